"""ds4's rounding of the indexer's queries (model/numerics.py indexer_qat) in one Triton pass (every step):

    indexer_qat_triton(x [..., n] f32, block, min_amax) -> [..., n] f32, bitwise the values of indexer_qat

Per row of n values (a power of two): the Walsh-Hadamard butterflies in hadamard_rotate's order (stage h adds and
subtracts the values h apart, h = 1, 2, .., n/2), times n^-1/2, then the FP4 E2M1 round trip of each block of
`block` values (power-of-two scale 2^ceil(log2(max|x| / 6)), max|x| at least min_amax; the grid rounding of
round_e2m1, ties to the even code). Every float32 operation is the one PyTorch performs, in the same order, so the
result is the same to the bit: the FP4 rounding has ties, where any other summation order of the rotation (a
matrix product) would round some values the other way. Eager PyTorch made ~36 passes over the [T, 64, 128] queries
of a prefill chunk (a ratio-4 layer's indexer at 2048 tokens: 3.56 -> 1.60 ms with this kernel in
scripts/profile_modules.py on the H200, BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.model.numerics import FP4_MAX
from ds4trt.plugins.kernels.int_dot import rint
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

ROWS = 32          # rows per program
WARPS = 4
FP4_Q = tl.constexpr(FP4_MAX)


@triton.jit
def _pow2_scale(amax, QMAX: tl.constexpr):
    """The biased exponent e of 2^ceil(log2(amax / QMAX)) (model/numerics.py _pow2_ceil_log2; amax / QMAX normal:
    IEEE division, then the exponent bits, one more when the mantissa is not zero)."""
    bits = tl.math.div_rn(amax, QMAX).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _round_fp4(x, min_amax, BR: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr, BLOCK: tl.constexpr):
    """model/numerics.py indexer_qat of the rows x [BR, N] (N a power of two): the Hadamard butterflies scaled by
    N^-1/2, then the FP4 E2M1 round trip in blocks of BLOCK (amax at least min_amax) -> [BR, N]. Also the
    indexer compressor's rows (rows_triton)."""
    for s in tl.static_range(LOG2N):
        # stage h = 2^s: in each group of 2h values, a = the first h, b = the next h -> (a + b, a - b)
        y = tl.permute(tl.reshape(x, (BR, N // (2 << s), 2, 1 << s)), (0, 1, 3, 2))     # [BR, N/2h, h, 2]
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BR, N))
    x = tl.reshape(x * (N ** -0.5), (BR, N // BLOCK, BLOCK))
    e = _pow2_scale(tl.maximum(tl.max(tl.abs(x), axis=2), min_amax), FP4_Q)                # [BR, N/BLOCK]
    scale = (e << 23).to(tl.float32, bitcast=True)[:, :, None]
    y = tl.minimum(tl.maximum(x * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, :, None], -FP4_Q), FP4_Q)
    a = tl.abs(y)
    q = tl.where(a <= 2, rint(a * 2) * 0.5, tl.where(a <= 4, 2 + rint(a - 2), 4 + 2 * rint((a - 4) * 0.5)))
    return tl.reshape(tl.where(y < 0, -q, q) * scale, (BR, N))


@triton.jit
def _indexer_qat(x_ptr, out_ptr, R, min_amax, N: tl.constexpr, LOG2N: tl.constexpr, BLOCK: tl.constexpr,
                 BR: tl.constexpr, PDL: tl.constexpr):
    """Program i: rows i*BR .. i*BR+BR-1 of x [R, N] -> out."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    off = rows.to(tl.int64)[:, None] * N + tl.arange(0, N)[None, :]
    rm = (rows < R)[:, None]
    q = _round_fp4(tl.load(x_ptr + off, mask=rm, other=0.0), min_amax, BR, N, LOG2N, BLOCK)   # [BR, N]
    tl.store(out_ptr + off, q, mask=rm)


def indexer_qat_triton(x: torch.Tensor, block: int, min_amax: float) -> torch.Tensor:
    """model/numerics.py indexer_qat for float32 x [..., n] (n a power of two, a multiple of block)."""
    n = x.shape[-1]
    if x.dtype != torch.float32 or n & (n - 1) or n % block or block & (block - 1):
        raise ValueError(f"indexer_qat_triton: expected float32 [..., n], n a power of two and a multiple of the "
                         f"block {block} (a power of two), got {x.dtype} {list(x.shape)}")
    x = x.contiguous()
    out = torch.empty_like(x)
    R = x.numel() // n
    if R:
        _indexer_qat[(triton.cdiv(R, ROWS),)](x, out, R, min_amax, N=n, LOG2N=n.bit_length() - 1, BLOCK=block,
                                              BR=ROWS, num_warps=WARPS, **pdl_launch(x.device))
    return out
