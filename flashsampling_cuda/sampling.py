"""Python API of FlashSampling: exact sampling fused into the LM-head GEMM."""

from __future__ import annotations

import math
import numbers
import struct
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Union

import torch
from torch import Tensor

from .masks import int32_words, pack_allowed_mask, unpack_allowed_mask
from .logprobs import (MAX_TOP_LOGPROBS, LogprobsOutput, fused_top_logprobs_takes, logprob_outputs,
                       parse_logprob_args, ranked_tokens, raw_logsumexp, raw_token_logprobs, top_logprobs_cpu)
from .noise import as_int64_tensor, draw_seed
from .shard_truncation import whole_row_survivors
from .penalties import PenaltyState, check_fused_penalty_vocab, fused_penalty_args, parse_penalties, rule_logits
from .truncation import (LOGITS_PATH_MAX_VOCAB, ROW_PROBABILITY_DTYPES, ROW_TOP_K_DTYPES, TRUNCATION_ORDERS,
                         TRUNCATION_PATHS, Truncation,
                         choose_truncation_path, fused_top_k_args, logits_path_args, logits_truncation_args,
                         logits_allowed_mask, materialized_logits, parse_truncation, sample_from_logits_cpu,
                         temperature_scales, transformed_logits,
                         truncated_allowed_mask)

__all__ = ["sample", "sample_with_scores", "sample_without_replacement", "sample_from_logits", "pack_allowed_mask",
           "SampleOutput", "ScoredSample"]

SparseLogitBias = Union[tuple[Tensor, Tensor], Sequence[Mapping[int, float]]]


class SampleOutput(NamedTuple):
    """What :func:`sample` returns with ``return_logprobs=True``."""

    tokens: Tensor  # int64 [B, num_samples]
    logprobs: Tensor  # float32 [B, num_samples]: log-probability of each token
    logsumexp: Tensor  # float32 [B]: logsumexp of the transformed logits y over the allowed tokens


class ScoredSample(NamedTuple):
    """What :func:`sample_with_scores` returns (the four outputs of the op)."""

    tokens: Tensor  # int64 [B, num_samples], global token ids
    scores: Tensor  # float32 [B, num_samples]: the winning perturbed score (-inf: no candidate)
    token_logprobs: Tensor  # float32 [B, num_samples] with return_logprobs, else shape [0]
    logsumexp: Tensor  # float32 [B] with return_logprobs, else shape [0]


def _temperature_args(temperature: float | Tensor, hidden: Tensor) -> tuple[float, Tensor | None]:
    """(scalar, per-row tensor) arguments of the op for a float, 0-d or [B] temperature. A
    tensor of any floating dtype is rounded to float32 (as a host float is) and moved to
    hidden's device; other dtypes are refused, as is anything that is not a real number."""
    if not isinstance(temperature, Tensor):
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError("flashsampling.sample: temperature must be a float, a 0-d or a [B] floating tensor, "
                            f"got {type(temperature).__name__}")
        return float(temperature), None
    if not temperature.is_floating_point():
        raise TypeError("flashsampling.sample: temperature must be a float, a 0-d or a [B] floating tensor, "
                        f"got a {temperature.dtype} tensor")
    temperature = temperature.to(device=hidden.device, dtype=torch.float32)
    if temperature.dim() == 0:
        temperature = temperature.expand(hidden.shape[0])
    return 1.0, temperature


def _float32(name: str, t: Tensor | None) -> Tensor | None:
    """A floating tensor as float32 (other dtypes go to the op, which names them)."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        raise TypeError(f"flashsampling.sample: {name} must be a tensor, got {type(t).__name__}")
    return t.to(torch.float32) if t.is_floating_point() else t


def _sparse_bias_args(sparse_logit_bias: SparseLogitBias | None, hidden: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """(sparse_bias_ids, sparse_bias_values) of the op for a pair of [B, K] tensors or a list
    of B dicts {token_id: bias} (padded to the longest with id -1, which matches no token)."""
    if sparse_logit_bias is None:
        return None, None
    name = "flashsampling.sample: sparse_logit_bias"
    if isinstance(sparse_logit_bias, (tuple, list)) and len(sparse_logit_bias) == 2 and all(
        isinstance(t, Tensor) for t in sparse_logit_bias
    ):
        ids, values = sparse_logit_bias
        return ids, _float32("sparse_logit_bias values", values)
    if not isinstance(sparse_logit_bias, Sequence) or not all(isinstance(d, Mapping) for d in sparse_logit_bias):
        raise TypeError(
            f"{name} must be a pair (ids [B, K] int tensor, values [B, K] float tensor) or a list of B "
            f"dicts {{token_id: bias}}, got {type(sparse_logit_bias).__name__}"
        )
    batch = hidden.shape[0]
    if len(sparse_logit_bias) != batch:
        raise ValueError(f"{name} must hold one dict per row: B = {batch}, got {len(sparse_logit_bias)}")
    width = max([0] + [len(d) for d in sparse_logit_bias])  # (no `default=`: torch.compile traces this)
    if width == 0:
        return None, None
    ids = [[int(k) for k in d] + [-1] * (width - len(d)) for d in sparse_logit_bias]
    values = [[float(v) for v in d.values()] + [0.0] * (width - len(d)) for d in sparse_logit_bias]
    return (
        torch.tensor(ids, dtype=torch.int64, device=hidden.device),
        torch.tensor(values, dtype=torch.float32, device=hidden.device),
    )


def _allowed_mask_arg(allowed_mask: Tensor | None, hidden: Tensor, weight: Tensor) -> Tensor | None:
    if allowed_mask is None or not isinstance(allowed_mask, Tensor) or allowed_mask.dtype != torch.bool:
        return allowed_mask
    expected = (hidden.shape[0], weight.shape[0])
    if allowed_mask.dim() != 2 or tuple(allowed_mask.shape) != expected:
        raise ValueError(
            f"flashsampling.sample: a bool allowed_mask must have shape [B, V] = {list(expected)}, "
            f"got shape {list(allowed_mask.shape)}"
        )
    return pack_allowed_mask(allowed_mask)


def _seed_arg(name: str, x: int | Tensor | None) -> Tensor | None:
    """seed / offset as an int64 tensor: ints become 0-d tensors (values in [2^63, 2^64)
    wrap, as uint64); tensors go to the op as they are, which checks dtype, shape and device."""
    if x is None or isinstance(x, Tensor):
        return x
    try:
        return as_int64_tensor(x)
    except (TypeError, ValueError) as e:
        raise type(e)(f"flashsampling.sample: {name}: {e}") from None


class LogitTransforms(NamedTuple):
    """The model-side transforms and penalties of a call, as the caller gave them."""

    logit_scale: float = 1.0
    logit_softcap: float | None = None
    repetition_penalty: float | Tensor | None = None
    frequency_penalty: float | Tensor | None = None
    presence_penalty: float | Tensor | None = None
    penalty_state: PenaltyState | None = None
    prompt_token_ids: object = None
    output_token_ids: object = None


def _positive_normal_float32(value: float) -> bool:
    """Whether a host value is, rounded to float32, a positive normal number, so that neither it
    nor its reciprocal rounds to 0 or overflows: what the op takes as logit_scale /
    logit_softcap, and as a temperature other than 0 (checks.cpp: positive_normal_float)."""
    try:
        rounded = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range
        return False
    return math.isfinite(rounded) and rounded >= torch.finfo(torch.float32).tiny


def _model_transform_args(logit_scale, logit_softcap, op: str = "flashsampling.sample") -> tuple[float, float | None]:
    for name, value in (("logit_scale", logit_scale), ("logit_softcap", logit_softcap)):
        if value is None and name == "logit_softcap":
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
        if not _positive_normal_float32(float(value)):
            raise ValueError(f"{op}: {name} must be finite and > 0 (a normal float32), got {value}")
    return float(logit_scale), None if logit_softcap is None else float(logit_softcap)


def _op_kwargs(
    hidden, weight, temperature, generator, seed, offset, num_samples, logit_bias, sparse_logit_bias,
    allowed_mask, empty_mask_token, vocab_start, top_k=None, top_p=None, min_p=None, route: dict | None = None,
    truncation_path: str = "auto", truncation_order: str = "top_k_first",
    transforms: LogitTransforms = LogitTransforms(), context: dict | None = None, logits_wanted: bool = False,
    fused_top_logprobs: tuple[int, bool] | None = None,
) -> dict:
    """Keyword arguments of torch.ops.flashsampling.sample for the wrapper's arguments.
    Truncation that may be on (truncation.py) takes the path :func:`choose_truncation_path`
    picks: with ``route`` (a dict) given, the fused top-k pass or the logits path fill it with
    their op's name (``"op"``) and extra arguments; the materialised path makes the survivors
    part of ``allowed_mask``, and on the CPU with ``route`` given also hands the logits it
    computed to ``_sample_logits`` through ``route`` (no second logits pass). ``logits_wanted``
    (the logprob outputs read the logits): a call that would take the fused op takes the logits
    route instead (CUDA: ``sample_from_logits``; CPU: ``_sample_logits``), so that the logits are
    computed once. A route that computed the logits keeps the matmul's own in ``route["raw_logits"]``.
    ``fused_top_logprobs`` (``(top_logprobs, raw)`` of a call that returns processed values, or raw
    ones without a bias): such a call without truncation takes ``_sample_top_logprobs`` where
    :func:`~flashsampling_cuda.logprobs.fused_top_logprobs_takes` says it can."""
    scalar_temperature, temperatures = _temperature_args(temperature, hidden)
    sparse_ids, sparse_values = _sparse_bias_args(sparse_logit_bias, hidden)
    kwargs = dict(
        temperature=scalar_temperature,
        temperatures=temperatures,
        num_samples=num_samples,
        seed=_seed_arg("seed", seed),
        offset=_seed_arg("offset", offset),
        generator=generator,
        logit_bias=_float32("logit_bias", logit_bias),
        sparse_bias_ids=sparse_ids,
        sparse_bias_values=sparse_values,
        allowed_mask=_allowed_mask_arg(allowed_mask, hidden, weight),
        empty_mask_token=empty_mask_token,
        vocab_start=vocab_start,
    )
    truncation = parse_truncation(top_k, top_p, min_p, hidden)
    order = _truncation_order(truncation_order, truncation)
    _check_order_path(order, truncation_path)
    scale, softcap = _model_transform_args(transforms.logit_scale, transforms.logit_softcap)
    # A call on the whole vocabulary checks the ids of a history given on the host; a shard's
    # history (vocab_start > 0) holds other shards' ids too.
    id_end = (weight.shape[0] if kwargs["vocab_start"] == 0 and isinstance(weight, Tensor) and weight.dim() == 2
              else None)
    penalties = parse_penalties(transforms.repetition_penalty, transforms.frequency_penalty,
                                transforms.presence_penalty, transforms.penalty_state, transforms.prompt_token_ids,
                                transforms.output_token_ids, hidden, id_end=id_end)
    model_side = scale != 1.0 or softcap is not None
    if context is not None:  # the call as given, for outputs computed beside the sample (logprobs.py)
        context.update(kwargs=dict(kwargs), truncation=truncation, order=order, scale=scale, softcap=softcap,
                       penalties=penalties)
    # The fused op applies the model-side transforms and the penalties in its epilogue (CUDA) or
    # transform pass (CPU); the truncation paths and the logprob outputs read logits the op does
    # not hand over, so such calls take the logits route, which applies the same functions
    # (_model_logits; the penalties' torch ops, which divide and add as fs_penalized_logit does).
    if (model_side or penalties is not None) and (truncation is not None or logits_wanted):
        _logits_route(hidden, weight, kwargs, route, truncation, truncation_path, scale, softcap, penalties, order)
        return kwargs
    if model_side or penalties is not None:
        _check_transformed_truncation_path(truncation_path)
        if model_side:
            kwargs.update(logit_scale=scale, logit_softcap=softcap)
        if penalties is not None:
            check_fused_penalty_vocab(weight.shape[0], hidden.device)
            kwargs.update(fused_penalty_args(penalties, hidden.shape[0]))
        return kwargs
    if truncation is not None:
        _check_op_args_eagerly(hidden, weight, kwargs)
        wanted = truncation_path
        if logits_wanted and truncation_path == "auto" and hidden.device.type != "cpu":
            wanted = "logits"
        path = choose_truncation_path(wanted if route is not None and order == "top_k_first"
                                      else "materialized", truncation, hidden, weight, kwargs)
        if path == "fused_top_k":
            route.update(op="sample_top_k", **fused_top_k_args(truncation, hidden, weight))
        elif path == "logits":
            route.update(op="sample_from_logits", **logits_path_args(truncation, hidden, weight, kwargs))
        elif route is not None and hidden.device.type == "cpu":
            logits = materialized_logits(hidden, weight)
            kwargs["allowed_mask"], kwargs["empty_mask_token"] = truncated_allowed_mask(hidden, weight, kwargs,
                                                                                        truncation, logits, order)
            route.update(op="_sample_logits", logits=logits, raw_logits=logits)
        else:
            kwargs["allowed_mask"], kwargs["empty_mask_token"] = truncated_allowed_mask(hidden, weight, kwargs,
                                                                                        truncation, order=order)
    else:
        if truncation_path not in TRUNCATION_PATHS:  # nothing to truncate: any path name is fine, a typo is not
            choose_truncation_path(truncation_path, Truncation(None, None, None), hidden, weight, kwargs)
        if logits_wanted and route is not None and weight.shape[0] <= LOGITS_PATH_MAX_VOCAB:
            _check_op_args_eagerly(hidden, weight, kwargs)
            if fused_top_logprobs is not None and fused_top_logprobs_takes(hidden, weight, kwargs):
                route.update(op="_sample_top_logprobs", top_n=fused_top_logprobs[0], raw=fused_top_logprobs[1])
            elif hidden.device.type == "cpu":
                logits = materialized_logits(hidden, weight)
                route.update(op="_sample_logits", logits=logits, raw_logits=logits)
            else:
                route.update(op="sample_from_logits",
                             **logits_path_args(Truncation(None, None, None), hidden, weight, kwargs))
    return kwargs


def _truncation_order(truncation_order, truncation) -> str:
    """The validated order; "top_k_first" wherever the order cannot change the survivors
    (top_p off, or neither top_k nor min_p on)."""
    if truncation_order not in TRUNCATION_ORDERS:
        raise ValueError(f"flashsampling.sample: truncation_order must be one of {', '.join(TRUNCATION_ORDERS)}, "
                         f"got {truncation_order!r}")
    if truncation is None or truncation.top_p is None or (truncation.top_k is None and truncation.min_p is None):
        return "top_k_first"
    return truncation_order


def _check_order_path(order: str, truncation_path: str) -> None:
    if order != "top_k_first" and truncation_path in ("fused_top_k", "logits"):
        raise ValueError(f"flashsampling.sample: truncation_path={truncation_path!r} truncates in the order "
                         f"'top_k_first' only; truncation_order={order!r} takes 'auto' or 'materialized'")


def _check_op_args_eagerly(hidden: Tensor, weight: Tensor, kwargs: dict) -> None:
    """The op's own argument errors, before any logits are materialised for it (traced, the
    op's fake kernel runs the same checks; torch._check messages do not trace)."""
    if not torch.compiler.is_compiling():
        _check_fake_args(hidden, weight, kwargs["num_samples"], kwargs["temperatures"], kwargs["seed"],
                         kwargs["offset"], kwargs["logit_bias"], kwargs["sparse_bias_ids"],
                         kwargs["sparse_bias_values"], kwargs["allowed_mask"], temperature=kwargs["temperature"],
                         generator=kwargs["generator"], empty_mask_token=kwargs["empty_mask_token"],
                         vocab_start=kwargs["vocab_start"])


