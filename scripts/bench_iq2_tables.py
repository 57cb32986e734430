#!/usr/bin/env python3
"""The decode IQ2_XXS gate/up loop (moe_triton._iq2_dp_pair) with its selector tables read other ways, and with its
block fields loaded one or two steps ahead, timed on the H200 (one Flash layer, T = 1, as scripts/bench_iq2_gateup.py):

    python3 scripts/bench_iq2_tables.py

Each run of 8 values looks up two 32-bit prmt selectors in global memory (moe_triton._tables: the grid codes by the
run's grid index, the sign bits by its 7-bit sign index), 2 of the loop's ~450 instructions per run plus their
64-bit address arithmetic. Modes of `gateup_variant`:
  0  main's loop (both tables from global memory, L1-resident)
  1  no tables: a selector made from the indices by two integer operations (wrong values; the time without the
     lookups, a bound on what any table scheme can gain)
  2  sign selectors by arithmetic (ksigns[s] = s | parity(s) << 7, its bits spread to bit 2 of each nibble)
  3  both tables through shared memory: a tl.gather per matrix and step (Triton stores the table, then each lane
     loads its entries; a barrier on each side)
  4  the grid table through one shared-memory gather per step, the signs by arithmetic
  5  both tables, both matrices, one shared-memory gather per step
and `gateup_prefetch`: main's loop with the next (distance 1) or next two (2) blocks' fields loaded a step ahead.
Modes 2..5 and the prefetch forms give main's outputs bit for bit (the same integers; checked here on the GPU).
Results: BENCHMARKS.md, thirtieth session.
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_iq2_gateup import one_layer  # noqa: E402
from bench_kernels import D, F, K_SLOTS, time_graph  # noqa: E402

from ds4trt.plugins.kernels import moe_triton as M  # noqa: E402
from ds4trt.plugins.kernels.int_dot import ASM  # noqa: E402

NSB = D // 256
MODES = {0: "global tables (main)", 1: "no tables (bound)", 2: "signs by arithmetic", 3: "smem, 2 gathers",
         4: "smem grid + arith signs", 5: "smem, 1 gather"}


@triton.jit
def popc(x):
    if ASM:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        c = x * 0
        for i in tl.static_range(8):
            c += (x >> i) & 1
        return c


@triton.jit
def sign_nibbles(bw, l: tl.constexpr):
    """ksigns[(bw >> 7l) & 127] (the 7 bits and their parity as bit 7) with bit i moved to bit 4i + 2."""
    s = (bw >> (7 * l)) & 127
    s = s | ((popc(s) & 1) << 7)
    x = (s | (s << 12)) & 0x000F000F
    x = (x | (x << 6)) & 0x03030303
    x = (x | (x << 3)) & 0x11111111
    return x << 2


@triton.jit
def block_sel(acc, s0, s1, s2, s3, hi, d, xq_ptr, sb, NSB: tl.constexpr):
    D: tl.constexpr = NSB * 256
    PS: tl.constexpr = D // 8
    r0 = xq_ptr + sb * 32 + 4 * tl.arange(0, 8)[:, None]
    h0, h1, l0, l1, l2, l3, xu = M._ld_run_planes(r0, PS)
    y = tl.zeros(acc.shape, tl.float32)
    sels = (s0, s1, s2, s3)
    for l in tl.static_range(4):
        y = M._iq2_dp_run(y, sels[l], h0[l], h1[l], l0[l], l1[l], l2[l], l3[l], xu[l])
    dl = d.to(tl.float16, bitcast=True).to(tl.float32) * (0.125 * M._u2f(2 * (hi.to(tl.int32) >> 12) + 1))
    return acc + dl * y


@triton.jit
def idx_of(a01, a23, lo, hi, l: tl.constexpr):
    a = a01 if l < 2 else a23
    return (a.to(tl.int32) >> (8 * (l % 2))) & 255


@triton.jit
def sels_global(a01, a23, lo, hi, dp_ptr, MODE: tl.constexpr):
    """The 4 selectors of a group's runs: MODE 0 both tables from global memory (main), 1 neither (a stand-in, timing
    only), 2 the signs by arithmetic."""
    bw = lo.to(tl.int32) | (hi.to(tl.int32) << 16)
    out = ()
    for l in tl.static_range(4):
        idx = idx_of(a01, a23, lo, hi, l)
        if MODE == 0:
            s = tl.load(dp_ptr + idx) | tl.load(dp_ptr + 256 + ((bw >> (7 * l)) & 127))
        elif MODE == 1:
            s = (idx * 0x00010101 ^ (bw >> (7 * l))) & 0x66666666
        else:
            s = tl.load(dp_ptr + idx) | sign_nibbles(bw, l)
        out = out + (s,)
    return out


@triton.jit
def lookup_smem(tab, i0, i1, i2, i3, i4, i5, i6, i7):
    """tab [512] int32; i* [8, BR] -> tab[i*], by one gather through shared memory."""
    j = _join8(i0, i1, i2, i3, i4, i5, i6, i7)
    shape: tl.constexpr = j.shape
    return _split8(tl.reshape(tl.gather(tab, tl.reshape(j, (j.numel,)), 0), shape))


@triton.jit
def lookup16(tab, i):
    """i: 16 index tensors [8, BR] -> 16 tab lookups, one gather."""
    j = tl.join(_join8(i[0], i[1], i[2], i[3], i[4], i[5], i[6], i[7]),
                _join8(i[8], i[9], i[10], i[11], i[12], i[13], i[14], i[15]))
    shape: tl.constexpr = j.shape
    g = tl.reshape(tl.gather(tab, tl.reshape(j, (j.numel,)), 0), shape)
    ga, gb = tl.split(g)
    return _split8(ga) + _split8(gb)


@triton.jit
def _join8(a, b, c, d, e, f, g, h):
    return tl.join(tl.join(tl.join(a, b), tl.join(c, d)), tl.join(tl.join(e, f), tl.join(g, h)))


@triton.jit
def _split8(g):
    a, b = tl.split(g)
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    o0, o1 = tl.split(a0)
    o2, o3 = tl.split(a1)
    o4, o5 = tl.split(b0)
    o6, o7 = tl.split(b1)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def _program(ids_ptr, gate_ptr, up_ptr, expert_bytes, NSB: tl.constexpr, BR: tl.constexpr):
    """This program's pair, first row, the pair's gate and up expert as uint16 pointers and its rows' half-word
    offsets."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    row0 = tl.program_id(1) * BR
    g16 = (gate_ptr + e * expert_bytes).to(tl.pointer_type(tl.uint16))
    u16 = (up_ptr + e * expert_bytes).to(tl.pointer_type(tl.uint16))
    return pair, row0, g16, u16, (row0 + tl.arange(0, BR)) * (NSB * 33)


