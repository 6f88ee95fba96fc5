"""Files that are not what they claim (issue 36 §3, §5): every file the workbench reads goes
through one bounded reader (:mod:`workbench.fileio`). A FIFO, ``/dev/zero``, a directory, a
sparse file of gigabytes, JSON nested 200 000 deep, a 5 MB value echoed in a message: each is
one clear error naming the file, never a hang, a gigabyte read, a ``RecursionError`` or a
megabyte error line. Cases that could hang run in a subprocess whose timeout only catches a
hang."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import workbench
from workbench.errors import InputError, ModelLoadError
from workbench.fileio import read_bytes_bounded, read_json, read_text, shorten

ROOT = Path(__file__).resolve().parents[1]
NESTED = "[" * 200_000 + "]" * 200_000


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of this worktree; the timeout only catches a hang."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def _fifo(p: Path) -> Path:
    if p.exists() or p.is_symlink():
        p.unlink()
    os.mkfifo(p)
    return p


def _zero(p: Path) -> Path:
    if p.exists() or p.is_symlink():
        p.unlink()
    p.symlink_to("/dev/zero")
    return p


def _sparse(p: Path, size: int) -> Path:
    if p.exists() or p.is_symlink():
        p.unlink()
    with open(p, "wb") as f:
        f.truncate(size)
    return p


# --------------------------------------------------------------------------------------------
# the reader itself
# --------------------------------------------------------------------------------------------
def test_the_reader_names_each_kind_of_file_that_is_not_one(tmp_path):
    cases = {
        "missing": (lambda p: None, "does not exist"),
        "dir": (lambda p: p.mkdir(), "is a directory"),
        "zero": (_zero, "is not a regular file"),
        "empty": (lambda p: p.write_bytes(b""), "is empty (0 bytes)"),
        "sparse": (lambda p: _sparse(p, 1_500_000_000), "is too large: 1,500,000,000 bytes"),
        "dangling": (lambda p: p.symlink_to(tmp_path / "nowhere"), "does not exist"),
    }
    for name, (make, fragment) in cases.items():
        p = tmp_path / name
        make(p)
        with pytest.raises(InputError) as e:
            read_bytes_bounded(p, 1 << 20, f"the {name} file")
        assert one_line(e.value).startswith(f"the {name} file ") and fragment in str(e.value)
    with pytest.raises(ModelLoadError, match="is not a regular file"):  # the caller's type
        read_bytes_bounded(tmp_path / "zero", 10, "x", ModelLoadError)


def test_the_read_is_bounded_even_when_the_size_lies():
    """/proc files say 0 bytes and hold more (as a file that grows after the stat): the read
    stops at the limit, and a file that claims 0 bytes is 'empty' unless empty is allowed."""
    with pytest.raises(InputError, match="grew past 100 bytes while read"):
        read_bytes_bounded("/proc/self/status", 100, "status", empty_ok=True)
    with pytest.raises(InputError, match=r"is empty \(0 bytes\)"):
        read_bytes_bounded("/proc/self/status", 100, "status")
    assert read_bytes_bounded("/proc/self/status", 1 << 20, "status", empty_ok=True)


def test_the_reader_parses_json_bounded_in_depth_and_standard(tmp_path):
    p = tmp_path / "a.json"
    for text, fragment in [(NESTED, "nested deeper than 64"), ('{"a": NaN}', "NaN is not"),
                           ("[1]", "must be a JSON object, not a JSON array"),
                           ("{no", "is not valid JSON")]:
        p.write_text(text)
        with pytest.raises(InputError, match=fragment):
            read_json(p, 1 << 20, "a.json")
    p.write_bytes(b"\xef\xbb\xbf" + b"\xff\xfe")
    with pytest.raises(InputError, match="is not UTF-8 text"):
        read_text(p, 100, "a.txt")
    p.write_text('{"a": [1, {"b": 2}]}')
    assert read_json(p, 100, "a.json") == {"a": [1, {"b": 2}]}


def test_the_reader_never_blocks_on_a_fifo(tmp_path):
    _fifo(tmp_path / "f")
    r = _python(f"""
        from workbench.fileio import read_bytes_bounded
        try:
            read_bytes_bounded({str(tmp_path / 'f')!r}, 100, 'the FIFO')
        except Exception as e:
            print(type(e).__name__, e)
    """, timeout=120)
    assert r.stdout.strip() == "InputError the FIFO is not a regular file (a FIFO, device or " \
                               "socket)", r.stderr


def test_shorten_cuts_huge_and_deep_values():
    assert shorten("x" * 5_000_000).endswith("…") and len(shorten("x" * 5_000_000)) <= 120
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert len(shorten(deep)) <= 120
    assert shorten("line\nbreak") == repr("line\nbreak")
    assert shorten(3) == "3"
    assert len(shorten([10**5000])) <= 120 and len(shorten(10**5000)) <= 120


# --------------------------------------------------------------------------------------------
# calibrations, refactorings, routers: a FIFO never blocks, nesting never escapes
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory, embedded):
    """A MACS calibration, a MoE-Prism refactoring and a router of the embedded model."""
    from workbench.prism import finetune as F
    from workbench.prism import refactor as R

    root = tmp_path_factory.mktemp("folders")
    shutil.copytree(Path(embedded.path) / "workbench" / "macs", root / "macs")
    ref = R.random_refactoring(embedded, subexperts=4, seed=1)
    R.save(ref, root / "prism")
    L, E = embedded.layout.num_layers, embedded.layout.num_experts
    H = int(embedded.layout.blocks[0].experts.gate_up_proj.shape[2])
    weight = np.zeros((L, E * 4, H), np.float32)
    F.save(F.Router(weight, {"format": F.FORMAT, "layers": L, "experts": E, "subexperts": 4,
                             "hidden": H,
                             "config_hash": embedded.config_hash, "model_id": "m",
                             "refactoring_hash": F.refactoring_hash(ref)}), root / "router")
    return root


#: (folder, file, loader expression on folder ``d``)
LOADERS = {
    "macs.json": ("macs", "macs.json", "calibration.load(d)"),
    "macs.safetensors": ("macs", "macs.safetensors", "calibration.load(d)"),
    "prism.json": ("prism", "prism.json", "R.load(d)"),
    "prism.safetensors": ("prism", "prism.safetensors", "R.load(d)"),
    "router.json": ("router", "router.json", "F.load(d)"),
    "router.safetensors": ("router", "router.safetensors", "F.load(d)"),
}
_IMPORTS = """
    import json, sys
    from pathlib import Path
    from workbench.macs import calibration
    from workbench.prism import finetune as F, refactor as R
    from workbench.errors import WorkbenchError
