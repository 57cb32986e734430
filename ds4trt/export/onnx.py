"""The step functions as ONNX graphs (TorchScript exporter), with weights as external data written tensor by tensor.

    target step   tokens [T] int64, start [] int64, cache.{l}.{field} ...  ->  logits [T, V], hc [T, S, D],
                                                                              rows.{l}.{field} [T, w]
    MTP step      tokens [T], h [T, S, D], start [], cache.0.raw          ->  logits, hc, rows.0.raw
One graph per step function serves prefill chunks, decode (T = 1) and verify (T = drafts + 1); only T is dynamic.
Cache shapes are fixed by the context size (`ctx`) the graphs are exported for (runtime/cache.py CacheState).

Memory: the model is traced on placeholder weights (uninitialised tensors: no page is touched, so they cost no
RSS) whose identity records the GGUF tensor each parameter stands for; the exporter runs with export_params=False,
so parameters become graph inputs, which `attach_weights` turns into initializers whose bytes are written to one
external-data file, one tensor (in row chunks) at a time, straight from the GGUF. At no time does the process hold
the model's weights. Tensors two graphs share (the token embedding and LM head, used by the MTP head) are written
once and referenced by both graphs at the same offset.

Weights in the graph: every non-expert tensor is a float32 initializer equal to Weights.get(name) (F16 and Q8_0
dequantized exactly); routed experts stay GGUF blocks (uint8) consumed by the ds4::MoE op (plugins/moe.py); I32
tensors (ffn_gate_tid2eid) are graph constants (V x k int64, a few MB).

Op set 17. Three torch ops have no (or no usable) ONNX export and get symbolics here, all TensorRT-parsable:
  aten::frexp, aten::ldexp  exact powers of two by a 279-entry table lookup (Gather), with the exponent from
                            Floor(Log2) corrected by two exact comparisons: FP8/FP4 scales stay bit-exact;
  aten::sort (stable)       TopK over the whole axis: ONNX TopK orders equal values by lower index first, which
                            is exactly torch's stable descending sort; followed by a constant slice [:k] it is
                            fused to TopK(K=k) (TensorRT requires K < 3840; the indexer sorts ctx/4 rows).
Graph passes after tracing (the exporter's constant folding is off: it would evaluate ops on the weights):
fold_constants (index arithmetic on Python ints and static shapes, double scalars), rope_tables (the float64
RoPE angles become Gathers from float32 tables of the same values, TensorRT having no float64 math),
fuse_topk_slices, integer_clips_to_min_max (TensorRT's Clip is float only). export/trt_ops.py then checks
every node against TensorRT's ONNX support matrix.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import TensorProto, helper

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import dequantize, dequantize_rows, raw_rows
from ds4trt.model.config import ModelConfig
from ds4trt.model.mtp import MTPHead
from ds4trt.export.manifest import IOSpec
from ds4trt.model.state import LayerCache
from ds4trt.model.state import cache_shapes as state_cache_shapes
from ds4trt.model.transformer import Transformer
from ds4trt.plugins import moe

OPSET = 17
CUSTOM_OPSETS = {moe.DOMAIN: moe.VERSION}
TRACE_T, TRACE_START = 3, 5      # example step used for tracing (T >= 2 so nothing specializes on T == 1)
ALIGN = 4096                     # external-data offsets: page aligned, so ONNX Runtime can map them
CHUNK_BYTES = 64 << 20           # write tensors in row chunks of about this size

ONNX_DTYPES = {"float32": TensorProto.FLOAT, "int64": TensorProto.INT64, "uint8": TensorProto.UINT8}


# ---------------------------------------------------------------------------------------------------
# Graph inputs and outputs

def cache_shapes(cfg: ModelConfig, ctx: int, mtp: bool = False) -> list[dict[str, tuple[int, int]]]:
    """model/state.py cache_shapes of the target's layers, or of the MTP head (one ratio-0 layer)."""
    return state_cache_shapes(cfg, ctx, [0] if mtp else cfg.compress_ratios)


