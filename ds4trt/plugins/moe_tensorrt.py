"""`ds4::MoE` (plugins/moe.py, THE contract) as a TensorRT plugin: a Python plugin (`tensorrt.plugin`, "QDP")
whose implementation calls the Triton kernel (plugins/kernels/moe_triton.py moe_forward).

    register()          defines the plugin in TensorRT's registry (once per process; imports tensorrt)
    plugin_attributes(node)   the typed attributes of an exported ds4::MoE ONNX node, checked
    plugin_impl(v, ids, ..., clamp, outputs, stream, device="cuda")
                        the registered implementation's body, callable without TensorRT (tests: CPU tensors)
    moe_host(v, ids, weights, gate_words, up_words, down_words, attrs, out)
                        the computation on torch tensors (CUDA: the Triton kernel; CPU: the contract's numpy
                        reference)

Why a JIT Python plugin (@trtp.impl), not @trtp.aot_impl nor a C++ IPluginV3:
  - moe_forward is a Python launcher of four or five Triton kernels plus a torch reduction with torch
    temporaries; an AOT implementation is ONE precompiled kernel with fixed launch parameters
    ("Presently, only PTX is supported", https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/
    python-api/infer/tensorrt.plugin/trt_plugin_aot_impl/index.html), so it would need the kernel rewritten;
  - an IPluginV3 needs a compiled .so per platform and the kernel ported to CUDA C++;
  - ds4-run is Python anyway. The cost: the engine needs this module imported (register()) before it is
    deserialized, and trtexec / C++ cannot run it (scripts/jetson_build.sh therefore uses ds4-build).

Binding to the exported node (export/tensorrt.py tensorrt_graph does the rewrite on a copy of the graph):
  - the ONNX parser's fallback importer looks the plugin up by op_type ("MoE"), attribute plugin_version
    (default "1") and attribute plugin_namespace (TensorRT >= 10.10 also reads the node's domain); the rewrite
    adds plugin_namespace = "ds4" so TensorRT 10.3 (JetPack 6) finds it too
    (onnx/onnx-tensorrt onnxOpImporters.cpp FallbackPluginImporter; TensorRT 10.10 release notes);
  - the parser passes INT attributes as INT32 plugin fields and FLOAT as FLOAT32 (loadFields, same file);
    the plugin declares them `int` / `float`, which the creator converts (tensorrt/plugin/_lib.py
    create_plugin: attr_type(field.data));
  - the three block inputs are uint8 initializers in the exported graph. TensorRT cannot take them as they
    are: the parser widens UINT8 initializers to INT32, one byte per int32, 4x the memory (WeightsContext.cpp
    convertUINT8), and plugin I/O may not be UINT8 ("DataType::kBOOL and DataType::kUINT8 are not
    supported", PluginTensorDesc in the TensorRT 10.14 C++ API). The rewrite re-types each as an INT32
    initializer over the same external bytes ([bytes / 4] little-endian words; no copy, no new file), and
    moe_host views the words as the contract's uint8 [E, rows, row bytes] again. Inputs: FP32, INT64, FP32,
    INT32, INT32, INT32 (PLUGIN_TYPES); output FP32 [T, D].

This module imports nothing of ds4trt but plugins/ (STYLE habit 13). It must not use
`from __future__ import annotations`: tensorrt.plugin reads the annotations as classes (issubclass).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from ds4trt.plugins import moe

NAMESPACE, NAME, PLUGIN_VERSION = moe.DOMAIN, moe.OP_TYPE, "1"
PLUGIN_ID = f"{NAMESPACE}::{NAME}"
# TensorRT type names of inputs 0..5 and output 0, in tensorrt.plugin.AutoTuneCombination's syntax
PLUGIN_TYPES = ("FP32", "INT64", "FP32", "INT32", "INT32", "INT32", "FP32")
KERNEL_MAX_T = 16            # moe_forward's capturable token range per call (longer calls sync with the host): chunks
_INT_ATTRS = tuple(a for a in moe.ATTRIBUTES if a != "clamp")


@dataclass(frozen=True)
class MoEAttrs:
    gate_type: int
    up_type: int
    down_type: int
    n_expert: int
    expert_ff: int
    n_embd: int
    clamp: float

    def block_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The contract's uint8 shapes [E, rows, row bytes] of gate, up and down blocks."""
        E, F, D = self.n_expert, self.expert_ff, self.n_embd
        return (moe.blocks_shape(self.gate_type, E, F, D), moe.blocks_shape(self.up_type, E, F, D),
                moe.blocks_shape(self.down_type, E, D, F))

    def reference_kwargs(self) -> dict:
        return {a: getattr(self, a) for a in moe.ATTRIBUTES}


