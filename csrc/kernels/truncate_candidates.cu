// Stage 2 of the fused top-k pass (SamplerLoop::kTopCandidates): one block per batch row, in one
// of two kernels. truncate_candidates_kernel (below) takes every call but one with a host top_k
// in (kMaxFusedTopK, kMaxFusedLargeTopK], which select_large_top_k_kernel (at the end) takes: the
// same steps 2-3 over every key with the survivors kept in shared memory (sorted for top_p), then
// step 4. Two kernels, because the second's code in the first made the first's
// other rows slower (docs/truncation_kernels.md).
//
// Stage 1 left, per (vocabulary tile, row), the tile's kTopCandidatesPerTile (C) largest
// transformed logits x as keys (candidate_math.cuh, pack_top_candidate). The row's top_k by
// the truncation order (y = fl(x * fl(1 / T)) descending, ties to the smaller index;
// flashsampling_cuda/truncation.py) lies in the union of the tiles' lists unless some tile
// holds more than C of them. Here:
//
//  1. a lower bound tau on the k-th key: the smallest of k group maxima of the tiles' first
//     keys (k keys of distinct tiles are >= tau), so only tiles whose first key reaches tau
//     are read and only their keys >= tau kept (typically a few hundred of C * tiles);
//  2. the k-th largest key kappa of those (radix select, 8 bits per pass, in shared memory);
//  3. the certificate: a tile whose C-th key is >= kappa (or ties kappa's y while the scale
//     x -> y can merge neighbouring x) may hide more of the top_k; such tiles' logits are
//     recomputed (dot products, fp32) and their full lists take the place of their C keys,
//     a few tiles per round, keeping the k best after each. Exact whatever the data: the
//     top_k lie in the union once every tile is either certified or recomputed;
//  4. top-p and min-p over the <= k survivors (float64 probabilities, as truncation.py), then
//     for each sample the Gumbel-Max winner among the kept survivors with the noise of plain
//     sampling (fs_gumbel_noise of the token's global id), and the log-probabilities of the
//     truncated, renormalised distribution.
// A row without top_k is selected as if k were kMaxFusedTopK, and decided here when its top_p /
// min_p cut falls among those tokens. Where the tiles' first keys and log-masses already show
// that every one of them survives the cut (a flat row: thousands of survivors), the row is handed
// on before steps 1-4, which would only find that out. A row of flashsampling._sample_top_logprobs
// (nothing on) is selected the same way, and its top-N log-probabilities and the rank of its
// sample (the GEMM's tile winner) are read off those tokens where they certify them
// (finish_top_logprob_row).
#include <algorithm>
#include <cstdint>

#include <cuda_fp16.h>

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/top_logprobs.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int C = kTopCandidatesPerTile;
constexpr int kRepairTiles = 8;  // tiles recomputed per repair round
constexpr int kTileLoads = 5;    // tiles whose candidate lists a thread loads at once
// Dynamic shared memory of one block: keys (8 bytes) and x (4 bytes) per working entry, and
// per tile its last key and the y bits of its first (read once from global memory).
constexpr size_t kBytesPerEntry = sizeof(PackedCandidate) + sizeof(float);
constexpr size_t kBytesPerTile = sizeof(PackedCandidate) + sizeof(uint32_t);
// Up to this many entries are ranked directly (two per thread, every pair compared: cheaper
// than eight radix passes for the few hundred keys >= tau a row usually has).
constexpr int kRankDirectly = 2 * kThreads;
constexpr size_t kMaxDynamicSmem = 216 * 1024;

struct Stage2Shared {
  unsigned hist[256];
  PackedCandidate group_max[kMaxFusedTopK];
  PackedCandidate survivor_key[kMaxFusedTopK];
  float survivor_x[kMaxFusedTopK];
  PackedCandidate sorted_key[kMaxFusedTopK];
  float sorted_x[kMaxFusedTopK];
  int repair_tiles[kThreads];
  double warp_mass[kWarps];
  PackedCandidate warp_winner[kWarps];
  uint32_t first_y_bits;  // order bits of the row's first y (the largest of the tiles' first)
  int tiles_with_token;   // tiles whose list is not empty
  int min_p_tiles;        // tiles whose first token passes min_p
  int tiles_ahead;        // tiles whose first y is above the winner's (a row with a large top_k)
  int count, survivors, repair_count, digit;
  int runs_listed;  // select_large_top_k_kernel: runs whose tokens a repair round recomputes
  unsigned remaining;
};

// The truncation key of a stage-1 key: x -> y = fl(x * inv_t) (greedy rows: y = x), index kept.
__device__ __forceinline__ PackedCandidate y_key(PackedCandidate x_key, float inv_t, bool greedy) {
  uint32_t const hi = static_cast<uint32_t>(x_key >> 32);
  if (hi <= 1u || greedy) return x_key;  // no token, NaN, or y = x
  float const y = fs_mul(from_order_bits(hi), inv_t);
  return (static_cast<PackedCandidate>(order_bits(y)) << 32) | static_cast<uint32_t>(x_key);
}

// A slot of `counter` for each lane of the warp that wants one, with one atomic a warp (a
// shared counter takes its atomics one after another). Every lane of the warp calls it.
__device__ __forceinline__ int warp_claim_slot(int* counter, bool wants) {
  unsigned const wanting = __ballot_sync(0xFFFFFFFFu, wants);
  int const lane = threadIdx.x % 32, leader = __ffs(wanting) - 1;
  int first = 0;
  if (lane == leader) first = atomicAdd(counter, __popc(wanting));
  first = __shfl_sync(0xFFFFFFFFu, first, leader < 0 ? 0 : leader);
  return first + __popc(wanting & ((1u << lane) - 1u));
}

// The k-th largest of keys[0, n) (block-wide; 0 when n < k): eight passes of an 8-bit digit
// histogram, each narrowing the prefix of the k-th key. kVoteDigits: a warp whose counted keys
// share the digit counts them with one atomic (thousands of keys, whose first digits, the sign
// and exponent of y, most share: one counter's atomics run one after another); else one a key;
// and once one key is left with the prefix (usually after y's 32 bits), it is found in one pass.
// kDigits < 8 stops after that many: the k-th key's prefix with zeros below, a lower bound on it.
template <bool kVoteDigits = false, int kDigits = 8>
__device__ PackedCandidate block_kth_largest(PackedCandidate const* keys, int n, int k, Stage2Shared& sh) {
  __shared__ unsigned digit_keys;    // kVoteDigits: keys with the prefix and the k-th key's digit
  __shared__ PackedCandidate found;  // kVoteDigits: the one key left
  if (n < k) return 0;
  PackedCandidate prefix = 0, prefix_mask = 0;
  unsigned remaining = static_cast<unsigned>(k);
  for (int shift = 56; shift >= 64 - 8 * kDigits; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kThreads) sh.hist[i] = 0;
    __syncthreads();
    if constexpr (kVoteDigits) {
      for (int base = 0; base < n; base += kThreads) {
        int const i = base + threadIdx.x;
        PackedCandidate const key = i < n ? keys[i] : 0;
        bool const counted = i < n && (key & prefix_mask) == prefix;
        unsigned const digit = static_cast<unsigned>((key >> shift) & 255u);
        unsigned const counting = __ballot_sync(0xFFFFFFFFu, counted);
        if (counting == 0u) continue;
        int const leader = __ffs(counting) - 1;
        unsigned const leader_digit = __shfl_sync(0xFFFFFFFFu, digit, leader);
        if (__all_sync(0xFFFFFFFFu, !counted || digit == leader_digit)) {
          if (static_cast<int>(threadIdx.x % 32) == leader) atomicAdd(&sh.hist[leader_digit], __popc(counting));
        } else if (counted) {
          atomicAdd(&sh.hist[digit], 1u);
        }
      }
    } else {
      for (int i = threadIdx.x; i < n; i += kThreads) {
        PackedCandidate const key = keys[i];
        if ((key & prefix_mask) == prefix) atomicAdd(&sh.hist[(key >> shift) & 255u], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8l .. 248 - 8l, from the top: the first lane whose running
      // count reaches `remaining` holds the k-th key's digit.
      int const lane = threadIdx.x;
      unsigned count[8], total = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        count[j] = sh.hist[255 - 8 * lane - j];
        total += count[j];
      }
      unsigned inclusive = total;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        unsigned const other = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
        if (lane >= d) inclusive += other;
      }
      int const owner = __ffs(__ballot_sync(0xFFFFFFFFu, inclusive >= remaining)) - 1;
      if (lane == owner) {
        unsigned before = inclusive - total;
        for (int j = 0; j < 8; ++j) {
          if (before + count[j] >= remaining) {
            sh.digit = 255 - 8 * lane - j;
            sh.remaining = remaining - before;
            if constexpr (kVoteDigits) digit_keys = count[j];
            break;
          }
          before += count[j];
        }
      }
    }
    __syncthreads();
    prefix |= static_cast<PackedCandidate>(sh.digit) << shift;
    prefix_mask |= PackedCandidate{0xFF} << shift;
    remaining = sh.remaining;
    if constexpr (kVoteDigits) {
      if (digit_keys == 1u && shift > 0) {
        for (int i = threadIdx.x; i < n; i += kThreads) {
          if ((keys[i] & prefix_mask) == prefix) found = keys[i];
        }
        __syncthreads();
        PackedCandidate const kth = found;
        __syncthreads();  // read before a later call writes it
        return kth;
      }
    }
    __syncthreads();
  }
  return prefix;
}

// Keeps the entries of keys/xs[0, n) with key >= threshold and not `excluded`, at the front
// (through the survivor arrays: at most kMaxFusedTopK of them). Returns their count.
template <class Excluded>
__device__ int block_keep_at_least(PackedCandidate* keys, float* xs, int n, PackedCandidate threshold,
                                   Excluded const& excluded, Stage2Shared& sh) {
  if (threadIdx.x == 0) sh.survivors = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kThreads) {
    PackedCandidate const key = keys[i];
    if (key != 0 && key >= threshold && !excluded(key)) {
      int const at = atomicAdd(&sh.survivors, 1);
      if (at < kMaxFusedTopK) {
        sh.survivor_key[at] = key;
        sh.survivor_x[at] = xs[i];
      }
    }
  }
  __syncthreads();
  int const kept = min(sh.survivors, kMaxFusedTopK);
  for (int i = threadIdx.x; i < kept; i += kThreads) {
    keys[i] = sh.survivor_key[i];
    xs[i] = sh.survivor_x[i];
  }
  __syncthreads();
  return kept;
}

