"""A random-weight checkpoint of the embedded model's architecture, wider — for speed only.

The embedded model's experts are 64 wide (hidden 64 × 64): a layer call is a few hundred small
operations, so a run's time is mostly Python and operation launches, not arithmetic. Whether a
mechanism's overhead matters where experts are as wide as a real model's cannot be read from it.
This writes a checkpoint of the same architecture (Qwen3-VL-MoE: layers, experts, top-k,
attention, vision tower, tokenizer, processor and chat template all the embedded model's) with
the text tower ``--hidden`` wide (each expert ``--hidden`` × ``--hidden``, as in the embedded
model) and random weights (transformers' own initialisation, seeded), so the workbench runs it
as any checkpoint folder::

    python benchmarks/wide_model.py /tmp/wide256 --hidden 256
    python benchmarks/bench_prism_speed.py --model /tmp/wide256 --settings offloaded

The weights are random: routing has no learned structure (near-uniform over experts), the
answers are noise. Use it for wall time only, and say so. Writes only ``OUT`` (a new folder).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

#: the embedded checkpoint's files copied as they are (everything but the weights and its card)
_COPIED = ("chat_template.jinja", "generation_config.json", "preprocessor_config.json",
           "processor_config.json", "tokenizer.json", "tokenizer_config.json")


def build(out: Path, hidden: int, layers: int | None, experts: int | None, seed: int) -> Path:
    """Write the checkpoint into ``out`` (a folder that does not exist yet); returns it."""
    import torch
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from workbench.models.embedded import EMBEDDED_MODEL_DIR

    src = Path(EMBEDDED_MODEL_DIR)
    cfg = json.loads((src / "config.json").read_text())
    text = cfg["text_config"]
    text.update(hidden_size=hidden, moe_intermediate_size=hidden, intermediate_size=2 * hidden)
    if layers is not None:
        text["num_hidden_layers"] = layers
    if experts is not None:
        text["num_local_experts"] = experts
    cfg["vision_config"]["out_hidden_size"] = hidden  # the vision tower projects to the text width
    config = Qwen3VLMoeConfig(**{k: v for k, v in cfg.items()
                                 if k not in ("architectures", "transformers_version")})
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(torch.float16).eval()
    out.mkdir()  # (its parent must exist: nothing is made that cleanup would leave behind)
    try:
        model.save_pretrained(out)
        for name in _COPIED:
            shutil.copyfile(src / name, out / name)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written stays behind
        raise
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a new folder for the checkpoint (must not exist; its parent "
                                "must)")
    ap.add_argument("--hidden", type=int, default=256,
                    help="text width and each expert's width (the embedded model: 64)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the embedded 12)")
    ap.add_argument("--experts", type=int, help="experts per layer (default: the embedded 64)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = Path(a.out)
    if out.exists():
        ap.error(f"out {str(out)!r} exists: give a new folder (nothing is overwritten)")
    if not out.parent.is_dir():
        ap.error(f"out {str(out)!r}: its parent folder does not exist")
    # (experts: at least the embedded model's top-k, 4, which every token is routed to)
    for name, v, lo, hi in (("--hidden", a.hidden, 16, 4096), ("--layers", a.layers, 1, 64),
                            ("--experts", a.experts, 4, 512)):
        if v is not None and not lo <= v <= hi:
            ap.error(f"{name} {v} is outside {lo} … {hi}")
    if a.hidden % 16:  # each expert is hidden wide: 4 sub-experts of NVFP4's 16-value groups
        ap.error(f"--hidden {a.hidden} is not a multiple of 16 (an expert's width splits "
                 f"into 4 sub-experts and 16-value low-precision groups)")
    try:
        build(out, a.hidden, a.layers, a.experts, a.seed)
    except FileExistsError:  # another writer made it since the check: theirs, untouched
        ap.error(f"out {str(out)!r} exists: give a new folder (nothing is overwritten)")
    print(f"wrote {out} (random weights: for wall time only)", file=sys.stderr)


if __name__ == "__main__":
    main()
