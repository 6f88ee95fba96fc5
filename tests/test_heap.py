"""A run's heap frozen for the garbage collector (workbench.runtime.heap): frozen during a run
and only then, the run's own cycles collected when it ends, a foreign freeze and the option
respected, concurrent runs sharing one freeze, and cycles that die in the old heap collected
by the periodic full collection."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import workbench
from workbench.runtime import heap


class _Node:
    """An object that can hold a reference cycle (and a weak reference)."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def clean_gc(monkeypatch):
    """Nothing frozen and no run inside :func:`frozen_heap` before the test, the periodic
    full collection's count at 0; nothing frozen after it (a failed test must not leave the
    heap frozen for the rest of the worker)."""
    assert gc.get_freeze_count() == 0 and heap._depth == 0 and not heap._froze
    monkeypatch.setattr(heap, "_since_full", 0)
    monkeypatch.delenv(heap.GC_FREEZE_ENV, raising=False)  # the default: on
    yield
    gc.unfreeze()
    heap._froze = False


def test_a_run_freezes_the_heap_it_starts_with_and_only_during_the_run(embedded, clean_gc):
    seen, made = [], []

    def on_token(_id, _text):
        seen.append(gc.get_freeze_count())
        if not made:  # a cycle the run makes and drops: collected by the run's end
            n = _Node()
            made.append(weakref.ref(n))

    workbench.Runtime(embedded, max_new_tokens=3).run("hello", record=False,
                                                      on_token=on_token)
    assert seen and min(seen) > 10_000  # the model and the libraries were frozen
    assert gc.get_freeze_count() == 0  # nothing stays frozen after the run
    assert made and made[0]() is None


def test_the_option_off_and_a_foreign_freeze_are_left_alone(embedded, clean_gc):
    rt = workbench.Runtime(embedded, max_new_tokens=2)
    seen = []
    with workbench.set_options(gc_freeze=False):
        rt.run("hello", record=False, on_token=lambda *_: seen.append(gc.get_freeze_count()))
    assert seen and max(seen) == 0
    gc.freeze()  # someone else's freeze: the run neither adds to it nor undoes it
    frozen = gc.get_freeze_count()
    rt.run("hello", record=False)
    # (frozen objects are still freed by reference counting: the count may only fall)
    assert frozen - 1000 < gc.get_freeze_count() <= frozen


def test_concurrent_runs_share_one_freeze(clean_gc):
    """The first to enter freezes, the last to leave unfreezes (runs in threads)."""
    inside, leave_a = threading.Event(), threading.Event()
    counts = {}

    def a():
        with heap.frozen_heap():
            inside.set()
            leave_a.wait(30)
        counts["a left"] = gc.get_freeze_count()

    t = threading.Thread(target=a)
    t.start()
    assert inside.wait(30)
    with heap.frozen_heap():
        counts["both in"] = gc.get_freeze_count()
        leave_a.set()
        t.join(30)
        counts["b alone"] = gc.get_freeze_count()
    assert counts["both in"] > 0 and counts["a left"] > 0 and counts["b alone"] > 0
    assert gc.get_freeze_count() == 0


def test_cycles_that_die_in_the_old_heap_wait_for_the_periodic_full_collection(
        monkeypatch, clean_gc):
    monkeypatch.setattr(heap, "FULL_COLLECTION_EVERY", 3)
    old = _Node()  # alive when the heap is frozen, dropped during the frozen period
    ref = weakref.ref(old)
    for i in range(3):
        with heap.frozen_heap():
            if i == 0:
                del old
        # frozen when it died: the end-of-run collection (frozen) does not see it; the third
        # period's end makes the full collection that frees it
        assert (ref() is None) == (i == 2), i


def test_overlapping_runs_still_get_the_full_collection_and_stay_frozen(monkeypatch, clean_gc):
    """Runs that overlap without a break (threads): the periodic full collection unfreezes,
    collects the whole heap and freezes it again for the runs still going."""
    monkeypatch.setattr(heap, "FULL_COLLECTION_EVERY", 1)
    old = _Node()
    ref = weakref.ref(old)
    with heap.frozen_heap():  # a long run
        del old  # dies in the frozen old heap
        with heap.frozen_heap():  # another run, ending while the first goes on
            pass
        assert ref() is None  # the full collection at its end took the cycle
        assert heap._froze and gc.get_freeze_count() > 0  # frozen again for the long run
    assert gc.get_freeze_count() == 0 and not heap._froze


def test_a_run_that_raised_gets_a_full_collection(clean_gc):
    """Its frames (in the traceback) hold the session in cycles: collected at once, not at
    the 50th run."""
    old = _Node()
    ref = weakref.ref(old)
    with pytest.raises(RuntimeError):
        with heap.frozen_heap():
            del old
            raise RuntimeError("the run failed")
    assert ref() is None and gc.get_freeze_count() == 0


def test_an_interrupt_in_the_end_of_run_collection_leaves_nothing_frozen(monkeypatch,
                                                                         clean_gc):
    """Ctrl-C during the end-of-run collection: the heap is unfrozen anyway, and the next
    run freezes and unfreezes it as its own (not taken for someone else's freeze)."""
    real = gc.collect
    calls = []

    def interrupted(*a):
        calls.append(a)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*a)

    monkeypatch.setattr(heap.gc, "collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with heap.frozen_heap():
            pass
    monkeypatch.setattr(heap.gc, "collect", real)
    assert gc.get_freeze_count() == 0 and not heap._froze
    with heap.frozen_heap():
        assert heap._froze and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_freeze_an_interrupt_left_behind_is_undone_as_ours(clean_gc):
    """The flag is set before freezing: a freeze found with the flag set at the next entry
    is ours, unfrozen there, and the run freezes afresh."""
    heap._froze = True  # what an interrupt right after gc.freeze() at an entry leaves
    gc.freeze()
    with heap.frozen_heap():
        assert heap._froze and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and not heap._froze


def test_the_environment_variable_where_the_option_is_not_set(monkeypatch, clean_gc):
    """``$WORKBENCH_GC_FREEZE`` (for ``panel serve`` and the CLI): 0 turns it off, the option
    wins over it, and a value it does not take is refused naming it, nothing frozen."""
    monkeypatch.setenv(heap.GC_FREEZE_ENV, "0")
    with heap.frozen_heap():
        assert not heap._froze and gc.get_freeze_count() == 0
    with workbench.set_options(gc_freeze=True):
        with heap.frozen_heap():
            assert heap._froze
    monkeypatch.setenv(heap.GC_FREEZE_ENV, "maybe")
    with pytest.raises(workbench.errors.InputError, match="WORKBENCH_GC_FREEZE='maybe'"):
        with heap.frozen_heap():
            pass
    assert gc.get_freeze_count() == 0 and heap._depth == 0


def test_the_cli_refuses_a_bad_environment_value_with_exit_2(embedded_dir, monkeypatch,
                                                             capsys, clean_gc):
    from workbench.cli import main

    monkeypatch.setenv(heap.GC_FREEZE_ENV, "2")
    assert main(["run", "--model", str(embedded_dir), "--prompt", "hi", "--max-new-tokens",
                 "1", "--no-record"]) == 2
    err = capsys.readouterr().err
    assert "WORKBENCH_GC_FREEZE='2'" in err and "Traceback" not in err


def test_the_option_refuses_a_value_it_does_not_take_saying_what_it_takes():
    with pytest.raises(ValueError, match=r"gc_freeze='yes' is not valid; it takes None .*"
                                         r"True or False"):
        workbench.set_options(gc_freeze="yes")
    assert workbench.get_options()["gc_freeze"] is None
