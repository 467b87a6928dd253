"""GPU tests of the fused CUTLASS sampler (run on the device machine; skipped without a GPU).

Pathwise: same Philox noise => same token as the float64 reference, except rows whose
top-2 perturbed scores are within fp32 rounding (counted and reported). Statistical:
chi-square over >= 1M GPU samples. Also GPU == CPU op, generator/graph behaviour and
clear errors for inputs the kernel cannot take.
"""

import contextlib
import itertools

import pytest
import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from flashsampling_cuda.reference import reference_sample
from kernel_trace import run_listing_cuda_kernels
from sampling_stats import chi_square_pvalue, pathwise_mismatches

pytestmark = pytest.mark.requires_cuda

# The reference tolerance: fp32 accumulation over D terms in another order than the
# float64 sum; 1e-4 of the largest |logit| scale covers D = 8192 with margin.
GPU_RTOL = 1e-4

BATCHES = [1, 3, 17, 64, 176, 255, 256, 257, 1000]  # 176: three 64-wide tiles, padded
VOCABS = [1000, 32000, 151936, 151937]
DIMS = [64, 2880, 4096, 8192]
DTYPES = [torch.bfloat16, torch.float16]

# Every (B, V) pair, with D and dtype cycling through their lists, plus every (D, dtype)
# at B=64, V=151937: 40 shapes that cover each value of each axis several times.
SWEEP = [(b, v, DIMS[i % len(DIMS)], DTYPES[i % len(DTYPES)]) for i, (b, v) in enumerate(itertools.product(BATCHES, VOCABS))]
SWEEP += [(64, 151937, d, dt) for d in DIMS for dt in DTYPES]

_mismatch_report = []


def lm_head(batch, vocab, dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(batch, dim, device="cuda", generator=gen).to(dtype)
    # logits with std ~3: peaked like a real LM head, far from uniform
    weight = (torch.randn(vocab, dim, device="cuda", generator=gen) * (3.0 / dim**0.5)).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("batch,vocab,dim,dtype", SWEEP)
def test_tokens_match_float64_reference(batch, vocab, dim, dtype):
    hidden, weight = lm_head(batch, vocab, dim, dtype, seed=batch * 7 + vocab + dim)
    seed, offset = 1234 + batch, 17
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=seed, offset=offset)
    ref = reference_sample(hidden, weight, 0.8, seed=seed, offset=offset, rtol=GPU_RTOL)
    total, unexplained = pathwise_mismatches(tokens, ref)
    if total:
        # Show that every mismatch is a near tie: the reference gap against the tolerance.
        rows = (tokens.cpu() != ref.tokens.cpu()).any(dim=1).nonzero().flatten().tolist()
        detail = [(r, float(ref.gap[r, 0]), float(ref.tolerance[r])) for r in rows]
        print(f"B={batch} V={vocab} D={dim} {dtype}: {total} mismatches (row, gap, tol): {detail}")
    _mismatch_report.append((batch, vocab, dim, str(dtype), total, unexplained))
    assert unexplained == 0
    assert total <= max(1, batch // 1000)  # >= 99.9% of rows identical


def test_mismatch_summary():
    """Prints the sweep's mismatch counts (runs after the sweep in file order)."""
    rows = sum(r[0] for r in _mismatch_report)
    total = sum(r[4] for r in _mismatch_report)
    print(f"\npathwise sweep: {len(_mismatch_report)} shapes, {rows} rows, {total} mismatches (all near ties)")
    assert all(r[5] == 0 for r in _mismatch_report)


@pytest.mark.parametrize(
    "vocab,temperature,dtype",
    [(997, 1.0, torch.bfloat16), (1000, 0.7, torch.float16), (1024, 2.0, torch.bfloat16)],
)
def test_chi_square_one_million_samples(vocab, temperature, dtype):
    dim, rows, samples = 64, 4096, 256  # 4096 rows x 256 samples = 1,048,576 draws
    hidden_row, weight = lm_head(1, vocab, dim, dtype, seed=vocab)
    weight = (weight.float() * 0.5).to(dtype)  # a flatter distribution: most tokens get mass
    hidden = hidden_row.expand(rows, dim).contiguous()  # identical rows, independent streams
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=temperature, seed=99, num_samples=samples)
    probs = torch.softmax((hidden_row.double() @ weight.double().T)[0] / temperature, dim=0)
    assert tokens.min() >= 0 and tokens.max() < vocab
    assert chi_square_pvalue([tokens], [probs]) > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_tokens_equal_cpu_op_tokens(dtype):
    hidden, weight = lm_head(37, 5003, 256, dtype, seed=5)
    gpu = flashsampling_cuda.sample(hidden, weight, temperature=1.3, seed=42, offset=3, num_samples=2)
    cpu = flashsampling_cuda.sample(hidden.cpu(), weight.cpu(), temperature=1.3, seed=42, offset=3, num_samples=2)
    ref = reference_sample(hidden, weight, 1.3, seed=42, offset=3, num_samples=2, rtol=GPU_RTOL)
    differ = gpu.cpu() != cpu
    near_tie = ref.gap.cpu() < ref.tolerance.cpu()[:, None]
    assert int((differ & ~near_tie).sum()) == 0


def test_greedy_is_argmax_of_fp32_logits():
    hidden, weight = lm_head(9, 32000, 512, torch.bfloat16, seed=3)
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=0.0)
    ref = reference_sample(hidden, weight, 0.0, rtol=GPU_RTOL)
    assert pathwise_mismatches(tokens, ref)[1] == 0


# Beyond 64 GEMM columns the plain pass runs the kernel with epilogue warpgroups on sm90
# (kernel/sm90_sampler_epilogue_warpgroups.hpp): greedy batches, a vocabulary offset (a TP
# shard), a short K and a tail tile in M and N.
@pytest.mark.parametrize(
    "batch,vocab,dim,temperature,vocab_start",
    [(129, 5003, 64, 0.7, 0), (300, 32000, 2880, 0.0, 0), (256, 9000, 1024, 1.3, 4096), (1000, 3001, 8192, 0.9, 77)],
)
def test_wide_batches_match_float64_reference(batch, vocab, dim, temperature, vocab_start):
    hidden, weight = lm_head(batch, vocab, dim, torch.bfloat16, seed=batch + dim)
    tokens = flashsampling_cuda.sample(hidden, weight, temperature=temperature, seed=11, offset=5,
                                       vocab_start=vocab_start)
    ref = reference_sample(hidden, weight, temperature, seed=11, offset=5, vocab_start=vocab_start, rtol=GPU_RTOL)
    total, unexplained = pathwise_mismatches(tokens, ref)
    assert unexplained == 0
    assert total <= max(1, batch // 1000)


@contextlib.contextmanager
def dispatch_options(**options):
    """Runs the block with these DispatchOptions (sampler_params.h: variants of the dispatch
    that must give the same tokens), then restores the defaults."""
    torch.ops.flashsampling._set_dispatch_options(**options)
    try:
        yield
    finally:
        torch.ops.flashsampling._set_dispatch_options()


def assert_bitwise_equal(results, reference):
    assert len(results) == len(reference) > 0
    for got, want in zip(results, reference):
        assert torch.equal(got.view(torch.int32) if got.is_floating_point() else got,
                           want.view(torch.int32) if want.is_floating_point() else want)


def pad_probe():
    gen = torch.Generator(device="cuda").manual_seed(5)
    out = []
    for batch, k in ((33, 0), (65, 0), (129, 0), (5, 3), (40, 50)):
        hidden = torch.randn(batch, 256, device="cuda", generator=gen).to(torch.bfloat16)
        weight = (torch.randn(5003, 256, device="cuda", generator=gen) * 0.2).to(torch.bfloat16)
        temperature = torch.rand(batch, device="cuda", generator=gen) + 0.5
        if k == 0:
            out.append(flashsampling_cuda.sample(hidden, weight, temperature=0.8, seed=9))
            out.append(flashsampling_cuda.sample(hidden, weight, temperature=temperature, seed=9,
                                                 return_logprobs=True).tokens)
        elif k == 3:
            out.append(flashsampling_cuda.sample(hidden, weight, seed=9, num_samples=k))
        else:
            out.append(flashsampling_cuda.sample(hidden, weight, seed=9, top_k=k, top_p=0.9))
    return [t.cpu() for t in out]


def test_padding_hidden_rows_changes_no_token():
    """launch_sampler pads the hidden rows to whole N tiles (DispatchOptions::pad_columns): the
    same calls with and without it give the same tokens (plain, per-row T with logprobs, several
    samples, fused top-k)."""
    padded = pad_probe()
    with dispatch_options(pad_columns=False):
        ragged = pad_probe()
    assert_bitwise_equal(padded, ragged)


def noise_skip_probe():
    op = torch.ops.flashsampling.sample_with_scores
    gen = torch.Generator(device="cuda").manual_seed(6)
    out = []
    # Batches on the epilogue-warpgroup kernels (plain: > 32 columns; common controls: > 16), one to
    # three N tiles, ~2-8 vocabulary tiles per SM so that later tiles skip against earlier ones.
    for batch, vocab, dtype, vocab_start in ((65, 64000, torch.bfloat16, 0), (128, 100003, torch.float16, 7),
                                             (257, 64000, torch.bfloat16, 0), (48, 151936, torch.bfloat16, 0),
                                             (256, 50001, torch.bfloat16, 3), (200, 30011, torch.float16, 0)):
        hidden = torch.randn(batch, 256, device="cuda", generator=gen).to(dtype)
        weight = (torch.randn(vocab, 256, device="cuda", generator=gen) * 0.15).to(dtype)
        temps = torch.rand(batch, device="cuda", generator=gen) * 1.5 + 0.05
        temps[::5] = 0.0  # greedy rows
        mask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), device="cuda", generator=gen,
                             dtype=torch.int64).to(torch.int32) | 0x10  # token 4 of every word always allowed
        bias = torch.randn(vocab, device="cuda", generator=gen)
        for kwargs in (dict(temperature=0.7), dict(temperature=0.05), dict(temperatures=temps),
                       dict(temperatures=temps, allowed_mask=mask, logit_bias=bias, return_logprobs=True),
                       dict(temperature=0.0), dict(temperature=0.0, allowed_mask=mask, return_logprobs=True)):
            result = op(hidden, weight, seed=torch.tensor(13), offset=torch.tensor(2), vocab_start=vocab_start, **kwargs)
            out.extend(t for t in result if isinstance(t, torch.Tensor))
    return [t.cpu() for t in out]


