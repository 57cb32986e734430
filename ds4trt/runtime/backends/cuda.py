"""CUDA backend: the PyTorch model with its quantized weights resident on the GPU as GGUF blocks, computed by
the Triton kernels (plugins/kernels), and each step replayed from CUDA graphs.

    engine = open_engine("model.gguf", "mtp.gguf")          # Engine(..., steps=GraphedSteps)
    s = engine.session(4096)                                 # the same Session / speculative loop as on the CPU

Weights: Q8_0 projections -> Q8Linear (q8_matmul, on the blocks rearranged by q8_triton.split_q8: the same
bytes), routed experts -> CudaExperts (moe_forward on IQ2_XXS / Q2_K / Q4_K blocks; in one-token steps the shared
expert's SwiGLU and down product run inside their launches, ExpertsAndShared), the F16 matrices of the router,
compressors and indexer -> F16Linear (float16, f16_triton); other F16/F32 tensors (norms, HC, embedding) as float32.
Prefill chunks (more rows than the kernels take) multiply on the float16 tensor cores (project_f16, ~3e-4
relative): a Q8_0 weight made float16 one at a time by one kernel from its blocks (q8_triton.dequant_f16, 3 bytes
of traffic per weight value, no float32 copy), an F16 one as it is.
The hyper-connections' reduction of the streams (norm, mixer products, Sinkhorn mixing, weighted sum, the
sublayer's RMS norm) runs as two kernels (hc_triton.hc_pre_triton) in decode and verify steps, and after each
sublayer with its update of the streams in the first (hc_post_pre_triton); the attention and its output's inverse
RoPE as two (attn_triton), the indexer's scores as one (index_triton); in every step the raw KV row and each
compressor's rows (rows_triton), the queries' norm and RoPE (rope_triton) and the rounding of the indexer's queries
(qat_triton, bitwise PyTorch's) are one kernel each; a prefill chunk's attention, indexer scores and stream update
too (attend_long_triton, or attend_top_triton over each query's own top rows once the indexer runs,
index_score_long_triton, hc_post_triton: float16 parts on the tensor cores).
No float copy of a quantized weight is kept.

Graphs: GraphedSteps captures `run` for each (T, last_only, indexer, bound) with T <= MAX_GRAPH_T (decode, verify of
up to 8 drafts, draft, catch-up; indexer: whether the step's position needs the indexer, Steps.indexer; bound: the
positions below which it reads compressed rows, Steps.bound, a power of two from MIN_BOUND on, so that a step's cost
follows the context used rather than --ctx) and `commit` for each of those and n (one kernel:
commit_triton.CommitPlan), on first use or beforehand (Session.warm_up: ds4-run does it). A whole prefill chunk
(PREFILL_CHUNK tokens: Steps.prefill, run and commit of every row) replays one graph per (indexer, bound), captured
after the first such chunk ran eagerly; those graphs share one memory pool and keep no rows, so together they hold
about one chunk's temporaries. Other chunks (a prompt's last, shorter one) run eagerly, as every chunk does with
DS4_GRAPH_PREFILL=0. Eager chunks cost the host more time than the GPU on some machines (BENCHMARKS.md).
Every graph reads the session's own cache buffers, so a session's CacheState is never reallocated (reset() is in place).

compile=True: torch.compile (Inductor) fuses the glue between the kernels inside each block (HC mixing and its
Sinkhorn loop, norms, RoPE, rounding, compressors, indexer, masks), the head and the step's inputs (embedding, RoPE
tables) for the graphed shapes: one compiled variant per block kind (the first and last blocks' too), step length
and indexer flag (each bound is the same compiled code: the compressed caches' row count is a dynamic dimension),
compiled in the warm-up or on first use (about a minute per step length for the 43 Flash layers on the H200); eager
steps ignore it. Inductor's combo kernels (INDUCTOR_OPTIONS) launch
independent small kernels of a block as one, and on sm_90+ each kernel is launched with programmatic dependent
launch (PDL) like the package's own kernels (plugins/kernels/pdl.py). With DS4_COMPILE_PREFILL=1 whole prefill chunks
(PREFILL_CHUNK tokens: one more shape, compiled on the first prompt that fills a chunk) run through the compiled
blocks too (their kernels are custom ops like the steps'), a prompt's last, shorter chunk eagerly. Not the default:
on an H100 at 28 layers a compiled 2048-token chunk took 201-214 ms in 4 of 5 runs against 225-230 eager in 3 of 4
(BENCHMARKS.md, the fifty-sixth and fifty-seventh sessions), but no less than eager on the slower H100s of the
fifty-ninth and sixtieth sessions (404.8 against 351.0 ms, 355.8 against 349.8), and never on an H200.
"""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import torch
import torch.nn as nn

from ds4trt.errors import Ds4Error
from ds4trt.gguf_io import names as N
from ds4trt.model.attention import Attention, Compressor, attend_by_query_blocks, top_rows
from ds4trt.model.hc import hc_post
from ds4trt.model.linear import Linear, project_group
from ds4trt.model.moe import WEIGHT_SUM_FLOOR, route
from ds4trt.model.numerics import FP4_BLOCK, FP4_MIN_AMAX, indexer_qat, rms_norm
from ds4trt.model.mtp import MTPHead
from ds4trt.model.transformer import FeedForward, HyperConnection, Transformer
from ds4trt.model.weights import load_mtp, load_target
from ds4trt.plugins.kernels import attn_triton, f16_triton, hc_triton, index_triton, moe_triton, q8_triton, \
    qat_triton, rope_triton, route_triton, rows_triton, topk_triton
from ds4trt.plugins.kernels.commit_triton import CommitPlan
from ds4trt.plugins.kernels.pdl import pdl_wanted
from ds4trt.plugins.moe import GGUFExperts
from ds4trt.runtime.session import Engine
from ds4trt.runtime.steps import Steps
from ds4trt.tokenizer import Tokenizer

KERNEL_MAX_T = 16            # q8_matmul's row limit: longer steps make the weight float16 for one float16
                             # tensor-core GEMM (project_f16; a float32 SGEMM at first: prefill of 2048 tokens
                             # 836 -> 883 tokens/s on the H200 with bf16 parts, BENCHMARKS.md)
