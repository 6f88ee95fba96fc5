"""What one run produced, as plain data (the CLI prints it, the store keeps it as JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from workbench.compression.policies import COMPRESSION
from workbench.policies.prefetch import PREFETCH
from workbench.sim.dispatch import DISPATCH
from workbench.sim.realb import balances


@dataclass
class RunResult:
    """What one run produced. Latencies: *measured* = wall time here, *modeled* = the
    hardware profile's timeline. ``hit_rate`` counts offloaded (non-pinned) layers only.
    A batch of requests: ``text``/``token_ids`` are request 0's and ``batch`` lists every
    request's ``{prompt, images, text, token_ids, prompt_tokens}`` (empty for one request);
    the counters and times are the whole batch's."""

    text: str
    token_ids: list[int]
    steps: int
    hits: int
    misses: int
    loads: int
    evictions: int
    latency_measured_s: float
    latency_modeled_s: float
    stall_measured_s: float
    stall_modeled_s: float
    prefill_measured_s: float
    prefill_modeled_s: float
    transfer_bytes: int
    transfer_bytes_modeled: int
    store: str | None
    knobs: dict[str, Any]
    model_id: str
    stopped: bool = False
    pre_evictions: int = 0  # ActiveEvict evictions ahead of demand (included in evictions)
    host_runs: int = 0  # hybrid mode: misses run on the host copy (in misses, not in loads)
    prefetches: int = 0  # experts the prefetch policy loaded (in loads)
    # prefetched experts evicted before any access used them: transfers that bought nothing
    # (the replay's ``redundant_transfers``; ones still resident at the end are not counted)
    redundant_prefetches: int = 0
    #: demand-first transfer order: prefetches cancelled before their copy started (their
    #: layer had run, or they were evicted first); issued in ``prefetches``, not in ``loads``
    cancelled_prefetches: int = 0
    #: capacity-aware dispatch (``dispatch`` ≠ topk): the router's (token, expert)
    #: assignments, and those the dispatch dropped (computed by no expert)
    dispatch_assigned: int = 0
    dispatch_dropped: int = 0
    #: MACS: assignments moved to a same-rank expert with room (not dropped)
    dispatch_rerouted: int = 0
    #: Expanded Drop: (token, expert) pairs added beyond the router's top-k
    dispatch_added: int = 0
    #: cache-aware routing (``cache_routing``): assignments moved to a resident expert
    cache_rerouted: int = 0
    #: ReaLB (``balance`` ≠ none): (layer call, expert) computations run in low precision
    low_precision_runs: int = 0
    #: MoE-Prism (prism=True): (token, sub-expert) runs the routed experts asked for (N per
    #: routed slot) and those that ran (k_active of them); 0 when off
    subexperts_asked: int = 0
    subexperts_ran: int = 0
    #: MoE-Prism: how the layer calls ran sub-experts — "fused" or "per-subexpert" (the
    #: ``prism_kernel`` knob, ``auto`` resolved), or "shortcut" (every sub-expert active:
    #: whole experts through the model's own forward, no sub-expert kernel); None when off
    prism_kernel: str | None = None
    # visual-token compression (compression ≠ none): visual tokens of the prompt and how many
    # reached the layers after the pinned prefix; measured seconds of the selection (prefix
    # routing + policy) and of the vision-saliency recomputation
    visual_tokens: int = 0
    kept_visual_tokens: int = 0
    compression_select_s: float = 0.0
    compression_saliency_s: float = 0.0
    # lookahead predictor (predictor or prefetch = vismmoe): measured seconds per call
    predictor_cost: dict[str, Any] = field(default_factory=dict)
    # the eviction policy's own counters (slab: victims and fallbacks), when it keeps any
    eviction_stats: dict[str, Any] = field(default_factory=dict)
    #: a batch's requests and answers (empty: a run of one request)
    batch: list[dict[str, Any]] = field(default_factory=list)
    #: expert parallelism (``ep_ranks`` > 1, a static placement, the run recorded): the EP
    #: summary of what it routed, summed as its store was written
    #: (:class:`~workbench.replay.ep.EPStream`: ``open_run(store).moe.ep_summary()``'s
    #: figures, bit for bit), set once the store is closed (after the session's
    #: ``on_result``); None otherwise. Not in :meth:`to_json` (nor the store's ``summary``):
    #: the CLI prints it as its ``ep`` section
    ep: dict[str, Any] | None = None

    @property
    def right(self) -> tuple[int, int]:
        """(answers equal to their expected one, requests with an expected answer) of a
        batch: exact match after stripping, as the model card counts."""
        known = [r for r in self.batch if r.get("expected") is not None]
        return sum(answer_matches(r) for r in known), len(known)

    @property
    def texts(self) -> list[str]:
        """Every request's answer, in batch order."""
        return [r["text"] for r in self.batch] if self.batch else [self.text]

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else float("nan")

    @property
    def loads_per_access(self) -> float:
        """Experts copied to the device per cache access (offloaded layers): 1 − hit rate for
        demand loading alone; above that, prefetching brought experts the run did not ask
        for at that access (over-fetch: a high hit rate bought with extra transfers)."""
        n = self.hits + self.misses
        return self.loads / n if n else float("nan")

    @property
    def redundant_share(self) -> float:
        """Share of the loads that were prefetched and evicted unused (0 without prefetch)."""
        return self.redundant_prefetches / self.loads if self.loads else 0.0

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "ep"}  # (the CLI prints it apart)
        d["hit_rate"] = None if np.isnan(self.hit_rate) else self.hit_rate
        d["loads_per_access"] = None if np.isnan(self.loads_per_access) else self.loads_per_access
        d["redundant_share"] = self.redundant_share
        return d

    def summary(self) -> str:
        hr = "n/a (no offloaded layer)" if np.isnan(self.hit_rate) else f"{self.hit_rate:.1%}"
        k = self.knobs
        lines = [
            f"answer: {self.text}",
            *(f"answer {i}: {r['text']}   ← {r['prompt']!r}"
              + (f" + {len(r['images'])} image(s)" if r["images"] else "")
              + (f"   expected: {r['expected']} {'✓' if answer_matches(r) else '✗'}"
                 if r.get("expected") is not None else "")
              for i, r in enumerate(self.batch)),
            *([f"right: {self.right[0]} of {self.right[1]} answers equal their expected one "
               f"(exact match)"] if self.right[1] else []),
            f"model {self.model_id} · "
            + (f"batch of {len(self.batch)} requests · " if self.batch else "")
            + f"{self.steps} steps (1 prefill + {self.steps - 1} decode) · "
            f"cache_slots={k.get('cache_slots')} pinned_layers={k.get('pinned_layers')} "
            f"eviction={k.get('eviction')}",
            f"expert cache: hit rate {hr} · {self.hits} hits, {self.misses} misses, "
            f"{self.loads} loads, {self.evictions} evictions"
            + ("" if np.isnan(self.loads_per_access) else
               f" · {self.loads_per_access:.2f} loads per access"
               + (f" ({self.loads - (self.misses - self.host_runs)} of the loads prefetched by "
                  f"{k.get('prefetch')}, beyond the demand loads of the misses; "
                  f"{self.redundant_prefetches} evicted unused = {self.redundant_share:.1%} of "
                  f"the loads)"
                  if _is(PREFETCH, k.get("prefetch"), "fetches") else ""))
            + (f" ({self.pre_evictions} ahead of demand)" if self.pre_evictions else "")
            + (f" · {self.host_runs} misses run on the host copy (hybrid)"
               if self.host_runs else ""),
            f"measured: {self.latency_measured_s * 1e3:.1f} ms total "
            f"(prefill {self.prefill_measured_s * 1e3:.1f} ms), stall "
            f"{self.stall_measured_s * 1e3:.2f} ms, {self.transfer_bytes / 1e6:.2f} MB moved",
            f"modeled ({k.get('profile')}, costs of {_costs_of(k)}): "
            f"{self.latency_modeled_s * 1e3:.1f} ms total (prefill "
            f"{self.prefill_modeled_s * 1e3:.1f} ms), stall {self.stall_modeled_s * 1e3:.1f} ms, "
            f"{self.transfer_bytes_modeled / 1e6:.1f} MB moved",
        ]
        lines += self._feature_lines(k)
        if self.store:
            lines.append(f"store: {self.store}")
        return "\n".join(lines)

    def _feature_lines(self, k: dict[str, Any]) -> list[str]:
        """The summary's lines of the features that are on (hybrid, compression, dispatch,
        MoE-Prism, balance)."""
        lines: list[str] = []
        if k.get("hybrid"):
            # why a hybrid run's numbers look as they do (issue 13): host runs move no expert
            # but the device waits for their result, which the modeled stall counts
            lines.append(
                f"hybrid: {self.host_runs} of {self.misses} misses ran on the host copy (no expert "
                f"moved for them; the modeled stall includes the device waiting for their results)"
                if self.host_runs else
                f"hybrid: no miss ran on the host: at these prices (profile {k.get('profile')}, costs "
                f"of {_costs_of(k)}) loading each missed expert ended sooner than running it "
                f"on the host; host runs pay off for large experts (e.g. target_model=qwen3-vl-30b-a3b) "
                f"with few tokens per miss (decode)")
        if _is(COMPRESSION, k.get("compression"), "prunes") and self.visual_tokens:
            lines.append(
                f"compression {k.get('compression')} (beta={k.get('beta')}, lam={k.get('lam')}): "
                f"kept {self.kept_visual_tokens}/{self.visual_tokens} visual tokens after "
                f"{k.get('pinned_layers')} pinned layers; selection "
                f"{self.compression_select_s * 1e3:.2f} ms, saliency "
                f"{self.compression_saliency_s * 1e3:.2f} ms (measured)")
        if _is(DISPATCH, k.get("dispatch"), "changes_routing"):
            share = self.dispatch_dropped / self.dispatch_assigned if self.dispatch_assigned else 0
            lines.append(f"dispatch {k.get('dispatch')} (capacity_factor "
                         f"{k.get('capacity_factor')}): dropped {self.dispatch_dropped} of "
                         f"{self.dispatch_assigned} expert assignments ({share:.1%})"
                         + (f", rerouted {self.dispatch_rerouted} "
                            f"({self.dispatch_rerouted / max(self.dispatch_assigned, 1):.1%})"
                            if _is(DISPATCH, k.get("dispatch"), "reroutes", False) else "")
                         + (f", added {self.dispatch_added} beyond the top-k (expanded "
                            f"candidates)" if _is(DISPATCH, k.get("dispatch"), "widens", False)
                            else ""))
        if self.prism_kernel is not None:
            which = (f"prism_k {k['prism_k']}" if k.get("prism_k") else
                     f"k_active {k.get('prism_k_active') or 'all'}")
            ran = (f"{self.subexperts_ran} of {self.subexperts_asked} (token, sub-expert) runs "
                   f"ran ({self.subexperts_ran / self.subexperts_asked:.0%})"
                   if self.subexperts_asked else "no (token, sub-expert) run asked")
            how = ("as whole experts (the shortcut)" if self.prism_kernel == "shortcut" else
                   f"by the {self.prism_kernel} kernel"
                   + (" (prism_kernel=auto)" if k.get("prism_kernel") == "auto" else ""))
            lines.append(f"prism ({which}): {ran}; sub-experts ran {how}")
        if "balance" in k and balances(k["balance"]):
            lines.append(f"balance {k.get('balance')} ({k.get('low_precision')}, emulated by "
                         f"fake_quant): {self.low_precision_runs} expert computations in low "
                         f"precision; priced at the {k.get('profile')} profile's rate where it "
                         f"has one (modeled)")
        return lines


def _is(registry, name: str | None, flag: str, unknown: bool = True) -> bool:
    """Whether the policy ``name`` of ``registry`` declares ``flag``; None (no such knob in the
    result): False; a name this version does not know: ``unknown``."""
    if name is None:
        return False
    return bool(getattr(registry.get(name), flag)) if name in registry else unknown


def _costs_of(knobs: dict[str, Any]) -> str:
    """Whose expert sizes the modeled clock prices: the target model, or the run's own."""
    target = knobs.get("target_model")
    return "this model" if target in (None, "none") else str(target)


def answer_matches(request: dict[str, Any]) -> bool:
    """A batch entry's answer (``text``) is its ``expected`` one: exact match after stripping
    surrounding white space, as the model card counts (False without an expected answer)."""
    e = request.get("expected")
    return isinstance(e, str) and str(request.get("text", "")).strip() == e.strip()
