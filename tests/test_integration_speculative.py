"""flashsampling_cuda.integrations.transformers.speculative: speculative decoding of Hugging Face
causal LMs verified with speculative_sample.

CPU, tiny random-weight models: greedy decoding equals the target's plain greedy tokens (the
model's standard forward, reference_generate) whatever the proposer, rows accepting different
numbers of drafts in one batch included; sampled decoding follows the target's distribution
over the first three tokens (chi-square over many rows with per-row seeds, a Granite-style
model with a logit scale and top_k and a soft-capped Gemma 2-style one included); a row's tokens depend only on its seed; the
refusals. Skipped where transformers is not installed.
"""

import pathlib
import subprocess
import sys

import pytest
import torch

from sampling_stats import chi_square_pvalue
from test_integration_transformers import COMMON, PROMPTS, assert_same_path, import_or_skip, tiny_model


@pytest.fixture(scope="module")
def fst():
    return import_or_skip("flashsampling_cuda.integrations.transformers")


@pytest.fixture(scope="module")
def spec(fst):
    return fst.speculative


def target_model(**overrides):
    """The tiny Llama of the integration tests with its last layer's residual writes shrunk, so
    that its first layer alone (truncated_draft_model(model, 1)) is a draft that is often right."""
    model = tiny_model("llama", **overrides)
    last = model.model.layers[-1]
    with torch.no_grad():
        last.self_attn.o_proj.weight.mul_(0.1)
        last.mlp.down_proj.weight.mul_(0.1)
    return model


class OracleProposer:
    """Drafts the reference's own tokens, every third one (varying with the row) replaced by
    another: rows accept different numbers of drafts, and every draft count occurs."""

    def __init__(self, reference_tokens, prompts, vocab):
        self.reference, self.prompt_lengths, self.vocab = reference_tokens, [len(p) for p in prompts], vocab

    def start(self, input_ids, attention_mask, position_ids):
        pass

    def rollback(self, num_slots):
        pass

    def propose(self, state, n):
        drafts = []
        for b, history in enumerate(state.history):
            done = len(history) - self.prompt_lengths[b]
            row = []
            for j in range(n):
                t = done + j
                token = int(self.reference[b, t]) if t < self.reference.shape[1] else 0
                row.append((token + 1) % self.vocab if (t + b) % 3 == 2 else token)
            drafts.append(row)
        return torch.tensor(drafts), None


