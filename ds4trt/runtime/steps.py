"""A step function bound to the one CacheState it reads and writes:

    steps = Steps(model, cache)
    logits, hc, rows = steps.run(tokens, h=None, last_only=False)   # propose: reads the cache, writes nothing
    (run(..., graph=False): a one-off shape such as a prefill chunk; a graph backend runs it eagerly)
    steps.prepare(T, last_only, h, first, end)                       # a graph backend captures that shape now
    steps.commit(rows, n)                                            # write the first n rows, advance the cache

`model` is the target (Transformer.forward signature) or the MTP head (MTPHead.forward: it also takes h).
This eager version calls them directly; backends/cuda.py replays the same two calls from CUDA graphs.
"""

from __future__ import annotations

import torch

from ds4trt.model.attention import indexer_needed
from ds4trt.runtime.cache import CacheState


class Steps:
    def __init__(self, model, cache: CacheState):
        self.model, self.cache = model, cache
        self.device = cache.layers[0].raw.device

    def run(self, tokens: list[int], h: torch.Tensor | None = None, last_only: bool = False, graph: bool = True):
        """tokens at positions cache.pos..; h: [T, S, D] for the MTP head. -> logits [T or 1, V], hc [T, S, D], rows.
        The indexer runs only where some token sees more than top-k compressed rows (indexer_needed)."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        args = (t,) if h is None else (t, h)
        return self.model(*args, self.cache.start(), self.cache.layers, last_only=last_only,
                          indexer=self.indexer(len(tokens)))

    def indexer(self, T: int, pos: int | None = None) -> bool:
        """Whether a step of T tokens from position pos (default: the cache's) needs the indexer (never for caches
        without ratio-4 layers, such as the MTP block's)."""
        return 4 in self.cache.ratios and indexer_needed(self.cache.cfg, (self.cache.pos if pos is None else pos) + T)

    def indexer_flags(self, T: int, first: int = 0, end: int | None = None) -> list[bool]:
        """The indexer flags that steps of T tokens starting at position `first` or later and ending by `end`
        (default, and at most: the cache's context) can have, in order."""
        end = self.cache.ctx if end is None else min(end, self.cache.ctx)
        return sorted({self.indexer(T, first), self.indexer(T, max(first, end - T))})

    def prepare(self, T: int, last_only: bool, h: torch.Tensor | None = None, first: int = 0,
                end: int | None = None) -> int:
        """Make ready what run(T tokens, last_only[, h]) and its commits need from position `first` on, up to
        `end` (a graph backend captures them, for each of indexer_flags): nothing here, the eager steps run as they
        come. Returns the graphs captured: 0."""
        return 0

    def commit(self, rows, n: int) -> None:
        self.cache.commit(rows, n)
