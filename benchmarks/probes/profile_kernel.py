"""A handful of fused-sampler calls at one shape, for ncu (device_run.sh STEPS=ncu).

  ncu --kernel-name device_kernel --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section WarpStateStats --section SourceCounters \\
      python3 benchmarks/probes/profile_kernel.py --batch 256 --dim 4096

CUTLASS launches its GEMMs as cutlass::device_kernel<...>, the name ncu matches. The first
calls warm up (kernel load, workspace); profile a later one. --controls all3 runs
the controls kernel the way bench_controls.py's "all3" does (per-row temperatures, an
allowed-token bitmask, log-probabilities); --controls temps with per-row temperatures only.
"""

import argparse

import torch

import flashsampling_cuda


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--controls", choices=["plain", "temps", "all3"], default="plain")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_kernel.py profiles the CUDA kernel: no GPU here")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(args.batch, args.dim, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.randn(args.vocab, args.dim, device="cuda", generator=gen) / args.dim**0.5).to(torch.bfloat16)
    options = {}
    if args.controls == "temps":
        options = dict(temperature=torch.rand(args.batch, device="cuda", generator=gen) + 0.5)
    if args.controls == "all3":
        temperatures = torch.rand(args.batch, device="cuda", generator=gen) + 0.5
        words = (args.vocab + 31) // 32
        # Every token allowed except bit 31 of every 7th word: the mask is read, little changes.
        mask = torch.full((args.batch, words), -1, dtype=torch.int32, device="cuda")
        mask[:, ::7] = 0x7FFFFFFF
        options = dict(temperature=temperatures, allowed_mask=mask, return_logprobs=True)
    for call in range(args.calls):
        result = flashsampling_cuda.sample(hidden, weight, seed=call, **options)
    tokens = result.tokens if args.controls == "all3" else result
    torch.cuda.synchronize()
    print(f"B={args.batch} D={args.dim} V={args.vocab} {args.controls}: {args.calls} calls, "
          f"last tokens[:4] = {tokens[:4, 0].tolist()}")


if __name__ == "__main__":
    main()
