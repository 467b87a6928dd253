"""The noise of philox_gumbel.h: known answers, accuracy, range, and bit-identity of the
C++ header (torch.ops.flashsampling.*) with the pure-PyTorch port (noise.py)."""

import math
from fractions import Fraction

import pytest
import torch

import flashsampling_cuda  # noqa: F401  (registers the ops)
from flashsampling_cuda import noise

ops = torch.ops.flashsampling

# Philox4x32-10 known-answer vectors (Random123 kat_vectors).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


@pytest.mark.parametrize("philox", [ops._philox4x32_10, noise.philox4x32_10], ids=["cpp", "python"])
def test_philox_known_answers(philox):
    counter = torch.tensor([c for c, _, _ in PHILOX_KAT])
    key = torch.tensor([k for _, k, _ in PHILOX_KAT])
    expected = torch.tensor([r for _, _, r in PHILOX_KAT])
    assert torch.equal(philox(counter, key), expected)


def test_philox_cpp_equals_python_on_random_inputs():
    g = torch.Generator().manual_seed(0)
    counter = torch.randint(0, 2**32, (10000, 4), generator=g)
    key = torch.randint(0, 2**32, (10000, 2), generator=g)
    assert torch.equal(ops._philox4x32_10(counter, key), noise.philox4x32_10(counter, key))


def float_range(lo: float, hi: float, stride: int) -> torch.Tensor:
    """Every `stride`-th fp32 value in [lo, hi] (positive floats order like their bits)."""
    first = torch.tensor(lo, dtype=torch.float32).view(torch.int32).item()
    last = torch.tensor(hi, dtype=torch.float32).view(torch.int32).item()
    bits = torch.cat([torch.arange(first, last, stride, dtype=torch.int32), torch.tensor([last], dtype=torch.int32)])
    return bits.view(torch.float32)


def test_logf_within_2_ulp_over_noise_range():
    # [2^-24, 20] holds every input fs_logf sees: u in [2^-24, 1 - 2^-24] and -log(u) <= 16.7.
    x = float_range(2.0**-24, 20.0, stride=13)  # 1.8e7 of the 2.4e8 floats
    got = ops._logf(x).double()
    exact = torch.log(x.double())
    mag = exact.abs().float()
    ulp = (torch.nextafter(mag, torch.tensor(math.inf)) - mag).double()
    err_ulp = ((got - exact).abs() / ulp).max().item()
    assert err_ulp < 2.0, f"fs_logf error {err_ulp:.3f} ulp"


def test_logf_cpp_equals_python():
    x = float_range(2.0**-24, 20.0, stride=97)
    assert torch.equal(as_bits(ops._logf(x)), as_bits(noise.logf(x)))


