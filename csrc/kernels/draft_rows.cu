// The kernels of speculative verification (flashsampling/draft_rows_launch.h has their
// contracts): with sampled drafts, each draft position's log-sum-exp, argmax and draft value in one
// pass over its logits (blocks over vocabulary chunks, then a warp an item merges their partials),
// the acceptance walk (a thread a row), and each row's emitted sample's logits (the residual after
// a rejection, else the target) in one elementwise pass over the row where it stops and a second
// over the rows whose residual has no mass; for either kind of draft, the step's tokens.
#include <cmath>
#include <cstdint>

#include "flashsampling/draft_rows_launch.h"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/zero_bytes.h"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;  // loads in flight per thread
// A (row, position)'s vocabulary in chunks, a block each: many blocks a row, so that a few rows
// still spread over the GPU (a block a row left a row's pass latency-bound), but no more blocks
// than about kTargetBlocks in all, so that many rows amortise each block's merge of its warps
// (chunks of kMinChunk tokens at B = 64, n = 4 spent more on the merges than on their 16 tokens a
// thread). A function of the shapes: the workspace holds a partial per block.
constexpr int64_t kMinChunk = 4096;
constexpr int64_t kTargetBlocks = 1024;

int64_t position_chunk_tokens(int64_t items, int64_t vocab) {
  int64_t const most_chunks = (vocab + kMinChunk - 1) / kMinChunk;
  int64_t chunks = items < 1 ? 1 : (kTargetBlocks + items - 1) / items;  // no items (n = 0): any size
  chunks = chunks < 1 ? 1 : chunks > most_chunks ? most_chunks : chunks;
  int64_t const step = int64_t{kThreads} * kUnroll;
  return ((vocab + chunks - 1) / chunks + step - 1) / step * step;
}

// A running log-sum-exp: m the largest term so far, s the sum of exp(term - m).
struct LogSumExp {
  float m = -INFINITY;
  float s = 0.0f;

  __device__ void add(float y) {
    if (y == -INFINITY) return;  // no mass (and exp(-inf - -inf) would be NaN)
    if (y == INFINITY || m == INFINITY) {  // +inf terms: lse +inf, as torch.logsumexp (no inf - inf) ...
      bool const nan = isnan(s) || isnan(y);  // ... but NaN where any term is NaN
      s = nan ? NAN : m == INFINITY ? s + (y == INFINITY ? 1.0f : 0.0f) : 1.0f;
      m = INFINITY;
      return;
    }
    if (y > m) {
      s = s * expf(m - y) + 1.0f;
      m = y;
    } else {
      s += expf(y - m);  // a NaN y makes s NaN, as torch.logsumexp gives NaN
    }
  }
  __device__ void merge(LogSumExp o) {
    if (o.m == -INFINITY && !isnan(o.s)) return;
    if (m == -INFINITY && !isnan(s)) {
      *this = o;
      return;
    }
    if (m == INFINITY || o.m == INFINITY) {
      bool const nan = isnan(s) || isnan(o.s);
      s = nan ? NAN : m == INFINITY ? (o.m == INFINITY ? s + o.s : s) : o.s;
      m = INFINITY;
      return;
    }
    float const top = fmaxf(m, o.m);
    s = s * expf(m - top) + o.s * expf(o.m - top);
    m = top;
  }
  __device__ float value() const { return m + logf(s); }  // -inf + log 0 = -inf where nothing
};

// The largest y and its first index, NaN counting as largest (torch.max's order).
struct Best {
  float v = -INFINITY;
  int64_t i = INT64_MAX;

  __device__ void take(float y, int64_t index) {
    bool const nan_y = isnan(y), nan_v = isnan(v);
    bool const better = (nan_y && !nan_v) || (!nan_v && y > v) || ((y == v || (nan_y && nan_v)) && index < i);
    if (better) {
      v = y;
      i = index;
    }
  }
};

struct Partial {
  LogSumExp lse;
  Best best;
};

