"""The routed experts of long calls (prefill chunks) on the tensor cores, for ds4's q2 mix (IQ2_XXS gate and up, Q2_K
down): moe_mma.cu, built and launched by cuda_launch.

    gateup_iq2(hi, inv, ids, weights, order, cnt, starts, gate_blocks, up_blocks, h, n_slots, clamp, cap)
        h[pair, :] = weight * swiglu(gate_e x_t, up_e x_t) for the pairs of the listed multi-pair items
    down_q2k(hh, hsh, hsl, hinv, ids, order, cnt, starts, down_blocks, y, cap)
        y[pair, :] = down_e h[pair] for the same pairs (mma.sync; h as split_runs' parts)
    down_q2k_wg(hh, hs, ids, order, cnt, starts, down_blocks, y, cap)
        the same on wgmma (h as x_f16's rows in the down order)
    kernel(name, nt, warps) / smem_bytes(name, cap) / tables(device)

Why: moe_triton's _moe_gateup_multi decodes a [rows, 256] block tile into registers and hands it to tl.dot, which
takes 255 registers and runs one 4-warp program per SM (12.5 % occupancy, ncu: latency-bound); the routed experts are
~60 % of a 2048-token prefill (BENCHMARKS.md). Here each lane decodes only its own fragments (moe_mma.cu: table reads
and a few byte permutes and packed float16 operations per two values), and x (h for the down) comes through shared
memory by cp.async.

Numerics within the issue's 1e-3 for float16 inputs: the gate/up's values carry their run's scale (2s + 1) d in
float16 and x is q8_triton.x_f16's rows (2^-11 of each value), sums over all blocks in float32: ~5e-4 normwise against
float64 (~2.5e-4 while the block scales were applied in float32 to per-block sums: twice the accumulators, with which
CAP 64 spilled 780 bytes at two programs an SM). The down's values are exact float16 integers against split_runs' hi
parts.

On an H100 / H200 (compute capability 9.0) both products run on wgmma instead (use_wgmma: the `_wg` kernels, each
warpgroup's 64 rows against a k step's whole tile of x or h in shared memory, ~5 % off a 2048-token prefill chunk,
WG_MIN_BLOCKS); elsewhere (A100, Jetson Orin, Blackwell) on mma.sync.

Measured (`python3 scripts/bench_kernels.py --cases moe_long`, H100, 2026-12-05; a q2 layer's routed experts, ms at
T = 256 / 512 / 1024 / 2048, 2048 skewed): Triton 4.71 / 4.80 / 5.46 / 9.44, 9.48; here at 4 warps 3.14 / 3.20 / 3.92
/ 7.36, 6.67, at 8 warps - / 3.23 / 3.65 / 6.04, -; with the block scales in the values (H100, 2026-12-06) CAP 32
/ 64 2.62 / 3.55, 2.81 / 3.78, 3.25 / 4.12, 5.69 / 4.73, skewed 5.57 / 5.73 (moe_triton.MMA_ITEM_COST). So
moe_triton.moe_forward sends every long q2 call here (`use_gateup`, `use_down`; DS4_MOE_MMA=0 keeps Triton).
tests/test_moe_mma.py runs it on the CPU stand-in of tests/cuda_emu and on the GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

from ds4trt.plugins.kernels import cuda_launch

Q2_K, IQ2_XXS = 10, 16
XSTRIDE = 576                 # bytes of a token's chunk in shared memory (moe_mma.cu)
Q2K_SLOT = 96                 # bytes of a staged Q2_K block's slot in the wgmma down's shared memory (moe_mma.cu)
WARPS = {32: 8, 64: 8}        # warps (16 rows each) of a program by CAP: 8 beat 4 and 2 (the header's runs)
# the gate/up's IQ2_XXS tables (moe_mma.cu): True, 4-byte nibble selectors (fewer shared-memory passes, more
# operations); False, 16-byte float16 rows: 4.08 / 4.86 / 7.85 ms at T = 512 / 1024 / 2048 against 3.20 / 3.92 / 7.36
# with True (the header's runs, 4 warps).
NIB = True
# gate and up in one pass over each block, by CAP (moe_mma.cu's FUSE): each x fragment read from shared memory serves
# both matrices (one 16-byte read per two tensor-core products apart, per four fused). sm_90 with NIB: CAP 32 126
# registers and 558 instructions per half block for both matrices against 96 and 2 x 310 apart; CAP 64 206 and 647
# against 160 and 2 x 360 (two programs per SM either way: shared memory). Apart: 3.43 / 4.24 / 7.43 ms at T = 512 /
# 1024 / 2048 against 3.20 / 3.92 / 7.36 fused (the header's runs, 4 warps). With the block scales in the values
# (247388a), CAP 64 at two programs an SM: fused 128 registers, 296 bytes of spill loads; apart 12 bytes; fused faster
# all the same, 4.73 against 5.03 ms a q2 layer at T = 2048 (H100, BENCHMARKS.md, the forty-seventh session).
FUSE = {32: True, 64: True}
# programs per SM the compiler must leave registers for (moe_mma.cu's MINB: __launch_bounds__' second argument), by
# CAP. At 1, CAP 64's fused gate/up took 206 registers at 8 warps, one program per SM (ncu: 12.5 % occupancy, no
# eligible warp 66 % of cycles), and CAP 32's 130, also one; at 2, 128 / 126 (CAP 64: a 272-byte stack frame, 780
# bytes spilled, yet the block loop 647 -> 649 instructions; its down 151 -> 128, 28 bytes). H100, one q2 layer's
# routed experts, three alternating rounds, outputs bit for bit the same: CAP 32 4.37-4.98 -> 3.78-3.83 ms at T =
# 1024, 7.63-7.97 -> 6.36-6.54 at 2048; CAP 64 5.74-5.79 -> 5.59-5.68, 6.72-6.82 -> 6.51-6.60 (BENCHMARKS.md, the
# forty-fourth session). Those were the gate/up with per-block sums; since 247388a CAP 64's takes 148 registers at 1
# (no spills) and 128 at 2 (above), not retimed at 1.
MIN_BLOCKS = {32: 2, 64: 2}
# The wgmma kernels (moe_gateup_iq2_wg, moe_down_q2k_wg; compute capability 9.0 only): programs per SM by CAP, and
# whether moe_forward takes them (DS4_MOE_WGMMA unset: WG_DEFAULT_MODE). H100, 28 layers, a 2048-token prompt
# (`python3 scripts/bench_decode.py --layers 28 --prefill 2048 --chunk 2048 --repeats 3 --verify ''`, BENCHMARKS.md,
# the forty-ninth session): 252.6-253.0 ms on mma.sync, 239.0-240.2 on wgmma at two programs an SM; in chunks of 1024
# 327.4 -> 319.0. With their copies of x / h laid out once a program (moe_mma.cu's TileCopies), no kernel spills at two
# (CAP 64's gate/up spilled 60 bytes before; at one it takes 150 registers); one program an SM against two is not
# measured (the forty-ninth session's run had wrong descriptors, BENCHMARKS.md).
WG_MIN_BLOCKS = {32: 2, 64: 2}
WG_DEFAULT_MODE = "1"


def use_gateup(gate_type: int, up_type: int, parts: int, F: int, cap: int, device: torch.device) -> bool:
    """Whether a long call's multi-pair gate/up goes to moe_gateup_iq2: IQ2_XXS gate and up, and _enabled."""
    return gate_type == up_type == IQ2_XXS and _enabled(parts, F, cap, device)


