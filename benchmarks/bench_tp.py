"""Tensor-parallel benchmark: the distributed fused sampler against all-gather-logits baselines.

For each tensor-parallel size TP (a process group of TP ranks, spawned by this script:
NCCL on TP GPUs, or gloo on the CPU) and batch B, every rank holds a vocabulary shard
``W_r [V / TP, D]`` of the LM head and the same ``hidden [B, D]``; the contenders:

  ours                  flashsampling_cuda.distributed.sample: the fused sampler on each
                        shard, one all-gather of a B-element summary per rank
  mm+AG+multinomial     hidden @ W_r.T on each shard -> all_gather logits -> fp32 softmax
                        -> torch.multinomial (eager)
  mm+AG+gumbel          ... -> all_gather logits -> fp32 Gumbel-argmax (eager)
  compiled multinomial  torch.compile(fullgraph) of the multinomial baseline, the
                        all-gather as a functional collective (in-graph)
  compiled gumbel       the same for the Gumbel-argmax baseline

With --forms, also the truncation forms of bench_truncation.py (each with its temperature and
[B] tensors where the form has them), on --regimes' logits (flashsampling_cuda/problems.py:
flat, or llm-like, the hidden states built from the whole LM head on every rank):

  ours                  flashsampling_cuda.distributed.sample with the form's truncation (the
                        survivors' search across ranks)
  ours whole rows       the same with vocab_size: the whole rows' logits on every rank (one
                        all-reduce), then the single-process logits sampler
  ours plain            the call without truncation (the plain sampling it is held to)
  mm+AG+FlashInfer      hidden @ W_r.T on each shard -> all_gather logits -> FlashInfer's
                        equivalent call (vLLM's pattern: gathered logits, then its sampler)

Time per call: CUDA events (GPU) or perf_counter (CPU) around `--iters` back-to-back
calls after a barrier, the maximum over ranks, the minimum over `--runs` runs (as the
paper's Table 6). TP=1 runs on one device without collectives. Writes
``tp_<device>_<date>.{json,md,png}`` (``tp_tiny_...`` with --tiny) under --out and
prints the table last. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set here for every rank).

Usage:
  python benchmarks/bench_tp.py                              # TP 1,2,4; D=8192, V=128256; B 16,64,256
  python benchmarks/bench_tp.py --world-sizes 1,2,4,8        # on an 8-GPU machine
  python benchmarks/bench_tp.py --tiny --out /tmp/tp         # CPU/gloo smoke test in seconds
  python benchmarks/bench_tp.py --world-sizes 1,2 --forms "plain,k20 [B],p0.9 [B]" --regimes flat,llm
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import flashsampling_cuda  # noqa: E402, F401  (registers the op)
from flashsampling_cuda import distributed as tp  # noqa: E402
from flashsampling_cuda.problems import REGIMES, hidden_states, lm_head_weight, row_statistics  # noqa: E402
from bench_truncation import FORMS, flashinfer_sampler, form_arguments  # noqa: E402
from report import pyplot_or_none, run_header, write_results, written_files  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CONTENDERS = ["ours", "mm+AG+multinomial", "mm+AG+gumbel", "compiled multinomial", "compiled gumbel"]
BASELINES = CONTENDERS[1:]
TRUNCATED_CONTENDERS = ["ours", "ours whole rows", "ours plain", "mm+AG+FlashInfer"]


# ---------------------------------------------------------------- contenders (per rank)


def _samplers_over(full_logits, inv_t):
    """The two all-gather baselines' sampling steps over a full-logits function
    (eager or functional collectives): softmax + multinomial, and Gumbel-argmax."""

    def multinomial(h, w):
        probs = torch.softmax(full_logits(h, w) * inv_t, dim=-1)
        return torch.multinomial(probs, 1)

    def gumbel(h, w):
        logits = full_logits(h, w)
        u = torch.rand_like(logits).clamp_(1e-20, 1.0)
        return torch.argmax(logits * inv_t - torch.log(-torch.log(u)), dim=-1, keepdim=True)

    return multinomial, gumbel


def _gather_logits(logits, world, group, shard_width, vocab):
    """[B, V] logits of every shard (eager all_gather into a fresh tensor)."""
    if world == 1:
        return logits
    out = logits.new_empty((world * logits.shape[0], shard_width))
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(out, logits.contiguous(), group=group)
    full = out.view(world, logits.shape[0], shard_width).permute(1, 0, 2).reshape(logits.shape[0], -1)
    return full[:, :vocab]


def _pad_to(logits, width):
    if logits.shape[1] == width:
        return logits
    return torch.nn.functional.pad(logits, (0, width - logits.shape[1]), value=-float("inf"))


def make_contenders(world, group, start, shard_width, vocab, temperature, compile_baselines):
    """{name: fn(hidden, shard) -> tokens [B, 1] (global ids)} for this rank."""
    inv_t = 1.0 / temperature
    calls = {"n": 0}

    def ours(h, w):
        calls["n"] += 1
        return tp.sample(h, w, vocab_start=start, group=group if world > 1 else None, temperature=temperature,
                         seed=1234, offset=calls["n"])

    def full_logits_eager(h, w):
        logits = _pad_to((h @ w.T).float(), shard_width)
        return _gather_logits(logits, world, group, shard_width, vocab)

    multinomial, gumbel = _samplers_over(full_logits_eager, inv_t)
    contenders = {"ours": ours, "mm+AG+multinomial": multinomial, "mm+AG+gumbel": gumbel}
    if compile_baselines:
        import torch.distributed._functional_collectives as fc

        def full_logits_functional(h, w):
            logits = _pad_to((h @ w.T).float(), shard_width)
            if world > 1:
                gathered = fc.all_gather_tensor(logits, gather_dim=0, group=group)  # [world * B, width]
                logits = gathered.view(world, h.shape[0], shard_width).permute(1, 0, 2).reshape(h.shape[0], -1)
            return logits[:, :vocab]

        c_multinomial, c_gumbel = _samplers_over(full_logits_functional, inv_t)
        contenders["compiled multinomial"] = torch.compile(c_multinomial, fullgraph=True, dynamic=False)
        contenders["compiled gumbel"] = torch.compile(c_gumbel, fullgraph=True, dynamic=False)
    return contenders


def make_truncated_contenders(world, group, start, shard_width, vocab, form, batch, device, fi):
    """{name: fn(hidden, shard) -> tokens} for one truncation form (FORMS[form]) on this rank."""
    temperature, spec = FORMS[form]
    kwargs = form_arguments(spec, batch, device=device)
    calls = {"n": 0}

    def sampled(h, w, **truncation):
        calls["n"] += 1
        return tp.sample(h, w, vocab_start=start, group=group if world > 1 else None, temperature=temperature,
                         seed=1234, offset=calls["n"], **truncation)

    contenders = {"ours": lambda h, w: sampled(h, w, **kwargs),
                  "ours whole rows": lambda h, w: sampled(h, w, vocab_size=vocab, **kwargs), "ours plain": sampled}
    sampler = flashinfer_sampler(fi, spec, batch, temperature, {}) if fi is not None else None
    if sampler is not None:
        contenders["mm+AG+FlashInfer"] = lambda h, w: sampler(
            _gather_logits(_pad_to((h @ w.T).float(), shard_width), world, group, shard_width, vocab))
    return contenders


def _flashinfer_or_none(device, rank):
    if device.type != "cuda":
        return None
    try:
        import flashinfer.sampling as fi
        return fi
    except Exception as exc:  # noqa: BLE001 - FlashInfer is optional
        if rank == 0:
            print(f"[bench_tp] FlashInfer not importable, no FlashInfer column: {exc}", file=sys.stderr)
        return None


# ---------------------------------------------------------------- timing


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphed(fn, args, device, warmup):
    """fn captured in a CUDA graph after `warmup` calls on a side stream (NCCL collectives
    are captured too; every rank captures the same calls): returns the replay."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream(device).wait_stream(stream)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return lambda *_: graph.replay()


