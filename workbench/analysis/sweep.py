"""Knob sweeps on Dask distributed: every point of a grid × inputs, each its own run store.

Layout of a sweep folder ``OUT``::

    OUT/points/<id>.zarr    the run store of one point (written by the worker that ran it)
    OUT/points/<id>.json    the point's outcome: knobs, input, status, result or error
                            (written last, atomically: its presence with status "complete"
                            is what marks a point finished)
    OUT/summary.zarr        the summary Dataset, dims = the grid's knobs + input

Workers only ever write their own point's files, and only the client writes the summary, so no
two processes touch the same zarr metadata. Re-running the same sweep skips finished points; a
failed point is recorded with its error and the sweep goes on; Ctrl-C cancels what is in flight
and leaves every finished point intact. An outcome file that cannot be read (garbage JSON, not
an object, a directory) counts as not done: the point runs again.

Everything that can be checked is checked before a cluster starts, each failure an
:class:`~workbench.errors.InputError` or :class:`~workbench.errors.KnobError` naming the thing:
the grid (known knobs, valid and distinct values, at most :data:`MAX_SWEEP_POINTS` points), every
point's knobs, the inputs' images (header only), the model directory, the ``out`` folder (a
folder, new or a previous sweep's, writable) and ``scheduler``: a ``tcp://HOST:PORT`` address
where a Dask scheduler must answer within :data:`SCHEDULER_TIMEOUT_S` seconds (connect and
handshake; Dask's own default waits 30 s, and a silent port forever).
"""

from __future__ import annotations

import gc
import hashlib
import ipaddress
import itertools
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import xarray as xr

from workbench import jsonio
from workbench.errors import InputError, KnobError, WorkbenchError
from workbench.fileio import read_text
from workbench.errors import one_line as _one_line  # the shared one, under its old name here
from workbench.knobs import Knobs

#: seconds a sweep waits for a ``scheduler`` to accept the connection and answer as a Dask
#: scheduler (Dask's default connect timeout is 30 s, and a port that accepts but never answers
#: would hang it for good)
SCHEDULER_TIMEOUT_S = 5.0
#: most points (grid × inputs) a sweep takes
MAX_SWEEP_POINTS = 10_000
#: most LocalCluster worker processes
MAX_WORKERS = 256

#: result fields gathered into the summary (all from :class:`RunResult`)
SUMMARY_FIELDS = ("hit_rate", "hits", "misses", "loads", "evictions", "host_runs", "steps",
                  "latency_measured_s", "latency_modeled_s", "stall_measured_s",
                  "stall_modeled_s", "transfer_bytes", "transfer_bytes_modeled")


@dataclass(frozen=True)
class SweepInput:
    """One input of a sweep: a name (summary coordinate), a prompt and image paths; ``batch``
    > 1 runs it together with ``batch`` − 1 generated held-out requests of ``mix``
    (:func:`workbench.batch`), the way the dashboard's batch does."""

    name: str
    prompt: str
    images: tuple[str, ...] = ()
    batch: int = 1
    mix: str = "mixed"

    def batched(self, batch: int, mix: str = "mixed") -> "SweepInput":
        """This input in a batch of ``batch`` (its name says so when > 1)."""
        from workbench.models.batches import check_batch_size

        check_batch_size(batch, "heldout", mix)
        name = self.name if batch == 1 else f"{self.name} (batch of {batch}, {mix})"
        return SweepInput(name=name, prompt=self.prompt, images=self.images, batch=int(batch),
                          mix=mix)

    @classmethod
    def parse(cls, text: str) -> "SweepInput":
        """``"PROMPT"`` or ``"IMAGE[,IMAGE…]|PROMPT"`` (the CLI's ``--input``). The part
        before the first ``|`` is taken for images only when each of its comma-separated
        names is an existing file or ends in an image suffix; otherwise the whole text is the
        prompt (a text prompt may contain ``|``)."""
        images, prompt = (), text
        if "|" in text:
            imgs, rest = text.split("|", 1)
            names = tuple(i.strip() for i in imgs.split(",") if i.strip())
            if names and all(_looks_like_image(n) for n in names):
                images, prompt = names, rest
        if not prompt.strip():
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise InputError(f"--input {shown!r} has an empty prompt; use 'IMAGE|PROMPT' or "
                             f"'PROMPT'")
        name = (Path(images[0]).stem + ": " if images else "") + prompt.strip()
        return cls(name=name, prompt=prompt.strip(), images=images)


