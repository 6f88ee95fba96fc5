"""Transfer engine: asynchronous host → device copies of experts into cache slots.

On CUDA a dedicated copy stream does the work and an event marks each transfer's end, so compute
on the default stream only waits for the expert it needs. On CPU a single background worker thread
plays the copy engine (FIFO, one transfer at a time, like one DMA lane). Either way ``submit``
returns at once with a :class:`Transfer` whose ``wait`` blocks only on that expert.

Measured times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Hashable

import torch


@dataclass
class Transfer:
    """One expert copy in flight. ``start``/``end`` are measured worker times (perf_counter s)."""

    key: Hashable
    slot: int
    nbytes: int
    submitted: float
    start: float = 0.0
    end: float = 0.0
    error: BaseException | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cuda_event: object = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        if self._cuda_event is not None:
            return self._cuda_event.query()  # type: ignore[attr-defined]
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the copy has landed; returns the seconds spent waiting (the stall)."""
        t0 = time.perf_counter()
        if self._cuda_event is not None:
            self._cuda_event.synchronize()  # type: ignore[attr-defined]
            self.end = self.end or time.perf_counter()
        else:
            self._done.wait()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0


class TransferEngine:
    """Copies ``src`` tensors into ``dst`` tensors asynchronously, in submission order."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.bytes_moved = 0
        self.completed: list[Transfer] = []  # drained by the runtime after each step
        self._lock = threading.Lock()
        if self.device.type == "cuda":
            self._stream = torch.cuda.Stream(device=self.device)
            self._queue = None
            self._worker = None
        else:
            self._stream = None
            self._queue: queue.Queue | None = queue.Queue()
            self._worker = threading.Thread(target=self._run, name="workbench-transfer", daemon=True)
            self._worker.start()

    def submit(self, key: Hashable, slot: int, dst: dict[str, torch.Tensor],
               src: dict[str, torch.Tensor]) -> Transfer:
        nbytes = sum(t.numel() * t.element_size() for t in src.values())
        tr = Transfer(key=key, slot=slot, nbytes=nbytes, submitted=time.perf_counter())
        if self._stream is not None:
            # the slot may still be read by kernels queued on the compute stream: order after them
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                tr.start = time.perf_counter()
                for name, s in src.items():
                    dst[name].copy_(s, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._stream)
            tr._cuda_event = ev
            self._finish(tr)
        else:
            assert self._queue is not None
            self._queue.put((tr, dst, src))
        return tr

    def _finish(self, tr: Transfer) -> None:
        with self._lock:
            self.bytes_moved += tr.nbytes
            self.completed.append(tr)

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            if item is None:
                return
            tr, dst, src = item
            tr.start = time.perf_counter()
            try:
                with torch.no_grad():
                    for name, s in src.items():
                        dst[name].copy_(s)
            except BaseException as e:  # surfaced to the waiting compute thread
                tr.error = e
            tr.end = time.perf_counter()
            self._finish(tr)
            tr._done.set()

    def drain(self) -> list[Transfer]:
        """Completed transfers since the last drain."""
        with self._lock:
            out, self.completed = self.completed, []
        return out

    def synchronize(self) -> None:
        """Wait for every submitted transfer."""
        if self._stream is not None:
            self._stream.synchronize()
        elif self._queue is not None:
            ev = threading.Event()
            self._queue.put((Transfer(key=None, slot=-1, nbytes=0, submitted=0.0, _done=ev), {}, {}))
            ev.wait()
            with self._lock:  # the sentinel is not a real transfer
                self.completed = [t for t in self.completed if t.key is not None]

    def close(self) -> None:
        if self._queue is not None and self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=5)
            self._worker = None
