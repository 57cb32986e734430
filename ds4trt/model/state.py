"""What one model step reads and what it proposes to write, per layer.

A step is a pure function of (new tokens, their start position, read-only caches). It returns the rows
it *would* append; the runtime commits any prefix of them (runtime/cache.py). Rollback is "don't write".

Every cache is indexed by absolute position, so it holds exactly what sequential decoding of the
committed tokens would hold:
  raw      ring of `raw_cap` (>= window - 1) rows, position p at slot p % raw_cap
  comp     compressed rows, row c covers block [R*c, R*c + R); n_comp = committed // R
  comp_kv/comp_score   compressor inputs of the current (and, for ratio 4, previous) block,
                       position p at slot p % (coff * R); empty slots have score NEG
  index*   the same for the indexer lane of ratio-4 layers (width index_head_dim)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ds4trt.model.config import ModelConfig

NEG = -1e30  # "minus infinity" for compressor scores: exp(NEG - m) == 0, and never NaN
EMITTED = ("comp", "index")  # LayerCache fields written only by emitting positions; the others are rings


@dataclass
class LayerCache:
    raw: torch.Tensor                        # [raw_cap, d]
    comp: torch.Tensor | None = None         # [comp_cap, d]           ratio != 0
    comp_kv: torch.Tensor | None = None      # [coff*R, coff*d]        ratio != 0
    comp_score: torch.Tensor | None = None   # [coff*R, coff*d]
    index: torch.Tensor | None = None        # [comp_cap, di]          ratio == 4
    index_kv: torch.Tensor | None = None     # [8, 2*di]
    index_score: torch.Tensor | None = None  # [8, 2*di]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass
class LayerRows:
    """The rows a step proposes, one per new token (T rows each)."""
    raw: torch.Tensor                        # [T, d]   post-RoPE, post-rounding K=V rows
    comp: torch.Tensor | None = None         # [T, d]   row emitted by token t (zero unless (p+1) % R == 0)
    comp_kv: torch.Tensor | None = None      # [T, coff*d]
    comp_score: torch.Tensor | None = None   # [T, coff*d]
    index: torch.Tensor | None = None        # [T, di]
    index_kv: torch.Tensor | None = None     # [T, 2*di]
    index_score: torch.Tensor | None = None  # [T, 2*di]


def cache_shapes(cfg: ModelConfig, ctx: int, ratios) -> list[dict[str, tuple[int, int]]]:
    """Per layer of the given compress ratios, the shapes of its LayerCache tensors for `ctx` positions, in
    LayerCache field order (comp and index have one spare last row: CacheState.write)."""
    d, di = cfg.head_dim, cfg.index_head_dim
    out = []
    for r in ratios:
        s = {"raw": (max(1, cfg.window - 1), d)}
        if r:
            coff = 2 if r == 4 else 1
            s |= {"comp": (ctx // r + 1, d), "comp_kv": (coff * r, coff * d), "comp_score": (coff * r, coff * d)}
        if r == 4:
            s |= {"index": (ctx // 4 + 1, di), "index_kv": (8, 2 * di), "index_score": (8, 2 * di)}
        out.append(s)
    return out