@triton.jit
def gateup_variant(ids_ptr, gate_ptr, up_ptr, xq_ptr, dp_ptr, g_out, u_out, expert_bytes, F: tl.constexpr,
                   NSB: tl.constexpr, BR: tl.constexpr, MODE: tl.constexpr):
    """MODE 0..2: sels_global; 3: both tables through one shared-memory gather per step; 4: the grid through one
    shared-memory gather per step, signs by arithmetic."""
    pair, row0, g16, u16, rh = _program(ids_ptr, gate_ptr, up_ptr, expert_bytes, NSB, BR)
    acc_g = tl.zeros([8, BR], tl.float32)
    acc_u = tl.zeros([8, BR], tl.float32)
    if MODE >= 3:
        k = tl.arange(0, 512)
        tab = tl.load(dp_ptr + tl.minimum(k, 383))
    for sb in range(0, NSB):
        ga01, ga23, glo, ghi, gd = M._iq2_fields(g16, rh, sb)
        ua01, ua23, ulo, uhi, ud = M._iq2_fields(u16, rh, sb)
        if MODE < 3:
            gs0, gs1, gs2, gs3 = sels_global(ga01, ga23, glo, ghi, dp_ptr, MODE)
            us0, us1, us2, us3 = sels_global(ua01, ua23, ulo, uhi, dp_ptr, MODE)
        else:
            gb = glo.to(tl.int32) | (ghi.to(tl.int32) << 16)
            ub = ulo.to(tl.int32) | (uhi.to(tl.int32) << 16)
            if MODE == 5:
                o = lookup16(tab, (idx_of(ga01, ga23, glo, ghi, 0), idx_of(ga01, ga23, glo, ghi, 1),
                    idx_of(ga01, ga23, glo, ghi, 2), idx_of(ga01, ga23, glo, ghi, 3),
                    256 + (gb & 127), 256 + ((gb >> 7) & 127), 256 + ((gb >> 14) & 127), 256 + ((gb >> 21) & 127),
                    idx_of(ua01, ua23, ulo, uhi, 0), idx_of(ua01, ua23, ulo, uhi, 1),
                    idx_of(ua01, ua23, ulo, uhi, 2), idx_of(ua01, ua23, ulo, uhi, 3),
                    256 + (ub & 127), 256 + ((ub >> 7) & 127), 256 + ((ub >> 14) & 127), 256 + ((ub >> 21) & 127)))
                gs0, gs1, gs2, gs3 = o[0] | o[4], o[1] | o[5], o[2] | o[6], o[3] | o[7]
                us0, us1, us2, us3 = o[8] | o[12], o[9] | o[13], o[10] | o[14], o[11] | o[15]
            elif MODE == 3:
                g0, g1, g2, g3, t0, t1, t2, t3 = lookup_smem(
                    tab, idx_of(ga01, ga23, glo, ghi, 0), idx_of(ga01, ga23, glo, ghi, 1),
                    idx_of(ga01, ga23, glo, ghi, 2), idx_of(ga01, ga23, glo, ghi, 3),
                    256 + (gb & 127), 256 + ((gb >> 7) & 127), 256 + ((gb >> 14) & 127), 256 + ((gb >> 21) & 127))
                v0, v1, v2, v3, w0, w1, w2, w3 = lookup_smem(
                    tab, idx_of(ua01, ua23, ulo, uhi, 0), idx_of(ua01, ua23, ulo, uhi, 1),
                    idx_of(ua01, ua23, ulo, uhi, 2), idx_of(ua01, ua23, ulo, uhi, 3),
                    256 + (ub & 127), 256 + ((ub >> 7) & 127), 256 + ((ub >> 14) & 127), 256 + ((ub >> 21) & 127))
                gs0, gs1, gs2, gs3 = g0 | t0, g1 | t1, g2 | t2, g3 | t3
                us0, us1, us2, us3 = v0 | w0, v1 | w1, v2 | w2, v3 | w3
            else:
                g0, g1, g2, g3, v0, v1, v2, v3 = lookup_smem(
                    tab, idx_of(ga01, ga23, glo, ghi, 0), idx_of(ga01, ga23, glo, ghi, 1),
                    idx_of(ga01, ga23, glo, ghi, 2), idx_of(ga01, ga23, glo, ghi, 3),
                    idx_of(ua01, ua23, ulo, uhi, 0), idx_of(ua01, ua23, ulo, uhi, 1),
                    idx_of(ua01, ua23, ulo, uhi, 2), idx_of(ua01, ua23, ulo, uhi, 3))
                gs0, gs1 = g0 | sign_nibbles(gb, 0), g1 | sign_nibbles(gb, 1)
                gs2, gs3 = g2 | sign_nibbles(gb, 2), g3 | sign_nibbles(gb, 3)
                us0, us1 = v0 | sign_nibbles(ub, 0), v1 | sign_nibbles(ub, 1)
                us2, us3 = v2 | sign_nibbles(ub, 2), v3 | sign_nibbles(ub, 3)
        acc_g = block_sel(acc_g, gs0, gs1, gs2, gs3, ghi, gd, xq_ptr, sb, NSB)
        acc_u = block_sel(acc_u, us0, us1, us2, us3, uhi, ud, xq_ptr, sb, NSB)
    r = pair * F + row0 + tl.arange(0, BR)
    tl.store(g_out + r, tl.sum(acc_g, axis=0))
    tl.store(u_out + r, tl.sum(acc_u, axis=0))