// Keeps the entries of keys/xs[0, n) with key >= threshold and not `excluded` at the front, in
// place and in any order (a row with a large top_k: up to kMaxFusedLargeTopK of them): each step
// of kCompactLoads * kThreads entries is read before its survivors are written, and the survivors
// so far never outnumber the entries read. Returns their count. A step a barrier: the pass's cost
// is its steps' latency, not its work.
constexpr int kCompactLoads = 4;
template <class Excluded>
__device__ int block_compact_at_least(PackedCandidate* keys, float* xs, int n, PackedCandidate threshold,
                                      Excluded const& excluded, Stage2Shared& sh) {
  if (threadIdx.x == 0) sh.survivors = 0;
  for (int base = 0; base < n; base += kCompactLoads * kThreads) {
    PackedCandidate key[kCompactLoads];
    float x[kCompactLoads];
#pragma unroll
    for (int j = 0; j < kCompactLoads; ++j) {
      int const i = base + j * kThreads + threadIdx.x;
      key[j] = i < n ? keys[i] : 0;
      x[j] = i < n ? xs[i] : 0.0f;
    }
    __syncthreads();  // the step is read (and the count zeroed) before survivors are written
#pragma unroll
    for (int j = 0; j < kCompactLoads; ++j) {
      bool const keep = key[j] != 0 && key[j] >= threshold && !excluded(key[j]);
      int const at = warp_claim_slot(&sh.survivors, keep);
      if (keep) {
        keys[at] = key[j];
        xs[at] = x[j];
      }
    }
  }
  __syncthreads();
  int const kept = sh.survivors;
  __syncthreads();  // read before the next call zeroes it
  return kept;
}

// Whether a tile whose list's C-th key is `last` may hide more keys >= kappa than its list: it
// has C tokens and the C-th reaches kappa, or ties kappa's y where the scale x -> y can merge
// neighbouring x (a token past the list with x below the C-th, y equal to kappa's and a smaller
// index than kappa's; the tile's tokens start at global id `tile_start`).
__device__ __forceinline__ bool tile_may_hide_more(PackedCandidate last, PackedCandidate kappa, bool scale_exact,
                                                   uint32_t tile_start) {
  if (last == 0) return false;  // fewer than C tokens: the tile's list is complete
  if (kappa == 0 || last >= kappa) return true;
  if (!scale_exact && static_cast<uint32_t>(last >> 32) == static_cast<uint32_t>(kappa >> 32)) {
    return tile_start < top_candidate_index(kappa);
  }
  return false;
}

__device__ __forceinline__ float element_to_float(uint16_t bits, ElementType type) {
  return type == ElementType::kBFloat16 ? __uint_as_float(static_cast<uint32_t>(bits) << 16)
                                        : __half2float(__ushort_as_half(bits));
}

// fp32 dot product of weight row v and hidden row `row` (warp-wide; D is a multiple of 8 and
// rows are 16-byte aligned, as the GEMM's TMA requires). The weight row comes from memory (the
// GEMM streamed it long ago): the unrolled loop keeps four of a lane's loads in flight.
__device__ float warp_dot(SamplerParams const& p, int64_t v, int64_t row) {
  int const lane = threadIdx.x % 32;
  auto const* w = reinterpret_cast<uint16_t const*>(p.weight) + v * p.weight_row_stride;
  auto const* h = reinterpret_cast<uint16_t const*>(p.hidden) + row * p.hidden_row_stride;
  float sum = 0.0f;
#pragma unroll 4
  for (int64_t d = int64_t{lane} * 8; d < p.hidden_dim; d += 32 * 8) {
    uint4 const wv = *reinterpret_cast<uint4 const*>(w + d);
    uint4 const hv = *reinterpret_cast<uint4 const*>(h + d);
    uint32_t const wa[4] = {wv.x, wv.y, wv.z, wv.w}, ha[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      sum = fmaf(element_to_float(static_cast<uint16_t>(wa[j]), p.element_type),
                 element_to_float(static_cast<uint16_t>(ha[j]), p.element_type), sum);
      sum = fmaf(element_to_float(static_cast<uint16_t>(wa[j] >> 16), p.element_type),
                 element_to_float(static_cast<uint16_t>(ha[j] >> 16), p.element_type), sum);
    }
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, delta);
  return sum;
}

// x of token v (local id) of row `row` recomputed from the weight (warp_dot, then the dense bias as
// the GEMM adds it), for a tile or run whose stored keys may hide more of a top k; false where the
// mask excludes the token, before its dot product (a row whose mask leaves fewer than k tokens
// recomputes every tile or run that holds four of them). Warp-wide: every lane gets the same.
__device__ bool recomputed_logit(SamplerParams const& p, int64_t v, int64_t row, float& x) {
  SamplingControls const& c = p.controls;
  if (c.allowed_mask && !((c.allowed_mask[row * c.mask_words + (v >> 5)] >> (v & 31)) & 1u)) return false;
  x = warp_dot(p, v, row);
  if (c.logit_bias) x = fs_add(x, c.logit_bias[v]);
  return true;
}

// Hands the row to the logits sampler (SamplerParams::fallback_rows); thread 0 of the block.
__device__ void leave_to_logits_sampler(SamplerParams const& p, int64_t row) {
  if (p.fallback_rows == nullptr) return;  // the binding gives the buffer wherever a row may need it
  append_to_row_list(p.fallback_rows, row);
}

// The row's probability mass relative to the first token's, sum of exp(y - y0) over every
// allowed token, from the GEMM's per-tile log-masses of y in log2 units (block-wide; here a copy
// in shared memory); of x about any reference y0 where the masses are of x (raw mode).
__device__ double block_row_mass(float2 const* tile_log_masses, int64_t num_tiles, double y0, Stage2Shared& sh) {
  double const y0_2 = y0 * 1.4426950408889634;
  double mass = 0.0;
  for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) {
    float2 const part = tile_log_masses[t];
    if (part.y > 0.0f) mass += static_cast<double>(part.y) * exp2(static_cast<double>(part.x) - y0_2);
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) mass += __shfl_xor_sync(0xFFFFFFFFu, mass, delta);
  if (threadIdx.x % 32 == 0) sh.warp_mass[threadIdx.x / 32] = mass;
  __syncthreads();
  double total = 0.0;
  for (int w = 0; w < kWarps; ++w) total += sh.warp_mass[w];  // every thread, the same order
  return total;
}

// The row's log-sum-exp from the GEMM's per-tile log-masses (log2 units: part.x the tile's largest
// value, part.y its sum of 2^(value - part.x)), about the largest part: +inf where a tile holds
// +inf, -inf where none holds mass. Block-wide; every thread gets the same value.
__device__ double block_row_log_sum_exp(float2 const* tile_log_masses, int64_t num_tiles, Stage2Shared& sh) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float top2 = -INFINITY;  // a tile with +inf has part (+inf, NaN): its x alone counts here
  for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) {
    float2 const part = tile_log_masses[t];
    if (part.y > 0.0f || part.x == INFINITY) top2 = fmaxf(top2, part.x);
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) top2 = fmaxf(top2, __shfl_xor_sync(0xFFFFFFFFu, top2, delta));
  if (lane == 0) sh.warp_mass[warp] = top2;
  __syncthreads();
  double ref2 = -INFINITY;
  for (int w = 0; w < kWarps; ++w) ref2 = fmax(ref2, sh.warp_mass[w]);
  __syncthreads();  // every thread has read the maxima before the sums overwrite them
  if (!isfinite(ref2)) return ref2;
  double const mass = block_row_mass(tile_log_masses, num_tiles, ref2 * 0.6931471805599453, sh);
  return ref2 * 0.6931471805599453 + log(mass);
}

// The noise coordinates of a row's samples: the batch-wide seed (stream = row) or the row's own
// (stream 0); sample s draws token v's noise at (key.seed, key.offset, key.stream, s, v).
__device__ __forceinline__ RowNoiseKey sample_noise_key(SamplerParams const& p, int64_t row) {
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  return row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(row), /*sample=*/0);
}

// The best of the survivors a thread offers to one sample: the perturbed score (x where greedy),
// the token and its y.
struct SampleBest {
  float score = -INFINITY;
  int32_t index = kNoCandidate;
  double y = 0.0;
  __device__ __forceinline__ void offer(uint32_t token, float x, double token_y, int sample, bool greedy, float inv_t,
                                        RowNoiseKey const& key) {
    float const token_score =
        greedy ? x
               : fs_perturbed_score(
                     x, inv_t, fs_gumbel_noise(key.seed, key.offset, key.stream, static_cast<uint32_t>(sample), token));
    if (fs_candidate_better(token_score, static_cast<int32_t>(token), score, index)) {
      score = token_score;
      index = static_cast<int32_t>(token);
      y = token_y;
    }
  }
};

// The perturbed score of token `index` (global) in sample 0, from the x the GEMM stored, as plain
// sampling computes it (bit for bit: a packed candidate's score folds -0 into +0).
__device__ float stored_score(SamplerParams const& p, int64_t row, uint32_t index) {
  float const x = p.row_logits[row * p.row_logits_stride + (index - p.vocab_start)];
  float const inv_t = row_inv_temperature(p.controls, static_cast<uint32_t>(row), p.inv_temperature);
  if (inv_t == 0.0f) return x;
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  RowNoiseKey const key = row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(row), 0);
  return fs_perturbed_score(x, inv_t, fs_gumbel_noise(key.seed, key.offset, key.stream, 0u, index));
}

__device__ __forceinline__ PackedCandidate max_key(PackedCandidate a, PackedCandidate b) { return a > b ? a : b; }

