"""Speculative-decoding verification (issue #36): ours against FlashInfer's and vLLM's rejection
samplers, one run.

For each shape (D x V), batch B and number of draft tokens n, the target's hidden states at the
n + 1 positions are bf16 LLM-like rows (flashsampling_cuda/problems.py, so the target is peaked);
the one-hot drafts are the target's argmax at each position, each replaced by a random id with
probability --draft-noise (default 0.2), so the target accepts them at a realistic rate (recorded:
acceptance = mean accepted drafts / n of one call of ours). For the n in --draft-probs-n (default
4) also sampled drafts: q = softmax((logits + N(0, 1)) / T) at the n draft positions, drafts drawn
from q. Temperature T (default 0.8). Medians of CUDA-graph replays, µs:

  ours       flashsampling_cuda.speculative_sample(hidden [B, n + 1, D], weight, draft_token_ids
             [, draft_probs])
  plain      ours, flashsampling_cuda.sample of the same B * (n + 1) rows (the reference of the
             "within 1.1x of plain" target)
  FI         cuBLAS logits -> torch.compile(fp32 softmax(logits / T)) -> FlashInfer
             chain_speculative_sampling(draft_probs [B, n, V], draft_token_ids, target_probs
             [B, n + 1, V]); one-hot drafts go in as a one-hot draft_probs made before the timed
             call (not timed). The call adapts to FlashInfer's signature (recorded); a mismatch is
             recorded, not fatal
  vLLM       torch.compile of vLLM's rejection sampler in torch (one-hot: accept d_j when
             u_j < p_j(d_j); sampled: when u_j * q_j(d_j) < p_j(d_j); the recovered token from
             p_j with d_j zeroed / from max(p_j - q_j, 0), by an exponential race; the bonus token
             from p_n; the output tokens with -1 after the first rejection)

Ratios (same run): ours / plain, FI / ours, vLLM / ours. Checks printed last (issue #36): faster
than both in every cell; FI / ours >= 1.3 for B * (n + 1) <= 64 rows; one-hot ours within 1.1x
of plain.

Writes benchmarks/results/speculative_<gpu>_<date>.{json,md,png}: "records" holds one entry per
(D, V, B, n, drafts) with ours_us, plain_us, flashinfer_us, vllm_us, acceptance and the ratios.

Usage:
  python benchmarks/bench_speculative.py [--shapes 4096x151936,8192x128256] [--batches 1,4,16,64]
      [--drafts 1,2,4,8] [--draft-probs-n 4] [--draft-noise 0.2] [--per-row-seeds] [--out benchmarks/results]

--per-row-seeds gives ours a [B] seed tensor (per-request generators, as serving engines keep
them): the one-hot route's columns then draw their noise key by key (the controls' loop), where
a batch-wide seed's several-samples layout takes the plain loop beyond 32 GEMM columns.
  python benchmarks/bench_speculative.py --tiny         # CPU / GPU smoke run, eager timing
"""

from __future__ import annotations

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states
import harness
from harness import (Bench, baseline_cells, call_signature, cell, check_line, eager_note, faster_check, int_list,
                     make_parser, plot_lines, ratio_lines, shape_tables, short_error)

TINY = dict(shapes="64x1000", batches="1,4", drafts="1,2", draft_probs_n="2")  # --tiny's defaults


SEED = 1234


def vllm_rejection_sampler(temperature: float, sampled: bool):
    """vLLM's rejection sampler (vllm/v1/sample/rejection_sampler.py) in torch, fp32 (to compile):
    returns the output tokens [B, n + 1] (-1 after the first rejection) and the accepted counts."""

    def fn(hidden, weight, draft_ids, draft_probs):
        batch, positions, dim = hidden.shape
        n = positions - 1
        logits = (hidden.reshape(batch * positions, dim) @ weight.T).float()
        p = torch.softmax(logits / temperature, dim=-1).view(batch, positions, -1)
        p_draft = p[:, :n].gather(2, draft_ids[:, :, None])[:, :, 0]
        u = torch.rand((batch, n), device=hidden.device)
        if sampled:
            q_draft = draft_probs.gather(2, draft_ids[:, :, None])[:, :, 0]
            accepted = u * q_draft < p_draft
            residual = (p[:, :n] - draft_probs).clamp_min(0.0)
        else:
            accepted = u < p_draft
            residual = p[:, :n].scatter(2, draft_ids[:, :, None], 0.0)
        recovered = residual.div(torch.empty_like(residual).exponential_()).argmax(dim=-1)
        bonus = p[:, n].div(torch.empty_like(p[:, n]).exponential_()).argmax(dim=-1, keepdim=True)
        num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1, keepdim=True)
        emitted = torch.cat((recovered, bonus), dim=1)
        slot = torch.arange(positions, device=hidden.device)[None, :]
        drafts = torch.cat((draft_ids, torch.full_like(draft_ids[:, :1], -1)), dim=1)
        tokens = torch.where(slot < num_accepted, drafts,
                             torch.where(slot == num_accepted, emitted.gather(1, num_accepted), -1))
        return tokens, num_accepted

    return fn


