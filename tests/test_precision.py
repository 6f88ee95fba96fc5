"""Low-precision emulation (issue 15 §1): fake_quant against hand-computed vectors."""

import numpy as np
import pytest
import torch

from workbench.errors import InputError
from workbench.precision import E2M1_VALUES, fake_quant


def test_native_is_the_identity_and_keeps_dtype():
    x = torch.randn(3, 20, dtype=torch.bfloat16)
    y = fake_quant(x, "native")
    assert y.dtype == torch.bfloat16 and torch.equal(x, y) and y is not x


# A tensor whose amax is 5.25 has the global scale 5.25 / (448 · 6) = 2⁻⁹ exactly; a group
# whose amax is 3 then has the scale 3 / 6 / 2⁻⁹ = 256 (a power of two, exact in E4M3), so
# its values are exactly 2x in units (scale · global = 0.5): ties are exact ties.
ANCHOR = torch.full((16,), 5.25)  # its own group: scale 448, unit 448 · 2⁻⁹ = 0.875


def test_e2m1_rounding_hand_computed():
    x = torch.tensor([3.0, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, 2.75, -0.15, -1.45,
                      2.2, 0.0, 0.5, -3.0, 0.37])
    # in units of 0.5: 6 | .25→0 | .75→1 | 1.25→1 | 1.75→2 | 2.5→2 | 3.5→4 | 5→4 | 5.5→6 |
    # −.3→−.5 | −2.9→−3 | 4.4→4 | 0 | 1 | −6 | .74→.5 (ties to the even mantissa)
    units = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.5, -3.0, 4.0, 0.0,
                          1.0, -6.0, 0.5])
    y = fake_quant(torch.cat([ANCHOR, x])[None], "nvfp4")[0]
    assert torch.equal(y[:16], ANCHOR)
    assert torch.equal(y[16:], units * 0.5)


def test_nvfp4_group_scales_are_e4m3():
    """A group of amax 0.875: its scale 0.875 / 6 / 2⁻⁹ = 74.67 rounds to the E4M3 value 72
    (step 8 in [64, 128)), so its unit is 72 · 2⁻⁹; its values are the nearest E2M1 points."""
    g2 = torch.linspace(-0.875, 0.875, 16)
    y = fake_quant(torch.cat([ANCHOR, g2])[None], "nvfp4")[0]
    unit = 72.0 * 2.0 ** -9
    grid = torch.tensor(E2M1_VALUES)
    q = (g2 / unit).abs()
    nearest = grid[(q[:, None] - grid).abs().argmin(1)]  # no ties among these values
    torch.testing.assert_close(y[16:], torch.sign(g2) * nearest * unit, rtol=0, atol=1e-7)


def test_nvfp4_error_bound_shape_and_short_last_group():
    torch.manual_seed(0)
    x = torch.randn(5, 37) * torch.logspace(-3, 2, 37)
    y = fake_quant(x, "nvfp4")
    assert y.shape == x.shape and y.dtype == x.dtype
    glob = x.abs().max() / (448 * 6)
    for row in range(5):
        for a in range(0, 37, 16):
            g = x[row, a:a + 16]
            scale = (g.abs().max() / 6 / glob).clamp(2 ** -6, 448).to(
                torch.float8_e4m3fn).float()
            unit = float(scale * glob)
            # at most half the widest E2M1 step (2 units), plus what saturation at 6 cuts off
            err = (y[row, a:a + 16] - g).abs()
            assert bool((err <= unit * (1 + 1e-5) + (g.abs() - 6 * unit).clamp(min=0)).all())
    # values on the grid survive unchanged; all-zero stays zero
    exact = torch.cat([ANCHOR, 0.5 * torch.tensor([0.5, -1.5, 3.0, 6.0] * 4)])[None]
    assert torch.equal(fake_quant(exact, "nvfp4"), exact)
    assert torch.equal(fake_quant(torch.zeros(2, 16), "nvfp4"), torch.zeros(2, 16))


