"""Float64 reference sampler for tests (CPU or CUDA tensors).

Computes the same Gumbel-Max sample as ``flashsampling.sample`` (every sampling control
included: biases, allowed-token mask, vocab_start, per-row and greedy temperatures,
log-probabilities) with the logits, biases and perturbed scores in float64 and the *same*
fp32 noise (noise.py), so the op's tokens must equal the reference's except where the
top-2 perturbed scores are closer than the op's fp32 rounding: :class:`ReferenceSample`
reports that gap and a tolerance. Top-k / top-p / min-p (:func:`reference_truncation`) and
sampling without replacement (:func:`reference_sample_without_replacement`) are computed
from the semantics, independently of truncation.py, and report how near their boundary is.
"""

from __future__ import annotations

import math
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
    # float64 [B]: how far the top_k/top_p/min_p boundary is from moving, in the units of
    # `tolerance` (a row below its tolerance may truncate differently in fp32); inf untruncated.
    boundary_gap: Tensor


class ReferenceTruncation(NamedTuple):
    survivors: Tensor  # bool [B, V]: the allowed tokens that survive top_k, top_p and min_p
    boundary_gap: Tensor  # float64 [B], as ReferenceSample.boundary_gap


class ReferenceTopK(NamedTuple):
    tokens: Tensor  # int64 [B, k]: the tokens of the k best perturbed scores, best first
    gap: Tensor  # float64 [B]: smallest difference of consecutive scores among the best k + 1
    tolerance: Tensor  # float64 [B], as ReferenceSample.tolerance
    boundary_gap: Tensor  # float64 [B], as ReferenceSample.boundary_gap


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


class ReferenceLogitTransform(NamedTuple):
    """The model-side transforms and penalties of flashsampling_cuda/penalties.py in float64,
    with dense tables (a reference: [B, V] memory)."""

    scale: float
    softcap: float | None
    repetition: Tensor  # [B] float64, 1: off
    frequency: Tensor  # [B] float64
    presence: Tensor  # [B] float64
    seen: Tensor  # [B, V] bool: in the prompt or the output (local columns)
    counts: Tensor  # [B, V] float64: count among the output tokens


def reference_logit_transform(batch: int, vocab: int, *, logit_scale: float = 1.0, logit_softcap: float | None = None,
                              repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
                              prompt_token_ids=None, output_token_ids=None, vocab_start: int = 0,
                              device="cpu") -> ReferenceLogitTransform:
    """The arguments of :func:`flashsampling_cuda.sample` of those names as float64 tables:
    penalties as floats or [B] tensors (None: off), token ids as [B, L] int tensors or lists of
    lists (negative: padding; global ids, ``vocab_start`` the id of column 0)."""

    def rows(value, off):
        if value is None:
            value = off
        return torch.as_tensor(value, dtype=torch.float64, device=device).expand(batch).clone()

    seen = torch.zeros((batch, vocab), dtype=torch.bool, device=device)
    counts = torch.zeros((batch, vocab), dtype=torch.float64, device=device)
    for ids, is_output in ((prompt_token_ids, False), (output_token_ids, True)):
        if ids is None:
            continue
        for b, row in enumerate(ids.tolist() if isinstance(ids, Tensor) else ids):
            for token in row:
                if token >= 0 and 0 <= token - vocab_start < vocab:
                    seen[b, token - vocab_start] = True
                    counts[b, token - vocab_start] += float(is_output)
    return ReferenceLogitTransform(float(logit_scale), logit_softcap, rows(repetition_penalty, 1.0),
                                   rows(frequency_penalty, 0.0), rows(presence_penalty, 0.0), seen, counts)


