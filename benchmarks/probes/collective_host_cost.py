"""Host time of one search round's collective (probe, not a benchmark): in a one-rank NCCL group,
the issue and eager time of ``dist.all_reduce`` on a ``[1, B, 3, 256]`` int64 histogram (the key
search's), of the functional ``all_reduce_`` + ``wait_tensor`` on it, and of a bare ``torch.zeros``
of it, 200 back-to-back calls each. Where a call is host-bound, what each round costs the host.

    python benchmarks/probes/collective_host_cost.py [--batches 16,256]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from profile_tp_truncation import issue_times_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="16,256")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    name = dist.group.WORLD.group_name
    for batch in (int(b) for b in args.batches.split(",")):
        hist = torch.zeros(1, batch, 3, 256, dtype=torch.int64, device=device)

        def c10d():
            dist.all_reduce(hist)

        def functional():
            torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce_(hist, "sum", name))

        def zeros():
            torch.zeros(1, batch, 3, 256, dtype=torch.int64, device=device)

        for label, fn in (("dist.all_reduce", c10d), ("functional all_reduce_ + wait_tensor", functional),
                          ("torch.zeros", zeros)):
            for _ in range(20):
                fn()
            eager_us, issue_us = issue_times_us(fn, device, 200)
            print(f"B={batch} {label}: issued in {issue_us:.1f} us, eager {eager_us:.1f} us", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
