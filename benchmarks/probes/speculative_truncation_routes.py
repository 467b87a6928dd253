"""One-hot speculative verification with truncation: the fused top-k pass over the B * (n + 1)
rows (position_tokens_truncated_fused, what speculative_sample takes on CUDA) against the logits
route it replaced (position_tokens_from_logits: cuBLAS fp32 logits, a sample_from_logits call a
position) and plain sampling of the same rows, one process, CUDA-graph replays, median µs.
LLM-like rows (flashsampling_cuda/problems.py); drafts: the target's argmax, a fifth replaced by
random ids. The tokens of both routes are compared (they may differ only at near ties of the two
matmuls' roundings).

  python3 benchmarks/probes/speculative_truncation_routes.py --batches 1,4,16,64 --drafts 1,4
"""

import argparse
import sys
from pathlib import Path
from unittest import mock

import torch

import flashsampling_cuda
from flashsampling_cuda import speculative
from flashsampling_cuda.problems import hidden_states, lm_head_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_sampler import median_us  # noqa: E402

FORMS = {
    "p0.9 [B]": lambda b, dev: dict(top_p=torch.full((b,), 0.9, device=dev)),
    "k20 p0.95 [B] (Qwen3)": lambda b, dev: dict(top_k=torch.full((b,), 20, device=dev),
                                                  top_p=torch.full((b,), 0.95, device=dev)),
    "k50 (int)": lambda b, dev: dict(top_k=50),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--drafts", default="1,4")
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = lm_head_weight(vocab, dim)
    g = torch.Generator().manual_seed(3)
    print(f"{torch.cuda.get_device_name()}, D = {dim}, V = {vocab}, T = {args.temperature}; µs: fused / logits "
          "route / plain sampling of the B (n + 1) rows")
    for n in (int(x) for x in args.drafts.split(",")):
        for batch in (int(x) for x in args.batches.split(",")):
            rows = hidden_states(weight, batch * (n + 1), "llm", seed=batch + n)
            hidden = rows.reshape(batch, n + 1, dim)
            x = (hidden[:, :n].float() @ weight.float().T)
            drafts = torch.where(torch.rand(batch, n, generator=g).cuda() < 0.8, x.argmax(2),
                                 torch.randint(0, vocab, (batch, n), generator=g).cuda())
            for form, make in FORMS.items():
                kwargs = dict(temperature=args.temperature, seed=torch.tensor(7, device="cuda"),
                              offset=torch.tensor(2, device="cuda"), **make(batch, "cuda"))

                def fused():
                    return flashsampling_cuda.speculative_sample(hidden, weight, drafts, **kwargs)

                def logits_route():
                    with mock.patch.object(speculative, "fused_top_k_takes_positions", lambda *a: False):
                        return flashsampling_cuda.speculative_sample(hidden, weight, drafts, **kwargs)

                def plain():
                    return flashsampling_cuda.sample(rows, weight, temperature=args.temperature, seed=7)

                assert speculative.fused_top_k_takes_positions(hidden, weight, speculative.parse_step(
                    "probe", hidden, weight, drafts, None, args.temperature, 7, 2, kwargs.get("top_k"),
                    kwargs.get("top_p"), None, None))
                a, b = fused(), logits_route()
                same = float((a.tokens == b.tokens).float().mean())
                times = [median_us(f, graph=True) for f in (fused, logits_route, plain)]
                print(f"n={n} B={batch} {form}: {times[0]:.0f} / {times[1]:.0f} / {times[2]:.0f} "
                      f"(fused / logits {times[0] / times[1]:.2f}, fused / plain {times[0] / times[2]:.2f}; "
                      f"tokens equal {same:.3f}, accepted {float(a.num_accepted.float().mean()):.2f})", flush=True)


if __name__ == "__main__":
    main()
