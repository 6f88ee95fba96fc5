"""Issue 10 §12, 13, 15, 16: hostile inputs get a message, not a traceback.

Each class of hostile input — images, knob values, model folders, sweeps — is tried with many
members, and every one must raise a :class:`~workbench.errors.WorkbenchError` (the CLI's exit 2
and one-line message) whose text names the thing at fault and what is allowed. Broken model
folders are copies of the tiny and embedded checkpoints, built once per module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import param
import pytest
import torch
from PIL import Image

import workbench
from workbench.errors import InputError, KnobError, ModelLoadError, WorkbenchError
from workbench.knobs import CEILINGS, Knobs
from workbench.models import inputs as inputs_mod
from workbench.models.inputs import (MAX_ASPECT_RATIO, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS,
                                     Request, build_inputs, open_image, probe_image)
from workbench.models.loading import check_logits

ROOT = Path(__file__).resolve().parents[1]
SCENE = ROOT / "data" / "demo" / "scene_0.png"


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, f"message is not one line: {text!r}"
    assert "Traceback" not in text
    return text


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


def png_header(width: int, height: int, idat: bytes | None = None, bits: int = 8,
               color: int = 2) -> bytes:
    """A PNG whose header claims ``width`` × ``height`` (with little or no pixel data: the
    checks must refuse it from the header, before any decoding)."""
    ihdr = struct.pack(">IIBBBBB", width, height, bits, color, 0, 0, 0)
    body = _chunk(b"IHDR", ihdr)
    if idat is not None:
        body += _chunk(b"IDAT", idat)
    return b"\x89PNG\r\n\x1a\n" + body + _chunk(b"IEND", b"")


# ============================================================================================
# §12 images
# ============================================================================================
@pytest.fixture(scope="module")
def img_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("images")
    (d / "bomb_20000.png").write_bytes(png_header(20000, 20000, zlib.compress(b"\0" * 1000)))
    (d / "bomb_pil_limit.png").write_bytes(png_header(2**31 - 1, 2**31 - 1))
    (d / "big_8000.png").write_bytes(png_header(8000, 8000, zlib.compress(b"\0" * 1000)))
    Image.new("RGB", (10000, 2), "red").save(d / "wide_10000x2.png")
    Image.new("RGB", (2, 10000), "red").save(d / "tall_2x10000.png")
    Image.new("RGB", (201, 1), "red").save(d / "ratio_201.png")
    (d / "empty.png").write_bytes(b"")
    raw = SCENE.read_bytes()
    (d / "truncated.png").write_bytes(raw[: len(raw) // 2])
    (d / "truncated_header.png").write_bytes(raw[:30])
    (d / "bad_idat.png").write_bytes(png_header(64, 64, os.urandom(200)))
    (d / "zero_width.png").write_bytes(png_header(0, 10, zlib.compress(b"")))
    (d / "garbage.png").write_bytes(os.urandom(2048))
    (d / "text.png").write_text("hello, not an image")
    gif = Image.new("P", (1, 1))
    gif.save(d / "tiny.gif")
    g = bytearray((d / "tiny.gif").read_bytes())
    g[6:10] = (65535).to_bytes(2, "little") * 2  # logical screen 65535 × 65535
    (d / "gif_screen_bomb.gif").write_bytes(bytes(g))
    (d / "a_directory.png").mkdir()
    (d / "loop_a").symlink_to(d / "loop_b")
    (d / "loop_b").symlink_to(d / "loop_a")
    os.mkfifo(d / "fifo.png")
    with open(d / "huge_bytes.png", "wb") as f:  # sparse: bigger than the byte limit
        f.truncate(MAX_IMAGE_BYTES + 1)
    Image.new("RGB", (8, 8)).save(d / "picture.eps")  # a format that runs Ghostscript
    # accepted modes and shapes
    Image.new("RGB", (1, 1), "red").save(d / "one_pixel.png")
    Image.new("RGB", (400, 2), "red").save(d / "ratio_200.png")
    frames = [Image.new("RGB", (32, 32), c) for c in ("red", "green", "blue")]
    frames[0].save(d / "animated.gif", save_all=True, append_images=frames[1:], duration=50)
    Image.new("CMYK", (32, 32), (0, 255, 0, 0)).save(d / "cmyk.jpg")
    Image.fromarray(np.full((32, 32), 32896, np.uint16)).save(d / "gray16.png")  # mid-gray
    im = Image.new("P", (32, 32), 0)
    im.save(d / "palette_transparent.png", transparency=0)
    Image.new("RGBA", (32, 32), (255, 0, 0, 0)).save(d / "rgba_transparent.png")
    Image.new("LA", (32, 32), (0, 255)).save(d / "la_black.png")
    Image.new("1", (32, 32), 1).save(d / "bilevel.png")
    Image.new("F", (32, 32), 0.5).save(d / "float.tif")
    Image.new("I", (32, 32), 70000).save(d / "int32.tif")
    Image.new("RGB", (32, 32), "red").save(d / "red.webp")
    a, b = Image.new("RGB", (32, 32), "red"), Image.new("RGB", (32, 32), "blue")
    a.save(d / "camera.mpo", save_all=True, append_images=[b])
    return d


REFUSED = [
    # (file, fragments of the message)
    ("bomb_20000.png", ["400,000,000 pixels", f"at most {MAX_IMAGE_PIXELS:,} pixels"]),
    ("bomb_pil_limit.png", ["decompression bomb", f"at most {MAX_IMAGE_PIXELS:,} pixels"]),
    ("gif_screen_bomb.gif", ["decompression bomb", f"at most {MAX_IMAGE_PIXELS:,} pixels"]),
    ("big_8000.png", ["8000×8000", f"at most {MAX_IMAGE_PIXELS:,} pixels"]),
    ("wide_10000x2.png", ["10000×2", "5000:1", f"at most {MAX_ASPECT_RATIO}:1"]),
    ("tall_2x10000.png", ["2×10000", "5000:1", f"at most {MAX_ASPECT_RATIO}:1"]),
    ("ratio_201.png", ["201:1", f"at most {MAX_ASPECT_RATIO}:1"]),
    ("empty.png", ["is empty (0 bytes)"]),
    ("truncated.png", ["damaged or truncated PNG"]),
    ("truncated_header.png", ["not a readable image", "PNG, JPEG"]),
    ("bad_idat.png", ["damaged or truncated PNG"]),
    ("zero_width.png", ["not a readable image"]),
    ("garbage.png", ["not a readable image", "PNG, JPEG"]),
    ("text.png", ["not a readable image"]),
    ("picture.eps", ["not a readable image", "PNG, JPEG"]),
    ("a_directory.png", ["is a directory"]),
    ("loop_a", ["cannot be read"]),
    ("fifo.png", ["not a regular file"]),
    ("huge_bytes.png", [f"at most {MAX_IMAGE_BYTES:,} bytes"]),
    ("no_such_file.png", ["does not exist"]),
]


@pytest.mark.parametrize("name, fragments", REFUSED, ids=[r[0] for r in REFUSED])
def test_hostile_image_files_are_refused_by_name(img_dir, name, fragments):
    path = img_dir / name
    decode_time = name in ("truncated.png", "bad_idat.png")  # the header is fine
    for fn in (open_image,) if decode_time else (open_image, probe_image):
        with pytest.raises(InputError) as e:
            fn(path)
        msg = one_line(e.value)
        assert str(path) in msg
        for f in fragments:
            assert f in msg, msg


@pytest.mark.parametrize("bad, fragment", [
    (5, "must be a file path or a PIL image, not int"),
    (b"scene.png", "not bytes"),
    (None, "not NoneType"),
    ("", "image path is empty"),
    ("  ", "image path is empty"),
    ("bad\x00name.png", "cannot be read"),
    ("x" * 5000 + ".png", "cannot be read"),
    (Image.new("RGB", (10000, 2)), "aspect ratio of 5000:1"),
    (Image.new("RGB", (5000, 5000)), f"at most {MAX_IMAGE_PIXELS:,} pixels"),
    (Image.new("RGB", (0, 0)), "at least 1×1"),
])
def test_hostile_image_objects_are_refused(bad, fragment):
    with pytest.raises(InputError) as e:
        open_image(bad)
    assert fragment in one_line(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_image_file(img_dir, tmp_path):
    p = tmp_path / "secret.png"
    shutil.copy(SCENE, p)
    p.chmod(0)
    with pytest.raises(InputError, match="permission denied"):
        open_image(p)


@pytest.mark.parametrize("name, pixel", [
    ("one_pixel.png", (255, 0, 0)),
    ("ratio_200.png", (255, 0, 0)),
    ("animated.gif", (255, 0, 0)),  # the first frame
    ("camera.mpo", (255, 0, 0)),  # the first picture
    ("cmyk.jpg", (255, 0, 255)),
    ("gray16.png", (128, 128, 128)),  # scaled to 8 bits, not clipped to white
    ("palette_transparent.png", (255, 255, 255)),  # alpha onto white, like transformers
    ("rgba_transparent.png", (255, 255, 255)),
    ("la_black.png", (0, 0, 0)),
    ("bilevel.png", (255, 255, 255)),
    ("float.tif", (128, 128, 128)),
    ("int32.tif", (255, 255, 255)),
    ("red.webp", None),
])
def test_unusual_but_valid_images_decode_to_rgb(img_dir, name, pixel):
    im = open_image(img_dir / name)
    assert im.mode == "RGB" and im.size[0] >= 1
    if pixel is not None:
        got = np.asarray(im)[0, 0]
        assert np.abs(got.astype(int) - pixel).max() <= 2, (name, got)


def test_unusual_images_run_through_the_vl_processor(embedded, img_dir):
    names = ["one_pixel.png", "ratio_200.png", "animated.gif", "cmyk.jpg", "gray16.png",
             "palette_transparent.png", "float.tif"]
    for n in names:
        inp = build_inputs(embedded, Request("what color is it?", [img_dir / n]))
        assert int((inp.modality != 0).sum()) > 0


def test_processor_refusals_become_input_errors(embedded, img_dir, monkeypatch):
    """The workbench's own 200:1 check is the processor's; were it looser, the processor's
    refusal still comes back as an InputError naming the image."""
    monkeypatch.setattr(inputs_mod, "MAX_ASPECT_RATIO", 10**6)
    path = img_dir / "wide_10000x2.png"
    with pytest.raises(InputError) as e:
        build_inputs(embedded, Request("what?", [path]))
    msg = one_line(e.value)
    assert "image processor" in msg and "aspect ratio" in msg


@pytest.mark.parametrize("prompt, images, fragment", [
    ("what <|image_pad|> is it?", [], "image placeholder '<|image_pad|>'"),
    ("what <|image_pad|> is it?", [SCENE], "image placeholder '<|image_pad|>'"),
    ("a <|video_pad|> b", [], "video placeholder '<|video_pad|>'"),
    ("bad \ud800 text", [], "lone surrogate"),
    (42, [], "prompt must be text"),
    ("   ", [], "prompt is empty"),
    ("how many?", [SCENE] * 40, "more than the model's context of 512 tokens"),
])
def test_hostile_prompts(embedded, prompt, images, fragment):
    with pytest.raises(InputError) as e:
        build_inputs(embedded, Request(prompt, images))
    assert fragment in one_line(e.value)


def test_cli_run_refuses_a_bomb_with_one_line(tiny_ckpt, img_dir, capsys):
    from workbench.cli import main

    for name in ("bomb_20000.png", "wide_10000x2.png", "a_directory.png", "empty.png"):
        rc = main(["run", "--model", str(tiny_ckpt()), "--prompt", "x", "--no-record",
                   "--image", str(img_dir / name)])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("workbench: error:") and err.count("\n") == 1, err
        assert name in err


# ============================================================================================
# §13 knobs
# ============================================================================================
def _knobs_of(kind) -> list[str]:
    k = Knobs()
    out = []
    for g in k.groups.values():
        for n in g.knob_names():
            p = g.param[n]
            if kind is param.Number and isinstance(p, param.Integer):
                continue
            if isinstance(p, kind):
                out.append(n)
    return out


NUMBER_KNOBS = _knobs_of(param.Number)
INTEGER_KNOBS = _knobs_of(param.Integer)
BOOLEAN_KNOBS = _knobs_of(param.Boolean)
SELECTOR_KNOBS = _knobs_of(param.Selector)


def test_the_knob_classes_are_covered():
    assert {"lam", "temperature", "top_p", "alpha", "beta", "ae_alpha"} <= set(NUMBER_KNOBS)
    assert {"cache_slots", "seed", "ae_window", "lookahead_depth"} <= set(INTEGER_KNOBS)


@pytest.mark.parametrize("name", NUMBER_KNOBS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, np.float64("nan"),
                                   np.float32("inf"), 10**400])
def test_non_finite_numbers_are_refused_in_python(name, value):
    with pytest.raises(KnobError) as e:
        Knobs(**{name: value})
    msg = one_line(e.value)
    assert msg.startswith(name) and "finite number" in msg and "allowed:" in msg


@pytest.mark.parametrize("name", NUMBER_KNOBS)
@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "Infinity", "1e999", "-1e999", "NaN"])
def test_non_finite_numbers_are_refused_from_strings(name, text):
    with pytest.raises(KnobError) as e:
        Knobs().set_from_strings([f"{name}={text}"])
    msg = one_line(e.value)
    assert msg.startswith(name) and "finite number" in msg and repr(text) in msg


@pytest.mark.parametrize("name", NUMBER_KNOBS)
@pytest.mark.parametrize("value", [True, "0.5", [0.5], None])
def test_numbers_refuse_other_types(name, value):
    with pytest.raises(KnobError) as e:
        Knobs(**{name: value})
    assert one_line(e.value).startswith(name)


def test_minus_zero_is_zero_and_attrs_are_standard_json():
    k = Knobs().set_from_strings(["lam=-0", "ae_tau=-0.0", "alpha=-0"])
    assert math.copysign(1.0, k.lam) == 1.0 and k.to_attrs()["knob.lam"] == "0.0"
    for v in k.to_attrs().values():
        json.loads(v, parse_constant=lambda c: pytest.fail(f"non-standard JSON {c}"))


@pytest.mark.parametrize("name", INTEGER_KNOBS)
@pytest.mark.parametrize("value, fragment", [
    (True, "a boolean"), (False, "a boolean"), (np.True_, "a boolean"), (2.5, "fraction"),
    (3.0, "fraction"), ("3", "str"), (10**30, "at most"), (2**53, "at most"),
    (math.inf, "fraction"), ([3], "list"),
])
def test_integers_refuse_bools_floats_and_huge_values(name, value, fragment):
    with pytest.raises(KnobError) as e:
        Knobs(**{name: value})
    msg = one_line(e.value)
    assert msg.startswith(name) and fragment in msg and "allowed: an integer" in msg


@pytest.mark.parametrize("name", INTEGER_KNOBS)
@pytest.mark.parametrize("text", ["1.5", "1e3", "0x10", "ten", "9" * 5000, "true"])
def test_integers_refuse_bad_strings(name, text):
    with pytest.raises(KnobError) as e:
        Knobs().set_from_strings([f"{name}={text}"])
    msg = one_line(e.value)
    assert msg.startswith(name) and "must be an integer" in msg and len(msg) < 400


@pytest.mark.parametrize("name, ceiling", sorted(CEILINGS.items()))
def test_allocation_sized_knobs_have_ceilings(name, ceiling):
    Knobs(**{name: ceiling})
    with pytest.raises(KnobError, match=rf"{name} must be at most {ceiling}, not {ceiling + 1}"):
        Knobs(**{name: ceiling + 1})


def test_numpy_integers_are_plain_ints():
    k = Knobs(cache_slots=np.int64(12), sampling=np.bool_(True))
    assert type(k.cache_slots) is int and type(k.sampling) is bool
    json.dumps(k.to_dict())


@pytest.mark.parametrize("name", BOOLEAN_KNOBS)
@pytest.mark.parametrize("value", [1, 0, "yes", None, 2.0])
def test_booleans_refuse_non_booleans(name, value):
    with pytest.raises(KnobError) as e:
        Knobs(**{name: value})
    assert one_line(e.value).startswith(name)


@pytest.mark.parametrize("name", SELECTOR_KNOBS)
@pytest.mark.parametrize("value", [5, ["x"], None, "definitely-not-a-choice"])
def test_selectors_refuse_non_choices(name, value):
    with pytest.raises(KnobError) as e:
        Knobs(**{name: value})
    msg = one_line(e.value)
    assert msg.startswith(name)
    assert str(Knobs()._owner(name).param[name].objects[0]) in msg  # the choices are listed


@pytest.mark.parametrize("value", [5, "a\x00b"])
def test_text_knob_refuses_non_text_and_nul(value):
    with pytest.raises(KnobError, match="predictor_path"):
        Knobs(predictor_path=value)


def test_tiny_temperature_that_overflows_is_refused():
    with pytest.raises(KnobError, match=r"temperature must be at least 1e-06, not 1e-40"):
        Knobs(temperature=1e-40)


def test_widget_set_values_are_rechecked_before_a_run(embedded):
    k = Knobs(compression="affinity")
    k.group("compression").lam = math.inf  # what a number widget may do, past Knobs.set
    with pytest.raises(KnobError, match="lam must be a finite number"):
        k.validate()
    with pytest.raises(KnobError, match="lam must be a finite number"):
        workbench.Runtime(embedded, knobs=Knobs()).run("x", record=False, lam=math.inf)
    rt = workbench.Runtime(embedded, knobs=Knobs(compression="affinity", device="cpu"))
    rt.knobs.group("compression").lam = math.inf
    with pytest.raises(KnobError, match="lam must be a finite number"):
        rt.run("what color is the circle?", [SCENE], record=False)


@pytest.mark.parametrize("key, text, fragment", [
    ("knob.lam", "{not json", "not valid JSON"),
    ("knob.lam", "Infinity", "Infinity is not standard JSON"),
    ("knob.lam", "NaN", "NaN is not standard JSON"),
    ("knob.lam", "-Infinity", "not standard JSON"),
    ("knob.lam", "1e999", "finite number"),
    ("knob.lam", '"2.0"', "must be a number"),
    ("knob.cache_slots", "true", "a boolean"),
    ("knob.cache_slots", "2.5", "fraction"),
    ("knob.cache_slots", "1e30", "fraction"),
    ("knob.cache_slots", "-3", "at least 1"),
    ("knob.sampling", '"yes"', "must be a boolean"),
    ("knob.eviction", "42", "must be one of"),
    ("knob.predictor_path", '"a\\u0000b"', "NUL"),
])
def test_from_attrs_names_the_bad_attribute(key, text, fragment):
    attrs = {**Knobs().to_attrs(), key: text}
    with pytest.raises(KnobError) as e:
        Knobs.from_attrs(attrs)
    msg = one_line(e.value)
    assert repr(key) in msg and fragment in msg, msg


def test_from_attrs_keeps_defaults_for_unknown_knobs_and_policies():
    attrs = {**Knobs(cache_slots=7).to_attrs(), "knob.eviction": '"retired-policy"',
             "knob.no_such_knob": "{garbage", "other": "x"}
    k = Knobs.from_attrs(attrs)
    assert k.cache_slots == 7 and k.eviction == "lru"


def test_lam_inf_with_affinity_is_refused_before_the_run(embedded, capsys):
    with pytest.raises(KnobError, match="lam must be a finite number"):
        workbench.Runtime(embedded, compression="affinity", lam=math.inf)
    from workbench.cli import main

    rc = main(["run", "--prompt", "what color?", "--image", str(SCENE), "--no-record",
               "--set", "compression=affinity", "--set", "lam=inf"])
    err = capsys.readouterr().err
    assert rc == 2 and "lam must be a finite number, not 'inf'" in err and err.count("\n") == 1


# ============================================================================================
# §15 model folders
# ============================================================================================
def _edit_weights(d: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    f = d / "model.safetensors"
    sd = fn(load_file(f))
    f.unlink()
    save_file(sd, f, metadata={"format": "pt"})


def _put(key, make):
    return lambda sd: {**sd, key: make(sd)}


def _drop(*keys):
    return lambda sd: {k: v for k, v in sd.items() if k not in keys}


def _cfg(d: Path, **changes) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


def _image_std(d: Path, std: list) -> None:
    """``image_std`` in both places a processor may read it from."""
    pre = json.loads((d / "preprocessor_config.json").read_text())
    (d / "preprocessor_config.json").write_text(json.dumps({**pre, "image_std": std}))
    proc = json.loads((d / "processor_config.json").read_text())
    proc["image_processor"] = {**proc.get("image_processor", {}), "image_std": std}
    (d / "processor_config.json").write_text(json.dumps(proc))


def _raw(d: Path, data: bytes) -> None:
    (d / "model.safetensors").write_bytes(data)


def _header(h: dict, tail: bytes = b"") -> bytes:
    hb = json.dumps(h).encode()
    return struct.pack("<Q", len(hb)) + hb + tail


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    b = f.read_bytes()
    f.write_bytes(b[: len(b) // 2])


def _bin_only(d: Path) -> None:
    from safetensors.torch import load_file

    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")


def _sharded_missing(d: Path) -> None:
    from safetensors.torch import load_file

    keys = list(load_file(d / "model.safetensors"))
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(keys)}}))


def _st_dir(d: Path) -> None:
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").mkdir()


def _cfg_dir(d: Path) -> None:
    (d / "config.json").unlink()
    (d / "config.json").mkdir()


TEXT_GATE = "model.layers.0.mlp.gate.weight"

#: name → (source checkpoint, breakage, fragments of the ModelLoadError)
BROKEN = {
    # tensors: missing, mismatched, wrong dtype, non-finite
    "missing_tensor": ("tiny", lambda d: _edit_weights(d, _drop(TEXT_GATE)),
                       ["lack 1 tensor", TEXT_GATE, "random values"]),
    "missing_lm_head": ("tiny", lambda d: _edit_weights(d, _drop("lm_head.weight")),
                        ["lack 1 tensor", "lm_head.weight"]),
    "missing_vision_tensors": ("emb", lambda d: _edit_weights(
        d, lambda sd: {k: v for k, v in sd.items() if "visual.blocks.0.attn.qkv" not in k}),
        ["lack 2 tensors", "model.visual.blocks.0.attn.qkv.weight"]),
    "wrong_shape": ("tiny", lambda d: _edit_weights(d, _put(TEXT_GATE, lambda sd: torch.zeros(
        9, 32))), [TEXT_GATE, "(9, 32) in the checkpoint, (8, 32) in the model"]),
    "transposed": ("tiny", lambda d: _edit_weights(d, _put("lm_head.weight", lambda sd: sd[
        "lm_head.weight"].T.contiguous())), ["'lm_head.weight' is (32, 128) in the checkpoint"]),
    "int8_lm_head": ("tiny", lambda d: _edit_weights(d, _put("lm_head.weight", lambda sd: (
        sd["lm_head.weight"] * 100).to(torch.int8))), ["'lm_head.weight' (I8)", "floating"]),
    "bool_weight": ("tiny", lambda d: _edit_weights(d, _put("model.norm.weight", lambda sd: sd[
        "model.norm.weight"] > 0)), ["'model.norm.weight' (BOOL)"]),
    "int64_weight": ("tiny", lambda d: _edit_weights(d, _put("model.norm.weight", lambda sd: sd[
        "model.norm.weight"].long())), ["'model.norm.weight' (I64)"]),
    "all_nan": ("tiny", lambda d: _edit_weights(d, lambda sd: {
        k: torch.full_like(v, math.nan) for k, v in sd.items()}), ["are broken", "NaN or inf"]),
    "nan_experts": ("tiny", lambda d: _edit_weights(d, lambda sd: {
        k: (torch.full_like(v, math.nan) if "experts" in k else v) for k, v in sd.items()}),
        ["are broken", "experts"]),
    "one_inf": ("tiny", lambda d: _edit_weights(d, _put("model.norm.weight", lambda sd: (
        torch.full_like(sd["model.norm.weight"], math.inf)))),
        ["'model.norm.weight' (32 of 32 values)"]),
    "nan_vision": ("emb", lambda d: _edit_weights(d, lambda sd: {
        k: (torch.full_like(v, math.nan) if "visual.merger" in k else v) for k, v in sd.items()}),
        ["are broken", "model.visual.merger"]),
    # safetensors files
    "empty_safetensors": ("tiny", lambda d: _raw(d, b""), ["model.safetensors", "too short"]),
    "garbage_safetensors": ("tiny", lambda d: _raw(d, b"\xff" * 4096),
                            ["not a safetensors file", "header claims"]),
    "header_len_huge": ("tiny", lambda d: _raw(d, struct.pack("<Q", 2**62) + b"{}"),
                        ["header claims 4,611,686,018,427,387,904 bytes"]),
    "header_not_json": ("tiny", lambda d: _raw(d, struct.pack("<Q", 10) + b"not json!!"),
                        ["its header is not valid JSON"]),
    "header_not_object": ("tiny", lambda d: _raw(d, _header([1, 2])), ["JSON array"]),
    "header_huge_tensor": ("tiny", lambda d: _raw(d, _header({"lm_head.weight": {
        "dtype": "F32", "shape": [10**12], "data_offsets": [0, 4 * 10**12]}}, b"\0" * 64)),
        ["is truncated", "'lm_head.weight' ends at byte 4,000,000,000,000"]),
    "header_bad_dtype": ("tiny", lambda d: _raw(d, _header({"w": {
        "dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16)), ["'F128'"]),
    "header_offsets_lie": ("tiny", lambda d: _raw(d, _header({"w": {
        "dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8)),
        ["needs 16 bytes", "span 8"]),
    "header_negative_shape": ("tiny", lambda d: _raw(d, _header({"w": {
        "dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4)), ["shape [-1]"]),
    "header_trailing_bytes": ("tiny", lambda d: _raw(d, _header({"w": {
        "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 40)),
        ["cover 4 of its 40"]),
    "truncated_safetensors": ("tiny", _truncate, ["is truncated", "ends at byte"]),
    "safetensors_is_dir": ("tiny", _st_dir, ["model.safetensors is not a regular file"]),
    "no_weights": ("tiny", lambda d: (d / "model.safetensors").unlink(),
                   ["has no *.safetensors weights"]),
    "pickle_only": ("tiny", _bin_only, ["only 'pytorch_model.bin'", "never opened"]),
    "shard_missing": ("tiny", _sharded_missing, ["lacks shard 'model-00002-of-00002"]),
    "bad_index": ("tiny", lambda d: ((d / "model.safetensors").unlink(), (
        d / "model.safetensors.index.json").write_text("[]")), ["not a valid shard index"]),
    "index_escapes_dir": ("tiny", lambda d: ((d / "model.safetensors").unlink(), (
        d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "../../etc/passwd.safetensors"}}))), ["shards must be *.safetensors files"]),
    # config.json
    "config_not_json": ("tiny", lambda d: (d / "config.json").write_text("{nope"),
                        ["config.json in", "not valid JSON"]),
    "config_list": ("tiny", lambda d: (d / "config.json").write_text("[]"), ["JSON array"]),
    "config_null": ("tiny", lambda d: (d / "config.json").write_text("null"), ["JSON null"]),
    "config_number": ("tiny", lambda d: (d / "config.json").write_text("42"), ["JSON number"]),
    "config_nan": ("tiny", lambda d: (d / "config.json").write_text('{"model_type": NaN}'),
                   ["NaN is not standard JSON"]),
    "config_no_model_type": ("tiny", lambda d: _cfg(d, model_type=None),
                             ['no "model_type"']),
    "config_unknown_type": ("tiny", lambda d: _cfg(d, model_type="nope_moe"), ["nope_moe"]),
    "config_is_dir": ("tiny", _cfg_dir, ["config.json in", "is not a regular file"]),
    # never ends (a FIFO blocks, /dev/zero is endless): refused before it is opened
    "config_fifo": ("tiny", lambda d: ((d / "config.json").unlink(),
                                       os.mkfifo(d / "config.json")),
                    ["config.json in", "is not a regular file"]),
    "config_dev_zero": ("tiny", lambda d: ((d / "config.json").unlink(),
                                           (d / "config.json").symlink_to("/dev/zero")),
                        ["config.json in", "is not a regular file"]),
    "config_huge_file": ("tiny", lambda d: (d / "config.json").write_text(
        "{" + " " * (17 * 2**20) + "}"), ["config.json in", "is too large"]),
    "config_layers_string": ("tiny", lambda d: _cfg(d, num_hidden_layers="3"),
                             ["num_hidden_layers"]),
    "config_layers_huge": ("tiny", lambda d: _cfg(d, num_hidden_layers=10**5),
                           ["num_hidden_layers"]),
    "config_hidden_mismatch": ("tiny", lambda d: _cfg(d, hidden_size=64),
                               ["do not fit config.json", "(128, 64) in the model"]),
    "config_vocab_huge": ("tiny", lambda d: _cfg(d, vocab_size=10**9),
                          ["describes a model of", "do not belong together"]),
    "config_experts_huge": ("tiny", lambda d: _cfg(d, moe_intermediate_size=10**7),
                            ["describes a model of", "do not belong together"]),
    "config_more_experts": ("tiny", lambda d: _cfg(d, num_experts=16),
                            ["(16, 32, 32) in the model"]),
    "config_topk_above_experts": ("tiny", lambda d: _cfg(d, num_experts_per_tok=99),
                                  ["top-99 of 8 experts"]),
    # tokenizer, template, processor
    "tokenizer_missing": ("tiny", lambda d: [(d / f).unlink() for f in (
        "tokenizer.json", "tokenizer_config.json")], ["has no tokenizer"]),
    "tokenizer_garbage": ("tiny", lambda d: (d / "tokenizer.json").write_text("{garbage"),
                          ["tokenizer in", "tokenizer.json is not valid JSON"]),
    "tokenizer_json_missing": ("tiny", lambda d: (d / "tokenizer.json").unlink(),
                               ["tokenizer in"]),
    "chat_template_broken": ("emb", lambda d: (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content "), ["chat template in", "is broken"]),
    # a template that amplifies (issue 26): bounded in memory, by class, not by operator
    "chat_template_times": ("emb", lambda d: (d / "chat_template.jinja").write_text(
        "{{ 'a' * 3000000000 }}"), ["chat template in", "more than 1 GiB of memory"]),
    "chat_template_join": ("emb", lambda d: (d / "chat_template.jinja").write_text(
        "{{ range(100000)|join('a' * 100000) }}"), ["chat template in", "of memory"]),
    "chat_template_width": ("emb", lambda d: (d / "chat_template.jinja").write_text(
        "{{ '{:>3000000000}'.format('a') }}"), ["chat template in", "of memory"]),
    "chat_template_long": ("emb", lambda d: (d / "chat_template.jinja").write_text(
        "{{ 'x' * 20000000 }}"), ["chat template in", "rendered more than 9,437,184 characters"]),
    "preprocessor_garbage": ("emb", lambda d: [(d / f).write_text("{garbage") for f in (
        "preprocessor_config.json", "processor_config.json")], ["image processor in"]),
    "preprocessor_missing": ("emb", lambda d: [(d / f).unlink() for f in (
        "preprocessor_config.json", "processor_config.json")], ["image processor in"]),
    # image_std of zeros: every image becomes inf/NaN (was blamed on the weights)
    "image_std_zero": ("emb", lambda d: _image_std(d, [0.0, 0.0, 0.0]),
                       ["image_std is [0.0, 0.0, 0.0]", "each > 0"]),
    # a config declaring 100 000 layers: refused before anything is built (76 s, 4 GB before)
    "config_100k_layers": ("tiny", lambda d: _cfg(d, num_hidden_layers=100_000),
                           ["num_hidden_layers = 100,000", "do not belong together"]),
    "vision_100k_depth": ("emb", lambda d: _cfg(d, vision_config={
        **json.loads((d / "config.json").read_text())["vision_config"], "depth": 100_000}),
        ["vision_config.depth = 100,000", "blocks"]),
    # JSON nested 100 000 deep (RecursionError before issue 26)
    "config_nested": ("tiny", lambda d: (d / "config.json").write_text(
        '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"), ["config.json", "nested deeper than 64"]),
}


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, tiny_ckpt, embedded_dir):
    """Factory: the broken copy ``name`` of :data:`BROKEN` (built once)."""
    root = tmp_path_factory.mktemp("broken")
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            src, breakage, _ = BROKEN[name]
            d = root / name
            shutil.copytree(tiny_ckpt("qwen2_moe") if src == "tiny" else embedded_dir, d)
            breakage(d)
            made[name] = d
        return made[name]

    return make


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_model_folders_name_path_and_fault(broken_models, name, no_hang):
    d = broken_models(name)
    with pytest.raises(ModelLoadError) as e:
        no_hang(lambda: workbench.load(d, device="cpu"))  # a FIFO read would never end
    msg = one_line(e.value)
    assert str(d) in msg
    for f in BROKEN[name][2]:
        assert f in msg, msg
    assert len(msg) < 1200


def test_what_a_config_says_of_images_never_blocks(broken_models, no_hang):
    """takes_images (the text-only defaults of run --batch, sweeps and the dashboard) reads
    config.json before any load: a FIFO or /dev/zero there is 'unknown' (True: the load then
    refuses it), at once."""
    from workbench.models.loading import takes_images

    assert no_hang(lambda: takes_images(broken_models("config_fifo")))  # never blocks
    assert no_hang(lambda: takes_images(broken_models("config_dev_zero")))


def test_extra_tensors_are_ignored_with_a_note(tiny_ckpt, tmp_path):
    d = tmp_path / "extra"
    shutil.copytree(tiny_ckpt("qwen2_moe"), d)
    _edit_weights(d, _put("model.mtp.0.weight", lambda sd: torch.zeros(3)))
    lm = workbench.load(d, device="cpu")
    assert any("'model.mtp.0.weight'" in n and "ignored" in n for n in lm.notes)
    res = workbench.Runtime(lm, max_new_tokens=2, device="cpu").run("hi", record=False)
    assert len(res.token_ids) == 2


def test_half_precision_weights_still_load(tiny_ckpt, tmp_path):
    d = tmp_path / "f16"
    shutil.copytree(tiny_ckpt("qwen2_moe"), d)
    _edit_weights(d, lambda sd: {k: v.half() for k, v in sd.items()})
    assert workbench.load(d, device="cpu").notes == []


def test_pickle_is_never_opened(tiny_ckpt, tmp_path, monkeypatch):
    """Beside safetensors, a pytorch_model.bin is never unpickled."""
    d = tmp_path / "both"
    shutil.copytree(tiny_ckpt("qwen2_moe"), d)
    (d / "pytorch_model.bin").write_bytes(b"not even a pickle")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load was called"))
    workbench.load(d, device="cpu")


def test_nan_logits_of_the_first_step_are_an_error(tiny_ckpt, tmp_path, capsys):
    """Finite weights whose logits overflow (float16): the first step says the weights are
    broken, as an error, not an answer."""
    d = tmp_path / "overflow"
    shutil.copytree(tiny_ckpt("qwen2_moe"), d)
    _edit_weights(d, _put("lm_head.weight", lambda sd: sd["lm_head.weight"].sign() * 60000.0))
    lm = workbench.load(d, device="cpu", dtype="float16")
    with pytest.raises(ModelLoadError) as e:
        workbench.Runtime(lm, dtype="float16", device="cpu", max_new_tokens=3).run(
            "hello", record=False)
    msg = one_line(e.value)
    assert str(d) in msg and "NaN/inf logits" in msg and "dtype float16" in msg
    from workbench.cli import main

    rc = main(["run", "--model", str(d), "--prompt", "hello", "--no-record",
               "--set", "dtype=float16", "--set", "device=cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "NaN/inf logits" in err and err.count("\n") == 1


def test_check_logits():
    check_logits(torch.zeros(2, 5), "m")
    for bad in (math.nan, math.inf, -math.inf):
        t = torch.zeros(2, 5)
        t[1, 3] = bad
        with pytest.raises(ModelLoadError, match="'m' produced NaN/inf logits"):
            check_logits(t, "m")


@pytest.mark.parametrize("name", ["missing_tensor", "int8_lm_head", "all_nan", "pickle_only",
                                  "config_list", "header_huge_tensor"])
def test_cli_exits_2_on_broken_models(broken_models, name, capsys):
    from workbench.cli import main

    rc = main(["info", "--model", str(broken_models(name))])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("workbench: error:") and err.count("\n") == 1, err


# ============================================================================================
# §16 sweeps
# ============================================================================================
@pytest.fixture
def no_cluster(monkeypatch):
    """Fail the test if a Dask cluster or client is started."""
    import dask.distributed  # imported first: it copies distributed's names
    import distributed

    def refuse(*a, **k):
        raise AssertionError("a Dask cluster/client was started")

    for mod in (distributed, dask.distributed):
        monkeypatch.setattr(mod, "LocalCluster", refuse)
        monkeypatch.setattr(mod, "Client", refuse)


def _sweep(tmp_path, **kw):
    from workbench.analysis.sweep import SweepInput, sweep

    # cache_slots 4: the embedded model's top-k (a point with fewer slots is refused up front)
    args = dict(grid={"cache_slots": [4]}, inputs=[SweepInput.parse("hi")],
                out=tmp_path / "s", workers=1, progress=False,
                knobs=Knobs(max_new_tokens=2, device="cpu"))
    args.update(kw)
    return sweep(args.pop("grid"), args.pop("inputs"), **args)


@pytest.mark.parametrize("setup, fragment", [
    (lambda t: (t / "f").write_text("x") and t / "f", "is a file, not a folder"),
    (lambda t: (t / "f").write_text("x") and t / "f" / "sub", "f' is a file, not a folder"),
    (lambda t: ((t / "d").mkdir(), (t / "d" / "notes.txt").write_text("keep"))
     and t / "d", "is not a sweep folder"),
    (lambda t: ((t / "d").mkdir(), (t / "d" / "points").write_text("x")) and t / "d",
     "'points' that is not a folder"),
    (lambda t: "", "must be a path"),
    (lambda t: str(t / "a\x00b"), "NUL"),
])
def test_sweep_out_must_be_a_usable_folder(tmp_path, no_cluster, setup, fragment):
    out = setup(tmp_path)
    with pytest.raises(InputError) as e:
        _sweep(tmp_path, out=out)
    assert fragment in one_line(e.value) and "--out" in str(e.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_sweep_out_in_a_read_only_folder(tmp_path, no_cluster):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(InputError, match="not writable"):
            _sweep(tmp_path, out=ro / "s")
    finally:
        ro.chmod(0o755)


def test_sweep_out_that_cannot_be_written(tmp_path, no_cluster, monkeypatch):
    """Whatever the permission bits say (root, read-only mounts), a failing mkdir is a
    message naming the folder."""
    def deny(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", deny)
    with pytest.raises(InputError, match=r"sweep folder \(--out\) .* permission denied"):
        _sweep(tmp_path)


@pytest.mark.parametrize("grid, fragment", [
    ({"lam": [math.inf]}, "lam must be a finite number"),
    ({"lam": [2.0, math.nan]}, "lam must be a finite number"),
    ({"cache_slots": [0, 4]}, "cache_slots must be at least 1"),
    ({"cache_slots": [True]}, "a boolean"),
    ({"cache_slots": [4, 4]}, "lists 4 twice"),
    ({"cache_slots": []}, "has no values"),
    ({"cache_slots": 4}, "must be a list"),
    ({"cache_slots": "4,8"}, "must be a list"),
    ({"slots": [4]}, "unknown knob 'slots'"),
    ({}, "non-empty mapping"),
    ([("cache_slots", [4])], "non-empty mapping"),
    ({"cache_slots": list(range(1, 200)), "seed": list(range(100))}, "at most 10,000"),
])
def test_sweep_grid_is_checked_before_any_cluster(tmp_path, no_cluster, grid, fragment):
    with pytest.raises(WorkbenchError) as e:
        _sweep(tmp_path, grid=grid)
    assert fragment in one_line(e.value)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("assign, fragment", [
    ("lam=inf,2", "lam must be a finite number"), ("cache_slots=4,4", "lists 4 twice"),
    ("cache_bytes=none,null", "lists None twice"), ("temperature=nan", "finite"),
    ("cache_slots=1e999", "must be an integer"), ("lookahead_depth=9999", "at most 256"),
])
def test_cli_grid_parsing(assign, fragment):
    from workbench.analysis.sweep import parse_grid

    with pytest.raises(KnobError) as e:
        parse_grid([assign])
    assert fragment in one_line(e.value)


def test_sweep_inputs_model_and_workers_are_checked_before_any_cluster(tmp_path, no_cluster,
                                                                       img_dir):
    from workbench.analysis.sweep import SweepInput

    bad = SweepInput.parse(f"{img_dir / 'bomb_20000.png'}|what?")
    with pytest.raises(InputError, match=r"input .*bomb_20000.*400,000,000 pixels"):
        _sweep(tmp_path, inputs=[bad])
    with pytest.raises(InputError, match=r"is a directory"):
        _sweep(tmp_path, inputs=[SweepInput.parse(f"{img_dir / 'a_directory.png'}|what?")])
    with pytest.raises(ModelLoadError, match="does not exist"):
        _sweep(tmp_path, model=tmp_path / "no-model")
    for w in (0, -1, True, 2.5, 10**6):
        with pytest.raises(InputError, match="--workers must be an integer between 1 and"):
            _sweep(tmp_path, workers=w)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("address, fragment", [
    ("", "is not an address"),
    ("   ", "is not an address"),
    ("not an address", "is not HOST:PORT"),
    ("tcp://host:notaport", "is not HOST:PORT"),
    ("tcp://[::1", "is not HOST:PORT"),
    ("tcp://", "is not HOST:PORT"),
    ("http://127.0.0.1:8786", "only tcp://HOST:PORT"),
    ("tls://127.0.0.1:8786", "only tcp://HOST:PORT"),
    ("inproc://x", "only tcp://HOST:PORT"),
    ("tcp://127.0.0.1:99999", "port 99999 is not between 1 and 65535"),
    ("tcp://127.0.0.1:0", "port 0 is not between 1 and 65535"),
    ("tcp://bad host:80", "is not a host name or IP address"),
    ("tcp://-x-:80", "is not a host name or IP address"),
])
def test_malformed_scheduler_addresses(address, fragment):
    from workbench.analysis.sweep import check_scheduler

    with pytest.raises(InputError) as e:
        check_scheduler(address)
    assert fragment in one_line(e.value) and repr(address) in str(e.value)


def _server(mode: str) -> tuple[int, socket.socket]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)

    def loop():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            if mode == "garbage":
                c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
            elif mode == "close":
                c.close()
            # silent: keep the connection open, say nothing

    threading.Thread(target=loop, daemon=True).start()
    return s.getsockname()[1], s


def test_unreachable_schedulers_fail_fast_with_the_address(no_cluster):
    from workbench.analysis.sweep import SCHEDULER_TIMEOUT_S, check_scheduler

    assert SCHEDULER_TIMEOUT_S <= 5
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    # "connection refused" said at once, not Dask's timeout after 30 s of retries
    with pytest.raises(InputError, match=rf"tcp://127.0.0.1:{port}.*connection refused"):
        check_scheduler(f"127.0.0.1:{port}")
    with pytest.raises(InputError, match="does not resolve|no answer"):  # DNS may be absent
        check_scheduler("tcp://no-such-host.invalid:8786", timeout=1.0)
    # each said in its own words ("within 1 s": the given timeout applied, not Dask's retries)
    for mode, fragment in (("silent", "no answer from .* within 1 s"),
                           ("garbage", "is not a Dask scheduler"),
                           ("close", "cannot reach|is not a Dask scheduler")):
        port, s = _server(mode)
        try:
            with pytest.raises(InputError, match=rf"tcp://127.0.0.1:{port}.*") as e:
                check_scheduler(f"tcp://127.0.0.1:{port}", timeout=1.0)
            assert __import__("re").search(fragment, one_line(e.value)), e.value
        finally:
            s.close()


def test_a_real_scheduler_answers():
    from distributed import LocalCluster

    from workbench.analysis.sweep import check_scheduler

    with LocalCluster(n_workers=0, processes=False, dashboard_address=None,
                      host="127.0.0.1", protocol="tcp") as cl:
        addr = cl.scheduler_address
        assert check_scheduler(addr) == addr
        assert check_scheduler(addr.removeprefix("tcp://")) == addr


def test_cli_sweep_errors_are_one_line(tiny_ckpt, tmp_path, capsys):
    from workbench.cli import main

    (tmp_path / "file").write_text("x")
    for extra in (["--out", str(tmp_path / "file")],
                  ["--out", str(tmp_path / "n"), "--scheduler", "tcp://127.0.0.1:1"],
                  ["--out", str(tmp_path / "n"), "--scheduler", "localhost"],
                  ["--out", str(tmp_path / "n"), "--grid", "lam=inf"]):
        rc = main(["sweep", "--model", str(tiny_ckpt()), "--grid", "cache_slots=2",
                   "--input", "hi", *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("workbench: error:") and err.count("\n") == 1, err


@pytest.mark.parametrize("content", [b"{garbage", b"[]", b'"complete"', b'{"status": 5}',
                                     b'{"status": "complete"}', b"\xff\xfe", b"", None])
def test_read_outcome_treats_corrupt_files_as_not_done(tmp_path, content):
    from workbench.analysis.sweep import read_outcome

    p = tmp_path / "p-x.json"
    if content is None:
        p.mkdir()
    else:
        p.write_bytes(content)
    assert read_outcome(p) is None


def test_corrupt_point_files_are_rerun_not_a_crash(tiny_ckpt, tmp_path, dask_scheduler):
    """A sweep whose earlier outcome files are garbage (or a folder) runs those points again
    and writes a correct summary."""
    from workbench.analysis.sweep import SweepInput, point_id, summarize, sweep

    out = tmp_path / "s"
    inputs = [SweepInput.parse("hello"), SweepInput.parse("again")]
    base = Knobs(max_new_tokens=2, device="cpu")
    grid = {"cache_slots": [2, 3]}
    (out / "points").mkdir(parents=True)
    ids = [point_id(base.copy(cache_slots=s).to_dict(), i) for s in (2, 3) for i in inputs]
    (out / "points" / f"{ids[0]}.json").write_text("{garbage")
    (out / "points" / f"{ids[1]}.json").write_text('["not", "an", "outcome"]')
    (out / "points" / f"{ids[2]}.json").mkdir()
    # summarising before the sweep: corrupt files are failed points, not a crash
    ds = summarize(out, grid, inputs, base)
    assert (ds.status.values == "failed").sum() == 3
    assert all("unreadable" in e for e in ds.error.values.ravel() if e)
    ds = sweep(grid, inputs, out=out, model=tiny_ckpt(), knobs=base, scheduler=dask_scheduler,
               progress=False)
    assert (ds.status == "complete").all(), ds.error.values
    for pid in ids:
        assert json.loads((out / "points" / f"{pid}.json").read_text())["status"] == "complete"


# ============================================================================================
# predictor folders (predictor=vismmoe, predictor_path=DIR): checked when the run starts
# ============================================================================================
@pytest.fixture(scope="module")
def predictor_dir(embedded, tmp_path_factory) -> Path:
    """A predictor folder for the embedded model (untrained weights: the files' format is what
    matters here, not the predictions)."""
    from workbench.predictor.model import LookaheadPredictor, PredictorConfig, save

    lay = embedded.layout
    torch.manual_seed(0)
    cfg = PredictorConfig(lay.num_layers, lay.num_experts, 64, model_id=embedded.model_id,
                          config_hash=embedded.config_hash)
    return save(LookaheadPredictor(cfg), tmp_path_factory.mktemp("pred") / "predictor")


def _pred_cfg(**changes):
    def edit(d: Path) -> None:
        doc = json.loads((d / "predictor.json").read_text())
        doc["config"].update(changes)
        (d / "predictor.json").write_text(json.dumps(doc))
    return edit


def _pred_json(text: str):
    return lambda d: (d / "predictor.json").write_text(text)


def _pred_weights(fn):
    def edit(d: Path) -> None:
        from safetensors.torch import load_file, save_file

        sd = load_file(str(d / "predictor.safetensors"))
        fn(sd)
        save_file(sd, str(d / "predictor.safetensors"))
    return edit


def _pred_bytes(fn):
    def edit(d: Path) -> None:
        f = d / "predictor.safetensors"
        f.write_bytes(fn(bytearray(f.read_bytes())))
    return edit


def _set_nan(sd):
    sd["W2.weight"][0, 0] = math.nan


BROKEN_PREDICTORS = {
    # name: (edit, fragments of the message)
    "truncated_1000": (_pred_bytes(lambda b: b[:1000]), ["predictor.safetensors",
                                                         "header claims"]),
    "header_2_62": (_pred_bytes(lambda b: struct.pack("<Q", 2**62) + b[8:]),
                    ["predictor.safetensors", "4,611,686,018,427,387,904 bytes"]),
    "empty_weights": (_pred_bytes(lambda b: b""), ["predictor.safetensors", "too short"]),
    "json_list": (_pred_json("[1, 2]"), ["predictor.json", "JSON array"]),
    "json_garbage": (_pred_json("{garbage"), ["predictor.json", "not valid JSON"]),
    "json_nan": (_pred_json('{"format": NaN}'), ["predictor.json", "not valid JSON"]),
    "json_deep": (_pred_json("[" * 100_000 + "]" * 100_000), ["predictor.json",
                                                               "not valid JSON"]),
    "wrong_format": (_pred_json('{"format": "x", "config": {}}'), ["format 'x'"]),
    "config_list": (_pred_json('{"format": "workbench-lookahead-predictor/1", "config": []}'),
                    ["'config' is []"]),
    "window_text": (_pred_cfg(window="five"), ["config.window is 'five'", "an integer"]),
    "window_zero": (_pred_cfg(window=0), ["config.window is 0", "an integer between 1"]),
    "width_3M": (_pred_cfg(width=3_000_000), ["config.width is 3000000", "between 1 and"]),
    "width_1e7": (_pred_cfg(width=10**7), ["config.width is 10000000"]),
    # {IN}: the fixture predictor's input width, read from its weights (it follows the model)
    "width_mismatch": (_pred_cfg(width=100_000), ["'W1.weight'", "[128, {IN}]",
                                                  "needs [100000, {IN}]"]),
    "hidden_mismatch": (_pred_cfg(hidden_size=65), ["'x_mean'", "[{IN}]", "needs [{IN2}]"]),
    "width_bool": (_pred_cfg(width=True), ["config.width is True"]),
    "decay_big": (_pred_cfg(decay=2.0), ["config.decay is 2.0", "0 < decay ≤ 1"]),
    "dropout_text": (_pred_cfg(dropout="0.1"), ["config.dropout is '0.1'"]),
    "use_visual_int": (_pred_cfg(use_visual=1), ["config.use_visual is 1", "true or false"]),
    "unknown_field": (_pred_cfg(foo=1), ["unknown config field 'foo'"]),
    "layers_missing": (lambda d: (_pred_json(json.dumps({
        "format": "workbench-lookahead-predictor/1", "config": {"num_experts": 32,
                                                                "hidden_size": 64}}))(d)),
        ["lacks config field 'num_layers'"]),
    "config_hash": (_pred_cfg(config_hash="deadbeef"), ["config_hash='deadbeef'",
                                                         "config_hash='"]),
    "num_experts": (_pred_cfg(num_experts=16), ["num_experts=16", "has {E}"]),
    "num_layers": (_pred_cfg(num_layers=4), ["num_layers=4", "has {L}"]),
    "nan_weight": (_pred_weights(_set_nan), ["'W2.weight'", "NaN or inf"]),
    "int8_weight": (_pred_weights(lambda sd: sd.__setitem__("Wo.weight",
                                                            sd["Wo.weight"].to(torch.int8))),
                    ["'Wo.weight'", "is I8", "F32"]),
    "missing_tensor": (_pred_weights(lambda sd: sd.pop("Wo.bias")), ["lacks tensor 'Wo.bias'"]),
    "extra_tensor": (_pred_weights(lambda sd: sd.__setitem__("evil", torch.zeros(2))),
                     ["unexpected tensor 'evil'"]),
    "zero_std": (_pred_weights(lambda sd: sd["x_std"].__setitem__(0, 0.0)), ["'x_std'", "≤ 0"]),
    "no_weights": (lambda d: (d / "predictor.safetensors").unlink(), ["holds no calibrated"]),
    "json_is_dir": (lambda d: ((d / "predictor.json").unlink(),
                               (d / "predictor.json").mkdir()), ["predictor.json is a directory"]),
}


@pytest.fixture(scope="module")
def broken_predictors(predictor_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("broken_predictors")
    for name, (edit, _) in BROKEN_PREDICTORS.items():
        shutil.copytree(predictor_dir, root / name)
        edit(root / name)
    return root


def test_the_predictor_fixture_is_accepted(embedded, predictor_dir):
    from workbench.runtime.runtime import Runtime

    rt = Runtime(embedded, knobs=Knobs(predictor="vismmoe", predictor_path=str(predictor_dir),
                                       cache_slots=8, max_new_tokens=1, device="cpu"))
    assert rt.run("hi", record=False).steps == 1


@pytest.mark.parametrize("name", list(BROKEN_PREDICTORS))
def test_broken_predictor_folders_are_refused_before_the_run(embedded, broken_predictors, predictor_dir,
                                                             name, monkeypatch):
    """Refused when the runtime is built (before generation, before the module is built from
    the config), with one line naming the folder and the fault."""
    from workbench.predictor import model as pmodel
    from workbench.runtime.runtime import Runtime

    built, init = [], pmodel.LookaheadPredictor.__init__

    def record(self, cfg):
        init(self, cfg)
        built.append((self.W1.weight.device.type, cfg.width))

    monkeypatch.setattr(pmodel.LookaheadPredictor, "__init__", record)
    d = broken_predictors / name
    with pytest.raises(InputError) as e:
        Runtime(embedded, knobs=Knobs(predictor="vismmoe", predictor_path=str(d),
                                      cache_slots=8, max_new_tokens=1, device="cpu"))
    text = one_line(e.value)
    assert str(d) in text
    from safetensors import safe_open

    with safe_open(str(predictor_dir / "predictor.safetensors"), "pt") as f:
        width_in = f.get_slice("W1.weight").get_shape()[1]
    lay = embedded.layout
    for fragment in BROKEN_PREDICTORS[name][1]:
        fragment = fragment.format(IN=width_in, IN2=width_in + 2, E=lay.num_experts, L=lay.num_layers)
        assert fragment in text, text
    # built in memory only from a checked config that matches the weights (else: on meta)
    assert all(w == 128 for dev, w in built if dev != "meta"), built


def test_cli_run_refuses_a_broken_predictor_with_one_line(broken_predictors, capsys):
    from workbench.cli import main

    rc = main(["run", "--set", "predictor=vismmoe", "--set",
               f"predictor_path={broken_predictors / 'window_text'}", "--prompt", "hi",
               "--no-record", "--max-new-tokens", "1"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.err.startswith("workbench: error: predictor in")
    assert cap.err.count("\n") == 1 and "answer" not in cap.out


# ============================================================================================
# sweeps apply workbench run's up-front checks to every point
# ============================================================================================
@pytest.mark.parametrize("grid, fragment", [
    ({"eviction": ["belady"]}, "eviction 'belady' needs the future"),
    ({"prefetch": ["oracle"]}, "needs the future"),
    ({"eviction": ["slab"]}, "needs the predictor"),
    ({"pinned_layers": [99]}, "pinned_layers must be between 0 and 12"),
    ({"cache_slots": [1, 2]}, "cache_slots must be at least 4 (top-k)"),
])
def test_sweep_points_get_the_run_checks_before_any_cluster(tmp_path, no_cluster, grid,
                                                            fragment):
    with pytest.raises(KnobError) as e:
        _sweep(tmp_path, grid=grid)
    text = one_line(e.value)
    assert fragment in text and "sweep point" in text
    name, values = next(iter(grid.items()))
    assert f"{name}={values[0]!r}" in text
    assert not (tmp_path / "s").exists()


def test_sweep_with_a_broken_predictor_is_refused(tmp_path, no_cluster, broken_predictors):
    with pytest.raises(InputError, match=r"sweep point .*predictor in .*nan_weight.*NaN"):
        _sweep(tmp_path, grid={"predictor_path": [str(broken_predictors / "nan_weight")]},
               knobs=Knobs(max_new_tokens=2, device="cpu", predictor="vismmoe"))


def test_sweep_records_refused_points_and_runs_the_others(tmp_path, monkeypatch):
    """A grid with some refused points: those are recorded as failed by the client (no worker
    time), the others are sent to the cluster."""
    from workbench.analysis import sweep as sweep_mod

    sent = []

    class FakeClient:
        def __init__(self, *a, **k):
            pass

        def submit(self, fn, *args, **kw):
            sent.append(args[1]["eviction"])
            raise RuntimeError("stop here")

        def close(self):
            pass

    import dask.distributed
    monkeypatch.setattr(dask.distributed, "Client", FakeClient)
    monkeypatch.setattr(dask.distributed, "LocalCluster", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="stop here"):
        _sweep(tmp_path, grid={"eviction": ["belady", "lru"]})
    assert sent == ["lru"]
    outcomes = [json.loads(p.read_text()) for p in (tmp_path / "s" / "points").glob("*.json")]
    assert [(o["grid"], o["status"]) for o in outcomes] == [({"eviction": "belady"}, "failed")]
    assert "KnobError: eviction 'belady' needs the future" in outcomes[0]["error"]
    assert sweep_mod.check_points(None, []) == {}


# ============================================================================================
# Python API argument types
# ============================================================================================
@pytest.mark.parametrize("images", ["/tmp/x.png", b"/tmp/x.png", Path("/tmp/x.png"),
                                    Image.new("RGB", (4, 4)), 5, None])
def test_run_refuses_a_single_image_or_a_non_list(embedded, images):
    rt = workbench.Runtime(embedded, device="cpu", max_new_tokens=1)
    with pytest.raises(InputError) as e:
        rt.run("hi", images=images, record=False)
    text = one_line(e.value)
    assert text.startswith("images must be a list of paths or PIL images, not "
                           f"{type(images).__name__}")


@pytest.mark.parametrize("kwargs, cls, fragment", [
    (dict(model=123), ModelLoadError, "model must be a checkpoint folder"),
    (dict(model=["a"]), ModelLoadError, "not list"),
    (dict(knobs=[("cache_slots", 2)]), KnobError, "knobs must be a workbench.Knobs or a dict"),
    (dict(knobs="cache_slots=4"), KnobError, "not str"),
    (dict(knobs={1: 2}), KnobError, "knob names (str)"),
    (dict(knobs={"slots": 4}), KnobError, "unknown knob 'slots'"),
    (dict(knobs={"cache_slots": "many"}), KnobError, "cache_slots"),
])
def test_runtime_refuses_wrong_argument_types(embedded, kwargs, cls, fragment):
    kwargs.setdefault("model", embedded)
    with pytest.raises(cls) as e:
        workbench.Runtime(**kwargs)
    assert fragment in one_line(e.value)


def test_runtime_accepts_a_dict_of_knobs(embedded):
    rt = workbench.Runtime(embedded, knobs={"cache_slots": 6, "device": "cpu"}, seed=3)
    assert (rt.knobs.cache_slots, rt.knobs.seed) == (6, 3)


@pytest.mark.parametrize("attrs", [None, "knob.seed", [("knob.seed", "1")], 5])
def test_from_attrs_refuses_non_mappings(attrs):
    with pytest.raises(KnobError) as e:
        Knobs.from_attrs(attrs)
    assert f"not {type(attrs).__name__}" in one_line(e.value)


def test_json_read_from_disk_has_a_depth_limit():
    """Every JSON document read from disk goes through ``jsonio.loads``: deep nesting is a
    ``ValueError`` naming the limit, never ``RecursionError`` (issue 26, class 2)."""
    from workbench import jsonio

    assert jsonio.loads("[" * 64 + "]" * 64) is not None  # at the limit: fine
    assert jsonio.loads(b"[" * 64 + b"]" * 64) is not None
    # brackets inside strings count towards the cheap bound only, never towards the depth
    assert jsonio.loads('["' + "[{" * 100 + '"]') == ["[{" * 100]
    for doc in ("[" * 65 + "]" * 65, '{"a":' * 100_000 + "1" + "}" * 100_000,
                "[" * 100_000 + "]" * 100_000, b"[" * 65 + b"]" * 65,
                bytearray(b'{"a":' * 65 + b"1" + b"}" * 65)):
        with pytest.raises(json.JSONDecodeError, match="nested deeper than 64"):
            jsonio.loads(doc)


def _store_with_attr(tiny_ckpt, tmp_path, key, value) -> Path:
    rt = workbench.Runtime(workbench.load(tiny_ckpt("qwen3_moe"), device="cpu"),
                           max_new_tokens=2)
    path = tmp_path / "s.zarr"
    rt.run("hello", store=path)
    meta = json.loads((path / "zarr.json").read_text())
    meta["attributes"][key] = value
    (path / "zarr.json").write_text(json.dumps(meta))
    return path


@pytest.mark.parametrize("key, value, fragment", [
    ("knob.cache_slots", "[" * 100_000 + "]" * 100_000, "nested deeper than 64"),
    ("cost_spec", {"source": "x", "expert_bytes": 1.7e308, "expert_flops_per_token": 1.0,
                   "dense_bytes_per_layer": 1.0, "dense_flops_per_token_per_layer": 1.0},
     "'expert_bytes' = 1.7e+308; expected a number from 0 to 1e+18"),
])
def test_store_attributes_that_crashed_replay_are_clear_errors(tiny_ckpt, tmp_path, capsys, key,
                                                               value, fragment):
    """A store whose attribute is nested 100 000 deep (RecursionError) or whose cost spec
    overflows the modeled clock (OverflowError) is refused: exit 2, one line naming it."""
    from workbench.cli import main

    path = _store_with_attr(tiny_ckpt, tmp_path, key, value)
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("workbench: error: ") and fragment in err[0], err


def test_wbtrace_cost_spec_that_overflows_is_refused(tmp_path, capsys):
    from workbench.cli import main

    spec = {"source": "x", "expert_bytes": 1.7e308, "expert_flops_per_token": 1.0,
            "dense_bytes_per_layer": 1.0, "dense_flops_per_token_per_layer": 1.0}
    p = tmp_path / "t.wbtrace"
    p.write_text("wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=1\n@attr\tcost_spec\t"
                 + json.dumps(spec) + "\n0\t0\tdecode\ttext\t1\t2\n1\t0\tdecode\ttext\t2\t3\n")
    assert main(["replay", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "'expert_bytes' = 1.7e+308" in err and "internal error" not in err


def test_a_wrong_image_token_id_names_the_config_not_the_prompt(embedded_dir, tmp_path):
    """A config whose image_token_id is wrong was reported as "the prompt contains the model's
    image placeholder None" (issue 26): the fault named is the config's."""
    d = tmp_path / "m"
    shutil.copytree(embedded_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    for bad in (7, 10**6):  # another token (the real one is 5), and no token at all
        cfg["image_token_id"] = bad
        (d / "config.json").write_text(json.dumps(cfg))
        try:
            lm = workbench.load(d, device="cpu")
        except ModelLoadError:
            continue  # refused at load: also a clear error
        from workbench.models.inputs import Request, build_inputs

        with pytest.raises(InputError) as e:
            build_inputs(lm, Request("what color is the triangle?",
                                     [str(embedded_dir.parent / "demo" / "scene_0.png")]), 4)
        msg = one_line(e.value)
        assert f"image_token_id {bad}" in msg and "the prompt contains" not in msg, msg


def _with_template(embedded_dir, tmp_path, per_content: str):
    """A copy of the embedded model whose chat template runs ``per_content`` (Jinja, with
    ``c`` a message's content part) on every part of every message, then the assistant turn."""
    d = tmp_path / "m"
    shutil.copytree(embedded_dir, d)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}{% for c in m.content %}" + per_content
        + "{% endfor %}{% endfor %}<|im_start|>assistant\n")
    return d


