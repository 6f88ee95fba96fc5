"""Events: what happened in one step, as plain data (no I/O, no torch).

The runtime fills a :class:`StepEvent` while a step runs; the recorder turns a batch of them into
xarray chunks and the modeled clock prices them. Times are seconds; measured times are relative to
the run's start (``perf_counter`` based), modeled times to the start of the modeled timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

#: modality codes carried by every routed token
MODALITIES: tuple[str, ...] = ("text", "image", "video")
TEXT, IMAGE, VIDEO = 0, 1, 2
#: step phases
PHASES: tuple[str, ...] = ("prefill", "decode")
#: lanes of a timeline
LANES: tuple[str, ...] = ("compute", "transfer", "stall", "host")
CLOCKS: tuple[str, ...] = ("measured", "modeled")


@dataclass
class LayerEvent:
    """Routing and cache outcome of one MoE layer in one step.

    ``topk_ids``/``topk_weights`` are ``[T, k]`` for the T tokens of the step (rank order as the
    router returned them; k is the k the layer really used, see ``dynamic_topk``).
    ``hits``/``misses`` are expert ids (each counted once per layer-step) of the expert-cache
    lookups of an offloaded layer. A ``pinned`` layer makes no lookup: the recorder books its
    distinct routed experts (from ``topk_ids``) as the store's ``pinned_accesses`` and ignores
    its ``hits``/``misses`` (the runtime lists every routed expert in ``hits``, as the modeled
    clock expects). ``expert_tokens`` maps
    expert → routed-token count. ``evicted`` are keys evicted on demand to admit this layer's
    misses; ``pre_evicted`` are keys ActiveEvict evicted ahead of demand while this layer ran
    (both are booked on the evicted expert's layer); ``prefetched`` are keys the prefetch
    policy copied ahead of need while this layer ran. ``pred_ids`` is ``[T, D, k]`` (int16, -1 =
    none): the routers of layers ``layer + 1 … layer + D`` applied to this layer's MoE input
    (router lookahead), or ``None`` when lookahead is off. ``host`` are misses that GPU–CPU
    hybrid mode ran on the host copy instead of loading (a subset of ``misses``, same order).
    ``dropped_ids`` is ``[T, k]`` (int16, -1 = none) or ``None``: the experts a capacity-aware
    dispatch took from each token (their slots in ``topk_ids`` read -1).
    """

    layer: int
    pinned: bool
    topk_ids: np.ndarray
    topk_weights: np.ndarray
    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    evicted: list[tuple[int, int]] = field(default_factory=list)
    pre_evicted: list[tuple[int, int]] = field(default_factory=list)
    prefetched: list[tuple[int, int]] = field(default_factory=list)
    host: list[int] = field(default_factory=list)
    pred_ids: np.ndarray | None = None
    expert_tokens: dict[int, int] = field(default_factory=dict)
    dropped_ids: np.ndarray | None = None
    #: [T, k] (int16, -1 = none) or None: the expert a rerouting dispatch (MACS) moved each
    #: slot away from (the slot's ``topk_ids`` holds the expert it moved to)
    rerouted_ids: np.ndarray | None = None
    #: [T] float32 or None: MACS's semantic weight w(x) of each token at this layer (the
    #: effective load's units; None: every token weighs 1)
    token_weights: np.ndarray | None = None
    #: experts ReaLB ran in low precision at this layer call (empty: none)
    low_precision: list[int] = field(default_factory=list)
    #: ReaLB's decision at this layer call (``workbench.sim.realb.ReaLBDecision``: per-rank
    #: ``low``, ``m``, ``ib``, ``vision`` and ``gated``), or None: no controller
    realb: Any = None
    #: MoE-Prism: [T, k, w] int16, the sub-experts each routed slot ran, -1 padding (w =
    #: k_active, or N with a global K); None: prism off (each expert one sub-expert)
    sub_chosen: np.ndarray | None = None
    stall_s: float = 0.0


class Span(NamedTuple):
    """One interval on a timeline lane (``clock`` measured or modeled). A named tuple: a run
    makes one per modeled key computed and copied (≈ 15 000 in a batch-8 run caching
    sub-experts), so they are built and stored column by column at C speed."""

    clock: int  # index into CLOCKS
    lane: int  # index into LANES
    step: int
    layer: int  # -1 when not tied to a layer
    expert: int  # -1 when not tied to an expert
    start: float
    end: float


@dataclass
class StepEvent:
    """Everything recorded about one forward pass (a prefill or one decode token)."""

    step: int
    phase: int  # index into PHASES
    token_ids: np.ndarray  # [T] input ids of this step's tokens
    modality: np.ndarray  # [T] int8 codes into MODALITIES
    layers: list[LayerEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    step_start_s: float = 0.0  # measured, relative to run start
    latency_measured_s: float = 0.0
    stall_measured_s: float = 0.0
    latency_modeled_s: float = 0.0
    stall_modeled_s: float = 0.0
    transfer_bytes: int = 0
    transfer_bytes_modeled: int = 0
    residency: np.ndarray | None = None  # bool [L, E] at the end of the step
    generated_token: int = -1  # the token chosen after this step (-1 if none)
    # bool [T]: the token reached every layer (False: a visual token pruned after the pinned
    # prefix by token compression; its routing on later layers is -1 / 0). None = all True.
    kept: np.ndarray | None = None
    # the lookahead predictor's outputs (set from LivePredictor.step_predictions when it ran):
    # ``predicted_ids`` int16 [L, B], per MoE layer y_l's top-B expert ids best first (-1 where
    # the predictor did not run for the layer), ``predicted_scores`` float32 [L, B] their
    # σ(y_l) scores (the vismmoe prefetch policy orders by γ^(d−1)·score). None: no predictor.
    predicted_ids: np.ndarray | None = None
    predicted_scores: np.ndarray | None = None
    #: [T] int16: the request of the run's batch each token belongs to (None: all request 0)
    request: np.ndarray | None = None
    #: the tokens chosen after this step, one per request of the batch (``generated_token`` is
    #: request 0's); empty: not known
    generated_tokens: list[int] = field(default_factory=list)

    def keep_tokens(self, valid: np.ndarray) -> None:
        """Keep only the tokens where ``valid`` (bool [T]) is True, in every per-token array
        of the step and of its layers (a batch's padding and finished requests: positions
        the model computed that are no request's tokens)."""
        valid = np.asarray(valid, bool)
        self.token_ids = np.asarray(self.token_ids)[valid]
        self.modality = np.asarray(self.modality)[valid]
        if self.request is not None:
            self.request = np.asarray(self.request)[valid]
        if self.kept is not None:
            self.kept = np.asarray(self.kept)[valid]
        for le in self.layers:
            le.topk_ids = np.asarray(le.topk_ids)[valid]
            le.topk_weights = np.asarray(le.topk_weights)[valid]
            if le.pred_ids is not None:
                le.pred_ids = le.pred_ids[valid]
            if le.dropped_ids is not None:
                le.dropped_ids = le.dropped_ids[valid]
            if le.rerouted_ids is not None:
                le.rerouted_ids = le.rerouted_ids[valid]
            if le.token_weights is not None:
                le.token_weights = le.token_weights[valid]
            if le.sub_chosen is not None:
                le.sub_chosen = le.sub_chosen[valid]
