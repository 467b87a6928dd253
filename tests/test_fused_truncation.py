"""The fused top-k pass with every truncation form (issue #33, sm90): ``[B]`` top_k / top_p /
min_p, top_p or min_p alone, top_k above 64, per-row mixes with rows whose truncation is off.
Stage 2 decides the rows the GEMM's candidates settle (top_k <= 64, a host top_k <= 1024 without
top_p, or a top_p / min_p cut within the first 64 tokens); the others are sampled from the logits
the same GEMM pass stored.

On logits that are exact in fp32 (small multiples of powers of two: every summation order
gives the same bits) the fused path returns the CPU op's tokens and scores on the same logits,
whichever route each row takes; rows whose truncation is off get the plain-sampling token;
chi-square of the truncated distribution; CUDA-graph replay and torch.compile(fullgraph=True).
"""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from kernel_trace import run_listing_cuda_kernels
from sampling_stats import assert_truncated_distribution, random_controls

requires_cuda = pytest.mark.requires_cuda
V, D = 32768, 256
# A hidden size at which a top_p call of 33-64 rows draws the tile winners (up to 3072 the
# epilogue-warpgroup scan without them, then the streaming pass, is faster).
LONG_MAINLOOP_D = 3072 + 256


def requires_sm90(test):
    sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    return pytest.mark.skipif(not sm90, reason="the fused pass takes every truncation form on sm90 only")(
        requires_cuda(test))


def exact_problem(batch, regime, seed, vocab=V):
    """bf16 hidden / weight of multiples of 1/8 whose products and sums are exact in fp32
    (|logit| < 2^11 in steps of 2^-6). flat: every logit small (thousands of top_p survivors);
    peaked: each row a few weight rows with integer weights (a head of ~16-64 over a bulk of
    spread ~8), which at the temperatures below gives rows from one survivor to hundreds."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randint(-3, 4, (vocab, D), generator=g).float() / 8
    if regime == "flat":
        hidden = torch.randint(-2, 3, (batch, D), generator=g).float() / 8
    else:
        ids = torch.randint(0, vocab, (batch, 8), generator=g)
        coefficients = torch.randint(1, 5, (batch, 8, 1), generator=g).float()
        hidden = (coefficients * weight[ids]).sum(1) + torch.randint(-1, 2, (batch, D), generator=g).float() / 8
    logits = hidden @ weight.T
    assert torch.equal(hidden.bfloat16().float(), hidden) and logits.abs().max() < 2**11
    return hidden.bfloat16(), weight.bfloat16(), logits


def per_row(kind, batch):
    """[B] values cycling through on, off and out-of-range ones (device tensors are not checked)."""
    values = {
        "k": [50, 0, 1, -1, V + 5, 7, 2000, 64, 65, 20],
        "p": [0.9, 1.0, 0.5, 0.0, 0.999, float("nan"), 0.95, 1.5, 0.3, 0.8],
        "m": [0.05, 0.0, 0.3, 1.0, 1.5, -0.5, float("nan"), 0.01, 0.1, 0.0],
        # around the limits of stage 2's selections (64; a host top_k up to 1024 without top_p)
        "k_large": [1000, 65, 0, 1024, 1025, 200, 5000, 64, 700, 3],
    }[kind]
    dtype = torch.int64 if kind.startswith("k") else torch.float64
    return torch.tensor([values[b % len(values)] for b in range(batch)], dtype=dtype)


FORMS = {
    "k_rows": dict(top_k="k"),
    "p_rows": dict(top_p="p"),
    "min_p_rows": dict(min_p="m"),
    "k_p_min_p_rows": dict(top_k="k", top_p="p", min_p="m"),
    "p_scalar": dict(top_p=0.9),
    "min_p_scalar": dict(min_p=0.05),
    "k1000": dict(top_k=1000),
    "k300_min_p_rows": dict(top_k=300, min_p="m"),
    "k300_p_rows_min_p_scalar": dict(top_k=300, top_p="p", min_p=0.02),
    "k1000_p0.9": dict(top_k=1000, top_p=0.9),
    "k_large_rows": dict(top_k="k_large"),
    "k_large_rows_min_p_scalar": dict(top_k="k_large", min_p=0.02),
    "k_rows_p_scalar": dict(top_k="k", top_p=0.95),
}


def truncation_kwargs(form, batch, device):
    return {name: per_row(value, batch).to(device) if isinstance(value, str) else value
            for name, value in FORMS[form].items()}


def on_cuda(kwargs):
    """The arguments with their tensors moved to the GPU."""
    return {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in kwargs.items()}


def cpu_op_kwargs(kwargs):
    """sample()'s arguments as the CPU op sample_from_logits names them (its per-row `temperatures`)."""
    return {("temperatures" if name == "temperature" else name): value for name, value in kwargs.items()}


def sample_with_dispatch_options(hidden, weight, kwargs, **options):
    """fs.sample_with_scores with DispatchOptions `options` (the defaults again after), and the
    names of the CUDA kernels it ran."""
    torch.ops.flashsampling._set_dispatch_options(**options)
    try:
        return run_listing_cuda_kernels(lambda: fs.sample_with_scores(hidden, weight, **kwargs))
    finally:
        torch.ops.flashsampling._set_dispatch_options()


def ran_top_candidates_epilogue_warpgroups(kernel_names):
    """Whether the fused top-k pass ran on the epilogue-warpgroup kernel (its loop is
    (flashsampling::SamplerLoop)3 in the kernel's name)."""
    return any("Sm90SamplerEpilogueWarpGroups" in n and "SamplerLoop)3" in n for n in kernel_names)


def top_candidates_results_on_both_kernels(form, batch, vocab):
    """The fused pass of `form` over `batch` LLM-like rows with the controls it takes (per-row T
    with greedy rows, bias, mask, per-row seeds, two samples, log-probabilities), once on the
    epilogue-warpgroup kernel and once on CUTLASS's tile (DispatchOptions::
    top_candidates_epilogue_warpgroups true / false), the profiler checking each: ({True: result,
    False: result}, hidden, weight, temperatures)."""
    weight = lm_head_weight(vocab, D, seed=3).cuda()
    hidden = hidden_states(weight, batch, "llm", seed=batch)
    g = torch.Generator().manual_seed(batch)
    temperatures = (torch.rand(batch, generator=g) * 1.5 + 0.3).cuda()
    temperatures[::7] = 0.0
    c = random_controls(batch, vocab, "cuda", vocab_start=64, seed=batch, density=0.5)
    kwargs = dict(temperature=temperatures, seed=torch.arange(batch, device="cuda") * 3 + 1,
                  offset=torch.arange(batch, device="cuda"), num_samples=2, return_logprobs=True,
                  logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64, empty_mask_token=-7,
                  truncation_path="fused_top_k", **truncation_kwargs(form, batch, "cuda"))
    results = {}
    for epilogue_warpgroups in (True, False):
        results[epilogue_warpgroups], names = sample_with_dispatch_options(
            hidden, weight, kwargs, top_candidates_epilogue_warpgroups=epilogue_warpgroups)
        assert ran_top_candidates_epilogue_warpgroups(names) == epilogue_warpgroups, names
    return results, hidden, weight, temperatures


def assert_same_bits(got, want, fields):
    """The named outputs of two results equal bit for bit (floats compared as their bits)."""
    for name in fields:
        a, b = getattr(got, name), getattr(want, name)
        as_bits = (lambda t: t.view(torch.int32)) if a.is_floating_point() else (lambda t: t)
        assert torch.equal(as_bits(a), as_bits(b)), (name, (as_bits(a) != as_bits(b)).nonzero()[:8])


