"""The fused top-k pass (issue #5, csrc/kernels/truncate_candidates.cu): on the GPU,
``sample(..., top_k=k)`` with a host ``k <= 64`` keeps four candidates per vocabulary tile in
the GEMM's epilogue and truncates and samples in a second kernel. Pathwise against the
float64 reference and against the materialised path, on every tile config (B = 8, 40, 100, 200:
N = 16, 64, then 128: on sm90 the epilogue-warpgroup kernel, one column tile and a clustered
pair), the repair of tiles that hold more than four of the top-k (clustered and tied logits),
chi-square, CUDA-graph replay, empty rows, opcheck.
The CPU kernel of ``sample_top_k`` (the materialised path) is checked on the CPU too."""

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.reference import reference_sample
from sampling_stats import assert_matches_reference, assert_truncated_distribution, problem, random_controls

requires_cuda = pytest.mark.requires_cuda
V, D = 32768, 256
RTOL = 1e-4


def both_paths(hidden, weight, **kwargs):
    """(fused, materialised) outputs of sample_with_scores for the same arguments."""
    fused = fs.sample_with_scores(hidden, weight, truncation_path="fused_top_k", **kwargs)
    materialised = fs.sample_with_scores(hidden, weight, truncation_path="materialized", **kwargs)
    return fused, materialised


CASES = {
    "k50_temps": dict(top_k=50),
    "k50_p09_minp": dict(top_k=50, top_p=0.9, min_p=0.02),
    "k64_per_row_p": dict(top_k=64, top_p="rows", min_p="rows"),
    "k1": dict(top_k=1),
    "k20_controls": dict(top_k=20, top_p=0.8, controls=True),
}


@requires_cuda
@pytest.mark.parametrize("batch", [8, 40, 100, 200])  # N = 16, 64, then 128 (sm90: epilogue warpgroups)
@pytest.mark.parametrize("case", list(CASES))
def test_fused_top_k_matches_reference_and_materialised_path(case, batch):
    spec = dict(CASES[case])
    hidden, weight = problem(batch, V, D, "cuda", seed=batch + len(case))
    g = torch.Generator().manual_seed(batch)
    temps = torch.rand(batch, generator=g) * 1.5 + 0.3
    temps[::5] = 0.0  # greedy rows
    kwargs = dict(temperature=temps.cuda(), seed=77, offset=5, num_samples=4, top_k=spec["top_k"])
    for name in ("top_p", "min_p"):
        if spec.get(name) == "rows":
            upper = 1.0 if name == "top_p" else 0.2
            kwargs[name] = (torch.rand(batch, generator=g) * upper).cuda()
        elif name in spec:
            kwargs[name] = spec[name]
    if spec.get("controls"):
        c = random_controls(batch, V, "cuda", vocab_start=128, seed=batch, density=0.4)
        kwargs.update(logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"], vocab_start=128,
                      seed=torch.arange(batch, device="cuda") * 31 + 7, offset=torch.arange(batch, device="cuda"))
    fused, materialised = both_paths(hidden, weight, **kwargs, return_logprobs=True)
    ref = reference_sample(hidden, weight, **kwargs, rtol=RTOL)
    assert_matches_reference(fused.tokens, ref)
    assert_matches_reference(materialised.tokens, ref)
    same = fused.tokens == materialised.tokens
    assert same.float().mean() > 0.99
    # (the two paths run different GEMM kernels: x may differ in the last bits)
    torch.testing.assert_close(fused.scores[same], materialised.scores[same], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.logsumexp.double().cpu(), ref.logsumexp.cpu(), rtol=1e-4, atol=1e-4)
    ok = (fused.tokens.cpu() == ref.tokens.cpu())
    torch.testing.assert_close(fused.token_logprobs.double().cpu()[ok], ref.logprobs.cpu()[ok], rtol=1e-4, atol=1e-4)
    # The direct op gives the wrapper's tokens (the wrapper took the fused path).
    direct = torch.ops.flashsampling.sample_top_k(
        hidden, weight, temperature=1.0, temperatures=kwargs["temperature"], num_samples=4,
        seed=torch.tensor(77) if not spec.get("controls") else kwargs["seed"],
        offset=torch.tensor(5) if not spec.get("controls") else kwargs["offset"],
        logit_bias=kwargs.get("logit_bias"), allowed_mask=kwargs.get("allowed_mask"),
        vocab_start=kwargs.get("vocab_start", 0), top_k=spec["top_k"],
        top_p=kwargs["top_p"] if isinstance(kwargs.get("top_p"), float) else None,
        top_ps=kwargs["top_p"].double() if isinstance(kwargs.get("top_p"), torch.Tensor) else None,
        min_p=kwargs["min_p"] if isinstance(kwargs.get("min_p"), float) else None,
        min_ps=kwargs["min_p"].double() if isinstance(kwargs.get("min_p"), torch.Tensor) else None)
    assert torch.equal(direct[0], fused.tokens)


