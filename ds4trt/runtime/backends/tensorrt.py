"""TensorRT backend: the engines of a `ds4-build --backend tensorrt` directory behind the Transformer.forward /
MTPHead.forward signatures, so runtime/session.py and runtime/speculative.py run on it unchanged.

    engine = open_engine("engines/demo-trt")      # manifest + TensorRT/GPU match checked, engines deserialized
    s = engine.session()                          # a TrtSession: the target caches live in the engine's buffers
    ...                                           # Session API as usual (prefill, eval, eval_speculative_argmax)
    engine.close()                                # frees the device buffers

Execution contexts: one per optimization profile of each engine (export/tensorrt.py plan_profiles), i.e. per
phase: target decode (T = 1), target verify (T = 2..N+1), target prefill (T = 1..chunk), and on the MTP engine
draft (T = 1), catch-up after a verify (T = 2..N+1) and prefill catch-up. A step of T tokens runs on
TensorRTInfo.profile_for(T). Every context of an engine shares one block of context memory (USER_MANAGED; they
never run at the same time: one stream) and binds every I/O tensor once, at fixed addresses in the engine's
DeviceArena (runtime/buffers.py), T dimensions planned at the largest profile.

Where data lives, per call:
  - target caches (KV ring, compressed rows, compressor and indexer state): IN PLACE. TrtSession adopts its
    CacheState into the arena's cache.* slots (the tensors become views of them); the engine reads them at
    their bound addresses with no copy, and CacheState.commit writes the accepted rows into the same memory.
  - engine outputs never alias inputs: the graphs have no cache outputs. They propose rows.* [T, w]; rejected
    rows are simply not committed (rollback by not writing), so TensorRT's input/output aliasing (KV-cache
    update layers, aliased plugin I/O) is neither needed nor used.
  - any other caches (the MTP drafter's ring and its scratch copy, or a session that is not a TrtSession):
    STAGED, copied into the arena slots before the step (device to device: for the MTP head one ring of
    (window - 1) x head_dim floats, 254 KiB at Flash width, per draft call).
  - tokens, start, h: staged (T int64s, one int64, T x n_hc x n_embd floats).
  - rows.*: returned as views of the arena, valid until the next call of the same engine (every caller,
    Session.commit and the drafter, commits them at once). logits and hc are cloned on the caller's stream
    (they outlive the call: Session.logits, the drafter's pending states): T x (n_vocab + n_hc x n_embd) x 4
    bytes per call, about 0.6 MB per token at Flash width (with last_only, logits are one row).
Streams: the engine runs on its own stream, ordered after the caller's current torch stream and before it
(wait_stream both ways), so commits and clones by torch stay ordered with the engine, with no host sync.

CUDA graphs (STYLE habit 6): the decode, verify and draft contexts capture one graph per token count the first
time it is seen, after that call ran eagerly once (the warm-up TensorRT asks for after a shape or address
change, then capture of execute_async_v3 on a non-default stream: the TensorRT developer guide's "CUDA Graphs"
best practice, summarized with its sources in shared/spec/anchors.md section 4e; not run here).
Capture goes through torch.cuda.graph on the engine's stream, so the torch temporaries the Python MoE plugin
allocates during capture come from the graph's private pool and stay reserved for it. Prefill chunks run
eagerly. A capture that fails (an unsupported call in a kernel launcher) leaves that phase eager, with one note.

One session per engine at a time: a new TrtSession (or a rewind) adopts the engine's cache buffers; a step from
an older session whose caches still view them is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.model.config import ModelConfig
from ds4trt.model.state import LayerRows
from ds4trt.runtime.buffers import DeviceArena, device_compute_capability, plan_buffers
from ds4trt.runtime.cache import CacheState
from ds4trt.runtime.session import Engine, Session
from ds4trt.tokenizer import Tokenizer

BACKEND = "tensorrt"
REBUILD = "scripts/jetson_build.sh"
GRAPH_PHASES = ("decode", "verify")          # profiles whose contexts capture CUDA graphs


def _version(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits or digits != part:
            break
        out.append(int(digits))
    return tuple(out)


def compatibility_problem(info: M.TensorRTInfo, trt_version: str | None, compute_capability: str | None,
                          directory="DIR") -> str | None:
    """None if engines of `info` run here, else the one-line reason. TensorRT plans run only on the TensorRT
    version that built them (major.minor.patch), or with version compatibility on that version or a later one
    ("engines built with newer versions do not work with older runtimes"); and only on the GPU architecture
    they were built for (no hardware-compatibility mode here: it is not available on Jetson)."""
    built, here = _version(info.version), _version(trt_version) if trt_version else ()
    if info.version_compatible:
        version_ok = bool(here) and here[:3] >= built[:3]
    else:
        version_ok = bool(here) and here[:3] == built[:3]
    if version_ok and compute_capability == info.compute_capability:
        return None
    vc = " (version-compatible)" if info.version_compatible else ""
    return (f"engines built with TensorRT {info.version}{vc} for compute capability {info.compute_capability}; "
            f"this machine has TensorRT {trt_version or 'none'} / GPU {compute_capability or 'none'}: "
            f"rebuild with {REBUILD} {directory}")


def _gpu_compute_capability() -> str | None:
    cc = device_compute_capability()
    if cc is None and torch.cuda.is_available():
        cc = "{}.{}".format(*torch.cuda.get_device_capability())
    return cc


def _trt_version() -> tuple[object, str | None]:
    try:
        import tensorrt
    except ImportError:
        return None, None
    return tensorrt, tensorrt.__version__


class TrtStep:
    """One engine (target or MTP): its contexts (one per profile), its arena, its stream and CUDA graphs."""

    def __init__(self, trt, runtime, path: Path, cfg: ModelConfig, ctx: int, inputs: list[M.IOSpec],
                 outputs: list[M.IOSpec], info: M.TensorRTInfo, cuda_graphs: bool = True):
        self.path, self.cfg, self.ctx, self.info = Path(path), cfg, ctx, info
        self.inputs, self.outputs, self.cuda_graphs = inputs, outputs, cuda_graphs
        self.engine = runtime.deserialize_cuda_engine(self.path.read_bytes())
        if self.engine is None:
            raise Ds4Error(f"{self.path}: TensorRT could not deserialize the engine (see its messages above)")
        self._check_io(trt)
        self.plan = plan_buffers(inputs, outputs, max(p["max"] for p in info.profiles))
        self.arena = DeviceArena(self.plan, self.engine.device_memory_size_v2)
        self.stream = torch.cuda.Stream()
        self.contexts = []
        # USER_MANAGED + set_device_memory(ptr, size): "256-byte aligned device memory ... at least as large as
        # device_memory_size_v2 ... in use until enqueue returns; using the same memory for a parallel execution
        # context" is undefined (python/docstrings/infer/pyCoreDoc.h, TensorRT >= 10.1). Our contexts never run in
        # parallel (one stream), so they share one block: the largest profile's, not one per context.
        strategy = trt.ExecutionContextAllocationStrategy.USER_MANAGED
        for i in range(len(info.profiles)):
            c = self.engine.create_execution_context(strategy)
            c.set_device_memory(self.arena.scratch, self.arena.scratch_bytes)
            c.set_optimization_profile_async(i, self.stream.cuda_stream)
            for name in self.plan.slots:
                c.set_tensor_address(name, self.arena.address(name))
            self.contexts.append(c)
        self.stream.synchronize()
        self.shape_set = [None] * len(self.contexts)            # T last given to each context
        self.graphs: dict[tuple[int, int], object] = {}          # (profile, T) -> torch.cuda.CUDAGraph | None
        self.cache_names = [s.name for s in inputs if s.name.startswith("cache.")]
        self.dynamic = [s.name for s in inputs if "T" in s.shape]
        self.row_fields = M.row_fields(outputs)
        self.owner = None                                        # the adopted CacheState's layers

    def _check_io(self, trt) -> None:
        """The engine's I/O tensors and profiles are the manifest's (names, directions, types, shapes)."""
        e = self.engine
        dtypes = {"float32": trt.DataType.FLOAT, "int64": trt.DataType.INT64}
        have = {e.get_tensor_name(i) for i in range(e.num_io_tensors)}
        want = [(s, trt.TensorIOMode.INPUT) for s in self.inputs] + [(s, trt.TensorIOMode.OUTPUT) for s in self.outputs]
        if have != {s.name for s, _ in want}:
            raise Ds4Error(f"{self.path}: engine tensors {sorted(have)} differ from the manifest's graph I/O")
        for s, mode in want:
            shape = [-1 if d == "T" else d for d in s.shape]
            got = (e.get_tensor_mode(s.name), e.get_tensor_dtype(s.name), list(e.get_tensor_shape(s.name)))
            if got != (mode, dtypes[s.dtype], shape):
                raise Ds4Error(f"{self.path}: tensor {s.name} is {got[1]} {got[2]} in the engine, the manifest says "
                               f"{s.dtype} {list(s.shape)}")
        if e.num_optimization_profiles != len(self.info.profiles):
            raise Ds4Error(f"{self.path}: {e.num_optimization_profiles} optimization profiles, the manifest lists "
                           f"{len(self.info.profiles)}")
        for i, p in enumerate(self.info.profiles):
            lo, opt, hi = (list(x)[0] for x in e.get_tensor_profile_shape("tokens", i))
            if (lo, opt, hi) != (p["min"], p["opt"], p["max"]):
                raise Ds4Error(f"{self.path}: profile {i} takes T {lo}..{hi}, the manifest says {p['min']}..{p['max']}")

    # ---- caches ----
    def adopt(self, cache: CacheState) -> CacheState:
        """Move a CacheState into this engine's cache slots: each tensor is copied there (unless it already is)
        and replaced by a view of its slot. Later steps on it read the caches in place."""
        for layer_index, layer in enumerate(cache.layers):
            for f, t in layer.tensors().items():
                name = f"cache.{layer_index}.{f}"
                if name not in self.plan.slots:
                    raise Ds4Error(f"{self.path}: the session's cache has {name}, the engine does not")
                view = self.arena.view(name)
                if tuple(t.shape) != tuple(view.shape):
                    raise Ds4Error(f"{self.path}: {name} has shape {list(t.shape)}, the engine was built for "
                                   f"{list(view.shape)} (ctx {self.ctx}): open the session with ctx {self.ctx}")
                if t.data_ptr() != view.data_ptr():
                    view.copy_(t)
                setattr(layer, f, view)
        self.owner = cache.layers
        return cache

    def _stage_caches(self, caches) -> None:
        flat = [(f"cache.{i}.{f}", t) for i, c in enumerate(caches) for f, t in c.tensors().items()]
        if [name for name, _ in flat] != self.cache_names:
            raise Ds4Error(f"{self.path}: expects caches {self.cache_names}, got {[name for name, _ in flat]}")
        if caches is self.owner:
            return                                   # adopted: already in place
        for name, t in flat:
            if self.arena.owns(t.data_ptr()):
                raise Ds4Error(f"{self.path}: this session's caches were taken over by a newer session of the same "
                               "TensorRT engine (one session at a time)")
            view = self.arena.view(name)
            if tuple(t.shape) != tuple(view.shape):
                raise Ds4Error(f"{self.path}: {name} has shape {list(t.shape)}, the engine was built for "
                               f"{list(view.shape)} (ctx {self.ctx}): open the session with ctx {self.ctx}")
            view.copy_(t)

    # ---- one step ----
    def _run(self, feeds: dict[str, torch.Tensor], caches, last_only: bool):
        T = int(feeds["tokens"].shape[0])
        prof = self.info.profile_for(T)
        for name, t in feeds.items():
            self.arena.view(name, T).copy_(t.reshape(self.plan.slots[name].shape_for(T)))
        self._stage_caches(caches)
        ctx = self.contexts[prof]
        if self.shape_set[prof] != T:
            for name in self.dynamic:
                ctx.set_input_shape(name, self.plan.slots[name].shape_for(T))
            self.shape_set[prof] = T
        caller = torch.cuda.current_stream()
        self.stream.wait_stream(caller)
        self._execute(prof, T)
        caller.wait_stream(self.stream)
        logits = self.arena.view("logits", T)
        logits = (logits[-1:] if last_only else logits).clone()
        hc = self.arena.view("hc", T).clone()
        it = iter(self.arena.view(s.name, T) for s in self.outputs if s.name.startswith("rows."))
        rows = [LayerRows(**{f: next(it) for f in fields}) for fields in self.row_fields]
        return logits, hc, rows

    def _execute(self, prof: int, T: int) -> None:
        graph = self.graphs.get((prof, T))
        if graph is not None:
            with torch.cuda.stream(self.stream):
                graph.replay()
            return
        if not self.contexts[prof].execute_async_v3(self.stream.cuda_stream):
            raise Ds4Error(f"{self.path}: TensorRT execution failed ({self.info.profiles[prof]['name']}, T = {T})")
        if (prof, T) not in self.graphs and self.cuda_graphs and self.info.profiles[prof]["name"] in GRAPH_PHASES:
            self.graphs[(prof, T)] = self._capture(prof, T)      # the run above was the warm-up

    def _capture(self, prof: int, T: int):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                if not self.contexts[prof].execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError("execute_async_v3 returned false during capture")
        except RuntimeError as e:
            print(f"ds4-run: note: {self.path.name} {self.info.profiles[prof]['name']} T={T}: CUDA graph capture "
                  f"failed ({str(e).splitlines()[0]}); this phase runs without a graph", file=sys.stderr)
            return None
        return graph

    def close(self) -> None:
        self.graphs.clear()
        self.contexts.clear()
        self.owner = None
        self.arena.close()


class TrtTarget(TrtStep):
    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, caches, last_only: bool = False,
                 indexer: bool = True):
        """Transformer.forward: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows (the engine always runs the
        indexer: `indexer` changes nothing)."""
        return self._run({"tokens": tokens, "start": start}, caches, last_only)


class TrtMTP(TrtStep):
    def __call__(self, tokens: torch.Tensor, h: torch.Tensor, start: torch.Tensor, caches, last_only: bool = False,
                 indexer: bool = True):
        """MTPHead.forward: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows."""
        return self._run({"tokens": tokens, "h": h, "start": start}, caches, last_only)


class TrtSession(Session):
    """A Session whose target caches live in the engine's buffers (TrtStep.adopt)."""

    def __init__(self, engine: "TrtEngine", ctx: int):
        super().__init__(engine, ctx)
        self.cache = engine.model.adopt(self.cache)

    def rewind(self, pos: int) -> None:
        """Session.rewind (the kept prefix is replayed, staged through the buffers), then the caches move back in."""
        super().rewind(pos)
        self.cache = self.engine.model.adopt(self.cache)


