"""MoE-Prism on tiny *text* MoEs of two architectures (issue 16 §5: "on the embedded model and
on tiny text MoEs of two architectures") — perplexity *measured*.

The tiny text MoEs of :mod:`workbench.models.tiny` have random weights: no held-out text is
worth scoring on them. So this benchmark first **trains** two of them, a bit larger (hidden 64,
4 layers, 8 experts top-2, 32 neurons per expert — N = 4 sub-experts of 8), on real text
nobody here wrote: the five seed papers in ``../shared/seeds/`` (printable ASCII, runs of
whitespace folded; character-level, the tiny tokenizer). Each paper's last 10 % is held out
and never trained on. Training: AdamW, ``--steps`` steps of 32 windows × 128 characters, the
architecture's own load-balancing loss; seeded (the run is repeatable on one machine, not
bit-for-bit across machines). The checkpoints go to a temporary folder; nothing is committed.

Then, per architecture, through the runtime like any run (every expert resident):

- the refactoring (``R.refactor``: 64 calibration windows of the training text, N = 4, the
  paper's 100 000 annealing iterations per expert) and its random-partition control;
- ``--n`` held-out windows: a 96-character prompt, then the next 32 characters teacher-forced
  (:func:`workbench.prism.quality.score`, no end-of-sequence token), NLL per character in nats;
- settings: the original model at top-2 and top-1 (whole experts dropped,
  ``bench_prism_points.top_k_prime``); MoE-Prism k_active 4 … 1 (annealed) and 3 … 1
  (random); MoE-Prism global K 7 … 1 (the seed's K, a token's K best of its router's 2 experts'
  8 sub-experts by proxy score × routing weight); and the same k_active and global K with
  the **trained gate** of the router fine-tune (seed §4.3.2, :mod:`workbench.prism.finetune`:
  ``--router-steps`` steps on the calibration windows, self-distilled from the full model)
  instead of the proxy gate.

Operating points are counted as in ``bench_prism_ppl`` (its :func:`count_points`: distinct
compute levels K, stable at PPL ≤ ρ × the full model's and not dominated beyond 2 paired SE),
at ρ = 2, 1.25, 1.10, 1.05. Verdicts compare, at equal compute, MoE-Prism's dial with
dropping whole experts (the seed's Fig. 9) and the annealed partition with random ones, beyond
two paired SE, from the numbers. JSON: ``--json`` (default ``benchmarks/results/prism_text.json``).

    python benchmarks/bench_prism_text.py [--steps 1500] [--n 128] [--arch qwen3_moe mixtral]

Needs ``../shared/seeds`` (exits 2 naming it when absent). ≈ 6–8 min on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
import time
from pathlib import Path

import workbench  # first: sets the process's OpenMP settings before torch starts
import numpy as np
import torch

from bench_prism_points import top_k_prime
from bench_prism_ppl import RHOS, count_points

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
RESULTS = Path(__file__).resolve().parent / "results" / "prism_text.json"
HELD_OUT = 0.10  # of each paper, its end
TOP_K = 2

#: the tiny architectures' configs, scaled up (same classes; see workbench.models.tiny)
SIZES = {
    "qwen3_moe": dict(hidden_size=64, num_hidden_layers=4, moe_intermediate_size=32,
                      intermediate_size=128, head_dim=16, max_position_embeddings=512,
                      router_aux_loss_coef=0.01, output_router_logits=False),
    "mixtral": dict(hidden_size=64, num_hidden_layers=4, intermediate_size=32,
                    head_dim=16, max_position_embeddings=512, router_aux_loss_coef=0.01,
                    output_router_logits=False),
}


def corpus(root: Path = SEEDS) -> tuple[str, str]:
    """(training text, held-out text): each paper folded to printable ASCII with single
    spaces, its first 90 % to training and its last 10 % held out (papers joined by a space)."""
    papers = sorted(root.glob("*.txt"))
    if not papers:
        raise SystemExit(2)
    train, held = [], []
    for p in papers:
        t = re.sub(r"\s+", " ", p.read_text(encoding="utf-8", errors="replace"))
        t = "".join(c for c in t if 32 <= ord(c) < 127)
        cut = int(len(t) * (1 - HELD_OUT))
        train.append(t[:cut])
        held.append(t[cut:])
    return " ".join(train), " ".join(held)


def train(arch: str, text: str, out: Path, steps: int, held: str = "", seed: int = 0,
          log=print) -> dict:
    """Train a tiny ``arch`` MoE on ``text`` (character level) and save it with the tiny
    tokenizer to ``out``; returns the training record (with the plain model's NLL on
    ``held``, 128-character windows, when given: the check that it did not just memorise)."""
    from workbench.models.tiny import _specs, tiny_tokenizer

    cfg_cls, model_cls, kw = _specs()[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(**dict(kw, **SIZES[arch]))
    model = model_cls(cfg)
    model.set_experts_implementation("grouped_mm")  # same maths as eager, faster to train
    tok = tiny_tokenizer()
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    seq, batch = 128, 32
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps,
                                                pct_start=0.05)
    g = torch.Generator().manual_seed(seed)
    model.train()
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        at = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        x = torch.stack([ids[a:a + seq + 1] for a in at.tolist()])
        out_ = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = out_.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1))
        aux = getattr(out_, "aux_loss", None)
        total = loss + (cfg.router_aux_loss_coef * aux if aux is not None else 0)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 250 == 0 or step == steps - 1:
            log(f"  {arch} step {step}: train NLL {np.mean(losses[-50:]):.3f} nats/char")
    model.eval()
    held_nll = None
    if held:
        h = torch.tensor(tok(held, add_special_tokens=False)["input_ids"], dtype=torch.long)
        x = h[:len(h) // (seq + 1) * (seq + 1)].reshape(-1, seq + 1)
        with torch.no_grad():
            lg = model(input_ids=x[:, :-1]).logits
            held_nll = float(torch.nn.functional.cross_entropy(
                lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1)))
        log(f"  {arch}: held-out NLL {held_nll:.3f} nats/char (plain model, 128-char windows)")
    model.set_experts_implementation("eager")  # what a plain from_pretrained gives
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return {"steps": steps, "seconds": time.perf_counter() - t0,
            "final_train_nll": float(np.mean(losses[-100:])), "held_out_nll": held_nll,
            "parameters": sum(p.numel() for p in model.parameters())}


def windows(text: str, n: int, prompt: int, cont: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (prompt, continuation) pairs at evenly spaced starts of ``text`` (a seeded
    offset), prompts not starting or ending in a space (the runtime refuses blank prompts)."""
    span = prompt + cont
    starts = np.linspace(0, len(text) - span - 1, n).astype(int)
    starts += np.random.default_rng(seed).integers(0, 8, n)
    out = []
    for s in np.minimum(starts, len(text) - span - 1).tolist():
        out.append((text[s:s + prompt], text[s + prompt:s + span]))
    return out


