"""Scenarios of tests/test_distributed.py, run on every rank of a spawned process group.

Kept apart from the test module (no pytest, no scipy) so that each spawned process only
imports torch and flashsampling_cuda: with 8 processes on a 2-core box every import counts.
`run_job(group_kind, world)` spawns the group once and returns what every rank returned.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashsampling_cuda as fs
from flashsampling_cuda import distributed as tp

# Shape of the scenarios' problems: V is not a multiple of 32 nor of any world size.
BATCH, VOCAB, DIM = 6, 203, 64


# ---------------------------------------------------------------- problem and shards


def integer_problem(batch=BATCH, vocab=VOCAB, dim=DIM, seed=0):
    """Small integers times 2^-4 (exact in bfloat16): every fp32 logit is exact whatever
    the summation order, so shard and whole-vocabulary logits agree bit for bit."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-3, 4, (batch, dim), generator=g).float()
    weight = torch.randint(-2, 3, (vocab, dim), generator=g).float() / 16
    return hidden, weight


def unequal_shards(vocab, world):
    """[(vocab_start, V_r)] in vocabulary order, unequal sizes, one shard of size 1."""
    g = torch.Generator().manual_seed(world)
    cuts = set(torch.randperm(vocab - 2, generator=g)[: world - 2].add(2).tolist()) | {1}
    while len(cuts) < world - 1:
        cuts.add(int(torch.randint(2, vocab, (1,), generator=g)))
    bounds = [0] + sorted(cuts)[: world - 1] + [vocab]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(world)]


def shard_of_rank(rank, world):
    """Ranks hold shards out of vocabulary order: rank r holds shard world - 1 - r."""
    return world - 1 - rank


