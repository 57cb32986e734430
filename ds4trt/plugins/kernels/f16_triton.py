"""F16 matrix products in Triton (the routers, compressors and indexer projections, kept as float16): out = x @ W.T
for T = 1..MAX_T rows of x (up to LAUNCH_T per launch), W read as float16 and accumulated in float32.

    f16_matmul(x [T, K] f32, w [N, K] f16) -> [T, N] f32, 1 <= T <= MAX_T

w is read before the wait for the kernel launched just before (PDL), so that kernel must not write it (here w is
always a weight).

One launch, grid (N / BR): a program holds BR rows of W in tiles of BK values (16-byte loads along K, the f16
values made exact float32) and multiplies each by the T rows of x into [BR, BK] float32 partial products,
reduced across the lanes once at the end. launch_shape picks (BR, BK) from N and T as measured on the H200. The
CUDA backend held these tensors as float32 for cuBLAS GEMVs: twice the bytes. A tensor-core form (q8_mma.cu's F16W,
the forty-first session) was slower at every Flash shape for T <= 5 and was removed (BENCHMARKS.md, the forty-second
session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_T = 16              # rows of x per call (decode and verify steps); longer ones (prefill) use torch
LAUNCH_T = 4            # rows of x per launch: a call of more rows launches once per 4, each reading w again
TILE = 2048             # BR * BK at most: 16 float32 partial products per thread and row of x at 4 warps


@triton.jit(do_not_specialize=["KS"])
def _f16_rows(x_ptr, w_ptr, out_ptr, N, KS, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, TP: tl.constexpr,
              PDL: tl.constexpr):
    """out[0:TP, rows] for BR rows of w from program_id(0) * BR. KS (= K) is w's row stride as a runtime value the
    compiler only knows to be a multiple of 4: w is then read 4 halves (8 bytes) per load, and x, read in the same
    [BR, BK] shape, 4 floats per load, so both tiles get one layout (8-byte f16 loads against 16-byte f32 loads
    gave two, and the loop converted x through shared memory). The first tile of w is requested before the wait for
    the previous kernel (pdl_enter): weights, which no kernel of a step writes, so their load overlaps that kernel's
    last programs."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = rows < N
    c = tl.arange(0, BK)[None, :]
    wp = w_ptr + tl.multiple_of(rows.to(tl.int64) * KS, 4)[:, None] + c                  # [BR, BK]
    xo = c + 0 * rows[:, None]                                                           # [BR, BK]: x's offsets
    w_first = tl.load(wp, mask=rm[:, None] & (c < K), other=0.0)
    pdl_enter(PDL)
    zero = tl.zeros([BR, BK], tl.float32)
    acc0, acc1, acc2, acc3 = _f16_tile(zero, zero, zero, zero, w_first.to(tl.float32), x_ptr, 0, xo, c < K, K, TP)
    for k in range(BK, K, BK):
        km = k + c < K
        w = tl.load(wp + k, mask=rm[:, None] & km, other=0.0).to(tl.float32)
        acc0, acc1, acc2, acc3 = _f16_tile(acc0, acc1, acc2, acc3, w, x_ptr, k, xo, km, K, TP)
    tl.store(out_ptr + rows, tl.sum(acc0, axis=1), mask=rm)
    if TP > 1:
        tl.store(out_ptr + N + rows, tl.sum(acc1, axis=1), mask=rm)
    if TP > 2:
        tl.store(out_ptr + 2 * N + rows, tl.sum(acc2, axis=1), mask=rm)
    if TP > 3:
        tl.store(out_ptr + 3 * N + rows, tl.sum(acc3, axis=1), mask=rm)


@triton.jit
def _f16_tile(acc0, acc1, acc2, acc3, w, x_ptr, k, xo, km, K: tl.constexpr, TP: tl.constexpr):
    """The [BR, BK] partial products of w's tile at k (float32) with x's rows 0..TP-1 added to acc0..acc3."""
    acc0 += w * tl.load(x_ptr + k + xo, mask=km, other=0.0)
    if TP > 1:
        acc1 += w * tl.load(x_ptr + K + k + xo, mask=km, other=0.0)
    if TP > 2:
        acc2 += w * tl.load(x_ptr + 2 * K + k + xo, mask=km, other=0.0)
    if TP > 3:
        acc3 += w * tl.load(x_ptr + 3 * K + k + xo, mask=km, other=0.0)
    return acc0, acc1, acc2, acc3


def launch_shape(N: int, K: int, T: int) -> tuple[int, int]:
    """(rows per program, K tile) for T rows of x, from the sweeps of scripts/bench_kernels.py --cases f16 on the
    H200 (2026-11-30): one row of x is fastest with K tiles of 1024 and one or two rows per program (the
    indexer's 8192 x 1024 query projection 9.6 -> 5.7 us against 32 x 64, the 2624-row group 9.9 -> 7.1 us);
    four rows of x want about N / 1024 rows per program and shorter tiles (8192 rows: 8 x 256)."""
    if T == 1:
        br, bk = (1 if N < 2048 else 2), 1024
    else:
        br = min(64, max(2, triton.next_power_of_2(-(-N // 1024))))
        bk = TILE // br
    return br, min(bk, triton.next_power_of_2(K))


def f16_matmul(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int] | None = None) -> torch.Tensor:
    """x: float32 [T, K] (1 <= T <= MAX_T), w: float16 [N, K] -> float32 [T, N] = x @ w.T, one launch per LAUNCH_T
    rows of x (verify steps of 5..16 rows read w up to 4 times; the alternative, prefill's float16 GEMM, would round
    x to float16). config: (rows per program, K tile), overriding launch_shape
    (sweeps)."""
    T, K = x.shape
    if not 1 <= T <= MAX_T or x.dtype != torch.float32 or w.dtype != torch.float16 or w.dim() != 2 \
            or w.shape[1] != K:
        raise ValueError(f"f16_matmul: expected float32 x [1..{MAX_T}, K] and float16 w [N, K], got x {x.dtype} "
                         f"{list(x.shape)}, w {w.dtype} {list(w.shape)}")
    N = w.shape[0]
    out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    x, w = x.contiguous(), w.contiguous()
    for t0 in range(0, T, LAUNCH_T):
        tp = min(LAUNCH_T, T - t0)
        br, bk = config or launch_shape(N, K, tp)
        _f16_rows[(triton.cdiv(N, br),)](x[t0:t0 + tp], w, out[t0:t0 + tp], N, K, K=K, BR=br, BK=bk, TP=tp,
                                         num_warps=4, **pdl_launch(x.device))
    return out
