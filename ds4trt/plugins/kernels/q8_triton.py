"""Q8_0 matrix products in Triton (attention projections, shared expert, LM head): out = x @ W.T for T = 1..16
rows of x, reading W as Q8_0 values, rearranged once when the weight is loaded (split_q8).

    split_q8(blocks uint8 [N, K/32*34], N, K) -> quants uint8 [N, KP], scales f16 [N, KP/32]   (KP: K to 256)
    q8_matmul(x [T, G*K] f32, quants, scales, K, groups=G, out=None) -> out [T, N] float32
        Rows n of W form G equal groups; group g = n // (N/G) reads x[:, g*K:(g+1)*K] (attn_output_a's
        8 groups of 1024 rows each seeing their own 4096 inputs; G = 1 for a plain projection). Its first weight
        words are read before the wait for the kernel launched just before (PDL), which must not write them (here
        they are always a weight's).
    dequant_f16(quants, scales, K, inv_scale) -> float16 [N, K]: d * q * inv_scale (a power of two) rounded to
        float16, the weight operand of the CUDA backend's long prefill chunks (runtime/backends/cuda.py project_f16).
    x_f16(x [T, G*K] f32, wgmma_order=False) -> (float16 [T, G*K], s f32 [T]): each row divided by the power of two
        s just above its largest |value| and rounded to float16, its input side (wgmma_order: each 256-value chunk
        permuted for moe_mma's wgmma gate/up, wgmma_position).

Q8_0 block (34 bytes, 32 values; spec ds4_architecture.md §2.8): f16 d | int8 q[32]; value i = d * q[i].
In the GGUF the blocks follow each other at a 34-byte stride, so a row's quants are only 2-byte aligned and a
kernel reading them in place issues one 2-byte load per 2 values (the previous kernel: 33-40 % of the copy
bandwidth on the big projections). split_q8 keeps the same values, as many bytes (no float copy), in two arrays:
the scales, and the quants as offset binary (q + 128) with each row's spans of 8 blocks stored word-interleaved:
word j (quants 4j..4j+3) of block b at word 8j + b. Word j of a span's 8 blocks is then 32 contiguous bytes (two
16-byte loads) and their 8 scales 16 bytes (one load), both in the same tile layout, so nothing moves between
lanes in the loop (with the GGUF order the scales' layout differed from the quants' and every step converted the
products through shared memory).

Decoding in _q8_rows (T <= 4 rows of x per launch), per value: byte u = q + 128 is put in the low mantissa bits of
1.0f (bits 0..7 for bytes 0 and 2 of a 32-bit word, bits 8..15 for bytes 1 and 3: one LOP3 or PRMT each), giving
f = 1 + u * 2^-23 (or 2^-15); f - (1 + 128 * 2^-23) is q * 2^-23 exactly (Sterbenz). At T = 1 a word's 4 products
with x are summed in the two units, joined, and the block scale d is applied to the word sum (6 FMUL / FFMA); at
T >= 2 the values d * q (exact: 8 x 11 significant bits) are made once per word and each row of x costs 4 FFMA per
word. Each word is decoded once for the T rows of x, whose 4 values of a word are one 128-bit load (wide_load.ld4;
sm_90 loop of 8 blocks at T = 1..4: 169 / 445 / 523 / 600 instructions, against 193 / 476 / 612 / 743 with scalar x
loads and the T = 1 form at every T). When N is small the K range is split over several programs (at least
MIN_PROGRAMS in all), and the last program of each row tile to finish adds the partial sums in a fixed order
(deterministic: an atomic counter says which program is last, the sum does not depend on it).
T > 4 (verify of 4+ drafts, prefill chunks of <= 16 tokens): one launch per LAUNCH_T rows of x, each reading W
again. The tensor-core kernel this replaced (a [64, 128] tile of gathered bytes times x [128, 16] per step) took
211-216 us for the 32 MB projections and 3.3 ms for the LM head at T = 5 and at T = 9, where the 4-row kernel
takes 27-29 us and 370 us (scripts/bench_kernels.py --cases q8, H200, 2026-11-30).

Prefill chunks' float16 operands: a Q8_0 value d * q has up to 18 significant bits, so float16 rounds it (to
2^-12 of itself); dividing by a power of two first is exact, so it moves the values into float16's range and
rounds nothing more. Likewise x: |x / s| < 1 never overflows float16, whatever the activations' magnitudes.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels import q8_mma
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch
from ds4trt.plugins.kernels.wide_load import ld4

QK, BLOCK_BYTES = 32, 34
NB_STEP = 8                  # blocks per loop step of _q8_rows: 256 values, 64 words per row
SPAN = NB_STEP * QK          # values of a row that split_q8 word-interleaves (one such step); rows are padded to it
ONE_BITS = 0x3F800000        # bits of 1.0f, a kernel argument so that AND and OR fuse into one LOP3
LO_BIAS = tl.constexpr(1.0 + 128 * 2.0 ** -23)     # f of u = 128 (q = 0) with the byte in bits 0..7
HI_BIAS = tl.constexpr(1.0 + 128 * 2.0 ** -15)     # ... in bits 8..15
# (rows per program, warps, min programs[, prefetch]) of _q8_rows by rows per launch (1..LAUNCH_T). From the sweeps of
# scripts/bench_kernels.py on the H200 (2026-11-29): T = 1 at (16, 4): attn_q_b 13.1 us, LM head 159 us (83 % of the
# floor), against 15.0 / 167 at (32, 4); splitting K to 1056 programs rather than 528: attn_output_b 14.6 against
# 18.8 us, the shared expert's 7.5 -> 6.9 (2112: 16.0 / 7.7); T = 4 at (32, 4, 528): attn_q_b 27.9 us, LM head 369
# against 32.5 / 402 at (16, 4), attn_output_b 29.9 against 34.2 at 1056 programs. With the 4-FFMA loop of T >= 2
# (2026-12-01, BENCHMARKS.md): T = 3 at (16, 4, 528) attn_output_b 22.7 us, LM head 311 against 35.2 / 408 at
# (32, 4, 528) (attn_q_b 26.0 / 25.6); T = 2 and 4 keep (32, 4, 528). A fourth entry, prefetch (PF: each step's
# words and scales loaded one step ahead, ~16 more registers at T = 1), at (32, 4, 528) (2026-12-02): T = 1
# attn_output_a / b 13.85 / 13.88 -> 12.52 / 12.58 us, the shared gate 6.94 -> 5.96, attn_q_b 12.14 -> 11.81 (at (16,
# 4, 1056) it was slower); T = 4 ~1 us faster; T = 2 no gain and T = 3 much slower with it. T = 4 on 2 warps of 16
# rows (2026-12-02, twenty-sixth session): the shared gate 14.4 -> 9.4 us, attn_output_b 25.9 -> 23.5, LM head 299
# -> 294, attn_q_b and attn_output_a the same; at T = 1 and 3 no 2-warp shape was faster; at T = 2 (32, 2, 528) was
# faster on attn_output_a / b (21.8 -> 18.0) but slower on the shared expert (7.4 -> 8.9): taken by weight size
# (SIZE_CONFIG, below).
ROWS_CONFIG = {1: (32, 4, 528, True), 2: (32, 4, 528), 3: (16, 4, 528), 4: (16, 2, 528, True)}
# Launches by weight size overriding ROWS_CONFIG: (rows per launch, least N * K, most N * K (excluded), launch). T = 2
# on 2 warps of 32 rows for the 32 MB attention projections (N * K = 2^25: attn_q_b, attn_output_a, attn_output_b;
# H200, 2026-12-02, twenty-seventh session, scripts/bench_kernels.py --cases q8 --sweep-t 2): 16.76 -> 16.40,
# 21.87 -> 18.02, 21.77 -> 17.78 us; the shared expert's 8 MB weights are slower with it (7.38 -> 8.96) and the LM
# head (2^29) was not timed at it, so both keep ROWS_CONFIG's.
SIZE_CONFIG = ((2, 1 << 25, 1 << 26, (32, 2, 528)),)
LAUNCH_T = 4                 # rows of x per launch of _q8_rows (its accumulators are per row)
MIN_PROGRAMS = 528           # a sweep config without a third entry: 4 programs per SM on an H200
COUNTER_SLOTS = 4096         # arrival counters: the most row tiles of a split call (its min programs at most)
PARTS_BR, PARTS_BK, PARTS_WARPS = 32, 256, 4      # dequant_f16's tile: rows, values, warps
X_F16_BT, X_F16_BK = 2, 1024                      # x_f16's tile: rows, inputs a step (PARTS_WARPS warps)


@triton.jit
def _q8_rows(x_ptr, q_ptr, d_ptr, out_ptr, part_ptr, cnt_ptr, N, rows_per_group, ONE, K: tl.constexpr,
             BR: tl.constexpr, STEPS: tl.constexpr, SPLITS: tl.constexpr, TP: tl.constexpr, PF: tl.constexpr,
             NB: tl.constexpr, PDL: tl.constexpr):
    """out[0:TP, rows] for TP = T <= 4 rows of x: program (i, split) does rows i*BR.. and the STEPS steps of 8
    blocks from split*STEPS*8 on (split_q8's layout: a step is 64 words, word j of block b at 8*j + b).
    Tile [word j, block b, row], rows last: Triton orders a tile's dims by contiguity, then by position, so each lane
    holds word j of the 8 blocks (contiguous) and the scales tile (the same shape, contiguous along b too) gets the
    same layout; lanes go to j and then rows, warps and registers to rows. Each word decoded once for all x rows.
    SPLITS > 1: each program stores its partial sums in part[split] and counts itself in cnt[i] (an atomic); the
    last of a tile's SPLITS programs adds the partials in split order (deterministic), writes out and sets cnt[i]
    back to 0, so no second launch sums them (cnt: zeros before the call, zeros after it).
    PF: each step's words and scales are loaded during the step before (its latency hidden behind that step's math;
    a program of K = 1024 has only 4 steps, so without it a good part of its time is 4 waits on memory); the first
    step's are requested before the wait for the previous kernel (q8_tile's PDL)."""
    row0 = tl.program_id(0) * BR
    rows = tl.minimum(row0 + tl.arange(0, BR), N - 1).to(tl.int64)
    x_row = x_ptr + (row0 // rows_per_group).to(tl.int64) * K
    y0, y1, y2, y3 = q8_tile(x_row, K * (N // rows_per_group), q_ptr, d_ptr, rows, tl.program_id(1) * STEPS, ONE,
                              K, BR, STEPS, TP, PF, NB, PDL)
    out_rows = row0 + tl.arange(0, BR)
    o = (out_ptr if SPLITS == 1 else part_ptr + tl.program_id(1).to(tl.int64) * (TP * N)) + out_rows
    omask = out_rows < N
    tl.store(o, y0, mask=omask)
    if TP > 1:
        tl.store(o + N, y1, mask=omask)
    if TP > 2:
        tl.store(o + 2 * N, y2, mask=omask)
    if TP > 3:
        tl.store(o + 3 * N, y3, mask=omask)
    if SPLITS > 1:
        tl.debug_barrier()                          # every thread's partial is stored before the count (release)
        arrived = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            for t in tl.static_range(TP):
                total = tl.zeros([BR], tl.float32)
                for split in tl.static_range(SPLITS):     # .cg: from L2, never a stale line of this SM's L1
                    total += tl.load(part_ptr + (split * TP + t) * N + out_rows, mask=omask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(out_ptr + t * N + out_rows, total, mask=omask)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)


@triton.jit
def q8_tile(x_row, xs, q_ptr, d_ptr, rows, kb0, ONE, K: tl.constexpr, BR: tl.constexpr, STEPS: tl.constexpr,
            TP: tl.constexpr, PF: tl.constexpr, NB: tl.constexpr = 8, PDL: tl.constexpr = False):
    """4 x [BR] float32: weight rows `rows` ([BR] int64) of split_q8's arrays times TP <= 4 rows of x (x_row: row 0,
    16-byte aligned; xs: the stride between rows) over the STEPS steps of 8 blocks from step kb0 on (sums of rows
    past TP are zeros). _q8_rows' loop (see there), also the shared expert's down in moe_triton.
    NB: blocks of a step per tile (8, 4 or 2): each step is 8 / NB sub-steps over a [word, NB blocks, row] tile, so
    that a thread holds NB words of more rows and loads each x value once for all of them (x's registers and loads
    per weight word fall by 8 / NB at the same weight bytes per thread).
    PDL: this is the kernel's start, so it waits for the previous kernel (pdl_enter) here: with PF after the first
    sub-step's words and scales are requested (weights, which no kernel of a step writes: their loads then overlap
    that kernel's last programs while this one's programs are already resident), else before any load."""
    KP: tl.constexpr = (K + 255) // 256 * 256                            # padded row length
    SUB: tl.constexpr = 8 // NB                                           # sub-steps per step
    w_ptr = q_ptr.to(tl.pointer_type(tl.uint32))
    j = tl.arange(0, 8)[:, None, None]
    b = tl.arange(0, NB)[None, :, None]
    woff = (rows * (KP // 4))[None, None, :] + 8 * j + b                               # [8, NB, BR]
    doff = (rows * (KP // 32))[None, None, :] + b + 0 * j          # [8, NB, BR]: the quants' shape, hence layout
    xoff = 32 * b + 4 * j                                                               # [8, NB, 1]: x of byte 0
    acc0 = tl.zeros([8, NB, BR], tl.float32)
    acc1 = tl.zeros([8, NB, BR], tl.float32)
    acc2 = tl.zeros([8, NB, BR], tl.float32)
    acc3 = tl.zeros([8, NB, BR], tl.float32)
    if PF:                                  # this program's first sub-step, loaded before the loop
        w_next = tl.load(w_ptr + woff + kb0 * 64)
        d_next = tl.load(d_ptr + doff + kb0 * 8)
    pdl_enter(PDL)
    for it in range(0, STEPS * SUB):
        span = kb0 + it // SUB                      # the step (span of 8 blocks) and the sub-step's first block in it
        b0 = it % SUB * NB
        kb = span * 8 + b0                          # the sub-step's first block
        if PF:                              # the next sub-step's words and scales in flight during this one's math
            w, d = w_next, d_next.to(tl.float32)
            if SUB == 1:                    # the last step loads itself again: never past the range
                kn = tl.minimum(kb + 8, (kb0 + STEPS - 1) * 8)
                w_next = tl.load(w_ptr + woff + kn * 8)
                d_next = tl.load(d_ptr + doff + kn)
            else:                           # likewise the last sub-step
                nxt = tl.minimum(it + 1, STEPS * SUB - 1)
                ns, nb0 = kb0 + nxt // SUB, nxt % SUB * NB
                w_next = tl.load(w_ptr + woff + (ns * 64 + nb0))
                d_next = tl.load(d_ptr + doff + (ns * 8 + nb0))
        else:
            w = tl.load(w_ptr + woff + (span * 64 + b0))
            d = tl.load(d_ptr + doff + kb).to(tl.float32)
        hi = w >> 16
        v0 = ((w & 0xFF) | ONE).to(tl.float32, bitcast=True) - LO_BIAS           # q * 2^-23
        v1 = ((w & 0xFF00) | ONE).to(tl.float32, bitcast=True) - HI_BIAS         # q * 2^-15
        v2 = ((hi & 0xFF) | ONE).to(tl.float32, bitcast=True) - LO_BIAS
        v3 = ((hi & 0xFF00) | ONE).to(tl.float32, bitcast=True) - HI_BIAS
        xp = x_row + kb * 32 + xoff
        if TP == 1:
            acc0 += _word_sums(v0, v1, v2, v3, xp, kb, K, NB) * (d * 32768.0)
        else:       # the values d * q (exact) made once, then 4 FFMA per word and row of x
            dl = d * 8388608.0
            dh = d * 32768.0
            v0, v1, v2, v3 = v0 * dl, v1 * dh, v2 * dl, v3 * dh
            acc0 = _word_fma(acc0, v0, v1, v2, v3, xp, kb, K, NB)
            acc1 = _word_fma(acc1, v0, v1, v2, v3, xp + xs, kb, K, NB)
            if TP > 2:
                acc2 = _word_fma(acc2, v0, v1, v2, v3, xp + 2 * xs, kb, K, NB)
            if TP > 3:
                acc3 = _word_fma(acc3, v0, v1, v2, v3, xp + 3 * xs, kb, K, NB)
    return (tl.sum(tl.sum(acc0, axis=0), axis=0), tl.sum(tl.sum(acc1, axis=0), axis=0),
            tl.sum(tl.sum(acc2, axis=0), axis=0), tl.sum(tl.sum(acc3, axis=0), axis=0))


@triton.jit
def _word_x(xp, kb, K: tl.constexpr, NB: tl.constexpr):
    """x at the 4 bytes of each word: xp [8, NB, 1] the pointers to x at byte 0 (16-byte aligned) -> 4 x [8, NB, 1]
    float32, one 128-bit load each when K fills the padded row, else masked loads (the padded blocks past K, q = 0
    and d = 0, must not read past x)."""
    if K % 256 == 0:
        x0, x1, x2, x3 = ld4(xp.to(tl.pointer_type(tl.int32)))
        return (x0.to(tl.float32, bitcast=True), x1.to(tl.float32, bitcast=True), x2.to(tl.float32, bitcast=True),
                x3.to(tl.float32, bitcast=True))
    m = kb + tl.arange(0, NB)[None, :, None] < K // 32
    return (tl.load(xp, mask=m, other=0.0), tl.load(xp + 1, mask=m, other=0.0), tl.load(xp + 2, mask=m, other=0.0),
            tl.load(xp + 3, mask=m, other=0.0))


@triton.jit
def _word_sums(v0, v1, v2, v3, xp, kb, K: tl.constexpr, NB: tl.constexpr):
    """Sum over each word's 4 bytes of q * x, in units of 2^-15: v0..v3 [8, NB, BR] (bytes 0..3 of each word,
    q * 2^-23 / 2^-15 / 2^-23 / 2^-15), xp [8, NB, 1] the pointers to x at byte 0 of each word -> [8, NB, BR]."""
    x0, x1, x2, x3 = _word_x(xp, kb, K, NB)
    return (v0 * x0 + v2 * x2) * 256.0 + (v1 * x1 + v3 * x3)


@triton.jit
def _word_fma(acc, p0, p1, p2, p3, xp, kb, K: tl.constexpr, NB: tl.constexpr):
    """acc [8, NB, BR] + the sum over each word's 4 bytes of (d * q) * x: p0..p3 the values d * q of bytes 0..3 of
    each word, xp as in _word_sums."""
    x0, x1, x2, x3 = _word_x(xp, kb, K, NB)
    return acc + p0 * x0 + p1 * x1 + p2 * x2 + p3 * x3


@triton.jit
def _dequant_f16(q_ptr, d_ptr, out_ptr, N, inv_scale, K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
                 PDL: tl.constexpr):
    """Program (p, s): rows p*BR.. and values s*BK.. of out float16 [N, K], d * q * inv_scale rounded to nearest
    even; rows past N and blocks past K masked. Tile [row, block, value in block]: one scale load per block, and
    each word of 4 quants is one 4-byte load (split_q8 keeps them together)."""
    pdl_enter(PDL)
    KP: tl.constexpr = (K + 255) // 256 * 256
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    r = rows.to(tl.int64)[:, None, None]                                          # [BR, 1, 1]
    blk = (tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32))[None, :, None]  # [1, BK/32, 1]
    i = tl.arange(0, 32)[None, None, :]                                           # [1, 1, 32]
    k = blk * 32 + i                                                              # value index in the row
    pos = blk // 8 * 256 + i // 4 * 32 + blk % 8 * 4 + i % 4                     # its byte in split_q8's row
    mask = (rows < N)[:, None, None] & (blk < K // 32)                            # [BR, BK/32, 1]: whole blocks
    u = tl.load(q_ptr + r * KP + pos, mask=mask, other=128)
    d = tl.load(d_ptr + r * (KP // 32) + blk, mask=mask, other=0.0)
    value = (u.to(tl.int32) - 128).to(tl.float32) * d.to(tl.float32) * inv_scale  # exact: a power of two apart
    tl.store(out_ptr + r * K + k, value.to(tl.float16), mask=mask)


@triton.jit
def _x_f16(x_ptr, out_ptr, s_ptr, T, GK: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
           WGMMA_ORDER: tl.constexpr = False, DOWN_ORDER: tl.constexpr = False):
    """Program p: rows p*BT.. of x float32 [T, GK] -> out float16 [T, GK] = x / s rounded to nearest even, s [T]
    the power of two with the row's max |x| in [s/2, s) (2^-126 for a row of zeros or subnormals; finite rows below
    2^126), in two passes over the rows, the second mostly from L2. WGMMA_ORDER: each 256-value chunk's values
    stored in wgmma_position's order, DOWN_ORDER: in down_wgmma_position's (BK a multiple of 256)."""
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    live = rows < T
    base = rows.to(tl.int64)[:, None] * GK
    m = tl.zeros([BT], tl.float32)
    for k0 in tl.range(0, GK, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(x_ptr + base + k[None, :], mask=live[:, None] & (k < GK)[None, :], other=0.0)
        m = tl.maximum(m, tl.max(tl.abs(v), axis=1))
    e = (m.to(tl.int32, bitcast=True) >> 23) & 0xFF                                # biased exponent of the maximum
    tl.store(s_ptr + rows, ((e + 1) << 23).to(tl.float32, bitcast=True), mask=live)  # 2^(e - 126) > max
    inv = ((253 - e) << 23).to(tl.float32, bitcast=True)                           # 1 / s, exactly
    for k0 in tl.range(0, GK, BK):
        k = k0 + tl.arange(0, BK)
        mask = live[:, None] & (k < GK)[None, :]
        v = tl.load(x_ptr + base + k[None, :], mask=mask, other=0.0)
        p = k
        if WGMMA_ORDER:
            o = k % 256                              # wgmma_position in Triton: value o of a chunk -> its position
            sb, r, i = o >> 5, (o >> 3) & 3, o & 7
            p = (k - o) + 16 * (8 * (sb >> 2) + 2 * r + (i >> 2)) + 8 * ((i >> 1) & 1) + 2 * (sb & 3) + (i & 1)
        if DOWN_ORDER:
            o = k % 256                              # down_wgmma_position: o = 128 n + 32 j + 4 w + i
            n, j, w, i = o >> 7, (o >> 5) & 3, (o >> 2) & 7, o & 3
            p = (k - o) + 16 * (8 * n + 2 * j + (w >> 2)) + 8 * (i >> 1) + 2 * (w & 3) + (i & 1)
        tl.store(out_ptr + base + p[None, :], (v * inv[:, None]).to(tl.float16), mask=mask)


_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """int32 [COUNTER_SLOTS] zeros per device: the arrival counts of split row tiles (a call splits only when it has
    fewer tiles than its min programs, at most COUNTER_SLOTS, and leaves them at zero). Made on a device's first
    call, which runs before any CUDA graph capture (the backends warm every shape up eagerly)."""
    key = str(device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def launch_fields(config: tuple) -> tuple[int, int, int, bool, int]:
    """A launch config (rows per program, warps[, min programs[, prefetch[, blocks per tile]]]), as in ROWS_CONFIG ->
    all five fields, the missing ones at their defaults (MIN_PROGRAMS, no prefetch, NB_STEP blocks per tile)."""
    br, warps, *rest = config
    return (br, warps, rest[0] if rest else MIN_PROGRAMS, bool(rest[1]) if len(rest) > 1 else False,
            rest[2] if len(rest) > 2 else NB_STEP)


def rows_config(T: int, N: int, K: int) -> tuple:
    """q8_matmul's launch config for T (<= LAUNCH_T) rows of x and an [N, K] weight: SIZE_CONFIG's entry for them,
    else ROWS_CONFIG[T]."""
    return next((c for t, lo, hi, c in SIZE_CONFIG if t == T and lo <= N * K < hi), ROWS_CONFIG[T])


def row_launch(N: int, K: int, br: int, min_programs: int = MIN_PROGRAMS) -> tuple[int, int, int]:
    """_q8_rows' launch for N rows of K inputs at br rows per program: (row tiles, steps of NB_STEP blocks, K splits).
    K is split until there are min_programs programs, by a divisor of the steps (no partial split)."""
    tiles, steps = triton.cdiv(N, br), triton.cdiv(K // QK, NB_STEP)
    want = min(steps, triton.cdiv(min_programs, tiles))
    return tiles, steps, max(s for s in range(1, want + 1) if steps % s == 0)


def split_q8(blocks: torch.Tensor, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's GGUF rows uint8 [N, K/32*34] -> quants uint8 [N, KP] (q + 128), scales f16 [N, KP/32], on the
    blocks' device: the same values, rows padded to KP = K rounded up to 256 (q = 0, d = 0), and in each span of 8
    blocks word j (quants 4j..4j+3) of block b at word 8*j + b (word j of the 8 blocks is 32 contiguous bytes)."""
    if K % QK or blocks.dtype != torch.uint8 or blocks.numel() != N * (K // QK) * BLOCK_BYTES:
        raise ValueError(f"split_q8: expected uint8 with {N} x {K // QK * BLOCK_BYTES} bytes (K = {K} a multiple of "
                         f"32), got {blocks.dtype} {list(blocks.shape)}")
    KP = padded(K)
    b = blocks.reshape(N, K // QK, BLOCK_BYTES)
    scales = torch.zeros(N, KP // QK, dtype=torch.float16, device=blocks.device)
    scales[:, :K // QK] = b[..., :2].contiguous().view(torch.float16).reshape(N, K // QK)
    quants = torch.full((N, KP), 128, dtype=torch.uint8, device=blocks.device)
    quants[:, :K] = (b[..., 2:] ^ 0x80).reshape(N, K)
    return _swap_words(quants), scales


def padded(K: int) -> int:
    """split_q8's row length for K values: K rounded up to SPAN."""
    return -(-K // SPAN) * SPAN


def split_bytes(N: int, K: int) -> int:
    """Bytes of split_q8's arrays for an [N, K] weight."""
    return N * padded(K) // QK * BLOCK_BYTES


def _swap_words(u: torch.Tensor) -> torch.Tensor:
    """uint8 [N, KP]: in each span of NB_STEP blocks, word j of block b <-> word b of block j ([block, word] ->
    [word, block]; NB_STEP = 8 = the words of a block, so the swap is its own inverse)."""
    N, KP = u.shape
    return u.reshape(N, KP // SPAN, NB_STEP, QK // 4, 4).transpose(2, 3).reshape(N, KP)


def dequantize(quants: torch.Tensor, scales: torch.Tensor, K: int) -> torch.Tensor:
    """split_q8's arrays -> float32 [N, K] (value = d * q, exact)."""
    N, KP = quants.shape
    u = _swap_words(quants).reshape(N, KP // QK, QK)
    return ((u.to(torch.int16) - 128).float() * scales.float()[..., None]).reshape(N, KP)[:, :K]


def q8_matmul(x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, K: int, groups: int = 1, *,
              out: torch.Tensor | None = None, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """x: float32 [T, groups*K], 1 <= T <= 16; quants, scales: split_q8 of an [N, K] weight -> [T, N]
    (written into `out` when given), one launch per LAUNCH_T rows of x. config: (rows per program, warps[, min
    programs: K is split until there are that many[, prefetch]]) of every launch, overriding rows_config (sweeps).
    With no config, CUDA calls go to the tensor-core kernel instead where q8_mma.use_mma says (DS4_Q8_MMA)."""
    x, quants, scales, out = call_operands("q8_matmul", x, quants, scales, K, groups, out)
    if config is None and q8_mma.use_mma(x, quants.shape[0], groups):
        return q8_mma.launch(x, quants, scales, K, groups, out)
    T, N = out.shape
    rows_per_group = N // groups
    for t0 in range(0, T, LAUNCH_T):
        tp = min(LAUNCH_T, T - t0)
        br, warps, min_programs, pf, nb = launch_fields(config or rows_config(tp, N, K))
        if not 1 <= min_programs <= COUNTER_SLOTS:
            raise ValueError(f"q8_matmul: min programs {min_programs} outside 1..{COUNTER_SLOTS}")
        if nb not in (2, 4, 8):
            raise ValueError(f"q8_matmul: blocks per tile {nb} not 2, 4 or 8")
        if groups > 1 and rows_per_group % br:
            raise ValueError(f"q8_matmul: rows per group {rows_per_group} must be a multiple of the row tile {br}")
        tiles, steps_total, splits = row_launch(N, K, br, min_programs)
        o = out[t0:t0 + tp]                                                             # [tp, N], contiguous
        part = o if splits == 1 else torch.empty(splits, tp, N, dtype=torch.float32, device=x.device)
        _q8_rows[(tiles, splits)](x[t0:t0 + tp], quants, scales, o, part, _counters(x.device), N, rows_per_group,
                                  ONE_BITS, K=K, BR=br, STEPS=steps_total // splits, SPLITS=splits, TP=tp, PF=pf,
                                  NB=nb, num_warps=warps, **pdl_launch(x.device))
    return out


def call_operands(what: str, x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, K: int, groups: int,
                  out: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The checks of a Q8_0 product's arguments (q8_matmul, q8_mma.q8_mma_matmul; `what` names the caller in the
    errors) -> x contiguous at a 16-byte boundary (both kernels read it by 16-byte loads), quants and scales
    contiguous, and out [T, N] float32 (made when None)."""
    N, KP = quants.shape
    if K % QK or N % groups or KP != padded(K) or quants.dtype != torch.uint8 \
            or scales.dtype != torch.float16 or scales.shape != (N, KP // QK):
        raise ValueError(f"{what}: expected split_q8 arrays of an [N, {K}] weight (N a multiple of groups = "
                         f"{groups}), got quants {quants.dtype} {list(quants.shape)}, scales {scales.dtype} "
                         f"{list(scales.shape)}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != groups * K or not 1 <= x.shape[0] <= 16:
        raise ValueError(f"{what} x: expected float32 [1..16, {groups * K}], got {x.dtype} {list(x.shape)}")
    if quants.device != x.device or scales.device != x.device:
        raise ValueError(f"{what}: x and the weight are on different devices")
    T = x.shape[0]
    x, quants, scales = x.contiguous(), quants.contiguous(), scales.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()
    if out is None:
        out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    elif out.shape != (T, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"{what} out: expected contiguous float32 [{T}, {N}], got {out.dtype} {list(out.shape)}")
    return x, quants, scales, out


def wgmma_position(o: torch.Tensor | int) -> torch.Tensor | int:
    """Where value o (0..255) of a 256-value chunk goes in x_f16's wgmma order (moe_mma.cu moe_gateup_iq2_wg): with
    o = 32 sb + 8 r + i (sub-block sb = t + 4 h, run r, value i = 4 half + 2 kc + j), position 16 (8 h + 2 r + half)
    + 8 kc + 2 t + j."""
    sb, r, i = o >> 5, (o >> 3) & 3, o & 7
    return 16 * (8 * (sb >> 2) + 2 * r + (i >> 2)) + 8 * ((i >> 1) & 1) + 2 * (sb & 3) + (i & 1)


def down_wgmma_position(o: torch.Tensor | int) -> torch.Tensor | int:
    """Where value o (0..255) of a 256-value chunk goes in x_f16's down order (moe_mma.cu moe_down_q2k_wg): with
    o = 128 n + 32 j + 4 (t + 4 hw) + 2 kc + b, position 16 (8 n + 2 j + hw) + 8 kc + 2 t + b."""
    n, j, w, i = o >> 7, (o >> 5) & 3, (o >> 2) & 7, o & 3
    return 16 * (8 * n + 2 * j + (w >> 2)) + 8 * (i >> 1) + 2 * (w & 3) + (i & 1)


def x_f16(x: torch.Tensor, wgmma_order: bool = False, down_order: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The input side of project_f16 (runtime/backends/cuda.py) in one kernel (each row band read twice):
    x float32 [T, GK] -> (float16 [T, GK], s float32 [T]) with row t = x[t] / s[t] rounded to nearest even, s[t]
    the power of two with max |x[t]| in [s/2, s) (bit for bit torch's (x[t] / s[t]).to(torch.float16)).
    wgmma_order: each 256-value chunk of a row in wgmma_position's order (the gate/up of moe_mma's wgmma kernels);
    down_order: in down_wgmma_position's (their down); GK a multiple of 256 for either."""
    ordered = wgmma_order or down_order
    if x.dtype != torch.float32 or x.dim() != 2 or ordered and x.shape[1] % 256 or wgmma_order and down_order:
        raise ValueError(f"x_f16: expected float32 [T, GK]{' with GK % 256 == 0' if ordered else ''} and one order, "
                         f"got {x.dtype} {list(x.shape)}")
    T, GK = x.shape
    x = x.contiguous()
    out = torch.empty(T, GK, dtype=torch.float16, device=x.device)
    s = torch.empty(T, dtype=torch.float32, device=x.device)
    _x_f16[(triton.cdiv(T, X_F16_BT),)](x, out, s, T, GK=GK, BT=X_F16_BT, BK=X_F16_BK, WGMMA_ORDER=wgmma_order,
                                        DOWN_ORDER=down_order, num_warps=PARTS_WARPS)
    return out, s


def dequant_f16(quants: torch.Tensor, scales: torch.Tensor, K: int, inv_scale: float = 1.0) -> torch.Tensor:
    """split_q8's arrays of an [N, K] weight -> float16 [N, K]: the values d * q times inv_scale (a power of two:
    f16_scale's inverse keeps them in float16's range) rounded to nearest even (bit for bit torch's
    .to(torch.float16) of dequantize(...) * inv_scale)."""
    N, KP = quants.shape
    if K % QK or KP != padded(K) or quants.dtype != torch.uint8 or scales.dtype != torch.float16 \
            or scales.shape != (N, KP // QK) or scales.device != quants.device:
        raise ValueError(f"dequant_f16: expected split_q8 arrays of an [N, {K}] weight, got quants "
                         f"{quants.dtype} {list(quants.shape)}, scales {scales.dtype} {list(scales.shape)}")
    out = torch.empty(N, K, dtype=torch.float16, device=quants.device)
    grid = (triton.cdiv(N, PARTS_BR), triton.cdiv(K, PARTS_BK))
    _dequant_f16[grid](quants.contiguous(), scales.contiguous(), out, N, inv_scale, K=K, BR=PARTS_BR, BK=PARTS_BK,
                       num_warps=PARTS_WARPS, **pdl_launch(quants.device))
    return out


def f16_scale(scales: torch.Tensor) -> float:
    """The power of two that dequant_f16's values of a weight with these split_q8 scales are divided by: the
    largest |d * q| (|q| <= 128) lands in [2^14, 2^15), far from float16's overflow (65504) and its subnormals
    (below 2^-14) for all but values 2^28 times smaller than it. One host read of the scales' maximum (at load)."""
    m = scales.abs().max().float().item() * 128
    return 2.0 ** (math.frexp(m)[1] - 15) if 0 < m < math.inf else 1.0
