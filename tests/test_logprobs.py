"""top_logprobs / token_ids / logprobs_mode (flashsampling_cuda/logprobs.py): against float64
log-softmax, consistent with the sampled tokens' logprobs, ranks, ties, truncation, vocabulary
shards, argument errors. CPU always; CUDA where there is a GPU."""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.logprobs import LogprobsOutput
from sampling_stats import problem

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def float64_log_softmax(hidden, weight, temperature=1.0, bias=None):
    x = hidden.double() @ weight.double().T
    if bias is not None:
        x = x + bias.double()
    return torch.log_softmax(x / temperature, dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_top_logprobs_ranks_and_ids_against_float64(device, mode):
    batch, vocab, dim, n = 8, 1500, 64, 20
    hidden, weight = problem(batch, vocab, dim, device, seed=2, logit_std=2.0)
    bias = torch.randn(vocab, generator=torch.Generator().manual_seed(3)).to(device)
    ids = torch.randint(-1, vocab, (batch, 6), generator=torch.Generator().manual_seed(4)).to(device)
    out = fs.sample(hidden, weight, temperature=0.7, seed=5, num_samples=3, logit_bias=bias, return_logprobs=True,
                    top_logprobs=n, token_ids=ids, logprobs_mode=mode)
    assert isinstance(out, LogprobsOutput)
    want = (float64_log_softmax(hidden, weight, 0.7, bias) if mode == "processed"
            else float64_log_softmax(hidden, weight)).cpu()
    top = torch.sort(want, dim=1, descending=True, stable=True)
    assert out.top_ids.shape == (batch, n) and out.top_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.top_logprobs.cpu().double(), top.values[:, :n], atol=2e-4, rtol=1e-4)
    # ids agree except where two log-probabilities are within float rounding
    gap = (top.values[:, :n] - top.values[:, 1 : n + 1]).abs()
    assert ((out.top_ids.cpu() == top.indices[:, :n]) | (gap < 1e-4) | (gap.roll(1, 1) < 1e-4)).all()
    # the sampled tokens: their logprob, and their rank in the row's order
    mine = want.gather(1, out.tokens.cpu())
    torch.testing.assert_close(out.logprobs.cpu().double(), mine, atol=2e-4, rtol=1e-4)
    assert ((out.ranks.cpu() - 1 - (want[:, None, :] > mine[:, :, None] + 1e-4).sum(2)).abs() <= 2).all()
    assert (out.ranks >= 1).all()
    # given ids: NaN where padded
    inside = ids.cpu() >= 0
    got = out.token_ids_logprobs.cpu().double()
    assert got[~inside].isnan().all()
    torch.testing.assert_close(got[inside], want.gather(1, ids.cpu().clamp(min=0))[inside], atol=2e-4, rtol=1e-4)


def test_processed_entries_agree_with_the_op_logprobs():
    """A sampled token found in its row's top-N has the same logprob in both outputs (to the
    float32 rounding of the logsumexp), and its rank is its place in the list."""
    hidden, weight = problem(16, 800, 32, "cpu", seed=7, logit_std=2.0)
    out = fs.sample(hidden, weight, temperature=1.2, seed=1, return_logprobs=True, top_logprobs=64)
    hit = out.top_ids == out.tokens  # [B, 64] vs [B, 1]
    rows = hit.any(dim=1)
    assert rows.sum() >= 8
    torch.testing.assert_close(out.top_logprobs[hit], out.logprobs[rows, 0], atol=2e-6, rtol=0)
    assert torch.equal(out.ranks[rows, 0], hit.float().argmax(dim=1)[rows] + 1)


def test_truncated_processed_logprobs_cover_the_survivors_only():
    hidden, weight = problem(6, 1000, 32, "cpu", seed=8, logit_std=2.0)
    out = fs.sample(hidden, weight, seed=2, top_k=torch.tensor([3, 5, 8, 13, 21, 34]), top_p=0.9,
                    return_logprobs=True, top_logprobs=40)
    finite = out.top_logprobs.isfinite()
    assert (finite.sum(dim=1) <= torch.tensor([3, 5, 8, 13, 21, 34])).all()
    torch.testing.assert_close(out.top_logprobs.exp().nan_to_num(0).sum(dim=1), torch.ones(6), atol=1e-5, rtol=0)
    assert (out.ranks <= finite.sum(dim=1, keepdim=True)).all()


