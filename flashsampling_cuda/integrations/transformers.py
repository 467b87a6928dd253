"""Decode Hugging Face causal LMs with FlashSampling.

The standard decode step of a ``transformers`` causal LM ends with ``logits =
lm_head(hidden)``, the logits processors (temperature, ...) and ``torch.multinomial``
over ``softmax(logits / T)``. Here the body of the model runs as usual and the last
hidden state (the output of the model's final norm) goes straight to
:func:`flashsampling_cuda.sample` with ``lm_head.weight``: the same categorical
distribution, sampled exactly with the Gumbel-Max trick, without writing the logits.

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2,
Qwen3, Gemma, Gemma 2, Gemma 3 text), tied or untied embeddings, a plain
``torch.nn.Linear`` head (a bias goes in as the op's ``logit_bias`` where the installed
op has that argument), ``attn_implementation`` ``"sdpa"`` or ``"eager"``. Refused, with
:class:`UnsupportedModelError`: final-logit soft-capping (Gemma 2/3's
``final_logit_softcapping``: ``cap * tanh(logits / cap)`` is not applied by the op, so
its samples would not follow the model's distribution), logit scaling configs
(``logit_scale``, ``logits_scaling``), quantized, vocab-parallel (DTensor) or wrapped
heads, sliding-window attention beyond its window, other model types.

``top_k``, ``top_p`` and ``min_p`` go to the op (its exact materialise-then-mask path,
README "Top-k, top-p, min-p"). Not supported: repetition penalties and other logits
processors.

Decoding runs on a static KV cache with fixed-shape buffers and no host
synchronisation inside a step, so on CUDA one decode step (body + sampling + stop
bookkeeping) is captured once as a CUDA graph and replayed; seeds and offsets are
device tensors the op reads at run time. With ``attn_implementation="sdpa"`` the decode
steps' attention reads the static cache in place, without transformers' per-layer copy of it to
every query head (``grouped_decode_attention``). :func:`fuse_projections` (opt-in, it edits
the model in place) runs each layer's q/k/v and gate/up projections as one GEMM per group.
Step ``t`` (``t = 0`` is the token sampled from the prompt) draws noise at ``offset + t``,
so with a fixed ``seed`` the tokens are a pure function of the prompt: for every step, the
token equals
``argmax_v(logit[v] / T + g(seed, offset + t, stream, 0, v))`` of the model's own logits
(:func:`reference_generate` is that reference, on the model's standard forward), up to
near ties of fp32/bf16 rounding.

This module imports ``transformers`` (>= 5.0) on import; ``import flashsampling_cuda``
does not.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch import Tensor

try:
    import transformers as _transformers
    from transformers.cache_utils import Cache, DynamicCache, StaticCache, StaticLayer
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise ModuleNotFoundError(
        "flashsampling_cuda.integrations.transformers needs the optional dependency "
        "`transformers` (>= 5.0): pip install 'flashsampling-cuda[transformers]'",
        name="transformers",
    ) from _exc

if int(_transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise ImportError(
        "flashsampling_cuda.integrations.transformers needs transformers >= 5.0, found "
        f"{_transformers.__version__}: pip install -U 'transformers>=5.0'"
    )

from ..noise import as_int64_tensor, gumbel_noise
from ..sampling import sample as _fs_sample

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedModelError",
    "FlashSamplingHead",
    "StaticCacheDecoder",
    "FlashSamplingDecoder",
    "fuse_projections",
    "DecodeOutput",
    "ReferenceDecodeOutput",
    "generate",
    "reference_generate",
    "reference_sample_from_logits",
    "logits_rtol",
]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
_MASK_KINDS = {"sdpa": "bool", "eager": "additive"}

# A sampler maps (hidden [B, D], seed tensor, offset tensor) to tokens [B] or [B, 1].
Sampler = Callable[[Tensor, Tensor, Tensor], Tensor]


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
    slots; the fused sdpa kernels run a prefill-sized tile for them (~14 us per layer on an
    H100 at the Qwen3-1.7B shape and B = 1, against ~9 us here, compiled). Scores are
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
    from transformers import AttentionInterface, AttentionMaskInterface, PretrainedConfig
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    _GROUPED_DECODE_SDPA: str | None = "flashsampling_grouped_decode_sdpa"
    AttentionInterface.register(_GROUPED_DECODE_SDPA, _grouped_decode_sdpa)
    AttentionMaskInterface.register(_GROUPED_DECODE_SDPA, sdpa_mask)  # unused: the decoder passes 4-D masks
except ImportError:  # pragma: no cover
    _GROUPED_DECODE_SDPA = None


class _ProjectionGroup:
    """Linears that read the same input, computed as one GEMM over their weights stacked along
    the output dimension (q/k/v of an attention layer, gate/up of an MLP).

    A decode step's projections are skinny GEMMs (B rows): each is bound by streaming its
    weight, and a small one (k_proj, v_proj: 1024 outputs) leaves most SMs idle. One GEMM over
    the stacked weight streams the same bytes with more blocks and fewer launches. The members'
    parameters stay the model's parameters (same objects, names and values); their storage
    becomes a slice of the stacked weight, so in-place updates (``load_state_dict``,
    ``param.data.copy_``) reach the fused GEMM. Where that no longer holds (:meth:`fusable`),
    every member computes its own GEMM again (:class:`_GroupedLinear`).
    """

    def __init__(self, linears: Sequence[nn.Linear]):
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            has_bias = linears[0].bias is not None
            self.bias = torch.cat([lin.bias for lin in linears]) if has_bias else None
        self.linears = list(linears)
        self.members, self.pointers, self.splits, start = [], [], [], 0
        for index, lin in enumerate(linears):
            end = start + lin.out_features
            lin.weight.data = self.weight[start:end]
            if has_bias:
                lin.bias.data = self.bias[start:end]
            self.members.append((lin.weight, lin.bias))
            self.pointers.append((lin.weight.data_ptr(), lin.bias.data_ptr() if has_bias else 0))
            self.splits.append(lin.out_features)
            lin.__class__ = _GroupedLinear
            lin._fs_group, lin._fs_index = self, index
            start = end
        self.pending_input: Tensor | None = None  # set by member 0, taken by the others
        self.pending_outputs: list[Tensor | None] = []

    def fusable(self) -> bool:
        """Whether the stacked GEMM computes what the members' own parameters would: every
        member still holds the parameter objects recorded here, with the stacked tensors'
        dtype and device (``module.to(...)`` moves a parameter's data) and, outside
        torch.compile, on their very storage (a ``.data`` assignment moves it); and no gradient
        is being recorded for them (autograd does not know the stacked tensors)."""
        grad = torch.is_grad_enabled()
        compiling = torch.compiler.is_compiling()
        for lin, (weight, bias), (weight_ptr, bias_ptr) in zip(self.linears, self.members, self.pointers):
            if lin.weight is not weight or lin.bias is not bias:
                return False
            if weight.dtype != self.weight.dtype or weight.device != self.weight.device:
                return False
            if grad and (weight.requires_grad or (bias is not None and bias.requires_grad)):
                return False
            if compiling:  # data pointers cannot be traced; identity, dtype and device are guarded
                continue
            if weight.data_ptr() != weight_ptr or (bias is not None and bias.data_ptr() != bias_ptr):
                return False
        return True


class _GroupedLinear(nn.Linear):
    """An ``nn.Linear`` member of a :class:`_ProjectionGroup`: member 0 computes the whole
    group's GEMM and keeps the other members' outputs for their calls on the same input
    tensor (the model's forward calls them in order: q, k, v; gate, up). Anything else (another
    input, a group that is not :meth:`~_ProjectionGroup.fusable`) is a plain linear of the
    member's own parameters."""

    def forward(self, x: Tensor) -> Tensor:
        group, index = self._fs_group, self._fs_index
        if index == 0:
            if not group.fusable():
                group.pending_input, group.pending_outputs = None, []
                return nn.functional.linear(x, self.weight, self.bias)
            outputs = list(nn.functional.linear(x, group.weight, group.bias).split(group.splits, dim=-1))
            group.pending_input, group.pending_outputs = x, outputs
            return outputs[0]
        if group.pending_input is x and group.pending_outputs[index] is not None:
            out = group.pending_outputs[index]
            group.pending_outputs[index] = None
            if all(o is None for o in group.pending_outputs[1:]):
                group.pending_input, group.pending_outputs = None, []
            return out
        return nn.functional.linear(x, self.weight, self.bias)


def fuse_projections(model: nn.Module) -> int:
    """Stacks each decoder layer's q/k/v projections and its MLP's gate/up projections into one
    GEMM per group (:class:`_ProjectionGroup`); returns the number of groups made. The model's
    outputs are unchanged up to the GEMMs' floating-point summation order; its parameters stay
    the same objects (their storage moves into the stacked weights). Already fused groups and
    projections that differ in input size, dtype, device or bias presence are left as they are."""
    groups = 0
    for module in model.modules():
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is nn.Linear for lin in linears):
                continue
            first = linears[0]
            if any(lin.in_features != first.in_features or lin.weight.dtype != first.weight.dtype
                   or lin.weight.device != first.weight.device or (lin.bias is None) != (first.bias is None)
                   or lin.weight.is_meta for lin in linears):
                continue
            _ProjectionGroup(linears)
            groups += 1
    return groups


