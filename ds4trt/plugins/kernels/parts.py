"""float32 operands as two 16-bit parts for the tensor cores: a = hi + lo, and a product of two such operands as the
three products hi*hi + lo*hi + hi*lo accumulated in float32 (the lo*lo term is left out).
  float16 parts: a to ~2^-22 |a| (~2e-7 relative products, like float32 FMA) for |a| < 65504; the prefill
      kernels' operands (attn_triton.attend_long_triton, index_triton.index_score_long_triton).
  bfloat16 parts: a to ~2^-17 |a| over float32's whole range; the prefill projections
      (runtime/backends/cuda.py project_bf16_parts)."""

from __future__ import annotations

import torch


def split_parts(a: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 a -> (hi, lo) of dtype (torch.float16 or torch.bfloat16) with a = hi + lo to the precision above (hi
    rounded to nearest even; for float16, lo is subnormal where |a| < ~0.1: coarser in relative terms there, a small
    absolute error)."""
    hi = a.to(dtype)
    return hi, (a - hi.float()).to(dtype)