@triton.jit
def gateup_prefetch(ids_ptr, gate_ptr, up_ptr, xq_ptr, dp_ptr, g_out, u_out, expert_bytes, F: tl.constexpr,
                    NSB: tl.constexpr, BR: tl.constexpr, DIST: tl.constexpr):
    """Main's pair loop (global tables) with the fields of block sb + DIST loaded in step sb (DIST 1 or 2)."""
    pair, row0, g16, u16, rh = _program(ids_ptr, gate_ptr, up_ptr, expert_bytes, NSB, BR)
    acc_g = tl.zeros([8, BR], tl.float32)
    acc_u = tl.zeros([8, BR], tl.float32)
    ga01, ga23, glo, ghi, gd = M._iq2_fields(g16, rh, 0)
    ua01, ua23, ulo, uhi, ud = M._iq2_fields(u16, rh, 0)
    if DIST == 2:
        ga01b, ga23b, glob, ghib, gdb = M._iq2_fields(g16, rh, 1)
        ua01b, ua23b, ulob, uhib, udb = M._iq2_fields(u16, rh, 1)
    for sb in range(0, NSB):
        nb = tl.minimum(sb + DIST, NSB - 1)
        na01, na23, nlo, nhi, nd = M._iq2_fields(g16, rh, nb)
        ma01, ma23, mlo, mhi, md = M._iq2_fields(u16, rh, nb)
        acc_g = M._iq2_dp_block(acc_g, ga01, ga23, glo, ghi, gd, xq_ptr, sb, dp_ptr, NSB)
        acc_u = M._iq2_dp_block(acc_u, ua01, ua23, ulo, uhi, ud, xq_ptr, sb, dp_ptr, NSB)
        if DIST == 2:
            ga01, ga23, glo, ghi, gd = ga01b, ga23b, glob, ghib, gdb
            ua01, ua23, ulo, uhi, ud = ua01b, ua23b, ulob, uhib, udb
            ga01b, ga23b, glob, ghib, gdb = na01, na23, nlo, nhi, nd
            ua01b, ua23b, ulob, uhib, udb = ma01, ma23, mlo, mhi, md
        else:
            ga01, ga23, glo, ghi, gd = na01, na23, nlo, nhi, nd
            ua01, ua23, ulo, uhi, ud = ma01, ma23, mlo, mhi, md
    r = pair * F + row0 + tl.arange(0, BR)
    tl.store(g_out + r, tl.sum(acc_g, axis=0))
    tl.store(u_out + r, tl.sum(acc_u, axis=0))


