"""Hostile trace files get a message, not a traceback or an out-of-memory (issue 10, items 9, 10).

Every class of bad input to the trace importers — sizes a file declares that it cannot back
(huge token/step/layer numbers, header fields, ``.npy`` shapes), ids out of range, non-finite or
out-of-range weights, bytes that are not UTF-8, JSON nested deeper than 64 levels or with repeated keys,
lines too long, ``.npy`` files that are garbage, truncated, pickled, structured or of the wrong
dtype or rank, empty files, folders, link loops, pipes, bad options and budgets — raises
:class:`~workbench.errors.InputError` whose message names the file and the problem. The cases
that declare a big size are also loaded in a child process under ``RLIMIT_AS`` of 1.5 GiB,
which must refuse them with the same error while its peak RSS stays small: the sizes are checked
before anything is allocated. Variants that are not errors (a byte-order mark, CRLF, Fortran
order, big-endian, NaN/inf weights in ``.wbtrace``) load to the same trace as the plain file.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import distinct_ids

from workbench.errors import InputError
from workbench.traces import Trace, from_store, load_trace, read_plain, write_plain
from workbench.traces import limits
from workbench.traces import trace as trace_mod

HEADER = "wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=2\n"
TOKEN = "0\t0\tdecode\ttext\t1:0.5,2:0.5\t3\n"
GOOD_JSONL = '{"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}\n'


@pytest.fixture(autouse=True)
def _no_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv(limits.ENV, raising=False)


# -- file builders --------------------------------------------------------------------------------
def npy_file(header: dict | str, data: bytes = b"", version: tuple[int, int] = (1, 0)) -> bytes:
    """A .npy file with this header (a dict, written as numpy writes it, or raw text)."""
    if isinstance(header, dict):
        text = "{" + "".join(f"'{k}': {v!r}, " for k, v in sorted(header.items())) + "}"
    else:
        text = header
    hl = 2 if version[0] == 1 else 4
    pad = (64 - (8 + hl + len(text) + 1) % 64) % 64
    body = (text + " " * pad + "\n").encode("latin1")
    return (b"\x93NUMPY" + bytes(version) + struct.pack("<H" if hl == 2 else "<I", len(body))
            + body + data)


def npy_of(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


I4 = {"descr": "<i4", "fortran_order": False}
OK3 = np.array([[[0, 1], [2, 3]], [[1, 2], [3, 0]]], np.int32)   # [2 tokens, 2 layers, top-2]


class _Marker:
    """Unpickling this creates a file: proof that something unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def jl(**rec) -> str:
    """One JSON-lines record; a key given as None is left out."""
    base = {"problem_id": 0, "layer": 0, "token_idx": 0, "experts": [1, 2]}
    return json.dumps({k: v for k, v in {**base, **rec}.items() if v is not None}) + "\n"


