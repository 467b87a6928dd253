"""Logprobs as serving APIs return them (issue #34): ours against the torch patterns, one run.

For each shape (D x V), logits regime (bf16; flashsampling_cuda/problems.py: LLM-like rows, a
Zipf head over a Gaussian bulk, and flat rows, random weights) and batch B, at temperature T
(default 0.8), every contender side by side (medians of CUDA-graph replays, µs):

  ours <variant>  flashsampling_cuda.sample with the variant's logprob outputs:
                    plain      no logprobs
                    lp         return_logprobs=True (the sampled token's logprob and logsumexp)
                    N=1/5/20   + top_logprobs=N (top-N ids and logprobs, the sampled token's rank)
                    K=8 ids    + token_ids [B, 8] (the logprobs of given ids)
                    raw N=20   + top_logprobs=20, logprobs_mode="raw"
  torch           torch.compile(cuBLAS logits -> fp32 log_softmax(logits / T) -> torch.topk(N) /
                  gather of the K ids -> torch.multinomial); "plain": softmax -> multinomial;
                  "raw": log_softmax of the raw logits for the outputs
  vLLM            torch.compile of vLLM v1's sampler pattern: fp32 logits, softmax(logits / T) and
                  an exponential race (probs / Exp(1) -> argmax) for the token, log_softmax (of
                  logits / T, or of the raw logits for "raw"), topk N, gather of the sampled
                  token's logprob, rank = (logprobs > token_logprob).sum(-1) + 1, the cat of ids and
                  logprobs (not for plain, lp and K ids)

Ratios (same run): ours <variant> / ours plain, torch / ours, vLLM / ours. Checks printed last
(issue #34): N=20 within 1.10x of plain for B <= 64 and 1.25x at B = 256; every cell faster than
the compiled baselines.

Writes benchmarks/results/logprobs_<gpu>_<date>.{json,md,png}: "records" holds one entry per
(D, V, regime, B, variant) with ours_us, plain_us, torch_us, vllm_us and the ratios.

Usage:
  python benchmarks/bench_logprobs.py [--shapes 4096x151936,8192x128256] [--batches 1,16,64,128,256]
      [--regimes llm,flat] [--variants plain,lp,N=1,...] [--baselines torch,vllm] [--temperature 0.8]
      [--out benchmarks/results]
  python benchmarks/bench_logprobs.py --tiny            # CPU / GPU smoke run, eager timing
"""

from __future__ import annotations

import sys

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states
import harness
from harness import (Bench, baseline_cells, cell, check_line, eager_note, faster_check, int_list, make_parser,
                     plot_lines, ratio_lines, shape_tables)

TINY = dict(shapes="64x1000", batches="1,4")  # --tiny's defaults

# name -> (top_logprobs N or None for no logprobs, K given ids, logprobs_mode)
VARIANTS = {
    "plain": (None, 0, "processed"),
    "lp": (0, 0, "processed"),
    "N=1": (1, 0, "processed"),
    "N=5": (5, 0, "processed"),
    "N=20": (20, 0, "processed"),
    "K=8 ids": (0, 8, "processed"),
    "raw N=20": (20, 0, "raw"),
}
TORCH_BASELINE = ("plain", "N=1", "N=5", "N=20", "K=8 ids", "raw N=20")
VLLM_BASELINE = ("N=1", "N=5", "N=20", "raw N=20")


def ours_kwargs(variant: str, token_ids: torch.Tensor) -> dict:
    n, k, mode = VARIANTS[variant]
    if n is None:
        return {}
    kwargs = dict(return_logprobs=True, top_logprobs=n, logprobs_mode=mode)
    if k:
        kwargs["token_ids"] = token_ids
    return kwargs


def torch_pattern(variant: str, temperature: float):
    """cuBLAS logits -> log_softmax -> topk / gather -> multinomial, in fp32 (to compile)."""
    n, k, mode = VARIANTS[variant]

    def fn(hidden, weight, token_ids):
        logits = (hidden @ weight.T).float()
        scaled = logits / temperature
        if n is None:
            return torch.multinomial(torch.softmax(scaled, dim=-1), 1)
        logprobs = torch.log_softmax(scaled, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1)
        table = logprobs if mode == "processed" else torch.log_softmax(logits, dim=-1)
        out = [token, table.gather(1, token)]
        if n:
            out += list(torch.topk(table, n, dim=-1))
        if k:
            out.append(table.gather(1, token_ids))
        return out

    return fn


def vllm_pattern(variant: str, temperature: float):
    """vLLM v1's sampler with logprobs (vllm/v1/sample/sampler.py: compute_logprobs, random_sample,
    gather_logprobs), in fp32 (to compile)."""
    n, _, mode = VARIANTS[variant]

    def fn(hidden, weight, token_ids):
        logits = (hidden @ weight.T).float()
        raw = torch.log_softmax(logits, dim=-1) if mode == "raw" else None  # before the logits processors
        scaled = logits / temperature
        probs = torch.softmax(scaled, dim=-1)
        token = probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1, keepdim=True)
        table = raw if raw is not None else torch.log_softmax(scaled, dim=-1)
        token_logprob = table.gather(-1, token)
        rank = (table > token_logprob).sum(-1) + 1
        top_logprobs, top_ids = torch.topk(table, n, dim=-1)
        return torch.cat((token, top_ids), dim=1), torch.cat((token_logprob, top_logprobs), dim=1), rank

    return fn


