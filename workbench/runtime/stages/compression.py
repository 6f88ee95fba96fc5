"""Visual-token compression on the live runtime: where VisMMOE's pruning runs in a run.

The selection (the ``COMPRESSION`` policies, :mod:`workbench.compression.policies`) and the
model hooks that run the pinned prefix on the full stream and every later layer on the kept
tokens (:class:`~workbench.compression.placement.PrunedPlacement`) live in
:mod:`workbench.compression`; this stage is everything a run does with them:

- **checks**: a pruning policy needs a Qwen3-VL-MoE vision model (:meth:`check_runtime`, when
  the Runtime checks a run's knobs) and a batch of one request (:meth:`check_requests`);
- **setup** (:meth:`from_knobs`): the policy from its knob group; a placement only when the
  policy prunes and the request has visual tokens (text only: nothing to prune, the stage is
  off); the placement is *provided* to the later stages and the predictor as ``pruning``
  (:meth:`provides`: the router lookahead restricts its predictions to the kept tokens);
- **install** (:meth:`model_hooks`): the placement's hooks, entered after the offloader's and
  before the predictor's (the declared order of :mod:`workbench.models.hooks`);
- **per step** (:meth:`step_ended`): the prefill's event put back at the original token
  positions (pruned tokens -1);
- **result** (:meth:`record`, :meth:`store_attrs`): the visual and kept token counts and the
  selection's measured seconds.

It has no layer-call hook: a layer call of a run with compression costs what one without does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.compression.placement import PrunedPlacement, check_supported
from workbench.compression.policies import COMPRESSION, CompressionKnobs
from workbench.errors import InputError
from workbench.runtime.stages.base import RunContext, Stage

if TYPE_CHECKING:
    from workbench.knobs import Knobs
    from workbench.telemetry.events import StepEvent


class TokenCompression(Stage):
    """The request's visual-token pruning behind the pinned prefix (module docstring)."""

    def __init__(self, placement: PrunedPlacement) -> None:
        self.placement = placement

    @classmethod
    def check_runtime(cls, knobs: "Knobs", lm) -> None:
        if COMPRESSION.get(knobs.compression).prunes:
            check_supported(lm.model)

    @classmethod
    def check_requests(cls, knobs: "Knobs", n: int) -> None:
        if n > 1 and COMPRESSION.get(knobs.compression).prunes:
            raise InputError(f"compression={knobs.compression!r} prunes the visual tokens of "
                             f"one request; a batch of {n} requests needs "
                             f"compression='none' (or run the requests one at a time)")

    @classmethod
    def from_knobs(cls, knobs: "Knobs", run: RunContext) -> "TokenCompression | None":
        group: CompressionKnobs = knobs.group("compression")
        comp = COMPRESSION.get(group.compression).from_knobs(knobs)  # from its group's fields
        inputs = run.inputs
        if not comp.prunes or inputs is None or not bool((inputs.modality != 0).any()):
            return None  # text only: no pruning
        model = run.runtime.lm.model
        check_supported(model, inputs.input_ids)
        pinned = knobs.group("cache").pinned_layers
        return cls(PrunedPlacement(model, run.layout, pinned, comp))

    def provides(self) -> dict[str, Any]:
        return {"pruning": self.placement}

    def model_hooks(self):
        return self.placement

    def step_ended(self, step: int, ev: "StepEvent") -> None:
        if step == 0:
            self.placement.scatter_event(ev)

    def record(self, result) -> None:
        placement = self.placement
        result.visual_tokens = placement.num_visual
        result.kept_visual_tokens = (int(placement.kept_visual.numel())
                                     if placement.kept_visual is not None else 0)
        result.compression_select_s = placement.select_s
        result.compression_saliency_s = placement.saliency_s

    @classmethod
    def store_attrs(cls, result) -> dict[str, Any]:
        return dict(compression_visual_tokens=result.visual_tokens,
                    compression_kept_visual_tokens=result.kept_visual_tokens,
                    compression_select_s=result.compression_select_s,
                    compression_saliency_s=result.compression_saliency_s)
