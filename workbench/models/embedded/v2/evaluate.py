"""Evaluation of a v2 embedded model: held-out exact match and token accuracy per task kind,
beside chance and blind baselines, and per-layer routing statistics of image vs text tokens."""

from __future__ import annotations

import math
from collections import Counter

import torch

from ..tokenizer import IMAGE_TOKEN_ID
from .model import chunks, encode_batch
from .tasks import CHANCE, QUESTION_KINDS, question_kind

def token_accuracy(prediction: list[str], reference: list[str]) -> float:
    """Share of positions where the predicted and the reference token agree, over the longer
    of the two (so a missing or an extra token costs as much as a wrong one)."""
    width = max(len(prediction), len(reference), 1)
    return sum(p == r for p, r in zip(prediction, reference)) / width


@torch.no_grad()
def generate_answers(model, tokenizer, image_processor, split: list[tuple], batch_size: int) -> list[str]:
    """Greedy answers (decoded new tokens, special tokens skipped, whitespace stripped) to the
    questions of ``split``, in order."""
    answers: list[str] = []
    for chunk in chunks(split, batch_size):
        batch = encode_batch(chunk, tokenizer, image_processor, with_answers=False)
        batch = {k: v.to(model.device) for k, v in batch.items()}
        out = model.generate(**batch, generation_config=model.generation_config)
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        answers += [t.strip() for t in texts]
    return answers


def evaluate(model, tokenizer, image_processor, split: list[tuple], batch_size: int) -> dict:
    """Greedy-generate an answer for every request of ``split`` and :func:`score` them."""
    return score(split, generate_answers(model, tokenizer, image_processor, split, batch_size))


def score(split: list[tuple], predictions: list[str]) -> dict:
    """Scores of ``predictions`` (one decoded answer per request of ``split``), overall and per kind.

    Metrics: **exact match** (prediction == reference answer) and **token accuracy**
    (:func:`token_accuracy` on the space-separated tokens). Baselines beside each:

    - ``chance_uniform``: a uniform guess over the kind's valid answers (``tasks.CHANCE``);
    - ``majority_baseline``: always the kind's most frequent answer in ``split``;
    - ``blind_baseline`` (image kinds only; ``None`` for text-only kinds, whose question is the
      whole input): the best any *question-only* model could do on ``split``, i.e. for every
      distinct question its most frequent answer in ``split``. It is an upper bound of a blind
      model (fitted on the split itself), so beating it means the image was used.

    Overall baselines weight each kind's baseline by its count; the overall blind baseline counts a
    text-only request as right (it needs no image), so it bounds a model without eyes.
    """
    if len(predictions) != len(split):
        raise ValueError(f"{len(predictions)} predictions for {len(split)} requests")
    exact: Counter = Counter()
    tokens: Counter = Counter()
    total: Counter = Counter()
    lengths: list[int] = []
    samples = []
    for (_, question, answer), pred in zip(split, predictions):
        kind = question_kind(question)
        total[kind] += 1
        exact[kind] += pred == answer
        tokens[kind] += token_accuracy(pred.split(), answer.split())
        lengths.append(len(answer.split()))
        if len(samples) < 30 and (pred != answer or len(samples) < 12):
            samples.append({"question": question, "answer": answer, "prediction": pred})
    n = sum(total.values())
    if n == 0:
        raise ValueError("cannot score an empty split")
    majority, blind = _majority_baseline(split), _blind_baseline(split)
    kinds = [k for k in QUESTION_KINDS if total[k]]
    per_kind = {
        kind: {
            "n": total[kind],
            "exact_match": round(exact[kind] / total[kind], 4),
            "token_accuracy": round(tokens[kind] / total[kind], 4),
            "chance_uniform": CHANCE[kind],
            "majority_baseline": majority[kind],
            "blind_baseline": blind.get(kind),
        }
        for kind in kinds
    }
    return {
        "n": n,
        "exact_match": round(sum(exact.values()) / n, 4),
        "token_accuracy": round(sum(tokens.values()) / n, 4),
        "chance_uniform": round(sum(CHANCE[k] * total[k] for k in kinds) / n, 4),
        "majority_baseline": round(sum(majority[k] * total[k] for k in kinds) / n, 4),
        "blind_baseline": round(sum(blind.get(k, 1.0) * total[k] for k in kinds) / n, 4),
        "mean_answer_tokens": round(sum(lengths) / n, 3),
        "per_kind": per_kind,
        "samples": samples,
    }


