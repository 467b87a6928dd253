"""Sampling controls (issue #4): per-row and greedy temperatures, dense and sparse logit
bias, the allowed-token mask, vocab_start, num_samples, log-probabilities and per-row
seeds; each against the float64 reference under the same noise (pathwise) and against
softmax (chi-square) where it changes the distribution, plus greedy == argmax, batch
invariance, empty-mask rows, argument errors, opcheck and torch.compile.

Tests parametrized over `device` run on the CPU here and on CUDA on the GPU machine
(requires_cuda), so they use what the CUDA kernel takes: bfloat16, D % 8 == 0 and
num_samples <= 65535. fp32-only checks are CPU-only.
"""

import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.reference import reference_sample
from sampling_stats import (
    assert_matches_reference,
    chi_square_pvalue,
    integer_problem,
    make_problem,
    problem,
    random_controls,
    transformed_probs,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
# Tolerance of the reference (relative fp32 error of a score): the GPU accumulates the
# logits in another order than at::mm (as in test_sample_cuda.py).
RTOL = 1e-4


def as_dicts(ids, values):
    """The list-of-dicts form of (ids, values); a repeated id keeps its summed value."""
    out = []
    for row_ids, row_values in zip(ids.tolist(), values.tolist()):
        d = {}
        for i, v in zip(row_ids, row_values):
            if i >= 0:
                d[i] = d.get(i, 0.0) + v
        out.append(d)
    return out


# ---------------------------------------------------------------- pathwise, per control

B, V, D = 8, 3001, 64  # V % 32 != 0: the mask's last word is partial
CONTROL_CASES = ["logit_bias", "sparse_pair", "sparse_dicts", "mask_bitmask", "mask_bool", "vocab_start",
                 "per_row_temperature", "num_samples", "per_row_seed", "all"]


def control_kwargs(case, device):
    """Keyword arguments of fs.sample and reference_sample for one CONTROL_CASES entry."""
    vocab_start = 123_457 if case in ("vocab_start", "all") else 0
    c = random_controls(B, V, device, vocab_start=vocab_start, seed=len(case))
    kwargs = dict(temperature=0.8, seed=2024, offset=3, num_samples=2)
    if case == "logit_bias":
        kwargs["logit_bias"] = c["logit_bias"]
    elif case == "sparse_pair":
        kwargs["sparse_logit_bias"] = c["sparse_logit_bias"]
    elif case == "sparse_dicts":
        kwargs["sparse_logit_bias"] = as_dicts(*c["sparse_logit_bias"])
    elif case == "mask_bitmask":
        kwargs["allowed_mask"] = c["allowed_mask"]
    elif case == "mask_bool":
        kwargs["allowed_mask"] = c["allowed_bool"]
    elif case == "vocab_start":
        kwargs["vocab_start"] = vocab_start
    elif case == "per_row_temperature":
        kwargs["temperature"] = torch.tensor([0.5, 0.0, 1.0, 2.0, 0.0, 0.7, 1.3, 0.9], device=device)
    elif case == "num_samples":
        kwargs["num_samples"] = 7
    elif case == "per_row_seed":
        kwargs.update(seed=torch.arange(B, device=device) * 7919 + 1, offset=torch.arange(B, device=device) * 5)
    elif case == "all":
        kwargs.update(
            temperature=torch.tensor([0.5, 0.0, 1.0, 2.0, 0.0, 0.7, 1.3, 0.9], device=device),
            seed=torch.arange(B, device=device) * 7919 + 1,
            offset=torch.arange(B, device=device) * 5,
            num_samples=3,
            logit_bias=c["logit_bias"],
            sparse_logit_bias=c["sparse_logit_bias"],
            allowed_mask=c["allowed_mask"],
            vocab_start=vocab_start,
        )
    return kwargs


def assert_logprobs_close(out_logprobs, out_lse, ref, same):
    """logprobs (where the token equals the reference's) and logsumexp within 1e-4
    relative of float64 (plus 1e-4 absolute for log-probabilities near 0)."""
    lse = out_lse.cpu().double()
    torch.testing.assert_close(lse, ref.logsumexp.cpu(), rtol=1e-4, atol=0.0)
    lp, ref_lp = out_logprobs.cpu().double()[same], ref.logprobs.cpu()[same]
    torch.testing.assert_close(lp, ref_lp, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CONTROL_CASES)
def test_pathwise_equal_to_float64_reference(case, device):
    hidden, weight = problem(B, V, D, device, seed=len(case))
    kwargs = control_kwargs(case, device)
    tokens = fs.sample(hidden, weight, **kwargs)
    assert tokens.shape == (B, kwargs["num_samples"]) and tokens.dtype == torch.int64
    ref = reference_sample(hidden, weight, **kwargs, rtol=RTOL)
    assert_matches_reference(tokens, ref)
    vocab_start = kwargs.get("vocab_start", 0)
    assert ((tokens >= vocab_start) & (tokens < vocab_start + V)).all()

    # sample_with_scores: the same tokens, the winning scores and the log-probabilities.
    out = fs.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
    assert torch.equal(out.tokens, tokens)
    same = (tokens.cpu() == ref.tokens.cpu())
    scale = ref.tolerance.cpu()[:, None].expand_as(same) * 10
    score_error = (out.scores.cpu().double() - ref.scores.cpu()).abs()
    assert (score_error[same] <= scale[same]).all(), score_error[same].max()
    assert_logprobs_close(out.token_logprobs, out.logsumexp, ref, same)
    out2 = fs.sample(hidden, weight, **kwargs, return_logprobs=True)
    assert isinstance(out2, fs.SampleOutput)
    assert torch.equal(out2.tokens, tokens) and torch.equal(out2.logprobs, out.token_logprobs)


def test_pathwise_float32_all_controls_cpu():
    """fp32 inputs (CPU only) with every control, odd D."""
    hidden, weight = problem(6, 2000, 37, "cpu", dtype=torch.float32, seed=3)
    c = random_controls(6, 2000, "cpu", vocab_start=64, seed=3)
    kwargs = dict(temperature=torch.tensor([1.0, 0.0, 0.6, 1.5, 0.0, 2.0]), seed=99, num_samples=4,
                  logit_bias=c["logit_bias"], sparse_logit_bias=c["sparse_logit_bias"],
                  allowed_mask=c["allowed_mask"], vocab_start=64)
    out = fs.sample(hidden, weight, **kwargs, return_logprobs=True)
    ref = reference_sample(hidden, weight, **kwargs)
    assert_matches_reference(out.tokens, ref)
    assert_logprobs_close(out.logprobs, out.logsumexp, ref, out.tokens == ref.tokens)


def test_bias_is_added_in_fp32_in_the_documented_order():
    """Exact fp32 model on the CPU: x = fl(fl(logit + bias) + fl(0 + s1 + s2)) for a
    repeated sparse id, score = fma(x, fl(1 / T), g)."""
    from flashsampling_cuda import noise

    hidden, weight = integer_problem(2, 300, 8, seed=1)
    bias = torch.randn(300, generator=torch.Generator().manual_seed(0)) * 1e-3
    ids = torch.tensor([[5, 7, 5, -1], [9, 9, 9, 299]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.0], [1.5, -0.25, 1e-8, 2.0]])
    out = fs.sample_with_scores(hidden, weight, temperature=0.7, seed=5, num_samples=3, logit_bias=bias,
                                sparse_logit_bias=(ids, values))
    x = ((hidden.double() @ weight.double().T).float() + bias)
    sparse_sum = torch.zeros(2, 300)
    for b in range(2):
        for i, v in zip(ids[b].tolist(), values[b].tolist()):
            if i >= 0:
                sparse_sum[b, i] = sparse_sum[b, i] + torch.tensor(v)  # fp32, list order
    x = torch.where(sparse_sum != 0, x + sparse_sum, x)
    inv_t = torch.ones(()) / torch.tensor(0.7)
    for s in range(3):
        g = noise.gumbel_noise(5, 0, torch.arange(2)[:, None], s, torch.arange(300))
        scores = noise.fma32(x, inv_t, g)
        assert torch.equal(out.tokens[:, s], scores.argmax(dim=1))
        assert torch.equal(out.scores[:, s], scores.amax(dim=1))


