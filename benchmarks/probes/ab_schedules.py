"""A/B of the plain kernel's dispatch knobs: ours and cuBLAS mm side by side.

Each variant runs in its own process, since the dispatch reads its knobs once; VARIANT_ENV
names them (FLASHSAMPLING_PLAIN_TILE_N caps the plain N tile,
FLASHSAMPLING_PLAIN_WIDE_SCHEDULE=cutlass runs plain passes of more than 64 columns on the
CUTLASS schedules instead of the epilogue-warpgroup kernel, FLASHSAMPLING_PAD_COLUMNS=0 does not pad the hidden
rows to whole N tiles, FLASHSAMPLING_EWG_CLUSTER=1 runs the epilogue-warpgroup kernels one CTA per
cluster instead of pairs on neighbouring column tiles; --all3 also times bench_controls'
all3). Times are medians of CUDA-graph
replays (bench_sampler's median_us); mm is timed in every process, so each variant has its own
reference.

Usage:
  python benchmarks/probes/ab_schedules.py [--variants default,tile32,tile64]
      [--shapes 4096x151936,8192x128256] [--batches 64,128,256] [--rounds 3] [--greedy] [--all3]
      [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_*.py, report.py

VARIANT_ENV = {
    "default": {},
    "tile32": {"FLASHSAMPLING_PLAIN_TILE_N": "32"},
    "tile64": {"FLASHSAMPLING_PLAIN_TILE_N": "64"},
    # more than 64 columns run the kernel with epilogue warpgroups of its own by default;
    # "cutlass" runs the CUTLASS schedules instead
    "cutlass": {"FLASHSAMPLING_PLAIN_WIDE_SCHEDULE": "cutlass"},
    # hidden rows padded to whole N tiles by default; "nopad" leaves the TMA boxes ragged
    "nopad": {"FLASHSAMPLING_PAD_COLUMNS": "0"},
    # the epilogue-warpgroup kernels run an even number of column tiles in clusters of two CTAs
    # (the W tile multicast) by default; "single" runs one CTA per cluster
    "single": {"FLASHSAMPLING_EWG_CLUSTER": "1"},
    # the common controls' N tile capped at 32 (33-64 columns: two pingpong tiles re-reading W)
    "ctile32": {"FLASHSAMPLING_CONTROLS_TILE_N": "32"},
    # the common controls on the CUTLASS schedules (by default more than 16 columns run on the
    # epilogue-warpgroup kernel)
    "ccutlass": {"FLASHSAMPLING_CONTROLS_SCHEDULE": "cutlass"},
    # the controls' loop sums log-sum-exp terms against each column's log-sum-exp of earlier
    # tiles by default; "lsemax" takes each step's max over the lanes instead
    "lsemax": {"FLASHSAMPLING_LSE_REFERENCE": "0"},
}


def measure(shapes: str, batches: str, greedy: bool = False, all3: bool = False) -> list[dict]:
    """Times of ours and mm in this process (its knobs are the environment's)."""
    import torch

    import flashsampling_cuda
    from bench_sampler import median_us

    torch.manual_seed(0)
    rows = []
    for shape in shapes.split(","):
        dim, vocab = (int(x) for x in shape.lower().split("x"))
        weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
        for batch in (int(b) for b in batches.split(",")):
            hidden = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
            ours = median_us(lambda: flashsampling_cuda.sample(hidden, weight, temperature=1.0), graph=True)
            mm = median_us(lambda: hidden @ weight.T, graph=True)
            row = {"D": dim, "V": vocab, "B": batch, "ours": ours, "mm": mm}
            if greedy:  # the same kernel with the epilogue's noise off (T = 0): how long is the rest?
                row["ours_greedy"] = median_us(
                    lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.0), graph=True)
            if all3:  # bench_controls' all3: per-row temperatures + bitmask + logprobs (issue #4)
                from bench_controls import variant_kwargs

                kwargs = variant_kwargs("all3", batch, vocab, hidden.device)
                op = torch.ops.flashsampling.sample_with_scores
                row["ours_all3"] = median_us(lambda: op(hidden, weight, **kwargs), graph=True)
            rows.append(row)
        del weight
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="default,tile64")
    parser.add_argument("--shapes", default="4096x151936,8192x128256")
    parser.add_argument("--batches", default="64,128,256")
    parser.add_argument("--out", default=None, help="write ab_schedules.json here")
    parser.add_argument("--greedy", action="store_true", help="also time T = 0 (no noise)")
    parser.add_argument("--all3", action="store_true",
                        help="also time per-row temperatures + bitmask + logprobs (bench_controls' all3)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the variants this many times, interleaved (A B A B ...), and report each "
                             "cell's median: at large B the GPU runs at its power cap and its clock drifts "
                             "from one process to the next (docs/benchmarking.md)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.shapes, args.batches, args.greedy, args.all3)))
        return
    import statistics

    import torch

    from report import run_header

    header = run_header(torch.cuda.get_device_name(0))
    runs: dict[str, list[list[dict]]] = {}
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            env = {**os.environ, **VARIANT_ENV[variant]}
            command = [sys.executable, __file__, "--child", "--shapes", args.shapes, "--batches", args.batches]
            flags = (["--greedy"] if args.greedy else []) + (["--all3"] if args.all3 else [])
            proc = subprocess.run(command + flags, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"[ab] {variant} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                continue
            runs.setdefault(variant, []).append(json.loads(proc.stdout.strip().splitlines()[-1]))
    # Each cell's median over the rounds (a run's rows come in the same order every time).
    results = {
        variant: [{key: statistics.median(run[i][key] for run in rounds) if key not in ("D", "V", "B")
                   else rounds[0][i][key] for key in rounds[0][i]} for i in range(len(rounds[0]))]
        for variant, rounds in runs.items()
    }
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "ab_schedules.json").write_text(
            json.dumps({**header, "rounds": args.rounds, "variants": results, "runs": runs}, indent=1))
    print("| variant | D | B | ours µs | mm µs | ours/mm |" + (" ours T=0 µs |" if args.greedy else "")
          + (" all3 µs | all3/ours | all3/mm |" if args.all3 else ""))
    print("|---|---|---|---|---|---|" + ("---|" if args.greedy else "") + ("---|---|---|" if args.all3 else ""))
    for variant, rows in results.items():
        for r in rows:
            greedy = f" {r['ours_greedy']:.0f} |" if args.greedy else ""
            all3 = (f" {r['ours_all3']:.0f} | {r['ours_all3'] / r['ours']:.3f} | {r['ours_all3'] / r['mm']:.3f} |"
                    if args.all3 else "")
            print(f"| {variant} | {r['D']} | {r['B']} | {r['ours']:.0f} | {r['mm']:.0f} | {r['ours'] / r['mm']:.3f} |"
                  f"{greedy}{all3}")

if __name__ == "__main__":
    main()
