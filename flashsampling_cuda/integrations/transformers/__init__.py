"""Decode Hugging Face causal LMs with FlashSampling.

The standard decode step of a ``transformers`` causal LM ends with ``logits =
lm_head(hidden)``, the logits processors (temperature, ...) and ``torch.multinomial``
over ``softmax(logits / T)``. Here the body of the model runs as usual and the last
hidden state (the output of the model's final norm) goes straight to
:func:`flashsampling_cuda.sample` with ``lm_head.weight``: the same categorical
distribution, sampled exactly with the Gumbel-Max trick, without writing the logits.

Supported: ``model_type`` in :data:`SUPPORTED_MODEL_TYPES` (Llama, Mistral, Qwen2,
Qwen3, Gemma, Gemma 2, Gemma 3 text, Granite, Cohere, Cohere 2), tied or untied embeddings, a
plain ``torch.nn.Linear`` head (a bias goes in as the op's ``logit_bias``),
``attn_implementation`` ``"sdpa"`` or ``"eager"``. What these models do to their logits after
``lm_head`` goes to the op, which applies it first (docs/penalties.md): Granite's division by
``config.logits_scaling`` as ``logit_scale = 1 / logits_scaling``, Cohere's and Cohere 2's
multiplication by ``config.logit_scale`` as ``logit_scale``, Gemma 2/3's final-logit
soft-capping (``final_logit_softcapping``) as ``logit_softcap``. Refused, with
:class:`UnsupportedModelError`: a logit scaling attribute (``logit_scale``,
``logits_scaling``, ``output_multiplier_scale``) other than 1 that the model type is not known
to apply, quantized, vocab-parallel (DTensor) or wrapped heads, sliding-window attention beyond
its window, other model types (the multimodal ``gemma3``: load its text model,
``Gemma3ForCausalLM``, whose ``model_type`` is ``gemma3_text``).

``top_k``, ``top_p`` and ``min_p`` go to the op, which truncates exactly (on CUDA in the fused
top-k pass or from the logits computed once: docs/truncation.md).
``return_logprobs`` / ``top_logprobs`` / ``logprobs_mode`` go to the op too: each step's sampled
token's log-probability, and with ``top_logprobs=N`` its top-``N`` tokens, their
log-probabilities and the sampled token's rank, recorded in fixed buffers inside the step (no
logits returned). ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty`` go
to the op with a :class:`flashsampling_cuda.PenaltyState` the decoder keeps on the device and
updates inside the step (docs/transformers.md). Not supported: other logits processors.

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

The package, by subject:

- :mod:`.head`: which models can be sampled exactly, and :class:`FlashSamplingHead`
  (``lm_head`` + temperature + multinomial as one ``flashsampling.sample``);
- :mod:`.decoder`: the static-cache decode loop with CUDA-graph steps
  (:class:`StaticCacheDecoder`, :class:`FlashSamplingDecoder`, :func:`generate`);
- :mod:`.attention`: the decode steps' grouped-query attention on the static cache;
- :mod:`.projections`: :func:`fuse_projections` (q/k/v and gate/up as one GEMM per group);
- :mod:`.speculative`: speculative decoding verified exactly with ``speculative_sample``
  (:func:`speculative_generate`) and its proposers (:class:`NgramProposer`,
  :class:`DraftModelProposer`, :func:`truncated_draft_model`);
- :mod:`.reference`: the float64 reference decoder the tests compare against;
- :mod:`.prompts`: prompt padding and stop-token helpers shared by the decoders.

This package imports ``transformers`` (>= 5.0) on import; ``import flashsampling_cuda``
does not.
"""

from __future__ import annotations

try:
    import transformers as _transformers
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

from .decoder import DecodeOutput, FlashSamplingDecoder, StaticCacheDecoder, generate  # noqa: E402
from .head import SUPPORTED_MODEL_TYPES, FlashSamplingHead, UnsupportedModelError  # noqa: E402
from .projections import fuse_projections  # noqa: E402
from .speculative import (  # noqa: E402
    DraftModelProposer,
    DraftState,
    NgramProposer,
    SpeculativeDecodeOutput,
    speculative_generate,
    truncated_draft_model,
)
from .reference import (  # noqa: E402
    ReferenceDecodeOutput,
    logits_rtol,
    reference_generate,
    reference_sample_from_logits,
)

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
    "speculative_generate",
    "SpeculativeDecodeOutput",
    "DraftState",
    "NgramProposer",
    "DraftModelProposer",
    "truncated_draft_model",
]