@requires_sm90
# the N = 16 and 64 tiles, then the epilogue-warpgroup kernel: one column tile (100) and two in a
# column cluster (130, 200); three tiles (300) in test_top_candidates_kernels_agree_bit_for_bit
@pytest.mark.parametrize("batch", [5, 40, 100, 130, 200])
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
def test_fused_truncation_equals_cpu_op_on_exact_logits(form, regime, batch, controls):
    """Every row, decided by stage 2 or sampled from the stored logits: the CPU op's tokens and
    scores on the same logits, bit for bit."""
    hidden, weight, logits = exact_problem(batch, regime, seed=batch + len(form))
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 3.5 + 0.5
    temperatures[::6] = 0.0
    kwargs = dict(temperature=temperatures, seed=torch.tensor(11), offset=torch.tensor(4), num_samples=2,
                  return_logprobs=True)
    if controls:
        c = random_controls(batch, V, "cpu", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64,
                      seed=torch.arange(batch) * 3 + 1, offset=torch.arange(batch), empty_mask_token=-7)
    on = on_cuda(kwargs)
    got = fs.sample_with_scores(hidden.cuda(), weight.cuda(), truncation_path="fused_top_k",
                                **on, **truncation_kwargs(form, batch, "cuda"))
    op_kwargs = cpu_op_kwargs(kwargs)
    for name, value in truncation_kwargs(form, batch, "cpu").items():
        op_kwargs[name + "s" if isinstance(value, torch.Tensor) else name] = value
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    tokens = got.tokens.cpu()
    assert torch.equal(tokens, expected[0]), (tokens != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])
    torch.testing.assert_close(got.token_logprobs.cpu(), expected[2], rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(got.logsumexp.cpu(), expected[3], rtol=1e-5, atol=1e-5, equal_nan=True)


@requires_sm90
@pytest.mark.parametrize("vocab", [V, V - 40], ids=["whole_tiles", "ragged_last_tile"])
@pytest.mark.parametrize("batch", [100, 200, 300])
@pytest.mark.parametrize("form", ["k_rows", "p_rows", "k_p_min_p_rows"])
def test_top_candidates_kernels_agree_bit_for_bit(form, batch, vocab):
    """The fused pass beyond 64 columns on the epilogue-warpgroup kernel and on CUTLASS's
    cooperative tile (DispatchOptions::top_candidates_epilogue_warpgroups): the same candidates,
    stored logits and log-mass parts, so the same tokens, scores, logprobs and logsumexp bit for
    bit (rows decided by stage 2 and rows sampled from the stored logits alike), with the controls
    the pass takes (per-row T with greedy rows, bias, mask, per-row seeds, two samples), also with
    a last vocabulary tile of 88 rows (runs of 16 rows partly and wholly past the vocabulary). The
    profiler checks that each setting ran the kernel it names."""
    results, *_ = top_candidates_results_on_both_kernels(form, batch, vocab)
    assert_same_bits(results[True], results[False], ("tokens", "scores", "token_logprobs", "logsumexp"))


@requires_sm90
@pytest.mark.parametrize("batch", [33, 48, 64])
@pytest.mark.parametrize("form", ["k_rows", "min_p_rows", "k_p_min_p_rows", "k1000", "k_rows_p_scalar", "p_rows",
                                  "k_large_rows"])
def test_narrow_top_candidates_kernels_agree_bit_for_bit(form, batch):
    """A top-k pass of 33-64 columns that draws no tile winners runs the epilogue-warpgroup
    kernel's 64-wide scan (candidates per 128-row tile); with top_candidates_epilogue_warpgroups =
    false, the 64-wide pingpong tile (per 64-row tile): the same tokens and scores bit for bit,
    log-probabilities within rounding of the two merge orders, with the controls the pass takes
    (per-row T with greedy rows, bias, mask, per-row seeds, two samples); on exact logits the CPU
    op's tokens and scores. A call that draws the tile winners (a host top_k above 1024 alone, a
    batch-wide seed) keeps the pingpong tile. The profiler checks each setting."""
    results, hidden, weight, temperatures = top_candidates_results_on_both_kernels(form, batch, V)
    assert_same_bits(results[True], results[False], ("tokens", "scores"))
    for name in ("token_logprobs", "logsumexp"):
        torch.testing.assert_close(getattr(results[True], name), getattr(results[False], name), rtol=1e-5,
                                   atol=1e-5, equal_nan=True)
    # exact logits: the CPU op's tokens and scores
    exact_hidden, exact_weight, logits = exact_problem(batch, "peaked", seed=batch + len(form))
    exact_kwargs = dict(temperature=temperatures.cpu(), seed=torch.arange(batch) * 5 + 2, offset=torch.tensor(4),
                        num_samples=2)  # per-row seeds: no tile winners in any form
    got, names = sample_with_dispatch_options(
        exact_hidden.cuda(), exact_weight.cuda(),
        dict(truncation_path="fused_top_k", **on_cuda(exact_kwargs), **truncation_kwargs(form, batch, "cuda")))
    assert ran_top_candidates_epilogue_warpgroups(names), names
    op_kwargs = cpu_op_kwargs(exact_kwargs)
    for name, value in truncation_kwargs(form, batch, "cpu").items():
        op_kwargs[name + "s" if isinstance(value, torch.Tensor) else name] = value
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)
    assert torch.equal(got.tokens.cpu(), expected[0])
    assert torch.equal(got.scores.cpu(), expected[1])
    # a host top_k above 1024 alone with a batch-wide seed draws the tile winners at any hidden
    # size: the pingpong tile either way (top_p alone: test_top_p_tile_winners_by_hidden_size)
    winners = dict(temperature=0.8, seed=torch.tensor(5, device="cuda"), offset=torch.tensor(1, device="cuda"),
                   truncation_path="fused_top_k", top_k=2000)
    _, names = sample_with_dispatch_options(hidden, weight, winners)
    assert not ran_top_candidates_epilogue_warpgroups(names), names


@requires_sm90
@pytest.mark.parametrize("regime", ["flat", "llm"])
@pytest.mark.parametrize("batch", [7, 48, 130])
@pytest.mark.parametrize("with_min_p", [False, True], ids=["k_p", "k_p_min_p"])
def test_rows_whose_truncation_is_off_get_the_plain_token(regime, batch, with_min_p):
    """bf16 logits of an LM head (not exact: the fused pass's own accumulators): rows with
    top_k <= 0 / >= V, top_p >= 1 and min_p <= 0 in a mixed batch get plain sampling's token.
    With a min_p in the call, stage 2 hands the min_p-alone rows its candidates cannot decide to
    the streaming kernels; with a top_k tensor, top_p rows take the row list: the profiler checks
    that the streaming kernels run in the min_p calls only."""
    weight = lm_head_weight(V, D, seed=3)
    hidden = hidden_states(weight, batch, regime, seed=batch)
    truncation = dict(top_k=per_row("k", batch).cuda(), top_p=per_row("p", batch).cuda())
    if with_min_p:
        truncation["min_p"] = per_row("m", batch).cuda()
    off = ((truncation["top_k"] <= 0) | (truncation["top_k"] >= V)) & (truncation["top_p"] >= 1.0)
    if with_min_p:
        off &= truncation["min_p"] <= 0
    assert off.any()
    kwargs = dict(temperature=0.8, seed=torch.tensor(5), offset=torch.tensor(2))
    got, kernels = run_listing_cuda_kernels(
        lambda: fs.sample(hidden, weight, truncation_path="fused_top_k", **truncation, **kwargs))
    assert any("streaming_sample_kernel" in name for name in kernels) == with_min_p
    assert not any("top_p_round_kernel" in name for name in kernels)
    plain = fs.sample(hidden, weight, **kwargs)
    assert torch.equal(got[off], plain[off])
    # and the truncated rows agree with the materialised path (other logits bits: near ties may differ)
    materialised = fs.sample(hidden, weight, truncation_path="materialized", **truncation, **kwargs)
    assert (got == materialised).float().mean() > 0.97


@requires_sm90
@pytest.mark.parametrize("regime", ["flat", "llm"])
@pytest.mark.parametrize("batch", [7, 48, 130])
@pytest.mark.parametrize("top_k", [1, 20, 64])
def test_per_row_top_k_rows_equal_the_host_int_call(regime, batch, top_k):
    """bf16 logits of an LM head (not exact): in a ``[B]`` top_k call, the rows whose top_k is in
    [1, 64] (the GEMM stores no x for them: stage 2 decides them from the candidates and
    recomputes the tiles that may hide more of their top_k from W and h) get the host-int top_k
    call's tokens, scores and log-probabilities bit for bit, next to rows that need the stored
    logits (top_k off under a top_p, above 64). Weight rows 128-159 nearly repeat row 128 and
    every other hidden row leans on it, so that one tile holds many of those rows' top_k: their
    repairs run."""
    weight = lm_head_weight(V, D, seed=4)
    g = torch.Generator(device="cuda").manual_seed(batch)
    weight[128:160] = (weight[128].float() + 0.05 * D**-0.5 * torch.randn(32, D, device="cuda", generator=g)).bfloat16()
    hidden = hidden_states(weight, batch, regime, seed=batch + top_k)
    hidden[::2] += (4 * weight[128]).to(hidden.dtype)
    top_ks = torch.tensor([[top_k, 0, 1000, top_k, 65][b % 5] for b in range(batch)], device="cuda")
    top_ps = torch.full((batch,), 0.9, dtype=torch.float64, device="cuda")
    kwargs = dict(temperature=0.8, seed=torch.tensor(9), offset=torch.tensor(3), return_logprobs=True,
                  truncation_path="fused_top_k")
    got = fs.sample_with_scores(hidden, weight, top_k=top_ks, top_p=top_ps, **kwargs)
    host = fs.sample_with_scores(hidden, weight, top_k=top_k, top_p=top_ps, **kwargs)
    rows = top_ks == top_k
    for name in ("tokens", "scores", "token_logprobs", "logsumexp"):
        a, b = getattr(got, name)[rows], getattr(host, name)[rows]
        as_bits = (lambda t: t.view(torch.int32)) if a.is_floating_point() else (lambda t: t)
        assert torch.equal(as_bits(a), as_bits(b)), (name, (as_bits(a) != as_bits(b)).nonzero()[:8])