def test_ties_go_to_the_smaller_id_and_ids_are_global():
    vocab, dim = 50, 16
    hidden, weight = problem(2, vocab, dim, "cpu", seed=9, logit_std=2.0)
    weight[30] = weight[7]  # token 30 ties token 7 exactly
    weight[12] = weight[7]
    out = fs.sample(hidden, weight, seed=3, return_logprobs=True, top_logprobs=vocab, vocab_start=1000)
    for b in range(2):
        row = out.top_ids[b].tolist()
        assert row.index(1007) < row.index(1012) < row.index(1030)
        assert row.index(1030) == row.index(1007) + 2 or out.top_logprobs[b, row.index(1007) + 1] == \
            out.top_logprobs[b, row.index(1007)]
    assert (out.top_ids >= 1000).all() and (out.top_ids < 1000 + vocab).all()


def test_compiles_fullgraph_on_cpu():
    hidden, weight = problem(4, 300, 16, "cpu", seed=1, logit_std=2.0)

    def step(h):
        out = fs.sample(h, weight, seed=3, return_logprobs=True, top_logprobs=5, token_ids=torch.zeros(4, 2).long())
        return out.top_ids, out.top_logprobs, out.ranks

    compiled = torch.compile(step, fullgraph=True)
    for got, want in zip(compiled(hidden), step(hidden)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(top_logprobs=5), ValueError, "return_logprobs"),
    (dict(return_logprobs=True, top_logprobs=65), ValueError, "top_logprobs"),
    (dict(return_logprobs=True, top_logprobs=2.0), TypeError, "top_logprobs"),
    (dict(return_logprobs=True, logprobs_mode="raw_logits"), ValueError, "logprobs_mode"),
    (dict(return_logprobs=True, token_ids=torch.zeros(3, 2).long()), ValueError, "token_ids"),
    (dict(return_logprobs=True, token_ids="1,2"), TypeError, "token_ids"),
    (dict(return_logprobs=True, top_logprobs=-1), ValueError, "top_logprobs"),
    (dict(return_logprobs=True, token_ids=[[3, 100], [-1, 5]]), ValueError, r"token_ids .*\[0, 100\), got 100"),
    (dict(return_logprobs=True, token_ids=torch.tensor([[3, -2], [-1, 5]])), ValueError, "token_ids .*got -2"),
])
def test_argument_errors(kwargs, error, match):
    hidden, weight = problem(2, 100, 16, "cpu", logit_std=2.0)
    with pytest.raises(error, match=match):
        fs.sample(hidden, weight, **kwargs)


