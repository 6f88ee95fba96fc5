"""Eviction policies for the expert cache.

One policy object serves the live runtime and trace replay alike: the cache calls
``on_hit`` / ``on_insert`` / ``on_evict`` as accesses happen and asks ``choose_victim`` for a slot
to free. Keys are ``(layer, expert)`` pairs; ``t`` is a logical access clock that only grows.

Register a new policy with ``@EVICTION.register("name")``: it then appears in the ``eviction``
knob's menu, the dashboard and ``--set eviction=name``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Hashable, Iterable

from workbench.knobs import CacheKnobs
from workbench.policies.registry import NeedsFlag, Registry, declared_kwargs
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
    #: the cache's size and key space (:meth:`bind_cache`; None until a cache binds the policy)
    num_slots: int | None = None
    num_layers: int | None = None
    num_experts: int | None = None

    def __init__(self) -> None:
        """The knobs a policy takes are its ``__init__``'s keyword parameters (see
        :mod:`workbench.policies.registry`); the base takes none."""
        self.reset()

    @classmethod
    def from_knobs(cls, knobs) -> "EvictionPolicy":
        """The policy of a run of ``knobs`` (a :class:`~workbench.knobs.Knobs`): a policy that
        takes knobs reads its group's fields; the base gives ``__init__`` the knobs it declares
        (:func:`~workbench.policies.registry.declared_kwargs`)."""
        return cls(**declared_kwargs(cls, knobs))

    def reset(self) -> None:
        """Forget all history (a new run)."""

    def begin_group(self, group: int, step: int) -> None:
        """A layer's accesses of ``step`` are about to be looked up (``group`` counts the
        (step, layer) groups served so far). Policies that keep time in steps use it."""

    def begin_layer(self, layer: int) -> None:
        """The group about to be served is ``layer``'s (called right after
        :meth:`begin_group`, pinned layers included). Policies that use the layer order use it."""

    def bind_cache(self, num_slots: int, num_layers: int, num_experts: int) -> None:
        """The cache this policy serves holds ``num_slots`` keys of ``num_layers`` ×
        ``num_experts`` (called once, by :class:`~workbench.sim.cache.ExpertCache`; survives
        :meth:`reset`). Policies whose queues are sized by the cache (ARC, S3-FIFO) use it."""
        self.num_slots, self.num_layers, self.num_experts = num_slots, num_layers, num_experts

    def before_admit(self, key: Key, t: int) -> None:
        """``key`` is about to be given a slot (a demand miss or a prefetch), before any
        victim is chosen for it. Policies whose eviction depends on the incoming key (ARC's
        ghost hits, S3-FIFO's ghost queue) use it."""

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

    def victim(self, resident: dict, protected: set, t: int) -> Key:
        """The key to evict among ``resident`` (the cache's keys, in the order they were
        admitted) less ``protected`` (some key is not protected): :meth:`choose_victim` of
        those candidates, in that order. A policy may answer faster without listing them
        (:class:`LRU`), with the same key."""
        return self.choose_victim([k for k in resident if k not in protected], t)


EVICTION: Registry[EvictionPolicy] = Registry("eviction", knob="eviction")
#: the policy whose hit rate is the ceiling replay reports a run's share of (Belady's MIN)
CEILING = "belady"


@EVICTION.register("lru")
class LRU(EvictionPolicy):
    """Least recently used: evict the candidate whose last use is oldest."""

    def reset(self) -> None:
        #: each key's last use; while :attr:`_ordered`, also in the order of those uses
        #: (oldest first: a use moves its key to the end), so the least recent key is the first
        self.last_use: dict[Key, int] = {}
        self._ordered = True  # False once a use did not come after the one before (a tie)
        self._last_t: int | None = None  # the latest use's t

    def on_hit(self, key: Key, t: int) -> None:
        last_use = self.last_use
        if self._ordered:
            if self._last_t is not None and t <= self._last_t:  # a tie may come: scans now
                self._ordered = False
            else:
                self._last_t = t
                last_use.pop(key, None)  # (re-inserted last)
        last_use[key] = t

    on_insert = on_hit

    def on_evict(self, key: Key) -> None:
        self.last_use.pop(key, None)

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: self.last_use.get(k, -1))

    def victim(self, resident: dict, protected: set, t: int) -> Key:
        """:meth:`choose_victim`'s key without a scan of the cache (a scan was ≈ 15 % of a
        live offloaded run of the embedded model, and most of one caching sub-experts:
        cProfile): the first key of :attr:`last_use`, in the order of last use, that is
        resident and not protected — the layer's protected keys were just used, so it is
        nearly always the first. Equal because the cache's clock gives every use its own
        ``t`` (checked: once a use does not come after the last one, every choice scans): the
        least recent unprotected key is unique. A resident key with no recorded use (a reset
        with keys resident) sorts first, in admission order: then the scan too, as for a
        subclass with a ``choose_victim`` of its own. (A heap of uses did this until stop 58:
        ≈ 2× the time per use.)"""
        if (not self._ordered or len(self.last_use) != len(resident)
                or type(self).choose_victim is not LRU.choose_victim):  # (a subclass's own)
            return super().victim(resident, protected, t)
        for k in self.last_use:
            if k not in protected and k in resident:
                return k
        return super().victim(resident, protected, t)


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


