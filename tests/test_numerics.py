"""ds4 numerics helpers (spec ds4_architecture.md §3.0) against hand-computed cases and independent
references (torch's own float8_e4m3fn cast; a brute-force nearest-grid search for FP4)."""

from __future__ import annotations

import math

import pytest
import torch

from ds4trt.model.numerics import (fp4_roundtrip, fp8_kv_row, fp8_roundtrip, hadamard_matrix, hadamard_rotate,
                                   indexer_qat, rms_norm, round_e2m1, round_e4m3)
from ds4trt.model.rope import apply_rope_tail, inv_freq
from ds4trt.model.config import ModelConfig

FP4_GRID = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)


# ---- FP8 E4M3 ----
@pytest.mark.parametrize("value, expected", [
    (448.0, 448.0),            # the largest finite E4M3FN value (code 126)
    (1.0, 1.0),
    (1.0625, 1.0),             # halfway between 1 and 1.125: ties to the even mantissa (1.0)
    (1.1875, 1.25),            # halfway between 1.125 and 1.25: even mantissa is 1.25
    (2 ** -9, 2 ** -9),        # the smallest subnormal
    (3 * 2 ** -10, 2 ** -8),   # halfway between 1 and 2 subnormal steps: to the even one (2)
    (2 ** -10, 0.0),           # halfway between 0 and the smallest subnormal: to 0
    (-300.0, -288.0),          # spacing 32 in [256, 448): 300 -> 288
    (0.0, 0.0),
])
def test_round_e4m3_hand_cases(value, expected):
    assert round_e4m3(torch.tensor([value], dtype=torch.float64)).item() == expected


def test_round_e4m3_matches_torch_float8():
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(100_000, generator=g, dtype=torch.float64) * 2 - 1) * 448
    x = torch.cat([x, x * 1e-3, x * 1e-5])
    ref = x.to(torch.float8_e4m3fn).to(torch.float64)      # round-to-nearest-even cast
    assert torch.equal(round_e4m3(x), ref)


def test_fp8_roundtrip_block_scale():
    # one 64-block with max |x| = 3.5: scale = 2^ceil(log2(3.5/448)) = 2^-7; values are quantized on x/scale
    x = torch.linspace(-3.5, 3.5, 64, dtype=torch.float64)
    s = 2.0 ** -7
    assert math.ceil(math.log2(3.5 / 448)) == -7
    expected = x.div(s).to(torch.float8_e4m3fn).to(torch.float64) * s
    assert torch.equal(fp8_roundtrip(x), expected)
    # a block of zeros uses the 1e-4 floor and stays zero
    assert torch.equal(fp8_roundtrip(torch.zeros(64, dtype=torch.float64)), torch.zeros(64, dtype=torch.float64))


def test_fp8_kv_row_leaves_rope_dims():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 512, generator=g, dtype=torch.float64)
    y = fp8_kv_row(x, 448)
    assert torch.equal(y[:, 448:], x[:, 448:])
    for b in range(7):                                     # seven independent 64-blocks
        blk = x[:, 64 * b:64 * (b + 1)]
        assert torch.equal(y[:, 64 * b:64 * (b + 1)], fp8_roundtrip(blk))
    rel = ((y[:, :448] - x[:, :448]).abs() / x[:, :448].abs().amax(-1, keepdim=True)).max()
    assert 0 < rel < 2 ** -4                               # E4M3 has 3 mantissa bits


# ---- FP4 E2M1 + Hadamard ----
@pytest.mark.parametrize("value, expected", [
    (0.25, 0.0),    # halfway 0 / 0.5 -> even code 0
    (0.75, 1.0),    # halfway 0.5 (code 1) / 1 (code 2) -> code 2
    (1.25, 1.0),    # 1 (code 2) / 1.5 (code 3) -> code 2
    (1.75, 2.0),    # 1.5 (3) / 2 (4) -> 4
    (2.5, 2.0),     # 2 (4) / 3 (5) -> 4
    (3.5, 4.0),     # 3 (5) / 4 (6) -> 6
    (5.0, 4.0),     # 4 (6) / 6 (7) -> 6
    (5.9, 6.0),
    (-2.6, -3.0),
])
def test_round_e2m1_hand_cases(value, expected):
    assert round_e2m1(torch.tensor([value], dtype=torch.float64)).item() == expected


