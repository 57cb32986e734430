"""A prefill chunk through the CUDA backend reads no tensor value on the host, so nothing in it waits for the GPU:
the host queues the next layers' launches while the routed experts compute (a 2048-token chunk at 28 layers on an
H100: 325.8 -> 301.4 ms once the MoE's item listing stopped reading the routing, BENCHMARKS.md, the forty-sixth
session).

How: while the tiny model prefills two 22-token chunks (long calls: more than 16 tokens; in the second the ratio-4
layer's indexer picks each query's top rows of the first's cache) on the kernel path, every Python-level read of a
tensor's values (item, tolist, bool / int / float / index conversion, nonzero, numpy, cpu, indexing by a bool mask,
and torch's nonzero / unique / bincount / masked_select / repeat_interleave, which size their outputs from the
values) made by ds4trt code is recorded with its file and line; reads made inside Triton's interpreter (its own
bookkeeping on CPU tensors) are not ds4trt's and are left out. What this cannot see: a synchronization inside a C++
op not listed here. A control run first makes sure the recorder sees a read placed in the MoE's item listing.

Without a GPU the chunks run in a child process on Triton's CPU interpreter (DS4_TRITON_INTERPRET=1 must be set
before triton is imported), so CI runs it wherever triton is installed.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import traceback

import pytest

from triton_env import GPU, HAVE_TRITON, INTERP  # noqa: I001 - first: it may set TRITON_INTERPRET
import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu")
TORCH_READS = ("nonzero", "unique", "bincount", "masked_select", "repeat_interleave")


class _ControlRead(Exception):
    """Raised by the control's item listing once it has read the routing."""


def host_reads(control: bool) -> collections.Counter:
    """{"what at file:line": count} of the value reads made by ds4trt code while the tiny model prefills two chunks
    of 22 tokens through the CUDA backend (here: a GPU, or the interpreter). control: make the MoE's item listing
    read its routing's largest id, and stop the prefill there (the rest of the chunk would take ~25 s on the
    interpreter for nothing the control checks)."""
    from ds4trt.plugins.kernels import moe_triton
    from ds4trt.runtime.backends import cuda
    from tiny_engines import PROMPT, tiny_files
    from triton_env import DEVICE

    engine = cuda.open_engine(*tiny_files(), numerics="ds4", device=DEVICE, graphs=False)
    session = engine.session(64)
    hits: collections.Counter = collections.Counter()

    def recorded(what, fn):
        def read(*args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            ours = [f for f in stack if f"{os.sep}ds4trt{os.sep}" in f.filename]
            if ours and not any(f"{os.sep}triton{os.sep}" in f.filename for f in stack):
                hits[f"{what} at {os.path.relpath(ours[-1].filename)}:{ours[-1].lineno}"] += 1
            return fn(*args, **kwargs)
        return read

    def bool_indexed(fn):
        flagged = recorded(fn.__name__ + " by a bool mask", fn)

        def index(self, idx, *rest):
            keys = idx if isinstance(idx, tuple) else (idx,)
            mask = any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys)
            return (flagged if mask else fn)(self, idx, *rest)
        return index

    saved = [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in (*READS, "__getitem__", "__setitem__")]
    saved += [(torch, n, getattr(torch, n)) for n in TORCH_READS]
    saved += [(moe_triton, "_long_items", moe_triton._long_items)]
    try:
        for name in READS:
            setattr(torch.Tensor, name, recorded(name, getattr(torch.Tensor, name)))
        for name in ("__getitem__", "__setitem__"):
            setattr(torch.Tensor, name, bool_indexed(getattr(torch.Tensor, name)))
        for name in TORCH_READS:
            setattr(torch, name, recorded("torch." + name, getattr(torch, name)))
        if control:
            def listing_that_reads(ids, *rest):
                int(ids.max())                  # a read of the routing, as the listing once made (counts.tolist())
                raise _ControlRead
            moe_triton._long_items = listing_that_reads
        session.prefill(list(PROMPT) * 2, chunk=len(PROMPT))
    except _ControlRead:
        pass
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return hits


def _run(control: bool) -> collections.Counter:
    """host_reads here (GPU, or already on the interpreter), else in a child process on the interpreter."""
    if GPU or INTERP:
        return host_reads(control)
    env = {**os.environ, "DS4_TRITON_INTERPRET": "1"}
    tests = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests!r}); import triton_env, test_prefill_host_reads as t; "
            f"import json; print(json.dumps(t.host_reads({control})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return collections.Counter(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton (scripts/setup.sh installs it; the interpreter runs on CPU)")
def test_a_prefill_chunk_reads_no_tensor_value_on_the_host():
    control = _run(control=True)
    assert any("moe_triton.py" in k and k.startswith("__int__") for k in control), \
        f"the recorder missed the control's read in the MoE's item listing: {dict(control)}"
    hits = _run(control=False)
    assert not hits, "a prefill chunk reads tensor values on the host (each waits for the GPU):\n" + "\n".join(
        f"  {n} x {k}" for k, n in hits.most_common())
