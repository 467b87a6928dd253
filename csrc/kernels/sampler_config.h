// The static config table of the fused sampler: one CTA tile per batch bucket,
// chosen on the host from B alone (no sync, no per-call compilation). Each entry is
// instantiated in its own instantiations/sampler_<dtype>_n<N>_<loop>..._<arch>.cu (written by
// generate_kernels.py) so builds run in parallel.
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

#if defined(__CUDACC__)
#define FLASHSAMPLING_HOST_DEVICE __host__ __device__ inline
#else
#define FLASHSAMPLING_HOST_DEVICE inline
#endif

// GEMM columns: num_samples copies of the batch, column s * B + b = (sample s, row b). The
// fused top-k pass draws its samples in stage 2 (the GEMM draws at most each tile's winner of sample 0:
// SamplerParams::draw_tile_winners), one column per row.
FLASHSAMPLING_HOST_DEVICE int64_t sampler_unpadded_columns(SamplerParams const& p) {
  return p.fused_truncation ? p.batch_size : p.batch_size * p.num_samples;
}

// The GEMM's N: the columns above, or more when launch_sampler pads the hidden rows to a whole
// number of N tiles (the extra columns are zero rows; their candidates are never read).
FLASHSAMPLING_HOST_DEVICE int64_t sampler_gemm_columns(SamplerParams const& p) {
  return p.padded_columns > 0 ? p.padded_columns : sampler_unpadded_columns(p);
}

// Candidates per (vocabulary tile, GEMM column) in the workspace.
inline int64_t candidates_per_slot(SamplerParams const& p) {
  return p.fused_truncation ? kTopCandidatesPerTile : 1;
}

// Per-(tile, column) log-masses: the logprobs' (every loop), and the fused truncation's when it
// stores the logits (top_p without top_k needs each row's; not on the plain pass, whose rounds
// sum the rows' masses themselves).
inline bool needs_lse_parts(SamplerParams const& p) {
  return p.logprobs || (p.row_logits != nullptr && !p.truncation_on_plain_pass);
}

inline int64_t num_vocab_tiles(SamplerParams const& p, int vocab_tile) {
  return (p.vocab_size + vocab_tile - 1) / vocab_tile;
}

// Stage-1 outputs in the workspace, per (sample, vocabulary tile, batch row).
struct SamplerBuffers {
  PackedCandidate* candidates = nullptr;  // [num_vocab_tiles][S * B] ([num_vocab_tiles][B][4] for top-k)
  float* candidate_logits = nullptr;      // [num_vocab_tiles][S * B] (logprobs only)
  float2* lse_parts = nullptr;            // [num_vocab_tiles][S * B] (needs_lse_parts)
  uint32_t* sparse_bitmap = nullptr;      // [B][mask_words] (sparse bias only)
  uint32_t* penalty_words = nullptr;      // [B][mask_words][2] (penalties only: SamplingControls)
  float* penalty_slots = nullptr;         // [B][penalty_capacity][2] (penalties only)
  uint32_t* penalty_lowers = nullptr;     // [B] (penalties only)
  float* inv_temperatures = nullptr;      // [B] (prepare_inv_temperatures only)
  uint32_t* noise_floors = nullptr;       // [S * B] zeroed (skip_unreachable_noise only)
  // fused_truncation_streams_rows only: stage 2's rows for the streaming kernels
  // (LogitsSamplerParams::streamed_first_y), and those kernels' workspace.
  float* streamed_first_y = nullptr;  // [B]
  void* logits_sampler = nullptr;
  // draw_tile_winners only: the top-k scan's winner of each (vocabulary tile, row) (pack_candidate of
  // the perturbed score and index; 0: none), and stage 2's row winners for the streaming kernels
  // (LogitsSamplerParams::streamed_winners).
  // (and truncation_on_plain_pass with top_p: streamed_winners, the reduction's)
  PackedCandidate* tile_winners = nullptr;      // [num_vocab_tiles][columns]
  PackedCandidate* streamed_winners = nullptr;  // [B]
  // truncation_on_plain_pass only: each (vocabulary tile, column)'s largest x.
  float* tile_max_logits = nullptr;  // [num_vocab_tiles][columns]
  // min_p_filtered_winners only: each GEMM column's largest x so far (number_order_bits; 0: none
  // yet), zeroed before the GEMM, raised by every CTA.
  uint32_t* column_max_codes = nullptr;  // [columns]
  // large_top_k_run_keys only: each row's 16-token runs' four largest keys (top_scan_key of x, 0
  // where a run has fewer tokens), in place of x: [B][large_top_k_runs(p)][kTopCandidatesPerTile].
  PackedCandidate* run_keys = nullptr;
};

