"""ModelConfig: the model's shape, read from a GGUF's deepseek4.* metadata.

The real DeepSeek V4 Flash shape (`ModelConfig.flash()`) is the canonical configuration; ds4 accepts only
that one. ds4trt also accepts smaller, self-consistent configurations (fewer layers, narrower widths,
other window / top-k / ratio values), which is what the tests and the demo model use.

Layer kinds follow ds4: ratio 0 = sliding-window only; ratio 4 = overlapping compressor + indexer
("CSA"); any other ratio = non-overlapping compressor ("HCA"). Layers below `n_hash_layer` route
experts by token id (tid2eid).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N

# GGUF value type ids (the container's own numbering).
_U32, _I32, _F32, _BOOL, _STRING, _ARRAY, _U64, _F64 = 4, 5, 6, 7, 8, 9, 10, 12
_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string",
               9: "array", 10: "u64", 11: "i64", 12: "f64"}


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 43
    n_embd: int = 4096            # D
    n_vocab: int = 129280         # V
    n_head: int = 64              # H query heads; one shared K=V head
    head_dim: int = 512           # d (key = value width)
    n_rot: int = 64               # rotary dims, at the tail of each head
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_expert: int = 256           # E
    n_expert_used: int = 6        # k
    expert_ff: int = 2048         # F (routed and shared)
    n_hash_layer: int = 3
    window: int = 128             # raw sliding window, query included
    index_n_head: int = 64
    index_head_dim: int = 128
    index_top_k: int = 512
    n_hc: int = 4                 # hyper-connection streams S
    sinkhorn_iters: int = 20
    compress_ratios: tuple[int, ...] = field(
        default_factory=lambda: (0, 0) + tuple(4 if l % 2 == 0 else 128 for l in range(2, 43)))
    swiglu_clamp: float = 10.0
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    rope_scale: float = 16.0
    rope_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    expert_weight_scale: float = 1.5
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    context_length: int = 1048576  # informational
    name: str = ""

    # ---- derived shapes ----
    @property
    def n_nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def hc_dim(self) -> int:  # flattened HC state, S*D
        return self.n_hc * self.n_embd

    @property
    def hc_mix(self) -> int:  # pre(S) + post(S) + comb(S*S)
        return (2 + self.n_hc) * self.n_hc

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def has_indexer(self, layer: int) -> bool:
        return self.compress_ratios[layer] == 4

    def is_hash(self, layer: int) -> bool:
        return layer < self.n_hash_layer

    def compress_width(self, layer: int) -> int:
        """Wc: the compressor projection width (2*d for the overlapping ratio-4 scheme, else d)."""
        return (2 if self.ratio(layer) == 4 else 1) * self.head_dim

    @classmethod
    def flash(cls) -> "ModelConfig":
        return cls(name="DeepSeek-V4-Flash")

    def is_flash_shape(self) -> bool:
        """True when this is the shape ds4 itself accepts (floats within ds4's 1e-6 relative tolerance)."""
        ref = asdict(ModelConfig.flash())
        for key, value in asdict(self).items():
            if key in ("name", "context_length"):
                continue
            if isinstance(value, float):
                if abs(value - ref[key]) > 1e-6 * max(1.0, abs(ref[key])):
                    return False
            elif value != ref[key]:
                return False
        return True

    # ---- reading ----
    @classmethod
    def from_gguf(cls, gguf) -> "ModelConfig":
        """Read and check the deepseek4.* metadata of an opened GGUFFile; raise Ds4Error naming the key."""
        md = _Metadata(gguf.metadata, str(gguf.path))
        n_layer = md.u32(N.KEY_BLOCK_COUNT)
        if n_layer < 1:  # before the per-layer arrays: clamps[0] below needs one layer
            md.fail(N.KEY_BLOCK_COUNT, "a value >= 1", n_layer)
        ratios = md.int_array(N.KEY_COMPRESS_RATIOS, n_layer)
        clamps = md.float_array(N.KEY_SWIGLU_CLAMP, n_layer)
        if any(abs(c - clamps[0]) > 1e-6 * max(1.0, abs(clamps[0])) for c in clamps):
            md.fail(N.KEY_SWIGLU_CLAMP, "one clamp value for every layer", f"{clamps}")
        cfg = cls(
            n_layer=n_layer,
            n_embd=md.u32(N.KEY_EMBD),
            n_vocab=md.u32(N.KEY_VOCAB),
            n_head=md.u32(N.KEY_HEAD),
            head_dim=md.u32(N.KEY_KEY_LENGTH),
            n_rot=md.u32(N.KEY_ROPE_DIMS),
            q_lora_rank=md.u32(N.KEY_Q_LORA),
            o_lora_rank=md.u32(N.KEY_O_LORA),
            o_groups=md.u32(N.KEY_O_GROUPS),
            n_expert=md.u32(N.KEY_EXPERTS),
            n_expert_used=md.u32(N.KEY_EXPERTS_USED),
            expert_ff=md.u32(N.KEY_EXPERT_FF),
            n_hash_layer=md.u32(N.KEY_HASH_LAYERS),
            window=md.u32(N.KEY_WINDOW),
            index_n_head=md.u32(N.KEY_INDEX_HEADS),
            index_head_dim=md.u32(N.KEY_INDEX_DIM),
            index_top_k=md.u32(N.KEY_INDEX_TOP_K),
            n_hc=md.u32(N.KEY_HC),
            sinkhorn_iters=md.u32(N.KEY_SINKHORN),
            compress_ratios=tuple(ratios),
            swiglu_clamp=clamps[0],
            rope_base=md.float(N.KEY_ROPE_BASE),
            compress_rope_base=md.float(N.KEY_COMPRESS_ROPE_BASE),
            rope_scale=md.float(N.KEY_ROPE_SCALE),
            rope_orig_ctx=md.u64_or_u32(N.KEY_ROPE_ORIG_CTX),
            yarn_beta_fast=md.float(N.KEY_YARN_BETA_FAST),
            yarn_beta_slow=md.float(N.KEY_YARN_BETA_SLOW),
            expert_weight_scale=md.float(N.KEY_EXPERT_WEIGHT_SCALE),
            rms_eps=md.float(N.KEY_RMS_EPS),
            hc_eps=md.float(N.KEY_HC_EPS),
            context_length=md.optional_int(N.KEY_CONTEXT_LENGTH, 0),
            name=md.optional_str(N.KEY_NAME),
        )
        # Fixed by the architecture (ds4trt implements exactly these):
        md.expect_u32(N.KEY_HEAD_KV, 1)
        md.expect_u32(N.KEY_VALUE_LENGTH, cfg.head_dim)
        md.expect_u32(N.KEY_EXPERTS_SHARED, 1)
        md.expect_u32(N.KEY_EXPERT_GROUPS, 0, optional=True)
        md.expect_u32(N.KEY_EXPERT_GROUPS_USED, 0, optional=True)
        if not md.bool(N.KEY_EXPERT_WEIGHTS_NORM):
            md.fail(N.KEY_EXPERT_WEIGHTS_NORM, "true", "false")
        cfg.check(md.fail)
        return cfg

    def check(self, fail) -> None:
        """Cross-field consistency; `fail(key, expected, got)` raises."""
        pos = {N.KEY_BLOCK_COUNT: self.n_layer, N.KEY_EMBD: self.n_embd, N.KEY_VOCAB: self.n_vocab,
               N.KEY_HEAD: self.n_head, N.KEY_KEY_LENGTH: self.head_dim, N.KEY_Q_LORA: self.q_lora_rank,
               N.KEY_O_LORA: self.o_lora_rank, N.KEY_O_GROUPS: self.o_groups, N.KEY_EXPERTS: self.n_expert,
               N.KEY_EXPERTS_USED: self.n_expert_used, N.KEY_EXPERT_FF: self.expert_ff, N.KEY_WINDOW: self.window,
               N.KEY_INDEX_HEADS: self.index_n_head, N.KEY_INDEX_TOP_K: self.index_top_k, N.KEY_HC: self.n_hc,
               N.KEY_SINKHORN: self.sinkhorn_iters}
        for key, v in pos.items():
            if v < 1:
                fail(key, "a value >= 1", v)
        if self.n_rot % 2 or not 0 < self.n_rot <= min(self.head_dim, self.index_head_dim):
            fail(N.KEY_ROPE_DIMS, f"an even value in 2..{min(self.head_dim, self.index_head_dim)}", self.n_rot)
        if self.n_head % self.o_groups:
            fail(N.KEY_O_GROUPS, f"a divisor of the head count {self.n_head}", self.o_groups)
        if self.n_expert_used > self.n_expert:
            fail(N.KEY_EXPERTS_USED, f"<= expert_count {self.n_expert}", self.n_expert_used)
        if self.n_hash_layer > self.n_layer:
            fail(N.KEY_HASH_LAYERS, f"<= block_count {self.n_layer}", self.n_hash_layer)
        d = self.index_head_dim
        if d < 2 or d & (d - 1):
            fail(N.KEY_INDEX_DIM, "a power of two (the indexer's Hadamard transform)", d)
        for layer, r in enumerate(self.compress_ratios):
            if r == 1 or r < 0:
                fail(N.KEY_COMPRESS_RATIOS, f"entry {layer} to be 0 or >= 2", r)
        if self.swiglu_clamp <= 0:
            fail(N.KEY_SWIGLU_CLAMP, "a positive clamp", self.swiglu_clamp)
        for key, v in ((N.KEY_ROPE_BASE, self.rope_base), (N.KEY_COMPRESS_ROPE_BASE, self.compress_rope_base),
                       (N.KEY_ROPE_SCALE, self.rope_scale), (N.KEY_ROPE_ORIG_CTX, self.rope_orig_ctx),
                       (N.KEY_YARN_BETA_FAST, self.yarn_beta_fast), (N.KEY_YARN_BETA_SLOW, self.yarn_beta_slow),
                       (N.KEY_RMS_EPS, self.rms_eps), (N.KEY_HC_EPS, self.hc_eps)):
            if not (v > 0 and math.isfinite(v)):
                fail(key, "a positive finite number", v)

    def summary(self) -> str:
        kinds = {0: "sliding", 4: "ratio-4+indexer"}
        counts: dict[str, int] = {}
        for r in self.compress_ratios:
            k = kinds.get(r, f"ratio-{r}")
            counts[k] = counts.get(k, 0) + 1
        params = self.parameter_count()
        lines = [
            f"model        {self.name or '(unnamed)'}{'  [DeepSeek V4 Flash shape]' if self.is_flash_shape() else ''}",
            f"layers       {self.n_layer}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
            + f"; hash-routed: {self.n_hash_layer}",
            f"width        D={self.n_embd}, heads={self.n_head}x{self.head_dim} (rope {self.n_rot}), "
            f"q_lora={self.q_lora_rank}, out={self.o_groups}x{self.o_lora_rank}",
            f"experts      {self.n_expert} routed (top {self.n_expert_used}) + 1 shared, ff={self.expert_ff}",
            f"attention    window={self.window}, indexer {self.index_n_head}x{self.index_head_dim} "
            f"top-{self.index_top_k}",
            f"hyper-conn   {self.n_hc} streams, {self.sinkhorn_iters} Sinkhorn iterations",
            f"vocab        {self.n_vocab}",
            f"parameters   {params / 1e9:.2f} B" if params >= 1e8 else f"parameters   {params / 1e6:.2f} M",
        ]
        return "\n".join(lines)

    def parameter_count(self) -> int:
        D, V, H, d, S = self.n_embd, self.n_vocab, self.n_head, self.head_dim, self.n_hc
        n = 2 * V * D + S * S * D + S + 1 + D
        for layer in range(self.n_layer):
            n += 2 * (self.hc_mix * S * D + 3 + self.hc_mix) + 2 * D
            n += D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * d + D * d + d + H
            n += (H * d // self.o_groups) * self.o_groups * self.o_lora_rank + self.o_groups * self.o_lora_rank * D
            n += D * self.n_expert + 3 * self.n_expert * self.expert_ff * D + 3 * self.expert_ff * D
            r = self.ratio(layer)
            if r:
                wc = self.compress_width(layer)
                n += wc * r + 2 * D * wc + d
            if r == 4:
                i = self.index_head_dim
                n += self.q_lora_rank * self.index_n_head * i + D * self.index_n_head + 2 * i * 4 + 2 * D * 2 * i + i
        return n


class _Metadata:
    """Typed access to GGUF metadata with one-line errors naming the file and key."""

    def __init__(self, fields: dict, path: str):
        self.fields, self.path = fields, path

    def fail(self, key, expected, got):
        raise Ds4Error(f"{self.path}: metadata {key}: expected {expected}, got {got}")

    def _get(self, key, types):
        f = self.fields.get(key)
        if f is None:
            raise Ds4Error(f"{self.path}: metadata key {key} is missing")
        if f.type not in types:
            self.fail(key, " or ".join(_TYPE_NAMES[t] for t in types), _TYPE_NAMES.get(f.type, f.type))
        return f

    def u32(self, key) -> int:
        return int(self._get(key, (_U32,)).value)

    def u64_or_u32(self, key) -> int:
        return int(self._get(key, (_U64, _U32)).value)

    def float(self, key) -> float:
        return float(self._get(key, (_F32, _F64, _U32, _I32)).value)

    def bool(self, key) -> bool:
        return bool(self._get(key, (_BOOL,)).value)

    def expect_u32(self, key, value, optional=False):
        if optional and key not in self.fields:
            return
        got = self.u32(key)
        if got != value:
            self.fail(key, value, got)

    def _array(self, key, elem_types, n_layer):
        f = self._get(key, (_ARRAY,))
        if f.array_type not in elem_types:
            self.fail(key, "an array of " + " or ".join(_TYPE_NAMES[t] for t in elem_types),
                      f"an array of {_TYPE_NAMES.get(f.array_type, f.array_type)}")
        if len(f.value) < n_layer:
            self.fail(key, f"at least {n_layer} entries (block_count)", f"{len(f.value)}")
        return list(f.value)[:n_layer]

    def int_array(self, key, n_layer) -> list[int]:
        return [int(v) for v in self._array(key, (_U32, _I32), n_layer)]

    def float_array(self, key, n_layer) -> list[float]:
        return [float(v) for v in self._array(key, (_F32, _F64), n_layer)]

    def optional_int(self, key, default) -> int:
        f = self.fields.get(key)
        return int(f.value) if f is not None and f.type in (_U32, _U64, _I32) else default

    def optional_str(self, key) -> str:
        f = self.fields.get(key)
        return str(f.value) if f is not None and f.type == _STRING else ""
