"""The KV / compressor caches of one session: preallocated for a context size, written only on commit.

The step functions (model/transformer.py, model/mtp.py) read these tensors and propose rows; `commit`
writes the rows of an accepted prefix. Nothing else writes a cache, so rejected speculative rows are
never stored. Layout and indexing: model/state.py.
"""

from __future__ import annotations

import torch

from ds4trt.model.config import ModelConfig
from ds4trt.model.state import NEG, LayerCache, LayerRows


class CacheState:
    def __init__(self, cfg: ModelConfig, ctx: int, n_layers: int | None = None, ratios=None, device="cpu",
                 dtype=torch.float32):
        """Caches for `ctx` positions. `ratios` overrides the per-layer compress ratios (the MTP block
        is one ratio-0 layer)."""
        self.cfg, self.ctx = cfg, ctx
        ratios = list(cfg.compress_ratios if ratios is None else ratios)[: n_layers or cfg.n_layer]
        self.ratios = ratios
        self.pos = 0                     # committed tokens
        d, di = cfg.head_dim, cfg.index_head_dim
        raw_cap = max(1, cfg.window - 1)
        z = lambda *shape: torch.zeros(*shape, device=device, dtype=dtype)  # noqa: E731
        self.layers: list[LayerCache] = []
        for r in ratios:
            c = LayerCache(raw=z(raw_cap, d))
            if r:
                coff = 2 if r == 4 else 1
                c.comp = z(ctx // r + 1, d)
                c.comp_kv = z(coff * r, coff * d)
                c.comp_score = torch.full((coff * r, coff * d), NEG, device=device, dtype=dtype)
            if r == 4:
                c.index = z(ctx // 4 + 1, di)
                c.index_kv = z(8, 2 * di)
                c.index_score = torch.full((8, 2 * di), NEG, device=device, dtype=dtype)
            self.layers.append(c)

    def start(self) -> torch.Tensor:
        return torch.tensor(self.pos, dtype=torch.int64, device=self.layers[0].raw.device)

    def commit(self, rows: list[LayerRows], n: int) -> None:
        """Write the first n proposed rows (positions pos..pos+n-1) of every layer; advance pos by n."""
        if n <= 0:
            return
        if self.pos + n > self.ctx:
            raise ValueError(f"commit of {n} tokens at position {self.pos} exceeds the context size {self.ctx}")
        pos = torch.arange(self.pos, self.pos + n, device=self.layers[0].raw.device)
        for cache, r, ratio in zip(self.layers, rows, self.ratios):
            cache.raw[pos % cache.raw.shape[0]] = r.raw[:n]      # later positions win on slot reuse
            if ratio:
                slots = pos % cache.comp_kv.shape[0]
                cache.comp_kv[slots] = r.comp_kv[:n]
                cache.comp_score[slots] = r.comp_score[:n]
                emit = torch.nonzero((pos + 1) % ratio == 0).flatten()
                cache.comp[(pos[emit] + 1) // ratio - 1] = r.comp[emit]
            if ratio == 4:
                slots = pos % 8
                cache.index_kv[slots] = r.index_kv[:n]
                cache.index_score[slots] = r.index_score[:n]
                cache.index[(pos[emit] + 1) // 4 - 1] = r.index[emit]
        self.pos += n

    def clone(self) -> "CacheState":
        """An independent copy (the MTP drafter's scratch ring for recursive drafts)."""
        other = object.__new__(CacheState)
        other.__dict__.update(self.__dict__)
        other.layers = [LayerCache(**{k: v.clone() for k, v in c.tensors().items()}) for c in self.layers]
        return other

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every cache tensor by a stable name (for equality tests and device-buffer backends)."""
        return {f"{l}.{k}": v for l, c in enumerate(self.layers) for k, v in c.tensors().items()}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Only the rows that committed tokens define (what sequential decoding must agree on)."""
        out = {}
        p = self.pos
        for l, (c, r) in enumerate(zip(self.layers, self.ratios)):
            W = c.raw.shape[0]
            prev = torch.arange(max(0, p - W), p)
            out[f"{l}.raw"] = c.raw[prev % W]
            if r:
                out[f"{l}.comp"] = c.comp[: p // r]
                coff = 2 if r == 4 else 1
                live = torch.arange(max(0, (p // r - coff + 1) * r), p)
                out[f"{l}.comp_kv"] = c.comp_kv[live % (coff * r)]
                out[f"{l}.comp_score"] = c.comp_score[live % (coff * r)]
            if r == 4:
                out[f"{l}.index"] = c.index[: p // 4]
                live = torch.arange(max(0, (p // 4 - 1) * 4), p)
                out[f"{l}.index_kv"] = c.index_kv[live % 8]
                out[f"{l}.index_score"] = c.index_score[live % 8]
        return out
