"""The fake kernels' argument checks (flashsampling_cuda/sampling.py, _check_fake_args) and the
real kernels' (csrc/torch/checks.cpp) reject the same bad inputs with the same message.

The fakes serve torch.compile and the Meta dispatch key (a meta tensor among CPU ones selects
it), so an input the real op rejects must fail there too, with the words a user would see from
the real op. CPU only: each case calls the op once on CPU tensors (the real kernel) and once on
the same tensors on the meta device (the fake), and compares the first line of the errors.

The model-side transforms' checks (logit_scale, logit_softcap) and the penalties' (penalty_ids,
penalty_values, repetition_penalties) are among the cases.

A case may carry a reason to mark it xfail (strict) while a known difference stands; none does.
"""

import pytest
import torch

import flashsampling_cuda  # noqa: F401  (registers the ops and their fakes)

B, V, D = 2, 10, 8


def _h(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


# name -> (hidden, weight, keyword arguments, xfail reason or None)
CASES = {
    "hidden_not_2d": (_h(B, 1, D), _h(V, D), {}, None),
    "weight_not_2d": (_h(B, D), _h(V * D), {}, None),
    "hidden_dtype": (_h(B, D, dtype=torch.int64), _h(V, D, dtype=torch.int64), {}, None),
    "weight_dtype": (_h(B, D), _h(V, D, dtype=torch.float64), {}, None),
    "hidden_weight_d": (_h(B, D), _h(V, D + 1), {}, None),
    "empty_vocabulary": (_h(B, D), _h(0, D), {}, None),
    "num_samples": (_h(B, D), _h(V, D), dict(num_samples=0), None),
    "temperature_negative": (_h(B, D), _h(V, D), dict(temperature=-1.0), None),
    "temperature_nan": (_h(B, D), _h(V, D), dict(temperature=float("nan")), None),
    "vocab_start": (_h(B, D), _h(V, D), dict(vocab_start=-1), None),
    "offset_without_seed": (_h(B, D), _h(V, D), dict(offset=torch.tensor(1)), None),
    "temperatures_dtype": (_h(B, D), _h(V, D), dict(temperatures=torch.ones(B, dtype=torch.float64)),
                           None),
    "temperatures_shape": (_h(B, D), _h(V, D), dict(temperatures=torch.ones(B + 1)), None),
    "seed_dtype": (_h(B, D), _h(V, D), dict(seed=torch.tensor(1, dtype=torch.int32)), None),
    "seed_shape": (_h(B, D), _h(V, D), dict(seed=torch.ones(B + 1, dtype=torch.int64)), None),
    "streams_scalar": (_h(B, D), _h(V, D), dict(streams=torch.tensor(1)), None),
    "streams_dtype": (_h(B, D), _h(V, D), dict(streams=torch.ones(B, dtype=torch.int32)), None),
    "streams_shape": (_h(B, D), _h(V, D), dict(streams=torch.ones(B + 1, dtype=torch.int64)), None),
    "offset_shape": (_h(B, D), _h(V, D), dict(seed=torch.tensor(1), offset=torch.ones(B, 2, dtype=torch.int64)),
                     None),
    "logit_bias_dtype": (_h(B, D), _h(V, D), dict(logit_bias=torch.zeros(V, dtype=torch.float16)), None),
    "logit_bias_shape": (_h(B, D), _h(V, D), dict(logit_bias=torch.zeros(V - 1)), None),
    "sparse_ids_alone": (_h(B, D), _h(V, D), dict(sparse_bias_ids=torch.zeros(B, 3, dtype=torch.int64)), None),
    "sparse_values_alone": (_h(B, D), _h(V, D), dict(sparse_bias_values=torch.zeros(B, 3)), None),
    "sparse_ids_rows": (_h(B, D), _h(V, D), dict(sparse_bias_ids=torch.zeros(B + 1, 3, dtype=torch.int64),
                                                 sparse_bias_values=torch.zeros(B + 1, 3)), None),
    "sparse_ids_dtype": (_h(B, D), _h(V, D), dict(sparse_bias_ids=torch.zeros(B, 3, dtype=torch.int16),
                                                  sparse_bias_values=torch.zeros(B, 3)), None),
    "sparse_values_shape": (_h(B, D), _h(V, D), dict(sparse_bias_ids=torch.zeros(B, 3, dtype=torch.int64),
                                                     sparse_bias_values=torch.zeros(B, 2)), None),
    "allowed_mask_dtype": (_h(B, D), _h(V, D), dict(allowed_mask=torch.zeros(B, 1, dtype=torch.int64)),
                           None),
    "empty_mask_token_range": (_h(B, D), _h(V, D), dict(empty_mask_token=V + 3), None),
    "seed_and_generator": (_h(B, D), _h(V, D), dict(seed=torch.tensor(1), generator=torch.Generator()), None),
    "allowed_mask_shape": (_h(B, D), _h(V, D), dict(allowed_mask=torch.zeros(B, 2, dtype=torch.int32)), None),
    "logit_scale_zero": (_h(B, D), _h(V, D), dict(logit_scale=0.0), None),
    "logit_scale_inf": (_h(B, D), _h(V, D), dict(logit_scale=float("inf")), None),
    "logit_softcap_negative": (_h(B, D), _h(V, D), dict(logit_softcap=-30.0), None),
    "logit_softcap_float32_overflow": (_h(B, D), _h(V, D), dict(logit_softcap=1e39), None),
    "logit_softcap_float32_underflow": (_h(B, D), _h(V, D), dict(logit_softcap=1e-40), None),
    "penalty_ids_dtype": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, 3, dtype=torch.int32)), None),
    "penalty_ids_rows": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B + 1, 3, dtype=torch.int64)), None),
    "penalty_ids_1d": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, dtype=torch.int64)), None),
    "penalty_values_shape": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, 3, dtype=torch.int64),
                                                      penalty_values=torch.zeros(B, 4)), None),
    "penalty_values_dtype": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, 3, dtype=torch.int64),
                                                      penalty_values=torch.zeros(B, 3, dtype=torch.float64)), None),
    "repetition_penalties_shape": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, 3, dtype=torch.int64),
                                                            repetition_penalties=torch.ones(B + 1)), None),
    "repetition_penalties_dtype": (_h(B, D), _h(V, D), dict(penalty_ids=torch.zeros(B, 3, dtype=torch.int64),
                                                            repetition_penalties=torch.ones(B, dtype=torch.int64)),
                                   None),
    "penalty_values_alone": (_h(B, D), _h(V, D), dict(penalty_values=torch.zeros(B, 3)), None),
    "repetition_penalties_alone": (_h(B, D), _h(V, D), dict(repetition_penalties=torch.ones(B)), None),
}

