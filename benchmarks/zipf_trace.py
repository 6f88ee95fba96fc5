"""Deterministic zipf routing trace for the replay-speed benchmarks (issue 11).

Every (token, layer) routes to ``k`` *distinct* experts of ``E``, drawn without replacement
with probability ∝ rank^-alpha, where each layer has its own seeded permutation of which expert
holds which popularity rank (so layers differ, as real routers do). One token per step (decode),
so the file is exactly what ``workbench replay`` reads as ``.npy``: an int16 array
``[steps, layers, k]``, each token its own step.

Sampling without replacement uses the Gumbel-top-k trick (the k largest ``log p + Gumbel``
are a draw of k without replacement from p). Chunks of :data:`CHUNK` steps are drawn from one
``numpy.random.default_rng(seed)`` stream in a fixed order, so a given ``(steps, layers, E, k,
alpha, seed)`` always gives the same bytes, on any machine with the same numpy bit generator.

    python benchmarks/zipf_trace.py --out /tmp/zipf.npy            # the issue's trace:
    # 40 000 steps × 32 layers × top-8 of 64 experts, alpha 1.3, seed 0 → 10 240 000 accesses
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

CHUNK = 2048  # steps drawn at a time (bounds the [chunk, L, E] float temporaries)


def zipf_routing(steps: int = 40_000, layers: int = 32, experts: int = 64, k: int = 8,
                 alpha: float = 1.3, seed: int = 0) -> np.ndarray:
    """``int16 [steps, layers, k]`` expert ids, distinct within each (step, layer), in rank
    order (most likely first, like a router's top-k)."""
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in 1..experts ({experts}), not {k}")
    rng = np.random.default_rng(seed)
    logp = -alpha * np.log(np.arange(1, experts + 1, dtype=np.float64))
    perm = np.stack([rng.permutation(experts) for _ in range(layers)])  # rank → expert id
    out = np.empty((steps, layers, k), np.int16)
    for a in range(0, steps, CHUNK):
        b = min(steps, a + CHUNK)
        score = logp + rng.gumbel(size=(b - a, layers, experts))
        top = np.argpartition(-score, k - 1, axis=-1)[..., :k] if k < experts else \
            np.broadcast_to(np.arange(experts), score.shape).copy()
        # rank order within the top-k: highest score first
        order = np.argsort(-np.take_along_axis(score, top, -1), axis=-1, kind="stable")
        ranks = np.take_along_axis(top, order, -1)
        out[a:b] = np.take_along_axis(perm[None], ranks, -1)
    return out


def zipf_flat_keys(accesses: int, layers: int = 32, experts: int = 64, k: int = 8,
                   alpha: float = 1.3, seed: int = 0) -> np.ndarray:
    """The flattened accesses of a zipf routing trace of :func:`zipf_routing`'s law (each
    (token, layer) draws k distinct experts, each next one ∝ rank^-alpha among those left;
    layer-own permutations), one key ``layer · E + expert`` each, in serving order, at least
    ``accesses`` of them (whole tokens): a ``uint16`` array filled by a compiled loop, so 10⁹
    accesses take 2 GB, where :func:`zipf_routing` and the relabelling would need tens of GB.
    Another sampler than :func:`zipf_routing` (rejection of repeats), so not the same draws."""
    if layers * experts > 1 << 16:
        raise ValueError(f"layers × experts must fit in uint16, not {layers} × {experts}")
    if not 1 <= k <= experts:
        raise ValueError(f"k must be in 1..experts ({experts}), not {k}")
    rng = np.random.default_rng(seed)
    p = np.arange(1, experts + 1, dtype=np.float64) ** -alpha
    perm = np.stack([rng.permutation(experts) for _ in range(layers)]).astype(np.int64)
    tokens = -(-int(accesses) // (layers * k))
    out = np.empty(tokens * layers * k, np.uint16)
    _draw_flat()(tokens, layers, experts, k, np.cumsum(p / p.sum()), perm, seed, out)
    return out


def _draw_flat():
    """The compiled sampler of :func:`zipf_flat_keys` (numba imported only here)."""
    from numba import njit

    @njit(cache=True)
    def draw(tokens, layers, experts, k, cdf, perm, seed, out):
        np.random.seed(seed)
        taken = np.zeros(experts, np.bool_)
        ranks = np.empty(k, np.int64)
        i = 0
        for _ in range(tokens):
            for layer in range(layers):
                got = 0
                while got < k:  # draw ∝ p, redraw a rank already taken: ∝ p among the rest
                    rank = min(np.searchsorted(cdf, np.random.random() * cdf[-1]), experts - 1)
                    if taken[rank]:
                        continue
                    taken[rank] = True
                    ranks[got] = rank
                    out[i + got] = layer * experts + perm[layer, rank]
                    got += 1
                for j in range(k):
                    taken[ranks[j]] = False
                i += k

    return draw


def write(path: str | Path, **kw) -> Path:
    """Write :func:`zipf_routing` (``kw``) to ``path`` as ``.npy`` and return the path."""
    path = Path(path)
    np.save(path, zipf_routing(**kw))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output .npy path")
    ap.add_argument("--steps", type=int, default=40_000)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    p = write(a.out, steps=a.steps, layers=a.layers, experts=a.experts, k=a.k, alpha=a.alpha,
              seed=a.seed)
    print(f"{p}: {a.steps} steps × {a.layers} layers × top-{a.k} of {a.experts} experts "
          f"(zipf {a.alpha}, seed {a.seed}) = {a.steps * a.layers * a.k} accesses")


if __name__ == "__main__":
    main()
