"""`ds4::MoE`: the routed experts of one layer, computed from GGUF-quantized blocks. THE CONTRACT.

Every implementation (this module's numpy reference, a Triton kernel, a TensorRT plugin) computes exactly
this. The ONNX node is domain "ds4", op_type "MoE", op set version 1.

Inputs
  0  v            float32  [T, D]      the FFN input of T tokens (already RMS-normed)
  1  ids          int64    [T, k]      selected expert per token and slot, each in [0, n_expert)
  2  weights      float32  [T, k]      routing weight per token and slot (already normalised and scaled)
  3  gate_blocks  uint8    [E, F, D / QK(gate_type) * BS(gate_type)]
  4  up_blocks    uint8    [E, F, D / QK(up_type)   * BS(up_type)]
  5  down_blocks  uint8    [E, D, F / QK(down_type) * BS(down_type)]
Attributes
  gate_type, up_type, down_type   int    ggml type ids of the three tensors: 10 Q2_K, 12 Q4_K, 16 IQ2_XXS
                                         (what ds4 ships; the reference accepts any type gguf.quants dequantizes)
  n_expert (E), expert_ff (F), n_embd (D)   int
  clamp                           float  the SwiGLU clamp (deepseek4.swiglu_clamp_exp), > 0
Output
  0  out          float32  [T, D]
T >= 1 is dynamic; k, E, F, D are fixed by the graph. QK / BS = values / bytes per block of the type
(Q2_K 256/84, Q4_K 256/144, IQ2_XXS 256/66; gguf.GGML_QUANT_SIZES).

Semantics, for every token t:
  out[t] = sum over slots j of  down_e @ ( weights[t, j] * swiglu(gate_e @ v[t], up_e @ v[t]) ),   e = ids[t, j]
  swiglu(g, u) = silu(min(g, clamp)) * min(max(u, -clamp), clamp)
    - the clamp is ASYMMETRIC: the gate is clamped from above only, the up projection on both sides;
    - silu(x) = x * sigmoid(x);
    - the routing weight multiplies the F-wide hidden vector BEFORE the down projection;
    - a slot counts once per occurrence (an expert listed twice for a token contributes twice).
  gate_e, up_e: [F, D] and down_e: [D, F] are the dequantized matrices of expert e (row-major, y = M x).
  Accumulate in float32 or wider; the summation order is not specified (tolerance: 1e-5 relative to max |out|).

Byte layout (exactly the GGUF tensor data, unchanged): a ggml tensor of ggml shape [ne0, ne1, E] is E experts,
expert-major; expert e is ne1 rows of ne0 values; each row is ne0 / QK consecutive blocks of BS bytes. So
gate_blocks[e, r] holds row r of gate_e (its D inputs), and down_blocks[e, r] holds row r of down_e (its F
inputs). Dequantizing block by block is gguf.quants.dequantize (this reference) or the ggml kernels.

A TensorRT plugin binds to this node as plugin "MoE" in namespace "ds4", inputs and attributes as above.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

DOMAIN, OP_TYPE, VERSION = "ds4", "MoE", 1
INPUTS = ("v", "ids", "weights", "gate_blocks", "up_blocks", "down_blocks")
ATTRIBUTES = ("gate_type", "up_type", "down_type", "n_expert", "expert_ff", "n_embd", "clamp")

_GATE_SUFFIX, _UP_SUFFIX, _DOWN_SUFFIX = "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"


def row_bytes(ggml_type: int, n_values: int) -> int:
    """Bytes of one row of `n_values` values of a ggml type (n_values a multiple of its block)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if n_values % block:
        raise ValueError(f"a {GGMLQuantizationType(ggml_type).name} row of {n_values} values splits a block of {block}")
    return n_values // block * size


def blocks_shape(ggml_type: int, n_expert: int, rows: int, cols: int) -> tuple[int, int, int]:
    """The uint8 input shape [E, rows, row bytes] of an expert tensor whose matrices are [rows, cols]."""
    return n_expert, rows, row_bytes(ggml_type, cols)


