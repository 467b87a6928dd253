"""Samples next tokens for an LM-head-shaped problem, times it against the standard pipeline
and checks that the tokens follow the exact distribution.

    bash scripts/demo.sh                       # sets up, then runs this module
    python -m flashsampling_cuda.demo --batch 8 --dim 4096 --vocab 151936 --device cpu

On the GPU when there is one, else on the CPU. The weights are random: the tokens show the API
at work (a decode loop advancing the offset); the timings (warm calls, medians) put
``flashsampling.sample`` next to torch's matmul -> softmax -> multinomial on the same device;
a chi-square test of many draws on a small vocabulary compares the tokens' frequencies with
``softmax(logits / T)``.
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
    ours_ms = median_ms(lambda i: fs.sample(hidden, weight, temperature=args.temperature, seed=1234, offset=i),
                        device, repeats)
    gen_torch = torch.Generator(device=device).manual_seed(1)

    def standard(_):
        logits = (hidden @ weight.T).float() / args.temperature
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen_torch)

    torch_ms = median_ms(standard, device, repeats)
    tflops = 2 * args.batch * args.dim * args.vocab / (ours_ms * 1e-3) / 1e12
    print(f"{'flashsampling.sample:':40s}{ours_ms:9.3f} ms per call ({tflops:.2f} TFLOP/s of GEMM)")
    print(f"{'torch matmul -> softmax -> multinomial:':40s}{torch_ms:9.3f} ms per call")
    print(f"speed-up: {torch_ms / ours_ms:.2f}x (warm calls, median of {repeats} each, same device)")
    print(exactness_line(device, dtype, args.temperature))


def median_ms(call, device: torch.device, repeats: int, warmup: int = 2) -> float:
    """Median wall time of call(i) in ms over `repeats` calls after `warmup` untimed ones."""
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        call(i)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def exactness_line(device: torch.device, dtype: torch.dtype, temperature: float, vocab: int = 20,
                   draws: int = 200_000) -> str:
    """One line: a chi-square test of `draws` samples of one row over a small vocabulary
    against softmax(logits / T) computed in float64."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    hidden = torch.randn(1, 64, generator=gen).to(dtype)
    weight = (torch.randn(vocab, 64, generator=gen) * 0.15).to(dtype)
    tokens = fs.sample(hidden.to(device), weight.to(device), temperature=temperature, seed=99, num_samples=draws)
    counts = torch.bincount(tokens.flatten().cpu(), minlength=vocab).double()
    probs = torch.softmax((hidden.double() @ weight.double().T)[0] / temperature, dim=0)
    expected = probs * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    p = float(torch.special.gammaincc(torch.tensor((vocab - 1) / 2, dtype=torch.float64),
                                      torch.tensor(chi2 / 2, dtype=torch.float64)))
    verdict = "consistent with the exact distribution" if p > 1e-3 else "NOT consistent: please report this"
    return (f"exactness: {draws} draws over V = {vocab} tokens against softmax(logits / T): chi-square = {chi2:.1f} "
            f"({vocab - 1} dof), p = {p:.3f}: {verdict}")

if __name__ == "__main__":
    main()