def use_wgmma(device: torch.device, cap: int) -> bool:
    """Whether moe_forward's moe_mma kernels for items of `cap` pairs are the wgmma ones (moe_gateup_iq2_wg,
    moe_down_q2k_wg): DS4_MOE_WGMMA (else WG_DEFAULT_MODE) "1" on a device of compute capability 9.0 (wgmma: Hopper's
    own, sm_90a), with an NVRTC that builds sm_90a (cuda_launch.builds_sm90a; an older one keeps the mma.sync kernels),
    and whole warpgroups (WARPS[cap] a multiple of 4: bench_kernels' sweep tries 2)."""
    return (os.environ.get("DS4_MOE_WGMMA", WG_DEFAULT_MODE) == "1" and device.type == "cuda"
            and cap in WARPS and WARPS[cap] % 4 == 0 and torch.cuda.get_device_capability(device) == (9, 0)
            and cuda_launch.builds_sm90a())


def use_down(down_type: int, parts: int, D: int, cap: int, device: torch.device) -> bool:
    """Whether a long call's multi-pair down goes to moe_down_q2k: a Q2_K down, and _enabled."""
    return down_type == Q2_K and _enabled(parts, D, cap, device)


# DS4_MOE_MMA when unset: on. The kernels' GPU tests (tests/test_moe_mma.py: both kernels against float64 at small
# shapes and Flash widths, moe_forward's long call) passed on an H100 (BENCHMARKS.md, the forty-second session).
DEFAULT_MODE = "1"


