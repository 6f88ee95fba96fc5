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
"""

from __future__ import annotations

import json
import math
import operator
import os
from pathlib import Path
from typing import Any

import numpy as np

from workbench.errors import InputError, StoreExistsError
from workbench.traces.trace import Trace

FORMATS = ("auto", "store", "jsonl", "npy", "plain")
SUFFIXES = {".jsonl": "jsonl", ".npy": "npy", ".wbtrace": "plain"}
PHASE_NAMES = ("prefill", "decode")
MODALITY_NAMES = ("text", "image", "video")
PLAIN_VERSION = 1
_OPTIONS = {"store": (), "jsonl": ("num_experts", "problem"),
            "npy": ("num_experts", "prefill_tokens"), "plain": ()}
_I16 = np.iinfo(np.int16).max


# -- dispatch ------------------------------------------------------------------------------------
def load_trace(path: str | Path, format: str = "auto", **options: Any) -> Trace:
    """Load a trace from ``path`` in ``format`` (one of :data:`FORMATS`). ``auto``: a folder with
    ``zarr.json`` is a run store, otherwise the suffix decides (:data:`SUFFIXES`). ``options`` go
    to the reader (``num_experts``, ``problem`` for jsonl; ``num_experts``, ``prefill_tokens``
    for npy)."""
    if format not in FORMATS:
        raise InputError(f"trace format {format!r} is unknown; allowed: {', '.join(FORMATS)}")
    p = Path(path)
    if not p.exists():
        raise InputError(f"trace {str(p)!r} does not exist")
    if format == "auto":
        format = _detect(p)
    bad = sorted(set(options) - set(_OPTIONS[format]))
    if bad:
        allowed = ", ".join(_OPTIONS[format]) or "none"
        raise InputError(f"option {bad[0]!r} does not apply to trace format {format!r}; "
                         f"allowed options: {allowed}")
    reader = {"store": from_store, "jsonl": read_jsonl, "npy": read_npy, "plain": read_plain}
    return reader[format](p, **options)


def _detect(p: Path) -> str:
    if p.is_dir():
        if (p / "zarr.json").exists():
            return "store"
        raise InputError(f"trace {str(p)!r} is a folder without zarr.json, so not a run store; "
                         f"give a run store or a file ending in {', '.join(SUFFIXES)}")
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise InputError(f"cannot tell the format of trace {str(p)!r} from its suffix "
                         f"{p.suffix or '(none)'!r}; known suffixes: {', '.join(SUFFIXES)}, or a "
                         f"run store folder; or pass format= one of {', '.join(FORMATS[1:])}")
    return fmt


def _file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} {str(p)!r} does not exist or is not a file")
    return p


def _num_experts(num_experts: Any, where: str) -> int | None:
    if num_experts is None:
        return None
    try:
        n = operator.index(num_experts)
    except TypeError:
        n = 0
    if isinstance(num_experts, bool) or not 1 <= n <= _I16:
        raise InputError(f"num_experts for {where} must be an integer in 1..{_I16}, "
                         f"got {num_experts!r}")
    return n


# -- run stores ----------------------------------------------------------------------------------
def from_store(path_or_dataset: Any) -> Trace:
    """The routing of a run store (a path, or a Dataset from :func:`workbench.open_run`).

    One request (``step_request`` all 0); phase, modality, weights and pinned layers as recorded
    (the store writes weight 0 where ``topk_ids`` is -1); ``kept`` when the store has it (token
    compression; else all True). ``pred_ids`` is taken when the dataset has it with dims
    (token, layer, depth, k) and it holds any id (all -1 = lookahead off → None); likewise
    ``predicted_ids``/``predicted_scores`` (step, layer, rank), the lookahead predictor's
    outputs (all -1 = predictor off → None). attrs:
    source, path, model_id, the run's ``knob.*`` attrs (JSON text) and its
    ``cost_spec``/``hardware_profile`` (so replay prices it as the live modeled clock did)."""
    import xarray as xr

    from workbench.telemetry.store import open_run

    if isinstance(path_or_dataset, xr.Dataset):
        ds, path = path_or_dataset, path_or_dataset.encoding.get("source")
    else:
        path = Path(path_or_dataset)
        if not path.exists():
            raise InputError(f"run store {str(path)!r} does not exist")
        ds = open_run(path)
    where = f"run store {str(path)!r}" if path else "run dataset"

    def var(name: str, dims: tuple[str, ...], required: bool = False) -> np.ndarray | None:
        if name not in ds.variables:
            if required:
                raise InputError(f"{where} has no variable {name!r}; a trace needs topk_ids "
                                 f"(token, layer, k) and token_step (token)")
            return None
        v = ds[name]
        if set(v.dims) != set(dims):
            raise InputError(f"{where}: variable {name!r} has dims {v.dims}, expected {dims}")
        return np.asarray(v.transpose(*dims).values)

    ids = var("topk_ids", ("token", "layer", "k"), required=True)
    token_step = var("token_step", ("token",), required=True)
    if "expert" in ds.sizes:
        num_experts = int(ds.sizes["expert"])
    elif ids.size and ids.max() >= 0:
        num_experts = int(ids.max()) + 1
    else:
        raise InputError(f"{where} has no 'expert' dimension and no routed expert to infer it from")
    pred = var("pred_ids", ("token", "layer", "depth", "k"))
    if pred is not None and not (pred >= 0).any():
        pred = None  # lookahead was off: the store keeps a depth-1 array of -1
    p_ids = var("predicted_ids", ("step", "layer", "rank"))
    p_scores = var("predicted_scores", ("step", "layer", "rank"))
    if p_ids is None or p_scores is None or not (p_ids >= 0).any():
        p_ids = p_scores = None  # predictor off: the store keeps a rank-1 array of -1
    attrs: dict[str, Any] = {"source": "store"}
    if path:
        attrs["path"] = str(path)
    for k, v in ds.attrs.items():
        if k in ("model_id", "cost_spec", "hardware_profile") or k.startswith("knob."):
            attrs[k] = v
    return Trace(topk_ids=ids, token_step=token_step, num_experts=num_experts,
                 topk_weights=var("topk_weights", ("token", "layer", "k")),
                 token_modality=var("token_modality", ("token",)),
                 phase=var("phase", ("step",)), step_request=var("step_request", ("step",)),
                 pinned=var("pinned", ("layer",)),
                 pred_ids=pred, attrs=attrs, kept=var("kept", ("token",)),
                 predicted_ids=p_ids, predicted_scores=p_scores)


# -- JSON lines ----------------------------------------------------------------------------------
def read_jsonl(path: str | Path, num_experts: int | None = None,
               problem: Any = None) -> Trace:
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
    """
    p = _file(path, "routing file")
    E = _num_experts(num_experts, f"routing file {str(p)!r}")
    recs, pos_key, k = _parse_jsonl(p, E)
    if not recs:
        raise InputError(f"routing file {str(p)!r} has no records")
    L = 1 + max(r[3] for r in recs)
    max_id = max(max(r[4]) for r in recs)
    if E is None:
        E = max_id + 1
    requests: list[tuple[Any, Any]] = []
    for r in recs:
        if r[1] not in requests:
            requests.append(r[1])
    if problem is not None:
        wanted = [problem] if isinstance(problem, (int, str)) else list(problem)
        have = [pid for _, pid in requests]
        absent = [w for w in wanted if w not in have]
        if absent:
            raise InputError(f"problem {absent[0]!r} is not in routing file {str(p)!r}; "
                             f"it has problems {have}")
        requests = [rq for rq in requests if rq[1] in wanted]
        recs = [r for r in recs if r[1] in requests]
    req_index = {rq: i for i, rq in enumerate(requests)}
    if pos_key == "token_idx":
        slots, step_tokens, phases, step_req = _by_token_idx(p, recs, req_index)
    else:
        slots, step_tokens, phases, step_req = _by_emission(recs, req_index)
    T = int(sum(step_tokens))
    ids = np.full((T, L, k), -1, np.int16)
    w = np.full((T, L, k), np.nan, np.float32)
    for (tok, layer), r in zip(slots, recs):
        ids[tok, layer] = r[4]
        w[tok, layer] = r[5]
    token_step = np.repeat(np.arange(len(step_tokens), dtype=np.int32), step_tokens)
    attrs = {"source": "jsonl", "path": str(p), "position_key": pos_key,
             "records": len(recs), "missing_records": T * L - len(recs),
             "requests": [{"dataset": d, "problem_id": pid} for d, pid in requests]}
    return Trace(topk_ids=ids, token_step=token_step, num_experts=E, topk_weights=w,
                 phase=np.asarray(phases, np.int8), step_request=np.asarray(step_req, np.int32),
                 attrs=attrs)


