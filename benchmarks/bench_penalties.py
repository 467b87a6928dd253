"""Penalties and model-side logit transforms (issue #35): ours against vLLM's torch pattern and
FlashInfer, one run.

For each shape (D x V), batch B and token history of L tokens per row (half prompt: random ids;
half output: ids drawn from L / 4 per row, so with repeats), bf16 LLM-like logits
(flashsampling_cuda/problems.py), temperature T (default 0.8), every contender side by side
(medians of CUDA-graph replays, µs):

  plain       ours, flashsampling_cuda.sample(hidden, weight, temperature=T)
  ours        ours with the form:
                penalties L      repetition 1.1, frequency 0.3, presence 0.2 ([B] tensors) over a
                                 PenaltyState of the history (the fused op's rank bitmap,
                                 docs/penalties.md)
                freq+pres L      frequency 0.3, presence 0.2 alone (the same route)
                softcap          logit_softcap=30 (Gemma 2/3)
                logit_scale      logit_scale=0.125 (Granite-like)
  vLLM mult.  torch.compile(cuBLAS fp32 logits -> vLLM's penalties (vllm/v1/sample/ops/penalties.py:
              bin counts of the prompt and output ids over [B, V + 1] by scatter_add, repetition
              where logits > 0 divide else multiply, frequency / presence subtraction) -> / T ->
              softmax -> multinomial); for softcap / logit_scale the transform instead of the
              penalties. The id tensors are on the device already (vLLM pads them on the host
              every step: not timed here)
  vLLM gumbel the same, then a Gumbel argmax instead of softmax + multinomial
  FI          the same compiled logits / T, then FlashInfer sampling_from_logits

Ratios (same run): ours / plain, each baseline / ours. Checks printed last (issue #35):
penalties (L = 2048) within 1.05x of plain for B <= 64 and 1.15x at B = 256; softcap within 1.03x.

Writes benchmarks/results/penalties_<gpu>_<date>.{json,md,png}: "records" holds one entry per
(D, V, B, form, history) with ours_us, plain_us, vllm_multinomial_us, vllm_gumbel_us,
flashinfer_us and the ratios.

Usage:
  python benchmarks/bench_penalties.py [--shapes 4096x151936] [--batches 1,16,64,128,256]
      [--histories 256,2048,8192] [--forms penalties,freq+pres,softcap,logit_scale] [--out benchmarks/results]
  python benchmarks/bench_penalties.py --tiny           # CPU / GPU smoke run, eager timing
"""

from __future__ import annotations

import sys

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states
import harness
from harness import (Bench, baseline_cells, cell, check_line, eager_note, faster_check, int_list, make_parser,
                     plot_lines, ratio_lines, shape_tables)

TINY = dict(shapes="64x1000", batches="1,4", histories="16,64")  # --tiny's defaults

REPETITION, FREQUENCY, PRESENCE = 1.1, 0.3, 0.2
SOFTCAP, LOGIT_SCALE = 30.0, 0.125
FORMS = ("penalties", "freq+pres", "softcap", "logit_scale")
HISTORY_FORMS = ("penalties", "freq+pres")
BASELINE_FORMS = ("penalties", "softcap", "logit_scale")


