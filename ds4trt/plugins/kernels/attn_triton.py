"""Attention of a decode or verify step in one Triton kernel (model/attention.py attend): per query row and head,
softmax over the visible keys and the head's sink logit, then the weighted sum of the keys (V = K).

    attend_triton(q [T, H, d] f32, k [K, d] f32, mask [T, K] bool, sinks [H] f32) -> o [T, H, d]
        T <= MAX_T (the compiled step's attention was 4-5 launches, ~15 us per layer at Flash width).

One program per (query row, block of HB heads) streams the keys in chunks of KB (online softmax, float32 FMA
products: input_precision="ieee"). The running maximum starts at the sink logit with weight 1, so a chunk whose
keys are all masked adds nothing and no row divides by zero. Heads past H and dims past d are masked (tiny models).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_T = 16       # attend_triton's query limit (decode and verify steps)
HB = 16          # heads per program (tl.dot's smallest tile side)
KB = 16          # keys per chunk


@triton.jit
def _attend(q_ptr, k_ptr, m_ptr, s_ptr, o_ptr, scale, K: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            HB: tl.constexpr, KB: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * HB + tl.arange(0, HB)
    c = tl.arange(0, DP)
    hm, cm = h < H, c < D
    q = tl.load(q_ptr + (t * H + h)[:, None] * D + c[None, :], mask=hm[:, None] & cm[None, :], other=0.0)  # [HB, DP]
    run_max = tl.load(s_ptr + h, mask=hm, other=0.0)              # the sink logit: weight exp(sink - max) = 1
    run_sum = tl.full([HB], 1.0, tl.float32)
    acc = tl.zeros([HB, DP], tl.float32)
    for k0 in range(0, K, KB):
        kk = k0 + tl.arange(0, KB)
        km = kk < K
        keys = tl.load(k_ptr + kk[:, None] * D + c[None, :], mask=km[:, None] & cm[None, :], other=0.0)   # [KB, DP]
        vis = tl.load(m_ptr + t * K + kk, mask=km, other=0) != 0
        s = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale                                   # [HB, KB]
        s = tl.where(vis[None, :], s, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(s, axis=1))
        alpha = tl.exp(run_max - new_max)
        p = tl.exp(s - new_max[:, None])
        run_sum = run_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, keys, input_precision="ieee")
        run_max = new_max
    o = acc / run_sum[:, None]
    tl.store(o_ptr + (t * H + h)[:, None] * D + c[None, :], o, mask=hm[:, None] & cm[None, :])


def attend_triton(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """model/attention.py attend for float32 q [T, H, d] (T <= MAX_T), keys k [K, d], mask bool [T, K]."""
    T, H, D = q.shape
    K = k.shape[0]
    if not 1 <= T <= MAX_T or q.dtype != torch.float32 or k.dtype != torch.float32 or k.shape != (K, D) \
            or mask.shape != (T, K) or mask.dtype != torch.bool or sinks.shape != (H,):
        raise ValueError(f"attend_triton: expected float32 q [1..{MAX_T}, H, d], k [K, d], bool mask [T, K] and "
                         f"sinks [H], got q {q.dtype} {list(q.shape)}, k {k.dtype} {list(k.shape)}, "
                         f"mask {mask.dtype} {list(mask.shape)}, sinks {list(sinks.shape)}")
    q, k = q.contiguous(), k.contiguous()
    m = mask.contiguous().view(torch.uint8)
    o = torch.empty_like(q)
    _attend[(T, triton.cdiv(H, HB))](q, k, m, sinks.float().contiguous(), o, D ** -0.5, K=K, H=H, D=D,
                                     DP=triton.next_power_of_2(D), HB=HB, KB=KB, num_warps=8)
    return o
