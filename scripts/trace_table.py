#!/usr/bin/env python3
"""Side-by-side GPU time per kernel of decode steps traced by `bench_decode.py --kernels --trace FILE`:

    python3 scripts/trace_table.py base.tsv new.tsv [...] [--min-us 20] [--by-name]

One row per kernel (Inductor's generated `triton_*` kernels as one row, PyTorch's own kernels and copies by the start
of their name), one column per trace: total µs in the step / number of launches; then each trace's total. Rows
whose largest total is below --min-us are left out (their sum is still in the totals). --by-name keeps every
Inductor kernel as its own row (their names carry a per-graph number, so they only line up within one commit).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys


def load(path: str, by_name: bool) -> tuple[dict[str, float], collections.Counter]:
    """A trace file (µs <tab> kernel name per line) -> (total µs, launches) per row name."""
    total, count = collections.defaultdict(float), collections.Counter()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            us, sep, name = line.rstrip("\n").partition("\t")
            try:
                us = float(us)
            except ValueError:
                sys.exit(f"trace_table: {path} line {n}: expected 'microseconds<tab>kernel name', "
                         f"got {line.rstrip()[:60]!r}")
            if name.startswith("triton_") and not by_name:
                name = "triton_* (Inductor)"
            elif not name.startswith(("_", "triton_")):
                name = name[:50]                                     # C++ template names: their start is enough
            total[name] += us
            count[name] += 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--by-name", action="store_true")
    args = ap.parse_args()
    for p in args.traces:
        if not os.path.isfile(p):
            sys.exit(f"trace_table: {p}: no such file")
    runs = [load(p, args.by_name) for p in args.traces]
    names = sorted({k for t, _ in runs for k in t}, key=lambda k: -max(t.get(k, 0.0) for t, _ in runs))
    heads = [os.path.splitext(os.path.basename(p))[0] for p in args.traces]
    print(f"{'kernel':52s}" + "".join(f"{h[:20]:>22s}" for h in heads))
    for k in names:
        if max(t.get(k, 0.0) for t, _ in runs) >= args.min_us:
            print(f"{k[:52]:52s}" + "".join(f"{t.get(k, 0.0):14.1f} / {c[k]:5d}" for t, c in runs))
    print(f"{'total':52s}" + "".join(f"{sum(t.values()):14.1f} / {sum(c.values()):5d}" for t, c in runs))


if __name__ == "__main__":
    main()