def _check_transformed_truncation_path(truncation_path) -> None:
    """A call with logit_scale / logit_softcap or penalties: the fused top-k pass applies neither,
    so its truncation_path is one of the others."""
    if truncation_path not in TRUNCATION_PATHS or truncation_path == "fused_top_k":
        raise ValueError("flashsampling.sample: with logit_scale / logit_softcap or penalties, truncation_path must be "
                         f"'auto', 'logits' or 'materialized', got {truncation_path!r}")


def _logits_route(hidden, weight, kwargs: dict, route: dict, truncation, truncation_path: str, scale: float,
                  softcap: float | None, penalties, order: str = "top_k_first") -> None:
    """Fills ``route`` for a call with model-side transforms or penalties the fused op cannot
    apply: the fp32 logits once (:func:`materialized_logits`), the rule of
    flashsampling_cuda/penalties.py on them in torch ops, then
    ``torch.ops.flashsampling.sample_from_logits`` (its CUDA kernel, or the CPU op), which
    applies the mask, temperature, truncation and noise. No host sync."""
    _check_transformed_truncation_path(truncation_path)
    _check_op_args_eagerly(hidden, weight, kwargs)
    # Every bias is folded into x here (the same fp32 adds the kernel would do).
    raw = materialized_logits(hidden, weight)
    x = rule_logits(raw, kwargs["logit_bias"], kwargs["sparse_bias_ids"],
                    kwargs["sparse_bias_values"], kwargs["vocab_start"], scale, softcap, penalties)
    if order != "top_k_first":  # the kernel truncates top_k first: hand it the survivors as its mask
        op_kwargs = {**kwargs, "logit_bias": None, "sparse_bias_ids": None, "sparse_bias_values": None}
        kwargs["allowed_mask"], kwargs["empty_mask_token"] = logits_allowed_mask(x, op_kwargs, truncation, order)
        truncation = None
    route.update(op="sample_from_logits", logits=x, logit_bias=None, raw_logits=raw,
                 **logits_truncation_args(truncation, hidden.shape[0], hidden.device))


def _call_op(hidden: Tensor, weight: Tensor, kwargs: dict, route: dict, return_logprobs: bool):
    """The op's four outputs, by the op ``route`` names (:func:`_op_kwargs`), else the fused op."""
    if not route:
        return torch.ops.flashsampling.sample_with_scores(hidden, weight, **kwargs, return_logprobs=return_logprobs)
    if route["op"] == "_sample_top_logprobs":
        outputs = torch.ops.flashsampling._sample_top_logprobs(hidden, weight, **kwargs, top_n=route["top_n"],
                                                               raw=route["raw"])
        # for logprobs.logprob_outputs: the top values, local ids and ranks (raw or processed, as the
        # outputs before them), and the GEMM's stored x (the call's logits; without a bias also the
        # matmul's own)
        x = outputs[7]
        route.update(top_outputs=outputs[4:7], logits=x, raw_logits=x if kwargs["logit_bias"] is None else None)
        return outputs[:4]
    extra = {name: value for name, value in route.items() if name not in ("op", "raw_logits")}
    if route["op"] == "sample_top_k":
        return torch.ops.flashsampling.sample_top_k(hidden, weight, **kwargs, return_logprobs=return_logprobs, **extra)
    if route["op"] == "_sample_logits":
        return torch.ops.flashsampling._sample_logits(extra["logits"], **kwargs, return_logprobs=return_logprobs)
    logits_kwargs = {name: value for name, value in kwargs.items()
                     if name not in ("sparse_bias_ids", "sparse_bias_values", "logit_bias")}
    return torch.ops.flashsampling.sample_from_logits(**extra, **logits_kwargs, return_logprobs=return_logprobs)


