"""Reproduces a compute-sanitizer initcheck report that is not ours: the output of a B = 1
`torch.mm(hidden, weight.t(), out_dtype=torch.float32)` (the logits path's `materialized_logits`)
reads as uninitialised to whatever kernel reads it next, though every element is written
(it matches an fp32 reference). cuBLAS's kernel for M = 1 writes in a way initcheck does not
track; an fp32 `@` and B = 17 / 200 are clean. So initcheck on `sanitizer_shapes.py` reports the
logits path's `sample_from_logits_kernel` reading its input at B = 1; memcheck is the sanitizer
that run relies on.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck --print-limit 1 \\
        python3 benchmarks/probes/initcheck_cublas_m1.py out_dtype 1 1000     # ~1000 errors
    ... initcheck_cublas_m1.py fp32 1 1000 / out_dtype 17 32003             # 0 errors
"""

import sys

import torch

form, batch, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hidden = torch.randn(batch, 64, device="cuda", dtype=torch.bfloat16)
weight = torch.randn(vocab, 64, device="cuda", dtype=torch.bfloat16)
if form == "out_dtype":
    logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
elif form == "fp32":
    logits = hidden.float() @ weight.float().t()
else:
    raise SystemExit(f"form must be out_dtype or fp32, got {form!r}")
reference = hidden.float() @ weight.float().t()  # reads `logits` nowhere: the next line does
print(form, batch, vocab, "max |logits - fp32 reference| =", float((logits - reference).abs().max()))
