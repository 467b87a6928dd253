"""The fused route of top-N logprobs (``flashsampling._sample_top_logprobs``, sm90; issue #34):
one pass of the fused top-k GEMM with nothing on samples the plain token, and stage 2 reads each
row's top N and the token's rank off its first 64 tokens where they certify them; the top-N kernels
take the rest from the logits the GEMM stored (flashsampling_cuda/logprobs.py).

On logits exact in fp32 the op returns the CPU op's tokens and scores, and top N and ranks equal
bit for bit to the logits route's of its own logits and log-sum-exp, whichever part decided them
(flat rows: the rank left to the kernels; N = 64 and tied rows: the top N too); on an LM head's
bf16 logits its tokens are plain sampling's; ``sample(top_logprobs=...)`` takes it and agrees with
the CPU; graphs and torch.compile. CPU: the op's CPU kernel (the reference) and its checks.
"""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.logprobs import normalised, ranked_tokens, top_logprobs_cpu
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from flashsampling_cuda.truncation import temperature_scales
from kernel_trace import run_listing_cuda_kernels
from test_fused_truncation import exact_problem, requires_sm90

V = 32768


def op_kwargs(batch, device, controls, vocab=V, bias=True):
    """seed / offset 0-d tensors; with controls per-row temperatures with greedy rows, a vocabulary
    shard and (``bias``) a dense bias."""
    kwargs = dict(temperature=0.8, seed=torch.tensor(7), offset=torch.tensor(3))
    if controls:
        g = torch.Generator().manual_seed(batch)
        kwargs.update(
            temperatures=torch.tensor([[0.0, 0.7, 1.3, 2.0][b % 4] for b in range(batch)], device=device),
            vocab_start=1000,
        )
        if bias:
            kwargs.update(logit_bias=(torch.randint(-8, 9, (vocab,), generator=g).float() / 4).to(device))
    return kwargs


def expected_top(x, logsumexp, tokens, kwargs, top_n, raw=False):
    """The logits route's top N and ranks of logits ``x`` (bias added) with this log-sum-exp
    (processed values, or raw ones of x)."""
    x, logsumexp, tokens = x.cpu(), logsumexp.cpu(), tokens.cpu()
    temperatures = kwargs.get("temperatures")
    scales = temperature_scales(x.shape[0], kwargs["temperature"], None if temperatures is None else temperatures.cpu(),
                                x.device)
    local, valid = ranked_tokens(tokens, logsumexp, kwargs.get("vocab_start", 0), x.shape[1])
    return top_logprobs_cpu(x if raw else x * scales[:, None], logsumexp.double(), torch.where(valid, local, -1),
                            top_n, raw=raw)


