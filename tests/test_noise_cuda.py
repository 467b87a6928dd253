"""GPU noise == CPU noise, bit for bit, over every input the noise transform can take (run on
the device machine; skipped without a GPU).

fs_logf (philox_gumbel.h) reduces its argument to a float m in [sqrt(1/2), sqrt(2)) and
divides m - 1 by m + 1, so checking it on all 2^23 such m covers every division it makes
(the GPU's div.rn against the host's a / b); fs_gumbel_from_bits keeps only 23 of its 32
bits, so its 2^23 distinct inputs are checked one by one. The GPU side runs the four-lane
forms the fused epilogue calls.
"""

import math

import pytest
import torch

import flashsampling_cuda  # noqa: F401 - registers the ops

pytestmark = pytest.mark.requires_cuda


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_logf_cuda_equals_cpu_on_every_reduced_argument():
    lo = torch.tensor(math.sqrt(0.5), dtype=torch.float32).view(torch.int32).item()
    hi = torch.tensor(math.sqrt(2.0), dtype=torch.float32).view(torch.int32).item()
    x = torch.arange(lo, hi + 1, dtype=torch.int32).view(torch.float32)
    assert x.numel() > 2**23
    cpu = torch.ops.flashsampling._logf(x)
    gpu = torch.ops.flashsampling._logf(x.cuda()).cpu()
    differ = (_bits(cpu) != _bits(gpu)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} inputs differ, first x = {x[differ[:4]].tolist()}"


def test_logf_cuda_equals_cpu_on_random_positive_floats():
    generator = torch.Generator().manual_seed(5)
    bits = torch.randint(0x00800000, 0x7F800000, (1 << 22,), generator=generator, dtype=torch.int32)
    x = bits.view(torch.float32)  # positive normal floats over the whole range
    cpu = torch.ops.flashsampling._logf(x)
    gpu = torch.ops.flashsampling._logf(x.cuda()).cpu()
    assert torch.equal(_bits(cpu), _bits(gpu))


def test_gumbel_from_bits_cuda_equals_cpu_on_every_uniform():
    k = torch.arange(1 << 23, dtype=torch.int64)
    bits = (k << 9) | (k & 0x1FF)  # the low 9 bits are dropped; vary them anyway
    cpu = torch.ops.flashsampling._gumbel_from_bits(bits)
    gpu = torch.ops.flashsampling._gumbel_from_bits(bits.cuda()).cpu()
    differ = (_bits(cpu) != _bits(gpu)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} uniforms differ, first k = {k[differ[:4]].tolist()}"
    assert torch.isfinite(gpu).all()


def test_gumbel_from_bits_cuda_rejects_out_of_range_bits():
    with pytest.raises(RuntimeError, match="bits values must lie in"):
        torch.ops.flashsampling._gumbel_from_bits(torch.tensor([-1], device="cuda"))


def test_gumbel_upper_bound_cuda_equals_cpu_on_every_uniform():
    """The skip bound the fused kernels use (fs_gumbel_upper_bound_from_bits) is the CPU op's,
    bit for bit; tests/test_noise.py checks the CPU op lies above the noise everywhere."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    bits = (k << 9) | (k & 0x1FF)
    cpu = torch.ops.flashsampling._gumbel_upper_bound(bits)
    gpu = torch.ops.flashsampling._gumbel_upper_bound(bits.cuda()).cpu()
    differ = (_bits(cpu) != _bits(gpu)).nonzero().flatten()
    assert differ.numel() == 0, f"{differ.numel()} uniforms differ, first k = {k[differ[:4]].tolist()}"


def test_uniform_noise_cuda_equals_cpu():
    """flashsampling._uniform_noise (speculative verification's acceptance draws) on CUDA equals
    the CPU op, whose value tests/test_noise.py checks against the torch-ops reference."""
    from test_noise import uniform_noise_coordinates

    args = uniform_noise_coordinates()
    want = torch.ops.flashsampling._uniform_noise(*args)
    got = torch.ops.flashsampling._uniform_noise(*(a.cuda() for a in args))
    assert torch.equal(got.cpu(), want)


def test_tanh_cuda_equals_cpu_on_every_third_float():
    """fs_tanhf (the soft-cap's tanh, philox_gumbel.h) on the GPU == on the CPU, bit for bit: every
    third float of [0, 11] (beyond, the clamp gives 1 on both), both signs, in chunks; through
    _model_logits with scale 1 and soft-cap 1, the tanh alone."""
    last = torch.tensor(11.0, dtype=torch.float32).view(torch.int32).item()
    chunk = 1 << 25
    for first in range(0, last + 1, chunk * 3):
        bits = torch.arange(first, min(first + chunk * 3, last + 1), 3, dtype=torch.int32)
        x = torch.cat([bits, bits | torch.iinfo(torch.int32).min]).view(torch.float32)
        cpu = torch.ops.flashsampling._model_logits(x, 1.0, 1.0)
        gpu = torch.ops.flashsampling._model_logits(x.cuda(), 1.0, 1.0).cpu()
        differ = (_bits(cpu) != _bits(gpu)).nonzero().flatten()
        assert differ.numel() == 0, f"{differ.numel()} inputs differ, first x = {x[differ[:4]].tolist()}"


@pytest.mark.parametrize("scale,softcap", [(1.0, 30.0), (0.5, 8.0), (4.0, None), (1.0 / 3.0, 2.5)])
def test_model_logits_cuda_equals_cpu(scale, softcap):
    generator = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(1 << 22, generator=generator) * 50,
                   torch.randint(-0x7F800000, 0x7F800000, (1 << 22,), generator=generator,
                                 dtype=torch.int32).view(torch.float32),
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])])
    cpu = torch.ops.flashsampling._model_logits(x, scale, softcap)
    gpu = torch.ops.flashsampling._model_logits(x.cuda(), scale, softcap).cpu()
    same = (_bits(cpu) == _bits(gpu)) | (torch.isnan(cpu) & torch.isnan(gpu))
    assert same.all(), f"{(~same).sum().item()} inputs differ, first x = {x[~same][:4].tolist()}"
