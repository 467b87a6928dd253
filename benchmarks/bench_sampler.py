"""Kernel benchmark: the fused sampler against cuBLAS-based baselines and the floor.

One run on one GPU, every contender side by side, for each (D, V) shape and batch:

  ours            flashsampling_cuda.sample (fused GEMM + Gumbel-argmax + reduction)
  mm              cuBLAS matmul alone, hidden @ W.T (bf16 logits)
  mm+multinomial  torch.compile(matmul -> fp32 softmax -> torch.multinomial)
  mm+gumbel       torch.compile(matmul -> fp32 logits / T + Gumbel -> argmax)
  mm+FI           cuBLAS matmul -> flashinfer.sampling.sampling_from_logits (if importable)
  mm+FI top-k/p   cuBLAS matmul -> flashinfer top_k_top_p_sampling_from_logits(50, 0.9)
With --topk (issue #5): ours with top_k=50, top_p=0.9 (the fused top-k pass; also on the
materialised path) and with top_k=1000 (the logits path), and the compiled torch equivalent (matmul -> fp32 / T -> top-k 50 -> softmax -> top-p 0.9 -> multinomial).

Floors (measured on the device in the same run): reading W once at the measured
device-to-device copy bandwidth (bytes read + written / time), and 2*B*V*D FLOPs at
the measured bf16 matmul rate (8192^3). Times are medians of CUDA-event timings of
warm calls; W (>= 1 GB) is far larger than L2, so every call streams it from HBM.
--timing graph (default) times replays of each contender captured in a CUDA graph
(device time, as in CUDA-graph decode loops); --timing eager times eager calls, host
overhead included. Column "ours eager" always shows our eager call time beside it.
Noise: ours and FlashInfer draw from explicit seed and offset device tensors, their graph-safe
form (noise_tensors); torch's contenders draw from torch's generator,
whose graph replays pay torch's RNG prologue (docs/benchmarking.md), which is what they cost.

Usage:
  python benchmarks/bench_sampler.py [--shapes 4096x151936,8192x128256]
      [--batches 1,2,4,8,16,32,64,128,256] [--dtype bf16] [--timing graph|eager]
      [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import flashsampling_cuda
from report import pyplot_or_none, run_header, write_results

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def noise_tensors() -> tuple[dict, dict]:
    """Explicit seed and offset device tensors for a benchmark's calls, ours (0-d) and
    FlashInfer's (1-element int64): the graph-safe form of both, so that no replay pays torch's
    RNG prologue for them (docs/benchmarking.md)."""
    ours = {"seed": torch.tensor(7, device="cuda"), "offset": torch.tensor(0, device="cuda")}
    return ours, {name: value.reshape(1) for name, value in ours.items()}


def replay_times_us(fn, warmup: int = 5, reps: int = 30, graph: bool = False,
                    draws: torch.Tensor | None = None) -> list[float]:
    """Times of reps calls of fn() in microseconds, each timed with its own CUDA events on an
    idle GPU. graph=False times eager calls, so the host's work before the first kernel launch
    counts too; graph=True captures fn once in a CUDA graph and times its replays: device time
    alone, as in a CUDA-graph decode loop. draws: a 0-d integer device tensor fn's calls read
    their noise offset from; it is set to the call's number before each call (outside the timed
    events), so that each call draws other noise, as a decode loop's steps do. A path whose work
    depends on the draw (the top_p rounds, FlashInfer's rejection loops) is then timed over reps
    draws instead of one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    call = fn
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        call = cuda_graph.replay
        call()
    times = []
    for rep in range(reps):
        if draws is not None:
            draws.fill_(rep + 1)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    if draws is not None:
        draws.fill_(0)
    return times


def median_us(fn, warmup: int = 5, reps: int = 30, graph: bool = False) -> float:
    """Median of replay_times_us(...): the time of a typical call."""
    return statistics.median(replay_times_us(fn, warmup, reps, graph))


def measure_copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), warmup=3, reps=10)
    del src, dst
    return 2 * 2 * 1024**3 / (us * 1e-6)


