"""The transfer engine's measured spans: every transfer is drained exactly once, only once its
copy has completed (waited on or not), with ``submitted ≤ start ≤ end``."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import workbench
from workbench.runtime.transfer import TransferEngine


class _Gate:
    """A stand-in destination whose ``copy_`` blocks until released (holds the CPU copy engine
    mid-transfer, so a test can look at a transfer that has not completed)."""

    def __init__(self, like: torch.Tensor) -> None:
        self.release = threading.Event()
        self.tensor = torch.empty_like(like)

    def copy_(self, src: torch.Tensor) -> torch.Tensor:
        if not self.release.wait(timeout=30):
            raise TimeoutError("gate never released")
        return self.tensor.copy_(src)


def _expert(i: int, n: int = 4096) -> dict[str, torch.Tensor]:
    return {"gate_up_proj": torch.full((n,), float(i)),
            "down_proj": torch.full((n // 2,), -float(i))}


def _check_span(tr, t_before: float) -> None:
    assert t_before <= tr.submitted <= tr.start <= tr.end
    assert tr.end > 0


def _drain_until(engine: TransferEngine, pred, timeout: float = 10.0) -> list:
    out: list = []
    deadline = time.perf_counter() + timeout
    while not pred(out):
        out += engine.drain()
        assert time.perf_counter() < deadline, "transfers never completed"
        time.sleep(0.001)
    return out


def test_cpu_every_transfer_drained_once_with_valid_span():
    t_before = time.perf_counter()
    eng = TransferEngine(torch.device("cpu"))
    try:
        slots = [{k: torch.empty_like(v) for k, v in _expert(0).items()} for _ in range(20)]
        trs, drained = [], []
        for i in range(20):
            trs.append(eng.submit((0, i), i, slots[i], _expert(i)))
            if i % 3 == 0:  # wait on some only: the others are never waited on (prefetches)
                assert trs[-1].wait() >= 0
            if i % 4 == 0:
                drained += eng.drain()  # mid-stream drains hand over what has completed so far
        drained += _drain_until(eng, lambda out: len(drained) + len(out) >= 20)
        assert sorted(t.key for t in drained) == [(0, i) for i in range(20)]  # none lost, no dup
        assert eng.drain() == []
        for t in drained:
            _check_span(t, t_before)
            assert t.nbytes == (4096 + 2048) * 4
        ends = [t.end for t in sorted(drained, key=lambda t: t.submitted)]
        assert ends == sorted(ends)  # one FIFO lane
        for i, s in enumerate(slots):
            assert torch.equal(s["gate_up_proj"], _expert(i)["gate_up_proj"])
    finally:
        eng.close()


def test_cpu_unwaited_transfer_drained_only_once_complete():
    eng = TransferEngine(torch.device("cpu"))
    try:
        src = _expert(7)
        gate = _Gate(src["gate_up_proj"])
        dst = {"gate_up_proj": gate, "down_proj": torch.empty_like(src["down_proj"])}
        t_before = time.perf_counter()
        tr = eng.submit((3, 7), 0, dst, src)
        time.sleep(0.02)
        assert not tr.done and eng.drain() == []  # in flight: not handed over
        gate.release.set()
        got = _drain_until(eng, lambda out: len(out) >= 1)  # never waited on
        assert got == [tr] and tr.done
        _check_span(tr, t_before)
        assert tr.end - tr.start >= 0.015  # the span covers the copy, held at the gate
        assert eng.drain() == []
        assert tr.wait() >= 0  # waiting after the drain still works
        assert torch.equal(gate.tensor, src["gate_up_proj"])
    finally:
        eng.close()


def test_cpu_failed_copy_raises_on_wait_and_is_drained():
    eng = TransferEngine(torch.device("cpu"))
    try:
        tr = eng.submit((0, 0), 0, {"w": torch.empty(3)}, {"w": torch.ones(5)})
        with pytest.raises(RuntimeError):
            tr.wait()
        got = _drain_until(eng, lambda out: len(out) >= 1)
        assert got == [tr] and tr.end >= tr.start >= tr.submitted
    finally:
        eng.close()


def test_cpu_submit_many_is_one_job_with_a_transfer_per_key():
    """``submit_many``: the rows land in their slots exactly (as key-by-key copies would put
    them), one transfer per key, each drained once with the job's interval; a job whose copy
    fails fails every transfer of it; a repeated slot goes key by key (last write wins, in
    order, as separate submits)."""
    eng = TransferEngine(torch.device("cpu"))
    try:
        src = {"gate_up_proj": torch.randn(10, 6, 4), "down_proj": torch.randn(10, 4, 3)}
        dst = {n: torch.zeros(8, *t.shape[1:]) for n, t in src.items()}
        ref = {n: t.clone() for n, t in dst.items()}
        keys, slots, rows = [(2, 9), (2, 0), (2, 4)], [5, 1, 7], [9, 0, 4]
        t_before = time.perf_counter()
        trs = eng.submit_many(keys, slots, dst, src, rows)
        assert [t.key for t in trs] == keys and [t.slot for t in trs] == slots
        assert trs[1].wait() >= 0 and all(t.done for t in trs)  # one job: all landed
        for s, r in zip(slots, rows):
            for n in src:
                ref[n][s] = src[n][r]
        assert all(torch.equal(dst[n], ref[n]) for n in src)  # and nothing else written
        got = _drain_until(eng, lambda out: len(out) >= 3)
        assert got == trs and eng.drain() == []
        assert len({(t.start, t.end) for t in got}) == 1  # the job's interval
        for t in got:
            _check_span(t, t_before)
            assert t.nbytes == (6 * 4 + 4 * 3) * 4
        # a failing job: every transfer of it raises on wait and is drained once
        bad = {"gate_up_proj": torch.zeros(8, 5, 4), "down_proj": dst["down_proj"]}
        failed = eng.submit_many([(0, 1), (0, 2)], [0, 1], bad, src, [1, 2])
        for t in failed:
            with pytest.raises(RuntimeError):
                t.wait()
        assert _drain_until(eng, lambda out: len(out) >= 2) == failed
        # a host copy in another dtype than the slots' is converted, as copy_ converts it
        half = {n: t.to(torch.bfloat16) for n, t in src.items()}
        for t in eng.submit_many([(3, 1), (3, 2)], [0, 1], dst, half, [1, 2]):
            t.wait()
        assert torch.equal(dst["gate_up_proj"][1], half["gate_up_proj"][2].float())
        # a repeated slot: key by key, in order
        again = eng.submit_many([(1, 3), (1, 6)], [2, 2], dst, src, [3, 6])
        for t in again:
            t.wait()
        assert torch.equal(dst["down_proj"][2], src["down_proj"][6])
        assert len({(t.start, t.end) for t in again}) == 2
    finally:
        eng.close()


def test_runtime_transfer_spans_are_valid_and_unique(tiny_ckpt, monkeypatch):
    """A live run with prefetch (transfers nobody waits on within their step): every drained
    transfer appears once, with a span inside the run."""
    drained: list = []
    orig = TransferEngine.drain

    def spy(self):
        out = orig(self)
        drained.extend(out)
        return out

    monkeypatch.setattr(TransferEngine, "drain", spy)
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=6, pinned_layers=1,
                           max_new_tokens=6, device="cpu", prefetch="previous-step",
                           ignore_eos=True)
    t_before = time.perf_counter()
    res = rt.run("prefetch me", record=False)
    t_after = time.perf_counter()
    assert res.loads > 0 and drained
    assert len({id(t) for t in drained}) == len(drained)
    # every copy made is a load the core counted or a prefetch it cancelled (demand-first: a
    # prefetch whose layer ran before its modeled start is cancelled in the core, while the
    # real copy engine here may have made it already)
    assert len(drained) <= res.loads + res.cancelled_prefetches
    for t in drained:
        _check_span(t, t_before)
        assert t.end <= t_after


# -- the CUDA path's bookkeeping, on a simulated device (runs everywhere) -----------------------
class _FakeGPU:
    """Just enough of ``torch.cuda`` for the engine: streams run their recorded events only when
    the test says so (or when one is synchronized), and event times come from a device clock
    with its own epoch (``perf_counter() + 1000``), as a GPU's timer has."""

    EPOCH = 1000.0

    def __init__(self) -> None:
        gpu = self
        self.current = None

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t = None
                self.stream = None

            def record(self, stream) -> None:
                self.stream = stream
                stream.ops.append(self)
                if stream.idle:  # a stream that never gets work fires at once
                    stream.run()

            def query(self) -> bool:
                return self.t is not None

            def synchronize(self) -> None:
                self.stream.run(upto=self)

            def elapsed_time(self, other) -> float:
                assert self.t is not None and other.t is not None, "event not complete"
                return (other.t - self.t) * 1e3

        class Stream:
            def __init__(self, device=None) -> None:
                self.ops: list = []
                self.waited: list = []
                self.idle = False

            def wait_stream(self, other) -> None:
                self.waited.append(other)

            def run(self, upto=None) -> None:
                """Complete the recorded events in order (up to ``upto``), 1 ms apart."""
                while self.ops:
                    ev = self.ops.pop(0)
                    ev.t = time.perf_counter() + gpu.EPOCH
                    if ev is upto:
                        return
                    time.sleep(0.001)

        class _StreamCtx:
            def __init__(self, stream) -> None:
                self.stream = stream

            def __enter__(self):
                self.prev, gpu.current = gpu.current, self.stream
                return self.stream

            def __exit__(self, *exc) -> None:
                gpu.current = self.prev

        self.Event, self.Stream = Event, Stream
        self.stream = _StreamCtx
        self.compute = Stream()
        self.current = self.compute

    def install(self, monkeypatch) -> None:
        import workbench.runtime.transfer as transfer

        monkeypatch.setattr(transfer.torch.cuda, "Stream", self.Stream)
        monkeypatch.setattr(transfer.torch.cuda, "Event", self.Event)
        monkeypatch.setattr(transfer.torch.cuda, "stream", self.stream)
        monkeypatch.setattr(transfer.torch.cuda, "current_stream", lambda device=None: self.current)


