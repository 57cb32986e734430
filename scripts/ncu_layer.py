#!/usr/bin/env python3
"""The decode kernels of one Flash layer, three calls each, for Nsight Compute (on the H200):

    ncu -k regex:"_moe_|_q8_" --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python3 scripts/ncu_layer.py

Runs ds4::MoE (q2 mix, T = 1, random experts) and two Q8_0 products at T = 1 (attn_q_b 32768 x 1024,
ffn_gate_shexp 2048 x 4096) on synthetic blocks (scripts/bench_kernels.random_blocks). ncu locks the clocks
(SM ~1.5 GHz), so its durations are longer than bench_kernels.py's; read its ratios (L1 / DRAM throughput,
occupancy, stall reasons), not its times.

`--long T` runs instead one prefill call of ds4::MoE (q2 mix, T tokens, random routing: the multi-pair
tensor-core kernels), three times; for example

    ncu -k regex:"_moe_.*_multi" -c 2 --set full python3 scripts/ncu_layer.py --long 2048

(the tensor-core kernels: -k regex:"moe_gateup_iq2|moe_down_q2k"; with -o F, `ncu --import F.ncu-rep --page source
--csv --print-source sass > F.csv` and `python3 scripts/ncu_sass_table.py F.csv` give their instructions by opcode and
their stalls by reason).
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_kernels import CLAMP, D, E, F, K_SLOTS, MIXES, random_blocks, uniform_routing  # noqa: E402

from ds4trt.plugins.kernels import moe_triton as M  # noqa: E402
from ds4trt.plugins.kernels import q8_triton as Q  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--long", type=int, default=0, metavar="T", help="one prefill MoE call of T tokens instead")
ap.add_argument("--long-config", default=None, metavar="CAP:ROWS:WARPS:STAGES:PARTS",
                help="with --long: this launch of the multi-pair kernels instead of long_launch's")
args = ap.parse_args()
types = MIXES["q2"]
blocks = [random_blocks(t, r, c, lead=E).view(E, r, -1) for t, (r, c) in zip(types, ((F, D), (F, D), (D, F)))]
T = args.long or 1
v = torch.randn(T, D, device="cuda") * 3
ids = uniform_routing(T, device="cuda")                                               # [T, 6]
w = torch.rand(T, K_SLOTS, device="cuda") * 0.9 + 0.1
long_config = tuple(map(int, args.long_config.split(":"))) if args.long_config else None
for _ in range(3):
    M.moe_forward(v, ids, w, *blocks, *types, CLAMP, long_config=long_config)
for N, K in ((32768, 1024), (2048, 4096)) if not args.long else ():
    qs = Q.split_q8(random_blocks(8, N, K)[0], N, K)
    x = torch.randn(1, K, device="cuda")
    for _ in range(3):
        Q.q8_matmul(x, *qs, K)
torch.cuda.synchronize()
