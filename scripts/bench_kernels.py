#!/usr/bin/env python3
"""Benchmark the Triton kernels (plugins/kernels) at DeepSeek V4 Flash shapes on one GPU.

    python3 scripts/bench_kernels.py [--budget SECONDS]      (writes $OUT/bench_kernels.json when OUT is set)

What it measures (synthetic blocks resident on the device: random bytes with moderate f16 scales, never
zeros; the kernels' time does not depend on the values):
  0. the copy bandwidth: a 2 GiB device-to-device copy, bytes read + written over the median time;
  1. one layer's routed MoE (ds4::MoE, k = 6 of E = 256, D = 4096, F = 2048), q2 mix (IQ2_XXS gate/up, Q2_K
     down) and q4 mix (Q4_K x3), T = 1, 2, 3, 4, 8, 16 tokens, with
       random routing: each token picks 6 distinct experts uniformly (the bytes grow with the distinct experts);
       shared routing (T > 1): all tokens pick the same 6 experts (the verify best case: T = 1's bytes);
  1b. the q2 MoE of a prefill chunk (T = 256, 512, 1024, 2048 with random routing, 1024 and 2048 with skewed
      routing; a long call, timed eagerly), each also with DS4_MOE_MMA the other way (moe_mma's kernels or not) and
      with DS4_MOE_WGMMA the other way (moe_mma's gate/up on wgmma or mma.sync);
  2. the Q8_0 projections of a layer and the LM head, T = 1..4 (case `q8_mma`: the tensor-core kernel q8_mma and
     _q8_rows side by side at T = 1..16, and the layer's sum for each; case `read`: a plain streaming read of each one's
     bytes, the time a kernel that only loads them takes at that size: the practical floor of a matrix-vector
     product, with the ramp and tail of one launch that the copy bandwidth's floor leaves out); the F16 products of
     a layer (router, compressors, indexer; each alone, and a layer's F16 projections of one input stacked as one
     matrix), T = 1..5 and 9;
  2b. decode attention (attend_triton) over 129 .. 8321 keys, T = 1, 2, 4 (ATTEND_KEYS);
  2c. prefill attention (attend_long_triton) of a 256-query block at the end of a 2048-token prompt's second
      chunk of 1024, for a window-only, a ratio-4 and a ratio-128 layer (the keys and masks model/attention.py
      forms), and the PyTorch attend it replaces, for comparison (timed eagerly);
  2c'. prefill attention of a ratio-4 layer once the indexer runs, a block of 256 queries at chunk start 4096,
      16384 and 65536: attend_top_triton (the window band of raw keys, then each query's 512 top rows by index)
      against attend_long_triton over the whole compressed cache masked to those rows (timed eagerly);
  2d. the indexer's scores of a prefill block (index_score_long_triton: 256 queries, the 1040 compressed rows of
      a 4160-token cache + 513 of a 2048-token chunk) and the PyTorch index_score it replaces (timed eagerly);
  2e. the hyper-connection reduction of a 2048-token prefill chunk (hc_pre_long_triton) and the PyTorch hc_sum_streams
      it replaces (timed eagerly);
  2e'. the indexer's scores of a decode or verify step (index_score_triton: 64 heads of 128) over TOPK_ROWS
      compressed rows, T = 1, 2, 4;
  2f. the indexer's top-k (top_rows_triton, k = 512) over TOPK_ROWS compressed rows, T = 1, 2, 4, and the stable
      torch.sort it replaces, for comparison;
  2f'. a 2048-token prefill chunk's projections through the CUDA backend's modules (Q8Linear, F16Linear past
      their kernels' row limit: the weight made float16, one GEMM), each Q8_0 and F16 matrix of a layer and the
      layer's sum (timed eagerly, L2 flushed between calls);
  2g. a compressor's rows of a short step (compress_emit_triton) at T = 1 (a token that emits and one that does
      not) and T = 5, for the ratio-128 and ratio-4 KV compressors and the ratio-4 indexer's, and the PyTorch
      emit_rows it replaces (uncompiled PyTorch ops in the same CUDA graph; compiled they are several kernels);
  3. small sweeps (timing only) of the launch shapes (rows per program, warps[, register cap; None = no cap]),
     of the one-pair MoE kernels' register prefetch, of the long calls' (CAP, rows, warps, stages), of the
     attention's keys per program and of the top-k kernel's warps, while the time budget lasts (--sweep-t: the
     one-pair MoE and Q8_0 sweeps only at those row counts, which may add T = 8 and 16 to the one-pair sweep).
Timing: medians of CUDA-graph replays (triton.testing.do_bench_cudagraph), each graph running R calls over R
different input sets (expert ids or weight copies) that together exceed 4x the L2 cache, so the weights come
from HBM as they do in a real decode step; reported times are per call.
Per case: the bytes that must move (distinct expert blocks or the weight matrix, plus activations read and the
output written), the floor = bytes / measured copy bandwidth, the achieved median, and floor / achieved.
Then an estimated decode step: 43 x (routed MoE + Q8_0 projections at T = 1, measured; the layer's F16 tensors
(HC mixers, router, compressors) at their floor, not benchmarked here) + the LM head; tokens/s against the
whole-model floor computed from the shapes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds4trt.model.attention import emit_rows, top_rows  # noqa: E402
from ds4trt.model.config import ModelConfig  # noqa: E402
from ds4trt.model.rope import inv_freq  # noqa: E402
from ds4trt.plugins.kernels import rows_triton as RT  # noqa: E402
from ds4trt.plugins.kernels import attn_triton as A  # noqa: E402
from ds4trt.plugins.kernels import f16_triton as F16  # noqa: E402
from ds4trt.plugins.kernels import hc_triton as H  # noqa: E402
from ds4trt.plugins.kernels import index_triton as I  # noqa: E402
from ds4trt.plugins.kernels import moe_triton as M  # noqa: E402
from ds4trt.plugins.kernels import moe_mma as MM  # noqa: E402
from ds4trt.plugins.kernels import q8_mma as QM  # noqa: E402
from ds4trt.plugins.kernels import q8_triton as Q  # noqa: E402
from ds4trt.plugins.kernels import topk_triton as TK  # noqa: E402

D, F, E, K_SLOTS, N_LAYER, N_VOCAB = 4096, 2048, 256, 6, 43, 129280
Q2_K, Q4_K, IQ2_XXS = 10, 12, 16
MIXES = {"q2": (IQ2_XXS, IQ2_XXS, Q2_K), "q4": (Q4_K, Q4_K, Q4_K)}
TS = (1, 2, 3, 4, 8, 16)
# (CAP, rows per program, warps, stages, activation parts) of the multi-pair kernels in long (prefill) calls, swept
# while the budget lasts
LONG_SWEEP = ((32, 64, 4, 1, 1), (32, 64, 4, 1, 2), (64, 64, 4, 1, 1), (64, 64, 4, 1, 2), (32, 64, 4, 2, 1),
              (16, 64, 4, 1, 1), (32, 32, 4, 1, 1), (32, 64, 2, 1, 1), (32, 128, 4, 1, 1), (64, 128, 8, 1, 1),
              (32, 128, 8, 1, 1), (32, 64, 8, 1, 1), (64, 32, 4, 1, 1))
# the same for calls with a Q4_K matrix, which keep both activation parts (moe_triton.LONG_CONFIGS_Q4)
LONG_SWEEP_Q4 = ((32, 128, 8, 1, 2), (64, 128, 8, 1, 2), (32, 64, 4, 1, 2), (64, 64, 4, 1, 2), (32, 64, 8, 1, 2),
                 (64, 64, 8, 1, 2), (16, 128, 8, 1, 2), (32, 128, 4, 1, 2), (32, 32, 4, 1, 2))
# (rows per program, warps, register cap, prefetch) of the one-pair MoE kernels at T = 1, each block type in turn
SINGLE_SWEEP = ((16, 2, None, False), (32, 2, None, False), (8, 2, None, False), (16, 1, None, False),
                (32, 4, None, False), (64, 4, None, False), (8, 4, None, False), (16, 4, None, False),
                (16, 4, None, True), (16, 8, None, False), (32, 4, None, True), (32, 8, None, False),
                (32, 8, None, True), (64, 8, None, False))
# (rows per program, warps[, min programs: K is split until there are that many[, prefetch: the next step's words
# loaded during this one[, blocks per tile: a step of 8 blocks as 8 / NB sub-steps]]]) of the Q8_0 kernel, by T. The NB
# = 2 / 4 entries (sm_90, scripts/sass_report.py): fewer registers at the same weight words per thread (T = 3 (32, 4,
# 528, 1, 4) 110 against the default's 128 without prefetch), so the prefetch fits at T = 2..4
Q8_SWEEP = {1: ((32, 2, 528, 1), (16, 2, 528, 1), (32, 2, 1056, 1), (16, 2, 1056, 1), (16, 4, 1056, 1),
                (32, 4, 1056, 1), (16, 4, 528, 1), (16, 8, 1056, 1), (32, 4, 528, 1), (32, 4), (16, 4, 528),
                (16, 4, 2112), (32, 4, 528, 1, 4), (64, 8, 528, 1, 4), (128, 4, 528, 1, 2)),
            2: ((32, 2, 528), (16, 2, 528), (32, 2, 1056), (32, 4, 528, 1), (16, 4, 528, 1), (32, 4, 1056, 1),
                (16, 4, 528), (32, 4, 528, 1, 4), (64, 4, 528, 1, 2), (64, 4, 528, 1, 4), (128, 8, 528, 1, 2)),
            3: ((16, 2, 528), (32, 2, 528), (16, 2, 1056), (16, 4, 528, 1), (16, 4, 1056, 1), (32, 4, 528, 1),
                (32, 4, 528), (32, 4, 528, 1, 4), (32, 4, 528, 0, 4), (64, 4, 528, 1, 2), (32, 4, 528, 1, 2),
                (64, 8, 528, 1, 2)),
            4: ((32, 2, 528, 1), (16, 2, 528, 1), (32, 2, 1056, 1), (32, 4, 528, 1), (16, 4, 528, 1), (32, 4, 1056, 1),
                (32, 4, 1056), (32, 4, 528, 1, 4), (64, 4, 528, 1, 2), (128, 8, 528, 1, 2), (32, 2, 528, 1, 2))}
MM_SWEEP_WARPS = (2, 4)              # moe_mma's warps a program other than its WARPS (--cases moe_long, the sweep,
                                     # which also runs its other gate/up table form, NIB, and gate/up pass, FUSE)
MMA_TS = (1, 2, 3, 4, 5, 8, 9, 16)   # rows of case q8_mma: decode, verify of 1..8 drafts, 16 (two x tiles)
SWEEP_T: set[int] | None = None     # --sweep-t: the T at which those sweeps run (None: each sweep's own default)
CLAMP = 10.0
# Q8_0 tensors of one layer, (name, N rows, K inputs per row, groups), and the LM head
Q8_LAYER = [("attn_q_a", 1024, 4096, 1), ("attn_q_b", 32768, 1024, 1), ("attn_kv", 512, 4096, 1),
            ("attn_output_a", 8192, 4096, 8), ("attn_output_b", 4096, 8192, 1),
            ("ffn_gate_shexp", 2048, 4096, 1), ("ffn_up_shexp", 2048, 4096, 1), ("ffn_down_shexp", 4096, 2048, 1)]
LM_HEAD = ("output", N_VOCAB, 4096, 1)
# F16 matrices applied by f16_matmul, (name, N rows, K): a ratio-4 layer's, and its F16 projections of the normed
# input u stacked as one matrix, what the CUDA backend's LinearGroup reads in one launch (attention compressor kv +
# gate 2 x 1024, indexer compressor kv + gate 2 x 256, indexer weights 64; a ratio-128 layer's compressor pair:
# 2 x 512 rows)
F16_LAYER = [("ffn_gate_inp", 256, 4096), ("attn_compressor_kv", 1024, 4096), ("indexer_compressor_kv", 256, 4096),
             ("indexer.attn_q_b", 8192, 1024), ("indexer.proj", 64, 4096), ("u_group_ratio4", 2624, 4096),
             ("u_group_ratio128", 1024, 4096)]
# (rows per program, K tile) of the F16 kernel
F16_SWEEP = ((1, 2048), (1, 1024), (2, 1024), (2, 512), (4, 512), (4, 256), (8, 256), (16, 128))
# decode attention (64 heads of 512, one KV head): keys of a window-only layer (128 + 1), of a ratio-4 layer at a
# 400-row cache (128 + 100 + 1), of 128 raw + 512 gathered top-k rows, and of the whole masked compressed cache at
# 4096, 8192 and 32768 rows (128 + capacity / 4 + 1)
ATTEND_KEYS = (129, 229, 640, 1153, 2177, 8321)
# (keys per chunk, chunks per program, warps) of _attend_part; the default is attn_triton.CONFIG
ATTEND_SWEEP = ((32, 1, 8), (8, 4, 2), (8, 8, 1), (4, 8, 1), (4, 4, 1), (4, 16, 1), (8, 2, 1))
# (BT, HB, BN, DC, DV, warps, stages, parts) of _attend_long; the default is attn_triton.LONG_CONFIG. With one
# float16 part (~3e-4 relative, tests/test_kernels.py): a third of the tensor-core products, and at DV = d the logits
# made once per query instead of twice (no spills on sm_90, scripts/sass_report.py --long --attend-config)
ATTEND_LONG_SWEEP = ((1, 64, 64, 64, 256, 4, 3, 2), (1, 64, 64, 64, 128, 4, 3, 2), (2, 64, 64, 64, 128, 8, 3, 2),
                     (1, 64, 128, 64, 128, 4, 3, 2), (1, 64, 128, 32, 128, 4, 3, 2), (1, 64, 128, 64, 256, 8, 3, 2),
                     (4, 16, 32, 64, 256, 4, 3, 2), (4, 16, 64, 64, 256, 4, 3, 2), (1, 64, 32, 64, 256, 4, 4, 2),
                     (2, 64, 32, 64, 128, 8, 3, 2), (1, 64, 32, 32, 128, 4, 2, 2),
                     (2, 64, 64, 64, 256, 8, 3, 1), (1, 64, 64, 64, 256, 8, 3, 1), (1, 64, 64, 64, 512, 8, 2, 1),
                     (1, 64, 32, 64, 512, 8, 2, 1), (1, 64, 32, 64, 512, 8, 3, 1), (1, 64, 32, 32, 512, 8, 2, 1),
                     (1, 64, 64, 128, 512, 8, 2, 1))
# (HB, BN, DC, DV, warps, stages, parts) of _attend_top; the default is attn_triton.TOP_CONFIG
# (32, ..., 256, 8, 3): half the heads and twice the output dims of TOP_CONFIG, so the logits of a key block are made
# twice per query instead of four times (~40 % fewer tensor-core products); no spills on sm_90 (scripts/sass_report.py)
ATTEND_TOP_SWEEP = ((64, 64, 32, 256, 8, 3, 2), (64, 64, 32, 128, 4, 3, 2), (64, 64, 64, 128, 4, 4, 2),
                    (64, 64, 64, 64, 4, 3, 2), (64, 64, 64, 128, 4, 2, 2), (32, 64, 64, 128, 4, 3, 2),
                    (32, 64, 64, 256, 8, 3, 2), (32, 64, 32, 256, 8, 3, 2),
                    (64, 64, 64, 256, 8, 3, 1), (64, 64, 32, 256, 8, 3, 1), (64, 32, 64, 256, 8, 3, 1),
                    (64, 32, 64, 512, 8, 2, 1))
TOP_STARTS = (4096, 16384, 65536)      # the chunk positions of attend_top's block
# (keys BN, queries TB, warps) of _index_score_long; the default is index_triton.LONG_CONFIG
INDEX_LONG_SWEEP = ((128, 16, 4), (128, 16, 8), (32, 16, 4), (64, 32, 4), (64, 8, 4), (128, 32, 8))
# (tokens BT, inputs per step BK, splits, warps) of _hc_dots_long; the default is hc_triton.LONG_CONFIG
HC_LONG_SWEEP = ((128, 64, 8, 8), (64, 32, 8, 4), (64, 64, 16, 4), (64, 64, 4, 4), (32, 64, 16, 4), (64, 128, 8, 4))
# the indexer's rows of one decode step: compressed rows of a 4096-token cache (the CLI's default) + 4, of 16k, 32k
# and 64k tokens (the kernel's limit, MAX_N)
TOPK_ROWS = (1028, 4100, 8196, 16384)
# (keys KB, warps, precision) of _index_score; the default is index_triton.CONFIG
INDEX_SWEEP = ((16, 4, "ieee"), (16, 8, "ieee"), (32, 4, "ieee"), (16, 4, "tf32x3"), (32, 4, "tf32x3"),
               (64, 4, "tf32x3"), (32, 8, "tf32x3"), (64, 8, "tf32x3"))
TOPK_WARPS = (2, 4, 8, 16)       # top_rows_triton's sweep (the default: 8 from 2048 scores on, else 4; 1 warp took
# 2-10x as long)
# the f16 fields of each block type: byte offsets of its scales (set to moderate values)
SCALE_FIELDS = {Q2_K: (80, 82), Q4_K: (0, 2), IQ2_XXS: (0,), 8: (0,)}
BLOCK = {Q2_K: (256, 84), Q4_K: (256, 144), IQ2_XXS: (256, 66), 8: (32, 34)}

DEV = "cuda"
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


def uniform_routing(T: int, gen: torch.Generator | None = None, device: str = "cpu") -> torch.Tensor:
    """[T, K_SLOTS] int64: each token's K_SLOTS distinct experts of E, uniformly at random (gen on `device`)."""
    return torch.stack([torch.randperm(E, generator=gen, device=device)[:K_SLOTS] for _ in range(T)])


