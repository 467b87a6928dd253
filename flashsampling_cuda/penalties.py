"""Repetition, frequency and presence penalties, and the model-side logit transforms
(``logit_scale``, ``logit_softcap``), as :func:`flashsampling_cuda.sample` applies them.

The rule, per row ``b`` and token ``v`` (fp32, in this order; docs/penalties.md):

1. model side, on the raw logit ``l = hidden . weight[v]``: ``l = fl(l * logit_scale)``, then
   ``l = fl(cap * tanh(fl(l * fl(1 / cap))))`` with ``cap = logit_softcap`` and the tanh of
   ``csrc/include/flashsampling/philox_gumbel.h`` (``fs_tanhf``, within 2 ulp; Gemma 2/3
   ``final_logit_softcapping``; Granite's ``logits_scaling`` is ``logit_scale = 1 / it``, Cohere's
   ``logit_scale`` is itself);
2. the biases and the mask, as without penalties: ``x = fl(fl(l + logit_bias[v]) + s)``, ``s`` the
   row's sparse bias;
3. vLLM's penalties (``vllm/v1/sample/ops/penalties.py``): the repetition penalty ``r_b`` on
   every token seen in the prompt or the output, ``x = x / r_b`` where ``x > 0`` and ``x * r_b``
   elsewhere; then ``x = fl(x + q)`` with ``q = -fl(fl(f_b * c) + fl(p_b * [c > 0]))``, ``c`` the
   token's count among the output tokens, ``f_b`` / ``p_b`` the frequency / presence penalties;
4. temperature, truncation and the noise as without penalties (``y = x / T``).

A row whose penalties are off (``r = 1``, ``f = p = 0``) and whose model transforms are off gets
the logits of plain sampling, bit for bit.

The token history lives in a :class:`PenaltyState`: per row the distinct ids seen, whether each
was in the prompt and its count among the output tokens, in ``O(B * capacity)`` device memory
(not a ``[B, V]`` count table), updated on the device from each step's tokens without a host
sync, so a decode step that samples and updates can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .truncation import transformed_logits

__all__ = ["PenaltyState"]


def _token_matrix(name: str, ids, batch: int | None, device) -> Tensor:
    """``ids`` as an int64 ``[B, L]`` tensor (``-1``: padding); lists of lists are padded."""
    if isinstance(ids, Tensor):
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
            raise TypeError(f"flashsampling.PenaltyState: {name} must be an int32/int64 [B, L] tensor, got "
                            f"{ids.dtype} with shape {list(ids.shape)}")
        t = ids.to(device=device if device is not None else ids.device, dtype=torch.int64)
    elif isinstance(ids, (list, tuple)):
        rows = [list(r) for r in ids]
        if not all(isinstance(v, int) for r in rows for v in r):
            raise TypeError(f"flashsampling.PenaltyState: {name} must hold ints")
        width = max((len(r) for r in rows), default=0)
        t = torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64,
                         device=device).reshape(len(rows), width)
    else:
        raise TypeError(f"flashsampling.PenaltyState: {name} must be a [B, L] tensor or a list of lists, got "
                        f"{type(ids).__name__}")
    if batch is not None and t.shape[0] != batch:
        raise ValueError(f"flashsampling.PenaltyState: {name} must have {batch} rows, got {t.shape[0]}")
    return t


class PenaltyState:
    """The tokens each row has seen, for the penalties of :func:`flashsampling_cuda.sample`.

    Tensors (on ``device``; ``C = capacity``): ``ids`` int64 ``[B, C]`` (distinct ids, ``-1`` in
    free slots), ``output_counts`` int32 ``[B, C]`` (count among the output tokens),
    ``in_prompt`` bool ``[B, C]``, ``size`` int64 ``[B]`` (slots in use) and ``overflowed`` bool
    ``[B]``: a row that had more distinct tokens than ``capacity`` (its later new tokens are not
    recorded; :meth:`check` raises for it). Give a capacity of at least the prompt's distinct
    tokens plus the steps to come.

    Args:
        prompt_token_ids: ``[B, L]`` int tensor or list of lists (``-1`` or any negative id:
            padding), or None.
        output_token_ids: the same for tokens generated so far, or None.
        capacity: slots per row (default: ``L_prompt + L_output + 256``).
        batch, device: needed when both id sets are None.
        vocab_size: where given, every id must be below it (``ValueError`` naming the argument;
            reads the ids once on the host). Without it an id beyond the vocabulary penalises
            nothing (a vocabulary shard's state holds every shard's ids).
    """

    def __init__(self, prompt_token_ids=None, output_token_ids=None, *, capacity: int | None = None,
                 batch: int | None = None, device: torch.device | str | None = None, vocab_size: int | None = None):
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"flashsampling.PenaltyState: vocab_size must be an int >= 1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        parts = []
        for name, ids, is_output in (("prompt_token_ids", prompt_token_ids, False),
                                     ("output_token_ids", output_token_ids, True)):
            if ids is not None:
                t = _token_matrix(name, ids, batch, device)
                if vocab_size is not None and t.numel() > 0 and int(t.max()) >= vocab_size:
                    raise ValueError(f"flashsampling.PenaltyState: {name} holds id {int(t.max())}, beyond "
                                     f"vocab_size={vocab_size}")
                batch, device = t.shape[0], t.device
                parts.append((t, is_output))
        if batch is None:
            raise ValueError("flashsampling.PenaltyState: give prompt_token_ids, output_token_ids or batch")
        device = torch.device(device) if device is not None else torch.device("cpu")
        width = sum(t.shape[1] for t, _ in parts)
        if capacity is None:
            capacity = width + 256
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"flashsampling.PenaltyState: capacity must be an int >= 1, got {capacity!r}")
        self.ids = torch.full((batch, capacity), -1, dtype=torch.int64, device=device)
        self.output_counts = torch.zeros((batch, capacity), dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
        self.size = torch.zeros(batch, dtype=torch.int64, device=device)
        self.overflowed = torch.zeros(batch, dtype=torch.bool, device=device)
        if parts:
            self._insert_all(torch.cat([t for t, _ in parts], dim=1),
                             torch.cat([torch.full_like(t, int(o), dtype=torch.bool) for t, o in parts], dim=1))

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def capacity(self) -> int:
        return self.ids.shape[1]

    def _insert_all(self, ids: Tensor, is_output: Tensor) -> None:
        """Fills the empty state with the distinct non-negative ids of each row (sorted)."""
        padding = torch.iinfo(torch.int64).max  # sorts after every id
        key, order = torch.where(ids >= 0, ids, padding).sort(dim=1, stable=True)
        real = key != padding
        is_output = is_output.gather(1, order) & real
        is_prompt = ~is_output & real
        first = torch.ones_like(key, dtype=torch.bool)
        first[:, 1:] = key[:, 1:] != key[:, :-1]
        first &= real
        slot = torch.cumsum(first.long(), dim=1) - 1  # the slot of each id's run
        fits = (slot < self.capacity) & real
        self.overflowed = (real & ~fits).any(dim=1)
        spare = self.capacity  # writes that do not fit go to a spare column, dropped below
        column = torch.where(fits, slot, spare)
        ids_wide = torch.full((self.batch, self.capacity + 1), -1, dtype=torch.int64, device=key.device)
        ids_wide.scatter_(1, torch.where(first & fits, column, spare), torch.where(first & fits, key, -1))
        counts = torch.zeros((self.batch, self.capacity + 1), dtype=torch.int32, device=key.device)
        counts.scatter_add_(1, column, is_output.int())
        prompt = torch.zeros((self.batch, self.capacity + 1), dtype=torch.int32, device=key.device)
        prompt.scatter_add_(1, column, is_prompt.int())
        self.ids = ids_wide[:, :-1].contiguous()
        self.output_counts = counts[:, :-1].contiguous()
        self.in_prompt = prompt[:, :-1] > 0
        self.size = (self.ids >= 0).sum(dim=1)

    def load_(self, prompt_token_ids=None, output_token_ids=None) -> None:
        """Refills this state in place with a new history (same batch, capacity and device), so
        that a captured CUDA graph that reads this state's tensors sees the new one."""
        fresh = PenaltyState(prompt_token_ids, output_token_ids, capacity=self.capacity, batch=self.batch,
                             device=self.ids.device, vocab_size=self.vocab_size)
        for name in ("ids", "output_counts", "in_prompt", "size", "overflowed"):
            getattr(self, name).copy_(getattr(fresh, name))

    def update(self, tokens: Tensor) -> None:
        """Counts each row's new output token, in place, on the device: ``tokens`` int ``[B]``
        or ``[B, 1]`` (a negative id, e.g. a finished row's ``-1``, records nothing)."""
        if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int32, torch.int64):
            raise TypeError("flashsampling.PenaltyState.update: tokens must be an int32/int64 tensor")
        if tokens.dim() == 2 and tokens.shape[1] == 1:
            tokens = tokens[:, 0]
        if tokens.dim() != 1 or tokens.shape[0] != self.batch:
            raise ValueError(f"flashsampling.PenaltyState.update: tokens must be [B] or [B, 1] with B = {self.batch}, "
                             f"got shape {list(tokens.shape)}")
        tokens = tokens.to(device=self.ids.device, dtype=torch.int64)
        live = tokens >= 0
        match = (self.ids == tokens[:, None]) & live[:, None]
        self.output_counts += match.int()
        new = live & ~match.any(dim=1)
        fits = new & (self.size < self.capacity)
        slot = self.size.clamp(max=self.capacity - 1)[:, None]
        self.ids.scatter_(1, slot, torch.where(fits, tokens, self.ids.gather(1, slot)[:, 0])[:, None])
        self.output_counts.scatter_(1, slot, torch.where(fits, 1, self.output_counts.gather(1, slot)[:, 0])[:, None]
                                    .int())
        self.size += fits.long()
        self.overflowed |= new & ~fits

    def check(self) -> None:
        """Raises ``RuntimeError`` naming the rows whose history did not fit ``capacity`` (a host sync)."""
        rows = torch.nonzero(self.overflowed).flatten().tolist()
        if rows:
            raise RuntimeError(f"flashsampling.PenaltyState: rows {rows[:16]} saw more than capacity={self.capacity} "
                               "distinct tokens; their penalties miss the later ones (build the state with a larger "
                               "capacity)")