# Each case: id, file name, content (bytes/str, or a callable making the file at the path),
# load_trace options, regex the message must match. "BIG" cases declare a big size: they also
# run under RLIMIT_AS in a child process (test_declared_sizes_are_refused_before_allocating).
BIG = "big"
CASES = [
    # JSON lines: sizes
    ("jsonl-token-idx-1e9", "t.jsonl", jl(token_idx=10**9), {},
     r"1000000001 tokens \(the largest token_idx is 1000000000, on line 1\).*need 21\.4 GiB "
     r"of memory, more than the memory budget of 64 MiB for a file of 74 bytes", BIG),
    ("jsonl-token-idx-1e7-sparse", "t.jsonl", jl(token_idx=10**7), {},
     r"10000001 tokens .* more than the memory budget of 64 MiB for a file", BIG),
    ("jsonl-token-pos-1e9", "t.jsonl", jl(token_pos=10**9, token_idx=None), {},
     r"1000000001 tokens \(the largest token_pos is 1000000000", BIG),
    ("jsonl-token-idx-2^40", "t.jsonl", jl(token_idx=2**40), {},
     r"line 1: 'token_idx' must be an integer ≥ 0, got 1099511627776 "
     r"\(allowed: 0\.\.2147483646\)",
     BIG),
    ("jsonl-layer-1e6", "t.jsonl", jl(layer=10**6), {},
     r"line 1: 'layer' must be an integer ≥ 0, got 1000000 \(allowed: 0\.\.32766\)", BIG),
    ("jsonl-layer-and-token-big", "t.jsonl", jl(layer=30000, token_idx=10**5), {},
     r"100001 tokens .* 30001 layers .* more than the memory budget", BIG),
    ("jsonl-many-experts", "t.jsonl", jl(experts=list(range(40000))), {},
     r"line 1: 40000 experts; top-k is at most 32767", BIG),
    # JSON lines: values
    ("jsonl-expert-huge", "t.jsonl", jl(experts=[1, 10**30]), {},
     r"line 1: expert id 1000000000000000000000000000000 is outside 0\.\.32766", None),
    ("jsonl-expert-negative", "t.jsonl", jl(experts=[-1, 2]), {},
     r"line 1: expert id -1 is outside 0\.\.32766", None),
    ("jsonl-expert-above-num-experts", "t.jsonl", jl(experts=[1, 9]), {"num_experts": 8},
     r"line 1: expert id 9 is outside 0\.\.7 \(num_experts=8\)", None),
    ("jsonl-prob-nan", "t.jsonl", GOOD_JSONL + jl(gating_probs=[0.5, float("nan")]), {},
     r"line 2: gating_probs value nan is not a finite float32", None),
    ("jsonl-prob-inf", "t.jsonl", jl(gating_probs=[float("inf"), 0.5]), {},
     r"line 1: gating_probs value inf is not a finite float32", None),
    ("jsonl-prob-1e39", "t.jsonl", jl(gating_probs=[1e39, 0.5]), {},
     r"line 1: gating_probs value 1e\+39 is not a finite float32", None),
    ("jsonl-prob-huge-int", "t.jsonl", jl(gating_probs=[10**400, 0.5]), {},
     r"line 1: gating_probs value 1000.*… is not a finite float32", None),
    ("jsonl-problem-id-list", "t.jsonl", jl(problem_id=[1]), {},
     r"line 1: 'problem_id' must be a string or integer, got \[1\]", None),
    ("jsonl-not-object", "t.jsonl", "null\n", {}, r"line 1: expected a JSON object, got NoneType",
     None),
    # JSON lines: bytes and syntax
    ("jsonl-not-utf8", "t.jsonl", GOOD_JSONL.encode() + b'{"layer": 0, "x": "\xff\xfe"}\n', {},
     r"line 2: byte 0xff at column 20 is not UTF-8 text", None),
    ("jsonl-latin1-file", "t.jsonl", '{"dataset": "café"}\n'.encode("latin1"), {},
     r"line 1: byte 0xe9 at column 17 is not UTF-8", None),
    ("jsonl-deep-nesting", "t.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", {},
     r"line 1: JSON nested deeper than 64 levels", None),
    ("jsonl-deep-nesting-in-extra-key", "t.jsonl", jl()[:-2] + ', "x": ' + "[" * 50_000
     + "]" * 50_000 + "}\n", {}, r"line 1: JSON nested deeper than 64 levels", None),
    ("jsonl-5000-digit-int", "t.jsonl", '{"layer": ' + "9" * 5000 + "}\n", {},
     r"line 1: not usable JSON \(Exceeds the limit \(4300 digits\)", None),
    ("jsonl-duplicate-key", "t.jsonl",
     '{"layer": 0, "layer": 1, "token_idx": 0, "experts": [1]}\n', {},
     r"line 1: the key 'layer' appears twice in one object; keys must be unique", None),
    ("jsonl-line-too-long", "t.jsonl", lambda p: p.write_bytes(b"[" + b"0," * (5 * 2**20)),
     {}, r"line 1: longer than 8 MiB, the longest line this format allows", BIG),
    ("jsonl-1GiB-single-line", "t.jsonl", lambda p: _sparse(p, 2**30), {},
     r"line 1: longer than 8 MiB", BIG),
    ("jsonl-empty", "t.jsonl", b"", {}, r"has no records", None),
    ("jsonl-only-blank-lines", "t.jsonl", "\n \r\n\t\n", {}, r"has no records", None),
    ("jsonl-problem-option-bad", "t.jsonl", GOOD_JSONL, {"problem": 1.5},
     r"problem must be a problem_id \(integer or string\)", None),
    ("jsonl-problem-absent", "t.jsonl", GOOD_JSONL, {"problem": [0, 7]},
     r"problem 7 is not in routing file .*; it has problems \[0\]", None),
    ("jsonl-num-experts-bool", "t.jsonl", GOOD_JSONL, {"num_experts": True},
     r"num_experts for routing file .* must be an integer in 1\.\.32767, got True", None),
    # .wbtrace: sizes
    ("wbtrace-32767x32767", "t.wbtrace",
     lambda p: p.write_text("wbtrace\tversion=1\tlayers=32767\texperts=8\ttop_k=32767\n"
                            "0\t0\tdecode\ttext\t" + "\t".join(["-"] * 32767) + "\n"),
     {}, r"its 1 token lines × 32767 layers × top_k 32767 \(as its header declares\) need "
         r"6\.01 GiB of memory, more than the memory budget", BIG),
    ("wbtrace-sparse-top-k", "t.wbtrace",
     lambda p: p.write_text("wbtrace\tversion=1\tlayers=1\texperts=8\ttop_k=32767\n"
                            + "0\t0\tdecode\ttext\t-\n" * 20_000),
     {}, r"its 20000 token lines × 1 layers × top_k 32767 .* need 3\.67 GiB of memory, more "
         r"than the memory budget of 87\.9 MiB for a file of 352 KiB \(the larger of 64 MiB and "
         r"256 × the file size", BIG),
    ("wbtrace-layers-huge", "t.wbtrace", "wbtrace\tversion=1\tlayers=99999\texperts=4\ttop_k=2\n",
     {}, r"line 1: layers 99999 is outside 1\.\.32767", BIG),
    ("wbtrace-layers-5000-digits", "t.wbtrace",
     f"wbtrace\tversion=1\tlayers={'9' * 5000}\texperts=4\ttop_k=2\n", {},
     r"line 1: layers '9999+… is outside 1\.\.32767", BIG),
    ("wbtrace-step-huge", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t1\t2\n"
     + "99999999999\t0\tdecode\ttext\t1\t2\n", {},
     r"line 3: step 99999999999 is outside 0\.\.2147483646", BIG),
    ("wbtrace-line-too-long", "t.wbtrace",
     lambda p: p.write_bytes(HEADER.encode() + b"0\t0\tdecode\ttext\t" + b"1," * 9 * 2**20),
     {}, r"line 2: longer than 16 MiB", BIG),
    ("wbtrace-1GiB-single-line", "t.wbtrace", lambda p: _sparse(p, 2**30, HEADER.encode()), {},
     r"line 2: longer than 16 MiB", BIG),
    ("wbtrace-too-many-fields", "t.wbtrace",
     lambda p: p.write_text(HEADER + "0" + "\t" * (8 * 2**20) + "\n"), {},
     r"line 2: 8388609 tab-separated fields; a token line has 6", BIG),
    ("wbtrace-too-many-pinned", "t.wbtrace", HEADER + "@pinned\t" + "0," * 2**20 + "0\n", {},
     r"line 2: @pinned lists more than 2 layers", BIG),
    ("wbtrace-too-many-entries", "t.wbtrace",
     HEADER + "0\t0\tdecode\ttext\t" + "1," * 2**20 + "1\t-\n", {},
     r"line 2, layer 0: 1048577 experts '1,1,1.*; top_k is 2", BIG),
    ("wbtrace-attrs-too-big", "t.wbtrace",
     lambda p: p.write_text(HEADER + "".join(f'@attr\ta{i}\t"{"x" * 2**20}"\n'
                                             for i in range(17))), {},
     r"line 17: the @attr values add up to more than 16 MiB", BIG),
    # .wbtrace: header fields
    ("wbtrace-layers-zero", "t.wbtrace", "wbtrace\tversion=1\tlayers=0\texperts=4\ttop_k=2\n", {},
     r"line 1: layers 0 is outside 1\.\.32767", None),
    ("wbtrace-layers-negative", "t.wbtrace",
     "wbtrace\tversion=1\tlayers=-3\texperts=4\ttop_k=2\n", {},
     r"line 1: layers -3 is outside 1\.\.32767", None),
    ("wbtrace-top-k-float", "t.wbtrace", "wbtrace\tversion=1\tlayers=2\texperts=4\ttop_k=2.5\n",
     {}, r"line 1: top_k '2\.5' is not an integer", None),
    ("wbtrace-experts-fullwidth-digit", "t.wbtrace",
     "wbtrace\tversion=1\tlayers=2\texperts=４\ttop_k=2\n", {},
     r"line 1: experts '４' is not an integer", None),
    ("wbtrace-experts-underscore", "t.wbtrace",
     "wbtrace\tversion=1\tlayers=2\texperts=1_0\ttop_k=2\n", {},
     r"line 1: experts '1_0' is not an integer", None),
    ("wbtrace-header-repeated", "t.wbtrace",
     "wbtrace\tversion=1\tlayers=2\tlayers=3\texperts=4\ttop_k=2\n", {},
     r"line 1: header field 'layers=3' is unknown or repeated", None),
    ("wbtrace-empty", "t.wbtrace", b"", {}, r"line 1: the file is empty; the first line must be",
     None),
    # .wbtrace: token lines
    ("wbtrace-expert-huge", "t.wbtrace",
     HEADER + "0\t0\tdecode\ttext\t1,99999999999999999999\t-\n", {},
     r"line 2, layer 0: expert id 99999999999999999999 is outside -1\.\.3", None),
    ("wbtrace-expert-negative", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t-2\t-\n", {},
     r"line 2, layer 0: expert id -2 is outside -1\.\.3", None),
    ("wbtrace-expert-underscore", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t1_0\t-\n", {},
     r"line 2: '_' at column 18; numbers are written without underscores", None),
    ("wbtrace-expert-arabic-digit", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t٣\t-\n", {},
     r"line 2: byte 0xd9 at column 17; a token line is ASCII", None),
    ("wbtrace-weight-1e39", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t1:1e39\t-\n", {},
     r"line 2, layer 0: weight '1e39' of expert 1 is outside the float32 range", None),
    ("wbtrace-weight-1e400", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t1:1e400\t-\n", {},
     r"line 2, layer 0: weight '1e400' of expert 1 is outside the float32 range", None),
    ("wbtrace-weight-hex", "t.wbtrace", HEADER + "0\t0\tdecode\ttext\t1:0x10\t-\n", {},
     r"line 2, layer 0: weight '0x10' of expert 1 is not a number", None),
    ("wbtrace-request-huge", "t.wbtrace", HEADER + "0\t3000000000\tdecode\ttext\t1\t-\n", {},
     r"line 2: request 3000000000 is outside -2147483648\.\.2147483647", None),
    ("wbtrace-phase-code-huge", "t.wbtrace", HEADER + "0\t0\t300\ttext\t1\t-\n", {},
     r"line 2: phase code 300 is outside -128\.\.127", None),
    ("wbtrace-not-utf8-attr", "t.wbtrace", HEADER.encode() + b'@attr\tx\t"\xc3\x28"\n', {},
     r"line 2: byte 0xc3 at column 10 is not UTF-8 text", None),
    ("wbtrace-attr-deep-nesting", "t.wbtrace",
     HEADER + "@attr\tx\t" + "[" * 100_000 + "]" * 100_000 + "\n", {},
     r"line 2: value of attr 'x' is JSON nested deeper than 64 levels", None),
    ("wbtrace-attr-duplicate-key", "t.wbtrace", HEADER + '@attr\tx\t{"a": 1, "a": 2}\n', {},
     r"line 2: value of attr 'x' has the key 'a' twice", None),
    ("wbtrace-attr-repeated", "t.wbtrace", HEADER + "@attr\tx\t1\n@attr\tx\t2\n", {},
     r"line 3: attr 'x' is given twice \(first on line 2\)", None),
    ("wbtrace-attr-5000-digits", "t.wbtrace", HEADER + "@attr\tx\t" + "9" * 5000 + "\n", {},
     r"line 2: value of attr 'x' is not usable JSON \(Exceeds the limit", None),
    # .npy: declared sizes
    ("npy-shape-1e11", "t.npy", npy_file({**I4, "shape": (10**11, 32, 8)}, b"\0" * 96), {},
     r"its header declares shape \(100000000000, 32, 8\) of int32, 102400000000000 bytes of "
     r"data, but the file holds 96 bytes", BIG),
    ("npy-shape-negative", "t.npy", npy_file({**I4, "shape": (-1, 2, 2)}), {},
     r"has shape \(-1, 2, 2\); every dim must be ≥ 1", BIG),
    ("npy-shape-huge-layers", "t.npy",
     npy_file({"descr": "|u1", "fortran_order": False, "shape": (1, 40000, 1)}, b"\0" * 40000),
     {}, r"has shape \(1, 40000, 1\); allowed: seq_len ≤ 2147483647, layers ≤ 32767", BIG),
    ("npy-header-length-4GiB", "t.npy", b"\x93NUMPY\x02\x00\xff\xff\xff\xff{'descr'", {},
     r"has a \.npy header that claims 4294967295 bytes \(the file has 20", BIG),
    ("npy-consistent-but-over-budget", "t.npy",
     lambda p: p.write_bytes(npy_file({"descr": "|i1", "fortran_order": False,
                                       "shape": (10**6, 4, 4)}, b"\0" * (16 * 10**6))),
     {"max_bytes": "10MB"},
     r"its 1000000 tokens × 4 layers × top-4 need 41 MiB of memory, more than the memory "
     r"budget max_bytes=10000000", BIG),
    ("npy-truncated-data", "t.npy", npy_of(OK3)[:-5], {},
     r"header declares shape \(2, 2, 2\) of int32, 32 bytes of data, but the file holds 27",
     None),
    ("npy-trailing-bytes", "t.npy", npy_of(OK3) + b"xx", {},
     r"32 bytes of data, but the file holds 34 bytes", None),
    ("npy-truncated-header", "t.npy", npy_of(OK3)[:20], {},
     r"has a \.npy header that claims 118 bytes \(the file has 20", None),
    # .npy: what the file is
    ("npy-empty", "t.npy", b"", {}, r"is empty \(0 bytes\)", None),
    ("npy-garbage", "t.npy", os.urandom(64).replace(b"\x93", b"x"), {},
     r"is not a \.npy file: it does not start with the \.npy magic string", None),
    ("npy-text", "t.npy", "0 1 2 3\n", {}, r"is not a \.npy file.*it starts with b'0 1 2 '",
     None),
    ("npy-pickle", "t.npy", pickle.dumps([1, 2, 3]), {}, r"is not a \.npy file", None),
    ("npy-npz", "t.npy", lambda p: np.savez(open(p, "wb"), a=OK3), {}, r"is an \.npz archive",
     None),
    ("npy-version-9", "t.npy", b"\x93NUMPY\x09\x00" + b"\0" * 60, {},
     r"has \.npy format version 9\.0; this reader knows 1\.0, 2\.0 and 3\.0", None),
    ("npy-header-extra-key", "t.npy", npy_file("{'descr': '<i4', 'fortran_order': False, "
                                               "'shape': (1, 1, 1), 'x': 1}", b"\0" * 4), {},
     r"has a malformed \.npy header \(Header does not contain the correct keys", None),
    ("npy-header-not-python", "t.npy", npy_file("{'descr': '<i4', 'fortran_order': False, "
                                                "'shape': (1, 1, __import__('os'))}"), {},
     r"has a malformed \.npy header", None),
    ("npy-header-nested", "t.npy", npy_file("(" * 3000 + ")" * 3000), {},
     r"has a malformed \.npy header", None),
    ("npy-header-shape-bool", "t.npy",
     npy_file("{'descr': '<i4', 'fortran_order': False, 'shape': (True, 1, 1)}", b"\0" * 4), {},
     r"has shape \(True, 1, 1\); every dim must be ≥ 1", None),
    # .npy: dtypes and ranks
    ("npy-object", "t.npy", lambda p: np.save(p, np.array([[[1, None]]], object)), {},
     r"has dtype object \(Python objects\), which cannot be read without pickle", None),
    ("npy-object-structured", "t.npy",
     npy_file({"descr": [("a", "|O")], "fortran_order": False, "shape": (1, 1, 1)}, b"\0" * 8),
     {}, r"cannot be read without pickle", None),
    ("npy-structured", "t.npy",
     lambda p: np.save(p, np.zeros((2, 2, 2), [("a", "<i4"), ("b", "<i4")])), {},
     r"has the structured dtype .*; expected a plain integer dtype", None),
    ("npy-subarray", "t.npy",
     npy_file({"descr": [("a", "<i4", (2,))], "fortran_order": False, "shape": (1, 1, 1)},
              b"\0" * 8), {}, r"has the structured dtype", None),
    ("npy-float", "t.npy", npy_of(OK3.astype(np.float64)), {},
     r"has dtype float64; expected an integer dtype", None),
    ("npy-complex", "t.npy", npy_of(OK3.astype(np.complex64)), {}, r"has dtype complex64", None),
    ("npy-bool", "t.npy", npy_of(OK3.astype(bool)), {}, r"has dtype bool", None),
    ("npy-timedelta", "t.npy", npy_of(OK3.astype("m8[s]")), {}, r"has dtype timedelta64\[s\]",
     None),
    ("npy-bytes", "t.npy", npy_of(OK3.astype("S2")), {}, r"has dtype \|S2", None),
    ("npy-0d", "t.npy", npy_of(np.array(3, np.int32)), {},
     r"has shape \(\); expected 3 dims \[seq_len, layers, top_k\]", None),
    ("npy-1d", "t.npy", npy_of(np.arange(3, dtype=np.int32)), {}, r"has shape \(3,\); expected",
     None),
    ("npy-4d", "t.npy", npy_of(np.zeros((1, 1, 1, 1), np.int32)), {},
     r"has shape \(1, 1, 1, 1\); expected 3 dims", None),
    ("npy-expert-huge-uint64", "t.npy", npy_of(np.array([[[0, 2**64 - 1]]], np.uint64)), {},
     r"expert id 18446744073709551615 at index \[0, 0, 1\] .* is outside -1\.\.32766", None),
    ("npy-expert-negative", "t.npy", npy_of(np.array([[[0, -7]]], np.int64)), {},
     r"expert id -7 at index \[0, 0, 1\] \(token, layer, rank\) is outside -1\.\.32766", None),
    ("npy-expert-above-num-experts-fortran", "t.npy",
     npy_of(np.asfortranarray(np.array([[[0, 1], [2, 3]], [[1, 9], [3, 0]]], np.int16))),
     {"num_experts": 8}, r"expert id 9 at index \[1, 0, 1\] .* outside -1\.\.7", None),
    ("npy-prefill-negative", "t.npy", npy_of(OK3), {"prefill_tokens": -1},
     r"prefill_tokens for .* must be an integer in 0\.\.2 .*, got -1", None),
    ("npy-prefill-float", "t.npy", npy_of(OK3), {"prefill_tokens": 1.0},
     r"prefill_tokens .* got 1\.0", None),
    # any file: what the path is, options, budgets
    ("folder-as-jsonl", "t.jsonl", lambda p: p.mkdir(), {"format": "jsonl"},
     r"routing file .* is a folder, not a file", None),
    ("folder-auto", "t.npy", lambda p: p.mkdir(), {},
     r"trace .* is a folder without zarr\.json, so not a run store", None),
    ("symlink-loop", "t.wbtrace", lambda p: os.symlink(p, p), {},
     r"trace .* cannot be read \(Too many levels of symbolic links\)", None),
    ("dangling-symlink", "t.npy", lambda p: os.symlink(p.with_name("gone.npy"), p), {},
     r"trace .*t\.npy' does not exist", None),
    ("fifo", "t.jsonl", lambda p: os.mkfifo(p), {},
     r"routing file .* is not a regular file \(a device, pipe or socket\)", None),
    ("option-unknown", "t.npy", npy_of(OK3), {"layers": 3},
     r"option 'layers' does not apply to trace format 'npy'; allowed options: num_experts, "
     r"prefill_tokens, max_bytes", None),
    ("max-bytes-garbage", "t.npy", npy_of(OK3), {"max_bytes": "lots"},
     r"max_bytes 'lots' is not a byte count; use e\.g\. 2147483648, 500MB or 4GiB", None),
    ("max-bytes-negative", "t.npy", npy_of(OK3), {"max_bytes": -5},
     r"max_bytes must be a positive number of bytes, got -5", None),
    ("max-bytes-too-small", "t.wbtrace", HEADER + TOKEN, {"max_bytes": 100},
     r"its 1 token lines × 2 layers × top_k 2 .* more than the memory budget max_bytes=100",
     None),
]
# messages that cannot name the file (the option, not the file, is at fault)
NO_FILE_NAME = {"max-bytes-garbage", "max-bytes-negative", "jsonl-problem-option-bad",
                "jsonl-num-experts-bool"}


