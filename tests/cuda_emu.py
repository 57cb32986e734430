"""The CPU stand-in for the GPU (cuda_emu/simt_emu.h): this project's CUDA C++ kernels built by g++ as host code and
run on tensors in host memory, each CUDA thread a fiber, so their indexing, fragment layouts, shared memory and
split-K bookkeeping are tested where there is no GPU (CI); their reads (__ldg, __ldcg, cp.async) must stay inside the
tensor arguments (up to the end of each one's storage). Slow (a warp collective is two rounds of 32 context
switches): small shapes only.

    launch(device, kernel, grid, threads, smem, args)   # cuda_launch.launch's stand-in: the same Kernel and
                                                        # arguments (tensors in host memory); tests monkeypatch it in
    build(source, name, defines) -> the library        # cached per (sources, defines)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).with_name("cuda_emu")
CACHE = Path(tempfile.gettempdir()) / "ds4trt-cuda-emu"


def available() -> bool:
    return shutil.which("g++") is not None


@functools.cache
def build(source: Path, name: str, defines: tuple[tuple[str, int], ...] = ()) -> ctypes.CDLL:
    """source (a .cu of plugins/kernels) with its kernel `name` and -D defines -> the loaded library."""
    inputs = [HERE / "simt_emu.h", HERE / "launch.cpp", source, *sorted(source.parent.glob("*.cuh"))]
    key = hashlib.sha256(repr((name, defines)).encode() + b"".join(p.read_bytes() for p in inputs)).hexdigest()[:20]
    lib = CACHE / f"{source.stem}-{key}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{id(lib)}.tmp")
        cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-fno-strict-aliasing", "-w", f"-I{HERE}",
               f"-I{source.parent}", f'-DEMU_SOURCE="{source}"', f"-DEMU_KERNEL={name}",
               *(f"-D{k}={v}" for k, v in defines), str(HERE / "launch.cpp"), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"cuda_emu: g++ could not build {source.name}:\n{done.stderr[-4000:]}")
        tmp.rename(lib)
    dll = ctypes.CDLL(str(lib))
    dll.emu_launch.restype = ctypes.c_char_p
    dll.emu_launch.argtypes = [ctypes.c_uint] * 5 + [ctypes.POINTER(ctypes.c_void_p),
                                                     ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    return dll


def launch(device, kernel, grid: tuple[int, ...], threads: int, smem_bytes: int, args: tuple) -> None:
    """cuda_launch.launch on the CPU: kernel (a cuda_launch.Kernel) over grid (x[, y[, z]]) programs of `threads`
    threads. args in the kernel's order: CPU tensors (passed as their addresses), Python ints (as int), or (value,
    ctypes type) pairs."""
    from ds4trt.plugins.kernels import cuda_launch

    lib = build(cuda_launch.HERE / kernel.source, kernel.name, tuple(kernel.defines))
    ranges = []
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                raise ValueError("cuda_emu: tensors must be in host memory")
            storage = a.untyped_storage()
            ranges += [a.data_ptr(), storage.data_ptr() + storage.nbytes()]       # to the end of its storage
    values = [kind(value) for value, kind in cuda_launch.typed_args(args)]
    ptrs = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
    gx, gy, gz = (*grid, 1, 1)[:3]
    err = lib.emu_launch(gx, gy, gz, threads, smem_bytes, ptrs, (ctypes.c_ulonglong * len(ranges))(*ranges),
                         len(ranges) // 2)
    if err:
        raise RuntimeError(err.decode())