__device__ __forceinline__ float scaled_logit(float const* x, bool const* allowed, int64_t at, float scale) {
  if (allowed != nullptr && !allowed[at]) return -INFINITY;
  return __fmul_rn(__ldg(x + at), scale);
}

__device__ __forceinline__ void merge_over_warp(Partial& part) {
  for (int delta = 16; delta > 0; delta /= 2) {
    LogSumExp other;
    other.m = __shfl_xor_sync(0xFFFFFFFF, part.lse.m, delta);
    other.s = __shfl_xor_sync(0xFFFFFFFF, part.lse.s, delta);
    part.lse.merge(other);
    float const v = __shfl_xor_sync(0xFFFFFFFF, part.best.v, delta);
    int64_t const i = __shfl_xor_sync(0xFFFFFFFF, part.best.i, delta);
    part.best.take(v, i);
  }
}

// A thread's step: kUnroll loads of kWidth consecutive tokens (draft_position_partials_kernel),
// term k at this offset from the step's first token: in index order.
template <int kWidth>
__device__ __forceinline__ int64_t term_offset(int k) {
  return int64_t{k / kWidth} * kThreads * kWidth + k % kWidth;
}

// A thread's step is ordinary when its y are finite or -inf (positions past the chunk are -inf)
// and its terms so far hold no +inf or NaN: the usual case, which add_ordinary_step takes without
// LogSumExp::add's and Best::take's per-element tests of inf and NaN.
template <int kTerms>
__device__ __forceinline__ bool ordinary_step(Partial const& part, float const (&y)[kTerms]) {
  bool ordinary = part.lse.m != INFINITY && !isnan(part.lse.s);
#pragma unroll
  for (int k = 0; k < kTerms; ++k) ordinary = ordinary && y[k] < INFINITY;  // false for NaN and +inf
  return ordinary;
}

// An ordinary step's terms: the running log-sum-exp rescaled once to the step's largest term
// (exp(-inf - m) = 0 adds nothing), and the best y by `>` in index order (the earlier index keeps a
// tie, as Best::take; a -inf y takes nothing here, where Best::take would record its index: that
// index only ever ends up the argmax of a row whose every y is -inf, whose argmax is index 0 both
// ways, the finish kernel's default).
template <int kWidth, int kTerms>
__device__ __forceinline__ void add_ordinary_step(Partial& part, float const (&y)[kTerms], int64_t v0) {
  float step_max = y[0];
#pragma unroll
  for (int k = 1; k < kTerms; ++k) step_max = fmaxf(step_max, y[k]);
  float const m = fmaxf(part.lse.m, step_max);
  if (m != -INFINITY) {
    float s = part.lse.s * expf(part.lse.m - m);  // 0 * 0 while nothing had mass
#pragma unroll
    for (int k = 0; k < kTerms; ++k) s += expf(y[k] - m);
    part.lse.m = m;
    part.lse.s = s;
  }
#pragma unroll
  for (int k = 0; k < kTerms; ++k) {
    if (y[k] > part.best.v) {
      part.best.v = y[k];
      part.best.i = v0 + term_offset<kWidth>(k);
    }
  }
}

