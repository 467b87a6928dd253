"""flashsampling_cuda.integrations.transformers: decoding Hugging Face causal LMs with the op.

CPU: tiny random-weight Llama-, Qwen3-, Mistral-, Qwen2-, Gemma-, Gemma3-, Granite- and
Cohere-style models;
the decoder's tokens must equal the reference path's (the model's standard forward, its
logits in float64 + the op's Gumbel noise, reference_generate) for the same seeds, with
prompts of different lengths, stop tokens, tied and untied embeddings, per-request seeds,
greedy decoding, and the refusals. GPU (requires_cuda): the same on a Qwen3-1.7B-shaped
bf16 model, with CUDA graphs.

Skipped with a reason where transformers (the `transformers` extra) is not installed.
"""

import importlib
import inspect
import subprocess
import sys

import pytest
import torch

import flashsampling_cuda as fs
from flashsampling_cuda.reference import reference_sample
from sampling_stats import pathwise_mismatches


COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, initializer_range=0.2)  # logits with ~2 units of spread
# family -> (config class, extra config); tie: tied input/output embeddings.
FAMILIES = {
    "llama": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(sliding_window=128)),  # sliding window longer than the cache
    "gemma": ("GemmaConfig", dict()),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=128)),
    # The logit-scaling models with a scale that changes the tokens: Granite divides its logits
    # by logits_scaling, Cohere multiplies them by logit_scale.
    "granite": ("GraniteConfig", dict(logits_scaling=0.25, tie_word_embeddings=False)),
    "cohere": ("CohereConfig", dict(logit_scale=4.0)),
    "cohere2": ("Cohere2Config", dict(logit_scale=0.25, sliding_window=128)),
    # Gemma 2 soft-caps its logits (cap * tanh(logits / cap)); a small cap that changes the tokens.
    "gemma2": ("Gemma2Config", dict(final_logit_softcapping=2.0, sliding_window=128)),
}
PROMPTS = [[5, 17, 3, 99, 250, 7, 8], [11, 2], [300, 301, 302, 42]]  # different lengths: left padding


def import_or_skip(name):
    """The module, or a skip naming why not (transformers missing or older than 5.0)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.skip(f"needs transformers >= 5.0 (the `transformers` extra), not importable here: {exc}")


@pytest.fixture(scope="module")
def fst():
    return import_or_skip("flashsampling_cuda.integrations.transformers")


def tiny_model(family, attn="sdpa", **overrides):
    transformers = import_or_skip("transformers")
    config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def assert_same_path(out, ref):
    """Token sequences equal; a row may part only at a near tie of the reference (and is
    not compared after it). Returns the number of tokens compared."""
    assert out.new_tokens.shape == ref.new_tokens.shape
    compared = 0
    for b in range(out.new_tokens.shape[0]):
        differ = (out.new_tokens[b] != ref.new_tokens[b]).nonzero()
        if differ.numel() == 0:
            compared += out.new_tokens.shape[1]
            continue
        t = int(differ[0])
        assert ref.gap[b, t] < ref.tolerance[b, t], (
            f"row {b} step {t}: token {int(out.new_tokens[b, t])} != reference {int(ref.new_tokens[b, t])} "
            f"with score gap {float(ref.gap[b, t]):.3g} >= tolerance {float(ref.tolerance[b, t]):.3g}"
        )
        compared += t
    return compared


def test_import_flashsampling_does_not_import_transformers():
    code = ("import sys, flashsampling_cuda, flashsampling_cuda.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported eagerly'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- tokens == reference path


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_tokens_equal_reference_path(fst, family, temperature):
    model = tiny_model(family)
    if family == "qwen3":  # tied embeddings: the op reads the embedding matrix itself
        assert model.lm_head.weight is model.model.embed_tokens.weight
    decoder = fst.FlashSamplingDecoder(model)
    if family == "qwen3":
        assert decoder.head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    kwargs = dict(max_new_tokens=12, temperature=temperature, seed=2024, offset=7)
    out = decoder.generate(PROMPTS, **kwargs)
    ref = fst.reference_generate(model, PROMPTS, **kwargs)
    assert out.new_tokens.shape == (3, 12)
    assert torch.equal(out.prompt_attention_mask.sum(1), torch.tensor([len(p) for p in PROMPTS]))
    assert assert_same_path(out, ref) == out.new_tokens.numel()  # fp32: no near tie expected
    assert torch.equal(out.sequences[:, :7], ref.sequences[:, :7])
    if temperature > 0:  # the logits matter: not the argmax of the noise alone
        noise_only = torch.stack([
            fst.reference_sample_from_logits(torch.zeros(3, COMMON["vocab_size"]), temperature, 2024, 7 + t)[0]
            for t in range(12)], dim=1)
        assert not torch.equal(noise_only, out.new_tokens)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma", "gemma3_text", "granite", "cohere", "cohere2"])
def test_other_families_equal_reference_path(fst, family):
    model = tiny_model(family)
    kwargs = dict(max_new_tokens=6, temperature=0.8, seed=3)
    out = fst.generate(model, PROMPTS, **kwargs)
    assert assert_same_path(out, fst.reference_generate(model, PROMPTS, **kwargs)) == out.new_tokens.numel()


def test_final_logit_softcapping_follows_the_model(fst):
    """Gemma 2 soft-caps its logits (final_logit_softcapping, 30 by default; 2 here so that it
    matters): the head passes it to the op, and the tokens follow the model's own path."""
    transformers = import_or_skip("transformers")
    config = transformers.Gemma2Config(**COMMON, final_logit_softcapping=2.0, sliding_window=128)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    assert fst.FlashSamplingHead(model).logit_softcap == 2.0
    kwargs = dict(max_new_tokens=6, temperature=0.8, seed=3)
    out = fst.generate(model, PROMPTS, **kwargs)
    assert assert_same_path(out, fst.reference_generate(model, PROMPTS, **kwargs)) == out.new_tokens.numel()


