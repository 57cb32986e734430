"""float32 operands as two float16 parts for the tensor cores: a = hi + lo to ~2^-22 |a| for |a| < 65504, and a
product of two such operands as the three products hi*hi + lo*hi + hi*lo accumulated in float32 (the lo*lo term is
left out): ~2e-7 relative products, like float32 FMA. The prefill kernels' operands (attn_triton.attend_long_triton,
attend_top_triton, index_triton.index_score_long_triton).
On a GPU the float16 split is one Triton kernel (split_f16_triton: one pass; PyTorch's four passes over a prefill
chunk's queries, [256, 64, 512] per attention call, cost more than the split needs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SPLIT_BLOCK = 4096           # values per program of _split_f16


@triton.jit
def _split_f16(a_ptr, hi_ptr, lo_ptr, n, B: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * B + tl.arange(0, B)
    m = i < n
    a = tl.load(a_ptr + i, mask=m, other=0.0)
    hi = a.to(tl.float16)                                  # round to nearest even, as torch's .to(torch.float16)
    tl.store(hi_ptr + i, hi, mask=m)
    tl.store(lo_ptr + i, (a - hi.to(tl.float32)).to(tl.float16), mask=m)


def split_f16_triton(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """split_parts(a) in one kernel, bit for bit (a float32, contiguous)."""
    if a.dtype != torch.float32 or not a.is_contiguous():
        raise ValueError(f"split_f16_triton: expected a contiguous float32 tensor, got {a.dtype} {list(a.shape)}")
    hi, lo = torch.empty_like(a, dtype=torch.float16), torch.empty_like(a, dtype=torch.float16)
    if a.numel():
        _split_f16[(triton.cdiv(a.numel(), SPLIT_BLOCK),)](a, hi, lo, a.numel(), B=SPLIT_BLOCK, num_warps=4)
    return hi, lo


def split_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 a -> float16 (hi, lo) with a = hi + lo to the precision above (hi rounded to nearest even; lo is
    subnormal where |a| < ~0.1: coarser in relative terms there, a small absolute error)."""
    if a.is_cuda and a.is_contiguous():
        return split_f16_triton(a)
    hi = a.to(torch.float16)
    return hi, (a - hi.float()).to(torch.float16)
