"""The embedded default model: the real Qwen3-VL-MoE class, trained here, loaded like any
checkpoint, and its tokens carry their modality through the runtime into the store."""

import json
import re

import numpy as np
import pytest

import workbench
from workbench.telemetry.events import IMAGE, TEXT


def test_layout_meets_the_spec(embedded, embedded_dir):
    cfg = embedded.model.config
    assert type(embedded.model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    lay = embedded.layout
    assert lay.num_layers >= 8 and lay.num_layers == cfg.text_config.num_hidden_layers
    assert lay.num_experts >= 32 and lay.top_k >= 4
    assert cfg.vision_config.depth >= 2 and embedded.is_vision
    size = sum(p.stat().st_size for p in embedded_dir.rglob("*") if p.is_file())
    assert size <= 30 * 1024 * 1024
    for f in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
              "README.md"):
        assert (embedded_dir / f).is_file(), f


def test_model_card_states_training_and_measured_routing(embedded_dir):
    card = (embedded_dir / "README.md").read_text().lower()
    for words in ("steps", "loss", "accuracy", "entropy", "image", "text", "python -m"):
        assert words in card, words


def test_is_the_default_model():
    from workbench.models.loading import default_model_dir

    rt = workbench.Runtime(device="cpu")
    assert rt.lm.path == default_model_dir()


def test_vl_run_records_modalities(embedded, demo_inputs, tmp_path):
    image, prompt, answer = demo_inputs[0]
    rt = workbench.Runtime(embedded, cache_slots=16, pinned_layers=1, max_new_tokens=4)
    res = rt.run(prompt, images=[image], store=tmp_path / "vl.zarr")
    ds = workbench.open_run(res.store)
    mod = ds.token_modality.values
    n_img = int((mod == IMAGE).sum())
    assert n_img > 0 and (mod == TEXT).sum() > 0
    assert (ds.token_id.values[mod == IMAGE] == embedded.image_token_id).all()
    # prefill routes image and text tokens; decode steps are text only
    by_mod = ds.routed_tokens.sum(("layer", "expert"))
    k = ds.sizes["k"]
    assert int(by_mod.sel(modality="image")[0]) == n_img * k * ds.sizes["layer"]
    assert int(by_mod.sel(modality="image")[1:].sum()) == 0
    assert ds.moe.hit_rate() == pytest.approx(res.hit_rate)
    assert ds.attrs["architecture"] == "Qwen3VLMoeForConditionalGeneration"


def test_answers_demo_questions(embedded, demo_inputs):
    """The trained model answers the bundled demo questions (their answers are generated with
    the scenes); the model card reports held-out accuracy over many more."""
    rt = workbench.Runtime(embedded, cache_slots=32, pinned_layers=2, max_new_tokens=4)
    right = 0
    for image, prompt, answer in demo_inputs:
        res = rt.run(prompt, images=[image], record=False)
        right += res.text.strip() == answer
    assert right >= len(demo_inputs) // 2, f"{right}/{len(demo_inputs)} demo answers right"
