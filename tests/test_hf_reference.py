"""Checks of the HF transformers reference (tests/hf_reference.py): config equivalence, RoPE/YaRN tables against
the ds4 formulas (spec ds4_architecture.md §3.0), the GGUF<->HF mapping round trip, and cache vs no-cache."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

pytest.importorskip("transformers")

import hf_reference as R  # noqa: E402
from ds4trt.model.config import ModelConfig  # noqa: E402
from ds4trt.model.layout import target_layout  # noqa: E402

TINY = ModelConfig(
    n_layer=6, compress_ratios=(0, 0, 4, 8, 4, 8), n_hash_layer=3, n_embd=64, n_vocab=300, n_head=4, head_dim=32,
    n_rot=8, q_lora_rank=32, o_lora_rank=16, o_groups=2, n_expert=8, n_expert_used=2, expert_ff=32, window=8,
    index_n_head=4, index_head_dim=16, index_top_k=2, n_hc=4, sinkhorn_iters=20, name="tiny",
)


@pytest.fixture(scope="module")
def tiny_model():
    return R.random_hf_model(TINY, seed=0)


def _ids(n, seed=1, vocab=TINY.n_vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------------------------
# config


def test_hf_config_matches_model_config():
    c = R.hf_config(TINY)
    assert c.layer_types == [R.SLIDING, R.SLIDING, R.CSA, R.HCA, R.CSA, R.HCA]
    assert c.compress_rates == {R.CSA: 4, R.HCA: 8}
    assert c.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    assert c.qk_rope_head_dim == 8 and c.sliding_window == 8 and c.index_topk == 2
    assert c._attn_implementation == "eager"
    assert c.rope_parameters["compress"]["attention_factor"] == 1.0
    assert R.model_config_from_hf(c) == dataclasses.replace(TINY, name="")

    flash = R.hf_config(ModelConfig.flash())
    want = [R.SLIDING, R.SLIDING] + [R.CSA if l % 2 == 0 else R.HCA for l in range(2, 43)]
    assert flash.layer_types == want and flash.compress_rates == {R.CSA: 4, R.HCA: 128}
    assert flash.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 40
    assert flash.qk_rope_head_dim == 64 and flash.max_position_embeddings == 1048576

    with pytest.raises(ValueError, match="one HCA"):
        R.hf_config(dataclasses.replace(TINY, compress_ratios=(0, 0, 4, 8, 4, 16)))


# ---------------------------------------------------------------------------------------------------------------
# RoPE / YaRN against the ds4 formulas (spec §3.0)


def _ds4_inv_freq(n_rot, base, yarn=None):
    """Per-pair angle per position, float64, as spec §3.0 writes it (theta_i = p * f_i)."""
    i = torch.arange(n_rot // 2, dtype=torch.float64)
    f_ext = base ** (-2.0 * i / n_rot)
    if yarn is None:
        return f_ext, None
    factor, orig, bf, bs = yarn
    corr = lambda beta: n_rot * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))  # noqa: E731
    lo, hi = max(0, math.floor(corr(bf))), min(n_rot - 1, math.ceil(corr(bs)))
    ramp = 1 - torch.clamp((i - lo) / max(0.001, hi - lo), 0, 1)
    return (f_ext / factor) * (1 - ramp) + f_ext * ramp, (lo, hi)


@pytest.mark.parametrize("cfg", [ModelConfig.flash(), TINY], ids=["flash", "tiny"])
def test_rope_tables_match_ds4(cfg):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    rot = DeepseekV4RotaryEmbedding(R.hf_config(cfg))
    main, _ = _ds4_inv_freq(cfg.n_rot, cfg.rope_base)
    comp, (lo, hi) = _ds4_inv_freq(cfg.n_rot, cfg.compress_rope_base,
                                   (cfg.rope_scale, cfg.rope_orig_ctx, cfg.yarn_beta_fast, cfg.yarn_beta_slow))
    if cfg.is_flash_shape():
        assert (lo, hi) == (15, 25)
    else:
        assert 0 < lo < hi and lo + 1 < cfg.n_rot // 2  # the tiny table has pairs strictly inside the ramp
    assert rot.main_inv_freq.shape == (cfg.n_rot // 2,) and rot.compress_inv_freq.shape == (cfg.n_rot // 2,)
    torch.testing.assert_close(rot.main_inv_freq.double(), main, rtol=3e-7, atol=0)
    torch.testing.assert_close(rot.compress_inv_freq.double(), comp, rtol=3e-7, atol=0)
    assert rot.main_attention_scaling == 1.0 and rot.compress_attention_scaling == 1.0  # no YaRN mscale


def test_rope_application_matches_ds4(tiny_model):
    """HF's rotation = interleaved pairs on the tail n_rot dims, inverse = -sin; every rotary module in the model
    (model, compressors, indexers) holds the same tables."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    m = tiny_model.model
    for name, mod in tiny_model.named_modules():
        if name.endswith("rotary_emb"):
            assert torch.equal(mod.main_inv_freq, m.rotary_emb.main_inv_freq), name
            assert torch.equal(mod.compress_inv_freq, m.rotary_emb.compress_inv_freq), name
    cfg, d = TINY, 16  # a 16-wide (indexer-like) head: nope 8 | rope 8
    pos = torch.tensor([[0, 1, 5, 37, 1000]])
    x = torch.randn(1, 1, pos.shape[1], d, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for kind in ("main", "compress"):
        inv = getattr(m.rotary_emb, f"{kind}_inv_freq").double()
        cos, sin = m.rotary_emb(x.float(), pos, layer_type=kind)
        got = apply_rotary_pos_emb(x.float(), cos, sin).double()
        back = apply_rotary_pos_emb(got.float(), cos, -sin).double()
        th = pos[0, :, None].double() * inv  # [P, n_rot/2]
        want = x.clone()
        t = x[..., d - cfg.n_rot:]
        x0, x1 = t[..., 0::2], t[..., 1::2]
        want[..., d - cfg.n_rot::2] = x0 * th.cos() - x1 * th.sin()
        want[..., d - cfg.n_rot + 1::2] = x0 * th.sin() + x1 * th.cos()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(back, x, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# GGUF <-> HF mapping


def test_round_trip_is_a_bijection(tiny_model):
    g = R.gguf_tensors_from_hf(tiny_model)
    specs = {s.name: s for s in target_layout(TINY)}
    want = {n for n, s in specs.items() if not (n.endswith("exp_probs_b.bias") and TINY.is_hash(int(n.split(".")[1])))}
    assert set(g) == want
    for n, t in g.items():
        assert tuple(t.shape) == specs[n].shape, n
        assert t.dtype == (torch.int32 if "tid2eid" in n else torch.float32), n
    # every tensor was randomised (HF zero-inits sinks, biases, HC bases, tid2eid)
    for n, t in g.items():
        assert t.float().abs().sum() > 0 and (t.numel() == 1 or t.float().std() > 0), n
    assert all(len(set(r)) == TINY.n_expert_used for r in g["blk.0.ffn_gate_tid2eid.weight"].tolist())

    rebuilt = R.hf_model_from_gguf_tensors(TINY, g)
    sd0, sd1 = tiny_model.state_dict(), rebuilt.state_dict()
    assert sd0.keys() == sd1.keys()
    for k in sd0:
        assert sd0[k].dtype == sd1[k].dtype and torch.equal(sd0[k], sd1[k]), k
    ids = _ids(37)
    assert torch.equal(R.hf_logits(tiny_model, ids), R.hf_logits(rebuilt, ids))
    assert not rebuilt.training


def test_loader_checks_names_shapes_and_defaults(tiny_model):
    g = R.gguf_tensors_from_hf(tiny_model)
    with pytest.raises(KeyError, match="not in target_layout"):
        R.hf_model_from_gguf_tensors(TINY, {**g, "blk.0.bogus.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="missing"):
        R.hf_model_from_gguf_tensors(TINY, {k: v for k, v in g.items() if k != "blk.2.indexer.proj.weight"})
    with pytest.raises(ValueError, match="shape"):
        R.hf_model_from_gguf_tensors(TINY, {**g, "blk.1.attn_sinks.weight": torch.zeros(5)})
    bad = g["blk.1.ffn_gate_tid2eid.weight"].clone()
    bad[0, 0] = TINY.n_expert
    with pytest.raises(ValueError, match="expert ids"):
        R.hf_model_from_gguf_tensors(TINY, {**g, "blk.1.ffn_gate_tid2eid.weight": bad})
    # exp_probs_b.bias is optional: absent -> zeros; a float tid2eid is accepted
    g2 = {k: v for k, v in g.items() if k != "blk.4.exp_probs_b.bias"}
    g2["blk.0.ffn_gate_tid2eid.weight"] = g["blk.0.ffn_gate_tid2eid.weight"].float()
    m = R.hf_model_from_gguf_tensors(TINY, g2)
    assert torch.equal(m.model.layers[4].mlp.gate.e_score_correction_bias, torch.zeros(TINY.n_expert))
    assert m.model.layers[0].mlp.gate.tid2eid.dtype == torch.int64


# ---------------------------------------------------------------------------------------------------------------
# cache vs no cache


def test_topk_tie_break_is_lowest_index():
    orig = torch.topk, torch.Tensor.topk
    with R.ds4_topk_ties():
        assert torch.zeros(10).topk(3).indices.tolist() == [0, 1, 2]
        assert torch.topk(torch.tensor([0.0, 1, 0, 0, 1, 0]), 3, sorted=False).indices.tolist() == [1, 4, 0]
    assert (torch.topk, torch.Tensor.topk) == orig


@pytest.mark.parametrize("n_prompt", [40, 43])
def test_cache_and_nocache_greedy_agree(tiny_model, n_prompt):
    prompt = _ids(n_prompt)
    # the prompt alone makes 10 CSA rows (indexer top-2 of up to 16 binding) and 5 HCA rows; 43 leaves partial
    # windows (3 of 4, 3 of 8) in the compressor buffers after the prefill
    toks_c, lg_c = R.hf_greedy(tiny_model, prompt, 24, return_logits=True)
    toks_n, lg_n = R.hf_greedy_nocache(tiny_model, prompt, 24, return_logits=True)
    assert toks_c == toks_n
    torch.testing.assert_close(lg_c, lg_n, rtol=1e-4, atol=1e-4)
    # the prompt's last-row logits equal the full forward's, and the model is not degenerate
    full = R.hf_logits(tiny_model, prompt + toks_n)
    torch.testing.assert_close(full[len(prompt) - 1:-1], lg_n, rtol=1e-5, atol=1e-5)
    assert len(set(toks_n)) > 4