// The block's largest of each thread's `key` (every thread gets it).
__device__ PackedCandidate block_max_key(PackedCandidate key, Stage2Shared& sh) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) key = max_key(key, __shfl_xor_sync(0xFFFFFFFFu, key, delta));
  if (threadIdx.x % 32 == 0) sh.warp_winner[threadIdx.x / 32] = key;
  __syncthreads();
  key = 0;
  for (int w = 0; w < kWarps; ++w) key = max_key(key, sh.warp_winner[w]);
  return key;
}

// The k-th largest of keys[0, n) (distinct and nonzero; 0 when n < k) where n is k and a few more,
// as after a repair round of select_large_top_k_kernel adds a few tokens to the k it kept: the
// (n - k + 1)-th smallest, one block-wide minimum over the keys above the last a step, where a
// select takes four barriers a digit. Far more than k keys take block_kth_largest.
constexpr int kMaxMinimumSteps = 16;
__device__ PackedCandidate block_kth_largest_near_bottom(PackedCandidate const* keys, int n, int k, Stage2Shared& sh) {
  if (n < k) return 0;
  int const steps = n - k + 1;
  if (steps > kMaxMinimumSteps) return block_kth_largest<true>(keys, n, k, sh);
  PackedCandidate last = 0;  // below every key
  for (int step = 0; step < steps; ++step) {
    PackedCandidate mine = 0;  // the complement of this thread's smallest key above `last`
    for (int i = threadIdx.x; i < n; i += kThreads) {
      PackedCandidate const key = keys[i];
      if (key > last) mine = max_key(mine, ~key);
    }
    last = ~block_max_key(mine, sh);
    __syncthreads();  // the warps' values are read before the next step writes them
  }
  return last;
}

// The row's plain-sampling winner over every allowed token, the best of the GEMM's tile winners
// (draw_tile_winners; pack_candidate, 0: none), block-wide.
__device__ PackedCandidate block_row_winner(PackedCandidate const* __restrict__ tile_winners, int64_t num_tiles,
                                            int64_t columns, int64_t row, Stage2Shared& sh) {
  PackedCandidate best = 0;
  for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) best = max_key(best, tile_winners[t * columns + row]);
  return block_max_key(best, sh);
}

// A row without top_k whose first kMaxFusedTopK tokens all survive its cut, so that more may
// follow past them (one thread). With min_p alone (in (0, 1] here: a larger or NaN one keeps the
// first token only) the rest is one comparison an element against the first y, which the
// streaming kernels can take; with top_p (in (0, 1) here) they sample the row from its first y
// and verify the winner against top_p in rounds, in the calls of
// fused_truncation_streams_top_p_rows. Where the GEMM drew the winners (a call without min_p: no
// pass runs) a row takes the streaming kernels only with its winner (none: a row without a finite
// score, which the cut kernel reports). Every other such row goes to the cut kernel.
__device__ void hand_on_undecided_row(SamplerParams const& p, int64_t row, float first_y, double top_p, bool top_p_on,
                                      bool streams_top_p_rows, float* streamed_first_y,
                                      PackedCandidate const* tile_winners, PackedCandidate* streamed_winners,
                                      PackedCandidate winner) {
  bool const streams_top_p = streams_top_p_rows && top_p > 0.0;
  bool const with_winner = tile_winners == nullptr || winner != 0;
  if (streamed_first_y != nullptr && (!top_p_on || streams_top_p) && with_winner) {
    streamed_first_y[row] = first_y;
    if (streamed_winners != nullptr) streamed_winners[row] = winner;
  } else {
    leave_to_logits_sampler(p, row);
  }
}

// An upper bound of every x whose y = fl32(x * inv_t) is at most `last_y`: `last_x` where y = x
// (greedy rows, scale 1); else x * inv_t rounds to last_y or below only under the next float
// above it, so x < next / inv_t, taken up by a margin far above the double division's rounding
// (x is a float).
__device__ double raw_x_bound(float last_x, float last_y, float inv_t) {
  if (inv_t == 0.0f || inv_t == 1.0f) return last_x;
  double const bound = static_cast<double>(nextafterf(last_y, INFINITY)) / static_cast<double>(inv_t);
  return bound + fabs(bound) * 0x1p-50;
}

// A row of flashsampling._sample_top_logprobs (warp 0; SamplerParams::top_logprobs), its first
// m tokens by the order of y sorted in sh (m < kMaxFusedTopK: a row with fewer tokens). Its sample
// is the GEMM's tile winner; its log-sum-exp lse is that of the GEMM's per-tile log-masses:
// y0 + log(row_mass) (processed), or `raw_lse` (raw mode: the masses are of x). Every token past
// the list has y <= the list's last y, hence a value t no larger than a bound: processed,
// t = fl32(y - fl32(lse)) is monotone in y, so the last entry's t; raw, t = fl32(fl64(x) -
// fl64(fl32(lse))) is monotone in x, and y <= the last y bounds x (raw_x_bound). The list's first
// N in the order of t (t descending, exact ties to the smaller id) are the row's when the N-th's t
// is above the bound, and the sample's rank is its position there when its own t is. What that
// does not certify (ties of t at the bound, a sample past it: a flat row), and the whole row
// where something is missing (a winner, a finite first y or lse, a valid temperature; NaN logits
// in the list), row_modes leaves to the top-N kernels, which the logits sampler's sample of an
// undecided row precedes. NaN logits past the list are not seen here (the sampler never draws
// them, and the log-masses carry none); the top-N kernels, where they take a row, order NaN first.
__device__ void finish_top_logprob_row(SamplerParams const& p, int64_t row, Stage2Shared& sh, int m,
                                       bool row_usable, double row_mass, double raw_lse, PackedCandidate winner,
                                       float inv_t) {
  TopLogprobRows const& out = p.top_logprobs;
  bool const raw = out.raw_logsumexp != nullptr;
  int const lane = threadIdx.x % 32;
  bool const greedy = inv_t == 0.0f;
  if (lane == 0) out.row_scales[row] = greedy ? 1.0f : inv_t;
  bool valid[2], nan_entry = false;
  float x[2], y[2];
  uint32_t local[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int const i = lane + 32 * h;
    valid[h] = i < m;
    uint32_t const hi = valid[h] ? static_cast<uint32_t>(sh.sorted_key[i] >> 32) : 0u;
    nan_entry = nan_entry || (valid[h] && hi <= 1u);
    // y from x as the reference scales it (the keys fold -0 into +0; t keeps the sign of 0)
    x[h] = valid[h] ? sh.sorted_x[i] : -INFINITY;
    y[h] = greedy || !valid[h] ? x[h] : fs_mul(x[h], inv_t);
    local[h] = valid[h] ? top_candidate_index(sh.sorted_key[i]) - static_cast<uint32_t>(p.vocab_start) : 0u;
  }
  double const y0 = static_cast<double>(__shfl_sync(0xFFFFFFFFu, y[0], 0));
  double const lse = raw ? raw_lse : y0 + log(row_mass);
  bool const decided = m == kMaxFusedTopK && row_usable && winner != 0 && inv_t == inv_t && isfinite(y0) &&
                       isfinite(lse) && !__any_sync(0xFFFFFFFFu, nan_entry);
  if (!decided) {
    if (lane == 0) {
      out.row_modes[row] = kTopLogprobsRank | kTopLogprobsTop;
      leave_to_logits_sampler(p, row);
    }
    return;
  }
  float const lse_f = static_cast<float>(lse);
  double const lse_raw = static_cast<double>(lse_f);  // raw t: the top-N kernels' and the CPU's arithmetic
  auto raw_t = [&](double value) { return __double2float_rn(__dsub_rn(value, lse_raw)); };  // -inf stays -inf

  // The sample and its outputs, as plain sampling's.
  uint32_t const token = top_candidate_index(winner);
  uint32_t const token_local = token - static_cast<uint32_t>(p.vocab_start);
  if (lane == 0) {
    float const x_token = p.row_logits[row * p.row_logits_stride + token_local];
    float const y_token = greedy ? x_token : fs_mul(x_token, inv_t);
    p.tokens[row] = static_cast<int64_t>(token);
    if (p.scores) p.scores[row] = stored_score(p, row, token);
    if (raw) {
      p.token_logprobs[row] = raw_t(x_token);
    } else {
      p.token_logprobs[row] = static_cast<float>(static_cast<double>(y_token) - lse);
      p.logsumexp[row] = lse_f;
    }
  }

  // t of each entry and its key in the order of the outputs (t is a number here: y is finite
  // or -inf and lse finite), then each entry's position among the m.
  float t[2];
  uint32_t t_bits[2];
  PackedCandidate* const order_keys = sh.group_max;  // free after step 1
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    t[h] = raw ? raw_t(x[h]) : y[h] == -INFINITY ? -INFINITY : __fsub_rn(y[h], lse_f);
    t_bits[h] = number_order_bits(t[h]);
    order_keys[lane + 32 * h] = (static_cast<PackedCandidate>(t_bits[h]) << 32) | (0xFFFFFFFFu - local[h]);
  }
  __syncwarp();
  int position[2] = {0, 0};
  for (int j = 0; j < m; ++j) {
    PackedCandidate const other = order_keys[j];
#pragma unroll
    for (int h = 0; h < 2; ++h) position[h] += other > order_keys[lane + 32 * h];
  }
  // The bound of the t of every token past the list (the m-th entry is lane 31's second).
  float const last_x = __shfl_sync(0xFFFFFFFFu, x[1], 31), last_y = __shfl_sync(0xFFFFFFFFu, y[1], 31);
  uint32_t const last_bits =
      raw ? number_order_bits(raw_t(raw_x_bound(last_x, last_y, inv_t))) : __shfl_sync(0xFFFFFFFFu, t_bits[1], 31);
  int above_last = (t_bits[0] > last_bits) + (t_bits[1] > last_bits);
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) above_last += __shfl_xor_sync(0xFFFFFFFFu, above_last, delta);
  bool const top_certified = above_last >= out.top_n;
  bool rank_certified = false;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (top_certified && position[h] < out.top_n) {
      out.values[row * out.top_n + position[h]] = t[h];
      out.ids[row * out.top_n + position[h]] = static_cast<int64_t>(local[h]);
    }
    if (local[h] == token_local && t_bits[h] > last_bits) {
      out.ranks[row] = position[h] + 1;
      rank_certified = true;
    }
  }
  rank_certified = __any_sync(0xFFFFFFFFu, rank_certified);
  if (lane == 0) {
    out.row_modes[row] = static_cast<uint8_t>((top_certified ? 0 : kTopLogprobsTop) |
                                              (rank_certified ? 0 : kTopLogprobsRank));
  }
}