@requires_sm90
@pytest.mark.parametrize("batch, vocab", [(5, V), (40, V), (130, V), (40, V - 3), (130, V - 3)])
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("truncation", ["p_rows", "p_scalar", "k_p_min_p_rows", "p0.1", "p0.5_min_p_rows"])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
def test_top_p_rows_verified_in_rounds_equal_cpu_op(truncation, regime, batch, vocab, controls):
    """One sample without log-probabilities, no top_k tensor: stage 2 hands the top_p rows its
    candidates cannot decide to the streaming kernels, whose rounds verify each row's winner
    against top_p, draw the next winner where it fails (a small top_p fails most first winners)
    and leave a row still undecided after the last round to the cut kernel (with a top_k tensor
    such rows take the row list). Tokens and scores as the CPU op's, bit for bit; the profiler
    checks that the rounds ran where they should. V - 3: a row's last chunk ends inside a group of
    four tokens (the verifying rounds' vector loads). (Beyond 32 rows top_p alone runs on the plain
    pass, whose reduction hands its rows to the same rounds: test_plain_pass_equals_cpu_op.)"""
    hidden, weight, logits = exact_problem(batch, regime, seed=batch + 7 * len(truncation), vocab=vocab)
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 3.5 + 0.5
    temperatures[::7] = 0.0
    kwargs = dict(temperature=temperatures, seed=torch.tensor(13), offset=torch.tensor(6))
    if controls:
        c = random_controls(batch, vocab, "cpu", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64,
                      seed=torch.arange(batch) * 3 + 1, offset=torch.arange(batch), empty_mask_token=-7)
    if truncation == "p0.1":
        trunc_cpu = dict(top_p=0.1)
    elif truncation == "p0.5_min_p_rows":
        trunc_cpu = dict(top_p=torch.full((batch,), 0.5, dtype=torch.float64), min_p=per_row("m", batch))
    else:
        trunc_cpu = truncation_kwargs(truncation, batch, "cpu")
    trunc_cuda = on_cuda(trunc_cpu)
    on = on_cuda(kwargs)
    got, kernels = run_listing_cuda_kernels(lambda: fs.sample_with_scores(
        hidden.cuda(), weight.cuda(), truncation_path="fused_top_k", **on, **trunc_cuda))
    rounds = any("top_p_round_kernel" in name for name in kernels)
    assert rounds == ("top_k" not in trunc_cpu)
    op_kwargs = cpu_op_kwargs(kwargs)
    for name, value in trunc_cpu.items():
        op_kwargs[name + "s" if isinstance(value, torch.Tensor) else name] = value
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    tokens = got.tokens.cpu()
    assert torch.equal(tokens, expected[0]), (tokens != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])


@requires_sm90
@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_rows_whose_winner_is_among_their_first_tokens_equal_cpu_op(seed):
    """top_p rows whose cut falls past their first 64 tokens (peaked rows at T = 5, hundreds of
    survivors): stage 2 gives a row whose plain-sampling winner lies among those 64 that winner
    (every one of them survives), and hands the others on to the rounds, in one batch. Tokens and
    scores as the CPU op's, bit for bit; the float64 logits and the CPU op's plain token show that
    both kinds of row are there."""
    batch = 40
    hidden, weight, logits = exact_problem(batch, "peaked", seed=seed)
    temperatures = torch.full((batch,), 5.0)
    temperatures[::9] = 0.0
    top_ps = torch.full((batch,), 0.95, dtype=torch.float64)
    top_ps[5::11] = 1.0
    kwargs = dict(seed=torch.tensor(13), offset=torch.tensor(6))
    got, names = sample_with_dispatch_options(  # (at 40 rows the plain pass by default)
        hidden.cuda(), weight.cuda(), dict(truncation_path="fused_top_k", temperature=temperatures.cuda(),
                                           top_p=top_ps.cuda(), **on_cuda(kwargs)), top_p_on_plain_pass=False)
    assert any("truncate_candidates_kernel" in n for n in names), names
    tokens, scores = torch.ops.flashsampling.sample_from_logits(logits, temperatures=temperatures, top_ps=top_ps,
                                                                **kwargs)[:2]
    assert torch.equal(got.tokens.cpu(), tokens), (got.tokens.cpu() != tokens).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), scores)
    # The rows of the branch: top_p on, more than 64 survivors, the plain-sampling winner (the CPU
    # op without top_p, the same noise) among the first 64, where it is the sample.
    winners = torch.ops.flashsampling.sample_from_logits(logits, temperatures=temperatures, **kwargs)[0].reshape(batch)
    y = logits.double() / temperatures.clamp(min=1e-30)[:, None]
    order = torch.sort(y, dim=1, descending=True, stable=True).indices
    probabilities = torch.softmax(y, dim=1).gather(1, order)
    survivors = ((probabilities.cumsum(1) - probabilities) < top_ps[:, None]).sum(1)
    rank = (order == winners.reshape(batch, 1)).float().argmax(1)
    past_64 = (top_ps < 1.0) & (temperatures > 0) & (survivors > 64)
    decided = past_64 & (rank < 64)
    assert torch.equal(tokens.reshape(batch)[decided], winners[decided])
    assert int(decided.sum()) >= 10 and int((past_64 & (rank >= 64)).sum()) >= 1


@requires_sm90
@pytest.mark.parametrize("batch, epilogue_warpgroups", [(6, True), (40, True), (64, True), (100, False), (200, True)])
@pytest.mark.parametrize("regime", ["flat", "llm"])
@pytest.mark.parametrize("truncation", ["p_rows", "p_scalar", "p0.3"])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "bias_mask"])
@pytest.mark.parametrize("temperature", ["rows", 0.7, 0.0])
def test_top_p_tile_winners_equal_the_streaming_pass(truncation, regime, batch, epilogue_warpgroups, controls,
                                                      temperature):
    """top_p without top_k or min_p, one sample, the batch-wide seed: the top-k scan draws each
    tile's plain-sampling winner (DispatchOptions::top_p_tile_winners), stage 2 gives the rows
    without a cut their winner and starts the top_p rows' rounds from it, and no streaming pass runs.
    The same tokens and scores bit for bit as with the streaming pass, on bf16 LM-head logits
    (per-row temperatures with greedy rows, a scalar one, a greedy call; with the dense bias and the
    mask), on the scans that draw them: the N = 16 and 64 pingpong tiles and, beyond 64 rows,
    CUTLASS's cooperative tile where asked. The epilogue-warpgroup kernel (200 rows, the default
    beyond 64) draws none: its rows take the streaming pass either way; at 33-64 rows it runs
    where no winners are drawn. D = LONG_MAINLOOP_D, where the 64-wide tile draws them
    (test_top_p_tile_winners_by_hidden_size has the shorter ones). The profiler checks which route
    ran; rows whose top_p is off get plain sampling's token. Beyond 32 rows a plain call's
    top_p runs on the plain pass by default (test_top_p_on_plain_pass_equals_the_top_k_scan):
    here on the top-k scan (DispatchOptions::top_p_on_plain_pass off)."""
    weight = lm_head_weight(V, LONG_MAINLOOP_D, seed=6).cuda()
    hidden = hidden_states(weight, batch, regime, seed=batch)
    if temperature == "rows":
        temperature = (torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 1.5 + 0.4).cuda()
        temperature[::5] = 0.0
    kwargs = dict(temperature=temperature, seed=torch.tensor(21, device="cuda"), offset=torch.tensor(3, device="cuda"))
    if controls:
        c = random_controls(batch, V, "cuda", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64, empty_mask_token=-7)
    plain = fs.sample(hidden, weight, **kwargs)
    kwargs["truncation_path"] = "fused_top_k"
    if truncation == "p0.3":
        kwargs["top_p"] = torch.full((batch,), 0.3, dtype=torch.float64, device="cuda")
    else:
        kwargs.update(truncation_kwargs(truncation, batch, "cuda"))
    results = {}
    for winners in (True, False):
        results[winners], names = sample_with_dispatch_options(
            hidden, weight, kwargs, top_candidates_epilogue_warpgroups=epilogue_warpgroups, top_p_tile_winners=winners,
            top_p_on_plain_pass=False)
        draws = winners and not (epilogue_warpgroups and batch > 64)
        assert any("streaming_sample_kernel" in n for n in names) != draws, names
        narrow_without_winners = 32 < batch <= 64 and not winners
        assert ran_top_candidates_epilogue_warpgroups(names) == (
            epilogue_warpgroups and (batch > 64 or narrow_without_winners)), names
    assert_same_bits(results[True], results[False], ("tokens", "scores"))
    if truncation == "p_rows":
        off = kwargs["top_p"] >= 1.0
        assert off.any()
        assert torch.equal(results[True].tokens.reshape(batch)[off], plain.reshape(batch)[off])


