"""The attention queries' per-head RMS norm and rotary embedding (model/attention.py head_norm_rope) in one pass, for
every step (decode, verify, prefill chunks):

    head_norm_rope_triton(x [T, H, d] f32, cos [T, n_rot/2] f32, sin, eps) -> [T, H, d] f32
        = apply_rope_tail(rms_norm(x, None, eps), cos[:, None], sin[:, None])
    head_norm_rope_triton(x, cos, sin, eps, row_scale=s [T], out_dtype=torch.float16)
        = the same of x * s[:, None, None], rounded to float16: a prefill chunk's queries straight from q_b's
          tensor-core product before its rows are scaled back (runtime/backends/cuda.py queries_kernel), as the
          prefill attention reads them (one float16 part)

Eager PyTorch read and wrote the [T, H, d] queries about five times (square, mean, scale, the tail's rotation and the
concatenation of head and tail; 268 MB each at 2048 tokens of Flash's 64 heads x 512); here once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

HEADS = 4          # heads per program
WARPS = 4


@triton.jit
def _head_norm_rope(x_ptr, s_ptr, cos_ptr, sin_ptr, out_ptr, H, eps, D: tl.constexpr, DP: tl.constexpr,
                    NR: tl.constexpr, NP: tl.constexpr, HB: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr):
    """Program (t, i): heads i*HB .. of token t. D values per head (DP: D padded to a power of two), the last NR
    rotated in pairs (NP: NR/2 padded). SCALED: x's row t stands for x * s[t]. The results are stored in out's type."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    row = (t * H + h)[:, None] * D                                                   # [HB, 1]
    hm = (h < H)[:, None]
    c = tl.arange(0, DP)[None, :]
    st = tl.load(s_ptr + t) if SCALED else 1.0
    x = tl.load(x_ptr + row + c, mask=hm & (c < D), other=0.0)                       # [HB, DP]
    if SCALED:
        x = x * st
    r = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]                           # [HB, 1]
    tl.store(out_ptr + row + c, (x * r).to(out_ptr.dtype.element_ty), mask=hm & (c < D - NR))
    i = tl.arange(0, NP)[None, :]                                                    # pair index
    pm = hm & (i < NR // 2)
    cs = tl.load(cos_ptr + t * (NR // 2) + i, mask=i < NR // 2, other=0.0)           # [1, NP]
    sn = tl.load(sin_ptr + t * (NR // 2) + i, mask=i < NR // 2, other=0.0)
    p = row + (D - NR) + 2 * i                                                       # [HB, NP]
    x0 = tl.load(x_ptr + p, mask=pm, other=0.0)
    x1 = tl.load(x_ptr + p + 1, mask=pm, other=0.0)
    if SCALED:
        x0, x1 = x0 * st, x1 * st
    x0, x1 = x0 * r, x1 * r
    tl.store(out_ptr + p, (x0 * cs - x1 * sn).to(out_ptr.dtype.element_ty), mask=pm)
    tl.store(out_ptr + p + 1, (x0 * sn + x1 * cs).to(out_ptr.dtype.element_ty), mask=pm)


def head_norm_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                          row_scale: torch.Tensor | None = None,
                          out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """model/attention.py head_norm_rope for float32 x [T, H, d] and cos, sin [T, n_rot/2] (any float type: used as
    float32, as apply_rope_tail does); row_scale: float32 [T], x's rows standing for x * row_scale; out_dtype:
    float32 or float16 (each result rounded to nearest even)."""
    T, H, D = x.shape
    nr = 2 * cos.shape[-1]
    if x.dtype != torch.float32 or cos.shape != (T, nr // 2) or sin.shape != cos.shape or not 0 < nr <= D \
            or out_dtype not in (torch.float32, torch.float16) \
            or row_scale is not None and (row_scale.shape != (T,) or row_scale.dtype != torch.float32):
        raise ValueError(f"head_norm_rope_triton: expected float32 x [T, H, d] and cos, sin [T, n_rot/2] with "
                         f"n_rot <= d, row_scale float32 [T] if any, a float32 or float16 output, got x {x.dtype} "
                         f"{list(x.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}, row_scale "
                         f"{None if row_scale is None else (row_scale.dtype, list(row_scale.shape))}, {out_dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if T:
        _head_norm_rope[(T, triton.cdiv(H, HEADS))](
            x, x if row_scale is None else row_scale.contiguous(), cos.to(torch.float32).contiguous(),
            sin.to(torch.float32).contiguous(), out, H, eps, D=D, DP=triton.next_power_of_2(D), NR=nr,
            NP=triton.next_power_of_2(nr // 2), HB=HEADS, SCALED=row_scale is not None, num_warps=WARPS,
            **pdl_launch(x.device))
    return out