#: suffixes that make the part before ``|`` of an input an image list
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff", ".ppm",
                  ".mpo")


def _looks_like_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES) or Path(name).is_file()


def demo_inputs(n: int = 2, text_only: bool = False) -> list[SweepInput]:
    """``n`` bundled demo requests, the default inputs of a sweep: image and text-only requests
    in turn (``text_only``: text-only ones, for a text-only model), each the one with the
    longest expected answer left (ties: demo order). A cache is exercised by decoding: a
    one-word answer is one decode step after the prefill, and its hit rate is ≈ 0 at any
    useful cache size, so the first demos (one-word answers) made every point of a default
    sweep read 0 (issue 25)."""
    from workbench.models.embedded.demo import read_demo

    demos = read_demo()
    by_len = lambda d: -len(str(d.get("answer") or "").split())  # noqa: E731
    image = [] if text_only else sorted((d for d in demos if d["image"]), key=by_len)
    text = sorted((d for d in demos if not d["image"]), key=by_len)
    picked = []
    while len(picked) < n and (image or text):
        for pool in (image, text):
            if pool and len(picked) < n:
                picked.append(pool.pop(0))
    return [SweepInput(name=(f"{Path(i['image']).stem}: " if i["image"] else "") + i["prompt"],
                       prompt=i["prompt"], images=(i["image"],) if i["image"] else ())
            for i in picked]


def parse_grid(assignments: Iterable[str]) -> dict[str, list[Any]]:
    """``["cache_slots=8,16", "eviction=lru,lfu"]`` → typed, validated value lists."""
    from workbench.knobs import parse_text

    grid: dict[str, list[Any]] = {}
    probe = Knobs()
    for a in assignments:
        if "=" not in a:
            raise KnobError(f"--grid expects NAME=V1,V2,…, not {a!r}")
        name, values = a.split("=", 1)
        name = name.strip()
        owner = probe._owner(name)
        if name in grid:
            raise KnobError(f"--grid names {name!r} twice")
        vals = [parse_text(owner.param[name], name, v) for v in values.split(",") if v.strip()]
        if not vals:
            raise KnobError(f"--grid {name} has no values")
        for v in vals:
            probe.set(**{name: v})  # validates each value against the knob's bounds
        grid[name] = [getattr(probe.set(**{name: v}), name) for v in vals]  # normalised
        _check_distinct(name, grid[name])
    if not grid:
        raise KnobError("a sweep needs at least one --grid NAME=V1,V2,…")
    return grid


def _check_distinct(name: str, values: Sequence[Any]) -> None:
    seen: list[Any] = []
    for v in values:
        if any(v == w and type(v) is type(w) for w in seen):
            raise KnobError(f"--grid {name} lists {v!r} twice; give each value once")
        seen.append(v)


def check_grid(grid: Any, base: Knobs, n_inputs: int) -> dict[str, list[Any]]:
    """The grid of the Python API checked like :func:`parse_grid` checks the CLI's: a non-empty
    mapping of knob names to non-empty lists of distinct valid values; at most
    :data:`MAX_SWEEP_POINTS` points with ``n_inputs`` inputs."""
    if not isinstance(grid, dict) or not grid:
        raise KnobError(f"a sweep grid must be a non-empty mapping of knob names to value lists "
                        f"(e.g. {{'cache_slots': [16, 32]}}), not {str(grid)[:60]!r}")
    out: dict[str, list[Any]] = {}
    for name, values in grid.items():
        if not isinstance(name, str):
            raise KnobError(f"grid knob names must be text, not {name!r}")
        base._owner(name)  # unknown knob → KnobError listing the known ones
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
            raise KnobError(f"grid values of {name} must be a list, not {str(values)[:60]!r}")
        values = list(values)
        if not values:
            raise KnobError(f"grid {name} has no values")
        probe = base.copy()
        out[name] = [getattr(probe.set(**{name: v}), name) for v in values]
        _check_distinct(name, out[name])
    n = math.prod(len(v) for v in out.values()) * max(n_inputs, 1)
    if n > MAX_SWEEP_POINTS:
        raise InputError(f"the sweep has {n:,} points (grid × {n_inputs} inputs); at most "
                         f"{MAX_SWEEP_POINTS:,} are allowed: split it into several sweeps")
    return out


