// Arguments of flashsampling::sample / sample_with_scores shared by every backend
// (CPU, CUDA): one struct, one set of checks, one registration helper.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace flashsampling {

// Everything of the op's schema (csrc/torch/ops.cpp) after hidden and weight.
//
// Transformed logit of row b, vocabulary index v (global index vocab_start + v):
//   l = fs_model_logit(logit, logit_scale, logit_softcap) (philox_gumbel.h: fl32(logit * logit_scale),
//       then fl32(cap * fs_tanhf(fl32(l * fl32(1 / cap)))); each only when on)
//   x = fl32(fl32(l + logit_bias[v]) + sum of sparse_bias_values[b, k] over the k
//       with sparse_bias_ids[b, k] == vocab_start + v)    (each term only when given)
//   where penalty_ids[b, k] == vocab_start + v for some k (the row's seen tokens; ids distinct
//   in a row): x = x > 0 ? fl32(x / r_b) : fl32(x * r_b) with r_b = repetition_penalties[b],
//   then x = fl32(x + penalty_values[b, k])                 (each only when given)
//   excluded when allowed_mask[b] has bit v clear;
//   score = fma(x, fl32(1 / T_b), g) (T_b > 0) or x (T_b == 0, greedy, no noise);
//   y = fl32(x * fl32(1 / T_b)) (T_b > 0) or x (greedy): the logits of the log-probabilities.
struct SampleArgs {
  double temperature = 1.0;
  std::optional<at::Tensor> temperatures;  // float32 [B] on hidden's device; wins over temperature
  int64_t num_samples = 1;
  std::optional<at::Tensor> seed;    // int64 [] or [B]
  std::optional<at::Tensor> offset;  // int64 [] or [B]
  std::optional<at::Generator> generator;
  std::optional<at::Tensor> logit_bias;          // float32 [V]
  std::optional<at::Tensor> sparse_bias_ids;     // int32 or int64 [B, K] global ids; others ignored
  std::optional<at::Tensor> sparse_bias_values;  // float32 [B, K]
  std::optional<at::Tensor> allowed_mask;        // int32 [B, ceil(V / 32)], bit v & 31 of word v >> 5
  // A row whose allowed_mask allows nothing gets this token; absent: such a row is an error.
  // A global id in [vocab_start, vocab_start + V) or negative (a marker such as -1).
  std::optional<int64_t> empty_mask_token;
  int64_t vocab_start = 0;  // global index of weight row 0 (tensor-parallel shards)
  bool return_logprobs = false;
  double logit_scale = 1.0;              // 1: off
  std::optional<double> logit_softcap;   // absent: off
  std::optional<at::Tensor> penalty_ids;           // int64 [B, C] global ids (negative: free slot)
  std::optional<at::Tensor> penalty_values;        // float32 [B, C] (needs penalty_ids)
  std::optional<at::Tensor> repetition_penalties;  // float32 [B] (needs penalty_ids)
  // int64 [B] noise streams (low 32 bits), on the CPU or hidden's device; absent: the rule below.
  std::optional<at::Tensor> streams;
};

// tokens int64 [B, S]: global vocabulary ids; -1 for a row with no finite candidate
//   (every score NaN, or an invalid temperature in a device tensor), empty_mask_token
//   for a row whose mask allows nothing.
// scores float32 [B, S]: the winning score (perturbed; the transformed logit x for greedy
//   rows); -inf where the row has no candidate.
// token_logprobs float32 [B, S] and logsumexp float32 [B]: y[token] - logsumexp(y over the
//   allowed tokens), when return_logprobs; else empty tensors of shape [0].
struct SampleResult {
  at::Tensor tokens, scores, token_logprobs, logsumexp;
  // flashsampling._sample_top_logprobs (CUDA) only: top_values [B, N], top_ids [B, N] (local),
  // ranks [B, 1] and the call's logits x [B, V] (views of the GEMM's stored rows).
  at::Tensor top_values, top_ids, ranks, logits;
};

