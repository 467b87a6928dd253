"""Speculative-decoding verification: exact rejection sampling of draft tokens against the
target model's distribution (Leviathan et al. 2023; Chen et al. 2023), with the noise of
:func:`flashsampling_cuda.sample`.

Per row ``b``, positions ``j = 0 .. n - 1`` in order, ``p_j`` the target's distribution at
position ``j`` (the logits ``hidden[b, j] . weight``, then the biases, mask, temperature and
truncation of ``sample``), ``d_j`` the draft token, ``t_j`` the token ``sample`` draws from ``p_j``
with the noise of offset ``offset + j`` (stream ``b``, or 0 with per-row seeds), so that the bonus
token ``t_n`` is the token ``sample(hidden[:, n], weight, offset=offset + n)`` returns:

- one-hot drafts (``draft_probs=None``: greedy EAGLE / MTP drafts, n-grams): accept ``d_j`` when
  ``t_j = d_j``; otherwise emit ``t_j`` and stop. This is rejection sampling with the draw
  coupled to the acceptance: ``P(t_j = d_j) = p_j(d_j)`` is the acceptance probability, and given
  ``t_j != d_j`` the token ``t_j`` is a sample of ``p_j`` without ``d_j`` (renormalised), the
  corrective sample. A greedy row (``T = 0``) is the same rule with ``t_j`` the argmax;
- sampled drafts (``draft_probs [B, n, V]``, the draft model's ``q``): accept when
  ``u_j < min(1, p_j(d_j) / q_j(d_j))``, with the acceptance uniform ``u_j`` of ``(b, j)``,
  :func:`flashsampling_cuda.noise.uniform_noise` at ``(seed, offset, stream_b, j, 2^32 - 1)``; on
  rejection emit Gumbel-Max over ``log max(0, p_j - q_j)`` (renormalised) with the noise of
  ``t_j`` and stop; a greedy row accepts while ``d_j`` is the argmax and emits the argmax;
- all ``n`` accepted: emit the bonus token ``t_n``.

The output follows the target's distribution exactly (up to the uniforms' 2^-23 grid and the
fp32 rounding of ``p`` for sampled drafts), and ``(seed, offset)`` reproduces a step. After a
rejected sampled draft whose residual has no mass (``q >= p`` everywhere, possible only within
the draft distributions' sum tolerance or by rounding), the target's own sample ``t_j`` is emitted.

Routes, all without a host sync (CUDA-graph capture, ``torch.compile(fullgraph=True)``):

- one-hot drafts, bf16 / fp16 on CUDA or any dtype on the CPU, without truncation
  (:func:`position_tokens_fused`): one call of the fused op over the ``B * (n + 1)`` rows
  (``_sample_positions``: position ``j`` of row ``b`` draws sample ``j``'s noise of row ``b``, the
  layout of ``sample``'s several samples), with row ``b``'s temperature, bias and mask: the target
  logits never reach memory;
- one-hot drafts with truncation that the fused top-k pass takes on CUDA
  (:func:`position_tokens_truncated_fused`): one ``sample_top_k`` call over the same rows, each
  with its row's noise stream (``streams``), seed and offset ``offset + j``;
- one-hot drafts otherwise (:func:`position_tokens_from_logits`: other truncation, fp32 on
  CUDA): the target logits computed once, then ``sample_from_logits`` per position, which
  truncates;
- sampled drafts (:func:`verify`): the fp32 logits once (cuBLAS on CUDA); each draft position's
  log-sum-exp, argmax and draft value in one pass (``_draft_position_stats``); the acceptance
  walk; then one sample a row at the position where it stops, from the logits
  ``_stop_row_logits`` forms there (the residual's, or the bonus token's).

The helpers below are shared with the tensor-parallel verification,
:func:`flashsampling_cuda.distributed.speculative_sample`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .masks import pack_allowed_mask, unpack_allowed_mask
from .noise import as_int64_tensor, draw_seed, uniform_noise
from .penalties import rule_logits
from .sampling import _model_transform_args
from .truncation import (Truncation, fused_pass_preferred, fused_top_k_args, fused_top_k_takes,
                         logits_truncation_args, materialized_logits, parse_truncation, scaled_logits, survivor_mask,
                         temperature_scales)

__all__ = ["speculative_sample", "SpeculativeOutput"]

_ACCEPT_INDEX = 2**32 - 1  # the acceptance uniforms' vocabulary index: no token has it
MAX_FUSED_POSITIONS = 65535  # n + 1 the fused op takes on CUDA (its samples on the grid's y; more: the logits)


class SpeculativeOutput(NamedTuple):
    tokens: Tensor  # int64 [B, n + 1]: accepted drafts, then the corrective or bonus token, -1 after
    num_accepted: Tensor  # int64 [B]
    logprobs: Tensor | None  # float32 [B, n + 1]: log p_j of each emitted token (NaN after), or None


def _per_row_int64(prefix: str, name: str, value, batch: int, device) -> tuple[Tensor, bool]:
    """(int64 [B] values, per_row) of a seed / offset given as an int, 0-d or [B] tensor."""
    if isinstance(value, Tensor):
        if value.dtype != torch.int64 or value.dim() > 1 or (value.dim() == 1 and value.shape[0] != batch):
            raise ValueError(f"{prefix}: {name} must be an int, or an int64 0-d or [B] "
                             f"tensor with B = {batch}, got {value.dtype} with shape {list(value.shape)}")
        return value.to(device).expand(batch), value.dim() == 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{prefix}: {name} must be an int or a tensor, got "
                        f"{type(value).__name__}")
    return as_int64_tensor(value, device).expand(batch), False


class _Step(NamedTuple):
    """A verification step's arguments, checked: per-row seeds, offsets, streams, temperatures."""

    batch: int
    n: int
    seeds: Tensor  # int64 [B]
    per_row_seed: bool
    offsets: Tensor  # int64 [B]
    streams: Tensor  # int64 [B]
    temps: Tensor  # float32 [B]
    greedy: Tensor  # bool [B]
    truncation: Truncation | None
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    scalar_temperature: float | None = None  # the call's temperature where it was a number (not a tensor)
    per_row_offset: bool = False  # offset given as a [B] tensor