def check_out(out: str | Path) -> Path:
    """``out`` as a sweep folder: a new folder whose nearest existing parent is a writable
    folder, or an existing folder that is empty or holds a previous sweep (``points/``).
    Nothing is created here."""
    text = os.fspath(out) if isinstance(out, (str, os.PathLike)) else None
    if text is None or not text.strip():
        raise InputError(f"the sweep folder (--out) must be a path, not {out!r}")
    if "\x00" in text:
        raise InputError(f"the sweep folder (--out) {text!r} contains a NUL character")
    from workbench.telemetry.destination import follow_link

    label = f"sweep folder (--out) {text!r}"
    out = follow_link(Path(text), "the sweep folder (--out)")
    try:
        if out.exists():
            if not out.is_dir():
                raise InputError(f"{label} is a file, not a folder; give a new folder or the "
                                 f"folder of a previous sweep")
            pts = out / "points"
            if pts.exists() and not pts.is_dir():
                raise InputError(f"{label} has a 'points' that is not a folder, so it is not "
                                 f"a sweep folder; give a new folder")
            if not pts.exists() and any(out.iterdir()):
                raise InputError(f"{label} already holds other files and is not a sweep folder "
                                 f"(no points/); give a new folder or a previous sweep's")
            target = pts if pts.exists() else out
            if not os.access(target, os.W_OK | os.X_OK):
                raise InputError(f"{label} is not writable (permission denied)")
        else:
            parent = out.parent
            while not parent.exists() and parent != parent.parent:
                parent = parent.parent
            if not parent.is_dir():
                raise InputError(f"{label} cannot be created: {str(parent)!r} is a file, not a "
                                 f"folder")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise InputError(f"{label} cannot be created: {str(parent)!r} is not writable "
                                 f"(permission denied)")
    except OSError as e:
        raise InputError(f"{label} cannot be used: {_one_line(e)}") from None
    return out


def _make_out(out: Path) -> None:
    """Create ``out/points`` and prove it writable (a read-only file system, a full disk…)."""
    label = f"sweep folder (--out) {str(out)!r}"
    try:
        (out / "points").mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out / "points", prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except PermissionError:
        raise InputError(f"{label} cannot be written: permission denied") from None
    except OSError as e:
        raise InputError(f"{label} cannot be written: {_one_line(e)}") from None


_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")


def check_scheduler(address: str, timeout: float = SCHEDULER_TIMEOUT_S) -> str:
    """The ``tcp://HOST:PORT`` form of ``address`` (``HOST:PORT`` is taken as tcp) once a Dask
    scheduler there has answered within ``timeout`` seconds; else :class:`InputError` naming
    the address and what went wrong."""
    shown = repr(address)
    if not isinstance(address, str) or not address.strip():
        raise InputError(f"--scheduler {shown} is not an address; give tcp://HOST:PORT (e.g. "
                         f"tcp://127.0.0.1:8786)")
    addr = address.strip()
    scheme, _, loc = addr.rpartition("://") if "://" in addr else ("tcp", "", addr)
    if scheme != "tcp":
        raise InputError(f"--scheduler {shown}: only tcp://HOST:PORT addresses are supported, "
                         f"not {scheme}:// (tls, ws and ucx need a security or transport setup "
                         f"the sweep does not make)")
    from distributed.comm.addressing import parse_host_port

    try:
        host, port = parse_host_port(loc)
    except (ValueError, TypeError) as e:
        raise InputError(f"--scheduler {shown} is not HOST:PORT ({_one_line(e)}); e.g. "
                         f"tcp://127.0.0.1:8786") from None
    valid_host = bool(_HOST.match(host))
    if not valid_host:
        try:
            ipaddress.ip_address(host)
            valid_host = True
        except ValueError:
            pass
    if not valid_host:
        raise InputError(f"--scheduler {shown}: {host!r} is not a host name or IP address")
    if not 1 <= int(port) <= 65535:
        raise InputError(f"--scheduler {shown}: port {port} is not between 1 and 65535")
    norm = f"tcp://{'[' + host + ']' if ':' in host else host}:{int(port)}"
    result: dict[str, Any] = {}

    def probe() -> None:
        import asyncio
        import socket

        try:  # a plain connect first: refused or unresolvable is said at once, not after retries
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            result["error"] = e
            return

        async def ask() -> Any:
            from distributed.comm import connect

            comm = await connect(norm, timeout=timeout)
            try:
                await comm.write({"op": "identity", "reply": True})
                return await comm.read()
            finally:
                comm.abort()

        async def bounded() -> Any:
            return await asyncio.wait_for(ask(), timeout)

        try:
            result["reply"] = asyncio.run(bounded())
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            result["error"] = e

    t = threading.Thread(target=probe, name="workbench-scheduler-probe", daemon=True)
    t.start()
    t.join(timeout + 1.0)
    where = f"the Dask scheduler at {norm} (--scheduler {shown})"
    err = result.get("error")
    if t.is_alive() or isinstance(err, TimeoutError):
        raise InputError(f"no answer from {where} within {timeout:g} s: is it running, and is "
                         f"the address right?")
    import socket

    if isinstance(err, socket.gaierror):
        raise InputError(f"cannot reach {where}: host {host!r} does not resolve "
                         f"({_one_line(err, 120)})")
    if isinstance(err, ConnectionRefusedError):
        raise InputError(f"cannot reach {where}: connection refused (nothing listens on port "
                         f"{port} of {host})")
    if isinstance(err, OSError) or type(err).__name__ in ("CommClosedError",):
        raise InputError(f"cannot reach {where}: {_one_line(err, 200)}")
    if err is not None:
        raise InputError(f"{where} is not a Dask scheduler: it answered with something other "
                         f"than the Dask protocol ({type(err).__name__})")
    reply = result.get("reply")
    if not isinstance(reply, dict) or reply.get("type") != "Scheduler":
        kind = reply.get("type") if isinstance(reply, dict) else type(reply).__name__
        raise InputError(f"{where} answered, but is not a Dask scheduler (it says {kind!r})")
    return norm


