"""The indexer's scores of a decode or verify step in Triton (model/attention.py index_score): for each query row t
and compressed row k, sum over the heads h of w[t, h] * relu(q[t, h] . key[k]).

    index_score_triton(w [T, nh] f32, q [T, nh, di] f32, keys [K, di] f32) -> [T, K] f32, T <= MAX_T
    index_score_long_triton(the same) for any T (prefill chunks)

One launch, grid (T, K / KB): a program loads KB keys and the row's queries of all heads (padded to a power of two,
at least 16) and forms their [heads, KB] products as one tl.dot on the tensor cores in "tf32x3" (each operand
split into a tf32 high part and a tf32 remainder, three products: float32 accuracy, held to 1e-5 of float64 by the
tests), then the relu and the weighted sum over the heads, so the [T, nh, K] products are never stored. On the H200
(64 heads of 128, T = 1; bench_kernels.py --cases index): 2.6 / 3.1 / 4.2 / 7.4 us over 1028 / 4100 / 8196 / 16384
keys; the same dot in "ieee" (float32 FMA, 16 keys per program) took 7.5 / 13.1 / 25.7 / 50.8 us. (A loop over the
heads, one dot per head, took 15.7 us for 65 keys: 64 dependent reductions.) In the compiled PyTorch step the same
scores were a cuBLAS SGEMM with a split-K reduction, a division, the relu and a batched GEMV (~13 us per indexer
layer at Flash width, 2k context, on the H200: the 4-layer trace in BENCHMARKS.md).

The long version turns the loops around: program (key block, query block) keeps its BN keys (as float16 parts,
parts.py) while it walks TB queries, each one dot of [heads, di] x [di, BN] as three float16 tensor-core products
(~2e-7 relative), then the relu and the weighted sum; each query's q is read once per key block. (The short
kernel at long T re-read every query's q per 16 keys; in a 2048-token prefill the float32 einsums took ~4.4 ms
per indexer layer at Flash width on the H200.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.parts import split_parts
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_T = 16       # index_score_triton's query limit (decode and verify steps)
CONFIG = (32, 4, "tf32x3")   # (keys KB per program, warps, the dot's input precision) of _index_score: bench_kernels
# sweep on the H200, T = 1, us over 1028 / 4100 / 8196 / 16384 keys: 2.62 / 3.05 / 4.16 / 7.38 (16, 4: 2.42 / 4.34 /
# 5.90 / 10.11; 64, 4: 3.57 / 3.73 / 4.02 / 6.07; 32, 8: 3.62 / 4.00 / 7.37 / 14.05; all tf32x3)
LONG_CONFIG = (64, 8, 4)     # (keys BN, queries TB, warps) of _index_score_long: bench_kernels sweep, 118.6 us
# per 256-query block over 1553 rows on the H200 (64, 16, 4: 180; 64, 32, 4: 119.7; 128, 16, 4: 123.1)


@triton.jit
def _index_score(w_ptr, q_ptr, k_ptr, out_ptr, K, NH, NHP: tl.constexpr, DI: tl.constexpr, KB: tl.constexpr,
                 PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    kk = tl.program_id(1) * KB + tl.arange(0, KB)
    km = kk < K
    h = tl.arange(0, NHP)
    hm = h < NH
    c = tl.arange(0, DI)
    keys = tl.load(k_ptr + kk[:, None].to(tl.int64) * DI + c[None, :], mask=km[:, None], other=0.0)   # [KB, DI]
    q = tl.load(q_ptr + (t * NH + h[:, None]) * DI + c[None, :], mask=hm[:, None], other=0.0)         # [NHP, DI]
    s = tl.dot(q, tl.trans(keys), input_precision=PRECISION)                                       # [NHP, KB]
    w = tl.load(w_ptr + t * NH + h, mask=hm, other=0.0)                                            # [NHP]
    tl.store(out_ptr + t.to(tl.int64) * K + kk, tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0), mask=km)


def index_score_triton(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                       config: tuple[int, int, str] | None = None) -> torch.Tensor:
    """model/attention.py index_score for float32 w [T, nh], q [T, nh, di] (T <= MAX_T, di a power of two and at
    least 16), keys [K, di]. config: CONFIG's fields, overriding it (sweeps; the precision "ieee" or "tf32x3")."""
    T, NH, DI = q.shape
    K = keys.shape[0]
    if not 1 <= T <= MAX_T or DI & (DI - 1) or DI < 16 or w.shape != (T, NH) or keys.shape != (K, DI) \
            or not all(x.dtype == torch.float32 for x in (w, q, keys)):
        raise ValueError(f"index_score_triton: expected float32 w [T, nh], q [1..{MAX_T}, nh, di] (di a power of "
                         f"two, at least 16), keys [K, di]; got w {w.dtype} {list(w.shape)}, "
                         f"q {q.dtype} {list(q.shape)}, keys {keys.dtype} {list(keys.shape)}")
    kb, warps, precision = config or CONFIG
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    if K:
        _index_score[(T, triton.cdiv(K, kb))](w.contiguous(), q.contiguous(), keys.contiguous(), out, K, NH,
                                               NHP=max(16, triton.next_power_of_2(NH)), DI=DI, KB=kb,
                                               PRECISION=precision, num_warps=warps, **pdl_launch(q.device))
    return out


