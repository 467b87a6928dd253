// Torch-free description of one fused sampling call, and the launcher API the
// binding layer (csrc/torch/sample_cuda.cpp) calls. Kernel sources include only
// this, CUTLASS and CUDA headers.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "flashsampling/philox_gumbel.h"  // FS_HOST_DEVICE
#include "flashsampling/sampler_loop.h"
#include "flashsampling/top_logprobs.h"

namespace flashsampling {

enum class ElementType : int { kBFloat16 = 0, kFloat16 = 1 };
constexpr size_t kElementBytes = 2;  // both element types are 16-bit

// Where the seed and offset of the noise come from. A device pointer, when set,
// wins over the value and is read by the kernel at run time, so a captured CUDA
// graph replays with whatever the tensor holds then (torch's Philox convention:
// offset = *offset_device + offset_device_add).
struct NoiseSource {
  uint64_t seed = 0;
  uint64_t offset = 0;
  const int64_t* seed_device = nullptr;
  const int64_t* offset_device = nullptr;
  uint64_t offset_device_add = 0;
  // Per-row [B] device arrays; when set they win over the batch-wide values above.
  // Per-row seeds also switch every row to noise stream 0 (batch-invariant sampling).
  const int64_t* row_seeds = nullptr;
  const int64_t* row_offsets = nullptr;
  // Per-row [B] noise streams (low 32 bits), when set, in place of the row (batch-wide seed) or
  // 0 (per-row seeds): rows that stand for other rows' positions keep those rows' noise
  // (speculative verification samples position j of row b as row b at offset + j).
  const int64_t* row_streams = nullptr;
};

// Per-row sampling controls, all optional (nullptr = off); device memory.
// Transformed logit: l = fs_model_logit(logit, logit_scale, logit_softcap, inv_logit_softcap),
// x = fl(fl(l + logit_bias[v]) + sparse sum), then on the row's seen tokens the penalties
// (fs_penalized_logit), masked tokens excluded, score = fma(x, fl(1 / T), g) or x for greedy rows
// (csrc/torch/checks.h).
struct SamplingControls {
  // The model-side transforms of the raw logit, before the biases (philox_gumbel.h's
  // fs_model_logit): scale 1 and softcap 0 are off; inv_logit_softcap = fs_div(1, softcap).
  float logit_scale = 1.0f;
  float logit_softcap = 0.0f;
  float inv_logit_softcap = 0.0f;
  const float* temperatures = nullptr;    // [B]; wins over SamplerParams::inv_temperature
  // [B] fs_inv_temperature(temperatures[b]), filled by launch_sampler in its workspace before
  // the GEMM where SamplerParams::prepare_inv_temperatures says so; else nullptr and the kernels
  // divide the row's temperature themselves (row_inv_temperature).
  const float* inv_temperatures = nullptr;
  const float* logit_bias = nullptr;      // [V]
  const uint32_t* allowed_mask = nullptr;  // [B, mask_words]: bit v & 31 of word v >> 5 = allowed
  // Sparse per-row bias: sparse_bitmap marks (row, v) with at least one entry, so the
  // epilogue scans the row's ids only for those.
  const uint32_t* sparse_bitmap = nullptr;  // [B, mask_words]
  const int32_t* sparse_ids = nullptr;      // [B, sparse_k] global ids (others ignored)
  const float* sparse_values = nullptr;     // [B, sparse_k]
  int sparse_k = 0;
  int64_t mask_words = 0;  // ceil(V / 32)
  // Penalties of the tokens each row has seen (docs/penalties.md step 3): penalty_ids [B,
  // penalty_capacity] global ids, distinct within a row (a PenaltyState's; negative ids and ids
  // outside this vocabulary ignored); the entry's token gets x / r or x * r with r =
  // repetition_penalties[b] (nullptr: none), then + penalty_values[b, k] (nullptr: none).
  const int64_t* penalty_ids = nullptr;
  const float* penalty_values = nullptr;
  const float* repetition_penalties = nullptr;
  int penalty_capacity = 0;
  // Set by launch_sampler, not by callers (launch_build_penalty_table, before the GEMM): the
  // rank bitmap the epilogue looks a token up in, O(1) per logit. penalty_words [B, mask_words]
  // pairs {bits of the row's seen tokens in the word, seen tokens of the row in earlier words};
  // a seen token's rank in its row is words.y + popc(words.x & below) and penalty_slots [B,
  // penalty_capacity] pairs {r, add} by rank (r = 1, add = -0.0f where not given: no change).
  const uint32_t* penalty_words = nullptr;
  const float* penalty_slots = nullptr;
  // Set by launch_sampler with the two above: per row 1 where no seen token's penalty can raise
  // its logit (r >= 1 and every add <= 0: fs_penalized_logit(x) <= x), else 0. The plain
  // epilogue-warpgroup loop's skip bounds such a row's penalised logits by the logits themselves.
  const uint32_t* penalty_lowers = nullptr;
  // The top-k scan's per-tile log-masses (candidate_math.cuh) of x instead of y = x / T: the raw
  // log-sum-exp of flashsampling._sample_top_logprobs's raw mode (TopLogprobRows::raw_logsumexp).
  bool top_scan_masses_of_x = false;
};

// The loop a call needs (sampler_loop.h). Plain sampling (one sample per row, batch-wide
// temperature and noise, no logit transform, no logprobs) runs on kernels compiled without the
// controls' code (benchmarks/NOTES.md: that code costs instruction cache when present); the
// model-side transforms run in the controls' loops (the common controls' for a call that has
// nothing else), never in the plain loop.
inline LoopNeeds loop_needs(SamplingControls const& c, NoiseSource const& noise, int num_samples, bool logprobs) {
  LoopNeeds n;
  n.model_transform = c.logit_scale != 1.0f || c.logit_softcap != 0.0f;
  n.penalties = c.penalty_ids != nullptr;
  n.per_row_temperatures = c.temperatures != nullptr;
  n.logit_bias = c.logit_bias != nullptr;
  n.allowed_mask = c.allowed_mask != nullptr;
  n.logprobs = logprobs;
  n.sparse_bias = c.sparse_ids != nullptr;
  n.per_row_keys = noise.row_seeds != nullptr || noise.row_offsets != nullptr || noise.row_streams != nullptr;
  n.num_samples = num_samples;
  return n;
}

inline bool is_plain_sampling(SamplingControls const& c, NoiseSource const& noise, int num_samples, bool logprobs) {
  return sampler_loop_for(loop_needs(c, noise, num_samples, logprobs)) == SamplerLoop::kPlain;
}

// The epilogue's element loops: flashsampling/sampler_loop.h.

// Candidates per (vocabulary tile, row) of the fused top-k pass. Exact whatever the data: a
// row where some tile may hold more than these of the row's top-k is repaired in stage 2
// (truncate_candidates.cu recomputes that tile's logits).
constexpr int kTopCandidatesPerTile = 4;
// Largest top_k stage 2 of the fused truncation decides in truncate_candidates_kernel (it keeps
// the survivors in one warp's registers, sorted); rows with larger k go to the logits sampler,
// but for those below.
constexpr int kMaxFusedTopK = 64;
// Largest host top_k stage 2 selects in shared memory (fused_truncation_selects_large_top_k;
// sorted only for top_p, whose prefix needs the order). A flat row's top 1024 of ~150K logits
// hold more than 4 of one 128-token tile in ~1% of tiles, which stage 2 recomputes from the
// stored logits.
constexpr int kMaxFusedLargeTopK = 1024;

inline SamplerLoop sampler_loop_for(SamplingControls const& c, NoiseSource const& noise, int num_samples,
                                    bool logprobs) {
  return sampler_loop_for(loop_needs(c, noise, num_samples, logprobs));
}

// The top-N log-probabilities of flashsampling._sample_top_logprobs (flashsampling_cuda/logprobs.py
// has the order: t descending, exact ties to the smaller id; processed t = fl32(y - fl32(lse)),
// raw t = fl32(fl64(x) - fl64(lse)) with lse the raw logits' float32 log-sum-exp), decided in the
// fused truncation's stage 2 from the candidates of a row's first kMaxFusedTopK tokens where they
// certify the answer (truncate_candidates.cu), and otherwise marked in row_modes for the top-N
// kernels (top_logprobs.h), which read the stored logits after stage 2 and the logits sampler.
struct TopLogprobRows {
  int top_n = -1;                // N in [0, kMaxFusedTopK]; -1: not such a call
  float* values = nullptr;       // [B, N] t
  int64_t* ids = nullptr;        // [B, N] local ids
  int64_t* ranks = nullptr;      // [B] 1-based rank of the sampled token
  uint8_t* row_modes = nullptr;  // [B] what stage 2 left (top_logprobs.h: kTopLogprobsRank | kTopLogprobsTop)
  float* row_scales = nullptr;   // [B] y / x of the row: fl32(1 / T), 1 on greedy rows
  // [B] or null. Raw mode where given (the call has no bias, so x is the raw logits): stage 2
  // writes every row's raw log-sum-exp here (the GEMM's log-masses are of x: SamplingControls::
  // top_scan_masses_of_x), and the sampled token's raw log-probability to SamplerParams::
  // token_logprobs where it decides the row; the logits sampler writes its processed values of
  // the rows it samples (SamplerParams::logsumexp: not returned), whose token_logprobs the top-N
  // kernels' rank pass then overwrites with the raw ones.
  float* raw_logsumexp = nullptr;
};
struct SamplerParams {
  // LM head weight [V, D] and hidden states, both with unit stride along D. With
  // num_samples = S > 1, `hidden` holds the batch S times ([S * B, D], sample-major):
  // every sample is a GEMM column of its own, so W is read once for all of them.
  const void* weight = nullptr;
  const void* hidden = nullptr;
  int64_t vocab_size = 0;         // V
  int64_t hidden_dim = 0;         // D
  int64_t batch_size = 0;         // B
  int64_t weight_row_stride = 0;  // elements between weight rows (>= D)
  int64_t hidden_row_stride = 0;  // elements between hidden rows (>= D)
  ElementType element_type = ElementType::kBFloat16;
  int64_t vocab_start = 0;        // global id of weight row 0: noise and tokens use vocab_start + v

