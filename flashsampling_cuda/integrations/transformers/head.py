"""The model's head as one exact ``flashsampling.sample`` call: which models qualify
(:func:`_lm_head_of`) and :class:`FlashSamplingHead`."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch import Tensor

from ...sampling import sample as _fs_sample

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")

# A sampler maps (hidden [B, D], seed tensor, offset tensor) to tokens [B] or [B, 1].
Sampler = Callable[[Tensor, Tensor, Tensor], Tensor]


class UnsupportedModelError(ValueError):
    """The model's head cannot be replaced by flashsampling.sample exactly."""


def _prefix(model: nn.Module) -> str:
    return f"flashsampling transformers integration ({type(model).__name__}):"


def _lm_head_of(model: nn.Module) -> tuple[Tensor, Tensor | None, float | None]:
    """(weight [V, D], float32 logit bias [V] or None, final-logit soft-cap or None) of the
    model's head, after checking that logits = weight @ hidden (+ bias), soft-capped as
    ``cap * tanh(logits / cap)`` where the config says so (Gemma 2/3), is all the model does
    after its body, so that sampling them with the op (``logit_softcap``) is exact."""
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
        logit_bias = head.bias.detach().to(torch.float32).contiguous()
    return weight.detach(), logit_bias, None if softcap is None else float(softcap)


class FlashSamplingHead:
    """The model's ``lm_head`` + temperature + multinomial as one ``flashsampling.sample``.

    ``head(hidden, temperature=..., seed=..., offset=...)`` samples next tokens
    ``[B, num_samples]`` from ``softmax((hidden @ lm_head.weight.T + bias) / T)`` (soft-capped
    first where the config says so: the op's ``logit_softcap``, which takes the logits route,
    docs/penalties.md) for the
    final-norm hidden states ``hidden [B, D]`` (what ``model.model(...)`` returns as
    ``last_hidden_state[:, -1]``). Built once per model: it holds references to the head's
    weight (tied or not) and a float32 copy of its bias.
    """

    def __init__(self, model: nn.Module):
        self.weight, self.logit_bias, self.logit_softcap = _lm_head_of(model)

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
        kwargs = dict(top_k=top_k, top_p=top_p, min_p=min_p, logit_softcap=self.logit_softcap)
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
