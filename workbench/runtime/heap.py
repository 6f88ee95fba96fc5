"""The Python heap during a run: frozen for the cyclic garbage collector.

A loaded model, torch, transformers and the workbench are ≈ 400 000 objects the collector
tracks (the embedded model's process). A run allocates many short-lived ones (events, spans,
tensors' Python wrappers), so every few runs the collector's oldest generation fills and a
*full* collection walks all of them: ≈ 240 ms on the 2-core dev machine, in the middle of a
run, about every tenth run of a batch of 8 (measured: ``gc.callbacks``, BENCHMARKS.md
*A run's heap frozen for the collector*). Nothing of that old heap becomes garbage because a
run ran.

So a run freezes the heap it starts with (:func:`gc.freeze`: the objects alive at that
instant move to a permanent generation the collector does not walk) and unfreezes it when
it ends (:func:`gc.unfreeze`: back into the oldest generation). During the run the collector
runs as always over what the run allocates — a reference cycle the run makes is collected
as before — and after it the heap is the collector's as before: nothing stays frozen, so no
object of the notebook's or of a dropped model can leak through this (what inference
servers do once for good at start-up — vLLM, SGLang, Ray Serve — would keep a deleted
model's cycles for ever; a notebook loads and drops models). Both calls are O(1) list
splices.

The freeze is process-wide: runs in several threads share it (the first to start freezes,
the last to end unfreezes), and a heap someone else froze (``gc.get_freeze_count() > 0``
when the first run starts) or a disabled collector is left alone. The ``gc_freeze`` option
(``workbench.set_options(gc_freeze=False)``), or ``$WORKBENCH_GC_FREEZE=0`` where the option
is not set (``panel serve``, the CLI), turns it off. It changes nothing a run
computes: only when the collector walks what.

What a run leaves behind is collected as follows. Its own reference cycles are collected when
it ends, while the old heap is still frozen (a collection of what the run allocated: ≈ 0.2 ms
a run of the embedded model). Cycles that die in the old heap — ≈ 160 objects a run there:
earlier runs' knob copies, whose ``param`` objects refer to themselves — wait for a full
collection of the whole heap, which the end of every :data:`FULL_COLLECTION_EVERY`-th run
makes (and the end of a run that raised): that bounds them, at a fifth of the full
collections CPython's own thresholds made during runs (every ≈ 10 runs; each freeze resets
those thresholds' counts, so without it they would never come between back-to-back runs).
A ``gc.freeze()`` someone else makes during a run is undone with the run's own.
"""

from __future__ import annotations

import gc
import os
import threading
from contextlib import contextmanager
from typing import Iterator

from workbench.errors import InputError
from workbench.options import get_options

#: environment variable for the ``gc_freeze`` option where a program cannot set it (``panel
#: serve``, the CLI): ``1`` / ``0`` (also true/false, on/off, yes/no)
GC_FREEZE_ENV = "WORKBENCH_GC_FREEZE"
_ENV_VALUES = {"1": True, "true": True, "on": True, "yes": True,
               "0": False, "false": False, "off": False, "no": False}


def freeze_wanted() -> bool:
    """Whether runs freeze the heap: the ``gc_freeze`` option, else ``$WORKBENCH_GC_FREEZE``,
    else yes. :class:`InputError` naming the variable for a value it does not take."""
    opt = get_options()["gc_freeze"]
    if opt is not None:
        return bool(opt)
    raw = os.environ.get(GC_FREEZE_ENV, "").strip()
    if not raw:
        return True
    v = _ENV_VALUES.get(raw.lower())
    if v is None:
        raise InputError(f"{GC_FREEZE_ENV}={raw!r} is not one of 1, 0, true, false, on, off, "
                         f"yes, no (unset it for the default: on)")
    return v


#: (re-entrant: a finalizer the collections below run may start a frozen period of its own)
_lock = threading.RLock()
#: runs inside :func:`frozen_heap` now (all threads)
_depth = 0
#: whether the outermost entry froze the heap (and so its exit unfreezes it)
_froze = False
#: runs (outermost frozen periods) between two full collections of the whole heap
FULL_COLLECTION_EVERY = 50
#: frozen periods ended since the last full collection
_since_full = 0


@contextmanager
def frozen_heap() -> Iterator[None]:
    """The heap alive at entry frozen for the collector until the last concurrent run exits
    (see the module docstring).

    Safe against an interrupt at any instant: the flag that says the freeze is ours is set
    before freezing and cleared after unfreezing, so a freeze an interrupt left behind is
    known for ours (and undone) at the next entry, never taken for someone else's. Every
    exit counts towards the periodic full collection, so runs that overlap without a break
    (dashboard sessions in threads) still get it: the heap is unfrozen, collected whole and
    frozen again for the runs still going. A run that raised gets a full collection at
    once: its traceback's frames hold the session (and on a GPU its tensors) in cycles.
    Collections run under the lock: a run starting or ending in another thread waits for
    them (a full one ≈ 240 ms, every 50th run)."""
    global _depth, _froze, _since_full
    entered = failed = False
    wanted = freeze_wanted()  # (a bad $WORKBENCH_GC_FREEZE: refused before anything runs)
    try:
        with _lock:
            if _depth == 0:
                if _froze:  # ours, left behind by an interrupted exit
                    gc.unfreeze()
                    _froze = False
                if wanted and gc.isenabled() and gc.get_freeze_count() == 0:
                    _froze = True
                    gc.freeze()
            _depth += 1
            entered = True
        yield
    except BaseException:
        failed = True
        raise
    finally:
        if entered:
            with _lock:
                _depth -= 1
                if _froze:
                    _since_full += 1
                    full = failed or _since_full >= FULL_COLLECTION_EVERY
                    if _depth == 0 or full:
                        try:
                            if not full:  # the run's own cycles, the old heap still frozen
                                gc.collect()
                        finally:
                            gc.unfreeze()
                            _froze = False
                    if full:  # cycles that died in the old heap (nothing frozen now)
                        _since_full = 0
                        gc.collect()
                        if _depth > 0:  # runs still going: their heap frozen again
                            _froze = True
                            gc.freeze()
