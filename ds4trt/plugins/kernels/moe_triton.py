"""ds4::MoE in Triton: the routed experts of one layer, read straight from the GGUF blocks.

    moe_forward(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type, clamp,
                out=None, workspace=None)
        -> out [T, D] float32; the contract of plugins/moe.py (inputs, byte layout, semantics), any T >= 1
    MoEWorkspace.create(T, k, D, F, device): the call's scratch, allocated once (CUDA graph capture)
    dequant_rows_triton(blocks [N, row bytes] uint8, ggml_type) -> [N, cols] float32 (test / debugging aid)

Weights are never materialized as floats: every program loads its rows' blocks and dequantizes them in
registers. For T <= 16 (decode, verify): four launches (six and split_runs' when T >= MULTI_MIN), no host
synchronization, so a CUDA graph can capture a call:

  1. _moe_prepare  program 0 groups the T*k (token, slot) pairs by expert. Sorted position s of each pair
                   (by expert, then pair index) -> order[s] = pair; cnt[s] = number of pairs (<= CAP) of the
                   item that starts at s (0 where no item starts). An item is up to CAP pairs of one expert
                   that has at least MULTI_MIN pairs in the call, else one pair. When gate or up is IQ2_XXS,
                   programs 1.. store the activations as integers for its one-pair kernel (_quant_runs); with
                   `shared` (one token) the last programs store the shared expert's SwiGLU sh.
  2. gate/up       grid (T*k sorted positions, F / BR row tiles): the program of an item computes, for its
                   BR rows of F and each pair of the item, h[pair] = weight * swiglu(gate_e v_t, up_e v_t).
  3. down          grid (T*k, D / BR): y[pair, rows] = down_e h[pair] for the item's pairs; with `shared` (one
                   token) also a Q8_0 shared expert's down product of its SwiGLU sh, in extra programs (SHARED_BR).
  4. out[t] = sum over slots of y[t*k + slot]   (torch; a fixed order, so the result is deterministic)

T > 16 (prefill chunks): the same kernels, but the items are made by torch (_long_items: a stable sort by expert)
with up to 32 or 64 pairs each (long_launch) and listed on the device, so each program serves one listed item
(COMPACT) and an expert's blocks are read once per 32 or 64 of its tokens instead of once per 16-token slice. The
lists are padded to their longest possible length (programs past an item list's end find no item and return), so
nothing waits on the host: the host runs ahead into the next layer while the experts compute. The multi-pair items of
an IQ2_XXS gate/up and of a Q2_K down (one activation part) go to moe_mma's CUDA C++ kernels instead where they run
(measured faster: moe_mma.py; DS4_MOE_MMA=0 keeps these).

Kernels 2 and 3 come in two forms. `_single` serves items of one pair (the decode case): IQ2_XXS gate/up as integer
dot products (_iq2_dp_rows: each run's 8 signed magnitudes as int8 by a byte permute, times the activations stored
as u * (2048 h + l) with int8 h and int16 l per run of 8, so the sums are exact integers and agree with float64 to
~1e-6 relative), a Q2_K down likewise (_q2k_dp_rows: the gate/up kernel stores its h in those integers, _quant_h, in
the pair's own row of h, which then holds int32 planes instead of floats), the other types by float32 FMA on the
decoded values (_fma_rows says how each value becomes one FMA). `_multi` serves items of 2..CAP pairs (tokens
sharing an expert), so one read of the expert's rows serves every token routed to it: the blocks become exact small
integers in fp16 (Q2_K sc*q <= 45, Q4_K sc*q <= 945, IQ2_XXS (2s+1)*grid*sign <= 1333, all exact below 2048; made by
byte permutes and HFMA2: IQ2_XXS in _iq2_mma_runs, sm_90 gate/up loop 3574 -> 1279 instructions, Q2_K / Q4_K in
_kq_mma_runs) times a per-row float scale, and the activations are split per 256-value chunk into two fp16 terms
after a power-of-two scaling (x * 2^-e = hi + lo + O(2^-22 max|x|); split_runs, by torch once per call for all
programs: the gate/up kernel's v, the down kernel's h). Each tensor-core product is then exact in the fp32
accumulator up to fp32 rounding, so both forms agree with float64 to ~1e-6 relative.

Accumulation is float32 throughout. No atomics: every output element is written by one program.

Block layouts decoded here (ggml; spec ds4_architecture.md §2.8), 256 values per block, value k:
  Q2_K (84 B):  scales[16] | qs[64] | f16 d | f16 dmin.
                value k = d * (scales[k/16] & 15) * q - dmin * (scales[k/16] >> 4), with
                k = 128n + 32j + l (l < 32): q = (qs[32n + l] >> 2j) & 3.
                Seen as 16 runs of 16: run c = k/16 = 8n + 2j + (l >= 16) reads qs[32(c>>3) + 16(c&1) + l16]
                at shift 2((c>>1)&3).
  Q4_K (144 B): f16 d | f16 dmin | scales[12] | qs[128].
                value k = d * sc[s] * q - dmin * m[s], s = k/32 (8 runs of 32),
                q = (qs[32(s>>1) + l] >> 4(s&1)) & 15. Six-bit (sc, m) of run s from B = scales:
                  s < 4:  sc = B[s] & 63,                     m = B[s+4] & 63
                  s >= 4: sc = (B[s+4] & 15) | (B[s-4] >> 6) << 4,  m = (B[s+4] >> 4) | (B[s] >> 6) << 4
  IQ2_XXS (66 B): f16 d | 8 groups of (u32 A, u32 B), little-endian.
                Group g = values 32g..32g+31, four runs of 8 (run r = 4g + l). A's byte l indexes the grid:
                8 magnitudes in {8, 25, 43}; B bits 7l..7l+6 index ksigns (bit i set -> value i negative);
                B >> 28 = s. value = d * (0.5 + s) / 4 * magnitude * sign = d/8 * (2s+1) * magnitude * sign.
                The grid is kept as 256 16-bit words of 2-bit codes (0, 1, 2 -> 8, 25, 43; magnitude
                = 8 + c * (16.5 + c/2)), built at import from gguf's own grid and ksigns tables.

Offsets into the expert tensors are int64 (E * rows * row bytes reaches 1.2e9 for Flash Q4_K; the margin
to 2^31 is small). Alignment: Q4_K blocks (144 B) keep their quants 16-byte aligned and Q2_K blocks (84 B)
4-byte aligned, so those are read as 32-bit words; IQ2_XXS blocks (66 B) are only 2-byte aligned, so their
fields are read as fp16 / uint16 / bytes, never as 4-byte words.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from gguf import quants as gguf_quants

from ds4trt.plugins.kernels import moe_mma
from ds4trt.plugins.kernels.int_dot import ASM, XQ_LO, dp2a, dp4a, int_words, quant_values
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch
from ds4trt.plugins.kernels.q8_triton import padded, q8_tile, x_f16
from ds4trt.plugins.kernels.wide_load import ld4

Q2_K, Q4_K, IQ2_XXS = 10, 12, 16
# ggml type -> (bytes per 256-value block, NS runs, L values per run); value k of a block is run k // L.
LAYOUT = {Q2_K: (84, 16, 16), Q4_K: (144, 8, 32), IQ2_XXS: (66, 32, 8)}
QK = 256
ONE_BITS = 0x3F800000      # the bits of 1.0f (passed as an argument: see _fma_rows)
CAP = 16                    # most pairs one item (one program) handles; the tensor-core tile width
# Launch settings of the one-pair (decode) kernels, by block type: (rows per program, warps, register cap or None,
# prefetch: the next block's fields loaded a step ahead; for an IQ2_XXS gate and up, which run in one loop
# (_iq2_dp_pair), its form over pairs of blocks as 32-bit words instead). Chosen from the compiled code for sm_90
# (registers, spills, instructions per value, weight bytes in flight per SM: the loops are latency-bound when too few
# bytes are in flight);
# scripts/bench_kernels.py times alternatives. Gate/up use the gate type's row tile and warps.
# Since the tiles put the rows last (_iq2_dot): 32 rows x 4 warps with prefetch for Q2_K and Q4_K (H200, BENCHMARKS.md:
# q2 layer 79.3 us at T = 1, every swept alternative within 1 us or slower; q4 64.8 us). IQ2_XXS gate/up on integer
# dot products (_iq2_dp_pair, a group's 4 runs per thread): 16 rows x 2 warps, no prefetch: each thread then holds
# two rows of a group and loads x's runs once for both; q2 layer at T = 1 42.2 us against 44.5 at 16 x 4 and 50.1 at
# 32 x 4, the decode step ~0.1 ms faster (BENCHMARKS.md, 2026-12-02, twenty-sixth session); two blocks per step on
# [2, group, row] tiles at 8 warps, the loop unrolled by two, the K range split over programs and the blocks kept
# rearranged (records apart from scales, scripts/bench_iq2_gateup.py) were all no faster.
# Nor were the pair loop's next fields loaded a step ahead (26.4 against 24.8 us) or its selector tables in shared
# memory or by arithmetic (26.7-31 us; with no tables at all, a bound, 20.1): scripts/bench_iq2_tables.py, thirtieth
# session. An L2 prefetch of a program's whole row tile before its loop: 6-12 % slower (thirty-second session).
# A Q2_K down runs on integer dot products too (_q2k_dp_rows), which has no prefetch form: loading the next block
# first made the decode step ~0.5 ms slower on the H200 (BENCHMARKS.md, try/q2k-down-dp-pf), so Q2_K's prefetch flag
# serves only a Q2_K gate or up (_fma_rows); 64-row tiles measured no better than 32.
SINGLE_CONFIG = {Q2_K: (32, 4, None, True), Q4_K: (32, 4, None, True), IQ2_XXS: (16, 2, None, False)}
# Calls of 2..CAP tokens (verify) launch T * k one-pair programs per row tile (at least 12 at Flash's k = 6), so
# fewer warps per program pay: ((most tokens, {block type: launch}), ...), the first entry whose bound covers T
# overriding SINGLE_CONFIG. q2 layer, IQ2_XXS gate/up tiles, H200 (same session): T = 2 16 x 1 70.2 us, 16 x 2
# 70.5, 32 x 4 71.6; T = 3 16 x 1 94.4, 16 x 2 99.8, 32 x 4 106.6 (verify of 2 drafts 13.0 ms against 13.6); T = 4
# 16 x 2 122.5, 16 x 1 132.3, 32 x 4 126.8; calls of 5..16 tokens keep 32 x 4 (not swept there).
# The pair loop over word pairs (prefetch True), H100, the sixty-second session (BENCHMARKS.md): T = 1 41.5 us against
# 41.3-41.4 (not taken), T = 2 68.3 against 71.1-71.4, T = 3 105.7 (16 x 1; 99.1 at 16 x 2, its best) against 96.2-96.8
# (kept), T = 4 122.8 against 127.6-128.4, T = 8 238.1 against 256.6-258.0, T = 16 446.2 against 485.6-488.5.
SHORT_CONFIG = ((2, {IQ2_XXS: (16, 1, None, True)}), (3, {IQ2_XXS: (16, 1, None, False)}),
                (4, {IQ2_XXS: (16, 2, None, True)}), (CAP, {IQ2_XXS: (32, 4, None, True)}))
MULTI_BR, MULTI_WARPS = 64, 8
SPLIT_CHUNKS = 8            # 256-value chunks per program of split_runs
# A Q8_0 shared expert's down product inside the one-pair down launch of a decode call (moe_forward's `shared`, T = 1):
# D / SHARED_BR extra programs of SHARED_BR rows and the whole F each beside the routed down (4 rows per warp: 8
# weight words per thread, 56 registers for the Q2_K down against 48 without, so the routed programs keep their
# occupancy), instead of a Q8_0 launch of its own. H200, 4 Flash layers, DS4_PDL=0 (BENCHMARKS.md, twenty-ninth
# session): routed down 12.4 + shared down 6.4 us -> 14.2 us per layer (split over F in two: 16.6), and at 43 layers
# the decode step 7.38 / 7.19 -> 7.02 / 7.06 ms in two rounds. The gate/up alike (its programs beside the routed
# gate/up) cost more than its own launch (26.0 + 8.2 -> 38.5 us), and at T = 3 the down too (26.3 + 9.0 -> 41.3 us:
# the verify tile's registers cut the routed programs' occupancy), so only the decode down takes it.
SHARED_BR = 16
# On the H200 (BENCHMARKS.md, q2) a multi-pair item costs about as much as 4.5 one-pair items (6 experts shared by
# T = 2..4 tokens: 464-468 us; 6T distinct experts, one pair each: 227 us at T = 2, 402 at 4). So in calls of up to 16
# tokens an expert's pairs form multi-pair items only when it has at least MULTI_MIN of them, and calls of fewer tokens
# (decode, verify of up to 3 drafts) launch the one-pair kernels alone. Verify of 4 drafts at 43 layers with uniform
# routing (a few experts shared by 2 of the 5 tokens): 24.4 ms, against 28.4 with multi-pair items for every shared one.
MULTI_MIN = 5
# Long calls (T > CAP: prefill chunks): items of up to CAP pairs of one expert, so that one read of an expert's blocks
# serves up to CAP tokens; (CAP, rows per program, warps, pipeline stages, activation parts) by CAP, the one whose items
# cost least (long_launch), swept by scripts/bench_kernels.py. Parts: 2 splits each activation in two float16 terms (hi
# + lo, exact to ~1e-6 like the short calls' kernels), 1 keeps hi alone (each value to 2^-11 of its magnitude; the Q2_K
# / Q4_K min terms keep both). Normwise against float64, a 300-token call at Flash width: q2 mix 5.0e-4 with one part
# (within the issue's 1e-3 for float16 inputs; ds4's own kernels quantize the activations to int8), 2.6e-6 with two;
# all-Q4_K 1.2e-3 with one, 4.9e-6 with two, so a call with a Q4_K matrix keeps two parts (LONG_CONFIGS_Q4). The loops
# are latency-bound (one 8-warp program per SM at 255 registers: 12.5 % occupancy, 0.3 instructions issued per scheduler
# cycle, ncu), so a one-part product with 64-row tiles of 4 warps (two programs per SM) pays most. H200, q2 layer
# (BENCHMARKS.md, thirty-seventh session), ms at T = 512 / 1024 / 2048 random, 2048 skewed: (32, 128, 8, 1, 2) / (64,
# 128, 8, 1, 2) before 6.24 / 6.93 / 11.55 / 14.21; (32, 64, 4, 1, 1) 4.90 / 5.67 / 10.17 / 9.85, (64, 64, 4, 1, 1) 7.93
# / 8.48 / 9.57 / 11.71; two parts at those shapes 6.6-16 ms, 2 pipeline stages or 2 / 8 warps or 32 / 128 rows slower;
# gate and up in one loop over the blocks (not GATE_THEN_UP) 5.53 / 6.25 / 10.55 / 10.78 against 5.32 / 5.83 / 9.57 /
# 9.99 (thirty-eighth session). All-Q4_K layer, two parts, same T: (32, 128, 8, 1, 2) 7.89 / 8.78 / 15.19 / 14.64, (32,
# 64, 4, 1, 2) 6.80 / 7.84 / 14.46 / 14.15, (64, 128, 8, 1, 2) 9.66 / 10.42 / 11.59 / 13.96, (64, 64, 4, 1, 2) 9.23 /
# 9.96 / 11.74 / 14.56; 8 warps at 64 rows, 16 or 32-row items slower.
# An item costs about the same at any fill: ~20 us at CAP 32, ~35 at 64 (LONG_ITEM_COST, relative).
# Measured and dropped (thirty-second session): each block's product in 2-8 smaller tensor-core products with the
# activations loaded after the weights' decode (fewer spills, 9-35 % slower: they must load during it), and an L2
# prefetch of each row's next block (within +-3 %).
LONG_CONFIGS = {32: (32, 64, 4, 1, 1), 64: (64, 64, 4, 1, 1)}
LONG_CONFIGS_Q4 = {32: (32, 64, 4, 1, 2), 64: (64, 128, 8, 1, 2)}
LONG_ITEM_COST = {32: 1.0, 64: 1.75}
# The same for moe_mma's items (its gate/up at CAP 64 with the block scales in its float16 values, 247388a): H100, a q2
# layer's routed experts at random routing (bench_kernels --long-config, BENCHMARKS.md, the forty-seventh session), CAP
# 32 / 64 3.25 / 4.12 ms at 1024 tokens (~24 pairs an expert: one item either way), 5.69 / 4.73 at 2048 (~48: two
# items against one).
MMA_ITEM_COST = {32: 1.0, 64: 1.6}
# From this many pairs an expert on average (ceil(P / E)), a long call whose gate/up and down both go to moe_mma lists
# its one-pair items among the others for moe_mma (_long_items' apart False) instead of the one-pair Triton kernels:
# their padded list launched min(E, P) x F / BR programs, nearly all empty (at 2048 tokens, ~one real single an
# expert-layer with random routing, the two one-pair kernels and _moe_prepare's quantization for them took ~0.24 ms a
# layer on an H100, BENCHMARKS.md, the forty-seventh session), while a one-pair moe_mma item costs a whole item.
# Measured at ~48 and ~24 pairs an expert (H100, 28 layers, a 2048-token prompt in chunks of 2048 / 1024: 266.6-267.8
# -> 264.0-264.1 ms, 340.5 -> 333.3; BENCHMARKS.md, the forty-eighth session); the threshold between 12 (512-token
# chunks, which keep the one-pair kernels) and 24 is a guess, not measured.
SINGLES_IN_ITEMS_FROM = 16


def one_pair_config(T: int) -> dict[int, tuple]:
    """The one-pair kernels' launch settings by block type for a call of T tokens: SINGLE_CONFIG, overridden for
    2..CAP tokens by SHORT_CONFIG's entry for T."""
    short = next((c for most, c in SHORT_CONFIG if T <= most), {}) if T > 1 else {}
    return {**SINGLE_CONFIG, **short}