def calibration(train_text: str) -> list:
    """The refactoring's calibration requests: 64 windows of 128 characters of the training
    text (seeded)."""
    return [workbench.Request(p + c, []) for p, c in windows(train_text, 64, 112, 16, seed=7)]


def study(arch: str, ckpt: Path, train_text: str, held: str, a, log=print) -> dict:
    from workbench.prism import quality as Q
    from workbench.prism import refactor as R

    rt = workbench.Runtime(str(ckpt))
    lm = rt.lm
    lay = lm.layout
    base = dict(pinned_layers=0, cache_slots=lay.num_layers * lay.num_experts)
    Req = workbench.Request
    cal = calibration(train_text)
    t0 = time.perf_counter()
    ref = R.refactor(lm, cal)
    t_refactor = time.perf_counter() - t0
    work = Path(tempfile.mkdtemp(prefix=f"prism-text-{arch}-"))
    R.save(ref, work / "annealed")
    R.save(R.random_control(lm, ref, cal), work / "random")
    N = ref.subexperts
    # the optional router fine-tune (seed §4.3.2) on the same calibration windows
    from workbench.prism import finetune as F

    router = F.finetune(lm, ref, cal, steps=a.router_steps, batch_size=8, log=log)
    F.save(router, work / "router")
    pairs = windows(held, a.n, 96, 32, seed=11)
    reqs = [Req(p, []) for p, _ in pairs]
    conts = [c for _, c in pairs]
    scores, settings = {}, {}

    def run(key, name, k_prime=TOP_K, partition=None, k_active=None, k_total=None,
            trained=False):
        hooks = top_k_prime(lm, k_prime) if k_prime < TOP_K else []
        kw = dict(base)
        if partition is not None:
            kw.update(prism=True, prism_refactoring=str(work / partition))
            if trained:
                kw.update(prism_router=str(work / "router"))
            kw.update(prism_k=k_total) if k_total is not None else kw.update(
                prism_k_active=k_active)
        t = time.perf_counter()
        try:
            s = Q.score(rt, reqs, conts, eos=False, batch_size=a.batch, **kw)
        finally:
            for h in hooks:
                h.remove()
        share = (k_prime / TOP_K) * (s.compute_share if s.compute_share is not None else 1.0)
        K = k_total if k_total is not None else k_prime * (k_active or N)
        scores[key] = s
        settings[key] = {"name": name, "K": K, "compute_share": share,
                         "wall_s": time.perf_counter() - t}
        log(f"  {arch} {name}: PPL {math.exp(s.mean_nll):.3f} (share {share:.2f})")

    run("top2", "original, top-2 (full model)")
    run("top1", "original, top-1", k_prime=1)
    for k in range(N, 0, -1):
        run(f"prism{k}", f"MoE-Prism annealed, k_active {k}/{N}", partition="annealed",
            k_active=k)
    for k in range(N - 1, 0, -1):
        run(f"random{k}", f"MoE-Prism random, k_active {k}/{N}", partition="random",
            k_active=k)
    for K in range(TOP_K * N - 1, 0, -1):
        run(f"global{K}", f"MoE-Prism annealed, global K {K}", partition="annealed",
            k_total=K)
    for k in range(N - 1, 0, -1):
        run(f"trained{k}", f"MoE-Prism annealed, trained gate, k_active {k}/{N}",
            partition="annealed", k_active=k, trained=True)
    for K in range(TOP_K * N - 1, 0, -1):
        run(f"tglobal{K}", f"MoE-Prism annealed, trained gate, global K {K}",
            partition="annealed", k_total=K, trained=True)
    full = scores["top2"]
    rows = []
    for key, st in settings.items():
        s = scores[key]
        d, se = Q.paired_nll(s, full)
        rows.append(dict(st, key=key, ppl=math.exp(s.mean_nll), mean_nll=s.mean_nll,
                         d_nll_vs_full=d, se=se,
                         top1=float(np.mean(np.concatenate(s.top1))) if s.top1 else None))

    def cmp(claim, better, worse):  # better's NLL below worse's beyond 2 paired SE?
        d, se = Q.paired_nll(scores[better], scores[worse])
        v = ("appears" if d < -2 * se else "does not appear" if d > 2 * se
             else "not resolved at this n")
        return {"claim": claim, "d_nll": d, "se": se, "verdict": v}

    verdicts = [
        cmp("at half the compute, a global K = 4 of sub-experts beats top-1 (whole experts "
            "dropped)", "global4", "top1"),
        cmp("at half the compute, k_active 2/4 beats top-1", "prism2", "top1"),
        cmp("the annealed partition beats random ones at k_active 2/4", "prism2", "random2"),
        cmp("the annealed partition beats random ones at k_active 1/4", "prism1", "random1"),
        cmp("the trained gate (router fine-tune) beats the proxy gate at k_active 2/4",
            "trained2", "prism2"),
        cmp("the trained gate beats the proxy gate at k_active 1/4", "trained1", "prism1"),
        cmp("the trained gate beats the proxy gate at a global K = 4", "tglobal4", "global4"),
        cmp("the trained gate beats the proxy gate at a global K = 2", "tglobal2", "global2"),
    ]
    top_levels = [{"K": K * N, "key": f"top{K}"} for K in (2, 1)]
    glob_levels = [{"K": TOP_K * N, "key": "top2"}] + [
        {"K": K, "key": f"global{K}"} for K in range(TOP_K * N - 1, 0, -1)]
    ka_levels = [{"K": TOP_K * k, "key": f"prism{k}"} for k in range(N, 0, -1)]
    tglob_levels = [{"K": TOP_K * N, "key": "top2"}] + [
        {"K": K, "key": f"tglobal{K}"} for K in range(TOP_K * N - 1, 0, -1)]
    points = {f"rho {rho:g}": {
        "top_k'": count_points(top_levels, scores, "top2", rho),
        "global K": count_points(glob_levels, scores, "top2", rho),
        "global K, trained gate": count_points(tglob_levels, scores, "top2", rho),
        "k_active": count_points(ka_levels, scores, "top2", rho)} for rho in RHOS}
    return {"arch": arch, "model_id": lm.model_id, "layers": lay.num_layers,
            "experts": lay.num_experts, "top_k": lay.top_k, "subexperts": N,
            "refactor_s": t_refactor, "router": router.meta,
            "objective": {k: float(v.mean()) for k, v in ref.objective.items()},
            "n": len(pairs), "tokens": int(sum(len(c) for c in conts)), "rows": rows,
            "verdicts": verdicts, "operating_points": points}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--n", type=int, default=128, help="held-out windows")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--router-steps", type=int, default=200,
                    help="steps of the router fine-tune (seed §4.3.2)")
    ap.add_argument("--seeds", default=str(SEEDS), help="folder of the seed papers' text")
    ap.add_argument("--json", default=str(RESULTS), help="write every number here ('': not)")
    a = ap.parse_args()
    root = Path(a.seeds)
    if not sorted(root.glob("*.txt")):
        ap.exit(2, f"bench_prism_text: no seed papers (*.txt) in {root}; it trains on them\n")
    t_start = time.perf_counter()
    train_text, held = corpus(root)
    print(f"corpus: {len(train_text):,} training characters, {len(held):,} held out")
    out = {"command": "python benchmarks/bench_prism_text.py", "steps": a.steps,
           "train_chars": len(train_text), "held_out_chars": len(held), "archs": {}}
    tmp = Path(tempfile.mkdtemp(prefix="prism-text-"))
    for arch in a.arch:
        ckpt = tmp / arch
        rec = train(arch, train_text, ckpt, a.steps, held)
        print(f"{arch}: trained {rec['steps']} steps in {rec['seconds']:.0f} s "
              f"({rec['parameters']:,} parameters)")
        res = study(arch, ckpt, train_text, held, a)
        res["training"] = rec
        out["archs"][arch] = res
        for v in res["verdicts"]:
            print(f"  {arch}: {v['claim']}: {v['verdict']} (ΔNLL {v['d_nll']:+.4f} ± "
                  f"{2 * v['se']:.4f})")
        for rho, p in res["operating_points"].items():
            print(f"  {arch} {rho}: stable points " + ", ".join(
                f"{k} {v['stable']} (K {v['stable_K']})" for k, v in p.items()))
    out["wall_s"] = time.perf_counter() - t_start
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"results: {a.json}")


if __name__ == "__main__":
    main()
