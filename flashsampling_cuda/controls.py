"""The sampling controls: one definition of the keyword arguments the entry points take.

Each entry point spells its keywords out (so that signatures, IDEs and type checkers show
them), and ``tests/test_controls_definition.py`` checks every signature against this table:
the same names in the same order and the same defaults, and that every documented keyword is in
docs/api.md. A new control goes here first, then into the entry points that take it.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Control", "SAMPLING_CONTROLS", "ENTRY_POINTS"]


class Control(NamedTuple):
    name: str
    default: object
    meaning: str


SAMPLING_CONTROLS: tuple[Control, ...] = (
    Control("temperature", 1.0, "float or [B] tensor; 0: greedy"),
    Control("generator", None, "torch.Generator drawing seed and offset when seed is None"),
    Control("seed", None, "int, 0-d or [B] int64 tensor (per row: batch-invariant noise)"),
    Control("offset", None, "int, 0-d or [B] int64 tensor"),
    Control("num_samples", 1, "samples per row"),
    Control("logit_bias", None, "float32 [V], added to the logits"),
    Control("sparse_logit_bias", None, "(ids [B, K], values [B, K]) or B dicts {id: bias}"),
    Control("allowed_mask", None, "int32 [B, ceil(V / 32)] bitmask of the allowed tokens"),
    Control("empty_mask_token", None, "token of a row whose mask allows nothing"),
    Control("return_logprobs", False, "also the log-probabilities and the logsumexp"),
    Control("vocab_start", 0, "global id of column 0 (a vocabulary shard)"),
    Control("top_k", None, "int, 0-d or [B] tensor; -1 or 0: off"),
    Control("top_p", None, "float, 0-d or [B] tensor in (0, 1]; 1: off"),
    Control("min_p", None, "float, 0-d or [B] tensor in [0, 1]; 0: off"),
    Control("truncation_path", "auto", "auto | fused_top_k | logits | materialized"),
    Control("truncation_order", "top_k_first", "top_k_first | min_p_first | joint: top_p's base"),
    Control("check_nan", False, "raise naming rows with non-finite values (host syncs)"),
    Control("logit_scale", 1.0, "model side: raw logits times it"),
    Control("logit_softcap", None, "model side: cap * tanh(l / cap)"),
    Control("repetition_penalty", None, "float, 0-d or [B] tensor; 1: off"),
    Control("frequency_penalty", None, "float, 0-d or [B] tensor; 0: off"),
    Control("presence_penalty", None, "float, 0-d or [B] tensor; 0: off"),
    Control("penalty_state", None, "PenaltyState: the token history"),
    Control("prompt_token_ids", None, "[B, L] ids, the history's prompt (instead of penalty_state)"),
    Control("output_token_ids", None, "[B, L] ids, the history's output (instead of penalty_state)"),
    Control("top_logprobs", 0, "with return_logprobs: the N most probable tokens and ranks"),
    Control("token_ids", None, "with return_logprobs: [B, K] ids whose log-probabilities to return"),
    Control("logprobs_mode", "processed", "processed | raw"),
)

_ALL = tuple(c.name for c in SAMPLING_CONTROLS)
_CORE = ("temperature", "generator", "seed", "offset", "num_samples", "logit_bias", "sparse_logit_bias",
         "allowed_mask", "empty_mask_token", "return_logprobs", "vocab_start", "top_k", "top_p", "min_p")

# What defines the target of a speculative verification (one sample a position, no sparse bias).
_SPECULATIVE = ("temperature", "generator", "seed", "offset", "logit_bias", "allowed_mask", "return_logprobs",
                "vocab_start", "top_k", "top_p", "min_p", "logit_scale", "logit_softcap")

# Entry point -> the controls it takes, in signature order. Defaults differ only where named in
# DEFAULT_EXCEPTIONS (the float64 reference needs an explicit seed).
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "flashsampling_cuda.sample": _ALL,
    "flashsampling_cuda.sample_with_scores": _ALL[: _ALL.index("top_logprobs")],
    "flashsampling_cuda.sample_from_logits": _CORE,
    "flashsampling_cuda.sample_without_replacement": tuple(
        c for c in _CORE if c not in ("num_samples", "return_logprobs")),
    "flashsampling_cuda.distributed.sample": tuple(
        c for c in _ALL if c not in ("vocab_start", "truncation_path", "check_nan")),
    "flashsampling_cuda.speculative_sample": _SPECULATIVE,
    "flashsampling_cuda.distributed.speculative_sample": tuple(c for c in _SPECULATIVE if c != "vocab_start"),
    "flashsampling_cuda.reference.reference_sample": tuple(
        c for c in _CORE if c not in ("generator", "return_logprobs")) + ("truncation_order",),
}
DEFAULT_EXCEPTIONS = {("flashsampling_cuda.reference.reference_sample", "seed"): 0,
                      ("flashsampling_cuda.reference.reference_sample", "offset"): 0}
