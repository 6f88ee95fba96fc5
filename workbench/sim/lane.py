"""The modeled transfer lane: one copy over the link at a time, in the order of ``transfer_order``.

- ``fifo``: every copy (demand load or prefetch) is queued behind every copy before it, so a
  demand miss waits for each prefetch queued ahead of it.
- ``demand-first`` (VisMMOE §3.4's orchestrator, MoE-Infinity, KTransformers): a prefetch is
  *pending* until it starts; a demand load that arrives at time T goes before every pending
  prefetch that has not started by T (a copy already in flight finishes). So a demand load
  waits for at most one prefetch: it starts less than one transfer time after
  max(T, the previous demand load's end). The simulator cancels pending prefetches whose
  layer has already run (:meth:`TransferLane.cancel`); their slot is freed, no copy is made.

With no prefetch both orders are the same lane (nothing is ever pending). Times are modeled
seconds; nothing here imports torch.
"""

from __future__ import annotations

from typing import Callable

from workbench.sim.cache import Key

#: the values of the ``transfer_order`` knob (the first is today's)
TRANSFER_ORDERS = ("fifo", "demand-first")
#: the orders under which a prefetch not yet started can be cancelled (its layer has run)
CANCELLING_ORDERS = frozenset({"demand-first"})

#: called for each copy that starts: (key, start, end)
OnStart = Callable[[Key, float, float], None]


class TransferLane:
    """When each queued copy starts and lands (``ready``), under ``order``."""

    def __init__(self, transfer_s: float, order: str = "fifo") -> None:
        if order not in TRANSFER_ORDERS:
            raise ValueError(f"transfer_order must be one of {', '.join(TRANSFER_ORDERS)}, "
                             f"not {order!r}")
        self.transfer_s = float(transfer_s)
        self.order = order
        self.free = 0.0  # when the copies that have started are all done
        #: demand-first: prefetches not started, in order: (key, issued at, target layer)
        self.pending: list[tuple[Key, float, int]] = []
        self.ready: dict[Key, float] = {}  # modeled time each started copy lands

    def _start(self, key: Key, at: float, on_start: OnStart) -> None:
        start = max(self.free, at)
        self.free = end = start + self.transfer_s
        self.ready[key] = end
        on_start(key, start, end)

    def advance(self, t: float, on_start: OnStart) -> None:
        """Start, in order, the pending prefetches that begin before ``t`` (a demand at ``t``
        goes before the others)."""
        while self.pending:
            key, at, _ = self.pending[0]
            if max(self.free, at) >= t:
                return
            self.pending.pop(0)
            self._start(key, at, on_start)

    def demand(self, key: Key, now: float, on_start: OnStart) -> None:
        """A demand load issued at ``now``: behind the copies started by then (demand-first)
        or behind every queued copy (fifo)."""
        if self.pending:  # (else nothing can start before it)
            self.advance(now, on_start)
        self._start(key, now, on_start)

    def prefetch(self, key: Key, now: float, layer: int, on_start: OnStart) -> None:
        """A prefetch of ``key`` (for ``layer``) issued at ``now``."""
        if self.order == "fifo":
            self._start(key, now, on_start)
        else:
            self.pending.append((key, now, int(layer)))

    def land(self, key: Key, on_start: OnStart) -> float | None:
        """When ``key``'s copy lands (None: no copy of it is queued); a pending prefetch and
        those ahead of it start first (the compute lane waits for it: no demand comes
        between)."""
        if self.pending and any(k == key for k, _, _ in self.pending):
            while True:
                k, at, _ = self.pending.pop(0)
                self._start(k, at, on_start)
                if k == key:
                    break
        return self.ready.pop(key, None)

    def cancel(self, now: float, ran_layer: int | None, key: Key | None,
               on_start: OnStart) -> list[Key]:
        """Drop pending prefetches that have not started by ``now``: those for layers ≤
        ``ran_layer`` (their layer has run), or ``key`` (it was evicted). Returns them."""
        if not self.pending:
            return []
        self.advance(now, on_start)
        gone = [k for k, _, lay in self.pending
                if k == key or (ran_layer is not None and lay <= ran_layer)]
        if gone:
            drop = set(gone)
            self.pending = [p for p in self.pending if p[0] not in drop]
        return gone