def step_io(cfg: ModelConfig, ctx: int, mtp: bool = False) -> tuple[list[IOSpec], list[IOSpec]]:
    """Inputs and outputs of the target (or MTP) step graph exported for `ctx` positions."""
    hc_shape = ("T", cfg.n_hc, cfg.n_embd)
    inputs = [IOSpec("tokens", "int64", ("T",))]
    if mtp:
        inputs.append(IOSpec("h", "float32", hc_shape))
    inputs.append(IOSpec("start", "int64", ()))
    outputs = [IOSpec("logits", "float32", ("T", cfg.n_vocab)), IOSpec("hc", "float32", hc_shape)]
    for l, shapes in enumerate(cache_shapes(cfg, ctx, mtp)):
        for f, shape in shapes.items():
            inputs.append(IOSpec(f"cache.{l}.{f}", "float32", shape))
            outputs.append(IOSpec(f"rows.{l}.{f}", "float32", ("T", shape[1])))
    return inputs, outputs


class StepGraph(nn.Module):
    """Transformer.forward / MTPHead.forward with flat tensor arguments and results (what an exporter traces):
    forward(tokens, [h,] start, *cache tensors) -> (logits, hc, *row tensors), in step_io order."""

    def __init__(self, step: nn.Module, cfg: ModelConfig, ctx: int, mtp: bool):
        super().__init__()
        self.step, self.mtp = step, mtp
        self.fields = [list(layer) for layer in cache_shapes(cfg, ctx, mtp)]
        if mtp:      # the head reads the target's embedding and LM head: make them this module's parameters
            self.embed, self.output = step.target[0].embed, step.target[0].output

    def forward(self, tokens, *args):
        h, args = (args[0], args[1:]) if self.mtp else (None, args)
        start, flat = args[0], iter(args[1:])
        caches = [LayerCache(**{f: next(flat) for f in fs}) for fs in self.fields]
        logits, hc, rows = self.step(tokens, h, start, caches) if self.mtp else self.step(tokens, start, caches)
        return (logits, hc, *(getattr(r, f) for r, fs in zip(rows, self.fields) for f in fs))


# ---------------------------------------------------------------------------------------------------
# Symbolics: frexp / ldexp (exact powers of two), stable sort (TopK)

_POW2_OFFSET = 150                                     # table[i] = 2 ** (i - 150), i in [0, 278]; 2**128 = inf
with np.errstate(over="ignore"):
    _POW2 = torch.from_numpy(np.ldexp(np.float64(1.0), np.arange(-_POW2_OFFSET, 129)).astype(np.float32))


def _const(g, value):
    return g.op("Constant", value_t=torch.as_tensor(value))


def _pow2(g, e):
    """2.0 ** e for an int64 tensor e, exactly (e clamped to [-150, 128])."""
    i64 = lambda v: _const(g, torch.tensor(v, dtype=torch.int64))  # noqa: E731
    idx = g.op("Add", g.op("Min", g.op("Max", e, i64(-_POW2_OFFSET)), i64(128)), i64(_POW2_OFFSET))
    return g.op("Gather", _const(g, _POW2), idx, axis_i=0)


def _frexp(g, x):
    """torch.frexp for finite float32 x: x = m * 2**e, |m| in [0.5, 1) (m = e = 0 for x = 0, sign not kept)."""
    i64 = lambda v: _const(g, torch.tensor(v, dtype=torch.int64))  # noqa: E731
    ax = g.op("Abs", x)
    f = g.op("Floor", g.op("Div", g.op("Log", ax), _const(g, torch.tensor(math.log(2.0), dtype=torch.float32))))
    f = g.op("Cast", g.op("Clip", f, _const(g, torch.tensor(-149.0)), _const(g, torch.tensor(127.0))),
             to_i=TensorProto.INT64)
    # f ~ floor(log2 |x|) up to rounding of Log: make 2**f <= |x| < 2**(f+1) exact
    up = g.op("Cast", g.op("GreaterOrEqual", ax, _pow2(g, g.op("Add", f, i64(1)))), to_i=TensorProto.INT64)
    down = g.op("Cast", g.op("Less", ax, _pow2(g, f)), to_i=TensorProto.INT64)
    e = g.op("Add", g.op("Sub", g.op("Add", f, up), down), i64(1))
    # m = x * 2**-e in two exact steps (2**-e alone over- or underflows at the ends of the float range)
    ne = g.op("Neg", e)
    half = g.op("Div", ne, i64(2))
    m = g.op("Mul", g.op("Mul", x, _pow2(g, half)), _pow2(g, g.op("Sub", ne, half)))
    zero = g.op("Equal", ax, _const(g, torch.tensor(0.0)))
    m = g.op("Where", zero, x, m)
    e = g.op("Where", zero, i64(0), e)
    return m, g.op("Cast", e, to_i=TensorProto.INT32)


