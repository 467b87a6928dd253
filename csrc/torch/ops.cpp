// The operator schemas of the flashsampling library: defined here once; backends
// register implementations with TORCH_LIBRARY_IMPL (sample_cpu.cpp, noise_cpu.cpp,
// sample_cuda.cpp) and flashsampling_cuda/sampling.py registers the fake kernels.
#include <Python.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>

#include "flashsampling/kernel_choice.h"
#include "flashsampling/streaming_chunks.h"

namespace {

// The fused-GEMM unit the CUDA dispatch runs for a call (flashsampling/kernel_choice.h): its
// file stem in csrc/kernels/instantiations/, "" for an architecture without kernels. A pure
// function, so CPU builds answer it too (tests/test_kernel_choice.py).
std::string kernel_choice(int64_t arch, const std::string& loop, int64_t columns, bool bf16, bool column_clusters,
                          bool top_candidates_epilogue_warpgroups, bool plain_loop_extras,
                          bool narrow_ragged_columns, bool tile_winners) {
  using flashsampling::SamplerLoop;
  SamplerLoop kind = static_cast<SamplerLoop>(-1);
  for (int i = 0; i < flashsampling::kSamplerLoops; ++i) {
    if (loop == flashsampling::sampler_loop_name(static_cast<SamplerLoop>(i))) kind = static_cast<SamplerLoop>(i);
  }
  TORCH_CHECK(static_cast<int>(kind) >= 0, "flashsampling._kernel_choice: loop must be plain, common_controls, ",
              "all_controls or top_candidates, got '", loop, "'");
  TORCH_CHECK(columns >= 1, "flashsampling._kernel_choice: columns must be >= 1, got ", columns);
  return flashsampling::kernel_unit_name(
      flashsampling::choose_kernel(static_cast<int>(arch), kind, columns, column_clusters,
                                   top_candidates_epilogue_warpgroups, plain_loop_extras, narrow_ragged_columns,
                                   tile_winners),
      bf16);
}

flashsampling::LoopNeeds loop_needs_of(const char* op, bool model_transform, bool penalties,
                                       bool per_row_temperatures, bool logit_bias, bool allowed_mask, bool logprobs,
                                       bool sparse_bias, bool per_row_keys, int64_t num_samples) {
  TORCH_CHECK(num_samples >= 1, op, ": num_samples must be >= 1, got ", num_samples);
  flashsampling::LoopNeeds needs;
  needs.model_transform = model_transform;
  needs.penalties = penalties;
  needs.per_row_temperatures = per_row_temperatures;
  needs.logit_bias = logit_bias;
  needs.allowed_mask = allowed_mask;
  needs.logprobs = logprobs;
  needs.sparse_bias = sparse_bias;
  needs.per_row_keys = per_row_keys;
  needs.num_samples = static_cast<int>(std::min<int64_t>(num_samples, 2));  // only 1 or more matters
  return needs;
}

// The epilogue loop a call with these needs (sampler_loop.h's sampler_loop_for), by the name
// _kernel_choice takes; a pure function, as above.
std::string sampler_loop(bool model_transform, bool penalties, bool per_row_temperatures, bool logit_bias, bool allowed_mask,
                         bool logprobs, bool sparse_bias, bool per_row_keys, int64_t num_samples) {
  return flashsampling::sampler_loop_name(flashsampling::sampler_loop_for(
      loop_needs_of("flashsampling._sampler_loop", model_transform, penalties, per_row_temperatures, logit_bias,
                    allowed_mask, logprobs, sparse_bias, per_row_keys, num_samples)));
}

// Whether the plain epilogue-warpgroup loop also takes such a call of batch_size rows
// (sampler_loop.h's needs_only_plain_loop_extras: _kernel_choice's plain_loop_extras).
bool plain_loop_extras(bool model_transform, bool penalties, bool per_row_temperatures, bool logit_bias,
                       bool allowed_mask, bool logprobs, bool sparse_bias, bool per_row_keys, int64_t num_samples,
                       int64_t batch_size) {
  return flashsampling::needs_only_plain_loop_extras(
      loop_needs_of("flashsampling._plain_loop_extras", model_transform, penalties, per_row_temperatures, logit_bias,
                    allowed_mask, logprobs, sparse_bias, per_row_keys, num_samples),
      batch_size);
}

// The streaming kernels' split of their rows (flashsampling/streaming_chunks.h), pure functions as
// above (tests/test_streaming_chunks.py): a launch's chunks a listed quad and tokens a chunk, and
// the grid of a launch of `quads` quads; a top_p round's tokens a chunk.
std::tuple<int64_t, int64_t, int64_t> streaming_chunks(int64_t listed_quads, int64_t quads, int64_t vocab,
                                                       int64_t sm_count, bool one_wave) {
  TORCH_CHECK(quads >= 1 && listed_quads >= 1 && listed_quads <= quads,
              "flashsampling._streaming_chunks: need 1 <= listed_quads <= quads, got ", listed_quads, " and ", quads);
  TORCH_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 22), "flashsampling._streaming_chunks: vocab must be in [1, 2^22], got ",
              vocab);
  TORCH_CHECK(sm_count >= 1 && sm_count <= 4096, "flashsampling._streaming_chunks: sm_count must be in [1, 4096], got ",
              sm_count);
  flashsampling::EvenChunks const split = flashsampling::quad_chunks(
      static_cast<uint32_t>(listed_quads), static_cast<uint32_t>(vocab), static_cast<int>(sm_count), one_wave);
  return {split.chunks, split.tokens,
          flashsampling::most_streaming_items(quads, vocab, static_cast<int>(sm_count), one_wave)};
}

