"""Would TensorRT's ONNX parser take these graphs? Every node against the published operator support matrix.

The matrix is data (trt_onnx_ops.json: its source URL and TensorRT version inside): per ONNX op, whether the
parser supports it, the tensor types it supports and its restrictions. `check_tensorrt_ops(model)` lists every
node whose op is unsupported or absent, any of whose input types (or Cast target type) is not in the op's
list, or that breaks a checkable restriction (TopK: sorted = 1 and a constant K < 3840); nodes of our plugin
domains (plugins/) are accepted. The op set must lie in the parser's range. An empty list means "parsable as
far as the table says"; building an engine is the real test (a later issue).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import onnx
from onnx import TensorProto

from ds4trt.export.onnx import attribute, tensor_types
from ds4trt.plugins import moe

TABLE = Path(__file__).with_name("trt_onnx_ops.json")
PLUGIN_OPS = {(moe.DOMAIN, moe.OP_TYPE)}
TOPK_MAX_K = 3840
TRT_TYPE = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16",
            TensorProto.INT32: "INT32", TensorProto.INT64: "INT64", TensorProto.BOOL: "BOOL",
            TensorProto.UINT8: "UINT8", TensorProto.INT8: "INT8", TensorProto.FLOAT8E4M3FN: "FP8",
            TensorProto.DOUBLE: "DOUBLE"}


@cache
def table() -> dict:
    return json.loads(TABLE.read_text())


def check_tensorrt_ops(model: onnx.ModelProto) -> list[str]:
    """Problems TensorRT's ONNX parser would have with `model`, one line each (empty: none found)."""
    doc = table()
    ops, (lo, hi) = doc["operators"], doc["opset_range"]
    problems = []
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and not lo <= imp.version <= hi:
            problems.append(f"op set {imp.version} outside TensorRT {doc['tensorrt_version']}'s range {lo}..{hi}")
    types = tensor_types(model)
    consts = {n.output[0]: n for n in model.graph.node if n.op_type == "Constant"}
    for node in model.graph.node:
        where = f"node {node.name or node.output[0]} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            if (node.domain, node.op_type) not in PLUGIN_OPS:
                problems.append(f"{where}: domain {node.domain!r} is neither ONNX nor one of our plugin ops")
            continue
        entry = ops.get(node.op_type)
        if entry is None or not entry["supported"]:
            problems.append(f"{where}: not supported by TensorRT {doc['tensorrt_version']}'s ONNX parser")
            continue
        used = [types.get(name) for name in node.input if name]
        if node.op_type == "Cast":
            used.append(attribute(node, "to"))
        for t in used:
            name = TRT_TYPE.get(t, f"type {t}") if t is not None else "unknown"
            if name not in entry["types"]:
                problems.append(f"{where}: input type {name} not in {'/'.join(entry['types'])}")
                break
        if node.op_type == "TopK":
            k = consts.get(node.input[1])
            if attribute(node, "sorted", 1) != 1:
                problems.append(f"{where}: sorted must be 1")
            if k is None:
                problems.append(f"{where}: K is not a constant (TensorRT needs K < {TOPK_MAX_K})")
            elif int(onnx.numpy_helper.to_array(k.attribute[0].t).max()) >= TOPK_MAX_K:
                problems.append(f"{where}: K must be < {TOPK_MAX_K}")
    return problems