def _ldexp(g, x, e):
    return g.op("Mul", x, _pow2(g, g.op("Cast", e, to_i=TensorProto.INT64)))


def _sort(g, x, *args):
    """aten::sort(self, dim, descending) and aten::sort.stable(self, stable, dim, descending) -> TopK(all)."""
    from torch.onnx import symbolic_helper as sh

    consts = [sh._maybe_get_const(a, "i") for a in args]
    dim, descending = consts[-2], consts[-1]
    if dim < 0:     # a non-negative axis, so the slice that follows is recognisable (fuse_topk_slices)
        dim += sh._get_tensor_rank(x)
    k = g.op("Gather", g.op("Shape", x), _const(g, torch.tensor([dim], dtype=torch.int64)), axis_i=0)
    return g.op("TopK", x, k, axis_i=dim, largest_i=int(bool(descending)), sorted_i=1, outputs=2)


_REGISTERED = False


def register_symbolics() -> None:
    global _REGISTERED
    if not _REGISTERED:
        for name, fn in (("aten::frexp", _frexp), ("aten::ldexp", _ldexp), ("aten::sort", _sort)):
            torch.onnx.register_custom_op_symbolic(name, fn, OPSET)
        _REGISTERED = True


# ---------------------------------------------------------------------------------------------------
# Tracing on placeholder weights

@dataclass
class Source:
    """Where an initializer's bytes come from: a GGUF tensor dequantized to float32 ("float32") or kept as
    blocks ("blocks"), or an array computed at export ("array": RoPE tables)."""
    weights: object                 # model/weights.py Weights (None for arrays)
    name: str                       # GGUF tensor name (also the initializer name)
    kind: str
    shape: tuple[int, ...]
    array: np.ndarray | None = None

    @property
    def dtype(self) -> str:
        return "uint8" if self.kind == "blocks" else "float32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (1 if self.kind == "blocks" else 4)


class TraceWeights:
    """A Weights stand-in for tracing: the same queries; get() and blocks() return uninitialised tensors of the
    right shape (no memory touched) and remember which GGUF tensor each stands for. I32 tensors are real: the
    graph holds them as constants."""

    def __init__(self, weights, sources: dict[int, Source]):
        self.weights, self.sources = weights, sources

    def has(self, name):
        return self.weights.has(name)

    def type_of(self, name):
        return self.weights.type_of(name)

    def shape_of(self, name):
        return self.weights.shape_of(name)

    def get(self, name):
        if self.weights.type_of(name) == N.I32:
            return self.weights.get(name)
        return self._placeholder(name, "float32", self.weights.shape_of(name), torch.float32)

    def blocks(self, name):
        nbytes = self.weights.file.tensors[name].nbytes
        return self._placeholder(name, "blocks", (nbytes,), torch.uint8)

    def _placeholder(self, name, kind, shape, dtype):
        t = torch.empty(tuple(shape), dtype=dtype)
        self.sources[t.data_ptr()] = Source(self.weights, name, kind, tuple(shape))
        return t


def build_step_modules(cfg: ModelConfig, target_weights, mtp_weights, numerics: str, sources: dict[int, Source]):
    """(target, mtp or None): the model on TraceWeights, routed experts as ds4::MoE over GGUF blocks."""
    target = Transformer(cfg, TraceWeights(target_weights, sources), numerics, experts=moe.GGUFExperts.from_weights)
    mtp = None
    if mtp_weights is not None:
        mtp = MTPHead(target, TraceWeights(mtp_weights, sources), experts=moe.GGUFExperts.from_weights)
    return target, mtp