// Whether the row's plain-sampling token (`winner`, the best of the GEMM's tile winners, 0 where
// there is none) lies among its first m tokens sorted in sh (warp-wide, every lane gets it). The
// winner beats every token, so it is the sample of any cut that keeps it.
__device__ bool winner_among_first(Stage2Shared const& sh, int m, PackedCandidate winner) {
  uint32_t const index = top_candidate_index(winner);
  bool listed = false;
  for (int i = threadIdx.x % 32; i < m; i += 32) listed = listed || top_candidate_index(sh.sorted_key[i]) == index;
  return __any_sync(0xFFFFFFFFu, listed) && winner != 0;
}

// The row's one sample is its plain-sampling token `index` (global), with its score.
__device__ void write_winner(SamplerParams const& p, int64_t row, uint32_t index) {
  p.tokens[row] = static_cast<int64_t>(index);
  if (p.scores) p.scores[row] = stored_score(p, row, index);
}

// A row with a top_k above kMaxFusedTopK alone (warp 0), its first m <= kMaxFusedTopK tokens by
// the order of y sorted in sh: top_k keeps the winner when it lies among those m (its rank is at
// most m < top_k). Otherwise (a flat row, usually) the logits sampler samples the row from the
// stored logits.
__device__ void decide_by_winner(SamplerParams const& p, int64_t row, Stage2Shared const& sh, int m,
                                 PackedCandidate winner) {
  bool const listed = winner_among_first(sh, m, winner);
  if (threadIdx.x % 32 != 0) return;
  if (listed) {
    write_winner(p, row, top_candidate_index(winner));
  } else {
    leave_to_logits_sampler(p, row);
  }
}

// The mass of the entries [0, m) that `counted(i, ratio)` keeps, sum of ratio(i) = exp(y - y0)
// <= 1, as fixed-point integers of 2^-52 (order-independent: deterministic); NaN where a counted
// ratio is NaN. Block-wide; every thread gets it.
template <class Counted, class Ratio>
__device__ double block_mass(int m, Counted const& counted, Ratio const& ratio, Stage2Shared& sh) {
  __shared__ unsigned long long mass_fixed;
  __shared__ int nan_mass;
  if (threadIdx.x == 0) {
    mass_fixed = 0;
    nan_mass = 0;
  }
  __syncthreads();
  unsigned long long mine = 0;
  bool nan_seen = false;
  for (int i = threadIdx.x; i < m; i += kThreads) {
    double const r = ratio(i);
    if (!counted(i, r)) continue;
    if (r != r) {
      nan_seen = true;
    } else {
      mine += static_cast<unsigned long long>(__double2ll_rn(r * 0x1p52));
    }
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) mine += __shfl_xor_sync(0xFFFFFFFFu, mine, delta);
  nan_seen = __any_sync(0xFFFFFFFFu, nan_seen);
  if (threadIdx.x % 32 == 0) {
    atomicAdd(&mass_fixed, mine);
    if (nan_seen) nan_mass = 1;
  }
  __syncthreads();
  double const mass = nan_mass ? NAN : static_cast<double>(mass_fixed) * 0x1p-52;
  __syncthreads();  // read before a later call zeroes it
  return mass;
}

// The sum of `value` over the threads before this one (block-wide, threads in order; every
// thread's additions in the same order whatever the data), built without a subtraction: the
// warps before this one's, then the lanes before this one's (the previous lane's inclusive sum).
__device__ double block_exclusive_sum(double value, Stage2Shared& sh) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  double inclusive = value;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    double const other = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  double const lanes_before = __shfl_up_sync(0xFFFFFFFFu, inclusive, 1);
  if (lane == 31) sh.warp_mass[warp] = inclusive;
  __syncthreads();
  double before = 0.0;
  for (int w = 0; w < warp; ++w) before += sh.warp_mass[w];
  __syncthreads();  // read before a later use overwrites them
  return lane == 0 ? before : before + lanes_before;
}

// Sorts keys / xs[0, m) by key, descending (block-wide bitonic sort over the next power of two,
// the entries past m zeroed first: 0 is no key, last; the capacity holds kMaxFusedLargeTopK).
__device__ void block_sort_descending(PackedCandidate* keys, float* xs, int m) {
  static_assert(kMaxFusedLargeTopK <= 2 * kThreads, "finish_large_top_k_row: two survivors a thread");
  int size = 1;
  while (size < m) size <<= 1;
  for (int i = m + threadIdx.x; i < size; i += kThreads) {
    keys[i] = 0;
    xs[i] = 0.0f;
  }
  __syncthreads();
  for (int merged = 2; merged <= size; merged <<= 1) {
    for (int stride = merged / 2; stride > 0; stride >>= 1) {
      for (int t = threadIdx.x; t < size / 2; t += kThreads) {
        int const i = 2 * stride * (t / stride) + t % stride, j = i + stride;
        bool const descending = (i & merged) == 0;
        PackedCandidate const a = keys[i], b = keys[j];
        if ((a < b) == descending) {
          keys[i] = b;
          keys[j] = a;
          float const x = xs[i];
          xs[i] = xs[j];
          xs[j] = x;
        }
      }
      __syncthreads();
    }
  }
}

// A row with a top_k in (kMaxFusedTopK, kMaxFusedLargeTopK] (block-wide): its m survivors of
// top_k in keys / xs[0, m), in any order. With top_p they are sorted first and top_p keeps the
// prefix whose probability before each (of the m survivors' mass, an exclusive sum in the order,
// two entries a thread, in a fixed order of additions) stays below top_p; min_p keeps those
// within min_p of the first token's probability; both keep the first, and the kept ones are the
// prefix before the first entry either drops, as the warp-wide finish below. Then each sample is
// the Gumbel-Max winner among the kept ones with the noise of plain sampling. The masses
// (exp(y - y0) <= 1 each) are summed as fixed-point integers of 2^-52, so that the entries'
// order, which the atomics set, moves no bit of the log-probabilities.
__device__ void finish_large_top_k_row(SamplerParams const& p, int64_t row, PackedCandidate* keys, float* xs, int m,
                                       bool top_p_on, double top_p, bool min_p_on, double min_p, float inv_t,
                                       Stage2Shared& sh) {
  bool const greedy = inv_t == 0.0f;
  bool const invalid_temperature = inv_t != inv_t;
  RowNoiseKey const key = sample_noise_key(p, row);  // its loads under the reductions below
  PackedCandidate first = 0;
  for (int i = threadIdx.x; i < m; i += kThreads) first = max_key(first, keys[i]);
  first = block_max_key(first, sh);
  auto key_y = [](PackedCandidate key) {
    uint32_t const hi = static_cast<uint32_t>(key >> 32);
    return hi <= 1u ? -INFINITY : static_cast<double>(from_order_bits(hi));  // NaN y: no mass
  };
  double const y0 = key_y(first);
  auto ratio_of = [&](int i) { return exp(key_y(keys[i]) - y0); };  // NaN when y0 is +-inf
  auto passes_min_p = [&](int i, double ratio) { return !min_p_on || ratio >= min_p || keys[i] == first; };
  // The kept entries: with top_p the prefix [0, kept_prefix) of the sorted survivors, else those
  // min_p passes.
  __shared__ int kept_prefix;
  if (top_p_on) {
    block_sort_descending(keys, xs, m);
    double const total = block_mass(m, [](int, double) { return true; }, ratio_of, sh);
    if (threadIdx.x == 0) kept_prefix = m;
    __syncthreads();
    // Thread t holds entries 2t and 2t + 1 (m <= 2 * kThreads).
    int const i0 = 2 * static_cast<int>(threadIdx.x), i1 = i0 + 1;
    double const ratio0 = i0 < m ? ratio_of(i0) : 0.0, ratio1 = i1 < m ? ratio_of(i1) : 0.0;
    double const prob0 = ratio0 / total, prob1 = ratio1 / total;
    double const before0 = block_exclusive_sum(prob0 + prob1, sh), before1 = before0 + prob0;
    bool const keep0 = (before0 < top_p || top_p >= 1.0 || i0 == 0) && passes_min_p(i0, ratio0);
    bool const keep1 = (before1 < top_p || top_p >= 1.0) && passes_min_p(i1, ratio1);
    if (i0 < m && !keep0) atomicMin(&kept_prefix, i0);
    if (i1 < m && !keep1) atomicMin(&kept_prefix, i1);
    __syncthreads();
  }
  auto kept = [&](int i, double ratio) { return top_p_on ? i < kept_prefix : passes_min_p(i, ratio); };
  // The kept mass is the log-probabilities' normaliser only: the samples do not need it.
  double const kept_mass = p.logprobs ? block_mass(m, kept, ratio_of, sh) : 0.0;
  double const lse = m == 0 ? -INFINITY : y0 + log(kept_mass);
  // Whether entry i is kept, with its ratio only where min_p decides it.
  auto kept_entry = [&](int i, double y) {
    return top_p_on ? i < kept_prefix : !min_p_on || passes_min_p(i, exp(y - y0));
  };

  for (int s = 0; s < p.num_samples; ++s) {
    // Each thread's best, then the block's as a packed (score, index): unsigned order is
    // fs_candidate_better's, NaN scores 0 (no sample); the thread holding it writes it.
    SampleBest best;
    for (int i = threadIdx.x; i < m && !invalid_temperature; i += kThreads) {
      PackedCandidate const entry = keys[i];
      double const y = key_y(entry);
      if (kept_entry(i, y)) best.offer(top_candidate_index(entry), xs[i], y, s, greedy, inv_t, key);
    }
    PackedCandidate const mine = best.index == kNoCandidate ? PackedCandidate{0} : pack_candidate(best.score, best.index);
    PackedCandidate const winner = block_max_key(mine, sh);
    __syncthreads();  // every thread has read the warps' maxima before the next sample's
    bool const found = winner != 0 && static_cast<uint32_t>(winner >> 32) != 0u;
    int64_t const out = row * p.num_samples + s;
    if (found && mine == winner) {
      p.tokens[out] = best.index;
      if (p.scores) p.scores[out] = best.score;
      if (p.logprobs) p.token_logprobs[out] = static_cast<float>(best.y - lse);
    } else if (!found && threadIdx.x == 0) {
      p.tokens[out] = (m == 0 && p.controls.allowed_mask) ? p.empty_mask_token : -1;
      if (p.scores) p.scores[out] = -INFINITY;
      if (p.logprobs) p.token_logprobs[out] = __uint_as_float(0x7fc00000u);
    }
  }
  if (threadIdx.x == 0 && p.logprobs) {
    p.logsumexp[row] = invalid_temperature ? __uint_as_float(0x7fc00000u) : static_cast<float>(lse);
  }
}

