"""The simulation core: everything that decides what an expert cache does, without torch.

Both the live runtime (:mod:`workbench.runtime`, which moves real tensors) and trace replay
(:mod:`workbench.replay`) drive this package; the numba kernel (:mod:`workbench.replay.kernel`)
is its checked fast path. Nothing here imports torch, transformers or the UI.
"""
