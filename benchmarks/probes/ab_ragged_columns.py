"""Same-run A/B of the column tiles beyond 128 GEMM columns (kernel_choice.h's
narrow_ragged_column_tiles): 64-wide tiles where the last 128-wide tile would be at most half
full, against 128-wide tiles (DispatchOptions::narrow_ragged_columns = false), with cuBLAS's
matmul beside them; plain sampling and per-row temperatures (the common controls' loop, which
keeps 128-wide tiles either way: a control of the run-to-run spread), the two settings timed
alternately, CUDA-graph replays, median µs. Checks that both give the same tokens and scores.

  python benchmarks/probes/ab_ragged_columns.py [--shapes 4096x151936,8192x128256]
      [--columns 128,129,144,160,176,192,200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_*

import torch  # noqa: E402

from bench_sampler import median_us  # noqa: E402
from harness import shape_list  # noqa: E402

from flashsampling_cuda.problems import lm_head_weight  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4096x151936,8192x128256")
    parser.add_argument("--columns", default="128,129,144,160,176,192,200")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda")
    op = torch.ops.flashsampling.sample_with_scores
    set_options = torch.ops.flashsampling._set_dispatch_options
    print(f"# {torch.cuda.get_device_name()}; D x V, columns, variant: mm / narrow / wide µs, wide / narrow")
    for dim, vocab in shape_list(args.shapes):
        weight = lm_head_weight(vocab, dim, device=device)
        torch.manual_seed(0)
        for columns in (int(c) for c in args.columns.split(",")):
            hidden = torch.randn(columns, dim, device=device, dtype=torch.bfloat16)
            temps = torch.rand(columns, device=device) + 0.5
            mm = median_us(lambda: torch.mm(hidden, weight.T), graph=True)
            for variant, extra in (("plain", {}), ("temps", {"temperatures": temps})):
                kwargs = dict(seed=torch.tensor(7, device=device), offset=torch.tensor(0, device=device), **extra)
                times = {True: [], False: []}
                outputs = {}
                for _ in range(args.rounds):
                    for narrow in (True, False):
                        set_options(narrow_ragged_columns=narrow)
                        outputs[narrow] = op(hidden, weight, **kwargs)
                        times[narrow].append(median_us(lambda: op(hidden, weight, **kwargs), graph=True))
                set_options()
                same = all(torch.equal(a, b) for a, b in zip(outputs[True], outputs[False]))
                narrow_us, wide_us = min(times[True]), min(times[False])
                print(f"{dim}x{vocab} {columns:4d} {variant:6s}: {mm:7.1f} / {narrow_us:7.1f} / {wide_us:7.1f} µs,"
                      f" {wide_us / narrow_us:.3f}{'' if same else '  TOKENS DIFFER'}", flush=True)
        del weight


if __name__ == "__main__":
    main()