"""


def _copy(folders: Path, tmp_path: Path, name: str) -> Path:
    d = tmp_path / name
    shutil.copytree(folders / name, d)
    return d


def test_fifos_and_dev_zero_in_folders_are_refused_without_blocking(folders, tmp_path):
    """``macs_calibration=DIR`` with DIR/macs.safetensors a FIFO hung; every file of every
    folder, as a FIFO and as /dev/zero, in one child process."""
    jobs = []
    for key, (folder, file, expr) in LOADERS.items():
        for kind, make in (("fifo", _fifo), ("zero", _zero)):
            d = tmp_path / f"{key}-{kind}"
            shutil.copytree(folders / folder, d)
            make(d / file)
            jobs.append((str(d), file, expr))
    r = _python(_IMPORTS + f"""
    out = []
    for d, file, expr in {jobs!r}:
        d = Path(d)
        try:
            eval(expr)
            out.append([d.name, "loaded"])
        except WorkbenchError as e:
            out.append([d.name, str(e)])
    print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    for name, msg in json.loads(r.stdout):
        file = name.split("-")[0]
        assert file in msg and "is not a regular file" in msg, (name, msg)


@pytest.mark.parametrize("key", ["macs.json", "prism.json", "router.json"])
def test_nested_sparse_and_empty_headers_are_refused(folders, tmp_path, key):
    folder, file, expr = LOADERS[key]
    from workbench.macs import calibration  # noqa: F401
    from workbench.prism import finetune as F  # noqa: F401
    from workbench.prism import refactor as R  # noqa: F401

    d = _copy(folders, tmp_path, folder)
    for make, fragment in [(lambda p: p.write_text(NESTED), "nested deeper than 64"),
                           (lambda p: _sparse(p, 1_500_000_000), "is too large"),
                           (lambda p: p.write_text(""), "is empty"),
                           (lambda p: p.write_text('{"format": NaN}'), "NaN is not")]:
        make(d / file)
        with pytest.raises(InputError) as e:
            eval(expr)
        assert file in str(e.value) and fragment in str(e.value), str(e.value)