def clustered_problem(batch, device, *, tied=False):
    """Logits whose top tokens crowd a few vocabulary tiles (every tile there holds more than
    four of the top-k: the certificate fails and stage 2 recomputes them); `tied`: all equal."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(batch, D, generator=g)
    weight = torch.randn(V, D, generator=g) * (1.0 / D**0.5)
    if tied:
        weight.zero_()
    else:
        weight[200:330] = hidden[0] * (4.0 / hidden[0].norm() ** 2) + weight[200:330] * 0.3  # ~4 above the rest
    return hidden.bfloat16().to(device), weight.bfloat16().to(device)


@requires_cuda
@pytest.mark.parametrize("tied", [False, True], ids=["clustered", "tied"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_fused_repair_of_crowded_tiles(tied, temperature):
    hidden, weight = clustered_problem(12, "cuda", tied=tied)
    kwargs = dict(temperature=temperature, seed=5, num_samples=8, top_k=40, top_p=0.95, return_logprobs=True)
    fused, materialised = both_paths(hidden, weight, **kwargs)
    ref = reference_sample(hidden, weight, temperature, 5, 0, 8, top_k=40, top_p=0.95, rtol=RTOL)
    assert_matches_reference(fused.tokens, ref)
    assert (fused.tokens == materialised.tokens).float().mean() > 0.99
    if tied:  # all logits equal: the survivors are tokens 0 .. 39
        assert (fused.tokens < 40).all()


@requires_cuda
@pytest.mark.parametrize("top_k, top_p, min_p, temperature", [(10, None, None, 1.0), (30, 0.8, None, 0.8),
                                                              (64, 0.9, 0.05, 1.2)])
def test_fused_chi_square(top_k, top_p, min_p, temperature):
    batch, samples = 4, 20_000
    hidden, weight = problem(batch, 8192, 64, "cuda", logit_std=2.0, seed=top_k)
    trunc = dict(top_k=top_k, top_p=top_p, min_p=min_p)
    tokens = fs.sample(hidden, weight, temperature=temperature, seed=torch.arange(batch, device="cuda") + 3,
                       num_samples=samples, truncation_path="fused_top_k", **trunc).cpu()
    assert_truncated_distribution(tokens, hidden, weight, temperature, **trunc)


@requires_cuda
def test_fused_cuda_graph_replays_with_fresh_offsets():
    hidden, weight = problem(8, V, D, "cuda", seed=2)
    offset = torch.tensor(0, device="cuda")
    kwargs = dict(temperature=1.0, seed=torch.tensor(9, device="cuda"), top_k=50, top_p=0.9, num_samples=2,
                  truncation_path="fused_top_k")
    fs.sample(hidden, weight, offset=offset, **kwargs)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fs.sample(hidden, weight, offset=offset, **kwargs)
    seen = []
    for step in range(3):
        offset.fill_(step * 2)
        graph.replay()
        eager = fs.sample(hidden, weight, offset=torch.tensor(step * 2, device="cuda"), **kwargs)
        assert torch.equal(captured, eager)
        seen.append(captured.clone())
    assert not torch.equal(seen[0], seen[1])


@requires_cuda
def test_fused_rows_with_few_or_no_allowed_tokens():
    batch = 3
    hidden, weight = problem(batch, V, D, "cuda", seed=6)
    allowed = torch.zeros(batch, V, dtype=torch.bool)
    allowed[0] = True
    allowed[1, [5, 9000, 32000]] = True  # three tokens, fewer than top_k
    mask = fs.pack_allowed_mask(allowed).cuda()
    out = fs.sample_with_scores(hidden, weight, seed=1, num_samples=64, top_k=50, allowed_mask=mask,
                                empty_mask_token=-7, return_logprobs=True, truncation_path="fused_top_k")
    assert (out.tokens[2] == -7).all()
    assert torch.isin(out.tokens[1].cpu(), torch.tensor([5, 9000, 32000])).all()
    assert len(set(out.tokens[1].tolist())) > 1
    ref = reference_sample(hidden[:2], weight, 1.0, 1, 0, 64, allowed_mask=mask[:2], top_k=50, rtol=RTOL)
    assert_matches_reference(out.tokens[:2], ref)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_sample_top_k_opcheck(device):
    hidden, weight = problem(4, 5000, 64, device, seed=1)
    kwargs = dict(seed=torch.tensor(3), top_k=20, top_p=0.9, min_ps=torch.full((4,), 0.01, device=device,
                  dtype=torch.float64), return_logprobs=True)
    torch.library.opcheck(torch.ops.flashsampling.sample_top_k.default, (hidden, weight), kwargs)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_sample_top_k_argument_errors(device):
    hidden, weight = problem(4, 5000, 64, device, seed=1)
    with pytest.raises(RuntimeError, match="top_k must be an integer >= -1"):
        torch.ops.flashsampling.sample_top_k(hidden, weight, seed=torch.tensor(1), top_k=-2)
    with pytest.raises(RuntimeError, match="top_ks must be an int32 or int64"):
        torch.ops.flashsampling.sample_top_k(hidden, weight, seed=torch.tensor(1), top_ks=torch.ones(4, device=device))
    if device == "cuda":
        with pytest.raises(RuntimeError, match="top_ps must be a float32 or float64"):
            torch.ops.flashsampling.sample_top_k(hidden, weight, seed=torch.tensor(1), top_k=5,
                                                 top_ps=torch.ones(4, device=device, dtype=torch.int64))
        with pytest.raises(RuntimeError, match=r"min_ps must have shape \[B\]"):
            torch.ops.flashsampling.sample_top_k(hidden, weight, seed=torch.tensor(1), top_k=5,
                                                 min_ps=torch.ones(3, device=device, dtype=torch.float64))