@pytest.mark.parametrize("family", ["qwen3", "granite"])
def test_penalties_follow_the_reference_over_steps(fst, family):
    """vLLM's penalties over each row's prompt and the tokens generated so far: the decoder's
    PenaltyState (loaded with the prompts, updated by every step) gives the tokens of the float64
    reference that recomputes the penalties from the whole history at every step, on two calls
    with different prompts (the session's state is refilled in place); without the penalties the
    tokens differ (they matter here)."""
    model = tiny_model(family)
    decoder = fst.FlashSamplingDecoder(model)
    penalties = dict(repetition_penalty=1.8, frequency_penalty=0.7,
                     presence_penalty=torch.tensor([0.0, 1.5, -0.5]))
    kwargs = dict(max_new_tokens=10, temperature=0.7, seed=5)
    for prompts in (PROMPTS, [list(reversed(p)) for p in PROMPTS]):
        out = decoder.generate(prompts, **kwargs, **penalties)
        ref = fst.reference_generate(model, prompts, **kwargs, **penalties)
        assert assert_same_path(out, ref) == out.new_tokens.numel()
        assert decoder.penalty_state is not None and not bool(decoder.penalty_state.overflowed.any())
    assert not torch.equal(decoder.generate(prompts, **kwargs).new_tokens, out.new_tokens)


@pytest.mark.parametrize("family,scale", [("granite", 4.0), ("cohere", 4.0), ("cohere2", 0.25)])
def test_logit_scaling_follows_the_model(fst, family, scale):
    """Granite's logits / logits_scaling and Cohere's logits * logit_scale reach the op as its
    logit_scale: the tokens follow the model's own logits, and sampling the unscaled logits
    would not (the scale matters here)."""
    model = tiny_model(family)
    head = fst.FlashSamplingHead(model)
    assert head.logit_scale == scale
    kwargs = dict(max_new_tokens=8, temperature=0.8, seed=3)
    out = fst.generate(model, PROMPTS, **kwargs)
    assert assert_same_path(out, fst.reference_generate(model, PROMPTS, **kwargs)) == out.new_tokens.numel()

    def unscaled(hidden, seed, offset):
        return fs.sample(hidden, head.weight, temperature=0.8, seed=seed, offset=offset)

    without = fst.StaticCacheDecoder(model).generate_with_sampler(PROMPTS, sampler=unscaled, max_new_tokens=8, seed=3)
    assert not torch.equal(without.new_tokens, out.new_tokens)


