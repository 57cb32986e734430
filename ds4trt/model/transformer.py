"""The DeepSeek V4 target model as one pure step function (spec §3.9):

    step(tokens [T], start, caches) -> final HC states [T, S, D], proposed cache rows per layer
    head(hc [T, S, D]) -> logits [T, V]

One step serves prefill chunks (T = chunk), decode (T = 1) and speculative verify (T = drafts + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ds4trt.model.attention import Attention, _param, step_rope
from ds4trt.model.config import ModelConfig
from ds4trt.model.linear import Linear, project_group
from ds4trt.model.hc import hc_collapse, hc_post, hc_post_pre, hc_pre
from ds4trt.model.moe import RoutedExperts, route, shared_expert
from ds4trt.model.numerics import rms_norm
from ds4trt.model.rope import inv_freq
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

    def forward(self, v: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """v: [T, D] the input, RMS-normed with self.norm (HyperConnection.pre does it), tokens: [T] -> [T, D]. A
        backend's both_experts may return the [T, J, D] terms of the sum instead where its hyper-connection functions
        (HyperConnection.post, pre_after: the only consumers) sum them."""
        cfg = self.cfg
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

    def pre(self, X, norm):
        """X [T, S, D], norm [D] the sublayer's input norm -> its normed input [T, D], post, comb (hc_pre)"""
        c = self.cfg
        return self.reduce(X, self.fn, self.scale, self.base, c.rms_eps, c.hc_eps, c.sinkhorn_iters, norm)

    def post(self, f, X, post, comb):
        return self.combine(f, X, post, comb)

    def pre_after(self, f, X, post, comb, norm):
        """The streams updated by the sublayer before (its output f, its connection's post and comb), then this
        connection's pre of them -> X', the sublayer's normed input, post', comb'."""
        c = self.cfg
        return self.update_reduce(f, X, post, comb, self.fn, self.scale, self.base, c.rms_eps, c.hc_eps,
                                  c.sinkhorn_iters, norm)


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

    def forward(self, X: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, rope: tuple, cache: LayerCache,
                indexer: bool = True, pending: tuple | None = None, last: bool = True):
        """X: [T, S, D] streams -> X', pending', LayerRows (rope, indexer: Attention.forward's).
        pending: the previous block's update of X not yet made (its FFN output f and its connection's post and comb),
        made here together with this block's first reduction (hc_attn.pre_after); None: X is up to date.
        last: X' is this block's output streams and pending' None; otherwise X' is the streams before this block's
        own update, left pending for the next block (a backend then makes each update and the next reduction in fewer
        passes over the streams)."""
        if pending is None:
            u, post, comb = self.hc_attn.pre(X, self.attn.norm)
        else:
            f, prev_post, prev_comb = pending                                        # hc_ffn.post before, hc_attn.pre
            X, u, post, comb = self.hc_attn.pre_after(f, X, prev_post, prev_comb, self.attn.norm)
        a, rows = self.attn(u, start, rope, cache, indexer)
        X, v, post, comb = self.hc_ffn.pre_after(a, X, post, comb, self.ffn.norm)   # hc_attn.post, then hc_ffn.pre
        f = self.ffn(v, tokens)
        if last:
            return self.hc_ffn.post(f, X, post, comb), None, rows
        return X, (f, post, comb), rows


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
        self.rope_freqs = (inv_freq(cfg, compressed=False), inv_freq(cfg, compressed=True))   # step_rope's, float64

    def step(self, tokens: torch.Tensor, start: torch.Tensor, caches: list[LayerCache],
             indexer: bool = True) -> StepOutput:
        """tokens: [T] int64 at positions start..start+T-1; caches: read only; indexer: False only where
        attention.indexer_needed(cfg, start + T) is False (the same result without the indexer's work)."""
        X, ropes = self.step_inputs(tokens, start)
        rows, pending = [], None
        for i, (block, cache) in enumerate(zip(self.blocks, caches)):
            rope = ropes[block.attn.ratio != 0]
            X, pending, r = block(X, tokens, start, rope, cache, indexer, pending, last=i == len(self.blocks) - 1)
            rows.append(r)
        return StepOutput(hc=X, rows=rows)

    def step_inputs(self, tokens: torch.Tensor, start: torch.Tensor):
        """The step's first streams X [T, S, D] (each token's embedding in every stream) and RoPE tables (step_rope:
        the plain layers', then the compressed layers'), made once a step (a backend may compile this too)."""
        X = self.embed[tokens][:, None, :].repeat(1, self.cfg.n_hc, 1)
        return X, step_rope(self.rope_freqs, start, tokens.shape[0], X.dtype)

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
