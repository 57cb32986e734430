"""Attention of a decode or verify step in Triton (model/attention.py attend): per query row and head, softmax over
the visible keys and the head's sink logit, then the weighted sum of the keys (V = K).

    attend_triton(q [T, H, d] f32, k [K, d] f32, mask [T, K] bool, sinks [H] f32, cos, sin [T, n_rot/2]) -> o [T, H, d]
        model/attention.py attend_unrotate (the attention, then each head's tail rotated back), T <= MAX_T (the
        compiled step's attention was 4-5 launches, ~15 us per layer at Flash width, and the rotation one more).

Split over the keys (flash-decoding), two launches:
  _attend_part: program (t, h, s) scores the keys s*CH*KS.. for query row t and head h, CH chunks of KS (float32
      FMA: a dot of d values per key, in registers), and stores their maximum, sum of exponentials and weighted
      key sum;
  _attend_join: program (t, h, d-block) joins the splits with the sink: M = max(sink, maxima),
      o = sum_s exp(m_s - M) acc_s / (exp(sink - M) + sum_s exp(m_s - M) l_s), and rotates the tail of o back.
A split whose keys are all masked stores m = -inf, l = 0, acc = 0 and adds nothing; a chunk of keys whose mask
bytes are all zero for the row is skipped (its keys are not loaded), so rows that see few of the keys (a verify step's
gathered top-k blocks, each row seeing its own) cost less than rows that see them all. CONFIG = (KS, CH, warps) = (8, 4,
1): in bench_kernels' third sweep on the H200 (BENCHMARKS.md) as fast as or faster than (8, 4, 2) at every size
tried (129 .. 8321 keys, T = 1 and 4; 1153 keys T = 4: 61.75 -> 52.57 us), and 1.3x to 2.4x faster than one chunk of
32 keys at 8 warps; smaller programs ((4, 4, 1)) are faster up to 2177 keys but slower at 8321 (their partial sums
to join grow), so calls of up to SMALL_KEYS keys take those (SMALL_CONFIG); at T = 1 and Flash width (64 heads,
~129 raw keys) the first launch is 64 x 9 programs.
A first version with one program per (row, block of 16 heads) and tl.dot was 4 programs at T = 1 and took 152 us per
layer; blocks of 16 heads per key split (float32 tl.dot) were 4x slower than one head per program.

    attend_long_triton(q [T, H, d] f32, k [K, d] f32, mask [T, K] bool, sinks [H] f32, cos, sin [T, n_rot/2],
                       out=None) -> o [T, H, d], any T
        model/attention.py attend_unrotate for prefill chunks (the PyTorch version was two float32 GEMMs on the CUDA
        cores plus ~6 passes over the [T, H, K] logits per block of queries), into `out` when given (a block of
        queries writes its rows of the chunk's output: no concatenation after the blocks)

One launch, flash-attention style: program (query block, head block, output-dims block) holds the rows
(t, h) of BT queries x HB heads (the heads of a query share its keys and mask: one shared K=V head) and walks the
keys in blocks of BN, skipping a block none of its queries sees (a query sees ~W raw keys of the chunk's
W-1+T and the compressed rows), with the online softmax (running maximum, sum, rescaled accumulator) and the
sink added at the end, the tail rotated back as the output is stored (no PyTorch rotation after it: a concatenation
and ~10 passes over the tail per block of queries). Both products run on the float16 tensor cores, with parts 2 as
three products of float16 parts (parts.py: a = hi + lo to ~2^-22; hi*hi + lo*hi + hi*lo, float32 accumulation):
~2e-7 relative against float64, as float32 FMA (Triton's "tf32x3" on the float32 operands was as exact but spilled
registers at most tile shapes, BENCHMARKS.md); with parts 1 as one product of the operands rounded to float16 (q, and
p before the second product; the raw keys are float16 values already, ds4 rounds them): ~3e-4 relative, a third
of the tensor-core work and fewer registers (room for DV = d: the logits made once). The logits are summed over d
in chunks of DC (no [rows, d] query tile held across the loop); each program accumulates DV of the d output dims,
so the logits are recomputed d/DV times.

    attend_top_triton(q [T, H, d], raw [Kr, d], raw_mask [T, Kr], comp [Kc, d], top [T, k], top_vis [T, k], sinks,
                      cos, sin) -> o [T, H, d], any T (prefill chunks of the ratio-4 layers once the indexer runs:
        the masked attend_long reads every compressed row some query of its block keeps, nearly all of a long
        cache's; ~18 us of prefill per position of a 2048-token chunk's start, BENCHMARKS.md, the thirty-fifth
        session)

One query per program with all HB heads of it (its tile rows): the raw keys in blocks of BN as in _attend_long
(blocks outside the query's window skipped), then the query's own k top rows gathered by index, in blocks of BN:
the work per query is the window and k rows whatever the cache's length. The block folding and the final join with
the sinks are _attend_long's (_fold_keys, _store_with_sink).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.parts import split_parts
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

MAX_T = 16       # attend_triton's query limit (decode and verify steps)
CONFIG = (8, 4, 1)    # (keys per chunk KS, chunks per program CH, warps) of _attend_part
SMALL_CONFIG, SMALL_KEYS = (4, 4, 1), 1153   # up to SMALL_KEYS keys (window layers: 129, a decode step's gathered
# indexer rows: 641): in the third sweep 3-11 % faster than CONFIG there, much slower at 8321 (more partials to join)
DB = 128         # output dims per program of _attend_join
# (queries BT, heads HB, keys per block BN, logit dims per dot DC, output dims DV, warps, stages, float16 parts of
# each operand) of _attend_long: bench_kernels' sweep on an H100 (2026-12-06), a window / ratio-4 / ratio-128 block
# of 256 queries: 106.5 / 215.5 / 123.0 us against 163 / 476 / 200 at (2, 64, 64, 64, 256, 8, 3, 2), the best of
# the two-part configs (BENCHMARKS.md)
LONG_CONFIG = (1, 64, 64, 128, 512, 8, 2, 1)
# (heads HB, keys per block BN, logit dims per dot DC, output dims DV, warps, stages, parts) of _attend_top: the same
# sweep, a 256-query block at 4096 / 16384 / 65536: 269 / 285 / 334 us against 537 / 578 / 778 at (64, 64, 64, 128,
# 4, 3, 2), the best with two parts; no spills at Flash width (scripts/sass_report.py --long --top-config)
TOP_CONFIG = (64, 64, 64, 256, 8, 3, 1)


@triton.jit
def _attend_part(q_ptr, k_ptr, m_ptr, pm_ptr, pl_ptr, pa_ptr, scale, K: tl.constexpr, H: tl.constexpr,
                 D: tl.constexpr, DP: tl.constexpr, KS: tl.constexpr, CH: tl.constexpr, NS: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (t, h, s): the keys s*CH*KS .. in CH chunks of KS, the softmax's maximum kept as it goes."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    c = tl.arange(0, DP)
    cm = c < D
    q = tl.load(q_ptr + (t * H + h) * D + c, mask=cm, other=0.0)                                 # [DP]
    mx = tl.max(tl.full([KS], float("-inf"), tl.float32), axis=0)
    total = tl.sum(tl.zeros([KS], tl.float32), axis=0)
    acc = tl.zeros([DP], tl.float32)
    for i in range(CH):
        kk = (s * CH + i) * KS + tl.arange(0, KS)
        km = kk < K
        vis = tl.load(m_ptr + t * K + kk, mask=km, other=0) != 0
        if tl.max(vis.to(tl.int32), axis=0) > 0:             # a chunk this row cannot see adds nothing: skipped
            keys = tl.load(k_ptr + kk[:, None] * D + c[None, :], mask=km[:, None] & cm[None, :], other=0.0)
            sc = tl.where(vis, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))          # [KS]
            top = tl.maximum(mx, tl.max(sc, axis=0))
            base = tl.where(top == float("-inf"), 0.0, top)  # all masked so far: 0 (never -inf - -inf)
            p = tl.exp(sc - base)
            carry = tl.exp(mx - base)                        # the earlier chunks' terms rescaled (0 for none)
            total = total * carry + tl.sum(p, axis=0)
            acc = acc * carry + tl.sum(p[:, None] * keys, axis=0)
            mx = top
    slot = (t * H + h) * NS + s
    tl.store(pm_ptr + slot, mx)
    tl.store(pl_ptr + slot, total)
    tl.store(pa_ptr + slot.to(tl.int64) * D + c, acc, mask=cm)


@triton.jit
def _attend_join(pm_ptr, pl_ptr, pa_ptr, s_ptr, cos_ptr, sin_ptr, o_ptr, H: tl.constexpr, D: tl.constexpr,
                 NR: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, DB: tl.constexpr, PDL: tl.constexpr):
    """Program (t, h, b): output dims b*DB .. b*DB+DB-1 of query row t, head h; the pairs (2i, 2i+1) of the last NR
    dims rotated back by the row's RoPE (apply_rope_tail's inverse; the other pairs by angle 0). The partial sums
    are read as contiguous rows and the pairs taken apart in registers (reading the even and the odd dims as two
    strided loads made the join 4x slower in a verify step of 4 rows, BENCHMARKS.md)."""
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2) * DB + tl.arange(0, DB)
    j = tl.arange(0, NSP)
    jm = j < NS
    base = (t * H + h) * NS
    m = tl.load(pm_ptr + base + j, mask=jm, other=float("-inf"))
    l = tl.load(pl_ptr + base + j, mask=jm, other=0.0)
    sink = tl.load(s_ptr + h)
    top = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - top)                                              # -inf maxima (masked splits): 0
    acc = tl.load(pa_ptr + (base + j).to(tl.int64)[:, None] * D + c[None, :], mask=jm[:, None] & (c < D)[None, :],
                  other=0.0)                                                                    # [NSP, DB]
    total = tl.exp(sink - top) + tl.sum(l * w, axis=0)
    x0, x1 = tl.split(tl.reshape(tl.sum(acc * w[:, None], axis=0) / total, [DB // 2, 2]))      # [DB/2] each
    ce = tl.program_id(2) * DB + 2 * tl.arange(0, DB // 2)          # the pairs' first dims
    y0, y1 = _rotate_back(x0, x1, cos_ptr, sin_ptr, t, ce, ce < D, D, NR)
    o = tl.reshape(tl.join(y0, y1), [DB])
    tl.store(o_ptr + (t * H + h) * D + c, o, mask=c < D)


@triton.jit
def _rotate_back(x0, x1, cos_ptr, sin_ptr, row, ce, ok, D: tl.constexpr, NR: tl.constexpr):
    """The pairs (x0, x1) whose first dims are ce, of query rows `row` (cos, sin [T, NR/2]), with the pairs of the last
    NR dims rotated back by the row's RoPE (apply_rope_tail's inverse; other pairs, and those where ok is False, by
    angle 0) -> (first, second) of the rotated pairs (row, ce and ok broadcast together)."""
    p = (ce - (D - NR)) // 2                                         # pair index in the rotated tail
    pm = ok & (ce >= D - NR)
    cs = tl.load(cos_ptr + row * (NR // 2) + p, mask=pm, other=1.0)
    sn = tl.load(sin_ptr + row * (NR // 2) + p, mask=pm, other=0.0)
    return x0 * cs + x1 * sn, x1 * cs - x0 * sn


def attend_triton(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """model/attention.py attend_unrotate for float32 q [T, H, d] (T <= MAX_T, d even), keys k [K, d], mask bool
    [T, K], cos, sin [T, n_rot/2] (used as float32). config: (keys per chunk, chunks per program, warps) of
    _attend_part, overriding CONFIG (sweeps)."""
    T, H, D = q.shape
    K, nr = k.shape[0], 2 * cos.shape[-1]
    if not 1 <= T <= MAX_T or q.dtype != torch.float32 or k.dtype != torch.float32 or k.shape != (K, D) \
            or mask.shape != (T, K) or mask.dtype != torch.bool or sinks.shape != (H,) or D % 2 \
            or cos.shape != (T, nr // 2) or sin.shape != cos.shape or not 0 < nr <= D:
        raise ValueError(f"attend_triton: expected float32 q [1..{MAX_T}, H, d] (d even), k [K, d], bool mask [T, K], "
                         f"sinks [H] and cos, sin [T, n_rot/2] (n_rot <= d), got q {q.dtype} {list(q.shape)}, k "
                         f"{k.dtype} {list(k.shape)}, mask {mask.dtype} {list(mask.shape)}, sinks {list(sinks.shape)}, "
                         f"cos {list(cos.shape)}, sin {list(sin.shape)}")
    q, k = q.contiguous(), k.contiguous()
    m = mask.contiguous().view(torch.uint8)
    ks, ch, warps = config or (SMALL_CONFIG if K <= SMALL_KEYS else CONFIG)
    NS = triton.cdiv(K, ks * ch)
    part_m = torch.empty(T, H, NS, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(T, H, NS, D, dtype=torch.float32, device=q.device)
    DP = triton.next_power_of_2(D)
    pdl = pdl_launch(q.device)
    _attend_part[(T, H, NS)](q, k, m, part_m, part_l, part_acc, D ** -0.5, K=K, H=H, D=D, DP=DP, KS=ks, CH=ch,
                             NS=NS, num_warps=warps, **pdl)
    o = torch.empty_like(q)
    db = min(DB, DP)
    _attend_join[(T, H, triton.cdiv(D, db))](part_m, part_l, part_acc, sinks.float().contiguous(),
                                             cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous(),
                                             o, H=H, D=D, NR=nr, NS=NS, NSP=triton.next_power_of_2(NS), DB=db,
                                             num_warps=4, **pdl)
    return o


@triton.jit
def _fold_keys(qh_ptr, ql_ptr, qrow, rm, kh_ptr, kl_ptr, krow, km, vis, dv, mx, total, acc, scale, D: tl.constexpr,
               DC: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, PARTS: tl.constexpr):
    """One block of BN keys (rows krow [BN] of kh + kl, km [BN] in range, vis [M or 1, BN] visible) folded into the
    online softmax (mx, total [M], acc [M, DV]) of the M query rows qrow [M] (rm [M] in range) -> (mx, total, acc).
    PARTS 2: three products of the float16 parts (~float32); 1: the hi parts alone, one product (ql, kl unread)."""
    dc = tl.arange(0, DC)
    sc = tl.zeros([M, BN], tl.float32)
    for c in range(0, D, DC):
        qh = tl.load(qh_ptr + qrow[:, None] + c + dc[None, :], mask=rm[:, None], other=0.0)                  # [M, DC]
        if PARTS > 1:
            ql = tl.load(ql_ptr + qrow[:, None] + c + dc[None, :], mask=rm[:, None], other=0.0)
        kh = tl.trans(tl.load(kh_ptr + krow[:, None] + c + dc[None, :], mask=km[:, None], other=0.0))       # [DC, BN]
        if PARTS > 1:
            kl = tl.trans(tl.load(kl_ptr + krow[:, None] + c + dc[None, :], mask=km[:, None], other=0.0))
        sc = tl.dot(qh, kh, sc)                                                                             # [M, BN]
        if PARTS > 1:
            sc = tl.dot(ql, kh, sc)
            sc = tl.dot(qh, kl, sc)
    sc = tl.where(vis, sc * scale, float("-inf"))
    top = tl.maximum(mx, tl.max(sc, axis=1))
    base = tl.where(top == float("-inf"), 0.0, top)          # no key seen yet: 0 (never -inf - -inf)
    p = tl.exp(sc - base[:, None])
    carry = tl.exp(mx - base)
    total = total * carry + tl.sum(p, axis=1)
    ph = p.to(tl.float16)
    if PARTS > 1:
        pl = (p - ph.to(tl.float32)).to(tl.float16)
    vh = tl.load(kh_ptr + krow[:, None] + dv[None, :], mask=km[:, None], other=0.0)                        # [BN, DV]
    if PARTS > 1:
        vl = tl.load(kl_ptr + krow[:, None] + dv[None, :], mask=km[:, None], other=0.0)
    acc = acc * carry[:, None]
    acc = tl.dot(ph, vh, acc)
    if PARTS > 1:
        acc = tl.dot(pl, vh, acc)
        acc = tl.dot(ph, vl, acc)
    return top, total, acc


@triton.jit
def _store_with_sink(o_ptr, s_ptr, cos_ptr, sin_ptr, t, h, qrow, rm, dv, mx, total, acc, D: tl.constexpr,
                     NR: tl.constexpr, DV: tl.constexpr):
    """The softmax joined with each row's head sink (h [M]): o = acc / (total + exp(sink)), rescaled, stored at o[qrow,
    dv] (dv: DV consecutive dims from a multiple of DV); then, in the program whose dims reach the last NR, those pairs
    read back and rotated back by the row's query t [M] (_rotate_back). Rotating the [M, DV] tile in registers took
    its pairs apart for every dim and spilled ~50 registers (sm_90); the tail is NR of the d dims."""
    sink = tl.load(s_ptr + h, mask=rm, other=0.0)
    top = tl.maximum(mx, sink)
    w = tl.exp(mx - top)
    tl.store(o_ptr + qrow[:, None] + dv[None, :], acc * (w / (total * w + tl.exp(sink - top)))[:, None],
             mask=rm[:, None])
    lo = tl.program_id(2) * DV
    if lo + DV > D - NR:
        tl.debug_barrier()                          # the tile's stores visible to all of the program's threads
        ce = D - NR + 2 * tl.arange(0, NR // 2)     # the tail pairs' first dims
        pm = rm[:, None] & ((ce >= lo) & (ce < lo + DV))[None, :]
        at = o_ptr + qrow[:, None] + ce[None, :]                                                    # [M, NR/2]
        x0 = tl.load(at, mask=pm, other=0.0)
        x1 = tl.load(at + 1, mask=pm, other=0.0)
        y0, y1 = _rotate_back(x0, x1, cos_ptr, sin_ptr, t.to(tl.int64)[:, None], ce[None, :], pm, D, NR)
        tl.store(at, y0, mask=pm)
        tl.store(at + 1, y1, mask=pm)


@triton.jit
def _attend_long(qh_ptr, ql_ptr, kh_ptr, kl_ptr, m_ptr, s_ptr, cos_ptr, sin_ptr, o_ptr, scale, T, K, H: tl.constexpr,
                 D: tl.constexpr, NR: tl.constexpr, BT: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr,
                 DC: tl.constexpr, DV: tl.constexpr, PARTS: tl.constexpr):
    """Program (i, j, v): queries i*BT.., heads j*HB.., output dims v*DV..; row r of its tiles is query
    i*BT + r // HB, head j*HB + r % HB. q and k come as float16 parts hi + lo (parts.split_parts; PARTS 1: hi
    alone, the lo pointers unread)."""
    r = tl.arange(0, BT * HB)
    t = tl.program_id(0) * BT + r // HB
    h = tl.program_id(1) * HB + r % HB
    tm = t < T
    qrow = (t * H + h).to(tl.int64) * D                                                    # [M]
    dv = tl.program_id(2) * DV + tl.arange(0, DV)
    mx = tl.full([BT * HB], float("-inf"), tl.float32)
    total = tl.zeros([BT * HB], tl.float32)
    acc = tl.zeros([BT * HB, DV], tl.float32)
    kb = 0
    while kb < K:       # (a while loop: Triton's interpreter cannot take a runtime range bound)
        kk = kb + tl.arange(0, BN)
        km = kk < K
        vis = tl.load(m_ptr + t.to(tl.int64)[:, None] * K + kk[None, :], mask=tm[:, None] & km[None, :], other=0) != 0
        if tl.max(tl.max(vis.to(tl.int32), axis=1), axis=0) > 0:      # a block none of the rows sees: skipped
            mx, total, acc = _fold_keys(qh_ptr, ql_ptr, qrow, tm, kh_ptr, kl_ptr, kk.to(tl.int64) * D, km, vis, dv,
                                        mx, total, acc, scale, D, DC, BT * HB, BN, PARTS)
        kb += BN
    _store_with_sink(o_ptr, s_ptr, cos_ptr, sin_ptr, t, h, qrow, tm, dv, mx, total, acc, D, NR, DV)


def attend_long_triton(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, config: tuple[int, ...] | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """model/attention.py attend_unrotate for float32 q [T, H, d] (any T; d a power of two, at least 16), keys k
    [K, d], mask bool [T, K], sinks [H], cos, sin [T, n_rot/2] (n_rot <= d), q and k within float16's range (the
    model's are RMS-normalized: |x| <= sqrt(d) |weight|) -> o [T, H, d], written into `out` when given (float32
    [T, H, d] contiguous: a prefill chunk's query block writes its rows of the chunk's output). config: LONG_CONFIG's
    fields, overriding it (sweeps); HB, DC and DV are capped at H and d, and BT raised to give at least 16 rows
    (tl.dot's minimum)."""
    T, H, D = q.shape
    K = k.shape[0]
    _check_long("attend_long_triton", q, sinks, cos, sin, out)
    if k.dtype != torch.float32 or k.shape != (K, D) or mask.shape != (T, K) or mask.dtype != torch.bool:
        raise ValueError(f"attend_long_triton: expected float32 k [K, {D}] and bool mask [{T}, K], got k {k.dtype} "
                         f"{list(k.shape)}, mask {mask.dtype} {list(mask.shape)}")
    bt, hb, bn, dc, dv, warps, stages, parts = config or LONG_CONFIG
    hb = math.gcd(hb, H)
    bt = max(bt, triton.cdiv(16, hb))
    dc, dv = min(dc, D), min(dv, D)
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device) if out is None else out
    grid = (triton.cdiv(T, bt), H // hb, D // dv)
    _attend_long[grid](*_operand(q, parts), *_operand(k, parts),
                       mask.contiguous().view(torch.uint8), sinks.float().contiguous(),
                       cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous(), o, D ** -0.5, T, K,
                       H=H, D=D, NR=2 * cos.shape[-1], BT=bt, HB=hb, BN=bn, DC=dc, DV=dv, PARTS=parts,
                       num_warps=warps, num_stages=stages)
    return o


def _operand(a: torch.Tensor, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill kernel's float32 operand as its float16 (hi, lo) parts, or with parts 1 as (hi, hi): the kernel
    then reads hi alone. A float16 operand (queries made so, runtime/backends/cuda.py queries_kernel) is its own hi,
    with parts 1 only."""
    if a.dtype == torch.float16:
        if parts != 1:
            raise ValueError(f"attn_triton: float16 queries need a config of one part, got {parts}")
        return a.contiguous(), a.contiguous()
    if parts == 2:
        return split_parts(a.contiguous())
    if parts != 1:
        raise ValueError(f"attn_triton: a config's parts is 1 or 2, got {parts}")
    hi = a.to(torch.float16).contiguous()
    return hi, hi


def reads_float16_queries() -> bool:
    """Whether the prefill kernels' configs (LONG_CONFIG, TOP_CONFIG) read one float16 part of their operands, so
    that queries may come as float16 (the same values they would make of float32 ones)."""
    return LONG_CONFIG[-1] == 1 and TOP_CONFIG[-1] == 1


def _check_long(name: str, q: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None) -> None:
    """The operands the prefill kernels share: float32 (or float16: _operand) q [T, H, d] (d a power of two, at least
    16), sinks [H], cos, sin [T, n_rot/2] with 0 < n_rot <= d, out (if any) float32 [T, H, d] contiguous on q's
    device."""
    T, H, D = q.shape
    if T < 1 or D < 16 or D & (D - 1) or q.dtype not in (torch.float32, torch.float16) or sinks.shape != (H,) \
            or cos.ndim != 2 or cos.shape[0] != T or not 0 < 2 * cos.shape[1] <= D or sin.shape != cos.shape \
            or out is not None and (out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous()
                                    or out.device != q.device):
        raise ValueError(f"{name}: expected float32 or float16 q [T, H, d] (d a power of two, at least 16), sinks [H], "
                         f"cos and sin [T, n_rot/2] (n_rot <= d) and a contiguous float32 out like q, got q {q.dtype} "
                         f"{list(q.shape)}, sinks {list(sinks.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}"
                         + ("" if out is None else f", out {out.dtype} {list(out.shape)}"))


@triton.jit
def _attend_top(qh_ptr, ql_ptr, rh_ptr, rl_ptr, m_ptr, ch_ptr, cl_ptr, top_ptr, tv_ptr, s_ptr, cos_ptr, sin_ptr, o_ptr,
                scale, KR, H: tl.constexpr, D: tl.constexpr, NR: tl.constexpr, NT: tl.constexpr, HB: tl.constexpr,
                M: tl.constexpr, BN: tl.constexpr, DC: tl.constexpr, DV: tl.constexpr, PARTS: tl.constexpr):
    """Program (t, j, v): query t, heads j*HB.. (rows of the tiles past HB are padding for tl.dot's 16), output dims
    v*DV..: the raw keys rh + rl [KR, d] in blocks of BN (those the query's mask row does not see skipped), then
    its own NT top compressed rows, gathered from ch + cl by index (those top_vis marks invisible left out)."""
    t = tl.program_id(0)
    r = tl.arange(0, M)
    h = tl.program_id(1) * HB + r
    rm = r < HB
    qrow = (t * H + h).to(tl.int64) * D                                                    # [M]
    dv = tl.program_id(2) * DV + tl.arange(0, DV)
    mx = tl.full([M], float("-inf"), tl.float32)
    total = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    kb = 0
    while kb < KR:
        kk = kb + tl.arange(0, BN)
        km = kk < KR
        vis = tl.load(m_ptr + t.to(tl.int64) * KR + kk, mask=km, other=0) != 0                # [BN]
        if tl.max(vis.to(tl.int32), axis=0) > 0:
            mx, total, acc = _fold_keys(qh_ptr, ql_ptr, qrow, rm, rh_ptr, rl_ptr, kk.to(tl.int64) * D, km,
                                        vis[None, :], dv, mx, total, acc, scale, D, DC, M, BN, PARTS)
        kb += BN
    for jb in range(0, NT, BN):
        jj = jb + tl.arange(0, BN)
        jm = jj < NT
        vis = tl.load(tv_ptr + t * NT + jj, mask=jm, other=0) != 0                             # [BN]
        if tl.max(vis.to(tl.int32), axis=0) > 0:
            row = tl.load(top_ptr + t * NT + jj, mask=jm & vis, other=0)                       # [BN] int64
            mx, total, acc = _fold_keys(qh_ptr, ql_ptr, qrow, rm, ch_ptr, cl_ptr, row * D, jm & vis, vis[None, :],
                                        dv, mx, total, acc, scale, D, DC, M, BN, PARTS)
    _store_with_sink(o_ptr, s_ptr, cos_ptr, sin_ptr, tl.full([M], t, tl.int32), h, qrow, rm, dv, mx, total, acc, D,
                     NR, DV)


def attend_top_triton(q: torch.Tensor, raw: torch.Tensor, raw_mask: torch.Tensor, comp: torch.Tensor,
                      top: torch.Tensor, top_vis: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """model/attention.py attend_unrotate for float32 q [T, H, d] (any T; d a power of two, at least 16) over each
    query's raw keys (raw [Kr, d], bool raw_mask [T, Kr]) and its own top compressed rows comp[top[t]] (comp [Kc, d],
    top [T, k] int64, bool top_vis [T, k]: which of them it sees; the rows of top[t] distinct), all within float16's
    range, the output's tail rotated back by cos, sin [T, n_rot/2] -> o [T, H, d]. What the masked attention over
    the raw keys and the whole of comp gives with comp's mask restricted to each query's top rows
    (Attention._keep_top), without reading the rows no query keeps. config: TOP_CONFIG's fields, overriding it
    (sweeps); HB, DC and DV are capped at H and d."""
    T, H, D = q.shape
    KR, KC, NT = raw.shape[0], comp.shape[0], top.shape[1]
    _check_long("attend_top_triton", q, sinks, cos, sin, None)
    if raw.dtype != torch.float32 or comp.dtype != torch.float32 or raw.shape != (KR, D) or comp.shape != (KC, D) \
            or raw_mask.shape != (T, KR) or raw_mask.dtype != torch.bool or top.shape != (T, NT) \
            or top.dtype != torch.int64 or top_vis.shape != (T, NT) or top_vis.dtype != torch.bool:
        raise ValueError(f"attend_top_triton: expected float32 raw [Kr, {D}], comp [Kc, {D}], bool raw_mask [{T}, Kr], "
                         f"int64 top and bool top_vis [{T}, k], got raw {raw.dtype} {list(raw.shape)}, comp "
                         f"{comp.dtype} {list(comp.shape)}, raw_mask {raw_mask.dtype} {list(raw_mask.shape)}, top "
                         f"{top.dtype} {list(top.shape)}, top_vis {top_vis.dtype} {list(top_vis.shape)}")
    hb, bn, dc, dv, warps, stages, parts = config or TOP_CONFIG
    hb = math.gcd(hb, H)
    dc, dv = min(dc, D), min(dv, D)
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    grid = (T, H // hb, D // dv)
    _attend_top[grid](*_operand(q, parts), *_operand(raw, parts), raw_mask.contiguous().view(torch.uint8),
                      *_operand(comp, parts),
                      top.contiguous(), top_vis.contiguous().view(torch.uint8), sinks.float().contiguous(),
                      cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous(), o, D ** -0.5, KR, H=H,
                      D=D, NR=2 * cos.shape[-1], NT=NT, HB=hb, M=max(hb, 16), BN=bn, DC=dc, DV=dv, PARTS=parts,
                      num_warps=warps, num_stages=stages)
    return o
