"""Tensor-parallel sampling (flashsampling_cuda.distributed) in real process groups.

For each (group kind, world size) one torch.multiprocessing job runs every scenario of
tests/tp_scenarios.py on every rank (a process group costs seconds to start on a 2-core
CI box, so one is shared) and saves what each rank returned; the tests then compare:

* tokens on every rank == the single-process op on the whole weight (same seed), over
  unequal shards handed to the ranks out of vocabulary order, batch-wide and per-row
  seeds, per-row temperatures with a greedy row, float32 and bfloat16;
* masks where a shard allows nothing in some rows, a row no shard allows (sentinel and
  error), logit biases, and log-probabilities against the single-process op;
* chi-square of the merged tokens against softmax; back-to-back calls; the no-seed path
  (rank 0 draws and broadcasts);
* global truncation, every form (host and per-row top_k / top_p / min_p, masks, the three
  orders) == the single-process op; on one GPU, a one-rank NCCL group: no host sync, and CUDA
  graph replays equal to the single-process op;
* speculative verification (distributed.speculative_sample) == the single-process
  speculative_sample: one-hot and sampled drafts, greedy rows, truncation with a mask.

gloo on the CPU with 2, 4 and 8 processes everywhere; on a machine with a GPU the same
processes with their tensors on it and gloo's collectives (`gloo-one-gpu`: the CUDA kernels of
every rank, the collectives staged through the host); NCCL with the same test functions where at
least `world_size` GPUs are (`pytest tests/test_distributed.py -m requires_cuda` on the 2-, 4- or
8-GPU machine).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import flashsampling_cuda as fs
from flashsampling_cuda import distributed as tp
from sampling_stats import chi_square_pvalue
from tp_scenarios import (GLOO_ON_ONE_GPU, SPEC_DRAFTS, VOCAB, chi_problem, integer_problem, random_mask, run_job,
                          unequal_shards)

WORLD_SIZES = [2, 4, 8]


def _params():
    out = [pytest.param("gloo", w, id=f"gloo-{w}") for w in WORLD_SIZES]
    for w in WORLD_SIZES:
        out.append(pytest.param(GLOO_ON_ONE_GPU, w, id=f"{GLOO_ON_ONE_GPU}-{w}", marks=pytest.mark.requires_cuda))
    for w in WORLD_SIZES:
        marks = [
            pytest.mark.requires_cuda,
            pytest.mark.skipif(torch.cuda.device_count() < w, reason=f"needs {w} GPUs for NCCL"),
        ]
        out.append(pytest.param("nccl", w, id=f"nccl-{w}", marks=marks))
    return out


PARAMS = _params()


def results(group_kind, world, scenario):
    ranks = run_job(group_kind, world)[scenario]
    for r, res in enumerate(ranks):
        assert "exception" not in res, f"rank {r} raised in {scenario}:\n{res['exception']}"
    return ranks


def assert_same_on_every_rank(ranks, key):
    first = ranks[0][key]
    for r, res in enumerate(ranks[1:], start=1):
        torch.testing.assert_close(res[key], first, rtol=0, atol=0, equal_nan=True, msg=f"rank {r} differs")


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_tokens_equal_single_process_op(group_kind, world):
    ranks = results(group_kind, world, "scenario_tokens")
    checked = 0
    for name, entry in ranks[0].items():
        if "unsupported" in entry:
            assert all(r[name] == entry for r in ranks), f"{name}: ranks disagree on {entry}"
            continue
        tokens = [r[name]["tokens"] for r in ranks]
        for r, t in enumerate(tokens):
            assert torch.equal(t, entry["expected"]), f"{name}: rank {r} {t.tolist()} != {entry['expected'].tolist()}"
        checked += 1
    # The CPU op takes every configuration; a GPU may decline CPU-only ones (reported).
    assert checked == len(ranks[0]) if group_kind == "gloo" else checked >= 1, f"configurations that ran: {ranks[0]}"


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_unequal_shards_all_win_sometimes(group_kind, world):
    """The shards are unequal (one of size 1) and winners come from several shards, so
    the merge really chose between ranks."""
    shards = unequal_shards(VOCAB, world)
    sizes = [n for _, n in shards]
    assert len(set(sizes)) > 1 and min(sizes) == 1 and sum(sizes) == VOCAB
    tokens = results(group_kind, world, "scenario_chi_square")[0]["tokens"]
    starts = torch.tensor([s for s, _ in shards])
    shard_of_token = torch.bucketize(tokens.flatten(), starts, right=True) - 1
    assert shard_of_token.unique().numel() >= min(world, 2)
    logprob_ranks = results(group_kind, world, "scenario_logprobs")
    first_shard_wins = (logprob_ranks[0]["got"]["tokens"] == shards[0][0]).sum()
    assert first_shard_wins > 0, "the size-1 shard (boosted by a sparse bias) never won"


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_shard_whose_mask_allows_nothing(group_kind, world):
    ranks = results(group_kind, world, "scenario_masks")
    zero = ranks[0]
    # the rank holding the first (size-1) shard allows nothing in row 1
    assert any(r["shard_row_empty"] for r in ranks)
    for key in ("sentinel", "sentinel_bool", "no_sentinel"):
        assert_same_on_every_rank([{"x": _tokens(r[key])} for r in ranks], "x")
    assert torch.equal(_tokens(zero["sentinel"]), zero["expected_sentinel"]["tokens"])
    assert torch.equal(zero["sentinel_bool"], zero["expected_sentinel"]["tokens"])
    assert torch.equal(zero["no_sentinel"], zero["expected_no_sentinel"])
    assert (zero["sentinel_bool"][2] == -7).all() and (zero["sentinel_bool"][[0, 1, 3, 4, 5]] >= 0).all()
    got, expected = zero["sentinel"], zero["expected_sentinel"]
    torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(got["logsumexp"], expected["logsumexp"], rtol=1e-5, atol=1e-5)
    assert torch.isnan(got["logprobs"][2]).all() and got["logsumexp"][2] == -math.inf


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_row_no_shard_allows_raises_on_every_rank(group_kind, world):
    ranks = results(group_kind, world, "scenario_masks")
    assert ranks[0]["expected_error"] is not None and "allows no token" in ranks[0]["expected_error"]
    for r, res in enumerate(ranks):
        assert res["error"] is not None, f"rank {r} did not raise"
        assert "allowed_mask allows no token in 1 row(s) (first: 2)" in res["error"], res["error"]


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_logprobs_match_single_process_op(group_kind, world):
    ranks = results(group_kind, world, "scenario_logprobs")
    expected = ranks[0]["expected"]
    for r, res in enumerate(ranks):
        got = res["got"]
        assert torch.equal(got["tokens"], expected["tokens"]), f"rank {r}"
        torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["logsumexp"], expected["logsumexp"], rtol=1e-5, atol=1e-5)
    assert_same_on_every_rank([r["got"] for r in ranks], "logprobs")


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_chi_square_against_softmax(group_kind, world):
    ranks = results(group_kind, world, "scenario_chi_square")
    assert_same_on_every_rank(ranks, "tokens")
    hidden, weight = chi_problem()
    probs = torch.softmax(hidden.double() @ weight.double().T, dim=1)
    p = chi_square_pvalue(ranks[0]["tokens"], probs)
    assert p > 1e-3, f"chi-square p = {p:.2e}"


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_back_to_back_calls(group_kind, world):
    ranks = results(group_kind, world, "scenario_back_to_back")
    expected = ranks[0]["expected"]
    for r, res in enumerate(ranks):
        for i, (got, exp) in enumerate(zip(res["got"], expected)):
            assert torch.equal(got, exp), f"rank {r}, call {i}"


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_no_seed_rank0_draws_and_broadcasts(group_kind, world):
    ranks = results(group_kind, world, "scenario_no_seed")
    for r, res in enumerate(ranks):
        for i, (got, exp) in enumerate(zip(res["got"], ranks[0]["expected"])):
            assert torch.equal(got, exp), f"rank {r}, call {i}"
    assert not torch.equal(ranks[0]["got"][0], ranks[0]["got"][1])


def assert_configs_equal_single_process(ranks):
    """Every configuration of a scenario: the same on every rank, and equal to the single-process
    op on rank 0: integer outputs (tokens, top-N ids, ranks) exactly, log-probabilities to fp32
    rounding."""
    for name, entry in ranks[0].items():
        expected = entry["expected"]
        for route in ("got", "whole_rows"):  # "whole_rows": the route of vocab_size, where a scenario runs it
            if route not in entry:
                continue
            got, label = entry[route], f"{name} ({route})"
            for r, res in enumerate(ranks[1:], start=1):
                torch.testing.assert_close(res[name][route], got, rtol=0, atol=0, equal_nan=True,
                                           msg=f"{label}: rank {r} differs")
            if not isinstance(got, dict):
                assert torch.equal(got, expected), f"{label}: {got.tolist()} != {expected.tolist()}"
                continue
            assert got.keys() == expected.keys(), label
            for key in got:
                if got[key].dtype == torch.int64:
                    assert torch.equal(got[key], expected[key]), f"{label}.{key}: {got[key]} != {expected[key]}"
                else:
                    torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5, equal_nan=True,
                                               msg=f"{label}.{key}")


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_truncation_equals_single_process_op(group_kind, world):
    assert_configs_equal_single_process(results(group_kind, world, "scenario_truncation"))


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_whole_rows_where_shards_do_not_tile_return_minus_one(group_kind, world):
    """vocab_size beyond the shards: token -1 on every rank; below the last shard's end: that rank
    raises (after the all-reduce), the others return -1 instead of waiting; an empty batch with a
    mask; without a seed the same tokens as the search route."""
    ranks = results(group_kind, world, "scenario_whole_rows_layouts")
    for r, res in enumerate(ranks):
        assert (res["gap"] == -1).all(), (r, res["gap"])
        assert res["empty_batch"].shape == (0, 1)
        assert torch.equal(res["no_seed"], res["no_seed_search"]), r
        assert torch.equal(res["no_seed"], ranks[0]["no_seed"]), r
    raised = [r for r, res in enumerate(ranks) if "short_error" in res]
    assert len(raised) == 1 and "vocab_size must cover this rank's shard" in ranks[raised[0]]["short_error"]
    assert all((res["short"] == -1).all() for r, res in enumerate(ranks) if r not in raised)


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_serving_controls_equal_single_process_op(group_kind, world):
    """Penalties, model-side transforms, truncation orders and the logprob outputs: tokens, top-N
    ids and ranks exact, log-probabilities to fp32 rounding, the same on every rank."""
    assert_configs_equal_single_process(results(group_kind, world, "scenario_serving"))


@pytest.mark.parametrize("group_kind,world", PARAMS)
def test_speculative_equals_single_process_op(group_kind, world):
    """distributed.speculative_sample: tokens and num_accepted exact, log-probabilities to fp32
    rounding, the same on every rank; drafts are accepted and rejected, and the size-1 shard's
    token is accepted as a draft."""
    ranks = results(group_kind, world, "scenario_speculative")
    accepted = []
    for name, entry in ranks[0].items():
        got, expected = entry["got"], entry["expected"]
        for r, res in enumerate(ranks[1:], start=1):
            for key, value in res[name]["got"].items():
                if value is not None:
                    torch.testing.assert_close(value, got[key], rtol=0, atol=0, equal_nan=True,
                                               msg=f"{name}.{key}: rank {r} differs")
        assert torch.equal(got["tokens"], expected["tokens"]), f"{name}: {got['tokens']} != {expected['tokens']}"
        assert torch.equal(got["num_accepted"], expected["num_accepted"]), name
        if expected["logprobs"] is None:
            assert got["logprobs"] is None, name
        else:
            torch.testing.assert_close(got["logprobs"], expected["logprobs"], rtol=1e-5, atol=1e-5, equal_nan=True,
                                       msg=name)
        accepted.append(expected["num_accepted"])
    accepted = torch.cat(accepted)
    assert (accepted > 0).any() and (accepted < SPEC_DRAFTS).any(), accepted
    small = unequal_shards(VOCAB, world)[0][0]
    one_hot = ranks[0]["one_hot"]["expected"]
    drafted = torch.arange(SPEC_DRAFTS + 1)[None, :] < one_hot["num_accepted"][:, None]
    assert (drafted & (one_hot["tokens"] == small)).any(), one_hot


def _tokens(x):
    return x["tokens"] if isinstance(x, dict) else x


# ---------------------------------------------------------------- single process (no group)


def _decode_tokens(keys):
    """The token of candidate keys (fs_shard_key_token of shard_keys.h)."""
    return 0x7FFFFFFF - (keys & 0xFFFFFFFF)


def test_keys_order_like_the_op():
    """Max of the int64 keys == best (score, then smaller index); sentinels lose."""
    scores = torch.tensor([1.0, 1.0, -0.0, 0.0, -math.inf, 3e38, -3e38, -math.inf, -math.inf, 2.5])
    tokens = torch.tensor([7, 3, 5, 9, 1, 2, 4, -1, -2, 0])
    keys = tp._encode_keys(tokens, scores)
    order = sorted(range(len(tokens)), key=lambda i: (
        -2 if tokens[i] == -2 else -1 if tokens[i] == -1 else 0, float(scores[i]) + 0.0, -int(tokens[i])))
    assert torch.argsort(keys).tolist() == order
    valid = tokens >= 0
    assert torch.equal(_decode_tokens(keys[valid]), tokens[valid])


def _random_shard_summaries(world, batch, samples, columns, seed):
    """[world, batch, columns] int64 summaries: keys of random (token, score) in the first
    `samples` columns, both sentinels sprinkled in, padding after."""
    generator = torch.Generator().manual_seed(seed)
    shape = (world, batch, samples)
    tokens = torch.randint(0, 150000, shape, generator=generator)
    scores = torch.randn(shape, generator=generator) * 3
    scores[torch.rand(shape, generator=generator) < 0.05] = -math.inf
    tokens[torch.rand(shape, generator=generator) < 0.1] = -1
    tokens[torch.rand(shape, generator=generator) < 0.1] = tp._SHARD_EMPTY
    scores[:, 0, 0] = 1.5  # an exact tie across ranks: the smaller token wins
    scores[:, :2, 1:] = -math.inf  # rows without candidates (-1) or with empty masks (-2) everywhere
    tokens[:, 1, 1:] = -1
    tokens[:, 0, 1:] = tp._SHARD_EMPTY
    summary = torch.full((world, batch, columns), 12345, dtype=torch.int64)
    summary[:, :, :samples] = tp._encode_keys(tokens.flatten(), scores.flatten()).view(shape)
    return summary


def _merge_reference(gathered, samples, mask_empty_token):
    best, winner = gathered[:, :, :samples].max(dim=0)
    tokens = torch.where(best == tp._KEY_NO_CANDIDATE, -1, _decode_tokens(best))
    tokens = torch.where(best == tp._KEY_SHARD_EMPTY, mask_empty_token, tokens)
    return best, tokens


@pytest.mark.parametrize("world,batch,samples,columns", [(1, 3, 1, 1), (2, 5, 3, 5), (4, 17, 2, 4), (8, 64, 1, 2)])
def test_merge_shard_keys_is_the_max_over_ranks(world, batch, samples, columns):
    gathered = _random_shard_summaries(world, batch, samples, columns, seed=world * 100 + batch)
    best, winner, tokens = torch.ops.flashsampling._merge_shard_keys(gathered, samples, 7)
    ref_best, ref_tokens = _merge_reference(gathered, samples, 7)
    assert torch.equal(best, ref_best) and torch.equal(tokens, ref_tokens)
    assert torch.equal(gathered[:, :, :samples].gather(0, winner[None])[0], best)
    # the first rank that holds the best key
    first = (gathered[:, :, :samples] == best[None]).int().argmax(dim=0)
    assert torch.equal(winner, first)


@pytest.mark.requires_cuda
def test_shard_key_ops_cuda_equal_cpu():
    gathered = _random_shard_summaries(4, 300, 3, 5, seed=11)
    for cpu, gpu in zip(torch.ops.flashsampling._merge_shard_keys(gathered, 3, -1),
                        torch.ops.flashsampling._merge_shard_keys(gathered.cuda(), 3, -1)):
        assert torch.equal(cpu, gpu.cpu())
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(-2, 1000, (4096,), generator=generator)
    scores = torch.randn(4096, generator=generator) * 1e3
    scores[::7] = -0.0
    scores[::11] = -math.inf
    assert torch.equal(tp._encode_keys(tokens, scores), tp._encode_keys(tokens.cuda(), scores.cuda()).cpu())


def test_shard_key_ops_name_bad_arguments():
    with pytest.raises(RuntimeError, match="_shard_keys: scores must be float32"):
        torch.ops.flashsampling._shard_keys(torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="_shard_keys: tokens and scores must have one shape"):
        torch.ops.flashsampling._shard_keys(torch.zeros(3, dtype=torch.int64), torch.zeros(4))
    with pytest.raises(RuntimeError, match=r"_merge_shard_keys: gathered must be \[world >= 1, B, C\]"):
        torch.ops.flashsampling._merge_shard_keys(torch.zeros(3, 4, dtype=torch.int64), 1, -1)
    with pytest.raises(RuntimeError, match="_merge_shard_keys: num_samples must lie in"):
        torch.ops.flashsampling._merge_shard_keys(torch.zeros(2, 3, 4, dtype=torch.int64), 5, -1)


@pytest.mark.parametrize("start,size", [(0, 1), (0, 32), (5, 27), (31, 1), (32, 64), (37, 100), (200, 3), (45, 158)])
def test_shard_allowed_mask_matches_bool_slice(start, size):
    mask = random_mask(5, VOCAB, 0.5, seed=start + size)
    packed = fs.pack_allowed_mask(mask)
    assert torch.equal(tp.shard_allowed_mask(packed, start, size), fs.pack_allowed_mask(mask[:, start:start + size]))


def test_vocab_shards_tile_the_vocabulary():
    for vocab, world in [(10, 1), (10, 3), (128256, 8), (203, 8)]:
        shards = tp.vocab_shards(vocab, world)
        assert [s for s, _ in shards] == [sum(n for _, n in shards[:i]) for i in range(world)]
        assert sum(n for _, n in shards) == vocab and max(n for _, n in shards) - min(n for _, n in shards) <= 1
    with pytest.raises(ValueError):
        tp.vocab_shards(3, 4)


def test_without_process_group_is_the_single_process_op():
    assert not dist.is_initialized()
    hidden, weight = integer_problem()
    got = tp.sample(hidden, weight, vocab_start=0, seed=3, num_samples=4, return_logprobs=True)
    expected = fs.sample(hidden, weight, seed=3, num_samples=4, return_logprobs=True)
    assert torch.equal(got.tokens, expected.tokens)
    torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="offset was given without seed"):
        tp.sample(hidden, weight, vocab_start=0, offset=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_truncation_without_process_group_is_the_single_process_op(device):
    """Without a process group the tensor-parallel sample is the single-process op, truncation
    included (its routes, not the shards' search): every form returns the op's tokens, and its
    log-probabilities and top log-probabilities."""
    assert not dist.is_initialized()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16  # the CUDA op's dtypes; the values are exact in both
    hidden, weight = (t.to(device, dtype) for t in integer_problem(batch=4, vocab=3001, dim=32, seed=8))
    rows = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    forms = [dict(top_p=0.9), dict(min_p=rows(0.1, 0.0, 0.3, 0.05)), dict(top_k=rows(5, 0, 3001, 40)),
             dict(top_k=2000, top_p=rows(0.9, 1.0, 0.5, 0.99)), dict(top_k=20, top_p=0.9, truncation_order="joint")]
    for form in forms:
        common = dict(temperature=0.7, seed=11, num_samples=3, **form)
        assert torch.equal(tp.sample(hidden, weight, vocab_start=0, **common), fs.sample(hidden, weight, **common)), form
    common = dict(temperature=0.7, seed=12, top_p=rows(0.9, 0.5, 1.0, 0.8), return_logprobs=True, top_logprobs=3)
    got, expected = tp.sample(hidden, weight, vocab_start=0, **common), fs.sample(hidden, weight, **common)
    for name in ("tokens", "logprobs", "logsumexp", "top_ids", "top_logprobs", "ranks"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), rtol=0, atol=0, equal_nan=True,
                                   msg=name)


@pytest.mark.requires_cuda
def test_truncation_reads_nothing_on_the_host_and_replays_in_a_cuda_graph():
    """A one-rank NCCL group on one GPU (its all-reduces run as in a larger group): every
    truncation form of the tensor-parallel sample runs with torch's sync debug mode at "error" (no
    host read of a device value), returns the single-process op's tokens, and a CUDA graph of it
    replays with the single-process op's fresh tokens as its offset advances; both routes, the
    search across ranks and (with vocab_size) the whole rows."""
    device = torch.device("cuda")
    hidden, weight = integer_problem(batch=6, vocab=5003, dim=64, seed=21)
    routes = {"search": {}, "whole_rows": dict(vocab_size=5003)}
    h, w = hidden.bfloat16().to(device), weight.bfloat16().to(device)
    rows = lambda *v: torch.tensor(v, device=device)  # noqa: E731
    forms = {
        "top_k_per_row": dict(top_k=rows(1, 20, 0, 4000, 5003, 64)),
        "top_p_per_row": dict(top_p=rows(0.9, 0.5, 1.0, 0.99, 0.0, 0.3)),
        "min_p_alone": dict(min_p=0.1),
        "all_per_row": dict(top_k=rows(50, 0, 7, 3000, 2, 1), top_p=rows(0.95, 0.8, 1.0, 0.5, 0.9, 0.9),
                            min_p=rows(0.0, 0.05, 0.3, 0.0, 0.1, 0.0)),
        "host_top_k_gathered": dict(top_k=20, top_p=0.9),
        "host_top_k_searched": dict(top_k=2000, top_p=0.9),
        "joint": dict(top_k=20, top_p=0.9, truncation_order="joint"),
        "masked_top_p_per_row": dict(top_p=rows(0.9, 0.5, 1.0, 0.99, 0.0, 0.3), empty_mask_token=-3,
                                     allowed_mask=random_mask(6, 5003, 0.5, seed=22).to(device)),
    }
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        seed, offset = torch.tensor(5, device=device), torch.tensor(0, device=device)
        for (name, form), (route, route_args) in itertools.product(forms.items(), routes.items()):
            common = dict(temperature=0.8, seed=seed, offset=offset, num_samples=2, **form)
            expected = fs.sample(h, w, **common)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = tp.sample(h, w, vocab_start=0, **common, **route_args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert torch.equal(got, expected), (name, route)
        form = forms["all_per_row"]
        for route, route_args in routes.items():
            step = torch.zeros((), dtype=torch.int64, device=device)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the capture
                tp.sample(h, w, vocab_start=0, temperature=0.8, seed=seed, offset=step, **form, **route_args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = tp.sample(h, w, vocab_start=0, temperature=0.8, seed=seed, offset=step, **form,
                                     **route_args)
            seen = set()
            for value in range(4):
                step.fill_(value)
                graph.replay()
                expected = fs.sample(h, w, temperature=0.8, seed=seed, offset=step, **form)
                assert torch.equal(captured, expected), (route, value)
                seen.add(tuple(captured.flatten().tolist()))
            assert len(seen) > 1, route
    finally:
        dist.destroy_process_group()
