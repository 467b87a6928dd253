"""The allowed-token bitmask of the op (xgrammar's layout) and its bool form.

Token ``v`` (local: row ``v`` of ``weight``) is allowed when bit ``v & 31`` of int32 word
``v >> 5`` of its row is set; bits past ``V`` are ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["pack_allowed_mask", "unpack_allowed_mask", "int32_words"]


def int32_words(bits: Tensor) -> Tensor:
    """int32 words with the bits of int64 values in ``[0, 2^32)`` (the op's mask words; with
    ``.view(torch.float32)``, floats of given bit patterns)."""
    return ((bits + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack_allowed_mask(mask: Tensor) -> Tensor:
    """Packs a bool ``[B, V]`` allowed-token mask (True = allowed) into the int32
    ``[B, ceil(V / 32)]`` bitmask the op takes (xgrammar's layout: token ``v`` is bit
    ``v & 31`` of word ``v >> 5``), on the mask's device."""
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(
            f"flashsampling.sample: allowed_mask to pack must be a bool [B, V] tensor, got {mask.dtype} "
            f"of shape {list(mask.shape)}"
        )
    batch, vocab = mask.shape
    words = (vocab + 31) // 32
    bits = F.pad(mask.to(torch.uint8), (0, words * 32 - vocab)).view(batch, words * 4, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    packed_bytes = (bits << shifts).sum(dim=-1, dtype=torch.uint8)  # little-endian bytes of each word
    return packed_bytes.view(torch.int32)


def unpack_allowed_mask(mask: Tensor, vocab: int) -> Tensor:
    """bool ``[B, vocab]`` (True = allowed) of an int32 ``[B, ceil(vocab / 32)]`` bitmask,
    on the mask's device; the inverse of :func:`pack_allowed_mask`."""
    v = torch.arange(vocab, device=mask.device)
    # An arithmetic shift keeps bit 31's value in bit 0 as well: `& 1` reads any bit.
    return ((mask[:, v >> 5] >> (v & 31)) & 1).bool()