def _enabled(parts: int, rows: int, cap: int, device: torch.device) -> bool:
    """DS4_MOE_MMA (else DEFAULT_MODE) "1", a device the kernels run on (cuda_launch.runs_on), one activation part,
    items of a CAP with a launch here (WARPS) and rows a multiple of its row tile."""
    return (os.environ.get("DS4_MOE_MMA", DEFAULT_MODE) == "1" and cuda_launch.runs_on(device) and parts == 1
            and cap in WARPS
            and rows % (16 * WARPS[cap]) == 0)


def kernel(name: str, nt: int, warps: int, nib: bool | None = None, fuse: bool | None = None,
           min_blocks: int | None = None) -> cuda_launch.Kernel:
    """moe_mma.cu's kernel `name` ("moe_gateup_iq2", "moe_down_q2k", or either with "_wg": on wgmma) with NT = nt x
    tiles, `warps` warps, the gate/up's table form, whether it does gate and up in one pass and the programs per SM its
    registers must allow (NIB, FUSE[8 nt], MIN_BLOCKS[8 nt] when None; the wgmma kernels WG_MIN_BLOCKS)."""
    wg = name.endswith("_wg")
    nib = NIB if nib is None else nib
    fuse = FUSE.get(8 * nt, False) if fuse is None else fuse
    min_blocks = (WG_MIN_BLOCKS if wg else MIN_BLOCKS).get(8 * nt, 1) if min_blocks is None else min_blocks
    return cuda_launch.Kernel("moe_mma.cu", name, (("NT", nt), ("WARPS", warps), ("NIB", int(nib)),
                                                   ("FUSE", int(fuse)), ("MINB", min_blocks))
                              + ((("WG", 1),) if wg else ()))


def smem_bytes(name: str, cap: int, nib: bool | None = None) -> int:
    """gate/up: two chunks of x (cap x XSTRIDE each; the wgmma kernel's unpadded, cap x 512), the 384 table rows, and
    per slot its token offset, s / 8, weight, pair (the tables' form: nib, NIB when None); down: two chunks of h and
    of its run sums (64 bytes a slot), and per slot its pair and 2 invs; the wgmma down two chunks of h (cap x 512),
    each chunk's blocks of the program's 16 WARPS[cap] rows (moe_mma.cu's stage_rows: Q2K_SLOT bytes a row) and per
    slot its pair and s."""
    if name.startswith("moe_gateup_iq2"):
        chunk = cap * 512 if name.endswith("_wg") else cap * XSTRIDE
        return 2 * chunk + 384 * (4 if (NIB if nib is None else nib) else 16) + cap * (8 + 4 + 4 + 4)
    if name.endswith("_wg"):
        return 2 * cap * 512 + 2 * 16 * WARPS[cap] * Q2K_SLOT + cap * (8 + 4)
    return 2 * cap * (XSTRIDE + 64) + cap * (8 + 8)


