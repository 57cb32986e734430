"""The tensor-core Q8_0 kernel (plugins/kernels/q8_mma.cu, launched by q8_mma.py) against float64.

Where they run: the offline check (NVRTC compiles CONFIG and every SWEEP launch for sm_90; ptxas' report must show
no spills and no stack frame) wherever NVRTC loads, CI included (the nvidia-cuda-nvrtc wheel of the test extras); the
launch arithmetic everywhere; the products on two devices: "emu", the kernel's CUDA C++ built by g++ for the CPU
stand-in of tests/cuda_emu (each CUDA thread a fiber, the warp's tensor-core product modelled from the PTX ISA's
fragment layouts), so CI runs them, at small shapes; and "cuda", a CUDA GPU (scripts/gpu_kernels.sh), at Flash's
widths too. On fresh random blocks with every output NaN-poisoned, at the float32 kernels' tolerance (1e-5 of the
largest |reference|), for T = 1..16, partial row tiles and spans, groups, K splits (their arrival counters back at
zero), inputs whose rows differ in magnitude by 1e37, infinities; CUDA-graph replay and q8_matmul's opt-in dispatch
on the GPU alone.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ds4trt.plugins.kernels import cuda_launch, q8_mma, q8_triton
from q8_cases import Q8_FLASH, Q8_SMALL, q8_float64, random_q8_0
from test_kernels import TOL, _rel, _seed

GPU = torch.cuda.is_available()
gpu_only = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU (scripts/gpu_kernels.sh on the H200)")
TS = (1, 2, 3, 5, 8, 9, 16)


def _matmul(x, quants, scales, K, groups=1, out=None, config=None):
    """q8_mma_matmul, on CPU tensors through its checks and launch (the emulated device)."""
    if x.is_cuda:
        return q8_mma.q8_mma_matmul(x, quants, scales, K, groups, out=out, config=config)
    x, quants, scales, out = q8_triton.call_operands("q8_mma_matmul", x, quants, scales, K, groups, out)
    return q8_mma.launch(x, quants, scales, K, groups, out, config)


@pytest.mark.skipif(not cuda_launch.builds(), reason="NVRTC not found (pip install nvidia-cuda-nvrtc)")
def test_every_launch_compiles_for_sm90_without_spills():
    """CONFIG and each SWEEP launch, for one and two x tiles: NVRTC compiles them for sm_90 and ptxas reports no
    spill stores or loads and no stack frame (an array indexed at run time or too many registers would show there),
    and CONFIG's one-tile kernel fits in 128 registers (four 4-warp programs per SM)."""
    for warps, mt, pf, _ in (q8_mma.CONFIG, *q8_mma.SWEEP):
        for nt in (1, 2):
            cubin, log = q8_mma.compile_cubin("sm_90", nt, mt, warps, pf, ptxas_verbose=True)
            assert cubin[:4] == b"\x7fELF", (nt, mt, warps, pf)
            if not log:
                pytest.skip("this NVRTC returns no ptxas -v report (the GPU machine's image: NVRTC 13.0 under "
                            "cuda.bindings 13.3); the check runs where it does, as on CI")
            frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
            regs = re.search(r"Used (\d+) registers", log)
            assert frame and regs, log
            assert frame.groups() == ("0", "0", "0"), f"NT={nt} MT={mt} WARPS={warps} PF={pf}: {frame.group(0)}"
            if (warps, mt, pf) == q8_mma.CONFIG[:3] and nt == 1:
                assert int(regs.group(1)) <= 128, log


def test_launch_config_fits_the_groups():
    """CONFIG's row tile, halved (tiles a warp first, then warps) until it divides a group's rows: attn_output_a's
    groups of 1024 rows keep it; groups of 32 rows get 32-row tiles, of 16 one warp of one tile."""
    assert q8_mma.CONFIG[0] * q8_mma.CONFIG[1] * 16 == 128
    assert q8_mma.launch_config(8192, 8) == q8_mma.CONFIG == q8_mma.launch_config(50, 1)
    assert q8_mma.launch_config(64, 2) == (2, 1, *q8_mma.CONFIG[2:])
    assert q8_mma.launch_config(32, 2) == (1, 1, *q8_mma.CONFIG[2:])
    with pytest.raises(ValueError, match="24 rows per group is not a multiple of 16"):
        q8_mma.launch_config(48, 2)


