"""The logits path of truncation (flashsampling_cuda/truncation.py, csrc/kernels/sample_from_logits.cu)
and the public ``sample_from_logits``.

GPU: the CUDA kernel against the CPU op on the same fp32 logits (the same noise and survivors,
so the same tokens and scores bit for bit) over flat, peaked, tied and non-finite rows and
every truncation form, per-row mixes with off rows, masks, biases, greedy rows, per-row seeds
and several samples; ``sample`` on the logits path against the materialised path and plain
sampling; chi-square of the truncated distribution; CUDA-graph replay; torch.compile; opcheck.
CPU: the CPU op against the materialised path, the choice of path, argument errors, opcheck.
"""

import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda import truncation
from flashsampling_cuda.problems import hidden_states, lm_head_weight
from flashsampling_cuda.reference import reference_truncation
from sampling_stats import chi_square_pvalue, make_problem, problem, random_controls, transformed_probs

requires_cuda = pytest.mark.requires_cuda


def row_logits(kind: str, batch: int, vocab: int, seed: int) -> torch.Tensor:
    """fp32 [B, V] logits of one kind of row."""
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(batch, vocab, generator=g)
    if kind == "peaked":  # a Zipf head over a Gaussian bulk
        logits = 2.5 * torch.randn(batch, vocab, generator=g)
        head = torch.argsort(torch.rand(batch, vocab, generator=g), dim=1)[:, :32]
        c = 12 + 10 * torch.rand(batch, 1, generator=g)
        values = c - (1 + 2 * torch.rand(batch, 1, generator=g)) * torch.log(torch.arange(1.0, 33.0))
        return logits.scatter(1, head, values)
    if kind == "tied":  # few distinct values: ties at every cut, so the index digits decide
        return torch.randint(-4, 3, (batch, vocab), generator=g).float()
    if kind == "non_finite":  # rows with +inf, NaN, -inf, and all -inf (those of them the batch has)
        logits = torch.randn(batch, vocab, generator=g)
        logits[0, 5] = math.inf
        if batch >= 5:
            logits[1, :: 7] = math.nan
            logits[2, 10:] = -math.inf
            logits[3] = -math.inf
            logits[4, 3] = math.inf
            logits[4, 9] = math.inf
        return logits
    raise ValueError(kind)


FORMS = {
    "none": {},
    "k50": dict(top_k=50),
    "k1000": dict(top_k=1000),
    "k_rows": dict(top_k="k"),
    "p_rows": dict(top_p="p"),
    "min_p_rows": dict(min_p="m"),
    "k_p_min_p_rows": dict(top_k="k", top_p="p", min_p="m"),
    "p_scalar_min_p_scalar": dict(top_p=0.9, min_p=0.02),
}


def per_row(kind: str, batch: int, vocab: int, out_of_range: bool = True) -> torch.Tensor:
    """[B] parameters cycling through on and off values and, unless the tensor will be checked
    on the host (``out_of_range=False``), values out of range, which device tensors may hold."""
    if kind == "k":
        values = [50, 0, 1, -1, vocab + 5, 7, 2000, 20]
        return torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.int64)
    if kind == "p":
        values = [0.9, 1.0, 0.5, 0.0, 0.999, float("nan"), 0.95, 1.5] if out_of_range else [
            0.9, 1.0, 0.5, 0.2, 0.999, 0.05, 0.95, 1.0]
        return torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.float64)
    values = [0.05, 0.0, 0.3, 1.0, 1.5, -0.5, float("nan"), 0.01] if out_of_range else [
        0.05, 0.0, 0.3, 1.0, 0.6, 0.0, 0.2, 0.01]
    return torch.tensor([values[b % len(values)] for b in range(batch)], dtype=torch.float64)


def op_truncation(form: str, batch: int, vocab: int, device) -> dict:
    """The op's truncation arguments of a FORMS entry."""
    args = {}
    for name, value in FORMS[form].items():
        if isinstance(value, str):
            args[name + "s"] = per_row(value, batch, vocab).to(device)
        else:
            args[name] = value
    return args


