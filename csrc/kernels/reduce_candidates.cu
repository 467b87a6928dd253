// Small kernels around the fused GEMM:
//  - before it, the sparse-bias bitmap (which (row, token) pairs have a sparse entry), the
//    penalties' rank bitmap (the rows' seen tokens, their ranks and penalties),
//    the rows' fl(1 / T) and the zeroed floors of the exact skip;
//  - after it, stage 2: per (batch row, sample) the best packed candidate over all
//    vocabulary tiles, decoded to a token id and score, plus (logprobs) the merged
//    log-sum-exp and the token's log-probability. Candidates are tiny
//    ([samples][tiles][B] x 8 bytes, ~2.4 MB at B=256, V=152k) and still in L2.
#include <algorithm>
#include <cstdint>

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/philox_gumbel.h"
#include "logits_rows.cuh"
#include "sampler_config.h"

namespace flashsampling {
namespace {

// Stage 2 is one block per (row, sample) over ~1-2K vocabulary tiles: latency-bound. 512
// threads, each issuing its loads four tiles at a time before comparing, keep the loads in
// flight (128 threads with one load per step are several times slower: docs/kernel.md).
constexpr int kReduceThreads = 512;
constexpr int kTilesPerStep = 4;
constexpr float kLn2 = 0.6931471805599453f;

__global__ void build_sparse_bitmap_kernel(int32_t const* __restrict__ ids, int64_t batch_size, int sparse_k,
                                           int64_t vocab_start, int64_t vocab_size, int64_t mask_words,
                                           uint32_t* __restrict__ bitmap) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch_size * sparse_k) return;
  int64_t const row = i / sparse_k;
  int64_t const local = static_cast<int64_t>(ids[i]) - vocab_start;
  if (local >= 0 && local < vocab_size) {  // ids of other shards (and -1 padding) are ignored
    atomicOr(bitmap + row * mask_words + (local >> 5), 1u << (local & 31));
  }
}

// The rank bitmap of the penalties (SamplingControls::penalty_words / penalty_slots), one block
// per row: the row's seen-token bits, then per word the seen tokens of the earlier words (an
// exclusive scan of the words' popcounts), then each seen token's {r, add} at its rank among the
// row's seen tokens (ordered by id), and whether any of them may raise its logit
// (SamplingControls::penalty_lowers). O(mask_words + capacity) per row, no [B, V] table; the
// epilogue then finds a token's slot with one load and a popcount. The ids must be distinct in
// a row (a PenaltyState's are); a repeated id's slot gets one of its entries.
//
// The bits are gathered in shared memory (dynamic, 4 bytes a word) and the scan runs over chunks
// of one word a thread, so global memory sees one coalesced write of the words and the slots'
// reads and writes: the kernel runs before the GEMM, on its critical path, where each round trip
// of zeroing, atomics and strided scans in global memory would add to every penalised call.
constexpr int kPenaltyTableThreads = 512;

size_t penalty_table_smem_bytes(int64_t mask_words) { return static_cast<size_t>(mask_words) * sizeof(uint32_t); }

