"""Repetition / frequency / presence penalties and the model-side logit transforms
(flashsampling_cuda/penalties.py): the token history (PenaltyState) against a dense recount,
pathwise samples against the float64 reference (reference_logit_transform), bit-exact agreement of
the routes and with plain sampling where everything is off, a chi-square of the penalised
distribution, argument errors. CPU always; CUDA where there is a GPU."""

import math

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda import PenaltyState
from flashsampling_cuda.reference import reference_logit_transform, reference_sample
from sampling_stats import problem, assert_matches_reference, chi_square_pvalue

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def histories(batch, vocab, seed=0, prompt_len=30, output_len=20):
    g = torch.Generator().manual_seed(seed + 1)
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=g)
    output = torch.randint(0, vocab // 4, (batch, output_len), generator=g)  # repeats
    prompt[0, 5:] = -1  # padding
    output[1] = -1
    return prompt, output


def dense_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab, dtype=torch.int64)
    for b, row in enumerate(ids.tolist()):
        for t in row:
            if t >= 0:
                counts[b, t] += 1
    return counts


def state_tables(state: PenaltyState, vocab: int):
    seen = torch.zeros(state.batch, vocab, dtype=torch.bool)
    counts = torch.zeros(state.batch, vocab, dtype=torch.int64)
    prompt = torch.zeros(state.batch, vocab, dtype=torch.bool)
    for b in range(state.batch):
        for slot in range(state.capacity):
            t = int(state.ids[b, slot])
            if t >= 0:
                assert not seen[b, t], "an id twice in a row's slots"
                seen[b, t] = True
                counts[b, t] = int(state.output_counts[b, slot])
                prompt[b, t] = bool(state.in_prompt[b, slot])
    return seen, counts, prompt


@pytest.mark.parametrize("device", DEVICES)
def test_state_matches_a_dense_recount_through_updates(device):
    vocab = 300
    prompt, output = histories(6, vocab)
    state = PenaltyState(prompt.to(device), output.to(device), capacity=128)
    g = torch.Generator().manual_seed(5)
    outputs = [output]
    for _ in range(15):
        step = torch.randint(-1, vocab // 3, (6,), generator=g)  # -1: a finished row
        state.update(step.to(device))
        outputs.append(step[:, None])
    everything = torch.cat(outputs, dim=1)
    seen, counts, in_prompt = state_tables(state, vocab)
    want_counts = dense_counts(everything, vocab)
    want_prompt = dense_counts(prompt, vocab) > 0
    assert torch.equal(counts, want_counts)
    assert torch.equal(in_prompt, want_prompt)
    assert torch.equal(seen, want_prompt | (want_counts > 0))
    assert torch.equal(state.size.cpu(), seen.sum(dim=1))
    assert not state.overflowed.any()
    state.check()


def test_state_overflow_is_flagged_not_silent():
    state = PenaltyState([[1, 2, 3]], capacity=4)
    state.update(torch.tensor([4]))
    assert not state.overflowed.any()
    state.update(torch.tensor([5]))  # a fifth distinct id
    assert state.overflowed.tolist() == [True]
    with pytest.raises(RuntimeError, match="capacity=4"):
        state.check()
    assert PenaltyState([[1, 2, 3, 4, 5]], capacity=2).overflowed.tolist() == [True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["repetition", "frequency", "presence", "frequency_presence", "all_per_row",
                                  "masked", "softcap_scale", "everything"])
def test_pathwise_against_float64_reference(device, case):
    """Each penalty alone and together, host and per-row values, with the mask and with
    truncation, against the float64 reference. The histories have padded rows, repeated ids and
    a row with none at all (row 3)."""
    batch, vocab, dim = 12, 3001, 64
    hidden, weight = problem(batch, vocab, dim, device, seed=3, logit_std=2.0)
    prompt, output = histories(batch, vocab)
    prompt[3] = -1
    output[3] = -1
    per_row = torch.linspace(0.5, 2.0, batch)
    args = {
        "repetition": dict(repetition_penalty=1.3),
        "frequency": dict(frequency_penalty=0.7),
        "presence": dict(presence_penalty=torch.linspace(-1.0, 1.0, batch)),
        "frequency_presence": dict(frequency_penalty=0.7, presence_penalty=0.4),
        "masked": dict(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.2),
        "all_per_row": dict(repetition_penalty=per_row, frequency_penalty=per_row - 0.5, presence_penalty=-0.2),
        "softcap_scale": dict(logit_scale=3.0, logit_softcap=5.0),
        "everything": dict(logit_scale=0.5, logit_softcap=8.0, repetition_penalty=1.1, frequency_penalty=0.3,
                           presence_penalty=0.3),
    }[case]
    bias = torch.randn(vocab, generator=torch.Generator().manual_seed(2))
    controls = dict(temperature=0.8, seed=11, offset=3, num_samples=3, logit_bias=bias.to(device))
    if case == "everything":
        controls.update(top_k=torch.full((batch,), 200), top_p=0.95, min_p=0.01)
    if case == "masked":  # a mask that keeps a third of the tokens, some of them penalised
        allowed = torch.rand(batch, vocab, generator=torch.Generator().manual_seed(5)) < 0.33
        allowed[:, output[0, :5].clamp(min=0)] = True
        controls.update(allowed_mask=fs.pack_allowed_mask(allowed).to(device))
    out = fs.sample(hidden, weight, **controls, **args, prompt_token_ids=prompt.to(device),
                    output_token_ids=output.to(device), return_logprobs=True)
    penalties = {k: v for k, v in args.items() if k.endswith("penalty")}
    transform = reference_logit_transform(batch, vocab, logit_scale=args.get("logit_scale", 1.0),
                                          logit_softcap=args.get("logit_softcap"), prompt_token_ids=prompt,
                                          output_token_ids=output, device=device, **penalties)
    ref = reference_sample(hidden, weight, **{k: v for k, v in controls.items()}, logit_transform=transform)
    assert_matches_reference(out.tokens, ref)
    same = out.tokens.cpu() == ref.tokens.cpu()
    assert torch.allclose(out.logprobs.cpu()[same], ref.logprobs.cpu().float()[same], atol=2e-4, rtol=1e-4)


def test_rows_without_penalties_get_the_plain_tokens_bit_for_bit():
    """CPU: the logits route computes the op's own logits, so a row whose penalties are off
    gets the token and score of plain sampling, bit for bit."""
    batch, vocab, dim = 16, 2000, 64
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=4, logit_std=2.0)
    prompt, output = histories(batch, vocab)
    rep = torch.ones(batch)
    rep[::3] = 1.5
    freq = torch.zeros(batch)
    freq[::3] = 0.5
    kwargs = dict(temperature=torch.rand(batch) + 0.3, seed=torch.arange(batch), offset=7, top_p=0.9)
    plain = fs.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
    penalized = fs.sample_with_scores(hidden, weight, **kwargs, repetition_penalty=rep, frequency_penalty=freq,
                                      prompt_token_ids=prompt, output_token_ids=output, return_logprobs=True)
    off = rep == 1
    assert torch.equal(plain.tokens[off], penalized.tokens[off])
    assert torch.equal(plain.scores[off].view(torch.int32), penalized.scores[off].view(torch.int32))
    assert torch.equal(plain.logsumexp[off].view(torch.int32), penalized.logsumexp[off].view(torch.int32))
    assert (plain.logsumexp[~off] != penalized.logsumexp[~off]).any()  # the penalties did change rows