def test_eager_attention_and_tensor_prompts(fst):
    model = tiny_model("llama", attn="eager")
    ids = torch.tensor([[0, 0, 4, 5, 6], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    kwargs = dict(max_new_tokens=8, temperature=0.7, seed=11)
    out = fst.FlashSamplingDecoder(model).generate(ids, mask, **kwargs)
    assert torch.equal(out.sequences[:, :5], ids)
    assert assert_same_path(out, fst.reference_generate(model, ids, mask, **kwargs)) == out.new_tokens.numel()


def test_per_row_temperatures(fst):
    model = tiny_model("qwen3")
    kwargs = dict(max_new_tokens=8, temperature=torch.tensor([0.5, 1.0, 0.0]), seed=21)
    out = fst.FlashSamplingDecoder(model).generate(PROMPTS, **kwargs)
    assert assert_same_path(out, fst.reference_generate(model, PROMPTS, **kwargs)) == out.new_tokens.numel()


def test_per_request_seeds_are_batch_invariant(fst):
    model = tiny_model("qwen3")
    decoder = fst.FlashSamplingDecoder(model)
    seeds = torch.tensor([101, 202, 303])
    batch = decoder.generate(PROMPTS, max_new_tokens=10, temperature=1.0, seed=seeds)
    ref = fst.reference_generate(model, PROMPTS, max_new_tokens=10, temperature=1.0, seed=seeds)
    assert assert_same_path(batch, ref) == batch.new_tokens.numel()
    for b in (1, 2):
        alone = decoder.generate([PROMPTS[b]], max_new_tokens=10, temperature=1.0, seed=seeds[b:b + 1])
        assert torch.equal(alone.new_tokens[0], batch.new_tokens[b])


def test_stop_tokens(fst):
    model = tiny_model("llama")
    decoder = fst.FlashSamplingDecoder(model, check_every=2)
    free = decoder.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=9)
    stop = int(free.new_tokens[0, 3])  # row 0 stops at step 3 (or earlier, if the token came before)
    kwargs = dict(max_new_tokens=16, temperature=1.0, seed=9, stop_token_ids=[stop], pad_token_id=0)
    out = decoder.generate(PROMPTS, **kwargs)
    ref = fst.reference_generate(model, PROMPTS, **kwargs)
    assert_same_path(out, ref)
    assert torch.equal(out.num_new_tokens, ref.num_new_tokens)
    for b in range(3):
        n = int(out.num_new_tokens[b])
        hits = (free.new_tokens[b] == stop).nonzero()
        assert n == (int(hits[0]) + 1 if hits.numel() else 16)
        assert torch.equal(out.new_tokens[b, :n], free.new_tokens[b, :n])  # stopping changes nothing before
        assert bool((out.new_tokens[b, n:] == 0).all())  # padding after the stop token
    assert out.new_tokens.shape[1] == int(out.num_new_tokens.max())
    # Every row stopping early ends decoding early.
    first = [int(t) for t in free.new_tokens[:, 0]]
    early = decoder.generate(PROMPTS, max_new_tokens=16, temperature=1.0, seed=9, stop_token_ids=first)
    assert early.new_tokens.shape == (3, 1) and torch.equal(early.num_new_tokens, torch.ones(3, dtype=torch.int64))


def test_decoder_reuse_and_offsets(fst):
    model = tiny_model("qwen3")
    decoder = fst.FlashSamplingDecoder(model)
    a = decoder.generate(PROMPTS, max_new_tokens=8, seed=5)
    b = decoder.generate(PROMPTS, max_new_tokens=8, seed=5)  # reuses the cache (reset)
    c = decoder.generate(PROMPTS, max_new_tokens=8, seed=5, offset=1)
    assert torch.equal(a.new_tokens, b.new_tokens)
    assert not torch.equal(a.new_tokens, c.new_tokens)
    other = decoder.generate([[1, 2, 3]], max_new_tokens=4, seed=5)  # another shape, then back
    assert other.new_tokens.shape == (1, 4)
    assert torch.equal(decoder.generate(PROMPTS, max_new_tokens=8, seed=5).new_tokens, a.new_tokens)


def stand_in_graph_decoder(fst):
    """A FlashSamplingDecoder class whose CUDA-graph control flow (warm-up steps, capture once,
    replay, reuse across calls) runs on the CPU: its "graph" is a stand-in whose replay runs
    the captured step; ``captures`` counts the captures."""

    class StandInGraph:
        def __init__(self, replay):
            self.replay = replay

    class Decoder(fst.FlashSamplingDecoder):
        captures = 0

        def _graphs_enabled(self):
            return True

        def _capture(self, s, sampler):
            Decoder.captures += 1
            for _ in range(self.warmup_steps):
                self._step(s, sampler)
            return StandInGraph(lambda: self._step(s, sampler))

    return Decoder


def test_graph_bookkeeping_with_a_stand_in_graph(fst):
    """The CUDA-graph control flow (warm-up steps, capture once, replay, reuse across calls,
    recapture for another sampler) on the CPU, with a stand-in whose replay runs the step."""
    Decoder = stand_in_graph_decoder(fst)
    model = tiny_model("qwen3")
    kwargs = dict(max_new_tokens=9, temperature=0.9, seed=4)
    eager = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS, **kwargs)
    decoder = Decoder(model)
    first = decoder.generate(PROMPTS, **kwargs, return_timings=True)
    assert Decoder.captures == 1 and first.timed_steps == 9 - 1 - decoder.warmup_steps
    second = decoder.generate(PROMPTS, **kwargs, return_timings=True)  # same shapes: replays only
    assert Decoder.captures == 1 and second.timed_steps == 8
    assert torch.equal(first.new_tokens, eager.new_tokens) and torch.equal(second.new_tokens, eager.new_tokens)
    colder = decoder.generate(PROMPTS, **{**kwargs, "temperature": 0.5})  # another sampler: recapture
    assert Decoder.captures == 2
    assert torch.equal(colder.new_tokens, fst.FlashSamplingDecoder(model, cuda_graph=False).generate(
        PROMPTS, **{**kwargs, "temperature": 0.5}).new_tokens)
    short = decoder.generate(PROMPTS, max_new_tokens=3, temperature=0.5, seed=4)  # too short to capture
    assert Decoder.captures == 2 and torch.equal(short.new_tokens, colder.new_tokens[:, :3])


