"""Shared fixtures: tiny real transformers checkpoints (built here, no download) and paths."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (see workbench/__init__)
# served dashboards of the suite do not compile the replay kernels in a child of their own
# (workbench.ui.warm; its tests turn it on): the suite's workers share one kernel cache already
os.environ.setdefault("WORKBENCH_WARM_KERNELS", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
# one intra-op thread per pytest-xdist worker (the workers share the cores), else up to two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else
                      max(1, min(2, os.cpu_count() or 1)))

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


_SCRATCH: dict[str, str | None] = {}


def pytest_sessionstart(session):
    """Each pytest process (the xdist controller and every worker) keeps its scratch files in a
    directory of its own, removed when the session ends, failed or not: notebooks
    (``tempfile.mkdtemp``), subprocesses, served dashboards and browsers inherit ``TMPDIR``.
    pytest's own base folder stays where pytest puts it (``PYTEST_DEBUG_TEMPROOT``, the
    temporary directory before this one), with pytest's retention: a failed test's
    ``tmp_path`` kept, the last three runs' folders at most. Before, every suite run left
    ≈ 50 MB of notebook stores in /tmp, and CI machines share their disk (a CI run once
    died of a full disk)."""
    for name in ("TMPDIR", "PYTEST_DEBUG_TEMPROOT"):
        _SCRATCH[name] = os.environ.get(name)
    os.environ["PYTEST_DEBUG_TEMPROOT"] = _SCRATCH["PYTEST_DEBUG_TEMPROOT"] or \
        tempfile.gettempdir()
    _SCRATCH["dir"] = tempfile.mkdtemp(prefix="wb-suite-")
    os.environ["TMPDIR"] = _SCRATCH["dir"]
    tempfile.tempdir = None  # tempfile caches its directory; read TMPDIR again


def pytest_sessionfinish(session, exitstatus):
    scratch = _SCRATCH.pop("dir", None)
    if scratch is None:
        return
    for name in ("TMPDIR", "PYTEST_DEBUG_TEMPROOT"):
        before = _SCRATCH.pop(name, None)
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
    tempfile.tempdir = None
    shutil.rmtree(scratch, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    _group_dask_tests(items)
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def torch_settings():
    """The embedded model's trainer sets 2 threads and deterministic algorithms process-wide; put them back."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.fixture(scope="session")
def no_hang():
    """``call(fn, within_s)``: ``fn()``'s value (or its exception, re-raised here), failing the
    test if it has not returned after ``within_s`` — a hang catcher for inputs that could block
    for ever (a FIFO read), never a speed check: ``within_s`` is far above any busy machine's
    time, and speed goals live in benchmarks/."""
    import threading

    def call(fn, within_s: float = 120.0):
        out: dict = {}

        def go():
            try:
                out["value"] = fn()
            except BaseException as e:  # re-raised in the test's thread
                out["error"] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        t.join(within_s)
        if t.is_alive():
            pytest.fail(f"still running after {within_s} s: it hangs")
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return call


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """Factory: a loadable tiny checkpoint directory of a text MoE architecture."""
    from transformers.utils import logging as hf_logging

    from workbench.models.tiny import save_tiny_checkpoint

    # made on first use, inside whichever test asks first: its "Writing model shards" bar must
    # not land in that test's captured stderr
    hf_logging.disable_progress_bar()

    made: dict[str, Path] = {}

    def make(arch: str = "qwen2_moe") -> Path:
        if arch not in made:
            made[arch] = save_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch) / "ckpt")
        return made[arch]

    return make


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    from workbench.models.embedded import EMBEDDED_MODEL_DIR

    if not (Path(EMBEDDED_MODEL_DIR) / "model.safetensors").exists():
        pytest.fail(f"the embedded model is missing at {EMBEDDED_MODEL_DIR}; run "
                    f"`python -m workbench.models.embedded.v2.train`")
    return Path(EMBEDDED_MODEL_DIR)


@pytest.fixture(scope="session")
def embedded(embedded_dir):
    """The embedded model, loaded once per session (float32, CPU)."""
    import workbench

    return workbench.load(embedded_dir, device="cpu")


def _group_dask_tests(items) -> None:
    """Tests that use the shared Dask cluster (:func:`dask_scheduler`) run in one pytest-xdist
    worker (``--dist loadgroup``): one cluster per suite, not one per worker (each starts two
    worker processes that import torch and transformers)."""
    for item in items:
        if "dask_scheduler" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("dask"))


