"""End-to-end decode benchmark: time per output token (TPOT) of a Hugging Face model.

Two decode loops over the same model body, static KV cache and CUDA graphs, differing
only in how the next token is chosen from the final-norm hidden state:

  standard  torch.compile(lm_head -> logits.float() -> / T -> softmax -> torch.multinomial),
            what transformers' generate() does per step (logits [B, V] written and read back)
  ours      flashsampling_cuda.sample(hidden, lm_head.weight, ...) (fused GEMM + Gumbel-Max)

Both run StaticCacheDecoder (flashsampling_cuda.integrations.transformers): the prompt is
prefilled eagerly, two decode steps run as warm-up (compiling the standard head and, on the
GPU, the model body: `compile_body=True`, torch.compile with dynamic shapes, shared by both
paths), then one decode step (body + sampling + bookkeeping) is captured as a CUDA graph
and replayed for the remaining tokens. Without the compiled body a Qwen3-1.7B step runs
~1,500 small eager kernels, several times the compiled step's time, which hides any sampler. The decode
steps attend with the query heads grouped per KV head over the un-repeated static cache
(StaticCacheDecoder(grouped_decode_attention=True), for both paths; compiled, that attention is
two batched GEMMs and a float32 softmax) and, by default, with each layer's q/k/v and gate/up
projections fused into one GEMM per group (fuse_projections=True, as serving engines load their
weights; --no-fuse-projections keeps transformers' seven projection GEMMs per layer); --repeat-kv-attention
keeps transformers' masked sdpa path, which copies the whole cache to all query heads
(repeat_kv) in every layer of every step: memory traffic that grows with B. TPOT = GPU
time of the replayed steps / their number (CUDA events; prefill excluded), median over
--reps generations, the two paths alternating. Models are Qwen3-shaped with random bf16
weights (normal, std 0.02), built on the GPU from the configs below; nothing is downloaded.

--penalties adds vLLM's repetition / frequency / presence penalties (PENALTIES) over each row's
prompt and output: *standard* keeps dense [B, V] tables on the device (vLLM's pattern), *ours*
passes them to the op with the decoder's PenaltyState.

--serving-defaults samples as a serving engine does with Qwen3's generation config
(T = 0.6, top_k = 20, top_p = 0.95) passed per request as [B] tensors: *standard* is the
compiled lm_head, then FlashInfer's top_k_top_p_sampling_from_logits on the fp32 logits / T
(where FlashInfer is importable; else the compiled torch top-k -> softmax -> top-p ->
multinomial, recorded in the results), *ours* the fused op with the same tensors.

Usage (GPU):
  python benchmarks/bench_decode.py [--models qwen3-1.7b,qwen3-8b] [--batches 1,4,16,32,64]
      [--prompt-len 256] [--new-tokens 128] [--reps 5] [--out benchmarks/results]
Smoke run (CPU or GPU, tiny Qwen3 config, no compile on the CPU):
  python benchmarks/bench_decode.py --tiny --out /tmp/bench_decode
Writes decode_<device>_<date>.{json,md,png} under --out and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench_penalties import penalized_logits
from report import pyplot_or_none, run_header, write_results

MODELS = {
    # Qwen/Qwen3-1.7B: tied embeddings.
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    # Qwen/Qwen3-8B: untied.
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                     rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    # Smoke test only.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=True),
}
DEFAULT_MODELS = ("qwen3-1.7b", "qwen3-8b")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_model(name: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**MODELS[name], initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):  # weights are created and initialised on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def standard_head(model, temperature: float, compile_head: bool):
    """transformers' sampling step: lm_head -> fp32 logits -> / T -> softmax -> multinomial."""
    lm_head = model.get_output_embeddings()
    weight, bias = lm_head.weight, lm_head.bias

    def head(hidden):
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, num_samples=1)

    head = torch.compile(head) if compile_head else head
    return lambda hidden, seed, offset: head(hidden)


# Qwen3's generation_config.json: the defaults serving engines send every step.
QWEN3_SERVING_DEFAULTS = dict(temperature=0.6, top_k=20, top_p=0.95)


