// The per-row truncation arrays ([B] top_k, top_p, min_p) as the kernels read them: int64 top_ks,
// float64 top_ps / min_ps. Serving engines hand them over as int32 / float32 (vLLM's, FlashInfer's
// dtypes); one launch widens those into arrays of the kernels' types and zeroes a row list's count
// on the way, so that a call pays one small kernel where a conversion per array and the list's
// zeroing took one each. Torch-free.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashsampling {

// One narrow array to widen: `from` in the caller's dtype (int32 for top_k, float32 for the
// others) into `to` in the kernels' (int64 / float64). Both null: nothing to widen (no array, or a
// wide one the kernels read as it is).
struct RowTruncationArray {
  const void* from = nullptr;
  void* to = nullptr;
};

struct RowTruncationWidening {
  RowTruncationArray top_ks, top_ps, min_ps;
  int32_t* list_count = nullptr;  // zeroed where given (the fused truncation's fallback row list)
  int64_t batch_size = 0;
};

// Whether the widening has anything to do (a narrow array or a count to zero).
inline bool row_truncation_widening_needed(RowTruncationWidening const& w) {
  return w.list_count != nullptr || w.top_ks.to != nullptr || w.top_ps.to != nullptr ||
         w.min_ps.to != nullptr;
}

cudaError_t launch_widen_row_truncation(RowTruncationWidening const& w, cudaStream_t stream);

}  // namespace flashsampling
