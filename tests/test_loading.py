import shutil

import pytest

import workbench
from workbench.errors import ModelLoadError


def test_loads_local_checkpoint_offline(tiny_ckpt, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = workbench.load(tiny_ckpt("mixtral"), device="cpu")
    assert lm.layout.model_type == "mixtral" and not lm.is_vision
    assert len(lm.config_hash) == 16 and lm.model_id == "ckpt"


@pytest.mark.parametrize("breakage, fragment", [
    ("missing", "does not exist"),
    ("config", "has no config.json"),
    ("weights", "has no *.safetensors weights"),
    ("tokenizer", "has no tokenizer"),
    ("bad-config", "config.json in"),
])
def test_broken_directory_names_path_and_what_is_missing(tiny_ckpt, tmp_path, breakage, fragment):
    d = tmp_path / "model"
    if breakage != "missing":
        shutil.copytree(tiny_ckpt("qwen3_moe"), d)
    if breakage == "config":
        (d / "config.json").unlink()
    elif breakage == "weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    elif breakage == "tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink()
    elif breakage == "bad-config":
        (d / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        workbench.load(d, device="cpu")
    assert str(d) in str(e.value) and fragment in str(e.value)


def test_truncated_weights_are_reported(tiny_ckpt, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(tiny_ckpt("olmoe"), d)
    w = next(d.glob("*.safetensors"))
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        workbench.load(d, device="cpu")