def logits_route(hidden, weight, return_logprobs=False, **kwargs):
    """``fs.sample_with_scores`` of the same call forced onto the logits route (fp32 logits, the
    rule in torch ops, then sample_from_logits): what the fused op must match bit for bit."""
    from flashsampling_cuda.sampling import LogitTransforms, _scored_sample

    transforms = LogitTransforms(**{k: kwargs.pop(k) for k in list(kwargs) if k in LogitTransforms._fields})
    args = dict(temperature=1.0, generator=None, seed=None, offset=None, num_samples=1, logit_bias=None,
                sparse_logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0, top_k=None,
                top_p=None, min_p=None, truncation_path="auto", truncation_order="top_k_first")
    args.update(kwargs)
    out, route = _scored_sample(hidden, weight, args, transforms, return_logprobs, False, logits_wanted=True)
    assert route["op"] == "sample_from_logits"
    return out


def fused_route_kwargs(hidden, weight, **kwargs):
    """The fused op's keyword arguments for a call (asserting that it takes the fused op)."""
    from flashsampling_cuda.sampling import LogitTransforms, _op_kwargs

    transforms = LogitTransforms(**{k: kwargs.pop(k) for k in list(kwargs) if k in LogitTransforms._fields})
    route: dict = {}
    args = dict(temperature=1.0, generator=None, seed=None, offset=None, num_samples=1, logit_bias=None,
                sparse_logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0)
    args.update(kwargs)
    op_kwargs = _op_kwargs(hidden, weight, **args, route=route, transforms=transforms)
    assert route == {}, route
    return op_kwargs