#: largest outcome file of a sweep point read (a real one is a few kB)
MAX_OUTCOME_BYTES = 16 * 1024 * 1024


def read_outcome(meta: str | Path) -> dict[str, Any] | None:
    """A point's outcome file, or ``None`` when it is missing or unreadable (garbage JSON, not
    an object, no status, a complete point without a result): such a point is not done."""
    try:
        o = jsonio.loads(read_text(meta, MAX_OUTCOME_BYTES, "outcome"))
    except (OSError, ValueError, InputError):  # a FIFO or a sparse giant is "not done" too
        return None
    if not isinstance(o, dict) or not isinstance(o.get("status"), str):
        return None
    if o["status"] == "complete" and not isinstance(o.get("result"), dict):
        return None
    return o


def point_id(knobs: dict[str, Any], inp: SweepInput) -> str:
    what: list[Any] = [inp.prompt, list(inp.images)]
    if inp.batch > 1:  # (a batch of one keeps the ids of sweeps before batches)
        what += [inp.batch, inp.mix]
    key = json.dumps({"knobs": knobs, "input": what}, sort_keys=True)
    return "p-" + hashlib.sha256(key.encode()).hexdigest()[:12]


# -- the work of one point (runs in a Dask worker process) --------------------------------------
_MODELS: dict[tuple[str, str, str], Any] = {}


def run_point(model_dir: str | None, knobs: dict[str, Any], prompt: str, images: Sequence[str],
              store: str, meta: str, point: dict[str, Any]) -> dict[str, Any]:
    """Run one point and write its outcome file; never raises for a point's own failure."""
    import torch

    from workbench.models.loading import load
    from workbench.runtime.runtime import Runtime

    torch.set_num_threads(1)  # one worker = one core; the cluster provides the parallelism
    outcome = dict(point)
    try:
        key = (model_dir or "", knobs["dtype"], knobs["device"])
        if key not in _MODELS:
            _MODELS[key] = load(model_dir, dtype=knobs["dtype"], device=knobs["device"])
        rt = Runtime(_MODELS[key], knobs=Knobs(**knobs))
        if int(point.get("batch", 1)) > 1:
            from workbench.models.batches import batch
            from workbench.models.inputs import Request

            requests = [Request(prompt, list(images)),
                        *batch(int(point["batch"]) - 1, mix=point.get("mix", "mixed"))]
            res = rt.run(requests, store=store, overwrite=True)
        else:
            res = rt.run(prompt, images=list(images), store=store, overwrite=True)
        outcome.update(status="complete", result=res.to_json())
    except Exception as e:  # a failed point is data, not a crash of the sweep
        outcome.update(status="failed", error=f"{type(e).__name__}: {e}")
    return _write_outcome(meta, outcome)


