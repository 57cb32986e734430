"""Compile Triton kernels for the H200 (sm_90) on a machine without a GPU, and read what ptxas made of them.

    activate()                                   # in a process where TRITON_INTERPRET is unset, before any .warmup
    k = kernel.warmup(*args, grid=(1,), **constexprs, num_warps=4)     # compiles, never runs
    sass_stats(k) -> {"regs": 127, "spills": 0, "instructions": 1936, "loop": 391, "FFMA": 352, "LDG": 78, ...}
    cubin_stats(cubin, name, shared) -> the same for a cubin compiled elsewhere (q8_mma's, by NVRTC)

activate() swaps Triton's active driver for a stand-in that answers sm_90; compilation then uses the ptxas
shipped in the triton wheel, and sass_stats disassembles the cubin with the wheel's cuobjdump. Used by the
offline compile check of tests/test_kernels.py and by scripts/sass_report.py (launch shapes, layouts, spills).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch

# SASS opcodes counted by sass_stats (prefix match: LDG counts LDG.E.U16, LDG.E.128, ...)
OPCODES = ("FFMA", "LDG", "LDS", "LDSM", "STS", "BAR", "SHFL", "STL", "LDL", "HGMMA", "HMMA")


def activate() -> None:
    """Make Triton compile for sm_90 with no GPU present (the process must not use the interpreter)."""
    if os.environ.get("TRITON_INTERPRET"):
        raise RuntimeError("sm90.activate(): unset TRITON_INTERPRET first (the interpreter compiles nothing)")
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class Sm90(DriverBase):
        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError

        def get_device_interface(self):
            raise NotImplementedError

        def get_empty_cache_for_benchmark(self):
            raise NotImplementedError

        def clear_cache(self, cache):
            pass

    driver.set_active(Sm90())


def _nvidia_tool(name: str) -> str:
    from triton.backends import nvidia
    return os.path.join(os.path.dirname(nvidia.__file__), "bin", name)


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_nvidia_tool("cuobjdump"), *flags, f.name], capture_output=True, text=True,
                              check=True).stdout


def sass(kernel) -> str:
    """The SASS of a compiled kernel (its cubin disassembled)."""
    return _cuobjdump(kernel.asm["cubin"], "-sass")


def loop_instructions(code: str, innermost_mma: bool = False) -> int:
    """Instructions in the longest loop body of a SASS listing: from the target of a backward branch to the branch
    (0 without one). Static counts over the whole kernel mix setup with the loop; this is what each step costs.
    innermost_mma: only loops holding a matrix instruction and no other loop (q8_mma's span loop, which ptxas places
    inside a branch back over the kernel's other loops)."""
    lines = re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+(.*)$", code, re.M)
    index = {int(a, 16): i for i, (a, _) in enumerate(lines)}
    loops = []
    for i, (at, text) in enumerate(lines):
        m = re.match(r"(?:@!?U?P\w+\s+)?BRA\S*\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < int(at, 16) and int(m.group(1), 16) in index:
            loops.append((index[int(m.group(1), 16)], i))
    if innermost_mma:
        loops = [(a, b) for a, b in loops if any("MMA" in t for _, t in lines[a:b + 1])
                 and not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return max((b - a + 1 for a, b in loops), default=0)


def sass_stats(kernel, math: bool = True) -> dict:
    """Registers per thread, spills (STL + LDL), shared memory bytes, instruction count, the longest loop's
    instruction count (loop_instructions) and OPCODES counts of a compiled Triton kernel. math: the kernel must hold
    FFMA or MMA instructions (False for integer-only kernels such as the top-k search)."""
    return cubin_stats(kernel.asm["cubin"], kernel.metadata.name, kernel.metadata.shared, math)


def cubin_stats(cubin: bytes, name: str, shared: int, math: bool = True, innermost_mma: bool = False,
                function: str | None = None) -> dict:
    """sass_stats of any cubin (the CUDA C++ kernels that NVRTC compiles, q8_mma, moe_mma); shared: its shared memory
    bytes, as the caller knows them (dynamic shared memory is not in the cubin); innermost_mma: "loop" counts the
    innermost loop with matrix instructions (loop_instructions); function: that kernel alone of a cubin that holds
    several."""
    code = _cuobjdump(cubin, "-res-usage", "-sass", *(("-fun", function) if function else ()))   # resources, SASS
    if math and "FFMA" not in code and "MMA" not in code:
        raise RuntimeError(f"sm90.sass_stats: no FFMA/MMA in the disassembly of {name}")
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", code, re.M)
    regs = re.search(r"REG:(\d+)", code)
    out = dict(regs=int(regs.group(1)) if regs else -1, shared=shared, instructions=len(ops),
               loop=loop_instructions(code, innermost_mma))
    for op in OPCODES:
        out[op] = sum(1 for o in ops if o == op or o.startswith(op + "."))
    out["spills"] = out["STL"] + out["LDL"]
    return out
