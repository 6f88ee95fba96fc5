"""Training checkpoints of the v2 embedded model: everything a run needs to continue bit for bit.

A checkpoint is a folder ``step-NNNNNNN`` (the optimizer steps run so far, over all stages)
inside the run's checkpoint directory, written as ``.step-NNNNNNN.partial`` and renamed into
place whole, so a crash at any instant leaves the previous checkpoint intact. It holds:

- ``weights.safetensors``: the model's and the training probe's tensors (float32);
- ``optimizer.safetensors`` + the ``optimizer`` entry of ``state.json``: the stage's AdamW state
  (per-parameter moments and step counts) and its parameter groups;
- ``rng.safetensors``: torch's CPU (and CUDA) generator states;
- ``state.json``: where the run is (stage, step), the data stream's and numpy's and Python's RNG
  states, the curves so far and the arguments' fingerprint a resume must match.

No pickle anywhere: tensors go through safetensors, the rest through JSON.

:func:`read` checks a checkpoint's files and their form (JSON depth-limited, tensors readable,
optimizer keys well formed); the trainer checks that it fits the run (names, shapes, dtypes,
finiteness, counters in range) before resuming. A write that fails (disk full, file too large)
raises :class:`CheckpointError`, leaves no partial folder and the previous checkpoint as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from workbench import jsonio
from workbench.ownedfolder import io_reason
from workbench.errors import WorkbenchError

FORMAT = 1
STEP_FOLDER = re.compile(r"^step-(\d{7})$")
_MOMENT = re.compile(r"^(\d{1,9})\.([A-Za-z_]{1,40})$")
MAX_STATE_BYTES = 64 * 2**20
"""``state.json`` larger than this is refused before reading (curves of a long run are < 1 MB)."""


class CheckpointError(WorkbenchError, ValueError):
    """A checkpoint folder that cannot be resumed from; the message names it and why."""


def checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:07d}"


def latest(root: Path) -> Path | None:
    """The newest complete checkpoint in ``root`` (``None`` when it holds none)."""
    if not root.is_dir():
        return None
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_FOLDER.match(p.name)) and p.is_dir())
    return found[-1][1] if found else None


def write(root: Path, global_step: int, tensors: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
          state: dict, keep: int = 2) -> Path:
    """Write a checkpoint of ``global_step`` into ``root`` (created if absent); keep the newest
    ``keep`` checkpoints. Returns the new folder."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(global_step)
    staging = root / f".{final.name}.partial"
    try:
        if staging.exists():
            shutil.rmtree(staging)  # left by a crash mid-write
        staging.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, staging / "weights.safetensors")
        opt = optimizer.state_dict()
        moments = {f"{index}.{key}": value.detach().contiguous().cpu()
                   for index, per_param in opt["state"].items() for key, value in per_param.items()
                   if isinstance(value, torch.Tensor)}
        save_file(moments, staging / "optimizer.safetensors")
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        save_file(rng, staging / "rng.safetensors")
        document = {"format": FORMAT, "global_step": global_step,
                    "optimizer": {"param_groups": opt["param_groups"]}, **state}
        (staging / "state.json").write_text(json.dumps(document))
        for path in staging.iterdir():  # the data reaches the disk before the rename publishes it
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except (OSError, SafetensorError) as e:  # disk full, file too large: one message, no partial folder
        shutil.rmtree(staging, ignore_errors=True)
        before = latest(root)
        raise CheckpointError(
            f"checkpoint {str(final)!r} could not be written ({io_reason(e)}); "
            + (f"the previous checkpoint {str(before)!r} is intact (--resume {str(root)!r} continues from it)"
               if before is not None else "no earlier checkpoint exists")) from None
    older = sorted(p for p in root.iterdir() if STEP_FOLDER.match(p.name) and p != final)
    for old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old)
    return final


def read(folder: Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor], dict]:
    """``(tensors, optimizer state_dict, rng tensors, state)`` of a checkpoint folder;
    :class:`CheckpointError` names what is missing or malformed."""
    for name in ("weights.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json"):
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint {str(folder)!r} has no {name}; expected a folder written by "
                                  f"--checkpoint-dir")
    size = (folder / "state.json").stat().st_size
    if size > MAX_STATE_BYTES:
        raise CheckpointError(f"checkpoint {str(folder)!r}: state.json is {size} bytes, over {MAX_STATE_BYTES}")
    try:
        state = jsonio.loads((folder / "state.json").read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {str(folder)!r}: state.json is not JSON ({e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {str(folder)!r}: state.json is not a format-{FORMAT} training state")
    for key, kind in (("optimizer", dict), ("rng", dict), ("global_step", int)):
        if not isinstance(state.get(key), kind) or isinstance(state.get(key), bool):
            raise CheckpointError(f"checkpoint {str(folder)!r}: state.json entry {key!r} is "
                                  f"{'missing' if key not in state else repr(state[key])[:60]}; a "
                                  f"{'mapping' if kind is dict else 'integer'} is expected")
    groups = state["optimizer"].get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise CheckpointError(f"checkpoint {str(folder)!r}: state.json entry 'optimizer.param_groups' is not a "
                              f"list of mappings")
    try:
        tensors = load_file(folder / "weights.safetensors")
        moments = load_file(folder / "optimizer.safetensors")
        rng = load_file(folder / "rng.safetensors")
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise CheckpointError(f"checkpoint {str(folder)!r}: unreadable tensors ({e})") from None
    per_param: dict[int, dict] = {}
    for key, value in moments.items():
        m = _MOMENT.match(key)
        if m is None:
            raise CheckpointError(f"checkpoint {str(folder)!r}: optimizer.safetensors entry {key[:60]!r} is not "
                                  f"'<parameter index>.<name>'")
        per_param.setdefault(int(m.group(1)), {})[m.group(2)] = value
    optimizer = {"state": per_param, "param_groups": groups}
    return tensors, optimizer, rng, state

