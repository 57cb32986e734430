"""The TensorRT path (export/tensorrt.py, plugins/moe_tensorrt.py, runtime/buffers.py, runtime/backends/tensorrt.py,
scripts/jetson_build.sh): everything around TensorRT that runs without it here, and the engine tests that need it.

Without TensorRT (CI): the profile per phase and which profile a step of T tokens runs on; the device buffer plan
(offsets, sizes, alignment) against CacheState's shapes; the manifest's TensorRT fields and the one-line refusal
of engines built for another TensorRT version or GPU (ds4-run --engines); the graph rewrite that binds ds4::MoE
to the plugin (namespace attribute, uint8 blocks carried as INT32 words over the same bytes) on the exported tiny
graph; the plugin's attributes, registration signature (through a stand-in tensorrt.plugin) and host entry point
against the contract's numpy reference; cuda-python error handling; jetson_build.sh. And the code that drives
TensorRT, on stand-ins (the engines are the same graphs in ONNX Runtime; the builder records its calls): the
runtime's contexts, buffers, cache adoption, staging and graph replay token-exact against the ONNX Runtime
backend, and what ds4-build asks of the builder and writes to the manifest.

With TensorRT and a GPU (skipped here, the reason says why): engines built from the tiny model against the ONNX
Runtime outputs `ds4-build --check` saved (polygraphy TrtRunner, export/check.py tolerances), and greedy plus
speculative decoding through the TensorRT backend token-exact against PyTorch, with and without CUDA graphs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ds4trt import cli
from ds4trt.errors import Ds4Error
from ds4trt.export import manifest as M
from ds4trt.export import tensorrt as XT
from ds4trt.gguf_io import names as N
from ds4trt.plugins import moe
from ds4trt.plugins import moe_tensorrt as P
from ds4trt.runtime import session as S
from ds4trt.runtime.backends import tensorrt as RT
from ds4trt.runtime.buffers import ALIGN, ITEMSIZE, cuda_call, plan_buffers
from ds4trt.runtime.cache import CacheState
from moe_cases import random_moe_inputs
from tiny_engines import CTX, N_NEW, PROMPT, tiny_engine, tiny_files
from tiny_engines import greedy as _greedy

torch.set_num_threads(1)

NO_TRT = "TensorRT is not installed here (PyPI's tensorrt wheels download from an unreachable host; the GPU image has none)"
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "jetson_build.sh"


def _needs_tensorrt_gpu():
    pytest.importorskip("tensorrt", reason=NO_TRT)
    if not torch.cuda.is_available():
        pytest.skip("TensorRT engines need a CUDA GPU")


# ---------------------------------------------------------------------------------------------------
# Profiles

def test_profiles_per_phase():
    assert XT.plan_profiles(4096) == [{"name": "decode", "min": 1, "opt": 1, "max": 1},
                                      {"name": "verify", "min": 2, "opt": 9, "max": 9},
                                      {"name": "prefill", "min": 1, "opt": 256, "max": 256}]
    assert XT.plan_profiles(4096, mtp_draft_max=2, prefill_chunk=128)[1:] == [
        {"name": "verify", "min": 2, "opt": 3, "max": 3}, {"name": "prefill", "min": 1, "opt": 128, "max": 128}]
    assert [p["max"] for p in XT.plan_profiles(CTX)] == [1, 9, CTX]          # no profile beyond ctx
    assert [p["max"] for p in XT.plan_profiles(5)] == [1, 5, 5]
    assert [p["name"] for p in XT.plan_profiles(1)] == ["decode", "prefill"]  # no T >= 2 step fits ctx 1
    for kw, msg in (({"mtp_draft_max": 0}, "--mtp-draft-max must be >= 1"),
                    ({"prefill_chunk": 0}, "--prefill-chunk must be >= 1")):
        with pytest.raises(Ds4Error, match=msg):
            XT.plan_profiles(64, **kw)
    # the defaults are the runtime's: ds4-run's prefill chunk, and the largest --mtp-draft it accepts
    assert XT.DEFAULT_PREFILL_CHUNK == S.PREFILL_CHUNK
    args = cli._run_parser().parse_args(["--mtp-draft", str(XT.DEFAULT_DRAFT_MAX)])
    cli._check_args(args)
    with pytest.raises(Ds4Error, match="--mtp-draft must be in 1..8"):
        cli._check_args(cli._run_parser().parse_args(["--mtp-draft", str(XT.DEFAULT_DRAFT_MAX + 1)]))


def _info(profiles=None, **kw) -> M.TensorRTInfo:
    fields = dict(version="10.3.0.30", compute_capability="8.7", version_compatible=False,
                  engines={"target": Path("target.engine")}, profiles=profiles or XT.plan_profiles(4096))
    return M.TensorRTInfo(**(fields | kw))


PROFILE_FOR = [   # (T, profile the step runs on)
    (1, "decode"),        # decode and prefill both take T = 1: the narrower one
    (2, "verify"),        # the pending token and one draft
    (9, "verify"),        # the pending token and --mtp-draft-max 8 drafts
    (10, "prefill"),      # past verify
    (256, "prefill"),     # a full prefill chunk
]


@pytest.mark.parametrize("T, name", PROFILE_FOR)
def test_profile_selection(T, name):
    info = _info()
    assert info.profiles[info.profile_for(T)]["name"] == name


@pytest.mark.parametrize("T", [0, 257, 10_000])
def test_profile_selection_refuses_steps_outside_every_profile(T):
    with pytest.raises(Ds4Error, match=rf"a step of {T} tokens is outside the TensorRT profiles \(the largest, "
                                       r"prefill, takes T <= 256\): prefill in chunks of at most 256") as err:
        _info().profile_for(T)
    assert "\n" not in str(err.value)


def test_profile_shapes_only_for_inputs_with_T():
    m = M.load(tiny_engine("ds4"), verify_hashes=False)
    verify = XT.plan_profiles(m.ctx)[1]
    assert XT.profile_shapes(m.graphs["target"]["inputs"], verify) == {"tokens": ((2,), (9,), (9,))}
    assert XT.profile_shapes(m.graphs["mtp"]["inputs"], verify) == {
        "tokens": ((2,), (9,), (9,)), "h": ((2, 4, 256), (9, 4, 256), (9, 4, 256))}


# ---------------------------------------------------------------------------------------------------
# Device buffer plan

@pytest.mark.parametrize("role", ["target", "mtp"])
def test_buffer_plan_from_the_manifest(role, tiny_cfg):
    m = M.load(tiny_engine("ds4"), verify_hashes=False)
    g = m.graphs[role]
    t_max = max(p["max"] for p in XT.plan_profiles(m.ctx))
    plan = plan_buffers(g["inputs"], g["outputs"], t_max)
    specs = {s.name: s for s in g["inputs"] + g["outputs"]}
    assert list(plan.slots) == list(specs)                                   # manifest order, inputs first
    end = 0
    for name, slot in plan.slots.items():
        s = specs[name]
        assert slot.offset % ALIGN == 0 and slot.offset >= end               # aligned, no overlap, in order
        assert slot.shape == tuple(t_max if d == "T" else d for d in s.shape)
        assert slot.nbytes == math.prod(slot.shape) * ITEMSIZE[s.dtype] and slot.dtype == s.dtype
        assert slot.role == ("input" if s in g["inputs"] else "output")
        assert slot.shape_for(3) == tuple(3 if d == "T" else d for d in s.shape)
        end = slot.offset + slot.nbytes
    assert plan.total == -(-end // ALIGN) * ALIGN and plan.total % ALIGN == 0
    # the cache slots are exactly the tensors CacheState allocates for this ctx
    cache = CacheState(tiny_cfg, m.ctx, ratios=[0] if role == "mtp" else None)
    assert {f"cache.{k}": tuple(v.shape) for k, v in cache.tensors().items()} == \
        {n: s.shape for n, s in plan.slots.items() if n.startswith("cache.")}


def test_buffer_plan_tiny_case_by_hand():
    inputs = [M.IOSpec("tokens", "int64", ("T",)), M.IOSpec("start", "int64", ()),
              M.IOSpec("cache.0.raw", "float32", (7, 64))]
    outputs = [M.IOSpec("logits", "float32", ("T", 512)), M.IOSpec("rows.0.raw", "float32", ("T", 64))]
    plan = plan_buffers(inputs, outputs, t_max=9)
    got = {n: (s.offset, s.nbytes) for n, s in plan.slots.items()}
    assert got == {"tokens": (0, 72), "start": (256, 8), "cache.0.raw": (512, 1792),
                   "logits": (2304, 18432), "rows.0.raw": (20736, 2304)}
    assert plan.total == 23040
    for bad, msg in (([inputs[0], inputs[0]], "appears twice"),
                     ([M.IOSpec("x", "float32", (3, "T"))], "T must be the first and only dynamic dimension"),
                     ([M.IOSpec("x", "float64", (3,))], "has no device buffer type")):
        with pytest.raises(ValueError, match=msg):
            plan_buffers(bad, [], 4)


# ---------------------------------------------------------------------------------------------------
# Manifest TensorRT fields; refusing engines of another machine

@pytest.fixture(scope="module")
def trt_dir(tmp_path_factory) -> Path:
    """The tiny engine directory as a TensorRT build would leave it (engine files are placeholders: nothing here
    can deserialize them), for the manifest and compatibility checks."""
    d = tmp_path_factory.mktemp("trt") / "engine"
    shutil.copytree(tiny_engine("ds4"), d)
    m = json.loads((d / M.MANIFEST).read_text())
    for role in ("target", "mtp"):
        (d / XT.ENGINE_FILES[role]).write_bytes(b"placeholder plan " + role.encode())
        m["files"][XT.ENGINE_FILES[role]] = M.file_entry(d / XT.ENGINE_FILES[role])
    m["backend"] = "tensorrt"
    m["tensorrt"] = {"version": "10.3.0.30", "compute_capability": "8.7", "version_compatible": False,
                     "engines": dict(XT.ENGINE_FILES), "profiles": XT.plan_profiles(m["ctx"])}
    M.write(d, m)
    return d


def _variant(tmp_path, base: Path, edit) -> Path:
    """A copy of `base` (files linked) with its manifest edited."""
    d = tmp_path / "variant"
    d.mkdir()
    for f in base.iterdir():
        if f.name != M.MANIFEST:
            (d / f.name).symlink_to(f)
    m = json.loads((base / M.MANIFEST).read_text())
    edit(m)
    M.write(d, m)
    return d


def test_manifest_tensorrt_fields_load(trt_dir):
    info = M.tensorrt_info(M.load(trt_dir))
    assert (info.version, info.compute_capability, info.version_compatible) == ("10.3.0.30", "8.7", False)
    assert info.engines == {r: trt_dir / f for r, f in XT.ENGINE_FILES.items()}
    assert [p["name"] for p in info.profiles] == list(XT.PROFILES)
    assert M.backend_of(trt_dir) == "tensorrt" and M.backend_of(tiny_engine("ds4")) == "onnxruntime"
    assert M.backend_of(trt_dir / "nowhere") is None


def _trt(edit):
    return lambda m: edit(m["tensorrt"])


BAD_TRT_FIELDS = [   # (case, edit of the manifest, message)
    ("no tensorrt key", lambda m: m.pop("tensorrt"), r"key tensorrt is missing"),
    ("no version", _trt(lambda t: t.pop("version")), r"key tensorrt\.version is missing"),
    ("version not a string", _trt(lambda t: t.update(version=10)), r"tensorrt\.version: expected a string, got 10"),
    ("version not a version", _trt(lambda t: t.update(version="latest")), r"tensorrt\.version: expected a TensorRT version"),
    ("cc missing", _trt(lambda t: t.pop("compute_capability")), r"key tensorrt\.compute_capability is missing"),
    ("cc not major.minor", _trt(lambda t: t.update(compute_capability="sm_87")),
     r"tensorrt\.compute_capability: expected a \"major\.minor\" string, got \"sm_87\""),
    ("vc not a bool", _trt(lambda t: t.update(version_compatible=1)),
     r"tensorrt\.version_compatible: expected true or false, got 1"),
    ("an engine missing", _trt(lambda t: t["engines"].pop("mtp")), r"tensorrt\.engines: expected one engine per graph"),
    ("engine not listed", _trt(lambda t: t["engines"].update(mtp="other.engine")),
     r"tensorrt\.engines\.mtp \"other\.engine\" is not listed in files"),
    ("no profiles", _trt(lambda t: t.update(profiles=[])), r"tensorrt\.profiles: expected a non-empty array"),
    ("profile past ctx", _trt(lambda t: t["profiles"][2].update(max=CTX + 1)),
     rf"tensorrt\.profiles\[2\]: expected 1 <= min <= opt <= max <= ctx {CTX}"),
    ("profile min > opt", _trt(lambda t: t["profiles"][1].update(min=5, opt=3)), r"tensorrt\.profiles\[1\]: expected 1 <= min"),
    ("profile bound a float", _trt(lambda t: t["profiles"][0].update(max=1.0)),
     r"tensorrt\.profiles\[0\]\.max: expected an integer"),
    ("profile names twice", _trt(lambda t: t["profiles"][1].update(name="decode")),
     r"tensorrt\.profiles\[1\]\.name: expected a name used once"),
]


@pytest.mark.parametrize("edit, message", [c[1:] for c in BAD_TRT_FIELDS], ids=[c[0] for c in BAD_TRT_FIELDS])
def test_manifest_tensorrt_fields_are_checked(tmp_path, trt_dir, edit, message):
    d = _variant(tmp_path, trt_dir, edit)
    with pytest.raises(Ds4Error, match=message) as err:
        M.tensorrt_info(M.load(d, verify_hashes=False))
    assert "\n" not in str(err.value) and str(d / M.MANIFEST) in str(err.value)


def test_onnxruntime_directory_has_no_tensorrt_fields():
    with pytest.raises(Ds4Error, match=r"backend 'onnxruntime' has no TensorRT engines \(build them with "
                                       r"ds4-build --from-onnx .* --backend tensorrt\)"):
        M.tensorrt_info(M.load(tiny_engine("ds4"), verify_hashes=False))
    with pytest.raises(Ds4Error, match=r"backend 'onnxruntime' cannot be loaded by the tensorrt runtime"):
        RT.open_engine(tiny_engine("ds4"))


COMPATIBILITY = [   # (case, built version, version-compatible, built cc, this machine's TensorRT, GPU, runs?)
    ("same build", "10.3.0.30", False, "8.7", "10.3.0.30", "8.7", True),
    ("another build number", "10.3.0.30", False, "8.7", "10.3.0.26", "8.7", True),   # major.minor.patch decide
    ("another patch", "10.3.0", False, "8.7", "10.3.1", "8.7", False),
    ("newer minor", "10.3.0", False, "8.7", "10.4.0", "8.7", False),
    ("another GPU", "10.3.0", False, "8.7", "10.3.0", "9.0", False),                 # Orin engines on an H200
    ("Thor vs Spark", "11.4.1", False, "11.0", "11.4.1", "12.1", False),             # sm_110 engines on sm_121
    ("no TensorRT", "10.3.0", False, "8.7", None, "8.7", False),
    ("no GPU", "10.3.0", False, "8.7", "10.3.0", None, False),
    ("VC, later runtime", "10.3.0", True, "8.7", "10.8.0", "8.7", True),             # lean runtime in the plan
    ("VC, next major", "10.16.0", True, "9.0", "11.4.0", "9.0", True),               # 10 -> 11 is allowed
    ("VC, older runtime", "10.8.0", True, "8.7", "10.3.0", "8.7", False),            # never backwards
    ("VC, another GPU", "10.3.0", True, "8.7", "10.8.0", "9.0", False),              # VC is not hardware compat
]


@pytest.mark.parametrize("built, vc, cc, here, gpu, runs", [c[1:] for c in COMPATIBILITY],
                         ids=[c[0] for c in COMPATIBILITY])
def test_compatibility_rule(built, vc, cc, here, gpu, runs):
    problem = RT.compatibility_problem(_info(version=built, version_compatible=vc, compute_capability=cc), here, gpu,
                                       "engines/x")
    assert (problem is None) == runs
    if not runs:
        assert problem == (f"engines built with TensorRT {built}{' (version-compatible)' if vc else ''} for compute "
                           f"capability {cc}; this machine has TensorRT {here or 'none'} / GPU {gpu or 'none'}: "
                           "rebuild with scripts/jetson_build.sh engines/x")


def test_ds4_run_refuses_engines_built_elsewhere(trt_dir, capsys):
    """Here: no TensorRT, no GPU. On a machine with both, the versions in trt_dir (10.3.0.30, sm_87) still differ
    unless it is that Orin: the refusal comes before any engine byte is read."""
    trt_version = getattr(sys.modules.get("tensorrt"), "__version__", None) if importlib.util.find_spec("tensorrt") \
        else None
    if trt_version and trt_version.startswith("10.3.0") and RT._gpu_compute_capability() == "8.7":
        pytest.skip("this machine matches the placeholder engines' TensorRT and GPU")
    with pytest.raises(Ds4Error, match=r"engines built with TensorRT 10\.3\.0\.30 for compute capability 8\.7; "
                                       r"this machine has TensorRT .* / GPU .*: rebuild with scripts/jetson_build\.sh"):
        RT.open_engine(trt_dir)
    with pytest.raises(SystemExit) as code:
        cli.run_main(["--engines", str(trt_dir), "-p", "hi"])
    assert code.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ds4-run: error: ") and "compute capability 8.7" in err[0]


# ---------------------------------------------------------------------------------------------------
# The graph TensorRT parses: ds4::MoE bound to the plugin

def _ext(t) -> dict:
    return {e.key: e.value for e in t.external_data}


@pytest.mark.parametrize("role", ["target", "mtp"])
def test_tensorrt_graph_binds_moe_to_the_plugin(role):
    d = tiny_engine("ds4")
    path = d / f"{role}.onnx"
    model = onnx.load(str(path), load_external_data=False)
    before = model.SerializeToString()
    out = XT.tensorrt_graph(model)
    assert model.SerializeToString() == before                           # the exported graph is untouched
    src_inits, inits = {t.name: t for t in model.graph.initializer}, {t.name: t for t in out.graph.initializer}
    moe_nodes = [n for n in out.graph.node if n.domain == moe.DOMAIN]
    assert moe_nodes and len(out.graph.node) == len(model.graph.node)
    blocks = set()
    with open(d / "weights.bin", "rb") as w:
        for node in moe_nodes:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert node.op_type == P.NAME == "MoE"
            assert attrs["plugin_namespace"] == b"ds4" and attrs["plugin_version"] == b"1"
            assert set(attrs) == set(moe.ATTRIBUTES) | {"plugin_namespace", "plugin_version"}
            a = P.plugin_attributes(node)
            for name, shape in zip(node.input[3:], a.block_shapes()):
                blocks.add(name)
                t, src = inits[name], src_inits[name]
                assert (src.data_type, tuple(src.dims)) == (TensorProto.UINT8, shape)
                assert (t.data_type, tuple(t.dims)) == (TensorProto.INT32, (math.prod(shape) // 4,))
                assert _ext(t) == _ext(src)                                 # the same bytes of weights.bin
                w.seek(int(_ext(t)["offset"]))
                raw = np.frombuffer(w.read(int(_ext(t)["length"])), np.uint8)
                assert np.array_equal(P.pack_words(raw), raw.view("<i4"))
                unpacked = P.unpack_words(torch.from_numpy(P.pack_words(raw).copy()), shape)
                assert np.array_equal(unpacked.numpy().reshape(-1), raw)
    # nothing else changed
    for a, b in zip(model.graph.node, out.graph.node):
        if a.domain != moe.DOMAIN:
            assert a == b
    for name, t in src_inits.items():
        if name not in blocks:
            assert inits[name] == t
    assert list(out.graph.input) == list(model.graph.input) and list(out.graph.output) == list(model.graph.output)


def _moe_graph(types3=(N.Q4_K, N.Q4_K, N.Q4_K), E=2, F=256, D=256, extra_user=False, drop_attr=None,
               block_dtype=TensorProto.UINT8):
    attrs = dict(gate_type=types3[0], up_type=types3[1], down_type=types3[2], n_expert=E, expert_ff=F, n_embd=D,
                 clamp=10.0)
    if drop_attr:
        attrs.pop(drop_attr)
    shapes = [moe.blocks_shape(types3[0], E, F, D), moe.blocks_shape(types3[1], E, F, D),
              moe.blocks_shape(types3[2], E, D, F)]
    inits = [helper.make_tensor(n, block_dtype, s, np.zeros(math.prod(s), np.uint8).tobytes(), raw=True)
             for n, s in zip(("g", "u", "dn"), shapes)]
    nodes = [helper.make_node("MoE", ["v", "ids", "w", "g", "u", "dn"], ["y"], domain="ds4", **attrs)]
    if extra_user:
        nodes.append(helper.make_node("Cast", ["g"], ["gf"], to=TensorProto.FLOAT))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["T", D]),
                                       helper.make_tensor_value_info("ids", TensorProto.INT64, ["T", 2]),
                                       helper.make_tensor_value_info("w", TensorProto.FLOAT, ["T", 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ds4", 1)])


BAD_GRAPHS = [   # (case, graph, message)
    ("block shared with another node", _moe_graph(extra_user=True), r"block initializer g also feeds other nodes"),
    ("block not uint8", _moe_graph(block_dtype=TensorProto.INT8), r"block initializer g is INT8 .* the contract says UINT8"),
    ("attribute missing", _moe_graph(drop_attr="clamp"), r"attributes: missing \['clamp'\]"),
]


@pytest.mark.parametrize("model, message", [c[1:] for c in BAD_GRAPHS], ids=[c[0] for c in BAD_GRAPHS])
def test_tensorrt_graph_refuses(model, message):
    with pytest.raises(Ds4Error, match=message) as err:
        XT.tensorrt_graph(model)
    assert "\n" not in str(err.value)


def test_block_words():
    """Contract block tensors are always whole 4-byte words (rows are multiples of 256 values, so an IQ2_XXS
    tensor has an even number of 66-byte blocks); anything else is refused rather than truncated."""
    assert P.words_shape((8, 256, 66)) == (8 * 256 * 66 // 4,)
    with pytest.raises(ValueError, match=r"\(66 bytes\) is not a whole number of 4-byte words"):
        P.words_shape((1, 1, 66))
    b = np.arange(16, dtype=np.uint8).reshape(2, 2, 4)
    assert P.pack_words(b).tolist() == [0x03020100, 0x07060504, 0x0B0A0908, 0x0F0E0D0C]    # little-endian


def test_plugin_attributes_of_the_exported_node():
    d = tiny_engine("ds4")
    m = M.load(d, verify_hashes=False)
    model = onnx.load(str(d / "target.onnx"), load_external_data=False)
    node = next(n for n in model.graph.node if n.domain == moe.DOMAIN)
    a = P.plugin_attributes(node)
    cfg = m.config()
    assert (a.n_expert, a.expert_ff, a.n_embd, a.clamp) == (cfg.n_expert, cfg.expert_ff, cfg.n_embd, cfg.swiglu_clamp)
    assert (a.gate_type, a.up_type, a.down_type) == (N.IQ2_XXS, N.IQ2_XXS, N.Q2_K)   # tiny_gguf's target experts
    assert all(isinstance(getattr(a, k), int) for k in moe.ATTRIBUTES if k != "clamp") and isinstance(a.clamp, float)
    with pytest.raises(ValueError, match=r"ds5::MoE is not ds4::MoE"):
        P.plugin_attributes(helper.make_node("MoE", ["x"], ["y"], domain="ds5"))


GOOD_ATTRS = dict(gate_type=N.Q4_K, up_type=N.Q4_K, down_type=N.Q2_K, n_expert=4, expert_ff=256, n_embd=512, clamp=7.0)
BAD_ATTRS = [   # (case, change, message)
    ("missing", {"clamp": None}, r"missing \['clamp'\], unexpected \[\]"),
    ("extra", {"bias": 1}, r"missing \[\], unexpected \['bias'\]"),
    ("float where int", {"n_expert": 4.0}, r"attribute n_expert: expected an integer, got 4\.0"),
    ("bool where int", {"gate_type": True}, r"attribute gate_type: expected an integer, got True"),
    ("clamp zero", {"clamp": 0.0}, r"attribute clamp: expected a number > 0, got 0\.0"),
    ("clamp NaN", {"clamp": float("nan")}, r"attribute clamp: expected a number > 0"),
    ("no experts", {"n_expert": 0}, r"attribute n_expert: expected >= 1, got 0"),
    ("unknown ggml type", {"up_type": 99}, r"attributes: 99 is not a valid GGMLQuantizationType"),
    ("row splits a block", {"n_embd": 300}, r"attributes: a Q4_K row of 300 values splits a block of 256"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in BAD_ATTRS], ids=[c[0] for c in BAD_ATTRS])
def test_plugin_attribute_checks(change, message):
    values = {k: v for k, v in (GOOD_ATTRS | change).items() if v is not None}
    with pytest.raises(ValueError, match=message):
        P.check_attrs(values)


def test_plugin_attributes_as_tensorrt_passes_them():
    """TensorRT's ONNX parser hands INT attributes over as int32 and FLOAT as float32 fields; tensorrt.plugin turns
    them into int() / float() of one-element arrays (create_plugin). numpy scalars must pass too."""
    values = {k: (np.float32(v) if k == "clamp" else np.int32(v)) for k, v in GOOD_ATTRS.items()}
    assert P.check_attrs(values) == P.check_attrs(GOOD_ATTRS) == P.MoEAttrs(**GOOD_ATTRS)


# ---------------------------------------------------------------------------------------------------
# The plugin: registration signature and host entry point

MIXES = {"iq2_iq2_q2k": (N.IQ2_XXS, N.IQ2_XXS, N.Q2_K), "q4k": (N.Q4_K, N.Q4_K, N.Q4_K),
         "q2k_q2k_q4k": (N.Q2_K, N.Q2_K, N.Q4_K)}


def _moe_case(types3, T, seed=0, E=6, F=256, D=512, k=2):
    v, ids, w, (gate, up, down) = random_moe_inputs(types3, T, seed, E, F, D, k)
    attrs = P.MoEAttrs(*types3, E, F, D, 10.0)
    return (v, ids, w, gate, up, down), attrs


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("T", [1, 3, P.KERNEL_MAX_T + 4])
def test_plugin_impl_and_host_entry_equal_the_reference(mix, T):
    (v, ids, w, gate, up, down), attrs = _moe_case(MIXES[mix], T, seed=T)
    want = moe.moe_reference(v, ids, w, gate, up, down, **attrs.reference_kwargs())
    words = [torch.from_numpy(P.pack_words(b).copy()) for b in (gate, up, down)]   # what TensorRT hands over
    out = torch.full((T, attrs.n_embd), float("nan"))
    P.moe_host(torch.from_numpy(v), torch.from_numpy(ids), torch.from_numpy(w), *words, attrs, out)
    assert np.array_equal(out.numpy(), want)
    # the registered implementation's body, as TensorRT calls it (attributes as the parser's int32 / float32
    # fields become after tensorrt.plugin's int() / float()), on CPU tensors
    out2 = torch.full((T, attrs.n_embd), float("nan"))
    values = [np.int32(getattr(attrs, a)) if a != "clamp" else np.float32(attrs.clamp) for a in moe.ATTRIBUTES]
    P.plugin_impl(torch.from_numpy(v), torch.from_numpy(ids), torch.from_numpy(w), *words,
                  *[int(x) if isinstance(x, np.integer) else float(x) for x in values], (out2,), 0, device="cpu")
    assert np.array_equal(out2.numpy(), want)
    # the words are views: unpacking shares their memory
    assert P.unpack_words(words[0], attrs.block_shapes()[0]).data_ptr() == words[0].data_ptr()
    with pytest.raises(ValueError, match=r"expected int32 \[\d+\] block words"):
        P.moe_host(torch.from_numpy(v), torch.from_numpy(ids), torch.from_numpy(w), words[1][:-1], words[1],
                   words[2], attrs, out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel path of the plugin runs on a CUDA GPU")
@pytest.mark.parametrize("T", [1, 5, P.KERNEL_MAX_T + 3])
def test_plugin_host_entry_on_gpu_equals_the_reference(T):
    (v, ids, w, gate, up, down), attrs = _moe_case(MIXES["iq2_iq2_q2k"], T, seed=T)
    want = moe.moe_reference(v, ids, w, gate, up, down, **attrs.reference_kwargs())
    cuda = lambda a: torch.from_numpy(np.ascontiguousarray(a)).cuda()  # noqa: E731
    out = torch.empty(T, attrs.n_embd, device="cuda")
    P.moe_host(cuda(v), cuda(ids), cuda(w), *(cuda(P.pack_words(b)) for b in (gate, up, down)), attrs, out)
    got = out.cpu().numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


class _FakeTrtp(types.ModuleType):
    """A stand-in for tensorrt.plugin recording what register() declares (the real one validates the same
    things: TensorDesc-annotated inputs first, then attributes of supported types, tensorrt/plugin/_validate.py)."""

    class TensorDesc:
        def like(self):
            return "like"

    class AutoTuneCombination:
        def __init__(self, types_, layouts="LINEAR"):
            self.types, self.layouts = types_, layouts

    def __init__(self):
        super().__init__("tensorrt.plugin")
        self.defined = {}

    def _deco(self, kind):
        def wrap(plugin_id):
            def keep(fn):
                self.defined[(kind, plugin_id)] = fn
                return fn
            return keep
        return wrap

    def __getattr__(self, name):
        if name in ("register", "autotune", "impl"):
            return self._deco(name)
        raise AttributeError(name)


def test_plugin_registration_declares_the_contract(monkeypatch):
    fake = _FakeTrtp()
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", fake)
    monkeypatch.setattr(P, "_REGISTERED", False)
    P.register()
    P.register()                                                  # once per process
    assert set(fake.defined) == {("register", "ds4::MoE"), ("autotune", "ds4::MoE"), ("impl", "ds4::MoE")}
    desc = inspect.signature(fake.defined[("register", "ds4::MoE")])
    assert list(desc.parameters) == list(moe.INPUTS) + list(moe.ATTRIBUTES)
    for name, p in desc.parameters.items():   # real classes (no string annotations), as tensorrt.plugin requires
        want = fake.TensorDesc if name in moe.INPUTS else float if name == "clamp" else int
        assert p.annotation is want, name
    assert desc.return_annotation is fake.TensorDesc
    assert fake.defined[("register", "ds4::MoE")](*[fake.TensorDesc()] * 6, *GOOD_ATTRS.values()) == "like"
    combos = fake.defined[("autotune", "ds4::MoE")](*[None] * 6, outputs=None)
    assert [c.types for c in combos] == ["FP32, INT64, FP32, INT32, INT32, INT32, FP32"]
    impl = inspect.signature(fake.defined[("impl", "ds4::MoE")])
    assert list(impl.parameters) == list(moe.INPUTS) + list(moe.ATTRIBUTES) + ["outputs", "stream"]
    assert (P.NAMESPACE, P.NAME, P.PLUGIN_ID) == (moe.DOMAIN, moe.OP_TYPE, "ds4::MoE")


# ---------------------------------------------------------------------------------------------------
# cuda-python error handling

def test_cuda_call_raises_on_any_error_code():
    rt = pytest.importorskip("cuda.bindings.runtime", reason="cuda-bindings is not installed")
    with pytest.raises(Ds4Error, match=r"cudaMalloc\(64\) failed: cudaErrorMemoryAllocation \(2\)"):
        cuda_call((rt.cudaError_t.cudaErrorMemoryAllocation, None), "cudaMalloc(64)")
    assert cuda_call((rt.cudaError_t.cudaSuccess, 7)) == 7 and cuda_call((rt.cudaError_t.cudaSuccess,)) is None
    assert cuda_call((rt.cudaError_t.cudaSuccess, 1, 2)) == (1, 2)
    result = rt.cudaMalloc(64)
    if result[0] == rt.cudaError_t.cudaSuccess:          # a GPU: allocate and free for real
        cuda_call(rt.cudaFree(cuda_call(result)))
    else:                                                # no driver or no device here: the real error, by name
        with pytest.raises(Ds4Error, match=r"cudaMalloc failed: cudaError\w+ \(\d+\)"):
            cuda_call(result, "cudaMalloc")
        from ds4trt.runtime.buffers import DeviceArena, device_compute_capability
        assert device_compute_capability() is None
        with pytest.raises(Ds4Error, match=r"cudaMalloc\(\d+\) failed"):
            DeviceArena(plan_buffers([M.IOSpec("x", "float32", (4,))], [], 1))


# ---------------------------------------------------------------------------------------------------
# The runtime's own logic on a stand-in TensorRT (CPU): contexts per profile, buffers, adoption, staging,
# graph capture and replay, behind the unchanged Session / speculative loop



def _speculative(engine, n_draft, n=N_NEW):
    s = engine.session(CTX)
    s.prefill(PROMPT, chunk=9)
    out, log = [s.argmax()], []
    while len(out) < n:
        new = s.eval_speculative_argmax(out[-1], n - len(out), None, n_draft=n_draft, margin=0.0, log=log.append)
        out += new[1:] + [s.argmax()]
    return out[:n], [line.split(" margins=")[0] for line in log], s


class _CpuArena:
    """DeviceArena's interface over one CPU byte tensor (the same plan, offsets and views)."""
    live: list = []

    def __init__(self, plan, scratch_bytes=0):
        self.plan, self.scratch_bytes = plan, max(ALIGN, -(-scratch_bytes // ALIGN) * ALIGN)
        self.nbytes = plan.total + self.scratch_bytes
        raw = torch.zeros(self.nbytes + ALIGN, dtype=torch.uint8)       # cudaMalloc's alignment, on the CPU
        self.buf = raw[-raw.data_ptr() % ALIGN:][:self.nbytes]
        self.ptr = self.buf.data_ptr()
        _CpuArena.live.append(self)

    def address(self, name):
        return self.ptr + self.plan.slots[name].offset

    @property
    def scratch(self):
        return self.ptr + self.plan.total

    def view(self, name, T=None):
        slot = self.plan.slots[name]
        return self.at(slot.offset, slot.dtype, slot.shape if T is None else slot.shape_for(T))

    def at(self, offset, dtype, shape):
        n = math.prod(shape) * ITEMSIZE[dtype]
        return self.buf[offset:offset + n].view(getattr(torch, dtype)).view(shape)

    def owns(self, ptr):
        return self.ptr <= ptr < self.ptr + self.nbytes

    def close(self):
        _CpuArena.live.remove(self)

    @staticmethod
    def tensor_at(ptr, dtype, shape):
        a = next(a for a in _CpuArena.live if a.owns(ptr))
        return a.at(ptr - a.ptr, dtype, shape)


_CAPTURING: list = []


class _FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: work enqueued while capturing is recorded, replay() runs it again on
    whatever the buffers then hold (what a CUDA graph does)."""

    def __init__(self):
        self.work = []

    def replay(self):
        for w in self.work:
            w()


class _capture:
    def __init__(self, graph, stream=None):
        self.graph = graph

    def __enter__(self):
        _CAPTURING.append(self.graph.work)

    def __exit__(self, *exc):
        _CAPTURING.pop()


class _FakeStream:
    cuda_stream = 0

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


def _fake_tensorrt(directory: Path, runs: list):
    """A stand-in tensorrt module whose engines are the directory's ONNX graphs in ONNX Runtime, reporting
    the I/O and profiles a real engine built from the manifest would. `runs` records (role, profile, T, how)."""
    import onnxruntime as ort

    m = M.load(directory, verify_hashes=False)
    info = M.tensorrt_info(m)
    trt = types.SimpleNamespace(
        __version__=info.version,
        DataType=types.SimpleNamespace(FLOAT="FLOAT", INT64="INT64"),
        TensorIOMode=types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT"),
        ExecutionContextAllocationStrategy=types.SimpleNamespace(USER_MANAGED="USER_MANAGED"))

    class Context:
        def __init__(self, engine):
            self.engine, self.addr, self.shapes, self.profile, self.memory = engine, {}, {}, None, None

        def set_device_memory(self, ptr, size):
            assert size >= engine_memory and ptr % ALIGN == 0
            self.memory = ptr

        def set_optimization_profile_async(self, i, stream):
            self.profile = i

        def set_tensor_address(self, name, ptr):
            assert ptr % ALIGN == 0
            self.addr[name] = ptr

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)

        def execute_async_v3(self, stream):
            shapes = dict(self.shapes)
            if _CAPTURING:
                _CAPTURING[-1].append(lambda: self.run(shapes, "graph"))
            else:
                self.run(shapes, "eager")
            return True

        def run(self, shapes, how):
            e = self.engine
            T = shapes["tokens"][0]
            p = info.profiles[self.profile]
            assert p["min"] <= T <= p["max"], (p, T)                  # a context runs only its profile's shapes
            feeds = {}
            for s in e.inputs:
                shape = shapes.get(s.name, s.shape)
                feeds[s.name] = _CpuArena.tensor_at(self.addr[s.name], s.dtype, shape).numpy().copy()
            outs = e.session.run([s.name for s in e.outputs], feeds)
            for s, o in zip(e.outputs, outs):
                _CpuArena.tensor_at(self.addr[s.name], s.dtype, o.shape).copy_(torch.from_numpy(o))
            runs.append((e.role, p["name"], T, how))

    engine_memory = 4096

    class Engine:
        def __init__(self, role):
            g = m.graphs[role]
            self.role, self.inputs, self.outputs = role, g["inputs"], g["outputs"]
            self.session = ort.InferenceSession(str(g["file"]), moe.onnxruntime_session_options(),
                                                providers=["CPUExecutionProvider"])
            self.io = [(s, "INPUT") for s in self.inputs] + [(s, "OUTPUT") for s in self.outputs]
            self.num_io_tensors = len(self.io)
            self.num_optimization_profiles = len(info.profiles)
            self.device_memory_size_v2 = engine_memory

        def spec(self, name):
            return next((s, mode) for s, mode in self.io if s.name == name)

        def get_tensor_name(self, i):
            return self.io[i][0].name

        def get_tensor_mode(self, name):
            return self.spec(name)[1]

        def get_tensor_dtype(self, name):
            return {"float32": "FLOAT", "int64": "INT64"}[self.spec(name)[0].dtype]

        def get_tensor_shape(self, name):
            return [-1 if d == "T" else d for d in self.spec(name)[0].shape]

        def get_tensor_profile_shape(self, name, i):
            p = info.profiles[i]
            return [(p["min"],), (p["opt"],), (p["max"],)]

        def create_execution_context(self, strategy):
            assert strategy == "USER_MANAGED"
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            self.engine_host_code_allowed = False

        def deserialize_cuda_engine(self, plan: bytes):
            return Engine(plan.decode().rsplit(" ", 1)[1])           # trt_dir's placeholder plans name their role

    class Logger:
        WARNING = 2

        def __init__(self, severity):
            pass

    trt.Runtime, trt.Logger = Runtime, Logger
    return trt


@pytest.fixture
def fake_trt(monkeypatch, trt_dir):
    runs: list = []
    trt = _fake_tensorrt(trt_dir, runs)
    monkeypatch.setattr(RT, "_trt_version", lambda: (trt, trt.__version__))
    monkeypatch.setattr(RT, "_gpu_compute_capability", lambda: "8.7")
    monkeypatch.setattr(RT, "DeviceArena", _CpuArena)
    monkeypatch.setattr(RT.TrtEngine, "DEVICE", "cpu")
    monkeypatch.setattr(P, "register", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", _capture)
    return runs


@pytest.fixture(scope="module")
def ort_reference():
    """The ONNX Runtime backend on the same graphs: logits after the prompt, greedy tokens, and a speculative run
    (draft 3, margin 0) with its drafts and committed caches."""
    from ds4trt.runtime.backends.onnxruntime import open_engine as open_ort

    engine = open_ort(tiny_engine("ds4"), verify_hashes=False)
    s = engine.session(CTX)
    s.prefill(PROMPT, chunk=9)
    tokens, drafts, spec = _speculative(engine, 3)
    return {"logits": s.logits, "greedy": _greedy(engine), "speculative": tokens, "drafts": drafts,
            "caches": spec.cache.live_tensors()}


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_runtime_on_a_stand_in_tensorrt(fake_trt, trt_dir, ort_reference, cuda_graphs):
    """The TensorRT backend's runtime over engines that are the same ONNX graphs in ONNX Runtime: every token,
    draft, logit and committed cache row must equal the ONNX Runtime backend's, and each step must run on its
    phase's context (a CUDA graph replay from the second decode / verify / draft step of a size on)."""
    ref = ort_reference
    engine = RT.open_engine(trt_dir, verify_hashes=False, cuda_graphs=cuda_graphs)
    try:
        assert engine.prefill_chunk == CTX          # prefill steps take the widest profile: min(--prefill-chunk, ctx)
        s = engine.session()
        views = {f"cache.{k}": v.data_ptr() for k, v in s.cache.tensors().items()}
        assert views == {n: engine.model.arena.address(n) for n in views}     # the caches live in the arena
        s.prefill(PROMPT, chunk=9)
        assert torch.equal(s.logits, ref["logits"])
        assert _greedy(engine) == ref["greedy"]
        got, drafts, s2 = _speculative(engine, 3)
        assert got == ref["speculative"] == ref["greedy"] and drafts == ref["drafts"] and s2.stats.drafted[0] > 0
        live = s2.cache.live_tensors()
        assert live.keys() == ref["caches"].keys() and all(torch.equal(live[k], ref["caches"][k]) for k in live)
        s2.rewind(len(PROMPT) // 2)                                  # replayed, then moved back in place
        assert s2.cache.layers is engine.model.owner
        assert s2.cache.layers[0].raw.data_ptr() == engine.model.arena.address("cache.0.raw")
        with pytest.raises(Ds4Error, match=r"taken over by a newer session of the same TensorRT engine"):
            s.eval(5)                                                # s's caches were adopted by later sessions
        with pytest.raises(Ds4Error, match=r"a step of 65 tokens is outside the TensorRT profiles"):
            engine.model(torch.arange(CTX + 1), s2.cache.start(), s2.cache.layers)
    finally:
        engine.close()
    phases = {(role, name) for role, name, T, how in fake_trt}
    assert phases == {("target", "decode"), ("target", "verify"), ("target", "prefill"), ("mtp", "decode"),
                      ("mtp", "verify"), ("mtp", "prefill")}
    assert all(name == "decode" for _, name, T, _ in fake_trt if T == 1)
    replays = {(role, name, T) for role, name, T, how in fake_trt if how == "graph"}
    if cuda_graphs:     # decode, verify and draft replay graphs; prefill never does
        assert ("target", "decode", 1) in replays and ("mtp", "decode", 1) in replays
        assert any(name == "verify" for _, name, _ in replays) and all(name != "prefill" for _, name, _ in replays)
    else:
        assert not replays


# ---------------------------------------------------------------------------------------------------
# The build's own logic on a stand-in TensorRT: what it asks of the builder, and what it writes

def _fake_builder_trt(calls: list):
    """A stand-in tensorrt module recording the build calls; a 'plan' is the parsed graph's MoE attributes."""
    class Flag:
        STRONGLY_TYPED = 3
        VERSION_COMPATIBLE = "VERSION_COMPATIBLE"

    class Tensor:
        def __init__(self, name, shape):
            self.name, self.shape = name, shape

    class Network:
        def __init__(self):
            self.inputs = []
            self.num_inputs = 0

        def get_input(self, i):
            return self.inputs[i]

    class Parser:
        num_errors = 0

        def __init__(self, network, logger):
            self.network = network

        def parse(self, model: bytes, path: str):
            m = onnx.load_from_string(model)
            calls.append(("parse", Path(path).name, m))
            self.network.inputs = [Tensor(i.name, tuple(d.dim_value if d.HasField("dim_value") else -1
                                                        for d in i.type.tensor_type.shape.dim)) for i in m.graph.input]
            self.network.num_inputs = len(self.network.inputs)
            return True

    class Cache:
        def __init__(self, data):
            self.data = bytes(data)

        def serialize(self):
            return self.data + b"+"

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    class Config:
        def __init__(self):
            self.flags, self.profiles, self.cache, self.max_aux_streams = [], [], None, None

        def create_timing_cache(self, data):
            calls.append(("create_timing_cache", bytes(data)))
            return Cache(data)

        def set_timing_cache(self, cache, ignore_mismatch):
            assert ignore_mismatch is False
            self.cache = cache

        def set_flag(self, flag):
            self.flags.append(flag)

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            assert flags == 1 << Flag.STRONGLY_TYPED
            return Network()

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            calls.append(("build", config))
            return b"plan"

    class ILogger:
        INTERNAL_ERROR, ERROR, WARNING = 0, 1, 2

        def __init__(self):
            pass

    return types.SimpleNamespace(__version__="10.3.0.30", Builder=Builder, OnnxParser=Parser, ILogger=ILogger,
                                 NetworkDefinitionCreationFlag=Flag, BuilderFlag=Flag)


def test_build_on_a_stand_in_tensorrt(monkeypatch, tmp_path, capsys):
    """ds4-build --gguf ... --backend tensorrt, then --from-onnx on the result: the rewritten graphs are parsed
    with their weights' path, every T input gets one shape range per profile, the timing cache is reused and
    saved, the flags asked for are set, and the manifest passes tensorrt_info with the engines listed."""
    from ds4trt.export import package

    calls: list = []
    trt = _fake_builder_trt(calls)
    monkeypatch.setattr(XT, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(package, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(XT, "compute_capability", lambda: "9.0")
    monkeypatch.setattr(P, "register", lambda: None)
    target, mtp = tiny_files()
    out = tmp_path / "engine"
    assert cli.build(["--gguf", str(target), "--mtp", str(mtp), "--out", str(out), "--ctx", str(CTX),
                      "--backend", "tensorrt", "--mtp-draft-max", "3"]) == 0
    assert "TensorRT 10.3.0.30 engines for compute capability 9.0: target.engine, mtp.engine; profiles decode T " \
           "1..1, verify T 2..4, prefill T 1..64" in capsys.readouterr().out
    m = M.load(out)
    info = M.tensorrt_info(m)
    assert (m.backend, info.version, info.compute_capability, info.version_compatible) == \
        ("tensorrt", "10.3.0.30", "9.0", False)
    assert [(p["name"], p["min"], p["opt"], p["max"]) for p in info.profiles] == \
        [("decode", 1, 1, 1), ("verify", 2, 4, 4), ("prefill", 1, 64, 64)]
    assert all(path.read_bytes() == b"plan" for path in info.engines.values())
    assert m.data["tools"]["tensorrt"] == "10.3.0.30" and (out / XT.TIMING_CACHE).read_bytes() == b"+"
    parsed = [c for c in calls if c[0] == "parse"]
    assert [name for _, name, _ in parsed] == ["target.onnx", "mtp.onnx"]
    for _, name, model in parsed:
        nodes = [n for n in model.graph.node if n.domain == moe.DOMAIN]
        assert nodes and all(any(a.name == "plugin_namespace" for a in n.attribute) for n in nodes)
    builds = [c[1] for c in calls if c[0] == "build"]
    assert [sorted(p.shapes) for p in builds[0].profiles] == [["tokens"]] * 3
    assert [sorted(p.shapes) for p in builds[1].profiles] == [["h", "tokens"]] * 3
    assert builds[1].profiles[1].shapes["h"] == ((2, 4, 256), (4, 4, 256), (4, 4, 256))
    assert all(b.max_aux_streams == 0 and b.flags == [] and b.cache is builds[0].cache for b in builds)

    # on the device: in place, the timing cache reused, version compatibility asked for
    calls.clear()
    assert cli.build(["--from-onnx", str(out), "--backend", "tensorrt", "--version-compatible"]) == 0
    assert [c[1] for c in calls if c[0] == "create_timing_cache"] == [b"+"]
    assert all(c[1].flags == ["VERSION_COMPATIBLE"] for c in calls if c[0] == "build")
    info = M.tensorrt_info(M.load(out))
    assert info.version_compatible and (out / XT.TIMING_CACHE).read_bytes() == b"++"


# ---------------------------------------------------------------------------------------------------
# ds4-build and jetson_build.sh

def test_build_command_lines(tmp_path):
    target, _ = tiny_files()
    d = tiny_engine("ds4")
    rows = [   # (argv, message)
        (["--from-onnx", str(d)], "--from-onnx builds TensorRT engines: pass --backend tensorrt"),
        (["--from-onnx", str(d), "--backend", "tensorrt", "--out", str(tmp_path)], "--from-onnx builds in place"),
        (["--from-onnx", str(d), "--backend", "tensorrt", "--mtp", str(target)], "leave out --mtp"),
        (["--gguf", str(target)], "--out DIR is required with --gguf"),
    ]
    if importlib.util.find_spec("tensorrt") is None:
        rows += [(["--from-onnx", str(d), "--backend", "tensorrt"], XT.NOT_INSTALLED),
                 (["--gguf", str(target), "--out", str(tmp_path / "o"), "--backend", "tensorrt"], XT.NOT_INSTALLED)]
    for argv, msg in rows:
        with pytest.raises(Ds4Error) as err:
            cli.build(argv)
        assert msg in str(err.value) and "\n" not in str(err.value), argv
    assert json.loads((d / M.MANIFEST).read_text())["backend"] == "onnxruntime"   # refused builds touch nothing
    with pytest.raises(SystemExit):
        cli.build(["--gguf", str(target), "--from-onnx", str(d)])                 # one source at a time


def test_jetson_build_script():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    text = SCRIPT.read_text()
    assert os.access(SCRIPT, os.X_OK) and text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert any('--from-onnx "$dir" --backend tensorrt "$@"' in line for line in code)   # the documented command
    assert any("ds4-build" in line for line in code) and not any("trtexec" in line for line in code)
    for fact in ("sm_87", "sm_110", "sm_121", "JetPack 6", "TensorRT 10.3"):
        assert fact in text
    usage = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True)
    assert usage.returncode == 2 and "scripts/jetson_build.sh DIR" in usage.stdout
    missing = subprocess.run(["bash", str(SCRIPT), "/nonexistent/dir"], capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip() == \
        "jetson_build.sh: /nonexistent/dir/manifest.json is missing (expected an engine directory written by ds4-build)"


def test_jetson_build_script_without_tensorrt(tmp_path):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT is installed: the script would build")
    d = tmp_path / "engine"
    shutil.copytree(tiny_engine("ds4"), d)
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    r = subprocess.run(["bash", str(SCRIPT), str(d)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 1 and "import tensorrt failed" in r.stderr
    assert M.backend_of(d) == "onnxruntime"


# ---------------------------------------------------------------------------------------------------
# With TensorRT and a GPU

@pytest.fixture(scope="module")
def trt_engine_dir(tmp_path_factory):
    """The tiny model built for TensorRT here, with --check (ORT vs torch, saved; then the engines vs saved)."""
    _needs_tensorrt_gpu()
    target, mtp = tiny_files()
    out = tmp_path_factory.mktemp("trt-build") / "engine"
    rc = cli.build(["--gguf", str(target), "--mtp", str(mtp), "--out", str(out), "--ctx", str(CTX),
                    "--backend", "tensorrt", "--mtp-draft-max", "4", "--check"])
    assert rc == 0
    return out


def test_engines_match_the_saved_onnxruntime_outputs(trt_engine_dir):
    _needs_tensorrt_gpu()
    results = XT.compare_with_saved(trt_engine_dir)
    assert {r.graph for r in results} == {"target", "mtp"} and {r.T for r in results} == {1, 3, 8}
    bad = [r for r in results if not r.ok]
    assert not bad, bad[:5]
    info = M.tensorrt_info(M.load(trt_engine_dir))
    import tensorrt

    assert info.version == tensorrt.__version__ and info.compute_capability == RT._gpu_compute_capability()


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
def test_speculative_decoding_through_tensorrt_is_token_exact(trt_engine_dir, cuda_graphs):
    _needs_tensorrt_gpu()
    target, mtp = tiny_files()
    ref = S.Engine.open(target, mtp, numerics="ds4")
    engine = RT.open_engine(trt_engine_dir, cuda_graphs=cuda_graphs)
    try:
        assert _greedy(engine) == _greedy(ref)
        for n_draft in (1, 2, 4):
            got, got_drafts, s = _speculative(engine, n_draft)
            want, want_drafts, _ = _speculative(ref, n_draft)
            assert got == want == _greedy(ref)
            assert got_drafts == want_drafts and s.stats.drafted[0] > 0
        s.rewind(len(PROMPT) // 2)                          # caches move back into the engine's buffers
        assert s.cache.layers is engine.model.owner
    finally:
        engine.close()


def test_tensorrt_refuses_engines_from_another_version_on_device(trt_engine_dir, tmp_path):
    _needs_tensorrt_gpu()
    d = _variant(tmp_path, trt_engine_dir, lambda m: m["tensorrt"].update(version="9.0.0"))
    with pytest.raises(Ds4Error, match=r"engines built with TensorRT 9\.0\.0 for compute capability"):
        RT.open_engine(d)
