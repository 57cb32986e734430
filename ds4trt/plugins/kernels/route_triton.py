"""The router's expert choice in Triton (model/moe.py route, biased top-k layers), for steps and prefill chunks alike:

    route_triton(logits [T, E] f32, bias [E] f32, k, scale, floor) -> ids [T, k] int64, weights [T, k] f32

One launch, one program per token row: probs = sqrt(softplus(logits)) for all E experts in registers, then k
rounds of "the largest probs + bias, the lowest id among equal ones" (what route's stable descending sort keeps
first), each chosen expert masked out for the next round; the weights are the chosen probs scaled by
scale / max(their sum, floor). In the compiled PyTorch step the same routing was two Inductor kernels
(a per-row sort of the 256 experts, 4.4 us, and the gather + normalisation, 2.5 us, per layer at Flash width on
the H200: the 43-layer trace in BENCHMARKS.md). Hash-routed layers take their ids from a table and stay in PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch

@triton.jit
def _route_rows(x_ptr, b_ptr, ids_ptr, w_ptr, scale, floor, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                KP: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0)
    e = tl.arange(0, EP)
    em = e < E
    x = tl.load(x_ptr + t * E + e, mask=em, other=0.0)
    # torch's softplus: log1p(exp(x)), x itself above 20; log1p(y) as log(u) * y / (u - 1), u = 1 + y (exact to a
    # few ulps where log(1 + y) alone would lose y's low bits)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    soft = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    probs = tl.sqrt(tl.where(x > 20.0, x, soft))                                                    # [EP]
    sel = tl.where(em, probs + tl.load(b_ptr + e, mask=em, other=0.0), float("-inf"))
    slot = tl.arange(0, KP)
    ids = tl.zeros([KP], tl.int32)
    w = tl.zeros([KP], tl.float32)
    for i in range(K):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, EP), axis=0)                  # the lowest id among equal maxima
        ids = tl.where(slot == i, pick, ids)
        w = tl.where(slot == i, tl.sum(tl.where(e == pick, probs, 0.0), axis=0), w)
        sel = tl.where(e == pick, float("-inf"), sel)
    w = w * (scale / tl.maximum(tl.sum(w, axis=0), floor))
    tl.store(ids_ptr + t * K + slot, ids.to(tl.int64), mask=slot < K)
    tl.store(w_ptr + t * K + slot, w, mask=slot < K)


def route_triton(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float,
                 floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """model/moe.py route for a biased layer: float32 logits [T, E], bias [E] -> ids [T, k] int64, weights [T, k]
    float32 (floor: route's WEIGHT_SUM_FLOOR)."""
    T, E = logits.shape
    if T < 1 or not 1 <= k <= E or logits.dtype != torch.float32 or bias.shape != (E,):
        raise ValueError(f"route_triton: expected float32 logits [T >= 1, E], bias [E] and 1 <= k <= E, got "
                         f"logits {logits.dtype} {list(logits.shape)}, bias {list(bias.shape)}, k {k}")
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    _route_rows[(T,)](logits.contiguous(), bias.float().contiguous(), ids, w, scale, floor, E=E,
                      EP=triton.next_power_of_2(E), K=k, KP=triton.next_power_of_2(k), num_warps=1,
                      **pdl_launch(logits.device))
    return ids, w
