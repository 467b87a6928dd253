// The top-N log-probabilities of a row and the ranks of its sampled tokens, from materialised
// values (flashsampling/top_logprobs.h has the contract). One CTA a row, exact whatever the
// data, no sort of the row:
//
//  1. keys: hi = order bits of t (unsigned order = the output order, NaN highest), lo = ~v, so
//     every key is distinct and a larger key comes first;
//  2. a radix select over hi, 8 bits a pass (4 passes over the row, each a shared-memory
//     histogram of the elements that match the digits chosen so far), finds the N-th key's hi
//     and how many of its ties the top N take; the first pass also counts, per sampled token,
//     the keys above the token's (its rank);
//  3. one pass gathers the keys above that hi (any order) and its first ties in index order (a
//     block-wide ordered compaction), stopping once it has all of them;
//  4. the N keys are ranked against each other (N <= 64) and written in order.
//
// The row is read 5 times (fewer where step 3 stops early); at V = 152k that is 3 MB a row,
// mostly from L2.
#include <cmath>
#include <cstdint>

#include "flashsampling/top_logprobs.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kDigitBits = 8;
constexpr int kBins = 1 << kDigitBits;
constexpr int kRankSlots = 4;  // sampled tokens ranked per pass over the row

struct RowView {
  const float* values;
  int64_t vocab;
  double lse;
  float lse_f;
  bool raw;

  // t[v] as logprobs.py's `normalised` computes it.
  __device__ __forceinline__ float logprob(int64_t v) const {
    float const x = __ldg(values + v);
    if (raw) return __double2float_rn(__dsub_rn(static_cast<double>(x), lse));
    return x == -INFINITY ? -INFINITY : __fsub_rn(x, lse_f);
  }
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

// Warp 0 picks the bin of hist (descending) that holds the `remaining`-th element, and how many
// of that bin's elements are still needed; every thread gets them after the barrier.
__device__ void choose_bin(uint32_t const* hist, uint32_t remaining, uint32_t* chosen_bin, uint32_t* chosen_remaining) {
  int const lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    constexpr int kPerLane = kBins / 32;
    int const top = kBins - 1 - kPerLane * lane;  // lane 0 holds the highest bins
    uint32_t sum = 0;
    for (int k = 0; k < kPerLane; ++k) sum += hist[top - k];
    uint32_t inclusive = sum;
    for (int d = 1; d < 32; d <<= 1) {
      uint32_t const up = __shfl_up_sync(0xFFFFFFFFu, inclusive, d);
      if (lane >= d) inclusive += up;
    }
    uint32_t before = inclusive - sum;
    if (before < remaining && remaining <= inclusive) {
      for (int k = 0; k < kPerLane; ++k) {
        uint32_t const count = hist[top - k];
        if (remaining <= before + count) {
          *chosen_bin = static_cast<uint32_t>(top - k);
          *chosen_remaining = remaining - before;
          break;
        }
        before += count;
      }
    }
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) top_logprobs_kernel(TopLogprobsParams p) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t warp_ties[kWarps], warp_above[kWarps];
  __shared__ uint64_t chosen[kMaxTopLogprobs];
  __shared__ uint32_t rank_counts[kRankSlots];
  __shared__ uint32_t chosen_bin, chosen_remaining, gathered_above;  // gathered_above: slots handed out

  int64_t const row = blockIdx.x;
  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  double const lse = __ldg(p.lse + row);
  RowView const view{p.values + row * p.row_stride, p.vocab_size, lse, static_cast<float>(lse), p.raw};
  int64_t const vocab = p.vocab_size;

