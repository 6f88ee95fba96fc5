"""Intra-op CPU threads of a run (workbench.runtime.threads): one thread on the CPU unless the
``threads`` option, $WORKBENCH_THREADS or $OMP_NUM_THREADS says otherwise; restored after."""

from __future__ import annotations

import pytest
import torch

import workbench
from workbench.errors import InputError
from workbench.runtime import session as S


@pytest.fixture
def threads_seen(monkeypatch):
    """The intra-op threads each run's session ran with."""
    seen: list[int] = []
    real = S.RunSession.run

    def run(self):
        seen.append(torch.get_num_threads())
        return real(self)

    monkeypatch.setattr(S.RunSession, "run", run)
    return seen


def _run(rt) -> None:
    rt.run("what is 2 plus 3?", max_new_tokens=2, record=False)


def test_a_cpu_run_uses_one_thread_and_restores_the_setting(embedded, threads_seen, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("WORKBENCH_THREADS", raising=False)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rt = workbench.Runtime(embedded)
        _run(rt)
        assert threads_seen == [1] and torch.get_num_threads() == 2
        with workbench.set_options(threads=2):
            _run(rt)
        monkeypatch.setenv("WORKBENCH_THREADS", "2")
        _run(rt)
        monkeypatch.delenv("WORKBENCH_THREADS")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's: torch's setting is left
        _run(rt)
        assert threads_seen == [1, 2, 2, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)


def test_a_bad_threads_setting_is_refused_naming_it(embedded, monkeypatch):
    for bad in (0, -1, 2.5, "2", True):
        with pytest.raises(ValueError, match="threads"):
            workbench.set_options(threads=bad)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("WORKBENCH_THREADS", "lots")
    with pytest.raises(InputError, match="WORKBENCH_THREADS='lots'"):
        _run(workbench.Runtime(embedded))
