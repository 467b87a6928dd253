"""Tensor-parallel FlashSampling: the LM-head weight is split by vocabulary over the
ranks of a torch.distributed process group and every rank returns the same tokens.

Each rank runs the fused sampler (``torch.ops.flashsampling.sample_with_scores``) on its
shard ``weight_shard [V_r, D]``, whose row 0 is global vocabulary index ``vocab_start``.
The noise of element ``(b, s, v)`` is keyed by the *global* index ``vocab_start + v``,
so a shard's perturbed scores are exactly the single-process scores of those tokens, and
the global winner is the best shard winner under the order of philox_gumbel.h (larger
score, exact ties to the smaller index). The ranks exchange one packed summary per row
and sample with one all-gather of ``B * (S [+ ceil((S + 1) / 2)])`` int64 per rank:

    key[b, s]  = order-preserving int64 of (score, -token): the max over ranks is the winner
    (with log-probabilities) token_logprob[b, s] and logsumexp[b] of the shard, as fp32

so the tokens equal ``torch.ops.flashsampling.sample`` on the whole weight for the same
``(seed, offset)`` bit for bit (up to the fp32 accumulation order of the logits, as
between any two implementations), whatever the number and sizes of the shards.

Truncation (``top_k`` / ``top_p`` / ``min_p``, host scalars or ``[B]`` tensors, any order) is
global and exact, with one read of each shard's weight and no host read of a device value: each
rank computes its shard's logits once (one matmul), finds its share of the survivors of the whole
rows and samples them from those logits (``torch.ops.flashsampling.sample_from_logits``, the
noise of the fused op) as its mask. The survivors come from a radix search of each row's cut over
the global truncation order (flashsampling_cuda/shard_truncation.py: per round one kernel and one
all-reduce of ``B * 768`` int64; eight rounds for top_k, eight for top_p, one all-reduce for the
first token; a row's kernels stop reading once its cut is known), or off CUDA, for a host
``top_k`` up to 1024, from each shard's first ``k`` tokens in one all-gather of ``B * k`` int64.
With ``vocab_size`` the ranks instead assemble the whole rows' logits on every rank (one all-reduce
of ``(B + 1) * V`` int32 words) and each samples them with the single-process logits sampler: the same
tokens, one collective instead of up to seventeen (whose rounds make eager calls host-bound).

:func:`speculative_sample` verifies draft tokens across the shards (the single-process
:func:`flashsampling_cuda.speculative_sample`'s output on every rank) with one all-gather of
``O(B n)`` words for one-hot drafts, two for sampled drafts (its docstring lists what they carry).
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.distributed as dist
from torch import Tensor

from .logprobs import (LogprobsOutput, logprob_outputs, logprob_values, normalised, parse_logprob_args,
                       raw_logsumexp, tokens_ahead, top_entries, values_of_ids)
from .masks import int32_words, pack_allowed_mask, unpack_allowed_mask
from .noise import draw_seed as _draw_seed
from .penalties import Penalties, PenaltyState, parse_penalties, rule_logits
from .sampling import (LogitTransforms, SampleOutput, ScoredSample, _allowed_mask_arg, _call_op, _float32, _seed_arg,
                       _model_transform_args, _op_kwargs, _scored_sample, _sparse_bias_args, _temperature_args,
                       _truncation_order)
from .speculative import (SpeculativeOutput, acceptance_probability, accepted_count, check_draft_values,
                          draft_columns, empty_output, masked_target, one_hot_output, parse_step, position_samples,
                          step_output, target, values_at)
from .shard_truncation import MAX_SHARDED_VOCAB, Reduce, sharded_survivors, survivor_bitmask, whole_row_survivors
from .truncation import (Truncation, _first_in_order, key_of_rank, keep_prefix,
                         logits_truncation_args, materialized_logits, parse_truncation, scaled_logits,
                         temperature_scales, truncation_rank)

__all__ = ["sample", "speculative_sample", "shard_allowed_mask", "vocab_shards"]

# Token the op reports, per shard, for a row whose shard mask allows nothing (we pass it
# as the shard's empty_mask_token); -1 is the op's "every score NaN" token.
_SHARD_EMPTY = -2
_INT64_MIN = -(2**63)
# Keys below every candidate's key: a shard whose row has no candidate (all scores NaN)
# beats a shard whose mask row is empty; both lose to any real candidate.
_KEY_SHARD_EMPTY = _INT64_MIN
_KEY_NO_CANDIDATE = _INT64_MIN + 1  # (kShardKeyMaskEmpty / kShardKeyNoCandidate of shard_keys.h)


def vocab_shards(vocab: int, world_size: int) -> list[tuple[int, int]]:
    """``[(vocab_start, V_r)]`` of an even split of ``vocab`` rows over ``world_size``
    ranks (the first ``vocab % world_size`` shards one row longer), as Megatron/vLLM split
    a vocabulary-parallel LM head. Any other split works with :func:`sample` too."""
    if world_size < 1 or vocab < world_size:
        raise ValueError(f"cannot split V={vocab} over {world_size} ranks (each needs >= 1 row)")
    base, extra = divmod(vocab, world_size)
    shards, start = [], 0
    for r in range(world_size):
        size = base + (r < extra)
        shards.append((start, size))
        start += size
    return shards


def shard_allowed_mask(allowed_mask: Tensor, vocab_start: int, shard_vocab: int) -> Tensor:
    """The ``[B, ceil(V_r / 32)]`` int32 bitmask of the shard ``[vocab_start, vocab_start
    + V_r)`` cut from a global ``[B, ceil(V / 32)]`` int32 bitmask (bit ``v & 31`` of word
    ``v >> 5`` allows token ``v``), for any ``vocab_start`` (not only multiples of 32).
    Runs on the mask's device without a host sync; bits past the shard are cleared."""
    if allowed_mask.dtype != torch.int32 or allowed_mask.dim() != 2:
        raise ValueError(f"allowed_mask must be an int32 [B, words] tensor, got {allowed_mask.dtype} "
                         f"{list(allowed_mask.shape)}")
    if vocab_start < 0 or shard_vocab < 1 or vocab_start + shard_vocab > 32 * allowed_mask.shape[1]:
        raise ValueError(f"shard [{vocab_start}, {vocab_start + shard_vocab}) is outside the mask's "
                         f"{32 * allowed_mask.shape[1]} bits")
    words = (shard_vocab + 31) // 32
    first, shift = divmod(vocab_start, 32)
    g = allowed_mask.to(torch.int64) & 0xFFFFFFFF
    g = torch.cat([g, g.new_zeros(g.shape[0], words + 1)], dim=1)  # room for word first + words
    lo = g[:, first : first + words] >> shift
    hi = (g[:, first + 1 : first + 1 + words] << (32 - shift)) & 0xFFFFFFFF
    out = (lo | hi) & 0xFFFFFFFF
    tail = shard_vocab % 32
    if tail:
        out[:, -1] &= (1 << tail) - 1
    return int32_words(out)


