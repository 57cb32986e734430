#!/usr/bin/env python3
"""Does prefetching a Q8_0 weight into L2 during the latency-bound kernels before it pay? (one GPU, H200)

    python3 scripts/bench_prefetch.py [--copies 8]

Measured on the H200 (2026-12-02, BENCHMARKS.md): no. Even read straight from L2 the Q8_0 kernel is only ~10-15 %
faster (it is bound by its own loop, not by HBM), and the prefetch launches cost about what they save. The script
stays as the record of how that was measured.

Part 1, where a projection's bytes come from (us per call, T = 1): cold (copies rotated), hot (the second of two
calls on the same copy: all of it in L2), after a streaming read of its bytes by another kernel, after this
script's prefetch kernel (cp.async.bulk.prefetch.L2 per chunk, or prefetch.global.L2 per 128-byte line).
Part 2, in the order of a decode step:

A decode layer reads its attention projections right after stretches of small kernels that leave memory idle
(the hyper-connection reduction and norm before q_a / kv and q_b; RoPE, the KV row, masks and attention before
attn_output_a). Here, at Flash widths with synthetic Q8_0 weights (`copies` copies of each, rotated so that every
read comes from HBM as in a real step), each scenario is one CUDA graph per copy sequence, timed by replays
(median per copy):
  q8 cold          the projections alone
  chain            a stand-in for the small kernels: hc_pre_triton on [1, 4, 4096] (its RMS norm included)
  base             chain, then the projections
  pf side/<mode>   the prefetch launched on a second stream (forked in the graph), chain, join, the projections
  pf main/<mode>   the prefetch on the same stream before chain
  warm/<mode>      prefetch, chain x 3, the projections, less (prefetch, chain x 3): the projections from L2
Sets: q_b (35.7 MB); q_a + kv (6.7 MB, one launch) then q_b; attn_output_a (35.7 MB, 8 groups); and a layer's
attention part (chain, q_a + kv, norm, q_b, chain, out_a, out_b) with out_a prefetched before the second chain.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds4trt.model.numerics import rms_norm  # noqa: E402
from ds4trt.plugins.kernels import hc_triton as H  # noqa: E402
from ds4trt.plugins.kernels import q8_triton as Q  # noqa: E402
from bench_kernels import _read_words  # noqa: E402  (this script's folder is on sys.path)

DEV = "cuda"
PROGRAMS = 64           # one-warp programs of a prefetch launch
LINE = 128              # bytes per prefetch.global.L2 (one L2 line)


@triton.jit
def _prefetch(base_ptr, nbytes, sink_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    """Program p: chunks p*LANES .. p*LANES+LANES-1 of CHUNK bytes of the nbytes at base (the last one cut to a
    multiple of 16 bytes); sink is never written (the store keeps the asm from being dropped)."""
    i = tl.program_id(0) * LANES + tl.arange(0, LANES)
    off = i.to(tl.int64) * CHUNK
    n = (tl.minimum(nbytes - off, CHUNK) // 16 * 16).to(tl.int32)
    go = (n > 0).to(tl.int32)
    p = base_ptr + off
    if BULK:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.ne.s32 q, $2, 0; @q cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
            "=r,l,r,r", [p, go, n], dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.inline_asm_elementwise(
            "{ .reg .pred q; setp.ne.s32 q, $2, 0; @q prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [p, go], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(sink_ptr + 0 * i, r, mask=r != 0)


_SINK: dict[str, torch.Tensor] = {}


def l2_prefetch(tensors, programs: int = PROGRAMS, mode: str = "bulk") -> None:
    """Start bringing the bytes of each CUDA tensor (contiguous) into L2: one launch per tensor. bulk: one thread
    per chunk issues cp.async.bulk.prefetch.L2 (sm_90: the copy engine fetches it, the thread does not wait), the
    chunks spread over `programs` one-warp programs; line: prefetch.global.L2 per 128-byte line."""
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes < 16:
            continue
        dev = str(t.device)
        if dev not in _SINK:
            _SINK[dev] = torch.zeros(1, dtype=torch.int32, device=t.device)
        lanes = 32
        chunk = triton.cdiv(triton.cdiv(nbytes, programs * lanes), 16) * 16 if mode == "bulk" else LINE
        grid = triton.cdiv(triton.cdiv(nbytes, chunk), lanes)
        _prefetch[(grid,)](t.view(torch.uint8).reshape(-1), nbytes, _SINK[dev], CHUNK=chunk, LANES=lanes,
                           BULK=mode == "bulk", num_warps=1)


def stream_read(t: torch.Tensor, programs: int = 1056) -> None:
    """A plain streaming read of t's bytes by another kernel (bench_kernels' case `read`)."""
    w = t.view(torch.int32).reshape(-1)
    ch = triton.cdiv(triton.cdiv(w.numel(), programs), 512) * 512
    out = torch.empty(triton.cdiv(w.numel(), ch), dtype=torch.int32, device=t.device)
    _read_words[(out.numel(),)](w, out, w.numel(), CH=ch, BW=512, num_warps=4)


D, S = 4096, 4
PROJ = {"qakv": (1536, 4096, 1), "qb": (32768, 1024, 1), "outa": (8192, 4096, 8), "outb": (4096, 8192, 1)}
MODES = (("bulk", 16), ("bulk", 64), ("bulk", 264), ("line", 0))


def weight(N: int, K: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    KP = Q.padded(K)
    quants = torch.randint(0, 256, (N, KP), dtype=torch.uint8, device=DEV, generator=gen)
    scales = (torch.rand(N, KP // 32, device=DEV, generator=gen) * 0.02 + 0.001).half()
    return quants, scales


def ms_per(fn, n: int) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") / n * 1e3      # us per copy


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=8)
    args = ap.parse_args()
    C = args.copies
    gen = torch.Generator(device=DEV).manual_seed(0)
    W = [{k: weight(N, K, gen) for k, (N, K, G) in PROJ.items()} for _ in range(C)]
    xs = {k: torch.randn(1, G * K, device=DEV, generator=gen) for k, (N, K, G) in PROJ.items()}
    outs = {k: torch.empty(1, N, device=DEV) for k, (N, K, G) in PROJ.items()}
    X = [torch.randn(1, S, D, device=DEV, generator=gen) for _ in range(C)]
    fn_ = torch.randn((2 + S) * S, S * D, device=DEV, generator=gen) * 0.01
    scale, base = torch.rand(3, device=DEV) + 0.5, torch.randn((2 + S) * S, device=DEV) * 0.1
    g = torch.rand(D, device=DEV)
    side = torch.cuda.Stream()

    def q8(c, k):
        N, K, G = PROJ[k]
        Q.q8_matmul(xs[k], *W[c][k], K, groups=G, out=outs[k])

    def chain(c, times=1):
        for _ in range(times):
            H.hc_pre_triton(X[c], fn_, scale, base, 1e-6, 1e-6, 20, g)

    def tensors(c, keys):
        return [a for k in keys for a in W[c][k]]

    def forked(c, keys, mode, programs):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            l2_prefetch(tensors(c, keys), programs=programs or PROGRAMS, mode=mode)

    def join():
        torch.cuda.current_stream().wait_stream(side)

    rows = []

    def record(label, fn):
        us = ms_per(fn, C)
        rows.append((label, us))
        print(f"{label:40s} {us:9.2f} us", flush=True)
        return us

    for k, (N, K, G) in PROJ.items():          # part 1
        cold = ms_per(lambda: [q8(c, k) for c in range(C)], C)
        two = ms_per(lambda: [(q8(c, k), q8(c, k)) for c in range(C)], C)
        after = {}
        for label, fetch in (("read", lambda c: [stream_read(a) for a in W[c][k]]),
                             ("bulk", lambda c: l2_prefetch(W[c][k])),
                             ("line", lambda c: l2_prefetch(W[c][k], mode="line"))):
            alone = ms_per(lambda: [fetch(c) for c in range(C)], C)
            after[label] = ms_per(lambda: [(fetch(c), q8(c, k)) for c in range(C)], C) - alone
        rows.append((f"{k}: cold / hot / after read, bulk, line", cold, two - cold, *after.values()))
        print(f"{k:6s} q8 cold {cold:7.2f}  hot {two - cold:7.2f}  after read {after['read']:7.2f}  after bulk "
              f"prefetch {after['bulk']:7.2f}  after line prefetch {after['line']:7.2f} us", flush=True)

    record("chain", lambda: [chain(c) for c in range(C)])
    for keys in (("qb",), ("qakv", "qb"), ("outa",)):
        name = "+".join(keys)
        record(f"{name}: q8 cold", lambda: [q8(c, k) for c in range(C) for k in keys])
        record(f"{name}: base", lambda: [(chain(c), [q8(c, k) for k in keys]) for c in range(C)])
        for mode, programs in MODES:
            tag = f"{mode}{programs or ''}"

            def pf_side(keys=keys, mode=mode, programs=programs):
                for c in range(C):
                    forked(c, keys, mode, programs)
                    chain(c)
                    join()
                    for k in keys:
                        q8(c, k)
            record(f"{name}: pf side/{tag}", pf_side)

            def pf_main(keys=keys, mode=mode, programs=programs):
                for c in range(C):
                    l2_prefetch(tensors(c, keys), programs=programs or PROGRAMS, mode=mode)
                    chain(c)
                    for k in keys:
                        q8(c, k)
            record(f"{name}: pf main/{tag}", pf_main)

            def warm(with_q8, keys=keys, mode=mode, programs=programs):
                for c in range(C):
                    l2_prefetch(tensors(c, keys), programs=programs or PROGRAMS, mode=mode)
                    chain(c, 3)
                    if with_q8:
                        for k in keys:
                            q8(c, k)
            a = ms_per(lambda: warm(True), C)
            b = ms_per(lambda: warm(False), C)
            rows.append((f"{name}: warm/{tag}", a - b))
            print(f"{name + ': warm/' + tag:40s} {a - b:9.2f} us  (prefetch + chain x3: {b:.2f})", flush=True)

    def layer(pf, mode="bulk", programs=PROGRAMS):
        for c in range(C):
            if pf:
                forked(c, ("qakv", "qb"), mode, programs)
            chain(c)
            if pf:
                join()
            q8(c, "qakv")
            rms_norm(outs["qakv"][:, :1024], g[:1024], 1e-6)
            q8(c, "qb")
            if pf:
                forked(c, ("outa",), mode, programs)
            chain(c)
            if pf:
                join()
            q8(c, "outa")
            q8(c, "outb")
    record("layer attention: base", lambda: layer(False))
    for mode, programs in MODES:
        record(f"layer attention: pf side/{mode}{programs or ''}", lambda m=mode, p=programs: layer(True, m, p))
    print("\nsummary (us per copy)")
    for label, *us in rows:
        print(f"  {label:40s} " + " ".join(f"{u:9.2f}" for u in us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
