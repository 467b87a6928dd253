// The truncation cut's radix search over order keys (flashsampling/key_search.h): the rows' first
// keys, one round (the choice from the previous round's summed histogram, then this round's
// histogram) and the survivors' bitmask. A grid of (chunks of the vocabulary, rows); a CTA reads
// its chunk of one row's y once, computing each token's key from y, its allowed bit and its id.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <cstdint>

#include "flashsampling/key_search.h"
#include "logits_rows.cuh"

namespace flashsampling {
namespace {

constexpr int kThreads = kKeySearchBins;  // a thread a bin in the choice
constexpr int kTokensPerThread = 16;      // a CTA's chunk: 4096 tokens
constexpr int64_t kChunk = int64_t{kThreads} * kTokensPerThread;
constexpr unsigned long long kNoKey = 0x7FFFFFFFFFFFFFFFull;
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

// A token's order key from its y and local index (truncation.py: truncation_rank).
__device__ __forceinline__ unsigned long long order_key(KeySearchRows const& r, float y, int64_t v) {
  int64_t rank = 0x7F800001;  // an allowed NaN: after -inf
  if (y == y) {
    int32_t bits = __float_as_int(-y);
    if (bits == INT32_MIN) bits = 0;  // -0 as +0
    rank = bits >= 0 ? int64_t{bits} : -int64_t{bits & 0x7FFFFFFF};
  }
  return (static_cast<unsigned long long>(rank + (int64_t{1} << 31)) << 31) |
         static_cast<unsigned long long>(r.vocab_start + v);
}

// min_p's test of a token (truncation.py: keep_prefix): exp(y - y0) >= min_p in float64, a NaN y
// as -inf, or the row's first key. logits_rows.cuh's MinP gives the same answers with float
// shortcuts, but in the round kernel it cost 26 more registers.
__device__ __forceinline__ bool passes_min_p(float y, unsigned long long key, double y0, double min_p,
                                             long long first) {
  double const ys = y != y ? -INFINITY : static_cast<double>(y);
  return exp(ys - y0) >= min_p || key == static_cast<unsigned long long>(first);
}

// The top_p mass of a token whose row's first y is y0 (0 where y0 is not finite).
__device__ __forceinline__ unsigned long long key_mass(float y, float y0) {
  return isfinite(y0) ? fixed_mass(y, static_cast<double>(y0)) : 0ull;
}

struct RowPointers {
  const float* y;
  const uint32_t* mask;
};

__device__ __forceinline__ RowPointers row_pointers(KeySearchRows const& r, int64_t row) {
  return {r.y + row * r.row_stride, r.allowed_mask ? r.allowed_mask + row * r.mask_words : nullptr};
}

// A thread's tokens of its CTA's chunk, token i at `first + i * stride`: every load issued before
// any is used (the thread's loads in flight together), and bit i of `allowed` set where token i
// lies in the row and is allowed.
struct Tile {
  float y[kTokensPerThread];
  unsigned allowed;
};

__device__ __forceinline__ Tile load_tile(KeySearchRows const& r, RowPointers const& p, int64_t first,
                                          int64_t stride) {
  Tile t;
  t.allowed = 0;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    int64_t const v = first + i * stride;
    bool const inside = v < r.vocab_size;
    t.y[i] = inside ? __ldg(p.y + v) : 0.0f;
    bool const allowed = inside && (p.mask == nullptr || ((__ldg(p.mask + (v >> 5)) >> (v & 31)) & 1u));
    t.allowed |= static_cast<unsigned>(allowed) << i;
  }
  return t;
}

__global__ void __launch_bounds__(kThreads) first_keys_kernel(KeySearchRows const r, int64_t* first) {
  int64_t const row = blockIdx.y;
  RowPointers const p = row_pointers(r, row);
  int64_t const begin = int64_t{blockIdx.x} * kChunk + threadIdx.x;
  Tile const t = load_tile(r, p, begin, kThreads);
  unsigned long long best = kNoKey;
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    unsigned long long const key = order_key(r, t.y[i], begin + i * kThreads);
    if (((t.allowed >> i) & 1u) && key < best) best = key;
  }
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  unsigned long long const smallest = Reduce(temp).Reduce(best, [](auto a, auto b) { return a < b ? a : b; });
  if (threadIdx.x == 0 && smallest != kNoKey) {
    atomicMin(reinterpret_cast<unsigned long long*>(first + row), smallest);
  }
}

// The round's state of a row from the previous one and its summed histogram (every CTA of the row
// computes the same). Thread d holds bin d.
struct SearchState {
  long long prefix, need_or_ahead, total, found;
};