@requires_sm90
@pytest.mark.parametrize("hidden_dim", [D, 3072, LONG_MAINLOOP_D])
@pytest.mark.parametrize("batch", [16, 33, 64])
@pytest.mark.parametrize("regime", ["flat", "llm"])
def test_top_p_tile_winners_by_hidden_size(regime, batch, hidden_dim):
    """top_p alone (a [B] tensor, the batch-wide seed) draws the tile winners up to 32 rows at
    every hidden size, and at 33-64 rows only beyond D = 3072: there the 64-wide pingpong tile
    draws them; up to 3072 the epilogue-warpgroup kernel's 64-wide scan draws none and the
    streaming pass samples the rows stage 2 hands on. Either way the same tokens and scores bit
    for bit as with the winners turned off (DispatchOptions::top_p_tile_winners). The profiler
    checks which route ran. (Such a call of 33-64 rows runs on the plain pass by default: here the
    top-k scan's routes, DispatchOptions::top_p_on_plain_pass off.)"""
    weight = lm_head_weight(V, hidden_dim, seed=9).cuda()
    hidden = hidden_states(weight, batch, regime, seed=batch + hidden_dim)
    kwargs = dict(temperature=0.8, seed=torch.tensor(7, device="cuda"), offset=torch.tensor(2, device="cuda"),
                  truncation_path="fused_top_k", top_p=per_row("p", batch).cuda())
    draws = batch <= 32 or hidden_dim > 3072
    got, names = sample_with_dispatch_options(hidden, weight, kwargs, top_p_on_plain_pass=False)
    assert any("streaming_sample_kernel" in n for n in names) != draws, names
    assert ran_top_candidates_epilogue_warpgroups(names) == (batch > 32 and not draws), names
    streamed, names = sample_with_dispatch_options(hidden, weight, kwargs, top_p_tile_winners=False,
                                                   top_p_on_plain_pass=False)
    assert any("streaming_sample_kernel" in n for n in names), names
    assert_same_bits(got, streamed, ("tokens", "scores"))


def ran_sampler_loop(kernel_names, loops):
    """Whether a GEMM of one of these SamplerLoop values ran: (flashsampling::SamplerLoop)N in a
    demangled name (the epilogue-warpgroup kernels), or SamplerLoopEN in a mangled one (the
    profiler keeps CUTLASS's long device_kernel names mangled)."""
    return any(f"SamplerLoop){loop}" in n or f"11SamplerLoopE{loop}E" in n
               for n in kernel_names for loop in loops)


def ran_plain_pass(kernel_names):
    """Whether a fused truncation call ran on plain sampling's pass (SamplerParams::
    truncation_on_plain_pass): a GEMM of the plain or controls' loop (beyond 32 rows the
    epilogue-warpgroup kernel, up to 32 CUTLASS's narrow plain tile), its reduction, and no stage
    2."""
    return (ran_sampler_loop(kernel_names, (0, 1)) and
            any("reduce_candidates_kernel" in n for n in kernel_names) and
            not any("truncate_candidates_kernel" in n for n in kernel_names))


def ran_top_p_on_plain_pass(kernel_names):
    """ran_plain_pass, and the top_p rounds after it."""
    return ran_plain_pass(kernel_names) and any("top_p_round_kernel" in n for n in kernel_names)


@requires_sm90
@pytest.mark.parametrize("batch, vocab", [(1, V), (16, V - 3), (20, V), (33, V), (64, V - 3), (100, V), (200, V - 3)])
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("truncation", ["p_rows", "p_scalar", "p0.1", "min_p_rows", "min_p_scalar", "min_p0.3"])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
def test_plain_pass_equals_cpu_op(truncation, regime, batch, vocab, controls):
    """top_p alone or min_p alone, one sample: the sampling pass (beyond 32 rows the
    epilogue-warpgroup kernel's plain loop, or with per-row temperatures (greedy rows among them),
    the dense bias, the mask and per-row seeds its controls' loop; up to 32 rows, in a call of the
    plain loop, CUTLASS's narrow plain tile; each also storing the logits and
    each tile's largest allowed one; no stage 2) hands each top_p row's plain token and first y to
    the rounds (or keeps that token where it is the row's first: DispatchOptions::
    first_winners_in_reduction), gives a min_p row whose plain token passes min_p that token,
    samples the others itself where at most 64 tiles hold their survivors (without the mask) and
    hands the rest to the streaming pass over their survivors, lists the rows whose cut keeps only the first token
    (top_p 0 or NaN, min_p above 1 or NaN) for the cut kernel, and keeps plain sampling's token
    where the cut is off or the row is greedy. Tokens and scores as the CPU op's, bit for bit, on
    exact logits (a small top_p fails most first winners, so the drawing rounds have rows), and as
    the top-k scan's route (DispatchOptions::top_p_on_plain_pass / min_p_on_plain_pass off; min_p
    takes the plain pass up to 128 rows, so at 200 both calls run the top-k scan; up to 32 rows
    either takes it in calls of the plain loop, CUTLASS's narrow tiles storing the logits, and the
    controls' calls keep the top-k scan). V - 3:
    the stored rows end inside a 64-row half tile and a group of four tokens. The profiler checks
    which route ran (not which rounds found rows: every round launches either way)."""
    hidden, weight, logits = exact_problem(batch, regime, seed=batch + 11 * len(truncation), vocab=vocab)
    kwargs = dict(temperature=2.5 if regime == "peaked" else 0.8, seed=torch.tensor(13), offset=torch.tensor(6))
    if controls:
        temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 2.5 + 0.5
        temperatures[::7] = 0.0
        c = random_controls(batch, vocab, "cpu", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(temperature=temperatures, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"],
                      vocab_start=64, seed=torch.arange(batch) * 3 + 1, offset=torch.arange(batch),
                      empty_mask_token=-7)
    special = {"p0.1": dict(top_p=0.1), "min_p0.3": dict(min_p=0.3)}
    trunc = special.get(truncation) or truncation_kwargs(truncation, batch, "cpu")
    top_p = "top_p" in trunc
    on = dict(on_cuda(kwargs), **on_cuda(trunc), truncation_path="fused_top_k")
    h, w = hidden.cuda(), weight.cuda()
    got, names = sample_with_dispatch_options(h, w, on)
    # min_p alone: up to 128 rows (min_p_plain_pass_pays); up to 32 rows in calls of the plain
    # loop (DispatchOptions::narrow_plain_pass), not with the controls
    on_plain_pass = (top_p or batch <= 128) and (batch > 32 or not controls)
    assert (ran_top_p_on_plain_pass if top_p else ran_plain_pass)(names) == on_plain_pass, names
    option = "top_p_on_plain_pass" if top_p else "min_p_on_plain_pass"
    scan, names = sample_with_dispatch_options(h, w, on, **{option: False})
    assert any("truncate_candidates_kernel" in n for n in names), names
    op_kwargs = cpu_op_kwargs(kwargs) if controls else dict(kwargs)
    for name, value in trunc.items():
        op_kwargs[name + "s" if isinstance(value, torch.Tensor) else name] = value
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])
    assert_same_bits(got, scan, ("tokens", "scores"))
    if truncation in ("p_rows", "min_p_rows") and batch > 1:  # (one row: its cut is on)
        off = trunc["top_p"] >= 1.0 if top_p else trunc["min_p"] <= 0.0
        plain = fs.sample_with_scores(h, w, **on_cuda(kwargs))
        assert off.any()
        assert torch.equal(got.tokens.reshape(batch)[off.cuda()], plain.tokens.reshape(batch)[off.cuda()])