_fuse_model_projections = fuse_projections  # the decoder's keyword argument has the same name


class UnsupportedModelError(ValueError):
    """The model's head cannot be replaced by flashsampling.sample exactly."""


def _prefix(model: nn.Module) -> str:
    return f"flashsampling transformers integration ({type(model).__name__}):"


def _op_takes(name: str) -> bool:
    return name in inspect.signature(_fs_sample).parameters


def _lm_head_of(model: nn.Module) -> tuple[Tensor, Tensor | None]:
    """(weight [V, D], float32 logit bias [V] or None) of the model's head, after
    checking that logits = weight @ hidden (+ bias) is all the model does after its
    body, so that sampling them with the op is exact."""
    prefix = _prefix(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{prefix} model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}); other models may transform their logits "
            "after lm_head (scaling, soft-capping) and need a check of their own first"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        raise UnsupportedModelError(
            f"{prefix} config.final_logit_softcapping={softcap}: the model samples from "
            "softcap * tanh(logits / softcap), which flashsampling.sample does not apply, so its "
            "tokens would not follow the model's distribution. Refusing; set "
            "config.final_logit_softcapping = None only to sample the uncapped logits"
        )
    for attr in ("logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            raise UnsupportedModelError(f"{prefix} config.{attr}={value} scales the logits; not supported")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise UnsupportedModelError(f"{prefix} expected the decoder body at model.model")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise UnsupportedModelError(
            f"{prefix} lm_head is {type(head).__name__}; only a plain torch.nn.Linear head can be "
            "fused (quantized, vocab-parallel or adapter-wrapped heads cannot)"
        )
    weight = head.weight
    try:
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):
            raise UnsupportedModelError(f"{prefix} lm_head.weight is a DTensor (vocab-parallel); not supported")
    except ImportError:  # pragma: no cover
        pass
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.is_meta:
        raise UnsupportedModelError(
            f"{prefix} lm_head.weight must be a materialised bfloat16, float16 or float32 tensor, "
            f"got {weight.dtype} on {weight.device}"
        )
    logit_bias = None
    if head.bias is not None:
        if not _op_takes("logit_bias"):
            raise UnsupportedModelError(
                f"{prefix} lm_head has a bias and this flashsampling build's sample() has no "
                "logit_bias argument"
            )
        logit_bias = head.bias.detach().to(torch.float32).contiguous()
    return weight.detach(), logit_bias