def _sparse(p: Path, size: int, head: bytes = b"") -> None:
    """A file of ``size`` bytes, all NUL after ``head``, costing no disk: one huge line."""
    with open(p, "wb") as f:
        f.write(head)
        f.truncate(size)


def _make(case, folder: Path) -> Path:
    cid, name, content = case[:3]
    d = folder / cid
    d.mkdir()
    p = d / name
    if callable(content):
        content(p)
    elif isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_bytes(content.encode("utf-8"))
    return p


def _load(p: Path, opts: dict):
    opts = dict(opts)
    fmt = opts.pop("format", "auto")
    return load_trace(p, format=fmt, **opts)


SMALL = [c for c in CASES if c[5] != BIG]
LARGE = [c for c in CASES if c[5] == BIG]


@pytest.mark.parametrize("case", SMALL, ids=[c[0] for c in SMALL])
def test_hostile_input_is_a_clear_error(case, tmp_path):
    p = _make(case, tmp_path)
    with pytest.raises(InputError, match=case[4]) as err:
        _load(p, case[3])
    msg = str(err.value)
    assert "\n" not in msg and len(msg) < 600, msg
    if case[0] not in NO_FILE_NAME:
        assert str(p) in msg, msg


# -- declared sizes: refused before any allocation, under an address-space limit ----------------
CHILD = textwrap.dedent("""
    import json, resource, sys
    cap = int(1.5 * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    from workbench.errors import InputError
    from workbench.traces import load_trace
    out = {}
    for cid, path, opts in json.loads(sys.argv[1]):
        fmt = opts.pop("format", "auto")
        try:
            load_trace(path, format=fmt, **opts)
            out[cid] = ["loaded", ""]
        except InputError as e:
            out[cid] = ["InputError", str(e)]
        except BaseException as e:  # MemoryError above all
            out[cid] = [type(e).__name__, str(e)[:300]]
    # VmHWM: this process's peak RSS (ru_maxrss would include the parent's, kept across exec)
    with open("/proc/self/status") as f:
        hwm = [line.split()[1] for line in f if line.startswith("VmHWM:")]
    out["peak_rss"] = int(hwm[0]) * 1024 if hwm else None
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """Every BIG case loaded in one child process limited to 1.5 GiB of address space."""
    folder = tmp_path_factory.mktemp("big")
    jobs = [(c[0], str(_make(c, folder)), dict(c[3])) for c in LARGE]
    env = {k: v for k, v in os.environ.items() if k != limits.ENV}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(jobs)], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), dict((j[0], j[1]) for j in jobs)


@pytest.mark.parametrize("case", LARGE, ids=[c[0] for c in LARGE])
def test_declared_sizes_are_refused_before_allocating(case, limited):
    import re

    out, paths = limited
    kind, msg = out[case[0]]
    assert kind == "InputError", (kind, msg)
    assert re.search(case[4], msg), msg
    assert paths[case[0]] in msg and "\n" not in msg
    # the whole child, with every big case, stayed small: nothing was allocated for them
    assert out["peak_rss"] is None or out["peak_rss"] < 200 * 2**20, out["peak_rss"]


# -- variants that are not errors -----------------------------------------------------------------
def test_bom_crlf_and_blank_lines_are_read_like_plain_text(tmp_path):
    plain = tmp_path / "plain.wbtrace"
    plain.write_text(HEADER + "@attr\tm\t\"é\"\n" + TOKEN + "1\t0\tdecode\timage\t-\t0:1\n")
    odd = tmp_path / "odd.wbtrace"
    odd.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes().replace(b"\n", b"\r\n")
                    .replace(b"@attr", b"\r\n  \r\n@attr"))
    a, b = read_plain(plain), read_plain(odd)
    assert np.array_equal(a.topk_ids, b.topk_ids) and a.attrs["m"] == b.attrs["m"] == "é"
    assert np.array_equal(a.topk_weights, b.topk_weights, equal_nan=True)
    j1, j2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    j1.write_text(GOOD_JSONL + jl(layer=1, experts=[3, 0]))
    j2.write_bytes(b"\xef\xbb\xbf" + j1.read_bytes().replace(b"\n", b"\r\n") + b"\r\n")
    t1, t2 = load_trace(j1), load_trace(j2)
    assert np.array_equal(t1.topk_ids, t2.topk_ids) and t1.num_layers == 2


def test_fortran_big_endian_and_unsigned_npy_load_like_plain(tmp_path):
    rng = np.random.default_rng(0)
    arr = distinct_ids(rng, (50, 3, 4), 60, none_share=0).astype(np.int32)
    arr[::7, 0, 0] = -1  # some "none" entries (the unsigned copy maps them to 0: kept distinct)
    arr[::7, 0, 1:] = np.where(arr[::7, 0, 1:] == 0, 59 - np.arange(3), arr[::7, 0, 1:])
    ref = None
    for name, a in [("c", arr), ("f", np.asfortranarray(arr)), ("be", arr.astype(">i4")),
                    ("be-f", np.asfortranarray(arr.astype(">i8"))),
                    ("u2", np.where(arr < 0, 0, arr).astype(np.uint16)),
                    ("i1", arr.astype("i1"))]:
        np.save(tmp_path / f"{name}.npy", a)
        tr = load_trace(tmp_path / f"{name}.npy", num_experts=60, prefill_tokens=5)
        want = np.where(arr < 0, 0, arr) if name == "u2" else arr
        assert np.array_equal(tr.topk_ids, want) and tr.topk_ids.flags.c_contiguous, name
        assert tr.num_steps == 46 and tr.phase[0] == 0
        ref = ref or tr
    assert not ref.topk_weights.flags.writeable and np.isnan(ref.topk_weights).all()


def test_nan_and_extreme_weights_round_trip_in_wbtrace(tmp_path):
    big = np.finfo(np.float32).max
    w = np.array([[[np.nan, big]], [[-big, np.finfo(np.float32).max]],
                  [[-0.0, np.finfo(np.float32).smallest_subnormal]]], np.float32)
    tr = Trace(topk_ids=np.array([[[0, 1]], [[2, -1]], [[1, 0]]]), token_step=[0, 1, 1],
               num_experts=3, topk_weights=w)
    back = read_plain(write_plain(tr, tmp_path / "w.wbtrace"))
    assert np.array_equal(back.topk_weights.view(np.uint32)[~np.isnan(w)],
                          w.view(np.uint32)[~np.isnan(w)])
    assert np.isnan(back.topk_weights[0, 0, 0])


def test_pickle_is_never_loaded(tmp_path):
    marker = tmp_path / "unpickled"
    evil = tmp_path / "evil.npy"
    evil.write_bytes(pickle.dumps(_Marker(str(marker))))
    with pytest.raises(InputError, match="is not a .npy file"):
        load_trace(evil)
    obj = tmp_path / "obj.npy"   # a real object array whose data is that pickle
    obj.write_bytes(npy_file({"descr": "|O", "fortran_order": False, "shape": (1, 1, 1)},
                             pickle.dumps(_Marker(str(marker)))))
    with pytest.raises(InputError, match="cannot be read without pickle"):
        load_trace(obj)
    assert not marker.exists()


# -- budgets: where they come from, and groups() -------------------------------------------------
def test_budget_from_environment_and_default(tmp_path, monkeypatch):
    p = tmp_path / "t.wbtrace"
    p.write_text(HEADER + TOKEN * 10)
    assert load_trace(p).num_tokens == 10
    monkeypatch.setenv(limits.ENV, "100")
    with pytest.raises(InputError, match=rf"more than the memory budget {limits.ENV}=100 "):
        load_trace(p)
    monkeypatch.setenv(limits.ENV, "1GiB")
    assert load_trace(p).num_tokens == 10
    monkeypatch.setenv(limits.ENV, "a lot")
    with pytest.raises(InputError, match=rf"environment variable {limits.ENV} 'a lot' is not a "
                                         r"byte count"):
        load_trace(p)
    assert load_trace(p, max_bytes="1MB").num_tokens == 10  # the parameter wins
    monkeypatch.delenv(limits.ENV)
    n, says = limits.budget(None, 10)
    assert n == limits.FLOOR_BYTES and "256 × the file size, at most 2 GiB" in says
    assert limits.budget(None, 10**9)[0] == limits.DEFAULT_MAX_BYTES


def test_groups_refuses_more_than_the_budget_before_building(tmp_path):
    rng = np.random.default_rng(1)
    tr = Trace(topk_ids=rng.integers(0, 64, (20_000, 4, 1)), token_step=np.arange(20_000),
               num_experts=64)
    assert tr.groups(max_bytes="100MB").num_accesses == 80_000
    with pytest.raises(InputError, match=r"trace replay: the access groups of Trace\(\?: 20000 "
                                         r"steps.*\(up to 80000 accesses in 80000 groups\) need "
                                         r"2\.44 MiB of memory, more than the memory budget "
                                         r"max_bytes=100000"):
        tr.groups(max_bytes=100_000)


@pytest.mark.parametrize("seed", range(6))
def test_groups_in_chunks_equal_groups_in_one_piece(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    T, L, K, E = int(rng.integers(1, 300)), int(rng.integers(1, 5)), int(rng.integers(1, 4)), \
        int(rng.integers(1, 20))
    step_len = rng.choice([1, 3, 50, 1000])
    ts = np.cumsum(rng.random(T) < 1 / step_len)
    ts = ts - ts[0]
    kept = rng.random(T) < 0.7 if seed % 2 else None
    ids = distinct_ids(rng, (T, L, K), E)
    if kept is not None:
        ids[~kept, 1:] = -1          # pruned tokens have no routing behind the first layer
    tr = Trace(topk_ids=ids, token_step=ts, num_experts=E, kept=kept)
    whole = tr.groups()
    for chunk in (1, 7, 64):
        monkeypatch.setattr(trace_mod, "_CHUNK_SLOTS", chunk)
        part = tr.groups()
        for f in ("step", "layer", "ptr", "expert", "expert_tokens", "step_tokens",
                  "layer_tokens"):
            a, b = getattr(whole, f), getattr(part, f)
            assert a.dtype == b.dtype and np.array_equal(a, b), (chunk, f)
    # and against a direct count
    g = whole
    for i in range(g.num_groups):
        s, lay = g.step[i], g.layer[i]
        rows = ids[ts == s, lay]
        want = np.unique(rows[rows >= 0], return_counts=True)
        sl = slice(g.ptr[i], g.ptr[i + 1])
        assert g.expert[sl].tolist() == want[0].tolist()
        assert g.expert_tokens[sl].tolist() == want[1].tolist()


def test_trace_refuses_ids_that_would_wrap_around():
    with pytest.raises(InputError, match=r"trace expert id 65537 at token 0, layer 0, rank 1 is "
                                         r"outside -1\.\.7"):
        Trace(topk_ids=np.array([[[1, 65537]]]), token_step=[0], num_experts=8)
    with pytest.raises(InputError, match=r"trace num_experts must be an integer in 1\.\.32767"):
        Trace(topk_ids=np.zeros((1, 1, 1), int), token_step=[0], num_experts=10**9)
    with pytest.raises(InputError, match=r"trace token_step must hold integers, got dtype "
                                         r"float64"):
        Trace(topk_ids=np.zeros((2, 1, 1), int), token_step=[0, 0.5], num_experts=1)
    with pytest.raises(InputError, match=r"trace step_request 4294967296 at axis 0 0 is outside"):
        Trace(topk_ids=np.zeros((1, 1, 1), int), token_step=[0], num_experts=1,
              step_request=np.array([2**32]))


def test_store_dataset_declaring_huge_arrays_is_refused_before_reading():
    da = pytest.importorskip("dask.array")
    import xarray as xr

    T = 10**9
    ds = xr.Dataset({"topk_ids": (("token", "layer", "k"), da.zeros((T, 32, 8), dtype=np.int16)),
                     "token_step": (("token",), da.zeros(T, dtype=np.int32))})
    with pytest.raises(InputError, match=r"run dataset: its routing arrays \(token 1000000000, "
                                         r"layer 32, k 8\) need 481 GiB of memory, more than "
                                         r"the memory budget of 2 GiB"):
        from_store(ds)


# -- the command line: one line, exit 2 ------------------------------------------------------------
@pytest.mark.parametrize("name, content, fragment", [
    ("huge.jsonl", jl(token_idx=10**9), "more than the memory budget"),
    ("bad.jsonl", b"\xff\xfe\n", "is not UTF-8 text"),
    ("garbage.npy", b"not numpy at all", "is not a .npy file"),
    ("big.wbtrace", "wbtrace\tversion=1\tlayers=32767\texperts=8\ttop_k=32767\n"
     "0\t0\tdecode\ttext\t" + "\t".join(["-"] * 32767) + "\n", "more than the memory budget"),
])
def test_cli_replay_of_a_hostile_trace_is_one_line_and_exit_2(tmp_path, capsys, name, content,
                                                              fragment):
    from workbench.cli import main

    p = tmp_path / name
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["replay", str(p)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("workbench: error: ") and fragment in err[0]
    assert str(p) in err[0]


TINY_HUGE_KEYS = {
    "tiny.jsonl": b'{"layer":4095,"token_idx":0,"experts":[32766]}\n',
    "tiny.wbtrace": b"wbtrace\tversion=1\tlayers=4096\texperts=32767\ttop_k=1\n",
}


def _tiny_npy(path):
    a = np.full((1, 4096, 1), -1, np.int16)
    a[0, 0, 0] = 32766
    np.save(path, a)


@pytest.mark.parametrize("name", [*TINY_HUGE_KEYS, "tiny.npy"])
def test_a_tiny_file_declaring_huge_ids_replays_in_little_memory(tmp_path, capsys, name):
    """A 52-byte .jsonl, an 8 KB .npy or a .wbtrace header declaring layer 4095 / expert 32766
    made replay allocate 8.4 GB (issue 26): its state now follows the ids in use."""
    from workbench.cli import main
    from workbench.replay import as_trace

    p = tmp_path / name
    if name == "tiny.npy":
        _tiny_npy(p)
    else:
        p.write_bytes(TINY_HUGE_KEYS[name])
    trace = as_trace(p, num_experts=32767) if name == "tiny.npy" else as_trace(p)
    assert trace.num_layers * trace.num_experts > 2**20  # as declared
    small = trace.compact_experts()
    from workbench.replay.engine import replay_bytes

    assert replay_bytes(small, "fast", "belady") < 100 * 2**20
    assert replay_bytes(small, "python") < 100 * 2**20
    assert main(["replay", str(p), "--json"] + (["--num-experts", "32767"]
                                                  if name == "tiny.npy" else [])) == 0
    capsys.readouterr()


def test_replay_state_beyond_the_budget_is_refused_before_allocating(tmp_path, monkeypatch):
    """Replay state (per step × layer) is checked against the trace memory budget first."""
    from workbench.replay import replay_trace

    a = np.zeros((20_000, 64, 1), np.int16)  # 20 000 steps × 64 layers: ≈ 120 MiB of state
    np.save(tmp_path / "long.npy", a)
    monkeypatch.setenv("WORKBENCH_TRACE_MAX_BYTES", "64MiB")
    with pytest.raises(InputError) as e:
        replay_trace(tmp_path / "long.npy", belady=False)
    msg = str(e.value)
    assert "replay" in msg and "20,000 steps × 64 layers" in msg and "WORKBENCH_TRACE_MAX_BYTES" \
        in msg, msg


@pytest.mark.parametrize("fmt", ["npy", "wbtrace", "jsonl", "python"])
def test_a_repeated_expert_in_a_tokens_top_k_is_refused_in_every_format(tmp_path, fmt):
    """Refused only in .jsonl before (issue 26); .npy, .wbtrace and stores counted the expert
    twice in replay. One rule, in Trace itself: a token's experts at a layer are distinct."""
    from workbench.replay import as_trace
    from workbench.traces.trace import Trace

    if fmt == "python":
        with pytest.raises(InputError, match=r"token 1, layer 0: expert ids \[3, 3\] repeat"):
            Trace(topk_ids=np.array([[[1, 2]], [[3, 3]]]), token_step=np.array([0, 1]),
                  num_experts=4)
        Trace(topk_ids=np.array([[[-1, -1]]]), token_step=np.array([0]), num_experts=4)
        return
    p = tmp_path / f"t.{fmt}"
    if fmt == "npy":
        np.save(p, np.array([[[1, 2]], [[3, 3]]], np.int32))
    elif fmt == "wbtrace":
        p.write_text("wbtrace\tversion=1\tlayers=1\texperts=4\ttop_k=2\n"
                     "0\t0\tprefill\ttext\t1,2\n1\t0\tdecode\ttext\t3,3\n")
    else:
        p.write_text('{"layer":0,"token_idx":0,"experts":[3,3]}\n')
    with pytest.raises(InputError, match="repeat"):
        as_trace(p, num_experts=4) if fmt == "npy" else as_trace(p)


@pytest.mark.parametrize("fmt", ["python", "wbtrace", "jsonl"])
def test_infinite_weights_are_refused_in_every_format(tmp_path, fmt):
    """One rule for weights (issue 26): finite, or NaN (none recorded); ±inf refused by every
    format alike (the JSON-lines reader refused it, .wbtrace and Python traces passed it on)."""
    from workbench.replay import as_trace
    from workbench.traces.trace import Trace

    if fmt == "python":
        with pytest.raises(InputError, match=r"token 1, layer 0, rank 0: weight -inf is not"):
            Trace(topk_ids=np.array([[[0, 1]], [[2, 1]]]), token_step=[0, 1], num_experts=3,
                  topk_weights=np.array([[[0.5, 0.5]], [[-np.inf, 1.0]]], np.float32))
        return
    p = tmp_path / f"t.{fmt}"
    if fmt == "wbtrace":
        p.write_text("wbtrace\tversion=1\tlayers=1\texperts=4\ttop_k=2\n"
                     "0\t0\tprefill\ttext\t1:0.5,2:inf\n")
        with pytest.raises(InputError, match="not finite"):
            as_trace(p)
    else:
        p.write_text('{"layer":0,"token_idx":0,"experts":[1,2],"gating_probs":[0.5,1e39]}\n')
        with pytest.raises(InputError, match="not a finite"):
            as_trace(p)