int64_t round_chunk_tokens(int64_t rows, int64_t vocab, int64_t ctas, int64_t step) {
  TORCH_CHECK(rows >= 0, "flashsampling._round_chunk_tokens: rows must be >= 0, got ", rows);
  TORCH_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 22), "flashsampling._round_chunk_tokens: vocab must be in [1, 2^22], got ",
              vocab);
  TORCH_CHECK(ctas >= 1 && ctas <= 65536, "flashsampling._round_chunk_tokens: ctas must be in [1, 65536], got ", ctas);
  TORCH_CHECK(step == flashsampling::kRoundChunkTokens || step == flashsampling::kRoundDrawChunkTokens,
              "flashsampling._round_chunk_tokens: step must be ", flashsampling::kRoundChunkTokens, " (verifying rounds) or ",
              flashsampling::kRoundDrawChunkTokens, " (drawing rounds), got ", step);
  return flashsampling::round_chunk_tokens(rows, vocab, ctas, step);
}

}  // namespace

TORCH_LIBRARY(flashsampling, m) {
  // Exact Gumbel-Max sampling fused with the LM-head GEMM:
  //   token[b, s] = argmax_v(score(b, s, v)), score = fma(x[b, v], fl32(1 / T_b), g(seed, offset, stream_b, s, v)),
  //   x = hidden[b, :] . weight[v, :] in fp32, scaled and soft-capped, plus biases, over the allowed tokens
  //   (checks.h, SampleArgs, has the whole rule). Returns int64 [B, num_samples].
#define FS_SAMPLE_ARGS                                                                                  \
  "Tensor hidden, Tensor weight, *, float temperature=1.0, Tensor? temperatures=None, "                \
  "int num_samples=1, Tensor? seed=None, Tensor? offset=None, Generator? generator=None, "              \
  "Tensor? logit_bias=None, Tensor? sparse_bias_ids=None, Tensor? sparse_bias_values=None, "           \
  "Tensor? allowed_mask=None, int? empty_mask_token=None, int vocab_start=0"
  // The model-side transforms of the raw logit, before the biases (checks.h; sample_top_k has
  // none: flashsampling_cuda.sample takes the logits route for truncation with them).
#define FS_MODEL_ARGS ", float logit_scale=1.0, float? logit_softcap=None"
  // The penalties of the tokens each row has seen, after the biases (checks.h; docs/penalties.md:
  // flashsampling_cuda.sample passes a PenaltyState's ids, the frequency / presence terms per
  // entry and the repetition penalty per row; sample_top_k has none).
#define FS_PENALTY_ARGS ", Tensor? penalty_ids=None, Tensor? penalty_values=None, Tensor? repetition_penalties=None"
  // Per-row noise streams (checks.h: int64 [B], in place of the row or 0): speculative
  // verification samples position j of row b as a row of its own with row b's stream.
#define FS_STREAM_ARGS ", Tensor? streams=None"
  m.def("sample(" FS_SAMPLE_ARGS FS_MODEL_ARGS FS_PENALTY_ARGS FS_STREAM_ARGS ") -> Tensor",
        {at::Tag::nondeterministic_seeded});
  // The same sample plus the winning scores [B, S] (what tensor-parallel ranks compare)
  // and, with return_logprobs, the log-probability of each token [B, S] and the
  // logsumexp [B] of the transformed logits (empty [0] tensors otherwise).
  m.def("sample_with_scores(" FS_SAMPLE_ARGS FS_MODEL_ARGS FS_PENALTY_ARGS FS_STREAM_ARGS
        ", bool return_logprobs=False) -> (Tensor tokens, Tensor scores, Tensor token_logprobs, Tensor logsumexp)",
        {at::Tag::nondeterministic_seeded});
  // Fused truncation (flashsampling_cuda/truncation.py has the semantics): keep the top_k
  // largest y = x / T (top_k <= 0: off), then top_p and min_p, then sample the survivors with
  // the noise of plain sampling. int32 or int64 top_ks and float32 or float64 top_ps / min_ps
  // [B] win over the scalars (None / absent: off). Stage 2 decides from the GEMM's candidates the
  // rows with top_k <= 64 and the rows without top_k whose cut falls within their first 64
  // tokens; the others are sampled from the logits the GEMM stored in the same pass. Outputs as
  // sample_with_scores; the log-probabilities are those of the truncated, renormalised
  // distribution. No sparse bias (it takes the logits path). streams: speculative verification's
  // positions with truncation, as for sample.
  m.def("sample_top_k(" FS_SAMPLE_ARGS
        ", bool return_logprobs=False, int top_k=0, float? top_p=None, Tensor? top_ps=None, float? min_p=None, "
        "Tensor? min_ps=None, Tensor? top_ks=None" FS_STREAM_ARGS ") -> (Tensor tokens, Tensor scores, "
        "Tensor token_logprobs, Tensor logsumexp)",
        {at::Tag::nondeterministic_seeded});
  // A plain sample (as sample_with_scores with return_logprobs, one sample) through the fused
  // top-k pass with nothing on, and each row's top_n processed log-probabilities (values
  // descending, exact ties to the smaller id; local ids) and the sample's 1-based rank [B, 1],
  // with the call's logits x [B, V] (fp32, bias added) for further outputs: the fused route of
  // flashsampling_cuda.sample(top_logprobs=...) (flashsampling_cuda/logprobs.py). With raw (no
  // logit_bias) token_logprobs, logsumexp, the top N and the rank are those of the raw logits
  // (logprobs_mode="raw"). CUDA (sm_90) only; no allowed_mask or sparse bias.
  m.def("_sample_top_logprobs(" FS_SAMPLE_ARGS
        ", int top_n=0, bool raw=False) -> (Tensor tokens, Tensor scores, Tensor token_logprobs, Tensor logsumexp, "
        "Tensor top_logprobs, Tensor top_ids, Tensor ranks, Tensor logits)",
        {at::Tag::nondeterministic_seeded});
  // The CPU op from precomputed fp32 logits [B, V] (the raw hidden . weight, before biases) in
  // place of hidden and weight: the same sample, biases, mask, noise and outputs as
  // sample_with_scores. The materialised top-k / top-p path of the CPU samples its survivors
  // with it from the logits it has computed once (flashsampling_cuda/truncation.py).
  m.def("_sample_logits(Tensor logits, *, float temperature=1.0, Tensor? temperatures=None, int num_samples=1, "
        "Tensor? seed=None, Tensor? offset=None, Generator? generator=None, Tensor? logit_bias=None, "
        "Tensor? sparse_bias_ids=None, Tensor? sparse_bias_values=None, Tensor? allowed_mask=None, "
        "int? empty_mask_token=None, int vocab_start=0, bool return_logprobs=False) "
        "-> (Tensor tokens, Tensor scores, Tensor token_logprobs, Tensor logsumexp)",
        {at::Tag::nondeterministic_seeded});
#undef FS_STREAM_ARGS
#undef FS_PENALTY_ARGS
#undef FS_MODEL_ARGS
#undef FS_SAMPLE_ARGS
  // Sampling from materialised fp32 logits [B, V] (flashsampling/sample_from_logits.h): the
  // controls of sample (no sparse bias: add it to the logits), then top_k, top_p and min_p as
  // host scalars or per-row [B] device arrays (int32 or int64 top_ks, float32 or float64
  // top_ps / min_ps) that win over them, then Gumbel-Max over the survivors with the noise of
  // plain sampling. Outputs as sample_with_scores; the log-probabilities are those of the
  // truncated distribution.
  m.def("sample_from_logits(Tensor logits, *, float temperature=1.0, Tensor? temperatures=None, "
        "int num_samples=1, Tensor? seed=None, Tensor? offset=None, Generator? generator=None, "
        "Tensor? logit_bias=None, Tensor? allowed_mask=None, int? empty_mask_token=None, int vocab_start=0, "
        "bool return_logprobs=False, int top_k=0, Tensor? top_ks=None, float top_p=1.0, Tensor? top_ps=None, "
        "float min_p=0.0, Tensor? min_ps=None) -> (Tensor tokens, Tensor scores, Tensor token_logprobs, "
        "Tensor logsumexp)",
        {at::Tag::nondeterministic_seeded});
  // The top-N log-probabilities of materialised values [B, V] float32 and the ranks of the
  // sampled tokens [B, S] (local ids), for the logprob outputs (flashsampling/top_logprobs.h);
  // lse float64 [B]; raw: fl32(fl64(y) - lse), else fl32(y - fl32(lse)), y = fl32(values *
  // scales[b]) with scales float32 [B], y = values without. CUDA only: the CPU computes them in
  // torch ops (flashsampling_cuda/logprobs.py).
  m.def("_top_logprobs(Tensor values, Tensor lse, Tensor tokens, int top_n, bool raw, Tensor? scales=None) -> "
        "(Tensor top_values, Tensor top_ids, Tensor ranks)");
  // The float32 log-sum-exp [B] of each row of values [B, V] float32: the raw logprob outputs'
  // normaliser. CUDA: one read of the rows (torch.logsumexp's eager passes read them four times);
  // the CPU: torch.logsumexp (flashsampling_cuda/logprobs.py).
  m.def("_row_logsumexp(Tensor values) -> Tensor");
  // What step 3 of the penalties adds to each seen token's logit (flashsampling_cuda/penalties.py,
  // fused_penalty_args; flashsampling/penalty_values_launch.h): float32 [B, C] from a PenaltyState's
  // ids [B, C] and output_counts (int32 [B, C]), frequency / presence as host values or float32 [B]
  // (None: off). CUDA only: elsewhere the same bits come from torch ops.
  m.def("_penalty_values(Tensor ids, Tensor output_counts, float? frequency=None, Tensor? frequencies=None, "
        "float? presence=None, Tensor? presences=None) -> Tensor");
  // Speculative verification's position rows (flashsampling_cuda/speculative.py,
  // position_tokens_fused): hidden [P * B, D], position-major. Position p of batch row b is GEMM
  // column p * B + b and draws the noise of sample p of row b (sample's layout of several samples:
  // a batch-wide seed's column quads share their Philox blocks), with row b's temperature, bias and
  // mask. seed and offset: int64 0-d or [B]. -> tokens, scores and token_logprobs [B, P] (each
  // under its own position's distribution; token_logprobs [0] without return_logprobs). CUDA; the
  // CPU kernel is speculative.py's, the same rows through sample_with_scores.
  m.def("_sample_positions(Tensor hidden, Tensor weight, int positions, *, float temperature=1.0, "
        "Tensor? temperatures=None, Tensor seed, Tensor offset, Tensor? logit_bias=None, Tensor? allowed_mask=None, "
        "int? empty_mask_token=None, int vocab_start=0, float logit_scale=1.0, float? logit_softcap=None, "
        "bool return_logprobs=False) -> (Tensor tokens, Tensor scores, Tensor token_logprobs)",
        {at::Tag::nondeterministic_seeded});
  // Speculative verification with sampled drafts (flashsampling_cuda/speculative.py, verify;
  // flashsampling/draft_rows_launch.h): per row b and draft position j < J of the target's fp32
  // logits [B, P, V], with y = fl(x * scales[b]) and -inf outside `allowed`, the log-sum-exp, the
  // argmax and y at draft_columns[b, j] (outside [0, V): none); and the logits [B, V] of each row's emitted
  // sample at position stop[b] (the residual log max(0, exp(y - lse) - q) where residual[b], else
  // x over the allowed tokens). CUDA; the CPU kernels are speculative.py's torch ops.
  m.def("_draft_position_stats(Tensor logits, Tensor scales, Tensor draft_columns, Tensor? allowed=None) "
        "-> (Tensor lse, Tensor argmax, Tensor y_draft)");
  m.def("_stop_row_logits(Tensor logits, Tensor draft_probs, Tensor stop, Tensor scales, Tensor lse, "
        "Tensor residual, Tensor? allowed=None) -> Tensor");
  // Then the acceptance walk (flashsampling/draft_rows_launch.h, AcceptDraftsParams): from the
  // stats, draft_columns [B, n] (local; outside [0, V): none), draft_probs float32 [B, n, V] and the step's
  // seeds, offsets, streams (int64 [B]) and temperatures (float32 [B]), each row's accepted count,
  // whether its sample is the residual's, and that sample's temperature and offset. And for either
  // kind of draft the step's tokens [B, n + 1] (DraftTokensParams): emitted [B, 1] with
  // num_accepted (sampled drafts), or each position's token [B, n + 1] without (one-hot drafts).
  m.def("_accept_drafts(Tensor lse, Tensor argmax, Tensor y_draft, Tensor draft_columns, Tensor draft_probs, "
        "Tensor seeds, Tensor offsets, Tensor streams, Tensor temps) -> (Tensor num_accepted, Tensor residual, "
        "Tensor sample_temps, Tensor sample_offsets)");
  m.def("_draft_tokens(Tensor draft_token_ids, Tensor emitted, Tensor? num_accepted=None) -> (Tensor tokens, "
        "Tensor num_accepted)");
  // The model-side transforms of fp32 raw logits (any shape), elementwise: fl(l * logit_scale),
  // then fl(cap * tanh(fl(l * fl(1 / cap)))) with philox_gumbel.h's tanh (fs_model_logit), the
  // bits the fused op computes in its epilogue; the logits route applies them with this op.
  m.def("_model_logits(Tensor logits, float logit_scale=1.0, float? logit_softcap=None) -> Tensor");
  // The skip's bound of a soft-capped logit in the plain epilogue-warpgroup kernel (fs_softcap_upper_bound).
  m.def("_softcap_upper_bound(Tensor logits, float logit_softcap) -> Tensor");
  // The fp32 logits [B, V] = hidden @ weight.T exactly as the CPU op computes them
  // (csrc/torch/logits_cpu.h), for the materialised truncation path.
  m.def("_logits(Tensor hidden, Tensor weight) -> Tensor");
  // The Gumbel noise g(seed, offset, stream, sample, vocab_index) of philox_gumbel.h;
  // `stream` and `vocab_index` are int64 tensors broadcast together. Returns float32.
  m.def("gumbel_noise(int seed, int offset, Tensor stream, int sample, Tensor vocab_index) -> Tensor");
  // fs_uniform_noise elementwise over int64 tensors of one shape, all on one device (seed and
  // offset as uint64 bits, stream, sample and vocab_index as their low 32 bits; values not read
  // on the host, so it runs under graph capture): speculative verification's acceptance draws.
  m.def("_uniform_noise(Tensor seed, Tensor offset, Tensor stream, Tensor sample, Tensor vocab_index) -> Tensor");
  // The tensor-parallel exchange (flashsampling/shard_keys.h, flashsampling_cuda/distributed.py):
  // int64 keys of a shard's (tokens, scores), and the merge of every rank's keys
  // gathered [world, B, C] (keys in the first num_samples of C) -> (best key, its first rank,
  // token) [B, num_samples], mask_empty_token for rows no shard's mask allows anything in.
  // The truncation cut's radix search over order keys (flashsampling/key_search.h;
  // flashsampling_cuda/shard_truncation.py runs its rounds, across tensor-parallel shards by
  // all-reduces of the histograms). CUDA only: the CPU runs the same search in torch ops.
  // row_scales: y holds x, and the kernels take fl32(x * row_scales[b]) (no y written).
  m.def("_first_order_keys(Tensor y, Tensor? allowed_mask, int vocab_start, Tensor? row_scales=None) -> Tensor");
  m.def("_order_key_round(Tensor y, Tensor? allowed_mask, int vocab_start, int shift, Tensor target, Tensor? state, "
        "Tensor? hist, Tensor? limit=None, Tensor? y0=None, Tensor? min_ps=None, Tensor? first=None, "
        "Tensor? row_scales=None) -> (Tensor state, Tensor hist)");
  m.def("_order_key_cut_mask(Tensor y, Tensor? allowed_mask, int vocab_start, Tensor cut, Tensor? first=None, "
        "Tensor? y0=None, Tensor? min_ps=None, Tensor? row_scales=None) -> Tensor");
  m.def("_shard_keys(Tensor tokens, Tensor scores) -> Tensor");
  m.def("_merge_shard_keys(Tensor gathered, int num_samples, int mask_empty_token) -> (Tensor, Tensor, Tensor)");
  // Test hooks into philox_gumbel.h (tests/test_noise.py).
  m.def("_philox4x32_10(Tensor counter, Tensor key) -> Tensor");
  m.def("_logf(Tensor x) -> Tensor");
  m.def("_gumbel_from_bits(Tensor bits) -> Tensor");
  // The skip bound of the epilogue-warpgroup kernels (fs_gumbel_upper_bound_from_bits).
  m.def("_gumbel_upper_bound(Tensor bits) -> Tensor");
  // The dispatch's kernel choice (above).
  m.def("_kernel_choice(int arch, str loop, int columns, bool bf16=True, bool column_clusters=True, "
        "bool top_candidates_epilogue_warpgroups=True, bool plain_loop_extras=False, "
        "bool narrow_ragged_columns=True, bool tile_winners=False) -> str",
        &kernel_choice);
  m.def("_streaming_chunks(int listed_quads, int quads, int vocab, int sm_count, bool one_wave) -> (int, int, int)",
        &streaming_chunks);
  m.def("_round_chunk_tokens(int rows, int vocab, int ctas, int step=4096) -> int", &round_chunk_tokens);
  m.def("_sampler_loop(*, bool model_transform=False, bool penalties=False, bool per_row_temperatures=False, "
        "bool logit_bias=False, bool allowed_mask=False, bool logprobs=False, bool sparse_bias=False, bool per_row_keys=False, "
        "int num_samples=1) -> str",
        &sampler_loop);
  m.def("_plain_loop_extras(*, bool model_transform=False, bool penalties=False, bool per_row_temperatures=False, "
        "bool logit_bias=False, bool allowed_mask=False, bool logprobs=False, bool sparse_bias=False, "
        "bool per_row_keys=False, int num_samples=1, int batch_size=1) -> bool",
        &plain_loop_extras);
}

// `import flashsampling_cuda._C` loads this library (and so runs the registrations
// above); the module itself is empty. Only the stable Python C API is used, so one
// build serves every CPython >= 3.9 (setup.py builds with py_limited_api).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
