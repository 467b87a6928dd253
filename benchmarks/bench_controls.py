"""Overhead of each sampling control in the fused kernel, side by side in one run.

For each batch size B at one (D, V) shape (default D=4096, V=151936, bf16), times:

  mm          cuBLAS matmul alone (hidden @ W.T), the reference the targets use
  plain       the fused sampler, batch-wide float temperature
  temps       + per-row temperatures ([B] float32 on the GPU)
  mask        + allowed-token bitmask ([B, ceil(V/32)] int32, ~90% of tokens allowed)
  logprobs    + token log-probabilities and logsumexp
  bias        + dense [V] logit bias
  sparse      + sparse per-row bias (16 entries per row)
  row_seeds   + per-row seeds and offsets ([B] int64 on the GPU)
  all3        per-row temperatures + bitmask + logprobs together (the issue's target)
  samples4    num_samples=4 (reported per call; one GEMM pass for B <= 64)

Medians of CUDA-event timings of warm calls, by default of each call captured in a CUDA
graph and replayed (device time; --timing eager includes the host's per-call work); W
streams from HBM every call.

Usage: python benchmarks/bench_controls.py [--dim 4096] [--vocab 151936]
           [--batches 1,8,32,64,128,256] [--timing graph|eager] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import flashsampling_cuda  # noqa: F401  (registers torch.ops.flashsampling)
from bench_sampler import median_us
from report import run_header, write_results

VARIANTS = ["plain", "temps", "mask", "logprobs", "bias", "sparse", "row_seeds", "all3", "samples4"]


def variant_kwargs(name: str, batch: int, vocab: int, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(batch)
    temps = (torch.rand(batch, generator=g) * 1.5 + 0.25).to(device)
    words = (vocab + 31) // 32
    allowed = torch.rand(batch, words * 32, generator=g) < 0.9
    bits = allowed.view(batch, words, 32).to(torch.int64) << torch.arange(32)
    words_u32 = bits.sum(-1)
    mask = torch.where(words_u32 >= 2**31, words_u32 - 2**32, words_u32).to(torch.int32).to(device)
    base = dict(seed=torch.tensor(7, device=device), offset=torch.tensor(0, device=device), empty_mask_token=-1)
    if name == "plain":
        return base
    if name == "temps":
        return dict(base, temperatures=temps)
    if name == "mask":
        return dict(base, allowed_mask=mask)
    if name == "logprobs":
        return dict(base, return_logprobs=True)
    if name == "bias":
        return dict(base, logit_bias=torch.randn(vocab, generator=g).to(device))
    if name == "sparse":
        ids = torch.randint(0, vocab, (batch, 16), generator=g).to(device)
        return dict(base, sparse_bias_ids=ids, sparse_bias_values=torch.randn(batch, 16, generator=g).to(device))
    if name == "row_seeds":
        return dict(base, seed=torch.arange(batch, device=device) + 11, offset=torch.arange(batch, device=device))
    if name == "all3":
        return dict(base, temperatures=temps, allowed_mask=mask, return_logprobs=True)
    if name == "samples4":
        return dict(base, num_samples=4)
    raise ValueError(name)


def run(args) -> dict:
    device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    results = {
        **run_header(props.name),
        "D": args.dim,
        "V": args.vocab,
        "timing": args.timing,
        "rows": [],
    }
    weight = torch.randn(args.vocab, args.dim, device=device, dtype=dtype) * args.dim**-0.5
    op = torch.ops.flashsampling.sample_with_scores
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = torch.randn(batch, args.dim, device=device, dtype=dtype)
        graph = args.timing == "graph"
        row = {"B": batch, "mm": median_us(lambda: hidden @ weight.T, graph=graph)}
        for name in VARIANTS:
            kwargs = variant_kwargs(name, batch, args.vocab, device)
            row[name] = median_us(lambda kwargs=kwargs: op(hidden, weight, **kwargs), graph=graph)
        results["rows"].append(row)
        print("[bench] " + json.dumps(row), flush=True)
    return results


def markdown_table(results: dict) -> str:
    head = ["B", "mm"] + VARIANTS + ["all3/plain", "all3/mm"]
    lines = [
        f"\n**Controls overhead, D={results['D']}, V={results['V']}** (bf16, {results['device']}, {results['date']}), "
        f"µs (median, {'CUDA-graph replays' if results.get('timing') == 'graph' else 'eager calls'}); "
        "each control alone, then all3 = per-row T + bitmask + logprobs\n",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in results["rows"]:
        cells = [str(r["B"]), f"{r['mm']:.0f}"] + [f"{r[v]:.0f}" for v in VARIANTS]
        cells += [f"{r['all3'] / r['plain']:.3f}", f"{r['all3'] / r['mm']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batches", default="1,8,32,64,128,256")
    parser.add_argument("--timing", choices=["graph", "eager"], default="graph")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_controls.py needs a CUDA GPU")
    results = run(args)
    table = markdown_table(results)
    write_results(args.out, f"controls_{results['device'].replace(' ', '_')}_{results['date']}", results, table)
    print(table)


if __name__ == "__main__":
    main()
