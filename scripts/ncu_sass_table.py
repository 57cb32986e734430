#!/usr/bin/env python3
"""Where a kernel's instructions and stalls go, from Nsight Compute's per-instruction page:

    ncu -k regex:"moe_gateup_iq2_wg|moe_down_q2k_wg" -c 2 --set full -o F python3 scripts/ncu_layer.py --long 2048
    ncu --import F.ncu-rep --page source --csv --print-source sass > F.csv
    python3 scripts/ncu_sass_table.py F.csv [--per OPCODE] [--top 12]

For each kernel in the export: the warp instructions executed, by opcode, as a count per executed instruction of
--per (default HGMMA, the wgmma kernels' tensor-core instruction; any opcode with executions) and as a share of all;
the warp-state samples by stall reason (all samples, not only those where no warp issued), as shares of all samples;
and the --top instructions by samples with their three largest reasons. Opcodes drop predicates and modifiers (`@P2
PRMT R1, ...` and `IMAD.WIDE` count as PRMT and IMAD).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re


def kernels(path: str) -> list[tuple[list[str], list[list[str]]]]:
    """The export's kernels: (header, instruction rows) each; a header is a row naming Address and Source."""
    out: list[tuple[list[str], list[list[str]]]] = []
    with open(path, newline="", errors="replace") as f:
        for row in csv.reader(f):
            if "Address" in row and "Source" in row:
                out.append((row, []))
            elif out and len(row) == len(out[-1][0]):
                out[-1][1].append(row)
    return out


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", sass.strip()).split(" ")[0].split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--per", default="HGMMA", help="opcode whose executions the counts are per (default HGMMA)")
    ap.add_argument("--top", type=int, default=12, help="instructions listed by samples (default 12)")
    args = ap.parse_args()
    found = kernels(args.csv)
    if not found:
        raise SystemExit(f"ncu_sass_table: no instruction table in {args.csv} (export with --page source --csv "
                         "--print-source sass)")
    for n, (hdr, rows) in enumerate(found):
        src, executed = hdr.index("Source"), hdr.index("Instructions Executed")
        samples = hdr.index("Warp Stall Sampling (All Samples)")
        reasons = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
        by_op: collections.Counter = collections.Counter()
        stalls: collections.Counter = collections.Counter()
        for r in rows:
            by_op[opcode(r[src])] += number(r[executed])
            for i in reasons:
                stalls[hdr[i]] += number(r[i])
        total, per = sum(by_op.values()), by_op[args.per]
        all_samples = sum(number(r[samples]) for r in rows) or 1.0
        print(f"== kernel {n}: {len(rows)} instructions, {total / 1e6:.1f} M warp instructions executed"
              + (f", {total / per:.1f} per {args.per}" if per else f" (no {args.per})"))
        print("  by opcode (per " + args.per + ", % of all): " + ", ".join(
            f"{op} {c / per if per else 0:.1f} ({100 * c / total:.1f})" for op, c in by_op.most_common(16)))
        print("  stall reasons (% of samples): " + ", ".join(
            f"{k[6:]} {100 * v / all_samples:.1f}" for k, v in stalls.most_common(10)))
        for r in sorted(rows, key=lambda r: -number(r[samples]))[:args.top]:
            top = sorted(reasons, key=lambda i: -number(r[i]))[:3]
            print(f"  {100 * number(r[samples]) / all_samples:5.1f} %  {r[src].strip()[:64]:64s} "
                  + " ".join(f"{hdr[i][6:]} {number(r[i]):.0f}" for i in top))


if __name__ == "__main__":
    main()