def check_attrs(values: dict) -> MoEAttrs:
    """The contract's attributes from a name -> value mapping (an ONNX node's, or TensorRT's plugin fields):
    exactly moe.ATTRIBUTES, integers for all but clamp, known ggml block types, sizes that split into blocks."""
    names = set(values)
    if names != set(moe.ATTRIBUTES):
        missing, extra = sorted(set(moe.ATTRIBUTES) - names), sorted(names - set(moe.ATTRIBUTES))
        raise ValueError(f"{PLUGIN_ID} attributes: missing {missing}, unexpected {extra}")
    for a in _INT_ATTRS:
        v = values[a]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"{PLUGIN_ID} attribute {a}: expected an integer, got {v!r}")
    clamp = values["clamp"]
    if isinstance(clamp, bool) or not isinstance(clamp, (int, float, np.floating, np.integer)) or not clamp > 0:
        raise ValueError(f"{PLUGIN_ID} attribute clamp: expected a number > 0, got {clamp!r}")
    attrs = MoEAttrs(*(int(values[a]) for a in _INT_ATTRS), float(clamp))
    for a in ("n_expert", "expert_ff", "n_embd"):
        if getattr(attrs, a) < 1:
            raise ValueError(f"{PLUGIN_ID} attribute {a}: expected >= 1, got {getattr(attrs, a)}")
    try:
        attrs.block_shapes()
    except ValueError as e:            # an unknown ggml type, or a row that splits a block
        raise ValueError(f"{PLUGIN_ID} attributes: {e}") from None
    return attrs


def plugin_attributes(node) -> MoEAttrs:
    """The attributes of a ds4::MoE ONNX NodeProto (plugin_namespace / plugin_version, which only route the
    node to the plugin, are left out)."""
    from onnx import helper

    if (node.domain, node.op_type) != (moe.DOMAIN, moe.OP_TYPE):
        raise ValueError(f"node {node.name}: {node.domain}::{node.op_type} is not {PLUGIN_ID}")
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    for routing in ("plugin_namespace", "plugin_version"):
        values.pop(routing, None)
    return check_attrs(values)


