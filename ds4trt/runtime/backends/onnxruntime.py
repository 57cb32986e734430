"""ONNX Runtime backend: the exported step graphs behind the Transformer.forward / MTPHead.forward signatures.

    engine = open_engine("engines/demo")          # validates manifest.json (files, sizes, sha256)
    s = engine.session(engine.model.ctx)          # the cache shapes are the ones the graphs were built for

Inputs are the CacheState tensors as numpy views (no copy); outputs come back as torch tensors. The session
(runtime/session.py) and the speculative loop (runtime/speculative.py) run unchanged on top.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.model.config import ModelConfig
from ds4trt.model.state import LayerCache, LayerRows
from ds4trt.plugins import moe
from ds4trt.runtime.session import Engine
from ds4trt.tokenizer import Tokenizer

BACKEND = "onnxruntime"


class OrtStep:
    """One step graph in an onnxruntime.InferenceSession."""

    def __init__(self, path: Path, cfg: ModelConfig, ctx: int, inputs: list[M.IOSpec], outputs: list[M.IOSpec],
                 session_options=None):
        import onnxruntime as ort

        self.path, self.cfg, self.ctx = Path(path), cfg, ctx
        self.inputs, self.outputs = inputs, outputs
        so = moe.onnxruntime_session_options(session_options)
        # between steps the Python loop runs: idle ORT threads must not spin on the cores it (and torch) need
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # noqa: BLE001 - ORT raises its own types; report one line
            raise Ds4Error(f"{self.path}: ONNX Runtime cannot load it: {str(e).splitlines()[0]}") from e
        have = {i.name: i for i in self.session.get_inputs()}
        for spec in inputs:
            got = have.get(spec.name)
            if got is None or [d if isinstance(d, int) else "T" for d in got.shape] != list(spec.shape):
                raise Ds4Error(f"{self.path}: input {spec.name} is {got.shape if got else 'missing'}, "
                               f"the manifest says {list(spec.shape)}")
        self.cache_specs = [s for s in inputs if s.name.startswith("cache.")]
        self.row_fields = M.row_fields(outputs)

    def _run(self, feeds: dict, caches: list[LayerCache], last_only: bool):
        flat = [t for c in caches for t in c.tensors().values()]
        if len(flat) != len(self.cache_specs):
            raise Ds4Error(f"{self.path}: expects {len(self.cache_specs)} cache tensors, got {len(flat)}")
        for spec, t in zip(self.cache_specs, flat):
            if tuple(t.shape) != spec.shape:
                raise Ds4Error(f"{self.path}: {spec.name} has shape {list(t.shape)}, the engine was built for "
                               f"{list(spec.shape)} (ctx {self.ctx}): open the session with ctx {self.ctx}")
            feeds[spec.name] = _numpy(t, np.float32)
        out = [torch.from_numpy(a) for a in self.session.run([s.name for s in self.outputs], feeds)]
        logits, hc, it = out[0], out[1], iter(out[2:])
        rows = [LayerRows(**{f: next(it) for f in fields}) for fields in self.row_fields]
        return (logits[-1:] if last_only else logits), hc, rows


class OrtTarget(OrtStep):
    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, caches: list[LayerCache], last_only: bool = False,
                 indexer: bool = True):
        """Transformer.forward: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows (the graph always runs the
        indexer: `indexer` changes nothing)."""
        return self._run({"tokens": _numpy(tokens, np.int64), "start": _numpy(start, np.int64).reshape(())},
                         caches, last_only)


class OrtMTP(OrtStep):
    def __call__(self, tokens: torch.Tensor, h: torch.Tensor, start: torch.Tensor, caches: list[LayerCache],
                 last_only: bool = False, indexer: bool = True):
        """MTPHead.forward: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows."""
        return self._run({"tokens": _numpy(tokens, np.int64), "h": _numpy(h, np.float32),
                          "start": _numpy(start, np.int64).reshape(())}, caches, last_only)


def _numpy(t: torch.Tensor, dtype) -> np.ndarray:
    """A numpy view of a CPU tensor (a copy only when the dtype or layout must change)."""
    return np.ascontiguousarray(t.detach().cpu().numpy(), dtype=dtype)


def open_engine(directory, verify_hashes: bool = True) -> Engine:
    """An Engine whose model (and MTP head, if built) run the directory's graphs in ONNX Runtime."""
    m = M.load(directory, verify_hashes)
    if m.backend != BACKEND:
        raise Ds4Error(f"{m.directory / M.MANIFEST}: backend {m.backend!r} cannot be loaded by the "
                       f"{BACKEND} runtime (rebuild with ds4-build --backend {BACKEND})")
    cfg = m.config()
    tokenizer = Tokenizer.from_file(m.directory / m.data["tokenizer"]["file"])
    g = m.graphs["target"]
    target = OrtTarget(g["file"], cfg, m.ctx, g["inputs"], g["outputs"])
    mtp = None
    if "mtp" in m.graphs:
        g = m.graphs["mtp"]
        mtp = OrtMTP(g["file"], cfg, m.ctx, g["inputs"], g["outputs"])
    return Engine(target, tokenizer, mtp, source=str(m.directory))
