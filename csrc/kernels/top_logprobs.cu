// The top-N log-probabilities of a row and the ranks of its sampled tokens, from materialised
// values (flashsampling/top_logprobs.h has the contract). Exact whatever the data, no sort of the
// row. Keys are 64 bits: the order bits of t (hi; unsigned order = the output order, NaN highest)
// and ~v (lo), so every key is distinct and a larger key comes first. A radix select over the
// keys' digits (11, 11, 10 bits of hi, then of lo) finds the N-th key, in three launches:
//
//  1. slices of the row, several CTAs a row (about two CTAs an SM over the batch): digit 0's
//     histogram, and per sampled token the keys above the token's (its rank), added into the
//     workspace;
//  2. the same slices: where the keys from digit 0's chosen bin up fit a row's buffer (4096; the
//     usual case: the top N of a row lie in its far tail), they are copied there;
//  3. a CTA a row: the remaining digits, the gather of the N keys and their order over the
//     buffer; where the keys did not fit, two passes over the row find the rest of hi and one
//     gathers the keys above it and its first ties in index order (a block-wide ordered
//     compaction), stopping once it has them.
//
// So a row is read twice, each time by several CTAs: at small B one CTA's loads alone would
// bound a pass (instruction latency, not bandwidth); with row_modes (a few rows, often none) each
// row gets the slices of a batch of one. Loads go as float4, two a thread in flight.
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
  float scale;  // 1 where the call has no scales: fl32(x * 1) = x, so the same bits
  bool raw;

  // t of a value, as logprobs.py's `normalised` computes it (of the value scaled).
  __device__ __forceinline__ float logprob_of(float x) const {
    x = __fmul_rn(x, scale);
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

// atomicAdd(&counts[bin], 1) of the lanes here, one atomic a distinct bin: a row's keys crowd into
// a few bins of the first digit (the exponents of its log-probabilities), where lanes adding one
// each would serialise on the same words.
__device__ __forceinline__ void add_to_bin(uint32_t* counts, uint32_t bin) {
  unsigned const peers = __match_any_sync(__activemask(), bin);
  if ((threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&counts[bin], static_cast<uint32_t>(__popc(peers)));
}

// A slot of `*fill` for each lane here that `takes` one, one atomic a warp (in lane order).
__device__ __forceinline__ uint32_t take_slot(uint32_t* fill, bool takes) {
  unsigned const lanes = __ballot_sync(__activemask(), takes);
  if (!takes) return 0;
  int const lane = threadIdx.x & 31, leader = __ffs(lanes) - 1;
  uint32_t base = 0;
  if (lane == leader) base = atomicAdd(fill, static_cast<uint32_t>(__popc(lanes)));
  base = __shfl_sync(lanes, base, leader);
  return base + static_cast<uint32_t>(__popc(lanes & ((1u << lane) - 1u)));
}

// Calls f(v, x) for every v of [begin, end) of a row of `vocab` values, kLoadsPerThread loads a
// thread in flight: float4 loads where the row allows them (16-byte aligned, V and begin
// multiples of 4: the usual vocabularies; slices of the row start at multiples of 4).
template <class F>
__device__ __forceinline__ void for_each_value(const float* values, int64_t vocab, int64_t begin, int64_t end,
                                               F&& f) {
  if (reinterpret_cast<uintptr_t>(values) % 16 == 0 && vocab % 4 == 0 && begin % 4 == 0) {
    float4 const* quads = reinterpret_cast<float4 const*>(values);
    int64_t const quad_end = end / 4;
    for (int64_t base = begin / 4 + threadIdx.x; base < quad_end; base += kLoadsPerThread * kThreads) {
      float4 x[kLoadsPerThread];
#pragma unroll
      for (int k = 0; k < kLoadsPerThread; ++k) {
        int64_t const i = base + k * kThreads;
        x[k] = i < quad_end ? __ldg(quads + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll
      for (int k = 0; k < kLoadsPerThread; ++k) {
        int64_t const i = base + k * kThreads;
        if (i < quad_end) {
          f(4 * i, x[k].x);
          f(4 * i + 1, x[k].y);
          f(4 * i + 2, x[k].z);
          f(4 * i + 3, x[k].w);
        }
      }
    }
    return;
  }
  for (int64_t base = begin + threadIdx.x; base < end; base += kLoadsPerThread * kThreads) {
    float x[kLoadsPerThread];
#pragma unroll
    for (int k = 0; k < kLoadsPerThread; ++k) {
      int64_t const v = base + k * kThreads;
      x[k] = v < end ? __ldg(values + v) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kLoadsPerThread; ++k) {
      int64_t const v = base + k * kThreads;
      if (v < end) f(v, x[k]);
    }
  }
}

// Calls f(v, hi) for every v of [begin, end) of the row: hi the order bits of its t.
template <class F>
__device__ __forceinline__ void for_each_key(RowView const& view, int64_t begin, int64_t end, F&& f) {
  for_each_value(view.values, view.vocab, begin, end,
                 [&](int64_t v, float x) { f(v, order_bits(view.logprob_of(x))); });
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

__device__ __forceinline__ RowView row_view(TopLogprobsParams const& p, int64_t row) {
  float const scale = p.scales != nullptr ? __ldg(p.scales + row) : 1.0f;
  if (p.lse_float != nullptr) {
    float const lse = __ldg(p.lse_float + row);
    return RowView{p.values + row * p.row_stride, p.vocab_size, static_cast<double>(lse), lse, scale, p.raw};
  }
  double const lse = __ldg(p.lse + row);
  return RowView{p.values + row * p.row_stride, p.vocab_size, lse, static_cast<float>(lse), scale, p.raw};
}

// What the row wants of this call (TopLogprobsParams::row_modes).
__device__ __forceinline__ uint8_t row_mode(TopLogprobsParams const& p, int64_t row) {
  return p.row_modes != nullptr ? __ldg(p.row_modes + row) : uint8_t{kTopLogprobsRank | kTopLogprobsTop};
}
__device__ __forceinline__ int row_top_n(TopLogprobsParams const& p, uint8_t mode) {
  return (mode & kTopLogprobsTop) ? p.top_n : 0;
}
__device__ __forceinline__ int64_t row_samples(TopLogprobsParams const& p, uint8_t mode) {
  return (mode & kTopLogprobsRank) ? p.num_samples : 0;
}

// Sample s's token of the row as a local id, -1 where it ranks nothing (outside [0, V), or a
// row without a sample: lse_float not above -inf).
__device__ __forceinline__ int64_t local_token(TopLogprobsParams const& p, RowView const& view, int64_t row,
                                               int64_t s) {
  int64_t const token = __ldg(p.tokens + row * p.num_samples + s) - p.token_base;
  bool const sampled = p.lse_float == nullptr || view.lse_f > -INFINITY;
  return sampled && token >= 0 && token < view.vocab ? token : -1;
}

// [begin, end) of slice `slice` of `slices`: a multiple of 4 elements each (the float4 loads).
__device__ __forceinline__ void slice_bounds(int64_t vocab, int slices, int slice, int64_t& begin, int64_t& end) {
  int64_t const step = ((vocab + slices - 1) / slices + 3) / 4 * 4;
  begin = min(vocab, step * slice);
  end = min(vocab, begin + step);
}

// The row's histogram of digit 0 (from the workspace) into shared memory, then the selection of
// digit 0 in every thread; returns how many keys lie in the chosen bin or above it.
__device__ uint32_t select_first_digit(TopLogprobsWorkspace const& w, int64_t row, int n, uint32_t* hist,
                                       Selection& sel, uint32_t* shared_bin, uint32_t* shared_before) {
  for (int i = threadIdx.x; i < kMaxBins; i += kThreads) hist[i] = w.hist[row * kMaxBins + i];
  __syncthreads();
  sel = Selection{};
  sel.remaining = static_cast<uint32_t>(n);
  choose_bin(hist, 0, sel, shared_bin, shared_before);
  return sel.above + hist[*shared_bin];
}

// Step 1, a slice of a row a CTA (grid: B x slices): digit 0's histogram and the keys above each
// sampled token's, added into the workspace.
__global__ void __launch_bounds__(kThreads) top_logprobs_histogram_kernel(TopLogprobsParams p, TopLogprobsWorkspace w) {
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint32_t rank_counts[kRankSlots];
  int64_t const row = blockIdx.x;
  uint8_t const mode = row_mode(p, row);
  if (mode == 0) return;
  int const tid = threadIdx.x, lane = tid & 31, n = row_top_n(p, mode);
  int64_t const samples = row_samples(p, mode);
  RowView const view = row_view(p, row);
  int64_t begin, end;
  slice_bounds(view.vocab, gridDim.y, blockIdx.y, begin, end);
  if (n > 0) {
    for (int i = tid; i < kMaxBins; i += kThreads) hist[i] = 0;
  }
  for (int64_t s0 = 0; s0 < samples || (s0 == 0 && n > 0); s0 += kRankSlots) {
    int const slots = samples - s0 < kRankSlots ? static_cast<int>(samples - s0) : kRankSlots;
    uint32_t token_hi[kRankSlots], count[kRankSlots];
    int64_t token[kRankSlots];
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      token[k] = k < slots ? local_token(p, view, row, s0 + k) : -1;
      token_hi[k] = token[k] >= 0 ? order_bits(view.logprob(token[k])) : 0u;
      count[k] = 0;
    }
    bool const histogram = s0 == 0 && n > 0;
    if (tid < kRankSlots) rank_counts[tid] = 0;
    __syncthreads();
    for_each_key(view, begin, end, [&](int64_t v, uint32_t hi) {
      if (histogram) add_to_bin(hist, hi >> (32 - kDigitBits[0]));
#pragma unroll
      for (int k = 0; k < kRankSlots; ++k) {
        count[k] += (hi > token_hi[k] || (hi == token_hi[k] && v < token[k])) ? 1u : 0u;
      }
    });
#pragma unroll
    for (int k = 0; k < kRankSlots; ++k) {
      uint32_t const warp_count = __reduce_add_sync(0xFFFFFFFFu, count[k]);
      if (lane == 0 && warp_count != 0) atomicAdd(&rank_counts[k], warp_count);
    }
    __syncthreads();
    if (tid < slots && rank_counts[tid] != 0) atomicAdd(&w.counts[row * p.num_samples + s0 + tid], rank_counts[tid]);
    __syncthreads();
  }
  if (n > 0) {
    for (int i = tid; i < kMaxBins; i += kThreads) {
      if (hist[i] != 0) atomicAdd(&w.hist[row * kMaxBins + i], hist[i]);
    }
  }
}

// Step 2, a slice a CTA: where the keys from digit 0's chosen bin up fit the row's buffer, they
// go there (any order: their order is decided by their values).
__global__ void __launch_bounds__(kThreads) top_logprobs_collect_kernel(TopLogprobsParams p, TopLogprobsWorkspace w) {
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint32_t shared_bin, shared_before;
  int64_t const row = blockIdx.x;
  int const n = row_top_n(p, row_mode(p, row));
  if (n == 0) return;
  Selection sel;
  uint32_t const candidates = select_first_digit(w, row, n, hist, sel, &shared_bin, &shared_before);
  if (candidates > kBufferCapacity) return;
  RowView const view = row_view(p, row);
  int64_t begin, end;
  slice_bounds(view.vocab, gridDim.y, blockIdx.y, begin, end);
  uint32_t const first_bin = shared_bin;
  uint64_t* buffer = w.buffer + row * kBufferCapacity;
  for_each_key(view, begin, end, [&](int64_t v, uint32_t hi) {
    bool const takes = (hi >> (32 - kDigitBits[0])) >= first_bin;
    uint32_t const slot = take_slot(&w.filled[row], takes);
    if (takes && slot < kBufferCapacity) buffer[slot] = order_key(hi, v);
  });
}

// Step 3, a row a CTA: the ranks; the rest of the select over the buffer, or where the keys did
// not fit it over the row (the rest of hi, then the keys above it and its first ties in index
// order); then the N keys in order.
__global__ void __launch_bounds__(kThreads) top_logprobs_finish_kernel(TopLogprobsParams p, TopLogprobsWorkspace w) {
  __shared__ uint32_t hist[kMaxBins];
  __shared__ uint64_t buffer[kBufferCapacity];
  __shared__ uint64_t chosen[kMaxTopLogprobs];
  __shared__ uint32_t warp_ties[kWarps], warp_above[kWarps];
  __shared__ uint32_t shared_bin, shared_before, gathered;

  int64_t const row = blockIdx.x;
  uint8_t const mode = row_mode(p, row);
  int const tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n = row_top_n(p, mode);
  RowView const view = row_view(p, row);
  int64_t const vocab = p.vocab_size;
  for (int64_t s = tid; s < row_samples(p, mode); s += kThreads) {
    int64_t const token = local_token(p, view, row, s);
    bool const valid = token >= 0;
    p.ranks[row * p.num_samples + s] = valid ? static_cast<int64_t>(w.counts[row * p.num_samples + s]) + 1 : 0;
    if (p.token_values != nullptr) {
      p.token_values[row * p.num_samples + s] = valid ? view.logprob(token) : __uint_as_float(0x7fc00000u);
    }
  }
  if (n == 0) return;

  Selection sel;
  uint32_t const candidates = select_first_digit(w, row, n, hist, sel, &shared_bin, &shared_before);
  __syncthreads();
  if (candidates <= kBufferCapacity) {
    uint32_t const size = min(w.filled[row], static_cast<uint32_t>(kBufferCapacity));
    for (uint32_t i = tid; i < size; i += kThreads) buffer[i] = w.buffer[row * kBufferCapacity + i];
    __syncthreads();
    for (int d = 1; d < kDigits; ++d) {
      for (int i = tid; i < kMaxBins; i += kThreads) hist[i] = 0;
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
    for (int d = 1; d < 3; ++d) {
      for (int i = tid; i < kMaxBins; i += kThreads) hist[i] = 0;
      __syncthreads();
      for_each_key(view, 0, vocab, [&](int64_t, uint32_t hi) {
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
      for (int k = 0; k < kWarps; ++k) {
        position += k < warp ? warp_ties[k] : 0u;
        ties_before += warp_ties[k];
        above_before += warp_above[k];
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

// A running log-sum-exp in float32: the largest finite value m and the sum of exp(v - m), with
// flags for NaN and +inf (which torch.logsumexp returns as the row's result).
struct RunningLogSumExp {
  float max = -INFINITY;
  float sum = 0.0f;
  bool nan = false, pos_inf = false;

  __device__ __forceinline__ void add(float v) {
    if (v != v) {
      nan = true;
    } else if (v == INFINITY) {
      pos_inf = true;
    } else if (v > max) {
      sum = fmaf(sum, __expf(max - v), 1.0f);
      max = v;
    } else if (v != -INFINITY) {
      sum += __expf(v - max);
    }
  }
  __device__ __forceinline__ void merge(RunningLogSumExp const& o) {
    nan = nan || o.nan;
    pos_inf = pos_inf || o.pos_inf;
    float const m = fmaxf(max, o.max);
    if (m == -INFINITY) return;
    sum = (max == -INFINITY ? 0.0f : sum * __expf(max - m)) + (o.max == -INFINITY ? 0.0f : o.sum * __expf(o.max - m));
    max = m;
  }
  __device__ __forceinline__ void merge_warp() {
#pragma unroll
    for (int delta = 16; delta > 0; delta >>= 1) {
      RunningLogSumExp o;
      o.max = __shfl_xor_sync(0xFFFFFFFFu, max, delta);
      o.sum = __shfl_xor_sync(0xFFFFFFFFu, sum, delta);
      o.nan = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(nan), delta) != 0;
      o.pos_inf = __shfl_xor_sync(0xFFFFFFFFu, static_cast<int>(pos_inf), delta) != 0;
      merge(o);
    }
  }
  __device__ __forceinline__ float result() const {
    return nan ? __uint_as_float(0x7fc00000u) : pos_inf ? INFINITY : max == -INFINITY ? -INFINITY : max + logf(sum);
  }
};

__global__ void __launch_bounds__(kThreads) row_logsumexp_kernel(const float* __restrict__ values, int64_t row_stride,
                                                                 int64_t vocab, float* __restrict__ lse) {
  __shared__ RunningLogSumExp warp_parts[kWarps];
  int64_t const row = blockIdx.x;
  const float* const row_values = values + row * row_stride;
  RunningLogSumExp part;
  for_each_value(row_values, vocab, 0, vocab, [&](int64_t, float x) { part.add(x); });
  part.merge_warp();
  int const warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) warp_parts[warp] = part;
  __syncthreads();
  if (threadIdx.x == 0) {
    RunningLogSumExp total = warp_parts[0];
    for (int w = 1; w < kWarps; ++w) total.merge(warp_parts[w]);
    lse[row] = total.result();
  }
}

}  // namespace

cudaError_t launch_row_logsumexp(const float* values, int64_t row_stride, int64_t batch, int64_t vocab, float* lse,
                                 cudaStream_t stream) {
  if (batch == 0) return cudaSuccess;
  if (batch > INT32_MAX || vocab < 0) return cudaErrorInvalidValue;
  row_logsumexp_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(values, row_stride, vocab, lse);
  return cudaGetLastError();
}

size_t top_logprobs_workspace_bytes(int64_t batch, int64_t num_samples) {
  return static_cast<size_t>(batch) * (kMaxBins * sizeof(uint32_t) + num_samples * sizeof(uint32_t) + sizeof(uint32_t) +
                                       kBufferCapacity * sizeof(uint64_t));
}

int top_logprobs_slices(int64_t batch, int64_t vocab, int sm_count) {
  // About two CTAs an SM over the batch, each slice at least 8192 elements, at most 32 slices.
  int64_t slices = (2 * static_cast<int64_t>(sm_count) + batch - 1) / batch;
  int64_t const most = (vocab + 8191) / 8192;
  slices = slices < most ? slices : most;
  return static_cast<int>(slices < 1 ? 1 : (slices > 32 ? 32 : slices));
}

cudaError_t launch_top_logprobs(TopLogprobsParams const& params, void* workspace, int sm_count, cudaStream_t stream) {
  if (params.batch_size == 0) return cudaSuccess;
  if (params.top_n < 0 || params.top_n > kMaxTopLogprobs || params.top_n > params.vocab_size ||
      params.vocab_size < 1 || params.vocab_size > (int64_t{1} << 32) - 1 || params.batch_size > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  int64_t const batch = params.batch_size;
  // Layout: buffer (8-byte keys first, aligned), then hist, counts, filled.
  TopLogprobsWorkspace w;
  w.buffer = static_cast<uint64_t*>(workspace);
  w.hist = reinterpret_cast<uint32_t*>(w.buffer + batch * kBufferCapacity);
  w.counts = w.hist + batch * kMaxBins;
  w.filled = w.counts + batch * params.num_samples;
  size_t const zeroed = static_cast<size_t>(batch) * (kMaxBins + params.num_samples + 1) * sizeof(uint32_t);
  cudaError_t err = cudaMemsetAsync(w.hist, 0, zeroed, stream);
  if (err != cudaSuccess) return err;
  // With row_modes usually a few rows (often none) want the passes: each gets as many slices as a
  // batch of one, so that their passes do not wait on a few CTAs; the other rows' CTAs return at once.
  int64_t const sliced_rows = params.row_modes != nullptr ? 1 : batch;
  dim3 const sliced(static_cast<unsigned>(batch),
                    static_cast<unsigned>(top_logprobs_slices(sliced_rows, params.vocab_size, sm_count)));
  top_logprobs_histogram_kernel<<<sliced, kThreads, 0, stream>>>(params, w);
  if (params.top_n > 0) {
    top_logprobs_collect_kernel<<<sliced, kThreads, 0, stream>>>(params, w);
  }
  top_logprobs_finish_kernel<<<static_cast<unsigned>(batch), kThreads, 0, stream>>>(params, w);
  return cudaGetLastError();
}

}  // namespace flashsampling
