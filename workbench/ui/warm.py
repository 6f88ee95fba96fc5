"""The dashboard's numba kernels, compiled before a served page needs them, in a child process.

numba compiles a kernel at its first call with new argument types and keeps the machine code in
its on-disk cache (``cache=True``). After an install that cache is empty, and the replay view's
first study compiled on the Bokeh event loop: it held the loop 16 s on an idle 2-core machine
and 32 s with two busy cores beside the server (``benchmarks/bench_dashboard.py --load 2``: the
next Run reached its first plot 33.5 s after the click). A slice deadline cannot cut a compile.

So a served dashboard calls :func:`start` once the model has loaded (``DataStore.preload``,
which a served page starts once it has rendered, and ``panel serve --warm`` at server start;
started before the model, the child made the first page ≈ 2 s slower under load): a child process
(``python -m workbench.ui.warm_child``) records a 2-token run of the embedded model into a scratch
folder, replays it through the replay view's own path
(:meth:`~workbench.ui.datastore.DataStore.replay_study`) in every scope and builds MoE-Prism's
QoS scheduler view (its first simulation compiled on the loop too, at the first page), which
compiles every kernel those views call into the cache (or finds them there: then it takes a few
seconds). Until the child has ended, :func:`ready` is False and both views draw a placeholder
instead; they then load the compiled kernels from the cache. A child that fails costs nothing
but its time: the views then compile in-process, as before.

Invariant: once :func:`ready`, the dashboard's views, the replay view's studies of any run of
any model among them, compile nothing (kernels are specialised on argument types, which a
store's routing always has the same of; ``tests/test_ui.py`` checks, in a fresh process, that
drawing every view after the child's work adds no compiled (kernel, signature) and that each of
them is cached on disk). Notebooks and the CLI never start it. ``WORKBENCH_WARM_KERNELS=0`` turns it off (the
test suite does: its workers share the cache).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

#: the environment variable that turns the warm-up off ("0")
ENV = "WORKBENCH_WARM_KERNELS"

_lock = threading.Lock()
_child: subprocess.Popen | None = None
_reported = False


def start(command: list[str] | None = None) -> bool:
    """Start the warm-up child once per process (unless :data:`ENV` is ``0``); True when one
    was started by this call. ``command``: another child (tests)."""
    global _child, _reported
    if os.environ.get(ENV, "1") == "0":
        return False
    with _lock:
        if _child is not None:
            return False
        cmd = command or [sys.executable, "-m", "workbench.ui.warm_child"]
        try:
            _child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        except OSError as e:  # the views compile in-process, as without a warm-up
            log.info("the dashboard kernels' warm-up could not start: %s", e)
            return False
        _reported = False
        return True


def ready() -> bool:
    """Whether the views may run their compiled kernels now (the replay view's studies, the
    scheduler view's simulation): no warm-up child, or it has ended."""
    global _reported
    child = _child
    if child is None:
        return True
    code = child.poll()
    if code is None:
        return False
    if not _reported:
        _reported = True
        (log.info if code == 0 else log.warning)(
            "the dashboard kernels' warm-up ended with exit code %s%s", code,
            "" if code == 0 else " (the views compile them in the server)")
    return True


def _reset() -> None:
    """Forget the child (tests): the next :func:`start` starts one again."""
    global _child
    with _lock:
        if _child is not None and _child.poll() is None:
            _child.kill()
            _child.wait()
        _child = None