class FlashSamplingHead:
    """The model's ``lm_head`` + temperature + multinomial as one ``flashsampling.sample``.

    ``head(hidden, temperature=..., seed=..., offset=...)`` samples next tokens
    ``[B, num_samples]`` from ``softmax((hidden @ lm_head.weight.T + bias) / T)`` for the
    final-norm hidden states ``hidden [B, D]`` (what ``model.model(...)`` returns as
    ``last_hidden_state[:, -1]``). Built once per model: it holds references to the head's
    weight (tied or not) and a float32 copy of its bias.
    """

    def __init__(self, model: nn.Module):
        self.weight, self.logit_bias = _lm_head_of(model)

    def __call__(
        self,
        hidden: Tensor,
        *,
        temperature: float | Tensor = 1.0,
        seed: int | Tensor | None = None,
        offset: int | Tensor | None = None,
        generator: torch.Generator | None = None,
        num_samples: int = 1,
        top_k: int | Tensor | None = None,
        top_p: float | Tensor | None = None,
        min_p: float | Tensor | None = None,
    ) -> Tensor:
        kwargs = dict(top_k=top_k, top_p=top_p, min_p=min_p)
        if self.logit_bias is not None:
            if self.logit_bias.device != hidden.device:
                self.logit_bias = self.logit_bias.to(hidden.device)
            kwargs["logit_bias"] = self.logit_bias
        return _fs_sample(
            hidden, self.weight, temperature=temperature, generator=generator, seed=seed, offset=offset,
            num_samples=num_samples, **kwargs,
        )

    def sampler(self, temperature: float | Tensor = 1.0, **truncation) -> Sampler:
        """A decode-step sampler ``(hidden, seed, offset) -> tokens [B, 1]`` at a fixed
        temperature and truncation (``top_k``, ``top_p``, ``min_p`` as in ``__call__``)."""
        return lambda hidden, seed, offset: self(hidden, temperature=temperature, seed=seed, offset=offset,
                                                 **truncation)