def _group_info(group) -> tuple[int, int, str | None]:
    """(rank, world size, backend name) of `group`; (0, 1, None) without an initialised
    default group (then :func:`sample` is the single-process op)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None
    return dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)).lower()


def _comm_device(device: torch.device, backend: str | None) -> torch.device:
    """Where the collectives' tensors live: gloo (and other CPU backends) only take CPU
    tensors for all_gather; NCCL takes the CUDA tensors themselves."""
    if device.type == "cuda" and backend is not None and "nccl" not in backend:
        return torch.device("cpu")
    return device


def _shared_seed(generator, device: torch.device, rank: int, world: int, group, backend) -> Tensor:
    """Rank 0 of the group draws the seed and broadcasts it (one extra collective)."""
    comm = _comm_device(device, backend)
    seed = _draw_seed(generator, device) if rank == 0 else torch.empty((), dtype=torch.int64, device=comm)
    seed = seed.to(comm).reshape(1)
    if world > 1:
        dist.broadcast(seed, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return seed.reshape(()).to(device)


def _encode_keys(tokens: Tensor, scores: Tensor) -> Tensor:
    """int64 keys whose max is the better candidate (flashsampling/shard_keys.h): (order-
    preserving score bits) * 2^32 + (2^31 - 1 - token), the order of philox_gumbel.h's
    fs_candidate_better (the op never reports a NaN score: a row without candidates has -inf
    and token -1); _KEY_NO_CANDIDATE for token -1, _KEY_SHARD_EMPTY for _SHARD_EMPTY (-2).
    One kernel (torch.ops.flashsampling._shard_keys)."""
    return torch.ops.flashsampling._shard_keys(tokens, scores)


@torch.library.register_fake("flashsampling::_shard_keys")
def _shard_keys_fake(tokens, scores):
    return torch.empty_like(tokens)


@torch.library.register_fake("flashsampling::_merge_shard_keys")
def _merge_shard_keys_fake(gathered, num_samples, mask_empty_token):
    shape = (gathered.shape[1], num_samples)
    return tuple(gathered.new_empty(shape) for _ in range(3))


def _gather(summary: Tensor, world: int, group) -> Tensor:
    """[world, *summary.shape] of every rank's summary: one all-gather of the flattened
    summary into a fresh tensor (a new output per call: no buffer is reused while a
    peer may still read or write it)."""
    if world == 1:
        return summary[None]
    flat = summary.contiguous().view(-1)
    out = flat.new_empty(world * flat.numel())
    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather_single(out, flat, group=group)
    return out.view((world,) + tuple(summary.shape))


_INT64_MAX = 2**63 - 1  # pads a shard's candidate list shorter than k; sorts after every key
# Off CUDA, host top_k up to this take the first-k all-gather (one collective of B * k int64 a
# rank); larger ones, per-row tensors and top_p / min_p alone the radix search (shard_truncation.py).
_GATHERED_TOP_K_MAX = 1024


def _all_reduce(device: torch.device, group, backend) -> Reduce:
    """The ``reduce`` of :func:`~flashsampling_cuda.shard_truncation.sharded_survivors` in this
    group: an all-reduce (sum or min) of a ``[1, ...]`` integer tensor, on the collectives' device
    (in a group of one rank too: the tests capture its collectives in a CUDA graph there); without
    a process group (``backend`` None: the single-process sample) the tensor itself."""
    if backend is None:
        return lambda t, how: t
    comm = _comm_device(device, backend)
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN}

    def reduce(t: Tensor, how: str) -> Tensor:
        buffer = t.to(comm).contiguous()  # a fresh tensor per collective or t's own storage, not reused after
        dist.all_reduce(buffer, op=ops[how], group=group)
        return buffer.to(device)

    return reduce


def _kernel_search(y: Tensor) -> bool:
    """Whether the radix search runs as CUDA kernels (shard_truncation.survivor_bitmask): every form
    on CUDA (its kernels read the shard's logits once a round, where the first ``k`` cost a top-k
    selection over int64 order keys)."""
    return y.is_cuda and y.shape[1] <= MAX_SHARDED_VOCAB


def _searches_in_torch(truncation: Truncation, order: str) -> bool:
    """Off the kernels, whether the survivors come from the radix search in torch ops rather than
    the all-gather of each shard's first ``k``: every form but a host top_k up to
    _GATHERED_TOP_K_MAX (the joint order normalises top_p over every allowed token: the search has
    that mass)."""
    k = truncation.top_k
    return not isinstance(k, int) or k > _GATHERED_TOP_K_MAX or order == "joint"


def _searched_survivor_mask(y: Tensor, mask: Tensor | None, truncation: Truncation, *, vocab_start: int, order: str,
                            group, backend, row_scales: Tensor | None = None) -> Tensor:
    """The int32 bitmask of this shard's survivors by the CUDA kernels of the radix search (``y``
    float32 ``[B, V_r]`` on CUDA, or its ``x`` with ``row_scales``: survivor_bitmask; ``mask`` the
    shard's allowed bitmask or None)."""
    return survivor_bitmask(y.contiguous(), mask, vocab_start, truncation, order,
                            _all_reduce(y.device, group, backend), row_scales)