// Exclusive sum over the block of one value a thread (and the block's total).
__device__ uint32_t block_exclusive_sum(uint32_t value, uint32_t* warp_sums, uint32_t& total) {
  int const t = threadIdx.x, lane = t % 32, warp = t / 32;
  uint32_t inclusive = value;
  for (int delta = 1; delta < 32; delta *= 2) {
    uint32_t const other = __shfl_up_sync(0xFFFFFFFF, inclusive, delta);
    if (lane >= delta) inclusive += other;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();
  uint32_t before = inclusive - value;
  total = 0;
  for (int w = 0; w < kPenaltyTableThreads / 32; ++w) {
    uint32_t const sum = warp_sums[w];
    before += w < warp ? sum : 0u;
    total += sum;
  }
  __syncthreads();  // warp_sums is reused by the next chunk
  return before;
}

__global__ void __launch_bounds__(kPenaltyTableThreads)
    build_penalty_table_kernel(int64_t const* __restrict__ ids, float const* __restrict__ values,
                               float const* __restrict__ repetition, int capacity, int64_t vocab_start,
                               int64_t vocab_size, int64_t mask_words, uint2* __restrict__ words,
                               float2* __restrict__ slots, uint32_t* __restrict__ lowers) {
  extern __shared__ uint32_t seen_bits[];  // [mask_words]
  __shared__ uint32_t warp_sums[kPenaltyTableThreads / 32];
  int64_t const row = blockIdx.x;
  int const t = threadIdx.x;
  uint2* const row_words = words + row * mask_words;
  int64_t const* const row_ids = ids + row * capacity;
  for (int64_t w = t; w < mask_words; w += kPenaltyTableThreads) seen_bits[w] = 0u;
  __syncthreads();
  for (int k = t; k < capacity; k += kPenaltyTableThreads) {
    int64_t const local = row_ids[k] - vocab_start;
    if (local >= 0 && local < vocab_size) {  // free slots (-1) and other shards' ids are not seen here
      atomicOr(&seen_bits[local >> 5], 1u << (local & 31));
    }
  }
  __syncthreads();
  uint32_t carry = 0;  // seen tokens in the chunks before
  for (int64_t first = 0; first < mask_words; first += kPenaltyTableThreads) {
    int64_t const w = first + t;
    uint32_t const bits = w < mask_words ? seen_bits[w] : 0u;
    uint32_t chunk_total;
    uint32_t const before = block_exclusive_sum(__popc(bits), warp_sums, chunk_total);
    if (w < mask_words) row_words[w] = make_uint2(bits, carry + before);
    carry += chunk_total;
  }
  __syncthreads();  // the words' global writes, before the slots' reads below
  float const r = repetition != nullptr ? repetition[row] : 1.0f;
  bool raises = false;  // some seen token's penalty may raise its logit (r < 1, an add > 0, NaN)
  for (int k = t; k < capacity; k += kPenaltyTableThreads) {
    int64_t const local = row_ids[k] - vocab_start;
    if (local >= 0 && local < vocab_size) {
      uint2 const word = row_words[local >> 5];
      uint32_t const rank = word.y + __popc(word.x & ((1u << (local & 31)) - 1u));
      float const add = values != nullptr ? values[row * capacity + k] : -0.0f;
      slots[row * capacity + rank] = make_float2(r, add);
      raises = raises || !(r >= 1.0f) || !(add <= 0.0f);
    }
  }
  raises = __syncthreads_or(raises);
  if (t == 0) lowers[row] = raises ? 0u : 1u;
}

// The rows' fl(1 / T) (per-row temperatures) and the zeroed per-column codes the GEMM raises (the
// floors of the exact skip, or the columns' largest x for the filtered min_p winners): one small
// kernel before the GEMM rather than a kernel and a memset (a graph node each).
__global__ void prepare_gemm_inputs_kernel(float const* __restrict__ temperatures, int64_t batch_size,
                                           float* __restrict__ inv_temperatures, uint32_t* __restrict__ noise_floors,
                                           uint32_t* __restrict__ column_max_codes, int64_t num_columns) {
  int64_t const i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (inv_temperatures != nullptr && i < batch_size) inv_temperatures[i] = fs_inv_temperature(temperatures[i]);
  if (noise_floors != nullptr && i < num_columns) noise_floors[i] = 0u;
  if (column_max_codes != nullptr && i < num_columns) column_max_codes[i] = 0u;
}

// Whether row `row` of the allowed mask allows no token of [0, V) (block-wide).
__device__ bool mask_row_empty(SamplerParams const& p, int64_t row) {
  SamplingControls const& c = p.controls;
  int any = 0;
  for (int64_t w = threadIdx.x; w < c.mask_words; w += kReduceThreads) {
    uint32_t word = c.allowed_mask[row * c.mask_words + w];
    int64_t const valid = p.vocab_size - w * 32;
    if (valid < 32) word &= (1u << valid) - 1u;
    any |= word != 0u;
  }
  return __syncthreads_or(any) == 0;
}

// Whether no allowed key lies strictly ahead of the winner (local id v) in the truncation order (y
// descending, then index ascending), on the plain pass: its y is the row's first y, and no token
// before it has that y, neither in the vocabulary tiles before its own (their largest x, in L2)
// nor before it in its own tile (the stored x). Ties of y from different x (the rounding of x *
// fl(1 / T)) count as ties. Block-wide: every thread returns the same.
__device__ bool winner_leads_row(SamplerParams const& p, SamplerBuffers const& buffers, int64_t row, int64_t col,
                                 int64_t columns, int vocab_tile, int64_t v, float inv_t, float first_y) {
  float const* const x = p.row_logits + row * p.row_logits_stride;
  int64_t const tile = v / vocab_tile;
  bool behind = !(fs_mul(x[v], inv_t) == first_y);
  for (int64_t t = threadIdx.x; t < tile; t += kReduceThreads) {
    behind = behind || fs_mul(buffers.tile_max_logits[t * columns + col], inv_t) == first_y;
  }
  for (int64_t u = tile * vocab_tile + threadIdx.x; u < v; u += kReduceThreads) {
    behind = behind || fs_mul(x[u], inv_t) == first_y;
  }
  return __syncthreads_or(behind) == 0;
}

// min_p on the plain pass (a call of min_p alone), a row whose min_p is on: `cut` where it may
// cut (a winner, not greedy, min_p in (0, 1], a finite first y), `winner_survives` where the
// winner passes min_p against the row's first y (MinP::keeps, the survivors' test of every other
// path: the winner beats every survivor, so it is the sample), and `decided` where the row's
// sample was drawn here over its survivors instead (`best`: sample_min_p_from_tiles, or with the
// filtered winners sample_min_p_past_filtered_winners).
struct MinPRow {
  bool cut = false, winner_survives = false, decided = false;
  PackedCandidate best = 0;
};

// Where the plain token fails min_p, the survivors lie in the vocabulary tiles whose largest x
// passes it (the stored tile maxima; y = fl(x * fl(1 / T)) is monotone in x, and so is the test):
// on a peaked row a handful of tiles. Up to this many such tiles the block draws the row's sample
// over their survivors itself (Gumbel-Max with the noise of plain sampling, as the streaming
// pass would, so the same token and score); with more (a flat row) the row goes to the streaming
// pass over the whole row.
constexpr int kMinPSampleTiles = 64;

// Puts tile t on a block's list of up to kMinPSampleTiles tiles, at a slot from an atomic (the
// order depends on the atomics; what is drawn from the list does not); `count` past the list's
// length says it overflowed.
__device__ __forceinline__ void list_tile(int32_t* tiles, int* count, int64_t t) {
  int const slot = atomicAdd(count, 1);
  if (slot < kMinPSampleTiles) tiles[slot] = static_cast<int32_t>(t);
}

// Block-wide (every thread gets the same): the best survivor of the `listed` tiles in `tiles` (their
// stored x that pass min_p, Gumbel-Max with the noise of plain sampling, as the streaming pass
// would draw them: the same token and score), or `best` where that is better.
__device__ PackedCandidate best_survivor_of_tiles(SamplerParams const& p, int64_t row, int32_t const* tiles,
                                                  int listed, int vocab_tile, float inv_t, MinP const& test,
                                                  PackedCandidate best) {
  __shared__ PackedCandidate warp_best[kReduceThreads / 32];
  uint64_t seed, offset;
  resolve_noise_source(p.noise, seed, offset);
  RowNoiseKey const noise = row_noise_key(p.noise, seed, offset, static_cast<uint32_t>(row), 0);
  float const* const x = p.row_logits + row * p.row_logits_stride;
  for (int64_t i = threadIdx.x; i < int64_t{listed} * vocab_tile; i += kReduceThreads) {
    int64_t const v = int64_t{tiles[i / vocab_tile]} * vocab_tile + i % vocab_tile;
    if (v >= p.vocab_size) continue;
    float const xv = x[v];
    if (!test.keeps(fs_mul(xv, inv_t))) continue;
    uint32_t const index = static_cast<uint32_t>(p.vocab_start + v);
    float const score =
        fs_perturbed_score(xv, inv_t, fs_gumbel_noise(noise.seed, noise.offset, noise.stream, 0, index));
    PackedCandidate const c = pack_candidate(score, static_cast<int32_t>(index));
    best = c > best ? c : best;
  }
  best = warp_max(best);
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kReduceThreads / 32; ++w) best = warp_best[w] > best ? warp_best[w] : best;
  return best;
}