def test_noise_skip_changes_no_token():
    """The epilogue-warpgroup kernels skip the exact noise of elements whose score bound lies below
    their column's best (DispatchOptions::noise_skip): with and without it the same tokens,
    scores and log-probabilities, bit for bit (low and per-row temperatures, greedy rows and
    greedy batches, mask, bias, fp16, several N tiles)."""
    skipped = noise_skip_probe()
    with dispatch_options(noise_skip=False):
        exact = noise_skip_probe()
    assert_bitwise_equal(skipped, exact)


def test_lse_references_change_no_token():
    """The controls' loop of the epilogue-warpgroup kernels sums each column's log-sum-exp terms
    against its log-sum-exp of earlier tiles (DispatchOptions::lse_references = false: against
    each step's max): the same tokens and scores bit for bit, the same log-probabilities and
    logsumexp to float rounding; and a second run gives every output bit for bit again (the
    references follow the persistent schedule, not the timing of other CTAs)."""
    referenced = noise_skip_probe()
    with dispatch_options(lse_references=False):
        step_max = noise_skip_probe()
    assert len(referenced) == len(step_max) > 0 and len(referenced) % 4 == 0
    for call in range(0, len(referenced), 4):  # (tokens, scores, token_logprobs, logsumexp) per call
        assert_bitwise_equal(referenced[call:call + 2], step_max[call:call + 2])
        lse = step_max[call + 3]
        if lse.numel():
            # a few float32 ulps of the largest logsumexp (T = 0.05 puts it in the hundreds)
            ulps = 16 * lse[lse.isfinite()].abs().max().item() * 2.0**-23
            for got, want in zip(referenced[call + 2:call + 4], step_max[call + 2:call + 4]):
                torch.testing.assert_close(got, want, rtol=0, atol=ulps, equal_nan=True)
    assert_bitwise_equal(noise_skip_probe(), referenced)


def test_epilogue_warpgroup_clusters_change_no_token():
    """The epilogue-warpgroup kernels run an even number of column tiles in clusters of two CTAs
    that share each W tile by TMA multicast (B = 200, 256 here; DispatchOptions::column_clusters
    = false: one CTA a cluster): the same tiles, so the same tokens, scores and
    log-probabilities, bit for bit (bf16 and fp16, both loops)."""
    clustered = noise_skip_probe()
    with dispatch_options(column_clusters=False):
        single = noise_skip_probe()
    assert_bitwise_equal(clustered, single)
    # and the default really runs the pairs: the mainloop's cluster shape (1, 2, 1) in the kernel name
    import re

    column_pairs = re.compile(r"C<1>,\s*cute::C<2>,\s*cute::C<1>")
    assert any(column_pairs.search(n) for n in controls_kernel_names(256))
    with dispatch_options(column_clusters=False):
        assert not any(column_pairs.search(n) for n in controls_kernel_names(256))


def ragged_columns_probe():
    op = flashsampling_cuda.sample_with_scores
    gen = torch.Generator(device="cuda").manual_seed(8)
    out = []
    # 129-192 columns (three 64-wide tiles on the plain loop, padded to 192 columns; 176 only by
    # the rule for these tiles)
    for batch, vocab, dtype in ((144, 30011, torch.bfloat16), (192, 20000, torch.float16),
                                (129, 9001, torch.bfloat16), (176, 9001, torch.bfloat16)):
        hidden = torch.randn(batch, 256, device="cuda", generator=gen).to(dtype)
        weight = (torch.randn(vocab, 256, device="cuda", generator=gen) * 0.15).to(dtype)
        for kwargs in (dict(temperature=0.7), dict(temperature=0.0), dict(temperature=0.8, logit_softcap=20.0),
                       dict(temperature=0.0, logit_scale=0.5, frequency_penalty=0.5, presence_penalty=0.3,
                            penalty_state=flashsampling_cuda.PenaltyState(
                                torch.randint(0, vocab, (batch, 8), device="cuda", generator=gen)))):
            result = op(hidden, weight, seed=torch.tensor(13), offset=torch.tensor(2), **kwargs)
            out.extend(t for t in result if isinstance(t, torch.Tensor))
        # several samples of row quads (speculative verification's positions): 4 x 36 = 144 columns
        result = op(hidden[:36], weight, seed=torch.tensor(13), offset=torch.tensor(2), num_samples=4)
        out.extend(t for t in result if isinstance(t, torch.Tensor))
    return [t.cpu() for t in out]


def test_narrow_ragged_column_tiles_change_no_token():
    """Plain passes of 129-192 columns run three 64-wide column tiles of the epilogue-warpgroup
    kernel (DispatchOptions::narrow_ragged_columns = false: two 128-wide ones): the same tokens
    and scores, bit for bit (plain, greedy, soft-capped, scaled with penalties, several samples;
    bf16 and fp16); and the default really runs the plain loop's 64-wide tiles at 144 columns.
    (The CPU op checks them too: 176 in BATCHES, 144 in COMMON_CONTROL_BATCHES.)"""
    narrow = ragged_columns_probe()
    with dispatch_options(narrow_ragged_columns=False):
        wide = ragged_columns_probe()
    assert_bitwise_equal(narrow, wide)
    assert runs_controls_on_epilogue_warpgroups(plain_kernel_names(144), 64, loop=0)
    with dispatch_options(narrow_ragged_columns=False):
        assert runs_controls_on_epilogue_warpgroups(plain_kernel_names(144), 128, loop=0)


