"""The run store's schema: every variable, its dims, dtype, chunking, units and doc, declared once.

The recorder (:mod:`workbench.telemetry.store`) writes exactly these, the reader
(:mod:`workbench.telemetry.reader`) checks a store against them (an older store against
:func:`disk_schema` of its version, then presents it in the current names and meaning), and the
docs table is generated from them.

Invariants of the cache counters (per step and layer): on an offloaded layer ``hits + misses``
is the number of distinct routed experts (those that ran a sub-expert under MoE-Prism's global
``prism_k``; the distinct sub-experts run when the cache holds sub-experts, ``prism_offload``,
and ``loads``, ``evictions`` and ``pinned_accesses`` count them too) and ``pinned_accesses`` is
0; on a pinned layer
``pinned_accesses`` is that number and ``hits`` = ``misses`` = 0. So ``hits.sum()`` is the run's
cache hits (``RunResult.hits``) and ``(hits + misses + pinned_accesses).sum()`` every access.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: 2: chunk keys "c.0.0" (readers need nothing new: zarr reads both). 3: every chunk inside the
#: committed extent has a file (a missing one is corruption, never zeros) and the root attrs
#: list the store's ``arrays``. 4: the predictor's order dim is ``pred_order`` (was ``rank``);
#: ``hits``/``misses`` count expert-cache lookups only (offloaded layers) and the accesses the
#: pinned prefix served are ``pinned_accesses`` (schema ≤ 3 booked them as ``hits``).
#: 5: ``dispatch_dropped`` (a store of schema ≤ 4 had no dispatch: it reads 0).
#: 6: ``token_request`` (a store of schema ≤ 5 served one request: it reads 0) and
#: ``dispatch_rerouted`` (no rerouting dispatch before: it reads 0) and ``effective_load``
#: (MACS's semantic-weighted load; before: every token weighed 1, it reads ``routed_tokens``)
#: and ``low_precision`` (ReaLB; before: every expert native, it reads False).
#: 7: ReaLB's per-rank state ``realb_low``/``realb_m``/``realb_ib``/``realb_vision`` [step,
#: layer, ep_rank] and ``realb_gated`` [step, layer] (before: no controller; ep_rank has size 1,
#: the floats read NaN, the flags False).
#: 8: MoE-Prism's ``subexpert_tokens`` [step, layer, expert, subexpert, modality] and
#: ``subexpert_ran`` [token, layer, k, subexpert] (before: no sub-experts; ``subexpert`` has
#: size 1, they read ``routed_tokens`` and ``topk_ids ≥ 0``: each expert one sub-expert that
#: every routed token ran).
#: :func:`workbench.open_run` presents every older store in the current names and meaning.
SCHEMA_VERSION = 8
#: the dim of ReaLB's per-rank state: the run's ``ep_ranks`` when ``balance`` ≠ none, else 1
EP_RANK = "ep_rank"
#: the dim of MoE-Prism's sub-experts: the refactoring's N when ``prism`` is on, else 1 (the
#: whole expert)
SUBEXPERT = "subexpert"
#: the dim of the lookahead predictor's top-B, best first (``predicted_ids``/``_scores``)
PRED_ORDER = "pred_order"
#: what schema ≤ 3 named :data:`PRED_ORDER` on disk
LEGACY_PRED_ORDER = "rank"
GROWING = ("step", "token", "span")
INITIAL_CAPACITY = {"step": 1024, "token": 16384, "span": 16384}


@dataclass(frozen=True)
class Var:
    """One stored variable: dims (first one grows), dtype, chunk length along the growing dim,
    units and a one-line description (the docs table is generated from these)."""

    dims: tuple[str, ...]
    dtype: str
    chunk: int
    units: str
    doc: str


SCHEMA: dict[str, Var] = {
    # -- per step ------------------------------------------------------------------------------
    "phase": Var(("step",), "int8", 1024, "code", "0 = prefill, 1 = decode (attrs phase_names)"),
    "step_tokens": Var(("step",), "int32", 1024, "tokens", "tokens processed by the step"),
    "step_start_s": Var(("step",), "float64", 1024, "s (measured)", "step start since run start"),
    "latency_measured_s": Var(("step",), "float64", 1024, "s (measured)", "wall time of the step"),
    "latency_modeled_s": Var(("step",), "float64", 1024, "s (modeled)",
                             "step time on the modeled timeline under the hardware profile"),
    "stall_measured_s": Var(("step",), "float64", 1024, "s (measured)",
                            "compute time spent waiting for expert transfers"),
    "stall_modeled_s": Var(("step",), "float64", 1024, "s (modeled)",
                           "compute-lane wait for transfers on the modeled timeline"),
    "transfer_bytes": Var(("step",), "int64", 1024, "bytes (measured)",
                          "bytes copied host→device by the live runtime"),
    "transfer_bytes_modeled": Var(("step",), "int64", 1024, "bytes (modeled)",
                                  "loads × expert bytes of the cost model (target model if set)"),
    "generated_token": Var(("step",), "int64", 1024, "token id",
                           "token chosen after the step (-1: none)"),
    # -- per step × layer ----------------------------------------------------------------------
    "hits": Var(("step", "layer"), "int32", 256, "experts",
                "expert-cache lookups that found the routed expert resident (offloaded layers "
                "only; 0 on pinned layers, see pinned_accesses)"),
    "misses": Var(("step", "layer"), "int32", 256, "experts",
                  "expert-cache lookups that did not (offloaded layers only; 0 on pinned layers)"),
    "pinned_accesses": Var(("step", "layer"), "int32", 256, "experts",
                           "routed experts served by the pinned (always resident) prefix, no "
                           "cache lookup (pinned layers only; 0 on offloaded layers)"),
    "loads": Var(("step", "layer"), "int32", 256, "experts", "experts copied into a cache slot"),
    "evictions": Var(("step", "layer"), "int32", 256, "experts",
                     "experts of this layer evicted during the step"),
    "stall_layer_measured_s": Var(("step", "layer"), "float64", 256, "s (measured)",
                                  "stall inside the layer"),
    "pre_evictions": Var(("step", "layer"), "int32", 256, "experts",
                         "experts of this layer evicted ahead of demand by ActiveEvict "
                         "(included in evictions)"),
    "prefetches": Var(("step", "layer"), "int32", 256, "experts",
                      "experts prefetched while this layer ran (the copies also count in the "
                      "loads of their own layer)"),
    "host_runs": Var(("step", "layer"), "int32", 256, "experts",
                     "misses GPU–CPU hybrid mode ran on the host copy instead of loading "
                     "(included in misses, not in loads)"),
    "topk_used": Var(("step", "layer"), "int16", 256, "experts",
                     "experts per token the layer computed: top-k, or the k chosen by "
                     "dynamic_topk (0: layer did not run)"),
    "predicted_ids": Var(("step", "layer", PRED_ORDER), "int16", 256, "expert id",
                         "lookahead predictor (predictor/prefetch = vismmoe): the top-B experts "
                         "of y_layer, best first (-1: predictor off or did not run for the "
                         "layer; pred_order has size 1 when off)"),
    "predicted_scores": Var(("step", "layer", PRED_ORDER), "float32", 256, "score",
                            "σ(y_layer) of predicted_ids (0 where the id is -1); the vismmoe "
                            "prefetch orders its candidates by decay^(d−1)·score"),
    # -- per step × layer × expert -------------------------------------------------------------
    "routed_tokens": Var(("step", "layer", "expert", "modality"), "int32", 32, "tokens",
                         "tokens routed to the expert, split by modality"),
    "dispatch_dropped": Var(("step", "layer", "expert", "modality"), "int32", 32, "tokens",
                            "tokens a capacity-aware dispatch took from the expert (dispatch ≠ "
                            "topk; their topk_ids read -1), split by modality"),
    "dispatch_rerouted": Var(("step", "layer", "expert", "modality"), "int32", 32, "tokens",
                             "tokens a rerouting dispatch (MACS) moved away from the expert to a "
                             "same-rank expert with room (their topk_ids hold the new expert), "
                             "split by modality"),
    "effective_load": Var(("step", "layer", "expert", "modality"), "float32", 32,
                          "weighted tokens",
                          "MACS's effective load: the semantic weights w(x) of the tokens "
                          "routed to the expert (= routed_tokens when no dispatch weighs "
                          "tokens), split by modality"),
    "subexpert_tokens": Var(("step", "layer", "expert", SUBEXPERT, "modality"), "int32", 32,
                            "tokens",
                            "tokens that ran the sub-expert (MoE-Prism, prism on: each routed "
                            "token runs prism_k_active of its expert's N sub-experts, or its K "
                            "best of its routed experts' with prism_k; off: subexpert has "
                            "size 1 and this equals routed_tokens), split by modality"),
    "low_precision": Var(("step", "layer", "expert"), "bool", 32, "flag",
                         "the expert ran in low precision at the step's layer call (ReaLB: "
                         "balance ≠ none; the precision is the knob low_precision)"),
    # -- per step × layer × EP rank (ReaLB, balance ≠ none) ------------------------------------
    "realb_low": Var(("step", "layer", EP_RANK), "bool", 256, "flag",
                     "ReaLB put the rank's experts in low precision at the step's layer call "
                     "(the knob low_precision; the rank's experts are in low_precision)"),
    "realb_m": Var(("step", "layer", EP_RANK), "float32", 256, "ratio",
                   "M_d, the vision-ratio threshold the decision used (AIMD state before "
                   "its update; NaN: no controller, or the layer did not run)"),
    "realb_ib": Var(("step", "layer", EP_RANK), "float32", 256, "ratio",
                    "IB_d = the rank's load / the mean rank load of the layer call (NaN: no "
                    "controller)"),
    "realb_vision": Var(("step", "layer", EP_RANK), "float32", 256, "ratio",
                        "R_vd, the visual share of the rank's assignments (NaN: no controller)"),
    "realb_gated": Var(("step", "layer"), "bool", 256, "flag",
                       "the LB gate let ReaLB act: the layer call's aggregate load > realb_gate"),
    "resident": Var(("step", "layer", "expert"), "bool", 32, "flag",
                    "expert in a cache slot or pinned at the end of the step"),
    # -- per routed token ----------------------------------------------------------------------
    "token_id": Var(("token",), "int64", 4096, "token id", "input id of the token"),
    "token_step": Var(("token",), "int32", 4096, "step", "step that processed the token"),
    "token_modality": Var(("token",), "int8", 4096, "code",
                          "0 text, 1 image, 2 video (coordinate modality)"),
    "token_request": Var(("token",), "int16", 4096, "request",
                         "the request of the run's batch the token belongs to (0 … batch_size − "
                         "1; a batch's padding is not stored)"),
    "kept": Var(("token",), "bool", 4096, "flag",
                "token reached every layer; False: a visual token pruned after the pinned prefix "
                "by token compression (its topk_ids there are -1, topk_weights 0)"),
    "topk_ids": Var(("token", "layer", "k"), "int16", 1024, "expert id",
                    "routed experts in the router's rank order"),
    "topk_weights": Var(("token", "layer", "k"), "float32", 1024, "weight",
                        "combine weights of the routed experts"),
    "subexpert_ran": Var(("token", "layer", "k", SUBEXPERT), "bool", 1024, "flag",
                         "the routed slot ran the sub-expert of its expert (MoE-Prism: "
                         "prism_k_active of N per slot, or the token's K best with prism_k; "
                         "off: subexpert has size 1 and it is topk_ids ≥ 0)"),
    "pred_ids": Var(("token", "layer", "depth", "k"), "int16", 1024, "expert id",
                    "router lookahead: the router of layer (layer + depth) applied to this "
                    "layer's MoE input, in its rank order (-1: none, past the last layer or "
                    "lookahead off)"),
    # -- timeline ------------------------------------------------------------------------------
    "span_clock": Var(("span",), "int8", 4096, "code", "0 measured, 1 modeled"),
    "span_lane": Var(("span",), "int8", 4096, "code", "0 compute, 1 transfer, 2 stall, 3 host"),
    "span_step": Var(("span",), "int32", 4096, "step", "step of the interval"),
    "span_layer": Var(("span",), "int16", 4096, "layer", "MoE layer (-1: none)"),
    "span_expert": Var(("span",), "int16", 4096, "expert", "expert (-1: none)"),
    "span_start_s": Var(("span",), "float64", 4096, "s", "interval start (clock's own origin)"),
    "span_end_s": Var(("span",), "float64", 4096, "s", "interval end"),
}


#: variables each schema version added (absent from the files of older stores)
ADDED_IN = {"pinned_accesses": 4, "dispatch_dropped": 5, "token_request": 6,
            "dispatch_rerouted": 6, "effective_load": 6, "low_precision": 6,
            "realb_low": 7, "realb_m": 7, "realb_ib": 7, "realb_vision": 7, "realb_gated": 7,
            "subexpert_tokens": 8, "subexpert_ran": 8}
#: dimensions with a coordinate array of their own (an index; ``depth`` counts from 1;
#: ``modality`` the names), current names
INDEX_DIMS = ("layer", "expert", "k", "depth", PRED_ORDER, "modality", EP_RANK, SUBEXPERT)


def disk_dim(dim: str, version: int) -> str:
    """The name a store of schema ``version`` gives on disk to the current dim ``dim``."""
    return LEGACY_PRED_ORDER if dim == PRED_ORDER and version < 4 else dim


def disk_schema(version: int) -> dict[str, Var]:
    """The variables as a store of schema ``version`` (1 … :data:`SCHEMA_VERSION`) holds them
    in its files: dims under their on-disk names, variables added later left out. The reader
    checks a store against this, then presents it as :data:`SCHEMA`."""
    if version >= SCHEMA_VERSION:
        return SCHEMA
    return {name: replace(v, dims=tuple(disk_dim(d, version) for d in v.dims))
            for name, v in SCHEMA.items() if ADDED_IN.get(name, 0) <= version}


#: every entry of a run store's root folder but the root document and the writer's own hidden
#: files (the marker that lets ``--overwrite`` delete a folder: nothing else may be in it); the
#: names of every schema version, so that a new run may replace an old store
STORE_ENTRIES = (*SCHEMA, "pinned", *INDEX_DIMS, LEGACY_PRED_ORDER)