@EVICTION.register("belady-horizon")
class BeladyHorizon(Belady):
    """Belady's MIN that sees only the next ``belady_horizon`` layer turns ((step, layer)
    groups): how much of the future an eviction policy must know to get Belady's hits. A
    candidate used again within the horizon is ranked by that use (the farthest goes first);
    the others, whose next use it cannot see, go before them, least recently used first (the
    tie rule of :class:`Belady`). So a horizon of 0 evicts as LRU does and one past the
    trace's end as Belady does. An oracle (it needs the future): trace replay only, and never
    an online policy."""

    def __init__(self, belady_horizon: int = CacheKnobs.param.belady_horizon.default) -> None:
        if belady_horizon < 0:
            raise ValueError(f"belady_horizon must be at least 0 layer turns, not {belady_horizon}")
        self.horizon = int(belady_horizon)
        super().__init__()

    def next_use(self, key: Key) -> float:
        """Belady's next use of ``key`` when it lies within the horizon, else inf (unseen)."""
        g = super().next_use(key)
        return g if g - self._group <= self.horizon else float("inf")


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

    @classmethod
    def from_knobs(cls, knobs) -> "Hotness":
        cache: CacheKnobs = knobs.group("cache")
        return cls(cache.hotness_decay, cache.hotness_window)
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


def _oldest(queue: "OrderedDict[Key, object]", allowed: set) -> Key | None:
    """The oldest key of ``queue`` (insertion order) that is in ``allowed`` (None: none)."""
    for k in queue:
        if k in allowed:
            return k
    return None


