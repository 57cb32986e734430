"""Engine directories of the tiny test model, built once per test process (test_export.py, test_ort_backend.py).

    tiny_files()          -> (target GGUF, MTP GGUF): tiny_config(), seeds 0 and 1 (IQ2_XXS/Q2_K and Q4_K experts)
    tiny_engine(numerics) -> engine directory built by `ds4-build --gguf ... --mtp ... --ctx CTX --numerics ...`
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

from ds4trt import cli
from ds4trt.testing.tiny_gguf import tiny_config, write_model_gguf, write_mtp_gguf

CTX = 64
# a prompt of 22 tokens for the backend comparisons (the tiny vocabulary has 512)
PROMPT = [3, 77, 140, 9, 250, 31, 402, 66, 5, 188, 301, 12, 97, 456, 21, 60, 333, 8, 144, 270, 19, 500]
N_NEW = 14


def greedy(engine, n: int = N_NEW, prompt: list[int] = PROMPT, ctx: int = CTX, chunk: int = 9) -> list[int]:
    """Plain greedy decoding of n tokens after `prompt` (prefilled in chunks of `chunk`), through any backend."""
    s = engine.session(ctx)
    s.prefill(list(prompt), chunk=chunk)
    out = [s.argmax()]
    while len(out) < n:
        s.eval(out[-1])
        out.append(s.argmax())
    return out


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="ds4trt-engines-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_files() -> tuple[Path, Path]:
    cfg = tiny_config()
    target, mtp = _root() / "tiny.gguf", _root() / "tiny-mtp.gguf"
    write_model_gguf(target, cfg)
    write_mtp_gguf(mtp, cfg)
    return target, mtp


@functools.cache
def tiny_engine(numerics: str = "ds4") -> Path:
    target, mtp = tiny_files()
    out = _root() / f"engine-{numerics}"
    rc = cli.build(["--gguf", str(target), "--mtp", str(mtp), "--out", str(out), "--ctx", str(CTX),
                    "--numerics", numerics])
    assert rc == 0
    return out
