"""model/weights.py on the tiny GGUF, the tiny-model writer itself, and a table of broken files."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType
from gguf import quants as gq

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.reader import GGUFFile
from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import mtp_layout, target_layout
from ds4trt.model.weights import Weights, load_mtp, load_target
from ds4trt.testing.tiny_gguf import (SPECIAL_TOKENS, build_tokenizer, bytes_to_unicode, quantize, random_quant,
                                      tiny_config, write_model_gguf, write_mtp_gguf)

Q2_K, Q4_K, IQ2_XXS, Q8_0, F16, F32 = N.Q2_K, N.Q4_K, N.IQ2_XXS, N.Q8_0, N.F16, N.F32
BF16 = int(GGMLQuantizationType.BF16)
U32, I32, ARR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.ARRAY


def same_config(a: ModelConfig, b: ModelConfig) -> bool:
    """Equal, floats up to f32 rounding (1e-6 is stored as the f32 nearest to it)."""
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    return da.keys() == db.keys() and all(
        math.isclose(da[k], db[k], rel_tol=1e-6) if isinstance(da[k], float) else da[k] == db[k] for k in da)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f, cfg, w = load_target(tiny_gguf)
    yield cfg, w
    w.close()


# ---- the tiny file loads ----------------------------------------------------------------------------

def test_config_round_trips(tiny, tiny_cfg, tiny_gguf):
    cfg, _ = tiny
    assert same_config(cfg, tiny_cfg)
    with GGUFFile(tiny_gguf) as f:
        assert same_config(ModelConfig.from_gguf(f), tiny_cfg)


def test_tiny_config_covers_every_layer_kind(tiny_cfg):
    kinds = {(tiny_cfg.ratio(l), tiny_cfg.is_hash(l)) for l in range(tiny_cfg.n_layer)}
    assert {(0, True), (4, True), (4, False), (8, False)} <= kinds
    assert tiny_cfg.n_embd % 256 == 0 and tiny_cfg.expert_ff % 256 == 0


def test_every_tensor_dequantizes(tiny):
    cfg, w = tiny
    for spec in target_layout(cfg):
        assert w.has(spec.name), spec.name
        t = w.get(spec.name)
        assert tuple(t.shape) == spec.shape, spec.name
        if spec.name.endswith("tid2eid.weight"):
            assert t.dtype == torch.int64
            assert int(t.min()) >= 0 and int(t.max()) < cfg.n_expert
            assert all(len(set(row)) == cfg.n_expert_used for row in t.tolist()), "expert ids repeat in a row"
        else:
            assert t.dtype == torch.float32 and torch.isfinite(t).all(), spec.name
    assert w.get(N.TOKEN_EMBD) is w.get(N.TOKEN_EMBD)  # cached


def test_types_are_the_ones_ds4_ships(tiny):
    cfg, w = tiny
    assert w.type_of(N.TOKEN_EMBD) == F16 and w.type_of(N.OUTPUT) == Q8_0
    assert w.type_of("blk.2.attn_q_a.weight") == Q8_0 and w.type_of("blk.2.attn_norm.weight") == F32
    assert [w.type_of(f"blk.3.ffn_{p}_exps.weight") for p in ("gate", "up", "down")] == [IQ2_XXS, IQ2_XXS, Q2_K]
    assert w.type_of("blk.2.ffn_gate_tid2eid.weight") == N.I32
    assert w.has("blk.5.exp_probs_b.bias")


def test_expert_equals_get(tiny_gguf, tiny_cfg):
    with GGUFFile(tiny_gguf) as f:
        fresh, full = Weights(f, target_layout(tiny_cfg)), Weights(f, target_layout(tiny_cfg))
        for l in (0, 3):
            for p in ("gate", "up", "down"):
                name = f"blk.{l}.ffn_{p}_exps.weight"
                for e in range(tiny_cfg.n_expert):
                    assert torch.equal(fresh.expert(name, e), full.get(name)[e]), (name, e)
        assert name not in fresh._cache  # expert() did not dequantize the whole tensor


def test_weight_scales_keep_activations_o1(tiny):
    cfg, w = tiny
    for name in ("blk.2.ffn_gate_exps.weight", "blk.2.ffn_down_exps.weight", "blk.2.attn_q_b.weight",
                 "blk.4.ffn_up_shexp.weight", "blk.3.attn_compressor_kv.weight"):
        t = w.get(name)
        assert abs(t.std().item() * math.sqrt(t.shape[-1]) - 1) < 0.1, name
        assert abs(t.mean().item()) < 0.05 * t.std().item(), name
    norm = w.get("blk.1.attn_norm.weight")
    assert (norm - 1).abs().max() <= 0.1 + 1e-6


def test_mtp_loads(tiny_mtp_gguf, tiny_cfg):
    f, w = load_mtp(tiny_mtp_gguf, tiny_cfg)
    with f:
        for spec in mtp_layout(tiny_cfg):
            t = w.get(spec.name)
            assert tuple(t.shape) == spec.shape and torch.isfinite(t).all(), spec.name
        assert w.type_of("mtp.0.hc_head_fn.weight") == F32 and w.type_of("mtp.0.ffn_gate_exps.weight") == Q4_K
        assert set(f.metadata) == {N.KEY_ARCHITECTURE}


def test_ratio_128_variant_and_alignment(write_tiny):
    cfg = tiny_config(compress_ratios=(0, 0, 4, 128))
    f, got, w = load_target(write_tiny("r128.gguf", cfg=cfg, alignment=64))
    with f:
        assert same_config(got, cfg) and f.alignment == 64
        assert tuple(w.get("blk.3.attn_compressor_ape.weight").shape) == (128, cfg.head_dim)


def test_optional_bias_may_be_absent(write_tiny):
    f, _, w = load_target(write_tiny(drop=("blk.4.exp_probs_b.bias",)))
    with f:
        assert not w.has("blk.4.exp_probs_b.bias") and w.has("blk.5.exp_probs_b.bias")


def test_unlisted_tensors_are_ignored(write_tiny):
    f, _, w = load_target(write_tiny(tensors={"extra.weight": np.ones((2, 3), np.float32)}))
    with f:
        assert w.get("extra.weight").tolist() == [[1, 1, 1]] * 2


# ---- broken files: one line naming the file and the tensor or key ------------------------------------

BAD = [
    # a required tensor is absent
    pytest.param("target", dict(drop=("blk.3.attn_kv.weight",)), "tensor blk.3.attn_kv.weight is missing",
                 id="missing"),
    # ds4 rejects an F16 attention projection (Q8_0 only)
    pytest.param("target", dict(retype={"blk.0.attn_q_a.weight": F16}),
                 "blk.0.attn_q_a.weight: expected type Q8_0, got F16", id="f16-attn_q_a"),
    # BF16 is never accepted, here for the embedding
    pytest.param("target", dict(retype={N.TOKEN_EMBD: BF16}), "token_embd.weight: expected type F16, got BF16",
                 id="bf16-embd"),
    # routed experts: only the three expert types
    pytest.param("target", dict(retype={"blk.4.ffn_down_exps.weight": Q8_0}),
                 "blk.4.ffn_down_exps.weight: expected type IQ2_XXS, Q2_K or Q4_K, got Q8_0", id="q8-expert"),
    # one dimension off
    pytest.param("target", dict(reshape={"blk.1.attn_kv.weight": (256, 60)}),
                 "blk.1.attn_kv.weight: expected ggml shape [256, 64], got [256, 60]", id="shape"),
    # an extra dimension
    pytest.param("target", dict(reshape={"blk.0.ffn_gate_tid2eid.weight": (2, 512, 1)}),
                 "blk.0.ffn_gate_tid2eid.weight: expected ggml shape [2, 512], got [2, 512, 1]", id="ndim"),
    # gate and up experts must share a type (first offender: layer 0)
    pytest.param("target", dict(expert_types=(IQ2_XXS, Q2_K, Q2_K)),
                 "blk.0.ffn_up_exps.weight: type Q2_K differs from blk.0.ffn_gate_exps.weight (IQ2_XXS)",
                 id="gate-up-types"),
    # metadata says D = 512 while the tensors are 256 wide
    pytest.param("target", dict(metadata_overrides={N.KEY_EMBD: 512}),
                 "token_embd.weight: expected ggml shape [512, 512], got [256, 512]", id="embd-vs-tensors"),
    # metadata says V = 1000
    pytest.param("target", dict(metadata_overrides={N.KEY_VOCAB: 1000}),
                 "token_embd.weight: expected ggml shape [256, 1000], got [256, 512]", id="vocab-vs-tensors"),
    # one more layer in the metadata (arrays long enough) than in the file
    pytest.param("target", dict(metadata_overrides={N.KEY_BLOCK_COUNT: 7,
                                                    N.KEY_COMPRESS_RATIOS: [0, 0, 4, 8, 4, 8, 4],
                                                    N.KEY_SWIGLU_CLAMP: [10.0] * 7}),
                 "tensor blk.6.hc_attn_fn.weight is missing", id="extra-layer"),
    # four hash layers: layer 3 has no tid2eid
    pytest.param("target", dict(metadata_overrides={N.KEY_HASH_LAYERS: 4}),
                 "tensor blk.3.ffn_gate_tid2eid.weight is missing", id="hash-layers"),
    # a required key is absent
    pytest.param("target", dict(drop_keys=(N.KEY_HEAD,)), "metadata key deepseek4.attention.head_count is missing",
                 id="missing-key"),
    # integers must be u32
    pytest.param("target", dict(metadata_overrides={N.KEY_BLOCK_COUNT: GGUFValue(6, I32)}),
                 "deepseek4.block_count: expected u32, got i32", id="i32-block_count"),
    # fewer compress ratios than layers
    pytest.param("target", dict(metadata_overrides={N.KEY_COMPRESS_RATIOS: GGUFValue([0, 0, 4, 8, 4], ARR, U32)}),
                 "deepseek4.attention.compress_ratios: expected at least 6 entries", id="short-ratios"),
    # ds4 requires normalized expert weights
    pytest.param("target", dict(metadata_overrides={N.KEY_EXPERT_WEIGHTS_NORM: False}),
                 "deepseek4.expert_weights_norm: expected true", id="weights-norm"),
    # the MTP block always needs its selection bias
    pytest.param("mtp", dict(drop=("mtp.0.exp_probs_b.bias",)), "tensor mtp.0.exp_probs_b.bias is missing",
                 id="mtp-bias"),
    # MTP "plain" tensors are F16 or F32
    pytest.param("mtp", dict(retype={"mtp.0.hc_head_fn.weight": Q8_0}),
                 "mtp.0.hc_head_fn.weight: expected type F16 or F32, got Q8_0", id="mtp-plain-type"),
    # an MTP file written for another model (D = 512): the first tensor checked is named
    pytest.param("mtp", dict(cfg=tiny_config(n_embd=512)),
                 "mtp.0.hc_head_fn.weight: expected ggml shape [1024, 4], got [2048, 4]", id="mtp-other-model"),
]


@pytest.mark.parametrize("kind, kw, expect", BAD)
def test_bad_file(write_tiny, tiny_cfg, kind, kw, expect):
    path = write_tiny("bad.gguf", mtp=kind == "mtp", **kw)
    with pytest.raises(Ds4Error) as err:
        if kind == "mtp":
            load_mtp(path, tiny_cfg)
        else:
            load_target(path)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(str(path)), msg
    assert expect in msg, msg


def test_target_passed_as_mtp(tiny_gguf, tiny_cfg):
    with pytest.raises(Ds4Error, match=r"not an MTP GGUF \(no mtp\.0\.\* tensors\)") as err:
        load_mtp(tiny_gguf, tiny_cfg)
    assert str(err.value).startswith(str(tiny_gguf))


def test_mtp_plain_f16_is_accepted(write_tiny, tiny_cfg):
    f, w = load_mtp(write_tiny(mtp=True, retype={"mtp.0.hc_head_fn.weight": F16}), tiny_cfg)
    with f:
        assert w.type_of("mtp.0.hc_head_fn.weight") == F16


# ---- the writer ---------------------------------------------------------------------------------------

def test_writer_is_deterministic_and_fast(tmp_path, tiny_cfg):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_model_gguf(a, tiny_cfg)
    t0 = time.perf_counter()
    write_model_gguf(b, tiny_cfg)
    assert time.perf_counter() - t0 < 1.0
    write_model_gguf(c, tiny_cfg, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    write_mtp_gguf(a, tiny_cfg)
    write_mtp_gguf(b, tiny_cfg)
    assert a.read_bytes() == b.read_bytes()


def test_each_tensor_has_its_own_stream(tiny, write_tiny):
    """Dropping or retyping one tensor leaves every other tensor's values unchanged."""
    _, w = tiny
    f, _, v = load_target(write_tiny(drop=("blk.4.exp_probs_b.bias",), retype={"blk.2.ffn_down_exps.weight": Q4_K}))
    with f:
        for name in ("blk.4.attn_q_b.weight", "blk.5.ffn_gate_exps.weight", N.OUTPUT):
            assert torch.equal(v.get(name), w.get(name)), name


