"""The Gumbel noise of FlashSampling in pure PyTorch, bit-identical to philox_gumbel.h.

A vectorised port of csrc/include/flashsampling/philox_gumbel.h for tests and the
float64 reference (reference.py): it runs on any device and never calls the
extension, so comparing it with the C++ noise (``torch.ops.flashsampling.gumbel_noise``)
checks the header against an independent implementation.

uint32 values are held in int64 tensors and masked to 32 bits. Every fp32 step is
an fp32 tensor op (IEEE round-to-nearest, as the header's fs_add/fs_mul/fs_div), and
fs_fma is emulated exactly through float64 (:func:`fma32`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .masks import int32_words

MASK32 = 0xFFFFFFFF
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_WEYL = (0x9E3779B9, 0xBB67AE85)


def _fp32(x: float) -> float:
    """x rounded to fp32 (as the C++ literal ``x f``), held exactly in a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


# fs_logf's constants (fdlibm/musl logf).
_LG1, _LG2 = _fp32(0.66666662693), _fp32(0.40000972152)
_LG3, _LG4 = _fp32(0.28498786688), _fp32(0.24279078841)
_LN2_HI, _LN2_LO = _fp32(6.9313812256e-01), _fp32(9.0580006145e-06)


def as_int64_tensor(x: int | Tensor, device: torch.device | str | None = None) -> Tensor:
    """An int64 tensor of x; Python ints in [2^63, 2^64) wrap to their two's complement,
    so any uint64 seed or offset can be passed as an int. An int becomes a 0-d tensor filled on
    ``device`` (a fill, not a copy from the host: no sync, and capturable in a CUDA graph)."""
    if isinstance(x, Tensor):
        if x.dtype != torch.int64:
            raise TypeError(f"expected an int64 tensor, got {x.dtype}")
        return x if device is None else x.to(device)
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an int or an int64 tensor, got {type(x).__name__}")
    if not -(2**63) <= x < 2**64:
        raise ValueError(f"{x} does not fit in 64 bits")
    return torch.full((), x - 2**64 if x >= 2**63 else x, dtype=torch.int64, device=device)


def draw_seed(generator: torch.Generator | None, device: torch.device) -> Tensor:
    """A batch-wide 64-bit seed (0-d int64 on `device`) drawn from `generator` (default:
    the default generator of `device`), without a host sync on CUDA."""
    if generator is not None:
        device = generator.device
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64, device=device, generator=generator)