// tile_winners / streamed_winners (draw_tile_winners, else null): the GEMM's tile winners, and
// where stage 2 puts the winner of each row it streams.
__global__ void __launch_bounds__(kThreads, 1)
truncate_candidates_kernel(SamplerParams const p, PackedCandidate const* __restrict__ candidates,
                           float2 const* __restrict__ tile_log_masses, float* __restrict__ streamed_first_y,
                           bool streams_top_p_rows, PackedCandidate const* __restrict__ tile_winners,
                           PackedCandidate* __restrict__ streamed_winners, int64_t num_tiles, int vocab_tile) {
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  __shared__ Stage2Shared sh;
  int64_t const row = blockIdx.x;
  int64_t const columns = sampler_gemm_columns(p);  // tiles are `columns` apart
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // The row's truncation (device values are not checked: out-of-range ones act as documented
  // in sampler_params.h, NaN keeps the first token).
  int64_t const given_k = p.top_ks ? p.top_ks[row] : p.top_k;
  double const top_p = top_p_of_row(p, row);
  double const min_p = min_p_of_row(p, row);
  bool const top_p_on = !(top_p >= 1.0);
  bool const min_p_on = !(min_p <= 0.0);
  // Without top_k the first kMaxFusedTopK tokens are selected as if it were that, and the row
  // is decided here when its top_p / min_p cut falls among them (checked after step 4).
  bool const certify = given_k < 1 && (top_p_on || min_p_on);
  // A row of flashsampling._sample_top_logprobs (nothing on in the call): selected as a row
  // without top_k, then finish_top_logprob_row.
  bool const top_logprob_row = p.top_logprobs.top_n >= 0;
  // A row without top_k the candidates cannot decide may be left to the logits sampler's
  // streaming kernels with its first y (below); every other row's entry stays NaN.
  if (threadIdx.x == 0 && streamed_first_y != nullptr) streamed_first_y[row] = __uint_as_float(0x7fc00000u);
  // A row with a top_k above kMaxFusedTopK alone, where the GEMM drew the tile winners: selected
  // as a row without top_k, then decide_by_winner.
  bool const large_top_k_row = given_k > kMaxFusedTopK && !top_p_on && !min_p_on && tile_winners != nullptr;
  if (!certify && !top_logprob_row && !large_top_k_row && !top_k_decides_row_from_candidates(given_k)) {
    // A larger top_k, or nothing on. Where the GEMM drew the tile winners (a call of one sample
    // without log-probabilities) a row without a cut has its sample: the best of them.
    PackedCandidate const winner =
        tile_winners != nullptr && given_k < 1 ? block_row_winner(tile_winners, num_tiles, columns, row, sh) : 0;
    if (threadIdx.x == 0) {
      if (winner != 0) {
        write_winner(p, row, top_candidate_index(winner));
      } else {
        leave_to_logits_sampler(p, row);
      }
    }
    return;
  }
  bool const first_tokens = certify || top_logprob_row || large_top_k_row;  // the row's first kMaxFusedTopK
  int const k = first_tokens ? kMaxFusedTopK : static_cast<int>(given_k);
  SamplingControls const& controls = p.controls;
  float const inv_t = row_inv_temperature(controls, static_cast<uint32_t>(row), p.inv_temperature);
  bool const greedy = inv_t == 0.0f;
  bool const invalid_temperature = inv_t != inv_t;
  // y = x * inv_t can map two x to one y (then tiles may tie kappa's y with a smaller index).
  bool const scale_exact = greedy || inv_t == 1.0f;
  auto key_at = [&](int64_t tile, int j) { return candidates[(tile * columns + row) * C + j]; };
  auto row_y_key = [&](PackedCandidate x_key) { return y_key(x_key, inv_t, greedy); };

  PackedCandidate* keys = reinterpret_cast<PackedCandidate*>(dynamic_smem);
  int64_t const capacity = max(num_tiles * C, int64_t{kMaxFusedTopK} + int64_t{kRepairTiles} * vocab_tile);
  PackedCandidate* tile_last = keys + capacity;
  float* xs = reinterpret_cast<float*>(tile_last + num_tiles);
  uint32_t* tile_first_y = reinterpret_cast<uint32_t*>(xs + capacity);

  // Every tile once (its loads go out together): its first and last keys; for a row without
  // top_k its first y (the largest of the tiles' first: x -> y is monotone) and how many tiles
  // hold a token, and for its top_p the tiles' log-masses (copied into xs, free until the keys
  // >= tau fill it) and their winners.
  bool const bounded = num_tiles >= 2 * int64_t{k};
  bool const wants_mass = ((certify && top_p_on) || top_logprob_row) && tile_log_masses != nullptr;
  bool const wants_winner = ((certify && top_p_on) || top_logprob_row || large_top_k_row) && tile_winners != nullptr;
  float2* const log_mass_copy = reinterpret_cast<float2*>(xs);  // capacity >= 4 num_tiles floats
  for (int g = threadIdx.x; g < k; g += kThreads) sh.group_max[g] = 0;
  if (threadIdx.x == 0) {
    sh.count = sh.tiles_with_token = sh.min_p_tiles = sh.tiles_ahead = 0;
    sh.first_y_bits = 0;
  }
  __syncthreads();
  uint32_t first_y_bits = 0;
  int with_token = 0;
  PackedCandidate winner_part = 0;
  for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) {
    PackedCandidate const first = row_y_key(key_at(t, 0));
    tile_last[t] = row_y_key(key_at(t, C - 1));
    tile_first_y[t] = static_cast<uint32_t>(first >> 32);
    if (wants_mass) log_mass_copy[t] = tile_log_masses[t * columns + row];
    if (wants_winner) winner_part = max_key(winner_part, tile_winners[t * columns + row]);
    if (bounded) atomicMax(&sh.group_max[t * k / num_tiles], first);
    first_y_bits = max(first_y_bits, static_cast<uint32_t>(first >> 32));
    with_token += first != 0;
  }
  if (first_tokens) {
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) {
      first_y_bits = max(first_y_bits, __shfl_xor_sync(0xFFFFFFFFu, first_y_bits, delta));
      with_token += __shfl_xor_sync(0xFFFFFFFFu, with_token, delta);
    }
    if (lane == 0) {
      atomicMax(&sh.first_y_bits, first_y_bits);
      atomicAdd(&sh.tiles_with_token, with_token);
    }
  }
  __syncthreads();

  // A row without top_k: its first y, its mass (top_p) and its winner. When its first k tokens
  // surely all survive its cut (k tokens are there, every one passes min_p since k tiles' first
  // ones do, and k first-token masses stay below top_p of the row's), the candidates cannot
  // decide it: it is handed on now, as step 4 would, without selecting them.
  double row_y0 = -INFINITY, row_mass = 0.0, raw_lse = NAN;
  bool const raw_top_logprob_row = top_logprob_row && p.top_logprobs.raw_logsumexp != nullptr;
  bool row_usable = false;  // a finite first y and the GEMM's log-masses
  PackedCandidate const row_winner = wants_winner ? block_max_key(winner_part, sh) : PackedCandidate{0};
  if (large_top_k_row && row_winner != 0 && !invalid_temperature) {
    // The winner ranks past the first kMaxFusedTopK tokens when that many tiles' first tokens have
    // a larger y (a flat row, usually): it goes to the logits sampler now, without the selection,
    // which could only find that out.
    float const x = p.row_logits[row * p.row_logits_stride + (top_candidate_index(row_winner) - p.vocab_start)];
    uint32_t const winner_y_bits = order_bits(greedy ? x : fs_mul(x, inv_t));
    int ahead = 0;
    for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) ahead += tile_first_y[t] > winner_y_bits;
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) ahead += __shfl_xor_sync(0xFFFFFFFFu, ahead, delta);
    if (lane == 0 && ahead != 0) atomicAdd(&sh.tiles_ahead, ahead);
    __syncthreads();
    if (sh.tiles_ahead >= kMaxFusedTopK) {
      if (threadIdx.x == 0) leave_to_logits_sampler(p, row);
      return;
    }
  }
  if (first_tokens) {
    uint32_t const hi0 = sh.first_y_bits;
    row_y0 = hi0 <= 1u ? -INFINITY : static_cast<double>(from_order_bits(hi0));
    row_usable = isfinite(row_y0) && tile_log_masses != nullptr;
    if (raw_top_logprob_row) {  // every row's, decided here or not (the logits sampler's is processed)
      if (tile_log_masses != nullptr) raw_lse = block_row_log_sum_exp(log_mass_copy, num_tiles, sh);
      if (threadIdx.x == 0) p.top_logprobs.raw_logsumexp[row] = static_cast<float>(raw_lse);
    } else if (row_usable && (top_p_on || top_logprob_row)) {
      row_mass = block_row_mass(log_mass_copy, num_tiles, row_y0, sh);
    }
    if (row_usable && min_p_on) {
      int passing = 0;
      for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) {
        uint32_t const hi = tile_first_y[t];
        double const y = hi <= 1u ? -INFINITY : static_cast<double>(from_order_bits(hi));
        passing += exp(y - row_y0) >= min_p;  // step 4's test
      }
#pragma unroll
      for (int delta = 16; delta > 0; delta >>= 1) passing += __shfl_xor_sync(0xFFFFFFFFu, passing, delta);
      if (lane == 0) atomicAdd(&sh.min_p_tiles, passing);
      __syncthreads();
    }
    // Step 4's masses are exp(y - y0) <= 1 each: k of them stay below top_p of row_mass with
    // room for its float64 rounding.
    bool const all_survive = certify && row_usable && sh.tiles_with_token >= k &&
                             (!top_p_on || double{kMaxFusedTopK} * (1.0 + 1e-9) < top_p * row_mass) &&
                             (!min_p_on || sh.min_p_tiles >= k);
    if (all_survive) {
      if (threadIdx.x == 0) {
        hand_on_undecided_row(p, row, from_order_bits(hi0), top_p, top_p_on, streams_top_p_rows, streamed_first_y,
                              tile_winners, streamed_winners, row_winner);
      }
      return;
    }
  }

  // 1. tau: the smallest of k group maxima of the tiles' first keys (0: no bound).
  PackedCandidate tau = 0;
  if (bounded) {
    tau = ~PackedCandidate{0};
    for (int g = 0; g < k; ++g) tau = min(tau, sh.group_max[g]);
  }
  uint32_t const tau_y = static_cast<uint32_t>(tau >> 32);

  // The keys >= tau, with their x. A tile's keys have y <= its first key's y.
  for (int64_t t = threadIdx.x; t < num_tiles; t += kThreads) {
    if (tile_first_y[t] < tau_y) continue;
#pragma unroll
    for (int j = 0; j < C; ++j) {
      PackedCandidate const x_key = key_at(t, j);
      PackedCandidate const key = row_y_key(x_key);
      if (key != 0 && key >= tau) {
        int const at = atomicAdd(&sh.count, 1);
        keys[at] = key;
        xs[at] = from_order_bits(static_cast<uint32_t>(x_key >> 32));
      }
    }
  }
  __syncthreads();
  int n = sh.count;

  // 2. kappa: by ranking every entry when there are few (the top k land sorted in
  // sh.sorted_key), else by radix select.
  bool const ranked = n <= kRankDirectly;
  if (ranked) {
    for (int i = threadIdx.x; i < n; i += kThreads) {
      PackedCandidate const key = keys[i];
      int rank = 0;
      for (int j = 0; j < n; ++j) rank += keys[j] > key;
      if (rank < k) {
        sh.sorted_key[rank] = key;
        sh.sorted_x[rank] = xs[i];
      }
    }
    __syncthreads();
  }
  PackedCandidate const kappa = ranked ? (n >= k ? sh.sorted_key[k - 1] : PackedCandidate{0})
                                       : block_kth_largest(keys, n, k, sh);

  // 3. The certificate, and the repair of the tiles it does not cover.
  auto tile_may_hide = [&](int64_t t) {
    PackedCandidate const last = tile_last[t];
    if (last == 0) return false;  // fewer than C tokens: the tile's list is complete
    if (kappa == 0 || last >= kappa) return true;
    if (!scale_exact && static_cast<uint32_t>(last >> 32) == static_cast<uint32_t>(kappa >> 32)) {
      // A token past the list with x below the C-th but y equal to kappa's, and a smaller index.
      return static_cast<uint32_t>(p.vocab_start + t * vocab_tile) < top_candidate_index(kappa);
    }
    return false;
  };
  int any_hidden = 0;
  for (int64_t t = threadIdx.x; t < num_tiles && !any_hidden; t += kThreads) any_hidden = tile_may_hide(t);
  bool const repaired = __syncthreads_or(any_hidden);
  if (repaired) {
    // Keep the entries >= kappa outside the tiles to recompute (<= k), then add those tiles.
    n = block_keep_at_least(keys, xs, n, kappa,
                            [&](PackedCandidate key) {
                              return tile_may_hide((top_candidate_index(key) - p.vocab_start) / vocab_tile);
                            },
                            sh);
    for (int64_t base = 0; base < num_tiles; base += kThreads) {
      if (threadIdx.x == 0) sh.repair_count = 0;
      __syncthreads();
      int64_t const t = base + threadIdx.x;
      if (t < num_tiles && tile_may_hide(t)) sh.repair_tiles[atomicAdd(&sh.repair_count, 1)] = static_cast<int>(t);
      __syncthreads();
      int const repair_count = sh.repair_count;
      for (int first = 0; first < repair_count; first += kRepairTiles) {
        int const tiles = min(kRepairTiles, repair_count - first);
        if (threadIdx.x == 0) sh.count = n;
        __syncthreads();
        auto add_token = [&](int64_t v, float x) {
          int const at = atomicAdd(&sh.count, 1);
          keys[at] = row_y_key(pack_top_candidate(x, static_cast<uint32_t>(p.vocab_start + v)));
          xs[at] = x;
        };
        if (p.row_logits != nullptr && !(p.row_logits_by_top_k && top_k_decides_row_from_candidates(given_k))) {
          // The GEMM's own x, as it stored them (bias added, excluded tokens marked); a row it
          // did not store (row_logits_by_top_k) is recomputed as a host-int top_k call's is.
          for (int e = threadIdx.x; e < tiles * vocab_tile; e += kThreads) {
            int64_t const v = int64_t{sh.repair_tiles[first + e / vocab_tile]} * vocab_tile + e % vocab_tile;
            if (v >= p.vocab_size) continue;
            float const x = p.row_logits[row * p.row_logits_stride + v];
            if (__float_as_uint(x) != kExcludedLogitBits) add_token(v, x);
          }
        } else {
          for (int e = warp; e < tiles * vocab_tile; e += kWarps) {
            int64_t const v = int64_t{sh.repair_tiles[first + e / vocab_tile]} * vocab_tile + e % vocab_tile;
            if (v >= p.vocab_size) continue;
            float x;
            if (recomputed_logit(p, v, row, x) && lane == 0) add_token(v, x);
          }
        }
        __syncthreads();
        n = sh.count;
        PackedCandidate const kappa_now = block_kth_largest(keys, n, k, sh);
        n = block_keep_at_least(keys, xs, n, kappa_now, [](PackedCandidate) { return false; }, sh);
      }
      __syncthreads();  // every thread has read repair_count before the next batch resets it
    }
  }

  // 4. The survivors of top_k (<= k keys), sorted: already, when ranked and not repaired.
  int m = min(n, k);
  if (repaired || !ranked) {
    PackedCandidate const kappa_final = block_kth_largest(keys, n, k, sh);
    m = block_keep_at_least(keys, xs, n, kappa_final, [](PackedCandidate) { return false; }, sh);
    if (warp == 0) {
      for (int i = lane; i < m; i += 32) {
        PackedCandidate const key = keys[i];
        int rank = 0;
        for (int j = 0; j < m; ++j) rank += keys[j] > key;
        sh.sorted_key[rank] = key;
        sh.sorted_x[rank] = xs[i];
      }
    }
  }
  __syncthreads();  // the sorted survivors are visible to every warp
  if (top_logprob_row) {
    if (warp == 0) finish_top_logprob_row(p, row, sh, m, row_usable, row_mass, raw_lse, row_winner, inv_t);
    return;
  }
  if (large_top_k_row) {
    if (warp == 0) decide_by_winner(p, row, sh, m, invalid_temperature ? PackedCandidate{0} : row_winner);
    return;
  }

  // Without top_k: the list holds the row's first m = k tokens, or all of them (m < k). When
  // it may not hold every survivor, top_p needs the row's whole mass (the GEMM's per-tile
  // log-masses), and rows whose first token is not finite go to the logits sampler.
  bool const whole_row = m < k;
  if (certify && !whole_row && !row_usable) {
    if (threadIdx.x == 0) leave_to_logits_sampler(p, row);
    return;
  }
  // A top_p row handed on below starts its rounds from its winner (draw_tile_winners).
  PackedCandidate const winner = whole_row ? PackedCandidate{0} : row_winner;
  if (warp != 0) return;
  __syncwarp();

  // Lane l holds survivors l and l + 32 (in order).
  bool valid[2];
  double y[2], ratio[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int const i = lane + 32 * h;
    valid[h] = i < m;
    uint32_t const hi = valid[h] ? static_cast<uint32_t>(sh.sorted_key[i] >> 32) : 1u;
    y[h] = hi <= 1u ? -INFINITY : static_cast<double>(from_order_bits(hi));  // NaN y: no mass
  }
  double const y0 = __shfl_sync(0xFFFFFFFFu, y[0], 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) ratio[h] = valid[h] ? exp(y[h] - y0) : 0.0;  // NaN when y0 is +-inf
  bool keep[2] = {valid[0], valid[1]};
  if (min_p_on) {
#pragma unroll
    for (int h = 0; h < 2; ++h) keep[h] = keep[h] && (ratio[h] >= min_p || lane + 32 * h == 0);
  }
  // The mass top_p is a fraction of (the top_k survivors', or without top_k the row's), and the
  // probability ahead of each survivor (an exclusive sum).
  double total = ratio[0] + ratio[1];
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) total += __shfl_xor_sync(0xFFFFFFFFu, total, delta);
  if (certify && !whole_row) total = row_mass;
  if (top_p_on) {
    double const prob[2] = {ratio[0] / total, ratio[1] / total};
    double inclusive = prob[0];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      double const other = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
      if (lane >= d) inclusive += other;
    }
    double const first_half = __shfl_sync(0xFFFFFFFFu, inclusive, 31);
    double const before0 = inclusive - prob[0];
    double inclusive1 = prob[1];
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      double const other = __shfl_up_sync(0xFFFFFFFFu, inclusive1, d);
      if (lane >= d) inclusive1 += other;
    }
    double const before1 = first_half + (inclusive1 - prob[1]);
    keep[0] = keep[0] && (before0 < top_p || top_p >= 1.0 || lane == 0);
    keep[1] = keep[1] && (before1 < top_p || top_p >= 1.0);
  }
  // Survivors keep a prefix of the order: its length is the first position not kept.
  unsigned const kept0 = __ballot_sync(0xFFFFFFFFu, keep[0]), kept1 = __ballot_sync(0xFFFFFFFFu, keep[1]);
  int const lead0 = __ffs(~kept0) == 0 ? 32 : __ffs(~kept0) - 1;
  int const lead1 = __ffs(~kept1) == 0 ? 32 : __ffs(~kept1) - 1;
  int const n_keep = lead0 < 32 ? lead0 : 32 + lead1;
  if (certify && !whole_row && n_keep == m) {
    // The cut falls past the first m tokens, so every one of them survives: a row whose winner is
    // among them has its sample (an LLM-like row with hundreds of survivors, often), the others
    // are handed on. "Past" is decided on the row's mass from the GEMM's per-tile log-masses, as
    // every cut this kernel takes is (the rounds would sum the fixed-point masses): the two can
    // differ only where the mass ahead of the winner is within their rounding of top_p's.
    bool const decided = p.num_samples == 1 && !p.logprobs && !invalid_temperature &&
                         winner_among_first(sh, m, winner);
    if (lane == 0) {
      if (decided) {
        write_winner(p, row, top_candidate_index(winner));
      } else {
        hand_on_undecided_row(p, row, from_order_bits(static_cast<uint32_t>(sh.sorted_key[0] >> 32)), top_p,
                              top_p_on, streams_top_p_rows, streamed_first_y, tile_winners, streamed_winners, winner);
      }
    }
    return;
  }

  // Log-sum-exp of the kept survivors' y (float64).
  double kept_mass = (lane < n_keep ? ratio[0] : 0.0) + (lane + 32 < n_keep ? ratio[1] : 0.0);
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) kept_mass += __shfl_xor_sync(0xFFFFFFFFu, kept_mass, delta);
  double const lse = m == 0 ? -INFINITY : y0 + log(kept_mass);

  RowNoiseKey const key = sample_noise_key(p, row);

  for (int s = 0; s < p.num_samples; ++s) {
    SampleBest best;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      int const i = lane + 32 * h;
      if (i >= n_keep || invalid_temperature) continue;
      best.offer(top_candidate_index(sh.sorted_key[i]), sh.sorted_x[i], y[h], s, greedy, inv_t, key);
    }
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) {
      float const other_score = __shfl_xor_sync(0xFFFFFFFFu, best.score, delta);
      int32_t const other_index = __shfl_xor_sync(0xFFFFFFFFu, best.index, delta);
      double const other_y = __shfl_xor_sync(0xFFFFFFFFu, best.y, delta);
      if (fs_candidate_better(other_score, other_index, best.score, best.index)) {
        best.score = other_score;
        best.index = other_index;
        best.y = other_y;
      }
    }
    if (lane != 0) continue;
    bool const found = best.index != kNoCandidate;
    int64_t const out = row * p.num_samples + s;
    p.tokens[out] = found ? best.index : (m == 0 && controls.allowed_mask) ? p.empty_mask_token : -1;
    if (p.scores) p.scores[out] = found ? best.score : -INFINITY;
    if (p.logprobs) p.token_logprobs[out] = found ? static_cast<float>(best.y - lse) : __uint_as_float(0x7fc00000u);
  }
  if (lane == 0 && p.logprobs) {
    p.logsumexp[row] = invalid_temperature ? __uint_as_float(0x7fc00000u) : static_cast<float>(lse);
  }
}

