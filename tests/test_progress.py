"""Progress of long commands (issue 37 §7): tqdm bars with an ETA on stderr, one per phase,
drawn when stderr is a terminal or ``--progress`` asks, never on stdout, never with
``--no-progress``; the library's callbacks change no result."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from workbench.progress import Bars, wanted

REPO = Path(__file__).resolve().parents[1]
BAR = re.compile(r"(\d+)/(\d+) \[\d\d:\d\d<\d\d:\d\d")   # tqdm's "n/total [elapsed<ETA"


def test_bars_draw_one_bar_per_phase_only_when_enabled():
    f = io.StringIO()
    with Bars(True, file=f, prefix="x: ") as bars:
        for i in range(4):
            bars("profiling requests", i, 3 if i < 3 else 3)
        bars("annealing experts", 0, 10)
        bars("annealing experts", 5, 10)
    text = f.getvalue()
    assert "x: profiling requests: 100%" in text and "3/3" in text
    assert "x: annealing experts:  50%" in text and "5/10" in text   # closed where it stood
    off = io.StringIO()
    with Bars(False, file=off) as bars:
        bars("profiling requests", 1, 2)
    assert off.getvalue() == ""
    assert wanted(None, io.StringIO()) is False and wanted(True, io.StringIO()) is True
    with open(os.devnull, "w") as dn:
        assert wanted(None, dn) is False and wanted(False, dn) is False


def test_chunked_annealing_reports_progress_and_changes_no_partition():
    from workbench.prism import partition as P

    rng = np.random.default_rng(0)
    Ms = [rng.standard_normal((int(rng.integers(3, 20)), 16)) for _ in range(150)]
    seen = []
    chunked = P.anneal_many(Ms, 4, iterations=300, seed=3,
                            progress=lambda *a: seen.append(a))
    whole = P.anneal_many(Ms, 4, iterations=300, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(chunked, whole)) and len(whole) == 150
    assert seen[0] == ("annealing experts", 0, 150) and seen[-1] == ("annealing experts", 150, 150)
    assert len(seen) >= 3 and [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def _cli(args, stderr_tty: bool):
    """``workbench ARGS`` in a subprocess, stdout a pipe; stderr a pseudo-terminal or a pipe."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "workbench.cli", *args]
    if not stderr_tty:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, env=env, text=True)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:   # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        out = p.stdout.read()
        p.wait(timeout=300)
    finally:
        os.close(master)
    return p.returncode, out, b"".join(chunks).decode("utf-8", "replace")


def test_refactor_shows_progress_on_a_terminal_and_keeps_stdout_clean(tmp_path):
    """A real terminal (a pseudo-terminal as stderr, stdout a pipe), no flag: both phases'
    bars, redrawn in place, ending at their totals; stdout one JSON document."""
    rc, out, err = _cli(["refactor", "--requests", "4", "--iterations", "200", "--max-tokens",
                         "16", "--json", "--out", str(tmp_path / "a")], stderr_tty=True)
    assert rc == 0, err
    assert json.loads(out)["experts"] == 768
    for phase, total in (("profiling requests", 4), ("annealing experts", 768)):
        assert f"refactor: {phase}: 100%" in err and f"{total}/{total} [" in err, err[-500:]
    assert BAR.search(err) and "\r" in err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_calibrate_macs_progress_follows_the_terminal_and_the_flags(tmp_path, monkeypatch,
                                                                     capsys):
    """stderr not a terminal: no bar unless --progress; a terminal: a bar unless
    --no-progress. stdout stays one JSON document in every case."""
    from workbench.cli import main

    def run(name: str, *flags: str, tty: bool = False) -> str:
        term = _Terminal()
        if tty:
            monkeypatch.setattr(sys, "stderr", term)
        try:
            assert main(["calibrate-macs", "--out", str(tmp_path / name), "--requests", "4",
                         "--json", *flags]) == 0
        finally:
            monkeypatch.undo()
        cap = capsys.readouterr()
        assert json.loads(cap.out)["layers"] == 12
        return cap.err + term.getvalue()

    assert not BAR.search(run("a"))
    err = run("b", "--progress")
    assert "calibrate-macs: calibration requests: 100%" in err and "4/4 [" in err
    assert BAR.search(run("c", tty=True))
    assert not BAR.search(run("d", "--no-progress", tty=True))