# -- the client side ---------------------------------------------------------------------------
def check_points(model: str | Path | None, points: Sequence[dict[str, Any]],
                 local: bool = True, refuse_all: bool = True) -> dict[str, WorkbenchError]:
    """Apply to every point's knobs the up-front checks ``workbench run`` applies (the
    :class:`~workbench.runtime.runtime.Runtime` constructor's: knobs against the model's MoE
    layout, live-only policies, the predictor folder, the memory plan), before any cluster
    starts. Returns ``{point id: error}`` of the refused points (a failed point is data: the
    sweep records it and runs the others); when *every* point is refused (and ``refuse_all``:
    the sweep has no finished point either), raises the first one's error (same class,
    prefixed with the point's grid values), as ``workbench run`` would.

    The model is loaded here once per (dtype, device) of the points, as each worker loads it,
    and let go afterwards (``local=False``, a remote scheduler whose workers may have devices
    this machine lacks: on the CPU)."""
    if not points:
        return {}
    from workbench.models.loading import load
    from workbench.runtime.runtime import Runtime

    from workbench.knobs import ModelShape

    models: dict[tuple[str, str], Any] = {}
    by_knobs: dict[str, WorkbenchError | None] = {}
    refused: dict[str, WorkbenchError] = {}
    for point in points:  # first what needs no model (as `workbench run` before it loads)
        key = json.dumps(point["knobs"], sort_keys=True, default=str)
        if key not in by_knobs:
            try:
                Knobs(**point["knobs"]).check(ModelShape.unknown(), live=True)
            except WorkbenchError as e:
                by_knobs[key] = e
    try:
        for point in points:
            k = point["knobs"]
            key = json.dumps(k, sort_keys=True, default=str)
            if key not in by_knobs:  # else: refused already, or the same knobs for another
                # input (a sweep whose points all fail without a model loads none)
                mk = (k["dtype"], k["device"] if local else "cpu")
                if mk not in models:
                    models[mk] = load(model, dtype=mk[0], device=mk[1])
                try:
                    Runtime(models[mk], knobs=Knobs(**k))
                    by_knobs[key] = None
                except WorkbenchError as e:
                    by_knobs[key] = e
            if by_knobs[key] is not None:
                refused[point["id"]] = by_knobs[key]
    finally:
        models.clear()
        gc.collect()  # the client holds no model while the workers load theirs
    if refuse_all and len(refused) == len(points):
        first = points[0]
        e = refused[first["id"]]
        where = ", ".join(f"{n}={v!r}" for n, v in first["grid"].items())
        msg = (f"every sweep point is refused before it runs; the first, {where}: {e}"
               if len(points) > 1 else f"sweep point {where}: {e}")
        try:
            err = type(e)(msg)
        except Exception:  # a subclass with another constructor
            err = KnobError(msg)
        raise err from None
    return refused


def _write_outcome(meta: str | Path, outcome: dict[str, Any]) -> dict[str, Any]:
    """Write a point's outcome file atomically; a failure to write is recorded in the
    outcome (the client still gets it)."""
    try:
        target = Path(meta)
        if target.is_dir():  # a stray folder where the outcome belongs
            shutil.rmtree(target)
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(outcome))
        os.replace(tmp, target)  # atomic: a point is finished exactly when this file says so
    except Exception as e:  # disk full, permissions: the client still gets the outcome
        outcome.update(status="failed",
                       error=f"the outcome file {str(meta)!r} could not be written: "
                             f"{type(e).__name__}: {e}")
    return outcome


