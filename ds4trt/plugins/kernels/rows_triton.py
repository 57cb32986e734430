"""The cache rows a step proposes (model/state.py LayerRows), one Triton kernel each, a program per token, so for any
number of tokens (decode, verify, draft, prefill chunks):

    kv_row_triton(kva [T, d] f32, norm [d], cos [T, n_rot/2], sin, eps, post, n_nope) -> raw [T, d] f32
        = model/attention.py kv_row: RMS norm, RoPE tail, for post "fp8" the FP8 round trip and f16 precision
    compress_emit_triton(kv [T, coff*c] f32, score [T, coff*c], state_kv [coff*R, coff*c], state_score, start 0-d int64,
                         norm [c] f32, freq [n_rot/2] f64, ratio, post, n_nope, eps) -> rows [T, c] f32
        = model/attention.py emit_rows
kva, kv and score may be column slices of a wider [T, *] tensor (their rows are read in place).

kv_row: program t does token t's row (compiled PyTorch made three kernels of it: the norm's and the FP8 blocks'
reductions and the rotation between them).

compress_emit: token t (position p = start + t) emits a row when (p + 1) % R == 0: the softmax-weighted pool, per dim,
of the candidates of its block (the R positions p+1-R .. p; ratio 4 also the R before them, in the first half of the
width, its own block in the second half), RMS-normed, its RoPE tail rotated at the block's first position p+1-R,
rounded by `post` (model/attention.py POSTS: "fp8" the FP8 E4M3 round trip of dims [0, n_nope) in blocks of 64, the
last one shorter; "fp4" the indexer's Hadamard + FP4 E2M1 round trip in blocks of min(32, c); "none"). A candidate at
or after `start` is a row of this step's kv / score, one before it the state's slot q % (coff*R), one before position
0 weighs nothing. Program t does token t. A token that does not emit (R - 1 of every R decode steps) stores its zero
row and reads nothing else, so a decode step's compressor costs one launch (compiled PyTorch made 5-7 kernels of each
compressor, the indexer's Hadamard butterflies alone two). The pool is one pass over the candidates, TILE / c at a
time (online softmax).

The FP8 / FP4 rounding repeats model/numerics.py's float32 operations, so given the same normed and rotated row both
kernels give PyTorch's rows to the bit (tests/test_kernels.py checks that); the pool and the norms sum in another
order than PyTorch (~1e-7 relative).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.model.attention import POSTS
from ds4trt.model.numerics import FP4_BLOCK, FP4_MIN_AMAX, FP8_BLOCK, FP8_MAX, FP8_MIN_AMAX
from ds4trt.model.state import NEG
from ds4trt.plugins.kernels.int_dot import rint
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch
from ds4trt.plugins.kernels.qat_triton import _pow2_scale, _round_fp4

TILE = 2048        # compress_emit: candidates x dims loaded per loop step (CH = TILE / c); larger tiles spill
WARPS = 8          # compress_emit's warps (sm_90 SASS at TILE: 64-108 registers per thread)
NEG_SCORE = tl.constexpr(NEG)
FP8_B, FP8_Q, FP8_MIN = tl.constexpr(FP8_BLOCK), tl.constexpr(FP8_MAX), tl.constexpr(FP8_MIN_AMAX)
FP4_MIN = tl.constexpr(FP4_MIN_AMAX)


@triton.jit
def _round_fp8(x, NOPE: tl.constexpr, C: tl.constexpr, NB: tl.constexpr):
    """model/numerics.py fp8_kv_row of x [C]: block b = dims [64b, 64b + 64) of [0, NOPE) (NB blocks, padded)."""
    d = tl.arange(0, C)
    b = tl.arange(0, NB)
    inb = ((d // FP8_B)[None, :] == b[:, None]) & (d < NOPE)[None, :]                    # [NB, C]
    amax = tl.maximum(tl.max(tl.where(inb, tl.abs(x)[None, :], 0.0), axis=1), FP8_MIN)     # [NB]
    e = _pow2_scale(amax, FP8_Q)
    e = tl.sum(tl.where(inb, e[:, None], 0), axis=0) + tl.where(d < NOPE, 0, 127)       # [C]; 2^0 past NOPE
    y = tl.minimum(tl.maximum(x * ((254 - e) << 23).to(tl.float32, bitcast=True), -FP8_Q), FP8_Q)
    a = tl.abs(y)
    ea = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)             # floor(log2 a), >= -6
    q = rint(a * ((130 - ea) << 23).to(tl.float32, bitcast=True)) * ((124 + ea) << 23).to(tl.float32, bitcast=True)
    q = tl.where(y < 0, -q, q) * (e << 23).to(tl.float32, bitcast=True)
    return tl.where(d < NOPE, q, x)


@triton.jit
def _norm_rope(x, norm_ptr, cs, sn, eps, C: tl.constexpr, NR: tl.constexpr):
    """x [C] RMS-normed (weights norm_ptr [C]), then its last NR dims rotated in pairs (2j, 2j + 1) by cs, sn [C/2]
    (pair j's; the values of the pairs before the tail are not used) -> [C]"""
    x = x * tl.rsqrt(tl.sum(x * x, axis=0) / C + eps) * tl.load(norm_ptr + tl.arange(0, C))
    x0, x1 = tl.split(tl.reshape(x, (C // 2, 2)))
    tail = tl.arange(0, C // 2) >= (C - NR) // 2
    return tl.reshape(tl.join(tl.where(tail, x0 * cs - x1 * sn, x0), tl.where(tail, x0 * sn + x1 * cs, x1)), (C,))


@triton.jit
def _kv_row(kva_ptr, kva_stride, norm_ptr, cos_ptr, sin_ptr, out_ptr, eps, C: tl.constexpr, NR: tl.constexpr,
            POST: tl.constexpr, NOPE: tl.constexpr, NB: tl.constexpr, PDL: tl.constexpr):
    """Program t: token t's row kva[t] (at kva_ptr + t * kva_stride) -> out[t] (C values, the last NR rotated)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    d = tl.arange(0, C)
    j = tl.arange(0, C // 2) - (C - NR) // 2                                            # pair j of the tail
    cs = tl.load(cos_ptr + t * (NR // 2) + j, mask=j >= 0, other=1.0)
    sn = tl.load(sin_ptr + t * (NR // 2) + j, mask=j >= 0, other=0.0)
    x = _norm_rope(tl.load(kva_ptr + t * kva_stride + d), norm_ptr, cs, sn, eps, C, NR)
    if POST == 1:
        x = _round_fp8(x, NOPE, C, NB).to(tl.float16).to(tl.float32)
    tl.store(out_ptr + t * C + d, x)


def kv_row_triton(kva: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, post: str,
                  n_nope: int) -> torch.Tensor:
    """model/attention.py kv_row for float32 rows, d (norm's width) a power of two; cos, sin of any float type (used as
    float32, as apply_rope_tail does)."""
    T, C = kva.shape
    nr = 2 * cos.shape[-1]
    if (kva.dtype != torch.float32 or T < 1 or norm.shape != (C,) or C & (C - 1) or C < 4
            or cos.shape != (T, nr // 2) or sin.shape != cos.shape or not 0 < nr <= C or post not in ("none", "fp8")
            or (post == "fp8" and not 0 < n_nope <= C)):
        raise ValueError(f"kv_row_triton: expected float32 kva [T >= 1, d] (d a power of two), norm [d], cos, "
                         f"sin [T, n_rot/2] with n_rot <= d, post 'none' or 'fp8'; got kva {kva.dtype} "
                         f"{list(kva.shape)}, norm {list(norm.shape)}, cos {list(cos.shape)}, post {post!r}, "
                         f"n_nope {n_nope}")
    out = torch.empty(T, C, dtype=torch.float32, device=kva.device)
    kva = _rows(kva)
    _kv_row[(T,)](kva, kva.stride(0), norm.contiguous(), cos.to(torch.float32).contiguous(),
                  sin.to(torch.float32).contiguous(), out, eps, C=C, NR=nr, POST=POSTS.index(post),
                  NOPE=max(n_nope, 1), NB=_fp8_blocks(n_nope), num_warps=4, **pdl_launch(kva.device))
    return out


@triton.jit
def _candidates(sc_ptr, sc_stride, ssc_ptr, start, p, i0, R: tl.constexpr, COFF: tl.constexpr, C: tl.constexpr,
                CH: tl.constexpr):
    """Candidates i0 .. i0+CH-1 of the row position p emits: their scores s [CH, C] (NEG_SCORE before position 0 and
    past the last), their rows in this step (rn [CH]) and columns there (cd [CH, C]; where `new` [CH, C]) and the
    offsets of their values in the state's rows (oo, -1 where not there)."""
    i = i0 + tl.arange(0, CH)
    q = p + 1 - COFF * R + i                                                             # positions
    col = (i // R) * C                              # ratio 4: the previous block's first half, then the second half
    d = tl.arange(0, C)[None, :]
    new = tl.broadcast_to(((q >= start) & (i < COFF * R))[:, None], (CH, C))
    old = tl.broadcast_to(((q >= 0) & (q < start) & (i < COFF * R))[:, None], (CH, C))
    rn = tl.where(q >= start, q - start, 0)
    cd = col[:, None] + d
    oo = tl.where(old, ((tl.where(q >= 0, q, 0) % (COFF * R)) * (COFF * C))[:, None] + cd, -1)
    s = tl.where(new, tl.load(sc_ptr + rn[:, None] * sc_stride + cd, mask=new, other=0.0),
                 tl.load(ssc_ptr + oo, mask=old, other=NEG_SCORE))
    return s, rn, cd, oo, new


@triton.jit
def _compress_emit(kv_ptr, kv_stride, sc_ptr, sc_stride, skv_ptr, ssc_ptr, start_ptr, norm_ptr, freq_ptr, out_ptr, eps,
                   R: tl.constexpr, COFF: tl.constexpr, C: tl.constexpr, NR: tl.constexpr, CH: tl.constexpr,
                   POST: tl.constexpr, NOPE: tl.constexpr, NB: tl.constexpr, LOG2C: tl.constexpr,
                   FP4B: tl.constexpr, PDL: tl.constexpr):
    """Program t: the row of token t -> out[t, :C]. Input rows are COFF*C wide, this step's kv and score rows
    kv_stride and sc_stride values apart."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    start = tl.load(start_ptr)
    p = start + t
    d = tl.arange(0, C)
    if (p + 1) % R == 0:
        # one pass of the online softmax: a running maximum m, the sums rescaled when it grows; the candidates
        # that weigh nothing (score NEG_SCORE: before position 0) are left out, as exp(NEG - max) is 0 in PyTorch
        m = tl.full([C], NEG_SCORE, tl.float32)
        den = tl.zeros([C], tl.float32)
        num = tl.zeros([C], tl.float32)
        for i0 in range(0, COFF * R, CH):
            s, rn, cd, oo, new = _candidates(sc_ptr, sc_stride, ssc_ptr, start, p, i0, R, COFF, C, CH)
            old = oo >= 0
            v = tl.load(kv_ptr + rn[:, None] * kv_stride + cd, mask=new, other=0.0) \
                + tl.load(skv_ptr + oo, mask=old, other=0.0)
            m_new = tl.maximum(m, tl.max(s, axis=0))
            w = tl.where(s == NEG_SCORE, 0.0, tl.exp(s - m_new[None, :]))                  # [CH, C]
            r = tl.exp(m - m_new)
            den = den * r + tl.sum(w, axis=0)
            num = num * r + tl.sum(w * v, axis=0)
            m = m_new
        # RoPE at the block's first position
        j = tl.arange(0, C // 2) - (C - NR) // 2                                        # pair j of the tail
        ang = (p + 1 - R).to(tl.float64) * tl.load(freq_ptr + j, mask=j >= 0, other=0.0)
        x = _norm_rope(num / den, norm_ptr, tl.cos(ang).to(tl.float32), tl.sin(ang).to(tl.float32), eps, C, NR)
        if POST == 1:
            x = _round_fp8(x, NOPE, C, NB)
        if POST == 2:
            x = tl.reshape(_round_fp4(tl.reshape(x, (1, C)), FP4_MIN, 1, C, LOG2C, FP4B), (C,))
        tl.store(out_ptr + t * C + d, x)
    else:
        tl.store(out_ptr + t * C + d, tl.zeros([C], tl.float32))


def compress_emit_triton(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                         start: torch.Tensor, norm: torch.Tensor, freq: torch.Tensor, ratio: int, post: str,
                         n_nope: int, eps: float) -> torch.Tensor:
    """model/attention.py emit_rows for float32 rows; c (norm's width) a power of two >= 4."""
    T, W = kv.shape
    C, nr = norm.shape[0], 2 * freq.shape[0]
    coff = W // C if C else 0
    if (kv.dtype != torch.float32 or score.shape != kv.shape or T < 1 or coff not in (1, 2)
            or W != coff * C or C & (C - 1) or C < 4 or state_kv.shape != (coff * ratio, W)
            or state_score.shape != state_kv.shape or not 0 < nr <= C or post not in POSTS
            or (post == "fp8" and not 0 < n_nope <= C)):
        raise ValueError(f"compress_emit_triton: expected float32 kv, score [T >= 1, coff*c] (coff 1 or 2, c a "
                         f"power of two), state [coff*ratio, coff*c], n_rot <= c, post in {POSTS}; got kv "
                         f"{kv.dtype} {list(kv.shape)}, score {list(score.shape)}, state {list(state_kv.shape)}, "
                         f"c {C}, n_rot {nr}, ratio {ratio}, post {post!r}, n_nope {n_nope}")
    out = torch.empty(T, C, dtype=torch.float32, device=kv.device)
    kv, score = _rows(kv), _rows(score)
    _compress_emit[(T,)](kv, kv.stride(0), score, score.stride(0), state_kv.contiguous(), state_score.contiguous(),
                         start, norm.contiguous(), freq.to(torch.float64).contiguous(), out, eps,
                         **emit_constexprs(ratio, coff, C, nr, post, n_nope), num_warps=WARPS, **pdl_launch(kv.device))
    return out


def emit_constexprs(ratio: int, coff: int, c: int, n_rot: int, post: str, n_nope: int) -> dict:
    """_compress_emit's compile-time arguments for a compressor of this shape and rounding."""
    return dict(R=ratio, COFF=coff, C=c, NR=n_rot, CH=max(1, min(TILE // c, triton.next_power_of_2(coff * ratio))),
                POST=POSTS.index(post), NOPE=max(n_nope, 1),
                NB=_fp8_blocks(n_nope), LOG2C=c.bit_length() - 1,
                FP4B=min(FP4_BLOCK, c))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, W] as the kernels read it: rows x.stride(0) values apart, each row's values adjacent. A step's inputs are
    column slices of its projections' one output (LinearGroup) and are used in place: a copy of each was a kernel of
    its own in every verify step (~2 us each, 2-3 per layer)."""
    return x if x.stride(1) == 1 else x.contiguous()


def _fp8_blocks(n_nope: int) -> int:
    """_round_fp8's NB: the FP8 blocks of n_nope dims, padded to a power of two."""
    return triton.next_power_of_2(max(1, triton.cdiv(n_nope, FP8_BLOCK)))