def measure_matmul_rate(dtype: torch.dtype) -> float:
    """Dense matmul rate in FLOP/s on random data (8192^3)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    us = median_us(lambda: a @ b, warmup=3, reps=10)
    return 2 * n**3 / (us * 1e-6)


def make_baselines(temperature: float, fi_topk: bool, topk: bool = False, noise: dict | None = None,
                   fi_noise: dict | None = None):
    noise, fi_noise = noise or {}, fi_noise or {}

    def mm_only(h, w):
        return h @ w.T

    def mm_multinomial(h, w):
        logits = (h @ w.T).float()
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1)

    def mm_gumbel(h, w):
        logits = (h @ w.T).float()
        u = torch.rand_like(logits).clamp_(1e-20, 1.0)
        return torch.argmax(logits / temperature - torch.log(-torch.log(u)), dim=-1)

    def mm_topk_topp(h, w, k: int = 50, p: float = 0.9):
        values, ids = torch.topk((h @ w.T).float() / temperature, k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        ahead = torch.cumsum(probs, dim=-1) - probs  # mass before each survivor
        probs = torch.where(ahead < p, probs, 0.0)  # the top token always stays (ahead = 0)
        return ids.gather(-1, torch.multinomial(probs, 1))

    baselines = {
        "mm": mm_only,
        "mm+multinomial": torch.compile(mm_multinomial, dynamic=False),
        "mm+gumbel": torch.compile(mm_gumbel, dynamic=False),
    }
    if topk:
        baselines["ours top-k/p"] = lambda h, w: flashsampling_cuda.sample(
            h, w, temperature=temperature, top_k=50, top_p=0.9, **noise)
        baselines["ours top-k/p materialised"] = lambda h, w: flashsampling_cuda.sample(
            h, w, temperature=temperature, top_k=50, top_p=0.9, truncation_path="materialized", **noise)
        baselines["ours top-k 1000"] = lambda h, w: flashsampling_cuda.sample(
            h, w, temperature=temperature, top_k=1000, **noise)
        baselines["mm+torch top-k/p"] = torch.compile(mm_topk_topp, dynamic=False)
    try:
        import flashinfer.sampling as fi

        baselines["mm+FI"] = lambda h, w: fi.sampling_from_logits(h @ w.T, deterministic=True, **fi_noise)
        if fi_topk:  # needs FlashInfer's topk module (JIT-compiles for minutes if not prebuilt)
            baselines["mm+FI top-k/p"] = lambda h, w: fi.top_k_top_p_sampling_from_logits(
                h @ w.T, top_k=50, top_p=0.9, deterministic=True, **fi_noise
            )
    except Exception as exc:  # noqa: BLE001 - FlashInfer is optional
        print(f"[bench] FlashInfer not importable, skipping its baselines: {exc}", file=sys.stderr)
    return baselines


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = measure_copy_bandwidth()
    mm_rate = measure_matmul_rate(dtype)
    print(f"[bench] {props.name}: copy {copy_bw / 1e12:.2f} TB/s, {args.dtype} matmul {mm_rate / 1e12:.0f} TFLOP/s")
    noise, fi_noise = noise_tensors()
    baselines = make_baselines(args.temperature, args.fi_topk, args.topk, noise, fi_noise)
    results = {
        **run_header(props.name),
        "dtype": args.dtype,
        "temperature": args.temperature,
        "noise": "ours and FlashInfer: seed and offset device tensors; torch's contenders: its generator",
        "copy_bandwidth_Bps": copy_bw,
        "matmul_flops": mm_rate,
        "timing": args.timing,
        "rows": [],
    }
    for shape in args.shapes.split(","):
        dim, vocab = (int(x) for x in shape.lower().split("x"))
        weight = torch.randn(vocab, dim, device="cuda", dtype=dtype) * dim**-0.5
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = torch.randn(batch, dim, device="cuda", dtype=dtype)
            w_bytes = weight.numel() * weight.element_size()
            floor_mem = w_bytes / copy_bw * 1e6  # W read once at the measured copy bandwidth
            floor_flops = 2 * batch * vocab * dim / mm_rate * 1e6
            row = {
                "D": dim,
                "V": vocab,
                "B": batch,
                "floor_us": max(floor_mem, floor_flops),
                "floor_mem_us": floor_mem,
                "floor_flops_us": floor_flops,
            }
            graph = args.timing == "graph"

            def ours():
                return flashsampling_cuda.sample(hidden, weight, temperature=args.temperature, **noise)

            row["ours"] = median_us(ours, graph=graph)
            row["ours eager"] = median_us(ours)
            for name, fn in baselines.items():
                try:
                    row[name] = median_us(lambda fn=fn: fn(hidden, weight), graph=graph)
                except Exception as exc:  # noqa: BLE001 - report and keep going
                    print(f"[bench] {name} failed at D={dim} V={vocab} B={batch}: {exc}", file=sys.stderr)
            results["rows"].append(row)
            print("[bench] " + json.dumps(row), flush=True)
        del weight
        torch.cuda.empty_cache()
    return results


def markdown_table(results: dict) -> str:
    names = [k for k in ("mm", "mm+multinomial", "mm+gumbel", "mm+FI", "mm+FI top-k/p", "ours top-k/p",
                         "ours top-k/p materialised", "ours top-k 1000", "mm+torch top-k/p")
             if any(k in r for r in results["rows"])]
    topk = "ours top-k/p" in names
    lines = []
    for (dim, vocab) in dict.fromkeys((r["D"], r["V"]) for r in results["rows"]):
        timing = results.get("timing", "eager")
        noise = results.get("noise", "torch's default generator")
        lines.append(f"\n**D={dim}, V={vocab}** ({results['dtype']}, {results['device']}, {results['date']}), µs "
                     f"(median, {'CUDA-graph replays' if timing == 'graph' else 'eager calls'}; noise: {noise})\n")
        eager_col = timing == "graph" and any("ours eager" in r for r in results["rows"])
        head = ["B", "floor", "ours"] + (["ours eager"] if eager_col else []) + names
        head += ["ours/floor", "ours/mm", "multinomial/ours"] + (["top-k/p / ours", "FI top-k/p / top-k/p"] if topk else [])
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in results["rows"]:
            if (r["D"], r["V"]) != (dim, vocab):
                continue
            cells = [str(r["B"]), f"{r['floor_us']:.0f}", f"{r['ours']:.0f}"]
            cells += [f"{r['ours eager']:.0f}"] if eager_col else []
            cells += [f"{r[n]:.0f}" if n in r else "—" for n in names]
            cells.append(f"{r['ours'] / r['floor_us']:.3f}")
            cells.append(f"{r['ours'] / r['mm']:.3f}" if "mm" in r else "—")
            cells.append(f"{r['mm+multinomial'] / r['ours']:.2f}×" if "mm+multinomial" in r else "—")
            if topk:
                cells.append(f"{r['ours top-k/p'] / r['ours']:.3f}" if "ours top-k/p" in r else "—")
                cells.append(f"{r['mm+FI top-k/p'] / r['ours top-k/p']:.2f}×"
                             if "mm+FI top-k/p" in r and "ours top-k/p" in r else "—")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot_or_none("bench")
    if plt is None:
        return
    shapes = list(dict.fromkeys((r["D"], r["V"]) for r in results["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (dim, vocab) in zip(axes[0], shapes):
        rows = [r for r in results["rows"] if (r["D"], r["V"]) == (dim, vocab)]
        batches = [r["B"] for r in rows]
        for name in ["floor_us", "ours", "mm", "mm+multinomial", "mm+gumbel", "mm+FI", "mm+FI top-k/p", "ours top-k/p",
                     "mm+torch top-k/p"]:
            if all(name in r for r in rows):
                ax.plot(batches, [r[name] for r in rows], marker="o", label=name.replace("_us", ""),
                        linestyle="--" if name == "floor_us" else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("µs (median)")
        ax.set_title(f"D={dim}, V={vocab}, {results['dtype']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{results['device']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x151936,8192x128256", help="comma list of DxV")
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--timing", choices=["graph", "eager"], default="graph",
                        help="time CUDA-graph replays (device time) or eager calls (host overhead included)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--topk", action="store_true",
                        help="also time ours with top_k=50, top_p=0.9 (and top_k=1000) and the compiled torch equivalent")
    parser.add_argument("--fi-topk", action="store_true", help="also time FlashInfer top-k/top-p sampling")
    args = parser.parse_args()
    # One compiled graph per (shape, batch): 18 of them by default, over dynamo's default limit
    # of 8 recompiles per function, past which the baselines would silently run eager.
    torch._dynamo.config.recompile_limit = 64
    if not torch.cuda.is_available():
        sys.exit("bench_sampler.py needs a CUDA GPU")
    results = run(args)
    table = markdown_table(results)
    write_results(args.out, f"kernel_{results['device'].replace(' ', '_')}_{results['date']}", results, table, plot)
    print(table)


if __name__ == "__main__":
    main()
