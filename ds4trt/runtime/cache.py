"""The KV / compressor caches of one session: preallocated for a context size, written only on commit.

The step functions (model/transformer.py, model/mtp.py) read these tensors and propose rows; `commit`
writes the rows of an accepted prefix. Nothing else writes a cache, so rejected speculative rows are
never stored. Layout and indexing: model/state.py.
"""

from __future__ import annotations

import torch

from ds4trt.model.config import ModelConfig
from ds4trt.model.state import NEG, LayerCache, LayerRows, cache_shapes


class CacheState:
    def __init__(self, cfg: ModelConfig, ctx: int, n_layers: int | None = None, ratios=None, device="cpu",
                 dtype=torch.float32):
        """Caches for `ctx` positions. `ratios` overrides the per-layer compress ratios (the MTP block
        is one ratio-0 layer)."""
        self.cfg, self.ctx = cfg, ctx
        ratios = list(cfg.compress_ratios if ratios is None else ratios)[: n_layers or cfg.n_layer]
        self.ratios = ratios
        self.layers = [LayerCache(**{name: torch.empty(shape, device=device, dtype=dtype)
                                     for name, shape in layer.items()}) for layer in cache_shapes(cfg, ctx, ratios)]
        self.reset()

    def start(self) -> torch.Tensor:
        return torch.tensor(self.pos, dtype=torch.int64, device=self.layers[0].raw.device)

    def commit(self, rows: list[LayerRows], n: int) -> None:
        """Write the first n proposed rows (positions pos..pos+n-1) of every layer; advance pos by n."""
        if n <= 0:
            return
        start = self.start()
        self.advance(n)
        self.write(rows, n, start)

    def advance(self, n: int) -> None:
        """Count n more committed tokens (their rows written by `write`)."""
        if self.pos + n > self.ctx:
            raise ValueError(f"commit of {n} tokens at position {self.pos} exceeds the context size {self.ctx}")
        self.pos += n

    def write(self, rows: list[LayerRows], n: int, start: torch.Tensor) -> None:
        """The tensor half of commit: rows 0..n-1 to positions start..start+n-1 (start: 0-d int64 tensor).
        No host synchronization and fixed shapes for a given n, so a CUDA graph can capture it.
        Where n exceeds a ring, only its last rows are written (later positions win a slot). Non-emitting
        positions send their (zero) compressed row to the spare last row, which no position ever reads."""
        pos = start + torch.arange(n, device=start.device)                       # [n]
        last = lambda t, k: (pos[n - min(n, k):] % k, t[n - min(n, k):n])  # noqa: E731
        for cache, r, ratio in zip(self.layers, rows, self.ratios):
            cache.raw.index_copy_(0, *last(r.raw, cache.raw.shape[0]))
            if ratio:
                slots = cache.comp_kv.shape[0]
                cache.comp_kv.index_copy_(0, *last(r.comp_kv, slots))
                cache.comp_score.index_copy_(0, *last(r.comp_score, slots))
                cache.comp.index_copy_(0, self._emit_rows(pos, ratio, cache.comp.shape[0]), r.comp[:n])
            if ratio == 4:
                cache.index_kv.index_copy_(0, *last(r.index_kv, 8))
                cache.index_score.index_copy_(0, *last(r.index_score, 8))
                cache.index.index_copy_(0, self._emit_rows(pos, 4, cache.index.shape[0]), r.index[:n])

    @staticmethod
    def _emit_rows(pos: torch.Tensor, ratio: int, cap: int) -> torch.Tensor:
        """Compressed row written by each position: (p+1)/R - 1 where (p+1) % R == 0, else the spare row cap-1."""
        return torch.where((pos + 1) % ratio == 0, torch.div(pos + 1, ratio, rounding_mode="floor") - 1, cap - 1)

    def reset(self) -> None:
        """Back to no tokens (empty compressor slots score NEG), in place: the buffers keep their addresses, so
        captured CUDA graphs stay valid."""
        for c in self.layers:
            for name, t in c.tensors().items():
                t.fill_(NEG if name.endswith("_score") else 0.0)
        self.pos = 0                     # committed tokens

    def copy_from(self, other: "CacheState") -> None:
        """Become a copy of `other` (same shapes), in place."""
        for a, b in zip(self.layers, other.layers):
            for name, t in a.tensors().items():
                t.copy_(getattr(b, name))
        self.pos = other.pos

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
