"""ds4::MoE (plugins/moe.py): the op's reference against RoutedExperts on float-dequantized weights, the ONNX
Runtime registration on a one-node graph, and the torch module built through the `experts` factory.

Tolerances: reference vs RoutedExperts max |diff| / max |ref| <= 1e-5 (float32, different summation orders);
ORT vs reference <= 1e-6 (the ORT op runs the same reference; only the bridge's float round trip differs).
Inputs are fresh seeded random values: expert blocks from testing.tiny_gguf.random_quant, v ~ N(0, 1),
distinct random ids per token, weights ~ U(0.1, 1)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import dequantize
from ds4trt.model.moe import RoutedExperts
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.plugins import moe
from ds4trt.testing.tiny_gguf import random_quant

torch.set_num_threads(1)

E, F, D, K, CLAMP = 8, 256, 512, 3, 10.0
MIXES = {"iq2_iq2_q2k": (N.IQ2_XXS, N.IQ2_XXS, N.Q2_K), "q4k": (N.Q4_K, N.Q4_K, N.Q4_K),
         "q2k_q2k_q4k": (N.Q2_K, N.Q2_K, N.Q4_K)}


def _case(types, seed: int, T: int):
    rng = np.random.default_rng(seed)
    gate = random_quant(rng, types[0], (E, F, D), 1 / D ** 0.5)
    up = random_quant(rng, types[1], (E, F, D), 1 / D ** 0.5)
    down = random_quant(rng, types[2], (E, D, F), 1 / F ** 0.5)
    v = rng.standard_normal((T, D)).astype(np.float32) * 3     # large enough that the clamps bite
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    attrs = dict(gate_type=types[0], up_type=types[1], down_type=types[2], n_expert=E, expert_ff=F, n_embd=D,
                 clamp=CLAMP)
    return (v, ids, w, gate, up, down), attrs


def _float_experts(args, attrs) -> RoutedExperts:
    _, _, _, gate, up, down = args
    deq = lambda b, t, shape: torch.from_numpy(dequantize(b.reshape(-1), t, shape))  # noqa: E731
    return RoutedExperts(deq(gate, attrs["gate_type"], (E, F, D)), deq(up, attrs["up_type"], (E, F, D)),
                         deq(down, attrs["down_type"], (E, D, F)), CLAMP)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("mix", list(MIXES))
def test_reference_equals_routed_experts(mix):
    args, attrs = _case(MIXES[mix], seed=len(mix), T=7)
    got = moe.moe_reference(*args, **attrs)
    v, ids, w = (torch.from_numpy(a) for a in args[:3])
    experts = _float_experts(args, attrs)
    assert _rel(got, experts(v, ids, w).numpy()) <= 1e-5
    # both clamps were active on the selected experts (else min(g, clamp) and clip(u) would be untested)
    sel = ids.unique()
    assert (torch.einsum("td,efd->tef", v, experts.gate[sel]) > CLAMP).any()
    assert (torch.einsum("td,efd->tef", v, experts.up[sel]).abs() > CLAMP).any()


def test_reference_counts_repeated_slots_and_checks_inputs():
    args, attrs = _case(MIXES["q4k"], seed=5, T=2)
    v, ids, w, *blocks = args
    twice = np.stack([ids[:, 0], ids[:, 0]], axis=1)
    once = moe.moe_reference(v, ids[:, :1], w[:, :1] * 2, *blocks, **attrs)
    assert _rel(moe.moe_reference(v, twice, w[:, :1].repeat(2, axis=1), *blocks, **attrs), once) <= 1e-6
    with pytest.raises(ValueError, match=r"ds4::MoE input gate_blocks: expected shape \[8, 256, 288\]"):
        moe.moe_reference(v, ids, w, blocks[0][:, :, :-1], *blocks[1:], **attrs)
    with pytest.raises(ValueError, match=r"ids: expected values in \[0, 8\)"):
        moe.moe_reference(v, ids + E, w, *blocks, **attrs)


def _one_node_model(args, attrs) -> bytes:
    _, _, _, gate, up, down = args
    node = helper.make_node(moe.OP_TYPE, list(moe.INPUTS), ["out"], domain=moe.DOMAIN, **attrs)
    inits = [numpy_helper.from_array(np.ascontiguousarray(b), n) for b, n in zip((gate, up, down), moe.INPUTS[3:])]
    graph = helper.make_graph(
        [node], "moe", [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["T", D]),
                        helper.make_tensor_value_info("ids", TensorProto.INT64, ["T", K]),
                        helper.make_tensor_value_info("weights", TensorProto.FLOAT, ["T", K])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", D])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(moe.DOMAIN, moe.VERSION)])
    onnx.checker.check_model(model)
    return model.SerializeToString()


@pytest.mark.parametrize("mix", list(MIXES))
def test_onnxruntime_one_node_graph_equals_reference(mix):
    args, attrs = _case(MIXES[mix], seed=10 + len(mix), T=5)
    sess = ort.InferenceSession(_one_node_model(args, attrs), moe.onnxruntime_session_options(),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {"v": args[0], "ids": args[1], "weights": args[2]})[0]
    assert got.shape == (5, D) and got.dtype == np.float32
    assert _rel(got, moe.moe_reference(*args, **attrs)) <= 1e-6


def test_factory_module_equals_routed_experts(tiny_gguf, tiny_mtp_gguf, tiny_cfg):
    """GGUFExperts.from_weights (the `experts` factory) on the tiny GGUFs' layers: target IQ2_XXS/Q2_K, MTP Q4_K."""
    _, cfg, weights = load_target(tiny_gguf)
    _, mtp_weights = load_mtp(tiny_mtp_gguf, cfg)
    g = torch.Generator().manual_seed(3)
    for w, prefix in ((weights, "blk.3."), (mtp_weights, N.MTP_PREFIX)):
        ours = moe.GGUFExperts.from_weights(w, prefix, cfg.swiglu_clamp)
        ref = RoutedExperts.from_weights(w, prefix, cfg.swiglu_clamp)
        v = torch.randn(6, cfg.n_embd, generator=g) * 2
        ids = torch.argsort(torch.rand(6, cfg.n_expert, generator=g), dim=1)[:, :cfg.n_expert_used]
        wt = torch.rand(6, cfg.n_expert_used, generator=g)
        assert _rel(ours(v, ids, wt), ref(v, ids, wt)) <= 1e-5
