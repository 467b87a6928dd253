// Torch-free launchers of the two small kernels around the fused op in one-hot speculative
// verification (csrc/kernels/speculative.cu; flashsampling_cuda/speculative.py,
// verify_one_hot_fused): the per-row inputs of the B * (n + 1) rows before the GEMM, and the acceptance
// walk after it. Rows are position-major: row j * B + b is position j of batch row b.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// A per-batch-row value: v[b * stride] (stride 0: one value for every row, as an expanded 0-d
// tensor holds it, read without a copy).
template <typename T>
struct RowValues {
  const T* v = nullptr;
  int64_t stride = 1;
  __host__ __device__ T operator[](int64_t b) const { return v[b * stride]; }
};

// A batch row's temperature and noise key (the step's, speculative.py's _Step), as both kernels read them.
struct RowKeys {
  RowValues<float> temperatures;  // [B]
  RowValues<int64_t> seeds;       // [B]
  RowValues<int64_t> offsets;     // [B]
  RowValues<int64_t> streams;     // [B]
};

// The most positions (n + 1) a step may have: the finishing kernel keeps a row's draft logits in
// shared memory and its log-probabilities in registers (speculative.py routes longer steps elsewhere).
constexpr int kSpeculativeMaxPositions = 64;

// The fused op's per-row inputs for the rows r = j * B + b: masks[r][w] = allowed_mask[b][w]
// (all ones without a mask), with the bit of draft drafts[b][j] - vocab_start cleared where
// j < n, the draft is one of the V columns and row b samples (temperatures[b] != 0): the
// corrective sample leaves the draft out; and row b's temperature, seed and stream, and its
// offset + j.
struct SpeculativeRowsParams {
  int64_t batch = 0, n = 0, words = 0, vocab = 0, vocab_start = 0;
  const int64_t* drafts = nullptr;         // [B, n]
  RowKeys keys;
  const uint32_t* allowed_mask = nullptr;  // [B, words] or nullptr
  uint32_t* masks = nullptr;               // [(n + 1) * B, words]
  float* row_temperatures = nullptr;       // [(n + 1) * B]
  int64_t* row_seeds = nullptr;            // [(n + 1) * B]
  int64_t* row_offsets = nullptr;          // [(n + 1) * B]
  int64_t* row_streams = nullptr;          // [(n + 1) * B]
};
cudaError_t launch_speculative_rows(SpeculativeRowsParams const& p, cudaStream_t stream);

// Per batch row b: the draft's logit x_j(d) at each position (an fp32 dot product of hidden[b, j]
// and weight[d - vocab_start], then fs_model_logit and the dense bias), y = x * fl(1 / T) (x on
// greedy rows); then positions j = 0 .. n - 1 in order: a greedy row accepts while emitted[j]
// is the draft, a sampled row while u_j < p_j(d) = exp(y - logaddexp(lse_j, y)) (lse_j: the
// emitted row's log-sum-exp without the draft; fs_uniform_noise at (seed, offset, stream, j,
// 2^32 - 1)); then the tokens (accepted drafts, the emitted token at num_accepted, -1 after) and,
// with token_logprobs, their log-probabilities under the target (NaN after).
struct SpeculativeFinishParams {
  int64_t batch = 0, n = 0, dim = 0, vocab = 0, vocab_start = 0, words = 0;
  const void* hidden = nullptr;  // [B, n + 1, D], contiguous
  const void* weight = nullptr;  // [V, D], unit stride along D
  int64_t weight_row_stride = 0;
  bool bf16 = true;  // else fp16
  const int64_t* drafts = nullptr;          // [B, n] global ids
  const int64_t* emitted = nullptr;         // [(n + 1) * B] the fused op's tokens, global ids
  const float* lse = nullptr;               // [(n + 1) * B]
  const float* token_logprobs = nullptr;    // [(n + 1) * B] or nullptr
  RowKeys keys;
  const uint32_t* allowed_mask = nullptr;   // [B, words] or nullptr
  const float* logit_bias = nullptr;        // [V] or nullptr
  float logit_scale = 1.0f, logit_softcap = 0.0f, inv_logit_softcap = 0.0f;
  int64_t* tokens = nullptr;                // [B, n + 1]
  int64_t* num_accepted = nullptr;          // [B]
  float* logprobs = nullptr;                // [B, n + 1] or nullptr
};
cudaError_t launch_speculative_finish(SpeculativeFinishParams const& p, cudaStream_t stream);

}  // namespace flashsampling
