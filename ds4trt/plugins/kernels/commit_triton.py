"""A step's accepted cache rows written by one kernel: the CUDA form of runtime/cache.py CacheState.write.

    plan = CommitPlan.build(cache.layers, cache.ratios, rows, n)  # None where some rows are not contiguous
    plan.load(start)                          # compiles the kernel, copies nothing (before a graph capture)
    plan.write(start)                         # start: 0-d int64 device tensor, the first committed position

CacheState.write makes each group of cache tensors' slot indices and index_copy_ with PyTorch ops: ~37 kernels per
committed step on the GPU. Here one table, built once per captured commit graph (the step's row tensors and the cache
tensors keep their addresses for the graphs' lifetime), holds per (layer, cache tensor) entry the source rows, the
destination and its slot rule, and one launch of program (entry, row i) copies source row i to its slot, by the rules
of CacheState.write for the position p = start + i:
  rings (the raw window, the compressors' state): slot p % cap, only for the last min(n, cap) rows;
  compressed rows (comp, index): slot (p + 1) / R - 1 where (p + 1) % R == 0, else the spare last row (cap - 1),
  which no position reads.
Rows are copied as 32-bit words, so any dtype whose rows hold whole words (the CUDA backend's float32) works.

Table (int64 [entries, 8]): source address, source row stride, destination address, destination row stride (strides
in words), row width in words, cap, R (0: a ring), first source row to copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ds4trt.model.state import EMITTED, LayerCache, LayerRows
from ds4trt.plugins.kernels.pdl import pdl_enter, pdl_launch


@triton.jit
def _commit_rows(table_ptr, start_ptr, MAXW: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    entry = table_ptr + tl.program_id(0) * 8
    i = tl.program_id(1)
    if i < tl.load(entry + 7):                    # rows before a ring's last cap ones: later rows take their slots
        return
    src = tl.load(entry).to(tl.pointer_type(tl.int32))
    dst = tl.load(entry + 2).to(tl.pointer_type(tl.int32))
    cap, ratio = tl.load(entry + 5), tl.load(entry + 6)
    p = tl.load(start_ptr) + i
    r = tl.maximum(ratio, 1)
    slot = tl.where(ratio == 0, p % cap, tl.where((p + 1) % r == 0, (p + 1) // r - 1, cap - 1))
    w = tl.arange(0, MAXW)
    live = w < tl.load(entry + 4)
    row = tl.load(src + i * tl.load(entry + 1) + w, mask=live)
    tl.store(dst + slot * tl.load(entry + 3) + w, row, mask=live)


def _words(t: torch.Tensor) -> tuple[int, int] | None:
    """(row stride, row width) in 32-bit words of a 2-d tensor with contiguous, word-aligned rows, else None."""
    size = t.element_size()
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[1] * size) % 4 or (t.stride(0) * size) % 4 or t.data_ptr() % 4:
        return None
    return t.stride(0) * size // 4, t.shape[1] * size // 4


@dataclass
class CommitPlan:
    """One commit shape (the rows of one step, n of them accepted) of one cache: its table on the cache's device."""
    table: torch.Tensor
    n: int
    maxw: int

    @classmethod
    def build(cls, layers: list[LayerCache], ratios: list[int], rows: list[LayerRows], n: int) -> "CommitPlan | None":
        """The plan of writing rows 0..n-1 of `rows` into `layers` (CacheState.layers, .ratios); None when some row
        tensor does not have contiguous rows (the caller then writes with CacheState.write)."""
        entries = []
        for cache, ratio, new in zip(layers, ratios, rows):
            for name, t in cache.tensors().items():
                src = getattr(new, name)
                if src is None or src.dtype != t.dtype or src.device != t.device or src.shape[1] != t.shape[1] \
                        or src.shape[0] < n:
                    raise ValueError(f"commit_triton: rows.{name} {None if src is None else list(src.shape)} do not "
                                     f"fit the cache tensor {list(t.shape)} {t.dtype} for {n} rows")
                src_words, dst_words = _words(src), _words(t)
                if src_words is None or dst_words is None:
                    return None
                (s_stride, width), (d_stride, _) = src_words, dst_words
                cap = t.shape[0]
                compressed = name in EMITTED
                lo = 0 if compressed else n - min(n, cap)
                entries.append((src.data_ptr(), s_stride, t.data_ptr(), d_stride, width, cap,
                                ratio if compressed else 0, lo))
        device = layers[0].raw.device
        table = torch.tensor(entries, dtype=torch.int64, device=device)
        return cls(table, n, triton.next_power_of_2(max(e[4] for e in entries)))

    def load(self, start: torch.Tensor) -> None:
        """Launch the kernel once without copying a row (every entry's first row set past n): compiles and loads it,
        so that capturing write() in a CUDA graph launches nothing new."""
        dry = self.table.clone()
        dry[:, 7] = self.n
        _commit_rows[(dry.shape[0], self.n)](dry, start, MAXW=self.maxw, num_warps=4, **pdl_launch(dry.device))

    def write(self, start: torch.Tensor) -> None:
        """Rows 0..n-1 to positions start..start+n-1 (start: 0-d int64 on the table's device), as CacheState.write."""
        _commit_rows[(self.table.shape[0], self.n)](self.table, start, MAXW=self.maxw, num_warps=4,
                                                     **pdl_launch(self.table.device))
