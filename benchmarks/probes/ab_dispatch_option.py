"""Same-run A/B of one DispatchOptions switch (sampler_params.h) on the truncation forms of
bench_truncation.py and plain sampling: the switch on and off timed alternately in one process
(CUDA-graph replays, median µs; the best of the rounds), with a check that both give the same
tokens and scores. Prints on / off per cell and the ratio off / on (> 1: the switch helps).

  python benchmarks/probes/ab_dispatch_option.py --option top_p_tile_winners
      [--shapes 4096x151936] [--batches 1,16,64,256] [--regimes flat,llm] [--forms "p0.9 [B],..." | none]
      [--offsets 0,1,2] [--extras softcap,logit_scale,penalties,freq+pres] [--fixed narrow_plain_pass=off]

--fixed sets other switches in both arms (e.g. a route's switch off, to time a part only that route runs).

--extras adds calls of bench_penalties.py's forms (penalties, freq+pres, softcap, logit_scale: its
constants, the penalties over 2048-token histories) without truncation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_*

import torch  # noqa: E402

from bench_penalties import FORMS as PENALTY_FORMS, HISTORY_FORMS, histories, ours_kwargs, per_row_penalties  # noqa: E402
from bench_sampler import median_us  # noqa: E402
from bench_truncation import FORMS, form_arguments  # noqa: E402
from harness import add_problem_arguments, lm_head_problems, ratio_summary  # noqa: E402

import flashsampling_cuda  # noqa: E402


def same_results(a, b) -> bool:
    return all(torch.equal(x.view(torch.int32) if x.is_floating_point() else x,
                           y.view(torch.int32) if y.is_floating_point() else y)
               for x, y in zip(a, b) if isinstance(x, torch.Tensor))


def extra_arguments(form: str, batch: int, vocab: int) -> dict:
    """sample()'s arguments of one of bench_penalties.py's forms (histories of 2048 tokens)."""
    if form not in PENALTY_FORMS:
        raise ValueError(f"unknown --extras form {form!r}: one of {PENALTY_FORMS}")
    state = (flashsampling_cuda.PenaltyState(*histories(batch, 2048, vocab, "cuda", seed=batch * 7 + 2048))
             if form in HISTORY_FORMS else None)
    return ours_kwargs(form, state, per_row_penalties(batch, "cuda"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--option", required=True, help="a DispatchOptions field, e.g. top_p_tile_winners")
    add_problem_arguments(parser, shapes="4096x151936", batches="1,16,64,256", regimes="flat,llm")
    parser.add_argument("--forms", default=None,
                        help="comma-separated bench_truncation FORMS (default: all; none: plain sampling alone)")
    parser.add_argument("--extras", default="", help=f"comma-separated, of {PENALTY_FORMS}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--offsets", default="0",
                        help="comma-separated noise offsets: each cell is the mean over them (draws that differ)")
    parser.add_argument("--fixed", default="",
                        help="comma-separated name=on|off: other DispatchOptions fields, the same in both arms")
    args = parser.parse_args()
    fixed = {}
    for item in filter(None, args.fixed.split(",")):
        name, _, value = item.partition("=")
        if value not in ("on", "off"):
            parser.error(f"--fixed: {item!r} is not name=on or name=off")
        fixed[name] = value == "on"
    set_options = torch.ops.flashsampling._set_dispatch_options
    named = [] if args.forms == "none" else args.forms.split(",") if args.forms else list(FORMS)
    forms = {"plain": (0.8, {})} | {f: FORMS[f] for f in named} | {
        f: (0.8, None) for f in args.extras.split(",") if f}
    print(f"# {torch.cuda.get_device_name()}; {args.option}: on / off µs, off / on"
          + "".join(f"; {name} {'on' if on else 'off'}" for name, on in fixed.items()))
    ratios = []
    for dim, vocab, regime, batch, weight, hidden in lm_head_problems(args.shapes, args.regimes, args.batches):
        for form, (temperature, spec) in forms.items():
            on_offsets, off_offsets, same = [], [], True
            arguments = extra_arguments(form, batch, vocab) if spec is None else form_arguments(spec, batch)
            for offset in (int(o) for o in args.offsets.split(",")):
                kwargs = dict(temperature=temperature, seed=torch.tensor(7, device="cuda"),
                              offset=torch.tensor(offset, device="cuda"), **arguments)

                def call(kwargs=kwargs):
                    return flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs)

                times = {True: [], False: []}
                outputs = {}
                for _ in range(args.rounds):
                    for on in (True, False):
                        set_options(**fixed, **{args.option: on})
                        outputs[on] = call()
                        times[on].append(median_us(call, graph=True))
                set_options()
                on_offsets.append(min(times[True]))
                off_offsets.append(min(times[False]))
                same = same and same_results(outputs[True], outputs[False])
            on_us, off_us = statistics.mean(on_offsets), statistics.mean(off_offsets)
            ratios.append(off_us / on_us)
            print(f"{dim}x{vocab} {regime:4s} B={batch:<4d} {form:26s}: {on_us:8.1f} / {off_us:8.1f} µs,"
                  f" {off_us / on_us:.3f}{'' if same else '  RESULTS DIFFER'}", flush=True)
    print(ratio_summary("off / on", ratios))


if __name__ == "__main__":
    main()