# ---------------------------------------------------------------- chi-square

CHI_SQUARE_CASES = ["logit_bias", "sparse", "mask", "per_row_temperature"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CHI_SQUARE_CASES)
def test_chi_square_matches_transformed_softmax(case, device):
    batch, vocab, samples = 4, 97, 20_000
    hidden, weight = problem(batch, vocab, 32, device, logit_std=1.5, seed=10 + len(case))
    c = random_controls(batch, vocab, device, seed=len(case), density=0.5, bias_scale=1.5, boost=1.0)
    temperature = 0.9
    kwargs, probs_kwargs = {}, {}
    if case == "logit_bias":
        kwargs["logit_bias"] = probs_kwargs["logit_bias"] = c["logit_bias"]
    elif case == "sparse":
        kwargs["sparse_logit_bias"] = probs_kwargs["sparse"] = c["sparse_logit_bias"]
    elif case == "mask":
        kwargs["allowed_mask"] = c["allowed_mask"]
        probs_kwargs["allowed"] = c["allowed_bool"]
    elif case == "per_row_temperature":
        temperature = torch.tensor([0.3, 1.0, 2.5, 0.7], device=device)
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=torch.arange(batch, device=device) + 31,
                       num_samples=samples, **kwargs)
    probs = transformed_probs(hidden, weight, temperature, **probs_kwargs)
    if case == "mask":
        allowed = c["allowed_bool"].cpu()
        assert allowed.gather(1, tokens.cpu()).all(), "a masked token was sampled"
    p = chi_square_pvalue(tokens.cpu(), probs)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax_of_transformed_logits(device):
    """Small-integer data: the fp32 logits, biases and sums are exact, so greedy rows must
    be exactly the first argmax of x over the allowed tokens; noisy rows are not."""
    batch, vocab = 6, 1000
    hidden, weight = integer_problem(batch, vocab, 16, seed=7)
    g = torch.Generator().manual_seed(7)
    bias = torch.randint(-4, 5, (vocab,), generator=g).float()
    ids = torch.randint(0, vocab, (batch, 4), generator=g)
    values = torch.randint(-6, 7, (batch, 4), generator=g).float()
    allowed = torch.rand(batch, vocab, generator=g) < 0.4
    x = hidden @ weight.T + bias
    x = x.index_put((torch.arange(batch)[:, None].expand_as(ids), ids), values, accumulate=True)
    expected = x.masked_fill(~allowed, -math.inf).argmax(dim=1)  # first maximum
    temps = torch.tensor([0.0, 0.0, 1.0, 0.0, 2.0, 0.0])
    to = dict(dtype=torch.bfloat16, device=device)
    out = fs.sample(hidden.to(**to), weight.to(**to), temperature=temps.to(device), seed=3, num_samples=3,
                    logit_bias=bias.to(device), sparse_logit_bias=(ids.to(device), values.to(device)),
                    allowed_mask=allowed.to(device), return_logprobs=True)
    greedy = temps == 0
    tokens = out.tokens.cpu()
    assert torch.equal(tokens[greedy], expected[greedy][:, None].expand(-1, 3))
    assert allowed.gather(1, tokens).all()
    # Greedy rows report log-probabilities under T = 1: y = x.
    y = x.double().masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(y, dim=1)
    torch.testing.assert_close(out.logsumexp.cpu().double()[greedy], lse[greedy], rtol=1e-5, atol=0)
    expected_lp = y.gather(1, tokens) - lse[:, None]
    torch.testing.assert_close(out.logprobs.cpu().double()[greedy], expected_lp[greedy], rtol=1e-4, atol=1e-5)
    # A scalar T = 0 gives the same tokens for every row's argmax.
    scalar = fs.sample(hidden.to(**to), weight.to(**to), temperature=0.0, seed=3, logit_bias=bias.to(device),
                       sparse_logit_bias=(ids.to(device), values.to(device)), allowed_mask=allowed.to(device))
    assert torch.equal(scalar.cpu()[:, 0], expected)