def serving_head(weight, bias, batch: int, device: torch.device, compile_head: bool, fi_noise: dict | None = None):
    """The standard step of a serving engine with per-request [B] top_k / top_p tensors:
    lm_head (weight, bias) -> fp32 logits / T -> FlashInfer top_k_top_p_sampling_from_logits,
    drawing from fi_noise's seed and offset tensors where given (else from torch's generator), or,
    without FlashInfer, the compiled torch equivalent. Returns (sampler, name of what samples)."""
    t = QWEN3_SERVING_DEFAULTS["temperature"]
    top_k = torch.full((batch,), QWEN3_SERVING_DEFAULTS["top_k"], dtype=torch.int32, device=device)
    top_p = torch.full((batch,), QWEN3_SERVING_DEFAULTS["top_p"], dtype=torch.float32, device=device)
    logits_of = torch.compile(lambda h: torch.nn.functional.linear(h, weight, bias).float() / t) if compile_head \
        else (lambda h: torch.nn.functional.linear(h, weight, bias).float() / t)
    try:
        import flashinfer.sampling as fi

        if device.type != "cuda":
            raise ImportError("FlashInfer samples on CUDA only")
        return (lambda hidden, seed, offset: fi.top_k_top_p_sampling_from_logits(
            logits_of(hidden), top_k, top_p, deterministic=True, **(fi_noise or {}))[:, None]), "flashinfer"
    except Exception:  # noqa: BLE001 - FlashInfer is optional
        k = QWEN3_SERVING_DEFAULTS["top_k"]

        def torch_sampler(logits):
            values, ids = torch.topk(logits, k, dim=-1)
            probs = torch.softmax(values, dim=-1)
            ahead = torch.cumsum(probs, dim=-1) - probs
            probs = torch.where(ahead < top_p[:, None], probs, 0.0)
            return ids.gather(-1, torch.multinomial(probs, 1))

        sampler = torch.compile(torch_sampler) if compile_head else torch_sampler
        return (lambda hidden, seed, offset: sampler(logits_of(hidden))), "torch"


# Penalties as Qwen2.5 / Qwen3 generation configs and serving requests set them.
PENALTIES = dict(repetition_penalty=1.05, frequency_penalty=0.2, presence_penalty=0.5)


def penalties_head(model, prompt: torch.Tensor, temperature: float, compile_head: bool):
    """A serving engine's step with vLLM's penalties (vllm/v1/sample/ops/penalties.py): dense
    [B, V] tables of the prompt's tokens and the output counts on the device, lm_head -> fp32
    logits, repetition / frequency / presence, / T -> softmax -> multinomial, then the sampled
    token counted into the table (in place, inside the captured step). The table restarts at the
    prefill's sample (offset 0). Returns the sampler."""
    lm_head = model.get_output_embeddings()
    weight, bias = lm_head.weight, lm_head.bias
    batch, vocab = prompt.shape[0], model.config.vocab_size
    in_prompt = torch.zeros((batch, vocab), dtype=torch.bool, device=prompt.device).scatter_(1, prompt, True)
    counts = torch.zeros((batch, vocab), dtype=torch.float32, device=prompt.device)
    r, f, p = (PENALTIES[k] for k in ("repetition_penalty", "frequency_penalty", "presence_penalty"))

    def head(hidden, counts):
        logits = torch.nn.functional.linear(hidden, weight, bias).float()
        logits = penalized_logits(logits, in_prompt, counts, r, f, p)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, num_samples=1)

    head = torch.compile(head) if compile_head else head

    def sampler(hidden, seed, offset):
        counts.mul_((offset != 0).float().reshape(-1, 1))  # a new generation starts at offset 0
        tokens = head(hidden, counts)
        counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
        return tokens

    return sampler


