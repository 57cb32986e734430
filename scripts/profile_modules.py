#!/usr/bin/env python3
"""Where a prefill's GPU time goes, per part of the model, at Flash width on one GPU.

    python3 scripts/profile_modules.py [--layers 4] [--prompt 2048] [--chunk 2048] [--ctx 4096]

Builds bench_decode.py's synthetic model (the real Flash widths and q2 mix, random weights on the device), prefills
a random prompt once to warm up, then again with a pair of CUDA events around every call of the parts below, and
prints each part's summed time, its calls and its share of the whole prefill. The parts nest (a layer's `ffn`
contains `ffn.experts`), so shares do not add up to 100 %; what a part leaves to its children is its own glue.
  block                      one layer;  hc.reduce / hc.combine  the hyper-connections' reduction / update
  attn[rR]                   the attention of a layer of compress ratio R (0: window only)
  attn.group / q_b / out_a / out_b / index_q_b     the projections; attn.attend[rR] the attention products
                             (attn.attend_top[r4]: those of a ratio-4 layer's chunk with the indexer)
  attn.head_norm_rope        the queries' per-head norm and RoPE
  attn._indexer_top, attn.index_score, attn.top_rows, attn.compressor.emit, attn.index_compressor.emit
  ffn, ffn.experts (routed MoE), ffn.route, ffn.gate_inp, ffn.group (shared gate + up), ffn.sh_down, head
Events serialize nothing, but each pair is a record on the stream: the total is a little above bench_decode's.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_decode import SyntheticWeights, flash_layers  # noqa: E402

from ds4trt.model.transformer import Transformer  # noqa: E402
from ds4trt.runtime.backends.cuda import CudaExperts, GraphedSteps, cuda_linear, to_device  # noqa: E402
from ds4trt.runtime.cache import CacheState  # noqa: E402


class Timer:
    """Wraps callables so that, while on, each call is bracketed by CUDA events recorded under a name."""

    def __init__(self):
        self.on = False
        self.events = collections.defaultdict(list)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            self.events[name].append((start, end))
            return out
        return timed

    def instrument(self, model: Transformer) -> None:
        cfg, w = model.cfg, self.wrap
        for i, block in enumerate(model.blocks):
            kind = f"r{cfg.ratio(i)}"
            for hc in (block.hc_attn, block.hc_ffn):
                hc.reduce, hc.combine = w("hc.reduce", hc.reduce), w("hc.combine", hc.combine)
                hc.update_reduce = w("hc.update_reduce", hc.update_reduce)
            a, f = block.attn, block.ffn
            a.forward, a.group = w(f"attn[{kind}]", a.forward), w("attn.group (u projections)", a.group)
            a.attend = w(f"attn.attend[{kind}]", a.attend)
            a.head_norm_rope = w("attn.head_norm_rope", a.head_norm_rope)
            a.index_score, a.top_rows = w("attn.index_score", a.index_score), w("attn.top_rows", a.top_rows)
            modules = {"attn.q_b": a.q_b, "attn.out_a": a.out_a, "attn.out_b": a.out_b, "ffn": f,
                       "ffn.experts": f.experts, "ffn.sh_down": f.sh_down, "ffn.gate_inp": f.gate_inp, "block": block}
            if cfg.ratio(i):
                a.compressor.emit = w("attn.compressor.emit", a.compressor.emit)
            if cfg.ratio(i) == 4:
                a._indexer_top = w("attn._indexer_top", a._indexer_top)
                if a.attend_top is not None:
                    a.attend_top = w(f"attn.attend_top[{kind}]", a.attend_top)
                a.index_compressor.emit = w("attn.index_compressor.emit", a.index_compressor.emit)
                modules["attn.index_q_b"] = a.index_q_b
            for name, m in modules.items():
                m.forward = w(name, m.forward)
            f.route, f.group = w("ffn.route", f.route), w("ffn.group (shared gate + up)", f.group)
        model.head = w("head", model.head)

    def report(self, total_ms: float) -> None:
        times = {name: sum(a.elapsed_time(b) for a, b in ev) for name, ev in self.events.items()}
        for name, ms in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"  {name:34s} {ms:9.2f} ms  {len(self.events[name]):4d} calls  {100 * ms / total_ms:5.1f} %")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="transformer layers (Flash has 43; 4 = 2 window-only, "
                                                          "one ratio-4, one ratio-128)")
    ap.add_argument("--prompt", type=int, default=2048, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk")
    ap.add_argument("--ctx", type=int, default=4096, help="cache capacity in tokens (ds4-run's default: 4096; the "
                                                          "compressed caches' capacity sets the indexer's work)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("profile_modules.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = flash_layers(args.layers)
    with torch.no_grad():
        model = to_device(Transformer(cfg, SyntheticWeights(cfg), "ds4", experts=CudaExperts.from_weights,
                                      linear=cuda_linear), "cuda")
    if args.ctx < args.prompt:
        print(f"profile_modules.py: --ctx {args.ctx} is below the prompt ({args.prompt})", file=sys.stderr)
        return 2
    cache = CacheState(cfg, args.ctx, device="cuda")
    steps = GraphedSteps(model, cache)
    timer = Timer()
    timer.instrument(model)
    prompt = torch.randint(0, cfg.n_vocab, (args.prompt,), generator=torch.Generator().manual_seed(1)).tolist()

    def prefill():
        for i in range(0, len(prompt), args.chunk):
            part = prompt[i:i + args.chunk]
            _, _, rows = steps.run(part, last_only=True)
            steps.commit(rows, len(part))

    with torch.no_grad():
        prefill()                                  # compiles the kernels
        cache.reset()
        timer.on = True
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        prefill()
        end.record()
        torch.cuda.synchronize()
    total = start.elapsed_time(end)
    print(f"{torch.cuda.get_device_name(0)}: {args.layers} layers, a {args.prompt}-token prompt in chunks of "
          f"{args.chunk}: {total:.2f} ms")
    timer.report(total)
    return 0


if __name__ == "__main__":
    sys.exit(main())
