"""Top-k, top-p and min-p sampling and sampling without replacement (issue #5): pathwise
against the float64 reference under the same noise, chi-square on the truncated
distributions and on Gumbel-top-k (Plackett-Luce), per-row parameters mixing off and on
rows, everything off == plain sampling, ties, argument errors and torch.compile.

Tests parametrized over `device` run on the CPU here and on CUDA on the GPU machine
(requires_cuda), with what the CUDA kernel takes: bfloat16, D % 8 == 0. On CUDA the
truncation's logits come from cuBLAS, summed in another order than the kernel's, so a
token may differ from the reference where two scores or a truncation boundary are within
fp32 rounding (the reference reports both).
"""

import itertools
import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda import noise, truncation
from flashsampling_cuda.reference import (
    reference_sample,
    reference_sample_without_replacement,
    reference_truncation,
)
from sampling_stats import (
    assert_matches_reference,
    chi_square,
    chi_square_pvalue,
    integer_problem,
    make_problem,
    problem,
    random_controls,
    softmax_rows,
    transformed_probs,
)
from scipy.stats import chi2

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
RTOL = 1e-4  # as test_controls.py: the GPU sums the logits in another order than at::mm


# ---------------------------------------------------------------- pathwise

B, V, D = 8, 3001, 64
TEMPERATURES = [0.5, 0.0, 1.0, 2.0, 0.0, 0.7, 1.3, 0.9]  # rows 1 and 4 greedy
TRUNCATION_CASES = {
    "top_k_1": dict(top_k=1),
    "top_k_5": dict(top_k=5),
    "top_k_per_row": dict(top_k=[1, 5, 50, 0, -1, 200, 3, 2000]),
    "top_p": dict(top_p=0.9),
    "top_p_per_row": dict(top_p=[0.1, 0.5, 0.9, 1.0, 0.99, 0.3, 0.7, 1.0]),
    "min_p": dict(min_p=0.1),
    "top_k_top_p": dict(top_k=50, top_p=0.8),
    "all_per_row": dict(top_k=[20, -1, 0, 100, 5, 0, 3000, 1], top_p=[0.8, 0.95, 1.0, 0.6, 1.0, 0.9, 0.5, 0.3],
                        min_p=[0.05, 0.0, 0.2, 0.0, 0.5, 0.01, 0.0, 0.0]),
}


def truncation_kwargs(case, device):
    """top_k/top_p/min_p of a TRUNCATION_CASES entry, lists as [B] tensors on `device`."""
    out = {}
    for name, value in TRUNCATION_CASES[case].items():
        if isinstance(value, list):
            value = torch.tensor(value, device=device, dtype=torch.int64 if name == "top_k" else torch.float32)
        out[name] = value
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("controls", [False, True], ids=["plain", "controls"])
@pytest.mark.parametrize("case", list(TRUNCATION_CASES))
def test_pathwise_equal_to_float64_reference(case, controls, device):
    """Tokens, scores and log-probabilities of the renormalised truncated distribution,
    per-row temperatures (greedy rows too), alone or with every other control."""
    hidden, weight = problem(B, V, D, device, seed=len(case))
    kwargs = dict(temperature=torch.tensor(TEMPERATURES, device=device), seed=2024, offset=3, num_samples=6,
                  **truncation_kwargs(case, device))
    if controls:
        c = random_controls(B, V, device, vocab_start=64, seed=len(case), density=0.5)
        kwargs.update(seed=torch.arange(B, device=device) * 7919 + 1, offset=torch.arange(B, device=device) * 5,
                      logit_bias=c["logit_bias"], sparse_logit_bias=c["sparse_logit_bias"],
                      allowed_mask=c["allowed_mask"], vocab_start=64)
    out = fs.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
    ref = reference_sample(hidden, weight, **kwargs, rtol=RTOL)
    assert_matches_reference(out.tokens, ref)
    # Every token survives the reference truncation (except at a boundary within rounding).
    survivors = reference_truncation(hidden, weight, kwargs["temperature"], **{
        k: v for k, v in kwargs.items() if k not in ("temperature", "seed", "offset", "num_samples")}).survivors
    local = out.tokens.cpu() - kwargs.get("vocab_start", 0)
    sure = (ref.boundary_gap.cpu() >= ref.tolerance.cpu())[:, None].expand_as(local)
    assert survivors.cpu().gather(1, local)[sure].all()

    same = out.tokens.cpu() == ref.tokens.cpu()
    scale = ref.tolerance.cpu()[:, None].expand_as(same) * 10
    assert ((out.scores.cpu().double() - ref.scores.cpu()).abs()[same] <= scale[same]).all()
    torch.testing.assert_close(out.logsumexp.cpu().double(), ref.logsumexp.cpu(), rtol=1e-4, atol=0.0)
    torch.testing.assert_close(out.token_logprobs.cpu().double()[same], ref.logprobs.cpu()[same], rtol=1e-4,
                               atol=1e-4)
    tokens = fs.sample(hidden, weight, **kwargs)
    assert torch.equal(tokens, out.tokens)