def random_mask(batch, vocab, density, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(batch, vocab, generator=g) < density


# ---------------------------------------------------------------- scenarios (run on every rank)


class Ctx:
    def __init__(self, rank, world, device):
        self.rank, self.world, self.device = rank, world, device
        self.shards = unequal_shards(VOCAB, world)
        self.start, self.size = self.shards[shard_of_rank(rank, world)]

    def shard(self, full: torch.Tensor, dim=0):
        return full.narrow(dim, self.start, self.size).contiguous().to(self.device)

    def to(self, t):
        return t.to(self.device) if isinstance(t, torch.Tensor) else t


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {k: _cpu(v) for k, v in zip(x._fields, x)}
    if isinstance(x, (list, tuple)):
        return [_cpu(v) for v in x]
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def scenario_tokens(ctx: Ctx):
    """Tokens == single-process op for several argument forms."""
    hidden, weight = integer_problem()
    out = {}
    configs = {
        "bf16_batch_seed": dict(dtype=torch.bfloat16, temperature=0.8, seed=1234, offset=7, num_samples=4),
        "fp32_per_row_seed": dict(dtype=torch.float32, temperature=1.0, seed=torch.arange(BATCH) * 7919 + 3,
                                  offset=torch.arange(BATCH) * 10, num_samples=3),
        "per_row_temperature_with_greedy": dict(dtype=torch.bfloat16, temperature=torch.tensor(
            [0.0, 0.5, 1.0, 1.5, 2.0, 0.25]), seed=99, num_samples=2),
        "greedy": dict(dtype=torch.bfloat16, temperature=0.0, seed=5, num_samples=1),
    }
    for name, cfg in configs.items():
        cfg = dict(cfg)
        dtype = cfg.pop("dtype")
        h = hidden.to(dtype).to(ctx.device)
        kwargs = {k: ctx.to(v) for k, v in cfg.items()}
        try:
            got = tp.sample(h, ctx.shard(weight.to(dtype)), vocab_start=ctx.start, **kwargs)
        except (RuntimeError, NotImplementedError) as exc:
            # An argument the device's op does not take (e.g. a CPU-only control on CUDA):
            # raised by the op on every rank, before any collective.
            if not (isinstance(exc, NotImplementedError) or str(exc).startswith("flashsampling.sample:")):
                raise
            out[name] = {"unsupported": str(exc).splitlines()[0]}
            continue
        entry = {"tokens": got}
        if ctx.rank == 0:
            entry["expected"] = fs.sample(h, weight.to(dtype).to(ctx.device), **kwargs)
        out[name] = entry
    return out


def scenario_masks(ctx: Ctx):
    """Masks where shards allow nothing; a row no shard allows; logprobs with masks."""
    hidden, weight = integer_problem(seed=1)
    h, w = hidden.bfloat16().to(ctx.device), weight.bfloat16()
    mask = random_mask(BATCH, VOCAB, 0.3, seed=2)
    first_start, first_size = ctx.shards[0]
    last_start, last_size = ctx.shards[-1]
    mask[0] = False
    mask[0, last_start + last_size // 2] = True  # only the last shard allows anything
    mask[1, first_start : first_start + first_size] = False  # the first shard (size 1) allows nothing
    mask[2] = False  # no shard allows anything
    mask[3, last_start:] = False  # the last shard allows nothing in row 3
    mask[3, 0] = True
    packed = fs.pack_allowed_mask(mask)
    out = {}
    kwargs = dict(seed=77, offset=3, num_samples=5, temperature=0.9)
    # An int32 shard bitmask cut from the global one, and a bool slice: the same tokens.
    shard_bits = tp.shard_allowed_mask(packed, ctx.start, ctx.size).to(ctx.device)
    out["sentinel"] = tp.sample(h, ctx.shard(w), vocab_start=ctx.start, allowed_mask=shard_bits,
                                empty_mask_token=-7, return_logprobs=True, **kwargs)
    out["sentinel_bool"] = tp.sample(h, ctx.shard(w), vocab_start=ctx.start,
                                     allowed_mask=ctx.shard(mask, dim=1), empty_mask_token=-7, **kwargs)
    try:
        tp.sample(h, ctx.shard(w), vocab_start=ctx.start, allowed_mask=shard_bits, **kwargs)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    # Without the all-empty row no sentinel is needed, and a shard allowing nothing is fine.
    ok = packed.clone()
    ok[2] = fs.pack_allowed_mask(random_mask(1, VOCAB, 0.5, seed=3))[0]
    out["no_sentinel"] = tp.sample(h, ctx.shard(w), vocab_start=ctx.start,
                                   allowed_mask=tp.shard_allowed_mask(ok, ctx.start, ctx.size).to(ctx.device),
                                   **kwargs)
    out["shard_row_empty"] = bool(not ctx.shard(mask, dim=1)[1].any())
    if ctx.rank == 0:
        wd = w.to(ctx.device)
        out["expected_sentinel"] = fs.sample(h, wd, allowed_mask=packed.to(ctx.device), empty_mask_token=-7,
                                             return_logprobs=True, **kwargs)
        out["expected_no_sentinel"] = fs.sample(h, wd, allowed_mask=ok.to(ctx.device), **kwargs)
        try:
            fs.sample(h, wd, allowed_mask=packed.to(ctx.device), **kwargs)
            out["expected_error"] = None
        except RuntimeError as exc:
            out["expected_error"] = str(exc)
    return out


def scenario_logprobs(ctx: Ctx):
    """Merged log-probabilities == single-process op, with dense and sparse biases."""
    hidden, weight = integer_problem(seed=4)
    h, w = hidden.bfloat16().to(ctx.device), weight.bfloat16()
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(VOCAB, generator=g)
    bias[5::17] = -torch.inf  # some impossible tokens (not token 0, the size-1 shard)
    ids = torch.randint(0, VOCAB, (BATCH, 4), generator=g)
    ids[:, 0] = ctx.shards[0][0]  # the size-1 shard gets a big boost: it wins often
    values = torch.randn(BATCH, 4, generator=g) + torch.tensor([6.0, 0, 0, 0])
    kwargs = dict(temperature=0.7, seed=2024, num_samples=6,
                  sparse_logit_bias=(ids.to(ctx.device), values.to(ctx.device)))
    out = {"got": tp.sample(h, ctx.shard(w), vocab_start=ctx.start, logit_bias=ctx.shard(bias),
                            return_logprobs=True, **kwargs)}
    if ctx.rank == 0:
        out["expected"] = fs.sample(h, w.to(ctx.device), logit_bias=bias.to(ctx.device), return_logprobs=True,
                                    **kwargs)
    return out


CHI_ROWS, CHI_SAMPLES = 2, 3000


def chi_problem():
    """bf16 inputs (what the CUDA kernel takes; the CPU op too), so one problem serves
    gloo and NCCL; the test's softmax uses the same bf16 values in float64."""
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(CHI_ROWS, DIM, generator=g)
    weight = torch.randn(VOCAB, DIM, generator=g) * (1.5 / math.sqrt(DIM))
    return hidden.bfloat16(), weight.bfloat16()


def scenario_chi_square(ctx: Ctx):
    hidden, weight = chi_problem()
    tokens = tp.sample(hidden.to(ctx.device), ctx.shard(weight), vocab_start=ctx.start, seed=31337,
                       num_samples=CHI_SAMPLES)
    return {"tokens": tokens}


BACK_TO_BACK_CALLS = 12


def scenario_back_to_back(ctx: Ctx):
    """Calls with no synchronisation in between, alternating summary sizes."""
    hidden, weight = integer_problem(seed=7)
    h, ws = hidden.bfloat16().to(ctx.device), ctx.shard(weight.bfloat16())
    results = []
    for i in range(BACK_TO_BACK_CALLS):
        results.append(tp.sample(h, ws, vocab_start=ctx.start, seed=11, offset=3 * i, num_samples=3,
                                 return_logprobs=bool(i % 2)))
    out = {"got": [r if isinstance(r, torch.Tensor) else r.tokens for r in results]}
    if ctx.rank == 0:
        w = weight.bfloat16().to(ctx.device)
        out["expected"] = [fs.sample(h, w, seed=11, offset=3 * i, num_samples=3) for i in range(BACK_TO_BACK_CALLS)]
    return out


def scenario_no_seed(ctx: Ctx):
    """seed=None: rank 0 draws from its generator and broadcasts; other ranks' generators
    (seeded differently here) do not matter."""
    hidden, weight = integer_problem(seed=8)
    h, w = hidden.bfloat16().to(ctx.device), weight.bfloat16()
    torch.manual_seed(1000 + ctx.rank)
    got = [tp.sample(h, ctx.shard(w), vocab_start=ctx.start, num_samples=2) for _ in range(2)]
    out = {"got": got}
    if ctx.rank == 0:
        torch.manual_seed(1000)
        expected = []
        for _ in range(2):
            seed = tp._draw_seed(None, h.device)
            expected.append(fs.sample(h, w.to(ctx.device), seed=seed, num_samples=2))
        out["expected"] = expected
    return out


def scenario_truncation(ctx: Ctx):
    """Global top-k (+ top-p / min-p) == the single-process op's truncation; integer logits
    have many exact ties, which must break by the global id on every rank."""
    hidden, weight = integer_problem(seed=8)
    h, w = hidden.bfloat16().to(ctx.device), weight.bfloat16()
    g = torch.Generator().manual_seed(9)
    bias = (torch.randint(-2, 3, (VOCAB,), generator=g) / 4).float()
    mask = random_mask(BATCH, VOCAB, 0.7, seed=10)
    configs = {
        "top_k": dict(top_k=5),
        "top_k_wider_than_shards": dict(top_k=60),
        "top_k_top_p": dict(top_k=20, top_p=0.8, logit_bias=bias),
        "top_k_min_p_per_row": dict(top_k=12, min_p=torch.tensor([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]),
                                    allowed_mask=mask),
        "logprobs": dict(top_k=9, top_p=0.9, return_logprobs=True),
        # The forms the radix search takes (off CUDA; on CUDA every form): top_p / min_p alone, per row.
        "top_p_alone": dict(top_p=0.5, logit_bias=bias),
        "min_p_alone_per_row": dict(min_p=torch.tensor([0.0, 0.1, 0.3, 0.5, 0.9, 1.0]), allowed_mask=mask),
        "top_k_per_row_top_p": dict(top_k=torch.tensor([1, 0, 5, 60, -1, 3]), top_p=torch.tensor(
            [0.9, 0.5, 1.0, 0.7, 0.95, 0.2]), return_logprobs=True),
        # Every form through the radix search: per-row top_k alone (k up to V and above), all three
        # per row with a mask, and the orders with a host top_k.
        "top_k_per_row_alone": dict(top_k=torch.tensor([1, 2, 203, 150, 0, 500]), allowed_mask=mask),
        "all_per_row_mask": dict(top_k=torch.tensor([3, 0, 40, 200, 7, 1]), top_p=torch.tensor(
            [0.6, 0.99, 0.3, 1.0, 0.05, 0.8]), min_p=torch.tensor([0.05, 0.0, 0.2, 0.01, 0.5, 0.0]), allowed_mask=mask,
            logit_bias=bias, return_logprobs=True),
        "joint_top_k_top_p": dict(top_k=15, top_p=0.7, truncation_order="joint"),
        "min_p_first_per_row": dict(top_k=torch.tensor([30, 5, 0, 60, 2, 100]), top_p=0.8, min_p=0.1,
                                    truncation_order="min_p_first"),
        # greedy rows and per-row temperatures; model-side transforms; a row the mask empties
        "greedy_and_row_temperatures": dict(top_p=torch.tensor([0.9, 0.5, 1.0, 0.7, 0.95, 0.2]),
                                            temperature=torch.tensor([0.0, 0.5, 1.3, 0.0, 2.0, 0.9]),
                                            return_logprobs=True),
        "transforms_and_sparse_bias": dict(top_k=25, min_p=0.05, logit_scale=0.5, logit_softcap=3.0,
                                           sparse_logit_bias=[{3: 1.5, 150: -2.0}, {}, {7: 4.0}, {}, {}, {202: 1.0}]),
        "empty_row_token": dict(top_p=0.8, allowed_mask=mask & (torch.arange(BATCH) != 2)[:, None],
                                empty_mask_token=-5, return_logprobs=True),
    }
    out = {}
    for name, cfg in configs.items():
        common = {**dict(temperature=0.9, seed=31, offset=2, num_samples=3), **cfg}
        shard_kwargs = dict(common)
        for arg, shard_dim in (("logit_bias", 0), ("allowed_mask", 1)):
            if arg in shard_kwargs:
                shard_kwargs[arg] = ctx.shard(shard_kwargs[arg], dim=shard_dim)
        shard_kwargs = {k: ctx.to(v) for k, v in shard_kwargs.items()}
        entry = {"got": tp.sample(h, ctx.shard(w), vocab_start=ctx.start, **shard_kwargs),
                 # the whole rows on every rank (one all-reduce) instead of the search across them
                 "whole_rows": tp.sample(h, ctx.shard(w), vocab_start=ctx.start, vocab_size=VOCAB, **shard_kwargs)}
        if ctx.rank == 0:
            entry["expected"] = fs.sample(h, w.to(ctx.device), **{k: ctx.to(v) for k, v in common.items()})
        out[name] = entry
    return out


def scenario_serving(ctx: Ctx):
    """What serving engines send beside the sample: penalties over a history of global ids,
    model-side transforms, the truncation orders and the logprob outputs (top-N with ranks,
    token ids, raw), alone and with truncation == the single-process op."""
    hidden, weight = integer_problem(seed=11)
    h, w = hidden.bfloat16().to(ctx.device), weight.bfloat16()
    g = torch.Generator().manual_seed(12)
    prompt = torch.randint(0, VOCAB, (BATCH, 7), generator=g)
    prompt[:, -2:] = -1  # padding
    prompt[0, 0] = ctx.shards[0][0]  # the size-1 shard's token is in a history
    output = torch.randint(0, VOCAB, (BATCH, 5), generator=g)
    output[:, 3] = output[:, 1]  # a repeated token: count 2
    output[1] = -1  # an empty output history
    history = dict(prompt_token_ids=prompt, output_token_ids=output)
    ids = torch.randint(0, VOCAB, (BATCH, 4), generator=g)
    ids[:, 3] = -1  # padding
    ids[0, 0] = ctx.shards[0][0]
    configs = {
        "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.25, presence_penalty=torch.tensor(
            [0.0, 0.5, 1.0, -0.5, 2.0, 0.25]), return_logprobs=True, **history),
        "frequency_presence_alone": dict(frequency_penalty=0.5, presence_penalty=0.75, **history),
        "scale_softcap": dict(logit_scale=0.5, logit_softcap=2.0, return_logprobs=True),
        "penalties_top_k_top_p": dict(repetition_penalty=torch.tensor([1.0, 1.5, 2.0, 1.2, 0.8, 1.1]),
                                      top_k=9, top_p=0.8, return_logprobs=True, **history),
        "penalties_min_p_alone": dict(presence_penalty=0.5, min_p=0.2, logit_softcap=3.0, **history),
        "order_min_p_first": dict(top_k=12, top_p=0.6, min_p=0.1, truncation_order="min_p_first"),
        "order_joint": dict(top_k=12, top_p=0.6, truncation_order="joint", return_logprobs=True),
        "top_logprobs": dict(return_logprobs=True, top_logprobs=5, token_ids=ids),
        "top_logprobs_wider_than_shards": dict(return_logprobs=True, top_logprobs=40),
        # Fewer survivors than N: the top-N reach -inf entries (ties to the smaller id).
        "top_logprobs_beyond_the_survivors": dict(return_logprobs=True, top_logprobs=5, top_k=2),
        "raw_with_truncation": dict(return_logprobs=True, top_logprobs=3, token_ids=ids, logprobs_mode="raw",
                                    top_k=7, repetition_penalty=1.5, **history),
        "processed_with_truncation": dict(return_logprobs=True, top_logprobs=6, token_ids=ids, top_p=0.7,
                                          frequency_penalty=0.3, **history),
    }
    out = {}
    for name, cfg in configs.items():
        common = {k: ctx.to(v) for k, v in dict(temperature=0.8, seed=41, offset=5, num_samples=3, **cfg).items()}
        entry = {"got": tp.sample(h, ctx.shard(w), vocab_start=ctx.start, **common)}
        if ctx.rank == 0:
            entry["expected"] = fs.sample(h, w.to(ctx.device), **common)
        out[name] = entry
    return out