@pytest.mark.parametrize("ggml_type", [Q2_K, Q4_K, IQ2_XXS])
def test_random_quant_blocks_have_the_intended_scale(ggml_type):
    raw = random_quant(np.random.default_rng(5), ggml_type, (64, 512), std=0.05)
    x = gq.dequantize(raw, GGMLQuantizationType(ggml_type))
    assert x.shape == (64, 512) and np.isfinite(x).all()
    assert abs(x.std() / 0.05 - 1) < 0.1 and abs(x.mean()) < 0.05 * x.std()


@pytest.mark.parametrize("ggml_type, max_rel_err", [(Q8_0, 0.01), (Q4_K, 0.12), (Q2_K, 0.4), (IQ2_XXS, 0.45)])
def test_given_values_are_quantized(ggml_type, max_rel_err):
    x = np.random.default_rng(6).normal(0, 0.05, (2, 16, 512)).astype(np.float32)
    y = gq.dequantize(quantize(x, ggml_type), GGMLQuantizationType(ggml_type))
    assert y.shape == x.shape
    assert np.sqrt(np.mean((y - x) ** 2)) / x.std() < max_rel_err


def test_given_tensors_are_written(write_tiny, tiny_cfg):
    rng = np.random.default_rng(7)
    gate = rng.normal(0, 0.06, (tiny_cfg.n_expert, tiny_cfg.expert_ff, tiny_cfg.n_embd)).astype(np.float32)
    norm = rng.normal(1, 0.1, (tiny_cfg.n_embd,)).astype(np.float32)
    ids = np.tile(np.arange(tiny_cfg.n_expert_used, dtype=np.int32), (tiny_cfg.n_vocab, 1))
    f, _, w = load_target(write_tiny(expert_types=(Q4_K, Q4_K, Q4_K), tensors={
        "blk.1.ffn_gate_exps.weight": gate, "blk.1.ffn_norm.weight": norm, "blk.1.ffn_gate_tid2eid.weight": ids}))
    with f:
        assert torch.equal(w.get("blk.1.ffn_norm.weight"), torch.from_numpy(norm))
        assert torch.equal(w.get("blk.1.ffn_gate_tid2eid.weight"), torch.from_numpy(ids).long())
        got = w.get("blk.1.ffn_gate_exps.weight").numpy()
        assert np.sqrt(np.mean((got - gate) ** 2)) / gate.std() < 0.12


def test_default_tokenizer(tiny_gguf, tiny_cfg):
    tokens, merges = build_tokenizer(tiny_cfg.n_vocab)
    assert len(tokens) == len(set(tokens)) == tiny_cfg.n_vocab
    assert set(SPECIAL_TOKENS) <= set(tokens) and set(bytes_to_unicode().values()) <= set(tokens)
    assert len(merges) > 100 and not any(t.startswith("<pad_") for t in tokens)
    tokenizer = pytest.importorskip("ds4trt.tokenizer")
    tok = tokenizer.Tokenizer.from_gguf(tiny_gguf)
    tok.require_chat_ids()
    text = "Hello, world! The model reads the file.\n    return x  # ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < 0.6 * len(text.encode())  # merges are used
