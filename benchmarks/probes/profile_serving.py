"""Per-kernel device times of the serving features' calls (torch.profiler): plain sampling,
top_logprobs / token_ids, the three penalties over 2048-token histories, the soft-cap, per-row
temperatures (the common controls' loop) and
speculative verification with one-hot and sampled drafts, so that the time
each spends beyond plain sampling can be placed (the logits GEMM, sample_from_logits, the
top-N kernel, torch's small kernels).

  python3 benchmarks/probes/profile_serving.py --batches 1,64 --shape 4096x151936
  (--timeline: also one CUDA-graph replay of each call, each kernel with the idle time before it;
   --only 'spec n=4 sampled' for one call)
"""

import argparse

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from stage2_share import graph_timeline, kernel_times  # benchmarks/probes/, this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--only", default=None, help="comma list of the calls to profile (default: all)")
    parser.add_argument("--regime", default="llm", choices=["llm", "flat"])
    parser.add_argument("--timeline", action="store_true",
                        help="also one CUDA-graph replay of each call: each kernel with the idle gap before it")
    args = parser.parse_args()
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = lm_head_weight(vocab, dim)
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = hidden_states(weight, batch, args.regime, seed=1)
        ids = torch.zeros(batch, 8, dtype=torch.int64, device=hidden.device)
        calls = {
            "plain": lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1),
            "N=20": lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1, return_logprobs=True,
                                                      top_logprobs=20),
            "K=8 ids": lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1,
                                                         return_logprobs=True, token_ids=ids),
            "raw N=20": lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1,
                                                          return_logprobs=True, top_logprobs=20, logprobs_mode="raw"),
        }
        gen = torch.Generator(device=hidden.device).manual_seed(batch)
        prompt = torch.randint(0, vocab, (batch, 1024), device=hidden.device, generator=gen)
        output = torch.randint(0, 512, (batch, 1024), device=hidden.device, generator=gen)  # repeats
        state = flashsampling_cuda.PenaltyState(prompt, output)
        penalties = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2, penalty_state=state)
        calls["penalties L=2048"] = lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1,
                                                                      **penalties)
        calls["softcap"] = lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=1,
                                                             logit_softcap=30.0)
        temperatures = torch.full((batch,), 0.8, device=hidden.device)
        calls["[B] T"] = lambda: flashsampling_cuda.sample(hidden, weight, temperature=temperatures, seed=1)
        for n in (1, 4):
            spec_hidden = hidden_states(weight, batch * (n + 1), "llm", seed=2).view(batch, n + 1, dim)
            drafts = torch.zeros(batch, n, dtype=torch.int64, device=hidden.device)
            calls[f"spec n={n}"] = (lambda h=spec_hidden, d=drafts: flashsampling_cuda.speculative_sample(
                h, weight, d, temperature=0.8, seed=1))
            if n == 4:
                q = torch.softmax(torch.randn(batch, n, vocab, device=hidden.device, generator=gen), dim=2)
                calls[f"spec n={n} sampled"] = (lambda h=spec_hidden, d=drafts, q=q: flashsampling_cuda.speculative_sample(
                    h, weight, d, q, temperature=0.8, seed=1))
        for name, call in calls.items():
            if args.only is not None and name not in args.only.split(","):
                continue
            call()
            times = kernel_times(call, args.calls)
            total = sum(times.values())
            top = ", ".join(f"{k} {v:.0f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:12])
            print(f"B={batch} {name}: {total:.0f} us device; {top}", flush=True)
            if args.timeline:
                print(f"    graph replay: {graph_timeline(call)}", flush=True)


if __name__ == "__main__":
    main()