def _parse_jsonl(p: Path, E: int | None):
    """Validated records ``(line, (dataset, problem_id), pos, layer, ids, weights)``."""
    recs: list[tuple] = []
    pos_key: str | None = None
    k: int | None = None
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            at = f"routing file {str(p)!r}, line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{at}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(obj, dict):
                raise InputError(f"{at}: expected a JSON object, got {type(obj).__name__}")
            key = "token_idx" if "token_idx" in obj else "token_pos" if "token_pos" in obj else None
            if key is None:
                raise InputError(f"{at}: missing key 'token_idx' (or 'token_pos' for raw "
                                 f"emission order)")
            if pos_key is None:
                pos_key = key
            elif key != pos_key:
                raise InputError(f"{at}: has {key!r} but earlier lines have {pos_key!r}; "
                                 f"one file uses one of them")
            for req in ("layer", "experts"):
                if req not in obj:
                    raise InputError(f"{at}: missing key {req!r}")
            pos, layer = _int_field(obj, key, at), _int_field(obj, "layer", at)
            ex = obj["experts"]
            if not isinstance(ex, list) or not ex:
                raise InputError(f"{at}: 'experts' must be a non-empty list of expert ids, "
                                 f"got {ex!r}")
            if k is None:
                k = len(ex)
            elif len(ex) != k:
                raise InputError(f"{at}: {len(ex)} experts {ex}, but earlier lines have {k} "
                                 f"(top-k must be the same on every line)")
            for e in ex:
                if isinstance(e, bool) or not isinstance(e, int):
                    raise InputError(f"{at}: expert id {e!r} in 'experts' is not an integer")
                hi = (E - 1) if E is not None else _I16 - 1
                if not 0 <= e <= hi:
                    raise InputError(f"{at}: expert id {e} is outside 0..{hi}"
                                     + (f" (num_experts={E})" if E is not None else ""))
            if len(set(ex)) != len(ex):
                raise InputError(f"{at}: expert ids {ex} repeat; a token's experts are distinct")
            probs = obj.get("gating_probs")
            if probs is None:
                probs = [math.nan] * k
            elif (not isinstance(probs, list) or len(probs) != k
                  or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in probs)):
                raise InputError(f"{at}: 'gating_probs' must be a list of {k} numbers (one per "
                                 f"expert), got {probs!r}")
            req = (obj.get("dataset"), obj.get("problem_id", 0))
            for part, val in zip(("dataset", "problem_id"), req):
                if val is not None and (isinstance(val, bool) or not isinstance(val, (int, str))):
                    raise InputError(f"{at}: {part!r} must be a string or integer, got {val!r}")
            recs.append((n, req, pos, layer, ex, probs))
    return recs, pos_key, k