class TrtEngine(Engine):
    DEVICE = "cuda"                   # where sessions keep tokens and the caches they stage (tests: a CPU stand-in)

    def __init__(self, target: TrtTarget, tokenizer: Tokenizer, mtp: TrtMTP | None, source: str,
                 info: M.TensorRTInfo):
        super().__init__(target, tokenizer, mtp, source, dtype=torch.float32, device=self.DEVICE,
                         prefill_chunk=max(p["max"] for p in info.profiles))     # the widest profile: prefill
        self.info, self.steps = info, [s for s in (target, mtp) if s is not None]

    def session(self, ctx: int | None = None) -> TrtSession:
        return TrtSession(self, self.model.ctx if ctx is None else ctx)

    def close(self) -> None:
        for s in self.steps:
            s.close()


def open_engine(directory, verify_hashes: bool = True, cuda_graphs: bool = True) -> TrtEngine:
    """A TrtEngine over the directory's engines. Refuses, in one line: a directory of another backend, malformed
    TensorRT fields, and engines built for another TensorRT version or GPU compute capability."""
    from ds4trt.plugins import moe_tensorrt

    m = M.load(directory, verify_hashes)
    if m.backend != BACKEND:
        raise Ds4Error(f"{m.directory / M.MANIFEST}: backend {m.backend!r} cannot be loaded by the {BACKEND} runtime "
                       f"(build engines with ds4-build --from-onnx {m.directory} --backend {BACKEND})")
    info = M.tensorrt_info(m)
    trt, version = _trt_version()
    problem = compatibility_problem(info, version, _gpu_compute_capability(), m.directory)
    if problem is not None:
        raise Ds4Error(f"{m.directory}: {problem}")
    cfg = m.config()
    tokenizer = Tokenizer.from_file(m.directory / m.data["tokenizer"]["file"])
    moe_tensorrt.register()                     # the engines' plugin must be in the registry to deserialize them
    runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
    runtime.engine_host_code_allowed = info.version_compatible   # a version-compatible plan's lean runtime
    steps = {}
    try:
        for role, cls in (("target", TrtTarget), ("mtp", TrtMTP)):
            if role in m.graphs:
                g = m.graphs[role]
                steps[role] = cls(trt, runtime, info.engines[role], cfg, m.ctx, g["inputs"], g["outputs"], info,
                                  cuda_graphs)
    except BaseException:
        for s in steps.values():
            s.close()
        raise
    return TrtEngine(steps["target"], tokenizer, steps.get("mtp"), str(m.directory), info)