def _check_finite(what: str, rows: Tensor) -> None:
    """Raises the ValueError of check_nan for the rows where ``rows`` (bool [B]) is set."""
    bad = rows.nonzero().flatten().tolist()
    if bad:
        first = ", ".join(str(r) for r in bad[:8])
        raise ValueError(f"flashsampling.sample: check_nan: {what} in {len(bad)} row(s) (first: {first})")


def _check_nan_inputs(hidden: Tensor) -> None:
    """check_nan before the op: hidden must be finite (one host sync)."""
    _check_finite("hidden holds NaN or infinite values", ~torch.isfinite(hidden).all(dim=1))


def _check_nan_outputs(weight: Tensor, kwargs: dict, tokens: Tensor, scores: Tensor, logsumexp: Tensor,
                       return_logprobs: bool) -> None:
    """check_nan after the op (one host sync): every row's winning score must be finite, which
    fails exactly for a row whose allowed logits are all NaN (token -1), one with a +inf
    logit (it would win every draw) or one whose allowed logits are all -inf; a row whose
    mask allows nothing (given empty_mask_token) is left alone. With return_logprobs, a NaN
    logsumexp also fails: a NaN among the allowed logits."""
    mask = kwargs["allowed_mask"]
    empty = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    if mask is not None and kwargs["empty_mask_token"] is not None:
        empty = ~unpack_allowed_mask(mask, weight.shape[0]).any(dim=1)
    _check_finite("every allowed logit is NaN (an invalid temperature gives this too)",
                  (tokens == -1).any(dim=1) & ~empty)
    _check_finite("a logit is +inf", (scores == torch.inf).any(dim=1))
    _check_finite("every allowed logit is -inf", ((scores == -torch.inf) & (tokens != -1)).any(dim=1) & ~empty)
    if return_logprobs:
        _check_finite("a logit among the allowed tokens is NaN", torch.isnan(logsumexp) & ~empty)


def sample(
    hidden: Tensor,
    weight: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    num_samples: int = 1,
    logit_bias: Tensor | None = None,
    sparse_logit_bias: SparseLogitBias | None = None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    return_logprobs: bool = False,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    truncation_path: str = "auto",
    truncation_order: str = "top_k_first",
    check_nan: bool = False,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    repetition_penalty: float | Tensor | None = None,
    frequency_penalty: float | Tensor | None = None,
    presence_penalty: float | Tensor | None = None,
    penalty_state: PenaltyState | None = None,
    prompt_token_ids: Tensor | Sequence[Sequence[int]] | None = None,
    output_token_ids: Tensor | Sequence[Sequence[int]] | None = None,
    top_logprobs: int = 0,
    token_ids: Tensor | Sequence[Sequence[int]] | None = None,
    logprobs_mode: str = "processed",
) -> Tensor | SampleOutput | LogprobsOutput:
    r"""Sample next tokens from ``softmax(hidden @ weight.T / T)`` without materialising logits.

    FlashSampling fuses the Gumbel-Max trick into the LM-head matrix multiply:

    .. math::

        \text{token}[b, s] = \operatorname{argmax}_{v \text{ allowed}} \big(x[b, v] / T_b + g(b, s, v)\big),
        \qquad \text{logit}[b, v] = \sum_d \text{hidden}[b, d]\,\text{weight}[v, d],

    with the logits accumulated in fp32, :math:`x` the logits plus the optional biases, and
    :math:`g` i.i.d. standard Gumbel noise. Since
    :math:`P(\operatorname{argmax}_v(x_v + g_v) = i) = \operatorname{softmax}(x)_i`, every
    token is an exact sample from the categorical distribution of the (biased, masked)
    logits, no approximation. With ``top_k``/``top_p``/``min_p`` it is an exact sample of
    that distribution truncated and renormalised (``truncation_path`` says how).

    Args:
        hidden: ``[B, D]`` hidden states, ``torch.bfloat16``, ``torch.float16`` or
            ``torch.float32`` (CPU: all three; CUDA: see the README).
        weight: ``[V, D]`` LM-head weight, same dtype and device as ``hidden``;
            ``1 <= V < 2**31``. May be a vocabulary shard: see ``vocab_start``.
        temperature: a float, a 0-d tensor or a ``[B]`` float tensor (per row). Must be
            finite and ``>= 0``; ``0`` means greedy (exact argmax of the transformed logits,
            no noise). Rounded to fp32; the scale applied is ``fl32(1 / T)``. Values inside a
            CUDA tensor are not checked on the host (no sync): a row with an invalid one
            gets token ``-1``.
        generator: draws ``(seed, offset)`` when ``seed`` is None; default: the default
            generator of ``hidden``'s device, so ``torch.manual_seed`` makes runs
            reproducible. Mutually exclusive with ``seed``.
        seed: int, 0-d or ``[B]`` int64 tensor. A 0-d seed is batch-wide: row ``b`` draws
            noise stream ``b``. A ``[B]`` tensor gives each row its own seed and stream 0,
            so a row's token does not depend on the other rows of the batch.
        offset: int, 0-d or ``[B]`` int64 tensor, default 0; only with ``seed``. Advance it
            (by at least ``num_samples``) to draw fresh samples with the same seed.
        num_samples: independent draws per row (with replacement), ``>= 1``.
        logit_bias: optional ``[V]`` float tensor (any float dtype, used as float32) on
            ``hidden``'s device, added to every row's logits before the temperature:
            ``x = fl32(logit + logit_bias[v])``. ``-inf`` makes a token impossible (unless
            every allowed token is ``-inf``).
        sparse_logit_bias: optional per-row sparse bias (OpenAI-style ``logit_bias`` maps),
            added after ``logit_bias``: either a pair ``(ids, values)`` of ``[B, K]``
            tensors (ids int32/int64 global token ids, values float; pad with id ``-1``) on
            ``hidden``'s device, or a list of ``B`` dicts ``{token_id: bias}`` (converted to
            such a pair on ``hidden``'s device, a host-to-device copy per call). Ids outside
            ``[vocab_start, vocab_start + V)`` are ignored; the values of a repeated id are
            summed in fp32 in list order and that sum is added once.
        allowed_mask: optional allowed-token mask: an int32 ``[B, ceil(V / 32)]`` bitmask
            (xgrammar's layout: token ``v`` is allowed when bit ``v & 31`` of word ``v >> 5``
            is set; bits past ``V`` are ignored), or a bool ``[B, V]`` tensor (True =
            allowed), packed with :func:`pack_allowed_mask`. Indices are local (row ``v`` of
            ``weight``). Excluded tokens are never sampled and do not count in the
            log-probabilities.
        empty_mask_token: what a row whose ``allowed_mask`` allows no token returns (its
            logprob is NaN, its logsumexp ``-inf``). Without it such a row is an error
            naming ``allowed_mask`` (which reads the mask: a sync on CUDA, and an error
            under CUDA graph capture, where ``empty_mask_token`` is required).
        return_logprobs: also return the log-probability of each token and the logsumexp
            of the transformed logits ``y = fl32(x * fl32(1 / T))`` (``y = x`` for greedy
            rows) over the allowed tokens: ``logprob = y[token] - logsumexp(y)``.
        vocab_start: global id of ``weight``'s row 0 (tensor-parallel vocabulary shards):
            the noise is keyed by and the tokens are the global ids ``vocab_start + v``.
        top_k: keep only the ``top_k`` largest transformed logits ``y`` of a row (exact
            ties to the smaller index); an int, a 0-d or a ``[B]`` integer tensor (per row)
            on ``hidden``'s device or the CPU; ``-1`` or ``0``: off.
        top_p: then keep the shortest prefix of those, in descending order, whose
            probabilities (their softmax, float64) add up to ``top_p`` (the top token always
            stays); a float in ``(0, 1]``, a 0-d or ``[B]`` float tensor; ``1``: off.
        min_p: then drop the tokens whose probability is below ``min_p`` times the top
            token's; a float in ``[0, 1]``, a 0-d or ``[B]`` float tensor; ``0``: off.
            Tokens are sampled from ``softmax(y)`` over what remains, with the noise of plain
            sampling: a row whose truncation is off gets exactly the plain-sampling token.
            Values in CPU tensors are checked; in device tensors they are not (no sync):
            ``top_k < 0``, ``top_p > 1`` and ``min_p < 0`` are off, ``top_p <= 0``,
            ``min_p > 1`` and NaN keep the top token only. They apply to ``weight``'s
            vocabulary: on a shard, to the shard.
        truncation_path: how a truncated call is sampled (flashsampling_cuda/truncation.py);
            every path gives the same tokens, up to near ties within fp32 rounding.
            ``"auto"`` (default): on CUDA with bf16/fp16 and no sparse bias, ``"fused_top_k"``
            (the GEMM keeps each vocabulary tile's 4 best logits, a second kernel truncates and
            samples the rows they decide; on sm90 the GEMM also stores the logits and the
            logits kernel samples the other rows) for a host ``top_k <= 64`` and, on sm90, for
            a ``[B]`` top_k and for top_p / min_p without top_k up to B = 64; everything else
            ``"logits"`` (one fp32 logits matmul ``[B, V]``, then one kernel selects the
            survivors of each row and samples them: the weight is read once); the CPU takes
            ``"materialized"`` (float64 survivors in torch ops, then the fused op samples with
            them as a mask: the reference path, which reads the weight twice). Naming a path
            that cannot take the call is a ``ValueError``.
        truncation_order: what top_p's probabilities are normalised over: the top_k survivors
            (``"top_k_first"``, the default), those that also pass min_p (``"min_p_first"``, vLLM's
            order), or every allowed token (``"joint"``, SGLang's and FlashInfer's joint
            top-k/top-p). Only calls with top_p and top_k or min_p differ; for those the other
            orders take the materialised path (docs/truncation.md has an example).
        logit_scale, logit_softcap: model-side transforms of the raw logits, before the biases:
            ``l * logit_scale``, then ``logit_softcap * tanh(l / logit_softcap)`` (Gemma's
            ``final_logit_softcapping``; Granite's ``logits_scaling`` is ``1 / logit_scale``).
            Off by default (1.0, None); in the fused op, or with truncation or the logprob
            outputs that read the logits on the logits route (docs/penalties.md).
        repetition_penalty, frequency_penalty, presence_penalty: vLLM's penalties, after the
            biases and before the temperature: a host float, or a 0-d / ``[B]`` float tensor
            (per row). Repetition (off: 1.0, host values > 0) divides a positive logit of a token
            seen in the prompt or the output by it and multiplies a negative one; frequency and
            presence (off: 0.0) subtract ``f * count + p * [count > 0]`` over the output tokens.
            They run in the fused op, after the biases; with truncation or logprob outputs
            the call takes the logits route (docs/penalties.md).
        penalty_state: the token history of every row (:class:`flashsampling_cuda.PenaltyState`,
            on hidden's device; ``penalty_state.update(tokens)`` after each step, graph-safe).
        prompt_token_ids, output_token_ids: instead of ``penalty_state``, the history as
            ``[B, L]`` int tensors or lists of lists (negative ids: padding). With
            ``vocab_start = 0``, ids given on the host must lie below ``V`` (``ValueError``; a
            shard's history with other shards' ids goes in a ``PenaltyState``); ids in a GPU
            tensor are not read (no sync), and an id beyond the vocabulary penalises nothing.
        top_logprobs: with ``return_logprobs``, also the ``N`` (0-64) most probable tokens of
            each row and their log-probabilities, and each sampled token's 1-based rank
            (:class:`flashsampling_cuda.logprobs.LogprobsOutput`; docs/api.md).
        token_ids: with ``return_logprobs``, also the log-probabilities of these ids, ``[B, K]``
            int tensor or lists (negative: padding, NaN out).
        logprobs_mode: ``"processed"`` (the distribution sampled from: transforms, biases,
            mask, penalties, temperature, truncation) or ``"raw"`` (``log_softmax`` of
            ``hidden @ weight.T``), for every logprob output.
        check_nan: check for non-finite values (as FlashInfer's ``check_nan``), with host syncs
            (eager only: not under torch.compile or CUDA-graph capture): raise ``ValueError``
            naming the rows where ``hidden`` holds NaN or infinity, where the winning score is
            not finite (every allowed logit NaN, a logit of +inf, every allowed logit -inf), or,
            with ``return_logprobs``, where the logsumexp is NaN (a NaN among the allowed
            logits). It does not read ``weight``: without ``return_logprobs``, a NaN logit among
            finite ones (a NaN in a weight row or a bias) goes unreported and is never sampled.
            Without it, non-finite logits follow fixed rules (docs/cpu.md, "Non-finite logits"):
            a NaN logit is never sampled, a row of NaN logits returns token ``-1``, a row with
            +inf logits returns its first +inf token every time, a row of -inf logits its first
            allowed token.

    Returns:
        ``[B, num_samples]`` int64 token ids on ``hidden``'s device (``-1`` only for a row
        whose scores are all NaN, ``empty_mask_token`` for a row whose mask allows nothing);
        with ``return_logprobs`` a :class:`SampleOutput` ``(tokens, logprobs [B, num_samples]
        float32, logsumexp [B] float32)``; under truncation the log-probabilities are those
        of the truncated, renormalised distribution (the logsumexp runs over the survivors).

    Noise and exactness contract:
        The noise of element ``(b, s, v)`` is a pure function of
        ``(seed, offset, stream, s, vocab_start + v)``:
        ``key = (lo32(seed), hi32(seed))``,
        ``counter = (vocab_start + v, stream >> 2, lo32(offset + s), hi32(offset + s))``,
        ``bits = Philox4x32_10(key, counter)[stream & 3]``,
        ``u = (floor(bits / 2^9) + 1/2) / 2^23`` (strictly inside (0, 1)),
        ``g = -log(-log(u))`` in fp32; the score is ``fma(x, fl32(1 / T), g)`` in fp32 and
        exact ties go to the smaller index. It does not depend on tiling, kernel
        configuration, thread count or device, so samples are reproducible from
        ``(seed, offset)`` alone (:func:`flashsampling_cuda.noise.gumbel_noise`
        recomputes the noise in pure PyTorch).

    Example::

        >>> tokens = flashsampling_cuda.sample(hidden, lm_head.weight, temperature=0.7, seed=1234)
        >>> out = flashsampling_cuda.sample(hidden, lm_head.weight, seed=1234, return_logprobs=True,
        ...                                 sparse_logit_bias=[{50256: -100.0}] * hidden.shape[0])
        >>> out.tokens, out.logprobs, out.logsumexp
    """
    if check_nan:
        _check_nan_inputs(hidden)
    top_n, wanted_ids, mode = parse_logprob_args(
        return_logprobs, top_logprobs, token_ids, logprobs_mode, hidden.shape[0], hidden.device,
        vocab_start + weight.shape[0] if isinstance(weight, Tensor) and weight.dim() == 2 else None)
    route: dict = {}
    context: dict = {}
    kwargs = _op_kwargs(
        hidden, weight, temperature, generator, seed, offset, num_samples, logit_bias, sparse_logit_bias,
        allowed_mask, empty_mask_token, vocab_start, top_k, top_p, min_p, route, truncation_path, truncation_order,
        LogitTransforms(logit_scale, logit_softcap, repetition_penalty, frequency_penalty, presence_penalty,
                        penalty_state, prompt_token_ids, output_token_ids), context,
        logits_wanted=top_n > 0 or wanted_ids is not None or mode != "processed",
        # raw values: of the logits the fused pass stores, which have no bias added; with check_nan
        # raw values take the logits route, whose log-sum-exp NaN logits make NaN (the fused
        # route's log-masses carry none)
        fused_top_logprobs=((top_n, mode == "raw")
                            if mode == "processed" or (logit_bias is None and not check_nan) else None),
    )
    if not return_logprobs and not route and not check_nan:
        return torch.ops.flashsampling.sample(hidden, weight, **kwargs)
    tokens, scores, logprobs, logsumexp = _call_op(hidden, weight, kwargs, route, return_logprobs)
    if check_nan:
        _check_nan_outputs(weight, kwargs, tokens, scores, logsumexp, return_logprobs)
    if top_n > 0 or wanted_ids is not None or mode != "processed":
        return logprob_outputs(hidden, weight, context, route, tokens, logprobs, logsumexp, top_n, wanted_ids, mode)
    return SampleOutput(tokens, logprobs, logsumexp) if return_logprobs else tokens