def sweep(grid: dict[str, Sequence[Any]], inputs: Sequence[SweepInput] | None = None, *,
          out: str | Path, model: str | Path | None = None, knobs: Knobs | None = None,
          scheduler: str | None = None, workers: int | None = None,
          progress: bool = True, bar: bool | None = None) -> xr.Dataset:
    """Run every point of ``grid`` × ``inputs`` on Dask; returns the summary Dataset.

    ``progress``: say on stderr what a user should know (points refused, no workers yet) and,
    unless ``bar`` says otherwise, draw a progress bar of the points with an ETA there.

    ``scheduler`` is the address of an existing Dask scheduler; without it a LocalCluster of
    ``workers`` processes (default 2) on 127.0.0.1 is started and stopped.
    """
    from dask.distributed import Client, LocalCluster, as_completed

    if knobs is not None and not isinstance(knobs, Knobs):
        raise KnobError(f"knobs must be a workbench.Knobs, not {type(knobs).__name__}")
    base = (knobs.copy() if knobs is not None else Knobs())
    if inputs:
        inputs = [SweepInput.parse(i) if isinstance(i, str) else i for i in inputs]
    else:  # a text-only model gets the text-only demos
        from workbench.models.loading import takes_images

        inputs = demo_inputs(text_only=not takes_images(model))
    _check_inputs(inputs)
    grid = check_grid(grid, base, len(inputs))
    names = list(grid)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not 1 <= workers <= MAX_WORKERS):
        raise InputError(f"--workers must be an integer between 1 and {MAX_WORKERS}, not "
                         f"{workers!r}")
    if model is not None:
        from workbench.models.loading import check_model_dir

        check_model_dir(model)
    out = check_out(out)
    todo, done = [], {}
    for values in itertools.product(*(grid[n] for n in names)):
        k = base.copy(**dict(zip(names, values))).to_dict()  # every point's knobs, checked
        for inp in inputs:
            pid = point_id(k, inp)
            point = {"id": pid, "grid": dict(zip(names, values)), "knobs": k,
                     "input": inp.name, "prompt": inp.prompt, "images": list(inp.images),
                     **({"batch": inp.batch, "mix": inp.mix} if inp.batch > 1 else {})}
            prev = read_outcome(out / "points" / f"{pid}.json")
            if prev and prev.get("status") == "complete":
                done[pid] = prev
            else:
                todo.append((pid, point))
    address = check_scheduler(scheduler) if todo and scheduler is not None else None
    refused = check_points(model, [point for _, point in todo], local=address is None,
                           refuse_all=not done)
    _make_out(out)
    if refused:  # recorded as failed here, like a worker records a point that fails
        if progress:
            e = next(iter(refused.values()))
            print(f"workbench: {len(refused)} of {len(todo)} sweep points are refused before "
                  f"they run (e.g. {type(e).__name__}: {_one_line(e, 200)}); they are recorded "
                  f"as failed", file=sys.stderr)
        for pid, point in todo:
            if pid in refused:
                e = refused[pid]
                done[pid] = _write_outcome(out / "points" / f"{pid}.json", {
                    **point, "status": "failed", "error": f"{type(e).__name__}: {e}"})
        todo = [(pid, point) for pid, point in todo if pid not in refused]
    model_dir = str(Path(model).resolve()) if model is not None else None
    if todo:
        cluster = None
        try:
            if address is None:
                cluster = LocalCluster(n_workers=workers or 2, threads_per_worker=1,
                                       processes=True, host="127.0.0.1", dashboard_address=None)
            client = Client(address or cluster, timeout=SCHEDULER_TIMEOUT_S)
        except Exception as e:
            if cluster is not None:
                cluster.close()
            what = (f"the Dask scheduler at {address}" if address
                    else f"a local Dask cluster of {workers or 2} workers")
            raise InputError(f"could not start or reach {what}: {type(e).__name__}: "
                             f"{_one_line(e, 200)}") from None
        try:
            if address is not None and progress and not client.scheduler_info().get("workers"):
                print(f"workbench: the scheduler at {address} has no workers yet; points wait "
                      f"until one joins (Ctrl-C stops the sweep)", file=sys.stderr)
            futures = {client.submit(
                run_point, model_dir, point["knobs"], point["prompt"], point["images"],
                str(out / "points" / f"{pid}.zarr"), str(out / "points" / f"{pid}.json"),
                point, key=f"workbench-{pid}", pure=False): point for pid, point in todo}
            show_bar = progress if bar is None else bar
            bar = _progress(len(futures), len(done), show_bar)
            try:
                for fut in as_completed(list(futures)):
                    try:
                        res = fut.result()
                    except Exception as e:  # the worker died, or the task could not run
                        res = {**futures[fut], "status": "failed",
                               "error": f"{type(e).__name__}: {e}"}
                    done[res["id"]] = res
                    bar.update(1)
                    bar.set_postfix_str(f"failed {sum(d['status'] != 'complete' for d in done.values())}")
            except KeyboardInterrupt:
                client.cancel(list(futures))
                raise
            finally:
                bar.close()
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
    summary = summarize(out, grid, inputs, base)
    return summary


