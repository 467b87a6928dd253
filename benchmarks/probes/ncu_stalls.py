"""Summarise an Nsight Compute SASS source page: stall reasons, hot opcodes, hot code regions.

Export the page on the GPU machine, then read it anywhere (no ncu needed here):

  ncu --set full --import-source yes --kernel-name device_kernel --launch-skip 2 --launch-count 1 \\
      -o prof python3 benchmarks/probes/profile_kernel.py --batch 256
  ncu -i prof.ncu-rep --page source --csv --print-source sass > sass.csv
  python benchmarks/probes/ncu_stalls.py sass.csv [--region 100]

Warp-stall samples are taken from every warp of the CTA (producer and consumers alike), so a
region's share of the samples is its share of warp time. In our kernels the regions read as:
the mainloop (HGMMA, the TMA barrier waits), the unrolled epilogue body (one copy per
subtile), and the out-of-line noise functions at the end of the listing.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0] if words else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    parser.add_argument("--region", type=int, default=100, help="instructions per reported code region")
    parser.add_argument("--min-share", type=float, default=1.0, help="list regions with at least this %% of samples")
    args = parser.parse_args()

    with open(args.csv, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    header, data = rows[header_at], rows[header_at + 1:]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]
    total = sum(number(r[col[SAMPLES]]) for r in data) or 1.0
    executed = sum(number(r[col[EXECUTED]]) for r in data) or 1.0

    print(f"{len(data)} SASS instructions, {total:.0f} warp samples, {executed / 1e6:.1f}M warp instructions executed")
    print("\nstall reasons (share of all samples):")
    by_reason = Counter({h: sum(number(r[col[h]]) for r in data) for h in reasons})
    for name, value in by_reason.most_common():
        if value:
            print(f"  {name:26s} {100 * value / total:5.1f}%")

    print("\nopcodes (share of executed instructions / of samples):")
    ops_executed, ops_samples = Counter(), Counter()
    for r in data:
        op = opcode(r[col["Source"]]).split(".")[0]
        ops_executed[op] += number(r[col[EXECUTED]])
        ops_samples[op] += number(r[col[SAMPLES]])
    for op, value in ops_executed.most_common(15):
        print(f"  {op:12s} {100 * value / executed:5.1f}% / {100 * ops_samples[op] / total:5.1f}%")

    print(f"\ncode regions of {args.region} instructions with >= {args.min_share}% of the samples:")
    for start in range(0, len(data), args.region):
        chunk = data[start:start + args.region]
        share = 100 * sum(number(r[col[SAMPLES]]) for r in chunk) / total
        if share >= args.min_share:
            ops = Counter(opcode(r[col["Source"]]) for r in chunk)
            ran = sum(number(r[col[EXECUTED]]) for r in chunk) / 1e6
            print(f"  {start:6d}-{start + len(chunk):<6d} {share:5.1f}% of samples, {ran:7.2f}M executed: "
                  f"{' '.join(o for o, _ in ops.most_common(4))}")


if __name__ == "__main__":
    main()
