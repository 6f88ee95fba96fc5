"""Eviction policies for the expert cache.

One policy object serves the live runtime and trace replay alike: the cache calls
``on_hit`` / ``on_insert`` / ``on_evict`` as accesses happen and asks ``choose_victim`` for a slot
to free. Keys are ``(layer, expert)`` pairs; ``t`` is a logical access clock that only grows.

Register a new policy with ``@EVICTION.register("name")``: it then appears in the ``eviction``
knob's menu, the dashboard and ``--set eviction=name``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Hashable, Iterable

from workbench.knobs import CacheKnobs
from workbench.policies.registry import NeedsFlag, Registry
from workbench.predictor.knobs import PredictorKnobs

Key = Hashable


class EvictionPolicy(ABC):
    """Decides which resident expert to evict.

    Invariant: ``choose_victim`` returns one of ``candidates`` (the resident experts that may be
    evicted right now; the cache never passes experts the current layer still needs).
    """

    name: str = "abstract"
    #: what the policy needs beyond the accesses: "future" (trace replay only) or "predictor"
    #: (the live lookahead predictor, or a trace's recorded predictions)
    needs: frozenset[str] = frozenset()
    needs_future = NeedsFlag("future")
    needs_predictor = NeedsFlag("predictor")

    def __init__(self) -> None:
        """The knobs a policy takes are its ``__init__``'s keyword parameters (see
        :mod:`workbench.policies.registry`); the base takes none."""
        self.reset()

    def reset(self) -> None:
        """Forget all history (a new run)."""

    def begin_group(self, group: int, step: int) -> None:
        """A layer's accesses of ``step`` are about to be looked up (``group`` counts the
        (step, layer) groups served so far). Policies that keep time in steps use it."""

    @abstractmethod
    def on_hit(self, key: Key, t: int) -> None:
        """``key`` was used while resident."""

    @abstractmethod
    def on_insert(self, key: Key, t: int) -> None:
        """``key`` was loaded into the cache (and is about to be used)."""

    def on_evict(self, key: Key) -> None:
        """``key`` left the cache."""

    @abstractmethod
    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        """The candidate to evict."""


EVICTION: Registry[EvictionPolicy] = Registry("eviction", knob="eviction")


@EVICTION.register("lru")
class LRU(EvictionPolicy):
    """Least recently used: evict the candidate whose last use is oldest."""

    def reset(self) -> None:
        self.last_use: dict[Key, int] = {}

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t

    on_insert = on_hit

    def on_evict(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: self.last_use.get(k, -1))


@EVICTION.register("lfu")
class LFU(EvictionPolicy):
    """Least frequently used, counting every use since the run started ("perfect" LFU).

    Counts survive eviction, because an expert's popularity is a property of the model and the
    input, not of its stay in the cache. Ties go to the least recently used.
    """

    def reset(self) -> None:
        self.count: dict[Key, int] = {}
        self.last_use: dict[Key, int] = {}

    def on_hit(self, key: Key, t: int) -> None:
        self.count[key] = self.count.get(key, 0) + 1
        self.last_use[key] = t

    on_insert = on_hit

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: (self.count.get(k, 0), self.last_use.get(k, -1)))


@EVICTION.register("belady")
class Belady(EvictionPolicy):
    """Belady's MIN: evict the candidate whose next use is farthest in the future.

    The hit-rate ceiling of any eviction policy on a trace (with one key per access; with a
    whole layer's experts needed at once it is the classic heuristic form of MIN). It needs the
    future, so only trace replay can run it: replay calls :meth:`prepare` with the trace's
    access groups and :meth:`begin_group` before each group. Ties (e.g. never used again) go to
    the least recently used, then the smallest (layer, expert): its recency is LRU's own
    bookkeeping (the same methods), not a copy.
    """

    needs = frozenset({"future"})

    def reset(self) -> None:
        LRU.reset(self)
        self._occ: dict[Key, list[int]] = {}
        self._ptr: dict[Key, int] = {}
        self._group = 0

    def prepare(self, groups) -> None:
        """Index every key's access groups (``groups``: :class:`workbench.traces.trace.Groups`)."""
        import numpy as np

        g_of = np.repeat(np.arange(groups.num_groups), np.diff(groups.ptr))
        layer_of = np.repeat(groups.layer, np.diff(groups.ptr))
        occ: dict[Key, list[int]] = {}
        for g, l, e in zip(g_of.tolist(), layer_of.tolist(), groups.expert.tolist()):
            occ.setdefault((l, e), []).append(g)
        self._occ, self._ptr = occ, {k: 0 for k in occ}

    def begin_group(self, group: int, step: int) -> None:
        self._group = group

    def next_use(self, key: Key) -> float:
        """Index of the first group after the current one that uses ``key`` (inf: never)."""
        occ = self._occ.get(key)
        if not occ:
            return float("inf")
        i = self._ptr[key]
        while i < len(occ) and occ[i] <= self._group:
            i += 1
        self._ptr[key] = i
        return occ[i] if i < len(occ) else float("inf")

    on_hit, on_insert, on_evict = LRU.on_hit, LRU.on_insert, LRU.on_evict

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        if not self._occ:
            raise RuntimeError("belady needs the future: run it with trace replay "
                               "(workbench replay / workbench.replay)")
        return min(candidates, key=lambda k: (-self.next_use(k), self.last_use.get(k, -1), k))


@EVICTION.register("hotness")
class Hotness(EvictionPolicy):
    """Decayed hotness (ActiveEvict's history term): evict the candidate with the lowest
    u(e) = Σ γ^(now − s) over the steps s < now + 1 in the last ``window`` steps that used it.

    γ = knob ``hotness_decay`` ∈ (0, 1], T = knob ``hotness_window`` in steps (one decode step =
    one token). Ties go to the least recently used. The step comes from :meth:`begin_group`
    (the runtime and replay call it before each layer's accesses).
    """

    def __init__(self, hotness_decay: float = CacheKnobs.param.hotness_decay.default,
                 hotness_window: int = CacheKnobs.param.hotness_window.default) -> None:
        if not 0.0 < hotness_decay <= 1.0:
            raise ValueError(f"hotness_decay must be in (0, 1], not {hotness_decay}")
        if hotness_window < 1:
            raise ValueError(f"hotness_window must be at least 1 step, not {hotness_window}")
        self.decay, self.window = float(hotness_decay), int(hotness_window)
        super().__init__()

    def reset(self) -> None:
        self.last_use: dict[Key, int] = {}
        self.uses: dict[Key, list[int]] = {}  # steps that used the key, newest last, ≤ window
        self.step = 0

    def begin_group(self, group: int, step: int) -> None:
        self.step = step

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t
        u = self.uses.setdefault(key, [])
        if not u or u[-1] != self.step:
            u.append(self.step)
            if len(u) > self.window:
                del u[0]

    on_insert = on_hit

    def score(self, key: Key) -> float:
        return sum(self.decay ** (self.step - s) for s in self.uses.get(key, ())
                   if self.step - s < self.window)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: (self.score(k), self.last_use.get(k, -1)))


