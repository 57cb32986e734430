"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for the kernels of this package.

A kernel launched with the PDL attribute may be scheduled while the kernel before it on the stream is still
running its last programs: its own programs become resident as SMs free up and wait in griddepcontrol.wait until
that kernel has completed and its writes are visible. What it saves is the gap between two kernels (launch, block
scheduling, the ramp of the first wave), which in a decode step of ~1900 small kernels is a good part of the time.
Each kernel of this package starts with `pdl_enter(PDL)` before it reads or writes any tensor, so its whole body
runs after the previous kernel, exactly as without PDL, and lets the next kernel be scheduled at once.

    kernel[grid](..., **pdl_launch(x.device))    # PDL=True and launch_pdl=True where the device supports it

DS4_PDL=0 in the environment turns it off (A/B measurements, debugging; the CUDA backend then also compiles
Inductor's kernels without it); Triton's interpreter never uses it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel on the stream (its completion and writes), then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(device: torch.device) -> dict:
    """The launch arguments of a kernel taking PDL: on `device` with PDL where supported."""
    on = _supported(device.type, device.index)
    return {"PDL": on, "launch_pdl": on}


def pdl_wanted() -> bool:
    """False when DS4_PDL=0 is set."""
    return os.environ.get("DS4_PDL", "1") != "0"


@functools.cache
def _supported(kind: str, index: int | None) -> bool:
    if kind != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or not pdl_wanted():
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9