  // score = logit * inv_temperature + gumbel; greedy rows drop the noise.
  float inv_temperature = 1.0f;
  bool greedy = false;
  SamplingControls controls;

  NoiseSource noise;
  int num_samples = 1;

  // Fused truncation (kTopCandidates, truncate_candidates.cu): the GEMM keeps each (vocabulary
  // tile, row)'s kTopCandidatesPerTile largest transformed logits and stage 2 truncates a row
  // from them: top_k (<= 0: off), then top_p and min_p (off: top_p >= 1, min_p <= 0), then
  // samples the survivors with the noise of plain sampling. Per-row [B] device arrays (int64
  // top_ks, float64 top_ps / min_ps) win over the scalars. Stage 2 decides a row with top_k in
  // [1, kMaxFusedTopK], every row of a call with a host top_k up to kMaxFusedLargeTopK, and a
  // row without top_k whose top_p / min_p cut falls within its first kMaxFusedTopK tokens; it
  // leaves the others (a larger top_k, nothing on, or a cut past them) to the logits sampler,
  // which needs row_logits and fallback_rows.
  bool fused_truncation = false;
  int64_t top_k = 0;
  double top_p = 1.0;
  double min_p = 0.0;
  const int64_t* top_ks = nullptr;
  const double* top_ps = nullptr;
  const double* min_ps = nullptr;
  // [B, row_logits_stride] fp32, the stride a multiple of 128 covering V: the GEMM stores every
  // x there (kExcludedLogitBits where the mask excludes it), for the rows stage 2 leaves.
  float* row_logits = nullptr;
  int64_t row_logits_stride = 0;
  // [1 + B] int32, count zeroed: stage 2 appends the rows it leaves (count, then rows), and
  // sample_from_logits samples those rows from row_logits.
  int32_t* fallback_rows = nullptr;
  // flashsampling._sample_top_logprobs (top_n >= 0): a fused truncation call with nothing on,
  // whose stage 2 also gives each row its processed top-N log-probabilities and the sampled
  // token's rank where the candidates certify them (TopLogprobRows).
  TopLogprobRows top_logprobs;

