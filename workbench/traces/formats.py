"""Importers (and one writer) that turn routing records into a :class:`~workbench.traces.Trace`.

Formats (:data:`FORMATS`; :func:`load_trace` dispatches, ``auto`` picks by path):

- ``store``  a run store written by the runtime (zarr v3 folder): :func:`from_store`;
- ``jsonl``  one JSON object per (token, layer), as routing recorders hooked into vLLM write
             them: :func:`read_jsonl`;
- ``npy``    a ``[seq_len, layers, top_k]`` integer array of routed experts, as vLLM returns
             them: :func:`read_npy`;
- ``plain``  ``.wbtrace``, our own tab-separated text, lossless for everything in a Trace but
             ``pred_ids``: :func:`read_plain` / :func:`write_plain`.

Every importer sets ``attrs["source"]`` (the format) and ``attrs["path"]``; they never invent
routing: a (token, layer) the source lacks stays ``-1`` with NaN weights. Every problem with the
input raises :class:`~workbench.errors.InputError` naming the file, the line (text formats) or
index (arrays) at fault, the bad value and what is allowed. See ``docs/traces.md``.

Hostile input: sizes a file declares are checked against the file and a memory budget
(:mod:`workbench.traces.limits`) before anything is allocated; text is read one bounded line at
a time and ``.npy`` data in bounded chunks (no pickle, ever), so peak memory is the trace's own
arrays plus a few MiB.
"""

from __future__ import annotations

import json
import math
import operator
import os
import re
import stat
import struct
from array import array
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from workbench import jsonio
from workbench.errors import InputError, StoreExistsError
from workbench.fileio import open_regular, shorten
from workbench.telemetry.destination import follow_link
from workbench.traces import limits
from workbench.traces.limits import cut, show
from workbench.traces.trace import Trace

FORMATS = ("auto", "store", "jsonl", "npy", "plain")
SUFFIXES = {".jsonl": "jsonl", ".npy": "npy", ".wbtrace": "plain"}
PHASE_NAMES = ("prefill", "decode")
MODALITY_NAMES = ("text", "image", "video")
PLAIN_VERSION = 1
_OPTIONS = {"store": ("max_bytes",), "jsonl": ("num_experts", "problem", "max_bytes"),
            "npy": ("num_experts", "prefill_tokens", "max_bytes"), "plain": ("max_bytes",)}
_I16 = int(np.iinfo(np.int16).max)
_I32 = int(np.iinfo(np.int32).max)
_F32 = float(np.finfo(np.float32).max)
_BOM = b"\xef\xbb\xbf"
_READ_CHUNK = 1 << 22   # bytes of .npy data read at a time


# -- dispatch ------------------------------------------------------------------------------------
def load_trace(path: str | Path, format: str = "auto", **options: Any) -> Trace:
    """Load a trace from ``path`` in ``format`` (one of :data:`FORMATS`). ``auto``: a folder with
    ``zarr.json`` is a run store, otherwise the suffix decides (:data:`SUFFIXES`). ``options`` go
    to the reader (``num_experts``, ``problem`` for jsonl; ``num_experts``, ``prefill_tokens``
    for npy; ``max_bytes``, the memory budget, for all: :mod:`workbench.traces.limits`)."""
    if not isinstance(format, str) or format not in FORMATS:
        raise InputError(f"trace format {show(format)} is unknown; allowed: {', '.join(FORMATS)}")
    p = _path(path, "trace")
    st = _stat(p, "trace")
    if format == "auto":
        format = _detect(p, st)
    bad = sorted(set(options) - set(_OPTIONS[format]))
    if bad:
        allowed = ", ".join(_OPTIONS[format]) or "none"
        raise InputError(f"option {show(bad[0])} does not apply to trace format {format!r}; "
                         f"allowed options: {allowed} (trace {str(p)!r})")
    reader = {"store": from_store, "jsonl": read_jsonl, "npy": read_npy, "plain": read_plain}
    return reader[format](p, **options)


def _path(path: Any, what: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"{what} path must be a string or path, got {show(path)}")
    text = os.fspath(path)
    if isinstance(text, str) and text.strip() == "":  # Path("") would be the current folder
        raise InputError(f"{what} path is blank ({text!r}); give a file path")
    return Path(path)


def _stat(p: Path, what: str) -> os.stat_result:
    """``os.stat`` of ``p`` (following links), or :class:`InputError` saying why not."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        raise InputError(f"{what} {str(p)!r} does not exist") from None
    except (OSError, ValueError) as e:   # a link loop, no permission, a NUL in the name …
        why = getattr(e, "strerror", None) or str(e)
        raise InputError(f"{what} {str(p)!r} cannot be read ({why})") from None


def _detect(p: Path, st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        if (p / "zarr.json").exists():
            return "store"
        raise InputError(f"trace {str(p)!r} is a folder without zarr.json, so not a run store; "
                         f"give a run store or a file ending in {', '.join(SUFFIXES)}")
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise InputError(f"cannot tell the format of trace {str(p)!r} from its suffix "
                         f"{p.suffix or '(none)'!r}; known suffixes: {', '.join(SUFFIXES)}, or a "
                         f"run store folder; or name the format (--format on the command line, format= in "
                         f"Python): one of {', '.join(FORMATS[1:])}")
    return fmt


def _file(path: str | Path, what: str) -> tuple[Path, int]:
    """A regular file's path and size (a folder, device, pipe or socket is refused: reading a
    pipe could block for ever, a device never end)."""
    p = _path(path, what)
    st = _stat(p, what)
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} {str(p)!r} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {str(p)!r} is not a regular file (a device, pipe or socket)")
    return p, int(st.st_size)


def _open(p: Path, where: str):
    """``p`` opened for reading by :func:`workbench.fileio.open_regular`: a FIFO or device put
    there after the checks of :func:`_check_file` can neither block nor be read (the reads
    that follow are bounded by line and by record)."""
    return open_regular(p, where, empty_ok=True)


def _lines(f, where: str, max_line: int) -> Iterator[tuple[int, bytes]]:
    """``(line number, raw bytes)`` of a binary file, one line at a time, none longer than
    ``max_line`` bytes (a longer one is an error, never read whole); a UTF-8 byte-order mark
    before line 1 is dropped; line endings are kept."""
    n = 0
    while True:
        try:
            raw = f.readline(max_line + 1)
        except OSError as e:
            raise InputError(f"{where} cannot be read after line {n} ({e.strerror or e})") \
                from None
        if not raw:
            return
        n += 1
        if n == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        if len(raw) > max_line and not raw.endswith(b"\n"):
            raise InputError(f"{where}, line {n}: longer than {limits.fmt_bytes(max_line)}, the "
                             f"longest line this format allows (is it the right file?)")
        yield n, raw


def _text(raw: bytes, at: str) -> str:
    """The UTF-8 text of a line, without its line ending (``\\n`` or ``\\r\\n``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{at}: byte 0x{raw[e.start]:02x} at column {e.start + 1} is not UTF-8 "
                         f"text; the file must be UTF-8") from None
    if text.endswith("\n"):
        text = text[:-1]
    if text.endswith("\r"):
        text = text[:-1]
    return text


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        for k, _ in pairs:
            if k in seen:
                raise _DuplicateKey(k)
            seen.add(k)
    return d


def _json(text: str, at: str) -> Any:
    """``json.loads`` of one JSON-lines record with every failure an :class:`InputError`:
    invalid JSON, a repeated key, nesting too deep, an integer too long."""
    try:
        return jsonio.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey as e:
        raise InputError(f"{at}: the key {show(e.args[0])} appears twice in one object; keys "
                         f"must be unique") from None
    except jsonio.TooDeep:
        raise InputError(f"{at}: JSON nested deeper than {jsonio.MAX_DEPTH} levels") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{at}: not valid JSON ({e.msg}, column {e.colno})") from None
    except ValueError as e:      # e.g. an integer of more than 4300 digits
        raise InputError(f"{at}: not usable JSON ({cut(str(e), 100)})") from None


def _f32_ok(x: float) -> bool:
    """``x`` rounds to a finite float32 (or is not finite itself)."""
    try:
        struct.pack("<f", x)
    except OverflowError:
        return False
    return True


