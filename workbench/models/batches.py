"""Batches of requests, one call away: the bundled demo requests and generated held-out scenes.

Expert-parallel load only means something for a batch, and what MACS and ReaLB react to is
its *modality mix*; so a batch is built here from

- ``source="heldout"`` (default): the embedded model's generated requests of the held-out
  split (``tasks.make_split``, seed :data:`HELDOUT_SEED` by default — never trained on), with
  ``mix`` ``"mixed"`` (the split's own family mix: short visual questions, descriptions,
  digit strips and text-only puzzles), ``"image"`` (image families only) or ``"text"``
  (text-only puzzles only). Images are PIL images made in memory (the store records them as
  ``<PIL image>``; ``(source, seed, n, mix)`` regenerates them exactly: the split is
  deterministic).
- ``source="demo"``: the bundled demo requests (``data/demo/prompts.json``), cycled to ``n``.

:func:`mixed_batch` interleaves two batches (e.g. text-only and image-heavy requests) in a given
proportion. Everything returns a list of :class:`~workbench.models.inputs.Request` for
``Runtime.run(requests)``; ``workbench run --batch N [--batch-source …] [--batch-mix …]`` is
the same call.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from workbench.errors import InputError
from workbench.models.inputs import MAX_BATCH, Request

#: seed of the embedded model's held-out split (``train.HELDOUT_SEED``; equal, checked by a test)
HELDOUT_SEED = 20_251_121
SOURCES = ("heldout", "demo")
MIXES = ("mixed", "image", "text")


def check_batch_size(n: int, source: str, mix: str) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= MAX_BATCH:
        raise InputError(f"a batch holds from 1 to {MAX_BATCH} requests, not {n!r}")
    if source not in SOURCES:
        raise InputError(f"batch source must be one of {', '.join(SOURCES)}, not {source!r}")
    if mix not in MIXES:
        raise InputError(f"batch mix must be one of {', '.join(MIXES)}, not {mix!r}")


def batch(n: int = 8, *, source: str = "heldout", mix: str = "mixed",
          seed: int | None = None) -> list[Request]:
    """``n`` requests (see the module docstring). ``seed``: the generated split's seed
    (default :data:`HELDOUT_SEED`); ignored for the demo requests."""
    check_batch_size(n, source, mix)
    n = int(n)
    if source == "demo":
        from workbench.models.embedded.demo import read_demo

        items = read_demo()
        if mix != "mixed":
            items = [it for it in items if (it["image"] is None) == (mix == "text")]
        if not items:
            raise InputError(f"no demo requests of mix {mix!r} in data/demo/prompts.json")
        return [Request(it["prompt"], [it["image"]] if it["image"] else [],
                        expected=it.get("answer"))
                for it in (items[i % len(items)] for i in range(n))]
    from workbench.models.embedded.v2 import tasks

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
                             or not 0 <= seed < 2**63):
        raise InputError(f"batch seed must be a whole number from 0 to 2**63 − 1, not {seed!r}")
    seed = HELDOUT_SEED if seed is None else int(seed)
    if mix == "text":
        rng = np.random.default_rng(seed)
        examples = [tasks.make_example(rng, tasks.TEXT_KINDS[rng.integers(len(tasks.TEXT_KINDS))])
                    for _ in range(n)]
    else:
        examples = tasks.make_split(seed, n, image_only=mix == "image")
    return [Request(q, [img] if img is not None else [], expected=a) for img, q, a in examples]


def mixed_batch(n: int = 8, *, text_share: float = 0.5, seed: int | None = None) -> list[Request]:
    """A batch of ``n``: ``round(text_share·n)`` text-only requests and the rest image
    requests (held-out scenes and digit strips), interleaved evenly — the mix MACS reacts to."""
    if not isinstance(text_share, (int, float)) or not 0.0 <= float(text_share) <= 1.0:
        raise InputError(f"text_share must be a number in [0, 1], not {text_share!r}")
    check_batch_size(n, "heldout", "mixed")
    n_text = int(round(float(text_share) * int(n)))
    text = batch(n_text, mix="text", seed=seed) if n_text else []
    image = batch(int(n) - n_text, mix="image", seed=seed) if n - n_text else []
    return _interleave(text, image)


def _interleave(a: Sequence[Request], b: Sequence[Request]) -> list[Request]:
    """``a`` and ``b`` merged so that each keeps its order and spreads evenly."""
    n = len(a) + len(b)
    out, ia, ib = [], 0, 0
    for i in range(n):
        # the request from a whose even position comes first
        if ib >= len(b) or (ia < len(a) and (ia + 0.5) / len(a) <= (ib + 0.5) / len(b)):
            out.append(a[ia])
            ia += 1
        else:
            out.append(b[ib])
            ib += 1
    return out
