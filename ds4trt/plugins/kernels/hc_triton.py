"""Hyper-connection kernels (model/hc.py): the reduction of the S streams to a sublayer's normed input (norm, mixer
products, Sinkhorn mixing, weighted sum, the sublayer's RMS norm) and, for prefill chunks, the streams' update.

    hc_pre_triton(X [T, S, D] f32, fn [(2+S)*S, S*D] f32, scale, base, rms_eps, hc_eps, iters, norm [D])
        -> rms_norm(y, norm) [T, D], post, comb: model/hc.py hc_pre in two launches, T <= MAX_T.
    hc_pre_long_triton(X, fn, scale, base, rms_eps, hc_eps, iters) -> y [T, D], post, comb: model/hc.py
        hc_sum_streams (hc_pre before the norm) for any T (prefill chunks): _hc_dots_long, then _hc_combine
    hc_post_triton(f [T, D] f32, X [T, S, D] f32, post [T, S], comb [T, S, S]) -> [T, S, D]
        model/hc.py hc_post in one pass over X (prefill chunks; eager PyTorch made 9 passes over the streams).
    hc_post_pre_triton(f, X, post, comb, then hc_pre_triton's fn .. norm) -> X' [T, S, D], rms_norm(y, norm), post',
        comb': model/hc.py hc_post_pre, T <= MAX_T: the update made by _hc_post_dots, which also computes the
        reduction's partials of X' (a decode step's update was an Inductor kernel of its own before them), then
        _hc_combine. f may be [T, J, D], J terms of the sublayer's output that _hc_post_dots sums (a decode step's
        routed experts' slots and shared expert: their sum was an Inductor kernel of its own).

The mixing (_mix) keeps a token's S x S matrix in registers for all the Sinkhorn iterations (the eager PyTorch
version is about 2 * iters small kernels, ~40 launches per call).
hc_pre: the RMS norm of the S*D stream values, their products with the (2+S)*S rows of fn, the mixing and the
weighted sum y = sum_s pre[s] X[s] were 7 kernels in a compiled decode step (~14.5 us, most of it launch gaps), and
the sublayer's RMS norm of y one more (Inductor's, 2.1-2.3 us on an H100). Here two: _hc_post_dots splits the D
dims of a token's streams over SPLITS programs (fn is 1.5 MB in float32 at Flash width: one SM would need ~10 us to
read it), each storing its partial products, sum of squares and the streams' S x S Gram matrix over its dims;
_hc_combine, one warp per DY outputs, adds the partials in split order (deterministic), mixes (each of a token's
programs alike: the mixing is a chain of ~40 small reductions, fastest in one warp) and writes its part of
rms_norm(y, norm): the norm's sum of squares over the whole of y is pre G pre (G the Gram matrix), so no program waits
for the others' y.
rms_norm(X) @ fn.T = rsqrt(mean(X^2) + eps) * (X @ fn.T): the scale is applied to the sums.
_hc_dots_long, for prefill chunks, computes the same partials (without G) for a block of BT tokens per program on the
tensor cores in "tf32x3" (each float32 operand as two tf32 parts, three products: ~2^-22 relative, float32's range,
which the residual stream needs: float16 parts would not hold it, and bfloat16 hi + lo parts missed the 1e-5 float64
test on the H200); several programs per block of tokens over the S*D inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_T = 16              # hc_pre_triton's token limit (decode and verify steps, where the launches count)
SPLITS = 32             # programs per token of the products, each over S*D/SPLITS inputs
# stream values per step of _hc_post_dots (S * DB): at Flash width a program's 128 dims of 4 streams in one step, so
# that sm_90's code issues every load before the math. In 2 steps of 64 dims (with the Gram matrix) the one-term
# variant's code issued the second step's loads among the first step's products: 6.0 us a call in a decode step
# against 4.0 for the 7-term variant, whose code issued them all first (H100, no PDL; BENCHMARKS.md, fifty-eighth
# session). The one-step kernel was not traced per call; the decode step it gave was timed.
KB = 512
DY = 512                # outputs y per program of the combination
# (tokens BT, inputs per step BK, splits, warps) of _hc_dots_long (sm_90: 173 registers, no spills; BK = 128 spills)
LONG_CONFIG = (64, 64, 8, 4)


@triton.jit
def _mix(row, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, ITERS: tl.constexpr, S: tl.constexpr):
    """Mixer outputs at row [(2+S)*S] -> pre (returned, and stored), post, comb (stored). Loads bypass L1 (.cg):
    _hc_combine's row was just written by other lanes of the program."""
    i = tl.arange(0, S)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i, cache_modifier=".cg") * s0 + tl.load(base_ptr + i)) + hc_eps
    post = 2 * tl.sigmoid(tl.load(row + S + i, cache_modifier=".cg") * s1 + tl.load(base_ptr + S + i))
    ab = 2 * S + i[:, None] * S + i[None, :]                     # [S, S]: source a, destination b
    logits = tl.load(row + ab, cache_modifier=".cg") * s2 + tl.load(base_ptr + ab)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps               # softmax over b
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)       # columns
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)   # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)   # columns
    tl.store(pre_ptr + i, pre)
    tl.store(post_ptr + i, post)
    tl.store(comb_ptr + (ab - 2 * S), comb)
    return pre


