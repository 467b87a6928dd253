#include "checks.h"

#include "flashsampling/philox_gumbel.h"

#include <c10/util/Exception.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>

namespace flashsampling {
namespace {

constexpr int64_t kMaxInt32Extent = (int64_t{1} << 31) - 1;

// `seed` and `offset`: int64, shape [] (batch-wide) or [B] (one per row), on the CPU
// or on hidden's device (a device tensor lets a CUDA graph replay with new values).
void check_seed_like(const char* name, const at::Tensor& t, const at::Tensor& hidden) {
  const int64_t batch = hidden.size(0);
  TORCH_CHECK(t.scalar_type() == at::kLong, "flashsampling.sample: ", name,
              " must be an int64 tensor, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 0 || (t.dim() == 1 && t.size(0) == batch), "flashsampling.sample: ",
              name, " must have shape [] (batch-wide) or [B] = [", batch,
              "] (one per row), got shape ", t.sizes());
  TORCH_CHECK(t.device().is_cpu() || t.device() == hidden.device(), "flashsampling.sample: ",
              name, " must be on the CPU or on hidden's device (", hidden.device(), "), got ",
              t.device());
}

// Whether a host value, rounded to float32, is a positive normal number, so that neither it nor
// its reciprocal rounds to 0 or overflows: logit_scale / logit_softcap, and a temperature other
// than 0.
static bool positive_normal_float(double value) {
  const float f = static_cast<float>(value);
  return std::isfinite(f) && f >= std::numeric_limits<float>::min();
}

// A temperature the op takes: 0 (greedy) or a positive normal float32 once rounded, whose
// reciprocal (fs_inv_temperature) stays finite. The kernels treat any other value as invalid
// (the row gets no candidate), which is what a device tensor's entry, not read on the host, gets.
static bool valid_temperature(double t) { return t == 0.0 || positive_normal_float(t); }
static constexpr const char* kTemperatureRule = "finite and >= 0 (0 = greedy; a positive one at least 1.17549435e-38, "
                                                "a normal float32)";

void check_temperatures(const at::Tensor& temperatures, const at::Tensor& hidden) {
  const int64_t batch = hidden.size(0);
  TORCH_CHECK(temperatures.scalar_type() == at::kFloat,
              "flashsampling.sample: temperatures must be a float32 tensor, got ",
              temperatures.scalar_type());
  TORCH_CHECK(temperatures.dim() == 1 && temperatures.size(0) == batch,
              "flashsampling.sample: temperatures must have shape [B] = [", batch, "], got shape ",
              temperatures.sizes());
  TORCH_CHECK(temperatures.device() == hidden.device(),
              "flashsampling.sample: temperatures must be on hidden's device (", hidden.device(),
              "), got ", temperatures.device());
  if (!temperatures.device().is_cpu()) return;  // see check_sample_args
  const at::Tensor t = temperatures.contiguous();
  const float* values = t.const_data_ptr<float>();
  for (int64_t row = 0; row < batch; ++row) {
    TORCH_CHECK(valid_temperature(values[row]), "flashsampling.sample: temperatures must be ", kTemperatureRule,
                ", got ", values[row], " in row ", row);
  }
}

// An optional extra tensor of the op: dtype(s) (dtype_text names them as torch does),
// exact shape, on hidden's device.
void check_extra(const char* name, const at::Tensor& t, std::initializer_list<at::ScalarType> dtypes,
                 const char* dtype_text, at::IntArrayRef shape, const char* shape_text, const at::Tensor& hidden) {
  bool dtype_ok = false;
  for (const auto d : dtypes) dtype_ok = dtype_ok || t.scalar_type() == d;
  TORCH_CHECK(dtype_ok, "flashsampling.sample: ", name, " must be ", dtype_text, ", got ", t.scalar_type());
  TORCH_CHECK(t.sizes() == shape, "flashsampling.sample: ", name, " must have shape ", shape_text, " = ", shape,
              ", got shape ", t.sizes());
  TORCH_CHECK(t.device() == hidden.device(), "flashsampling.sample: ", name, " must be on hidden's device (",
              hidden.device(), "), got ", t.device());
}

}  // namespace

namespace {
// A host value of logit_scale / logit_softcap as the kernels take it: a positive normal float32,
// so that neither it nor its reciprocal rounds to 0 or overflows.
void check_model_value(const char* op, const char* name, double value) {
  TORCH_CHECK(positive_normal_float(value), op, ": ", name, " must be finite and > 0 (a normal float32), got ", value);
}
}  // namespace

void check_model_transform_args(const char* op, double logit_scale, std::optional<double> logit_softcap) {
  check_model_value(op, "logit_scale", logit_scale);
  if (logit_softcap.has_value()) check_model_value(op, "logit_softcap", *logit_softcap);
}

ModelTransform model_transform(double logit_scale, std::optional<double> logit_softcap) {
  ModelTransform t;
  t.scale = static_cast<float>(logit_scale);
  if (logit_softcap.has_value()) {
    t.softcap = static_cast<float>(*logit_softcap);
    t.inv_softcap = fs_div(1.0f, t.softcap);
  }
  return t;
}

ModelTransform model_logits_args(const at::Tensor& logits, double logit_scale, std::optional<double> logit_softcap) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat, "flashsampling._model_logits: logits must be float32, got ",
              logits.scalar_type());
  check_model_transform_args("flashsampling._model_logits", logit_scale, logit_softcap);
  return model_transform(logit_scale, logit_softcap);
}

