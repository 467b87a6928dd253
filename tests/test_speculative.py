"""speculative_sample (flashsampling_cuda/speculative.py): the emitted tokens follow the target
(chi-square, one-hot and sampled drafts), pathwise against the float64 reference, the bonus token
is sample()'s, greedy verification, argument errors, the routes against each other, torch.compile.
CPU always; CUDA where there is a GPU."""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.reference import reference_speculative_sample
from sampling_stats import chi_square_pvalue

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def problem(batch, positions, vocab, dim, device, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, positions, dim, generator=g).to(torch.bfloat16).to(device)
    weight = (torch.randn(vocab, dim, generator=g) * scale / dim**0.5).to(torch.bfloat16).to(device)
    return hidden, weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("truncation", [{}, dict(top_k=8, top_p=0.85), dict(min_p=0.1)], ids=["none", "k_p", "min_p"])
def test_emitted_tokens_follow_the_target(device, sampled_drafts, truncation):
    """Many independent rows (per-row seeds) of one problem: the first emitted token is a sample
    of the target p_0 whatever the draft; the second, on rows that accepted the first draft, of
    p_1 (chi-square, fixed seeds); with truncation the target is the truncated, renormalised
    distribution (float64 reference)."""
    from flashsampling_cuda.reference import reference_truncation

    rows, n, vocab, dim = 20000, 2, 24, 16
    one, weight = problem(1, n + 1, vocab, dim, device, seed=1, scale=3.0)
    hidden = one.expand(rows, n + 1, dim).contiguous()
    x = one[0].double() @ weight.double().T
    p = torch.softmax(x / 0.8, dim=1).cpu()
    if truncation:
        ref = reference_truncation(one[0], weight, 0.8, **truncation)
        assert (ref.boundary_gap > 1e-4).all()
        p = torch.where(ref.survivors.cpu(), p, 0.0)
        p = p / p.sum(dim=1, keepdim=True)
    g = torch.Generator().manual_seed(2)
    if sampled_drafts:
        q = torch.softmax(torch.randn(n, vocab, generator=g) * 1.5, dim=1)
        drafts = torch.stack([torch.multinomial(q[j], rows, replacement=True, generator=g) for j in range(n)], dim=1)
        draft_probs = q[None].expand(rows, n, vocab).to(device)
    else:
        drafts = torch.tensor([[int(p[0].argmax()), 5]]).expand(rows, n)
        draft_probs = None
    out = fs.speculative_sample(hidden, weight, drafts.to(device).contiguous(), draft_probs, temperature=0.8,
                                seed=torch.arange(rows, device=device) * 7 + 1, offset=3, **truncation)
    first = out.tokens[:, 0].cpu()
    second = out.tokens[out.num_accepted.cpu() >= 1, 1].cpu()
    assert (p[0][first] > 0).all() and (p[1][second] > 0).all()  # survivors only (chi-square pools empty bins)
    assert chi_square_pvalue([first], [p[0]]) > 1e-3
    assert chi_square_pvalue([second], [p[1]]) > 1e-3
    # every emitted token is a real token up to the first non-draft, -1 after
    emitted = out.num_accepted.cpu() + 1
    slots = torch.arange(n + 1)[None, :]
    assert ((out.tokens.cpu() >= 0) == (slots < emitted[:, None])).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_acceptance_rate_is_the_sum_of_min_p_q(device, sampled_drafts):
    """The first draft's acceptance rate over many rows (per-row seeds) is sum_v min(p_v, q_v),
    the theoretical rate (p(d) for a one-hot draft d): within 4 binomial standard deviations."""
    rows, vocab, dim = 40000, 24, 16
    one, weight = problem(1, 2, vocab, dim, device, seed=5, scale=3.0)
    hidden = one.expand(rows, 2, dim).contiguous()
    p = torch.softmax((one[0, 0].double() @ weight.double().T) / 0.8, dim=0).cpu()
    g = torch.Generator().manual_seed(6)
    if sampled_drafts:
        q = torch.softmax(torch.randn(vocab, generator=g) * 1.5, dim=0)
        drafts = torch.multinomial(q, rows, replacement=True, generator=g)[:, None]
        draft_probs = q.float()[None, None].expand(rows, 1, vocab).to(device)
        rate = float(torch.minimum(p, q.double()).sum())
    else:
        d = int(p.argsort()[-3])  # a token with some, not most, of the mass
        drafts = torch.full((rows, 1), d)
        draft_probs, rate = None, float(p[d])
    out = fs.speculative_sample(hidden, weight, drafts.to(device), draft_probs, temperature=0.8,
                                seed=torch.arange(rows, device=device) * 11 + 5)
    observed = float(out.num_accepted.double().mean())
    assert abs(observed - rate) < 4 * (rate * (1 - rate) / rows) ** 0.5, (observed, rate)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["one_hot", "sampled", "greedy_rows", "sampled_greedy_rows", "truncated_masked",
                                  "masked_biased"])
