#!/usr/bin/env python3
"""Alternatives of the decode IQ2_XXS gate/up loop, timed on the H200 (one Flash layer, T = 1): the blocks
rearranged on the device, and the K range split over several programs.

    python3 scripts/bench_iq2_gateup.py [--rows 16,32] [--warps 4] [--splits 16:4:1,16:4:2,...]

The one-pair gate/up loop (moe_triton._iq2_dp_pair) reads each block's fields as five 2-byte loads per lane (the
66-byte GGUF blocks are only 2-byte aligned), spread over 4 rows' blocks 1056 bytes apart per warp. Kept apart on
the device, a block's 8 group records (A, B: 8 bytes each) become one 8-byte load per lane, a warp's 8 groups x 4
rows 256 contiguous bytes, and d one 2-byte load from its own array: records int64 [E, D/256, F, 8], d f16
[E, D/256, F] (the same bytes). This script times the two layouts with the same arithmetic (_iq2_dp_block) in
stripped-down kernels (6 pairs, gate and up, swiglu into float h; no routing), each graph replaying R calls over
R expert sets larger together than 4x the L2, and says whether the outputs agree bit for bit (they do at 16 rows x
4 warps; other tiles may add a row's group sums in another order).

--splits (rows:warps:splits, ...): the GGUF layout's loop with the 16 blocks of a row split over `splits` programs
(more programs in flight, each a shorter chain of dependent steps): each stores its partial gate and up sums, and the
last of a row tile's programs to arrive (an atomic count, as in q8_triton._q8_rows) adds them in split order; its
outputs are compared with the unsplit kernel's (float32 sums in another order: to 1e-6 relative).
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kernels import CLAMP, D, E, F, K_SLOTS, copy_bandwidth, random_blocks, time_graph  # noqa: E402

from ds4trt.plugins.kernels import moe_triton as M  # noqa: E402

NSB = D // 256


@triton.jit
def _quant(v_ptr, xq_ptr, D: tl.constexpr):
    b = tl.program_id(0)
    x = tl.load(v_ptr + b * 256 + 8 * tl.arange(0, 32)[:, None] + tl.arange(0, 8)[None, :])        # [32, 8]
    M._quant_runs(xq_ptr, D, b * 32, x, 32)


@triton.jit
def _gateup_gguf(ids_ptr, gate_ptr, up_ptr, xq_ptr, dp_ptr, g_out, u_out, expert_bytes, F: tl.constexpr,
                 NSB: tl.constexpr, BR: tl.constexpr):
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row0 = tl.program_id(1) * BR
    g, u = M._iq2_dp_pair(gate_ptr, e * expert_bytes, up_ptr, e * expert_bytes, row0, xq_ptr, dp_ptr, NSB, BR)
    r = pair * F + row0 + tl.arange(0, BR)
    tl.store(g_out + r, g)
    tl.store(u_out + r, u)


@triton.jit
def _rep_fields(rec_ptr, d_ptr, e, row0, sb, F: tl.constexpr, NSB: tl.constexpr, BR: tl.constexpr):
    """Block sb of rows row0.. of expert e in the rearranged layout -> the fields _iq2_dp_block takes, [8, BR]."""
    rows = (e * NSB + sb) * F + row0 + tl.arange(0, BR)                   # int64 [BR]: (e, sb, row) of d
    rec = tl.load(rec_ptr + rows[None, :] * 8 + tl.arange(0, 8)[:, None])  # int64 [8, BR]: A | B << 32
    a = rec.to(tl.int32)
    b = (rec >> 32).to(tl.int32)
    d = tl.broadcast_to(tl.load(d_ptr + rows)[None, :], (8, BR))
    return a & 0xFFFF, (a >> 16) & 0xFFFF, b & 0xFFFF, (b >> 16) & 0xFFFF, d


@triton.jit
def _gateup_rep(ids_ptr, grec, gd, urec, ud, xq_ptr, dp_ptr, g_out, u_out, F: tl.constexpr, NSB: tl.constexpr,
                BR: tl.constexpr):
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row0 = tl.program_id(1) * BR
    acc_g = tl.zeros([8, BR], tl.float32)
    acc_u = tl.zeros([8, BR], tl.float32)
    for sb in range(0, NSB):
        ga01, ga23, glo, ghi, gdd = _rep_fields(grec, gd, e, row0, sb, F, NSB, BR)
        ua01, ua23, ulo, uhi, udd = _rep_fields(urec, ud, e, row0, sb, F, NSB, BR)
        acc_g = M._iq2_dp_block(acc_g, ga01, ga23, glo, ghi, gdd, xq_ptr, sb, dp_ptr, NSB)
        acc_u = M._iq2_dp_block(acc_u, ua01, ua23, ulo, uhi, udd, xq_ptr, sb, dp_ptr, NSB)
    r = pair * F + row0 + tl.arange(0, BR)
    tl.store(g_out + r, tl.sum(acc_g, axis=0))
    tl.store(u_out + r, tl.sum(acc_u, axis=0))


@triton.jit
def _gateup_split(ids_ptr, gate_ptr, up_ptr, xq_ptr, dp_ptr, g_out, u_out, part_ptr, cnt_ptr, expert_bytes,
                  F: tl.constexpr, NSB: tl.constexpr, BR: tl.constexpr, SPLITS: tl.constexpr):
    pair = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row0 = tile * BR
    g16 = (gate_ptr + e * expert_bytes).to(tl.pointer_type(tl.uint16))
    u16 = (up_ptr + e * expert_bytes).to(tl.pointer_type(tl.uint16))
    rh = (row0 + tl.arange(0, BR)) * (NSB * 33)
    acc_g = tl.zeros([8, BR], tl.float32)
    acc_u = tl.zeros([8, BR], tl.float32)
    STEPS: tl.constexpr = NSB // SPLITS
    for i in range(0, STEPS):
        sb = split * STEPS + i
        ga01, ga23, glo, ghi, gd = M._iq2_fields(g16, rh, sb)
        ua01, ua23, ulo, uhi, ud = M._iq2_fields(u16, rh, sb)
        acc_g = M._iq2_dp_block(acc_g, ga01, ga23, glo, ghi, gd, xq_ptr, sb, dp_ptr, NSB)
        acc_u = M._iq2_dp_block(acc_u, ua01, ua23, ulo, uhi, ud, xq_ptr, sb, dp_ptr, NSB)
    r = pair * F + row0 + tl.arange(0, BR)
    P = tl.num_programs(0) * F                                          # values of one split's g (or u) partials
    tl.store(part_ptr + split * 2 * P + r, tl.sum(acc_g, axis=0))
    tl.store(part_ptr + (split * 2 + 1) * P + r, tl.sum(acc_u, axis=0))
    tl.debug_barrier()
    c = pair * tl.num_programs(1) + tile
    if tl.atomic_add(cnt_ptr + c, 1, sem="acq_rel", scope="gpu") == SPLITS - 1:
        g = tl.zeros([BR], tl.float32)
        u = tl.zeros([BR], tl.float32)
        for s in tl.static_range(SPLITS):
            g += tl.load(part_ptr + s * 2 * P + r, cache_modifier=".cg")
            u += tl.load(part_ptr + (s * 2 + 1) * P + r, cache_modifier=".cg")
        tl.store(g_out + r, g)
        tl.store(u_out + r, u)
        tl.atomic_xchg(cnt_ptr + c, 0)


def rearrange(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [E, F, NSB * 66] -> (records int64 [E, NSB, F, 8], d f16 [E, NSB, F])."""
    b = blocks.view(E, F, NSB, 66).permute(0, 2, 1, 3)
    return (b[..., 2:].contiguous().view(torch.int64).view(E, NSB, F, 8),
            b[..., :2].contiguous().view(torch.float16).view(E, NSB, F))


