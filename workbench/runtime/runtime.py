"""The live offloaded runtime: one request in, an answer, a summary and a run store out.

``Runtime.run`` wraps ``model.generate`` (the model's own generation loop, greedy by default)
with three things that are always removed afterwards, whatever happens:

- the :class:`~workbench.runtime.offload.Offloader` (experts in the host store, a slot cache);
- a forward pre/post hook on the model that marks step boundaries (one step = one forward pass:
  the prefill, then one per decode token);
- a streamer that receives each generated token, closes that step's event and hands it to the
  recorder (zarr store) and to the caller's ``on_token``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from workbench.compression.placement import PrunedPlacement, check_supported
from workbench.compression.policies import COMPRESSION
from workbench.errors import InputError, KnobError, ModelLoadError
from workbench.knobs import Knobs, _show
from workbench.models.inputs import ModelInputs, Request, build_inputs, modality_of
from workbench.models.loading import LoadedModel, load
from workbench.options import get_options
from workbench.policies.active_evict import ActiveEvict
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.runtime.clocks import CostSpec, ModeledClock, measured_spans, runs_on_host
from workbench.runtime.offload import Offloader, StepProbe
from workbench.runtime.plan import MemoryPlan, device_budget
from workbench.runtime.profiles import get_profile, get_target_model
from workbench.telemetry.events import PHASES, StepEvent
from workbench.telemetry.store import Recorder, check_store_path

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class RunResult:
    """What one request produced. Latencies: *measured* = wall time here, *modeled* = the
    hardware profile's timeline. ``hit_rate`` counts offloaded (non-pinned) layers only."""

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

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else float("nan")

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["hit_rate"] = None if np.isnan(self.hit_rate) else self.hit_rate
        return d

    def summary(self) -> str:
        hr = "n/a (no offloaded layer)" if np.isnan(self.hit_rate) else f"{self.hit_rate:.1%}"
        k = self.knobs
        lines = [
            f"answer: {self.text}",
            f"model {self.model_id} · {self.steps} steps (1 prefill + {self.steps - 1} decode) · "
            f"cache_slots={k.get('cache_slots')} pinned_layers={k.get('pinned_layers')} "
            f"eviction={k.get('eviction')}",
            f"expert cache: hit rate {hr} · {self.hits} hits, {self.misses} misses, "
            f"{self.loads} loads, {self.evictions} evictions"
            + (f" ({self.pre_evictions} ahead of demand)" if self.pre_evictions else "")
            + (f" · {self.host_runs} misses run on the host copy (hybrid)"
               if self.host_runs else ""),
            f"measured: {self.latency_measured_s * 1e3:.1f} ms total "
            f"(prefill {self.prefill_measured_s * 1e3:.1f} ms), stall "
            f"{self.stall_measured_s * 1e3:.2f} ms, {self.transfer_bytes / 1e6:.2f} MB moved",
            f"modeled ({k.get('profile')}, costs of {k.get('target_model')}): "
            f"{self.latency_modeled_s * 1e3:.1f} ms total (prefill "
            f"{self.prefill_modeled_s * 1e3:.1f} ms), stall {self.stall_modeled_s * 1e3:.1f} ms, "
            f"{self.transfer_bytes_modeled / 1e6:.1f} MB moved",
        ]
        if k.get("compression", "none") != "none" and self.visual_tokens:
            lines.append(
                f"compression {k.get('compression')} (beta={k.get('beta')}, lam={k.get('lam')}): "
                f"kept {self.kept_visual_tokens}/{self.visual_tokens} visual tokens after "
                f"{k.get('pinned_layers')} pinned layers; selection "
                f"{self.compression_select_s * 1e3:.2f} ms, saliency "
                f"{self.compression_saliency_s * 1e3:.2f} ms (measured)")
        if self.store:
            lines.append(f"store: {self.store}")
        return "\n".join(lines)