def _fake_engine(monkeypatch) -> tuple[TransferEngine, _FakeGPU]:
    gpu = _FakeGPU()
    gpu.install(monkeypatch)
    orig_init = gpu.Stream.__init__
    n = {"made": 0}

    def init(self, device=None):  # the engine's second stream is its idle clock stream
        orig_init(self, device)
        n["made"] += 1
        self.idle = n["made"] == 2

    monkeypatch.setattr(gpu.Stream, "__init__", init)
    return TransferEngine(torch.device("cuda")), gpu


def test_simulated_cuda_unwaited_transfer_drained_once_complete_on_host_timeline(monkeypatch):
    eng, gpu = _fake_engine(monkeypatch)
    src = _expert(2)
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    t_before = time.perf_counter()
    tr = eng.submit((4, 2), 3, dst, src)
    assert eng._stream.waited == [gpu.compute]  # ordered after compute, not after itself
    assert not tr.done and eng.drain() == []  # in flight: kept, not handed over
    assert tr.start == tr.end == 0.0
    eng._stream.run()  # the copy lands; nobody waits on it (a prefetch)
    assert tr.done
    time.sleep(0.005)
    got = eng.drain()
    t_after = time.perf_counter()
    assert got == [tr] and eng.drain() == []
    _check_span(tr, t_before)
    assert tr.end <= t_after  # on the host timeline (the device clock's epoch is gone)
    assert tr.end - tr.start >= 0.0009  # the copy's own span, from the device events
    assert tr.wait() >= 0  # waiting after the drain still works


