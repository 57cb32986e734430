"""An independent CPU reference for differential tests: Hugging Face transformers' DeepseekV4ForCausalLM.

Built from our ModelConfig and fed with GGUF-named tensors (spec hf_deepseek_v4.md §2, §3, §6). Checked against
transformers 5.24.0 (torch CPU, fp32, eager attention, eager experts).

    model = hf_model_from_gguf_tensors(cfg, tensors)   # tensors: GGUF name -> float32 tensor, numpy/torch order
    logits = hf_logits(model, ids)                     # [T, V], one no-cache forward
    new = hf_greedy(model, prompt, n)                  # greedy continuation with the HF cache

Known HF-vs-ds4 differences: see HF_VS_DS4_NOTES below. hf_logits / hf_greedy patch torch.topk while they run so
that top-k ties go to the lowest index, as in ds4 (ds4_ties=False gives stock HF).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager, nullcontext

import torch

from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import target_layout

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

HF_VS_DS4_NOTES = """
* ds4's FP8 (E4M3, 64-blocks) round trip of the KV nope dims, the indexer Hadamard+FP4 QAT, and the CPU's f16
  rounding of cached rows are absent in HF (fp32 throughout).
* Top-k ties: HF uses torch.topk (no tie order; router with sorted=False); ds4 keeps the lower index. Indexer
  ties are common (ReLU gives exact-0 scores): use ds4_topk_ties() (hf_logits/hf_greedy do by default).
* Router normalisation: HF w / (sum + 1e-20); ds4 w / max(sum, 6.103515625e-5) (degenerate inputs only).
* RoPE angles: HF float32 p * inv_freq; ds4 float32 p * theta_scale^i by repeated multiplication; the angle
  roundings differ by ~p * 2^-24 rad (invisible at short positions, ~1e-2 rad near p = 1e5).
