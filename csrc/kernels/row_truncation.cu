// flashsampling/row_truncation_launch.h: a thread a row widens the narrow arrays (int32 -> int64,
// float32 -> float64: exact, so the kernels see the values the caller passed); thread 0 also zeroes
// the row list's count.
#include "flashsampling/row_truncation_launch.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;

__global__ void widen_row_truncation_kernel(RowTruncationWidening const w) {
  int64_t const row = int64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (row == 0 && w.list_count != nullptr) *w.list_count = 0;
  if (row >= w.batch_size) return;
  if (w.top_ks.to != nullptr) {
    static_cast<int64_t*>(w.top_ks.to)[row] = static_cast<const int32_t*>(w.top_ks.from)[row];
  }
  if (w.top_ps.to != nullptr) {
    static_cast<double*>(w.top_ps.to)[row] = static_cast<const float*>(w.top_ps.from)[row];
  }
  if (w.min_ps.to != nullptr) {
    static_cast<double*>(w.min_ps.to)[row] = static_cast<const float*>(w.min_ps.from)[row];
  }
}

}  // namespace

cudaError_t launch_widen_row_truncation(RowTruncationWidening const& w, cudaStream_t stream) {
  if (!row_truncation_widening_needed(w)) return cudaSuccess;
  int64_t const rows = w.batch_size < 1 ? 1 : w.batch_size;
  unsigned const blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  widen_row_truncation_kernel<<<blocks, kThreads, 0, stream>>>(w);
  return cudaGetLastError();
}

}  // namespace flashsampling
