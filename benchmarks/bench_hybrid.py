"""GPU–CPU hybrid mode vs offload-only (issue 5 §3), side by side in one run.

Live: the embedded model on every demo request (its real answer, up to --tokens), priced as Qwen3-VL-30B-A3B on each profile
(*modeled*), plus the wall time here (*measured*; on this CPU machine "host" and "device" are
the same cores, so the measured column shows the cost of the mechanism, not its benefit).
Replay: the real Mixtral-8x7B trace from ../shared/data (when present) under the same two
modes (*modeled*).

    python benchmarks/bench_hybrid.py [--tokens 32] [--ignore-eos] [--cache-slots 32] [--pinned 1]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIXTRAL = (REPO.parent / "shared" / "data" / "traces" / "mixtral-8x7b-vllm"
           / "humaneval_2_routing.jsonl")


def live(args) -> list[str]:
    import workbench

    from workbench.models.embedded.demo import read_demo

    prompts = [(d["prompt"], [d["image"]] if d["image"] else []) for d in read_demo(required=True)]
    rt = workbench.Runtime(device="cpu", max_new_tokens=args.tokens, ignore_eos=args.ignore_eos,
                           cache_slots=args.cache_slots, pinned_layers=args.pinned,
                           target_model="qwen3-vl-30b-a3b")
    rows = ["| profile | mode | latency (modeled) | prefill (modeled) | decode/token (modeled) "
            "| stall (modeled) | hit rate | loads | host runs | latency (measured) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    rt.run(*prompts[0], record=False)  # warm-up
    for profile in args.profiles:
        for prefetch, hybrid in [(pf, h) for pf in ("none", args.prefetch) for h in (False, True)]:
            tot: dict[str, float] = {}
            answers = []
            for prompt, images in prompts:
                r = rt.run(prompt, images, record=False, hybrid=hybrid,
                           profile=profile, prefetch=prefetch)
                answers.append(r.token_ids)
                for k in ("latency_modeled_s", "prefill_modeled_s", "stall_modeled_s",
                          "latency_measured_s", "hits", "misses", "loads", "host_runs",
                          "steps"):
                    tot[k] = tot.get(k, 0.0) + getattr(r, k)
            n = len(prompts)
            dec = (tot["latency_modeled_s"] - tot["prefill_modeled_s"]) / (
                tot["steps"] - n)
            rows.append(
                f"| {profile} | {'hybrid' if hybrid else 'offload-only'}"
                f"{'' if prefetch == 'none' else ' + ' + prefetch + ' prefetch'} "
                f"| {tot['latency_modeled_s'] / n * 1e3:.1f} ms "
                f"| {tot['prefill_modeled_s'] / n * 1e3:.1f} ms | {dec * 1e3:.2f} ms "
                f"| {tot['stall_modeled_s'] / n * 1e3:.1f} ms "
                f"| {tot['hits'] / (tot['hits'] + tot['misses']):.1%} "
                f"| {tot['loads'] / n:.0f} | {tot['host_runs'] / n:.0f} "
                f"| {tot['latency_measured_s'] / n * 1e3:.0f} ms |")
    return rows


def replayed(args) -> list[str]:
    from workbench.replay import replay_trace
    from workbench.traces import read_jsonl

    if not MIXTRAL.exists():
        return [f"({MIXTRAL} is absent: replay skipped)"]
    trace = read_jsonl(MIXTRAL, num_experts=8)
    rows = [f"Replay of the real Mixtral-8x7B trace `{MIXTRAL.name}` ({trace.num_steps} steps), "
            f"costed as Qwen3-VL-30B-A3B "
            f"experts on a100-40gb (*modeled*), LRU:", "",
            "| cache slots | mode | latency | blocking I/O | hit rate | transfers | host runs |",
            "|---|---|---|---|---|---|---|"]
    for slots in args.replay_slots:
        for hybrid in (False, True):
            m = replay_trace(trace, belady=False, cache_slots=slots, hybrid=hybrid,
                             target_model="qwen3-vl-30b-a3b").metrics()
            rows.append(f"| {slots} | {'hybrid' if hybrid else 'offload-only'} "
                        f"| {m['latency_s']:.2f} s | {m['blocking_io_s']:.2f} s "
                        f"| {m['hit_rate']:.1%} | {m['transfers']} | {m['host_runs']} |")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32, help="max decoded tokens per request")
    ap.add_argument("--ignore-eos", action="store_true", help="decode exactly --tokens tokens")
    ap.add_argument("--cache-slots", type=int, default=32)
    ap.add_argument("--pinned", type=int, default=1)
    ap.add_argument("--profiles", nargs="+", default=["a100-40gb", "rtx-3090", "h200"])
    ap.add_argument("--replay-slots", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--prefetch", default="apex",
                    help="the prefetch policy of the second pair of rows (router lookahead)")
    args = ap.parse_args(argv)
    print(f"command: python benchmarks/bench_hybrid.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"\nLive, up to {args.tokens} decode tokens per demo request (ignore_eos={args.ignore_eos}), cache_slots={args.cache_slots}, "
          f"pinned_layers={args.pinned}, LRU; means per request:\n")
    print("\n".join(live(args)))
    print()
    print("\n".join(replayed(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
