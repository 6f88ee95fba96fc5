"""workbench: see and steer expert offloading of vision-language MoE models.

Public API (imported lazily so that ``import workbench`` stays cheap):

- :func:`load` — a local Hugging Face checkpoint (the embedded default model when no path).
- :class:`Knobs` — every run setting, validated.
- :class:`Runtime` — the live offloaded runtime; :meth:`Runtime.run` returns a :class:`RunResult`.
- :func:`open_run` — a run store as an xarray Dataset (``ds.moe`` for analysis);
  :class:`RunMetadata` — its attributes, typed.
- :func:`replay_trace` — any routing trace through the same simulation core as live runs.
- :class:`ModelPool` — loaded models shared between runs (notebooks, the dashboard).
- :func:`fake_quant` — quantise → dequantise a tensor to FP8 or NVFP4 (low-precision
  emulation, ReaLB).
- :func:`batch`, :func:`mixed_batch` — batches of demo and generated held-out requests for
  ``Runtime.run(requests)`` (run together: expert-parallel load needs a batch).

Knob groups: :mod:`workbench.features` is the one module that imports the feature packages and
registers their knob groups; :mod:`workbench.knobs` (a leaf: it imports no feature package)
imports it the first time the groups are needed, so ``from workbench.knobs import Knobs`` alone
gives every group and ``import workbench`` stays cheap (see the registration rule in
:mod:`workbench.knobs`).
"""

from __future__ import annotations

import os

# OpenMP threads that spin while idle made a prefill of the embedded model ~100x slower whenever
# another process held a core (measured on the 2-core dev machines: 10.5 s vs 0.07 s). Passive
# waiting costs nothing measurable when the machine is idle. Set before torch is imported; a
# value the user set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from importlib import import_module  # noqa: E402
from typing import Any

from workbench._version import __version__  # noqa: E402

_LAZY = {
    "load": "workbench.models.loading",
    "LoadedModel": "workbench.models.loading",
    "Knobs": "workbench.knobs",
    "Runtime": "workbench.runtime.runtime",
    "RunResult": "workbench.runtime.result",
    "ModelPool": "workbench.runtime.pool",
    "RunMetadata": "workbench.telemetry.metadata",
    "Request": "workbench.models.inputs",
    "batch": "workbench.models.batches",
    "mixed_batch": "workbench.models.batches",
    "fake_quant": "workbench.precision",
    "open_run": "workbench.analysis",  # the reader, with ds.moe registered
    "replay_trace": "workbench.replay",
    "load_trace": "workbench.traces",
    "set_options": "workbench.options",
    "sweep": "workbench.analysis.sweep",
    "open_summary": "workbench.analysis.sweep",
    "compare_runs": "workbench.analysis.compare",
    "get_options": "workbench.options",
    "WorkbenchError": "workbench.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
