"""One 128-bit global load per thread and element: four consecutive 32-bit words that Triton would load with four
scalar instructions (it does not merge separate tl.load calls, and one [..., 4] tile split in registers costs layout
conversions through shared memory in the kernels that tried it).

    a, b, c, d = ld4(ptr)        # ptr: a tensor of int32 pointers, each 16-byte aligned -> four int32 tensors

On the GPU it is inline PTX (ld.global.nc.v4.b32: the kernels call it only on tensors that no kernel writes while
they run); under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) four tl.load calls.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def ld4(ptr):
    """The four int32 words at ptr (16-byte aligned)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        return tl.load(ptr), tl.load(ptr + 1), tl.load(ptr + 2), tl.load(ptr + 3)