def assert_same_bits(a, b, logprobs_exact=False):
    assert torch.equal(a.tokens, b.tokens)
    assert torch.equal(a.scores.view(torch.int32), b.scores.view(torch.int32))
    if a.token_logprobs.numel():
        if logprobs_exact:
            assert torch.equal(a.token_logprobs.view(torch.int32), b.token_logprobs.view(torch.int32))
        else:
            torch.testing.assert_close(a.token_logprobs, b.token_logprobs, rtol=1e-5, atol=1e-5)


PENALTY_CASES = {
    "repetition": dict(repetition_penalty=1.3),
    "repetition_below_one": dict(repetition_penalty=0.7),
    "frequency": dict(frequency_penalty=0.9),
    "presence": dict(presence_penalty=-1.5),
    "all": dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.6),
    "all_per_row": "per_row",
    "all_with_scale_softcap": dict(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.6,
                                   logit_scale=0.5, logit_softcap=4.0),
}


def penalty_case(case, batch):
    if case == "per_row":
        g = torch.Generator().manual_seed(9)
        rep = torch.rand(batch, generator=g) + 0.5
        rep[::4] = 1.0  # rows with the repetition penalty off
        freq = torch.randn(batch, generator=g)
        freq[1::5] = 0.0
        return dict(repetition_penalty=rep, frequency_penalty=freq, presence_penalty=torch.tensor(0.3))
    return dict(case)


@pytest.mark.parametrize("controls", ["plain", "bias_mask_sparse", "per_row_keys_samples"])
@pytest.mark.parametrize("case", list(PENALTY_CASES))
def test_fused_and_logits_routes_agree_bit_for_bit(case, controls):
    """CPU: every penalty alone and together (host and per-row [B] values, with scale and
    soft-cap) runs in the fused op, after the biases, with the logits route's arithmetic: the fused
    call and the same call on the logits route give the same tokens and scores bit for bit, with
    dense and sparse bias, the mask, per-row T with greedy rows, per-row seeds and several samples.
    The history has padded rows, an empty row and ids repeated in prompt and output."""
    from test_controls import random_controls

    batch, vocab, dim = 10, 4000, 64
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=6, logit_std=3.0)
    prompt, output = histories(batch, vocab, seed=2, prompt_len=300, output_len=200)
    prompt[2] = -1  # row 2: no prompt, only output tokens
    state = PenaltyState(prompt, output, capacity=600)
    args = penalty_case(PENALTY_CASES[case], batch)
    kwargs = dict(temperature=0.7, seed=5, penalty_state=state)
    if controls != "plain":
        c = random_controls(batch, vocab, "cpu", seed=3, density=0.7)
        temperature = torch.rand(batch, generator=torch.Generator().manual_seed(1)) + 0.3
        temperature[::4] = 0.0  # greedy rows
        ids = torch.cat([output[:, :6], torch.randint(0, vocab, (batch, 4))], dim=1)  # seen ids among them
        kwargs.update(temperature=temperature, logit_bias=c["logit_bias"], allowed_mask=c["allowed_mask"],
                      sparse_logit_bias=(ids, torch.randn(batch, 10)))
    if controls == "per_row_keys_samples":
        kwargs.update(seed=torch.arange(batch) * 7 + 1, offset=torch.tensor(3), num_samples=3)
    op_kwargs = fused_route_kwargs(hidden, weight, **kwargs, **args)
    assert op_kwargs["penalty_ids"] is state.ids
    assert ("repetition_penalties" in op_kwargs) == ("repetition_penalty" in args)
    for return_logprobs in (False, True):
        fused = fs.sample_with_scores(hidden, weight, **kwargs, **args, return_logprobs=return_logprobs)
        routed = logits_route(hidden, weight, **kwargs, **args, return_logprobs=return_logprobs)
        assert_same_bits(fused, routed)
    off = fs.sample_with_scores(hidden, weight, **kwargs)
    assert not torch.equal(fused.tokens, off.tokens) or (fused.scores != off.scores).any()  # they did apply


def test_fused_penalties_equal_the_cpu_op_on_penalised_logits():
    """CPU: the fused op with penalties gives the tokens, scores and log-probabilities of the CPU
    op (_sample_logits) on the penalised materialised logits (penalties.rule_logits), bit for bit:
    one op, two inputs (what tests/test_sample_cuda.py compares the CUDA epilogue against)."""
    from flashsampling_cuda.penalties import parse_penalties, rule_logits

    batch, vocab, dim = 7, 2500, 32
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=2, logit_std=3.0)
    state = PenaltyState(*histories(batch, vocab, seed=4, prompt_len=100, output_len=80), capacity=256)
    args = dict(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2)
    fused = fs.sample_with_scores(hidden, weight, temperature=0.9, seed=3, penalty_state=state, **args,
                                  return_logprobs=True)
    penalties = parse_penalties(*args.values(), state, None, None, hidden)
    x = rule_logits(torch.ops.flashsampling._logits(hidden, weight), None, None, None, 0, 1.0, None, penalties)
    materialized = torch.ops.flashsampling._sample_logits(x, temperature=0.9, seed=torch.tensor(3),
                                                          return_logprobs=True)
    for got, expected in zip(fused, materialized):
        assert torch.equal(got.view(torch.int32) if got.is_floating_point() else got,
                           expected.view(torch.int32) if expected.is_floating_point() else expected)