def test_pathwise_against_float64_reference(device, case):
    batch, n, vocab, dim = 24, 4, 400, 32
    hidden, weight = problem(batch, n + 1, vocab, dim, device, seed=3, scale=4.0)
    x = hidden.float() @ weight.float().T
    g = torch.Generator().manual_seed(4)
    near = torch.rand(batch, n, generator=g) < 0.7
    drafts = torch.where(near, x[:, :n].argmax(2).cpu(), torch.randint(0, vocab, (batch, n), generator=g)).to(device)
    kwargs = dict(seed=11, offset=5, temperature=0.9)
    draft_probs = None
    if case in ("sampled", "sampled_greedy_rows"):
        draft_probs = torch.softmax(torch.randn(batch, n, vocab, generator=g), dim=2).to(device)
    if case in ("greedy_rows", "sampled_greedy_rows"):
        kwargs["temperature"] = torch.tensor([0.0, 0.7, 1.3] * (batch // 3), device=device)
    if case in ("truncated_masked", "masked_biased"):
        mask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), generator=g, dtype=torch.int64)
        kwargs.update(allowed_mask=(mask.to(torch.int32) | 0x1).to(device), logit_bias=torch.randn(vocab).to(device))
    if case == "truncated_masked":
        kwargs.update(top_k=torch.randint(3, 60, (batch,), generator=g).to(device), top_p=0.9)
    out = fs.speculative_sample(hidden, weight, drafts, draft_probs, **kwargs)
    ref = reference_speculative_sample(hidden, weight, drafts, draft_probs, **kwargs)
    clear = ref.margin.cpu() > 1e-4
    assert clear.sum() >= batch // 2
    assert torch.equal(out.tokens.cpu()[clear], ref.tokens.cpu()[clear])
    assert torch.equal(out.num_accepted.cpu()[clear], ref.num_accepted.cpu()[clear])


def test_bonus_token_is_the_plain_sample():
    """No drafts (n = 0): the emitted token is sample()'s at the same seed and offset; with n
    drafts all accepted, the bonus is sample()'s at offset + n."""
    hidden, weight = problem(6, 1, 500, 32, "cpu", seed=5)
    out = fs.speculative_sample(hidden, weight, torch.zeros(6, 0, dtype=torch.int64), seed=4, offset=10)
    assert torch.equal(out.tokens[:, 0], fs.sample(hidden[:, 0], weight, seed=4, offset=10)[:, 0])
    hidden, weight = problem(6, 3, 500, 32, "cpu", seed=6)
    greedy_path = (hidden.float() @ weight.float().T).argmax(2)
    out = fs.speculative_sample(hidden, weight, greedy_path[:, :2].contiguous(), temperature=0.0, seed=4, offset=10)
    assert (out.num_accepted == 2).all()
    assert torch.equal(out.tokens, greedy_path)


@pytest.mark.parametrize("device", DEVICES)
def test_sampled_drafts_edge_steps(device):
    """Sampled drafts with n = 0 (no draft position: the op's stats have no rows) emit sample()'s
    token; a temperature that rounds to 0 in float32 verifies greedily, as T = 0 does."""
    hidden, weight = exact_problem(6, 1, 300, 16, device, seed=3)
    none = torch.zeros(6, 0, dtype=torch.int64, device=device)
    out = fs.speculative_sample(hidden, weight, none, torch.zeros(6, 0, 300, device=device), seed=4, offset=10)
    assert torch.equal(out.tokens[:, 0], fs.sample(hidden[:, 0], weight, seed=4, offset=10)[:, 0])
    assert (out.num_accepted == 0).all()
    hidden, weight = exact_problem(4, 4, 300, 16, device, seed=8)
    path = (hidden.double() @ weight.double().T).argmax(2)
    q = torch.softmax(torch.randn(4, 3, 300, generator=torch.Generator().manual_seed(3)), -1).to(device)
    steps = [fs.speculative_sample(hidden, weight, path[:, :3].contiguous(), q, temperature=t, seed=2)
             for t in (0.0, 1e-46)]
    assert (steps[0].num_accepted == 3).all()
    assert torch.equal(steps[0].tokens, steps[1].tokens) and torch.equal(steps[0].num_accepted, steps[1].num_accepted)


def test_greedy_rejection_emits_the_argmax():
    hidden, weight = problem(4, 4, 300, 32, "cpu", seed=7)
    path = (hidden.float() @ weight.float().T).argmax(2)
    drafts = path[:, :3].clone()
    drafts[:, 1] = (drafts[:, 1] + 1) % 300  # wrong at position 1
    out = fs.speculative_sample(hidden, weight, drafts, temperature=0.0, seed=1, return_logprobs=True)
    assert (out.num_accepted == 1).all()
    assert torch.equal(out.tokens[:, :2], path[:, :2]) and (out.tokens[:, 2:] == -1).all()
    assert out.logprobs[:, :2].isfinite().all() and out.logprobs[:, 2:].isnan().all()


