"""The tensors a DS4 GGUF must hold for a given ModelConfig: name -> allowed ggml types and ggml shape.

ggml_shape lists ne0 first (the fastest-varying dim), as in the file; the math matrix is its reverse
(a [ne0, ne1] weight is M[ne1][ne0], applied as y = M x). Spec ds4_architecture.md §2.
"""

from __future__ import annotations

from dataclasses import dataclass

from ds4trt.gguf_io import names as N
from ds4trt.model.config import ModelConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str
    types: tuple[int, ...]          # allowed ggml types
    ggml_shape: tuple[int, ...]     # ne0 first
    optional: bool = False
    same_type_as: str | None = None  # gate/up experts must share a type
    matmul: bool = False             # an F16 matrix the model applies as x @ W.T through its `linear` factory

    @property
    def shape(self) -> tuple[int, ...]:  # torch / numpy order
        return tuple(reversed(self.ggml_shape))


def _block_specs(cfg: ModelConfig, prefix: str, ratio: int, hash_routed: bool, plain: tuple[int, ...],
                 bias_optional: bool) -> list[TensorSpec]:
    """Tensors of one transformer block (a target layer, or the MTP block when prefix = 'mtp.0.')."""
    D, H, d, S = cfg.n_embd, cfg.n_head, cfg.head_dim, cfg.n_hc
    F32, F16, Q8 = (N.F32,), plain, (N.Q8_0,)
    t = lambda suffix, types, shape, **kw: TensorSpec(prefix + suffix, types, tuple(shape), **kw)  # noqa: E731
    specs = []
    for sub in ("attn", "ffn"):
        specs += [t(f"hc_{sub}_fn.weight", F16, (S * D, cfg.hc_mix)),
                  t(f"hc_{sub}_scale.weight", F32, (3,)),
                  t(f"hc_{sub}_base.weight", F32, (cfg.hc_mix,))]
    specs += [
        t("attn_norm.weight", F32, (D,)),
        t("attn_q_a.weight", Q8, (D, cfg.q_lora_rank)),
        t("attn_q_a_norm.weight", F32, (cfg.q_lora_rank,)),
        t("attn_q_b.weight", Q8, (cfg.q_lora_rank, H * d)),
        t("attn_kv.weight", Q8, (D, d)),
        t("attn_kv_a_norm.weight", F32, (d,)),
        t("attn_sinks.weight", F32, (H,)),
        t("attn_output_a.weight", Q8, (H * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)),
        t("attn_output_b.weight", Q8, (cfg.o_groups * cfg.o_lora_rank, D)),
        t("ffn_norm.weight", F32, (D,)),
        t("ffn_gate_inp.weight", F16, (D, cfg.n_expert), matmul=True),
        t("exp_probs_b.bias", F32, (cfg.n_expert,), optional=bias_optional),
        t("ffn_gate_exps.weight", N.EXPERT_TYPES, (D, cfg.expert_ff, cfg.n_expert)),
        t("ffn_up_exps.weight", N.EXPERT_TYPES, (D, cfg.expert_ff, cfg.n_expert),
          same_type_as=prefix + "ffn_gate_exps.weight"),
        t("ffn_down_exps.weight", N.EXPERT_TYPES, (cfg.expert_ff, D, cfg.n_expert)),
        t("ffn_gate_shexp.weight", Q8, (D, cfg.expert_ff)),
        t("ffn_up_shexp.weight", Q8, (D, cfg.expert_ff)),
        t("ffn_down_shexp.weight", Q8, (cfg.expert_ff, D)),
    ]
    if ratio:
        wc = (2 if ratio == 4 else 1) * d
        specs += [t("attn_compressor_ape.weight", F16, (wc, ratio)),
                  t("attn_compressor_kv.weight", F16, (D, wc), matmul=True),
                  t("attn_compressor_gate.weight", F16, (D, wc), matmul=True),
                  t("attn_compressor_norm.weight", F32, (d,))]
    if ratio == 4:
        i, ih = cfg.index_head_dim, cfg.index_n_head
        specs += [t("indexer.attn_q_b.weight", F16, (cfg.q_lora_rank, ih * i), matmul=True),
                  t("indexer.proj.weight", F16, (D, ih), matmul=True),
                  t("indexer_compressor_ape.weight", F16, (2 * i, 4)),
                  t("indexer_compressor_kv.weight", F16, (D, 2 * i), matmul=True),
                  t("indexer_compressor_gate.weight", F16, (D, 2 * i), matmul=True),
                  t("indexer_compressor_norm.weight", F32, (i,))]
    if hash_routed:
        specs.append(t("ffn_gate_tid2eid.weight", (N.I32,), (cfg.n_expert_used, cfg.n_vocab)))
    return specs


def target_layout(cfg: ModelConfig) -> list[TensorSpec]:
    D, V, S = cfg.n_embd, cfg.n_vocab, cfg.n_hc
    specs = [
        TensorSpec(N.TOKEN_EMBD, (N.F16,), (D, V)),
        TensorSpec(N.OUTPUT_HC_BASE, (N.F32,), (S,)),
        TensorSpec(N.OUTPUT_HC_FN, (N.F16,), (S * D, S)),
        TensorSpec(N.OUTPUT_HC_SCALE, (N.F32,), (1,)),
        TensorSpec(N.OUTPUT_NORM, (N.F32,), (D,)),
        TensorSpec(N.OUTPUT, (N.Q8_0,), (D, V)),
    ]
    for layer in range(cfg.n_layer):
        specs += _block_specs(cfg, f"blk.{layer}.", cfg.ratio(layer), cfg.is_hash(layer), (N.F16,), True)
    return specs


def mtp_layout(cfg: ModelConfig) -> list[TensorSpec]:
    """The MTP GGUF (ds4's `mtp.0.*`): one sliding-window block with top-k routing, plus its head."""
    D, S, plain = cfg.n_embd, cfg.n_hc, N.PLAIN_TYPES
    t = lambda suffix, types, shape: TensorSpec(N.mtp(suffix), types, shape)  # noqa: E731
    return [
        t("hc_head_base.weight", (N.F32,), (S,)),
        t("hc_head_fn.weight", plain, (S * D, S)),
        t("hc_head_scale.weight", (N.F32,), (1,)),
        t("e_proj.weight", (N.Q8_0,), (D, D)),
        t("h_proj.weight", (N.Q8_0,), (D, D)),
        t("enorm.weight", (N.F32,), (D,)),
        t("hnorm.weight", (N.F32,), (D,)),
        t("norm.weight", (N.F32,), (D,)),
    ] + _block_specs(cfg, N.MTP_PREFIX, 0, False, plain, bias_optional=False)