# ---------------------------------------------------------------- log-probabilities

@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_and_logsumexp_match_float64(device):
    batch, vocab = 5, 20_000  # several CPU chunks
    hidden, weight = problem(batch, vocab, 64, device, logit_std=4.0, seed=21)
    c = random_controls(batch, vocab, device, seed=21, density=0.6)
    temps = torch.tensor([1.0, 0.4, 0.0, 3.0, 1.7], device=device)
    kwargs = dict(temperature=temps, seed=8, num_samples=4, logit_bias=c["logit_bias"],
                  allowed_mask=c["allowed_mask"], vocab_start=1000)
    out = fs.sample(hidden, weight, **kwargs, return_logprobs=True)
    assert out.logprobs.shape == (batch, 4) and out.logsumexp.shape == (batch,)
    assert out.logprobs.dtype == out.logsumexp.dtype == torch.float32
    ref = reference_sample(hidden, weight, **kwargs, rtol=RTOL)
    assert_matches_reference(out.tokens, ref)
    assert_logprobs_close(out.logprobs, out.logsumexp, ref, out.tokens.cpu() == ref.tokens.cpu())
    assert (out.logprobs <= 0).all()
    # No controls: logsumexp of logits / T over the whole vocabulary.
    plain = fs.sample(hidden, weight, temperature=0.7, seed=1, return_logprobs=True)
    expected = torch.logsumexp(hidden.double().cpu() @ weight.double().cpu().T / 0.7, dim=1)
    torch.testing.assert_close(plain.logsumexp.cpu().double(), expected, rtol=1e-4, atol=0)


