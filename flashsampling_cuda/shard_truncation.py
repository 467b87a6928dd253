"""The survivors of the global truncation (truncation.py's rule) of a vocabulary split into
shards that exchange only small collectives: each row's cut found by a radix search, exact,
with a fixed number of collectives and no host read of a device value (so a CUDA graph can
capture it).

Every token gets a 63-bit key of its place in the global truncation order (smaller first):
``(truncation_rank + 2^31) << 31 | global id``, the rank of ``y`` descending (an allowed NaN
after every number) with ties to the smaller global id; an excluded token gets ``_KEY_NONE``.
A row's survivors are then the tokens whose key is at most its cuts:

- ``top_k``: the k-th smallest allowed key;
- ``top_p``: the last key whose mass ahead has not reached ``top_p`` of the total (over the
  top_k survivors; ``"min_p_first"``: those that also pass min_p; ``"joint"``: every allowed
  token);
- ``min_p``: a test of each token's own ``y`` against the first token's (no search), as
  :func:`~flashsampling_cuda.truncation.keep_prefix` does it;

and the first token always survives. A cut key is found 8 bits a round from the top: every
shard histograms its keys within the range found so far (counts; for top_p also masses), one
all-reduce sums the histograms, and every shard picks the same bin. Eight rounds fix a key:
in torch ops ``top_k`` costs eight all-reduces of ``B * 256`` int64, ``top_p`` eight of
``B * 512``, the CUDA kernels eight of ``B * 768`` (below), and the first token one all-reduce
(min) of ``B`` int64 (on CUDA not for top_k alone, whose cut keeps the first token by itself).

Masses are the logits sampler's fixed point (csrc/kernels/logits_rows.cuh: fixed_mass,
top_p_reached): ``round(exp(fl32(y - y0)) * 2^41)`` as int64, whose sums are exact in any order,
so every rank and every split of the vocabulary keeps the same tokens, and the tokens the
single-process kernels keep (the float64 reference, ``survivor_mask``, sums in another order and
can differ only where a top_p boundary lies within rounding of ``top_p``). At most ``2^21``
tokens a row (the sums stay below ``2^63``).

Two implementations of one search: :func:`survivor_bitmask` on CUDA runs each round as one kernel
(csrc/kernels/key_search.cu: a CTA reads its chunk of a row's ``y`` once, or of ``x`` scaled by the
row's ``fl32(1 / T)`` as it loads, so that ``y`` need not be written; the next round's kernel
picks the bin from the summed histogram) and writes the survivors' bitmask. Its histograms carry
a third plane, the sum of each bin's keys, which is the key itself where the bin holds one: a row
whose chosen bin holds a single key has its cut, and its later rounds read nothing (a flat row's
top_k or top_p cut after three rounds, a peaked row's often sooner; the launches and all-reduces
stay, so the number of collectives does not depend on the data). :func:`sharded_survivors`
runs it in torch ops (the CPU, and the reference the tests hold the kernels to). Both take a
``reduce(t, how)`` that returns the reduction (``"sum"`` or ``"min"``) of ``t [S, ...]`` over every
shard of the group with the shape kept: in a process group ``S = 1`` and ``reduce`` is an
all-reduce (flashsampling_cuda/distributed.py); in one process over the whole rows it is the
identity (``sample_without_replacement``); the tests also run ``S`` shards in one process with a
sum over dimension 0.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .masks import pack_allowed_mask, unpack_allowed_mask
from .truncation import (_NAN_RANK, Truncation, key_of_rank, scaled_logits, survivor_mask, temperature_scales,
                         truncation_rank)
from .truncation import _per_row as per_row_parameter  # [B, 1]

__all__ = ["MAX_SHARDED_VOCAB", "Reduce", "order_keys", "sharded_survivors", "survivor_bitmask",
           "whole_row_survivors"]

Reduce = Callable[[Tensor, str], Tensor]

_KEY_NONE = 2**63 - 1  # an excluded token: after every allowed one
_DIGIT_BITS = 8
_BINS = 1 << _DIGIT_BITS
_ROUND_SHIFTS = tuple(range(56, -1, -_DIGIT_BITS))  # a key's 63 bits, the top digit first
_FIXED_ONE = 2.0**41  # logits_rows.cuh: kFixedOne
MAX_SHARDED_VOCAB = 1 << 21  # tokens a row: 2^21 masses of at most 2^41 sum below 2^63


def order_keys(y: Tensor, allowed: Tensor | None, ids: Tensor) -> Tensor:
    """int64 keys of the global truncation order (module docstring) of ``y`` (float32), where
    ``allowed`` (bool, or None: all) and ``ids`` (int64 global ids, broadcast to ``y``)."""
    rank = truncation_rank(y, allowed)
    return torch.where(rank < _NAN_RANK, ((rank + 2**31) << 31) | ids, _KEY_NONE)


def _first_y(first: Tensor) -> Tensor:
    """float32 ``y`` of the tokens whose keys are ``first`` (NaN for an allowed NaN and where the
    row allows nothing: ``_KEY_NONE``)."""
    return -key_of_rank((first >> 31) - 2**31)


def _fixed_masses(y: Tensor, y0: Tensor) -> Tensor:
    """int64 fixed-point ``exp(fl32(y - y0))`` (NaN ``y``: 0) of rows whose first ``y`` is
    ``y0 [S, B]``; 0 on rows whose ``y0`` is not finite (top_p then keeps the first token only,
    as the reference does)."""
    mass = torch.exp(y - y0[..., None])
    mass = torch.where(torch.isnan(y) | ~torch.isfinite(y0)[..., None], 0.0, mass)
    return (mass * _FIXED_ONE).round().to(torch.int64)


def _in_range(keys: Tensor, inside: Tensor, prefix: Tensor, shift: int) -> Tensor:
    """``inside`` narrowed to the keys whose bits above the digit at ``shift`` are ``prefix``."""
    if shift + _DIGIT_BITS >= 63:
        return inside
    return inside & ((keys >> (shift + _DIGIT_BITS)) == prefix[..., None])


def _histogram(digit: Tensor, values: Tensor) -> Tensor:
    """int64 ``[S, B, 256]`` sums of ``values`` per digit."""
    return torch.zeros(digit.shape[:-1] + (_BINS,), dtype=torch.int64, device=digit.device).scatter_add_(
        -1, digit, values)


def _kth_key(keys: Tensor, inside: Tensor, k: Tensor, reduce: Reduce) -> Tensor:
    """``[S, B]``: the ``k``-th smallest key (``k >= 1``) of ``inside``, ``_KEY_NONE`` where the
    row has fewer."""
    need = k
    prefix = torch.zeros_like(k)
    enough = None
    for shift in _ROUND_SHIFTS:
        digit = (keys >> shift) & (_BINS - 1)
        counts = reduce(_histogram(digit, _in_range(keys, inside, prefix, shift).long()), "sum")
        upto = counts.cumsum(-1)
        if enough is None:
            enough = upto[..., -1] >= need
        # the first bin whose count up to it reaches `need`; what lies in earlier bins is ahead
        bin_ = (upto < need[..., None]).sum(-1).clamp(max=_BINS - 1)
        need = need - (upto - counts).gather(-1, bin_[..., None])[..., 0]
        prefix = (prefix << _DIGIT_BITS) | bin_
    return torch.where(enough, prefix, _KEY_NONE)


def _top_p_key(keys: Tensor, inside: Tensor, masses: Tensor, top_p: Tensor, reduce: Reduce) -> tuple[Tensor, Tensor]:
    """``([S, B] key, found)``: the last key of ``inside`` whose mass ahead (the ``masses`` of the
    ``inside`` keys before it) is below ``top_p`` of their total (top_p_reached's test on the
    same integers); not found where no key is (``top_p <= 0`` or NaN, a total of 0)."""
    prefix = torch.zeros(keys.shape[:-1], dtype=torch.int64, device=keys.device)
    ahead = torch.zeros_like(prefix)  # the mass of the inside keys below the range
    total = found = None
    bins = torch.arange(1, _BINS + 1, device=keys.device)
    for shift in _ROUND_SHIFTS:
        digit = (keys >> shift) & (_BINS - 1)
        in_range = _in_range(keys, inside, prefix, shift)
        hist = reduce(torch.stack([_histogram(digit, in_range.long()),
                                   _histogram(digit, torch.where(in_range, masses, 0))], dim=-2), "sum")
        counts, mass = hist.unbind(-2)
        if total is None:
            total = mass.sum(-1)
        before = ahead[..., None] + mass.cumsum(-1) - mass  # the mass ahead of each bin's first key
        survives = (counts > 0) & (before.double() / total[..., None].double() < top_p[..., None])
        last = (survives * bins).amax(-1)  # 1 + the last bin holding a survivor, 0 for none
        if found is None:
            found = last > 0
        bin_ = (last - 1).clamp(min=0)
        ahead = before.gather(-1, bin_[..., None])[..., 0]
        prefix = (prefix << _DIGIT_BITS) | bin_
    return prefix, found


def _per_row(value, rows: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A truncation parameter (host scalar, 0-d or ``[B]`` tensor) as ``rows``-shaped ``dtype``
    (``rows`` ends with ``B``)."""
    return per_row_parameter(value, rows[-1], dtype, device)[:, 0].expand(rows)