def _shard_survivors(y: Tensor, allowed: Tensor | None, truncation: Truncation, *, vocab_start: int, order: str,
                     world: int, group, backend) -> Tensor:
    """This shard's survivors (bool ``[B, V_r]``, within ``allowed``) of the global truncation of
    the rows whose shard of ``y`` (:func:`scaled_logits`) this rank holds (module docstring)."""
    k = truncation.top_k
    batch, shard_vocab = y.shape
    device = y.device
    if _kernel_search(y):
        mask = None if allowed is None else pack_allowed_mask(allowed)
        return unpack_allowed_mask(_searched_survivor_mask(y, mask, truncation, vocab_start=vocab_start, order=order,
                                                           group=group, backend=backend), shard_vocab)
    if _searches_in_torch(truncation, order):
        ids = torch.arange(vocab_start, vocab_start + shard_vocab, device=device)
        return sharded_survivors(y[None], None if allowed is None else allowed[None], ids, truncation, order,
                                 _all_reduce(device, group, backend))[0]
    rank = truncation_rank(y, allowed)
    width = min(k, shard_vocab)
    first_local = (_first_in_order(rank, width) if width < shard_vocab
                   else torch.sort(rank, dim=1, stable=True).indices)
    # (order rank, global id): the single-process order (ties to the smaller global id).
    keys = rank.gather(1, first_local) * 2**31 + (first_local + vocab_start)
    if width < k:
        keys = torch.cat([keys, keys.new_full((batch, k - width), _INT64_MAX)], dim=1)
    gathered = _gather(keys.to(_comm_device(device, backend)), world, group).to(device)  # [W, B, k]
    first = torch.topk(gathered.permute(1, 0, 2).reshape(batch, -1), k, dim=1, largest=False, sorted=True).values
    keep = keep_prefix(key_of_rank(first >> 31), first != _INT64_MAX, truncation, order)
    local = (first & 0x7FFFFFFF) - vocab_start
    mine = keep & (local >= 0) & (local < shard_vocab)
    survivors = torch.zeros((batch, shard_vocab + 1), dtype=torch.bool, device=device)
    survivors.scatter_(1, torch.where(mine, local, shard_vocab), True)  # others land in the spare column
    survivors = survivors[:, :shard_vocab]
    return survivors if allowed is None else survivors & allowed


def _shard_logits(hidden: Tensor, weight_shard: Tensor, vocab_start: int, logit_bias, sparse_logit_bias,
                  allowed_mask, scale: float, softcap: float | None,
                  penalties: Penalties | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(x, raw, mask)``: this shard's fp32 logits ``raw`` (one matmul: the one read of the
    shard's weight), ``x`` the rule of flashsampling_cuda/penalties.py on them (model-side
    transforms, biases, penalties) and the shard's int32 ``allowed_mask`` bitmask (or None)."""
    sparse_ids, sparse_values = _sparse_bias_args(sparse_logit_bias, hidden)
    raw = materialized_logits(hidden, weight_shard)
    x = rule_logits(raw, _float32("logit_bias", logit_bias), sparse_ids, sparse_values, vocab_start, scale, softcap,
                    penalties)
    return x, raw, _allowed_mask_arg(allowed_mask, hidden, weight_shard)


def _truncated_shard_logits(hidden: Tensor, weight_shard: Tensor, vocab_start: int, truncation: Truncation,
                            order: str, temperature, logit_bias, sparse_logit_bias, allowed_mask, scale: float,
                            softcap: float | None, penalties: Penalties | None, world: int, group,
                            backend) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, raw, mask)``: :func:`_shard_logits`' ``x`` and ``raw``, and the int32
    ``[B, ceil(V_r / 32)]`` bitmask of the shard's survivors of the global truncation of
    ``y = x / T`` (module docstring), within the shard's ``allowed_mask``."""
    scalar_temperature, temperatures = _temperature_args(temperature, hidden)
    x, raw, mask = _shard_logits(hidden, weight_shard, vocab_start, logit_bias, sparse_logit_bias, allowed_mask, scale,
                                 softcap, penalties)
    if _kernel_search(x):  # the kernels write the bitmask, taking y = x / T as they read x
        scales = temperature_scales(x.shape[0], scalar_temperature, temperatures, x.device)
        return x, raw, _searched_survivor_mask(x, mask, truncation, vocab_start=vocab_start, order=order, group=group,
                                               backend=backend, row_scales=scales)
    y = scaled_logits(x, scalar_temperature, temperatures)
    allowed = None if mask is None else unpack_allowed_mask(mask, weight_shard.shape[0])
    return x, raw, pack_allowed_mask(_shard_survivors(y, allowed, truncation, vocab_start=vocab_start, order=order,
                                                      world=world, group=group, backend=backend))


def _gathers_whole_rows(vocab_size: int | None, serving_logprobs: bool) -> bool:
    """Whether a truncated call takes the whole-rows route (:func:`_sampled_whole_rows`): where the
    caller gave ``vocab_size`` and the logits sampler takes rows of that size, for the outputs of
    ``sample_from_logits`` (tokens, their log-probabilities and logsumexp; top log-probabilities,
    token ids' and raw ones take the search), up to the search kernels' vocabulary (whose cut the
    other orders take over the whole rows). Every input here is the same on every rank, so
    every rank takes the same route."""
    return vocab_size is not None and vocab_size <= MAX_SHARDED_VOCAB and not serving_logprobs


def _whole_rows(x: Tensor, mask: Tensor | None, vocab_start: int, vocab_size: int, fits: bool,
                reduce: Reduce) -> tuple[Tensor, Tensor | None]:
    """``(x, mask)`` of the whole rows on every rank, from each rank's columns, in one all-reduce
    (sum) of int32 words: the ``[B, V]`` bits of ``x`` (this rank's columns at their global place,
    zero elsewhere), a ``[V]`` count of the ranks that hold each column, and with ``mask`` the
    ``[B, ceil(V / 32)]`` words of the whole rows' bitmask (a rank's bits at its columns: where the
    shards tile ``[0, V)`` no two ranks' bits share a place, so the sum is their union). A rank whose
    shard does not fit in ``[0, V)`` or whose mask is malformed (``fits`` False) writes no column but
    a count of 2 for column 0, and raises after the all-reduce, so that its peers do not wait for it. Exact where the shards tile
    ``[0, V)``, whatever their sizes and order: a column has one summand that is not zero. Where they
    do not (a column that no rank or two hold, a shard out of range: a wrong ``vocab_size`` or
    layout) every logit is NaN, so that every rank returns token -1 rather than garbage."""
    batch, shard_vocab = x.shape
    mask_words = (vocab_size + 31) // 32
    logit_words = (batch + 1) * vocab_size
    buffer = x.new_zeros((logit_words + (0 if mask is None else batch * mask_words),), dtype=torch.int32)
    # (a rank that does not fit may hold a malformed mask: its words stay zero)
    rows = buffer[:logit_words].view(batch + 1, vocab_size)
    if fits:
        rows[:batch, vocab_start : vocab_start + shard_vocab] = x.view(torch.int32)
        rows[batch, vocab_start : vocab_start + shard_vocab] = 1
        if mask is not None:
            allowed = torch.zeros((batch, vocab_size), dtype=torch.bool, device=x.device)
            allowed[:, vocab_start : vocab_start + shard_vocab] = unpack_allowed_mask(mask, shard_vocab)
            buffer[logit_words:].view(batch, mask_words).copy_(pack_allowed_mask(allowed))
    else:
        rows[batch, 0] = 2
    buffer = reduce(buffer[None], "sum")[0]
    rows = buffer[:logit_words].view(batch + 1, vocab_size)
    whole_x = torch.where((rows[batch] == 1).all(), rows[:batch].view(torch.float32), float("nan"))
    whole_mask = None if mask is None else buffer[logit_words:].view(batch, mask_words)
    return whole_x, whole_mask


