"""Write tiny DS4-layout GGUF files: the test model (and, with trained `tensors=`, the demo model).

    tiny_config(**overrides)            -> a small ModelConfig covering every layer kind
    write_model_gguf(path, cfg, ...)    -> a target GGUF: deepseek4.* metadata, tokenizer, every tensor
    write_mtp_gguf(path, cfg, ...)      -> an MTP GGUF (mtp.0.* tensors, no tokenizer, no deepseek4.* keys)
    build_tokenizer(n_vocab, text)      -> (tokens, merges) of a byte-level BPE vocabulary of n_vocab entries

Weights are seeded random numbers in the types ds4 uses (spec ds4_architecture.md §2), scaled so a
forward pass stays O(1): norms 1 ± 0.1, projections std 1/sqrt(fan_in), sinks N(0,1), ape N(0, 0.5),
router std 2/sqrt(D), LM head std 2/sqrt(D) (logits std ~2).
Each tensor draws from its own generator, seeded by (seed, crc32(name)), so dropping or retyping one
tensor leaves the others' values unchanged, and the same call writes byte-identical files.

Routed experts (Q2_K, Q4_K, IQ2_XXS) are written as random blocks (gguf.quants cannot quantize these
types): random quant bytes / grid indices / signs, sub-block scales and mins chosen so every sub-block
is roughly zero-mean, and the f16 block scale `d` set from the type's measured unit RMS so that the
dequantized tensor has std ~= 1/sqrt(fan_in). Values given through `tensors=` are quantized on write
(simple round-to-nearest K-quants, nearest-grid IQ2_XXS).

Knobs for deliberately broken files: `drop` (tensor names), `retype` ({name: ggml type}), `reshape`
({name: ggml shape, ne0 first}), `metadata_overrides` ({key: value or gguf.GGUFValue}), `drop_keys`.
"""

from __future__ import annotations

import functools
import math
import re
import zlib
from collections import Counter
from os import PathLike

import numpy as np
from gguf import GGMLQuantizationType, GGUFValue, GGUFValueType, GGUFWriter
from gguf import quants as gq

from ds4trt.gguf_io import names as N
from ds4trt.model.config import ModelConfig
from ds4trt.model.layout import TensorSpec, mtp_layout, target_layout

Q2_K, Q4_K, IQ2_XXS = N.Q2_K, N.Q4_K, N.IQ2_XXS
_K_TYPES = (Q2_K, Q4_K, IQ2_XXS)
_QK = 256  # values per K-quant / IQ2_XXS block

SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                  "<think>", "</think>", "｜DSML｜")
BOS, EOS = SPECIAL_TOKENS[0], SPECIAL_TOKENS[1]


# ---------------------------------------------------------------------------------------------------
# Config

def tiny_config(**overrides) -> ModelConfig:
    """A small config with every layer kind: 0,1 sliding; even >= 2 ratio 4 + indexer; odd ratio 8.

    Layers 0..2 are hash routed, so layer 2 is ratio-4 and hash routed as in Flash. n_embd and
    expert_ff are multiples of 256 (K-quant / IQ2_XXS blocks). Passing `compress_ratios` alone sets
    n_layer to its length, e.g. tiny_config(compress_ratios=(0, 0, 4, 128)); passing n_layer alone
    builds the default schedule for that many layers.
    """
    if "compress_ratios" in overrides:
        overrides.setdefault("n_layer", len(overrides["compress_ratios"]))
    n_layer = overrides.setdefault("n_layer", 6)
    overrides["compress_ratios"] = tuple(overrides.get("compress_ratios") or
                                         (0 if l < 2 else 4 if l % 2 == 0 else 8 for l in range(n_layer)))
    overrides.setdefault("n_hash_layer", min(3, n_layer))
    if len(overrides["compress_ratios"]) != n_layer:
        raise ValueError(f"compress_ratios has {len(overrides['compress_ratios'])} entries for {n_layer} layers")
    base = dict(n_embd=256, n_vocab=512, n_head=4, head_dim=64, n_rot=16, q_lora_rank=64, o_lora_rank=32,
                o_groups=2, n_expert=8, n_expert_used=2, expert_ff=256, window=8, index_n_head=4,
                index_head_dim=32, index_top_k=3, n_hc=4, sinkhorn_iters=20, context_length=4096,
                name="ds4trt-tiny")
    cfg = ModelConfig(**(base | overrides))

    def fail(key, expected, got):
        raise ValueError(f"tiny_config: {key}: expected {expected}, got {got}")
    cfg.check(fail)
    return cfg