def test_fused_penalties_overflowed_state_and_vocab_shard():
    """CPU: an overflowed state (its recorded ids still penalised), ids beyond a shard's
    vocabulary (vocab_start > 0: other shards' ids ignored) and a state without any id: the
    fused op equals the logits route bit for bit."""
    batch, vocab, dim = 6, 1500, 32
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=5, logit_std=3.0)
    state = PenaltyState(*histories(batch, 3 * vocab, seed=1, prompt_len=60, output_len=40), capacity=40)
    assert state.overflowed.any()
    args = dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5, penalty_state=state)
    for vocab_start in (0, vocab, 2 * vocab):
        kwargs = dict(temperature=0.8, seed=4, vocab_start=vocab_start, **args)
        assert_same_bits(fs.sample_with_scores(hidden, weight, **kwargs), logits_route(hidden, weight, **kwargs))
    empty = PenaltyState(batch=batch, capacity=8)
    kwargs = dict(temperature=0.8, seed=4, repetition_penalty=1.5, frequency_penalty=0.5, penalty_state=empty)
    assert_same_bits(fs.sample_with_scores(hidden, weight, **kwargs),
                     fs.sample_with_scores(hidden, weight, temperature=0.8, seed=4))


def test_multi_step_decode_fused_equals_logits_route():
    """CPU: a decode of 10 steps with all three penalties (per-row repetition), each step's tokens
    recorded by PenaltyState.update on two copies of the state: the fused op and the logits route
    give the same token streams bit for bit."""
    batch, vocab, dim = 8, 1200, 32
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=9, logit_std=2.0)
    prompt, output = histories(batch, vocab, seed=5, prompt_len=50, output_len=0)
    fused_state = PenaltyState(prompt, capacity=128)
    routed_state = PenaltyState(prompt, capacity=128)
    args = dict(temperature=0.8, repetition_penalty=torch.linspace(0.8, 1.6, batch), frequency_penalty=0.4,
                presence_penalty=0.3)
    for step in range(10):
        fused = fs.sample_with_scores(hidden, weight, **args, seed=3, offset=step, penalty_state=fused_state)
        routed = logits_route(hidden, weight, **args, seed=3, offset=step, penalty_state=routed_state)
        assert_same_bits(fused, routed)
        fused_state.update(fused.tokens)
        routed_state.update(routed.tokens)
    assert torch.equal(fused_state.output_counts, routed_state.output_counts)
    assert int(fused_state.output_counts.max()) >= 2  # a token was sampled again, penalised by its count


