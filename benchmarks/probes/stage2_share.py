"""How much of a fused sampling call the stage-2 reduction takes (torch.profiler, CUDA kernels).

The fused GEMM writes one packed candidate per (vocabulary tile, column); a second small
kernel (reduce_candidates.cu) reduces them to tokens. The CUTLASS issue asks to choose between
that kernel and a last-CTA reduction inside the GEMM launch by measurement: the second
kernel's own time bounds what the in-GEMM form could save.

Usage: python benchmarks/probes/stage2_share.py [--shapes 4096x151936,8192x128256] [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times_us(fn, calls: int = 20) -> dict[str, float]:
    """Mean device time per call of each CUDA kernel fn launches, by kernel name."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / calls
    return dict(totals)


def kernel_label(name: str) -> str:
    """A CUDA kernel's profiler name without namespaces, return type and arguments ("cutlass" for
    CUTLASS's GEMM); template arguments kept."""
    if "device_kernel" in name:
        return "cutlass"
    short = name.replace("(anonymous namespace)::", "").removeprefix("void ").replace("flashsampling::", "")
    return short.split("(")[0]


def kernel_times(call, calls: int) -> dict[str, float]:
    """:func:`kernel_times_us` with CUTLASS's GEMM as "cutlass" and other names shortened (the
    profile_* probes' tables)."""
    totals: dict[str, float] = defaultdict(float)
    for name, us in kernel_times_us(call, calls).items():
        totals[kernel_label(name).split("<")[0][-40:]] += us
    return dict(totals)


def captured_graph(call) -> torch.cuda.CUDAGraph:
    """call captured as a CUDA graph (after a warm-up outside the capture: allocations, cached
    workspaces), replayed three times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_timeline(call) -> str:
    """One CUDA-graph replay of call: its span (first kernel's start to last kernel's end), the
    sum of its kernels' device times, and each kernel (memsets and copies too) as
    name +gap/time µs, gap being the idle time since the previous one ended."""
    graph = captured_graph(call)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    if not events:
        return "no kernels traced"
    parts, previous_end, busy = [], None, 0.0
    for e in events:
        gap = 0.0 if previous_end is None else e.time_range.start - previous_end
        parts.append(f"{kernel_label(e.name)[:40]} +{gap:.1f}/{e.device_time:.1f}")
        previous_end = max(previous_end or e.time_range.end, e.time_range.end)
        busy += e.device_time
    span = events[-1].time_range.end - events[0].time_range.start
    return f"span {span:.1f} us, kernels {busy:.1f} us, {len(events)} launches: " + ", ".join(parts)


def main() -> None:
    import flashsampling_cuda  # (the helpers above need only torch)

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x151936,8192x128256")
    parser.add_argument("--batches", default="1,64,256")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| D | V | B | fused GEMM µs | stage 2 µs | other kernels µs | stage 2 share |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        dim, vocab = (int(x) for x in shape.split("x"))
        weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
            times = kernel_times_us(lambda: flashsampling_cuda.sample(hidden, weight, seed=1, offset=0))
            gemm = sum(t for name, t in times.items() if "device_kernel" in name)
            stage2 = sum(t for name, t in times.items() if "reduce_candidates" in name)
            other = max(0.0, sum(times.values()) - gemm - stage2)
            share = stage2 / (gemm + stage2 + other)
            print(f"| {dim} | {vocab} | {batch} | {gemm:.1f} | {stage2:.1f} | {other:.1f} | {share:.1%} |")
        del weight
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
