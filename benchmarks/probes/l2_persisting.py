"""Does the L2 persisting set-aside keep more of the stored logits in L2?

The top-k scan writes the transformed logits x with an L2 evict_last policy; at B = 16 about 8 of
x's 9.7 MB stay in L2, at B = 64 also about 8 of 39 MB. This probe reads the device's L2 size, its
largest persisting set-aside and the context's current one (driver API), then times the truncation
forms that store x with the set-aside at 0 and at its largest (the context's own, 11.2 MiB on an
H200, lies between), alternating, in one process: CUDA-graph medians of the call and per-kernel
means (torch.profiler).

  python3 benchmarks/probes/l2_persisting.py --batches 16,64 --regimes flat,llm
  python3 benchmarks/probes/l2_persisting.py --one-call 'k20 [B]' 64 flat --set-aside max   (for ncu)
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states, lm_head_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_sampler import median_us
from bench_truncation import FORMS, form_arguments
from stage2_share import kernel_times  # benchmarks/probes/, this script's folder

CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06

_driver = ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def device_attribute(attribute: int) -> int:
    value = ctypes.c_int()
    _check(_driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, torch.cuda.current_device()),
           "cuDeviceGetAttribute")
    return value.value


def persisting_set_aside() -> int:
    value = ctypes.c_size_t()
    _check(_driver.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_PERSISTING_L2_CACHE_SIZE), "cuCtxGetLimit")
    return value.value


def set_persisting_set_aside(nbytes: int) -> None:
    torch.cuda.synchronize()
    _check(_driver.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, ctypes.c_size_t(nbytes)), "cuCtxSetLimit")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--regimes", default="flat,llm")
    parser.add_argument("--forms", default="k20 [B],p0.9 [B],min_p0.05 [B],k1000 (int)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two settings")
    parser.add_argument("--one-call", nargs=3, metavar=("FORM", "B", "REGIME"))
    parser.add_argument("--set-aside", default="0", help="bytes, or max (with --one-call)")
    args = parser.parse_args()
    torch.empty(1, device="cuda")  # the context, current on this thread
    largest = device_attribute(CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE)
    print(f"L2 {device_attribute(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE) / 2**20:.1f} MiB, largest persisting "
          f"set-aside {largest / 2**20:.1f} MiB, current {persisting_set_aside() / 2**20:.1f} MiB", flush=True)
    weight = lm_head_weight(151936, 4096)
    if args.one_call:
        form, batch, regime = args.one_call[0], int(args.one_call[1]), args.one_call[2]
        set_persisting_set_aside(largest if args.set_aside == "max" else int(args.set_aside))
        print(f"set-aside now {persisting_set_aside() / 2**20:.1f} MiB", flush=True)
        hidden = hidden_states(weight, batch, regime, seed=batch)
        temperature, spec = FORMS[form]
        kwargs = form_arguments(spec, batch)
        for _ in range(3):
            flashsampling_cuda.sample(hidden, weight, temperature=temperature, **kwargs)
        torch.cuda.synchronize()
        return
    settings = {"0": 0, "max": largest}
    for regime in args.regimes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            hidden = hidden_states(weight, batch, regime, seed=batch)
            for form in args.forms.split(","):
                temperature, spec = FORMS[form]
                kwargs = form_arguments(spec, batch)

                def call():
                    return flashsampling_cuda.sample(hidden, weight, temperature=temperature, **kwargs)  # noqa: B023

                for round_index in range(args.rounds):
                    for label, nbytes in settings.items():
                        set_persisting_set_aside(nbytes)
                        us = median_us(call, graph=True)
                        parts = kernel_times(call, 10)
                        gemm = parts.get("cutlass", 0.0)
                        rest = sum(parts.values()) - gemm
                        print(f"{regime} B={batch} {form:>16} set-aside {label:>3} round {round_index}: "
                              f"call {us:7.1f} us, GEMM {gemm:6.1f}, other kernels {rest:6.1f}", flush=True)
    set_persisting_set_aside(0)


if __name__ == "__main__":
    main()
