"""Speculative decoding of a Hugging Face causal LM, verified exactly with
:func:`flashsampling_cuda.speculative_sample` (:func:`speculative_generate`), and two proposers
of draft tokens: prompt lookup (:class:`NgramProposer`) and a small draft model
(:class:`DraftModelProposer`, e.g. :func:`truncated_draft_model` of the target).

Each step of the loop proposes ``n`` drafts per row, runs the target's body once over the row's
last emitted token and the drafts (``n + 1`` positions, on a ``DynamicCache``), verifies them
against the target with ``speculative_sample`` and keeps the accepted prefix plus the
corrective or bonus token: 1 to ``n + 1`` tokens per row and step, which follow the target's
distribution exactly whatever the proposer (greedy rows: the target's greedy tokens).

Rows accept different numbers of drafts. The loop keeps one cache for the batch: the slots of
a row's rejected drafts stay in it and are masked out of the attention (the row's attention
mask is 0 there; position ids count the row's own tokens), and the slots that every row
rejected are cropped (``DynamicCache.crop``). So a batch decodes in lockstep and ``B = 1`` never
has masked slots. The loop is written for clarity rather than speed: it reads each step's
accepted counts on the host, and no step is captured in a CUDA graph.

Noise (so that ``(seed, offset)`` reproduces a run for a given proposer): the first token is
``sample(..., offset=offset)`` of the prompt's last hidden state; step ``k`` (``k = 0, 1, ...``)
verifies with ``speculative_sample(..., offset=offset + 1 + k (n + 1))``, whose positions draw
at that offset plus ``0 .. n``; a :class:`DraftModelProposer` samples draft ``j`` of step ``k``
at the same offset plus ``j`` under the seed ``seed ^ DRAFT_SEED_XOR``, independent of the
verification's noise (a draft drawn with the verification's own noise would bias the result).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from transformers.cache_utils import DynamicCache

from ...noise import as_int64_tensor
from ...sampling import sample_from_logits
from ...speculative import speculative_sample
from ...truncation import scaled_logits
from .head import FlashSamplingHead, UnsupportedModelError, _prefix
from .prompts import _cache_kwarg, _default_pad_token_id, _positions, _prepare_prompts, _stop_list

__all__ = ["speculative_generate", "SpeculativeDecodeOutput", "DraftState", "Proposer", "NgramProposer",
           "DraftModelProposer", "truncated_draft_model", "DRAFT_SEED_XOR"]

# Draft tokens are sampled under seed ^ DRAFT_SEED_XOR: another Philox key than the
# verification's, so the drafts are independent of its uniforms and samples.
DRAFT_SEED_XOR = 0x5851F42D4C957F2D


@dataclass
class DraftState:
    """What a proposer sees at a step (``S`` cache slots so far, the same for the target's and a
    draft model's cache)."""

    history: list[list[int]]  # per row: its prompt tokens, then the tokens emitted so far (the last: pending)
    pending: Tensor  # int64 [B]: each row's last emitted token, in no cache yet
    attention_mask: Tensor  # int64 [B, S]: 1 where a row attends (0: left padding, rejected drafts)
    next_position: Tensor  # int64 [B]: position id of `pending`
    temperature: Tensor  # float32 [B] (0: greedy)
    seed: Tensor  # int64, 0-d or [B]: the call's seed
    offset: Tensor  # int64, 0-d or [B]: the noise offset of this step's verification


class Proposer(Protocol):
    """Proposes draft tokens for :func:`speculative_generate`."""

    def start(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> None:
        """Called once with the left-padded prompts ``[B, P]`` (cache slots ``0 .. P - 1``)."""

    def propose(self, state: DraftState, num_draft_tokens: int) -> tuple[Tensor, Tensor | None]:
        """``(draft_ids int64 [B, n], draft_probs [B, n, V] or None)``: the drafts following
        ``state.pending``; ``draft_probs`` the distributions they were sampled from (None: one-hot).
        A proposer with a cache feeds ``pending`` and the ``n`` drafts at slots ``S .. S + n``."""

    def rollback(self, num_slots: int) -> None:
        """Keep the first ``num_slots`` cache slots (the loop keeps as many in the target's)."""


class NgramProposer:
    """Prompt lookup: the drafts are what followed the latest earlier occurrence of the row's
    last ``max_ngram`` (down to ``min_ngram``) tokens in its prompt and output, continued
    periodically where that runs into the end; without a match, the last token repeated. One-hot
    drafts (``draft_probs=None``), on the host; no model, no cache."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= int(min_ngram) <= int(max_ngram):
            raise ValueError(f"NgramProposer: need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = int(max_ngram), int(min_ngram)

    def start(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> None:
        pass

    def rollback(self, num_slots: int) -> None:
        pass

    def lookup(self, history: Sequence[int], n: int) -> list[int]:
        """The ``n`` drafts for one row's tokens ``history``."""
        h = list(history)
        for size in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
            tail = h[-size:]
            for start in range(len(h) - size - 1, -1, -1):
                if h[start : start + size] == tail:
                    seq = h[:]
                    for k in range(n):  # an overlapping copy: a match near the end repeats its period
                        seq.append(seq[start + size + k])
                    return seq[len(h):]
        return [h[-1]] * n

    def propose(self, state: DraftState, num_draft_tokens: int) -> tuple[Tensor, None]:
        drafts = [self.lookup(row, num_draft_tokens) for row in state.history]
        return torch.tensor(drafts, dtype=torch.int64, device=state.pending.device), None


class DraftModelProposer:
    """Drafts from a small causal LM over the target's vocabulary (its own ``DynamicCache``,
    kept slot for slot like the target's).

    ``sample_drafts=True``: draft ``j`` is a sample of ``q_j = softmax(draft logits / T)`` at the
    call's temperatures (no truncation; greedy rows: its argmax), passed with ``draft_probs=q``;
    ``False``: the draft model's greedy tokens as one-hot drafts (``draft_probs=None``). Either
    way the output follows the target exactly; the choice changes only the acceptance.
    """

    def __init__(self, draft_model: nn.Module, *, sample_drafts: bool = True):
        self.model = draft_model
        self.sample_drafts = bool(sample_drafts)
        self.cache: DynamicCache | None = None
        self._cache_kwarg = _cache_kwarg(draft_model.forward)

    def _forward(self, ids: Tensor, mask: Tensor, positions: Tensor) -> Tensor:
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         **{self._cache_kwarg: self.cache}, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    def start(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._forward(input_ids, attention_mask, position_ids)

    def rollback(self, num_slots: int) -> None:
        _crop(self.cache, num_slots)

    def propose(self, state: DraftState, num_draft_tokens: int) -> tuple[Tensor, Tensor | None]:
        mask, token = state.attention_mask, state.pending
        ones = torch.ones_like(mask[:, :1])
        greedy = state.temperature == 0
        draft_seed = state.seed ^ DRAFT_SEED_XOR
        drafts, probs = [], []
        for j in range(num_draft_tokens + 1):
            mask = torch.cat([mask, ones], dim=1)
            logits = self._forward(token[:, None], mask, (state.next_position + j)[:, None])
            if j == num_draft_tokens:  # the last draft is fed only to keep this cache's slots the target's
                break
            if not self.sample_drafts:
                token = logits.argmax(dim=1)
            else:
                token = sample_from_logits(logits, temperature=state.temperature, seed=draft_seed,
                                           offset=state.offset + j)[:, 0]
                q = torch.softmax(scaled_logits(logits, 1.0, state.temperature), dim=1)
                probs.append(torch.where(greedy[:, None], nn.functional.one_hot(token, q.shape[1]).to(q.dtype), q))
            drafts.append(token)
        return torch.stack(drafts, dim=1), torch.stack(probs, dim=1) if probs else None


def truncated_draft_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A draft model made of the target's embedding, its first ``num_layers`` decoder layers, its
    final norm and its head: the same modules (no weight is copied), in a shallow copy of the
    model whose config says ``num_hidden_layers = num_layers``. Its logits are what the target
    would give if its later layers added nothing to the residual stream."""
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not 1 <= int(num_layers) <= len(layers):
        raise ValueError(f"truncated_draft_model: num_layers must be in [1, {len(layers) if layers else 0}] "
                         f"(the model's decoder layers at model.model.layers), got {num_layers}")
    num_layers = int(num_layers)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    draft_body = copy.copy(body)
    draft_body._modules = dict(body._modules)  # the copy's own module table: the target keeps its layers
    draft_body.layers = nn.ModuleList(list(layers[:num_layers]))
    draft_body.config = config
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.model = draft_body
    draft.config = config
    return draft


@dataclass
class SpeculativeDecodeOutput:
    sequences: Tensor  # int64 [B, P + n]: the (left-padded) prompts followed by new_tokens
    new_tokens: Tensor  # int64 [B, n]: emitted tokens; pad_token_id after a row's stop token or end
    num_new_tokens: Tensor  # int64 [B]: tokens generated per row, its stop token included
    prompt_attention_mask: Tensor  # int64 [B, P]
    num_steps: Tensor  # int64 [B]: verification steps (target forwards) per row while it ran
    num_drafted: Tensor  # int64 [B]: drafts verified per row
    num_accepted: Tensor  # int64 [B]: drafts accepted per row

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafts, all rows together."""
        return float(self.num_accepted.sum()) / max(1, int(self.num_drafted.sum()))

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step (the first token, from the prompt, not counted)."""
        return float((self.num_new_tokens - 1).clamp(min=0).sum()) / max(1, int(self.num_steps.sum()))


def _crop(cache: DynamicCache, num_slots: int) -> None:
    """Keeps the first ``num_slots`` slots. ``crop`` with a negative count removes that many
    slots in every transformers 5.x (a non-negative argument meant another thing before 5.24)."""
    extra = cache.get_seq_length() - num_slots
    if extra > 0:
        cache.crop(-extra)


def _check_window(model: nn.Module, cache: DynamicCache, num_slots: int) -> None:
    """Sliding-window layers count their window in cache slots, and a row's rejected drafts keep
    theirs: refuse a run whose slots could outgrow the window (within it, the attention is full)."""
    if not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        return
    window = getattr(model.config, "sliding_window", None)
    if window is None or num_slots > window:
        raise UnsupportedModelError(
            f"{_prefix(model)} speculative decoding with sliding-window attention (window {window}) and up to "
            f"{num_slots} cache slots (prompt + (max_new_tokens - 1) * (num_draft_tokens + 1) + num_draft_tokens + 1) "
            "is not supported; keep them within the window")


@torch.no_grad()
def speculative_generate(
    model: nn.Module,
    input_ids: Tensor | Sequence[Sequence[int]],
    attention_mask: Tensor | None = None,
    *,
    proposer: Proposer,
    num_draft_tokens: int = 4,
    max_new_tokens: int,
    temperature: float | Tensor = 1.0,
    top_k: int | Tensor | None = None,
    top_p: float | Tensor | None = None,
    min_p: float | Tensor | None = None,
    seed: int | Tensor = 0,
    offset: int | Tensor = 0,
    stop_token_ids: Sequence[int] | Tensor | None = None,
    pad_token_id: int | None = None,
) -> SpeculativeDecodeOutput:
    """Samples up to ``max_new_tokens`` tokens per prompt from ``model`` with speculative
    decoding (module docstring): ``proposer`` drafts ``num_draft_tokens`` tokens per step, the
    target verifies them exactly. Prompts, ``temperature`` (float, 0 = greedy, or ``[B]``),
    ``top_k`` / ``top_p`` / ``min_p``, ``seed`` / ``offset``, ``stop_token_ids`` and
    ``pad_token_id`` as in :meth:`FlashSamplingDecoder.generate`; the tokens follow the same
    distribution (greedy: the same tokens), drawn with other noise.

    Supported models: those of :class:`FlashSamplingHead`; a model's logit scale and soft-cap go
    to ``speculative_sample`` as they go to ``sample``.
    """
    n = num_draft_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative_generate: num_draft_tokens must be an int >= 1, got {num_draft_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"speculative_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    head = FlashSamplingHead(model)
    device = head.weight.device
    stops = _stop_list(stop_token_ids)
    pad_id = _default_pad_token_id(model, pad_token_id, stops)
    ids, mask = _prepare_prompts(input_ids, attention_mask, pad_id, device)
    batch, prompt_len = ids.shape
    if isinstance(temperature, Tensor):
        temps = temperature.to(device=device, dtype=torch.float32).expand(batch).contiguous()
    else:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"speculative_generate: temperature must be a float >= 0 or a [B] tensor, "
                             f"got {temperature!r}")
        temps = torch.full((batch,), float(temperature), dtype=torch.float32, device=device)
    seed_t, offset_t = as_int64_tensor(seed, device), as_int64_tensor(offset, device)
    truncation = dict(top_k=top_k, top_p=top_p, min_p=min_p)

    body, cache_kwarg = model.model, _cache_kwarg(model.model.forward)
    cache = DynamicCache(config=model.config)
    _check_window(model, cache, prompt_len + (max_new_tokens - 1) * (n + 1) + n + 1)

    def forward(tokens: Tensor, slot_mask: Tensor, positions: Tensor) -> Tensor:
        return body(input_ids=tokens, attention_mask=slot_mask, position_ids=positions, **{cache_kwarg: cache},
                    use_cache=True).last_hidden_state

    positions = _positions(mask)
    hidden = forward(ids, mask, positions)
    pending = head(hidden[:, -1].contiguous(), temperature=temps, seed=seed_t, offset=offset_t, **truncation)[:, 0]
    proposer.start(ids, mask, positions)

    slot_mask = mask.clone()
    next_position = mask.sum(dim=1)
    history = [[int(t) for t, m in zip(row, row_mask) if m] for row, row_mask in zip(ids.tolist(), mask.tolist())]
    new = [[] for _ in range(batch)]
    running = [True] * batch

    def emit(b: int, tokens: list[int]) -> None:
        for t in tokens:
            new[b].append(t)
            history[b].append(t)
            if t in stops or len(new[b]) == max_new_tokens:
                running[b] = False
                return

    for b, t in enumerate(pending.tolist()):
        emit(b, [t])
    steps, drafted, accepted = ([0] * batch for _ in range(3))
    slots = torch.arange(n + 1, device=device)
    k = 0
    while any(running):
        step_offset = offset_t + 1 + k * (n + 1)
        state = DraftState(history, pending, slot_mask, next_position, temps, seed_t, step_offset)
        drafts, draft_probs = proposer.propose(state, n)
        if tuple(drafts.shape) != (batch, n) or drafts.dtype != torch.int64:
            raise ValueError(f"speculative_generate: the proposer returned draft ids {drafts.dtype} "
                             f"{list(drafts.shape)}, expected int64 [{batch}, {n}]")
        num_slots = slot_mask.shape[1]
        fed_mask = torch.cat([slot_mask, slot_mask.new_ones(batch, n + 1)], dim=1)
        hidden = forward(torch.cat([pending[:, None], drafts], dim=1), fed_mask, next_position[:, None] + slots)
        out = speculative_sample(hidden, head.weight, drafts, draft_probs, temperature=temps, seed=seed_t,
                                 offset=step_offset, logit_bias=head.logit_bias_on(device), **truncation,
                                 logit_scale=head.logit_scale, logit_softcap=head.logit_softcap)
        num_accepted = out.num_accepted
        # Row b keeps pending and its accepted drafts; the slots every row rejected go.
        fed_mask[:, num_slots:] = (slots[None, :] <= num_accepted[:, None]).to(fed_mask.dtype)
        keep = num_slots + 1 + int(num_accepted.max())
        slot_mask = fed_mask[:, :keep]
        _crop(cache, keep)
        proposer.rollback(keep)
        next_position = next_position + num_accepted + 1
        pending = out.tokens.gather(1, num_accepted[:, None])[:, 0]
        for b, (row, a) in enumerate(zip(out.tokens.tolist(), num_accepted.tolist())):
            if running[b]:
                steps[b] += 1
                drafted[b] += n
                accepted[b] += a
                emit(b, row[: a + 1])
        k += 1

    width = max(len(row) for row in new)
    new_tokens = torch.full((batch, width), pad_id, dtype=torch.int64)
    for b, row in enumerate(new):
        new_tokens[b, : len(row)] = torch.tensor(row, dtype=torch.int64)
    new_tokens = new_tokens.to(device)
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
    return SpeculativeDecodeOutput(
        sequences=torch.cat([ids, new_tokens], dim=1),
        new_tokens=new_tokens,
        num_new_tokens=as_tensor([len(row) for row in new]),
        prompt_attention_mask=mask,
        num_steps=as_tensor(steps),
        num_drafted=as_tensor(drafted),
        num_accepted=as_tensor(accepted),
    )
