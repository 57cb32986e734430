"""Rotary embedding on the tail of each head, interleaved pairs (GPT-J style), spec §3.0.

Sliding-window layers (and the MTP block) use the plain table (rope_base). Compressed layers use
compress_rope_base with YaRN (factor, original context, beta fast/slow), without the mscale factor.
Pair i of a head of width w is (x[w - n_rot + 2i], x[w - n_rot + 2i + 1]).
"""

from __future__ import annotations

import math

import torch

from ds4trt.model.config import ModelConfig


def inv_freq(cfg: ModelConfig, compressed: bool) -> torch.Tensor:
    """Per-pair angular frequency [n_rot/2], float64."""
    n = cfg.n_rot
    i = torch.arange(n // 2, dtype=torch.float64)
    if not compressed:
        return cfg.rope_base ** (-2 * i / n)
    base = cfg.compress_rope_base
    f_ext = base ** (-2 * i / n)
    f_int = f_ext / cfg.rope_scale

    def corr(beta: float) -> float:
        return n * math.log(cfg.rope_orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))

    lo = max(0, math.floor(corr(cfg.yarn_beta_fast)))
    hi = min(n - 1, math.ceil(corr(cfg.yarn_beta_slow)))
    ramp = 1 - torch.clamp((i - lo) / max(0.001, hi - lo), 0, 1)
    return f_int * (1 - ramp) + f_ext * ramp


def rope_cos_sin(freq: torch.Tensor, pos: torch.Tensor):
    """cos, sin of the angles pos * freq: [*pos.shape, n_rot/2], computed in float64."""
    ang = pos.to(torch.float64)[..., None] * freq.to(pos.device)
    return torch.cos(ang), torch.sin(ang)


def apply_rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] dims of x in adjacent pairs.

    x: [..., w]; cos/sin broadcastable to [..., n_rot/2] (e.g. [T, 1, n_rot/2] for x [T, H, w]).
    """
    n_rot = 2 * cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    head, tail = x[..., :-n_rot], x[..., -n_rot:]
    pairs = tail.reshape(*tail.shape[:-1], n_rot // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    if inverse:
        sin = -sin
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    return torch.cat([head, torch.stack([r0, r1], dim=-1).reshape(tail.shape)], dim=-1)
