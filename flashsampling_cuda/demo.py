"""Samples next tokens for an LM-head-shaped problem and prints tokens and timings.

    bash scripts/demo.sh                       # sets up, then runs this module
    python -m flashsampling_cuda.demo --batch 8 --dim 4096 --vocab 151936 --device cpu

On the GPU when there is one, else on the CPU. The weights are random: the tokens show
the API at work (a decode loop advancing the offset), the timings its speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashsampling_cuda as fs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--steps", type=int, default=3, help="decode steps to print")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default: 50 GPU, 5 CPU)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    # LM-head-like scale: logits with a spread of a few units.
    hidden = torch.randn(args.batch, args.dim, device=device, generator=gen).to(dtype)
    weight = torch.empty(args.vocab, args.dim, device=device, dtype=dtype).normal_(
        std=3.0 / args.dim**0.5, generator=gen
    )
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    print(f"device {name}; hidden [{args.batch}, {args.dim}], weight [{args.vocab}, {args.dim}], {args.dtype}")

    for step in range(args.steps):  # one request stream: same seed, offset = step
        tokens = fs.sample(hidden, weight, temperature=args.temperature, seed=1234, offset=step)
        print(f"step {step}: tokens {tokens[:, 0].tolist()}")
    greedy = fs.sample(hidden, weight, temperature=0.0, seed=0)
    print(f"greedy: tokens {greedy[:, 0].tolist()}")

    repeats = args.repeats or (50 if device.type == "cuda" else 5)
    times = []
    for i in range(repeats + 2):  # 2 warm-up calls
        synchronize(device)
        start = time.perf_counter()
        fs.sample(hidden, weight, temperature=args.temperature, seed=1234, offset=i)
        synchronize(device)
        times.append(time.perf_counter() - start)
    median_ms = statistics.median(times[2:]) * 1e3
    tflops = 2 * args.batch * args.dim * args.vocab / (median_ms * 1e-3) / 1e12
    print(f"flashsampling.sample: {median_ms:.3f} ms per call (median of {repeats}), {tflops:.2f} TFLOP/s of GEMM")


if __name__ == "__main__":
    main()