// Block (item r = b * J + j, chunk c): the chunk's terms, kUnroll loads in flight per thread, then
// the warps, then the block; its partial to the workspace [items, chunks]. kWidth = 4 (no mask, V
// a multiple of 4, 16-byte aligned logits: launch_draft_position_stats) loads four consecutive
// tokens at a time, so that a thread has four times the bytes in flight; a group of four then
// lies wholly inside the chunk or past its end (the chunk is a multiple of 1024 tokens).
template <int kWidth>
__global__ void __launch_bounds__(kThreads) draft_position_partials_kernel(DraftPositionStatsParams p,
                                                                            Partial* partials, int64_t chunk) {
  constexpr int kTerms = kUnroll * kWidth;
  constexpr int64_t kStep = int64_t{kThreads} * kUnroll * kWidth;
  int64_t const chunks = gridDim.y, item = blockIdx.x, c = blockIdx.y;
  int64_t const b = item / p.columns, j = item % p.columns;
  int64_t const base = (b * p.positions + j) * p.vocab;
  float const scale = p.scales[b];
  int64_t const end = min(p.vocab, (c + 1) * chunk);
  Partial part;
  for (int64_t v0 = c * chunk + int64_t{threadIdx.x} * kWidth; v0 < end; v0 += kStep) {
    float y[kTerms];
    if constexpr (kWidth == 4) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int64_t const v = v0 + term_offset<kWidth>(u * kWidth);
        bool const in = v < end;
        float4 const x = in ? __ldg(reinterpret_cast<float4 const*>(p.logits + base + v)) : float4{};
        y[u * 4 + 0] = in ? __fmul_rn(x.x, scale) : -INFINITY;
        y[u * 4 + 1] = in ? __fmul_rn(x.y, scale) : -INFINITY;
        y[u * 4 + 2] = in ? __fmul_rn(x.z, scale) : -INFINITY;
        y[u * 4 + 3] = in ? __fmul_rn(x.w, scale) : -INFINITY;
      }
    } else if (p.allowed == nullptr && v0 + (kUnroll - 1) * kThreads < end) {  // the loads without a branch
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) y[u] = __fmul_rn(__ldg(p.logits + base + v0 + u * kThreads), scale);
    } else {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int64_t const v = v0 + u * kThreads;
        y[u] = v < end ? scaled_logit(p.logits, p.allowed, base + v, scale) : -INFINITY;
      }
    }
    if (ordinary_step(part, y)) {
      add_ordinary_step<kWidth>(part, y, v0);
      continue;
    }
#pragma unroll
    for (int k = 0; k < kTerms; ++k) {
      int64_t const v = v0 + term_offset<kWidth>(k);
      if (v < end) {
        part.lse.add(y[k]);
        part.best.take(y[k], v);
      }
    }
  }
  merge_over_warp(part);
  __shared__ Partial warp_parts[kWarps];
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_parts[warp] = part;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kWarps; ++w) {
    part.lse.merge(warp_parts[w].lse);
    part.best.take(warp_parts[w].best.v, warp_parts[w].best.i);
  }
  partials[item * chunks + c] = part;
}

// A warp an item: its chunks' partials merged, then the outputs.
__global__ void __launch_bounds__(kThreads) draft_position_finish_kernel(DraftPositionStatsParams p,
                                                                          Partial const* partials, int64_t chunks) {
  int64_t const item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  if (item >= p.batch * p.columns) return;
  Partial part;
  for (int64_t c = lane; c < chunks; c += 32) {
    Partial const other = partials[item * chunks + c];
    part.lse.merge(other.lse);
    part.best.take(other.best.v, other.best.i);
  }
  merge_over_warp(part);
  if (lane != 0) return;
  int64_t const b = item / p.columns, j = item % p.columns;
  p.lse[item] = part.lse.value();
  p.argmax[item] = part.best.i == INT64_MAX ? 0 : part.best.i;  // (V >= 1: some index always takes)
  int64_t const d = p.draft_columns[item];
  p.y_draft[item] = d < 0 || d >= p.vocab
                        ? -INFINITY
                        : scaled_logit(p.logits, p.allowed, (b * p.positions + j) * p.vocab + d, p.scales[b]);
}

// The acceptance uniforms' vocabulary index, which no token has (speculative.py's _ACCEPT_INDEX).
constexpr uint32_t kAcceptIndex = 0xFFFFFFFFu;

