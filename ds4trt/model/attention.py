"""Attention half of a layer: q low-rank, one shared K=V row, tail RoPE, sinks, raw sliding window +
compressed rows (+ indexer top-k on ratio-4 layers), inverse RoPE, grouped output (spec §3.4-§3.7).

Dimension names: T new tokens, H heads, d head width, D model width, R compress ratio,
W window, Kc compressed cache capacity, di indexer head width.
All index arithmetic uses tensors of fixed shape so the step exports to ONNX unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ds4trt.model.config import ModelConfig
from ds4trt.model.linear import Linear, project_group
from ds4trt.model.numerics import fp8_kv_row, indexer_qat, rms_norm, round_f16
from ds4trt.model.rope import apply_rope_tail, inv_freq, rope_cos_sin
from ds4trt.model.state import NEG, LayerCache, LayerRows


QUERY_BLOCK = 256   # long prefill chunks score their queries in blocks of this many: bounds the [T, H, K] temporaries
# (at T = 2048 the attention logits alone are 2 GiB) and lets each block skip the keys none of its queries sees.
# A traced step (T = 3) is one block on the whole tensors: no slice bakes T into the graph.
GATHER_T = 16       # steps of up to this many rows (decode, verify) attend over each row's gathered top-k compressed
# rows when the cache holds more than top-k of them; longer ones over the whole cache, masked


def step_rope(freqs: tuple[torch.Tensor, torch.Tensor], start: torch.Tensor, T: int,
              dtype: torch.dtype) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The RoPE tables of a step's positions start..start+T-1 for each of freqs (inv_freq's, on the step's device):
    ((cos, sin) [T, n_rot/2] in dtype, ...). Made once a step: every layer of a kind rotates by the same ones."""
    pos = start + torch.arange(T, device=start.device)
    return tuple(tuple(c.to(dtype) for c in rope_cos_sin(f, pos)) for f in freqs)


def indexer_needed(cfg: ModelConfig, end: int) -> bool:
    """Whether a step whose last token is at position end - 1 needs the ratio-4 layers' indexer: only when that token
    sees more than index_top_k of a layer's compressed rows (floor(end / 4) of them). Otherwise its top-k would keep
    every visible row, the rows the attention reads without it, so ds4 skips it there (spec §3.6) and so does a step
    told `indexer=False` (Attention.forward)."""
    return end // 4 > cfg.index_top_k


def _by_query_blocks(fn, *rows: torch.Tensor) -> torch.Tensor:
    """fn(*rows) for tensors whose dim 0 is the T queries, each query's result depending on its own rows alone; in
    blocks of QUERY_BLOCK queries when T is larger (same values, less memory)."""
    T = rows[0].shape[0]
    if T <= QUERY_BLOCK:
        return fn(*rows)
    return torch.cat([fn(*(r[a:a + QUERY_BLOCK] for r in rows)) for a in range(0, T, QUERY_BLOCK)])


