// The top-N log-probabilities of a row and the ranks of its sampled tokens, from materialised
// values (flashsampling/top_logprobs.h has the contract). One CTA a row, exact whatever the
// data, no sort of the row. Keys are 64 bits: the order bits of t (hi; unsigned order = the
// output order, NaN highest) and ~v (lo), so every key is distinct and a larger key comes first.
// A radix select over the keys' digits (11, 11, 10 bits of hi, then of lo) finds the N-th key:
//
//  1. one pass over the row histograms the first digit (and counts, per sampled token, the keys
//     above the token's: its rank);
//  2. where the keys from the chosen bin up fit the CTA's buffer (4096; the usual case: the top N
//     of a row lie in its far tail), one more pass copies them there and the remaining digits,
//     the gather of the N keys and their order use the buffer only: two reads of the row;
//  3. else two more passes over the row find the rest of hi, and one gathers the keys above it
//     and its first ties in index order (a block-wide ordered compaction), stopping once it has
//     them: four to five reads.
//
// Loads go as float4, two a thread at a time, so that a CTA has 16 KB in flight (one row a CTA
// at B = 1).
#include <cmath>
#include <cstdint>

#include "flashsampling/top_logprobs.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxBins = 2048;  // 11-bit digits
constexpr int kBufferCapacity = 4096;
constexpr int kRankSlots = 4;  // sampled tokens ranked per pass over the row
constexpr int kLoadsPerThread = 2;
// The digits of a key, most significant first: 11, 11, 10 bits of hi, then of lo.
constexpr int kDigits = 6;
__device__ constexpr int kDigitShift[kDigits] = {53, 42, 32, 21, 10, 0};
__device__ constexpr int kDigitBits[kDigits] = {11, 11, 10, 11, 11, 10};

struct RowView {
  const float* values;
  int64_t vocab;
  double lse;
  float lse_f;
  bool raw;

  // t of a value, as logprobs.py's `normalised` computes it.
  __device__ __forceinline__ float logprob_of(float x) const {
    if (raw) return __double2float_rn(__dsub_rn(static_cast<double>(x), lse));
    return x == -INFINITY ? -INFINITY : __fsub_rn(x, lse_f);
  }
  __device__ __forceinline__ float logprob(int64_t v) const { return logprob_of(__ldg(values + v)); }
};