@pytest.mark.parametrize("key", ["macs.safetensors", "prism.safetensors",
                                 "router.safetensors"])
def test_weights_files_say_missing_empty_or_too_large(folders, tmp_path, key):
    folder, file, expr = LOADERS[key]
    from workbench.macs import calibration  # noqa: F401
    from workbench.prism import finetune as F  # noqa: F401
    from workbench.prism import refactor as R  # noqa: F401

    d = _copy(folders, tmp_path, folder)
    for make, fragment in [(lambda p: p.write_bytes(b""), "is empty"),
                           (lambda p: p.unlink(), "does not exist"),
                           (lambda p: _sparse(p, 1 << 40), "too large")]:
        make(d / file)
        with pytest.raises(InputError) as e:
            eval(expr)
        msg = one_line(e.value)
        # a calibration's weights have no size bound before their header is read: a sparse
        # file's header of zeros is refused as such
        assert file in msg and (fragment in msg or "not a safetensors file" in msg), msg
        assert "missing or larger" not in msg


def test_a_megabyte_value_is_echoed_shortened(folders, tmp_path, embedded):
    """A prism.json with a 5 MB model_id made a 5 MB error line."""
    from workbench.prism import finetune as F
    from workbench.prism import refactor as R

    for folder, mod in (("prism", R), ("router", F)):
        d = _copy(folders, tmp_path, folder)
        meta = json.loads((d / mod.CONFIG).read_text())
        meta.update(model_id="m" * 5_000_000, config_hash="c" * 1_000_000)
        (d / mod.CONFIG).write_text(json.dumps(meta))
        with pytest.raises(InputError) as e:
            mod.load(d, embedded)
        assert len(str(e.value)) < 1000 and "mmmm…" in str(e.value)
        meta.update(format="f" * 1_000_000)
        (d / mod.CONFIG).write_text(json.dumps(meta))
        with pytest.raises(InputError) as e:
            mod.load(d)
        assert len(str(e.value)) < 1000