def _sampled_whole_rows(hidden: Tensor, weight_shard: Tensor, vocab_start: int, vocab_size: int,
                        truncation: Truncation, order: str, args: dict, empty_mask_token: int | None,
                        transform_args: tuple, return_logprobs: bool, group, backend):
    """The sample of a truncated call from the whole rows' logits on every rank: each rank's
    :func:`_shard_logits` (its one read of the weight), :func:`_whole_rows` (one all-reduce), then
    ``torch.ops.flashsampling.sample_from_logits`` over ``[B, V]`` (its kernel truncates the
    rows in the order ``"top_k_first"``; other orders hand it ``whole_row_survivors`` as its mask).
    Every rank computes the same outputs; the tokens are those of the search across ranks (the same
    survivors of the same logits, the same noise keyed by global id)."""
    shard_vocab, words = weight_shard.shape[0], (weight_shard.shape[0] + 31) // 32
    x, _, mask = _shard_logits(hidden, weight_shard, vocab_start, args["logit_bias"], args["sparse_logit_bias"],
                               args["allowed_mask"], *transform_args)
    # A rank's own mistake is raised after the all-reduce, so that its peers return -1 instead of waiting.
    problem = None
    if not 0 <= vocab_start <= vocab_size - shard_vocab:
        problem = (f"vocab_size must cover this rank's shard, rows [{vocab_start}, {vocab_start + shard_vocab}) of "
                   f"[0, vocab_size), got vocab_size = {vocab_size}")
    elif mask is not None and (mask.dtype != torch.int32 or tuple(mask.shape) != (x.shape[0], words)):
        problem = (f"allowed_mask must be an int32 [B, ceil(V_r / 32)] = [{x.shape[0]}, {words}] bitmask or a bool "
                   f"[B, V_r] tensor, got {mask.dtype} {list(mask.shape)}")
    x, mask = _whole_rows(x, mask, vocab_start, vocab_size, problem is None, _all_reduce(x.device, group, backend))
    if problem is not None:
        raise ValueError(f"flashsampling.distributed.sample: {problem}")
    scalar_temperature, temperatures = _temperature_args(args["temperature"], hidden)
    truncation_args = logits_truncation_args(truncation, hidden.shape[0], hidden.device)
    if order != "top_k_first":  # the kernel truncates top_k first: hand it the survivors as its mask
        if mask is None and empty_mask_token is None:
            empty_mask_token = -1  # truncation keeps each row's top token: no row is empty, nothing to check
        mask = whole_row_survivors(x, mask, 0, truncation, order, scalar_temperature, temperatures)
        truncation_args = {}
    tokens, _, logprobs, logsumexp = torch.ops.flashsampling.sample_from_logits(
        x, temperature=scalar_temperature, temperatures=temperatures, num_samples=args["num_samples"],
        seed=_seed_arg("seed", args["seed"]), offset=_seed_arg("offset", args["offset"]), allowed_mask=mask,
        empty_mask_token=empty_mask_token, return_logprobs=return_logprobs, **truncation_args)
    return SampleOutput(tokens, logprobs, logsumexp) if return_logprobs else tokens


def _sampled_from_logits(hidden: Tensor, weight_shard: Tensor, x: Tensor, raw: Tensor, args: dict,
                         return_logprobs: bool, context: dict) -> tuple[ScoredSample, dict]:
    """:func:`_scored_sample` of a truncated call from the shard's logits ``x`` (biases and
    penalties applied) and ``raw`` (the matmul's) instead of another pass over the weight: the
    survivors are ``args["allowed_mask"]``, ``torch.ops.flashsampling.sample_from_logits`` samples
    them with the noise of the fused op, and ``context`` and the route are those of the logits
    route (flashsampling_cuda/logprobs.py reads the outputs' values from them)."""
    kwargs = _op_kwargs(hidden, weight_shard, **args, context=context)
    route = dict(op="sample_from_logits", logits=x, logit_bias=None, raw_logits=raw)
    return ScoredSample(*_call_op(hidden, weight_shard, kwargs, route, return_logprobs)), route


