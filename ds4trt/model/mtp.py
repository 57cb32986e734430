"""The MTP (multi-token prediction) head: one sliding-window block that drafts the token after next.

Pairing (a deliberate choice, see docs in README "MTP pairing"): DeepSeek's convention, the one the MTP
weights were trained with. Row i of the head combines the target's final HC state h_i (after token x_i)
with the embedding of x_{i+1}, sits at position i, and predicts x_{i+2}. ds4 instead pairs h_p with the
embedding of x_p, which re-predicts x_{p+1}, a token the target's own logits already give.

    X = e_proj(RMSNorm(embed(x_{i+1}); enorm))  (same in every stream)
      + h_proj(RMSNorm(h_i[s]; hnorm))           (per stream s)
    X -> block (ratio 0, main RoPE, biased top-k routing, its own raw KV ring) -> HC head -> target LM head

Recursive drafting feeds the head's own output HC state and the token it just drafted, at position i+1.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ds4trt.gguf_io import names as N
from ds4trt.model.attention import _param, step_rope
from ds4trt.model.hc import hc_collapse
from ds4trt.model.linear import Linear
from ds4trt.model.moe import RoutedExperts
from ds4trt.model.numerics import rms_norm
from ds4trt.model.state import LayerCache
from ds4trt.model.transformer import Block, StepOutput, Transformer


class MTPHead(nn.Module):
    def __init__(self, target: Transformer, weights, experts=RoutedExperts.from_weights, linear=Linear.from_weights):
        """`weights`: the MTP GGUF's tensors (get/has); the token embedding and LM head are the target's."""
        super().__init__()
        cfg = target.cfg
        self.cfg, self.target = cfg, [target]     # a list: do not register the target as a submodule
        w = weights.get
        g = lambda s: _param(w(N.mtp(s)))  # noqa: E731
        self.e_proj, self.h_proj = linear(weights, N.mtp("e_proj.weight")), linear(weights, N.mtp("h_proj.weight"))
        self.enorm, self.hnorm, self.norm = g("enorm.weight"), g("hnorm.weight"), g("norm.weight")
        self.head_fn, self.head_scale, self.head_base = g("hc_head_fn.weight"), g("hc_head_scale.weight"), \
            g("hc_head_base.weight")
        self.block = Block(cfg, 0, weights, target.numerics, N.MTP_PREFIX, hash_routed=False, experts=experts,
                           linear=linear)

    def step(self, tokens: torch.Tensor, h: torch.Tensor, start: torch.Tensor, caches: list[LayerCache]) -> StepOutput:
        """tokens: [T] (x_{i+1}); h: [T, S, D] (h_i); rows at positions start..start+T-1 -> hc [T, S, D]"""
        cfg, target = self.cfg, self.target[0]
        e = self.e_proj(rms_norm(target.embed[tokens], self.enorm, cfg.rms_eps))              # [T, D]
        hh = self.h_proj(rms_norm(h, self.hnorm, cfg.rms_eps))                                # [T, S, D]
        rope, = step_rope(target.rope_freqs[:1], start, tokens.shape[0], e.dtype)      # the plain RoPE
        X, _, rows = self.block(e[:, None, :] + hh, tokens, start, rope, caches[0])
        return StepOutput(hc=X, rows=[rows])

    def forward(self, tokens: torch.Tensor, h: torch.Tensor, start: torch.Tensor, caches: list[LayerCache],
                last_only: bool = False, indexer: bool = True):
        """step + head: logits [T, V] ([1, V] if last_only), hc [T, S, D], rows. indexer: Transformer.forward's
        argument, accepted for the same call (the MTP block has no indexer)."""
        out = self.step(tokens, h, start, caches)
        return self.head(out.hc[-1:] if last_only else out.hc), out.hc, out.rows

    def head(self, hc: torch.Tensor) -> torch.Tensor:
        """hc: [T, S, D] -> logits [T, V] through the MTP's HC head and norm and the target's LM head."""
        c, target = self.cfg, self.target[0]
        z = hc_collapse(hc, self.head_fn, self.head_scale, self.head_base, c.rms_eps, c.hc_eps)
        return target.output(rms_norm(z, self.norm, c.rms_eps))
