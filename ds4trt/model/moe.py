"""Mixture of experts: sqrt-softplus router, hash or biased top-k selection, clamped SwiGLU experts,
one shared expert (spec §3.4 FFN half)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ds4trt.model.linear import project_group

WEIGHT_SUM_FLOOR = 6.103515625e-5


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp: float) -> torch.Tensor:
    """silu(min(gate, clamp)) * clamp(up, -clamp, clamp): the clamp is asymmetric on purpose."""
    return F.silu(torch.clamp(gate, max=clamp)) * torch.clamp(up, -clamp, clamp)


def route(logits: torch.Tensor, bias: torch.Tensor | None, tid2eid: torch.Tensor | None,
          tokens: torch.Tensor, k: int, scale: float):
    """Pick k experts per token and their weights.

    logits: [T, E] the router's products v @ gate_inp.T; bias: [E] or None; tid2eid: [V, k] or None (hash layer);
    tokens: [T]. returns ids [T, k] int64, weights [T, k]
    """
    probs = torch.sqrt(F.softplus(logits))                          # [T, E]
    if tid2eid is not None:
        ids = tid2eid[tokens].long()
    else:
        sel = probs if bias is None else probs + bias
        ids = torch.sort(sel, dim=-1, descending=True, stable=True).indices[:, :k]  # ties: lower id first
    w = probs.gather(1, ids)
    w = scale * w / torch.clamp(w.sum(-1, keepdim=True), min=WEIGHT_SUM_FLOOR)
    return ids, w


class RoutedExperts(nn.Module):
    """Sum over the selected experts of weight * down(swiglu(gate v, up v)), from float weights.

    This module is the unit a backend swaps for its own implementation of the same contract (the
    `ds4::MoE` op reading GGUF blocks, plugins/moe.py).
    gate, up: [E, F, D]; down: [E, D, F]
    """

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, clamp: float):
        super().__init__()
        self.gate, self.up, self.down = (nn.Parameter(t.float(), requires_grad=False) for t in (gate, up, down))
        self.clamp = clamp

    @classmethod
    def from_weights(cls, weights, prefix: str, clamp: float) -> "RoutedExperts":
        """The default factory: dequantize a layer's three expert tensors ('blk.N.' / 'mtp.0.' prefix)."""
        g = lambda s: weights.get(prefix + s)  # noqa: E731
        return cls(g("ffn_gate_exps.weight"), g("ffn_up_exps.weight"), g("ffn_down_exps.weight"), clamp)

    def forward(self, v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """v: [T, D]; ids, weights: [T, k] -> [T, D]"""
        out = torch.zeros_like(v)
        for e in torch.unique(ids).tolist():
            t, slot = torch.nonzero(ids == e, as_tuple=True)
            h = swiglu(v[t] @ self.gate[e].T, v[t] @ self.up[e].T, self.clamp) * weights[t, slot, None]
            out.index_add_(0, t, h @ self.down[e].T)
        return out


def shared_expert(v: torch.Tensor, gate, up, down, clamp: float, group=project_group):
    """v: [T, D]; gate, up: projections D -> F; down: F -> D (model/linear.py); group: project_group or a
    backend's version of it -> [T, D]"""
    return down(swiglu(*group(v, gate, up), clamp))