// Block-wide (every thread gets the same): the sample of a min_p row over the survivors of its
// tiles, or decided = false where more than kMinPSampleTiles tiles may hold survivors. (Counting
// the tiles first without atomics, then listing them at the threads' exclusive offsets, takes a
// second pass and a scan's barriers, and was slower on peaked rows: docs/truncation.md.)
__device__ void sample_min_p_from_tiles(SamplerParams const& p, SamplerBuffers const& buffers, int64_t row,
                                        int64_t col, int64_t columns, int64_t num_tiles, int vocab_tile,
                                        float inv_t, MinP const& test, MinPRow& out) {
  __shared__ int32_t tiles[kMinPSampleTiles];
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  // The first kReduceThreads tiles, a load a thread, are counted at one barrier: a flat row, whose
  // survivors lie in most tiles, leaves here without an atomic.
  bool const first_keeps =
      threadIdx.x < num_tiles && test.keeps(fs_mul(buffers.tile_max_logits[threadIdx.x * columns + col], inv_t));
  if (__syncthreads_count(first_keeps) > kMinPSampleTiles) return;  // every thread: the row streams
  if (first_keeps) list_tile(tiles, &count, threadIdx.x);
  for (int64_t t = threadIdx.x + kReduceThreads; t < num_tiles; t += kReduceThreads) {
    if (test.keeps(fs_mul(buffers.tile_max_logits[t * columns + col], inv_t))) list_tile(tiles, &count, t);
  }
  __syncthreads();
  int const listed = count;
  if (listed > kMinPSampleTiles) return;  // every thread: the row streams
  out.decided = true;
  out.best = best_survivor_of_tiles(p, row, tiles, listed, vocab_tile, inv_t, test, 0);
}