def _int_field(obj: dict, key: str, at: str) -> int:
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InputError(f"{at}: {key!r} must be an integer ≥ 0, got {v!r}")
    return v


def _by_token_idx(p: Path, recs: list, req_index: dict):
    """(token, layer) slot of every record, tokens per step, phase and request of every step."""
    n_steps = [0] * len(req_index)
    for r in recs:
        i = req_index[r[1]]
        n_steps[i] = max(n_steps[i], r[2] + 1)
    first = np.r_[0, np.cumsum(n_steps)].astype(int)
    seen: dict[tuple[int, int], int] = {}
    slots = []
    for r in recs:
        slot = (int(first[req_index[r[1]]]) + r[2], r[3])
        if slot in seen:
            raise InputError(f"routing file {str(p)!r}, line {r[0]}: a second record for "
                             f"problem {r[1][1]!r}, token_idx {r[2]}, layer {r[3]} (first on "
                             f"line {seen[slot]}); each (token, layer) has one record")
        seen[slot] = r[0]
        slots.append(slot)
    S = int(first[-1])
    step_req = np.repeat(np.arange(len(n_steps)), n_steps)
    return slots, [1] * S, [1] * S, step_req


def _by_emission(recs: list, req_index: dict):
    step_tokens: list[int] = []
    phases: list[int] = []
    step_req: list[int] = []
    rec_step: list[int] = []
    prev = None
    for r in recs:
        key = (r[3], r[2])
        if prev is None or r[1] != prev[0] or key <= prev[1]:
            phases.append(0 if prev is None or r[1] != prev[0] else 1)
            step_req.append(req_index[r[1]])
            step_tokens.append(0)
        step_tokens[-1] = max(step_tokens[-1], r[2] + 1)
        rec_step.append(len(step_tokens) - 1)
        prev = (r[1], key)
    first = np.r_[0, np.cumsum(step_tokens)].astype(int)
    slots = [(int(first[s]) + r[2], r[3]) for s, r in zip(rec_step, recs)]
    return slots, step_tokens, phases, step_req


