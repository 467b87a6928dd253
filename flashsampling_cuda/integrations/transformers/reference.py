"""The reference of :meth:`FlashSamplingDecoder.generate`: the model's standard forward and the
op's sampling rule applied to its logits in float64."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor
from transformers.cache_utils import DynamicCache

from ...noise import as_int64_tensor, gumbel_noise
from ...penalties import penalties_on
from ...reference import reference_logit_transform, reference_penalized
from .prompts import (_cache_kwarg, _default_pad_token_id, _num_new_tokens, _output_cache, _positions, _prepare_prompts,
                      _stop_list)


def logits_rtol(dtype: torch.dtype) -> float:
    """Relative error budget of a score computed from logits of this dtype against the op's
    fp32 logits: about twice the dtype's half-ulp (bf16 and fp16 logits are rounded)."""
    return {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 0.0) + 1e-5


def reference_sample_from_logits(
    logits: Tensor,
    temperature: float | Tensor = 1.0,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    *,
    rtol: float = 1e-5,
) -> tuple[Tensor, Tensor, Tensor]:
    """The op's sampling rule applied to given logits ``[B, V]``, in float64.

    ``token[b] = argmax_v(logits[b, v] / T_b + g(seed, offset, stream, 0, v))`` (``T = 0``:
    ``argmax_v logits[b, v]``) with the op's noise and stream rule (0-d seed: stream ``b``;
    ``[B]`` seed: stream 0). Returns ``(tokens [B], gap [B], tolerance [B])``: ``gap`` is the
    best minus the second-best score; a token may differ from the op's where ``gap <
    tolerance = rtol * (max_v |logits[b, v]| / T_b + 1)``.
    """
    batch, vocab = logits.shape
    device = logits.device
    x = logits.double()
    temps = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    greedy = temps == 0
    inv_t = torch.where(greedy, 1.0, 1.0 / temps)
    seeds = as_int64_tensor(seed, device)
    per_row_seed = seeds.dim() == 1
    streams = torch.zeros(batch, dtype=torch.int64, device=device) if per_row_seed else torch.arange(batch, device=device)
    seeds = seeds.expand(batch)
    offsets = as_int64_tensor(offset, device).expand(batch)
    g = gumbel_noise(seeds[:, None], offsets[:, None], streams[:, None], 0, torch.arange(vocab, device=device))
    scores = torch.where(greedy[:, None], x, x * inv_t[:, None] + g.double())
    top = scores.topk(min(2, vocab), dim=1)
    if vocab > 1:
        gap = top.values[:, 0] - top.values[:, 1]
    else:
        gap = torch.full((batch,), math.inf, dtype=torch.float64, device=device)
    tolerance = rtol * (x.abs().amax(dim=1) * inv_t + 1.0)
    return top.indices[:, 0], gap, tolerance


@dataclass
class ReferenceDecodeOutput:
    sequences: Tensor  # [B, P + n]
    new_tokens: Tensor  # [B, n]
    num_new_tokens: Tensor  # [B]
    gap: Tensor  # float64 [B, n]: best minus second-best score of each step
    tolerance: Tensor  # float64 [B, n]: a step whose gap is below this is a near tie


@torch.no_grad()
def reference_generate(
    model: nn.Module,
    input_ids: Tensor | Sequence[Sequence[int]],
    attention_mask: Tensor | None = None,
    *,
    max_new_tokens: int,
    temperature: float | Tensor = 1.0,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    stop_token_ids: Sequence[int] | Tensor | None = None,
    pad_token_id: int | None = None,
    rtol: float | None = None,
    repetition_penalty=None,
    frequency_penalty=None,
    presence_penalty=None,
) -> ReferenceDecodeOutput:
    """The reference of :meth:`FlashSamplingDecoder.generate`: the model's standard forward
    (``model(...)`` with a dynamic cache and its own masks, lm_head included), its logits
    ``[:, -1]`` in float64, the penalties over the prompt and the tokens so far
    (:func:`flashsampling_cuda.reference.reference_penalized`, dense tables) and
    :func:`reference_sample_from_logits` with offset ``offset + t`` at step ``t``. Same prompt,
    padding and stop rules as the decoder."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    stops = _stop_list(stop_token_ids)
    pad_id = _default_pad_token_id(model, pad_token_id, stops)
    device = model.get_output_embeddings().weight.device
    ids, mask = _prepare_prompts(input_ids, attention_mask, pad_id, device)
    batch = ids.shape[0]
    stop_t = torch.tensor(stops, dtype=torch.int64, device=device)
    seed_t = as_int64_tensor(seed, device)
    offset_t = as_int64_tensor(offset, device)
    attn = mask.clone()
    positions = _positions(mask)
    cache_kwarg = _cache_kwarg(model.forward)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                **{cache_kwarg: DynamicCache(config=model.config)}, use_cache=True)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, gaps, tols = [], [], []
    penalised = penalties_on(repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty)
    for t in range(max_new_tokens):
        logits = out.logits[:, -1]
        if penalised:
            transform = reference_logit_transform(
                batch, logits.shape[1], repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty, prompt_token_ids=torch.where(mask.bool(), ids, -1),
                output_token_ids=torch.stack(tokens, dim=1) if tokens else None, device=device)
            logits = reference_penalized(logits.double(), transform)
        tok, gap, tol = reference_sample_from_logits(
            logits, temperature, seed_t, offset_t + t, rtol=logits_rtol(out.logits.dtype) if rtol is None else rtol)
        tok = torch.where(finished, pad_id, tok)
        if stops:
            finished |= (tok[:, None] == stop_t[None, :]).any(dim=1)
        tokens.append(tok)
        gaps.append(gap)
        tols.append(tol)
        if t + 1 == max_new_tokens or (stops and bool(finished.all())):
            break
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=tok[:, None], attention_mask=attn, position_ids=positions,
                    **{cache_kwarg: _output_cache(out)}, use_cache=True)
    new_tokens = torch.stack(tokens, dim=1)
    return ReferenceDecodeOutput(
        sequences=torch.cat([ids, new_tokens], dim=1),
        new_tokens=new_tokens,
        num_new_tokens=_num_new_tokens(new_tokens, stops),
        gap=torch.stack(gaps, dim=1),
        tolerance=torch.stack(tols, dim=1),
    )
