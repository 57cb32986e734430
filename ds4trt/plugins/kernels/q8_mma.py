"""Q8_0 matrix products on the tensor cores (q8_mma.cu, CUDA C++ compiled at run time by NVRTC) for T = 1..16 rows
of x: the same contract as q8_triton.q8_matmul, on split_q8's arrays.

    q8_mma_matmul(x [T, G*K] f32, quants, scales, K, groups=G, out=None, config=None) -> out [T, N] float32
    launch(x, quants, scales, K, groups, out, config=None) -> out    # arguments q8_triton.call_operands checked
    compile_cubin(arch, nt, mt, warps, pf, ptxas_verbose=False) -> (cubin bytes, NVRTC log)    # no GPU needed

Why: _q8_rows (q8_triton) multiplies on the FMA units, 4 FFMA per weight word and row of x on top of each word's
decode, so at T >= 2 it is bound by instruction issue rather than by the weight bytes (BENCHMARKS.md: attn_q_b 11.8 us
at T = 1, 21.1 at T = 3, against a floor of 8.3; the verify step of 2 drafts spends 4.6 ms in it against 2.4 at T =
1). Here one mma.sync.m16n8k16 does 16 rows x 16 values x 8 rows of x, so a word costs 2 byte permutes and 2 packed
subtractions whatever T is (up to 8; 16 with two x tiles), and the weights reach the fragments as they were loaded
(q8_mma.cu's header has the layout). Numerics: the products are exact (q x float16 parts of x / s), summed in float32
by the tensor cores and the block scales applied in float32: ~1e-6 relative, inside the 1e-5 of the float32 kernels.

q8_triton.q8_matmul sends a call here where it was measured faster (`use_mma`, `faster`; DS4_Q8_MMA=auto, the
default): every product of 2 or more rows (verify steps, prefill chunks of up to 16 tokens); decode steps (T = 1) keep
_q8_rows.
Built and launched by cuda_launch (NVRTC, the CUDA driver on PyTorch's current stream). Triton is imported only by the
launching functions (q8_triton's layout helpers and counters, pdl.py), so that compile_cubin runs where only NVRTC is
installed (the offline check).
"""

from __future__ import annotations

import ctypes
import os

import torch

from ds4trt.plugins.kernels import cuda_launch

MAX_T = 16                   # two x tiles of 8 rows
SPAN = 256                   # values of a span: split_q8's 8 interleaved blocks (q8_triton.SPAN, q8_mma.cu's SPAN)
MAX_SPANS = 4                # spans of 256 values a program converts into shared memory (K is split to reach it)
HI_BYTES = 0x64646464       # the kernel's last argument (q8_mma.cu says why it is not a literal there)
# (warps, 16-row tiles per warp, prefetch, min programs): the launch of every call. Offline for sm_90 (python3
# scripts/sass_report.py --q8-t 1 3 --q8-mma 1:2:4:0 2:2:4:0 1:2:4:1 1:4:4:0): 125 registers, 539 SASS instructions a
# span (a lane's 256 weight bytes: 2.1 a byte at any T <= 8, 2.6 with two x tiles: 171 registers, 659), where
# _q8_rows' loop step takes 333 for 64 bytes at T = 1 (5.2 a byte) and 277 for 32 at T = 3 (8.7); with prefetch
# (1:2:4:1) 250 registers; 4 tiles a warp (1:4:4:0) 255 and spills. The sweep (bench_kernels --cases q8_mma, H100,
# 2026-12-05) put 264 min programs (fewer K splits) ahead of 528 on every 32 MB projection at T = 1 / 3 / 9, e.g.
# attn_output_a 18.0 / 19.6 / 33.7 us against 20.1 / 22.4 / 43.3; the LM head the same (206 / 218 / 376).
CONFIG = (4, 2, False, 264)
# the launches bench_kernels' case q8_mma times against CONFIG (each compiles for sm_90 without spills at NT = 1, 2;
# (8, 1, False, ...) does not: ptxas gives it 80 registers and a 16-byte stack frame)
SWEEP = ((4, 1, False, 264), (4, 1, False, 528), (8, 2, False, 264), (2, 2, False, 264), (4, 2, False, 528),
         (4, 2, False, 132), (8, 2, False, 528))

# DS4_Q8_MMA when unset: where it was measured faster. Its GPU tests (tests/test_q8_mma.py: every launch against
# float64, Flash widths, the graph replay, the dispatch) passed on an H100 (BENCHMARKS.md, the forty-second session).
DEFAULT_MODE = "auto"


