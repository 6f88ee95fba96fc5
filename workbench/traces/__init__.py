"""Routing traces: the :class:`Trace` model and the formats it is read from and written to.

>>> from workbench.traces import load_trace
>>> tr = load_trace("humaneval_2_routing.jsonl", num_experts=8)   # or a run store, .npy, .wbtrace
>>> tr.groups()                                                   # accesses in serving order
"""

from workbench.traces.formats import (FORMATS, from_store, load_trace, read_jsonl, read_npy,
                                      read_plain, write_plain)
from workbench.traces.trace import Trace

__all__ = ["Trace", "load_trace", "from_store", "read_jsonl", "read_npy", "read_plain",
           "write_plain", "FORMATS"]