def time_per_call_us(fn, args, device, world, group, runs, iters, warmup, graph=False):
    """min over runs of (max over ranks of the mean time of `iters` back-to-back calls);
    graph=True (CUDA only) times replays of fn captured in a CUDA graph: device time
    without the host's per-call Python work, as in a CUDA-graph decode step."""
    if graph and device.type == "cuda":
        fn = _graphed(fn, args, device, warmup)
    for _ in range(warmup):
        fn(*args)
    _sync(device)
    best = float("inf")
    for _ in range(runs):
        if world > 1:
            dist.barrier(group=group)
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(*args)
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(*args)
            us = (time.perf_counter() - t0) * 1e6 / iters
        t = torch.tensor([us], dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        best = min(best, float(t.item()))
    return best


# ---------------------------------------------------------------- one process group


def _worker(rank, world, cfg, store, out_path):
    use_cuda = cfg["backend"] == "nccl"
    if use_cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, cfg["cpu_threads"] // world))
    group = None
    if world > 1:
        dist.init_process_group(cfg["backend"], init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=dt.timedelta(seconds=600))
        group = dist.group.WORLD
    dtype = DTYPES[cfg["dtype"]]
    dim, vocab = cfg["dim"], cfg["vocab"]
    shards = tp.vocab_shards(vocab, world)
    start, size = shards[rank]
    shard_width = max(n for _, n in shards)
    # Every rank builds the whole LM head from one seed and keeps its shard: the llm regime's
    # hidden states are sums of the head's rows, the same on every rank.
    full_weight = lm_head_weight(vocab, dim, dtype=dtype, device=device)
    weight = full_weight[start:start + size].clone()
    truncated = [f for f in cfg["forms"] if f != "plain"]
    problems = {}  # (regime, B) -> (hidden, row statistics per temperature)
    for regime in cfg["regimes"] if truncated else ["flat"]:
        for batch in cfg["batches"]:
            hidden = hidden_states(full_weight, batch, regime, seed=batch)
            stats = {}
            if truncated and rank == 0:
                logits = (hidden @ full_weight.T).float()
                stats = {t: row_statistics(logits, t) for t in sorted({FORMS[f][0] for f in truncated})}
                del logits
            problems[regime, batch] = hidden, stats
    del full_weight
    rows = []
    fi = _flashinfer_or_none(device, rank) if truncated else None
    contenders = make_contenders(world, group, start, shard_width, vocab, cfg["temperature"], cfg["compile"]) \
        if "plain" in cfg["forms"] else {}

    def timed_row(row, contenders, hidden):
        for name, fn in contenders.items():
            try:
                row[name] = time_per_call_us(fn, (hidden, weight), device, world, group, cfg["runs"], cfg["iters"],
                                             cfg["warmup"], graph=cfg["timing"] == "graph")
            except Exception as exc:  # noqa: BLE001 - a failing contender is reported, not fatal
                row[name] = None
                row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                if rank == 0:
                    traceback.print_exc()
                if world > 1:
                    dist.barrier(group=group)  # every rank ran the same calls: realign
        if rank == 0:
            shown = ", ".join(f"{k} {v:.0f}" for k, v in row.items()
                              if k in CONTENDERS + TRUNCATED_CONTENDERS and v is not None)
            label = f" {row['regime']} {row['form']}" if "form" in row else ""
            print(f"[bench_tp] TP={world} B={row['B']}{label}: {shown} µs", flush=True)
        rows.append(row)

    for batch in cfg["batches"]:
        if contenders:
            timed_row({"TP": world, "B": batch}, contenders, problems["flat", batch][0])
        for regime in cfg["regimes"] if truncated else []:
            hidden, stats = problems[regime, batch]
            for form in truncated:
                temperature = FORMS[form][0]
                row = {"TP": world, "B": batch, "regime": regime, "form": form, "temperature": temperature,
                       **stats.get(temperature, {})}
                timed_row(row, make_truncated_contenders(world, group, start, shard_width, vocab, form, batch,
                                                         device, fi), hidden)
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    if world > 1:
        dist.barrier(group=group)
        dist.destroy_process_group()


def run_world(world, cfg):
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(world, cfg, os.path.join(tmp, "store"), out_path), nprocs=world, join=True)
        return json.loads(Path(out_path).read_text())