def use_mma(x: torch.Tensor, N: int, groups: int) -> bool:
    """Whether q8_matmul sends x's rows here: a CUDA tensor on a GPU the kernel runs on (cuda_launch.runs_on),
    T <= MAX_T, groups of whole 16-row tiles (N rows in `groups` groups), and DS4_Q8_MMA (else DEFAULT_MODE): "auto",
    the T where it was measured faster than _q8_rows (`faster`); "1", every such call; "0", none."""
    mode = os.environ.get("DS4_Q8_MMA", DEFAULT_MODE)
    return (mode in ("auto", "1") and x.is_cuda and x.shape[0] <= MAX_T and (N // groups) % 16 == 0
            and (mode == "1" or faster(x.shape[0])) and cuda_launch.runs_on(x.device))


def faster(T: int) -> bool:
    """Where this kernel beats _q8_rows: from 2 rows of x on, at every Flash shape (`python3 scripts/bench_kernels.py
    --cases q8_mma --sweep-t 1,2,3,4`, H100, 2026-12-07, us, q8_mma against _q8_rows at T = 2 / 3 / 4: attn_q_b 17.0 /
    17.9 / 18.6 against 17.9 / 22.2 / 23.8, attn_q_a 5.6 / 7.1 / 6.8 against 6.4 / 8.2 / 8.4, the shared expert's
    down 7.1 / 7.6 / 8.0 against 8.1 / 8.9 / 9.3, attn_output_a 17.5 / 18.3 / 18.9 against 22.7 / 26.8 / 28.4; the one
    exception, attn_kv alone at T = 2, 5.2 against 4.8, never runs alone: LinearGroup joins it to attn_q_a); not at
    T = 1 (attn_q_b 16.2 against 13.3, attn_output_b 17.1 against 14.7). Until then the narrower projections (N or K
    under 4096) kept _q8_rows up to T = 4 (BENCHMARKS.md, the forty-second session)."""
    return T >= 2


def launch_config(N: int, groups: int) -> tuple:
    """CONFIG, its row tile (warps x tiles x 16 rows) halved, tiles first, until it divides a group's rows."""
    warps, mt, pf, min_programs = CONFIG
    while groups > 1 and (N // groups) % (warps * mt * 16):
        if warps * mt == 1:
            raise ValueError(f"q8_mma_matmul: {N // groups} rows per group is not a multiple of 16")
        mt, warps = (mt // 2, warps) if mt > 1 else (mt, warps // 2)
    return warps, mt, pf, min_programs


def kernel(nt: int, mt: int, warps: int, pf: bool) -> cuda_launch.Kernel:
    """q8_mma.cu with NT = nt x tiles, MT = mt row tiles per warp, `warps` warps and PF = pf."""
    return cuda_launch.Kernel("q8_mma.cu", "q8_mma", (("NT", nt), ("MT", mt), ("WARPS", warps), ("PF", int(pf))))


def compile_cubin(arch: str, nt: int, mt: int, warps: int, pf: bool, ptxas_verbose: bool = False) -> tuple[bytes, str]:
    """kernel(nt, mt, warps, pf) for arch ("sm_90") -> (cubin, NVRTC's log; with ptxas_verbose it holds ptxas'
    registers / spills line). Raises RuntimeError with the log."""
    return cuda_launch.compile_cubin(kernel(nt, mt, warps, pf), arch, ptxas_verbose)


def smem_bytes(nt: int, spans: int) -> int:
    """Dynamic shared memory of a program: 8 * nt x rows of spans * 1024 + 64 bytes, their scales and a flag."""
    return 8 * nt * (spans * 1024 + 64) + 8 * nt * 4 + 16


def mma_launch(N: int, K: int, rows: int, min_programs: int) -> tuple[int, int, int]:
    """(row tiles, spans per program, K splits) for an [N, K] weight at `rows` rows per program: the fewest splits
    (a divisor of the spans) leaving at most MAX_SPANS spans per program and at least min_programs programs, else
    the most (one span each)."""
    tiles, total = -(-N // rows), -(-K // SPAN)
    ok = [s for s in range(1, total + 1) if total % s == 0 and total // s <= MAX_SPANS]
    splits = next((s for s in ok if tiles * s >= min_programs), ok[-1])
    return tiles, total // splits, splits


def q8_mma_matmul(x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, K: int, groups: int = 1, *,
                  out: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """x: float32 [T, groups*K], 1 <= T <= 16, on a CUDA device; quants, scales: split_q8 of an [N, K] weight ->
    [T, N] (written into `out` when given). config: (warps, row tiles per warp, prefetch, min programs), else
    launch_config's."""
    from ds4trt.plugins.kernels import q8_triton

    if not x.is_cuda:
        raise ValueError("q8_mma_matmul: x and the weight must be on one CUDA device")
    x, quants, scales, out = q8_triton.call_operands("q8_mma_matmul", x, quants, scales, K, groups, out)
    return launch(x, quants, scales, K, groups, out, config)


def launch(x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, K: int, groups: int, out: torch.Tensor,
           config: tuple | None = None) -> torch.Tensor:
    """q8_mma_matmul on arguments q8_triton.call_operands has checked and made ready (x [T, G*K] contiguous on a
    CUDA device at a 16-byte boundary, out [T, N]) -> out."""
    from ds4trt.plugins.kernels import q8_triton

    (T, N), KP = out.shape, quants.shape[1]
    warps, mt, pf, min_programs = config or launch_config(N, groups)
    rows = warps * mt * 16
    if groups > 1 and (N // groups) % rows:
        raise ValueError(f"q8_mma_matmul: rows per group {N // groups} must be a multiple of the row tile {rows}")
    tiles, spans, splits = mma_launch(N, K, rows, min_programs)
    if splits > 1 and tiles > q8_triton.COUNTER_SLOTS:
        raise ValueError(f"q8_mma_matmul: {tiles} row tiles split {splits} ways, more than the "
                         f"{q8_triton.COUNTER_SLOTS} arrival counters")
    part = out if splits == 1 else torch.empty(splits, T, N, dtype=torch.float32, device=x.device)
    nt = 1 if T <= 8 else 2
    cuda_launch.launch(x.device, kernel(nt, mt, warps, bool(pf)), (tiles, splits), warps * 32,
                       smem_bytes(nt, spans), (x, quants, scales, out, part, q8_triton._counters(x.device), T, N,
                                               N // groups, K, KP, spans, splits, (HI_BYTES, ctypes.c_uint)))
    return out