def trace_to_onnx(module: StepGraph, cfg: ModelConfig, ctx: int, mtp: bool, path: Path) -> onnx.ModelProto:
    """torch.onnx.export (TorchScript) of a StepGraph without parameters: they are graph inputs named by their
    state_dict keys. Returns the loaded ModelProto (small: no weights in it)."""
    register_symbolics()
    inputs, outputs = step_io(cfg, ctx, mtp)
    example = [torch.arange(TRACE_T, dtype=torch.int64)]
    if mtp:
        example.append(torch.zeros(TRACE_T, cfg.n_hc, cfg.n_embd))
    example += [torch.tensor(TRACE_START, dtype=torch.int64)]
    example += [torch.zeros(shape) for layer in cache_shapes(cfg, ctx, mtp) for shape in layer.values()]
    dynamic = {s.name: {i: "T" for i, d in enumerate(s.shape) if d == "T"} for s in inputs + outputs}
    with warnings.catch_warnings(), torch.no_grad():
        # TracerWarnings here come from Python ints taken from fixed dims (widths, block sizes, the cache's
        # compressed-row count): none depends on T, and tests run the graphs at several T against torch.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", UserWarning)
        # the exporter's shape inference would evaluate every op on parameters (the weights' transposes) as a
        # constant and keep the results: gigabytes at Flash width. Our parameters are placeholders whose values
        # mean nothing, so it runs without them (shapes and types still come from the graph inputs).
        infer = torch._C._jit_pass_onnx_graph_shape_type_inference
        torch._C._jit_pass_onnx_graph_shape_type_inference = lambda graph, params, opset: infer(graph, {}, opset)
        try:
            torch.onnx.export(module, tuple(example), str(path), dynamo=False, opset_version=OPSET,
                              input_names=[s.name for s in inputs], output_names=[s.name for s in outputs],
                              dynamic_axes={k: v for k, v in dynamic.items() if v}, export_params=False,
                              do_constant_folding=False, keep_initializers_as_inputs=True,
                              custom_opsets=CUSTOM_OPSETS)
        finally:
            torch._C._jit_pass_onnx_graph_shape_type_inference = infer
    return onnx.load(str(path))


# ---------------------------------------------------------------------------------------------------
# Graph rewrites

def _consumers(graph) -> dict[str, list]:
    out: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            out.setdefault(name, []).append(node)
    return out


def _constant_ints(graph) -> dict[str, list[int]]:
    """Values of Constant nodes holding integers."""
    out = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            t = onnx.numpy_helper.to_array(node.attribute[0].t)
            if t.dtype.kind in "iu":
                out[node.output[0]] = [int(v) for v in t.reshape(-1)]
    return out


_FOLD_MAX = 1 << 20      # fold constant subgraphs whose results have at most this many elements


def _np_div(a, b):
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":     # ONNX integer Div truncates toward zero
        q = np.abs(a) // np.abs(b)
        return (np.sign(a) * np.sign(b) * q).astype(np.result_type(a, b))
    return a / b


def _np_reshape(x, shape, allowzero=0):
    shape = [int(d) for d in shape]
    if not allowzero:
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


_FOLDERS = {
    "Identity": lambda n, x: x,
    "Cast": lambda n, x: x.astype(helper.tensor_dtype_to_np_dtype(attribute(n, "to"))),
    "Unsqueeze": lambda n, x, axes: np.expand_dims(x, tuple(int(a) % (x.ndim + len(axes)) for a in axes)),
    "Squeeze": lambda n, x, axes=None: np.squeeze(x, None if axes is None else tuple(int(a) for a in axes)),
    "Concat": lambda n, *xs: np.concatenate(xs, axis=attribute(n, "axis")),
    "Reshape": lambda n, x, shape: _np_reshape(x, shape, attribute(n, "allowzero", 0)),
    "Gather": lambda n, x, i: np.take(x, i, axis=attribute(n, "axis", 0)),
    "Add": lambda n, a, b: a + b, "Sub": lambda n, a, b: a - b, "Mul": lambda n, a, b: a * b,
    "Div": lambda n, a, b: _np_div(a, b), "Neg": lambda n, x: -x,
    "Min": lambda n, *xs: np.minimum.reduce(xs), "Max": lambda n, *xs: np.maximum.reduce(xs),
    "Range": lambda n, a, b, d: np.arange(a, b, d, dtype=a.dtype),
    "Equal": lambda n, a, b: a == b, "Less": lambda n, a, b: a < b, "Greater": lambda n, a, b: a > b,
    "Not": lambda n, x: ~x, "Where": lambda n, c, a, b: np.where(c, a, b),
}