void check_uint32_values(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong, op, ": ", name, " must be an int64 tensor, got ",
              t.scalar_type());
  if (t.numel() == 0) return;
  const auto [lo, hi] = at::aminmax(t);
  TORCH_CHECK(lo.item<int64_t>() >= 0 && hi.item<int64_t>() <= 0xffffffffLL, op, ": ", name,
              " values must lie in [0, 2^32)");
}

void check_uniform_noise_args(const at::Tensor& seed, const at::Tensor& offset, const at::Tensor& stream,
                              const at::Tensor& sample, const at::Tensor& vocab_index) {
  constexpr const char* kOp = "flashsampling._uniform_noise";
  for (auto [name, t] : {std::pair{"seed", &seed}, std::pair{"offset", &offset}, std::pair{"stream", &stream},
                         std::pair{"sample", &sample}, std::pair{"vocab_index", &vocab_index}}) {
    TORCH_CHECK(t->scalar_type() == at::kLong, kOp, ": ", name, " must be an int64 tensor, got ", t->scalar_type());
    TORCH_CHECK(t->sizes() == seed.sizes(), kOp, ": ", name, " must have seed's shape ", seed.sizes(), ", got ",
                t->sizes());
    TORCH_CHECK(t->device() == seed.device(), kOp, ": ", name, " must be on seed's device (", seed.device(),
                "), got ", t->device());
  }
}

void check_shard_keys_args(const at::Tensor& tokens, const at::Tensor& scores) {
  constexpr const char* kOp = "flashsampling._shard_keys";
  TORCH_CHECK(tokens.scalar_type() == at::kLong, kOp, ": tokens must be int64, got ", tokens.scalar_type());
  TORCH_CHECK(scores.scalar_type() == at::kFloat, kOp, ": scores must be float32, got ", scores.scalar_type());
  TORCH_CHECK(tokens.sizes() == scores.sizes(), kOp, ": tokens and scores must have one shape, got ", tokens.sizes(),
              " and ", scores.sizes());
  TORCH_CHECK(tokens.device() == scores.device(), kOp, ": tokens and scores must be on one device, got ",
              tokens.device(), " and ", scores.device());
}

void check_merge_shard_keys_args(const at::Tensor& gathered, int64_t num_samples) {
  constexpr const char* kOp = "flashsampling._merge_shard_keys";
  TORCH_CHECK(gathered.scalar_type() == at::kLong, kOp, ": gathered must be int64, got ", gathered.scalar_type());
  TORCH_CHECK(gathered.dim() == 3 && gathered.size(0) >= 1, kOp,
              ": gathered must be [world >= 1, B, C] (every rank's summary), got shape ", gathered.sizes());
  TORCH_CHECK(num_samples >= 1 && num_samples <= gathered.size(2), kOp, ": num_samples must lie in [1, C = ",
              gathered.size(2), "], got ", num_samples);
}

