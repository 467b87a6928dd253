// The per-row truncation arrays ([B] top_k, top_p, min_p) as the kernels read them: int64 top_ks,
// float64 top_ps / min_ps. Serving engines hand them over as int32 / float32 (vLLM's, FlashInfer's
// dtypes); one launch widens those into arrays of the kernels' types and zeroes a row list's count
// on the way, so that a call pays one small kernel where a conversion per array and the list's
// zeroing took one each. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// One array: `from` in the caller's dtype (narrow: int32 for top_k, float32 for the others), and
// `to` in the kernels' (int64 / float64), written where `from` is narrow. Both null: no array.
struct RowTruncationArray {
  const void* from = nullptr;
  bool narrow = false;
  void* to = nullptr;
};

struct RowTruncationWidening {
  RowTruncationArray top_ks, top_ps, min_ps;
  int32_t* list_count = nullptr;  // zeroed where given (the fused truncation's fallback row list)
  int64_t batch_size = 0;
};

// Whether the widening has anything to do (a narrow array or a count to zero).
inline bool row_truncation_widening_needed(RowTruncationWidening const& w) {
  return w.list_count != nullptr || (w.top_ks.from && w.top_ks.narrow) || (w.top_ps.from && w.top_ps.narrow) ||
         (w.min_ps.from && w.min_ps.narrow);
}

cudaError_t launch_widen_row_truncation(RowTruncationWidening const& w, cudaStream_t stream);

}  // namespace flashsampling
