"""truncation_order: what top_p's probabilities are normalised over (the top_k survivors,
those that also pass min_p, or every allowed token): the worked example of docs/truncation.md,
pathwise samples against the float64 reference per order, the routes, argument errors."""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.reference import reference_sample
from flashsampling_cuda.truncation import Truncation, survivor_mask
from sampling_stats import assert_matches_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROBS = torch.tensor([[0.4, 0.3, 0.2, 0.1]])


@pytest.mark.parametrize("top_k,min_p,want", [
    (3, None, {"top_k_first": 2, "min_p_first": 2, "joint": 3}),
    (None, 0.4, {"top_k_first": 3, "min_p_first": 2, "joint": 3}),
])
def test_worked_example(top_k, min_p, want):
    y = torch.log(PROBS).float()
    for order, survivors in want.items():
        for k in (top_k, None if top_k is None else torch.tensor([top_k])):  # host int and [B] tensor
            mask = survivor_mask(y, None, Truncation(k, 0.75, min_p), order)
            assert mask[0].tolist() == [i < survivors for i in range(4)], (order, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("order", ["top_k_first", "min_p_first", "joint"])
def test_pathwise_against_reference(device, order):
    batch, vocab, dim = 10, 2003, 64
    g = torch.Generator().manual_seed(7)
    hidden = torch.randn(batch, dim, generator=g).to(torch.bfloat16).to(device)
    weight = (torch.randn(vocab, dim, generator=g) * 3 / dim**0.5).to(torch.bfloat16).to(device)
    top_k = torch.randint(5, 400, (batch,), generator=g)
    top_p = torch.rand(batch, generator=g) * 0.5 + 0.4
    kwargs = dict(temperature=0.9, seed=4, num_samples=4, top_k=top_k.to(device), top_p=top_p.to(device), min_p=0.05)
    out = fs.sample(hidden, weight, **kwargs, truncation_order=order)
    ref = reference_sample(hidden, weight, **kwargs, truncation_order=order)
    assert_matches_reference(out, ref)


def test_orders_differ_where_the_example_says():
    """One row whose logits are the worked example's (other tokens far below), top_k = 3 and
    top_p = 0.75: token 2 survives only the joint order."""
    vocab = 64
    logits = torch.full((vocab,), -30.0)
    logits[:4] = torch.log(PROBS[0])
    hidden = torch.zeros(1, vocab, dtype=torch.bfloat16)
    hidden[0, 0] = 1
    weight = torch.zeros(vocab, vocab, dtype=torch.bfloat16)
    weight[:, 0] = logits.bfloat16()  # hidden @ weight.T = the logits
    kwargs = dict(seed=1, num_samples=2000, top_k=3, top_p=0.75)
    drawn = {order: set(fs.sample(hidden, weight, **kwargs, truncation_order=order)[0].tolist())
             for order in ("top_k_first", "min_p_first", "joint")}
    assert drawn["top_k_first"] == drawn["min_p_first"] == {0, 1}
    assert drawn["joint"] == {0, 1, 2}


@pytest.mark.parametrize("kwargs,match", [
    (dict(truncation_order="vllm", top_p=0.9, top_k=5), "truncation_order"),
    (dict(truncation_order="joint", top_p=0.9, top_k=5, truncation_path="logits"), "truncation_path"),
])
def test_argument_errors(kwargs, match):
    hidden, weight = torch.randn(2, 16).bfloat16(), torch.randn(100, 16).bfloat16()
    with pytest.raises(ValueError, match=match):
        fs.sample(hidden, weight, **kwargs)


def test_the_order_does_not_matter_without_a_second_cut():
    """top_p alone (or with neither top_k nor min_p) keeps the default route and tokens."""
    hidden, weight = torch.randn(4, 16).bfloat16(), torch.randn(300, 16).bfloat16()
    base = fs.sample(hidden, weight, seed=3, top_p=0.8)
    for order in ("min_p_first", "joint"):
        assert torch.equal(fs.sample(hidden, weight, seed=3, top_p=0.8, truncation_order=order), base)