class _Streamer:
    """transformers streamer protocol: ``put`` gets the prompt once, then each new token."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self._seen_prompt = False
        self.on_token = on_token

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        for t in value.reshape(-1).tolist():
            self.on_token(int(t))

    def end(self) -> None:
        pass


class _StopOnEvent:
    """A stopping criterion that ends generation when ``event`` is set (the UI's Stop)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool,
                          device=input_ids.device)


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
        if isinstance(model, LoadedModel):
            self.lm = model
        else:
            self.lm = load(model, dtype=self.knobs.dtype, device=self.knobs.device)
        self._check()

    # -- plan ------------------------------------------------------------------------------
    def _check(self, knobs: Knobs | None = None) -> None:
        knobs = knobs if knobs is not None else self.knobs
        lay = self.lm.layout
        knobs.check_against(lay.num_layers, lay.top_k, lay.expert_bytes)
        if knobs.compression != "none":
            check_supported(self.lm.model)
            if knobs.alpha > knobs.beta:
                raise KnobError(f"alpha must be at most beta (the salient core is part of the "
                                f"kept tokens), not alpha={knobs.alpha} > beta={knobs.beta}")
        if knobs.k_max is not None and knobs.k_max > lay.num_experts:
            raise KnobError(f"k_max must be between 1 and {lay.num_experts} (experts per "
                            f"layer), not {knobs.k_max}")
        if getattr(EVICTION.get(knobs.eviction), "needs_predictor", False) \
                and not _uses_predictor(knobs):
            raise KnobError(
                f"eviction {knobs.eviction!r} keeps the experts the lookahead predictor names "
                f"for the next window layers, so it needs the predictor: set predictor=vismmoe "
                f"(or prefetch=vismmoe), or choose another eviction policy")
        if _uses_predictor(knobs):
            self._predictor(knobs)
        # the valid prefix interval (seed VisMMOE eq. 10), on the profile first, then here
        live, modeled = self.plans(knobs)
        modeled.check_pinned()
        live.check_pinned()

    def _predictor(self, knobs: Knobs):
        """The calibrated lookahead predictor of ``knobs`` (loaded once per path), checked
        against this model's MoE layout."""
        from workbench.predictor.model import load as load_predictor
        from workbench.predictor.policy import default_path

        path = Path(knobs.predictor_path) if knobs.predictor_path else default_path(self.lm.path)
        cache = self.__dict__.setdefault("_predictors", {})
        if path not in cache:
            # checked against this model (layers, experts, config hash) before it is built
            cache[path] = load_predictor(path, model=self.lm)
        return cache[path]

    def cost_spec(self, knobs: Knobs | None = None) -> CostSpec:
        k = knobs if knobs is not None else self.knobs
        if k.target_model != "none":
            return CostSpec.from_target(get_target_model(k.target_model))
        return CostSpec.from_layout(self.lm.layout, _DTYPE_BYTES[k.dtype])

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
    def run(self, prompt: str | Request, images: Sequence[Any] = (), *,
            store: str | Path | None = None, overwrite: bool = False, record: bool = True,
            on_token: Callable[[int, str], None] | None = None,
            stop: threading.Event | None = None, logits_processor: Sequence[Any] = (),
            **knob_values: Any) -> RunResult:
        """Serve one request. ``store`` defaults to a fresh folder in the workspace option;
        ``record=False`` skips telemetry (for overhead benchmarks). ``on_token(id, text_so_far)``
        streams tokens. ``logits_processor``: extra transformers logits processors for
        ``generate`` (e.g. teacher forcing, see :meth:`quality`). Knob values given here apply
        to this run only.

        ``images`` is a list (any sequence) of image paths or PIL images; a single path or image
        given on its own is refused with :class:`InputError` (wrap it in a list), so that a
        path's characters are never taken for images."""
        from PIL import Image

        if isinstance(images, (str, bytes, bytearray, os.PathLike, Image.Image)):
            raise InputError(f"images must be a list of paths or PIL images, not "
                             f"{type(images).__name__} ({_show(images)}); wrap a single image "
                             f"in a list: images=[...]")
        if not isinstance(images, Iterable):
            raise InputError(f"images must be a list of paths or PIL images, not "
                             f"{type(images).__name__}")
        knobs = self.knobs.copy(**knob_values) if knob_values else self.knobs
        self._check(knobs)  # also when the knobs object was changed in place (widgets)
        saved, self.knobs = self.knobs, knobs
        try:
            return self._run(prompt, images, store, overwrite, record, on_token, stop,
                             list(logits_processor))
        finally:
            self.knobs = saved

    def quality(self, prompt: str | Request, images: Sequence[Any] = (), *,
                dynamic_topk: bool = True, **knob_values: Any):
        """Quality cost of budget-aware dynamic top-k on one request: the same knobs with and
        without ``dynamic_topk``, teacher-forced on the reference (dynamic top-k off) greedy
        tokens. Returns a :class:`workbench.analysis.quality.QualityReport` (top-1 agreement,
        mean KL(reference ‖ modified) of the next-token distributions, both runs' results)."""
        from workbench.analysis.quality import compare_runs

        return compare_runs(self, prompt, images, dynamic_topk=dynamic_topk, **knob_values)

    def _run(self, prompt, images, store, overwrite, record, on_token, stop,
             logits_processor) -> RunResult:
        k, lm, lay = self.knobs, self.lm, self.lm.layout
        request = prompt if isinstance(prompt, Request) else Request(prompt, list(images))
        inputs = build_inputs(lm, request, k.max_new_tokens)
        live, modeled = self.plans()
        live.check()
        modeled.check()
        store_path = (check_store_path(_store_path(store), overwrite) if record else None)
        clock = ModeledClock(get_profile(k.profile), self.cost_spec())
        t0 = time.perf_counter()
        probe = StepProbe(t0)
        kd = k.to_dict()
        policy = EVICTION.create(k.eviction, **kd)
        prefetcher = PREFETCH.create(k.prefetch, **kd)
        pinned = [b.index < k.pinned_layers for b in lay.blocks]
        recorder = None
        events: list[StepEvent] = []
        generated: list[int] = []
        pending: list[StepEvent] = []
        state = {"step": -1, "t_start": 0.0}
        tok = lm.tokenizer

        def pre_hook(module, args, kwargs):
            state["step"] += 1
            probe.begin(state["step"])
            state["t_start"] = time.perf_counter()

        def post_hook(module, args, kwargs, output):
            t_end = time.perf_counter()
            ids = kwargs.get("input_ids", args[0] if args else None)
            ids = ids if ids is not None else torch.zeros(0, dtype=torch.long)
            step = state["step"]
            ev = StepEvent(step=step, phase=0 if step == 0 else 1,
                           token_ids=ids.reshape(-1).cpu().numpy(),
                           modality=modality_of(ids, lm.image_token_id, lm.video_token_id),
                           layers=list(probe.layers), step_start_s=state["t_start"] - t0,
                           latency_measured_s=t_end - state["t_start"])
            res = off.cache.residency()
            res[np.asarray(pinned)] = True
            ev.residency = res
            if placement is not None and step == 0:
                placement.scatter_event(ev)
            if live_pred is not None:  # what the predictor said, for replay
                ev.predicted_ids, ev.predicted_scores = live_pred.step_predictions(step)
            transfers = off.engine.drain() if off.engine is not None else []
            measured_spans(ev, probe.stalls, transfers, t0)
            clock.price(ev)
            pending.append(ev)

        def take_token(token: int) -> None:
            generated.append(token)
            if pending:
                ev = pending.pop(0)
                ev.generated_token = token
                events.append(ev)
                if recorder is not None:
                    recorder.add(ev)
            if on_token is not None:
                on_token(token, tok.decode(generated, skip_special_tokens=True))

        gen_kwargs: dict[str, Any] = dict(max_new_tokens=k.max_new_tokens, do_sample=k.sampling,
                                          streamer=_Streamer(take_token))
        if k.ignore_eos:
            gen_kwargs["min_new_tokens"] = k.max_new_tokens
        if k.sampling:
            torch.manual_seed(k.seed)
            gen_kwargs.update(temperature=k.temperature, top_p=k.top_p)
        else:
            gen_kwargs.update(temperature=None, top_p=None, top_k=None)
        if stop is not None:
            from transformers import StoppingCriteriaList

            gen_kwargs["stopping_criteria"] = StoppingCriteriaList([_StopOnEvent(stop)])
        if logits_processor:
            from transformers import LogitsProcessorList

            gen_kwargs["logits_processor"] = LogitsProcessorList(logits_processor)
        ae = (ActiveEvict.from_knobs(k, lay.num_layers, lay.num_experts)
              if k.active_evict else None)
        model = lm.model
        comp = COMPRESSION.create(k.compression, **kd)
        placement = None
        if comp.prunes and bool((inputs.modality != 0).any()):  # text-only: nothing to prune
            check_supported(model, inputs.input_ids)
            placement = PrunedPlacement(model, lay, k.pinned_layers, comp)
        off = Offloader(lay, self.num_slots(), k.pinned_layers, policy, lm.device, probe,
                        lookahead_depth=k.lookahead_depth, active_evict=ae,
                        dynamic_topk=k.dynamic_topk, k_max=k.k_max, prefetch=prefetcher,
                        prefetch_lead=k.prefetch_lead, prefetch_budget=_prefetch_budget(k),
                        pruning=placement,
                        hybrid=(functools.partial(runs_on_host, clock.profile, clock.cost)
                                if k.hybrid else None))
        live_pred = None
        if _uses_predictor(k):
            from workbench.predictor.policy import LivePredictor

            live_pred = LivePredictor(model, lay, self._predictor(k), _predictor_budget(k),
                                      placement=placement)
            if hasattr(prefetcher, "attach"):
                prefetcher.attach(live_pred)
            if hasattr(policy, "attach"):  # slab eviction: fed the window at every layer
                policy.attach(live_pred)
        try:
            if store_path is not None:  # inside the try: a failure from here on closes it
                # the store's k dim holds every k a layer may use (dynamic top-k may widen it)
                store_k = max(lay.top_k, k.k_max or 0) if k.dynamic_topk else lay.top_k
                recorder = Recorder(
                    store_path, lay.num_layers, lay.num_experts, store_k,
                    attrs=self._attrs(request, inputs, live, modeled), pinned=pinned,
                    overwrite=overwrite, flush_every=get_options()["flush_every"],
                    flush_interval_s=get_options()["flush_interval_s"],
                    depth=k.lookahead_depth,
                    rank=_predictor_budget(k) if _uses_predictor(k) else 1)
            with off, (placement if placement is not None else contextlib.nullcontext()), \
                    (live_pred if live_pred is not None else contextlib.nullcontext()):
                h1 = model.register_forward_pre_hook(pre_hook, with_kwargs=True)
                h2 = model.register_forward_hook(post_hook, with_kwargs=True)
                try:
                    with torch.no_grad():
                        model.generate(**inputs.tensors, **gen_kwargs)
                finally:
                    h1.remove()
                    h2.remove()
                counters = off.cache.counters()
            for ev in pending:  # a forward whose token never came (stopped): keep it
                events.append(ev)
                if recorder is not None:
                    recorder.add(ev)
            # the store stays open until the summary is in it
            return self._finish_run(recorder, events, generated, counters, pinned, store_path,
                                    stop, placement, live_pred, policy)
        except BaseException as e:
            if recorder is not None:
                try:
                    recorder.close("failed", error=f"{type(e).__name__}: {e}")
                except Exception:  # never hide the original error
                    pass
            raise

    def _finish_run(self, recorder, events, generated, counters, pinned, store_path, stop,
                    placement, live_pred, policy) -> RunResult:
        """The run's result from its events; the store is closed ``complete`` with it."""
        k, tok = self.knobs, self.lm.tokenizer
        lm = self.lm
        offl = ~np.asarray(pinned)
        result = RunResult(
            text=tok.decode(generated, skip_special_tokens=True).strip(),
            token_ids=generated, steps=len(events),
            hits=int(counters["hits"][offl].sum()), misses=int(counters["misses"][offl].sum()),
            loads=int(counters["loads"].sum()), evictions=int(counters["evictions"].sum()),
            latency_measured_s=sum(e.latency_measured_s for e in events),
            latency_modeled_s=sum(e.latency_modeled_s for e in events),
            stall_measured_s=sum(e.stall_measured_s for e in events),
            stall_modeled_s=sum(e.stall_modeled_s for e in events),
            prefill_measured_s=events[0].latency_measured_s if events else 0.0,
            prefill_modeled_s=events[0].latency_modeled_s if events else 0.0,
            transfer_bytes=sum(e.transfer_bytes for e in events),
            transfer_bytes_modeled=sum(e.transfer_bytes_modeled for e in events),
            store=str(store_path) if store_path is not None else None,
            knobs=k.to_dict(), model_id=lm.model_id,
            stopped=bool(stop is not None and stop.is_set()),
            pre_evictions=sum(len(le.pre_evicted) for e in events for le in e.layers),
            host_runs=sum(len(le.host) for e in events for le in e.layers))
        if placement is not None:
            result.visual_tokens = placement.num_visual
            result.kept_visual_tokens = (int(placement.kept_visual.numel())
                                         if placement.kept_visual is not None else 0)
            result.compression_select_s = placement.select_s
            result.compression_saliency_s = placement.saliency_s
        if live_pred is not None:
            result.predictor_cost = live_pred.cost_summary()
        if hasattr(policy, "stats"):
            result.eviction_stats = policy.stats()
        if recorder is not None:
            recorder.close("complete", summary=json.dumps(result.to_json()),
                           compression_visual_tokens=result.visual_tokens,
                           compression_kept_visual_tokens=result.kept_visual_tokens,
                           compression_select_s=result.compression_select_s,
                           compression_saliency_s=result.compression_saliency_s,
                           **({"predictor_cost": json.dumps(result.predictor_cost)}
                              if live_pred is not None else {}))
        return result

    def _attrs(self, request: Request, inputs: ModelInputs, live: MemoryPlan,
               modeled: MemoryPlan) -> dict[str, Any]:
        k, lm = self.knobs, self.lm
        prof = get_profile(k.profile)
        return {
            **k.to_attrs(),
            "model_id": lm.model_id, "model_path": str(lm.path),
            "config_hash": lm.config_hash, "architecture": lm.layout.architecture,
            "model_type": lm.layout.model_type, "top_k": lm.layout.top_k,
            "bytes_per_expert": lm.layout.expert_bytes,
            "hardware_profile": prof.name, "hardware_profile_label": prof.label,
            "cost_source": self.cost_spec().source,
            # the modeled clock's sizes, so replay can price this trace the same way
            "cost_spec": json.dumps(dataclasses.asdict(self.cost_spec())),
            "prompt": request.prompt,
            "images": json.dumps([str(i) if not hasattr(i, "size") else "<PIL image>"
                                  for i in request.images]),
            # each image's patch grid (t, h, w) from the processor and the vision tower's merge:
            # one visual token per spatial_merge_size² patches, row-major (ds.moe.visual_tokens)
            "image_grid_thw": json.dumps(inputs.tensors["image_grid_thw"].tolist()
                                         if "image_grid_thw" in inputs.tensors else []),
            "spatial_merge_size": int(getattr(getattr(lm.model.config, "vision_config", None),
                                              "spatial_merge_size", None) or 1),
            "prompt_tokens": int(inputs.input_ids.shape[-1]),
            "live_plan": json.dumps(live.as_dict()), "modeled_plan": json.dumps(modeled.as_dict()),
            "device": str(lm.device), "torch_version": torch.__version__,
        }


def _uses_predictor(knobs: Knobs) -> bool:
    return knobs.predictor == "vismmoe" or knobs.prefetch == "vismmoe"


def _prefetch_budget(knobs: Knobs) -> int | None:
    """``prefetch_budget``; for prefetch = vismmoe None means the predictor's B = 20."""
    if knobs.prefetch_budget is None and knobs.prefetch == "vismmoe":
        from workbench.predictor.policy import DEFAULT_BUDGET

        return DEFAULT_BUDGET
    return knobs.prefetch_budget


def _predictor_budget(knobs: Knobs) -> int:
    """B: how many experts of y_l the live predictor keeps (and the store records)."""
    from workbench.predictor.policy import DEFAULT_BUDGET

    return _prefetch_budget(knobs) or DEFAULT_BUDGET


def _store_path(store: str | Path | None) -> Path:
    if store is not None:
        return store  # checked (type, emptiness, NUL, writability) by check_store_path
    from workbench.telemetry.destination import new_run_name, workspace_dir

    ws = workspace_dir(get_options()["workspace"])
    return ws / new_run_name(ws)