class Penalties(NamedTuple):
    """The parsed penalty arguments of one call: each None (off for every row), a host float,
    or a float32 ``[B]`` tensor."""
    repetition: float | Tensor | None
    frequency: float | Tensor | None
    presence: float | Tensor | None
    state: PenaltyState | None


# The value of each penalty that turns it off (as a host float; a tensor is always read).
PENALTIES_OFF = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def penalties_on(**penalties) -> bool:
    """Whether any of the penalties given by name may be on: a tensor, or a host value other than
    its off value (an invalid one counts as on, for the op to refuse)."""
    return any(v is not None and (isinstance(v, Tensor) or v != PENALTIES_OFF[k]) for k, v in penalties.items())


def _penalty(name: str, value, hidden: Tensor, off: float, low: float, low_text: str):
    if value is None:
        return None
    if isinstance(value, Tensor):
        if not value.is_floating_point() or value.dim() > 1 or (value.dim() == 1 and value.shape[0] != hidden.shape[0]):
            raise ValueError(f"flashsampling.sample: {name} must be a float, or a floating 0-d or [B] tensor with "
                             f"B = {hidden.shape[0]}, got {value.dtype} with shape {list(value.shape)}")
        return value.to(device=hidden.device, dtype=torch.float32).expand(hidden.shape[0])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"flashsampling.sample: {name} must be a float or a tensor, got {type(value).__name__}")
    value = float(value)
    if not (value >= low) or value == float("inf"):
        raise ValueError(f"flashsampling.sample: {name} must be {low_text}, got {value}")
    return None if value == off else value