@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 64), (torch.float32, 37), (torch.float16, 1000),
                                        (torch.bfloat16, 4096)])
def test_cpu_truncation_sees_the_ops_fp32_logits_bit_for_bit(dtype, dim):
    """On the CPU the survivors are computed from the op's own fp32 logits (same at::mm
    calls), so the sample is the fp32 Gumbel-argmax over them exactly: recomputing
    fma(x, fl(1 / T), g) over the survivors gives the op's tokens and scores bit for bit."""
    batch, vocab = 6, 5000
    hidden, weight = make_problem(batch, vocab, dim, dtype=dtype, logit_std=1.0, seed=dim)
    c = random_controls(batch, vocab, "cpu", vocab_start=32, seed=dim, density=0.6)
    temps = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.7, 1.3])
    top_k = torch.tensor([5, 0, 3, -1, 100, 7])
    controls = dict(logit_bias=c["logit_bias"], sparse_logit_bias=c["sparse_logit_bias"],
                    allowed_mask=c["allowed_mask"], vocab_start=32)
    out = fs.sample_with_scores(hidden, weight, temperature=temps, seed=11, num_samples=4, top_k=top_k, top_p=0.9,
                                **controls)
    ids, values = c["sparse_logit_bias"]
    x = truncation.transformed_logits(truncation.materialized_logits(hidden, weight), c["logit_bias"], ids, values,
                                      32)
    survivors = truncation.survivor_mask(truncation.scaled_logits(x, 1.0, temps), c["allowed_bool"],
                                         truncation.Truncation(top_k, 0.9, None))
    inv_t = torch.where(temps == 0, 1.0, torch.ones(batch) / temps)[:, None]
    for s in range(4):
        g = noise.gumbel_noise(11, 0, torch.arange(batch)[:, None], s, torch.arange(32, 32 + vocab))
        scores = torch.where((temps == 0)[:, None], x, noise.fma32(x, inv_t, g)).masked_fill(~survivors, -math.inf)
        assert torch.equal(out.tokens[:, s], scores.argmax(dim=1) + 32)
        assert torch.equal(out.scores[:, s], scores.amax(dim=1))


