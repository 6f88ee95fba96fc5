"""Visual-token compression behind the pinned prefix (VisMMOE §3.2, Algorithm 1).

- :mod:`workbench.compression.policies`: the ``COMPRESSION`` registry (``none``, ``random``,
  ``saliency``, ``affinity``), Algorithm 1 as pure tensor functions, and the knob group
  (``compression``, ``alpha``, ``beta``, ``lam``).
- :mod:`workbench.compression.saliency`: vision-encoder attention saliency per merged token.
- :mod:`workbench.compression.placement`: the hooks that run the pinned prefix on the full
  stream and every later layer on the kept tokens (a context manager, always removed).

Policies are separate from the placement so that a new policy is one registered class; the
placement is separate from the runtime so that it can be tested on the bare model.
"""

from workbench.compression.policies import (COMPRESSION, CompressionKnobs, CompressionPolicy,
                                            SelectionInput, affinity_keep, marginal_expansion)

__all__ = ["COMPRESSION", "CompressionKnobs", "CompressionPolicy", "SelectionInput",
           "affinity_keep", "marginal_expansion"]
