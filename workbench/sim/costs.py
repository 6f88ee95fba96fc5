"""What the modeled clock prices work with: sizes of one expert and one layer's dense part,
and the per-operation prices a :class:`~workbench.sim.profiles.HardwareProfile` gives them.

:class:`CostSpec` holds sizes (bytes; FLOPs per token); :class:`Prices` binds one to a profile
and is the single place a group's modeled durations come from (live runs and replay alike;
replay prices many counts at once with :meth:`Prices.many`, which calls the same methods).
The hybrid rule (:func:`runs_on_host`) lives here because it is a comparison of prices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from workbench.sim.profiles import HardwareProfile, TargetModel


#: largest size (bytes) or FLOP count a cost spec may hold: far above any real model's (a
#: 1 EB expert), and small enough that the modeled clock's sums and products of them stay
#: finite (1.7e308 bytes overflowed to inf and crashed replay)
MAX_COST_VALUE = 1e18


@dataclass(frozen=True)
class CostSpec:
    """Sizes the modeled clock prices work with (bytes; FLOPs per token)."""

    source: str  # "loaded model" or a target model name
    expert_bytes: float
    expert_flops_per_token: float
    dense_bytes_per_layer: float
    dense_flops_per_token_per_layer: float
    # hidden-state bytes of one token (hidden size × dtype bytes): what hybrid mode moves over
    # the link to run an expert on the host and back; 0 in stores written before it existed
    activation_bytes_per_token: float = 0.0

    def part(self, n: int) -> "CostSpec":
        """One ``n``-th of every expert (MoE-Prism: an expert split into ``n`` equal neuron
        groups has ``1/n`` of its bytes and FLOPs a sub-expert); the dense part as is."""
        return self if n == 1 else replace(
            self, expert_bytes=self.expert_bytes / n,
            expert_flops_per_token=self.expert_flops_per_token / n)

    @classmethod
    def from_target(cls, target: TargetModel) -> "CostSpec":
        """Costs of a real model: each MoE layer of the trace is priced as one of its layers."""
        return cls(
            source=target.name,
            expert_bytes=float(target.expert_bytes),
            expert_flops_per_token=float(target.expert_flops_per_token),
            dense_bytes_per_layer=target.backbone_bytes / target.num_layers,
            dense_flops_per_token_per_layer=float(target.dense_flops_per_token_per_layer),
            activation_bytes_per_token=float(target.hidden_size * 2),  # bf16 hidden states
        )


def layer_tokens(num_tokens: int, kept: np.ndarray | None, topk_ids: np.ndarray) -> int:
    """Tokens of a step of ``num_tokens`` that reach a layer whose routing is ``topk_ids``
    ``[T, k]``: every token that was kept (``kept`` None = all: ``num_tokens``) or that the
    layer routed (a pruned visual token still runs the pinned prefix, where it has routing;
    behind the prefix its routing is all -1). Trace grouping counts the same way
    (:meth:`workbench.traces.trace.Trace.groups`)."""
    if kept is None:
        return num_tokens
    kept = np.asarray(kept, bool)
    T = int(topk_ids.shape[0])
    if kept.all() or len(kept) != T:
        return num_tokens
    ids = np.asarray(topk_ids).reshape(T, -1)
    return int((kept | (ids >= 0).any(1)).sum())


def host_expert_time(profile: HardwareProfile, cost: CostSpec, n_tokens: int) -> float:
    """Modeled seconds to run one routed expert for ``n_tokens`` on the host copy (GPU–CPU
    hybrid mode): the tokens' hidden states cross the link to the host and the outputs come
    back (two transfers), and the host computes the expert over its weights in host memory."""
    act = n_tokens * cost.activation_bytes_per_token
    return 2 * profile.transfer_time(act) + profile.host_compute_time(
        n_tokens * cost.expert_flops_per_token, cost.expert_bytes)


def runs_on_host(profile: HardwareProfile, cost: CostSpec, n_tokens: int) -> bool:
    """The hybrid rule (VisMMOE §3.4 "GPU–CPU hybrid"; the comparison Fiddler makes): a
    missed expert runs on the host when doing so ends sooner than copying it and computing it
    on the device, i.e. ``host_expert_time(n) < transfer_time(expert_bytes) +
    compute_time(n·flops, expert_bytes)``. It depends only on the expert's token count, so the
    live runtime and trace replay decide every miss the same way. Decode (one token) usually
    goes to the host, large prefill groups to the device."""
    device = profile.transfer_time(cost.expert_bytes) + profile.compute_time(
        n_tokens * cost.expert_flops_per_token, cost.expert_bytes)
    return host_expert_time(profile, cost, n_tokens) < device


class Prices:
    """Modeled seconds of the operations of one group, for one (profile, cost) pair.

    Every price is a method of one argument, memoised per instance:
    ``dense(T)``: attention, router and shared experts of one MoE layer over T tokens;
    ``expert(n)``: one routed expert over n tokens on the device; ``transfer``: one expert over
    the link; ``host(n)`` / ``on_host(n)``: hybrid mode's host run and its rule;
    ``subexpert_op(runs, parts, N)``: an expert running sub-experts (MoE-Prism). ``cost`` None
    (a trace without model sizes) prices nothing: :attr:`available` is False and every price is
    0, so hit counts stay exact while times are reported as unavailable.
    """

    def __init__(self, profile: HardwareProfile, cost: CostSpec | None) -> None:
        self.profile = profile
        self.cost = cost
        self.available = cost is not None
        self.transfer = profile.transfer_time(cost.expert_bytes) if cost is not None else 0.0
        # a live run prices the same few token counts at every layer: remember them
        self.dense = functools.lru_cache(maxsize=4096)(self._dense)
        self.expert = functools.lru_cache(maxsize=4096)(self._expert)
        self.host = functools.lru_cache(maxsize=4096)(self._host)
        self.on_host = functools.lru_cache(maxsize=4096)(self._on_host)
        self.subexpert_op = functools.lru_cache(maxsize=4096)(self._subexpert_op)

    @staticmethod
    def shared(profile: HardwareProfile, cost: CostSpec | None) -> "Prices":
        """The prices of (``profile``, ``cost``), one instance per pair for the process (the
        last 16 pairs used): every run of the same model and profile reads the memos the
        runs before it filled, instead of pricing each token count and sub-expert code
        again. A price is a pure function of the pair (both frozen), so sharing changes no
        figure; concurrent runs may fill a memo entry twice, with the same value."""
        try:
            return _shared_prices(profile, cost)
        except TypeError:  # (a pair that cannot be hashed: its own instance)
            return Prices(profile, cost)

    def _dense(self, tokens: int) -> float:
        c = self.cost
        if c is None:
            return 0.0
        return self.profile.compute_time(tokens * c.dense_flops_per_token_per_layer,
                                         c.dense_bytes_per_layer)

    def _expert(self, tokens: int) -> float:
        c = self.cost
        if c is None:
            return 0.0
        return self.profile.compute_time(tokens * c.expert_flops_per_token, c.expert_bytes)

    def expert_in(self, precision: str):
        """``expert`` priced in ``precision`` (``native``, ``fp8``, ``nvfp4``): a function of
        the token count, memoised (:meth:`HardwareProfile.precision_compute_time`: a
        precision the profile lacks costs what native does)."""
        if precision == "native":
            return self.expert
        memo = self.__dict__.setdefault("_expert_in", {})
        if precision not in memo:
            c = self.cost

            def price(tokens: int) -> float:
                if c is None:
                    return 0.0
                return self.profile.precision_compute_time(
                    tokens * c.expert_flops_per_token, c.expert_bytes, precision)

            memo[precision] = functools.lru_cache(maxsize=4096)(price)
        return memo[precision]

    def _subexpert_op(self, tokens: int, parts: int, n: int,
                      precision: str = "native") -> float:
        """MoE-Prism: modeled seconds of one expert's op when it runs ``parts`` of its ``n``
        sub-experts over ``tokens`` (token, sub-expert) runs in all — one op (its sub-experts
        run as one grouped kernel: one overhead) of the runs' FLOPs, each ``1/n`` of the
        expert's per token, and of the distinct sub-experts' bytes, each ``1/n`` of the
        expert's. Every sub-expert run (``parts = n``, ``tokens = n·t``) = :meth:`expert` (t);
        in ``precision`` (ReaLB's low precision) = :meth:`expert_in` (t)."""
        c = self.cost
        if c is None:
            return 0.0
        flops, nbytes = tokens * c.expert_flops_per_token / n, parts * c.expert_bytes / n
        if precision == "native":
            return self.profile.compute_time(flops, nbytes)
        return self.profile.precision_compute_time(flops, nbytes, precision)

    def subexperts(self, tokens: np.ndarray, low: np.ndarray | None = None,
                   precision: str = "native") -> np.ndarray:
        """:meth:`subexpert_op` of each row of ``tokens`` int [experts, N] (the tokens that
        run each of an expert's N sub-experts); the rows where ``low`` (bool [experts]) is
        set in ``precision``."""
        t = np.asarray(tokens, np.int64)
        N = t.shape[1]
        # (runs, parts) of each row as one number; counts are ≥ 0: parts = the nonzero ones
        return self.subexperts_coded(t.sum(1) * (N + 1) + (t != 0).sum(1), N, low, precision)

    def subexperts_coded(self, code: np.ndarray, N: int, low: np.ndarray | None = None,
                         precision: str = "native") -> np.ndarray:
        """:meth:`subexperts` of experts given by their (runs, parts) ``code`` int64 [experts]
        (runs·(N + 1) + parts: ``runs`` (token, sub-expert) runs over ``parts`` distinct
        sub-experts of N)."""
        code = np.asarray(code, np.int64)
        if low is None or not np.any(low):
            return self._subexpert_table(code, N, "native")
        low = np.asarray(low, bool)
        out = np.zeros(len(code))
        for prec, rows in (("native", ~low), (precision, low)):
            if rows.any():
                out[rows] = self._subexpert_table(code[rows], N, prec)
        return out

    #: the largest (runs, parts) code :meth:`subexperts` keeps a table up to (float64: 512
    #: KiB per (N, precision)); larger codes are priced per call, once per distinct code
    SUBEXPERT_TABLE = 1 << 16

    def _subexpert_table(self, code: np.ndarray, N: int, precision: str) -> np.ndarray:
        """:meth:`subexpert_op` of each (runs, parts) ``code`` (runs·(N + 1) + parts): read
        from a table of the prices seen so far, kept per (N, precision) on this instance (a
        live run prices the same few codes at every layer call), each entry priced once."""
        if code.size == 0:
            return np.zeros(0)
        top = int(code.max())
        if top >= self.SUBEXPERT_TABLE:
            return self.many(lambda c: self.subexpert_op(c // (N + 1), c % (N + 1), N,
                                                         precision), code)
        memo = self.__dict__.setdefault("_subexpert_tables", {})
        table = memo.get((N, precision))
        if table is None or top >= len(table):
            grown = np.full(min(max(top + 1, 2 * (0 if table is None else len(table)), 256),
                                self.SUBEXPERT_TABLE), np.nan)
            if table is not None:
                grown[:len(table)] = table
            memo[(N, precision)] = table = grown
        out = table[code]
        new = np.isnan(out)
        if new.any():  # prices are finite: NaN marks a code not priced yet
            for c in np.unique(code[new]).tolist():
                table[c] = self.subexpert_op(c // (N + 1), c % (N + 1), N, precision)
            out = table[code]
        return out

    def part(self, n: int) -> "Prices":
        """The prices of one ``n``-th of each expert (:meth:`CostSpec.part`: a sub-expert's
        transfer), same profile; memoised."""
        if n == 1:
            return self
        memo = self.__dict__.setdefault("_part", {})
        if n not in memo:
            memo[n] = Prices(self.profile, None if self.cost is None else self.cost.part(n))
        return memo[n]

    def _host(self, tokens: int) -> float:
        return host_expert_time(self.profile, self.cost, tokens) if self.cost is not None else 0.0

    def _on_host(self, tokens: int) -> bool:
        return runs_on_host(self.profile, self.cost, tokens) if self.cost is not None else False

    @staticmethod
    def many(fn: Callable[[int], float], counts: np.ndarray, dtype=np.float64) -> np.ndarray:
        """``fn`` of every element of ``counts`` (whole numbers ≥ 0), calling ``fn`` once per
        distinct count; linear in ``len(counts)`` when the counts are small (a lookup table
        indexed by count), a sort otherwise."""
        counts = np.asarray(counts).reshape(-1)
        if counts.size == 0:
            return np.zeros(0, dtype)
        top = int(counts.max())
        if counts.min() >= 0 and top <= 4 * counts.size + 1024:
            seen = np.zeros(top + 1, bool)
            seen[counts] = True
            vals = np.flatnonzero(seen)
            table = np.zeros(top + 1, dtype)
            table[vals] = [fn(int(v)) for v in vals]
            return table[counts]
        vals, inv = np.unique(counts, return_inverse=True)
        return np.array([fn(int(v)) for v in vals], dtype)[inv.reshape(-1)]


@functools.lru_cache(maxsize=16)
def _shared_prices(profile: HardwareProfile, cost: CostSpec | None) -> Prices:
    """:meth:`Prices.shared`'s instances."""
    return Prices(profile, cost)