SPEC_DRAFTS = 3  # n: drafts per row


def scenario_speculative(ctx: Ctx):
    """distributed.speculative_sample == the single-process speculative_sample: one-hot and
    sampled drafts, greedy rows beside sampled ones, truncation with a mask; integer logits at
    low temperatures so that drafts (mostly the target's argmax) are often accepted, and the
    size-1 shard's token boosted (the argmax in some rows) and drafted."""
    n = SPEC_DRAFTS
    hidden, weight = integer_problem(batch=BATCH * (n + 1), seed=13)
    h, w = hidden.reshape(BATCH, n + 1, DIM).bfloat16(), weight.bfloat16()
    g = torch.Generator().manual_seed(14)
    small = ctx.shards[0][0]  # the size-1 shard's token
    bias = (torch.randint(-2, 3, (VOCAB,), generator=g) / 4).float()
    bias[small] = 3.0
    x = h.float() @ w.float().T + bias
    drafts = torch.where(torch.rand(BATCH, n, generator=g) < 0.85, x[:, :n].argmax(2),
                         torch.randint(0, VOCAB, (BATCH, n), generator=g))
    drafts[0] = small  # the size-1 shard's token: where rejected, that shard keeps nothing
    q = torch.softmax(x[:, :n] / 0.5 + torch.randn(BATCH, n, VOCAB, generator=g), dim=2)
    sampled = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=g).reshape(BATCH, n)
    mask = random_mask(BATCH, VOCAB, 0.7, seed=15)
    mask[torch.arange(BATCH)[:, None], drafts] = True
    temperatures = torch.tensor([0.0, 0.5, 1.0, 0.0, 0.7, 0.3])
    configs = {
        "one_hot": dict(drafts=drafts, temperature=0.5, seed=123, offset=4, return_logprobs=True),
        "one_hot_greedy_rows_per_row_seed": dict(drafts=drafts, temperature=temperatures, seed=torch.arange(
            BATCH) * 31 + 5, offset=torch.arange(BATCH) * 3, return_logprobs=True),
        "sampled": dict(drafts=sampled, draft_probs=q, temperature=0.6, seed=77, offset=1, return_logprobs=True),
        "sampled_greedy_rows": dict(drafts=sampled, draft_probs=q, temperature=temperatures, seed=78),
        "one_hot_top_k_top_p_mask": dict(drafts=drafts, temperature=0.8, seed=9, top_k=8, top_p=0.8,
                                         allowed_mask=fs.pack_allowed_mask(mask), return_logprobs=True),
        "sampled_top_k_top_p": dict(drafts=sampled, draft_probs=q, temperature=torch.tensor(
            [0.9, 0.0, 0.6, 1.2, 0.8, 0.0]), seed=10, top_k=5, top_p=0.9, return_logprobs=True),
    }
    out = {}
    for name, cfg in configs.items():
        cfg = dict(cfg, logit_bias=bias)
        drafts_cfg, probs = cfg.pop("drafts").to(ctx.device), cfg.pop("draft_probs", None)
        shard_cfg = dict(cfg, logit_bias=ctx.shard(bias))
        if "allowed_mask" in cfg:
            shard_cfg["allowed_mask"] = tp.shard_allowed_mask(cfg["allowed_mask"], ctx.start, ctx.size)
        entry = {"got": tp.speculative_sample(
            h.to(ctx.device), ctx.shard(w), drafts_cfg, None if probs is None else ctx.shard(probs, dim=2),
            vocab_start=ctx.start, **{k: ctx.to(v) for k, v in shard_cfg.items()})}
        if ctx.rank == 0:
            entry["expected"] = fs.speculative_sample(h.to(ctx.device), w.to(ctx.device), drafts_cfg,
                                                      ctx.to(probs), **{k: ctx.to(v) for k, v in cfg.items()})
        out[name] = entry
    return out


