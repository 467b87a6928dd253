// The static config table of the fused sampler: one CTA tile per batch bucket,
// chosen on the host from B alone (no sync, no per-call compilation). Each entry
// is instantiated in its own sampler_<dtype>_n<N>_<arch>.cu so builds run in parallel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashsampling/sampler_params.h"

namespace flashsampling {

// kPingpong: each consumer warpgroup owns a 64-row vocabulary tile and its epilogue
// (noise + argmax) overlaps the other warpgroup's mainloop; otherwise both
// warpgroups share a 128-row tile (cooperative) and the epilogue is not overlapped.
template <int TileN, bool kPingpong>
struct SamplerTileConfig {
  static constexpr int kTileM = kPingpong ? 64 : 128;
  // Narrow N tiles are memory-bound: deeper K per stage keeps more bytes in flight.
  static constexpr int kTileK = TileN >= 128 ? 64 : 128;
};

// Batch buckets: the narrowest N tile that covers B; B > 256 runs several N tiles.
inline int sampler_tile_n_for_batch(int64_t batch_size) {
  return batch_size <= 16 ? 16 : batch_size <= 32 ? 32 : batch_size <= 64 ? 64 : batch_size <= 128 ? 128 : 256;
}

inline int64_t num_vocab_tiles(SamplerParams const& p, int vocab_tile) {
  return (p.vocab_size + vocab_tile - 1) / vocab_tile;
}

// Candidates of all samples: [num_samples][num_vocab_tiles][B].
inline size_t candidate_bytes(SamplerParams const& p, int vocab_tile) {
  return static_cast<size_t>(p.num_samples) * num_vocab_tiles(p, vocab_tile) * p.batch_size *
         sizeof(PackedCandidate);
}

// Per-config entry points (defined in sampler_gemm_<arch>.cuh, instantiated per file).
template <class Element, int TileN, bool kPingpong>
cudaError_t run_sampler_gemm_sm90(SamplerParams const& p, PackedCandidate* candidates, void* gemm_workspace,
                                  cudaStream_t stream);
template <class Element, int TileN, bool kPingpong>
size_t sampler_gemm_workspace_sm90(SamplerParams const& p);

template <class Element, int TileN>
cudaError_t run_sampler_gemm_sm100(SamplerParams const& p, PackedCandidate* candidates, void* gemm_workspace,
                                   cudaStream_t stream);
template <class Element, int TileN>
size_t sampler_gemm_workspace_sm100(SamplerParams const& p);

// Stage 2: the best candidate over vocabulary tiles -> token ids.
cudaError_t launch_reduce_candidates(PackedCandidate const* candidates, int64_t num_tiles, int64_t batch_size,
                                     int num_samples, int64_t* tokens, cudaStream_t stream);

}  // namespace flashsampling