def test_ngram_lookup(spec):
    proposer = spec.NgramProposer(max_ngram=3)
    assert proposer.lookup([1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]  # after the latest earlier "1 2"
    assert proposer.lookup([7, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a match near the end repeats its period
    assert proposer.lookup([4, 5, 6], 2) == [6, 6]  # no match: the last token
    with pytest.raises(ValueError, match="min_ngram"):
        spec.NgramProposer(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("proposer_kind", ["ngram", "draft_sampled", "draft_greedy", "oracle"])
def test_greedy_equals_plain_greedy_decoding(fst, spec, proposer_kind):
    """T = 0: the tokens are the target's greedy tokens (its standard forward, one token at a
    time), whatever the proposer and however many drafts each row accepts."""
    model = target_model()
    kwargs = dict(max_new_tokens=16, temperature=0.0)
    ref = fst.reference_generate(model, PROMPTS, **kwargs)
    proposer = {
        "ngram": lambda: spec.NgramProposer(),
        "draft_sampled": lambda: spec.DraftModelProposer(spec.truncated_draft_model(model, 1)),
        "draft_greedy": lambda: spec.DraftModelProposer(spec.truncated_draft_model(model, 1), sample_drafts=False),
        "oracle": lambda: OracleProposer(ref.new_tokens, PROMPTS, COMMON["vocab_size"]),
    }[proposer_kind]()
    out = spec.speculative_generate(model, PROMPTS, proposer=proposer, num_draft_tokens=3, **kwargs)
    assert assert_same_path(out, ref) == out.new_tokens.numel()
    assert torch.equal(out.num_new_tokens, torch.full((3,), 16))
    assert bool((out.num_accepted <= out.num_drafted).all()) and torch.equal(out.num_drafted, 3 * out.num_steps)
    if proposer_kind != "ngram":  # the drafts are often right: fewer target forwards than tokens
        assert out.acceptance_rate > 0.3 and out.tokens_per_step > 1.5, (out.acceptance_rate, out.tokens_per_step)
    if proposer_kind == "oracle":  # rows accepted different numbers of drafts in the same steps
        assert len(set(out.num_steps.tolist())) > 1


def test_greedy_stops_and_eager_attention(fst, spec):
    model = target_model(attn="eager")
    free = fst.reference_generate(model, PROMPTS, max_new_tokens=12, temperature=0.0)
    stop = int(free.new_tokens[1, 4])
    kwargs = dict(max_new_tokens=12, temperature=0.0, stop_token_ids=[stop], pad_token_id=0)
    ref = fst.reference_generate(model, PROMPTS, **kwargs)
    out = spec.speculative_generate(model, PROMPTS, proposer=OracleProposer(free.new_tokens, PROMPTS, 384),
                                    num_draft_tokens=4, **kwargs)
    assert torch.equal(out.num_new_tokens, ref.num_new_tokens) and int(out.num_new_tokens[1]) <= 5
    width = ref.new_tokens.shape[1]
    assert torch.equal(out.new_tokens[:, :width], ref.new_tokens)
    assert bool((out.new_tokens[:, width:] == 0).all())


def exact_three_token_distribution(model, prompt, temperature, top_k=None):
    """P(t1, t2, t3 | prompt) of the model's own logits / T (top_k: truncated and renormalised
    at each step), float64 [V^3], from one forward over every two-token continuation."""
    vocab = model.config.vocab_size
    pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))
    with torch.no_grad():
        logits = model(torch.cat([torch.tensor(prompt).expand(vocab * vocab, len(prompt)), pairs], dim=1)).logits
    y = logits[:, len(prompt) - 1 :].double() / temperature  # [V * V, 3, V]: t1, t2 | t1, t3 | t1 t2
    if top_k is not None:
        y = y.masked_fill(y < y.topk(top_k, dim=2).values[:, :, -1:], -torch.inf)
    p = torch.softmax(y, dim=2).reshape(vocab, vocab, 3, vocab)
    return (p[0, 0, 0][:, None, None] * p[:, 0, 1][:, :, None] * p[:, :, 2]).reshape(-1)


@pytest.mark.parametrize("family,proposer_kind,top_k", [("llama", "ngram", None), ("llama", "draft_sampled", None),
                                                        ("granite", "draft_sampled", 3), ("gemma2", "ngram", None)])
def test_sampled_tokens_follow_the_target(fst, spec, family, proposer_kind, top_k):
    """T > 0: the first three tokens of 20000 rows (one prompt, per-row seeds, 2 drafts per step,
    so the third token comes from a step whose rows kept different numbers of slots) follow
    the target's own distribution; Granite's logit scale and Gemma 2's soft-cap go to the
    verification as they go to sample."""
    extra = {"granite": dict(logits_scaling=0.5), "gemma2": dict(final_logit_softcapping=1.0)}.get(
        family, dict(tie_word_embeddings=False))
    model = tiny_model(family, vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                       num_key_value_heads=1, initializer_range=0.5, attn="eager" if family == "gemma2" else "sdpa",
                       **extra)
    prompt, temperature, rows, vocab = [1, 5, 2], 0.9, 20000, 8
    proposer = (spec.NgramProposer() if proposer_kind == "ngram"
                else spec.DraftModelProposer(spec.truncated_draft_model(model, 1)))
    out = spec.speculative_generate(model, [prompt] * rows, proposer=proposer, num_draft_tokens=2, max_new_tokens=3,
                                    temperature=temperature, top_k=top_k, seed=torch.arange(rows) * 3 + 1)
    assert out.new_tokens.shape == (rows, 3)
    assert 0.05 < out.acceptance_rate < 1.0, out.acceptance_rate
    joint = exact_three_token_distribution(model, prompt, temperature, top_k)
    index = (out.new_tokens * torch.tensor([vocab * vocab, vocab, 1])).sum(dim=1)
    assert chi_square_pvalue([index], [joint]) > 1e-3


def test_reproducible_and_batch_invariant(spec):
    """With per-row seeds a row's tokens depend on its seed only, not on the batch (whose other
    rows accept other numbers of drafts) nor on the run; another seed gives other tokens."""
    model = target_model()
    draft = spec.truncated_draft_model(model, 1)
    kwargs = dict(num_draft_tokens=3, max_new_tokens=12, temperature=1.0)
    seeds = torch.tensor([11, 22, 33])
    batch = spec.speculative_generate(model, PROMPTS, proposer=spec.DraftModelProposer(draft), seed=seeds, **kwargs)
    again = spec.speculative_generate(model, PROMPTS, proposer=spec.DraftModelProposer(draft), seed=seeds, **kwargs)
    assert torch.equal(batch.new_tokens, again.new_tokens)
    for b in range(3):
        alone = spec.speculative_generate(model, [PROMPTS[b]], proposer=spec.DraftModelProposer(draft),
                                          seed=seeds[b : b + 1], **kwargs)
        assert torch.equal(alone.new_tokens[0], batch.new_tokens[b])
    other = spec.speculative_generate(model, PROMPTS, proposer=spec.DraftModelProposer(draft), seed=seeds + 1,
                                      **kwargs)
    assert not torch.equal(other.new_tokens, batch.new_tokens)


def test_truncated_draft_model_shares_the_targets_modules(spec):
    model = target_model()
    draft = spec.truncated_draft_model(model, 1)
    assert len(model.model.layers) == 2 and model.config.num_hidden_layers == 2  # the target is unchanged
    assert len(draft.model.layers) == 1 and draft.config.num_hidden_layers == 1
    assert draft.model.layers[0] is model.model.layers[0] and draft.lm_head is model.lm_head
    assert draft.model.norm is model.model.norm and draft.model.embed_tokens is model.model.embed_tokens
    with pytest.raises(ValueError, match="num_layers"):
        spec.truncated_draft_model(model, 3)


def test_refusals_and_argument_errors(fst, spec):
    sliding = tiny_model("mistral", sliding_window=32)
    with pytest.raises(fst.UnsupportedModelError, match="sliding-window"):
        spec.speculative_generate(sliding, PROMPTS, proposer=spec.NgramProposer(), max_new_tokens=8)
    model = target_model()
    with pytest.raises(ValueError, match="num_draft_tokens"):
        spec.speculative_generate(model, PROMPTS, proposer=spec.NgramProposer(), num_draft_tokens=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        spec.speculative_generate(model, PROMPTS, proposer=spec.NgramProposer(), max_new_tokens=4, temperature=-1.0)

    class Short(spec.NgramProposer):
        def propose(self, state, n):
            return super().propose(state, n)[0][:, :-1], None

    with pytest.raises(ValueError, match="proposer returned draft ids"):
        spec.speculative_generate(model, PROMPTS, proposer=Short(), max_new_tokens=4)


def test_demo_script_runs(spec):
    """scripts/speculative_demo.py on a smaller model: both proposers, greedy check passed."""
    script = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "speculative_demo.py"
    result = subprocess.run([sys.executable, str(script), "--device", "cpu", "--layers", "2", "--hidden", "64",
                             "--vocab", "256", "--new-tokens", "12", "--batch", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("greedy tokens equal to plain decoding in 2/2 rows") == 2, result.stdout
