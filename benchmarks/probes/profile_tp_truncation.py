"""Where the tensor-parallel sample's truncation spends its time (probe, not a benchmark):
``distributed.sample`` in an NCCL group of --world ranks, one GPU each (--world 1: a one-rank
group, whose all-reduces run as in a larger group), flat rows, D = 4096, V = 151936, T = 0.8.
Rank 0 prints, per batch and form, the eager time a call (ten back-to-back calls, then a
synchronisation), the host's time to issue them (no synchronisation), the torch profiler's CUDA
kernels (mean µs a call, largest first), the single-process op's eager and issuing times on
the whole head for comparison, with --host the host operations that took most of the issuing time
and the calls that wait for the device (cudaStreamSynchronize, cudaMemcpy), and with --cprofile
the Python functions that did (cProfile, by own time); --whole-rows adds each form with
``vocab_size`` (the whole rows on every rank instead of the search across ranks).

    python benchmarks/probes/profile_tp_truncation.py [--world 2] [--batches 64,256] [--host] [--cprofile]
        [--whole-rows]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashsampling_cuda
from flashsampling_cuda import distributed as tp
from flashsampling_cuda.problems import hidden_states, lm_head_weight

VOCAB, DIM = 151936, 4096
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def forms(batch: int, device, whole_rows: bool) -> dict:
    """The forms, each also with vocab_size (the whole rows' route) where ``whole_rows``."""
    rows = lambda value: torch.full((batch,), value, device=device)  # noqa: E731
    truncated = {"min_p0.05": dict(min_p=0.05), "p0.9 [B]": dict(top_p=rows(0.9)), "k20 [B]": dict(top_k=rows(20)),
                 "k20 p0.95 [B]": dict(top_k=rows(20), top_p=rows(0.95))}
    out = {"plain": {}, **truncated}
    if whole_rows:
        out.update({f"{name} whole rows": dict(form, vocab_size=VOCAB) for name, form in truncated.items()})
    return out


def issue_times_us(call, device, calls: int) -> tuple[float, float]:
    """(eager µs a call, host µs a call to issue it) over `calls` back-to-back calls."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    issued = time.perf_counter()
    torch.cuda.synchronize(device)
    done = time.perf_counter()
    return (done - t0) * 1e6 / calls, (issued - t0) * 1e6 / calls


def print_profile(prof, calls: int, host: bool) -> None:
    per_kernel = collections.defaultdict(float)
    per_host = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:70]] += event.device_time_total / calls
        elif host:
            entry = per_host[event.name[:70]]
            entry[0] += event.self_cpu_time_total / calls
            entry[1] += 1
    print(f"    kernels {sum(per_kernel.values()):.1f} us a call")
    for kernel, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]):
        if us >= 0.5:
            print(f"    {us:7.1f}  {kernel}")
    if host:
        print("    host (self µs a call, events a call), largest first:")
        for name, (us, n) in sorted(per_host.items(), key=lambda kv: -kv[1][0])[:25]:
            print(f"    {us:7.1f} {n / calls:5.1f}  {name}")
        waits = {n: e[1] / calls for n, e in per_host.items() if n.startswith(WAITS)}
        print(f"    calls that wait for the device, a call: {waits or 'none'}")


def run_rank(rank: int, world: int, args, store: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    full = lm_head_weight(VOCAB, DIM, device=device)
    start, size = tp.vocab_shards(VOCAB, world)[rank]
    weight = full[start:start + size].clone()
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = hidden_states(full, batch, "flat")
        for name, form in forms(batch, device, args.whole_rows).items():
            common = dict(temperature=0.8, seed=torch.tensor(1, device=device), offset=torch.tensor(0, device=device))

            def call():
                return tp.sample(hidden, weight, vocab_start=start, **common, **form)

            for _ in range(3):
                call()
            dist.barrier()
            eager_us, issue_us = issue_times_us(call, device, args.calls)
            dist.barrier()
            activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU]
                                                                   if args.host else [])
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(args.calls):
                    call()
                torch.cuda.synchronize(device)
            if rank == 0:
                op_form = {k: v for k, v in form.items() if k != "vocab_size"}
                op_eager_us, op_issue_us = issue_times_us(
                    lambda: flashsampling_cuda.sample(hidden, full, **common, **op_form), device, args.calls)
                print(f"[TP={world} flat B={batch} {name}] eager {eager_us:.0f} us a call, issued in "
                      f"{issue_us:.0f} us; the single-process op: eager {op_eager_us:.0f}, issued in "
                      f"{op_issue_us:.0f}", flush=True)
                print_profile(prof, args.calls, args.host)
            if args.cprofile:
                dist.barrier()
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.calls):
                    call()
                profiler.disable()
                torch.cuda.synchronize(device)
                if rank == 0:
                    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
            dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--host", action="store_true", help="also profile the host's operations")
    parser.add_argument("--cprofile", action="store_true", help="also profile the Python functions (cProfile)")
    parser.add_argument("--whole-rows", action="store_true",
                        help="also each form with vocab_size (the whole rows on every rank)")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run_rank, args=(args.world, args, os.path.join(tmp, "store")), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