def _num_experts(num_experts: Any, where: str) -> int | None:
    if num_experts is None:
        return None
    try:
        n = operator.index(num_experts)
    except TypeError:
        n = 0
    if isinstance(num_experts, bool) or not 1 <= n <= _I16:
        raise InputError(f"num_experts for {where} must be an integer in 1..{_I16}, "
                         f"got {show(num_experts)}")
    return n


# -- run stores ----------------------------------------------------------------------------------
#: the run store's arrays a trace is made of (:func:`from_store` reads these and no others;
#: a Dataset may also hold ``step_request``, which no store writes): ``open_run(path,
#: variables=TRACE_ARRAYS)`` opens what a trace needs. ``from_store`` of a path opens the whole
#: store: a tampered count array refuses the store in replay too (issue 26)
TRACE_ARRAYS = ("topk_ids", "token_step", "topk_weights", "token_modality", "phase", "pinned",
                "kept", "pred_ids", "predicted_ids", "predicted_scores", "subexpert_ran")


def from_store(path_or_dataset: Any, max_bytes: Any = None) -> Trace:
    """The routing of a run store (a path, or a Dataset from :func:`workbench.open_run`).

    One request (``step_request`` all 0); phase, modality, weights and pinned layers as recorded
    (the store writes weight 0 where ``topk_ids`` is -1); ``kept`` when the store has it (token
    compression; else all True). ``pred_ids`` is taken when the dataset has it with dims
    (token, layer, depth, k) and it holds any id (all -1 = lookahead off → None); likewise
    ``predicted_ids``/``predicted_scores`` (step, layer, pred_order), the lookahead predictor's
    outputs (all -1 = predictor off → None; a Dataset of a schema ≤ 3 store not read with
    ``open_run`` may name that dim ``rank``). attrs:
    source, path, model_id, the run's ``knob.*`` attrs (JSON text) and its
    ``cost_spec``/``hardware_profile`` (so replay prices it as the live modeled clock did).
    A run with sub-experts (MoE-Prism) gives ``subexpert_ran``.
    The arrays the store declares must fit the memory budget (``max_bytes``, else
    ``WORKBENCH_TRACE_MAX_BYTES``, else 2 GiB) before they are read."""
    import xarray as xr

    from workbench.telemetry.schema import LEGACY_PRED_ORDER, PRED_ORDER
    from workbench.telemetry.store import open_run

    if isinstance(path_or_dataset, xr.Dataset):
        ds, path = path_or_dataset, path_or_dataset.encoding.get("source")
    else:
        path = _path(path_or_dataset, "run store")
        _stat(path, "run store")
        ds = open_run(path)
    where = f"run store {str(path)!r}" if path else "run dataset"
    order = (LEGACY_PRED_ORDER if "predicted_ids" in ds.variables
             and LEGACY_PRED_ORDER in ds["predicted_ids"].dims else PRED_ORDER)
    used = {"topk_ids": ("token", "layer", "k"), "token_step": ("token",),
            "topk_weights": ("token", "layer", "k"), "token_modality": ("token",),
            "phase": ("step",), "step_request": ("step",), "pinned": ("layer",),
            "kept": ("token",), "pred_ids": ("token", "layer", "depth", "k"),
            "predicted_ids": ("step", "layer", order),
            "predicted_scores": ("step", "layer", order)}
    if ds.sizes.get("subexpert", 1) > 1:  # MoE-Prism: the sub-experts each slot ran
        used["subexpert_ran"] = ("token", "layer", "k", "subexpert")
    # the Variables, not ``ds[n]``: a DataArray (with its coordinates) built per read costs
    # more than the small arrays of a short run
    variables = ds.variables
    declared = sum(int(variables[n].size) * variables[n].dtype.itemsize
                   for n in used if n in variables)
    limits.check(declared, limits.budget(max_bytes), where,
                 f"its routing arrays ({', '.join(f'{k} {v}' for k, v in ds.sizes.items())})")

    def var(name: str, dims: tuple[str, ...], required: bool = False) -> np.ndarray | None:
        if name not in variables:
            if required:
                raise InputError(f"{where} has no variable {name!r}; a trace needs topk_ids "
                                 f"(token, layer, k) and token_step (token)")
            return None
        v = variables[name]
        if set(v.dims) != set(dims) or len(v.dims) != len(dims):
            raise InputError(f"{where}: variable {name!r} has dims {v.dims}, expected {dims}")
        return np.asarray(v.transpose(*dims).values)

    ids = var("topk_ids", used["topk_ids"], required=True)
    token_step = var("token_step", used["token_step"], required=True)
    if "expert" in ds.sizes:
        num_experts = int(ds.sizes["expert"])
        if not 1 <= num_experts <= _I16:
            raise InputError(f"{where}: its expert dimension has size {num_experts}; allowed: "
                             f"1..{_I16}")
    elif ids.size and ids.dtype.kind in "iu" and ids.max() >= 0:
        num_experts = min(int(ids.max()) + 1, _I16)
    else:
        raise InputError(f"{where} has no 'expert' dimension and no routed expert to infer it from")
    pred = var("pred_ids", used["pred_ids"])
    if pred is not None and not (pred >= 0).any():
        pred = None  # lookahead was off: the store keeps a depth-1 array of -1
    p_ids = var("predicted_ids", used["predicted_ids"])
    p_scores = var("predicted_scores", used["predicted_scores"])
    if p_ids is None or p_scores is None or not (p_ids >= 0).any():
        p_ids = p_scores = None  # predictor off: the store keeps a pred_order-1 array of -1
    attrs: dict[str, Any] = {"source": "store"}
    if path:
        attrs["path"] = str(path)
    for k, v in ds.attrs.items():
        if k in ("model_id", "cost_spec", "hardware_profile") or k.startswith("knob."):
            attrs[k] = v
    arrays = {n: var(n, used[n]) for n in ("topk_weights", "token_modality", "phase",
                                             "step_request", "pinned", "kept")}
    if "subexpert_ran" in used:
        arrays["subexpert_ran"] = var("subexpert_ran", used["subexpert_ran"])
    try:
        return Trace(topk_ids=ids, token_step=token_step, num_experts=num_experts,
                     pred_ids=pred, attrs=attrs, predicted_ids=p_ids, predicted_scores=p_scores,
                     **arrays)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None


# -- JSON lines ----------------------------------------------------------------------------------
_MAX_POS = _I32 - 1   # token_idx / token_pos: steps and tokens are int32


def read_jsonl(path: str | Path, num_experts: int | None = None,
               problem: Any = None, max_bytes: Any = None) -> Trace:
    """Per-(token, layer) JSON lines: ``{"layer", "token_idx", "experts", "gating_probs"?,
    "problem_id"?, "dataset"?}``; any order of lines, extra keys ignored.

    Each (dataset, problem_id) is one request, in order of first appearance; its steps follow
    the previous request's. With ``token_idx`` every index is one decode step (phase 1) of one
    token, steps ``0 .. max token_idx`` of the request. With ``token_pos`` instead (raw emission
    order: a forward batch's rows, layer by layer) lines must be in emission order: a step ends
    where the (layer, token_pos) pair stops growing; its tokens are rows ``0 .. max token_pos``;
    the first step of each request is its prefill (phase 0), the rest decode.

    A (token, layer) without a record stays -1 / NaN; their count is ``attrs["missing_records"]``.
    ``num_experts`` defaults to the largest id + 1 (over the whole file); ``problem`` keeps one
    problem_id (or a list of them). Layers: 0 .. largest layer in the file.

    The file is streamed (one line of at most 8 MiB at a time) into compact arrays; the trace's
    size (tokens × layers × top-k) must fit the memory budget ``max_bytes``
    (:mod:`workbench.traces.limits`) before it is allocated.
    """
    p, size = _file(path, "routing file")
    where = f"routing file {str(p)!r}"
    E = _num_experts(num_experts, where)
    wanted = _problems(problem)
    limit = limits.budget(max_bytes, size)
    r = _JsonlRecords(where, E, wanted, limit)
    with _open(p, where) as f:
        for n, raw in _lines(f, where, limits.MAX_JSONL_LINE):
            if not raw.isspace():
                r.add(n, raw)
    if not r.n_all:
        raise InputError(f"{where} has no records")
    if wanted is not None:
        have = list(dict.fromkeys(pid for _, pid in r.all_requests))
        absent = [w for w in wanted if w not in have]
        if absent:
            listed = ", ".join(show(h) for h in have[:20]) + (", …" if len(have) > 20 else "")
            raise InputError(f"problem {show(absent[0])} is not in {where}; it has problems "
                             f"[{listed}]")
    return r.trace(p, num_experts=E)