* HF's indexer always scores all entries; ds4 skips it when <= top_k rows are visible (same selection).
"""


# --------------------------------------------------------------------------------------------------------------
# config


def _hca_rate(cfg: ModelConfig) -> int | None:
    rates = sorted({r for r in cfg.compress_ratios if r not in (0, 4)})
    if len(rates) > 1:
        raise ValueError(f"HF DeepseekV4Config supports one HCA compress rate; this config uses {rates}")
    return rates[0] if rates else None


def layer_type(ratio: int) -> str:
    return SLIDING if ratio == 0 else CSA if ratio == 4 else HCA


def hf_config_kwargs(cfg: ModelConfig) -> dict:
    """The exact DeepseekV4Config keyword arguments equivalent to `cfg` (transformers 5.24 spelling)."""
    if cfg.n_rot % 2 or cfg.n_rot > min(cfg.head_dim, cfg.index_head_dim):
        raise ValueError(f"n_rot={cfg.n_rot} must be even and <= head_dim/index_head_dim")
    hca = _hca_rate(cfg)
    prf = cfg.n_rot / cfg.head_dim
    return dict(
        vocab_size=cfg.n_vocab,
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=1,
        head_dim=cfg.head_dim,
        partial_rotary_factor=prf,
        q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank,
        n_routed_experts=cfg.n_expert,
        num_experts_per_tok=cfg.n_expert_used,
        n_shared_experts=1,
        moe_intermediate_size=cfg.expert_ff,
        scoring_func="sqrtsoftplus",
        norm_topk_prob=True,
        routed_scaling_factor=float(cfg.expert_weight_scale),
        swiglu_limit=float(cfg.swiglu_clamp),
        layer_types=[layer_type(r) for r in cfg.compress_ratios],
        compress_rates={CSA: 4, HCA: hca if hca is not None else 128},
        mlp_layer_types=["hash_moe" if cfg.is_hash(l) else "moe" for l in range(cfg.n_layer)],
        sliding_window=cfg.window,
        index_n_heads=cfg.index_n_head,
        index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_top_k,
        hc_mult=cfg.n_hc,
        hc_sinkhorn_iters=cfg.sinkhorn_iters,
        hc_eps=float(cfg.hc_eps),
        rms_norm_eps=float(cfg.rms_eps),
        rope_theta=float(cfg.rope_base),
        compress_rope_theta=float(cfg.compress_rope_base),
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": float(cfg.rope_base), "partial_rotary_factor": prf},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": float(cfg.compress_rope_base),
                "partial_rotary_factor": prf,
                "factor": float(cfg.rope_scale),
                "original_max_position_embeddings": int(cfg.rope_orig_ctx),
                "beta_fast": float(cfg.yarn_beta_fast),
                "beta_slow": float(cfg.yarn_beta_slow),
                "attention_factor": 1.0,  # no YaRN mscale on cos/sin (ds4 cancels it)
            },
        },
        # only feeds YaRN's consistency warning (factor == max_pos / original); not used in the maths
        max_position_embeddings=int(round(cfg.rope_orig_ctx * cfg.rope_scale)),
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pad_token_id=None,
        bos_token_id=None,  # ds4 finds special tokens by string; keeps generate() from stopping on id 1
        eos_token_id=None,
        use_cache=True,
        attn_implementation="eager",
        experts_implementation="eager",
        dtype=torch.float32,
    )


def hf_config(cfg: ModelConfig):
    from transformers import DeepseekV4Config

    c = DeepseekV4Config(**hf_config_kwargs(cfg))
    if c.qk_rope_head_dim != cfg.n_rot:  # int(head_dim * n_rot/head_dim) could round down
        raise ValueError(f"HF derived qk_rope_head_dim={c.qk_rope_head_dim}, expected {cfg.n_rot}")
    return c


# --------------------------------------------------------------------------------------------------------------
# GGUF name <-> HF state-dict key


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(gguf_name, hf_key) for every 1:1 tensor (excludes the fused experts, tid2eid and the router bias)."""
    pairs = [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output_hc_fn.weight", "model.hc_head.hc_fn"),
        ("output_hc_base.weight", "model.hc_head.hc_base"),
        ("output_hc_scale.weight", "model.hc_head.hc_scale"),
    ]
    for l in range(cfg.n_layer):
        g, h = f"blk.{l}.", f"model.layers.{l}."
        a = h + "self_attn."
        pairs += [
            (g + "hc_attn_fn.weight", h + "attn_hc.fn"),
            (g + "hc_attn_base.weight", h + "attn_hc.base"),
            (g + "hc_attn_scale.weight", h + "attn_hc.scale"),
            (g + "hc_ffn_fn.weight", h + "ffn_hc.fn"),
            (g + "hc_ffn_base.weight", h + "ffn_hc.base"),
            (g + "hc_ffn_scale.weight", h + "ffn_hc.scale"),
            (g + "attn_norm.weight", h + "input_layernorm.weight"),
            (g + "ffn_norm.weight", h + "post_attention_layernorm.weight"),
            (g + "attn_q_a.weight", a + "q_a_proj.weight"),
            (g + "attn_q_a_norm.weight", a + "q_a_norm.weight"),
            (g + "attn_q_b.weight", a + "q_b_proj.weight"),
            (g + "attn_kv.weight", a + "kv_proj.weight"),
            (g + "attn_kv_a_norm.weight", a + "kv_norm.weight"),
            (g + "attn_sinks.weight", a + "sinks"),
            (g + "attn_output_a.weight", a + "o_a_proj.weight"),
            (g + "attn_output_b.weight", a + "o_b_proj.weight"),
            (g + "ffn_gate_inp.weight", h + "mlp.gate.weight"),
            (g + "ffn_down_exps.weight", h + "mlp.experts.down_proj"),
            (g + "ffn_gate_shexp.weight", h + "mlp.shared_experts.gate_proj.weight"),
            (g + "ffn_up_shexp.weight", h + "mlp.shared_experts.up_proj.weight"),
            (g + "ffn_down_shexp.weight", h + "mlp.shared_experts.down_proj.weight"),
        ]
        if cfg.ratio(l):
            c = a + "compressor."
            pairs += [
                (g + "attn_compressor_ape.weight", c + "position_bias"),
                (g + "attn_compressor_kv.weight", c + "kv_proj.weight"),
                (g + "attn_compressor_gate.weight", c + "gate_proj.weight"),
                (g + "attn_compressor_norm.weight", c + "kv_norm.weight"),
            ]
        if cfg.has_indexer(l):
            i = a + "compressor.indexer."
            pairs += [
                (g + "indexer.attn_q_b.weight", i + "q_b_proj.weight"),
                (g + "indexer.proj.weight", i + "scorer.weights_proj.weight"),
                (g + "indexer_compressor_ape.weight", i + "position_bias"),
                (g + "indexer_compressor_kv.weight", i + "kv_proj.weight"),
                (g + "indexer_compressor_gate.weight", i + "gate_proj.weight"),
                (g + "indexer_compressor_norm.weight", i + "kv_norm.weight"),
            ]
    return pairs


