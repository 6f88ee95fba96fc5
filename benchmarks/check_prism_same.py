"""Whether two versions of the code run MoE-Prism's settings alike (issue 41's rule: a speed
change changes nothing a run computes).

    PYTHONPATH=TREE python benchmarks/check_prism_same.py run OUT   # per tree: OUT a new folder
    python benchmarks/check_prism_same.py compare OUT_A OUT_B

``run``: the embedded model, a mixed batch of 8, 16 new tokens, a random refactoring (N = 4,
seed 0: the same in every tree), 1 pinned layer and 256 slots, recorded into
``OUT/<setting>.zarr`` for each setting of :data:`SETTINGS` (k_active 3, 2 and 1, a global K,
the sub-expert path at k_active N, sub-expert offloading at k_active N, 2 and 1, ReaLB beside
k_active 2, the whole-expert shortcut alone and beside ReaLB; the first one twice).
``compare``: every stored array that is not *measured* (wall-clock times, measured spans) equal
between the trees — integers and flags exactly; a float array that differs is reported with its
largest difference beside the same array's between two runs of one tree (the offloader adds
expert groups in the order their copies land: float32 rounding varies from run to run). Exit
status 0 when the tokens and every integer and flag array are equal, and every float array is
equal or reported so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import workbench  # first: sets OMP_WAIT_POLICY=PASSIVE before torch starts OpenMP
import numpy as np

SETTINGS: dict[str, dict] = {
    "k3": dict(prism_k_active=3),
    "k2": dict(prism_k_active=2),
    "k2-again": dict(prism_k_active=2),
    "k1": dict(prism_k_active=1),
    "global6": dict(prism_k=6),
    "path": dict(prism_k_active=4, prism_shortcut=False),
    "offload4": dict(prism_k_active=4, prism_offload=True, prism_shortcut=False),
    "offload2": dict(prism_k_active=2, prism_offload=True, prism_shortcut=False),
    "offload1": dict(prism_k_active=1, prism_offload=True, prism_shortcut=False),
    "realb-k2": dict(prism_k_active=2, balance="realb", ep_ranks=8),
    "shortcut": dict(),  # the default: k_active N through the model's own forward
    "shortcut-realb": dict(balance="realb", ep_ranks=8),
}


def run(out: str) -> None:
    from workbench.prism import refactor as R

    root = Path(out)
    try:
        root.mkdir()  # a new folder: nothing of anyone else's is written over
    except OSError as e:
        print(f"check_prism_same: OUT must be a new folder; {str(out)!r}: {e.strerror}",
              file=sys.stderr)
        sys.exit(2)
    rt = workbench.Runtime()
    lay = rt.lm.layout
    R.save(R.random_refactoring(rt.lm, subexperts=4, seed=0), root / "refactoring")
    reqs = workbench.mixed_batch(8, seed=5)
    summary = {"workbench": workbench.__file__}
    for name, kw in SETTINGS.items():
        res = rt.run(reqs, max_new_tokens=16, pinned_layers=1, cache_slots=lay.num_experts * 4,
                     prism=True, prism_refactoring=str(root / "refactoring"),
                     store=root / f"{name}.zarr", **kw)
        summary[name] = [b["token_ids"] for b in res.batch]
    (root / "tokens.json").write_text(json.dumps(summary, indent=1) + "\n")


def _computed(ds) -> dict[str, np.ndarray]:
    """The store's arrays that a run computes (not wall-clock): measured variables left out,
    spans kept on the modeled clock only."""
    out = {}
    modeled = None
    if "span_clock" in ds.variables:
        names = list(ds.attrs.get("clock_names", []))
        modeled = ds["span_clock"].values == (names.index("modeled") if "modeled" in names
                                              else 1)
    for name, v in ds.variables.items():
        if "(measured)" in str(v.attrs.get("units", "")) or name == "step_start_s":
            continue
        a = v.values
        if modeled is not None and v.dims == ("span",):
            a = a[modeled]
        out[name] = a
    return out


def compare(a: str, b: str) -> bool:
    ta, tb = (json.loads((Path(p) / "tokens.json").read_text()) for p in (a, b))
    same = True
    for name in SETTINGS:
        da, db = (_computed(workbench.open_run(Path(p) / f"{name}.zarr")) for p in (a, b))
        rep = (_computed(workbench.open_run(Path(a) / "k2-again.zarr")) if name == "k2"
               else None)
        equal, floats = [], []
        for var in sorted(set(da) | set(db)):
            x, y = da.get(var), db.get(var)
            if x is None or y is None or x.shape != y.shape:
                print(f"{name}: {var} is in one tree only or of another shape")
                same = False
                continue
            if np.array_equal(x, y, equal_nan=x.dtype.kind == "f"):
                equal.append(var)
                continue
            if x.dtype.kind != "f":
                print(f"{name}: {var} DIFFERS ({int((x != y).sum())} of {x.size} values)")
                same = False
                continue
            d = float(np.nanmax(np.abs(x.astype(np.float64) - y)))
            line = f"{name}: {var} differs by ≤ {d:.1e}"
            if rep is not None and var in rep:
                r = float(np.nanmax(np.abs(da[var].astype(np.float64) - rep[var])))
                line += f" (two runs of the first tree: ≤ {r:.1e})"
            floats.append(line)
        tokens = ta[name] == tb[name]
        same &= tokens
        print(f"{name}: tokens {'equal' if tokens else 'DIFFER'}; {len(equal)} arrays equal"
              + "".join("\n  " + f for f in floats))
    return same


if __name__ == "__main__":
    if len(sys.argv) != 3 + (sys.argv[1:2] == ["compare"]) or sys.argv[1] not in ("run",
                                                                                   "compare"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
