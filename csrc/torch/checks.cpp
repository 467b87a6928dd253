#include "checks.h"

#include <c10/util/Exception.h>

#include <cmath>

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
    TORCH_CHECK(std::isfinite(values[row]) && values[row] >= 0.0f,
                "flashsampling.sample: temperatures must be finite and >= 0 (0 = greedy), got ",
                values[row], " in row ", row);
  }
}

}  // namespace

void check_sample_args(const at::Tensor& hidden, const at::Tensor& weight, double temperature,
                       const std::optional<at::Tensor>& temperatures, int64_t num_samples,
                       const std::optional<at::Tensor>& seed,
                       const std::optional<at::Tensor>& offset,
                       const std::optional<at::Generator>& generator) {
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
  TORCH_CHECK(weight.size(0) >= 1 && weight.size(0) <= kMaxInt32Extent,
              "flashsampling.sample: weight must have 1 <= V < 2^31 rows, got shape ",
              weight.sizes());
  TORCH_CHECK(hidden.size(0) <= kMaxInt32Extent,
              "flashsampling.sample: hidden must have B < 2^31 rows, got shape ", hidden.sizes());
  TORCH_CHECK(num_samples >= 1 && num_samples <= kMaxInt32Extent,
              "flashsampling.sample: num_samples must be >= 1, got ", num_samples);
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0.0,
              "flashsampling.sample: temperature must be finite and >= 0 (0 = greedy), got ",
              temperature);
  if (temperatures.has_value()) check_temperatures(*temperatures, hidden);
  if (seed.has_value()) {
    check_seed_like("seed", *seed, hidden);
    TORCH_CHECK(!(generator.has_value() && generator->defined()),
                "flashsampling.sample: pass either seed or generator, not both");
  }
  if (offset.has_value()) {
    TORCH_CHECK(seed.has_value(),
                "flashsampling.sample: offset was given without seed; with no seed the offset "
                "comes from the generator");
    check_seed_like("offset", *offset, hidden);
  }
}

}  // namespace flashsampling
