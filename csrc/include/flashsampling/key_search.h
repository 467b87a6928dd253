// Torch-free description of the truncation cut's radix search over order keys
// (flashsampling_cuda/shard_truncation.py has the semantics and runs the rounds; the CUDA
// kernels are csrc/kernels/key_search.cu, the binding csrc/torch/key_search_cuda.cpp).
//
// A token's order key places it in a row's truncation order, smaller first: (rank of y + 2^31)
// << 31 | global id, the rank of y descending (an allowed NaN after every number, -0 as +0) with
// ties to the smaller id; an excluded token has no key. A search finds one key per row 8 bits a
// round from the top: each round every shard histograms its keys within the range found so far,
// the caller sums the histograms over the shards, and the next round's kernel picks the bin from
// the sum (every shard the same bin), so a round is one kernel and one all-reduce. A row whose
// chosen bin holds a single key is complete: the histogram's third plane gives that key (the
// bin's sum of keys, wrapping, which is the key where the bin's count is 1), and its later rounds
// read nothing (a flat row's cut after three rounds of eight).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace flashsampling {

constexpr int kKeySearchDigitBits = 8;
constexpr int kKeySearchBins = 1 << kKeySearchDigitBits;
// The search's per-row state, int64 words: the key bits found so far (the whole key once
// complete); for top_k the rank still needed within the range, for top_p the mass ahead of the
// range; top_p's total mass; whether the key exists (1), not (0), or not yet known
// (kKeySearchUnknown, before the first choice); whether the key is complete (1) or not (0).
constexpr int kKeySearchStateWords = 5;
enum KeySearchStateWord { kStatePrefix = 0, kStateNeedOrAhead = 1, kStateTotal = 2, kStateFound = 3, kStateComplete = 4 };
// A round's histogram planes, int64 [B, 3, 256]: counts, top_p's masses, lone keys (above).
constexpr int kKeySearchPlanes = 3;
constexpr int64_t kKeySearchUnknown = 2;
// Masses relative to the row's first token in fixed point (logits_rows.cuh: fixed_mass): sums
// of at most this many tokens a row stay below 2^63.
constexpr int64_t kKeySearchMaxVocab = int64_t{1} << 21;

// The rows every kernel reads: y [B, V] fp32 (the transformed logits, unit stride along V),
// the allowed tokens (bit v & 31 of word v >> 5; null: all) and the global id of column 0. With
// row_scales the stored values are x and y = fl32(x * row_scales[b]) (fl32(1 / T_b), 1 on a
// greedy row): the caller need not write y.
struct KeySearchRows {
  const float* y = nullptr;
  const float* row_scales = nullptr;  // [B] or null
  int64_t row_stride = 0;
  int64_t batch_size = 0;
  int64_t vocab_size = 0;
  int64_t vocab_start = 0;
  const uint32_t* allowed_mask = nullptr;
  int64_t mask_words = 0;
};

// One round of a search. Before the histogram, the kernel takes the round's range from the
// previous round's summed histogram (hist_in; null at the first round, whose range is every key):
//   top_k (top_ps null): the bin holding the `need`-th key; found where the keys number at
//     least top_ks[b] (>= 1);
//   top_p (top_ps set): the last bin holding a key whose mass ahead is below top_p of the total
//     (the total: the first histogram's sum); found where some key is.
// A row whose chosen bin holds one key takes it whole (complete). Then, where shift >= 0 and the
// row is not complete, it histograms the keys whose bits above `shift + 8` equal the prefix and
// that are at most limit[b] (where given): counts, and for top_p their masses, fixed_mass(y, y0[b])
// (0 where y0 is not finite), only for min_p's survivors where min_ps is given (exp(y - y0) >=
// min_p in float64, or the key first[b]). shift < 0: the choice only (the last round).
struct KeySearchRound {
  KeySearchRows rows;
  int shift = 56;
  const int64_t* top_ks = nullptr;  // [B] >= 1, top_k's target
  const double* top_ps = nullptr;   // [B], top_p's target
  const int64_t* state_in = nullptr;          // [B, 5], null at the first round
  const int64_t* hist_in = nullptr;           // [B, 3, 256], summed over the shards
  int64_t* state_out = nullptr;               // [B, 5]
  unsigned long long* hist_out = nullptr;     // [B, 3, 256], zeroed; null where shift < 0
  const int64_t* limit = nullptr;             // [B] or null
  const float* y0 = nullptr;                  // [B], the row's first y (top_p)
  const double* min_ps = nullptr;             // [B] or null
  const int64_t* first = nullptr;             // [B] first keys (with min_ps)
};

// The survivors' bitmask: allowed, key <= cut[b], and (min_ps given) min_p's test or the first key.
struct KeyCutMask {
  KeySearchRows rows;
  const int64_t* cut = nullptr;     // [B]
  const int64_t* first = nullptr;   // [B] or null: used only with min_ps
  const float* y0 = nullptr;        // [B] or null: used only with min_ps
  const double* min_ps = nullptr;   // [B] or null
  uint32_t* mask = nullptr;         // [B, mask_words]
};

// first[b] = the row's smallest key (every entry must hold INT64_MAX on entry: the value of a row
// with no allowed token).
cudaError_t launch_first_order_keys(KeySearchRows const& rows, int64_t* first, int sm_count, cudaStream_t stream);
cudaError_t launch_key_search_round(KeySearchRound const& round, int sm_count, cudaStream_t stream);
cudaError_t launch_key_cut_mask(KeyCutMask const& cut, int sm_count, cudaStream_t stream);

}  // namespace flashsampling