OPS = ["sample", "sample_with_scores"]


def first_error_line(op_name, device, hidden, weight, kwargs):
    """The first line of the op's error on `device` (meta: the fake), or None if it accepts."""
    op = getattr(torch.ops.flashsampling, op_name)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    try:
        op(hidden.to(device), weight.to(device), **moved)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def params():
    for name, (hidden, weight, kwargs, reason) in CASES.items():
        for op_name in OPS:
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(op_name, hidden, weight, kwargs, id=f"{op_name}-{name}", marks=marks)


@pytest.mark.parametrize("op_name, hidden, weight, kwargs", list(params()))
def test_fake_and_real_checks_give_the_same_error(op_name, hidden, weight, kwargs):
    real = first_error_line(op_name, "cpu", hidden, weight, kwargs)
    assert real is not None and real.startswith("flashsampling.sample: "), f"the real op accepted it: {real}"
    fake = first_error_line(op_name, "meta", hidden, weight, kwargs)
    assert fake == real


def test_every_case_is_rejected_by_the_real_op():
    """Each case is a single fault the real kernel reports (so the comparisons above compare errors)."""
    for name, (hidden, weight, kwargs, _) in CASES.items():
        real = first_error_line("sample_with_scores", "cpu", hidden, weight, kwargs)
        assert real is not None, name
