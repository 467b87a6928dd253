"""Speculative decoding of a small random-weight Llama-style model with exact verification
(flashsampling_cuda.integrations.transformers.speculative_generate), with two proposers:
prompt lookup (NgramProposer) and a draft model made of the target's first layers
(truncated_draft_model + DraftModelProposer).

    python scripts/speculative_demo.py                  # GPU (bf16) if there is one, else CPU (fp32)
    python scripts/speculative_demo.py --device cpu --new-tokens 32

Greedy (T = 0): the tokens must be the target's plain greedy tokens (reference_generate: the
model's standard forward, one token per step); it prints, per proposer, whether they are and
exits with status 1 where a row differs at a step whose top-2 logit gap is beyond the
rounding of the model's dtype. Sampled (T > 0): acceptance rate and tokens per target
forward. The weights are random: the target's layers after the draft's write little into the
residual stream (--residual-scale), so that its first layers are a useful draft, as early
layers often are in a trained model. Prompt lookup finds next to nothing in a random model's
output (acceptance near 0; the output is still exact): it pays off where a model repeats its
prompt or itself. Acceptance here says nothing about a trained model's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--draft-tokens", type=int, default=4, help="drafts per verification step")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.8, help="of the sampled runs")
    parser.add_argument("--residual-scale", type=float, default=0.1,
                        help="scale of the residual writes of the layers after the draft's")
    return parser.parse_args(argv)


def build_model(args, transformers):
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=1,
        head_dim=64, initializer_range=0.1, tie_word_embeddings=False, max_position_embeddings=4096)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32  # the op's CUDA kernels: bf16/fp16
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers[args.draft_layers:]:
            layer.self_attn.o_proj.weight.mul_(args.residual_scale)
            layer.mlp.down_proj.weight.mul_(args.residual_scale)
    return model.to(device=args.device, dtype=dtype).eval()


def prompts(args) -> list[list[int]]:
    """Random prompts of different lengths (left-padded by the decoders)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (8 + 3 * b,), generator=g).tolist() for b in range(args.batch)]


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers

    from flashsampling_cuda.integrations import transformers as fst

    model = build_model(args, transformers)
    draft = fst.truncated_draft_model(model, args.draft_layers)
    proposers = {
        "prompt lookup (n-gram)": lambda: fst.NgramProposer(max_ngram=3),
        f"draft model ({args.draft_layers} of {args.layers} layers, sampled drafts)":
            lambda: fst.DraftModelProposer(draft),
    }
    batch = prompts(args)
    dtype = next(model.parameters()).dtype
    print(f"target: {args.layers} layers, D = {args.hidden}, V = {args.vocab}, {dtype} on {args.device}; "
          f"B = {args.batch}, {args.new_tokens} new tokens, {args.draft_tokens} drafts per step")

    start = time.perf_counter()
    # Near ties: the n + 1-token forward of a verification rounds differently from one token at
    # a time, by about the dtype's rounding of the logits (fp32: that of the summation order).
    near_tie_rtol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}.get(dtype, 1e-5)
    plain = fst.reference_generate(model, batch, max_new_tokens=args.new_tokens, temperature=0.0, rtol=near_tie_rtol)
    print(f"plain greedy decoding (model forward per token): {time.perf_counter() - start:.2f} s")
    failed = False
    for temperature in (0.0, args.temperature):
        for name, make in proposers.items():
            start = time.perf_counter()
            out = fst.speculative_generate(model, batch, proposer=make(), num_draft_tokens=args.draft_tokens,
                                           max_new_tokens=args.new_tokens, temperature=temperature, seed=1234)
            seconds = time.perf_counter() - start
            line = (f"T = {temperature:g}, {name}: acceptance {out.acceptance_rate:.2f}, "
                    f"{out.tokens_per_step:.2f} tokens per target forward, {seconds:.2f} s")
            if temperature == 0.0:
                line += ", " + greedy_check(out, plain)
                failed |= line.endswith("MISMATCH")
            print(line)
    return 1 if failed else 0


def greedy_check(out, plain) -> str:
    """Whether each row's tokens are the plain greedy ones; a row may part only at a near tie
    of the plain decode (top-2 gap below its tolerance)."""
    equal, near_ties = 0, []
    for b in range(out.new_tokens.shape[0]):
        differ = (out.new_tokens[b].cpu() != plain.new_tokens[b].cpu()).nonzero()
        if differ.numel() == 0:
            equal += 1
            continue
        t = int(differ[0])
        if plain.gap[b, t] >= plain.tolerance[b, t]:
            return f"row {b} differs from plain greedy at step {t} (top-2 gap {float(plain.gap[b, t]):.3g}): MISMATCH"
        near_ties.append((b, t))
    text = f"greedy tokens equal to plain decoding in {equal}/{out.new_tokens.shape[0]} rows"
    return text + (f" (the others part at near ties: (row, step) {near_ties})" if near_ties else "")


if __name__ == "__main__":
    sys.exit(main())
