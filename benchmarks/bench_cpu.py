"""The CPU path against plain torch, side by side in one run, at 1 and all threads.

For each batch size B and thread count at one (D, V) shape (default D=4096, V=151936, bf16),
times, in ms per call:

  mm            torch matmul alone (hidden @ W.T, bf16 out: oneDNN on CPUs with AVX-512 BF16)
  torch         the standard pipeline: fp32 logits of that matmul -> softmax -> multinomial
  ours          flashsampling_cuda.sample (fused, exact)
  torch_topkp   matmul -> topk(50) -> softmax -> top-p 0.9 (sorted cumsum) -> multinomial
  ours_topkp    sample(top_k=50, top_p=0.9)
  torch_lp      matmul -> log_softmax -> multinomial -> the token's log-probability
  ours_lp       sample(return_logprobs=True)

and the ratios ours / torch (the issue's targets: plain <= 1.0, top-k/top-p and logprobs <= 1.3).
Rounds run every call once in turn, so load from other processes hits all of them alike; the
table reports each call's median over the rounds. The load average before and after goes into
the results.

Usage: python benchmarks/bench_cpu.py [--dim 4096] [--vocab 151936] [--batches 8,64]
           [--threads 1,2] [--dtype bfloat16] [--rounds 7] [--out benchmarks/results]
Writes cpu_<cpu model>_<date>.{json,md} under --out (cpu_<dtype>_... for another dtype).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import flashsampling_cuda as fs
from report import run_header, write_results, written_files

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CALLS = ["mm", "torch", "ours", "torch_topkp", "ours_topkp", "torch_lp", "ours_lp"]
RATIOS = [("ours", "torch"), ("ours_topkp", "torch_topkp"), ("ours_lp", "torch_lp")]
TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def torch_calls(hidden: torch.Tensor, weight: torch.Tensor, gen: torch.Generator) -> dict:
    """The standard pipelines (the way a decode loop writes them without FlashSampling)."""

    def logits():
        return (hidden @ weight.T).float() / TEMPERATURE

    def plain():
        return torch.multinomial(torch.softmax(logits(), dim=-1), 1, generator=gen)

    def topkp():
        values, indices = torch.topk(logits(), TOP_K, dim=-1)  # sorted, descending
        probs = torch.softmax(values, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass ahead of each token
        probs = probs.masked_fill(before >= TOP_P, 0.0)
        return indices.gather(1, torch.multinomial(probs, 1, generator=gen))

    def logprobs():
        logp = torch.log_softmax(logits(), dim=-1)
        tokens = torch.multinomial(logp.exp(), 1, generator=gen)
        return tokens, logp.gather(1, tokens)

    return {"mm": lambda: hidden @ weight.T, "torch": plain, "torch_topkp": topkp, "torch_lp": logprobs}


def our_calls(hidden: torch.Tensor, weight: torch.Tensor) -> dict:
    step = iter(range(1 << 62))  # a fresh offset per call, as a decode loop advances it
    kw = lambda: dict(temperature=TEMPERATURE, seed=1234, offset=next(step))  # noqa: E731
    return {
        "ours": lambda: fs.sample(hidden, weight, **kw()),
        "ours_topkp": lambda: fs.sample(hidden, weight, **kw(), top_k=TOP_K, top_p=TOP_P),
        "ours_lp": lambda: fs.sample(hidden, weight, **kw(), return_logprobs=True),
    }


def measure(batch: int, dim: int, vocab: int, dtype: torch.dtype, rounds: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, dim, generator=g).to(dtype)
    weight = (torch.randn(vocab, dim, generator=g) * (3.0 / dim**0.5)).to(dtype)
    calls = {**torch_calls(hidden, weight, g), **our_calls(hidden, weight)}
    for name in CALLS:  # warm-up (oneDNN primitive creation, allocations)
        calls[name]()
    times = {name: [] for name in CALLS}
    for _ in range(rounds):
        for name in CALLS:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()} | {"all_ms": times}


def markdown_table(results: dict) -> str:
    head = ["B", "threads", *CALLS, *(f"{a}/{b}" for a, b in RATIOS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results["rows"]:
        cells = [str(r["B"]), str(r["threads"])] + [f"{r[n]:.1f}" for n in CALLS]
        cells += [f"{r[a] / r[b]:.2f}" for a, b in RATIOS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()

    device = cpu_model()
    results = run_header(device) | {
        "D": args.dim, "V": args.vocab, "dtype": args.dtype, "rounds": args.rounds,
        "temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P,
        "cpus": os.cpu_count(), "avx512_bf16": "avx512_bf16" in cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(), "load_before": os.getloadavg(), "rows": [],
    }
    thread_counts = sorted({int(t) for t in args.threads.split(",")})
    for batch in (int(b) for b in args.batches.split(",")):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            row = {"B": batch, "threads": threads}
            row |= measure(batch, args.dim, args.vocab, DTYPES[args.dtype], args.rounds)
            results["rows"].append(row)
            print(f"[bench_cpu] B={batch} threads={threads}: " + ", ".join(f"{n} {row[n]:.1f}" for n in CALLS),
                  flush=True)
    results["load_after"] = os.getloadavg()
    table = markdown_table(results)
    table += (f"\n\n{device} ({results['cpus']} CPUs, AVX-512 BF16: {'yes' if results['avx512_bf16'] else 'no'}), "
              f"{results['date']}, torch {results['torch']}, D = {args.dim}, V = {args.vocab}, "
              f"{args.dtype}, T = {TEMPERATURE}, top-k {TOP_K} / top-p {TOP_P}; ms per call, median of "
              f"{args.rounds} rounds; load average {results['load_before'][0]:.2f} before, "
              f"{results['load_after'][0]:.2f} after.")
    model = device.replace(" ", "_").replace("/", "_")
    stem = f"cpu_{model}_{results['date']}" if args.dtype == "bfloat16" else f"cpu_{args.dtype}_{model}_{results['date']}"
    path = write_results(args.out, stem, results, table)
    print(f"[bench_cpu] wrote {written_files(path)}")
    print(table)


if __name__ == "__main__":
    main()