@requires_sm90
@pytest.mark.parametrize("batch", [1, 16, 48, 100])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "row_temperatures_seeds"])
def test_min_p_rows_sampled_in_the_reduction(batch, controls):
    """min_p alone on the plain pass: a row whose plain token fails min_p and whose survivors lie
    in at most 64 vocabulary tiles (the tiles whose largest stored x passes min_p: a peaked row)
    is sampled by the reduction over those tiles' survivors; a row with more such tiles (a flat
    row, every third row here, at min_p 0.05) goes to the streaming pass. Peaked rows at
    temperatures where the plain token often fails min_p (a third to a half of them), next to flat
    rows in one batch: tokens and scores as the CPU
    op's on exact logits and as the top-k scan's route (DispatchOptions::min_p_on_plain_pass
    off), bit for bit; with per-row temperatures (greedy rows among them) and per-row seeds too
    (beyond 32 rows the controls' loop: up to 32 such calls keep the top-k scan). The mask keeps
    every row on the streaming pass (its stored logits are the mask's too), as
    test_plain_pass_equals_cpu_op checks."""
    hidden, weight, _ = exact_problem(batch, "peaked", seed=batch + 17)
    g = torch.Generator().manual_seed(batch)
    flat_rows = torch.arange(batch) % 3 == 2
    hidden[flat_rows] = (torch.randint(-2, 3, (int(flat_rows.sum()), D), generator=g).float() / 8).bfloat16()
    logits = hidden.float() @ weight.float().T
    kwargs = dict(temperature=8.0, seed=torch.tensor(5), offset=torch.tensor(3))
    if controls:
        temperatures = torch.rand(batch, generator=g) * 8.0 + 4.0
        temperatures[::7] = 0.0
        kwargs.update(temperature=temperatures, seed=torch.arange(batch) * 7 + 3, offset=torch.arange(batch) + 1)
    values = [0.5, 0.3, 0.9, 0.05, 0.2, 1.0, 0.7]
    min_ps = torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.float64)
    min_ps[flat_rows] = 0.05  # every tile holds survivors: the streaming pass
    on = dict(on_cuda(kwargs), min_p=min_ps.cuda(), truncation_path="fused_top_k")
    h, w = hidden.cuda(), weight.cuda()
    got, names = sample_with_dispatch_options(h, w, on)
    assert ran_plain_pass(names) == (batch > 32 or not controls), names
    scan, _ = sample_with_dispatch_options(h, w, on, min_p_on_plain_pass=False)
    assert_same_bits(got, scan, ("tokens", "scores"))
    op_kwargs = cpu_op_kwargs(kwargs) if controls else dict(kwargs)
    expected = torch.ops.flashsampling.sample_from_logits(logits, min_ps=min_ps, **op_kwargs)  # the CPU op
    assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])
    # The rows this is about: peaked rows whose plain token fails min_p.
    plain = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)[0].reshape(batch, 1)
    temperature = kwargs["temperature"]
    t = temperature if isinstance(temperature, torch.Tensor) else torch.full((batch,), temperature)
    y = logits / t.clamp(min=1e-6)[:, None]
    ratio = torch.exp((y.gather(1, plain) - y.max(1, keepdim=True).values).double())[:, 0]
    fails = (ratio < min_ps) & (t > 0) & ~flat_rows
    assert batch < 16 or int(fails.sum()) >= batch // 8, int(fails.sum())


@requires_sm90
@pytest.mark.parametrize("batch", [33, 64, 100])
@pytest.mark.parametrize("temperature", [0.8, 4.0])
@pytest.mark.parametrize("host_min_p", [None, 0.3], ids=["tensor", "host"])
def test_min_p_filtered_winners(batch, temperature, host_min_p):
    """min_p alone on the plain pass at 33-64 GEMM columns (the epilogue-warpgroup kernel's plain
    loop): each tile's candidate is the best score among its tokens whose y reaches the column's
    min_p floor (from the column's largest x so far on any SM; DispatchOptions::
    min_p_filtered_winners), and the reduction samples a row from its surviving candidates,
    reading the stored x of the tiles whose failing candidate beats them (up to 64; with more the
    row streams); at 100 rows both calls take the tiles' plain winners
    (min_p_filtered_winners_pay). Flat and peaked rows side by side, min_p from 0.01 to 1 (small
    ones keep thousands of a flat row's tokens, large ones a few, so that many early tiles'
    candidates fail), off, above-1 and NaN rows among them, or a host min_p of 0.3 for every row:
    tokens and scores as the CPU op's on exact logits and as the route of the tiles' plain
    winners (the option off), bit for bit, and off rows get plain sampling's token."""
    hidden, weight, _ = exact_problem(batch, "peaked", seed=batch + 29)
    g = torch.Generator().manual_seed(batch + 1)
    flat_rows = torch.arange(batch) % 2 == 1
    hidden[flat_rows] = (torch.randint(-2, 3, (int(flat_rows.sum()), D), generator=g).float() / 8).bfloat16()
    logits = hidden.float() @ weight.float().T
    values = [0.05, 0.3, 0.01, 0.6, 0.0, 0.9, 0.1, 1.0, 0.2, 1.5, float("nan"), 0.02, 0.5]
    min_ps = torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.float64)
    if host_min_p is not None:
        min_ps = torch.full((batch,), host_min_p, dtype=torch.float64)
    kwargs = dict(temperature=temperature, seed=torch.tensor(9), offset=torch.tensor(4))
    min_p = host_min_p if host_min_p is not None else min_ps.cuda()
    on = dict(on_cuda(kwargs), min_p=min_p, truncation_path="fused_top_k")
    h, w = hidden.cuda(), weight.cuda()
    got, names = sample_with_dispatch_options(h, w, on)
    assert ran_plain_pass(names) and ran_sampler_loop(names, (0,)), names
    unfiltered, _ = sample_with_dispatch_options(h, w, on, min_p_filtered_winners=False)
    assert_same_bits(got, unfiltered, ("tokens", "scores"))
    expected = torch.ops.flashsampling.sample_from_logits(logits, min_ps=min_ps, **kwargs)  # the CPU op
    assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])
    if host_min_p is None:
        off = (min_ps <= 0.0).cuda()
        plain = fs.sample_with_scores(h, w, **on_cuda(kwargs))
        assert torch.equal(got.tokens.reshape(batch)[off], plain.tokens.reshape(batch)[off])


@requires_sm90
@pytest.mark.parametrize("batch", [16, 32, 48, 130])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "row_temperatures_seeds"])
def test_first_winners_in_reduction_with_tied_first_tokens(batch, controls):
    """top_p alone on the plain pass: the reduction keeps a row's plain token itself where no
    allowed key lies ahead of it in the truncation order (DispatchOptions::
    first_winners_in_reduction), which ties of a row's largest logit put to the test. Each row's
    largest logit is copied to a token just before it (its vocabulary tile), just after it, 300
    before (an earlier tile) or 300 after, so that a row's winner is often a first token with a tie
    ahead of it, which top_p 0.1 then fails. Tokens and scores as the CPU op's on exact logits and
    as the rounds' (the option off), bit for bit, for top_p 0.1 and [B] top_p; with per-row
    temperatures (greedy rows among them) and per-row seeds too."""
    hidden, weight, _ = exact_problem(batch, "peaked", seed=batch + 5)
    w = weight.float()
    first = (hidden.float() @ w.T).argmax(1)
    shifts = torch.tensor([-1, 1, -300, 300])
    w[(first + shifts[torch.arange(batch) % 4]).clamp(0, V - 1)] = w[first]
    weight = w.bfloat16()
    logits = hidden.float() @ weight.float().T
    assert ((logits == logits.max(1, keepdim=True).values).sum(1) > 1).float().mean() > 0.5
    kwargs = dict(temperature=0.8, seed=torch.tensor(21), offset=torch.tensor(4))
    if controls:
        temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) + 0.5
        temperatures[::9] = 0.0
        kwargs.update(temperature=temperatures, seed=torch.arange(batch) * 5 + 2, offset=torch.arange(batch))
    h, w = hidden.cuda(), weight.cuda()
    # [B] top_p clear of the shares a tie of two, three or four first tokens puts ahead of a winner
    # (1/4, 1/3, 1/2, ...): there the rounds' fixed-point masses, whose tail rounds to 0, reach top_p
    # exactly, and the CPU op's float64 ones do not.
    values = [0.1, 0.3, 0.7, 0.9, 1.0, 0.0, float("nan"), 0.95, 0.2]
    top_ps = torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.float64)
    for top_p in (0.1, top_ps):
        on = dict(on_cuda(kwargs), top_p=top_p.cuda() if isinstance(top_p, torch.Tensor) else top_p,
                  truncation_path="fused_top_k")
        got, names = sample_with_dispatch_options(h, w, on)
        # up to 32 rows the plain pass takes the calls of the plain loop (narrow_plain_pass)
        assert ran_top_p_on_plain_pass(names) == (batch > 32 or not controls), names
        rounds, _ = sample_with_dispatch_options(h, w, on, first_winners_in_reduction=False)
        assert_same_bits(got, rounds, ("tokens", "scores"))
        op_kwargs = cpu_op_kwargs(kwargs) if controls else dict(kwargs)
        op_kwargs["top_ps" if isinstance(top_p, torch.Tensor) else "top_p"] = top_p
        expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
        assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
        assert torch.equal(got.scores.cpu(), expected[1])