MAX_GRAPH_T = 9              # a verify step of 8 drafts (ds4-run --mtp-draft <= 8)
MIN_BOUND = 4096             # graphed steps read the compressed rows of positions below a power of two from this on
                             # (Steps.bound): at ds4-run's default --ctx one bound, the whole cache
FUSED_MAX_T = 16             # steps of up to this many rows keep the PyTorch version of the streams' update (a
                             # compiled step fuses it into its glue); longer ones (prefill chunks) run the
                             # single-pass kernel (hc_post_triton)
# Prefill chunk of this backend's sessions: a long MoE call costs less per token up to 2048 tokens (an expert's
# blocks serve more tokens per read), attention grows with the chunk; on the H200 at Flash width (43 layers;
# BENCHMARKS.md, 14767a2, with the prefill attention kernel) chunks of 1024 / 2048 prefilled a 2048-token prompt at
# 1502 / 1721 tokens/s and a 4096-token one at 1448 / 1672, with peaks of 84.2 / 86.2 GiB.
PREFILL_CHUNK = 2048


# The kernels as PyTorch custom ops: opaque to torch.compile (which fuses the glue around them) and to CUDA graphs.
@torch.library.custom_op("ds4trt::q8_matmul", mutates_args=())
def q8_matmul_op(x: torch.Tensor, quants: torch.Tensor, scales: torch.Tensor, K: int, groups: int) -> torch.Tensor:
    return q8_triton.q8_matmul(x, quants, scales, K, groups)


@q8_matmul_op.register_fake
def _(x, quants, scales, K, groups):
    return x.new_empty(x.shape[0], quants.shape[0])


@torch.library.custom_op("ds4trt::moe", mutates_args=())
def moe_op(v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_blocks: torch.Tensor,
           up_blocks: torch.Tensor, down_blocks: torch.Tensor, gate_type: int, up_type: int, down_type: int,
           clamp: float) -> torch.Tensor:
    """-> [T, k, D]: each slot's weighted expert output (CudaExperts sums them)"""
    return moe_triton.moe_forward(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type,
                                  down_type, clamp, per_slot=True)


@moe_op.register_fake
def _(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type, clamp):
    return v.new_empty(v.shape[0], ids.shape[1], v.shape[1])


@torch.library.custom_op("ds4trt::moe_with_shared", mutates_args=())
def moe_with_shared_op(v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_blocks: torch.Tensor,
                       up_blocks: torch.Tensor, down_blocks: torch.Tensor, gate_type: int, up_type: int, down_type: int,
                       clamp: float, gu: torch.Tensor, down_quants: torch.Tensor,
                       down_scales: torch.Tensor) -> torch.Tensor:
    """-> [1, k + 1, D]: each slot's weighted expert output, then the shared expert's (gu: its gate's and up's products
    of v, ExpertsAndShared)"""
    return moe_triton.moe_forward(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type,
                                  down_type, clamp, per_slot=True, shared=(gu, down_quants, down_scales))


@moe_with_shared_op.register_fake
def _(v, ids, weights, gate_blocks, up_blocks, down_blocks, gate_type, up_type, down_type, clamp, gu, down_quants,
      down_scales):
    return v.new_empty(v.shape[0], ids.shape[1] + 1, v.shape[1])


