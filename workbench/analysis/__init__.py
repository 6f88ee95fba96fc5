"""analysis: metrics of run stores. Importing it registers the ``ds.moe`` accessor."""

from workbench.analysis import accessor  # noqa: F401  (registers ds.moe)
from workbench.analysis.accessor import MoEAccessor

__all__ = ["MoEAccessor"]
