"""Grouped and online Group-Gumbel-Max (flashsampling_cuda.grouped): exact in distribution.

The vocabulary is cut into K groups (some empty: all tokens masked, or no tokens at
all), each group is summarised on its own (from its logits, or from (hidden, weight)
with the fused op) and the summaries are merged in the parallel and the online form;
the merged tokens must follow softmax over the union (chi-square), the merged log-mass
must be the union's logsumexp and the merged log-probabilities those of the tokens.
"""

import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda import grouped
from sampling_stats import chi_square_pvalue

BATCH, VOCAB, DIM = 3, 60, 32
SAMPLES = 20_000

# Group boundaries in [0, VOCAB]; a repeated boundary is a zero-width group.
SPLITS = {
    1: [0, VOCAB],
    2: [0, 17, VOCAB],
    3: [0, 1, 40, VOCAB],
    5: [0, 12, 12, 30, 31, VOCAB],  # group 1 has no tokens
    7: [0, 5, 9, 20, 33, 41, 50, VOCAB],
}
MERGES = ["parallel", "online"]


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(BATCH, DIM, generator=g)
    weight = torch.randn(VOCAB, DIM, generator=g) * (2.0 / math.sqrt(DIM))
    return hidden, weight


def allowed_tokens(bounds):
    """[B, V] bool: the whole group 2 (if any) is masked in every row; row 1 also masks
    its first group and a few scattered tokens."""
    allowed = torch.ones(BATCH, VOCAB, dtype=torch.bool)
    if len(bounds) > 3:
        allowed[:, bounds[2] : bounds[3]] = False
    if len(bounds) > 2:
        allowed[1, bounds[0] : bounds[1]] = False
    allowed[1, ::7] = False
    return allowed


def merge(kind, groups, generator):
    if kind == "parallel":
        return grouped.merge_parallel(groups, generator=generator)
    return grouped.merge_online(iter(groups), generator=generator)


def target(hidden, weight, allowed, temperature):
    y = (hidden.double() @ weight.double().T) / temperature
    return torch.log_softmax(y.masked_fill(~allowed, -math.inf), dim=1)