@triton.jit
def _hc_post_dots(f_ptr, x_ptr, post_ptr, comb_ptr, fn_ptr, xo_ptr, part_ptr, S: tl.constexpr, D: tl.constexpr,
                  MP: tl.constexpr, SPLITS: tl.constexpr, DC: tl.constexpr, DB: tl.constexpr, J: tl.constexpr,
                  UPDATE: tl.constexpr, PDL: tl.constexpr):
    """Program (t, split): dims split*DC .. split*DC+DC-1 (DB a step; those past D masked) of every stream of token t,
    UPDATE: updated as hc_post does, X'[t, b, d] = post[t, b] f[t, d] + sum_a comb[t, a, b] X[t, a, d] (its order),
    stored in xo (f [T, J, D]: f[t] is the sum of its J terms, added in order: a decode step's routed experts' slots
    and shared expert, J = k + 1); else X' = X as it is (f, post, comb, xo unused). Stores part[t, split] = (those S*DC
    values' MP dot products with the rows of fn, their sum of squares, and the S x S products of the streams' values
    sum_d X'[a, d] X'[b, d] over its dims: the Gram matrix's part, from which _hc_combine has the sum of squares of
    y = sum_s pre[s] X'[s] for its norm). The first step's tile of fn is loaded before the wait for the previous
    kernel: fn is a weight, which no kernel of a step writes."""
    t = tl.program_id(0)
    sp = tl.program_id(1)
    M: tl.constexpr = (2 + S) * S
    j = tl.arange(0, MP)
    b = tl.arange(0, S)
    jm = (j < M)[:, None, None]
    d = sp * DC + tl.arange(0, DB)
    col = b[:, None] * D + d[None, :]                                                    # [S, DB] columns of fn
    w = tl.load(fn_ptr + j[:, None, None] * (S * D) + col[None, :, :], mask=jm & (d < D)[None, None, :],
                other=0.0)                                                               # [MP, S, DB]
    pdl_enter(PDL)
    acc = tl.zeros([MP, S, DB], tl.float32)
    sq = tl.zeros([S, DB], tl.float32)
    gram = tl.zeros([S, S, DB], tl.float32)
    for d0 in tl.static_range(0, DC, DB):
        d = sp * DC + d0 + tl.arange(0, DB)
        dm = d < D
        if d0 > 0:
            col = b[:, None] * D + d[None, :]
            w = tl.load(fn_ptr + j[:, None, None] * (S * D) + col[None, :, :], mask=jm & dm[None, None, :], other=0.0)
        if UPDATE:
            fv = tl.load(f_ptr + t * (J * D) + d, mask=dm, other=0.0)
            for i in tl.static_range(1, J):
                fv += tl.load(f_ptr + (t * J + i) * D + d, mask=dm, other=0.0)
            out = tl.load(post_ptr + t * S + b)[:, None] * fv[None, :]                             # [S, DB]
            for a in tl.static_range(S):
                x = tl.load(x_ptr + (t * S + a) * D + d, mask=dm, other=0.0)                        # [DB]
                out += tl.load(comb_ptr + (t * S + a) * S + b)[:, None] * x[None, :]
            tl.store(xo_ptr + (t * S + b[:, None]) * D + d[None, :], out, mask=dm[None, :])
        else:
            out = tl.load(x_ptr + (t * S + b[:, None]) * D + d[None, :], mask=dm[None, :], other=0.0)  # [S, DB]
        sq += out * out
        gram += out[:, None, :] * out[None, :, :]
        acc += w * out[None, :, :]
    part = part_ptr + (t * SPLITS + sp) * (MP + 1 + S * S)
    tl.store(part + j, tl.sum(tl.sum(acc, axis=2), axis=1))
    tl.store(part + MP, tl.sum(tl.sum(sq, axis=1), axis=0))
    tl.store(part + MP + 1 + b[:, None] * S + b[None, :], tl.sum(gram, axis=2))