def sample_with_scores(
    hidden: Tensor,
    weight: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    num_samples: int = 1,
    logit_bias: Tensor | None = None,
    sparse_logit_bias: SparseLogitBias | None = None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    return_logprobs: bool = False,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    truncation_path: str = "auto",
    truncation_order: str = "top_k_first",
    check_nan: bool = False,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    repetition_penalty: float | Tensor | None = None,
    frequency_penalty: float | Tensor | None = None,
    presence_penalty: float | Tensor | None = None,
    penalty_state: PenaltyState | None = None,
    prompt_token_ids: Tensor | Sequence[Sequence[int]] | None = None,
    output_token_ids: Tensor | Sequence[Sequence[int]] | None = None,
) -> ScoredSample:
    """:func:`sample` (same arguments) returning every output of the op, for callers that
    combine partial samples, e.g. tensor-parallel vocabulary shards: the winning score of
    each token, comparable across shards that share ``(seed, offset)`` (the global
    winner is the best score, exact ties to the smaller token id), and with
    ``return_logprobs`` each shard's token log-probability and logsumexp, which combine
    as ``lse = logsumexp over shards`` and ``logprob = logprob_shard + lse_shard - lse``.
    Under truncation the score is the winner's among the survivors (and truncation
    applies to the shard, so shards do not combine into a globally truncated sample).

    Returns:
        :class:`ScoredSample` ``(tokens int64 [B, S], scores float32 [B, S],
        token_logprobs float32 [B, S] or [0], logsumexp float32 [B] or [0])``.
    """
    return _scored_sample(
        hidden, weight, dict(temperature=temperature, generator=generator, seed=seed, offset=offset,
                             num_samples=num_samples, logit_bias=logit_bias, sparse_logit_bias=sparse_logit_bias,
                             allowed_mask=allowed_mask, empty_mask_token=empty_mask_token, vocab_start=vocab_start,
                             top_k=top_k, top_p=top_p, min_p=min_p, truncation_path=truncation_path,
                             truncation_order=truncation_order),
        LogitTransforms(logit_scale, logit_softcap, repetition_penalty, frequency_penalty, presence_penalty,
                        penalty_state, prompt_token_ids, output_token_ids), return_logprobs, check_nan)[0]