def _checked_host_history(name: str, ids, batch: int, id_end: int):
    """``ids`` as the ``[B, L]`` CPU tensor the state is built from, after a ``ValueError`` naming
    ``name`` where a history given on the host (lists, or a CPU tensor) holds an id at or beyond
    ``id_end``; ``ids`` as given where it is on the GPU (not read: no sync) or being traced."""
    if torch.compiler.is_compiling() or not (isinstance(ids, (list, tuple))
                                             or (isinstance(ids, Tensor) and ids.device.type == "cpu")):
        return ids
    host = _token_matrix(name, ids, batch, "cpu")
    if host.numel() > 0 and int(host.max()) >= id_end:
        raise ValueError(f"flashsampling.sample: {name} holds id {int(host.max())}, beyond the vocabulary [0, "
                         f"{id_end}) (negative ids are padding; a vocabulary shard's history, whose ids lie on other "
                         "shards too, goes in a PenaltyState)")
    return host


def parse_penalties(repetition_penalty, frequency_penalty, presence_penalty, penalty_state, prompt_token_ids,
                    output_token_ids, hidden: Tensor, id_end: int | None = None) -> Penalties | None:
    """The call's penalties, or None when every one is off as a host value. Host values out of
    range raise ``ValueError`` naming the argument (``repetition_penalty > 0``; frequency and
    presence finite); values inside tensors are not read (no sync). Where ``id_end`` is given,
    histories given on the host must hold ids below it."""
    repetition = _penalty("repetition_penalty", repetition_penalty, hidden, PENALTIES_OFF["repetition_penalty"],
                          float.fromhex("0x1p-126"), "> 0")
    frequency = _penalty("frequency_penalty", frequency_penalty, hidden, PENALTIES_OFF["frequency_penalty"],
                         -float("inf"), "finite")
    presence = _penalty("presence_penalty", presence_penalty, hidden, PENALTIES_OFF["presence_penalty"],
                        -float("inf"), "finite")
    if penalty_state is not None and (prompt_token_ids is not None or output_token_ids is not None):
        raise ValueError("flashsampling.sample: give penalty_state or prompt_token_ids / output_token_ids, not both")
    if penalty_state is None and (prompt_token_ids is not None or output_token_ids is not None):
        if id_end is not None:
            if prompt_token_ids is not None:
                prompt_token_ids = _checked_host_history("prompt_token_ids", prompt_token_ids, hidden.shape[0], id_end)
            if output_token_ids is not None:
                output_token_ids = _checked_host_history("output_token_ids", output_token_ids, hidden.shape[0], id_end)
        penalty_state = PenaltyState(prompt_token_ids, output_token_ids, batch=hidden.shape[0], device=hidden.device)
    if penalty_state is not None:
        if not isinstance(penalty_state, PenaltyState):
            raise TypeError(f"flashsampling.sample: penalty_state must be a PenaltyState, got "
                            f"{type(penalty_state).__name__}")
        if penalty_state.batch != hidden.shape[0] or penalty_state.ids.device != hidden.device:
            raise ValueError(f"flashsampling.sample: penalty_state must have B = {hidden.shape[0]} rows on "
                             f"{hidden.device}, got {penalty_state.batch} on {penalty_state.ids.device}")
    if repetition is None and frequency is None and presence is None:
        return None
    if penalty_state is None:
        raise ValueError("flashsampling.sample: penalties need the token history: penalty_state, or prompt_token_ids "
                         "/ output_token_ids")
    return Penalties(repetition, frequency, presence, penalty_state)


