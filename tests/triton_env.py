"""Where this test process can run Triton code (imported by the kernel and CUDA-backend tests before triton).

GPU: a CUDA device and triton. INTERP: no GPU, triton installed and DS4_TRITON_INTERPRET=1, which turns on
Triton's CPU interpreter (TRITON_INTERPRET must be set before triton is first imported). DEVICE: where the
tests put their tensors.
"""

import os

import torch

if os.environ.get("DS4_TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"          # read when @triton.jit decorates a function: before the import
try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
GPU = HAVE_TRITON and torch.cuda.is_available()
INTERP = HAVE_TRITON and not GPU and os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if GPU else "cpu"