def _scored_sample(hidden: Tensor, weight: Tensor, args: dict, transforms: LogitTransforms, return_logprobs: bool,
                   check_nan: bool, context: dict | None = None, logits_wanted: bool = False
                   ) -> tuple[ScoredSample, dict]:
    """:func:`sample_with_scores` of ``args`` (its controls by name, :func:`_op_kwargs`'s) and the
    route it took; ``context``, where given, records the call for outputs computed beside the
    sample (:func:`flashsampling_cuda.logprobs.logprob_values`; the tensor-parallel merge), and
    ``logits_wanted`` says that those outputs read the logits (:func:`_op_kwargs`)."""
    if check_nan:
        _check_nan_inputs(hidden)
    route: dict = {}
    kwargs = _op_kwargs(hidden, weight, **args, route=route, transforms=transforms, context=context,
                        logits_wanted=logits_wanted)
    out = ScoredSample(*_call_op(hidden, weight, kwargs, route, return_logprobs))
    if check_nan:
        _check_nan_outputs(weight, kwargs, out.tokens, out.scores, out.logsumexp, return_logprobs)
    return out, route


def sample_from_logits(
    logits: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    num_samples: int = 1,
    logit_bias: Tensor | None = None,
    sparse_logit_bias: SparseLogitBias | None = None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    return_logprobs: bool = False,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
) -> Tensor | SampleOutput:
    """:func:`sample` for logits a caller already has (``[B, V]``), with the same controls,
    truncation and noise: the token :func:`sample` returns for ``hidden`` and ``weight`` whose
    fp32 logits are these (up to near ties within fp32 rounding of the two matmuls).

    On CUDA one kernel (csrc/kernels/sample_from_logits.cu) selects each row's survivors of
    ``top_k``/``top_p``/``min_p`` and samples them, with no host sync; the CPU runs the same
    semantics in torch ops (a reference: slow for large vocabularies).

    Args:
        logits: ``[B, V]`` floating tensor (used as float32), unit stride along ``V`` on CUDA.
        temperature, generator, seed, offset, num_samples, logit_bias, sparse_logit_bias,
        allowed_mask, empty_mask_token, return_logprobs, vocab_start, top_k, top_p, min_p:
            as in :func:`sample` (``vocab_start`` is the global id of column 0).

    Returns:
        as :func:`sample`: ``[B, num_samples]`` int64 tokens, or with ``return_logprobs`` a
        :class:`SampleOutput` of the truncated distribution.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        raise TypeError(f"flashsampling.sample_from_logits: logits must be a floating tensor, got "
                        f"{type(logits).__name__ if not isinstance(logits, Tensor) else logits.dtype}")
    if logits.dim() != 2:
        raise ValueError(f"flashsampling.sample_from_logits: logits must be 2-D [B, V], got shape {list(logits.shape)}")
    logits = logits.float()
    if logits.is_cuda and logits.stride(1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    scalar_temperature, temperatures = _temperature_args(temperature, logits)
    sparse_ids, sparse_values = _sparse_bias_args(sparse_logit_bias, logits)
    bias = _float32("logit_bias", logit_bias)
    if sparse_ids is not None:
        _check_fake_args(*_stand_ins(logits), num_samples, temperatures, None, None, bias, sparse_ids, sparse_values,
                         None)
        logits = transformed_logits(logits, bias, sparse_ids, sparse_values, vocab_start)
        bias = None
    truncation = parse_truncation(top_k, top_p, min_p, logits)
    tokens, _, logprobs, logsumexp = torch.ops.flashsampling.sample_from_logits(
        logits, temperature=scalar_temperature, temperatures=temperatures, num_samples=num_samples,
        seed=_seed_arg("seed", seed), offset=_seed_arg("offset", offset), generator=generator, logit_bias=bias,
        allowed_mask=_allowed_mask_arg(allowed_mask, logits, _stand_ins(logits)[1]),
        empty_mask_token=empty_mask_token, vocab_start=vocab_start, return_logprobs=return_logprobs,
        **logits_truncation_args(truncation, batch, logits.device),
    )
    return SampleOutput(tokens, logprobs, logsumexp) if return_logprobs else tokens


def _without_tokens(mask: Tensor, local: Tensor, vocab: int) -> Tensor:
    """The int32 bitmask ``mask [B, ceil(V / 32)]`` with the bit of each row's token ``local [B, 1]``
    (a local id; others, such as a filler token, leave the row as it is) cleared."""
    chosen = (local >= 0) & (local < vocab)
    index = local.clamp(0, vocab - 1)
    word = index >> 5
    bits = mask.gather(1, word).to(torch.int64) & 0xFFFFFFFF
    cleared = torch.where(chosen, bits & ~(1 << (index & 31)), bits)
    return mask.scatter(1, word, int32_words(cleared))


def sample_without_replacement(
    hidden: Tensor,
    weight: Tensor,
    k: int,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    logit_bias: Tensor | None = None,
    sparse_logit_bias: SparseLogitBias | None = None,
    allowed_mask: Tensor | None = None,
    empty_mask_token: int | None = None,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
) -> Tensor:
    r"""``k`` distinct tokens per row, an exact ordered sample without replacement
    (Gumbel-top-k), for beam search and n-best lists.

    The tokens are the allowed tokens (after ``top_k``/``top_p``/``min_p``) of the ``k``
    largest perturbed scores ``fma(x, fl32(1 / T), g)`` of one noise draw (draw 0 of
    ``(seed, offset)``), in descending score order, exact ties to the smaller index. For
    i.i.d. Gumbel noise this is the Plackett-Luce distribution of ``p = softmax(y)`` over
    the allowed tokens: ``P(t_1, ..., t_k) = prod_j p[t_j] / (1 - sum_{i<j} p[t_i])``.
    Token 0 is the token :func:`sample` returns for the same arguments; greedy rows
    (``T = 0``) return their ``k`` largest ``x`` in order.

    The weight is read once: one matmul gives the fp32 logits (:func:`materialized_logits`),
    the truncation's survivors come from them (on CUDA the logits sampler's rule, its fixed-point
    masses: :func:`~flashsampling_cuda.shard_truncation.whole_row_survivors`; on the CPU the
    float64 :func:`~flashsampling_cuda.truncation.survivor_mask`), and ``k`` calls of
    ``torch.ops.flashsampling.sample_from_logits`` with the same noise draw the tokens, call
    ``j`` excluding the ``j`` tokens already chosen through its mask, so its winner is the
    ``(j+1)``-th best score. On CUDA the logits are cuBLAS's, so token 0 can differ from
    :func:`sample`'s (the fused GEMM's logits) only at a near tie within fp32 rounding; fp32
    inputs on CUDA (whose matmul may run in TF32) and vocabularies above the logits sampler's
    take ``k`` passes of the fused op instead.

    Args:
        hidden, weight, temperature, logit_bias, sparse_logit_bias, allowed_mask,
        vocab_start, top_k, top_p, min_p: as in :func:`sample`.
        k: tokens per row, ``1 <= k <= V``.
        seed, offset, generator: as in :func:`sample`. With no seed, one batch-wide seed is
            drawn from ``generator`` (a 0-d tensor on its device, no sync) for all ``k``
            passes, so token 0 is then not the token ``sample(generator=...)`` would draw.
        empty_mask_token: fills the positions of a row past its allowed tokens (a row
            whose mask, after truncation, allows fewer than ``k``). Without it such a row is
            an error, which counting the allowed tokens finds (a host sync on CUDA, only
            with an ``allowed_mask`` or truncation).

    Returns:
        int64 ``[B, k]`` global token ids on ``hidden``'s device.
    """
    vocab = weight.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"flashsampling.sample_without_replacement: k must be an int in [1, V] = [1, {vocab}], "
                         f"got {k!r}")
    if seed is None:
        if offset is not None:
            raise ValueError("flashsampling.sample: offset was given without seed; with no seed the offset comes "
                             "from the generator")
        seed, generator = draw_seed(generator, hidden.device), None
    kwargs = _op_kwargs(hidden, weight, temperature, generator, seed, offset, 1, logit_bias, sparse_logit_bias,
                        allowed_mask, empty_mask_token, vocab_start)
    truncation = parse_truncation(top_k, top_p, min_p, hidden, "flashsampling.sample_without_replacement")
    _check_op_args_eagerly(hidden, weight, kwargs)
    on_cpu = hidden.device.type == "cpu"
    from_logits = on_cpu or (hidden.dtype in (torch.bfloat16, torch.float16) and vocab <= LOGITS_PATH_MAX_VOCAB)
    x = None
    if from_logits or truncation is not None:  # every bias in x: the same fp32 adds as the op's
        x = transformed_logits(materialized_logits(hidden, weight), kwargs["logit_bias"], kwargs["sparse_bias_ids"],
                               kwargs["sparse_bias_values"], vocab_start)
    batch = hidden.shape[0]
    mask = kwargs["allowed_mask"]
    if truncation is not None:  # on CUDA the logits sampler's survivors (its fixed-point masses): sample()'s
        mask = whole_row_survivors(x, mask, vocab_start, truncation, "top_k_first", kwargs["temperature"],
                                   kwargs["temperatures"])
    if mask is not None and empty_mask_token is None and batch > 0:
        fewest = int(unpack_allowed_mask(mask, vocab).sum(dim=1).min())
        if fewest < k:
            raise ValueError(
                f"flashsampling.sample_without_replacement: k = {k} exceeds the {fewest} allowed tokens "
                "(after top_k/top_p/min_p) of some row; pass empty_mask_token to fill such rows")
    # No row can run out unless filled (counted above; k <= V): the op need not read the masks.
    fill = -1 if empty_mask_token is None else empty_mask_token
    tokens = []
    for j in range(k):
        if from_logits:
            token = torch.ops.flashsampling.sample_from_logits(
                x, temperature=kwargs["temperature"], temperatures=kwargs["temperatures"], seed=kwargs["seed"],
                offset=kwargs["offset"], allowed_mask=mask, empty_mask_token=fill, vocab_start=vocab_start)[0]
        else:
            token = torch.ops.flashsampling.sample(hidden, weight, **dict(kwargs, allowed_mask=mask,
                                                                          empty_mask_token=fill))
        tokens.append(token)
        if j + 1 < k:
            if mask is None:  # every token allowed so far
                mask = pack_allowed_mask(torch.ones((batch, vocab), dtype=torch.bool, device=token.device))
            mask = _without_tokens(mask, token - vocab_start, vocab)
    return torch.cat(tokens, dim=1)


# ScalarType names as c10 prints them in checks.cpp's messages.
_C10_DTYPE_NAMES = {
    torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
    torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
    torch.bool: "Bool", torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble",
}
_MAX_INT32_EXTENT = 2**31 - 1


def _c10(dtype: torch.dtype) -> str:
    return _C10_DTYPE_NAMES.get(dtype, str(dtype))


def _check_fake_args(
    hidden, weight, num_samples, temperatures, seed, offset, logit_bias, sparse_bias_ids, sparse_bias_values,
    allowed_mask, *, temperature=1.0, generator=None, empty_mask_token=None, vocab_start=0, logit_scale=1.0,
    logit_softcap=None, penalty_ids=None, penalty_values=None, repetition_penalties=None, streams=None,
):
    """The checks of csrc/torch/checks.cpp (check_sample_args) that need no tensor values, in its
    order and with its messages (tests/test_fake_checks.py compares them): the fake kernel also
    serves the Meta dispatch key, which a meta tensor among CPU ones selects, so it must reject
    what the real kernels reject, in the same words."""
    prefix = "flashsampling.sample:"
    torch._check(hidden.dim() == 2, lambda: f"{prefix} hidden must be 2-D [B, D], got shape {list(hidden.shape)}")
    torch._check(weight.dim() == 2, lambda: f"{prefix} weight must be 2-D [V, D], got shape {list(weight.shape)}")
    torch._check(
        hidden.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"{prefix} hidden must be bfloat16, float16 or float32, got {_c10(hidden.dtype)}",
    )
    torch._check(
        weight.dtype == hidden.dtype,
        lambda: f"{prefix} weight dtype ({_c10(weight.dtype)}) must match hidden dtype ({_c10(hidden.dtype)})",
    )
    torch._check(
        weight.device == hidden.device,
        lambda: f"{prefix} weight must be on hidden's device ({hidden.device}), got {weight.device}",
    )
    torch._check(
        weight.shape[1] == hidden.shape[1],
        lambda: f"{prefix} hidden [B, D] and weight [V, D] must have the same D, got hidden shape "
        f"{list(hidden.shape)} and weight shape {list(weight.shape)}",
    )
    batch, vocab = hidden.shape[0], weight.shape[0]
    torch._check(1 <= vocab <= _MAX_INT32_EXTENT,
                 lambda: f"{prefix} weight must have 1 <= V < 2^31 rows, got shape {list(weight.shape)}")
    torch._check(batch <= _MAX_INT32_EXTENT,
                 lambda: f"{prefix} hidden must have B < 2^31 rows, got shape {list(hidden.shape)}")
    if isinstance(vocab_start, int):
        torch._check(0 <= vocab_start <= _MAX_INT32_EXTENT - vocab,
                     lambda: f"{prefix} vocab_start must be >= 0 with vocab_start + V < 2^31, got "
                     f"vocab_start={vocab_start} and V={vocab}")
    torch._check(1 <= num_samples <= _MAX_INT32_EXTENT, lambda: f"{prefix} num_samples must be >= 1, got {num_samples}")
    if isinstance(temperature, (int, float)):
        torch._check(temperature == 0 or _positive_normal_float32(float(temperature)),
                     lambda: f"{prefix} temperature must be finite and >= 0 (0 = greedy; a positive one at least "
                     f"1.17549435e-38, a normal float32), got {_c10_double(temperature)}")

    def check(name, t, dtypes, dtype_text, shapes, shape_text, cpu_ok=False):
        torch._check(t.dtype in dtypes, lambda: f"{prefix} {name} must be {dtype_text}, got {_c10(t.dtype)}")
        torch._check(
            tuple(t.shape) in shapes,
            lambda: f"{prefix} {name} must have shape {shape_text}, got shape {list(t.shape)}",
        )
        where = "on the CPU or on hidden's device" if cpu_ok else "on hidden's device"
        torch._check(
            t.device == hidden.device or (cpu_ok and t.device.type == "cpu"),
            lambda: f"{prefix} {name} must be {where} ({hidden.device}), got {t.device}",
        )

    if temperatures is not None:
        check("temperatures", temperatures, (torch.float32,), "a float32 tensor", [(batch,)], f"[B] = [{batch}]")
    _check_model_transform_fake(prefix, logit_scale, logit_softcap)
    seed_shapes = ([(), (batch,)], f"[] (batch-wide) or [B] = [{batch}] (one per row)")
    if seed is not None:
        check("seed", seed, (torch.int64,), "an int64 tensor", *seed_shapes, cpu_ok=True)
        torch._check(generator is None, lambda: f"{prefix} pass either seed or generator, not both")
    if offset is not None:
        torch._check(seed is not None, lambda: f"{prefix} offset was given without seed; with no seed the offset "
                     "comes from the generator")
        check("offset", offset, (torch.int64,), "an int64 tensor", *seed_shapes, cpu_ok=True)
    if streams is not None:
        torch._check(streams.dim() == 1,
                     lambda: f"{prefix} streams must have shape [B] = [{batch}], got shape {list(streams.shape)}")
        check("streams", streams, (torch.int64,), "an int64 tensor", *seed_shapes, cpu_ok=True)
    if logit_bias is not None:
        check("logit_bias", logit_bias, (torch.float32,), "float32", [(vocab,)], f"[V] = [{vocab}]")
    torch._check(
        (sparse_bias_ids is None) == (sparse_bias_values is None),
        lambda: f"{prefix} sparse_bias_ids and sparse_bias_values go together; got only "
        f"{'sparse_bias_ids' if sparse_bias_ids is not None else 'sparse_bias_values'}",
    )
    if sparse_bias_ids is not None:
        torch._check(sparse_bias_ids.dim() == 2 and sparse_bias_ids.shape[0] == batch,
                     lambda: f"{prefix} sparse_bias_ids must have shape [B, K] = [{batch}, K], got shape "
                     f"{list(sparse_bias_ids.shape)}")
        shape = tuple(sparse_bias_ids.shape)
        check("sparse_bias_ids", sparse_bias_ids, (torch.int32, torch.int64), "int32 or int64", [shape],
              f"[B, K] = {list(shape)}")
        check("sparse_bias_values", sparse_bias_values, (torch.float32,), "float32", [shape],
              f"[B, K] (the shape of sparse_bias_ids) = {list(shape)}")
    if allowed_mask is not None:
        words = (vocab + 31) // 32
        check("allowed_mask", allowed_mask, (torch.int32,), "int32", [(batch, words)],
              f"[B, ceil(V / 32)] = [{batch}, {words}]")
    if penalty_ids is not None:
        torch._check(penalty_ids.dim() == 2 and penalty_ids.shape[0] == batch
                     and penalty_ids.shape[1] <= _MAX_INT32_EXTENT,
                     lambda: f"{prefix} penalty_ids must have shape [B, C] = [{batch}, C], got shape "
                     f"{list(penalty_ids.shape)}")
        shape = tuple(penalty_ids.shape)
        check("penalty_ids", penalty_ids, (torch.int64,), "int64", [shape], f"[B, C] = {list(shape)}")
        if penalty_values is not None:
            check("penalty_values", penalty_values, (torch.float32,), "float32", [shape],
                  f"[B, C] (the shape of penalty_ids) = {list(shape)}")
        if repetition_penalties is not None:
            check("repetition_penalties", repetition_penalties, (torch.float32,), "float32", [(batch,)],
                  f"[B] = [{batch}]")
    else:
        torch._check(penalty_values is None and repetition_penalties is None,
                     lambda: f"{prefix} penalty_values and repetition_penalties need penalty_ids")
    if isinstance(empty_mask_token, int) and isinstance(vocab_start, int):
        torch._check(
            empty_mask_token < 0 or vocab_start <= empty_mask_token < vocab_start + vocab,
            lambda: f"{prefix} empty_mask_token must be a token id in [vocab_start, vocab_start + V) = "
            f"[{vocab_start}, {vocab_start + vocab}) or negative (a marker such as -1), got {empty_mask_token}",
        )


def _check_model_transform_fake(prefix: str, logit_scale, logit_softcap) -> None:
    """checks.cpp's check_model_transform_args, its messages."""
    for name, value in (("logit_scale", logit_scale), ("logit_softcap", logit_softcap)):
        if isinstance(value, (int, float)):
            torch._check(_positive_normal_float32(float(value)),
                         lambda: f"{prefix} {name} must be finite and > 0 (a normal float32), got "
                         f"{_c10_double(float(value))}")