  uint32_t prefix = 0, prefix_mask = 0, remaining = static_cast<uint32_t>(p.top_n);
  // Ranks, kRankSlots tokens a pass; the first pass also histograms the first digit.
  for (int64_t s0 = 0; s0 < p.num_samples || (s0 == 0 && p.top_n > 0); s0 += kRankSlots) {
    int const slots = p.num_samples - s0 < kRankSlots ? static_cast<int>(p.num_samples - s0) : kRankSlots;
    uint32_t token_hi[kRankSlots];
    int64_t token[kRankSlots];
    uint32_t count[kRankSlots];
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      token[k] = k < slots ? __ldg(p.tokens + row * p.num_samples + s0 + k) : -1;
      bool const valid = token[k] >= 0 && token[k] < vocab;
      token_hi[k] = valid ? order_bits(view.logprob(token[k])) : 0u;
      if (!valid) token[k] = -1;
      count[k] = 0;
    }
    bool const histogram = s0 == 0 && p.top_n > 0;
    if (tid < kBins) hist[tid] = 0;
    if (tid < kRankSlots) rank_counts[tid] = 0;
    __syncthreads();
#pragma unroll 4
    for (int64_t v = tid; v < vocab; v += kThreads) {
      uint32_t const hi = order_bits(view.logprob(v));
      if (histogram) atomicAdd(&hist[hi >> (32 - kDigitBits)], 1u);
#pragma unroll
      for (int k = 0; k < kRankSlots; ++k) {
        count[k] += (hi > token_hi[k] || (hi == token_hi[k] && v < token[k])) ? 1u : 0u;
      }
    }
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      uint32_t const warp_count = __reduce_add_sync(0xFFFFFFFFu, count[k]);
      if (lane == 0) atomicAdd(&rank_counts[k], warp_count);
    }
    __syncthreads();
    if (tid < slots) {
      p.ranks[row * p.num_samples + s0 + tid] = token[tid] >= 0 ? static_cast<int64_t>(rank_counts[tid]) + 1 : 0;
    }
    if (histogram) {
      choose_bin(hist, remaining, &chosen_bin, &chosen_remaining);
      prefix = chosen_bin << (32 - kDigitBits);
      prefix_mask = 0xFFFFFFFFu << (32 - kDigitBits);
      remaining = chosen_remaining;
    }
    __syncthreads();
  }
  if (p.top_n == 0) return;

  // The remaining digits of the N-th key's hi.
  for (int shift = 32 - 2 * kDigitBits; shift >= 0; shift -= kDigitBits) {
    if (tid < kBins) hist[tid] = 0;
    __syncthreads();
#pragma unroll 4
    for (int64_t v = tid; v < vocab; v += kThreads) {
      uint32_t const hi = order_bits(view.logprob(v));
      if ((hi & prefix_mask) == prefix) atomicAdd(&hist[(hi >> shift) & (kBins - 1)], 1u);
    }
    __syncthreads();
    choose_bin(hist, remaining, &chosen_bin, &chosen_remaining);
    prefix |= chosen_bin << shift;
    prefix_mask |= static_cast<uint32_t>(kBins - 1) << shift;
    remaining = chosen_remaining;
    __syncthreads();
  }

  // Gather: the keys above `prefix`, then the first `remaining` ties in index order.
  uint32_t const threshold = prefix, ties_wanted = remaining;
  uint32_t const above_total = static_cast<uint32_t>(p.top_n) - ties_wanted;
  if (tid == 0) gathered_above = 0;
  __syncthreads();
  uint32_t ties_before = 0, above_before = 0;  // the same in every thread
  for (int64_t base = 0; base < vocab; base += kThreads) {
    int64_t const v = base + tid;
    bool const in_row = v < vocab;
    uint32_t const hi = in_row ? order_bits(view.logprob(v)) : 0u;
    bool const above = in_row && hi > threshold, tie = in_row && hi == threshold;
    if (above) {
      uint32_t const slot = atomicAdd(&gathered_above, 1u);
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
  __syncthreads();

  // Order the N keys (distinct) by counting.
  if (tid < p.top_n) {
    uint64_t const key = chosen[tid];
    int position = 0;
    for (int k = 0; k < p.top_n; ++k) position += chosen[k] > key ? 1 : 0;
    int64_t const v = 0xFFFFFFFFu - static_cast<uint32_t>(key);
    p.top_ids[row * p.top_n + position] = v;
    p.top_values[row * p.top_n + position] = view.logprob(v);
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