def test_fused_penalties_signed_zeros_and_specials():
    """CPU: the penalty arithmetic on logits of +-0, +-inf and huge values (x > 0 divides, else
    multiplies; a -0.0 add leaves x as it is) is the logits route's, bit for bit: greedy scores
    are the penalised logits themselves."""
    batch, vocab = 4, 64
    logits = torch.randn(batch, vocab) * 3
    logits[:, 0] = 0.0
    logits[:, 1] = -0.0
    logits[:, 2] = 3e38
    logits[:, 3] = -3e38
    logits[0, 4] = float("inf")
    # hidden = identity rows: the raw logits are exactly these (fp32 matmul with one term each)
    hidden = logits.clone()
    weight = torch.eye(vocab)
    state = PenaltyState([[0, 1, 2, 3, 4, 10, 11]] * batch, [[1, 10, 10], [2], [-1], [3, 3, 3]], capacity=16)
    for args in (dict(repetition_penalty=2.0), dict(frequency_penalty=0.0, presence_penalty=0.0 + 1e-30),
                 dict(repetition_penalty=0.5, frequency_penalty=-2.0)):
        for t in range(vocab):  # each token in turn the only allowed one: its greedy score is its x
            mask = torch.zeros(batch, 2, dtype=torch.int32)
            mask[:, t // 32] = 1 << (t % 32) if t % 32 != 31 else -(1 << 31)
            kwargs = dict(temperature=0.0, allowed_mask=mask, penalty_state=state, **args)
            assert_same_bits(fs.sample_with_scores(hidden, weight, **kwargs),
                             logits_route(hidden, weight, **kwargs))


# The model-side transforms alone (no penalties, no truncation, no logprob outputs) run in the
# fused op: its CUDA epilogue, its CPU transform pass.
MODEL_TRANSFORMS = [dict(logit_softcap=30.0), dict(logit_scale=0.25), dict(logit_scale=3.0, logit_softcap=5.0),
                    dict(logit_scale=0.5, logit_softcap=2.0)]


def test_model_transforms_alone_take_the_fused_op():
    from flashsampling_cuda.sampling import LogitTransforms, _op_kwargs

    hidden, weight = problem(3, 500, 16, "cpu", logit_std=2.0)

    def route_of(transforms, **extra):
        route: dict = {}
        kwargs = _op_kwargs(hidden, weight, 0.8, None, 5, None, 1, None, None, None, None, 0, route=route,
                            transforms=transforms, **extra)
        return kwargs, route

    kwargs, route = route_of(LogitTransforms(logit_scale=0.5, logit_softcap=30.0))
    assert route == {} and kwargs["logit_scale"] == 0.5 and kwargs["logit_softcap"] == 30.0
    kwargs, route = route_of(LogitTransforms())  # off: today's call, no new arguments
    assert route == {} and "logit_scale" not in kwargs and "logit_softcap" not in kwargs
    state = PenaltyState([[1, 2]] * 3, capacity=16)  # the penalties stay fused with them
    kwargs, route = route_of(LogitTransforms(logit_softcap=30.0, frequency_penalty=0.5, penalty_state=state))
    assert route == {} and kwargs["logit_softcap"] == 30.0 and kwargs["sparse_bias_ids"] is None
    assert kwargs["penalty_ids"] is state.ids and "repetition_penalties" not in kwargs
    kwargs, route = route_of(LogitTransforms(logit_softcap=30.0, repetition_penalty=1.2, penalty_state=state))
    assert route == {} and kwargs["repetition_penalties"].tolist() == [1.2000000476837158] * 3
    assert "penalty_values" not in kwargs
    long_history = PenaltyState([list(range(3000))] * 3)  # any capacity: no sparse-bias scan any more
    kwargs, route = route_of(LogitTransforms(presence_penalty=0.5, penalty_state=long_history))
    assert route == {} and kwargs["penalty_values"].shape == (3, long_history.capacity)
    # truncation and the logprob outputs read the logits: the logits route
    for transforms in (LogitTransforms(logit_softcap=30.0), LogitTransforms(repetition_penalty=1.2,
                                                                            penalty_state=state)):
        _, route = route_of(transforms, top_k=5)
        assert route["op"] == "sample_from_logits"
        _, route = route_of(transforms, logits_wanted=True)
        assert route["op"] == "sample_from_logits"


@pytest.mark.parametrize("transforms", MODEL_TRANSFORMS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
def test_model_transforms_fused_op_equals_logits_route_bit_for_bit(transforms):
    """CPU: the fused op applies the scale and soft-cap in its transform pass with the logits
    route's function (_model_logits, philox_gumbel.h's fs_model_logit): the fused call, the same
    call on the logits route (logits_route) and the CPU op on
    the transformed materialised logits give the same tokens and scores bit for bit (and, on the
    same op, the same log-probabilities), with bias, mask, per-row T with greedy rows, per-row
    seeds and several samples."""
    from test_controls import random_controls

    batch, vocab, dim = 13, 3001, 64
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=8, logit_std=20.0)  # beyond the caps
    c = random_controls(batch, vocab, "cpu", seed=3, density=0.6)
    temperature = torch.rand(batch, generator=torch.Generator().manual_seed(1)) + 0.3
    temperature[::4] = 0.0  # greedy rows
    for seeding in (dict(seed=7, offset=2), dict(seed=torch.arange(batch) * 3 + 1, offset=torch.tensor(5))):
        kwargs = dict(temperature=temperature, num_samples=2, logit_bias=c["logit_bias"],
                      allowed_mask=c["allowed_mask"], **seeding)
        fused = fs.sample_with_scores(hidden, weight, **kwargs, **transforms, return_logprobs=True)
        untransformed = fs.sample_with_scores(hidden, weight, **kwargs, return_logprobs=True)
        assert (fused.logsumexp != untransformed.logsumexp).all()  # the transforms did apply
        routed = logits_route(hidden, weight, **kwargs, **transforms, return_logprobs=True)
        assert torch.equal(fused.tokens, routed.tokens)
        assert torch.equal(fused.scores.view(torch.int32), routed.scores.view(torch.int32))
        torch.testing.assert_close(fused.token_logprobs, routed.token_logprobs, rtol=1e-5, atol=1e-5)
        logits = torch.ops.flashsampling._model_logits(torch.ops.flashsampling._logits(hidden, weight),
                                                       transforms.get("logit_scale", 1.0),
                                                       transforms.get("logit_softcap"))
        op_kwargs = dict(kwargs, seed=torch.as_tensor(kwargs["seed"]), offset=torch.as_tensor(kwargs["offset"]))
        op_kwargs["temperatures"] = op_kwargs.pop("temperature")
        materialized = torch.ops.flashsampling._sample_logits(logits, **op_kwargs, return_logprobs=True)
        for got, expected in zip(fused, materialized):
            assert torch.equal(got.view(torch.int32) if got.is_floating_point() else got,
                               expected.view(torch.int32) if expected.is_floating_point() else expected)


def test_soft_cap_with_frequency_and_presence_fused_equals_logits_route():
    """Frequency and presence (and the repetition penalty) stay on the fused op with a soft-cap,
    after it and the bias, as the rule orders them: bit for bit with the logits route (CPU)."""
    batch, vocab, dim = 10, 4000, 64
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=6, logit_std=8.0)
    state = PenaltyState(*histories(batch, vocab, seed=2), capacity=2048)
    kwargs = dict(temperature=0.7, seed=5, frequency_penalty=0.9, presence_penalty=1.5, penalty_state=state,
                  logit_bias=torch.randn(vocab), logit_scale=0.5, logit_softcap=4.0)
    for extra in ({}, dict(repetition_penalty=1.3)):
        fused = fs.sample_with_scores(hidden, weight, **kwargs, **extra, return_logprobs=True)
        routed = logits_route(hidden, weight, **kwargs, **extra, return_logprobs=True)
        assert_same_bits(fused, routed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transforms", MODEL_TRANSFORMS, ids=lambda t: "-".join(f"{k}={v}" for k, v in t.items()))
def test_model_transforms_pathwise_against_float64_reference(device, transforms):
    """The fused op with scale / soft-cap, per-row T with greedy rows, bias and mask: pathwise
    against the float64 reference (torch.tanh in float64), log-probabilities close."""
    from test_controls import random_controls

    batch, vocab, dim = 24, 5000, 64
    hidden, weight = problem(batch, vocab, dim, device, seed=12, logit_std=20.0)
    c = random_controls(batch, vocab, device, seed=4, density=0.6)
    temperature = torch.rand(batch, generator=torch.Generator().manual_seed(2)) + 0.3
    temperature[::5] = 0.0
    kwargs = dict(temperature=temperature.to(device), seed=21, offset=4, logit_bias=c["logit_bias"],
                  allowed_mask=c["allowed_mask"])
    out = fs.sample(hidden, weight, **kwargs, **transforms, return_logprobs=True)
    transform = reference_logit_transform(batch, vocab, device=device, **transforms)
    ref = reference_sample(hidden, weight, **kwargs, logit_transform=transform)
    assert_matches_reference(out.tokens, ref)
    same = out.tokens.cpu() == ref.tokens.cpu()
    assert torch.allclose(out.logprobs.cpu()[same], ref.logprobs.cpu().float()[same], atol=2e-4, rtol=1e-4)


def test_penalised_distribution_chi_square():
    """Many samples of one small row: the empirical distribution is the softmax of the
    penalised, soft-capped logits (float64), chi-square p > 1e-3 (fixed seed)."""
    vocab, dim, draws = 40, 32, 20000
    hidden, weight = problem(1, vocab, dim, "cpu", seed=9, logit_std=2.0)
    prompt, output = [[1, 2, 3, 4]], [[2, 2, 5, 7, 7, 7]]
    args = dict(logit_softcap=3.0, repetition_penalty=1.7, frequency_penalty=0.3, presence_penalty=0.5)
    tokens = fs.sample(hidden, weight, temperature=0.9, seed=2024, num_samples=draws, **args,
                       prompt_token_ids=prompt, output_token_ids=output)
    transform = reference_logit_transform(1, vocab, logit_softcap=3.0, repetition_penalty=1.7, frequency_penalty=0.3,
                                          presence_penalty=0.5, prompt_token_ids=prompt, output_token_ids=output)
    x = hidden.double() @ weight.double().T
    x = 3.0 * torch.tanh(x / 3.0)
    r = 1.7
    x = torch.where(transform.seen, torch.where(x > 0, x / r, x * r), x)
    x = x - 0.3 * transform.counts - 0.5 * (transform.counts > 0)
    probs = torch.softmax(x[0] / 0.9, dim=0)
    assert chi_square_pvalue([tokens[0]], [probs]) > 1e-3


def test_graph_safe_decode_step_on_cpu_compiles():
    """A decode step (sample with penalties, then update the state) traces with
    torch.compile(fullgraph=True): no host sync on the route."""
    batch, vocab, dim = 4, 500, 32
    hidden, weight = problem(batch, vocab, dim, "cpu", seed=1, logit_std=2.0)
    eager_state = PenaltyState([[1, 2]] * batch, capacity=16)
    compiled_state = PenaltyState([[1, 2]] * batch, capacity=16)

    def step(h, offset, state):
        tokens = fs.sample(h, weight, seed=3, offset=offset, repetition_penalty=1.2, frequency_penalty=0.1,
                           presence_penalty=0.5, penalty_state=state)
        state.update(tokens)
        return tokens

    compiled = torch.compile(step, fullgraph=True)
    for offset in range(3):
        assert torch.equal(compiled(hidden, offset, compiled_state), step(hidden, offset, eager_state))
    for name in ("ids", "output_counts", "in_prompt", "size", "overflowed"):
        assert torch.equal(getattr(compiled_state, name), getattr(eager_state, name)), name


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("truncated", [False, True])
def test_decode_step_in_a_cuda_graph_and_compiled_equals_eager(truncated):
    """A decode step (sample with the three penalties, then update the state) captured in a CUDA
    graph, and compiled with fullgraph=True, gives eager's tokens and state step after step (the
    fused route, and the logits route that truncation takes)."""
    batch, vocab, dim = 8, 8192, 256
    hidden, weight = problem(batch, vocab, dim, "cuda", seed=2, logit_std=3.0)
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    prompt, _ = histories(batch, vocab, seed=5)
    extra = dict(top_p=torch.full((batch,), 0.9, device="cuda")) if truncated else {}
    offset = torch.zeros((), dtype=torch.int64, device="cuda")
    h = hidden.clone()

    def step(state):
        tokens = fs.sample(h, weight, seed=9, offset=offset, temperature=0.8, repetition_penalty=1.3,
                           frequency_penalty=0.4, presence_penalty=0.6, penalty_state=state, **extra)
        state.update(tokens)
        return tokens

    states = {k: PenaltyState(prompt.cuda(), capacity=96) for k in ("eager", "graph", "compiled")}
    step(PenaltyState(prompt.cuda(), capacity=96))  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(states["graph"])
    compiled = torch.compile(step, fullgraph=True)
    for i in range(4):
        h.copy_(hidden.roll(i, dims=0))
        offset.fill_(i)
        want = step(states["eager"])
        graph.replay()
        assert torch.equal(captured, want), i
        assert torch.equal(compiled(states["compiled"]), want), i
    for name in ("ids", "output_counts", "in_prompt", "size", "overflowed"):
        assert torch.equal(states["graph"].__dict__[name], states["eager"].__dict__[name]), name
        assert torch.equal(states["compiled"].__dict__[name], states["eager"].__dict__[name]), name


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(repetition_penalty=0.0, prompt_token_ids=[[1]]), ValueError, "repetition_penalty"),
    (dict(repetition_penalty="1.2", prompt_token_ids=[[1]]), TypeError, "repetition_penalty"),
    (dict(frequency_penalty=math.nan, prompt_token_ids=[[1]]), ValueError, "frequency_penalty"),
    (dict(presence_penalty=torch.ones(3), prompt_token_ids=[[1]]), ValueError, "presence_penalty"),
    (dict(frequency_penalty=0.5), ValueError, "penalty_state"),
    (dict(frequency_penalty=0.5, penalty_state=PenaltyState([[1], [2]])), ValueError, "penalty_state"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap"),
    (dict(logit_scale=0.0), ValueError, "logit_scale"),
    (dict(logit_softcap=30.0, top_k=5, truncation_path="fused_top_k"), ValueError, "truncation_path"),
    (dict(logit_softcap=30.0, truncation_path="fused_top_k"), ValueError, "truncation_path"),
    (dict(frequency_penalty=0.5, prompt_token_ids=torch.ones(1, 2)), TypeError, "prompt_token_ids"),
])
def test_bad_arguments_name_themselves(kwargs, error, match):
    hidden, weight = problem(1, 100, 16, "cpu", logit_std=2.0)
    with pytest.raises(error, match=match):
        fs.sample(hidden, weight, **kwargs)