def attribute(node, name, default=None):
    """A node attribute's value (`default` if absent)."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def fold_constants(model: onnx.ModelProto) -> int:
    """Evaluate small constant subgraphs (the exporter's index arithmetic on Python ints and on static shapes,
    Casts of double scalars) into Constant nodes, then drop dead nodes. Returns the number of nodes folded."""
    graph = model.graph
    static = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in graph.input
              if all(d.HasField("dim_value") for d in v.type.tensor_type.shape.dim)}
    values: dict[str, np.ndarray] = {}
    new, folded = [], 0
    for node in graph.node:
        out = None
        if node.op_type == "Constant" and node.attribute[0].name == "value":
            values[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
        elif node.op_type == "Shape" and node.input[0] in static and not node.attribute:
            out = [np.array(static[node.input[0]], np.int64)]
        elif node.op_type in _FOLDERS and node.input and all(i in values for i in node.input if i):
            args = [values[i] if i else None for i in node.input]
            with np.errstate(all="ignore"):
                out = [np.asarray(_FOLDERS[node.op_type](node, *args))]
        if out is not None and all(o.size <= _FOLD_MAX for o in out) and len(out) == len(node.output):
            for name, v in zip(node.output, out):
                values[name] = v
                new.append(helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(v, name)))
            folded += 1
        else:
            new.append(node)
    del graph.node[:]
    graph.node.extend(new)
    prune(model)
    return folded


def prune(model: onnx.ModelProto) -> None:
    """Drop nodes none of whose outputs is used (by a node or as a graph output)."""
    graph = model.graph
    while True:
        used = {o.name for o in graph.output} | {i for n in graph.node for i in n.input}
        keep = [n for n in graph.node if any(o in used for o in n.output)]
        if len(keep) == len(graph.node):
            return
        del graph.node[:]
        graph.node.extend(keep)


def rope_tables(model: onnx.ModelProto, ctx: int) -> dict[str, np.ndarray]:
    """Replace the float64 RoPE angles (model/rope.py rope_cos_sin: cos/sin(float64(pos) * freq), rounded to
    float32 by the caller) by a Gather from float32 tables of the same values for positions 0..ctx-1 (positions
    are clamped into that range; rows outside it are masked by the model). TensorRT has no float64 math, and
    float32 angles lose accuracy at large positions; the tables keep the reference's values exactly.
    Pattern: Cos|Sin(Mul(Unsqueeze(Cast(pos: int64 [n] -> DOUBLE), last axis), freq: Constant)). Returns the tables
    (name -> float32 [ctx, n]) the rewritten graph reads as initializers."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in graph.node
              if n.op_type == "Constant" and n.attribute[0].name == "value"}
    tables: dict[str, np.ndarray] = {}
    new = []
    for node in graph.node:
        mul = producer.get(node.input[0]) if node.op_type in ("Cos", "Sin") else None
        if mul is None or mul.op_type != "Mul":
            new.append(node)
            continue
        a, b = mul.input
        freq, other = (consts.get(b), a) if b in consts else (consts.get(a), b)
        unsq = producer.get(other)
        cast = producer.get(unsq.input[0]) if unsq is not None and unsq.op_type == "Unsqueeze" else None
        if (freq is None or freq.ndim != 1 or cast is None or cast.op_type != "Cast"
                or attribute(cast, "to") != TensorProto.DOUBLE or consts.get(unsq.input[1]) is None
                or [int(x) for x in consts[unsq.input[1]]] not in ([-1], [1])):
            raise Ds4Error(f"graph {graph.name}: {node.op_type} node {node.name} is not the RoPE pattern "
                           "cos/sin(float64(pos) * freq); export cannot make it float32")
        fn = np.cos if node.op_type == "Cos" else np.sin
        table = fn(np.arange(ctx, dtype=np.float64)[:, None] * freq.astype(np.float64)[None, :]).astype(np.float32)
        name = f"rope.{node.op_type.lower()}.{hashlib.sha1(freq.tobytes()).hexdigest()[:12]}.ctx{ctx}"
        tables[name] = table
        pos, lo, hi = cast.input[0], node.output[0] + "_lo", node.output[0] + "_hi"
        new += [helper.make_node("Constant", [], [lo], value=helper.make_tensor(lo, TensorProto.INT64, [], [0])),
                helper.make_node("Constant", [], [hi], value=helper.make_tensor(hi, TensorProto.INT64, [], [ctx - 1])),
                helper.make_node("Max", [pos, lo], [node.output[0] + "_pos0"]),
                helper.make_node("Min", [node.output[0] + "_pos0", hi], [node.output[0] + "_pos"]),
                helper.make_node("Gather", [name, node.output[0] + "_pos"], [node.output[0]], axis=0)]
    del graph.node[:]
    graph.node.extend(new)
    prune(model)
    return tables