// Whether a packed candidate is a token (not 0, nor "none": every score NaN, an invalid
// temperature, an empty mask, or every token of a filtered winners' tile below its floor).
__device__ __forceinline__ bool is_token_candidate(PackedCandidate c) {
  return c != 0 && static_cast<int32_t>(~static_cast<uint32_t>(c)) != kNoCandidate;
}

// Block-wide (every thread gets the same), SamplerParams::min_p_filtered_winners: each tile's
// candidate is the best score among its tokens that may pass min_p (every survivor among them;
// the exact skip leaves none out of such a row: its floors stay unraised). So a tile whose
// candidate survives holds no better survivor, and a tile whose candidate fails holds only
// survivors below the candidate: the row's sample is the best surviving candidate W unless a
// failing candidate beats W, and only those tiles' stored x are read (their survivors sampled as
// the streaming pass would), up to kMinPSampleTiles of them; with more the row streams (decided
// = false), as it does where the row's final floor beats W (a guard: no winner of such a row raises
// it). The candidates' x are read from the stored x, four tiles' loads at a time in flight (not
// read back by the GEMM at its merge, which costs its epilogue more: docs/truncation_kernels.md).
__device__ void sample_min_p_past_filtered_winners(SamplerParams const& p, SamplerBuffers const& buffers,
                                                   int64_t row, int64_t col, int64_t columns, int64_t num_tiles,
                                                   int vocab_tile, float inv_t, MinP const& test, MinPRow& out) {
  constexpr int kLoads = 4;
  __shared__ int32_t tiles[kMinPSampleTiles];
  __shared__ int count;
  __shared__ PackedCandidate warp_best[kReduceThreads / 32];
  float const* const x = p.row_logits + row * p.row_logits_stride;
  auto candidate_x = [&](PackedCandidate c) {
    return x[static_cast<int64_t>(~static_cast<uint32_t>(c)) - p.vocab_start];
  };
  PackedCandidate surviving = 0;  // W
  for (int64_t first = threadIdx.x; first < num_tiles; first += int64_t{kReduceThreads} * kLoads) {
    PackedCandidate c[kLoads];
    float xv[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t const tile = first + int64_t{u} * kReduceThreads;
      c[u] = tile < num_tiles ? buffers.candidates[tile * columns + col] : PackedCandidate{0};
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) xv[u] = is_token_candidate(c[u]) ? candidate_x(c[u]) : -INFINITY;
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      if (c[u] > surviving && is_token_candidate(c[u]) && test.keeps(fs_mul(xv[u], inv_t))) surviving = c[u];
    }
  }
  surviving = warp_max(surviving);
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = surviving;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kReduceThreads / 32; ++w) surviving = warp_best[w] > surviving ? warp_best[w] : surviving;
  if (buffers.noise_floors != nullptr) {
    uint32_t const floor_code = buffers.noise_floors[col];
    float const floor = floor_code > 1u ? from_order_bits(floor_code) : -INFINITY;
    if (floor > (surviving == 0 ? -INFINITY : unpack_score(surviving))) return;  // every thread: the row streams
  }
  for (int64_t t = threadIdx.x; t < num_tiles; t += kReduceThreads) {
    PackedCandidate const c = buffers.candidates[t * columns + col];
    if (c > surviving && is_token_candidate(c) && !test.keeps(fs_mul(candidate_x(c), inv_t))) {
      list_tile(tiles, &count, t);
    }
  }
  __syncthreads();
  int const listed = count;
  if (listed > kMinPSampleTiles) return;  // every thread: the row streams
  out.decided = true;
  out.best = listed == 0 ? surviving
                         : best_survivor_of_tiles(p, row, tiles, listed, vocab_tile, inv_t, test, surviving);
}