@dataclass
class DecodeOutput:
    sequences: Tensor  # int64 [B, P + n]: the (left-padded) prompts followed by new_tokens
    new_tokens: Tensor  # int64 [B, n]: sampled tokens; pad_token_id after a row's stop token
    num_new_tokens: Tensor  # int64 [B]: tokens generated per row, its stop token included
    prompt_attention_mask: Tensor  # int64 [B, P]: 1 for prompt tokens, 0 for left padding
    decode_seconds: float | None = None  # wall time of the timed decode steps (return_timings)
    timed_steps: int = 0  # decode steps inside decode_seconds (graph replays when graphs are on)


@dataclass
class _Session:
    """Fixed-shape state of one decode configuration; a captured CUDA graph reads and
    writes exactly these tensors, so it can be replayed for any prompt of this shape."""

    key: tuple
    cache: Cache
    ids: Tensor  # [B, 1] token fed to the next step
    pos: Tensor  # [B, 1] its position id
    pad: Tensor  # [B] left padding per row
    kv_pos: Tensor  # [1] cache slot of the next step's token
    seed: Tensor
    offset: Tensor  # noise offset of the next sample
    step: Tensor  # [1] index of the next sample in `tokens`
    finished: Tensor  # [B] bool
    stop_ids: Tensor  # [S]
    pad_token: Tensor  # 0-d
    tokens: Tensor  # [B, L] sampled tokens
    slots: Tensor  # [L] arange
    used: bool = False
    graph: object = None
    graph_key: object = None
    graph_sampler: object = None  # keeps what the captured sampler reads (e.g. a temperature tensor) alive


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


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