@triton.jit
def _hc_dots_long(x_ptr, f_ptr, part_ptr, T, S: tl.constexpr, D: tl.constexpr, MP: tl.constexpr,
                  SPLITS: tl.constexpr, KC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Program (i, sp): tokens i*BT.., inputs sp*KC .. sp*KC+KC-1 (a multiple of BK; those past S*D masked) -> for
    each token part[t, sp] = (its MP dot products with fn's rows, its sum of squares). f: fn [MP, S*D] float32,
    rows past (2+S)*S zero."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < T
    sp = tl.program_id(1)
    j = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], tl.float32)
    sq = tl.zeros([BT], tl.float32)
    for k0 in range(0, KC, BK):
        k = sp * KC + k0 + tl.arange(0, BK)
        km = k < S * D
        x = tl.load(x_ptr + t.to(tl.int64)[:, None] * (S * D) + k[None, :], mask=tm[:, None] & km[None, :],
                    other=0.0)                                                                            # [BT, BK]
        sq += tl.sum(x * x, axis=1)
        f = tl.load(f_ptr + j[None, :] * (S * D) + k[:, None], mask=km[:, None], other=0.0)               # [BK, MP]
        acc = tl.dot(x, f, acc, input_precision="tf32x3")
    part = part_ptr + (t.to(tl.int64) * SPLITS + sp) * (MP + 1)
    tl.store(part[:, None] + j[None, :], acc, mask=tm[:, None])
    tl.store(part + MP, sq, mask=tm)


