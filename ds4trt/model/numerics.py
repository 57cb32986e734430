"""Elementwise numerics shared by every layer: RMSNorm and ds4's quantization round trips.

`ds4` numerics (the default) reproduce what ds4 does to stored rows (spec ds4_architecture.md §3.0):
  * FP8 E4M3FN round trip of the non-RoPE dims of every KV row, power-of-two scale per 64-dim block;
  * Hadamard(n)/sqrt(n) + FP4 E2M1 round trip (blocks of 32) of indexer queries and keys.
`float` numerics skip both (this is what transformers computes).
All functions are plain torch ops so the same code exports to ONNX.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP8_BLOCK = 64
FP4_MAX = 6.0
FP4_BLOCK = 32
FP8_MIN_AMAX = 1e-4
FP4_MIN_AMAX = 7.052966104933725e-38


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim, times `weight` if given."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def _pow2_ceil_log2(a: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(a)) for a > 0, exactly (frexp: a = m * 2**e with m in [0.5, 1))."""
    m, e = torch.frexp(a)
    e = torch.where(m == 0.5, e - 1, e)
    return torch.ldexp(torch.ones_like(a), e)


def _block_scale(x: torch.Tensor, block: int, qmax: float, min_amax: float):
    """Split the last dim into blocks; return (blocks [..., nb, block], scale [..., nb, 1])."""
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"row width {n} is not a multiple of the quantization block {block}")
    xb = x.reshape(*x.shape[:-1], n // block, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(min_amax)
    return xb, _pow2_ceil_log2(amax / qmax)


def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round values already within [-448, 448] to the nearest E4M3FN value, ties to even."""
    a = y.abs()
    _, e = torch.frexp(a)                      # a = m * 2**e, m in [0.5, 1): floor(log2 a) = e - 1
    e = torch.clamp(e - 1, min=-6)             # below 2**-6 the spacing is the subnormal one, 2**-9
    step = torch.ldexp(torch.ones_like(a), e - 3)
    return torch.sign(y) * torch.round(a / step) * step


def fp8_roundtrip(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """ds4's FP8 E4M3 simulation of a row segment (last dim a multiple of `block`)."""
    xb, s = _block_scale(x, block, FP8_MAX, FP8_MIN_AMAX)
    q = round_e4m3(torch.clamp(xb / s, -FP8_MAX, FP8_MAX)) * s
    return q.reshape(x.shape)


def fp8_kv_row(x: torch.Tensor, n_nope: int) -> torch.Tensor:
    """FP8 on dims [0, n_nope) of each row, RoPE dims untouched. n_nope not a multiple of 64 → the
    last block is shorter (tiny test models); Flash has 448 = 7 blocks."""
    nope, rope = x[..., :n_nope], x[..., n_nope:]
    full = (n_nope // FP8_BLOCK) * FP8_BLOCK
    parts = []
    if full:
        parts.append(fp8_roundtrip(nope[..., :full], FP8_BLOCK))
    if n_nope > full:
        parts.append(fp8_roundtrip(nope[..., full:], n_nope - full))
    return torch.cat(parts + [rope], dim=-1)


def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round values within [-6, 6] to the FP4 E2M1 grid {0,.5,1,1.5,2,3,4,6}, ties to the even code."""
    a = y.abs()
    lo = torch.round(a * 2) / 2                # [0, 2]: spacing 0.5, code = 2a (even code = round-half-even)
    mid = 2 + torch.round(a - 2)               # [2, 4]: spacing 1, code = 4 + (a - 2)
    hi = 4 + 2 * torch.round((a - 4) / 2)      # [4, 6]: spacing 2, code = 6 + (a - 4) / 2
    q = torch.where(a <= 2, lo, torch.where(a <= 4, mid, hi))
    return torch.sign(y) * q


def fp4_roundtrip(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    xb, s = _block_scale(x, block, FP4_MAX, FP4_MIN_AMAX)
    q = round_e2m1(torch.clamp(xb / s, -FP4_MAX, FP4_MAX)) * s
    return q.reshape(x.shape)


def hadamard_matrix(n: int, dtype=torch.float32) -> torch.Tensor:
    """Sylvester Hadamard H_ij = (-1)^popcount(i & j), scaled by 1/sqrt(n) (orthonormal)."""
    i = torch.arange(n)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype) / n ** 0.5


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ hadamard_matrix(n).T along the last dim (n a power of two) by the fast Walsh-Hadamard transform: log2(n)
    butterfly stages of sums and differences, then 1/sqrt(n). Elementwise ops only, so a compiler fuses them into one
    kernel (as a matrix product, [64 heads, 128] @ [128, 128] was a cuBLAS SGEMM with a split-K reduction)."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < n:
        y = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return x * n ** -0.5


def indexer_qat(x: torch.Tensor) -> torch.Tensor:
    """ds4's indexer quantization-aware rounding: rotate by H/sqrt(n), then FP4 round trip."""
    return fp4_roundtrip(hadamard_rotate(x), min(FP4_BLOCK, x.shape[-1]))


def round_f16(x: torch.Tensor) -> torch.Tensor:
    """ds4 stores raw KV rows at f16 precision."""
    return x.to(torch.float16).to(x.dtype)
