"""Transfer engine: asynchronous host → device copies of experts into cache slots.

On CUDA a dedicated copy stream does the work, so compute on the default stream only waits for
the expert it needs. On CPU a single background worker thread plays the copy engine (FIFO, one
transfer at a time, like one DMA lane). Either way ``submit`` returns at once with a
:class:`Transfer` whose ``wait`` blocks only on that expert.

Measured times (``Transfer.start``/``end``) are ``time.perf_counter()`` seconds:

- on CPU the worker reads ``perf_counter`` around the copy;
- on CUDA the copy is bracketed by two timing events recorded on the copy stream, so the span is
  what the GPU's copy engine did, not when the host happened to look. GPU event times are placed
  on the host timeline through an *anchor*: an event recorded on a stream that never has work
  (so it completes at once) and the host time at which that happened. A span is clamped so it
  never starts before its ``submit`` and never ends before it starts.

``drain`` hands over each transfer exactly once, when its copy has completed — whether or not
anyone waited on it (a prefetch may land long after the step that issued it); transfers still
in flight stay for a later drain.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Hashable

import torch

#: on CUDA, re-anchor the GPU clock on the host clock when the anchor is older than this (s) and
#: no copy is in flight, so that the drift between the two clocks stays negligible
_REANCHOR_S = 2.0


@dataclass
class Transfer:
    """One expert copy. ``start``/``end`` are measured copy times (perf_counter s), set when the
    copy has completed and :meth:`TransferEngine.drain` handed it over (0 before)."""

    key: Hashable
    slot: int
    nbytes: int
    submitted: float
    start: float = 0.0
    end: float = 0.0
    error: BaseException | None = None
    #: CPU: held from submission until the worker has copied (a bare lock: an Event per copy
    #: cost ≈ 5 % of a run caching sub-experts, cProfile); CUDA: None (the end event tells)
    _done: threading.Lock | None = field(default=None, repr=False)
    _start_ev: object = field(default=None, repr=False)  # CUDA timing events on the copy stream
    _end_ev: object = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        """The copy has landed (never blocks)."""
        if self._end_ev is not None:
            return bool(self._end_ev.query())  # type: ignore[attr-defined]
        return not self._done.locked()

    def wait(self) -> float:
        """Block until the copy has landed; returns the seconds spent waiting (the stall)."""
        t0 = time.perf_counter()
        if self._end_ev is not None:
            self._end_ev.synchronize()  # type: ignore[attr-defined]
        else:
            self._done.acquire()  # released by the worker once the copy has landed
            self._done.release()
        waited = time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return waited


class TransferEngine:
    """Copies ``src`` tensors into ``dst`` tensors asynchronously, in submission order."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._lock = threading.Lock()
        # CPU: transfers the worker finished, not yet drained. CUDA: transfers submitted, not
        # yet drained (complete or not: drain looks at their end events).
        self._completed: list[Transfer] = []
        self._pending: list[Transfer] = []
        self._queue: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._stream = None
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            # never given work: an event recorded on it completes at once (a clock reading)
            self._clock_stream = torch.cuda.Stream(device=self.device)
            self._anchor_ev, self._anchor_host = self._anchor()
        else:
            # SimpleQueue: put is one C call (Queue.put takes a Python-level Condition; with
            # sub-experts cached, 4× the copies, it was ≈ 8 % of a run, cProfile)
            self._queue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._run, name="workbench-transfer",
                                            daemon=True)
            self._worker.start()

    # -- submit ----------------------------------------------------------------------------
    def submit(self, key: Hashable, slot: int, dst: dict[str, torch.Tensor],
               src: dict[str, torch.Tensor]) -> Transfer:
        nbytes = sum(t.numel() * t.element_size() for t in src.values())
        tr = Transfer(key=key, slot=slot, nbytes=nbytes, submitted=time.perf_counter())
        if self._stream is not None:
            stream = self._stream
            compute = torch.cuda.current_stream(self.device)  # before switching streams
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            # under the lock: the clock is never re-anchored between these events and the append
            with self._lock, torch.cuda.stream(stream):
                # the slot may still be read by kernels queued on the compute stream: order the
                # copy after them (the start event fires once they are done)
                stream.wait_stream(compute)
                start_ev.record(stream)
                for name, s in src.items():
                    dst[name].copy_(s, non_blocking=True)
                end_ev.record(stream)
                tr._start_ev, tr._end_ev = start_ev, end_ev
                self._pending.append(tr)
        else:
            assert self._queue is not None
            tr._done = threading.Lock()
            tr._done.acquire()
            self._queue.put((tr, dst, src))
        return tr

    @property
    def batches(self) -> bool:
        """Whether :meth:`submit_many` makes one job of its copies (the CPU worker); else it
        copies key by key, and a caller holding each key's views should :meth:`submit` them."""
        return self._stream is None

    def submit_many(self, keys: list[Hashable], slots: list[int],
                    dst: dict[str, torch.Tensor], src: dict[str, torch.Tensor],
                    rows: list[int]) -> list[Transfer]:
        """Copy row ``rows[i]`` of each ``src`` tensor (``[K, ...]``, e.g. a layer's host
        copies) into row ``slots[i]`` of the ``dst`` tensor of the same name (``[S, ...]``, the
        slot pool), for every ``i`` in order: one :class:`Transfer` per key, as many
        :meth:`submit` calls would give.

        On CPU the worker makes them one job — per tensor one gather of the rows and one
        scatter into the slots, instead of a copy per key and tensor (the Python around each
        copy holds the GIL the compute thread wants; sub-expert offloading submits ≈ 20 keys at
        once) — so they land together: each reports the job's measured interval, and
        ``wait`` on any waits for all. ``slots`` must be distinct (a repeated slot, or a
        single key, goes key by key). On CUDA: key by key on the copy stream, as
        :meth:`submit`."""
        if self._stream is not None or len(keys) < 2 or len(set(slots)) != len(slots):
            return [self.submit(k, s, {n: t[s] for n, t in dst.items()},
                                {n: t[r] for n, t in src.items()})
                    for k, s, r in zip(keys, slots, rows)]
        assert self._queue is not None
        nbytes = sum(t[0].numel() * t.element_size() for t in src.values())
        done = threading.Lock()  # one for the job: released once every copy of it landed
        done.acquire()
        now = time.perf_counter()
        trs = [Transfer(key=k, slot=s, nbytes=nbytes, submitted=now, _done=done)
               for k, s in zip(keys, slots)]
        self._queue.put((trs, dst, src, torch.as_tensor(slots, dtype=torch.long),
                         torch.as_tensor(rows, dtype=torch.long)))
        return trs

    # -- CPU worker ------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._queue is not None
        # grad mode is per thread: off once for the worker's life, not per copy (a context
        # manager per copy was ≈ 15 % of the worker's time on sub-expert blocks)
        torch.set_grad_enabled(False)
        get, clock, lock = self._queue.get, time.perf_counter, self._lock
        while True:
            item = get()
            if item is None:
                return
            if len(item) == 5:  # submit_many's job: its rows gathered, scattered into slots
                trs, dst, src, at, rows = item
                start, error = clock(), None
                try:
                    for name, s in src.items():
                        d = dst[name]  # (converted to the slot's dtype, as copy_ does)
                        d.index_copy_(0, at, s.index_select(0, rows).to(d.dtype))
                except BaseException as e:  # surfaced to whoever waits on any of them
                    error = e
                end = clock()
                for tr in trs:
                    tr.start, tr.end, tr.error = start, end, error
                with lock:
                    self._completed.extend(trs)
                trs[0]._done.release()
                continue
            tr, dst, src = item
            tr.start = clock()
            try:
                for name, s in src.items():
                    dst[name].copy_(s)
            except BaseException as e:  # surfaced to the waiting compute thread
                tr.error = e
            tr.end = clock()
            with lock:
                self._completed.append(tr)
            tr._done.release()

    # -- CUDA clock ------------------------------------------------------------------------
    def _anchor(self) -> tuple[object, float]:
        """An event on the idle clock stream and the host time (perf_counter s) it fired at:
        the midpoint of record → completion, off by at most half that round trip."""
        ev = torch.cuda.Event(enable_timing=True)
        t_before = time.perf_counter()
        ev.record(self._clock_stream)
        ev.synchronize()
        t_after = time.perf_counter()
        return ev, 0.5 * (t_before + t_after)

    def _place(self, tr: Transfer, now: float) -> None:
        """Put a completed CUDA transfer's event times on the host timeline: ``submitted ≤
        start ≤ end ≤ now`` (it cannot start before it was asked for, nor end after the host
        saw it complete; the clamps only absorb the anchor's error)."""
        anchor = self._anchor_ev
        start = self._anchor_host + anchor.elapsed_time(tr._start_ev) / 1e3  # type: ignore
        end = self._anchor_host + anchor.elapsed_time(tr._end_ev) / 1e3  # type: ignore
        tr.start = min(max(start, tr.submitted), now)
        tr.end = min(max(end, tr.start), now)

    # -- drain / close ---------------------------------------------------------------------
    def drain(self) -> list[Transfer]:
        """Transfers whose copy has completed since the last drain, each handed over once (in
        submission order); the others stay for a later drain."""
        if self._stream is None:
            with self._lock:
                out, self._completed = self._completed, []
            return out
        with self._lock:
            out, keep = [], []
            for t in self._pending:  # one query per transfer: none can fall between the lists
                (out if t.done else keep).append(t)
            self._pending = keep
            now = time.perf_counter()  # every copy in ``out`` had completed by now
            for tr in out:
                self._place(tr, now)
            # a fresh anchor only while nothing is in flight, so every event timed against it
            # comes after it (elapsed times stay non-negative)
            if not keep and time.perf_counter() - self._anchor_host > _REANCHOR_S:
                self._anchor_ev, self._anchor_host = self._anchor()
        return out

    def close(self) -> None:
        if self._stream is not None:
            # copies still in flight (unwaited prefetches) write into slot tensors the caller
            # frees next; the caching allocator may reuse those blocks on the compute stream
            self._stream.synchronize()
        if self._queue is not None and self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._worker = None
