"""Prompt padding and stop-token bookkeeping shared by the decoder and the reference decoder."""

from __future__ import annotations

import inspect

from typing import Sequence

import torch
import torch.nn as nn
from torch import Tensor


def _prepare_prompts(input_ids, attention_mask, pad_token_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Left-padded int64 ids [B, P] and 0/1 mask [B, P] on `device`."""
    if isinstance(input_ids, Tensor):
        ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)
        ids = ids.to(device=device, dtype=torch.int64)
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            mask = attention_mask.reshape(ids.shape).to(device=device, dtype=torch.int64)
    else:
        rows = [list(map(int, r)) for r in input_ids]
        if attention_mask is not None:
            raise ValueError("attention_mask goes with a tensor input_ids; lists are left-padded here")
        width = max((len(r) for r in rows), default=0)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for b, r in enumerate(rows):
            if r:
                ids[b, width - len(r):] = torch.tensor(r)
                mask[b, width - len(r):] = 1
        ids, mask = ids.to(device), mask.to(device)
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"need at least one prompt of at least one token, got input_ids of shape {list(ids.shape)}")
    m = mask.cpu()
    if not bool(((m == 0) | (m == 1)).all()):
        raise ValueError("attention_mask must hold 0 and 1")
    if not bool((m[:, -1] == 1).all() and (m[:, 1:] >= m[:, :-1]).all()):
        raise ValueError(
            "prompts must be left-padded (attention_mask of the form 0...0 1...1 with a last "
            "column of ones): every row's next token goes at the same cache slot"
        )
    return ids, mask


def _positions(mask: Tensor) -> Tensor:
    """Position ids of left-padded tokens [B, P] (0/1 ``mask``): each row counts its own tokens
    from 0; padding gets 1 (any value: nothing attends to it)."""
    return (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)


def _default_pad_token_id(model: nn.Module, pad_token_id, stops: Sequence[int]) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    return int(stops[0]) if len(stops) else 0


def _stop_list(stop_token_ids) -> list[int]:
    return [] if stop_token_ids is None else [int(t) for t in torch.as_tensor(stop_token_ids).reshape(-1).tolist()]


def _num_new_tokens(new_tokens: Tensor, stops: Sequence[int]) -> Tensor:
    """Tokens per row up to and including its first stop token."""
    batch, n = new_tokens.shape
    if not stops:
        return torch.full((batch,), n, dtype=torch.int64, device=new_tokens.device)
    hit = (new_tokens[:, :, None] == torch.tensor(stops, device=new_tokens.device)).any(dim=2)
    first = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, n)
    return first.to(torch.int64)


def _cache_kwarg(forward) -> str:
    """The KV-cache argument of a model's forward: ``cache`` from transformers 5.24 on (which
    deprecates ``past_key_values``), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _output_cache(out):
    """The KV cache a forward returned (``cache`` from transformers 5.24 on, else ``past_key_values``)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
