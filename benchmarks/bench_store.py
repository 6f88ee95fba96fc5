"""Store streaming rate for a Qwen3-VL-30B-A3B-sized layout (48 MoE layers × 128 experts, top-8).

Feeds the real Recorder with decode-step events (one token per step, every layer routed, spans on
both clocks, residency) and measures steps/s end to end (event → zarr on disk), plus bytes on disk
per routing event (one token × one layer). Goal: ≥ 500 steps/s.

    python benchmarks/bench_store.py [--steps 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from workbench.telemetry.events import LayerEvent, Span, StepEvent
from workbench.telemetry.store import Recorder

L, E, K = 48, 128, 8


def make_events(n: int, seed: int = 0) -> list[StepEvent]:
    rng = np.random.default_rng(seed)
    events = []
    resident = np.zeros((L, E), bool)
    for s in range(n):
        layers = []
        for l in range(L):
            ids = rng.choice(E, size=(1, K), replace=False).astype(np.int32)
            w = rng.dirichlet(np.ones(K), size=1).astype(np.float32)
            hits = [int(e) for e in ids[0] if resident[l, e]]
            misses = [int(e) for e in ids[0] if not resident[l, e]]
            resident[l, ids[0]] = True
            layers.append(LayerEvent(layer=l, pinned=l < 4, topk_ids=ids, topk_weights=w,
                                     hits=hits, misses=misses,
                                     expert_tokens={int(e): 1 for e in ids[0]}))
        spans = [Span(c, lane, s, l, -1, 0.001 * l, 0.001 * l + 0.0005)
                 for l in range(L) for c in (0, 1) for lane in (0, 1)]
        events.append(StepEvent(step=s, phase=int(s > 0), token_ids=np.array([5]),
                                modality=np.array([0], np.int8), layers=layers, spans=spans,
                                latency_measured_s=0.01, latency_modeled_s=0.02,
                                residency=resident.copy(), generated_token=7))
    return events


def run(steps: int, flush_every: int) -> dict:
    events = make_events(steps)
    tmp = Path(tempfile.mkdtemp())
    try:
        t0 = time.perf_counter()
        with Recorder(tmp / "b.zarr", L, E, K, attrs={}, pinned=[l < 4 for l in range(L)],
                      flush_every=flush_every, flush_interval_s=1e9) as rec:
            for ev in events:
                rec.add(ev)
        dt = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in (tmp / "b.zarr").rglob("*") if p.is_file())
    finally:
        shutil.rmtree(tmp)
    return {"layout": f"{L} layers x {E} experts, top-{K}", "steps": steps,
            "flush_every": flush_every, "seconds_measured": dt, "steps_per_s": steps / dt,
            "store_bytes": size, "bytes_per_routing_event": size / (steps * L)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--flush-every", type=int, default=32, help="the flush_every option default")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = run(a.steps, a.flush_every)
    print(json.dumps(r) if a.json else
          f"{r['layout']}: {r['steps_per_s']:.0f} steps/s (measured, {r['steps']} steps, "
          f"flush every {r['flush_every']}), {r['bytes_per_routing_event']:.1f} bytes on disk "
          f"per routing event (token × layer)")


if __name__ == "__main__":
    main()
