"""Q8_0 matrix products in Triton, reading the GGUF blocks directly (attention projections, shared expert,
LM head): out = x @ W.T for T = 1..16 rows of x.

    q8_matmul(x [T, G*K] f32, w_blocks uint8 [N, K/32*34], N, K, groups=G, out=None) -> out [T, N] float32
        Rows n of W form G equal groups; group g = n // (N/G) reads x[:, g*K:(g+1)*K] (attn_output_a's
        8 groups of 1024 rows each seeing their own 4096 inputs; G = 1 for a plain projection).

Q8_0 block (34 bytes, 32 values; spec ds4_architecture.md §2.8): f16 d | int8 q[32]; value i = d * q[i].
Blocks start at multiples of 34 bytes, so they are 2-byte aligned only: quants are read as uint16 pairs.

Decoding, per value, is one FFMA: each uint16 pair is xor-ed with 0x8080 (so each byte holds q + 128),
byte b is moved to bits 15..22 of 1.0f's bit pattern, giving f = 1 + (q + 128)/256, and
value = f * 256d - 384d = q * d. Both products are exact (9 x 11 significant bits), so the dequantized value
is bit-exact.

T <= 4: float32 FMA (_q8_rows), lanes along each block's quants so that loads are coalesced, each block decoded
once for the T rows; when N is small the K range is split over several programs (at least MIN_PROGRAMS in
all), and the last program of each row tile to finish adds the partial sums in a fixed order (deterministic: an
atomic counter says which program is last, the sum does not depend on it).
T > 4: the decoded [BR, 256] tile times x [256, 16] on the tensor cores with input_precision="tf32x3"
(operands split into two tf32 parts; the Q8_0 values q*d have at most 19 significant bits, so they are
carried exactly; x to ~2^-22), float32 accumulation: agrees with float64 to ~1e-6 relative.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QK, BLOCK_BYTES = 32, 34
NB_STEP = 8                  # blocks per loop step of the FMA kernels: 256 values
NB = tl.constexpr(NB_STEP)
MMA_NB = tl.constexpr(4)     # blocks per step of the tensor-core kernel (its tile lives in shared memory)
ONE_BITS = 0x3F800000        # bits of 1.0f, a kernel argument so that AND and OR fuse into one LOP3
# (rows per program, warps): the FMA kernel by T (1..4) and the tensor-core kernel (T > 4). Chosen from the
# compiled code (instructions per value, registers, no spills, bytes in flight per SM; T = 2..4 at 16 rows hold
# 78-97 registers) and the sweeps of scripts/bench_kernels.py: T = 1 at (16, 4) beat (32, 8) on the H200 for
# attn_q_b, ffn_gate_shexp and the LM head (21.1 / 10.1 / 254 us against 22.1 / 12.1 / 280, 2026-11-29).
ROWS_CONFIG = {1: (16, 4), 2: (16, 8), 3: (16, 8), 4: (16, 8)}
MIN_PROGRAMS = 528           # split K until there are at least this many programs (4 per SM on an H200)
MMA_BR, MMA_WARPS = 64, 4


@triton.jit
def _decode(w_ptr, rows, kb, ONE, NKB: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """Blocks kb*NB .. kb*NB+NB-1 of each row in `rows` ([BR] int32, valid) -> ([BR*NB, 16, 2] float32 values,
    [BR*NB] block-valid mask). Tile row j = r * NB + block."""
    j = tl.arange(0, BR * NB)
    blk = kb * NB + j % NB
    valid = blk < NKB
    r = tl.reshape(tl.broadcast_to(rows[:, None], (BR, NB)), (BR * NB,))
    base = r.to(tl.int64) * (NKB * 34) + tl.where(valid, blk, 0) * 34
    hw = tl.arange(0, 16)[None, :]
    q2 = tl.load((w_ptr + (base + 2)[:, None] + 2 * hw).to(tl.pointer_type(tl.uint16))).to(tl.int32) ^ 0x8080
    q2 = tl.reshape(tl.join(q2, q2), (BR * NB, 16, 2))                 # each pair repeated for its 2 bytes
    b = tl.arange(0, 2)[None, None, :]
    f = (((q2 << (15 - 8 * b)) & 0x007F8000) | ONE).to(tl.float32, bitcast=True)   # 1 + (q + 128) / 256
    d = tl.load((w_ptr + base).to(tl.pointer_type(tl.float16))).to(tl.float32)
    d = tl.where(valid, d, 0.0)
    return f * (256.0 * d)[:, None, None] - (384.0 * d)[:, None, None], valid


@triton.jit
def _q8_rows(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, N, rows_per_group, ONE, NKB: tl.constexpr,
             BR: tl.constexpr, STEPS: tl.constexpr, SPLITS: tl.constexpr, EXACT: tl.constexpr, TP: tl.constexpr):
    """out[0:TP, rows] for TP = T <= 4 rows of x: program (i, split) does rows i*BR.. and the STEPS steps of NB
    blocks from split*STEPS*NB on; EXACT: every such block exists (else blocks past NKB are masked, which costs
    selects per value). Tile [row, block, halfword, byte]: 16 lanes read a block's 32 quant bytes as 16 uint16
    (coalesced), through a uint16 pointer indexed in elements. Each block is decoded once for all x rows; one
    accumulator per x row (explicit, so that no tile grows a row axis).
    SPLITS > 1: each program stores its partial sums in part[split] and counts itself in cnt[i] (an atomic); the
    last of a tile's SPLITS programs adds the partials in split order (deterministic), writes out and sets cnt[i]
    back to 0, so no second launch sums them (cnt: zeros before the call, zeros after it)."""
    row0 = tl.program_id(0) * BR
    kb0 = tl.program_id(1) * STEPS
    rows = tl.minimum(row0 + tl.arange(0, BR), N - 1)
    K = NKB * 32
    xs = K * (N // rows_per_group)                                      # stride between x rows
    p16 = w_ptr.to(tl.pointer_type(tl.uint16))
    pf16 = w_ptr.to(tl.pointer_type(tl.float16))
    rbase = rows.to(tl.int64) * (NKB * 17)                              # row start, in 2-byte units
    blk = tl.arange(0, NB)
    hw = tl.arange(0, 16)
    b = tl.arange(0, 2)[None, None, None, :]
    x_row = x_ptr + (row0 // rows_per_group).to(tl.int64) * K
    xoff = (32 * blk)[:, None, None] + 2 * hw[None, :, None] + tl.arange(0, 2)[None, None, :]     # [NB, 16, 2]
    acc0 = tl.zeros([BR, NB, 16], tl.float32)
    acc1 = tl.zeros([BR, NB, 16], tl.float32)
    acc2 = tl.zeros([BR, NB, 16], tl.float32)
    acc3 = tl.zeros([BR, NB, 16], tl.float32)
    for step in range(0, STEPS):
        bi = (kb0 + step) * NB + blk
        valid = (bi < NKB) | EXACT
        boff = (bi if EXACT else tl.where(valid, bi, 0)) * 17                                # [NB]
        q2 = tl.load(p16 + (rbase[:, None] + boff[None, :] + 1)[:, :, None] + hw[None, None, :]).to(tl.int32)
        q2 = q2 ^ 0x8080                                                     # each byte now holds q + 128
        q2 = tl.reshape(tl.join(q2, q2), (BR, NB, 16, 2))
        f = (((q2 << (15 - 8 * b)) & 0x007F8000) | ONE).to(tl.float32, bitcast=True)        # 1 + (q + 128)/256
        d = tl.load(pf16 + rbase[:, None] + boff[None, :]).to(tl.float32)
        if not EXACT:
            d = tl.where(valid[None, :], d, 0.0)
        val = f * (256.0 * d)[:, :, None, None] - (384.0 * d)[:, :, None, None]             # q * d, exact
        xp = x_row + (kb0 + step) * (NB * 32) + xoff
        xm = valid[:, None, None]
        acc0 += tl.sum(val * tl.load(xp, mask=xm, other=0.0)[None], axis=3)
        if TP > 1:
            acc1 += tl.sum(val * tl.load(xp + xs, mask=xm, other=0.0)[None], axis=3)
        if TP > 2:
            acc2 += tl.sum(val * tl.load(xp + 2 * xs, mask=xm, other=0.0)[None], axis=3)
        if TP > 3:
            acc3 += tl.sum(val * tl.load(xp + 3 * xs, mask=xm, other=0.0)[None], axis=3)
    out_rows = row0 + tl.arange(0, BR)
    o = (out_ptr if SPLITS == 1 else part_ptr + tl.program_id(1).to(tl.int64) * (TP * N)) + out_rows
    omask = out_rows < N
    tl.store(o, tl.sum(tl.sum(acc0, axis=2), axis=1), mask=omask)
    if TP > 1:
        tl.store(o + N, tl.sum(tl.sum(acc1, axis=2), axis=1), mask=omask)
    if TP > 2:
        tl.store(o + 2 * N, tl.sum(tl.sum(acc2, axis=2), axis=1), mask=omask)
    if TP > 3:
        tl.store(o + 3 * N, tl.sum(tl.sum(acc3, axis=2), axis=1), mask=omask)
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
def _q8_multi(x_ptr, w_ptr, out_ptr, T, N, rows_per_group, ONE, NKB: tl.constexpr, BR: tl.constexpr):
    """out[0:T, rows] for 4 < T <= 16 (tensor cores, tf32x3), K in steps of MMA_NB blocks."""
    row0 = tl.program_id(0) * BR
    rows = tl.minimum(row0 + tl.arange(0, BR), N - 1)
    K = NKB * 32
    t = tl.arange(0, 16)
    tmask = t < T
    x_rows = x_ptr + (row0 // rows_per_group).to(tl.int64) * K + t.to(tl.int64) * (K * (N // rows_per_group))
    kk = tl.arange(0, MMA_NB * 32)
    acc = tl.zeros([BR, 16], tl.float32)
    for kb in range(0, (NKB + MMA_NB - 1) // MMA_NB):
        val, _ = _decode(w_ptr, rows, kb, ONE, NKB, BR, MMA_NB)
        w2 = tl.reshape(val, (BR, MMA_NB * 32))
        k = kb * (MMA_NB * 32) + kk
        xt = tl.load(x_rows[None, :] + k[:, None], mask=tmask[None, :] & (k < K)[:, None], other=0.0)  # [128, 16]
        acc = tl.dot(w2, xt, acc, input_precision="tf32x3")
    out_rows = row0 + tl.arange(0, BR)
    tl.store(out_ptr + t[None, :].to(tl.int64) * N + out_rows[:, None], acc,
             mask=(out_rows < N)[:, None] & tmask[None, :])


_COUNTERS: dict[str, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """int32 [MIN_PROGRAMS] zeros per device: the arrival counts of split row tiles (a call splits only when it has
    fewer than MIN_PROGRAMS tiles, and leaves them at zero). Made on a device's first call, which runs before any
    CUDA graph capture (the backends warm every shape up eagerly)."""
    key = str(device)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MIN_PROGRAMS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def row_launch(N: int, K: int, br: int) -> tuple[int, int, int]:
    """_q8_rows' launch for N rows of K inputs at br rows per program: (row tiles, steps of NB_STEP blocks, K splits).
    K is split until there are MIN_PROGRAMS programs, by a divisor of the steps (no partial split)."""
    tiles, steps = triton.cdiv(N, br), triton.cdiv(K // QK, NB_STEP)
    want = min(steps, triton.cdiv(MIN_PROGRAMS, tiles))
    return tiles, steps, max(s for s in range(1, want + 1) if steps % s == 0)


def q8_matmul(x: torch.Tensor, w_blocks: torch.Tensor, N: int, K: int, groups: int = 1, *,
              out: torch.Tensor | None = None, config: tuple[int, int] | None = None) -> torch.Tensor:
    """x: float32 [T, groups*K], 1 <= T <= 16; w_blocks: uint8 [N, K/32*34] (a Q8_0 tensor's rows) -> [T, N]
    (written into `out` when given). config: (rows per program, warps), overriding the defaults (sweeps)."""
    if K % QK or N % groups:
        raise ValueError(f"q8_matmul: K = {K} must be a multiple of 32 and N = {N} of groups = {groups}")
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != groups * K or not 1 <= x.shape[0] <= 16:
        raise ValueError(f"q8_matmul x: expected float32 [1..16, {groups * K}], got {x.dtype} {list(x.shape)}")
    if w_blocks.dtype != torch.uint8 or w_blocks.numel() != N * (K // QK) * BLOCK_BYTES:
        raise ValueError(f"q8_matmul w_blocks: expected uint8 with {N} x {K // QK * BLOCK_BYTES} bytes, "
                         f"got {w_blocks.dtype} {list(w_blocks.shape)}")
    if w_blocks.device != x.device:
        raise ValueError("q8_matmul: x and w_blocks are on different devices")
    T = x.shape[0]
    rows_per_group = N // groups
    x, w_blocks = x.contiguous(), w_blocks.contiguous()
    if out is None:
        out = torch.empty(T, N, dtype=torch.float32, device=x.device)
    elif out.shape != (T, N) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"q8_matmul out: expected contiguous float32 [{T}, {N}], got {out.dtype} {list(out.shape)}")
    if T <= 4:
        br, warps = config or ROWS_CONFIG[T]
        if groups > 1 and rows_per_group % br:
            raise ValueError(f"q8_matmul: rows per group {rows_per_group} must be a multiple of the row tile {br}")
        tiles, steps_total, splits = row_launch(N, K, br)
        part = out if splits == 1 else torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
        _q8_rows[(tiles, splits)](x, w_blocks, out, part, _counters(x.device), N, rows_per_group, ONE_BITS,
                                  NKB=K // QK, BR=br, STEPS=steps_total // splits, SPLITS=splits,
                                  EXACT=(K // QK) % NB_STEP == 0, TP=T, num_warps=warps)
        return out
    br, warps = config or (MMA_BR, MMA_WARPS)
    while groups > 1 and rows_per_group % br and br > 16:
        br //= 2                                   # a row tile must not straddle two groups
    if groups > 1 and rows_per_group % br:
        raise ValueError(f"q8_matmul: rows per group {rows_per_group} must be a multiple of the row tile {br}")
    _q8_multi[(triton.cdiv(N, br),)](x, w_blocks, out, T, N, rows_per_group, ONE_BITS, NKB=K // QK, BR=br,
                                     num_warps=warps)
    return out