def fuse_topk_slices(model: onnx.ModelProto) -> int:
    """TopK(K = whole axis) whose values are unused and whose indices feed only Slice(start 0, end c, that axis,
    step 1) becomes TopK(K = c). Valid when the axis always has >= c entries (the caller checks). Returns count."""
    graph = model.graph
    users, consts = _consumers(graph), _constant_ints(graph)
    fused, drop = 0, set()
    for node in graph.node:
        if node.op_type != "TopK" or users.get(node.output[0]):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), -1)
        slices = users.get(node.output[1], [])
        if len(slices) != 1 or slices[0].op_type != "Slice":
            continue
        s = slices[0]
        args = [consts.get(name) for name in s.input[1:]] + [None] * (5 - len(s.input))
        starts, ends, axes, steps = args[0], args[1], args[2], args[3]
        if not (starts == [0] and ends and len(ends) == 1 and axes in ([axis], None if axis == 0 else [axis])
                and steps in (None, [1])):
            continue
        k_name = node.name + "_k" if node.name else node.output[1] + "_k"
        graph.node.append(helper.make_node("Constant", [], [k_name],
                                           value=helper.make_tensor(k_name, TensorProto.INT64, [1], [ends[0]])))
        node.input[1] = k_name
        node.output[1] = s.output[0]        # the slice was the indices' only reader: TopK now produces its result
        drop.add(id(s))
        fused += 1
    _remove(graph, drop)
    prune(model)
    _topo_sort(graph)
    return fused


def integer_clips_to_min_max(model: onnx.ModelProto) -> int:
    """Clip on an integer tensor -> Max(x, lo) then Min(., hi) (TensorRT parses Clip on floats only)."""
    graph = model.graph
    types = tensor_types(model)
    new, count = [], 0
    for node in graph.node:
        if node.op_type == "Clip" and types.get(node.input[0]) in (TensorProto.INT64, TensorProto.INT32):
            x = node.input[0]
            lo = node.input[1] if len(node.input) > 1 else ""
            hi = node.input[2] if len(node.input) > 2 else ""
            if lo:
                y = node.output[0] + "_lo" if hi else node.output[0]
                new.append(helper.make_node("Max", [x, lo], [y]))
                x = y
            if hi:
                new.append(helper.make_node("Min", [x, hi], [node.output[0]]))
            if not (lo or hi):
                new.append(helper.make_node("Identity", [x], [node.output[0]]))
            count += 1
        else:
            new.append(node)
    del graph.node[:]
    graph.node.extend(new)
    return count


def _remove(graph, drop_ids: set) -> None:
    keep = [n for n in graph.node if id(n) not in drop_ids]
    del graph.node[:]
    graph.node.extend(keep)


def _topo_sort(graph) -> None:
    """Order nodes so each comes after the producers of its inputs (appended Constants go first)."""
    known = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        rest = []
        for n in pending:
            if all(i in known for i in n.input):
                ordered.append(n)
                known.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            raise Ds4Error(f"graph {graph.name}: cycle or missing input at node {rest[0].name or rest[0].op_type}")
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every named tensor (inputs, initializers, Constant outputs, inferred value_info)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types[node.output[0]] = node.attribute[0].t.data_type
    return {k: v for k, v in types.items() if v}