def hf_state_dict_from_gguf_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    specs = {s.name: s for s in target_layout(cfg)}
    unknown = sorted(set(tensors) - set(specs))
    if unknown:
        raise KeyError(f"tensors not in target_layout(cfg): {unknown[:8]}{' ...' if len(unknown) > 8 else ''}")
    missing = sorted(n for n, s in specs.items() if not s.optional and n not in tensors)
    if missing:
        raise KeyError(f"missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for n, t in tensors.items():
        if tuple(t.shape) != specs[n].shape:
            raise ValueError(f"{n}: shape {tuple(t.shape)}, expected {specs[n].shape} (reversed ggml shape)")

    f32 = lambda n: torch.as_tensor(tensors[n]).to(torch.float32).contiguous()  # noqa: E731
    sd = {hf: f32(gg) for gg, hf in _name_pairs(cfg)}
    for l in range(cfg.n_layer):
        g, h = f"blk.{l}.", f"model.layers.{l}.mlp."
        sd[h + "experts.gate_up_proj"] = torch.cat([f32(g + "ffn_gate_exps.weight"), f32(g + "ffn_up_exps.weight")],
                                                   dim=1).contiguous()
        if cfg.is_hash(l):
            t = torch.as_tensor(tensors[g + "ffn_gate_tid2eid.weight"])
            if t.is_floating_point() and not torch.equal(t, t.round()):
                raise ValueError(f"{g}ffn_gate_tid2eid.weight holds non-integer values")
            t = t.to(torch.int64)
            if t.min() < 0 or t.max() >= cfg.n_expert:
                raise ValueError(f"{g}ffn_gate_tid2eid.weight has expert ids outside [0, {cfg.n_expert})")
            sd[h + "gate.tid2eid"] = t.contiguous()
            # a hash layer's exp_probs_b.bias (if any) has no effect in ds4 or HF: selection is tid2eid
        else:
            b = g + "exp_probs_b.bias"
            sd[h + "gate.e_score_correction_bias"] = f32(b) if b in tensors else torch.zeros(cfg.n_expert)
    return sd


def hf_model_from_gguf_tensors(cfg: ModelConfig, tensors: Mapping[str, torch.Tensor]):
    """DeepseekV4ForCausalLM (fp32, eval, eager) holding exactly `tensors` (GGUF names, numpy/torch order)."""
    from transformers import DeepseekV4ForCausalLM

    sd = hf_state_dict_from_gguf_tensors(cfg, tensors)
    model = DeepseekV4ForCausalLM(hf_config(cfg)).to(torch.float32)
    # strict: every persistent parameter/buffer is set, nothing is left over (the rotary inv_freq
    # buffers are non-persistent and rebuilt from the config)
    model.load_state_dict(sd, strict=True)
    return model.eval()


def gguf_tensors_from_hf(model) -> dict[str, torch.Tensor]:
    """The inverse mapping: an HF model's state dict as GGUF-named float32 tensors (tid2eid as int32)."""
    c = model.config
    cfg = model_config_from_hf(c)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {gg: sd[hf].to(torch.float32).clone() for gg, hf in _name_pairs(cfg)}
    F = cfg.expert_ff
    for l in range(cfg.n_layer):
        g, h = f"blk.{l}.", f"model.layers.{l}.mlp."
        gu = sd[h + "experts.gate_up_proj"].to(torch.float32)
        out[g + "ffn_gate_exps.weight"] = gu[:, :F].clone()
        out[g + "ffn_up_exps.weight"] = gu[:, F:].clone()
        if cfg.is_hash(l):
            out[g + "ffn_gate_tid2eid.weight"] = sd[h + "gate.tid2eid"].to(torch.int32).clone()
        else:
            out[g + "exp_probs_b.bias"] = sd[h + "gate.e_score_correction_bias"].to(torch.float32).clone()
    return out


def model_config_from_hf(c) -> ModelConfig:
    """ModelConfig of an HF DeepseekV4Config built by hf_config (the fields ds4 GGUFs carry)."""
    rp = c.rope_parameters["compress"]
    ratios = tuple(0 if t == SLIDING else c.compress_rates[t] for t in c.layer_types)
    n_hash = sum(1 for t in c.mlp_layer_types if t == "hash_moe")
    if c.mlp_layer_types != ["hash_moe"] * n_hash + ["moe"] * (c.num_hidden_layers - n_hash):
        raise ValueError("hash layers must come first")
    return ModelConfig(
        n_layer=c.num_hidden_layers, n_embd=c.hidden_size, n_vocab=c.vocab_size, n_head=c.num_attention_heads,
        head_dim=c.head_dim, n_rot=c.qk_rope_head_dim, q_lora_rank=c.q_lora_rank, o_lora_rank=c.o_lora_rank,
        o_groups=c.o_groups, n_expert=c.n_routed_experts, n_expert_used=c.num_experts_per_tok,
        expert_ff=c.moe_intermediate_size, n_hash_layer=n_hash, window=c.sliding_window,
        index_n_head=c.index_n_heads, index_head_dim=c.index_head_dim, index_top_k=c.index_topk, n_hc=c.hc_mult,
        sinkhorn_iters=c.hc_sinkhorn_iters, compress_ratios=ratios, swiglu_clamp=c.swiglu_limit,
        rope_base=c.rope_parameters["main"]["rope_theta"], compress_rope_base=rp["rope_theta"],
        rope_scale=rp.get("factor", 1.0), rope_orig_ctx=rp.get("original_max_position_embeddings", 65536),
        yarn_beta_fast=rp.get("beta_fast", 32.0), yarn_beta_slow=rp.get("beta_slow", 1.0),
        expert_weight_scale=c.routed_scaling_factor, rms_eps=c.rms_norm_eps, hc_eps=c.hc_eps,
    )


# --------------------------------------------------------------------------------------------------------------
# random models


@torch.no_grad()
def randomize_(model, seed: int = 0, scale: float = 1.0):
    """Give every parameter and persistent buffer O(1)-activation random values (HF zero-inits sinks,
    position biases, HC bases, the router bias and tid2eid). tid2eid rows get distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda shape: torch.randn(shape, generator=gen)  # noqa: E731
    for name, p in model.named_parameters():
        shape, last = p.shape, name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            v = 1.0 + 0.2 * rn(shape)
        elif last == "sinks":
            v = rn(shape)
        elif last == "position_bias":
            v = 0.5 * rn(shape)
        elif last in ("base", "hc_base"):
            v = 0.5 * rn(shape)
        elif last in ("scale", "hc_scale"):
            v = 0.5 + 0.5 * torch.rand(shape, generator=gen)
        elif last in ("fn", "hc_fn"):
            v = rn(shape) / shape[-1] ** 0.5 * 2.0
        elif name.endswith("embed_tokens.weight"):
            v = rn(shape)
        else:  # [.., out, in] matrices, fused experts included
            v = rn(shape) / shape[-1] ** 0.5 * scale
        p.copy_(v.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * rn(b.shape))
        elif name.endswith("tid2eid"):
            V, k = b.shape
            E = model.config.n_routed_experts
            b.copy_(torch.argsort(torch.rand(V, E, generator=gen), dim=-1)[:, :k])
    return model


def random_hf_model(cfg: ModelConfig, seed: int = 0):
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    return randomize_(DeepseekV4ForCausalLM(hf_config(cfg)).to(torch.float32), seed).eval()


# --------------------------------------------------------------------------------------------------------------
# running


@contextmanager
def ds4_topk_ties():
    """Make torch.topk / Tensor.topk pick the lowest index among equal values (ds4's CPU order, spec §3.4, §3.6)
    while active. HF's router (modeling_deepseek_v4.py:1092, torch.topk sorted=False) and indexer (:593,
    Tensor.topk) have no tie order; ties are common in the indexer (ReLU gives exact 0 scores). Only the order
    of exactly equal values changes."""
    orig_fn, orig_method = torch.topk, torch.Tensor.topk

    def stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):  # noqa: A002
        assert out is None
        v, i = torch.sort(input, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))

    torch.topk, torch.Tensor.topk = stable_topk, stable_topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = orig_fn, orig_method


def _ties(ds4_ties: bool):
    return ds4_topk_ties() if ds4_ties else nullcontext()


@torch.no_grad()
def hf_logits(model, token_ids: list[int], ds4_ties: bool = True) -> torch.Tensor:
    """[T, V] float32 logits of one full-sequence forward without a cache (positions 0..T-1).
    ds4_ties: break top-k ties by lowest index like ds4 (see ds4_topk_ties); False = stock HF."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with _ties(ds4_ties):
        return model(input_ids=ids, use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], n_new: int, return_logits: bool = False, ds4_ties: bool = True):
    """Greedy continuation with the HF DynamicCache (one prefill, then one-token decode steps).
    Returns the n_new new token ids (and, with return_logits, the [n_new, V] logits that chose them).
    Argmax ties resolve to the lowest token id (torch.argmax)."""
    with _ties(ds4_ties):
        return _greedy_cached(model, prompt_ids, n_new, return_logits)


def _greedy_cached(model, prompt_ids, n_new, return_logits):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    out, logits = [], []
    pos = 0
    for _ in range(n_new):
        n = ids.shape[1]
        position_ids = torch.arange(pos, pos + n).unsqueeze(0)
        lg = model(input_ids=ids, position_ids=position_ids, cache=cache, use_cache=True).logits[0, -1].float()
        pos += n
        tok = int(lg.argmax())
        out.append(tok)
        logits.append(lg)
        ids = torch.tensor([[tok]], dtype=torch.long)
    return (out, torch.stack(logits)) if return_logits else out


@torch.no_grad()
def hf_greedy_nocache(model, prompt_ids: list[int], n_new: int, return_logits: bool = False,
                      ds4_ties: bool = True):
    """Greedy continuation by repeated full no-cache forwards (slow; for checking hf_greedy)."""
    seq, logits = list(prompt_ids), []
    for _ in range(n_new):
        lg = hf_logits(model, seq, ds4_ties)[-1]
        seq.append(int(lg.argmax()))
        logits.append(lg)
    out = seq[len(prompt_ids):]
    return (out, torch.stack(logits)) if return_logits else out