def run(args) -> dict:
    import transformers

    from flashsampling_cuda.integrations.transformers import FlashSamplingDecoder, StaticCacheDecoder

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if on_gpu else "fp32")]
    compile_head = on_gpu and not args.no_compile
    compile_body = on_gpu and not args.no_compile_body
    graphs = on_gpu and not args.no_cuda_graphs
    grouped = not args.repeat_kv_attention
    device_name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    results = {
        **run_header(device_name),
        "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "temperature": QWEN3_SERVING_DEFAULTS["temperature"] if args.serving_defaults else args.temperature,
        "reps": args.reps,
        "cuda_graphs": graphs,
        "standard_head_compiled": compile_head,
        "body_compiled": compile_body,
        "grouped_decode_attention": grouped,
        "fused_projections": not args.no_fuse_projections,
        "serving_defaults": QWEN3_SERVING_DEFAULTS if args.serving_defaults else None,
        "penalties": PENALTIES if args.penalties else None,
        "rows": [],
    }
    for name in args.models.split(","):
        model = build_model(name, device, dtype)
        if not args.no_fuse_projections:
            from flashsampling_cuda.integrations.transformers import fuse_projections

            fuse_projections(model)
        vocab = model.config.vocab_size
        standard = standard_head(model, args.temperature, compile_head)
        for batch in (int(b) for b in args.batches.split(",")):
            gen = torch.Generator().manual_seed(batch)
            prompt = torch.randint(0, vocab, (batch, args.prompt_len), generator=gen).to(device)
            # Both compile the same body: the second reuses the first's compilation.
            dec_kwargs = dict(cuda_graph=graphs, compile_body=compile_body, grouped_decode_attention=grouped)
            ours_dec = FlashSamplingDecoder(model, **dec_kwargs)
            std_dec = StaticCacheDecoder(model, **dec_kwargs)

            sampling = dict(temperature=args.temperature)
            standard_sampler, standard_name = standard, "multinomial"
            if args.serving_defaults:  # per-request [B] tensors, as serving engines send them
                sampling = dict(temperature=QWEN3_SERVING_DEFAULTS["temperature"],
                                top_k=torch.full((batch,), QWEN3_SERVING_DEFAULTS["top_k"], device=device),
                                top_p=torch.full((batch,), QWEN3_SERVING_DEFAULTS["top_p"], device=device))
                lm_head = model.get_output_embeddings()
                standard_sampler, standard_name = serving_head(lm_head.weight, lm_head.bias, batch, device,
                                                               compile_head)
            if args.penalties:  # the token history: the prompt, then every sampled token
                sampling.update(PENALTIES)
                standard_sampler = penalties_head(model, prompt, args.temperature, compile_head)
                standard_name = "torch penalties + multinomial"

            def run_ours():
                return ours_dec.generate(prompt, max_new_tokens=args.new_tokens, seed=1234, return_timings=True,
                                         **sampling)

            def run_standard():
                return std_dec.generate_with_sampler(prompt, sampler=standard_sampler, sampler_key=standard_name,
                                                     max_new_tokens=args.new_tokens, return_timings=True)

            tpot = {"ours": [], "standard": []}
            for rep in range(args.reps + 1):  # the first generation of each captures its graph
                for key, fn in (("standard", run_standard), ("ours", run_ours)):
                    out = fn()
                    assert out.new_tokens.shape == (batch, args.new_tokens)
                    assert int(out.new_tokens.min()) >= 0 and int(out.new_tokens.max()) < vocab
                    if rep > 0:
                        tpot[key].append(out.decode_seconds / out.timed_steps * 1e3)
            row = {
                "model": name,
                "B": batch,
                "tpot_standard_ms": statistics.median(tpot["standard"]),
                "tpot_ours_ms": statistics.median(tpot["ours"]),
                "standard_ms_reps": tpot["standard"],
                "ours_ms_reps": tpot["ours"],
                "timed_steps": out.timed_steps,
                "standard_sampler": standard_name,
            }
            row["reduction_pct"] = 100.0 * (1.0 - row["tpot_ours_ms"] / row["tpot_standard_ms"])
            results["rows"].append(row)
            print("[bench] " + json.dumps(row), flush=True)
            del ours_dec, std_dec, out
            if on_gpu:
                torch.cuda.empty_cache()
        del model, standard
        if on_gpu:
            torch.cuda.empty_cache()
    return results