def test_launch_splits_k_to_fill_the_gpu():
    """mma_launch: the fewest K splits giving min programs with at most MAX_SPANS spans a program; K rounded up to
    whole spans; the most splits when even those are too few programs."""
    assert q8_mma.mma_launch(32768, 1024, 128, 528) == (256, 1, 4)       # attn_q_b: 256 tiles, 4 splits
    assert q8_mma.mma_launch(32768, 1024, 128, 256) == (256, 4, 1)       # already enough programs: no split
    assert q8_mma.mma_launch(129280, 4096, 128, 528) == (1010, 4, 4)     # LM head: split only to MAX_SPANS
    assert q8_mma.mma_launch(4096, 8192, 128, 528) == (32, 1, 32)        # attn_output_b: 512 programs at most
    assert q8_mma.mma_launch(50, 320, 128, 528) == (1, 1, 2)             # 2 spans (320 -> 512 values)
    assert q8_mma.smem_bytes(2, q8_mma.MAX_SPANS) <= 227 * 1024


def _check(device, Ts, N, K, groups, seed, config=None, row_scales=None):
    """q8_mma_matmul against float64 for each T: weights random_q8_0, x standard normal (each row times
    row_scales[t] when given), output NaN-poisoned; the split calls' counters back at zero."""
    rng = np.random.default_rng(seed)
    wb = torch.from_numpy(random_q8_0(rng, N, K, 1 / K ** 0.5)).to(device)
    wd = q8_float64(wb, K)
    quants, scales = q8_triton.split_q8(wb, N, K)
    rpg = N // groups
    for T in Ts:
        x = torch.from_numpy(rng.standard_normal((T, groups * K)).astype(np.float32)).to(device)
        if row_scales is not None:
            x *= torch.tensor(row_scales[:T], dtype=torch.float32, device=device)[:, None]
        ref = torch.cat([x[:, g * K:(g + 1) * K].double() @ wd[g * rpg:(g + 1) * rpg].T for g in range(groups)], 1)
        out = torch.full((T, N), float("nan"), device=device)
        got = _matmul(x, quants, scales, K, groups, out=out, config=config)
        assert got.data_ptr() == out.data_ptr()
        assert not q8_triton._counters(x.device).any(), "split row tiles left their arrival counters set"
        # each x row against its own reference: a row of small values is held to its own scale
        for t in range(T):
            err = _rel(got[t], ref[t])
            assert err <= TOL, f"T = {T}, row {t}, N = {N}, K = {K}, groups = {groups}: relative error {err:.3g}"


@pytest.mark.parametrize("shape", Q8_SMALL, ids=lambda s: "x".join(map(str, s)))
def test_q8_mma_small(kernel_device, shape):
    _check(kernel_device, TS, *shape, seed=_seed("mma", *shape))      # (64, 256, 2): groups of 32 rows, 32-row tiles


@pytest.mark.parametrize("config", q8_mma.SWEEP, ids=str)
def test_q8_mma_launches(kernel_device, config):
    """Every swept launch computes the same products: row tiles of 32..256, prefetch, 1..32 K splits."""
    _check(kernel_device, (1, 3, 9), 200, 2048, 1, seed=_seed("mma launch", config), config=config)
    _check(kernel_device, (2, 16), 1024, 4096, 8 if config[0] * config[1] * 16 <= 128 else 1,
           seed=_seed("mma groups", config), config=config)


@gpu_only
@pytest.mark.parametrize("shape", Q8_FLASH, ids=lambda s: "x".join(map(str, s)))
def test_q8_mma_flash_widths(shape):
    _check("cuda", TS, *shape, seed=_seed("mma flash", *shape))


@gpu_only
def test_q8_mma_lm_head():
    _check("cuda", (1, 3, 9), 129280, 4096, 1, seed=_seed("mma head"))


def test_q8_mma_rows_of_any_magnitude(kernel_device):
    """x rows from 1e-30 to 1e7 times standard normal (past float16's range both ways): each row divided by its own
    power of two before its float16 parts are taken, so each is as exact as a row of unit size (rows whose products
    would be float32 subnormals are not: no float32 kernel holds those to 1e-5)."""
    _check(kernel_device, (9,), 256, 1024, 1, seed=_seed("mma magnitudes"),
           row_scales=[1e-7, 1e7, 1.0, 3e-3, 2e5, 1e-30, 0.5, 65504.0, 1e-20])


