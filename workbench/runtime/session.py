"""One run: a batch of requests served by a :class:`~workbench.runtime.runtime.Runtime`.

:class:`RunSession` holds every piece of per-run state explicitly (the knobs of the run, the
offloader and its core, the recorder, the step in progress, the events, the tokens), so a
Runtime serves runs without changing itself: two sessions of one Runtime share the model and
nothing else. Its life is ``install`` (policies, stages, offloader, predictor, store) →
one ``step_started`` / ``step_ended`` pair per model forward (prefill, then one per decode
token) → ``token`` per generated token → ``finish`` (the result; the store closed
``complete``), or ``fail`` on any error (the store closed ``failed``).

A run serves a *batch* of requests together through the model's own ``generate`` (one row
per request, left-padded by the processor, the attention mask from it). Each forward's tokens
are the batch's rows flattened; the positions that are not real tokens — left padding, and
the rows of requests that have already finished (``generate`` keeps feeding them pad tokens)
— are routed to no expert (:meth:`Offloader.set_token_mask`) and left out of every event, so
the store, the cache and the load hold the real tokens only, each with its request index.
Greedy answers equal each request run alone (tested). A stage may refuse a batch
(:meth:`~workbench.runtime.stages.Stage.check_requests`): visual-token compression needs a
batch of one (its placement scatters one request's pruned tokens).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

from workbench.errors import InputError
from workbench.knobs import Knobs
from workbench.models.hooks import Hooks
from workbench.models.inputs import Request, build_batch_inputs, modality_of
from workbench.options import get_options
from workbench.policies.eviction import EVICTION
from workbench.policies.prefetch import PREFETCH
from workbench.runtime.clocks import measured_spans
from workbench.runtime.executor import StepProbe
from workbench.runtime.offload import Offloader
from workbench.runtime.stages import STAGES, TOKEN_CONTEXT, RunContext, Stage, hooked, provided
from workbench.runtime.stages import from_knobs as stages_from_knobs
from workbench.runtime.result import RunResult
from workbench.runtime.view import RuntimeView
from workbench.sim.costs import Prices
from workbench.sim.profiles import get_profile
from workbench.telemetry.events import StepEvent
from workbench.telemetry.store import Recorder



class _Streamer:
    """transformers streamer protocol: ``put`` gets the prompt once, then each step's new
    tokens (one per request of the batch)."""

    def __init__(self, on_tokens: Callable[[list[int]], None]) -> None:
        self._seen_prompt = False
        self.on_tokens = on_tokens

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.on_tokens([int(t) for t in value.reshape(-1).tolist()])

    def end(self) -> None:
        pass


class _StopOnEvent:
    """A stopping criterion that ends generation when ``event`` is set (the UI's Stop)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool,
                          device=input_ids.device)


