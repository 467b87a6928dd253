"""FlashSampling: exact LLM token sampling fused into the LM-head GEMM.

``sample(hidden, weight, ...)`` is the API; ``torch.ops.flashsampling.sample`` the op.
"""

import torch  # noqa: F401  (loads libtorch/libc10, which _C links against)

from . import _C  # noqa: F401  (registers torch.ops.flashsampling)
from .sampling import sample

__all__ = ["sample"]
__version__ = "0.1.0"
