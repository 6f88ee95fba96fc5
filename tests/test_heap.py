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
def clean_gc():
    """Nothing frozen before or after the test (a failed test must not leave the heap frozen
    for the rest of the worker)."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


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
    monkeypatch.setattr(heap, "_since_full", 0)
    old = _Node()  # alive when the heap is frozen, dropped during the frozen period
    ref = weakref.ref(old)
    for i in range(3):
        with heap.frozen_heap():
            if i == 0:
                del old
        # frozen when it died: the end-of-run collection (frozen) does not see it; the third
        # period's end makes the full collection that frees it
        assert (ref() is None) == (i == 2), i
