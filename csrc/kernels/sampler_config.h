// The static config table of the fused sampler: one CTA tile per batch bucket,
// chosen on the host from B alone (no sync, no per-call compilation). Each entry
// is instantiated in its own sampler_<dtype>_n<N>_<arch>.cu so builds run in parallel.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flashsampling/sampler_params.h"

namespace flashsampling {

// Every config tiles the vocabulary by 128 rows (two consumer warpgroups of 64),
// so the candidate workspace has the same shape whichever config runs.
inline constexpr int kVocabTile = 128;

template <int TileN>
struct SamplerTileConfig {
  static constexpr int kTileM = kVocabTile;
  // Narrow N tiles are memory-bound: deeper K per stage keeps more bytes in flight.
  static constexpr int kTileK = TileN >= 128 ? 64 : 128;
};

// Batch buckets: the narrowest N tile that covers B; B > 64 runs several 64-wide N
// tiles (measured on H200, benchmarks/NOTES.md: the 128- and 256-wide tiles were 2-3x
// slower than 64-wide tiles at B = 128 / 256 with this epilogue).
inline int sampler_tile_n_for_batch(int64_t batch_size) {
  return batch_size <= 16 ? 16 : batch_size <= 32 ? 32 : 64;
}

inline int64_t num_vocab_tiles(SamplerParams const& p) {
  return (p.vocab_size + kVocabTile - 1) / kVocabTile;
}

// Candidates of all samples: [num_samples][num_vocab_tiles][B].
inline size_t candidate_bytes(SamplerParams const& p) {
  return static_cast<size_t>(p.num_samples) * num_vocab_tiles(p) * p.batch_size * sizeof(PackedCandidate);
}

// Per-config entry points (defined in sampler_gemm_<arch>.cuh, instantiated per file).
template <class Element, int TileN>
cudaError_t run_sampler_gemm_sm90(SamplerParams const& p, PackedCandidate* candidates, void* gemm_workspace,
                                  cudaStream_t stream);
template <class Element, int TileN>
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