class StaticCacheDecoder:
    """Decode loop on a static KV cache with a pluggable sampler (the body of the model is
    the same for any sampler, which is what the benchmark compares).

    Args:
        model: a supported ``*ForCausalLM`` (see the module docstring), in eval mode.
        cuda_graph: on CUDA, capture one decode step as a CUDA graph (after two eager warm-up
            steps) and replay it; ignored on the CPU.
        check_every: with stop tokens, check every this many steps whether all rows have
            stopped (a host sync); the rows' outputs do not depend on it.
        cache_len_multiple: the cache length is ``P + max_new_tokens`` rounded up to this, so
            that calls with nearby lengths share the cache and the captured graph.
        compile_body: run the decode steps' model body through ``torch.compile`` (dynamic
            shapes, so one compilation serves every batch size; the prefill stays eager). It
            fuses the body's many small kernels, which otherwise dominate a small model's
            step even inside a CUDA graph. The first call pays the compilation.
        grouped_decode_attention: for a model loaded with ``attn_implementation="sdpa"`` and
            grouped-query attention, the decode steps attend with the query heads grouped per
            KV head instead of transformers' ``repeat_kv`` copy of the whole static cache in
            every layer (:func:`_grouped_decode_sdpa`; the same attention, less memory traffic
            that grows with B). The prefill and the model outside the decoder are unchanged.
            In a compiled body on CUDA it runs as two batched GEMMs and a float32 softmax
            (:func:`_grouped_decode_matmul_attention`), faster than the fused sdpa kernels'
            prefill-sized tiles for a one-token query.
        fuse_projections: call :func:`fuse_projections` on the model: each layer's q/k/v and
            gate/up projections run as one GEMM per group (what serving engines do with their
            weights). This changes the model in place: its parameters keep their objects, names
            and values, but their storage moves into the stacked weights (in-place updates reach
            the fused GEMMs). Outputs differ from the unfused model only by the GEMMs' summation
            order. Where the stack would be stale (a parameter replaced, converted, or given new
            storage) or while autograd records, the projections run one by one again
            (:meth:`_ProjectionGroup.fusable`). A captured CUDA graph reads the weights' memory
            as captured: update weights in place. Off by default because it edits the model.
    """

    warmup_steps = 2

    def __init__(self, model: nn.Module, *, cuda_graph: bool = True, check_every: int = 8,
                 cache_len_multiple: int = 64, compile_body: bool = False, grouped_decode_attention: bool = True,
                 fuse_projections: bool = False):
        self.model = model
        if fuse_projections:
            _fuse_model_projections(model)
        self.head = FlashSamplingHead(model)
        self.body = model.model
        self.step_body = torch.compile(self.body, dynamic=True) if compile_body else self.body
        self.config = model.config
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in _MASK_KINDS:
            raise UnsupportedModelError(
                f"{_prefix(model)} attn_implementation {impl!r} is not supported; load the model "
                "with attn_implementation='sdpa' or 'eager' (the decoder passes explicit 4-D masks)"
            )
        self.mask_kind = _MASK_KINDS[impl]
        # The configs whose attn implementation the decode steps switch (see _step_attention).
        self._step_configs = []
        if grouped_decode_attention and impl == "sdpa" and _GROUPED_DECODE_SDPA is not None:
            configs = {id(c): c for c in [self.config, *(getattr(m, "config", None) for m in self.body.modules())]
                       if isinstance(c, PretrainedConfig)}
            self._step_configs = [c for c in configs.values()
                                  if getattr(c, "_attn_implementation_internal", None) == "sdpa"]
        self.cuda_graph = cuda_graph
        self.check_every = max(1, int(check_every))
        self.cache_len_multiple = max(1, int(cache_len_multiple))
        self._pass_cache_position = "cache_position" in inspect.signature(self.body.forward).parameters
        self._cache_kwarg = _cache_kwarg(self.body.forward)
        self._session: _Session | None = None

    # ------------------------------------------------------------------ pieces of a step

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def _dtype(self) -> torch.dtype:
        return next(self.body.parameters()).dtype

    def _mask(self, valid: Tensor) -> Tensor:
        """4-D attention mask [B, 1, Q, L] from a boolean `valid` for the model's attention."""
        if self.mask_kind == "bool":
            return valid
        dtype = self._dtype()
        zero = torch.zeros((), dtype=dtype, device=valid.device)
        return torch.where(valid, zero, torch.finfo(dtype).min)

    def _forward(self, s: _Session, ids: Tensor, pos: Tensor, valid: Tensor, cache_position: Tensor,
                 body: nn.Module | None = None) -> Tensor:
        kwargs = {"input_ids": ids, "attention_mask": self._mask(valid), "position_ids": pos,
                  self._cache_kwarg: s.cache, "use_cache": True}
        if self._pass_cache_position:  # transformers versions whose StaticCache writes at cache_position
            kwargs["cache_position"] = cache_position
        return (self.body if body is None else body)(**kwargs).last_hidden_state

    @staticmethod
    def _record(s: _Session, tokens: Tensor) -> None:
        tok = tokens.reshape(-1).to(torch.int64)
        tok = torch.where(s.finished, s.pad_token, tok)
        s.tokens.index_copy_(1, s.step, tok[:, None])
        if s.stop_ids.numel():
            s.finished |= (tok[:, None] == s.stop_ids[None, :]).any(dim=1)
        s.ids.copy_(tok[:, None])
        s.offset.add_(1)
        s.step.add_(1)

    @contextlib.contextmanager
    def _step_attention(self):
        """Inside, the model's sdpa attention is :func:`_grouped_decode_sdpa` (the configs'
        implementation name is switched and restored; the name is read at every forward, and
        a compiled body guards on it)."""
        for c in self._step_configs:
            c._attn_implementation_internal = _GROUPED_DECODE_SDPA
        try:
            yield
        finally:
            for c in self._step_configs:
                c._attn_implementation_internal = "sdpa"

    def _step(self, s: _Session, sampler: Sampler) -> None:
        """One decode step: feed s.ids, sample the next token. No host sync."""
        valid = (s.slots[None, :] >= s.pad[:, None]) & (s.slots[None, :] <= s.kv_pos)
        with self._step_attention():
            hidden = self._forward(s, s.ids, s.pos, valid[:, None, None, :], s.kv_pos, body=self.step_body)
        tokens = sampler(hidden[:, -1], s.seed, s.offset)
        s.pos.add_(1)
        s.kv_pos.add_(1)
        self._record(s, tokens)

    # ------------------------------------------------------------------ setup

    def _new_cache(self, max_cache_len: int) -> Cache:
        cache = StaticCache(config=self.config, max_cache_len=max_cache_len)
        if not any(getattr(layer, "is_sliding", False) for layer in cache.layers):
            return cache
        window = getattr(self.config, "sliding_window", None)
        if window is None or max_cache_len > window:
            raise UnsupportedModelError(
                f"{_prefix(self.model)} sliding-window attention (window {window}) with a cache of "
                f"{max_cache_len} tokens is not supported; keep prompt + new tokens within the window"
            )
        # Within the window, sliding-window attention is full attention: plain static layers.
        return Cache(layers=[StaticLayer(max_cache_len=max_cache_len) for _ in cache.layers])

    def _session_for(self, batch: int, max_cache_len: int, n_stop: int, seed: Tensor, offset: Tensor) -> _Session:
        device = self.device
        key = (batch, max_cache_len, n_stop, tuple(seed.shape), tuple(offset.shape), device)
        if self._session is not None and self._session.key == key:
            return self._session
        self._session = None  # frees the previous cache and graph first
        if device.type == "cuda":
            torch.cuda.empty_cache()
        i64 = dict(dtype=torch.int64, device=device)
        self._session = _Session(
            key=key,
            cache=self._new_cache(max_cache_len),
            ids=torch.zeros(batch, 1, **i64),
            pos=torch.zeros(batch, 1, **i64),
            pad=torch.zeros(batch, **i64),
            kv_pos=torch.zeros(1, **i64),
            seed=torch.zeros(seed.shape, **i64),
            offset=torch.zeros(offset.shape, **i64),
            step=torch.zeros(1, **i64),
            finished=torch.zeros(batch, dtype=torch.bool, device=device),
            stop_ids=torch.zeros(n_stop, **i64),
            pad_token=torch.zeros((), **i64),
            tokens=torch.zeros(batch, max_cache_len, **i64),
            slots=torch.arange(max_cache_len, device=device),
        )
        return self._session

    def _graphs_enabled(self) -> bool:
        return self.cuda_graph and self.device.type == "cuda"

    def _capture(self, s: _Session, sampler: Sampler) -> torch.cuda.CUDAGraph:
        """Runs warmup_steps real steps on a side stream, then captures one step."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_steps):
                self._step(s, sampler)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(s, sampler)
        return graph

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def generate_with_sampler(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        attention_mask: Tensor | None = None,
        *,
        sampler: Sampler,
        sampler_key: object = None,
        max_new_tokens: int,
        seed: int | Tensor = 0,
        offset: int | Tensor = 0,
        stop_token_ids: Sequence[int] | Tensor | None = None,
        pad_token_id: int | None = None,
        max_cache_len: int | None = None,
        return_timings: bool = False,
    ) -> DecodeOutput:
        """Decodes ``max_new_tokens`` tokens per row with ``sampler(hidden, seed, offset)``
        choosing each token; ``sampler_key`` identifies the sampler for reusing a captured
        graph across calls (default: the sampler object itself)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        device = self.device
        stops = _stop_list(stop_token_ids)
        pad_id = _default_pad_token_id(self.model, pad_token_id, stops)
        ids, mask = _prepare_prompts(input_ids, attention_mask, pad_id, device)
        batch, prompt_len = ids.shape
        needed = prompt_len + max_new_tokens
        cache_len = _round_up(needed, self.cache_len_multiple) if max_cache_len is None else int(max_cache_len)
        if cache_len < needed:
            raise ValueError(
                f"max_cache_len={cache_len} < prompt length {prompt_len} + max_new_tokens {max_new_tokens}")
        seed_t = as_int64_tensor(seed, device)
        offset_t = as_int64_tensor(offset, device)
        s = self._session_for(batch, cache_len, len(stops), seed_t, offset_t)
        if s.used:
            s.cache.reset()
        s.used = True
        pad = (mask == 0).sum(dim=1)
        s.pad.copy_(pad)
        s.seed.copy_(seed_t)
        s.offset.copy_(offset_t)
        s.step.zero_()
        s.finished.zero_()
        s.tokens.zero_()
        if stops:
            s.stop_ids.copy_(torch.tensor(stops, dtype=torch.int64))
        s.pad_token.fill_(pad_id)

        # Prefill: the prompt's cache slots 0..P-1, the first token from its last position.
        q = torch.arange(prompt_len, device=device)
        valid = ((s.slots[None, None, :] >= pad[:, None, None]) & (s.slots[None, None, :] <= q[None, :, None])) | (
            s.slots[None, None, :] == q[None, :, None]
        )  # a padding query sees itself only: no fully masked rows
        positions = (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
        hidden = self._forward(s, ids, positions, valid[:, None], q)
        tokens = sampler(hidden[:, -1].contiguous(), s.seed, s.offset)
        s.pos.copy_((prompt_len - pad)[:, None])
        s.kv_pos.fill_(prompt_len)
        self._record(s, tokens)

        use_graph = self._graphs_enabled()
        key = sampler if sampler_key is None else sampler_key
        steps = 1
        timed_steps, start, start_event, end_event = 0, None, None, None

        def check_stop() -> bool:
            return bool(stops) and steps % self.check_every == 0 and bool(s.finished.all())

        if use_graph and (s.graph is None or s.graph_key != key):
            s.graph = s.graph_key = s.graph_sampler = None
            if max_new_tokens - steps > self.warmup_steps:
                s.graph = self._capture(s, sampler)  # ran warmup_steps steps
                s.graph_key, s.graph_sampler = key, sampler
                steps += self.warmup_steps
        while steps < max_new_tokens:
            if timed_steps == 0 and start is None and start_event is None:
                if device.type == "cuda":
                    start_event = torch.cuda.Event(enable_timing=True)
                    end_event = torch.cuda.Event(enable_timing=True)
                    start_event.record()
                else:
                    start = time.perf_counter()
            if use_graph and s.graph is not None:
                s.graph.replay()
            else:
                self._step(s, sampler)
            steps += 1
            timed_steps += 1
            if check_stop():
                break
        decode_seconds = None
        if return_timings and timed_steps:
            if end_event is not None:
                end_event.record()
                end_event.synchronize()
                decode_seconds = start_event.elapsed_time(end_event) * 1e-3
            else:
                decode_seconds = time.perf_counter() - start

        new_tokens = s.tokens[:, :steps].clone()
        num_new = _num_new_tokens(new_tokens, stops)
        if stops:  # drop the columns after every row stopped (how many ran depends on check_every)
            new_tokens = new_tokens[:, : int(num_new.max())]
        return DecodeOutput(
            sequences=torch.cat([ids, new_tokens], dim=1),
            new_tokens=new_tokens,
            num_new_tokens=num_new,
            prompt_attention_mask=mask,
            decode_seconds=decode_seconds,
            timed_steps=timed_steps if return_timings else 0,
        )


def _temperature_key(temperature: float | Tensor) -> tuple:
    if isinstance(temperature, Tensor):
        return ("per-row", tuple(temperature.reshape(-1).tolist()))
    return ("scalar", float(temperature))


class FlashSamplingDecoder(StaticCacheDecoder):
    """Decoding with :class:`FlashSamplingHead` as the sampler.

    Example::

        model = AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16).cuda().eval()
        decoder = FlashSamplingDecoder(model)            # checks the model once
        out = decoder.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=128,
                               temperature=0.7, seed=1234, stop_token_ids=[tokenizer.eos_token_id])
        out.new_tokens, out.num_new_tokens
    """

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor | Sequence[Sequence[int]],
        attention_mask: Tensor | None = None,
        *,
        max_new_tokens: int,
        temperature: float | Tensor = 1.0,
        top_k: int | Tensor | None = None,
        top_p: float | Tensor | None = None,
        min_p: float | Tensor | None = None,
        seed: int | Tensor = 0,
        offset: int | Tensor = 0,
        stop_token_ids: Sequence[int] | Tensor | None = None,
        pad_token_id: int | None = None,
        max_cache_len: int | None = None,
        return_timings: bool = False,
    ) -> DecodeOutput:
        """Samples up to ``max_new_tokens`` tokens per prompt.

        Args:
            input_ids: ``[B, P]`` int tensor of left-padded prompts (with ``attention_mask``)
                or a list of token-id lists of any lengths (left-padded here).
            attention_mask: ``[B, P]`` 0/1, left padding only; default all ones.
            temperature: float (0 = greedy) or ``[B]`` tensor (per row, where the installed op
                takes per-row temperatures on the model's device).
            top_k, top_p, min_p: truncation as in ``flashsampling_cuda.sample`` (int/float or
                ``[B]`` tensor on the model's device; None or -1/0, 1, 0: off).
            seed: int or 0-d tensor: batch-wide, row ``b`` draws noise stream ``b``; or a
                ``[B]`` int64 tensor of per-request seeds (stream 0), so a request's tokens do
                not depend on the batch around it (where the installed op takes [B] seeds on
                the model's device).
            offset: noise offset of the first token; step ``t`` uses ``offset + t``.
            stop_token_ids: a row stops after sampling one of these (it is kept in the output);
                its later tokens are ``pad_token_id``. Decoding ends early once every row stopped.
            pad_token_id: default: the model's generation config, else the first stop token, else 0.
            max_cache_len: static cache length (default: P + max_new_tokens rounded up to 64).
            return_timings: fill ``decode_seconds`` / ``timed_steps`` (the graph-replayed steps).
        """
        if isinstance(temperature, Tensor):  # on the device once, not copied inside a captured step
            temperature = temperature.to(device=self.device, dtype=torch.float32)
        truncation = dict(top_k=top_k, top_p=top_p, min_p=min_p)
        return self.generate_with_sampler(
            input_ids, attention_mask, sampler=self.head.sampler(temperature, **truncation),
            sampler_key=("flashsampling", _temperature_key(temperature),
                         tuple(_temperature_key(v) if isinstance(v, Tensor) else v for v in truncation.values())),
            max_new_tokens=max_new_tokens,
            seed=seed, offset=offset, stop_token_ids=stop_token_ids, pad_token_id=pad_token_id,
            max_cache_len=max_cache_len, return_timings=return_timings,
        )