@requires_sm90
@pytest.mark.parametrize("batch", [48, 130])
@pytest.mark.parametrize("regime", ["flat", "llm"])
def test_top_p_on_plain_pass_equals_the_top_k_scan(regime, batch):
    """bf16 logits of an LM head (the pass's own accumulators, D = LONG_MAINLOOP_D): top_p alone
    on the plain pass gives the top-k scan's tokens and scores bit for bit (at 48 rows its tile
    winners where the seed is batch-wide, else and at 130 its streaming pass), for a [B] top_p and
    a host one, and with per-row
    temperatures and a bias, or per-row seeds; plain sampling's token where top_p is off. The calls
    the plain pass does not take keep the top-k scan: min_p with top_p, a greedy call, and up to 32
    rows one with per-row temperatures (there a call of the plain loop takes CUTLASS's narrow plain
    tiles, DispatchOptions::narrow_plain_pass)."""
    weight = lm_head_weight(V, LONG_MAINLOOP_D, seed=8).cuda()
    hidden = hidden_states(weight, batch, regime, seed=batch + 1)
    kwargs = dict(temperature=0.7, seed=torch.tensor(3, device="cuda"), offset=torch.tensor(9, device="cuda"),
                  truncation_path="fused_top_k")
    g = torch.Generator(device="cuda").manual_seed(batch)
    controls = [dict(), dict(temperature=torch.rand(batch, device="cuda", generator=g) + 0.4,
                             logit_bias=torch.randn(V, device="cuda", generator=g)),
                dict(seed=torch.arange(batch, device="cuda"), offset=torch.zeros(batch, dtype=torch.int64, device="cuda"))]
    for top_p in (per_row("p", batch).cuda(), 0.9):
        for control in controls:
            call = dict(kwargs, top_p=top_p, **control)
            got, names = sample_with_dispatch_options(hidden, weight, call)
            assert ran_top_p_on_plain_pass(names), names
            scan, names = sample_with_dispatch_options(hidden, weight, call, top_p_on_plain_pass=False)
            assert any("truncate_candidates_kernel" in n for n in names), names
            assert_same_bits(got, scan, ("tokens", "scores"))
    top_p = per_row("p", batch).cuda()
    plain = fs.sample(hidden, weight, temperature=0.7, seed=kwargs["seed"], offset=kwargs["offset"])
    off = top_p >= 1.0
    got, _ = sample_with_dispatch_options(hidden, weight, dict(kwargs, top_p=top_p))
    assert torch.equal(got.tokens.reshape(batch)[off], plain.reshape(batch)[off])
    for other in (dict(min_p=0.02), dict(temperature=0.0)):
        _, names = sample_with_dispatch_options(hidden, weight, dict(kwargs, top_p=top_p, **other))
        assert not ran_top_p_on_plain_pass(names), (other.keys(), names)
    # Up to 32 rows a call of the plain loop runs on CUTLASS's narrow plain tiles (16 wide, 32 wide
    # in clusters), whose visitor stores the logits, and gives the top-k scan's bits; one with
    # per-row temperatures keeps the top-k scan.
    for rows in (16, 32):
        narrow = dict(kwargs, top_p=top_p[:rows])
        got, names = sample_with_dispatch_options(hidden[:rows], weight, narrow)
        assert ran_top_p_on_plain_pass(names), names
        scan, names = sample_with_dispatch_options(hidden[:rows], weight, narrow, narrow_plain_pass=False)
        assert any("truncate_candidates_kernel" in n for n in names), names
        assert_same_bits(got, scan, ("tokens", "scores"))
        _, names = sample_with_dispatch_options(hidden[:rows], weight,
                                                dict(narrow, temperature=controls[1]["temperature"][:rows]))
        assert not ran_top_p_on_plain_pass(names), names


@requires_sm90
@pytest.mark.parametrize("temperature, cut, values", [
    (1.0, "top_p", (0.8, 0.75, 0.85, 0.7, 0.9)),
    (2.5, "top_p", (0.5, 0.45, 0.55, 0.4, 0.6, 0.35, 0.65)),
    (2.5, "min_p", (0.05, 0.03, 0.07, 0.02, 0.1)),
])
def test_plain_pass_chi_square(temperature, cut, values):
    """The plain pass's truncated distribution: 40 copies of one hidden row (each row its own noise
    stream, so one call gives 40 independent samples), 250 calls at offsets 0-249; every token a
    survivor of the float64 reference and chi-square against the renormalised distribution, on an
    LLM-like row (at T = 2.5 hundreds of top_p survivors, whose first winners often fail; a flat
    row's cut always lies within rounding of the reference). The cut is the first of `values` that
    lies clear of rounding; min_p's rows whose winner fails it take the streaming pass."""
    from flashsampling_cuda.reference import reference_truncation

    batch, calls, vocab = 40, 250, 8192
    weight = lm_head_weight(vocab, 64, seed=1)
    hidden = hidden_states(weight, 1, "llm", seed=2)
    value = next(v for v in values
                 if (reference_truncation(hidden, weight, temperature, **{cut: v}).boundary_gap > 1e-4).all())
    rows = hidden.expand(batch, -1).contiguous()

    def call(offset):
        return fs.sample(rows, weight, temperature=temperature, seed=5, offset=offset, truncation_path="fused_top_k",
                         **{cut: value})

    names = run_listing_cuda_kernels(lambda: call(0))[1]
    assert (ran_top_p_on_plain_pass if cut == "top_p" else ran_plain_pass)(names), names
    tokens = torch.cat([call(o).reshape(batch) for o in range(calls)])
    assert_truncated_distribution(tokens.reshape(1, -1).cpu(), hidden, weight, temperature, **{cut: value})


@requires_sm90
@pytest.mark.parametrize("batch", [3, 40, 64])
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("top_k", [1500, 5000])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "bias_mask"])
def test_large_top_k_rows_decided_by_their_winner_equal_cpu_op(top_k, regime, batch, controls):
    """A host top_k above 1024 alone, one sample, the batch-wide seed: the GEMM draws the tile
    winners, and stage 2 gives a row plain sampling's token when it lies among the row's first 64
    tokens (peaked rows), else the logits sampler samples it (flat rows). The CPU op's tokens and
    scores on the same logits bit for bit, and the same as without the winners (every row on the
    logits sampler); "auto" takes this route up to FUSED_LARGE_TOP_K_MAX_BATCH rows."""
    hidden, weight, logits = exact_problem(batch, regime, seed=batch + top_k)
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 1.5 + 0.4
    temperatures[::4] = 0.0
    kwargs = dict(temperature=temperatures, seed=torch.tensor(13), offset=torch.tensor(2), top_k=top_k)
    if controls:
        c = random_controls(batch, V, "cpu", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64, empty_mask_token=-7)
    on = on_cuda(kwargs)
    h, w = hidden.cuda(), weight.cuda()
    op_kwargs = cpu_op_kwargs(kwargs)
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    results = {}
    for winners in (True, False):
        results[winners], _ = sample_with_dispatch_options(h, w, {**on, "truncation_path": "fused_top_k"},
                                                           top_p_tile_winners=winners)
        assert torch.equal(results[winners].tokens.cpu(), expected[0])
        assert torch.equal(results[winners].scores.cpu(), expected[1])
    assert_same_bits(results[True], results[False], ("tokens", "scores"))
    auto = fs.truncation.choose_truncation_path("auto", fs.truncation.Truncation(top_k, None, None), h, w,
                                                dict(seed=on["seed"], offset=on["offset"], num_samples=1,
                                                     sparse_bias_ids=None))
    assert auto == ("fused_top_k" if batch <= fs.truncation.FUSED_LARGE_TOP_K_MAX_BATCH else "logits")


