"""The DeepSeek V4 target model as one pure step function (spec §3.9):

    step(tokens [T], start, caches) -> final HC states [T, S, D], proposed cache rows per layer
    head(hc [T, S, D]) -> logits [T, V]

One step serves prefill chunks (T = chunk), decode (T = 1) and speculative verify (T = drafts + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ds4trt.model.attention import Attention, _param
from ds4trt.model.config import ModelConfig
from ds4trt.model.linear import Linear, project_group
from ds4trt.model.hc import hc_collapse, hc_post, hc_post_pre, hc_pre
from ds4trt.model.moe import RoutedExperts, route, shared_expert
from ds4trt.model.numerics import rms_norm
from ds4trt.model.state import LayerCache, LayerRows
from ds4trt.gguf_io import names as N

NUMERICS = ("ds4", "float")


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, weights, prefix: str, hash_routed: bool, experts, linear):
        super().__init__()
        self.cfg = cfg
        w = weights.get
        g = lambda s: _param(w(prefix + s))  # noqa: E731
        self.norm, self.gate_inp = g("ffn_norm.weight"), linear(weights, prefix + "ffn_gate_inp.weight")
        self.bias = g("exp_probs_b.bias") if weights.has(prefix + "exp_probs_b.bias") else None
        self.register_buffer("tid2eid", w(prefix + "ffn_gate_tid2eid.weight").long() if hash_routed else None,
                             persistent=False)                                       # [V, k]
        self.experts = experts(weights, prefix, cfg.swiglu_clamp)
        self.group = project_group       # a backend may set a version computing the shared gate and up in one launch
        self.route = route               # and a kernel with route's signature
        self.sh_gate, self.sh_up, self.sh_down = (linear(weights, prefix + f"ffn_{s}_shexp.weight")
                                                  for s in ("gate", "up", "down"))
        self.both_experts = self.routed_plus_shared     # a backend may set one call computing both

    def forward(self, y: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """y: [T, D], tokens: [T] -> [T, D]"""
        cfg = self.cfg
        v = rms_norm(y, self.norm, cfg.rms_eps)
        ids, weights = self.route(self.gate_inp(v), self.bias, self.tid2eid, tokens, cfg.n_expert_used,
                                  cfg.expert_weight_scale)
        return self.both_experts(v, ids, weights)

    def routed_plus_shared(self, v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """v: [T, D]; ids, weights: [T, k] -> [T, D]: the routed experts' weighted sum plus the shared expert."""
        return self.experts(v, ids, weights) + shared_expert(v, self.sh_gate, self.sh_up, self.sh_down,
                                                             self.cfg.swiglu_clamp, self.group)


class HyperConnection(nn.Module):
    def __init__(self, cfg: ModelConfig, w, prefix: str):
        super().__init__()
        self.cfg = cfg
        self.reduce = hc_pre             # a backend may set a fused kernel with hc_pre's signature
        self.combine = hc_post           # and with hc_post's
        self.update_reduce = hc_post_pre     # and with hc_post_pre's
        self.fn, self.scale, self.base = _param(w(prefix + "_fn.weight")), _param(w(prefix + "_scale.weight")), \
            _param(w(prefix + "_base.weight"))

    def pre(self, X):
        c = self.cfg
        return self.reduce(X, self.fn, self.scale, self.base, c.rms_eps, c.hc_eps, c.sinkhorn_iters)

    def post(self, f, X, post, comb):
        return self.combine(f, X, post, comb)

    def pre_after(self, f, X, post, comb):
        """The streams updated by the sublayer before (its output f, its connection's post and comb), then this
        connection's pre of them -> X', y, post', comb'."""
        c = self.cfg
        return self.update_reduce(f, X, post, comb, self.fn, self.scale, self.base, c.rms_eps, c.hc_eps,
                                  c.sinkhorn_iters)