def test_fp8_per_tensor_and_per_channel():
    x = torch.tensor([[448.0, 1.0, -0.3], [2.0, 0.02, 1e-4]])
    y = fake_quant(x, "fp8")  # scale 1: plain E4M3 rounding
    want = torch.tensor([[448.0, 1.0, -0.3], [2.0, 0.02, 1e-4]]).to(torch.float8_e4m3fn).float()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert y[0, 2] == -0.3125 and y[1, 1] == pytest.approx(0.01953125)  # E4M3 neighbours
    rows = fake_quant(x, "fp8", axis=-1)  # row 1's amax 2 → scale 2/448
    s = 2.0 / 448.0
    assert rows[1, 0] == pytest.approx(2.0) and rows[1, 1] == pytest.approx(
        float(torch.tensor(0.02 / s).to(torch.float8_e4m3fn).float()) * s)
    big = torch.tensor([1e6, -3e6])
    torch.testing.assert_close(fake_quant(big, "fp8"), big, rtol=0.07, atol=0)


def test_bad_input_is_refused_clearly():
    with pytest.raises(InputError, match="precision must be one of native, fp8, nvfp4"):
        fake_quant(torch.ones(2), "fp4")
    with pytest.raises(InputError, match="floating-point"):
        fake_quant(torch.ones(2, dtype=torch.int64), "fp8")
    with pytest.raises(InputError, match="finite"):
        fake_quant(torch.tensor([1.0, float("nan")]), "nvfp4")
    with pytest.raises(InputError, match="axis is not a setting"):
        fake_quant(torch.ones(16), "nvfp4", axis=0)


def test_against_torchao_when_installed():
    torchao = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor",
                                  reason="torchao (optional test dependency) is not installed")
    torch.manual_seed(0)
    for x in (torch.randn(4, 64), torch.randn(8, 128) * torch.logspace(-3, 2, 128),
              torch.randn(3, 32) * 1e-4):
        ref = torchao.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=x.abs().max() / (448 * 6))
        np.testing.assert_array_equal(fake_quant(x, "nvfp4").numpy(),
                                      ref.dequantize(torch.float32).numpy())


def test_profiles_price_low_precision_only_where_the_gpu_has_it():
    from workbench.sim.profiles import get_profile

    b200, h200, a100 = get_profile("b200"), get_profile("h200"), get_profile("a100-40gb")
    flops, nbytes = 4e12, 2e9  # compute-bound on every profile
    assert b200.supports("nvfp4") and b200.supports("fp8") and b200.supports("native")
    assert h200.supports("fp8") and not h200.supports("nvfp4")
    assert not a100.supports("fp8") and not a100.supports("nvfp4")
    nat = b200.precision_compute_time(flops, nbytes, "native")
    assert nat == b200.compute_time(flops, nbytes)
    fp4 = b200.precision_compute_time(flops, nbytes, "nvfp4")
    assert fp4 == pytest.approx(b200.kernel_overhead_s + flops / 9000e12)
    # memory-bound: the weights' bytes shrink to 4.5 / 16
    t = b200.precision_compute_time(1.0, 16e9, "nvfp4")
    assert t == pytest.approx(b200.kernel_overhead_s + 4.5e9 / 7.7e12)
    # no FP4 on Hopper, no FP8 on Ampere: priced as native, no invented speedup
    assert h200.precision_compute_time(flops, nbytes, "nvfp4") == h200.compute_time(flops, nbytes)
    assert a100.precision_compute_time(flops, nbytes, "fp8") == a100.compute_time(flops, nbytes)
    assert h200.precision_compute_time(flops, nbytes, "fp8") < h200.compute_time(flops, nbytes)


def test_hostile_inputs_get_clear_errors_or_finite_values():
    """From the issue-15 hostile probe: values whose scale underflows float32 quantise to 0
    (they were NaN), one value works as a row of one, non-tensors and bad axes are refused
    naming them, a float64 beyond float32's range says so."""
    for p in ("fp8", "nvfp4"):
        out = fake_quant(torch.tensor([1e-45, 0.0]), p)
        assert torch.isfinite(out).all() and (out == 0).all()
        assert fake_quant(torch.tensor(3.0), p).shape == ()
    assert float(fake_quant(2.9, "fp8")) == pytest.approx(2.9)
    for bad in ("x", None, {"a": 1}, [[1.0], [1.0, 2.0]]):
        with pytest.raises(InputError, match="needs a tensor"):
            fake_quant(bad)
    for axis in (2, -3, 1.0, True, "x"):
        with pytest.raises(InputError, match="axis must be None or a dimension"):
            fake_quant(torch.ones(2, 3), "fp8", axis=axis)
    with pytest.raises(InputError, match="beyond its range"):
        fake_quant(torch.tensor([1e300], dtype=torch.float64), "fp8")
    with pytest.raises(InputError, match="meta tensor"):
        fake_quant(torch.ones(4, device="meta"), "fp8")
