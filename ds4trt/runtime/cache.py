"""The KV / compressor caches of one session: preallocated for a context size, written only on commit.

The step functions (model/transformer.py, model/mtp.py) read these tensors and propose rows; `commit`
writes the rows of an accepted prefix. Nothing else writes a cache, so rejected speculative rows are
never stored. Layout and indexing: model/state.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4trt.model.config import ModelConfig
from ds4trt.model.state import EMITTED, NEG, LayerCache, LayerRows, cache_shapes


@dataclass
class _Group:
    """The tensors `field` of the layers `members` (one shape, one compress ratio): views of one storage
    [len(members), rows, width], so that a commit writes all of them with one index_copy_."""
    field: str
    ratio: int
    members: list[int]
    storage: torch.Tensor
    first_rows: torch.Tensor           # int64 [len(members)]: member j's first row in the flattened storage

    def intact(self, layers: list[LayerCache]) -> bool:
        """Whether every member's tensor is still its view of the storage (a TensorRT engine's adopt() replaces
        them with views of its own arena)."""
        step = self.storage.stride(0) * self.storage.element_size()
        return all(getattr(layers[l], self.field).data_ptr() == self.storage.data_ptr() + j * step
                   for j, l in enumerate(self.members))


class CacheState:
    def __init__(self, cfg: ModelConfig, ctx: int, n_layers: int | None = None, ratios=None, device="cpu",
                 dtype=torch.float32):
        """Caches for `ctx` positions. `ratios` overrides the per-layer compress ratios (the MTP block
        is one ratio-0 layer). The layers' tensors of one field, shape and ratio share one storage (_Group)."""
        self.cfg, self.ctx = cfg, ctx
        ratios = list(cfg.compress_ratios if ratios is None else ratios)[: n_layers or cfg.n_layer]
        self.ratios = ratios
        members: dict[tuple, list[int]] = {}
        shapes = cache_shapes(cfg, ctx, ratios)
        for l, layer in enumerate(shapes):
            for name, shape in layer.items():
                members.setdefault((name, shape, ratios[l]), []).append(l)
        fields: list[dict[str, torch.Tensor]] = [{} for _ in shapes]
        self.groups = []
        for (name, shape, ratio), ls in members.items():
            storage = torch.empty((len(ls), *shape), device=device, dtype=dtype)
            for j, l in enumerate(ls):
                fields[l][name] = storage[j]
            first = torch.arange(len(ls), device=device) * shape[0]
            self.groups.append(_Group(name, ratio, ls, storage, first))
        self.layers = [LayerCache(**f) for f in fields]
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
        made: dict[tuple, torch.Tensor] = {}      # slot indices, shared by the groups of one ring size / ratio
        for g in self.groups:
            cap, width = g.storage.shape[1:]
            if g.field in EMITTED:                # the compressed row each position emits (or the spare row)
                lo, key = 0, ("emit", g.ratio, cap)
                if key not in made:
                    made[key] = self._emit_rows(pos, g.ratio, cap)
            else:                                 # rings: slot p % cap for the last min(n, cap) positions
                lo, key = n - min(n, cap), ("ring", cap)
                if key not in made:
                    made[key] = pos[lo:] % cap
            idx = made[key]                                                        # [m]
            if len(g.members) == 1 or not g.intact(self.layers):
                for l in g.members:
                    getattr(self.layers[l], g.field).index_copy_(0, idx, getattr(rows[l], g.field)[lo:n])
            else:                                 # one index_copy_ for the whole group (on the GPU: 2 kernels, not 43)
                src = torch.stack([getattr(rows[l], g.field)[lo:n] for l in g.members])     # [members, m, width]
                flat = (g.first_rows[:, None] + idx[None, :]).reshape(-1)
                g.storage.view(-1, width).index_copy_(0, flat, src.reshape(-1, width))

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
