// Torch-free description of the top-N log-probabilities of rows of materialised values, with
// the ranks of given tokens, and its launcher (csrc/kernels/top_logprobs.cu). The binding is
// csrc/torch/top_logprobs_cuda.cpp; flashsampling_cuda/logprobs.py has the semantics and
// computes the same outputs in torch ops on the CPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace flashsampling {

// Largest N (flashsampling_cuda/logprobs.py: MAX_TOP_LOGPROBS).
constexpr int kMaxTopLogprobs = 64;

// What a row leaves to these kernels where TopLogprobsParams::row_modes is given (the fused
// sampler's stage 2 decides the rest: SamplerParams::top_logprobs).
constexpr uint8_t kTopLogprobsRank = 1;  // the ranks of its tokens
constexpr uint8_t kTopLogprobsTop = 2;   // its top N

// One call. Row b's log-probabilities are t[v] = fl32(y - fl32(lse[b])) with -inf kept where y is
// -inf (processed), or fl32(fl64(y) - lse[b]) (raw), y = fl32(values[b, v] * scales[b]) (y =
// values[b, v] without scales: the processed logits as they are, or x with the rows' fl32(1 / T)
// applied here, so that they need not be materialised). Their order
// is t descending with -0 folded into +0, NaN above every number, exact ties to the smaller v.
struct TopLogprobsParams {
  const float* values = nullptr;  // [B, V] fp32, unit stride along V
  int64_t row_stride = 0;
  int64_t batch_size = 0;  // B
  int64_t vocab_size = 0;  // V
  const double* lse = nullptr;  // [B]
  // [B], in place of lse: a float32 log-sum-exp, lse = fl64(lse_float[b]) where raw (the fused
  // sampler's: processed, its own; raw, its stage 2's); a row whose lse is not above -inf (nothing
  // sampled, or no mass) ranks no token.
  const float* lse_float = nullptr;
  const float* scales = nullptr;  // [B] or null (1)
  bool raw = false;
  const int64_t* tokens = nullptr;  // [B, S] ids token_base + v; one outside [0, V) gets rank 0
  int64_t token_base = 0;
  int64_t num_samples = 0;          // S
  int top_n = 0;                    // N in [0, min(V, kMaxTopLogprobs)]
  // [B] or null (every row: both): what each row wants (kTopLogprobsRank | kTopLogprobsTop);
  // the outputs of the rest are not written.
  const uint8_t* row_modes = nullptr;

  // Outputs: the first N of the order, top_values float [B, N] (t) and top_ids int64 [B, N]
  // (local v); ranks int64 [B, S]: each token's 1-based position in the order; token_values
  // float [B, S] (optional): each ranked token's own t (NaN where it ranks nothing).
  float* top_values = nullptr;
  int64_t* top_ids = nullptr;
  int64_t* ranks = nullptr;
  float* token_values = nullptr;
};

// Scratch of a call in device memory, carved by launch_top_logprobs out of one allocation of
// top_logprobs_workspace_bytes (8-byte aligned): per row a buffer of candidate keys, digit 0's
// histogram, the sampled tokens' counts of keys above them and the buffer's fill.
struct TopLogprobsWorkspace {
  uint64_t* buffer = nullptr;  // [B, 4096]
  uint32_t* hist = nullptr;    // [B, 2048]
  uint32_t* counts = nullptr;  // [B, S]
  uint32_t* filled = nullptr;  // [B]
};

size_t top_logprobs_workspace_bytes(int64_t batch, int64_t num_samples);

// How many slices (CTAs) a row gets in the launches that read it: about two CTAs an SM over the
// batch, each slice at least 8192 elements, at most 32 (a pure function, so tests can name it).
int top_logprobs_slices(int64_t batch, int64_t vocab, int sm_count);

cudaError_t launch_top_logprobs(TopLogprobsParams const& params, void* workspace, int sm_count,
                                cudaStream_t stream);

// lse[b] = the float32 log-sum-exp of row b of values [B, V] (fp32, unit stride along V,
// `row_stride` elements apart): the raw outputs' normaliser, as torch.logsumexp on the CPU to
// about 1e-6 (summed in float32 in another order); NaN where the row holds NaN, else +inf where
// it holds +inf, -inf where every value is -inf. One read of the rows, a CTA a row.
cudaError_t launch_row_logsumexp(const float* values, int64_t row_stride, int64_t batch, int64_t vocab, float* lse,
                                 cudaStream_t stream);

}  // namespace flashsampling
