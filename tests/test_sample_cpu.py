"""flashsampling.sample on the CPU: exactness (statistical and pathwise), determinism,
argument errors and torch integration (opcheck, torch.compile)."""

import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda import noise
from flashsampling_cuda.reference import reference_sample
from sampling_stats import chi_square_pvalue, integer_problem, make_problem, pathwise_mismatches, softmax_rows

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- exactness: statistics

# (V, temperature, B, samples per row, dtype, rows differ, per-row seeds)
CHI_SQUARE_CONFIGS = [
    (2, 1.0, 4, 25_000, torch.float32, False, False),
    (10, 0.5, 4, 25_000, torch.float32, True, False),
    (100, 2.0, 8, 12_500, torch.float32, False, False),
    (997, 1.0, 8, 12_500, torch.bfloat16, False, False),  # prime V
    (1000, 0.7, 5, 20_000, torch.float16, True, False),  # B % 4 == 1: a single-lane row
    (2048, 1.5, 8, 12_500, torch.float32, False, False),  # one CPU vocab chunk (2048 rows at small D)
    (2049, 1.0, 4, 25_000, torch.float32, False, False),  # one past a chunk boundary
    (4999, 1.0, 8, 12_500, torch.float32, False, False),  # prime V
    (5000, 0.8, 4, 25_000, torch.bfloat16, True, False),
    (1000, (0.5, 1.0, 2.0, 4.0), 4, 25_000, torch.float32, False, False),  # per-row T
    (500, 1.0, 4, 25_000, torch.float32, False, True),  # per-row seeds
]


@pytest.mark.parametrize(
    "vocab,temperature,batch,samples,dtype,rows_differ,per_row_seed", CHI_SQUARE_CONFIGS
)
def test_chi_square_matches_softmax(vocab, temperature, batch, samples, dtype, rows_differ, per_row_seed):
    hidden, weight = make_problem(batch, vocab, 32, dtype=dtype, seed=vocab, same_rows=not rows_differ)
    seed = torch.arange(100, 100 + batch) if per_row_seed else 7
    if isinstance(temperature, tuple):
        temperature = torch.tensor(temperature)
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=seed, num_samples=samples)
    assert tokens.shape == (batch, samples) and tokens.dtype == torch.int64
    probs = softmax_rows(hidden, weight, temperature)
    if rows_differ or isinstance(temperature, torch.Tensor):
        p = chi_square_pvalue(tokens, probs)
    else:
        p = chi_square_pvalue([tokens], [probs[0]])
    assert p > 1e-3, f"chi-square p = {p:.2e}"


# ---------------------------------------------------------------- exactness: pathwise

PATHWISE_CONFIGS = [
    dict(batch=64, vocab=3001, dim=96, dtype=torch.float32, temperature=1.0, num_samples=16, seed=5),
    dict(batch=32, vocab=5000, dim=256, dtype=torch.bfloat16, temperature=0.6, num_samples=3,
         seed="per_row", offset="per_row"),
    dict(batch=19, vocab=777, dim=64, dtype=torch.float16, temperature="per_row_with_greedy",
         num_samples=8, seed=123, offset=1000),
    dict(batch=6, vocab=4097, dim=512, dtype=torch.float32, temperature=0.0, num_samples=1, seed=1),
    dict(batch=128, vocab=1000, dim=2048, dtype=torch.bfloat16, temperature=1.0, num_samples=8, seed=9),
]


def resolve(config):
    """Concrete hidden, weight and keyword arguments of a PATHWISE_CONFIGS entry."""
    batch = config["batch"]
    hidden, weight = make_problem(batch, config["vocab"], config["dim"], dtype=config["dtype"],
                                  logit_std=3.0, seed=batch)
    temperature = config["temperature"]
    if temperature == "per_row_with_greedy":
        temperature = torch.linspace(0.0, 2.0, batch)
    seed = torch.arange(batch) * 7919 + 3 if config["seed"] == "per_row" else config["seed"]
    offset = config.get("offset", 0)
    if offset == "per_row":
        offset = torch.arange(batch) * 10
    return hidden, weight, dict(temperature=temperature, seed=seed, offset=offset,
                                num_samples=config["num_samples"])