def test_plain_loop_extras_of_33_to_64_columns_as_the_controls_loop():
    """Calls of 33-64 columns with the scale / soft-cap / penalties alone, or several samples alone
    on row quads, run the plain loop's 64-wide epilogue-warpgroup tile: the same tokens and scores,
    bit for bit, as the common controls' loop (a bias of zeros) gives them (bf16 and fp16, greedy
    rows, penalties that raise logits)."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    for batch, vocab, dtype in ((50, 30011, torch.bfloat16), (64, 20000, torch.float16), (33, 9001, torch.bfloat16)):
        hidden = torch.randn(batch, 256, device="cuda", generator=gen).to(dtype)
        weight = (torch.randn(vocab, 256, device="cuda", generator=gen) * 0.15).to(dtype)
        state = flashsampling_cuda.PenaltyState(torch.randint(0, vocab, (batch, 8), device="cuda", generator=gen))
        noise = dict(seed=torch.tensor(13, device="cuda"), offset=torch.tensor(2, device="cuda"))
        for kwargs in (dict(temperature=0.8, logit_softcap=20.0), dict(temperature=0.7, logit_scale=0.5),
                       dict(temperature=0.0, logit_scale=0.5, frequency_penalty=0.5, presence_penalty=0.3,
                            penalty_state=state),
                       dict(temperature=0.9, repetition_penalty=torch.full((batch,), 1.2, device="cuda"),
                            frequency_penalty=-0.4, penalty_state=state)):
            assert_same_as_the_controls_loop(hidden, weight, {**noise, **kwargs})
        # several samples of row quads: 4 x 12 = 48 columns, on the plain loop's 64-wide tile
        assert_same_as_the_controls_loop(hidden[:12], weight, {**noise, "num_samples": 4})
        names = sample_kernel_names(hidden[:12], weight, **noise, num_samples=4)
        assert runs_controls_on_epilogue_warpgroups(names, 64, loop=0), names


def test_default_generator_reproducible_and_advancing():
    hidden, weight = lm_head(64, 32000, 256, torch.bfloat16, seed=4)
    torch.manual_seed(0)
    a1 = flashsampling_cuda.sample(hidden, weight)
    a2 = flashsampling_cuda.sample(hidden, weight)
    torch.manual_seed(0)
    b1 = flashsampling_cuda.sample(hidden, weight)
    assert torch.equal(a1, b1)
    assert not torch.equal(a1, a2)


def test_seed_tensor_on_device_and_graph_replay_draws_fresh_samples():
    hidden, weight = lm_head(256, 2048, 128, torch.bfloat16, seed=6)
    # A device offset tensor is read at run time: advancing it changes the draw.
    seed = torch.tensor(5, device="cuda")
    offset = torch.tensor(0, device="cuda")
    t0 = flashsampling_cuda.sample(hidden, weight, seed=seed, offset=offset)
    offset += 1
    t1 = flashsampling_cuda.sample(hidden, weight, seed=seed, offset=offset)
    assert not torch.equal(t0, t1)
    assert torch.equal(t1, flashsampling_cuda.sample(hidden, weight, seed=5, offset=1))

    # Default generator under graph capture: each replay draws new noise.
    flashsampling_cuda.sample(hidden, weight)  # warm up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashsampling_cuda.sample(hidden, weight)
    graph.replay()
    r1 = captured.clone()
    graph.replay()
    r2 = captured.clone()
    assert not torch.equal(r1, r2)
    assert r1.min() >= 0 and r1.max() < 2048


def test_num_samples_columns_are_independent_draws():
    hidden, weight = lm_head(8, 4096, 128, torch.float16, seed=8)
    tokens = flashsampling_cuda.sample(hidden, weight, seed=1, num_samples=4)
    ref = reference_sample(hidden, weight, 1.0, seed=1, num_samples=4, rtol=GPU_RTOL)
    assert tokens.shape == (8, 4)
    assert pathwise_mismatches(tokens, ref)[1] == 0


def test_empty_batch_and_strided_hidden():
    hidden, weight = lm_head(16, 1000, 128, torch.bfloat16, seed=9)
    assert flashsampling_cuda.sample(hidden[:0], weight).shape == (0, 1)
    wide = torch.zeros(16, 256, device="cuda", dtype=torch.bfloat16)
    wide[:, :128] = hidden
    view = wide[:, :128]  # row stride 256: legal for TMA
    assert torch.equal(
        flashsampling_cuda.sample(view, weight, seed=3), flashsampling_cuda.sample(hidden, weight, seed=3)
    )


def test_single_row_with_any_row_stride():
    hidden, weight = lm_head(1, 1000, 64, torch.bfloat16, seed=12)
    wide = torch.zeros(3, 67, device="cuda", dtype=torch.bfloat16)
    view = wide.as_strided((1, 64), (67, 1))  # one row with a row stride TMA could not take
    view.copy_(hidden)
    assert torch.equal(flashsampling_cuda.sample(view, weight, seed=2), flashsampling_cuda.sample(hidden, weight, seed=2))


def test_num_samples_beyond_grid_limit_is_an_error():
    hidden, weight = lm_head(1, 16, 64, torch.bfloat16, seed=13)
    with pytest.raises(RuntimeError, match="num_samples"):
        flashsampling_cuda.sample(hidden, weight, seed=1, num_samples=65536)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda h, w: (h[:, :60].contiguous(), w[:, :60].contiguous()), "multiple of 8"),
        (lambda h, w: (h.float(), w.float()), "bfloat16 or float16"),
        (lambda h, w: (h, w.t().contiguous().t()), "unit stride"),
        (lambda h, w: (h, w.cpu()), "weight"),
    ],
)
def test_inputs_the_kernel_cannot_take_raise_clear_errors(make, match):
    hidden, weight = lm_head(4, 1000, 64, torch.bfloat16, seed=10)
    h, w = make(hidden, weight)
    with pytest.raises((RuntimeError, NotImplementedError), match=match):
        flashsampling_cuda.sample(h, w, seed=1)


def test_opcheck_and_compile_on_cuda():
    hidden, weight = lm_head(4, 1000, 64, torch.bfloat16, seed=11)
    seed = torch.tensor(3, dtype=torch.int64)
    torch.library.opcheck(torch.ops.flashsampling.sample.default, (hidden, weight), {"seed": seed})

    @torch.compile(fullgraph=True)
    def step(h, w):
        return flashsampling_cuda.sample(h * 1.0, w, temperature=0.9, seed=3)

    assert torch.equal(step(hidden, weight), flashsampling_cuda.sample(hidden, weight, temperature=0.9, seed=3))


# ---------------------------------------------------------------- controls on every tile config

# One batch per N bucket of plain sampling (16, 32 pingpong; 64, 128, 256 epilogue warpgroups;
# > 256 N-tiled) with every control at once and 6 samples: 6 * B GEMM columns in one pass,
# run on the controls' capped N tiles (16 or 32 wide, several per vocabulary tile).
CONTROL_BATCHES = [1, 29, 50, 100, 200, 300]


CONTROLS_VOCAB, CONTROLS_DIM, CONTROLS_VOCAB_START = 9000, 256, 4096


def controls_problem(batch, hidden_seed):
    """The control sweeps' problem: bf16 hidden/weight, every control (random_controls) and
    per-row temperatures with every 7th row greedy (CPU tensor)."""
    from test_controls import random_controls

    hidden, weight = lm_head(batch, CONTROLS_VOCAB, CONTROLS_DIM, torch.bfloat16, seed=hidden_seed)
    c = random_controls(batch, CONTROLS_VOCAB, "cuda", vocab_start=CONTROLS_VOCAB_START, seed=batch, density=0.5)
    gen = torch.Generator().manual_seed(batch)
    temps = torch.rand(batch, generator=gen) * 1.5 + 0.3
    temps[::7] = 0.0  # greedy rows
    return hidden, weight, c, temps


def assert_sample_matches_reference_and_cpu(hidden, weight, kwargs):
    """GPU tokens and logprobs against the float64 reference (pathwise, same noise), and the
    CPU op token for token outside near ties; returns the GPU result."""
    from test_controls import assert_logprobs_close

    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
    ref = reference_sample(hidden, weight, **kwargs, rtol=GPU_RTOL)
    mismatches, unexplained = pathwise_mismatches(out.tokens, ref)
    assert unexplained == 0, f"{unexplained} mismatches outside near ties"
    assert mismatches <= max(1, out.tokens.numel() // 1000)
    assert_logprobs_close(out.token_logprobs, out.logsumexp, ref, out.tokens.cpu() == ref.tokens.cpu())
    cpu_kwargs = {k: (tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() if torch.is_tensor(v) else v)
                  for k, v in kwargs.items()}
    cpu_tokens = flashsampling_cuda.sample(hidden.cpu(), weight.cpu(), **cpu_kwargs)
    differ = cpu_tokens != out.tokens.cpu()
    near_tie = (ref.gap.cpu() <= ref.tolerance.cpu()[:, None])
    assert not (differ & ~near_tie).any()
    return out


@pytest.mark.parametrize("batch", CONTROL_BATCHES)
@pytest.mark.parametrize("seeding", ["batch", "per_row"])
def test_every_control_on_every_tile_config(batch, seeding):
    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch)
    if seeding == "batch":
        seed, offset = torch.tensor(99, device="cuda"), torch.arange(batch, device="cuda") * 8
    else:
        seed, offset = torch.arange(batch, device="cuda") * 31 + 5, torch.tensor(3, device="cuda")
    kwargs = dict(temperature=temps.cuda(), seed=seed, offset=offset, num_samples=6,
                  vocab_start=CONTROLS_VOCAB_START, logit_bias=c["logit_bias"],
                  sparse_logit_bias=c["sparse_logit_bias"], allowed_mask=c["allowed_mask"])
    out = assert_sample_matches_reference_and_cpu(hidden, weight, kwargs)
    # Greedy rows repeat one token.
    assert (out.tokens[::7] == out.tokens[::7, :1]).all()


# The common controls' loop (per-row T with greedy rows, dense bias, mask, logprobs; one
# sample, batch-wide seed): up to 16 columns on the CUTLASS pingpong tile, then on the
# epilogue-warpgroup kernel's 32-, 64- and 128-wide tiles (300: three of them, the last partial).
# 144: the tests' calls that the plain loop takes (scale / soft-cap or penalties alone) run its
# three 64-wide tiles there.
COMMON_CONTROL_BATCHES = [1, 20, 50, 100, 144, 200, 300]


@pytest.mark.parametrize("batch", COMMON_CONTROL_BATCHES)
@pytest.mark.parametrize("temperature", ["per_row", "scalar", "greedy"])
def test_common_controls_on_every_tile_config(batch, temperature):
    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    temps = {"per_row": temps.cuda(), "scalar": 0.8, "greedy": 0.0}[temperature]
    kwargs = dict(temperature=temps, seed=torch.tensor(99, device="cuda"), offset=torch.tensor(5, device="cuda"),
                  vocab_start=CONTROLS_VOCAB_START, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    out = assert_sample_matches_reference_and_cpu(hidden, weight, kwargs)
    allowed = c["allowed_bool"].gather(1, out.tokens - CONTROLS_VOCAB_START)
    assert allowed.all(), "a masked-out token was sampled"


# The common controls' loop with some inputs absent, special values and a row whose mask allows
# nothing, bf16 and fp16, on tiles of 32, 64 and 128 columns (also run without padding, below).
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [20, 40, 100])
@pytest.mark.parametrize("variant", ["no_logprobs", "bias_only", "empty_mask_row", "special_values"])
def test_common_controls_variants(dtype, batch, variant):
    import math

    from test_controls import assert_logprobs_close

    hidden, weight = lm_head(batch, CONTROLS_VOCAB, CONTROLS_DIM, dtype, seed=batch + 7)
    _, _, c, temps = controls_problem(batch, hidden_seed=batch + 7)
    kwargs = dict(temperature=temps.cuda(), seed=torch.tensor(99, device="cuda"), offset=torch.tensor(5, device="cuda"),
                  vocab_start=CONTROLS_VOCAB_START)
    if variant == "no_logprobs":  # the serving call: tokens only
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
        tokens = flashsampling_cuda.sample(hidden, weight, **kwargs)
        total, unexplained = pathwise_mismatches(tokens, reference_sample(hidden, weight, **kwargs, rtol=GPU_RTOL))
        assert unexplained == 0 and total <= 1
    elif variant == "bias_only":  # no mask, a scalar temperature
        kwargs.update(temperature=0.8, logit_bias=c["logit_bias"])
        assert_sample_matches_reference_and_cpu(hidden, weight, kwargs)
    elif variant == "empty_mask_row":
        mask = c["allowed_mask"].clone()
        mask[3] = 0
        kwargs.update(allowed_mask=mask, empty_mask_token=-7)
        out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
        ref = reference_sample(hidden, weight, **kwargs, rtol=GPU_RTOL)
        total, unexplained = pathwise_mismatches(out.tokens, ref)
        assert unexplained == 0 and total <= 1
        assert int(out.tokens[3, 0]) == -7 and out.logsumexp[3] == -math.inf and out.token_logprobs[3].isnan().all()
        others = torch.arange(batch) != 3  # row 3's log-probabilities are NaN on both sides
        same = (out.tokens.cpu() == ref.tokens.cpu()) & others[:, None]
        assert_logprobs_close(out.token_logprobs, out.logsumexp, ref, same)
    else:  # +inf logit (by the bias) wins every row; a NaN row has no candidate and a NaN logsumexp
        bias = torch.zeros(CONTROLS_VOCAB, device="cuda")
        bias[17] = math.inf
        out = flashsampling_cuda.sample(hidden, weight, **kwargs, logit_bias=bias, return_logprobs=True)
        assert (out.tokens == CONTROLS_VOCAB_START + 17).all() and (out.logsumexp == math.inf).all()
        hidden = hidden.clone()
        hidden[1] = math.nan
        out = flashsampling_cuda.sample(hidden, weight, **kwargs, return_logprobs=True)
        assert int(out.tokens[1, 0]) == -1 and out.logsumexp[1].isnan()
        assert out.logsumexp[torch.arange(batch, device="cuda") != 1].isfinite().all()


def sample_kernel_names(hidden, weight, **kwargs):
    """Names of the CUDA kernels one sample() call runs (after a first call outside the profile)."""
    flashsampling_cuda.sample(hidden, weight, **kwargs)
    return run_listing_cuda_kernels(lambda: flashsampling_cuda.sample(hidden, weight, **kwargs))[1]


def epilogue_warpgroups_tile(columns):
    """The N tile of the epilogue-warpgroup kernel (plain or controls' loop) at these columns, up
    to 128 (kernel_choice.h)."""
    return 32 if columns <= 32 else 64 if columns <= 64 else 128


def controls_kernel_names(batch, per_row_temperatures=True):
    """Names of the CUDA kernels one common-controls sample() call (bf16, per-row temperatures)
    runs; with per_row_temperatures=False, one plain call's."""
    hidden = torch.randn(batch, 256, device="cuda").to(torch.bfloat16)
    weight = torch.randn(9000, 256, device="cuda").to(torch.bfloat16)
    # per-row T: the common controls
    return sample_kernel_names(
        hidden, weight, temperature=torch.full((batch,), 0.7, device="cuda") if per_row_temperatures else 0.7)


def plain_kernel_names(batch):
    return controls_kernel_names(batch, per_row_temperatures=False)


def runs_controls_on_epilogue_warpgroups(names, tile_n, loop=1):
    """Whether one of the kernels is the epilogue-warpgroup kernel with the common controls' loop
    (`loop` 0: the plain loop) and this N tile (its name carries the loop as
    (flashsampling::SamplerLoop)1 and the wgmma atom 64xNx16)."""
    return any("Sm90SamplerEpilogueWarpGroups" in n and f"SamplerLoop){loop}" in n and f"64x{tile_n}x16" in n
               for n in names)


def test_common_controls_schedules_by_tile():
    """Common-controls passes on 32-, 64- and 128-wide tiles (more than 16 columns) run the
    epilogue-warpgroup kernel with the common controls' loop, up to 16 columns the CUTLASS
    pingpong schedule (kernel_choice.h; tests/test_kernel_choice.py has the whole table)."""
    assert runs_controls_on_epilogue_warpgroups(controls_kernel_names(20), 32)
    assert runs_controls_on_epilogue_warpgroups(controls_kernel_names(50), 64)
    assert runs_controls_on_epilogue_warpgroups(controls_kernel_names(100), 128)
    assert not any("EpilogueWarpGroups" in n for n in controls_kernel_names(10))


def test_per_row_temperatures_need_no_kernel_before_the_gemm_on_the_visitor():
    """The CUTLASS schedules' common-controls loop (up to 16 columns) divides each column's
    temperature itself: no kernel before the GEMM, one graph node fewer. The epilogue-warpgroup
    kernels load 1/T prepared by the kernel that zeroes their noise floors anyway. (The tokens:
    the per-row temperature tests.)"""

    def prepares(names):
        return any("prepare_gemm_inputs" in n for n in names)

    assert not prepares(controls_kernel_names(10))
    assert prepares(controls_kernel_names(20))
    assert prepares(controls_kernel_names(50))


def test_common_controls_sweep_without_padding():
    """The common-controls sweep (pathwise against the float64 reference, logprobs, the CPU op,
    masks, greedy rows, tiles of 32, 64 and 128 columns, several N tiles, fp16, special values,
    an empty mask row) also passes with the hidden rows not padded to whole tiles."""
    with dispatch_options(pad_columns=False):
        for batch in COMMON_CONTROL_BATCHES:
            for temperature in ("per_row", "scalar", "greedy"):
                test_common_controls_on_every_tile_config(batch, temperature)
        for dtype in (torch.bfloat16, torch.float16):
            for batch in (20, 40, 100):
                for variant in ("no_logprobs", "bias_only", "empty_mask_row", "special_values"):
                    test_common_controls_variants(dtype, batch, variant)


@pytest.mark.parametrize("batch", [20, 50, 100, 200, 300])
@pytest.mark.parametrize("keys", ["seeds", "seeds_offsets", "offsets"])
def test_per_row_keys_on_the_common_controls_loop(batch, keys):
    """Per-row seeds and / or offsets with one sample and no sparse bias run the epilogue-warpgroup
    kernels' common-controls loop from 17 columns on sm90: pathwise against the float64
    reference (same noise), logprobs, the CPU op; 32-, 64- and 128-wide tiles, column pairs, three N
    tiles, greedy rows, mask and bias."""
    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    seed = torch.arange(batch, device="cuda") * 31 + 5 if "seeds" in keys else torch.tensor(77, device="cuda")
    offset = torch.arange(batch, device="cuda") * 3 + 1 if "offsets" in keys else torch.tensor(3, device="cuda")
    kwargs = dict(temperature=temps.cuda(), seed=seed, offset=offset, vocab_start=CONTROLS_VOCAB_START,
                  logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    assert_sample_matches_reference_and_cpu(hidden, weight, kwargs)


# (batch, num_samples, seeding, controls): several samples (GEMM column s * B + b) and sparse bias on
# the epilogue-warpgroup kernels' controls loop from 17 columns (several samples alone on row
# quads beyond 32 columns: the plain loop's). Batch-wide seeds with
# B % 4 == 0 take the Philox block of a whole row quad, other batches a key per column; 64- and
# 128-wide tiles, column pairs, several N tiles.
SEVERAL_SAMPLES_AND_SPARSE_CASES = [
    (12, 4, "batch", "none"),       # 48 columns: the plain loop's 64-wide tile, row quads
    (36, 3, "batch", "common"),     # 108: one 128-wide tile, row quads, temperatures + mask + bias
    (50, 2, "batch", "sparse"),     # 100: columns keyed one by one (50 % 4 = 2), sparse bias only
    (64, 4, "batch", "all"),        # 256: two 128-wide tiles (a column pair), everything
    (40, 1, "batch", "sparse"),     # 40: one sample, sparse bias, 64-wide tile
    (130, 1, "batch", "all"),       # 130: two N tiles, the second almost empty
    (45, 5, "per_row", "all"),      # 225: per-row seeds and offsets with several samples
    (33, 7, "offsets", "sparse"),   # 231: per-row offsets, sparse
    (32, 3, "batch", "none"),       # 96: several samples alone on row quads: the plain loop's kernel
    (64, 4, "batch", "none"),       # 256: the same on a column pair
    (30, 4, "batch", "none"),       # 120: several samples alone, 30 % 4 = 2: the controls' loop
]


@pytest.mark.parametrize("batch,num_samples,seeding,controls", SEVERAL_SAMPLES_AND_SPARSE_CASES)
def test_several_samples_and_sparse_bias_on_the_epilogue_warpgroup_loops(batch, num_samples, seeding, controls):
    """Pathwise against the float64 reference (the contract's noise of every sample), logprobs
    within 1e-4, the CPU op token for token outside near ties."""
    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch + num_samples)
    seed = torch.arange(batch, device="cuda") * 17 + 3 if seeding == "per_row" else torch.tensor(123, device="cuda")
    offset = torch.arange(batch, device="cuda") * 5 + 2 if seeding in ("per_row", "offsets") else 7
    kwargs = dict(seed=seed, offset=offset, num_samples=num_samples, vocab_start=CONTROLS_VOCAB_START,
                  temperature=0.9)
    if controls in ("common", "all"):
        kwargs.update(temperature=temps.cuda(), logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    if controls in ("sparse", "all"):
        kwargs.update(sparse_logit_bias=c["sparse_logit_bias"])
    out = assert_sample_matches_reference_and_cpu(hidden, weight, kwargs)
    assert out.tokens.shape == (batch, num_samples)
    if controls != "none" and num_samples > 1:
        assert (out.tokens != out.tokens[:, :1]).any(), "the samples of a row are not independent draws"


@pytest.mark.parametrize("batch,num_samples,sparse", [(10, 1, False), (20, 1, False), (50, 1, False), (20, 1, True),
                                                       (50, 1, True), (32, 2, False), (100, 3, True)])
def test_per_row_temperatures_win_over_a_zero_scalar(batch, num_samples, sparse):
    """The raw op with temperature=0.0 and a per-row temperatures tensor samples with the tensor
    (as the CPU op does), on every route: narrow and wide tiles, common controls, several samples,
    sparse bias. The scalar made the whole batch greedy on the GPU before."""
    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch + 5)
    op = torch.ops.flashsampling.sample_with_scores
    kwargs = dict(temperatures=temps.cuda(), num_samples=num_samples, seed=torch.tensor(31, device="cuda"),
                  offset=torch.tensor(2, device="cuda"), vocab_start=CONTROLS_VOCAB_START)
    if sparse:
        kwargs.update(sparse_bias_ids=c["sparse_logit_bias"][0], sparse_bias_values=c["sparse_logit_bias"][1])
    zero = op(hidden, weight, temperature=0.0, **kwargs)
    one = op(hidden, weight, temperature=1.0, **kwargs)
    assert torch.equal(zero[0], one[0])
    assert torch.equal(zero[1].view(torch.int32), one[1].view(torch.int32))
    cpu = op(hidden.cpu(), weight.cpu(), temperature=0.0,
             **{k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()})
    ref = reference_sample(hidden, weight, temps, seed=31, offset=2, num_samples=num_samples,
                           vocab_start=CONTROLS_VOCAB_START, rtol=GPU_RTOL,
                           **({"sparse_logit_bias": c["sparse_logit_bias"]} if sparse else {}))
    near_tie = ref.gap.cpu() <= ref.tolerance.cpu()[:, None]
    assert not ((cpu[0] != zero[0].cpu()) & ~near_tie).any()
    assert pathwise_mismatches(zero[0], ref)[1] == 0


def all_controls_calls():
    """Calls that need the loop for all controls up to 16 columns (per-row seeds / offsets,
    several samples, sparse bias) at 20-256 rows: (hidden, weight, kwargs) of sample_with_scores.
    Beyond 16 columns they run the epilogue-warpgroup kernels' controls loop, but several samples
    alone of B % 4 == 0 rows beyond 32 columns (B = 20, 40 and 256 with num_samples=3) its plain loop."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    for batch, vocab, dtype in ((20, 9001, torch.float16), (40, 30011, torch.bfloat16),
                                (130, 64000, torch.float16), (256, 50001, torch.bfloat16)):
        hidden = torch.randn(batch, 256, device="cuda", generator=gen).to(dtype)
        weight = (torch.randn(vocab, 256, device="cuda", generator=gen) * 0.15).to(dtype)
        seeds = torch.randint(0, 2**62, (batch,), device="cuda", generator=gen)
        offsets = torch.randint(0, 2**40, (batch,), device="cuda", generator=gen)
        temps = torch.rand(batch, device="cuda", generator=gen) + 0.2
        temps[::6] = 0.0
        mask = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), device="cuda", generator=gen,
                             dtype=torch.int64).to(torch.int32) | 0x10
        ids = torch.randint(0, vocab, (batch, 5), device="cuda", generator=gen)
        ids[:, 1] = ids[:, 0]
        ids[:, 2] = -1
        values = torch.randn(batch, 5, device="cuda", generator=gen) * 2 + 3
        sparse = dict(sparse_bias_ids=ids, sparse_bias_values=values)
        common = dict(temperatures=temps, allowed_mask=mask, return_logprobs=True)
        for kwargs in (dict(seed=seeds, offset=torch.tensor(5)), dict(seed=torch.tensor(9), offset=offsets),
                       dict(seed=seeds, offset=offsets, **common),
                       dict(seed=torch.tensor(4), offset=torch.tensor(6), num_samples=3),
                       dict(seed=torch.tensor(4), offset=torch.tensor(6), num_samples=2, **common),
                       dict(seed=seeds, offset=offsets, num_samples=2, **sparse),
                       dict(seed=torch.tensor(4), offset=torch.tensor(6), **sparse, **common)):
            yield hidden, weight, kwargs


def rows_of(kwargs: dict, rows: slice) -> dict:
    """The arguments of a call on these rows alone (per-row tensors sliced)."""
    per_row = ("temperatures", "allowed_mask", "sparse_bias_ids", "sparse_bias_values")
    return {k: (v[rows] if k in per_row or (k in ("seed", "offset") and v.dim() == 1) else v)
            for k, v in kwargs.items()}


def test_all_controls_beyond_16_columns_match_the_all_controls_loop():
    """Calls needing every control run, beyond 16 GEMM columns, on the epilogue-warpgroup kernels'
    controls loop (several samples alone beyond 32 columns on its plain loop); up to 16 on the loop
    for all controls. With per-row seeds the noise does not
    depend on a row's place in the batch, so the same rows sampled 16 columns at a time (the other
    loop) give the same tokens and scores bit for bit and log-probabilities within rounding of the
    two loops' sums (bf16, fp16, up to two 128-wide column tiles, greedy rows, mask, sparse bias,
    several samples)."""
    op = torch.ops.flashsampling.sample_with_scores
    compared = 0
    for hidden, weight, kwargs in all_controls_calls():
        result, kernels = run_listing_cuda_kernels(lambda: op(hidden, weight, **kwargs))
        assert any("EpilogueWarpGroups" in name for name in kernels)
        if kwargs["seed"].dim() == 0:
            continue  # batch-wide seed: each row's noise stream is its place in the batch
        step = 16 // kwargs.get("num_samples", 1)
        parts = [op(hidden[i:i + step], weight, **rows_of(kwargs, slice(i, i + step)))
                 for i in range(0, hidden.shape[0], step)]
        tokens, scores = (torch.cat([part[j] for part in parts]) for j in (0, 1))
        assert torch.equal(result[0], tokens)
        assert torch.equal(result[1].view(torch.int32), scores.view(torch.int32))  # the same fma of the same noise
        if kwargs.get("return_logprobs"):
            for j in (2, 3):
                want = torch.cat([part[j] for part in parts])
                assert torch.allclose(result[j], want, rtol=1e-5, atol=1e-5, equal_nan=True)
        compared += 1
    assert compared == 12


def test_graph_replay_with_per_row_device_seeds_and_all_controls():
    """A captured graph with per-row seeds/offsets in device tensors and every control
    replays with whatever the tensors hold: advancing the offsets gives fresh tokens
    equal to an eager call with the same values."""
    from test_controls import random_controls

    batch, vocab, dim = 24, 5000, 128
    hidden, weight = lm_head(batch, vocab, dim, torch.bfloat16, seed=3)
    c = random_controls(batch, vocab, "cuda", seed=3, density=0.5)
    seeds = torch.arange(batch, device="cuda") + 1000
    offsets = torch.zeros(batch, dtype=torch.int64, device="cuda")
    temps = torch.full((batch,), 0.9, device="cuda")
    kwargs = dict(temperature=temps, seed=seeds, offset=offsets, num_samples=2, logit_bias=c["logit_bias"],
                  allowed_mask=c["allowed_mask"], empty_mask_token=-1)
    flashsampling_cuda.sample(hidden, weight, **kwargs)  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flashsampling_cuda.sample(hidden, weight, **kwargs)
    draws = []
    for step in range(3):
        offsets.fill_(step * 2)
        graph.replay()
        eager = flashsampling_cuda.sample(hidden, weight, **kwargs)
        assert torch.equal(captured, eager), f"step {step}"
        draws.append(captured.clone())
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_mask_check_under_capture_points_at_empty_mask_token():
    batch, vocab = 4, 1000
    hidden, weight = lm_head(batch, vocab, 64, torch.bfloat16, seed=1)
    mask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device="cuda")
    seed = torch.tensor(1, device="cuda")
    flashsampling_cuda.sample(hidden, weight, seed=seed, allowed_mask=mask)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="empty_mask_token"):
        with torch.cuda.graph(graph):
            flashsampling_cuda.sample(hidden, weight, seed=seed, allowed_mask=mask)


# The model-side transforms (logit_scale, logit_softcap) in the fused epilogue: they run in the
# controls' loops (the common controls' when nothing else is on), and alone beyond 32 columns on
# sm90 in the plain epilogue-warpgroup loop.
# GPU == CPU bit for bit needs the same raw logits on both, so these problems have exact ones:
# hidden in k / 8 (|k| <= 8) and weight in small integers, whose products and every partial sum
# are exact in fp32 in any order; the soft-cap (fs_tanhf), biases and noise are the same bits on
# both sides, so the tokens and scores are too.
MODEL_TRANSFORMS = [dict(logit_softcap=30.0), dict(logit_scale=0.5), dict(logit_scale=0.25, logit_softcap=8.0)]


def exact_lm_head(batch, vocab=CONTROLS_VOCAB, dim=CONTROLS_DIM, seed=0, dtype=torch.bfloat16):
    """bf16 hidden [B, D] and weight [V, D] whose fp32 logits are exact (std ~24), on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randint(-8, 9, (batch, dim), generator=gen) / 8).to(dtype)
    weight = torch.randint(-4, 5, (vocab, dim), generator=gen).to(dtype)
    return hidden.cuda(), weight.cuda()