def sharded_survivors(y: Tensor, allowed: Tensor | None, ids: Tensor, truncation: Truncation, order: str,
                      reduce: Reduce) -> Tensor:
    """bool ``[S, B, V_s]``: which of the shards' tokens survive the global truncation
    (truncation.py's rule, ``order`` as for ``keep_prefix``; module docstring for the masses).

    Args:
        y: float32 ``[S, B, V_s]`` transformed logits of each shard's tokens.
        allowed: bool ``[S, B, V_s]`` or None (all); a padding column is a token not allowed.
        ids: int64 global ids of the columns, broadcast to ``y`` (``[S, 1, V_s]`` or ``[V_s]``).
        truncation: the parameters (host scalars or 0-d / ``[B]`` tensors), the same everywhere.
        order: ``"top_k_first"``, ``"min_p_first"`` or ``"joint"``.
        reduce: the reduction over every shard (module docstring).
    """
    keys = order_keys(y, allowed, ids)
    rows = keys.shape[:-1]
    device = keys.device
    valid = keys != _KEY_NONE
    first = reduce(keys.amin(dim=-1), "min")
    is_first = keys == first[..., None]
    keep = valid
    if truncation.top_k is not None:
        k = _per_row(truncation.top_k, rows, torch.int64, device)
        cut = torch.where(k > 0, _kth_key(keys, valid, k.clamp(min=1), reduce), _KEY_NONE)
        keep = keep & (keys <= cut[..., None])
    y0 = _first_y(first)
    if truncation.min_p is not None:
        min_p = _per_row(truncation.min_p, rows, torch.float64, device)
        y64 = torch.where(torch.isnan(y), -torch.inf, y.double())
        passes_min_p = (torch.exp(y64 - y0.double()[..., None]) >= min_p[..., None]) | is_first
    if truncation.top_p is not None:
        top_p = _per_row(truncation.top_p, rows, torch.float64, device)
        masses = _fixed_masses(y, y0)
        if order == "min_p_first" and truncation.min_p is not None:
            masses = torch.where(passes_min_p, masses, 0)
        cut, found = _top_p_key(keys, valid if order == "joint" else keep, masses, top_p, reduce)
        cut = torch.where(top_p >= 1, _KEY_NONE, torch.where(found, cut, first))
        keep = keep & (keys <= cut[..., None])
    if truncation.min_p is not None:
        keep = keep & passes_min_p
    return keep


