"""Same-run A/B of DispatchOptions::top_p_on_plain_pass on a serving engine's top_p call: per-row
temperatures and top_p as [B] tensors (the controls' loop of the sampling pass, where the
benchmark's forms take a host temperature and its plain loop), on flat and LLM-like rows; the
option on and off alternately in one process, CUDA-graph replays, the best of two medians each,
and plain sampling at the same temperatures.

  python benchmarks/probes/ab_top_p_row_temperatures.py [--shapes 4096x151936] [--batches 64,128,256]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_*, harness

import torch  # noqa: E402

from bench_sampler import median_us  # noqa: E402
from harness import add_problem_arguments, lm_head_problems  # noqa: E402

import flashsampling_cuda as fs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser, shapes="4096x151936", batches="64,128,256", regimes="flat,llm")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    set_options = torch.ops.flashsampling._set_dispatch_options
    print(f"# {torch.cuda.get_device_name()}; top_p_on_plain_pass on / off µs, off / on")
    for dim, vocab, regime, batch, weight, hidden in lm_head_problems(args.shapes, args.regimes, args.batches):
        noise = dict(temperature=torch.full((batch,), args.temperature, device="cuda"),
                     seed=torch.tensor(7, device="cuda"), offset=torch.tensor(1, device="cuda"))
        top_p = torch.full((batch,), args.top_p, dtype=torch.float64, device="cuda")
        plain = median_us(lambda: fs.sample_with_scores(hidden, weight, **noise), graph=True)
        times = {True: [], False: []}
        for on in (True, False, True, False):
            set_options(top_p_on_plain_pass=on)
            times[on].append(median_us(lambda: fs.sample_with_scores(hidden, weight, top_p=top_p, **noise), graph=True))
        set_options()
        on_us, off_us = min(times[True]), min(times[False])
        print(f"{dim}x{vocab} {regime} B={batch} [B] T, [B] top_p {args.top_p}: plain {plain:.1f}  on {on_us:.1f} / "
              f"off {off_us:.1f} us, off/on {off_us / on_us:.3f}, on/plain {on_us / plain:.2f}, "
              f"off/plain {off_us / plain:.2f}")


if __name__ == "__main__":
    main()