__device__ SearchState choose_bin(KeySearchRound const& q, int64_t row) {
  __shared__ SearchState shared;
  __shared__ int last_bin;
  using Scan = cub::BlockScan<long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  bool const by_mass = q.top_ps != nullptr;
  SearchState s;
  if (q.state_in == nullptr) {
    s = {0, by_mass ? 0 : static_cast<long long>(q.top_ks[row]), 0, kKeySearchUnknown};
  } else {
    int64_t const* in = q.state_in + row * kKeySearchStateWords;
    s = {in[kStatePrefix], in[kStateNeedOrAhead], in[kStateTotal], in[kStateFound]};
  }
  if (q.hist_in == nullptr) return s;
  int const d = threadIdx.x;
  int64_t const* hist = q.hist_in + row * 2 * kKeySearchBins;
  long long const count = hist[d];
  long long upto_count;
  Scan(scan_temp).InclusiveSum(count, upto_count);
  __syncthreads();
  if (!by_mass) {
    // the first bin whose keys up to it reach `need`; what lies in earlier bins is ahead
    int const below = __syncthreads_count(upto_count < s.need_or_ahead);
    int const bin = below < kKeySearchBins ? below : kKeySearchBins - 1;
    if (d == kKeySearchBins - 1) {
      shared.found = s.found == kKeySearchUnknown ? (upto_count >= s.need_or_ahead ? 1 : 0) : s.found;
    }
    if (d == bin) shared.need_or_ahead = s.need_or_ahead - (upto_count - count);
    __syncthreads();
    return {(s.prefix << kKeySearchDigitBits) | bin, shared.need_or_ahead, 0, shared.found};
  }
  long long const mass = hist[kKeySearchBins + d];
  long long upto_mass;
  Scan(scan_temp).InclusiveSum(mass, upto_mass);
  if (d == 0) last_bin = 0;
  if (d == kKeySearchBins - 1) shared.total = s.found == kKeySearchUnknown ? upto_mass : s.total;
  __syncthreads();
  long long const total = shared.total;
  long long const before = s.need_or_ahead + (upto_mass - mass);  // the mass ahead of the bin's first key
  // the negation of top_p_reached's test (logits_rows.cuh) on the same integers, false for a NaN
  // top_p and a total of 0 (a row whose first y is not finite: its first token alone survives)
  bool const survives = count > 0 && static_cast<double>(before) / static_cast<double>(total) < q.top_ps[row];
  if (survives) atomicMax(&last_bin, d + 1);
  __syncthreads();
  int const last = last_bin;
  int const bin = last > 0 ? last - 1 : 0;
  if (d == bin) shared.need_or_ahead = before;
  __syncthreads();
  long long const found = s.found == kKeySearchUnknown ? (last > 0 ? 1 : 0) : s.found;
  return {(s.prefix << kKeySearchDigitBits) | bin, shared.need_or_ahead, total, found};
}

__global__ void __launch_bounds__(kThreads) search_round_kernel(KeySearchRound const q) {
  int64_t const row = blockIdx.y;
  SearchState const s = choose_bin(q, row);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t* out = q.state_out + row * kKeySearchStateWords;
    out[kStatePrefix] = s.prefix;
    out[kStateNeedOrAhead] = s.need_or_ahead;
    out[kStateTotal] = s.total;
    out[kStateFound] = s.found;
  }
  if (q.shift < 0) return;

  __shared__ unsigned int counts[kKeySearchBins];
  __shared__ unsigned long long masses[kKeySearchBins];
  counts[threadIdx.x] = 0;
  masses[threadIdx.x] = 0;
  __syncthreads();
  KeySearchRows const& r = q.rows;
  RowPointers const p = row_pointers(r, row);
  bool const by_mass = q.top_ps != nullptr;
  unsigned long long const limit = q.limit ? static_cast<unsigned long long>(q.limit[row]) : kNoKey;
  float const y0 = by_mass ? q.y0[row] : 0.0f;
  double const min_p = q.min_ps ? q.min_ps[row] : 0.0;
  long long const first = q.min_ps ? q.first[row] : 0;
  int const above = q.shift + kKeySearchDigitBits;
  int64_t const begin = int64_t{blockIdx.x} * kChunk + threadIdx.x;
  int const lane = threadIdx.x & 31;
  Tile const t = load_tile(r, p, begin, kThreads);
  // A warp's keys of one digit add up in the warp first (flat rows put most keys of the first
  // rounds in a few bins), then one lane adds them to the CTA's histogram.
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    float const y = t.y[i];
    unsigned long long const key = order_key(r, y, begin + i * kThreads);
    bool const in_range = ((t.allowed >> i) & 1u) && key <= limit &&
                          (above >= 63 || static_cast<long long>(key >> above) == s.prefix);
    unsigned const active = __ballot_sync(kFullMask, in_range);
    if (!in_range) continue;
    int const digit = static_cast<int>((key >> q.shift) & (kKeySearchBins - 1));
    unsigned const group = __match_any_sync(active, digit);
    bool const leader = lane == __ffs(group) - 1;
    if (leader) atomicAdd(counts + digit, static_cast<unsigned>(__popc(group)));
    if (by_mass) {
      unsigned long long mass = 0;
      if (q.min_ps == nullptr || passes_min_p(y, key, static_cast<double>(y0), min_p, first)) mass = key_mass(y, y0);
      // A mass is below 2^42: its low 21 and high 21 bits each sum over 32 lanes within 32 bits.
      unsigned const low = __reduce_add_sync(group, static_cast<unsigned>(mass & 0x1FFFFFu));
      unsigned const high = __reduce_add_sync(group, static_cast<unsigned>(mass >> 21));
      unsigned long long const sum = (static_cast<unsigned long long>(high) << 21) + low;
      if (leader && sum != 0) atomicAdd(masses + digit, sum);
    }
  }
  __syncthreads();
  unsigned long long* hist = q.hist_out + row * 2 * kKeySearchBins;
  int const d = threadIdx.x;
  if (counts[d] != 0) atomicAdd(hist + d, static_cast<unsigned long long>(counts[d]));
  if (masses[d] != 0) atomicAdd(hist + kKeySearchBins + d, masses[d]);
}

