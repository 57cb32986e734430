#!/usr/bin/env python3
"""What ptxas makes of the decode kernels for the H200 (sm_90), on a machine without a GPU.

    python3 scripts/sass_report.py [--moe BR:WARPS:PREFETCH ...] [--q8 BR:WARPS ...] [--q8-t T ...]
                                   [--topk-warps W ...] [--long [--long-config C ...]]
                                   [--attend-config BT:HB:BN:DC:DV:WARPS:STAGES:PARTS ...]
                                   [--top-config HB:BN:DC:DV:WARPS:STAGES:PARTS ...] [--q8-mma NT:MT:WARPS:PF ...]
                                   [--moe-mma NT:WARPS[:NIB[:FUSE[:MINB]]] ...] [--dump DIR]

For each launch shape (default: each kernel's current SINGLE_CONFIG / rows_config) it compiles the one-pair ds4::MoE
kernels of the q2 and q4 mixes and the Q8_0 and F16 kernels at Flash widths (for T = 1, or the --q8-t row counts),
attention's join (_attend_join), the indexer's scores and top-k (at 8 warps, or the --topk-warps), the two
hyper-connection kernels of hc_pre_triton and hc_post_pre_triton's first, _hc_post_dots (--long: also the prefill
chunks' multi-pair MoE kernels, at LONG_CONFIGS or the --long-config launches, and the Q8_0 float16 dequantization; the
prefill attention's two kernels, _attend_long at LONG_CONFIG or the --attend-config launches and _attend_top at
TOP_CONFIG or the --top-config launches; the tensor-core Q8_0 kernel q8_mma, CUDA C++ compiled by NVRTC, at
q8_mma.CONFIG or the --q8-mma launches: its "loop" is one span of 256 values of each of the warp's rows, its shared
memory that of MAX_SPANS spans; with --long also the long calls' tensor-core MoE kernels of moe_mma.cu at moe_mma.WARPS
or the --moe-mma launches (the wgmma ones, `_wg`, for sm_90a where NVRTC builds it, at WG_MIN_BLOCKS or the launch's
MINB): gate/up's "loop" is half a block (128 values) of a warp's 16 rows of one matrix, or of both when fused; down's a
half block of the main term), and prints registers per thread, spills, shared memory, the instruction count of the whole
kernel and of its longest loop body (one step: e.g. one 256-value block of every row the program serves) and the
instruction mix of the SASS (FFMA, global / shared loads, barriers, shuffles). --dump writes each kernel's TTGIR (its
layouts: which tile dims go to lanes, warps and registers) and SASS to DIR. Counts are static (the loops are not
multiplied out); compare variants of one kernel.
Needs triton (the CPU wheel is enough); runs with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds4trt.testing import sm90  # noqa: E402

D, F, Q2_K, Q4_K, IQ2_XXS = 4096, 2048, 10, 12, 16


def shape(text: str) -> tuple:
    parts = text.split(":")
    return tuple(p == "1" if i == 2 else int(p) for i, p in enumerate(parts))


def q8_shape(text: str) -> tuple:
    return tuple(int(p) for p in text.split(":"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moe", nargs="*", type=shape, default=None, help="one-pair MoE shapes rows:warps:prefetch(0|1)")
    ap.add_argument("--q8", nargs="*", type=q8_shape, default=None,
                    help="Q8_0 shapes rows:warps[:min programs[:prefetch[:blocks per tile]]] (default: "
                         "rows_config's at each --q8-t)")
    ap.add_argument("--q8-t", nargs="*", type=int, default=[1], help="Q8_0 rows of x per launch, 1..4 (default 1)")
    ap.add_argument("--topk-warps", nargs="*", type=int, default=[8], help="top_rows' warps (default 8)")
    ap.add_argument("--long", action="store_true", help="also the multi-pair MoE kernels (prefill) at LONG_CONFIGS")
    ap.add_argument("--long-config", nargs="*", type=q8_shape, default=None, metavar="CAP:ROWS:WARPS:STAGES:PARTS",
                    help="with --long: these launches of the multi-pair kernels instead of LONG_CONFIGS")
    ap.add_argument("--attend-config", nargs="*", type=q8_shape, default=None,
                    metavar="BT:HB:BN:DC:DV:WARPS:STAGES:PARTS",
                    help="with --long: these launches of _attend_long instead of attn_triton.LONG_CONFIG")
    ap.add_argument("--top-config", nargs="*", type=q8_shape, default=None, metavar="HB:BN:DC:DV:WARPS:STAGES:PARTS",
                    help="with --long: these launches of _attend_top instead of attn_triton.TOP_CONFIG")
    ap.add_argument("--moe-mma", nargs="*", type=q8_shape, default=None,
                    metavar="NT:WARPS[:NIB[:FUSE[:MINB]]]",
                    help="with --long: moe_mma.cu's kernels at these x tiles (CAP = 8 NT), warps, gate/up table form, "
                         "one-pass gate/up and programs per SM (default: moe_mma.WARPS, NIB, FUSE, MIN_BLOCKS)")
    ap.add_argument("--q8-mma", nargs="*", type=q8_shape, default=None, metavar="NT:MT:WARPS:PF",
                    help="the tensor-core Q8_0 kernel (q8_mma.cu, compiled by NVRTC) at these x tiles, row tiles a "
                         "warp, warps and prefetch (default: q8_mma.CONFIG at NT = 1 and 2)")
    ap.add_argument("--dump", help="write <kernel>.ttgir and <kernel>.sass here")
    args = ap.parse_args()
    sm90.activate()
    from ds4trt.plugins.kernels import attn_triton as A
    from ds4trt.plugins.kernels import f16_triton as F16
    from ds4trt.plugins.kernels import moe_triton as M
    from ds4trt.plugins.kernels import q8_triton as Q
    from ds4trt.testing import warmups as W

    rows = []

    def report(label: str, k, math: bool = True) -> None:
        st = sm90.sass_stats(k, math)
        rows.append((label, st))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, label + ".ttgir"), "w") as f:
                f.write(k.asm["ttgir"])
            with open(os.path.join(args.dump, label + ".sass"), "w") as f:
                f.write(sm90.sass(k))

    def single(t: int) -> tuple:      # moe_forward's one-pair launch for block type t: (rows, warps, prefetch)
        br, warps, _, pf = M.SINGLE_CONFIG[t]
        return br, warps, pf

    for gate, down in ((IQ2_XXS, Q2_K), (Q4_K, Q4_K)):
        for br, warps, pf in args.moe or [single(gate)]:
            report(f"moe_gateup_t{gate}_{br}x{warps}{'_pf' if pf else ''}",
                   W.moe_gateup_single(gate, gate, down, D, F, br, warps, pf))
        for br, warps, pf in args.moe or [single(down)]:
            report(f"moe_down_t{down}_{br}x{warps}{'_pf' if pf else ''}", W.moe_down_single(down, D, F, br, warps, pf))
            report(f"moe_down_t{down}_{br}x{warps}{'_pf' if pf else ''}_shared",
                   W.moe_down_single(down, D, F, br, warps, pf, shared=True))
    if args.long:
        longs = args.long_config or [*M.LONG_CONFIGS.values(), *M.LONG_CONFIGS_Q4.values()]
        for cap, br, warps, stages, parts in longs:
            for gate, down in ((IQ2_XXS, Q2_K), (Q4_K, Q4_K)):
                name = f"{cap}x{br}x{warps}" + (f"_s{stages}" if stages > 1 else "") + f"_p{parts}"
                report(f"moe_gateup_multi_t{gate}_{name}", W.moe_gateup_multi(gate, gate, D, F, cap, br, warps, True,
                                                                              stages, parts))
                report(f"moe_down_multi_t{down}_{name}", W.moe_down_multi(down, D, F, cap, br, warps, True, stages,
                                                                          parts))
        report(f"q8_dequant_f16_{Q.PARTS_BR}x{Q.PARTS_BK}", W.dequant_f16(D))
        from ds4trt.plugins.kernels import cuda_launch, moe_mma
        for nt, warps, *opt in args.moe_mma or [(cap // 8, w) for cap, w in moe_mma.WARPS.items()]:
            nib = bool(opt[0]) if opt else moe_mma.NIB
            fuse = bool(opt[1]) if len(opt) > 1 else moe_mma.FUSE.get(8 * nt, False)
            minb = opt[2] if len(opt) > 2 else moe_mma.MIN_BLOCKS.get(8 * nt, 1)
            wg_minb = opt[2] if len(opt) > 2 else moe_mma.WG_MIN_BLOCKS.get(8 * nt, 1)
            wg = cuda_launch.builds_sm90a() and warps % 4 == 0
            for name, arch, mb in (("moe_gateup_iq2", "sm_90", minb), ("moe_down_q2k", "sm_90", minb),
                                   *((("moe_gateup_iq2_wg", "sm_90a", wg_minb), ("moe_down_q2k_wg", "sm_90a", wg_minb))
                                     if wg else ())):
                cubin, _ = cuda_launch.compile_cubin(moe_mma.kernel(name, nt, warps, nib, fuse, mb), arch)
                label = f"{name}_cap{8 * nt}_{warps}w_minb{mb}" + (
                    (("_nib" if nib else "") + ("_fused" if fuse else "")) if name.startswith("moe_gateup") else "")
                rows.append((label, sm90.cubin_stats(cubin, label, moe_mma.smem_bytes(name, 8 * nt, nib),
                                                     innermost_mma=True, function=name)))
        for config in args.attend_config or [A.LONG_CONFIG]:
            report("attend_long_" + "x".join(map(str, config)), W.attend_long(config))
        for config in args.top_config or [A.TOP_CONFIG]:
            report("attend_top_" + "x".join(map(str, config)), W.attend_top(config))
    for T in args.q8_t:
        for config in args.q8 or [None]:                       # None: q8_matmul's launch (rows_config)
            for n, k in ((32768, 1024), (2048, 4096)):        # attn_q_b (no split at T = 1), ffn_gate_shexp (split K)
                br, warps, min_programs, pf, nb = Q.launch_fields(config or Q.rows_config(T, n, k))
                _, steps, splits = Q.row_launch(n, k, br, min_programs)
                report(f"q8_t{T}_{n}x{k}_{br}x{warps}_split{splits}" + ("_pf" if pf else "") + (f"_nb{nb}" if nb < 8
                                                                                                else ""),
                       W.q8_rows(k, br, warps, steps // splits, splits, T, N=n, pf=pf, nb=nb))
        for n, k in ((256, 4096), (2624, 4096), (8192, 1024)):  # the router, a ratio-4 layer's u group, indexer q_b
            br, bk = F16.launch_shape(n, k, T)
            report(f"f16_t{T}_{n}x{k}_{br}x{bk}", W.f16_rows(n, k, T, br, bk))
    from ds4trt.plugins.kernels import q8_mma as QM
    warps, mt, pf, _ = QM.CONFIG
    for nt, mt_, warps_, pf_ in args.q8_mma or [(1, mt, warps, pf), (2, mt, warps, pf)]:
        cubin, _ = QM.compile_cubin("sm_90", nt, mt_, warps_, bool(pf_))
        label = f"q8_mma_nt{nt}_{mt_}x{warps_}" + ("_pf" if pf_ else "")
        rows.append((label, sm90.cubin_stats(cubin, label, QM.smem_bytes(nt, QM.MAX_SPANS), innermost_mma=True)))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, label + ".sass"), "w") as f:
                f.write(sm90._cuobjdump(cubin, "-sass"))
    for keys, ks, ch in ((129, 4, 4), (2048, 8, 4)):     # attention's join: a window layer's decode, a verify of 4
        report(f"attend_join_{keys}", W.attend_join(keys, ks, ch))   # rows over their gathered top-k rows
    report("index_score_1025", W.index_score(1025))  # the indexer's scores of a decode step, 4096-token cache
    for n in (1025, 16384):                            # its top-k: that step, and the most scores it takes
        for warps in args.topk_warps:
            report(f"top_rows_{n}_{warps}w", W.top_rows(n, warps=warps), math=False)
    report("hc_post_dots (no update)", W.hc_post_dots(4, D, update=False))
    report("hc_combine", W.hc_combine(4, D))
    report("hc_post_dots", W.hc_post_dots(4, D))
    cols = ("regs", "spills", "shared", "instructions", "loop") + tuple(o for o in sm90.OPCODES
                                                                        if o not in ("STL", "LDL"))
    width = {c: max(6, len(c)) + 1 for c in cols}
    print(f"{'kernel':30s}" + "".join(f"{c:>{width[c]}s}" for c in cols))
    for label, st in rows:
        print(f"{label:30s}" + "".join(f"{st[c]:{width[c]}d}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