def test_cpu_host_top_k_shortcut_gives_the_general_paths_mask():
    """On the CPU a host top_k takes one torch.topk of the logits (truncation._host_top_k_mask)
    where that decides the survivors exactly: its bitmask is the general path's bit for bit, and
    it steps aside (None) for a tie or a NaN at the boundary."""
    g = torch.Generator().manual_seed(3)
    batch, vocab = 7, 3000
    temps = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.7, 1.3, 0.0])
    allowed = torch.rand(batch, vocab, generator=g) < 0.5
    allowed[:, :3] = True
    cases = [truncation.Truncation(k, p, m) for k, p, m in
             [(1, None, None), (5, 0.9, None), (50, 0.5, 0.05), (40, torch.rand(batch, generator=g), None),
              (vocab - 2, 0.99, None)]]
    for quantum in (0.0, 0.25):  # continuous logits, then logits on a grid of 0.25 (ties)
        x = torch.randn(batch, vocab, generator=g) * 3
        if quantum:
            x = (x / quantum).round() * quantum
        for mask in (None, allowed):
            for trunc in cases:
                y = truncation.scaled_logits(x, 1.0, temps)
                expected = fs.pack_allowed_mask(truncation.survivor_mask(y, mask, trunc))
                got = truncation._host_top_k_mask(x, mask, trunc, 1.0, temps)
                if quantum or (mask is not None and trunc.top_k > 1000):  # ties, or -inf at the boundary
                    assert got is None or torch.equal(got, expected)
                else:
                    assert got is not None and torch.equal(got, expected), (trunc, mask is None)
    x = torch.randn(batch, vocab, generator=g)
    x[2, 7] = math.nan
    assert truncation._host_top_k_mask(x, None, cases[1], 1.0, temps) is None
    x[2, 7] = 100.0
    x[2, 8] = 100.0  # a tie at k = 1 (row 2, greedy: y = x)
    assert truncation._host_top_k_mask(x, None, truncation.Truncation(1, None, None), 1.0, temps) is None


# ---------------------------------------------------------------- chi-square

CHI_SQUARE_CASES = [  # (top_k, top_p, min_p, temperature)
    (5, None, None, 1.0),
    (None, 0.7, None, 0.8),
    (None, None, 0.2, 1.5),
    (20, 0.9, 0.05, 0.6),
    (3, 0.5, None, 2.0),
    (-1, 0.95, 0.1, 1.0),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("top_k, top_p, min_p, temperature", CHI_SQUARE_CASES)
def test_chi_square_matches_truncated_softmax(top_k, top_p, min_p, temperature, device):
    batch, vocab, samples = 4, 97, 20_000
    hidden, weight = problem(batch, vocab, 32, device, logit_std=1.0, seed=17)
    trunc = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=torch.arange(batch, device=device) + 101,
                       num_samples=samples, **trunc).cpu()
    ref = reference_truncation(hidden, weight, temperature, **trunc)
    # fp32 logits are within ~1e-6 of float64 here: no boundary may be that close.
    assert (ref.boundary_gap > 1e-5).all(), "a boundary within rounding: pick other parameters"
    survivors = ref.survivors.cpu()
    assert survivors.gather(1, tokens).all(), "a truncated token was sampled"
    probs = transformed_probs(hidden, weight, temperature, allowed=survivors)
    p = chi_square_pvalue(tokens, probs)
    print(f"survivors per row {survivors.sum(dim=1).tolist()}, chi-square p = {p:.3f}")
    assert p > 1e-3, f"chi-square p = {p:.2e}"


# ---------------------------------------------------------------- off, per row, ties