def generate(model: nn.Module, input_ids, attention_mask=None, *, cuda_graph: bool = True, **kwargs) -> DecodeOutput:
    """One-shot :meth:`FlashSamplingDecoder.generate` (builds the decoder, its cache and graph
    each call; keep a :class:`FlashSamplingDecoder` to reuse them)."""
    return FlashSamplingDecoder(model, cuda_graph=cuda_graph).generate(input_ids, attention_mask, **kwargs)


# ---------------------------------------------------------------------- reference


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
) -> ReferenceDecodeOutput:
    """The reference of :meth:`FlashSamplingDecoder.generate`: the model's standard forward
    (``model(...)`` with a dynamic cache and its own masks, lm_head included), its logits
    ``[:, -1]`` in float64 and :func:`reference_sample_from_logits` with offset ``offset + t``
    at step ``t``. Same prompt, padding and stop rules as the decoder."""
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
    positions = (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
    cache_kwarg = _cache_kwarg(model.forward)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions,
                **{cache_kwarg: DynamicCache(config=model.config)}, use_cache=True)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    tokens, gaps, tols = [], [], []
    for t in range(max_new_tokens):
        logits = out.logits[:, -1]
        tok, gap, tol = reference_sample_from_logits(
            logits, temperature, seed_t, offset_t + t, rtol=logits_rtol(logits.dtype) if rtol is None else rtol)
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
