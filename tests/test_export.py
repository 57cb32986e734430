"""ONNX export (export/onnx.py, export/package.py, export/check.py, export/trt_ops.py) on the tiny model.

Numerics: each graph in ONNX Runtime against the same step in torch (check_engine) on fresh random inputs
(random tokens, start and cache contents) at T = 1, 3, 8: max |diff| / max |ref| <= 1e-4 for every output with
float numerics and for logits and hc with ds4 numerics; ds4 rows may differ by one FP8 rounding step in <= 1 %
of their elements (export/check.py explains). The symbolics (frexp/ldexp/sort) are checked exactly.
"""

from __future__ import annotations

import importlib.util
import json
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from ds4trt.errors import Ds4Error
from ds4trt.export import check, package
from ds4trt.export import onnx as X
from ds4trt.export.trt_ops import check_tensorrt_ops, table
from ds4trt.gguf_io.reader import GGUFFile
from ds4trt.model.config import ModelConfig
from ds4trt.plugins import moe
from ds4trt.runtime.cache import CacheState
from ds4trt.testing.tiny_gguf import tiny_config
from tiny_engines import CTX, tiny_engine, tiny_files

torch.set_num_threads(1)


def _ort(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), moe.onnxruntime_session_options(),
                                providers=["CPUExecutionProvider"])


def _export_small(module, args, names, tmp_path, dynamic=None) -> onnx.ModelProto:
    X.register_symbolics()
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():     # the TorchScript exporter's deprecation notices (we use it on purpose)
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(module, args, str(path), dynamo=False, opset_version=X.OPSET, input_names=names,
                          dynamic_axes=dynamic or {})
    return onnx.load(str(path))


def test_frexp_ldexp_symbolics_are_exact(tmp_path):
    class M(torch.nn.Module):
        def forward(self, x):
            m, e = torch.frexp(x)
            return m, e, torch.ldexp(torch.ones_like(x), e - 3)

    model = _export_small(M(), (torch.ones(3),), ["x"], tmp_path, {"x": {0: "n"}})
    rng = np.random.default_rng(0)
    x = np.concatenate([   # every binade, both signs, powers of two and their neighbours, subnormals, zeros
        rng.standard_normal(20000) * np.exp2(rng.integers(-149, 127, 20000)),
        np.exp2(np.arange(-149, 128.0)), np.nextafter(np.exp2(np.arange(-148, 128.0)).astype(np.float32), 0),
        [0.0, -0.0, 1e-45, -3.0, np.finfo(np.float32).max]]).astype(np.float32)
    m, e, l = _ort(model).run(None, {"x": x})
    mt, et = torch.frexp(torch.from_numpy(x))
    assert np.array_equal(m, mt.numpy())           # as values: the sign of a zero is not kept (the model's are >= 0)
    assert np.array_equal(e, et.numpy())
    keep = et.numpy() - 3 >= -149     # ldexp of the table's range
    assert np.array_equal(l[keep], torch.ldexp(torch.ones(len(x)), et - 3).numpy()[keep])


def test_stable_sort_exports_as_topk_with_lower_index_first(tmp_path):
    """ONNX TopK orders equal values by lower index: the stable descending sort, and the [:, :k] slice fuses."""
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :5]

    model = _export_small(M(), (torch.zeros(3, 16),), ["x"], tmp_path, {"x": {0: "n"}})
    X.fold_constants(model)
    assert X.fuse_topk_slices(model) == 1
    assert [n.op_type for n in model.graph.node].count("Slice") == 0 and check_tensorrt_ops(model) == []
    x = torch.randint(0, 4, (50, 16)).float()          # many ties
    got = _ort(model).run(None, {"x": x.numpy()})[0]
    assert np.array_equal(got, M()(x).numpy())


def test_integer_clip_becomes_min_max():
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"])]
    inits = [helper.make_tensor("lo", TensorProto.INT64, [], [2]), helper.make_tensor("hi", TensorProto.INT64, [], [5])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [7])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [7])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", X.OPSET)])
    assert any("Clip" in p for p in check_tensorrt_ops(model))
    assert X.integer_clips_to_min_max(model) == 1
    assert check_tensorrt_ops(model) == []
    x = np.arange(7, dtype=np.int64)
    assert _ort(model).run(None, {"x": x})[0].tolist() == [2, 2, 2, 3, 4, 5, 5]


def test_tensorrt_check_reports_what_the_table_rejects():
    """Each row a node TensorRT's parser would refuse; the checker must name it."""
    cases = [
        (helper.make_node("BitShift", ["i", "i"], ["o"], direction="LEFT"), "BitShift"),    # unsupported op
        (helper.make_node("Cos", ["d"], ["o"]), "DOUBLE"),                                   # no float64 math
        (helper.make_node("TopK", ["f", "k"], ["v", "o"]), "K is not a constant"),          # K must be < 3840
        (helper.make_node("Foo", ["f"], ["o"], domain="ds5"), "domain 'ds5'"),              # unknown custom op
    ]
    for node, msg in cases:
        g = helper.make_graph([node], "g", [helper.make_tensor_value_info("i", TensorProto.UINT32, [3]),
                                            helper.make_tensor_value_info("d", TensorProto.DOUBLE, [3]),
                                            helper.make_tensor_value_info("f", TensorProto.FLOAT, [3]),
                                            helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("o", TensorProto.UNDEFINED, None)])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", X.OPSET), helper.make_opsetid("ds5", 1)])
        problems = check_tensorrt_ops(model)
        assert any(msg in p for p in problems), (msg, problems)
    assert table()["tensorrt_version"] and table()["source"].startswith("https://")