@EVICTION.register("arc")
class ARC(EvictionPolicy):
    """ARC, Adaptive Replacement Cache (Megiddo & Modha, FAST '03), as libCacheSim's
    ``ARC.c`` runs it with unit-size objects: T1 (seen once recently) and T2 (seen at least
    twice) are LRU lists of residents, B1 and B2 their ghosts (evicted keys, no slot), and the
    target size ``p`` of T1 adapts — up by max(|B2|/|B1|, 1) on a hit in B1, down by
    max(|B1|/|B2|, 1) on a hit in B2 (a float, as libCacheSim). A miss found in a ghost enters
    T2, any other miss T1; a hit moves the key to T2's head.

    REPLACE evicts T1's LRU key into B1 if T1 is non-empty and (|T1| > p, or |T1| = p and the
    incoming key was in B2), or if T2 is empty; else T2's LRU key into B2. A miss in no list
    (case IV) first trims: if |T1| + |B1| would exceed c, drop B1's LRU key and REPLACE (or, B1
    empty, evict T1's LRU key with no ghost); else if all four lists hold 2c keys, drop B2's
    LRU key; then REPLACE. c = the cache's slots (:meth:`bind_cache`).

    With a whole layer protected (keys the current layer still needs are not candidates), a
    list's "LRU key" is its least recently used *candidate*; a list with none gives way to the
    other. A key freed without a victim choice (a pre-eviction, ActiveEvict's) enters its
    list's ghost, as REPLACE would move it. Flat traces (one key per access) have no protected
    keys: hits equal libCacheSim's (``tests/test_eviction_zoo.py``).
    """

    def reset(self) -> None:
        self.t1: OrderedDict[Key, None] = OrderedDict()  # LRU first, MRU last
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self.p = 0.0
        self._ghost = 0  # 1 / 2: the key being admitted was found in B1 / B2
        self._no_ghost: Key | None = None  # the victim leaves without a ghost entry

    def _c(self) -> int:
        return self.num_slots if self.num_slots else len(self.t1) + len(self.t2)

    def on_hit(self, key: Key, t: int) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def before_admit(self, key: Key, t: int) -> None:
        self._ghost = 0
        if key in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), float(self._c()))
            del self.b1[key]
            self._ghost = 1
        elif key in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            del self.b2[key]
            self._ghost = 2

    def on_insert(self, key: Key, t: int) -> None:
        (self.t2 if self._ghost else self.t1)[key] = None
        self._ghost = 0

    def _replace(self, allowed: set, in_b2: bool) -> Key:
        n1 = len(self.t1)
        first, second = self.t1, self.t2
        if not ((n1 > 0 and (n1 > self.p or (n1 == self.p and in_b2))) or not self.t2):
            first, second = second, first
        k = _oldest(first, allowed)
        if k is None:
            k = _oldest(second, allowed)
        if k is None:
            raise ValueError("no candidate to evict")
        return k

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        allowed = set(candidates)
        self._no_ghost = None
        if self._ghost:  # cases II and III
            return self._replace(allowed, self._ghost == 2)
        c = self._c()
        if len(self.t1) + len(self.b1) + 1 > c:  # case IV A: L1 = T1 ∪ B1 has c keys
            if self.b1:
                self.b1.popitem(last=False)
                return self._replace(allowed, False)
            k = _oldest(self.t1, allowed)
            if k is not None:
                self._no_ghost = k
                return k
            return self._replace(allowed, False)
        if len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)  # case IV B
        return self._replace(allowed, False)

    def on_evict(self, key: Key) -> None:
        ghost = key != self._no_ghost
        self._no_ghost = None
        if key in self.t1:
            del self.t1[key]
            if ghost:
                self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            if ghost:
                self.b2[key] = None