@triton.jit
def _hc_combine(x_ptr, part_ptr, m_ptr, scale_ptr, base_ptr, norm_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr, rms_eps,
                hc_eps, ITERS: tl.constexpr, S: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, SPLITS: tl.constexpr,
                DY: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
    """Program (t, c), one warp: adds token t's partials in split order (deterministic), mixes (every program of
    the token alike; program c = 0 stores m, pre, post and comb, the others a scratch row) and writes
    y[t, c*DY .. c*DY+DY-1] (its stream values loaded first, so that their latency overlaps the mixing), y = sum_s
    pre[s] X[s]. NORM (the partials hold the streams' Gram matrix G, _hc_post_dots): rms_norm(y, norm) instead, the
    sum of squares of the token's whole y being pre G pre (sum over a, b of pre[a] G[a, b] pre[b]), so that no
    program needs the others' y. The norm weight is loaded before the wait for the previous kernel (no kernel of a
    step writes it)."""
    t = tl.program_id(0)
    c = tl.program_id(1)
    i = tl.arange(0, S)
    d = c * DY + tl.arange(0, DY)
    if NORM:
        wn = tl.load(norm_ptr + d, mask=d < D, other=0.0)
    pdl_enter(PDL)
    xs = tl.load(x_ptr + t.to(tl.int64) * (S * D) + i[:, None] * D + d[None, :], mask=(d < D)[None, :], other=0.0)
    PR: tl.constexpr = MP + 1 + (S * S if NORM else 0)                      # a partials row
    j = tl.arange(0, MP)
    dots = tl.zeros([MP], tl.float32)
    gram = tl.zeros([S, S], tl.float32)
    total = 0.0
    for s in tl.static_range(SPLITS):
        dots += tl.load(part_ptr + (t * SPLITS + s) * PR + j)
        total += tl.load(part_ptr + (t * SPLITS + s) * PR + MP)
        if NORM:
            gram += tl.load(part_ptr + (t * SPLITS + s) * PR + MP + 1 + i[:, None] * S + i[None, :])
    slot = t if c == 0 else tl.num_programs(0) + t * tl.num_programs(1) + c     # this program's own rows
    row = m_ptr + slot * MP
    tl.store(row + j, dots * tl.rsqrt(total / (S * D) + rms_eps))
    tl.debug_barrier()                          # the row is written before _mix reads it
    pre = _mix(row, scale_ptr, base_ptr, pre_ptr + slot * S, post_ptr + slot * S, comb_ptr + slot * S * S, hc_eps,
               ITERS, S)
    y = tl.sum(xs * pre[:, None], axis=0)
    if NORM:
        ysq = tl.sum(tl.sum(gram * pre[:, None] * pre[None, :], axis=1), axis=0)
        y = y * tl.rsqrt(ysq / D + rms_eps) * wn
    tl.store(y_ptr + t * D + d, y, mask=d < D)


@triton.jit
def _hc_post(f_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, S: tl.constexpr, D: tl.constexpr, DB: tl.constexpr):
    """Program (t, c): out[t, b, d] = post[t, b] f[t, d] + sum_a comb[t, a, b] X[t, a, d] for d in c*DB.., the
    terms added in hc_post's order."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * DB + tl.arange(0, DB)
    dm = d < D
    b = tl.arange(0, S)
    out = tl.load(post_ptr + t * S + b)[:, None] * tl.load(f_ptr + t * D + d, mask=dm, other=0.0)[None, :]  # [S, DB]
    for a in tl.static_range(S):
        x = tl.load(x_ptr + (t * S + a) * D + d, mask=dm, other=0.0)                                     # [DB]
        out += tl.load(comb_ptr + (t * S + a) * S + b)[:, None] * x[None, :]
    tl.store(out_ptr + (t * S + b[:, None]) * D + d[None, :], out, mask=dm[None, :])


def hc_pre_long_triton(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
                       hc_eps: float, iters: int, config: tuple[int, int, int, int] | None = None):
    """model/hc.py hc_sum_streams for float32 X [T, S, D] (any T; S a power of two) -> y [T, D], post [T, S],
    comb [T, S, S]. config: LONG_CONFIG's fields, overriding it (sweeps)."""
    T, S, D = X.shape
    M = (2 + S) * S
    bt, bk, splits, warps = config or LONG_CONFIG
    if S & (S - 1) or X.dtype != torch.float32 or fn.shape != (M, S * D) or fn.dtype != torch.float32 or iters < 1:
        raise ValueError(f"hc_pre_long_triton: expected X float32 [T, S, D] (S a power of two) and fn float32 "
                         f"[{M}, S*D], got X {X.dtype} {list(X.shape)}, fn {fn.dtype} {list(fn.shape)}, "
                         f"iters = {iters}")
    MP = max(16, triton.next_power_of_2(M))
    X = X.contiguous()
    fp = torch.zeros(MP, S * D, dtype=torch.float32, device=X.device)
    fp[:M] = fn
    part = torch.empty(T, splits, MP + 1, dtype=torch.float32, device=X.device)
    if T:
        _hc_dots_long[(triton.cdiv(T, bt), splits)](X, fp, part, T, S=S, D=D, MP=MP, SPLITS=splits,
                                                    KC=triton.cdiv(triton.cdiv(S * D, splits), bk) * bk, BT=bt,
                                                    BK=bk, num_warps=warps)
    return _combined(X, part, scale, base, rms_eps, hc_eps, iters, dict(PDL=False))


def hc_post_triton(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """model/hc.py hc_post for float32 f [T, D], X [T, S, D], post [T, S], comb [T, S, S] (S a power of two)."""
    T, S, D = X.shape
    if S & (S - 1) or f.shape != (T, D) or post.shape != (T, S) or comb.shape != (T, S, S) \
            or not all(a.dtype == torch.float32 for a in (f, X, post, comb)):
        raise ValueError(f"hc_post_triton: expected float32 f [T, D], X [T, S, D] (S a power of two), post [T, S] and "
                         f"comb [T, S, S], got f {f.dtype} {list(f.shape)}, X {X.dtype} {list(X.shape)}, post "
                         f"{list(post.shape)}, comb {list(comb.shape)}")
    out = torch.empty_like(X)
    db = min(1024, triton.next_power_of_2(D))
    if T:
        _hc_post[(T, triton.cdiv(D, db))](f.contiguous(), X.contiguous(), post.contiguous(), comb.contiguous(), out,
                                          S=S, D=D, DB=db, num_warps=4)
    return out


def hc_pre_triton(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
                  hc_eps: float, iters: int, norm: torch.Tensor):
    """model/hc.py hc_pre for float32 X [T, S, D], 1 <= T <= MAX_T, S a power of two, norm [D] -> rms_norm(y, norm)
    [T, D], post [T, S], comb [T, S, S], in two launches (_hc_post_dots without the update, _hc_combine)."""
    T, S, D = X.shape
    M = (2 + S) * S
    if not 1 <= T <= MAX_T or S & (S - 1) or X.dtype != torch.float32 or fn.shape != (M, S * D) \
            or fn.dtype != torch.float32 or norm.shape != (D,) or iters < 1:
        raise ValueError(f"hc_pre_triton: expected X float32 [1..{MAX_T}, S, D] (S a power of two), fn float32 "
                         f"[{M}, S*D] and norm [D], got X {X.dtype} {list(X.shape)}, fn {fn.dtype} {list(fn.shape)}, "
                         f"norm {list(norm.shape)}, iters = {iters}")
    return _reduced(None, X, None, None, fn, scale, base, rms_eps, hc_eps, iters, norm)


def post_dots_shape(S: int, D: int) -> tuple[int, int]:
    """_hc_post_dots' (DC, DB) for S streams of D dims: each of the SPLITS programs of a token takes DC dims of every
    stream (D / SPLITS rounded up to whole steps), DB a step (a power of two, S * DB <= KB values)."""
    dc = triton.cdiv(D, SPLITS)
    db = min(triton.next_power_of_2(dc), KB // S)
    return triton.cdiv(dc, db) * db, db


def hc_post_pre_triton(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                       scale: torch.Tensor, base: torch.Tensor, rms_eps: float, hc_eps: float, iters: int,
                       norm: torch.Tensor):
    """model/hc.py hc_post_pre (the streams' update by a sublayer's output f, then the next connection's reduction of
    them, RMS-normed by norm [D]) for float32 f [T, D] (or [T, J, D]: its J terms, summed in order), X [T, S, D], post
    [T, S], comb [T, S, S], 1 <= T <= MAX_T, in two launches (_hc_post_dots, _hc_combine) -> X' [T, S, D],
    rms_norm(y, norm) [T, D], post' [T, S], comb' [T, S, S]."""
    T, S, D = X.shape
    M = (2 + S) * S
    if not 1 <= T <= MAX_T or S & (S - 1) or f.dim() not in (2, 3) or (f.shape[0], f.shape[-1]) != (T, D) \
            or post.shape != (T, S) or comb.shape != (T, S, S) or fn.shape != (M, S * D) or norm.shape != (D,) \
            or not all(a.dtype == torch.float32 for a in (f, X, post, comb, fn)) or iters < 1:
        raise ValueError(f"hc_post_pre_triton: expected float32 f [T, D] or [T, J, D], X [T, S, D] (1 <= T <= "
                         f"{MAX_T}, S a power of two), post [T, S], comb [T, S, S], fn [{M}, S*D] and norm [D], got f "
                         f"{f.dtype} {list(f.shape)}, X {X.dtype} {list(X.shape)}, post {list(post.shape)}, comb "
                         f"{list(comb.shape)}, fn {fn.dtype} {list(fn.shape)}, norm {list(norm.shape)}, "
                         f"iters = {iters}")
    Xn = torch.empty_like(X)
    return (Xn, *_reduced(f, X, post, comb, fn, scale, base, rms_eps, hc_eps, iters, norm, Xn))


def _reduced(f, X, post, comb, fn, scale, base, rms_eps: float, hc_eps: float, iters: int, norm: torch.Tensor,
             Xn: torch.Tensor | None = None):
    """_hc_post_dots (with the update into Xn when f is given, else on X as it is), then _hc_combine with the norm
    -> rms_norm(y, norm) [T, D], post [T, S], comb [T, S, S] of the streams (Xn or X)."""
    T, S, D = X.shape
    MP = triton.next_power_of_2((2 + S) * S)
    dc, db = post_dots_shape(S, D)
    X = X.contiguous()
    part = torch.empty(T, SPLITS, MP + 1 + S * S, dtype=torch.float32, device=X.device)
    pdl = pdl_launch(X.device)
    update = f is not None
    if update:
        f, post, comb = f.contiguous(), post.contiguous(), comb.contiguous()
    else:
        f = post = comb = Xn = X                 # stand-ins: the kernel uses none of the four without the update
    _hc_post_dots[(T, SPLITS)](f, X, post, comb, fn.contiguous(), Xn, part, S=S, D=D, MP=MP, SPLITS=SPLITS, DC=dc,
                               DB=db, J=f.shape[1] if update and f.dim() == 3 else 1, UPDATE=update, num_warps=4, **pdl)
    return _combined(Xn, part, scale, base, rms_eps, hc_eps, iters, pdl, norm)


def _combined(X: torch.Tensor, part: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
              hc_eps: float, iters: int, pdl: dict, norm: torch.Tensor | None = None):
    """_hc_combine on the partials part [T, splits, MP + 1 (+ S*S with norm)] of X [T, S, D] -> y [T, D] (with norm
    [D]: rms_norm(y, norm)), post [T, S], comb [T, S, S] (the program of each token's first output block stores its m,
    pre, post and comb, the others scratch rows)."""
    T, S, D = X.shape
    splits, MP = part.shape[1], part.shape[2] - 1 - (S * S if norm is not None else 0)
    ny = triton.cdiv(D, DY)
    m = torch.empty(T * (1 + ny), MP, dtype=torch.float32, device=X.device)
    y = torch.empty(T, D, dtype=torch.float32, device=X.device)
    pre = torch.empty(T * (1 + ny), S, dtype=torch.float32, device=X.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T * (1 + ny), S, S, dtype=torch.float32, device=X.device)
    if T:
        _hc_combine[(T, ny)](X, part, m, scale.float().contiguous(), base.float().contiguous(),
                             y if norm is None else norm.float().contiguous(), y, pre, post, comb, float(rms_eps),
                             float(hc_eps), ITERS=iters, S=S, D=D, MP=MP, SPLITS=splits, DY=DY, NORM=norm is not None,
                             num_warps=1, **pdl)
    return y, post[:T], comb[:T]
