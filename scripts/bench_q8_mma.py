#!/usr/bin/env python3
"""Is a tensor-core Q8_0 product faster than q8_matmul's FMA loop at T = 2..4 rows of x (verify steps)? A stripped-down
kernel timed against q8_matmul on Flash's projection shapes on the H200:

    python3 scripts/bench_q8_mma.py [--t 2,3,4] [--rows 64] [--warps 4] [--splits 1,2,4]

q8_matmul at T >= 2 makes each weight d * q once and spends T FMAs on it, and costs 1.5-2x its T = 1 time for the
same bytes (BENCHMARKS.md, twenty-seventh session). Here, per program of BR rows and a K range (split over `splits`
programs, partial sums added by torch afterwards: a bound, not the product's epilogue): for each block of 32 values,
its quants (offset binary u = q + 128, 32 contiguous bytes per row) become exact fp16 values, x's 32 values (T rows
padded to 16, as two fp16 parts after a power-of-two scaling per row: x * 2^-e = hi + lo to 2^-22) form the other
operand, two tensor-core products give the block's sums for every row of x in float32, and the block scale d is applied
to them in the accumulator. The weights are read in plain row order ([N, KP] quants, [N, KP / 32] scales: split_q8's
quants with each span's words swapped back, the same bytes); the product would need that layout too.
Checks each output against float64 (1e-5 of the largest |value|, the kernels' tolerance) before timing; prints per
shape and T the time of both (the kernel alone: x's split and the splits' sum are left out) and the copy-bandwidth
floor of the weight bytes. Without a GPU, TRITON_INTERPRET=1 ... --shapes 0 runs the check on a small shape.
Two forms: "block" (_q8_mma) makes one product per 32-value block ([rows, 32] x [32, 16]), "bd" (_q8_mma_bd) one per
256 values, x put block-diagonally into [256, 8 x T padded to 2 or 4] so that a product gives the 8 blocks' sums at
once.
Offline sm_90 (ptxas, thirty-second session), per loop step at 64 rows x 4 warps: block 48 registers, 138 instructions
per 32 values (16 weights a thread: ~8.6 per weight, about the FMA loop's at T = 3, 275 per 32); bd 168 registers,
560 / 587 instructions per 256 values at T = 2 / 4 (128 weights a thread: ~4.5 per weight), no spills in either.
H200 (thirty-third session, BENCHMARKS.md): neither form beats q8_matmul but bd at 4 K splits on attn_q_b at T = 3 / 4
(19.4 against 21.1 us, before the splits' sum), so a tensor-core Q8_0 product kernel was not built.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import copy_bandwidth, time_graph  # noqa: E402

from ds4trt.plugins.kernels import q8_triton as Q  # noqa: E402
from ds4trt.plugins.kernels.parts import split_parts  # noqa: E402

# (name, N, K) of Flash's Q8_0 projections that verify steps read: attn_q_b, attn_output_b, the shared gate
SHAPES = (("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192), ("ffn_gate_shexp", 2048, 4096))
TP = 16                     # rows of x per tensor-core product (T padded)


@triton.jit
def _q8_mma(xh_ptr, xl_ptr, xinv_ptr, q_ptr, d_ptr, out_ptr, N, KP: tl.constexpr, KS: tl.constexpr,
            BR: tl.constexpr, TP: tl.constexpr):
    """out[split, t, rows] = sum over this split's blocks of d * (q . x[t]) for the BR rows of program 0's tile."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    split = tl.program_id(1)
    k32 = tl.arange(0, 32)
    t = tl.arange(0, TP)
    acc = tl.zeros([BR, TP], tl.float32)
    for b in range(0, KS // 32):
        blk = split * (KS // 32) + b
        k0 = blk * 32
        u = tl.load(q_ptr + rows[:, None].to(tl.int64) * KP + k0 + k32[None, :])             # [BR, 32] uint8
        q = u.to(tl.float16) - 128.0                                                          # exact
        xo = t[None, :] * KP + k0 + k32[:, None]                                             # [32, TP]
        p = tl.dot(q, tl.load(xh_ptr + xo)) + tl.dot(q, tl.load(xl_ptr + xo))
        d = tl.load(d_ptr + rows.to(tl.int64) * (KP // 32) + blk).to(tl.float32)
        acc += d[:, None] * p
    inv = tl.load(xinv_ptr + t)
    tl.store(out_ptr + split * TP * N + t[None, :] * N + rows[:, None], acc * inv[None, :])


@triton.jit
def _q8_mma_bd(xh_ptr, xl_ptr, xinv_ptr, q_ptr, d_ptr, out_ptr, N, KP: tl.constexpr, KS: tl.constexpr,
               BR: tl.constexpr, TB: tl.constexpr):
    """The same sums with one product per 256 values (8 blocks): x's 256 values put block-diagonally into [256, 8 * TB]
    (column (b, t) holds row t of x on block b's 32 values, zeros elsewhere: the tensor cores have time to spare), so
    the product gives every block's sums at once; the 8 block scales then weight them and the blocks are added."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    split = tl.program_id(1)
    k = tl.arange(0, 256)
    t = tl.arange(0, TB)
    c = tl.arange(0, 8 * TB)                                                                 # column (b, t)
    diag = (k // 32)[:, None] == (c // TB)[None, :]                                          # [256, 8 * TB]
    acc = tl.zeros([BR, TB], tl.float32)
    for s in range(0, KS // 256):
        k0 = (split * (KS // 256) + s) * 256
        u = tl.load(q_ptr + rows[:, None].to(tl.int64) * KP + k0 + k[None, :])               # [BR, 256] uint8
        q = u.to(tl.float16) - 128.0                                                          # exact
        xo = (c % TB)[None, :] * KP + k0 + k[:, None]                                        # [256, 8 * TB]
        xh = tl.load(xh_ptr + xo, mask=diag, other=0.0)
        xl = tl.load(xl_ptr + xo, mask=diag, other=0.0)
        p = tl.reshape(tl.dot(q, xh) + tl.dot(q, xl), (BR, 8, TB))
        d = tl.load(d_ptr + rows[:, None].to(tl.int64) * (KP // 32) + k0 // 32 + tl.arange(0, 8)[None, :])
        acc += tl.sum(d.to(tl.float32)[:, :, None] * p, axis=1)
    inv = tl.load(xinv_ptr + t)
    tl.store(out_ptr + split * TB * N + t[None, :] * N + rows[:, None], acc * inv[None, :])


def split_x(x: torch.Tensor, KP: int, TP: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [T, K] -> hi, lo fp16 [TP, KP] (zero rows and columns past T and K), inv float32 [TP]: per row a
    power-of-two scale s with |x * s| < 1, x * s = hi + lo to 2^-22 of the row's largest |x|, inv = 1 / s."""
    T, K = x.shape
    e = torch.frexp(x.abs().amax(dim=1).clamp_min(2.0 ** -100))[1].to(torch.float32)        # |x| < 2^e
    s = torch.exp2(-e)
    xs = torch.zeros(TP, KP, device=x.device)
    xs[:T, :K] = x * s[:, None]
    hi, lo = split_parts(xs)
    inv = torch.ones(TP, device=x.device)
    inv[:T] = 1 / s
    return hi, lo, inv


def q8_mma(x, quants_plain, scales, rows: int, warps: int, splits: int, form: str):
    """(launch: a closure of the kernel alone, result: the [T, N] output once launched) for x float32 [T, K]; form
    "block" (_q8_mma) or "bd" (_q8_mma_bd)."""
    N, KP = quants_plain.shape
    T = x.shape[0]
    tp = TP if form == "block" else max(2, triton.next_power_of_2(T))
    hi, lo, inv = split_x(x, KP, tp)
    out = torch.empty(splits, tp, N, device=x.device)
    kernel, extra = (_q8_mma, dict(TP=tp)) if form == "block" else (_q8_mma_bd, dict(TB=tp))

    def launch():
        kernel[(N // rows, splits)](hi, lo, inv, quants_plain, scales, out, N, KP=KP, KS=KP // splits, BR=rows,
                                    num_warps=warps, **extra)
    return launch, lambda: out.sum(0)[:T]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--t", default="2,3,4")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--forms", default="block,bd", help="block: a product per 32-value block; bd: one per 256 values "
                                                        "(x block-diagonal)")
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes (tests: 0 = a small one)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(3)
    bw = copy_bandwidth() if dev == "cuda" else None
    shapes = SHAPES[:args.shapes] if args.shapes else (("small", 128, 512),)
    for name, N, K in shapes:
        blocks = torch.randint(0, 256, (N, K // 32, 34), dtype=torch.uint8, device=dev, generator=gen)
        blocks[..., :2] = (torch.rand(N, K // 32, device=dev, generator=gen) * 0.02 + 0.001).to(
            torch.float16).view(torch.uint8).view(N, K // 32, 2)
        quants, scales = Q.split_q8(blocks.view(N, -1), N, K)
        plain = Q._swap_words(quants)                    # value order (the swap is its own inverse)
        w = Q.dequantize(quants, scales, K).double()     # exact
        for T in (int(t) for t in args.t.split(",")):
            x = torch.randn(T, K, device=dev, generator=gen) * 3
            want = x.double() @ w.T
            base = Q.q8_matmul(x, quants, scales, K)
            line = f"{name:15s} T={T}"
            if bw is not None:
                line += (f"  floor {quants.numel() * 34 / 32 / bw * 1e6:6.2f} us  q8_matmul "
                         f"{time_graph(lambda: Q.q8_matmul(x, quants, scales, K), 1) * 1e3:7.2f} us")
            for form in args.forms.split(","):
                for splits in (int(s) for s in args.splits.split(",")):
                    if (quants.shape[1] // splits) % (256 if form == "bd" else 32):
                        continue                                   # bd steps over 256 values
                    launch, result = q8_mma(x, plain, scales, args.rows, args.warps, splits, form)
                    launch()
                    err = float((result().double() - want).abs().max() / want.abs().max())
                    if err > 1e-5:
                        berr = float((base.double() - want).abs().max() / want.abs().max())
                        print(f"{line}: {form} splits {splits}: relative error {err:.2e} (q8_matmul {berr:.2e}): WRONG")
                        return 1
                    line += f"  {form}/{splits} {err:.1e}"
                    if bw is not None:
                        line += f" {time_graph(launch, 1) * 1e3:7.2f} us"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
