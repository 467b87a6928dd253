"""Python API of FlashSampling: exact sampling fused into the LM-head GEMM."""

from __future__ import annotations

import torch
from torch import Tensor

from .noise import as_int64_tensor

__all__ = ["sample"]


def _temperature_args(temperature: float | Tensor, hidden: Tensor) -> tuple[float, Tensor | None]:
    """(scalar, per-row tensor) arguments of the op for a float, 0-d or [B] temperature."""
    if not isinstance(temperature, Tensor):
        return float(temperature), None
    if temperature.is_floating_point():
        temperature = temperature.to(device=hidden.device, dtype=torch.float32)
    if temperature.dim() == 0:
        temperature = temperature.expand(hidden.shape[0])
    return 1.0, temperature


def sample(
    hidden: Tensor,
    weight: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    generator: torch.Generator | None = None,
    seed: int | Tensor | None = None,
    offset: int | Tensor | None = None,
    num_samples: int = 1,
) -> Tensor:
    r"""Sample next tokens from ``softmax(hidden @ weight.T / T)`` without materialising logits.

    FlashSampling fuses the Gumbel-Max trick into the LM-head matrix multiply:

    .. math::

        \text{token}[b, s] = \operatorname{argmax}_v \big(\text{logit}[b, v] / T_b + g(b, s, v)\big),
        \qquad \text{logit}[b, v] = \sum_d \text{hidden}[b, d]\,\text{weight}[v, d],

    with the logits accumulated in fp32 and :math:`g` i.i.d. standard Gumbel noise. Since
    :math:`P(\operatorname{argmax}_v(x_v + g_v) = i) = \operatorname{softmax}(x)_i`, every
    token is an exact sample from the categorical distribution of the logits; no top-k
    truncation, no approximation.

    Args:
        hidden: ``[B, D]`` hidden states, ``torch.bfloat16``, ``torch.float16`` or
            ``torch.float32`` (CPU: all three; CUDA: see the README).
        weight: ``[V, D]`` LM-head weight, same dtype and device as ``hidden``;
            ``1 <= V < 2**31``.
        temperature: a float, a 0-d tensor or a ``[B]`` float tensor (per row). Must be
            finite and ``>= 0``; ``0`` means greedy (exact argmax of the logits, no noise).
            Rounded to fp32; the scale applied is ``fl32(1 / T)``.
        generator: draws ``(seed, offset)`` when ``seed`` is None; default: the default
            generator of ``hidden``'s device, so ``torch.manual_seed`` makes runs
            reproducible. Mutually exclusive with ``seed``.
        seed: int, 0-d or ``[B]`` int64 tensor. A 0-d seed is batch-wide: row ``b`` draws
            noise stream ``b``. A ``[B]`` tensor gives each row its own seed and stream 0,
            so a row's token does not depend on the other rows of the batch.
        offset: int, 0-d or ``[B]`` int64 tensor, default 0; only with ``seed``. Advance it
            (by at least ``num_samples``) to draw fresh samples with the same seed.
        num_samples: independent draws per row (with replacement), ``>= 1``.

    Returns:
        ``[B, num_samples]`` int64 token ids on ``hidden``'s device (``-1`` only for a row
        whose scores are all NaN).

    Noise and exactness contract:
        The noise of element ``(b, s, v)`` is a pure function of
        ``(seed, offset, stream, s, v)``:
        ``key = (lo32(seed), hi32(seed))``,
        ``counter = (v, stream >> 2, lo32(offset + s), hi32(offset + s))``,
        ``bits = Philox4x32_10(key, counter)[stream & 3]``,
        ``u = (floor(bits / 2^9) + 1/2) / 2^23`` (strictly inside (0, 1)),
        ``g = -log(-log(u))`` in fp32; the score is ``fma(logit, fl32(1 / T), g)`` in fp32 and
        exact ties go to the smaller index. It does not depend on tiling, kernel
        configuration, thread count or device, so samples are reproducible from
        ``(seed, offset)`` alone (:func:`flashsampling_cuda.noise.gumbel_noise`
        recomputes the noise in pure PyTorch).

    Example::

        >>> tokens = flashsampling_cuda.sample(hidden, lm_head.weight, temperature=0.7, seed=1234)
    """
    scalar_temperature, temperatures = _temperature_args(temperature, hidden)
    return torch.ops.flashsampling.sample(
        hidden,
        weight,
        temperature=scalar_temperature,
        temperatures=temperatures,
        num_samples=num_samples,
        seed=None if seed is None else as_int64_tensor(seed),
        offset=None if offset is None else as_int64_tensor(offset),
        generator=generator,
    )


@torch.library.register_fake("flashsampling::sample")
def _sample_fake(
    hidden, weight, *, temperature=1.0, temperatures=None, num_samples=1, seed=None, offset=None,
    generator=None,
):
    # What the output's shape and device depend on; the real kernels check the rest
    # (csrc/torch/checks.cpp) with the same messages.
    prefix = "flashsampling.sample:"
    torch._check(hidden.dim() == 2, lambda: f"{prefix} hidden must be 2-D [B, D], got shape {list(hidden.shape)}")
    torch._check(weight.dim() == 2, lambda: f"{prefix} weight must be 2-D [V, D], got shape {list(weight.shape)}")
    torch._check(
        weight.device == hidden.device,
        lambda: f"{prefix} weight must be on hidden's device ({hidden.device}), got {weight.device}",
    )
    torch._check(num_samples >= 1, lambda: f"{prefix} num_samples must be >= 1, got {num_samples}")
    return hidden.new_empty((hidden.shape[0], num_samples), dtype=torch.int64)
