"""Same-run A/B of two builds of the package on one GPU: the kernel benchmark's variants
(bench_controls.VARIANTS: plain, per-row temperatures, mask, logprobs, dense and sparse bias,
per-row seeds, all three common controls, four samples), or with --suite truncation
bench_truncation.py's forms on its flat and LLM-like rows, timed as CUDA-graph replays with
whichever flashsampling_cuda comes first on sys.path, one process per build and round, rounds
alternating between the builds; then a table of after / before per cell.

  PYTHONPATH=<tree> python benchmarks/probes/ab_builds.py time --label before --round 0 --out DIR
  python benchmarks/probes/ab_builds.py compare --out DIR --stem ab_<what>_<gpu>_<date>

A kernel after the GEMM (truncation, logprobs) is compared by its own device time instead:
profile_truncation.py's output with each build, then

  python benchmarks/probes/ab_builds.py compare-profiles BEFORE.log AFTER.log

prints each call's total and every kernel whose time moved, before -> after.

ab_builds.sh runs the whole A/B on the GPU machine (two builds, alternating rounds, table;
PROFILE_ARGS: also profile_truncation.py with each build and compare-profiles).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_*, report

import torch  # noqa: E402


def time_build(args) -> None:
    import flashsampling_cuda  # the build under test: first on PYTHONPATH

    from bench_controls import VARIANTS, variant_kwargs
    from bench_sampler import median_us
    from flashsampling_cuda.problems import lm_head_weight
    from harness import shape_list

    device = torch.device("cuda")
    op = torch.ops.flashsampling.sample_with_scores
    records = []
    for dim, vocab in shape_list(args.shapes):
        weight = lm_head_weight(vocab, dim, device=device)
        torch.manual_seed(0)  # the same hidden rows in every build's process
        for batch in (int(b) for b in args.batches.split(",")):
            if args.suite == "truncation":
                records += truncation_records(weight, batch, median_us)
                continue
            hidden = torch.randn(batch, dim, device=device, dtype=torch.bfloat16)
            for name in VARIANTS:
                kwargs = variant_kwargs(name, batch, vocab, device)
                us = median_us(lambda kwargs=kwargs: op(hidden, weight, **kwargs), graph=True)
                records.append({"D": dim, "V": vocab, "B": batch, "variant": name, "us": us})
        del weight
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"label": args.label, "round": args.round, "package": flashsampling_cuda.__file__,
              "device": torch.cuda.get_device_properties(0).name, "records": records}
    (out / f"{args.label}_r{args.round}.json").write_text(json.dumps(result))
    print(f"[ab] {args.label} round {args.round}: {len(records)} cells from {flashsampling_cuda.__file__}")


def truncation_records(weight, batch: int, median_us) -> list[dict]:
    """bench_truncation.py's forms on its flat and LLM-like rows at one batch, graph replays (every
    launch a captured call makes, with the gaps between them, as a decode loop runs them)."""
    import flashsampling_cuda
    from bench_truncation import FORMS, form_arguments
    from flashsampling_cuda.problems import hidden_states

    vocab, dim = weight.shape
    records = []
    for regime in ("flat", "llm"):
        hidden = hidden_states(weight, batch, regime, seed=batch)
        for form, (temperature, spec) in FORMS.items():
            kwargs = form_arguments(spec, batch)
            us = median_us(lambda kwargs=kwargs, t=temperature: flashsampling_cuda.sample(  # noqa: B023
                hidden, weight, temperature=t, **kwargs), graph=True)
            records.append({"D": dim, "V": vocab, "B": batch, "variant": f"{regime} {form}", "us": us})
    return records


def compare(args) -> None:
    from report import run_header

    runs = [json.loads(p.read_text()) for label in (args.before, args.after)
            for p in sorted(Path(args.out).glob(f"{label}_r*.json"))]
    times: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        for r in run["records"]:
            times.setdefault((r["D"], r["V"], r["B"], r["variant"]), {}).setdefault(run["label"], []).append(r["us"])
    rows = []
    for (dim, vocab, batch, variant), by_label in times.items():
        before = statistics.median(by_label[args.before])
        after = statistics.median(by_label[args.after])
        rows.append({"D": dim, "V": vocab, "B": batch, "variant": variant, "before_us": before,
                     "after_us": after, "after_over_before": after / before,
                     "rounds": len(by_label[args.before])})
    worst = max(rows, key=lambda r: abs(r["after_over_before"] - 1))
    header = run_header(runs[0]["device"])
    results = {**header, "before": args.before_desc, "after": args.after_desc, "rows": rows,
               "worst_cell": worst}
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [f"Same-run A/B, {header['device']}, {header['date']}: after / before, medians of "
             f"{rows[0]['rounds']} alternating rounds each of CUDA-graph replay medians.",
             f"before: {args.before_desc}; after: {args.after_desc}.", ""]
    for shape in dict.fromkeys((r["D"], r["V"]) for r in rows):
        lines += [f"**D={shape[0]}, V={shape[1]}** (after / before)", "",
                  "| B | " + " | ".join(variants) + " |", "|---" * (len(variants) + 1) + "|"]
        for batch in dict.fromkeys(r["B"] for r in rows if (r["D"], r["V"]) == shape):
            cells = {r["variant"]: r for r in rows if (r["D"], r["V"], r["B"]) == (*shape, batch)}
            lines.append(f"| {batch} | " + " | ".join(f"{cells[v]['after_over_before']:.3f}" for v in variants) + " |")
        lines.append("")
    lines.append(f"Largest difference: {worst['after_over_before']:.3f} (D={worst['D']}, B={worst['B']}, "
                 f"{worst['variant']}: {worst['before_us']:.1f} -> {worst['after_us']:.1f} µs).")
    table = "\n".join(lines)
    out = Path(args.out)
    (out / f"{args.stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.stem}.md").write_text(table + "\n")
    print(table)


def profile_lines(path: str) -> dict[str, tuple[float, dict[str, float]]]:
    """profile_truncation.py's lines "[call] total T us: kernel t, kernel t, ..." by call."""
    calls = {}
    for line in Path(path).read_text().splitlines():
        match = re.match(r"\[(.*?)\] total ([\d.]+) us: (.*)", line)
        if match:
            kernels = {}
            for part in match.group(3).split(", "):
                name, _, us = part.rpartition(" ")
                kernels[name] = float(us)
            calls[match.group(1)] = (float(match.group(2)), kernels)
    return calls