def test_simulated_cuda_wait_then_drain_and_reanchor(monkeypatch):
    import workbench.runtime.transfer as transfer

    monkeypatch.setattr(transfer, "_REANCHOR_S", 0.0)  # re-anchor at every idle drain
    eng, gpu = _fake_engine(monkeypatch)
    t_before = time.perf_counter()
    seen: list = []
    anchors = {id(eng._anchor_ev)}
    for i in range(6):
        src = _expert(i, 64)
        tr = eng.submit((0, i), i, {k: torch.empty_like(v) for k, v in src.items()}, src)
        if i % 2 == 0:
            assert tr.wait() >= 0 and tr.done  # runs the copy stream up to this copy
        seen += eng.drain()
        anchors.add(id(eng._anchor_ev))
    eng._stream.run()
    seen += eng.drain()
    assert [t.key for t in seen] == [(0, i) for i in range(6)]
    assert len(anchors) > 1  # re-anchored while idle
    for t in seen:
        _check_span(t, t_before)
        assert t.end <= time.perf_counter()


# -- CUDA ---------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_spans_non_negative_and_unwaited_prefetch_drained_once_complete():
    dev = torch.device("cuda")
    eng = TransferEngine(dev)
    try:
        t_before = time.perf_counter()
        src = {"w": torch.randn(1 << 22).pin_memory()}  # 16 MiB
        dst = {"w": torch.empty(1 << 22, device=dev)}
        # hold the copy behind compute work: the copy stream orders after the compute stream
        torch.cuda._sleep(int(2e8))
        t_submit = time.perf_counter()
        tr = eng.submit((0, 1), 0, dst, src)
        assert not tr.done
        assert eng.drain() == []  # in flight: not handed over, and not lost
        deadline = time.perf_counter() + 30
        while not tr.done:  # never waited on, like a prefetch no layer used
            assert time.perf_counter() < deadline
            time.sleep(0.001)
        t_done = time.perf_counter()
        got = eng.drain()
        assert got == [tr]
        assert eng.drain() == []
        assert t_submit <= tr.submitted <= tr.start <= tr.end
        assert tr.start - t_before >= 0 and tr.end - t_before >= 0
        assert tr.end <= t_done + 0.005  # on the host timeline, not in the future
        assert tr.wait() >= 0
        assert torch.equal(dst["w"].cpu(), src["w"])

        # a stream of copies, some waited on, drained in between: each once, all valid
        slots = [{"w": torch.empty(1 << 16, device=dev)} for _ in range(16)]
        srcs = [{"w": torch.full((1 << 16,), float(i)).pin_memory()} for i in range(16)]
        trs, drained = [], []
        for i in range(16):
            trs.append(eng.submit((1, i), i, slots[i], srcs[i]))
            if i % 3 == 0:
                trs[-1].wait()
            drained += eng.drain()
        torch.cuda.synchronize()
        drained += eng.drain()
        assert sorted(t.key for t in drained) == [(1, i) for i in range(16)]
        for t in drained:
            assert t.submitted <= t.start <= t.end and t.start - t_before >= 0
    finally:
        eng.close()


@pytest.mark.gpu
@cuda
def test_cuda_runtime_transfer_spans_non_negative(tiny_ckpt, monkeypatch):
    drained: list = []
    orig = TransferEngine.drain

    def spy(self):
        out = orig(self)
        drained.extend(out)
        return out

    monkeypatch.setattr(TransferEngine, "drain", spy)
    rt = workbench.Runtime(tiny_ckpt("qwen3_moe"), cache_slots=6, pinned_layers=1,
                           max_new_tokens=6, device="cuda", prefetch="previous-step",
                           ignore_eos=True)
    t_before = time.perf_counter()
    res = rt.run("prefetch me", record=False)
    assert res.loads > 0 and drained
    assert len({id(t) for t in drained}) == len(drained) <= res.loads
    for t in drained:
        assert t_before <= t.submitted <= t.start <= t.end
