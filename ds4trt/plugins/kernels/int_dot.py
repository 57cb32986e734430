"""Integer dot products on activations stored as exact integers (the one-pair MoE kernels of moe_triton), and the
float rounding helper the kernels share.

An activation run of 8 values with largest magnitude amax becomes u = amax / (127 XQ_LO), h = rint(x / (XQ_LO u)) in
[-127, 127] and l = rint(x / u - XQ_LO h) in [-XQ_LO/2, XQ_LO/2], so that x = u (XQ_LO h + l) to within u / 2
(2^-19 of amax; ds4 itself uses 8-bit activations, spec ds4_architecture.md §3.0). Weights held as signed bytes then
dot with h by dp4a and with l by dp2a (16-bit halves times bytes): the run's sum XQ_LO * sum(q h) + sum(q l) is exact
in int32 and becomes float once, times u.

    rint(y)                    y to the nearest integer, ties to even (|y| < 2^22)
    quant_values(x [R, L])     -> h, l int32 [R, L], u float32 [R]  (the scheme above, per row of x)
    int_words(v [R, W * 32 / BITS] int32, W, BITS) -> [R, W]: the low BITS bits of consecutive values packed
                               little-endian into words (h: BITS = 8, four per word; l: BITS = 16, two per word)
    dp4a(a, b, c)              c + the four signed bytes of a times those of b
    dp2a(a, b, c, HI)          c + the two signed 16-bit halves of a times signed bytes 0, 1 (HI: 2, 3) of b

dp4a and dp2a are inline PTX on a GPU; under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) the same
functions compute them with integer tensor operations.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
XQ_LO = tl.constexpr(2048)   # x = u (XQ_LO h + l), h int8, |l| <= XQ_LO / 2


@triton.jit
def rint(y):
    """y rounded to the nearest integer (ties to even), |y| < 2^22."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def quant_values(x):
    """x float32 [R, L] -> (h, l) int32 [R, L] and u float32 [R] with x = u (XQ_LO h + l) to within u / 2 per row;
    a row of zeros gives h = l = u = 0."""
    amax = tl.max(tl.abs(x), axis=1)
    y = tl.where(amax[:, None] > 0, x / tl.maximum(amax, 1e-30)[:, None], 0.0) * 127.0      # |y| <= 127
    h = rint(y)
    lo = rint((y - h) * XQ_LO).to(tl.int32)
    return h.to(tl.int32), lo, amax * (1.0 / (127.0 * XQ_LO))


@triton.jit
def int_words(v, W: tl.constexpr, BITS: tl.constexpr):
    """v int32 [R, W * 32 / BITS] -> int32 [R, W]: word w holds values w * 32 / BITS.. in its BITS-bit fields, the
    first in the low bits."""
    PER: tl.constexpr = 32 // BITS
    fields = tl.reshape(v & ((1 << BITS) - 1), (v.shape[0], W, PER))
    return tl.sum(fields << (BITS * tl.arange(0, PER))[None, None, :], axis=2)


@triton.jit
def dp4a(a, b, c):
    """c + the sum of the products of the four signed bytes of a and of b (int32 tensors)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            c += ((a << (24 - 8 * k)) >> 24) * ((b << (24 - 8 * k)) >> 24)
        return c


@triton.jit
def dp2a(a, b, c, HI: tl.constexpr):
    """c + the two signed 16-bit halves of a times signed bytes 0, 1 (HI: 2, 3) of b (int32 tensors)."""
    if ASM:
        if HI:
            return tl.inline_asm_elementwise("dp2a.hi.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp2a.lo.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(2):
            bk: tl.constexpr = 2 * HI + k
            c += ((a << (16 - 16 * k)) >> 16) * ((b << (24 - 8 * bk)) >> 24)
        return c