@pytest.mark.parametrize("cfg", [tiny_config(), ModelConfig.flash()], ids=["tiny", "flash"])
def test_cache_shapes_are_cachestate_shapes(cfg):
    for mtp in (False, True):
        cache = CacheState(cfg, 4096, ratios=[0] if mtp else None)
        assert [{k: tuple(v.shape) for k, v in c.tensors().items()} for c in cache.layers] == \
            X.cache_shapes(cfg, 4096, mtp)


@pytest.mark.parametrize("numerics", ["ds4", "float"])
def test_graphs_match_torch_on_random_inputs(numerics, tmp_path):
    target, mtp = tiny_files()
    results = check.check_engine(tiny_engine(numerics), target, mtp, save_dir=tmp_path / "check")
    assert {(r.graph, r.T) for r in results} == {(g, T) for g in ("target", "mtp") for T in check.T_VALUES}
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    strict = [r for r in results if numerics == "float" or not r.output.startswith("rows.")]
    assert max(r.rel for r in strict) <= check.TOL
    # the reference inputs/outputs polygraphy saved load back with both runners' results
    from polygraphy.comparator import RunResults

    run = RunResults.load(str(tmp_path / "check" / "target.outputs.json"))
    assert [name for name, _ in run.items()] == ["torch-target", "onnxrt-target"]
    assert (tmp_path / "check" / "mtp.inputs.json").is_file()


def test_engine_directory_contents():
    d = tiny_engine("ds4")
    manifest = json.loads((d / "manifest.json").read_text())
    target_gguf, mtp_gguf = tiny_files()
    assert manifest["backend"] == "onnxruntime" and manifest["ctx"] == CTX and manifest["opset"] == X.OPSET
    assert [(s["role"], s["file"], s["size"]) for s in manifest["sources"]] == \
        [("target", target_gguf.name, target_gguf.stat().st_size), ("mtp", mtp_gguf.name, mtp_gguf.stat().st_size)]
    assert {"ds4trt", "torch", "onnx", "onnxruntime"} <= set(manifest["tools"])
    assert manifest["tensorrt"] == {"version": None, "compute_capability": None}
    models = {}
    for role in ("target", "mtp"):
        path = str(d / f"{role}.onnx")
        onnx.checker.check_model(path)
        models[role] = onnx.load(path, load_external_data=False)
        assert check_tensorrt_ops(models[role]) == []
        assert [i.name for i in models[role].graph.input] == [s["name"] for s in manifest["graphs"][role]["inputs"]]
        assert [o.name for o in models[role].graph.output] == [s["name"] for s in manifest["graphs"][role]["outputs"]]

    def ext(model):
        return {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer}
    # shared weights: the MTP graph reads the target's embedding and LM head at the same place in weights.bin
    for name in ("token_embd.weight", "output.weight"):
        assert ext(models["mtp"])[name] == ext(models["target"])[name]
    # ds4::MoE nodes carry the contract's attributes, and their block initializers are the GGUF bytes
    f = GGUFFile(target_gguf)
    cfg = ModelConfig(**(manifest["model"] | {"compress_ratios": tuple(manifest["model"]["compress_ratios"])}))
    nodes = [n for n in models["target"].graph.node if n.domain == moe.DOMAIN]
    assert len(nodes) == cfg.n_layer and all(n.op_type == moe.OP_TYPE for n in nodes)
    inits = {t.name: t for t in models["target"].graph.initializer}
    with open(d / "weights.bin", "rb") as w:
        for layer, node in enumerate(nodes):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert set(attrs) == set(moe.ATTRIBUTES)
            assert (attrs["n_expert"], attrs["expert_ff"], attrs["n_embd"]) == (cfg.n_expert, cfg.expert_ff, cfg.n_embd)
            assert attrs["gate_type"] == f.tensors[f"blk.{layer}.ffn_gate_exps.weight"].ggml_type
            for name in node.input[3:]:
                t, e = inits[name], ext(models["target"])[name]
                assert t.data_type == TensorProto.UINT8 and name.startswith(f"blk.{layer}.ffn_")
                w.seek(int(e["offset"]))
                assert w.read(int(e["length"])) == f.raw(name).tobytes()


def test_build_refuses_bad_options(tmp_path):
    target, _ = tiny_files()
    cases = [   # (keyword arguments, message)
        ({"backend": "tensorrt"}, "TensorRT is not installed (import tensorrt failed)"),
        ({"backend": "tvm"}, "--backend must be one of onnxruntime, tensorrt"),
        ({"numerics": "fp8"}, "--numerics must be one of ds4, float"),
        ({"ctx": 3}, "--ctx 3 is too small for this model"),          # indexer top-3 needs ctx >= 4
    ]
    for kw, msg in cases:
        if kw.get("backend") == "tensorrt" and importlib.util.find_spec("tensorrt"):
            continue    # installed (a GPU machine): the TensorRT build is a later issue's
        with pytest.raises(Ds4Error) as err:
            package.build(target, tmp_path / "out", **kw)
        assert msg in str(err.value) and "\n" not in str(err.value)