#: the files whose tests take longest, longest first (``--durations``, 2 xdist workers, idle): they
#: start first, so the suite does not end on one worker running a minute-long notebook while the
#: other idles. Whole files move, so a module's fixtures are still set up once per worker.
LONGEST_FIRST = (
    "notebooks/02_", "notebooks/06_", "notebooks/03_", "notebooks/04_", "notebooks/05_",
    "tests/test_dashboard_browser.py", "tests/test_hostile_dashboard.py",
    "notebooks/01_", "notebooks/07_",
)


def _longest_first(items) -> None:
    """Order the collection so the longest files run first (a stable sort: the rest keep
    pytest's order). With ``--dist loadgroup`` every test is its own work unit, handed out in
    this order as workers free up (the longest-processing-time-first rule)."""
    def rank(item) -> int:
        nodeid = item.nodeid
        return next((i for i, p in enumerate(LONGEST_FIRST) if nodeid.startswith(p)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.fixture(scope="session")
def dask_scheduler():
    """The address of a real Dask scheduler with two worker processes, shared by the sweeps whose
    subject is not the cluster itself: starting a LocalCluster (workers spawned, each importing
    torch and transformers) costs more than a small sweep. The sweeps that test the cluster's own
    start, worker count or Ctrl-C start their own."""
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        yield cluster.scheduler_address


@pytest.fixture(scope="session")
def demo_inputs():
    """The bundled demo requests ``[(image path | None, prompt, expected answer)]``, in file order."""
    from workbench.models.embedded.demo import read_demo

    return [(Path(p["image"]) if p["image"] else None, p["prompt"], p["answer"]) for p in read_demo()]


@pytest.fixture(scope="session")
def assert_replays_live():
    """``check(res, ds)``: a replay (``ReplayResult``) reproduces the live run stored in ``ds``
    — per-step, per-layer hits, misses, evictions, prefetches and host runs (hybrid mode), and
    the modeled clock."""
    import numpy as np

    def check(res, ds) -> None:
        np.testing.assert_array_equal(res.hits, ds["hits"].values)
        np.testing.assert_array_equal(res.misses, ds["misses"].values)
        np.testing.assert_array_equal(res.pinned_accesses, ds["pinned_accesses"].values)
        np.testing.assert_array_equal(res.evictions, ds["evictions"].values)
        np.testing.assert_array_equal(res.prefetch_loads, ds["prefetches"].values)
        if "host_runs" in ds:
            np.testing.assert_array_equal(res.host_runs, ds["host_runs"].values)
        np.testing.assert_allclose(res.stall_s.sum(1), ds["stall_modeled_s"].values, rtol=1e-9,
                                   atol=1e-15)
        np.testing.assert_allclose(res.step_latency_s, ds["latency_modeled_s"].values,
                                   rtol=1e-9)

    return check


@pytest.fixture(scope="session")
def vismmoe_run(embedded, demo_inputs, tmp_path_factory):
    """A stored run of the embedded model with VisMMOE on — affinity token compression
    (β = 0.5, pinned_layers = 1) and the lookahead predictor, calibrated here on 4 generated
    scenes (< 1 s; weak, but real) — 6 tokens of demo input 0: ``(store path, RunResult)``."""
    from workbench.knobs import Knobs
    from workbench.predictor.calibrate import calibrate, scene_requests
    from workbench.predictor.model import save
    from workbench.runtime.runtime import Runtime

    root = tmp_path_factory.mktemp("vismmoe")
    pred, report = calibrate(embedded, scene_requests(0, 4), steps=40, seed=0,
                             max_new_tokens=1, ablation=False)
    save(pred, root / "predictor", report)
    image, prompt, _ = demo_inputs[0]
    rt = Runtime(embedded, knobs=Knobs(compression="affinity", predictor="vismmoe",
                                       predictor_path=str(root / "predictor"), cache_slots=16,
                                       max_new_tokens=6, ignore_eos=True, device="cpu"))
    res = rt.run(prompt, [image], store=root / "run.zarr")
    return root / "run.zarr", res


def distinct_ids(rng, shape, num_experts: int, none_share: float = 0.15):
    """Random routing ``[T, L, K]`` obeying the trace rule: a token's experts at one layer are
    distinct (``-1`` = none, which may repeat), some entries -1."""
    T, L, K = shape
    keys = rng.random((T, L, max(num_experts, K)))
    ids = np.argsort(keys, axis=-1)[..., :K].astype(np.int64)
    ids[ids >= num_experts] = -1
    ids[rng.random((T, L, K)) < none_share] = -1
    return ids