@pytest.mark.parametrize("args,kwargs,match", [
    (lambda h, w: (h[:, 0], w, torch.zeros(2, 1, dtype=torch.int64)), {}, "hidden"),
    (lambda h, w: (h, w, torch.zeros(2, 3, dtype=torch.int64)), {}, "draft_token_ids"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int32)), {}, "draft_token_ids"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1, 7)), {}, "draft_probs"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(temperature=-1.0), "temperature"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(seed=torch.zeros(3, dtype=torch.int64)), "seed"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(logit_bias=torch.zeros(7)), "logit_bias"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(temperature=torch.ones(3)), "temperature"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)),
     dict(allowed_mask=torch.zeros(2, 2, dtype=torch.int64)), "allowed_mask"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(seed=1, generator=torch.Generator()),
     "speculative_sample: pass either seed or generator"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(top_k=-5), "speculative_sample: top_k"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(top_p=1.5), "speculative_sample: top_p"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64)), dict(logit_scale=0.0),
     "speculative_sample: logit_scale"),
    (lambda h, w: (h, w, torch.tensor([[3], [50]])), {}, r"draft_token_ids\[1, 0\] = 50 .*\[0, 50\)"),
    (lambda h, w: (h, w, torch.tensor([[3], [-1]])), {}, r"draft_token_ids\[1, 0\] = -1"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1, 50), 0.03)), {},
     r"draft_probs\[0, 0\] is not a distribution .* sums to 1.5"),
    (lambda h, w: (h, w, torch.zeros(2, 1, dtype=torch.int64),
                   torch.cat([torch.full((2, 1, 49), 1 / 48), torch.full((2, 1, 1), -1 / 48)], dim=2)), {},
     r"draft_probs\[0, 0\] is not a distribution"),
])
def test_argument_errors(args, kwargs, match):
    hidden, weight = problem(2, 2, 50, 8, "cpu")
    with pytest.raises(ValueError, match=match):
        fs.speculative_sample(*args(hidden, weight), **kwargs)


def test_greedy_row_that_allows_nothing_accepts_no_draft_and_empty_batches():
    """A greedy row whose mask allows nothing matches no draft (the argmax of nothing is no token);
    a batch of no rows gives empty outputs."""
    hidden, weight = problem(2, 3, 50, 8, "cpu")
    mask = torch.ones(2, 50, dtype=torch.bool)
    mask[1] = False
    out = fs.speculative_sample(hidden, weight, torch.zeros(2, 2, dtype=torch.int64), temperature=0.0, seed=1,
                                allowed_mask=mask)
    assert int(out.num_accepted[1]) == 0 and int(out.tokens[1, 0]) == -1
    q = torch.full((2, 2, 50), 1 / 50)
    for temperature in (0.0, 0.8):  # sampled drafts: no residual, no argmax
        out = fs.speculative_sample(hidden, weight, torch.zeros(2, 2, dtype=torch.int64), q, temperature=temperature,
                                    seed=1, allowed_mask=mask)
        assert int(out.num_accepted[1]) == 0 and int(out.tokens[1, 0]) == -1 and int(out.tokens[0, 0]) >= 0
    empty = fs.speculative_sample(hidden[:0], weight, torch.zeros(0, 2, dtype=torch.int64), seed=1,
                                  return_logprobs=True)
    assert empty.tokens.shape == (0, 3) and empty.num_accepted.shape == (0,) and empty.logprobs.shape == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("truncated", [False, True])