def _c10_double(value: float) -> str:
    """A double as c10's error messages print it (std::ostream: 6 significant digits)."""
    return f"{value:g}" if math.isfinite(value) else ("nan" if value != value else ("inf" if value > 0 else "-inf"))


@torch.library.register_fake("flashsampling::sample")
def _sample_fake(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, logit_scale=1.0, logit_softcap=None, penalty_ids=None,
    penalty_values=None, repetition_penalties=None, streams=None,
):
    _check_fake_args(hidden, weight, num_samples, temperatures, seed, offset, logit_bias, sparse_bias_ids,
                     sparse_bias_values, allowed_mask, temperature=temperature, generator=generator,
                     empty_mask_token=empty_mask_token, vocab_start=vocab_start, logit_scale=logit_scale,
                     logit_softcap=logit_softcap, penalty_ids=penalty_ids, penalty_values=penalty_values,
                     repetition_penalties=repetition_penalties, streams=streams)
    return hidden.new_empty((hidden.shape[0], num_samples), dtype=torch.int64)


@torch.library.register_fake("flashsampling::sample_with_scores")
def _sample_with_scores_fake(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, logit_scale=1.0, logit_softcap=None, penalty_ids=None,
    penalty_values=None, repetition_penalties=None, streams=None, return_logprobs=False,
):
    _check_fake_args(hidden, weight, num_samples, temperatures, seed, offset, logit_bias, sparse_bias_ids,
                     sparse_bias_values, allowed_mask, temperature=temperature, generator=generator,
                     empty_mask_token=empty_mask_token, vocab_start=vocab_start, logit_scale=logit_scale,
                     logit_softcap=logit_softcap, penalty_ids=penalty_ids, penalty_values=penalty_values,
                     repetition_penalties=repetition_penalties, streams=streams)
    batch = hidden.shape[0]
    shape = (batch, num_samples)
    return (
        hidden.new_empty(shape, dtype=torch.int64),
        hidden.new_empty(shape, dtype=torch.float32),
        hidden.new_empty(shape if return_logprobs else (0,), dtype=torch.float32),
        hidden.new_empty((batch,) if return_logprobs else (0,), dtype=torch.float32),
    )


