"""Plain CUTLASS GEMMs of several tile / cluster shapes beside cuBLAS and our sampler.

At B = 128-256 our sampler with nothing in its epilogue (T = 0) is slower than cuBLAS's matmul
(docs/controls.md): the GPU runs at its power cap, so what is left is the mainloop's
energy per FLOP. Before a wider tile goes into the sampler, this measures what plain CUTLASS
GEMMs (same operands, bf16 out like torch.mm) of each shape take in the same process as mm:
if a 128 x 256 tile is no faster than a 128 x 128 one here, a sampler built on it will not be.

Builds gemm_probe_*.cu (torch-free, ctypes) with the extension's nvcc flags, checks each result
against mm, then times CUDA-graph replays, the configs interleaved over --rounds (medians).

Usage: python benchmarks/probes/gemm_probe/gemm_probe.py [--shapes 4096x151936] [--batches 128,256]
       [--rounds 3] [--rasters 0,2] [--configs a,b] [--out DIR]
       (--profile NAME --calls 4: only NAME's calls, untimed, for ncu; NAME as in the table)
Raster 0 is CUTLASS's heuristic, 1 along M, 2 along N (what the sampler asks for).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "tools"))
sys.path.insert(0, str(HERE.parents[1]))  # benchmarks/: bench_*.py, report.py

CONFIGS = sorted(p.stem.removeprefix("gemm_probe_") for p in HERE.glob("gemm_probe_*.cu"))


def build(build_dir: Path, configs: list[str]) -> Path:
    """Compiles each config in its own nvcc process and links them into one shared library."""
    import build_config as bc

    nvcc = bc.find_nvcc()
    arch = [bc.CUDA_ARCHS["90a"]]
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [HERE / f"gemm_probe_{config}.cu" for config in configs]
    objects = [build_dir / (s.stem + ".o") for s in sources]
    # (an object newer than its source and the headers is kept: a second run in one session links at once)
    headers = [HERE / "gemm_probe.cuh", bc.INCLUDE_DIR / "flashsampling" / "kernel" / "gemm_setup.hpp"]
    newest_input = max(h.stat().st_mtime for h in headers)
    commands = [bc.nvcc_command(nvcc, s, o, arch) for s, o in zip(sources, objects)
                if not o.exists() or o.stat().st_mtime < max(s.stat().st_mtime, newest_input)]
    jobs = int(os.environ.get("MAX_JOBS", os.cpu_count() or 2))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for proc in pool.map(lambda c: subprocess.run(c, capture_output=True, text=True), commands):
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-4000:])
    library = build_dir / "gemm_probe.so"
    subprocess.run([nvcc, "-shared", "-o", str(library), *map(str, objects), "-lcudart"], check=True)
    return library


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4096x151936")
    parser.add_argument("--batches", default="128,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--build-dir", default="/tmp/gemm_probe_build")
    parser.add_argument("--rasters", default="0")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profile", default=None)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    library = ctypes.CDLL(str(build(Path(args.build_dir), args.configs.split(","))))
    import torch

    from bench_sampler import median_us
    from report import run_header

    try:
        import flashsampling_cuda
    except ImportError:
        flashsampling_cuda = None
    header = run_header(torch.cuda.get_device_name(0))
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        dim, vocab = (int(x) for x in shape.lower().split("x"))
        weight = torch.randn(vocab, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
            reference = hidden @ weight.T
            calls = {"mm": lambda: hidden @ weight.T}
            for config in args.configs.split(","):
                for raster in (int(r) for r in args.rasters.split(",")):
                    name = config if args.rasters == "0" else f"{config}_r{raster}"
                    if args.profile not in (None, name):
                        continue
                    fn = getattr(library, f"gemm_probe_{config}")
                    out = torch.empty(batch, vocab, device="cuda", dtype=torch.bfloat16)
                    size = ctypes.c_size_t(0)
                    fn(None, None, None, vocab, batch, dim, raster, None, ctypes.byref(size))
                    workspace = torch.empty(max(size.value, 1), device="cuda", dtype=torch.uint8)

                    def call(fn=fn, out=out, workspace=workspace, size=size, raster=raster, name=name):
                        rc = fn(ctypes.c_void_p(weight.data_ptr()), ctypes.c_void_p(hidden.data_ptr()),
                                ctypes.c_void_p(out.data_ptr()), vocab, batch, dim, raster,
                                ctypes.c_void_p(workspace.data_ptr()), ctypes.byref(size),
                                ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
                        if rc != 0:
                            raise RuntimeError(f"{name}: status {rc}")

                    call()
                    error = (out.float() - reference.float()).abs().max().item()
                    if error > 0.05:
                        raise RuntimeError(f"{name}: max |out - mm| = {error}")
                    calls[name] = call
            if flashsampling_cuda is not None:
                calls["ours_greedy"] = lambda: flashsampling_cuda.sample(hidden, weight, temperature=0.0)
                calls["ours_plain"] = lambda: flashsampling_cuda.sample(hidden, weight, temperature=1.0)
                from bench_controls import variant_kwargs  # all3: per-row T + bitmask + logprobs (issue #4)

                all3 = variant_kwargs("all3", batch, vocab, hidden.device)
                calls["ours_all3"] = lambda: torch.ops.flashsampling.sample_with_scores(hidden, weight, **all3)
            if args.profile is not None:
                for _ in range(args.calls):
                    calls[args.profile]()
                torch.cuda.synchronize()
                print(f"profiled {args.profile} at B = {batch}: {args.calls} calls", flush=True)
                continue
            times: dict[str, list[float]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    times[name].append(median_us(call, graph=True))
            row = {"D": dim, "V": vocab, "B": batch, **{k: statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.profile is not None:
            return
        try:  # which kernel cuBLAS runs for the last batch
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                hidden @ weight.T
                torch.cuda.synchronize()
            print(f"cuBLAS at B = {batch}: {sorted({e.name for e in prof.events()})}", flush=True)
        except Exception as error:  # the profiler is a side show here
            print(f"profiler: {error}", flush=True)
        del weight
        torch.cuda.empty_cache()

    names = list(rows[0].keys())[3:]
    lines = [f"{header['device']}, {header['date']}: {header['command']} (µs, and / mm)", "", "| D | B | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in rows:
        lines.append(f"| {row['D']} | {row['B']} | " + " | ".join(
            f"{row[n]:.0f} ({row[n] / row['mm']:.2f})" for n in names) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "gemm_probe_" + torch.cuda.get_device_name(0).replace(" ", "_")
        (out / f"{stem}.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
        (out / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