def test_history_ids_beyond_the_vocabulary_name_themselves():
    with pytest.raises(ValueError, match="output_token_ids holds id 100, beyond vocab_size=100"):
        PenaltyState([[1]], [[100]], vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        PenaltyState([[1]], vocab_size=0)
    assert PenaltyState([[1, 99]], [[-1]], vocab_size=100).size.tolist() == [2]


def test_sample_histories_beyond_the_vocabulary_name_themselves():
    """Histories given on the host to a call on the whole vocabulary must hold its ids; a
    shard's (vocab_start > 0) may hold other shards' ids, which penalise nothing there."""
    hidden, weight = problem(2, 100, 16, "cpu", logit_std=2.0)
    with pytest.raises(ValueError, match=r"prompt_token_ids holds id 1000, beyond the vocabulary \[0, 100\)"):
        fs.sample(hidden, weight, repetition_penalty=1.2, prompt_token_ids=[[1000, 5], [1]])
    with pytest.raises(ValueError, match=r"output_token_ids holds id 100, beyond the vocabulary \[0, 100\)"):
        fs.sample(hidden, weight, presence_penalty=0.5, output_token_ids=torch.tensor([[3, -1], [100, 2]]))
    kwargs = dict(vocab_start=50, seed=3, repetition_penalty=1.2)
    shard = fs.sample(hidden, weight, **kwargs, prompt_token_ids=[[1000, 55], [60]])
    assert torch.equal(shard, fs.sample(hidden, weight, **kwargs, penalty_state=PenaltyState([[1000, 55], [60]])))


def test_load_refills_in_place():
    """load_ keeps every tensor of the state (a captured CUDA graph reads them) and gives the state
    of a fresh construction with the new history."""
    state = PenaltyState([[1, 2, 2]], [[5]], capacity=8, vocab_size=100)
    pointers = [getattr(state, n).data_ptr() for n in ("ids", "output_counts", "in_prompt", "size", "overflowed")]
    state.load_([[7, -1, 7]], [[3, 3]])
    fresh = PenaltyState([[7, -1, 7]], [[3, 3]], capacity=8)
    for name, pointer in zip(("ids", "output_counts", "in_prompt", "size", "overflowed"), pointers):
        assert getattr(state, name).data_ptr() == pointer, name
        assert torch.equal(getattr(state, name), getattr(fresh, name)), name
    with pytest.raises(ValueError, match="beyond vocab_size=100"):
        state.load_([[100]])


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("frequency, presence", [(0.3, None), (None, -0.7), (0.3, 0.2), ("rows", "rows"),
                                                 (-1.5, "rows"), (0.0, 0.0)])
def test_penalty_values_kernel_equals_its_torch_ops(frequency, presence):
    """flashsampling._penalty_values (CUDA's step-3 values, one kernel) gives penalty_values' bits
    (torch ops; the CPU's): host and [B] values, negative and zero penalties, free slots,
    prompt-only tokens (count 0), a signed zero where nothing is added."""
    from flashsampling_cuda.penalties import Penalties, penalty_values

    batch, vocab = 6, 500
    prompt, output = histories(batch, vocab, seed=4)
    state = PenaltyState(prompt.cuda(), output.cuda(), capacity=64)
    g = torch.Generator().manual_seed(3)
    rows = lambda: (torch.randn(batch, generator=g) * 2).cuda()  # noqa: E731
    f = rows() if frequency == "rows" else frequency
    p = rows() if presence == "rows" else presence
    penalties = Penalties(None, f, p, state)
    reference = penalty_values(penalties)
    kernel = torch.ops.flashsampling._penalty_values(
        state.ids, state.output_counts, frequency=None if isinstance(f, torch.Tensor) else f,
        frequencies=f if isinstance(f, torch.Tensor) else None, presence=None if isinstance(p, torch.Tensor) else p,
        presences=p if isinstance(p, torch.Tensor) else None)
    assert torch.equal(kernel.view(torch.int32), reference.view(torch.int32))  # bit for bit, signed zeros too


def test_fused_penalties_vocabulary_bound():
    """The fused CUDA op keeps a row's seen-token bits in shared memory: a vocabulary shard beyond
    MAX_FUSED_PENALTY_VOCAB gets a ValueError naming the weight on CUDA; the CPU op has no bound."""
    from flashsampling_cuda.penalties import MAX_FUSED_PENALTY_VOCAB, check_fused_penalty_vocab

    assert (MAX_FUSED_PENALTY_VOCAB // 32) * 4 + 64 <= 227 * 1024  # the words and the scan's warp sums
    check_fused_penalty_vocab(MAX_FUSED_PENALTY_VOCAB, torch.device("cuda"))
    check_fused_penalty_vocab(10**7, torch.device("cpu"))
    with pytest.raises(ValueError, match="penalties on CUDA take at most .* weight has"):
        check_fused_penalty_vocab(MAX_FUSED_PENALTY_VOCAB + 1, torch.device("cuda"))
