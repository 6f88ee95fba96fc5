"""The workbench dashboard: ``panel serve apps/dashboard.py --address 127.0.0.1 --warm``.

``--warm`` builds one session when the server starts, so the first page a user opens does not
wait for the imports (≈ 3 s here).

Thin on purpose: everything lives in :mod:`workbench.ui` (DataStore → Views → build_app).
Runs go to ``$WORKBENCH_WORKSPACE`` (default ``runs/`` under the working directory). Options
after ``--args``: ``--model DIR`` (a checkpoint folder instead of the embedded model) and
``--demo-dir DIR`` (a folder with ``prompts.json`` and images instead of ``data/demo``).
"""

import argparse
import os
import sys

# An interactive server shares its cores with the Bokeh event loop (and often a browser):
# OpenMP threads that spin while waiting make a model step up to 100× slower on a busy CPU.
# Must be set before torch loads (it loads on the first run); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from workbench.ui.app import build_app  # noqa: E402
from workbench.ui.datastore import DataStore  # noqa: E402

_parser = argparse.ArgumentParser(prog="apps/dashboard.py")
_parser.add_argument("--model", default=None, help="checkpoint folder (default: embedded model)")
_parser.add_argument("--demo-dir", default=None, help="demo inputs (default: data/demo)")
_args, _ = _parser.parse_known_args(sys.argv[1:])

build_app(DataStore(model=_args.model), demo_folder=_args.demo_dir).servable(title="workbench")