def test_compiled_body_same_tokens(fst):
    """compile_body=True (torch.compile of the steps' body, dynamic shapes) changes no token."""
    model = tiny_model("qwen3")
    kwargs = dict(max_new_tokens=6, temperature=0.9, seed=4)
    eager = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS, **kwargs)
    compiled = fst.FlashSamplingDecoder(model, cuda_graph=False, compile_body=True)
    assert torch.equal(compiled.generate(PROMPTS, **kwargs).new_tokens, eager.new_tokens)
    two = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS[:2], **kwargs)
    assert torch.equal(compiled.generate(PROMPTS[:2], **kwargs).new_tokens, two.new_tokens)  # another batch size


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_grouped_decode_attention(fst, family):
    """The decode steps' grouped-query sdpa (no repeat_kv copy of the cache) is the model's
    attention: same tokens and hidden states (to fp32 rounding) as transformers' sdpa path, it
    runs in every layer of every step, and the model's config is left as it was."""
    model = tiny_model(family)
    calls = []

    def run(grouped):
        hidden = []

        def sampler(h, seed, offset):
            hidden.append(h.clone())
            return fst.FlashSamplingHead(model)(h, temperature=0.9, seed=seed, offset=offset)

        decoder = fst.StaticCacheDecoder(model, cuda_graph=False, grouped_decode_attention=grouped)
        out = decoder.generate_with_sampler(PROMPTS, sampler=sampler, max_new_tokens=6, seed=4)
        return out.new_tokens, torch.stack(hidden)

    from transformers import AttentionInterface

    grouped_fn = fst.attention._grouped_decode_sdpa
    AttentionInterface.register(fst.attention._GROUPED_DECODE_SDPA, lambda *a, **k: calls.append(1) or grouped_fn(*a, **k))
    try:
        tokens, hidden = run(True)
    finally:
        AttentionInterface.register(fst.attention._GROUPED_DECODE_SDPA, grouped_fn)
    ref_tokens, ref_hidden = run(False)
    assert model.config._attn_implementation == "sdpa"
    assert len(calls) == 5 * model.config.num_hidden_layers  # steps 1..5 (step 0 is the prefill)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(hidden, ref_hidden, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])  # q/k/v biases; q/k norms and scaling
def test_fused_projections_keep_the_model(fst, family):
    """fuse_projections: one GEMM per q/k/v and gate/up group; the parameters stay the same
    objects with the same names and values, the outputs the same (to fp32 summation order),
    and in-place updates reach the fused GEMM."""
    model = tiny_model(family)
    ids = torch.tensor(PROMPTS[0])[None]
    with torch.no_grad():
        before = model(ids).logits
        params = list(model.named_parameters())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        assert fst.fuse_projections(model) == 2 * model.config.num_hidden_layers
        assert fst.fuse_projections(model) == 0  # already fused
        assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in params]
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        attn = model.model.layers[0].self_attn
        group = attn.q_proj._fs_group
        assert attn.k_proj.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
        assert group.fusable()
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
        assert group.pending_input is None  # nothing held between calls

        reference = tiny_model(family)  # the same weights, unfused
        for m in (model, reference):
            m.model.layers[0].self_attn.k_proj.weight.mul_(2)  # in place
            m.model.layers[0].mlp.up_proj.weight.data.mul_(-1)
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        assert group.fusable()