# ---------------------------------------------------------------- report


def plain_rows(results: dict) -> list[dict]:
    """The rows of the plain contenders (those without a truncation form)."""
    return [r for r in results["rows"] if "form" not in r]


def markdown_table(results: dict) -> str:
    tables = []
    if plain_rows(results):
        tables.append(plain_table(results))
    if len(plain_rows(results)) < len(results["rows"]):
        tables.append(truncated_table(results))
    return "\n".join(tables)


def best_ours(row: dict) -> float | None:
    """The faster of our two routes in a truncation row (the search, the whole rows), or None."""
    return min((row[n] for n in ("ours", "ours whole rows") if row.get(n)), default=None)


def truncated_table(results: dict) -> str:
    rows = [r for r in results["rows"] if "form" in r]
    lines = [f"\n**Truncation, D={results['D']}, V={results['V']}** ({results['dtype']}, {results['device']}, "
             f"{results['date']}, {results['backend']}), µs per call (min of {results['runs']} runs of "
             f"{results['iters']} calls, max over ranks"
             f"{', CUDA-graph replays' if results.get('timing') == 'graph' else ''}); entropy (nats) and "
             "top_p=0.9 survivors: median over the rows at the form's temperature\n"]
    head = ["B", "TP", "regime", "form", "entropy", "survivors", "ours", "ours whole rows", "ours plain",
            "mm+AG+FlashInfer", "best ours / plain", "FlashInfer / best ours"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in sorted(rows, key=lambda r: (r["regime"], r["B"], r["form"], r["TP"])):
        def cell(value, spec=".0f", suffix=""):
            return "—" if value is None else f"{value:{spec}}{suffix}"
        plain, fi, ours = r.get("ours plain"), r.get("mm+AG+FlashInfer"), best_ours(r)
        cells = [str(r["B"]), str(r["TP"]), r["regime"], r["form"], cell(r.get("entropy_median"), ".2f"),
                 cell(r.get("top_p_survivors_median")), cell(r.get("ours")), cell(r.get("ours whole rows")),
                 cell(plain), cell(fi),
                 cell(ours / plain if ours and plain else None, ".2f", "×"),
                 cell(fi / ours if ours and fi else None, ".2f", "×")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plain_table(results: dict) -> str:
    rows = plain_rows(results)
    names = [n for n in CONTENDERS if any(r.get(n) is not None for r in rows)]
    base = {r["B"]: r["ours"] for r in rows if r["TP"] == 1 and r.get("ours")}
    lines = [f"\n**D={results['D']}, V={results['V']}** ({results['dtype']}, {results['device']}, "
             f"{results['date']}, {results['backend']}), µs per call (min of {results['runs']} runs of "
             f"{results['iters']} calls, max over ranks"
             f"{', CUDA-graph replays' if results.get('timing') == 'graph' else ''})\n"]
    head = ["B", "TP"] + names + ["best baseline / ours", "ours: TP=1 / (TP · TP=k)"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in sorted(rows, key=lambda r: (r["B"], r["TP"])):
        cells = [str(r["B"]), str(r["TP"])]
        cells += [f"{r[n]:.0f}" if r.get(n) is not None else "—" for n in names]
        baselines = [r[n] for n in BASELINES if r.get(n) is not None]
        cells.append(f"{min(baselines) / r['ours']:.2f}×" if baselines and r.get("ours") else "—")
        cells.append(f"{base[r['B']] / (r['TP'] * r['ours']):.2f}" if r["B"] in base and r.get("ours") else "—")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nLast column: scaling efficiency of ours (1.00 = perfect; the issue's target at B=256, "
                 "TP=4 is ≥ 1/1.2 = 0.83).")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    """The plain contenders' times against TP, or where the run has no plain rows, the
    truncation forms' FlashInfer / ours ratios."""
    plt = pyplot_or_none("bench_tp")
    if plt is None:
        return
    batches = sorted({r["B"] for r in plain_rows(results)})
    if not batches:
        plot_truncation(plt, results, path)
        return
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = sorted((r for r in plain_rows(results) if r["B"] == batch), key=lambda r: r["TP"])
        tps = [r["TP"] for r in rows]
        for name in CONTENDERS:
            pts = [(r["TP"], r[name]) for r in rows if r.get(name) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=name, linewidth=2.5 if name == "ours" else 1.2)
        ours1 = next((r["ours"] for r in rows if r["TP"] == 1 and r.get("ours")), None)
        if ours1:
            ax.plot(tps, [ours1 / t for t in tps], linestyle="--", color="gray", label="ours TP=1 / TP")
        ax.set_yscale("log")
        ax.set_xticks(tps, [str(t) for t in tps])
        _label_axes(ax, "tensor-parallel size", "µs per call", f"B={batch}", legend_size=7)
    _save(fig, path, f"TP sampling, D={results['D']}, V={results['V']}, {results['dtype']} — {results['device']} — "
                     f"{results['date']}")


def _label_axes(ax, xlabel: str, ylabel: str, title: str, legend_size: int) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=legend_size)


def _save(fig, path: Path, title: str) -> None:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_truncation(plt, results: dict, path: Path) -> None:
    rows = [r for r in results["rows"] if best_ours(r) and r.get("mm+AG+FlashInfer")]
    regimes = sorted({r["regime"] for r in rows})
    if not regimes:
        return
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.5 * len(regimes), 4.5), squeeze=False)
    styles = {1: "-", 2: "--", 4: ":", 8: "-."}
    for ax, regime in zip(axes[0], regimes):
        for form in results.get("forms", {}):
            for world in sorted({r["TP"] for r in rows}):
                pts = sorted((r["B"], r["mm+AG+FlashInfer"] / best_ours(r)) for r in rows
                             if r["regime"] == regime and r["form"] == form and r["TP"] == world)
                if pts:
                    ax.plot(*zip(*pts), marker="o", linestyle=styles.get(world, "-"), label=f"{form}, TP={world}")
        ax.axhline(1.0, color="gray", linewidth=1)
        _label_axes(ax, "batch", "mm+AG+FlashInfer / best of ours (> 1: ours faster)", f"{regime} logits",
                    legend_size=6)
    _save(fig, path, f"TP truncation, D={results['D']}, V={results['V']} — {results['device']} — {results['date']}"
                     f"{' (CUDA-graph replays)' if results.get('timing') == 'graph' else ' (eager)'}")


