r"""Grouped and online Group-Gumbel-Max: sample from a vocabulary that arrives in groups.

The vocabulary is split into disjoint groups ``G_1 .. G_K`` (chunks of a streamed
vocabulary, shards on devices that cannot talk to each other, ...). Each group is
summarised on its own by a :class:`GroupSample`: an exact sample ``i_k`` of
``softmax(y)`` restricted to the group and its log-mass ``L_k = logsumexp_{v in G_k} y_v``
(``y = logits / T``). The summaries then merge exactly (paper §D.1, Algorithms I.2/I.3):

* **parallel** (:func:`merge_parallel`): pick group ``k`` with probability
  ``exp(L_k - L)``, ``L = logsumexp_k L_k`` (a Gumbel-max over the ``K`` log-masses), and
  return ``i_k``;
* **online** (:func:`merge_online`, :class:`OnlineMerge`): keep a running log-mass ``L``
  and a running sample; group ``k`` updates ``L_new = logaddexp(L, L_k)`` and replaces the
  running sample by ``i_k`` with probability ``exp(L_k - L_new)``.

Both give ``P(token = v) = exp(y_v - L)``, the softmax over the union, *in distribution*:
unlike the tensor-parallel sampler (:mod:`flashsampling_cuda.distributed`), which takes the
max of globally keyed Gumbel scores and so reproduces the single-process token path by
path, the merges draw fresh randomness (from ``generator``) to choose the group. They
need only the ``(sample, log-mass)`` of each group, never its scores, so groups can be
sampled with unrelated seeds, at different times, on different devices. An empty group
(``L_k = -inf``: no allowed token, or no tokens at all) is never chosen; if every group
is empty the merged token is ``-1`` with ``log_mass = -inf``.

Each row and each of the ``S`` samples is merged independently. Group summaries:

* :func:`group_sample_logits` from a ``[B, V_k]`` block of logits (pure PyTorch);
* :func:`group_sample` from ``(hidden, weight_k)`` with the fused op, without
  materialising the group's logits (``sample_with_scores(return_logprobs=True)``).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import torch
from torch import Tensor

from .sampling import sample_with_scores

__all__ = ["GroupSample", "OnlineMerge", "group_sample", "group_sample_logits", "merge_online", "merge_parallel"]


class GroupSample(NamedTuple):
    """Summary of one group (or of a merged union of groups), for ``B`` rows and ``S``
    samples per row.

    tokens: int64 ``[B, S]``, global vocabulary ids of exact samples of ``softmax(y)``
        over the group's allowed tokens; ``-1`` where the group allows nothing.
    log_mass: float32 ``[B]``, ``logsumexp(y)`` over the group's allowed tokens
        (``-inf`` for an empty group).
    token_logprobs: float32 ``[B, S]``, ``y[token] - log_mass``: the token's
        log-probability within the group (after a merge: within the union); NaN where
        the token is ``-1``.
    """

    tokens: Tensor
    log_mass: Tensor
    token_logprobs: Tensor


def _positive_temperature(temperature: float | Tensor, batch: int, device: torch.device) -> Tensor:
    """float64 [B] temperatures; every one must be finite and > 0 (reads a tensor)."""
    t = torch.as_tensor(temperature, dtype=torch.float64, device=device).expand(batch)
    if not bool(((t > 0) & t.isfinite()).all()):
        raise ValueError(
            "flashsampling.grouped: temperature must be finite and > 0 (greedy rows have no log-mass to "
            "merge; take the max of the group maxima instead)"
        )
    return t


def group_sample_logits(
    logits: Tensor,
    *,
    vocab_start: int = 0,
    temperature: float | Tensor = 1.0,
    num_samples: int = 1,
    allowed: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> GroupSample:
    """Summarise one group given its logits: ``S`` exact samples and the log-mass.

    Args:
        logits: ``[B, V_k]`` floating logits of global vocabulary ids
            ``[vocab_start, vocab_start + V_k)``; ``V_k = 0`` is an empty group.
        vocab_start: global id of column 0 (returned tokens are global ids).
        temperature: float or ``[B]`` tensor, finite and ``> 0``; ``y = logits / T``
            in float64.
        num_samples: samples per row, ``S >= 1``.
        allowed: optional bool ``[B, V_k]``; False excludes a token (a row with no True
            is empty: token ``-1``, ``log_mass = -inf``).
        generator: source of the within-group Gumbel noise (float64 uniforms; memory
            O(B * V_k) per block of samples).

    Returns:
        :class:`GroupSample` on ``logits``' device.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [B, V_k] tensor, got {logits.dtype} {list(logits.shape)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    batch, width = logits.shape
    device = logits.device
    temps = _positive_temperature(temperature, batch, device)
    y = logits.double() / temps[:, None]
    if allowed is not None:
        if allowed.shape != logits.shape or allowed.dtype != torch.bool:
            raise ValueError(f"allowed must be a bool tensor of shape {list(logits.shape)}")
        y = y.masked_fill(~allowed, -torch.inf)
    if width == 0:
        empty = torch.full((batch, num_samples), -1, dtype=torch.int64, device=device)
        nan = torch.full((batch, num_samples), torch.nan, dtype=torch.float32, device=device)
        return GroupSample(empty, torch.full((batch,), -torch.inf, device=device), nan)
    log_mass = torch.logsumexp(y, dim=1)  # [B], -inf for an empty row
    local = torch.empty((batch, num_samples), dtype=torch.int64, device=device)
    step = max(1, (1 << 22) // max(batch * width, 1))  # samples per block of noise
    for s0 in range(0, num_samples, step):
        n = min(step, num_samples - s0)
        u = torch.rand((batch, n, width), dtype=torch.float64, device=device, generator=generator)
        gumbel = -torch.log(-torch.log(u))  # u == 0 (p = 2^-53) gives -inf: that token loses
        local[:, s0 : s0 + n] = (y[:, None, :] + gumbel).argmax(dim=2)
    empty_row = (log_mass == -torch.inf)[:, None]
    tokens = torch.where(empty_row, -1, local + vocab_start)
    logprobs = torch.where(empty_row, torch.nan, y.gather(1, local) - log_mass[:, None])
    return GroupSample(tokens, log_mass.float(), logprobs.float())


def group_sample(
    hidden: Tensor,
    weight: Tensor,
    *,
    vocab_start: int = 0,
    temperature: float | Tensor = 1.0,
    num_samples: int = 1,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    generator: torch.Generator | None = None,
    **controls,
) -> GroupSample:
    """Summarise one group ``weight [V_k, D]`` (global ids ``[vocab_start, vocab_start +
    V_k)``) with the fused op, without materialising its logits.

    Calls :func:`flashsampling_cuda.sample_with_scores` (``return_logprobs=True``,
    ``vocab_start=vocab_start``, and ``empty_mask_token=-1`` with a mask, so a group may
    allow nothing): tokens are the op's samples, ``log_mass`` its logsumexp,
    ``token_logprobs`` its log-probabilities. ``controls`` are that function's other
    keyword arguments for this group: ``logit_bias [V_k]``, ``sparse_logit_bias`` (global
    ids), ``allowed_mask`` (int32 ``[B, ceil(V_k / 32)]`` or bool ``[B, V_k]``).

    The noise is keyed by the global id, so groups sampled with the same ``(seed,
    offset)`` are independent (disjoint ids) and the merged token is exact; so are groups
    sampled with different seeds. ``temperature`` must be > 0 (float or ``[B]``).
    """
    if isinstance(temperature, Tensor):
        _positive_temperature(temperature, hidden.shape[0], temperature.device)
    else:
        _positive_temperature(float(temperature), 1, torch.device("cpu"))
    tokens, _, logprobs, lse = sample_with_scores(
        hidden,
        weight,
        temperature=temperature,
        seed=seed,
        offset=offset,
        generator=generator,
        num_samples=num_samples,
        empty_mask_token=-1 if controls.get("allowed_mask") is not None else None,
        vocab_start=vocab_start,
        return_logprobs=True,
        **controls,
    )
    return GroupSample(tokens, lse, logprobs)


def _gumbel64(shape, device, generator) -> Tensor:
    u = torch.rand(shape, dtype=torch.float64, device=device, generator=generator)
    return -torch.log(-torch.log(u))


def merge_parallel(groups: Sequence[GroupSample], *, generator: torch.Generator | None = None) -> GroupSample:
    """Parallel Group-Gumbel-Max: merge the summaries of disjoint groups at once.

    For every row ``b`` and sample ``s`` independently, group ``k`` is chosen with
    probability ``exp(L_k - L)`` (``argmax_k L_k + Gumbel``, float64, from ``generator``)
    and its token returned. ``groups``: ``K >= 1`` :class:`GroupSample` of the same
    ``B``, ``S`` and device. Returns the union's :class:`GroupSample` (``log_mass = L``,
    ``token_logprobs`` relative to the union).
    """
    if len(groups) == 0:
        raise ValueError("merge_parallel needs at least one group")
    tokens = torch.stack([g.tokens for g in groups])  # [K, B, S]
    masses = torch.stack([g.log_mass for g in groups]).double()  # [K, B]
    logprobs = torch.stack([g.token_logprobs for g in groups]).double()  # [K, B, S]
    total = torch.logsumexp(masses, dim=0)  # [B]
    choice = (masses[:, :, None] + _gumbel64(tokens.shape, tokens.device, generator)).argmax(dim=0)  # [B, S]
    batch = tokens.shape[1]
    rows = torch.arange(batch, device=tokens.device)[:, None]
    chosen_mass = masses[choice, rows]  # [B, S]
    out_tokens = tokens.gather(0, choice[None]).squeeze(0)
    out_logprobs = logprobs.gather(0, choice[None]).squeeze(0) + chosen_mass - total[:, None]
    empty = (total == -torch.inf)[:, None]
    out_tokens = torch.where(empty, -1, out_tokens)
    out_logprobs = torch.where(empty, torch.nan, out_logprobs)
    return GroupSample(out_tokens, total.float(), out_logprobs.float())


class OnlineMerge:
    """Online Group-Gumbel-Max: fold group summaries in one at a time, in O(B * S) state.

    ::

        merge = OnlineMerge(generator=g)
        for chunk_start in range(0, V, chunk):
            merge.update(group_sample(hidden, weight[chunk_start:chunk_start + chunk],
                                      vocab_start=chunk_start, seed=seed))
        tokens = merge.result().tokens

    ``update`` keeps the running log-mass ``L`` (float64) and replaces each running
    sample by the group's with probability ``exp(L_k - logaddexp(L, L_k))`` (a float64
    uniform from ``generator``). After any number of updates the running sample is an
    exact sample of the softmax over the union of the groups seen.
    """

    def __init__(self, *, generator: torch.Generator | None = None):
        self.generator = generator
        self._mass: Tensor | None = None  # float64 [B]
        self._tokens: Tensor | None = None  # int64 [B, S]
        self._y: Tensor | None = None  # float64 [B, S]: y of the running token

    def update(self, group: GroupSample) -> "OnlineMerge":
        if self._mass is None:
            self._mass = torch.full_like(group.log_mass, -torch.inf, dtype=torch.float64)
            self._tokens = torch.full_like(group.tokens, -1)
            self._y = torch.full_like(group.tokens, torch.nan, dtype=torch.float64)
        elif group.tokens.shape != self._tokens.shape:
            raise ValueError(f"group of shape {list(group.tokens.shape)} after {list(self._tokens.shape)}")
        mass_k = group.log_mass.double()
        new_mass = torch.logaddexp(self._mass, mass_k)
        # log P(replace) = L_k - L_new: -inf for an empty group, NaN (never) while all are empty.
        log_p = (mass_k - new_mass)[:, None]
        u = torch.rand(group.tokens.shape, dtype=torch.float64, device=group.tokens.device, generator=self.generator)
        replace = torch.log(u) < log_p
        self._tokens = torch.where(replace, group.tokens, self._tokens)
        self._y = torch.where(replace, group.token_logprobs.double() + mass_k[:, None], self._y)
        self._mass = new_mass
        return self

    def result(self) -> GroupSample:
        """The merged :class:`GroupSample` of the groups seen so far."""
        if self._mass is None:
            raise ValueError("OnlineMerge.result() before any update()")
        logprobs = torch.where(self._tokens < 0, torch.nan, self._y - self._mass[:, None])
        return GroupSample(self._tokens.clone(), self._mass.float(), logprobs.float())


def merge_online(groups: Iterable[GroupSample], *, generator: torch.Generator | None = None) -> GroupSample:
    """Online Group-Gumbel-Max over an iterable of group summaries (see :class:`OnlineMerge`);
    the groups may be produced lazily, one at a time."""
    merge = OnlineMerge(generator=generator)
    for group in groups:
        merge.update(group)
    return merge.result()