def sample(
    hidden: Tensor,
    weight_shard: Tensor,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    num_samples: int = 1,
    logit_bias: Tensor | None = None,
    sparse_logit_bias=None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    return_logprobs: bool = False,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    truncation_order: str = "top_k_first",
    vocab_size: int | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    repetition_penalty: float | Tensor | None = None,
    frequency_penalty: float | Tensor | None = None,
    presence_penalty: float | Tensor | None = None,
    penalty_state: PenaltyState | None = None,
    prompt_token_ids=None,
    output_token_ids=None,
    top_logprobs: int = 0,
    token_ids=None,
    logprobs_mode: str = "processed",
) -> Tensor | SampleOutput | LogprobsOutput:
    r"""Tensor-parallel exact sampling: every rank of ``group`` holds a vocabulary shard.

    Call it on every rank of the group with the same ``hidden``, ``temperature``,
    ``seed``/``offset``, ``num_samples``, ``sparse_logit_bias`` and ``return_logprobs``;
    each rank passes its own ``weight_shard`` and ``vocab_start`` (shards may have
    different sizes and come in any order, but must tile ``[0, V)`` without overlap) and
    its own slices of ``logit_bias`` and ``allowed_mask``. Every rank returns the same
    tensors.

    The result equals :func:`flashsampling_cuda.sample` on the whole weight with the same
    arguments and the same ``(seed, offset)``: the noise of each token is keyed by its
    global id, and the winner across ranks is the best shard winner under the op's
    order (larger score, exact ties to the smaller id). The tokens are identical
    wherever the fp32 logits are (an implementation that sums the logits in another fp32
    order can change a token only at a near tie, as between the CPU and the GPU op);
    merged log-probabilities agree with the single-process ones to fp32 rounding.

    Communication: one all-gather of ``B * S`` int64 per rank (``B * (S + ceil((S + 1) /
    2))`` with ``return_logprobs``: each shard's token log-probability and logsumexp ride
    along as fp32) into a tensor allocated per call, so back-to-back calls never reuse a
    buffer that a peer may still read. NCCL for CUDA tensors, gloo for CPU tensors (CUDA
    tensors on a gloo group: the summary goes through the CPU). Without an initialised
    default process group and ``group=None``, it is the single-process op.

    Args:
        hidden: ``[B, D]`` hidden states, the same on every rank (dtypes and devices as
            for :func:`flashsampling_cuda.sample`).
        weight_shard: ``[V_r, D]``, ``V_r >= 1``: rows ``[vocab_start, vocab_start + V_r)``
            of the LM-head weight.
        vocab_start: global id of ``weight_shard[0]``; the returned tokens are global ids.
        group: the tensor-parallel process group (default: the default group).
        temperature: float, 0-d or ``[B]`` tensor, finite and ``>= 0`` (0 = greedy).
        generator, seed, offset: as for :func:`flashsampling_cuda.sample`; ``seed`` and
            ``offset`` (int, 0-d or ``[B]`` int64) must be the same on every rank. **With
            no seed**, rank 0 of the group draws a batch-wide 64-bit seed from
            ``generator`` (default: the default generator of ``hidden``'s device; the other
            ranks' generators are neither used nor advanced), ``offset`` 0, and broadcasts
            it: one more collective per call. Pass a seed (advancing ``offset`` by
            ``num_samples`` per step) to sample with a single all-gather.
        num_samples: independent draws per row.
        logit_bias: ``[V_r]`` float, this shard's slice of the ``[V]`` bias.
        sparse_logit_bias: as for :func:`flashsampling_cuda.sample` (``(ids, values)``
            ``[B, K]`` tensors or ``B`` dicts), with global ids, the same on every rank:
            each shard applies the ids it holds.
        allowed_mask: this shard's mask: an int32 ``[B, ceil(V_r / 32)]`` bitmask of the
            shard's local rows (:func:`shard_allowed_mask` cuts it from a global one) or a
            bool ``[B, V_r]`` tensor. A shard may allow nothing in a row; a row that no
            shard allows gets ``empty_mask_token``, or raises a ``RuntimeError`` on every
            rank (after the all-gather; a host sync) when that is None.
        empty_mask_token: token for rows that no shard allows (default: an error).
        return_logprobs: also return each token's log-probability under ``softmax(y)`` over
            the whole allowed vocabulary and the per-row logsumexp (see
            :func:`flashsampling_cuda.sample`); under truncation, over the survivors.
        top_k, top_p, min_p: global truncation as in :func:`flashsampling_cuda.sample`,
            the same on every rank: one fp32 logits matmul of each rank's shard (the only read of
            its weight), the survivors' radix search (module docstring: 17 small all-reduces at
            most, none read on the host), and the sample from those logits. ``truncation_order``
            as for :func:`flashsampling_cuda.sample`.
        vocab_size: the whole vocabulary's size ``V`` (the end of the tiling of ``[0, V)``), the
            same on every rank (as is whether ``allowed_mask`` is given), or None. Given, a truncated call with ``V`` up to 2^21 and
            without top / token-id / raw log-probabilities assembles the whole rows' fp32
            logits on every rank instead of searching the cut across them: one all-reduce of
            ``B · V + V`` int32 words (``+ B · ceil(V / 32)`` with ``allowed_mask``), then the
            single-process logits sampler over ``[B, V]`` on every rank. The same tokens as the
            search; far fewer collectives and launches (the search's host time dominates eager
            calls), for more bytes exchanged and each rank truncating whole rows. Where the
            shards do not tile ``[0, vocab_size)`` every rank returns token -1 (NaN
            log-probabilities), and a rank whose shard lies outside raises a ``ValueError``
            (after the all-reduce, so that its peers do not wait).
        logit_scale, logit_softcap, repetition_penalty, frequency_penalty, presence_penalty,
            penalty_state, prompt_token_ids, output_token_ids: as for
            :func:`flashsampling_cuda.sample`, the same on every rank (the history holds global
            ids; each shard transforms the logits of the tokens it holds, so nothing more is
            exchanged).
        top_logprobs, token_ids, logprobs_mode: as for :func:`flashsampling_cuda.sample`, exact
            over the whole vocabulary: each shard's first ``top_logprobs`` entries, its values of
            ``token_ids`` and of its own sample ride in the same all-gather (float64), and the
            sampled tokens' ranks take one more all-gather of ``B * num_samples`` int64 (each
            shard's count of tokens ahead of them).

    Returns:
        ``[B, num_samples]`` int64 global token ids (``-1`` for a row whose scores are all
        NaN), or with ``return_logprobs`` a :class:`flashsampling_cuda.SampleOutput`
        ``(tokens, logprobs [B, S] float32, logsumexp [B] float32)`` (NaN log-probabilities
        where the token is -1 or ``empty_mask_token``, ``logsumexp = -inf`` for a row that
        nothing allows); with ``top_logprobs``, ``token_ids`` or ``logprobs_mode="raw"`` a
        :class:`flashsampling_cuda.LogprobsOutput`, the fields of the single-process op.
    """
    rank, world, backend = _group_info(group)
    device = hidden.device
    if vocab_size is not None:
        given = vocab_size
        try:
            vocab_size = 0 if isinstance(given, bool) else operator.index(given)
        except TypeError:
            vocab_size = 0
        if vocab_size < 1:
            raise ValueError(f"flashsampling.distributed.sample: vocab_size must be a positive int or None, got "
                             f"{given!r}")
    top_n, wanted_ids, mode = parse_logprob_args(return_logprobs, top_logprobs, token_ids, logprobs_mode,
                                                 hidden.shape[0], device)
    serving_logprobs = top_n > 0 or wanted_ids is not None or mode != "processed"
    scale, softcap = _model_transform_args(logit_scale, logit_softcap)
    penalties = parse_penalties(repetition_penalty, frequency_penalty, presence_penalty, penalty_state,
                                prompt_token_ids, output_token_ids, hidden)
    # The history as one state for both uses below (id lists become device tensors once).
    transforms = LogitTransforms(scale, softcap, repetition_penalty, frequency_penalty, presence_penalty,
                                 None if penalties is None else penalties.state)
    if seed is None:
        if offset is not None:
            raise ValueError("flashsampling.distributed.sample: offset was given without seed")
        seed = _shared_seed(generator, device, rank, world, group, backend)
    elif generator is not None:
        raise ValueError("flashsampling.distributed.sample: pass either seed or generator, not both")
    user_mask = allowed_mask
    truncation = parse_truncation(top_k, top_p, min_p, hidden, "flashsampling.distributed.sample")
    order = _truncation_order(truncation_order, truncation)
    context: dict = {}
    args = dict(temperature=temperature, generator=None, seed=seed, offset=offset, num_samples=num_samples,
                logit_bias=logit_bias, sparse_logit_bias=sparse_logit_bias, allowed_mask=allowed_mask,
                empty_mask_token=None if allowed_mask is None else _SHARD_EMPTY, vocab_start=vocab_start)
    if truncation is not None and backend is not None and _gathers_whole_rows(vocab_size, serving_logprobs):
        return _sampled_whole_rows(hidden, weight_shard, vocab_start, vocab_size, truncation, order,
                                   args, empty_mask_token, (scale, softcap, penalties), return_logprobs, group,
                                   backend)
    if truncation is not None and backend is not None:  # the survivors become this shard's mask; the sample reads its logits
        # Dicts become the (ids, values) pair once (a host-to-device copy), for both uses.
        sparse_ids, sparse_values = _sparse_bias_args(sparse_logit_bias, hidden)
        sparse_logit_bias = None if sparse_ids is None else (sparse_ids, sparse_values)
        x, raw, survivors = _truncated_shard_logits(hidden, weight_shard, vocab_start, truncation, order, temperature,
                                                    logit_bias, sparse_logit_bias, allowed_mask, scale, softcap,
                                                    penalties, world, group, backend)
        args.update(logit_bias=None, sparse_logit_bias=None, allowed_mask=survivors, empty_mask_token=_SHARD_EMPTY)
        (tokens, scores, token_logprobs, logsumexp), route = _sampled_from_logits(
            hidden, weight_shard, x, raw, args, return_logprobs, context)
    else:  # plain sampling, or without a process group the single-process op's truncation routes
        (tokens, scores, token_logprobs, logsumexp), route = _scored_sample(
            hidden, weight_shard,
            dict(args, top_k=top_k, top_p=top_p, min_p=min_p, truncation_path="auto", truncation_order=truncation_order),
            transforms, return_logprobs, False, context, logits_wanted=serving_logprobs)
    batch, samples = tokens.shape
    if batch == 0:  # the same on every rank: nothing to exchange
        if serving_logprobs:
            return logprob_outputs(hidden, weight_shard, context, route, tokens, token_logprobs, logsumexp, top_n,
                                   wanted_ids, mode)
        return SampleOutput(tokens, token_logprobs, logsumexp) if return_logprobs else tokens
    keys = _encode_keys(tokens, scores)
    if return_logprobs:
        # The fp32 [B, S] token log-probabilities and [B] logsumexp ride in the same
        # int64 buffer (viewed as fp32), so one collective carries everything.
        float_words = (samples + 2) // 2
        summary = keys.new_empty((batch, samples + float_words))
        summary[:, :samples] = keys
        floats = summary[:, samples:].view(torch.float32)
        floats[:, :samples] = token_logprobs
        floats[:, samples] = logsumexp
        floats[:, samples + 1 :] = 0.0
    else:
        summary = keys
    if serving_logprobs:
        values = logprob_values(hidden, weight_shard, context, route, mode)
        extra = _shard_logprob_summary(values, tokens, vocab_start, top_n, wanted_ids, mode)
        columns = summary.shape[1]
        summary = torch.cat([summary, extra], dim=1)
    gathered = _gather(summary.to(_comm_device(device, backend)), world, group).to(device)  # [W, B, C]

    # [B, S]: the winning key, its first rank, and the token (-1 where no shard has a candidate;
    # where no shard's mask allows anything: empty_mask_token, else -1 and, with a user mask, an
    # error below; truncation alone keeps every row's top token, so never the case there).
    mask_empty_token = -1 if user_mask is None or empty_mask_token is None else int(empty_mask_token)
    best, winner, out_tokens = torch.ops.flashsampling._merge_shard_keys(gathered, samples, mask_empty_token)
    if user_mask is not None and empty_mask_token is None:
        empty_rows = (best[:, 0] == _KEY_SHARD_EMPTY).nonzero().flatten().cpu()
        if empty_rows.numel() > 0:  # every rank sees the same gathered keys: all raise
            first = ", ".join(str(int(r)) for r in empty_rows[:8])
            raise RuntimeError(
                f"flashsampling.sample: allowed_mask allows no token in {empty_rows.numel()} row(s) "
                f"(first: {first}) on any of the {world} shards; fix the mask, or pass "
                "empty_mask_token to get that token for such rows"
            )
    if not return_logprobs:
        return out_tokens
    nothing_allowed = best == _KEY_SHARD_EMPTY

    floats = gathered[:, :, samples:].view(torch.float32)
    shard_lp = floats[:, :, :samples].double()  # [W, B, S]
    shard_lse = floats[:, :, samples].double()  # [W, B]
    lse = torch.logsumexp(shard_lse, dim=0)  # [B]
    rows = torch.arange(batch, device=device)[:, None]
    # logprob = y[token] - lse, with y[token] = logprob_r + lse_r of the winning rank r.
    logprobs = shard_lp.gather(0, winner[None]).squeeze(0) + shard_lse[winner, rows] - lse[:, None]
    logprobs = torch.where((best == _KEY_NO_CANDIDATE) | nothing_allowed, torch.nan, logprobs)
    if not serving_logprobs:
        return SampleOutput(out_tokens, logprobs.float(), lse.float())
    real = (best != _KEY_NO_CANDIDATE) & ~nothing_allowed
    return _merged_logprob_outputs(gathered[:, :, columns:], values, vocab_start, out_tokens, winner, real,
                                   logprobs.float(), lse.float(), top_n, 0 if wanted_ids is None else
                                   wanted_ids.shape[1], mode, world, group, backend)