def model_logits(logits: Tensor, logit_scale: float, logit_softcap: float | None) -> Tensor:
    """Step 1 of the rule on fp32 raw logits ``[B, V]``, by ``torch.ops.flashsampling._model_logits``:
    the function the fused op applies in its epilogue (philox_gumbel.h's ``fs_model_logit``, with
    its own tanh), so the two routes transform the logits to the same bits."""
    if logit_scale == 1.0 and logit_softcap is None:
        return logits
    return torch.ops.flashsampling._model_logits(logits, logit_scale, logit_softcap)


def _local_ids(state: PenaltyState, vocab: int, vocab_start: int) -> tuple[Tensor, Tensor]:
    """(column of each slot's id in this vocabulary, ``vocab`` where out of it or free; in range)."""
    local = state.ids - vocab_start
    inside = (state.ids >= 0) & (local >= 0) & (local < vocab)
    return torch.where(inside, local, vocab), inside


def repetition_penalized(x: Tensor, penalties: Penalties, vocab_start: int) -> Tensor:
    """Step 3's repetition penalty on fp32 ``x [B, V]`` (a new tensor)."""
    if penalties.repetition is None:
        return x
    batch, vocab = x.shape
    column, inside = _local_ids(penalties.state, vocab, vocab_start)
    r = penalties.repetition
    # A host value as a [1, 1] tensor on x's device: CUDA divides a tensor by a host scalar as a
    # product with the scalar's reciprocal (ATen's div_true_kernel_cuda), which can differ from
    # the true division (fs_penalized_logit's, the fused op's) in the last bit.
    r = r[:, None] if isinstance(r, Tensor) else torch.full((1, 1), r, dtype=x.dtype, device=x.device)
    wide = torch.cat([x, x.new_zeros(batch, 1)], dim=1)  # a spare column for free slots
    seen = wide.gather(1, column)
    penalized = torch.where(seen > 0, seen / r, seen * r)
    return wide.scatter(1, column, torch.where(inside, penalized, seen))[:, :vocab]


def penalty_bias(penalties: Penalties) -> tuple[Tensor, Tensor] | None:
    """Step 3's ``q`` as sparse-bias entries: (global ids int64 ``[B, C]``, fp32 values ``[B, C]``),
    or None without frequency and presence penalties."""
    if penalties.frequency is None and penalties.presence is None:
        return None
    state = penalties.state
    counts = state.output_counts.float()
    q = torch.zeros_like(counts)
    if penalties.frequency is not None:
        f = penalties.frequency
        q = q + (f[:, None] if isinstance(f, Tensor) else f) * counts
    if penalties.presence is not None:
        p = penalties.presence
        q = q + (p[:, None] if isinstance(p, Tensor) else p) * (counts > 0).float()
    counted = (state.ids >= 0) & (state.output_counts > 0)  # prompt-only tokens get no entry
    return torch.where(counted, state.ids, -1), torch.where(counted, -q, 0.0)