  // Outputs. tokens: int64 [B, num_samples]; scores: float [B, num_samples] (optional);
  // with logprobs: token_logprobs float [B, num_samples] and logsumexp float [B].
  int64_t* tokens = nullptr;
  float* scores = nullptr;
  bool logprobs = false;
  float* token_logprobs = nullptr;
  float* logsumexp = nullptr;
  // Token for a row whose allowed_mask allows nothing (the binding has already made
  // that an error when the caller gave none); -1 for a row without finite candidates.
  int64_t empty_mask_token = -1;

  // Multiprocessors of the running GPU (sizes the persistent grid).
  int device_sm_count = 0;

  // Set by launch_sampler, not by callers: GEMM columns after padding the hidden rows to a
  // multiple of the CTA's N tile (0: not padded; see sampler_dispatch.cu).
  int64_t padded_columns = 0;
  // Set by launch_sampler, not by callers: whether the kernel skips the exact noise of elements
  // that cannot reach their column's best score (the epilogue-warpgroup kernels; the tokens are
  // the same either way). It then gets a zeroed [columns] buffer of the best scores so far.
  bool skip_unreachable_noise = false;
  // Set by launch_sampler, not by callers: whether the epilogue-warpgroup kernels' controls loop
  // sums log-probability terms against each column's log-sum-exp of earlier tiles instead of
  // its max over the lanes; the tokens are the same either way, the log-probabilities to ~1e-7.
  bool lse_references = false;
  // Set by launch_sampler, not by callers: with per-row temperatures, whether a small kernel
  // before the GEMM fills controls.inv_temperatures. It does for the kernels that load that
  // array: the epilogue-warpgroup kernels and the loop for all controls, which looks a column's
  // row up per element. The CUTLASS schedules' common-controls loop divides once per column it
  // loads instead, and the fused top-k's stage 2 once per row: a kernel and a graph node fewer
  // before the GEMM.
  bool prepare_inv_temperatures = false;
  // Set by launch_sampler, not by callers (fused_truncation_draws_tile_winners): whether the top-k
  // scan also draws plain sampling's noise and keeps each (vocabulary tile, row)'s winner, so that
  // stage 2 knows every row's plain-sampling token: the rows without a cut get it at once, and the
  // top_p rows it hands on start their rounds from it (no streaming pass over their logits).
  bool draw_tile_winners = false;
  // Set by launch_sampler, not by callers (fused_truncation_stores_logits_by_top_k): whether the
  // GEMM stores x in row_logits only for the rows whose top_k (top_ks) is not in [1,
  // kMaxFusedTopK] (top_k_decides_row_from_candidates); the rows it skips leave their entries
  // unwritten, and stage 2 recomputes their hidden tiles instead of reading them: the x no later
  // kernel reads cost the GEMM their write-back (a [B, V] fp32 array) as the weight streams in.
  bool row_logits_by_top_k = false;
  // Set by launch_sampler, not by callers (sampler_stores_run_keys): a call that selects a large
  // top_k (fused_truncation_selects_large_top_k) on the epilogue-warpgroup top-k scan stores, in
  // place of x (row_logits is then null), each 16-token run's four largest keys
  // (SamplerBuffers::run_keys), from which the selection's repairs read a tile.
  bool large_top_k_run_keys = false;
  // Set by launch_sampler, not by callers (sampler_dispatch.cu: runs_on_plain_pass): a fused
  // truncation call of top_p alone or min_p alone that runs plain sampling's pass instead of the
  // top-k scan (fused_truncation is then false): the GEMM also stores every x in row_logits and
  // each (vocabulary tile, row)'s largest x, and its reduction gives each row its plain-sampling
  // token where that is its sample (no cut; with min_p, a winner that passes it) and hands the
  // other rows on: top_p rows with their winner and first y to the top_p rounds
  // (LogitsSamplerParams::streamed_winners), which verify it against top_p; min_p rows with their
  // first y to the streaming pass over their survivors. No stage 2, no tile winners.
  bool truncation_on_plain_pass = false;
  // Set by launch_sampler with truncation_on_plain_pass (DispatchOptions::first_winners_in_reduction):
  // the reduction keeps a top_p row's plain token itself where no allowed key lies ahead of it in
  // the truncation order (the row's first token, which top_p always keeps), instead of handing the
  // row to the rounds, whose round 0 would find no mass ahead of it.
  bool first_winners_in_reduction = false;
  // Set by launch_sampler (DispatchOptions::min_p_filtered_winners), not by callers: a call of
  // min_p alone on the plain pass whose GEMM runs the epilogue-warpgroup kernel's plain loop. Each
  // (tile, row)'s candidate is then the best score among the tile's tokens whose y reaches a floor
  // no survivor of the row's min_p is below (from the row's largest x so far over every CTA, in a
  // [columns] array), and the exact skip's floors are not raised for the rows min_p cuts (up to
  // 64 GEMM columns: min_p_filtered_winners_pay). So the reduction finds most rows' samples among
  // the candidates and reads the stored x of the few tiles whose failing candidate beats the best
  // surviving one, where the streaming pass would read every x of the row.
  bool min_p_filtered_winners = false;
};

// Whether stage 2 of the fused truncation decides a row with this top_k from the candidates alone
// (top_k in [1, kMaxFusedTopK]), recomputing from W and h the tiles that may hide more of its
// top_k: it reads no stored logits for such a row and leaves it to no later kernel.
constexpr bool top_k_decides_row_from_candidates(int64_t top_k) { return top_k >= 1 && top_k <= kMaxFusedTopK; }

// Whether stage 2 of the fused truncation decides every row (a host top_k in [1, kMaxFusedTopK]):
// otherwise it may leave rows to the logits sampler, which needs row_logits and fallback_rows.
inline bool fused_truncation_decides_every_row(SamplerParams const& p) {
  return p.top_ks == nullptr && top_k_decides_row_from_candidates(p.top_k);
}

// Whether the GEMM of a call that stores row_logits skips the rows whose per-row top_k stage 2
// decides from the candidates alone (SamplerParams::row_logits_by_top_k): every call with top_ks
// but one that returns the stored logits (top-N log-probabilities, TopLogprobRows).
inline bool fused_truncation_stores_logits_by_top_k(SamplerParams const& p) {
  return p.row_logits != nullptr && p.top_ks != nullptr && p.top_logprobs.top_n < 0;
}

// Whether some row of a call may have top_p / min_p on (a [B] tensor, or an on host value); the
// dispatch and the plain pass's reduction ask.
FS_HOST_DEVICE bool call_may_cut_top_p(SamplerParams const& p) { return p.top_ps != nullptr || p.top_p < 1.0; }
FS_HOST_DEVICE bool call_may_cut_min_p(SamplerParams const& p) { return p.min_ps != nullptr || p.min_p > 0.0; }

// Whether a row's min_p keeps the tokens whose probability reaches min_p times the first token's
// (in (0, 1]); off at <= 0, and above 1 or NaN it keeps the first token alone (the cut kernel's).
// The plain pass's reduction and its filtered winners' floors ask.
FS_HOST_DEVICE bool min_p_cuts(double min_p) { return min_p > 0.0 && min_p <= 1.0; }

// Row `row`'s top_p / min_p: its entry of the [B] tensor where the call has one, else the call's
// value (on the device: the kernels that decide a row's cut read it here).
FS_HOST_DEVICE double top_p_of_row(SamplerParams const& p, int64_t row) { return p.top_ps ? p.top_ps[row] : p.top_p; }
FS_HOST_DEVICE double min_p_of_row(SamplerParams const& p, int64_t row) { return p.min_ps ? p.min_ps[row] : p.min_p; }

// Whether stage 2 selects a host top_k in (kMaxFusedTopK, kMaxFusedLargeTopK] in shared memory
// (truncate_candidates.cu: select_large_top_k_kernel), deciding every row: its repairs read the
// stored logits (row_logits) or the runs' keys (large_top_k_run_keys), and no row is left to the
// logits sampler.
inline bool fused_truncation_selects_large_top_k(SamplerParams const& p) {
  return p.top_ks == nullptr && p.top_k > kMaxFusedTopK && p.top_k <= kMaxFusedLargeTopK;
}

// Tokens of a run of the large top_k's run keys (SamplerParams::large_top_k_run_keys: the
// epilogue-warpgroup scan's runs), and a row's runs (the last may be partial).
constexpr int kRunKeysRunTokens = 16;
FS_HOST_DEVICE int64_t large_top_k_runs(SamplerParams const& p) {
  return (p.vocab_size + kRunKeysRunTokens - 1) / kRunKeysRunTokens;
}

// Whether the fused truncation's stage 2 hands the top_p rows it cannot decide to the logits
// sampler's streaming kernels (LogitsSamplerParams::streamed_first_y): in a call of top_p without
// top_k, one sample and no log-probabilities. With a top_k tensor they take the row list: such
// calls (serving defaults) rarely leave a row, and would pay for the streaming kernels' launches
// whether or not one streams (docs/truncation.md).
inline bool fused_truncation_streams_top_p_rows(SamplerParams const& p) {
  return call_may_cut_top_p(p) && p.top_ks == nullptr && p.top_k < 1 && p.num_samples == 1 && !p.logprobs;
}

// Whether stage 2 may hand some of the rows it leaves to the logits sampler's streaming kernels
// rather than its row list: rows without top_k whose first y stage 2 knows, cut by min_p alone
// (a comparison an element) or by top_p (fused_truncation_streams_top_p_rows; the streaming
// pass's winner, verified in rounds).
inline bool fused_truncation_streams_rows(SamplerParams const& p) {
  bool const rows_without_top_k = p.top_ks != nullptr || p.top_k < 1;
  bool const rows_without_top_p = p.top_ps != nullptr || !(p.top_p < 1.0);
  return p.fallback_rows != nullptr && rows_without_top_k &&
         ((call_may_cut_min_p(p) && rows_without_top_p) || fused_truncation_streams_top_p_rows(p));
}

// Whether the fused truncation's GEMM may draw the tile winners (SamplerParams::draw_tile_winners)
// for a call: rows handed on by top_p alone (no top_k, no min_p: the winner over every allowed
// token is then the first winner the rounds verify), a host top_k above kMaxFusedLargeTopK alone (one
// sample, no log-probabilities: the winner is the sample when it lies among the row's first
// tokens, which stage 2 selects), or the plain sample of a top-N logprobs call (one sample), and
// the batch-wide noise key of plain sampling, whose Philox block serves four neighbouring rows.
// The kernel must scan for them too (sampler_dispatch.cu: the CUTLASS schedules' top-k scan on
// sm90).
inline bool fused_truncation_draws_tile_winners(SamplerParams const& p) {
  bool const min_p = call_may_cut_min_p(p);
  bool const per_row_keys =
      p.noise.row_seeds != nullptr || p.noise.row_offsets != nullptr || p.noise.row_streams != nullptr;
  bool const top_logprobs = p.top_logprobs.top_n >= 0 && p.num_samples == 1;
  bool const large_top_k_alone = p.top_ks == nullptr && p.top_k > kMaxFusedLargeTopK && !call_may_cut_top_p(p) &&
                                 !min_p && p.num_samples == 1 && !p.logprobs;
  return ((fused_truncation_streams_rows(p) && fused_truncation_streams_top_p_rows(p) && !min_p) || top_logprobs ||
          large_top_k_alone) &&
         !per_row_keys;
}

// Per-(vocabulary tile, batch row) candidate, packed so that a plain unsigned max
// realises the total order of philox_gumbel.h (score desc, index asc, NaN last).
//   hi 32 bits: order-preserving bits of the fp32 score (NaN -> 0)
//   lo 32 bits: ~vocab_index
using PackedCandidate = unsigned long long;

// Variants of the dispatch that give the same tokens, for tests that compare them
// (flashsampling::_set_dispatch_options, CUDA builds): each default is what runs.
struct DispatchOptions {
  bool column_clusters = true;  // pairs of 128-wide column tiles sharing each W tile (kernel_choice.h)
  bool pad_columns = true;      // hidden rows padded to whole N tiles where the last is at most half full
  bool noise_skip = true;       // the epilogue-warpgroup kernels skip noise that cannot win
  bool lse_references = true;   // and sum log-sum-exp terms against earlier tiles' (else each step's max)
  // the fused top-k pass on sm90 runs the epilogue-warpgroup kernel beyond 64 columns, and from 33
  // where it draws no tile winners (else CUTLASS's cooperative / 64-wide pingpong tile, whose
  // visitor's tokens and scores it reproduces bit for bit; kernel_choice.h)
  bool top_candidates_epilogue_warpgroups = true;
  // the fused truncation's top_p calls draw each tile's winner in the top-k scan where they may
  // (fused_truncation_draws_tile_winners; else the streaming pass samples those rows)
  bool top_p_tile_winners = true;
  // plain passes of 129-192 columns on three 64-wide column tiles (kernel_choice.h's
  // narrow_ragged_column_tiles; else two 128-wide tiles)
  bool narrow_ragged_columns = true;
  // a fused truncation call of top_p alone beyond 32 rows runs plain sampling's pass, which
  // stores the logits, and the rounds verify each row's plain token (SamplerParams::
  // truncation_on_plain_pass; else the top-k scan and stage 2) ...
  bool top_p_on_plain_pass = true;
  // ... and so does one of min_p alone, whose rows keep their plain token where it passes min_p
  // and else take the streaming pass over their survivors
  bool min_p_on_plain_pass = true;
  // on the plain pass, the reduction keeps the top_p rows whose winner is their first token
  // (SamplerParams::first_winners_in_reduction; else round 0 verifies every top_p row)
  bool first_winners_in_reduction = true;
  // top_p or min_p alone up to 32 rows runs the plain pass too where the call takes the plain loop
  // (a host temperature, no mask or bias, the batch-wide seed): CUTLASS's narrow plain tiles store
  // the logits (epilogue/sm90_visitor_gumbel_argmax.hpp: kStoresPlainLogits); else the top-k scan
  bool narrow_plain_pass = true;
  // min_p alone on the plain pass at 33-64 GEMM columns (the plain loop): the epilogue keeps each
  // tile's best among the tokens that may pass min_p, and the reduction samples most rows from
  // those (SamplerParams::min_p_filtered_winners; else the tiles' plain winners and the streaming
  // pass)
  bool min_p_filtered_winners = true;
};
// Process-wide; read at each launch (host), so a CUDA graph keeps the options it was captured with.
void set_sampler_dispatch_options(const DispatchOptions& options);
DispatchOptions sampler_dispatch_options();

// Bytes of device workspace launch_sampler needs for these parameters (candidates
// of every vocabulary tile plus CUTLASS's own workspace). Depends only on shapes.
size_t sampler_workspace_bytes(const SamplerParams& params, int device_arch);

// Runs the fused GEMM + Gumbel-argmax and the reduction over vocabulary tiles on
// `stream`. device_arch is 90 or 100 (major*10 + minor of the running GPU).
// Returns cudaErrorNotSupported for architectures this build has no kernel for.
cudaError_t launch_sampler(const SamplerParams& params, void* workspace, size_t workspace_bytes,
                           int device_arch, cudaStream_t stream);

// Whether the fused top-k pass's stage 2 holds this vocabulary's candidates (its shared memory
// bounds V, ~300K tokens on sm90); false: the caller takes the logits path.
bool fused_top_k_fits(const SamplerParams& params, int device_arch);

// Whether the call's GEMM stores its 16-token runs' largest keys in place of x
// (SamplerParams::large_top_k_run_keys): the caller then gives no row_logits.
bool sampler_stores_run_keys(const SamplerParams& params, int device_arch);

// Which architectures this build compiled kernels for (e.g. "sm90a,sm100a").
const char* sampler_compiled_archs();

}  // namespace flashsampling