def _mulhilo32(a: int, b: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) 32-bit halves of a * b for a uint32 constant a and uint32 values b,
    without overflowing int64: b is split into 16-bit halves."""
    t_lo = a * (b & 0xFFFF)  # < 2^48
    t_hi = a * (b >> 16)  # < 2^48
    mid = t_lo + ((t_hi & 0xFFFF) << 16)  # < 2^49
    return (t_hi >> 16) + (mid >> 32), mid & MASK32


def _philox_rounds(c0, c1, c2, c3, k0, k1):
    for _ in range(10):
        hi0, lo0 = _mulhilo32(_PHILOX_MUL[0], c0)
        hi1, lo1 = _mulhilo32(_PHILOX_MUL[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _PHILOX_WEYL[0]) & MASK32
        k1 = (k1 + _PHILOX_WEYL[1]) & MASK32
    return c0, c1, c2, c3


def philox4x32_10(counter: Tensor, key: Tensor) -> Tensor:
    """Philox4x32-10 of counter [..., 4] and key [..., 2] (uint32 values in int64
    tensors, leading dims broadcast); returns [..., 4] int64."""
    return torch.stack(_philox_rounds(*counter.unbind(-1), *key.unbind(-1)), dim=-1)


def _bits_of(x: Tensor) -> Tensor:
    """uint32 bit pattern (in int64) of an fp32 tensor."""
    return x.view(torch.int32).to(torch.int64) & MASK32


def _float_of(bits: Tensor) -> Tensor:
    """fp32 tensor with the given uint32 bit patterns (int64 tensor)."""
    return int32_words(bits & MASK32).view(torch.float32)


def fma32(a: Tensor | float, b: Tensor | float, c: Tensor | float) -> Tensor:
    """Correctly rounded fp32 fma(a, b, c) of fp32 values (fs_fma).

    a * b is exact in float64 and TwoSum gives s + e == a * b + c exactly, with
    s = fl64(a * b + c). Rounding s to fp32 equals rounding the exact value except when
    s is a midpoint of two fp32 neighbours and e != 0: then the sign of e decides.
    """
    as64 = lambda x: x.double() if isinstance(x, Tensor) else float(x)  # noqa: E731
    a64, b64, c64 = as64(a), as64(b), as64(c)
    p = a64 * b64
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.to(torch.float32)
    r64 = r.double()
    other = torch.nextafter(r, torch.where(r64 < s, torch.inf, -torch.inf).to(torch.float32))
    midpoint = (r64 + other.double()) == 2.0 * s
    toward_e = torch.where(e > 0, torch.maximum(r, other), torch.minimum(r, other))
    # An infinite s (an infinite operand or an overflow) is the fp32 result already: TwoSum's
    # error term is NaN there, and the midpoint test would compare infinities.
    return torch.where(midpoint & (e != 0) & torch.isfinite(s), toward_e, r)


def logf(x: Tensor) -> Tensor:
    """fs_logf: natural log of positive normal fp32 values, bit-identical to the header."""
    ix = (_bits_of(x) + (0x3F800000 - 0x3F3504F3)) & MASK32
    k = (ix >> 23) - 0x7F
    f = _float_of((ix & 0x007FFFFF) + 0x3F3504F3) - 1.0
    s = f / (f + 2.0)
    z = s * s
    w = z * z
    t1 = w * fma32(w, _LG4, _LG2)
    t2 = z * fma32(w, _LG3, _LG1)
    r = t2 + t1
    hfsq = (f * 0.5) * f
    dk = k.to(torch.float32)
    acc = fma32(s, hfsq + r, dk * _LN2_LO)
    acc = acc - hfsq
    acc = acc + f
    return fma32(dk, _LN2_HI, acc)


def uniform_open01(bits: Tensor) -> Tensor:
    """fs_uniform_open01: (floor(bits / 2^9) + 1/2) / 2^23, strictly inside (0, 1)."""
    return ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23


def gumbel_from_bits(bits: Tensor) -> Tensor:
    """fs_gumbel_from_bits: -log(-log(u)) in fp32."""
    return -logf(-logf(uniform_open01(bits)))


def uniform_noise(
    seed: int | Tensor,
    offset: int | Tensor,
    stream: int | Tensor,
    sample: int | Tensor,
    vocab_index: int | Tensor,
) -> Tensor:
    """The fp32 uniform in (0, 1) under :func:`gumbel_noise` at the same coordinates
    (``uniform_open01`` of the same Philox bits): speculative verification's acceptance draws use
    it at ``vocab_index = 2^32 - 1``, an index no token has. One kernel
    (``flashsampling._uniform_noise``, philox_gumbel.h's ``fs_uniform_noise``) over the broadcast
    arguments; :func:`uniform_noise_reference` is the same in torch ops."""
    args = (seed, offset, stream, sample, vocab_index)
    device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
    tensors = torch.broadcast_tensors(*(as_int64_tensor(a, device) for a in args))
    return torch.ops.flashsampling._uniform_noise(*(t.contiguous() for t in tensors))


def uniform_noise_reference(seed, offset, stream, sample, vocab_index) -> Tensor:
    """:func:`uniform_noise` (the same arguments) in torch ops: about a hundred small kernels, the
    reference of the tests and of reference.py."""
    return uniform_open01(_bits_at(seed, offset, stream, sample, vocab_index))


def gumbel_noise(
    seed: int | Tensor,
    offset: int | Tensor,
    stream: int | Tensor,
    sample: int | Tensor,
    vocab_index: int | Tensor,
) -> Tensor:
    """fs_gumbel_noise: the fp32 Gumbel noise of FlashSampling at the given coordinates.

    Args (ints or int64 tensors, broadcast together):
        seed, offset: 64-bit values (ints >= 2^63 wrap, as uint64 in C++).
        stream: batch row for a batch-wide seed, 0 for a per-row seed; in [0, 2^32).
        sample: sample index in [0, num_samples).
        vocab_index: global vocabulary index in [0, 2^32).

    Returns: float32 tensor of the broadcast shape, on the device of the tensor
    arguments (CPU when all are ints).
    """
    return gumbel_from_bits(_bits_at(seed, offset, stream, sample, vocab_index))


def _bits_at(seed, offset, stream, sample, vocab_index) -> Tensor:
    """The Philox bits of noise coordinates (fs_gumbel_noise's counter, key and lane)."""
    args = (seed, offset, stream, sample, vocab_index)
    device = next((a.device for a in args if isinstance(a, Tensor)), torch.device("cpu"))
    seed, offset, stream, sample, vocab_index = (as_int64_tensor(a, device) for a in args)
    offset_plus_sample = offset + sample  # int64 wrap-around == uint64 addition
    r = _philox_rounds(
        vocab_index & MASK32,
        stream >> 2,
        offset_plus_sample & MASK32,
        (offset_plus_sample >> 32) & MASK32,
        seed & MASK32,
        (seed >> 32) & MASK32,
    )
    lane = stream & 3
    return torch.where(lane == 0, r[0], torch.where(lane == 1, r[1], torch.where(lane == 2, r[2], r[3])))