@triton.jit
def _index_score_long(w_ptr, qh_ptr, ql_ptr, kh_ptr, kl_ptr, out_ptr, T, K, NH, NHP: tl.constexpr,
                      DI: tl.constexpr, BN: tl.constexpr, TB: tl.constexpr):
    """Program (j, i): keys j*BN.., queries i*TB.. (q and keys as float16 parts hi + lo)."""
    kk = tl.program_id(0) * BN + tl.arange(0, BN)
    km = kk < K
    c = tl.arange(0, DI)
    h = tl.arange(0, NHP)
    hm = h < NH
    krow = kk.to(tl.int64)[:, None] * DI + c[None, :]
    kh = tl.trans(tl.load(kh_ptr + krow, mask=km[:, None], other=0.0))                           # [DI, BN]
    kl = tl.trans(tl.load(kl_ptr + krow, mask=km[:, None], other=0.0))
    for i in range(TB):
        t = tl.program_id(1) * TB + i
        if t < T:
            qrow = (t * NH + h[:, None]).to(tl.int64) * DI + c[None, :]
            qh = tl.load(qh_ptr + qrow, mask=hm[:, None], other=0.0)                                 # [NHP, DI]
            ql = tl.load(ql_ptr + qrow, mask=hm[:, None], other=0.0)
            s = tl.dot(qh, kh)
            s = tl.dot(ql, kh, s)
            s = tl.dot(qh, kl, s)                                                                    # [NHP, BN]
            w = tl.load(w_ptr + t * NH + h, mask=hm, other=0.0)
            tl.store(out_ptr + t.to(tl.int64) * K + kk, tl.sum(w[:, None] * tl.maximum(s, 0.0), axis=0), mask=km)


def index_score_long_triton(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor,
                            config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """model/attention.py index_score for float32 w [T, nh], q [T, nh, di] (any T; di a power of two, at least 16),
    keys [K, di], q and keys within float16's range (the model's are FP4-rounded). config: LONG_CONFIG's fields,
    overriding it (sweeps)."""
    T, NH, DI = q.shape
    K = keys.shape[0]
    if DI & (DI - 1) or DI < 16 or w.shape != (T, NH) or keys.shape != (K, DI) \
            or not all(x.dtype == torch.float32 for x in (w, q, keys)):
        raise ValueError(f"index_score_long_triton: expected float32 w [T, nh], q [T, nh, di] (di a power of two, at "
                         f"least 16), keys [K, di]; got w {w.dtype} {list(w.shape)}, q {q.dtype} {list(q.shape)}, "
                         f"keys {keys.dtype} {list(keys.shape)}")
    bn, tb, warps = config or LONG_CONFIG
    out = torch.empty(T, K, dtype=torch.float32, device=q.device)
    if T and K:
        _index_score_long[(triton.cdiv(K, bn), triton.cdiv(T, tb))](
            w.contiguous(), *split_parts(q.contiguous()), *split_parts(keys.contiguous()),
            out, T, K, NH,
            NHP=max(16, triton.next_power_of_2(NH)), DI=DI, BN=bn, TB=tb, num_warps=warps)
    return out
