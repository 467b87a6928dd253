"""Per-kernel device times of the truncation forms of bench_truncation.py (torch.profiler):
the logits GEMM, the selection kernel and anything else each form launches.

  python3 benchmarks/probes/profile_truncation.py --batches 1,16,64,256 --regimes flat,llm
  (--launches: also each launch of a call in order, the mean of --calls calls and where one took
   longer the largest, e.g. the top_p rounds apart;
   --timeline: one CUDA-graph replay of the call, each kernel with the idle time before it, and
   the replay's span against the sum of its kernels' times: what the launches between kernels cost;
   --dispatch noise_skip=0,...: DispatchOptions for an A/B in one process, e.g. the exact skip off)
"""

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states, lm_head_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_truncation import FORMS, form_arguments
from stage2_share import graph_timeline, kernel_label, kernel_times  # benchmarks/probes/, this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--regimes", default="flat,llm")
    parser.add_argument("--forms", default=None)
    parser.add_argument("--path", default="auto")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--launches", action="store_true",
                        help="also each kernel launch of a call, in order (mean of --calls calls)")
    parser.add_argument("--timeline", action="store_true",
                        help="also one CUDA-graph replay: each kernel with the idle gap before it")
    parser.add_argument("--dispatch", default="", help="DispatchOptions to set, e.g. noise_skip=0,top_p_tile_winners=0")
    args = parser.parse_args()
    options = {name: bool(int(value)) for name, value in (item.split("=") for item in args.dispatch.split(",") if item)}
    torch.ops.flashsampling._set_dispatch_options(**options)
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = lm_head_weight(vocab, dim)
    for regime in args.regimes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = hidden_states(weight, batch, regime, seed=batch)
            if args.timeline:
                print(f"[{regime} B={batch} plain] graph replay: " + graph_timeline(
                    lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.8)), flush=True)  # noqa: B023
            for form, (temperature, spec) in FORMS.items():
                if args.forms and form not in args.forms.split(","):
                    continue
                # Each form's calls draw their seeds from a generator of their own, so that two builds
                # (ab_builds.sh) sample the same rows with the same noise and take the same routes.
                kwargs = form_arguments(spec, batch) | {"generator": torch.Generator(device="cuda").manual_seed(batch)}
                path = args.path
                if path == "fused_top_k" and not (isinstance(spec.get("top_k"), int) and spec["top_k"] <= 64):
                    path = "auto"
                totals = kernel_times(lambda: flashsampling_cuda.sample(  # noqa: B023
                    hidden, weight, temperature=temperature, truncation_path=path, **kwargs), args.calls)
                parts = ", ".join(f"{n} {us:.1f}" for n, us in sorted(totals.items(), key=lambda kv: -kv[1]))
                print(f"[{regime} B={batch} {form}{' ' + args.dispatch if args.dispatch else ''}] total {sum(totals.values()):.1f} us: {parts}", flush=True)
                if args.timeline:
                    print("    graph replay: " + graph_timeline(lambda: flashsampling_cuda.sample(  # noqa: B023
                        hidden, weight, temperature=temperature, truncation_path=path, **kwargs)), flush=True)
                if args.launches:
                    times = launch_times(lambda: flashsampling_cuda.sample(  # noqa: B023
                        hidden, weight, temperature=temperature, truncation_path=path, **kwargs), args.calls)
                    print(f"    launches (mean of {args.calls} calls): {times}", flush=True)


def launch_times(call, calls: int = 1) -> str:
    """Each CUDA kernel of a call, in launch order, with its device time (µs): the mean over
    `calls` calls and, where one took more than 1 µs longer, the largest (a round's rows, and so
    its time, vary from call to call). One call's times where the calls' launches differ."""
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    names = [kernel_label(e.name)[:48] for e in events]
    per_call = len(events) // calls
    if per_call * calls != len(events) or any(names[i] != names[i % per_call] for i in range(len(names))):
        return launch_times(call) + " (one call: the calls' launches differ)"  # one call always matches itself
    parts = []
    for i in range(per_call):
        times = [events[c * per_call + i].device_time for c in range(calls)]
        mean, most = sum(times) / calls, max(times)
        parts.append(f"{names[i]} {mean:.1f}" + (f" (max {most:.1f})" if most - mean > 1.0 else ""))
    return ", ".join(parts)


if __name__ == "__main__":
    main()