def model_metadata(cfg: ModelConfig) -> dict[str, GGUFValue]:
    """The deepseek4.* keys of a target GGUF, with the GGUF types of spec §1.4."""
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    v = lambda value, t, sub=None: GGUFValue(value, t, sub)  # noqa: E731
    md = {
        N.KEY_ARCHITECTURE: v(N.ARCH, GGUFValueType.STRING),
        N.KEY_NAME: v(cfg.name, GGUFValueType.STRING),
        N.KEY_BLOCK_COUNT: v(cfg.n_layer, u32),
        N.KEY_CONTEXT_LENGTH: v(cfg.context_length, GGUFValueType.UINT64),
        N.KEY_EMBD: v(cfg.n_embd, u32),
        N.KEY_VOCAB: v(cfg.n_vocab, u32),
        N.KEY_HEAD: v(cfg.n_head, u32),
        N.KEY_HEAD_KV: v(1, u32),
        N.KEY_KEY_LENGTH: v(cfg.head_dim, u32),
        N.KEY_VALUE_LENGTH: v(cfg.head_dim, u32),
        N.KEY_ROPE_DIMS: v(cfg.n_rot, u32),
        N.KEY_Q_LORA: v(cfg.q_lora_rank, u32),
        N.KEY_O_LORA: v(cfg.o_lora_rank, u32),
        N.KEY_O_GROUPS: v(cfg.o_groups, u32),
        N.KEY_EXPERTS: v(cfg.n_expert, u32),
        N.KEY_EXPERTS_USED: v(cfg.n_expert_used, u32),
        N.KEY_EXPERT_FF: v(cfg.expert_ff, u32),
        N.KEY_EXPERTS_SHARED: v(1, u32),
        N.KEY_HASH_LAYERS: v(cfg.n_hash_layer, u32),
        N.KEY_EXPERT_GROUPS: v(0, u32),
        N.KEY_EXPERT_GROUPS_USED: v(0, u32),
        N.KEY_WINDOW: v(cfg.window, u32),
        N.KEY_INDEX_HEADS: v(cfg.index_n_head, u32),
        N.KEY_INDEX_DIM: v(cfg.index_head_dim, u32),
        N.KEY_INDEX_TOP_K: v(cfg.index_top_k, u32),
        N.KEY_HC: v(cfg.n_hc, u32),
        N.KEY_SINKHORN: v(cfg.sinkhorn_iters, u32),
        N.KEY_COMPRESS_RATIOS: v(list(cfg.compress_ratios), GGUFValueType.ARRAY, u32),
        N.KEY_SWIGLU_CLAMP: v([float(cfg.swiglu_clamp)] * cfg.n_layer, GGUFValueType.ARRAY, f32),
        N.KEY_ROPE_ORIG_CTX: v(cfg.rope_orig_ctx, GGUFValueType.UINT64),
        N.KEY_ROPE_BASE: v(cfg.rope_base, f32),
        N.KEY_ROPE_SCALE: v(cfg.rope_scale, f32),
        N.KEY_YARN_BETA_FAST: v(cfg.yarn_beta_fast, f32),
        N.KEY_YARN_BETA_SLOW: v(cfg.yarn_beta_slow, f32),
        N.KEY_COMPRESS_ROPE_BASE: v(cfg.compress_rope_base, f32),
        N.KEY_EXPERT_WEIGHT_SCALE: v(cfg.expert_weight_scale, f32),
        N.KEY_RMS_EPS: v(cfg.rms_eps, f32),
        N.KEY_HC_EPS: v(cfg.hc_eps, f32),
        N.KEY_EXPERT_WEIGHTS_NORM: v(True, GGUFValueType.BOOL),
    }
    return md


# ---------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE with GPT-2's byte -> unicode symbols

TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. A small model reads the same file as the large one,
and the tests check that every layer gives the same answer on the CPU and on the GPU. The cache
keeps the keys and values of the last tokens; the compressor folds older rows into summaries.
When the draft model guesses the next tokens, the target model verifies them in one pass and keeps
the longest prefix that matches its own greedy choice. Then it commits those rows and moves on.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? It is Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 2048 3.14159 2.71828 -1 +1 = 0.5 * 2
def forward(self, tokens, positions):
    x = self.embed(tokens)
    for layer in self.layers:
        x = layer(x, positions)
    return self.head(self.norm(x))

class Cache:
    def __init__(self, n_layer, n_ctx, width):
        self.rows = [[0.0] * width for _ in range(n_ctx)]
        self.length = 0

    def append(self, row):
        self.rows[self.length] = row
        self.length += 1

for i in range(10):
    if i % 2 == 0:
        print(f"even {i}")
    else:
        print("odd", i)
int main(void) { return 0; }  // the end
{"name": "ds4trt", "version": "0.1.0", "layers": [0, 0, 4, 8], "ok": true, "value": null}
"""

_PIECE = re.compile(r"\d{1,3}| ?[A-Za-z]+| ?[^\sA-Za-z\d]+|\s+")


@functools.cache
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable symbol map: 33-126, 161-172, 174-255 map to themselves, the rest to 256+n."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in keep]
    return {b: chr(b) for b in keep} | {b: chr(256 + n) for n, b in enumerate(extra)}


@functools.cache
def build_tokenizer(n_vocab: int, text: str = TRAIN_TEXT) -> tuple[list[str], list[str]]:
    """(tokens, merges): 256 byte symbols + BPE merges learned on `text` + special tokens, exactly n_vocab.

    Layout: BOS, EOS, the 256 byte symbols (byte order), merged tokens (merge order), padding
    `<pad_N>` if `text` runs out of pairs, then the other special tokens. Merges break count ties by
    the lexicographically smallest pair, so the result is deterministic.
    """
    n_fixed = 256 + len(SPECIAL_TOKENS)
    if n_vocab < n_fixed:
        raise ValueError(f"n_vocab must be >= {n_fixed} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
    b2u = bytes_to_unicode()
    words = Counter(tuple(b2u[b] for b in piece.encode("utf-8")) for piece in _PIECE.findall(text))
    vocab = [BOS, EOS] + [b2u[b] for b in range(256)]
    known, merges = set(vocab), []
    while len(vocab) < n_vocab - (len(SPECIAL_TOKENS) - 2):
        pairs: Counter = Counter()
        for w, c in words.items():
            for pair in zip(w, w[1:]):
                pairs[pair] += c
        if not pairs:
            break
        a, b = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{a} {b}")
        if a + b not in known:
            known.add(a + b)
            vocab.append(a + b)
        words = Counter({_merge_word(w, a, b): c for w, c in words.items()})
    vocab += [f"<pad_{i}>" for i in range(n_vocab - len(vocab) - (len(SPECIAL_TOKENS) - 2))]
    vocab += list(SPECIAL_TOKENS[2:])
    assert len(vocab) == n_vocab and len(set(vocab)) == n_vocab
    return vocab, merges


def _merge_word(w: tuple[str, ...], a: str, b: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(w):
        if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
            out.append(a + b)
            i += 2
        else:
            out.append(w[i])
            i += 1
    return tuple(out)


def tokenizer_metadata(tokens: list[str], merges: list[str]) -> dict[str, GGUFValue]:
    s, arr = GGUFValueType.STRING, GGUFValueType.ARRAY
    return {N.KEY_TOKENIZER_MODEL: GGUFValue("gpt2", s),
            N.KEY_TOKENIZER_PRE: GGUFValue("joyai-llm", s),
            N.KEY_TOKENS: GGUFValue(list(tokens), arr, s),
            N.KEY_MERGES: GGUFValue(list(merges), arr, s)}


# ---------------------------------------------------------------------------------------------------
# Initial values: what each tensor role gets (numpy shape; the last dim is the fan-in)

def _initial_values(name: str, shape: tuple[int, ...], rng: np.random.Generator, n_expert: int) -> np.ndarray:
    """float32 (or int32 for tid2eid) values of numpy `shape` for the tensor called `name`."""
    suffix = name.split(".", 2)[-1] if name.startswith(("blk.", "mtp.")) else name
    fan_in = shape[-1]
    if suffix.endswith("tid2eid.weight"):  # [V][k]: k distinct expert ids per token
        rows, k = math.prod(shape[:-1]), shape[-1]
        ids = np.argsort(rng.random((rows, max(k, n_expert))), axis=1)[:, :k]
        return ids.reshape(shape).astype(np.int32)
    if suffix.endswith("norm.weight"):  # every RMSNorm weight (attn, q_a, kv_a, ffn, compressors, MTP)
        x = 1.0 + rng.uniform(-0.1, 0.1, shape)
    elif suffix.endswith("_scale.weight"):  # HC scales: moderate gains on fn·x
        x = rng.uniform(0.3, 1.0, shape)
    elif suffix.endswith("_base.weight"):  # HC biases: pre(S), post(S), comb(SxS) favouring identity
        x = rng.normal(0.0, 0.5, shape)
        if suffix.startswith("hc_") and not suffix.startswith("hc_head"):  # size (2+S)*S = (S+1)^2 - 1
            s = math.isqrt(x.size + 1) - 1
            x.reshape(-1)[2 * s:] += np.eye(s).reshape(-1)
    elif suffix == "attn_sinks.weight":
        x = rng.normal(0.0, 1.0, shape)
    elif suffix.endswith("ape.weight"):
        x = rng.normal(0.0, 0.5, shape)
    elif suffix == "exp_probs_b.bias":
        x = rng.normal(0.0, 0.1, shape)
    elif suffix == "ffn_gate_inp.weight":  # router logits std ~2 keep the top-k choice well separated
        x = rng.normal(0.0, 2.0 / math.sqrt(fan_in), shape)
    elif name == N.TOKEN_EMBD:
        x = rng.normal(0.0, 1.0, shape)
    elif name == N.OUTPUT:  # logits std ~2: a peaked, LM-like next-token distribution
        x = rng.normal(0.0, 2.0 / math.sqrt(fan_in), shape)
    else:  # projections, HC mixers, expert matrices
        x = rng.normal(0.0, 1.0 / math.sqrt(fan_in), shape)
    return x.astype(np.float32)


# ---------------------------------------------------------------------------------------------------
# Random quantized blocks (types gguf.quants cannot quantize)

def _f16(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).astype(np.float16)


def _pack_q4k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """(n, 8) six-bit scales and mins -> the 12-byte packing unpacked by gguf's Q4_K.get_scale_min."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _random_blocks(rng: np.random.Generator, ggml_type: int, n_blocks: int, d: float) -> np.ndarray:
    """(n_blocks, block bytes) of random blocks; `d` is the f16 block scale before a ±25 % jitter."""
    db = d * rng.uniform(0.75, 1.25, (n_blocks, 1))
    if ggml_type == Q2_K:  # scales[16] | qs[64] | d | dmin; value = d*sc*q - dmin*m, q in 0..3
        sc = rng.integers(1, 16, (n_blocks, 16))
        m = np.round(0.75 * sc)  # dmin = 2d: sub-block mean d*(1.5*sc - 2m) ~ 0
        qs = rng.integers(0, 256, (n_blocks, 64))
        parts = [(sc | (m.astype(np.int64) << 4)).astype(np.uint8), qs.astype(np.uint8),
                 _f16(db).view(np.uint8), _f16(2 * db).view(np.uint8)]
    elif ggml_type == Q4_K:  # d | dmin | scales[12] | qs[128]; value = d*sc*q - dmin*m, q in 0..15
        sc = rng.integers(16, 64, (n_blocks, 8))
        m = np.round(sc * 7.5 / 8)  # dmin = 8d: sub-block mean d*(7.5*sc - 8m) ~ 0
        qs = rng.integers(0, 256, (n_blocks, 128))
        parts = [_f16(db).view(np.uint8), _f16(8 * db).view(np.uint8), _pack_q4k_scales(sc, m),
                 qs.astype(np.uint8)]
    elif ggml_type == IQ2_XXS:  # d | 8 x (u32 grid indices, u32 signs + 4-bit scale)
        grid = rng.integers(0, 256, (n_blocks, 8, 4), dtype=np.uint32)
        signs = rng.integers(0, 128, (n_blocks, 8, 4), dtype=np.uint32)
        s = rng.integers(0, 16, (n_blocks, 8), dtype=np.uint32)
        a = (grid << np.array([0, 8, 16, 24], np.uint32)).sum(-1, dtype=np.uint32)
        b = (signs << np.array([0, 7, 14, 21], np.uint32)).sum(-1, dtype=np.uint32) | (s << 28)
        qs = np.stack([a, b], axis=-1).astype("<u4").reshape(n_blocks, 16).view(np.uint8)
        parts = [_f16(db).view(np.uint8), qs]
    else:
        raise ValueError(f"no random-block writer for ggml type {ggml_type}")
    return np.concatenate(parts, axis=1)


