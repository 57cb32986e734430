#!/usr/bin/env python3
"""Whole-model speed of the CUDA backend at DeepSeek V4 Flash width, on synthetic weights built on the GPU.

    python3 scripts/bench_decode.py [--layers 43] [--prefill 2048] [--repeats 30] [--ctx N] [--json FILE]

(43 layers need ~82 GiB for the weights: where they do not fit, it says which --layers do and stops.)

The model is the real Transformer (model/transformer.py) with the CUDA backend's kernels
(runtime/backends/cuda.py): Flash widths (hidden 4096, 64 heads x 512, 256 experts x 2048, vocabulary
129280, ModelConfig.flash()), the q2 mix (IQ2_XXS gate/up, Q2_K down, Q8_0 projections, F16 where ds4 has
F16: the router, compressor and indexer matrices kept as float16, the rest as float32), random bytes with
moderate f16 scales (never zeros), random routing (the router's selection bias small, so that tokens spread over
the experts as with a trained model's balancing bias; until 2026-11-30 it was N(0, 1) and sent most of a prompt's
tokens to ~20 experts per layer, which made verify and prefill look cheaper than uniform routing).
Steps run through GraphedSteps exactly as a session runs them (one CUDA graph per step shape + a commit graph);
--compile also fuses each block's glue with torch.compile.

Measured (median of --repeats, CUDA events around run + commit, so host work between graphs counts):
  decode   T = 1 at a short context and after the --prefill prompt
  verify   T = 2..4 (--verify) after the prompt (commit of 1 row: the positions advance by one per repeat)
  draft    --draft N,...: the MTP head's part of a speculative cycle after one committed token (MTPDrafter.draft:
           the catch-up step on the new pair, then N - 1 recursive steps on the scratch ring, each with its top-2
           read by the host, as ds4-run runs them; synthetic MTP weights with Q4_K experts, random target states),
           and the cycle's cost (N drafts + verify of N + 1) in decode steps: the tokens a cycle must keep on
           average to beat plain decoding
  prefill  the --prefill prompt in chunks (--chunk, one or several sizes; as Session.prefill runs them: chunks of
           the backend's PREFILL_CHUNK tokens replay a graph of the whole chunk, captured in the untimed first pass,
           unless DS4_GRAPH_PREFILL=0; other chunks longer than 16 tokens run eagerly; with --compile and
           DS4_COMPILE_PREFILL=1 whole chunks through the compiled blocks), with the peak device memory of each and
           host_ms, the host's time to queue the prompt's work (near the whole time, the host either set the pace or
           waited on a full launch queue: the kernels' GPU time, --kernels, or a graphed run tells which)
For each: the bytes that must be read in GGUF formats (weights; experts: the T*k distinct ones of random routing;
one embedding row per token; the visible cache rows; no indexer query weights or rows for steps that need no
indexer, attention.indexer_needed: a decode below position 2048), the floor = bytes / measured copy bandwidth, and the
achieved fraction. Also the device memory of the model and the peak of the whole run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kernels import copy_bandwidth, matmul_flops, random_blocks  # noqa: E402

from ds4trt.gguf_io import names as N  # noqa: E402
from ds4trt.gguf_io.dequant import tensor_nbytes, type_name  # noqa: E402
from ds4trt.model.attention import indexer_needed  # noqa: E402
from ds4trt.model.config import ModelConfig  # noqa: E402
from ds4trt.model.layout import mtp_layout, target_layout  # noqa: E402
from ds4trt.model.mtp import MTPHead  # noqa: E402
from ds4trt.model.transformer import Transformer  # noqa: E402
from ds4trt.plugins.kernels import attn_triton  # noqa: E402
from ds4trt.runtime.backends.cuda import (CudaExperts, GraphedSteps, compile_blocks, cuda_linear,  # noqa: E402
                                          resident_bytes, to_device)
from ds4trt.runtime.cache import CacheState  # noqa: E402
from ds4trt.runtime.speculative import MTPDrafter  # noqa: E402
from ds4trt.testing.flash_sparse import EXPERT_MIXES, spec_type  # noqa: E402

Q2_MIX = EXPERT_MIXES["q2"]              # (gate, up, down): IQ2_XXS, IQ2_XXS, Q2_K
MTP_MIX = EXPERT_MIXES["q4"]             # the MTP head's experts: Q4_K (ds4's DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf)
# device memory a run needs beside the weights: the 4096-token cache, a 2048-token chunk's temporaries (peak 55.92
# GiB against 54.16 of weights at 28 layers on an H100, BENCHMARKS.md, the forty-fourth session), with a margin
RUN_HEADROOM = 4 * 2 ** 30
START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


class SyntheticWeights:
    """The Weights interface (get, has, type_of, shape_of, blocks) over random tensors made on the GPU, in the
    types of ds4's GGUFs (the routed experts in `mix`): what the CUDA backend's factories read, without a file."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, specs=None, mix: tuple[int, int, int] = Q2_MIX):
        """specs: the tensors (the target's, target_layout, by default; mtp_layout for the MTP head); mix: the
        routed experts' (gate, up, down) types."""
        self.specs = {s.name: s for s in (specs if specs is not None else target_layout(cfg))}
        self.seed, self._gen = seed, None
        self.cfg, self.mix = cfg, mix

    @property
    def gen(self) -> torch.Generator:
        """The GPU's generator, made on first use (sizes and types need no GPU: layers_that_fit)."""
        if self._gen is None:
            self._gen = torch.Generator(device="cuda").manual_seed(self.seed)
        return self._gen

    def has(self, name):
        return name in self.specs

    def type_of(self, name) -> int:
        return spec_type(self.specs[name], self.mix)

    def shape_of(self, name):
        return self.specs[name].shape

    def nbytes(self, name) -> int:
        return tensor_nbytes(self.type_of(name), self.specs[name].ggml_shape)

    def get(self, name) -> torch.Tensor:
        shape, t = self.shape_of(name), self.type_of(name)
        if t == N.I32:                                            # hash routing table: random experts
            return torch.randint(0, self.cfg.n_expert, shape, device="cuda", generator=self.gen)
        x = torch.randn(shape, device="cuda", generator=self.gen)
        if name.endswith("exp_probs_b.bias"):    # small: tokens spread over the experts, as a trained balancing bias
            return 0.01 * x                      # makes them do (an N(0, 1) bias sent a 1024-token chunk to ~20)
        if len(shape) == 2:
            x /= shape[1] ** 0.5
        elif name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        return x.half().float() if t == N.F16 else x

    def blocks(self, name) -> torch.Tensor:
        shape, t = self.shape_of(name), self.type_of(name)
        lead = shape[0] if len(shape) == 3 else 1
        return random_blocks(t, shape[-2], shape[-1], lead, gen=self.gen).reshape(-1)