def _problems(problem: Any) -> list | None:
    if problem is None:
        return None
    if isinstance(problem, np.integer):
        problem = int(problem)
    items = [problem] if isinstance(problem, (str, int)) else problem
    if isinstance(items, (list, tuple, set, frozenset, np.ndarray)):
        items = list(items.tolist() if isinstance(items, np.ndarray) else items)
        if items and all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool))
                         for x in items):
            return items
    raise InputError(f"problem must be a problem_id (integer or string) or a non-empty list of "
                     f"them, got {show(problem)}")


class _JsonlRecords:
    """Validated records of a JSON-lines file, kept in compact typed arrays (not Python
    objects), with what building the trace needs: top-k, layers, largest id, requests, and for
    ``token_pos`` files the steps as the emission order defines them."""

    def __init__(self, where: str, E: int | None, wanted: list | None, limit) -> None:
        self.where, self.E, self.wanted, self.limit = where, E, wanted, limit
        self.pos_key: str | None = None
        self.k: int | None = None
        self.n_all = 0                       # records in the file (all problems)
        self.max_layer = self.max_id = -1
        self.max_layer_line = self.max_id_line = 0
        self.all_requests: dict = {}         # every (dataset, problem_id) → None, in order
        self.requests: dict = {}             # the kept ones → request index
        self.req_bytes = 0
        self.line, self.pos = array("q"), array("q")
        self.layer, self.req = array("i"), array("i")
        self.ids, self.w = array("h"), array("f")
        # token_pos: the step of every record, and per step its tokens, phase and request
        self.rec_step = array("q")
        self.step_tokens, self.step_phase, self.step_req = array("q"), array("b"), array("i")
        self.prev: tuple | None = None

    def nbytes(self) -> int:
        k = self.k or 1
        return (len(self.line) * (40 + 6 * k) + len(self.step_tokens) * 13 + self.req_bytes)

    def add(self, n: int, raw: bytes) -> None:
        at = f"{self.where}, line {n}"
        obj = _json(_text(raw, at), at)
        if not isinstance(obj, dict):
            raise InputError(f"{at}: expected a JSON object, got {type(obj).__name__}")
        key = "token_idx" if "token_idx" in obj else "token_pos" if "token_pos" in obj else None
        if key is None:
            raise InputError(f"{at}: missing key 'token_idx' (or 'token_pos' for raw "
                             f"emission order)")
        if self.pos_key is None:
            self.pos_key = key
        elif key != self.pos_key:
            raise InputError(f"{at}: has {key!r} but earlier lines have {self.pos_key!r}; "
                             f"one file uses one of them")
        for req in ("layer", "experts"):
            if req not in obj:
                raise InputError(f"{at}: missing key {req!r}")
        pos = _int_field(obj, key, at, _MAX_POS)
        layer = _int_field(obj, "layer", at, _I16 - 1)
        ex = obj["experts"]
        if not isinstance(ex, list) or not ex:
            raise InputError(f"{at}: 'experts' must be a non-empty list of expert ids, "
                             f"got {show(ex)}")
        k = self.k
        if k is None:
            if len(ex) > _I16:
                raise InputError(f"{at}: {len(ex)} experts; top-k is at most {_I16}")
            k = self.k = len(ex)
        elif len(ex) != k:
            raise InputError(f"{at}: {len(ex)} experts {show(ex)}, but earlier lines have {k} "
                             f"(top-k must be the same on every line)")
        E = self.E
        hi = (E - 1) if E is not None else _I16 - 1
        for e in ex:
            if isinstance(e, bool) or not isinstance(e, int):
                raise InputError(f"{at}: expert id {show(e)} in 'experts' is not an integer")
            if not 0 <= e <= hi:
                raise InputError(f"{at}: expert id {show(e)} is outside 0..{hi}"
                                 + (f" (num_experts={E})" if E is not None else ""))
        if len(set(ex)) != k:
            raise InputError(f"{at}: expert ids {show(ex)} repeat; a token's experts are "
                             f"distinct")
        probs = obj.get("gating_probs")
        if probs is not None:
            if not isinstance(probs, list) or len(probs) != k or any(
                    isinstance(x, bool) or not isinstance(x, (int, float)) for x in probs):
                raise InputError(f"{at}: 'gating_probs' must be a list of {k} numbers (one per "
                                 f"expert), got {show(probs)}")
            for x in probs:
                try:
                    ok = math.isfinite(x) and _f32_ok(x)
                except OverflowError:   # an integer too large for a float
                    ok = False
                if not ok:
                    raise InputError(f"{at}: gating_probs value {show(x)} is not a finite "
                                     f"float32 number (|x| ≤ {_F32:.4g}); leave 'gating_probs' "
                                     f"out for a record without weights")
        rq = (obj.get("dataset"), obj.get("problem_id", 0))
        for part, val in zip(("dataset", "problem_id"), rq):
            if val is not None and (isinstance(val, bool) or not isinstance(val, (int, str))):
                raise InputError(f"{at}: {part!r} must be a string or integer, got {show(val)}")
        self.n_all += 1
        if layer > self.max_layer:
            self.max_layer, self.max_layer_line = layer, n
        top = max(ex)
        if top > self.max_id:
            self.max_id, self.max_id_line = top, n
        if rq not in self.all_requests:
            self.all_requests[rq] = None
            self.req_bytes += 200 + sum(len(str(v)) for v in rq)
        if not self.n_all & 0xFFFF:
            limits.check(self.nbytes(), self.limit, self.where,
                         f"its first {self.n_all} records (up to line {n})")
        if self.wanted is not None and rq[1] not in self.wanted:
            return
        ri = self.requests.get(rq)
        if ri is None:
            ri = self.requests[rq] = len(self.requests)
        self.line.append(n)
        self.pos.append(pos)
        self.layer.append(layer)
        self.req.append(ri)
        self.ids.extend(ex)
        self.w.extend([math.nan] * k if probs is None else probs)
        if self.pos_key == "token_pos":
            pair = (layer, pos)
            if self.prev is None or ri != self.prev[0] or pair <= self.prev[1]:
                self.step_tokens.append(0)
                self.step_phase.append(0 if self.prev is None or ri != self.prev[0] else 1)
                self.step_req.append(ri)
            if pos + 1 > self.step_tokens[-1]:
                self.step_tokens[-1] = pos + 1
            self.rec_step.append(len(self.step_tokens) - 1)
            self.prev = (ri, pair)

    def trace(self, p: Path, num_experts: int | None) -> Trace:
        where, k = self.where, self.k
        L = self.max_layer + 1
        E = num_experts if num_experts is not None else self.max_id + 1
        N = len(self.line)
        line = np.frombuffer(self.line, np.int64)
        pos = np.frombuffer(self.pos, np.int64)
        layer = np.frombuffer(self.layer, np.int32)
        req = np.frombuffer(self.req, np.int32)
        R = len(self.requests)
        if self.pos_key == "token_idx":
            n_steps = np.zeros(R, np.int64)
            np.maximum.at(n_steps, req, pos + 1)
            S = T = int(n_steps.sum())
            step_tokens = None
        else:
            step_tokens = np.frombuffer(self.step_tokens, np.int64)
            S, T = len(step_tokens), int(step_tokens.sum())
        top = int(np.argmax(pos))
        span = (f"{T} tokens (the largest {self.pos_key} is {int(pos[top])}, on line "
                f"{int(line[top])}) × {L} layers (the largest layer is {self.max_layer}, on line "
                f"{self.max_layer_line}) × top-{k}")
        if T > _I32 or S > _I32:
            raise InputError(f"{where}: {span}: more than {_I32} tokens, the most a trace holds")
        limits.check(limits.trace_bytes(T, L, k, S) + N * 24 + R * 64, self.limit, where, span)
        if self.pos_key == "token_idx":
            first = np.r_[0, np.cumsum(n_steps)].astype(np.int64)
            tok = first[req] + pos
            _no_second_record(where, tok * L + layer, line, pos, layer, req,
                              list(self.requests))
            token_step = np.arange(T, dtype=np.int32)
            phase = np.ones(S, np.int8)
            step_req = np.repeat(np.arange(R, dtype=np.int32), n_steps)
        else:
            first = np.r_[0, np.cumsum(step_tokens)].astype(np.int64)
            tok = first[np.frombuffer(self.rec_step, np.int64)] + pos
            token_step = np.repeat(np.arange(S, dtype=np.int32), step_tokens)
            phase = np.frombuffer(self.step_phase, np.int8).copy()
            step_req = np.frombuffer(self.step_req, np.int32).copy()
        ids = np.full((T, L, k), -1, np.int16)
        w = np.full((T, L, k), np.nan, np.float32)
        ids[tok, layer] = np.frombuffer(self.ids, np.int16).reshape(N, k)
        w[tok, layer] = np.frombuffer(self.w, np.float32).reshape(N, k)
        del tok
        attrs = {"source": "jsonl", "path": str(p), "position_key": self.pos_key,
                 "records": N, "missing_records": T * L - N,
                 "requests": [{"dataset": d, "problem_id": pid} for d, pid in self.requests]}
        return Trace(topk_ids=ids, token_step=token_step, num_experts=E, topk_weights=w,
                     phase=phase, step_request=step_req, attrs=attrs)


