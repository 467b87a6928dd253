"""Float64 reference sampler for tests (CPU or CUDA tensors).

Computes the same Gumbel-Max sample as ``flashsampling.sample`` with the logits and the
perturbed scores in float64 and the *same* fp32 noise (noise.py), so the op's tokens
must equal the reference's except where the top-2 perturbed scores are closer than
the op's fp32 rounding: :class:`ReferenceSample` reports that gap and a tolerance.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .noise import as_int64_tensor, gumbel_noise


class ReferenceSample(NamedTuple):
    tokens: Tensor  # int64 [B, num_samples]
    gap: Tensor  # float64 [B, num_samples]: best minus second-best score (inf when V == 1)
    tolerance: Tensor  # float64 [B]: rows whose gap is below this may differ from fp32


def _per_row(x: int | Tensor, batch: int, device: torch.device) -> tuple[Tensor, bool]:
    """Seed-like argument as an int64 [B] tensor, and whether it was given per row."""
    t = as_int64_tensor(x, device)
    return t.expand(batch), t.dim() == 1


def reference_sample(
    hidden: Tensor,
    weight: Tensor,
    temperature: float | Tensor = 1.0,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    num_samples: int = 1,
    *,
    rtol: float = 1e-5,
    max_chunk_elements: int = 1 << 21,
) -> ReferenceSample:
    """Reference of ``flashsampling.sample(hidden, weight, temperature=..., seed=...,
    offset=..., num_samples=...)`` with an explicit seed.

    Args:
        hidden: [B, D], weight: [V, D] (any float dtype; used as float64).
        temperature: float or [B] tensor; 0 means greedy (score = logit, no noise).
        seed, offset: int, 0-d or [B] int64 tensor. A [B] seed is per row (noise
            stream 0); otherwise the stream is the batch row.
        rtol: relative fp32 error budget of a score; tolerance per row is
            rtol * (max_v sum_d |w[v, d] h[d]| / T + 1) (T = 1 for greedy rows).
        max_chunk_elements: bounds B * vocab chunk, the size of every temporary.
    """
    batch, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    h = hidden.double()
    temps = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    greedy = temps == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temps)
    seeds, per_row_seed = _per_row(seed, batch, device)
    offsets, _ = _per_row(offset, batch, device)
    streams = torch.zeros(batch, dtype=torch.int64, device=device)
    if not per_row_seed:
        streams = torch.arange(batch, device=device)

    shape = (batch, num_samples)
    best = torch.full(shape, -torch.inf, dtype=torch.float64, device=device)
    second = best.clone()
    tokens = torch.full(shape, -1, dtype=torch.int64, device=device)
    abs_dot_max = torch.zeros(batch, dtype=torch.float64, device=device)
    chunk = max(1, max_chunk_elements // max(batch, 1))
    for begin in range(0, vocab, chunk):
        w = weight[begin : begin + chunk].double()
        logits = h @ w.T  # [B, c]
        abs_dot_max = torch.maximum(abs_dot_max, (h.abs() @ w.abs().T).amax(dim=1))
        vocab_index = torch.arange(begin, begin + w.shape[0], device=device)
        for s in range(num_samples):
            g = gumbel_noise(seeds[:, None], offsets[:, None], streams[:, None], s, vocab_index)
            scores = torch.where(greedy[:, None], logits, logits * inv_t[:, None] + g.double())
            chunk_best, chunk_arg = scores.max(dim=1)
            if scores.shape[1] > 1:
                chunk_second = scores.scatter(1, chunk_arg[:, None], -torch.inf).amax(dim=1)
            else:
                chunk_second = torch.full_like(chunk_best, -torch.inf)
            # Earlier chunks hold smaller indices, so they keep exact ties.
            wins = chunk_best > best[:, s]
            second[:, s] = torch.maximum(
                torch.minimum(best[:, s], chunk_best), torch.maximum(second[:, s], chunk_second)
            )
            tokens[:, s] = torch.where(wins, chunk_arg + begin, tokens[:, s])
            best[:, s] = torch.where(wins, chunk_best, best[:, s])
    tolerance = rtol * (abs_dot_max * inv_t + 1.0)
    return ReferenceSample(tokens, best - second, tolerance)
