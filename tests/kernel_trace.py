"""Which CUDA kernels a call ran: the tests that check a route (which kernel a dispatch chose,
whether a streaming kernel ran) read the names from torch.profiler through this one helper."""

from __future__ import annotations

import torch


def run_listing_cuda_kernels(call):
    """call()'s result and the names of the CUDA kernels it ran, in launch order (the device
    synchronised inside the profile, so every kernel of the call is recorded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = call()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events() if e.device_type.name == "CUDA"]
