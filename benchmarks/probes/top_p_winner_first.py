"""Winner-first top_p / min_p: how many passes over a row a kernel needs when it finds the
sample before the cut, checked token for token against the survivors-first rule (CPU, float64).

The logits kernel finds the top_p cut first (a histogram of the row, the crossing bin sorted,
the prefix masses) and samples the survivors after; on flat rows that is several passes. The
sample can come first instead. Survivors of top_p (and min_p) form a prefix of the truncation
order (y descending, ties to the smaller id), and the sample is the best perturbed score
``s_v = y_v + g_v`` among them, so:

1. pass 1: the row's max ``y0``, its total mass ``Z = sum exp(y - y0)`` and ``t`` = the best
   ``s`` over every allowed token (min_p's threshold ``y0 + log(min_p)`` needs ``y0``: a token
   below it is no survivor, handled by step 2 like any other);
2. pass 2, 3, ...: the mass ahead of ``t`` in the order, ``A(t)``, and ``t'`` = the best ``s``
   among the tokens strictly ahead of ``t``, in one pass. If ``t`` is first, or ``A(t) < top_p
   * Z`` and ``t`` passes min_p, ``t`` is the sample (it is the best over a superset of the
   survivors). Otherwise every survivor lies strictly ahead of ``t``: continue with ``t'``.

Each step keeps the invariant "the sample lies at or ahead of t", and the set ahead shrinks, so
the loop ends; it returns exactly the survivors-first token for the same noise (the noise
contract). On a row whose survivors hold mass ``p`` of a flat distribution, ``t`` is a draw of
the whole softmax and fails with probability about ``1 - p``; this probe counts the passes on
the flat and LLM-like regimes of flashsampling_cuda/problems.py.

    PYTHONPATH=. python benchmarks/probes/top_p_winner_first.py [--vocab 151936] [--batch 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flashsampling_cuda.noise import gumbel_noise
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from flashsampling_cuda.truncation import Truncation, survivor_mask, truncation_rank


def survivors_first(y: torch.Tensor, scores: torch.Tensor, top_p: float, min_p: float | None) -> torch.Tensor:
    """The reference: the survivors of truncation.py's rule, then the best perturbed score."""
    keep = survivor_mask(y, None, Truncation(None, top_p, min_p))
    return torch.where(keep, scores, -torch.inf).argmax(dim=1)


def winner_first(y: torch.Tensor, scores: torch.Tensor, top_p: float,
                 min_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B], passes [B]) of the winner-first loop (module docstring). The masses ahead are
    float64 prefix sums in the order, as keep_prefix rounds them (a kernel would use one
    order-independent fixed-point sum for both rules)."""
    batch, vocab = y.shape
    rank = truncation_rank(y, None)
    order = torch.sort(rank, dim=1, stable=True).indices
    position = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=y.device).expand(batch, vocab))
    y64 = y.double()
    y0 = y64.gather(1, order[:, :1])
    ratio = torch.exp(y64 - y0)
    sorted_ratio = ratio.gather(1, order)
    probs = sorted_ratio / sorted_ratio.sum(dim=1, keepdim=True)
    before = torch.cat([torch.zeros_like(probs[:, :1]), torch.cumsum(probs, dim=1)[:, :-1]], dim=1)
    before = before.gather(1, position)  # per token: the mass ahead of it
    passes_min_p = torch.ones_like(ratio, dtype=torch.bool) if min_p is None else ratio >= min_p
    candidates = torch.ones_like(ratio, dtype=torch.bool)
    tokens = torch.where(candidates, scores, -torch.inf).argmax(dim=1)  # pass 1
    passes = torch.ones(batch, dtype=torch.int64, device=y.device)
    done = torch.zeros(batch, dtype=torch.bool, device=y.device)
    while not bool(done.all()):
        live = ~done
        passes += live.long()  # this pass: the mass ahead of t and the best strictly ahead
        t = tokens[:, None]
        first = position.gather(1, t)[:, 0] == 0
        survives = first | ((before.gather(1, t)[:, 0] < top_p) & passes_min_p.gather(1, t)[:, 0])
        done |= survives
        candidates &= position < position.gather(1, t)
        ahead = torch.where(candidates, scores, -torch.inf).argmax(dim=1)
        tokens = torch.where(done, tokens, ahead)
    return tokens, passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--draws", type=int, default=4, help="noise draws (offsets) per row")
    args = parser.parse_args()
    weight = lm_head_weight(args.vocab, args.dim, dtype=torch.float32, device="cpu")
    print("| regime | T | top_p | min_p | rows x draws | tokens equal | passes: mean | median | p90 | max |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for regime in ("flat", "llm"):
        logits = hidden_states(weight, args.batch, regime) @ weight.T
        for temperature, top_p, min_p in ((1.0, 0.9, None), (0.6, 0.95, None), (1.0, 0.9, 0.05),
                                          (1.0, 0.5, None)):
            y = logits / temperature
            passes_all, equal = [], True
            for offset in range(args.draws):
                g = gumbel_noise(7, offset, torch.arange(args.batch)[:, None], 0, torch.arange(args.vocab)[None, :])
                scores = y + g
                want = survivors_first(y, scores, top_p, min_p)
                got, passes = winner_first(y, scores, top_p, min_p)
                equal &= torch.equal(got, want)
                passes_all += passes.tolist()
            passes_all.sort()
            print(f"| {regime} | {temperature} | {top_p} | {min_p} | {args.batch} x {args.draws} | {equal} | "
                  f"{statistics.mean(passes_all):.2f} | {statistics.median(passes_all):.0f} | "
                  f"{passes_all[int(0.9 * (len(passes_all) - 1))]} | {passes_all[-1]} |", flush=True)


if __name__ == "__main__":
    main()
