"""The Panel dashboard: ``DataStore`` (state) → views (panes) → ``build_app`` (layout).

>>> from workbench.ui import build_app
>>> build_app().servable()        # in apps/dashboard.py; or ``workbench.ui.serve()``

The runtime never imports this package; it reads and writes run stores only (see
``docs/telemetry.md``). Importing it imports Panel but not torch (the model loads on the first
run, or in the background when the app is built).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "DataStore": "workbench.ui.datastore",
    "build_app": "workbench.ui.app",
    "serve": "workbench.ui.app",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.ui' has no attribute {name!r}")
