"""Compression-guided lookahead predictor (VisMMOE §3.3).

- :mod:`workbench.predictor.features`: x_l = [h^(r); h^(h); h^(v); onehot(l)], the window
  targets g, and the hooks that record them from a live model.
- :mod:`workbench.predictor.model`: the bottleneck MLP, safetensors + JSON files, Hot Recall.
- :mod:`workbench.predictor.calibrate`: ``workbench calibrate`` (record, train, held-out report).
- :mod:`workbench.predictor.policy`: knobs (``predictor``, ``window``, ``decay``), the
  ``vismmoe`` prefetch policy and the live hook.
"""