@functools.cache
def _f16_rows_np() -> np.ndarray:
    """The float16 form of the gate/up kernel's IQ2_XXS tables (NIB off), from gguf's: uint16 [384, 8], rows 0..255
    the grid's magnitudes as float16, rows 256..383 ksigns' bits as float16 sign masks (0x8000 where negated)."""
    from gguf import quants as gguf_quants

    cls = gguf_quants.IQ2_XXS
    cls.init_grid()
    grid = np.asarray(cls.grid, dtype=np.float32).reshape(256, 8)
    bits = (np.frombuffer(cls.ksigns, dtype=np.uint8)[:, None] >> np.arange(8)) & 1             # [128, 8]
    return np.concatenate([grid.astype(np.float16).view(np.uint16), (bits * 0x8000).astype(np.uint16)])


_F16_ROWS: dict[str, torch.Tensor] = {}


def tables(device: torch.device, nib: bool | None = None) -> torch.Tensor:
    """The gate/up kernel's IQ2_XXS tables on `device`: with nib (NIB when None) moe_triton's selector table (int32
    [384]: each grid entry's codes as nibbles, then each sign index's bits at bit 2 of those nibbles, the one
    _iq2_dp_block reads), else _f16_rows_np's."""
    if NIB if nib is None else nib:
        from ds4trt.plugins.kernels import moe_triton     # not at the top: moe_triton imports this module

        return moe_triton._tables(device)[2]
    key = str(device)
    if key not in _F16_ROWS:
        _F16_ROWS[key] = torch.from_numpy(_f16_rows_np().view(np.int16).copy()).to(device)
    return _F16_ROWS[key]


def gateup_iq2(xh: torch.Tensor, xscale: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, order: torch.Tensor,
               cnt: torch.Tensor, starts: torch.Tensor, gate_blocks: torch.Tensor, up_blocks: torch.Tensor,
               h: torch.Tensor, n_slots: int, clamp: float, cap: int, wg: bool = False) -> torch.Tensor:
    """xh float16 [R, D], xscale float32 [R] (q8_triton.x_f16 of the tokens' x: x = xh * xscale, xscale a power of
    two); ids int64 [P] (each pair's expert), weights float32 [P]; order int32 [P], cnt int32 [P + 1] and starts int32
    [items] (moe_triton._long_items: items of 1..cap pairs; a program whose start has cnt 0 returns); gate_blocks,
    up_blocks uint8 [E, F, D / 256 * 66] IQ2_XXS; h float32 [P, F] -> h, its rows of the items' pairs written.
    wg: the wgmma kernel (use_wgmma), xh in x_f16's wgmma order. Arguments are trusted (moe_forward checked them),
    apart from the shapes this kernel depends on."""
    R, D = xh.shape
    E, F, row_bytes = gate_blocks.shape
    warps = WARPS[cap]
    if (xh.dtype != torch.float16 or xscale.shape != (R,) or xscale.dtype != torch.float32 or D % 256
            or row_bytes != D // 256 * 66 or up_blocks.shape != gate_blocks.shape or F % (16 * warps)
            or h.shape[1] != F or ids.dtype != torch.int64 or cap % 8):
        raise ValueError(f"moe_mma.gateup_iq2: unexpected operands (xh {xh.dtype} {list(xh.shape)}, xscale "
                         f"{xscale.dtype} {list(xscale.shape)}, gate {list(gate_blocks.shape)}, h {list(h.shape)}, "
                         f"ids {ids.dtype}, cap {cap})")
    if wg and warps % 4:
        raise ValueError(f"moe_mma.gateup_iq2: the wgmma kernel takes whole warpgroups, not {warps} warps")
    _launch("moe_gateup_iq2_wg" if wg else "moe_gateup_iq2", cap, F, starts,
            (xh, xscale, ids, weights, order, cnt, starts, gate_blocks, up_blocks, tables(xh.device), h, n_slots, F,
             D, (float(clamp), ctypes.c_float)))
    return h