def _shard_logprob_summary(values: Tensor, tokens: Tensor, vocab_start: int, top_n: int, wanted_ids: Tensor | None,
                           mode: str) -> Tensor:
    """int64 ``[B, N + 2 * ... ]``: what this shard adds to the all-gather for the logprob outputs
    (:func:`flashsampling_cuda.logprobs.logprob_values` are its ``values``): the ids of its first
    ``N`` entries, then as float64 bits their values, its values of its own sample's tokens and
    of ``wanted_ids``, and in raw mode its raw log-sum-exp. Padding: id ``2^63 - 1``, value
    ``-inf`` (it sorts after every real entry)."""
    batch, shard_vocab = values.shape
    width = min(top_n, shard_vocab)
    top_values, top_local = top_entries(values, width)
    pad = top_n - width
    # (cat, not pad: pad's fill value goes through a float, and 2^63 - 1 is not one)
    top_ids = torch.cat([top_local + vocab_start, top_local.new_full((batch, pad), _INT64_MAX)], dim=1)
    top_values = torch.cat([top_values, top_values.new_full((batch, pad), -torch.inf)], dim=1)
    local = tokens - vocab_start
    mine = (local >= 0) & (local < shard_vocab)
    own = torch.where(mine, values.gather(1, torch.where(mine, local, 0)), torch.nan)
    floats = [top_values, own]
    if wanted_ids is not None:
        floats.append(values_of_ids(values, wanted_ids, vocab_start))
    if mode == "raw":
        floats.append(raw_logsumexp(values)[:, None])
    return torch.cat([top_ids, torch.cat([f.double() for f in floats], dim=1).view(torch.int64)], dim=1)