// Whether a call's reduction hands rows on to the top_p rounds with their winners
// (SamplerBuffers::streamed_winners): stage 2 where the GEMM drew the tile winners, or the plain
// pass's reduction.
inline bool hands_on_streamed_winners(SamplerParams const& p) {
  return p.draw_tile_winners || (p.truncation_on_plain_pass && call_may_cut_top_p(p));
}

// Byte offsets of SamplerBuffers in the workspace (each 256-aligned), the padded copy of the
// hidden rows (when padded), then the GEMM's own.
struct SamplerWorkspaceLayout {
  size_t candidates = 0, candidate_logits = 0, lse_parts = 0, sparse_bitmap = 0, penalty_words = 0,
         penalty_slots = 0, penalty_lowers = 0, inv_temperatures = 0, noise_floors = 0, streamed_first_y = 0, logits_sampler = 0,
         tile_winners = 0, streamed_winners = 0, tile_max_logits = 0, column_max_codes = 0, run_keys = 0,
         padded_hidden = 0, gemm = 0, total = 0;

  // logits_sampler_bytes: the fallback's logits sampler's workspace (0 unless
  // fused_truncation_streams_rows).
  SamplerWorkspaceLayout(SamplerParams const& p, int vocab_tile, size_t gemm_bytes, size_t logits_sampler_bytes) {
    auto round_up = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
    size_t const slots =
        static_cast<size_t>(num_vocab_tiles(p, vocab_tile)) * static_cast<size_t>(sampler_gemm_columns(p));
    size_t at = 0;
    candidates = at;
    at += round_up(slots * static_cast<size_t>(candidates_per_slot(p)) * sizeof(PackedCandidate));
    candidate_logits = at;
    at += p.logprobs ? round_up(slots * sizeof(float)) : 0;
    lse_parts = at;
    at += needs_lse_parts(p) ? round_up(slots * sizeof(float2)) : 0;
    sparse_bitmap = at;
    at += p.controls.sparse_ids ? round_up(static_cast<size_t>(p.batch_size) * p.controls.mask_words * 4) : 0;
    bool const penalties = p.controls.penalty_ids != nullptr;
    penalty_words = at;
    at += penalties ? round_up(static_cast<size_t>(p.batch_size) * p.controls.mask_words * 2 * sizeof(uint32_t)) : 0;
    penalty_slots = at;
    at += penalties ? round_up(static_cast<size_t>(p.batch_size) * p.controls.penalty_capacity * 2 * sizeof(float))
                    : 0;
    penalty_lowers = at;
    at += penalties ? round_up(static_cast<size_t>(p.batch_size) * sizeof(uint32_t)) : 0;
    inv_temperatures = at;
    at += p.prepare_inv_temperatures ? round_up(static_cast<size_t>(p.batch_size) * sizeof(float)) : 0;
    noise_floors = at;
    at += p.skip_unreachable_noise ? round_up(static_cast<size_t>(sampler_gemm_columns(p)) * sizeof(uint32_t)) : 0;
    bool const streams = fused_truncation_streams_rows(p);
    streamed_first_y = at;
    at += streams ? round_up(static_cast<size_t>(p.batch_size) * sizeof(float)) : 0;
    logits_sampler = at;
    at += streams ? round_up(logits_sampler_bytes) : 0;
    tile_winners = at;
    at += p.draw_tile_winners ? round_up(slots * sizeof(PackedCandidate)) : 0;
    streamed_winners = at;
    at += hands_on_streamed_winners(p) ? round_up(static_cast<size_t>(p.batch_size) * sizeof(PackedCandidate)) : 0;
    tile_max_logits = at;
    at += p.truncation_on_plain_pass ? round_up(slots * sizeof(float)) : 0;
    column_max_codes = at;
    at += p.min_p_filtered_winners ? round_up(static_cast<size_t>(sampler_gemm_columns(p)) * sizeof(uint32_t)) : 0;
    run_keys = at;
    at += p.large_top_k_run_keys ? round_up(static_cast<size_t>(p.batch_size * large_top_k_runs(p)) *
                                            kTopCandidatesPerTile * sizeof(PackedCandidate))
                                 : 0;
    padded_hidden = at;
    at += p.padded_columns > 0 ? round_up(static_cast<size_t>(p.padded_columns * p.hidden_dim) * kElementBytes) : 0;
    gemm = at;
    total = at + gemm_bytes;
  }