def attend(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """q: [t, H, d] queries; k: [K, d] keys (= values); mask: [t, K] visible; sinks [H] -> [t, H, d]: softmax over
    the visible keys' logits (q.k / sqrt(d)) and each head's sink logit, times the keys."""
    logits = torch.einsum("thd,kd->thk", q, k) / q.shape[-1] ** 0.5
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink = sinks[None, :, None].expand(q.shape[0], q.shape[1], 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,kd->thd", p, k)                    # V = K


def unrotate(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """o [t, H, d] with each head's tail rotated back by its query row's RoPE (cos, sin [t, n_rot/2])"""
    return apply_rope_tail(o, cos[:, None], sin[:, None], inverse=True)


def attend_unrotate(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """attend, then unrotate -> [t, H, d], written into `out` when given (a long chunk's rows of a block of queries)"""
    o = unrotate(attend(q, k, mask, sinks), cos, sin)
    return o if out is None else out.copy_(o)


def attend_by_query_blocks(attend, q: torch.Tensor, keys: list[torch.Tensor], masks: list[torch.Tensor],
                           sinks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, window: int) -> torch.Tensor:
    """A long chunk's attend_unrotate (`attend`, its `out` included) in blocks of QUERY_BLOCK queries a..b-1, each
    scored only against the keys it can see: raw rows a .. b+window-2 (the windows of its queries) and the compressed
    rows; the keys left out are masked for the whole block, so the values are the same. q [T, H, d] (a backend's may
    be narrower: float16 queries); keys: the raw keys [W-1+T, d], then the compressed ones; masks: theirs [T, K_i]
    -> o [T, H, d], each block writing its rows."""
    T = q.shape[0]
    o = torch.empty(q.shape, dtype=torch.promote_types(q.dtype, keys[0].dtype), device=q.device)
    for a in range(0, T, QUERY_BLOCK):
        b = min(a + QUERY_BLOCK, T)
        spans = [(a, b + window - 1)] + [(0, g.shape[0]) for g in keys[1:]]
        kb = torch.cat([g[lo:hi] for g, (lo, hi) in zip(keys, spans)], dim=0)
        mb = torch.cat([m[a:b, lo:hi] for m, (lo, hi) in zip(masks, spans)], dim=1)
        attend(q[a:b], kb, mb, sinks, cos[a:b], sin[a:b], out=o[a:b])
    return o


def head_norm_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The queries' per-head RMS norm (no weight), then RoPE on each head's tail. x: [T, H, d]; cos, sin:
    [T, n_rot/2] -> [T, H, d]"""
    return apply_rope_tail(rms_norm(x, None, eps), cos[:, None], sin[:, None])


def kv_row(kva: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, post: str,
           n_nope: int) -> torch.Tensor:
    """The raw K=V row of each new token: kva [T, d] RMS-normed (norm [d]), its tail rotated (cos, sin [T, n_rot/2]),
    and for post "fp8" (ds4 numerics) the FP8 round trip of its first n_nope dims, then f16 precision -> [T, d]."""
    kv = apply_rope_tail(rms_norm(kva, norm, eps), cos, sin)
    return round_f16(fp8_kv_row(kv, n_nope)) if post == "fp8" else kv


def index_score(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The indexer's score of each compressed row: w [t, nh] head weights, q [t, nh, di] queries, keys [K, di]
    -> [t, K] = sum over heads of w * relu(q . key)."""
    return torch.einsum("th,thk->tk", w, torch.relu(torch.einsum("thd,kd->thk", q, keys)))


def top_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """score: [T, N] -> [T, k] the columns of each row's k largest scores, equal scores lowest column first (a
    stable descending sort's first k). Callers use them as a set: a backend's kernel may give another order."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k]


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.to(torch.float32), requires_grad=False)


POSTS = ("none", "fp8", "fp4")      # the roundings of a compressor's rows (round_row)


def round_row(x: torch.Tensor, post: str, n_nope: int) -> torch.Tensor:
    """ds4's rounding of a stored compressed row x [..., c] (POSTS): "fp8" the KV rows' FP8 round trip of the first
    n_nope dims, "fp4" the indexer's Hadamard + FP4 (model/numerics.py), "none" (float numerics) x itself."""
    if post == "fp8":
        return fp8_kv_row(x, n_nope)
    return indexer_qat(x) if post == "fp4" else x


def emit_rows(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
              start: torch.Tensor, norm: torch.Tensor, freq: torch.Tensor, ratio: int, post: str, n_nope: int,
              eps: float) -> torch.Tensor:
    """The compressed row each new token emits: [T, c] (zero where (p+1) % R != 0).

    kv, score: [T, coff*c] new projections; state_kv, state_score: [coff*R, coff*c] committed ones (coff = 2 for
    ratio 4, else 1); start: 0-d int64 position of token 0; norm [c]; freq [n_rot/2] the RoPE frequencies. Row of
    the token at p: the softmax-weighted pool (per dim) of block p+1-R .. p (ratio 4: candidates of block j are block
    j-1's first half of the width + block j's second half), RMS-normed, RoPE at p+1-R, rounded by round_row.
    """
    R, c = ratio, norm.shape[0]
    coff = kv.shape[1] // c
    T = kv.shape[0]
    n_blocks = coff + (T + R - 1) // R
    base = (start // R) * R - (coff - 1) * R
    q = base + torch.arange(n_blocks * R, device=kv.device)                      # positions covered, block aligned
    slot = torch.remainder(q, coff * R)
    new_i = torch.clamp(q - start, 0, T - 1)
    is_new = (q >= start) & (q < start + T)
    is_old = (q < start) & (q >= 0)
    ext_kv = torch.where(is_new[:, None], kv[new_i], torch.where(is_old[:, None], state_kv[slot], 0.0))
    ext_sc = torch.where(is_new[:, None], score[new_i], torch.where(is_old[:, None], state_score[slot], NEG))
    bkv = ext_kv.reshape(n_blocks, R, coff * c)
    bsc = ext_sc.reshape(n_blocks, R, coff * c)
    if coff == 2:   # candidates of block j: block j-1's first half + block j's second half
        bkv = torch.cat([bkv[:-1, :, :c], bkv[1:, :, c:]], dim=1)
        bsc = torch.cat([bsc[:-1, :, :c], bsc[1:, :, c:]], dim=1)
    pooled = (torch.softmax(bsc, dim=1) * bkv).sum(dim=1)      # [n_candidates, c]
    first = base + (coff - 1) * R                              # first position of candidate 0
    pos = start + torch.arange(T, device=kv.device)
    row_start = pos + 1 - R                                    # block start of the row token t emits
    emits = torch.remainder(pos + 1, R) == 0
    idx = torch.clamp(torch.div(row_start - first, R, rounding_mode="floor"), 0, pooled.shape[0] - 1)
    rows = rms_norm(pooled[idx], norm, eps)
    cos, sin = rope_cos_sin(freq, row_start)
    rows = round_row(apply_rope_tail(rows, cos, sin), post, n_nope)
    return torch.where(emits[:, None], rows, 0.0)


class Compressor(nn.Module):
    """One compressor lane: pools each block of R tokens into one row (softmax over tokens, per dim).

    Ratio 4 overlaps: row c pools block c-1 (first half of the projection) and block c (second half).
    """

    def __init__(self, cfg: ModelConfig, ratio: int, width: int, kv: nn.Module, gate: nn.Module,
                 ape: torch.Tensor, norm: torch.Tensor, post: str):
        """kv, gate: the [coff*width, D] projections (model/linear.py's contract, built by the `linear` factory);
        post: the rounding of each emitted row (round_row: "fp8", "fp4" or "none")."""
        super().__init__()
        self.cfg, self.ratio, self.width = cfg, ratio, width
        self.kv, self.gate, self.ape, self.norm = kv, gate, _param(ape), _param(norm)
        self.freq = inv_freq(cfg, compressed=True)
        self.post = post
        self.emit_rows = emit_rows       # a backend may set a kernel with emit_rows' signature

    def score(self, gate: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """gate: [T, coff*width] = self.gate(u) (computed in the layer's group of projections of u), pos: [T] -> the
        pooling scores [T, coff*width]"""
        return gate + self.ape[pos % self.ratio]

    def emit(self, kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
             start: torch.Tensor) -> torch.Tensor:
        """Rows emitted by each new token: [T, width] (emit_rows)."""
        return self.emit_rows(kv, score, state_kv, state_score, start, self.norm, self.freq, self.ratio, self.post,
                              self.cfg.n_nope, self.cfg.rms_eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, weights, numerics: str, prefix: str, linear=Linear.from_weights):
        """`weights.get(name)` returns a float32 tensor for a GGUF tensor name; `prefix` is 'blk.N.' or 'mtp.0.';
        `linear(weights, name, groups)` builds the projections (model/linear.py): the Q8_0 ones and the F16
        compressor and indexer matrices."""
        super().__init__()
        w = weights.get
        self.cfg, self.ratio = cfg, cfg.ratio(layer) if prefix.startswith("blk.") else 0
        self.ds4 = numerics == "ds4"
        g = lambda s: _param(w(prefix + s))  # noqa: E731
        lin = lambda s, groups=1: linear(weights, prefix + s, groups)  # noqa: E731
        self.norm, self.q_a, self.q_a_norm, self.q_b = g("attn_norm.weight"), lin("attn_q_a.weight"), \
            g("attn_q_a_norm.weight"), lin("attn_q_b.weight")
        self.kv, self.kv_norm, self.sinks = lin("attn_kv.weight"), g("attn_kv_a_norm.weight"), g("attn_sinks.weight")
        self.out_a, self.out_b = lin("attn_output_a.weight", cfg.o_groups), lin("attn_output_b.weight")
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, cfg.head_dim, lin("attn_compressor_kv.weight"),
                                         lin("attn_compressor_gate.weight"),
                                         w(prefix + "attn_compressor_ape.weight"),
                                         w(prefix + "attn_compressor_norm.weight"), "fp8" if self.ds4 else "none")
        if self.ratio == 4:
            self.qat = indexer_qat if self.ds4 else (lambda x: x)
            self.index_q_b, self.index_proj = lin("indexer.attn_q_b.weight"), lin("indexer.proj.weight")
            self.index_compressor = Compressor(cfg, 4, cfg.index_head_dim, lin("indexer_compressor_kv.weight"),
                                               lin("indexer_compressor_gate.weight"),
                                               w(prefix + "indexer_compressor_ape.weight"),
                                               w(prefix + "indexer_compressor_norm.weight"),
                                               "fp4" if self.ds4 else "none")
        # the projections of the normed input u, in the order forward unpacks them
        self.u_projections = (self.q_a, self.kv) + ((self.compressor.kv, self.compressor.gate) if self.ratio else ()) \
            + ((self.index_compressor.kv, self.index_compressor.gate, self.index_proj) if self.ratio == 4 else ())
        # a backend may set kernels with the signatures of attend_unrotate (its `out` included), index_score, top_rows,
        # head_norm_rope, kv_row and project_group (fewer launches for u_projections)
        self.attend = attend_unrotate
        # and attend_top (q [T, H, d], raw [Kr, d], raw_mask [T, Kr], comp [Kc, d], top [T, k], top_vis [T, k], sinks,
        # cos, sin -> [T, H, d] unrotated): steps of more than GATHER_T rows with the indexer then attend each query's
        # raw keys and its own top rows comp[top[t]] (visible where top_vis), not the whole of comp masked to them
        self.attend_top = None
        self.index_score = index_score
        self.top_rows = top_rows
        self.head_norm_rope = head_norm_rope
        self.kv_row = kv_row
        self.group = project_group

    def forward(self, u: torch.Tensor, start: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: LayerCache, indexer: bool = True):
        """u: [T, D] the HC-reduced input RMS-normed with self.norm (HyperConnection.pre does it); start: 0-d int64
        position of token 0; rope: this layer's RoPE (cos, sin) [T, n_rot/2] of the step's positions in u's type
        (step_rope: made once a step for every layer of its kind);
        indexer: False when no token of the step sees more than index_top_k compressed rows (indexer_needed): a
        ratio-4 layer then attends every visible one without scoring them (the same rows). Returns a: [T, D] attention
        output, LayerRows proposed for the caches."""
        cfg = self.cfg
        T, H, d, W = u.shape[0], cfg.n_head, cfg.head_dim, cfg.window
        pos = start + torch.arange(T, device=u.device)              # [T]
        qa, kva, *uc = self.group(u, *self.u_projections)       # uc: the compressors' (and indexer's) products
        qn = rms_norm(qa, self.q_a_norm, cfg.rms_eps)            # [T, Lq]
        cos, sin = rope
        q = self.queries(qn, cos, sin)                                                   # [T, H, d]
        kv = self.kv_row(kva, self.kv_norm, cos, sin, cfg.rms_eps, "fp8" if self.ds4 else "none", cfg.n_nope)  # [T, d]
        rows = LayerRows(raw=kv)

        # raw window keys: the W-1 committed positions before `start`, then the T new rows
        prev_pos = start - (W - 1) + torch.arange(W - 1, device=u.device)
        raw_keys = torch.cat([cache.raw[torch.remainder(prev_pos, cache.raw.shape[0])], kv], dim=0)
        key_pos = torch.cat([prev_pos, pos])
        keys = [raw_keys]
        masks = [(key_pos[None, :] >= 0) & (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - W)]
        top_keys = None         # (comp, top, top_vis) for self.attend_top

        if self.ratio:
            R = self.ratio
            rows.comp_kv, rows.comp_score = uc[0], self.compressor.score(uc[1], pos)
            rows.comp = self.compressor.emit(rows.comp_kv, rows.comp_score, cache.comp_kv, cache.comp_score, start)
            # without the indexer no token sees more than index_top_k compressed rows (indexer_needed), the cache's
            # first ones: the rest of a large cache would be keys masked for every query (at a 65536-token cache
            # 16385 rows per ratio-4 layer, copied into the keys and split over in each step)
            old_comp = cache.comp[:cfg.index_top_k] if R == 4 and not indexer else cache.comp           # [Kc, d]
            n_old = torch.div(start, R, rounding_mode="floor")
            emits = torch.remainder(pos + 1, R) == 0
            old_vis = (torch.arange(old_comp.shape[0], device=u.device) < n_old)[None, :].expand(T, -1)     # [T, Kc]
            new_vis = emits[None, :] & (pos[None, :] <= pos[:, None])                      # [T, T]
            comp_new = rows.comp
            if T > QUERY_BLOCK:
                # a long chunk: of its new rows only those of the tokens that may emit (1 in R); the others are
                # zero and never visible. Fewer keys for the indexer and the attention, the same values.
                new, ok = self._emitting(start, T)                                             # [n]
                new_vis, comp_new = new_vis[:, new] & ok[None, :], rows.comp[new]
            comp_vis = torch.cat([old_vis, new_vis], dim=1)
            comp = torch.cat([old_comp, comp_new], dim=0)                                    # [Kc+T or Kc+n, d]
            if self.ratio == 4:
                rows.index_kv, rows.index_score = uc[2], self.index_compressor.score(uc[3], pos)
                rows.index = self.index_compressor.emit(rows.index_kv, rows.index_score, cache.index_kv,
                                                        cache.index_score, start)
                if indexer:
                    index_new = rows.index if T <= QUERY_BLOCK else rows.index[new]
                    top = self._indexer_top(uc[4], qn, cos, sin, cache.index, index_new, comp_vis)      # [T, k]
                    if self.attend_top is not None and T > GATHER_T:
                        top_keys = (comp, top, torch.gather(comp_vis, 1, top))
                    else:
                        comp, comp_vis = self._keep_top(top, comp, comp_vis)
            if top_keys is None:
                keys.append(comp)
                masks.append(comp_vis)

        if top_keys is not None:
            o = self.attend_top(q, raw_keys, masks[0], *top_keys, self.sinks, cos, sin)            # [T, H, d]
        elif T <= QUERY_BLOCK:
            # keys [K = W-1+T (+ Kc+T or T*k), d]
            o = self.attend(q, torch.cat(keys, dim=0), torch.cat(masks, dim=1), self.sinks, cos, sin)
        else:
            o = self.attend_chunk(q, keys, masks, self.sinks, cos, sin)
        return self.out_b(self.out_a(o.reshape(T, H * d))), rows

    def attend_chunk(self, q: torch.Tensor, keys: list[torch.Tensor], masks: list[torch.Tensor], sinks: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A long chunk's attention (more than QUERY_BLOCK queries): attend_by_query_blocks with self.attend (a backend
        may set an instance attribute `attend_chunk` with this signature)."""
        return attend_by_query_blocks(self.attend, q, keys, masks, sinks, cos, sin, self.cfg.window)

    def queries(self, qn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qn [T, Lq] -> q [T, H, d]: q_b's product, then each head's norm and RoPE (a backend may set an instance
        attribute `queries` doing both at once, and hand the attention narrower queries it reads as they are)."""
        cfg = self.cfg
        return self.head_norm_rope(self.q_b(qn).reshape(qn.shape[0], cfg.n_head, cfg.head_dim), cos, sin,
                                   cfg.rms_eps)

    def _emitting(self, start: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's tokens (indices 0..T-1) that may emit a compressed row: the n = T // R + 1 positions p with
        (p + 1) % R == 0 from the first on, the last clamped to T - 1 where it lies past the chunk -> new [n] int64,
        ok [n] bool (False for such a clamped one)."""
        R = self.ratio
        new = torch.remainder(R - 1 - start, R) + R * torch.arange(T // R + 1, device=start.device)
        return torch.clamp(new, max=T - 1), new < T

    def _keep_top(self, top: torch.Tensor, comp: torch.Tensor,
                  comp_vis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed keys and their visibility restricted to each query row's top rows: top [T, k], comp
        [Kc+T (or Kc+n), d], comp_vis [T, Kc+T] -> (keys, visible)."""
        T = top.shape[0]
        if T <= GATHER_T and top.shape[1] < comp.shape[0]:
            # each row's own top-k rows, fewer than the whole cache (its capacity, mostly masked at short context):
            # row t sees block t of the gathered rows, where they are visible (the attention kernel skips the other
            # rows' blocks)
            own = torch.arange(T, device=top.device)
            own_block = (own[:, None] == own[None, :])[:, :, None]                       # [T, T, 1]
            return comp[top.reshape(-1)], (own_block & torch.gather(comp_vis, 1, top)[None]).reshape(T, -1)
        # scatter floats, not bools: a bool scatter does not trace to ONNX, and TensorRT's ScatterElements has no BOOL
        return comp, comp_vis & (torch.zeros_like(comp_vis, dtype=torch.float32).scatter(1, top, 1.0) > 0)

    def _indexer_top(self, proj, qn, cos, sin, old_index, new_index, visible) -> torch.Tensor:
        """[T, k] the compressed rows the indexer keeps for each query row, k = min(top-k, Kc+T): the top-k rows by
        score among the visible ones (when fewer are visible, the rest of the k are invisible rows, which the
        caller masks). Ties keep the lower row index. proj: [T, nh] = index_proj(u), the per-head weights before
        scaling; cos, sin: [T, n_rot/2] the queries' RoPE; visible: [T, Kc+T] bool."""
        cfg = self.cfg
        T, nh, di = qn.shape[0], cfg.index_n_head, cfg.index_head_dim
        qi = self.index_q_b(qn).reshape(T, nh, di)
        qi = self.qat(apply_rope_tail(qi, cos[:, None], sin[:, None]))
        wi = proj / (di * nh) ** 0.5                                # [T, nh]
        keys = torch.cat([old_index, new_index], dim=0)             # [Kc+T, di]
        score = _by_query_blocks(lambda w, q: self.index_score(w, q, keys), wi, qi)   # [T, Kc+T]
        score = score.masked_fill(~visible, float("-inf"))
        k = min(cfg.index_top_k, keys.shape[0])
        return self.top_rows(score, k)
