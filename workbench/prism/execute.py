"""Elastic execution of sub-experts (issue 16 §2): the model's own experts forward over
sub-expert slices of the (permuted) fused tensors.

:class:`PrismView` wraps the offloader's :class:`~workbench.runtime.slots.ExpertsView`: a call
for experts ``[e, …]`` becomes a call for their sub-experts ``[e·N + s, …]`` — each one expert
of its own to the model's experts forward, with ``gate_up_proj`` rows (its gate and up halves)
and ``down_proj`` columns of the neurons the refactoring put in sub-expert s
(``perm[e][s·I/N : (s+1)·I/N]``). The offloader stores a prism layer's experts in the
*sub-expert layout* while installed (:func:`to_subexpert_layout`, at install; undone bit for bit
at removal), where each sub-expert is a contiguous block: a call slices them with no copy, and
the host store, the cache slots and the transfers move the same bytes as always. Each routed
slot (token, e, w) hands on only the sub-experts it runs, as slots (token, e·N + s, w); the
others are the forward's sentinel (no compute). Every path of the offloader (cache hits,
misses, the host, the pinned prefix, sub-expert offloading's own slots) calls the view, so all
of them run sub-experts the same way. With every sub-expert active the layer computes
Σ_s A[:, S_s]·down[:, S_s] = the expert's output (a sum in another order: equal up to float
rounding; tested).

Which sub-experts run (:meth:`PrismView.choose`, router-side, before the cache is consulted):
the proxy gate scores each sub-expert on the token by the mean |activation| of its r gate
neurons, from resident copies of their rows (:meth:`PrismView.capture_gates`); per routed
expert its ``k_active`` best run, or, with a global K, the token's K best (expert, sub-expert)
pairs by score × routing weight. The router's expert choice is kept (seed §4.3.1: "the model's
top-level router can then use these lightweight scores to select which sub-experts to
execute"); each sub-expert's output is weighted by its expert's routing weight. A trained gate
(:mod:`workbench.prism.finetune`, ``prism_router``) may score instead of the proxy.

The shortcut (``prism_shortcut``, default): when every sub-expert of every routed expert runs
(k_active = N, no global K, whole-expert caching), the view runs whole experts over the
model's unchanged layout (``whole``; the offloader then skips the layout change) and records
every routed slot as having run all N — the same sums in the model's own order, the same store
and modeled clock as the sub-expert path (tested), at the unmodified runtime's cost.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch


def _gate_up_rows(perm: torch.Tensor, N: int) -> torch.Tensor:
    """long [E, 2I]: the original ``gate_up_proj`` row at each row of the sub-expert layout
    (sub-expert s's gate rows, then its up rows, for s = 0 … N−1)."""
    E, I = perm.shape
    p = perm.reshape(E, N, 1, I // N)
    return torch.cat([p, p + I], 2).reshape(E, 2 * I)


def to_subexpert_layout(gate_up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor,
                        N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's fused expert tensors (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    in the sub-expert layout, same shapes: expert e's sub-expert s is rows
    ``s·2c … (s+1)·2c`` of ``gate_up`` (its c = I/N gate rows, then its up rows) and the
    ``[H, c]`` block ``down.reshape(E, N, H, c)[e, s]`` — the down bytes are [E, N, H, c]
    viewed as [E, H, I], so *not* the expert's down matrix. Both reshape to sub-experts
    without a copy; :func:`from_subexpert_layout` restores the input bit for bit."""
    E, H, I = down.shape
    rows = _gate_up_rows(perm.to(gate_up.device), N)
    gu = torch.gather(gate_up, 1, rows[:, :, None].expand(E, 2 * I, gate_up.shape[2]))
    d = torch.gather(down, 2, perm.to(down.device)[:, None, :].expand(E, H, I))
    d = d.reshape(E, H, N, I // N).permute(0, 2, 1, 3).contiguous().view(E, H, I)
    return gu, d


def from_subexpert_layout(gate_up: torch.Tensor, down: torch.Tensor, perm: torch.Tensor,
                          N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_subexpert_layout` (a permutation: exact)."""
    E, H, I = down.shape
    rows = _gate_up_rows(perm.to(gate_up.device), N)
    gu = torch.empty_like(gate_up).scatter_(
        1, rows[:, :, None].expand(E, 2 * I, gate_up.shape[2]), gate_up)
    d = down.reshape(E, N, H, I // N).permute(0, 2, 1, 3).reshape(E, H, I)
    d = torch.empty_like(down).scatter_(2, perm.to(down.device)[:, None, :].expand(E, H, I), d)
    return gu, d


class PrismSetup(NamedTuple):
    """What a run with ``prism=True`` hands the offloader: the refactoring's ``perm`` [L, E,
    I] and ``gates`` [L, E, N, r] (tensors), its ``subexperts`` N, and the choice — per
    expert ``k_active``, or a token's ``global_k`` best (None: per expert) — by the proxy
    gate, or by a trained ``router`` [L, E·N, H] (:mod:`workbench.prism.finetune`; None: the
    proxy gate)."""

    perm: torch.Tensor
    gates: torch.Tensor
    subexperts: int
    k_active: int
    global_k: int | None = None
    router: torch.Tensor | None = None
    #: with every sub-expert of every routed expert running (k_active = N, no global K),
    #: run whole experts instead (:class:`PrismView` ``whole``)
    shortcut: bool = True


def subexpert_shapes(shapes: dict[str, tuple[int, ...]], N: int) -> dict[str, tuple[int, ...]]:
    """One sub-expert's weight shapes (a cache slot of sub-expert offloading) from one
    expert's: ``gate_up_proj`` (2I, H) → (2I/N, H), ``down_proj`` (H, I) → (H, I/N)."""
    (two_i, H), (H2, I) = shapes["gate_up_proj"], shapes["down_proj"]
    return {"gate_up_proj": (two_i // N, H), "down_proj": (H2, I // N)}


def subexpert_rows(layer: dict[str, torch.Tensor], N: int) -> dict[str, torch.Tensor]:
    """A layer's fused tensors in the sub-expert layout as ``[E·N, …]`` rows, row e·N + s the
    sub-expert s of expert e (views, no copy): what the host store of sub-expert offloading
    addresses by (layer, e·N + s)."""
    gu, down = layer["gate_up_proj"], layer["down_proj"]
    E, H, I = down.shape
    return {"gate_up_proj": gu.reshape(E * N, 2 * (I // N), gu.shape[2]),
            "down_proj": down.reshape(E * N, H, I // N)}


#: elements of the gate-neuron rows the proxy gate gathers at once (tokens are chunked to this:
#: 64 MiB of float32 whatever the prefill's length)
_GATHER_ITEMS = 1 << 24


class PrismView:
    """An :class:`ExpertsView` over sub-experts (module docstring). ``perm`` [L, E, I] and
    ``gates`` [L, E, N, r] (a :class:`~workbench.prism.refactor.Refactoring`'s), ``layer``
    the MoE layer, ``k_active`` sub-experts per (token, expert). The weights it is handed
    are in the sub-expert layout (:func:`to_subexpert_layout`; the offloader converts the
    layer at install), so a call splits them into sub-experts without copying."""

    def __init__(self, inner, perm: torch.Tensor, gates: torch.Tensor, layer: int,
                 subexperts: int, k_active: int, act_fn, global_k: int | None = None,
                 router: torch.Tensor | None = None, whole: bool = False) -> None:
        self.inner, self.layer = inner, layer
        #: the shortcut: every sub-expert of every routed expert runs, so each call runs whole
        #: experts through the model's own forward over the *unchanged* layout (the offloader
        #: then leaves the tensors as they are) — the same sums, in the model's own order, at
        #: the unmodified runtime's cost; what ran is recorded as for sub-experts
        self.whole = whole
        #: a trained sub-expert gate's rows of this layer [E·N, H] (None: the proxy gate)
        self.router = None if router is None else router[layer]
        #: the seed's K: a token's K best sub-experts among its routed experts' (None: the
        #: k_active best of each routed expert)
        self.global_k = global_k
        self.perm = perm[layer]  # [E, I]
        self.N, self.k_active, self.act_fn = subexperts, k_active, act_fn
        # each gate neuron's gate row in the sub-expert layout (its up row: + c)
        E, I = self.perm.shape
        c = I // subexperts
        where = torch.empty_like(self.perm).scatter_(
            1, self.perm, torch.arange(I).expand(E, I))  # neuron → position in perm
        g = torch.gather(where, 1, gates[layer].reshape(E, -1))  # [E, N·r] positions
        self.gate_rows = (g // c) * 2 * c + g % c
        self.c = c
        #: (token, expert) sub-expert runs this view was asked for / ran (counters)
        self.asked = 0
        self.ran = 0
        #: the layer call in progress (:meth:`choose` … :meth:`take`): long [T, k, w] the
        #: sub-experts each slot runs (-1 padding), and int16 the same where they ran
        self._chosen_call: torch.Tensor | None = None
        self._ran_call: torch.Tensor | None = None
        self._gate_w = self._up_w = None  # [E, N·r, H]: the resident gate-neuron rows

    def capture_gates(self, gate_up: torch.Tensor, device: torch.device) -> None:
        """Keep the layer's gate-neuron rows resident on ``device`` (from ``gate_up`` [E, 2I,
        H] in the sub-expert layout, read at install before the layer is offloaded): the
        proxy gate is router-side — it picks a token's sub-experts before any expert is
        looked up, so only those need to be resident or fetched. 2·r·N rows per expert."""
        rows = self.gate_rows.to(gate_up.device)  # [E, N·r]
        E = rows.shape[0]
        H = gate_up.shape[2]
        idx = rows[:, :, None].expand(E, rows.shape[1], H)
        self._gate_w = torch.gather(gate_up, 1, idx).to(device)  # [E, N·r, H]
        self._up_w = torch.gather(gate_up, 1, idx + self.c).to(device)

    def choose(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
        """The layer call starts: long [T, k, w], the sub-experts each routed slot will run,
        -1 padding (a slot routed nowhere — id ``num_experts`` — runs none). Per expert: the
        proxy gate's k_active best (w = k_active; all, in order, when k_active = N). With a
        global K: the token's K best (token, sub-expert) pairs by score × the slot's routing
        weight (w = N, the others -1)."""
        T, k = top_k_index.shape
        N, ka, dev = self.N, self.k_active, top_k_index.device
        routed = top_k_index < num_experts
        if self.global_k is None and ka >= N:
            chosen = torch.arange(N, device=dev).expand(T, k, N)
        else:
            score = self._scores(hidden_states, top_k_index, num_experts)  # [T, k, N]
            if self.global_k is None:
                chosen = score.topk(ka, dim=-1).indices
            else:
                w = (score * top_k_weights[..., None].to(score.dtype)).masked_fill(
                    ~routed[..., None], float("-inf")).reshape(T, k * N)
                K = min(self.global_k, k * N)
                pick = torch.zeros((T, k * N), dtype=torch.bool, device=dev)
                pick.scatter_(1, w.topk(K, dim=-1).indices, True)
                pick &= torch.isfinite(w)  # a token with fewer routed slots than K
                chosen = torch.arange(N, device=dev).expand(T, k, N).masked_fill(
                    ~pick.reshape(T, k, N), -1)
        chosen = chosen.masked_fill(~routed[..., None], -1)
        self._chosen_call = chosen
        self._ran_call = torch.full(chosen.shape, -1, dtype=torch.int16, device=dev)
        self.asked += int(routed.sum()) * N  # every routed slot runs once, in some call
        self.ran += int((chosen >= 0).sum())
        return chosen

    def _scores(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                num_experts: int) -> torch.Tensor:
        """[T, k, N]: the proxy gate's score of each slot's sub-experts — the mean
        |act(gate)·up| of its r gate neurons (resident rows), tokens chunked — or the trained
        gate's (``router``)."""
        T, k = top_k_index.shape
        ids = top_k_index.long().clamp(max=num_experts - 1)
        if self.router is not None:  # trained: σ(W[e·N + s] · x), positive like the proxy's
            if self.router.device != hidden_states.device:
                self.router = self.router.to(hidden_states.device)
            with torch.no_grad():
                s = torch.sigmoid(hidden_states.float() @ self.router.T).reshape(
                    T, num_experts, self.N)
                return torch.gather(s, 1, ids[..., None].expand(T, k, self.N)).to(
                    hidden_states.dtype)
        G, H = self._gate_w.shape[1:]
        step = max(1, _GATHER_ITEMS // (k * G * H))  # tokens whose rows are gathered at once
        score = torch.empty((T, k, self.N), dtype=hidden_states.dtype,
                            device=hidden_states.device)
        with torch.no_grad():
            for a in range(0, T, step):
                x, e = hidden_states[a:a + step], ids[a:a + step]
                g = torch.einsum("th,tkgh->tkg", x, self._gate_w[e])
                u = torch.einsum("th,tkgh->tkg", x, self._up_w[e])
                score[a:a + step] = (self.act_fn(g) * u).abs().reshape(
                    len(x), k, self.N, -1).mean(-1)
        return score

    def tokens_per_subexpert(self, top_k_index: torch.Tensor, num_experts: int) -> np.ndarray:
        """int64 [E, N]: tokens of the layer call that will run each sub-expert (after
        :meth:`choose`), for the modeled clock's prices."""
        chosen = self._chosen_call
        keys = (top_k_index.long()[..., None] * self.N + chosen)[chosen >= 0]
        return torch.bincount(keys, minlength=num_experts * self.N).reshape(
            num_experts, self.N).cpu().numpy()

    def subexpert_ids(self, top_k_index: torch.Tensor) -> np.ndarray:
        """int64 [T, k·w] (after :meth:`choose`): the sub-expert id e·N + s of each (slot,
        sub-expert) the layer call will run, -1 elsewhere — the routing of a trace whose
        experts are sub-experts (:meth:`~workbench.traces.trace.Trace.as_subexperts`)."""
        chosen = self._chosen_call
        ids = (top_k_index.long()[..., None] * self.N + chosen).masked_fill(chosen < 0, -1)
        return ids.reshape(ids.shape[0], -1).cpu().numpy()

    def tokens_per_expert(self, top_k_index: torch.Tensor, num_experts: int) -> np.ndarray:
        """int64 [E]: tokens of the layer call that will run some sub-expert of each expert
        (after :meth:`choose`; with a global K a routed token may run none of an expert's)."""
        runs = (self._chosen_call >= 0).any(-1)  # [T, k]
        return torch.bincount(top_k_index.long()[runs], minlength=num_experts).cpu().numpy()

    def take(self):
        """int16 [T, k, w] (numpy): the sub-experts each slot of the layer call ran, -1
        padding (w = k_active, or N with a global K); ends the call."""
        c, self._ran_call, self._chosen_call = self._ran_call, None, None
        return None if c is None else c.cpu().numpy()

    def _sub_weights(self, weights: dict[str, torch.Tensor], n: int
                     ) -> dict[str, torch.Tensor]:
        gu, down = weights["gate_up_proj"], weights["down_proj"]  # [n, 2I, H], [n, H, I]
        N, c, H = self.N, self.c, down.shape[1]
        return {"gate_up_proj": gu.reshape(n * N, 2 * c, gu.shape[2]),
                "down_proj": down.reshape(n * N, H, c)}

    def __call__(self, weights: dict[str, torch.Tensor], experts, num_experts: int,
                 hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, *args: Any, all_routed=None, **kwargs: Any
                 ) -> torch.Tensor:
        """The layer output share of whole experts ``experts`` (``weights`` theirs, in the
        sub-expert layout): their sub-experts, sliced as views. ``all_routed``: ``experts``
        are every expert the layer routed to, ascending (a tensor; :class:`ExpertsView`) —
        then every routed slot's chosen sub-experts are in this call, and they map to the
        call's sub-experts by a sorted search with no per-call masks (the all-hit step)."""
        N = self.N
        if self.whole:
            return self._run_whole(weights, experts, num_experts, hidden_states, top_k_index,
                                   top_k_weights, *args, all_routed=all_routed, **kwargs)
        sub_w = self._sub_weights(weights, len(experts))
        if all_routed is not None and self._chosen_call is not None \
                and self._chosen_call.shape[:2] == top_k_index.shape:
            dev = top_k_index.device
            chosen = self._chosen_call.to(dev)
            T = top_k_index.shape[0]
            step = torch.arange(N, device=dev)
            subs = (all_routed.to(dev).long()[:, None] * N + step).reshape(-1).to(
                top_k_index.dtype)
            # not chosen (and routed nowhere, id E): past every sub-expert, the sentinel
            ids = (top_k_index.long()[..., None] * N + chosen).masked_fill(
                chosen < 0, num_experts * N)
            w = top_k_weights[..., None].expand(chosen.shape).masked_fill(chosen < 0, 0)
            self._ran_call = chosen.to(self._ran_call.device, torch.int16)
            return self.inner(sub_w, subs, num_experts * N, hidden_states,
                              ids.reshape(T, -1).to(top_k_index.dtype), w.reshape(T, -1),
                              *args, all_routed=subs, **kwargs)
        subs = [int(e) * N + s for e in experts for s in range(N)]
        return self.run_subexperts(sub_w, subs, num_experts, hidden_states, top_k_index,
                                   top_k_weights, *args, **kwargs)

    def fake_quant(self, weights: dict[str, torch.Tensor], experts, precision: str
                   ) -> dict[str, torch.Tensor]:
        """Whole experts ``experts`` (``weights`` theirs, in the sub-expert layout) quantised
        → dequantised to ``precision`` (ReaLB's low precision) in the model's own layout and
        put back in the sub-expert one: the values each expert has when ReaLB quantises the
        unmodified model (block groups run along the matrices' rows, which the sub-expert
        layout of ``down_proj`` does not keep)."""
        from workbench.precision import fake_quant

        perm = self.perm[torch.as_tensor([int(e) for e in experts], dtype=torch.long)]
        gu, d = from_subexpert_layout(weights["gate_up_proj"], weights["down_proj"], perm,
                                      self.N)
        gu = torch.stack([fake_quant(t, precision) for t in gu])
        d = torch.stack([fake_quant(t, precision) for t in d])
        gu, d = to_subexpert_layout(gu, d, perm, self.N)
        return {"gate_up_proj": gu, "down_proj": d}

    def record_all(self) -> None:
        """The shortcut on a layer the model's own forward ran whole (pinned): every routed
        slot of the call ran every sub-expert."""
        self._ran_call = self._chosen_call.to(self._ran_call.device, torch.int16)

    def _run_whole(self, weights, experts, num_experts, hidden_states, top_k_index,
                   top_k_weights, *args, all_routed=None, **kwargs) -> torch.Tensor:
        """The shortcut (``whole``): whole experts ``experts`` (``weights`` in the model's own
        layout), their routed slots recorded as having run every sub-expert."""
        if self._chosen_call is None or self._chosen_call.shape[:2] != top_k_index.shape:
            self.choose(hidden_states, top_k_index, top_k_weights, num_experts)
        chosen = self._chosen_call
        if all_routed is not None:  # every routed slot is in this call
            self._ran_call = chosen.to(self._ran_call.device, torch.int16)
        else:
            ids = torch.as_tensor([int(e) for e in experts], dtype=top_k_index.dtype,
                                  device=top_k_index.device)
            here = torch.isin(top_k_index, ids)[..., None] & (chosen >= 0)
            self._ran_call = torch.where(here.to(self._ran_call.device),
                                         chosen.to(self._ran_call.device, torch.int16),
                                         self._ran_call)
        return self.inner(weights, experts, num_experts, hidden_states, top_k_index,
                          top_k_weights, *args, all_routed=all_routed, **kwargs)

    def run_subexperts(self, weights: dict[str, torch.Tensor], subs, num_experts: int,
                       hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The layer output share of sub-experts ``subs`` (ids e·N + s, ``weights`` their
        own blocks: :func:`subexpert_rows`, or sliced by :meth:`__call__`) — each routed
        slot's chosen sub-experts among them, weighted by the slot's routing weight. Every call
        of a layer (hits, each miss, the host) records the slots it ran."""
        N, dev = self.N, top_k_index.device
        if self._chosen_call is None or self._chosen_call.shape[:2] != top_k_index.shape:
            self.choose(hidden_states, top_k_index, top_k_weights, num_experts)  # on its own
        chosen = self._chosen_call.to(dev)  # [T, k, w] (the host path runs on the host)
        # a slot routed nowhere has id E: its keys E·N + s are past every sub-expert's
        keys = top_k_index.long()[..., None] * N + chosen.clamp(min=0)
        mine = torch.zeros(num_experts * N + N, dtype=torch.bool, device=dev)
        mine[torch.as_tensor([int(x) for x in subs], dtype=torch.long, device=dev)] = True
        here = mine[keys] & (chosen >= 0)
        ran = self._ran_call
        self._ran_call = torch.where(here.to(ran.device), chosen.to(ran.device, torch.int16),
                                     ran)
        T = top_k_index.shape[0]
        ids = keys.masked_fill(~here, num_experts * N)  # the sentinel: not in this call
        w = top_k_weights[..., None].expand_as(here).masked_fill(~here, 0)
        return self.inner(weights, subs, num_experts * N, hidden_states,
                          ids.reshape(T, -1).to(top_k_index.dtype), w.reshape(T, -1),
                          *args, **kwargs)


__all__ = ["PrismSetup", "PrismView", "from_subexpert_layout", "subexpert_rows", "subexpert_shapes",
           "to_subexpert_layout"]
