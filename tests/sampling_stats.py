"""Problems and statistics shared by the CPU and GPU sampling tests."""

import math

import torch
from scipy.stats import chi2


def make_problem(batch, vocab, dim, *, dtype=torch.float32, logit_std=2.0, seed=0, same_rows=False):
    """hidden [B, D] and weight [V, D] whose logits have about `logit_std` spread."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1 if same_rows else batch, dim, generator=g).expand(batch, dim)
    weight = torch.randn(vocab, dim, generator=g) * (logit_std / math.sqrt(dim))
    return hidden.to(dtype).contiguous(), weight.to(dtype)


def softmax_rows(hidden, weight, temperature):
    """Exact categorical distribution of every row: softmax(logits / T) in float64."""
    temps = torch.as_tensor(temperature, dtype=torch.float64).expand(hidden.shape[0])
    return torch.softmax((hidden.double() @ weight.double().T) / temps[:, None], dim=1)


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
    flashsampling_cuda.reference.ReferenceSample."""
    differ = tokens.cpu() != ref.tokens.cpu()
    near_tie = ref.gap.cpu() < ref.tolerance.cpu()[:, None]
    return int(differ.sum()), int((differ & ~near_tie).sum())
