"""Same-run A/B of the two routes of a top-N logprobs call (flashsampling_cuda/logprobs.py): the
fused route (one pass of the fused top-k GEMM, up to FUSED_TOP_LOGPROBS_MAX_BATCH rows, which
draws the plain sample from the GEMM's tile winners) against the logits route (cuBLAS logits, then
the logits kernels), by hidden size: at 33-64 rows the fused route's GEMM is the 64-wide pingpong
tile drawing the winners, whose epilogue a short mainloop does not hide. Prints per cell the
plain sample's time and each route's (CUDA-graph replays, median µs, the best of the rounds, the
routes timed alternately in one process) and logits / fused (> 1: the fused route is faster).

  python benchmarks/probes/top_logprobs_routes.py [--shapes 1024x151936,2048x151936,3072x128256,4096x151936]
      [--batches 16,33,48,64] [--regimes llm,flat] [--top-logprobs 20] [--rounds 3] [--option NAME]

--option NAME: the fused route with a DispatchOptions switch (sampler_params.h) on against off, in
place of the logits route (then "logits" below is the fused route with the switch off).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_*

import torch  # noqa: E402

from bench_sampler import median_us  # noqa: E402
from harness import add_problem_arguments, lm_head_problems, ratio_summary  # noqa: E402

import flashsampling_cuda  # noqa: E402
from flashsampling_cuda import logprobs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser, shapes="1024x151936,2048x151936,3072x128256,4096x151936", batches="16,33,48,64",
                          regimes="llm,flat")
    parser.add_argument("--top-logprobs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--option", default=None, help="a DispatchOptions field: its off in place of the logits route")
    args = parser.parse_args()
    set_options = torch.ops.flashsampling._set_dispatch_options
    fused_max_batch = logprobs.FUSED_TOP_LOGPROBS_MAX_BATCH
    print(f"# {torch.cuda.get_device_name()}; top_logprobs={args.top_logprobs}: plain, fused route, logits route µs; "
          "logits / fused")
    ratios = []
    for dim, vocab, regime, batch, weight, hidden in lm_head_problems(args.shapes, args.regimes, args.batches):
        kwargs = dict(temperature=0.8, seed=torch.tensor(7, device="cuda"), offset=torch.tensor(1, device="cuda"))

        def plain():
            return flashsampling_cuda.sample(hidden, weight, **kwargs)

        def top_n():
            return flashsampling_cuda.sample(hidden, weight, **kwargs, return_logprobs=True,
                                             top_logprobs=args.top_logprobs)

        times = {"plain": [], "fused": [], "logits": []}
        tokens = {}
        for _ in range(args.rounds):
            times["plain"].append(median_us(plain, graph=True))
            for route, max_batch in (("fused", fused_max_batch), ("logits", 0)):
                if args.option:
                    set_options(**{args.option: route == "fused"})
                else:
                    logprobs.FUSED_TOP_LOGPROBS_MAX_BATCH = max_batch
                try:
                    tokens[route] = top_n().tokens
                    times[route].append(median_us(top_n, graph=True))
                finally:
                    logprobs.FUSED_TOP_LOGPROBS_MAX_BATCH = fused_max_batch
                    set_options()
        plain_us, fused_us, logits_us = (min(times[k]) for k in ("plain", "fused", "logits"))
        agree = float((tokens["fused"] == tokens["logits"]).float().mean())
        ratios.append(logits_us / fused_us)
        print(f"{dim}x{vocab} {regime:4s} B={batch:<4d}: plain {plain_us:7.1f}, fused {fused_us:7.1f} "
              f"({fused_us / plain_us:.2f}x plain), logits {logits_us:7.1f} ({logits_us / plain_us:.2f}x), "
              f"logits / fused {logits_us / fused_us:.3f}; tokens agree {agree:.2f}", flush=True)
    print(ratio_summary("logits / fused", ratios))


if __name__ == "__main__":
    main()