// min_p on the plain pass: the row's MinPRow (block-wide, every thread the same).
__device__ MinPRow min_p_row_on_plain_pass(SamplerParams const& p, SamplerBuffers const& buffers, int64_t row,
                                         int64_t col, int64_t columns, int64_t num_tiles, int vocab_tile,
                                         bool found, int32_t index, float inv_t, float first_y) {
  MinPRow out;
  double const min_p = min_p_of_row(p, row);
  out.cut = found && inv_t != 0.0f && min_p_cuts(min_p) && isfinite(first_y);
  if (!out.cut) return out;
  MinP test = min_p_test(true, min_p);
  test.set_first(static_cast<double>(first_y), true);
  int64_t const v = static_cast<int64_t>(static_cast<uint32_t>(index)) - p.vocab_start;
  out.winner_survives = test.keeps(fs_mul(p.row_logits[row * p.row_logits_stride + v], inv_t));
  // The mask's tokens are stored too (the streaming pass tests the mask): those rows stream.
  if (!out.winner_survives && p.min_p_filtered_winners) {  // (the plain loop: no mask)
    sample_min_p_past_filtered_winners(p, buffers, row, col, columns, num_tiles, vocab_tile, inv_t, test, out);
  } else if (!out.winner_survives && p.controls.allowed_mask == nullptr) {
    sample_min_p_from_tiles(p, buffers, row, col, columns, num_tiles, vocab_tile, inv_t, test, out);
  }
  return out;
}

