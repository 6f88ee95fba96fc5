"""The run store's schema: every variable, its dims, dtype, chunking, units and doc, declared once.

The recorder (:mod:`workbench.telemetry.store`) writes exactly these, the reader
(:mod:`workbench.telemetry.reader`) checks a store against them, and the docs table is generated
from them.
"""

from __future__ import annotations

from dataclasses import dataclass

#: 2: chunk keys "c.0.0" (readers need nothing new: zarr reads both). 3: every chunk inside the
#: committed extent has a file (a missing one is corruption, never zeros) and the root attrs
#: list the store's ``arrays``
SCHEMA_VERSION = 3
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
                "routed experts already resident (pinned layers: all)"),
    "misses": Var(("step", "layer"), "int32", 256, "experts", "routed experts not resident"),
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
    "predicted_ids": Var(("step", "layer", "rank"), "int16", 256, "expert id",
                         "lookahead predictor (predictor/prefetch = vismmoe): the top-B experts "
                         "of y_layer, best first (-1: predictor off or did not run for the "
                         "layer; rank has size 1 when off)"),
    "predicted_scores": Var(("step", "layer", "rank"), "float32", 256, "score",
                            "σ(y_layer) of predicted_ids (0 where the id is -1); the vismmoe "
                            "prefetch orders its candidates by decay^(d−1)·score"),
    # -- per step × layer × expert -------------------------------------------------------------
    "routed_tokens": Var(("step", "layer", "expert", "modality"), "int32", 32, "tokens",
                         "tokens routed to the expert, split by modality"),
    "resident": Var(("step", "layer", "expert"), "bool", 32, "flag",
                    "expert in a cache slot or pinned at the end of the step"),
    # -- per routed token ----------------------------------------------------------------------
    "token_id": Var(("token",), "int64", 4096, "token id", "input id of the token"),
    "token_step": Var(("token",), "int32", 4096, "step", "step that processed the token"),
    "token_modality": Var(("token",), "int8", 4096, "code",
                          "0 text, 1 image, 2 video (coordinate modality)"),
    "kept": Var(("token",), "bool", 4096, "flag",
                "token reached every layer; False: a visual token pruned after the pinned prefix "
                "by token compression (its topk_ids there are -1, topk_weights 0)"),
    "topk_ids": Var(("token", "layer", "k"), "int16", 1024, "expert id",
                    "routed experts in the router's rank order"),
    "topk_weights": Var(("token", "layer", "k"), "float32", 1024, "weight",
                        "combine weights of the routed experts"),
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


#: every entry of a run store's root folder but the root document and the writer's own hidden
#: files (the marker that lets ``--overwrite`` delete a folder: nothing else may be in it)
STORE_ENTRIES = (*SCHEMA, "pinned", "layer", "expert", "k", "depth", "rank", "modality")