def _majority_baseline(split: list[tuple]) -> dict[str, float]:
    """Exact match of always answering the most frequent answer of each kind."""
    by_kind: dict[str, Counter] = {k: Counter() for k in QUESTION_KINDS}
    for _, question, answer in split:
        by_kind[question_kind(question)][answer] += 1
    return {
        k: round(c.most_common(1)[0][1] / sum(c.values()), 4) if c else 0.0 for k, c in by_kind.items()
    }


def _blind_baseline(split: list[tuple]) -> dict[str, float]:
    """Per image kind: exact match of answering each distinct question with its most frequent
    answer in ``split`` (the question-only prior; see :func:`score`)."""
    by_question: dict[str, Counter] = {}
    for image, question, answer in split:
        if image is not None:
            by_question.setdefault(question, Counter())[answer] += 1
    right: Counter = Counter()
    total: Counter = Counter()
    for question, answers in by_question.items():
        kind = question_kind(question)
        right[kind] += answers.most_common(1)[0][1]
        total[kind] += sum(answers.values())
    return {k: round(right[k] / total[k], 4) for k in QUESTION_KINDS if total[k]}


@torch.no_grad()
def routing_stats(model, tokenizer, image_processor, split: list[tuple], batch_size: int) -> dict:
    """Per-layer expert usage of image vs text tokens on prompt sequences.

    Forward hooks on every ``layer.mlp.gate`` (which returns ``(router_logits,
    weights, indices)``) collect the top-k expert indices. For each layer and
    modality we histogram the routed assignments (each token counts ``top_k``
    times; padding excluded) and report: entropy of the normalised histogram
    (bits; max log2(num_experts)), experts with at least one assignment, the
    smallest number of experts covering 90% of assignments, how many experts are
    used only by one modality, and the Jensen-Shannon divergence (bits, in [0, 1])
    between the image and text histograms. "text" = every non-image, non-padding
    token of the prompt (template, vision start/end markers and question words).
    """
    layers = model.model.language_model.layers
    num_experts = model.config.text_config.num_experts
    counts = {m: torch.zeros(len(layers), num_experts, dtype=torch.float64) for m in ("image", "text")}
    captured: dict[int, torch.Tensor] = {}

    def hook_for(layer_idx: int):
        def hook(_module, _inputs, output):
            captured[layer_idx] = output[2].detach()  # (batch * seq, top_k) expert indices

        return hook

    handles = [layer.mlp.gate.register_forward_hook(hook_for(i)) for i, layer in enumerate(layers)]
    try:
        for chunk in chunks(split, batch_size):
            batch = encode_batch(chunk, tokenizer, image_processor, with_answers=False)
            batch = {k: v.to(model.device) for k, v in batch.items()}
            captured.clear()
            model(**batch)
            ids = batch["input_ids"].reshape(-1)
            valid = batch["attention_mask"].reshape(-1).bool()
            masks = {"image": valid & (ids == IMAGE_TOKEN_ID), "text": valid & (ids != IMAGE_TOKEN_ID)}
            for layer_idx, indices in captured.items():
                for modality, mask in masks.items():
                    hist = torch.bincount(indices[mask].reshape(-1), minlength=num_experts)
                    counts[modality][layer_idx] += hist.double().cpu()
    finally:
        for handle in handles:
            handle.remove()

    per_layer = []
    for layer_idx in range(len(layers)):
        img, txt = counts["image"][layer_idx], counts["text"][layer_idx]
        p_img, p_txt = img / img.sum(), txt / txt.sum()
        per_layer.append(
            {
                "layer": layer_idx,
                "entropy_bits_image": round(_entropy_bits(p_img), 3),
                "entropy_bits_text": round(_entropy_bits(p_txt), 3),
                "experts_used_image": int((img > 0).sum()),
                "experts_used_text": int((txt > 0).sum()),
                "experts_for_90pct_image": _experts_covering(p_img, 0.9),
                "experts_for_90pct_text": _experts_covering(p_txt, 0.9),
                "experts_image_only": int(((img > 0) & (txt == 0)).sum()),
                "experts_text_only": int(((txt > 0) & (img == 0)).sum()),
                "js_divergence_bits": round(_js_bits(p_img, p_txt), 3),
                "top_experts_image": torch.argsort(img, descending=True)[:4].tolist(),
                "top_experts_text": torch.argsort(txt, descending=True)[:4].tolist(),
            }
        )
    token_counts = {m: int(counts[m][0].sum().item()) // model.config.text_config.num_experts_per_tok for m in counts}
    return {
        "n_examples": len(split),
        "tokens": token_counts,
        "max_entropy_bits": round(math.log2(num_experts), 3),
        "per_layer": per_layer,
    }


def _entropy_bits(p: torch.Tensor) -> float:
    nz = p[p > 0]
    return float(-(nz * torch.log2(nz)).sum())


def _js_bits(p: torch.Tensor, q: torch.Tensor) -> float:
    m = 0.5 * (p + q)
    return _entropy_bits(m) - 0.5 * (_entropy_bits(p) + _entropy_bits(q))


def _experts_covering(p: torch.Tensor, mass: float) -> int:
    cumulative = torch.cumsum(torch.sort(p, descending=True).values, 0)
    return int((cumulative < mass - 1e-12).sum()) + 1




def main(argv: list[str] | None = None) -> dict:
    """Held-out exact match per kind of a model folder at one or more scene scales (issue 39 §8):
    ``python -m workbench.models.embedded.v2.evaluate [MODEL] [--n 200] [--scale 1,2]
    [--image-only]``; the same requests (``make_split(HELDOUT_SEED, n)``) at every scale, each
    through a processor whose pixel budget keeps that scale's images whole. Prints one line per
    scale and returns ``{scale: score}``."""
    import argparse
    import json

    import workbench

    from . import V2_MODEL_DIR
    from .model import build_image_processor, build_v2_tokenizer
    from .tasks import SCENE_SIZE, check_scale, make_split
    from workbench.models.batches import HELDOUT_SEED  # not .train: it imports this module

    def scales(text: str) -> list[int]:
        try:
            return [check_scale(int(x)) for x in text.split(",")]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e) if "scale" in str(e) else
                                             f"{text!r} is not a comma-separated list of whole numbers") from None

    ap = argparse.ArgumentParser(description=main.__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=str(V2_MODEL_DIR), help="model folder (default: the shipped one)")
    ap.add_argument("--n", type=int, default=200, help="held-out requests (default 200)")
    ap.add_argument("--scale", type=scales, default=[1], help="scene scales, comma separated, 1-4 (default 1)")
    ap.add_argument("--image-only", action="store_true", help="only requests with an image")
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args(argv)
    if not 1 <= a.n <= 10_000:
        ap.error(f"--n must be from 1 to 10000, not {a.n}")
    torch.set_num_threads(2)
    model = workbench.load(a.model, device="cpu").model  # as the runtime loads it
    tokenizer = build_v2_tokenizer()
    out = {}
    for s in a.scale:
        split = make_split(HELDOUT_SEED, a.n, image_only=a.image_only, scale=s)
        r = out[s] = evaluate(model, tokenizer, build_image_processor(s), split, a.batch)
        print(f"scale {s} ({SCENE_SIZE * s} px): exact match {r['exact_match']:.1%}; " + ", ".join(
            f"{k} {v['exact_match']:.0%} (n={v['n']})" for k, v in r["per_kind"].items()), flush=True)
    print(json.dumps({str(s): {k: v["exact_match"] for k, v in r["per_kind"].items()} for s, r in out.items()}))
    return out


if __name__ == "__main__":
    main()
