"""Compile-only calls of the package's Triton kernels: Triton's `.warmup` with stand-in tensors (nothing runs), for
the checks that compile the kernels for a GPU this machine may lack (scripts/sass_report.py, tests/test_kernels.py's
offline sm_90 check). One function per kernel taking what shapes its code (widths, block types, launch shape), so
that a kernel's argument list is spelled out here once. Each returns the compiled kernel (.asm, .metadata).

    sm90.activate()                                  # first, where there is no GPU
    from ds4trt.testing import warmups
    k = warmups.q8_rows(K=4096, br=16, warps=4, steps=2, splits=8, T=1)

Integer arguments get realistic values: Triton specializes a kernel on whether an integer is 1 or a multiple of 16.
Every kernel is compiled with PDL=True, as it is launched on sm_90 (plugins/kernels/pdl.py).
"""

from __future__ import annotations

import torch

from ds4trt.plugins.kernels import attn_triton, commit_triton, f16_triton, hc_triton, index_triton, moe_triton, parts, \
    q8_triton, rope_triton, route_triton, rows_triton, topk_triton

U8, F16, F32 = torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.float16), torch.empty(64)
F64 = torch.empty(64, dtype=torch.float64)
I64, I32, I16 = (torch.empty(8, dtype=t) for t in (torch.int64, torch.int32, torch.int16))
SPLIT = (F16, F16, F16, F16, F32)           # moe_triton.split_runs: hi, lo, shi, slo, inv
M = moe_triton
LAUNCH = dict(PDL=True, grid=(1,))


def _expert_bytes(t: int, rows: int, cols: int) -> int:
    return rows * cols // 256 * M.LAYOUT[t][0]


def _reg(maxnreg: int | None) -> dict:
    return {"maxnreg": maxnreg} if maxnreg else {}