// A run's four keys (top_scan_key of x, 0 where the run has fewer tokens): two 16-byte loads.
__device__ __forceinline__ void load_run_keys(PackedCandidate const* row_keys, int64_t run,
                                              PackedCandidate (&x_key)[C]) {
  static_assert(C == 4, "a run's keys: two 16-byte loads");
  ulonglong2 const* const list = reinterpret_cast<ulonglong2 const*>(row_keys + run * C);
  ulonglong2 const first = list[0], second = list[1];
  x_key[0] = first.x;
  x_key[1] = first.y;
  x_key[2] = second.x;
  x_key[3] = second.y;
}

// A repair round of select_large_top_k_kernel where the GEMM stored each 16-token run's four
// largest keys in place of x (SamplerParams::large_top_k_run_keys): the keys at or above kappa_now
// of the round's tiles' runs join the list (keys, xs; sh.count entries), and a run whose fourth key
// may hide more of the top k (tile_may_hide_more, as for a tile) has its other tokens recomputed
// (warp_dot, the mask and the dense bias, as stage 2 recomputes its tiles; rare: a run holding four
// of the row's top k). Its four largest keep the GEMM's x; a recomputed x is summed in another
// order than the GEMM's, so it can move a token across the k-th key only within that rounding, or
// decide a sample where the token is in the top k (a run holding five of it). Block-wide; `tiles`
// the round's tiles, `elements` their tokens.
__device__ void add_repaired_runs(SamplerParams const& p, int64_t row, PackedCandidate const* __restrict__ run_keys,
                                  int const* tiles, int elements, int vocab_tile, PackedCandidate kappa_now,
                                  float inv_t, bool greedy, bool scale_exact, PackedCandidate* keys, float* xs,
                                  Stage2Shared& sh) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int const runs_per_tile = vocab_tile / kRunKeysRunTokens;
  int const runs = elements / kRunKeysRunTokens;
  int64_t const row_runs = large_top_k_runs(p);
  PackedCandidate const* const row_keys = run_keys + row * row_runs * C;
  auto add = [&](PackedCandidate key, float x) {
    int const at = atomicAdd(&sh.count, 1);
    keys[at] = key;
    xs[at] = x;
  };
  for (int chunk = 0; chunk < runs; chunk += kThreads) {
    if (threadIdx.x == 0) sh.runs_listed = 0;
    __syncthreads();
    int const r = chunk + threadIdx.x;
    int64_t const run = r < runs ? int64_t{tiles[r / runs_per_tile]} * runs_per_tile + r % runs_per_tile : row_runs;
    if (run < row_runs) {
      PackedCandidate x_key[C];
      load_run_keys(row_keys, run, x_key);
      uint32_t const run_start = static_cast<uint32_t>(p.vocab_start + run * kRunKeysRunTokens);
      if (tile_may_hide_more(y_key(x_key[C - 1], inv_t, greedy), kappa_now, scale_exact, run_start)) {
        sh.repair_tiles[atomicAdd(&sh.runs_listed, 1)] = static_cast<int>(run);
      }
#pragma unroll
      for (int j = 0; j < C; ++j) {
        PackedCandidate const key = y_key(x_key[j], inv_t, greedy);
        if (x_key[j] != 0 && key >= kappa_now) add(key, from_order_bits(static_cast<uint32_t>(x_key[j] >> 32)));
      }
    }
    __syncthreads();
    int const listed = sh.runs_listed;
    for (int e = warp; e < listed * kRunKeysRunTokens; e += kWarps) {
      int64_t const run = sh.repair_tiles[e / kRunKeysRunTokens];
      int64_t const v = run * kRunKeysRunTokens + e % kRunKeysRunTokens;
      if (v >= p.vocab_size) continue;
      PackedCandidate x_key[C];
      load_run_keys(row_keys, run, x_key);
      uint32_t const id = static_cast<uint32_t>(p.vocab_start + v);
      bool stored = false;  // added above with the GEMM's x
#pragma unroll
      for (int j = 0; j < C; ++j) stored |= x_key[j] != 0 && top_candidate_index(x_key[j]) == id;
      float x;
      if (stored || !recomputed_logit(p, v, row, x) || lane != 0) continue;
      PackedCandidate const key = y_key(pack_top_candidate(x, id), inv_t, greedy);
      if (key >= kappa_now) add(key, x);
    }
    __syncthreads();  // the list and its count are written again for the next chunk
  }
}