def target_probs_of(temperature: float):
    def fn(hidden, weight):
        batch, positions, dim = hidden.shape
        logits = (hidden.reshape(batch * positions, dim) @ weight.T).float()
        return torch.softmax(logits / temperature, dim=-1).view(batch, positions, -1)

    return fn


def flashinfer_chain(fi):
    """(call(draft_probs, draft_ids, target_probs) -> output tokens [B, n + 1], the signature
    it adapted to), or (None, why not)."""
    fn = getattr(fi, "chain_speculative_sampling", None)
    if fn is None:
        return None, "flashinfer.sampling has no chain_speculative_sampling"
    signature = call_signature(fn)
    if "uniform_samples" in signature:  # FlashInfer <= 0.2: (draft_probs, draft_ids, uniform_samples, target_probs)
        def call(q, d, p):
            u = torch.rand((d.shape[0], d.shape[1] + 1), device=d.device)
            out = fn(q, d, u, p, deterministic=True)
            return out[0] if isinstance(out, tuple) else out
    else:  # 0.2.3 and later, 0.7.x: (draft_probs, draft_token_ids, target_probs, ..., deterministic, generator, ...)
        def call(q, d, p):
            out = fn(q, d, p, deterministic=True)
            return out[0] if isinstance(out, tuple) else out
    return call, signature


def problem(weight, batch: int, n: int, draft_noise: float, seed: int):
    """(hidden [B, n + 1, D], one-hot draft ids [B, n], the target's fp32 logits at the draft
    positions [B, n, V])."""
    vocab, dim = weight.shape
    hidden = hidden_states(weight, batch * (n + 1), "llm", seed=seed).view(batch, n + 1, dim)
    logits = (hidden[:, :n].reshape(batch * n, dim) @ weight.T).float().view(batch, n, vocab)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    noisy = torch.rand((batch, n), generator=gen) < draft_noise
    random_ids = torch.randint(0, vocab, (batch, n), generator=gen)
    drafts = torch.where(noisy.to(weight.device), random_ids.to(weight.device), logits.argmax(dim=-1))
    return hidden, drafts, logits


def sampled_drafts(logits, temperature: float, seed: int):
    """(draft_probs q [B, n, V] fp32, draft ids [B, n] drawn from q): a draft model near the target."""
    gen = torch.Generator(device=logits.device).manual_seed(seed)
    noise = torch.randn(logits.shape, device=logits.device, generator=gen)
    q = torch.softmax((logits + noise) / temperature, dim=-1)
    del noise
    ids = torch.multinomial(q.view(-1, q.shape[-1]), 1, generator=gen).view(q.shape[:2])
    return q, ids


def run(bench: Bench, args) -> None:
    T = args.temperature
    vllm = {False: bench.baseline("vllm one-hot", vllm_rejection_sampler(T, sampled=False)),
            True: bench.baseline("vllm sampled", vllm_rejection_sampler(T, sampled=True))}
    probs_of = bench.baseline("target probs (FI)", target_probs_of(T))
    fi_call = None
    if bench.flashinfer is not None:
        fi_call, how = flashinfer_chain(bench.flashinfer)
        bench.results["flashinfer"]["chain_speculative_sampling"] = how
    with_probs = set(int_list(args.draft_probs_n))
    for dim, vocab, weight in bench.weights(args.shapes):
        for batch in int_list(args.batches):
            for n in int_list(args.drafts):
                seed = 1000 * batch + n
                hidden, drafts, logits = problem(weight, batch, n, args.draft_noise, seed)
                flat = hidden.view(batch * (n + 1), dim)
                plain = {}
                bench.measure(plain, "plain_us", lambda: flashsampling_cuda.sample(flat, weight, temperature=T))
                cases = [("one-hot", drafts, None)]
                if n in with_probs:
                    q, q_drafts = sampled_drafts(logits, T, seed)
                    cases.append(("sampled", q_drafts, q))
                del logits
                for case, draft_ids, draft_probs in cases:
                    record = {"D": dim, "V": vocab, "B": batch, "n": n, "rows": batch * (n + 1), "drafts": case,
                              "plain_us": plain.get("plain_us")}
                    if "errors" in plain:
                        record["errors"] = dict(plain["errors"])

                    seed = (torch.arange(batch, device=hidden.device) + SEED) if args.per_row_seeds else SEED

                    def ours(draft_ids=draft_ids, draft_probs=draft_probs, seed=seed):
                        return flashsampling_cuda.speculative_sample(hidden, weight, draft_ids, draft_probs,
                                                                     temperature=T, seed=seed)

                    try:
                        record["acceptance"] = float(ours().num_accepted.float().mean()) / n
                    except Exception as exc:  # noqa: BLE001 - recorded; the timing below records it too
                        record.setdefault("errors", {})["acceptance"] = short_error(exc)
                    bench.measure(record, "ours_us", ours)
                    if fi_call is not None:
                        q_fi = draft_probs if draft_probs is not None else torch.zeros(
                            (batch, n, vocab), dtype=torch.float32, device=bench.device).scatter_(
                                2, draft_ids[:, :, None], 1.0)
                        ids_fi = draft_ids.int()
                        try:
                            tokens = fi_call(q_fi, ids_fi, probs_of(hidden, weight))
                            if tuple(tokens.shape) != (batch, n + 1):
                                raise RuntimeError(f"output of shape {list(tokens.shape)}, not [{batch}, {n + 1}]")
                            bench.measure(record, "flashinfer_us",
                                          lambda: fi_call(q_fi, ids_fi, probs_of(hidden, weight)))
                            record.setdefault("compiled", {})["flashinfer_us"] = probs_of.is_compiled
                        except Exception as exc:  # noqa: BLE001 - a signature mismatch is recorded
                            record.setdefault("errors", {})["flashinfer_us"] = short_error(exc)
                        del q_fi
                    bench.measure(record, "vllm_us", vllm[draft_probs is not None], hidden, weight, draft_ids,
                                  draft_probs)
                    bench.add(record, markdown_table, ("flashinfer_us", "vllm_us"))