@EVICTION.register("s3fifo")
class S3FIFO(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP '23), as libCacheSim's ``S3FIFO.c`` (Dec 2024 version) runs
    it with unit-size objects: a small FIFO S of ⌊0.1·c⌋ keys, a main FIFO M of the rest
    (a CLOCK with a 2-bit counter) and a ghost FIFO G of ⌊0.9·c⌋ evicted keys (no slots).

    - a hit adds 1 to the key's count;
    - a miss found in G enters M; any other miss enters S — or M while nothing has been
      evicted yet and S is full; a new key's count is 0;
    - eviction takes from M if M holds more than its share or S is empty, else from S;
    - from S: its oldest key moves to M (count 0) if its count is ≥ 2
      (``move-to-main-threshold``), and the next oldest is examined; the first with a
      smaller count is evicted into G (G drops its oldest when full);
    - from M: its oldest key, if its count is ≥ 1, goes back to M's head with
      count min(count, 3) − 1; the first with count 0 is evicted.

    c = the cache's slots (:meth:`bind_cache`). With a whole layer protected, keys that are not
    candidates are passed over where they stand (a queue with no candidate gives way to the
    other); a key freed without a victim choice (a pre-eviction) leaves no ghost entry.
    libCacheSim admits nothing into an S of at most one key (c < 20): there this policy still
    admits (into S), so hits equal libCacheSim's from 20 slots on
    (``tests/test_eviction_zoo.py``).
    """

    SMALL, GHOST, THRESHOLD = 0.10, 0.90, 2

    def reset(self) -> None:
        self.small: OrderedDict[Key, int] = OrderedDict()  # oldest first → count
        self.main: OrderedDict[Key, int] = OrderedDict()
        self.ghost: OrderedDict[Key, None] = OrderedDict()
        self.evicted_any = False
        self._from_ghost = False

    def _sizes(self) -> tuple[float, float, int]:
        """(S's size, M's size, G's size); before a cache binds the policy: unbounded S."""
        if not self.num_slots:
            return float("inf"), float("inf"), 0
        c = self.num_slots
        small = int(c * self.SMALL)
        return small, c - small, int(c * self.GHOST)

    def on_hit(self, key: Key, t: int) -> None:
        if key in self.small:
            self.small[key] += 1
        elif key in self.main:
            self.main[key] += 1

    def before_admit(self, key: Key, t: int) -> None:
        self._from_ghost = key in self.ghost
        if self._from_ghost:
            del self.ghost[key]

    def on_insert(self, key: Key, t: int) -> None:
        small, _, _ = self._sizes()
        if self._from_ghost or (not self.evicted_any and len(self.small) >= small):
            self.main[key] = 0
        else:
            self.small[key] = 0
        self._from_ghost = False

    def _evict_main(self, allowed: set) -> Key | None:
        while True:
            k = _oldest(self.main, allowed)
            if k is None:
                return None
            f = self.main[k]
            if f < 1:
                return k
            self.main.move_to_end(k)
            self.main[k] = min(f, 3) - 1

    def _evict_small(self, allowed: set) -> Key | None:
        while True:
            k = _oldest(self.small, allowed)
            if k is None:
                return None
            if self.small[k] < self.THRESHOLD:
                _, _, g = self._sizes()
                if g > 0:
                    if len(self.ghost) >= g:
                        self.ghost.popitem(last=False)
                    self.ghost[k] = None
                return k
            del self.small[k]
            self.main[k] = 0

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        allowed = set(candidates)
        self.evicted_any = True
        _, main, _ = self._sizes()
        if len(self.main) > main or not self.small:
            k = self._evict_main(allowed)
            if k is None:
                k = self._evict_small(allowed)
        else:
            k = self._evict_small(allowed)
            if k is None:
                k = self._evict_main(allowed)
        if k is None:
            raise ValueError("no candidate to evict")
        return k

    def on_evict(self, key: Key) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)


class _LayerCycle(EvictionPolicy):
    """Shared bookkeeping of the layer-order policies: the layer being served
    (:meth:`begin_layer`), the number of layers L (:meth:`bind_cache`, else the largest layer
    seen + 1) and each key's last use on the access clock (LRU ties)."""

    def reset(self) -> None:
        self.layer = 0
        self.seen_layers = 0
        self.last_use: dict[Key, int] = {}

    def begin_layer(self, layer: int) -> None:
        self.layer = int(layer)
        self.seen_layers = max(self.seen_layers, self.layer + 1)

    def layers(self) -> int:
        return max(self.num_layers or 0, self.seen_layers, 1)

    def ahead(self, key: Key) -> int:
        """Groups until ``key``'s layer is served again, counting the current layer's next
        turn as L (1 … L): the layer-cyclic distance of a decode step."""
        L = self.layers()
        return (key[0] - self.layer - 1) % L + 1

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t

    on_insert = on_hit

    def on_evict(self, key: Key) -> None:
        self.last_use.pop(key, None)


@EVICTION.register("least-stale")
class LeastStale(_LayerCycle):
    """Least-Stale (SpecMD, arXiv 2602.03921), **as defined here from what could be verified**:
    the paper's text was not available to this implementation, only its abstract (an eviction
    policy built on MoE's layer-cyclic, predictable expert access). The rule implemented is the
    layer-cyclic one that abstract names: every token walks the layers in order, so a resident
    expert of layer j is next needed no sooner than j's next turn; evict the candidate whose
    layer's next turn is farthest (:meth:`ahead`: the layer just served first, then the one
    before it, …), ties to the least recently used, then the smallest key. Online: it needs
    only the layer being served."""

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        return min(candidates, key=lambda k: (-self.ahead(k), self.last_use.get(k, -1), k))


@EVICTION.register("reuse-eta")
class ReuseETA(_LayerCycle):
    """Expected time to the next use (this workbench's design, issue 40): Belady's rule —
    evict the key needed farthest ahead — with the future replaced by what a decode trace
    makes predictable: the layer order and how routing decays with age.

    Every token walks the layers in order, so a resident key (j, e) is next needed at one of
    layer j's turns: the next one is :meth:`ahead` groups away (1 … L), later ones L groups
    apart. Whether the router picks e at a turn depends on e's *age* a — the turns of layer j
    since e last ran there (0: it ran at the latest one) — through a hazard h(a), the share of
    (key, turn) pairs at age a that ran, learned online from every offloaded layer's turns
    (ages ≥ ``AGE_CAP`` pooled; smoothed by one pseudo-turn at the overall rate). With the
    expected turns to wait W(a) = (1 − h(a))·(1 + W(a + 1)), W(cap) = (1 − h)/h, a key's
    expected wait is ahead + L·W(a) groups; the candidate with the largest is evicted, ties to
    the least recently used, then the smallest key. A key never used at its layer counts as
    age ``AGE_CAP``. Online: the layer being served and past accesses only (no lookahead, no
    future). Uses are the current layer's hits and loads (a prefetch is not a use).
    """

    AGE_CAP = 16

    def reset(self) -> None:
        super().reset()
        self.turn: dict[int, int] = {}  # layer → turns served (the current one included)
        self.last_turn: dict[int, dict[int, int]] = {}  # layer → expert → turn of last use
        self.ran = [0] * (self.AGE_CAP + 1)  # per age: (key, turn) pairs that ran
        self.seen = [0] * (self.AGE_CAP + 1)  # per age: (key, turn) pairs observed

    def begin_layer(self, layer: int) -> None:
        super().begin_layer(layer)
        n = self.turn.get(layer, 0)
        for u in self.last_turn.get(layer, {}).values():
            self.seen[min(n - u - 1, self.AGE_CAP)] += 1
        self.turn[layer] = n + 1

    def on_hit(self, key: Key, t: int) -> None:
        self.last_use[key] = t
        j, e = key
        if j != self.layer or j not in self.turn:
            return
        n = self.turn[j] - 1
        known = self.last_turn.setdefault(j, {})
        u = known.get(e)
        if u is not None and u < n:
            self.ran[min(n - u - 1, self.AGE_CAP)] += 1
        known[e] = n

    on_insert = on_hit

    def waits(self) -> list[float]:
        """W(a), a = 0 … ``AGE_CAP``: expected turns until a key of age a runs."""
        A = self.AGE_CAP
        h0 = (sum(self.ran) + 1) / (sum(self.seen) + 2)
        h = [min(max((self.ran[a] + h0) / (self.seen[a] + 1), 1e-6), 1.0) for a in range(A + 1)]
        w = [0.0] * (A + 1)
        w[A] = (1.0 - h[A]) / h[A]
        for a in range(A - 1, -1, -1):
            w[a] = (1.0 - h[a]) * (1.0 + w[a + 1])
        return w

    def age(self, key: Key) -> int:
        u = self.last_turn.get(key[0], {}).get(key[1])
        if u is None:
            return self.AGE_CAP
        return min(max(self.turn.get(key[0], 0) - u - 1, 0), self.AGE_CAP)

    def wait(self, key: Key, w: list[float] | None = None) -> float:
        """Expected groups until ``key`` is next used."""
        w = self.waits() if w is None else w
        return self.ahead(key) + self.layers() * w[self.age(key)]

    def choose_victim(self, candidates: Iterable[Key], t: int) -> Key:
        w = self.waits()
        return min(candidates, key=lambda k: (-self.wait(k, w), self.last_use.get(k, -1), k))


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


    @classmethod
    def from_knobs(cls, knobs) -> "Slab":
        pred: PredictorKnobs = knobs.group("predictor")
        return cls(pred.window, pred.decay)
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
