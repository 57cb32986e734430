"""ds4-build --check: every graph of an engine directory in ONNX Runtime against the PyTorch reference, with
polygraphy (Comparator.run over two runners, RunResults saved for a later TensorRT comparison).

The reference is the same step in eager torch, built from the GGUF files (StepGraph around Transformer /
MTPHead, routed experts through the ds4::MoE numpy reference). polygraphy's OnnxrtRunner takes our own
InferenceSession (ds4::MoE registered); the torch side is a small BaseRunner. Inputs are fresh random values:
tokens uniform over the vocabulary, a random start position, every cache tensor N(0, 1) (not zeros), h N(0, 1).

Tolerance per output: max |ort - torch| <= TOL * max |torch| (TOL = 1e-4; the two differ by float32 summation
order only). With ds4 numerics the proposed cache rows are rounded (FP8 E4M3 on the non-RoPE dims, then f16):
an input 1e-7 away from a rounding boundary can land on the other side, so rows may also differ by up to one
FP8 step (|torch| / 8) in at most ROUNDING_FLIP_FRACTION (1 %) of their elements. polygraphy's
CompareFunc.simple at the same element-wise bounds must pass too.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.export.onnx import StepGraph
from ds4trt.model.config import ModelConfig
from ds4trt.model.mtp import MTPHead
from ds4trt.model.transformer import Transformer
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.plugins import moe

TOL = 1e-4
FP8_STEP = 1 / 8
ROUNDING_FLIP_FRACTION = 1e-2
T_VALUES = (1, 3, 8)


@dataclass
class OutputCheck:
    graph: str
    T: int
    output: str
    rel: float                      # max |diff| / max |ref|
    flips: float                    # fraction of elements beyond TOL * max |ref| (allowed for ds4 rows)
    ok: bool


def reference_steps(gguf, mtp, numerics: str, ctx: int) -> dict[str, StepGraph]:
    """The torch reference of each graph: StepGraph over the eager model (GGUF blocks through ds4::MoE)."""
    _, cfg, weights = load_target(gguf)
    target = Transformer(cfg, weights, numerics, experts=moe.GGUFExperts.from_weights)
    steps = {"target": StepGraph(target, cfg, ctx, mtp=False)}
    if mtp is not None:
        _, mtp_weights = load_mtp(mtp, cfg)
        steps["mtp"] = StepGraph(MTPHead(target, mtp_weights, experts=moe.GGUFExperts.from_weights), cfg, ctx, mtp=True)
    return steps


def random_feeds(inputs: list[M.IOSpec], cfg: ModelConfig, ctx: int, T: int, rng: np.random.Generator) -> dict:
    feeds = OrderedDict()
    for s in inputs:
        shape = tuple(T if d == "T" else d for d in s.shape)
        if s.name == "tokens":
            feeds[s.name] = rng.integers(0, cfg.n_vocab, shape, dtype=np.int64)
        elif s.name == "start":
            feeds[s.name] = np.array(rng.integers(0, ctx - T + 1), np.int64)
        else:
            feeds[s.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _runners(role: str, step: StepGraph, graph: dict, manifest: M.Manifest):
    import onnxruntime as ort
    from polygraphy.backend.base import BaseRunner
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.common import TensorMetadata

    class TorchRunner(BaseRunner):
        def __init__(self):
            super().__init__(name=f"torch-{role}", prefix="torch-runner")

        def activate_impl(self):
            pass

        def deactivate_impl(self):
            pass

        def get_input_metadata_impl(self):
            meta = TensorMetadata()
            for s in graph["inputs"]:
                meta.add(s.name, np.dtype(s.dtype), [-1 if d == "T" else d for d in s.shape])
            return meta

        def infer_impl(self, feed_dict):
            args = [torch.from_numpy(np.asarray(feed_dict[s.name])) for s in graph["inputs"]]
            t0 = time.perf_counter()
            with torch.no_grad():
                out = step(*args)
            self.inference_time = time.perf_counter() - t0
            return OrderedDict((s.name, o.numpy()) for s, o in zip(graph["outputs"], out))

    sess = ort.InferenceSession(str(graph["file"]), moe.onnxruntime_session_options(),
                                providers=["CPUExecutionProvider"])
    return TorchRunner(), OnnxrtRunner(sess, name=f"onnxrt-{role}")


def compare(ref: dict, got: dict, graph: str, T: int, rounded_rows: bool) -> list[OutputCheck]:
    out = []
    for name, r in ref.items():
        r, g = np.asarray(r, np.float64), np.asarray(got[name], np.float64)
        if r.shape != g.shape:
            out.append(OutputCheck(graph, T, name, float("inf"), 1.0, False))
            continue
        scale = max(float(np.abs(r).max()), 1e-30)
        diff = np.abs(g - r)
        rel = float(diff.max() / scale)
        beyond = diff > TOL * scale
        flips = float(beyond.mean())
        ok = rel <= TOL
        if not ok and rounded_rows and name.startswith("rows."):
            ok = flips <= ROUNDING_FLIP_FRACTION and bool((diff <= TOL * scale + FP8_STEP * np.abs(r)).all())
        out.append(OutputCheck(graph, T, name, rel, flips, ok))
    return out


def check_engine(directory, gguf, mtp=None, T_values=T_VALUES, seed: int = 0, save_dir=None) -> list[OutputCheck]:
    """Run each graph of `directory` on random inputs in ONNX Runtime and in torch; returns one OutputCheck per
    (graph, T, output). With save_dir: polygraphy inputs / RunResults JSON per graph ({role}.inputs.json,
    {role}.outputs.json) for `polygraphy run ... --load-inputs ... --load-outputs ...` against TensorRT later."""
    from polygraphy.comparator import Comparator, SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    m = M.load(directory)               # either backend: a TensorRT directory keeps its ONNX graphs
    cfg = m.config()
    steps = reference_steps(gguf, mtp, m.numerics, m.ctx)
    rng = np.random.default_rng(seed)
    results: list[OutputCheck] = []
    for role, graph in m.graphs.items():
        if role not in steps:
            raise Ds4Error(f"--check needs the {role} GGUF (pass --mtp)")
        feeds = [random_feeds(graph["inputs"], cfg, m.ctx, T, rng) for T in T_values]
        kw = {}
        if save_dir is not None:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            kw = {"save_inputs_path": str(Path(save_dir) / f"{role}.inputs.json")}
        with G_LOGGER.verbosity(G_LOGGER.ERROR):
            run = Comparator.run(list(_runners(role, steps[role], graph, m)), data_loader=feeds, **kw)
        if save_dir is not None:
            with G_LOGGER.verbosity(G_LOGGER.ERROR):
                run.save(str(Path(save_dir) / f"{role}.outputs.json"))
        (_, ref_iters), (_, ort_iters) = list(run.items())
        # polygraphy's verdict at the element-wise bounds below (atol from the largest |ref| over the iterations)
        rounded = m.numerics == "ds4"
        atol = {s.name: TOL * max(float(np.abs(it[s.name]).max()) for it in ref_iters) for s in graph["outputs"]}
        rtol = {s.name: FP8_STEP if rounded and s.name.startswith("rows.") else 0.0 for s in graph["outputs"]}
        with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
            poly_ok = bool(Comparator.compare_accuracy(
                run, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol, check_error_stat="elemwise")))
        for T, ref, got in zip(T_values, ref_iters, ort_iters):
            for c in compare(dict(ref.items()), dict(got.items()), role, T, rounded):
                c.ok = c.ok and poly_ok
                results.append(c)
    return results
