"""Logprobs as serving APIs return them: the top-N log-probabilities of each row with the
sampled tokens' ranks, the log-probabilities of given token ids, processed or raw
(:func:`flashsampling_cuda.sample`'s ``top_logprobs``, ``token_ids``, ``logprobs_mode``).

- ``logprobs_mode="processed"`` (default): the distribution actually sampled from: ``y`` after
  the model-side transforms, biases, mask, penalties and temperature, truncated (tokens outside
  the survivors get ``-inf``), normalised by the call's ``logsumexp``, so a token's top-N entry
  equals its ``logprobs`` entry to the float32 rounding of that logsumexp.
- ``logprobs_mode="raw"``: ``log_softmax`` of the raw logits ``hidden @ weight.T`` (before
  everything else), for every logprob output, ``logprobs`` and ``logsumexp`` included.

Two routes, neither with a host sync (graphs and ``torch.compile`` work):

- **Fused** (CUDA, sm90; :func:`fused_top_logprobs_takes`: processed values, or raw ones without a
  bias; no truncation, penalties, model-side transforms, mask or sparse bias; one sample, at most
  64 rows, the batch-wide noise key):
  ``flashsampling._sample_top_logprobs``, one pass of the fused top-k GEMM with nothing on. It
  draws plain sampling's token (the tile winners), sums the log-sum-exp from its per-tile
  log-masses (of ``y``, or of ``x`` for raw values: x is then the matmul itself), and its stage 2
  reads each row's top N and the token's rank off the row's first 64 tokens where they certify
  them (csrc/kernels/truncate_candidates.cu; for raw values against a bound of the x past those
  tokens, which their y bounds); the rest (a token past
  them, as on a flat row; ties of t at their end) the top-N kernels below take from the logits
  the GEMM stored. ``token_ids`` read those logits too.
- **Logits**: every other call samples on the logits route (``sample_from_logits``; on the CPU
  ``_sample_logits``) and the outputs read the same fp32 logits. On CUDA one kernel
  (csrc/kernels/top_logprobs.cu) finds each row's top N and the sampled tokens' ranks without
  sorting the row; the CPU computes the same in torch ops.

The routes' logits differ by the rounding of their matmuls, and the fused route's log-sum-exp is
its GEMM's (per-tile log-masses, to ~1e-6); on given logits and log-sum-exp both order and rank
alike (the tests compare them bit for bit), but for a NaN logit past a row's first 64 tokens where
stage 2 decides the row: it is neither listed nor ranked ahead (the sampler never draws it), where
the top-N kernels, as ``torch.sort``, put NaN first (``check_nan=True`` raises on such rows); raw
values there carry no mass of NaN logits, so ``check_nan=True`` sends raw calls to the logits route.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .masks import unpack_allowed_mask
from .penalties import rule_logits
from .truncation import (FUSED_ARCHS, FUSED_MAX_VOCAB, FUSED_MIN_VOCAB, cuda_arch, materialized_logits, order_rank,
                         scaled_logits, survivor_mask, temperature_scales)

__all__ = ["LogprobsOutput", "LOGPROBS_MODES", "MAX_TOP_LOGPROBS"]

LOGPROBS_MODES = ("processed", "raw")
MAX_TOP_LOGPROBS = 64
# The fused route's batches: up to 64 rows the fused top-k GEMM draws each row's sample (its tile
# winners: csrc/include/flashsampling/kernel_choice.h, the CUTLASS schedules' scan); beyond, its
# rows would take the logits sampler's cut kernel, slower than the logits route.
FUSED_TOP_LOGPROBS_MAX_BATCH = 64


class LogprobsOutput(NamedTuple):
    """What :func:`flashsampling_cuda.sample` returns with ``top_logprobs`` or ``token_ids``."""

    tokens: Tensor  # int64 [B, S]
    logprobs: Tensor  # float32 [B, S]: of each sampled token (per logprobs_mode)
    logsumexp: Tensor  # float32 [B]
    top_ids: Tensor  # int64 [B, N]: the N most probable tokens, descending, exact ties to the smaller id
    top_logprobs: Tensor  # float32 [B, N]
    ranks: Tensor  # int64 [B, S]: 1-based rank of each sampled token in its row (0: no token)
    token_ids_logprobs: Tensor  # float32 [B, K]: of the given token ids (NaN where padded)


def parse_logprob_args(return_logprobs: bool, top_logprobs, token_ids, logprobs_mode: str, batch: int,
                       device, id_end: int | None = None) -> tuple[int, Tensor | None, str]:
    """(N, token ids int64 [B, K] or None, mode), checked; ValueError / TypeError name the argument.
    Ids given on the host (lists, CPU tensors) must be -1 (padding) or in ``[0, id_end)`` (any
    ``>= 0`` with ``id_end`` None); a CUDA tensor's values are not read (no sync): an id outside the
    vocabulary gets NaN."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"flashsampling.sample: logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                         f"got {logprobs_mode!r}")
    if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
        raise TypeError(f"flashsampling.sample: top_logprobs must be an int, got {type(top_logprobs).__name__}")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"flashsampling.sample: top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")
    ids = host = None  # host: the ids where they are on the host (checked there, no sync)
    if token_ids is not None:
        if isinstance(token_ids, Tensor):
            if token_ids.dtype not in (torch.int32, torch.int64) or token_ids.dim() != 2 or token_ids.shape[0] != batch:
                raise ValueError(f"flashsampling.sample: token_ids must be an int [B, K] tensor with B = {batch}, got "
                                 f"{token_ids.dtype} with shape {list(token_ids.shape)}")
            if token_ids.device.type == "cpu":
                host = token_ids.to(torch.int64)
            ids = token_ids.to(device=device, dtype=torch.int64)
        elif isinstance(token_ids, (list, tuple)) and len(token_ids) == batch:
            rows = [list(r) for r in token_ids]
            if not all(isinstance(v, int) and not isinstance(v, bool) for r in rows for v in r):
                raise TypeError("flashsampling.sample: token_ids must hold ints")
            width = max([len(r) for r in rows] + [0])  # (a generator in max() does not trace)
            host = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(batch, width)
            ids = host.to(device)
        else:
            raise TypeError(f"flashsampling.sample: token_ids must be an int [B, K] tensor or a list of B lists, got "
                            f"{type(token_ids).__name__}")
    if host is not None and not torch.compiler.is_compiling():
        bad = (host < -1) if id_end is None else (host < -1) | (host >= id_end)
        if bool(bad.any()):
            raise ValueError(f"flashsampling.sample: token_ids must be -1 (padding) or a token id in [0, "
                             f"{'V' if id_end is None else id_end}), got {int(host[bad][0])}")
    if (top_logprobs > 0 or ids is not None or logprobs_mode != "processed") and not return_logprobs:
        raise ValueError("flashsampling.sample: top_logprobs, token_ids and logprobs_mode need return_logprobs=True")
    return top_logprobs, ids, logprobs_mode