def _search_rounds(y: Tensor, allowed_mask: Tensor | None, vocab_start: int, target: Tensor, reduce: Reduce,
                   **extra) -> tuple[Tensor, Tensor]:
    """``([B] key, found)`` of one search (:func:`_kth_key` for an int64 ``target``,
    :func:`_top_p_key` for a float64 one) by ``torch.ops.flashsampling._order_key_round``: a kernel
    and an all-reduce of ``[B, 3, 256]`` int64 a round (counts, masses, sums of keys), then the
    choice from the last histogram; ``state [B, 5]``: the key (bits so far), need or mass ahead,
    total, found, complete (key_search.h)."""
    state = hist = None
    for shift in _ROUND_SHIFTS + (-_DIGIT_BITS,):
        state, local = torch.ops.flashsampling._order_key_round(y, allowed_mask, vocab_start, shift, target, state,
                                                                hist, **extra)
        if shift >= 0:
            hist = reduce(local[None], "sum")[0]
    return state[:, 0], state[:, 3] == 1


def survivor_bitmask(y: Tensor, allowed_mask: Tensor | None, vocab_start: int, truncation: Truncation, order: str,
                     reduce: Reduce, row_scales: Tensor | None = None) -> Tensor:
    """int32 ``[B, ceil(V / 32)]`` bitmask of this shard's survivors of the global truncation, the
    survivors of :func:`sharded_survivors` by the CUDA kernels (``S = 1``).

    Args:
        y: float32 ``[B, V]`` CUDA tensor, unit stride along ``V``: this shard's transformed logits,
            or with ``row_scales`` its logits ``x`` before the temperature.
        allowed_mask: int32 ``[B, ceil(V / 32)]`` bitmask of the allowed tokens, or None (all).
        vocab_start: global id of column 0.
        truncation, order, reduce: as for :func:`sharded_survivors`.
        row_scales: float32 ``[B]`` on ``y``'s device (``truncation.temperature_scales``): the
            kernels take the transformed logits as ``fl32(y * row_scales[b])``, so that the
            caller need not write them; None: ``y`` holds the transformed logits.
    """
    ops = torch.ops.flashsampling
    batch = y.shape[0]
    device = y.device
    rows = (batch,)
    cut = torch.full(rows, _KEY_NONE, dtype=torch.int64, device=device)
    if truncation.top_k is not None:
        k = _per_row(truncation.top_k, rows, torch.int64, device)
        key, found = _search_rounds(y, allowed_mask, vocab_start, k.clamp(min=1).contiguous(), reduce,
                                    row_scales=row_scales)
        cut = torch.where((k > 0) & found, key, _KEY_NONE)
    if truncation.top_p is None and truncation.min_p is None:
        # top_k alone keeps its first key by itself, and the mask reads first and y0 only for
        # min_p: no pass and no all-reduce for them
        return ops._order_key_cut_mask(y, allowed_mask, vocab_start, cut, row_scales=row_scales)
    first = reduce(ops._first_order_keys(y, allowed_mask, vocab_start, row_scales=row_scales)[None], "min")[0]
    y0 = _first_y(first)
    min_ps = None
    if truncation.min_p is not None:
        min_ps = _per_row(truncation.min_p, rows, torch.float64, device).contiguous()
    if truncation.top_p is not None:
        top_p = _per_row(truncation.top_p, rows, torch.float64, device).contiguous()
        filtered = order == "min_p_first" and min_ps is not None
        key, found = _search_rounds(y, allowed_mask, vocab_start, top_p, reduce,
                                    limit=None if order == "joint" else cut, y0=y0,
                                    min_ps=min_ps if filtered else None, first=first if filtered else None,
                                    row_scales=row_scales)
        cut = torch.minimum(cut, torch.where(top_p >= 1, _KEY_NONE, torch.where(found, key, first)))
    return ops._order_key_cut_mask(y, allowed_mask, vocab_start, cut, first, y0, min_ps, row_scales=row_scales)