def penalty_values(penalties: Penalties) -> Tensor:
    """float32 ``[B, C]``: what step 3 adds to each slot's logit, ``fl(0 + (-q))`` (the sum
    :func:`~.truncation.transformed_logits` forms of a sparse entry), ``-0.0`` for a slot with no
    entry (it leaves ``x`` as it is); torch ops (``flashsampling._penalty_values`` on CUDA)."""
    ids, values = penalty_bias(penalties)
    return torch.where(ids >= 0, values + 0.0, -0.0)


# The fused CUDA op gathers a row's seen-token bits in shared memory before the GEMM
# (csrc/kernels/reduce_candidates.cu, build_penalty_table_kernel): 4 bytes per 32 tokens of the
# shard, within the 227 KB a block may take on sm90 / sm100.
MAX_FUSED_PENALTY_VOCAB = 57344 * 32


def check_fused_penalty_vocab(vocab: int, device: torch.device) -> None:
    """ValueError naming the weight where the fused CUDA op cannot take the penalties of a
    vocabulary shard this large (the CPU op has no such bound)."""
    if device.type == "cuda" and vocab > MAX_FUSED_PENALTY_VOCAB:
        raise ValueError(f"flashsampling.sample: the penalties on CUDA take at most {MAX_FUSED_PENALTY_VOCAB} "
                         f"vocabulary rows per shard, weight has {vocab}; shard the vocabulary "
                         "(flashsampling_cuda.distributed) or pass the history as a sparse logit bias")


def fused_penalty_args(penalties: Penalties, batch: int) -> dict:
    """Step 3 as the fused op's arguments (``torch.ops.flashsampling.sample``'s ``penalty_ids``,
    ``penalty_values``, ``repetition_penalties``; csrc/torch/checks.h): the state's ids, what the
    logits route adds to each (``fl(0 + (-q))``, the sum :func:`~.truncation.transformed_logits`
    forms of a sparse entry; ``-0.0`` for an id with no entry, which leaves ``x`` as it is) and
    the per-row repetition penalty. No host sync; on CUDA the added values come from one kernel
    (``flashsampling._penalty_values``), elsewhere from :func:`penalty_values` (the same bits); the
    op turns them into its rank bitmap (csrc/kernels/reduce_candidates.cu)."""
    state = penalties.state
    args = {"penalty_ids": state.ids}
    if penalties.frequency is not None or penalties.presence is not None:
        if state.ids.is_cuda:
            f, p = penalties.frequency, penalties.presence
            args["penalty_values"] = torch.ops.flashsampling._penalty_values(
                state.ids, state.output_counts, frequency=None if isinstance(f, Tensor) else f,
                frequencies=f if isinstance(f, Tensor) else None, presence=None if isinstance(p, Tensor) else p,
                presences=p if isinstance(p, Tensor) else None)
        else:
            args["penalty_values"] = penalty_values(penalties)
    r = penalties.repetition
    if r is not None:
        args["repetition_penalties"] = (r if isinstance(r, Tensor)
                                        else torch.full((batch,), r, dtype=torch.float32, device=state.ids.device))
    return args


def rule_logits(logits: Tensor, logit_bias: Tensor | None, sparse_bias_ids: Tensor | None,
                sparse_bias_values: Tensor | None, vocab_start: int, scale: float, softcap: float | None,
                penalties: Penalties | None) -> Tensor:
    """Steps 1-3 of the rule on fp32 raw logits ``[B, V]``: ``x`` before the temperature."""
    x = transformed_logits(model_logits(logits, scale, softcap), logit_bias, sparse_bias_ids, sparse_bias_values,
                           vocab_start)
    if penalties is not None:
        x = repetition_penalized(x, penalties, vocab_start)
        entries = penalty_bias(penalties)
        if entries is not None:
            x = transformed_logits(x, None, *entries, vocab_start, distinct_ids=True)  # a state's ids are distinct
    return x


@torch.library.register_fake("flashsampling::_penalty_values")
def _penalty_values_fake(ids, output_counts, frequency=None, frequencies=None, presence=None, presences=None):
    return ids.new_empty(ids.shape, dtype=torch.float32)
