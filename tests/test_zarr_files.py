"""The run store's direct writer produces arrays that zarr itself reads back exactly."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import given, settings, strategies as st

from workbench.telemetry import zarr_files


def _store(root: Path, dtype: str, chunk: int, tail: tuple[int, ...], capacity: int,
           compressors="auto") -> zarr_files.AppendArray:
    def build(group: zarr.Group) -> None:
        zarr_files.create_arrays(group, {"x": dict(shape=(capacity, *tail), chunks=(chunk, *tail),
                                                   dtype=dtype, fill_value=0,
                                                   compressors=compressors)})

    files = zarr_files.layout_template(("test", dtype, chunk, tail, capacity, str(compressors)),
                                       build)
    zarr_files.materialize(root, files)
    return zarr_files.AppendArray(root, "x", json.loads(files["x/zarr.json"]))


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(["int8", "int16", "int32", "int64", "float32", "float64", "bool"]),
       chunk=st.integers(1, 9), tail=st.sampled_from([(), (3,), (2, 4)]),
       appends=st.lists(st.integers(0, 13), min_size=1, max_size=8),
       compressed=st.booleans())
def test_appends_read_back_by_zarr(dtype, chunk, tail, appends, compressed):
    total = sum(appends)
    rng = np.random.default_rng(total)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "s.zarr"
        arr = _store(root, dtype, chunk, tail, capacity=max(total, 1) + 5,
                     compressors="auto" if compressed else None)
        parts, pos = [], 0
        for n in appends:
            data = (rng.integers(-50, 50, (n, *tail)) if dtype != "bool"
                    else rng.integers(0, 2, (n, *tail))).astype(dtype)
            arr.write(pos, data)
            parts.append(data)
            pos += n
            # a reader in between appends sees every row written so far
            got = zarr.open_array(str(root / "x"), mode="r")[:pos]
            np.testing.assert_array_equal(got, np.concatenate(parts) if parts else got)
        arr.resize(total)
        z = zarr.open_array(str(root / "x"), mode="r")
        assert z.shape == (total, *tail)
        np.testing.assert_array_equal(z[:], np.concatenate(parts).astype(dtype))
        assert not list(root.rglob("*.tmp"))  # no temp files left behind


def test_write_past_capacity_is_refused(tmp_path):
    arr = _store(tmp_path / "s.zarr", "int32", 4, (), capacity=6)
    with pytest.raises(ValueError, match="past the end"):
        arr.write(4, np.arange(3, dtype=np.int32))


def test_unsupported_codec_is_refused(tmp_path):
    def build(group: zarr.Group) -> None:
        zarr_files.create_arrays(group, {"x": dict(shape=(8,), chunks=(4,), dtype="int32",
                                                   compressors=zarr.codecs.BloscCodec())})

    files = zarr_files.layout_template(("test-blosc",), build)
    with pytest.raises(ValueError, match="unsupported codec 'blosc'"):
        zarr_files.AppendArray(tmp_path, "x", json.loads(files["x/zarr.json"]))