def down_q2k(hh: torch.Tensor, hsh: torch.Tensor, hsl: torch.Tensor, hinv: torch.Tensor, ids: torch.Tensor,
             order: torch.Tensor, cnt: torch.Tensor, starts: torch.Tensor, down_blocks: torch.Tensor, y: torch.Tensor,
             cap: int) -> torch.Tensor:
    """hh float16 [P, F], hsh, hsl float16 [P, F / 16], hinv float32 [P, F / 256] (split_runs of h: hi, the run sums'
    hi and lo, inv); ids int64 [P]; order, cnt, starts as gateup_iq2's; down_blocks uint8 [E, D, F / 256 * 84] Q2_K;
    y float32 [P, D] -> y, its rows of the items' pairs written (moe_down_q2k, mma.sync)."""
    P, F = hh.shape
    if hh.dtype != torch.float16 or hsh.shape != (P, F // 16) or hsl.shape != hsh.shape or hinv.shape != (P, F // 256):
        raise ValueError(f"moe_mma.down_q2k: unexpected operands (hh {hh.dtype} {list(hh.shape)}, sums "
                         f"{list(hsh.shape)}, inv {list(hinv.shape)})")
    D = _check_down(hh, ids, down_blocks, y, cap, False)
    _launch("moe_down_q2k", cap, D, starts, (hh, hsh, hsl, hinv, ids, order, cnt, starts, down_blocks, y, D, F))
    return y


def down_q2k_wg(hh: torch.Tensor, hs: torch.Tensor, ids: torch.Tensor, order: torch.Tensor, cnt: torch.Tensor,
                starts: torch.Tensor, down_blocks: torch.Tensor, y: torch.Tensor, cap: int) -> torch.Tensor:
    """down_q2k on wgmma (moe_down_q2k_wg, use_wgmma): h as q8_triton.x_f16(h, down_order=True) makes it, hh float16
    [P, F] (each 256-value chunk in q8_triton.down_wgmma_position's order) and hs float32 [P] (h = hh * hs)."""
    P, F = hh.shape
    if hh.dtype != torch.float16 or hs.dtype != torch.float32 or hs.shape != (P,):
        raise ValueError(f"moe_mma.down_q2k_wg: expected hh float16 [P, F] and hs float32 [P], got hh {hh.dtype} "
                         f"{list(hh.shape)}, hs {hs.dtype} {list(hs.shape)}")
    D = _check_down(hh, ids, down_blocks, y, cap, True)
    _launch("moe_down_q2k_wg", cap, D, starts, (hh, hs, ids, order, cnt, starts, down_blocks, y, D, F))
    return y


def _check_down(hh: torch.Tensor, ids: torch.Tensor, down_blocks: torch.Tensor, y: torch.Tensor, cap: int,
                wg: bool) -> int:
    """The operands both downs share checked -> D."""
    F = hh.shape[1]
    E, D, row_bytes = down_blocks.shape
    warps = WARPS[cap]
    if F % 256 or row_bytes != F // 256 * 84 or D % (16 * warps) or y.shape[1] != D or ids.dtype != torch.int64 \
            or cap % 8:
        raise ValueError(f"moe_mma.down_q2k: unexpected operands (hh {list(hh.shape)}, down "
                         f"{list(down_blocks.shape)}, y {list(y.shape)}, ids {ids.dtype}, cap {cap})")
    if wg and warps % 4:
        raise ValueError(f"moe_mma.down_q2k_wg: the wgmma kernel takes whole warpgroups, not {warps} warps")
    return D


def _launch(name: str, cap: int, rows: int, starts: torch.Tensor, args: tuple) -> None:
    """moe_mma.cu's kernel `name` over (the listed items, rows / its row tile) programs."""
    warps = WARPS[cap]
    if starts.numel():
        cuda_launch.launch(starts.device, kernel(name, cap // 8, warps), (starts.numel(), rows // (16 * warps)),
                           warps * 32, smem_bytes(name, cap), args)
