"""``ModelPool``: loaded models shared by the threads of one process.

Loading a checkpoint takes seconds and its weights take memory, so a process that runs many
requests (the dashboard's sessions, a notebook trying knobs, a server) loads each model once and
builds a cheap :class:`~workbench.runtime.runtime.Runtime` per run around it:

>>> from workbench.runtime.pool import default_pool
>>> pool = default_pool()
>>> rt = pool.runtime(None, cache_slots=16)             # doctest: +SKIP  (embedded model)
>>> with pool.exclusive(rt.lm):                          # doctest: +SKIP
...     res = rt.run("what color is the circle?", images=["data/demo/scene_0.png"])

Models are keyed by ``(path, dtype, device)`` (:meth:`ModelPool.key`: ``None`` is the embedded
model's folder; ``device`` as given, so ``"auto"`` and ``"cuda"`` are two entries). At most
``capacity`` models stay in the pool; the oldest is dropped first (a run still using it keeps
its own reference).

Thread-safety invariant
-----------------------
- **Loading**: :meth:`ModelPool.get` loads a key at most once however many threads ask for it at
  the same time (the others wait for that load and get the same object); loads of different
  keys do not wait for each other, and a model already in the pool is returned without waiting
  for any load. A load that fails is not kept: the next ``get`` tries again.
- **Running**: a run's offloader moves the model's expert weights between the host store and
  the device cache in place, so **at most one run may use a loaded model at a time**. Every
  thread that runs a model from the pool does so inside ``with pool.exclusive(lm):`` (one lock
  per key, kept for the life of the pool, so a model dropped and loaded again keeps its lock).
  The pool never runs anything itself; it only hands out models and their locks.
- The pool's own bookkeeping is guarded by one short-held lock; no lock is held while a model
  loads or runs, except the load's own per-key lock.

Importing this module imports no torch: the model loader is imported on the first load.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = ["ModelPool", "PoolKey", "default_pool"]

#: ``(checkpoint folder as text, dtype, device)``
PoolKey = tuple[str, str, str]

#: attribute a loaded model carries with its pool key
_KEY_ATTR = "_wb_pool_key"
#: models kept by :func:`default_pool` (each holds a model's weights in memory)
DEFAULT_CAPACITY = 2


def _default_loader(path: str, dtype: str, device: str) -> Any:
    from workbench.models.loading import load

    return load(path, dtype=dtype, device=device)


class ModelPool:
    """Loaded models by ``(path, dtype, device)``, shared by threads (see the module docstring
    for the thread-safety invariant).

    ``capacity``: models kept at most (≥ 1). ``loader(path, dtype, device)``: what loads a
    model (default :func:`workbench.models.loading.load`; tests pass a stand-in)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 loader: Callable[[str, str, str], Any] | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a whole number ≥ 1, not {capacity!r}")
        self.capacity = capacity
        self._loader = loader or _default_loader
        self._lock = threading.Lock()  # guards the three dicts below; held briefly
        self._models: OrderedDict[PoolKey, Any] = OrderedDict()  # oldest first
        self._loading: dict[PoolKey, threading.Lock] = {}  # one load per key at a time
        self._run_locks: dict[PoolKey, threading.Lock] = {}  # one run per key at a time

    @staticmethod
    def key(model: str | Path | None = None, dtype: str = "float32",
            device: str = "auto") -> PoolKey:
        """The pool key of a checkpoint (``None``: the embedded model), dtype and device."""
        if model is None:
            from workbench.models.loading import default_model_dir

            model = default_model_dir()
        return str(Path(model)), str(dtype), str(device)

    def get(self, model: str | Path | None = None, dtype: str = "float32",
            device: str = "auto") -> Any:
        """The :class:`~workbench.models.loading.LoadedModel` of ``(model, dtype, device)``,
        loaded on first use (errors of the load, e.g. :class:`ModelLoadError`, propagate and
        nothing is kept)."""
        key = self.key(model, dtype, device)
        with self._lock:
            if key in self._models:
                return self._models[key]
            loading = self._loading.setdefault(key, threading.Lock())
        with loading:  # one thread loads; the others wait here and find it loaded
            with self._lock:
                if key in self._models:
                    return self._models[key]
            lm = self._loader(*key)
            try:  # a model knows its key, so that its run lock is found after it is dropped
                setattr(lm, _KEY_ATTR, key)
            except AttributeError:
                pass
            with self._lock:
                while len(self._models) >= self.capacity:
                    self._models.popitem(last=False)
                self._models[key] = lm
                self._run_locks.setdefault(key, threading.Lock())
                self._loading.pop(key, None)
            return lm

    def peek(self, model: str | Path | None = None, dtype: str = "float32",
             device: str = "auto") -> Any:
        """The loaded model of ``(model, dtype, device)``, or None when it is not loaded (never
        loads: for checks that want the model's sizes only if they are at hand)."""
        with self._lock:
            return self._models.get(self.key(model, dtype, device))

    def runtime(self, model: str | Path | None = None, knobs: Any = None,
                **knob_values: Any) -> Any:
        """A :class:`~workbench.runtime.runtime.Runtime` of ``knobs`` (a ``Knobs``, a mapping
        or None) changed by ``knob_values`` around the pool's model for their ``dtype`` and
        ``device``. Run it inside ``with pool.exclusive(rt.lm):`` where other threads may run
        the same model."""
        from workbench.knobs import Knobs
        from workbench.runtime.runtime import Runtime

        if isinstance(knobs, Knobs):
            k = knobs.copy(**knob_values)
        else:
            k = Knobs(**{**dict(knobs or {}), **knob_values})
        return Runtime(self.get(model, k.dtype, k.device), knobs=k)

    def run_lock(self, model: Any = None, dtype: str = "float32",
                 device: str = "auto") -> threading.Lock:
        """The lock runs of a model hold (see :meth:`exclusive`). ``model``: a model this pool
        loaded (even one dropped since), or a checkpoint folder / None with ``dtype`` and
        ``device`` as :meth:`key` takes them."""
        if isinstance(model, (str, Path)) or model is None:
            key = self.key(model, dtype, device)
        else:
            key = getattr(model, _KEY_ATTR, None)
            if key is None:
                raise TypeError(f"not a model loaded by a ModelPool: {type(model).__name__}; "
                                f"pass its folder, dtype and device instead")
        with self._lock:
            return self._run_locks.setdefault(key, threading.Lock())

    @contextmanager
    def exclusive(self, model: Any = None, dtype: str = "float32",
                  device: str = "auto") -> Iterator[None]:
        """``with pool.exclusive(lm): rt.run(...)`` — hold the model's run lock (blocks while
        another thread runs the same model)."""
        lock = self.run_lock(model, dtype, device)
        with lock:
            yield

    def loaded(self) -> list[PoolKey]:
        """Keys of the models in the pool, oldest first."""
        with self._lock:
            return list(self._models)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._models

    def __len__(self) -> int:
        with self._lock:
            return len(self._models)

    def clear(self) -> None:
        """Drop every model (runs in flight keep theirs; run locks are kept)."""
        with self._lock:
            self._models.clear()


_DEFAULT: ModelPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> ModelPool:
    """The process-wide pool (the dashboard's sessions share it; so can notebooks)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = ModelPool()
        return _DEFAULT
