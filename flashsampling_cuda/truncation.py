"""Exact top-k / top-p / min-p truncation: the semantics, and the three paths that sample it.

Per row, from the transformed logits ``y`` of the op (``x`` = logits plus biases,
``y = fl32(x * fl32(1 / T))``, ``y = x`` for a greedy row) over the allowed tokens:

1. keep the ``top_k`` largest ``y`` (exact ties to the smaller index);
2. keep the shortest prefix of those, in that order, whose softmax probabilities add up
   to ``top_p`` (the top token always stays);
3. drop the tokens whose probability is below ``min_p`` times the top token's.

All three keep a prefix of the order (``y`` descending, index ascending), so the
survivors are the first ``n`` tokens of it, ``n >= 1``. Each sample is the Gumbel-Max
winner among the survivors with the noise of plain sampling: an exact sample of
``softmax(y)`` restricted to the survivors, and for a row whose truncation is off exactly
the token of plain sampling.

Paths (:func:`choose_truncation_path`; ``truncation_path=`` of ``sample`` picks one):

- ``"fused_top_k"`` (CUDA: a host ``top_k <= 64``; on sm90 every form): the GEMM keeps four
  candidates per vocabulary tile and ``sample_top_k``'s second kernel truncates and samples the
  rows they decide (``top_k <= 64``, or a top_p / min_p cut within the first 64 tokens); the
  GEMM also stores the logits, from which ``sample_from_logits``'s kernel samples the other rows.
- ``"logits"`` (CUDA, every other form): the fp32 logits once (:func:`materialized_logits`),
  then ``torch.ops.flashsampling.sample_from_logits`` (csrc/kernels/sample_from_logits.cu):
  per row a radix select on the truncation order and Gumbel-Max over the survivors, in one
  kernel, with no host sync. The weight is read once.
- ``"materialized"`` (CPU, and the reference on CUDA): the fp32 logits, :func:`survivor_mask`
  in float64 torch ops (a top-k selection per row for a host ``top_k``, else a stable sort of
  every row), and the fused op samples with the survivors as its ``allowed_mask``: the weight
  is read twice, memory ``O(B V)``. On the CPU the sample is drawn from the materialised
  logits instead (``torch.ops.flashsampling._sample_logits``), so there is one matmul in all,
  and a host ``top_k`` takes one ``torch.topk`` of the logits where that decides the survivors
  exactly (:func:`_host_top_k_mask`).

Nothing reads a device tensor's values on the host, so every path runs under
``torch.compile`` and CUDA-graph capture, except: a user ``allowed_mask`` without
``empty_mask_token`` still makes the op check the mask for empty rows (a host sync, as
without truncation), and per-row parameters in CPU tensors are checked on the host and
copied to the device (under capture, pass device tensors).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import Tensor

from .masks import int32_words, pack_allowed_mask, unpack_allowed_mask

__all__ = ["Truncation", "parse_truncation", "TRUNCATION_PATHS", "choose_truncation_path", "fused_top_k_takes", "fused_top_k_args",
           "logits_path_args", "logits_truncation_args", "FUSED_TOP_K_MAX", "materialized_logits", "transformed_logits", "scaled_logits",
           "survivor_mask", "TRUNCATION_ORDERS", "truncation_rank", "truncated_allowed_mask", "logits_allowed_mask", "sample_from_logits_cpu"]

# Elements of the fp32 weight copy per matmul where no fp32-output matmul exists.
_FALLBACK_CHUNK_ELEMENTS = 1 << 24
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm(..., out_dtype=), torch >= 2.8


class Truncation(NamedTuple):
    """Truncation parameters that may be on: a host scalar that is on, or a 0-d / ``[B]``
    tensor (its values are not read on the host); None where off."""

    top_k: int | Tensor | None
    top_p: float | Tensor | None
    min_p: float | Tensor | None


def _parameter(name: str, value, *, integer: bool, is_valid, valid_text: str, is_off, hidden: Tensor, op: str):
    """One validated truncation parameter: None when off (None or an off host scalar), a
    host scalar, or the tensor (0-d or [B], on hidden's device or the CPU)."""
    prefix = f"{op}: {name}"
    if value is None:
        return None
    if isinstance(value, Tensor):
        dtype_ok = (not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool
                    if integer else value.is_floating_point())
        if not dtype_ok:
            raise TypeError(f"{prefix} must be {'an integer' if integer else 'a floating'} tensor, got {value.dtype}")
        batch = hidden.shape[0]
        if value.dim() != 0 and tuple(value.shape) != (batch,):
            raise ValueError(f"{prefix} must be a scalar, a 0-d tensor or a [B] = [{batch}] tensor, "
                             f"got shape {list(value.shape)}")
        if value.device != hidden.device and value.device.type != "cpu":
            raise ValueError(f"{prefix} must be on the CPU or on hidden's device ({hidden.device}), got {value.device}")
        # Host values are checked, as the op checks host temperatures; device values are
        # not (a sync), nor under torch.compile (data-dependent): see survivor_mask.
        if value.device.type == "cpu" and not torch.compiler.is_compiling():
            bad = ~is_valid(value.reshape(-1))
            if bad.any():
                row = int(bad.nonzero()[0, 0])
                raise ValueError(f"{prefix} must be {valid_text}, got {value.reshape(-1)[row].item()} in row {row}")
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        kind = "an int" if integer else "a float"
        raise TypeError(f"{prefix} must be {kind} or a tensor, got {type(value).__name__}")
    scalar = int(value) if integer else float(value)
    if not is_valid(scalar):
        raise ValueError(f"{prefix} must be {valid_text}, got {value}")
    return None if is_off(scalar) else scalar


def parse_truncation(top_k, top_p, min_p, hidden: Tensor, op: str = "flashsampling.sample") -> Truncation | None:
    """Validates ``top_k`` (integer >= -1; -1 and 0: off), ``top_p`` (in (0, 1]; 1: off)
    and ``min_p`` (in [0, 1]; 0: off), each None, a host scalar, a 0-d tensor or a ``[B]``
    tensor; returns None when every one is known on the host to be off. Errors name ``op``."""
    truncation = Truncation(
        _parameter("top_k", top_k, integer=True, is_valid=lambda k: k >= -1, valid_text="an integer >= -1 "
                   "(-1 or 0: off)", is_off=lambda k: k <= 0, hidden=hidden, op=op),
        _parameter("top_p", top_p, integer=False, is_valid=lambda p: (p > 0) & (p <= 1), valid_text="in (0, 1] "
                   "(1: off)", is_off=lambda p: p == 1, hidden=hidden, op=op),
        _parameter("min_p", min_p, integer=False, is_valid=lambda p: (p >= 0) & (p <= 1), valid_text="in [0, 1] "
                   "(0: off)", is_off=lambda p: p == 0, hidden=hidden, op=op),
    )
    return None if all(parameter is None for parameter in truncation) else truncation


# The fused top-k pass (csrc/kernels/truncate_candidates.cu): stage 2 decides rows with k up to
# kMaxFusedTopK (and rows without top_k whose cut lies within that many tokens; on sm90 also rows
# with k up to kMaxFusedLargeTopK), for
# vocabularies whose candidates fit its shared memory (4 per 64-token tile, 12 bytes each, plus
# 12 per tile, in 216 KiB: V <= 229376 on 64-token tiles) and are large enough for the tiles to
# matter. Every other row is sampled from logits the GEMM stores in the same pass (sm90).
FUSED_TOP_K_MAX = 64
FUSED_LARGE_TOP_K_MAX = 1024
FUSED_MIN_VOCAB = 4096
FUSED_MAX_VOCAB = 229376
# Architectures (major * 10 + minor) whose fused pass also stores the logits for the rows stage 2
# leaves: there it takes every truncation form (elsewhere a host top_k <= 64 only) and the fused
# top-N logprobs (logprobs.py).
FUSED_ARCHS = (90,)


def cuda_arch(device: torch.device) -> int:
    """major * 10 + minor of a CUDA device; 0 where it cannot be asked (no GPU in this process)."""
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except (RuntimeError, AssertionError, ValueError):
        return 0
    return major * 10 + minor


def _stage2_decides_every_row(k) -> bool:
    """A host top_k (as :func:`_host_top_k` gives it) with which the fused pass's stage 2 decides
    every row (sampler_params.h: fused_truncation_decides_every_row)."""
    return isinstance(k, int) and 1 <= k <= FUSED_TOP_K_MAX


def _host_top_k(truncation: Truncation, vocab: int):
    """``top_k`` as the fused op takes it: a host int >= V keeps every token (off: None)."""
    k = truncation.top_k
    return None if isinstance(k, int) and k >= vocab else k


def fused_top_k_takes(truncation: Truncation, hidden: Tensor, weight: Tensor, op_kwargs: dict) -> bool:
    """Whether the fused top-k pass can take this call: CUDA, bf16/fp16, ``4096 <= V <= 229376``,
    no sparse bias, and a host int ``top_k`` in ``[1, 64]`` (any GPU) or, on sm90, any form
    (``[B]`` top_k, top_k above 64, top_p / min_p alone)."""
    vocab = weight.shape[0]
    if (hidden.device.type != "cuda" or hidden.dtype not in (torch.bfloat16, torch.float16)
            or not FUSED_MIN_VOCAB <= vocab <= FUSED_MAX_VOCAB or op_kwargs["sparse_bias_ids"] is not None):
        return False
    return (_stage2_decides_every_row(_host_top_k(truncation, vocab))
            or cuda_arch(hidden.device) in FUSED_ARCHS)


# Up to this many rows "auto" takes a host top_k above FUSED_LARGE_TOP_K_MAX alone to the fused
# pass, whose GEMM then draws plain sampling's tile winners (it can up to 64 rows: the CUTLASS
# schedules' top-k scan).
# There it wins on peaked (LLM-like) rows, whose plain token stage 2 finds among their first 64,
# and loses a little on flat rows, which go on to the cut kernel after a GEMM that drew the
# winners; from 16 rows on it no longer wins on either (measurements: docs/truncation.md).
FUSED_LARGE_TOP_K_MAX_BATCH = 4


def fused_pass_preferred(truncation: Truncation, hidden: Tensor, weight: Tensor, op_kwargs: dict) -> bool:
    """Where both can take a call, whether "auto" prefers the fused pass to the logits path: every
    form but a host top_k above FUSED_LARGE_TOP_K_MAX, which takes it only up to
    FUSED_LARGE_TOP_K_MAX_BATCH rows, alone, of one sample and with a batch-wide seed and offset
    (the GEMM then draws the tile winners): stage 2 decides such a row only when plain sampling's
    token lies among the row's first 64 tokens (a peaked row, usually), and without the winners
    it decides none. A host top_k up to FUSED_LARGE_TOP_K_MAX is selected in stage 2 at every
    batch. top_p / min_p without top_k take it at every batch: on LLM-like rows (few survivors)
    stage 2 decides nearly every row, and the rows it leaves stream (min_p) or take the logits
    kernel from the stored logits; only flat top_p rows at B >= 128 cost a little more than on the
    logits path (docs/truncation.md)."""
    k = _host_top_k(truncation, weight.shape[0])
    if not isinstance(k, int) or k <= FUSED_LARGE_TOP_K_MAX:
        return True
    seed, offset = op_kwargs["seed"], op_kwargs["offset"]
    return (hidden.shape[0] <= FUSED_LARGE_TOP_K_MAX_BATCH and truncation.top_p is None and truncation.min_p is None
            and op_kwargs["num_samples"] == 1 and (seed is None or seed.dim() == 0)
            and (offset is None or offset.dim() == 0) and cuda_arch(hidden.device) in FUSED_ARCHS)


# The [B] dtypes the ops take as they are (the CUDA ops widen int32 / float32 in one small launch,
# which in the fused pass also zeroes its fallback row list: vLLM's and FlashInfer's dtypes cost
# no conversion); others convert.
ROW_TOP_K_DTYPES = (torch.int32, torch.int64)
ROW_PROBABILITY_DTYPES = (torch.float32, torch.float64)


def fused_top_k_args(truncation: Truncation, hidden: Tensor, weight: Tensor) -> dict:
    """The truncation arguments of ``torch.ops.flashsampling.sample_top_k`` for a call it takes
    (:func:`fused_top_k_takes`): host scalars, tensors as ``[B]`` on hidden's device
    (:func:`_row_array`)."""
    k = _host_top_k(truncation, weight.shape[0])
    args = {"top_k": k if isinstance(k, int) else 0}
    batch = hidden.shape[0]
    for name, value in (("top_k", k), ("top_p", truncation.top_p), ("min_p", truncation.min_p)):
        if isinstance(value, Tensor):
            args[name + "s"] = _row_array(value, name, batch, hidden.device)
        elif value is not None and name != "top_k":
            args[name] = float(value)
    return args


def _row_array(value: Tensor, name: str, batch: int, device: torch.device) -> Tensor:
    """A 0-d or [B] truncation tensor as the ops' [B] argument on ``device``: int32 / int64
    ``top_ks`` and float32 / float64 ``top_ps`` / ``min_ps`` keep their dtype, others become
    int64 / float64."""
    dtypes = ROW_TOP_K_DTYPES if name == "top_k" else ROW_PROBABILITY_DTYPES
    dtype = value.dtype if value.dtype in dtypes else dtypes[-1]
    return value.to(device=device, dtype=dtype).expand(batch).contiguous()


TRUNCATION_PATHS = ("auto", "fused_top_k", "logits", "materialized")
LOGITS_PATH_MAX_VOCAB = 1 << 22  # sample_from_logits.h: kLogitsSamplerMaxVocab


def choose_truncation_path(requested: str, truncation: Truncation, hidden: Tensor, weight: Tensor,
                           op_kwargs: dict) -> str:
    """The path that samples a truncated call (module docstring): ``requested`` when it can
    take the call (else ValueError naming ``truncation_path``), or for ``"auto"`` the fused
    top-k pass where it can run (docs/truncation.md has the measurements), the logits path on
    CUDA, and the materialised path on the CPU."""
    if requested not in TRUNCATION_PATHS:
        raise ValueError(f"flashsampling.sample: truncation_path must be one of {', '.join(TRUNCATION_PATHS)}, "
                         f"got {requested!r}")
    fused_ok = fused_top_k_takes(truncation, hidden, weight, op_kwargs)
    # The logits path takes what the fused op takes on CUDA (bf16 / fp16: fp32 logits of fp32
    # inputs would come from a matmul that may run in TF32) and the vocabularies of its kernel.
    on_cuda = (hidden.device.type == "cuda" and hidden.dtype in (torch.bfloat16, torch.float16)
               and weight.shape[0] <= LOGITS_PATH_MAX_VOCAB)
    if requested == "auto":
        fused = fused_ok and (not on_cuda or fused_pass_preferred(truncation, hidden, weight, op_kwargs))
        return "fused_top_k" if fused else "logits" if on_cuda else "materialized"
    if requested == "fused_top_k" and not fused_ok:
        raise ValueError("flashsampling.sample: truncation_path='fused_top_k' needs CUDA, bfloat16/float16, "
                         f"{FUSED_MIN_VOCAB} <= V <= {FUSED_MAX_VOCAB}, no sparse_logit_bias, and a host int top_k "
                         f"in [1, {FUSED_TOP_K_MAX}] below V unless the GPU is sm90 (which takes every form)")
    if requested == "logits" and not on_cuda:
        raise ValueError("flashsampling.sample: truncation_path='logits' runs on CUDA only, with bfloat16/float16 "
                         f"and V <= {LOGITS_PATH_MAX_VOCAB} (elsewhere 'materialized' takes the call)")
    return requested


def logits_path_args(truncation: Truncation, hidden: Tensor, weight: Tensor, op_kwargs: dict) -> dict:
    """The arguments of ``torch.ops.flashsampling.sample_from_logits`` that differ from the
    fused op's for this call: the fp32 logits (:func:`materialized_logits`; with a sparse bias,
    both biases added here, since that op takes none), the dense ``logit_bias`` otherwise, and
    the truncation as host scalars or ``[B]`` tensors on hidden's device (:func:`_row_array`); and
    ``raw_logits``, the matmul's own logits, for the logprob outputs (not an argument of the op:
    sampling._call_op leaves it out)."""
    raw = logits = materialized_logits(hidden, weight)
    bias = op_kwargs["logit_bias"]
    if op_kwargs["sparse_bias_ids"] is not None:
        logits = transformed_logits(logits, bias, op_kwargs["sparse_bias_ids"], op_kwargs["sparse_bias_values"],
                                    op_kwargs["vocab_start"])
        bias = None
    return {"logits": logits, "logit_bias": bias, "raw_logits": raw,
            **logits_truncation_args(truncation, hidden.shape[0], hidden.device)}


def logits_truncation_args(truncation: Truncation | None, batch: int, device: torch.device) -> dict:
    """``sample_from_logits``'s truncation arguments: host scalars as they are, tensors as
    ``[B]`` on ``device`` (:func:`_row_array`)."""
    args = {}
    if truncation is None:
        return args
    for name, value in (("top_k", truncation.top_k), ("top_p", truncation.top_p), ("min_p", truncation.min_p)):
        if isinstance(value, Tensor):
            args[name + "s"] = _row_array(value, name, batch, device)
        elif value is not None:
            args[name] = value
    return args


def _chunked_fp32_logits(hidden: Tensor, weight: Tensor, chunk: int) -> Tensor:
    """fp32 ``hidden @ weight.T`` by fp32 matmuls over vocabulary chunks of ``chunk`` rows
    (bounds the fp32 copy of the weight)."""
    hidden_f = hidden.float().contiguous()
    vocab = weight.shape[0]
    return torch.cat([torch.mm(hidden_f, weight[begin : begin + chunk].float().t())
                      for begin in range(0, vocab, chunk)], dim=1)


def materialized_logits(hidden: Tensor, weight: Tensor) -> Tensor:
    """The fp32 logits ``hidden @ weight.T``, float32 ``[B, V]``, as the op computes them.

    CPU: bit for bit the op's (``torch.ops.flashsampling._logits``, the op's own dot-product
    kernel, csrc/torch/logits_cpu.h; tests/test_truncation.py checks the scores bit for bit).
    CUDA: one cuBLAS matmul with fp32
    accumulation and fp32 output (``torch.mm(..., out_dtype=torch.float32)``, no fp32 copy
    of the weight); it sums in another order than the fused kernel, so a token can differ
    from the kernel's only where two scores, or a truncation boundary, are within fp32
    rounding. Without ``out_dtype`` (torch < 2.8) or for fp32 inputs: fp32 matmuls over
    vocabulary chunks.
    """
    dim = hidden.shape[1]
    if hidden.device.type == "cpu":
        return torch.ops.flashsampling._logits(hidden, weight)
    if _HAS_MM_OUT_DTYPE and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return _chunked_fp32_logits(hidden, weight, max(1, _FALLBACK_CHUNK_ELEMENTS // max(dim, 1)))


def transformed_logits(
    logits: Tensor,
    logit_bias: Tensor | None = None,
    sparse_bias_ids: Tensor | None = None,
    sparse_bias_values: Tensor | None = None,
    vocab_start: int = 0,
    distinct_ids: bool = False,
) -> Tensor:
    """``x`` of the op (csrc/torch/checks.h), float32 ``[B, V]``, from fp32 ``logits [B, V]``:
    ``x = fl32(fl32(logit + logit_bias[v]) + s)`` where ``s`` is the fp32 sum, in list
    order from 0, of the row's sparse values with id ``vocab_start + v`` (each term only
    when given). ``logit_bias`` float32 ``[V]``; ``sparse_bias_ids`` int ``[B, K]`` global
    ids, ``sparse_bias_values`` float32 ``[B, K]``. ``distinct_ids``: the caller knows each
    row's ids are distinct (a PenaltyState's): one scatter instead of one per list position."""
    x = logits if logit_bias is None else logits + logit_bias
    if sparse_bias_ids is None or sparse_bias_ids.numel() == 0:
        return x
    batch, vocab = x.shape
    local = sparse_bias_ids.to(torch.int64) - vocab_start
    column = torch.where((local >= 0) & (local < vocab), local, vocab)  # ids elsewhere go to a spare column
    sums = x.new_zeros(batch, vocab + 1)
    if distinct_ids:  # one entry an id: one add each, whatever the order (ids outside share the spare column)
        sums.scatter_add_(1, column, sparse_bias_values.to(sums.dtype))
    else:
        for k in range(column.shape[1]):  # one id per row at a time: fp32 adds in list order, deterministic
            sums.scatter_add_(1, column[:, k : k + 1], sparse_bias_values[:, k : k + 1])
    hit = torch.zeros_like(sums, dtype=torch.bool).scatter_(1, column, True)
    return torch.where(hit[:, :vocab], x + sums[:, :vocab], x)


def scaled_logits(x: Tensor, temperature: float, temperatures: Tensor | None) -> Tensor:
    """``y = fl32(x * fl32(1 / T_b))`` of fp32 ``x [B, V]``, ``y = x`` for a greedy row
    (``T_b = 0``); ``temperatures`` float32 ``[B]`` overrides the scalar, as in the op."""
    if temperatures is None:  # one multiply (no [B] temperatures, no select)
        if temperature == 0:
            return x
        inv_temperature = torch.ones((), dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
        return x * inv_temperature  # a 0-d CPU tensor: a scalar of the kernel, no copy
    # fs_inv_temperature's fl32(1 / T) per row, 1 on a greedy row (fl32(x * 1) = x).
    return x * temperature_scales(x.shape[0], temperature, temperatures, x.device)[:, None]


def temperature_scales(batch: int, temperature: float, temperatures: Tensor | None, device: torch.device) -> Tensor:
    """float32 ``[B]``: the factor :func:`scaled_logits` applies to each row, ``fl32(1 / T_b)``,
    1 on a greedy row (``fl32(x * 1) = x``)."""
    if temperatures is None:
        # greedy where T rounds to 0 in float32, as the kernels read it (fs_inv_temperature)
        t = torch.tensor(temperature, dtype=torch.float32)
        scale = float(torch.where(t == 0, torch.ones(()), torch.ones((), dtype=torch.float32) / t))
        return torch.full((batch,), scale, dtype=torch.float32, device=device)
    temperatures = temperatures.to(device)
    return torch.where(temperatures == 0, 1.0, torch.ones_like(temperatures) / temperatures)


def _per_row(value: int | float | Tensor, batch: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A truncation parameter as a ``[B, 1]`` tensor of ``dtype`` on ``device``."""
    if not isinstance(value, Tensor):
        return torch.full((batch, 1), value, dtype=dtype, device=device)
    return value.to(device=device, dtype=dtype).expand(batch)[:, None]


_NAN_RANK = 2**31  # order_rank of NaN: above every number


def order_rank(key: Tensor) -> Tensor:
    """int64 ranks of fp32 ``key`` in ``torch.sort``'s ascending order: -0 folded into +0,
    NaN (all equal) above every number. ``rank * 2^31 + index`` (index < 2^31) orders like
    a stable sort."""
    bits = (key + 0.0).view(torch.int32).to(torch.int64)
    rank = torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))
    return torch.where(torch.isnan(key), _NAN_RANK, rank)


def key_of_rank(rank: Tensor) -> Tensor:
    """The fp32 key of an :func:`order_rank` (NaN for the NaN rank and above)."""
    bits = torch.where(rank >= 0, rank, (-rank) | 0x80000000)
    bits = torch.where(rank >= _NAN_RANK, 0x7FC00000, bits)
    return int32_words(bits).view(torch.float32)


def _first_in_order(rank: Tensor, k: int) -> Tensor:
    """Indices ``[B, k]`` of the first ``k`` entries of a row in the order of the int64
    ``rank`` (ascending, ties to the smaller index) without sorting whole rows: one ``topk``
    over ``rank * 2^31 + index`` (ranks within ``[-2^31, 2^31]``)."""
    index = torch.arange(rank.shape[1], device=rank.device)
    return torch.topk(rank * 2**31 + index, k, dim=1, largest=False, sorted=True).indices


def truncation_key(y: Tensor, allowed: Tensor | None) -> Tensor:
    """fp32 ``[B, V]`` key from which :func:`keep_prefix` reads ``y`` back: ``-y``; an allowed
    NaN +inf (no mass, as ``-inf``), an excluded token NaN. The order itself is
    :func:`truncation_rank`'s, which also places an allowed NaN after ``-inf``."""
    key = torch.where(torch.isnan(y), torch.inf, -y)
    return key if allowed is None else torch.where(allowed, key, torch.nan)


# The rank of an allowed NaN y: after every number (-inf's rank is order_rank(+inf)), before the
# excluded tokens (_NAN_RANK), as the kernels' keys order them (candidate_math.cuh, order_bits).
_NAN_Y_RANK = 0x7F800001


def truncation_rank(y: Tensor, allowed: Tensor | None) -> Tensor:
    """int64 ``[B, V]`` ranks of the truncation order, first = smallest, ties to the smaller
    index: ``y`` descending, an allowed NaN after every number (``-inf`` included), an excluded
    token after every allowed one."""
    rank = torch.where(torch.isnan(y), _NAN_Y_RANK, order_rank(torch.where(torch.isnan(y), 0.0, -y)))
    return rank if allowed is None else torch.where(allowed, rank, _NAN_RANK)


TRUNCATION_ORDERS = ("top_k_first", "min_p_first", "joint")


def keep_prefix(sorted_key: Tensor, keep: Tensor, truncation: Truncation, order: str = "top_k_first",
                all_mass: Tensor | None = None) -> Tensor:
    """``keep`` (bool ``[B, w]``, the top-k survivors of a row's first ``w`` tokens in
    order, whose :func:`truncation_key` is ``sorted_key``) narrowed by ``top_p`` and
    ``min_p``, float64 probabilities from the fp32 ``y``; the first token always stays.

    ``order`` picks what top_p's probabilities are normalised over (every cut keeps a prefix
    of the order, and min_p's ratios to the first token do not depend on it): the top_k
    survivors (``"top_k_first"``), those that also pass min_p (``"min_p_first"``, vLLM), or every
    allowed token (``"joint"``, SGLang / FlashInfer; ``all_mass [B]``: their probabilities over the
    first token's, summed, where the first ``w`` are not all of them)."""
    if truncation.top_p is None and truncation.min_p is None:
        return keep
    batch, width = sorted_key.shape
    device = sorted_key.device
    rank = torch.arange(width, device=device)
    y_all = torch.where(torch.isnan(sorted_key), -torch.inf, -sorted_key.double())
    y_sorted = torch.where(keep, y_all, -torch.inf)  # the top_k survivors
    ratio = torch.exp(y_sorted - y_sorted[:, :1])  # probability / the top token's (NaN: +-inf top)
    base = ratio
    if truncation.min_p is not None:
        min_p = _per_row(truncation.min_p, batch, torch.float64, device)
        keep = keep & ((ratio >= min_p) | (rank == 0))
        if order == "min_p_first":
            base = torch.where(keep, ratio, 0.0)
    if truncation.top_p is not None:
        top_p = _per_row(truncation.top_p, batch, torch.float64, device)
        if order == "joint":
            base = torch.exp(y_all - y_all[:, :1])
            total = base.sum(dim=1, keepdim=True) if all_mass is None else all_mass[:, None]
        else:
            total = base.sum(dim=1, keepdim=True)
        probs = base / total
        # Mass of the tokens ahead (an exclusive sum, not cumsum - probs, which rounds).
        before = torch.cat([torch.zeros_like(probs[:, :1]), torch.cumsum(probs, dim=1)[:, :-1]], dim=1)
        keep = keep & ((before < top_p) | (top_p >= 1) | (rank == 0))
    return keep


def survivor_mask(y: Tensor, allowed: Tensor | None, truncation: Truncation, order: str = "top_k_first") -> Tensor:
    """The survivors of top-k, then top-p, then min-p (module docstring; ``order``: what top_p
    is normalised over, :func:`keep_prefix`), bool ``[B, V]``.

    Args:
        y: float32 ``[B, V]`` transformed logits (:func:`scaled_logits`).
        allowed: bool ``[B, V]`` allowed tokens, or None (all). Only allowed tokens count
            towards ``top_k`` and the probabilities; the survivors are allowed tokens.
        truncation: the parameters; in tensors, ``top_k <= 0``, ``top_p >= 1`` and
            ``min_p <= 0`` are off, and values beyond the other bound (``top_p <= 0``,
            ``min_p > 1``, NaN) keep the top token only (device values are never checked).

    The probabilities are float64, from the fp32 ``y`` of the ``top_k`` survivors. A row's
    top token (the first of the order) always survives, so a row with an allowed token
    keeps at least one.
    """
    batch, vocab = y.shape
    device = y.device
    key, rank = truncation_key(y, allowed), truncation_rank(y, allowed)
    all_mass = None
    if isinstance(truncation.top_k, int) and truncation.top_k < vocab:
        ranked = _first_in_order(rank, truncation.top_k)  # a host top_k: only the first k ranks can survive
        if order == "joint" and truncation.top_p is not None:
            excluded = torch.isnan(y) if allowed is None else torch.isnan(y) | ~allowed
            y_allowed = torch.where(excluded, -torch.inf, y.double())
            y0 = y_allowed.amax(dim=1, keepdim=True)  # the first token's y
            all_mass = torch.exp(y_allowed - y0).sum(dim=1)
    else:
        ranked = torch.sort(rank, dim=1, stable=True).indices
    sorted_key = key.gather(1, ranked)
    width = ranked.shape[1]
    rank = torch.arange(width, device=device)
    if isinstance(truncation.top_k, Tensor):
        k = _per_row(truncation.top_k, batch, torch.int64, device)
        keep = rank < torch.where(k > 0, k, vocab)
    else:
        keep = torch.ones((batch, width), dtype=torch.bool, device=device)
    keep = keep_prefix(sorted_key, keep, truncation, order, all_mass)
    survivors = torch.zeros((batch, vocab), dtype=torch.bool, device=device).scatter_(1, ranked, keep)
    return survivors if allowed is None else survivors & allowed


def _host_top_k_mask(x: Tensor, allowed: Tensor | None, truncation: Truncation, temperature: float,
                     temperatures: Tensor | None) -> Tensor | None:
    """The bitmask of :func:`truncated_allowed_mask` from one ``torch.topk`` of ``x`` for a host
    int ``top_k`` where that decides the survivors exactly, else None (the general path). Reads
    values on the host, so CPU tensors only, not under torch.compile.

    The temperature scale is positive (or 1: greedy), and fl32 rounding of ``x * s`` is
    monotonic, so every token outside the ``k + 1`` largest ``x`` has ``y`` at most the
    ``(k + 1)``-th's. When the k-th ``y`` is above the ``(k + 1)``-th and no NaN is among them,
    the row's first ``k`` tokens of the truncation order are those ``k``; they are then ordered
    exactly (``y`` descending, ties to the smaller index) as in :func:`survivor_mask`. An
    invalid temperature (the op refuses it afterwards) or a tie at the boundary takes None."""
    k = truncation.top_k
    batch, vocab = x.shape
    if not isinstance(k, int) or not 1 <= k < vocab - 1 or x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    z = x if allowed is None else x.masked_fill(~allowed, -torch.inf)
    top_x, top_index = torch.topk(z, k + 1, dim=1)  # NaN sorts first: caught below
    top_y = scaled_logits(top_x, temperature, temperatures)
    if bool(torch.isnan(top_y).any()) or not bool((top_y[:, k - 1] > top_y[:, k]).all()):
        return None
    key = truncation_key(top_y[:, :k], None)
    ranks = order_rank(key) * 2**31 + top_index[:, :k]  # distinct: a total order
    perm = torch.argsort(ranks, dim=1)
    order, sorted_key = top_index[:, :k].gather(1, perm), key.gather(1, perm)
    keep = keep_prefix(sorted_key, torch.ones_like(order, dtype=torch.bool), truncation)
    # Bits of distinct tokens add up to their OR.
    words = torch.zeros((batch, (vocab + 31) // 32), dtype=torch.int64)
    words.scatter_add_(1, order >> 5, torch.where(keep, torch.ones_like(order) << (order & 31), 0))
    return int32_words(words)


def truncated_allowed_mask(hidden: Tensor, weight: Tensor, op_kwargs: dict, truncation: Truncation,
                           logits: Tensor | None = None, order: str = "top_k_first") -> tuple[Tensor, int | None]:
    """:func:`logits_allowed_mask` of the logits of :func:`materialized_logits` (``logits``,
    when given, are those logits, already computed)."""
    return logits_allowed_mask(materialized_logits(hidden, weight) if logits is None else logits, op_kwargs,
                               truncation, order)


def logits_allowed_mask(logits: Tensor, op_kwargs: dict, truncation: Truncation,
                        order: str = "top_k_first") -> tuple[Tensor, int | None]:
    """``(allowed_mask, empty_mask_token)`` for the op that restrict the sample to the
    survivors: the int32 ``[B, ceil(V / 32)]`` bitmask of :func:`survivor_mask` (within the
    caller's ``allowed_mask``) of fp32 ``logits [B, V]`` transformed with ``op_kwargs`` (the op's
    keyword arguments: biases, temperatures, mask, vocab_start). Without a caller mask,
    ``empty_mask_token`` is -1 where it was None: no row can be empty (the top token stays),
    and the op then skips reading the mask to check (a host sync on CUDA)."""
    vocab = logits.shape[1]
    x = transformed_logits(logits, op_kwargs["logit_bias"],
                           op_kwargs["sparse_bias_ids"], op_kwargs["sparse_bias_values"], op_kwargs["vocab_start"])
    user_mask = op_kwargs["allowed_mask"]
    allowed = None if user_mask is None else unpack_allowed_mask(user_mask, vocab)
    mask = None
    if order == "top_k_first" or truncation.top_p is None:
        mask = _host_top_k_mask(x, allowed, truncation, op_kwargs["temperature"], op_kwargs["temperatures"])
    if mask is None:
        y = scaled_logits(x, op_kwargs["temperature"], op_kwargs["temperatures"])
        mask = pack_allowed_mask(survivor_mask(y, allowed, truncation, order))
    empty_mask_token = op_kwargs["empty_mask_token"]
    if user_mask is None and empty_mask_token is None:
        empty_mask_token = -1
    return mask, empty_mask_token


def sample_from_logits_cpu(logits: Tensor, *, temperature=1.0, temperatures=None, num_samples=1, seed=None,
                           offset=None, generator=None, logit_bias=None, allowed_mask=None, empty_mask_token=None,
                           vocab_start=0, return_logprobs=False, top_k=0, top_ks=None, top_p=1.0, top_ps=None,
                           min_p=0.0, min_ps=None):
    """``torch.ops.flashsampling.sample_from_logits`` on the CPU: the survivors of
    :func:`logits_allowed_mask` as the mask of the CPU op's sample from these logits
    (``torch.ops.flashsampling._sample_logits``: the same noise and scores), so it returns the
    CUDA kernel's tokens and scores bit for bit wherever both keep the same survivors (the
    kernel sums top_p's masses in fixed point)."""
    op_kwargs = dict(temperature=temperature, temperatures=temperatures, num_samples=num_samples, seed=seed,
                     offset=offset, generator=generator, logit_bias=logit_bias, sparse_bias_ids=None,
                     sparse_bias_values=None, allowed_mask=allowed_mask, empty_mask_token=empty_mask_token,
                     vocab_start=vocab_start)
    truncation = Truncation(top_ks if top_ks is not None else (top_k if top_k > 0 else None),
                            top_ps if top_ps is not None else (top_p if top_p < 1 else None),
                            min_ps if min_ps is not None else (min_p if min_p > 0 else None))
    if any(parameter is not None for parameter in truncation):
        op_kwargs["allowed_mask"], op_kwargs["empty_mask_token"] = logits_allowed_mask(logits, op_kwargs, truncation)
    return torch.ops.flashsampling._sample_logits(logits, **op_kwargs, return_logprobs=return_logprobs)