  SamplerBuffers buffers(SamplerParams const& p, void* workspace) const {
    char* base = static_cast<char*>(workspace);
    SamplerBuffers b;
    b.candidates = reinterpret_cast<PackedCandidate*>(base + candidates);
    b.candidate_logits = p.logprobs ? reinterpret_cast<float*>(base + candidate_logits) : nullptr;
    b.lse_parts = needs_lse_parts(p) ? reinterpret_cast<float2*>(base + lse_parts) : nullptr;
    b.sparse_bitmap = p.controls.sparse_ids ? reinterpret_cast<uint32_t*>(base + sparse_bitmap) : nullptr;
    bool const penalties = p.controls.penalty_ids != nullptr;
    b.penalty_words = penalties ? reinterpret_cast<uint32_t*>(base + penalty_words) : nullptr;
    b.penalty_slots = penalties ? reinterpret_cast<float*>(base + penalty_slots) : nullptr;
    b.penalty_lowers = penalties ? reinterpret_cast<uint32_t*>(base + penalty_lowers) : nullptr;
    b.inv_temperatures = p.prepare_inv_temperatures ? reinterpret_cast<float*>(base + inv_temperatures) : nullptr;
    b.noise_floors = p.skip_unreachable_noise ? reinterpret_cast<uint32_t*>(base + noise_floors) : nullptr;
    bool const streams = fused_truncation_streams_rows(p);
    b.streamed_first_y = streams ? reinterpret_cast<float*>(base + streamed_first_y) : nullptr;
    b.logits_sampler = streams ? static_cast<void*>(base + logits_sampler) : nullptr;
    b.tile_winners = p.draw_tile_winners ? reinterpret_cast<PackedCandidate*>(base + tile_winners) : nullptr;
    b.streamed_winners =
        hands_on_streamed_winners(p) ? reinterpret_cast<PackedCandidate*>(base + streamed_winners) : nullptr;
    b.tile_max_logits = p.truncation_on_plain_pass ? reinterpret_cast<float*>(base + tile_max_logits) : nullptr;
    b.column_max_codes = p.min_p_filtered_winners ? reinterpret_cast<uint32_t*>(base + column_max_codes) : nullptr;
    b.run_keys = p.large_top_k_run_keys ? reinterpret_cast<PackedCandidate*>(base + run_keys) : nullptr;
    return b;
  }
};

