"""A step function bound to the one CacheState it reads and writes:

    steps = Steps(model, cache)
    logits, hc, rows = steps.run(tokens, h=None, last_only=False)   # propose: reads the cache, writes nothing
    (run(..., graph=False): a shape seen once, such as the drafter's catch-up; a graph backend runs it eagerly)
    steps.prepare(T, last_only, h, first, end)                       # a graph backend captures that shape now
    steps.commit(rows, n)                                            # write the first n rows, advance the cache
    logits, hc = steps.prefill(tokens, h=None)                       # a prefill chunk: run (last row's logits) and
                                                                     # commit of every row in one call (a graph
                                                                     # backend replays whole chunks from a graph)

With min_bound (the CUDA backend's), a step reads the compressed caches cut to the rows of positions below its
bound (the end of the step rounded up to a power of two, at least min_bound: `bound`, `layers`), so that its cost
follows the context used, not the cache's capacity; the rows cut off are never visible to it.

`model` is the target (Transformer.forward signature) or the MTP head (MTPHead.forward: it also takes h).
This eager version calls them directly; backends/cuda.py replays the same two calls from CUDA graphs.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ds4trt.model.attention import indexer_needed
from ds4trt.model.state import LayerCache
from ds4trt.runtime.cache import CacheState


class Steps:
    def __init__(self, model, cache: CacheState, min_bound: int | None = None):
        """min_bound: None reads the whole caches (the exported engines' fixed shapes need them), else the
        smallest bound of a step's compressed rows (`bound`)."""
        self.model, self.cache, self.min_bound = model, cache, min_bound
        self.device = cache.layers[0].raw.device
        self.cut: dict[int, list[LayerCache]] = {}         # bound -> the layers' views (layers)

    def run(self, tokens: list[int], h: torch.Tensor | None = None, last_only: bool = False, graph: bool = True):
        """tokens at positions cache.pos..; h: [T, S, D] for the MTP head. -> logits [T or 1, V], hc [T, S, D], rows.
        The indexer runs only where some token sees more than top-k compressed rows (indexer_needed)."""
        t = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        args = (t,) if h is None else (t, h)
        return self.model(*args, self.cache.start(), self.layers(self.bound(len(tokens))), last_only=last_only,
                          indexer=self.indexer(len(tokens)))

    def indexer(self, T: int, pos: int | None = None) -> bool:
        """Whether a step of T tokens from position pos (default: the cache's) needs the indexer (never for caches
        without ratio-4 layers, such as the MTP block's)."""
        return 4 in self.cache.ratios and indexer_needed(self.cache.cfg, (self.cache.pos if pos is None else pos) + T)

    def bound(self, T: int, pos: int | None = None) -> int:
        """The positions whose compressed rows a step of T tokens from position pos (default: the cache's) may read
        are those below this bound: the step's end rounded up to a power of two, at least min_bound, at most the
        context (the context without min_bound, or for caches without compressed rows, such as the MTP block's)."""
        end = (self.cache.pos if pos is None else pos) + T
        if self.min_bound is None or not any(self.cache.ratios):
            return self.cache.ctx
        return min(self.cache.ctx, max(self.min_bound, 1 << (end - 1).bit_length()))

    def layers(self, bound: int) -> list[LayerCache]:
        """The cache's layers with each compressed cache (comp, index) cut to its first bound // R + 1 rows (a
        position p < bound sees rows below p // R; one more keeps a cut of 2 rows or more, which torch.compile does
        not specialize): views, made once per bound, their row count marked dynamic for torch.compile (one compiled
        step serves every bound; a recompile only where the count crosses a shape test of the step, such as the
        CUDA backend's top_rows_kernel's); the whole layers for the context."""
        if bound >= self.cache.ctx:
            return self.cache.layers
        if bound not in self.cut:
            self.cut[bound] = [c if not r else replace(c, comp=c.comp[:bound // r + 1],
                                                       index=None if c.index is None else c.index[:bound // r + 1])
                               for c, r in zip(self.cache.layers, self.cache.ratios)]
            for c in self.cut[bound]:
                for t in (c.comp, c.index):
                    if t is not None:
                        torch._dynamo.maybe_mark_dynamic(t, 0)
        return self.cut[bound]

    def kinds(self, T: int, first: int = 0, end: int | None = None) -> list[tuple[bool, int]]:
        """The (indexer flag, bound) pairs that steps of T tokens starting at position `first` or later and ending
        by `end` (default, and at most: the cache's context) can have, in order. Both grow with the step's end, so
        they change only where one does: at the first and last end, where the indexer starts, and past each
        power of two."""
        end = self.cache.ctx if end is None else min(end, self.cache.ctx)
        lo = min(first + T, end)
        ends = {lo, end, 4 * (self.cache.cfg.index_top_k + 1)} | {1 << b for b in range(end.bit_length() + 1)}
        return sorted({(self.indexer(T, e - T), self.bound(T, e - T)) for e in ends | {e + 1 for e in ends}
                       if lo <= e <= end})

    def prepare(self, T: int, last_only: bool, h: torch.Tensor | None = None, first: int = 0,
                end: int | None = None) -> int:
        """Make ready what run(T tokens, last_only[, h]) and its commits need from position `first` on, up to
        `end` (a graph backend captures them, for each of kinds): nothing here, the eager steps run as they
        come. Returns the graphs captured: 0."""
        return 0

    def commit(self, rows, n: int) -> None:
        self.cache.commit(rows, n)

    def prefill(self, tokens: list[int], h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A prefill chunk: run(tokens, h, last_only=True, graph=False), then commit of all its rows -> logits [1, V]
        after its last token, hc [T, S, D] (a graph backend may replay the whole of it from one graph)."""
        logits, hc, rows = self.run(tokens, h, last_only=True, graph=False)
        self.commit(rows, len(tokens))
        return logits, hc
