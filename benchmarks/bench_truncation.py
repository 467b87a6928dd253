"""Truncated sampling as serving engines call it: ours against cuBLAS + FlashInfer, one run.

For each shape (D x V), logit regime (flat / llm, flashsampling_cuda/problems.py) and batch,
every contender side by side (CUDA-graph replays, median µs):

  mm        cuBLAS hidden @ W.T alone (bf16 logits)
  plain     ours, plain sampling at the form's temperature (no truncation)
  ours      ours with the form's truncation (truncation_path="auto")
  ours <p>  ours on the other of the fused top-k pass and the logits path (to set "auto"'s rule)
  FI        cuBLAS logits, then FlashInfer's equivalent call ([B] tensors where the form has them):
            top_k_top_p_sampling_from_logits, or top_k / top_p / min_p_sampling_from_probs on
            the softmax of logits / T

Noise: every call draws from explicit seed and offset device tensors (ours 0-d, FlashInfer's
1-element int64, its graph-safe form), not from torch's generator. The offset is set anew before
each timed replay (outside its events), so each of the 30 replays draws other noise, as a decode
loop's steps do: the work of some paths depends on the draw (ours' top_p rounds verify the
plain-sampling winner and draw another where it fails; FlashInfer's samplers loop until a draw is
accepted), and one fixed draw would time one sample of it. The table gives the medians, the JSON
also the means (`*_mean_us`), which count the rare costly draws. A graph whose calls draw
from the generator has torch fill the generator's seed and offset before each replay (two
kernels launched from the host, ~10-25 µs of a replay on an H200), while FlashInfer reads the
generator's state on the host when its call is captured (its replays then draw the same noise
and pay nothing): with the generator the replays would charge that prologue to ours alone.

Forms: host int k=50, p=0.9; [B] k=50, p=0.9; [B] k=20; [B] p=0.9; [B] min_p=0.05; host int
k=1000; Qwen3's defaults (T=0.6, [B] k=20, p=0.95). Each row records its regime's entropy and
top_p=0.9 survivors (median and 90th percentile over the rows).

Writes benchmarks/results/truncation_<gpu>_<date>.{json,md,png}: "records" is a list with the
fields D, V, B, regime, form, ours_us, plain_us, flashinfer_us, mm_us (and ratios).

Usage:
  python benchmarks/bench_truncation.py [--shapes 4096x151936,8192x128256]
      [--batches 1,16,64,128,256] [--regimes flat,llm] [--out benchmarks/results]
  python benchmarks/bench_truncation.py --from-json RESULTS.json   # rewrite its .md / .png
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

import flashsampling_cuda
from flashsampling_cuda import truncation
from bench_sampler import median_us, noise_tensors, replay_times_us
from flashsampling_cuda.problems import REGIMES, hidden_states, lm_head_weight, row_statistics
from report import pyplot_or_none, run_header, write_results

DEFAULT_SHAPES = "4096x151936,8192x128256"  # --shapes (D x V): issue #33's two LM heads

# name -> (temperature, truncation; "rows" marks a [B] tensor of the value)
FORMS = {
    "k50 p0.9 (int)": (0.8, {"top_k": 50, "top_p": 0.9}),
    "k50 p0.9 [B]": (0.8, {"top_k": ("rows", 50), "top_p": ("rows", 0.9)}),
    "k20 [B]": (0.8, {"top_k": ("rows", 20)}),
    "p0.9 [B]": (0.8, {"top_p": ("rows", 0.9)}),
    "min_p0.05 [B]": (0.8, {"min_p": ("rows", 0.05)}),
    "k1000 (int)": (0.8, {"top_k": 1000}),
    "qwen3 T0.6 k20 p0.95 [B]": (0.6, {"top_k": ("rows", 20), "top_p": ("rows", 0.95)}),
}


def form_arguments(spec: dict, batch: int, *, int_dtype=torch.int64, float_dtype=torch.float32,
                   device="cuda") -> dict:
    args = {}
    for name, value in spec.items():
        if isinstance(value, tuple):
            dtype = int_dtype if name == "top_k" else float_dtype
            args[name] = torch.full((batch,), value[1], dtype=dtype, device=device)
        else:
            args[name] = value
    return args


def flashinfer_sampler(fi, spec: dict, batch: int, temperature: float, noise: dict):
    """FlashInfer's equivalent of a form as a function of the [B, V] logits (drawing from
    `noise`, its seed and offset tensors, or from torch's generator where `noise` is empty), or
    None."""
    args = form_arguments(spec, batch, int_dtype=torch.int32)

    def probs(logits):
        return torch.softmax(logits.float() / temperature, dim=-1)

    if "top_k" in args and "top_p" in args:
        return lambda logits: fi.top_k_top_p_sampling_from_logits(
            logits.float() / temperature, args["top_k"], args["top_p"], deterministic=True, **noise)
    if "top_k" in args:
        return lambda logits: fi.top_k_sampling_from_probs(probs(logits), args["top_k"], deterministic=True, **noise)
    if "top_p" in args:
        return lambda logits: fi.top_p_sampling_from_probs(probs(logits), args["top_p"], deterministic=True, **noise)
    if "min_p" in args:
        return lambda logits: fi.min_p_sampling_from_probs(probs(logits), args["min_p"], deterministic=True, **noise)
    return None


def flashinfer_call(fi, spec: dict, batch: int, temperature: float, noise: dict):
    """flashinfer_sampler on cuBLAS logits: a function of (hidden, weight), or None."""
    sampler = flashinfer_sampler(fi, spec, batch, temperature, noise)
    return None if sampler is None else (lambda h, w: sampler(h @ w.T))


# The op's arguments of these calls that "auto"'s rule reads besides the truncation (the
# benchmark's calls: a batch-wide seed and offset, one sample).
AUTO_RULE_KWARGS = {"sparse_bias_ids": None, "seed": torch.zeros((), dtype=torch.int64),
                    "offset": torch.zeros((), dtype=torch.int64), "num_samples": 1}


def auto_path(hidden, weight, kwargs: dict) -> str:
    """The path truncation_path="auto" takes for this call."""
    trunc = truncation.parse_truncation(kwargs.get("top_k"), kwargs.get("top_p"), kwargs.get("min_p"), hidden)
    return truncation.choose_truncation_path("auto", trunc, hidden, weight, AUTO_RULE_KWARGS)


def alternative_paths(hidden, weight, kwargs: dict, chosen: str) -> list[str]:
    """The other of the fused top-k pass and the logits path than ``chosen`` ("auto"'s), where it
    can take this call too (to set the rule between them)."""
    trunc = truncation.parse_truncation(kwargs.get("top_k"), kwargs.get("top_p"), kwargs.get("min_p"), hidden)
    fused_ok = truncation.fused_top_k_takes(trunc, hidden, weight, AUTO_RULE_KWARGS)
    return [p for p in ("fused_top_k", "logits") if p != chosen and (p == "logits" or fused_ok)]


def run(args) -> dict:
    try:
        import flashinfer.sampling as fi
    except Exception as exc:  # noqa: BLE001 - FlashInfer is optional
        print(f"[bench] FlashInfer not importable, no FlashInfer column: {exc}", file=sys.stderr)
        fi = None
    props = torch.cuda.get_device_properties(0)
    results = {**run_header(props.name), "dtype": "bf16", "timing": "graph",
               "noise": "seed and offset device tensors, the offset set anew before each replay",
               "records": []}
    noise, fi_noise = noise_tensors()

    def timed(fn) -> tuple[float, float]:
        """(median, mean) µs of graph replays of fn, each replay drawing at its own offset."""
        times = replay_times_us(fn, graph=True, draws=noise["offset"])
        return statistics.median(times), statistics.fmean(times)

    for shape in args.shapes.split(","):
        dim, vocab = (int(x) for x in shape.lower().split("x"))
        weight = lm_head_weight(vocab, dim)
        for regime in args.regimes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                hidden = hidden_states(weight, batch, regime, seed=batch)
                logits = hidden.float() @ weight.float().T
                stats = {t: row_statistics(logits, t) for t in sorted({t for t, _ in FORMS.values()})}
                del logits
                mm_us = median_us(lambda: hidden @ weight.T, graph=True)
                plain = {t: timed(lambda t=t: flashsampling_cuda.sample(hidden, weight, temperature=t, **noise))
                         for t in stats}
                for form, (temperature, spec) in FORMS.items():
                    if args.forms and form not in args.forms.split(","):
                        continue
                    kwargs = form_arguments(spec, batch)
                    record = {"D": dim, "V": vocab, "B": batch, "regime": regime, "form": form,
                              "temperature": temperature, "mm_us": mm_us, "plain_us": plain[temperature][0],
                              "plain_mean_us": plain[temperature][1], **stats[temperature]}
                    record["ours_us"], record["ours_mean_us"] = timed(lambda: flashsampling_cuda.sample(
                        hidden, weight, temperature=temperature, **kwargs, **noise))
                    record["path"] = auto_path(hidden, weight, kwargs)
                    for path in alternative_paths(hidden, weight, kwargs, record["path"]):
                        record[f"ours_{path}_us"] = timed(lambda path=path: flashsampling_cuda.sample(
                            hidden, weight, temperature=temperature, truncation_path=path, **kwargs, **noise))[0]
                    call = flashinfer_call(fi, spec, batch, temperature, fi_noise) if fi is not None else None
                    if call is not None:
                        try:
                            record["flashinfer_us"], record["flashinfer_mean_us"] = timed(
                                lambda: call(hidden, weight))
                        except Exception as exc:  # noqa: BLE001 - report and keep going
                            print(f"[bench] FlashInfer failed for {form} B={batch}: {exc}", file=sys.stderr)
                    record["ours_over_plain"] = record["ours_us"] / record["plain_us"]
                    if "flashinfer_us" in record:
                        record["flashinfer_over_ours"] = record["flashinfer_us"] / record["ours_us"]
                    results["records"].append(record)
                    print("[bench] " + json.dumps(record), flush=True)
        del weight
        torch.cuda.empty_cache()
    return results


def markdown_table(results: dict) -> str:
    lines = []
    records = results["records"]
    for key in dict.fromkeys((r["D"], r["V"], r["regime"]) for r in records):
        dim, vocab, regime = key
        rows = [r for r in records if (r["D"], r["V"], r["regime"]) == key]
        noise = results.get("noise", "torch's default generator")
        lines.append(f"\n**D={dim}, V={vocab}, {regime} logits** ({results['device']}, {results['date']}, "
                     f"CUDA-graph replays, median µs; noise: {noise}; ratios from the same run)\n")
        means = all("ours_mean_us" in r for r in rows)  # files before the per-replay offsets have none
        lines.append("| B | entropy (form's T) | top-p 0.9 survivors (median / p90) | form | mm | plain | ours | "
                     "ours / plain | " + ("ours / plain, means | " if means else "") +
                     "FlashInfer | FlashInfer / ours | ours' path | other path |")
        lines.append("|---" * (13 if means else 12) + "|")
        for r in rows:
            other = "; ".join(f"{k[5:-3]} {v:.0f}" for k, v in r.items()
                              if k.startswith("ours_") and k.endswith("_us") and k not in ("ours_us", "ours_mean_us"))
            fi_us = r.get("flashinfer_us")
            fi_cells = (f"{fi_us:.0f} | {fi_us / r['ours_us']:.2f}" if fi_us else "— | —")
            lines.append(
                f"| {r['B']} | {r['entropy_median']:.2f} | {r['top_p_survivors_median']:.0f} / "
                f"{r['top_p_survivors_p90']:.0f} | {r['form']} | {r['mm_us']:.0f} | {r['plain_us']:.0f} | "
                f"{r['ours_us']:.0f} | {r['ours_over_plain']:.3f} | "
                + (f"{r['ours_mean_us'] / r['plain_mean_us']:.3f} | " if means else "")
                + f"{fi_cells} | {r.get('path', '—')} | {other or '—'} |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot_or_none("bench")
    if plt is None:
        return
    records = results["records"]
    panels = list(dict.fromkeys((r["D"], r["V"], r["regime"]) for r in records))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = [r for r in records if (r["D"], r["V"], r["regime"]) == key]
        for form in FORMS:
            pts = [(r["B"], r["ours_over_plain"]) for r in rows if r["form"] == form]
            ax.plot(*zip(*pts), marker="o", label=f"ours {form}")
            fi_pts = [(r["B"], r["flashinfer_us"] / r["plain_us"]) for r in rows if r["form"] == form and
                      "flashinfer_us" in r]
            if fi_pts:
                ax.plot(*zip(*fi_pts), marker="x", linestyle=":", color=ax.lines[-1].get_color())
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("time / our plain sampling (dotted: FlashInfer)")
        ax.set_title(f"D={key[0]}, V={key[1]}, {key[2]}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(f"{results['device']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of DxV")
    parser.add_argument("--batches", default="1,16,64,128,256")
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--forms", default=None, help="comma list of FORMS names (default: all)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="rewrite the .md and .png of an earlier run's records (no GPU needed)")
    args = parser.parse_args()
    if args.from_json:
        results = json.loads(Path(args.from_json).read_text())
        args.out = str(Path(args.from_json).parent)
    elif not torch.cuda.is_available():
        sys.exit("bench_truncation.py needs a CUDA GPU")
    else:
        results = run(args)
    table = markdown_table(results)
    write_results(args.out, results_name(results), results, table, plot)
    print(table)


def results_name(results: dict) -> str:
    """truncation_<gpu>_<date>, with the hidden sizes (d2048) after "truncation" where a run
    measured other hidden sizes than the default's, and the forms' names where it measured only some of
    FORMS (--forms): a run of every form and a later one of a changed form or of a smaller model's
    shape sit side by side."""
    records = results["records"]
    hidden_sizes = sorted({record["D"] for record in records})
    default_sizes = sorted({int(shape.split("x")[0]) for shape in DEFAULT_SHAPES.split(",")})
    tag = "" if hidden_sizes == default_sizes else "_" + "_".join(f"d{d}" for d in hidden_sizes)
    forms = sorted({record["form"] for record in records}, key=list(FORMS).index)
    if len(forms) != len(FORMS):
        tag += "_" + "_".join(re.sub(r"[^0-9A-Za-z.]+", "_", f).strip("_") for f in forms)
    return f"truncation{tag}_{results['device'].replace(' ', '_')}_{results['date']}"


if __name__ == "__main__":
    main()