def whole_row_survivors(x: Tensor, allowed_mask: Tensor | None, vocab_start: int, truncation: Truncation, order: str,
                        temperature: float, temperatures: Tensor | None) -> Tensor:
    """int32 ``[B, ceil(V / 32)]`` bitmask of the survivors of whole rows (no shards, nothing to
    reduce) of fp32 logits ``x`` before the temperature (``temperature`` / ``temperatures`` as the
    op takes them), within ``allowed_mask``: on CUDA :func:`survivor_bitmask`'s kernels (the logits
    sampler's fixed-point masses), elsewhere and beyond ``MAX_SHARDED_VOCAB`` the float64
    ``survivor_mask`` of ``y = x / T``."""
    batch, vocab = x.shape
    if x.is_cuda and vocab <= MAX_SHARDED_VOCAB:
        scales = temperature_scales(batch, temperature, temperatures, x.device)
        return survivor_bitmask(x, allowed_mask, vocab_start, truncation, order, lambda t, how: t, scales)
    allowed = None if allowed_mask is None else unpack_allowed_mask(allowed_mask, vocab)
    return pack_allowed_mask(survivor_mask(scaled_logits(x, temperature, temperatures), allowed, truncation, order))


@torch.library.register_fake("flashsampling::_first_order_keys")
def _first_order_keys_fake(y, allowed_mask, vocab_start, row_scales=None):
    return y.new_empty((y.shape[0],), dtype=torch.int64)


@torch.library.register_fake("flashsampling::_order_key_round")
def _order_key_round_fake(y, allowed_mask, vocab_start, shift, target, state, hist, limit=None, y0=None,
                          min_ps=None, first=None, row_scales=None):
    histogram = (y.shape[0], 3, _BINS) if shift >= 0 else (0,)
    return y.new_empty((y.shape[0], 5), dtype=torch.int64), y.new_empty(histogram, dtype=torch.int64)


@torch.library.register_fake("flashsampling::_order_key_cut_mask")
def _order_key_cut_mask_fake(y, allowed_mask, vocab_start, cut, first=None, y0=None, min_ps=None, row_scales=None):
    return y.new_empty((y.shape[0], (y.shape[1] + 31) // 32), dtype=torch.int32)
