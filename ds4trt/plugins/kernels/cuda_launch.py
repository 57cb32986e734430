"""The CUDA C++ kernels of this folder (q8_mma.cu, moe_mma.cu): compiled at run time by NVRTC, launched through the
CUDA driver (cuda.bindings) on PyTorch's current stream, so CUDA graphs capture them, with programmatic dependent
launch where pdl.py uses it.

    Kernel(source, name, defines)                          what to build: a .cu here, its entry, its -D values
    runs_on(device)                                        compute capability 8.0 or newer (mma.sync, cp.async)
    builds_sm90a()                                         NVRTC builds sm_90a (wgmma): CUDA 12.0 or newer
    compile_cubin(kernel, arch, ptxas_verbose=False)      -> (cubin, NVRTC's log); needs no GPU
    launch(device, kernel, grid, threads, smem, args)     args in the kernel's order: tensors (their addresses), ints
                                                          (int), or (value, ctypes type) pairs

Every .cuh here is given to NVRTC as a header. Triton is imported only by launch (pdl.py), so that compile_cubin runs
where only NVRTC is installed (the offline check). tests/cuda_emu.py runs the same Kernel on the CPU.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).parent


class Kernel(NamedTuple):
    source: str                                  # file name of a .cu in this folder
    name: str                                    # its extern "C" __global__ function
    defines: tuple[tuple[str, int], ...]         # -D name=value; WG=1: built for the "a" target (sm_90a: wgmma)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: they use mma.sync.m16n8k16 and cp.async, so a GPU of compute capability
    8.0 or newer (A100, H100 / H200, Jetson Orin; not Turing or Jetson Xavier), and they are built by NVRTC through
    cuda-bindings (`builds`). False for the CPU, where only the tests' stand-in runs them (its tests say so)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0) and builds()


@functools.cache
def builds() -> bool:
    """Whether cuda-bindings imports and NVRTC loads, so that kernels here can be compiled; where not, the callers keep
    the Triton kernels (a speed choice: both compute the same products)."""
    try:
        err, _, _ = _bindings("nvrtc").nvrtcVersion()
        return int(err) == 0
    except Exception:   # noqa: BLE001  (cuda-bindings missing, or its NVRTC library not found: any failure means no)
        return False


@functools.cache
def builds_sm90a() -> bool:
    """Whether NVRTC can build Hopper's own target (sm_90a: wgmma), which it knows from CUDA 12.0 on."""
    if not builds():
        return False
    _, major, _ = _bindings("nvrtc").nvrtcVersion()
    return major >= 12


def compile_cubin(kernel: Kernel, arch: str, ptxas_verbose: bool = False) -> tuple[bytes, str]:
    """kernel for arch ("sm_90") -> (cubin, NVRTC's log; with ptxas_verbose it holds ptxas' registers / spills
    lines). Raises RuntimeError with the log."""
    nvrtc = _bindings("nvrtc")
    opts = [f"--gpu-architecture={arch}", "-std=c++17", *(f"-D{k}={v}" for k, v in kernel.defines)]
    if ptxas_verbose:
        opts.append("--ptxas-options=-v")
    headers = sorted(HERE.glob("*.cuh"))
    err, prog = nvrtc.nvrtcCreateProgram((HERE / kernel.source).read_bytes(), kernel.source.encode(), len(headers),
                                         [h.read_bytes() for h in headers], [h.name.encode() for h in headers])
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        log = log.rstrip(b"\x00 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC could not compile {kernel.source} for {arch} ({opts}):\n{log}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def typed_args(args: tuple) -> list[tuple]:
    """A kernel's arguments as (value, ctypes type): a tensor its address (c_void_p), an int c_int, a (value, ctypes
    type) pair as given."""
    return [(a.data_ptr(), ctypes.c_void_p) if isinstance(a, torch.Tensor) else a if isinstance(a, tuple)
            else (a, ctypes.c_int) for a in args]


def _bindings(name: str):
    """cuda.bindings' module `name` ("nvrtc", "driver"), or a one-line error saying what to install."""
    try:
        return getattr(__import__("cuda.bindings", fromlist=[name]), name)
    except ImportError as e:
        raise RuntimeError(f"the CUDA C++ kernels (q8_mma, moe_mma) need cuda-bindings and NVRTC: pip install "
                           f"cuda-bindings nvidia-cuda-nvrtc ({e})") from None


def _check(err, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"cuda_launch: {what} failed: {err!r}")


def _make_current(driver, device_index: int) -> None:
    """The device's primary context (PyTorch's) current on this thread, as the driver API needs: PyTorch's runtime
    calls make it current where they ran (the caller sits inside torch.cuda.device(device_index)); a thread where none
    did gets it here."""
    err, ctx = driver.cuCtxGetCurrent()
    _check(err, "cuCtxGetCurrent")
    if int(ctx) == 0:
        err, dev = driver.cuDeviceGet(device_index)
        _check(err, "cuDeviceGet")
        err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
        _check(err, "cuDevicePrimaryCtxRetain")
        (err,) = driver.cuCtxSetCurrent(ctx)
        _check(err, "cuCtxSetCurrent")


@functools.cache
def _function(device_index: int, kernel: Kernel):
    """The kernel loaded into PyTorch's context of the device, allowed the device's largest dynamic shared memory.
    Not allowed during a CUDA graph capture: the backends run each step once before capturing it."""
    driver = _bindings("driver")
    major, minor = torch.cuda.get_device_capability(device_index)
    cubin, _ = compile_cubin(kernel, f"sm_{major}{minor}" + ("a" if dict(kernel.defines).get("WG") else ""))
    with torch.cuda.device(device_index):
        _make_current(driver, device_index)
        err, module = driver.cuModuleLoadData(cubin)
        _check(err, "cuModuleLoadData")
        err, fn = driver.cuModuleGetFunction(module, kernel.name.encode())
        _check(err, "cuModuleGetFunction")
        err, dev = driver.cuDeviceGet(device_index)
        _check(err, "cuDeviceGet")
        err, optin = driver.cuDeviceGetAttribute(
            driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, dev)
        _check(err, "cuDeviceGetAttribute")
        (err,) = driver.cuFuncSetAttribute(
            fn, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, optin)
        _check(err, "cuFuncSetAttribute")
    return module, fn


def launch(device: torch.device, kernel: Kernel, grid: tuple[int, ...], threads: int, smem: int, args: tuple) -> None:
    """kernel over grid (x[, y]) programs of `threads` threads with `smem` bytes of dynamic shared memory, on PyTorch's
    current stream of `device`."""
    from ds4trt.plugins.kernels.pdl import pdl_launch

    driver = _bindings("driver")
    index = device.index if device.index is not None else torch.cuda.current_device()
    _, fn = _function(index, kernel)
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = (*grid, 1, 1)[:3]
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes = smem
    cfg.hStream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    if pdl_launch(device)["PDL"]:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs, cfg.numAttrs = [attr], 1
    else:
        cfg.numAttrs = 0
    values, types = zip(*typed_args(args))
    with torch.cuda.device(index):
        _make_current(driver, index)
        (err,) = driver.cuLaunchKernelEx(cfg, fn, (values, types), 0)
    _check(err, "cuLaunchKernelEx")
