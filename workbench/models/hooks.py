"""The one place that installs and removes hooks on a model.

Every feature that reads or steers a forward without changing the model's code does it through
a :class:`Hooks` registry: the run's step boundaries (``runtime/session.py``), the offloader's
interception point (``Offloader._layer``, installed as an override of each experts module's
``forward``), the predictor's routing probe (``predictor/features.py``), token compression
(``compression/placement.py``, ``compression/saliency.py``), the teacher-forcing scorer
(``prism/quality.py``), and the calibration passes of MACS and MoE-Prism
(:func:`prefill_experts`); the loader's logits guard is the one hook kept for the model's life
(:func:`keep_forward_hook`). The embedded model's own trainer and evaluator
(``models/embedded/v2``) keep theirs: they train a model, they do not run the workbench on one.

Invariants (``tests/test_hooks.py``, ``tests/test_imports.py``):

- No other module calls ``register_forward_hook`` / ``register_forward_pre_hook`` (outside
  ``models/embedded/v2``).
- Hooks run in the order they were installed (PyTorch's order per module); a run installs its
  features in one declared order (:meth:`~workbench.runtime.session.RunSession.run`: offloader,
  token compression, predictor, then the step boundaries), so a feature's hook on the same
  module always sees the state the earlier ones left.
- Removal undoes everything, last installed first, whatever happened: an install that fails
  half way removes what it had installed, and after :meth:`Hooks.remove` (or the end of the
  ``with`` block) the model has none of its hooks and none of its overrides; nothing here
  changes a module's parameters or code.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Hooks", "keep_forward_hook", "prefill_experts"]


class Hooks:
    """A registry of hooks (and instance overrides) installed on a model's modules; a context
    manager that removes them all on exit. Reusable: after :meth:`remove` it is empty."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def pre(self, module: Any, fn: Callable, *, with_kwargs: bool = False) -> None:
        """A forward pre-hook ``fn`` on ``module`` (PyTorch's signature for ``with_kwargs``)."""
        self._undo.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs).remove)

    def post(self, module: Any, fn: Callable, *, with_kwargs: bool = False) -> None:
        """A forward hook ``fn`` on ``module`` (runs after its forward)."""
        self._undo.append(module.register_forward_hook(fn, with_kwargs=with_kwargs).remove)

    def override(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value`` as an instance attribute shadowing the class's (a module's
        ``forward``, a model method); removal puts back exactly what was there: the instance
        attribute it shadowed, if any (someone else's override), else none, so the class's own
        is back, unchanged."""
        d = vars(obj)
        had, old = name in d, d.get(name)
        setattr(obj, name, value)
        self._undo.append(lambda: d.__setitem__(name, old) if had else d.pop(name, None))

    def remove(self) -> None:
        """Remove every hook and override, last installed first."""
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._undo)

    def __enter__(self) -> "Hooks":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def keep_forward_hook(module: Any, fn: Callable) -> None:
    """A forward hook that stays for ``module``'s life (the loader's check on the logits of
    every forward): nothing removes it."""
    module.register_forward_hook(fn)


def prefill_experts(lm, requests: Sequence[Any], batch_size: int,
                    on_experts: Callable[[Any, Any, Any], None],
                    on_batch: Callable[[Any, np.ndarray], None] | None = None,
                    progress: Callable[[str, int, int], None] | None = None,
                    phase: str = "profiling requests") -> None:
    """The calibration pass of MACS and MoE-Prism: the prefill of ``requests`` in batches of
    ``batch_size``, with a forward pre-hook on every MoE block's experts module that calls
    ``on_experts(block, hidden_states, top_k_index)`` with the real tokens' rows only (padding
    left out). ``on_batch(inputs, valid)`` runs before each batch's forward (``valid``: its
    real-token mask, numpy bool); after it, ``progress(phase, requests done, len(requests))``
    (:mod:`workbench.progress`). No grad; the hooks are removed whatever happens."""
    import torch

    from workbench.models.inputs import build_batch_inputs

    state: dict[str, Any] = {}

    def hook(b):
        def pre(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            idx = args[1] if len(args) > 1 else kwargs["top_k_index"]
            on_experts(b, hs[state["valid"]], idx[state["valid"]])
        return pre

    with Hooks() as hooks, torch.no_grad():
        for b in lm.layout.blocks:
            hooks.pre(b.experts, hook(b), with_kwargs=True)
        if progress is not None:
            progress(phase, 0, len(requests))
        for i in range(0, len(requests), batch_size):
            inputs = build_batch_inputs(lm, requests[i:i + batch_size])
            valid = (inputs.valid if inputs.valid is not None
                     else np.ones(inputs.modality.size, bool))
            state["valid"] = torch.as_tensor(valid, device=lm.device)
            if on_batch is not None:
                on_batch(inputs, valid)
            lm.model(**inputs.tensors)
            if progress is not None:
                progress(phase, min(i + batch_size, len(requests)), len(requests))