// Whether row b accepts its draft at position j (AcceptDraftsParams). The arithmetic is the CPU
// kernel's torch ops' (speculative.py): fp32 difference, then float64 exp, division and comparison.
__device__ bool draft_accepted(AcceptDraftsParams const& p, int64_t b, int64_t j, bool greedy) {
  int64_t const d = p.draft_columns[b * p.drafts + j];
  bool const inside = d >= 0 && d < p.vocab;
  float const y = p.y_draft[b * p.stats_stride + j];
  if (greedy) return inside && d == p.argmax[b * p.stats_stride + j] && y > -INFINITY;
  if (!inside) return false;  // min(1, p / q) is 0
  double const target = exp(static_cast<double>(__fsub_rn(y, p.lse[b * p.stats_stride + j])));
  double const draft = static_cast<double>(p.draft_probs[(b * p.drafts + j) * p.vocab + d]);
  double const ratio = draft > 0.0 ? target / draft : INFINITY;
  double const accept = ratio > 1.0 ? 1.0 : ratio;  // NaN stays NaN (torch's clamp) and rejects
  double const u = static_cast<double>(fs_uniform_noise(static_cast<uint64_t>(p.seeds[b * p.seed_stride]),
                                                        static_cast<uint64_t>(p.offsets[b * p.offset_stride]),
                                                        static_cast<uint32_t>(p.streams[b * p.stream_stride]),
                                                        static_cast<uint32_t>(j), kAcceptIndex));
  return u < accept;
}

__global__ void accept_drafts_kernel(AcceptDraftsParams p) {
  int64_t const b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  float const temp = p.temps[b * p.temp_stride];
  bool const greedy = temp == 0.0f;
  int64_t accepted = 0;
  while (accepted < p.drafts && draft_accepted(p, b, accepted, greedy)) ++accepted;
  bool const residual = accepted < p.drafts && !greedy;
  p.num_accepted[b] = accepted;
  p.residual[b] = residual;
  p.sample_temps[b] = residual ? 1.0f : temp;
  p.sample_offsets[b] =
      static_cast<int64_t>(static_cast<uint64_t>(p.offsets[b * p.offset_stride]) + static_cast<uint64_t>(accepted));
}

__global__ void draft_tokens_kernel(DraftTokensParams p) {
  int64_t const b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.batch) return;
  int64_t const* drafts = p.draft_token_ids + b * p.drafts;
  int64_t const* emitted = p.emitted + b * p.emitted_width;
  int64_t accepted = 0;
  if (p.num_accepted != nullptr) {
    accepted = min(max(p.num_accepted[b], int64_t{0}), p.drafts);  // (callers give [0, n]; the CPU kernel clamps alike)
  } else {
    while (accepted < p.drafts && emitted[accepted] == drafts[accepted] && emitted[accepted] >= 0) ++accepted;
  }
  int64_t const final_token = emitted[p.emitted_width == 1 ? 0 : accepted];
  int64_t* tokens = p.tokens + b * (p.drafts + 1);
  for (int64_t s = 0; s <= p.drafts; ++s) tokens[s] = s < accepted ? drafts[s] : s == accepted ? final_token : -1;
  p.num_accepted_out[b] = accepted;
}

// One element of a stop row: the residual's logit log(max(0, p - q)) on a residual row, else the
// target's logit (-inf where not allowed). Returns whether it has mass.
__device__ __forceinline__ bool stop_row_value(float x, bool allowed, float q, float scale, float lse, bool residual,
                                               float& out) {
  float const y = allowed ? __fmul_rn(x, scale) : -INFINITY;  // scaled_logit's
  if (residual) {
    // fmaxf maps NaN to 0: no mass (the CPU kernel's nan_to_num)
    out = logf(fmaxf(__fsub_rn(expf(__fsub_rn(y, lse)), q), 0.0f));
    return out > -INFINITY;
  }
  out = y > -INFINITY ? x : -INFINITY;  // the sampler applies the temperature
  return false;
}