@pytest.mark.parametrize("change", ["new_parameter", "data_assignment", "to_float64", "gradients"])
def test_fused_projections_fall_back_where_the_stack_is_stale(fst, change):
    """Where the stacked weights would no longer be the members' parameters (a parameter
    replaced, its data moved, the model converted) or autograd records (the stacked tensors are
    not the parameters it knows), every member computes its own GEMM: outputs and gradients
    equal the unfused model's."""
    model, reference = tiny_model("qwen2"), tiny_model("qwen2")
    fst.fuse_projections(model)
    ids = torch.tensor(PROMPTS[0])[None]

    def layer0(m):
        return m.model.layers[0].self_attn, m.model.layers[0].mlp

    group = layer0(model)[0].q_proj._fs_group
    with torch.no_grad():
        if change == "new_parameter":
            for m in (model, reference):
                attn, mlp = layer0(m)
                attn.v_proj.weight = torch.nn.Parameter(attn.v_proj.weight * 3)
                mlp.gate_proj.bias = None if mlp.gate_proj.bias is None else torch.nn.Parameter(mlp.gate_proj.bias + 1)
        elif change == "data_assignment":
            for m in (model, reference):
                layer0(m)[0].k_proj.weight.data = layer0(m)[0].k_proj.weight * 0.5
        elif change == "to_float64":
            model.double()
            reference.double()
    if change == "gradients":
        assert group.fusable() is False  # grad mode on, parameters require grad
        model(ids).logits.square().sum().backward()
        reference(ids).logits.square().sum().backward()
        for name in ("q_proj", "k_proj", "v_proj"):
            torch.testing.assert_close(getattr(layer0(model)[0], name).weight.grad,
                                       getattr(layer0(reference)[0], name).weight.grad, rtol=1e-5, atol=1e-6)
        return
    with torch.no_grad():
        assert not group.fusable()
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_fused_projections_in_the_compiled_decoder(fst):
    """StaticCacheDecoder(fuse_projections=True, compile_body=True): the same tokens as the
    plain eager decoder (one graph for the step: no graph break from the groups' hand-over)."""
    model = tiny_model("qwen3")
    kwargs = dict(max_new_tokens=6, temperature=0.9, seed=4)
    plain = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS, **kwargs)
    fused = fst.FlashSamplingDecoder(model, cuda_graph=False, compile_body=True, fuse_projections=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, fst.projections._GroupedLinear)
    assert torch.equal(fused.generate(PROMPTS, **kwargs).new_tokens, plain.new_tokens)
    torch._dynamo.reset()
    with torch.no_grad():  # the decoder's mode: the fused path (with grad, every member's own GEMM)
        explained = torch._dynamo.explain(model.model)(input_ids=torch.tensor([PROMPTS[1]]))
    assert explained.graph_break_count == 0, explained.break_reasons


def test_truncation(fst):
    """top_k/top_p/min_p reach the op: off values give the plain tokens, top_k = 1 the greedy
    ones, and every top_k = 3 token is among the 3 largest logits of the model at its step."""
    model = tiny_model("qwen3")
    decoder = fst.FlashSamplingDecoder(model, cuda_graph=False)
    kwargs = dict(max_new_tokens=6, temperature=0.9, seed=4)
    plain = decoder.generate(PROMPTS, **kwargs).new_tokens
    assert torch.equal(decoder.generate(PROMPTS, **kwargs, top_k=-1, top_p=1.0, min_p=0.0).new_tokens, plain)
    greedy = decoder.generate(PROMPTS, **{**kwargs, "temperature": 0.0}).new_tokens
    assert torch.equal(decoder.generate(PROMPTS, **kwargs, top_k=1).new_tokens, greedy)
    prompt = PROMPTS[0]
    out = decoder.generate([prompt], max_new_tokens=8, temperature=2.0, seed=9, top_k=3)
    with torch.no_grad():
        logits = model(out.sequences).logits[0, len(prompt) - 1 : -1].double()
    ranks = (logits > logits.gather(1, out.new_tokens[0][:, None])).sum(dim=1)
    assert int(ranks.max()) < 3, ranks


def model_step_logits(model, out):
    """The model's standard forward (no cache, its own masks) over a decode output's sequences:
    float64 logits ``[B, n, V]``, step ``t``'s the ones its token ``t`` was sampled from."""
    prompt_len = out.prompt_attention_mask.shape[1]
    mask = torch.cat([out.prompt_attention_mask, torch.ones_like(out.new_tokens)], dim=1)
    positions = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        logits = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions).logits
    return logits[:, prompt_len - 1 : -1].double()