class Block(nn.Module):
    """One transformer layer: HC-pre -> attention -> HC-post, HC-pre -> MoE -> HC-post."""

    def __init__(self, cfg: ModelConfig, layer: int, weights, numerics: str, prefix: str, hash_routed: bool,
                 experts=RoutedExperts.from_weights, linear=Linear.from_weights):
        super().__init__()
        w = weights.get
        self.hc_attn = HyperConnection(cfg, w, prefix + "hc_attn")
        self.attn = Attention(cfg, layer, weights, numerics, prefix, linear)
        self.hc_ffn = HyperConnection(cfg, w, prefix + "hc_ffn")
        self.ffn = FeedForward(cfg, weights, prefix, hash_routed, experts, linear)

    def forward(self, X: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, cache: LayerCache,
                indexer: bool = True):
        """X: [T, S, D] -> [T, S, D], LayerRows (indexer: Attention.forward's)"""
        y, post, comb = self.hc_attn.pre(X)
        a, rows = self.attn(y, start, cache, indexer)
        X, y, post, comb = self.hc_ffn.pre_after(a, X, post, comb)            # hc_attn.post, then hc_ffn.pre
        return self.hc_ffn.post(self.ffn(y, tokens), X, post, comb), rows


@dataclass
class StepOutput:
    hc: torch.Tensor               # [T, S, D] final HC state of every new token (the MTP head's input)
    rows: list[LayerRows]          # per layer, the cache rows this step proposes


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights, numerics: str = "ds4", experts=RoutedExperts.from_weights,
                 linear=Linear.from_weights):
        """`weights` has get(name) -> float32 tensor and has(name) (model/weights.py). `experts(weights,
        prefix, clamp)` builds each layer's routed-expert module and `linear(weights, name, groups)` each Q8_0
        projection (a backend may keep GGUF blocks for both)."""
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        self.cfg, self.numerics = cfg, numerics
        w = weights.get
        self.embed = _param(w(N.TOKEN_EMBD))                           # [V, D]
        self.blocks = nn.ModuleList(
            Block(cfg, l, weights, numerics, f"blk.{l}.", cfg.is_hash(l), experts, linear) for l in range(cfg.n_layer))
        self.head_fn, self.head_scale, self.head_base = _param(w(N.OUTPUT_HC_FN)), _param(w(N.OUTPUT_HC_SCALE)), \
            _param(w(N.OUTPUT_HC_BASE))
        self.out_norm, self.output = _param(w(N.OUTPUT_NORM)), linear(weights, N.OUTPUT)

    def step(self, tokens: torch.Tensor, start: torch.Tensor, caches: list[LayerCache],
             indexer: bool = True) -> StepOutput:
        """tokens: [T] int64 at positions start..start+T-1; caches: read only; indexer: False only where
        attention.indexer_needed(cfg, start + T) is False (the same result without the indexer's work)."""
        X = self.embed[tokens][:, None, :].repeat(1, self.cfg.n_hc, 1)     # same embedding in every stream
        rows = []
        for block, cache in zip(self.blocks, caches):
            X, r = block(X, tokens, start, cache, indexer)
            rows.append(r)
        return StepOutput(hc=X, rows=rows)

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, caches: list[LayerCache], last_only: bool = False,
                indexer: bool = True):
        """The step and the head: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows. Every backend
        (PyTorch, ONNX Runtime, TensorRT) offers this same call; the session uses nothing else. indexer: see step
        (an exported engine always runs the indexer, which then keeps the same rows)."""
        out = self.step(tokens, start, caches, indexer)
        return self.head(out.hc[-1:] if last_only else out.hc), out.hc, out.rows

    def head(self, hc: torch.Tensor) -> torch.Tensor:
        """hc: [T, S, D] -> logits [T, V]"""
        c = self.cfg
        z = hc_collapse(hc, self.head_fn, self.head_scale, self.head_base, c.rms_eps, c.hc_eps)
        return self.output(rms_norm(z, self.out_norm, c.rms_eps))
