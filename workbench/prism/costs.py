"""MoE-Prism's cost table C(m, b) (issue 16 §2 "Cost model", seed §5): seconds of one batched
decode step of ``b`` requests when every routed expert runs ``m`` of its ``N`` sub-experts —
the lookup table the QoS scheduler (:mod:`workbench.prism.scheduler`) prices batches with.

A :class:`CostTable` holds, for ``m = 1 … N`` and the batch sizes ``sizes`` (strictly
increasing), ``decode_s[m − 1, j]`` (seconds of one decode step of ``sizes[j]`` requests) and
``prefill_s[m − 1, j]`` (seconds of the prefill of ``sizes[j]`` requests of ``prompt_tokens``
prompt tokens each). It comes from one of two clocks (``clock``):

- :meth:`CostTable.measure` — *measured*: the real runtime (``rt.run(requests, prism=True,
  prism_k_active=m)``, every expert resident, ``ignore_eos``), the median of the decode
  steps' wall times over ``repeats`` interleaved rounds;
- :meth:`CostTable.modeled` — *modeled*: a hardware profile (:mod:`workbench.sim.profiles`)
  and a target model's sizes, priced with the profile's roofline (:meth:`compute_time`):
  per MoE layer the dense part (:class:`~workbench.sim.costs.Prices`' ``dense``) plus the
  routed experts' op(s) over the distinct sub-experts the batch's tokens touch, ``1/N`` of an
  expert's bytes each (decode is memory-bound: the bytes read dominate).

Between sizes the table interpolates linearly in ``b``; below the smallest size it answers the
smallest size's price (never cheaper than measured); above the largest it refuses.
:meth:`save` / :meth:`load` keep it as JSON (no pickle); :meth:`load` refuses a malformed file
naming the file and the field. Units: seconds, tokens, requests.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from workbench.errors import InputError, KnobError

FORMAT = "workbench-prism-costs/1"
CLOCKS = ("measured", "modeled")
#: bounds a table (and a file declaring one) must stay within: far above any real setting,
#: small enough that a hostile header cannot make :meth:`CostTable.load` allocate much
MAX_SUBEXPERTS = 1024
MAX_SIZES = 1024
MAX_BATCH = 1 << 16
MAX_PROMPT_TOKENS = 1 << 24
MAX_FILE_BYTES = 16 << 20
#: how the distinct sub-experts a batch touches are counted by :meth:`CostTable.modeled`
SUB_CHOICES = ("shared", "independent")
#: how :meth:`CostTable.modeled` launches a layer's routed experts
KERNELS = ("grouped", "per_expert")


def _seconds(where: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v <= 0:
        raise ValueError(f"{where} must be a finite number of seconds above 0, not {v!r}")
    return float(v)


def _whole(where: str, v: Any, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
        raise ValueError(f"{where} must be a whole number in {lo} … {hi}, not {v!r}")
    return int(v)


@dataclass(frozen=True)
class CostTable:
    """C(m, b) and the prefill price (module docstring). Arrays are float64 ``[N, len(sizes)]``
    and read-only; every entry a finite number of seconds above 0; ``sizes`` strictly
    increasing in 1 … :data:`MAX_BATCH`."""

    decode_s: np.ndarray
    prefill_s: np.ndarray
    sizes: tuple[int, ...]
    prompt_tokens: int
    clock: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            self._check()
        except ValueError as e:
            raise InputError(f"CostTable: {e}") from None

    def _check(self) -> None:
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, not {self.clock!r}")
        if not isinstance(self.sizes, (tuple, list)) or not 1 <= len(self.sizes) <= MAX_SIZES:
            raise ValueError(f"sizes must be a list of 1 … {MAX_SIZES} batch sizes, "
                             f"not {self.sizes!r}"[:200])
        sizes = tuple(_whole(f"sizes[{j}]", b, 1, MAX_BATCH) for j, b in enumerate(self.sizes))
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"sizes must be strictly increasing, not {list(sizes)}")
        object.__setattr__(self, "sizes", sizes)
        _whole("prompt_tokens", self.prompt_tokens, 1, MAX_PROMPT_TOKENS)
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, not {type(self.meta).__name__}")
        for name in ("decode_s", "prefill_s"):
            a = np.array(getattr(self, name), dtype=np.float64)  # a copy: ours alone
            if a.ndim != 2 or not 1 <= a.shape[0] <= MAX_SUBEXPERTS \
                    or a.shape[1] != len(sizes):
                raise ValueError(f"{name} must have shape [N sub-experts (1 … "
                                 f"{MAX_SUBEXPERTS}), {len(sizes)} sizes], not "
                                 f"{list(a.shape)}")
            bad = ~(np.isfinite(a) & (a > 0))
            if bad.any():
                i, j = map(int, np.argwhere(bad)[0])
                raise ValueError(f"{name}[{i}][{j}] (m = {i + 1}, b = {sizes[j]}) must be a "
                                 f"finite number of seconds above 0, not {a[i, j]!r}")
            a.flags.writeable = False
            object.__setattr__(self, name, a)
        if self.prefill_s.shape != self.decode_s.shape:
            raise ValueError(f"prefill_s has shape {list(self.prefill_s.shape)}, decode_s "
                             f"{list(self.decode_s.shape)}: they must be equal")

    # -- reading -------------------------------------------------------------------------
    @property
    def subexperts(self) -> int:
        """N: the sub-experts of each expert (the table's levels are m = 1 … N)."""
        return int(self.decode_s.shape[0])

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _row(self, a: np.ndarray, b: Any, m: Any) -> float:
        m = self._level(m)
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) \
                or not 1 <= b <= self.max_batch:
            raise KnobError(f"batch size must be a whole number in 1 … {self.max_batch} (the "
                            f"largest in this {self.clock} cost table), not {b!r}")
        return float(np.interp(float(b), self.sizes, a[m - 1]))

    def _level(self, m: Any) -> int:
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) \
                or not 1 <= m <= self.subexperts:
            raise KnobError(f"k_active must be a whole number in 1 … {self.subexperts} (the "
                            f"cost table's sub-experts), not {m!r}")
        return int(m)

    def __call__(self, b: int, m: int) -> float:
        """C(m, b): seconds of one decode step of ``b`` requests at ``m`` sub-experts."""
        return self._row(self.decode_s, b, m)

    def prefill(self, b: int, m: int, prompt_tokens: float | None = None) -> float:
        """Seconds of the prefill of ``b`` requests padded to ``prompt_tokens`` each
        (default the table's): the table's price scaled linearly in the prompt length."""
        p = self.prompt_tokens if prompt_tokens is None else float(prompt_tokens)
        return self._row(self.prefill_s, b, m) * p / self.prompt_tokens

    def grid(self, max_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(decode, prefill)`` float64 ``[N, max_batch + 1]``: every b = 1 … max_batch
        interpolated (column 0 unused, 0) — what the scheduler's kernel indexes."""
        if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) \
                or not 1 <= max_batch <= self.max_batch:
            raise KnobError(f"batch_size must be in 1 … {self.max_batch} (the largest batch "
                            f"of this {self.clock} cost table), not {max_batch!r}")
        bs = np.arange(max_batch + 1, dtype=np.float64)
        out = []
        for a in (self.decode_s, self.prefill_s):
            g = np.stack([np.interp(bs, self.sizes, row) for row in a])
            g[:, 0] = 0.0
            out.append(g)
        return out[0], out[1]

    # -- files ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "clock": self.clock, "subexperts": self.subexperts,
                "sizes": list(self.sizes), "prompt_tokens": self.prompt_tokens,
                "decode_s": self.decode_s.tolist(), "prefill_s": self.prefill_s.tolist(),
                "meta": self.meta}

    def save(self, path: str | Path, overwrite: bool = False) -> Path:
        """Write the table to ``path`` (JSON; a temporary name, then renamed). An existing file
        is replaced only with ``overwrite``; a blank path or a link that leads nowhere is
        refused (the shared output-path checks)."""
        from workbench.telemetry.destination import follow_link, store_path_arg

        path = follow_link(store_path_arg(path, "cost table file", "costs.json").expanduser(),
                           "cost table file")
        if path.is_dir():
            raise InputError(f"cost table file {str(path)!r} is a folder; give a file path")
        if path.exists() and not overwrite:
            raise InputError(f"{str(path)!r} already exists; pass overwrite=True to replace "
                             f"the cost table there")
        try:
            text = json.dumps(self.to_json(), indent=1, allow_nan=False)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, path)
        except (OSError, ValueError, TypeError) as e:
            raise InputError(f"cannot write the cost table to {str(path)!r}: "
                             f"{type(e).__name__}: {str(e)[:200]}") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """The table in ``path``, checked: :class:`InputError` naming the file and the field
        (non-JSON, another format, sizes not increasing or beyond the bounds, arrays of the
        wrong shape, seconds that are not finite numbers above 0)."""
        from workbench.fileio import read_json, shorten

        path = Path(path)
        name = repr(str(path))
        doc = read_json(path, MAX_FILE_BYTES, f"cost table {name}", obj=False)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise InputError(f"{name} is not a {FORMAT} file (format "
                             f"{shorten(doc.get('format') if isinstance(doc, dict) else None)})")
        try:
            N = _whole("subexperts", doc.get("subexperts"), 1, MAX_SUBEXPERTS)
            sizes = doc.get("sizes")
            if not isinstance(sizes, list) or not 1 <= len(sizes) <= MAX_SIZES:
                raise ValueError(f"sizes must be a list of 1 … {MAX_SIZES} batch sizes")
            for key in ("decode_s", "prefill_s"):
                rows = doc.get(key)
                if not isinstance(rows, list) or len(rows) != N or any(
                        not isinstance(r, list) or len(r) != len(sizes) for r in rows):
                    raise ValueError(f"{key} must be {N} lists (subexperts) of {len(sizes)} "
                                     f"seconds (sizes)")
                for i, r in enumerate(rows):
                    for j, v in enumerate(r):
                        _seconds(f"{key}[{i}][{j}]", v)
            meta = doc.get("meta", {})
            if not isinstance(meta, dict):
                raise ValueError("meta must be an object")
            return cls(decode_s=np.array(doc["decode_s"], np.float64),
                       prefill_s=np.array(doc["prefill_s"], np.float64), sizes=tuple(sizes),
                       prompt_tokens=doc.get("prompt_tokens"), clock=doc.get("clock"),
                       meta=meta)
        except (ValueError, InputError) as e:
            msg = str(e).removeprefix("CostTable: ")
            raise InputError(f"{name}: {msg}") from None

    # -- making --------------------------------------------------------------------------
    @classmethod
    def modeled(cls, profile: Any, shape: Any, subexperts: int = 4,
                sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                prompt_tokens: int = 128, sub_choice: str = "shared",
                kernel: str = "grouped") -> "CostTable":
        """C(m, b) of ``shape`` (a :class:`~workbench.sim.profiles.TargetModel` or its name)
        on ``profile`` (a :class:`~workbench.sim.profiles.HardwareProfile` or its name),
        *modeled*. A step of T tokens (decode: T = b; prefill: T = b · prompt_tokens) costs,
        per MoE layer, the dense part — :class:`~workbench.sim.costs.Prices`' ``dense(T)`` —
        plus the routed experts: T·top_k·m sub-expert runs (FLOPs: m/N of an expert's per
        token) reading the bytes of the D distinct sub-experts the T tokens touch (each 1/N of
        an expert's), when each token routes to ``top_k`` of the E experts uniformly at
        random — X = E·(1 − (1 − top_k/E)^T) experts touched —

        - ``sub_choice="shared"``: the tokens of one expert run the same m sub-experts,
          D = m·X (exact at b = 1; a lower bound above);
        - ``"independent"``: each token picks its m of N at random,
          D = N·E·(1 − (1 − (top_k/E)·(m/N))^T) — the proxy gate choosing per token with no
          agreement between tokens (an upper bound);

        - ``kernel="grouped"``: one op for all of a layer's experts (a fused MoE kernel, as
          the seed's vLLM testbed runs), ``compute_time(runs·flops/N, D·bytes/N)``;
        - ``"per_expert"``: one op per touched expert, each :meth:`Prices.subexpert_op` of
          its share — how the workbench's modeled clock prices a live run (a launch overhead
          per expert).

        Attention over the KV cache is not priced (the target models' dense FLOPs exclude it).
        """
        from workbench.sim.costs import CostSpec, Prices
        from workbench.sim.profiles import get_profile, get_target_model

        prof = get_profile(profile) if isinstance(profile, str) else profile
        target = get_target_model(shape) if isinstance(shape, str) else shape
        for name, v, allowed in (("sub_choice", sub_choice, SUB_CHOICES),
                                 ("kernel", kernel, KERNELS)):
            if v not in allowed:
                raise KnobError(f"{name} must be one of {', '.join(allowed)}, not {v!r}")
        N = _check_arg("subexperts", subexperts, 1, MAX_SUBEXPERTS)
        sizes = tuple(_check_arg("sizes[...]", b, 1, MAX_BATCH) for b in sizes)
        p = _check_arg("prompt_tokens", prompt_tokens, 1, MAX_PROMPT_TOKENS)
        cost = CostSpec.from_target(target)
        prices = Prices(prof, cost)
        E, k = target.num_experts, target.top_k

        def step(tokens: int, m: int) -> float:
            touched = E * -math.expm1(tokens * math.log1p(-k / E))
            if sub_choice == "shared":
                distinct = m * touched
            else:
                distinct = N * E * -math.expm1(tokens * math.log1p(-(k / E) * (m / N)))
            runs = tokens * k * m
            if kernel == "grouped":
                experts = prof.compute_time(runs * cost.expert_flops_per_token / N,
                                            distinct * cost.expert_bytes / N)
            else:
                experts = touched * prices.subexpert_op(runs / touched, distinct / touched, N)
            return target.num_layers * (prices.dense(tokens) + experts)

        dec = [[step(b, m) for b in sizes] for m in range(1, N + 1)]
        pre = [[step(b * p, m) for b in sizes] for m in range(1, N + 1)]
        return cls(decode_s=np.array(dec), prefill_s=np.array(pre), sizes=sizes,
                   prompt_tokens=p, clock="modeled",
                   meta={"profile": prof.name, "profile_label": prof.label,
                         "target_model": target.name, "sub_choice": sub_choice,
                         "kernel": kernel,
                         "expert_bytes": cost.expert_bytes,
                         "dense_bytes_per_layer": cost.dense_bytes_per_layer,
                         "num_layers": target.num_layers, "num_experts": E, "top_k": k,
                         "note": "roofline of the profile (a lower bound), attention over "
                                 "the KV cache not priced"})

    @classmethod
    def measure(cls, rt: Any, sizes: Sequence[int] = (1, 2, 4, 8, 16), repeats: int = 3,
                steps: int = 8, requests: Sequence[Any] | None = None,
                native: bool = True, **knobs: Any) -> "CostTable":
        """C(m, b) of ``rt`` (a :class:`~workbench.runtime.runtime.Runtime`), *measured* here:
        for every m = 1 … N (N: the refactoring a ``prism=True`` run of ``rt`` loads — set
        ``prism_refactoring`` in ``knobs`` or ``rt.knobs``) and b in ``sizes``, a run of the
        first b of ``requests`` (default the held-out image requests, text-only ones for a
        text-only model) with ``prism_k_active=m``, ``steps`` tokens each (``ignore_eos``),
        every expert resident, no recording. A decode step is the wall time between two streamed tokens (what a
        client sees as TPOT); a cell is the median of its ``repeats · (steps − 1)`` decode
        steps, its prefill the median of ``repeats`` times from the call to the first
        streamed token (what a client sees as TTFT: the requests' inputs, the run's setup
        and the prefill forward — a serving run pays all three), ``prompt_tokens`` the median
        longest prompt of a batch. Every round visits every cell (after one warm-up run), so
        drift of the machine spreads over all cells. ``native``: also time the unmodified
        runtime (prism off) per size, kept in ``meta`` (``native_decode_s``,
        ``native_prefill_s``). Default ≈ 1.5 min on 2 cores for N = 4."""
        import torch

        import workbench
        from workbench.prism import refactor as R
        from workbench.runtime.threads import run_threads

        sizes = tuple(_check_arg("sizes[...]", b, 1, MAX_BATCH) for b in sizes)
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise KnobError(f"sizes must be strictly increasing, not {list(sizes)}")
        repeats = _check_arg("repeats", repeats, 1, 1000)
        steps = _check_arg("steps", steps, 2, 4096)
        lay = rt.lm.layout
        base = dict(max_new_tokens=steps, ignore_eos=True, pinned_layers=0,
                    cache_slots=lay.num_layers * lay.num_experts)
        base.update(knobs)
        ref, _ = R.for_run(rt.lm, rt.knobs.copy(**{**base, "prism": True,
                                                   "prism_k_active": None}))
        N = ref.subexperts
        reqs = list(requests) if requests is not None else workbench.batch(
            sizes[-1], mix="image" if rt.lm.is_vision else "text")  # one prompt length
        if len(reqs) < sizes[-1]:
            raise InputError(f"measure needs {sizes[-1]} requests (the largest size), "
                             f"not {len(reqs)}")
        cells = [(m, b) for m in range(1, N + 1) for b in sizes] + \
            ([(0, b) for b in sizes] if native else [])
        dec: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
        pre: dict[tuple[int, int], list[float]] = {c: [] for c in cells}
        prompt: list[int] = []
        t0 = time.perf_counter()
        load0 = os.getloadavg()[0]  # other work on the machine shows in the spread

        def run(m: int, b: int):
            kw = dict(prism=False) if m == 0 else dict(prism=True, prism_k_active=m)
            stamps: list[float] = []
            launched = time.perf_counter()
            res = rt.run(reqs[:b], record=False, on_token=lambda *_: stamps.append(
                time.perf_counter()), **base, **kw)
            if res.steps != steps or len(stamps) != steps:
                raise InputError(f"a measurement run made {res.steps} steps ({len(stamps)} "
                                 f"tokens streamed), not {steps}")
            return res, stamps[0] - launched, np.diff(stamps)

        run(N, sizes[0])  # warm-up: loads the refactoring, first-call allocations
        for _ in range(repeats):
            for m, b in cells:
                res, ttft, gaps = run(m, b)
                dec[m, b].extend(gaps.tolist())
                pre[m, b].append(ttft)
                prompt.append(max((r.get("prompt_tokens", 0) for r in res.batch),
                                  default=0))
        med = {c: (statistics.median(dec[c]), statistics.median(pre[c])) for c in cells}
        # interquartile range of the decode steps over their median: how steady the machine was
        spread = {c: float(np.subtract(*np.percentile(dec[c], [75, 25]))) / med[c][0]
                  for c in cells}
        p_ref = int(statistics.median(p for p in prompt if p > 0)) if any(prompt) else 1

        refactoring = base.get("prism_refactoring") or rt.knobs.prism_refactoring or \
            R.default_path(getattr(rt.lm, "path", None), rt.lm.config_hash)
        meta = {"model_id": rt.lm.model_id, "config_hash": rt.lm.config_hash,
                "refactoring": str(refactoring), "repeats": repeats, "steps": steps,
                "statistic": "decode: median of every decode step's wall time (between "
                             "streamed tokens) over the repeats; prefill: median over the "
                             "repeats of the time from the call to the first streamed token "
                             "(TTFT: inputs, run setup, prefill forward); prompt_tokens: "
                             "median longest prompt of a batch",
                "requests": "given" if requests is not None else
                            f"workbench.batch({sizes[-1]}, mix='image')",
                "host": {"machine": platform.machine(), "processor": platform.processor(),
                         "cpus": os.cpu_count(), "torch_threads": run_threads(rt.lm.device) or torch.get_num_threads(),
                         "device": str(getattr(rt.knobs, "device", "cpu"))},
                "max_relative_iqr": max(spread.values()), "knobs": base,
                "loadavg_1min": [load0, os.getloadavg()[0]],
                "elapsed_s": time.perf_counter() - t0,
                "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        if native:
            meta["native_decode_s"] = [med[0, b][0] for b in sizes]
            meta["native_prefill_s"] = [med[0, b][1] for b in sizes]
        return cls(decode_s=np.array([[med[m, b][0] for b in sizes] for m in range(1, N + 1)]),
                   prefill_s=np.array([[med[m, b][1] for b in sizes]
                                       for m in range(1, N + 1)]),
                   sizes=sizes, prompt_tokens=p_ref, clock="measured", meta=meta)

    def summary(self) -> str:
        """A markdown table of C(m, b) in milliseconds."""
        head = "| m \\ b | " + " | ".join(map(str, self.sizes)) + " |"
        rows = [f"| {m + 1}/{self.subexperts} | " + " | ".join(
            f"{v * 1e3:.3g}" for v in self.decode_s[m]) + " |" for m in range(self.subexperts)]
        return "\n".join([head, "|---" * (len(self.sizes) + 1) + "|", *rows])


def _check_arg(name: str, v: Any, lo: int, hi: int) -> int:
    try:
        return _whole(name, v, lo, hi)
    except ValueError as e:
        raise KnobError(str(e)) from None


__all__ = ["CostTable", "FORMAT", "CLOCKS", "SUB_CHOICES", "KERNELS"]