class SlabStates:
    """State bookkeeping of the VisMMOE slab cache (VisMMOE "Safety-guarded eviction").

    Fed once per (step, layer) by :meth:`begin_layer` with the lookahead predictor's ranked
    ``(expert, σ)`` pairs of y_layer; the window is then the keys ``(layer + d, e)`` for
    d = 1 … ``window`` and e in those pairs, with priority γ^(d−1)·σ_e (the order the ``vismmoe``
    prefetch policy fetches them in). :meth:`note_use` marks what the current layer routes.
    A resident key is

    - **Required** (``REQUIRED``): in the current window, or routed by the layer being computed;
    - **Speculative** (``SPECULATIVE``): not Required, its layer still ahead in this step, and
      predicted by an earlier window of this step or prefetched in this step (kept to absorb
      prediction shifts);
    - **Expired** (``EXPIRED``): neither (its layer finished for this token, or nothing
      predicted it).

    :meth:`victim` takes Expired keys only, lowest priority (the last predictor priority the key
    had; 0 if never predicted) first, ties least recently used, then the smallest key. When no
    candidate is Expired it falls back — counted in :attr:`fallbacks` — to the Speculative ones
    (same order), and only when every candidate is Required to the one farthest ahead in the
    window (largest d; ties lowest priority, LRU, key): the cache must free a slot, and the
    experts it protects for the current layer are never offered.
    """

    REQUIRED, SPECULATIVE, EXPIRED = "required", "speculative", "expired"

    def __init__(self, window: int = PredictorKnobs.param.window.default,
                 decay: float = PredictorKnobs.param.decay.default) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 layer, not {window}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], not {decay}")
        self.window, self.decay = int(window), float(decay)
        self.reset()

    def reset(self) -> None:
        self.step, self.layer = -1, -1
        self.required: dict[Key, float] = {}  # key → priority, current window
        self.routed: set[Key] = set()  # keys the current layer uses
        self.priority: dict[Key, float] = {}  # last priority a window gave each key
        self.ahead_step: dict[Key, int] = {}  # step in which a window named / prefetch loaded it
        self.last_use: dict[Key, int] = {}
        self.fallbacks = {"speculative": 0, "required": 0}
        self.victims = 0

    def begin_layer(self, step: int, layer: int, ranked) -> None:
        """Layer ``layer`` of ``step`` is being computed; ``ranked``: the predictor's
        ``(expert, score)`` pairs of y_layer (empty: no prediction)."""
        if (step, layer) == (self.step, self.layer):
            return
        self.step, self.layer = int(step), int(layer)
        self.routed = set()
        req: dict[Key, float] = {}
        for d in range(1, self.window + 1):
            w = self.decay ** (d - 1)
            for e, s in ranked:
                req[(layer + d, int(e))] = w * float(s)
        self.required = req
        for k, p in req.items():
            self.priority[k] = p
            self.ahead_step[k] = self.step

    def note_use(self, key: Key, t: int, inserted: bool = False) -> None:
        """``key`` was used (or loaded, ``inserted``) at access clock ``t``."""
        self.last_use[key] = t
        if key[0] == self.layer:
            self.routed.add(key)
        elif inserted and key[0] > self.layer:  # a prefetch for a layer still ahead
            self.ahead_step[key] = self.step

    def forget(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def state(self, key: Key) -> str:
        if key in self.required or key in self.routed:
            return self.REQUIRED
        if key[0] > self.layer and self.ahead_step.get(key) == self.step:
            return self.SPECULATIVE
        return self.EXPIRED

    def victim(self, candidates: Iterable[Key]) -> Key:
        by_state: dict[str, list[Key]] = {self.REQUIRED: [], self.SPECULATIVE: [],
                                          self.EXPIRED: []}
        for k in candidates:
            by_state[self.state(k)].append(k)
        self.victims += 1

        def low(k: Key):
            return (self.priority.get(k, 0.0), self.last_use.get(k, -1), k)

        if by_state[self.EXPIRED]:
            return min(by_state[self.EXPIRED], key=low)
        if by_state[self.SPECULATIVE]:
            self.fallbacks["speculative"] += 1
            return min(by_state[self.SPECULATIVE], key=low)
        if not by_state[self.REQUIRED]:
            raise ValueError("no candidate to evict")
        self.fallbacks["required"] += 1
        return min(by_state[self.REQUIRED],
                   key=lambda k: (-(k[0] - self.layer), self.required.get(k, 0.0),
                                  self.last_use.get(k, -1), k))


@EVICTION.register("slab")
class Slab(EvictionPolicy):
    """VisMMOE safety-guarded slab eviction: resident experts are Required (inside the lookahead
    predictor's window W, or routed by the current layer), Speculative or Expired
    (:class:`SlabStates`); only Expired experts are evicted, lowest predictor priority first.
    If no candidate is Expired it falls back to Speculative (lowest priority first), then to
    Required farthest ahead in the window, and counts it (``stats()``). Needs the predictor:
    live it reads the attached :class:`~workbench.predictor.policy.LivePredictor` (the runtime
    refuses ``eviction=slab`` without ``predictor=vismmoe``); replay reads the trace's recorded
    ``predicted_ids``/``predicted_scores`` (a trace without them leaves every window empty,
    which makes the policy LRU). Knobs ``window`` (W) and ``decay`` (γ)."""

    needs = frozenset({"predictor"})

    def __init__(self, window: int = PredictorKnobs.param.window.default,
                 decay: float = PredictorKnobs.param.decay.default) -> None:
        self.states = SlabStates(window, decay)
        self._layer_of = None
        self._predicted = None
        super().__init__()

    def reset(self) -> None:
        self.states.reset()

    # -- feeds -------------------------------------------------------------------------------
    def attach(self, live) -> None:
        """Live: ``live`` (a LivePredictor) calls back right after each layer's router."""
        live.listeners.append(lambda step, layer: self.states.begin_layer(
            step, layer, live.ranked(step, layer)))

    def prepare(self, groups) -> None:
        """Replay: the layer of every access group."""
        self._layer_of = groups.layer

    def attach_trace(self, trace) -> None:
        """Replay: the trace's recorded predictions (none: empty windows)."""
        self._predicted = trace.predicted if trace.predicted_ids is not None else None

    def begin_group(self, group: int, step: int) -> None:
        if group < 0 or self._layer_of is None:  # live: fed by the predictor's callback
            return
        layer = int(self._layer_of[group])
        ranked = self._predicted(step, layer) if self._predicted is not None else []
        self.states.begin_layer(step, layer, ranked)

    # -- cache calls -------------------------------------------------------------------------
    def on_hit(self, key: Key, t: int) -> None:
        self.states.note_use(key, t)

    def on_insert(self, key: Key, t: int) -> None:
        self.states.note_use(key, t, inserted=True)

    def on_evict(self, key: Key) -> None:
        self.states.forget(key)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return self.states.victim(candidates)

    def stats(self) -> dict[str, int]:
        """Victims chosen and how often no Expired candidate existed (the fallbacks)."""
        s = self.states
        return {"slab_victims": s.victims,
                "slab_fallback_speculative": s.fallbacks["speculative"],
                "slab_fallback_required": s.fallbacks["required"]}