def _check_fused_top_k(top_k: int, top_ks) -> None:
    """The op's checks of top_k / top_ks (sample_cuda.cpp: check_fused_top_k), for its fake and
    CPU kernels."""
    torch._check(top_k >= -1, lambda: f"flashsampling.sample_top_k: top_k must be an integer >= -1 (-1 or 0: off), "
                 f"got {top_k}")
    if top_ks is not None:
        torch._check(top_ks.dtype in ROW_TOP_K_DTYPES,
                     lambda: f"flashsampling.sample_top_k: top_ks must be an int32 or int64 tensor, got {top_ks.dtype}")


@torch.library.register_fake("flashsampling::sample_top_k")
def _sample_top_k_fake(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, return_logprobs=False, top_k=0, top_p=None, top_ps=None, min_p=None,
    min_ps=None, top_ks=None, streams=None,
):
    _check_fused_top_k(top_k, top_ks)
    return _sample_with_scores_fake(
        hidden, weight, temperature=temperature, temperatures=temperatures, num_samples=num_samples, seed=seed,
        offset=offset, generator=generator, logit_bias=logit_bias, sparse_bias_ids=sparse_bias_ids,
        sparse_bias_values=sparse_bias_values, allowed_mask=allowed_mask, empty_mask_token=empty_mask_token,
        vocab_start=vocab_start, streams=streams, return_logprobs=return_logprobs,
    )


@torch.library.register_kernel("flashsampling::sample_top_k", "cpu")
def _sample_top_k_cpu(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, return_logprobs=False, top_k=0, top_p=None, top_ps=None, min_p=None,
    min_ps=None, top_ks=None, streams=None,
):
    """The op on the CPU: the materialised path (truncation.py), whose logits are the CPU op's
    bit for bit, so it is the same sample the fused pass computes on the GPU (with ``streams``,
    through ``sample_with_scores``, which takes them, on the survivors' mask)."""
    _check_fused_top_k(top_k, top_ks)
    kwargs = dict(temperature=temperature, temperatures=temperatures, num_samples=num_samples, seed=seed,
                  offset=offset, generator=generator, logit_bias=logit_bias, sparse_bias_ids=sparse_bias_ids,
                  sparse_bias_values=sparse_bias_values, allowed_mask=allowed_mask,
                  empty_mask_token=empty_mask_token, vocab_start=vocab_start)
    truncation = Truncation(top_ks if top_ks is not None else (top_k if top_k > 0 else None),
                            top_ps if top_ps is not None else top_p, min_ps if min_ps is not None else min_p)
    logits = materialized_logits(hidden, weight)
    kwargs["allowed_mask"], kwargs["empty_mask_token"] = truncated_allowed_mask(hidden, weight, kwargs, truncation,
                                                                                logits)
    if streams is not None:
        return torch.ops.flashsampling.sample_with_scores(hidden, weight, **kwargs, streams=streams,
                                                          return_logprobs=return_logprobs)
    return torch.ops.flashsampling._sample_logits(logits, **kwargs, return_logprobs=return_logprobs)