@pytest.mark.parametrize("config", PATHWISE_CONFIGS, ids=lambda c: f"B{c['batch']}-V{c['vocab']}-{c['dtype']}")
def test_pathwise_equal_to_float64_reference(config):
    hidden, weight, kwargs = resolve(config)
    tokens = fs.sample(hidden, weight, **kwargs)
    ref = reference_sample(hidden, weight, **kwargs)
    mismatches, unexplained = pathwise_mismatches(tokens, ref)
    print(f"mismatches {mismatches} / {tokens.numel()}, outside near ties {unexplained}")
    assert unexplained == 0
    assert mismatches <= max(1, tokens.numel() // 100)


@pytest.fixture(params=["default", "avx2", "avx512", "avx512bf16"])
def cpu_isa(request, monkeypatch):
    """Pins the CPU code path (FLASHSAMPLING_CPU_ISA); skips those this CPU lacks."""
    monkeypatch.setenv("FLASHSAMPLING_CPU_ISA", request.param)
    try:
        fs.sample(torch.zeros(1, 1), torch.zeros(1, 1), seed=0)
    except RuntimeError as e:
        pytest.skip(str(e))
    return request.param


@pytest.mark.parametrize("per_row_seed", [False, True])
def test_bit_exact_fp32_model(cpu_isa, per_row_seed):
    """With exact fp32 logits the op is exactly argmax(fma(logit, fl(1/T), g)) in fp32,
    on every CPU code path, block (4 rows per Philox call) and single-lane alike."""
    batch, vocab, samples = 11, 2500, 3
    hidden, weight = integer_problem(batch, vocab, 24)
    temps = torch.tensor([0.7, 1.0, 0.0, 2.5, 1.3, 0.9, 0.0, 0.0, 0.0, 1.1, 3.0])
    seed = torch.arange(batch) + 50 if per_row_seed else 9
    tokens = fs.sample(hidden, weight, temperature=temps, seed=seed, offset=4, num_samples=samples)

    logits = (hidden.double() @ weight.double().T).float()
    inv_t = torch.ones(()) / temps
    streams = torch.zeros(batch, dtype=torch.int64) if per_row_seed else torch.arange(batch)
    seeds = noise.as_int64_tensor(seed).expand(batch)
    for s in range(samples):
        g = noise.gumbel_noise(seeds[:, None], 4, streams[:, None], s, torch.arange(vocab))
        scores = torch.where((temps == 0)[:, None], logits, noise.fma32(logits, inv_t[:, None], g))
        assert torch.equal(tokens[:, s], scores.argmax(dim=1)), f"sample {s}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_are_fp32_dot_products_on_every_code_path(cpu_isa, dtype):
    """The CPU logits (torch.ops.flashsampling._logits: what the op scores, and what the
    materialised truncation path reads) are fp32 dot products on every code path: within fp32
    accumulation error of float64, and bit for bit the same whatever the thread count, the
    weight's strides or a logit's position in the batch and the vocabulary."""
    threads = torch.get_num_threads()
    for batch, dim, vocab in [(1, 1, 3), (5, 37, 300), (9, 300, 1025), (4, 4096, 70)]:
        hidden, weight = make_problem(batch, vocab, dim, dtype=dtype, seed=dim)
        logits = torch.ops.flashsampling._logits(hidden, weight)
        assert logits.dtype == torch.float32 and logits.shape == (batch, vocab)
        exact = hidden.double() @ weight.double().T
        bound = dim * 2.0**-22 * (hidden.double().abs() @ weight.double().abs().T)
        assert ((logits.double() - exact).abs() <= bound).all()
        assert torch.equal(torch.ops.flashsampling._logits(hidden[batch // 2 :], weight[vocab // 3 :]),
                           logits[batch // 2 :, vocab // 3 :])
        padded = torch.cat([weight, weight[:, :3]], dim=1)[:, :dim]  # rows dim + 3 apart
        assert torch.equal(torch.ops.flashsampling._logits(hidden, padded), logits)
        assert torch.equal(torch.ops.flashsampling._logits(hidden, weight.T.contiguous().T), logits)
        try:
            for n in (1, 3):
                torch.set_num_threads(n)
                assert torch.equal(torch.ops.flashsampling._logits(hidden, weight), logits), n
        finally:
            torch.set_num_threads(threads)


def test_greedy_is_argmax_of_fp32_logits():
    hidden, weight = integer_problem(13, 3000, 16, seed=3)
    tokens = fs.sample(hidden, weight, temperature=0.0, seed=1, num_samples=2)
    expected = (hidden @ weight.T).argmax(dim=1)  # exact ties -> the smaller index
    assert torch.equal(tokens, expected[:, None].expand(-1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_matches_reference(dtype):
    hidden, weight = make_problem(8, 1500, 128, dtype=dtype, logit_std=3.0, seed=11)
    tokens = fs.sample(hidden, weight, temperature=0.9, seed=77, num_samples=4)
    _, unexplained = pathwise_mismatches(tokens, reference_sample(hidden, weight, 0.9, 77, 0, 4))
    assert unexplained == 0


def test_nan_scores_never_win_and_all_nan_row_gives_minus_one():
    hidden, weight = make_problem(3, 50, 8, seed=4)
    weight[10] = math.nan
    hidden[2] = math.nan
    tokens = fs.sample(hidden, weight, seed=0, num_samples=50)
    assert (tokens[:2] != 10).all() and (tokens[:2] >= 0).all()
    assert (tokens[2] == -1).all()


# ---------------------------------------------------------------- determinism

def test_same_seed_and_offset_give_same_tokens_any_thread_count():
    hidden, weight = make_problem(20, 5000, 64, seed=2)
    first = fs.sample(hidden, weight, seed=42, offset=3, num_samples=5)
    assert torch.equal(first, fs.sample(hidden, weight, seed=42, offset=3, num_samples=5))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(first, fs.sample(hidden, weight, seed=42, offset=3, num_samples=5)), n
            assert torch.equal(first[:1], fs.sample(hidden[:1], weight, seed=42, offset=3, num_samples=5)), n
    finally:
        torch.set_num_threads(threads)


def test_different_offsets_give_independent_draws():
    hidden, weight = make_problem(64, 1000, 32, logit_std=0.5, seed=3)  # near-uniform
    a = fs.sample(hidden, weight, seed=42, offset=0, num_samples=4)
    b = fs.sample(hidden, weight, seed=42, offset=4, num_samples=4)
    assert (a == b).float().mean() < 0.05  # collision chance ~ 1/1000 per draw
    # Draw s of offset o is draw 0 of offset o + s: the counter holds offset + sample.
    c = fs.sample(hidden, weight, seed=42, offset=2, num_samples=2)
    assert torch.equal(c, a[:, 2:4])


def test_per_row_seeds_make_rows_batch_invariant():
    hidden, weight = make_problem(10, 2000, 32, logit_std=1.0, seed=5)
    seeds = torch.arange(10) * 1000 + 1
    offsets = torch.arange(10) % 3
    full = fs.sample(hidden, weight, seed=seeds, offset=offsets, num_samples=3)
    for rows in ([3], [9, 0, 4], [7, 1, 2, 8, 5]):
        idx = torch.tensor(rows)
        sub = fs.sample(hidden[idx], weight, seed=seeds[idx], offset=offsets[idx], num_samples=3)
        assert torch.equal(sub, full[idx]), rows
    # Adding rows around a request does not change its tokens either.
    extra_h, _ = make_problem(5, 2000, 32, seed=6)
    grown = fs.sample(torch.cat([extra_h, hidden]), weight, seed=torch.cat([seeds[:5] + 7, seeds]),
                      offset=torch.cat([torch.zeros(5, dtype=torch.int64), offsets]), num_samples=3)
    assert torch.equal(grown[5:], full)


def test_block_and_single_lane_paths_agree():
    """A batch-wide seed lets 4 rows share one Philox call; with only one noisy row in
    the group the CPU draws that row's lane alone. The noise must be the same."""
    hidden, weight = make_problem(4, 3000, 32, seed=8)
    all_noisy = fs.sample(hidden, weight, temperature=torch.ones(4), seed=3, num_samples=2)
    for row in range(4):
        temps = torch.zeros(4)
        temps[row] = 1.0
        one_noisy = fs.sample(hidden, weight, temperature=temps, seed=3, num_samples=2)
        assert torch.equal(one_noisy[row], all_noisy[row])


def test_generator_and_manual_seed_make_no_seed_path_reproducible():
    hidden, weight = make_problem(6, 1000, 16, logit_std=0.5, seed=9)
    torch.manual_seed(1234)
    first = fs.sample(hidden, weight, num_samples=8)
    second = fs.sample(hidden, weight, num_samples=8)
    torch.manual_seed(1234)
    assert torch.equal(fs.sample(hidden, weight, num_samples=8), first)
    assert not torch.equal(first, second)  # the generator advanced
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(fs.sample(hidden, weight, generator=gen_a), fs.sample(hidden, weight, generator=gen_b))


def test_seed_and_temperature_argument_forms_agree():
    hidden, weight = make_problem(4, 700, 16, seed=10)
    base = fs.sample(hidden, weight, temperature=0.8, seed=2**64 - 3, offset=5, num_samples=2)
    same = [
        fs.sample(hidden, weight, temperature=torch.tensor(0.8), seed=-3, offset=torch.tensor(5), num_samples=2),
        fs.sample(hidden, weight, temperature=torch.full((4,), 0.8, dtype=torch.float64),
                  seed=torch.tensor(-3), offset=torch.full((4,), 5), num_samples=2),
    ]
    for tokens in same:
        assert torch.equal(tokens, base)


def test_empty_batch_returns_empty_tokens():
    tokens = fs.sample(torch.zeros(0, 8), torch.zeros(10, 8), seed=0, num_samples=3)
    assert tokens.shape == (0, 3) and tokens.dtype == torch.int64


# ---------------------------------------------------------------- argument errors

def _args(**overrides):
    """Valid op arguments (B=3, V=10, D=4) with `overrides`."""
    args = dict(hidden=torch.randn(3, 4), weight=torch.randn(10, 4), temperature=1.0, temperatures=None,
                num_samples=1, seed=torch.tensor(0), offset=None, generator=None)
    args.update(overrides)
    return args


BAD_ARGS = [
    (dict(hidden=torch.randn(3, 4, dtype=torch.float64), weight=torch.randn(10, 4, dtype=torch.float64)),
     r"hidden must be bfloat16, float16 or float32"),
    (dict(hidden=torch.randint(0, 3, (3, 4))), r"hidden must be bfloat16"),
    (dict(weight=torch.randn(10, 4, dtype=torch.bfloat16)), r"weight dtype .* must match hidden dtype"),
    (dict(hidden=torch.randn(3, 4, 1)), r"hidden must be 2-D \[B, D\], got shape \[3, 4, 1\]"),
    (dict(weight=torch.randn(10)), r"weight must be 2-D \[V, D\], got shape \[10\]"),
    (dict(weight=torch.randn(10, 5)), r"hidden \[B, D\] and weight \[V, D\] must have the same D"),
    (dict(weight=torch.randn(0, 4)), r"weight must have 1 <= V < 2\^31 rows"),
    (dict(temperature=-0.5), r"temperature must be finite and >= 0"),
    (dict(temperature=math.nan), r"temperature must be finite and >= 0"),
    (dict(temperature=math.inf), r"temperature must be finite and >= 0"),
    (dict(temperature=1e-40), r"temperature must be finite and >= 0 \(0 = greedy; a positive one at least"),
    (dict(temperatures=torch.tensor([1.0, 1e-40, 1.0])), r"temperatures must be finite and >= 0"),
    (dict(temperatures=torch.tensor([1.0, -1.0, 1.0])), r"temperatures must be finite and >= 0"),
    (dict(temperatures=torch.tensor([1.0, math.nan, 1.0])), r"temperatures must be finite and >= 0"),
    (dict(temperatures=torch.ones(4)), r"temperatures must have shape \[B\] = \[3\]"),
    (dict(temperatures=torch.ones(3, dtype=torch.float64)), r"temperatures must be a float32 tensor"),
    (dict(num_samples=0), r"num_samples must be >= 1"),
    (dict(seed=torch.tensor(0.0)), r"seed must be an int64 tensor"),
    (dict(seed=torch.tensor(0, dtype=torch.int32)), r"seed must be an int64 tensor"),
    (dict(seed=torch.zeros(2, dtype=torch.int64)), r"seed must have shape \[\] .* or \[B\] = \[3\]"),
    (dict(seed=torch.zeros(3, 1, dtype=torch.int64)), r"seed must have shape"),
    (dict(offset=torch.zeros(4, dtype=torch.int64)), r"offset must have shape"),
    (dict(offset=torch.tensor(1.5)), r"offset must be an int64 tensor"),
    (dict(seed=None, offset=torch.tensor(3)), r"offset was given without seed"),
    (dict(generator=torch.Generator()), r"pass either seed or generator, not both"),
]


@pytest.mark.parametrize("overrides,message", BAD_ARGS, ids=[m.split(" ")[0] + str(i) for i, (_, m) in enumerate(BAD_ARGS)])
def test_bad_arguments_raise_errors_naming_them(overrides, message):
    args = _args(**overrides)
    with pytest.raises(RuntimeError, match="flashsampling.sample: " + message):
        torch.ops.flashsampling.sample(args.pop("hidden"), args.pop("weight"), **args)


def test_tensors_on_different_devices_raise():
    with pytest.raises(RuntimeError, match="weight must be on hidden's device"):
        fs.sample(torch.randn(3, 4), torch.randn(10, 4, device="meta"), seed=0)


def test_wrapper_rejects_bad_seed_types():
    hidden, weight = make_problem(2, 10, 4)
    with pytest.raises(TypeError):
        fs.sample(hidden, weight, seed=1.5)
    with pytest.raises(ValueError):
        fs.sample(hidden, weight, seed=2**64)


@pytest.mark.parametrize("overrides,message", [
    (dict(temperature="hot"), "temperature must be a float, a 0-d or a \\[B\\] floating tensor, got str"),
    (dict(temperature=None), "temperature must be a float.*got NoneType"),
    (dict(temperature=[0.5, 1.0]), "temperature must be a float.*got list"),
    (dict(temperature=True), "temperature must be a float.*got bool"),
    (dict(temperature=torch.tensor([1, 2])), "temperature must be a float.*got a torch.int64 tensor"),
    (dict(temperature=torch.tensor(True)), "temperature must be a float.*got a torch.bool tensor"),
    (dict(top_k="5"), "top_k must be an int or a tensor, got str"),
    (dict(top_p="0.9"), "top_p must be a float or a tensor, got str"),
    (dict(min_p="a"), "min_p must be a float or a tensor, got str"),
    (dict(seed="abc"), "seed: expected an int or an int64 tensor, got str"),
    (dict(offset="x"), "offset: expected an int or an int64 tensor, got str"),
])
def test_wrapper_names_arguments_that_are_not_numbers(overrides, message):
    hidden, weight = make_problem(2, 10, 4)
    kwargs = dict(dict(seed=0), **overrides)
    with pytest.raises(TypeError, match="flashsampling.sample: " + message):
        fs.sample(hidden, weight, **kwargs)


def test_temperature_tensors_of_every_floating_dtype_are_rounded_to_float32():
    hidden, weight = make_problem(4, 700, 16, seed=13)
    temps = torch.tensor([0.8, 1.3, 0.0, 2.1], dtype=torch.float64)
    expected = fs.sample(hidden, weight, temperature=temps.float(), seed=3, num_samples=4)
    assert torch.equal(fs.sample(hidden, weight, temperature=temps, seed=3, num_samples=4), expected)
    for dtype in (torch.bfloat16, torch.float16):
        rounded = temps.to(dtype)
        assert torch.equal(fs.sample(hidden, weight, temperature=rounded, seed=3, num_samples=4),
                           fs.sample(hidden, weight, temperature=rounded.float(), seed=3, num_samples=4))
    assert torch.equal(fs.sample(hidden, weight, temperature=torch.tensor(0.8, dtype=torch.float64), seed=3),
                       fs.sample(hidden, weight, temperature=0.8, seed=3))


def test_empty_mask_token_must_be_a_token_of_the_vocabulary_or_negative():
    hidden, weight = make_problem(2, 10, 4)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 3] = True
    message = r"empty_mask_token must be a token id in \[vocab_start, vocab_start \+ V\) = \[100, 110\)"
    for token in (10**6, 110, 5, 99):
        with pytest.raises(RuntimeError, match=message):
            fs.sample(hidden, weight, seed=0, allowed_mask=mask, empty_mask_token=token, vocab_start=100)
        with pytest.raises(RuntimeError, match=message):  # truncation checks before the logits
            fs.sample(hidden, weight, seed=0, allowed_mask=mask, empty_mask_token=token, vocab_start=100, top_k=2)
    for token in (100, 109, -1, -7):
        tokens = fs.sample(hidden, weight, seed=0, allowed_mask=mask, empty_mask_token=token, vocab_start=100)
        assert tokens[0, 0] == 103 and tokens[1, 0] == token
    with pytest.raises(RuntimeError, match="empty_mask_token must be"):
        torch.ops.flashsampling.sample(hidden, weight, seed=torch.tensor(0), empty_mask_token=10)


# ---------------------------------------------------------------- non-finite logits

def test_non_finite_logits_follow_the_documented_rules():
    """Without check_nan: a NaN logit is never sampled; a row of NaN logits returns -1 (score
    -inf, logprob NaN); a row with +inf logits returns its first +inf token on every draw (score
    +inf); a row of -inf logits returns its first allowed token (score -inf)."""
    hidden, weight = make_problem(4, 50, 8, seed=14)
    w = weight.clone()
    w[10] = math.nan
    tokens = fs.sample(hidden, w, seed=0, num_samples=200)
    assert (tokens != 10).all() and (tokens >= 0).all()
    nan_hidden = hidden.clone()
    nan_hidden[2, 5] = math.nan
    out = fs.sample_with_scores(nan_hidden, weight, seed=0, num_samples=3, return_logprobs=True)
    assert (out.tokens[2] == -1).all() and (out.scores[2] == -math.inf).all() and out.token_logprobs[2].isnan().all()
    assert (out.tokens[[0, 1, 3]] >= 0).all()
    bias = torch.zeros(50)
    bias[[31, 7]] = math.inf
    for seed in range(5):
        out = fs.sample_with_scores(hidden, weight, seed=seed, num_samples=3, logit_bias=bias)
        assert (out.tokens == 7).all() and (out.scores == math.inf).all()
    mask = torch.zeros(4, 50, dtype=torch.bool)
    mask[:, 20:] = True
    out = fs.sample_with_scores(hidden, weight, seed=1, num_samples=2, logit_bias=torch.full((50,), -math.inf),
                                allowed_mask=mask)
    assert (out.tokens == 20).all() and (out.scores == -math.inf).all()


def test_check_nan_raises_naming_the_row():
    hidden, weight = make_problem(4, 50, 8, seed=14)
    clean = dict(seed=3, num_samples=2, temperature=0.7)
    assert torch.equal(fs.sample(hidden, weight, **clean, check_nan=True), fs.sample(hidden, weight, **clean))
    nan_hidden = hidden.clone()
    nan_hidden[2, 5] = math.inf
    bias_inf, bias_nan = torch.zeros(50), torch.zeros(50)
    bias_inf[7], bias_nan[9] = math.inf, math.nan
    cases = [
        (nan_hidden, {}, "hidden holds NaN or infinite values in 1 row\\(s\\) \\(first: 2\\)"),
        (hidden, dict(logit_bias=bias_inf), "a logit is \\+inf in 4 row\\(s\\) \\(first: 0, 1, 2, 3\\)"),
        (hidden, dict(sparse_logit_bias=[{}, {}, {v: -math.inf for v in range(50)}, {}]),
         "every allowed logit is -inf in 1 row\\(s\\) \\(first: 2\\)"),
        (hidden, dict(sparse_logit_bias=[{}, {}, {v: math.nan for v in range(50)}, {}]),
         "every allowed logit is NaN .* in 1 row\\(s\\) \\(first: 2\\)"),
        (hidden, dict(logit_bias=bias_nan, return_logprobs=True), "a logit among the allowed tokens is NaN"),
        (hidden, dict(logit_bias=bias_inf, top_k=5), "a logit is \\+inf"),
    ]
    for h, kwargs, message in cases:
        for fn in (fs.sample, fs.sample_with_scores):
            with pytest.raises(ValueError, match="flashsampling.sample: check_nan: " + message):
                fn(h, weight, **clean, **kwargs, check_nan=True)
            fn(h, weight, **clean, **kwargs)  # without check_nan: the rules above, no error
    # A NaN among finite logits is never sampled; without logprobs check_nan does not see it.
    fs.sample(hidden, weight, **clean, logit_bias=bias_nan, check_nan=True)
    # A row whose mask allows nothing, given empty_mask_token, is not an error.
    mask = torch.ones(4, 50, dtype=torch.bool)
    mask[1] = False
    tokens = fs.sample(hidden, weight, **clean, allowed_mask=mask, empty_mask_token=-1, check_nan=True)
    assert (tokens[1] == -1).all() and (tokens[[0, 2, 3]] >= 0).all()


# ---------------------------------------------------------------- torch integration

def test_opcheck():
    hidden, weight = make_problem(5, 300, 16, dtype=torch.bfloat16)
    op = torch.ops.flashsampling.sample.default
    torch.library.opcheck(op, (hidden, weight), dict(temperature=0.5, seed=torch.tensor(1), num_samples=3))
    torch.library.opcheck(op, (hidden.float(), weight.float()),
                          dict(temperatures=torch.rand(5), seed=torch.arange(5), offset=torch.tensor(7)))


def test_torch_compile_fullgraph():
    hidden, weight = make_problem(4, 500, 16, seed=12)

    def decode_step(h, w, temps, seeds):
        return fs.sample(torch.tanh(h) * 3, w, temperature=temps, seed=seeds, offset=2, num_samples=2)

    compiled = torch.compile(decode_step, fullgraph=True)  # inductor
    temps, seeds = torch.tensor([0.5, 1.0, 0.0, 2.0]), torch.arange(4)
    assert torch.equal(compiled(hidden, weight, temps, seeds), decode_step(hidden, weight, temps, seeds))