// Entries of select_large_top_k_kernel's key list: every key of the tiles' lists, and room for k
// kept keys beside a repair round of kRepairTiles tiles or more.
__host__ __device__ inline int64_t large_top_k_capacity(int64_t num_tiles, int vocab_tile) {
  int64_t const round = int64_t{kMaxFusedLargeTopK} + int64_t{kRepairTiles} * vocab_tile;
  return num_tiles * C > round ? num_tiles * C : round;
}

// Stage 2 of a call with a host top_k in (kMaxFusedTopK, kMaxFusedLargeTopK]
// (fused_truncation_selects_large_top_k), one block a row: every key of the tiles' lists at its
// own place, those at or above the k-th of the tiles' first (two) keys kept, their k-th largest
// kappa, the tiles whose list may hide more of the top k repaired (about 1% of a flat row's tiles
// at k = 1024, V = 152K) from the logits the GEMM stored, or from its runs' keys where it stored
// those instead (add_repaired_runs), in rounds as wide as fit beside k entries with the k best
// kept after each, then finish_large_top_k_row. Exact whatever the data, as the kernel above (of
// the x it reads or recomputes: a recomputed run's other tokens are summed in another order than
// the GEMM's); it decides every row. Two blocks an SM where their shared memory fits (vocab
// tiles of 128 tokens: 256 rows in one wave), so at most 64 registers a thread.
__global__ void __launch_bounds__(kThreads, 2)
select_large_top_k_kernel(SamplerParams const p, PackedCandidate const* __restrict__ candidates,
                          PackedCandidate const* __restrict__ run_keys, int64_t num_tiles, int vocab_tile) {
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  __shared__ Stage2Shared sh;
  int64_t const row = blockIdx.x;
  int64_t const columns = sampler_gemm_columns(p);  // tiles are `columns` apart
  int const k = static_cast<int>(p.top_k);
  double const min_p = min_p_of_row(p, row);
  float const inv_t = row_inv_temperature(p.controls, static_cast<uint32_t>(row), p.inv_temperature);
  bool const greedy = inv_t == 0.0f;
  bool const scale_exact = greedy || inv_t == 1.0f;
  int64_t const capacity = large_top_k_capacity(num_tiles, vocab_tile);
  PackedCandidate* const keys = reinterpret_cast<PackedCandidate*>(dynamic_smem);
  PackedCandidate* const tile_last = keys + capacity;
  float* const xs = reinterpret_cast<float*>(tile_last + num_tiles);

  // 1. Every key (0 where a tile has fewer tokens), the tiles' j-th keys at [j * tiles, (j + 1) *
  // tiles), and each tile's last; a tile's C keys a thread, kTileLoads tiles' loads in flight (a
  // row's 2374 tiles at V = 152K in one step: the loads' latency, not their bytes, is the step's cost).
  int n = static_cast<int>(num_tiles * C);
  static_assert(C == 4, "a tile's keys: two 16-byte loads");
  for (int64_t base = 0; base < num_tiles; base += kTileLoads * kThreads) {
    ulonglong2 x_keys[kTileLoads][2];
#pragma unroll
    for (int u = 0; u < kTileLoads; ++u) {
      int64_t const t = base + u * kThreads + threadIdx.x;
      ulonglong2 const* const list = reinterpret_cast<ulonglong2 const*>(candidates + (t * columns + row) * C);
      x_keys[u][0] = t < num_tiles ? list[0] : make_ulonglong2(0, 0);
      x_keys[u][1] = t < num_tiles ? list[1] : make_ulonglong2(0, 0);
    }
#pragma unroll
    for (int u = 0; u < kTileLoads; ++u) {
      int64_t const t = base + u * kThreads + threadIdx.x;
      if (t >= num_tiles) continue;
      PackedCandidate const x_key[C] = {x_keys[u][0].x, x_keys[u][0].y, x_keys[u][1].x, x_keys[u][1].y};
#pragma unroll
      for (int j = 0; j < C; ++j) {
        keys[j * num_tiles + t] = y_key(x_key[j], inv_t, greedy);
        xs[j * num_tiles + t] = from_order_bits(static_cast<uint32_t>(x_key[j] >> 32));
      }
      tile_last[t] = y_key(x_key[C - 1], inv_t, greedy);
    }
  }
  __syncthreads();

  if (inv_t != inv_t) {
    // An invalid temperature gives no sample whatever the keys (finish_large_top_k_row): only
    // whether the row has a token matters (an empty mask's token), not its top k, whose
    // certificate would recompute most tiles (every key ties at NaN).
    int has_token = 0;
    for (int e = threadIdx.x; e < n; e += kThreads) has_token |= keys[e] != 0;
    n = __syncthreads_or(has_token);
  } else {
    // 2. A lower bound on kappa, the k-th of the tiles' first keys, or of their first two where
    // there are fewer than 2k tiles (a subset's k-th key is at most the whole list's), keeps the
    // keys that can reach it: on independent logits at V = 152K, k = 1000, about 1100-1300 of
    // 4748 / 9496 (a CPU simulation). Its first two digits bound it (1/128 of a binade of y: tens
    // of keys more) in half the passes. Then kappa among those, and 3. the tiles it does
    // not certify, recomputed.
    int const bounding_keys = static_cast<int>((num_tiles >= 2 * int64_t{k} ? 1 : 2) * num_tiles);
    if (bounding_keys >= k) {
      PackedCandidate const bound = block_kth_largest<true, 2>(keys, bounding_keys, k, sh);
      n = block_compact_at_least(keys, xs, n, bound, [](PackedCandidate) { return false; }, sh);
    }
    PackedCandidate const kappa = block_kth_largest<true>(keys, n, k, sh);
    auto tile_may_hide = [&](int64_t t) {
      return tile_may_hide_more(tile_last[t], kappa, scale_exact, static_cast<uint32_t>(p.vocab_start + t * vocab_tile));
    };
    int any_hidden = 0;
    for (int64_t t = threadIdx.x; t < num_tiles && !any_hidden; t += kThreads) any_hidden = tile_may_hide(t);
    if (!__syncthreads_or(any_hidden)) {
      n = block_compact_at_least(keys, xs, n, kappa, [](PackedCandidate) { return false; }, sh);
    } else {
      n = block_compact_at_least(keys, xs, n, kappa,
                                 [&](PackedCandidate key) {
                                   return tile_may_hide((top_candidate_index(key) - p.vocab_start) / vocab_tile);
                                 },
                                 sh);
      // Only a recomputed token >= the k-th key so far can be among the top k (the k-th key of a
      // subset is at most the row's): the rounds add those, usually a few a tile.
      int const round_tiles = static_cast<int>(max(int64_t{kRepairTiles}, (capacity - k) / vocab_tile));
      PackedCandidate kappa_now = kappa;
      constexpr int kListedTiles = 2048;  // tiles listed at once (a row's, up to V = 262144)
      __shared__ int repair_tiles[kListedTiles];
      for (int64_t base = 0; base < num_tiles; base += kListedTiles) {
        if (threadIdx.x == 0) sh.repair_count = 0;
        __syncthreads();
        for (int64_t t = base + threadIdx.x; t < base + kListedTiles; t += kThreads) {  // as a warp
          bool const hidden = t < num_tiles && tile_may_hide(t);
          int const slot = warp_claim_slot(&sh.repair_count, hidden);
          if (hidden) repair_tiles[slot] = static_cast<int>(t);
        }
        __syncthreads();
        int const repair_count = sh.repair_count;
        for (int first = 0; first < repair_count; first += round_tiles) {
          // The round's tiles' tokens beside the n <= k entries kept so far: their runs' keys, or
          // the GEMM's own x as it stored them (bias added, excluded tokens marked).
          int const elements = min(round_tiles, repair_count - first) * vocab_tile;
          if (threadIdx.x == 0) sh.count = n;
          __syncthreads();
          constexpr int kLoads = 4;  // loads a thread has in flight
          if (run_keys != nullptr) {
            add_repaired_runs(p, row, run_keys, &repair_tiles[first], elements, vocab_tile, kappa_now, inv_t, greedy,
                              scale_exact, keys, xs, sh);
          }
          for (int chunk = 0; chunk < elements && run_keys == nullptr; chunk += kLoads * kThreads) {
            int64_t v[kLoads];
            float x[kLoads];
  #pragma unroll
            for (int u = 0; u < kLoads; ++u) {
              int const e = chunk + u * kThreads + threadIdx.x;
              v[u] = e < elements ? int64_t{repair_tiles[first + e / vocab_tile]} * vocab_tile + e % vocab_tile
                                  : p.vocab_size;
              x[u] = v[u] < p.vocab_size ? p.row_logits[row * p.row_logits_stride + v[u]] : 0.0f;
            }
  #pragma unroll
            for (int u = 0; u < kLoads; ++u) {
              PackedCandidate const key =
                  y_key(pack_top_candidate(x[u], static_cast<uint32_t>(p.vocab_start + v[u])), inv_t, greedy);
              bool const wanted = v[u] < p.vocab_size && __float_as_uint(x[u]) != kExcludedLogitBits && key >= kappa_now;
              int const at = warp_claim_slot(&sh.count, wanted);
              if (wanted) {
                keys[at] = key;
                xs[at] = x[u];
              }
            }
          }
          __syncthreads();
          n = sh.count;
          // kappa bounds the row's k-th key from below too, where fewer than k entries are held yet
          kappa_now = max_key(block_kth_largest_near_bottom(keys, n, k, sh), kappa);
          n = block_compact_at_least(keys, xs, n, kappa_now, [](PackedCandidate) { return false; }, sh);
        }
        __syncthreads();  // every thread has read repair_count before the next chunk zeroes it
      }
    }
  }

  // 4. top_p, min_p and the samples.
  double const top_p = top_p_of_row(p, row);
  finish_large_top_k_row(p, row, keys, xs, n, !(top_p >= 1.0), top_p, !(min_p <= 0.0), min_p, inv_t, sh);
}

}  // namespace

