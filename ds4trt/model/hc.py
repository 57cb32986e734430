"""Hyper-connections: the residual stream is S parallel copies (spec §3.2, §3.3, §3.8).

Shapes: T tokens, S streams, D width. X: [T, S, D].
"""

from __future__ import annotations

import torch

from ds4trt.model.numerics import rms_norm


def hc_pre(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           rms_eps: float, hc_eps: float, sinkhorn_iters: int, norm: torch.Tensor):
    """Reduce S streams to one sublayer input y (hc_sum_streams) and RMS-norm it with the sublayer's norm weight
    (its first operation: attn_norm, ffn_norm). norm: [D] -> rms_norm(y, norm) [T, D], post [T, S], comb [T, S, S]"""
    y, post, comb = hc_sum_streams(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return rms_norm(y, norm, rms_eps), post, comb


def hc_sum_streams(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                   rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    """The mixer's weights of the S streams and their weighted sum y = sum_s pre[s] X[s].

    X: [T, S, D]; fn: [(2+S)*S, S*D]; scale: [3]; base: [(2+S)*S]
    returns y [T, D], post [T, S], comb [T, S, S] (comb[t, a, b]: source stream a -> destination b)
    """
    T, S, D = X.shape
    n = rms_norm(X.reshape(T, S * D), None, rms_eps)
    m = n @ fn.T                                                    # [T, (2+S)*S]
    pre, post, comb = hc_mix(m, scale, base, S, hc_eps, sinkhorn_iters)
    return (pre[:, :, None] * X).sum(dim=1), post, comb


def hc_mix(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, hc_eps: float, sinkhorn_iters: int):
    """The mixer outputs m [T, (2+S)*S] -> pre [T, S], post [T, S], comb [T, S, S] (Sinkhorn-normalised)."""
    T = m.shape[0]
    pre = torch.sigmoid(m[:, :S] * scale[0] + base[:S]) + hc_eps
    post = 2 * torch.sigmoid(m[:, S:2 * S] * scale[1] + base[S:2 * S])
    logits = (m[:, 2 * S:] * scale[2] + base[2 * S:]).reshape(T, S, S)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'[b] = post[b] * f + sum_a comb[a, b] * X[a].   f: [T, D], X: [T, S, D] -> [T, S, D]
    The sum over the S (= 4) source streams is written out: a compiler fuses it with the post term into one
    elementwise kernel (as a batched matrix product it was a cuBLAS GEMM plus a kernel for the rest)."""
    out = post[:, :, None] * f[:, None, :]
    for a in range(X.shape[1]):
        out = out + comb[:, a, :, None] * X[:, a, None, :]
    return out


def hc_post_pre(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                scale: torch.Tensor, base: torch.Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                norm: torch.Tensor):
    """A sublayer's update of the streams (hc_post of its output f), then the next connection's reduction of them
    (hc_pre with its fn, scale, base, norm) -> X' [T, S, D], the next sublayer's normed input [T, D], post [T, S],
    comb [T, S, S] (a backend may do both in fewer passes over the streams)."""
    X = hc_post(f, X, post, comb)
    return (X, *hc_pre(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm))


def hc_collapse(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
                rms_eps: float, hc_eps: float) -> torch.Tensor:
    """The output head's stream collapse: sigmoid weights, no Sinkhorn.  X: [T, S, D] -> [T, D]"""
    T, S, D = X.shape
    n = rms_norm(X.reshape(T, S * D), None, rms_eps)
    w = torch.sigmoid((n @ fn.T) * scale[0] + base) + hc_eps      # [T, S]
    return (w[:, :, None] * X).sum(dim=1)