def _merged_logprob_outputs(gathered: Tensor, values: Tensor, vocab_start: int, tokens: Tensor, winner: Tensor,
                            real: Tensor, logprobs: Tensor, logsumexp: Tensor, top_n: int, num_ids: int, mode: str,
                            world: int, group, backend) -> LogprobsOutput:
    """The :class:`LogprobsOutput` of the whole vocabulary from every shard's
    :func:`_shard_logprob_summary` (``gathered [W, B, *]``), the merged sample (``tokens``, the
    rank ``winner`` that holds each, ``real``: a sampled token, not -1 or ``empty_mask_token``)
    and the processed ``logprobs`` / ``logsumexp`` already merged; one more all-gather for the
    ranks. Normalised as the single-process op does (:func:`normalised`)."""
    world_size, batch, _ = gathered.shape
    samples = tokens.shape[1]
    cand_ids = gathered[:, :, :top_n]
    floats = gathered[:, :, top_n:].contiguous().view(torch.float64)
    cand_values = floats[:, :, :top_n]
    own = floats[:, :, top_n : top_n + samples]
    wanted = floats[:, :, top_n + samples : top_n + samples + num_ids]
    lse = logsumexp
    if mode == "raw":
        lse = torch.logsumexp(floats[:, :, top_n + samples + num_ids], dim=0)  # float64 [B]
        logsumexp = lse.float()
    token_values = own.gather(0, winner[None]).squeeze(0).float()  # [B, S]: the winning shard's value
    mine = normalised(token_values, lse, mode)
    if mode == "raw":
        logprobs = torch.where(real, mine, torch.nan)
    # Ranks: every shard counts its entries ahead of each token; the counts add up.
    shard_ids = torch.arange(values.shape[1], device=values.device) + vocab_start
    ahead = tokens_ahead(normalised(values, lse, mode), shard_ids, mine, tokens)
    total = _gather(ahead.to(_comm_device(values.device, backend)), world, group).to(values.device).sum(dim=0)
    ranks = torch.where(real, total + 1, 0)
    flat = cand_values.permute(1, 0, 2).reshape(batch, world_size * top_n).float()
    top_logprobs, top_ids = top_entries(normalised(flat, lse, mode), top_n,
                                        cand_ids.permute(1, 0, 2).reshape(batch, world_size * top_n))
    top_ids = torch.where(top_ids == _INT64_MAX, -1, top_ids)  # N > V: -1 and -inf past the vocabulary
    # A token id's value comes from the one shard that holds it (NaN from the others).
    held = wanted[0]
    for r in range(1, world_size):
        held = torch.fmax(held, wanted[r])
    token_ids_logprobs = normalised(held.float(), lse, mode)
    return LogprobsOutput(tokens, logprobs, logsumexp, top_ids, top_logprobs, ranks, token_ids_logprobs)


def _all_gather_columns(ints: list[Tensor], floats: list[Tensor], world: int, group, backend
                        ) -> tuple[list[Tensor], list[Tensor]]:
    """Every rank's int64 and float64 ``[B, k_i]`` columns through one all-gather (the floats'
    bits ride as int64): ``[W, B, k_i]`` each, in the order given."""
    parts = [t.to(torch.int64) for t in ints] + [t.double().contiguous().view(torch.int64) for t in floats]
    device = parts[0].device
    gathered = _gather(torch.cat(parts, dim=1).to(_comm_device(device, backend)), world, group).to(device)
    out, begin = [], 0
    for i, part in enumerate(parts):
        piece = gathered[:, :, begin : begin + part.shape[1]].contiguous()
        out.append(piece if i < len(ints) else piece.view(torch.float64))
        begin += part.shape[1]
    return out[: len(ints)], out[len(ints) :]