def dequantize_expert(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    """One expert's bytes [rows, row bytes] -> float32 [rows, cols], through gguf.quants."""
    return gguf_quants.dequantize(np.ascontiguousarray(blocks), GGMLQuantizationType(ggml_type)).astype(np.float32)


def swiglu(g: np.ndarray, u: np.ndarray, clamp: float) -> np.ndarray:
    g = np.minimum(g, clamp)
    return g / (1.0 + np.exp(-g)) * np.clip(u, -clamp, clamp)


def moe_reference(v, ids, weights, gate_blocks, up_blocks, down_blocks, *, gate_type: int, up_type: int,
                  down_type: int, n_expert: int, expert_ff: int, n_embd: int, clamp: float) -> np.ndarray:
    """The contract in numpy; dequantizes only the experts some token selected. Returns float32 [T, D]."""
    v, ids, weights = np.asarray(v, np.float32), np.asarray(ids), np.asarray(weights, np.float32)
    T, D, F, E = v.shape[0], n_embd, expert_ff, n_expert
    expect = {"v": ((T, D), v.shape), "ids": ((T, ids.shape[1] if ids.ndim == 2 else -1), ids.shape),
              "weights": (ids.shape, weights.shape),
              "gate_blocks": (blocks_shape(gate_type, E, F, D), gate_blocks.shape),
              "up_blocks": (blocks_shape(up_type, E, F, D), up_blocks.shape),
              "down_blocks": (blocks_shape(down_type, E, D, F), down_blocks.shape)}
    for name, (want, got) in expect.items():
        if tuple(want) != tuple(got):
            raise ValueError(f"ds4::MoE input {name}: expected shape {list(want)}, got {list(got)}")
    if ids.size and (ids.min() < 0 or ids.max() >= E):
        raise ValueError(f"ds4::MoE input ids: expected values in [0, {E}), got [{ids.min()}, {ids.max()}]")
    out = np.zeros((T, D), np.float32)
    for e in np.unique(ids):
        t, slot = np.nonzero(ids == e)
        x = v[t]                                                               # [n, D]
        h = swiglu(x @ dequantize_expert(gate_blocks[e], gate_type).T,
                   x @ dequantize_expert(up_blocks[e], up_type).T, clamp)      # [n, F]
        h = h * weights[t, slot, None]
        np.add.at(out, t, h @ dequantize_expert(down_blocks[e], down_type).T)
    return out


class MoEFunction(torch.autograd.Function):
    """Eager: the numpy reference. Traced for ONNX export: one ds4::MoE node (the value is not needed)."""

    @staticmethod
    def forward(ctx, v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type,
                n_expert, expert_ff, n_embd, clamp):
        if torch.jit.is_tracing():
            return torch.zeros_like(v)
        out = moe_reference(v.detach().cpu().float().numpy(), ids.cpu().numpy(), weights.detach().cpu().float().numpy(),
                            gate_blocks.cpu().numpy(), up_blocks.cpu().numpy(), down_blocks.cpu().numpy(),
                            gate_type=gate_type, up_type=up_type, down_type=down_type, n_expert=n_expert,
                            expert_ff=expert_ff, n_embd=n_embd, clamp=clamp)
        return torch.from_numpy(out).to(v.dtype)

    @staticmethod
    def symbolic(g, v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type,
                 n_expert, expert_ff, n_embd, clamp):
        out = g.op(f"{DOMAIN}::{OP_TYPE}", v, ids, weights, gate_blocks, up_blocks, down_blocks,
                   gate_type_i=gate_type, up_type_i=up_type, down_type_i=down_type, n_expert_i=n_expert,
                   expert_ff_i=expert_ff, n_embd_i=n_embd, clamp_f=clamp)
        out.setType(v.type())
        return out


class GGUFExperts(nn.Module):
    """The RoutedExperts replacement that keeps the GGUF blocks: same forward(v, ids, weights) -> [T, D],
    computed by ds4::MoE. The three byte tensors are buffers, so an ONNX export makes them initializers."""

    def __init__(self, gate_blocks: torch.Tensor, up_blocks: torch.Tensor, down_blocks: torch.Tensor,
                 types: tuple[int, int, int], n_expert: int, expert_ff: int, n_embd: int, clamp: float):
        super().__init__()
        self.types = tuple(int(t) for t in types)
        self.n_expert, self.expert_ff, self.n_embd = n_expert, expert_ff, n_embd
        self.clamp = float(clamp)
        want = (blocks_shape(self.types[0], n_expert, expert_ff, n_embd),
                blocks_shape(self.types[1], n_expert, expert_ff, n_embd),
                blocks_shape(self.types[2], n_expert, n_embd, expert_ff))
        names = ("gate_blocks", "up_blocks", "down_blocks")
        for name, t, shape in zip(names, (gate_blocks, up_blocks, down_blocks), want):
            if t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise ValueError(f"GGUFExperts {name}: expected uint8 {list(shape)}, got {t.dtype} {list(t.shape)}")
            self.register_buffer(name, t)

    @classmethod
    def from_weights(cls, weights, prefix: str, clamp: float) -> "GGUFExperts":
        """The `experts` factory (same signature as RoutedExperts.from_weights): the layer's three expert tensors'
        bytes, no dequantization. `weights` needs type_of(name), shape_of(name) (numpy order [E, rows, cols])
        and blocks(name) (model/weights.py Weights)."""
        parts = []
        for suffix in (_GATE_SUFFIX, _UP_SUFFIX, _DOWN_SUFFIX):
            name = prefix + suffix
            t, (E, rows, cols) = weights.type_of(name), weights.shape_of(name)
            parts.append((weights.blocks(name).reshape(blocks_shape(t, E, rows, cols)), t, E, rows, cols))
        (g, gt, E, F, D), (u, ut, *_), (d, dt, *_) = parts
        return cls(g, u, d, (gt, ut, dt), E, F, D, clamp)

    def forward(self, v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """v: [T, D]; ids, weights: [T, k] -> [T, D]"""
        return MoEFunction.apply(v, ids, weights, self.gate_blocks, self.up_blocks, self.down_blocks, *self.types,
                                 self.n_expert, self.expert_ff, self.n_embd, self.clamp)


# ---- ONNX Runtime: onnxruntime-extensions' Python-op bridge (CPU) ----

_ORT_REGISTERED = False


def _ort_moe(v, ids, weights, gate_blocks, up_blocks, down_blocks, **attrs):
    return moe_reference(v, ids, weights, gate_blocks, up_blocks, down_blocks, **attrs)


def onnxruntime_session_options(so=None):
    """onnxruntime.SessionOptions (new, or `so`) with ds4::MoE registered and only errors logged."""
    import onnxruntime as ort

    so = so or ort.SessionOptions()
    so.log_severity_level = 3
    so.register_custom_ops_library(onnxruntime_library())
    return so


def onnxruntime_library() -> str:
    """Register ds4::MoE with onnxruntime-extensions (once per process) and return the custom-op library to pass
    to SessionOptions.register_custom_ops_library. The bridge copies the inputs into numpy on every call, so this
    is a correctness backend, not a fast one."""
    global _ORT_REGISTERED
    from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

    if not _ORT_REGISTERED:
        f, i64, u8 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int64, PyCustomOpDef.dt_uint8
        attrs = {a: (f if a == "clamp" else i64) for a in ATTRIBUTES}
        onnx_op(op_type=f"{DOMAIN}::{OP_TYPE}", inputs=[f, i64, f, u8, u8, u8], outputs=[f], attrs=attrs)(_ort_moe)
        _ORT_REGISTERED = True
    return get_library_path()