# -- numpy ---------------------------------------------------------------------------------------
def read_npy(path: str | Path, num_experts: int | None = None, prefill_tokens: int = 0) -> Trace:
    """A ``.npy`` integer array ``[seq_len, layers, top_k]`` of routed experts in rank order
    (vLLM's routed experts of one request; -1 = none). Every token is its own decode step,
    except that the first ``prefill_tokens`` tokens form one prefill step (phase 0). No weights
    (NaN). ``num_experts`` defaults to the largest id + 1."""
    p = _file(path, "routed-experts array")
    where = f"routed-experts array {str(p)!r}"
    E = _num_experts(num_experts, where)
    try:
        arr = np.load(p, allow_pickle=False)
    except ValueError as e:
        raise InputError(f"{where} cannot be read without pickle ({e}); save a plain integer "
                         f"array with numpy.save") from None
    except (OSError, EOFError) as e:
        raise InputError(f"{where} is not a .npy file ({e})") from None
    if not isinstance(arr, np.ndarray):
        arr.close()
        raise InputError(f"{where} is an .npz archive; expected one .npy array")
    if arr.dtype == bool or not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{where} has dtype {arr.dtype}; expected an integer dtype")
    if arr.ndim != 3:
        raise InputError(f"{where} has shape {arr.shape}; expected 3 dims [seq_len, layers, "
                         f"top_k]")
    T = arr.shape[0]
    if T == 0 or 0 in arr.shape[1:]:
        raise InputError(f"{where} has shape {arr.shape}; every dim must be ≥ 1")
    hi = E - 1 if E is not None else _I16 - 1
    bad = (arr < -1) | (arr > hi)
    if bad.any():
        t, l, j = (int(x) for x in np.argwhere(bad)[0])
        raise InputError(f"{where}: expert id {int(arr[t, l, j])} at index [{t}, {l}, {j}] "
                         f"(token, layer, rank) is outside -1..{hi} (-1 = none)")
    if E is None:
        if arr.max() < 0:
            raise InputError(f"{where} routes no token (all -1); pass num_experts")
        E = int(arr.max()) + 1
    try:
        pre = operator.index(prefill_tokens)
    except TypeError:
        pre = -1
    if isinstance(prefill_tokens, bool) or not 0 <= pre <= T:
        raise InputError(f"prefill_tokens for {where} must be an integer in 0..{T} (the "
                         f"array's seq_len), got {prefill_tokens!r}")
    if pre:
        token_step = np.r_[np.zeros(pre, np.int32), np.arange(1, T - pre + 1, dtype=np.int32)]
        phase = np.r_[0, np.ones(T - pre, np.int8)]
    else:
        token_step, phase = np.arange(T, dtype=np.int32), np.ones(T, np.int8)
    return Trace(topk_ids=arr.astype(np.int16), token_step=token_step, num_experts=E,
                 phase=phase, attrs={"source": "npy", "path": str(p), "prefill_tokens": pre})