def markdown_table(results: dict) -> str:
    lines = [
        f"Decode TPOT, {results['device']}, {results['date']}, {results['dtype']}, prompt {results['prompt_len']} "
        f"tokens, {results['new_tokens']} new tokens, T = {results['temperature']}, CUDA graphs "
        f"{'on' if results['cuda_graphs'] else 'off'} for both, model body "
        f"{'compiled' if results.get('body_compiled') else 'eager'}"
        f"{', fused q/k/v and gate/up projections' if results.get('fused_projections') else ''}"
        f"{', repeat_kv attention' if results.get('grouped_decode_attention') is False else ''}, "
        f"median of {results['reps']} generations"
        + (f"; serving defaults {results['serving_defaults']} as [B] tensors, standard sampler: "
           f"{', '.join(sorted({r.get('standard_sampler', '') for r in results['rows']}))}"
           if results.get("serving_defaults") else "")
        + (f"; penalties {results['penalties']} over the prompt and the output (standard: compiled lm_head + "
           "vLLM's torch penalties on dense [B, V] tables + multinomial; ours: the op with a PenaltyState)"
           if results.get("penalties") else ""),
        "",
        "| model | B | standard TPOT (ms) | ours TPOT (ms) | reduction |",
        "|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(f"| {r['model']} | {r['B']} | {r['tpot_standard_ms']:.3f} | {r['tpot_ours_ms']:.3f} | "
                     f"{r['reduction_pct']:.1f}% |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot_or_none("bench")
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in results["rows"]))
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False, sharex="col")
    for col, name in enumerate(models):
        rows = [r for r in results["rows"] if r["model"] == name]
        batches = [r["B"] for r in rows]
        ax = axes[0][col]
        ax.plot(batches, [r["tpot_standard_ms"] for r in rows], marker="o", label="standard (compiled multinomial)")
        ax.plot(batches, [r["tpot_ours_ms"] for r in rows], marker="o", label="ours (flashsampling)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"{name}, {results['dtype']}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.bar([str(b) for b in batches], [r["reduction_pct"] for r in rows])
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("batch size B")
        ax.set_ylabel("TPOT reduction (%)")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Decode time per output token — {results['device']} — {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5, help="timed generations per path and batch")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--no-compile", action="store_true", help="run the standard head eagerly")
    parser.add_argument("--no-compile-body", action="store_true", help="run the model body eagerly in the steps")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps (diagnosis only)")
    parser.add_argument("--no-fuse-projections", action="store_true",
                        help="keep transformers' separate q/k/v and gate/up projection GEMMs")
    parser.add_argument("--repeat-kv-attention", action="store_true",
                        help="transformers' sdpa decode attention (repeat_kv copy of the cache; diagnosis only)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even if a GPU is present")
    parser.add_argument("--tiny", action="store_true",
                        help="smoke run: --models tiny --batches 1,4 --prompt-len 16 --new-tokens 8 --reps 2")
    parser.add_argument("--serving-defaults", action="store_true",
                        help="Qwen3's T=0.6, top_k=20, top_p=0.95 as [B] tensors; standard = compiled lm_head + "
                             "FlashInfer top_k_top_p_sampling_from_logits")
    parser.add_argument("--penalties", action="store_true",
                        help=f"{PENALTIES} over each row's prompt and output; standard = compiled lm_head + vLLM's "
                             "torch penalties + multinomial")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.penalties and args.serving_defaults:
        parser.error("--penalties and --serving-defaults are separate runs")
    if args.tiny:
        args.models, args.batches, args.prompt_len, args.new_tokens, args.reps = "tiny", "1,4", 16, 8, 2
    if args.new_tokens < 4:
        parser.error("--new-tokens must be >= 4 (prefill token + 2 warm-up steps + timed steps)")
    results = run(args)
    table = markdown_table(results)
    write_results(args.out, results_stem(results, args), results, table, plot)
    print(table)


def results_stem(results: dict, args) -> str:
    """decode[_mode]_<gpu>_<date>, with the models' names after the mode where a run measured other
    than DEFAULT_MODELS (e.g. one of them): runs of each model sit side by side."""
    mode = "_serving_defaults" if args.serving_defaults else "_penalties" if args.penalties else ""
    models = [m for m in args.models.split(",") if m]
    tag = "" if args.tiny or sorted(models) == sorted(DEFAULT_MODELS) else "_" + "_".join(models)
    return f"decode{mode}{tag}_{results['device'].replace(' ', '_')}_{results['date']}" + ("_tiny" if args.tiny else "")


if __name__ == "__main__":
    main()