def _no_second_record(where: str, code: np.ndarray, line: np.ndarray, pos: np.ndarray,
                      layer: np.ndarray, req: np.ndarray, requests: list) -> None:
    """Each (token, layer) has one record: name the earliest line that repeats one."""
    order = np.argsort(code, kind="stable")
    c = code[order]
    dup = np.flatnonzero(c[1:] == c[:-1])
    if not dup.size:
        return
    second = order[dup + 1]
    i = int(np.argmin(line[second]))
    r2 = int(second[i])
    r1 = int(order[np.searchsorted(c, code[r2], "left")])
    pid = requests[int(req[r2])][1]
    raise InputError(f"{where}, line {int(line[r2])}: a second record for problem {show(pid)}, "
                     f"token_idx {int(pos[r2])}, layer {int(layer[r2])} (first on line "
                     f"{int(line[r1])}); each (token, layer) has one record")


def _int_field(obj: dict, key: str, at: str, hi: int) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        raise InputError(f"{at}: {key!r} must be an integer ≥ 0, got {show(v)} (allowed: "
                         f"0..{hi})")
    return v


# -- numpy ---------------------------------------------------------------------------------------
_NPY_MAGIC = b"\x93NUMPY"
_NPY_MAX_HEADER = 1 << 16


def read_npy(path: str | Path, num_experts: int | None = None, prefill_tokens: int = 0,
             max_bytes: Any = None) -> Trace:
    """A ``.npy`` integer array ``[seq_len, layers, top_k]`` of routed experts in rank order
    (vLLM's routed experts of one request; -1 = none). Every token is its own decode step,
    except that the first ``prefill_tokens`` tokens form one prefill step (phase 0). No weights
    (NaN). ``num_experts`` defaults to the largest id + 1.

    Never unpickles: the header is checked first (an integer dtype of any size and byte order,
    C or Fortran order, 3 dims, a data size that matches the file, a trace that fits the memory
    budget ``max_bytes``), then the data is read in 4 MiB chunks, each checked and narrowed to
    int16 in place — peak memory is the trace's ids plus one chunk."""
    p, size = _file(path, "routed-experts array")
    where = f"routed-experts array {str(p)!r}"
    E = _num_experts(num_experts, where)
    limit = limits.budget(max_bytes, size)
    with _open(p, where) as f:
        shape, fortran, dt, offset = _npy_header(f, where, size)
        if dt.hasobject:
            raise InputError(f"{where} has dtype {dt} (Python objects), which cannot be read "
                             f"without pickle; save a plain integer array with numpy.save")
        if dt.fields is not None or dt.subdtype is not None:
            raise InputError(f"{where} has the structured dtype {show(str(dt))}; expected a "
                             f"plain integer dtype")
        if dt.kind not in "iu":
            raise InputError(f"{where} has dtype {dt}; expected an integer dtype")
        if len(shape) != 3:
            raise InputError(f"{where} has shape {show(shape)}; expected 3 dims [seq_len, "
                             f"layers, top_k]")
        if any(isinstance(d, bool) or d < 1 for d in shape):
            raise InputError(f"{where} has shape {show(shape)}; every dim must be ≥ 1")
        T, L, K = shape
        data = T * L * K * dt.itemsize
        if data != size - offset:
            raise InputError(f"{where}: its header declares shape {show(shape)} of {dt}, "
                             f"{data} bytes of data, but the file holds {size - offset} bytes "
                             f"after the header; the file is truncated, padded or not what its "
                             f"header says")
        if T > _I32 or L > _I16 or K > _I16:
            raise InputError(f"{where} has shape {show(shape)}; allowed: seq_len ≤ {_I32}, "
                             f"layers ≤ {_I16}, top_k ≤ {_I16}")
        try:
            pre = operator.index(prefill_tokens)
        except TypeError:
            pre = -1
        if isinstance(prefill_tokens, bool) or not 0 <= pre <= T:
            raise InputError(f"prefill_tokens for {where} must be an integer in 0..{T} (the "
                             f"array's seq_len), got {show(prefill_tokens)}")
        need = limits.trace_bytes(T, L, K, weights=False) + (T * L * K * 2 if fortran else 0)
        limits.check(need, limit, where, f"its {T} tokens × {L} layers × top-{K}")
        hi = E - 1 if E is not None else _I16 - 1
        ids, top = _npy_data(f, where, shape, fortran, dt, hi)
    if E is None:
        if top < 0:
            raise InputError(f"{where} routes no token (all -1); pass num_experts")
        E = top + 1
    if pre:
        token_step = np.r_[np.zeros(pre, np.int32), np.arange(1, T - pre + 1, dtype=np.int32)]
        phase = np.r_[0, np.ones(T - pre, np.int8)].astype(np.int8)
    else:
        token_step, phase = np.arange(T, dtype=np.int32), np.ones(T, np.int8)
    return Trace(topk_ids=ids, token_step=token_step, num_experts=E,
                 phase=phase, attrs={"source": "npy", "path": str(p), "prefill_tokens": pre})


