"""TensorRT engines from an engine directory's ONNX graphs: ds4-build --backend tensorrt (after the ONNX export)
and ds4-build --from-onnx DIR --backend tensorrt (on the device: scripts/jetson_build.sh).

    build_engines(directory, manifest, options, progress) -> manifest   (backend "tensorrt", engines listed)
    rebuild(directory, options, progress)                               (the same from DIR/manifest.json)

Per graph (target.onnx, mtp.onnx): tensorrt_graph (a copy with ds4::MoE bound to our plugin, below) -> ONNX
parser -> strongly typed network -> one optimization profile per phase (plan_profiles) on every input with a
T dimension (cache inputs are static) -> build_serialized_network with a shared timing cache -> {role}.engine.
The ONNX graphs and weights.bin stay in the directory, so the engines can be rebuilt where they will run.

API (TensorRT 10.x Python; the same names in 11.x), https://docs.nvidia.com/deeplearning/tensorrt/latest/
inference-library/python-api-docs.html:
  - trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)): tensor
    types come from the graph (float32 everywhere; int64 indices; int32 plugin words). In 11.x every network
    is strongly typed and the flag is accepted but deprecated (migration guide tensorrt-10x-to-11x).
  - trt.OnnxParser(network, logger).parse(model_bytes, path): `path` locates the external weights
    (weights.bin) of the rewritten in-memory model (python/docstrings/parsers/pyOnnxDoc.h).
  - builder.create_optimization_profile(); profile.set_shape(name, min, opt, max);
    config.add_optimization_profile(profile): profile i of the engine is plan_profiles()[i].
  - config.create_timing_cache(bytes) / config.set_timing_cache(cache, ignore_mismatch=False) /
    cache.serialize(): the cache is reused across graphs and rebuilds (a mismatching cache is an error).
  - config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE) with --version-compatible: the plan embeds the lean
    runtime; loading needs runtime.engine_host_code_allowed = True; such an engine runs on this TensorRT
    version or a later one, not an earlier one, and may be slower (Advanced Topics, Version Compatibility).
    Untested here: whether a Python (JIT) plugin resolves inside the embedded lean runtime.
  - config.max_aux_streams = 0: one stream, so the Python plugin always runs on the stream the runtime
    captures CUDA graphs on.
  - builder.build_serialized_network(network, config) -> IHostMemory, or None on failure.
Every initializer becomes an engine constant, so each plan holds its graph's weights (expert blocks included):
the directory then holds the weights twice (weights.bin for rebuilding, the plans for running).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import TensorProto, helper

from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.plugins import moe
from ds4trt.plugins import moe_tensorrt as P

PROFILES = ("decode", "verify", "prefill")   # profile index order in every engine
DEFAULT_DRAFT_MAX = 8                        # ds4-run --mtp-draft accepts 1..8
DEFAULT_PREFILL_CHUNK = 256                  # runtime/session.py PREFILL_CHUNK (tests hold them equal)
ENGINE_FILES = {"target": "target.engine", "mtp": "mtp.engine"}
TIMING_CACHE = "timing.cache"
NOT_INSTALLED = "TensorRT is not installed (import tensorrt failed)"


@dataclass
class TrtOptions:
    mtp_draft_max: int = DEFAULT_DRAFT_MAX   # verify profile: T = 2 .. N + 1
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    version_compatible: bool = False
    timing_cache: Path | None = None         # default: DIR/timing.cache (read if present, then written)


def import_tensorrt():
    try:
        import tensorrt
    except ImportError:
        raise Ds4Error(NOT_INSTALLED) from None
    return tensorrt


def plan_profiles(ctx: int, mtp_draft_max: int = DEFAULT_DRAFT_MAX,
                  prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[dict]:
    """The optimization profiles of every engine, by phase: T ranges {"name", "min", "opt", "max"}.
      decode   T = 1            (target decode; the MTP head's recursive draft)
      verify   T = 2 .. N + 1   (N = mtp_draft_max: the pending token and up to N drafts; the MTP catch-up)
      prefill  T = 1 .. chunk   (prompt chunks; anything else up to the chunk)
    No profile exceeds ctx; a verify profile that would be empty (ctx 1) is left out."""
    if mtp_draft_max < 1:
        raise Ds4Error(f"--mtp-draft-max must be >= 1, got {mtp_draft_max}")
    if prefill_chunk < 1:
        raise Ds4Error(f"--prefill-chunk must be >= 1, got {prefill_chunk}")
    verify, chunk = min(mtp_draft_max + 1, ctx), min(prefill_chunk, ctx)
    out = [{"name": "decode", "min": 1, "opt": 1, "max": 1}]
    if verify >= 2:
        out.append({"name": "verify", "min": 2, "opt": verify, "max": verify})
    out.append({"name": "prefill", "min": 1, "opt": chunk, "max": chunk})
    return out


def profile_shapes(inputs: list[M.IOSpec], profile: dict) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shapes of every input with a T dimension under one profile; static inputs need none."""
    out = {}
    for s in inputs:
        if "T" in s.shape:
            out[s.name] = tuple(tuple(profile[k] if d == "T" else d for d in s.shape) for k in ("min", "opt", "max"))
    return out


def tensorrt_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of an exported step graph that TensorRT's ONNX parser binds to our plugin (plugins/moe_tensorrt.py
    explains each rule): every ds4::MoE node gets plugin_namespace = "ds4" and plugin_version = "1", and its
    three uint8 block initializers become INT32 initializers [bytes / 4] over the same external bytes. The
    attributes are checked (plugin_attributes), and so is that each block initializer has the contract's
    shape and feeds ds4::MoE nodes only. Nothing else changes."""
    model = copy.deepcopy(model)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    users: dict[str, set] = {}
    for n in graph.node:
        for name in n.input:
            users.setdefault(name, set()).add((n.domain, n.op_type))
    retyped: set[str] = set()
    for node in graph.node:
        if node.domain != moe.DOMAIN:
            continue
        where = f"graph {graph.name}: node {node.name or node.output[0]}"
        try:
            attrs = P.plugin_attributes(node)
        except ValueError as e:
            raise Ds4Error(f"{where}: {e}") from None
        if len(node.input) != len(moe.INPUTS):
            raise Ds4Error(f"{where}: expected {len(moe.INPUTS)} inputs {list(moe.INPUTS)}, got {len(node.input)}")
        for key, value in (("plugin_namespace", P.NAMESPACE), ("plugin_version", P.PLUGIN_VERSION)):
            for a in [a for a in node.attribute if a.name == key]:
                node.attribute.remove(a)
            node.attribute.append(helper.make_attribute(key, value))
        for name, shape in zip(node.input[3:], attrs.block_shapes()):
            t = inits.get(name)
            if t is None:
                raise Ds4Error(f"{where}: block input {name} is not an initializer")
            if name in retyped:
                continue
            if users[name] != {(moe.DOMAIN, moe.OP_TYPE)}:
                raise Ds4Error(f"{where}: block initializer {name} also feeds other nodes; it cannot be re-typed")
            if t.data_type != TensorProto.UINT8 or tuple(t.dims) != shape:
                raise Ds4Error(f"{where}: block initializer {name} is {TensorProto.DataType.Name(t.data_type)} "
                               f"{list(t.dims)}, the contract says UINT8 {list(shape)}")
            try:
                words = P.words_shape(shape)
            except ValueError as e:
                raise Ds4Error(f"{where}: {e}") from None
            t.data_type = TensorProto.INT32
            del t.dims[:]
            t.dims.extend(words)
            retyped.add(name)
    return model


def compute_capability() -> str:
    """"major.minor" of the GPU the engines are built on (the builder times tactics on it)."""
    import torch

    if not torch.cuda.is_available():
        raise Ds4Error("building TensorRT engines needs a CUDA GPU (torch.cuda.is_available() is False)")
    return "{}.{}".format(*torch.cuda.get_device_capability())


def error_logger(trt):
    """A trt.ILogger that keeps the errors (a failed build reports TensorRT's own first error in one line) and
    passes warnings and errors to stderr."""
    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR):
                self.errors.append(msg)
            if severity in (trt.ILogger.INTERNAL_ERROR, trt.ILogger.ERROR, trt.ILogger.WARNING):
                print(f"TensorRT: {msg}", file=sys.stderr)
    return Logger()


def build_engines(directory, manifest: dict, options: TrtOptions | None = None, progress=None) -> dict:
    """Build {role}.engine for every graph of the directory; returns `manifest` updated for backend "tensorrt"
    (the caller writes it). Needs TensorRT and a GPU."""
    trt = import_tensorrt()
    options = options or TrtOptions()
    directory = Path(directory)
    stage = progress.stage if progress is not None else (lambda text: None)
    P.register()
    logger = error_logger(trt)
    builder = trt.Builder(logger)
    profiles = plan_profiles(manifest["ctx"], options.mtp_draft_max, options.prefill_chunk)
    cache_path = Path(options.timing_cache) if options.timing_cache else directory / TIMING_CACHE
    cache = None
    engines = {}
    for role, g in manifest["graphs"].items():
        path = directory / g["file"]
        stage(f"TensorRT: parsing {path.name}")
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        model = tensorrt_graph(onnx.load(str(path), load_external_data=False))
        if not parser.parse(model.SerializeToString(), str(path)):
            first = str(parser.get_error(0)) if parser.num_errors else (logger.errors or ["no error reported"])[0]
            raise Ds4Error(f"{path}: TensorRT's ONNX parser failed ({parser.num_errors} errors): {first}")
        inputs = [M.IOSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in g["inputs"]]
        net_inputs = [network.get_input(i) for i in range(network.num_inputs)]
        dynamic = {t.name for t in net_inputs if -1 in tuple(t.shape)}
        want = {s.name for s in inputs if "T" in s.shape}
        if dynamic != want:
            raise Ds4Error(f"{path}: TensorRT sees dynamic inputs {sorted(dynamic)}, the manifest {sorted(want)}")
        config = builder.create_builder_config()
        if cache is None:
            cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
        if config.set_timing_cache(cache, ignore_mismatch=False) is False:   # another GPU's or version's cache
            print(f"ds4-build: note: {cache_path} was made for another GPU or TensorRT version; starting a new one",
                  file=sys.stderr)
            cache = config.create_timing_cache(b"")
            config.set_timing_cache(cache, ignore_mismatch=False)
        if options.version_compatible:
            config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        # one stream: the Python MoE plugin then always runs on the stream the runtime captures CUDA graphs on,
        # whose private torch memory pool covers the plugin's temporaries (auxiliary streams would not be)
        config.max_aux_streams = 0
        for p in profiles:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile_shapes(inputs, p).items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
        ranges = ", ".join("{} T {}..{}".format(p["name"], p["min"], p["max"]) for p in profiles)
        stage(f"TensorRT: building the {role} engine (profiles {ranges})")
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            first = (logger.errors or ["no error reported"])[0]
            raise Ds4Error(f"{path}: TensorRT could not build the engine: {first}")
        engine_path = directory / ENGINE_FILES[role]
        with open(engine_path, "wb") as f:
            f.write(plan)
        engines[role] = engine_path.name
        manifest["files"][engine_path.name] = M.file_entry(engine_path)
    cache_path.write_bytes(cache.serialize())
    manifest["backend"] = "tensorrt"
    manifest.setdefault("tools", {})["tensorrt"] = trt.__version__
    manifest["tensorrt"] = {
        "version": trt.__version__, "compute_capability": compute_capability(),
        "version_compatible": bool(options.version_compatible), "engines": engines, "profiles": profiles,
        "plugins": [{"name": P.NAME, "namespace": P.NAMESPACE, "version": P.PLUGIN_VERSION,
                     "implementation": "tensorrt.plugin JIT (plugins/moe_tensorrt.py -> kernels/moe_triton.py)"}],
        "timing_cache": str(cache_path.name if cache_path.parent == directory else cache_path),
    }
    return manifest


def rebuild(directory, options: TrtOptions | None = None, progress=None) -> M.Manifest:
    """ds4-build --from-onnx DIR --backend tensorrt: (re)build DIR's engines in place from its ONNX graphs
    (an onnxruntime or a tensorrt engine directory), then rewrite DIR/manifest.json."""
    import json

    import_tensorrt()
    m = M.load(directory)                        # every listed file present and unchanged
    data = json.loads(json.dumps(m.data))
    for name in ENGINE_FILES.values():
        data["files"].pop(name, None)
    # until the new engines are written the directory is the plain ONNX export, so a failed build leaves it usable
    data["backend"], data["tensorrt"] = "onnxruntime", {"version": None, "compute_capability": None}
    M.write(m.directory, data)
    M.write(m.directory, build_engines(m.directory, data, options, progress))
    return M.load(m.directory, verify_hashes=False)


def compare_with_saved(directory, check_dir=None) -> list:
    """The engines on the inputs `ds4-build --check` saved (check/{role}.inputs.json) against the ONNX Runtime
    outputs saved beside them, with polygraphy's TrtRunner (one per profile) and export/check.py's tolerances.
    Returns check.OutputCheck rows (graph, T, output, rel, flips, ok)."""
    import numpy as np
    from polygraphy.backend.trt import TrtRunner
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    from ds4trt.export.check import compare

    trt = import_tensorrt()
    P.register()
    m = M.load(directory)
    info = M.tensorrt_info(m)
    check_dir = Path(check_dir) if check_dir else m.directory / "check"
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    runtime.engine_host_code_allowed = info.version_compatible
    results = []
    for role, engine_path in info.engines.items():
        feeds = load_json(str(check_dir / f"{role}.inputs.json"))
        saved = RunResults.load(str(check_dir / f"{role}.outputs.json"))
        ort_iters = next(iters for name, iters in saved.items() if name.startswith("onnxrt"))
        engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
        for feed, ref in zip(feeds, ort_iters):
            T = int(np.asarray(feed["tokens"]).shape[0])
            with TrtRunner(engine, optimization_profile=info.profile_for(T)) as runner:
                got = runner.infer(feed)
            results += compare(dict(ref.items()), got, role, T, rounded_rows=m.numerics == "ds4")
    return results