# -- plain text (.wbtrace) -----------------------------------------------------------------------
def write_plain(trace: Trace, path: str | Path, overwrite: bool = False) -> Path:
    """Write ``trace`` as ``.wbtrace`` text (format in ``docs/traces.md``). Lossless except
    ``pred_ids`` and ``predicted_ids``/``predicted_scores`` (not stored) and the provenance
    attrs ``source``/``path`` (set by the reader). An existing file is kept unless
    ``overwrite``: :class:`StoreExistsError`."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"trace file {str(p)!r} is a folder; give a file path")
    if p.exists() and not overwrite:
        raise StoreExistsError(f"trace file {str(p)!r} already exists; pass overwrite=True "
                               f"(--overwrite) to replace it, or choose another path")
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
        if not isinstance(key, str) or not key or any(c in key for c in "\t\r\n"):
            raise InputError(f"trace attr name {key!r} cannot be written: it must be a non-empty "
                             f"string without tabs or line breaks")
        try:
            text = json.dumps(val, default=_json_default, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise InputError(f"trace attr {key!r} = {val!r} is not JSON-serialisable ({e})") \
                from None
        out.append(f"@attr\t{key}\t{text}")
    if trace.pred_ids is not None:
        out.append("# pred_ids are not stored in this format")
    if trace.predicted_ids is not None:
        out.append("# predicted_ids/predicted_scores are not stored in this format")
    out.append("# step\trequest\tphase\tmodality\t" + "\t".join(f"layer {i}" for i in range(L)))
    ids, w = trace.topk_ids, trace.topk_weights
    for t in range(T):
        s = int(trace.token_step[t])
        cols = [str(s), str(int(trace.step_request[s])), _code_name(trace.phase[s], PHASE_NAMES),
                _code_name(trace.token_modality[t], MODALITY_NAMES)]
        cols += [_layer_field(ids[t, layer], w[t, layer]) for layer in range(L)]
        out.append("\t".join(cols))
    tmp = p.with_name(f".{p.name}.tmp{os.getpid()}")
    tmp.write_text("\n".join(out) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p


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


def read_plain(path: str | Path) -> Trace:
    """A ``.wbtrace`` file (see ``docs/traces.md``): header, ``@`` directives, one line per
    token. Lines starting with ``#`` and blank lines are ignored."""
    p = _file(path, "trace file")
    with open(p, encoding="utf-8") as f:
        lines = f.read().split("\n")
    at = lambda n: f"trace file {str(p)!r}, line {n}"  # noqa: E731
    L, E, K = _plain_header(lines[0].rstrip("\r") if lines else "", at(1))
    pinned = np.zeros(L, bool)
    attrs: dict[str, Any] = {}
    steps: list[int] = []
    rows_ids: list[np.ndarray] = []
    rows_w: list[np.ndarray] = []
    modality: list[int] = []
    step_req: list[int] = []
    phase: list[int] = []
    step_line: list[int] = []
    for n, raw in enumerate(lines[1:], 2):
        line = raw.rstrip("\r")
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("@"):
            _plain_directive(line, at(n), L, pinned, attrs)
            continue
        cols = line.split("\t")
        if len(cols) != 4 + L:
            raise InputError(f"{at(n)}: {len(cols)} tab-separated fields; a token line has "
                             f"{4 + L}: step, request, phase, modality and one per layer "
                             f"({L} layers)")
        s = _plain_int(cols[0], "step", at(n), 0, np.iinfo(np.int32).max)
        prev = steps[-1] if steps else -1
        if s not in (prev, prev + 1) or (not steps and s != 0):
            raise InputError(f"{at(n)}: step {s} after step {prev}; steps start at 0 and a token "
                             f"line repeats the step before or adds 1")
        req = _plain_int(cols[1], "request", at(n), *_bounds(np.int32))
        ph = _plain_code(cols[2], "phase", PHASE_NAMES, at(n))
        if s == prev:
            if (req, ph) != (step_req[-1], phase[-1]):
                raise InputError(f"{at(n)}: request {req} / phase {ph} differ from the step's "
                                 f"first token (line {step_line[-1]}: request {step_req[-1]}, "
                                 f"phase {phase[-1]}); tokens of one step share them")
        else:
            step_req.append(req)
            phase.append(ph)
            step_line.append(n)
        steps.append(s)
        modality.append(_plain_code(cols[3], "modality", MODALITY_NAMES, at(n)))
        ids = np.full((L, K), -1, np.int16)
        w = np.full((L, K), np.nan, np.float32)
        for layer, field in enumerate(cols[4:]):
            _plain_layer(field, ids[layer], w[layer], E, f"{at(n)}, layer {layer}")
        rows_ids.append(ids)
        rows_w.append(w)
    T = len(steps)
    attrs.update(source="plain", path=str(p))
    return Trace(topk_ids=np.array(rows_ids, np.int16).reshape(T, L, K),
                 token_step=np.array(steps, np.int32), num_experts=E,
                 topk_weights=np.array(rows_w, np.float32).reshape(T, L, K),
                 token_modality=np.array(modality, np.int8), phase=np.array(phase, np.int8),
                 step_request=np.array(step_req, np.int32), pinned=pinned, attrs=attrs)