def compare_profiles(args) -> None:
    before, after = profile_lines(args.before_log), profile_lines(args.after_log)
    for call, (total_before, kernels_before) in before.items():
        if call not in after:
            continue
        total_after, kernels_after = after[call]
        moved = []
        for name in dict.fromkeys([*kernels_before, *kernels_after]):
            a, b = kernels_before.get(name, 0.0), kernels_after.get(name, 0.0)
            if abs(b - a) >= args.min_us:
                moved.append(f"{name} {a:.1f} -> {b:.1f}")
        print(f"{call:40s} total {total_before:7.1f} -> {total_after:7.1f} us ({total_after / total_before:.3f})"
              + ("; " + ", ".join(moved) if moved else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("time")
    t.add_argument("--label", required=True)
    t.add_argument("--round", type=int, default=0)
    t.add_argument("--shapes", default="4096x151936,8192x128256")
    t.add_argument("--batches", default="1,4,16,32,64,128,256")
    t.add_argument("--out", required=True)
    t.add_argument("--suite", choices=["controls", "truncation"], default="controls")
    c = sub.add_parser("compare")
    c.add_argument("--out", required=True)
    c.add_argument("--stem", required=True)
    c.add_argument("--before", default="before")
    c.add_argument("--after", default="after")
    c.add_argument("--before-desc", default="before")
    c.add_argument("--after-desc", default="after")
    p = sub.add_parser("compare-profiles")
    p.add_argument("before_log")
    p.add_argument("after_log")
    p.add_argument("--min-us", type=float, default=0.5, help="list the kernels that moved by at least this")
    args = parser.parse_args()
    {"time": time_build, "compare": compare, "compare-profiles": compare_profiles}[args.mode](args)


if __name__ == "__main__":
    main()
