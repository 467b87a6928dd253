"""How often the fused top-k pass's candidates would decide a truncated row by themselves
(docs/truncation.md: the per-row certificate of issue #33's fused design). For each row, the K
largest ``y = x / T`` (what stage 2 holds after its repairs, K <= 64) and the row's exact
log-sum-exp (what the common-controls loop carries) certify the survivors when

- top_p: the candidates' probability mass reaches top_p (the survivors are a prefix of them);
- min_p: the K-th candidate's probability lies below min_p times the first's (every survivor
  is a candidate);
- top_k <= K: always.

Rows that fail need the fallback (the logits written by the same GEMM, then the selection
kernel). float64 on the CPU, bf16 weights as the benchmarks make them.

  python3 benchmarks/probes/certificate_coverage.py [--shape 4096x151936] [--rows 64]
"""

import argparse

import torch

from flashsampling_cuda.problems import hidden_states, lm_head_weight

FORMS = {  # name -> (top_k, top_p, min_p); None: off
    "p=0.9 alone": (None, 0.9, None),
    "p=0.95 alone": (None, 0.95, None),
    "min_p=0.05": (None, None, 0.05),
    "k=20, p=0.95 (Qwen3)": (20, 0.95, None),
    "k=50, p=0.9": (50, 0.9, None),
    "k=1000": (1000, None, None),
}


def certified(y: torch.Tensor, k_cand: int, top_k, top_p, min_p) -> torch.Tensor:
    """bool [B]: the K candidates decide the row's survivors."""
    lse = torch.logsumexp(y, dim=1, keepdim=True)
    top = torch.topk(y, k_cand, dim=1).values
    ok = torch.zeros(y.shape[0], dtype=torch.bool)
    if top_k is not None and top_k <= k_cand:
        return ~ok  # top_k first: the survivors lie within the first top_k <= K
    probs = (top - lse).exp()
    if top_p is not None:
        ok |= probs.sum(dim=1) >= top_p
    if min_p is not None:
        ok |= probs[:, -1] < min_p * probs[:, 0]
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="4096x151936")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--temperatures", default="0.6,0.8,1.0")
    parser.add_argument("--candidates", default="16,32,64")
    args = parser.parse_args()
    dim, vocab = (int(x) for x in args.shape.split("x"))
    weight = lm_head_weight(vocab, dim, device="cpu")
    k_list = [int(k) for k in args.candidates.split(",")]
    print(f"| regime | T | form | " + " | ".join(f"K={k}" for k in k_list) + " |")
    print("|---|---|---|" + "---|" * len(k_list))
    for regime in ("llm", "flat"):
        hidden = hidden_states(weight, args.rows, regime, seed=3)
        logits = hidden.double() @ weight.double().T
        for temperature in (float(t) for t in args.temperatures.split(",")):
            y = logits / temperature
            for name, (top_k, top_p, min_p) in FORMS.items():
                cells = [f"{float(certified(y, k, top_k, top_p, min_p).double().mean()):.2f}" for k in k_list]
                print(f"| {regime} | {temperature} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