@pytest.mark.parametrize("device", DEVICES)
def test_everything_off_is_plain_sampling(device):
    """Off values give the tokens, scores and log-probabilities of plain sampling: host
    scalars take the plain call (bit for bit); tensors take the materialised path on the CPU
    (bit for bit) and the logits path on CUDA, whose logits come from cuBLAS (the same tokens
    here; scores and log-probabilities within fp32 rounding of the two matmuls)."""
    hidden, weight = problem(B, V, D, device, seed=4)
    c = random_controls(B, V, device, seed=4, density=0.7)
    kwargs = dict(temperature=torch.tensor(TEMPERATURES, device=device), seed=9, num_samples=5,
                  logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], return_logprobs=True)
    plain = fs.sample_with_scores(hidden, weight, **kwargs)
    ones = torch.ones(B, device=device)
    for off in (dict(top_k=-1, top_p=1.0, min_p=0.0), dict(top_k=0), dict(top_p=1), dict(min_p=0),
                dict(top_k=torch.tensor([-1, 0] * 4, device=device), top_p=ones, min_p=ones * 0),
                dict(top_k=torch.tensor(0), top_p=torch.tensor(1.0), min_p=torch.tensor(0.0))):
        out = fs.sample_with_scores(hidden, weight, **kwargs, **off)
        assert torch.equal(out.tokens, plain.tokens), off
        logits_path = device == "cuda" and any(isinstance(v, torch.Tensor) for v in off.values())
        tolerance = dict(rtol=1e-5, atol=1e-4) if logits_path else dict(rtol=1e-6, atol=1e-6)
        if logits_path:
            torch.testing.assert_close(out.scores, plain.scores, **tolerance)
        else:
            assert torch.equal(out.scores, plain.scores), off
        torch.testing.assert_close(out.token_logprobs, plain.token_logprobs, **tolerance)
        torch.testing.assert_close(out.logsumexp, plain.logsumexp, **tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_per_row_parameters_mix_off_and_on_rows(device):
    """In one batch: rows whose parameters are all off get the plain tokens (exactly on the
    CPU; on CUDA the masked call runs the controls kernel, which may differ from the plain
    one at near ties, as any two kernels), the others those of the reference."""
    hidden, weight = problem(6, V, D, device, seed=8)
    top_k = torch.tensor([-1, 5, 0, 20, -1, 1], device=device)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.5, 1.0], device=device)
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0], device=device)
    kwargs = dict(temperature=0.9, seed=torch.arange(6, device=device) + 5, num_samples=16)
    tokens = fs.sample(hidden, weight, **kwargs, top_k=top_k, top_p=top_p, min_p=min_p)
    plain = fs.sample(hidden, weight, **kwargs)
    off = torch.tensor([True, False, True, False, False, False], device=device)
    if device == "cpu":  # (on CUDA the reference check below covers the off rows)
        assert torch.equal(tokens[off], plain[off])
    assert not torch.equal(tokens[~off], plain[~off])
    ref = reference_sample(hidden, weight, 0.9, kwargs["seed"], 0, 16, top_k=top_k, top_p=top_p, min_p=min_p,
                           rtol=RTOL)
    assert_matches_reference(tokens, ref)
    assert (tokens[5] == tokens[5, 0]).all(), "top_k = 1 is the argmax"