def _check_top_logprobs_op(top_n: int, vocab: int, num_samples: int, allowed_mask, sparse_bias_ids, raw: bool,
                           logit_bias) -> None:
    """sample_cuda.cpp's checks of flashsampling._sample_top_logprobs, for its fake and CPU kernels."""
    prefix = "flashsampling._sample_top_logprobs:"
    torch._check(0 <= top_n <= MAX_TOP_LOGPROBS,
                 lambda: f"{prefix} top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    torch._check(top_n <= vocab, lambda: f"{prefix} top_n must be at most V={vocab}, got {top_n}")
    torch._check(num_samples == 1, lambda: f"{prefix} num_samples must be 1, got {num_samples}")
    torch._check(allowed_mask is None and sparse_bias_ids is None,
                 lambda: f"{prefix} takes no allowed_mask or sparse bias (flashsampling_cuda.sample routes those "
                 "calls elsewhere)")
    torch._check(not raw or logit_bias is None,
                 lambda: f"{prefix} raw takes no logit_bias (the logits the pass stores have it added)")


@torch.library.register_fake("flashsampling::_sample_top_logprobs")
def _sample_top_logprobs_fake(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, top_n=0, raw=False,
):
    _check_top_logprobs_op(top_n, weight.shape[0], num_samples, allowed_mask, sparse_bias_ids, raw, logit_bias)
    sample = _sample_with_scores_fake(
        hidden, weight, temperature=temperature, temperatures=temperatures, num_samples=num_samples, seed=seed,
        offset=offset, generator=generator, logit_bias=logit_bias, sparse_bias_ids=sparse_bias_ids,
        sparse_bias_values=sparse_bias_values, allowed_mask=allowed_mask, empty_mask_token=empty_mask_token,
        vocab_start=vocab_start, return_logprobs=True,
    )
    batch, vocab = hidden.shape[0], weight.shape[0]
    # CUDA: a view of the GEMM's stored rows, whose stride is V rounded up to 128; CPU: contiguous
    stride = (vocab + 127) // 128 * 128 if hidden.device.type == "cuda" else vocab
    return (*sample, hidden.new_empty((batch, top_n), dtype=torch.float32),
            hidden.new_empty((batch, top_n), dtype=torch.int64), hidden.new_empty((batch, 1), dtype=torch.int64),
            torch.empty_strided((batch, vocab), (stride, 1), dtype=torch.float32, device=hidden.device))


@torch.library.register_kernel("flashsampling::_sample_top_logprobs", "cpu")
def _sample_top_logprobs_cpu(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None, logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None,
    empty_mask_token=None, vocab_start=0, top_n=0, raw=False,
):
    """The op on the CPU (the reference of the CUDA kernels in the tests): the CPU op's sample
    from its own logits, and the logits route's outputs of them (raw: the raw log-sum-exp, the
    token's raw log-probability, the raw top N and ranks)."""
    _check_top_logprobs_op(top_n, weight.shape[0], num_samples, allowed_mask, sparse_bias_ids, raw, logit_bias)
    _check_fake_args(hidden, weight, num_samples, temperatures, seed, offset, logit_bias, sparse_bias_ids,
                     sparse_bias_values, allowed_mask, temperature=temperature, generator=generator,
                     empty_mask_token=empty_mask_token, vocab_start=vocab_start)
    logits = materialized_logits(hidden, weight)
    tokens, scores, logprobs, lse = torch.ops.flashsampling._sample_logits(
        logits, temperature=temperature, temperatures=temperatures, seed=seed, offset=offset, generator=generator,
        logit_bias=logit_bias, vocab_start=vocab_start, return_logprobs=True)
    x = logits if logit_bias is None else logits + logit_bias
    local, valid = ranked_tokens(tokens, lse, vocab_start, x.shape[1])
    if raw:
        lse_raw = raw_logsumexp(x)
        logprobs = raw_token_logprobs(x, lse_raw, local, valid)
        top_values, top_ids, ranks = top_logprobs_cpu(x, lse_raw, torch.where(valid, local, -1), top_n, raw=True)
        return tokens, scores, logprobs, lse_raw.float(), top_values, top_ids, ranks, x
    scales = temperature_scales(x.shape[0], temperature, temperatures, x.device)
    top_values, top_ids, ranks = top_logprobs_cpu(x * scales[:, None], lse.double(), torch.where(valid, local, -1),
                                                  top_n, raw=False)
    return tokens, scores, logprobs, lse, top_values, top_ids, ranks, x


@torch.library.register_fake("flashsampling::_model_logits")
def _model_logits_fake(logits, logit_scale=1.0, logit_softcap=None):
    torch._check(logits.dtype == torch.float32,
                 lambda: f"flashsampling._model_logits: logits must be float32, got {_c10(logits.dtype)}")
    _check_model_transform_fake("flashsampling._model_logits:", logit_scale, logit_softcap)
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@torch.library.register_fake("flashsampling::_logits")
def _logits_fake(hidden, weight):
    _check_fake_args(hidden, weight, 1, None, None, None, None, None, None, None)
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.register_fake("flashsampling::_sample_logits")
def _sample_logits_fake(
    logits, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None, generator=None,
    logit_bias=None, sparse_bias_ids=None, sparse_bias_values=None, allowed_mask=None, empty_mask_token=None,
    vocab_start=0, return_logprobs=False,
):
    torch._check(logits.dim() == 2 and logits.dtype == torch.float32,
                 lambda: f"flashsampling._sample_logits: logits must be float32 [B, V], got {logits.dtype} of shape "
                 f"{list(logits.shape)}")
    batch, shape = logits.shape[0], (logits.shape[0], num_samples)
    return (
        logits.new_empty(shape, dtype=torch.int64),
        logits.new_empty(shape, dtype=torch.float32),
        logits.new_empty(shape if return_logprobs else (0,), dtype=torch.float32),
        logits.new_empty((batch,) if return_logprobs else (0,), dtype=torch.float32),
    )


def _stand_ins(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Empty hidden ``[B, 0]`` and weight ``[V, 0]`` of ``logits [B, V]``'s shape and device, so
    that ``sample_from_logits``'s controls are checked by sample's rules and messages (as the
    CUDA binding does with ``check_sample_args``)."""
    batch, vocab = logits.shape
    return (logits.new_empty((batch, 0), dtype=torch.bfloat16), logits.new_empty((vocab, 0), dtype=torch.bfloat16))


def _check_logits_op_args(logits, temperature, temperatures, num_samples, seed, offset, logit_bias, allowed_mask,
                          top_k, top_ks, top_p, top_ps, min_p, min_ps, empty_mask_token=None, vocab_start=0,
                          generator=None):
    """The checks of sample_cuda.cpp's sample_from_logits that need no device values."""
    prefix = "flashsampling.sample_from_logits:"
    torch._check(logits.dim() == 2, lambda: f"{prefix} logits must be 2-D [B, V], got shape {list(logits.shape)}")
    torch._check(logits.dtype == torch.float32, lambda: f"{prefix} logits must be float32, got {logits.dtype}")
    torch._check(logits.shape[1] >= 1, lambda: f"{prefix} logits must have V >= 1 columns, got {list(logits.shape)}")
    hidden, weight = _stand_ins(logits)
    _check_fake_args(hidden, weight, num_samples, temperatures, seed, offset, logit_bias, None, None, allowed_mask,
                     temperature=temperature, generator=generator, empty_mask_token=empty_mask_token,
                     vocab_start=vocab_start)
    if logits.device.type == "cuda":  # sample_cuda.cpp's limits of the kernel
        vocab = logits.shape[1]
        torch._check(vocab <= LOGITS_PATH_MAX_VOCAB, lambda: f"{prefix} logits must have V <= {LOGITS_PATH_MAX_VOCAB} "
                     f"columns on CUDA, got V={vocab}")
        torch._check(logits.stride(1) == 1 or vocab == 1, lambda: f"{prefix} logits must have unit stride along V, "
                     f"got strides {list(logits.stride())}")
    torch._check(0.0 < top_p <= 1.0, lambda: f"{prefix} top_p must be in (0, 1] (1: off), got {top_p}")
    torch._check(0.0 <= min_p <= 1.0, lambda: f"{prefix} min_p must be in [0, 1] (0: off), got {min_p}")
    batch = logits.shape[0]
    for name, t, dtypes, kind in (("top_ks", top_ks, ROW_TOP_K_DTYPES, "an int32 or int64"),
                                  ("top_ps", top_ps, ROW_PROBABILITY_DTYPES, "a float32 or float64"),
                                  ("min_ps", min_ps, ROW_PROBABILITY_DTYPES, "a float32 or float64")):
        if t is None:
            continue
        torch._check(t.dtype in dtypes, lambda: f"{prefix} {name} must be {kind} tensor, got {t.dtype}")
        torch._check(tuple(t.shape) == (batch,), lambda: f"{prefix} {name} must have shape [B] = [{batch}], got "
                     f"{list(t.shape)}")
        torch._check(t.device == logits.device, lambda: f"{prefix} {name} must be on logits' device "
                     f"({logits.device}), got {t.device}")


@torch.library.register_fake("flashsampling::sample_from_logits")
def _sample_from_logits_fake(
    logits, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None, generator=None,
    logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0, return_logprobs=False, top_k=0,
    top_ks=None, top_p=1.0, top_ps=None, min_p=0.0, min_ps=None,
):
    _check_logits_op_args(logits, temperature, temperatures, num_samples, seed, offset, logit_bias, allowed_mask,
                          top_k, top_ks, top_p, top_ps, min_p, min_ps, empty_mask_token, vocab_start, generator)
    batch = logits.shape[0]
    shape = (batch, num_samples)
    return (
        logits.new_empty(shape, dtype=torch.int64),
        logits.new_empty(shape, dtype=torch.float32),
        logits.new_empty(shape if return_logprobs else (0,), dtype=torch.float32),
        logits.new_empty((batch,) if return_logprobs else (0,), dtype=torch.float32),
    )


def _check_top_logprobs_args(values, lse, tokens, top_n, scales=None) -> None:
    """top_logprobs_cuda.cpp's checks of flashsampling._top_logprobs (RuntimeError)."""
    prefix = "flashsampling._top_logprobs:"
    torch._check(values.dim() == 2 and values.dtype == torch.float32,
                 lambda: f"{prefix} values must be a float32 [B, V] tensor, got {values.dtype} {list(values.shape)}")
    batch = values.shape[0]
    torch._check(lse.dtype == torch.float64 and tuple(lse.shape) == (batch,),
                 lambda: f"{prefix} lse must be a float64 [B] tensor with B = {batch}, got {lse.dtype} "
                 f"{list(lse.shape)}")
    torch._check(tokens.dtype == torch.int64 and tokens.dim() == 2 and tokens.shape[0] == batch,
                 lambda: f"{prefix} tokens must be an int64 [B, S] tensor with B = {batch}, got {tokens.dtype} "
                 f"{list(tokens.shape)}")
    torch._check(0 <= top_n <= min(MAX_TOP_LOGPROBS, values.shape[1]),
                 lambda: f"{prefix} top_n must be in [0, min(V, {MAX_TOP_LOGPROBS})], got {top_n}")
    torch._check(scales is None or (scales.dtype == torch.float32 and tuple(scales.shape) == (batch,)),
                 lambda: f"{prefix} scales must be a float32 [B] tensor with B = {batch}")


@torch.library.register_fake("flashsampling::_uniform_noise")
def _uniform_noise_fake(seed, offset, stream, sample, vocab_index):
    for name, t in (("offset", offset), ("stream", stream), ("sample", sample), ("vocab_index", vocab_index)):
        torch._check(t.shape == seed.shape, lambda: f"flashsampling._uniform_noise: {name} must have seed's shape "
                     f"{list(seed.shape)}, got {list(t.shape)}")
    return seed.new_empty(seed.shape, dtype=torch.float32)


@torch.library.register_fake("flashsampling::_top_logprobs")
def _top_logprobs_fake(values, lse, tokens, top_n, raw, scales=None):
    _check_top_logprobs_args(values, lse, tokens, top_n, scales)
    batch = values.shape[0]
    return (values.new_empty((batch, top_n)), tokens.new_empty((batch, top_n)),
            tokens.new_empty((batch, tokens.shape[1])))


@torch.library.register_fake("flashsampling::_row_logsumexp")
def _row_logsumexp_fake(values):
    _check_row_logsumexp_args(values)
    return values.new_empty((values.shape[0],))


@torch.library.register_kernel("flashsampling::_row_logsumexp", "cpu")
def _row_logsumexp_cpu(values):
    _check_row_logsumexp_args(values)
    return torch.logsumexp(values, dim=1)


def _check_row_logsumexp_args(values) -> None:
    torch._check(values.dim() == 2 and values.dtype == torch.float32,
                 lambda: f"flashsampling._row_logsumexp: values must be a float32 [B, V] tensor, got {values.dtype} "
                 f"{list(values.shape)}")


@torch.library.register_kernel("flashsampling::_top_logprobs", "cpu")
def _top_logprobs_cpu_kernel(values, lse, tokens, top_n, raw, scales=None):
    _check_top_logprobs_args(values, lse, tokens, top_n, scales)
    return top_logprobs_cpu(values if scales is None else values * scales[:, None], lse, tokens, top_n, raw)


@torch.library.register_kernel("flashsampling::sample_from_logits", "cpu")
def _sample_from_logits_cpu_kernel(
    logits, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None, generator=None,
    logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0, return_logprobs=False, top_k=0,
    top_ks=None, top_p=1.0, top_ps=None, min_p=0.0, min_ps=None,
):
    """The op on the CPU (truncation.sample_from_logits_cpu): the CUDA binding's checks of the
    truncation here, the rest in the CPU op it calls."""
    _check_logits_op_args(logits, temperature, temperatures, num_samples, seed, offset, logit_bias, allowed_mask,
                          top_k, top_ks, top_p, top_ps, min_p, min_ps, empty_mask_token, vocab_start, generator)
    return sample_from_logits_cpu(
        logits, temperature=temperature, temperatures=temperatures, num_samples=num_samples, seed=seed, offset=offset,
        generator=generator, logit_bias=logit_bias, allowed_mask=allowed_mask, empty_mask_token=empty_mask_token,
        vocab_start=vocab_start, return_logprobs=return_logprobs, top_k=top_k, top_ks=top_ks, top_p=top_p,
        top_ps=top_ps, min_p=min_p, min_ps=min_ps,
    )
