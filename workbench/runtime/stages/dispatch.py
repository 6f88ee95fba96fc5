"""Capacity-aware dispatch on the live runtime (Token Drop, Expanded Drop, MACS).

Each layer call's tokens (one step, one layer) are dispatched by the core's rule
(:meth:`workbench.sim.dispatch.Dispatch.apply_weighted`, the one trace replay runs): a
dropped assignment gets id E — the experts forward's "not here" sentinel, which
:class:`~workbench.runtime.slots.ExpertsView` maps past the layer's experts — and weight 0
(the others keep theirs, not renormalised: CAI-MoE's default); MACS may move an assignment to
another expert instead (new id and weight); Expanded Drop may widen the routing. Only the real
tokens are dispatched: padding takes no capacity.
"""

from __future__ import annotations

import numpy as np
import torch

from workbench.models.adapter import MoEBlock
from workbench.runtime.stages.base import (ROUTER_LOGITS, TOKEN_CONTEXT, LayerCall,
                                           RunContext, Stage, StageSetup)
from workbench.knobs import Knobs
from workbench.sim.dispatch import DECODE, DISPATCH, PREFILL
from workbench.sim.knobs import ExpertParallelKnobs

#: the policies that read the tokens' context (:class:`workbench.sim.macs.DispatchContext`)
_READ_CONTEXT = ("macs", "capacity-expanded")


def _reads_gates(pol) -> bool:
    """Whether ``pol`` reads every expert's router probability (MACS rerouting, Expanded
    Drop)."""
    return pol.name in _READ_CONTEXT and (getattr(pol, "reroute", False)
                                          or "router" in pol.needs)