void check_sample_args(const at::Tensor& hidden, const at::Tensor& weight, const SampleArgs& args) {
  TORCH_CHECK(hidden.dim() == 2, "flashsampling.sample: hidden must be 2-D [B, D], got shape ",
              hidden.sizes());
  TORCH_CHECK(weight.dim() == 2, "flashsampling.sample: weight must be 2-D [V, D], got shape ",
              weight.sizes());
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "flashsampling.sample: hidden must be bfloat16, float16 or float32, got ", dtype);
  TORCH_CHECK(weight.scalar_type() == dtype, "flashsampling.sample: weight dtype (",
              weight.scalar_type(), ") must match hidden dtype (", dtype, ")");
  TORCH_CHECK(weight.device() == hidden.device(),
              "flashsampling.sample: weight must be on hidden's device (", hidden.device(),
              "), got ", weight.device());
  TORCH_CHECK(weight.size(1) == hidden.size(1),
              "flashsampling.sample: hidden [B, D] and weight [V, D] must have the same D, got "
              "hidden shape ",
              hidden.sizes(), " and weight shape ", weight.sizes());
  const int64_t vocab = weight.size(0);
  TORCH_CHECK(vocab >= 1 && vocab <= kMaxInt32Extent,
              "flashsampling.sample: weight must have 1 <= V < 2^31 rows, got shape ",
              weight.sizes());
  check_control_args(hidden, vocab, args);
}

void check_control_args(const at::Tensor& hidden, int64_t vocab, const SampleArgs& args) {
  const int64_t batch = hidden.size(0);
  TORCH_CHECK(batch <= kMaxInt32Extent,
              "flashsampling.sample: hidden must have B < 2^31 rows, got shape ", hidden.sizes());
  TORCH_CHECK(args.vocab_start >= 0 && args.vocab_start <= kMaxInt32Extent - vocab,
              "flashsampling.sample: vocab_start must be >= 0 with vocab_start + V < 2^31, got vocab_start=",
              args.vocab_start, " and V=", vocab);
  TORCH_CHECK(args.num_samples >= 1 && args.num_samples <= kMaxInt32Extent,
              "flashsampling.sample: num_samples must be >= 1, got ", args.num_samples);
  TORCH_CHECK(valid_temperature(args.temperature), "flashsampling.sample: temperature must be ", kTemperatureRule,
              ", got ", args.temperature);
  if (args.temperatures.has_value()) check_temperatures(*args.temperatures, hidden);
  check_model_transform_args("flashsampling.sample", args.logit_scale, args.logit_softcap);
  if (args.seed.has_value()) {
    check_seed_like("seed", *args.seed, hidden);
    TORCH_CHECK(!(args.generator.has_value() && args.generator->defined()),
                "flashsampling.sample: pass either seed or generator, not both");
  }
  if (args.offset.has_value()) {
    TORCH_CHECK(args.seed.has_value(),
                "flashsampling.sample: offset was given without seed; with no seed the offset "
                "comes from the generator");
    check_seed_like("offset", *args.offset, hidden);
  }
  if (args.streams.has_value()) {
    TORCH_CHECK(args.streams->dim() == 1, "flashsampling.sample: streams must have shape [B] = [", batch,
                "], got shape ", args.streams->sizes());
    check_seed_like("streams", *args.streams, hidden);
  }
  if (args.logit_bias.has_value()) {
    check_extra("logit_bias", *args.logit_bias, {at::kFloat}, "float32", {vocab}, "[V]", hidden);
  }
  TORCH_CHECK(args.sparse_bias_ids.has_value() == args.sparse_bias_values.has_value(),
              "flashsampling.sample: sparse_bias_ids and sparse_bias_values go together; got only ",
              args.sparse_bias_ids.has_value() ? "sparse_bias_ids" : "sparse_bias_values");
  if (args.sparse_bias_ids.has_value()) {
    const at::Tensor& ids = *args.sparse_bias_ids;
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == batch,
                "flashsampling.sample: sparse_bias_ids must have shape [B, K] = [", batch, ", K], got shape ",
                ids.sizes());
    check_extra("sparse_bias_ids", ids, {at::kInt, at::kLong}, "int32 or int64", ids.sizes(), "[B, K]", hidden);
    check_extra("sparse_bias_values", *args.sparse_bias_values, {at::kFloat}, "float32", ids.sizes(),
                "[B, K] (the shape of sparse_bias_ids)", hidden);
  }
  if (args.allowed_mask.has_value()) {
    check_extra("allowed_mask", *args.allowed_mask, {at::kInt}, "int32", {batch, (vocab + 31) / 32},
                "[B, ceil(V / 32)]", hidden);
  }
  if (args.penalty_ids.has_value()) {
    const at::Tensor& ids = *args.penalty_ids;
    TORCH_CHECK(ids.dim() == 2 && ids.size(0) == batch && ids.size(1) <= kMaxInt32Extent,
                "flashsampling.sample: penalty_ids must have shape [B, C] = [", batch, ", C], got shape ",
                ids.sizes());
    check_extra("penalty_ids", ids, {at::kLong}, "int64", ids.sizes(), "[B, C]", hidden);
    if (args.penalty_values.has_value()) {
      check_extra("penalty_values", *args.penalty_values, {at::kFloat}, "float32", ids.sizes(),
                  "[B, C] (the shape of penalty_ids)", hidden);
    }
    if (args.repetition_penalties.has_value()) {
      check_extra("repetition_penalties", *args.repetition_penalties, {at::kFloat}, "float32", {batch}, "[B]",
                  hidden);
    }
  } else {
    TORCH_CHECK(!args.penalty_values.has_value() && !args.repetition_penalties.has_value(),
                "flashsampling.sample: penalty_values and repetition_penalties need penalty_ids");
  }
  if (args.empty_mask_token.has_value()) {
    const int64_t token = *args.empty_mask_token;
    TORCH_CHECK(token < 0 || (token >= args.vocab_start && token < args.vocab_start + vocab),
                "flashsampling.sample: empty_mask_token must be a token id in [vocab_start, vocab_start + V) = [",
                args.vocab_start, ", ", args.vocab_start + vocab, ") or negative (a marker such as -1), got ",
                token);
  }
}