def _npy_header(f, where: str, size: int) -> tuple[tuple, bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) of a .npy file, checked against its size
    before numpy reads the header (numpy's own reader would first allocate whatever length the
    header claims)."""
    head = f.read(12)
    if not head:
        raise InputError(f"{where} is empty (0 bytes); expected an array written by numpy.save")
    if head.startswith(b"PK\x03\x04"):
        raise InputError(f"{where} is an .npz archive; expected one .npy array")
    if not head.startswith(_NPY_MAGIC):
        raise InputError(f"{where} is not a .npy file: it does not start with the .npy magic "
                         f"string b'\\x93NUMPY' (it starts with {show(head[:6])})")
    if len(head) < 10:
        raise InputError(f"{where} is truncated inside its .npy header ({size} bytes)")
    major, minor = head[6], head[7]
    if major not in (1, 2, 3) or minor != 0:
        raise InputError(f"{where} has .npy format version {major}.{minor}; this reader knows "
                         f"1.0, 2.0 and 3.0")
    if major == 1:
        hlen, start = struct.unpack("<H", head[8:10])[0], 10
    else:
        if len(head) < 12:
            raise InputError(f"{where} is truncated inside its .npy header ({size} bytes)")
        hlen, start = struct.unpack("<I", head[8:12])[0], 12
    if hlen > _NPY_MAX_HEADER or start + hlen > size:
        raise InputError(f"{where} has a .npy header that claims {hlen} bytes (the file has "
                         f"{size}; numpy writes headers of about 128 bytes); the file is "
                         f"truncated or not a .npy array")
    f.seek(6 + 2)
    read = (np.lib.format.read_array_header_1_0 if major == 1
            else np.lib.format.read_array_header_2_0)
    try:
        shape, fortran, dt = read(f, max_header_size=_NPY_MAX_HEADER)
    except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError,
            UnicodeDecodeError, struct.error) as e:
        raise InputError(f"{where} has a malformed .npy header ({cut(str(e), 160)})") from None
    return tuple(shape), bool(fortran), np.dtype(dt), f.tell()


def _npy_data(f, where: str, shape: tuple, fortran: bool, dt: np.dtype,
              hi: int) -> tuple[np.ndarray, int]:
    """The array as C-ordered int16 ids, read chunk by chunk (each chunk's ids checked to be in
    ``-1..hi``), and the largest id."""
    T, L, K = shape
    n_all = T * L * K
    flat = np.empty(n_all, np.int16)
    per = max(1, _READ_CHUNK // dt.itemsize)
    buf = bytearray(min(n_all, per) * dt.itemsize)
    top = -1
    for a in range(0, n_all, per):
        m = min(per, n_all - a)
        mv = memoryview(buf)[: m * dt.itemsize]
        got = 0
        while got < len(mv):
            try:
                r = f.readinto(mv[got:])
            except OSError as e:
                raise InputError(f"{where} cannot be read ({e.strerror or e})") from None
            if not r:
                raise InputError(f"{where} ended after {a * dt.itemsize + got} of "
                                 f"{n_all * dt.itemsize} bytes of data (did it change while "
                                 f"being read?)")
            got += r
        c = np.frombuffer(mv, dt)
        lo_c, hi_c = int(c.min()), int(c.max())
        if lo_c < -1 or hi_c > hi:
            j = int(np.flatnonzero((c > hi) | (c < -1) if lo_c < -1 else c > hi)[0])
            idx = np.unravel_index(a + j, shape, order="F" if fortran else "C")
            t, l, k = (int(x) for x in idx)
            raise InputError(f"{where}: expert id {int(c[j])} at index [{t}, {l}, {k}] "
                             f"(token, layer, rank) is outside -1..{hi} (-1 = none)")
        top = max(top, hi_c)
        flat[a:a + m] = c
    if fortran:
        return np.ascontiguousarray(flat.reshape((K, L, T)).transpose(2, 1, 0)), top
    return flat.reshape(T, L, K), top


# -- plain text (.wbtrace) -----------------------------------------------------------------------
def write_plain(trace: Trace, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``trace`` as ``.wbtrace`` text (format in ``docs/traces.md``). Lossless except
    ``pred_ids``, ``predicted_ids``/``predicted_scores``, ``kept`` and ``subexpert_ran`` (not
    stored) and the provenance
    attrs ``source``/``path`` (set by the reader). An existing file is kept unless
    ``overwrite``: :class:`StoreExistsError`. Written line by line to a temporary file that
    replaces ``path`` at the end."""
    p = _out_file(path, overwrite)
    T, L, K = trace.topk_ids.shape
    if L < 1 or K < 1:
        raise InputError(f"a .wbtrace needs ≥ 1 layer and top_k ≥ 1, the trace has {L} and {K}")
    out = [f"wbtrace\tversion={PLAIN_VERSION}\tlayers={L}\texperts={trace.num_experts}"
           f"\ttop_k={K}"]
    pinned = np.flatnonzero(trace.pinned)
    out.append("@pinned\t" + (",".join(map(str, pinned)) if len(pinned) else "-"))
    for key, val in trace.attrs.items():
        if key in ("source", "path"):
            continue
        if (not isinstance(key, str) or not key or any(c in key for c in "\t\r\n")
                or not _utf8(key)):
            raise InputError(f"trace attr name {show(key)} cannot be written: it must be a "
                             f"non-empty string without tabs or line breaks")
        try:
            text = json.dumps(val, default=_json_default, ensure_ascii=False)
            if not _utf8(text):   # lone surrogates: escaped, they round-trip
                text = json.dumps(val, default=_json_default)
        except (TypeError, ValueError, RecursionError) as e:
            raise InputError(f"trace attr {key!r} = {show(val)} is not JSON-serialisable "
                             f"({cut(str(e), 100)})") from None
        out.append(f"@attr\t{key}\t{text}")
    if trace.pred_ids is not None:
        out.append("# pred_ids are not stored in this format")
    if trace.predicted_ids is not None:
        out.append("# predicted_ids/predicted_scores are not stored in this format")
    out.append("# step\trequest\tphase\tmodality\t" + "\t".join(f"layer {i}" for i in range(L)))
    ids, w = trace.topk_ids, trace.topk_weights

    def write(f) -> None:
        f.write("\n".join(out) + "\n")
        for t in range(T):
            s = int(trace.token_step[t])
            cols = [str(s), str(int(trace.step_request[s])),
                    _code_name(trace.phase[s], PHASE_NAMES),
                    _code_name(trace.token_modality[t], MODALITY_NAMES)]
            cols += [_layer_field(ids[t, layer], w[t, layer]) for layer in range(L)]
            f.write("\t".join(cols) + "\n")

    return _replace(p, write)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_default(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, np.ndarray):
        return v.tolist()
    raise TypeError(f"{type(v).__name__} is not JSON-serialisable")


def _code_name(code: Any, names: tuple[str, ...]) -> str:
    c = int(code)
    return names[c] if 0 <= c < len(names) else str(c)


def _layer_field(ids: np.ndarray, w: np.ndarray) -> str:
    n = len(ids)
    while n and ids[n - 1] == -1 and np.isnan(w[n - 1]):
        n -= 1
    if not n:
        return "-"
    return ",".join(str(int(ids[j])) if np.isnan(w[j]) else f"{int(ids[j])}:{_fmt_weight(w[j])}"
                    for j in range(n))


def _fmt_weight(x: np.float32) -> str:
    s = str(np.float32(x))           # shortest text that identifies the float32 …
    if np.float32(float(s)) != x:    # … unless parsing through float64 rounds elsewhere
        s = repr(float(x))           # exact: every float32 is a float64
    return s




_HEADER_USAGE = ("the first line must be 'wbtrace' then tab-separated version=1, layers=L, "
                 "experts=E, top_k=K")
_FLUSH = 1 << 18    # (token, layer, rank) entries parsed before they are put into the arrays


def read_plain(path: str | Path, max_bytes: Any = None) -> Trace:
    """A ``.wbtrace`` file (see ``docs/traces.md``): header, ``@`` directives, one line per
    token. Lines starting with ``#`` and blank lines are ignored.

    Read in two streaming passes, one line (at most 16 MiB) at a time: the first counts the
    token lines, so the trace's arrays (tokens × layers × top_k, as the header declares) are
    checked against the memory budget ``max_bytes`` (:mod:`workbench.traces.limits`) and
    allocated once; the second parses into them."""
    p, size = _file(path, "trace file")
    where = f"trace file {str(p)!r}"
    limit = limits.budget(max_bytes, size)
    with _open(p, where) as f:
        lines = _lines(f, where, limits.MAX_PLAIN_LINE)
        first = next(lines, None)
        if first is None:
            raise InputError(f"{where}, line 1: the file is empty; {_HEADER_USAGE}")
        L, E, K = _plain_header(_text(first[1], f"{where}, line 1"), f"{where}, line 1")
        T = sum(1 for _, raw in lines if not _plain_skip(raw))
    limits.check(limits.trace_bytes(T, L, K) + min(_FLUSH, T * L * K) * 40, limit, where,
                 f"its {T} token lines × {L} layers × top_k {K} (as its header declares)")
    r = _PlainReader(where, T, L, E, K)
    with _open(p, where) as f:
        lines = _lines(f, where, limits.MAX_PLAIN_LINE)
        next(lines, None)
        for n, raw in lines:
            if raw.isspace() or raw[:1] == b"#":
                continue
            if raw[:1] == b"@":
                r.directive(_text(raw, f"{where}, line {n}"), n)
            else:
                r.token(raw, n)
    return r.trace(p)


def _plain_skip(raw: bytes) -> bool:
    """Not a token line: blank, a comment or a directive."""
    return raw.isspace() or raw[:1] in (b"#", b"@")