class DispatchStage(Stage):
    """The run's dispatch policy (``topk``: off) and what it did, over the run: (token,
    expert) assignments the router made, those dropped, rerouted (MACS) and added beyond the
    router's top-k (Expanded Drop). ``centroids``: MACS's calibrated μ [L, E, D] on the
    device (None: η acts as 0).

    A policy that reads every expert's router probability also needs :data:`ROUTER_LOGITS`
    (:attr:`needs` is per stage): its gates are the softmax of the logits the model's router
    computed for the call, not of a second router run (see :meth:`_context`)."""

    needs = frozenset({TOKEN_CONTEXT})
    routes_nowhere = True
    COUNTS = ("dispatch_assigned", "dispatch_dropped", "dispatch_rerouted", "dispatch_added")

    def __init__(self, policy, centroids: torch.Tensor | None = None) -> None:
        self.policy = policy
        if _reads_gates(policy):
            self.needs = frozenset({TOKEN_CONTEXT, ROUTER_LOGITS})
        self.dispatch_assigned = self.dispatch_dropped = 0
        self.dispatch_rerouted = self.dispatch_added = 0
        #: whether the policy dispatches a prefill step, a decode step (its ``acts_on``,
        #: asked once: the scope is the run's)
        self._acts = (policy.acts_on(PREFILL), policy.acts_on(DECODE))
        #: the unit-norm centroids [L, E, D] (float32), once a run. On the CPU in one
        #: operation: the same bits as normalising each layer's (checked for D up to 40 000;
        #: the reduction runs along D alone); elsewhere layer by layer, as before, since a
        #: GPU's reduction may split rows by how many there are
        self._unit_centroids = None
        if centroids is not None:
            c = centroids.float()
            norm = torch.nn.functional.normalize
            self._unit_centroids = (norm(c, dim=-1) if c.device.type == "cpu" else
                                    torch.stack([norm(x, dim=-1) for x in c]))
        #: ``((the step's modality, request, real rows), T, (modality, image of each
        #: token))`` of the rows dispatched last (:meth:`_tokens`)
        self._tokens_of: tuple | None = None

    @classmethod
    def from_knobs(cls, knobs: Knobs, run: RunContext) -> "DispatchStage | None":
        """The ``dispatch`` knob's policy; MACS gets the model's calibration (expert classes
        for its dynamic capacity, centroids for its rerouting) when a switch needs it."""
        ep: ExpertParallelKnobs = knobs.group("ep")  # the dispatch's and MACS's fields
        pol = DISPATCH.get(ep.dispatch).for_knobs(ep, knobs.group("generation").seed)
        cal, centroids = run.runtime.macs_calibration(knobs, pol), None
        if cal is not None:
            pol.classes = cal.classes
            if ep.macs_reroute and ep.macs_eta > 0:
                centroids = torch.as_tensor(np.asarray(cal.centroids, np.float32),
                                            device=run.device)
        return cls(pol, centroids) if pol.changes_routing else None

    @classmethod
    def from_setup(cls, setup: StageSetup) -> "DispatchStage | None":
        pol = setup.dispatch
        if pol is None or not pol.changes_routing:
            return None
        return cls(pol, setup.macs_centroids)

    def max_added(self, num_experts: int) -> int:
        return self.policy.max_added(num_experts)

    def needs_at(self, step: int) -> frozenset[str]:
        """Nothing in a step outside the policy's scope (:meth:`route` reads neither the token
        context nor the router's logits there)."""
        return self.needs if self._acts[step > 0] else frozenset()

    def route(self, call: LayerCall) -> None:
        """Dispatch the call's real tokens; the dropped and rerouted experts go to ``call``
        for the layer event. A step outside the policy's ``capacity_scope``
        (:meth:`~workbench.sim.dispatch.Dispatch.acts_on`; step 0 is the prefill, as the
        store's ``phase`` records it) keeps the router's routing; its assignments count."""
        if not self._acts[call.step > 0]:
            n = call.ids.shape[0] if call.real is None else int(np.count_nonzero(call.real))
            self.dispatch_assigned += n * call.ids.shape[1]
            return
        if call.mask is None:
            call.ids, call.weights, call.dropped, call.rerouted = self._rows(
                call, call.hidden_states, call.ids, call.weights, None, call.logits)
            return
        rows = call.mask.nonzero().squeeze(1)
        ids, w = call.ids, call.weights
        # the real rows by index_select: the same copy as ``t[rows]``, ≈ 4× cheaper per call
        pick = lambda t: t.index_select(0, rows)  # noqa: E731
        idx, new_w, sub, rer = self._rows(call, pick(call.hidden_states), pick(ids), pick(w),
                                          call.real,
                                          None if call.logits is None else pick(call.logits))
        if sub is None and rer is None and idx.shape[1] == ids.shape[1]:
            return
        if idx.shape[1] > ids.shape[1]:  # Expanded Drop widened the routing
            extra, n_all = idx.shape[1] - ids.shape[1], ids.shape[0]
            ids = torch.cat([ids, ids.new_full((n_all, extra), call.block.num_experts)], 1)
            w = torch.cat([w, w.new_zeros((n_all, extra))], 1)
        full = []
        for part in (sub, rer):
            f = None
            if part is not None:
                f = np.full((ids.shape[0], part.shape[1]), -1, np.int16)
                f[call.real] = part
            full.append(f)
        call.ids, call.weights = ids.index_copy(0, rows, idx), w.index_copy(0, rows, new_w)
        call.dropped, call.rerouted = full

    def _rows(self, call: LayerCall, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
              top_k_weights: torch.Tensor, real: np.ndarray | None,
              logits: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None, np.ndarray | None]:
        """The dispatch of rows that are all real tokens (``real``: which of the step's
        positions they are; None: all; ``logits``: the model's router logits of these rows,
        None where the offloader kept none): the routing, the dropped experts ``[T, k]`` (int16,
        -1 = kept; None: nothing dropped) and the experts rerouted away from (same form)."""
        b = call.block
        T, K = top_k_index.shape
        E = b.num_experts
        # most layer calls overflow nothing (a decode step's one token never does): one
        # bincount on the device decides it, without the copy and sort of apply()
        top = int(torch.bincount(top_k_index.reshape(-1), minlength=E).max()) if T else 0
        if self.policy.fits(top, T, K, E):
            self.dispatch_assigned += T * K
            return top_k_index, top_k_weights, None, None
        ids = top_k_index.detach().to("cpu").numpy()
        w = top_k_weights.detach().float().to("cpu").numpy()
        ctx = (self._context(call, b, hidden_states, real, logits)
               if self.policy.name in _READ_CONTEXT else None)
        new, new_w, rer = self.policy.apply_weighted(
            ids[:, None, :].astype(np.int16), w[:, None, :], np.zeros(T, np.int64), E, ctx)
        new, new_w, rer = new[:, 0, :], new_w[:, 0, :], rer[:, 0, :K]
        sw = getattr(self.policy, "last_weights", None)
        if sw is not None:  # MACS: the effective load's weights, per position of the step
            full = np.ones(len(real) if real is not None else T, np.float32)
            full[real if real is not None else slice(None)] = sw[:, 0]
            call.token_weights = full
        dropped = (new[:, :K] < 0) & (ids >= 0)
        self.dispatch_assigned += int((ids >= 0).sum())
        n, n_rer = int(dropped.sum()), int(rer.sum())
        n_add = int((new[:, K:] >= 0).sum())
        if not n and not n_rer and new.shape[1] == K and np.array_equal(new, ids) \
                and np.array_equal(new_w, w):
            return top_k_index, top_k_weights, None, None
        self.dispatch_dropped += n
        self.dispatch_rerouted += n_rer
        self.dispatch_added += n_add
        dev = top_k_index.device
        out_ids = torch.as_tensor(np.where(new < 0, E, new), dtype=top_k_index.dtype, device=dev)
        out_w = torch.as_tensor(new_w, device=dev).to(top_k_weights.dtype)
        return (out_ids, out_w,
                np.where(dropped, ids, -1).astype(np.int16) if n else None,
                np.where(rer, ids, -1).astype(np.int16) if n_rer else None)

    def _context(self, call: LayerCall, b: MoEBlock, hidden_states: torch.Tensor,
                 real: np.ndarray | None, logits: torch.Tensor | None):
        """What MACS or Expanded Drop reads of this layer call's tokens
        (:class:`DispatchContext`, one layer): modality and image of each token, the entropy
        of softmax over its MoE input's features (MACS semantic load), every expert's router
        probability (MACS rerouting, Expanded Drop) and the cosine to the calibrated
        centroids (MACS rerouting) — each only when the policy asks for it.

        The probabilities are ``softmax(logits.float())`` (float32 [T, E]) of the logits the
        model's router computed for the call (``call.logits``, the rows dispatched of them:
        ``logits``), with no second router run: the router's top-k weights, which the
        unchanged assignments keep, come from those same logits, so a rerouted or added
        assignment's weight is of the same computation as its neighbours'. (Until stop 57
        the router ran again on the real rows alone when a call had padding or finished
        requests: a product over fewer rows may round differently in the last bits, so a
        rerouted weight could differ from the model's own by an ulp;
        ``check_dispatch_same.py`` compares the tokens, counters and routing.) Without the
        model's logits (a block whose router the offloader does not see) the router runs
        again on the rows."""
        from workbench.sim.macs import DispatchContext

        pol = self.policy
        T = hidden_states.shape[0]
        mod, img, groups = self._tokens(call, real, T)
        ent = gates = aff = None
        with torch.no_grad():
            z = hidden_states.float()
            if getattr(pol, "semantic_load", False):
                logp = torch.log_softmax(z, dim=-1)
                ent = (-(logp.exp() * logp).sum(-1)).cpu().double().numpy()[:, None]
            if _reads_gates(pol):
                if logits is None:
                    logits, _, _ = b.route(hidden_states)
                gates = torch.softmax(logits.float(), dim=-1).cpu().numpy()[:, None, :]
                if self._unit_centroids is not None and getattr(pol, "eta", 0) > 0:
                    mu = self._unit_centroids[b.index]
                    cos = torch.nn.functional.normalize(z, dim=-1) @ mu.T
                    aff = cos.cpu().numpy()[:, None, :]
        return DispatchContext(modality=mod, layers=np.array([b.index]), features_entropy=ent,
                               image_of=img, gates=gates, affinity=aff, image_groups=groups)

    def _tokens(self, call: LayerCall, real: np.ndarray | None, T: int
                ) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """``(modality int8 [T], image of each token [T], the visual tokens image by image)``
        of the ``T`` rows dispatched (:func:`~workbench.sim.macs.image_runs`,
        :func:`~workbench.sim.macs.image_groups`; read-only, shared by the step's calls),
        computed once per step: every layer call of a step hands the same arrays (the stage
        holds them, so ``is`` cannot mistake a new array for a freed one's address)."""
        from workbench.sim.macs import image_groups, image_runs

        key = (call.modality, call.request, real)
        if self._tokens_of is not None and self._tokens_of[1] == T and all(
                a is b for a, b in zip(self._tokens_of[0], key)):
            return self._tokens_of[2]
        mod, req = call.modality, call.request
        if mod is None or len(mod) != (len(real) if real is not None else T):
            mod, req = np.zeros(T, np.int8), None
        elif real is not None:
            mod, req = mod[real], None if req is None else req[real]
        mod = np.asarray(mod, np.int8)
        img = image_runs(mod, req)
        out = mod, img, image_groups(mod, img)
        self._tokens_of = (key, T, out)
        return out
