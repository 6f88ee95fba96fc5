"""Issue 36 §4–6: bounds that bound memory, outputs checked before the work, one writer per
output folder, options that do nothing refused, compiled kernels cached once.

Real files, real subprocesses, the repo's embedded model; no mocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          timeout=300)


# -- §6: the annealer is compiled once and its cache reused by later processes -----------------

def test_annealer_cache_is_reused_by_the_next_process(tmp_path):
    code = ("import numpy as np, json\n"
            "from workbench.prism import partition as P, _anneal\n"
            "P.anneal_many([np.random.rand(6, 8) for _ in range(2)], 4, iterations=5)\n"
            "s = _anneal.anneal_batch.stats\n"
            "print(json.dumps([sum(s.cache_hits.values()), sum(s.cache_misses.values())]))\n")
    cache = tmp_path / "numba"
    first = _py(code, NUMBA_CACHE_DIR=str(cache))
    assert first.returncode == 0, first.stderr
    files = {p: p.stat().st_size for p in cache.rglob("*") if p.is_file()}
    assert files, "nothing was cached"
    second = _py(code, NUMBA_CACHE_DIR=str(cache))
    assert second.returncode == 0, second.stderr
    hits, misses = json.loads(second.stdout.splitlines()[-1])
    assert hits >= 1 and misses == 0, second.stdout
    # no new cache entries: the files (and the index) are as the first process left them
    assert {p: p.stat().st_size for p in cache.rglob("*") if p.is_file()} == files