def long_launch(pairs: int, experts: int, types: tuple[int, ...], F: int,
                device: torch.device) -> tuple[int, int, int, int, int]:
    """(CAP, rows, warps, stages, activation parts) of a long call of `pairs` (token, slot) pairs over `experts`
    experts, gate / up / down `types`, F rows of gate and up, on `device`, chosen before the routing is on the host (a
    long call lists its items on the device, _long_items): the LONG_CONFIGS entry (LONG_CONFIGS_Q4 with a Q4_K matrix)
    whose multi-pair items would cost least with the pairs spread evenly (ceil(n / CAP) items per expert of n =
    ceil(pairs / experts)), at MMA_ITEM_COST where moe_mma's kernels take the gate/up at both CAPs
    (moe_mma.use_gateup), else at LONG_ITEM_COST."""
    configs = LONG_CONFIGS_Q4 if Q4_K in types else LONG_CONFIGS
    mma = all(moe_mma.use_gateup(types[0], types[1], configs[cap][4], F, cap, device) for cap in configs)
    n = -(-pairs // experts)
    cost = {cap: (MMA_ITEM_COST if mma else LONG_ITEM_COST)[cap] * -(-n // cap) for cap in configs}
    return configs[min(cost, key=cost.get)]


@functools.cache
def _iq2xxs_tables_np() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From gguf's own IQ2_XXS tables: (grid codes int16 [256]: 2 bits per value, value i at bits 2i (read as
    uint16); ksigns uint8 [128]; the selectors of _iq2_dp_block, int32 [384]: at grid index j < 256 the codes as nibbles
    (value i's code at bits 4i), at 256 + sign index the sign bits of ksigns moved to bit 2 of each nibble, so that
    codes | signs is the prmt selector of each value's signed magnitude, see _prmt_q)."""
    cls = gguf_quants.IQ2_XXS
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(256, 8)
    levels = np.asarray(cls.grid_map, dtype=np.float32)                     # 8, 25, 43
    codes = np.searchsorted(levels, grid)
    if not (levels[np.minimum(codes, len(levels) - 1)] == grid).all():
        raise RuntimeError("gguf's IQ2_XXS grid holds a value outside (8, 25, 43)")
    packed = (codes.astype(np.int64) << (2 * np.arange(8))).sum(1).astype(np.uint16).view(np.int16)
    ksigns = np.frombuffer(cls.ksigns, dtype=np.uint8).copy()
    nibbles = (codes.astype(np.int64) << (4 * np.arange(8))).sum(1)
    sign_bits = (ksigns.astype(np.int64)[:, None] >> np.arange(8)) & 1
    signs = (sign_bits << (4 * np.arange(8) + 2)).sum(1)
    return packed, ksigns, np.concatenate([nibbles, signs]).astype(np.int32)


_TABLES: dict[str, tuple[torch.Tensor, ...]] = {}


def _tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    key = str(device)
    if key not in _TABLES:
        _TABLES[key] = tuple(torch.from_numpy(t).to(device) for t in _iq2xxs_tables_np())
    return _TABLES[key]


# ---------------------------------------------------------------------------------------------------
# Block decoding (shared by every kernel)

@triton.jit
def _u2f(q):
    """Exact int32 -> float32 for 0 <= q < 2^23: the float whose bits are 2^23's with q in the mantissa,
    minus 2^23 (an OR and a subtract instead of the slower int-to-float conversion)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _ld_f16(ptr, off):
    return tl.load((ptr + off).to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def _ld_u16(ptr, off):
    return tl.load((ptr + off).to(tl.pointer_type(tl.uint16))).to(tl.int32)


@triton.jit
def _iq2_run_fields(ptr, base, c):
    """IQ2_XXS run c = 4g + r (group g) of the block at byte offset base: (grid index, sign index, the half-word
    of B holding s in its top 4 bits), int32 each."""
    g8 = 8 * (c >> 2)
    run = c & 3
    idx = tl.load(ptr + base + (2 + g8 + run)).to(tl.int32)           # A byte r: grid index
    lo = _ld_u16(ptr, base + (6 + g8))
    hi = _ld_u16(ptr, base + (8 + g8))
    return idx, ((lo | (hi << 16)) >> (7 * run)) & 127, hi


@triton.jit
def _kq_scales(ptr, base, c, TYPE: tl.constexpr):
    """Q2_K / Q4_K run c of the block at byte offset base: (s, m) int32, its scale and min multipliers."""
    if TYPE == 10:  # scale byte c = m << 4 | s
        sc = tl.load(ptr + base + c).to(tl.int32)
        return sc & 15, sc >> 4
    else:  # Q4_K: six-bit (s, m) from B = scales (module notes)
        bs = tl.load(ptr + base + (4 + c)).to(tl.int32)           # B[s]
        bs4 = tl.load(ptr + base + (8 + c)).to(tl.int32)          # B[s+4]
        bsm4 = tl.load(ptr + base + (4 + (c & 3))).to(tl.int32)   # B[s-4] (used for s >= 4)
        low = c < 4
        return (tl.where(low, bs & 63, (bs4 & 15) | ((bsm4 >> 6) << 4)),
                tl.where(low, bs4 & 63, (bs4 >> 4) | ((bs >> 6) << 4)))


@triton.jit
def _block_parts(ptr, base, c, grid_ptr, ksigns_ptr, TYPE: tl.constexpr, L: tl.constexpr):
    """Decode runs of L values: run j is run c[j] of the block at byte offset base[j] (int64), so a tile
    [BR * NS, L] holds the blocks of BR rows, one run per tile row (every per-run quantity is then a
    slice of the same 2D layout: no layout conversions in the loop).

    Returns (q [R, L], s [R], m [R], d [R], dmin [R]), float32, with
    value[j, l] = d[j] * s[j] * q[j, l] - dmin[j] * m[j] for value L*c[j] + l of its block; q, s, m are
    exact small integers (q is signed for IQ2_XXS, whose m and dmin are 0)."""
    l = tl.arange(0, L)[None, :]
    if TYPE == 10:  # Q2_K: run c = 8n + 2j + h reads qs[32n + 16h + l] at shift 2j
        qoff = 16 + 32 * (c >> 3) + 16 * (c & 1)
        qb = tl.load(ptr + (base + qoff)[:, None] + l).to(tl.int32)
        q = _u2f((qb >> (2 * ((c >> 1) & 3))[:, None]) & 3)
        si, mi = _kq_scales(ptr, base, c, TYPE)
        s, m = _u2f(si), _u2f(mi)
        d = _ld_f16(ptr, base + 80)
        dmin = _ld_f16(ptr, base + 82)
    elif TYPE == 12:  # Q4_K: run s reads qs[32(s>>1) + l] at shift 4(s&1)
        qb = tl.load(ptr + (base + 16 + 32 * (c >> 1))[:, None] + l).to(tl.int32)
        q = _u2f((qb >> (4 * (c & 1))[:, None]) & 15)
        si, mi = _kq_scales(ptr, base, c, TYPE)
        s, m = _u2f(si), _u2f(mi)
        d = _ld_f16(ptr, base)
        dmin = _ld_f16(ptr, base + 2)
    else:  # IQ2_XXS
        idx, sidx, hi = _iq2_run_fields(ptr, base, c)
        signs = tl.load(ksigns_ptr + sidx).to(tl.int32)                    # 8-bit sign masks
        codes = tl.load(grid_ptr + idx).to(tl.int32) & 0xFFFF             # 2-bit codes of 8 magnitudes
        cf = _u2f((codes[:, None] >> (2 * l)) & 3)
        mag = 8.0 + cf * (16.5 + 0.5 * cf)                                 # 8, 25, 43 (exact)
        q = tl.where(((signs[:, None] >> l) & 1) != 0, -mag, mag)
        s = _u2f(2 * (hi >> 12) + 1)
        m = s * 0.0
        d = _ld_f16(ptr, base) * 0.125
        dmin = d * 0.0
    return q, s, m, d, dmin


@triton.jit
def _to_bit(w, b, T: tl.constexpr):
    """Shift byte b of w to bit T. b is an arange over an in-thread dimension, so each register's shift is a
    compile-time constant and the select folds away."""
    return tl.where(8 * b <= T, w << ((T - 8 * b) & 31), w >> ((8 * b - T) & 31))


@triton.jit
def _expand4(w):
    """[..., E] words -> [..., E, 4]: each word repeated for its 4 bytes (in-thread copies, no data movement)."""
    w = tl.join(w, w)
    return tl.reshape(tl.join(w, w), w.shape[:-1] + (4,))


@triton.jit
def _kq_raw(ptr, blk, c, TYPE: tl.constexpr):
    """Raw loads of one Q2_K / Q4_K block per row (blk: [BR] byte offsets of the blocks; c: run indices):
    (words [NS, NW, BR] uint32, per-run scale bytes [NS, BR] int32, d and dmin [BR] as f16 bit patterns); the
    rows come last (see _iq2_dot). Multi-byte fields are read through a pointer of their own type indexed in
    elements: a byte pointer cast to uint32 would look to Triton's contiguity analysis like a stride of 4, and the
    loads would neither be vectorized nor coalesced. Q4_K packs its three scale bytes B[s], B[s+4], B[s-4] into
    one int."""
    p32 = ptr.to(tl.pointer_type(tl.uint32))
    p16 = ptr.to(tl.pointer_type(tl.uint16))
    if TYPE == 10:  # run c = 8n + 2j + h: qs[32n + 16h + 0..15] (4 words) at shift 2j
        wi = tl.arange(0, 4)[None, :, None]
        w = tl.load(p32 + (8 * (c >> 3) + 4 * (c & 1))[:, None, None] + wi + (blk // 4 + 4)[None, None, :])
        sc = tl.load(ptr + c[:, None] + blk[None, :]).to(tl.int32)
        d = tl.load(p16 + (blk // 2 + 40)).to(tl.int32)
        dmin = tl.load(p16 + (blk // 2 + 41)).to(tl.int32)
    else:  # Q4_K, run s: qs[32(s>>1) + 0..31] (8 words) at shift 4(s&1)
        wi = tl.arange(0, 8)[None, :, None]
        w = tl.load(p32 + (8 * (c >> 1))[:, None, None] + wi + (blk // 4 + 4)[None, None, :])
        cc = c[:, None]
        bk = blk[None, :]
        sc = (tl.load(ptr + (4 + cc) + bk).to(tl.int32)
              | (tl.load(ptr + (8 + cc) + bk).to(tl.int32) << 8)
              | (tl.load(ptr + (4 + (cc & 3)) + bk).to(tl.int32) << 16))
        d = tl.load(p16 + blk // 2).to(tl.int32)
        dmin = tl.load(p16 + (blk // 2 + 1)).to(tl.int32)
    return w, sc, d, dmin


@triton.jit
def _f16_bits(h):
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _kq_dot(acc, w, sc, d, dmin, x, c, ONE, TYPE: tl.constexpr):
    """acc [NS, NW, BR] += per word, the sum over its 4 values of value * x (x: [NS, NW, 4])."""
    b = tl.arange(0, 4)[None, None, None, :]
    d = _f16_bits(d)[None, :]
    dmin = _f16_bits(dmin)[None, :]
    if TYPE == 10:
        w = w >> (2 * ((c >> 1) & 3))[:, None, None]
        f = ((_to_bit(_expand4(w), b, 21) & 0x00600000) | ONE).to(tl.float32, bitcast=True)     # 1 + q/4
        a = 4.0 * d * (sc & 15).to(tl.float32)
        bb = -(a + dmin * (sc >> 4).to(tl.float32))
    else:
        w = w >> (4 * (c & 1))[:, None, None]
        f = ((_to_bit(_expand4(w), b, 19) & 0x00780000) | ONE).to(tl.float32, bitcast=True)     # 1 + q/16
        bs = sc & 255
        bs4 = (sc >> 8) & 255
        bsm4 = (sc >> 16) & 255
        low = (c < 4)[:, None]
        s6 = tl.where(low, bs & 63, (bs4 & 15) | ((bsm4 >> 6) << 4)).to(tl.float32)
        m6 = tl.where(low, bs4 & 63, (bs4 >> 4) | ((bs >> 6) << 4)).to(tl.float32)
        a = 16.0 * d * s6
        bb = -(a + dmin * m6)
    return acc + tl.sum((f * a[:, None, :, None] + bb[:, None, :, None]) * x[:, :, None, :], axis=3)


@triton.jit
def _iq2_raw(ptr, rb, sb):
    """Raw loads of block sb of each row for the IQ2_XXS tile (see _fma_rows); rb [BR]: byte offset of each
    row's block 0. Returns, per group g and row: the B word's halves lo, hi [8, BR], the A bytes [8, 4, BR], and
    the block's d [BR]."""
    b = rb + sb * 66                                        # even: fields are read as 16-bit words at most
    gb = 8 * tl.arange(0, 8)[:, None] + b[None, :]          # group g's fields start at byte gb + 2
    idx = tl.load(ptr + gb[:, None, :] + 2 + tl.arange(0, 4)[None, :, None]).to(tl.int32)   # A bytes
    p16 = ptr.to(tl.pointer_type(tl.uint16))
    lo = tl.load(p16 + (gb // 2 + 3)).to(tl.int32)
    hi = tl.load(p16 + (gb // 2 + 4)).to(tl.int32)
    d = tl.load(ptr.to(tl.pointer_type(tl.float16)) + b // 2).to(tl.float32)
    return lo, hi, d, idx


@triton.jit
def _iq2_dot(acc, lo, hi, d, idx, x, grid_ptr, ksigns_ptr, ONE):
    """acc [8, 4, BR] += per group g, run l and row, the sum of the run's 8 values times x [8, 4, 2, 4] (value
    32g + 8l + 4w + b of the block).
    Layout: the rows come last so that Triton, which orders the dims of a gather (no contiguity) from the first,
    spreads a warp's 32 lanes over (g, l) and repeats the rows in each thread; the 8 values of a run are made by
    joins, so they stay in one thread too. A thread then loads its 8 activations once per block for all its rows,
    and a warp's loads of a row's fields touch one row (reading x per row made the loop bound by L1 traffic)."""
    l = tl.arange(0, 4)[None, :, None]
    b4 = tl.arange(0, 4)[None, None, None, None, :]
    dl = d[None, :] * (0.125 * (2 * (hi >> 12) + 1).to(tl.float32))                         # d (2s+1) / 8
    sidx = ((lo | (hi << 16))[:, None, :] >> (7 * l)) & 127
    codes = tl.load(grid_ptr + idx).to(tl.int32) & 0xFFFF                                    # [8, 4, BR]
    signs = tl.load(ksigns_ptr + sidx).to(tl.int32)
    cw = _expand4(tl.join(codes, codes >> 8))                                             # [8, 4, BR, 2, 4]
    sw = _expand4(tl.join(signs, signs >> 4))
    f = (((cw << (21 - 2 * b4)) & 0x00600000) | ONE).to(tl.float32, bitcast=True)             # 1 + code/4
    a8 = (8.0 * dl)[:, None, :, None, None]
    a50 = (50.0 * dl)[:, None, :, None, None]
    mag = f * (f * a8 + a50) - a50                                                           # dl * (8, 25, 43)
    val = (mag.to(tl.int32, bitcast=True) ^ ((sw << (31 - b4)) & -2147483648)).to(tl.float32, bitcast=True)
    return acc + tl.sum(tl.sum(val * x[:, :, None, :, :], axis=4), axis=3)


@triton.jit
def _fma_rows(ptr, expert_off, row0, x_ptr, grid_ptr, ksigns_ptr, ONE,
              TYPE: tl.constexpr, NSB: tl.constexpr, BR: tl.constexpr, PREFETCH: tl.constexpr):
    """[BR] float32: rows row0..row0+BR of the expert at byte offset expert_off, dotted with x_ptr[0:256*NSB].

    The decode-case inner loop (float32 FMA). Each value becomes one FMA of a float f in [1, 2) built from its
    bits: ONE (the bits of 1.0f, a kernel argument so that AND and OR fuse into one LOP3) with the quant
    field placed at the top of the mantissa: Q2_K f = 1 + q/4, value = f * 4dS - (4dS + dmin m);
    Q4_K f = 1 + q/16, value = f * 16dS - (16dS + dmin m) (one rounding of the per-run constant, ~1e-7
    relative); IQ2_XXS f = 1 + code/4, magnitude = 8f^2 + 50f - 50 (8, 25, 43: exact), sign bit xor-ed in.
    The run-dependent part of each shift is applied once per 32-bit word before the word is expanded to
    its 4 values, so the per-value shifts are constants.
    PREFETCH: load the next block's weight bytes before computing the current one (two blocks in flight per
    program; costs registers, so occupancy, for some types: see SINGLE_CONFIG)."""
    if TYPE != 16:  # Q2_K, Q4_K: tile [run, word, row, byte]; the activations [run, word, byte] serve every row
        NS: tl.constexpr = 16 if TYPE == 10 else 8
        NW: tl.constexpr = 4 if TYPE == 10 else 8
        BS: tl.constexpr = 84 if TYPE == 10 else 144
        c = tl.arange(0, NS)
        rbase = expert_off + (row0 + tl.arange(0, BR)).to(tl.int64) * (NSB * BS)
        xoff = (NW * 4 * c)[:, None, None] + 4 * tl.arange(0, NW)[None, :, None] + tl.arange(0, 4)[None, None, :]
        acc = tl.zeros([NS, NW, BR], tl.float32)
        if PREFETCH:
            w, sc, d, dmin = _kq_raw(ptr, rbase, c, TYPE)
            for sb in range(0, NSB):
                nw, nsc, nd, ndmin = _kq_raw(ptr, rbase + tl.minimum(sb + 1, NSB - 1) * BS, c, TYPE)
                acc = _kq_dot(acc, w, sc, d, dmin, tl.load(x_ptr + sb * 256 + xoff), c, ONE, TYPE)
                w, sc, d, dmin = nw, nsc, nd, ndmin
        else:
            for sb in range(0, NSB):
                w, sc, d, dmin = _kq_raw(ptr, rbase + sb * BS, c, TYPE)
                acc = _kq_dot(acc, w, sc, d, dmin, tl.load(x_ptr + sb * 256 + xoff), c, ONE, TYPE)
        return tl.sum(tl.sum(acc, axis=1), axis=0)
    else:  # IQ2_XXS: tile [group g, run l, row, word w, byte b]: value 32g + 8l + 4w + b of each row's block
        rb = expert_off + (row0 + tl.arange(0, BR)).to(tl.int64) * (NSB * 66)
        xoff = ((32 * tl.arange(0, 8))[:, None, None, None] + 8 * tl.arange(0, 4)[None, :, None, None]
                + 4 * tl.arange(0, 2)[None, None, :, None] + tl.arange(0, 4)[None, None, None, :])
        acc = tl.zeros([8, 4, BR], tl.float32)
        if PREFETCH:
            lo, hi, d, idx = _iq2_raw(ptr, rb, 0)
            for sb in range(0, NSB):
                nlo, nhi, nd, nidx = _iq2_raw(ptr, rb, tl.minimum(sb + 1, NSB - 1))
                acc = _iq2_dot(acc, lo, hi, d, idx, tl.load(x_ptr + sb * 256 + xoff), grid_ptr, ksigns_ptr, ONE)
                lo, hi, d, idx = nlo, nhi, nd, nidx
        else:
            for sb in range(0, NSB):
                lo, hi, d, idx = _iq2_raw(ptr, rb, sb)
                acc = _iq2_dot(acc, lo, hi, d, idx, tl.load(x_ptr + sb * 256 + xoff), grid_ptr, ksigns_ptr, ONE)
        return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit
def _prmt_q(sel):
    """Four int8 weights from four selector nibbles (bits 0..15 of sel): nibble c + 4 s (code c = 0, 1, 2, sign s)
    picks byte c + 4 s of {8, 25, 43, 0, -8, -25, -43, 0}: one prmt (byte permute) on the GPU."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, 0x002B1908, 0x00D5E7F8, $1;", "=r,r", [sel],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = sel * 0
        for k in tl.static_range(4):
            nib = (sel >> (4 * k)) & 7
            c = nib & 3
            m = tl.where(c == 0, 8, tl.where(c == 1, 25, tl.where(c == 2, 43, 0)))
            out = out | ((tl.where((nib & 4) != 0, -m, m) & 255) << (8 * k))
        return out


def _halves_ptx(word: str, outs: tuple[int, ...]) -> str:
    """PTX: bytes 0, 1 and 2, 3 of `word` (each 1024 + u under 0x64) times s2 plus c2 (HFMA2), into the f16
    outputs $outs[0], $outs[1] and $outs[2], $outs[3]."""
    return "".join(f"prmt.b32 h, {word}, 0x64646464, {sel};\nfma.rn.f16x2 h, h, s2, c2;\n"
                   f"mov.b32 {{${a}, ${b}}}, h;\n" for sel, a, b in (("0x5140", *outs[:2]), ("0x5342", *outs[2:])))


# Eight f16 results of one run (below): the selector's two words of signed bytes (_prmt_q's tables), each byte u
# = b + 128 put under 0x64 as a half (1024 + u), and one HFMA2 per two values: (1024 + u) s - 1152 s = b s, exact
# (one rounding of an integer |b s| <= 1333 < 2048). Output m holds value bitrev3(m), the order in which
# _iq2_mma_runs joins them back.
_IQ2_F16_ASM = tl.constexpr("""{
.reg .b32 w0, w1, t, s2, c2, h;
.reg .b16 sh;
prmt.b32 w0, 0x002B1908, 0x00D5E7F8, $8;
shr.b32 t, $8, 16;
prmt.b32 w1, 0x002B1908, 0x00D5E7F8, t;
xor.b32 w0, w0, 0x80808080;
xor.b32 w1, w1, 0x80808080;
cvt.rn.f16.u32 sh, $9;
mov.b32 s2, {sh, sh};
mov.b32 c2, 0xE480E480;
mul.rn.f16x2 c2, s2, c2;
""" + _halves_ptx("w0", (0, 4, 2, 6)) + _halves_ptx("w1", (1, 5, 3, 7)) + "}")


@triton.jit
def _iq2_mma_runs(ptr, base, c, dp_ptr):
    """IQ2_XXS runs for the tensor-core kernels: run j is run c[j] (= 4g + r of group g) of the block at byte
    offset base[j] (int64) -> float16 [R, 8], value l = (2s+1) * its signed grid magnitude (exact integers). Per
    run two table loads give _iq2_dp_block's prmt selector; on the GPU ~20 PTX instructions (_IQ2_F16_ASM) make the 8
    halves, against ~11 per value for the float decode of _block_parts."""
    idx, sidx, hi = _iq2_run_fields(ptr, base, c)
    sel = tl.load(dp_ptr + idx) | tl.load(dp_ptr + 256 + sidx)
    s = 2 * (hi >> 12) + 1
    if ASM:
        # output m holds value bitrev3(m): three joins (each adds a last dim) and the reshape restore value order
        v = tl.inline_asm_elementwise(_IQ2_F16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [sel, s],
                                      dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        t = tl.join(tl.join(tl.join(v[0], v[1]), tl.join(v[2], v[3])),
                    tl.join(tl.join(v[4], v[5]), tl.join(v[6], v[7])))
        return tl.reshape(t, (sel.shape[0], 8))
    else:
        nib = (sel[:, None] >> (4 * tl.arange(0, 8)[None, :])) & 7
        code = nib & 3
        mag = tl.where(code == 0, 8, tl.where(code == 1, 25, tl.where(code == 2, 43, 0)))
        return (tl.where((nib & 4) != 0, -mag, mag) * s[:, None]).to(tl.float16)


# Four f16 results of one word of Q2_K / Q4_K quants (bytes q = 0..15, already shifted and masked): each byte put
# under 0x64 as a half (1024 + q) and one HFMA2 per two values: (1024 + q) s - 1024 s = q s, exact (one rounding of
# an integer q s <= 945 < 2048; (1024 + 15) * 63 < 65504). Output m holds value bitrev2(m) (see _kq_mma_runs).
_KQ_F16_ASM = tl.constexpr("""{
.reg .b32 s2, c2, h;
.reg .b16 sh;
cvt.rn.f16.u32 sh, $5;
mov.b32 s2, {sh, sh};
mov.b32 c2, 0xE400E400;
mul.rn.f16x2 c2, s2, c2;
""" + _halves_ptx("$4", (0, 2, 1, 3)) + "}")


@triton.jit
def _kq_mma_runs(ptr, base, c, TYPE: tl.constexpr, L: tl.constexpr):
    """Q2_K / Q4_K runs for the tensor-core kernels: run j is run c[j] of the block at byte offset base[j] (int64)
    -> (a float16 [R, L] = s * q, exact integers; m [R] int32, the run's min multiplier). The quants are read as
    32-bit words (the blocks keep them 4-byte aligned) and each word's 4 values made by one shift, one mask and, on
    the GPU, two byte permutes and two HFMA2 (_KQ_F16_ASM), against ~6 instructions per value in _block_parts."""
    p32 = ptr.to(tl.pointer_type(tl.uint32))
    wi = tl.arange(0, L // 4)[None, :]
    if TYPE == 10:  # run c = 8n + 2j + h: qs[32n + 16h + 0..15] at shift 2j
        w = tl.load(p32 + ((base + 16 + 32 * (c >> 3) + 16 * (c & 1)) // 4)[:, None] + wi)
        q = (w >> (2 * ((c >> 1) & 3)).to(tl.uint32)[:, None]) & 0x03030303
    else:  # Q4_K, run c: qs[32(c>>1) + 0..31] at shift 4(c&1)
        w = tl.load(p32 + ((base + 16 + 32 * (c >> 1)) // 4)[:, None] + wi)
        q = (w >> (4 * (c & 1)).to(tl.uint32)[:, None]) & 0x0F0F0F0F
    s, m = _kq_scales(ptr, base, c, TYPE)
    q = q.to(tl.int32, bitcast=True)
    s2 = tl.broadcast_to(s[:, None], q.shape)
    if ASM:
        # output m holds value bitrev2(m) of the word: two joins (each adds a last dim) and the reshape restore order
        v = tl.inline_asm_elementwise(_KQ_F16_ASM, "=h,=h,=h,=h,r,r", [q, s2], dtype=(tl.float16,) * 4,
                                      is_pure=True, pack=1)
        t = tl.join(tl.join(v[0], v[1]), tl.join(v[2], v[3]))
    else:
        b = tl.arange(0, 4)[None, None, :]
        t = (((q[:, :, None] >> (8 * b)) & 255) * s2[:, :, None]).to(tl.float16)
    return tl.reshape(t, (q.shape[0], L)), m


@triton.jit
def _quant_runs(row_ptr, K: tl.constexpr, run0, x, R: tl.constexpr, SWAP: tl.constexpr = False):
    """Store x [R, 8] (runs run0.. of a row of K activations) as integers for _iq2_dp_rows. Per run of 8 values,
    u = max|x| / (127 XQ_LO), h = rint(x / (XQ_LO u)) in [-127, 127], l = rint(x / u - XQ_LO h) in
    [-XQ_LO/2, XQ_LO/2], so that x = u (XQ_LO h + l) to within u / 2 (2^-19 of the run's largest |x|). The row
    (int32 [K * 7/8]) in planes of one word per run (K / 8 words each): h words 0, 1 (4 int8 each) | l words
    0..3 (2 int16 each) | u (float32). A warp of _iq2_dp_rows reads one plane's word of 32 consecutive runs: 128
    contiguous bytes, 4 sectors (word k of run r at 2r + k / 4r + k spread each such read over 8 / 16 sectors:
    the x loads were a third of the gate/up kernel's L1 sectors). SWAP: run 16n + 4j + i goes to word 16n + 4i + j
    of each plane (the order _q2k_dp_rows reads, see _quant_h)."""
    r = run0 + tl.arange(0, R)
    if SWAP:
        r = (r & ~15) | ((r & 3) << 2) | ((r >> 2) & 3)
    h, lo, u = quant_values(x)
    tl.store(row_ptr + tl.arange(0, 2)[None, :] * (K // 8) + r[:, None], int_words(h, 2, 8))
    tl.store(row_ptr + K // 4 + tl.arange(0, 4)[None, :] * (K // 8) + r[:, None], int_words(lo, 4, 16))
    tl.store(row_ptr.to(tl.pointer_type(tl.float32)) + 3 * K // 4 + r, u)


@triton.jit
def _iq2_fields(p16, rh, sb):
    """Raw loads of block sb of each row for the IQ2_XXS tile [group g, row] of _iq2_dp_rows; p16: the expert's
    blocks as uint16, rh [BR] int32: each row's block 0 in half-words (blocks are 2-byte aligned). Returns uint16
    [8, BR]: group g's A half-words (grid indices of runs 0, 1 and 2, 3), B's halves lo and hi, and the block's d
    (every lane of a row loads it: one half-word)."""
    b = (rh + sb * 33)[None, :]
    g4 = 4 * tl.arange(0, 8)[:, None]                       # group g's A at half-words 1 + 4g, 2 + 4g; B at 3, 4
    return (tl.load(p16 + (b + 1 + g4)), tl.load(p16 + (b + 2 + g4)), tl.load(p16 + (b + 3 + g4)),
            tl.load(p16 + (b + 4 + g4)), tl.load(p16 + (b + 0 * g4)))


@triton.jit
def _ld_run_planes(r0, PS: tl.constexpr):
    """The 4 consecutive runs at r0 (int32 pointers) of each of _quant_runs's 7 planes of PS words (h words 0, 1, l
    words 0..3, u): one 128-bit load (ld4) per plane -> 7 quads of int32 tensors shaped like r0."""
    return (ld4(r0), ld4(r0 + PS), ld4(r0 + 2 * PS), ld4(r0 + 3 * PS), ld4(r0 + 4 * PS), ld4(r0 + 5 * PS),
            ld4(r0 + 6 * PS))


@triton.jit
def _iq2_dp_block(acc, a01, a23, lo, hi, d, xq_ptr, sb, dp_ptr, NSB: tl.constexpr):
    """acc [8, BR] += per group g and row of block sb: d (2s+1)/8 * the sum over its 4 runs of u * (the run's 8
    signed magnitudes . x's integers), x as _quant_runs stores it in the token's row xq_ptr (planes of D/8 words).
    Per run: two table loads give the prmt selector (codes | signs), two prmt the 8 signed int8 weights, and six
    integer dot-product instructions (dp4a on h, dp2a on l) the run's sum exactly in int32
    (|XQ_LO * sum(w h) + sum(w l)| <= 8 * 43 * (127 * 2048 + 1024) < 2^27); one conversion and one FFMA per run;
    the group's fields and scale once for its 4 runs (a lane per group, the runs in the thread). A group's 4 runs
    are 4 consecutive words of each of x's 7 planes: one 128-bit load per plane (ld4)."""
    D: tl.constexpr = NSB * 256
    PS: tl.constexpr = D // 8
    r0 = xq_ptr + sb * 32 + 4 * tl.arange(0, 8)[:, None]                               # [8, 1]: group g's run 0
    h0, h1, l0, l1, l2, l3, xu = _ld_run_planes(r0, PS)
    bw = lo.to(tl.int32) | (hi.to(tl.int32) << 16)                                    # B: signs | s << 28
    y = tl.zeros(acc.shape, tl.float32)
    for l in tl.static_range(4):
        a = a01 if l < 2 else a23
        idx = (a.to(tl.int32) >> (8 * (l % 2))) & 255                                  # grid index of run l
        sel = tl.load(dp_ptr + idx) | tl.load(dp_ptr + 256 + ((bw >> (7 * l)) & 127))
        y = _iq2_dp_run(y, sel, h0[l], h1[l], l0[l], l1[l], l2[l], l3[l], xu[l])
    dl = d.to(tl.float16, bitcast=True).to(tl.float32) * (0.125 * _u2f(2 * (hi.to(tl.int32) >> 12) + 1))
    return acc + dl * y


@triton.jit
def _iq2_dp_run(y, sel, h0, h1, l0, l1, l2, l3, xu):
    """y + one run's u * (8 signed magnitudes . x's integers): sel the run's prmt selector, h0, h1, l0..l3 and xu its
    words of x's 7 planes (_iq2_dp_block)."""
    w0 = _prmt_q(sel)                                                                  # values 0..3 as int8
    w1 = _prmt_q(sel >> 16)                                                            # values 4..7
    sh = dp4a(w1, h1, dp4a(w0, h0, 0))
    sl = dp2a(l0, w0, 0, False)
    sl = dp2a(l1, w0, sl, True)
    sl = dp2a(l2, w1, sl, False)
    sl = dp2a(l3, w1, sl, True)
    return y + xu.to(tl.float32, bitcast=True) * (sh * XQ_LO + sl).to(tl.float32)


@triton.jit
def _iq2_dp_rows(ptr, expert_off, row0, xq_ptr, dp_ptr, NSB: tl.constexpr, BR: tl.constexpr,
                 PREFETCH: tl.constexpr):
    """[BR] float32: rows row0..row0+BR of the IQ2_XXS expert at byte offset expert_off dotted with one token's
    activations as _quant_runs stores them (xq_ptr: the token's row). The gate/up inner loop of decode and verify
    (one-pair items): integer dot products on the quantized activations (_iq2_dp_block) instead of one float FMA and
    ~9 integer operations per value (the float path, _fma_rows, is ALU-bound on the H200). Used when only one of
    gate and up is IQ2_XXS (both: _iq2_dp_pair).
    Tile [group g, row] (rows last, see _iq2_dot); PREFETCH: load the next block's fields first."""
    p16 = (ptr + expert_off).to(tl.pointer_type(tl.uint16))         # expert_off is even (66-byte blocks)
    rh = (row0 + tl.arange(0, BR)) * (NSB * 33)                     # int32: < 2^31 within one expert
    acc = tl.zeros([8, BR], tl.float32)
    if PREFETCH:
        a01, a23, lo, hi, d = _iq2_fields(p16, rh, 0)
        for sb in range(0, NSB):
            na01, na23, nlo, nhi, nd = _iq2_fields(p16, rh, tl.minimum(sb + 1, NSB - 1))
            acc = _iq2_dp_block(acc, a01, a23, lo, hi, d, xq_ptr, sb, dp_ptr, NSB)
            a01, a23, lo, hi, d = na01, na23, nlo, nhi, nd
    else:
        for sb in range(0, NSB):
            a01, a23, lo, hi, d = _iq2_fields(p16, rh, sb)
            acc = _iq2_dp_block(acc, a01, a23, lo, hi, d, xq_ptr, sb, dp_ptr, NSB)
    return tl.sum(acc, axis=0)


@triton.jit
def _iq2_dp_pair(gate_ptr, gate_off, up_ptr, up_off, row0, xq_ptr, dp_ptr, NSB: tl.constexpr, BR: tl.constexpr,
                 WORDS: tl.constexpr):
    """(gate [BR], up [BR]) float32: _iq2_dp_rows of the gate and the up expert in one loop, both blocks of a step
    loaded before either is used: two independent loads in flight per step instead of one loop after the other
    (the one-pair kernel's time at T = 1 is mostly the latency of its serial block loads). WORDS (and NSB even): a
    step is a pair of blocks of each (132 bytes, 4-byte aligned), their fields loaded as 7 words per lane
    (_iq2_pair_words) instead of 5 half-words a block: the fields of two blocks in flight at once. (Triton's
    pipeliner can then request the pairs ahead by cp.async, which copies 4, 8 or 16 bytes, never a lone half-word:
    with num_stages 2 / 3 it was 3x slower, 123 / 145 us at T = 1 against 41.5, its dependent selector-table reads
    copied into shared memory too; BENCHMARKS.md, the sixty-second session.)"""
    rh = (row0 + tl.arange(0, BR)) * (NSB * 33)
    acc_g = tl.zeros([8, BR], tl.float32)
    acc_u = tl.zeros([8, BR], tl.float32)
    if WORDS and NSB % 2 == 0:
        g32 = (gate_ptr + gate_off).to(tl.pointer_type(tl.int32))
        u32 = (up_ptr + up_off).to(tl.pointer_type(tl.int32))
        rw = (rh // 2)[None, :]                                        # each row's first pair, in words
        g2 = 2 * tl.arange(0, 8)[:, None]
        for pb in range(0, NSB // 2):
            gw = _iq2_pair_words(g32, rw + pb * 33, g2)
            uw = _iq2_pair_words(u32, rw + pb * 33, g2)
            acc_g = _iq2_pair_block(acc_g, gw, xq_ptr, 2 * pb, dp_ptr, NSB)
            acc_u = _iq2_pair_block(acc_u, uw, xq_ptr, 2 * pb, dp_ptr, NSB)
    else:
        g16 = (gate_ptr + gate_off).to(tl.pointer_type(tl.uint16))
        u16 = (up_ptr + up_off).to(tl.pointer_type(tl.uint16))
        for sb in range(0, NSB):
            ga01, ga23, glo, ghi, gd = _iq2_fields(g16, rh, sb)
            ua01, ua23, ulo, uhi, ud = _iq2_fields(u16, rh, sb)
            acc_g = _iq2_dp_block(acc_g, ga01, ga23, glo, ghi, gd, xq_ptr, sb, dp_ptr, NSB)
            acc_u = _iq2_dp_block(acc_u, ua01, ua23, ulo, uhi, ud, xq_ptr, sb, dp_ptr, NSB)
    return tl.sum(acc_g, axis=0), tl.sum(acc_u, axis=0)


@triton.jit
def _iq2_pair_words(p32, b, g2):
    """The raw words of a pair of IQ2_XXS blocks for the tile [group g, row]: b [1, BR] each row's pair in words,
    g2 [8, 1] = 2g. Block 0: d at bytes 0, 1, group g's A at 2 + 8g, B at 6 + 8g (half-word aligned: words 2g, 2g + 1,
    2g + 2 hold them); block 1: d at bytes 66, 67 (word 16's upper half), A at word 17 + 2g, B at 18 + 2g.
    Returns int32 [8, BR] each: (w 2g, w 2g+1, w 2g+2, w 0, w 16, w 17+2g, w 18+2g)."""
    return (tl.load(p32 + (b + g2)), tl.load(p32 + (b + g2 + 1)), tl.load(p32 + (b + g2 + 2)),
            tl.load(p32 + (b + 0 * g2)), tl.load(p32 + (b + 0 * g2 + 16)), tl.load(p32 + (b + g2 + 17)),
            tl.load(p32 + (b + g2 + 18)))


@triton.jit
def _iq2_pair_block(acc, w, xq_ptr, sb, dp_ptr, NSB: tl.constexpr):
    """acc [8, BR] += blocks sb and sb + 1 of _iq2_pair_words' words w (as _iq2_dp_block, from half-words)."""
    w0, w1, w2, wd0, wd1, a1, b1 = w
    u16: tl.constexpr = tl.uint16                            # the low half-word of an int32 (conversion truncates)
    # block 0's A and B by funnel shifts of the misaligned words (taking the four halves straight from w0..w2 gives
    # the same values but costs registers on sm_90: 128 against 72 at 16 x 2, 202 against 118 at 16 x 1)
    a0 = ((w0 >> 16) & 0xFFFF) | (w1 << 16)
    b0 = ((w1 >> 16) & 0xFFFF) | (w2 << 16)
    acc = _iq2_dp_block(acc, a0.to(u16), (a0 >> 16).to(u16), b0.to(u16), (b0 >> 16).to(u16), wd0.to(u16), xq_ptr, sb,
                        dp_ptr, NSB)
    return _iq2_dp_block(acc, a1.to(u16), (a1 >> 16).to(u16), b1.to(u16), (b1 >> 16).to(u16), (wd1 >> 16).to(u16),
                         xq_ptr, sb + 1, dp_ptr, NSB)


@triton.jit
def _quant_h(h_ptr, row0, hv, F: tl.constexpr, BR: tl.constexpr):
    """Store rows row0.. of one pair's h (hv [BR], BR % 8 == 0) for _q2k_dp_rows, in the pair's row of h (F words):
    _quant_runs's seven planes of F / 8 words, then each run's sum of h (float32, the Q2_K min term's); in each
    plane, run 16n + 4j + i of a 256-value block at word 16n + 4i + j: the 4 runs that one lane of _q2k_dp_rows
    reads (one per shift j) are then 4 consecutive words, one 128-bit load."""
    x = tl.reshape(hv, (BR // 8, 8))
    _quant_runs(h_ptr.to(tl.pointer_type(tl.int32)), F, row0 // 8, x, BR // 8, True)
    r = row0 // 8 + tl.arange(0, BR // 8)
    tl.store(h_ptr + 7 * F // 8 + ((r & ~15) | ((r & 3) << 2) | ((r >> 2) & 3)), tl.sum(x, axis=1))


@triton.jit
def _q2k_dp_rows(ptr, expert_off, row0, hq_ptr, NSB: tl.constexpr, BR: tl.constexpr):
    """[BR] float32: rows row0..row0+BR of the Q2_K expert at byte offset expert_off (a multiple of 4) dotted with one
    pair's h as _quant_h stores it (hq_ptr: int32, the pair's row). The one-pair down loop on integer dot products,
    like _iq2_dp_block (the float path, _fma_rows, spends ~6.6 instructions per value on sm_90: 423 per 64): the 2-bit
    quants of a word at shift 2j are 4 values as bytes after one shift and one AND, times h's integers by one dp4a and
    two dp2a, exact in int32 (|XQ_LO * sum(q h) + sum(q l)| <= 8 * 3 * (127 * 2048 + 1024) < 2^23, times the 4-bit
    scale < 2^27); per run of 8 the sum becomes float once, times u; the min term is dmin * m * (the run's sum of h).
    Tile [word pair (n, i), row], rows last (see _iq2_dot): qs words 2i, 2i+1 of half n hold at shift 2j values
    128n + 32j + 8i .. +7 of the block, run 16n + 4j + i of the row's h, with scale byte 8n + 2j + (i >> 1)."""
    K: tl.constexpr = NSB * 256
    PS: tl.constexpr = K // 8                                   # _quant_runs's plane size (words)
    p32 = (ptr + expert_off).to(tl.pointer_type(tl.int32))
    q = tl.arange(0, 8)[:, None]
    n = q >> 2
    i = q & 3
    blk = (row0 + tl.arange(0, BR))[None, :] * (NSB * 21)      # [1, BR]: each row's block 0 in words (84 B = 21)
    acc = tl.zeros([8, BR], tl.float32)
    for sb in range(0, NSB):
        b = blk + sb * 21
        wa = tl.load(p32 + b + (4 + 8 * n + 2 * i))              # qs bytes 32n + 8i .. +3
        wb = tl.load(p32 + b + (5 + 8 * n + 2 * i))              # .. +4 .. +7
        s_lo = tl.load(p32 + b + 2 * n)                          # scale bytes 8n .. 8n+3
        s_hi = tl.load(p32 + b + (2 * n + 1))                    # 8n+4 .. 8n+7
        dd = tl.load(p32 + b + 20)                               # f16 d | f16 dmin
        r0 = hq_ptr + (sb * 32 + 16 * n + 4 * i)                 # [8, 1]: runs 16n + 4j + i, j = 0..3 (_quant_h)
        h0, h1, l0, l1, l2, l3, hu = _ld_run_planes(r0, PS)
        hs = ld4(r0 + 7 * PS)
        ym = tl.zeros([8, BR], tl.float32)
        yn = tl.zeros([8, BR], tl.float32)
        for j in tl.static_range(4):
            if j < 2:
                sc = (s_lo >> (8 * (2 * j + (i >> 1)))) & 255
            else:
                sc = (s_hi >> (8 * (2 * j - 4 + (i >> 1)))) & 255
            qa = (wa >> (2 * j)) & 0x03030303
            qb = (wb >> (2 * j)) & 0x03030303
            ih = dp4a(qb, h1[j], dp4a(qa, h0[j], 0))
            il = dp2a(l0[j], qa, 0, False)
            il = dp2a(l1[j], qa, il, True)
            il = dp2a(l2[j], qb, il, False)
            il = dp2a(l3[j], qb, il, True)
            ym += hu[j].to(tl.float32, bitcast=True) * ((ih * XQ_LO + il) * (sc & 15)).to(tl.float32)
            yn += hs[j].to(tl.float32, bitcast=True) * (sc >> 4).to(tl.float32)
        acc += _f16_bits(dd) * ym - _f16_bits(dd >> 16) * yn
    return tl.sum(acc, axis=0)


@triton.jit
def _runs(row0, expert_off, row_bytes, BR: tl.constexpr, NS: tl.constexpr):
    """Per tile row j of a [BR * NS, L] run tile: (byte offset of its row's first block, run index c)."""
    j = tl.arange(0, BR * NS)
    return expert_off + (row0 + j // NS).to(tl.int64) * row_bytes, j % NS


@triton.jit
def _mma_block(acc, ptr, base, c, rbase, hi, lo, shi, slo, inv, dp_ptr,
               TYPE: tl.constexpr, NS: tl.constexpr, L: tl.constexpr, BR: tl.constexpr, LO: tl.constexpr = True):
    """acc [BR, C] += dequantized block rows [BR,256] @ x [256, C] on the tensor cores (see the module notes).
    base, c: the run tile of the blocks (see _block_parts); rbase [BR]: byte offset of each row's block.
    hi, lo: the split activations [256, C]; shi, slo: their sums over 16-value runs, split [16, C].
    dp_ptr: _iq2_dp_block's selector table (IQ2_XXS). LO False: the block product on the activations' hi
    parts alone (lo unused); the min term keeps both parts (it can be large beside the result it is subtracted from).
    """
    if TYPE == 16:
        a = tl.reshape(_iq2_mma_runs(ptr, base, c, dp_ptr), (BR, NS * L))   # exact integers, |a| < 2048
    else:
        a, m = _kq_mma_runs(ptr, base, c, TYPE, L)
        a = tl.reshape(a, (BR, NS * L))                                      # exact integers, |a| < 2048
    r = tl.dot(a, hi)
    if LO:
        r += tl.dot(a, lo)
    if TYPE == 10:
        d = _ld_f16(ptr, rbase + 80)
        dmin = _ld_f16(ptr, rbase + 82)
    elif TYPE == 12:
        d = _ld_f16(ptr, rbase)
        dmin = _ld_f16(ptr, rbase + 2)
    else:
        d = _ld_f16(ptr, rbase) * 0.125
    acc += d[:, None] * (r * inv[None, :])
    if TYPE != 16:
        # the min term: dmin * sum over runs of m[run] * (sum of x over the run), runs cut to 16 values
        m16 = tl.reshape(tl.broadcast_to(m[:, None], (BR * NS, 16 // NS)), (BR, 16)).to(tl.float16)
        rm = tl.dot(m16, shi) + tl.dot(m16, slo)
        acc -= dmin[:, None] * (rm * inv[None, :])
    return acc


@triton.jit
def _swiglu(g, u, clamp):
    """silu(min(g, clamp)) * clamp(u, -clamp, clamp), the contract's asymmetric clamp."""
    g = tl.minimum(g, clamp)
    u = tl.minimum(tl.maximum(u, -clamp), clamp)
    return g / (1.0 + tl.exp(-g)) * u


# ---------------------------------------------------------------------------------------------------
# Kernels

@triton.jit
def _moe_prepare(ids_ptr, order_ptr, cnt_ptr, P, v_ptr, xq_ptr, n_quant, gu_ptr, sh_ptr, clamp,
                 ITEM_CAP: tl.constexpr, MIN_PAIRS: tl.constexpr, PB: tl.constexpr, D: tl.constexpr,
                 F: tl.constexpr, PDL: tl.constexpr):
    """Program 0 groups the P (token, slot) pairs by expert into items of up to ITEM_CAP pairs, an expert of fewer
    than MIN_PAIRS pairs into one-pair items (PB >= P a power of two; P = 0: no items, a long call's come from
    _long_items); program 1 + i < 1 + n_quant quantizes block i % (D / 256) of token i // (D / 256) (_quant_runs);
    program 1 + n_quant + j (a shared expert's, one token) stores sh[j*256 ..] = swiglu of the gate and up products
    gu [2F] (gate first)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid > n_quant:
        f = (pid - 1 - n_quant) * 256 + tl.arange(0, 256)
        fm = f < F
        g, u = tl.load(gu_ptr + f, mask=fm, other=0.0), tl.load(gu_ptr + F + f, mask=fm, other=0.0)
        tl.store(sh_ptr + f, _swiglu(g, u, clamp), mask=fm)
    elif pid == 0:
        p = tl.arange(0, PB)
        valid = p < P
        e = tl.where(valid, tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32), 2 ** 30)  # padding sorts last
        ea, eb = e[:, None], e[None, :]
        pa, pb = p[:, None], p[None, :]
        same = eb == ea
        pos = tl.sum(((eb < ea) | (same & (pb < pa))).to(tl.int32), axis=1)   # sorted position of pair p
        rank = tl.sum((same & (pb < pa)).to(tl.int32), axis=1)               # pairs of its expert before it
        size = tl.sum(same.to(tl.int32), axis=1)
        cnt = tl.where(size < MIN_PAIRS, 1, tl.where(rank % ITEM_CAP == 0, tl.minimum(size - rank, ITEM_CAP), 0))
        tl.store(order_ptr + pos, p, mask=valid)
        tl.store(cnt_ptr + pos, cnt, mask=valid)
    else:
        NB: tl.constexpr = D // 256
        t = ((pid - 1) // NB).to(tl.int64)
        b = (pid - 1) % NB
        x = tl.load(v_ptr + t * D + b * 256 + 8 * tl.arange(0, 32)[:, None] + tl.arange(0, 8)[None, :])   # [32, 8]
        _quant_runs(xq_ptr + t * (D * 7 // 8), D, b * 32, x, 32)


@triton.jit
def _moe_gateup_single(v_ptr, ids_ptr, wts_ptr, order_ptr, cnt_ptr, starts_ptr, gate_ptr, up_ptr, h_ptr, grid_ptr,
                       ksigns_ptr, xq_ptr, dp_ptr, n_slots, F: tl.constexpr, gate_expert_bytes, up_expert_bytes, clamp,
                       ONE, NSB: tl.constexpr, GT: tl.constexpr, UT: tl.constexpr, BR: tl.constexpr,
                       GPF: tl.constexpr, UPF: tl.constexpr, QD: tl.constexpr, COMPACT: tl.constexpr,
                       PDL: tl.constexpr):
    """Items of one pair: h[pair, rows] = weight * swiglu(gate_e v_t, up_e v_t): IQ2_XXS on the integers of
    _quant_runs (xq), the other types by float32 FMA. QD (a Q2_K down): h stored as _quant_h's integers."""
    pdl_enter(PDL)
    item, cnt = _item(starts_ptr, cnt_ptr, COMPACT)
    if cnt == 1:
        pair = tl.load(order_ptr + item)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        t = (pair // n_slots).to(tl.int64)
        x_ptr = v_ptr + t * (NSB * 256)
        xq_row = xq_ptr + t * (NSB * 256 * 7 // 8)
        row0 = tl.program_id(1) * BR
        if GT == 16 and UT == 16:
            g, u = _iq2_dp_pair(gate_ptr, e * gate_expert_bytes, up_ptr, e * up_expert_bytes, row0, xq_row, dp_ptr,
                                NSB, BR, GPF)
        else:
            if GT == 16:
                g = _iq2_dp_rows(gate_ptr, e * gate_expert_bytes, row0, xq_row, dp_ptr, NSB, BR, GPF)
            else:
                g = _fma_rows(gate_ptr, e * gate_expert_bytes, row0, x_ptr, grid_ptr, ksigns_ptr, ONE, GT, NSB, BR,
                              GPF)
            if UT == 16:
                u = _iq2_dp_rows(up_ptr, e * up_expert_bytes, row0, xq_row, dp_ptr, NSB, BR, UPF)
            else:
                u = _fma_rows(up_ptr, e * up_expert_bytes, row0, x_ptr, grid_ptr, ksigns_ptr, ONE, UT, NSB, BR, UPF)
        hv = tl.load(wts_ptr + pair) * _swiglu(g, u, clamp)
        if QD:
            _quant_h(h_ptr + pair.to(tl.int64) * F, row0, hv, F, BR)
        else:
            tl.store(h_ptr + pair.to(tl.int64) * F + row0 + tl.arange(0, BR), hv)


@triton.jit
def _moe_down_single(h_ptr, ids_ptr, order_ptr, cnt_ptr, starts_ptr, down_ptr, y_ptr, grid_ptr, ksigns_ptr,
                     D, down_expert_bytes, ONE, sq_ptr, sd_ptr, sh_ptr, n_items, NSB: tl.constexpr, DT: tl.constexpr,
                     BR: tl.constexpr, DPF: tl.constexpr, COMPACT: tl.constexpr, SH: tl.constexpr,
                     SBR: tl.constexpr, PDL: tl.constexpr):
    """Items of one pair: y[pair, rows] = down_e h[pair]: Q2_K on the integers of _quant_h, the other types by
    float32 FMA. SH (one token): the programs past the n_items items compute y[n_items, rows] = the shared expert's
    down (split_q8 arrays sq, sd of [D, F]) times sh [F], SBR rows each."""
    pdl_enter(PDL)
    if SH:
        if tl.program_id(0) >= n_items:
            tile = (tl.program_id(0) - n_items) * tl.num_programs(1) + tl.program_id(1)
            if tile < D // SBR:
                rows = tile * SBR + tl.arange(0, SBR)
                y, _, _, _ = q8_tile(sh_ptr, 0, sq_ptr, sd_ptr, rows.to(tl.int64), 0, ONE, NSB * 256, SBR, NSB, 1,
                                     False)
                tl.store(y_ptr + n_items * D + rows, y)
        else:
            _down_item(h_ptr, ids_ptr, order_ptr, cnt_ptr, starts_ptr, down_ptr, y_ptr, grid_ptr, ksigns_ptr, D,
                       down_expert_bytes, ONE, NSB, DT, BR, DPF, COMPACT)
    else:
        _down_item(h_ptr, ids_ptr, order_ptr, cnt_ptr, starts_ptr, down_ptr, y_ptr, grid_ptr, ksigns_ptr, D,
                   down_expert_bytes, ONE, NSB, DT, BR, DPF, COMPACT)


@triton.jit
def _down_item(h_ptr, ids_ptr, order_ptr, cnt_ptr, starts_ptr, down_ptr, y_ptr, grid_ptr, ksigns_ptr, D,
               down_expert_bytes, ONE, NSB: tl.constexpr, DT: tl.constexpr, BR: tl.constexpr, DPF: tl.constexpr,
               COMPACT: tl.constexpr):
    """A _moe_down_single program's one-pair item (see there)."""
    item, cnt = _item(starts_ptr, cnt_ptr, COMPACT)
    if cnt == 1:
        pair = tl.load(order_ptr + item)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        row0 = tl.program_id(1) * BR
        h_row = h_ptr + pair.to(tl.int64) * (NSB * 256)
        if DT == 10:
            y = _q2k_dp_rows(down_ptr, e * down_expert_bytes, row0, h_row.to(tl.pointer_type(tl.int32)), NSB, BR)
        else:
            y = _fma_rows(down_ptr, e * down_expert_bytes, row0, h_row, grid_ptr, ksigns_ptr, ONE, DT, NSB, BR, DPF)
        tl.store(y_ptr + pair.to(tl.int64) * D + row0 + tl.arange(0, BR), y)


@triton.jit
def _split_runs(x_ptr, hi_ptr, lo_ptr, shi_ptr, slo_ptr, inv_ptr, NC, CB: tl.constexpr, PDL: tl.constexpr):
    """Program i: the 256-value chunks i*CB .. of x seen as [NC, 256] (see split_runs)."""
    pdl_enter(PDL)
    c = tl.program_id(0) * CB + tl.arange(0, CB)
    cm = c < NC
    c64 = c.to(tl.int64)
    off = c64[:, None] * 256 + tl.arange(0, 256)[None, :]
    x = tl.load(x_ptr + off, mask=cm[:, None], other=0.0)                             # [CB, 256]
    e = tl.minimum((tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 255, 252)
    scale = ((253 - e) << 23).to(tl.float32, bitcast=True)[:, None]                   # 2^(126 - e)
    xs = x * scale
    hi = xs.to(tl.float16)
    tl.store(hi_ptr + off, hi, mask=cm[:, None])
    tl.store(lo_ptr + off, (xs - hi.to(tl.float32)).to(tl.float16), mask=cm[:, None])
    s16 = tl.sum(tl.reshape(x, (CB, 16, 16)), axis=2) * scale                         # [CB, 16]
    shi = s16.to(tl.float16)
    soff = c64[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(shi_ptr + soff, shi, mask=cm[:, None])
    tl.store(slo_ptr + soff, (s16 - shi.to(tl.float32)).to(tl.float16), mask=cm[:, None])
    tl.store(inv_ptr + c64, ((e + 1) << 23).to(tl.float32, bitcast=True), mask=cm)


@triton.jit
def _load_split(hi_ptr, lo_ptr, shi_ptr, slo_ptr, inv_ptr, rows, pm, sb, K: tl.constexpr, CAP: tl.constexpr,
                LO: tl.constexpr = True):
    """Block sb's 256 activations of each of CAP pair slots as split_runs stored them: rows [CAP] int64 (the
    slots' rows of the split arrays, K values each), pm [CAP] the live slots -> hi, lo [256, CAP] f16, shi, slo
    [16, CAP] f16, inv [CAP] (dead slots: zeros, never stored). LO False: lo not loaded (hi returned in its place)."""
    kk = tl.arange(0, 256)[:, None]
    off = rows[None, :] * K + sb * 256 + kk
    hi = tl.load(hi_ptr + off, mask=pm[None, :], other=0.0)
    soff = rows[None, :] * (K // 16) + sb * 16 + tl.arange(0, 16)[:, None]
    shi = tl.load(shi_ptr + soff, mask=pm[None, :], other=0.0)
    slo = tl.load(slo_ptr + soff, mask=pm[None, :], other=0.0)
    lo = tl.load(lo_ptr + off, mask=pm[None, :], other=0.0) if LO else hi
    inv = tl.load(inv_ptr + rows * (K // 256) + sb, mask=pm, other=0.0)
    return hi, lo, shi, slo, inv


@triton.jit
def _item(starts_ptr, cnt_ptr, COMPACT: tl.constexpr):
    """(sorted position where this program's item starts, its pair count, 0 where none starts): program i
    serves position i, or the i-th listed item start when the items were listed (COMPACT, long calls)."""
    item = tl.load(starts_ptr + tl.program_id(0)) if COMPACT else tl.program_id(0)
    return item, tl.load(cnt_ptr + item)


@triton.jit
def _item_pairs(order_ptr, cnt_ptr, ids_ptr, item, CAP: tl.constexpr):
    """(slot mask [CAP], pairs [CAP], expert) of a multi-pair item."""
    cnt = tl.load(cnt_ptr + item)
    slot = tl.arange(0, CAP)
    pm = slot < cnt
    pairs = tl.load(order_ptr + item + slot, mask=pm, other=0)
    e = tl.load(ids_ptr + tl.load(order_ptr + item)).to(tl.int64)
    return pm, pairs, e


@triton.jit
def _moe_gateup_multi(xh_ptr, xl_ptr, xsh_ptr, xsl_ptr, xinv_ptr, ids_ptr, wts_ptr, order_ptr, cnt_ptr, starts_ptr,
                      gate_ptr, up_ptr, h_ptr, dp_ptr, n_slots, F, gate_expert_bytes, up_expert_bytes,
                      clamp, NSB: tl.constexpr,
                      GT: tl.constexpr, GBS: tl.constexpr, GNS: tl.constexpr, GL: tl.constexpr,
                      UT: tl.constexpr, UBS: tl.constexpr, UNS: tl.constexpr, UL: tl.constexpr,
                      BR: tl.constexpr, CAP: tl.constexpr, COMPACT: tl.constexpr, GATE_THEN_UP: tl.constexpr,
                      PDL: tl.constexpr, LO: tl.constexpr = True):
    """Items of 2..CAP pairs of one expert: one read of its gate/up rows serves all of them (tensor cores).
    x*_ptr: the activations as split_runs stores them (a row per token). GATE_THEN_UP: one loop over the blocks
    for gate, then one for up (long calls: each matrix's tiles live alone, fewer spills), else one loop for both
    (short calls: each block's activations loaded once)."""
    pdl_enter(PDL)
    item, cnt = _item(starts_ptr, cnt_ptr, COMPACT)
    if cnt >= 2:
        D: tl.constexpr = NSB * 256
        pm, pairs, e = _item_pairs(order_ptr, cnt_ptr, ids_ptr, item, CAP)
        tokens = (pairs // n_slots).to(tl.int64)
        row0 = tl.program_id(1) * BR
        rows = row0 + tl.arange(0, BR)
        gbase, gc = _runs(row0, e * gate_expert_bytes, NSB * GBS, BR, GNS)
        ubase, uc = _runs(row0, e * up_expert_bytes, NSB * UBS, BR, UNS)
        grow = e * gate_expert_bytes + rows.to(tl.int64) * (NSB * GBS)
        urow = e * up_expert_bytes + rows.to(tl.int64) * (NSB * UBS)
        accg = tl.zeros([BR, CAP], tl.float32)
        accu = tl.zeros([BR, CAP], tl.float32)
        for sb in range(0, NSB):
            hi, lo, shi, slo, inv = _load_split(xh_ptr, xl_ptr, xsh_ptr, xsl_ptr, xinv_ptr, tokens, pm, sb, D, CAP,
                                                LO)
            accg = _mma_block(accg, gate_ptr, gbase + sb * GBS, gc, grow + sb * GBS, hi, lo, shi, slo, inv,
                              dp_ptr, GT, GNS, GL, BR, LO)
            if not GATE_THEN_UP:
                accu = _mma_block(accu, up_ptr, ubase + sb * UBS, uc, urow + sb * UBS, hi, lo, shi, slo, inv,
                                  dp_ptr, UT, UNS, UL, BR, LO)
        if GATE_THEN_UP:
            for sb in range(0, NSB):
                hi, lo, shi, slo, inv = _load_split(xh_ptr, xl_ptr, xsh_ptr, xsl_ptr, xinv_ptr, tokens, pm, sb, D,
                                                    CAP, LO)
                accu = _mma_block(accu, up_ptr, ubase + sb * UBS, uc, urow + sb * UBS, hi, lo, shi, slo, inv,
                                  dp_ptr, UT, UNS, UL, BR, LO)
        w = tl.load(wts_ptr + pairs, mask=pm, other=0.0)
        h = w[None, :] * _swiglu(accg, accu, clamp)
        tl.store(h_ptr + pairs.to(tl.int64)[None, :] * F + rows[:, None], h, mask=pm[None, :])


@triton.jit
def _moe_down_multi(hh_ptr, hl_ptr, hsh_ptr, hsl_ptr, hinv_ptr, ids_ptr, order_ptr, cnt_ptr, starts_ptr, down_ptr,
                    y_ptr, dp_ptr, D, down_expert_bytes, NSB: tl.constexpr, DT: tl.constexpr, DBS: tl.constexpr,
                    DNS: tl.constexpr, DL: tl.constexpr, BR: tl.constexpr, CAP: tl.constexpr, COMPACT: tl.constexpr,
                    PDL: tl.constexpr, LO: tl.constexpr = True):
    """Items of 2..CAP pairs of one expert: y[pair, rows] = down_e h[pair] (tensor cores). h*_ptr: h as split_runs
    stores it (a row per pair)."""
    pdl_enter(PDL)
    item, cnt = _item(starts_ptr, cnt_ptr, COMPACT)
    if cnt >= 2:
        F: tl.constexpr = NSB * 256
        pm, pairs, e = _item_pairs(order_ptr, cnt_ptr, ids_ptr, item, CAP)
        prow = pairs.to(tl.int64)
        row0 = tl.program_id(1) * BR
        rows = row0 + tl.arange(0, BR)
        base, c = _runs(row0, e * down_expert_bytes, NSB * DBS, BR, DNS)
        rbase = e * down_expert_bytes + rows.to(tl.int64) * (NSB * DBS)
        acc = tl.zeros([BR, CAP], tl.float32)
        for sb in range(0, NSB):
            hi, lo, shi, slo, inv = _load_split(hh_ptr, hl_ptr, hsh_ptr, hsl_ptr, hinv_ptr, prow, pm, sb, F, CAP, LO)
            acc = _mma_block(acc, down_ptr, base + sb * DBS, c, rbase + sb * DBS, hi, lo, shi, slo, inv,
                             dp_ptr, DT, DNS, DL, BR, LO)
        tl.store(y_ptr + pairs.to(tl.int64)[None, :] * D + rows[:, None], acc, mask=pm[None, :])


@triton.jit
def _dequant_rows(ptr, out_ptr, n_rows, K, grid_ptr, ksigns_ptr,
                  TYPE: tl.constexpr, BS: tl.constexpr, NS: tl.constexpr, L: tl.constexpr, BR: tl.constexpr,
                  PDL: tl.constexpr):
    """out[rows, block sb] = the dequantized values (rows past n_rows read the last row, are not stored)."""
    pdl_enter(PDL)
    row0 = tl.program_id(0) * BR
    sb = tl.program_id(1)
    j = tl.arange(0, BR * NS)
    rows = row0 + j // NS
    c = j % NS
    base = tl.minimum(rows, n_rows - 1).to(tl.int64) * ((K // 256) * BS) + sb * BS
    q, s, m, d, dmin = _block_parts(ptr, base, c, grid_ptr, ksigns_ptr, TYPE, L)
    w = (d * s)[:, None] * q - (dmin * m)[:, None]
    out = out_ptr + (rows.to(tl.int64) * K + sb * 256 + L * c)[:, None] + tl.arange(0, L)[None, :]
    tl.store(out, w, mask=(rows < n_rows)[:, None])


# ---------------------------------------------------------------------------------------------------
# Python entry points

def _layout(ggml_type: int) -> tuple[int, int, int]:
    if ggml_type not in LAYOUT:
        raise ValueError(f"moe_triton: unsupported ggml type {ggml_type}; supported: Q2_K 10, Q4_K 12, IQ2_XXS 16")
    return LAYOUT[ggml_type]


def _check_blocks(name: str, t: torch.Tensor, ggml_type: int, rows: int, cols: int, device) -> int:
    """Validate an expert tensor [E, rows, row bytes]; returns the bytes of one expert."""
    bs, _, _ = _layout(ggml_type)
    want_row = cols // QK * bs
    if t.dtype != torch.uint8 or t.dim() != 3 or tuple(t.shape[1:]) != (rows, want_row):
        raise ValueError(f"moe_forward {name}: expected uint8 [E, {rows}, {want_row}], got {t.dtype} {list(t.shape)}")
    if not t.is_contiguous() or t.device != device:
        raise ValueError(f"moe_forward {name}: must be contiguous on {device}")
    return rows * want_row


def split_runs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The multi-pair kernels' activations, split once per call: x float32 [R, K] (K % 256 == 0) -> hi, lo f16
    [R, K], shi, slo f16 [R, K/16], inv float32 [R, K/256]. Per 256-value chunk with e the biased exponent of its
    largest |x| (at most 252): scale = 2^(126-e) (|x * scale| < 1), x * scale = hi + lo to 2^-22 of the largest
    |x|, the sums of x * scale over 16-value runs = shi + slo likewise, inv = 1 / scale (both powers of two).
    One kernel (_split_runs; in PyTorch it was ~20 launches, inside every captured verify step of MULTI_MIN or more
    rows twice per layer)."""
    R, K = x.shape
    if x.dtype != torch.float32 or K % QK:
        raise ValueError(f"split_runs: expected float32 [R, K] with K % {QK} == 0, got {x.dtype} {list(x.shape)}")
    hi, lo = (torch.empty(R, K, dtype=torch.float16, device=x.device) for _ in range(2))
    shi, slo = (torch.empty(R, K // 16, dtype=torch.float16, device=x.device) for _ in range(2))
    inv = torch.empty(R, K // QK, dtype=torch.float32, device=x.device)
    n = R * (K // QK)
    if n:
        _split_runs[(triton.cdiv(n, SPLIT_CHUNKS),)](x.contiguous(), hi, lo, shi, slo, inv, n, CB=SPLIT_CHUNKS,
                                                      num_warps=4, **pdl_launch(x.device))
    return hi, lo, shi, slo, inv


def xq_words(D: int) -> int:
    """int32 words of one token's activations as _quant_runs stores them (h int8, l int16, u float32 per 8)."""
    return D * 7 // 8


@dataclass
class MoEWorkspace:
    """Scratch of one moe_forward call shape (T tokens, k slots): allocate once to capture a CUDA graph.
    order, cnt: int32 [T*k] (the items); h: float32 [T*k, F] (with a Q2_K down, a one-pair item's row holds F
    int32 words instead: _quant_h); y: float32 [T*k, D] (shared: [T*k + T, D], the shared expert's rows last);
    xq: int32 [T, D*7/8] (the activations as _quant_runs stores them, for IQ2_XXS gate/up); sh: float32 [T, F] (a
    shared expert's SwiGLU; [0, F] without one)."""
    order: torch.Tensor
    cnt: torch.Tensor
    h: torch.Tensor
    y: torch.Tensor
    xq: torch.Tensor
    sh: torch.Tensor

    @classmethod
    def create(cls, T: int, k: int, D: int, F: int, device, shared: bool = False) -> "MoEWorkspace":
        P = T * k
        return cls(torch.empty(P, dtype=torch.int32, device=device), torch.empty(P, dtype=torch.int32, device=device),
                   torch.empty(P, F, dtype=torch.float32, device=device),
                   torch.empty(P + (T if shared else 0), D, dtype=torch.float32, device=device),
                   torch.empty(T, xq_words(D), dtype=torch.int32, device=device),
                   torch.empty(T if shared else 0, F, dtype=torch.float32, device=device))


def _long_items(ids: torch.Tensor, E: int, cap: int, apart: bool = True) -> tuple[torch.Tensor, ...]:
    """The items of a long call, built and listed by torch on the device (no host synchronization: the lists are
    padded to their largest possible lengths). ids: int64 [P] pair -> expert in [0, E). Returns order int32 [P] and
    cnt int32 [P + 1] as _moe_prepare makes them (items of up to `cap` pairs; cnt[P] = 0), and the sorted positions
    where one-pair items start (int32 [min(E, P)]: at most one an expert, its n % cap == 1) and where multi-pair items
    start (int32 [min(P // 2, P // cap + min(E, P // 2))]: at most n / cap + 1 an expert of n >= 2 pairs, each of 2 or
    more pairs), in order, the rest of each list P: a position whose cnt is 0, which the kernels skip. apart False:
    no one-pair list (int32 [0]); the other lists every item, one-pair ones too (int32 [min(P, P // cap + min(E,
    P))]), for moe_mma's kernels, which take items of 1..cap pairs."""
    P = ids.numel()
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    order = torch.argsort(ids, stable=True)                                 # by expert, then pair index
    e = ids[order]
    rank = torch.arange(P, device=ids.device) - (torch.cumsum(counts, 0) - counts)[e]   # pairs of e before it
    cnt = torch.where(rank % cap == 0, torch.clamp(counts[e] - rank, max=cap), 0)
    cnt = torch.cat([cnt, cnt.new_zeros(1)]).to(torch.int32)
    positions = torch.arange(P, dtype=torch.int32, device=ids.device)

    def listed(mask: torch.Tensor, bound: int) -> torch.Tensor:             # positions where mask, padded with P
        out = torch.full((bound + 1,), P, dtype=torch.int32, device=ids.device)
        return out.scatter_(0, torch.where(mask, torch.cumsum(mask, 0) - 1, bound), positions)[:bound]

    if not apart:
        return order.to(torch.int32), cnt, positions[:0], listed(cnt[:P] >= 1, min(P, P // cap + min(E, P)))
    return (order.to(torch.int32), cnt, listed(cnt[:P] == 1, min(E, P)),
            listed(cnt[:P] >= 2, min(P // 2, P // cap + min(E, P // 2))))


def moe_forward(v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_blocks: torch.Tensor,
                up_blocks: torch.Tensor, down_blocks: torch.Tensor, gate_type: int, up_type: int, down_type: int,
                clamp: float, *, out: torch.Tensor | None = None, workspace: MoEWorkspace | None = None,
                per_slot: bool = False, single_config: dict | None = None,
                multi_config: tuple[int, int] = (MULTI_BR, MULTI_WARPS),
                long_config: tuple[int, int, int, int] | None = None,
                shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The ds4::MoE contract (plugins/moe.py). v: [T, D] float32; ids (any integer type), weights: [T, k];
    blocks: uint8 [E, rows, row bytes] as the contract lays them out, all on one device. Returns out [T, D]
    float32 (written into `out` when given); per_slot: return instead each slot's weighted expert output [T, k, D]
    unsummed (a view of the workspace's y: a new tensor unless `workspace` is given; not with `out`) for the
    caller to sum, as the CUDA backend does where torch.compile fuses that sum into the glue after it.
    ids must lie in [0, E): they are not checked here (that would need a host synchronization); the router
    guarantees it.
    No host synchronization at any T. T <= 16 (decode, verify): a CUDA graph can capture the call. T > 16 (prefill
    chunks): torch lists the items on the device (_long_items), of up to CAP pairs (long_launch).
    single_config: {ggml type: (rows per program, warps, register cap or None, prefetch)} entries overriding
    one_pair_config(T); multi_config: (rows per program, warps) of the multi-pair kernels of short calls;
    long_config: (CAP, rows per program, warps, stages, activation parts) of those of long calls, overriding
    long_launch's
    (benchmark sweeps).
    shared (T = 1 only): (gu float32 [1, 2F], quants, scales) of a Q8_0 shared expert: its gate's then its up's
    products of v, and its down weight [D, F] as q8_triton.split_q8 arrays: its SwiGLU (with `clamp`, as the routed
    experts') is made in the first launch and its down product runs in the routed down launch (SHARED_BR); out then
    holds the routed sum plus it and per_slot returns [1, k + 1, D], the shared expert's output last."""
    if v.dim() != 2 or v.dtype != torch.float32:
        raise ValueError(f"moe_forward v: expected float32 [T, D], got {v.dtype} {list(v.shape)}")
    T, D = v.shape
    if ids.dim() != 2 or ids.shape[0] != T or tuple(weights.shape) != tuple(ids.shape):
        raise ValueError(f"moe_forward ids / weights: expected [{T}, k] each, got {list(ids.shape)} / "
                         f"{list(weights.shape)}")
    if T < 1 or D % QK:
        raise ValueError(f"moe_forward: need T >= 1 and D % 256 == 0, got T = {T}, D = {D}")
    F = gate_blocks.shape[1]
    device = v.device
    pdl = pdl_launch(device)
    ge = _check_blocks("gate_blocks", gate_blocks, gate_type, F, D, device)
    ue = _check_blocks("up_blocks", up_blocks, up_type, F, D, device)
    de = _check_blocks("down_blocks", down_blocks, down_type, D, F, device)
    if not (gate_blocks.shape[0] == up_blocks.shape[0] == down_blocks.shape[0]) or F % QK:
        raise ValueError("moe_forward: gate/up/down disagree on E, or F % 256 != 0")
    cfg = {**one_pair_config(T), **(single_config or {})}
    (gbr, gwarps, greg, gpf), (dbr, dwarps, dreg, dpf) = cfg[gate_type], cfg[down_type]
    upf = cfg[up_type][3]
    long = T > CAP
    if long:
        flat_ids = ids.reshape(-1).long()
        cap, mbr, mwarps, mstages, parts = long_config or long_launch(flat_ids.numel(), gate_blocks.shape[0],
                                                                      (gate_type, up_type, down_type), F, device)
    else:
        cap, mbr, mwarps, mstages, parts = CAP, *multi_config, None, 2
    if F % gbr or D % dbr or F % mbr or D % mbr:
        raise ValueError(f"moe_forward: row tiles {gbr}, {dbr}, {mbr} must divide F = {F} and D = {D}")
    k = ids.shape[1]
    P = T * k
    if shared is not None:
        shared = _check_shared(shared, T, D, F, device)
    sh = int(shared is not None)
    ws = workspace or MoEWorkspace.create(T, k, D, F, device, shared=bool(sh))
    if ws.h.shape != (P, F) or ws.y.shape != (P + sh, D) or ws.order.shape != (P,) or ws.cnt.shape != (P,) \
            or ws.xq.shape != (T, xq_words(D)) or ws.sh.shape != (sh * T, F):
        raise ValueError(f"moe_forward workspace: made for another shape (need T*k = {P}, F = {F}, D = {D}"
                         f"{', the shared expert' if sh else ''})")
    if out is not None and per_slot:
        raise ValueError("moe_forward: per_slot returns the slots' outputs unsummed; out is for the summed [T, D]")
    if out is not None and (out.shape != (T, D) or out.dtype != torch.float32):
        raise ValueError(f"moe_forward out: expected float32 [{T}, {D}], got {out.dtype} {list(out.shape)}")
    v, ids = v.contiguous(), ids.contiguous()
    weights = weights.to(torch.float32).contiguous()
    grid_tab, ksigns_tab, dp_tab = _tables(device)

    # the one-pair IQ2_XXS gate/up reads x as _quant_runs's integers: one _moe_prepare program per block of a token
    quant_programs = T * (D // QK) if IQ2_XXS in (gate_type, up_type) else 0
    # a long call's multi-pair gate/up and down on moe_mma's tensor-core kernels (else _moe_gateup_multi / _down_multi)
    mma_gateup = long and moe_mma.use_gateup(gate_type, up_type, parts, F, cap, device)
    mma_down = long and moe_mma.use_down(down_type, parts, D, cap, device)
    wg = (mma_gateup or mma_down) and moe_mma.use_wgmma(device, cap)     # their wgmma forms (x, h in wgmma order)
    if long:
        E = gate_blocks.shape[0]
        apart = not (mma_gateup and mma_down and -(-P // E) >= SINGLES_IN_ITEMS_FROM)
        order, cnt, singles, multis = _long_items(flat_ids, E, cap, apart)
        n_single, n_multi, s_starts, m_starts = singles.numel(), multis.numel(), singles, multis
        if quant_programs and n_single:     # for the one-pair items, which the padded list always allows for
            _moe_prepare[(1 + quant_programs,)](ids, order, cnt, 0, v, ws.xq, quant_programs, v, v, 0.0, ITEM_CAP=1,
                                                MIN_PAIRS=1, PB=16, D=D, F=F, num_warps=4, **pdl)
    else:
        pairs_only = T < MULTI_MIN           # item cap 1 (so also when a token lists an expert twice)
        sh_programs = triton.cdiv(F, 256) if sh else 0               # the shared expert's SwiGLU
        _moe_prepare[(1 + quant_programs + sh_programs,)](ids, ws.order, ws.cnt, P, v, ws.xq, quant_programs,
                                                          shared[0] if sh else v, ws.sh if sh else v, float(clamp),
                                                          ITEM_CAP=1 if pairs_only else CAP, MIN_PAIRS=MULTI_MIN,
                                                          PB=max(16, triton.next_power_of_2(P)), D=D, F=F,
                                                          num_warps=4, **pdl)
        order, cnt = ws.order, ws.cnt
        n_single, n_multi, s_starts, m_starts = P, 0 if pairs_only else P, cnt, cnt   # starts: unused
    gu_args = (v, ids, weights, order, cnt)
    gu_rest = (k, F, ge, ue, float(clamp))
    dn_args = (ws.h, ids, order, cnt)
    dn_rest = (down_blocks, ws.y, grid_tab, ksigns_tab, D, de)
    if n_single:
        _moe_gateup_single[(n_single, F // gbr)](*gu_args, s_starts, gate_blocks, up_blocks, ws.h, grid_tab, ksigns_tab,
                                                 ws.xq, dp_tab, *gu_rest, ONE_BITS, NSB=D // QK,
                                                 GT=gate_type, UT=up_type, BR=gbr, GPF=gpf, UPF=upf,
                                                 QD=down_type == Q2_K, COMPACT=long,
                                                 num_warps=gwarps, **pdl,
                                                 **({"maxnreg": greg} if greg else {}))
    if n_multi and mma_gateup:
        moe_mma.gateup_iq2(*x_f16(v, wg), flat_ids, weights.view(-1), order, cnt, m_starts, gate_blocks, up_blocks,
                           ws.h, k, clamp, cap, wg)
    elif n_multi:
        gbs, gns, gl = LAYOUT[gate_type]
        ubs, uns, ul = LAYOUT[up_type]
        _moe_gateup_multi[(n_multi, F // mbr)](*split_runs(v), *gu_args[1:], m_starts, gate_blocks, up_blocks, ws.h,
                                               dp_tab, *gu_rest, NSB=D // QK, GT=gate_type, GBS=gbs,
                                               GNS=gns, GL=gl, UT=up_type, UBS=ubs, UNS=uns, UL=ul, BR=mbr, CAP=cap,
                                               COMPACT=long, GATE_THEN_UP=long, LO=parts == 2, num_warps=mwarps, **pdl,
                                               **({"num_stages": mstages} if long else {}))
    if n_single:
        extra = triton.cdiv(D // SHARED_BR, D // dbr) if sh else 0     # the shared expert's row tiles on axis 0
        sh_args = (*shared[1:], ws.sh) if sh else (down_blocks, down_blocks, ws.y)   # quants, scales, sh
        _moe_down_single[(n_single + extra, D // dbr)](*dn_args, s_starts, *dn_rest, ONE_BITS, *sh_args, n_single,
                                                       NSB=F // QK, DT=down_type, BR=dbr, DPF=dpf, COMPACT=long,
                                                       SH=bool(sh), SBR=SHARED_BR, num_warps=dwarps, **pdl,
                                                       **({"maxnreg": dreg} if dreg else {}))
    if n_multi and mma_down and wg:
        moe_mma.down_q2k_wg(*x_f16(ws.h, down_order=True), flat_ids, order, cnt, m_starts, down_blocks, ws.y, cap)
    elif n_multi and mma_down:
        hh, _, hsh, hsl, hinv = split_runs(ws.h)
        moe_mma.down_q2k(hh, hsh, hsl, hinv, flat_ids, order, cnt, m_starts, down_blocks, ws.y, cap)
    elif n_multi:
        dbs, dns, dl = LAYOUT[down_type]
        _moe_down_multi[(n_multi, D // mbr)](*split_runs(ws.h), *dn_args[1:], m_starts, down_blocks, ws.y, dp_tab,
                                             D, de, NSB=F // QK,
                                             DT=down_type, DBS=dbs,
                                             DNS=dns, DL=dl, BR=mbr, CAP=cap, COMPACT=long, LO=parts == 2,
                                             num_warps=mwarps, **pdl,
                                             **({"num_stages": mstages} if long else {}))
    if per_slot:
        return ws.y.view(T, k + sh, D)
    return torch.sum(ws.y.view(T, k + sh, D), dim=1, out=out)


def _check_shared(shared, T: int, D: int, F: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_forward's `shared` checked -> (gu contiguous, quants, scales)."""
    if T != 1:
        raise ValueError(f"moe_forward shared: the shared expert's down is computed in calls of one token, got T = {T}")
    gu, quants, scales = shared
    if gu.dtype != torch.float32 or tuple(gu.shape) != (1, 2 * F) or gu.device != device:
        raise ValueError(f"moe_forward shared: expected its gate and up products float32 [1, {2 * F}] on {device}, "
                         f"got {gu.dtype} {list(gu.shape)} on {gu.device}")
    if quants.dtype != torch.uint8 or scales.dtype != torch.float16 or tuple(quants.shape) != (D, padded(F)) \
            or tuple(scales.shape) != (D, padded(F) // 32) or not quants.is_contiguous() \
            or not scales.is_contiguous() or quants.device != device or scales.device != device:
        raise ValueError(f"moe_forward shared: expected contiguous split_q8 arrays of the down [{D}, {F}] on {device}, "
                         f"got quants {quants.dtype} {list(quants.shape)}, scales {scales.dtype} {list(scales.shape)}")
    return gu.contiguous(), quants, scales


def dequant_rows_triton(blocks: torch.Tensor, ggml_type: int, br: int = 16) -> torch.Tensor:
    """blocks: uint8 [N, row bytes] (rows of whole 256-value blocks) -> float32 [N, cols] (dequantized)."""
    bs, ns, l = _layout(ggml_type)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % bs:
        raise ValueError(f"dequant_rows_triton: expected uint8 [N, n*{bs}], got {blocks.dtype} {list(blocks.shape)}")
    blocks = blocks.contiguous()
    n, K = blocks.shape[0], blocks.shape[1] // bs * QK
    out = torch.empty(n, K, dtype=torch.float32, device=blocks.device)
    if n:
        grid_tab, ksigns_tab, _ = _tables(blocks.device)
        _dequant_rows[(triton.cdiv(n, br), K // QK)](blocks, out, n, K, grid_tab, ksigns_tab,
                                                     TYPE=ggml_type, BS=bs, NS=ns, L=l, BR=br,
                                                     **pdl_launch(blocks.device))
    return out