// top_p on the plain pass (SamplerParams::truncation_on_plain_pass; one sample): a row whose top_p is on
// goes to the top_p rounds with its plain-sampling winner and its first y = fl(max allowed x * fl(1 /
// T)), where the rounds verify the winner against top_p (the same start as stage 2 gives the rows
// it hands on), unless the winner leads the row (winner_leads_row: top_p > 0 keeps the first token,
// and round 0 would find no mass ahead of it); a row without a winner or a finite first y, or whose
// top_p keeps only its first token (<= 0, NaN), to the cut kernel's list; a greedy row (T = 0: its
// argmax, plain sampling's token) and a row whose top_p is off (>= 1) keep the plain token written
// above. Every row's entry of streamed_first_y is written (NaN: not streamed).
//
// min_p on the plain pass (a call of min_p alone; min_p_row as MinPRow says): a row whose min_p is
// on keeps its plain token where the winner survives, takes the sample drawn over its few tiles
// where there is one (written by the caller), else goes to the streaming pass over its survivors
// with its first y; min_p above 1 or NaN (the first token only), no winner or no finite first y
// to the cut kernel's list; greedy rows and rows whose min_p is off (<= 0) keep the plain token.
__device__ void hand_on_row(SamplerParams const& p, SamplerBuffers const& buffers, int64_t row, bool found,
                            PackedCandidate winner, float first_y, bool greedy, bool winner_leads,
                            MinPRow const& min_p_row) {
  bool off, streams;
  if (call_may_cut_top_p(p)) {  // a call of top_p alone
    double const top_p = top_p_of_row(p, row);
    bool const kept = winner_leads && top_p > 0.0;
    off = top_p >= 1.0 || kept;
    streams = !kept && found && !greedy && top_p > 0.0 && top_p < 1.0 && isfinite(first_y);
    if (streams) buffers.streamed_winners[row] = winner;
  } else {
    double const min_p = min_p_of_row(p, row);
    streams = min_p_row.cut && !min_p_row.winner_survives && !min_p_row.decided;
    off = min_p <= 0.0 || min_p_row.winner_survives || min_p_row.decided;
  }
  buffers.streamed_first_y[row] = streams ? first_y : __uint_as_float(0x7fc00000u);
  if (!streams && !greedy && !off) {
    append_to_row_list(p.fallback_rows, row);
  }
}