@requires_sm90
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("batch", [1, 13, 64])
@pytest.mark.parametrize("top_n", [0, 5, 20, 64])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_fused_op_equals_cpu_op_on_exact_logits(regime, batch, top_n, controls, mode):
    raw = mode == "raw"
    hidden, weight, logits = exact_problem(batch, regime, seed=batch + top_n)
    kwargs = op_kwargs(batch, "cuda", controls, bias=not raw)
    got = torch.ops.flashsampling._sample_top_logprobs(hidden.cuda(), weight.cuda(), **kwargs, top_n=top_n, raw=raw)
    cpu_kwargs = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}
    want = torch.ops.flashsampling._sample_top_logprobs(hidden, weight, **cpu_kwargs, top_n=top_n, raw=raw)
    tokens, scores, logprobs, logsumexp, top_values, top_ids, ranks, x = got
    # The sample, its score and the logits bit for bit; the log-sum-exp of the GEMM's log-masses
    # (approximate exponentials) close to the CPU's.
    assert torch.equal(tokens.cpu(), want[0]) and torch.equal(scores.cpu(), want[1])
    assert torch.equal(x.cpu(), want[7])
    torch.testing.assert_close(logsumexp.cpu(), want[3], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(logprobs.cpu(), want[2], atol=2e-5, rtol=1e-6)
    # The top N and ranks: the logits route's on these logits and this log-sum-exp, bit for bit;
    # raw, the token's log-probability too (stage 2's or the rank pass's).
    want_values, want_ids, want_ranks = expected_top(x, logsumexp, tokens, kwargs, top_n, raw)
    assert top_values.shape == (batch, top_n) and ranks.shape == (batch, 1)
    assert torch.equal(top_ids.cpu(), want_ids)
    assert torch.equal(top_values.cpu(), want_values)
    assert torch.equal(ranks.cpu(), want_ranks)
    if raw:
        local = tokens.cpu() - kwargs.get("vocab_start", 0)
        want_logprobs = normalised(x.cpu().gather(1, local), logsumexp.cpu().double(), "raw")
        assert torch.equal(logprobs.cpu(), want_logprobs)


@requires_sm90
@pytest.mark.parametrize("regime", ["flat", "llm"])
@pytest.mark.parametrize("batch", [3, 64])
def test_fused_route_samples_the_plain_token(regime, batch):
    """bf16 logits of an LM head (the fused pass's own accumulators): sample(top_logprobs=...)
    takes the fused route (its stage 2 runs) and draws plain sampling's token,
    with the logits route's outputs on the logits it stored."""
    weight = lm_head_weight(V, 256, seed=3)
    hidden = hidden_states(weight, batch, regime, seed=batch)
    kwargs = dict(temperature=0.8, seed=torch.tensor(5), offset=torch.tensor(2))
    ids = torch.randint(-1, V, (batch, 4), generator=torch.Generator().manual_seed(batch)).cuda()
    (out, raw), kernels = run_listing_cuda_kernels(lambda: (
        fs.sample(hidden, weight, **kwargs, return_logprobs=True, top_logprobs=20, token_ids=ids),
        fs.sample(hidden, weight, **kwargs, return_logprobs=True, top_logprobs=20, logprobs_mode="raw")))
    assert sum("truncate_candidates_kernel" in name for name in kernels) == 2
    assert torch.equal(raw.tokens, out.tokens)
    raw_table = torch.log_softmax(fs.truncation.materialized_logits(hidden, weight).double(), dim=1)
    torch.testing.assert_close(raw.top_logprobs.double(), raw_table.topk(20, dim=1).values, atol=1e-4, rtol=0)
    assert torch.equal(out.tokens, fs.sample(hidden, weight, **kwargs))
    plain = fs.sample(hidden, weight, **kwargs, return_logprobs=True)
    torch.testing.assert_close(out.logsumexp, plain.logsumexp, atol=2e-5, rtol=1e-6)
    # against the logits route on the same call (cuBLAS logits: other bits, so values to rounding)
    logits = fs.truncation.materialized_logits(hidden, weight)
    table = torch.log_softmax(logits.double() / 0.8, dim=1)
    torch.testing.assert_close(out.top_logprobs.double(), table.topk(20, dim=1).values, atol=1e-4, rtol=0)
    mine = table.gather(1, out.tokens)
    ahead = out.ranks - 1
    assert ((table > mine + 1e-4).sum(1, keepdim=True) <= ahead).all()
    assert (ahead <= (table > mine - 1e-4).sum(1, keepdim=True)).all()
    inside = ids >= 0
    torch.testing.assert_close(out.token_ids_logprobs.double()[inside], table.gather(1, ids.clamp(min=0))[inside],
                               atol=1e-4, rtol=0)
    assert out.token_ids_logprobs[~inside].isnan().all()


@requires_sm90
@pytest.mark.parametrize("mode", ["processed", "raw"])
@pytest.mark.parametrize("vocab", [V, V - 3], ids=["whole_tiles", "ragged"])
def test_fused_route_agrees_with_the_cpu_and_compiles(mode, vocab):
    """sample(top_logprobs=..., token_ids=...) on exact logits: the CPU's outputs (tokens, ids and
    ranks equal; values to the rounding of the log-sum-exp), eager and compiled alike (the stored
    logits' padded row stride, V not a multiple of 128, as the fake kernel states it); raw values
    from the logits the fused pass stored."""
    batch = 16
    hidden, weight, _ = exact_problem(batch, "peaked", seed=21, vocab=vocab)
    ids = [[0, 5, vocab - 1], [7], []] + [[b] for b in range(batch - 3)]
    kwargs = dict(temperature=0.7, seed=9, return_logprobs=True, top_logprobs=10, token_ids=ids,
                  logprobs_mode=mode)
    want = fs.sample(hidden, weight, **kwargs)
    h, w = hidden.cuda(), weight.cuda()
    compiled = torch.compile(lambda a, b: fs.sample(a, b, **kwargs), fullgraph=True)
    for got in (fs.sample(h, w, **kwargs), compiled(h, w)):
        assert torch.equal(got.tokens.cpu(), want.tokens)
        assert torch.equal(got.top_ids.cpu(), want.top_ids)
        assert torch.equal(got.ranks.cpu(), want.ranks)
        for name in ("logprobs", "logsumexp", "top_logprobs", "token_ids_logprobs"):
            torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), atol=2e-5, rtol=1e-6,
                                       equal_nan=True)