def _bounds(dtype) -> tuple[int, int]:
    info = np.iinfo(dtype)
    return int(info.min), int(info.max)


def _plain_header(line: str, at: str) -> tuple[int, int, int]:
    cols = line.split("\t")
    want = ("version", "layers", "experts", "top_k")
    usage = ("the first line must be 'wbtrace' then tab-separated version=1, layers=L, "
             "experts=E, top_k=K")
    if cols[0] != "wbtrace":
        raise InputError(f"{at}: {cols[0][:40]!r} is not a .wbtrace header; {usage}")
    vals: dict[str, int] = {}
    for c in cols[1:]:
        key, eq, val = c.partition("=")
        if not eq or key not in want or key in vals:
            raise InputError(f"{at}: header field {c!r} is unknown or repeated; {usage}")
        vals[key] = _plain_int(val, key, at, 1, _I16)
    if len(vals) != len(want):
        missing = [k for k in want if k not in vals]
        raise InputError(f"{at}: header lacks {', '.join(missing)}; {usage}")
    if vals["version"] != PLAIN_VERSION:
        raise InputError(f"{at}: .wbtrace version {vals['version']} is not supported; "
                         f"this reader knows version {PLAIN_VERSION}")
    return vals["layers"], vals["experts"], vals["top_k"]


def _plain_directive(line: str, at: str, L: int, pinned: np.ndarray, attrs: dict) -> None:
    name, _, rest = line.partition("\t")
    if name == "@pinned":
        pinned[:] = False
        if rest.strip() != "-":
            for x in rest.split(","):
                pinned[_plain_int(x, "pinned layer", at, 0, L - 1)] = True
    elif name == "@attr":
        key, tab, text = rest.partition("\t")
        if not key or not tab:
            raise InputError(f"{at}: an attr line is '@attr<TAB>name<TAB>JSON value', "
                             f"got {line[:60]!r}")
        try:
            attrs[key] = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{at}: value of attr {key!r} is not JSON ({e.msg}): "
                             f"{text[:60]!r}") from None
    else:
        raise InputError(f"{at}: unknown directive {name[:40]!r}; allowed: @pinned, @attr")


def _plain_int(text: str, what: str, at: str, lo: int, hi: int) -> int:
    try:
        v = int(text.strip())
    except ValueError:
        raise InputError(f"{at}: {what} {text[:40]!r} is not an integer") from None
    if not lo <= v <= hi:
        raise InputError(f"{at}: {what} {v} is outside {lo}..{hi}")
    return v


def _plain_code(text: str, what: str, names: tuple[str, ...], at: str) -> int:
    t = text.strip()
    if t in names:
        return names.index(t)
    try:
        v = int(t)
    except ValueError:
        raise InputError(f"{at}: {what} {t[:40]!r} is not one of {', '.join(names)} or an "
                         f"integer code") from None
    if not -128 <= v <= 127:
        raise InputError(f"{at}: {what} code {v} is outside -128..127")
    return v


def _plain_layer(field: str, ids: np.ndarray, w: np.ndarray, E: int, at: str) -> None:
    field = field.strip()
    if field == "-":
        return
    parts = field.split(",")
    if len(parts) > len(ids):
        raise InputError(f"{at}: {len(parts)} experts {field!r}; top_k is {len(ids)}")
    for j, part in enumerate(parts):
        e_text, colon, w_text = part.partition(":")
        ids[j] = _plain_int(e_text, "expert id", at, -1, E - 1)
        if colon:
            try:
                w[j] = np.float32(float(w_text))
            except ValueError:
                raise InputError(f"{at}: weight {w_text[:40]!r} of expert {e_text} is not a "
                                 f"number") from None