def _fma_exact(a: float, b: float, c: float) -> float:
    """Correctly rounded fp32 fma, through exact rationals."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    lo = torch.tensor(float(exact), dtype=torch.float32)  # within an ulp; fix below
    candidates = [torch.nextafter(lo, torch.tensor(-math.inf)), lo, torch.nextafter(lo, torch.tensor(math.inf))]
    best = min(candidates, key=lambda v: (abs(Fraction(v.item()) - exact), v.view(torch.int32).item() & 1))
    return best.item()


def test_fma32_emulation_is_correctly_rounded():
    g = torch.Generator().manual_seed(1)
    a, b, c = (torch.randn(2000, generator=g) * 4 for _ in range(3))
    # Midpoint cases where rounding a*b + c to float64 first would round the wrong way.
    e = 2.0**-12
    a = torch.cat([a, torch.tensor([e * (1 + 2.0**-20), e * (1 + 2.0**-20)])])
    b = torch.cat([b, torch.tensor([e * (1 - 2.0**-20), -e * (1 - 2.0**-20)])])
    c = torch.cat([c, torch.tensor([1 + 2.0**-23, -(1 + 2.0**-23)])])
    got = noise.fma32(a, b, c)
    expected = torch.tensor([_fma_exact(*v) for v in zip(a.tolist(), b.tolist(), c.tolist())])
    assert torch.equal(as_bits(got), as_bits(expected))
    assert got[-2].item() == 1 + 2.0**-23 and got[-1].item() == -(1 + 2.0**-23)


def test_uniforms_strictly_inside_unit_interval():
    grid = torch.arange(0, 2**23, dtype=torch.int64) << 9  # every value bits >> 9 can take
    u = noise.uniform_open01(grid | 0x1FF)  # the low 9 bits are dropped
    assert u.min().item() == 2.0**-24 and u.max().item() == 1 - 2.0**-24
    assert torch.equal(u, noise.uniform_open01(grid))
    g_cpp = ops._gumbel_from_bits(grid)
    assert torch.isfinite(g_cpp).all()
    some = slice(None, None, 7)
    assert torch.equal(as_bits(g_cpp[some]), as_bits(noise.gumbel_from_bits(grid[some])))


def test_gumbel_lanes_equal_one_lane():
    # _gumbel_from_bits runs fs_gumbel_from_bits_lanes<4> (the fused epilogue's form) on groups
    # of four and the one-lane form on the tail: every element must come out the same in any
    # lane, and as a single element.
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**32, (4099,), generator=g)
    grouped = ops._gumbel_from_bits(bits)
    shifted = ops._gumbel_from_bits(bits[1:])  # every element in another lane, or in the tail
    singles = torch.cat([ops._gumbel_from_bits(bits[i : i + 1]) for i in range(0, 4099, 97)])
    assert torch.equal(as_bits(grouped[1:]), as_bits(shifted))
    assert torch.equal(as_bits(grouped[::97]), as_bits(singles))
    assert torch.equal(as_bits(grouped), as_bits(noise.gumbel_from_bits(bits)))


def test_gumbel_noise_cpp_equals_python():
    g = torch.Generator().manual_seed(2)
    stream = torch.randint(0, 2**32, (64, 1), generator=g)
    vocab = torch.randint(0, 2**32, (1, 512), generator=g)
    for seed, offset, sample in [(0, 0, 0), (1234, 7, 3), (2**64 - 1, 2**63 + 5, 2**31), (-5, -1, 9)]:
        cpp = ops.gumbel_noise(
            noise.as_int64_tensor(seed).item(), noise.as_int64_tensor(offset).item(), stream, sample, vocab
        )
        py = noise.gumbel_noise(seed, offset, stream, sample, vocab)
        assert cpp.shape == (64, 512)
        assert torch.equal(as_bits(cpp), as_bits(py)), (seed, offset, sample)


def test_gumbel_noise_is_standard_gumbel():
    g = ops.gumbel_noise(42, 0, torch.arange(8)[:, None], 0, torch.arange(50000)[None, :]).double()
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler-Mascheroni constant
    assert abs(g.var().item() - math.pi**2 / 6) < 0.02


def test_noise_is_a_pure_function_of_coordinates():
    streams = torch.arange(9)[:, None]
    vocab = torch.arange(300)[None, :]
    batch = ops.gumbel_noise(5, 11, streams, 2, vocab)
    # Any sub-batch, any order, any vocab slice: the same value at the same coordinates.
    perm = torch.tensor([7, 2, 8, 0])
    assert torch.equal(ops.gumbel_noise(5, 11, streams[perm], 2, vocab[:, 100:]), batch[perm, 100:])
    for row in range(9):
        assert torch.equal(ops.gumbel_noise(5, 11, torch.tensor(row), 2, vocab[0]), batch[row])
    # Each coordinate changes the value.
    assert not torch.equal(ops.gumbel_noise(6, 11, streams, 2, vocab), batch)
    assert not torch.equal(ops.gumbel_noise(5, 12, streams, 2, vocab), batch)
    assert not torch.equal(ops.gumbel_noise(5, 11, streams, 3, vocab), batch)
    # offset + sample is what counts: (offset 11, sample 2) == (offset 12, sample 1).
    assert torch.equal(ops.gumbel_noise(5, 12, streams, 1, vocab), batch)


def test_gumbel_noise_rejects_out_of_range_coordinates():
    with pytest.raises(RuntimeError, match="stream"):
        ops.gumbel_noise(0, 0, torch.tensor([-1]), 0, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="vocab_index"):
        ops.gumbel_noise(0, 0, torch.tensor([0]), 0, torch.tensor([2**32]))


def test_gumbel_upper_bound_lies_above_the_noise_on_every_uniform():
    """The epilogue-warpgroup kernels skip the logs of an element whose score with this bound
    stays below its column's best (fs_gumbel_upper_bound_from_bits): exact only if the bound lies
    above fs_gumbel_from_bits on every one of the 2^23 uniforms. It is (n + 1) ln 2 + 2^-10 for
    n leading one bits of the uniform, so within ln 2 of the noise where the noise is large."""
    k = torch.arange(1 << 23, dtype=torch.int64)
    bits = (k << 9) | (k & 0x1FF)  # the low 9 bits are dropped; vary them anyway
    noise = ops._gumbel_from_bits(bits).double()
    bound = ops._gumbel_upper_bound(bits)
    slack = bound.double() - noise
    below = (slack <= 0).nonzero().flatten()
    assert below.numel() == 0, f"{below.numel()} uniforms above the bound, first k = {k[below[:4]].tolist()}"
    assert slack[noise >= 5.0].max().item() < math.log(2) + 0.01
    # The formula, from the bits alone: one fma, so float64 then one rounding to float32.
    leading_ones, run = torch.zeros_like(k), torch.ones_like(k, dtype=torch.bool)
    for b in range(22, -1, -1):
        run &= ((k >> b) & 1) == 1
        leading_ones += run
    ln2_up = float(torch.tensor(math.log(2), dtype=torch.float32))
    margin = float(torch.tensor(ln2_up + 2.0**-10, dtype=torch.float32))
    expected = (leading_ones.double() * ln2_up + margin).float()
    assert torch.equal(bound, expected)


def test_gumbel_upper_bound_rejects_out_of_range_bits():
    with pytest.raises(RuntimeError, match="_gumbel_upper_bound: bits values must lie in"):
        ops._gumbel_upper_bound(torch.tensor([1 << 32]))



def uniform_noise_coordinates(count: int = 4096):
    """int64 (seed, offset, stream, sample, vocab_index) of one shape: random, and the edges
    (seeds and offsets past 2^63, the largest stream and vocabulary index, sample past 0)."""
    gen = torch.Generator().manual_seed(17)
    wide = lambda: torch.randint(-2**63, 2**63 - 1, (count,), generator=gen, dtype=torch.int64)  # noqa: E731
    narrow = lambda: torch.randint(0, 2**32, (count,), generator=gen, dtype=torch.int64)  # noqa: E731
    seed, offset, stream, vocab = wide(), wide(), narrow(), narrow()
    sample = torch.randint(0, 8, (count,), generator=gen)
    vocab[:8] = 2**32 - 1
    stream[8:16] = 2**32 - 1
    return seed, offset, stream, sample, vocab


def test_uniform_noise_op_equals_the_reference():
    """noise.uniform_noise (one kernel, philox_gumbel.h's fs_uniform_noise) equals the torch-ops
    reference bit for bit, broadcast arguments and ints included."""
    from flashsampling_cuda.noise import uniform_noise, uniform_noise_reference

    args = uniform_noise_coordinates()
    assert torch.equal(torch.ops.flashsampling._uniform_noise(*args), uniform_noise_reference(*args))
    seeds = torch.tensor([[3], [2**40 + 5]])
    assert torch.equal(uniform_noise(seeds, 7, torch.arange(4), torch.arange(3)[:, None, None], 2**32 - 1),
                       uniform_noise_reference(seeds, 7, torch.arange(4), torch.arange(3)[:, None, None], 2**32 - 1))
    torch.library.opcheck(torch.ops.flashsampling._uniform_noise.default, tuple(a[:64] for a in args))


def fs_tanh(x: torch.Tensor) -> torch.Tensor:
    """fs_tanhf (philox_gumbel.h) elementwise: _model_logits with scale 1 and soft-cap 1 is
    fl(1 * tanh(fl(x * 1))), the tanh alone."""
    return ops._model_logits(x, 1.0, 1.0)


def ulps(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|got - exact| in fp32 ulps of the exact value (its binade's spacing)."""
    _, exponent = torch.frexp(exact)
    return (got.double() - exact).abs() / torch.ldexp(torch.ones_like(exact), exponent - 24)


def test_tanh_within_2_5_ulp():
    # The documented bound (< 2.5 ulp, 2.42 at worst over every float of (0, 11]) on a sample:
    # every 11th float of [2^-30, 11] and the neighbourhood of the worst input.
    sample = float_range(2.0**-30, 11.0, stride=11)
    x = torch.cat([sample, float_range(0.0077, 0.0079, stride=1)])
    err = ulps(fs_tanh(x), torch.tanh(x.double()))
    assert err.max().item() < 2.5, f"fs_tanhf error {err.max().item():.3f} ulp at x = {x[err.argmax()].item()!r}"
    assert (err[:sample.numel()] > 1.0).float().mean().item() < 0.15  # ~11% above an ulp


def test_tanh_is_odd_and_handles_special_values():
    x = float_range(2.0**-30, 11.0, stride=9973)
    assert torch.equal(as_bits(fs_tanh(-x)), as_bits(-fs_tanh(x)))
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 9.5, 9.6, 1e30, -1e30, 2.0**-149, -(2.0**-149)])
    expected = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0, 1.0, 1.0, -1.0, 2.0**-149, -(2.0**-149)])
    assert torch.equal(as_bits(fs_tanh(special)), as_bits(expected))
    assert torch.isnan(fs_tanh(torch.tensor([math.nan]))).all()
    # tanh rounds to 1 from 9.02 on; the clamp at 9.5 keeps that
    assert (fs_tanh(float_range(9.02, 20.0, stride=101)) == 1.0).all()


