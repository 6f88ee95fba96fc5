"""Routing traces: the :class:`Trace` model and the formats it is read from and written to.

>>> from workbench.traces import load_trace
>>> tr = load_trace("humaneval_2_routing.jsonl", num_experts=8)   # or a run store, .npy, .wbtrace
>>> tr.groups()                                                   # accesses in serving order
>>> export_trace("runs/demo.zarr", "demo.jsonl")                  # a run store → .jsonl/.npy/.wbtrace
"""

from workbench.traces.formats import (EXPORT_FORMATS, FORMATS, export_trace, from_store,
                                      load_trace, read_jsonl, read_npy, read_plain, write_jsonl,
                                      write_npy, write_plain)
from workbench.traces.trace import Trace

__all__ = ["Trace", "load_trace", "from_store", "read_jsonl", "read_npy", "read_plain",
           "write_plain", "write_jsonl", "write_npy", "export_trace", "FORMATS",
           "EXPORT_FORMATS"]