def random_blocks(ggml_type: int, rows: int, cols: int, lead: int = 1, gen=None) -> torch.Tensor:
    """uint8 [lead, rows, row bytes] of random blocks whose f16 scales are moderate (1e-3..2e-3)."""
    qk, bs = BLOCK[ggml_type]
    nb = cols // qk
    t = torch.randint(0, 256, (lead, rows, nb, bs), dtype=torch.uint8, device=DEV, generator=gen)
    for off in SCALE_FIELDS[ggml_type]:
        s = (torch.rand(lead, rows, nb, device=DEV, generator=gen) * 1e-3 + 1e-3).half()
        t[..., off:off + 2] = s.view(torch.uint8).view(lead, rows, nb, 2)
    return t.view(lead, rows, nb * bs)


def time_graph(fn, calls: int, rep_ms: int = 30) -> float:
    """Median per-call milliseconds of fn (which makes `calls` calls), replayed from a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") / calls


def guarded(label: str, results: list, thunk) -> None:
    """Run one case; a failure is logged and recorded, and the benchmark goes on to the next case."""
    try:
        thunk()
    except Exception as e:  # noqa: BLE001 -- keep the table of the cases that ran
        log(f"{label}: FAILED {type(e).__name__}: {e}")
        results.append(dict(name=label, kind="error", error=f"{type(e).__name__}: {e}"))


def case(name: str, T: int, nbytes: float, ms: float, bw: float, **extra) -> dict:
    floor_us = nbytes / bw * 1e6
    us = ms * 1e3
    row = dict(name=name, T=T, bytes=nbytes, floor_us=floor_us, time_us=us, fraction=floor_us / us, **extra)
    log(f"{name:34s} T={T:2d}  {nbytes / 1e6:9.2f} MB  floor {floor_us:8.2f} us  "
        f"achieved {us:8.2f} us  {100 * floor_us / us:5.1f} % of floor")
    return row


# ---------------------------------------------------------------------------------------------------

def copy_bandwidth() -> float:
    n = 1 << 31
    a = torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)


def matmul_flops(n: int = 8192) -> float:
    """The card's bfloat16 tensor-core rate now, in FLOP/s: an n x n x n product (cuBLAS), median of ~300 ms of
    repeats. Beside copy_bandwidth, a log's fingerprint of the machine for compute-bound figures (the prefill): two
    H100 80GB HBM3 of the same session ran the same 28-layer prefill in 234.8 and 349.8 ms (BENCHMARKS.md, the
    sixtieth session), so figures from different calls compare only where this rate agrees."""
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / (ms * 1e-3)


def expert_bytes(types) -> int:
    return sum(rows * (cols // BLOCK[t][0]) * BLOCK[t][1] for t, (rows, cols) in zip(types, ((F, D), (F, D), (D, F))))


def bench_moe(mix: str, bw: float, l2: int, results: list, sweeps: list | None) -> None:
    """Append the cases to results; append sweep thunks (run later, while the budget lasts) to sweeps."""
    types = MIXES[mix]
    gen = torch.Generator(device=DEV).manual_seed(1)
    blocks = [random_blocks(t, r, c, lead=E, gen=gen)
              for t, (r, c) in zip(types, ((F, D), (F, D), (D, F)))]
    blocks = [b.view(E, b.shape[1], b.shape[2]) for b in blocks]
    per_expert = expert_bytes(types)
    rng = torch.Generator(device="cpu").manual_seed(2)
    for routing in ("random", "shared"):
        for T in TS:
            if routing == "shared" and T == 1:
                continue
            per_call_guess = 6 * per_expert if routing == "shared" else min(E, 6 * T) * per_expert
            R = min(32, max(4, math.ceil(4 * l2 / per_call_guess)))
            sets, nbytes = [], 0.0
            for _ in range(R):
                if routing == "random":
                    ids = uniform_routing(T, rng)
                else:
                    ids = torch.randperm(E, generator=rng)[:K_SLOTS].repeat(T, 1)
                v = torch.randn(T, D, generator=rng) * 3
                w = torch.rand(T, K_SLOTS, generator=rng) * 0.9 + 0.1
                sets.append([x.to(DEV) for x in (v, ids, w)])
                nbytes += len(torch.unique(ids)) * per_expert + 2 * T * D * 4 + T * K_SLOTS * 12
            ws = M.MoEWorkspace.create(T, K_SLOTS, D, F, DEV)
            out = torch.empty(T, D, device=DEV)

            def fn(sets=sets, ws=ws, out=out, **cfg):
                for v, ids, w in sets:
                    M.moe_forward(v, ids, w, *blocks, *types, CLAMP, out=out, workspace=ws, **cfg)
            guarded(f"moe {mix} {routing} T={T}", results, lambda fn=fn, R=R, T=T, nb=nbytes / R: results.append(
                case(f"moe {mix} {routing}", T, nb, time_graph(fn, R), bw, kind="moe", mix=mix, routing=routing)))
            if sweeps is not None and routing == "random" and swept_t(T, T <= 4):
                # one-pair kernels: each block type of the mix in turn, the others at their defaults; at T = 2..4
                # (verify; 8 and 16 when --sweep-t names them) the types whose tiles SHORT_CONFIG sets for calls of
                # 2..16 tokens
                short = {t for _, c in M.SHORT_CONFIG for t in c}
                for t in sorted(set(types) if T == 1 else set(types) & short):
                    for cfg in SINGLE_SWEEP:
                        if cfg == M.one_pair_config(T)[t]:
                            continue
                        sc = {t: cfg}
                        sweeps.append(lambda sc=sc, fn=fn, R=R, T=T, nb=nbytes / R: results.append(case(
                            f"  sweep single_config={sc}", T, nb, time_graph(lambda: fn(single_config=sc), R), bw,
                            kind="sweep_moe", mix=mix, routing="random", config=str(sc))))
            if sweeps is not None and mix == "q2" and (routing, T) == ("shared", 8):    # T <= 4: one-pair items only
                # not (128, 8): 240 KB of shared memory at 3 stages (warmups.moe_gateup_multi(...).metadata.shared)
                for cfg in ((32, 4), (64, 4)):
                    sweeps.append(lambda cfg=cfg, fn=fn, R=R, T=T, nb=nbytes / R: results.append(case(
                        f"  sweep multi_config={cfg}", T, nb, time_graph(lambda: fn(multi_config=cfg), R), bw,
                        kind="sweep_moe", mix=mix, routing="shared", config=list(cfg))))


def bench_moe_long(mix: str, bw: float, results: list, sweeps: list | None, configs: tuple = ()) -> None:
    """One layer's routed MoE for a prefill chunk (T = 256, 512, 1024 and 2048, random routing; T = 1024 and 2048
    skewed: each token's 6 experts drawn without replacement with probabilities ~ 1 / rank^0.8 over a shuffled
    ranking, so that a few experts take many tokens and many take few, as in a prompt that crowds some experts), timed
    eagerly (do_bench, L2 flushed between calls), at long_launch's config and at each of `configs` (--long-config).
    Bytes: every touched expert once."""
    types = MIXES[mix]
    gen = torch.Generator(device=DEV).manual_seed(4)
    blocks = [random_blocks(t, r, c, lead=E, gen=gen).view(E, r, -1)
              for t, (r, c) in zip(types, ((F, D), (F, D), (D, F)))]
    rng = torch.Generator(device="cpu").manual_seed(5)
    skew = (1.0 / torch.arange(1, E + 1) ** 0.8)[torch.randperm(E, generator=rng)]
    runs = []                                             # (T, its default config, its timing closure)
    for T, routing in ((256, "random"), (512, "random"), (1024, "random"), (2048, "random"), (1024, "skewed"),
                       (2048, "skewed")):
        if routing == "random":
            ids = uniform_routing(T, rng)
        else:
            ids = torch.multinomial(skew.expand(T, E), K_SLOTS, generator=rng)
        v, w = torch.randn(T, D, generator=rng) * 3, torch.rand(T, K_SLOTS, generator=rng) * 0.9 + 0.1
        nbytes = len(torch.unique(ids)) * expert_bytes(types) + 2 * T * D * 4 + T * K_SLOTS * 12
        v, ids, w = (x.to(DEV) for x in (v, ids, w))

        default = M.long_launch(ids.numel(), E, types, F, torch.device(DEV))

        def run(T=T, v=v, ids=ids, w=w, nbytes=nbytes, cfg=default, label="", routing=routing):
            ms = do_bench(lambda: M.moe_forward(v, ids, w, *blocks, *types, CLAMP, long_config=cfg), warmup=3, rep=200,
                          return_mode="median")
            name = f"moe {mix} prefill" + (" skewed" if routing == "skewed" else "")
            results.append(case(name + label, T, nbytes, ms, bw, kind="moe_long" if not label else "sweep_moe",
                                mix=mix, routing=routing, config=list(cfg),
                                layers_tokens_per_s=T / (N_LAYER * ms * 1e-3),
                                most_pairs_per_expert=int(torch.bincount(ids.flatten(), minlength=E).max())))
        guarded(f"moe {mix} prefill {routing} T={T}", results, run)
        for cfg in configs:                                 # --long-config: these launches too, beside the default
            guarded(f"moe {mix} prefill {routing} T={T} long_config={cfg}", results,
                    lambda cfg=cfg, run=run: run(cfg=cfg, label=f" long_config={cfg}"))
        if mix == "q2":            # the same call with DS4_MOE_MMA the other way (moe_mma.DEFAULT_MODE's other); in
            def run_env(run=run, mma="0", warps=None, nib=None, fuse=None, minb=None, wg=None):   # the sweep,
                os.environ["DS4_MOE_MMA"] = mma               # moe_mma's kernels at other warps / table form /
                if wg is not None:                            # gate-up pass / programs per SM / wgmma or not
                    os.environ["DS4_MOE_WGMMA"] = wg
                saved = dict(MM.WARPS), MM.NIB, dict(MM.FUSE), dict(MM.MIN_BLOCKS), dict(MM.WG_MIN_BLOCKS)
                MM.WARPS.update({cap: warps for cap in MM.WARPS} if warps else {})
                MM.NIB = saved[1] if nib is None else nib
                MM.FUSE.update({cap: fuse for cap in MM.FUSE} if fuse is not None else {})
                MM.MIN_BLOCKS.update({cap: minb for cap in MM.MIN_BLOCKS} if minb else {})
                MM.WG_MIN_BLOCKS.update({cap: minb for cap in MM.WG_MIN_BLOCKS} if minb else {})
                try:
                    run(label=f" (DS4_MOE_MMA={mma}" + (f", DS4_MOE_WGMMA={wg}" if wg is not None else "")
                        + (f", {warps} warps" if warps else "")
                        + (f", NIB={int(nib)}" if nib is not None else "")
                        + (f", FUSE={int(fuse)}" if fuse is not None else "")
                        + (f", MINB={minb}" if minb else "") + ")")
                finally:
                    del os.environ["DS4_MOE_MMA"]
                    os.environ.pop("DS4_MOE_WGMMA", None)
                    MM.WARPS.update(saved[0])
                    MM.NIB = saved[1]
                    MM.FUSE.update(saved[2])
                    MM.MIN_BLOCKS.update(saved[3])
                    MM.WG_MIN_BLOCKS.update(saved[4])
            other = "0" if MM.DEFAULT_MODE == "1" else "1"
            guarded(f"moe {mix} prefill {routing} T={T} DS4_MOE_MMA={other}", results,
                    lambda run_env=run_env, other=other: run_env(mma=other))
            wg_other = "0" if MM.WG_DEFAULT_MODE == "1" else "1"       # moe_mma's gate/up on wgmma or not
            guarded(f"moe {mix} prefill {routing} T={T} DS4_MOE_WGMMA={wg_other}", results,
                    lambda run_env=run_env, wg_other=wg_other: run_env(mma="1", wg=wg_other))
            if sweeps is not None and T >= 512:
                sweeps.append(lambda run_env=run_env: run_env(mma="1", nib=not MM.NIB, minb=1))   # no spills
                sweeps.append(lambda run_env=run_env: run_env(mma="1", fuse=not MM.FUSE[32]))
                for warps in MM_SWEEP_WARPS:
                    sweeps.append(lambda run_env=run_env, warps=warps: run_env(mma="1", warps=warps))
                sweeps.append(lambda run_env=run_env: run_env(mma="1", minb=1))     # one program an SM
                for minb in (1, 2):                                                   # the wgmma gate/up's
                    sweeps.append(lambda run_env=run_env, minb=minb: run_env(mma="1", wg="1", minb=minb))
                # 4 warps, four programs an SM: CAP 32's gate/up 126 registers, no spills (sm_90 offline)
                sweeps.append(lambda run_env=run_env: run_env(mma="1", warps=4, minb=4))
        if T >= 512:
            runs.append((T, default, run))
    for cfg in (LONG_SWEEP_Q4 if Q4_K in types else LONG_SWEEP) if sweeps is not None else ():   # longest first
        for T, default, run in sorted(runs, key=lambda r: -r[0]):
            if cfg != default:
                sweeps.append(lambda cfg=cfg, run=run: run(cfg=cfg, label=f" sweep long_config={cfg}"))


@triton.jit
def _read_words(w_ptr, out_ptr, n, CH: tl.constexpr, BW: tl.constexpr):
    """Program p sums words p*CH .. p*CH+CH-1 of w (int32; those past n masked) BW at a time (contiguous: 128-bit
    loads) and stores the sum, so that nothing but the loads is left to time."""
    base = tl.program_id(0).to(tl.int64) * CH
    acc = tl.zeros([BW], tl.int32)
    for k in range(0, CH, BW):
        i = base + k + tl.arange(0, BW)
        acc += tl.load(w_ptr + i, mask=i < n, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


READ_PROGRAMS = (264, 528, 1056, 2112, 4224)   # bench_read's launches (2..32 programs per SM of an H200); the best


def bench_read(bw: float, l2: int, results: list) -> None:
    """A streaming read of the bytes of each Q8_0 projection (and the LM head), timed like bench_q8 (a CUDA graph
    over copies that exceed 4x the L2): the best of READ_PROGRAMS launches of _read_words (4 warps, 2 KB per step)."""
    for name, N, K, G in Q8_LAYER + [LM_HEAD]:
        wbytes = N * K // 32 * 34
        n = wbytes // 4
        C = min(64, max(1, math.ceil(4 * l2 / wbytes)))
        ws = [torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32, device=DEV) for _ in range(C)]
        best = None
        for programs in READ_PROGRAMS:
            ch = triton.cdiv(triton.cdiv(n, programs), 512) * 512
            out = torch.empty(triton.cdiv(n, ch), dtype=torch.int32, device=DEV)

            def fn(out=out, ws=ws, ch=ch, n=n):
                for w in ws:
                    _read_words[(out.numel(),)](w, out, n, CH=ch, BW=512, num_warps=4)
            ms = time_graph(fn, C)
            best = ms if best is None or ms < best else best
        results.append(case(f"read {name} {N}x{K}", 1, wbytes, best, bw, kind="read", tensor=name))
        del ws


def swept_t(T: int, by_default: bool) -> bool:
    """Whether the one-pair MoE and Q8_0 sweeps run at T: as --sweep-t names, else by_default."""
    return by_default if SWEEP_T is None else T in SWEEP_T


def bench_q8(bw: float, l2: int, results: list, sweeps: list | None) -> None:
    gen = torch.Generator(device=DEV).manual_seed(3)
    for name, N, K, G in Q8_LAYER + [LM_HEAD]:
        wbytes = N * K // 32 * 34
        C = min(64, max(1, math.ceil(4 * l2 / wbytes)))
        ws = [Q.split_q8(random_blocks(8, N, K, gen=gen), N, K) for _ in range(C)]
        for T in (1, 2, 3, 4, 5, 9):          # 5, 9: two and three launches (verify of 4 and of 8 drafts)
            x = torch.randn(T, G * K, device=DEV, generator=gen)
            out = torch.empty(T, N, device=DEV)

            def fn(x=x, out=out, ws=ws, N=N, K=K, G=G, config=None):
                for w in ws:
                    Q.q8_matmul(x, *w, K, groups=G, out=out, config=config)
            nbytes = wbytes + x.numel() * 4 + out.numel() * 4
            label = f"q8 {name} {N}x{K}" + (f" ({G} groups)" if G > 1 else "")
            guarded(f"{label} T={T}", results,
                    lambda fn=fn, C=C, T=T, nb=nbytes, label=label, name=name: results.append(
                        case(label, T, nb, time_graph(fn, C), bw, kind="q8", tensor=name)))
            if sweeps is not None and T in Q8_SWEEP and swept_t(T, True) and name in (
                    "attn_q_b", "attn_output_a", "attn_output_b", "ffn_gate_shexp", "output"):
                for cfg in Q8_SWEEP[T]:
                    sweeps.append(lambda cfg=cfg, fn=fn, C=C, T=T, nb=nbytes, name=name: results.append(case(
                        f"  sweep config={cfg}", T, nb, time_graph(lambda: fn(config=cfg), C), bw,
                        kind="sweep_q8", tensor=name, config=list(cfg))))


def bench_q8_mma(bw: float, l2: int, results: list, sweeps: list | None) -> None:
    """The tensor-core Q8_0 kernel (q8_mma.q8_mma_matmul) against q8_matmul's _q8_rows on the same weights and x: a
    layer's Q8_0 tensors and the LM head at MMA_TS rows; then each kernel's sum over the layer's tensors at each T
    (what a step of T rows spends on them, 43 times) and q8_mma.SWEEP's launches at T = 1, 3, 9 (--sweep-t) on the
    32 MB projections and the LM head."""
    os.environ["DS4_Q8_MMA"] = "0"                   # q8_matmul here is the Triton kernel
    gen = torch.Generator(device=DEV).manual_seed(10)
    layer = {}                                        # (kind, T) -> the layer's sum, us
    for name, N, K, G in Q8_LAYER + [LM_HEAD]:
        wbytes = N * K // 32 * 34
        C = min(64, max(1, math.ceil(4 * l2 / wbytes)))
        ws = [Q.split_q8(random_blocks(8, N, K, gen=gen), N, K) for _ in range(C)]
        label = f"{name} {N}x{K}" + (f" ({G} groups)" if G > 1 else "")
        for T in MMA_TS:
            x = torch.randn(T, G * K, device=DEV, generator=gen)
            out = torch.empty(T, N, device=DEV)
            nbytes = wbytes + x.numel() * 4 + out.numel() * 4
            for kind, matmul in (("q8", Q.q8_matmul), ("q8_mma", QM.q8_mma_matmul)):
                def fn(x=x, out=out, ws=ws, K=K, G=G, matmul=matmul, config=None):
                    for w in ws:
                        matmul(x, *w, K, groups=G, out=out, config=config)

                def run(fn=fn, C=C, T=T, nb=nbytes, kind=kind, name=name):
                    row = case(f"{kind} {label}", T, nb, time_graph(fn, C), bw, kind=kind + "_vs", tensor=name)
                    results.append(row)
                    if name != LM_HEAD[0]:
                        layer[kind, T] = layer.get((kind, T), 0.0) + row["time_us"]
                guarded(f"{kind} {label} T={T}", results, run)
                if kind == "q8_mma" and sweeps is not None and swept_t(T, T in (1, 3, 9)) and name in (
                        "attn_q_b", "attn_output_a", "attn_output_b", "output"):
                    for cfg in QM.SWEEP:
                        sweeps.append(lambda cfg=cfg, fn=fn, C=C, T=T, nb=nbytes, name=name: results.append(case(
                            f"  sweep config={cfg}", T, nb, time_graph(lambda: fn(config=cfg), C), bw,
                            kind="sweep_q8_mma", tensor=name, config=list(cfg))))
    for T in MMA_TS:
        log(f"a layer's Q8_0 products at T = {T}: _q8_rows {layer.get(('q8', T), float('nan')):.1f} us, "
            f"q8_mma {layer.get(('q8_mma', T), float('nan')):.1f} us")


def bench_f16(bw: float, l2: int, results: list, sweeps: list | None) -> None:
    gen = torch.Generator(device=DEV).manual_seed(4)
    for name, N, K in F16_LAYER:
        wbytes = 2 * N * K
        C = min(64, max(1, math.ceil(4 * l2 / wbytes)))
        ws = [torch.randn(N, K, device=DEV, generator=gen).half() for _ in range(C)]
        for T in (1, 2, 3, 4, 5, 9):          # 5, 9: two and three launches (verify of 4 and of 8 drafts)
            x = torch.randn(T, K, device=DEV, generator=gen)

            def fn(x=x, ws=ws, config=None):
                for w in ws:
                    F16.f16_matmul(x, w, config=config)
            nbytes = wbytes + x.numel() * 4 + T * N * 4
            label = f"f16 {name} {N}x{K}"
            guarded(f"{label} T={T}", results, lambda fn=fn, C=C, T=T, nb=nbytes, label=label, name=name:
                    results.append(case(label, T, nb, time_graph(fn, C), bw, kind="f16", tensor=name)))
            if sweeps is not None and T in (1, 2, 4):
                for cfg in F16_SWEEP:
                    if cfg != F16.launch_shape(N, K, T):
                        sweeps.append(lambda cfg=cfg, fn=fn, C=C, T=T, nb=nbytes, name=name: results.append(case(
                            f"  sweep config={cfg}", T, nb, time_graph(lambda: fn(config=cfg), C), bw,
                            kind="sweep_f16", tensor=name, config=list(cfg))))


def bench_project(bw: float, results: list) -> None:
    """A 2048-token prefill chunk's projections (case 2f'). Bytes: the weight in its GGUF format, x read, y
    written; the floor a GEMM that reads them once would have (the tensor-core work, ~0.7 ms per layer at the
    H200's bf16 rate, is not counted)."""
    from ds4trt.runtime.backends.cuda import F16Linear, Q8Linear
    gen = torch.Generator(device=DEV).manual_seed(9)
    T, total = 2048, 0.0
    mods = [(name, N, K, G, Q8Linear(random_blocks(8, N, K, gen=gen)[0], N, K, G)) for name, N, K, G in Q8_LAYER]
    mods += [(name, N, K, 1, F16Linear(torch.randn(N, K, device=DEV, generator=gen) / K ** 0.5))
             for name, N, K in F16_LAYER if not name.startswith("u_group")]
    for name, N, K, G, mod in mods:
        x = torch.randn(T, G * K, device=DEV, generator=gen)
        wbytes = N * K * (34 / 32 if isinstance(mod, Q8Linear) else 2)
        nbytes = wbytes + x.numel() * 4 + T * N * 4

        def run(mod=mod, x=x, name=name, nbytes=nbytes):
            nonlocal total
            ms = do_bench(lambda: mod(x), warmup=3, rep=50, return_mode="median")
            total += ms
            results.append(case(f"project {name}", T, nbytes, ms, bw, kind="project"))
        guarded(f"project {name}", results, run)
    log(f"a layer's projections of a {T}-token chunk (the F16 ones as separate matrices): {total:.3f} ms")


def bench_attend(bw: float, l2: int, results: list, sweeps: list | None) -> None:
    """attend_triton at T = 1, 2, 4 over ATTEND_KEYS keys (90 % visible; the kernel reads every key either way)."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    H, d = 64, 512
    for K in ATTEND_KEYS:
        kbytes = K * d * 4
        C = min(64, max(1, math.ceil(4 * l2 / kbytes)))
        ks = [torch.randn(K, d, device=DEV, generator=gen) for _ in range(C)]
        sinks = torch.randn(H, device=DEV, generator=gen)
        for T in (1, 2, 4):
            q = torch.randn(T, H, d, device=DEV, generator=gen)
            mask = torch.rand(T, K, device=DEV, generator=gen) < 0.9
            ang = torch.rand(T, 32, device=DEV, generator=gen) * 100
            cos, sin = torch.cos(ang), torch.sin(ang)

            def fn(q=q, mask=mask, ks=ks, cos=cos, sin=sin, config=None):
                for k in ks:
                    A.attend_triton(q, k, mask, sinks, cos, sin, config=config)
            nbytes = kbytes + T * K + 2 * q.numel() * 4
            label = f"attend {K} keys"
            guarded(f"{label} T={T}", results, lambda fn=fn, C=C, T=T, nb=nbytes, label=label, K=K:
                    results.append(case(label, T, nb, time_graph(fn, C), bw, kind="attend", keys=K)))
            if sweeps is not None and T in (1, 4):
                for cfg in ATTEND_SWEEP:
                    sweeps.append(lambda cfg=cfg, fn=fn, C=C, T=T, nb=nbytes, K=K: results.append(case(
                        f"  sweep config={cfg}", T, nb, time_graph(lambda: fn(config=cfg), C), bw,
                        kind="sweep_attend", keys=K, config=list(cfg))))


def rotation(T: int, pairs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, pairs] of random angles: the inverse RoPE the prefill attention kernels apply to each output's
    tail."""
    ang = torch.rand(T, pairs, device=DEV, generator=gen) * 100
    return torch.cos(ang), torch.sin(ang)


def long_attention_block(ratio: int, a: int = 768, qb: int = 256, start: int = 1024, T: int = 1024,
                         ctx: int = 4096, W: int = 128) -> tuple[int, torch.Tensor]:
    """(K, mask [qb, K]) of model/attention.py's query block a..a+qb-1 of a chunk of T tokens at `start`: the raw
    window keys a .. a+qb+W-2 (a band of W per query) and, for ratio R, the compressed cache (ctx / R rows, the
    start / R first visible) and the rows of the chunk's T // R + 1 tokens that may emit (every R-th), each visible
    from its token on; on ratio-4 layers the indexer keeps its top-k = 512 of them, here all (at most 512 are
    visible)."""
    i = torch.arange(qb, device=DEV)[:, None]
    raw = torch.arange(qb + W - 1, device=DEV)[None, :]
    masks = [(raw >= i) & (raw < i + W)]
    if ratio:
        kc = ctx // ratio
        new = (ratio - 1 - start) % ratio + ratio * torch.arange(T // ratio + 1, device=DEV)[None, :]
        masks.append((torch.arange(kc, device=DEV) < start // ratio)[None, :].expand(qb, kc))
        masks.append((new < T) & (new <= a + i))
    mask = torch.cat(masks, dim=1)
    return mask.shape[1], mask


def bench_attend_long(bw: float, results: list, sweeps: list | None) -> None:
    """attend_long_triton and model/attention.py attend_unrotate on one prefill query block per layer kind (see
    long_attention_block); eager medians (do_bench), the keys L2-resident as in a prefill."""
    from ds4trt.model.attention import attend_unrotate
    gen = torch.Generator(device=DEV).manual_seed(7)
    H, d = 64, 512
    for ratio in (0, 4, 128):
        K, mask = long_attention_block(ratio)
        q = torch.randn(mask.shape[0], H, d, device=DEV, generator=gen)
        k = torch.randn(K, d, device=DEV, generator=gen)
        sinks = torch.randn(H, device=DEV, generator=gen)
        cos, sin = rotation(mask.shape[0], d // 16, gen)
        nbytes = 2 * q.numel() * 4 + k.numel() * 4 + mask.numel()
        label = f"attend_long ratio {ratio} ({K} keys)"
        for name, fn in ((label, lambda: A.attend_long_triton(q, k, mask, sinks, cos, sin)),
                         (f"torch attend ratio {ratio}", lambda: attend_unrotate(q, k, mask, sinks, cos, sin))):
            guarded(name, results, lambda fn=fn, name=name, K=K, ratio=ratio: results.append(case(
                name, q.shape[0], nbytes, do_bench(fn, warmup=5, rep=100, return_mode="median"), bw,
                kind="attend_long", keys=K, ratio=ratio)))
        if sweeps is not None:
            for cfg in ATTEND_LONG_SWEEP:
                sweeps.append(lambda cfg=cfg, q=q, k=k, mask=mask, sinks=sinks, nb=nbytes, K=K, ratio=ratio:
                              results.append(case(f"  sweep config={cfg}", q.shape[0], nb, do_bench(
                                  lambda: A.attend_long_triton(q, k, mask, sinks, cos, sin, cfg), warmup=3, rep=50,
                                  return_mode="median"), bw, kind="sweep_attend_long", keys=K, ratio=ratio,
                                  config=list(cfg))))


def bench_attend_top(bw: float, results: list, sweeps: list | None) -> None:
    """attend_top_triton and attend_long_triton (the same keys: the whole compressed cache, masked to each query's
    top rows) on a ratio-4 layer's block of 256 queries at each of TOP_STARTS; eager medians (do_bench)."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    H, d, T, W, k = 64, 512, 256, 128, 512
    for start in TOP_STARTS:
        n_comp = (start + T) // 4                      # the cache's rows and the block's own, all visible here
        q = torch.randn(T, H, d, device=DEV, generator=gen)
        raw = torch.randn(W - 1 + T, d, device=DEV, generator=gen)
        comp = torch.randn(n_comp, d, device=DEV, generator=gen)
        sinks = torch.randn(H, device=DEV, generator=gen)
        cos, sin = rotation(T, d // 16, gen)
        i, j = torch.arange(T, device=DEV)[:, None], torch.arange(W - 1 + T, device=DEV)[None, :]
        raw_mask = (j >= i) & (j < i + W)
        top = torch.rand(T, n_comp, device=DEV, generator=gen).argsort(dim=1)[:, :k]
        top_vis = torch.ones(T, k, dtype=torch.bool, device=DEV)
        comp_mask = torch.zeros(T, n_comp, device=DEV).scatter(1, top, 1.0) > 0
        keys, mask = torch.cat([raw, comp]), torch.cat([raw_mask, comp_mask], dim=1)
        nbytes = 2 * q.numel() * 4 + (raw.shape[0] + T * k) * d * 4
        for name, fn in ((f"attend_top at {start} ({n_comp} rows)",
                          lambda: A.attend_top_triton(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin)),
                         (f"attend_long masked at {start}",
                          lambda: A.attend_long_triton(q, keys, mask, sinks, cos, sin))):
            guarded(name, results, lambda fn=fn, name=name, start=start: results.append(case(
                name, T, nbytes, do_bench(fn, warmup=5, rep=100, return_mode="median"), bw, kind="attend_top",
                keys=n_comp, start=start)))
        if sweeps is not None:
            for cfg in ATTEND_TOP_SWEEP:
                sweeps.append(lambda cfg=cfg, a=(q, raw, raw_mask, comp, top, top_vis, sinks, cos, sin), nb=nbytes,
                              st=start, nc=n_comp:
                              results.append(case(f"  sweep config={cfg}", T, nb, do_bench(
                                  lambda: A.attend_top_triton(*a, config=cfg), warmup=3, rep=50,
                                  return_mode="median"), bw, kind="sweep_attend_top", keys=nc, start=st,
                                  config=list(cfg))))


def bench_index_long(bw: float, results: list, sweeps: list | None) -> None:
    """index_score_long_triton and model/attention.py index_score on one prefill block of 256 queries (64 heads of
    128) over 1553 compressed rows; eager medians (do_bench)."""
    from ds4trt.model.attention import index_score
    gen = torch.Generator(device=DEV).manual_seed(8)
    T, nh, di, K = 256, 64, 128, 1553
    w, q = torch.randn(T, nh, device=DEV, generator=gen), torch.randn(T, nh, di, device=DEV, generator=gen)
    keys = torch.randn(K, di, device=DEV, generator=gen)
    nbytes = (q.numel() + keys.numel() + w.numel() + T * K) * 4
    for name, fn in ((f"index_score_long {K} rows", lambda: I.index_score_long_triton(w, q, keys)),
                     (f"torch index_score {K} rows", lambda: index_score(w, q, keys))):
        guarded(name, results, lambda fn=fn, name=name: results.append(case(
            name, T, nbytes, do_bench(fn, warmup=5, rep=100, return_mode="median"), bw, kind="index_long", keys=K)))
    for cfg in INDEX_LONG_SWEEP if sweeps is not None else ():
        sweeps.append(lambda cfg=cfg: results.append(case(
            f"  sweep config={cfg}", T, nbytes, do_bench(lambda: I.index_score_long_triton(w, q, keys, cfg), warmup=3,
                                                         rep=50, return_mode="median"), bw,
            kind="sweep_index_long", keys=K, config=list(cfg))))


def bench_hc_long(bw: float, results: list, sweeps: list | None) -> None:
    """hc_pre_long_triton and model/hc.py hc_sum_streams on a 2048-token prefill chunk at Flash width (4 streams of
    4096); eager medians (do_bench). Bytes: the streams read twice (products, weighted sum), fn, y written."""
    from ds4trt.model.hc import hc_sum_streams
    gen = torch.Generator(device=DEV).manual_seed(9)
    T, S, M = 2048, 4, 24
    X = torch.randn(T, S, D, device=DEV, generator=gen)
    fn = torch.randn(M, S * D, device=DEV, generator=gen) / (S * D) ** 0.5
    scale, base = torch.rand(3, device=DEV, generator=gen) + 0.5, torch.randn(M, device=DEV, generator=gen)
    nbytes = 2 * X.numel() * 4 + fn.numel() * 4 + T * D * 4
    for name, run in ((f"hc_pre_long T={T}", lambda: H.hc_pre_long_triton(X, fn, scale, base, 1e-6, 1e-6, 20)),
                      (f"torch hc_sum_streams T={T}", lambda: hc_sum_streams(X, fn, scale, base, 1e-6, 1e-6, 20))):
        guarded(name, results, lambda run=run, name=name: results.append(case(
            name, T, nbytes, do_bench(run, warmup=5, rep=100, return_mode="median"), bw, kind="hc_long")))
    for cfg in HC_LONG_SWEEP if sweeps is not None else ():
        sweeps.append(lambda cfg=cfg: results.append(case(
            f"  sweep config={cfg}", T, nbytes,
            do_bench(lambda: H.hc_pre_long_triton(X, fn, scale, base, 1e-6, 1e-6, 20, cfg), warmup=3, rep=50,
                     return_mode="median"), bw, kind="sweep_hc_long", tensor="hc_pre_long", config=list(cfg))))


def bench_index(bw: float, results: list, sweeps: list | None) -> None:
    """index_score_triton (64 heads of 128) at T = 1, 2, 4 over TOPK_ROWS keys; the sweep: T = 1 at INDEX_SWEEP."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    nh, di = 64, 128
    for K in TOPK_ROWS:
        keys = torch.randn(K, di, device=DEV, generator=gen)
        for T in (1, 2, 4):
            w, q = torch.randn(T, nh, device=DEV, generator=gen), torch.randn(T, nh, di, device=DEV, generator=gen)
            nbytes = (keys.numel() + q.numel() + w.numel() + T * K) * 4
            guarded(f"index_score {K} rows T={T}", results, lambda w=w, q=q, keys=keys, T=T, nb=nbytes, K=K:
                    results.append(case(f"index_score {K} rows", T, nb,
                                        time_graph(lambda: I.index_score_triton(w, q, keys), 1), bw, kind="index",
                                        keys=K)))
            for cfg in INDEX_SWEEP if sweeps is not None and T == 1 else ():
                sweeps.append(lambda w=w, q=q, keys=keys, cfg=cfg, nb=nbytes, K=K: results.append(case(
                    f"  sweep config={cfg}", 1, nb, time_graph(lambda: I.index_score_triton(w, q, keys, cfg), 1), bw,
                    kind="sweep_index", keys=K, config=list(cfg))))


def bench_topk(bw: float, results: list, sweeps: list | None) -> None:
    """top_rows_triton (k = 512) at T = 1, 2, 4 over TOPK_ROWS scores (a third of them -inf: invisible rows), and
    the stable torch.sort + slice of model/attention.py top_rows on the same scores; the sweep: T = 1 at
    TOPK_WARPS warps per program."""
    gen = torch.Generator(device=DEV).manual_seed(6)
    k = 512
    for N in TOPK_ROWS:
        for T in (1, 2, 4):
            score = torch.randn(T, N, device=DEV, generator=gen)
            score[torch.rand(T, N, device=DEV, generator=gen) < 0.3] = float("-inf")
            nbytes = T * N * 4 + T * k * 8
            for label, fn in ((f"top_rows {N} rows", lambda score=score: TK.top_rows_triton(score, k)),
                              (f"torch.sort {N} rows", lambda score=score: top_rows(score, k))):
                guarded(f"{label} T={T}", results, lambda fn=fn, T=T, nb=nbytes, label=label, N=N:
                        results.append(case(label, T, nb, time_graph(fn, 1), bw, kind="topk", rows=N)))
            if sweeps is not None and T == 1:
                for warps in TOPK_WARPS:
                    sweeps.append(lambda score=score, warps=warps, nb=nbytes, N=N: results.append(case(
                        f"  sweep warps={warps}", 1, nb, time_graph(lambda: TK.top_rows_triton(score, k, warps), 1),
                        bw, kind="sweep_topk", rows=N, warps=warps)))


def bench_compress(bw: float, results: list) -> None:
    """compress_emit_triton at Flash's compressor shapes, T = 1 at a position whose token emits a row and at one
    whose token does not, and T = 5 (one of its tokens emits); model/attention.py emit_rows on the same inputs."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    freq = inv_freq(ModelConfig(), compressed=True).to(DEV)
    for R, c, post in ((128, 512, "fp8"), (4, 512, "fp8"), (4, 128, "fp4")):
        coff = 2 if R == 4 else 1
        norm = torch.rand(c, device=DEV, generator=gen) + 0.5
        skv, ssc = (torch.randn(coff * R, coff * c, device=DEV, generator=gen) for _ in range(2))
        for T, start, what in ((1, 1024 * R - 1, "emits"), (1, 1024 * R, "no row"), (5, 1024 * R - 3, "")):
            kv, sc = (torch.randn(T, coff * c, device=DEV, generator=gen) for _ in range(2))
            st = torch.tensor(start, device=DEV)
            args = (kv, sc, skv, ssc, st, norm, freq, R, post, 448, 1e-6)
            nbytes = (2 * coff * R * coff * c + 2 * T * coff * c + T * c) * 4 if what != "no row" else T * c * 4
            for label, fn in ((f"compress_emit R={R} c={c} {what}", lambda a=args: RT.compress_emit_triton(*a)),
                              (f"torch emit_rows R={R} c={c} {what}", lambda a=args: emit_rows(*a))):
                guarded(f"{label} T={T}", results, lambda fn=fn, T=T, nb=nbytes, label=label:
                        results.append(case(label, T, nb, time_graph(fn, 1), bw, kind="compress")))


def model_bytes_per_token(mix: str) -> dict:
    """Bytes one decode token must read, from the Flash shapes (spec ds4_architecture.md §2)."""
    q8 = lambda n, k: n * k // 32 * 34  # noqa: E731
    f16 = lambda n, k: 2 * n * k  # noqa: E731
    per_layer_q8 = sum(q8(n, k) for _, n, k, _ in Q8_LAYER)
    routed = K_SLOTS * expert_bytes(MIXES[mix])
    small_f16 = 2 * f16(24, 4 * D) + f16(E, D)                         # hc_attn_fn, hc_ffn_fn, router
    ratio4 = 2 * f16(1024, D) + f16(4, 1024)                            # attention compressor kv, gate, ape
    ratio128 = 2 * f16(512, D) + f16(128, 512)
    indexer = f16(8192, 1024) + f16(64, D) + 2 * f16(256, D) + f16(4, 256)   # ratio-4 layers, long context
    n4, n128 = 21, 20                                                   # layers 2,4..42 and 3,5..41
    layers = N_LAYER * (per_layer_q8 + routed + small_f16) + n4 * ratio4 + n128 * ratio128
    head = q8(N_VOCAB, D) + f16(4, 4 * D) + 2 * D                       # LM head, output HC, embedding row
    return dict(q8_per_layer=per_layer_q8, routed_per_layer=routed, f16_small_per_layer=small_f16,
                compressors_total=n4 * ratio4 + n128 * ratio128, indexers_total=n4 * indexer, lm_head=head,
                total=layers + head, total_long_context=layers + head + n4 * indexer)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budget", type=float, default=80.0, help="seconds; the sweeps stop when it runs out")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-t", help="comma-separated row counts: sweep the one-pair MoE and Q8_0 launches only at "
                                      "these T (default: T = 1..4; the one-pair MoE sweep also runs at 8 and 16 "
                                      "when named here)")
    ap.add_argument("--cases",
                    default="moe,moe_long,q8,f16,attend,attend_long,attend_top,index,index_long,hc_long,topk,"
                            "compress,project,q4,q4_long",
                    help="comma-separated subset of: moe (q2), moe_long (q2 prefill), q8, q8_mma (the tensor-core "
                         "Q8_0 kernel against q8, T = 1..16; not in the default list), read (streaming reads of the "
                         "Q8_0 projections' bytes), f16, attend, attend_long (prefill), attend_top (prefill), index, "
                         "index_long (prefill), hc_long (prefill), topk, compress, project (prefill), q4 (moe), "
                         "q4_long (q4 prefill)")
    ap.add_argument("--long-config", nargs="*", default=[], metavar="CAP:ROWS:WARPS:STAGES:PARTS",
                    help="moe_long / q4_long: also time these launches of the multi-pair kernels at each T (e.g. "
                         "32:64:4:1:1 64:64:4:1:1, moe_triton.LONG_CONFIGS' entries)")
    args = ap.parse_args()
    long_configs = tuple(tuple(map(int, c.split(":"))) for c in args.long_config)
    global SWEEP_T
    SWEEP_T = None if args.sweep_t is None else {int(t) for t in args.sweep_t.split(",")}
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 << 20))
    info = dict(gpu=props.name, sm=props.multi_processor_count, l2_bytes=l2, torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M:%S"))
    log(f"{info}")
    bw = copy_bandwidth()
    log(f"copy bandwidth (2 GiB device-to-device, read + write): {bw / 1e12:.3f} TB/s")
    results: list = []
    sweeps: list | None = None if args.no_sweep else []
    cases = args.cases.split(",")
    if "moe" in cases:
        bench_moe("q2", bw, l2, results, sweeps)
    if "moe_long" in cases:
        bench_moe_long("q2", bw, results, sweeps, long_configs)
    if "q8" in cases:
        bench_q8(bw, l2, results, sweeps)
    if "q8_mma" in cases:
        bench_q8_mma(bw, l2, results, sweeps)
    if "read" in cases:
        bench_read(bw, l2, results)
    if "f16" in cases:
        bench_f16(bw, l2, results, sweeps)
    if "attend" in cases:
        bench_attend(bw, l2, results, sweeps)
    if "attend_long" in cases:
        bench_attend_long(bw, results, sweeps)
    if "attend_top" in cases:
        bench_attend_top(bw, results, sweeps)
    if "index" in cases:
        bench_index(bw, results, sweeps)
    if "index_long" in cases:
        bench_index_long(bw, results, sweeps)
    if "hc_long" in cases:
        bench_hc_long(bw, results, sweeps)
    if "topk" in cases:
        bench_topk(bw, results, sweeps)
    if "compress" in cases:
        bench_compress(bw, results)
    if "project" in cases:
        bench_project(bw, results)
    if "q4" in cases:
        bench_moe("q4", bw, l2, results, sweeps)
    if "q4_long" in cases:
        bench_moe_long("q4", bw, results, sweeps, long_configs)
    for i, thunk in enumerate(sweeps or []):          # tuning data, only while the budget lasts
        if time.time() > START + args.budget - 6:
            log(f"budget reached: {len(sweeps) - i} sweep cases not run")
            break
        guarded(f"sweep {i}", results, thunk)

    def t_of(pred) -> float:
        rows = [r for r in results if pred(r)]
        return rows[0]["time_us"] if rows else float("nan")

    summary = {}
    for mix in MIXES:
        mb = model_bytes_per_token(mix)
        for T in (1, 4):
            moe_us = t_of(lambda r: r["kind"] == "moe" and r["mix"] == mix and r["routing"] == "random" and r["T"] == T)
            q8_us = sum(t_of(lambda r, n=n: r["kind"] == "q8" and r["tensor"] == n and r["T"] == T)
                        for n, *_ in Q8_LAYER)
            head_us = t_of(lambda r: r["kind"] == "q8" and r["tensor"] == "output" and r["T"] == T)
            f16_floor_us = (N_LAYER * mb["f16_small_per_layer"] + mb["compressors_total"]) / bw * 1e6
            step_us = N_LAYER * (moe_us + q8_us) + f16_floor_us + head_us
            summary[f"{mix}_T{T}"] = dict(layer_moe_us=moe_us, layer_q8_us=q8_us, lm_head_us=head_us,
                                          f16_at_floor_us=f16_floor_us, step_us=step_us,
                                          tokens_per_s=T / step_us * 1e6 if T == 1 else None,
                                          steps_per_s=1e6 / step_us)
        summary[f"{mix}_floor"] = dict(bytes_per_token=mb, floor_us=mb["total"] / bw * 1e6,
                                       floor_tokens_per_s=bw / mb["total"],
                                       floor_tokens_per_s_long_context=bw / mb["total_long_context"])

    # ---- compact table, last ----
    print("\n=== kernels at Flash shapes:", info["gpu"], f"| copy bandwidth {bw / 1e12:.3f} TB/s ===")
    print(f"{'case':40s} {'T':>3s} {'MB':>9s} {'floor us':>9s} {'us':>9s} {'% floor':>8s}")
    for r in results:
        if r["kind"].startswith("sweep") or r["kind"] == "error":
            continue
        print(f"{r['name']:40s} {r['T']:3d} {r['bytes'] / 1e6:9.2f} {r['floor_us']:9.2f} {r['time_us']:9.2f} "
              f"{100 * r['fraction']:7.1f}%")
    sweeps = [r for r in results if r["kind"].startswith("sweep")]
    if sweeps:
        print("sweeps (launch configs):")
        for r in sweeps:
            what = r.get("mix") or r.get("tensor") or f"keys {r.get('keys')}"
            print(f"  {what} T={r['T']} {r['name'].strip()}: {r['time_us']:.2f} us")
    for r in results:
        if r["kind"] == "error":
            print(f"FAILED {r['name']}: {r['error'][:200]}")
    for mix in MIXES:
        s1, s4, fl = summary[f"{mix}_T1"], summary[f"{mix}_T4"], summary[f"{mix}_floor"]
        if math.isnan(s1["step_us"]):               # the cases it adds up were not run
            continue
        print(f"{mix} decode step (T=1): 43 x (MoE {s1['layer_moe_us']:.1f} + Q8_0 {s1['layer_q8_us']:.1f}) us "
              f"+ F16 at floor {s1['f16_at_floor_us']:.0f} us + LM head {s1['lm_head_us']:.1f} us = "
              f"{s1['step_us'] / 1e3:.2f} ms -> {s1['tokens_per_s']:.0f} tok/s; whole-model floor "
              f"{fl['bytes_per_token']['total'] / 1e9:.2f} GB/token -> {fl['floor_tokens_per_s']:.0f} tok/s "
              f"({100 * fl['floor_us'] / s1['step_us']:.0f} % of floor)")
        print(f"{mix} verify step (T=4, random routing): {s4['step_us'] / 1e3:.2f} ms = "
              f"{s4['step_us'] / s1['step_us']:.2f} x the T=1 step")
    for r in results:
        if r["kind"] == "moe_long":
            print(f"{r['mix']} MoE of a {r['T']}-token prefill chunk: {r['time_us'] / 1e3:.2f} ms per layer -> "
                  f"{r['layers_tokens_per_s']:.0f} tokens/s for the routed experts of 43 layers alone")
    shared = {mix: [(r["T"], r["time_us"]) for r in results if r["kind"] == "moe" and r["mix"] == mix
                    and r["routing"] == "shared"] for mix in MIXES}
    for mix in (m for m in MIXES if shared[m]):
        t1 = t_of(lambda r: r["kind"] == "moe" and r["mix"] == mix and r["routing"] == "random" and r["T"] == 1)
        print(f"{mix} MoE, all T tokens on the same 6 experts, time / T=1 time: "
              + ", ".join(f"T={T}: {us / t1:.2f}" for T, us in shared[mix]))
    out_dir = os.environ.get("OUT")
    if out_dir:
        path = os.path.join(out_dir, "bench_kernels.json")
        with open(path, "w") as f:
            json.dump(dict(info=info, copy_bandwidth_bytes_per_s=bw, results=results, summary=summary), f, indent=1)
        print(f"wrote {path}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
