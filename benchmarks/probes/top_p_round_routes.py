"""Which calls of the fused top_p path leave a row to the cut kernel, against a model of the
rounds: a row takes the cut kernel iff its third winner fails top_p (the rounds verify three).

Rows of exact logits (bf16 multiples of 1/8 whose products and sums are exact in fp32, so the
model on the GPU's own logits), top_p as a [B] tensor, one call a seed. The model: t1 = the best
perturbed score over the row, then while t fails top_p (its mass ahead reaches top_p) the best
strictly ahead of it (top_p_winner_first.py's loop, float64 masses). The call: whether the logits
sampler's kernels took more than --cut-us µs (they cut a row) under the profiler. A probe for the
route, not for timing; prints the seeds where the two disagree.

    PYTHONPATH=. python benchmarks/probes/top_p_round_routes.py --batches 64,130 --seeds 60 --top-p 0.7
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import flashsampling_cuda as fs
from flashsampling_cuda.noise import gumbel_noise

from top_p_winner_first import winner_first  # noqa: E402  (benchmarks/probes on the path)


def exact_flat_problem(batch: int, vocab: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-3, 4, (vocab, dim), generator=g).float() / 8
    hidden = torch.randint(-2, 3, (batch, dim), generator=g).float() / 8
    return hidden.bfloat16().cuda(), weight.bfloat16().cuda(), (hidden.cuda() @ weight.cuda().T)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,130")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--top-p", type=float, default=0.7)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--cut-us", type=float, default=10.0)
    args = parser.parse_args()
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(args.temperature, dtype=torch.float32)
    for batch in (int(b) for b in args.batches.split(",")):
        hidden, weight, logits = exact_flat_problem(batch, args.vocab, args.dim, seed=batch)
        y = logits * inv_t.cuda()
        top_p = torch.full((batch,), args.top_p, dtype=torch.float64, device="cuda")
        agree, cut_calls, model_cut_calls, disagree = 0, 0, 0, []
        for seed in range(args.seeds):
            g = gumbel_noise(seed, 0, torch.arange(batch, device="cuda")[:, None], 0,
                             torch.arange(args.vocab, device="cuda")[None, :])
            scores = (logits.double() * inv_t.double().cuda() + g.double()).float()
            _, passes = winner_first(y, scores, args.top_p, None)
            winners = passes - 1  # the winners the loop verified
            model_cut = bool((winners > 3).any())
            call = lambda: fs.sample(hidden, weight, temperature=args.temperature, top_p=top_p,  # noqa: E731,B023
                                     seed=torch.tensor(seed, device="cuda"), offset=torch.tensor(0, device="cuda"),
                                     truncation_path="fused_top_k")
            call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            cut_us = sum(e.device_time for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA and "sample_from_logits" in e.name)
            cut = cut_us > args.cut_us
            cut_calls += cut
            model_cut_calls += model_cut
            agree += cut == model_cut
            if cut != model_cut:
                rows = (winners > 3).nonzero().flatten().cpu().tolist()
                counts = torch.bincount(winners.cpu(), minlength=6).tolist()
                disagree.append(f"seed {seed}: cut {cut_us:.1f} us, model rows past 3 winners {rows}, "
                                f"rows by winners {counts}")
        print(f"B={batch} top_p={args.top_p}: {args.seeds} calls, cut kernel cut in {cut_calls}, model in "
              f"{model_cut_calls}, agree {agree}", flush=True)
        for line in disagree:
            print("   ", line, flush=True)


if __name__ == "__main__":
    main()