def test_q8_mma_nonfinite_inputs_propagate(kernel_device):
    """An infinity in x reaches the outputs of its row (as NaN or infinity), and only those."""
    rng = np.random.default_rng(_seed("mma inf"))
    N, K = 128, 512
    quants, scales = q8_triton.split_q8(torch.from_numpy(random_q8_0(rng, N, K, 0.05)).to(kernel_device), N, K)
    x = torch.randn(3, K, device=kernel_device)
    x[1, 7] = float("inf")
    y = _matmul(x, quants, scales, K)
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    assert not torch.isfinite(y[1]).any()


@gpu_only
def test_q8_mma_replays_from_a_cuda_graph():
    """Captured once (after an eager call), replayed on new x: the eager call's products."""
    rng = np.random.default_rng(_seed("mma graph"))
    N, K = 4096, 2048
    quants, scales = q8_triton.split_q8(torch.from_numpy(random_q8_0(rng, N, K, 1 / K ** 0.5)).cuda(), N, K)
    x = torch.randn(3, K, device="cuda")
    q8_mma.q8_mma_matmul(x, quants, scales, K)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        q8_mma.q8_mma_matmul(x, quants, scales, K)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = q8_mma.q8_mma_matmul(x, quants, scales, K)
    for _ in range(3):
        x.copy_(torch.randn(3, K, device="cuda"))
        graph.replay()
        assert torch.equal(y, q8_mma.q8_mma_matmul(x, quants, scales, K))


@gpu_only
def test_q8_matmul_dispatches_where_q8_mma_is_faster(monkeypatch):
    """With DS4_Q8_MMA=auto q8_triton.q8_matmul sends a call here (the bits of q8_mma_matmul) where `faster` says: 2
    or more rows of x, of any weight; it keeps _q8_rows for one row. DS4_Q8_MMA=1 sends every call here, DS4_Q8_MMA=0
    none; unset, DEFAULT_MODE decides."""
    rng = np.random.default_rng(_seed("mma dispatch"))
    for (N, K), T, here in (((512, 1024), 5, True), ((512, 1024), 2, True), ((512, 1024), 1, False),
                            ((4096, 4096), 2, True), ((4096, 4096), 1, False), ((8192, 2048), 4, True)):
        quants, scales = q8_triton.split_q8(torch.from_numpy(random_q8_0(rng, N, K, 1 / K ** 0.5)).cuda(), N, K)
        x = torch.randn(T, K, device="cuda")
        mma = q8_mma.q8_mma_matmul(x, quants, scales, K)
        want = {"auto": here, "1": True, "0": False}
        for mode in ("auto", "1", "0", None):
            if mode is None:
                monkeypatch.delenv("DS4_Q8_MMA", raising=False)
            else:
                monkeypatch.setenv("DS4_Q8_MMA", mode)
            got = torch.equal(q8_triton.q8_matmul(x, quants, scales, K), mma)     # else other summation orders
            assert got is want[mode or q8_mma.DEFAULT_MODE], (N, K, T, mode)


@gpu_only
def test_q8_mma_rejects_bad_arguments():
    """One-line errors for x of the wrong shape or device, and for a given launch whose row tile does not divide a
    group's rows (launch_config's own launch shrinks its tile until it does)."""
    N, K = 64, 256
    quants, scales = q8_triton.split_q8(torch.zeros(N, K // 32 * 34, dtype=torch.uint8, device="cuda"), N, K)
    with pytest.raises(ValueError, match=r"expected float32 \[1..16, 256\]"):
        q8_mma.q8_mma_matmul(torch.zeros(17, K, device="cuda"), quants, scales, K)
    with pytest.raises(ValueError, match="one CUDA device"):
        q8_mma.q8_mma_matmul(torch.zeros(1, K), quants, scales, K)
    with pytest.raises(ValueError, match="rows per group 32 must be a multiple of the row tile 128"):
        q8_mma.q8_mma_matmul(torch.zeros(1, 2 * K, device="cuda"), quants, scales, K, groups=2, config=(4, 2, False, 1))


def test_cuda_kernels_say_what_to_install(monkeypatch):
    """Without cuda-bindings, building a CUDA C++ kernel fails with a one-line error naming the packages, not an
    ImportError from deep inside, and cuda_launch.builds says so (runs_on, and with it the products' dispatch, then
    keeps the Triton kernels)."""
    import sys

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setattr(cuda_launch, "builds", cuda_launch.builds.__wrapped__)
    assert not cuda_launch.builds()
    with pytest.raises(RuntimeError, match="need cuda-bindings and NVRTC: pip install cuda-bindings nvidia-cuda-nvrtc"):
        q8_mma.compile_cubin("sm_90", 1, 2, 4, False)