def assert_cuda_equals_cpu_bit_for_bit(hidden, weight, kwargs):
    """Tokens and scores bit for bit against the CPU op; log-probabilities within 1e-4 (the GPU's
    log-sum-exp sums with exp2 on the MUFU unit). Returns the GPU result."""
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
    cpu_kwargs = {k: (tuple(t.cpu() for t in v) if isinstance(v, tuple) else v.cpu() if torch.is_tensor(v) else v)
                  for k, v in kwargs.items()}
    cpu = flashsampling_cuda.sample_with_scores(hidden.cpu(), weight.cpu(), **cpu_kwargs, return_logprobs=True)
    assert torch.equal(out.tokens.cpu(), cpu.tokens)
    assert torch.equal(out.scores.cpu().view(torch.int32), cpu.scores.view(torch.int32))
    torch.testing.assert_close(out.token_logprobs.cpu(), cpu.token_logprobs, rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(out.logsumexp.cpu(), cpu.logsumexp, rtol=1e-4, atol=1e-4, equal_nan=True)
    return out


def test_exact_lm_head_logits_are_exact():
    hidden, weight = exact_lm_head(64, seed=1)
    logits = hidden.float() @ weight.float().T
    assert torch.equal(logits.cpu(), torch.ops.flashsampling._logits(hidden.cpu(), weight.cpu()))
    assert logits.abs().max() > 60 and logits.std() > 10  # well beyond the caps tested


@pytest.mark.parametrize("batch", COMMON_CONTROL_BATCHES)
@pytest.mark.parametrize("transforms", MODEL_TRANSFORMS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("controls", ["alone", "per_row_greedy", "greedy", "bias_mask"])
def test_model_transforms_cuda_equal_cpu_on_every_tile_config(batch, transforms, controls):
    """The scale and soft-cap in the common controls' loop on every tile config (the CUTLASS
    pingpong tile up to 16 columns, the epilogue-warpgroup kernel's 32-, 64- and 128-wide tiles,
    column pairs, three N tiles): tokens and scores == the CPU op bit for bit, alone (a call that
    without them would be plain), with per-row T and greedy rows, all greedy, and with bias + mask."""
    hidden, weight = exact_lm_head(batch, seed=batch)
    _, _, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    kwargs = dict(seed=torch.tensor(99, device="cuda"), offset=torch.tensor(5, device="cuda"),
                  vocab_start=CONTROLS_VOCAB_START, **transforms)
    if controls == "per_row_greedy":
        kwargs.update(temperature=temps.cuda())
    elif controls == "greedy":
        kwargs.update(temperature=0.0)
    elif controls == "bias_mask":
        kwargs.update(temperature=0.8, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    assert_cuda_equals_cpu_bit_for_bit(hidden, weight, kwargs)
    tokens = flashsampling_cuda.sample(hidden, weight, **kwargs)  # without logprobs: the serving call
    cpu_kwargs = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
    assert torch.equal(tokens.cpu(), flashsampling_cuda.sample(hidden.cpu(), weight.cpu(), **cpu_kwargs))


@pytest.mark.parametrize("batch,num_samples,seeding", [(12, 3, "batch"), (12, 1, "per_row"), (40, 4, "batch"),
                                                       (100, 2, "per_row"), (200, 1, "per_row")])
def test_model_transforms_on_the_loops_for_all_controls(batch, num_samples, seeding):
    """With several samples, sparse bias and per-row seeds: the visitor's loop for all controls
    (up to 16 columns) and the epilogue-warpgroup kernels' general-columns loop, == the CPU op bit
    for bit."""
    hidden, weight = exact_lm_head(batch, seed=batch + 3)
    _, _, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    seed = torch.arange(batch, device="cuda") * 17 + 3 if seeding == "per_row" else torch.tensor(123, device="cuda")
    kwargs = dict(seed=seed, offset=torch.tensor(7, device="cuda"), num_samples=num_samples, temperature=temps.cuda(),
                  vocab_start=CONTROLS_VOCAB_START, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"],
                  sparse_logit_bias=c["sparse_logit_bias"], logit_scale=0.5, logit_softcap=12.0)
    assert_cuda_equals_cpu_bit_for_bit(hidden, weight, kwargs)


def assert_same_without_noise_skip(hidden, weight, kwargs):
    """The same tokens and scores (bit for bit) with the noise skip and the log-sum-exp references
    off as with the dispatch's defaults."""
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs)
    with dispatch_options(noise_skip=False, lse_references=False):
        unskipped = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs)
    assert torch.equal(out.tokens, unskipped.tokens)
    assert torch.equal(out.scores.view(torch.int32), unskipped.scores.view(torch.int32))


def assert_same_as_the_controls_loop(hidden, weight, kwargs, out=None):
    """The call's tokens and scores (`out`, else drawn here) bit for bit as the common controls'
    loop's, which a dense bias of zeros selects."""
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs) if out is None else out
    controls = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs,
                                                     logit_bias=torch.zeros(weight.shape[0], device="cuda"))
    assert torch.equal(out.tokens, controls.tokens)
    assert torch.equal(out.scores.view(torch.int32), controls.scores.view(torch.int32))