// Validates everything the schema does not: shapes, dtypes, devices and (host-resident)
// values. Every failure is a c10::Error whose message starts with "flashsampling.sample:"
// and names the argument.
//
// Values in device tensors (temperatures, seeds, masks) are not read here: reading them
// would synchronise the stream. Rules for those are in the README.
//
// Noise coordinates the arguments select (README, "Noise and exactness contract"):
//   seed 0-d  -> batch-wide seed, noise stream = batch row;
//   seed [B]  -> per-row seed,    noise stream = 0 (a row's token is batch-invariant);
//   offset    -> 0-d or [B]; defaults to 0 when a seed is given; given alone it is an error;
//   streams   -> [B]: row b draws noise stream streams[b] instead (whatever the seed's form);
//   no seed   -> the backend draws (seed, offset) from `generator` or the device's default
//                generator and uses it as a batch-wide seed.
void check_sample_args(const at::Tensor& hidden, const at::Tensor& weight, const SampleArgs& args);

// The part of check_sample_args after hidden and weight: every other argument, for a batch of
// hidden.size(0) rows on hidden's device and a vocabulary of `vocab` rows (the CPU op from
// precomputed logits passes its logits [B, V] as `hidden`).
void check_control_args(const at::Tensor& hidden, int64_t vocab, const SampleArgs& args);

// With allowed_mask given and no empty_mask_token: errors when some row allows no token
// of [0, V). Reads the mask (a stream sync for a device mask); `capturing` (the caller's
// stream is being captured into a CUDA graph) makes it an error pointing at empty_mask_token.
void check_mask_rows_nonempty(const at::Tensor& weight, const SampleArgs& args, bool capturing = false);
void check_mask_rows_nonempty(int64_t vocab, const SampleArgs& args, bool capturing = false);

// The model-side transforms' arguments (flashsampling.sample and _model_logits; `op` names the
// caller in the message): logit_scale, and logit_softcap where given, positive normal float32s
// (rounded to float32: neither the value nor its reciprocal 0 or infinite).
void check_model_transform_args(const char* op, double logit_scale, std::optional<double> logit_softcap);

// The model transform of one call as fs_model_logit takes it: (scale, softcap, fs_div(1, softcap)),
// softcap 0 where absent (off).
struct ModelTransform {
  float scale = 1.0f;
  float softcap = 0.0f;
  float inv_softcap = 0.0f;
  bool on() const { return scale != 1.0f || softcap != 0.0f; }
};
ModelTransform model_transform(double logit_scale, std::optional<double> logit_softcap);

// flashsampling._model_logits' arguments (CPU and CUDA impls): float32 logits and the checked
// transform.
ModelTransform model_logits_args(const at::Tensor& logits, double logit_scale, std::optional<double> logit_softcap);

// The noise ops' (noise_cpu.cpp, noise_cuda.cpp) uint32 arguments: an int64 tensor whose
// values lie in [0, 2^32). Reads the values (a host sync on a device tensor; test ops only).
void check_uint32_values(const char* op, const char* name, const at::Tensor& t);
// flashsampling._uniform_noise's arguments: int64 tensors of one shape on one device (values
// not read: no host sync).
void check_uniform_noise_args(const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& stream,
                              const at::Tensor& sample, const at::Tensor& vocab_index);

// flashsampling._shard_keys(tokens, scores): int64 and float32 tensors of one shape and device.
void check_shard_keys_args(const at::Tensor& tokens, const at::Tensor& scores);

// flashsampling._merge_shard_keys(gathered, num_samples, ...): int64 [world, B, C], 1 <= S <= C.
void check_merge_shard_keys_args(const at::Tensor& gathered, int64_t num_samples);

// True when `seed` holds one seed per batch row (noise stream 0 for every row).
inline bool has_per_row_seed(const std::optional<at::Tensor>& seed) {
  return seed.has_value() && seed->dim() == 1;
}

using SampleImpl = SampleResult (*)(const at::Tensor& hidden, const at::Tensor& weight, const SampleArgs& args);

// flashsampling._sample_positions' layout: positions >= 1 dividing hidden's rows [P * B, D].
void check_position_rows(const at::Tensor& hidden, int64_t positions);