@functools.cache
def _unit_rms(ggml_type: int) -> float:
    """RMS of dequantized random blocks written with d = 1 (measured once, fixed seed)."""
    blocks = _random_blocks(np.random.default_rng(0), ggml_type, 512, 1.0)
    x = gq.dequantize(blocks, GGMLQuantizationType(ggml_type))
    return float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))


def random_quant(rng: np.random.Generator, ggml_type: int, shape: tuple[int, ...], std: float) -> np.ndarray:
    """uint8 bytes (numpy byte shape) of a random Q2_K / Q4_K / IQ2_XXS tensor with dequantized std ~= std."""
    if shape[-1] % _QK:
        raise ValueError(f"{N.TYPE_NAMES[ggml_type]} needs ne0 % {_QK} == 0, got shape {shape}")
    n_blocks = math.prod(shape) // _QK
    blocks = _random_blocks(rng, ggml_type, n_blocks, std / _unit_rms(ggml_type))
    return blocks.reshape(*shape[:-1], -1)


# ---------------------------------------------------------------------------------------------------
# Quantizing given values (Q2_K, Q4_K, IQ2_XXS: simple round-to-nearest; the rest via gguf.quants)

def _kquant_scales(x: np.ndarray, q_max: int, s_max: int):
    """Per sub-block x ~ d*sc*q - dmin*m: returns f16 d, dmin (n,1) and integer sc, m, q."""
    lo = np.minimum(x.min(-1), 0.0)
    scale, mins = (np.maximum(x.max(-1), 0.0) - lo) / q_max, -lo
    d = _f16(scale.max(-1, keepdims=True) / s_max).astype(np.float32)
    dmin = _f16(mins.max(-1, keepdims=True) / s_max).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.clip(np.nan_to_num(np.round(scale / d)), 0, s_max)
        m = np.clip(np.nan_to_num(np.round(mins / dmin)), 0, s_max)
        step = (d * sc)[..., None]
        q = np.where(step > 0, np.round((x + (dmin * m)[..., None]) / step), 0)
    return d, dmin, sc, m, np.clip(np.nan_to_num(q), 0, q_max).astype(np.uint8)