@torch.library.custom_op("ds4trt::hc_pre", mutates_args=())
def hc_pre_op(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
              hc_eps: float, sinkhorn_iters: int,
              norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_triton.hc_pre_triton(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm)


@hc_pre_op.register_fake
def _(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm):
    T, S, D = X.shape
    return X.new_empty(T, D), X.new_empty(T, S), X.new_empty(T, S, S)


@torch.library.custom_op("ds4trt::hc_post_pre", mutates_args=())
def hc_post_pre_op(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                   scale: torch.Tensor, base: torch.Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                   norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_triton.hc_post_pre_triton(f, X, post, comb, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm)


@hc_post_pre_op.register_fake
def _(f, X, post, comb, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm):
    T, S, D = X.shape
    return X.new_empty(T, S, D), X.new_empty(T, D), X.new_empty(T, S), X.new_empty(T, S, S)


@torch.library.custom_op("ds4trt::attend", mutates_args=())
def attend_op(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    if _split_keys(q):
        return attn_triton.attend_triton(q, k, mask, sinks, cos, sin)
    return attn_triton.attend_long_triton(q, k, mask, sinks, cos, sin)


@attend_op.register_fake
def _(q, k, mask, sinks, cos, sin):
    return q.new_empty(q.shape, dtype=torch.float32)


def _split_keys(q: torch.Tensor) -> bool:
    """Whether attend_kernel takes the kernels split over the keys (steps) rather than the flash-attention one."""
    return q.shape[0] <= attn_triton.MAX_T and q.dtype == torch.float32


def attend_kernel(q, k, mask, sinks, cos, sin, out=None):
    """model/attention.py attend_unrotate on this backend: two kernels for steps of up to attn_triton.MAX_T queries
    (split over the keys, the rotation in the join), else the flash-attention kernel, which rotates as it stores
    into `out` (a prefill chunk's block of queries; also a chunk's last block of MAX_T or fewer when its queries
    came as float16 from queries_kernel, which only the flash-attention kernel reads). Without `out` one op (in a
    compiled chunk of up to QUERY_BLOCK queries, Inductor, torch 2.11 on an H100, failed to lower the
    flash-attention kernel's bool mask viewed as bytes when the chunk called the kernel itself)."""
    if out is None:
        return attend_op(q, k, mask, sinks, cos, sin)
    if _split_keys(q):
        return out.copy_(attend_op(q, k, mask, sinks, cos, sin))
    return attn_triton.attend_long_triton(q, k, mask, sinks, cos, sin, out=out)


# A prefill chunk's kernels are custom ops too, for a chunk run through the compiled blocks: a Triton kernel called
# in a compiled graph is analysed by Inductor, which takes every input of one with inline PTX (pdl.py's wait, the
# wide loads) as mutated, and whose copies for the chunk's attention writing its blocks of queries into views of one
# output (attend_by_query_blocks' out=) read past a buffer (an illegal address on the H100, BENCHMARKS.md).
@torch.library.custom_op("ds4trt::attend_chunk", mutates_args=())
def attend_chunk_op(q: torch.Tensor, keys: list[torch.Tensor], masks: list[torch.Tensor], sinks: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, window: int) -> torch.Tensor:
    return attend_by_query_blocks(attend_kernel, q, keys, masks, sinks, cos, sin, window)


@attend_chunk_op.register_fake
def _(q, keys, masks, sinks, cos, sin, window):
    return q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, keys[0].dtype))


def attend_chunk_kernel(attn: Attention, q, keys, masks, sinks, cos, sin):
    """model/attention.py Attention.attend_chunk on this backend: its blocks of queries as one op, each block one
    flash-attention kernel writing its rows of the output (attend_kernel)."""
    return attend_chunk_op(q, keys, masks, sinks, cos, sin, attn.cfg.window)


@torch.library.custom_op("ds4trt::attend_top", mutates_args=())
def attend_top_op(q: torch.Tensor, raw: torch.Tensor, raw_mask: torch.Tensor, comp: torch.Tensor, top: torch.Tensor,
                  top_vis: torch.Tensor, sinks: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return attn_triton.attend_top_triton(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin)


@attend_top_op.register_fake
def _(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin):
    return q.new_empty(q.shape, dtype=torch.float32)


def attend_top_kernel(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin):
    """model/attention.py's attend_top hook on this backend (prefill chunks of the indexer's layers): one kernel
    reading each query's window and own top rows, rotating as it stores."""
    return attend_top_op(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin)


@torch.library.custom_op("ds4trt::index_score", mutates_args=())
def index_score_op(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return index_triton.index_score_triton(w, q, keys)


@index_score_op.register_fake
def _(w, q, keys):
    return q.new_empty(q.shape[0], keys.shape[0])


@torch.library.custom_op("ds4trt::index_score_long", mutates_args=())
def index_score_long_op(w: torch.Tensor, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return index_triton.index_score_long_triton(w, q, keys)


@index_score_long_op.register_fake
def _(w, q, keys):
    return q.new_empty(q.shape[0], keys.shape[0], dtype=torch.float32)


def index_score_kernel(w, q, keys):
    """model/attention.py index_score on this backend: one kernel for steps of up to index_triton.MAX_T queries,
    another for prefill chunks."""
    if q.shape[0] <= index_triton.MAX_T:
        return index_score_op(w, q, keys)
    return index_score_long_op(w, q, keys)


@torch.library.custom_op("ds4trt::top_rows", mutates_args=())
def top_rows_op(score: torch.Tensor, k: int) -> torch.Tensor:
    return topk_triton.top_rows_triton(score, k)


@top_rows_op.register_fake
def _(score, k):
    return score.new_empty(score.shape[0], k, dtype=torch.int64)


def top_rows_kernel(score, k: int):
    """model/attention.py top_rows on this backend: one kernel for the indexer's steps and prefill chunks over at most
    topk_triton.MAX_N compressed rows, else the sort (longer caches)."""
    if score.shape[1] <= topk_triton.MAX_N:
        return top_rows_op(score, k)
    return top_rows(score, k)


@torch.library.custom_op("ds4trt::route", mutates_args=())
def route_op(logits: torch.Tensor, bias: torch.Tensor, k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return route_triton.route_triton(logits, bias, k, scale, WEIGHT_SUM_FLOOR)


@route_op.register_fake
def _(logits, bias, k, scale):
    T = logits.shape[0]
    return logits.new_empty(T, k, dtype=torch.int64), logits.new_empty(T, k)


def route_kernel(logits, bias, tid2eid, tokens, k: int, scale: float):
    """model/moe.py route on this backend: one kernel for the biased layers' steps and prefill chunks, else the
    PyTorch version (hash layers)."""
    if tid2eid is None and bias is not None:
        return route_op(logits, bias, k, scale)
    return route(logits, bias, tid2eid, tokens, k, scale)


@torch.library.custom_op("ds4trt::kv_row", mutates_args=())
def kv_row_op(kva: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, post: str,
              n_nope: int) -> torch.Tensor:
    return rows_triton.kv_row_triton(kva, norm, cos, sin, eps, post, n_nope)


@kv_row_op.register_fake
def _(kva, norm, cos, sin, eps, post, n_nope):
    return kva.new_empty(kva.shape)


@torch.library.custom_op("ds4trt::compress_emit", mutates_args=())
def compress_emit_op(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                     start: torch.Tensor, norm: torch.Tensor, freq: torch.Tensor, ratio: int, post: str, n_nope: int,
                     eps: float) -> torch.Tensor:
    return rows_triton.compress_emit_triton(kv, score, state_kv, state_score, start, norm, freq, ratio, post, n_nope,
                                            eps)


@compress_emit_op.register_fake
def _(kv, score, state_kv, state_score, start, norm, freq, ratio, post, n_nope, eps):
    return kv.new_empty(kv.shape[0], norm.shape[0])


@torch.library.custom_op("ds4trt::head_norm_rope", mutates_args=())
def head_norm_rope_op(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    return rope_triton.head_norm_rope_triton(q, cos, sin, eps)


@head_norm_rope_op.register_fake
def _(q, cos, sin, eps):
    return torch.empty_like(q)


def queries_kernel(attn: Attention, qn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """model/attention.py Attention.queries on this backend: for a prefill chunk (q_b a Q8_0 product on the tensor
    cores, the prefill attention reading one float16 part) one pass from q_b's product before its rows are scaled
    back to float16 queries, the float16 of what q_b and head_norm_rope_kernel give (bit for bit on Triton's
    interpreter and in the tiny model's layers on an H100; compiled at Flash's width a few values round the other
    way, within one float16 step: tests/test_kernels.py head_norm_rope), which is what the attention would read (its
    float32 queries were scaled, normed and rotated, then converted: four passes over [T, H, d] float32, 268 MB each
    at 2048 tokens of Flash: 28 layers on an H100 took a 2048-token chunk in 266.6-267.8 ms before, 255.7-255.9
    after, BENCHMARKS.md); else q_b, then head_norm_rope_kernel."""
    cfg, q_b, T = attn.cfg, attn.q_b, qn.shape[0]
    if T > KERNEL_MAX_T and isinstance(q_b, Q8Linear) and q_b.groups == 1 and attn_triton.reads_float16_queries():
        y, s = q_b.unscaled_f16(qn)
        return head_norm_rope_f16_op(y.view(T, cfg.n_head, cfg.head_dim), cos, sin, cfg.rms_eps, s)
    return head_norm_rope_kernel(q_b(qn).reshape(T, cfg.n_head, cfg.head_dim), cos, sin, cfg.rms_eps)


@torch.library.custom_op("ds4trt::head_norm_rope_f16", mutates_args=())
def head_norm_rope_f16_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
                          row_scale: torch.Tensor) -> torch.Tensor:
    """-> float16 [T, H, d]: head_norm_rope of x's rows times row_scale (queries_kernel)"""
    return rope_triton.head_norm_rope_triton(x, cos, sin, eps, row_scale=row_scale, out_dtype=torch.float16)


@head_norm_rope_f16_op.register_fake
def _(x, cos, sin, eps, row_scale):
    return x.new_empty(x.shape, dtype=torch.float16)


def head_norm_rope_kernel(q, cos, sin, eps: float):
    """model/attention.py head_norm_rope on this backend: one kernel (compiled, the PyTorch version of a short step
    was two of the glue's, a reduction and the rotation)."""
    return head_norm_rope_op(q, cos, sin, eps)


@torch.library.custom_op("ds4trt::indexer_qat", mutates_args=())
def indexer_qat_op(x: torch.Tensor, block: int, min_amax: float) -> torch.Tensor:
    return qat_triton.indexer_qat_triton(x, block, min_amax)


@indexer_qat_op.register_fake
def _(x, block, min_amax):
    return torch.empty_like(x)


def qat_kernel(x):
    """model/numerics.py indexer_qat of the indexer's queries on this backend: one kernel, bitwise the same (in a
    compiled decode step the PyTorch version's butterflies were spread over several of the glue's kernels)."""
    return indexer_qat_op(x, min(FP4_BLOCK, x.shape[-1]), FP4_MIN_AMAX)


def hc_reduce(X, fn, scale, base, rms_eps: float, hc_eps: float, sinkhorn_iters: int, norm):
    """model/hc.py hc_pre on this backend: two kernels for steps of up to hc_triton.MAX_T tokens (decode, verify,
    draft; the sublayer's RMS norm in the second), else the prefill chunks' two (tf32x3 tensor-core products of blocks
    of tokens, then the mixing and the weighted sum) and the norm in PyTorch."""
    if X.shape[0] <= hc_triton.MAX_T:
        return hc_pre_op(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm)
    y, post, comb = hc_pre_long_op(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return rms_norm(y, norm, rms_eps), post, comb


@torch.library.custom_op("ds4trt::hc_pre_long", mutates_args=())
def hc_pre_long_op(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
                   hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_triton.hc_pre_long_triton(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)


@hc_pre_long_op.register_fake
def _(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters):
    T, S, D = X.shape
    return X.new_empty(T, D), X.new_empty(T, S), X.new_empty(T, S, S)


def hc_combine(f, X, post, comb):
    """model/hc.py hc_post on this backend: the PyTorch version for steps of up to FUSED_MAX_T tokens, else one
    kernel (prefill chunks). f: [T, D], or the [T, J, D] terms of a decode step's FFN output (ExpertsAndShared)."""
    if f.dim() == 3:
        f = f.sum(dim=1)
    if X.shape[0] <= FUSED_MAX_T:
        return hc_post(f, X, post, comb)
    return hc_post_op(f, X, post, comb)


@torch.library.custom_op("ds4trt::hc_post", mutates_args=())
def hc_post_op(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return hc_triton.hc_post_triton(f, X, post, comb)


@hc_post_op.register_fake
def _(f, X, post, comb):
    return torch.empty_like(X)


def hc_update_reduce(f, X, post, comb, fn, scale, base, rms_eps: float, hc_eps: float, sinkhorn_iters: int, norm):
    """model/hc.py hc_post_pre on this backend: two kernels for steps of up to hc_triton.MAX_T tokens (the update
    and the reduction's products in one; f may be the [T, J, D] terms of the FFN output, which the first sums), else
    hc_combine then hc_reduce (prefill chunks)."""
    if X.shape[0] <= hc_triton.MAX_T:
        return hc_post_pre_op(f, X, post, comb, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm)
    X = hc_combine(f, X, post, comb)
    return (X, *hc_reduce(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, norm))


class Q8Linear(nn.Module):
    """x @ W.T with W kept as Q8_0 values (model/linear.py's contract, groups included): the GGUF blocks split
    into quants uint8 [N, K] and scales f16 [N, K/32] (q8_triton.split_q8: the same bytes)."""

    def __init__(self, blocks: torch.Tensor, N: int, K: int, groups: int = 1):
        super().__init__()
        quants, scales = q8_triton.split_q8(blocks, N, K)
        self.register_buffer("quants", quants)
        self.register_buffer("scales", scales)
        self.N, self.K, self.groups = N, K, groups
        self.f16_scale = q8_triton.f16_scale(scales)       # prefill's float16 weight stands for f16_scale times it

    @classmethod
    def from_weights(cls, weights, name: str, groups: int = 1) -> "Q8Linear":
        N, K = weights.shape_of(name)
        return cls(weights.blocks(name), N, K, groups)

    def forward(self, x: torch.Tensor, x16: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [..., G*K] float32 -> [..., N]; x16: q8_triton.x_f16 of x's rows, where the caller has it (long chunks)"""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > KERNEL_MAX_T:     # long prefill chunks: this weight in float16 for the one product
            return project_f16(x, self.weight_f16(), self.groups, self.f16_scale, x16)
        return q8_matmul_op(x2, self.quants, self.scales, self.K, self.groups).reshape(*x.shape[:-1], self.N)

    def weight_f16(self) -> torch.Tensor:
        """The weight as float16 [N, K] standing for f16_scale times it, made for one long chunk's product."""
        return dequant_f16_op(self.quants, self.scales, self.K, 1 / self.f16_scale)

    def unscaled_f16(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A long chunk's product (one group) before its rows are scaled back: x [T, K] float32 -> (y [T, N] float32,
        scale [T] float32, powers of two) with x @ W.T = y * scale[:, None] (project_f16's product_f16)."""
        y, s = product_f16(x, self.weight_f16())
        return y[0], s * self.f16_scale


def project_f16(x: torch.Tensor, w16: torch.Tensor, groups: int = 1, w_scale: float = 1.0,
                x16: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """model/linear.py project (x [..., G*K] float32, weight [N, K] -> [..., N]) on the float16 tensor cores, for
    long prefill chunks, given the weight as float16 w16 [N, K] standing for w_scale * w16 (w_scale a power of two:
    q8_triton.dequant_f16 and f16_scale, or an F16 weight itself with 1): x scaled per row by a power of two and
    rounded to float16 (q8_triton.x_f16), one GEMM with float32 accumulation and output, scaled back. Each operand
    rounded to float16 (2^-12 relative, the scaling exact): ~3e-4 relative against float64 on random rows, within
    the 1e-3 the issue allows float16 inputs, like the routed experts' long calls (ds4's own kernels round the
    activations to 8 bits). bf16 parts (hi + lo of each operand, three products: ~5e-6) cost three times the
    tensor-core work and twice the weight's bytes (BENCHMARKS.md). x16: x_f16 of x's rows, made once by a caller
    with several projections of x (LinearGroup)."""
    y, s = product_f16(x, w16, groups, x16)
    # scaled in bmm's layout [G, T, N/G], contiguous: a pass over the transpose was ~4x slower (the grouped out_a of
    # 2048 tokens: ~200 us on the H200)
    y.mul_((s * w_scale)[:, None])
    return y.transpose(0, 1).reshape(*x.shape[:-1], w16.shape[0])


def product_f16(x: torch.Tensor, w16: torch.Tensor, groups: int = 1,
                x16: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """project_f16's product before its rows are scaled back: (y [G, T, N/G] float32, s [T] float32) with group g's
    projection of row t = y[g, t] * s[t] * w_scale."""
    G, N, K = groups, w16.shape[0], w16.shape[1]
    xs, s = x16 or x_f16_op(x.reshape(-1, G * K))                         # [T, G*K] float16, [T] float32
    a = xs.view(-1, G, K).transpose(0, 1)                                  # [G, T, K]
    b = w16.view(G, N // G, K).transpose(1, 2)                             # [G, K, N/G]
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32), s                 # [G, T, N/G]
    return torch.bmm(a.float(), b.float()), s    # Triton's interpreter (CPU tests): the same products, float32 sums


@torch.library.custom_op("ds4trt::dequant_f16", mutates_args=())
def dequant_f16_op(quants: torch.Tensor, scales: torch.Tensor, K: int, inv_scale: float) -> torch.Tensor:
    return q8_triton.dequant_f16(quants, scales, K, inv_scale)


@dequant_f16_op.register_fake
def _(quants, scales, K, inv_scale):
    return quants.new_empty(quants.shape[0], K, dtype=torch.float16)


@torch.library.custom_op("ds4trt::x_f16", mutates_args=())
def x_f16_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q8_triton.x_f16(x)


@x_f16_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float16), x.new_empty(x.shape[0])


@torch.library.custom_op("ds4trt::f16_matmul", mutates_args=())
def f16_matmul_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return f16_triton.f16_matmul(x, w)


@f16_matmul_op.register_fake
def _(x, w):
    return x.new_empty(x.shape[0], w.shape[0])


class F16Linear(nn.Module):
    """x @ W.T for an F16 GGUF matrix kept as float16 (the routers, compressors and indexer projections: half the
    bytes of a float32 copy): f16_triton for steps of up to f16_triton.MAX_T rows, else project_f16 on the weight
    itself (prefill chunks)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.N, self.K = weight.shape
        self.register_buffer("weight", weight.to(torch.float16))            # [N, K], the F16 values exactly

    def forward(self, x: torch.Tensor, x16: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x: [..., K] float32 -> [..., N]; x16 as Q8Linear.forward's"""
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > f16_triton.MAX_T:
            return project_f16(x, self.weight, x16=x16)
        return f16_matmul_op(x2, self.weight).reshape(*x.shape[:-1], self.N)


def cuda_linear(weights, name: str, groups: int = 1) -> nn.Module:
    """The model's `linear` factory on this backend: Q8_0 -> Q8Linear, F16 -> F16Linear, F32 -> Linear."""
    t = weights.type_of(name)
    if t == N.Q8_0:
        return Q8Linear.from_weights(weights, name, groups)
    if t == N.F16 and groups == 1:
        return F16Linear(weights.get(name))
    return Linear.from_weights(weights, name, groups)


class LinearGroup:
    """model/linear.py project_group on this backend, for the projections of one input (attention: q_a, kv and the
    compressors' and indexer's F16 matrices of u; the shared expert: gate, up): the Q8_0 members in one q8_matmul
    and the F16 members in one f16_matmul, their weights made row views of one concatenated weight (the same
    bytes); other members, and steps longer than a kernel's row limit, each alone (those of prefill chunks on one
    x_f16 of x). Small projections are bound by launch latency (a decode step: 2-6 us each for 0.5-2 us of bytes)."""

    def __init__(self, mods):
        self.mods = tuple(mods)
        self.fused = []                   # (kernel, member indices, concatenated weight arrays, members' row spans)
        q8 = [i for i, m in enumerate(self.mods) if isinstance(m, Q8Linear) and m.groups == 1]
        f16 = [i for i, m in enumerate(self.mods) if isinstance(m, F16Linear)]
        for kernel, members, fields in (("q8", q8, ("quants", "scales")), ("f16", f16, ("weight",))):
            if len(members) < 2 or len({self.mods[i].K for i in members}) != 1:
                continue
            arrays = tuple(torch.cat([getattr(self.mods[i], f) for i in members]) for f in fields)
            spans = _spans([self.mods[i].N for i in members])
            for i, (lo, hi) in zip(members, spans):
                for f, a in zip(fields, arrays):
                    setattr(self.mods[i], f, a[lo:hi])
            self.fused.append((kernel, members, arrays, spans))

    def __call__(self, x: torch.Tensor, *mods: nn.Module) -> tuple[torch.Tensor, ...]:
        """x: [..., K] -> each member's [..., N_i]"""
        if len(mods) != len(self.mods) or any(a is not b for a, b in zip(mods, self.mods)):
            return project_group(x, *mods)
        x2 = x.reshape(-1, x.shape[-1])
        T = x2.shape[0]
        out = [None] * len(mods)
        for kernel, members, arrays, spans in self.fused:
            if T > (KERNEL_MAX_T if kernel == "q8" else f16_triton.MAX_T):
                continue
            y = q8_matmul_op(x2, *arrays, mods[members[0]].K, 1) if kernel == "q8" else f16_matmul_op(x2, *arrays)
            for i, (lo, hi) in zip(members, spans):
                out[i] = y[:, lo:hi].reshape(*x.shape[:-1], hi - lo)
        long = [i for i, m in enumerate(mods) if out[i] is None and _takes_x16(m, T)]
        if len(long) > 1:                                     # their inputs' float16 rows made once
            x16 = x_f16_op(x2)
            for i in long:
                out[i] = mods[i](x, x16)
        return tuple(m(x) if o is None else o for m, o in zip(mods, out))


def _takes_x16(m: nn.Module, T: int) -> bool:
    """Whether a projection of T rows runs project_f16 on x's rows as they are (no groups), so takes their x_f16."""
    return (isinstance(m, Q8Linear) and m.groups == 1 and T > KERNEL_MAX_T
            or isinstance(m, F16Linear) and T > f16_triton.MAX_T)


def _spans(sizes: list[int]) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) ranges of the given sizes."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return [(e - n, e) for n, e in zip(sizes, ends)]


class CudaExperts(GGUFExperts):
    """ds4::MoE computed by moe_forward (Triton) on the GGUF blocks (a prefill chunk in one call: each expert's
    blocks are read once per 64 of its tokens). The sum over the k slots is left to PyTorch, so that in a compiled
    step Inductor fuses it into the next kernel (a separate reduction was ~3.9 us per layer in decode)."""

    def forward(self, v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """v: [T, D]; ids, weights: [T, k] -> [T, D]"""
        y = moe_op(v, ids, weights, self.gate_blocks, self.up_blocks, self.down_blocks, *self.types, self.clamp)
        return y.sum(dim=1)                                                             # [T, k, D] -> [T, D]


class ExpertsAndShared:
    """model/transformer.py FeedForward.both_experts on this backend, for a Q8_0 shared expert: in one-token steps
    (decode, draft) its gate and up run as one Q8_0 launch (LinearGroup's arrays), its SwiGLU in the routed experts'
    first launch and its down product inside their down launch (moe_triton's `shared`: a launch and a glue kernel
    fewer per layer), and the k + 1 terms are returned unsummed, for the hyper-connection kernel that takes the FFN's
    output to sum them (hc_update_reduce; hc_combine sums them itself); longer steps compute the two apart
    (FeedForward.routed_plus_shared)."""

    def __init__(self, ffn: FeedForward):
        self.experts, self.down = ffn.experts, ffn.sh_down
        (_, _, self.gate_up, _), = ffn.group.fused              # the gate's and the up's Q8_0 arrays, concatenated
        self.K = ffn.sh_gate.K
        self.apart = ffn.routed_plus_shared

    @staticmethod
    def applies(ffn: FeedForward) -> bool:
        """Routed experts on this backend's kernels, and a Q8_0 shared expert of their width and clamp whose gate and
        up LinearGroup computes in one launch."""
        return isinstance(ffn.experts, CudaExperts) and isinstance(ffn.sh_down, Q8Linear) \
            and ffn.sh_down.groups == 1 and ffn.sh_down.K == ffn.experts.gate_blocks.shape[1] \
            and ffn.experts.clamp == ffn.cfg.swiglu_clamp and isinstance(ffn.group, LinearGroup) \
            and [(kernel, members) for kernel, members, _, _ in ffn.group.fused] == [("q8", [0, 1])]

    def __call__(self, v: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """v: [T, D]; ids, weights: [T, k] -> [T, D], or its [1, k + 1, D] terms when T = 1"""
        if v.shape[0] != 1:
            return self.apart(v, ids, weights)
        gu = q8_matmul_op(v, *self.gate_up, self.K, 1)                          # [1, 2F]: the gate's, then the up's
        e = self.experts
        return moe_with_shared_op(v, ids, weights, e.gate_blocks, e.up_blocks, e.down_blocks, *e.types, e.clamp, gu,
                                  self.down.quants, self.down.scales)                # [1, k + 1, D]: terms of [1, D]


def to_device(model: nn.Module, device) -> nn.Module:
    """model.to(device), plus the float64 RoPE frequency tables (plain attributes, kept float64 on purpose);
    the hyper-connections' reduction of the streams, and the attention and the indexer's scores of short steps become
    kernels (hc_reduce, attend_kernel, index_score_kernel), and so do every step's indexer top-k, router choice
    (biased layers), cache rows, query norm and RoPE and indexer query rounding (top_rows_kernel, route_kernel,
    kv_row_op, compress_emit_op, head_norm_rope_kernel, qat_kernel) and a prefill chunk's attention, indexer scores and
    stream update (attend_kernel, attend_top_kernel, index_score_kernel, hc_combine); the projections of one input
    become one launch per weight type (LinearGroup: attention's q_a + kv and compressor / indexer F16 matrices, the
    shared expert's gate + up), and in one-token steps the shared expert's SwiGLU and down product join the routed
    experts' launches (ExpertsAndShared)."""
    model.to(device)
    for m in model.modules():
        if isinstance(m, HyperConnection):
            m.reduce = hc_reduce
            m.combine = hc_combine
            m.update_reduce = hc_update_reduce
        if isinstance(m, Attention):
            m.attend = attend_kernel
            m.attend_top = attend_top_kernel
            m.index_score = index_score_kernel
            m.top_rows = top_rows_kernel
            m.head_norm_rope = head_norm_rope_kernel
            m.queries = functools.partial(queries_kernel, m)
            m.attend_chunk = functools.partial(attend_chunk_kernel, m)
            m.kv_row = kv_row_op
            m.group = LinearGroup(m.u_projections)
            if getattr(m, "qat", None) is indexer_qat:
                m.qat = qat_kernel
        if isinstance(m, Compressor):
            m.emit_rows = compress_emit_op
        if isinstance(m, FeedForward):
            m.group = LinearGroup((m.sh_gate, m.sh_up))
            m.route = route_kernel
            if ExpertsAndShared.applies(m):
                m.both_experts = ExpertsAndShared(m)
        if isinstance(getattr(m, "freq", None), torch.Tensor):
            m.freq = m.freq.to(device)
        if isinstance(m, Transformer):
            m.rope_freqs = tuple(f.to(device) for f in m.rope_freqs)
    return model


class _Captured:
    def __init__(self, graph: torch.cuda.CUDAGraph, tokens: torch.Tensor, h: torch.Tensor | None, out):
        self.graph, self.tokens, self.h, self.out = graph, tokens, h, out


class GraphedSteps(Steps):
    """Steps (runtime/steps.py) replayed from CUDA graphs: one per (T, last_only, indexer, bound) for `run`, one per
    (T, last_only, indexer, bound, n) for `commit`. A shape's graphs are captured by `prepare` or, failing that, on
    its first call (its first capture runs it once, compiling the Triton kernels). `run` returns logits and hc as
    fresh tensors and the rows as the graph's own outputs: valid until this object's next `run` (commit them before
    that)."""

    def __init__(self, model, cache, max_T: int = MAX_GRAPH_T):
        super().__init__(model, cache, MIN_BOUND)
        self.max_T = max_T
        # the chunk length whose runs without graphs go through the compiled blocks (`compiles`): with
        # DS4_COMPILE_PREFILL=1 only
        self.compiled_chunk = PREFILL_CHUNK if os.environ.get("DS4_COMPILE_PREFILL") == "1" else None
        # the chunk length whose prefill (run and commit of every row) replays a graph per (indexer, bound), captured
        # after the first such chunk ran eagerly; DS4_GRAPH_PREFILL=0: none, every chunk runs eagerly
        self.graphed_chunk = PREFILL_CHUNK if os.environ.get("DS4_GRAPH_PREFILL", "1") == "1" else None
        self.chunks: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.chunk_pool = None                  # the chunk graphs' one memory pool (their rows are not kept)
        self.chunk_io: _Captured | None = None  # tokens, h and (logits, hc): buffers every chunk graph shares
        self.start = torch.zeros((), dtype=torch.int64, device=self.device)   # position of the step's token 0
        self.graphs: dict[tuple, _Captured] = {}
        self.commits: dict[tuple, tuple] = {}  # key -> (graph, its CommitPlan or None)
        self.last: tuple | None = None          # key and rows of the latest graphed run

    def _call(self, g: _Captured, last_only: bool, indexer: bool, bound: int):
        args = (g.tokens,) if g.h is None else (g.tokens, g.h)
        return self.model(*args, self.start, self.layers(bound), last_only=last_only, indexer=indexer)

    def _graph(self, key: tuple, h: torch.Tensor | None) -> _Captured:
        """The run graph of key (T, last_only, indexer, bound), captured if new; h: [T, S, D] (the MTP head) or
        None."""
        g = self.graphs.get(key)
        if g is None:
            T = key[0]
            g = _Captured(None, torch.zeros(T, dtype=torch.int64, device=self.device),
                          None if h is None else torch.zeros_like(h), None)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):                     # warm-up: Triton compiles, lookup tables load
                self._call(g, *key[1:])
            torch.cuda.current_stream().wait_stream(side)
            g.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.graph):
                g.out = self._call(g, *key[1:])
            self.graphs[key] = g
        return g

    def _commit_graph(self, key: tuple, rows) -> torch.cuda.CUDAGraph:
        """The commit graph of key (T, last_only, indexer, bound, n) for the rows of run graph key[:4], captured (not
        executed) if new: one kernel (commit_triton), or CacheState.write where some rows are not contiguous."""
        c = self.commits.get(key)
        if c is None:
            plan = CommitPlan.build(self.cache.layers, self.cache.ratios, rows, key[4])
            if plan is not None:
                plan.load(self.start)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                if plan is None:
                    self.cache.write(rows, key[4], self.start)
                else:
                    plan.write(self.start)
            c = self.commits[key] = (graph, plan)         # the plan's table lives as long as its graph
        return c[0]

    def prepare(self, T: int, last_only: bool, h: torch.Tensor | None = None, first: int = 0,
                end: int | None = None) -> int:
        """Capture now the graphs of run(T tokens, last_only[, h]) and of its commits of 1..T rows, for each indexer
        flag and bound such a step can have from position `first` on, up to `end` (Steps.kinds), so that none is
        compiled or captured mid-stream (the first step past position 4 * index_top_k would be). Writes no cache
        row. Returns the graphs captured."""
        if T > self.max_T:
            return 0
        before = len(self.graphs) + len(self.commits)
        for indexer, bound in self.kinds(T, first, end):
            g = self._graph((T, last_only, indexer, bound), h)
            for n in range(1, T + 1):
                self._commit_graph((T, last_only, indexer, bound, n), g.out[2])
        return len(self.graphs) + len(self.commits) - before

    def run(self, tokens: list[int], h: torch.Tensor | None = None, last_only: bool = False, graph: bool = True):
        T = len(tokens)
        if not graph or T > self.max_T:
            self.last = None
            if self.compiles(T):
                return super().run(tokens, h, last_only)
            with torch.compiler.set_stance("force_eager"):      # no compile for a shape seen once
                return super().run(tokens, h, last_only)
        key = (T, last_only, self.indexer(T), self.bound(T))
        self.start.fill_(self.cache.pos)
        g = self._graph(key, h)
        g.tokens.copy_(torch.tensor(tokens, dtype=torch.int64))
        if h is not None:
            g.h.copy_(h)
        g.graph.replay()
        logits, hc, rows = g.out
        self.last = (key, rows)
        return logits.clone(), hc.clone(), rows

    def prefill(self, tokens: list[int], h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps.prefill; a chunk of graphed_chunk tokens replays its (indexer, bound)'s graph of the whole run and
        commit, captured when such a chunk first ran (eagerly). The chunk graphs share one memory pool and keep no
        output but the shared buffers of chunk_io, so together they hold about one eager chunk's temporaries."""
        T = len(tokens)
        if T != self.graphed_chunk:
            return super().prefill(tokens, h)
        key = (T, self.indexer(T), self.bound(T))
        if key not in self.chunks:
            logits, hc = super().prefill(tokens, h)     # compiles what it runs; the capture after it runs nothing
            if self.chunk_io is None:
                self.chunk_pool = torch.cuda.graph_pool_handle()
                self.chunk_io = _Captured(None, torch.zeros(T, dtype=torch.int64, device=self.device),
                                          None if h is None else torch.empty_like(h),
                                          (torch.empty_like(logits), torch.empty_like(hc)))
            self._capture_chunk(key)
            return logits, hc
        self.last = None
        io = self.chunk_io
        self.start.fill_(self.cache.pos)
        io.tokens.copy_(torch.tensor(tokens, dtype=torch.int64))
        if h is not None:
            io.h.copy_(h)
        self.cache.advance(T)
        self.chunks[key].replay()
        return io.out[0].clone(), io.out[1].clone()

    def _capture_chunk(self, key: tuple) -> None:
        """Capture (not run) the prefill graph of key (T, indexer, bound): the step of chunk_io's tokens (and h) at
        position self.start, its last row's logits and its hc copied to chunk_io.out, all of its rows written to the
        cache."""
        T, indexer, bound = key
        io = self.chunk_io
        graph = torch.cuda.CUDAGraph()
        with torch.compiler.set_stance("default" if self.compiles(T) else "force_eager"), \
                torch.cuda.graph(graph, pool=self.chunk_pool):
            logits, hc, rows = self._call(io, True, indexer, bound)
            io.out[0].copy_(logits)
            io.out[1].copy_(hc)
            self.cache.write(rows, T, self.start)
        self.chunks[key] = graph

    def compiles(self, T: int) -> bool:
        """Whether an eager run of T tokens (a prefill chunk) goes through the compiled blocks (where the model has
        them): a whole chunk of compiled_chunk tokens, one shape compiled once; a prompt's last, shorter chunk and the
        drafter's catch-up of it run eagerly."""
        return T == self.compiled_chunk

    def commit(self, rows, n: int) -> None:
        if n <= 0:
            return
        if self.last is None or rows is not self.last[1]:
            return super().commit(rows, n)        # rows of an eager run
        self.cache.advance(n)                     # checks the context; self.start still holds the old position
        self._commit_graph((*self.last[0], n), rows).replay()


# Horizontal fusion of a block's independent glue kernels (1-3 us each): on the H200, 43 Flash layers at --ctx 4096,
# a decode step's Inductor kernels 1401 -> 956 (2345 -> 1628 us), the step 10.26 -> 9.37 ms. Programmatic dependent
# launch of Inductor's kernels (sm_90+, as plugins/kernels/pdl.py does for ours): 9.32 -> 8.75 ms (BENCHMARKS.md).
INDUCTOR_OPTIONS = {"combo_kernels": True, "triton.enable_pdl": True}


def compile_blocks(*models: nn.Module, options: dict | None = None) -> None:
    """torch.compile every transformer block and the output head of these models in place (see the module
    docstring), with INDUCTOR_OPTIONS updated by `options` (torch._inductor.config names); DS4_PDL=0 drops Inductor's
    PDL too."""
    torch._dynamo.config.recompile_limit = 512          # block kinds x step lengths, all legitimate
    torch._dynamo.config.accumulated_recompile_limit = 4096
    options = INDUCTOR_OPTIONS | ({} if pdl_wanted() else {"triton.enable_pdl": False}) | (options or {})
    for m in models:
        for b in (m.blocks if hasattr(m, "blocks") else [m.block]):
            b.compile(fullgraph=True, dynamic=False, options=options)
        m.head = torch.compile(m.head, fullgraph=True, dynamic=False, options=options)
        if isinstance(m, Transformer):        # the embedding and RoPE tables: one kernel instead of ~12 a step
            m.step_inputs = torch.compile(m.step_inputs, fullgraph=True, dynamic=False, options=options)


def resident_bytes(weights) -> int:
    """Device bytes of a GGUF's weights in this backend: routed experts as their blocks, Q8_0 projections as
    split_q8's arrays (rows padded to 256 values), the F16 matrices applied through `linear` as float16, other
    F16/F32 tensors as float32, I32 (the hash-routing table) as int64. weights: model/weights.py's Weights, or any
    object with its specs, has, type_of, shape_of and nbytes (scripts/bench_decode.py's synthetic ones)."""
    total = 0
    for name in weights.specs:
        if weights.has(name):
            t, shape = weights.type_of(name), weights.shape_of(name)
            n = math.prod(shape)
            if t == N.F16 and weights.specs[name].matmul:
                total += 2 * n                                           # F16Linear
            elif t in (N.F16, N.F32, N.I32):
                total += (8 if t == N.I32 else 4) * n
            elif t == N.Q8_0 and len(shape) == 2:
                total += q8_triton.split_bytes(*shape)
            else:
                total += weights.nbytes(name)
    return total


def _check_memory(device, need: int, what: str) -> None:
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need > free:
        raise Ds4Error(f"{what}: the CUDA backend needs {need / 2**30:.1f} GiB of device memory for the weights, "
                       f"{device} has {free / 2**30:.1f} GiB free")


def open_engine(gguf_path: str | Path, mtp_path: str | Path | None = None, numerics: str = "ds4",
                device: str = "cuda", graphs: bool = True, compile: bool = False) -> Engine:
    """An Engine whose weights stay in their GGUF formats on `device`; graphs=False runs every step eagerly.
    Refuses in one line when the weights do not fit in the device's free memory."""
    gguf_file, cfg, weights = load_target(gguf_path)
    mtp_weights = load_mtp(mtp_path, cfg)[1] if mtp_path is not None else None
    if torch.device(device).type == "cuda":
        _check_memory(device, resident_bytes(weights) + (resident_bytes(mtp_weights) if mtp_weights else 0),
                      str(gguf_path) + (f" + {mtp_path}" if mtp_path is not None else ""))
    kernels = dict(experts=CudaExperts.from_weights, linear=cuda_linear)
    model = to_device(Transformer(cfg, weights, numerics, **kernels), device)
    mtp = to_device(MTPHead(model, mtp_weights, **kernels), device) if mtp_weights is not None else None
    if compile:
        compile_blocks(model, *([mtp] if mtp is not None else []))
    return Engine(model, Tokenizer.from_gguf(gguf_file), mtp, str(gguf_path), torch.float32, device,
                  steps=GraphedSteps if graphs else Steps, prefill_chunk=PREFILL_CHUNK)