class _PlainReader:
    """Parses the lines after a .wbtrace header into arrays allocated once for ``T`` tokens."""

    def __init__(self, where: str, T: int, L: int, E: int, K: int) -> None:
        self.where, self.T, self.L, self.E, self.K = where, T, L, E, K
        self.ids = np.full((T, L, K), -1, np.int16)
        self.w = np.full((T, L, K), np.nan, np.float32)
        self.t = 0
        self.steps, self.modality = array("i"), array("b")
        self.step_req, self.phase, self.step_line = array("i"), array("b"), array("q")
        self.pinned = np.zeros(L, bool)
        self.attrs: dict[str, Any] = {}
        self.attr_line: dict[str, int] = {}
        self.attr_text = 0
        self.flat: list[int] = []
        self.vals: list[int] = []
        self.wflat: list[int] = []
        self.wvals: list[float] = []

    def at(self, n: int) -> str:
        return f"{self.where}, line {n}"

    def directive(self, line: str, n: int) -> None:
        at, L = self.at(n), self.L
        name, _, rest = line.partition("\t")
        if name == "@pinned":
            self.pinned[:] = False
            rest = rest.strip()
            if rest != "-":
                if rest.count(",") >= L:
                    raise InputError(f"{at}: @pinned lists more than {L} layers (the header "
                                     f"declares {L})")
                for x in rest.split(","):
                    self.pinned[_plain_int(x, "pinned layer", at, 0, L - 1)] = True
        elif name == "@attr":
            key, tab, text = rest.partition("\t")
            if not key or not tab:
                raise InputError(f"{at}: an attr line is '@attr<TAB>name<TAB>JSON value', "
                                 f"got {show(line)}")
            if key in self.attr_line:
                raise InputError(f"{at}: attr {show(key)} is given twice (first on line "
                                 f"{self.attr_line[key]}); each attr once")
            self.attr_text += len(text)
            if self.attr_text > limits.MAX_ATTR_TEXT:
                raise InputError(f"{at}: the @attr values add up to more than "
                                 f"{limits.fmt_bytes(limits.MAX_ATTR_TEXT)}, the most a "
                                 f".wbtrace may hold")
            try:
                val = jsonio.loads(text, object_pairs_hook=_no_duplicates)
            except jsonio.TooDeep:
                raise InputError(f"{at}: value of attr {show(key)} is JSON nested deeper than "
                                 f"{jsonio.MAX_DEPTH} levels") from None
            except json.JSONDecodeError as e:
                raise InputError(f"{at}: value of attr {show(key)} is not JSON ({e.msg}): "
                                 f"{show(text)}") from None
            except _DuplicateKey as e:
                raise InputError(f"{at}: value of attr {show(key)} has the key "
                                 f"{show(e.args[0])} twice; keys must be unique") from None
            except ValueError as e:
                raise InputError(f"{at}: value of attr {show(key)} is not usable JSON "
                                 f"({cut(str(e), 100)})") from None
            self.attrs[key] = val
            self.attr_line[key] = n
        else:
            raise InputError(f"{at}: unknown directive {show(name, 40)}; allowed: @pinned, "
                             f"@attr")

    def token(self, raw: bytes, n: int) -> None:
        at, L, K, E = self.at(n), self.L, self.K, self.E
        if not raw.isascii():
            col = next(i for i, b in enumerate(raw) if b > 127) + 1
            raise InputError(f"{at}: byte 0x{raw[col - 1]:02x} at column {col}; a token line is "
                             f"ASCII (numbers, names, tabs, commas, colons)")
        line = raw.decode("ascii").rstrip("\r\n")
        if "_" in line:
            raise InputError(f"{at}: '_' at column {line.index('_') + 1}; numbers are written "
                             f"without underscores")
        fields = line.count("\t") + 1
        if fields != 4 + L:
            raise InputError(f"{at}: {fields} tab-separated fields; a token line has "
                             f"{4 + L}: step, request, phase, modality and one per layer "
                             f"({L} layers)")
        if self.t >= self.T:
            raise InputError(f"{self.where} changed while it was being read (line {n} is a "
                             f"token line the first pass did not see)")
        cols = line.split("\t")
        s = _plain_int(cols[0], "step", at, 0, _I32 - 1)
        steps = self.steps
        prev = steps[-1] if steps else -1
        if s not in (prev, prev + 1) or (not steps and s != 0):
            raise InputError(f"{at}: step {s} after step {prev}; steps start at 0 and a token "
                             f"line repeats the step before or adds 1")
        req = _plain_int(cols[1], "request", at, -_I32 - 1, _I32)
        ph = _plain_code(cols[2], "phase", PHASE_NAMES, at)
        if s == prev:
            if (req, ph) != (self.step_req[-1], self.phase[-1]):
                raise InputError(f"{at}: request {req} / phase {ph} differ from the step's "
                                 f"first token (line {self.step_line[-1]}: request "
                                 f"{self.step_req[-1]}, phase {self.phase[-1]}); tokens of one "
                                 f"step share them")
        else:
            self.step_req.append(req)
            self.phase.append(ph)
            self.step_line.append(n)
        steps.append(s)
        self.modality.append(_plain_code(cols[3], "modality", MODALITY_NAMES, at))
        flat, vals, wflat, wvals = self.flat, self.vals, self.wflat, self.wvals
        base = self.t * L * K
        for layer in range(L):
            field = cols[4 + layer].strip()
            if field == "-":
                continue
            if field.count(",") >= K:
                raise InputError(f"{at}, layer {layer}: {field.count(',') + 1} experts "
                                 f"{show(field, 40)}; top_k is {K}")
            for j, part in enumerate(field.split(",")):
                e_text, colon, w_text = part.partition(":")
                try:
                    e = int(e_text)
                except ValueError:
                    raise InputError(f"{at}, layer {layer}: expert id {show(e_text.strip(), 40)}"
                                     f" is not an integer") from None
                if not -1 <= e < E:
                    raise InputError(f"{at}, layer {layer}: expert id {e} is outside "
                                     f"-1..{E - 1}")
                flat.append(base + layer * K + j)
                vals.append(e)
                if colon:
                    try:
                        x = float(w_text)
                    except ValueError:
                        raise InputError(f"{at}, layer {layer}: weight {show(w_text, 40)} of "
                                         f"expert {e_text} is not a number") from None
                    if not -_F32 <= x <= _F32 and x == x and (
                            "inf" not in w_text.lower() if math.isinf(x) else not _f32_ok(x)):
                        raise InputError(f"{at}, layer {layer}: weight {show(w_text, 40)} of "
                                         f"expert {e_text} is outside the float32 range "
                                         f"(|w| ≤ {_F32:.8g}, or inf, -inf, nan)")
                    wflat.append(base + layer * K + j)
                    wvals.append(x)
        self.t += 1
        if len(flat) >= _FLUSH:
            self.flush()

    def flush(self) -> None:
        if self.flat:
            self.ids.reshape(-1)[np.array(self.flat, np.int64)] = np.array(self.vals, np.int16)
            self.flat.clear()
            self.vals.clear()
        if self.wflat:
            self.w.reshape(-1)[np.array(self.wflat, np.int64)] = np.array(self.wvals, np.float64)
            self.wflat.clear()
            self.wvals.clear()

    def trace(self, p: Path) -> Trace:
        self.flush()
        if self.t != self.T:
            raise InputError(f"{self.where} changed while it was being read (the first pass "
                             f"counted {self.T} token lines, the second {self.t})")
        self.attrs.update(source="plain", path=str(p))
        return Trace(topk_ids=self.ids, token_step=np.frombuffer(self.steps, np.int32),
                     num_experts=self.E, topk_weights=self.w,
                     token_modality=np.frombuffer(self.modality, np.int8),
                     phase=np.frombuffer(self.phase, np.int8),
                     step_request=np.frombuffer(self.step_req, np.int32),
                     pinned=self.pinned, attrs=self.attrs)


def _plain_header(line: str, at: str) -> tuple[int, int, int]:
    cols = line.split("\t", 16)
    if cols[0] != "wbtrace":
        raise InputError(f"{at}: {show(cols[0], 40)} is not a .wbtrace header; {_HEADER_USAGE}")
    want = ("version", "layers", "experts", "top_k")
    vals: dict[str, int] = {}
    for c in cols[1:]:
        key, eq, val = c.partition("=")
        if not eq or key not in want or key in vals:
            raise InputError(f"{at}: header field {show(c, 40)} is unknown or repeated; "
                             f"{_HEADER_USAGE}")
        vals[key] = _plain_int(val, key, at, 1, _I16)
    if len(vals) != len(want):
        missing = [k for k in want if k not in vals]
        raise InputError(f"{at}: header lacks {', '.join(missing)}; {_HEADER_USAGE}")
    if vals["version"] != PLAIN_VERSION:
        raise InputError(f"{at}: .wbtrace version {vals['version']} is not supported; "
                         f"this reader knows version {PLAIN_VERSION}")
    return vals["layers"], vals["experts"], vals["top_k"]


_INT = re.compile(r"[+-]?[0-9]+")