def markdown_table(results: dict) -> str:
    return shape_tables(
        results, "LLM-like target; plain = our sample of the B·(n+1) rows",
        ["B", "n", "rows", "drafts", "acceptance", "plain", "ours", "ours / plain", "FI", "FI / ours", "vLLM",
         "vLLM / ours"],
        lambda r: [str(r["B"]), str(r["n"]), str(r["rows"]), r["drafts"], cell(r.get("acceptance"), ".2f"),
                   cell(r.get("plain_us")), cell(r.get("ours_us")), cell(r.get("ours_over_plain"), ".3f"),
                   *baseline_cells(r, "flashinfer", "vllm")])


def checks(results: dict) -> list[str]:
    records = results["records"]

    def where(r):
        return f"D={r['D']} B={r['B']} n={r['n']} {r['drafts']}"

    one_hot = [r for r in records if r["drafts"] == "one-hot"]
    return [
        faster_check("faster than FlashInfer's pipeline and vLLM's sampler in every cell (min of the two / ours > 1)",
                     records, ("flashinfer_over_ours", "vllm_over_ours"), where, eager_note(results)),
        check_line("FI / ours >= 1.3 for B·(n+1) <= 64 rows (one-hot)",
                   [(where(r), r["flashinfer_over_ours"]) for r in one_hot
                    if r["rows"] <= 64 and r.get("flashinfer_over_ours") is not None], lambda v: v >= 1.3, worst=min),
        check_line("ours / plain (same rows) <= 1.1 (one-hot)",
                   [(where(r), r["ours_over_plain"]) for r in one_hot if r.get("ours_over_plain") is not None],
                   lambda v: v <= 1.1),
    ]


def plot(results: dict, path) -> None:
    def select(r, n):
        return r["n"] == n and r["drafts"] == "one-hot"

    ns = sorted({r["n"] for r in results["records"]})
    plot_lines(results, path, ratio_lines(ns, select, "ours_us", "ours, n={}", "o-")
               + ratio_lines(ns, select, "flashinfer_us", "FI, n={} (dotted: baselines)", "x:")
               + ratio_lines(ns, select, "vllm_us", "vLLM, n={}", "+:"),
               title=lambda k: f"D={k[0]}, V={k[1]}, one-hot drafts",
               ylabel="time / our plain sampling of the B·(n+1) rows")


def main() -> None:
    parser = make_parser(__doc__, shapes="4096x151936,8192x128256", batches="1,4,16,64", tiny=TINY)
    parser.add_argument("--drafts", default="1,2,4,8", help="comma list of draft tokens per row n")
    parser.add_argument("--draft-probs-n", default="4", help="the n also timed with sampled drafts (draft_probs)")
    parser.add_argument("--draft-noise", type=float, default=0.2,
                        help="probability that a one-hot draft is a random id instead of the target's argmax")
    parser.add_argument("--per-row-seeds", action="store_true", help="ours with a [B] seed tensor (recorded)")
    harness.main("speculative", parser, TINY, run, markdown_table, checks, plot,
                 header=lambda args: dict(draft_noise=args.draft_noise, seed=SEED, per_row_seeds=args.per_row_seeds))


if __name__ == "__main__":
    main()
