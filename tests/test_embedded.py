"""The embedded default model: the real Qwen3-VL-MoE class, trained here, loaded like any
checkpoint, and its tokens carry their modality through the runtime into the store."""

import json

import pytest

import workbench
from workbench.telemetry.events import IMAGE, TEXT


def test_layout_meets_the_spec(embedded, embedded_dir):
    cfg = embedded.model.config
    assert type(embedded.model).__name__ == "Qwen3VLMoeForConditionalGeneration"
    lay = embedded.layout
    assert lay.num_layers >= 12 and lay.num_layers == cfg.text_config.num_hidden_layers
    assert lay.num_experts >= 64 and lay.top_k >= 4
    assert cfg.vision_config.depth >= 2 and embedded.is_vision
    weights = embedded_dir / "model.safetensors"
    assert weights.stat().st_size <= 40 * 1024 * 1024
    # stored in float16, computed in float32
    from workbench.models.loading import read_safetensors_header

    assert {t["dtype"] for t in read_safetensors_header(weights).values()} == {"F16"}
    assert next(embedded.model.parameters()).dtype.is_floating_point
    assert str(next(embedded.model.parameters()).dtype) == "torch.float32"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json",
              "README.md"):
        assert (embedded_dir / f).is_file(), f


def test_model_card_states_training_and_measured_routing(embedded_dir):
    card = (embedded_dir / "README.md").read_text()
    for words in ("steps", "loss", "exact match", "token accuracy", "majority", "entropy", "image",
                  "text", "python -m", "re-run"):
        assert words in card.lower(), words
    # the card is rendered from the log it ships with: its numbers are the measured ones
    from workbench.models.embedded.v2.card import render_model_card

    log = json.loads((embedded_dir / "training_log.json").read_text())
    assert card == render_model_card(log)
    ev = log["heldout"]
    assert f"**{ev['exact_match']:.3f}**" in card and f"**{ev['token_accuracy']:.3f}**" in card
    assert log["command"] in card


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


def test_demo_menu_covers_every_task_kind(demo_inputs):
    """At least 8 scenes, every task kind, text-only requests among them, each with an answer."""
    from workbench.models.embedded.v2.tasks import QUESTION_KINDS, question_kind

    assert sum(image is not None for image, _, _ in demo_inputs) >= 8
    assert {question_kind(p) for _, p, _ in demo_inputs} == set(QUESTION_KINDS)
    assert any(image is None for image, _, _ in demo_inputs)
    assert all(answer for _, _, answer in demo_inputs)


def test_answers_demo_requests_through_the_offloading_runtime(embedded, demo_inputs):
    """The trained model answers the bundled demo requests (image and text-only, one word to
    twenty tokens) through the offloading runtime as ``generate`` does: the answers recorded
    in prompts.json (``model_answer``) are reproduced, and most equal the reference."""
    prompts = json.loads((embedded.path.parent / "demo" / "prompts.json").read_text())
    rt = workbench.Runtime(embedded, cache_slots=64, pinned_layers=2, max_new_tokens=24)
    right = 0
    for (image, prompt, answer), entry in zip(demo_inputs, prompts):
        res = rt.run(prompt, images=[image] if image is not None else [], record=False)
        assert res.text.strip() == entry["model_answer"], prompt
        right += res.text.strip() == answer
    assert right >= 0.75 * len(demo_inputs), f"{right}/{len(demo_inputs)} demo answers right"