def test_round_e2m1_is_nearest_grid_point():
    x = torch.linspace(-6, 6, 20001, dtype=torch.float64)
    dist = (x.abs()[:, None] - FP4_GRID[None, :]).abs()
    nearest = FP4_GRID[dist.argmin(1)] * torch.sign(x)
    tie = (dist.sort(1).values[:, 1] - dist.min(1).values) < 1e-12
    assert torch.equal(round_e2m1(x)[~tie], nearest[~tie])


def test_fp4_roundtrip_hand_case():
    # block of 32 with max 12: scale 2^ceil(log2(12/6)) = 2; values / 2 land on the grid as below
    x = torch.zeros(32, dtype=torch.float64)
    x[:4] = torch.tensor([12.0, -5.0, 2.4, 0.6])
    y = fp4_roundtrip(x)
    # 12/2 = 6 -> 6; -5/2 = -2.5 ties -> -2 (even code); 2.4/2 = 1.2 -> 1; 0.6/2 = 0.3 -> 0.5
    assert y[:4].tolist() == [12.0, -4.0, 2.0, 1.0]
    assert torch.equal(y[4:], torch.zeros(28, dtype=torch.float64))


def test_hadamard_is_sylvester_and_orthonormal():
    h = hadamard_matrix(8, torch.float64) * 8 ** 0.5
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    sylvester = torch.kron(torch.kron(h2, h2), h2)          # H_8 = H_2 (x) H_2 (x) H_2
    assert torch.equal(h, sylvester)
    h128 = hadamard_matrix(128, torch.float64)
    assert torch.allclose(h128 @ h128.T, torch.eye(128, dtype=torch.float64), atol=1e-12)


def test_indexer_qat_hand_case():
    # x = e_0 rotates to the constant row 1/sqrt(128): every block has max 1/sqrt(128), scale
    # 2^ceil(log2(0.0884/6)) = 2^-6, and 0.0884 / 2^-6 = 5.66 rounds to 6 -> every value 6 * 2^-6
    x = torch.zeros(128, dtype=torch.float64)
    x[0] = 1.0
    y = indexer_qat(x)
    assert torch.equal(y, torch.full((128,), 6 * 2.0 ** -6, dtype=torch.float64))


def test_hadamard_rotate_is_the_matrix_product():
    """The butterfly transform against x @ H.T on fresh random rows, float64, for every size it meets (and 1)."""
    g = torch.Generator().manual_seed(11)
    for n in (1, 2, 8, 64, 128):
        x = torch.randn(3, 5, n, generator=g, dtype=torch.float64)
        assert torch.allclose(hadamard_rotate(x), x @ hadamard_matrix(n, torch.float64).T, rtol=0, atol=1e-13)


# ---- RMSNorm, RoPE ----
def test_rms_norm_float64_reference():
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert torch.allclose(rms_norm(x, w, 1e-6).double(), ref, rtol=1e-6, atol=1e-6)


def test_yarn_table_flash():
    """Flash's compressed-layer table: pairs 0..15 unscaled, 25..31 divided by 16, a linear ramp between."""
    cfg = ModelConfig.flash()
    f_ext = 160000.0 ** (-torch.arange(32, dtype=torch.float64) / 32)
    f = inv_freq(cfg, compressed=True)
    assert torch.allclose(f[:16], f_ext[:16], rtol=1e-15)
    assert torch.allclose(f[25:], f_ext[25:] / 16, rtol=1e-15)
    i = 20
    ramp = 1 - (i - 15) / 10
    assert math.isclose(f[i].item(), f_ext[i].item() / 16 * (1 - ramp) + f_ext[i].item() * ramp, rel_tol=1e-15)
    assert torch.allclose(inv_freq(cfg, compressed=False), 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32))


def test_rope_tail_interleaved_pairs_and_inverse():
    x = torch.randn(2, 3, 24, dtype=torch.float64)
    ang = torch.tensor([0.3, 1.1, -0.7, 2.0], dtype=torch.float64)
    y = apply_rope_tail(x, torch.cos(ang), torch.sin(ang))
    assert torch.equal(y[..., :16], x[..., :16])           # only the last 8 dims (4 pairs) rotate
    x0, x1 = x[..., 16 + 2 * 1], x[..., 17 + 2 * 1]         # pair 1 = dims (18, 19)
    assert torch.allclose(y[..., 18], x0 * math.cos(1.1) - x1 * math.sin(1.1))
    assert torch.allclose(y[..., 19], x0 * math.sin(1.1) + x1 * math.cos(1.1))
    back = apply_rope_tail(y, torch.cos(ang), torch.sin(ang), inverse=True)
    assert torch.allclose(back, x, atol=1e-14)