def _check_inputs(inputs: Sequence[Any]) -> None:
    """Every input a :class:`SweepInput` with a prompt and readable images (header only)."""
    from workbench.models.inputs import probe_image

    for inp in inputs:
        if not isinstance(inp, SweepInput):
            raise InputError(f"sweep inputs must be SweepInput objects or 'IMAGE|PROMPT' text, "
                             f"not {type(inp).__name__}")
        if not isinstance(inp.prompt, str) or not inp.prompt.strip():
            raise InputError(f"input {inp.name!r} has an empty prompt")
        for img in inp.images:
            try:
                probe_image(img)
            except InputError as e:
                raise InputError(f"input {inp.name!r}: {e}") from None


def _progress(total: int, already: int, enabled: bool):
    from workbench.progress import bar

    return bar(total, f"sweep ({already} already done)", unit="point", enabled=enabled)


def summarize(out: str | Path, grid: dict[str, Sequence[Any]], inputs: Sequence[SweepInput],
              base: Knobs | None = None) -> xr.Dataset:
    """Gather every point's outcome into ``OUT/summary.zarr`` (regenerated on each call)."""
    out = Path(out)
    base = base or Knobs()
    names = list(grid)
    shape = [len(grid[n]) for n in names] + [len(inputs)]
    dims = names + ["input"]
    data = {f: np.full(shape, np.nan) for f in SUMMARY_FIELDS}
    status = np.full(shape, "missing", dtype=object)
    error = np.full(shape, "", dtype=object)
    store = np.full(shape, "", dtype=object)
    for idx in itertools.product(*(range(n) for n in shape)):
        values = {n: grid[n][i] for n, i in zip(names, idx[:-1])}
        inp = inputs[idx[-1]]
        pid = point_id(base.copy(**values).to_dict(), inp)
        meta = out / "points" / f"{pid}.json"
        if not meta.exists():
            continue
        o = read_outcome(meta)
        if o is None:
            status[idx] = "failed"
            error[idx] = f"the outcome file points/{pid}.json is unreadable"
            continue
        status[idx] = o["status"]
        error[idx] = str(o.get("error", ""))
        if o["status"] == "complete":
            store[idx] = str(Path("points") / f"{pid}.zarr")
            for f in SUMMARY_FIELDS:
                data[f][idx] = _number(o["result"].get(f))
    coords = {n: _coord(grid[n]) for n in names}
    coords["input"] = _vstr(np.array([i.name for i in inputs], dtype=object))
    ds = xr.Dataset({f: (dims, v) for f, v in data.items()}, coords=coords)
    ds["status"] = (dims, _vstr(status))
    ds["error"] = (dims, _vstr(error))
    ds["store"] = (dims, _vstr(store))
    ds.attrs.update({"grid": json.dumps({n: list(map(_jsonable, grid[n])) for n in names}),
                     "base_knobs": json.dumps(base.to_dict()),
                     "description": "one value per grid point × input; 'store' is relative to "
                                    "the sweep folder"})
    target = out / "summary.zarr"
    tmp = out / "summary.zarr.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        ds.to_zarr(tmp, mode="w-", zarr_format=3, consolidated=False)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as e:
        raise InputError(f"the sweep summary {str(target)!r} could not be written: "
                         f"{_one_line(e)}") from None
    return ds


def _number(v: Any) -> float:
    """A summary field's value as a float (NaN when missing or not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return np.nan
    return float(v)


def open_summary(out: str | Path) -> xr.Dataset:
    p = Path(out) / "summary.zarr"
    if not p.exists():
        raise InputError(f"sweep folder {str(out)!r} has no summary.zarr")
    try:
        return xr.open_zarr(p, consolidated=False, zarr_format=3).load()
    except Exception as e:  # a damaged or foreign store
        raise InputError(f"the sweep summary {str(p)!r} is not readable: "
                         f"{type(e).__name__}: {_one_line(e, 200)}") from None


def _vstr(a: np.ndarray) -> np.ndarray:
    """Variable-length strings: zarr v3's specified "string" type (fixed-width unicode is not)."""
    return a.astype(str).astype(np.dtypes.StringDType())


def _coord(values: Sequence[Any]) -> Any:
    if any(v is None for v in values) or all(isinstance(v, str) for v in values):
        return _vstr(np.array([str(v) for v in values], dtype=object))
    return list(values)


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