def check_merged(out, hidden, weight, allowed, temperature):
    logp = target(hidden, weight, allowed, temperature)
    assert out.tokens.shape == (BATCH, SAMPLES) and out.tokens.dtype == torch.int64
    assert bool(allowed.gather(1, out.tokens).all()), "a masked token was sampled"
    if int(allowed.sum(1).max()) > 1:
        p = chi_square_pvalue(out.tokens, logp.exp())
        assert p > 1e-3, f"chi-square p = {p:.2e}"
    y = (hidden.double() @ weight.double().T) / temperature
    torch.testing.assert_close(out.log_mass.double(), torch.logsumexp(y.masked_fill(~allowed, -math.inf), 1),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.token_logprobs.double(), logp.gather(1, out.tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", MERGES)
@pytest.mark.parametrize("num_groups", sorted(SPLITS))
def test_logits_groups_chi_square(num_groups, kind):
    hidden, weight = problem(num_groups)
    bounds = SPLITS[num_groups]
    allowed = allowed_tokens(bounds)
    temperature = 0.8
    logits = hidden @ weight.T
    gen = torch.Generator().manual_seed(100 + num_groups)
    groups = [
        grouped.group_sample_logits(logits[:, a:b], vocab_start=a, temperature=temperature, num_samples=SAMPLES,
                                    allowed=allowed[:, a:b], generator=gen)
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    for (a, b), g in zip(zip(bounds[:-1], bounds[1:]), groups):
        empty = ~allowed[:, a:b].any(1)
        assert torch.equal(g.log_mass == -math.inf, empty)
        assert bool((g.tokens[empty] == -1).all()) and bool(((g.tokens[~empty] >= a) & (g.tokens[~empty] < b)).all())
    check_merged(merge(kind, groups, gen), hidden, weight, allowed, temperature)


@pytest.mark.parametrize("kind", MERGES)
@pytest.mark.parametrize("num_groups", [2, 3, 5])
def test_fused_groups_chi_square(num_groups, kind):
    """(hidden, weight) groups through the fused op, all with the same seed: the noise is
    keyed by the global id, so the groups' samples are independent."""
    hidden, weight = problem(10 + num_groups)
    bounds = SPLITS[num_groups]
    allowed = allowed_tokens(bounds)
    temperature = torch.tensor([0.7, 1.0, 1.3])
    groups = [
        grouped.group_sample(hidden, weight[a:b], vocab_start=a, temperature=temperature, seed=4242,
                             num_samples=SAMPLES, allowed_mask=allowed[:, a:b])
        for a, b in zip(bounds[:-1], bounds[1:])
        if b > a  # the op needs V_k >= 1
    ]
    out = merge(kind, groups, torch.Generator().manual_seed(7))
    check_merged(out, hidden, weight, allowed, temperature[:, None].double())


@pytest.mark.parametrize("kind", MERGES)
def test_every_group_empty_gives_minus_one(kind):
    logits = torch.randn(2, 10)
    none = torch.zeros(2, 10, dtype=torch.bool)
    groups = [grouped.group_sample_logits(logits[:, :4], allowed=none[:, :4], num_samples=3),
              grouped.group_sample_logits(logits[:, 4:4], vocab_start=4, num_samples=3),
              grouped.group_sample_logits(logits[:, 4:], vocab_start=4, allowed=none[:, 4:], num_samples=3)]
    out = merge(kind, groups, None)
    assert (out.tokens == -1).all() and (out.log_mass == -math.inf).all() and out.token_logprobs.isnan().all()


def test_single_group_merge_keeps_the_group_sample():
    logits = torch.randn(4, 9)
    g = grouped.group_sample_logits(logits, vocab_start=100, num_samples=5, generator=torch.Generator().manual_seed(1))
    for kind in MERGES:
        out = merge(kind, [g], torch.Generator().manual_seed(2))
        assert torch.equal(out.tokens, g.tokens)
        torch.testing.assert_close(out.token_logprobs, g.token_logprobs)


def test_online_state_after_each_update_is_a_valid_merge():
    """OnlineMerge.result() after the first k groups is the merge of those k groups."""
    hidden, weight = problem(3)
    logits = hidden @ weight.T
    bounds = SPLITS[3]
    gen = torch.Generator().manual_seed(5)
    m = grouped.OnlineMerge(generator=gen)
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
        m.update(grouped.group_sample_logits(logits[:, a:b], vocab_start=a, num_samples=SAMPLES, generator=gen))
        out = m.result()
        allowed = torch.zeros(BATCH, VOCAB, dtype=torch.bool)
        allowed[:, : bounds[k]] = True
        check_merged(out, hidden, weight, allowed, 1.0)


def test_group_sample_is_the_op_on_the_group():
    hidden, weight = problem(4)
    g = grouped.group_sample(hidden, weight[20:45], vocab_start=20, seed=9, offset=2, num_samples=4)
    expected = fs.sample(hidden, weight[20:45], vocab_start=20, seed=9, offset=2, num_samples=4, return_logprobs=True)
    assert torch.equal(g.tokens, expected.tokens)
    torch.testing.assert_close(g.log_mass, expected.logsumexp)


def test_rejects_greedy_and_bad_shapes():
    with pytest.raises(ValueError, match="temperature"):
        grouped.group_sample_logits(torch.randn(2, 5), temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        grouped.group_sample(torch.randn(2, 8), torch.randn(5, 8), temperature=torch.tensor([1.0, 0.0]), seed=1)
    with pytest.raises(ValueError):
        grouped.merge_parallel([])
    m = grouped.OnlineMerge()
    m.update(grouped.group_sample_logits(torch.randn(2, 5), num_samples=2))
    with pytest.raises(ValueError):
        m.update(grouped.group_sample_logits(torch.randn(2, 5), num_samples=3))