// Block (row b, a slice of kUnroll * kThreads * kWidth tokens): row b's stop-row logits. kWidth = 4
// (launch_stop_row_logits: V a multiple of 4 and 16-byte aligned logits, q and out, 4-byte aligned
// mask) loads and stores four tokens at a time, so that a thread has 4 * kWidth of each operand's
// elements in flight with few instructions; kWidth = 1 takes any layout. A residual row marks
// has_mass[b] where one of its values is above -inf (every such thread writes 1). A thread's loads
// all go out before its arithmetic and stores (the stores may alias them for the compiler).
template <int kWidth>
__global__ void __launch_bounds__(kThreads) stop_row_logits_kernel(StopRowLogitsParams p, uint8_t* has_mass) {
  int64_t const b = blockIdx.x;
  int64_t const s = min(max(p.stop[b], int64_t{0}), p.positions - 1);
  int64_t const base = (b * p.positions + s) * p.vocab;
  float const scale = p.scales[b];
  bool const residual = p.residual[b] && s < p.drafts;
  float const lse = residual ? p.lse[b * p.drafts + s] : 0.0f;
  float const* q = residual ? p.draft_probs + (b * p.drafts + s) * p.vocab : nullptr;
  float* out = p.out + b * p.vocab;
  int64_t const first = (static_cast<int64_t>(blockIdx.y) * kUnroll * kThreads + threadIdx.x) * kWidth;
  float x[kUnroll][kWidth], qv[kUnroll][kWidth];
  bool allowed[kUnroll][kWidth];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    int64_t const v = first + u * kThreads * kWidth;
    bool const in = v < p.vocab;  // kWidth = 4: the whole group (V a multiple of 4)
    if constexpr (kWidth == 4) {
      float4 const xs = in ? __ldg(reinterpret_cast<float4 const*>(p.logits + base + v)) : float4{};
      float4 const qs = in && residual ? __ldg(reinterpret_cast<float4 const*>(q + v)) : float4{};
      uint32_t const mask = !in ? 0u
                            : p.allowed == nullptr ? 0x01010101u
                                                   : __ldg(reinterpret_cast<unsigned int const*>(p.allowed + base + v));
      x[u][0] = xs.x, x[u][1] = xs.y, x[u][2] = xs.z, x[u][3] = xs.w;
      qv[u][0] = qs.x, qv[u][1] = qs.y, qv[u][2] = qs.z, qv[u][3] = qs.w;
#pragma unroll
      for (int w = 0; w < 4; ++w) allowed[u][w] = (mask >> (8 * w)) & 0xffu;
    } else {
      x[u][0] = in ? __ldg(p.logits + base + v) : 0.0f;
      allowed[u][0] = in && (p.allowed == nullptr || p.allowed[base + v]);
      qv[u][0] = in && residual ? __ldg(q + v) : 0.0f;
    }
  }
  bool mass = false;
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    int64_t const v = first + u * kThreads * kWidth;
    if (v >= p.vocab) break;
    float value[kWidth];
#pragma unroll
    for (int w = 0; w < kWidth; ++w) {
      mass |= stop_row_value(x[u][w], allowed[u][w], qv[u][w], scale, lse, residual, value[w]);
    }
    if constexpr (kWidth == 4) {
      *reinterpret_cast<float4*>(out + v) = float4{value[0], value[1], value[2], value[3]};
    } else {
      out[v] = value[0];
    }
  }
  if (mass) has_mass[b] = 1;
}

// The residual rows without mass (q >= p everywhere: rounding, or the draft distribution's sum
// tolerance) take the target's logits instead.
__global__ void __launch_bounds__(kThreads) stop_row_fallback_kernel(StopRowLogitsParams p,
                                                                      uint8_t const* has_mass) {
  int64_t const b = blockIdx.x;
  int64_t const s = min(max(p.stop[b], int64_t{0}), p.positions - 1);
  if (!(p.residual[b] && s < p.drafts) || has_mass[b]) return;
  int64_t const base = (b * p.positions + s) * p.vocab;
  float const scale = p.scales[b];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    int64_t const v = (static_cast<int64_t>(blockIdx.y) * kUnroll + u) * kThreads + threadIdx.x;
    if (v >= p.vocab) break;
    bool const allowed = p.allowed == nullptr || p.allowed[base + v];
    stop_row_value(__ldg(p.logits + base + v), allowed, 0.0f, scale, 0.0f, /*residual=*/false, p.out[b * p.vocab + v]);
  }
}