def _quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q = _kquant_scales(blocks.reshape(n, 16, 16), 3, 15)
    q = q.reshape(n, 2, 4, 32)  # element 128h + 32j + l lives at bits 2j of qs[32h + l]
    qs = (q << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)).sum(2, dtype=np.uint8).reshape(n, 64)
    scales = (sc.astype(np.uint8) | (m.astype(np.uint8) << 4))
    return np.concatenate([scales, qs, _f16(d).view(np.uint8), _f16(dmin).view(np.uint8)], axis=1)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dmin, sc, m, q = _kquant_scales(blocks.reshape(n, 8, 32), 15, 63)
    q = q.reshape(n, 4, 2, 32)  # chunk j: low nibbles = sub-block 2j, high nibbles = 2j+1
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([_f16(d).view(np.uint8), _f16(dmin).view(np.uint8), _pack_q4k_scales(sc, m), qs], axis=1)


def _quantize_iq2_xxs(blocks: np.ndarray) -> np.ndarray:
    """Nearest-grid IQ2_XXS: signs from the values (even count: flip the smallest), one 4-bit scale per 32."""
    n = blocks.shape[0]
    x = blocks.reshape(n, 8, 4, 8)
    neg = x < 0
    odd = neg.sum(-1) % 2 == 1  # ksigns encodes only even counts of negatives
    flip = np.argmin(np.abs(x), axis=-1)
    neg[odd, flip[odd]] ^= True
    sign_idx = (neg[..., :7] << np.arange(7)).sum(-1).astype(np.uint32)
    a = np.abs(x)
    gs = a.reshape(n, 8, 32).max(-1) / 43.0  # group scale: largest magnitude -> grid value 43
    d = _f16(gs.max(-1, keepdims=True) / (15.5 * 0.25)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.clip(np.nan_to_num(np.round(gs * 4 / d - 0.5)), 0, 15).astype(np.uint32)
        t = np.nan_to_num(a / (d * (0.5 + s) * 0.25)[..., None, None])
    gq.IQ2_XXS.init_grid()
    grid = gq.IQ2_XXS.grid.reshape(256, 8)
    t = t.reshape(-1, 8)
    idx = np.empty(len(t), np.uint32)
    for i in range(0, len(t), 1 << 15):
        c = t[i:i + (1 << 15)]
        idx[i:i + len(c)] = np.argmin((grid * grid).sum(-1) - 2 * c @ grid.T, axis=-1)
    idx = idx.reshape(n, 8, 4)
    aa = (idx << np.array([0, 8, 16, 24], np.uint32)).sum(-1, dtype=np.uint32)
    bb = (sign_idx << np.array([0, 7, 14, 21], np.uint32)).sum(-1, dtype=np.uint32) | (s << 28)
    qs = np.stack([aa, bb], axis=-1).astype("<u4").reshape(n, 16).view(np.uint8)
    return np.concatenate([_f16(d).view(np.uint8), qs], axis=1)


_OWN_QUANTIZERS = {Q2_K: _quantize_q2_k, Q4_K: _quantize_q4_k, IQ2_XXS: _quantize_iq2_xxs}


def quantize(values: np.ndarray, ggml_type: int) -> np.ndarray:
    """Numpy `values` -> the array GGUFWriter stores for `ggml_type` (uint8 byte shape when quantized)."""
    if ggml_type == N.I32:
        return np.ascontiguousarray(values, dtype=np.int32)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if ggml_type in _OWN_QUANTIZERS:
        if values.shape[-1] % _QK:
            raise ValueError(f"{N.TYPE_NAMES[ggml_type]} needs ne0 % {_QK} == 0, got shape {values.shape}")
        blocks = _OWN_QUANTIZERS[ggml_type](values.reshape(-1, _QK))
        return blocks.reshape(*values.shape[:-1], -1)
    return gq.quantize(values, GGMLQuantizationType(ggml_type))


# ---------------------------------------------------------------------------------------------------
# Writing

def _tensor_type(spec: TensorSpec, expert_types: tuple[int, int, int]) -> int:
    for part, t in zip(("ffn_gate_exps.", "ffn_up_exps.", "ffn_down_exps."), expert_types):
        if part in spec.name:
            return t
    return N.F32 if N.F32 in spec.types else spec.types[0]


def _tensor_data(name: str, ggml_type: int, ggml_shape: tuple[int, ...], seed: int, n_expert: int,
                 values: np.ndarray | None) -> np.ndarray:
    shape = tuple(reversed(ggml_shape))
    if values is not None:
        values = np.asarray(values)
        if tuple(values.shape) != shape:
            raise ValueError(f"tensors[{name!r}] has shape {tuple(values.shape)}, expected {shape}")
        return quantize(values, ggml_type)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if ggml_type in _K_TYPES:
        return random_quant(rng, ggml_type, shape, 1.0 / math.sqrt(shape[-1]))
    return quantize(_initial_values(name, shape, rng, n_expert), ggml_type)


def _write(path, specs: list[TensorSpec], metadata: dict[str, GGUFValue], *, seed, expert_types, tensors,
           drop, retype, reshape, alignment=None) -> None:
    """Write `metadata` (in order; the writer's own general.architecture is replaced) and `specs`' tensors."""
    unknown = (set(drop) | set(retype) | set(reshape)) - {s.name for s in specs}
    if unknown:
        raise ValueError(f"drop/retype/reshape name tensors not in the layout: {sorted(unknown)}")
    tensors = dict(tensors or {})
    n_expert = next(s.ggml_shape[-1] for s in specs if s.name.endswith("ffn_gate_exps.weight"))
    writer = GGUFWriter(str(path), N.ARCH)
    writer.kv_data[0].clear()
    if alignment is not None:
        writer.data_alignment = alignment
        metadata = metadata | {N.KEY_ALIGNMENT: GGUFValue(alignment, GGUFValueType.UINT32)}
    for key, val in metadata.items():
        writer.add_key_value(key, val.value, val.type, val.sub_type)
    for spec in specs:
        values = tensors.pop(spec.name, None)
        if spec.name in drop:
            continue
        t = retype.get(spec.name, _tensor_type(spec, expert_types))
        ggml_shape = tuple(reshape.get(spec.name, spec.ggml_shape))
        try:
            data = _tensor_data(spec.name, t, ggml_shape, seed, n_expert, values)
        except (ValueError, gq.QuantError) as e:
            raise ValueError(f"{spec.name} ({GGMLQuantizationType(t).name} {list(ggml_shape)}): {e}") from e
        writer.add_tensor(spec.name, data, raw_dtype=GGMLQuantizationType(t))
    for name, values in tensors.items():  # extra tensors, not in the layout: written as given (F32/F16/I32)
        writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _as_value(v) -> GGUFValue | None:
    """A metadata override: a GGUFValue as is; plain bool/int/float/str/list values get a default type."""
    if isinstance(v, GGUFValue):
        return v
    if isinstance(v, bool):
        return GGUFValue(v, GGUFValueType.BOOL)
    if isinstance(v, int):
        return GGUFValue(v, GGUFValueType.UINT32)
    if isinstance(v, float):
        return GGUFValue(v, GGUFValueType.FLOAT32)
    if isinstance(v, str):
        return GGUFValue(v, GGUFValueType.STRING)
    if isinstance(v, (list, tuple)) and v:
        sub = _as_value(v[0]).type
        return GGUFValue(list(v), GGUFValueType.ARRAY, sub)
    raise ValueError(f"cannot infer a GGUF type for metadata value {v!r}; pass a gguf.GGUFValue")


def write_model_gguf(path: str | PathLike, cfg: ModelConfig, *, seed: int = 0,
                     expert_types: tuple[int, int, int] = (IQ2_XXS, IQ2_XXS, Q2_K),
                     tokenizer: tuple[list[str], list[str]] | None = None,
                     tensors: dict[str, np.ndarray] | None = None, drop=(), retype: dict | None = None,
                     reshape: dict | None = None, metadata_overrides: dict | None = None, drop_keys=(),
                     alignment: int | None = None) -> None:
    """Write a DS4-layout target GGUF for `cfg` (every tensor of target_layout(cfg), all metadata).

    expert_types: ggml types of (gate, up, down) routed experts. tokenizer: (tokens, merges), default
    build_tokenizer(cfg.n_vocab). tensors: {name: float32 values in numpy order} replacing the random
    values (quantized to the tensor's type); names outside the layout are added as given.
    metadata_overrides: {key: value} where value is a gguf.GGUFValue or a plain bool/int(u32)/float(f32)/
    str/list. drop_keys: metadata keys left out (general.architecture included).
    """
    tokens, merges = tokenizer if tokenizer is not None else build_tokenizer(cfg.n_vocab)
    metadata = model_metadata(cfg) | tokenizer_metadata(tokens, merges)
    metadata |= {k: _as_value(v) for k, v in (metadata_overrides or {}).items()}
    for key in drop_keys:
        metadata.pop(key, None)
    _write(path, target_layout(cfg), metadata, seed=seed, expert_types=expert_types, tensors=tensors,
           drop=drop, retype=retype or {}, reshape=reshape or {}, alignment=alignment)


def write_mtp_gguf(path: str | PathLike, cfg: ModelConfig, *, seed: int = 1,
                   expert_types: tuple[int, int, int] = (Q4_K, Q4_K, Q4_K),
                   tensors: dict[str, np.ndarray] | None = None, drop=(), retype: dict | None = None,
                   reshape: dict | None = None) -> None:
    """Write ds4's MTP GGUF for a target `cfg`: the mtp.0.* tensors (plain ones as F32), general.architecture only."""
    metadata = {N.KEY_ARCHITECTURE: GGUFValue(N.ARCH, GGUFValueType.STRING)}
    _write(path, mtp_layout(cfg), metadata, seed=seed, expert_types=expert_types, tensors=tensors, drop=drop,
           retype=retype or {}, reshape=reshape or {})