def test_logprobs_special_values_cpu():
    """+inf and NaN logits: logsumexp is +inf / NaN, never a silent finite value."""
    hidden, weight = make_problem(3, 100, 8, seed=4)
    bias = torch.zeros(100)
    bias[17] = math.inf
    out = fs.sample(hidden, weight, seed=0, logit_bias=bias, return_logprobs=True)
    assert (out.tokens == 17).all() and (out.logsumexp == math.inf).all()
    hidden[1] = math.nan
    out = fs.sample(hidden, weight, seed=0, return_logprobs=True)
    assert out.tokens[1, 0] == -1 and out.logsumexp[1].isnan() and out.logprobs[1].isnan().all()
    assert out.logsumexp[[0, 2]].isfinite().all()


# ---------------------------------------------------------------- batch invariance

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op_name", ["sample", "sample_with_scores"])
def test_streams_carry_a_rows_noise_to_another_position(device, op_name):
    """The op's streams [B]: a row drawing stream s gets the token of the batch-wide-seed row s
    with the same logits (any position, repeated rows, the loops for all controls, per-row seeds
    too: they draw stream 0 unless streams say otherwise)."""
    batch, vocab = 9, 3000
    hidden, weight = problem(batch, vocab, 32, device, logit_std=1.0, seed=6)
    op = getattr(torch.ops.flashsampling, op_name)

    def tokens(h, **kwargs):
        out = op(h, weight, temperature=0.9, seed=torch.tensor(11, device=device), offset=torch.tensor(4, device=device),
                 **kwargs)
        return out if op_name == "sample" else out[0]

    full = tokens(hidden)
    for rows in ([4], [8, 0, 3], [2, 2, 7, 1, 5, 6], [5, 0, 1, 2, 3, 4, 6, 7, 8]):
        idx = torch.tensor(rows, device=device)
        assert torch.equal(tokens(hidden[idx], streams=idx), full[idx]), rows
        # with a mask and per-row temperatures (the controls' loops)
        mask = torch.full((len(rows), (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
        temps = torch.full((len(rows),), 0.9, device=device)
        assert torch.equal(tokens(hidden[idx], streams=idx, allowed_mask=mask, temperatures=temps), full[idx]), rows
    # per-row seeds equal to the batch-wide one, with the rows' streams: the same tokens
    seeds = torch.full((batch,), 11, dtype=torch.int64, device=device)
    out = op(hidden, weight, temperature=0.9, seed=seeds, offset=torch.tensor(4, device=device),
             streams=torch.arange(batch, device=device))
    assert torch.equal(out if op_name == "sample" else out[0], full)


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_seeds_make_every_control_batch_invariant(device):
    """With [B] seeds, a row's tokens depend on its own seed, offset, temperature, biases
    and mask only: not on the rows around it or its position."""
    batch, vocab = 10, 2000
    hidden, weight = problem(batch, vocab, 32, device, logit_std=1.0, seed=5)
    c = random_controls(batch, vocab, device, vocab_start=300, seed=5, density=0.5)
    ids, values = c["sparse_logit_bias"]
    per_row = dict(
        hidden=hidden,
        temperature=torch.linspace(0.0, 2.0, batch, device=device),
        seed=torch.arange(batch, device=device) * 1000 + 1,
        offset=torch.arange(batch, device=device) % 3,
        ids=ids, values=values,
        allowed_mask=c["allowed_mask"],
    )

    def run(rows):
        a = {k: v[rows] for k, v in per_row.items()}
        return fs.sample(a["hidden"], weight, temperature=a["temperature"], seed=a["seed"], offset=a["offset"],
                         num_samples=3, logit_bias=c["logit_bias"], sparse_logit_bias=(a["ids"], a["values"]),
                         allowed_mask=a["allowed_mask"], vocab_start=300, return_logprobs=True)

    full = run(torch.arange(batch, device=device))
    for rows in ([3], [9, 0, 4], [7, 1, 2, 8, 5], [0, 0, 6]):
        idx = torch.tensor(rows, device=device)
        sub = run(idx)
        assert torch.equal(sub.tokens, full.tokens[idx]), rows
        torch.testing.assert_close(sub.logprobs, full.logprobs[idx], rtol=1e-5, atol=1e-5)
    # Rows added around them do not change them either.
    grown = run(torch.cat([torch.tensor([4, 2, 2], device=device), torch.arange(batch, device=device)]))
    assert torch.equal(grown.tokens[3:], full.tokens)


# ---------------------------------------------------------------- empty masks

@pytest.mark.parametrize("device", DEVICES)
def test_row_whose_mask_allows_nothing(device):
    batch, vocab = 4, 100  # 4 words, the last one 4 bits long
    hidden, weight = problem(batch, vocab, 16, device, seed=2)
    allowed = torch.rand(batch, vocab, generator=torch.Generator().manual_seed(2)) < 0.5
    allowed[2] = False
    mask = fs.pack_allowed_mask(allowed)
    mask[2, -1] = ~0xF  # bits past V do not count
    mask = mask.to(device)
    seeds = torch.arange(batch, device=device) + 10
    message = r"allowed_mask allows no token in 1 row\(s\) \(first: 2\).*empty_mask_token"
    with pytest.raises(RuntimeError, match=message):
        fs.sample(hidden, weight, seed=seeds, allowed_mask=mask)
    out = fs.sample_with_scores(hidden, weight, seed=seeds, num_samples=2, allowed_mask=mask, empty_mask_token=-7,
                                return_logprobs=True)
    assert (out.tokens[2] == -7).all() and (out.scores[2] == -math.inf).all()
    assert out.token_logprobs[2].isnan().all() and out.logsumexp[2] == -math.inf
    ref = reference_sample(hidden, weight, seed=seeds, num_samples=2, allowed_mask=mask, empty_mask_token=-7,
                           rtol=RTOL)
    assert_matches_reference(out.tokens, ref)
    assert torch.equal(fs.sample(hidden, weight, seed=seeds, num_samples=2, allowed_mask=mask, empty_mask_token=-7),
                       out.tokens)


# ---------------------------------------------------------------- argument errors

BATCH, VOCAB = 3, 40  # ceil(V / 32) = 2


def valid_op_args(device):
    """Valid arguments of both ops with every control (B=3, V=40, D=8)."""
    dev = dict(device=device)
    return dict(
        hidden=torch.randn(BATCH, 8, **dev).bfloat16(), weight=torch.randn(VOCAB, 8, **dev).bfloat16(),
        temperature=1.0, temperatures=torch.ones(BATCH, **dev), num_samples=2,
        seed=torch.arange(BATCH, **dev), offset=torch.zeros(BATCH, dtype=torch.int64, **dev),
        logit_bias=torch.zeros(VOCAB, **dev), sparse_bias_ids=torch.zeros(BATCH, 2, dtype=torch.int32, **dev),
        sparse_bias_values=torch.zeros(BATCH, 2, **dev),
        allowed_mask=torch.full((BATCH, 2), -1, dtype=torch.int32, **dev),
        empty_mask_token=None, vocab_start=0,
    )


def other_device(device):
    return "meta" if device == "cpu" else "cpu"


def bad_op_args(device):
    """(overrides, message) pairs; each message names the argument."""
    other = other_device(device)
    i32, i64 = torch.int32, torch.int64
    return [
        (dict(logit_bias=torch.zeros(VOCAB + 1)), r"logit_bias must have shape \[V\] = \[40\], got shape \[41\]"),
        (dict(logit_bias=torch.zeros(1, VOCAB)), r"logit_bias must have shape \[V\]"),
        (dict(logit_bias=torch.zeros(VOCAB, dtype=torch.float64)), r"logit_bias must be float32"),
        (dict(logit_bias=torch.zeros(VOCAB, dtype=torch.bfloat16)), r"logit_bias must be float32"),
        (dict(logit_bias=torch.zeros(VOCAB, device=other)), r"logit_bias must be on hidden's device"),
        (dict(sparse_bias_ids=torch.zeros(BATCH + 1, 2, dtype=i32)), r"sparse_bias_ids must have shape \[B, K\]"),
        (dict(sparse_bias_ids=torch.zeros(BATCH * 2, dtype=i32)), r"sparse_bias_ids must have shape \[B, K\]"),
        (dict(sparse_bias_ids=torch.zeros(BATCH, 2)), r"sparse_bias_ids must be int32 or int64"),
        (dict(sparse_bias_ids=torch.zeros(BATCH, 2, dtype=i32, device=other)),
         r"sparse_bias_ids must be on hidden's device"),
        (dict(sparse_bias_values=torch.zeros(BATCH, 3)), r"sparse_bias_values must have shape \[B, K\]"),
        (dict(sparse_bias_values=torch.zeros(BATCH, 2, dtype=torch.float16)), r"sparse_bias_values must be float32"),
        (dict(sparse_bias_values=torch.zeros(BATCH, 2, device=other)),
         r"sparse_bias_values must be on hidden's device"),
        (dict(sparse_bias_values=None),
         r"sparse_bias_ids and sparse_bias_values go together; got only sparse_bias_ids\b"),
        (dict(sparse_bias_ids=None),
         r"sparse_bias_ids and sparse_bias_values go together; got only sparse_bias_values"),
        (dict(allowed_mask=torch.full((BATCH, 1), -1, dtype=i32)),
         r"allowed_mask must have shape \[B, ceil\(V / 32\)\] = \[3, 2\], got shape \[3, 1\]"),  # too short
        (dict(allowed_mask=torch.full((BATCH + 1, 2), -1, dtype=i32)), r"allowed_mask must have shape"),
        (dict(allowed_mask=torch.full((BATCH, 2), -1, dtype=i64)), r"allowed_mask must be int32"),
        (dict(allowed_mask=torch.ones(BATCH, VOCAB, dtype=torch.bool)), r"allowed_mask must be int32"),
        (dict(allowed_mask=torch.full((BATCH, 2), -1, dtype=i32, device=other)),
         r"allowed_mask must be on hidden's device"),
        (dict(seed=torch.arange(BATCH, dtype=i32)), r"seed must be an int64 tensor"),
        (dict(seed=torch.arange(BATCH).double()), r"seed must be an int64 tensor"),
        (dict(seed=torch.arange(BATCH + 1)), r"seed must have shape \[\] .* or \[B\] = \[3\]"),
        (dict(offset=torch.zeros(BATCH, dtype=i32)), r"offset must be an int64 tensor"),
        (dict(temperatures=torch.ones(BATCH + 1)), r"temperatures must have shape \[B\] = \[3\]"),
        (dict(temperatures=torch.ones(BATCH, dtype=torch.float64)), r"temperatures must be a float32 tensor"),
        (dict(temperatures=torch.ones(BATCH, device=other)), r"temperatures must be on hidden's device"),
        (dict(temperature=-1.0), r"temperature must be finite and >= 0"),
        (dict(temperature=math.nan), r"temperature must be finite and >= 0"),
        (dict(vocab_start=-1), r"vocab_start must be >= 0"),
        (dict(vocab_start=2**31 - VOCAB), r"vocab_start must be >= 0 with vocab_start \+ V < 2\^31"),
        (dict(num_samples=0), r"num_samples must be >= 1"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op_name", ["sample", "sample_with_scores"])
def test_bad_op_arguments_raise_errors_naming_them(device, op_name):
    op = getattr(torch.ops.flashsampling, op_name)
    for overrides, message in bad_op_args(device):
        args = valid_op_args(device)
        for k, v in overrides.items():
            # CPU-built overrides stand for "on hidden's device", except the device cases.
            if isinstance(v, torch.Tensor) and "device" not in message:
                v = v.to(device)
            args[k] = v
        with pytest.raises(RuntimeError, match="flashsampling.sample: " + message):
            op(args.pop("hidden"), args.pop("weight"), **args)


def test_bad_host_temperature_values_raise():
    hidden, weight = make_problem(3, 40, 8)
    for temps, message in [(torch.tensor([1.0, -1.0, 1.0]), r"temperatures must be finite and >= 0"),
                           (torch.tensor([1.0, math.nan, 1.0]), r"temperatures must be finite and >= 0"),
                           (torch.tensor(-2.0), r"temperatures must be finite and >= 0"),
                           (-0.5, r"temperature must be finite and >= 0"),
                           (math.nan, r"temperature must be finite and >= 0"),
                           (1e-40, r"temperature must be finite and >= 0"),
                           (torch.tensor([1.0, 1e-39, 1.0]), r"temperatures must be finite and >= 0")]:
        with pytest.raises(RuntimeError, match=message):
            fs.sample(hidden, weight, temperature=temps, seed=0)


@pytest.mark.requires_cuda
def test_invalid_temperature_in_device_tensor_gives_minus_one():
    """Values inside a CUDA tensor are not read on the host (no sync): a row with a
    negative or NaN temperature gets token -1 (docs/api.md), the others sample normally."""
    hidden, weight = problem(4, 1000, 64, "cuda", seed=3)
    temps = torch.tensor([1.0, -1.0, math.nan, 0.0], device="cuda")
    tokens = fs.sample(hidden, weight, temperature=temps, seed=1, num_samples=2)
    assert (tokens[1:3] == -1).all()
    assert (tokens[[0, 3]] >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_wrapper_errors_name_the_argument(device):
    hidden, weight = problem(3, 40, 8, device)
    cases = [
        (dict(allowed_mask=torch.ones(3, 41, dtype=torch.bool, device=device)), ValueError,
         r"a bool allowed_mask must have shape \[B, V\] = \[3, 40\]"),
        (dict(allowed_mask=torch.ones(3, 40, dtype=torch.uint8, device=device)), RuntimeError,
         r"allowed_mask must be int32"),
        (dict(sparse_logit_bias=[{1: 1.0}] * 2), ValueError, r"sparse_logit_bias must hold one dict per row: B = 3"),
        (dict(sparse_logit_bias={1: 1.0}), TypeError, r"sparse_logit_bias must be a pair"),
        (dict(sparse_logit_bias=(torch.zeros(3, 2, device=device), torch.zeros(3, 2, device=device))),
         RuntimeError, r"sparse_bias_ids must be int32 or int64"),
        (dict(logit_bias=[0.0] * 40), TypeError, r"logit_bias must be a tensor"),
        (dict(logit_bias=torch.zeros(40, dtype=torch.int64, device=device)), RuntimeError,
         r"logit_bias must be float32"),
        (dict(seed=torch.arange(3, dtype=torch.int32, device=device)), RuntimeError, r"seed must be an int64 tensor"),
        (dict(seed=1.5), TypeError, r"seed: expected an int"),
        (dict(seed=1, offset=2**64), ValueError, r"offset: .* does not fit in 64 bits"),
        (dict(temperature=torch.ones(4, device=device)), RuntimeError, r"temperatures must have shape \[B\] = \[3\]"),
        (dict(temperature=torch.ones(3, dtype=torch.int64, device=device)), TypeError,
         r"temperature must be a float, a 0-d or a \[B\] floating tensor, got a torch.int64 tensor"),
    ]
    for kwargs, error, message in cases:
        kwargs.setdefault("seed", 0)
        with pytest.raises(error, match="flashsampling.sample: " + message):
            fs.sample(hidden, weight, **kwargs)


def test_pack_allowed_mask_is_xgrammar_layout():
    allowed = torch.zeros(2, 70, dtype=torch.bool)
    allowed[0, [0, 31, 32, 69]] = True
    allowed[1, 5] = True
    packed = fs.pack_allowed_mask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (2, 3)
    assert packed.tolist() == [[1 - 2**31, 1, 1 << 5], [1 << 5, 0, 0]]
    with pytest.raises(ValueError, match="allowed_mask"):
        fs.pack_allowed_mask(torch.ones(2, 3))


# ---------------------------------------------------------------- torch integration

def _every_option(device):
    batch, vocab = 4, 300
    hidden, weight = problem(batch, vocab, 16, device, seed=12)
    c = random_controls(batch, vocab, device, vocab_start=32, seed=12, density=0.5)
    return hidden, weight, c


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_both_ops_every_option(device):
    hidden, weight, c = _every_option(device)
    ids, values = c["sparse_logit_bias"]
    kwargs = dict(temperature=1.0, temperatures=torch.tensor([0.5, 1.0, 0.0, 2.0], device=device), num_samples=3,
                  seed=torch.arange(4, device=device), offset=torch.tensor(7, device=device),
                  logit_bias=c["logit_bias"], sparse_bias_ids=ids, sparse_bias_values=values,
                  allowed_mask=c["allowed_mask"], empty_mask_token=-1, vocab_start=32)
    torch.library.opcheck(torch.ops.flashsampling.sample.default, (hidden, weight), kwargs)
    torch.library.opcheck(torch.ops.flashsampling.sample.default, (hidden, weight),
                          dict(kwargs, streams=torch.tensor([3, 0, 2, 1], device=device)))
    for return_logprobs in (False, True):
        torch.library.opcheck(torch.ops.flashsampling.sample_with_scores.default, (hidden, weight),
                              dict(kwargs, return_logprobs=return_logprobs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sparse_form", ["pair", "dicts"])
def test_torch_compile_fullgraph_every_option(device, sparse_form):
    hidden, weight, c = _every_option(device)
    ids, values = c["sparse_logit_bias"]
    dicts = as_dicts(ids, values)  # traced as constants: the conversion happens in the graph

    def decode_step(h, w, temps, seeds, offsets, bias, ids, values, allowed):
        sparse = (ids, values) if sparse_form == "pair" else dicts
        # Scaling by 2 is exact, so eager and inductor feed the op the same bits.
        return fs.sample(h * 2, w, temperature=temps, seed=seeds, offset=offsets, num_samples=2,
                         logit_bias=bias * 2, sparse_logit_bias=sparse, allowed_mask=allowed,
                         empty_mask_token=-1, return_logprobs=True, vocab_start=32)

    args = (hidden, weight, torch.tensor([0.5, 1.0, 0.0, 2.0], device=device), torch.arange(4, device=device),
            torch.full((4,), 3, device=device), c["logit_bias"], ids, values, c["allowed_bool"])
    compiled = torch.compile(decode_step, fullgraph=True)
    got, expected = compiled(*args), decode_step(*args)
    assert isinstance(got, fs.SampleOutput)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.logsumexp, expected.logsumexp, rtol=1e-5, atol=0)


@pytest.mark.parametrize("isa", ["default", "avx2", "avx512", "avx512bf16"])
def test_every_cpu_code_path_gives_the_same_results(isa, monkeypatch):
    """The transform pass (biases, mask, logsumexp) is compiled per instruction set like
    the scan: tokens and scores are bit-identical, log-probabilities equal to ~1e-6. (The
    logits kernels of the instruction sets sum in different orders: the data are multiples of
    1/4 whose logits every order gives exactly.)"""
    hidden, weight = integer_problem(6, 5000, 24, seed=30)
    hidden = hidden * 0.25
    c = random_controls(6, 5000, "cpu", vocab_start=96, seed=30, density=0.4)
    kwargs = dict(temperature=torch.tensor([1.0, 0.0, 0.6, 1.5, 0.0, 2.0]), seed=5, num_samples=3,
                  logit_bias=c["logit_bias"], sparse_logit_bias=c["sparse_logit_bias"],
                  allowed_mask=c["allowed_mask"], vocab_start=96, return_logprobs=True)
    monkeypatch.setenv("FLASHSAMPLING_CPU_ISA", "default")
    expected = fs.sample_with_scores(hidden, weight, **kwargs)
    monkeypatch.setenv("FLASHSAMPLING_CPU_ISA", isa)
    try:
        got = fs.sample_with_scores(hidden, weight, **kwargs)
    except RuntimeError as e:
        pytest.skip(str(e))
    assert torch.equal(got.tokens, expected.tokens) and torch.equal(got.scores, expected.scores)
    torch.testing.assert_close(got.token_logprobs, expected.token_logprobs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logsumexp, expected.logsumexp, rtol=1e-6, atol=0)
