// Argument checks of flashsampling::sample shared by every backend (CPU, CUDA).
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace flashsampling {

// Validates everything the schema of flashsampling::sample (csrc/torch/ops.cpp) does
// not: shapes, dtypes, devices and values. Every failure is a c10::Error whose
// message starts with "flashsampling.sample:" and names the argument.
//
// Values of `temperatures` are read only when it lives on the CPU: reading a device
// tensor would synchronise the stream, so a device backend handles those values itself.
//
// Noise coordinates the arguments select (README, "Noise and exactness contract"):
//   seed 0-d  -> batch-wide seed, noise stream = batch row;
//   seed [B]  -> per-row seed,    noise stream = 0 (a row's token is batch-invariant);
//   offset    -> 0-d or [B]; defaults to 0 when a seed is given; given alone it is an error;
//   no seed   -> the backend draws (seed, offset) from `generator` or the device's default
//                generator and uses it as a batch-wide seed.
void check_sample_args(const at::Tensor& hidden, const at::Tensor& weight, double temperature,
                       const std::optional<at::Tensor>& temperatures, int64_t num_samples,
                       const std::optional<at::Tensor>& seed,
                       const std::optional<at::Tensor>& offset,
                       const std::optional<at::Generator>& generator);

// True when `seed` holds one seed per batch row (noise stream 0 for every row).
inline bool has_per_row_seed(const std::optional<at::Tensor>& seed) {
  return seed.has_value() && seed->dim() == 1;
}

}  // namespace flashsampling