@pytest.mark.parametrize("per_row_seed", [False, True])
@pytest.mark.parametrize("scalar_temperature", [False, True])
def test_one_hot_tokens_are_the_plain_samples(device, truncated, per_row_seed, scalar_temperature):
    """One-hot drafts: the token at every emitted position j is the token sample() draws from
    hidden[:, j] at offset + j (the same noise, truncation included), the drafts before it are
    those tokens, and the emitted one is not its draft; log-probabilities are sample()'s. A scalar
    temperature with a batch-wide seed and B % 4 == 0 beyond 32 columns is the plain loop's case on
    sm90 (several samples alone; 36 x 4 = 144 columns: its three 64-wide tiles)."""
    batch, n, vocab, dim = 24 if not scalar_temperature else 36, 3, 700, 32
    hidden, weight = exact_problem(batch, n + 1, vocab, dim, device, seed=12)
    g = torch.Generator().manual_seed(13)
    x = hidden.float().cpu() @ weight.float().cpu().T
    drafts = torch.where(torch.rand(batch, n, generator=g) < 0.8, x[:, :n].argmax(2),
                         torch.randint(0, vocab, (batch, n), generator=g)).to(device)
    temps = 0.7 if scalar_temperature else torch.tensor([0.0, 0.4, 0.9, 1.5] * (batch // 4), device=device)
    seed = torch.arange(batch, device=device) * 5 + 2 if per_row_seed else 2
    offset = torch.arange(batch, device=device) % 3 + 4 if per_row_seed else 4
    extra = dict(top_k=torch.randint(1, 40, (batch,), generator=g).to(device), top_p=0.8) if truncated else {}
    out = fs.speculative_sample(hidden, weight, drafts, temperature=temps, seed=seed, offset=offset,
                                return_logprobs=True, **extra)
    for j in range(n + 1):
        plain = fs.sample(hidden[:, j], weight, temperature=temps, seed=seed, offset=offset + j, return_logprobs=True,
                          **extra)
        emitted = out.num_accepted >= j
        assert torch.equal(out.tokens[emitted, j], plain.tokens[emitted, 0]), j
        torch.testing.assert_close(out.logprobs[emitted, j], plain.logprobs[emitted, 0], atol=2e-5, rtol=2e-5)
        if j < n:
            accepted = out.num_accepted > j
            assert torch.equal(out.tokens[accepted, j], drafts[accepted, j])
            stopped = out.num_accepted == j
            assert (plain.tokens[stopped, 0] != drafts[stopped, j]).all()
    assert (out.num_accepted > 0).any() and (out.num_accepted < n).any()  # acceptances and rejections


def exact_problem(batch, positions, vocab, dim, device, seed):
    """Small integers (weights in quarters): every fp32 dot product is exact, so the fused GEMM,
    cuBLAS, the CPU op and a dot product of one row give the same logits bit for bit."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (batch, positions, dim), generator=g).to(torch.bfloat16).to(device)
    weight = (torch.randint(-2, 3, (vocab, dim), generator=g) / 4).to(torch.bfloat16).to(device)
    return hidden, weight


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("per_row_seed", [False, True])
@pytest.mark.parametrize("transforms", [False, True])
def test_fused_one_hot_route_equals_the_logits_route(device, masked, per_row_seed, transforms):
    """position_tokens_fused (one fused call over the B * (n + 1) rows, _sample_positions giving
    position j of row b sample j's noise of row b) returns the tokens and log-probabilities of
    position_tokens_from_logits (the logits materialised, a sample_from_logits call a position)
    on logits both compute exactly: greedy and sampled rows, a mask, a bias, scale and soft-cap,
    batch-wide and per-row seeds, a vocab_start; and the same tokens without log-probabilities."""
    from flashsampling_cuda import speculative

    batch, n, vocab, dim, vocab_start = 36, 3, 700, 32, 5
    hidden, weight = exact_problem(batch, n + 1, vocab, dim, device, seed=8)
    g = torch.Generator().manual_seed(9)
    x = hidden.float().cpu() @ weight.float().cpu().T
    drafts = torch.where(torch.rand(batch, n, generator=g) < 0.7, x[:, :n].argmax(2),
                         torch.randint(0, vocab, (batch, n), generator=g)) + vocab_start
    drafts = drafts.to(device)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * (batch // 4), device=device)
    mask = None
    if masked:
        bits = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), generator=g, dtype=torch.int64)
        mask = (bits.to(torch.int32) | 0x1).to(device)
    bias = (torch.randint(-8, 9, (vocab,), generator=g) / 8).to(device) if transforms else None
    seed = torch.arange(batch, device=device) * 7 + 3 if per_row_seed else 3
    offset = torch.arange(batch, device=device) % 4 + 7 if per_row_seed else 7
    scale, softcap = (0.5, 8.0) if transforms else (1.0, None)
    step = speculative.parse_step("test", hidden, weight, drafts, None, temps, seed, offset, None, None, None, None,
                                  scale, softcap, bias, mask)
    fused, fused_logp = assert_route_equals_logits_route(speculative.position_tokens_fused,
                                                         (hidden, weight, bias, mask, step, vocab_start))
    out = speculative.one_hot_output(drafts, fused, fused_logp)
    assert (out.num_accepted > 0).any() and (out.num_accepted < n).any()  # acceptances and rejections


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["top_k_int", "top_k_rows", "top_p_rows", "min_p", "mixed_rows", "zero_dim",
                                  "top_k_large_int_min_p"])
@pytest.mark.parametrize("per_row_seed", [False, True])
@pytest.mark.parametrize("per_row_offset", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_truncated_route_equals_the_logits_route(device, form, per_row_seed, per_row_offset, masked):
    """position_tokens_truncated_fused (one sample_top_k call over the B * (n + 1) rows, row j * B + b
    with row b's truncation, seed, offset + j and, with a batch-wide seed, row b's noise stream)
    returns the tokens and log-probabilities of position_tokens_from_logits (a sample_from_logits
    call a position) on logits both compute exactly: every truncation form, per-row mixes with rows
    whose truncation is off, greedy rows, a mask, a bias, batch-wide and per-row seeds. On the CPU
    the op's kernel takes the streams through sample_with_scores."""
    from flashsampling_cuda import speculative

    batch, n, vocab, dim = 12, 3, 4608, 64
    hidden, weight = exact_problem(batch, n + 1, vocab, dim, device, seed=21)
    g = torch.Generator().manual_seed(22)
    x = hidden.float().cpu() @ weight.float().cpu().T
    drafts = torch.where(torch.rand(batch, n, generator=g) < 0.7, x[:, :n].argmax(2),
                         torch.randint(0, vocab, (batch, n), generator=g)).to(device)
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * (batch // 4), device=device)
    rows = torch.arange(batch, device=device)
    truncation = {
        "top_k_int": dict(top_k=20),
        # a host top_k above 64 without top_p: stage 2's large selection (sm90), every tile recomputed
        "top_k_large_int_min_p": dict(top_k=300, min_p=0.05),
        "top_k_rows": dict(top_k=(rows * 13) % 90 + 1),
        "top_p_rows": dict(top_p=torch.linspace(0.3, 0.95, batch, device=device)),
        "min_p": dict(min_p=0.2),
        "mixed_rows": dict(top_k=torch.where(rows % 3 == 0, -1, rows + 3), top_p=torch.where(rows % 2 == 0, 1.0, 0.8)
                           .to(device), min_p=0.05),
        "zero_dim": dict(top_k=torch.tensor(30, device=device), top_p=torch.tensor(0.9, device=device),
                         min_p=torch.tensor(0.02)),
    }[form]
    mask = None
    if masked:
        bits = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), generator=g, dtype=torch.int64)
        mask = (bits.to(torch.int32) | 0x1).to(device)
    bias = (torch.randint(-8, 9, (vocab,), generator=g) / 8).to(device)
    seed = rows * 7 + 3 if per_row_seed else 3
    offset = rows % 4 + 7 if per_row_offset else 7
    step = speculative.parse_step("test", hidden, weight, drafts, None, temps, seed, offset, truncation.get("top_k"),
                                  truncation.get("top_p"), truncation.get("min_p"), None, 1.0, None, bias, mask)
    if device == "cuda" and not speculative.fused_top_k_takes_positions(hidden, weight, step):
        assert torch.cuda.get_device_capability() != (9, 0)  # sm90 takes every form
        pytest.skip("the fused top-k pass takes per-row, top_p and min_p forms on sm90 only")
    assert_route_equals_logits_route(speculative.position_tokens_truncated_fused, (hidden, weight, bias, mask, step, 0))


def assert_route_equals_logits_route(route, args):
    """``route(*args, return_logprobs)`` gives position_tokens_from_logits' tokens and
    log-probabilities, and the same tokens without log-probabilities; returns its outputs."""
    from flashsampling_cuda import speculative

    tokens, logp = route(*args, True)
    logits_route, logits_logp = speculative.position_tokens_from_logits(*args, True)
    assert torch.equal(tokens, logits_route)
    torch.testing.assert_close(logp, logits_logp, atol=2e-5, rtol=2e-5, equal_nan=True)
    without, none = route(*args, False)
    assert torch.equal(without, tokens) and none is None
    return tokens, logp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_row", [False, True])
def test_sample_positions_op(device, per_row):
    """flashsampling._sample_positions (the fused route's op): opcheck (schema, fake kernel,
    torch.compile's dispatch), each position's tokens equal sample()'s at offset + j, and a clear
    error for rows that are not positions * B."""
    batch, positions, vocab, dim = 8, 3, 300, 16
    hidden, weight = exact_problem(batch, positions, vocab, dim, device, seed=2)
    rows = hidden.transpose(0, 1).reshape(positions * batch, dim)
    seed = torch.arange(batch, device=device) + 4 if per_row else torch.tensor(4, device=device)
    offset = torch.arange(batch, device=device) * 3 if per_row else torch.tensor(9, device=device)
    temps = torch.tensor([0.0, 0.7] * (batch // 2), device=device)
    kwargs = dict(temperatures=temps, seed=seed, offset=offset, return_logprobs=True)
    torch.library.opcheck(torch.ops.flashsampling._sample_positions.default, (rows, weight, positions), kwargs)
    tokens, _, logp = torch.ops.flashsampling._sample_positions(rows, weight, positions, **kwargs)
    assert tokens.shape == logp.shape == (batch, positions)
    for j in range(positions):
        plain = fs.sample(hidden[:, j], weight, temperature=temps, seed=seed, offset=offset + j, return_logprobs=True)
        assert torch.equal(tokens[:, j], plain.tokens[:, 0])
        torch.testing.assert_close(logp[:, j], plain.logprobs[:, 0], atol=2e-5, rtol=2e-5)
    with pytest.raises(RuntimeError, match=r"_sample_positions: hidden must be \[positions \* B, D\]"):
        torch.ops.flashsampling._sample_positions(rows[:-1], weight, positions, seed=seed, offset=offset)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("vocab", [9000, 9001])  # the stop-row kernel's four-token groups, and single tokens
def test_sampled_draft_ops(device, masked, vocab):
    """_draft_position_stats and _stop_row_logits (the sampled drafts' route): opcheck, and on
    CUDA the kernels against their CPU kernels (torch ops) on the same inputs: greedy rows
    (scale 1), ties of the largest logit (the first index), drafts outside the shard (-1), a row
    position that allows nothing, +inf and NaN logits (alone and together), residual and target
    rows."""
    g = torch.Generator().manual_seed(21)
    batch, positions = 6, 4  # several vocabulary chunks a position on CUDA
    logits = (torch.randint(-40, 40, (batch, positions, vocab), generator=g) / 8).float()
    logits[0, 1, 10] = logits[0, 1, 20] = logits[0, 1].max() + 1  # a tie: index 10
    scales = torch.tensor([1.0, 1.25, 0.5, 2.0, 1.0, 0.75])
    columns = torch.randint(0, vocab, (batch, positions - 1), generator=g)
    columns[1, 2] = -1
    allowed = torch.rand(batch, positions, vocab, generator=g) < 0.6 if masked else None
    if masked:
        allowed[2, 0] = False  # nothing allowed: lse -inf
    logits[3, 0, 7] = torch.inf  # lse +inf (torch.logsumexp's), argmax 7
    logits[5, 2, 9] = torch.nan  # lse NaN, argmax 9
    # the same past a thread's first steps (on CUDA after steps without +inf or NaN), and both in a
    # row (lse NaN)
    logits[1, 0, 3000] = torch.inf
    logits[4, 2, 2500] = torch.nan
    logits[0, 2, 100], logits[0, 2, 2600] = torch.inf, torch.nan
    q = torch.softmax(torch.randn(batch, positions - 1, vocab, generator=g), dim=2)
    stop = torch.tensor([0, 1, 2, 3, 1, 0])
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    stats = torch.ops.flashsampling._draft_position_stats(on(logits), on(scales), on(columns), on(allowed))
    expected = torch.ops.flashsampling._draft_position_stats(logits, scales, columns, allowed)
    torch.testing.assert_close(stats[0].cpu(), expected[0], rtol=2e-6, atol=2e-6, equal_nan=True)
    assert torch.equal(stats[1].cpu(), expected[1]) and int(expected[1][0, 1]) == 10
    assert torch.equal(stats[2].cpu(), expected[2])
    lse = expected[0].contiguous()
    # row 4 at position 1: q >= p everywhere, a residual without mass (the target's logits instead);
    # masked, row 2 at position 0 allows nothing (a residual of NaN differences: no mass either)
    q[4, 1] = 2 * torch.softmax(logits[4, 1] * scales[4], dim=0)
    stop[2] = 0
    residual = torch.tensor([True, True, True, False, True, False])
    args = (logits, q, stop, scales, lse, residual, allowed)
    rows = torch.ops.flashsampling._stop_row_logits(*(on(a) for a in args))
    # compared as probabilities: a residual that cancels to near 0 may round to 0 on one side only
    want = torch.ops.flashsampling._stop_row_logits(*args)
    torch.testing.assert_close(rows.cpu().exp(), want.exp(), rtol=1e-5, atol=1e-8)
    kept = torch.ones(vocab, dtype=torch.bool) if allowed is None else allowed[4, 1]
    assert torch.equal(want[4], torch.where(kept, logits[4, 1], -torch.inf))  # the target's row
    finite = logits.nan_to_num(nan=0.0)  # (opcheck compares NaN as unequal)
    torch.library.opcheck(torch.ops.flashsampling._draft_position_stats.default,
                          (on(finite), on(scales), on(columns), on(allowed)))
    torch.library.opcheck(torch.ops.flashsampling._stop_row_logits.default,
                          tuple(on(a) for a in (finite, *args[1:])))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_row", [False, True])
def test_acceptance_and_token_ops(device, per_row):
    """_accept_drafts and _draft_tokens (a step's bookkeeping, a kernel each on CUDA): opcheck, and
    on CUDA the kernels against their CPU kernels (torch ops) on the same inputs, value for value:
    greedy rows, an invalid (NaN) temperature, drafts outside the columns, a draft with q = 0 (ratio
    +inf) or NaN q, NaN and -inf draft values, seeds and offsets as one expanded value or per row;
    tokens from each position's (one-hot) or the emitted token with the count given."""
    g = torch.Generator().manual_seed(5)
    batch, n, vocab = 12, 5, 64
    lse = torch.randn(batch, n + 1, generator=g) + 2.0
    argmax = torch.randint(0, vocab, (batch, n + 1), generator=g)
    columns = torch.randint(0, vocab, (batch, n), generator=g)
    columns[:4] = argmax[:4, :n]  # greedy rows that accept for a while
    columns[3, 2] = 7 if int(argmax[3, 2]) != 7 else 8  # ... and one that stops at position 2
    columns[5, 1], columns[6, 0] = -1, vocab  # no column
    q = torch.softmax(torch.randn(batch, n, vocab, generator=g), dim=2)
    ratio = 0.2 + 1.3 * torch.rand(batch, n, generator=g)  # p / q at the drafts: the uniforms decide some
    ratio[:4] = 1.0
    y_draft = torch.log(q.gather(2, columns.clamp(0, vocab - 1)[:, :, None])[:, :, 0] * ratio) + lse[:, :n]
    y_draft = torch.cat([y_draft, torch.randn(batch, 1, generator=g)], dim=1)
    q[7, 0, columns[7, 0]] = 0.0  # ratio +inf: accepted
    q[8, 1, columns[8, 1]] = torch.nan  # ratio +inf as well (q > 0 is false)
    y_draft[9, 0] = torch.nan  # NaN ratio: rejected
    y_draft[10, 1] = -torch.inf  # p = 0
    temps = torch.full((batch,), 0.7)
    temps[:2], temps[3], temps[11] = 0.0, 0.0, torch.nan
    if per_row:
        seeds, offsets = torch.arange(batch) * 11 + 3, torch.arange(batch) * 2
        streams = torch.zeros(batch, dtype=torch.int64)
    else:
        seeds, offsets = torch.tensor(9).expand(batch), torch.tensor(4).expand(batch)
        streams = torch.arange(batch)
    args = (lse, argmax, y_draft, columns, q, seeds, offsets, streams, temps)
    on = lambda t: t.to(device)  # noqa: E731 (expanded views stay expanded)
    got = torch.ops.flashsampling._accept_drafts(*(on(a) for a in args))
    want = torch.ops.flashsampling._accept_drafts(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True)
    num_accepted, residual, sample_temps, sample_offsets = want
    assert int(num_accepted[0]) == n and not bool(residual[0])  # a greedy row whose drafts are the argmax
    assert int(num_accepted[3]) == 2 and not bool(residual[3])
    assert int(num_accepted[6]) == 0 and bool(residual[6])
    assert torch.equal(sample_offsets, offsets + num_accepted)
    torch.testing.assert_close(sample_temps, torch.where(residual, 1.0, temps), rtol=0, atol=0, equal_nan=True)
    assert 0 < int((num_accepted[4:] < n).sum()) < batch - 4  # sampled rows both accept all and stop
    finite = tuple(a.nan_to_num(nan=0.5) if a.is_floating_point() else a for a in args)  # (opcheck: NaN != NaN)
    torch.library.opcheck(torch.ops.flashsampling._accept_drafts.default,
                          tuple(on(a.contiguous()) for a in finite))

    drafts = torch.randint(0, vocab, (batch, n), generator=g)
    emitted = torch.randint(0, vocab, (batch, n + 1), generator=g)
    emitted[:, :3] = drafts[:, :3]
    emitted[2, 1] = -1
    drafts[4, 0] = emitted[4, 0] = -1  # a draft of -1 is no token
    for given in (None, num_accepted):
        for width in ((n + 1,) if given is None else (1, n + 1)):
            call = (drafts, emitted[:, :width].contiguous(), given)
            tokens, count = torch.ops.flashsampling._draft_tokens(*(None if a is None else on(a) for a in call))
            want_tokens, want_count = torch.ops.flashsampling._draft_tokens(*call)
            assert torch.equal(tokens.cpu(), want_tokens) and torch.equal(count.cpu(), want_count)
            torch.library.opcheck(torch.ops.flashsampling._draft_tokens.default,
                                  tuple(None if a is None else on(a) for a in call))
    tokens, count = torch.ops.flashsampling._draft_tokens(drafts, emitted)
    assert int(count[2]) == 1 and int(count[4]) == 0 and int(count[0]) >= 3
    assert torch.equal(tokens[2], torch.tensor([int(drafts[2, 0]), -1] + [-1] * (n - 1)))


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_sample_routes(device, monkeypatch):
    """speculative_sample's one-hot steps without truncation run position_tokens_fused (bf16 on
    CUDA, the CPU op on the CPU), with truncation position_tokens_truncated_fused where the fused
    top-k pass takes the rows (CUDA, V >= 4096, no model-side transforms), else
    position_tokens_from_logits; sampled drafts verify."""
    from flashsampling_cuda import speculative

    calls = []
    for name in ("position_tokens_fused", "position_tokens_truncated_fused", "position_tokens_from_logits", "verify"):
        original = getattr(speculative, name)
        monkeypatch.setattr(speculative, name,
                            lambda *a, _name=name, _original=original, **k: calls.append(_name) or _original(*a, **k))
    hidden, weight = exact_problem(4, 3, 300, 16, device, seed=1)
    drafts = torch.zeros(4, 2, dtype=torch.int64, device=device)
    fs.speculative_sample(hidden, weight, drafts, seed=1)
    fs.speculative_sample(hidden, weight, drafts, seed=1, top_k=5)
    fs.speculative_sample(hidden, weight, drafts, torch.full((4, 2, 300), 1 / 300, device=device), seed=1)
    assert calls == ["position_tokens_fused", "position_tokens_from_logits", "verify"]
    # With a vocabulary the fused top-k pass takes, truncation runs there on CUDA (sm90: any form).
    calls.clear()
    hidden, weight = exact_problem(4, 3, 4608, 16, device, seed=1)
    fs.speculative_sample(hidden, weight, drafts, seed=1, top_k=5)
    fs.speculative_sample(hidden, weight, drafts, seed=1, top_k=5, logit_softcap=20.0)  # the pass has no soft-cap
    fused_route = "position_tokens_truncated_fused" if device == "cuda" else "position_tokens_from_logits"
    assert calls == [fused_route, "position_tokens_from_logits"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled_drafts", [False, True])
def test_torch_compile_fullgraph_equals_eager(device, sampled_drafts):
    """torch.compile(fullgraph=True) of a verification step (one-hot: the fused route on CUDA;
    sampled drafts with top_k: the general route) returns the eager step's outputs."""
    hidden, weight = exact_problem(4, 3, 300, 16, device, seed=1)
    drafts = torch.tensor([[3, 7], [0, 1], [250, 2], [9, 9]], device=device)
    q = torch.softmax(torch.randn(4, 2, 300, generator=torch.Generator().manual_seed(2)), -1).to(device)
    extra = dict(top_k=20) if sampled_drafts else {}

    def step(h, w, d, q, s, o):
        out = fs.speculative_sample(h, w, d, q if sampled_drafts else None, temperature=0.8, seed=s, offset=o,
                                    return_logprobs=True, **extra)
        return out.tokens, out.num_accepted, out.logprobs

    args = (hidden, weight, drafts, q, torch.tensor(5, device=device), torch.tensor(3, device=device))
    compiled = torch.compile(step, fullgraph=True)(*args)
    eager = step(*args)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    torch.testing.assert_close(compiled[2], eager[2], equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_masked_out_drafts_are_always_rejected(device, sampled_drafts, temperature):
    """A draft the mask rules out has no mass under the target: it is never accepted, greedy or
    sampled, one-hot or drawn from draft_probs that favour it, and the token emitted in its place
    is an allowed one."""
    rows, vocab, dim = 512, 64, 16
    one, weight = problem(1, 2, vocab, dim, device, seed=3, scale=3.0)
    hidden = one.expand(rows, 2, dim).contiguous()
    x = one[0, 0].double() @ weight.double().T
    draft = int(x.argmax())  # the target's favourite, masked out below
    allowed = torch.ones(rows, vocab, dtype=torch.bool)
    allowed[:, draft] = False
    allowed[::2, torch.arange(0, vocab, 3)] = False  # and more on every other row
    drafts = torch.full((rows, 1), draft, device=device)
    draft_probs = None
    if sampled_drafts:
        q = torch.full((vocab,), 0.1 / (vocab - 1))
        q[draft] = 0.9
        draft_probs = q[None, None].expand(rows, 1, vocab).to(device)
    out = fs.speculative_sample(hidden, weight, drafts, draft_probs, temperature=temperature,
                                seed=torch.arange(rows, device=device), allowed_mask=fs.pack_allowed_mask(allowed)
                                .to(device))
    assert (out.num_accepted == 0).all()
    emitted = out.tokens[:, 0].cpu()
    assert allowed.gather(1, emitted[:, None]).all()
    assert (out.tokens[:, 1] == -1).all()


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sampled_drafts", [False, True])
@pytest.mark.parametrize("truncated", [False, True])
def test_verification_step_in_a_cuda_graph_equals_eager(sampled_drafts, truncated):
    """A verification step captured in a CUDA graph (device seed and offset read at run time,
    static input buffers) gives, replay after replay with new inputs, the outputs of the eager
    call on the same inputs: one-hot (the fused routes) and sampled drafts, with and without
    per-row truncation."""
    batch, n, vocab, dim = 8, 3, 4608, 64
    g = torch.Generator().manual_seed(31)
    hidden, weight = exact_problem(batch, n + 1, vocab, dim, "cuda", seed=30)
    static = dict(h=hidden.clone(), d=torch.zeros(batch, n, dtype=torch.int64, device="cuda"),
                  q=torch.full((batch, n, vocab), 1 / vocab, device="cuda"),
                  seed=torch.tensor(0, device="cuda"), offset=torch.tensor(0, device="cuda"))
    temps = torch.tensor([0.0, 0.6, 1.0, 1.3] * (batch // 4), device="cuda")
    extra = dict(top_k=torch.arange(batch, device="cuda") * 5 + 3, top_p=0.9) if truncated else {}

    def step(h, d, q, seed, offset):
        out = fs.speculative_sample(h, weight, d, q if sampled_drafts else None, temperature=temps, seed=seed,
                                    offset=offset, return_logprobs=True, **extra)
        return out.tokens, out.num_accepted, out.logprobs

    step(**static)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(**static)
    for i in range(3):
        inputs = dict(h=hidden.roll(i, dims=1), d=torch.randint(0, vocab, (batch, n), generator=g).cuda(),
                      q=torch.softmax(torch.randn(batch, n, vocab, generator=g) * 3, -1).cuda(),
                      seed=torch.tensor(11 + i, device="cuda"), offset=torch.tensor(5 * i, device="cuda"))
        x = inputs["h"].float() @ weight.float().T
        inputs["d"][::2] = x[::2, :n].argmax(2)  # some drafts the target accepts
        for name, value in inputs.items():
            static[name].copy_(value)
        graph.replay()
        want = step(**inputs)
        assert torch.equal(captured[0], want[0]) and torch.equal(captured[1], want[1]), i
        torch.testing.assert_close(captured[2], want[2], equal_nan=True)