def _logprob_values(batch, vocab, seed, ties=True):
    """float32 [B, V] values with what the order must get right: exact ties (``ties``: many;
    else LLM-like rows, a peaked head over a Gaussian bulk), -inf (excluded tokens), a NaN, -0.0
    and +0.0, a row with nothing allowed."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, vocab, generator=gen) * 3
    if ties:
        values = values.round(decimals=1)
    else:
        values[:, : min(vocab, 40)] += torch.linspace(30, 5, min(vocab, 40))
    values[:, ::7] = -torch.inf
    if vocab > 3:
        values[0, 1], values[0, 2], values[0, 3] = -0.0, 0.0, torch.nan
    values[-1] = -torch.inf
    return values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [1, 37, 600, 4099, 151936])
@pytest.mark.parametrize("raw", [False, True])
@pytest.mark.parametrize("ties", [True, False])
def test_top_logprobs_op_matches_the_cpu_op(device, vocab, raw, ties):
    """flashsampling._top_logprobs (CUDA: csrc/kernels/top_logprobs.cu) equals its CPU op bit for
    bit: the first N entries and the ranks of the tokens, ties to the smaller id, NaN first (rows
    whose top N the kernel finds in its buffer, and rows of massive ties that it cannot)."""
    batch = 5
    values = _logprob_values(batch, vocab, seed=vocab, ties=ties)
    lse = torch.logsumexp(values.double().nan_to_num(nan=0.0), dim=1)
    lse[-1] = -torch.inf if not raw else lse[-1]
    tokens = torch.randint(-1, vocab + 1, (batch, 6), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = torch.arange(batch) % vocab  # a token of the head
    for n in sorted({0, 1, min(5, vocab), min(20, vocab), min(64, vocab)}):
        want = torch.ops.flashsampling._top_logprobs(values, lse, tokens, n, raw)
        got = torch.ops.flashsampling._top_logprobs(values.to(device), lse.to(device), tokens.to(device), n, raw)
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, atol=0, rtol=0, equal_nan=True)
    # With per-row scales (x and the rows' fl32(1 / T), 1 on a greedy row): the op on the
    # values scaled, bit for bit.
    scales = torch.tensor([1.25, 1.0, 0.5, 2.0, 1.0 / 0.7], dtype=torch.float32)
    want = torch.ops.flashsampling._top_logprobs(values * scales[:, None], lse, tokens, min(20, vocab), raw)
    got = torch.ops.flashsampling._top_logprobs(values.to(device), lse.to(device), tokens.to(device), min(20, vocab),
                                                raw, scales.to(device))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_opcheck(device):
    values = _logprob_values(3, 300, seed=2).nan_to_num(nan=1.0).to(device)  # (opcheck compares NaN as unequal)
    lse = torch.logsumexp(values.double().nan_to_num(nan=0.0), dim=1)
    tokens = torch.tensor([[0, 5], [299, -1], [17, 300]], device=device)
    torch.library.opcheck(torch.ops.flashsampling._top_logprobs.default, (values, lse, tokens, 20, False))
    scales = torch.tensor([0.5, 1.0, 1.25], device=device)
    torch.library.opcheck(torch.ops.flashsampling._top_logprobs.default, (values, lse, tokens, 20, False, scales))


@pytest.mark.parametrize("device", DEVICES)
def test_row_logsumexp_op(device):
    """flashsampling._row_logsumexp (the raw outputs' normaliser): torch.logsumexp's values to
    float32 rounding on ordinary rows (odd V, a padded row stride, a misaligned view), its special
    values exactly (NaN, +inf, every value -inf), an empty vocabulary; opcheck; bad input named."""
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 4099, generator=g) * 8
    rows[1, 7] = torch.nan
    rows[2, 9] = torch.inf
    rows[3] = -torch.inf
    rows[4, ::2] = -torch.inf
    padded = torch.randn(6, 4224, generator=g)[:, :4101]  # stride 4224, V = 4101
    misaligned = torch.randn(6, 4100, generator=g)[:, 1:]  # a row start off 16 bytes
    for values in (rows, padded, misaligned, torch.randn(3, 0)):
        got = torch.ops.flashsampling._row_logsumexp(values.to(device)).cpu()
        torch.testing.assert_close(got, torch.logsumexp(values, dim=1), atol=2e-6, rtol=2e-6, equal_nan=True)
    torch.library.opcheck(torch.ops.flashsampling._row_logsumexp.default, (padded.to(device),))
    with pytest.raises(RuntimeError, match="values must be a float32"):
        torch.ops.flashsampling._row_logsumexp(rows.double().to(device))


def test_top_logprobs_op_errors():
    values = torch.zeros(2, 10)
    lse, tokens = torch.zeros(2, dtype=torch.float64), torch.zeros(2, 1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="top_n"):
        torch.ops.flashsampling._top_logprobs(values, lse, tokens, 11, False)


@pytest.mark.parametrize("device", DEVICES)
def test_logprob_outputs_sample_on_the_logits_route(device):
    """A call with top_logprobs samples from the logits it reads the outputs from, with the op's
    noise: the tokens of sample_from_logits on those logits (and on the CPU, whose two routes
    agree bit for bit, those of the same call without top_logprobs)."""
    hidden, weight = problem(16, 3000, 64, device, seed=11, logit_std=2.0)
    temps = torch.linspace(0.0, 1.5, 16, device=device)  # a greedy row too
    out = fs.sample(hidden, weight, temperature=temps, seed=4, num_samples=2, return_logprobs=True,
                    top_logprobs=8, token_ids=[[1, 2]] * 16)
    logits = fs.truncation.materialized_logits(hidden, weight)
    want = fs.sample_from_logits(logits, temperature=temps, seed=4, num_samples=2, return_logprobs=True)
    assert torch.equal(out.tokens, want.tokens)
    torch.testing.assert_close(out.logsumexp, want.logsumexp, atol=0, rtol=0)
    if device == "cpu":
        assert torch.equal(out.tokens, fs.sample(hidden, weight, temperature=temps, seed=4, num_samples=2))


@pytest.mark.requires_cuda
def test_logprob_outputs_replay_in_a_cuda_graph():
    hidden, weight = problem(4, 5000, 64, "cuda", seed=12, logit_std=2.0)
    offset = torch.zeros((), dtype=torch.int64, device="cuda")

    def step():
        out = fs.sample(hidden, weight, temperature=0.8, seed=7, offset=offset, return_logprobs=True,
                        top_logprobs=5, token_ids=torch.zeros(4, 2, dtype=torch.int64, device="cuda"))
        return out.tokens, out.top_ids, out.top_logprobs, out.ranks

    step()  # warm up (allocations) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for value in (0, 3):
        offset.fill_(value)
        graph.replay()
        for got, want in zip(captured, step()):
            assert torch.equal(got, want)
