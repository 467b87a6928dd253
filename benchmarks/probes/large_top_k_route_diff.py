"""How often a host top_k in (64, 1024] gives other tokens or scores on the epilogue-warpgroup
scan, which stores each 16-token run's four largest keys and recomputes the rest of a run that may
hide more of the top k (a warp's dot product, summed in another order than the GEMM's), than on
CUTLASS's scan, which stores the logits (DispatchOptions::top_candidates_epilogue_warpgroups off):
bf16 LM-head rows of both regimes, many offsets, counts of differing tokens and scores.

  python benchmarks/probes/large_top_k_route_diff.py [--top-k 1000] [--offsets 100]
      [--shapes 4096x151936] [--batches 48,64,128] [--regimes flat,llm]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # harness

import torch  # noqa: E402

import flashsampling_cuda as fs  # noqa: E402
from harness import add_problem_arguments, lm_head_problems  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser, shapes="4096x151936", batches="48,64,128", regimes="flat,llm")
    parser.add_argument("--top-k", type=int, default=1000)
    parser.add_argument("--offsets", type=int, default=100, help="offsets 0..N-1, one call per route each")
    args = parser.parse_args()
    for dim, _, regime, batch, weight, hidden in lm_head_problems(args.shapes, args.regimes, args.batches):
        tokens = scores = 0
        for offset in range(args.offsets):
            kwargs = dict(temperature=1.0, seed=torch.tensor(7, device="cuda"),
                          offset=torch.tensor(offset, device="cuda"), top_k=args.top_k, truncation_path="fused_top_k")
            run_keys = fs.sample_with_scores(hidden, weight, **kwargs)
            torch.ops.flashsampling._set_dispatch_options(top_candidates_epilogue_warpgroups=False)
            try:
                stored_x = fs.sample_with_scores(hidden, weight, **kwargs)
            finally:
                torch.ops.flashsampling._set_dispatch_options()
            tokens += int((run_keys.tokens != stored_x.tokens).sum())
            scores += int((run_keys.scores.view(torch.int32) != stored_x.scores.view(torch.int32)).sum())
        print(f"D{dim} {regime} B={batch}: {batch * args.offsets} rows, tokens differ {tokens}, scores differ {scores}",
              flush=True)


if __name__ == "__main__":
    main()
