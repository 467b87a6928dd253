"""Speculative-decoding verification: exact rejection sampling of draft tokens against the
target model's distribution (Leviathan et al. 2023; Chen et al. 2023), with the noise of
:func:`flashsampling_cuda.sample`.

Per row ``b``, positions ``j = 0 .. n - 1`` in order, ``p_j`` the target's distribution at
position ``j`` (the logits ``hidden[b, j] . weight``, then the biases, mask, temperature and
truncation of ``sample``), ``d_j`` the draft token:

- one-hot drafts (``draft_probs=None``: greedy EAGLE / MTP drafts, n-grams): accept ``d_j`` when
  ``u_j < p_j(d_j)``; on rejection emit a sample of ``p_j`` without ``d_j`` (renormalised) and stop;
- sampled drafts (``draft_probs [B, n, V]``, the draft model's ``q``): accept when
  ``u_j < min(1, p_j(d_j) / q_j(d_j))``; on rejection emit a sample of ``max(0, p_j - q_j)``
  (renormalised) and stop;
- a greedy row (``T = 0``): accept while ``d_j`` is the argmax of ``p_j``; on rejection emit the
  argmax;
- all ``n`` accepted: emit the bonus token, a sample of ``p_n``.

The output follows the target's distribution exactly (up to the uniforms' 2^-23 grid). Noise
(documented counters, so ``(seed, offset)`` reproduces a step): the acceptance uniform of
``(b, j)`` is :func:`flashsampling_cuda.noise.uniform_noise` at ``(seed, offset, stream_b, j,
2^32 - 1)``; the sample emitted at position ``j`` is Gumbel-Max with the noise of ``sample`` at
offset ``offset + j`` (stream ``b``, or 0 with per-row seeds): the bonus token is the token
``sample(hidden[:, n], weight, offset=offset + n)`` returns. The residual samples use
``log max(0, p - q)`` as their logits.

Routes, all without a host sync (CUDA-graph capture, ``torch.compile(fullgraph=True)``):

- one-hot drafts without truncation on CUDA (:func:`verify_one_hot_fused`): one call of the fused
  op over the ``B * (n + 1)`` rows, the target logits never in memory. Row ``(b, j)`` is a row of
  its own with row ``b``'s seed and stream (the op's ``streams``) at offset ``offset + j``, so it
  draws exactly the noise above; its mask drops the draft on sampled rows, so its token is the
  corrective sample and its log-sum-exp, with the draft's term added back, gives ``p_j(d_j)``;
  the draft's logit is a dot product of its own (fp32, the same value as the GEMM's up to the
  order of the summation);
- one-hot drafts without truncation on the CPU (:func:`verify_one_hot`): the same with the target
  logits computed once (``[B * (n + 1), V]`` fp32, the op's own bits) and the ``sample_from_logits``
  op per position;
- sampled drafts and truncation (:func:`verify`): the float64 log-probabilities of every position
  from the logits computed once (cuBLAS on CUDA), then each position's sample.

The helpers below are shared with the tensor-parallel verification,
:func:`flashsampling_cuda.distributed.speculative_sample`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .masks import int32_words, pack_allowed_mask, unpack_allowed_mask
from .noise import as_int64_tensor, draw_seed, uniform_noise
from .penalties import rule_logits
from .sampling import _model_transform_args
from .truncation import Truncation, materialized_logits, parse_truncation, scaled_logits, survivor_mask

__all__ = ["speculative_sample", "SpeculativeOutput"]

_ACCEPT_INDEX = 2**32 - 1  # the acceptance uniforms' vocabulary index: no token has it
FUSED_MAX_POSITIONS = 64  # n + 1 the fused route takes (kSpeculativeMaxPositions, flashsampling/speculative_launch.h)


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
    offsets, _ = _per_row_int64(name, "offset", 0 if offset is None else offset, batch, device)
    scale, softcap = _model_transform_args(logit_scale, logit_softcap)
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
    truncation = parse_truncation(top_k, top_p, min_p, hidden[:, 0])
    return _Step(batch, n, seeds, per_row_seed, offsets, streams, temps, temps == 0, truncation, scale, softcap)


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


def acceptance_probability(p_draft: Tensor, q_draft: Tensor | None, inside: Tensor) -> Tensor:
    """float64 ``[B, n]``: ``p(d)`` for one-hot drafts, ``min(1, p(d) / q(d))`` for sampled ones."""
    if q_draft is None:
        return p_draft
    ratio = torch.where(q_draft > 0, p_draft / q_draft, torch.inf)
    return torch.where(inside, ratio.clamp(max=1.0), 0.0)


def accepted_count(step: _Step, accept_prob: Tensor, greedy_hit: Tensor) -> Tensor:
    """int64 ``[B]``: the accepted prefix's length; ``u < accept_prob`` for sampled rows (the
    acceptance uniforms of the module docstring), ``greedy_hit`` (the draft is the argmax) for
    greedy rows."""
    j = torch.arange(step.n, device=accept_prob.device)
    u = uniform_noise(step.seeds[:, None], step.offsets[:, None], step.streams[:, None], j[None, :],
                      _ACCEPT_INDEX).double()
    accepted = torch.where(step.greedy[:, None], greedy_hit, u < accept_prob)
    return torch.cumprod(accepted.long(), dim=1).sum(dim=1)


def position_samples(x: Tensor, allowed: Tensor | None, step: _Step, safe: Tensor, inside: Tensor,
                     logp: Tensor | None, q: Tensor | None, vocab_start: int,
                     empty_token: int) -> tuple[Tensor, Tensor]:
    """(tokens, scores) ``[B, n + 1]`` of the sample each position would emit over these ``V``
    columns: corrective (``j < n``: the target without the draft where ``inside``, or with
    ``q [B, n, V]`` the residual ``max(0, exp(logp) - q)``; a greedy row's argmax) or bonus
    (``j = n``), with ``sample``'s noise at ``offset + j``; ``empty_token`` where nothing is kept."""
    batch, positions, vocab = x.shape
    tokens, scores = [], []
    for pos in range(positions):
        x_pos, temps_pos = x[:, pos], step.temps
        keep = (allowed[:, pos] if allowed is not None
                else torch.ones((batch, vocab), dtype=torch.bool, device=x.device))
        if pos < step.n:
            if q is None:
                drop = torch.zeros_like(keep).scatter_(1, safe[:, pos : pos + 1], inside[:, pos : pos + 1])
                keep = torch.where(step.greedy[:, None], keep, keep & ~drop)
            else:
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


def draft_words(base: Tensor, safe: Tensor, inside: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Each draft's place in the bitmask ``base``: (its word's index, that word, its bit as an
    int32 word, whether the mask allows it), all ``[B, n]``."""
    word = safe >> 5
    words = base.gather(1, word)
    bits = int32_words(torch.ones_like(safe) << (safe % 32))
    return word, words, bits, inside & ((words & bits) != 0)


def y_scales(step: _Step) -> Tensor:
    """float32 ``[B]``: ``y = x * scale``, ``fl32(1 / T)`` on sampled rows and 1 on greedy ones."""
    return torch.where(step.greedy, 1.0, torch.ones_like(step.temps) / step.temps)


def one_hot_acceptance(step: _Step, draft_token_ids: Tensor, emitted: Tensor, lse: Tensor, y_draft: Tensor,
                       draft_allowed: Tensor, cleared: Tensor, inside: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One-hot drafts' acceptance from each position's sample ``emitted [B, n + 1]`` and
    log-sum-exp ``lse`` (float64 ``[B, n + 1]``, over the tokens the sample saw: without the draft
    where ``cleared``) and the draft's ``y_draft`` (float64 ``[B, n]``): ``(num_accepted [B],
    log p_j(d_j) [B, n] (-inf where the draft is not allowed), the whole distribution's
    log-sum-exp [B, n + 1])``. A greedy row accepts while the draft is its sample (the argmax)."""
    n = step.n
    lse_draft = lse[:, :n]
    lse_full_draft = torch.where(cleared, torch.logaddexp(lse_draft, y_draft), lse_draft)  # the draft's term back
    logp_draft = torch.where(draft_allowed, y_draft - lse_full_draft, -torch.inf)
    greedy_hit = (emitted[:, :n] == draft_token_ids) & inside
    num_accepted = accepted_count(step, acceptance_probability(logp_draft.exp(), None, inside), greedy_hit)
    return num_accepted, logp_draft, torch.cat([lse_full_draft, lse[:, n:]], dim=1)


def verify_one_hot(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, logit_bias: Tensor | None,
                   allowed_mask: Tensor | None, step: _Step, vocab_start: int,
                   return_logprobs: bool) -> SpeculativeOutput:
    """:func:`speculative_sample` for one-hot drafts without truncation, the same tokens with
    less work: ``sample_from_logits`` on each position's logits (views of the one
    ``[B * (n + 1), V]`` matmul) with the draft's bit cleared from the mask on sampled rows, one
    call a position (one call for all of them with per-row seeds). Its token is the corrective
    sample (the bonus token at ``j = n``, the argmax on greedy rows), and its log-sum-exp over the
    tokens other than the draft, with the draft's term added back, gives ``p_j(d_j)``: no float64
    ``[B, n + 1, V]`` log-softmax and no bool masks."""
    batch, positions, _ = hidden.shape
    n, vocab, device = step.n, weight.shape[0], hidden.device
    x = target_logits(hidden, weight, logit_bias, step).reshape(batch, positions, vocab)
    base = packed_mask(allowed_mask, device)
    if base is None:
        base = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    safe, inside = draft_columns(draft_token_ids, vocab_start, vocab)
    word, words, bits, draft_allowed = draft_words(base, safe, inside)
    cleared = draft_allowed & ~step.greedy[:, None]  # the drafts taken out of their position's sample
    inv_temperature = y_scales(step)
    y_draft = x[:, :n].gather(2, safe[:, :, None])[:, :, 0] * inv_temperature[:, None]
    # Each position's mask: the row's, less the draft's bit on sampled rows.
    masks = base[:, None, :].repeat(1, positions, 1)  # [B, n + 1, words]
    masks[:, :n].scatter_(2, word[:, :, None], torch.where(cleared, words & ~bits, words)[:, :, None])
    if step.per_row_seed:
        # Per-row seeds draw stream 0 whatever the row: every position of every row in one call,
        # row (b, j) with seed_b and offset_b + j.
        j = torch.arange(positions, device=device)
        token, _, _, lse = torch.ops.flashsampling.sample_from_logits(
            x.reshape(batch * positions, vocab), temperature=1.0,
            temperatures=step.temps.repeat_interleave(positions), num_samples=1,
            seed=step.seeds.repeat_interleave(positions), offset=(step.offsets[:, None] + j).reshape(-1),
            generator=None, logit_bias=None, allowed_mask=masks.reshape(batch * positions, -1), empty_mask_token=-1,
            vocab_start=vocab_start, return_logprobs=True)
        emitted, lse = token.reshape(batch, positions), lse.reshape(batch, positions).double()
    else:
        # A batch-wide seed draws stream b for row b: a call a position, rows b in order.
        tokens, lses = [], []
        for j in range(positions):
            token, _, _, lse = torch.ops.flashsampling.sample_from_logits(
                x[:, j], temperature=1.0, temperatures=step.temps, num_samples=1, seed=step.seeds[:1].reshape(()),
                offset=step.offsets + j, generator=None, logit_bias=None, allowed_mask=masks[:, j],
                empty_mask_token=-1, vocab_start=vocab_start, return_logprobs=True)
            tokens.append(token[:, 0])
            lses.append(lse)
        emitted, lse = torch.stack(tokens, dim=1), torch.stack(lses, dim=1).double()  # [B, n + 1]
    num_accepted, logp_draft, lse_full = one_hot_acceptance(step, draft_token_ids, emitted, lse, y_draft.double(),
                                                            draft_allowed, cleared, inside)
    if not return_logprobs:
        return step_output(draft_token_ids, emitted, num_accepted, None, None)
    y_emitted = values_at(x, emitted - vocab_start) * inv_temperature[:, None]
    return step_output(draft_token_ids, emitted, num_accepted, torch.where(inside, logp_draft, torch.nan),
                       y_emitted.double() - lse_full)


def verify_one_hot_fused(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, logit_bias: Tensor | None,
                         allowed_mask: Tensor | None, step: _Step, vocab_start: int, return_logprobs: bool,
                         kernels: bool | None = None) -> SpeculativeOutput:
    """:func:`verify_one_hot`'s step from one call of the fused op (``sample_with_scores``) over
    the ``B * (n + 1)`` rows in position-major order (row ``j * B + b``: a batch-wide seed's
    neighbouring rows then share their Philox blocks as in plain sampling), each with row ``b``'s
    seed, stream and temperature at offset ``offset_b + j`` and row ``b``'s mask less the draft's
    bit on sampled rows; the draft's logit ``x_j(d_j)`` from an fp32 dot product (then the
    model-side transforms and the bias, as the op applies them). Before and after the op,
    ``kernels`` (default: on CUDA) runs the two small kernels of ``_speculative_rows`` /
    ``_speculative_finish``, else the same steps in torch ops (:func:`_rows`,
    :func:`_finish_step`; the CPU's, and the kernels' reference in the tests)."""
    batch, positions, dim = hidden.shape
    vocab, device = weight.shape[0], hidden.device
    kernels = hidden.is_cuda if kernels is None else kernels
    base = packed_mask(allowed_mask, device)
    bias = None if logit_bias is None else logit_bias.to(device, torch.float32)
    rows_of = torch.ops.flashsampling._speculative_rows if kernels else _rows
    masks, temps, seeds, offsets, streams = rows_of(draft_token_ids, step.temps, step.seeds, step.offsets,
                                                    step.streams, base, vocab, vocab_start)
    token, _, token_logp, lse = torch.ops.flashsampling.sample_with_scores(
        hidden.transpose(0, 1).reshape(positions * batch, dim), weight, temperature=1.0, temperatures=temps,
        num_samples=1, seed=seeds if step.per_row_seed else step.seeds[:1].reshape(()), offset=offsets,
        generator=None, logit_bias=bias, allowed_mask=masks, empty_mask_token=-1, vocab_start=vocab_start,
        logit_scale=step.logit_scale, logit_softcap=step.logit_softcap, streams=streams, return_logprobs=True)
    if kernels:
        tokens, num_accepted, logprobs = torch.ops.flashsampling._speculative_finish(
            hidden, weight, draft_token_ids, token[:, 0], lse, token_logp[:, 0] if return_logprobs else None,
            step.temps, step.seeds, step.offsets, step.streams, base, bias, step.logit_scale, step.logit_softcap,
            vocab_start)
        return SpeculativeOutput(tokens, num_accepted, logprobs if return_logprobs else None)
    return _finish_step(hidden, weight, draft_token_ids, token[:, 0], lse, token_logp[:, 0], base, bias, step,
                        vocab_start, return_logprobs)


def _rows(draft_token_ids: Tensor, temps: Tensor, seeds: Tensor, offsets: Tensor, streams: Tensor,
          base: Tensor | None, vocab: int, vocab_start: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``_speculative_rows`` in torch ops: the ``(n + 1) * B`` position-major rows' masks (int32
    ``[rows, ceil(V / 32)]``: row ``j * B + b`` holds row ``b``'s mask, all ones without one, less
    the draft's bit where ``j < n`` and row ``b`` samples), temperatures, seeds, offsets
    (``offset_b + j``) and streams."""
    batch, n = draft_token_ids.shape
    device = draft_token_ids.device
    if base is None:
        base = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32, device=device)
    safe, inside = draft_columns(draft_token_ids, vocab_start, vocab)
    word, words, bits, _ = draft_words(base, safe, inside)
    clear = inside & (temps != 0)[:, None]
    masks = base.repeat(n + 1, 1)
    draft_rows = torch.arange(n, device=device)[None, :] * batch + torch.arange(batch, device=device)[:, None]
    masks[draft_rows.reshape(-1), word.reshape(-1)] = torch.where(clear, words & ~bits, words).reshape(-1)
    j = torch.arange(n + 1, device=device)
    return (masks, temps.repeat(n + 1), seeds.repeat(n + 1), (offsets[None, :] + j[:, None]).reshape(-1),
            streams.repeat(n + 1))


def _finish_step(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, emitted_rows: Tensor, lse_rows: Tensor,
                 token_logp_rows: Tensor, base: Tensor | None, bias: Tensor | None, step: _Step, vocab_start: int,
                 return_logprobs: bool) -> SpeculativeOutput:
    """The acceptance walk after the fused op (``_speculative_finish``) in torch ops: the draft's
    logit, ``p_j(d_j)`` from the emitted row's log-sum-exp with the draft's term added back, the
    acceptance uniforms, then the step's tokens (and their log-probabilities)."""
    batch, positions, _ = hidden.shape
    n, vocab = step.n, weight.shape[0]
    safe, inside = draft_columns(draft_token_ids, vocab_start, vocab)
    draft_allowed = inside if base is None else draft_words(base, safe, inside)[3]
    cleared = draft_allowed & ~step.greedy[:, None]
    emitted = emitted_rows.reshape(positions, batch).T  # [B, n + 1]
    lse = lse_rows.reshape(positions, batch).T.double()
    # The draft's logit: raw dot product, then the op's rule (scale, soft-cap, bias), then 1 / T.
    raw = (hidden[:, :n].float() * weight[safe].float()).sum(dim=2)
    x_draft = torch.ops.flashsampling._model_logits(raw, step.logit_scale, step.logit_softcap)
    if bias is not None:
        x_draft = x_draft + bias[safe]
    y_draft = (x_draft * y_scales(step)[:, None]).double()
    num_accepted, logp_draft, lse_full = one_hot_acceptance(step, draft_token_ids, emitted, lse, y_draft,
                                                            draft_allowed, cleared, inside)
    if not return_logprobs:
        return step_output(draft_token_ids, emitted, num_accepted, None, None)
    # The op's log-probability is over its row's tokens (the draft left out): back to the whole row.
    emitted_logp = token_logp_rows.reshape(positions, batch).T.double() + lse - lse_full
    return step_output(draft_token_ids, emitted, num_accepted, torch.where(inside, logp_draft, torch.nan),
                       emitted_logp)


@torch.library.register_fake("flashsampling::_speculative_rows")
def _speculative_rows_fake(drafts, temperatures, seeds, offsets, streams, allowed_mask, vocab, vocab_start):
    rows = (drafts.shape[1] + 1) * drafts.shape[0]
    return (drafts.new_empty((rows, (vocab + 31) // 32), dtype=torch.int32), temperatures.new_empty((rows,)),
            seeds.new_empty((rows,)), offsets.new_empty((rows,)), streams.new_empty((rows,)))


@torch.library.register_fake("flashsampling::_speculative_finish")
def _speculative_finish_fake(hidden, weight, drafts, emitted, lse, token_logprobs, temperatures, seeds, offsets,
                             streams, allowed_mask, logit_bias, logit_scale, logit_softcap, vocab_start):
    batch, positions, _ = hidden.shape
    return (hidden.new_empty((batch, positions), dtype=torch.int64), hidden.new_empty((batch,), dtype=torch.int64),
            hidden.new_empty((batch if token_logprobs is not None else 0, positions), dtype=torch.float32))


def empty_output(hidden: Tensor, n: int, return_logprobs: bool) -> SpeculativeOutput:
    """The output of a batch of no rows."""
    tokens = torch.empty((0, n + 1), dtype=torch.int64, device=hidden.device)
    logprobs = torch.empty((0, n + 1), dtype=torch.float32, device=hidden.device) if return_logprobs else None
    return SpeculativeOutput(tokens, tokens.new_empty(0), logprobs)


def step_output(draft_token_ids: Tensor, emitted: Tensor, num_accepted: Tensor, draft_logp: Tensor | None,
                emitted_logp: Tensor | None) -> SpeculativeOutput:
    """The accepted drafts, then the emitted token at ``num_accepted``, -1 after; with
    ``draft_logp [B, n]`` / ``emitted_logp [B, n + 1]`` (float64, NaN where the token is none)
    their log-probabilities."""
    batch, positions = emitted.shape
    slot = torch.arange(positions, device=emitted.device)[None, :]
    final = emitted.gather(1, num_accepted[:, None])
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    tokens = torch.where(slot < num_accepted[:, None], drafts, torch.where(slot == num_accepted[:, None], final, -1))
    logprobs = None
    if draft_logp is not None:
        drafted = torch.cat([draft_logp, draft_logp.new_full((batch, 1), torch.nan)], dim=1)
        final_logp = emitted_logp.gather(1, num_accepted[:, None])
        logprobs = torch.where(slot < num_accepted[:, None], drafted,
                               torch.where(slot == num_accepted[:, None], final_logp, torch.nan)).float()
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
    step = parse_step("flashsampling.speculative_sample", hidden, weight, draft_token_ids, draft_probs, temperature,
                      seed, offset, top_k, top_p, min_p, lambda: draw_seed(generator, hidden.device), logit_scale,
                      logit_softcap, logit_bias, allowed_mask)
    n = step.n
    if step.batch == 0:
        return empty_output(hidden, n, return_logprobs)
    check_draft_values("flashsampling.speculative_sample", draft_token_ids, draft_probs, vocab_start + weight.shape[0])
    if draft_probs is None and step.truncation is None:
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and n + 1 <= FUSED_MAX_POSITIONS:
            return verify_one_hot_fused(hidden, weight, draft_token_ids, logit_bias, allowed_mask, step, vocab_start,
                                        return_logprobs)
        return verify_one_hot(hidden, weight, draft_token_ids, logit_bias, allowed_mask, step, vocab_start,
                              return_logprobs)
    return verify(hidden, weight, draft_token_ids, draft_probs, logit_bias, allowed_mask, step, vocab_start,
                  return_logprobs)


def verify(hidden: Tensor, weight: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
           logit_bias: Tensor | None, allowed_mask: Tensor | None, step: _Step, vocab_start: int,
           return_logprobs: bool) -> SpeculativeOutput:
    """:func:`speculative_sample` for any drafts and truncation: the float64 log-probabilities of
    every position, then each position's sample (:func:`position_samples`)."""
    n = step.n
    x, y, allowed = target(hidden, weight, logit_bias, allowed_mask, step)
    logp = torch.log_softmax(masked_target(y, allowed), dim=2)  # the target's log-probabilities, float64

    # Acceptance of each draft.
    safe, inside = draft_columns(draft_token_ids, vocab_start, weight.shape[0])
    p_draft = torch.where(inside, logp[:, :n].gather(2, safe[:, :, None])[:, :, 0].exp(), 0.0)
    q = q_draft = None
    if draft_probs is not None:
        q = draft_probs.to(hidden.device)  # float64 one position at a time, not [B, n, V] at once
        q_draft = q.gather(2, safe[:, :, None])[:, :, 0].double()
    argmax = torch.where(torch.isnan(y[:, :n]), -torch.inf, y[:, :n])
    if allowed is not None:
        argmax = argmax.masked_fill(~allowed[:, :n], -torch.inf)
    best = argmax.max(dim=2)  # first index of the max: ties to the smaller index
    # A greedy row accepts the draft that is its argmax, never where nothing is allowed.
    num_accepted = accepted_count(step, acceptance_probability(p_draft, q_draft, inside),
                                  (safe == best.indices) & inside & (best.values > -torch.inf))

    # The sample each position would emit: corrective (j < n) or bonus (j = n).
    emitted, _ = position_samples(x, allowed, step, safe, inside, logp, q, vocab_start, -1)
    if not return_logprobs:
        return step_output(draft_token_ids, emitted, num_accepted, None, None)
    return step_output(draft_token_ids, emitted, num_accepted, torch.where(inside, values_at(logp[:, :n], safe),
                       torch.nan), values_at(logp, emitted - vocab_start))