def scenario_whole_rows_layouts(ctx: Ctx):
    """The whole rows' route where the shards do not tile [0, vocab_size): every rank returns
    token -1 without waiting on a peer, the rank whose shard lies outside raising; an empty batch
    with a mask; no seed (rank 0 draws and broadcasts it)."""
    hidden, weight = integer_problem(seed=12)
    h, w = hidden.bfloat16().to(ctx.device), ctx.shard(weight.bfloat16())
    common = dict(temperature=0.9, seed=3, top_p=0.8, vocab_start=ctx.start)
    out = {"gap": tp.sample(h, w, vocab_size=VOCAB + 5, **common)}
    try:
        out["short"] = tp.sample(h, w, vocab_size=VOCAB - 1, **common)
    except ValueError as exc:
        out["short_error"] = str(exc)
    mask = ctx.shard(random_mask(BATCH, VOCAB, 0.5, seed=13), dim=1)
    out["empty_batch"] = tp.sample(h[:0], w, vocab_size=VOCAB, allowed_mask=mask[:0], **common)
    torch.manual_seed(77)  # rank 0's generator draws the seed; the others' are not read
    no_seed = {k: v for k, v in common.items() if k != "seed"}
    out["no_seed"] = tp.sample(h, w, vocab_size=VOCAB, num_samples=4, **no_seed)
    torch.manual_seed(77)
    out["no_seed_search"] = tp.sample(h, w, num_samples=4, **no_seed)
    return out