def parse_step(name: str, hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
               temperature, seed, offset, top_k, top_p, min_p, draw_seed_fn, logit_scale: float = 1.0,
               logit_softcap: float | None = None, logit_bias: Tensor | None = None,
               allowed_mask: Tensor | None = None) -> _Step:
    """Checks the arguments of a verification step (``weight``: the rows this process holds, whose
    count ``draft_probs``' last dimension must have) and reads them per row; ``draw_seed_fn()``
    draws the seed when ``seed`` is None."""
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        raise ValueError(f"{name}: hidden must be [B, n + 1, D], got "
                         f"{list(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__}")
    batch, positions, dim = hidden.shape
    n = positions - 1
    if n < 0:
        raise ValueError(f"{name}: hidden must have n + 1 >= 1 positions")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != dim:
        raise ValueError(f"{name}: weight must be [V, {dim}], got "
                         f"{list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    vocab = weight.shape[0]
    device = hidden.device
    if (not isinstance(draft_token_ids, Tensor) or draft_token_ids.dtype != torch.int64
            or tuple(draft_token_ids.shape) != (batch, n)):
        raise ValueError(f"{name}: draft_token_ids must be int64 [{batch}, {n}], got "
                         f"{getattr(draft_token_ids, 'dtype', type(draft_token_ids).__name__)} "
                         f"{list(getattr(draft_token_ids, 'shape', []))}")
    if draft_probs is not None and (not isinstance(draft_probs, Tensor) or not draft_probs.is_floating_point()
                                    or tuple(draft_probs.shape) != (batch, n, vocab)):
        raise ValueError(f"{name}: draft_probs must be floating [{batch}, {n}, {vocab}] or None, got "
                         f"{list(getattr(draft_probs, 'shape', []))}")
    if seed is None:
        seed = draw_seed_fn()
    seeds, per_row_seed = _per_row_int64(name, "seed", seed, batch, device)
    offsets, per_row_offset = _per_row_int64(name, "offset", 0 if offset is None else offset, batch, device)
    scale, softcap = _model_transform_args(logit_scale, logit_softcap, name)
    streams = torch.zeros(batch, dtype=torch.int64, device=device) if per_row_seed else torch.arange(
        batch, device=device)
    if logit_bias is not None and (not isinstance(logit_bias, Tensor) or not logit_bias.is_floating_point()
                                   or tuple(logit_bias.shape) != (vocab,)):
        raise ValueError(f"{name}: logit_bias must be a floating [{vocab}] tensor, got "
                         f"{getattr(logit_bias, 'dtype', type(logit_bias).__name__)} {list(getattr(logit_bias, 'shape', []))}")
    words = (vocab + 31) // 32
    if allowed_mask is not None and not (
            isinstance(allowed_mask, Tensor) and ((allowed_mask.dtype == torch.int32 and tuple(allowed_mask.shape) == (
                batch, words)) or (allowed_mask.dtype == torch.bool and tuple(allowed_mask.shape) == (batch, vocab)))):
        raise ValueError(f"{name}: allowed_mask must be an int32 [{batch}, {words}] bitmask or a bool [{batch}, {vocab}] "
                         f"tensor, got {getattr(allowed_mask, 'dtype', type(allowed_mask).__name__)} "
                         f"{list(getattr(allowed_mask, 'shape', []))}")
    if isinstance(temperature, Tensor):
        if not temperature.is_floating_point() or temperature.dim() > 1 or (
                temperature.dim() == 1 and temperature.shape[0] != batch):
            raise ValueError(f"{name}: temperature must be a float, or a floating 0-d or [B] tensor with B = {batch}, "
                             f"got {temperature.dtype} with shape {list(temperature.shape)}")
        temps = temperature.to(device=device, dtype=torch.float32).expand(batch)
    else:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"{name}: temperature must be a float >= 0 or a tensor, got {temperature!r}")
        temps = torch.full((batch,), float(temperature), dtype=torch.float32, device=device)
    truncation = parse_truncation(top_k, top_p, min_p, hidden[:, 0], name)
    scalar = None if isinstance(temperature, Tensor) else float(temperature)
    return _Step(batch, n, seeds, per_row_seed, offsets, streams, temps, temps == 0, truncation, scale, softcap,
                 scalar, per_row_offset)


DRAFT_PROBS_TOLERANCE = 1e-3  # |sum of a draft distribution - 1| allowed


