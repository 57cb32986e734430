"""A full-size DeepSeek V4 Flash GGUF whose tensor data is a hole: for testing opening, --info and layout checks.

`write_sparse_flash_gguf(path)` writes the real metadata (spec ds4_architecture.md §1.4, real values), a
tokenizer of the real size (129,280 tokens, 127,741 merges; dummy strings of realistic length) and the full
tensor directory (`target_layout(ModelConfig.flash())`, ~80 GB of data), then extends the file with
truncate so the data costs no disk. Reading a tensor gives zeros. Takes well under a second or two.

Token ids: the 256 byte-level symbols (GPT-2 byte->unicode map) are ids 0..255, then dummy words, then the
seven special strings of spec §5.1 at the end. Only their strings are meaningful; the ids are not ds4's.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from ds4trt.gguf_io import names as N
from ds4trt.gguf_io.dequant import tensor_nbytes
from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import target_layout

N_MERGES = 127741
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>", "｜DSML｜")
# Routed-expert types of the two shipped mixes (spec §2.2): q2 = IQ2_XXS gate/up + Q2_K down; q4 = Q4_K.
EXPERT_MIXES = {"q2": (N.IQ2_XXS, N.IQ2_XXS, N.Q2_K), "q4": (N.Q4_K, N.Q4_K, N.Q4_K)}


def byte_symbols() -> list[str]:
    """The GPT-2 byte->unicode map: bytes 33-126, 161-172, 174-255 map to themselves, the rest to 256+n."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]


def flash_tokens(n_vocab: int) -> list[str]:
    words = [f"\u0120w{i:06d}" if i % 2 else f"tok{i:06d}" for i in range(n_vocab - 256 - len(SPECIAL_TOKENS))]
    return byte_symbols() + words + list(SPECIAL_TOKENS)


def flash_merges(n: int = N_MERGES) -> list[str]:
    return [f"\u0120m{i:05d} x{i % 977}" for i in range(n)]


def _add_metadata(w: GGUFWriter, cfg: ModelConfig) -> None:
    u32 = {N.KEY_BLOCK_COUNT: cfg.n_layer, N.KEY_EMBD: cfg.n_embd, N.KEY_VOCAB: cfg.n_vocab,
           N.KEY_HEAD: cfg.n_head, N.KEY_HEAD_KV: 1, N.KEY_KEY_LENGTH: cfg.head_dim,
           N.KEY_VALUE_LENGTH: cfg.head_dim, N.KEY_ROPE_DIMS: cfg.n_rot, N.KEY_Q_LORA: cfg.q_lora_rank,
           N.KEY_O_LORA: cfg.o_lora_rank, N.KEY_O_GROUPS: cfg.o_groups, N.KEY_EXPERTS: cfg.n_expert,
           N.KEY_EXPERTS_USED: cfg.n_expert_used, N.KEY_EXPERT_FF: cfg.expert_ff, N.KEY_EXPERTS_SHARED: 1,
           N.KEY_HASH_LAYERS: cfg.n_hash_layer, N.KEY_EXPERT_GROUPS: 0, N.KEY_EXPERT_GROUPS_USED: 0,
           N.KEY_WINDOW: cfg.window, N.KEY_INDEX_HEADS: cfg.index_n_head, N.KEY_INDEX_DIM: cfg.index_head_dim,
           N.KEY_INDEX_TOP_K: cfg.index_top_k, N.KEY_HC: cfg.n_hc, N.KEY_SINKHORN: cfg.sinkhorn_iters,
           N.KEY_ROPE_ORIG_CTX: cfg.rope_orig_ctx, "general.quantization_version": 2}
    f32 = {N.KEY_ROPE_BASE: cfg.rope_base, N.KEY_ROPE_SCALE: cfg.rope_scale,
           N.KEY_YARN_BETA_FAST: cfg.yarn_beta_fast, N.KEY_YARN_BETA_SLOW: cfg.yarn_beta_slow,
           N.KEY_COMPRESS_ROPE_BASE: cfg.compress_rope_base, N.KEY_EXPERT_WEIGHT_SCALE: cfg.expert_weight_scale,
           N.KEY_RMS_EPS: cfg.rms_eps, N.KEY_HC_EPS: cfg.hc_eps}
    w.add_string(N.KEY_NAME, cfg.name)
    w.add_uint64(N.KEY_CONTEXT_LENGTH, cfg.context_length)
    for key, v in u32.items():
        w.add_uint32(key, v)
    for key, v in f32.items():
        w.add_float32(key, v)
    w.add_key_value(N.KEY_COMPRESS_RATIOS, list(cfg.compress_ratios), GGUFValueType.ARRAY, GGUFValueType.UINT32)
    w.add_key_value(N.KEY_SWIGLU_CLAMP, [cfg.swiglu_clamp] * cfg.n_layer, GGUFValueType.ARRAY, GGUFValueType.FLOAT32)
    w.add_bool(N.KEY_EXPERT_WEIGHTS_NORM, True)
    tokens = flash_tokens(cfg.n_vocab)
    w.add_string(N.KEY_TOKENIZER_MODEL, "gpt2")
    w.add_string(N.KEY_TOKENIZER_PRE, "joyai-llm")
    w.add_key_value(N.KEY_TOKENS, tokens, GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_key_value("tokenizer.ggml.token_type", np.ones(cfg.n_vocab, np.int32).tolist(), GGUFValueType.ARRAY,
                    GGUFValueType.INT32)
    w.add_key_value(N.KEY_MERGES, flash_merges(), GGUFValueType.ARRAY, GGUFValueType.STRING)
    w.add_uint32("tokenizer.ggml.bos_token_id", tokens.index(SPECIAL_TOKENS[0]))
    w.add_uint32("tokenizer.ggml.eos_token_id", tokens.index(SPECIAL_TOKENS[1]))


def write_sparse_flash_gguf(path, experts: str = "q2", cfg: ModelConfig | None = None) -> Path:
    """Write the Flash-shaped GGUF at `path` (data region sparse); return the path."""
    cfg = cfg or ModelConfig.flash()
    return write_sparse_gguf(path, target_layout(cfg), EXPERT_MIXES[experts], lambda w: _add_metadata(w, cfg))


def spec_type(spec, experts: tuple[int, int, int]) -> int:
    """The ggml type a written tensor gets: its first allowed type; routed experts: `experts` (gate, up, down)."""
    for part, t in zip(("ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."), experts):
        if part in spec.name:
            return t
    return spec.types[0]


def write_sparse_gguf(path, specs, experts: tuple[int, int, int], add_metadata) -> Path:
    """A GGUF with the tensor directory of `specs` (the first allowed type of each; routed experts: `experts`,
    the (gate, up, down) ggml types) whose data region is a hole. add_metadata(writer) writes the key-values."""
    path = Path(path)
    w = GGUFWriter(path, N.ARCH)
    add_metadata(w)
    data_size = 0
    for spec in specs:
        t = spec_type(spec, experts)
        nbytes = tensor_nbytes(t, spec.ggml_shape)
        w.add_tensor_info(spec.name, spec.shape, np.dtype(np.float32), nbytes, raw_dtype=GGMLQuantizationType(t))
        data_size += GGUFWriter.ggml_pad(nbytes, w.data_alignment)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    data_start = GGUFWriter.ggml_pad(path.stat().st_size, w.data_alignment)
    os.truncate(path, data_start + data_size)
    return path
