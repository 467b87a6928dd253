"""Float64 reference sampler for tests (CPU or CUDA tensors).

Computes the same Gumbel-Max sample as ``flashsampling.sample`` (every sampling control
included: biases, allowed-token mask, vocab_start, per-row and greedy temperatures,
log-probabilities) with the logits, biases and perturbed scores in float64 and the *same*
fp32 noise (noise.py), so the op's tokens must equal the reference's except where the
top-2 perturbed scores are closer than the op's fp32 rounding: :class:`ReferenceSample`
reports that gap and a tolerance.
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
    scores: Tensor  # float64 [B, num_samples]: the winning score (-inf: no candidate)
    logprobs: Tensor  # float64 [B, num_samples]: y[token] - logsumexp(y) (NaN: no candidate)
    logsumexp: Tensor  # float64 [B]: logsumexp of y = x / T (x for greedy rows) over the allowed tokens


def _per_row(x: int | Tensor, batch: int, device: torch.device) -> tuple[Tensor, bool]:
    """Seed-like argument as an int64 [B] tensor, and whether it was given per row."""
    t = as_int64_tensor(x, device)
    return t.expand(batch), t.dim() == 1


def _sparse_pair(sparse_logit_bias, batch: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """(ids int64 [B, K], values float64 [B, K]) of a pair of tensors or a list of B dicts."""
    if sparse_logit_bias is None:
        return None
    if len(sparse_logit_bias) == 2 and all(isinstance(t, Tensor) for t in sparse_logit_bias):
        ids, values = sparse_logit_bias
        return ids.to(device, torch.int64), values.to(device, torch.float64)
    assert len(sparse_logit_bias) == batch, "one dict per row"
    width = max((len(d) for d in sparse_logit_bias), default=0)
    ids = torch.full((batch, width), -1, dtype=torch.int64)
    values = torch.zeros(batch, width, dtype=torch.float64)
    for b, d in enumerate(sparse_logit_bias):
        ids[b, : len(d)] = torch.tensor(list(d.keys()), dtype=torch.int64)
        values[b, : len(d)] = torch.tensor(list(d.values()), dtype=torch.float64)
    return ids.to(device), values.to(device)


def _allowed_chunk(allowed_mask: Tensor, begin: int, end: int) -> Tensor:
    """bool [B, end - begin]: the allowed tokens of local vocabulary [begin, end) of a bool
    [B, V] mask or an int32 [B, ceil(V / 32)] bitmask (bit v & 31 of word v >> 5)."""
    if allowed_mask.dtype == torch.bool:
        return allowed_mask[:, begin:end]
    v = torch.arange(begin, end, device=allowed_mask.device)
    words = allowed_mask.to(torch.int64)[:, v >> 5]
    return ((words >> (v & 31)) & 1).bool()


def reference_sample(
    hidden: Tensor,
    weight: Tensor,
    temperature: float | Tensor = 1.0,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    num_samples: int = 1,
    *,
    logit_bias: Tensor | None = None,
    sparse_logit_bias=None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    vocab_start: int = 0,
    rtol: float = 1e-5,
    max_chunk_elements: int = 1 << 21,
) -> ReferenceSample:
    """Reference of ``flashsampling.sample(hidden, weight, temperature=..., seed=...,
    offset=..., num_samples=..., <controls>, return_logprobs=True)`` with an explicit seed.

    Args:
        hidden: [B, D], weight: [V, D] (any float dtype; used as float64).
        temperature: float or [B] tensor; 0 means greedy (score = x, no noise).
        seed, offset: int, 0-d or [B] int64 tensor. A [B] seed is per row (noise
            stream 0); otherwise the stream is the batch row.
        logit_bias, sparse_logit_bias, allowed_mask, empty_mask_token, vocab_start: as in
            ``flashsampling_cuda.sample``: x = logit + logit_bias[v] + the sparse values
            whose id is vocab_start + v (in float64), masked tokens excluded, noise keyed
            and tokens reported by the global index vocab_start + v. A row whose mask
            allows nothing gets empty_mask_token (-1 when None), score -inf, logprob NaN
            and logsumexp -inf.
        rtol: relative fp32 error budget of a score; tolerance per row is
            rtol * (max_v (sum_d |w[v, d] h[d]| + |biases of v|) / T + 1) (T = 1 for greedy rows).
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
    sparse = _sparse_pair(sparse_logit_bias, batch, device)
    rows = torch.arange(batch, device=device)

    shape = (batch, num_samples)
    best = torch.full(shape, -torch.inf, dtype=torch.float64, device=device)
    second = best.clone()
    best_y = torch.full(shape, torch.nan, dtype=torch.float64, device=device)
    tokens = torch.full(shape, -1, dtype=torch.int64, device=device)
    abs_dot_max = torch.zeros(batch, dtype=torch.float64, device=device)
    lse_max = torch.full((batch,), -torch.inf, dtype=torch.float64, device=device)
    lse_sum = torch.zeros(batch, dtype=torch.float64, device=device)
    any_allowed = torch.zeros(batch, dtype=torch.bool, device=device)
    chunk = max(1, max_chunk_elements // max(batch, 1))
    for begin in range(0, vocab, chunk):
        w = weight[begin : begin + chunk].double()
        end = begin + w.shape[0]
        x = h @ w.T  # [B, c]
        magnitude = h.abs() @ w.abs().T
        if logit_bias is not None:
            bias = logit_bias[begin:end].to(device, torch.float64)
            x = x + bias
            magnitude = magnitude + bias.abs()
        if sparse is not None:
            ids, values = sparse
            local = ids - vocab_start - begin
            hit = (local >= 0) & (local < end - begin)
            row_of = rows[:, None].expand_as(ids)
            x = x.index_put((row_of[hit], local[hit]), values[hit], accumulate=True)
            magnitude = magnitude.index_put((row_of[hit], local[hit]), values[hit].abs(), accumulate=True)
        abs_dot_max = torch.maximum(abs_dot_max, magnitude.amax(dim=1))
        allowed = torch.ones_like(x, dtype=torch.bool)
        if allowed_mask is not None:
            allowed = _allowed_chunk(allowed_mask.to(device), begin, end)
        any_allowed |= allowed.any(dim=1)
        y = torch.where(allowed, x * inv_t[:, None], -torch.inf)
        chunk_max = y.amax(dim=1)
        new_max = torch.maximum(lse_max, chunk_max)
        safe_max = torch.where(torch.isfinite(new_max), new_max, 0.0)
        lse_sum = lse_sum * torch.exp(lse_max - safe_max) + torch.exp(y - safe_max[:, None]).sum(dim=1)
        lse_max = new_max
        vocab_index = torch.arange(vocab_start + begin, vocab_start + end, device=device)
        for s in range(num_samples):
            g = gumbel_noise(seeds[:, None], offsets[:, None], streams[:, None], s, vocab_index)
            scores = torch.where(greedy[:, None], x, x * inv_t[:, None] + g.double())
            scores = torch.where(allowed, scores, -torch.inf)
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
            tokens[:, s] = torch.where(wins, chunk_arg + begin + vocab_start, tokens[:, s])
            best_y[:, s] = torch.where(wins, y.gather(1, chunk_arg[:, None])[:, 0], best_y[:, s])
            best[:, s] = torch.where(wins, chunk_best, best[:, s])
    tolerance = rtol * (abs_dot_max * inv_t + 1.0)
    logsumexp = torch.where(torch.isfinite(lse_max), lse_max + torch.log(lse_sum), lse_max)
    logprobs = best_y - logsumexp[:, None]
    empty = ~any_allowed
    tokens[empty] = -1 if empty_mask_token is None else empty_mask_token
    logprobs[empty] = torch.nan
    gap = torch.where(empty[:, None], torch.inf, best - second)
    return ReferenceSample(tokens, gap, tolerance, best, logprobs, logsumexp)
