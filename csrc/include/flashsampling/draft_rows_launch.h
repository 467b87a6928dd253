// Torch-free launchers of the kernels of speculative verification (csrc/kernels/draft_rows.cu;
// flashsampling_cuda/speculative.py calls them through flashsampling._draft_position_stats,
// _stop_row_logits, _accept_drafts and _draft_tokens on CUDA and computes the same in torch ops on
// the CPU). The first two read the target's fp32 logits x [B, P, V] (P = n + 1 positions,
// contiguous) with y = fl(x * scale_b) (scale_b = fl(1 / T_b), 1 on greedy rows) and -inf where
// `allowed` (bool [B, P, V], optional) is false; the last two are a step's per-row bookkeeping, a
// thread a row, in place of a few dozen small torch kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace flashsampling {

// Per row b and position j < J (J = the draft columns' width): lse[b, j] = log sum_v exp(y)
// (fp32; -inf where every y is -inf, NaN where one is NaN), argmax[b, j] = the first index of the
// largest y (NaN counting as largest, as torch.max orders), y_draft[b, j] = y at
// draft_columns[b, j] (-inf where that is -1).
struct DraftPositionStatsParams {
  int64_t batch = 0, positions = 0, vocab = 0, columns = 0;  // B, P, V, J (J <= P)
  const float* logits = nullptr;         // [B, P, V]
  const float* scales = nullptr;         // [B]
  const int64_t* draft_columns = nullptr;  // [B, J], local ids; -1 (or any id outside [0, V)): none
  const bool* allowed = nullptr;         // [B, P, V] or null
  float* lse = nullptr;                  // [B, J]
  int64_t* argmax = nullptr;             // [B, J]
  float* y_draft = nullptr;              // [B, J]
};
// The blocks' partials over vocabulary chunks: a workspace of this many bytes.
size_t draft_position_stats_workspace_bytes(DraftPositionStatsParams const& p);
cudaError_t launch_draft_position_stats(DraftPositionStatsParams const& p, void* workspace, cudaStream_t stream);

// Per row b, the logits of the sample it emits at position s = stop[b] (clamped to [0, P)): where
// residual[b] and s < n (a rejected sampled draft) the residual's log max(0, exp(y - lse[b, s]) -
// q[b, s, v]) (NaN differences count as 0), else, or where that residual has no value above -inf,
// x where y > -inf and -inf elsewhere (the target, its temperature applied by the sampler).
struct StopRowLogitsParams {
  int64_t batch = 0, positions = 0, vocab = 0, drafts = 0;  // B, P, V, n
  const float* logits = nullptr;       // [B, P, V]
  const float* draft_probs = nullptr;  // q [B, n, V]
  const int64_t* stop = nullptr;       // [B], in [0, P)
  const float* scales = nullptr;       // [B]
  const float* lse = nullptr;          // [B, n]
  const bool* residual = nullptr;      // [B]
  const bool* allowed = nullptr;       // [B, P, V] or null
  float* out = nullptr;                // [B, V]
};
// The rows' has-mass flags: a workspace of this many bytes.
size_t stop_row_logits_workspace_bytes(StopRowLogitsParams const& p);
cudaError_t launch_stop_row_logits(StopRowLogitsParams const& p, void* workspace, cudaStream_t stream);

// The acceptance walk of sampled drafts, a thread a row b: for j = 0, 1, ... while accepted, the
// draft's column d = draft_columns[b, j] (local; outside [0, V) no column: rejected) is accepted
// when u < min(1, p / q): p = exp(double(fl32(y_draft[b, j] - lse[b, j]))), q = double(
// draft_probs[b, j, d]) (q <= 0: ratio +inf; a NaN ratio rejects), u = double(fs_uniform_noise(
// seeds[b], offsets[b], streams[b], j, 2^32 - 1)); a greedy row (temps[b] == 0) accepts while d is
// argmax[b, j] and y_draft[b, j] > -inf. Writes num_accepted, residual (num_accepted < n on a row
// that is not greedy: its sample is the residual's), sample_temps (1 on residual rows, else
// temps[b]) and sample_offsets (offsets[b] + num_accepted).
struct AcceptDraftsParams {
  int64_t batch = 0, drafts = 0, vocab = 0;  // B, n, V
  int64_t stats_stride = 0;                  // the row stride J >= n of lse, argmax and y_draft
  const float* lse = nullptr;                // [B, J]
  const int64_t* argmax = nullptr;           // [B, J]
  const float* y_draft = nullptr;            // [B, J]
  const int64_t* draft_columns = nullptr;    // [B, n]
  const float* draft_probs = nullptr;        // [B, n, V]
  // [B] each, row b at [b * stride] (a stride of 0: one value for every row)
  const int64_t* seeds = nullptr;            // uint64 bits
  const int64_t* offsets = nullptr;          // uint64 bits
  const int64_t* streams = nullptr;          // low 32 bits
  const float* temps = nullptr;
  int64_t seed_stride = 1, offset_stride = 1, stream_stride = 1, temp_stride = 1;
  int64_t* num_accepted = nullptr;           // [B]
  bool* residual = nullptr;                  // [B]
  float* sample_temps = nullptr;             // [B]
  int64_t* sample_offsets = nullptr;         // [B]
};
cudaError_t launch_accept_drafts(AcceptDraftsParams const& p, cudaStream_t stream);

// A step's tokens [B, n + 1], a thread a row: the accepted drafts, then the emitted token, -1
// after. emitted is [B, 1] (each row's emitted token) or [B, n + 1] (each position's token t_j,
// the emitted one at num_accepted). Without num_accepted (one-hot drafts, emitted [B, n + 1]) the
// drafts are accepted while t_j is the draft and not -1. num_accepted_out gets the count.
struct DraftTokensParams {
  int64_t batch = 0, drafts = 0, emitted_width = 0;  // B, n, E (1 or n + 1)
  const int64_t* draft_token_ids = nullptr;  // [B, n]
  const int64_t* emitted = nullptr;          // [B, E]
  const int64_t* num_accepted = nullptr;     // [B] or null; clamped to [0, n]
  int64_t* tokens = nullptr;                 // [B, n + 1]
  int64_t* num_accepted_out = nullptr;       // [B]
};
cudaError_t launch_draft_tokens(DraftTokensParams const& p, cudaStream_t stream);

}  // namespace flashsampling