def _plain_int(text: str, what: str, at: str, lo: int, hi: int) -> int:
    t = text.strip(" \t\r\n")
    if not _INT.fullmatch(t):
        raise InputError(f"{at}: {what} {show(t, 40)} is not an integer")
    v = int(t) if len(t) <= 40 else (hi + 1 if t[0] != "-" else lo - 1)
    if not lo <= v <= hi:
        raise InputError(f"{at}: {what} {show(t, 40) if len(t) > 40 else v} is outside "
                         f"{lo}..{hi}")
    return v


def _plain_code(text: str, what: str, names: tuple[str, ...], at: str) -> int:
    t = text.strip()
    if t in names:
        return names.index(t)
    if not _INT.fullmatch(t):
        raise InputError(f"{at}: {what} {show(t, 40)} is not one of {', '.join(names)} or an "
                         f"integer code")
    return _plain_int(t, f"{what} code", at, -128, 127)


# -- writers: JSON lines and .npy (the inverses of read_jsonl / read_npy) ------------------------
def _out_file(path: str | Path, overwrite: bool) -> Path:
    """The checked output path of a writer: not a folder, and an existing file only with
    ``overwrite`` (:class:`StoreExistsError`), so a writer never replaces what it was not told
    to."""
    p = _path(path, "trace file")
    follow_link(p, "trace file")  # a link that leads nowhere is named as such, not "exists"
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return p
    except (OSError, ValueError) as e:  # a name too long, a component not searchable, a NUL
        raise InputError(f"trace file {shorten(str(p))} cannot be used "
                         f"({getattr(e, 'strerror', None) or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"trace file {str(p)!r} is a folder; give a file path")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else
                "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise InputError(f"trace file {str(p)!r} is {kind}, not a regular file; it is never "
                         f"replaced (not even with --overwrite): give a file path")
    if not overwrite:
        raise StoreExistsError(f"trace file {str(p)!r} already exists; pass overwrite=True "
                               f"(--overwrite) to replace it, or choose another path")
    return p


def _replace(p: Path, write: Any, binary: bool = False) -> Path:
    """Run ``write(f)`` on a temporary file beside ``p``, then put it in place with one
    ``os.replace``: a reader never sees half a file and a failure leaves ``p`` as it was."""
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    try:
        with (open(tmp, "wb") if binary
              else open(tmp, "w", encoding="utf-8", newline="\n")) as f:
            write(f)
        os.replace(tmp, p)
    except OSError as e:
        raise InputError(f"trace file {str(p)!r} cannot be written ({e.strerror or e})") \
            from None
    finally:
        if tmp.exists():
            tmp.unlink()
    return p


