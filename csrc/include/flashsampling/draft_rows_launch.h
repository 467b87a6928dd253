// Torch-free launchers of the two kernels of speculative verification with sampled drafts
// (csrc/kernels/draft_rows.cu; flashsampling_cuda/speculative.py, verify, calls them through
// flashsampling._draft_position_stats and flashsampling._stop_row_logits on CUDA and computes the
// same in torch ops on the CPU). Both read the target's fp32 logits x [B, P, V] (P = n + 1
// positions, contiguous) with y = fl(x * scale_b) (scale_b = fl(1 / T_b), 1 on greedy rows) and
// -inf where `allowed` (bool [B, P, V], optional) is false.
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

}  // namespace flashsampling