@pytest.mark.parametrize("batch", [50, 200])
def test_model_transforms_same_tokens_without_the_noise_skip(batch):
    """The epilogue-warpgroup kernels' noise skip bounds the transformed logit's score: the same
    tokens and scores with the skip off, and without the log-sum-exp references."""
    hidden, weight = exact_lm_head(batch, seed=batch + 5)
    _, _, _, temps = controls_problem(batch, hidden_seed=batch)
    kwargs = dict(temperature=temps.cuda(), seed=torch.tensor(9, device="cuda"), logit_softcap=30.0)
    assert_same_without_noise_skip(hidden, weight, kwargs)


@pytest.mark.parametrize("batch", [1, 20, 100, 300])
def test_model_transforms_pathwise_against_float64_reference(batch):
    """An LM-head problem (logits in fp32 from bf16): pathwise against the float64 reference
    (torch.tanh in float64), logprobs close, per-row T with greedy rows, bias and mask."""
    from flashsampling_cuda.reference import reference_logit_transform

    hidden, weight, c, temps = controls_problem(batch, hidden_seed=batch + 11)
    kwargs = dict(temperature=temps.cuda(), seed=torch.tensor(99, device="cuda"), offset=torch.tensor(5, device="cuda"),
                  vocab_start=CONTROLS_VOCAB_START, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    transform = reference_logit_transform(batch, CONTROLS_VOCAB, logit_scale=2.0, logit_softcap=4.0, device="cuda")
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs, logit_scale=2.0, logit_softcap=4.0,
                                                return_logprobs=True)
    ref = reference_sample(hidden, weight, **kwargs, logit_transform=transform, rtol=GPU_RTOL)
    mismatches, unexplained = pathwise_mismatches(out.tokens, ref)
    assert unexplained == 0 and mismatches <= max(1, out.tokens.numel() // 1000)
    same = out.tokens.cpu() == ref.tokens.cpu()
    assert torch.allclose(out.token_logprobs.cpu()[same], ref.logprobs.cpu().float()[same], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("batch,loop", [(20, 1), (50, 0), (100, 0), (256, 0)])
def test_soft_capped_call_runs_the_epilogue_warpgroup_kernels(batch, loop):
    """A soft-capped call with nothing else runs the common controls' kernel up to 32 columns (the
    epilogue-warpgroup one at 20), beyond it the plain epilogue-warpgroup kernel, whose loop
    applies the soft-cap; no cuBLAS GEMM (the logits route's)."""
    hidden, weight = exact_lm_head(batch, seed=2)
    names = sample_kernel_names(hidden, weight, logit_softcap=30.0)
    assert runs_controls_on_epilogue_warpgroups(names, epilogue_warpgroups_tile(batch), loop), names
    ours = ("flashsampling", "cutlass")  # our kernels (prepare_gemm_inputs among them) and CUTLASS's
    assert not any("gemm" in n.lower() and not any(o in n.lower() for o in ours) for n in names), names


@pytest.mark.parametrize("batch", [50, 65, 128, 200, 256])
@pytest.mark.parametrize("transforms", MODEL_TRANSFORMS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
@pytest.mark.parametrize("temperature", [0.8, 0.0, 2.5])
@pytest.mark.parametrize("regime", ["exact", "lm_head"])
def test_model_transforms_on_the_plain_epilogue_warpgroup_loop(batch, transforms, temperature, regime):
    """logit_scale / logit_softcap alone beyond 32 columns: the plain epilogue-warpgroup loop
    scales at once and soft-caps only in steps whose exact scores the skip needs, bounding the
    capped logits without the tanh. Exact logits: tokens and scores == the CPU op bit for bit;
    also an LM-head problem's peaked rows (bf16, logits up to the cap): the same tokens and scores
    with the skip off as on; and the same as the common controls' loop (with a bias of zeros)."""
    if regime == "exact":
        hidden, weight = exact_lm_head(batch, seed=batch + 7)
    else:
        weight = lm_head_weight(CONTROLS_VOCAB, CONTROLS_DIM, seed=3).cuda()
        hidden = hidden_states(weight, batch, "llm", seed=batch) * 4
    kwargs = dict(temperature=temperature, seed=torch.tensor(31, device="cuda"), offset=torch.tensor(2, device="cuda"),
                  **transforms)
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs)
    if regime == "exact":
        cpu_kwargs = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items()}
        cpu = flashsampling_cuda.sample_with_scores(hidden.cpu(), weight.cpu(), **cpu_kwargs)
        assert torch.equal(out.tokens.cpu(), cpu.tokens)
        assert torch.equal(out.scores.cpu().view(torch.int32), cpu.scores.view(torch.int32))
    assert_same_without_noise_skip(hidden, weight, kwargs)
    assert_same_as_the_controls_loop(hidden, weight, kwargs, out)


# The penalties (repetition, frequency, presence) in the fused epilogue: the rank bitmap built
# before the GEMM (reduce_candidates.cu) and looked up in the controls' loops after the biases.
# On exact logits (exact_lm_head) the CUDA op == the CPU op bit for bit.
def penalty_history(batch, seed, vocab=CONTROLS_VOCAB, vocab_start=CONTROLS_VOCAB_START, capacity=2048):
    """A PenaltyState on the GPU with 2048-slot rows: long prompts of ids around this vocabulary
    shard (some beyond it), short outputs with repeats, a padded row and an empty one."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_start + vocab + 500, (batch, 1500), generator=gen)
    output = vocab_start + torch.randint(0, 300, (batch, 400), generator=gen)  # repeats
    if batch > 1:
        prompt[1, 20:] = -1
        prompt[batch - 1] = -1
        output[batch - 1] = -1
    return flashsampling_cuda.PenaltyState(prompt.cuda(), output.cuda(), capacity=capacity)


PENALTIES = {
    "repetition": dict(repetition_penalty=1.3),
    "frequency_presence": dict(frequency_penalty=0.7, presence_penalty=0.4),
    "all": dict(repetition_penalty=0.8, frequency_penalty=-0.3, presence_penalty=1.5),
    "all_with_softcap": dict(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5,
                             logit_scale=0.5, logit_softcap=12.0),
}


@pytest.mark.parametrize("batch", COMMON_CONTROL_BATCHES)
@pytest.mark.parametrize("case", list(PENALTIES))
@pytest.mark.parametrize("controls", ["alone", "per_row_greedy", "bias_mask"])
def test_penalties_cuda_equal_cpu_on_every_tile_config(batch, case, controls):
    """The penalties in the common controls' loop on every tile config (the CUTLASS pingpong tile
    up to 16 columns, the epilogue-warpgroup kernels' 32-, 64- and 128-wide tiles, column pairs,
    three N tiles): tokens and scores == the CPU op bit for bit, alone, with per-row T and greedy
    rows, and with bias + mask; per-row [B] penalties in the per-row case."""
    hidden, weight = exact_lm_head(batch, seed=batch + 20)
    _, _, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    args = dict(PENALTIES[case])
    if controls == "per_row_greedy":
        args["repetition_penalty"] = torch.linspace(0.6, 1.8, batch, device="cuda")
    kwargs = dict(seed=torch.tensor(99, device="cuda"), offset=torch.tensor(5, device="cuda"),
                  vocab_start=CONTROLS_VOCAB_START, penalty_state=penalty_history(batch, seed=batch), **args)
    if controls == "per_row_greedy":
        kwargs.update(temperature=temps.cuda())
    elif controls == "bias_mask":
        kwargs.update(temperature=0.8, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"])
    cpu_state = kwargs["penalty_state"]
    out = flashsampling_cuda.sample_with_scores(hidden, weight, **kwargs)
    cpu_kwargs = {k: v.cpu() if torch.is_tensor(v) else v for k, v in kwargs.items() if k != "penalty_state"}
    cpu_kwargs["penalty_state"] = flashsampling_cuda.PenaltyState(batch=batch, capacity=cpu_state.capacity)
    for name in ("ids", "output_counts", "in_prompt", "size", "overflowed"):
        setattr(cpu_kwargs["penalty_state"], name, getattr(cpu_state, name).cpu())
    cpu = flashsampling_cuda.sample_with_scores(hidden.cpu(), weight.cpu(), **cpu_kwargs)
    assert torch.equal(out.tokens.cpu(), cpu.tokens)
    assert torch.equal(out.scores.cpu().view(torch.int32), cpu.scores.view(torch.int32))
    # The penalties did apply. Not against `out`: a row's winner is often a token it has not seen
    # (then its score is plain sampling's; at B = 1 and B = 20 with frequency / presence every
    # row's is, on the CPU op), so on a history of the plain winners, whose scores must move.
    plain = flashsampling_cuda.sample_with_scores(hidden, weight, **{k: v for k, v in kwargs.items()
                                                                     if k not in args and k != "penalty_state"})
    seen = flashsampling_cuda.PenaltyState(output_token_ids=plain.tokens, capacity=4)
    moved = flashsampling_cuda.sample_with_scores(hidden, weight, **{**kwargs, "penalty_state": seen})
    assert (moved.scores != plain.scores).any()


@pytest.mark.parametrize("batch,num_samples,seeding", [(12, 3, "batch"), (12, 1, "per_row"), (40, 4, "batch"),
                                                       (100, 2, "per_row"), (200, 1, "per_row")])
def test_penalties_on_the_loops_for_all_controls(batch, num_samples, seeding):
    """With several samples, sparse bias and per-row seeds: the visitor's loop for all controls
    (up to 16 columns) and the epilogue-warpgroup kernels' general-columns loop, == the CPU op bit
    for bit (logprobs within 1e-4)."""
    hidden, weight = exact_lm_head(batch, seed=batch + 23)
    _, _, c, temps = controls_problem(batch, hidden_seed=batch + 1)
    seed = torch.arange(batch, device="cuda") * 17 + 3 if seeding == "per_row" else torch.tensor(123, device="cuda")
    state = penalty_history(batch, seed=batch + 1)
    kwargs = dict(seed=seed, offset=torch.tensor(7, device="cuda"), num_samples=num_samples, temperature=temps.cuda(),
                  vocab_start=CONTROLS_VOCAB_START, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"],
                  sparse_logit_bias=c["sparse_logit_bias"], repetition_penalty=1.25, frequency_penalty=0.5,
                  presence_penalty=0.25, prompt_token_ids=state.ids)  # a prompt-only state built per call
    assert_cuda_equals_cpu_bit_for_bit(hidden, weight, kwargs)


@pytest.mark.parametrize("batch", [50, 200])
@pytest.mark.parametrize("temperature", ["rows", 0.8, 0.0])
@pytest.mark.parametrize("case", ["lowering", "raising", "raising_adds", "lowering_with_softcap"])
def test_penalties_same_tokens_without_the_noise_skip(batch, temperature, case):
    """The noise skip bounds the penalised logit's score (the controls' loop; beyond 32 columns a
    call with a batch-wide temperature takes the plain loop, which bounds it by the logit in rows
    whose penalties only lower logits and draws the exact scores of the others'): the same tokens
    and scores with the skip off and without the log-sum-exp references, and as the controls'
    loop (a bias of zeros) on an LM-head problem's peaked rows."""
    hidden, weight = exact_lm_head(batch, seed=batch + 25)
    if temperature == "rows":
        _, _, _, temperature = controls_problem(batch, hidden_seed=batch)
        temperature = temperature.cuda()
    args = {"lowering": dict(repetition_penalty=1.5, presence_penalty=1.0),
            "raising": dict(repetition_penalty=torch.linspace(0.5, 1.5, batch, device="cuda"), frequency_penalty=-0.4),
            # r = 1 and an add of +40 on every output token: the rows raise only through their adds,
            # and a seen token whose raw logit lies below the floor wins
            "raising_adds": dict(presence_penalty=-40.0),
            "lowering_with_softcap": dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_softcap=20.0)}[case]
    kwargs = dict(temperature=temperature, seed=torch.tensor(9, device="cuda"), vocab_start=CONTROLS_VOCAB_START,
                  penalty_state=penalty_history(batch, seed=3), **args)
    assert_same_without_noise_skip(hidden, weight, kwargs)
    if case == "raising_adds":  # output ids are vocab_start + [0, 300) (penalty_history; the last row has none)
        tokens = flashsampling_cuda.sample(hidden, weight, **kwargs)[:-1, 0]
        seen = (tokens >= CONTROLS_VOCAB_START) & (tokens < CONTROLS_VOCAB_START + 300)
        assert seen.float().mean() > 0.5, seen.float().mean()
    weight = lm_head_weight(CONTROLS_VOCAB, CONTROLS_DIM, seed=3).cuda()
    hidden = hidden_states(weight, batch, "llm", seed=batch) * 4
    assert_same_without_noise_skip(hidden, weight, kwargs)
    assert_same_as_the_controls_loop(hidden, weight, kwargs)