def words_shape(blocks_shape: tuple[int, ...]) -> tuple[int]:
    """The INT32 shape that carries a uint8 block tensor of `blocks_shape` to the plugin: [bytes / 4]."""
    n = int(np.prod(blocks_shape))
    if n % 4:
        raise ValueError(f"{PLUGIN_ID}: a block tensor of {list(blocks_shape)} ({n} bytes) is not a whole number "
                         "of 4-byte words, so TensorRT cannot carry it as INT32")
    return (n // 4,)


def pack_words(blocks: np.ndarray) -> np.ndarray:
    """uint8 blocks -> the int32 words TensorRT carries (a view of the same bytes; little-endian)."""
    blocks = np.ascontiguousarray(blocks, np.uint8)
    words_shape(blocks.shape)
    return blocks.reshape(-1).view("<i4")


def unpack_words(words: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """int32 words [bytes / 4] -> uint8 [E, rows, row bytes]: a view of the same memory, no copy."""
    if words.dtype != torch.int32 or words.dim() != 1 or words.numel() * 4 != int(np.prod(shape)):
        raise ValueError(f"{PLUGIN_ID}: expected int32 [{int(np.prod(shape)) // 4}] block words for {list(shape)}, "
                         f"got {words.dtype} {list(words.shape)}")
    return words.contiguous().view(torch.uint8).view(shape)


def moe_host(v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_words: torch.Tensor,
             up_words: torch.Tensor, down_words: torch.Tensor, attrs: MoEAttrs, out: torch.Tensor) -> None:
    """out[T, D] = ds4::MoE(v [T, D], ids [T, k], weights [T, k], blocks as int32 words). CUDA tensors run the
    Triton kernel in chunks of KERNEL_MAX_T tokens (no host synchronization: capturable in a CUDA graph);
    CPU tensors run the contract's numpy reference."""
    gate, up, down = (unpack_words(w, s) for w, s in zip((gate_words, up_words, down_words), attrs.block_shapes()))
    T = v.shape[0]
    if tuple(v.shape) != (T, attrs.n_embd) or tuple(out.shape) != (T, attrs.n_embd):
        raise ValueError(f"{PLUGIN_ID}: v and out must be [T, {attrs.n_embd}], got {list(v.shape)} and "
                         f"{list(out.shape)}")
    if v.is_cuda:
        from ds4trt.plugins.kernels.moe_triton import moe_forward

        for t0 in range(0, T, KERNEL_MAX_T):
            t1 = min(T, t0 + KERNEL_MAX_T)
            out[t0:t1] = moe_forward(v[t0:t1], ids[t0:t1], weights[t0:t1], gate, up, down, attrs.gate_type,
                                     attrs.up_type, attrs.down_type, attrs.clamp)
        return
    res = moe.moe_reference(v.numpy(), ids.numpy(), weights.numpy(), gate.numpy(), up.numpy(), down.numpy(),
                            **attrs.reference_kwargs())
    out.copy_(torch.from_numpy(res))


_REGISTERED = False


def register() -> None:
    """Define ds4::MoE in tensorrt.plugin's registry (and TensorRT's plugin registry) once per process. Call it
    before parsing a graph with the node and before deserializing an engine that holds the plugin."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt.plugin as trtp

    # Schemas: https://docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/tensorrt.plugin/
    # trt_plugin_register.html, trt_plugin_impl.html, trt_plugin_autotune/index.html
    @trtp.register(PLUGIN_ID)
    def _moe_desc(v: trtp.TensorDesc, ids: trtp.TensorDesc, weights: trtp.TensorDesc,
                  gate_blocks: trtp.TensorDesc, up_blocks: trtp.TensorDesc, down_blocks: trtp.TensorDesc,
                  gate_type: int, up_type: int, down_type: int, n_expert: int, expert_ff: int, n_embd: int,
                  clamp: float) -> trtp.TensorDesc:
        return v.like()                                        # out: float32 [T, D]

    @trtp.autotune(PLUGIN_ID)
    def _moe_autotune(v, ids, weights, gate_blocks, up_blocks, down_blocks, outputs):
        return [trtp.AutoTuneCombination(", ".join(PLUGIN_TYPES))]

    @trtp.impl(PLUGIN_ID)
    def _moe_impl(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type: int, up_type: int,
                  down_type: int, n_expert: int, expert_ff: int, n_embd: int, clamp: float, outputs, stream) -> None:
        plugin_impl(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type, n_expert,
                    expert_ff, n_embd, clamp, outputs, stream)

    _REGISTERED = True


def plugin_impl(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type, n_expert,
                expert_ff, n_embd, clamp, outputs, stream: int, device: str = "cuda") -> None:
    """The registered implementation's body: TensorRT's buffers (trtp.Tensor, which exports
    __cuda_array_interface__) viewed as torch tensors on `device`, the attributes checked, moe_host run on
    TensorRT's stream. Tests call it with CPU torch tensors and device="cpu" (no stream)."""
    attrs = check_attrs(dict(gate_type=gate_type, up_type=up_type, down_type=down_type, n_expert=n_expert,
                             expert_ff=expert_ff, n_embd=n_embd, clamp=clamp))
    on_stream = torch.cuda.stream(torch.cuda.ExternalStream(stream)) if device == "cuda" else nullcontext()
    with on_stream:
        t = [torch.as_tensor(x, device=device) for x in (v, ids, weights, gate_blocks, up_blocks, down_blocks)]
        moe_host(*t, attrs, torch.as_tensor(outputs[0], device=device))