def speculative_sample(
    hidden: Tensor,
    weight_shard: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    *,
    vocab_start: int,
    group: dist.ProcessGroup | None = None,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    logit_bias: Tensor | None = None,
    allowed_mask: Tensor | None = None,
    return_logprobs: bool = False,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> SpeculativeOutput:
    r"""Tensor-parallel speculative-decoding verification: every rank of ``group`` holds a
    vocabulary shard, and every rank returns the :class:`flashsampling_cuda.SpeculativeOutput` of
    :func:`flashsampling_cuda.speculative_sample` on the whole weight with the same arguments and
    ``(seed, offset)``: the same tokens and ``num_accepted``, log-probabilities to float rounding.

    Call it on every rank with the same ``hidden``, ``draft_token_ids`` (global ids),
    ``temperature``, ``seed`` / ``offset`` and truncation; each rank passes its own
    ``weight_shard`` and ``vocab_start`` (shards tile ``[0, V)`` as for :func:`sample`) and its
    own slices of ``logit_bias``, ``allowed_mask`` and ``draft_probs``.

    Each rank computes its shard's target ``y`` at every position (fp32 logits of its shard,
    biases, mask, temperature; the truncation's survivors as in :func:`sample`) and exchanges
    ``O(B n)`` numbers (one all-gather of 8-byte words per rank, ``P = n + 1``):

    - one-hot drafts: one all-gather of ``B (n + 1)`` words (``3 B (n + 1)`` with
      ``return_logprobs``): per position the shard's Gumbel-Max key of the position's token
      ``t_j`` (a greedy row's argmax; with log-probabilities also the shard's log-sum-exp of ``y``
      and the ``y`` of its winner). The merged keys (:func:`sample`'s merge) give the ``t_j``, and
      a draft is accepted while it is its position's ``t_j``;
    - sampled drafts: the residual ``max(0, p - q)`` needs the global log-sum-exp first, so two:
      ``B (4 n + 1)`` words (the log-sum-exps, holder flags, ``y_d`` and ``q(d)``), then each
      shard's key of the residual (or bonus) sample, ``B (n + 1)`` words (``2 B (n + 1)`` with
      ``return_logprobs``).

    The sampled drafts' acceptance uniforms depend only on ``(seed, offset, stream, j)``, so
    every rank draws them itself. A truncation adds :func:`sample`'s survivor search over the ``B (n + 1)``
    rows (its all-reduces of ``B (n + 1) 768`` int64). Without ``seed``, rank 0
    draws it and broadcasts it (one more collective).

    Args:
        hidden: ``[B, n + 1, D]``, the same on every rank.
        weight_shard: ``[V_r, D]``: rows ``[vocab_start, vocab_start + V_r)`` of the LM head.
        draft_token_ids: ``[B, n]`` int64 global ids, the same on every rank.
        draft_probs: ``[B, n, V_r]`` floating, this shard's columns of the draft's probabilities
            ``q`` (global ids ``vocab_start ..``), or None for one-hot drafts.
        vocab_start: global id of ``weight_shard[0]``.
        group: the tensor-parallel process group (default: the default group).
        temperature, seed, offset, generator, top_k, top_p, min_p, return_logprobs: as for
            :func:`flashsampling_cuda.speculative_sample`, the same on every rank (``generator``:
            rank 0's draws the seed when ``seed`` is None).
        logit_bias: ``[V_r]``, this shard's slice.
        allowed_mask: this shard's per-row mask, int32 ``[B, ceil(V_r / 32)]``
            (:func:`shard_allowed_mask`) or bool ``[B, V_r]``; it applies at every position.

    Returns:
        :class:`flashsampling_cuda.SpeculativeOutput`, the same on every rank.
    """
    rank, world, backend = _group_info(group)
    if seed is not None and generator is not None:
        raise ValueError("flashsampling.distributed.speculative_sample: pass either seed or generator, not both")
    step = parse_step("flashsampling.distributed.speculative_sample", hidden, weight_shard, draft_token_ids,
                      draft_probs, temperature, seed, offset, top_k, top_p, min_p,
                      lambda: _shared_seed(generator, hidden.device, rank, world, group, backend), logit_scale,
                      logit_softcap, logit_bias, allowed_mask)
    n = step.n
    if step.batch == 0:  # the same on every rank: nothing to exchange
        return empty_output(hidden, n, return_logprobs)
    # Every rank raises alike (the ids are the same everywhere); q is this shard's columns: its sums
    # are the shard's mass, so only the ids are checked here.
    check_draft_values("flashsampling.distributed.speculative_sample", draft_token_ids, None, None)
    survivors = functools.partial(_shard_survivors, vocab_start=vocab_start, order="top_k_first", world=world,
                                  group=group, backend=backend)
    x, y, allowed = target(hidden, weight_shard, logit_bias, allowed_mask, step, survivors)
    yd = masked_target(y, allowed) if draft_probs is not None or return_logprobs else None

    def shard_keys(logp: Tensor | None, q: Tensor | None) -> tuple[list[Tensor], list[Tensor]]:
        """This shard's keys of the position samples and, with log-probabilities, its winners' y."""
        tokens, scores = position_samples(x, allowed, step, logp, q, vocab_start, _SHARD_EMPTY)
        return [_encode_keys(tokens, scores)], [values_at(yd, tokens - vocab_start)] if return_logprobs else []

    if draft_probs is None:  # one-hot drafts: each position's token, accepted while it is the draft
        ints, more = shard_keys(None, None)
        floats = [torch.logsumexp(yd, dim=2)] + more if return_logprobs else []
        (keys,), gathered = _all_gather_columns(ints, floats, world, group, backend)
        _, winner, emitted = torch.ops.flashsampling._merge_shard_keys(keys, n + 1, -1)
        emitted_logp = None
        if return_logprobs:
            lse = torch.logsumexp(gathered[0], dim=0)  # float64 [B, n + 1]: the target's normalisers
            emitted_logp = torch.where(emitted >= 0, gathered[1].gather(0, winner[None])[0] - lse, torch.nan)
        return one_hot_output(draft_token_ids, emitted, emitted_logp)
    # Sampled drafts: the residuals need p = exp(y - lse), so the normalisers first.
    safe, mine = draft_columns(draft_token_ids, vocab_start, weight_shard.shape[0])
    q = draft_probs.to(hidden.device)  # float64 one position at a time, not [B, n, V_r] at once
    floats = [torch.logsumexp(yd, dim=2), mine.double(), torch.where(mine, values_at(yd[:, :n], safe), torch.nan),
              torch.where(mine, q.gather(2, safe[:, :, None])[:, :, 0].double(), torch.nan)]
    _, gathered = _all_gather_columns([], floats, world, group, backend)
    lse = torch.logsumexp(gathered[0], dim=0)  # float64 [B, n + 1]
    held = gathered[1]
    owner = held.argmax(dim=0, keepdim=True)  # the rank that holds each draft
    inside = held.amax(dim=0) > 0
    y_draft = gathered[2].gather(0, owner)[0]
    q_draft = gathered[3].gather(0, owner)[0]
    ints, more = shard_keys(yd - lse[:, :, None], q)
    (keys,), gathered = _all_gather_columns(ints, more, world, group, backend)
    _, winner, emitted = torch.ops.flashsampling._merge_shard_keys(keys, n + 1, -1)
    # A greedy row's sample at j < n is the argmax (-1 where nothing is allowed: no draft matches).
    p_draft = torch.where(inside, (y_draft - lse[:, :n]).exp(), 0.0)
    num_accepted = accepted_count(step, acceptance_probability(p_draft, q_draft, inside),
                                  (draft_token_ids == emitted[:, :n]) & inside & (emitted[:, :n] >= 0))
    if not return_logprobs:
        return step_output(draft_token_ids, emitted, num_accepted, None, None)
    y_emitted = gathered[-1].gather(0, winner[None])[0]
    return step_output(draft_token_ids, emitted, num_accepted, torch.where(inside, y_draft - lse[:, :n], torch.nan),
                       torch.where(emitted >= 0, y_emitted - lse, torch.nan))
