"""Device memory for the TensorRT backend: where every graph input and output lives, and who owns it.

    plan = plan_buffers(inputs, outputs, t_max)   # pure: name -> Slot(offset, nbytes, dtype, shape); total
    arena = DeviceArena(plan)                     # one cudaMalloc of plan.total bytes; close() frees it
    arena.view("cache.2.comp")                    # a torch CUDA tensor over that slot (no copy)
    arena.view("logits", T)                       # a T-dimension slot, first T rows

One arena per step graph (target, MTP). Every slot starts on an ALIGN (256 B) boundary: what TensorRT asks of
I/O and context memory ("256-byte aligned device memory", IExecutionContext.set_device_memory), more than any
element type needs. A T dimension is planned at t_max (the largest optimization profile), so every phase's
execution context binds the same addresses once and CUDA graphs captured on them stay valid.

cuda-python (`from cuda.bindings import runtime as cudart`; cuda-bindings >= 12.6, where the old `cuda.cudart`
module is gone in 13.0) returns (error, *values) from every call; cuda_call raises Ds4Error with the error's
name on anything but cudaSuccess and returns the values (TensorRT samples' common_runtime.py cuda_call, minus
its habit of swallowing errors in free()).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ds4trt.errors import Ds4Error
from ds4trt.export.manifest import IOSpec

ALIGN = 256
ITEMSIZE = {"float32": 4, "int64": 8, "int32": 4, "uint8": 1}
TYPESTR = {"float32": "<f4", "int64": "<i8", "int32": "<i4", "uint8": "|u1"}   # __cuda_array_interface__


@dataclass(frozen=True)
class Slot:
    name: str
    role: str                       # "input" | "output"
    dtype: str
    shape: tuple[int, ...]          # T already replaced by t_max
    t_axis: int | None              # 0 if the first dimension is T, None if static
    offset: int                     # bytes from the arena's start, a multiple of ALIGN
    nbytes: int

    def shape_for(self, T: int) -> tuple[int, ...]:
        return self.shape if self.t_axis is None else (T, *self.shape[1:])


@dataclass(frozen=True)
class BufferPlan:
    slots: dict[str, Slot]
    total: int                      # bytes, a multiple of ALIGN
    t_max: int


def plan_buffers(inputs: list[IOSpec], outputs: list[IOSpec], t_max: int, align: int = ALIGN) -> BufferPlan:
    """Offsets and sizes of every graph input and output, in manifest order (inputs first), each aligned."""
    if t_max < 1:
        raise ValueError(f"t_max must be >= 1, got {t_max}")
    slots, offset = {}, 0
    for role, specs in (("input", inputs), ("output", outputs)):
        for s in specs:
            if s.name in slots:
                raise ValueError(f"tensor {s.name} appears twice among the graph's inputs and outputs")
            if s.dtype not in ITEMSIZE:
                raise ValueError(f"tensor {s.name}: dtype {s.dtype} has no device buffer type")
            t_axes = [i for i, d in enumerate(s.shape) if d == "T"]
            if t_axes not in ([], [0]):     # T leads, so the first T rows of a slot are one contiguous tensor
                raise ValueError(f"tensor {s.name}: T must be the first and only dynamic dimension, got "
                                 f"{list(s.shape)}")
            shape = tuple(t_max if d == "T" else int(d) for d in s.shape)
            nbytes = math.prod(shape) * ITEMSIZE[s.dtype]
            offset = -(-offset // align) * align
            slots[s.name] = Slot(s.name, role, s.dtype, shape, t_axes[0] if t_axes else None, offset, nbytes)
            offset += nbytes
    return BufferPlan(slots, -(-offset // align) * align, t_max)


# ---- CUDA (cuda-python) ----

def cudart():
    try:
        from cuda.bindings import runtime
    except ImportError:
        raise Ds4Error("cuda-python is not installed (pip install cuda-bindings, matching the CUDA major "
                       "version of the driver): the TensorRT backend allocates device memory with it") from None
    return runtime


def cuda_call(result, what: str = "CUDA call"):
    """Unwrap a cuda.bindings (error, *values) result: raise on any error code, else return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    rt = cudart()
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        raise Ds4Error(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
    return None if not values else values[0] if len(values) == 1 else tuple(values)


def device_compute_capability(device: int = 0) -> str | None:
    """"major.minor" of CUDA device `device`, or None where there is no usable GPU (or no cuda-python)."""
    try:
        rt = cudart()
        attr = rt.cudaDeviceAttr
        major = cuda_call(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMajor, device))
        minor = cuda_call(rt.cudaDeviceGetAttribute(attr.cudaDevAttrComputeCapabilityMinor, device))
    except Ds4Error:
        return None
    return f"{major}.{minor}"


class _Span:
    """A device address range as __cuda_array_interface__ (v3), for torch.as_tensor(..., device="cuda")."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: str, owner):
        self.owner = owner                   # the arena stays alive while a tensor views it
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": TYPESTR[dtype], "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class DeviceArena:
    """Owns one cudaMalloc holding every slot of a BufferPlan, plus optional scratch bytes (TensorRT context
    memory) at the end. close() frees it; a closed arena refuses views. Views are torch CUDA tensors that do
    not own memory: they are valid while the arena is open."""

    def __init__(self, plan: BufferPlan, scratch_bytes: int = 0):
        self.plan = plan
        self.scratch_offset = plan.total
        self.scratch_bytes = max(ALIGN, -(-scratch_bytes // ALIGN) * ALIGN)
        self.nbytes = plan.total + self.scratch_bytes
        self.ptr = int(cuda_call(cudart().cudaMalloc(self.nbytes), f"cudaMalloc({self.nbytes})"))
        self._views: dict = {}
        cuda_call(cudart().cudaMemset(self.ptr, 0, self.nbytes), "cudaMemset")

    def address(self, name: str) -> int:
        self._open()
        return self.ptr + self.plan.slots[name].offset

    @property
    def scratch(self) -> int:
        self._open()
        return self.ptr + self.scratch_offset

    def view(self, name: str, T: int | None = None):
        """The slot as a torch CUDA tensor (its T dimension cut to T rows when given)."""
        import torch

        key = (name, T)
        view = self._views.get(key)
        if view is None:
            slot = self.plan.slots[name]
            shape = slot.shape if T is None else slot.shape_for(T)
            view = self._views[key] = torch.as_tensor(_Span(self.address(name), shape, slot.dtype, self),
                                                      device="cuda")
        return view

    def owns(self, ptr: int) -> bool:
        return self.ptr is not None and self.ptr <= ptr < self.ptr + self.nbytes

    def _open(self) -> None:
        if self.ptr is None:
            raise Ds4Error("the TensorRT engine's device buffers are closed")

    def close(self) -> None:
        if self.ptr is not None:
            ptr, self.ptr = self.ptr, None
            self._views.clear()
            cuda_call(cudart().cudaFree(ptr), "cudaFree")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
