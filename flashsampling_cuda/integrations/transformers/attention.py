"""The decode steps' attention: grouped-query attention of a one-token query on the static
cache, without transformers' per-layer copy of the cache to every query head.

:func:`_grouped_decode_sdpa` is registered with transformers' ``AttentionInterface`` under a
name of its own (:data:`_GROUPED_DECODE_SDPA`); the decoder switches its decode steps to it
(``StaticCacheDecoder(grouped_decode_attention=True)``) and leaves the prefill and the model
outside the decoder on sdpa.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

def _grouped_decode_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs) -> tuple[Tensor, None]:
    """transformers' ``sdpa`` attention for a one-token query without the K/V copy.

    With a mask, transformers' sdpa path cannot use ``enable_gqa`` on CUDA (masked GQA falls
    back to the math kernel), so it expands the whole cache ``[B, kv_heads, L, d]`` to
    ``[B, heads, L, d]`` (``repeat_kv``) in every layer of every step, and the kernel then reads
    that copy: traffic that grows with B and the cache length. For a single query token the
    ``group`` query heads that share a KV head are instead stacked as ``group`` query rows of
    that head, ``[B, kv_heads, group, d]`` against the un-repeated cache, under the same mask
    (broadcast over the rows): the same scores and outputs per head (head ``h`` reads KV head
    ``h // group``, as in ``repeat_kv``). Anything else goes to transformers' sdpa function.
    """
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] != 1 or groups == 1 or dropout or attention_mask is None or attention_mask.dim() != 4
            or attention_mask.shape[1] != 1 or attention_mask.shape[2] != 1
            or any(kwargs.get(k) is not None for k in ("softcap", "position_bias", "s_aux", "sinks"))
            or kwargs.get("output_attentions", False)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    batch, heads, _, dim = query.shape
    grouped_query = query.reshape(batch, heads // groups, groups, dim)
    if (query.is_cuda and attention_mask.dtype == torch.bool and _BMM_TAKES_OUT_DTYPE
            and torch.compiler.is_compiling()):  # compiled: the scale, mask and softmax fuse into one kernel
        out = _grouped_decode_matmul_attention(grouped_query, key, value, attention_mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped_query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]).contiguous(), None


# aten::bmm.dtype: bf16/fp16 operands, fp32 output (CUDA).
_BMM_TAKES_OUT_DTYPE = hasattr(torch.ops.aten.bmm, "dtype")


def _grouped_decode_matmul_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor,
                                     scaling: float | None) -> Tensor:
    """Attention of ``query [B, H_kv, G, d]`` over ``key``/``value [B, H_kv, L, d]`` under the
    boolean ``mask [B, 1, 1, L]``, as two batched GEMMs and a float32 softmax.

    For a one-token step the G query rows per KV head are a handful against the cache's L
    slots; the fused sdpa kernels run a prefill-sized tile for them, which takes longer than
    these two small GEMMs once compiled (docs/benchmarking.md, decode). Scores are
    accumulated and kept in float32 (``out_dtype``), the probabilities enter the value GEMM in
    the cache's dtype, as the fused kernels do."""
    batch, kv_heads, rows, dim = query.shape
    length, value_dim = key.shape[2], value.shape[-1]
    scale = dim ** -0.5 if scaling is None else scaling
    scores = torch.bmm(query.reshape(batch * kv_heads, rows, dim),
                       key.reshape(batch * kv_heads, length, dim).transpose(1, 2), out_dtype=torch.float32)
    scores = (scores.view(batch, kv_heads, rows, length) * scale).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.bmm(probs.view(batch * kv_heads, rows, length), value.reshape(batch * kv_heads, length, value_dim))
    return out.view(batch, kv_heads, rows, value_dim)


# Registered under a name of its own (nothing else changes); the decoder selects it for its
# decode steps only (StaticCacheDecoder(grouped_decode_attention=True)). None where this
# transformers version lacks the pieces: the steps then keep the model's sdpa attention.
try:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    _GROUPED_DECODE_SDPA: str | None = "flashsampling_grouped_decode_sdpa"
    AttentionInterface.register(_GROUPED_DECODE_SDPA, _grouped_decode_sdpa)
    AttentionMaskInterface.register(_GROUPED_DECODE_SDPA, sdpa_mask)  # unused: the decoder passes 4-D masks
except ImportError:  # pragma: no cover
    _GROUPED_DECODE_SDPA = None