def check_draft_values(name: str, draft_token_ids: Tensor, draft_probs: Tensor | None, id_end: int | None) -> None:
    """Draft ids in ``[0, id_end)`` (``>= 0`` with ``id_end`` None: a shard's caller cannot know the
    vocabulary's end) and ``draft_probs`` rows that are distributions (non-negative, summing to 1
    within :data:`DRAFT_PROBS_TOLERANCE`), else a ``ValueError`` naming the argument. Reads the
    values: one host sync on CUDA; skipped while a CUDA graph is captured or torch.compile traces."""
    if torch.compiler.is_compiling() or (draft_token_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    bad_ids = (draft_token_ids < 0) if id_end is None else (draft_token_ids < 0) | (draft_token_ids >= id_end)
    bad_probs = torch.zeros_like(bad_ids)
    if draft_probs is not None:
        sums = draft_probs.sum(dim=2, dtype=torch.float64)
        bad_probs = ~((sums - 1).abs() <= DRAFT_PROBS_TOLERANCE) | (draft_probs < 0).any(dim=2)
    if bool((bad_ids | bad_probs).any()):  # one sync for both
        if bool(bad_ids.any()):
            b, j = (int(i) for i in bad_ids.nonzero()[0])
            raise ValueError(f"{name}: draft_token_ids[{b}, {j}] = {int(draft_token_ids[b, j])} is not a token id "
                             f"in [0, {'V' if id_end is None else id_end})")
        b, j = (int(i) for i in bad_probs.nonzero()[0])
        raise ValueError(f"{name}: draft_probs[{b}, {j}] is not a distribution (non-negative, summing to 1 within "
                         f"{DRAFT_PROBS_TOLERANCE}): it sums to {float(draft_probs[b, j].double().sum()):.6g}")


def target_logits(hidden: Tensor, weight: Tensor, logit_bias: Tensor | None, step: _Step) -> Tensor:
    """``x`` of the target at every position, float32 ``[B * (n + 1), V]`` (rows ``(b, j)`` in
    order): one matmul, then the rule of flashsampling_cuda/penalties.py (model-side scale and
    soft-cap, then the bias)."""
    batch, positions, dim = hidden.shape
    bias = None if logit_bias is None else logit_bias.to(hidden.device, torch.float32)
    return rule_logits(materialized_logits(hidden.reshape(batch * positions, dim), weight), bias, None, None, 0,
                       step.logit_scale, step.logit_softcap, None)


def target(hidden: Tensor, weight: Tensor, logit_bias: Tensor | None, allowed_mask: Tensor | None, step: _Step,
           survivors=survivor_mask) -> tuple[Tensor, Tensor, Tensor | None]:
    """``(x, y, allowed)`` of the target at every position, ``[B, n + 1, V]`` (``allowed``: the
    mask, an int32 bitmask or bool, and the truncation's survivors; None for all):
    ``survivors(y, allowed, truncation)`` finds the survivors of ``[B * (n + 1), V]`` rows; ``x``:
    :func:`target_logits`."""
    batch, positions, _ = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    x = target_logits(hidden, weight, logit_bias, step)
    rows_temps = step.temps[:, None].expand(batch, positions).reshape(-1)
    y = scaled_logits(x, 1.0, rows_temps)
    allowed = None
    if allowed_mask is not None:
        mask = allowed_mask.to(device)
        allowed = mask if mask.dtype == torch.bool else unpack_allowed_mask(mask, vocab)
        allowed = allowed[:, None, :].expand(batch, positions, vocab).reshape(-1, vocab)
    if step.truncation is not None:
        repeat = [(v.to(device).expand(batch)[:, None].expand(batch, positions).reshape(-1)
                   if isinstance(v, Tensor) else v) for v in step.truncation]
        allowed = survivors(y, allowed, type(step.truncation)(*repeat))
    shape = (batch, positions, vocab)
    return x.reshape(shape), y.reshape(shape), None if allowed is None else allowed.reshape(shape)


def masked_target(y: Tensor, allowed: Tensor | None) -> Tensor:
    """float64 ``y`` with ``-inf`` outside ``allowed``: the target's unnormalised log-probabilities."""
    yd = y.double()
    return yd if allowed is None else yd.masked_fill(~allowed, -torch.inf)


def draft_columns(draft_token_ids: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(local column of each draft, clamped to 0 outside; whether the draft is one of these
    ``vocab`` columns), ``[B, n]``."""
    local = draft_token_ids - vocab_start
    inside = (local >= 0) & (local < vocab)
    return torch.where(inside, local, 0), inside


def acceptance_probability(p_draft: Tensor, q_draft: Tensor, inside: Tensor) -> Tensor:
    """float64 ``[B, n]``: sampled drafts' ``min(1, p(d) / q(d))``."""
    ratio = torch.where(q_draft > 0, p_draft / q_draft, torch.inf)
    return torch.where(inside, ratio.clamp(max=1.0), 0.0)


def accepted_count(step: _Step, accept_prob: Tensor, greedy_hit: Tensor) -> Tensor:
    """int64 ``[B]``: sampled drafts' accepted prefix; ``u < accept_prob`` for sampled rows (the
    acceptance uniforms of the module docstring), ``greedy_hit`` (the draft is the argmax) for
    greedy rows."""
    return _accepted_prefix(accept_prob, greedy_hit, step.seeds, step.offsets, step.streams, step.greedy)


def _accepted_prefix(accept_prob: Tensor, greedy_hit: Tensor, seeds: Tensor, offsets: Tensor, streams: Tensor,
                     greedy: Tensor) -> Tensor:
    """:func:`accepted_count` from the step's per-row seeds, offsets, streams and greedy flags."""
    j = torch.arange(accept_prob.shape[1], device=accept_prob.device)
    u = uniform_noise(seeds[:, None], offsets[:, None], streams[:, None], j[None, :], _ACCEPT_INDEX).double()
    accepted = torch.where(greedy[:, None], greedy_hit, u < accept_prob)
    return torch.cumprod(accepted.long(), dim=1).sum(dim=1)


def position_samples(x: Tensor, allowed: Tensor | None, step: _Step, logp: Tensor | None, q: Tensor | None,
                     vocab_start: int, empty_token: int) -> tuple[Tensor, Tensor]:
    """(tokens, scores) ``[B, n + 1]`` of the sample each position would emit over these ``V``
    columns, with ``sample``'s noise at ``offset + j``: ``t_j`` of the target (one-hot drafts,
    ``q`` None; the bonus position ``j = n``; a greedy row's argmax), or with ``q [B, n, V]`` the
    residual ``max(0, exp(logp) - q)`` at ``j < n``; ``empty_token`` where nothing is kept."""
    batch, positions, vocab = x.shape
    tokens, scores = [], []
    for pos in range(positions):
        x_pos, temps_pos = x[:, pos], step.temps
        keep = (allowed[:, pos] if allowed is not None
                else torch.ones((batch, vocab), dtype=torch.bool, device=x.device))
        if pos < step.n and q is not None:
            residual = (logp[:, pos].exp() - q[:, pos].double()).clamp(min=0.0)
            x_pos = torch.where(step.greedy[:, None], x_pos, torch.log(residual).float())
            temps_pos = torch.where(step.greedy, 0.0, 1.0)
            keep = torch.where(step.greedy[:, None], keep, residual > 0)
        tokens_pos, scores_pos, _, _ = torch.ops.flashsampling.sample_from_logits(
            x_pos.contiguous(), temperature=1.0, temperatures=temps_pos, num_samples=1,
            seed=step.seeds if step.per_row_seed else step.seeds[:1].reshape(()), offset=step.offsets + pos,
            generator=None,
            logit_bias=None, allowed_mask=pack_allowed_mask(keep), empty_mask_token=empty_token,
            vocab_start=vocab_start, return_logprobs=False)
        tokens.append(tokens_pos[:, 0])
        scores.append(scores_pos[:, 0])
    return torch.stack(tokens, dim=1), torch.stack(scores, dim=1)


def packed_mask(allowed_mask: Tensor | None, device) -> Tensor | None:
    """The step's mask as an int32 ``[B, ceil(V / 32)]`` bitmask on ``device`` (None without one)."""
    if allowed_mask is None:
        return None
    mask = allowed_mask.to(device)
    return mask if mask.dtype == torch.int32 else pack_allowed_mask(mask)


def accepted_while_equal(draft_token_ids: Tensor, emitted: Tensor) -> Tensor:
    """int64 ``[B]``: one-hot drafts' accepted prefix, the positions ``j < n`` in order while
    their token ``emitted [B, n + 1]`` (-1 where the row allows nothing) is the draft."""
    matches = (emitted[:, :-1] == draft_token_ids) & (emitted[:, :-1] >= 0)  # (a draft of -1 is no token)
    return torch.cumprod(matches.long(), dim=1).sum(dim=1)


def one_hot_output(draft_token_ids: Tensor, emitted: Tensor, emitted_logp: Tensor | None) -> SpeculativeOutput:
    """One-hot drafts' step from each position's token ``t_j`` (``emitted [B, n + 1]``) and, with
    log-probabilities, ``log p_j(t_j)`` (``emitted_logp``): the accepted drafts are the ``t_j``
    before the first one that is not its draft, which is the emitted token; -1 (NaN) after."""
    tokens, num_accepted = torch.ops.flashsampling._draft_tokens(draft_token_ids.contiguous(), emitted.contiguous())
    logprobs = None
    if emitted_logp is not None:
        kept = torch.arange(emitted.shape[1], device=emitted.device)[None, :] <= num_accepted[:, None]
        logprobs = torch.where(kept, emitted_logp, torch.nan).float()
    return SpeculativeOutput(tokens, num_accepted, logprobs)


def _position_temperature_args(step: _Step, repeat: int = 1, interleave: bool = False) -> dict:
    """The op's temperature arguments for ``repeat`` copies of the batch's rows (position-major,
    or each row's copies together with ``interleave``): the call's scalar where it had one (the
    op's loop without per-row temperatures), else the rows' ``[B]`` tensor repeated."""
    if step.scalar_temperature is not None:
        return dict(temperature=step.scalar_temperature, temperatures=None)
    temps = step.temps.repeat_interleave(repeat) if interleave else step.temps.repeat(repeat)
    return dict(temperature=1.0, temperatures=temps)


def position_tokens_fused(hidden: Tensor, weight: Tensor, logit_bias: Tensor | None, allowed_mask: Tensor | None,
                          step: _Step, vocab_start: int, return_logprobs: bool) -> tuple[Tensor, Tensor | None]:
    """``(t [B, n + 1], log p_j(t_j) [B, n + 1] float32 or None)`` from one call of the fused op
    over the ``B * (n + 1)`` rows (``_sample_positions``: position ``j`` of row ``b`` is GEMM column
    ``j * B + b`` and draws sample ``j``'s noise of row ``b``, as ``sample``'s several samples do, so
    with a batch-wide seed neighbouring columns share their Philox blocks as in plain sampling),
    each with row ``b``'s temperature, bias and mask: the tokens ``sample`` would draw, the target
    logits never in memory."""
    batch, positions, dim = hidden.shape
    device = hidden.device
    base = packed_mask(allowed_mask, device)
    token, _, token_logp = torch.ops.flashsampling._sample_positions(
        hidden.transpose(0, 1).reshape(positions * batch, dim), weight, positions, **_position_temperature_args(step),
        seed=step.seeds if step.per_row_seed else step.seeds[:1].reshape(()),
        offset=step.offsets if step.per_row_offset else step.offsets[:1].reshape(()),
        logit_bias=None if logit_bias is None else logit_bias.to(device, torch.float32), allowed_mask=base,
        empty_mask_token=-1, vocab_start=vocab_start, logit_scale=step.logit_scale, logit_softcap=step.logit_softcap,
        return_logprobs=return_logprobs)
    return token, token_logp if return_logprobs else None


@torch.library.register_kernel("flashsampling::_sample_positions", "cpu")
def _sample_positions_cpu(hidden, weight, positions, *, temperature=1.0, temperatures=None, seed, offset,
                          logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0, logit_scale=1.0,
                          logit_softcap=None, return_logprobs=False):
    """``_sample_positions`` on the CPU: the ``P * B`` rows as rows of their own through
    ``sample_with_scores``, row ``j * B + b`` with row ``b``'s controls and seed, its stream
    (``b``, or 0 with a per-row seed, the op's ``streams``) and offset ``offset_b + j``."""
    _check_position_rows(hidden, positions)
    batch = hidden.shape[0] // positions
    per_row_seed = seed.dim() == 1
    j = torch.arange(positions, device=offset.device)
    streams = (torch.zeros(batch, dtype=torch.int64) if per_row_seed else torch.arange(batch)).repeat(positions)
    tokens, scores, logp, _ = torch.ops.flashsampling.sample_with_scores(
        hidden, weight, temperature=temperature, temperatures=None if temperatures is None else temperatures.repeat(
            positions), num_samples=1, seed=seed.repeat(positions) if per_row_seed else seed,
        offset=(offset.expand(batch)[None, :] + j[:, None]).reshape(-1), generator=None, logit_bias=logit_bias,
        allowed_mask=None if allowed_mask is None else allowed_mask.repeat(positions, 1),
        empty_mask_token=empty_mask_token, vocab_start=vocab_start, logit_scale=logit_scale,
        logit_softcap=logit_softcap, streams=streams, return_logprobs=return_logprobs)

    def per_row(t: Tensor) -> Tensor:  # [P * B, 1] position-major -> [B, P]
        return t[:, 0].reshape(positions, batch).T.contiguous()

    return per_row(tokens), per_row(scores), per_row(logp) if return_logprobs else logp


@torch.library.register_fake("flashsampling::_sample_positions")
def _sample_positions_fake(hidden, weight, positions, *, temperature=1.0, temperatures=None, seed, offset,
                           logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=0, logit_scale=1.0,
                           logit_softcap=None, return_logprobs=False):
    _check_position_rows(hidden, positions)
    shape = (hidden.shape[0] // positions, positions)
    return (hidden.new_empty(shape, dtype=torch.int64), hidden.new_empty(shape, dtype=torch.float32),
            hidden.new_empty(shape if return_logprobs else (0,), dtype=torch.float32))


def _check_position_rows(hidden: Tensor, positions: int) -> None:
    """checks.cpp's check_position_rows (RuntimeError)."""
    torch._check(positions >= 1 and hidden.dim() == 2 and hidden.shape[0] % positions == 0,
                 lambda: f"flashsampling._sample_positions: hidden must be [positions * B, D] with positions >= 1, "
                         f"got positions={positions} and hidden of shape {list(hidden.shape)}")


def _repeated_truncation(truncation: Truncation, batch: int, positions: int, device) -> Truncation:
    """``truncation`` for the ``positions * B`` rows ``j * B + b`` (row ``b``'s values)."""
    def repeat(value):
        return value.to(device).expand(batch).repeat(positions) if isinstance(value, Tensor) else value
    return Truncation(repeat(truncation.top_k), repeat(truncation.top_p), repeat(truncation.min_p))


def _position_noise_args(step: _Step, positions: int, device) -> dict:
    """The noise arguments of the ``positions * B`` rows ``j * B + b`` in one call: row ``b``'s
    seed and offset ``offset_b + j`` and, with a batch-wide seed, row ``b``'s stream, so each row
    draws the noise ``sample`` draws for row ``b`` at ``offset + j``."""
    batch = step.batch
    j = torch.arange(positions, device=device)
    offsets = (step.offsets.expand(batch)[None, :] + j[:, None]).reshape(-1)
    if step.per_row_seed:
        return dict(seed=step.seeds.repeat(positions), offset=offsets, streams=None)
    return dict(seed=step.seeds[:1].reshape(()), offset=offsets,
                streams=torch.arange(batch, device=device).repeat(positions))


def fused_top_k_takes_positions(hidden: Tensor, weight: Tensor, step: _Step) -> bool:
    """Whether :func:`position_tokens_truncated_fused` takes this step: the fused top-k pass takes
    its ``B * (n + 1)`` rows as ``sample`` takes a batch of them with these seeds and offsets
    ("auto": docs/truncation.md; per-row offsets keep a host top_k above 1024 on the logits path),
    without the model-side transforms (which that pass does not apply)."""
    if step.truncation is None or step.logit_scale != 1.0 or step.logit_softcap is not None:
        return False
    batch, positions, dim = hidden.shape
    rows = hidden.reshape(batch * positions, dim)  # (its shape, dtype and device)
    # The rule reads the forms of the call's arguments, not their values: the step's truncation
    # (host scalars or tensors, as _repeated_truncation keeps them), a 0-d seed or per-row seeds,
    # and per-row offsets (_position_noise_args), without building those [P * B] tensors twice.
    op_kwargs = {"sparse_bias_ids": None, "num_samples": 1, "offset": step.offsets,
                 "seed": step.seeds if step.per_row_seed else step.seeds[:1].reshape(())}
    return (fused_top_k_takes(step.truncation, rows, weight, op_kwargs)
            and fused_pass_preferred(step.truncation, rows, weight, op_kwargs))


def position_tokens_truncated_fused(hidden: Tensor, weight: Tensor, logit_bias: Tensor | None,
                                    allowed_mask: Tensor | None, step: _Step, vocab_start: int,
                                    return_logprobs: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`position_tokens_from_logits`'s tokens (and log-probabilities) from one call of the
    fused top-k pass (``sample_top_k``) over the ``B * (n + 1)`` rows, row ``j * B + b`` being
    position ``j`` of row ``b`` with row ``b``'s controls and truncation and the noise of
    :func:`_position_noise_args`. The target logits are never in memory but for the rows stage 2
    leaves (docs/truncation.md)."""
    batch, positions, dim = hidden.shape
    device = hidden.device
    rows = hidden.transpose(0, 1).reshape(positions * batch, dim)
    base = packed_mask(allowed_mask, device)
    token, _, token_logp, _ = torch.ops.flashsampling.sample_top_k(
        rows, weight, **_position_temperature_args(step, positions), num_samples=1,
        **_position_noise_args(step, positions, device), generator=None,
        logit_bias=None if logit_bias is None else logit_bias.to(device, torch.float32),
        allowed_mask=None if base is None else base.repeat(positions, 1), empty_mask_token=-1,
        vocab_start=vocab_start, return_logprobs=return_logprobs,
        **fused_top_k_args(_repeated_truncation(step.truncation, batch, positions, device), rows, weight))

    def per_row(t: Tensor) -> Tensor:  # [P * B, 1] position-major -> [B, P]
        return t[:, 0].reshape(positions, batch).T.contiguous()

    return per_row(token), per_row(token_logp) if return_logprobs else None


def position_tokens_from_logits(hidden: Tensor, weight: Tensor, logit_bias: Tensor | None,
                                allowed_mask: Tensor | None, step: _Step, vocab_start: int,
                                return_logprobs: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`position_tokens_fused`'s tokens (and log-probabilities, of the truncated target)
    with the step's truncation: the target logits once (:func:`target_logits`), then
    ``sample_from_logits`` per position (one call for every position with per-row seeds, row
    ``(b, j)`` at ``b * (n + 1) + j``), which truncates top_k first."""
    batch, positions, _ = hidden.shape
    vocab, device = weight.shape[0], hidden.device
    x = target_logits(hidden, weight, logit_bias, step).reshape(batch, positions, vocab)
    base = packed_mask(allowed_mask, device)
    truncation = logits_truncation_args(step.truncation, batch, device)
    if step.per_row_seed:
        # Per-row seeds draw stream 0 whatever the row: every position of every row in one call.
        j = torch.arange(positions, device=device)
        per_row = {name: value.repeat_interleave(positions) if isinstance(value, Tensor) else value
                   for name, value in truncation.items()}
        token, _, token_logp, _ = torch.ops.flashsampling.sample_from_logits(
            x.reshape(batch * positions, vocab), **_position_temperature_args(step, positions, interleave=True),
            num_samples=1, seed=step.seeds.repeat_interleave(positions), offset=(step.offsets[:, None] + j).reshape(-1),
            generator=None, logit_bias=None,
            allowed_mask=None if base is None else base.repeat_interleave(positions, dim=0), empty_mask_token=-1,
            vocab_start=vocab_start, return_logprobs=return_logprobs, **per_row)
        emitted = token.reshape(batch, positions)
        return emitted, token_logp.reshape(batch, positions) if return_logprobs else None
    # A batch-wide seed draws stream b for row b: a call a position, rows b in order.
    tokens, logps = [], []
    for j in range(positions):
        token, _, token_logp, _ = torch.ops.flashsampling.sample_from_logits(
            x[:, j], **_position_temperature_args(step), num_samples=1, seed=step.seeds[:1].reshape(()),
            offset=step.offsets + j, generator=None, logit_bias=None, allowed_mask=base, empty_mask_token=-1,
            vocab_start=vocab_start, return_logprobs=return_logprobs, **truncation)
        tokens.append(token[:, 0])
        logps.append(token_logp[:, 0] if return_logprobs else None)
    emitted = torch.stack(tokens, dim=1)
    return emitted, torch.stack(logps, dim=1) if return_logprobs else None


def verify_one_hot(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, logit_bias: Tensor | None,
                   allowed_mask: Tensor | None, step: _Step, vocab_start: int,
                   return_logprobs: bool) -> SpeculativeOutput:
    """:func:`speculative_sample` for one-hot drafts: each position's token ``t_j``, then the
    prefix where it is the draft (module docstring). Without truncation, bf16 / fp16 on CUDA and
    anything on the CPU take :func:`position_tokens_fused` (on CUDA up to ``MAX_FUSED_POSITIONS``
    positions); with truncation, what the fused top-k pass takes (:func:`fused_top_k_takes_positions`)
    :func:`position_tokens_truncated_fused`; the rest :func:`position_tokens_from_logits`."""
    fused = step.truncation is None and (not hidden.is_cuda or (hidden.dtype in (torch.bfloat16, torch.float16)
                                                                 and hidden.shape[1] <= MAX_FUSED_POSITIONS))
    if fused:
        tokens_of = position_tokens_fused
    elif fused_top_k_takes_positions(hidden, weight, step):
        tokens_of = position_tokens_truncated_fused
    else:
        tokens_of = position_tokens_from_logits
    emitted, logp = tokens_of(hidden, weight, logit_bias, allowed_mask, step, vocab_start, return_logprobs)
    return one_hot_output(draft_token_ids, emitted, logp)


def empty_output(hidden: Tensor, n: int, return_logprobs: bool) -> SpeculativeOutput:
    """The output of a batch of no rows."""
    tokens = torch.empty((0, n + 1), dtype=torch.int64, device=hidden.device)
    logprobs = torch.empty((0, n + 1), dtype=torch.float32, device=hidden.device) if return_logprobs else None
    return SpeculativeOutput(tokens, tokens.new_empty(0), logprobs)


def accepted_then_emitted(drafted: Tensor, final: Tensor, num_accepted: Tensor, after) -> Tensor:
    """``[B, n + 1]``: ``drafted [B, n]`` before each row's ``num_accepted``, ``final [B, 1]`` at
    it, ``after`` past it (a step's tokens or their log-probabilities)."""
    slot = torch.arange(drafted.shape[1] + 1, device=drafted.device)[None, :]
    padded = torch.cat([drafted, drafted.new_full((drafted.shape[0], 1), after)], dim=1)
    return torch.where(slot < num_accepted[:, None], padded, torch.where(slot == num_accepted[:, None], final, after))


def step_output(draft_token_ids: Tensor, emitted: Tensor, num_accepted: Tensor, draft_logp: Tensor | None,
                emitted_logp: Tensor | None) -> SpeculativeOutput:
    """The accepted drafts, then the emitted token (``emitted [B, 1]``, or ``[B, n + 1]`` read at
    ``num_accepted``), -1 after; with ``draft_logp [B, n]`` / ``emitted_logp [B, n + 1]``
    (float64, NaN where the token is none) their log-probabilities."""
    tokens, _ = torch.ops.flashsampling._draft_tokens(draft_token_ids.contiguous(), emitted.contiguous(),
                                                      num_accepted)
    logprobs = None
    if draft_logp is not None:
        final_logp = emitted_logp.gather(1, num_accepted[:, None])
        logprobs = accepted_then_emitted(draft_logp, final_logp, num_accepted, torch.nan).float()
    return SpeculativeOutput(tokens, num_accepted, logprobs)


def values_at(table: Tensor, local: Tensor) -> Tensor:
    """``table [B, P, V]`` at the columns ``local [B, P]``, NaN where ``local`` is not a column."""
    valid = (local >= 0) & (local < table.shape[2])
    return torch.where(valid, table.gather(2, torch.where(valid, local, 0)[:, :, None])[:, :, 0], torch.nan)


def speculative_sample(
    hidden: Tensor,
    weight: Tensor,
    draft_token_ids: Tensor,
    draft_probs: Tensor | None = None,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    logit_bias: Tensor | None = None,
    allowed_mask: Tensor | None = None,
    return_logprobs: bool = False,
    vocab_start: int = 0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
) -> SpeculativeOutput:
    """Verifies ``n`` draft tokens per row against the target (module docstring) and emits the
    accepted prefix plus one corrective or bonus token.

    Args:
        hidden: ``[B, n + 1, D]`` bf16 / fp16 / fp32: the target's hidden states at the ``n``
            draft positions and the bonus position.
        weight: ``[V, D]``, the LM head.
        draft_token_ids: ``[B, n]`` int64 global ids (``vocab_start`` the id of column 0).
        draft_probs: ``[B, n, V]`` floating (the draft's probabilities of every token at each
            position), or None for one-hot drafts.
        temperature, generator, seed, offset, logit_bias, allowed_mask, vocab_start, top_k, top_p,
        min_p, logit_scale, logit_softcap: as in :func:`flashsampling_cuda.sample` (per row where
            ``[B]``; ``offset`` None is 0); the mask is per row (``[B, ceil(V / 32)]``) and applies
            at every position; the model-side scale and soft-cap act on the raw logits first.
        return_logprobs: also each emitted token's log-probability under the target.

    Returns:
        :class:`SpeculativeOutput` ``(tokens [B, n + 1] int64, num_accepted [B] int64,
        logprobs [B, n + 1] float32 or None)``.
    """
    if seed is not None and generator is not None:
        raise ValueError("flashsampling.speculative_sample: pass either seed or generator, not both")
    step = parse_step("flashsampling.speculative_sample", hidden, weight, draft_token_ids, draft_probs, temperature,
                      seed, offset, top_k, top_p, min_p, lambda: draw_seed(generator, hidden.device), logit_scale,
                      logit_softcap, logit_bias, allowed_mask)
    n = step.n
    if step.batch == 0:
        return empty_output(hidden, n, return_logprobs)
    check_draft_values("flashsampling.speculative_sample", draft_token_ids, draft_probs, vocab_start + weight.shape[0])
    if draft_probs is None:
        return verify_one_hot(hidden, weight, draft_token_ids, logit_bias, allowed_mask, step, vocab_start,
                              return_logprobs)
    return verify(hidden, weight, draft_token_ids, draft_probs, logit_bias, allowed_mask, step, vocab_start,
                  return_logprobs)


def verify(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, draft_probs: Tensor, logit_bias: Tensor | None,
           allowed_mask: Tensor | None, step: _Step, vocab_start: int, return_logprobs: bool) -> SpeculativeOutput:
    """:func:`speculative_sample` for sampled drafts from the fp32 logits computed once (cuBLAS on
    CUDA): each draft position's log-sum-exp, argmax and draft value in one pass
    (``_draft_position_stats``), the acceptance walk, then one sample a row at the position where
    it stops (``j* = num_accepted``) from the logits ``_stop_row_logits`` forms there: the
    residual ``max(0, p - q)`` after a rejection, the target at the bonus position, the argmax on
    greedy rows."""
    batch, positions, vocab = hidden.shape[0], hidden.shape[1], weight.shape[0]
    n, device = step.n, hidden.device
    if allowed_mask is None and step.truncation is None:
        x, allowed = target_logits(hidden, weight, logit_bias, step).reshape(batch, positions, vocab), None
    else:
        x, _, allowed = target(hidden, weight, logit_bias, allowed_mask, step)
        allowed = allowed.contiguous()
    # y = fl32(x * scale_b); one fill for a temperature given as a number
    scalar = step.scalar_temperature
    scales = (temperature_scales(step.batch, 0.0, step.temps, device) if scalar is None
              else temperature_scales(step.batch, scalar, None, device))
    # local columns; the kernels take a column outside [0, V) for none (a draft another shard holds)
    columns = (draft_token_ids if vocab_start == 0 else draft_token_ids - vocab_start).contiguous()
    # with log-probabilities the bonus position's log-sum-exp too
    stats_columns = torch.cat([columns, columns.new_full((batch, 1), -1)], dim=1) if return_logprobs else columns
    lse, argmax, y_draft = torch.ops.flashsampling._draft_position_stats(x, scales, stats_columns, allowed)

    # Acceptance of each draft, u < min(1, p(d) / q(d)) (a greedy row: while the draft is the
    # argmax), and where each row stops (j* = num_accepted): its sample's temperature and offset.
    q = draft_probs.to(device=device, dtype=torch.float32).contiguous()
    num_accepted, residual_row, sample_temps, sample_offsets = torch.ops.flashsampling._accept_drafts(
        lse, argmax, y_draft, columns, q, step.seeds, step.offsets, step.streams, step.temps)

    # The emitted token: a row of logits per batch row at j*, -inf for what it excludes.
    lse_n = lse[:, :n].contiguous()
    logits = torch.ops.flashsampling._stop_row_logits(x, q, num_accepted, scales, lse_n, residual_row, allowed)
    token, score, _, _ = torch.ops.flashsampling.sample_from_logits(
        logits, temperature=1.0, temperatures=sample_temps, num_samples=1,
        seed=step.seeds if step.per_row_seed else step.seeds[:1].reshape(()), offset=sample_offsets,
        generator=None, logit_bias=None, allowed_mask=None, empty_mask_token=None, vocab_start=vocab_start,
        return_logprobs=False)
    token = torch.where(score > -torch.inf, token, -1)  # [B, 1]; a row whose logits are all -inf: nothing allowed
    if not return_logprobs:
        return step_output(draft_token_ids, token, num_accepted, None, None)
    rows = torch.arange(batch, device=device)
    local = token[:, 0] - vocab_start
    found = (local >= 0) & (local < vocab)
    stop = num_accepted  # j* <= n
    at = (rows * positions + stop) * vocab + torch.where(found, local, 0)
    y_token = x.reshape(-1)[at] * scales
    emitted_logp = torch.where(found, y_token - lse[rows, stop], torch.nan).double()
    _, inside = draft_columns(draft_token_ids, vocab_start, vocab)
    draft_logp = torch.where(inside, y_draft[:, :n] - lse_n, torch.nan).double()
    return step_output(draft_token_ids, token, num_accepted, draft_logp, emitted_logp[:, None].expand(batch, positions))


def _scaled_positions(logits: Tensor, scales: Tensor, allowed: Tensor | None) -> Tensor:
    """``y = fl(x * scale_b)`` of logits ``[B, J, V]``, -inf outside ``allowed``."""
    y = logits * scales[:, None, None]
    return y if allowed is None else y.masked_fill(~allowed, -torch.inf)


@torch.library.register_kernel("flashsampling::_draft_position_stats", "cpu")
def _draft_position_stats_cpu(logits, scales, draft_columns, allowed=None):
    """``_draft_position_stats`` in torch ops (the CPU's; the CUDA kernel's reference)."""
    width = draft_columns.shape[1]
    y = _scaled_positions(logits[:, :width], scales, None if allowed is None else allowed[:, :width])
    valid = (draft_columns >= 0) & (draft_columns < logits.shape[2])
    y_draft = y.gather(2, torch.where(valid, draft_columns, 0)[:, :, None])[:, :, 0]
    return torch.logsumexp(y, dim=2), y.max(dim=2).indices, torch.where(valid, y_draft, -torch.inf)


@torch.library.register_kernel("flashsampling::_stop_row_logits", "cpu")
def _stop_row_logits_cpu(logits, draft_probs, stop, scales, lse, residual, allowed=None):
    """``_stop_row_logits`` in torch ops (the CPU's; the CUDA kernel's reference)."""
    batch, n = logits.shape[0], draft_probs.shape[1]
    rows = torch.arange(batch, device=logits.device)
    stop = stop.clamp(0, logits.shape[1] - 1)
    x = logits[rows, stop]
    y = _scaled_positions(x[:, None], scales, None if allowed is None else allowed[rows, stop][:, None])[:, 0]
    target_row = torch.where(y > -torch.inf, x, -torch.inf)
    if n == 0:
        return target_row
    at = stop.clamp(max=n - 1)
    mass = (torch.exp(y - lse[rows, at][:, None]) - draft_probs[rows, at]).nan_to_num(nan=0.0).clamp(min=0.0)
    has_mass = (mass > 0).any(dim=1)  # a residual without mass: the target's sample instead
    return torch.where((residual & (stop < n) & has_mass)[:, None], torch.log(mass), target_row)


@torch.library.register_kernel("flashsampling::_accept_drafts", "cpu")
def _accept_drafts_cpu(lse, argmax, y_draft, columns, draft_probs, seeds, offsets, streams, temps):
    """``_accept_drafts`` in torch ops (the CPU's; the CUDA kernel's reference); ``columns`` is the
    schema's ``draft_columns``."""
    if draft_probs.dim() != 3 or lse.dim() != 2 or lse.shape[1] < draft_probs.shape[1] or tuple(
            columns.shape) != tuple(draft_probs.shape[:2]):
        raise RuntimeError(f"flashsampling._accept_drafts: draft_probs must be [B, n, V], draft_columns [B, n] and "
                           f"the stats [B, J >= n], got {list(draft_probs.shape)}, {list(columns.shape)}, "
                           f"{list(lse.shape)}")
    n, vocab = draft_probs.shape[1], draft_probs.shape[2]
    safe, inside = draft_columns(columns, 0, vocab)
    y_n = y_draft[:, :n]
    p_draft = torch.where(inside, (y_n - lse[:, :n]).double().exp(), 0.0)
    q_draft = draft_probs.gather(2, safe[:, :, None])[:, :, 0].double()
    greedy = temps == 0
    num_accepted = _accepted_prefix(acceptance_probability(p_draft, q_draft, inside),
                                    (safe == argmax[:, :n]) & inside & (y_n > -torch.inf), seeds, offsets, streams,
                                    greedy)
    residual = (num_accepted < n) & ~greedy
    return num_accepted, residual, torch.where(residual, 1.0, temps), offsets + num_accepted


@torch.library.register_kernel("flashsampling::_draft_tokens", "cpu")
def _draft_tokens_cpu(draft_token_ids, emitted, num_accepted=None):
    """``_draft_tokens`` in torch ops (the CPU's; the CUDA kernel's reference)."""
    batch, n = draft_token_ids.shape
    if emitted.dim() != 2 or emitted.shape[0] != batch or not (
            emitted.shape[1] == n + 1 or (num_accepted is not None and emitted.shape[1] == 1)):
        raise RuntimeError(f"flashsampling._draft_tokens: emitted must be [B, n + 1], or [B, 1] with num_accepted, "
                           f"got {list(emitted.shape)}")
    if num_accepted is None:
        num_accepted = accepted_while_equal(draft_token_ids, emitted)
    else:
        num_accepted = num_accepted.clamp(0, n)  # (callers give [0, n]; the CUDA kernel clamps alike)
    final = emitted[:, :1] if emitted.shape[1] == 1 else emitted.gather(1, num_accepted[:, None])
    return accepted_then_emitted(draft_token_ids, final, num_accepted, -1), num_accepted.clone()


@torch.library.register_fake("flashsampling::_accept_drafts")
def _accept_drafts_fake(lse, argmax, y_draft, draft_columns, draft_probs, seeds, offsets, streams, temps):
    batch = draft_probs.shape[0]
    return (seeds.new_empty((batch,)), seeds.new_empty((batch,), dtype=torch.bool), temps.new_empty((batch,)),
            seeds.new_empty((batch,)))


@torch.library.register_fake("flashsampling::_draft_tokens")
def _draft_tokens_fake(draft_token_ids, emitted, num_accepted=None):
    batch, n = draft_token_ids.shape
    return draft_token_ids.new_empty((batch, n + 1)), draft_token_ids.new_empty((batch,))


@torch.library.register_fake("flashsampling::_draft_position_stats")
def _draft_position_stats_fake(logits, scales, draft_columns, allowed=None):
    return (logits.new_empty(draft_columns.shape), draft_columns.new_empty(draft_columns.shape),
            logits.new_empty(draft_columns.shape))


@torch.library.register_fake("flashsampling::_stop_row_logits")
def _stop_row_logits_fake(logits, draft_probs, stop, scales, lse, residual, allowed=None):
    return logits.new_empty((logits.shape[0], logits.shape[2]))
