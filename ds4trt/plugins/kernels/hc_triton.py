"""The hyper-connection mixing weights in one Triton kernel (model/hc.py hc_mix): per token, from the S*(2+S)
mixer outputs m, the pre and post weights and the S x S combination matrix after the Sinkhorn iterations.

    hc_mix_triton(m [T, (2+S)*S] f32, scale [3], base [(2+S)*S], S, hc_eps, iters) -> pre [T, S], post [T, S],
                                                                                      comb [T, S, S]

One program per token keeps the S x S matrix in registers for all the iterations: the eager PyTorch version is
about 2 * iters small kernels (each row or column normalisation is one reduction), ~40 launches per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_mix(m_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, hc_eps, ITERS: tl.constexpr, S: tl.constexpr):
    t = tl.program_id(0)
    M: tl.constexpr = (2 + S) * S
    i = tl.arange(0, S)
    row = m_ptr + t * M
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(tl.load(row + i) * s0 + tl.load(base_ptr + i)) + hc_eps
    post = 2 * tl.sigmoid(tl.load(row + S + i) * s1 + tl.load(base_ptr + S + i))
    ab = 2 * S + i[:, None] * S + i[None, :]                     # [S, S]: source a, destination b
    logits = tl.load(row + ab) * s2 + tl.load(base_ptr + ab)
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = e / tl.sum(e, axis=1)[:, None] + hc_eps               # softmax over b
    comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)       # columns
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)   # rows
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)   # columns
    tl.store(pre_ptr + t * S + i, pre)
    tl.store(post_ptr + t * S + i, post)
    tl.store(comb_ptr + t * S * S + (ab - 2 * S), comb)


def hc_mix_triton(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, S: int, hc_eps: float, iters: int):
    """model/hc.py hc_mix for float32 inputs; S must be a power of two (DeepSeek V4: 4)."""
    T = m.shape[0]
    if S & (S - 1) or m.shape != (T, (2 + S) * S) or m.dtype != torch.float32 or iters < 1:
        raise ValueError(f"hc_mix_triton: expected float32 [T, {(2 + S) * S}] with S a power of two and iters >= 1, "
                         f"got {m.dtype} {list(m.shape)}, S = {S}, iters = {iters}")
    m, scale, base = m.contiguous(), scale.float().contiguous(), base.float().contiguous()
    pre = torch.empty(T, S, dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty(T, S, S, dtype=torch.float32, device=m.device)
    if T:
        _hc_mix[(T,)](m, scale, base, pre, post, comb, float(hc_eps), ITERS=iters, S=S, num_warps=1)
    return pre, post, comb