def write_jsonl(trace: Trace, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``trace`` as per-(token, layer) JSON lines that :func:`read_jsonl` reads back.

    One line per (token, layer) with a routed expert: ``{"dataset"?, "problem_id", "layer",
    "token_idx" | "token_pos", "experts", "gating_probs"?}``; a request's ``dataset`` and
    ``problem_id`` are those ``attrs["requests"]`` names (a trace read from JSON lines), else
    ``problem_id`` is its index. A trace of one-token decode steps
    only is written with ``token_idx`` (each index one decode step); any other with
    ``token_pos`` in emission order (step by step, layer by layer, the step's tokens in order),
    which the reader splits into the same steps, the first of each request its prefill.

    Carried (read back equal): ``topk_ids``, ``token_step``, ``phase``, ``step_request``, and
    ``topk_weights`` where an id is routed (``gating_probs``, written as the shortest text that
    reads back to the same float32; a row without weights has none). Dropped: the weights of
    unrouted slots (-1 ids have no record: NaN when read), ``token_modality``, ``pinned``,
    ``kept``, lookahead/predictor ids, sub-experts and ``attrs``; ``num_experts`` is not
    written (pass ``num_experts=`` when reading: the reader's default is the largest id + 1).

    Refused with :class:`InputError` naming the step, token and layer (write ``.wbtrace``
    instead, which is lossless): a (token, layer) routed to fewer than top-k experts (a line
    holds exactly top-k), a row with some weights NaN and some not, and a trace whose steps,
    phases or request order the reader would see differently. Requests must follow each other
    in order 0, 1, …; an existing ``path`` is kept unless ``overwrite``
    (:class:`StoreExistsError`); written to a temporary file that replaces ``path`` at the end.
    """
    p = _out_file(path, overwrite)
    T, L, K = trace.topk_ids.shape
    if T < 1 or L < 1 or K < 1:
        raise InputError(f"a JSON-lines trace needs ≥ 1 token, layer and expert per token; the "
                         f"trace has {T} tokens, {L} layers, top-{K}")
    ts = trace.token_step.astype(np.int64)
    S = trace.num_steps
    starts = np.r_[0, np.flatnonzero(np.diff(ts)) + 1, T]
    per_step = np.diff(starts)
    req, phase = trace.step_request.astype(np.int64), trace.phase
    first_of_req = np.r_[True, req[1:] != req[:-1]]
    if req[0] != 0 or np.any(np.diff(req) < 0) or np.any(np.diff(req) > 1):
        raise InputError(f"the trace's steps belong to requests {show(req.tolist())}; JSON lines "
                         f"carry requests back to back in order 0, 1, … (write .wbtrace for "
                         f"any other order)")
    by_idx = bool((per_step == 1).all() and (phase == 1).all())
    if not by_idx and np.any(phase != np.where(first_of_req, 0, 1)):
        s = int(np.flatnonzero(phase != np.where(first_of_req, 0, 1))[0])
        raise InputError(f"step {s} is {_code_name(phase[s], PHASE_NAMES)}; JSON lines in "
                         f"emission order (token_pos) make the first step of each request its "
                         f"prefill and every other step a decode step (write .wbtrace for "
                         f"other phases)")
    ids, w = trace.topk_ids, trace.topk_weights
    routed = ids >= 0
    n_routed = routed.sum(-1)
    bad = np.argwhere((n_routed > 0) & (n_routed < K))
    if len(bad):
        t, layer = (int(x) for x in bad[0])
        raise InputError(f"token {t} (step {int(ts[t])}), layer {layer} is routed to "
                         f"{int(n_routed[t, layer])} of top-{K} experts "
                         f"{show(ids[t, layer].tolist())}; a JSON line holds exactly top-k "
                         f"experts (write .wbtrace instead)")
    nan = np.isnan(w)
    mixed = np.argwhere(routed.any(-1) & nan.any(-1) & ~nan.all(-1))
    if len(mixed):
        t, layer = (int(x) for x in mixed[0])
        raise InputError(f"token {t}, layer {layer} has weights {show(w[t, layer].tolist())}: "
                         f"some NaN, some not; gating_probs is all of a row's weights or none")
    key = "token_idx" if by_idx else "token_pos"
    has = routed.any(-1)          # [T, L]: the (token, layer) pairs that get a line
    # each step's index within its request: its token_idx when every step is one decode token
    in_req = np.arange(S) - np.maximum.accumulate(np.where(first_of_req, np.arange(S), 0))
    last_of_req = np.r_[first_of_req[1:], True]
    prev: tuple | None = None     # (request, (layer, pos)) of the last line, as the reader sees it
    for s in range(S):
        a, b = int(starts[s]), int(starts[s + 1])
        where = f"step {s} (tokens {a}..{b - 1})"
        if by_idx:   # the reader ends a request at its largest token_idx
            if last_of_req[s] and not has[a].any():
                raise InputError(f"{where}, the last of request {int(req[s])}, routes no token "
                                 f"at any layer, so JSON lines would end the request early "
                                 f"(write .wbtrace instead)")
            continue
        rows = np.argwhere(has[a:b].T)    # (layer, pos) in emission order
        if not len(rows):
            raise InputError(f"{where} routes no token at any layer; JSON lines cannot carry an "
                             f"empty step (write .wbtrace instead)")
        if int(rows[:, 1].max()) != b - a - 1:
            raise InputError(f"{where}: its last token is routed at no layer, so JSON lines "
                             f"would end the step early (write .wbtrace instead)")
        first = (int(req[s]), (int(rows[0, 0]), int(rows[0, 1])))
        if prev is not None and first[0] == prev[0] and first[1] > prev[1]:
            raise InputError(f"{where}: its first line (layer {first[1][0]}, token_pos "
                             f"{first[1][1]}) follows the previous step's last one, so the "
                             f"reader would merge the two steps (write .wbtrace instead)")
        prev = (first[0], (int(rows[-1, 0]), int(rows[-1, 1])))

    heads = _request_heads(trace.attrs.get("requests"), int(req[-1]) + 1)

    def write(f) -> None:
        for s in range(S):
            a, b = int(starts[s]), int(starts[s + 1])
            head = f'{heads[int(req[s])]}"layer": '
            for layer, pos in np.argwhere(has[a:b].T):
                t = a + int(pos)
                line = (f'{head}{int(layer)}, "{key}": '
                        f'{int(in_req[s]) if by_idx else int(pos)}, "experts": ['
                        + ", ".join(str(int(e)) for e in ids[t, layer]) + "]")
                if not nan[t, layer, 0]:
                    line += (', "gating_probs": ['
                             + ", ".join(_fmt_weight(x) for x in w[t, layer]) + "]")
                f.write(line + "}\n")

    return _replace(p, write)


def _request_heads(requests: Any, R: int) -> list[str]:
    """Each request's ``"dataset"``/``"problem_id"`` keys as a line starts with them: those of
    ``attrs["requests"]`` (what :func:`read_jsonl` recorded) when it names R distinct requests,
    else ``problem_id`` = the request's index."""
    ok = (isinstance(requests, list) and len(requests) == R
          and all(isinstance(r, dict) and set(r) <= {"dataset", "problem_id"} for r in requests))
    if ok:
        pairs = [(r.get("dataset"), r.get("problem_id", 0)) for r in requests]
        ok = len(set(map(repr, pairs))) == R and all(
            (v is None and k == "dataset") or isinstance(v, str)
            or (isinstance(v, int) and not isinstance(v, bool))
            for pair in pairs for k, v in zip(("dataset", "problem_id"), pair))
    if not ok:
        return [f'{{"problem_id": {r}, ' for r in range(R)]
    return ["{" + "".join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}, "
                          for k, v in zip(("dataset", "problem_id"), pair) if v is not None)
            for pair in pairs]


def write_npy(trace: Trace, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``trace``'s routed experts as the ``.npy`` array :func:`read_npy` reads:
    int16 ``[tokens, layers, top_k]`` (-1 = none), saved by ``numpy.save`` without pickle.

    Carried: ``topk_ids`` only. A trace whose first step is a prefill and every other step
    one decode token reads back with the same steps and phases given
    ``prefill_tokens=`` the first step's tokens (:func:`npy_prefill_tokens`); any other step
    structure, weights, modality, requests, pinned layers and attrs are dropped, and
    ``num_experts`` (pass ``num_experts=`` when reading; the default is the largest id + 1).
    An existing ``path`` is kept unless ``overwrite`` (:class:`StoreExistsError`); written to
    a temporary file that replaces ``path`` at the end."""
    p = _out_file(path, overwrite)
    T, L, K = trace.topk_ids.shape
    if T < 1 or L < 1 or K < 1:
        raise InputError(f"a .npy trace needs ≥ 1 token, layer and expert per token; the trace "
                         f"has {T} tokens, {L} layers, top-{K}")
    ids = np.ascontiguousarray(trace.topk_ids, np.int16)
    return _replace(p, lambda f: np.save(f, ids, allow_pickle=False), binary=True)


def npy_prefill_tokens(trace: Trace) -> int | None:
    """The ``prefill_tokens`` that makes :func:`read_npy` give ``trace``'s steps and phases
    back (0 for a trace of one-token decode steps), or None when no value does (several
    requests, several prefills, a decode step of several tokens)."""
    T = len(trace.token_step)
    per_step = np.bincount(trace.token_step, minlength=trace.num_steps)
    if len(np.unique(trace.step_request)) > 1 or (per_step[1:] != 1).any() \
            or (trace.phase[1:] != 1).any():
        return None
    if trace.phase[0] == 0:
        return int(per_step[0]) if T else 0
    return 0 if per_step[0] == 1 else None


#: the formats a trace is exported to, and the suffix each is recognised by
EXPORT_FORMATS = {"jsonl": ".jsonl", "npy": ".npy", "wbtrace": ".wbtrace"}


def export_trace(source: Any, path: str | Path, format: str | None = None,
                 overwrite: bool = False) -> dict[str, Any]:
    """Write the routing of ``source`` (a run store or any trace file :func:`load_trace`
    reads by its suffix, a Dataset from :func:`workbench.open_run`, or a :class:`Trace`) to
    ``path`` in ``format``: ``jsonl``
    (:func:`write_jsonl`), ``npy`` (:func:`write_npy`) or ``wbtrace`` (:func:`write_plain`;
    ``plain`` is the same). ``format=None`` takes it from ``path``'s suffix
    (:data:`EXPORT_FORMATS`); a format that disagrees with a known suffix is refused, so a
    file's name never lies about its content. An existing ``path`` is kept unless
    ``overwrite`` (:class:`StoreExistsError`); the file appears whole or not at all.

    Returns what was written: ``path``, ``format``, ``tokens``, ``layers``, ``top_k``,
    ``steps``, ``requests``, ``num_experts``, ``bytes``; ``dropped``, the fields this trace
    has that the format does not carry; and ``read_with``, the reader options that give its
    steps back (``num_experts``; ``prefill_tokens`` for npy)."""
    p = _path(path, "trace file")
    known = {v: k for k, v in EXPORT_FORMATS.items()}
    by_suffix = known.get(p.suffix.lower())
    if format is None:
        if by_suffix is None:
            raise InputError(f"cannot tell the format of trace file {str(p)!r} from its suffix "
                             f"{p.suffix or '(none)'!r}; name it with one of "
                             f"{', '.join(EXPORT_FORMATS.values())}, or give the format (one "
                             f"of {', '.join(EXPORT_FORMATS)})")
        format = by_suffix
    if format == "plain":
        format = "wbtrace"
    if not isinstance(format, str) or format not in EXPORT_FORMATS:
        raise InputError(f"trace export format {show(format)} is unknown; allowed: "
                         f"{', '.join(EXPORT_FORMATS)}")
    if by_suffix is not None and by_suffix != format:
        raise InputError(f"format {format!r} does not match trace file {str(p)!r}, whose "
                         f"suffix {p.suffix!r} means {by_suffix!r}; name the file "
                         f"{p.stem + EXPORT_FORMATS[format]!r} or give format {by_suffix!r}")
    _out_file(p, overwrite)   # before the store is read: an existing file costs nothing
    if isinstance(source, (str, os.PathLike)):
        src = _path(source, "trace")
        try:
            same = p.exists() and os.path.samefile(src, p)
        except (OSError, ValueError):
            same = False
        if same:
            raise InputError(f"trace file {str(p)!r} is the source {str(src)!r} itself; writing it "
                             f"would destroy what is being read: give another --out")
    import xarray as xr

    tr = (source if isinstance(source, Trace) else from_store(source)
          if isinstance(source, xr.Dataset) else load_trace(source))
    writer = {"jsonl": write_jsonl, "npy": write_npy, "wbtrace": write_plain}[format]
    writer(tr, p, overwrite=overwrite)
    T, L, K = tr.topk_ids.shape
    read_with: dict[str, Any] = {"num_experts": tr.num_experts}
    has = {"pred_ids": tr.pred_ids is not None, "predicted_ids": tr.predicted_ids is not None,
           "subexpert_ran": tr.subexpert_ran is not None, "kept": not bool(tr.kept.all())}
    if format in ("jsonl", "npy"):
        # attrs a reader sets again (provenance, its own counts) are not lost
        own = {"source", "path", "position_key", "records", "missing_records", "requests",
               "prefill_tokens"}
        has.update(token_modality=bool(tr.token_modality.any()), pinned=bool(tr.pinned.any()),
                   attrs=any(k not in own for k in tr.attrs))
    if format == "npy":
        pre = npy_prefill_tokens(tr)
        has.update(topk_weights=bool(np.isfinite(tr.topk_weights).any()),
                   step_request=len(np.unique(tr.step_request)) > 1,
                   token_step=pre is None)
        if pre is not None:
            read_with["prefill_tokens"] = pre
    dropped = [k for k, v in has.items() if v]
    return {"path": str(p), "format": format, "tokens": T, "layers": L, "top_k": K,
            "steps": tr.num_steps, "requests": int(len(np.unique(tr.step_request))),
            "num_experts": tr.num_experts, "bytes": p.stat().st_size, "dropped": dropped,
            "read_with": read_with}