@pytest.mark.parametrize("family", ["qwen3", "granite"])
@pytest.mark.parametrize("temperature", [0.7, torch.tensor([0.7, 0.0, 1.3])])
def test_logprobs_equal_the_models_log_softmax(fst, family, temperature):
    """return_logprobs / top_logprobs: each step's top-N ids and logprobs, the sampled token's
    logprob and rank equal log_softmax of the model's own logits / T (greedy rows: T = 1) at
    that step; "raw" is log_softmax of hidden @ W.T (before Granite's scaling). They change
    no token, and without top_logprobs only the token's logprob comes back."""
    model, top_n = tiny_model(family), 5
    decoder = fst.FlashSamplingDecoder(model)
    kwargs = dict(max_new_tokens=6, temperature=temperature, seed=4)
    tokens = decoder.generate(PROMPTS, **kwargs).new_tokens
    temps = torch.as_tensor(temperature, dtype=torch.float64).expand(3)
    logits = None
    for mode in ("processed", "raw"):
        out = decoder.generate(PROMPTS, **kwargs, return_logprobs=True, top_logprobs=top_n, logprobs_mode=mode)
        assert torch.equal(out.new_tokens, tokens)
        logits = model_step_logits(model, out) if logits is None else logits
        if mode == "processed":
            expected = torch.log_softmax(logits / torch.where(temps == 0, 1.0, temps)[:, None, None], dim=2)
        else:
            expected = torch.log_softmax(logits / fst.FlashSamplingHead(model).logit_scale, dim=2)
        top = expected.topk(top_n, dim=2)
        assert out.top_ids.shape == (3, 6, top_n) and torch.equal(out.top_ids, top.indices), mode
        torch.testing.assert_close(out.top_logprobs.double(), top.values, rtol=0, atol=1e-4)
        mine = expected.gather(2, tokens[:, :, None])[:, :, 0]
        torch.testing.assert_close(out.token_logprobs.double(), mine, rtol=0, atol=1e-4)
        assert torch.equal(out.ranks, 1 + (expected > mine[:, :, None]).sum(dim=2)), mode
        if mode == "processed":
            compact = decoder.generate(PROMPTS, **kwargs, return_logprobs=True)
            assert compact.top_ids is None and compact.top_logprobs is None and compact.ranks is None
            torch.testing.assert_close(compact.token_logprobs, out.token_logprobs, rtol=0, atol=1e-5)


def test_logprobs_with_stops_graphs_and_errors(fst):
    """After a row's stop token its logprob entries are NaN / -1 / 0; the CUDA-graph control
    flow (stand-in graph on the CPU) records the same values as eager steps; logprob
    arguments without return_logprobs are refused before the prefill, naming the argument."""
    model = tiny_model("llama")
    kwargs = dict(max_new_tokens=9, temperature=0.9, seed=4, return_logprobs=True, top_logprobs=3)
    eager = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS, **kwargs)
    Decoder = stand_in_graph_decoder(fst)
    graphed = Decoder(model).generate(PROMPTS, **kwargs)
    assert Decoder.captures == 1
    for name in ("new_tokens", "token_logprobs", "top_ids", "top_logprobs", "ranks"):
        assert torch.equal(getattr(graphed, name), getattr(eager, name)), name
    stop = int(eager.new_tokens[0, 2])
    stopped = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(PROMPTS, **kwargs, stop_token_ids=[stop],
                                                                          pad_token_id=0)
    for b, n in enumerate(stopped.num_new_tokens.tolist()):
        assert torch.equal(stopped.token_logprobs[b, :n], eager.token_logprobs[b, :n])
        assert torch.equal(stopped.top_ids[b, :n], eager.top_ids[b, :n])
        assert stopped.token_logprobs[b, n:].isnan().all() and (stopped.top_ids[b, n:] == -1).all()
        assert stopped.top_logprobs[b, n:].isnan().all() and (stopped.ranks[b, n:] == 0).all()
    decoder = fst.FlashSamplingDecoder(model, cuda_graph=False)
    with pytest.raises(ValueError, match="need return_logprobs=True"):
        decoder.generate(PROMPTS, max_new_tokens=2, top_logprobs=3)
    with pytest.raises(ValueError, match="logprobs_mode"):
        decoder.generate(PROMPTS, max_new_tokens=2, return_logprobs=True, logprobs_mode="logits")
    with pytest.raises(ValueError, match="top_logprobs"):
        decoder.generate(PROMPTS, max_new_tokens=2, return_logprobs=True, top_logprobs=65)


def test_lm_head_bias(fst):
    model = tiny_model("llama")
    vocab = COMMON["vocab_size"]
    model.lm_head.bias = torch.nn.Parameter(torch.linspace(-3.0, 3.0, vocab))
    if "logit_bias" not in inspect.signature(fs.sample).parameters:
        with pytest.raises(fst.UnsupportedModelError, match="bias"):
            fst.FlashSamplingDecoder(model)
        return
    kwargs = dict(max_new_tokens=8, temperature=1.0, seed=1)
    out = fst.FlashSamplingDecoder(model).generate(PROMPTS, **kwargs)
    assert assert_same_path(out, fst.reference_generate(model, PROMPTS, **kwargs)) == out.new_tokens.numel()