@pytest.mark.parametrize("scale,softcap", [(1.0, 30.0), (0.25, None), (3.0, 5.0), (1.0, None), (1.0 / 3.0, 2.5)])
def test_model_logits_composes_scale_and_softcap(scale, softcap):
    """_model_logits (the logits route's step 1, fs_model_logit) is fl(l * scale), then
    fl(cap * fs_tanhf(fl(l * fl(1 / cap)))), each only when on: built here from fp32 torch ops
    and fs_tanhf, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(100000, generator=g) * 40,
                   torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-40, -1e30])])
    expected = x * scale if scale != 1.0 else x.clone()
    if softcap is not None:
        inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(softcap, dtype=torch.float32)
        expected = torch.tensor(softcap, dtype=torch.float32) * fs_tanh(expected * inverse)
    assert torch.equal(as_bits(ops._model_logits(x, scale, softcap)), as_bits(expected))
    nan = ops._model_logits(torch.tensor([math.nan]), scale, softcap)
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("softcap", [30.0, 50.0, 2.5, 1e-30, 1e30, 3e38])
def test_softcap_upper_bound_lies_above_the_capped_logit(softcap):
    """The plain epilogue-warpgroup kernel skips the noise of a soft-capped element by
    fs_softcap_upper_bound, without its tanh: exact only if the bound is never below the capped
    logit _model_logits computes (the margins cover its roundings and fs_tanhf's error). Every
    4099th positive float (subnormals to FLT_MAX), their negatives, the neighbourhood of the cap,
    and special values."""
    positive = float_range(2.0**-149, 3.4028234663852886e38, stride=4099)
    near_cap = float_range(softcap * 0.999, min(softcap * 1.001, 3.4028234663852886e38), stride=7)
    x = torch.cat([positive, -positive, near_cap, torch.tensor([0.0, -0.0, math.inf, -math.inf])])
    bound = ops._softcap_upper_bound(x, softcap)
    capped = ops._model_logits(x, 1.0, softcap)
    assert (bound >= capped).all(), x[bound < capped][:5]
    assert (bound[x <= 0] == 0).all() and (bound[x > 0] <= torch.clamp(x[x > 0], max=softcap) * 1.0001 + softcap * 1e-17).all()
    assert torch.isnan(ops._softcap_upper_bound(torch.tensor([math.nan]), softcap)).all()


@pytest.mark.parametrize("scale,softcap,match", [
    (0.0, None, "logit_scale must be finite and > 0"), (math.inf, None, "logit_scale"), (-1.0, None, "logit_scale"),
    (1.0, 0.0, "logit_softcap must be finite and > 0"), (1.0, 1e-39, "logit_softcap"), (1.0, 1e39, "logit_softcap"),
    (1.0, math.nan, "logit_softcap"),
])
def test_model_logits_bad_arguments(scale, softcap, match):
    with pytest.raises(RuntimeError, match=match):
        ops._model_logits(torch.ones(3), scale, softcap)
    with pytest.raises(RuntimeError, match="float32"):
        ops._model_logits(torch.ones(3, dtype=torch.float64), 1.0, None)
