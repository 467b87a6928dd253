"""Per-kernel device times of one sampling call (torch.profiler), to split the fused pass
into its stages: the GEMM + epilogue (cutlass device_kernel), the stage-2 kernel
(reduce_candidates / truncate_candidates) and anything else launched.

  python3 benchmarks/probes/profile_stages.py --batches 1,32,64,128,256 --mode topk
  python3 benchmarks/probes/profile_stages.py --batches 32,64 --mode plain,temps,logprobs,all3 --vocab 75968

--mode takes a comma-separated list: plain, topk, or any variant of bench_controls.py (temps,
mask, logprobs, all3, ...; the same arguments as there, on the same data).
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

import flashsampling_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_*.py, report.py
from bench_controls import VARIANTS as CONTROL_VARIANTS
from bench_controls import variant_kwargs
from stage2_share import kernel_times_us  # benchmarks/probes/, this script's folder

MODES = {
    "plain": {},
    "topk": dict(top_k=50, top_p=0.9),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,32,64,128,256")
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--mode", default="topk", help="comma-separated: plain, topk, or bench_controls variants")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=50, help="top_k of --mode topk (with top_p=0.9)")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(args.vocab, args.dim, device="cuda", generator=gen) / args.dim**0.5).to(torch.bfloat16)
    modes = args.mode.split(",")
    for mode in modes:
        if mode not in MODES and mode not in CONTROL_VARIANTS:
            parser.error(f"--mode: unknown mode {mode!r} (plain, topk, {', '.join(CONTROL_VARIANTS)})")
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = torch.randn(batch, args.dim, device="cuda", generator=gen).to(torch.bfloat16)
        for mode in modes:
            if mode in MODES:
                options = dict(MODES[mode], **({"top_k": args.top_k} if mode == "topk" else {}), seed=1)
                op = flashsampling_cuda.sample
            else:  # the op bench_controls.py times, with its arguments
                options = variant_kwargs(mode, batch, args.vocab, torch.device("cuda"))
                op = torch.ops.flashsampling.sample_with_scores
            profile_call(lambda: op(hidden, weight, **options), mode, args, batch)  # noqa: B023


def profile_call(call, mode: str, args, batch: int) -> None:
    totals = defaultdict(float)
    for name, us in kernel_times_us(call, args.calls).items():
        totals["gemm+epilogue" if "device_kernel" in name else name.split("(")[0].split("<")[0][-40:]] += us
    parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(totals.items(), key=lambda kv: -kv[1]))
    label = f"topk k={args.top_k}" if mode == "topk" else mode
    print(f"[{label}] D={args.dim} V={args.vocab} B={batch}: total {sum(totals.values()):.1f} us: {parts}")


if __name__ == "__main__":
    main()
