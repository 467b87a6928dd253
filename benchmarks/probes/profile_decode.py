"""Where the decode step's time goes: TPOT, top CUDA kernels and kernels per step.

Builds the model of bench_decode.py (random bf16 weights, nothing downloaded), decodes with
StaticCacheDecoder and the standard sampler (compiled lm_head -> softmax -> multinomial;
bench_decode.standard_head) exactly as bench_decode.py does (compiled body, one step captured
as a CUDA graph), for each --attn variant and batch size:

  grouped   the decode steps' grouped-query sdpa over the un-repeated static cache
            (StaticCacheDecoder(grouped_decode_attention=True), what bench_decode runs)
  repeat_kv transformers' masked sdpa path, which copies the whole cache to all query heads
            (repeat_kv) in every layer of every step (grouped_decode_attention=False)

and prints (a) TPOT (median of --reps generations, CUDA events, as bench_decode.py), (b) the
top CUDA kernels by total time over --steps replayed decode steps (torch.profiler; CUPTI
reports the kernels of graph replays; where it reports none, the same steps run without the
graph and are profiled instead, marked "eager steps"), (c) kernels per step, and last a
compact table: TPOT, kernels per step, GPU time per step by kernel kind, and the idle gap
(TPOT minus the summed kernel time: launch gaps between the step's small kernels).

Usage (GPU, ~2-3 min on an H200, mostly torch.compile of the body: 2 graphs per variant):
  python benchmarks/probes/profile_decode.py [--model qwen3-1.7b] [--batches 1,32] [--attn grouped,repeat_kv]
Smoke run (CPU: tiny model, eager body, CPU ops instead of CUDA kernels):
  python benchmarks/probes/profile_decode.py --tiny
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_*.py, report.py
from bench_decode import DTYPES, build_model, standard_head

KINDS = (  # kernel kind by name, first match wins
    ("attn", re.compile(r"fmha|attention|flash|cudnn|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitk|matmul|dot_kernel", re.I)),
    ("triton", re.compile(r"^triton", re.I)),
)

KIND_NAMES = [k for k, _ in KINDS] + ["other"]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def rewind(s, n: int) -> None:
    """Moves the session back n decode steps (private state of StaticCacheDecoder), so that n
    more replays write cache slots and token columns that exist; their tokens do not matter.
    Cache layers that keep their own write position (transformers' StaticLayer.cumulative_length
    where the cache is not given cache_position) move back with it, in place: a captured graph
    reads those very tensors."""
    for t in (s.kv_pos, s.pos, s.step, s.offset):
        t.sub_(n)
    for layer in getattr(s.cache, "layers", ()):
        position = getattr(layer, "cumulative_length", None)
        if isinstance(position, torch.Tensor):
            position.sub_(n)


def device_events(prof, on_gpu: bool):
    """(name, microseconds) of every CUDA kernel/memcpy/memset (GPU) or top-level-ish CPU op (CPU)."""
    if on_gpu:
        return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    return [(e.name, e.self_cpu_time_total) for e in prof.events()
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::")]


def profile_steps(dec, sampler, steps: int, on_gpu: bool):
    """Profiles `steps` decode steps of the session the last generate left: graph replays
    where the profiler sees their kernels, else the same steps without the graph."""
    s = dec._session
    modes = ("graph", "eager steps") if on_gpu and s.graph is not None else ("eager steps",)
    for mode in modes:
        rewind(s, steps)
        if on_gpu:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            for _ in range(steps):
                s.graph.replay() if mode == "graph" else dec._step(s, sampler)
            if on_gpu:
                torch.cuda.synchronize()
        events = device_events(prof, on_gpu)
        if len(events) >= 10 * steps or mode == modes[-1]:
            return mode, events
    raise AssertionError("unreachable")


def tpot_ms(dec, prompt, sampler, new_tokens: int, reps: int) -> float:
    def run():
        out = dec.generate_with_sampler(prompt, sampler=sampler, sampler_key="standard", max_new_tokens=new_tokens,
                                        return_timings=True)
        return out.decode_seconds / out.timed_steps * 1e3

    run()  # compiles the body (first time per shape) and captures the graph
    return statistics.median(run() for _ in range(reps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--attn", default="grouped,repeat_kv", help="comma list of grouped, repeat_kv")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="timed generations per configuration")
    parser.add_argument("--steps", type=int, default=10, help="profiled decode steps")
    parser.add_argument("--top", type=int, default=15, help="kernels listed per configuration")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--no-compile-body", action="store_true")
    parser.add_argument("--fuse-projections", action="store_true",
                        help="fuse each layer's q/k/v and gate/up projections (bench_decode.py's default)")
    parser.add_argument("--tiny", action="store_true", help="smoke run: --model tiny --batches 1,4 --prompt-len 16 "
                                                            "--new-tokens 16 --reps 1 --steps 3")
    args = parser.parse_args()
    if args.tiny:
        args.model, args.batches, args.prompt_len, args.new_tokens, args.reps, args.steps = "tiny", "1,4", 16, 16, 1, 3
    if args.new_tokens < 4 + args.steps:
        parser.error("--new-tokens must be >= --steps + 4")

    from flashsampling_cuda.integrations.transformers import StaticCacheDecoder

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    compile_body = on_gpu and not args.no_compile_body
    if on_gpu:  # CUPTI up before any graph is captured (it may miss the kernels of graphs captured before)
        with profile(activities=[ProfilerActivity.CUDA]):
            torch.zeros(1, device=device).add_(1)
        torch.cuda.synchronize()
    model = build_model(args.model, device, dtype)
    sampler = standard_head(model, 1.0, compile_head=on_gpu)
    print(f"[profile] {torch.cuda.get_device_name() if on_gpu else 'CPU'}, torch {torch.__version__}, {args.model} "
          f"{str(dtype).replace('torch.', '')}, prompt {args.prompt_len}, {args.new_tokens} new tokens, body "
          f"{'compiled' if compile_body else 'eager'}, CUDA graphs {'on' if on_gpu else 'off'}", flush=True)
    unit = "us/step"
    if args.fuse_projections:
        from flashsampling_cuda.integrations.transformers import fuse_projections

        print(f"[profile] fused projection groups: {fuse_projections(model)}", flush=True)
    rows = []
    for attn in args.attn.split(","):
        if attn not in ("grouped", "repeat_kv"):
            parser.error(f"--attn: unknown variant {attn!r}")
        for batch in (int(b) for b in args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompt = torch.randint(0, model.config.vocab_size, (batch, args.prompt_len), generator=gen).to(device)
            dec = StaticCacheDecoder(model, cuda_graph=on_gpu, compile_body=compile_body,
                                     grouped_decode_attention=attn == "grouped")
            tpot = tpot_ms(dec, prompt, sampler, args.new_tokens, args.reps)
            mode, events = profile_steps(dec, sampler, args.steps, on_gpu)
            per_name = defaultdict(lambda: [0, 0.0])
            for name, us in events:
                per_name[name][0] += 1
                per_name[name][1] += us
            per_kind = defaultdict(float)
            for name, (_, us) in per_name.items():
                per_kind[kind_of(name)] += us / args.steps
            total = sum(us for _, us in events) / args.steps
            row = dict(attn=attn, B=batch, tpot=tpot, mode=mode, kernels=len(events) / args.steps, total=total,
                       us=[per_kind.get(k, 0.0) for k in KIND_NAMES])
            rows.append(row)
            print(f"\n[profile] attn={attn} B={batch}: TPOT {tpot:.3f} ms; {args.steps} {mode} profiled: "
                  f"{row['kernels']:.0f} {'kernels' if on_gpu else 'aten ops'}/step, {total:.0f} {unit} in them")
            print(f"  {'calls/step':>10} {unit:>9} {'%':>5}  kernel")
            for name, (n, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1])[: args.top]:
                print(f"  {n / args.steps:10.1f} {us / args.steps:9.1f} {100 * us / max(total * args.steps, 1e-9):5.1f}"
                      f"  {name[:90]}")
            del dec
            if on_gpu:
                torch.cuda.empty_cache()

    print(f"\nSummary ({args.model}, standard sampler; {unit}: GPU time per decode step by kernel kind; "
          "gap = TPOT - summed kernel time)")
    print(f"| attn variant | B | TPOT ms | kernels/step | {' | '.join(KIND_NAMES)} | sum | gap | profiled |")
    print("|---" * (len(KIND_NAMES) + 7) + "|")
    for r in rows:
        kinds = " | ".join(f"{us:.0f}" for us in r["us"])
        print(f"| {r['attn']} | {r['B']} | {r['tpot']:.3f} | {r['kernels']:.0f} | {kinds} | {r['total']:.0f} | "
              f"{r['tpot'] * 1e3 - r['total']:.0f} | {r['mode']} |")


if __name__ == "__main__":
    main()