def _tma_operand(t: Tensor) -> bool:
    """Whether the fused kernel's TMA takes ``t`` as it is (sample_cuda.cpp: check_tma_operand):
    unit stride along D, 16-byte rows and address (traced, the address is not known: a
    misaligned view then gets the op's error naming it)."""
    return (t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size() % 16 == 0 or t.shape[0] == 1)
            and (torch.compiler.is_compiling() or t.data_ptr() % 16 == 0))


def fused_top_logprobs_takes(hidden: Tensor, weight: Tensor, op_kwargs: dict) -> bool:
    """Whether ``flashsampling._sample_top_logprobs`` takes a logprob call without truncation,
    penalties or model-side transforms (processed values, or raw ones without a bias: the caller
    decides; ``op_kwargs``: the fused op's arguments): sm90, bf16 / fp16 operands the GEMM takes as
    they are (D a multiple of 8, TMA strides and alignment), ``4096 <= V <= 229376``, one sample,
    1-64 rows, a batch-wide seed and offset, no ``allowed_mask`` or sparse bias. Elsewhere the
    logits route takes the call (a matmul of any shape)."""
    seed, offset = op_kwargs["seed"], op_kwargs["offset"]
    return (hidden.device.type == "cuda" and hidden.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == hidden.dtype and hidden.shape[1] % 8 == 0 and _tma_operand(hidden)
            and _tma_operand(weight) and FUSED_MIN_VOCAB <= weight.shape[0] <= FUSED_MAX_VOCAB
            and 1 <= hidden.shape[0] <= FUSED_TOP_LOGPROBS_MAX_BATCH and op_kwargs["num_samples"] == 1
            and op_kwargs["allowed_mask"] is None and op_kwargs["sparse_bias_ids"] is None
            and (seed is None or seed.dim() == 0) and (offset is None or offset.dim() == 0)
            and cuda_arch(hidden.device) in FUSED_ARCHS)


