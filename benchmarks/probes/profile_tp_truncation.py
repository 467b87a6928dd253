"""Per-kernel device time of the tensor-parallel sample's truncation on one GPU (probe, not a
benchmark): ``distributed.sample`` in a one-rank NCCL group (its all-reduces run as in a larger
group), flat rows, D = 4096, V = 151936, T = 0.8; the torch profiler's CUDA kernels, mean µs a call
over ten calls, largest first.

    python benchmarks/probes/profile_tp_truncation.py [--batches 64,256]
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.distributed as dist

from flashsampling_cuda import distributed as tp
from flashsampling_cuda.problems import hidden_states, lm_head_weight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    weight = lm_head_weight(151936, 4096, device=device)
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = hidden_states(weight, batch, "flat")
        rows = lambda value: torch.full((batch,), value, device=device)  # noqa: E731
        forms = {"min_p0.05": dict(min_p=0.05), "p0.9 [B]": dict(top_p=rows(0.9)), "k20 [B]": dict(top_k=rows(20))}
        for name, form in forms.items():
            common = dict(temperature=0.8, seed=torch.tensor(1, device=device), offset=torch.tensor(0, device=device))
            for _ in range(3):
                tp.sample(hidden, weight, vocab_start=0, **common, **form)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(args.calls):
                    tp.sample(hidden, weight, vocab_start=0, **common, **form)
                torch.cuda.synchronize()
            per_kernel = collections.defaultdict(float)
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    per_kernel[event.name[:70]] += event.device_time_total / args.calls
            print(f"[flat B={batch} {name}] kernels {sum(per_kernel.values()):.1f} us")
            for kernel, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
                if us >= 0.5:
                    print(f"    {us:7.1f}  {kernel}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