def test_cpu_op_is_the_logits_route():
    """The op's CPU kernel (the CUDA kernels' reference) gives what sample(top_logprobs=...)
    gives on the CPU, and passes opcheck."""
    weight = lm_head_weight(600, 32, seed=1, device="cpu")
    hidden = hidden_states(weight, 5, "llm", seed=2)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5, 0.9])
    got = torch.ops.flashsampling._sample_top_logprobs(hidden, weight, temperatures=temps, seed=torch.tensor(4),
                                                       vocab_start=100, top_n=7)
    want = fs.sample(hidden, weight, temperature=temps, seed=4, vocab_start=100, return_logprobs=True,
                     top_logprobs=7)
    for g, w in zip(got[:4], (want.tokens, None, want.logprobs, want.logsumexp)):
        if w is not None:
            assert torch.equal(g, w)
    assert torch.equal(got[4], want.top_logprobs) and torch.equal(got[5] + 100, want.top_ids)
    assert torch.equal(got[6], want.ranks)
    torch.library.opcheck(torch.ops.flashsampling._sample_top_logprobs.default, (hidden, weight),
                          dict(temperatures=temps, seed=torch.tensor(4), top_n=3))


@requires_sm90
def test_fused_op_opcheck_and_misaligned_operands():
    """opcheck on CUDA (the fake's padded stride of the stored logits); a weight view the TMA
    cannot take (D not a multiple of 8) takes the logits route instead of failing."""
    hidden, weight, _ = exact_problem(3, "peaked", seed=5, vocab=V - 3)
    torch.library.opcheck(torch.ops.flashsampling._sample_top_logprobs.default, (hidden.cuda(), weight.cuda()),
                          dict(seed=torch.tensor(1), top_n=4))
    h, w = hidden[:, :252].cuda(), weight[:, :252].cuda()  # D = 252
    out = fs.sample(h, w, seed=3, return_logprobs=True, top_logprobs=4)
    want = fs.sample(hidden[:, :252], weight[:, :252], seed=3, return_logprobs=True, top_logprobs=4)
    assert torch.equal(out.tokens.cpu(), want.tokens) and torch.equal(out.top_ids.cpu(), want.top_ids)


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_route_plumbing_on_the_cpu_op(monkeypatch, mode):
    """sample(top_logprobs=..., token_ids=...) through the fused route's Python side (routing, the
    outputs it hands on, logprobs.logprob_outputs) with the op's CPU kernel in place of CUDA: the
    logits route's outputs bit for bit."""
    import flashsampling_cuda.sampling as sampling

    weight = lm_head_weight(600, 32, seed=1, device="cpu")
    hidden = hidden_states(weight, 5, "llm", seed=2)
    kwargs = dict(temperature=torch.tensor([0.0, 0.5, 1.0, 1.5, 0.9]), seed=4, vocab_start=100,
                  return_logprobs=True, top_logprobs=7, token_ids=[[100, 105, -1]] * 5, logprobs_mode=mode)
    want = fs.sample(hidden, weight, **kwargs)
    calls = []
    op = torch.ops.flashsampling._sample_top_logprobs

    def counted(*args, **op_kwargs):
        calls.append((op_kwargs["top_n"], op_kwargs["raw"]))
        return op(*args, **op_kwargs)

    monkeypatch.setattr(sampling, "fused_top_logprobs_takes", lambda hidden, weight, op_kwargs: True)
    monkeypatch.setattr(torch.ops.flashsampling, "_sample_top_logprobs", counted)
    got = fs.sample(hidden, weight, **kwargs)
    assert calls == [(7, mode == "raw")]
    for name, g, w in zip(want._fields, got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True, msg=name)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_n=65), "top_n must be in"),
    (dict(top_n=-1), "top_n must be in"),
    (dict(top_n=3, num_samples=2), "num_samples must be 1"),
    (dict(top_n=60, vocab=40), "top_n must be at most V=40"),
    (dict(top_n=3, allowed_mask=torch.ones(2, 19, dtype=torch.int32)), "no allowed_mask"),
])
def test_op_errors(kwargs, match):
    vocab = kwargs.pop("vocab", 600)
    hidden, weight = torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(vocab, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flashsampling._sample_top_logprobs(hidden, weight, **kwargs)
