#!/usr/bin/env python3
"""Side-by-side GPU time per kernel of decode steps traced by `bench_decode.py --kernels --trace FILE`:

    python3 scripts/trace_table.py base.tsv new.tsv [...] [--min-us 20] [--by-name]
    python3 scripts/trace_table.py --ends base.tsv.timeline new.tsv.timeline [...]
    python3 scripts/trace_table.py --ends --launches FILE.timeline      (each launch's share, in launch order)

One row per kernel (Inductor's generated `triton_*` kernels as one row, PyTorch's own kernels and copies by the start
of their name), one column per trace: total µs in the step / number of launches; then each trace's total. Rows
whose largest total is below --min-us are left out (their sum is still in the totals). --by-name keeps every
Inductor kernel as its own row (their names carry a per-graph number, so they only line up within one commit).
--ends reads the FILE.timeline files (start, µs, name per kernel) and gives each kernel the time from the end of
everything before it (or its own start, after an idle gap) to its own end: its share of the step's span. With
programmatic dependent launch a kernel starts before its predecessor ends and waits, so its duration counts that
wait and the durations add up to more than the step (10.9 ms of kernels in a 6.5 ms step); the shares add up to the
span, less the idle gaps (their own row, "(idle)").
"""

from __future__ import annotations

import argparse
import collections
import os
import sys


def row_name(name: str, by_name: bool) -> str:
    """A kernel's row: Inductor's kernels as one (unless by_name), C++ template names by their start."""
    if name.startswith("triton_") and not by_name:
        return "triton_* (Inductor)"
    return name if name.startswith(("_", "triton_")) else name[:50]


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
            name = row_name(name, by_name)
            total[name] += us
            count[name] += 1
    return total, count


def shares(path: str, by_name: bool) -> list[tuple[str, float]]:
    """A timeline file (start µs <tab> µs <tab> kernel name per line) -> (row name, share µs) of each kernel in start
    order, an idle gap before a kernel as ("(idle)", gap)."""
    kernels = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            fields = line.rstrip("\n").split("\t", 2)
            try:
                kernels.append((float(fields[0]), float(fields[1]), row_name(fields[2], by_name)))
            except (ValueError, IndexError):
                sys.exit(f"trace_table: {path} line {n}: expected 'start<tab>microseconds<tab>kernel name', "
                         f"got {line.rstrip()[:60]!r}")
    kernels.sort()
    out = []
    done = kernels[0][0] if kernels else 0.0         # the latest end so far
    for start, us, name in kernels:
        if start > done:
            out.append(("(idle)", start - done))
        out.append((name, max(0.0, start + us - max(start, done))))
        done = max(done, start + us)
    return out


def load_ends(path: str, by_name: bool) -> tuple[dict[str, float], collections.Counter]:
    """A timeline file -> (summed shares µs, launches) per row name, the idle gaps as the row "(idle)"."""
    total, count = collections.defaultdict(float), collections.Counter()
    for name, us in shares(path, by_name):
        total[name] += us
        count[name] += 1
    return total, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--by-name", action="store_true")
    ap.add_argument("--ends", action="store_true", help="timeline files: each kernel's share of the step's span")
    ap.add_argument("--launches", action="store_true",
                    help="with --ends: each launch's share in launch order (one timeline file), not the sums")
    args = ap.parse_args()
    for p in args.traces:
        if not os.path.isfile(p):
            sys.exit(f"trace_table: {p}: no such file")
    if args.launches:
        if not args.ends or len(args.traces) != 1:
            sys.exit("trace_table: --launches takes --ends and one timeline file")
        for name, us in shares(args.traces[0], True):
            print(f"{us:9.1f}  {name[:80]}")
        return
    runs = [(load_ends if args.ends else load)(p, args.by_name) for p in args.traces]
    names = sorted({k for t, _ in runs for k in t}, key=lambda k: -max(t.get(k, 0.0) for t, _ in runs))
    heads = [os.path.splitext(os.path.basename(p))[0] for p in args.traces]
    print(f"{'kernel':52s}" + "".join(f"{h[:20]:>22s}" for h in heads))
    for k in names:
        if max(t.get(k, 0.0) for t, _ in runs) >= args.min_us:
            print(f"{k[:52]:52s}" + "".join(f"{t.get(k, 0.0):14.1f} / {c[k]:5d}" for t, c in runs))
    print(f"{'total':52s}" + "".join(f"{sum(t.values()):14.1f} / {sum(c.values()):5d}" for t, c in runs))


if __name__ == "__main__":
    main()