def one_layer():
    """One Flash layer's random IQ2_XXS gate and up experts, the selector table, one token's activations as
    _quant_runs stores them, R sets of 6 experts (together over 4x the L2: the weights come from HBM) and the copy
    bandwidth -> (gate, up uint8 [E, F, row bytes], dp, xq, sets, bandwidth)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    gate = random_blocks(M.IQ2_XXS, F, D, lead=E, gen=gen).view(E, F, -1)
    up = random_blocks(M.IQ2_XXS, F, D, lead=E, gen=gen).view(E, F, -1)
    _, _, dp = M._tables(gate.device)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    R = max(4, -(-4 * l2 // (K_SLOTS * 2 * F * NSB * 66)))
    sets = [torch.randperm(E, device="cuda", generator=gen)[:K_SLOTS] for _ in range(R)]
    v = torch.randn(D, device="cuda", generator=gen) * 3
    xq = torch.empty(D * 7 // 8, dtype=torch.int32, device="cuda")
    _quant[(NSB,)](v, xq, D=D)
    return gate, up, dp, xq, sets, copy_bandwidth()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="16,32", help="rows per program to time (comma list)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--splits", default="", help="rows:warps:splits configs of the split loop (comma list)")
    args = ap.parse_args()
    gate, up, dp, xq, sets, bw = one_layer()
    R = len(sets)
    (grec, gd), (urec, ud) = rearrange(gate), rearrange(up)
    outs = {name: (torch.full((K_SLOTS, F), float("nan"), device="cuda"),
                   torch.full((K_SLOTS, F), float("nan"), device="cuda")) for name in ("gguf", "rep")}
    nbytes = K_SLOTS * 2 * F * NSB * 66
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.3f} TB/s; one layer's gate/up at T = 1: "
          f"{nbytes / 1e6:.1f} MB, floor {nbytes / bw * 1e6:.2f} us; {R} expert sets per graph")
    for br in (int(x) for x in args.rows.split(",")):
        grid = (K_SLOTS, F // br)

        def gguf(br=br, grid=grid):
            for ids in sets:
                _gateup_gguf[grid](ids, gate, up, xq, dp, *outs["gguf"], F * NSB * 66, F=F, NSB=NSB, BR=br,
                                   num_warps=args.warps)

        def rep(br=br, grid=grid):
            for ids in sets:
                _gateup_rep[grid](ids, grec, gd, urec, ud, xq, dp, *outs["rep"], F=F, NSB=NSB, BR=br,
                                  num_warps=args.warps)
        t_gguf, t_rep = time_graph(gguf, R) * 1e3, time_graph(rep, R) * 1e3
        same = all(torch.equal(a, b) for a, b in zip(outs["gguf"], outs["rep"]))
        finite = all(bool(torch.isfinite(a).all()) for a in outs["gguf"])
        print(f"rows {br:3d} warps {args.warps}: GGUF layout {t_gguf:6.2f} us, rearranged {t_rep:6.2f} us "
              f"({t_gguf / t_rep:.2f}x); outputs identical: {same}, finite: {finite}")
    if args.splits:
        ref = [torch.empty(K_SLOTS, F, device="cuda") for _ in range(2)]
        _gateup_gguf[(K_SLOTS, F // 16)](sets[-1], gate, up, xq, dp, *ref, F * NSB * 66, F=F, NSB=NSB, BR=16)
        part = torch.empty(16 * 2 * K_SLOTS * F, device="cuda")
        cnt = torch.zeros(K_SLOTS * F, dtype=torch.int32, device="cuda")
    for cfg in filter(None, args.splits.split(",")):
        br, warps, splits = (int(x) for x in cfg.split(":"))
        grid = (K_SLOTS, F // br, splits)
        out = [torch.full((K_SLOTS, F), float("nan"), device="cuda") for _ in range(2)]

        def split_fn(br=br, warps=warps, splits=splits, grid=grid, out=out):
            for ids in sets:
                _gateup_split[grid](ids, gate, up, xq, dp, *out, part, cnt, F * NSB * 66, F=F, NSB=NSB, BR=br,
                                    SPLITS=splits, num_warps=warps)
        ms = time_graph(split_fn, R) * 1e3
        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out, ref))
        print(f"split rows {br:3d} warps {warps} splits {splits:2d} ({K_SLOTS * F // br * splits:5d} programs): "
              f"{ms:6.2f} us; against the unsplit kernel {err:.1e} relative")
    h = torch.nn.functional.silu(outs["gguf"][0].clamp(max=CLAMP)) * outs["gguf"][1].clamp(-CLAMP, CLAMP)
    print(f"(h of the last set: mean |h| {h.abs().mean().item():.4g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