// Dynamic shared memory of select_large_top_k_kernel: its key list and each tile's last key.
static size_t large_top_k_smem_bytes(int64_t num_tiles, int vocab_tile) {
  return static_cast<size_t>(large_top_k_capacity(num_tiles, vocab_tile)) * kBytesPerEntry +
         static_cast<size_t>(num_tiles) * sizeof(PackedCandidate);
}

// Dynamic shared memory of truncate_candidates_kernel.
static size_t candidates_smem_bytes(int64_t num_tiles, int vocab_tile) {
  int64_t const capacity = std::max(num_tiles * C, int64_t{kMaxFusedTopK} + int64_t{kRepairTiles} * vocab_tile);
  return static_cast<size_t>(capacity) * kBytesPerEntry + static_cast<size_t>(num_tiles) * kBytesPerTile;
}

size_t truncate_candidates_smem_bytes(int64_t num_tiles, int vocab_tile) {
  size_t const smem = std::max(candidates_smem_bytes(num_tiles, vocab_tile), large_top_k_smem_bytes(num_tiles, vocab_tile));
  return smem > kMaxDynamicSmem ? 0 : smem;
}

cudaError_t launch_truncate_candidates(SamplerParams const& p, SamplerBuffers const& buffers, int64_t num_tiles,
                                       int vocab_tile, cudaStream_t stream) {
  if (p.batch_size == 0) return cudaSuccess;
  if (!p.fused_truncation || truncate_candidates_smem_bytes(num_tiles, vocab_tile) == 0) return cudaErrorInvalidValue;
  if (fused_truncation_selects_large_top_k(p)) {
    if (p.row_logits == nullptr && buffers.run_keys == nullptr) return cudaErrorInvalidValue;  // its repairs read them
    size_t const smem = large_top_k_smem_bytes(num_tiles, vocab_tile);
    cudaError_t const err = cudaFuncSetAttribute(select_large_top_k_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    select_large_top_k_kernel<<<static_cast<unsigned>(p.batch_size), kThreads, smem, stream>>>(
        p, buffers.candidates, buffers.run_keys, num_tiles, vocab_tile);
    return cudaGetLastError();
  }
  // Without the logits, every row must be one stage 2 decides.
  if (!fused_truncation_decides_every_row(p) && (p.row_logits == nullptr || p.fallback_rows == nullptr)) {
    return cudaErrorInvalidValue;
  }
  size_t const smem = candidates_smem_bytes(num_tiles, vocab_tile);
  cudaError_t err =
      cudaFuncSetAttribute(truncate_candidates_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  float2 const* tile_log_masses = p.row_logits != nullptr ? buffers.lse_parts : nullptr;
  truncate_candidates_kernel<<<static_cast<unsigned>(p.batch_size), kThreads, smem, stream>>>(
      p, buffers.candidates, tile_log_masses, buffers.streamed_first_y, fused_truncation_streams_top_p_rows(p),
      buffers.tile_winners, buffers.streamed_winners, num_tiles, vocab_tile);
  return cudaGetLastError();
}

}  // namespace flashsampling