def _raw_logits(hidden: Tensor, weight: Tensor, route: dict) -> Tensor:
    """The fp32 raw logits: those the sample's route already computed, else one matmul."""
    raw = route.get("raw_logits")
    return raw if raw is not None else materialized_logits(hidden, weight)


def processed_logits(hidden: Tensor, weight: Tensor, context: dict, route: dict) -> Tensor:
    """``x`` of the call, float32 ``[B, V]`` (flashsampling_cuda/penalties.py's rule, before the
    temperature): the logits route's own, with its bias, where the sample took that route; the
    fused route's stored ones (bias added)."""
    if route.get("op") == "_sample_top_logprobs":
        return route["logits"]
    if route.get("op") == "sample_from_logits":
        x, bias = route["logits"], route["logit_bias"]
        return x if bias is None else x + bias
    kwargs = context["kwargs"]
    return rule_logits(_raw_logits(hidden, weight, route), kwargs["logit_bias"], kwargs["sparse_bias_ids"],
                       kwargs["sparse_bias_values"], kwargs["vocab_start"], context["scale"], context["softcap"],
                       context["penalties"])


def logprob_values(hidden: Tensor, weight: Tensor, context: dict, route: dict, mode: str) -> Tensor:
    """What the logprob outputs normalise, float32 ``[B, V]``: the raw logits (``"raw"``), or the
    call's ``y`` with ``-inf`` outside the distribution it sampled from (``"processed"``:
    the mask and the truncation's survivors)."""
    values, scales = logprob_values_and_scales(hidden, weight, context, route, mode)
    return values if scales is None else values * scales[:, None]


def logprob_values_and_scales(hidden: Tensor, weight: Tensor, context: dict, route: dict,
                              mode: str) -> tuple[Tensor, Tensor | None]:
    """:func:`logprob_values` as ``(values, scales)``, ``y = fl32(values * scales[b])`` where
    ``scales`` (float32 ``[B]``) is not None: a processed call without mask or truncation hands
    over its ``x`` and the rows' ``fl32(1 / T)`` (1 on greedy rows), which the consumers apply,
    so that ``y`` is never materialised."""
    if mode == "raw":
        return _raw_logits(hidden, weight, route), None
    kwargs = context["kwargs"]
    x = processed_logits(hidden, weight, context, route)
    if kwargs["allowed_mask"] is None and context["truncation"] is None:
        return x, temperature_scales(x.shape[0], kwargs["temperature"], kwargs["temperatures"], x.device)
    y = scaled_logits(x, kwargs["temperature"], kwargs["temperatures"])
    allowed = None
    if kwargs["allowed_mask"] is not None:
        allowed = unpack_allowed_mask(kwargs["allowed_mask"], y.shape[1])
    if context["truncation"] is not None:
        allowed = survivor_mask(y, allowed, context["truncation"], context["order"])
    return (y if allowed is None else y.masked_fill(~allowed, -torch.inf)), None


