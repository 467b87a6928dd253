"""Per-kernel device times (full names) of sample_from_logits on materialised logits, the way the
logits route calls it: no truncation with log-probabilities (the logprob outputs' route), and
min_p alone. For Nsight Compute runs of one kernel, --calls 1 and --kernel-name regex:NAME.

  python3 benchmarks/probes/profile_logits_sampler.py --batches 1,64,256 --regimes flat,llm
"""

import argparse

import torch

from flashsampling_cuda.problems import hidden_states, lm_head_weight
from stage2_share import kernel_times_us  # benchmarks/probes/, this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--regimes", default="flat,llm")
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = lm_head_weight(vocab, dim)
    for regime in args.regimes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            logits = torch.mm(hidden_states(weight, batch, regime, seed=batch), weight.t(), out_dtype=torch.float32)
            seed = torch.tensor(1, device=logits.device)
            calls = {
                "logprobs": dict(return_logprobs=True),
                "min_p [B]": dict(min_ps=torch.full((batch,), 0.05, dtype=torch.float64, device=logits.device)),
            }
            for name, extra in calls.items():
                call = (lambda extra=extra: torch.ops.flashsampling.sample_from_logits(  # noqa: E731
                    logits, temperature=0.8, seed=seed, **extra))
                times = kernel_times_us(call, args.calls)
                top = ", ".join(f"{k.split('(')[0][-48:] if '(anonymous' not in k else k.split('::')[-1].split('(')[0]}"
                                f" {v:.1f}" for k, v in sorted(times.items(), key=lambda kv: -kv[1]))
                print(f"{regime} B={batch} {name}: {sum(times.values()):.1f} us; {top}", flush=True)


if __name__ == "__main__":
    main()