def moe_prepare(P: int, D: int):
    return M._moe_prepare.warmup(I64, I32, I32, P, F32, I32, 16, F32, F32, 10.0, ITEM_CAP=16, MIN_PAIRS=M.MULTI_MIN,
                                 PB=max(16, 1 << (P - 1).bit_length()), D=D, F=D // 2, num_warps=4, **LAUNCH)


def split_runs():
    return M._split_runs.warmup(F32, F16, F16, F16, F16, F32, 4096, CB=M.SPLIT_CHUNKS, num_warps=4, **LAUNCH)


def moe_gateup_single(gate: int, up: int, down: int, D: int, F: int, br: int, warps: int, prefetch: bool,
                      compact: bool = False, maxnreg: int | None = None):
    return M._moe_gateup_single.warmup(
        F32, I64, F32, I32, I32, I32, U8, U8, F32, I16, U8, I32, I32, 6, F, _expert_bytes(gate, F, D),
        _expert_bytes(up, F, D), 10.0, M.ONE_BITS, NSB=D // 256, GT=gate, UT=up, BR=br, GPF=prefetch, UPF=prefetch,
        QD=down == M.Q2_K, COMPACT=compact, num_warps=warps, **LAUNCH, **_reg(maxnreg))


def moe_down_single(down: int, D: int, F: int, br: int, warps: int, prefetch: bool, compact: bool = False,
                    maxnreg: int | None = None, shared: bool = False):
    """shared: with the shared expert's down programs (moe_forward's `shared`)"""
    return M._moe_down_single.warmup(
        F32, I64, I32, I32, I32, U8, F32, I16, U8, D, _expert_bytes(down, D, F), M.ONE_BITS, U8, F16, F32, 6,
        NSB=F // 256, DT=down, BR=br, DPF=prefetch, COMPACT=compact, SH=shared, SBR=M.SHARED_BR, num_warps=warps,
        **LAUNCH, **_reg(maxnreg))


def moe_gateup_multi(gate: int, up: int, D: int, F: int, cap: int, br: int, warps: int, compact: bool, stages: int,
                     parts: int = 2):
    (gbs, gns, gl), (ubs, uns, ul) = M.LAYOUT[gate], M.LAYOUT[up]
    return M._moe_gateup_multi.warmup(
        *SPLIT, I64, F32, I32, I32, I32, U8, U8, F32, I32, 6, F, _expert_bytes(gate, F, D), _expert_bytes(up, F, D),
        10.0, NSB=D // 256, GT=gate, GBS=gbs, GNS=gns, GL=gl, UT=up, UBS=ubs, UNS=uns, UL=ul, BR=br, CAP=cap,
        COMPACT=compact, GATE_THEN_UP=compact, LO=parts == 2, num_warps=warps, num_stages=stages, **LAUNCH)


def moe_down_multi(down: int, D: int, F: int, cap: int, br: int, warps: int, compact: bool, stages: int,
                   parts: int = 2):
    dbs, dns, dl = M.LAYOUT[down]
    return M._moe_down_multi.warmup(
        *SPLIT, I64, I32, I32, I32, U8, F32, I32, D, _expert_bytes(down, D, F), NSB=F // 256, DT=down, DBS=dbs,
        DNS=dns, DL=dl, BR=br, CAP=cap, COMPACT=compact, LO=parts == 2, num_warps=warps, num_stages=stages,
        **LAUNCH)


def dequant_rows(t: int):
    bs, ns, l = M.LAYOUT[t]
    return M._dequant_rows.warmup(U8, F32, 96, 4096, I16, U8, TYPE=t, BS=bs, NS=ns, L=l, BR=16, **LAUNCH)


def q8_rows(K: int, br: int, warps: int, steps: int, splits: int, T: int, N: int = 4096, pf: bool = False,
            nb: int = q8_triton.NB_STEP):
    return q8_triton._q8_rows.warmup(F32, U8, F16, F32, F32, I32, N, N, q8_triton.ONE_BITS, K=K, BR=br, STEPS=steps,
                                     SPLITS=splits, TP=T, PF=pf, NB=nb, num_warps=warps, **LAUNCH)


def dequant_f16(K: int, N: int = 4096):
    return q8_triton._dequant_f16.warmup(U8, F16, F16, N, 0.5, K=K, BR=q8_triton.PARTS_BR, BK=q8_triton.PARTS_BK,
                                         num_warps=q8_triton.PARTS_WARPS, **LAUNCH)


def head_norm_rope(H: int, D: int, NR: int):
    R = rope_triton
    return R._head_norm_rope.warmup(F32, F32, F32, F32, F32, H, 1e-6, D=D, DP=1 << (D - 1).bit_length(), NR=NR,
                                    NP=1 << (NR // 2 - 1).bit_length(), HB=R.HEADS, SCALED=False, num_warps=R.WARPS,
                                    **LAUNCH)


def split_f16():
    return parts._split_f16.warmup(F32, F16, F16, 1 << 20, B=parts.SPLIT_BLOCK, num_warps=4, grid=(1,))


def x_f16(GK: int):
    """the prefill projections' input rounding (no PDL)"""
    return q8_triton._x_f16.warmup(F32, F16, F32, 2048, GK=GK, BT=q8_triton.X_F16_BT, BK=q8_triton.X_F16_BK,
                                   num_warps=q8_triton.PARTS_WARPS, grid=(1,))


def top_rows(N: int, k: int = 512, warps: int = 8):
    return topk_triton._top_rows.warmup(F32, I64, N, K=k, NP=1 << (N - 1).bit_length(), num_warps=warps, **LAUNCH)


def commit_rows(maxw: int = 1024):
    return commit_triton._commit_rows.warmup(I64, I64, MAXW=maxw, num_warps=4, **LAUNCH)


def route_rows(E: int = 256, k: int = 6):
    return route_triton._route_rows.warmup(F32, F32, I64, F32, 1.5, 6e-5, E=E, EP=1 << (E - 1).bit_length(), K=k,
                                           KP=1 << (k - 1).bit_length(), num_warps=1, **LAUNCH)


def f16_rows(N: int, K: int, T: int, br: int, bk: int):
    return f16_triton._f16_rows.warmup(F32, F16, F32, N, K, K=K, BR=br, BK=bk, TP=T, num_warps=4, **LAUNCH)


def index_score(keys: int = 513, heads: int = 64, di: int = 128):
    kb, warps, precision = index_triton.CONFIG
    return index_triton._index_score.warmup(F32, F32, F32, F32, keys, heads, NHP=max(16, heads), DI=di, KB=kb,
                                            PRECISION=precision, num_warps=warps, **LAUNCH)


def kv_row(C: int = 512, NR: int = 64, n_nope: int = 448):
    """kva read in place from attention's q_a + kv output (rows 1536 values apart)"""
    K = rows_triton
    return K._kv_row.warmup(F32, 1536, F32, F32, F32, F32, 1e-6, C=C, NR=NR, POST=1, NOPE=n_nope,
                            NB=K._fp8_blocks(n_nope), num_warps=4, **LAUNCH)


def compress_emit(R: int, C: int, NR: int, post: str, n_nope: int):
    """kv read in place from a ratio-4 layer's F16 projections' output (rows 2624 values apart), score contiguous"""
    K = rows_triton
    coff = 2 if R == 4 else 1
    return K._compress_emit.warmup(F32, 2624, F32, coff * C, F32, F32, I64, F32, F64, F32, 1e-6,
                                   **K.emit_constexprs(R, coff, C, NR, post, n_nope), num_warps=K.WARPS,
                                   **LAUNCH)


def index_score_long(bn: int, tb: int, warps: int, NH: int = 64, DI: int = 128):
    """the prefill kernel (no PDL)"""
    return index_triton._index_score_long.warmup(F32, F16, F16, F16, F16, F32, 2048, 1553, NH, NHP=NH, DI=DI, BN=bn,
                                                 TB=tb, num_warps=warps, grid=(1,))


def attend_part(K: int, ks: int, ch: int, warps: int, H: int = 64, D: int = 512):
    return attn_triton._attend_part.warmup(F32, F32, U8, F32, F32, F32, 0.04, K=K, H=H, D=D, DP=D, KS=ks, CH=ch,
                                           NS=-(-K // (ks * ch)), num_warps=warps, **LAUNCH)


def attend_join(K: int, ks: int, ch: int, H: int = 64, D: int = 512, NR: int = 64):
    ns = -(-K // (ks * ch))
    return attn_triton._attend_join.warmup(F32, F32, F32, F32, F32, F32, F32, H=H, D=D, NR=NR, NS=ns,
                                           NSP=1 << (ns - 1).bit_length(), DB=attn_triton.DB, num_warps=4, **LAUNCH)


def attend_long(config: tuple[int, ...], H: int = 64, D: int = 512):
    """_attend_long at a LONG_CONFIG-style config (BT, HB, BN, DC, DV, warps, stages, parts); the prefill kernel has no
    PDL."""
    bt, hb, bn, dc, dv, warps, stages, parts = config
    return attn_triton._attend_long.warmup(F16, F16, F16, F16, U8, F32, F32, F32, F32, 0.04, 256, 2048, H=H, D=D,
                                           NR=D // 8, BT=bt, HB=hb, BN=bn, DC=dc, DV=dv, PARTS=parts,
                                           num_warps=warps, num_stages=stages, grid=(1,))


def attend_top(config: tuple[int, ...], H: int = 64, D: int = 512, k: int = 512):
    """_attend_top at a TOP_CONFIG-style config (HB, BN, DC, DV, warps, stages, parts) and k top rows; no PDL."""
    hb, bn, dc, dv, warps, stages, parts = config
    return attn_triton._attend_top.warmup(F16, F16, F16, F16, U8, F16, F16, I64, U8, F32, F32, F32, F32, 0.04, 2175,
                                          H=H, D=D, NR=D // 8, NT=k, HB=hb, M=max(hb, 16), BN=bn, DC=dc, DV=dv,
                                          PARTS=parts, num_warps=warps, num_stages=stages, grid=(1,))


def hc_post_dots(S: int, D: int, update: bool = True):
    """with the update of a decode step's FFN output (J = 7 terms), or without (the first block's reduction)"""
    H = hc_triton
    dc, db = H.post_dots_shape(S, D)
    return H._hc_post_dots.warmup(F32, F32, F32, F32, F32, F32, F32, S=S, D=D, MP=32, SPLITS=H.SPLITS, DC=dc, DB=db,
                                  J=7 if update else 1, UPDATE=update, num_warps=4, **LAUNCH)


def hc_dots_long(S: int, D: int, bt: int, bk: int, splits: int, warps: int):
    """the prefill kernel (no PDL)"""
    H = hc_triton
    return H._hc_dots_long.warmup(F32, F32, F32, 2048, S=S, D=D, MP=32, SPLITS=splits,
                                  KC=-(-S * D // splits // bk) * bk, BT=bt, BK=bk, num_warps=warps, grid=(1,))


def hc_post(S: int, D: int):
    """the prefill kernel (no PDL)"""
    return hc_triton._hc_post.warmup(F32, F32, F32, F32, F32, S=S, D=D, DB=1024, num_warps=4, grid=(1,))


def hc_combine(S: int, D: int):
    H = hc_triton
    return H._hc_combine.warmup(F32, F32, F32, F32, F32, F32, F32, F32, F32, F32, 1e-6, 1e-6, ITERS=20, S=S, D=D,
                                MP=32, SPLITS=H.SPLITS, DY=H.DY, NORM=True, num_warps=1, **LAUNCH)
