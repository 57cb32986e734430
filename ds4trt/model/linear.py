"""Projections y = x @ W.T, the unit a backend swaps to keep a weight in its GGUF blocks (like the routed
experts' `experts` factory): `Linear.from_weights(weights, name, groups)` is the default `linear` factory.

groups G > 1 (attn_output_a): the N rows of W form G equal groups and group g reads x[..., g*K:(g+1)*K].
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, groups: int = 1):
        super().__init__()
        self.weight = nn.Parameter(weight.to(torch.float32), requires_grad=False)      # [N, K]
        self.groups = groups

    @classmethod
    def from_weights(cls, weights, name: str, groups: int = 1) -> "Linear":
        return cls(weights.get(name), groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., G*K] -> [..., N]"""
        return project(x, self.weight, self.groups)


def project(x: torch.Tensor, weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """x: [..., G*K], weight: [N, K] -> [..., N] (the contract in the module docstring)."""
    if groups == 1:
        return x @ weight.T
    G, (N, K) = groups, weight.shape
    y = torch.einsum("tgi,goi->tgo", x.reshape(-1, G, K), weight.reshape(G, N // G, K))
    return y.reshape(*x.shape[:-1], N)


def project_group(x: torch.Tensor, *mods: nn.Module) -> tuple[torch.Tensor, ...]:
    """(m(x) for each m): the projections of one input, the unit a backend may compute with fewer launches."""
    return tuple(m(x) for m in mods)