def test_a_template_that_loops_on_long_prompts_is_stopped_at_run(embedded_dir, tmp_path,
                                                                   monkeypatch, capsys):
    """A template that loops only for prompts over 20 characters passes the load-time check
    (its prompt is "hello") and hung ``run`` (issue 26): every prompt's rendering is bounded in
    time, and the CLI says so in one line, exit 2. A template's own error names the model."""
    d = _with_template(embedded_dir, tmp_path,
                       "{% if c.text is defined and c.text|length > 20 %}{% for i in "
                       "range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
                       "{% endif %}")
    monkeypatch.setenv("WORKBENCH_TEMPLATE_SECONDS", "1")
    lm = workbench.load(d, device="cpu")  # "hello" renders
    from workbench.models.inputs import Request, build_inputs

    build_inputs(lm, Request("short prompt", []), 2)
    with pytest.raises(InputError) as e:  # "longer than 1 s": the bound applied
        build_inputs(lm, Request("a prompt of more than twenty characters", []), 2)
    msg = one_line(e.value)
    assert "chat template of model" in msg and "longer than 1 s" in msg, msg
    from workbench.cli import main

    rc = main(["run", "--model", str(d), "--prompt", "a prompt of more than twenty characters",
               "--no-record", "--max-new-tokens", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "longer than 1 s" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1, err


def test_bounded_rendering_is_transformers_rendering(embedded):
    """The bounded renderer runs transformers' own ``apply_chat_template``: same text."""
    from workbench.models.chat_template import render_chat

    for content in ([{"type": "image"}, {"type": "text", "text": "what colour? ünï"}],
                    [{"type": "text", "text": "x" * 5000}]):
        msgs = [{"role": "user", "content": content}]
        assert render_chat(embedded.tokenizer, msgs) == embedded.tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=True)


def test_template_time_bound_setting_is_checked(monkeypatch):
    from workbench.models.chat_template import render_seconds

    monkeypatch.setenv("WORKBENCH_TEMPLATE_SECONDS", "-3")
    with pytest.raises(InputError, match="WORKBENCH_TEMPLATE_SECONDS='-3'"):
        render_seconds()


class _Renderer:
    """Stands in for a tokenizer's ``apply_chat_template`` (the process mechanics under test:
    a slow or a crashing renderer), not for its rendering."""

    def __init__(self, seconds: float = 0.0, fail: bool = False):
        self.seconds, self.fail = seconds, fail

    def apply_chat_template(self, messages, **kw):
        if self.fail:
            raise ValueError("boom\nsecond line")
        time.sleep(self.seconds)
        return "rendered " + messages[0]["content"]


def test_a_render_finishes_on_its_reply_while_another_process_holds_its_pipe(monkeypatch, no_hang):
    """A process forked by another thread between this render's pipe() and its close of the
    write end holds that end open: the render must finish on its complete reply, not wait for
    EOF until the time bound (review of issue 26). The other holder is simulated by keeping a
    duplicate of the write end open."""
    from workbench.models import chat_template as ct

    held: list[int] = []
    real_pipe = os.pipe

    def leaky_pipe():
        r, w = real_pipe()
        held.append(os.dup(w))
        return r, w

    monkeypatch.setattr(ct.os, "pipe", leaky_pipe)
    try:
        for i in range(3):  # a render waiting for EOF would wait out its hour-long bound
            assert no_hang(lambda: ct.render_chat(
                _Renderer(), [{"role": "user", "content": f"f{i}"}], seconds=3600),
                within_s=300) == f"rendered f{i}"
        with pytest.raises(ct.TemplateRenderError, match="longer than 1 s"):
            ct.render_chat(_Renderer(30.0), [{"role": "user", "content": "s"}], seconds=1)
        with pytest.raises(ct.TemplateRenderError, match="boom second line"):
            ct.render_chat(_Renderer(fail=True), [{"role": "user", "content": "x"}])
    finally:
        for fd in held:
            os.close(fd)


def test_rendering_under_a_hard_address_space_limit(tmp_path):
    """A process under a hard RLIMIT_AS (ulimit -v) still renders: the child's limit is
    clamped to the hard one, not raised past it (review of issue 26)."""
    import subprocess
    import sys

    code = (
        "import resource; from workbench.models.chat_template import render_chat\n"
        "class R:\n"
        "    def apply_chat_template(self, m, **k): return 'ok ' + m[0]['content']\n"
        "from workbench.models.chat_template import _vm_bytes\n"
        "cap = _vm_bytes() + (512 << 20)  # below the child's own + 1 GiB\n"
        "resource.setrlimit(resource.RLIMIT_AS, (cap, cap))\n"
        "print(render_chat(R(), [{'role': 'user', 'content': 'fine'}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok fine"


class _Mixed(_Renderer):
    """Renders by content: "slow…" sleeps past any bound, "fail…" raises, others render."""

    def apply_chat_template(self, messages, **kw):
        c = messages[0]["content"]
        if c.startswith("slow"):
            time.sleep(30)
        if c.startswith("fail"):
            raise ValueError("boom " + c)
        return "rendered " + c


def test_a_batch_renders_in_one_child_with_bounds_per_prompt(monkeypatch):
    """A batch's prompts are rendered by one forked child (a fork of a process holding a model
    was half a batch's wall time), yet each keeps its own bounds: a template error is that
    prompt's alone, and a prompt that runs past the time bound is reported as its own error
    while the prompts after it are rendered by a fresh child."""
    from workbench.models import chat_template as ct

    forks = []
    real_fork = os.fork

    def counting_fork():
        pid = real_fork()
        if pid:
            forks.append(pid)
        return pid

    monkeypatch.setattr(ct.os, "fork", counting_fork)
    msgs = [[{"role": "user", "content": c}] for c in ("a", "b", "fail c", "d")]
    out = ct.render_chats(_Mixed(), msgs, seconds=5)
    assert out[:2] == ["rendered a", "rendered b"] and out[3] == "rendered d"
    assert isinstance(out[2], ct.TemplateRenderError) and "boom fail c" in str(out[2])
    assert len(forks) == 1
    forks.clear()
    msgs = [[{"role": "user", "content": c}] for c in ("a", "slow b", "c", "slow d", "e")]
    out = ct.render_chats(_Mixed(), msgs, seconds=1)
    assert [o for o in out if isinstance(o, str)] == ["rendered a", "rendered c", "rendered e"]
    assert [i for i, o in enumerate(out) if isinstance(o, ct.TemplateRenderError)
            and "longer than 1 s" in str(o)] == [1, 3]
    assert len(forks) == 3  # the first child, then one after each prompt that ran away


def test_a_batch_names_the_request_its_template_refused(embedded_dir, tmp_path):
    """In a batch, the request whose prompt the template refuses is named by its index."""
    d = _with_template(embedded_dir, tmp_path,
                       "{% if c.text is defined and 'forbidden' in c.text %}"
                       "{{ raise_exception('no forbidden words') }}{% endif %}")
    lm = workbench.load(d, device="cpu")
    from workbench.models.inputs import Request, build_batch_inputs

    ok = build_batch_inputs(lm, [Request("fine", []), Request("also fine", [])], 2)
    assert ok.batch_size == 2
    with pytest.raises(InputError) as e:
        build_batch_inputs(lm, [Request("fine", []), Request("a forbidden word", []),
                                Request("fine again", [])], 2)
    msg = one_line(e.value)
    assert msg.startswith("request 1 of the batch: ") and "no forbidden words" in msg, msg


def test_a_batch_stops_at_its_first_refused_prompt(monkeypatch):
    """A template that hangs on every prompt costs one time bound for the batch, not one per
    request (review): with stop_at_error the rendering ends at the first error."""
    from workbench.models import chat_template as ct

    msgs = [[{"role": "user", "content": f"slow {i}"}] for i in range(6)]
    out = ct.render_chats(_Mixed(), msgs, seconds=0.5, stop_at_error=True)  # len(out): where
    assert len(out) == 1 and "longer than 0.5 s" in str(out[0])
    msgs = [[{"role": "user", "content": c}] for c in ("a", "fail b", "c")]
    out = ct.render_chats(_Mixed(), msgs, seconds=5, stop_at_error=True)
    assert out[0] == "rendered a" and len(out) == 2 and "boom fail b" in str(out[1])


def test_a_rendering_child_dies_with_its_parent(tmp_path):
    """The rendering child blocks every signal; if its parent is killed (SIGTERM: no finally
    runs) the child must not spin on in a runaway template (review): it dies with it."""
    import signal
    import subprocess
    import sys

    code = (
        "import time\n"
        "from workbench.models import chat_template as ct\n"
        "class R:\n"
        "    def apply_chat_template(self, m, **k):\n"
        "        while True: pass\n"
        "ct.render_chat(R(), [{'role': 'user', 'content': 'x'}], seconds=60)\n")
    p = subprocess.Popen([sys.executable, "-c", code])
    try:
        child = None
        for _ in range(200):  # the forked child appears as the parent's child process
            kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
            if kids.stdout.split():
                child = int(kids.stdout.split()[0])
                break
            time.sleep(0.05)
        assert child is not None, "no rendering child started"
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
        def alive(pid: int) -> bool:  # a zombie (dead, not yet reaped by init) is dead
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except (FileNotFoundError, ProcessLookupError, IndexError):
                return False

        for _ in range(100):
            if not alive(child):
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the rendering child outlived its parent")
    finally:
        if p.poll() is None:
            p.kill()


def test_a_prompt_rendered_before_is_not_rendered_again(embedded, monkeypatch):
    """A conversation the same template rendered before is taken from the memo (no child:
    a run of the same prompt with other knobs renders it once), the same text; another
    template, a template that may render differently next time (the clock, ``random``), a
    conversation that is not plain JSON (a tuple) and a rendering that failed are rendered
    anew; the memo charges each text its length plus a fixed cost, at most ``MEMO_CHARS``,
    least recently used going first."""
    from workbench.models import chat_template as ct

    children = []
    real = ct._in_child

    def counting(call, conversations, *a):
        children.append(len(conversations))
        return real(call, conversations, *a)

    monkeypatch.setattr(ct, "_in_child", counting)
    monkeypatch.setattr(ct, "_MEMO", ct._Memo())
    tok = embedded.tokenizer
    msgs = [[{"role": "user", "content": [{"type": "text", "text": t}]}] for t in "abc"]
    first = ct.render_chats(tok, msgs[:2])
    assert children == [2]
    again = ct.render_chats(tok, msgs)  # a and b kept, c rendered alone
    assert again[:2] == first and children == [2, 1]
    assert again == [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
                     for m in msgs]
    tupled = [{"role": "user", "content": ({"type": "text", "text": "a"},)}]
    for _ in range(2):
        ct.render_chats(tok, [tupled])
    assert children[-2:] == [1, 1]  # not plain JSON: rendered each time
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{{ '!' }}")
    assert ct.render_chats(tok, msgs[:1])[0] == first[0] + "!" and children[-1] == 1
    for unstable in ("{{ strftime_now('%H:%M:%S.%f') }}", "{{ range(1000) | random }}"):
        monkeypatch.setattr(tok, "chat_template", unstable)
        ct.render_chats(tok, msgs[:1])
        ct.render_chats(tok, msgs[:1])
        assert children[-2:] == [1, 1]  # rendered each time
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('no') }}")
    for _ in range(2):
        (err,) = ct.render_chats(tok, msgs[:1])
        assert isinstance(err, ct.TemplateRenderError)
    assert children[-2:] == [1, 1]  # a failure is not kept
    monkeypatch.undo()  # the model's own template again
    monkeypatch.setattr(ct, "_MEMO", ct._Memo())
    room = 2 * (len(first[0]) + ct.MEMO_ENTRY_CHARS)
    monkeypatch.setattr(ct, "MEMO_CHARS", room)  # room for two texts
    ct.render_chats(tok, msgs)
    assert list(ct._MEMO.texts.values()) == again[1:] and ct._MEMO.charged == room