# ---------------------------------------------------------------- refusals and errors


def test_refuses_what_it_cannot_do_exactly(fst):
    transformers = import_or_skip("transformers")
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=100)
    with pytest.raises(fst.UnsupportedModelError, match="model_type 'gpt2'"):
        fst.FlashSamplingHead(transformers.AutoModelForCausalLM.from_config(gpt2))
    with pytest.raises(fst.UnsupportedModelError, match=r"logits_scaling=2.0 scales the logits, which model_type 'llama'"):
        fst.FlashSamplingHead(tiny_model("llama", logits_scaling=2.0))
    with pytest.raises(fst.UnsupportedModelError, match=r"config.logit_scale=0.5 scales .* 'granite'"):
        fst.FlashSamplingHead(tiny_model("granite", logit_scale=0.5))  # not an attribute Granite applies
    with pytest.raises(fst.UnsupportedModelError, match="logits_scaling=0.0 is not a finite positive number"):
        fst.FlashSamplingHead(tiny_model("granite", logits_scaling=0.0))
    sliding = tiny_model("mistral", sliding_window=16)
    with pytest.raises(fst.UnsupportedModelError, match="sliding-window"):
        fst.generate(sliding, PROMPTS, max_new_tokens=20)


def test_argument_errors(fst):
    model = tiny_model("qwen3")
    decoder = fst.FlashSamplingDecoder(model)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate(PROMPTS, max_new_tokens=2, top_p=1.5)
    with pytest.raises(ValueError, match="top_k"):
        decoder.head(torch.zeros(1, 64), top_k=-2)
    with pytest.raises(ValueError, match="left-padded"):
        decoder.generate(torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]]), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate(PROMPTS, max_new_tokens=0)


def test_head_samples_like_the_op(fst):
    model = tiny_model("llama")
    head = fst.FlashSamplingHead(model)
    hidden = torch.randn(4, 64)
    tokens = head(hidden, temperature=0.9, seed=3, offset=2, num_samples=5)
    expected = fs.sample(hidden, model.lm_head.weight, temperature=0.9, seed=3, offset=2, num_samples=5)
    assert torch.equal(tokens, expected)


# ---------------------------------------------------------------- GPU: Qwen3-1.7B shape, bf16

QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=40960)


@pytest.fixture(scope="module")
def qwen3_1_7b(fst):
    transformers = import_or_skip("transformers")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3Config(**QWEN3_1_7B), dtype=torch.bfloat16, attn_implementation="sdpa")
    yield model.eval()
    del model
    torch.cuda.empty_cache()


GPU_PROMPT_LENGTHS = [17, 5, 64, 33]


def gpu_prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, QWEN3_1_7B["vocab_size"], (n,), generator=g).tolist() for n in GPU_PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def qwen3_1_7b_fused(fst, qwen3_1_7b):
    """Its own copy of the model (fuse_projections edits the model), compiled decode steps."""
    transformers = import_or_skip("transformers")
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.Qwen3Config(**QWEN3_1_7B), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.load_state_dict(qwen3_1_7b.state_dict())
    assert fst.fuse_projections(model) == 2 * QWEN3_1_7B["num_hidden_layers"]
    yield model.eval()
    del model
    torch.cuda.empty_cache()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("body", ["eager", "compiled_fused"])