# ---------------------------------------------------------------------------------------------------
# External data

class WeightsFile:
    """One external-data file shared by the graphs: each tensor written once (by initializer name), page
    aligned, streamed from the GGUF in row chunks. All-zero chunks become holes (sparse files stay sparse).
    sha256 and size are computed while writing."""

    def __init__(self, path: Path, progress=None):
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.offset = 0
        self.entries: dict[str, tuple[int, int, str, tuple[int, ...]]] = {}    # name -> offset, length, dtype, shape
        self.sha = hashlib.sha256()
        self.progress = progress or (lambda n: None)

    def add(self, src: Source) -> tuple[int, int]:
        have = self.entries.get(src.name)
        if have is not None:
            if (have[2], have[3]) != (src.dtype, src.shape):
                raise Ds4Error(f"{src.name}: written as {have[2]} {list(have[3])}, now wanted as {src.dtype} "
                               f"{list(src.shape)}")
            return have[0], have[1]
        self._pad_to(-(-self.offset // ALIGN) * ALIGN)
        start = self.offset
        for chunk in _chunks(src):
            self._write(chunk)
        length = self.offset - start
        if length != src.nbytes:
            raise Ds4Error(f"{src.name}: wrote {length} bytes, expected {src.nbytes}")
        self.entries[src.name] = (start, length, src.dtype, src.shape)
        return start, length

    def _pad_to(self, offset: int) -> None:
        if offset > self.offset:
            self._write(np.zeros(offset - self.offset, np.uint8))

    def _write(self, a: np.ndarray) -> None:
        b = memoryview(np.ascontiguousarray(a)).cast("B")
        self.sha.update(b)
        if a.any():
            self.f.write(b)
        else:
            self.f.seek(len(b), os.SEEK_CUR)
        self.offset += len(b)
        self.progress(len(b))

    def close(self) -> None:
        if not self.f.closed:
            self.f.truncate(self.offset)
            self.f.close()

    def sha256(self) -> str:
        return self.sha.hexdigest()


def _chunks(src: Source):
    """The initializer's bytes in pieces of about CHUNK_BYTES (float32 rows, or raw blocks)."""
    if src.kind == "array":
        yield np.ascontiguousarray(src.array, np.float32)
        return
    w = src.weights
    info = w.file.tensors[src.name]
    raw = w.file.raw(src.name)
    try:
        if src.kind == "blocks":
            for i in range(0, raw.size, CHUNK_BYTES):
                yield raw[i:i + CHUNK_BYTES]
                _unmap_pages(raw[i:i + CHUNK_BYTES])
            return
        shape = info.shape
        if len(shape) == 1:
            yield dequantize(raw, info.ggml_type, shape)
            return
        row = math.prod(shape[1:]) * 4
        step = max(1, CHUNK_BYTES // row)
        for i in range(0, shape[0], step):
            yield dequantize_rows(raw, info.ggml_type, shape, i, min(shape[0], i + step))
            _unmap_pages(raw_rows(raw, info.ggml_type, shape, i, min(shape[0], i + step)))
    finally:
        _unmap_pages(raw)


_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _unmap_pages(view: np.ndarray) -> None:
    """Drop this process's mapping of the pages under a read-only view of a file mapping (the GGUF): they stay
    in the page cache, but stop counting as our resident memory, so streaming an 80 GB file keeps RSS flat.
    Only for views whose memory is a read-only mmap.mmap (DONTNEED on anonymous memory would zero it)."""
    base = view
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if isinstance(base, memoryview):        # np.frombuffer(mmap) keeps a memoryview of the map
        base = base.obj
    if _LIBC is None or view.flags.writeable or not isinstance(base, mmap.mmap) or view.nbytes == 0:
        return
    start = view.ctypes.data // _PAGE * _PAGE
    end = -(-(view.ctypes.data + view.nbytes) // _PAGE) * _PAGE
    _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def _external(name: str, dtype: str, dims, wfile: WeightsFile, offset: int, length: int) -> TensorProto:
    tp = TensorProto(name=name, data_type=ONNX_DTYPES[dtype], dims=list(dims), data_location=TensorProto.EXTERNAL)
    for k, v in (("location", wfile.path.name), ("offset", str(offset)), ("length", str(length))):
        tp.external_data.add(key=k, value=v)
    return tp


def attach_arrays(model: onnx.ModelProto, arrays: dict[str, np.ndarray], wfile: WeightsFile) -> None:
    for name, a in arrays.items():
        offset, length = wfile.add(Source(None, name, "array", tuple(a.shape), a))
        model.graph.initializer.append(_external(name, "float32", a.shape, wfile, offset, length))


def attach_weights(model: onnx.ModelProto, params: dict[str, torch.Tensor], sources: dict[int, Source],
                   wfile: WeightsFile, graph_inputs: list[IOSpec]) -> list[str]:
    """Turn the parameter inputs of a traced graph into external-data initializers named by GGUF tensor.
    `params`: the traced module's state_dict (keep_vars). Returns the initializer names."""
    graph = model.graph
    keep = {s.name for s in graph_inputs}
    missing = keep - {i.name for i in graph.input}
    if missing:
        raise Ds4Error(f"graph {graph.name}: inputs {sorted(missing)} are missing")
    rename: dict[str, str] = {}
    inits: dict[str, TensorProto] = {}
    for inp in graph.input:
        if inp.name in keep:
            continue
        t = params.get(inp.name)
        src = sources.get(t.data_ptr()) if t is not None else None
        if src is None or t.numel() * t.element_size() != src.nbytes:
            raise Ds4Error(f"graph input {inp.name} is a parameter that does not come from a GGUF tensor")
        offset, length = wfile.add(src)
        rename[inp.name] = src.name
        inits.setdefault(src.name, _external(src.name, src.dtype, t.shape, wfile, offset, length))
    ordered = [i for i in graph.input if i.name in keep]
    del graph.input[:]
    graph.input.extend(ordered)
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    graph.initializer.extend(inits.values())
    return list(inits)


def finish_graph(model: onnx.ModelProto, module: StepGraph, cfg: ModelConfig, ctx: int, mtp: bool, path: Path,
                 sources: dict[int, Source], wfile: WeightsFile) -> onnx.ModelProto:
    """Rewrite a traced graph, attach its weights (written to `wfile`), name it and save it to `path`."""
    fold_constants(model)
    attach_arrays(model, rope_tables(model, ctx), wfile)
    fuse_topk_slices(model)
    integer_clips_to_min_max(model)
    keep_custom_value_info(model)
    attach_weights(model, dict(module.state_dict(keep_vars=True)), sources, wfile, step_io(cfg, ctx, mtp)[0])
    model.graph.name = "ds4_mtp_step" if mtp else "ds4_target_step"
    model.producer_name = "ds4trt"
    onnx.save(model, str(path))
    return model


def keep_custom_value_info(model: onnx.ModelProto) -> None:
    """Drop the exporter's value_info (stale after the rewrites; ONNX shape inference redoes it) except for the
    outputs of custom-domain nodes, whose types shape inference cannot know."""
    custom = {o for n in model.graph.node if n.domain not in ("", "ai.onnx") for o in n.output}
    keep = [v for v in model.graph.value_info if v.name in custom]
    del model.graph.value_info[:]
    model.graph.value_info.extend(keep)


def graph_summary(model: onnx.ModelProto) -> dict:
    ops: dict[str, int] = {}
    for n in model.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain else n.op_type
        ops[key] = ops.get(key, 0) + 1
    return {"nodes": len(model.graph.node), "initializers": len(model.graph.initializer),
            "moe_nodes": ops.get(f"{moe.DOMAIN}::{moe.OP_TYPE}", 0), "ops": dict(sorted(ops.items()))}


def check_saved(path: Path) -> None:
    """onnx.checker on a saved graph (its external data must be beside it)."""
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        raise Ds4Error(f"{path}: onnx.checker: {str(e).splitlines()[0]}") from e


def min_ctx(cfg: ModelConfig) -> int:
    """The smallest context the graphs support: the indexer's TopK(K = top-k) needs at least top-k compressed
    rows plus one new token on every ratio-4 layer, i.e. ctx // 4 + 2 >= index_top_k."""
    if 4 not in cfg.compress_ratios:
        return 1
    return max(1, 4 * (cfg.index_top_k - 2))
