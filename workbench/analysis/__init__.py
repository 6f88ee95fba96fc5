"""analysis: metrics of run stores. Importing it registers the ``ds.moe`` accessor.

Invariant: ``ds.moe`` is registered here and only here (``telemetry/`` never imports
``analysis/``: the store is written and read without the metrics). :func:`open_run` is the
telemetry reader's; taken from this package (or as ``workbench.open_run``) the Dataset it returns
has ``ds.moe``.
"""

from workbench.analysis import accessor  # noqa: F401  (registers ds.moe)
from workbench.analysis.accessor import MoEAccessor
from workbench.telemetry.reader import open_run

__all__ = ["MoEAccessor", "open_run"]