def run(bench: Bench, args) -> None:
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    variants = ["plain"] + [v for v in variants if v != "plain"]  # the reference of every ratio
    baselines = {}
    for kind, names, make in (("torch", TORCH_BASELINE, torch_pattern), ("vllm", VLLM_BASELINE, vllm_pattern)):
        if kind in args.baselines.split(","):
            for v in names:
                if v in variants:
                    baselines[(kind, v)] = bench.baseline(f"{kind} {v}", make(v, args.temperature))
    T = args.temperature
    unknown = [r for r in args.regimes.split(",") if r not in ("llm", "flat")]
    if unknown:
        sys.exit(f"unknown regimes {unknown}; choose from llm, flat")
    for dim, vocab, weight in bench.weights(args.shapes):
        for regime in args.regimes.split(","):
            for batch in int_list(args.batches):
                hidden = hidden_states(weight, batch, regime, seed=batch)
                gen = torch.Generator(device="cpu").manual_seed(batch)
                token_ids = torch.randint(0, vocab, (batch, 8), generator=gen).to(bench.device)
                plain_us = None
                for variant in variants:
                    record = {"D": dim, "V": vocab, "B": batch, "variant": variant, "regime": regime}
                    kwargs = ours_kwargs(variant, token_ids)
                    bench.measure(record, "ours_us", lambda kwargs=kwargs: flashsampling_cuda.sample(
                        hidden, weight, temperature=T, **kwargs))
                    if variant == "plain":
                        plain_us = record.get("ours_us")
                    record["plain_us"] = plain_us
                    for kind in ("torch", "vllm"):
                        if (kind, variant) in baselines:
                            bench.measure(record, f"{kind}_us", baselines[(kind, variant)], hidden, weight, token_ids)
                    bench.add(record, markdown_table, ("torch_us", "vllm_us"))


def markdown_table(results: dict) -> str:
    """A table per regime and shape (records of an older run without a regime: LLM-like rows)."""
    tables = []
    for regime in dict.fromkeys(r.get("regime", "llm") for r in results["records"]):
        rows = {**results, "records": [r for r in results["records"] if r.get("regime", "llm") == regime]}
        tables.append(shape_tables(
            rows, f"{regime} logits",
            ["B", "variant", "ours", "ours / plain", "torch", "torch / ours", "vLLM", "vLLM / ours"],
            lambda r: [str(r["B"]), r["variant"], cell(r.get("ours_us")), cell(r.get("ours_over_plain"), ".3f"),
                       *baseline_cells(r, "torch", "vllm")]))
    return "\n".join(tables)


def checks(results: dict) -> list[str]:
    records = results["records"]

    def where(r):
        return f"{r.get('regime', 'llm')} D={r['D']} B={r['B']}" + ("" if "variant" not in r else f" {r['variant']}")

    n20 = [r for r in records if r["variant"] == "N=20" and r.get("ours_over_plain") is not None]
    out = [
        check_line("N=20 / plain <= 1.10 for B <= 64", [(where(r), r["ours_over_plain"]) for r in n20 if r["B"] <= 64],
                   lambda v: v <= 1.10),
        check_line("N=20 / plain <= 1.25 at B = 256", [(where(r), r["ours_over_plain"]) for r in n20 if r["B"] == 256],
                   lambda v: v <= 1.25),
    ]
    out.append(faster_check("every cell faster than the compiled baselines (min baseline / ours > 1)", records,
                            ("torch_over_ours", "vllm_over_ours"), where, eager_note(results)))
    return out


def plot(results: dict, path) -> None:
    """LLM-like rows (solid: ours; dotted: the baselines), and ours N=20 on flat rows (dashed)."""
    def select(r, v):
        return r["variant"] == v and r.get("regime", "llm") == "llm"

    def select_flat(r, v):
        return r["variant"] == v and r.get("regime", "llm") == "flat"

    variants = [v for v in VARIANTS if v != "plain"]
    plot_lines(results, path, ratio_lines(variants, select, "ours_us", "ours {}", "o-")
               + ratio_lines(["N=20", "raw N=20"], select_flat, "ours_us", "ours {} (flat rows)", "s--")
               + ratio_lines(["N=20"], select, "torch_us", "torch {} (dotted: baselines)", "x:")
               + ratio_lines(["N=20"], select, "vllm_us", "vLLM {}", "+:"))


def main() -> None:
    parser = make_parser(__doc__, shapes="4096x151936,8192x128256", batches="1,16,64,128,256", tiny=TINY)
    parser.add_argument("--variants", default=None, help=f"comma list of {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--baselines", default="torch,vllm", help="comma list of torch, vllm")
    parser.add_argument("--regimes", default="llm,flat", help="comma list of llm, flat")
    harness.main("logprobs", parser, TINY, run, markdown_table, checks, plot,
                 header=lambda args: dict(regimes=args.regimes.split(","), variants=VARIANTS))


if __name__ == "__main__":
    main()