def test_the_cli_refuses_hostile_folders_with_one_line(folders, tmp_path):
    """``macs_calibration=DIR`` / ``prism_router=DIR`` with a FIFO hung; a prism.json nested
    200 000 deep escaped as "internal error", exit 1. Now: exit 2, one line naming the file
    (the three runs in one child process)."""
    macs = _copy(folders, tmp_path, "macs")
    _fifo(macs / "macs.safetensors")
    prism = _copy(folders, tmp_path, "prism")
    (prism / "prism.json").write_text(NESTED)
    router = _copy(folders, tmp_path, "router")
    _fifo(router / "router.json")
    cases = {"macs.safetensors": (["dispatch=macs", f"macs_calibration={macs}"],
                                  "is not a regular file"),
             "prism.json": (["prism=true", f"prism_refactoring={prism}"],
                            "nested deeper than 64"),
             "router.json": (["prism=true", f"prism_refactoring={folders / 'prism'}",
                              f"prism_router={router}"], "is not a regular file")}
    argvs = {f: ["run", "--prompt", "x", "--no-record"] + [x for s in sets for x in ("--set", s)]
             for f, (sets, _) in cases.items()}
    r = _python(f"""
        import contextlib, io, json
        from workbench.cli import main
        out = {{}}
        for file, argv in {argvs!r}.items():
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                rc = main(argv)
            out[file] = [rc, err.getvalue()]
        print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    for file, (rc, err) in json.loads(r.stdout.splitlines()[-1]).items():
        assert rc == 2 and err.count("\n") == 1, (file, rc, err)
        assert err.startswith("workbench: error:") and file in err and cases[file][1] in err


# --------------------------------------------------------------------------------------------
# model folders: every file transformers opens is checked first
# --------------------------------------------------------------------------------------------
def _cfg(d: Path, section: str | None = None, **changes) -> None:
    cfg = json.loads((d / "config.json").read_text())
    (cfg[section] if section else cfg).update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _rm(*names):
    return lambda d: [(d / n).unlink() for n in names]


#: name → (breakage of a copy of the embedded model, fragments of the ModelLoadError)
BROKEN = {
    "tokenizer_config_fifo": (lambda d: _fifo(d / "tokenizer_config.json"),
                              ["tokenizer in", "tokenizer_config.json is not a regular file"]),
    "tokenizer_config_deleted": (_rm("tokenizer_config.json"),
                                 ["tokenizer in", "has no tokenizer_config.json"]),
    "tokenizer_json_zero": (lambda d: _zero(d / "tokenizer.json"),
                            ["tokenizer.json is not a regular file"]),
    "tokenizer_json_sparse": (lambda d: _sparse(d / "tokenizer.json", 1_200_000_000),
                              ["tokenizer.json is too large: 1,200,000,000 bytes"]),
    "tokenizer_json_nested": (lambda d: (d / "tokenizer.json").write_text(NESTED),
                              ["tokenizer.json is not valid JSON", "nested deeper than 64"]),
    "vocabulary_deleted": (_rm("tokenizer.json"), ["tokenizer in", "its vocabulary"]),
    "chat_template_fifo": (lambda d: _fifo(d / "chat_template.jinja"),
                           ["chat template in", "chat_template.jinja is not a regular file"]),
    "chat_template_zero": (lambda d: _zero(d / "chat_template.jinja"),
                           ["chat template in", "chat_template.jinja is not a regular file"]),
    "chat_template_sparse": (lambda d: _sparse(d / "chat_template.jinja", 1_200_000_000),
                             ["chat_template.jinja is too large"]),
    "chat_template_binary": (lambda d: (d / "chat_template.jinja").write_bytes(b"\xff\xfe{{"),
                             ["chat_template.jinja is not UTF-8"]),
    "extra_template_fifo": (lambda d: ((d / "additional_chat_templates").mkdir(),
                                       _fifo(d / "additional_chat_templates" / "tool.jinja")),
                            ["additional_chat_templates/tool.jinja is not a regular file"]),
    "sentencepiece_zero": (lambda d: _zero(d / "spm.model"),
                           ["tokenizer in", "spm.model is not a regular file"]),
    "chat_template_deleted": (_rm("chat_template.jinja"),
                              ["chat template in", "is missing", "vision_config"]),
    "processor_config_broken": (lambda d: (d / "processor_config.json").write_text("{nope"),
                                ["image processor in", "processor_config.json is not valid"]),
    "processor_config_fifo": (lambda d: _fifo(d / "processor_config.json"),
                              ["processor_config.json is not a regular file"]),
    "preprocessor_deleted": (_rm("preprocessor_config.json"),
                             ["image processor in", "needs preprocessor_config.json"]),
    "generation_config_nested": (lambda d: (d / "generation_config.json").write_text(NESTED),
                                 ["generation_config.json is not valid JSON"]),
    "index_fifo": (lambda d: (_fifo(d / "model.safetensors.index.json"),
                              (d / "model.safetensors").unlink()),
                   ["model.safetensors.index.json is not a regular file"]),
    "weights_fifo": (lambda d: _fifo(d / "model.safetensors"),
                     ["model.safetensors is not a regular file"]),
    # config values outside the model's shape: accepted before, and the answers changed
    "deepstack_beyond_depth": (lambda d: _cfg(d, "vision_config", deepstack_visual_indexes=[100]),
                               ["vision_config.deepstack_visual_indexes = [100]",
                                "0 … 3 (the model has 4 vision blocks)"]),
    "deepstack_negative": (lambda d: _cfg(d, "vision_config", deepstack_visual_indexes=[-1]),
                           ["deepstack_visual_indexes = [-1]"]),
    "deepstack_not_a_list": (lambda d: _cfg(d, "vision_config", deepstack_visual_indexes=3),
                             ["deepstack_visual_indexes = 3"]),
    "deepstack_too_many": (lambda d: _cfg(d, "text_config", num_hidden_layers=2),
                           ["deepstack_visual_indexes = [1, 2, 3]", "at most 2 indexes"]),
    "deepstack_repeated": (lambda d: _cfg(d, "vision_config", deepstack_visual_indexes=[1, 1, 1]),
                           ["deepstack_visual_indexes = [1, 1, 1]", "distinct"]),
    "mrope_section_short": (lambda d: _cfg(d, "text_config", rope_parameters={
        "mrope_interleaved": True, "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
        "rope_type": "default"}), ["text_config.rope_parameters.mrope_section = [2, 1, 1]",
                                   "head_dim / 2 = 8"]),
    "mlp_only_layers_beyond": (lambda d: _cfg(d, "text_config", mlp_only_layers=[12]),
                               ["text_config.mlp_only_layers = [12]", "12 layers"]),
    "sparse_step_zero": (lambda d: _cfg(d, "text_config", decoder_sparse_step=0),
                         ["text_config.decoder_sparse_step = 0", "1 … 12"]),
    "topk_zero": (lambda d: _cfg(d, "text_config", num_experts_per_tok=0),
                  ["num_experts_per_tok = 0", "of 64 experts"]),
    "image_token_beyond_vocab": (lambda d: _cfg(d, image_token_id=10**6),
                                 ["image_token_id = 1000000", "0 … 68"]),
}


@pytest.fixture(scope="module")
def broken_models(tmp_path_factory, embedded_dir):
    root = tmp_path_factory.mktemp("broken_files")

    def make(name: str) -> Path:
        d = root / name
        if not d.exists():
            shutil.copytree(embedded_dir, d, ignore=shutil.ignore_patterns("workbench"))
            BROKEN[name][0](d)
        return d

    return make


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_model_folder_files_are_checked_before_transformers_opens_them(broken_models, name):
    from workbench.models.loading import check_model_dir

    d = broken_models(name)
    with pytest.raises(ModelLoadError) as e:
        check_model_dir(d)  # what load() runs before anything is built
    msg = one_line(e.value)
    assert str(d) in msg
    for f in BROKEN[name][1]:
        assert f in msg, msg
    assert len(msg) < 600


def test_a_model_folder_with_a_fifo_is_refused_by_load_without_blocking(broken_models):
    names = ["tokenizer_config_fifo", "chat_template_fifo", "processor_config_fifo",
             "weights_fifo", "index_fifo"]
    dirs = [str(broken_models(n)) for n in names]
    r = _python(f"""
        import workbench
        from workbench.errors import ModelLoadError
        for d in {dirs!r}:
            try:
                workbench.load(d, device="cpu")
                print("loaded", d)
            except ModelLoadError as e:
                print("refused", d)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split().count("refused") == len(names), r.stdout



# --------------------------------------------------------------------------------------------
# the other readers: cost tables, operating points, sweep outcomes, store metadata, demo
# requests, predictor input lists, --input-file
# --------------------------------------------------------------------------------------------
def test_every_other_reader_refuses_a_fifo_and_a_sparse_giant(tmp_path):
    """Each reader on a FIFO (a hang before, for those that opened it unchecked) and on a
    sparse 1.5 GB file (read whole before): refused at once, or, where a file is optional
    (a sweep outcome, the demo requests), taken as absent."""
    for kind, make in (("fifo", _fifo), ("sparse", lambda p: _sparse(p, 1_500_000_000))):
        d = tmp_path / kind
        (d / "store").mkdir(parents=True)
        (d / "demo").mkdir()
        for f in ("costs.json", "points.json", "outcome.json", "store/zarr.json",
                  "demo/prompts.json", "inputs.json", "requests.txt"):
            make(d / f)
    r = _python(_IMPORTS + f"""
    from workbench.analysis.sweep import read_outcome
    from workbench.cli import _own_requests
    from workbench.errors import StoreError
    from workbench.models.embedded.demo import read_demo
    from workbench.predictor.calibrate import parse_inputs
    from workbench.prism.costs import CostTable
    from workbench.ui.datastore import _read_attrs
    from workbench.ui.prism import operating_points

    out = {{}}
    for kind in ("fifo", "sparse"):
        d = Path({str(tmp_path)!r}) / kind
        calls = {{
            "costs": lambda: CostTable.load(d / "costs.json"),
            "points": lambda: operating_points(d / "points.json"),
            "outcome": lambda: read_outcome(d / "outcome.json"),
            "store": lambda: _read_attrs(d / "store"),
            "demo": lambda: read_demo(d / "demo"),
            "inputs": lambda: parse_inputs([str(d / "inputs.json")], "x"),
            "requests": lambda: _own_requests([], str(d / "requests.txt")),
        }}
        for name, call in calls.items():
            try:
                out[f"{{kind}} {{name}}"] = ["returned", repr(call())]
            except WorkbenchError as e:
                out[f"{{kind}} {{name}}"] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    for key, (kind, msg) in out.items():
        if key.endswith(("outcome", "demo")):
            assert (kind, msg) in (("returned", "None"), ("returned", "[]")), (key, msg)
            continue
        fault = "is not a regular file" if key.startswith("fifo") else "is too large"
        assert fault in msg and len(msg) < 400, (key, kind, msg)


def _st_header(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw


@pytest.mark.parametrize("case", ["tensor_name", "shape", "offsets", "shard_name", "layers"])
def test_values_from_a_model_folder_are_echoed_shortened(tiny_ckpt, tmp_path, case):
    """A 5 MB tensor or shard name, a 100 000-long shape, 300-digit offsets or layer counts:
    each error line stays short."""
    d = tmp_path / case
    shutil.copytree(tiny_ckpt("qwen2_moe"), d)
    st = d / "model.safetensors"
    big = "n" * 5_000_000
    if case == "tensor_name":
        st.write_bytes(_st_header({big: {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}})
                       + b"\0" * 8)
    elif case == "shape":
        st.write_bytes(_st_header({"w": {"dtype": "F32", "shape": [2] * 100_000,
                                         "data_offsets": [0, 4]}}) + b"\0" * 4)
    elif case == "offsets":
        st.write_bytes(_st_header({"w": {"dtype": "F32", "shape": [10**300],
                                         "data_offsets": [0, 10**300]}}) + b"\0" * 4)
    elif case == "shard_name":
        st.rename(d / "model-1.safetensors")
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {"w": big + ".safetensors"}}))
    else:
        _cfg(d, num_hidden_layers=10**300)
    with pytest.raises(ModelLoadError) as e:
        workbench.load(d, device="cpu")
    msg = one_line(e.value)
    assert str(d) in msg and len(msg) < 800, msg[:2000]


@pytest.mark.parametrize("changes, fragment", [
    ({"n_group": 3, "topk_method": "group_limited_greedy"},
     "n_group = 3 is outside the model: a whole number ≥ 1 that divides the 8 experts"),
    ({"n_group": 0}, "n_group = 0"),
    ({"n_group": 2, "topk_group": 99, "topk_method": "group_limited_greedy"},
     "topk_group = 99 is outside the model: a whole number in 1 … n_group = 2"),
])
def test_group_limited_routing_fields_are_checked(tiny_ckpt, tmp_path, changes, fragment):
    """n_group that does not divide the experts, 0 groups, or topk_group above n_group: a run
    crashed (RuntimeError, ZeroDivisionError) after the load."""
    from workbench.models.loading import check_model_dir

    d = tmp_path / "ds"
    shutil.copytree(tiny_ckpt("deepseek_v2"), d)
    _cfg(d, **changes)
    with pytest.raises(ModelLoadError, match=fragment):
        check_model_dir(d)