// Chunks a (row, position) of the stats pass takes, and their tokens.
int64_t position_chunks(DraftPositionStatsParams const& p, int64_t& chunk) {
  chunk = position_chunk_tokens(p.batch * p.columns, p.vocab);
  return (p.vocab + chunk - 1) / chunk;
}

}  // namespace

size_t draft_position_stats_workspace_bytes(DraftPositionStatsParams const& p) {
  int64_t chunk = 0;
  return static_cast<size_t>(p.batch * p.columns * position_chunks(p, chunk)) * sizeof(Partial);
}

cudaError_t launch_draft_position_stats(DraftPositionStatsParams const& p, void* workspace, cudaStream_t stream) {
  int64_t const items = p.batch * p.columns;
  if (items == 0) return cudaSuccess;
  int64_t chunk = 0;
  int64_t const chunks = position_chunks(p, chunk);
  auto* partials = static_cast<Partial*>(workspace);
  dim3 const grid(static_cast<unsigned>(items), static_cast<unsigned>(chunks));
  if (p.allowed == nullptr && p.vocab % 4 == 0 && reinterpret_cast<uintptr_t>(p.logits) % 16 == 0) {
    draft_position_partials_kernel<4><<<grid, kThreads, 0, stream>>>(p, partials, chunk);
  } else {
    draft_position_partials_kernel<1><<<grid, kThreads, 0, stream>>>(p, partials, chunk);
  }
  draft_position_finish_kernel<<<static_cast<unsigned>((items + kWarps - 1) / kWarps), kThreads, 0, stream>>>(
      p, partials, chunks);
  return cudaGetLastError();
}

size_t stop_row_logits_workspace_bytes(StopRowLogitsParams const& p) { return static_cast<size_t>(p.batch); }

cudaError_t launch_stop_row_logits(StopRowLogitsParams const& p, void* workspace, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  auto* has_mass = static_cast<uint8_t*>(workspace);
  cudaError_t const err = launch_zero_bytes(has_mass, static_cast<size_t>(p.batch), stream);
  if (err != cudaSuccess) return err;
  auto aligned = [](void const* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  bool const vectors = p.vocab % 4 == 0 && aligned(p.logits, 16) && aligned(p.draft_probs, 16) && aligned(p.out, 16) &&
                       (p.allowed == nullptr || aligned(p.allowed, 4));
  int64_t const width = vectors ? 4 : 1;
  int64_t const slice = kThreads * kUnroll * width;
  dim3 const grid(static_cast<unsigned>(p.batch), static_cast<unsigned>((p.vocab + slice - 1) / slice));
  if (vectors) {
    stop_row_logits_kernel<4><<<grid, kThreads, 0, stream>>>(p, has_mass);
  } else {
    stop_row_logits_kernel<1><<<grid, kThreads, 0, stream>>>(p, has_mass);
  }
  int64_t const fallback_blocks = (p.vocab + kThreads * kUnroll - 1) / (kThreads * kUnroll);
  stop_row_fallback_kernel<<<dim3(static_cast<unsigned>(p.batch), static_cast<unsigned>(fallback_blocks)), kThreads, 0,
                             stream>>>(p, has_mass);
  return cudaGetLastError();
}

cudaError_t launch_accept_drafts(AcceptDraftsParams const& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  accept_drafts_kernel<<<static_cast<unsigned>((p.batch + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_draft_tokens(DraftTokensParams const& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  draft_tokens_kernel<<<static_cast<unsigned>((p.batch + kThreads - 1) / kThreads), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace flashsampling