def histories(batch: int, length: int, vocab: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt ids [B, L - L // 2], output ids [B, L // 2]): the prompt random, the output drawn
    from a pool of max(1, L // 4) random ids per row (repeats)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(0, vocab, (batch, length - length // 2), generator=gen)
    pool = torch.randint(0, vocab, (batch, max(1, length // 4)), generator=gen)
    output = pool.gather(1, torch.randint(0, pool.shape[1], (batch, length // 2), generator=gen))
    return prompt.to(device), output.to(device)


def bin_counts_and_mask(ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's get_token_bin_counts_and_mask: ids padded with ``vocab`` count into column V, dropped."""
    counts = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.long, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    counts = counts[:, :vocab]
    return counts, counts > 0


def penalized_logits(logits, prompt_mask, output_counts, repetition, frequency, presence):
    """vLLM's penalty arithmetic on fp32 logits [B, V] from the dense tables of the history (prompt
    tokens [B, V] bool, output counts [B, V]); penalties per row [B] or floats."""
    def per_row(value):
        return value[:, None] if isinstance(value, torch.Tensor) else value

    output_mask = output_counts > 0
    penalties = torch.where(prompt_mask | output_mask, per_row(repetition), 1.0)
    logits = torch.where(logits > 0, logits / penalties, logits * penalties)
    logits = logits - per_row(frequency) * output_counts
    return logits - per_row(presence) * output_mask


def vllm_penalties(logits, prompt_ids, output_ids, repetition, frequency, presence):
    """vLLM's apply_penalties on fp32 logits [B, V], per-row penalties [B]: the tables counted from
    the ids each call, then :func:`penalized_logits`."""
    vocab = logits.shape[1]
    _, prompt_mask = bin_counts_and_mask(prompt_ids, vocab)
    output_counts, _ = bin_counts_and_mask(output_ids, vocab)
    return penalized_logits(logits, prompt_mask, output_counts, repetition, frequency, presence)


def processed_logits(form: str, temperature: float):
    """cuBLAS fp32 logits with the form's processing, / T (the part every baseline shares)."""

    def fn(hidden, weight, prompt_ids, output_ids, repetition, frequency, presence):
        logits = (hidden @ weight.T).float()
        if form == "penalties":
            logits = vllm_penalties(logits, prompt_ids, output_ids, repetition, frequency, presence)
        elif form == "softcap":
            logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        elif form == "logit_scale":
            logits = logits * LOGIT_SCALE
        return logits / temperature

    return fn


def with_multinomial(form: str, temperature: float):
    logits_of = processed_logits(form, temperature)
    return lambda *args: torch.multinomial(torch.softmax(logits_of(*args), dim=-1), 1)


def with_gumbel(form: str, temperature: float):
    logits_of = processed_logits(form, temperature)

    def fn(*args):
        y = logits_of(*args)
        u = torch.rand_like(y).clamp_(1e-20, 1.0)
        return torch.argmax(y - torch.log(-torch.log(u)), dim=-1)

    return fn


def per_row_penalties(batch: int, device) -> dict:
    """The three penalties as [B] float32 tensors (REPETITION, FREQUENCY, PRESENCE)."""
    return {name: torch.full((batch,), value, dtype=torch.float32, device=device)
            for name, value in (("repetition_penalty", REPETITION), ("frequency_penalty", FREQUENCY),
                                ("presence_penalty", PRESENCE))}


def ours_kwargs(form: str, state, per_row: dict) -> dict:
    if form == "penalties":
        return dict(penalty_state=state, **per_row)
    if form == "freq+pres":
        return dict(penalty_state=state, frequency_penalty=per_row["frequency_penalty"],
                    presence_penalty=per_row["presence_penalty"])
    if form == "softcap":
        return dict(logit_softcap=SOFTCAP)
    if form == "logit_scale":
        return dict(logit_scale=LOGIT_SCALE)
    raise ValueError(form)


def run(bench: Bench, args) -> None:
    forms = args.forms.split(",")
    unknown = [f for f in forms if f not in FORMS]
    if unknown:
        sys.exit(f"unknown forms {unknown}; choose from {FORMS}")
    T = args.temperature
    baselines = {}
    for form in forms:
        if form in BASELINE_FORMS:
            baselines[(form, "vllm_multinomial_us")] = bench.baseline(f"vllm {form} multinomial",
                                                                      with_multinomial(form, T))
            baselines[(form, "vllm_gumbel_us")] = bench.baseline(f"vllm {form} gumbel", with_gumbel(form, T))
            baselines[(form, "logits")] = bench.baseline(f"vllm {form} logits", processed_logits(form, T))
    fi = bench.flashinfer
    for dim, vocab, weight in bench.weights(args.shapes):
        for batch in int_list(args.batches):
            hidden = hidden_states(weight, batch, args.regime, seed=batch)
            per_row = per_row_penalties(batch, bench.device)
            plain = {}
            bench.measure(plain, "plain_us", lambda: flashsampling_cuda.sample(hidden, weight, temperature=T))
            cases = [(f, L) for f in forms if f in HISTORY_FORMS for L in int_list(args.histories)]
            cases += [(f, None) for f in forms if f not in HISTORY_FORMS]
            for form, length in cases:
                record = {"D": dim, "V": vocab, "B": batch, "form": form, "history": length, "regime": args.regime,
                          "plain_us": plain.get("plain_us")}
                if "errors" in plain:
                    record["errors"] = dict(plain["errors"])
                if length is not None:
                    prompt_ids, output_ids = histories(batch, length, vocab, bench.device, seed=batch * 7 + length)
                    state = flashsampling_cuda.PenaltyState(prompt_ids, output_ids)
                    record["distinct_ids_mean"] = float(state.size.float().mean())
                else:
                    prompt_ids = output_ids = torch.full((batch, 1), vocab, dtype=torch.long, device=bench.device)
                    state = None
                kwargs = ours_kwargs(form, state, per_row)
                bench.measure(record, "ours_us", lambda kwargs=kwargs: flashsampling_cuda.sample(
                    hidden, weight, temperature=T, **kwargs))
                inputs = (hidden, weight, prompt_ids, output_ids, per_row["repetition_penalty"],
                          per_row["frequency_penalty"], per_row["presence_penalty"])
                for key in ("vllm_multinomial_us", "vllm_gumbel_us"):
                    if (form, key) in baselines:
                        bench.measure(record, key, baselines[(form, key)], *inputs)
                if fi is not None and (form, "logits") in baselines:
                    logits_of = baselines[(form, "logits")]
                    bench.measure(record, "flashinfer_us",
                                  lambda: fi.sampling_from_logits(logits_of(*inputs), deterministic=True))
                    record.setdefault("compiled", {})["flashinfer_us"] = logits_of.is_compiled
                bench.add(record, markdown_table, ("vllm_multinomial_us", "vllm_gumbel_us", "flashinfer_us"))
                del state


def form_name(r: dict) -> str:
    return r["form"] + (f" L={r['history']}" if r.get("history") else "")


def markdown_table(results: dict) -> str:
    return shape_tables(
        results, f"{results['regime']} logits; FI = vLLM's processing (compiled where the baselines are) + FlashInfer "
        "sampling_from_logits",
        ["B", "form", "plain", "ours", "ours / plain", "vLLM mult.", "/ ours", "vLLM gumbel", "/ ours", "FI",
         "FI / ours"],
        lambda r: [str(r["B"]), form_name(r), cell(r.get("plain_us")), cell(r.get("ours_us")),
                   cell(r.get("ours_over_plain"), ".3f"),
                   *baseline_cells(r, "vllm_multinomial", "vllm_gumbel", "flashinfer")])


def checks(results: dict) -> list[str]:
    records = results["records"]

    def where(r):
        return f"D={r['D']} B={r['B']} {form_name(r)}"

    pen = [r for r in records if r["form"] == "penalties" and r.get("history") == 2048
           and r.get("ours_over_plain") is not None]
    soft = [r for r in records if r["form"] == "softcap" and r.get("ours_over_plain") is not None]
    out = [
        check_line("penalties (L = 2048) / plain <= 1.05 for B <= 64",
                   [(where(r), r["ours_over_plain"]) for r in pen if r["B"] <= 64], lambda v: v <= 1.05),
        check_line("penalties (L = 2048) / plain <= 1.15 at B = 256",
                   [(where(r), r["ours_over_plain"]) for r in pen if r["B"] == 256], lambda v: v <= 1.15),
        check_line("softcap / plain <= 1.03", [(where(r), r["ours_over_plain"]) for r in soft], lambda v: v <= 1.03),
    ]
    for key, label in (("vllm_multinomial_over_ours", "vLLM + multinomial"), ("vllm_gumbel_over_ours", "vLLM + gumbel"),
                       ("flashinfer_over_ours", "vLLM processing + FlashInfer")):
        out.append(faster_check(f"(information) faster than {label}", records, (key,), where,
                                eager_note(results) if key != "flashinfer_over_ours" else ""))
    return out


def plot(results: dict, path) -> None:
    def select(r, case):
        return form_name(r) == case

    cases = list(dict.fromkeys(form_name(r) for r in results["records"]))
    shown = [c for c in cases if c in ("penalties L=2048", "softcap")]
    plot_lines(results, path, ratio_lines(cases, select, "ours_us", "ours {}", "o-")
               + ratio_lines(shown, select, "flashinfer_us", "FI {} (dotted: baselines)", "x:")
               + ratio_lines(shown, select, "vllm_gumbel_us", "vLLM gumbel {}", "+:"))


def main() -> None:
    parser = make_parser(__doc__, shapes="4096x151936", batches="1,16,64,128,256", tiny=TINY)
    parser.add_argument("--histories", default="256,2048,8192", help="comma list of tokens per row")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"comma list of {', '.join(FORMS)}")
    parser.add_argument("--regime", default="llm", choices=["flat", "llm"])
    harness.main("penalties", parser, TINY, run, markdown_table, checks, plot, header=lambda args: dict(
        regime=args.regime, settings=dict(
            repetition_penalty=REPETITION, frequency_penalty=FREQUENCY, presence_penalty=PRESENCE,
            logit_softcap=SOFTCAP, logit_scale=LOGIT_SCALE,
            history="half prompt (random ids), half output (ids from L // 4 per row)")))


if __name__ == "__main__":
    main()
