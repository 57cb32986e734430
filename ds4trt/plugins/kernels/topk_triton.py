"""The indexer's top-k compressed rows of a step or prefill chunk in Triton (model/attention.py top_rows):

    top_rows_triton(score [T, N] f32, k) -> [T, k] int64, k <= N <= MAX_N
        the columns of each row's k largest scores, equal scores taken lowest column first (the set of a stable
        descending sort's first k), in ascending column order.

One launch, one program per query row, the row's N scores in registers. Each score becomes an int32 key in the
order of the floats (-0.0 counted as +0.0, as the sort compares them); a binary search over the key range, rounds
of "how many keys are >= mid", finds the k-th largest key (at most 32 rounds; it stops at the first mid with exactly
k keys at or above it, which are the k: 12-20 rounds for distinct scores of 1000-16000 rows, once the interval is
narrower than the gap between the k-th key and the next); then every column above it is taken, and the
first of those equal to it until k are taken, each stored at its rank among the taken (a prefix sum). In the
compiled PyTorch step the same choice was torch.sort of every compressed row, a radixSortKVInPlace of 21.2 us per
indexer layer once the cache holds more than k = 512 compressed rows (the CLI's default --ctx 4096 holds 1024),
whatever the context. This kernel takes 6.0 us there, 13.9 / 26.3 / 20.2 us at 4100 / 8196 / 16384 rows (32 rounds
every time: 9.4 / 18.7 / 33.1 / 27.8 us; a radix select by 8- or 4-bit digit histograms, tl.histogram: 9.4 / 36.9 /
82.4 / 70.9 us; BENCHMARKS.md, 2026-12-03).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_N = 16384    # scores per row held in one program's registers (8 warps: 64 per thread)


@triton.jit
def _top_rows(s_ptr, out_ptr, N, K: tl.constexpr, NP: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    col = tl.arange(0, NP)
    cm = col < N
    x = tl.load(s_ptr + t.to(tl.int64) * N + col, mask=cm, other=0.0) + 0.0           # -0.0 + 0.0 = +0.0
    b = x.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)          # negative floats: magnitude bits flipped, so ints order as floats
    key = tl.where(cm, key, -2147483648)        # padding: below every score's key (-inf's is -2139095041)
    lo = tl.min(tl.where(cm, key, 2147483647), axis=0).to(tl.int64)   # invariant: >= K keys >= lo, and < K keys
    hi = tl.max(key, axis=0).to(tl.int64)                              # > hi or exactly K keys >= lo = hi
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), axis=0)
        lo = tl.where(count >= K, mid, lo)
        hi = tl.where(count > K, hi, tl.where(count == K, mid, mid - 1))     # exactly K: those are the k rows
    kth = lo.to(tl.int32)                  # the k-th largest key, or a bound with exactly K keys at or above it
    above = cm & (key > kth)
    at = cm & (key == kth)
    need = K - tl.sum(above.to(tl.int32), axis=0)
    take = above | (at & (tl.cumsum(at.to(tl.int32), axis=0) <= need))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + t.to(tl.int64) * K + slot, col.to(tl.int64), mask=take)


def top_rows_triton(score: torch.Tensor, k: int, warps: int | None = None) -> torch.Tensor:
    """model/attention.py top_rows for float32 score [T, N] (k <= N <= MAX_N) -> [T, k] int64.
    warps: the program's warps, overriding the default (sweeps; each of the 32 rounds ends in a reduction over
    the row, across warps when there are several)."""
    T, N = score.shape
    if T < 1 or not 1 <= k <= N <= MAX_N or score.dtype != torch.float32:
        raise ValueError(f"top_rows_triton: expected float32 score [T >= 1, N] and 1 <= k <= N <= {MAX_N}, got "
                         f"{score.dtype} {list(score.shape)}, k {k}")
    out = torch.empty(T, k, dtype=torch.int64, device=score.device)
    NP = triton.next_power_of_2(N)
    _top_rows[(T,)](score.contiguous(), out, N, K=k, NP=NP, num_warps=warps or (8 if NP >= 2048 else 4),
                    **pdl_launch(score.device))
    return out