def row_controls(batch: int, vocab: int, controls: bool, first_greedy_row: int) -> dict:
    """Per-row temperatures (every fifth row greedy from `first_greedy_row`) and, with `controls`,
    a bias, a mask, vocab_start and per-row seeds / offsets: the op's keyword arguments."""
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) + 0.4
    temperatures[first_greedy_row::5] = 0.0
    kwargs = dict(temperatures=temperatures)
    if controls:
        c = random_controls(batch, vocab, "cpu", vocab_start=64, seed=batch, density=0.5)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=64,
                      seed=torch.arange(batch) * 3 + 1, offset=torch.arange(batch), empty_mask_token=-7)
    return kwargs


def op_outputs(logits, device, **kwargs):
    out = torch.ops.flashsampling.sample_from_logits(logits.to(device), **{
        k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()})
    return [t.cpu() for t in out]


@requires_cuda
@pytest.mark.parametrize("kind", ["flat", "peaked", "tied", "non_finite"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
def test_cuda_kernel_equals_cpu_op_on_the_same_logits(kind, form, controls):
    """Same logits, same noise: the kernel's tokens and scores are the CPU op's bit for bit
    (its top_p sums run in another order, which would show only at a boundary within ~1e-7)."""
    batch, vocab = (16, 12289) if kind != "non_finite" else (8, 4099)
    logits = row_logits(kind, batch, vocab, seed=len(form) + len(kind))
    kwargs = dict(num_samples=3, seed=torch.tensor(11), offset=torch.tensor(4), return_logprobs=True,
                  **op_truncation(form, batch, vocab, "cpu"))
    kwargs.update(row_controls(batch, vocab, controls, first_greedy_row=0))
    cpu = op_outputs(logits, "cpu", **kwargs)
    gpu = op_outputs(logits, "cuda", **kwargs)
    assert torch.equal(gpu[0], cpu[0]), (gpu[0] != cpu[0]).nonzero()[:8]
    assert torch.equal(gpu[1], cpu[1])
    torch.testing.assert_close(gpu[2], cpu[2], rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(gpu[3], cpu[3], rtol=1e-5, atol=1e-5, equal_nan=True)


@requires_cuda
@pytest.mark.parametrize("kind", ["flat", "peaked", "tied", "non_finite"])
@pytest.mark.parametrize("form", ["none", "p_rows", "min_p_rows", "p_scalar_min_p_scalar", "p_rows_min_p_rows"])
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
@pytest.mark.parametrize("batch", [1, 8, 9])
def test_winner_first_rows_equal_cpu_op(kind, form, controls, batch):
    """One sample without log-probabilities: the rows without top_k take the kernel's winner-first
    path (sample_from_logits.cu, winner_first_row: greedy rows, and top_p rows in launches of at
    most 8 rows; B = 9 has only its greedy rows there), whose tokens and scores are the CPU op's
    bit for bit, as the cut path's are (the test above runs that path: several samples, logprobs)."""
    vocab = 12289 if kind != "non_finite" else 4099
    logits = row_logits(kind, batch, vocab, seed=len(form) + len(kind))
    trunc = (dict(top_ps=per_row("p", batch, vocab), min_ps=per_row("m", batch, vocab)[torch.arange(batch).flip(0)])
             if form == "p_rows_min_p_rows" else op_truncation(form, batch, vocab, "cpu"))
    kwargs = dict(num_samples=1, seed=torch.tensor(11), offset=torch.tensor(4), return_logprobs=False, **trunc)
    kwargs.update(row_controls(batch, vocab, controls, first_greedy_row=3))  # B = 1: a sampled row
    cpu = op_outputs(logits, "cpu", **kwargs)
    gpu = op_outputs(logits, "cuda", **kwargs)
    assert torch.equal(gpu[0], cpu[0]), (gpu[0] != cpu[0]).nonzero()[:8]
    assert torch.equal(gpu[1], cpu[1])


@requires_cuda
@pytest.mark.parametrize("batch", [1, 16, 33, 64, 130, 257])
def test_every_cluster_size_and_row_loop(batch):
    """Clusters of 8, 4 and 2 CTAs a row, and clusters that take several rows (B > 64)."""
    vocab = 20011
    logits = row_logits("peaked", batch, vocab, seed=batch)
    kwargs = dict(seed=torch.tensor(3), num_samples=2, return_logprobs=True, top_ps=per_row("p", batch, vocab),
                  top_ks=per_row("k", batch, vocab), temperature=0.7)
    assert [torch.equal(a, b) for a, b in zip(op_outputs(logits, "cuda", **kwargs)[:2],
                                              op_outputs(logits, "cpu", **kwargs)[:2])] == [True, True]


@requires_cuda
@pytest.mark.parametrize("kind", ["flat", "peaked", "non_finite"])
@pytest.mark.parametrize("form", ["none", "off_k_rows", "p_rows_some_off", "min_p"])
@pytest.mark.parametrize("batch,vocab", [(1, 4099), (5, 32771), (37, 20011)])
@pytest.mark.parametrize("keys", ["batch", "rows"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_streaming_rows_equal_cpu_op(kind, form, batch, vocab, keys, logprobs):
    """Rows without top_k / top_p / min_p take the streaming kernels (a quad of rows and a chunk of
    the vocabulary a CTA, csrc/kernels/streaming_rows.cu), the others the cut path, in one call
    where top_ps mixes them: tokens and scores bit for bit the CPU op's, over partial quads, prime
    V, greedy rows, a row that allows nothing, several samples, and noise keys that share the
    quad's Philox blocks (the batch's seed) or do not (per-row seeds and offsets); an invalid
    temperature in the device tensor gives its row no sample."""
    logits = row_logits(kind, batch, vocab, seed=batch + vocab)
    temperatures = torch.rand(batch, generator=torch.Generator().manual_seed(batch)) + 0.4
    temperatures[1::4] = 0.0
    truncation = {"none": {}, "min_p": dict(min_p=0.05),  # min_p: the cut path's rows, as a control
                  "off_k_rows": dict(top_ks=torch.tensor([(0, -1, vocab, vocab + 9)[b % 4] for b in range(batch)])),
                  "p_rows_some_off": dict(top_ps=torch.tensor([(1.0, 0.9, 1.5, 1.0, 0.5)[b % 5] for b in range(batch)],
                                                              dtype=torch.float64))}
    kwargs = dict(num_samples=2, temperatures=temperatures, return_logprobs=logprobs, **truncation[form])
    if keys == "batch":
        kwargs.update(seed=torch.tensor(5), offset=torch.tensor(9))
    else:
        kwargs.update(seed=torch.arange(batch) * 7 + 2, offset=torch.arange(batch) % 3)
    if batch > 4:  # a mask that allows nothing in row 4 and half the vocabulary elsewhere
        allowed = torch.rand(batch, vocab, generator=torch.Generator().manual_seed(3)) < 0.5
        allowed[4] = False
        kwargs.update(allowed_mask=fs.pack_allowed_mask(allowed), empty_mask_token=-7)
    cpu = op_outputs(logits, "cpu", **kwargs)
    gpu = op_outputs(logits, "cuda", **kwargs)
    assert torch.equal(gpu[0], cpu[0]), (gpu[0] != cpu[0]).nonzero()[:8]
    assert torch.equal(gpu[1], cpu[1])
    if logprobs:
        torch.testing.assert_close(gpu[2], cpu[2], rtol=1e-4, atol=1e-4, equal_nan=True)
        torch.testing.assert_close(gpu[3], cpu[3], rtol=1e-5, atol=1e-5, equal_nan=True)
    if batch > 2:  # the host checks a CPU tensor's temperatures; a device tensor's are not read
        temperatures[2] = -1.0
        invalid = op_outputs(logits, "cuda", **kwargs)
        assert (invalid[0][2] == -1).all() and (invalid[1][2] == -math.inf).all()
        rest = torch.arange(batch) != 2
        assert torch.equal(invalid[0][rest], gpu[0][rest]) and torch.equal(invalid[1][rest], gpu[1][rest])


@requires_cuda
@pytest.mark.parametrize("kind", ["flat", "peaked"])
@pytest.mark.parametrize("vocab", [20011, 32771])
@pytest.mark.parametrize("keys", ["batch", "rows"])
def test_streaming_rows_with_sparse_masks_equal_cpu_op(kind, vocab, keys):
    """Sparse masks (a few allowed tokens a row, as the tensor-parallel survivors or a grammar's):
    the streaming kernels skip a warp's step whose mask words allow nothing in its quad and load
    only the allowed logits; tokens and scores bit for bit the CPU op's, with rows of every
    density side by side in a quad, a row that allows nothing, greedy rows and logprobs."""
    batch = 37
    logits = row_logits(kind, batch, vocab, seed=vocab + 1)
    g = torch.Generator().manual_seed(vocab)
    density = torch.tensor([(0.0005, 0.002, 0.05, 1.0)[b % 4] for b in range(batch)])[:, None]
    allowed = torch.rand(batch, vocab, generator=g) < density
    allowed[5, 1000:1040] = True  # one run of allowed words
    allowed[6] = False
    allowed[7, -3:] = True  # the last, partial word
    temperatures = torch.rand(batch, generator=g) + 0.4
    temperatures[2::9] = 0.0
    kwargs = dict(num_samples=2, temperatures=temperatures, return_logprobs=True,
                  allowed_mask=fs.pack_allowed_mask(allowed), empty_mask_token=-7)
    if keys == "batch":
        kwargs.update(seed=torch.tensor(11), offset=torch.tensor(3))
    else:
        kwargs.update(seed=torch.arange(batch) * 5 + 1, offset=torch.arange(batch) % 2)
    cpu = op_outputs(logits, "cpu", **kwargs)
    gpu = op_outputs(logits, "cuda", **kwargs)
    assert torch.equal(gpu[0], cpu[0]), (gpu[0] != cpu[0]).nonzero()[:8]
    assert torch.equal(gpu[1], cpu[1])
    assert (gpu[0][6] == -7).all()
    torch.testing.assert_close(gpu[2], cpu[2], rtol=1e-4, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(gpu[3], cpu[3], rtol=1e-5, atol=1e-5, equal_nan=True)


@requires_cuda
def test_streaming_rows_with_sparse_masks_over_long_chunks_equal_cpu_op():
    """Chunks of more than 64 steps (B = 400 at V = 151930), so that a warp takes mask words from
    its first block, from the block read at the start and from one read as it goes (32 steps a
    block): allowed tokens around the blocks' edges (steps 30-34, 62-66 and the chunk's last
    ones), in the row's last, partial word, and bits past V set in it (ignored); tokens and
    scores bit for bit the CPU op's."""
    batch, vocab = 400, 151930
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    quads = batch // 4
    chunks, tokens, _ = torch.ops.flashsampling._streaming_chunks(quads, quads, vocab, sms, False)
    assert tokens // 256 > 64, f"{tokens} tokens a chunk on {sms} SMs: the test needs more than 64 steps"
    logits = row_logits("flat", batch, vocab, seed=17)
    g = torch.Generator().manual_seed(29)
    allowed = torch.rand(batch, vocab, generator=g) < 0.0002
    steps = torch.tensor([30, 31, 32, 33, 34, 62, 63, 64, 65, 66, tokens // 256 - 1])
    for c in range(chunks):
        token = c * tokens + steps * 256 + (torch.arange(len(steps)) * 37) % 256
        token = token[token < vocab]
        rows = (torch.arange(batch) % 3 == c % 3).nonzero().flatten()
        allowed[rows[:, None], token[None, :]] = True
    allowed[1::7, -5:] = True  # the last, partial word
    allowed[5] = False
    mask = fs.pack_allowed_mask(allowed)
    mask[2::5, -1] |= ~((1 << (vocab % 32)) - 1)  # bits past V: not tokens
    temperatures = torch.rand(batch, generator=g) + 0.4
    temperatures[3::11] = 0.0
    kwargs = dict(temperatures=temperatures, allowed_mask=mask, empty_mask_token=-7,
                  seed=torch.arange(batch) * 3 + 1, offset=torch.arange(batch) % 4)
    cpu = op_outputs(logits, "cpu", **kwargs)
    gpu = op_outputs(logits, "cuda", **kwargs)
    assert torch.equal(gpu[0], cpu[0]), (gpu[0] != cpu[0]).nonzero()[:8]
    assert torch.equal(gpu[1], cpu[1])
    sampled = torch.arange(batch) != 5
    assert bool(allowed[sampled].gather(1, gpu[0][sampled]).all()) and (gpu[0][5] == -7).all()


def sample_paths(hidden, weight, path_a, path_b, **kwargs):
    a = fs.sample_with_scores(hidden, weight, truncation_path=path_a, **kwargs)
    b = fs.sample_with_scores(hidden, weight, truncation_path=path_b, **kwargs)
    return a, b


def assert_same_tokens_up_to_near_ties(a, b, scale):
    """Tokens equal except where the two winning scores are within fp32 rounding of the two
    matmuls (cuBLAS's and the fused kernel's): at most 1% of them."""
    differ = a.tokens != b.tokens
    assert int(differ.sum()) <= max(1, differ.numel() // 100)
    close = (a.scores - b.scores).abs() <= 1e-5 * scale
    assert bool(close[~differ].all()) and bool(close[differ].all())


@requires_cuda
@pytest.mark.parametrize("regime", ["flat", "llm"])
@pytest.mark.parametrize("form", ["k_rows", "p_rows", "min_p_rows", "k_p_min_p_rows", "k1000"])
def test_logits_path_equals_materialized_path(regime, form):
    batch, vocab, dim = 40, 32768, 256
    weight = lm_head_weight(vocab, dim, seed=1)
    hidden = hidden_states(weight, batch, regime, seed=2)
    kwargs = {name: per_row(value, batch, vocab).cuda() if isinstance(value, str) else value
              for name, value in FORMS[form].items()}
    temps = torch.rand(batch, device="cuda") + 0.5
    temps[::7] = 0.0
    a, b = sample_paths(hidden, weight, "logits", "materialized", temperature=temps, seed=5, num_samples=2,
                        return_logprobs=True, **kwargs)
    assert_same_tokens_up_to_near_ties(a, b, scale=40.0)
    torch.testing.assert_close(a.logsumexp, b.logsumexp, rtol=1e-4, atol=1e-4)


@requires_cuda
def test_rows_whose_truncation_is_off_get_the_plain_token():
    batch, vocab, dim = 64, 32768, 256
    weight = lm_head_weight(vocab, dim, seed=3)
    hidden = hidden_states(weight, batch, "llm", seed=4)
    off = torch.arange(batch, device="cuda") % 2 == 0
    top_p = torch.where(off, 1.0, 0.8)
    top_k = torch.where(off, 0, 20)
    truncated = fs.sample_with_scores(hidden, weight, seed=9, top_p=top_p, top_k=top_k, truncation_path="logits")
    plain = fs.sample_with_scores(hidden, weight, seed=9)
    differ = (truncated.tokens != plain.tokens)[off]
    assert int(differ.sum()) <= 1
    assert bool(((truncated.scores - plain.scores).abs()[off] <= 1e-3).all())


@requires_cuda
@pytest.mark.parametrize("top_k,top_p,min_p,temperature", [(None, 0.8, None, 1.0), (5, None, None, 0.7),
                                                           (None, None, 0.2, 1.3), (30, 0.9, 0.05, 0.9)])
def test_chi_square_of_the_truncated_distribution(top_k, top_p, min_p, temperature):
    batch, vocab, samples = 4, 97, 20_000
    hidden, weight = problem(batch, vocab, 32, "cuda", logit_std=1.0, seed=17)
    trunc = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=torch.arange(batch, device="cuda") + 7,
                       num_samples=samples, truncation_path="logits", **trunc).cpu()
    ref = reference_truncation(hidden, weight, temperature, **trunc)
    assert (ref.boundary_gap > 1e-5).all(), "a boundary within rounding: pick other parameters"
    survivors = ref.survivors.cpu()
    assert survivors.gather(1, tokens).all(), "a truncated token was sampled"
    probs = transformed_probs(hidden, weight, temperature, allowed=survivors)
    assert chi_square_pvalue(tokens, probs) > 1e-3


@requires_cuda
def test_cuda_graph_replay_draws_fresh_samples():
    batch, vocab, dim = 8, 8192, 128
    weight = lm_head_weight(vocab, dim, seed=5)
    hidden = hidden_states(weight, batch, "flat", seed=6)
    top_p = torch.full((batch,), 0.9, device="cuda")

    def step():
        return fs.sample(hidden, weight, top_p=top_p)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tokens = step()
    draws = []
    for _ in range(4):
        graph.replay()
        draws.append(tokens.clone())
    assert len({tuple(d.flatten().tolist()) for d in draws}) == 4


@requires_cuda
def test_torch_compile_fullgraph_on_the_logits_path():
    batch, vocab, dim = 8, 8192, 128
    weight = lm_head_weight(vocab, dim, seed=7)
    hidden = hidden_states(weight, batch, "llm", seed=8)
    top_k = torch.full((batch,), 20, device="cuda")
    top_p = torch.full((batch,), 0.95, device="cuda")

    def decode_step(h, w, k, p):
        return fs.sample(h, w, temperature=0.6, seed=1, top_k=k, top_p=p, return_logprobs=True)

    got = torch.compile(decode_step, fullgraph=True)(hidden, weight, top_k, top_p)
    expected = decode_step(hidden, weight, top_k, top_p)
    assert torch.equal(got.tokens, expected.tokens)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_opcheck(device):
    logits = row_logits("peaked", 4, 300, seed=1).to(device)
    kwargs = dict(seed=torch.tensor(3), num_samples=2, return_logprobs=True, top_p=0.9,
                  top_ks=torch.tensor([3, 0, 50, -1], device=device))
    torch.library.opcheck(torch.ops.flashsampling.sample_from_logits, (logits,), kwargs)


# ---------------------------------------------------------------- CPU


@pytest.mark.parametrize("form", list(FORMS))
def test_cpu_op_equals_materialized_path(form):
    """sample_from_logits on the CPU op's own logits == sample's materialised path (the same
    logits bit for bit, the same survivors, the same noise and scores)."""
    batch, vocab = 12, 3001
    hidden, weight = make_problem(batch, vocab, 64, dtype=torch.bfloat16, logit_std=3.0, seed=3)
    c = random_controls(batch, vocab, "cpu", vocab_start=7, seed=2)
    temps = torch.rand(batch) + 0.3
    temps[::4] = 0.0
    kwargs = dict(temperature=temps, seed=torch.arange(batch) * 5 + 1, offset=torch.arange(batch), num_samples=2,
                  return_logprobs=True, vocab_start=7, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"],
                  sparse_logit_bias=c["sparse_logit_bias"])
    for name, value in FORMS[form].items():
        kwargs[name] = per_row(value, batch, vocab, out_of_range=False) if isinstance(value, str) else value
    expected = fs.sample_with_scores(hidden, weight, **kwargs)
    got = fs.sample_from_logits(truncation.materialized_logits(hidden, weight), **kwargs)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logsumexp, expected.logsumexp, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(got.logprobs, expected.token_logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_path_choice():
    hidden = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(32768, 16, dtype=torch.bfloat16, device="meta")
    kwargs = dict(sparse_bias_ids=None)
    on_cpu = (torch.empty(8, 16), torch.empty(32768, 16))
    k50 = truncation.Truncation(50, None, None)
    assert truncation.choose_truncation_path("auto", k50, *on_cpu, kwargs) == "materialized"
    with pytest.raises(ValueError, match="truncation_path='logits' runs on CUDA only"):
        truncation.choose_truncation_path("logits", k50, *on_cpu, kwargs)
    with pytest.raises(ValueError, match="truncation_path='fused_top_k' needs CUDA"):
        truncation.choose_truncation_path("fused_top_k", k50, *on_cpu, kwargs)
    with pytest.raises(ValueError, match="truncation_path must be one of"):
        truncation.choose_truncation_path("fast", k50, hidden, weight, kwargs)


def test_bad_arguments_name_them():
    logits = torch.randn(4, 100)
    with pytest.raises(TypeError, match="logits must be a floating tensor"):
        fs.sample_from_logits(torch.ones(4, 100, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits must be 2-D"):
        fs.sample_from_logits(torch.randn(100))
    with pytest.raises(ValueError, match="top_p must be in"):
        fs.sample_from_logits(logits, top_p=1.5)
    with pytest.raises(RuntimeError, match="temperatures must be finite"):
        fs.sample_from_logits(logits, temperature=torch.tensor([1.0, -1.0, 1.0, 1.0]), seed=1)
    with pytest.raises(RuntimeError, match="top_ks must have shape"):
        torch.ops.flashsampling.sample_from_logits(logits, top_ks=torch.ones(3, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="allowed_mask allows no token"):
        fs.sample_from_logits(logits, seed=1, allowed_mask=torch.zeros(4, 100, dtype=torch.bool), top_p=0.5)
    with pytest.raises(ValueError, match="truncation_path must be one of"):
        fs.sample(torch.randn(2, 8), torch.randn(50, 8), top_k=3, truncation_path="fast")


@pytest.mark.parametrize("form", [dict(top_k=1), dict(top_p=0.5), dict(top_k=torch.tensor([1, 1]))])
def test_an_allowed_nan_comes_after_minus_infinity(form):
    """The truncation order puts an allowed NaN y after every number, -inf included (as the
    kernels' keys do), so a row of [NaN, -inf, -inf] keeps token 1, the plain-sampling token."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[nan, -inf, -inf], [-inf, nan, 2.0]])
    survivors = truncation.survivor_mask(logits, None, truncation.Truncation(*(form.get(n) for n in
                                                                                ("top_k", "top_p", "min_p"))))
    assert survivors.tolist() == [[False, True, False], [False, False, True]]
    tokens = fs.sample_from_logits(logits, seed=1, **form)
    assert tokens.flatten().tolist() == [1, 2]
    assert tokens.flatten().tolist() == fs.sample_from_logits(logits, seed=1).flatten().tolist()


class _CudaShape:
    """What choose_truncation_path reads of a tensor (shape, dtype, device), on CUDA without a GPU."""

    def __init__(self, *shape, dtype=torch.bfloat16):
        self.shape, self.dtype, self.device = shape, dtype, torch.device("cuda")


def test_path_choice_on_cuda(monkeypatch):
    """On CUDA other than sm90 (the machine's own GPU does not matter here): a host top_k <= 64
    takes the fused pass, other forms the logits path, which takes what the fused op takes
    (bf16 / fp16: fp32 logits of fp32 inputs may come from a TF32 matmul) and V <= 2^22;
    everything else the materialised path."""
    monkeypatch.setattr(truncation, "cuda_arch", lambda device: 80)
    kwargs = dict(sparse_bias_ids=None)
    top_p, k20 = truncation.Truncation(None, 0.9, None), truncation.Truncation(20, 0.9, None)
    choose = truncation.choose_truncation_path
    assert choose("auto", k20, _CudaShape(4, 16), _CudaShape(32768, 16), kwargs) == "fused_top_k"
    assert choose("auto", top_p, _CudaShape(4, 16), _CudaShape(32768, 16), kwargs) == "logits"
    assert choose("logits", k20, _CudaShape(4, 16), _CudaShape(32768, 16), kwargs) == "logits"
    fp32 = (_CudaShape(4, 16, dtype=torch.float32), _CudaShape(32768, 16, dtype=torch.float32))
    assert choose("auto", top_p, *fp32, kwargs) == "materialized"
    big = (_CudaShape(4, 16), _CudaShape(truncation.LOGITS_PATH_MAX_VOCAB + 1, 16))
    assert choose("auto", top_p, *big, kwargs) == "materialized"
    with pytest.raises(ValueError, match="bfloat16/float16"):
        choose("logits", top_p, *fp32, kwargs)


def test_path_choice_on_sm90(monkeypatch):
    """On sm90 the fused pass takes every form (its GEMM stores the logits of the rows stage 2
    leaves); elsewhere a host top_k <= 64 only. A host top_k up to 1024 is selected
    in stage 2 at every batch, with or without top_p; a larger one takes the fused pass where the
    GEMM draws the tile winners and the measurements favour it (up to 4 rows, alone, one sample, a
    batch-wide seed and offset), else the logits path."""
    kwargs = dict(sparse_bias_ids=None, seed=torch.tensor(1), offset=None, num_samples=1)
    shapes = (_CudaShape(4, 16), _CudaShape(32768, 16))
    forms = [truncation.Truncation(None, 0.9, None), truncation.Truncation(None, None, 0.05),
             truncation.Truncation(torch.full((4,), 20), 0.9, None), truncation.Truncation(1000, None, None),
             truncation.Truncation(1024, None, 0.05), truncation.Truncation(5000, None, None)]
    monkeypatch.setattr(truncation, "cuda_arch", lambda device: 90)
    choose = truncation.choose_truncation_path
    assert [choose("auto", t, *shapes, kwargs) for t in forms] == ["fused_top_k"] * 6
    for batch in (16, 64, 256):
        large = (_CudaShape(batch, 16), shapes[1])
        assert [choose("auto", t, *large, kwargs) for t in forms] == ["fused_top_k"] * 5 + ["logits"]
    assert choose("fused_top_k", forms[5], *large, kwargs) == "fused_top_k"
    for per_call in (dict(kwargs, num_samples=2), dict(kwargs, seed=torch.arange(4)),
                     dict(kwargs, offset=torch.arange(4))):
        assert choose("auto", forms[3], *shapes, per_call) == "fused_top_k"
        assert choose("auto", forms[5], *shapes, per_call) == "logits"
    assert choose("auto", truncation.Truncation(1000, 0.9, None), *shapes, kwargs) == "fused_top_k"
    assert choose("auto", truncation.Truncation(5000, 0.9, None), *shapes, kwargs) == "logits"
    assert choose("auto", truncation.Truncation(5000, None, 0.05), *shapes, kwargs) == "logits"
    monkeypatch.setattr(truncation, "cuda_arch", lambda device: 100)
    assert [truncation.choose_truncation_path("auto", t, *shapes, kwargs) for t in forms] == ["logits"] * 6
    with pytest.raises(ValueError, match="unless the GPU is sm90"):
        truncation.choose_truncation_path("fused_top_k", forms[0], *shapes, kwargs)


def test_fake_kernel_checks_seed_with_generator():
    logits = torch.randn(2, 50)
    for device in ("cpu", "meta"):
        with pytest.raises(RuntimeError, match="pass either seed or generator, not both"):
            torch.ops.flashsampling.sample_from_logits(logits.to(device), seed=torch.tensor(1),
                                                       generator=torch.Generator())
