"""One form of bench_truncation.py called a few times on its rows, for a profiler that picks
launches out of a process (Nsight Compute, compute-sanitizer):

    ncu --kernel-name regex:streaming_sample_kernel --launch-skip 1 --launch-count 1 \
        python3 benchmarks/probes/call_form.py 'min_p0.05 [B]' 64 flat [calls] [DxV]

The noise comes from torch's generator (each call draws anew)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import flashsampling_cuda  # noqa: E402
from bench_truncation import FORMS, form_arguments  # noqa: E402
from flashsampling_cuda.problems import hidden_states, lm_head_weight  # noqa: E402


def main() -> None:
    form, batch, regime = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    calls = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    dim, vocab = (int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "4096x151936").split("x"))
    weight = lm_head_weight(vocab, dim)
    hidden = hidden_states(weight, batch, regime, seed=batch)
    temperature, spec = FORMS[form]
    kwargs = form_arguments(spec, batch)
    for _ in range(calls):
        flashsampling_cuda.sample(hidden, weight, temperature=temperature, **kwargs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