@pytest.mark.parametrize("batch", [1, 20, 100, 300])
def test_penalties_multi_step_decode_cuda_equals_cpu(batch):
    """A decode of 12 steps, each sampling with all three penalties and then
    PenaltyState.update(tokens) on both devices: the CUDA and CPU token streams are the same,
    and so are the states (the rank bitmap is rebuilt from the updated state each step)."""
    hidden, weight = exact_lm_head(batch, seed=batch + 27)
    gpu_state = penalty_history(batch, seed=batch + 2, capacity=2048)
    cpu_state = flashsampling_cuda.PenaltyState(batch=batch, capacity=2048)
    for name in ("ids", "output_counts", "in_prompt", "size", "overflowed"):
        setattr(cpu_state, name, getattr(gpu_state, name).cpu().clone())
    args = dict(temperature=0.9, vocab_start=CONTROLS_VOCAB_START, repetition_penalty=1.3, frequency_penalty=0.6,
                presence_penalty=0.8)
    for step in range(12):
        seed = torch.tensor(5)
        offset = torch.tensor(step)
        tokens = flashsampling_cuda.sample(hidden, weight, **args, seed=seed.cuda(), offset=offset.cuda(),
                                           penalty_state=gpu_state)
        cpu_tokens = flashsampling_cuda.sample(hidden.cpu(), weight.cpu(), **args, seed=seed, offset=offset,
                                               penalty_state=cpu_state)
        assert torch.equal(tokens.cpu(), cpu_tokens), step
        gpu_state.update(tokens)
        cpu_state.update(cpu_tokens)
    assert torch.equal(gpu_state.output_counts.cpu(), cpu_state.output_counts)


@pytest.mark.parametrize("batch,loop", [(20, 1), (50, 0), (100, 0)])
def test_penalised_call_runs_the_epilogue_warpgroup_kernels(batch, loop):
    """A penalised call with nothing else runs the common controls' kernel up to 32 columns (the
    epilogue-warpgroup one at 20), beyond it the plain epilogue-warpgroup kernel, whose loop applies
    the penalties, after the rank-bitmap kernel, and no cuBLAS GEMM (the old logits route's)."""
    hidden, weight = exact_lm_head(batch, seed=2)
    names = sample_kernel_names(hidden, weight, repetition_penalty=1.2, frequency_penalty=0.5,
                                penalty_state=penalty_history(batch, seed=4))
    assert any("build_penalty_table" in n for n in names), names
    assert runs_controls_on_epilogue_warpgroups(names, epilogue_warpgroups_tile(batch), loop), names
    ours = ("flashsampling", "cutlass")
    assert not any("gemm" in n.lower() and not any(o in n.lower() for o in ours) for n in names), names
