"""Low-precision emulation of expert execution (issue 15 §1): quantise → dequantise any tensor.

:func:`fake_quant` returns a tensor of the input's dtype and shape holding exactly the values a
low-precision kernel would compute with, so the real experts can run "in" FP8 or NVFP4 on a
CPU (no FP4 matmul runs here: the *modeled* clock prices the speedup, never this machine).

- ``native`` — unchanged (the model's dtype; ReaLB's BF16 baseline).
- ``fp8`` — FP8 E4M3 (the ``e4m3fn`` variant: max 448, no infinities), symmetric, one FP32
  scale = amax / 448 per tensor (``axis=None``) or per slice along ``axis`` (e.g. ``axis=-1``:
  one scale per row = per output channel of a weight ``[out, in]``, per token of activations
  ``[tokens, hidden]``); values are scaled, saturated to ±448 and rounded to the nearest E4M3
  value (ties to even: PyTorch's cast).
- ``nvfp4`` — NVFP4 (NVIDIA's Blackwell format; seed 004 App. "Quantization Details"): values
  in E2M1 (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}) in contiguous groups of 16 along the last axis, each
  group with an FP8 E4M3 scale, and one FP32 global scale per tensor. With amax the tensor's
  largest magnitude: global = amax / (448 · 6); each group's scale = its amax / 6 / global,
  saturated to [2⁻⁶, 448] and rounded to E4M3; a value becomes round_E2M1(x · ((1 / global)
  / scale)) (nearest, ties to the even mantissa; ±6 at most) and dequantises to q · (global ·
  scale) — torchao's ``nvfp4_quantize`` numerics, equal to it value for value (tested when
  torchao is installed). A last group shorter than 16 is its own group. All-zero groups stay
  zero.

Invariants (tested): ``native`` is the identity; an exactly representable input comes back
unchanged; the error of ``nvfp4`` is at most half a quantisation step of each group; results
are deterministic. Hand-computed vectors are in ``tests/test_precision.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.errors import InputError

#: the registry's names (the ``precision`` knobs of ReaLB choose from these)
PRECISIONS = ("native", "fp8", "nvfp4")
FP8_MAX = 448.0
#: E4M3's smallest normal (2⁻⁶): the least an NVFP4 group scale may be
E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)
FP4_MAX = 6.0
NVFP4_GROUP = 16
#: the non-negative E2M1 values, ascending
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: bits per value of each precision (weights; NVFP4 adds an 8-bit scale per 16 values)
BITS = {"native": None, "fp8": 8, "nvfp4": 4 + 8 / NVFP4_GROUP}


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest E4M3 value, saturated to ±448 (float32 out)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _div(x: torch.Tensor, c: float) -> torch.Tensor:
    """``x / c`` rounded once, on every device: PyTorch's CUDA kernels turn a division by a
    Python number into a multiplication by its rounded reciprocal (the last bit can differ,
    and flip a scale's E4M3 rounding — measured on an H200: one NVFP4 group in 16.7 M values);
    a divisor tensor on the same device keeps the IEEE division the CPU does."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to the nearest E2M1 value, ties to the even mantissa, saturated
    to ±6."""
    a = x.abs().clamp(max=FP4_MAX)
    # between consecutive E2M1 values the step is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    # torch.round sends halves to the even integer; on every step's grid an even multiple is
    # a value with mantissa 0 (0, 1 | 2 | 4) and an odd one mantissa 1 (0.5, 1.5 | 3 | 6), so
    # ties go to the even mantissa, as the format's round-to-nearest-even does (a tie at a
    # binade's edge, 1.75 or 3.5, lies below it and rounds up to the edge's mantissa-0 value)
    q = torch.round(a / step) * step
    return torch.sign(x) * q


def fake_quant(x: Any, precision: str = "nvfp4", *, axis: int | None = None) -> torch.Tensor:
    """Quantise ``x`` to ``precision`` and back (module docstring); same dtype and shape.

    ``axis`` (``fp8`` only): None — one scale for the tensor; an int — one scale per slice
    along that axis (``-1``: per row). ``nvfp4`` groups the last axis by 16."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, not "
                         f"{precision!r}")
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"fake_quant needs a tensor (or numbers torch.as_tensor takes), "
                             f"not {type(x).__name__}: {str(e)[:80]}") from None
    if not x.is_floating_point():
        raise InputError(f"fake_quant needs a floating-point tensor, not {x.dtype}")
    if x.device.type == "meta":
        raise InputError("fake_quant needs a tensor with values, not a meta tensor")
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)
                             or not -max(x.dim(), 1) <= axis < max(x.dim(), 1)):
        raise InputError(f"axis must be None or a dimension of the {x.dim()}-d tensor, not "
                         f"{axis!r}")
    if precision == "native" or x.numel() == 0:
        return x.clone()
    dtype = x.dtype
    if not torch.isfinite(x).all():
        raise InputError("fake_quant needs finite values (the tensor holds NaN or ±inf)")
    xf = x.detach().to(torch.float32)
    if not torch.isfinite(xf).all():
        raise InputError("fake_quant computes in float32: the tensor holds finite values "
                         "beyond its range (±3.4e38)")
    if x.dim() == 0:  # one value: a row of one
        return fake_quant(x.reshape(1), precision, axis=None if axis is None else 0
                          ).reshape(())
    if precision == "fp8":
        if axis is None:
            amax = xf.abs().amax()
        else:
            amax = xf.abs().amax(dim=axis, keepdim=True)
        scale = _div(amax, FP8_MAX)
        # a scale that underflows float32 (amax below 448 × 1.4e-45): those values are 0
        live = scale > 0
        scale = torch.where(live, scale, torch.ones_like(scale))
        return torch.where(live, _to_e4m3(xf / scale) * scale, 0.0).to(dtype)
    if axis is not None:
        raise InputError("nvfp4 groups the last axis by 16: axis is not a setting of it")
    amax = xf.abs().amax()
    if amax == 0 or _div(amax, FP8_MAX * FP4_MAX) == 0:  # all 0, or a global scale that
        return torch.zeros_like(x)                        # underflows float32: all 0
    glob = _div(amax, FP8_MAX * FP4_MAX)
    n = xf.shape[-1]
    pad = (-n) % NVFP4_GROUP
    flat = xf.reshape(-1, n)
    if pad:  # the last, shorter group: padded with zeros (they change no group's amax)
        flat = torch.nn.functional.pad(flat, (0, pad))
    g = flat.reshape(flat.shape[0], -1, NVFP4_GROUP)
    g_amax = g.abs().amax(-1, keepdim=True)
    # the group scale, saturated to E4M3's normal range [2⁻⁶, 448] and rounded to it; the
    # values scaled by the reciprocal of global × scale (NVIDIA's kernels and torchao compute
    # it so: the last bit of a value can depend on it)
    scale = _to_e4m3((_div(g_amax, FP4_MAX) / glob).clamp(E4M3_TINY, FP8_MAX))
    q = _round_e2m1(g * ((1.0 / glob) / scale))
    out = (q * (glob * scale)).reshape(flat.shape[0], -1)[:, :n]
    return out.reshape(xf.shape).to(dtype)


