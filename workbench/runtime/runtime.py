"""The live offloaded runtime: one request in, an answer, a summary and a run store out.

A :class:`Runtime` is a loaded model and default knobs. ``Runtime.run`` checks the run's knobs
against the model and hands the run to a :class:`~workbench.runtime.session.RunSession` (all
per-run state; the Runtime itself never changes during a run, so runs are re-entrant; the one
exception, asked for by a knob, is ReaLB's M_d carried under ``realb_carry``, owned by
:class:`~workbench.sim.realb.RealbCarry`). The
session wraps ``model.generate`` (the model's own generation loop, greedy by default) with
three things that are always removed afterwards, whatever happens:

- the :class:`~workbench.runtime.offload.Offloader` (experts in the host store, a slot cache);
- a forward pre/post hook on the model that marks step boundaries (one step = one forward pass:
  the prefill, then one per decode token);
- a streamer that receives each generated token, closes that step's event and hands it to the
  recorder (zarr store) and to the caller's ``on_token``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from workbench.errors import InputError, KnobError, ModelLoadError
from workbench.knobs import Knobs, ModelShape, show_value
from workbench.models.inputs import ModelInputs, Request
from workbench.models.loading import LoadedModel, load
from workbench.options import get_options
from workbench.predictor.knobs import DEFAULT_BUDGET, PredictorKnobs
from workbench.runtime.clocks import layout_cost_spec
from workbench.runtime.device import device_budget
from workbench.runtime.heap import frozen_heap
from workbench.runtime.threads import threads_for_run
from workbench.runtime.result import RunResult
from workbench.runtime.session import RunSession
from workbench.runtime.stages import STAGES
from workbench.sim.costs import CostSpec
from workbench.sim.dispatch import DISPATCH, Dispatch
from workbench.sim.plan import MemoryPlan
from workbench.sim.profiles import get_profile, get_target_model
from workbench.sim.realb import RealbCarry
from workbench.telemetry.store import check_store_path

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class Runtime:
    """A loaded model + knobs; ``run`` serves one request with experts offloaded.

    >>> rt = Runtime()                                    # the embedded default model
    >>> res = rt.run("what color is the circle?", images=["data/demo/scene_0.png"])
    """

    def __init__(self, model: LoadedModel | str | Path | None = None,
                 knobs: Knobs | Mapping[str, Any] | None = None, **knob_values: Any) -> None:
        """``model``: a :class:`LoadedModel`, a checkpoint folder (str or path) or None (the
        embedded model). ``knobs``: a :class:`Knobs`, or a mapping of knob values
        (``{"cache_slots": 8}``); ``knob_values`` override either. Other types raise
        :class:`ModelLoadError` / :class:`KnobError`."""
        if model is not None and not isinstance(model, (LoadedModel, str, os.PathLike)):
            raise ModelLoadError(f"model must be a checkpoint folder (a str or path), a loaded "
                                 f"model (workbench.load) or None for the embedded model, not "
                                 f"{type(model).__name__}")
        if isinstance(knobs, Knobs):
            base = knobs.copy()
        elif knobs is None:
            base = Knobs()
        elif isinstance(knobs, Mapping):
            bad = [k for k in knobs if not isinstance(k, str)]
            if bad:
                raise KnobError(f"knobs must map knob names (str) to values, not "
                                f"{bad[0]!r} ({type(bad[0]).__name__})")
            base = Knobs(**dict(knobs))
        else:
            raise KnobError(f"knobs must be a workbench.Knobs or a dict of knob values, not "
                            f"{type(knobs).__name__}")
        self.knobs = base.set(**knob_values)
        #: ReaLB's M_d carried across runs (knob realb_carry): the one state runs share,
        #: owned by RealbCarry and handed to each run's session
        self.realb_carry = RealbCarry()
        #: ``(the files' identity, MacsCalibration)`` last loaded by :meth:`macs_calibration`:
        #: every run checks its knobs, then sets up, and both read the calibration
        self._macs_loaded: tuple | None = None
        #: (the files' identity, the MoE-Prism refactoring read from them): see
        #: :meth:`prism_refactoring`
        self._prism_loaded: tuple | None = None
        if isinstance(model, LoadedModel):
            self.lm = model
        else:
            self.lm = load(model, dtype=self.knobs.dtype, device=self.knobs.device)
        self._check()

    # -- plan ------------------------------------------------------------------------------
    def _check(self, knobs: Knobs | None = None) -> None:
        knobs = knobs if knobs is not None else self.knobs
        lay = self.lm.layout
        knobs.check(ModelShape.of(lay))  # every group's rules (knobs.py and the features')
        for stage in STAGES:  # what a stage needs of the model (e.g. compression: Qwen3-VL)
            stage.check_runtime(knobs, self.lm)
        self._check_vision(knobs)
        if self.uses_predictor(knobs):
            self.predictor(knobs)
        # what a run reads beside the model, checked now (not when the first run sets up): a
        # sweep checks every point's knobs so, before any point starts
        if knobs.prism:
            self.prism_refactoring(knobs)
        self.macs_calibration(knobs)
        # the valid prefix interval (VisMMOE eq. 10), on the profile first, then here
        live, modeled = self.plans(knobs)
        modeled.check_pinned()
        live.check_pinned()

    def _check_vision(self, knobs: Knobs) -> None:
        """What calibrates on visual tokens is refused on a text-only model, with the knobs
        that turn it off (its calibration commands refuse such a model too)."""
        if self.lm.is_vision:
            return
        name = self.lm.model_id
        if self.uses_predictor(knobs):
            raise KnobError(f"the lookahead predictor (VisMMOE) is calibrated on visual tokens; "
                            f"model {name!r} is text-only: set predictor=none and a prefetch "
                            f"other than vismmoe")
        if self.dispatch(knobs).calibration_needed():
            raise KnobError(f"MACS's dynamic capacity and rerouting read a calibration of visual "
                            f"and text experts; model {name!r} is text-only: set "
                            f"macs_dynamic_capacity=false and macs_reroute=false, or another "
                            f"dispatch")

    @staticmethod
    def dispatch(knobs: Knobs) -> Dispatch:
        """The dispatch policy of a run of ``knobs`` (its Expert parallel group's fields)."""
        return DISPATCH.get(knobs.dispatch).for_knobs(knobs.group("ep"), knobs.seed)

    def macs_calibration(self, knobs: Knobs, policy: Dispatch | None = None) -> Any:
        """The MACS calibration a run of ``knobs`` reads (a dispatch policy that asks for
        one, :meth:`~workbench.sim.dispatch.Dispatch.calibration_needed`: MACS with dynamic
        capacity or rerouting; the ``macs_calibration`` folder, else the model's default),
        checked against this model; None when the run needs none. ``policy``: the run's, when
        made already. The runtime keeps the one it loaded (every run reads it twice: the knob
        check, then the set-up) until either file is rewritten or replaced, so the object is
        shared: its arrays are read-only."""
        if not (policy or self.dispatch(knobs)).calibration_needed():
            return None
        from workbench.macs.calibration import CONFIG, WEIGHTS, default_path, load

        lm = self.lm
        path = Path(knobs.macs_calibration or default_path(lm.path, lm.config_hash))

        def read() -> Any:
            cfg = getattr(lm.model.config, "text_config", None) or lm.model.config
            hidden = getattr(cfg, "hidden_size", None)
            return load(path, lm.layout.num_layers, lm.layout.num_experts, lm.config_hash,
                        hidden_size=int(hidden) if hidden else None)

        return self._kept("_macs_loaded", path, (CONFIG, WEIGHTS), read,
                          lambda cal: (cal.classes, cal.delta, cal.freq_visual,
                                       cal.freq_text, cal.centroids, cal.counts))

    def prism_refactoring(self, knobs: Knobs) -> tuple[Any, int]:
        """The MoE-Prism refactoring a run of ``knobs`` (``prism=True``) reads and its
        k_active, checked (:func:`workbench.prism.refactor.for_run`). As with
        :meth:`macs_calibration`, the runtime keeps the refactoring it read (every run reads
        it twice: the knob check, then the set-up; ≈ 1.2 ms each) until either file is
        rewritten or replaced, so the object is shared: its arrays are read-only."""
        from workbench.prism.refactor import CONFIG, WEIGHTS, for_run, load

        def kept(path: Path, lm: Any) -> Any:  # (load checks it against this model)
            return self._kept("_prism_loaded", path, (CONFIG, WEIGHTS),
                              lambda: load(path, lm),
                              lambda ref: (ref.perm, ref.gates, ref.tokens,
                                           *ref.objective.values()))

        return for_run(self.lm, knobs, kept)

    def _kept(self, slot: str, path: Path, files: tuple[str, ...], read: Callable[[], Any],
              arrays: Callable[[Any], Any]) -> Any:
        """``read()`` of folder ``path``, kept in attribute ``slot`` as ``(the files'
        identity, the object)`` until one of ``files`` is rewritten or replaced (or the model
        changes): the object is then shared by every run that reads it, so ``arrays(obj)``
        are made read-only. A file that cannot be stat'ed is not kept (``read`` says what is
        missing)."""
        from workbench.fileio import file_identity

        try:  # the files as they are now: a rewritten or replaced one is read again
            key = (str(path), self.lm.config_hash, *(file_identity(path / f) for f in files))
        except OSError:
            key = None
        held = getattr(self, slot)
        if key is not None and held is not None and held[0] == key:
            return held[1]
        obj = read()
        if key is not None:
            for a in arrays(obj):
                a.setflags(write=False)
            setattr(self, slot, (key, obj))
        return obj

    @staticmethod
    def uses_predictor(knobs: Knobs) -> bool:
        """Whether a run of ``knobs`` runs the lookahead predictor."""
        return PredictorKnobs.in_use(knobs)

    @staticmethod
    def prefetch_budget(knobs: Knobs) -> int | None:
        """``prefetch_budget``; None means the prefetch policy's own ``default_budget`` when it
        declares one (vismmoe: the predictor's B = 20)."""
        if knobs.prefetch_budget is None:
            return getattr(knobs.group("prefetch").selected("prefetch"), "default_budget", None)
        return knobs.prefetch_budget

    @classmethod
    def predictor_budget(cls, knobs: Knobs) -> int:
        """B: how many experts of y_l the live predictor keeps (and the store records)."""
        return cls.prefetch_budget(knobs) or DEFAULT_BUDGET

    def predictor(self, knobs: Knobs):
        """The calibrated lookahead predictor of ``knobs`` (loaded once per path), checked
        against this model's MoE layout."""
        from workbench.predictor.model import load as load_predictor
        from workbench.predictor.policy import default_path

        path = Path(knobs.predictor_path) if knobs.predictor_path else \
            default_path(self.lm.path, self.lm.config_hash)
        cache = self.__dict__.setdefault("_predictors", {})
        if path not in cache:
            # checked against this model (layers, experts, config hash) before it is built
            cache[path] = load_predictor(path, model=self.lm)
        return cache[path]

    def cost_spec(self, knobs: Knobs | None = None) -> CostSpec:
        k = knobs if knobs is not None else self.knobs
        if k.target_model != "none":
            return CostSpec.from_target(get_target_model(k.target_model))
        return layout_cost_spec(self.lm.layout, _DTYPE_BYTES[k.dtype])

    def plans(self, knobs: Knobs | None = None) -> tuple[MemoryPlan, MemoryPlan]:
        """(live plan of this model here, modeled plan of the cost model on the profile), of
        ``knobs`` (default: this runtime's), each with its valid pinned-prefix interval."""
        k, lay = (knobs if knobs is not None else self.knobs), self.lm.layout
        slots = self.num_slots(k)
        live = MemoryPlan(
            label=f"live plan ({self.lm.device})", num_layers=lay.num_layers,
            num_experts=lay.num_experts, pinned_layers=k.pinned_layers, slots=slots,
            expert_bytes=lay.expert_bytes, backbone_bytes=lay.backbone_bytes,
            budget_bytes=device_budget(self.lm.device), semantic_layers=k.semantic_floor(),
            reserve_slots=k.reserve_slots(lay.top_k))
        cost = self.cost_spec(k)
        prof = get_profile(k.profile)
        if k.target_model != "none":
            t = get_target_model(k.target_model)
            modeled = MemoryPlan(
                label=f"modeled plan ({t.name} on {prof.name})", num_layers=t.num_layers,
                num_experts=t.num_experts, pinned_layers=min(k.pinned_layers, t.num_layers),
                slots=min(k.effective_slots(int(cost.expert_bytes)),
                          (t.num_layers - min(k.pinned_layers, t.num_layers)) * t.num_experts),
                expert_bytes=cost.expert_bytes, backbone_bytes=t.backbone_bytes,
                budget_bytes=prof.device_memory_bytes, semantic_layers=k.semantic_floor(),
                reserve_slots=k.reserve_slots(t.top_k))
        else:
            modeled = MemoryPlan(
                label=f"modeled plan ({self.lm.model_id} on {prof.name})",
                num_layers=lay.num_layers, num_experts=lay.num_experts,
                pinned_layers=k.pinned_layers, slots=slots, expert_bytes=cost.expert_bytes,
                backbone_bytes=lay.backbone_bytes * _DTYPE_BYTES[k.dtype] / max(
                    _DTYPE_BYTES[self.lm.dtype], 1),
                budget_bytes=prof.device_memory_bytes, semantic_layers=k.semantic_floor(),
                reserve_slots=k.reserve_slots(lay.top_k))
        return live, modeled

    def num_slots(self, knobs: Knobs | None = None) -> int:
        k, lay = (knobs if knobs is not None else self.knobs), self.lm.layout
        if k.pinned_layers >= lay.num_layers:
            return 0
        offloaded = (lay.num_layers - k.pinned_layers) * lay.num_experts
        return min(k.effective_slots(lay.expert_bytes), offloaded)

    def info(self) -> dict[str, Any]:
        live, modeled = self.plans()
        return {"model": str(self.lm.path), "model_id": self.lm.model_id,
                "config_hash": self.lm.config_hash, "vision": self.lm.is_vision,
                "layout": self.lm.layout.summary(), "knobs": self.knobs.to_dict(),
                "live_plan": live.as_dict(), "modeled_plan": modeled.as_dict(),
                "notes": self.lm.notes}

    # -- run -------------------------------------------------------------------------------
    def run(self, prompt: str | Request | Sequence[Request], images: Sequence[Any] = (), *,
            store: str | Path | None = None, overwrite: bool = False, record: bool = True,
            on_token: Callable[[int, str], None] | None = None,
            stop: threading.Event | None = None, logits_processor: Sequence[Any] = (),
            on_result: Callable[[RunResult], None] | None = None,
            **knob_values: Any) -> RunResult:
        """Serve one request, or a batch of them run together: ``prompt`` a list of
        :class:`Request` (``images`` then empty; see :func:`workbench.batch` for batches of the
        demo and generated scenes). ``store`` defaults to a fresh folder in the workspace option;
        ``record=False`` skips telemetry (for overhead benchmarks). ``on_token(id, text_so_far)``
        streams tokens; ``on_result(result)`` gets the result as soon as generation has ended,
        before the store's final write (the store is complete only when ``run`` returns).
        ``logits_processor``: extra transformers logits processors for
        ``generate`` (e.g. teacher forcing, see :meth:`quality`). Knob values given here apply
        to this run only.

        ``images`` is a list (any sequence) of image paths or PIL images; a single path or image
        given on its own is refused with :class:`InputError` (wrap it in a list), so that a
        path's characters are never taken for images."""
        from PIL import Image

        if isinstance(images, (str, bytes, bytearray, os.PathLike, Image.Image)):
            raise InputError(f"images must be a list of paths or PIL images, not "
                             f"{type(images).__name__} ({show_value(images)}); wrap a single image "
                             f"in a list: images=[...]")
        if not isinstance(images, Iterable):
            raise InputError(f"images must be a list of paths or PIL images, not "
                             f"{type(images).__name__}")
        # a copy: the run's knobs cannot change under it (widgets may change self.knobs)
        knobs = self.knobs.copy(**knob_values)
        self._check(knobs)
        if isinstance(prompt, (list, tuple)):
            if images:
                raise InputError("a batch's requests carry their own images: give "
                                 "Request(prompt, images) items and no images=")
            if not prompt:
                raise InputError("the batch is empty: give at least one request")
            requests = list(prompt)
        else:
            requests = [prompt if isinstance(prompt, Request) else Request(prompt, list(images))]
        store_path = check_store_path(_store_path(store), overwrite) if record else None
        with threads_for_run(self.lm.device), frozen_heap():
            return RunSession(self, knobs, requests, store_path=store_path,
                              overwrite=overwrite, on_token=on_token, stop=stop,
                              logits_processor=list(logits_processor),
                              on_result=on_result).run()

    def quality(self, prompt: str | Request, images: Sequence[Any] = (), *,
                dynamic_topk: bool = True, **knob_values: Any):
        """Quality cost of budget-aware dynamic top-k on one request: the same knobs with and
        without ``dynamic_topk``, teacher-forced on the reference (dynamic top-k off) greedy
        tokens. Returns a :class:`workbench.analysis.quality.QualityReport` (top-1 agreement,
        mean KL(reference ‖ modified) of the next-token distributions, both runs' results)."""
        from workbench.analysis.quality import compare_runs

        return compare_runs(self, prompt, images, dynamic_topk=dynamic_topk, **knob_values)

    def run_attrs(self, k: Knobs, requests: Sequence[Request], inputs: ModelInputs,
                  live: MemoryPlan, modeled: MemoryPlan) -> dict[str, Any]:
        """The store attrs of a run of ``k`` on the batch ``requests`` (``prompt``, ``images``
        and ``prompt_tokens`` are request 0's; ``requests`` lists them all)."""
        from workbench.runtime.session import image_labels

        lm = self.lm
        request = requests[0]
        n_real = inputs.prompt_tokens()
        prof = get_profile(k.profile)
        return {
            **k.to_attrs(),
            "model_id": lm.model_id, "model_path": str(lm.path),
            "config_hash": lm.config_hash, "architecture": lm.layout.architecture,
            "model_type": lm.layout.model_type, "top_k": lm.layout.top_k,
            "bytes_per_expert": lm.layout.expert_bytes,
            "hardware_profile": prof.name, "hardware_profile_label": prof.label,
            "cost_source": self.cost_spec(k).source,
            # the modeled clock's sizes, so replay can price this trace the same way
            "cost_spec": json.dumps(dataclasses.asdict(self.cost_spec(k))),
            "prompt": request.prompt,
            "images": json.dumps(image_labels(request)),
            "batch_size": len(requests),
            "requests": json.dumps([{"prompt": r.prompt, "images": image_labels(r),
                                     "prompt_tokens": n} for r, n in zip(requests, n_real)]),
            # each image's patch grid (t, h, w) from the processor and the vision tower's merge:
            # one visual token per spatial_merge_size² patches, row-major (ds.moe.visual_tokens)
            "image_grid_thw": json.dumps(inputs.tensors["image_grid_thw"].tolist()
                                         if "image_grid_thw" in inputs.tensors else []),
            "spatial_merge_size": int(getattr(getattr(lm.model.config, "vision_config", None),
                                              "spatial_merge_size", None) or 1),
            "prompt_tokens": n_real[0],
            "live_plan": json.dumps(live.as_dict()), "modeled_plan": json.dumps(modeled.as_dict()),
            "device": str(lm.device), "torch_version": torch.__version__,
        }


def _store_path(store: str | Path | None) -> Path:
    if store is not None:
        return store  # checked (type, emptiness, NUL, writability) by check_store_path
    from workbench.telemetry.destination import new_run_name, workspace_dir

    ws = workspace_dir(get_options()["workspace"])
    return ws / new_run_name(ws)
