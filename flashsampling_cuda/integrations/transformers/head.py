"""The model's head as one exact ``flashsampling.sample`` call: which models qualify
(:func:`_lm_head_of`) and :class:`FlashSamplingHead`."""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from ...sampling import sample as _fs_sample

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "granite", "cohere",
                         "cohere2")

# What these model types' forward does to the logits after lm_head (transformers'
# modeling_<type>.py): (config attribute, True: logits * value, False: logits / value). The op's
# logit_scale multiplies, so a division goes in as 1 / value.
_LOGIT_SCALING = {
    "granite": ("logits_scaling", False),
    "cohere": ("logit_scale", True),
    "cohere2": ("logit_scale", True),
}
# Config attributes that scale the logits in some model; for a model type outside _LOGIT_SCALING
# (or another attribute than its own) any value but 1 is a transform this module does not know.
_SCALING_ATTRS = ("logit_scale", "logits_scaling", "output_multiplier_scale")

# A sampler maps (hidden [B, D], seed tensor, offset tensor) to tokens [B] or [B, 1], or to the
# op's SampleOutput / LogprobsOutput of one sample per row (the decoder records their logprobs).
Sampler = Callable[[Tensor, Tensor, Tensor], object]


class UnsupportedModelError(ValueError):
    """The model's head cannot be replaced by flashsampling.sample exactly."""


def _prefix(model: nn.Module) -> str:
    return f"flashsampling transformers integration ({type(model).__name__}):"


class _Head(NamedTuple):
    weight: Tensor  # [V, D]
    logit_bias: Tensor | None  # float32 [V]
    logit_scale: float  # the op's logit_scale: 1.0 where the model does not scale
    logit_softcap: float | None


def _logit_scale_of(config, model_type: str, prefix: str) -> float:
    """The op's ``logit_scale`` for the model's own scaling of its logits (:data:`_LOGIT_SCALING`);
    refuses a scaling attribute that this model type's forward is not known to apply."""
    own, multiplies = _LOGIT_SCALING.get(model_type, (None, True))
    for attr in _SCALING_ATTRS:
        value = getattr(config, attr, None)
        if attr != own and value is not None and value != 1:
            raise UnsupportedModelError(
                f"{prefix} config.{attr}={value} scales the logits, which model_type {model_type!r} is not "
                "known to do; not supported")
    if own is None:
        return 1.0
    value = getattr(config, own, None)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise UnsupportedModelError(f"{prefix} config.{own}={value!r} is not a finite positive number")
    return float(value) if multiplies else 1.0 / float(value)


def _lm_head_of(model: nn.Module) -> _Head:
    """The model's head (:class:`_Head`), after checking that logits = weight @ hidden (+ bias),
    scaled where the config says so (Granite divides by ``logits_scaling``, Cohere multiplies
    by ``logit_scale``) and soft-capped as ``cap * tanh(logits / cap)`` where it says so
    (Gemma 2/3), is all the model does after its body, so that sampling them with the op
    (``logit_scale``, ``logit_softcap``) is exact."""
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
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise UnsupportedModelError(f"{prefix} config.final_logit_softcapping={softcap!r} is not a positive number")
    logit_scale = _logit_scale_of(config, model_type, prefix)
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
        logit_bias = head.bias.detach().to(torch.float32).contiguous()
    return _Head(weight.detach(), logit_bias, logit_scale, None if softcap is None else float(softcap))


class FlashSamplingHead:
    """The model's ``lm_head`` + temperature + multinomial as one ``flashsampling.sample``.

    ``head(hidden, temperature=..., seed=..., offset=...)`` samples next tokens
    ``[B, num_samples]`` from ``softmax((f(hidden @ lm_head.weight.T) + bias) / T)`` for the
    final-norm hidden states ``hidden [B, D]`` (what ``model.model(...)`` returns as
    ``last_hidden_state[:, -1]``), ``f`` the model's own transform of its logits where the config
    has one: Granite's and Cohere's scaling (the op's ``logit_scale``), Gemma 2/3's soft-cap
    (``logit_softcap``), which the op applies first (docs/penalties.md). Built once per
    model: it holds references to the head's weight (tied or not) and a float32 copy of its bias.
    """

    def __init__(self, model: nn.Module):
        self.weight, self.logit_bias, self.logit_scale, self.logit_softcap = _lm_head_of(model)

    def logit_bias_on(self, device: torch.device) -> Tensor | None:
        """The head's float32 bias on ``device`` (moved there once), or None."""
        if self.logit_bias is not None and self.logit_bias.device != device:
            self.logit_bias = self.logit_bias.to(device)
        return self.logit_bias

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
        return_logprobs: bool = False,
        top_logprobs: int = 0,
        logprobs_mode: str = "processed",
        repetition_penalty: float | Tensor | None = None,
        frequency_penalty: float | Tensor | None = None,
        presence_penalty: float | Tensor | None = None,
        penalty_state=None,
    ):
        """Tokens ``[B, num_samples]``; with ``return_logprobs`` the op's ``SampleOutput`` (or its
        ``LogprobsOutput`` with ``top_logprobs`` > 0 or ``logprobs_mode="raw"``), as
        :func:`flashsampling_cuda.sample` returns them. ``"raw"`` is the op's: ``log_softmax``
        of ``hidden @ weight.T``, before the model's scaling or soft-cap. The penalties take a
        :class:`flashsampling_cuda.PenaltyState` (the op's; docs/penalties.md)."""
        return _fs_sample(
            hidden, self.weight, temperature=temperature, generator=generator, seed=seed, offset=offset,
            num_samples=num_samples, top_k=top_k, top_p=top_p, min_p=min_p,
            logit_bias=self.logit_bias_on(hidden.device), logit_scale=self.logit_scale,
            logit_softcap=self.logit_softcap, return_logprobs=return_logprobs, top_logprobs=top_logprobs,
            logprobs_mode=logprobs_mode, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
            presence_penalty=presence_penalty, penalty_state=penalty_state,
        )

    def sampler(self, temperature: float | Tensor = 1.0, **controls) -> Sampler:
        """A decode-step sampler ``(hidden, seed, offset) -> tokens [B, 1]`` (or the op's logprobs
        output, see ``__call__``) at a fixed temperature and the other controls of ``__call__``
        (``top_k``, ``top_p``, ``min_p``, ``return_logprobs``, ``top_logprobs``, ``logprobs_mode``)."""
        return lambda hidden, seed, offset: self(hidden, temperature=temperature, seed=seed, offset=offset,
                                                 **controls)