def raw_logsumexp(values: Tensor) -> Tensor:
    """``[B]`` log-sum-exp of the raw logits (``"raw"`` mode's normaliser), summed in float32 (to
    about 1e-6 of it, well inside the logprobs' 1e-4; a float64 copy of the logits cost more than
    the raw outputs' other work, CHANGELOG.md) and handed on as float64:
    ``flashsampling._row_logsumexp`` (CUDA: one read of the rows; the CPU: ``torch.logsumexp``)."""
    return torch.ops.flashsampling._row_logsumexp(values).double()


def normalised(values: Tensor, lse: Tensor, mode: str) -> Tensor:
    """Log-probabilities float32 of :func:`logprob_values`: ``values - lse`` (``lse``: the op's
    float32 logsumexp, processed; :func:`raw_logsumexp`'s float64 one, raw); excluded tokens stay
    ``-inf``."""
    if mode == "raw":
        return (values.double() - lse[..., None]).float()
    return torch.where(values == -torch.inf, -torch.inf, values - lse[..., None])


def ranked_tokens(tokens: Tensor, logsumexp: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(local ids ``tokens - vocab_start``, and whether each is ranked: a token of this vocabulary
    in a row that sampled one, ``logsumexp`` above -inf; a row that nothing allows has a sentinel),
    ``[B, S]`` each."""
    local = tokens - vocab_start
    return local, (local >= 0) & (local < vocab) & (logsumexp[:, None] > -torch.inf)


def raw_token_logprobs(values: Tensor, lse: Tensor, local: Tensor, valid: Tensor) -> Tensor:
    """float32 ``[B, S]``: the raw log-probabilities of the ranked tokens (:func:`ranked_tokens`'
    ``local`` ids and ``valid``) from ``values [B, V]`` and the float64 ``lse [B]``; NaN elsewhere."""
    return torch.where(valid, normalised(values.gather(1, torch.where(valid, local, 0)), lse, "raw"), torch.nan)


def tokens_ahead(table: Tensor, ids: Tensor, token_values: Tensor, token_ids: Tensor) -> Tensor:
    """int64 ``[B, S]``: how many entries of ``table [B, V]`` (ids ``ids [V]``) come before each
    token in the order of the outputs (log-probability descending with -0 folded into +0, NaN
    first, exact ties to the smaller id), the token's own value ``token_values [B, S]`` and id
    ``token_ids [B, S]``."""
    rank, token_rank = order_rank(table), order_rank(token_values)
    return torch.stack([((rank > token_rank[:, s : s + 1])
                         | ((rank == token_rank[:, s : s + 1]) & (ids < token_ids[:, s : s + 1]))).sum(dim=1)
                        for s in range(token_values.shape[1])], dim=1)


def top_entries(table: Tensor, n: int, ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The first ``n`` (values, ids) of each row of ``table [B, W]`` in the order of the outputs:
    value descending (NaN first, as ``torch.sort`` has it), exact ties to the smaller id.
    ``ids [B, W]``: the entries' ids, or None for columns that are the ids ``0 .. W - 1``."""
    if ids is not None:  # a few candidates: stable sorts, by id, then by value
        by_id = torch.sort(ids, dim=1, stable=True)
        table, ids = table.gather(1, by_id.indices), by_id.values
        order = torch.sort(table, dim=1, descending=True, stable=True)
        first = order.indices[:, :n]
        return order.values[:, :n], ids.gather(1, first)
    # A whole row: one top-k of distinct int64 keys (the value's order rank, then the smaller
    # column), so torch.topk's unspecified order among equal values never matters.
    n = min(n, table.shape[1])
    columns = torch.arange(table.shape[1], device=table.device)
    keys = order_rank(table) * 2**31 + (2**31 - 1 - columns)
    first = torch.topk(keys, n, dim=1, sorted=True).indices
    return table.gather(1, first), first


def top_logprobs_cpu(values: Tensor, lse: Tensor, tokens: Tensor, top_n: int, raw: bool
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """``flashsampling._top_logprobs`` on the CPU (the CUDA kernel is csrc/kernels/top_logprobs.cu):
    of the log-probabilities :func:`normalised` makes of ``values [B, V]`` float32 and ``lse [B]``
    float64, the first ``top_n`` (values float32, local ids int64 ``[B, top_n]``) and the 1-based
    rank of each token of ``tokens [B, S]`` (local ids; 0 for one outside ``[0, V)``)."""
    mode = "raw" if raw else "processed"
    table = normalised(values, lse if raw else lse.float(), mode)
    valid = (tokens >= 0) & (tokens < values.shape[1])
    safe = torch.where(valid, tokens, 0)
    ahead = tokens_ahead(table, torch.arange(values.shape[1]), table.gather(1, safe), safe)
    top_values, top_ids = top_entries(table, top_n)
    return top_values, top_ids, torch.where(valid, ahead + 1, 0)


def values_of_ids(table: Tensor, token_ids: Tensor, vocab_start: int) -> Tensor:
    """``table``'s entries at global ``token_ids [B, K]``; NaN where an id is padding (< 0) or
    outside this vocabulary."""
    wanted = token_ids - vocab_start
    inside = (token_ids >= 0) & (wanted >= 0) & (wanted < table.shape[1])
    return torch.where(inside, table.gather(1, torch.where(inside, wanted, 0)), torch.nan)


def logprob_outputs(hidden: Tensor, weight: Tensor, context: dict, route: dict, tokens: Tensor, logprobs: Tensor,
                    logsumexp: Tensor, top_n: int, token_ids: Tensor | None, mode: str) -> LogprobsOutput:
    """The outputs of :class:`LogprobsOutput` for a sample already drawn (``tokens``, and the op's
    ``logprobs`` / ``logsumexp``: of the processed distribution, or on the fused route of the call's
    mode); ``context``: the call's arguments
    as :func:`flashsampling_cuda.sampling._op_kwargs` recorded them; ``route``: how it sampled
    (logits it computed are not computed again)."""
    vocab_start = context["kwargs"]["vocab_start"]
    lse = logsumexp
    batch = tokens.shape[0]
    if route.get("op") == "_sample_top_logprobs":
        # They came with the sample, in the call's mode (stage 2 and the top-N kernels); token_ids
        # read the stored x.
        top_logprobs, top_local, ranks = route["top_outputs"]
        values, scales = route["logits"], None
        if token_ids is not None:
            values, scales = logprob_values_and_scales(hidden, weight, context, route, mode)
        if mode == "raw":
            lse = logsumexp.double()
    else:
        values, scales = logprob_values_and_scales(hidden, weight, context, route, mode)
        local, valid = ranked_tokens(tokens, logsumexp, vocab_start, values.shape[1])
        if mode == "raw":
            lse = raw_logsumexp(values)
            logsumexp = lse.float()
            logprobs = raw_token_logprobs(values, lse, local, valid)
        # CUDA: one kernel, no [B, V] table of log-probabilities and no sort; CPU: top_logprobs_cpu.
        top_logprobs, top_local, ranks = torch.ops.flashsampling._top_logprobs(
            values, lse.double(), torch.where(valid, local, -1), min(top_n, values.shape[1]), mode == "raw", scales)
    top_ids = top_local + vocab_start
    missing = top_n - top_local.shape[1]  # N > V: -1 and -inf past the vocabulary
    if missing > 0:
        top_ids = torch.cat([top_ids, top_local.new_full((batch, missing), -1)], dim=1)
        top_logprobs = torch.cat([top_logprobs, top_logprobs.new_full((batch, missing), -torch.inf)], dim=1)
    if token_ids is None:
        token_ids_logprobs = values.new_empty((batch, 0))
    else:
        of_ids = values_of_ids(values, token_ids, vocab_start)
        token_ids_logprobs = normalised(of_ids if scales is None else of_ids * scales[:, None], lse, mode)
    return LogprobsOutput(tokens, logprobs, logsumexp, top_ids, top_logprobs, ranks, token_ids_logprobs)