// Unsigned order of t: NaN above +inf, -0 folded into +0.
__device__ __forceinline__ uint32_t order_bits(float t) {
  if (isnan(t)) return 0xFFFFFFFFu;
  uint32_t const u = __float_as_uint(t == 0.0f ? 0.0f : t);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t order_key(uint32_t hi, int64_t v) {
  return (static_cast<uint64_t>(hi) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(v));
}

__device__ __forceinline__ int64_t index_of(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// Calls f(v, hi) for every v of the row, kLoadsPerThread loads a thread in flight: float4 loads
// where the row allows them (16-byte aligned, V a multiple of 4: the usual vocabularies).
template <class F>
__device__ __forceinline__ void for_each_key(RowView const& view, F&& f) {
  if (reinterpret_cast<uintptr_t>(view.values) % 16 == 0 && view.vocab % 4 == 0) {
    float4 const* quads = reinterpret_cast<float4 const*>(view.values);
    int64_t const count = view.vocab / 4;
    for (int64_t base = threadIdx.x; base < count; base += kLoadsPerThread * kThreads) {
      float4 x[kLoadsPerThread];
#pragma unroll
      for (int k = 0; k < kLoadsPerThread; ++k) {
        int64_t const i = base + k * kThreads;
        x[k] = i < count ? __ldg(quads + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < kLoadsPerThread; ++k) {
        int64_t const i = base + k * kThreads;
        if (i < count) {
          f(4 * i, order_bits(view.logprob_of(x[k].x)));
          f(4 * i + 1, order_bits(view.logprob_of(x[k].y)));
          f(4 * i + 2, order_bits(view.logprob_of(x[k].z)));
          f(4 * i + 3, order_bits(view.logprob_of(x[k].w)));
        }
      }
    }
    return;
  }
  for (int64_t base = threadIdx.x; base < view.vocab; base += kLoadsPerThread * kThreads) {
    float x[kLoadsPerThread];
#pragma unroll
    for (int k = 0; k < kLoadsPerThread; ++k) {
      int64_t const v = base + k * kThreads;
      x[k] = v < view.vocab ? __ldg(view.values + v) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kLoadsPerThread; ++k) {
      int64_t const v = base + k * kThreads;
      if (v < view.vocab) f(v, order_bits(view.logprob_of(x[k])));
    }
  }
}

// The radix select's state, the same in every thread.
struct Selection {
  uint64_t prefix = 0, mask = 0;  // the digits chosen so far
  uint32_t remaining = 0;         // how many of the keys that match them are still to take
  uint32_t above = 0;             // keys above the chosen bin of the last digit
};

// Warp 0 picks the bin of hist (descending) that holds the `remaining`-th key and every thread
// gets the selection of digit d after the barrier.
__device__ void choose_bin(uint32_t const* hist, int d, Selection& sel, uint32_t* shared_bin,
                           uint32_t* shared_before) {
  int const lane = threadIdx.x & 31, bins = 1 << kDigitBits[d], per_lane = bins / 32;
  if (threadIdx.x < 32) {
    int const top = bins - 1 - per_lane * lane;  // lane 0 holds the highest bins
    uint32_t sum = 0;
    for (int k = 0; k < per_lane; ++k) sum += hist[top - k];
    uint32_t inclusive = sum;
    for (int delta = 1; delta < 32; delta <<= 1) {
      uint32_t const up = __shfl_up_sync(0xFFFFFFFFu, inclusive, delta);
      if (lane >= delta) inclusive += up;
    }
    uint32_t before = inclusive - sum;
    if (before < sel.remaining && sel.remaining <= inclusive) {
      for (int k = 0; k < per_lane; ++k) {
        uint32_t const count = hist[top - k];
        if (sel.remaining <= before + count) {
          *shared_bin = static_cast<uint32_t>(top - k);
          *shared_before = before;
          break;
        }
        before += count;
      }
    }
  }
  __syncthreads();
  uint64_t const bin = *shared_bin;
  sel.prefix |= bin << kDigitShift[d];
  sel.mask |= static_cast<uint64_t>(bins - 1) << kDigitShift[d];
  sel.above += *shared_before;
  sel.remaining -= *shared_before;
}

__device__ __forceinline__ uint32_t digit_of(uint64_t key, int d) {
  return static_cast<uint32_t>(key >> kDigitShift[d]) & ((1u << kDigitBits[d]) - 1u);
}

__global__ void __launch_bounds__(kThreads) top_logprobs_kernel(TopLogprobsParams p) {
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint64_t buffer[kBufferCapacity];
  __shared__ uint64_t chosen[kMaxTopLogprobs];
  __shared__ uint32_t warp_ties[kWarps], warp_above[kWarps];
  __shared__ uint32_t rank_counts[kRankSlots];
  __shared__ uint32_t shared_bin, shared_before, filled, gathered;

  int64_t const row = blockIdx.x;
  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double const lse = __ldg(p.lse + row);
  RowView const view{p.values + row * p.row_stride, p.vocab_size, lse, static_cast<float>(lse), p.raw};
  int64_t const vocab = p.vocab_size;
  int const n = p.top_n;

  auto zero_hist = [&]() {
    for (int i = tid; i < kMaxBins; i += kThreads) hist[i] = 0;
  };

  // Pass 1: ranks, kRankSlots tokens a pass; the first pass also histograms digit 0.
  Selection sel;
  sel.remaining = static_cast<uint32_t>(n);
  for (int64_t s0 = 0; s0 < p.num_samples || (s0 == 0 && n > 0); s0 += kRankSlots) {
    int const slots = p.num_samples - s0 < kRankSlots ? static_cast<int>(p.num_samples - s0) : kRankSlots;
    uint32_t token_hi[kRankSlots], count[kRankSlots];
    int64_t token[kRankSlots];
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      token[k] = k < slots ? __ldg(p.tokens + row * p.num_samples + s0 + k) : -1;
      bool const valid = token[k] >= 0 && token[k] < vocab;
      token_hi[k] = valid ? order_bits(view.logprob(token[k])) : 0u;
      if (!valid) token[k] = -1;
      count[k] = 0;
    }
    bool const histogram = s0 == 0 && n > 0;
    if (histogram) zero_hist();  // (kept after the first pass: the candidate count reads it)
    if (tid < kRankSlots) rank_counts[tid] = 0;
    __syncthreads();
    for_each_key(view, [&](int64_t v, uint32_t hi) {
      if (histogram) atomicAdd(&hist[hi >> (32 - kDigitBits[0])], 1u);
#pragma unroll
      for (int k = 0; k < kRankSlots; ++k) {
        count[k] += (hi > token_hi[k] || (hi == token_hi[k] && v < token[k])) ? 1u : 0u;
      }
    });
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      uint32_t const warp_count = __reduce_add_sync(0xFFFFFFFFu, count[k]);
      if (lane == 0) atomicAdd(&rank_counts[k], warp_count);
    }
    __syncthreads();
    if (tid < slots) {
      p.ranks[row * p.num_samples + s0 + tid] = token[tid] >= 0 ? static_cast<int64_t>(rank_counts[tid]) + 1 : 0;
    }
    if (histogram) choose_bin(hist, 0, sel, &shared_bin, &shared_before);
    __syncthreads();
  }
  if (n == 0) return;

  uint32_t const candidates = sel.above + hist[shared_bin];  // keys from the chosen bin up
  __syncthreads();
  if (candidates <= kBufferCapacity) {
    // Pass 2: those keys into the buffer; the rest of the select runs there.
    uint32_t const first_bin = shared_bin;
    if (tid == 0) filled = 0;
    __syncthreads();
    for_each_key(view, [&](int64_t v, uint32_t hi) {
      if ((hi >> (32 - kDigitBits[0])) >= first_bin) {
        uint32_t const slot = atomicAdd(&filled, 1u);
        if (slot < kBufferCapacity) buffer[slot] = order_key(hi, v);
      }
    });
    __syncthreads();
    uint32_t const size = min(filled, static_cast<uint32_t>(kBufferCapacity));
    for (int d = 1; d < kDigits; ++d) {
      zero_hist();
      __syncthreads();
      for (uint32_t i = tid; i < size; i += kThreads) {
        uint64_t const key = buffer[i];
        if ((key & sel.mask) == sel.prefix) atomicAdd(&hist[digit_of(key, d)], 1u);
      }
      __syncthreads();
      choose_bin(hist, d, sel, &shared_bin, &shared_before);
      __syncthreads();
    }
    // sel.prefix is now the N-th key itself: the N keys are those >= it.
    if (tid == 0) gathered = 0;
    __syncthreads();
    for (uint32_t i = tid; i < size; i += kThreads) {
      uint64_t const key = buffer[i];
      if (key >= sel.prefix) {
        uint32_t const slot = atomicAdd(&gathered, 1u);
        if (slot < kMaxTopLogprobs) chosen[slot] = key;
      }
    }
  } else {
    // The rest of hi over the row, then the keys above it and its first ties in index order.
    for (int d = 1; d < 3; ++d) {
      zero_hist();
      __syncthreads();
      for_each_key(view, [&](int64_t v, uint32_t hi) {
        uint64_t const key = static_cast<uint64_t>(hi) << 32;
        if ((key & sel.mask) == sel.prefix) atomicAdd(&hist[digit_of(key, d)], 1u);
      });
      __syncthreads();
      choose_bin(hist, d, sel, &shared_bin, &shared_before);
      __syncthreads();
    }
    uint32_t const threshold = static_cast<uint32_t>(sel.prefix >> 32), ties_wanted = sel.remaining;
    uint32_t const above_total = static_cast<uint32_t>(n) - ties_wanted;
    if (tid == 0) gathered = 0;
    __syncthreads();
    uint32_t ties_before = 0, above_before = 0;  // the same in every thread
    for (int64_t base = 0; base < vocab; base += kThreads) {
      int64_t const v = base + tid;
      bool const in_row = v < vocab;
      uint32_t const hi = in_row ? order_bits(view.logprob(v)) : 0u;
      bool const above = in_row && hi > threshold, tie = in_row && hi == threshold;
      if (above) {
        uint32_t const slot = atomicAdd(&gathered, 1u);
        if (slot < above_total) chosen[slot] = order_key(hi, v);
      }
      uint32_t const tie_ballot = __ballot_sync(0xFFFFFFFFu, tie), above_ballot = __ballot_sync(0xFFFFFFFFu, above);
      if (lane == 0) {
        warp_ties[warp] = __popc(tie_ballot);
        warp_above[warp] = __popc(above_ballot);
      }
      __syncthreads();
      uint32_t position = ties_before + __popc(tie_ballot & ((1u << lane) - 1u));
      for (int w = 0; w < kWarps; ++w) {
        position += w < warp ? warp_ties[w] : 0u;
        ties_before += warp_ties[w];
        above_before += warp_above[w];
      }
      if (tie && position < ties_wanted) chosen[above_total + position] = order_key(hi, v);
      __syncthreads();  // warp_ties / warp_above are rewritten next chunk
      if (ties_before >= ties_wanted && above_before == above_total) break;
    }
  }
  __syncthreads();

  // Order the N keys (distinct) by counting.
  if (tid < n) {
    uint64_t const key = chosen[tid];
    int position = 0;
    for (int k = 0; k < n; ++k) position += chosen[k] > key ? 1 : 0;
    int64_t const v = index_of(key);
    p.top_ids[row * n + position] = v;
    p.top_values[row * n + position] = view.logprob(v);
  }
}

}  // namespace

cudaError_t launch_top_logprobs(TopLogprobsParams const& params, cudaStream_t stream) {
  if (params.batch_size == 0) return cudaSuccess;
  if (params.top_n < 0 || params.top_n > kMaxTopLogprobs || params.top_n > params.vocab_size ||
      params.vocab_size < 1 || params.vocab_size > (int64_t{1} << 32) - 1 || params.batch_size > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  top_logprobs_kernel<<<static_cast<unsigned>(params.batch_size), kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

}  // namespace flashsampling