// A warp a word of 32 tokens at a time: each lane tests its token, the ballot is the word.
__global__ void __launch_bounds__(kThreads) cut_mask_kernel(KeyCutMask const c) {
  int64_t const row = blockIdx.y;
  KeySearchRows const& r = c.rows;
  RowPointers const p = row_pointers(r, row);
  unsigned long long const cut = static_cast<unsigned long long>(c.cut[row]);
  long long const first = c.first[row];
  double const y0 = static_cast<double>(c.y0[row]);
  double const min_p = c.min_ps ? c.min_ps[row] : 0.0;
  int const lane = threadIdx.x & 31;
  // Warp w of the CTA takes words word_begin + w + 8 i: its lanes' tokens, all loaded first.
  int64_t const words_per_cta = kChunk / 32;
  int64_t const word_first = int64_t{blockIdx.x} * words_per_cta + threadIdx.x / 32;
  constexpr int64_t kWordStride = kThreads / 32;
  Tile const t = load_tile(r, p, word_first * 32 + lane, kWordStride * 32);
#pragma unroll
  for (int i = 0; i < kTokensPerThread; ++i) {
    int64_t const w = word_first + i * kWordStride;
    int64_t const v = w * 32 + lane;
    unsigned long long const key = order_key(r, t.y[i], v);
    bool keep = ((t.allowed >> i) & 1u) && key <= cut;
    if (keep && c.min_ps != nullptr) keep = passes_min_p(t.y[i], key, y0, min_p, first);
    unsigned const word = __ballot_sync(kFullMask, keep);
    if (lane == 0 && w < r.mask_words) c.mask[row * r.mask_words + w] = word;
  }
}

dim3 grid_of(KeySearchRows const& r) {
  return dim3(static_cast<unsigned>((r.vocab_size + kChunk - 1) / kChunk), static_cast<unsigned>(r.batch_size));
}

}  // namespace

cudaError_t launch_first_order_keys(KeySearchRows const& rows, int64_t* first, cudaStream_t stream) {
  if (rows.batch_size == 0 || rows.vocab_size == 0) return cudaSuccess;
  first_keys_kernel<<<grid_of(rows), kThreads, 0, stream>>>(rows, first);
  return cudaGetLastError();
}

cudaError_t launch_key_search_round(KeySearchRound const& round, cudaStream_t stream) {
  if (round.rows.batch_size == 0) return cudaSuccess;
  dim3 grid = grid_of(round.rows);
  if (round.shift < 0 || grid.x == 0) grid.x = 1;  // the choice alone: a CTA a row
  search_round_kernel<<<grid, kThreads, 0, stream>>>(round);
  return cudaGetLastError();
}

cudaError_t launch_key_cut_mask(KeyCutMask const& cut, cudaStream_t stream) {
  if (cut.rows.batch_size == 0 || cut.rows.mask_words == 0) return cudaSuccess;
  cut_mask_kernel<<<grid_of(cut.rows), kThreads, 0, stream>>>(cut);
  return cudaGetLastError();
}

}  // namespace flashsampling