class RunSession:
    """The state of one run (see the module docstring). ``runtime`` is the
    :class:`~workbench.runtime.runtime.Runtime` that serves it (model, plans, prices; read,
    never changed: the one state runs share, ReaLB's carried M_d, is handed to its stage)."""

    runtime: RuntimeView

    def __init__(self, runtime: RuntimeView, knobs: Knobs, requests: list[Request], *,
                 store_path=None, overwrite: bool = False,
                 on_token: Callable[[int, str], None] | None = None,
                 stop: threading.Event | None = None,
                 logits_processor: list | None = None,
                 on_result: Callable[[RunResult], None] | None = None) -> None:
        self.runtime, self.knobs, self.requests = runtime, knobs, list(requests)
        self.store_path, self.overwrite = store_path, overwrite
        self.on_token, self.stop = on_token, stop
        #: called with the result once generation has ended, before the store's final write
        #: (a UI shows the end then; :meth:`run` still raises if that write fails)
        self.on_result = on_result
        self.logits_processor = list(logits_processor or [])
        lm = runtime.lm
        if len(self.requests) > 1 and runtime.uses_predictor(knobs):
            raise InputError(f"the lookahead predictor (predictor / prefetch=vismmoe) reads one "
                             f"request's image summary; a batch of {len(self.requests)} "
                             f"requests needs it off (or run the requests one at a time)")
        for stage in STAGES:  # e.g. token compression prunes one request's visual tokens
            stage.check_requests(knobs, len(self.requests))
        self.inputs = build_batch_inputs(lm, self.requests, knobs.max_new_tokens)
        B = self.inputs.batch_size
        eos = lm.model.generation_config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else list(eos or []))
        #: per request: its generated tokens (up to and including its end-of-sequence token)
        self.answers: list[list[int]] = [[] for _ in range(B)]
        self.finished = np.zeros(B, bool)
        self.valid: np.ndarray | None = None  # real tokens of the forward in progress
        self.live_plan, self.modeled_plan = runtime.plans(knobs)
        self.live_plan.check()
        self.modeled_plan.check()
        self.cost = runtime.cost_spec(knobs)
        self.prices = Prices.shared(get_profile(knobs.profile), self.cost)
        self.t0 = time.perf_counter()
        self.probe = StepProbe(self.t0)
        self.pinned = [b.index < knobs.pinned_layers for b in lm.layout.blocks]
        self.step = -1
        self.step_t0 = 0.0
        self.events: list[StepEvent] = []  # finished steps, in order
        self.pending: list[StepEvent] = []  # forwards whose token has not come yet
        self.recorder: Recorder | None = None
        #: the run's EP summary, summed as its store is written (ep_ranks > 1 on a static
        #: placement; None otherwise): the run's result carries it (``RunResult.ep``)
        self.ep_stream = None
        self.offloader: Offloader | None = None
        self.stages: list[Stage] = []  # the run's layer stages, in order (on ones only)
        self.predictor = None

    # -- install ---------------------------------------------------------------------------
    def _install(self) -> None:
        """The run's policies, stages (token compression among them), offloader and predictor
        (nothing enters the model yet: :meth:`run` enters them)."""
        k, rt = self.knobs, self.runtime
        lay = rt.lm.layout
        # each policy from its knob group's fields (an outside one: the knobs it declares)
        self.policy = EVICTION.get(k.eviction).from_knobs(k)
        prefetcher = PREFETCH.get(k.prefetch).from_knobs(k)
        run = RunContext(rt, self.prices, rt.lm.device, prefetch=prefetcher,
                         prefetch_budget=rt.prefetch_budget(k), inputs=self.inputs)
        self.stages = stages_from_knobs(k, run)
        self._on_step = hooked(self.stages, "step_ended")
        run = provided(self.stages, run)
        self.offloader = Offloader(
            lay, rt.num_slots(k), k.pinned_layers, self.policy, rt.lm.device, self.probe,
            self.prices, low_precision=k.low_precision, stages=self.stages,
            transfer_order=k.transfer_order, offload_unit=k.offload_unit)
        if rt.uses_predictor(k):
            from workbench.predictor.policy import LivePredictor

            self.predictor = LivePredictor(rt.lm.model, lay, rt.predictor(k),
                                           rt.predictor_budget(k), placement=run.pruning)
            if hasattr(prefetcher, "attach"):
                prefetcher.attach(self.predictor)
            if hasattr(self.policy, "attach"):  # slab eviction: fed the window at every layer
                self.policy.attach(self.predictor)

    def _open_store(self) -> None:
        if self.store_path is None:
            return
        k, rt = self.knobs, self.runtime
        lay = rt.lm.layout
        # the store's k dim holds every k a layer may use (dynamic top-k may widen it)
        store_k = self.offloader.max_k(max(lay.top_k, k.k_max or 0) if k.dynamic_topk
                                       else lay.top_k)
        self.recorder = Recorder(
            self.store_path, lay.num_layers, lay.num_experts, store_k,
            attrs=rt.run_attrs(k, self.requests, self.inputs, self.live_plan,
                               self.modeled_plan),
            pinned=self.pinned, overwrite=self.overwrite,
            flush_every=get_options()["flush_every"],
            flush_interval_s=get_options()["flush_interval_s"], depth=k.lookahead_depth,
            pred_order=rt.predictor_budget(k) if rt.uses_predictor(k) else 1,
            **{"ep_ranks": 1, "subexperts": 1, **self.offloader.store_dims()})
        if k.ep_ranks > 1:
            from workbench.replay.ep import EPStream

            self.ep_stream = EPStream.for_store(self.recorder.attrs, self.pinned,
                                                lay.num_layers, lay.num_experts, store_k)
            if self.ep_stream is not None:
                self.recorder.on_columns(self.ep_stream.add_columns)

    # -- the run ---------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Install, generate, finish; on any error the store is closed ``failed``."""
        try:
            self._install()
            self._open_store()  # inside the try: a failure from here on closes it
            # the timelines' spans are written to the store only: a run without one does
            # not build them (per key and step: ≈ 1 % of a run, 4× with sub-expert keys)
            self.offloader.keep_spans(self.recorder is not None)
            model = self.runtime.lm.model
            # the declared order of the model's hooks (workbench.models.hooks): offloader,
            # the stages' own (token compression), predictor, step boundaries; removed in
            # reverse
            with self.offloader, self._stage_hooks(), \
                    (self.predictor or contextlib.nullcontext()), Hooks() as hooks:
                hooks.pre(model, self._step_started, with_kwargs=True)
                hooks.post(model, self._step_ended, with_kwargs=True)
                with torch.no_grad():
                    model.generate(**self.inputs.tensors, **self._generate_kwargs())
            for ev in self.pending:  # a forward whose token never came (stopped): keep it
                self._keep(ev)
            self.pending = []
            return self._finish()
        except BaseException as e:
            if self.recorder is not None:
                try:
                    self.recorder.close("failed", error=f"{type(e).__name__}: {e}")
                except Exception:  # never hide the original error
                    pass
            raise

    def _stage_hooks(self) -> contextlib.ExitStack:
        """The stages' own hooks on the model (:meth:`Stage.model_hooks`), entered in order."""
        stack = contextlib.ExitStack()
        with stack:  # a failing install removes what was installed before it
            for stage in self.stages:
                hooks = stage.model_hooks()
                if hooks is not None:
                    stack.enter_context(hooks)
            return stack.pop_all()

    def _generate_kwargs(self) -> dict[str, Any]:
        k = self.knobs
        kw: dict[str, Any] = dict(max_new_tokens=k.max_new_tokens, do_sample=k.sampling,
                                  streamer=_Streamer(self._tokens))
        if k.ignore_eos:
            kw["min_new_tokens"] = k.max_new_tokens
        if k.sampling:
            torch.manual_seed(k.seed)
            kw.update(temperature=k.temperature, top_p=k.top_p)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        if self.stop is not None:
            from transformers import StoppingCriteriaList

            kw["stopping_criteria"] = StoppingCriteriaList([_StopOnEvent(self.stop)])
        if self.logits_processor:
            from transformers import LogitsProcessorList

            kw["logits_processor"] = LogitsProcessorList(self.logits_processor)
        return kw

    # -- per step ----------------------------------------------------------------------------
    def _step_started(self, module, args, kwargs) -> None:
        self.step += 1
        self.valid = self._real_tokens(kwargs, args)
        ids = kwargs.get("input_ids", args[0] if args else None)
        lm = self.runtime.lm
        self.offloader.begin_step(self.step)
        if ids is not None and TOKEN_CONTEXT in self.offloader.step_needs:
            self.offloader.set_token_mask(
                self.valid, modality_of(ids, lm.image_token_id, lm.video_token_id),
                np.repeat(np.arange(ids.shape[0]), ids.shape[-1]) if ids.dim() > 1 else None)
        else:
            self.offloader.set_token_mask(self.valid)
        self.probe.begin(self.step, self.offloader.sim.lanes.compute)
        self.step_t0 = time.perf_counter()

    def _step_ended(self, module, args, kwargs, output) -> None:
        t_end = time.perf_counter()
        lm, probe, off = self.runtime.lm, self.probe, self.offloader
        ids = kwargs.get("input_ids", args[0] if args else None)
        ids = ids if ids is not None else torch.zeros(0, dtype=torch.long)
        step = self.step
        ev = StepEvent(step=step, phase=0 if step == 0 else 1,
                       token_ids=ids.reshape(-1).cpu().numpy(),
                       modality=modality_of(ids, lm.image_token_id, lm.video_token_id),
                       layers=list(probe.layers), step_start_s=self.step_t0 - self.t0,
                       latency_measured_s=t_end - self.step_t0,
                       request=np.repeat(np.arange(ids.shape[0] if ids.dim() > 1 else 1,
                                                   dtype=np.int16),
                                         ids.shape[-1] if ids.dim() > 1 else ids.numel()))
        if self.valid is not None and not self.valid.all():
            ev.keep_tokens(self.valid)  # padding and finished requests: not tokens of the run
        ev.residency = off.residency()
        for stage in self._on_step:  # e.g. token compression: the prefill's pruned tokens
            stage.step_ended(step, ev)
        if self.predictor is not None:  # what the predictor said, for replay
            ev.predicted_ids, ev.predicted_scores = self.predictor.step_predictions(step)
        transfers = off.engine.drain() if off.engine is not None else []
        measured_spans(ev, probe.stalls, transfers, self.t0, spans=off.sim.record_spans)
        # the modeled clock: the core priced every layer of the step as it ran
        ev.spans.extend(probe.modeled)
        ev.latency_modeled_s = off.sim.lanes.compute - probe.modeled_start
        ev.stall_modeled_s = probe.stall_modeled_s
        ev.transfer_bytes_modeled = probe.moved * int(self.cost.part(off.part).expert_bytes)
        self.pending.append(ev)

    def _real_tokens(self, kwargs: dict, args: tuple) -> np.ndarray | None:
        """bool [B·T] of the forward about to run: its real tokens (None: all real). The
        prefill's left padding (attention mask 0) and every row of a finished request."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.dim() != 2 or ids.shape[0] != len(self.finished):
            return None
        B, T = ids.shape
        valid = np.repeat(~self.finished[:, None], T, 1)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and mask.shape[0] == B:
            valid &= mask[:, -T:].detach().cpu().numpy().astype(bool)
        valid = valid.reshape(-1)
        return None if valid.all() else valid

    def _tokens(self, tokens: list[int]) -> None:
        """One step's generated tokens, one per request (a finished request's pad is not
        kept)."""
        streams = not self.finished[0]  # request 0's token is news (the on_token stream)
        for b, t in enumerate(tokens[:len(self.answers)]):
            if not self.finished[b]:
                self.answers[b].append(t)
                if t in self.eos:
                    self.finished[b] = True
        if self.pending:
            ev = self.pending.pop(0)
            ev.generated_token = tokens[0]
            ev.generated_tokens = list(tokens)
            self._keep(ev)
        if self.on_token is not None and tokens and streams:
            tok = self.runtime.lm.tokenizer
            self.on_token(tokens[0], tok.decode(self.answers[0], skip_special_tokens=True))

    def _keep(self, ev: StepEvent) -> None:
        self.events.append(ev)
        if self.recorder is not None:
            self.recorder.add(ev)

    # -- finish ----------------------------------------------------------------------------
    def _finish(self) -> RunResult:
        """The run's result from its events; the store is closed ``complete`` with it."""
        k, lm, events = self.knobs, self.runtime.lm, self.events
        counters = self.offloader.sim.counters()
        stop = self.stop
        texts = [lm.tokenizer.decode(a, skip_special_tokens=True).strip() for a in self.answers]
        result = RunResult(
            text=texts[0], token_ids=self.answers[0], steps=len(events),
            hits=int(counters["hits"].sum()), misses=int(counters["misses"].sum()),
            loads=int(counters["loads"].sum()), evictions=int(counters["evictions"].sum()),
            latency_measured_s=sum(e.latency_measured_s for e in events),
            latency_modeled_s=sum(e.latency_modeled_s for e in events),
            stall_measured_s=sum(e.stall_measured_s for e in events),
            stall_modeled_s=sum(e.stall_modeled_s for e in events),
            prefill_measured_s=events[0].latency_measured_s if events else 0.0,
            prefill_modeled_s=events[0].latency_modeled_s if events else 0.0,
            transfer_bytes=sum(e.transfer_bytes for e in events),
            transfer_bytes_modeled=sum(e.transfer_bytes_modeled for e in events),
            store=str(self.store_path) if self.store_path is not None else None,
            knobs=k.to_dict(), model_id=lm.model_id,
            stopped=bool(stop is not None and stop.is_set()),
            pre_evictions=sum(len(le.pre_evicted) for e in events for le in e.layers),
            host_runs=sum(len(le.host) for e in events for le in e.layers),
            prefetches=sum(len(le.prefetched) for e in events for le in e.layers),
            **self.offloader.counts())
        if len(self.requests) > 1:
            result.batch = [
                {"prompt": r.prompt, "images": image_labels(r), "text": t, "token_ids": a,
                 "prompt_tokens": n, **({"expected": r.expected}
                                        if getattr(r, "expected", None) is not None else {})}
                for r, t, a, n in zip(self.requests, texts, self.answers,
                                      self.inputs.prompt_tokens())]
        for stage in self.stages:  # e.g. token compression: visual and kept tokens
            stage.record(result)
        if self.predictor is not None:
            result.predictor_cost = self.predictor.cost_summary()
        if hasattr(self.policy, "stats"):
            result.eviction_stats = self.policy.stats()
        if self.on_result is not None:
            self.on_result(result)
        if self.recorder is not None:
            self.recorder.close("complete", summary=json.dumps(result.to_json()),
                                **{n: v for stage in STAGES
                                   for n, v in stage.store_attrs(result).items()},
                                **({"predictor_cost": json.dumps(result.predictor_cost)}
                                   if self.predictor is not None else {}))
            if self.ep_stream is not None:  # every batch is written: the summary is whole
                result.ep = self.ep_stream.result()
        return result



def image_labels(request: Request) -> list[str]:
    """A request's images as text: paths, or ``<PIL image>``."""
    images = request.images
    images = [images] if isinstance(images, (str, bytes, Image.Image)) or hasattr(
        images, "__fspath__") else list(images)
    return [str(i) if not isinstance(i, Image.Image) else "<PIL image>" for i in images]