def main() -> int:
    gate, up, dp, xq, sets, bw = one_layer()
    R = len(sets)
    nbytes = K_SLOTS * 2 * F * NSB * 66
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.3f} TB/s; gate/up {nbytes / 1e6:.1f} MB, floor "
          f"{nbytes / bw * 1e6:.2f} us; {R} expert sets per graph; us, three timings each")

    def run(label, launch, ref):
        out = tuple(torch.full((K_SLOTS, F), float("nan"), device="cuda") for _ in range(2))

        def fn():
            for ids in sets:
                launch(ids, out)
        times = [time_graph(fn, R) * 1e3 for _ in range(3)]
        same = "-" if ref is None else all(torch.equal(a, b) for a, b in zip(out, ref))
        print(f"{label:58s} " + " ".join(f"{t:6.2f}" for t in times) + f"; main's outputs: {same}")
        return out

    for br, warps in ((16, 2), (16, 1), (32, 2), (16, 4), (32, 4), (8, 2)):
        grid = (K_SLOTS, F // br)
        ref = None
        for mode, name in MODES.items():
            out = run(f"rows {br} warps {warps} mode {mode} {name}",
                      lambda ids, o, mode=mode: gateup_variant[grid](ids, gate, up, xq, dp, *o, F * NSB * 66, F=F,
                                                                     NSB=NSB, BR=br, MODE=mode, num_warps=warps),
                      None if mode == 1 else ref)
            ref = out if ref is None else ref
        for dist in (1, 2):
            run(f"rows {br} warps {warps} prefetch distance {dist}",
                lambda ids, o, dist=dist: gateup_prefetch[grid](ids, gate, up, xq, dp, *o, F * NSB * 66, F=F,
                                                                NSB=NSB, BR=br, DIST=dist, num_warps=warps), ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