@torch.no_grad()
def test_gpu_qwen3_1_7b_tokens_equal_reference_on_own_logits(fst, qwen3_1_7b, body, request):
    """compiled_fused: the benchmark's body (fused projections, compiled steps with the
    grouped GEMM attention), checked against the model's standard forward like the eager one."""
    prompts = gpu_prompts()
    temperature, seed, offset, steps = 0.7, 77, 1000, 24
    if body == "eager":
        model = qwen3_1_7b
        decoder = fst.FlashSamplingDecoder(model, cuda_graph=False)
    else:
        model = request.getfixturevalue("qwen3_1_7b_fused")
        decoder = fst.FlashSamplingDecoder(model, cuda_graph=False, compile_body=True)
    recorded = []

    def recording_sampler(hidden, seed_t, offset_t):
        tokens = decoder.head(hidden, temperature=temperature, seed=seed_t, offset=offset_t)
        recorded.append((hidden.clone(), int(offset_t), tokens.clone()))
        return tokens

    out = decoder.generate_with_sampler(prompts, sampler=recording_sampler, max_new_tokens=steps, seed=seed,
                                        offset=offset)
    assert len(recorded) == steps
    weight = model.lm_head.weight
    w64 = weight.double()
    totals = [0, 0]
    hf_mismatch = 0
    for t, (hidden, off, tokens) in enumerate(recorded):
        assert off == offset + t
        # Same state, float64 reference of the fused logits: exact up to fp32 near ties.
        ref = reference_sample(hidden, weight, temperature, seed=seed, offset=off)
        totals[0] += pathwise_mismatches(tokens, ref)[1]
        # The model's own (bf16) lm_head logits of the same hidden state.
        logits = model.lm_head(hidden)
        tok, gap, tol = fst.reference_sample_from_logits(logits, temperature, seed, off,
                                                         rtol=fst.logits_rtol(logits.dtype))
        differ = tok.cpu() != tokens[:, 0].cpu()
        totals[1] += int((differ & (gap.cpu() >= tol.cpu())).sum())
        hf_mismatch += int(differ.sum())
    assert totals[0] == 0 and totals[1] == 0, totals
    print(f"\n[qwen3-1.7b bf16, {body}] {steps} steps x {len(prompts)} rows: {hf_mismatch} near-tie mismatches "
          "vs bf16 logits")

    # The model's standard forward (no cache, its own masks) over the generated sequences:
    # its logits must agree with ours to bf16 accuracy, and its tokens with ours but for
    # gaps that this difference explains.
    hf_logits = model_step_logits(model, out)
    unexplained, worst = 0, 0.0
    for t, (hidden, off, tokens) in enumerate(recorded):
        ours = hidden.double() @ w64.T
        theirs = hf_logits[:, t]
        delta = (ours - theirs).abs().amax(dim=1)
        worst = max(worst, float((delta / (ours.abs().amax(dim=1) + 1)).max()))
        tok, gap, tol = fst.reference_sample_from_logits(theirs, temperature, seed, off)
        unexplained += int(((tok != tokens[:, 0]) & (gap >= 2 * delta / temperature + tol)).sum())
    print(f"[qwen3-1.7b bf16, {body}] standard forward vs decoder logits: max relative difference {worst:.2e}")
    assert worst < 0.05, "the decoder's hidden states differ from the model's standard forward"
    assert unexplained == 0


@pytest.mark.requires_cuda
@pytest.mark.parametrize("batch,length", [(1, 384), (5, 200), (32, 448)])
def test_gpu_grouped_decode_matmul_attention(fst, batch, length):
    """The compiled decode steps' attention (two GEMMs, float32 scores and softmax) against a
    float64 reference, bf16 inputs, ragged masks (a row may see one slot only)."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    q, k, v = (torch.randn(batch, 8, n, 128, device="cuda", generator=g).to(torch.bfloat16)
               for n in (2, length, length))
    lengths = torch.randint(1, length + 1, (batch,), device="cuda", generator=g)
    lengths[0] = 1
    mask = (torch.arange(length, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    out = torch.compile(fst.attention._grouped_decode_matmul_attention, dynamic=True)(q, k, v, mask, 0.088)
    scores = (q.double() @ k.double().transpose(-1, -2) * 0.088).masked_fill(~mask, float("-inf"))
    ref = torch.softmax(scores, dim=-1) @ v.double()
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[0].double(), v[0, :, :1].double().expand(8, 2, 128))  # one slot: its value


@pytest.mark.requires_cuda
@torch.no_grad()
def test_gpu_qwen3_1_7b_cuda_graph_equals_eager_and_stops(fst, qwen3_1_7b):
    model, prompts = qwen3_1_7b, gpu_prompts()
    kwargs = dict(max_new_tokens=20, temperature=1.0, seed=5, offset=3)
    eager = fst.FlashSamplingDecoder(model, cuda_graph=False).generate(prompts, **kwargs)
    decoder = fst.FlashSamplingDecoder(model, cuda_graph=True)
    graphed = decoder.generate(prompts, **kwargs, return_timings=True)
    assert graphed.timed_steps == 20 - 1 - decoder.warmup_steps  # the rest were graph replays
    assert torch.equal(graphed.new_tokens, eager.new_tokens)
    again = decoder.generate(prompts, **kwargs, return_timings=True)  # replays the captured graph
    assert again.timed_steps == 19
    assert torch.equal(again.new_tokens, eager.new_tokens)
    stop = int(eager.new_tokens[2, 4])
    stopped = decoder.generate(prompts, **kwargs, stop_token_ids=[stop], pad_token_id=0)
    n = int(stopped.num_new_tokens[2])
    assert n <= 5 and int(stopped.new_tokens[2, n - 1]) == stop
    for b, m in enumerate(stopped.num_new_tokens.tolist()):  # identical up to each row's stop
        assert torch.equal(stopped.new_tokens[b, :m], eager.new_tokens[b, :m])
        assert bool((stopped.new_tokens[b, m:] == 0).all())