@requires_sm90
@pytest.mark.parametrize("levels", [1, 3], ids=["all_tied", "three_values"])
@pytest.mark.parametrize("return_logprobs", [True, False], ids=["logprobs", "tokens"])
def test_large_top_k_on_tied_logits_equals_cpu_op(levels, return_logprobs):
    """A host top_k = 1000 on rows whose logits take one or three values: thousands of keys of one
    y, whose selects (the bound's two digits, then kappa's) and repairs (every tile's list may hide
    more of the top k) meet ties everywhere. The CPU op's tokens and scores on the same logits, and
    its log-probabilities where asked for (the kernel sums the kept mass only then)."""
    batch = 5
    g = torch.Generator().manual_seed(levels)
    weight = (torch.randint(0, levels, (V, 1), generator=g).float() / 8).expand(V, D).contiguous()
    hidden = torch.randint(-2, 3, (batch, D), generator=g).float() / 8
    logits = hidden @ weight.T
    kwargs = dict(temperature=torch.tensor([0.8, 0.0, 1.0, 2.5, 0.6]), seed=torch.tensor(7),
                  offset=torch.tensor(3), num_samples=2, return_logprobs=return_logprobs, top_k=1000)
    on = on_cuda(kwargs)
    got = fs.sample_with_scores(hidden.bfloat16().cuda(), weight.bfloat16().cuda(), truncation_path="fused_top_k",
                                **on)
    op_kwargs = cpu_op_kwargs(kwargs)
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])
    if return_logprobs:
        torch.testing.assert_close(got.token_logprobs.cpu(), expected[2], rtol=1e-4, atol=1e-4, equal_nan=True)


@requires_sm90
def test_large_top_k_at_a_full_vocabulary_equals_cpu_op():
    """A host top_k = 1000 at V = 151936 on logits with few ties (integer weights and hidden states
    up to 127, exact in bf16 and their dot products in fp32): a few of a row's 2374 tiles hold four
    of its top k and are recomputed, and rows 0 and 1 have a tile of 7 / 12 tokens far ahead of the
    rest, so that a repair adds 3 / 8 tokens to the k kept, which the select after it takes apart.
    The CPU op's tokens and scores on the same logits."""
    batch, vocab = 4, 151936
    g = torch.Generator().manual_seed(17)
    weight = torch.randint(-127, 128, (vocab, D), generator=g).float()
    hidden = torch.randint(-127, 128, (batch, D), generator=g).float()
    for row, tile, tokens in ((0, 100, 7), (1, 200, 12)):
        ids = torch.arange(tokens) + tile * 64
        weight[ids] = (120 * hidden[row].sign() + torch.randint(-7, 8, (tokens, D), generator=g)).clamp(-127, 127)
    logits = hidden @ weight.T
    assert logits.abs().max() < 2**24
    kwargs = dict(temperature=torch.tensor([2.0e4, 3.0e4, 0.0, 5.0e4]), seed=torch.tensor(5), offset=torch.tensor(2),
                  num_samples=2, top_k=1000)
    on = on_cuda(kwargs)
    got = fs.sample_with_scores(hidden.bfloat16().cuda(), weight.bfloat16().cuda(), truncation_path="fused_top_k", **on)
    op_kwargs = cpu_op_kwargs(kwargs)
    expected = torch.ops.flashsampling.sample_from_logits(logits, **op_kwargs)  # the CPU op
    assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(got.scores.cpu(), expected[1])


@requires_sm90
@pytest.mark.parametrize("vocab", [V, V - 40], ids=["whole_tiles", "ragged_last_tile"])
@pytest.mark.parametrize("batch", [40, 64, 130])
@pytest.mark.parametrize("regime", ["flat", "peaked"])
@pytest.mark.parametrize("controls", ["plain", "bias_mask", "few_allowed"])
def test_large_top_k_run_keys_equal_stored_logits(batch, regime, controls, vocab):
    """A host top_k = 1000 on the epilogue-warpgroup top-k scan (33 rows and more) stores each
    16-token run's four largest keys in place of x, and the selection's repairs read those,
    recomputing the other tokens of a run whose fourth key may hide more of the top k (at
    V = 32768 a row's tiles mostly need repairs, a few runs a row hold four of its top k, and the
    flat rows' logits tie by the hundred). Rows 0 and 1 also get a run of 12 / 7 tokens far ahead
    of the rest. Also with a vocabulary whose last run and last tile end past V, and with a mask
    that leaves each row fewer tokens than k (~650: kappa is then no bound, every run holding four
    of them is repaired). Tokens, scores and log-probabilities as CUTLASS's scan gives them from
    the x it stores (DispatchOptions::top_candidates_epilogue_warpgroups off), bit for bit, and
    the CPU op's tokens and scores on the same exact logits."""
    hidden, weight, _ = exact_problem(batch, regime, seed=batch + 71, vocab=vocab)
    weight = weight.float()
    for row, run, tokens in ((0, 300, 12), (1, 1500, 7)):
        weight[run * 16 + torch.arange(tokens)] = 3 / 8 * hidden[row].float().sign()
    weight = weight.bfloat16()
    logits = hidden.float() @ weight.float().T
    assert logits.abs().max() < 2**11  # exact in fp32 in every summation order
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) * 1.5 + 0.4
    temperatures[::5] = 0.0
    kwargs = dict(temperature=temperatures, seed=torch.tensor(11), offset=torch.tensor(3), top_k=1000,
                  num_samples=2, return_logprobs=True)
    if controls != "plain":
        c = random_controls(batch, vocab, "cpu", vocab_start=32, seed=batch,
                            density=0.7 if controls == "bias_mask" else 0.02)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=32, empty_mask_token=-3)
    on = {**on_cuda(kwargs), "truncation_path": "fused_top_k"}
    h, w = hidden.cuda(), weight.cuda()
    run_keys, names = sample_with_dispatch_options(h, w, on)
    assert ran_top_candidates_epilogue_warpgroups(names), names
    stored_x, names = sample_with_dispatch_options(h, w, on, top_candidates_epilogue_warpgroups=False)
    assert not ran_top_candidates_epilogue_warpgroups(names), names
    assert_same_bits(run_keys, stored_x, ("tokens", "scores", "token_logprobs", "logsumexp"))
    expected = torch.ops.flashsampling.sample_from_logits(logits, **cpu_op_kwargs(kwargs))  # the CPU op
    assert torch.equal(run_keys.tokens.cpu(), expected[0]), (run_keys.tokens.cpu() != expected[0]).nonzero()[:8]
    assert torch.equal(run_keys.scores.cpu(), expected[1])


@requires_sm90
def test_min_p_call_rows_without_a_finite_first_y_equal_cpu_op():
    """A min_p call whose rows' first y is -inf (a bias of -inf everywhere, one NaN): min_p's test
    keeps the first token alone in every row, also in rows whose own min_p is off (the cut kernel
    applies the test to every row of the call); tokens, scores and logsumexp as the CPU op's."""
    batch = 6
    hidden, weight, logits = exact_problem(batch, "flat", seed=5)
    bias = torch.full((V,), float("-inf"))
    bias[100] = float("nan")
    min_ps = torch.tensor([0.05, 0.0, 0.3, 0.0, 1.0, 0.0], dtype=torch.float64)
    kwargs = dict(temperature=0.8, seed=torch.tensor(3), offset=torch.tensor(1), return_logprobs=True)
    got = fs.sample_with_scores(hidden.cuda(), weight.cuda(), logit_bias=bias.cuda(), min_p=min_ps.cuda(),
                                truncation_path="fused_top_k", **kwargs)
    expected = torch.ops.flashsampling.sample_from_logits(logits, logit_bias=bias, min_ps=min_ps,
                                                          **kwargs)
    assert torch.equal(got.tokens.cpu(), expected[0])
    assert torch.equal(got.scores.cpu(), expected[1])
    torch.testing.assert_close(got.logsumexp.cpu(), expected[3], equal_nan=True)