def layers_that_fit(free: int, headroom: int = RUN_HEADROOM) -> int:
    """The most Flash layers (at most 43) whose synthetic weights, as the CUDA backend holds them
    (cuda.resident_bytes), leave `headroom` bytes of `free` for the run: 0 if not even one fits."""
    fits = 0
    for layers in range(1, ModelConfig.flash().n_layer + 1):
        if resident_bytes(SyntheticWeights(flash_layers(layers))) + headroom > free:
            break
        fits = layers
    return fits


def flash_layers(layers: int) -> ModelConfig:
    """ModelConfig.flash() cut to its first `layers` layers (their compress ratios and hash routing kept)."""
    flash = ModelConfig.flash()
    return dataclasses.replace(flash, n_layer=layers, compress_ratios=flash.compress_ratios[:layers],
                               n_hash_layer=min(flash.n_hash_layer, layers))


def step_bytes(w: SyntheticWeights, cfg: ModelConfig, T: int, pos: int) -> float:
    """Bytes a step of T tokens at position pos must read, in GGUF formats (see the module docstring); where the step
    needs no indexer (attention.indexer_needed), without the indexer's query weights and rows."""
    total = 0.0
    used = min(cfg.n_expert, T * cfg.n_expert_used)
    indexer = indexer_needed(cfg, pos + T)
    for name in w.specs:
        b = w.nbytes(name)
        if "indexer.attn_q_b" in name and not indexer:
            continue
        if "_exps." in name:
            b *= used / cfg.n_expert
        elif name == N.TOKEN_EMBD:
            b = T * cfg.n_embd * 2
        total += b
    for l in range(cfg.n_layer):                        # visible cache rows (this backend keeps them float32)
        r = cfg.ratio(l)
        total += (cfg.window - 1) * cfg.head_dim * 4
        if r:
            total += (pos // r) * cfg.head_dim * 4
        if r == 4 and indexer:
            total += (pos // 4) * cfg.index_head_dim * 4
    return total


def mtp_step_bytes(mw: SyntheticWeights, w: SyntheticWeights, cfg: ModelConfig) -> float:
    """Bytes one MTP step of one token must read: the head's tensors (its routed experts: the k used), the target's
    LM head and embedding row it shares, its window of cache rows."""
    total = sum(mw.nbytes(n) * (cfg.n_expert_used / cfg.n_expert if "_exps." in n else 1) for n in mw.specs)
    return total + w.nbytes(N.OUTPUT) + cfg.n_embd * 2 + (cfg.window - 1) * cfg.head_dim * 4


def timed(fn, repeats: int) -> float:
    """Median milliseconds of fn() over repeats, CUDA events around each call."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _inductor_option(text: str) -> tuple[str, object]:
    """'NAME=VALUE' -> (NAME, the literal VALUE), NAME an existing torch._inductor.config option (dotted for the
    nested ones, e.g. triton.enable_pdl)."""
    import torch._inductor.config as config
    name, sep, value = text.partition("=")
    owner, _, leaf = name.rpartition(".")
    for part in owner.split(".") if owner else ():
        config = getattr(config, part, None)
    if not sep or config is None or not hasattr(config, leaf):
        raise ValueError(f"{text!r}: expected NAME=VALUE with NAME an option of torch._inductor.config")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise ValueError(f"{text!r}: the value is not a Python literal") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=43, help="transformer layers (Flash has 43)")
    ap.add_argument("--prefill", type=int, default=2048, help="prompt tokens to prefill")
    ap.add_argument("--chunk", type=lambda a: [int(c) for c in a.split(",")], default=[256],
                    help="prefill chunk, or several separated by commas (<= 16: CUDA graphs, else eager)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--ctx", type=int, default=None,
                    help="cache capacity in tokens, like ds4-run --ctx (whose default is 4096); without it, just "
                         "what the run needs (prefill + 4 x repeats + 64). A graphed step reads the compressed rows "
                         "below a power-of-two bound of its end (at least 4096), so its cost follows the context used")
    ap.add_argument("--verify", type=lambda a: [int(t) for t in a.split(",") if t], default=[2, 3, 4],
                    help="verify step lengths to time after the prompt, comma-separated ('' for none: with --compile "
                         "each length compiles for about a minute at 43 layers)")
    ap.add_argument("--draft", type=lambda a: [int(t) for t in a.split(",") if t], default=[],
                    help="MTP draft lengths to time (comma-separated; each needs --verify to include N + 1 for the "
                         "cycle's cost)")
    ap.add_argument("--warm-up", type=int, default=None, metavar="N",
                    help="first capture the target's step graphs of 1..N+1 tokens, with and without the indexer where "
                         "--ctx can need both (Session.warm_up's target part), and report their time and memory")
    ap.add_argument("--compile", action="store_true", help="torch.compile the blocks (backends/cuda.py compile_blocks)")
    ap.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                    help="with --compile: compile with torch._inductor.config.NAME = VALUE (a Python literal) over "
                         "the backend's INDUCTOR_OPTIONS, to measure an Inductor option, e.g. combo_kernels=False "
                         "(the default fuses independent kernels horizontally: fewer launches); repeatable")
    ap.add_argument("--kernels", action="store_true",
                    help="at the end, profile 5 decode steps, 5 of each verify length and one prefill chunk "
                         "(torch.profiler) and print the kernels by GPU time (the chunk's with the PyTorch ops that "
                         "launched them, then grouped by the source lines that called them). With programmatic "
                         "dependent launch a kernel's time includes its wait for the kernel before it; DS4_PDL=0 "
                         "gives each kernel's own time")
    ap.add_argument("--trace", help="with --kernels: write the kernels of one profiled decode step here, in launch "
                                    "order (tab-separated: microseconds, name), and those of one verify step of T "
                                    "rows (each --verify length) to this name + '.T<T>'")
    ap.add_argument("--attend-config", metavar="BT:HB:BN:DC:DV:WARPS:STAGES:PARTS",
                    help="run the prefill attention (_attend_long) at this launch instead of attn_triton.LONG_CONFIG, "
                         "to time a config as a whole model (bench_kernels.py --cases attend_long sweeps one block)")
    ap.add_argument("--top-config", metavar="HB:BN:DC:DV:WARPS:STAGES:PARTS",
                    help="the same for _attend_top (attn_triton.TOP_CONFIG)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    for option, text, name in (("--attend-config", args.attend_config, "LONG_CONFIG"),
                               ("--top-config", args.top_config, "TOP_CONFIG")):
        if text is not None:
            fields = len(getattr(attn_triton, name))
            try:
                config = tuple(int(f) for f in text.split(":"))
            except ValueError:
                config = ()
            if len(config) != fields or config[-1] not in (1, 2):
                print(f"bench_decode.py: {option} {text!r}: expected {fields} integers separated by ':' (the last, "
                      f"the float16 parts, 1 or 2)", file=sys.stderr)
                return 2
            setattr(attn_triton, name, config)
    need = args.prefill + 4 * args.repeats + 64
    if args.ctx is not None and args.ctx < need:
        print(f"bench_decode.py: --ctx {args.ctx} is below what the run needs ({need} = prefill + 4 x repeats + 64)",
              file=sys.stderr)
        return 2
    ctx = args.ctx or need
    try:
        inductor = dict(_inductor_option(o) for o in args.inductor)
    except ValueError as e:
        print(f"bench_decode.py: --inductor {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_decode.py: needs a CUDA GPU", file=sys.stderr)
        return 2

    cfg = flash_layers(args.layers)
    free = torch.cuda.mem_get_info()[0]
    mtp_need = resident_bytes(SyntheticWeights(cfg, 2, mtp_layout(cfg), MTP_MIX)) if args.draft else 0
    need = resident_bytes(SyntheticWeights(cfg)) + mtp_need
    if need + RUN_HEADROOM > free:
        fits = layers_that_fit(free, RUN_HEADROOM + mtp_need)      # the MTP head's size does not depend on them
        print(f"bench_decode.py: {cfg.n_layer} layers need {need / 2 ** 30:.1f} GiB of device memory for the weights "
              f"and ~{RUN_HEADROOM / 2 ** 30:.0f} GiB for the run; {torch.cuda.get_device_name(0)} has "
              f"{free / 2 ** 30:.1f} GiB free: " + (f"--layers {fits} fits" if fits else "not even one layer fits"),
              file=sys.stderr)
        return 2
    bw, flops = copy_bandwidth(), matmul_flops()
    log(f"{torch.cuda.get_device_name(0)}; copy bandwidth {bw / 1e12:.3f} TB/s (2 GiB device copy, read + write); "
        f"bfloat16 product {flops / 1e12:.0f} TFLOP/s (8192^3, cuBLAS: the machine's compute rate for the prefill)")

    w = SyntheticWeights(cfg)
    with torch.no_grad():
        model = to_device(Transformer(cfg, w, "ds4", experts=CudaExperts.from_weights,
                                      linear=cuda_linear), "cuda")
        mw, mtp = None, None
        if args.draft:
            mw = SyntheticWeights(cfg, 2, mtp_layout(cfg), MTP_MIX)
            mtp = to_device(MTPHead(model, mw, experts=CudaExperts.from_weights, linear=cuda_linear), "cuda")
    if args.compile:
        for name, value in inductor.items():
            log(f"torch._inductor.config.{name} = {value!r}")
        compile_blocks(model, *([mtp] if mtp is not None else []), options=inductor)
    torch.cuda.synchronize()
    weights_gib = torch.cuda.memory_allocated() / 2 ** 30
    gguf_gib = sum(ws.nbytes(n) for ws in (w, mw) if ws is not None for n in ws.specs) / 2 ** 30
    log(f"model: {cfg.n_layer} layers{' and the MTP head' if mtp is not None else ''} on the GPU, {weights_gib:.2f} "
        f"GiB resident ({gguf_gib:.2f} GiB in GGUF formats)")

    cache = CacheState(cfg, ctx, device="cuda")
    log(f"cache capacity: {ctx} tokens")
    steps = GraphedSteps(model, cache)
    vocab = torch.Generator().manual_seed(1)
    tokens = lambda n: torch.randint(0, cfg.n_vocab, (n,), generator=vocab).tolist()  # noqa: E731
    results = []

    def record(name: str, T: int, ms: float, nbytes: float, **extra):
        floor_ms = nbytes / bw * 1e3
        results.append(dict(name=name, T=T, ms=ms, bytes=nbytes, floor_ms=floor_ms, fraction=floor_ms / ms, **extra))
        log(f"{name:22s} T={T:<4d} {ms:9.3f} ms  reads {nbytes / 1e9:7.3f} GB  floor {floor_ms:7.3f} ms  "
            f"{100 * floor_ms / ms:5.1f} % of floor" + "".join(f"  {k} {v:.1f}" for k, v in extra.items()))

    def prefill(prompt: list[int], chunk: int) -> None:
        """Commit `prompt` in chunks, as Session.prefill does (last-row logits only)."""
        for i in range(0, len(prompt), chunk):
            steps.prefill(prompt[i:i + chunk])

    def step(T: int, n: int = 1):
        def fn():
            _, _, rows = steps.run(tokens(T))
            steps.commit(rows, n)
        return fn

    with torch.no_grad():
        if args.warm_up is not None:
            torch.cuda.empty_cache()                           # as each capture does: reserved = what stays held
            t0, reserved = time.time(), torch.cuda.memory_reserved()
            n = sum(steps.prepare(T, False) for T in range(1, args.warm_up + 2))
            grown = (torch.cuda.memory_reserved() - reserved) / 2 ** 30
            log(f"warm-up: {n} graphs ({len(steps.graphs)} steps, {len(steps.commits)} commits) captured in "
                f"{time.time() - t0:.1f} s, device memory reserved +{grown:.2f} GiB")
        t0 = time.time()
        step(1)()                                              # capture the decode graphs
        log(f"decode graph captured in {time.time() - t0:.1f} s")
        pos = cache.pos
        ms = timed(step(1), args.repeats)
        record("decode (short ctx)", 1, ms, step_bytes(w, cfg, 1, pos), tokens_per_s=1e3 / ms)

        prompt = tokens(args.prefill)
        peaks = []                                             # device memory peaks before each reset of the counter
        for chunk in args.chunk:
            cache.reset()
            peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
            prefill(prompt, chunk)                             # warm-up pass (captures / compiles), not timed
            cache.reset()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            prefill(prompt, chunk)
            host_ms = (time.perf_counter() - t0) * 1e3                # the host's time to queue it all
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
            nbytes = sum(step_bytes(w, cfg, min(chunk, args.prefill - i), i) for i in range(0, args.prefill, chunk))
            record(f"prefill (chunk {chunk})", args.prefill, ms, nbytes, tokens_per_s=args.prefill / ms * 1e3,
                   host_ms=host_ms, peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30)

        for T in (1, *args.verify):
            t0 = time.time()
            step(T)()                                          # capture (and compile)
            log(f"T={T} graph captured in {time.time() - t0:.1f} s")
            pos = cache.pos
            ms = timed(step(T), args.repeats)
            record(f"{'decode' if T == 1 else 'verify'} (ctx {pos})", T, ms, step_bytes(w, cfg, T, pos),
                   **({"tokens_per_s": 1e3 / ms} if T == 1 else {}))
        if args.draft:
            drafter = MTPDrafter(mtp, ctx, torch.float32, torch.device("cuda"), GraphedSteps)
            history = tokens(16)                               # the drafter's committed pairs before the first draft
            drafter.observe(torch.randn(16, cfg.n_hc, cfg.n_embd, device="cuda"))
            drafter.catch_up(history + tokens(1), graph=False)

            def draft(n: int):
                def fn():                                       # one more committed token, then the cycle's drafts
                    history.append(tokens(1)[0])
                    drafter.observe(torch.randn(1, cfg.n_hc, cfg.n_embd, device="cuda"))
                    got = drafter.draft(history, tokens(1)[0], n, float("-inf"), None)
                    assert len(got) == n, (len(got), n)
                return fn

            mtp_bytes = mtp_step_bytes(mw, w, cfg)
            for n in args.draft:
                t0 = time.time()
                draft(n)()                                     # capture the MTP graphs (and compile)
                log(f"draft {n} captured in {time.time() - t0:.1f} s")
                ms = timed(draft(n), args.repeats)
                record(f"draft {n} (MTP)", n, ms, n * mtp_bytes)
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile
            for T in (1, *args.verify):                         # each graph captured above
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        step(T)()
                    torch.cuda.synchronize()
                name = "decode step" if T == 1 else f"verify step T={T}"
                print(f"{name}, 5 profiled (kernels by GPU time):")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                busy_us = sum(e.time_range.elapsed_us() for e in kernels) / 5
                log(f"{name}, profiled: {len(kernels) / 5:.0f} GPU kernels and copies per step, {busy_us / 1e3:.3f} "
                    f"ms of them busy ({cfg.n_layer} layers: {len(kernels) / 5 / cfg.n_layer:.1f} per layer)")
                if args.trace:
                    ordered = sorted(kernels, key=lambda e: e.time_range.start)
                    n = len(ordered) // 5
                    path = args.trace if T == 1 else f"{args.trace}.T{T}"
                    with open(path, "w") as f, open(path + ".timeline", "w") as tl:
                        t0 = ordered[2 * n].time_range.start
                        for e in ordered[2 * n:3 * n]:                     # the third step
                            f.write(f"{e.time_range.elapsed_us():.1f}\t{e.name}\n")
                            tl.write(f"{e.time_range.start - t0:.1f}\t{e.time_range.elapsed_us():.1f}\t{e.name}\n")
            cache.reset()
            part = prompt[:args.chunk[-1]]
            steps.graphed_chunk = None          # the chunk eagerly: each kernel with the PyTorch op that launched it
            stacks = torch._C._profiler._ExperimentalConfig(verbose=True)      # (without it no stacks are kept)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=True,
                         experimental_config=stacks) as prof:
                prefill(part, len(part))
                torch.cuda.synchronize()
            print(f"prefill, one chunk of {len(part)} tokens (PyTorch ops and kernels, by their own GPU time):")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70))
            print("the same by the source lines that called them (the glue's PyTorch ops, traced to the model):")
            print(prof.key_averages(group_by_stack_n=4).table(sort_by="self_cuda_time_total", row_limit=40,
                                                               max_name_column_width=40, max_src_column_width=90))
    t1 = next(r for r in results if r["T"] == 1 and "ctx" in r["name"] and "short" not in r["name"])
    for r in results:
        if r["name"].startswith("verify"):
            r["vs_decode"] = r["ms"] / t1["ms"]
            log(f"verify T={r['T']}: {r['vs_decode']:.2f}x the decode step")
    for r in results:
        if r["name"].startswith("draft"):
            v = next((x for x in results if x["name"].startswith("verify") and x["T"] == r["T"] + 1), None)
            if v is None:
                log(f"draft {r['T']}: no verify of T={r['T'] + 1} timed (add it to --verify) for the cycle's cost")
                continue
            r["cycle_ms"] = r["ms"] + v["ms"]
            r["cycle_vs_decode"] = r["cycle_ms"] / t1["ms"]
            log(f"cycle of {r['T']} drafts: {r['ms']:.3f} + verify {v['ms']:.3f} = {r['cycle_ms']:.3f} ms = "
                f"{r['cycle_vs_decode']:.2f} decode steps: it beats plain decoding when a cycle keeps more than "
                f"{r['cycle_vs_decode']:.2f} tokens on average (1 + accepted drafts; at most {r['T'] + 1})")
    peak = max(peaks + [torch.cuda.max_memory_allocated()]) / 2 ** 30
    log(f"device memory: model {weights_gib:.2f} GiB, peak {peak:.2f} GiB"
        + (f" ({'within' if peak <= 90 else 'OVER'} the 90 GiB target)"
           if cfg.n_layer == ModelConfig.flash().n_layer else ""))
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__, layers=cfg.n_layer, compile=args.compile,
                inductor={k: repr(v) for k, v in inductor.items()},
                date=time.strftime("%Y-%m-%d", time.gmtime()), cache_tokens=ctx, copy_bandwidth=bw, matmul_flops=flops,
                model_gib=weights_gib, gguf_gib=gguf_gib, peak_gib=peak,
                types=dict(zip(("gate", "up", "down"), map(type_name, Q2_MIX))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
