// Torch-free description of sampling from materialised fp32 logits with per-row truncation
// (top-k, top-p, min-p), and its launcher (csrc/kernels/sample_from_logits.cu). The binding
// is csrc/torch/sample_from_logits_cuda.cpp; flashsampling_cuda/truncation.py has the
// semantics and routes truncated calls here on CUDA.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashsampling/sampler_params.h"

namespace flashsampling {

// One call. Row b's transformed logits are x[v] = fl(logits[b, v] + logit_bias[v]) (the bias
// only when given), excluded where allowed_mask has bit v clear, y[v] = fl(x[v] * fl(1 / T_b))
// (y = x for a greedy row). The survivors of a row are a prefix of the truncation order (y
// descending, exact ties to the smaller index, NaN after every number): the first top_k, of
// those the shortest prefix whose probabilities reach top_p, then those whose probability is
// at least min_p times the first's (the first always stays). Each sample is the Gumbel-Max
// winner among the survivors with the noise of plain sampling, fma(x, fl(1 / T_b), g).
struct LogitsSamplerParams {
  const float* logits = nullptr;  // [B, V] fp32, unit stride along V
  int64_t logits_row_stride = 0;
  int64_t batch_size = 0;   // B
  // The rows to sample, when set ([1 + B] int32 device array: a count, then that many rows);
  // else every row. The fused truncation hands over the rows its stage 2 left. The launcher
  // then launches twice, each launch working only for its range of counts (read on the device):
  // few rows get clusters of 8 CTAs, many the grid of the batch. The streaming kernels' top_p
  // rounds append the rows they leave undecided (as stage 2 appends its rows).
  int32_t* rows = nullptr;
  int32_t min_rows = 0, max_rows = INT32_MAX;  // set by the launcher
  int64_t vocab_size = 0;   // V
  int64_t vocab_start = 0;  // global id of column 0: noise and tokens use vocab_start + v

  const float* logit_bias = nullptr;       // [V]
  const uint32_t* allowed_mask = nullptr;  // [B, mask_words]: bit v & 31 of word v >> 5 = allowed
  int64_t mask_words = 0;                  // ceil(V / 32)

  float inv_temperature = 1.0f;         // fs_inv_temperature of the call's T (0: greedy)
  const float* temperatures = nullptr;  // [B]; wins over inv_temperature

  // Truncation; per-row [B] device arrays win over the scalars. Off: top_k <= 0 (or >= the
  // row's allowed tokens), top_p >= 1, min_p <= 0 given as a scalar. In the arrays (values
  // not checked on the host) top_p <= 0, min_p > 1 and NaN keep the first token only.
  int64_t top_k = 0;
  const int64_t* top_ks = nullptr;
  double top_p = 1.0;
  const double* top_ps = nullptr;
  double min_p = 0.0;
  const double* min_ps = nullptr;

  NoiseSource noise;
  int num_samples = 1;

  // Outputs: tokens int64 [B, S], scores float [B, S]; with token_logprobs set also the
  // log-probability of each token [B, S] and logsumexp [B] of the truncated distribution.
  int64_t* tokens = nullptr;
  float* scores = nullptr;
  float* token_logprobs = nullptr;
  float* logsumexp = nullptr;
  // Token of a row whose allowed_mask allows nothing (the binding has made that an error when
  // the caller gave none).
  int64_t empty_mask_token = -1;

  // With a row list: the rows the fused truncation's stage 2 hands to the streaming kernels
  // instead ([B], or null for none): NaN for a row not streamed, else the row's first y (finite),
  // for a row without top_k cut by min_p (in (0, 1]), whose elements the streaming kernels test
  // against it, and / or (streams_top_p_rows) by top_p (in (0, 1)). A top_p row's sample is the
  // streaming pass's winner once the top_p rounds (streaming_rows.cu) have verified it; a row they
  // leave undecided gets NaN here again and joins `rows`.
  float* streamed_first_y = nullptr;
  // With streamed_first_y, where the fused truncation's GEMM drew them (draw_tile_winners, a call
  // without min_p): each streamed row's best candidate over every allowed token (pack_candidate of
  // its perturbed score and index), the first winner its top_p rounds verify; the streaming pass
  // over the rows' logits is then not needed and not launched.
  const PackedCandidate* streamed_winners = nullptr;