#: the GEMMs a :func:`quantises_input` weight quantises the other operand of (by name: torch's
#: functions and methods, and transformers' grouped-GEMM custom op on hosts without
#: ``torch._grouped_mm``)
_GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "__matmul__", "__rmatmul__",
                    "_grouped_mm", "grouped_mm", "grouped_mm_fallback"})


class InputQuantisingWeight(torch.Tensor):
    """A weight whose every GEMM takes its *activation* operand quantised → dequantised to
    :attr:`precision` (:func:`fake_quant`, groups along the contraction axis; one global scale
    per expert: a grouped GEMM's rows split by its offsets, a batched GEMM's entries apart; a
    static calibrated input scale per expert's Linear is what a PTQ recipe ships). Ops that
    derive a weight from it (an expert's slice, a transpose, a reshape) keep the type, so the
    model's own experts forward (eager, batched or grouped GEMMs) quantises the input of every
    GEMM this weight enters, unchanged. Made by :func:`quantises_input`."""

    precision: str = "nvfp4"
    gemms: int = 0  # GEMMs that quantised their input (all weights of this precision)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "") or ""
        name = name.rsplit(".", 1)[-1]
        if name not in _GEMMS:
            return super().__torch_function__(func, types, args, kwargs)
        import workbench.precision as here  # looked up per call: tests may patch fake_quant

        if name == "__rmatmul__":  # W.__rmatmul__(x) is x @ W
            name, args = "matmul", (args[1], args[0], *args[2:])
        tagged = [i for i, a in enumerate(args) if isinstance(a, cls)]
        if tagged not in ([0], [1]) or len(args) < 2 or \
                any(isinstance(a, cls) for a in kwargs.values()) or \
                (tagged == [0] and name == "linear"):
            raise TypeError(f"{cls.__name__}: {name} with this weight as operand "
                            f"{tagged or list(kwargs)}: no rule for which operand to quantise")
        p = cls.precision
        with torch._C.DisableTorchFunctionSubclass():
            args = [a.as_subclass(torch.Tensor) if isinstance(a, cls) else a for a in args]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            if name in ("_grouped_mm", "grouped_mm", "grouped_mm_fallback") and tagged == [1]:
                # rows grouped by expert (``offs``: each group's end): one global scale per
                # expert, so the values do not depend on which experts share the call; rows
                # past the last group (the EP sentinels) are no expert's and stay as they are
                x, ends = args[0], [0, *offs.tolist()]
                parts = [here.fake_quant(x[a:b], p) for a, b in zip(ends, ends[1:])]
                args[0] = torch.cat([*parts, x[ends[-1]:]])
            elif tagged == [1] and args[1].dim() == 3:  # batched x @ W: one GEMM per entry
                args[0] = torch.stack([here.fake_quant(r, p) for r in args[0]]) \
                    if len(args[0]) else args[0]
            elif tagged == [1]:  # x @ W (linear: x @ Wᵀ), one expert: x's last axis
                args[0] = here.fake_quant(args[0], p)
            elif args[1].dim() < 2:  # W @ v
                args[1] = here.fake_quant(args[1], p)
            elif args[0].dim() == 3:  # batched W @ x: x's second-to-last axis, per entry
                args[1] = torch.stack([here.fake_quant(r.transpose(-1, -2), p).transpose(-1, -2)
                                       for r in args[1]]) if len(args[1]) else args[1]
            else:  # W @ x: the contraction is x's second-to-last axis
                args[1] = here.fake_quant(args[1].transpose(-1, -2), p).transpose(-1, -2)
            cls.gemms += 1
            return func(*args, **kwargs)


_INPUT_QUANTISING: dict[str, type] = {}


def quantises_input(weight: torch.Tensor, precision: str) -> torch.Tensor:
    """``weight`` (no copy) as an :class:`InputQuantisingWeight` of ``precision``: every GEMM
    it enters quantises its other operand (ReaLB's W4A4: activations in FP4 into every
    expert GEMM, seed 004 App. "Quantization Details")."""
    if precision not in PRECISIONS:
        raise InputError(f"precision must be one of {', '.join(PRECISIONS)}, not "
                         f"{precision!r}")
    cls = _INPUT_QUANTISING.get(precision)
    if cls is None:
        cls = _INPUT_QUANTISING[precision] = type(
            f"InputQuantisingWeight_{precision}", (InputQuantisingWeight,),
            {"precision": precision, "gemms": 0})
    return weight.as_subclass(cls)


__all__ = ["PRECISIONS", "fake_quant", "quantises_input", "InputQuantisingWeight", "E2M1_VALUES",
           "FP8_MAX", "FP4_MAX", "NVFP4_GROUP", "BITS"]
