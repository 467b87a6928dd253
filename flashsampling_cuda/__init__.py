"""FlashSampling: exact LLM token sampling fused into the LM-head GEMM.

``sample(hidden, weight, ...)`` is the API; ``torch.ops.flashsampling.sample`` (and
``sample_with_scores``, which also returns scores and log-probabilities) the op.
"""

import torch  # noqa: F401  (loads libtorch/libc10, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.flashsampling)
from .penalties import PenaltyState
from .speculative import SpeculativeOutput, speculative_sample
from .sampling import (
    SampleOutput,
    ScoredSample,
    pack_allowed_mask,
    sample,
    sample_from_logits,
    sample_with_scores,
    sample_without_replacement,
)
from . import distributed, grouped  # noqa: E402  (tensor-parallel and grouped sampling)

__all__ = ["sample", "sample_with_scores", "sample_from_logits", "sample_without_replacement", "pack_allowed_mask",
           "PenaltyState", "speculative_sample", "SpeculativeOutput", "SampleOutput", "ScoredSample"]
__version__ = "0.1.0"
