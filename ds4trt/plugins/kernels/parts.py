"""float32 operands as float16 parts for the tensor cores: a = hi + lo, and a product of two such operands as the
three products hi*hi + lo*hi + hi*lo accumulated in float32 (~2e-7 relative, like float32 FMA; the lo*lo term is
below 2^-22 of |a| |b|). The prefill kernels (attn_triton.attend_long_triton, index_triton.index_score_long_triton)
take their operands this way."""

from __future__ import annotations

import torch


def f16_parts(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 a -> (hi, lo) float16 with a = hi + lo to within ~2^-22 |a| (for |a| < 65504; lo is subnormal, so
    coarser in relative terms, where |a| < ~0.1: a small absolute error)."""
    hi = a.to(torch.float16)
    return hi, (a - hi.float()).to(torch.float16)