// Per-config entry points (defined in sampler_gemm_<arch>.cuh, instantiated per file).
// kLoop: the epilogue's element loop (sampler_loop_for); p.controls' sparse_bitmap and
// inv_temperatures, when needed, already point at the prepared arrays.
// kClusterM: CTAs per cluster along the vocabulary (1, or 2: the pair multicasts each hidden
// tile).
template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM = 1>
cudaError_t run_sampler_gemm_sm90(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                                  cudaStream_t stream);
template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM = 1>
size_t sampler_gemm_workspace_sm90(SamplerParams const& p);

// The plain loop (or the common controls' loop, or the fused top-k pass's) on sm90 with epilogue
// warpgroups of their own (no GEMM workspace); its candidates come per 64-row half tile
// (kEpilogueWarpGroupsVocabTile), the top-k pass's per 128-row tile.
// kClusterM / kClusterN: 2 for clusters of two CTAs along the vocabulary / the columns.
constexpr int kEpilogueWarpGroupsVocabTile = 64;
// The fused top-k pass on it writes per 128-row tile, the tile of CUTLASS's cooperative schedule
// whose visitor outputs it reproduces bit for bit (stage 2 reads the same tiles either way).
constexpr int kEpilogueWarpGroupsTopCandidatesVocabTile = 128;
template <class Element, int TileN, SamplerLoop kLoop, int kClusterM = 1, int kClusterN = 1>
cudaError_t run_sampler_gemm_sm90_epilogue_warpgroups(SamplerParams const& p, SamplerBuffers const& buffers,
                                                      void* gemm_workspace, cudaStream_t stream);

template <class Element, int TileN, SamplerLoop kLoop>
cudaError_t run_sampler_gemm_sm100(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                                   cudaStream_t stream);
template <class Element, int TileN, SamplerLoop kLoop>
size_t sampler_gemm_workspace_sm100(SamplerParams const& p);

// Before stage 1, with sparse bias: marks (row, v) of every sparse entry in the bitmap.
cudaError_t launch_build_sparse_bitmap(SamplerParams const& p, uint32_t* bitmap, cudaStream_t stream);

// Before stage 1, with penalties: the rank bitmap of the rows' seen tokens (SamplingControls::
// penalty_words, penalty_slots) from penalty_ids / penalty_values / repetition_penalties.
cudaError_t launch_build_penalty_table(SamplerParams const& p, SamplerBuffers const& buffers, cudaStream_t stream);

// Before stage 1, one kernel for what the buffers ask: inv_temperatures[b] =
// fs_inv_temperature(T_b) (prepare_inv_temperatures); with the exact skip the zeroed noise floors.
cudaError_t launch_prepare_gemm_inputs(SamplerParams const& p, SamplerBuffers const& buffers, cudaStream_t stream);

// Stage 2: per (row, sample) the best candidate over vocabulary tiles -> token, score,
// and with logprobs the merged log-sum-exp and the token's log-probability; on the plain pass
// (truncation_on_plain_pass) also each top_p row's winner and first y for the rounds, or each
// min_p row's first y for the streaming pass.
cudaError_t launch_reduce_candidates(SamplerParams const& p, SamplerBuffers const& buffers, int64_t num_tiles,
                                     int vocab_tile, cudaStream_t stream);

// Stage 2 of the fused truncation (truncate_candidates.cu): per row, the top_k of the
// candidates (tiles that may hide more are recomputed), top-p / min-p, then the samples of
// Gumbel-Max over the survivors, with the noise of plain sampling; the rows it cannot decide
// go to fallback_rows (none where fused_truncation_selects_large_top_k: then it needs only
// row_logits). vocab_tile: M of a tile.
// Dynamic shared memory stage 2 needs for these tiles (0: more than it may use).
size_t truncate_candidates_smem_bytes(int64_t num_tiles, int vocab_tile);

cudaError_t launch_truncate_candidates(SamplerParams const& p, SamplerBuffers const& buffers, int64_t num_tiles,
                                       int vocab_tile, cudaStream_t stream);

}  // namespace flashsampling
