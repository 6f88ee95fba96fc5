"""What every layer stage is: its setup, the layer call it reads and rewrites, its hooks.

A *stage* is one mechanism family's part of an MoE layer call
(:meth:`workbench.runtime.offload.Offloader.layer`). It is built once per run by
:meth:`Stage.from_knobs` from the run's knob groups (each stage reads its own group's fields and
builds its mechanism: the dispatch policy, ReaLB's controller, MoE-Prism's setup) and what the
runtime gives it (:class:`RunContext`), or by :meth:`Stage.from_setup` from mechanism objects
made elsewhere (:class:`StageSetup`, the offloader's keyword arguments); None: its feature is
off, and the call never sees it. A stage defines only the hooks it needs; the runtime calls each hook of every stage in the order of
:data:`workbench.runtime.stages.STAGES`:

1. ``route(call)`` — rewrite the routing (``call.ids`` / ``call.weights``); a stage with
   ``before_mask`` sees the router's raw output for every row, the others the real tokens'
   (padding and finished requests already routed to the sentinel id E);
2. ``observe(call)`` — read the layer event and the real tokens' routing (``call.event``,
   ``call.real_ids``): lookahead, hotness, balance decisions;
3. ``price(call)`` — set what the cache looks up and the modeled compute of each key
   (``call.keys``, ``call.tokens``, ``call.compute_s``);
4. ``access(call, access)`` — add to the core's :class:`~workbench.sim.step.Access`
   (prefetches, a pre-eviction hook, host runs);
5. ``finish(call)`` — after the schedule ran: what the stage records of the call.

At install, ``runner(block, view)`` may wrap the view a layer's experts run through (and
``uninstall(block)`` undo what it changed of the model).

A stage may also take part in the run around the layer calls (:data:`RUN_HOOKS`, called by the
session): ``check_runtime`` / ``check_requests`` (refuse a model or a batch it cannot serve),
``provides`` (what the stages after it, and the session, read of it: :class:`RunContext`'s
fields), ``model_hooks`` (hooks of its own on the model for the run), ``step_ended`` (what it
changes of a step's event), ``record`` / ``store_attrs`` (what it writes into the result and the
store).

A stage *declares* what it needs (:attr:`Stage.needs`, on the class or, when it depends on
the stage's setup, on the instance); the runtime provides it and nothing else:
:data:`TOKEN_CONTEXT` (``call.modality`` / ``call.request``), :data:`ROUTER_LOGITS`
(``call.logits``). Per-run state (counters, a controller) lives in the stage; per-call state in the
:class:`LayerCall` handed to its hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from workbench.models.adapter import MoEBlock, MoELayout
from workbench.sim.costs import Prices
from workbench.runtime.view import RuntimeView
from workbench.telemetry.events import LayerEvent

if TYPE_CHECKING:
    from workbench.knobs import Knobs

#: what a stage may need of the runtime: each flattened position's modality and request
#: (:meth:`~workbench.runtime.offload.Offloader.set_token_mask`)
TOKEN_CONTEXT = "token_context"
#: what a stage may need of the runtime: the logits [T, E] the model's own router computed for
#: this layer call (``LayerCall.logits``), so that a stage reading every expert's probability
#: does not run the router again. They are the first element of the router module's output —
#: exactly what :meth:`~workbench.models.adapter.MoEBlock.route` returns on the experts'
#: input, for every supported architecture — for all T rows, padding included.
ROUTER_LOGITS = "router_logits"


@dataclass(frozen=True)
class StageSetup:
    """What a run gives its stages (the offloader's arguments; see
    :class:`~workbench.runtime.offload.Offloader`)."""

    layout: MoELayout
    pinned_layers: int
    prices: Prices
    device: torch.device
    lookahead_depth: int = 0
    active_evict: Any = None
    dynamic_topk: bool = False
    k_max: int | None = None
    prefetch: Any = None
    prefetch_lead: int = 1
    prefetch_budget: int | None = None
    pruning: Any = None
    hybrid: bool | Callable[[int], bool] = False
    dispatch: Any = None
    balance: Any = None
    rank_of_expert: np.ndarray | None = None
    low_precision: str = "nvfp4"
    prism: Any = None
    prism_offload: bool = False
    macs_centroids: torch.Tensor | None = None
    cache_routing: float | None = None  # Cache-Prior's λ (None: off)
    low_down_input: str = "quantised"  # the knob low_precision_down_input


@dataclass(frozen=True)
class RunContext:
    """What a run gives the stages it builds from knobs (:meth:`Stage.from_knobs`) beside the
    knobs: the :class:`~workbench.runtime.runtime.Runtime` (its model, the calibrations it
    reads, ReaLB's carried M_d), the modeled prices, the device, and the objects the session
    makes for other parts too (the prefetch policy, which the predictor attaches to; the token
    compression's placement, which its stage provides: :meth:`Stage.provides`)."""

    runtime: RuntimeView
    prices: Prices
    device: torch.device
    prefetch: Any = None
    prefetch_budget: int | None = None
    pruning: Any = None  # provided by the token compression stage (its placement)
    inputs: Any = None  # the run's ModelInputs (its tokens' modality, its input ids)

    @property
    def layout(self) -> MoELayout:
        return self.runtime.lm.layout


@dataclass(slots=True)
class LayerCall:
    """One MoE layer call as its stages see it. The runtime fills what it provides; the stages'
    hooks rewrite the routing and add what they decide (see the module docstring)."""

    block: MoEBlock
    hidden_states: torch.Tensor  # the MoE input [T, D], one row per flattened position
    ids: torch.Tensor  # routing [T, k] (id E: routed nowhere)
    weights: torch.Tensor  # combine weights [T, k]
    step: int
    pinned: bool
    mask: torch.Tensor | None = None  # real tokens, bool [T] on the device (None: all)
    real: np.ndarray | None = None  # the same on the host
    modality: np.ndarray | None = None  # per position of the step (TOKEN_CONTEXT; None: unknown)
    request: np.ndarray | None = None
    cache: Any = None  # the expert cache's bookkeeping (workbench.sim.cache.ExpertCache)
    part: int = 1  # cache keys per expert
    # the model's router's logits [T, E] for this call's T rows, as it computed them (its
    # dtype; ROUTER_LOGITS; None: not asked for, or the router's call was not this input's)
    logits: torch.Tensor | None = None
    # what the route hooks found, for the layer event
    dropped: np.ndarray | None = None  # [T, k] int16 experts the dispatch dropped (-1: kept)
    rerouted: np.ndarray | None = None  # [T, k] int16 experts rerouted away from
    token_weights: np.ndarray | None = None  # MACS semantic weights [T] (None: all 1)
    # the layer event and its distinct routed experts (ascending)
    event: LayerEvent | None = None
    experts: list[int] = field(default_factory=list)
    real_ids: np.ndarray | None = None  # the real tokens' recorded routing [T', k]
    # the next layers' routers on this input, real tokens only: top-k [T', D, k] int16 and
    # layer l+1's mean probabilities [E] (None: not asked for)
    pred: np.ndarray | None = None
    p_next: np.ndarray | None = None
    low: set[int] = field(default_factory=set)  # experts run in low precision
    low_precision: str = "native"  # theirs
    low_down_input: str = "quantised"  # their down projection's input: 'quantised' or 'native'
    # what the cache looks up: keys (experts, or sub-experts e·part + s), the tokens of each
    # (the hybrid rule's input), their modeled compute (None: the core prices the experts)
    keys: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    compute_s: list[float] | None = None
    key_ids: np.ndarray | None = None  # the real tokens' routing in keys (prefetch history)


class Stage:
    """Base of the layer stages (see the module docstring). A hook a subclass does not define
    is never called."""

    #: what the runtime must provide (:data:`TOKEN_CONTEXT`, :data:`ROUTER_LOGITS`)
    needs: frozenset[str] = frozenset()
    #: ``route`` runs on the router's raw output, before padding is masked
    before_mask: bool = False
    #: ``route`` may route an assignment nowhere (the sentinel id E)
    routes_nowhere: bool = False
    #: the run-result counters it keeps (attributes of the stage; 0 when it is off)
    COUNTS: tuple[str, ...] = ()
    #: cache keys per expert (> 1: the stage splits experts, and lays out the slots and the
    #: host store's rows: ``slot_shapes``, ``host_rows``)
    part: int = 1

    @classmethod
    def from_knobs(cls, knobs: "Knobs", run: RunContext) -> "Stage | None":
        """The stage of a run of ``knobs`` (its group's fields), or None when its feature is
        off."""
        return None

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "Stage | None":
        """The stage over mechanism objects made elsewhere, or None when its feature is off."""
        return None

    @classmethod
    def check_runtime(cls, knobs: "Knobs", lm) -> None:
        """Raise when a run of ``knobs`` cannot run on the loaded model ``lm`` (the Runtime
        checks every run's knobs so). The base accepts any."""

    @classmethod
    def check_requests(cls, knobs: "Knobs", n: int) -> None:
        """Raise :class:`~workbench.errors.InputError` when a run of ``knobs`` cannot serve a
        batch of ``n`` requests. The base serves any."""

    @classmethod
    def store_attrs(cls, result) -> dict[str, Any]:
        """What the run store's final attributes hold of the stage, from the run's result
        (asked of every class of :data:`STAGES`, on or off: the attributes are written
        either way)."""
        return {}

    def needs_at(self, step: int) -> frozenset[str]:
        """What the stage needs of the runtime in step ``step`` (0: the prefill): :attr:`needs`,
        unless it acts in some steps only (the offloader then provides no more than the
        step's stages ask for: no router hook where nobody reads the logits)."""
        return self.needs

    def provides(self) -> dict[str, Any]:
        """Fields of :class:`RunContext` the stage gives the stages after it (and the
        session: the predictor reads ``pruning``)."""
        return {}

    def model_hooks(self):
        """A context manager installing the stage's hooks on the model for the run (entered
        after the offloader's, before the predictor's), or None."""
        return None

    def step_ended(self, step: int, ev) -> None:
        """At the end of a step: what the stage changes of the step's event."""

    def record(self, result) -> None:
        """At the end of the run: what the stage writes into the run's result."""

    def counts(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.COUNTS}

    def store_dims(self) -> dict[str, int]:
        """The run store's dimensions the stage records along (e.g. ``ep_ranks``)."""
        return {}

    def max_added(self, num_experts: int) -> int:
        """The most assignments ``route`` may add to a token beyond its top-k (0: none)."""
        return 0

    def runner(self, block: MoEBlock, view):
        """At install: the view ``block``'s experts run through (wrapping ``view``)."""
        return view

    def uninstall(self, block: MoEBlock) -> None:
        """At removal: undo what :meth:`runner` changed of ``block``."""

    def route(self, call: LayerCall) -> None: ...

    def observe(self, call: LayerCall) -> None: ...

    def price(self, call: LayerCall) -> None: ...

    def access(self, call: LayerCall, access) -> None: ...

    def finish(self, call: LayerCall) -> None: ...


HOOKS = ("runner", "uninstall", "route", "observe", "price", "access", "finish")
#: the hooks the session calls around the layer calls (a stage's part in the run itself)
RUN_HOOKS = ("check_runtime", "check_requests", "store_attrs", "provides", "model_hooks",
             "step_ended", "record")


def hooked(stages, hook: str) -> list[Stage]:
    """The stages that define ``hook``, in order."""
    return [s for s in stages if getattr(type(s), hook) is not getattr(Stage, hook)]