def _transformed_chunk(h: Tensor, weight: Tensor, begin: int, end: int, logit_bias: Tensor | None,
                       sparse: tuple[Tensor, Tensor] | None, vocab_start: int,
                       transform: ReferenceLogitTransform | None = None) -> tuple[Tensor, Tensor]:
    """(x, magnitude), float64 [B, end - begin]: the transformed logits of local vocabulary
    [begin, end) for float64 hidden h [B, D] (logit, its model-side transforms, + logit_bias +
    the sparse values of the id, then the penalties) and their fp32 error scale, sum_d |w h| +
    |biases| carried through the transforms."""
    device = h.device
    w = weight[begin:end].to(device, torch.float64)
    x = h @ w.T
    magnitude = h.abs() @ w.abs().T
    if transform is not None:
        x = x * transform.scale
        magnitude = magnitude * transform.scale
        if transform.softcap is not None:  # tanh' <= 1: errors do not grow
            x = transform.softcap * torch.tanh(x / transform.softcap)
    if logit_bias is not None:
        bias = logit_bias[begin:end].to(device, torch.float64)
        x = x + bias
        magnitude = magnitude + bias.abs()
    if sparse is not None:
        ids, values = sparse
        local = ids - vocab_start - begin
        hit = (local >= 0) & (local < end - begin)
        row_of = torch.arange(h.shape[0], device=device)[:, None].expand_as(ids)
        x = x.index_put((row_of[hit], local[hit]), values[hit], accumulate=True)
        magnitude = magnitude.index_put((row_of[hit], local[hit]), values[hit].abs(), accumulate=True)
    if transform is not None:
        seen, r, q = _penalty_terms(transform, begin, end, device)
        x = reference_penalized(x, transform, begin)
        magnitude = torch.where(seen, magnitude * torch.maximum(r, 1 / r), magnitude) + q.abs()
    return x, magnitude