def diagonal_problem(logits, device, dim=8):
    """hidden [R, dim] and weight [V, dim] whose logits are exactly `logits` [R, V] (small
    integers, exact in bfloat16): row r of hidden is e_r, column r of weight row r's logits."""
    rows, vocab = logits.shape
    hidden = torch.zeros(rows, dim)
    hidden[torch.arange(rows), torch.arange(rows)] = 1.0
    weight = torch.zeros(vocab, dim)
    weight[:, :rows] = logits.T
    return hidden.bfloat16().to(device), weight.bfloat16().to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_at_the_boundary_go_to_the_smaller_index(device):
    """Exact ties at the k-th value and at the top_p cut keep the smaller indices; the
    survivors, and only they, are sampled, uniformly among equal logits."""
    logits = torch.tensor([[3.0, 5, 5, 1, 5, 4, 5, 0],  # top_k = 3: 5 at 1, 2, 4 (not 6)
                           [2.0, 2, 2, 2, 2, 2, 2, 2]])  # top_p = 0.5 of 8 equal: 0, 1, 2, 3
    hidden, weight = diagonal_problem(logits, device)
    samples = 8000
    out = fs.sample(hidden, weight, seed=torch.tensor([1, 2], device=device), num_samples=samples,
                    top_k=torch.tensor([3, -1], device=device), top_p=torch.tensor([1.0, 0.5], device=device)).cpu()
    expected = [{1, 2, 4}, {0, 1, 2, 3}]
    for row in range(2):
        assert set(out[row].tolist()) == expected[row]
        probs = torch.zeros(8, dtype=torch.float64)
        probs[list(expected[row])] = 1 / len(expected[row])
        stat, dof = chi_square(out[row], probs)
        assert chi2.sf(stat, dof) > 1e-3
    # Greedy rows: the first maximum whatever the truncation.
    greedy = fs.sample(hidden, weight, temperature=0.0, seed=0, top_k=2, top_p=0.01).cpu()
    assert greedy[:, 0].tolist() == [1, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_top_p_and_full_min_p_keep_the_top_token(device):
    hidden, weight = integer_problem(5, 1000, 16, seed=3)
    x = hidden @ weight.T  # exact: small integers
    top = x.argmax(dim=1)
    top_is_unique = (x == x.amax(dim=1, keepdim=True)).sum(dim=1) == 1
    to = dict(dtype=torch.bfloat16, device=device)
    hidden, weight = hidden.to(**to), weight.to(**to)
    for trunc in (dict(top_p=1e-9), dict(top_k=50, top_p=1e-6), dict(min_p=1.0)):
        for temperature in (0.5, 1.0, 3.0):
            tokens = fs.sample(hidden, weight, temperature=temperature, seed=7, num_samples=50, **trunc).cpu()
            rows = top_is_unique if "min_p" in trunc else torch.ones(5, dtype=torch.bool)
            assert (tokens[rows] == top[rows, None]).all(), (trunc, temperature)


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("device", DEVICES)
def test_bad_truncation_arguments_raise_errors_naming_them(device):
    hidden, weight = problem(3, 40, 8, device)
    cases = [
        (dict(top_k=-2), ValueError, r"top_k must be an integer >= -1 \(-1 or 0: off\), got -2"),
        (dict(top_k=2.5), TypeError, r"top_k must be an int or a tensor, got float"),
        (dict(top_k=True), TypeError, r"top_k must be an int or a tensor, got bool"),
        (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\] \(1: off\), got 0.0"),
        (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p=math.nan), ValueError, r"top_p must be in \(0, 1\]"),
        (dict(top_p="0.5"), TypeError, r"top_p must be a float or a tensor, got str"),
        (dict(min_p=-0.1), ValueError, r"min_p must be in \[0, 1\] \(0: off\), got -0.1"),
        (dict(min_p=1.01), ValueError, r"min_p must be in \[0, 1\]"),
        (dict(top_k=torch.ones(3)), TypeError, r"top_k must be an integer tensor, got torch.float32"),
        (dict(top_p=torch.ones(3, dtype=torch.int64)), TypeError, r"top_p must be a floating tensor"),
        (dict(min_p=torch.zeros(3, dtype=torch.bool)), TypeError, r"min_p must be a floating tensor"),
        (dict(top_k=torch.ones(4, dtype=torch.int64)), ValueError,
         r"top_k must be a scalar, a 0-d tensor or a \[B\] = \[3\] tensor, got shape \[4\]"),
        (dict(top_p=torch.ones(3, 1)), ValueError, r"top_p must be a scalar, a 0-d tensor or a \[B\]"),
        (dict(top_k=torch.ones(3, dtype=torch.int64, device="meta")), ValueError,
         r"top_k must be on the CPU or on hidden's device"),
        (dict(top_p=torch.tensor([0.5, 0.0, 1.0])), ValueError,
         r"top_p must be in \(0, 1\] \(1: off\), got 0.0 in row 1"),
        (dict(top_k=torch.tensor([3, -5, 1])), ValueError, r"top_k must be an integer >= -1 .* got -5 in row 1"),
        (dict(min_p=torch.tensor(2.0)), ValueError, r"min_p must be in \[0, 1\] .* got 2.0 in row 0"),
        # The op's own argument errors come first, with its messages.
        (dict(top_k=5, logit_bias=torch.zeros(41, device=device)), RuntimeError,
         r"logit_bias must have shape \[V\] = \[40\]"),
        (dict(top_k=5, allowed_mask=torch.zeros(3, 1, dtype=torch.int32, device=device)), RuntimeError,
         r"allowed_mask must have shape \[B, ceil\(V / 32\)\]"),
        (dict(top_k=5, temperature=torch.ones(4, device=device)), RuntimeError, r"temperatures must have shape"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match="flashsampling.sample: " + message):
            fs.sample(hidden, weight, seed=0, **kwargs)
    with pytest.raises(RuntimeError, match=r"flashsampling.sample: weight dtype .* must match hidden dtype"):
        fs.sample(hidden, weight.float(), seed=0, top_k=5)


# ---------------------------------------------------------------- without replacement

def assert_matches_reference_top_k(tokens, ref):
    """Rows differing from the reference_sample_without_replacement's are near ties."""
    near_tie = (ref.gap.cpu() < ref.tolerance.cpu()) | (ref.boundary_gap.cpu() < ref.tolerance.cpu())
    differ = (tokens.cpu() != ref.tokens.cpu()).any(dim=1)
    unexplained = int((differ & ~near_tie).sum())
    print(f"rows differing {int(differ.sum())} / {tokens.shape[0]}, outside near ties {unexplained}")
    assert unexplained == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "controls", "truncated"])