__global__ void __launch_bounds__(kReduceThreads)
reduce_candidates_kernel(SamplerParams const p, SamplerBuffers const buffers, int64_t num_tiles, int vocab_tile) {
  int64_t const row = blockIdx.x;
  int const sample = blockIdx.y;
  // GEMM column s * B + b holds (sample s, row b); tiles are `columns` apart.
  int64_t const columns = sampler_gemm_columns(p);
  int64_t const col = static_cast<int64_t>(sample) * p.batch_size + row;
  PackedCandidate const* column = buffers.candidates + col;

  // Best candidate and the tile it came from (for its logit); on the plain pass the row's largest
  // logit and the largest of the best candidate's tile (tile_max_logits).
  float const* const tile_max_logits = buffers.tile_max_logits;
  PackedCandidate best = 0;
  int64_t best_tile = -1;
  float lse_max = -INFINITY, lse_sum = 0.0f, max_x = -INFINITY, best_tile_max = -INFINITY;
  for (int64_t first = threadIdx.x; first < num_tiles; first += int64_t{kReduceThreads} * kTilesPerStep) {
    PackedCandidate c[kTilesPerStep];
    float2 part[kTilesPerStep];
    float tile_max[kTilesPerStep];
#pragma unroll
    for (int u = 0; u < kTilesPerStep; ++u) {  // the loads first, all in flight
      int64_t const tile = first + int64_t{u} * kReduceThreads;
      bool const in_range = tile < num_tiles;
      c[u] = in_range ? column[tile * columns] : PackedCandidate{0};
      part[u] = p.logprobs && in_range ? buffers.lse_parts[tile * columns + col] : make_float2(-INFINITY, 0.0f);
      tile_max[u] = tile_max_logits != nullptr && in_range ? tile_max_logits[tile * columns + col] : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < kTilesPerStep; ++u) {
      if (c[u] > best) {
        best = c[u];
        best_tile = first + int64_t{u} * kReduceThreads;
        best_tile_max = tile_max[u];
      }
      if (p.logprobs) lse_merge(lse_max, lse_sum, part[u].x, part[u].y);
      max_x = fmaxf(max_x, tile_max[u]);
    }
  }
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    PackedCandidate const other = __shfl_xor_sync(0xFFFFFFFF, best, delta);
    int64_t const other_tile = __shfl_xor_sync(0xFFFFFFFF, best_tile, delta);
    float const other_tile_max = __shfl_xor_sync(0xFFFFFFFF, best_tile_max, delta);
    if (other > best) {
      best = other;
      best_tile = other_tile;
      best_tile_max = other_tile_max;
    }
    float const other_max = __shfl_xor_sync(0xFFFFFFFF, lse_max, delta);
    float const other_sum = __shfl_xor_sync(0xFFFFFFFF, lse_sum, delta);
    lse_merge(lse_max, lse_sum, other_max, other_sum);
    max_x = fmaxf(max_x, __shfl_xor_sync(0xFFFFFFFF, max_x, delta));
  }
  __shared__ PackedCandidate warp_best[kReduceThreads / 32];
  __shared__ int64_t warp_tile[kReduceThreads / 32];
  __shared__ float2 warp_lse[kReduceThreads / 32];
  __shared__ float warp_max_x[kReduceThreads / 32];
  __shared__ float warp_best_tile_max[kReduceThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_best[threadIdx.x / 32] = best;
    warp_tile[threadIdx.x / 32] = best_tile;
    warp_best_tile_max[threadIdx.x / 32] = best_tile_max;
    warp_lse[threadIdx.x / 32] = make_float2(lse_max, lse_sum);
    warp_max_x[threadIdx.x / 32] = max_x;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kReduceThreads / 32; ++w) {  // every thread, so all agree below
    if (warp_best[w] > best) {
      best = warp_best[w];
      best_tile = warp_tile[w];
      best_tile_max = warp_best_tile_max[w];
    }
    max_x = fmaxf(max_x, warp_max_x[w]);
  }
  // "No candidate": every score NaN, an invalid temperature, or an empty mask.
  int32_t const index = static_cast<int32_t>(~static_cast<uint32_t>(best));
  bool const found = is_token_candidate(best);
  bool const empty_mask = !found && p.controls.allowed_mask != nullptr && mask_row_empty(p, row);
  // The plain pass's row: its fl(1 / T), first y, and whether its winner leads it. Only a winner
  // whose tile holds the row's first y may (most of a peaked row's winners, few of a flat row's),
  // so the others load nothing more.
  float inv_t = 0.0f, first_y = 0.0f;
  bool winner_leads = false;
  if (tile_max_logits != nullptr) {
    inv_t = row_inv_temperature(p.controls, static_cast<uint32_t>(row), p.inv_temperature);
    first_y = fs_mul(max_x, inv_t);
    if (p.first_winners_in_reduction && call_may_cut_top_p(p) && found && inv_t != 0.0f && isfinite(first_y) &&
        fs_mul(best_tile_max, inv_t) == first_y) {
      int64_t const v = static_cast<int64_t>(static_cast<uint32_t>(index)) - p.vocab_start;
      winner_leads = winner_leads_row(p, buffers, row, col, columns, vocab_tile, v, inv_t, first_y);
    }
  }
  MinPRow min_p_row;
  if (tile_max_logits != nullptr && !call_may_cut_top_p(p)) {
    min_p_row = min_p_row_on_plain_pass(p, buffers, row, col, columns, num_tiles, vocab_tile, found, index, inv_t,
                                        first_y);
  }
  if (threadIdx.x >= 32) return;

  // Warp 0 finishes: the token's logit is asked for first, so its L2 round trip runs under the
  // merge of the warps' log-sum-exp parts, which takes four shuffle steps (thread 0 merging the
  // sixteen one after the other was a chain of sixteen exp2 pairs).
  int64_t const out = row * p.num_samples + sample;
  float token_logit = 0.0f;
  if (p.logprobs && found && threadIdx.x == 0) token_logit = buffers.candidate_logits[col + best_tile * columns];
  float m = -INFINITY, s = 0.0f;
  if (p.logprobs) {
    constexpr int kWarps = kReduceThreads / 32;
    if (threadIdx.x < kWarps) {
      m = warp_lse[threadIdx.x].x;
      s = warp_lse[threadIdx.x].y;
    }
#pragma unroll
    for (int delta = kWarps / 2; delta > 0; delta >>= 1) {
      float const other_max = __shfl_xor_sync(0xFFFFFFFF, m, delta);
      float const other_sum = __shfl_xor_sync(0xFFFFFFFF, s, delta);
      lse_merge(m, s, other_max, other_sum);
    }
  }
  if (threadIdx.x != 0) return;

  if (min_p_row.decided) {  // the sample over the min_p survivors of the row's few tiles
    bool const any = min_p_row.best != 0;
    p.tokens[out] = any ? static_cast<int32_t>(~static_cast<uint32_t>(min_p_row.best)) : -1;
    if (p.scores) p.scores[out] = any ? unpack_score(min_p_row.best) : -INFINITY;
  } else {
    p.tokens[out] = found ? index : empty_mask ? p.empty_mask_token : -1;
    if (p.scores) p.scores[out] = found ? unpack_score(best) : -INFINITY;
  }
  if (tile_max_logits != nullptr) {
    hand_on_row(p, buffers, row, found, best, first_y, inv_t == 0.0f, winner_leads, min_p_row);
  }
  if (p.logprobs) {
    // lse = ln(sum_v e^y) = (max2 + log2(sum)) * ln 2.
    float const lse = m == -INFINITY ? (s == s ? -INFINITY : s) : (m + log2f(s)) * kLn2;
    p.token_logprobs[out] = found ? token_logit - lse : __uint_as_float(0x7fc00000u);
    if (sample == 0) p.logsumexp[row] = lse;
  }
}

}  // namespace