def _penalty_terms(transform: ReferenceLogitTransform, begin: int, end: int,
                   device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(seen [B, W], repetition [B, 1], q = frequency * count + presence * [count > 0] [B, W]) of
    columns [begin, end)."""
    seen = transform.seen[:, begin:end].to(device)
    counts = transform.counts[:, begin:end].to(device)
    q = transform.frequency.to(device)[:, None] * counts + transform.presence.to(device)[:, None] * (counts > 0)
    return seen, transform.repetition.to(device)[:, None], q


def reference_penalized(x: Tensor, transform: ReferenceLogitTransform, begin: int = 0) -> Tensor:
    """Step 3 of the rule (flashsampling_cuda/penalties.py), the penalties, in float64 on ``x
    [B, W]`` (columns ``begin ..`` of the transform's tables): a seen token's ``x`` divided by the
    repetition penalty where positive, multiplied where not; then ``- q``."""
    seen, r, q = _penalty_terms(transform, begin, begin + x.shape[1], x.device)
    return torch.where(seen, torch.where(x > 0, x / r, x * r), x) - q


def _row_params(temperature, seed, offset, batch: int, device: torch.device) -> tuple[Tensor, ...]:
    """(greedy bool, 1 / T float64 (1 for greedy rows), seed, offset, noise stream int64),
    each [B]: a [B] seed is per row (stream 0), otherwise the stream is the batch row."""
    temps = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    greedy = temps == 0
    seeds, per_row_seed = _per_row(seed, batch, device)
    offsets, _ = _per_row(offset, batch, device)
    streams = torch.arange(batch, device=device) * (0 if per_row_seed else 1)
    return greedy, torch.where(greedy, 1.0, 1.0 / temps), seeds, offsets, streams


def _truncated_mask(hidden, weight, temperature, logit_bias, sparse_logit_bias, allowed_mask, vocab_start,
                    top_k, top_p, min_p, logit_transform=None,
                    truncation_order="top_k_first") -> tuple[Tensor | None, Tensor]:
    """(allowed_mask restricted to the survivors of :func:`reference_truncation`,
    boundary_gap [B]); the mask as given and an inf gap when nothing is truncated."""
    if top_k is None and top_p is None and min_p is None:
        return allowed_mask, torch.full((hidden.shape[0],), torch.inf, dtype=torch.float64, device=hidden.device)
    return reference_truncation(hidden, weight, temperature, logit_bias=logit_bias,
                                sparse_logit_bias=sparse_logit_bias, allowed_mask=allowed_mask,
                                vocab_start=vocab_start, top_k=top_k, top_p=top_p, min_p=min_p,
                                logit_transform=logit_transform, truncation_order=truncation_order)


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
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    logit_transform: ReferenceLogitTransform | None = None,
    truncation_order: str = "top_k_first",
) -> ReferenceSample:
    """Reference of ``flashsampling.sample(hidden, weight, temperature=..., seed=...,
    offset=..., num_samples=..., <controls>, return_logprobs=True)`` with an explicit seed.
    With ``top_k``/``top_p``/``min_p`` the sample is over the survivors of
    :func:`reference_truncation` (and the log-probabilities over them).

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
        logit_transform: the model-side transforms and penalties
            (:func:`reference_logit_transform`), or None.
    """
    batch, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    allowed_mask, boundary_gap = _truncated_mask(hidden, weight, temperature, logit_bias, sparse_logit_bias,
                                                 allowed_mask, vocab_start, top_k, top_p, min_p, logit_transform,
                                                 truncation_order)
    h = hidden.double()
    greedy, inv_t, seeds, offsets, streams = _row_params(temperature, seed, offset, batch, device)
    sparse = _sparse_pair(sparse_logit_bias, batch, device)

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
        end = min(begin + chunk, vocab)
        x, magnitude = _transformed_chunk(h, weight, begin, end, logit_bias, sparse, vocab_start, logit_transform)
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
    return ReferenceSample(tokens, gap, tolerance, best, logprobs, logsumexp, boundary_gap)


def _row_values(x, batch: int, off) -> list:
    """A scalar or 0-d / [B] tensor truncation parameter as B Python numbers (None: off)."""
    if x is None:
        return [off] * batch
    if isinstance(x, Tensor):
        return x.cpu().expand(batch).tolist()
    return [x] * batch


def reference_truncation(
    hidden: Tensor,
    weight: Tensor,
    temperature: float | Tensor = 1.0,
    *,
    logit_bias: Tensor | None = None,
    sparse_logit_bias=None,
    allowed_mask: Tensor | None = None,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    logit_transform: ReferenceLogitTransform | None = None,
    truncation_order: str = "top_k_first",
) -> ReferenceTruncation:
    """The survivors of top-k, top-p and min-p in float64, row by row, read off the
    semantics: y = x / T (x for greedy rows, x as in :func:`reference_sample`) of the
    allowed tokens, in descending order with ties to the smaller index; keep the first
    ``top_k`` (``<= 0``: all); softmax over those; keep the shortest prefix whose
    probabilities add up to ``top_p`` (the first always); drop those whose probability is
    below ``min_p`` times the first's. Arguments as in :func:`reference_sample`;
    ``truncation_order`` as in ``flashsampling_cuda.sample``: top_p's softmax over the top_k
    survivors ("top_k_first"), over those that also pass min_p ("min_p_first") or over all
    ("joint").

    ``boundary_gap`` bounds how far the fp32 inputs may move before the set changes: if
    every y moves by at most d, a difference of two y by 2d, a probability by a factor
    exp(2d), so the gap is the smallest of (y_k - y_k+1) / 2 at the top_k cut,
    |sum - top_p| / (2 max(sum, top_p)) for the masses ahead of the last kept and first
    dropped tokens, |log(p_i / p_0) - log(min_p)| / 2 for the min_p cut (in units of y).
    """
    batch, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    x, _ = _transformed_chunk(hidden.double(), weight, 0, vocab, logit_bias,
                              _sparse_pair(sparse_logit_bias, batch, device), vocab_start, logit_transform)
    temps = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    y = torch.where(temps[:, None] == 0, x, x / temps[:, None]).cpu()
    allowed = torch.ones((batch, vocab), dtype=torch.bool)
    if allowed_mask is not None:
        allowed = _allowed_chunk(allowed_mask.to(device), 0, vocab).cpu()
    survivors = torch.zeros((batch, vocab), dtype=torch.bool)
    boundary_gap = torch.full((batch,), math.inf, dtype=torch.float64)
    rows = zip(_row_values(top_k, batch, -1), _row_values(top_p, batch, 1.0), _row_values(min_p, batch, 0.0))
    for b, (k, p, m) in enumerate(rows):
        ids = torch.nonzero(allowed[b] & ~y[b].isnan())[:, 0]  # ascending
        if ids.numel() == 0:
            continue
        ys, rank = torch.sort(y[b, ids], descending=True, stable=True)  # ties keep the smaller index first
        order = ids[rank]
        gaps = []
        n = order.numel() if k <= 0 else min(k, order.numel())
        if n < order.numel():
            gaps.append((ys[n - 1] - ys[n]).item() / 2)
        log_ratio = ys - ys[0]  # log(p_i / p_0): the same whatever the normalisation
        n_min_p = order.numel()
        if m > 0:
            n_min_p = max(1, int((log_ratio[:n] >= math.log(m)).sum()))
            gaps += [abs(log_ratio[i].item() - math.log(m)) / 2 for i in (n_min_p - 1, n_min_p)
                     if 0 < i < min(n, log_ratio.numel())]
        if p < 1:
            # top_p's probabilities: over the top_k survivors, those that also pass min_p, or all
            base = {"top_k_first": n, "min_p_first": min(n, n_min_p), "joint": order.numel()}[truncation_order]
            probs = torch.softmax(ys[:base], dim=0)
            ahead = torch.cumsum(probs, dim=0) - probs  # mass before each token
            n_top_p = max(1, int((ahead < p).sum()))
            gaps += [abs(ahead[i].item() - p) / (2 * max(ahead[i].item(), p)) for i in (n_top_p - 1, n_top_p)
                     if 0 < i < ahead.numel()]
            n = min(n, n_top_p)
        n = min(n, n_min_p)
        survivors[b, order[:n]] = True
        boundary_gap[b] = min(gaps, default=math.inf)
    return ReferenceTruncation(survivors.to(device), boundary_gap.to(device))


def reference_sample_without_replacement(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    temperature: float | Tensor = 1.0,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    *,
    logit_bias: Tensor | None = None,
    sparse_logit_bias=None,
    allowed_mask: Tensor | None = None,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    rtol: float = 1e-5,
) -> ReferenceTopK:
    """Reference of ``flashsampling.sample_without_replacement``: the allowed tokens
    (survivors of :func:`reference_truncation` when truncated) of the ``k`` largest float64
    scores x / T + g (x for greedy rows) of draw 0, best first, ties to the smaller index.
    Excluded tokens rank last (score -inf), so a row with fewer than k allowed tokens has
    excluded ones past them. Arguments as in :func:`reference_sample`."""
    batch, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    allowed_mask, boundary_gap = _truncated_mask(hidden, weight, temperature, logit_bias, sparse_logit_bias,
                                                 allowed_mask, vocab_start, top_k, top_p, min_p)
    x, magnitude = _transformed_chunk(hidden.double(), weight, 0, vocab, logit_bias,
                                      _sparse_pair(sparse_logit_bias, batch, device), vocab_start)
    greedy, inv_t, seeds, offsets, streams = _row_params(temperature, seed, offset, batch, device)
    g = gumbel_noise(seeds[:, None], offsets[:, None], streams[:, None], 0,
                     torch.arange(vocab_start, vocab_start + vocab, device=device))
    scores = torch.where(greedy[:, None], x, x * inv_t[:, None] + g.double())
    if allowed_mask is not None:
        scores = torch.where(_allowed_chunk(allowed_mask.to(device), 0, vocab), scores, -torch.inf)
    best, order = torch.sort(-scores, dim=1, stable=True)  # score descending, ties to the smaller index
    best = -best[:, : k + 1]
    steps = torch.cat([best[:, :-1] - best[:, 1:], torch.full_like(best[:, :1], torch.inf)], dim=1)
    gap = torch.where(torch.isnan(steps), torch.inf, steps).amin(dim=1)  # NaN: two excluded tokens
    tolerance = rtol * (magnitude.amax(dim=1) * inv_t + 1.0)
    return ReferenceTopK(order[:, :k] + vocab_start, gap, tolerance, boundary_gap)


class ReferenceSpeculative(NamedTuple):
    tokens: Tensor  # int64 [B, n + 1]
    num_accepted: Tensor  # int64 [B]
    margin: Tensor  # float64 [B]: the smallest |u - acceptance probability| and Gumbel top-2 gap a row's path met


def reference_speculative_sample(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, draft_probs=None, *,
                                 temperature: float | Tensor = 1.0, seed: int | Tensor = 0, offset: int | Tensor = 0,
                                 logit_bias: Tensor | None = None, allowed_mask: Tensor | None = None,
                                 top_k=None, top_p=None, min_p=None, vocab_start: int = 0) -> ReferenceSpeculative:
    """Reference of ``flashsampling_cuda.speculative_sample`` (its module docstring has the rule
    and the noise) in float64, row by row and position by position; ``margin`` bounds how far
    fp32 rounding may move a decision (compare rows whose margin is not tiny)."""
    from .noise import uniform_noise_reference as uniform_noise

    batch, positions, dim = hidden.shape
    n = positions - 1
    vocab = weight.shape[0]
    device = hidden.device
    greedy, inv_t, seeds, offsets, streams = _row_params(temperature, seed, offset, batch, device)
    flat = hidden.reshape(batch * positions, dim)
    x, _ = _transformed_chunk(flat.double(), weight, 0, vocab, logit_bias, None, vocab_start)
    x = x.reshape(batch, positions, vocab)
    temps = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    flat_mask = None if allowed_mask is None else allowed_mask.repeat_interleave(positions, dim=0)
    rows_t = temps[:, None].expand(batch, positions).reshape(-1)
    rep = [v.expand(batch)[:, None].expand(batch, positions).reshape(-1) if isinstance(v, Tensor) else v
           for v in (top_k, top_p, min_p)]
    truncated = top_k is not None or top_p is not None or min_p is not None
    if truncated:
        keep = reference_truncation(flat, weight, rows_t, logit_bias=logit_bias, allowed_mask=flat_mask,
                                    vocab_start=vocab_start, top_k=rep[0], top_p=rep[1], min_p=rep[2]).survivors
    else:
        keep = torch.ones((batch * positions, vocab), dtype=torch.bool, device=device)
        if flat_mask is not None:
            keep = _allowed_chunk(flat_mask.to(device), 0, vocab)
    keep = keep.reshape(batch, positions, vocab)
    y = torch.where(greedy[:, None, None], x, x * inv_t[:, None, None])
    logp = torch.log_softmax(y.masked_fill(~keep, -torch.inf), dim=2)
    tokens = torch.full((batch, positions), -1, dtype=torch.int64)
    accepted_count = torch.zeros(batch, dtype=torch.int64)
    margin = torch.full((batch,), math.inf, dtype=torch.float64)
    ids = torch.arange(vocab, device=device)
    for b in range(batch):
        for j in range(positions):
            candidates = keep[b, j].clone()
            scores = None
            d = int(draft_token_ids[b, j]) - vocab_start if j < n else -1
            inside = 0 <= d < vocab
            if j < n and draft_probs is not None:  # sampled drafts: the uniform, then the residual
                if greedy[b]:
                    target = int(torch.where(candidates, y[b, j], -torch.inf).argmax())
                    if inside and d == target:
                        tokens[b, j] = d + vocab_start
                        accepted_count[b] += 1
                        continue
                else:
                    p = float(logp[b, j, d].exp()) if inside else 0.0
                    qd = float(draft_probs[b, j, d]) if inside else 0.0
                    a = (1.0 if qd == 0 else min(1.0, p / qd)) if inside else 0.0
                    u = float(uniform_noise(int(seeds[b]), int(offsets[b]), int(streams[b]), j, 2**32 - 1))
                    margin[b] = min(margin[b], abs(u - a))
                    if u < a:
                        tokens[b, j] = d + vocab_start
                        accepted_count[b] += 1
                        continue
                    residual = (logp[b, j].exp() - draft_probs[b, j].to(device, torch.float64)).clamp(min=0)
                    if bool((residual > 0).any()):  # (no mass: the target's own sample)
                        candidates = residual > 0
                        scores = torch.log(residual)
            # The position's token t_j (the residual's sample after a rejected sampled draft).
            g = gumbel_noise(int(seeds[b]), int(offsets[b]) + j, int(streams[b]), 0, ids + vocab_start).double()
            if greedy[b]:
                s = x[b, j]
            elif scores is not None:
                s = scores + g
            else:
                s = x[b, j] * inv_t[b] + g
            s = torch.where(candidates, s, -torch.inf)
            if not bool(candidates.any()):  # a row that allows nothing emits -1 and accepts nothing
                break
            top2 = torch.topk(s, 2).values
            margin[b] = min(margin[b], float(top2[0] - top2[1]))
            tokens[b, j] = int(s.argmax()) + vocab_start
            if j < n and draft_probs is None and inside and int(s.argmax()) == d:
                accepted_count[b] += 1  # one-hot drafts: accepted while t_j is the draft
                continue
            break
    return ReferenceSpeculative(tokens.to(device), accepted_count.to(device), margin.to(device))