// The two ops' entry points for one backend implementation.
template <SampleImpl Impl>
struct SampleOps {
  static SampleArgs make_args(double temperature, const std::optional<at::Tensor>& temperatures,
                              int64_t num_samples, const std::optional<at::Tensor>& seed,
                              const std::optional<at::Tensor>& offset, std::optional<at::Generator> generator,
                              const std::optional<at::Tensor>& logit_bias,
                              const std::optional<at::Tensor>& sparse_bias_ids,
                              const std::optional<at::Tensor>& sparse_bias_values,
                              const std::optional<at::Tensor>& allowed_mask, std::optional<int64_t> empty_mask_token,
                              int64_t vocab_start, bool return_logprobs, double logit_scale = 1.0,
                              std::optional<double> logit_softcap = std::nullopt,
                              const std::optional<at::Tensor>& penalty_ids = std::nullopt,
                              const std::optional<at::Tensor>& penalty_values = std::nullopt,
                              const std::optional<at::Tensor>& repetition_penalties = std::nullopt,
                              const std::optional<at::Tensor>& streams = std::nullopt) {
    return SampleArgs{temperature,  temperatures,       num_samples,  seed,
                      offset,       std::move(generator), logit_bias, sparse_bias_ids,
                      sparse_bias_values, allowed_mask, empty_mask_token, vocab_start,
                      return_logprobs, logit_scale, logit_softcap, penalty_ids, penalty_values,
                      repetition_penalties, streams};
  }

  static at::Tensor sample(const at::Tensor& hidden, const at::Tensor& weight, double temperature,
                           const std::optional<at::Tensor>& temperatures, int64_t num_samples,
                           const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
                           std::optional<at::Generator> generator, const std::optional<at::Tensor>& logit_bias,
                           const std::optional<at::Tensor>& sparse_bias_ids,
                           const std::optional<at::Tensor>& sparse_bias_values,
                           const std::optional<at::Tensor>& allowed_mask, std::optional<int64_t> empty_mask_token,
                           int64_t vocab_start, double logit_scale, std::optional<double> logit_softcap,
                           const std::optional<at::Tensor>& penalty_ids,
                           const std::optional<at::Tensor>& penalty_values,
                           const std::optional<at::Tensor>& repetition_penalties,
                           const std::optional<at::Tensor>& streams) {
    return Impl(hidden, weight,
                make_args(temperature, temperatures, num_samples, seed, offset, std::move(generator), logit_bias,
                          sparse_bias_ids, sparse_bias_values, allowed_mask, empty_mask_token, vocab_start, false,
                          logit_scale, logit_softcap, penalty_ids, penalty_values, repetition_penalties, streams))
        .tokens;
  }

  static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_with_scores(
      const at::Tensor& hidden, const at::Tensor& weight, double temperature,
      const std::optional<at::Tensor>& temperatures, int64_t num_samples, const std::optional<at::Tensor>& seed,
      const std::optional<at::Tensor>& offset, std::optional<at::Generator> generator,
      const std::optional<at::Tensor>& logit_bias, const std::optional<at::Tensor>& sparse_bias_ids,
      const std::optional<at::Tensor>& sparse_bias_values, const std::optional<at::Tensor>& allowed_mask,
      std::optional<int64_t> empty_mask_token, int64_t vocab_start, double logit_scale,
      std::optional<double> logit_softcap, const std::optional<at::Tensor>& penalty_ids,
      const std::optional<at::Tensor>& penalty_values, const std::optional<at::Tensor>& repetition_penalties,
      const std::optional<at::Tensor>& streams, bool return_logprobs) {
    SampleResult r = Impl(hidden, weight,
                          make_args(temperature, temperatures, num_samples, seed, offset, std::move(generator),
                                    logit_bias, sparse_bias_ids, sparse_bias_values, allowed_mask, empty_mask_token,
                                    vocab_start, return_logprobs, logit_scale, logit_softcap, penalty_ids,
                                    penalty_values, repetition_penalties, streams));
    return {r.tokens, r.scores, r.token_logprobs, r.logsumexp};
  }

  static void register_impls(torch::Library& m) {
    m.impl("sample", &sample);
    m.impl("sample_with_scores", &sample_with_scores);
  }
};

}  // namespace flashsampling