SCENARIOS = [scenario_tokens, scenario_masks, scenario_logprobs, scenario_chi_square, scenario_back_to_back,
             scenario_no_seed, scenario_truncation, scenario_whole_rows_layouts, scenario_serving, scenario_speculative]


def _worker(rank, world, group_kind, store, out_dir):
    torch.set_num_threads(1)
    if group_kind == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    elif group_kind == GLOO_ON_ONE_GPU:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:
        device = torch.device("cpu")
    backend = "nccl" if group_kind == "nccl" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        ctx = Ctx(rank, world, device)
        for scenario in SCENARIOS:
            try:
                results[scenario.__name__] = _cpu(scenario(ctx))
            except Exception:  # noqa: BLE001 - reported by the test that reads it
                results[scenario.__name__] = {"exception": traceback.format_exc()}
        if device.type == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


# Every rank's CUDA kernels on one GPU, the collectives through gloo on the host: the CUDA path
# across 2-8 ranks (shards, merges, the survivor search's all-reduces) where fewer GPUs than ranks are.
GLOO_ON_ONE_GPU = "gloo-one-gpu"


@functools.lru_cache(maxsize=None)
def run_job(group_kind, world):
    """Every rank's results of every scenario: {scenario: [rank 0 dict, rank 1 dict, ...]}.
    `group_kind`: "gloo" (CPU tensors), "nccl" (rank r on GPU r) or GLOO_ON_ONE_GPU."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, group_kind, os.path.join(tmp, "store"), tmp), nprocs=world, join=True)
        per_rank = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    return {name: [ranks[name] for ranks in per_rank] for name in per_rank[0]}
