"""How much of a decode step's time any sampler could save: the sampling step alone, as
bench_decode.py's serving-defaults mode runs it (Qwen3's T = 0.6, [B] top_k = 20 and
top_p = 0.95), against the least a step that reads the LM head once can take.

For each B, CUDA-graph replays (median µs): *standard*, compiled lm_head -> fp32 logits / T ->
FlashInfer top_k_top_p_sampling_from_logits (bench_decode.serving_head, the same step); *ours*, the fused
op with the same [B] tensors; *plain*, our plain sampling at T; *mm*, cuBLAS's bf16 matmul alone;
*floor*, the lesser of mm and plain: the least time a kernel that reads the weight once took
here (a device-to-device copy reaches less bandwidth than either). Every sampler draws from
explicit seed and offset device tensors (bench_sampler.noise_tensors: no torch RNG replay
prologue on any side). With --tpot FILE (a bench_decode.py json of the same GPU and model) it also
prints the TPOT reduction ours gets (standard - ours) and the most any sampler could get
(standard - floor), both as a share of the standard TPOT.

  python3 benchmarks/probes/decode_sampling_ceiling.py --model qwen3-1.7b \\
      --tpot benchmarks/results/decode_serving_defaults_qwen3-1.7b_<GPU>_<date>.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import flashsampling_cuda
from flashsampling_cuda.problems import hidden_states, lm_head_weight

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_decode import MODELS, QWEN3_SERVING_DEFAULTS, serving_head
from bench_sampler import median_us, noise_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-1.7b", choices=[m for m in MODELS if m.startswith("qwen3")])
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--tpot", default=None, metavar="FILE", help="bench_decode.py json: TPOT of the standard step")
    args = parser.parse_args()
    config = MODELS[args.model]
    dim, vocab = config["hidden_size"], config["vocab_size"]
    t, k, p = (QWEN3_SERVING_DEFAULTS[name] for name in ("temperature", "top_k", "top_p"))
    weight = lm_head_weight(vocab, dim)
    noise, fi_noise = noise_tensors()
    tpot = {}
    if args.tpot:
        for record in json.loads(Path(args.tpot).read_text())["rows"]:
            if record["model"] == args.model:
                tpot[record["B"]] = record["tpot_standard_ms"] * 1000.0
    print(f"{args.model}: D = {dim}, V = {vocab}, weight {weight.numel() * weight.element_size() / 1e6:.0f} MB, "
          f"{torch.cuda.get_device_name()}")
    print("| B | mm | floor | plain | ours | standard | standard - ours | standard - floor |"
          + (" standard TPOT | ours' reduction | the most any sampler could save |" if tpot else ""))
    print("|---" * (8 + (3 if tpot else 0)) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        hidden = hidden_states(weight, batch, "llm", seed=batch)
        top_k = torch.full((batch,), k, dtype=torch.int64, device="cuda")
        top_p = torch.full((batch,), p, dtype=torch.float32, device="cuda")
        mm = median_us(lambda: hidden @ weight.T, graph=True)  # noqa: B023
        plain = median_us(lambda: flashsampling_cuda.sample(  # noqa: B023
            hidden, weight, temperature=t, **noise), graph=True)  # noqa: B023
        ours = median_us(lambda: flashsampling_cuda.sample(  # noqa: B023
            hidden, weight, temperature=t, top_k=top_k, top_p=top_p, **noise), graph=True)  # noqa: B023
        standard_step, sampler = serving_head(weight, None, batch, hidden.device, True, fi_noise)
        if sampler != "flashinfer":
            raise SystemExit("decode_sampling_ceiling.py: FlashInfer is not importable here")
        standard = median_us(lambda: standard_step(hidden, None, None), graph=True)  # noqa: B023
        floor_us = min(mm, plain)
        row = (f"| {batch} | {mm:.1f} | {floor_us:.1f} | {plain:.1f} | {ours:.1f} | {standard:.1f} | "
               f"{standard - ours:.1f} | {standard - floor_us:.1f} |")
        if batch in tpot:
            row += (f" {tpot[batch]:.0f} | {100 * (standard - ours) / tpot[batch]:.1f}% | "
                    f"{100 * (standard - floor_us) / tpot[batch]:.1f}% |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