void check_mask_rows_nonempty(const at::Tensor& weight, const SampleArgs& args, bool capturing) {
  check_mask_rows_nonempty(weight.size(0), args, capturing);
}

void check_mask_rows_nonempty(int64_t vocab, const SampleArgs& args, bool capturing) {
  if (!args.allowed_mask.has_value() || args.empty_mask_token.has_value()) return;
  const at::Tensor& mask = *args.allowed_mask;
  if (mask.numel() == 0) return;
  TORCH_CHECK(!capturing,
              "flashsampling.sample: checking that every row of allowed_mask allows a token reads the mask "
              "(a host sync), which CUDA graph capture forbids; pass empty_mask_token (e.g. -1) to return "
              "that token for such rows instead");
  // Bits past V in the last word do not count.
  const int64_t tail_bits = vocab % 32;
  at::Tensor words = mask;
  if (tail_bits != 0) {
    const int32_t tail_mask = static_cast<int32_t>((uint32_t{1} << tail_bits) - 1u);
    words = mask.clone();
    words.select(1, -1).bitwise_and_(tail_mask);
  }
  const at::Tensor empty_rows = (words != 0).any(1).logical_not().nonzero();
  if (empty_rows.numel() == 0) return;
  const at::Tensor rows = empty_rows.to(at::kCPU).flatten();
  std::string first;
  for (int64_t i = 0; i < std::min<int64_t>(8, rows.size(0)); ++i) {
    first += (i ? ", " : "") + std::to_string(rows[i].item<int64_t>());
  }
  TORCH_CHECK(false, "flashsampling.sample: allowed_mask allows no token in ", rows.size(0), " row(s) (first: ",
              first, "); fix the mask, or pass empty_mask_token to get that token for such rows");
}

void check_position_rows(const at::Tensor& hidden, int64_t positions) {
  TORCH_CHECK(positions >= 1 && hidden.dim() == 2 && hidden.size(0) % positions == 0,
              "flashsampling._sample_positions: hidden must be [positions * B, D] with positions >= 1, got positions=",
              positions, " and hidden of shape ", hidden.sizes());
}

}  // namespace flashsampling