def results_name(results: dict, tiny: bool) -> str:
    """tp[_tiny][_truncation][_eager]_<device>_<date>: a run with truncation forms and an eager one
    sit beside the CUDA-graph run of the plain contenders."""
    tag = "tp_tiny" if tiny else "tp"
    if any("form" in r for r in results["rows"]):
        tag += "_truncation"
    if results.get("timing") == "eager" and not tiny:
        tag += "_eager"
    return f"{tag}_{results['device'].split(' (')[0].replace(' ', '_')}_{results['date']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="1,2,4", help="comma list of TP sizes")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 (fp32 with --tiny)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=None, help="default 5 (3 with --tiny)")
    parser.add_argument("--iters", type=int, default=None, help="calls per run; default 20 (3 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="default 5 (1 with --tiny)")
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"],
                        help="auto: NCCL on GPUs when there are enough for the largest TP, else gloo on the CPU")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile baselines (auto: on for NCCL, off for gloo/CPU)")
    parser.add_argument("--timing", default="eager", choices=["eager", "graph"],
                        help="graph: time CUDA-graph replays of each contender (NCCL only; not yet run on GPUs)")
    parser.add_argument("--forms", default="plain",
                        help="comma list: plain (the plain contenders) and bench_truncation.py's forms: "
                             + ", ".join(FORMS))
    parser.add_argument("--regimes", default="flat", help=f"logits of the truncation forms: {', '.join(REGIMES)}")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: D=256, V=4099, B 4,16")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="rewrite the .md and .png of an earlier run's results (no GPU needed)")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        table = markdown_table(results)
        path = write_results(Path(args.from_json).parent, Path(args.from_json).stem, results, table, plot)
        print(f"[bench_tp] wrote {written_files(path)}")
        print(table)
        return

    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    forms = args.forms.split(",")
    unknown = [f for f in forms if f != "plain" and f not in FORMS]
    if unknown:
        sys.exit(f"--forms: unknown {unknown}; known: plain, {', '.join(FORMS)}")
    regimes = args.regimes.split(",")
    if any(r not in REGIMES for r in regimes):
        sys.exit(f"--regimes must be from {REGIMES}, got {args.regimes!r}")
    if args.tiny:
        args.dim, args.vocab, args.batches = 256, 4099, "4,16" if args.batches == "16,64,256" else args.batches
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= max(world_sizes) else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < max(world_sizes):
        sys.exit(f"--world-sizes {args.world_sizes} needs {max(world_sizes)} GPUs, have {torch.cuda.device_count()}")
    cfg = {
        "backend": backend,
        "dtype": args.dtype or ("fp32" if args.tiny or backend == "gloo" else "bf16"),
        "dim": args.dim,
        "vocab": args.vocab,
        "batches": [int(b) for b in args.batches.split(",")],
        "temperature": args.temperature,
        "runs": args.runs or (3 if args.tiny else 5),
        "iters": args.iters or (3 if args.tiny else 20),
        "warmup": args.warmup if args.warmup is not None else (1 if args.tiny else 5),
        "compile": args.compile == "on" or (args.compile == "auto" and backend == "nccl"),
        "cpu_threads": 1 if args.tiny else (os.cpu_count() or 1),
        "timing": args.timing,
        "forms": forms,
        "regimes": regimes,
    }
    device = torch.cuda.get_device_name(0) if backend == "nccl" else f"CPU ({platform.machine()}, gloo)"
    results = {
        **run_header(device),
        "backend": backend,
        "D": cfg["dim"],
        "V": cfg["vocab"],
        "dtype": cfg["dtype"],
        "temperature": cfg["temperature"],
        "runs": cfg["runs"],
        "iters": cfg["iters"],
        "compiled_baselines": cfg["compile"],
        "timing": cfg["timing"],
        "forms": {f: {"temperature": FORMS[f][0], "truncation": {k: list(v) if isinstance(v, tuple) else v
                                                                  for k, v in FORMS[f][1].items()}}
                  for f in forms if f != "plain"},
        "env": {k: os.environ[k] for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
        "rows": [],
    }
    for world in world_sizes:
        results["rows"] += run_world(world, cfg)
    table = markdown_table(results)
    path = write_results(args.out, results_name(results, args.tiny), results, table, plot)
    print(f"[bench_tp] wrote {written_files(path)}")
    print(table)


if __name__ == "__main__":
    main()