def test_without_replacement_is_gumbel_top_k(case, device):
    """k distinct tokens: the k best perturbed scores of draw 0, best first (the float64
    reference), token 0 == sample(); greedy rows give their k largest logits."""
    k = 6
    hidden, weight = problem(B, V, D, device, seed=31)
    kwargs = dict(temperature=torch.tensor(TEMPERATURES, device=device), seed=77, offset=2)
    if case != "plain":
        c = random_controls(B, V, device, vocab_start=96, seed=31, density=0.5)
        kwargs.update(seed=torch.arange(B, device=device) + 40, logit_bias=c["logit_bias"],
                      sparse_logit_bias=c["sparse_logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=96)
    if case == "truncated":
        kwargs.update(top_k=torch.tensor([10, 6, 100, -1, 50, 0, 7, 20], device=device))  # >= k: no row runs out
    tokens = fs.sample_without_replacement(hidden, weight, k, **kwargs)
    assert tokens.shape == (B, k) and tokens.dtype == torch.int64
    assert all(len(set(row)) == k for row in tokens.tolist())
    assert torch.equal(tokens[:, :1], fs.sample(hidden, weight, **kwargs))
    ref = reference_sample_without_replacement(hidden, weight, k, **kwargs, rtol=RTOL)
    assert_matches_reference_top_k(tokens, ref)


def plackett_luce(probs, k):
    """{ordered k-tuple: probability} of Gumbel-top-k (sampling without replacement) of `probs` [V]."""
    out = {}
    for t in itertools.permutations(range(probs.numel()), k):
        p, left = 1.0, 1.0
        for i in t:
            p *= probs[i].item() / left
            left -= probs[i].item()
        out[t] = p
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_without_replacement_chi_square_plackett_luce(device):
    """Each row an independent draw (per-row seeds, same hidden): ordered triples, first
    positions and pair inclusions of k = 2 against the exact Plackett-Luce probabilities."""
    rows, vocab, temperature = 12_000, 7, 0.8
    hidden, weight = make_problem(rows, vocab, 8, dtype=torch.bfloat16, logit_std=1.5, seed=5, same_rows=True)
    hidden, weight = hidden.to(device), weight.to(device)
    probs = softmax_rows(hidden[:1].cpu().float(), weight.cpu().float(), temperature)[0]
    seeds = torch.arange(rows, device=device) * 3 + 1
    for k in (2, 3):
        tokens = fs.sample_without_replacement(hidden, weight, k, temperature=temperature, seed=seeds).cpu()
        assert (tokens.sort(dim=1).values.diff(dim=1) > 0).all(), "repeated token"
        ordered = plackett_luce(probs, k)
        index = {t: i for i, t in enumerate(ordered)}
        expected = torch.tensor(list(ordered.values()), dtype=torch.float64)
        observed = torch.tensor([index[tuple(t)] for t in tokens.tolist()])
        p_ordered = chi2.sf(*chi_square(observed, expected))
        p_first = chi2.sf(*chi_square(tokens[:, 0], probs))
        print(f"k = {k}: p(ordered) = {p_ordered:.3f}, p(first) = {p_first:.3f}")
        assert p_ordered > 1e-3 and p_first > 1e-3
        if k == 2:  # pair inclusion: each draw includes exactly one unordered pair
            pairs = list(itertools.combinations(range(vocab), 2))
            pair_probs = torch.tensor([ordered[(a, b)] + ordered[(b, a)] for a, b in pairs], dtype=torch.float64)
            pair_index = {pair: i for i, pair in enumerate(pairs)}
            observed_pairs = torch.tensor([pair_index[tuple(sorted(t))] for t in tokens.tolist()])
            assert chi2.sf(*chi_square(observed_pairs, pair_probs)) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_without_replacement_runs_out_of_allowed_tokens(device):
    hidden, weight = problem(3, 40, 8, device, seed=2)
    allowed = torch.ones(3, 40, dtype=torch.bool)
    allowed[1] = False
    allowed[1, [4, 9, 30]] = True  # row 1 allows three tokens
    allowed = allowed.to(device)
    with pytest.raises(ValueError, match=r"k = 4 exceeds the 3 allowed tokens .* pass empty_mask_token"):
        fs.sample_without_replacement(hidden, weight, 4, seed=1, allowed_mask=allowed)
    tokens = fs.sample_without_replacement(hidden, weight, 4, seed=1, allowed_mask=allowed, empty_mask_token=-5)
    assert sorted(tokens[1, :3].tolist()) == [4, 9, 30] and tokens[1, 3] == -5
    assert all(len(set(row)) == 4 and -5 not in row for row in tokens[[0, 2]].tolist())
    with pytest.raises(ValueError, match=r"k = 3 exceeds the 2 allowed tokens \(after top_k/top_p/min_p\)"):
        fs.sample_without_replacement(hidden, weight, 3, seed=1, top_k=2)
    for k in (0, 41, 2.0, True):
        with pytest.raises(ValueError, match=r"sample_without_replacement: k must be an int in \[1, V\] = \[1, 40\]"):
            fs.sample_without_replacement(hidden, weight, k, seed=1)
    with pytest.raises(ValueError, match=r"offset was given without seed"):
        fs.sample_without_replacement(hidden, weight, 2, offset=3)


@pytest.mark.parametrize("device", DEVICES)
def test_without_replacement_seed_from_generator(device):
    hidden, weight = problem(4, 300, 16, device, seed=6)
    draws = [fs.sample_without_replacement(hidden, weight, 5, generator=torch.Generator(device).manual_seed(3))
             for _ in range(2)]
    assert torch.equal(draws[0], draws[1])
    assert all(len(set(row)) == 5 for row in draws[0].tolist())
    torch.manual_seed(0)
    assert fs.sample_without_replacement(hidden, weight, 5).shape == (4, 5)


# ---------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_with_truncation(device):
    """The mask path has no host sync: it traces with fullgraph=True."""
    hidden, weight = problem(4, 300, 16, device, seed=12)
    c = random_controls(4, 300, device, seed=12, density=0.6)

    def decode_step(h, w, temps, seeds, top_k, top_p, allowed):
        return fs.sample(h, w, temperature=temps, seed=seeds, num_samples=3, top_k=top_k, top_p=top_p, min_p=0.01,
                         allowed_mask=allowed, empty_mask_token=-1, return_logprobs=True)

    args = (hidden, weight, torch.tensor([0.5, 1.0, 0.0, 2.0], device=device), torch.arange(4, device=device),
            torch.tensor([5, -1, 3, 40], device=device), torch.tensor([0.9, 0.5, 1.0, 0.8], device=device),
            c["allowed_bool"])
    got, expected = torch.compile(decode_step, fullgraph=True)(*args), decode_step(*args)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-5, atol=1e-5)