  // Set by the launcher: the streaming rows' kernels sample the rows without a top_k / top_p /
  // min_p cut and those of streamed_first_y (logits_rows.cuh: is_streaming_row), and the cut
  // path's kernel skips them.
  bool streaming_rows = false;
};

// How the kernel spreads the batch: clusters of `cluster_size` CTAs each sample one row at a
// time (a row's vocabulary split across the cluster, its histograms exchanged through
// distributed shared memory), `clusters` of them loop over the rows. At most 64 rows are in
// flight so that their logits (V fp32 each) stay in L2 across the row's passes; small batches
// get up to 8 CTAs a row so that every multiprocessor works, larger ones 2.
struct LogitsSamplerGrid {
  int cluster_size;
  int clusters;
};

// Largest vocabulary: a CTA sums the masses of its slice (V / 2 tokens at most) in 32-bit words.
constexpr int64_t kLogitsSamplerMaxVocab = int64_t{1} << 22;

// `resident[i]`: how many clusters of 2 << i CTAs (2, 4, 8) the device runs at once
// (cudaOccupancyMaxActiveClusters; clusters live within one GPC, so 132 SMs may not hold 16
// clusters of 8). A cluster size is taken only when every row in flight gets a cluster at once:
// a second wave of clusters would double the row's time.
inline LogitsSamplerGrid logits_sampler_grid(int64_t batch, int sm_count, const int resident[3]) {
  constexpr int64_t kMaxRowsInFlight = 64;
  int64_t rows = batch < kMaxRowsInFlight ? (batch < 1 ? 1 : batch) : kMaxRowsInFlight;
  if (resident[0] >= 1 && rows > resident[0]) rows = resident[0];
  int cluster = 2;  // at least 2: a CTA's slice holds at most 2^21 tokens (kLogitsSamplerMaxVocab)
  for (int next = 1; next < 3 && rows * (2 << next) <= sm_count && rows <= resident[next]; ++next) cluster = 2 << next;
  return {cluster, static_cast<int>(rows)};
}

// How many clusters of `cluster_size` (2, 4 or 8) CTAs the device runs at once, from `resident` as
// above.
inline int resident_clusters_of_size(int cluster_size, const int resident[3]) {
  return resident[cluster_size == 8 ? 2 : cluster_size == 4 ? 1 : 0];
}

// Rows without a top_k / top_p / min_p cut (every allowed token survives) in a launch without a
// row list, and the min_p rows of streamed_first_y in one with, are sampled by kernels of their
// own (csrc/kernels/streaming_rows.cu): each CTA takes a quad of rows (one Philox block holds four
// streams' noise at a token) and a chunk of the vocabulary, so a row's pass runs on many CTAs at
// the speed of its loads. The kernels size the chunks on the device from the quads that have such
// a row, so that a few of them (the rows the fused truncation hands over) spread over every
// multiprocessor as a whole batch does; the workspace holds the most (quad, chunk) pairs any
// count of quads gives, a function of the shapes.

// Whether the streaming kernels may get top_p rows where a call gives streamed_first_y (and a
// row list): they verify each such row's winner against its top_p in rounds, which sample once
// without log-probabilities; the fused truncation streams them in calls without top_k (the same
// test as fused_truncation_streams_top_p_rows). The workspace holds the rounds' state wherever
// this holds.
inline bool streams_top_p_rows(const LogitsSamplerParams& params) {
  return (params.top_ps != nullptr || params.top_p < 1.0) && params.top_ks == nullptr && params.top_k < 1 &&
         params.num_samples == 1 && params.token_logprobs == nullptr;
}

// Bytes of device workspace the streaming rows' kernels need: per (row, chunk) partials and per
// (row, sample, chunk) candidates (a function of the shapes).
size_t streaming_rows_workspace_bytes(const LogitsSamplerParams& params, int sm_count);

// Bytes of device workspace launch_sample_from_logits needs (the streaming rows' per-chunk
// partials; 0 where no row can stream, and then the workspace may be null). Depends only on the
// shapes, the scalar truncation and whether there is a row list and streamed_first_y.
size_t sample_from_logits_workspace_bytes(const LogitsSamplerParams& params, int sm_count);

cudaError_t launch_sample_from_logits(const LogitsSamplerParams& params, void* workspace, int sm_count,
                                      cudaStream_t stream);

}  // namespace flashsampling
