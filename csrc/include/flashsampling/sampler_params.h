// Torch-free description of one fused sampling call, and the launcher API the
// binding layer (csrc/torch/sample_cuda.cpp) calls. Kernel sources include only
// this, CUTLASS and CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace flashsampling {

enum class ElementType : int { kBFloat16 = 0, kFloat16 = 1 };

// Where the seed and offset of the noise come from. A device pointer, when set,
// wins over the value and is read by the kernel at run time, so a captured CUDA
// graph replays with whatever the tensor holds then (torch's Philox convention:
// offset = *offset_device + offset_device_add).
struct NoiseSource {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_device = nullptr;
  const int64_t* offset_device = nullptr;
  uint64_t offset_device_add = 0;
};

struct SamplerParams {
  // LM head weight [V, D] and hidden states [B, D], both with unit stride along D.
  const void* weight = nullptr;
  const void* hidden = nullptr;
  int64_t vocab_size = 0;         // V
  int64_t hidden_dim = 0;         // D
  int64_t batch_size = 0;         // B
  int64_t weight_row_stride = 0;  // elements between weight rows (>= D)
  int64_t hidden_row_stride = 0;  // elements between hidden rows (>= D)
  ElementType element_type = ElementType::kBFloat16;

  // score = logit * inv_temperature + gumbel; greedy rows drop the noise.
  float inv_temperature = 1.0f;
  bool greedy = false;

  NoiseSource noise;
  int num_samples = 1;

  // Output: int64 token ids, [B, num_samples] row-major.
  int64_t* tokens = nullptr;

  // Multiprocessors of the running GPU (sizes the persistent grid).
  int device_sm_count = 0;
};

// Per-(vocabulary tile, batch row) candidate, packed so that a plain unsigned max
// realises the total order of philox_gumbel.h (score desc, index asc, NaN last).
//   hi 32 bits: order-preserving bits of the fp32 score (NaN -> 0)
//   lo 32 bits: ~vocab_index
using PackedCandidate = unsigned long long;

// Bytes of device workspace launch_sampler needs for these parameters (candidates
// of every vocabulary tile plus CUTLASS's own workspace). Depends only on shapes.
size_t sampler_workspace_bytes(const SamplerParams& params, int device_arch);

// Runs the fused GEMM + Gumbel-argmax and the reduction over vocabulary tiles on
// `stream`. device_arch is 90 or 100 (major*10 + minor of the running GPU).
// Returns cudaErrorNotSupported for architectures this build has no kernel for.
cudaError_t launch_sampler(const SamplerParams& params, void* workspace, size_t workspace_bytes,
                           int device_arch, cudaStream_t stream);

// Which architectures this build compiled kernels for (e.g. "sm90a,sm100a").
const char* sampler_compiled_archs();

}  // namespace flashsampling
