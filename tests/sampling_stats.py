"""Problems and statistics shared by the CPU and GPU sampling tests."""

import math

import torch
from scipy.stats import chi2

from flashsampling_cuda import pack_allowed_mask


def make_problem(batch, vocab, dim, *, dtype=torch.float32, logit_std=2.0, seed=0, same_rows=False):
    """hidden [B, D] and weight [V, D] whose logits have about `logit_std` spread."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1 if same_rows else batch, dim, generator=g).expand(batch, dim)
    weight = torch.randn(vocab, dim, generator=g) * (logit_std / math.sqrt(dim))
    return hidden.to(dtype).contiguous(), weight.to(dtype)


def problem(batch, vocab, dim, device, *, logit_std=3.0, seed=0, dtype=torch.bfloat16):
    """make_problem on `device`, bfloat16 by default (what the CUDA kernel takes)."""
    hidden, weight = make_problem(batch, vocab, dim, dtype=dtype, logit_std=logit_std, seed=seed)
    return hidden.to(device), weight.to(device)


def random_controls(batch, vocab, device, *, vocab_start=0, seed=0, density=0.3, bias_scale=2.0, boost=5.0):
    """Every control at once: logit_bias [V], sparse (ids, values) [B, 6] with a repeated
    id (each of its two values raised by `boost`, so it often wins), -1 padding and ids of
    other shards, a packed mask allowing ~density of the tokens (at least one per row) and
    its bool [B, V] form."""
    g = torch.Generator().manual_seed(seed)
    logit_bias = torch.randn(vocab, generator=g) * bias_scale
    ids = vocab_start + torch.randint(0, vocab, (batch, 6), generator=g)
    ids[:, 1] = ids[:, 0]  # a repeated id: its values add up
    ids[:, 3] = -1  # padding
    ids[:, 4] = vocab_start + vocab + 5  # the next shard's
    if vocab_start > 0:
        ids[:, 5] = vocab_start - 1  # the previous shard's
    values = torch.randn(batch, 6, generator=g) * 3.0
    values[:, :2] += boost
    allowed = torch.rand(batch, vocab, generator=g) < density
    allowed[torch.arange(batch), torch.randint(0, vocab, (batch,), generator=g)] = True
    return dict(
        logit_bias=logit_bias.to(device),
        sparse_logit_bias=(ids.to(device), values.to(device)),
        allowed_mask=pack_allowed_mask(allowed).to(device),
        allowed_bool=allowed.to(device),
    )


def softmax_rows(hidden, weight, temperature):
    """Exact categorical distribution of every row: softmax(logits / T) in float64."""
    temps = torch.as_tensor(temperature, dtype=torch.float64).expand(hidden.shape[0])
    return torch.softmax((hidden.double() @ weight.double().T) / temps[:, None], dim=1)


def transformed_probs(hidden, weight, temperature, *, logit_bias=None, sparse=None, allowed=None, vocab_start=0):
    """softmax(x / T) over the allowed tokens in float64 ([B, V]), x = logit + biases."""
    batch = hidden.shape[0]
    x = hidden.double().cpu() @ weight.double().cpu().T
    if logit_bias is not None:
        x = x + logit_bias.double().cpu()
    if sparse is not None:
        ids, values = (t.cpu() for t in sparse)
        local = ids - vocab_start
        hit = (local >= 0) & (local < x.shape[1])
        rows = torch.arange(batch)[:, None].expand_as(ids)
        x = x.index_put((rows[hit], local[hit]), values[hit].double(), accumulate=True)
    temps = torch.as_tensor(temperature, dtype=torch.float64).cpu().expand(batch)
    y = x / temps[:, None]
    if allowed is not None:
        y = y.masked_fill(~allowed.cpu(), -math.inf)
    return torch.softmax(y, dim=1)


def integer_problem(batch, vocab, dim, seed=0):
    """Small-integer data: fp32 logits are exact whatever the summation order."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-3, 4, (batch, dim), generator=g).float()
    weight = torch.randint(-3, 4, (vocab, dim), generator=g).float()
    return hidden, weight


def chi_square(tokens: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0):
    """Pearson chi-square statistic and degrees of freedom of `tokens` (any shape) drawn
    from the categorical `probs` [V]. Bins expected to hold fewer than `min_expected`
    draws are pooled into one bin (merged into the smallest other bin if still small)."""
    vocab = probs.numel()
    tokens = tokens.flatten().cpu()
    assert tokens.min() >= 0 and tokens.max() < vocab, "token out of range"
    observed = torch.bincount(tokens, minlength=vocab).double()
    expected = probs.double().cpu() * tokens.numel()
    large = expected >= min_expected
    obs, exp = observed[large], expected[large]
    small_obs, small_exp = observed[~large].sum(), expected[~large].sum()
    if small_exp > 0:
        if small_exp >= min_expected or exp.numel() == 0:
            obs = torch.cat([obs, small_obs[None]])
            exp = torch.cat([exp, small_exp[None]])
        else:
            i = exp.argmin()
            obs[i] += small_obs
            exp[i] += small_exp
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return stat, obs.numel() - 1


def chi_square_pvalue(tokens_per_row, probs_per_row) -> float:
    """p-value of the summed chi-square over independent rows (each row: tokens, probs)."""
    stat, dof = 0.0, 0
    for tokens, probs in zip(tokens_per_row, probs_per_row):
        s, d = chi_square(tokens, probs)
        stat, dof = stat + s, dof + d
    return float(chi2.sf(stat, dof))


def pathwise_mismatches(tokens: torch.Tensor, ref) -> tuple[int, int]:
    """(all mismatches, mismatches not explained by a near tie) of `tokens` against a
    flashsampling_cuda.reference.ReferenceSample: a near tie of the top-2 scores, or a
    top_k/top_p/min_p boundary within rounding (the row may truncate differently)."""
    differ = tokens.cpu() != ref.tokens.cpu()
    tolerance = ref.tolerance.cpu()[:, None]
    near_tie = (ref.gap.cpu() < tolerance) | (ref.boundary_gap.cpu()[:, None] < tolerance)
    return int(differ.sum()), int((differ & ~near_tie).sum())


def assert_matches_reference(tokens, ref):
    """Pathwise: every token differing from the reference's is a near tie, and at most 1%."""
    mismatches, unexplained = pathwise_mismatches(tokens, ref)
    print(f"mismatches {mismatches} / {tokens.numel()}, outside near ties {unexplained}")
    assert unexplained == 0
    assert mismatches <= max(1, tokens.numel() // 100)


def assert_truncated_distribution(tokens, hidden, weight, temperature, **truncation):
    """Tokens [B, S] of a truncated call: every one a survivor of the float64 reference
    (flashsampling_cuda.reference.reference_truncation), and chi-square against the renormalised
    distribution over them. The parameters must keep every boundary clear of rounding."""
    from flashsampling_cuda.reference import reference_truncation

    ref = reference_truncation(hidden, weight, temperature, **truncation)
    assert (ref.boundary_gap > 1e-4).all(), "a boundary within rounding: pick other parameters"
    survivors = ref.survivors.cpu()
    assert survivors.gather(1, tokens).all(), "a truncated token was sampled"
    p = chi_square_pvalue(tokens, transformed_probs(hidden, weight, temperature, allowed=survivors))
    assert p > 1e-3, f"chi-square p = {p:.2e}"
