// The two small kernels around the fused op in one-hot speculative verification
// (flashsampling/speculative_launch.h has their contracts; flashsampling_cuda/speculative.py,
// verify_one_hot_fused, the step they serve). Each replaces a chain of torch ops whose launches
// cost more than the work (tens of them a step under CUDA-graph replay).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "flashsampling/philox_gumbel.h"
#include "flashsampling/speculative_launch.h"

namespace flashsampling {
namespace {

constexpr int kRowsThreads = 256;
constexpr int kFinishWarps = 8;  // positions whose draft logits a block computes at once
constexpr uint32_t kAcceptIndex = 0xFFFFFFFFu;  // the acceptance uniforms' vocabulary index

__global__ void speculative_rows_kernel(SpeculativeRowsParams p) {
  int64_t const rows = (p.n + 1) * p.batch, total = rows * p.words;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    if (i < rows) {  // row i's scalars (j = i / B, b = i % B)
      int64_t const j = i / p.batch, b = i - j * p.batch;
      p.row_temperatures[i] = p.keys.temperatures[b];
      p.row_seeds[i] = p.keys.seeds[b];
      p.row_offsets[i] = static_cast<int64_t>(static_cast<uint64_t>(p.keys.offsets[b]) + static_cast<uint64_t>(j));
      p.row_streams[i] = p.keys.streams[b];
    }
    int64_t const row = i / p.words, w = i - row * p.words;
    int64_t const j = row / p.batch, b = row - j * p.batch;
    uint32_t word = p.allowed_mask ? p.allowed_mask[b * p.words + w] : ~0u;
    if (j < p.n && p.keys.temperatures[b] != 0.0f) {
      int64_t const d = p.drafts[b * p.n + j] - p.vocab_start;
      if (d >= 0 && d < p.vocab && (d >> 5) == w) word &= ~(1u << (d & 31));
    }
    p.masks[i] = word;
  }
}

template <typename Element>
__device__ float to_float(Element v);
template <>
__device__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ float to_float<__half>(__half v) { return __half2float(v); }

// log(exp(a) + exp(b)) in double, as torch.logaddexp computes it.
__device__ double log_add_exp(double a, double b) {
  if (isinf(a) && a == b) return a;
  double const m = fmax(a, b);
  return m + log1p(exp(-fabs(a - b)));
}

// One block per batch row: warps compute the draft logits (warp w: positions w, w + 8, ...),
// then thread 0 walks the positions.
template <typename Element>
__global__ void speculative_finish_kernel(SpeculativeFinishParams p) {
  __shared__ float y_draft[kSpeculativeMaxPositions];
  int64_t const b = blockIdx.x;
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t const n = p.n, positions = n + 1;
  float const temperature = p.keys.temperatures[b];
  bool const greedy = temperature == 0.0f;
  float const inv_t = fs_inv_temperature(temperature);
  auto const* hidden = static_cast<Element const*>(p.hidden);
  auto const* weight = static_cast<Element const*>(p.weight);
  for (int64_t j = warp; j < n; j += kFinishWarps) {
    int64_t const d = p.drafts[b * n + j] - p.vocab_start;
    float sum = 0.0f;
    if (d >= 0 && d < p.vocab) {
      Element const* h = hidden + (b * positions + j) * p.dim;
      Element const* w = weight + d * p.weight_row_stride;
      for (int64_t k = lane; k < p.dim; k += 32) sum = fmaf(to_float(h[k]), to_float(w[k]), sum);
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
    if (lane == 0) {
      float x = fs_model_logit(sum, p.logit_scale, p.logit_softcap, p.inv_logit_softcap);
      if (p.logit_bias && d >= 0 && d < p.vocab) x = fs_add(x, p.logit_bias[d]);
      y_draft[j] = greedy ? x : fs_mul(x, inv_t);
    }
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  double logp_draft[kSpeculativeMaxPositions];
  double lse_last = 0.0;  // lse of the whole distribution at the position that stops
  int64_t accepted = n;
  for (int64_t j = 0; j < n; ++j) {
    int64_t const d = p.drafts[b * n + j] - p.vocab_start;
    bool const inside = d >= 0 && d < p.vocab;
    bool const allowed = inside && (!p.allowed_mask || ((p.allowed_mask[b * p.words + (d >> 5)] >> (d & 31)) & 1u));
    int64_t const row = j * p.batch + b;
    double const lse = p.lse[row];
    double const y = y_draft[j];
    // sampled rows left the allowed draft out of the row's sample: its term goes back in
    double const lse_full = allowed && !greedy ? log_add_exp(lse, y) : lse;
    logp_draft[j] = inside ? (allowed ? y - lse_full : -INFINITY) : NAN;
    bool accept;
    if (greedy) {
      accept = inside && p.emitted[row] == p.drafts[b * n + j];
    } else {
      double const u = fs_uniform_noise(static_cast<uint64_t>(p.keys.seeds[b]), static_cast<uint64_t>(p.keys.offsets[b]),
                                        static_cast<uint32_t>(p.keys.streams[b]), static_cast<uint32_t>(j), kAcceptIndex);
      accept = inside && u < exp(allowed ? y - lse_full : -INFINITY);
    }
    if (!accept) {
      accepted = j;
      lse_last = lse_full;
      break;
    }
  }
  int64_t const stop_row = accepted * p.batch + b;
  if (accepted == n) lse_last = p.lse[stop_row];
  p.num_accepted[b] = accepted;
  for (int64_t k = 0; k < positions; ++k) {
    int64_t const out = b * positions + k;
    p.tokens[out] = k < accepted ? p.drafts[b * n + k] : k == accepted ? p.emitted[stop_row] : -1;
    if (p.logprobs) {
      double v = NAN;
      if (k < accepted) v = logp_draft[k];
      if (k == accepted) v = static_cast<double>(p.token_logprobs[stop_row]) + p.lse[stop_row] - lse_last;
      p.logprobs[out] = static_cast<float>(v);
    }
  }
}

}  // namespace

cudaError_t launch_speculative_rows(SpeculativeRowsParams const& p, cudaStream_t stream) {
  int64_t const total = (p.n + 1) * p.batch * p.words;
  if (total == 0) return cudaSuccess;
  int64_t const blocks = (total + kRowsThreads - 1) / kRowsThreads;
  speculative_rows_kernel<<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), kRowsThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_speculative_finish(SpeculativeFinishParams const& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.n + 1 > kSpeculativeMaxPositions) return cudaErrorInvalidValue;
  auto const blocks = static_cast<unsigned>(p.batch);
  if (p.bf16) {
    speculative_finish_kernel<__nv_bfloat16><<<blocks, 32 * kFinishWarps, 0, stream>>>(p);
  } else {
    speculative_finish_kernel<__half><<<blocks, 32 * kFinishWarps, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace flashsampling
