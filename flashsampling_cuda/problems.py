"""Synthetic LM-head problems for tests and benchmarks, in two logit regimes.

- *flat*: random weights and ``hidden ~ N(0, I)``: every logit about ``N(0, 1)``, so a row's
  probability is spread over the whole vocabulary (thousands of top-p survivors): the worst
  case for truncation.
- *llm*: a Zipf head over a Gaussian bulk, as trained models produce: with weight rows of norm
  about 1, ``h_b = sum_{r=1..32} (c_b - s_b ln r) W[t_{b,r}] + 2.5 z_b`` (distinct random ids
  ``t_{b,r}``, ``c_b ~ U(12, 22)``, ``s_b ~ U(1, 3)``, ``z_b ~ N(0, I)``). At T = 0.6-1 its rows
  have a median entropy of about 0.5-1.4 nats and a median of 2-5 top_p = 0.9 survivors, with a
  tail of rows holding hundreds to thousands.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["REGIMES", "lm_head_weight", "hidden_states", "row_statistics"]

REGIMES = ("flat", "llm")


def lm_head_weight(vocab: int, dim: int, *, dtype=torch.bfloat16, device="cuda", seed: int = 0) -> Tensor:
    """``[V, D]`` weight with rows of norm about 1 (``N(0, 1 / D)`` entries)."""
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(vocab, dim, device=device, generator=g) * dim**-0.5).to(dtype)


def hidden_states(weight: Tensor, batch: int, regime: str, *, seed: int = 0, head: int = 32) -> Tensor:
    """``[B, D]`` hidden states of ``weight.dtype`` whose logits ``hidden @ weight.T`` follow
    ``regime`` (module docstring)."""
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    vocab, dim = weight.shape
    device = weight.device
    # A stream of its own: the weight's seed would give hidden = a multiple of weight row 0.
    g = torch.Generator(device=device).manual_seed(seed + 0x5EED)
    if regime == "flat":
        return torch.randn(batch, dim, device=device, generator=g).to(weight.dtype)
    ids = torch.argsort(torch.rand(batch, vocab, device=device, generator=g), dim=1)[:, :head]
    c = 12.0 + 10.0 * torch.rand(batch, 1, device=device, generator=g)
    s = 1.0 + 2.0 * torch.rand(batch, 1, device=device, generator=g)
    coefficients = c - s * torch.log(torch.arange(1, head + 1, device=device, dtype=torch.float32))
    h = torch.einsum("br,brd->bd", coefficients, weight[ids].float())
    h = h + 2.5 * torch.randn(batch, dim, device=device, generator=g)
    return h.to(weight.dtype)


def row_statistics(logits: Tensor, temperature: float, top_p: float = 0.9) -> dict:
    """Median and 90th percentile over the rows of the entropy (nats) of
    ``softmax(logits / T)`` and of the number of ``top_p`` survivors (float64)."""
    y = logits.double() / temperature
    logp = torch.log_softmax(y, dim=1)
    p = logp.exp()
    entropy = -(p * logp).sum(dim=1)
    sorted_p = p.sort(dim=1, descending=True).values
    before = torch.cumsum(sorted_p, dim=1) - sorted_p
    survivors = (before < top_p).sum(dim=1).double()

    def quantiles(t: Tensor) -> tuple[float, float]:
        return float(t.median()), float(torch.quantile(t, 0.9))

    (e50, e90), (s50, s90) = quantiles(entropy), quantiles(survivors)
    return {"entropy_median": e50, "entropy_p90": e90, "top_p_survivors_median": s50,
            "top_p_survivors_p90": s90, "statistics_top_p": top_p, "statistics_temperature": temperature}
