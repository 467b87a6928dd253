"""SM clock and board power while one call shape runs back to back (CUDA-graph replays).

At large batch the fused sampler, the plain cuBLAS matmul and every baseline run at the GPU's
power cap (H200: ~700 W), so their clocks differ from one another and drift with temperature
(docs/benchmarking.md): this script shows it. Each mode replays a graph of 20 calls for
2.5 s while `nvidia-smi` samples the SM clock and power every 50 ms.

Each line also gives the GEMM's rate against the tensor cores' peak at the measured clock
(dense bf16 on Hopper: 4096 FLOP per SM per clock, 989 TFLOP/s at 1830 MHz on 132 SMs): near
100%, a call is bound by its tensor work at the clock the cap allows; far below it, by something
else (memory at small batch, the epilogue's instructions at large batch).
`--all3` adds ours with per-row temperatures + bitmask + logprobs (issue #4's controls).

Usage:
  python benchmarks/probes/power_probe.py [--dim 8192] [--vocab 128256] [--batch 256] [--all3]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import flashsampling_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_*.py, report.py


DENSE_FLOP_PER_SM_CLOCK = 4096  # Hopper bf16 tensor cores, dense


def probe(name: str, fn, flop: float, seconds: float = 2.5, calls_per_graph: int = 20) -> str:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    monitor = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-lms", "50"],
        stdout=subprocess.PIPE, text=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls = 0
    begin = time.time()
    start.record()
    while time.time() - begin < seconds:
        graph.replay()
        calls += calls_per_graph
        if calls % (10 * calls_per_graph) == 0:
            torch.cuda.synchronize()  # keep the host within a few graphs of the GPU
    end.record()
    torch.cuda.synchronize()
    monitor.terminate()
    samples = [line.split(",") for line in monitor.communicate()[0].strip().splitlines()[4:] if line.strip()]
    clocks = sorted(float(s[0]) for s in samples)
    power = sorted(float(s[1]) for s in samples)
    us = start.elapsed_time(end) * 1000 / calls
    clock = clocks[len(clocks) // 2]
    peak = DENSE_FLOP_PER_SM_CLOCK * torch.cuda.get_device_properties(0).multi_processor_count * clock * 1e6
    rate = flop / (us * 1e-6)
    return (f"{name}: {us:.0f} us/call, SM clock median {clock:.0f} MHz (min {clocks[0]:.0f}), "
            f"power median {power[len(power) // 2]:.0f} W (max {power[-1]:.0f}), "
            f"{rate / 1e12:.0f} TFLOP/s = {100 * rate / peak:.0f}% of the tensor peak at that clock")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--all3", action="store_true", help="also ours with per-row T + bitmask + logprobs")
    args = parser.parse_args()
    weight = torch.randn(args.vocab, args.dim, device="cuda", dtype=torch.bfloat16) * args.dim**-0.5
    hidden = torch.randn(args.batch, args.dim, device="cuda", dtype=torch.bfloat16)
    print(f"{torch.cuda.get_device_name(0)}, D={args.dim} V={args.vocab} B={args.batch}")
    modes = [("ours T=1", lambda: flashsampling_cuda.sample(hidden, weight, temperature=1.0)),
             ("ours T=0 (no noise)", lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.0)),
             ("cuBLAS mm", lambda: hidden @ weight.T)]
    if args.all3:
        from bench_controls import variant_kwargs

        kwargs = variant_kwargs("all3", args.batch, args.vocab, hidden.device)
        modes.insert(1, ("ours all3", lambda: torch.ops.flashsampling.sample_with_scores(hidden, weight, **kwargs)))
    flop = 2.0 * args.batch * args.vocab * args.dim
    for name, fn in modes:
        print(probe(name, fn, flop), flush=True)


if __name__ == "__main__":
    main()
