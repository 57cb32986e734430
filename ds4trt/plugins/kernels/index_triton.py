"""The indexer's scores of a decode or verify step in Triton (model/attention.py index_score): for each query row t
and compressed row k, sum over the heads h of w[t, h] * relu(q[t, h] . key[k]).

    index_score_triton(w [T, nh] f32, q [T, nh, di] f32, keys [K, di] f32) -> [T, K] f32, T <= MAX_T

One launch, grid (T, K / KB): a program loads KB keys and the row's queries of all heads (padded to a power of two,
at least 16) and forms their [heads, KB] products as one float32 tl.dot ("ieee": FMA, no tf32 rounding), then the
relu and the weighted sum over the heads, so the [T, nh, K] products are never stored. (A loop over the heads, one
dot per head, took 15.7 us for 65 keys: 64 dependent reductions.) In the compiled PyTorch step the same
scores were a cuBLAS SGEMM with a split-K reduction, a division, the relu and a batched GEMV (~13 us per indexer
layer at Flash width, 2k context, on the H200: the 4-layer trace in BENCHMARKS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_T = 16       # index_score_triton's query limit (decode and verify steps)
KB = 16          # keys per program


@triton.jit
def _index_score(w_ptr, q_ptr, k_ptr, out_ptr, K, NH, NHP: tl.constexpr, DI: tl.constexpr, KB: tl.constexpr,
                 PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    kk = tl.program_id(1) * KB + tl.arange(0, KB)
    km = kk < K
    h = tl.arange(0, NHP)
    hm = h < NH
    c = tl.arange(0, DI)
    keys = tl.load(k_ptr + kk[:, None].to(tl.int64) * DI + c[None, :], mask=km[:, None], other=0.0)   # [KB, DI]
    q = tl.load(q_ptr + (t * NH + h[:, None]) * DI + c[None, :], mask=hm[:, None], other=0.0)         # [NHP, DI]
    s = tl.dot(q, tl.trans(keys), input_precision="ieee")                                          # [NHP, KB]
    w = tl.load(w_ptr + t * NH + h, mask=hm, other=0.0)                                            # [NHP]
    tl.store(out_ptr + t.to(tl.int64) * K + kk, tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0), mask=km)


def index_score_triton(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """model/attention.py index_score for float32 w [T, nh], q [T, nh, di] (T <= MAX_T, di a power of two and at
    least 16), keys [K, di]."""
    T, NH, DI = q.shape
    K = keys.shape[0]
    if not 1 <= T <= MAX_T or DI & (DI - 1) or DI < 16 or w.shape != (T, NH) or keys.shape != (K, DI) \
            or not all(x.dtype == torch.float32 for x in (w, q, keys)):
        raise ValueError(f"index_score_triton: expected float32 w [T, nh], q [1..{MAX_T}, nh, di] (di a power of "
                         f"two, at least 16), keys [K, di]; got w {w.dtype} {list(w.shape)}, "
                         f"q {q.dtype} {list(q.shape)}, keys {keys.dtype} {list(keys.shape)}")
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    if K:
        _index_score[(T, triton.cdiv(K, KB))](w.contiguous(), q.contiguous(), keys.contiguous(), out, K, NH,
                                               NHP=max(16, triton.next_power_of_2(NH)), DI=DI, KB=KB, num_warps=4,
                                               **pdl_launch(q.device))
    return out
