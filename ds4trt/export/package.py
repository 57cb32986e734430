"""ds4-build's work: GGUF files -> an engine directory (export/manifest.py describes its layout).

    report = build(gguf, out, mtp=None, backend="onnxruntime", ctx=4096, numerics="ds4", progress=None)

Steps: open and validate the GGUFs; trace the target (and MTP) step on placeholder weights; stream the weights
into weights.bin (each tensor once) while attaching them to the graphs; onnx.checker; save the tokenizer; hash
the sources and outputs; write manifest.json. The TensorRT op-support check runs on the saved graphs.
"""

from __future__ import annotations

import platform
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.export import onnx as X
from ds4trt.export.tensorrt import TrtOptions, build_engines, import_tensorrt
from ds4trt.export.trt_ops import check_tensorrt_ops
from ds4trt.model.transformer import NUMERICS
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.plugins import moe
from ds4trt.tokenizer import ASSISTANT, BOS, END_THINK, EOS, THINK, USER, Tokenizer

WEIGHTS, TOKENIZER = "weights.bin", "tokenizer.json"
GRAPH_FILES = {"target": "target.onnx", "mtp": "mtp.onnx"}


class Progress:
    """What build() reports; the CLI draws it (tqdm). Defaults do nothing."""

    def stage(self, text: str) -> None:
        pass

    def start_bytes(self, text: str, total: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass


@dataclass
class BuildReport:
    out: Path
    files: dict[str, int]                              # name -> bytes
    graphs: dict[str, dict] = field(default_factory=dict)   # role -> {"nodes", "initializers", "moe_nodes", "ops"}
    trt_problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _versions() -> dict[str, str]:
    import gguf
    import numpy
    import onnx
    import torch

    import ds4trt

    out = {"ds4trt": ds4trt.__version__, "python": platform.python_version(), "torch": torch.__version__,
           "onnx": onnx.__version__, "numpy": numpy.__version__, "gguf": _dist_version("gguf", gguf)}
    try:
        import onnxruntime
        out["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    return out


def _dist_version(dist: str, module) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001 - a version string is informational
        return getattr(module, "__version__", "unknown")


def _require_backend(backend: str) -> None:
    if backend not in M.BACKENDS:
        raise Ds4Error(f"--backend must be one of {', '.join(M.BACKENDS)}, got {backend!r}")
    if backend == "tensorrt":
        import_tensorrt()                    # the one-line error where TensorRT is missing


def _chat_settings(tok: Tokenizer) -> dict:
    ids = {"bos": BOS, "eos": EOS, "user": USER, "assistant": ASSISTANT, "think": THINK, "end_think": END_THINK}
    return {"template": "ds4"} | {k: tok.token_id(s) for k, s in ids.items()}


def build(gguf, out, mtp=None, backend: str = "onnxruntime", ctx: int = 4096, numerics: str = "ds4",
          progress: Progress | None = None, trt: TrtOptions | None = None) -> BuildReport:
    """The ONNX engine directory, and for backend "tensorrt" its engines (export/tensorrt.py): the directory is
    first written as an onnxruntime one, so a failed TensorRT build leaves the export usable (--from-onnx)."""
    t0 = time.perf_counter()
    progress = progress or Progress()
    _require_backend(backend)
    if numerics not in NUMERICS:
        raise Ds4Error(f"--numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    gguf, out = Path(gguf), Path(out)
    if out.exists() and not out.is_dir():
        raise Ds4Error(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / M.MANIFEST).unlink(missing_ok=True)        # a half-written directory never looks like an engine

    progress.stage("reading GGUF")
    target_file, cfg, weights = load_target(gguf)
    mtp_file = mtp_weights = None
    if mtp is not None:
        mtp_file, mtp_weights = load_mtp(mtp, cfg)
    if ctx < X.min_ctx(cfg):
        raise Ds4Error(f"--ctx {ctx} is too small for this model: the indexer keeps the top {cfg.index_top_k} "
                       f"compressed rows, which needs --ctx >= {X.min_ctx(cfg)}")
    tokenizer = Tokenizer.from_gguf(target_file)

    sources: dict[int, X.Source] = {}
    target, head = X.build_step_modules(cfg, weights, mtp_weights, numerics, sources)
    roles = {"target": X.StepGraph(target, cfg, ctx, mtp=False)}
    if head is not None:
        roles["mtp"] = X.StepGraph(head, cfg, ctx, mtp=True)
    traced = {}
    for role, module in roles.items():
        progress.stage(f"tracing the {role} step")
        traced[role] = X.trace_to_onnx(module, cfg, ctx, role == "mtp", out / GRAPH_FILES[role])

    total = sum({s.name: s.nbytes for s in sources.values()}.values())
    progress.start_bytes("writing weights", total)
    wfile = X.WeightsFile(out / WEIGHTS, progress.advance)
    report = BuildReport(out, {})
    graphs_json = {}
    try:
        for role, model in traced.items():
            X.finish_graph(model, roles[role], cfg, ctx, role == "mtp", out / GRAPH_FILES[role], sources, wfile)
    finally:
        wfile.close()
    files = {WEIGHTS: M.file_entry(out / WEIGHTS, wfile.sha256())}
    progress.stage("checking graphs")
    for role, model in traced.items():
        path = out / GRAPH_FILES[role]
        X.check_saved(path)
        inputs, outputs = X.step_io(cfg, ctx, role == "mtp")
        graphs_json[role] = {"file": path.name, "inputs": [s.to_json() for s in inputs],
                             "outputs": [s.to_json() for s in outputs]}
        files[path.name] = M.file_entry(path)
        report.graphs[role] = X.graph_summary(model)
        report.trt_problems += [f"{path.name}: {p}" for p in check_tensorrt_ops(model)]
    tokenizer.save(out / TOKENIZER)
    files[TOKENIZER] = M.file_entry(out / TOKENIZER)

    sources_json = []
    for role, f in (("target", target_file), ("mtp", mtp_file)):
        if f is None:
            continue
        progress.start_bytes(f"hashing {f.path.name}", f.file_size)
        sources_json.append({"role": role, "file": f.path.name, "size": f.file_size,
                             "sha256": M.sha256_file(f.path, progress.advance)})
    manifest = {
        "format": M.FORMAT, "format_version": M.FORMAT_VERSION, "backend": "onnxruntime",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "tools": _versions(), "tensorrt": {"version": None, "compute_capability": None},
        "sources": sources_json,
        "model": asdict(cfg) | {"compress_ratios": list(cfg.compress_ratios)},
        "numerics": numerics, "ctx": ctx, "opset": X.OPSET,
        "custom_ops": [{"domain": moe.DOMAIN, "op_type": moe.OP_TYPE, "version": moe.VERSION}],
        "dims": {"T": {"min": 1, "max": ctx}},
        "graphs": graphs_json, "files": files,
        "tokenizer": {"file": TOKENIZER, "n_vocab": tokenizer.n_vocab},
        "chat": _chat_settings(tokenizer),
    }
    M.write(out, manifest)
    if backend == "tensorrt":
        M.write(out, build_engines(out, manifest, trt, progress))
    report.files = {name: e["size"] for name, e in files.items()} | {M.MANIFEST: (out / M.MANIFEST).stat().st_size}
    report.seconds = time.perf_counter() - t0
    for f in (target_file, mtp_file):
        if f is not None:
            f.close()
    return report