cudaError_t launch_build_sparse_bitmap(SamplerParams const& p, uint32_t* bitmap, cudaStream_t stream) {
  SamplingControls const& c = p.controls;
  cudaError_t err =
      cudaMemsetAsync(bitmap, 0, static_cast<size_t>(p.batch_size) * c.mask_words * sizeof(uint32_t), stream);
  if (err != cudaSuccess || c.sparse_k == 0) return err;
  int64_t const entries = p.batch_size * c.sparse_k;
  int const threads = 256;
  build_sparse_bitmap_kernel<<<static_cast<unsigned>((entries + threads - 1) / threads), threads, 0, stream>>>(
      c.sparse_ids, p.batch_size, c.sparse_k, p.vocab_start, p.vocab_size, c.mask_words, bitmap);
  return cudaGetLastError();
}

cudaError_t launch_build_penalty_table(SamplerParams const& p, SamplerBuffers const& buffers, cudaStream_t stream) {
  SamplingControls const& c = p.controls;
  size_t const smem = penalty_table_smem_bytes(c.mask_words);
  if (smem > 48 * 1024) {  // vocabularies above 393216 tokens: opt in (up to the device's limit)
    cudaError_t err = cudaFuncSetAttribute(build_penalty_table_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  build_penalty_table_kernel<<<static_cast<unsigned>(p.batch_size), kPenaltyTableThreads, smem, stream>>>(
      c.penalty_ids, c.penalty_values, c.repetition_penalties, c.penalty_capacity, p.vocab_start, p.vocab_size,
      c.mask_words, reinterpret_cast<uint2*>(buffers.penalty_words), reinterpret_cast<float2*>(buffers.penalty_slots),
      buffers.penalty_lowers);
  return cudaGetLastError();
}

cudaError_t launch_prepare_gemm_inputs(SamplerParams const& p, SamplerBuffers const& buffers, cudaStream_t stream) {
  bool const column_codes = buffers.noise_floors != nullptr || buffers.column_max_codes != nullptr;
  int64_t const num_columns = column_codes ? sampler_gemm_columns(p) : 0;
  int64_t const threads_needed = std::max(buffers.inv_temperatures != nullptr ? p.batch_size : 0, num_columns);
  if (threads_needed == 0) return cudaSuccess;  // nothing asked: no launch
  int const threads = 256;
  prepare_gemm_inputs_kernel<<<static_cast<unsigned>((threads_needed + threads - 1) / threads), threads, 0, stream>>>(
      p.controls.temperatures, p.batch_size, buffers.inv_temperatures, buffers.noise_floors, buffers.column_max_codes,
      num_columns);
  return cudaGetLastError();
}

cudaError_t launch_reduce_candidates(SamplerParams const& p, SamplerBuffers const& buffers, int64_t num_tiles,
                                     int vocab_tile, cudaStream_t stream) {
  if (p.batch_size == 0) {
    return cudaSuccess;
  }
  dim3 const grid(static_cast<unsigned>(p.batch_size), static_cast<unsigned>(p.num_samples));
  reduce_candidates_kernel<<<grid, kReduceThreads, 0, stream>>>(p, buffers, num_tiles, vocab_tile);
  return cudaGetLastError();
}

}  // namespace flashsampling