@requires_sm90
@pytest.mark.parametrize("vocab", [V, V - 3], ids=["whole_rows", "ragged_row_end"])
@pytest.mark.parametrize("batch", [8, 44])
@pytest.mark.parametrize("num_samples, return_logprobs", [(1, False), (2, True)])
def test_streamed_min_p_rows_equal_cpu_op(vocab, batch, num_samples, return_logprobs):
    """min_p on flat rows (their 64th token passes it): stage 2 hands every row to the streaming
    pass, whose quads of min_p rows (every row noisy, no bias or mask) take the sparse pass, a row
    at a time in float4 loads (with V - 3, the rows' last tokens one a thread); per-row min_p and
    temperatures, per-row seeds in one call and the batch-wide seed in another. Tokens and scores
    as the CPU op's, bit for bit."""
    hidden, weight, logits = exact_problem(batch, "flat", seed=batch + vocab, vocab=vocab)
    g = torch.Generator().manual_seed(batch)
    min_ps = torch.rand(batch, generator=g, dtype=torch.float64) * 0.05 + 0.01
    temperatures = torch.rand(batch, generator=g) * 1.5 + 0.5
    for seeds in (dict(seed=torch.tensor(7), offset=torch.tensor(2)),
                  dict(seed=torch.arange(batch) + 5, offset=torch.arange(batch) % 3)):
        kwargs = dict(num_samples=num_samples, return_logprobs=return_logprobs, **seeds)
        on = {name: value.cuda() for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        got, kernels = sample_with_dispatch_options(  # (at 44 rows one sample takes the plain pass by default)
            hidden.cuda(), weight.cuda(), dict(kwargs, **on, temperature=temperatures.cuda(), min_p=min_ps.cuda(),
                                               truncation_path="fused_top_k"), min_p_on_plain_pass=False)
        assert any("streaming_sample_kernel" in name for name in kernels)
        expected = torch.ops.flashsampling.sample_from_logits(logits, temperatures=temperatures, min_ps=min_ps,
                                                              **kwargs)
        assert torch.equal(got.tokens.cpu(), expected[0]), (got.tokens.cpu() != expected[0]).nonzero()[:8]
        assert torch.equal(got.scores.cpu(), expected[1])
        if return_logprobs:
            torch.testing.assert_close(got.token_logprobs.cpu(), expected[2], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.logsumexp.cpu(), expected[3], rtol=1e-5, atol=1e-5)


@requires_sm90
@pytest.mark.parametrize("truncation, temperature", [(dict(top_p=0.8), 1.0), (dict(min_p=0.1), 0.7),
                                                     (dict(top_k="k20", top_p=0.9), 1.2), (dict(top_k=200), 1.5),
                                                     (dict(top_k=200, top_p=0.9), 1.5)])
def test_fused_truncation_chi_square(truncation, temperature):
    batch, samples, vocab = 4, 20_000, 8192
    weight = lm_head_weight(vocab, 64, seed=1)
    hidden = hidden_states(weight, batch, "llm", seed=2)
    trunc = {name: torch.full((batch,), 20, device="cuda") if value == "k20" else value
             for name, value in truncation.items()}
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=torch.arange(batch, device="cuda") + 3,
                       num_samples=samples, truncation_path="fused_top_k", **trunc).cpu()
    assert_truncated_distribution(tokens, hidden, weight, temperature,
                                  **{name: 20 if value == "k20" else value for name, value in truncation.items()})


@requires_sm90
@pytest.mark.parametrize("batch, row_temperatures", [(16, False), (16, True), (100, False)])
def test_top_p_rounds_graph_replay(batch, row_temperatures):
    """top_p alone on flat rows, one sample: the top_p rounds (launches that read their rows'
    count on the device) run inside a captured CUDA graph. Each replay with a new offset gives the
    eager call's tokens and scores (top_p = 0.5 fails many first winners, so the drawing rounds and
    later rounds find rows), and the replays differ. At a host temperature plain sampling's pass
    draws each row's token (top_p on the plain pass: no stage 2, no streaming pass; at 16 rows
    CUTLASS's narrow plain tile); with per-row temperatures at 16 rows the top-k scan's GEMM draws
    the winners for stage 2."""
    hidden, weight, _ = exact_problem(batch, "flat", seed=batch)
    hidden, weight = hidden.cuda(), weight.cuda()
    top_p = torch.full((batch,), 0.5, dtype=torch.float64, device="cuda")
    offset = torch.tensor(0, device="cuda")
    seed = torch.tensor(17, device="cuda")

    temperature = torch.full((batch,), 0.8, device="cuda") if row_temperatures else 0.8

    def step(o):
        return fs.sample_with_scores(hidden, weight, temperature=temperature, seed=seed, offset=o, top_p=top_p,
                                     truncation_path="fused_top_k")

    _, names = run_listing_cuda_kernels(lambda: step(offset))  # warm up outside the capture
    assert any("top_p_round_kernel" in n for n in names), names
    assert not any("streaming_sample_kernel" in n for n in names), names
    assert any("truncate_candidates_kernel" in n for n in names) == row_temperatures, names
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(offset)
    seen = []
    for replay in range(3):
        offset.fill_(replay * 3 + 1)
        graph.replay()
        eager = step(torch.tensor(replay * 3 + 1, device="cuda"))
        assert torch.equal(captured.tokens, eager.tokens)
        assert torch.equal(captured.scores, eager.scores)
        seen.append(captured.tokens.clone())
    assert not torch.equal(seen[0], seen[1])


@requires_sm90
def test_fused_truncation_graph_replay_and_compile():
    batch = 16
    weight = lm_head_weight(V, D, seed=4)
    hidden = hidden_states(weight, batch, "llm", seed=5)
    top_k = per_row("k", batch).cuda()
    top_p = per_row("p", batch).cuda()
    offset = torch.tensor(0, device="cuda")
    seed = torch.tensor(9, device="cuda")

    def step(h, w, k, p, o):
        return fs.sample(h, w, temperature=0.9, seed=seed, offset=o, top_k=k, top_p=p, num_samples=2,
                         truncation_path="fused_top_k")

    step(hidden, weight, top_k, top_p, offset)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(hidden, weight, top_k, top_p, offset)
    seen = []
    for replay in range(3):
        offset.fill_(replay * 2)
        graph.replay()
        assert torch.equal(captured, step(hidden, weight, top_k, top_p, torch.tensor(replay * 2, device="cuda")))
        seen.append(captured.clone())
    assert not torch.equal(seen[0], seen[1])
    compiled = torch.compile(step, fullgraph=True)(hidden, weight, top_k, top_p, offset)
    assert torch.equal(compiled, step(hidden, weight, top_k, top_p, offset))


@pytest.mark.parametrize("path", ["fused_top_k", "logits", "materialized"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_narrow_per_row_tensors_equal_their_widening(device, path):
    """int32 top_k and float32 top_p / min_p [B] tensors (vLLM's and FlashInfer's dtypes), which the
    ops take as they are (the CUDA ops widen them in the launch that zeroes their row list), give
    the tokens and scores of their exact int64 / float64 widening on every path."""
    if device == "cpu" and path != "materialized":
        pytest.skip("the CPU takes the materialised path")
    if device == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused pass takes every truncation form on sm90 only")
    batch = 13
    hidden, weight, _ = exact_problem(batch, "peaked", seed=29)
    hidden, weight = hidden.to(device), weight.to(device)
    rows = torch.arange(batch)
    narrow = {"top_k": torch.tensor([50, 0, 1, 7, 64, 65, 20, 2000])[rows % 8].int(),
              "top_p": torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.8, 0.999])[rows % 7].float(),
              "min_p": torch.tensor([0.05, 0.0, 0.3, 0.01, 0.1])[rows % 5].float()}
    for names in (("top_k",), ("top_k", "top_p"), ("top_p",), ("min_p",), ("top_k", "top_p", "min_p")):
        given = {name: narrow[name].to(device) for name in names}
        widened = {name: (t.long() if t.dtype == torch.int32 else t.double()) for name, t in given.items()}
        kwargs = dict(temperature=0.8, seed=11, truncation_path=path)
        got = fs.sample_with_scores(hidden, weight, **kwargs, **given)
        want = fs.sample_with_scores(hidden, weight, **kwargs, **widened)
        assert torch.equal(got[0], want[0]), names
        assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), names
