// The logits sampler's streaming rows (logits_rows.cuh: is_streaming_row): rows without top_k,
// top_p or min_p, whose survivors are every allowed token (and min_p rows, below). Their sample is
// Gumbel-Max over one pass of the row, so they need none of the cut path's histograms; here a CTA
// takes a quad of rows and a chunk of the vocabulary (quad_chunks), so that a row is read by many
// CTAs at once:
//
//  1. streaming_sample_kernel: each (quad, chunk) per sample the best candidate of each row's
//     chunk, and (sample 0) the chunk's largest key, allowed tokens and the survivors' mass as an
//     online (max, sum) pair;
//  2. streaming_finish_kernel: a warp a row merges the chunks and writes the row's outputs as the
//     cut path writes them (logits_rows.cuh);
//  3. (top_p rows of streamed_first_y) top_p_round_kernel, kRounds launches: the winner of step 1
//     verified against the row's top_p, and where it fails the next winner ahead of it (below).
//
// Where the fused truncation's GEMM drew every streamed row's winner (streamed_winners: a top_p
// call without min_p) neither step 1 nor step 2 runs: step 3's first round lists the rows itself
// and writes each row's winner as its sample (a launch fewer).
//
// The noise is the cut path's (perturbed_score): one Philox block gives the noise of a token in
// four streams, so a quad of rows with one seed and offset and streams 4q .. 4q + 3 (the batch's
// rows, the usual case) draws one block a token. Most tokens cannot win, and skip their noise
// exactly: a token whose score with an upper bound of its noise in place of the noise stays
// below the best score drawn so far for its row (the row's floor: its warp's, shared with the
// row's other CTAs through the workspace) is not the row's sample; the bound is first the largest
// noise any 32 bits give (no Philox), then fs_gumbel_upper_bound_from_bits of the token's own
// bits (no logarithms), and the few tokens left queue per warp for their logarithms. The
// candidates are merged by fs_candidate_better's total order, so the tokens and scores are the cut
// path's whatever the chunks; the log-sum-exp sums the same exponentials in another order (fp32
// rounding).
//
// min_p rows stream only where their first y is known before the pass: the fused truncation's
// stage 2 knows it from its candidates and hands such rows over in streamed_first_y (the kernel's
// kMinPRows instance); a survivor is then an allowed token that passes MinP::keeps, mostly one
// float comparison. Elsewhere min_p rows stay on the cut path: a first pass for their first token
// made this path slower than the cut path's at B >= 128 (CHANGELOG.md). top_p rows (without
// top_k, one sample, no log-probabilities) stream the same way: step 1 samples them over every
// allowed token that passes min_p, and step 3 keeps that sample only where top_p keeps it.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flashsampling/streaming_chunks.h"
#include "flashsampling/zero_bytes.h"
#include "logits_rows.cuh"

namespace flashsampling {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// sample_quad_chunk's general loop takes a warp's 32 tokens of a step as one word of a row's mask:
// a chunk starts on a whole step, so every warp's first token is a multiple of 32.
static_assert(kStreamingChunkQuantum % kThreads == 0 && kThreads % 32 == 0, "a streaming chunk starts on a whole step");
constexpr int kQuad = 4;    // rows a CTA
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// What a CTA knows of one of its quad's rows.
struct QuadRow {
  int64_t row = 0;         // batch row
  bool counted = false;    // a streaming row in the launch: its chunk partials are written
  bool sampled = false;    // ... with a valid temperature: it draws candidates
  bool min_p_cut = false;  // a row of streamed_first_y in a min_p call: survivors pass min_p
  MinP min_p{};
  RowInput in{};
  RowNoiseKey noise{};     // sample 0's
};

// A chunk's results for one row (sample 0's statistics).
struct ChunkPartial {
  PackedCandidate first;  // the largest key (0: nothing allowed)
  uint32_t allowed;
  uint32_t has_nan;       // a survivor with a NaN y
  float mass_max;         // the survivors' largest y (-inf: none with mass), +inf wins
  float mass_sum;         // sum of exp(y - mass_max) over the survivors
};

// The top_p rounds (below): a row's t between them ...
struct RoundRow {
  PackedCandidate t_key;  // the truncation key of t (pack_top_candidate of its y and index)
  FixedMass total;        // the row's mass relative to its first y (after round 0)
};
// ... and a chunk's results in a round.
struct RoundPartial {
  FixedMass ahead;        // mass of the allowed keys strictly ahead of t
  FixedMass total;        // mass of every allowed key (round 0)
  PackedCandidate best;   // the best candidate strictly ahead of t (pack_candidate)
};
// The rounds alternate: the even ones verify their rows' t (no noise), the odd ones draw the next
// t of the rows that failed. A verified t is kept by most rows (a flat row's first t at top_p =
// 0.9 about nine times in ten, the next one about 29 times in 30), so a round that also drew the
// next t for every row it verifies would draw mostly for nothing. A row still undecided after
// the last round (its third t failed) takes the cut path.
constexpr int kRounds = 5;
constexpr int kRoundUnroll = 4;            // loads a thread has in flight in a round's pass
constexpr int kRoundCtasPerSm = 4;         // the grid's CTAs an SM (launch_streaming_rows), resident at once
// A round's chunk (flashsampling/streaming_chunks.h) is whole steps of its loop: kRoundChunkTokens
// of the verifying loop, kRoundDrawChunkTokens of the drawing loop. A drawing chunk of one step
// draws without a floor (RoundChunk's floor applies from a chunk's second step).
static_assert(kRoundChunkTokens == int64_t{kRoundUnroll} * kThreads * 4, "a verifying round's chunk: whole steps");
static_assert(kRoundDrawChunkTokens == int64_t{kRoundUnroll} * kThreads, "a drawing round's chunk: whole steps");

struct Workspace {
  ChunkPartial* partials;        // [items, 4]: item = listed quad's slot * chunks + chunk, then the quad's row
  PackedCandidate* candidates;   // [items, 4, S]
  int32_t* quad_slots;           // [quads]: a listed quad's place in the list (written by its chunk 0's CTA)
  int64_t* listed_chunks;        // [1]: each listed quad's chunks (written by CTA 0)
  RoundRow* round_rows;          // [B] (streams_top_p_rows)
  RoundPartial* round_partials;  // [B, round_chunks(V, kRoundDrawChunkTokens)] (streams_top_p_rows); a round uses [B, its chunks]
  uint32_t* floors;              // [B, S]: number_order_bits of the best score drawn so far (0: none), zeroed
  // streams_top_p_rows, zeroed: per round the CTAs done with each row's chunks, and the rows the
  // round takes (a count, then the rows)
  uint32_t* round_tickets;       // [kRounds, B]
  int32_t* round_lists;          // [kRounds, 1 + B]
};

// A token whose logarithms are due, waiting in its warp's queue: drawn where they lie, the
// logarithms would cost the whole warp a step for every step in which any lane needs them.
struct alignas(16) QueuedDraw {  // one 16-byte store
  float x;
  uint32_t bits;
  uint32_t index;
  int row;  // of the quad
};
// 32 drawn at a time: up to 31 left plus 4 x 32 added; a power of two, so that the ring's index is a mask
constexpr int kQueue = 256;
static_assert((kQueue & (kQueue - 1)) == 0 && kQueue >= 31 + 4 * 32, "kQueue: a power of two that holds a step");
// The min_p rows' pass (sparse quads): float4 loads a thread has in flight.
constexpr int kSparseLoads = 4;

size_t round_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

struct WorkspaceLayout {
  // floors and the rounds' tickets and lists last: the launch zeroes [floors, total)
  size_t candidates, quad_slots, listed_chunks, round_rows, round_partials, floors, round_tickets, round_lists, total;
  WorkspaceLayout(int64_t batch, int64_t samples, int64_t items, int64_t vocab, bool rounds) {
    size_t const b = static_cast<size_t>(batch);
    size_t const rows = static_cast<size_t>(items) * kQuad;
    candidates = round_up(rows * sizeof(ChunkPartial));
    quad_slots = candidates + round_up(rows * samples * sizeof(PackedCandidate));
    listed_chunks = quad_slots + round_up((b + kQuad - 1) / kQuad * sizeof(int32_t));
    round_rows = listed_chunks + round_up(sizeof(int64_t));
    round_partials = round_rows + (rounds ? round_up(b * sizeof(RoundRow)) : 0);
    floors = round_partials + (rounds ? round_up(b * round_chunks(vocab, kRoundDrawChunkTokens) * sizeof(RoundPartial)) : 0);
    round_tickets = floors + round_up(b * samples * sizeof(uint32_t));
    round_lists = round_tickets + (rounds ? round_up(kRounds * b * sizeof(uint32_t)) : 0);
    total = round_lists + (rounds ? round_up(kRounds * (b + 1) * sizeof(int32_t)) : 0);
  }
  Workspace carve(void* workspace) const {
    char* base = static_cast<char*>(workspace);
    bool const rounds = total > round_lists;
    return {reinterpret_cast<ChunkPartial*>(base),
            reinterpret_cast<PackedCandidate*>(base + candidates),
            reinterpret_cast<int32_t*>(base + quad_slots),
            reinterpret_cast<int64_t*>(base + listed_chunks),
            rounds ? reinterpret_cast<RoundRow*>(base + round_rows) : nullptr,
            rounds ? reinterpret_cast<RoundPartial*>(base + round_partials) : nullptr,
            reinterpret_cast<uint32_t*>(base + floors),
            rounds ? reinterpret_cast<uint32_t*>(base + round_tickets) : nullptr,
            rounds ? reinterpret_cast<int32_t*>(base + round_lists) : nullptr};
  }
};

__device__ __forceinline__ uint32_t warp_sum(uint32_t v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(kFullMask, v, d);
  return v;
}

// (max, sum) pairs of a log-sum-exp: sum = sum of exp(y - max). A max of +inf carries no sum (the
// row's log-sum-exp is then +inf or NaN, write_sample), -inf means no mass yet.
__device__ __forceinline__ void merge_mass(float& max, float& sum, float other_max, float other_sum) {
  float const m = fmaxf(max, other_max);
  if (m == -INFINITY || m == INFINITY) {
    max = m;
    sum = 0.0f;
    return;
  }
  sum = sum * __expf(max - m) + other_sum * __expf(other_max - m);
  max = m;
}

__device__ __forceinline__ void add_mass(float& max, float& sum, bool& has_nan, float y) {
  if (y != y) {
    has_nan = true;
  } else if (y > max) {
    if (y == INFINITY) {
      sum = 0.0f;
    } else {
      sum = sum * __expf(max - y) + 1.0f;
    }
    max = y;
  } else if (max != INFINITY && y != -INFINITY) {
    sum += __expf(y - max);
  }
}

// A warp's results of one sample, per row of the quad: its best candidate and (sample 0) its
// statistics; the CTA merges its warps' after the pass.
struct WarpResults {
  PackedCandidate best[kWarps][kQuad];
  PackedCandidate first[kWarps][kQuad];
  uint32_t allowed[kWarps][kQuad], nan[kWarps][kQuad];
  float mass[kWarps][kQuad][2];
};

// Row r's results of the calling warp (every lane calls; lane 0 writes them).
__device__ __forceinline__ void publish_warp_row(WarpResults& results, int r, bool stats, float best_score,
                                                 int32_t best_index, PackedCandidate first, uint32_t allowed,
                                                 bool has_nan, float mass_max, float mass_sum) {
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  PackedCandidate const best = warp_max(pack_candidate(best_score, best_index));
  if (lane == 0) results.best[warp][r] = best;
  if (!stats) return;
  PackedCandidate const f = warp_max(first);
  uint32_t const a = warp_sum(allowed);
  uint32_t const n = warp_sum(has_nan ? 1u : 0u);
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    float const om = __shfl_xor_sync(kFullMask, mass_max, d), os = __shfl_xor_sync(kFullMask, mass_sum, d);
    merge_mass(mass_max, mass_sum, om, os);
  }
  if (lane == 0) {
    results.first[warp][r] = f;
    results.allowed[warp][r] = a;
    results.nan[warp][r] = n;
    results.mass[warp][r][0] = mass_max;
    results.mass[warp][r][1] = mass_sum;
  }
}

// The logarithms of the tokens in a warp's queue (draw_bits: and their Philox bits, which they were
// queued without), 32 at a time, one a lane, and the rest too where `last`; each drawn score goes
// to keep(row of the quad, score, index).
template <class Keep>
__device__ __forceinline__ void drain_queue(QueuedDraw const* queue, int& head, int& queued, bool last, bool draw_bits,
                                            QuadRow const (&quad)[kQuad], int sample, Keep&& keep) {
  int const lane = threadIdx.x % 32;
  while (queued >= 32 || (last && queued > 0)) {
    __syncwarp();
    int const count = queued < 32 ? queued : 32;
    if (lane < count) {
      QueuedDraw const d = queue[(head + lane) & (kQueue - 1)];
      QuadRow const& q = quad[d.row];
      uint32_t bits = d.bits;
      if (draw_bits) {
        bits = fs_philox_lane(fs_noise_block(q.noise.seed, q.noise.offset + sample, d.index, q.noise.stream >> 2),
                              q.noise.stream & 3u);
      }
      keep(d.row, fs_perturbed_score(d.x, q.in.inv_t, fs_gumbel_from_bits(bits)), static_cast<int32_t>(d.index));
    }
    head = (head + count) & (kQueue - 1);
    queued -= count;
    __syncwarp();
  }
}

// MinP::keeps for a y within 1e-8 of the threshold or NaN (rare), and for every token of a row whose
// threshold has no float margin (a first y of magnitude 1e6 or more): out of line, so that the
// sparse pass's loop stays small in the instruction cache.
__device__ __noinline__ bool min_p_keeps_out_of_line(MinP const& min_p, float y) { return min_p.keeps(y); }

// One sample's pass over a quad of min_p rows whose first y stage 2 knows, every counted row drawing
// noise, no bias or mask (streaming_sample_kernel's sparse quads). A token
// survives if it passes min_p (mostly one comparison; a NaN y never does); only survivors are
// counted (the finish needs a nonzero count, and the first token survives) and draw noise, each
// its own Philox block from the warp's queue (no floor: the few survivors of a flat row lie within
// a few units of y of each other, far inside the noise's reach). With so little work a token the
// pass is bound by its loads and the instructions around them. The quad's rows run side by side,
// kRowWarps warps a row, each warp with its own row's loads and queue; four tokens a load with the
// next kSparseLoads loads in flight, and a warp queues tokens only in the steps where a lane holds
// one near the threshold. Its state is its own (the general loops' per-row arrays are dead here).
constexpr int kRowWarps = kWarps / kQuad;
static_assert(kWarps % kQuad == 0, "the sparse pass: whole warps a row");
__device__ __forceinline__ void sparse_min_p_pass(QuadRow const (&quad)[kQuad], QueuedDraw* queue, WarpResults& results,
                                               int64_t begin, int64_t end, uint32_t vocab_start, int sample,
                                               bool stats, bool with_mass) {
  constexpr int kRowThreads = kRowWarps * 32;
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int const r = warp % kQuad;                             // this warp's row of the quad
  int const thread = (warp / kQuad) * 32 + lane;          // its place among the row's kRowThreads
  bool const draws = stats && with_mass;
  for (int other = 0; other < kQuad; ++other) {  // nothing of the quad's other rows from this warp
    if (other != r && quad[other].counted) {
      publish_warp_row(results, other, stats, -INFINITY, kNoCandidate, 0, 0, false, -INFINITY, 0.0f);
    }
  }
  {
    QuadRow const& q = quad[r];
    if (!q.counted) return;
    float const* const row = q.in.logits;
    float const inv_t = q.in.inv_t, surely_below = q.min_p.surely_below, surely_above = q.min_p.surely_above;
    float best_score = -INFINITY, mass_max = -INFINITY, mass_sum = 0.0f;
    int32_t best_index = kNoCandidate;
    uint32_t allowed = 0;
    bool has_nan = false;
    int head = 0, queued = 0;  // the warp's queue (warp-uniform)
    auto keep = [&](int, float score, int32_t index) {
      if (fs_candidate_better(score, index, best_score, best_index)) {
        best_score = score;
        best_index = index;
      }
    };
    // The first `valid` of four tokens from `first`: survivors counted and queued. A warp step with
    // a survivor (nearly every step of a flat row) places them with one scan of the lanes' counts.
    auto visit4 = [&](float4 const x4, int64_t first, int valid) {
      float const x[4] = {x4.x, x4.y, x4.z, x4.w};
      float y[4];
      unsigned near_bits = 0, sure_bits = 0;  // not below the threshold by a margin; above it by one
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        y[e] = fs_mul(x[e], inv_t);
        bool const near = e < valid && !(y[e] < surely_below);
        near_bits |= near ? 1u << e : 0u;
        sure_bits |= near && y[e] >= surely_above ? 1u << e : 0u;
      }
      if (!__any_sync(kFullMask, near_bits != 0)) return;
      unsigned keep_bits = sure_bits;
      if (near_bits != sure_bits) {  // within 1e-8 of the threshold, or NaN: MinP::keeps decides
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (((near_bits & ~sure_bits) >> e & 1u) && min_p_keeps_out_of_line(q.min_p, y[e])) keep_bits |= 1u << e;
        }
      }
      int const mine = __popc(keep_bits);
      if (stats) allowed += mine;
      if (draws && keep_bits != 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (keep_bits >> e & 1u) add_mass(mass_max, mass_sum, has_nan, y[e]);
        }
      }
      int inclusive = mine;  // the warp's inclusive scan of the counts
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        int const other = __shfl_up_sync(kFullMask, inclusive, d);
        inclusive += lane >= d ? other : 0;
      }
      int slot = head + queued + inclusive - mine;
      uint32_t const index = vocab_start + static_cast<uint32_t>(first);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (keep_bits >> e & 1u) queue[slot++ & (kQueue - 1)] = {x[e], 0u, index + e, r};
      }
      queued += __shfl_sync(kFullMask, inclusive, 31);
      drain_queue(queue, head, queued, false, true, quad, sample, keep);
    };
    // The chunk's tokens before its first 16-byte boundary and after its last, one a thread (the
    // row's threads 0-3 and 4-7), then the aligned middle as float4. The fused pass's stored rows and the chunks
    // start on 16-byte boundaries, so today only a row's last tokens take this step (V not a
    // multiple of four); the head keeps the pass right for any row start.
    int64_t const misaligned = static_cast<int64_t>((reinterpret_cast<uintptr_t>(row + begin) & 15u) / sizeof(float));
    int64_t const head_end = misaligned == 0 ? begin : (begin + 4 - misaligned < end ? begin + 4 - misaligned : end);
    int64_t const body_end = head_end + (end - head_end) / 4 * 4;
    {
      int64_t const t = thread < 4 ? head_end - 4 + thread : body_end + thread - 4;
      bool const in_range = thread < 4 ? t >= begin : t < end;
      float const x = in_range ? __ldg(row + t) : 0.0f;
      visit4(make_float4(x, 0.0f, 0.0f, 0.0f), t, in_range ? 1 : 0);
    }
    // One visit4 in the loop (its code, with the queue's drain, is large), the loads of the next
    // kSparseLoads steps in flight.
    float4 const* const body = reinterpret_cast<float4 const*>(row + head_end);
    int64_t const vectors = (body_end - head_end) / 4;
    float4 ahead[kSparseLoads];
#pragma unroll
    for (int j = 0; j < kSparseLoads; ++j) {
      int64_t const i = thread + int64_t{j} * kRowThreads;
      ahead[j] = i < vectors ? __ldg(body + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (int64_t i = thread; i - thread < vectors; i += kRowThreads) {
      float4 const x4 = ahead[0];
#pragma unroll
      for (int j = 0; j + 1 < kSparseLoads; ++j) ahead[j] = ahead[j + 1];
      int64_t const later = i + int64_t{kSparseLoads} * kRowThreads;
      ahead[kSparseLoads - 1] = later < vectors ? __ldg(body + later) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      visit4(x4, head_end + 4 * i, i < vectors ? 4 : 0);
    }
    drain_queue(queue, head, queued, true, true, quad, sample, keep);
    PackedCandidate const first = pack_top_candidate(static_cast<float>(q.min_p.y0), 0);
    publish_warp_row(results, r, stats, best_score, best_index, first, allowed, has_nan, mass_max, mass_sum);
  }
}

// Whether batch quad `quad` (rows 4 * quad .. + 3) has a streaming row.
__device__ __forceinline__ bool quad_streams(LogitsSamplerParams const& p, int64_t quad) {
  bool any = false;
#pragma unroll
  for (int r = 0; r < kQuad; ++r) {
    int64_t const row = quad * kQuad + r;
    any |= row < p.batch_size && is_streaming_row(p, row);
  }
  return any;
}

// Listed(p, i): batch quad i has a streaming row ...
struct QuadStreams {
  __device__ __forceinline__ bool operator()(LogitsSamplerParams const& p, int64_t quad) const {
    return quad_streams(p, quad);
  }
};
// ... batch row i streams.
struct RowStreams {
  __device__ __forceinline__ bool operator()(LogitsSamplerParams const& p, int64_t row) const {
    return is_streaming_row(p, row);
  }
};

// How many of 0 .. n - 1 are Listed (every thread alike): the launch's quads with a streaming row,
// or (round 0 of the GEMM's winners) its streaming rows.
template <class Listed>
__device__ int64_t count_listed(LogitsSamplerParams const& p, int64_t n) {
  int64_t count = 0;
  for (int64_t base = 0; base < n; base += kThreads) {
    int64_t const i = base + threadIdx.x;
    count += __syncthreads_count(i < n && Listed{}(p, i));
  }
  return count;
}

// The one of 0 .. n - 1 in place `slot` of those Listed, in order (every thread alike); `listed`
// is their count (count_listed): where all are listed, no scan.
template <class Listed>
__device__ int64_t listed_at(LogitsSamplerParams const& p, int64_t n, int64_t listed, int64_t slot) {
  if (listed == n) return slot;
  __shared__ int warp_listed[kWarps];
  __shared__ int64_t found;
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t before = 0;  // listed in the blocks already scanned
  for (int64_t base = 0; base < n; base += kThreads) {
    int64_t const i = base + threadIdx.x;
    bool const is_listed = i < n && Listed{}(p, i);
    unsigned const ballot = __ballot_sync(kFullMask, is_listed);
    if (lane == 0) warp_listed[warp] = __popc(ballot);
    __syncthreads();
    int64_t place = before + __popc(ballot & ((1u << lane) - 1u));
    int block_listed = 0;
    for (int w = 0; w < kWarps; ++w) {
      place += w < warp ? warp_listed[w] : 0;
      block_listed += warp_listed[w];
    }
    if (is_listed && place == slot) found = i;
    __syncthreads();  // found is written; warp_listed is read before the next block writes it
    before += block_listed;
    if (before > slot) break;
  }
  return found;
}

// The CTA's quad is the batch rows 4 * quad_index .. + 3 (streams 4q .. 4q + 3, which share their
// Philox blocks); thread r < 4 fills row r. Returns whether any row of the quad streams (the same
// in every thread).
__device__ bool load_quad(LogitsSamplerParams const& p, int64_t quad_index, QuadRow (&quad)[kQuad]) {
  if (threadIdx.x < kQuad) {
    int const r = threadIdx.x;
    QuadRow& q = quad[r];
    q = QuadRow{};
    q.row = quad_index * kQuad + r;
    if (q.row < p.batch_size && is_streaming_row(p, q.row)) {
      q.counted = true;
      float const inv_t = row_inv_t(p, q.row);
      q.sampled = inv_t == inv_t;  // an invalid temperature draws nothing (the finish reports the row)
      q.in = row_input(p, q.row, inv_t);
      if (p.streamed_first_y != nullptr) {  // a streaming row's entry is finite
        q.min_p = row_min_p(p, q.row);
        // A min_p that cuts (in (0, 1] here): a top_p row of a min_p call may have its own off.
        q.min_p_cut = q.min_p.on && q.min_p.value > 0.0;
        if (q.min_p_cut) q.min_p.set_first(__ldg(p.streamed_first_y + q.row), true);
      }
    }
  }
  __syncthreads();
  bool any = false;
#pragma unroll
  for (int r = 0; r < kQuad; ++r) any |= quad[r].counted;
  return any;
}

// 1. Per sample the best candidate of each row's chunk; sample 0 also the chunk's statistics.
// In the general loops a thread takes one token of the four rows a step (the next step's loads in
// flight), so the loop is one compact body: its code is inlined for the four rows, and the
// logarithms, which few tokens need, are drawn from the warp's queue in one place. kMinPRows: the
// launch has streamed_first_y, whose min_p rows' survivors also pass min_p; a quad of such rows
// alone (sparse) takes sparse_min_p_pass instead. The CTA's item: tokens [begin, end) of batch
// quad `quad_index` (in shared memory, read where needed rather than held in registers through
// the loops, which are at their limit).
struct StreamingItem {
  int64_t item, quad_index, begin, end;
};

template <bool kMinPRows>
__device__ __forceinline__ void sample_quad_chunk(LogitsSamplerParams const& p, Workspace const& ws,
                                                  StreamingItem const& at) {
  __shared__ QuadRow quad[kQuad];
  __shared__ bool quad_noise;         // the quad's rows that draw noise share their Philox blocks ...
  __shared__ RowNoiseKey lead_noise;  // ... those of this key
  __shared__ bool quad_lean;          // the lean loop's quad: every counted row noisy, shared blocks, no bias or mask
  __shared__ bool quad_sparse;        // kMinPRows: every counted row a noisy min_p row, no bias or mask (few survivors)
  __shared__ WarpResults results;
  __shared__ QueuedDraw draw_queue[kWarps][kQueue];
  if (!load_quad(p, at.quad_index, quad)) return;
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  if (threadIdx.x < kQuad) {
    QuadRow& q = quad[threadIdx.x];
    if (q.counted) q.noise = row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(q.row), 0);
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the first row that draws noise leads; the others share its blocks if they can
    int lead = -1;
    bool shared = true;
    for (int r = 0; r < kQuad; ++r) {
      QuadRow const& q = quad[r];
      if (!q.sampled || q.in.greedy) continue;
      if (lead < 0) {
        lead = r;
        continue;
      }
      RowNoiseKey const& l = quad[lead].noise;
      shared = shared && q.noise.seed == l.seed && q.noise.offset == l.offset && (q.noise.stream >> 2) == (l.stream >> 2);
    }
    quad_noise = lead >= 0 && shared;
    lead_noise = lead >= 0 ? quad[lead].noise : RowNoiseKey{};
    bool every_counted_row_noisy = true;
    for (int r = 0; r < kQuad; ++r) {
      every_counted_row_noisy = every_counted_row_noisy && (!quad[r].counted || (quad[r].sampled && !quad[r].in.greedy));
    }
    quad_lean = quad_noise && every_counted_row_noisy && p.logit_bias == nullptr && p.allowed_mask == nullptr;
    bool every_counted_row_cut = true;
    for (int r = 0; r < kQuad; ++r) every_counted_row_cut = every_counted_row_cut && (!quad[r].counted || quad[r].min_p_cut);
    quad_sparse = kMinPRows && every_counted_row_cut && every_counted_row_noisy && p.logit_bias == nullptr &&
                  p.allowed_mask == nullptr;
  }
  __syncthreads();
  // Per row, from the quad: the logits, the mask, fl(1 / T), whether it streams here (counted),
  // draws candidates (sampled) and draws noise (noisy: sampled and not greedy).
  const float* logits[kQuad];
  const uint32_t* mask[kQuad];
  float inv_t[kQuad];
  bool counted[kQuad], sampled[kQuad], noisy[kQuad];
  bool min_p_cut[kQuad];
  float surely_below[kQuad];  // min_p rows: MinP::keeps's first comparison, in registers
#pragma unroll
  for (int r = 0; r < kQuad; ++r) {
    logits[r] = quad[r].in.logits;
    mask[r] = quad[r].in.mask;
    inv_t[r] = quad[r].in.inv_t;
    counted[r] = quad[r].counted;
    sampled[r] = quad[r].sampled;
    noisy[r] = quad[r].sampled && !quad[r].in.greedy;
    min_p_cut[r] = kMinPRows && quad[r].min_p_cut;
    surely_below[r] = quad[r].min_p.surely_below;
  }
  // Whether an allowed token of row r with this y survives: every one, or in a min_p row those
  // that pass min_p.
  auto survives_min_p = [&](int r, float y) {
    return !kMinPRows || !min_p_cut[r] || (!(y < surely_below[r]) && quad[r].min_p.keeps(y));
  };

  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int64_t const begin = at.begin, end = at.end;
  bool const shared_noise = quad_noise;
  bool const lean = quad_lean;
  // A quad of min_p rows draws no Philox block for a step: few of its tokens survive (a few
  // percent of a flat row), so each survivor goes to the warp's queue as it is and draws its own
  // block there, 32 at a time, where a step's block would serve one lane in most steps.
  bool const sparse = kMinPRows && quad_sparse;
  RowNoiseKey const lead = lead_noise;
  const float* const bias = p.logit_bias;
  // The largest noise any 32 bits give: a token whose score with it stays below the row's floor
  // needs no Philox block.
  float const max_noise = fs_gumbel_upper_bound_from_bits(kFullMask);
  uint32_t const vocab_start = static_cast<uint32_t>(p.vocab_start);
  bool const with_mass = p.token_logprobs != nullptr;
  QueuedDraw* const queue = draw_queue[warp];

  for (int s = 0; s < p.num_samples; ++s) {
    float best_score[kQuad], floor[kQuad];
    int32_t best_index[kQuad];
    PackedCandidate first[kQuad];
    uint32_t allowed[kQuad];
    bool has_nan[kQuad];
    float mass_max[kQuad], mass_sum[kQuad];
#pragma unroll
    for (int r = 0; r < kQuad; ++r) {
      best_score[r] = -INFINITY;
      floor[r] = -INFINITY;
      best_index[r] = kNoCandidate;
      first[r] = 0;
      allowed[r] = 0;
      has_nan[r] = false;
      mass_max[r] = -INFINITY;
      mass_sum[r] = 0.0f;
    }
    bool const stats = s == 0;
    uint32_t* const row_floors = ws.floors + at.quad_index * kQuad * p.num_samples + s;  // + r * S
    int head = 0, queued = 0;  // the warp's queue of tokens whose logarithms are due (warp-uniform)
    // The noise of a token whose rows want it: its Philox bits, and where they leave it within
    // reach of the floor, the token queued for its logarithms.
    auto draw_bits = [&](uint32_t index, float const (&x)[kQuad], bool const (&wants_noise)[kQuad],
                         bool any_noise) {
      Philox4 block{};
      if (shared_noise && any_noise) block = fs_noise_block(lead.seed, lead.offset + s, index, lead.stream >> 2);
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        bool due = false;
        uint32_t bits = 0;
        if (wants_noise[r]) {
          RowNoiseKey const& key = quad[r].noise;
          if (!shared_noise) block = fs_noise_block(key.seed, key.offset + s, index, key.stream >> 2);
          bits = fs_philox_lane(block, key.stream & 3u);
          due = !(fs_perturbed_score(x[r], inv_t[r], fs_gumbel_upper_bound_from_bits(bits)) < floor[r]);
        }
        unsigned const lanes = __ballot_sync(kFullMask, due);
        if (due) queue[(head + queued + __popc(lanes & ((1u << lane) - 1u))) & (kQueue - 1)] = {x[r], bits, index, r};
        queued += __popc(lanes);
      }
    };
    // draw_bits in the lean loop: the quad's rows share the lead's block, each row taking its word
    // of it (row_word; kInOrder: row r takes word r, without the selects), and a step in which no
    // lane leaves a token within reach of its row's floor (most steps once the floors have risen)
    // costs one vote instead of a ballot a row.
    auto draw_bits_lean = [&](auto in_order, uint32_t index, float const (&x)[kQuad], bool const (&wants_noise)[kQuad],
                              uint32_t const (&row_word)[kQuad]) {
      constexpr bool kInOrder = decltype(in_order)::value;
      Philox4 const block = fs_noise_block(lead.seed, lead.offset + s, index, lead.stream >> 2);
      uint32_t bits[kQuad];
      bool due[kQuad];
      bool any_due = false;
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        bits[r] = fs_philox_lane(block, kInOrder ? static_cast<uint32_t>(r) : row_word[r]);
        due[r] = wants_noise[r] &&
                 !(fs_perturbed_score(x[r], inv_t[r], fs_gumbel_upper_bound_from_bits(bits[r])) < floor[r]);
        any_due |= due[r];
      }
      if (!__any_sync(kFullMask, any_due)) return;
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        unsigned const lanes = __ballot_sync(kFullMask, due[r]);
        if (due[r]) {
          queue[(head + queued + __popc(lanes & ((1u << lane) - 1u))) & (kQueue - 1)] = {x[r], bits[r], index, r};
        }
        queued += __popc(lanes);
      }
    };
    // The logarithms of the queued tokens, 32 at a time (the rest after the chunk).
    auto draw_queued = [&](bool last) {
      drain_queue(queue, head, queued, last, false, quad, s, [&](int row, float score, int32_t index) {
#pragma unroll
        for (int r = 0; r < kQuad; ++r) {
          if (row == r && fs_candidate_better(score, index, best_score[r], best_index[r])) {
            best_score[r] = score;
            best_index[r] = index;
          }
        }
      });
    };
    // The floors: the best score drawn for each row so far, by this warp or (through the
    // workspace) any CTA of the row; every lane skips below them.
    auto refresh_floors = [&]() {
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        if (!noisy[r]) continue;
        float const mine = warp_max(best_score[r]);
        uint32_t* const slot = row_floors + r * p.num_samples;
        uint32_t published = 0;
        if (lane == 0) {
          published = *reinterpret_cast<volatile uint32_t*>(slot);
          uint32_t const bits = number_order_bits(mine);
          if (mine > -INFINITY && bits > published) {
            atomicMax(slot, bits);
            published = bits;
          }
        }
        published = __shfl_sync(kFullMask, published, 0);
        floor[r] = published < 2u ? -INFINITY : from_order_bits(published);
      }
    };
    float next[kQuad];  // the general loops' first step (the sparse pass loads its own)
    int64_t v = begin + threadIdx.x;
#pragma unroll
    for (int r = 0; r < kQuad; ++r) next[r] = !sparse && counted[r] && v < end ? __ldg(logits[r] + v) : 0.0f;
    // This step's logits of the quad's rows into `current`, the next step's loads in flight.
    auto advance = [&](float (&current)[kQuad]) {
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        current[r] = next[r];
        next[r] = counted[r] && v + kThreads < end ? __ldg(logits[r] + v + kThreads) : 0.0f;
      }
    };
    if (sparse) {
      sparse_min_p_pass(quad, queue, results, begin, end, vocab_start, s, stats, with_mass);
    } else if (lean) {
      // Every counted row draws noise with the shared blocks; no bias, no mask. Sample 0's first
      // key is kept as the largest y (fmaxf passes NaN by) and whether any y was a number.
      float y_max[kQuad];
      bool any_number[kQuad];
      uint32_t row_word[kQuad];  // the word of the shared block that row r's stream takes
      bool in_order = true;      // row r takes word r (the batch-wide key's quads)
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        y_max[r] = -INFINITY;
        any_number[r] = false;
        row_word[r] = quad[r].noise.stream & 3u;
        in_order = in_order && (!counted[r] || row_word[r] == static_cast<uint32_t>(r));
      }
      // kFast: sample 0 without the mass (a top_p row's pass), row r on word r. Its steps carry no
      // branch on either, which the general steps take a row at a time.
      auto lean_steps = [&](auto fast) {
        constexpr bool kFast = decltype(fast)::value;
        bool const step_stats = kFast || stats;
        bool const step_mass = !kFast && stats && with_mass;
        for (int step = 0; v - threadIdx.x < end; ++step, v += kThreads) {
          bool const in_range = v < end;
          float x[kQuad];
          advance(x);
          uint32_t const index = vocab_start + static_cast<uint32_t>(v);
          bool wants_noise[kQuad];
          bool any_noise = false;
#pragma unroll
          for (int r = 0; r < kQuad; ++r) {
            bool const live = counted[r] && in_range;
            float const y = fs_mul(x[r], inv_t[r]);
            if (step_stats) {
              y_max[r] = live ? fmaxf(y_max[r], y) : y_max[r];
              any_number[r] |= live && y == y;
              allowed[r] += live;
            }
            bool const survivor = live && survives_min_p(r, y);
            if (step_mass && survivor) add_mass(mass_max[r], mass_sum[r], has_nan[r], y);
            wants_noise[r] = survivor && !(fs_perturbed_score(x[r], inv_t[r], max_noise) < floor[r]);
            any_noise |= wants_noise[r];
          }
          if (__any_sync(kFullMask, any_noise)) draw_bits_lean(fast, index, x, wants_noise, row_word);
          bool const last = v - threadIdx.x + kThreads >= end;
          draw_queued(last);
          if ((step & 7) == 0 || last) refresh_floors();
        }
      };
      if (stats && !with_mass && in_order) {
        lean_steps(std::true_type{});
      } else {
        lean_steps(std::false_type{});
      }
      if (stats) {
#pragma unroll
        for (int r = 0; r < kQuad; ++r) {
          first[r] = any_number[r] ? pack_top_candidate(y_max[r], 0)
                                   : allowed[r] > 0 ? pack_top_candidate(NAN, 0) : PackedCandidate{0};
        }
      }
    } else {
      // A warp's 32 tokens of a step are one word of each row's mask (chunks start on whole
      // steps). The warp reads the words of 32 steps at a time, a block, one a lane (lane j: the
      // step j steps after the block's first), the next block's while this one runs, and takes a
      // step's from them by shuffles, two steps ahead: a lane loads a row's logit only where the
      // row allows its token, and a step whose words allow nothing in the quad costs a few
      // instructions (a sparse mask: the tensor-parallel survivors, a grammar's). A row that does
      // not stream here has words of 0, a row without a mask words of all ones. The min_p
      // instance (the fused truncation's rows, whose calls rarely have a mask) reads a token's
      // bit as it goes: the words' registers made it spill.
      constexpr int kBlockSteps = 32;  // a warp's lanes: lane j holds the words of the block's step j
      auto block_words = [&](int64_t block_token, uint32_t(&words)[kQuad]) {  // this lane's token
        int64_t const token = block_token - lane + int64_t{lane} * kThreads;  // the warp's, lane steps on
#pragma unroll
        for (int r = 0; r < kQuad; ++r) {
          words[r] = !counted[r] || token >= end ? 0u : mask[r] == nullptr ? kFullMask : __ldg(mask[r] + (token >> 5));
        }
      };
      // Bit r: row r streams here and allows this lane's token in step j of the block.
      auto lane_bits = [&](uint32_t const(&words)[kQuad], int j) {
        uint32_t bits = 0;
#pragma unroll
        for (int r = 0; r < kQuad; ++r) bits |= ((__shfl_sync(kFullMask, words[r], j) >> lane) & 1u) << r;
        return bits;
      };
      auto general_steps = [&](auto by_mask_words) {
        constexpr bool kByMaskWords = decltype(by_mask_words)::value;
        uint32_t bits = 0, next_bits = 0;  // this step's and the next one's
        uint32_t block[kQuad], next_block[kQuad];
        if constexpr (kByMaskWords) {
          block_words(v, block);
          block_words(v + kBlockSteps * kThreads, next_block);
          bits = lane_bits(block, 0);
          next_bits = lane_bits(block, 1);
        }
        for (int step = 0; v - threadIdx.x < end; ++step, v += kThreads) {
          bool const in_range = v < end;
          float raw[kQuad];
          if constexpr (kByMaskWords) {
#pragma unroll
            for (int r = 0; r < kQuad; ++r) {
              raw[r] = next[r];
              next[r] = ((next_bits >> r) & 1u) && v + kThreads < end ? __ldg(logits[r] + v + kThreads) : 0.0f;
            }
          } else {
            advance(raw);
          }
          if (!kByMaskWords || __any_sync(kFullMask, bits != 0)) {
            uint32_t const index = vocab_start + static_cast<uint32_t>(v);
            float const b = bias != nullptr && in_range ? __ldg(bias + v) : 0.0f;
            float x[kQuad];
            bool wants_noise[kQuad];
            bool any_noise = false;
#pragma unroll
            for (int r = 0; r < kQuad; ++r) {
              x[r] = bias != nullptr ? fs_add(raw[r], b) : raw[r];  // RowInput::key's arithmetic
              float const y = noisy[r] ? fs_mul(x[r], inv_t[r]) : x[r];
              bool const is_allowed =
                  kByMaskWords ? in_range && ((bits >> r) & 1u)
                               : counted[r] && in_range &&
                                     (mask[r] == nullptr || ((__ldg(mask[r] + (v >> 5)) >> (v & 31)) & 1u));
              PackedCandidate const key = is_allowed ? pack_top_candidate(y, index) : PackedCandidate{0};
              if (stats) {
                first[r] = key > first[r] ? key : first[r];
                allowed[r] += is_allowed;
              }
              bool const survivor = is_allowed && sampled[r] && survives_min_p(r, y);
              if (stats && with_mass && survivor) add_mass(mass_max[r], mass_sum[r], has_nan[r], y);
              if (survivor && !noisy[r] &&  // greedy: the score is x
                  fs_candidate_better(x[r], static_cast<int32_t>(index), best_score[r], best_index[r])) {
                best_score[r] = x[r];
                best_index[r] = static_cast<int32_t>(index);
              }
              // Not below the floor with the largest noise: the token needs its bits.
              wants_noise[r] = survivor && noisy[r] && !(fs_perturbed_score(x[r], inv_t[r], max_noise) < floor[r]);
              any_noise |= wants_noise[r];
            }
            if (__any_sync(kFullMask, any_noise)) draw_bits(index, x, wants_noise, any_noise);
          }
          bool const last = v - threadIdx.x + kThreads >= end;
          draw_queued(last);
          if ((step & 7) == 0 || last) refresh_floors();
          if constexpr (kByMaskWords) {
            int const ahead = (step + 2) % kBlockSteps;  // step + 2 within its block
            if (ahead == 0) {  // step + 2 begins the next block
#pragma unroll
              for (int r = 0; r < kQuad; ++r) block[r] = next_block[r];
              block_words(v + (2 + kBlockSteps) * kThreads, next_block);
            }
            bits = next_bits;
            next_bits = lane_bits(block, ahead);
          }
        }
      };
      if constexpr (kMinPRows) {
        general_steps(std::false_type{});
      } else {
        general_steps(std::true_type{});
      }
    }
    // The warps' results per row (the sparse pass published its own), then the CTA's.
    if (!sparse) {
#pragma unroll
      for (int r = 0; r < kQuad; ++r) {
        if (counted[r]) {
          publish_warp_row(results, r, stats, best_score[r], best_index[r], first[r], allowed[r], has_nan[r],
                           mass_max[r], mass_sum[r]);
        }
      }
    }
    __syncthreads();
    if (threadIdx.x < kQuad && quad[threadIdx.x].counted) {
      int const r = threadIdx.x;
      PackedCandidate best = 0;
      for (int w = 0; w < kWarps; ++w) best = results.best[w][r] > best ? results.best[w][r] : best;
      ws.candidates[(at.item * kQuad + r) * p.num_samples + s] = best;
      if (stats) {
        ChunkPartial out{0, 0, 0, -INFINITY, 0.0f};
        for (int w = 0; w < kWarps; ++w) {
          out.first = results.first[w][r] > out.first ? results.first[w][r] : out.first;
          out.allowed += results.allowed[w][r];
          out.has_nan |= results.nan[w][r];
          merge_mass(out.mass_max, out.mass_sum, results.mass[w][r][0], results.mass[w][r][1]);
        }
        ws.partials[at.item * kQuad + r] = out;
      }
    }
    __syncthreads();  // the slots are written again by the next sample
  }
}

// A CTA an item (quad_chunks): the grid has most_streaming_items CTAs, at least the items of any
// count of listed quads. Each CTA lists the quads itself (a flag a row read), so that no launch
// before it needs to; CTA 0 leaves the chunk count, and each quad's chunk 0 its place in the list,
// for the finish. kMinPRows takes one wave (quad_chunks).
template <bool kMinPRows>
__global__ void __launch_bounds__(kThreads, kStreamingCtasPerSm)
    streaming_sample_kernel(LogitsSamplerParams const p, Workspace ws, int sm_count) {
  int64_t const quads = (p.batch_size + kQuad - 1) / kQuad;
  int64_t const listed = count_listed<QuadStreams>(p, quads);
  if (listed == 0) return;  // nor does the finish read anything
  EvenChunks const chunking = quad_chunks(static_cast<uint32_t>(listed), static_cast<uint32_t>(p.vocab_size), sm_count, kMinPRows);
  if (blockIdx.x == 0 && threadIdx.x == 0) *ws.listed_chunks = chunking.chunks;
  int64_t const item = blockIdx.x;
  if (item >= listed * chunking.chunks) return;
  int64_t const slot = item / chunking.chunks, chunk = item % chunking.chunks;
  int64_t const quad = listed_at<QuadStreams>(p, quads, listed, slot);
  __shared__ StreamingItem at;
  if (threadIdx.x == 0) {
    if (chunk == 0) ws.quad_slots[quad] = static_cast<int32_t>(slot);
    int64_t const begin = chunk * chunking.tokens;
    at = {item, quad, begin, begin + chunking.tokens < p.vocab_size ? begin + chunking.tokens : p.vocab_size};
  }
  __syncthreads();
  sample_quad_chunk<kMinPRows>(p, ws, at);
}

// 2. A warp a row: the chunks merged, the row's outputs written.
__global__ void __launch_bounds__(128) streaming_finish_kernel(LogitsSamplerParams const p, Workspace ws) {
  int const lane = threadIdx.x % 32;
  int64_t const row = int64_t{blockIdx.x} * 4 + threadIdx.x / 32;
  if (row >= p.batch_size) return;
  if (!is_streaming_row(p, row)) return;
  // The row's chunks are items slot * chunks .. + chunks - 1 (streaming_sample_kernel), each with
  // its quad's four rows.
  int64_t const chunks = *ws.listed_chunks;
  int64_t const first_item = int64_t{ws.quad_slots[row / kQuad]} * chunks;
  int const r = static_cast<int>(row % kQuad);
  ChunkPartial const* partials = ws.partials + first_item * kQuad + r;  // chunk c at [c * kQuad]
  PackedCandidate first = 0;
  uint32_t allowed = 0, has_nan = 0;
  for (int64_t c = lane; c < chunks; c += 32) {
    ChunkPartial const& part = partials[c * kQuad];
    first = part.first > first ? part.first : first;
    allowed += part.allowed;
    has_nan |= part.has_nan;
  }
  first = warp_max(first);
  allowed = warp_sum(allowed);
  has_nan = warp_sum(has_nan);
  float const inv_t = row_inv_t(p, row);
  if (inv_t != inv_t) {  // an invalid temperature in a device tensor: no candidate
    bool const empty = p.allowed_mask != nullptr && allowed == 0;
    write_row_without_sample(p, row, lane, 32, empty ? p.empty_mask_token : -1,
                             empty ? -INFINITY : __uint_as_float(0x7fc00000u));
    return;
  }
  if (allowed == 0) {
    write_row_without_sample(p, row, lane, 32, p.allowed_mask ? p.empty_mask_token : -1, -INFINITY);
    return;
  }
  float const y0f = from_order_bits(static_cast<uint32_t>(first >> 32));
  double const y0 = static_cast<double>(y0f);
  bool const y0_finite = isfinite(y0f);
  // The survivors' mass relative to y0 (the first token survives, so it is the largest y).
  double kept_mass = 0.0;
  if (p.token_logprobs != nullptr) {
    for (int64_t c = lane; c < chunks; c += 32) {
      float const m = partials[c * kQuad].mass_max;
      if (y0_finite && m != -INFINITY) kept_mass += static_cast<double>(partials[c * kQuad].mass_sum) * exp(m - y0);
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) kept_mass += __shfl_xor_sync(kFullMask, kept_mass, d);
    if (has_nan) kept_mass = NAN;
  }
  RowInput const in = row_input(p, row, inv_t);
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  RowNoiseKey const noise = row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(row), 0);
  for (int s = 0; s < p.num_samples; ++s) {
    // chunk c's candidate at [c * kQuad * S]
    PackedCandidate const* candidates = ws.candidates + (first_item * kQuad + r) * p.num_samples + s;
    PackedCandidate best = 0;
    for (int64_t c = lane; c < chunks; c += 32) {
      PackedCandidate const candidate = candidates[c * kQuad * p.num_samples];
      best = candidate > best ? candidate : best;
    }
    best = warp_max(best);
    if (lane != 0) continue;
    int32_t const index = static_cast<int32_t>(~static_cast<uint32_t>(best));
    float score = -INFINITY;
    double best_y = 0.0;
    if (index != kNoCandidate) {  // its x, y and score again, as the pass drew them
      float x, y;
      in.token(static_cast<uint32_t>(index), x, y);
      score = perturbed_score(in, noise, static_cast<uint32_t>(s), static_cast<uint32_t>(index), x);
      best_y = static_cast<double>(y);
    }
    write_sample(p, row, s, score, index, best_y, y0, y0_finite, kept_mass);
    // A top_p row's winner t is its sample if top_p keeps it: round 0 verifies it (one sample,
    // no log-probabilities here; y0 is finite for every row of streamed_first_y).
    double const top_p = row_top_p(p, row);
    if (ws.round_rows != nullptr && index != kNoCandidate && top_p > 0.0 && top_p < 1.0) {
      ws.round_rows[row] = {pack_top_candidate(static_cast<float>(best_y), static_cast<uint32_t>(index)), 0ull};
      append_to_row_list(ws.round_lists, row);
    }
  }
}

// 3. The top_p rounds (streams_top_p_rows, with streamed_first_y and a row list). A row's survivors
// are a prefix of the truncation order, and the sample is their best candidate; t, the best
// candidate of every allowed token (the pass above's, or the GEMM's winner: the row's sample), is
// the sample iff top_p keeps it: the mass strictly ahead of it does not reach top_p of the row's
// (top_p_reached, the cut path's rule on the same fixed-point integers). Else every survivor lies
// strictly ahead of t, and the best candidate strictly ahead of it is the next t (the cut path's
// winner-first passes, here over many CTAs a row). t passed min_p (the pass's survivors did), and
// so does every key ahead of it. Round 0 verifies every row's t (most rows are decided there),
// round 1 draws the next t of the rows that failed, round 2 verifies it, and so on (kRounds). Each
// round takes the rows of its list (the finish kernel's, or round 0 lists the GEMM's winners
// itself; then the previous round's), as (row, chunk) items spread over the grid
// (round_chunk_tokens), so that a few rows left for the later rounds still spread over every
// multiprocessor; the last CTA to finish a row's chunks (a ticket) merges them, decides, and puts
// the row on the next round's list, or after the last round hands it to the cut path (NaN in
// streamed_first_y, appended to `rows`).

// A round's decision for a row, from the merged chunks (one thread): a verifying round keeps t
// as the sample or (it failed) lists the row for the next round, which draws; a drawing round
// writes the best candidate ahead of t as the row's sample and next t (none, from NaN scores
// only: token -1, as on the cut path's winner-first passes) and lists the row for the next
// round, which verifies it. After the last round (a verifying one) a failed row goes to the cut
// path.
static_assert(kRounds % 2 == 1, "kRounds: the last round verifies what the one before drew");
__device__ void decide_round(LogitsSamplerParams const& p, Workspace const& ws, int round, int64_t row,
                             RowInput const& in, RowNoiseKey const& noise, double y0, FixedMass ahead, FixedMass total,
                             PackedCandidate best, bool drawn) {
  RoundRow& state = ws.round_rows[row];
  if (round == 0) state.total = total;
  double const top_p = row_top_p(p, row);
  if (!drawn && !top_p_reached(ahead, state.total, top_p)) return;  // t is the sample, already written
  bool pending = true;  // on the next round's list
  if (drawn) {
    int32_t const index = static_cast<int32_t>(~static_cast<uint32_t>(best));
    float score = -INFINITY;
    double best_y = 0.0;
    pending = index != kNoCandidate;
    if (pending) {
      float x, y;
      state.t_key = in.token(static_cast<uint32_t>(index), x, y);
      score = perturbed_score(in, noise, 0, static_cast<uint32_t>(index), x);
      best_y = static_cast<double>(y);
    }
    write_sample(p, row, 0, score, index, best_y, y0, true, 1.0);
  }
  if (!pending) return;
  int32_t* const next = round + 1 < kRounds ? ws.round_lists + int64_t{round + 1} * (p.batch_size + 1) : p.rows;
  if (next == p.rows) p.streamed_first_y[row] = __uint_as_float(0x7fc00000u);  // the cut kernel runs after the rounds
  append_to_row_list(next, row);
}

// One (row, chunk) item of a round: verifying (!kDraw), the mass of the allowed keys strictly
// ahead of t (and, round 0, of every allowed key); drawing, the best candidate strictly ahead of
// t. The draw skips what cannot
// win as the streaming pass does: a token whose score with the largest noise any bits give stays
// below the warp's best so far draws no Philox block, and one whose bits bound its noise below it
// no logarithms (the skips are exact: strictly below a score already drawn).
template <bool kDraw>
struct RoundChunk {
  PackedCandidate t_key;
  double y0;
  bool with_total;
  RowInput in;
  RowNoiseKey noise;
  FixedMass ahead = 0, total = 0;
  float best_score = -INFINITY;
  int32_t best_index = kNoCandidate;

  // kLean: no bias, no mask (every token in range is allowed).
  template <bool kLean>
  __device__ __forceinline__ void run(int64_t begin, int64_t end) {
    float const inv_t = in.greedy ? 1.0f : in.inv_t;  // fs_mul(x, 1) == x: a greedy row's y
    float const max_noise = fs_gumbel_upper_bound_from_bits(kFullMask);
    float floor = -INFINITY;
    if constexpr (kLean && !kDraw) {
      // A verifying round: four tokens a load where the row's chunk is 16-byte aligned (the fused
      // truncation's stored rows are), so that four times the bytes are in flight; the integer
      // sums do not depend on which thread adds which token.
      if (reinterpret_cast<uintptr_t>(in.logits + begin) % 16 == 0) {
        run_verify_vectorized(begin, end, inv_t);
        return;
      }
    }
    // The same steps in every thread (the draw's floor is a warp collective).
    for (int64_t base = begin; base < end; base += kRoundUnroll * kThreads) {
      float raw[kRoundUnroll];
#pragma unroll
      for (int j = 0; j < kRoundUnroll; ++j) {
        int64_t const v = base + j * kThreads + threadIdx.x;
        raw[j] = v < end ? __ldg(in.logits + v) : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kRoundUnroll; ++j) {
        int64_t const v = base + j * kThreads + threadIdx.x;
        float x, y;
        PackedCandidate key;
        if constexpr (kLean) {
          x = raw[j];
          y = fs_mul(x, inv_t);
          key = v < end ? pack_top_candidate(y, in.vocab_start + static_cast<uint32_t>(v)) : PackedCandidate{0};
        } else {
          key = in.key(v, v < end, raw[j], x, y);
        }
        bool const is_ahead = key > t_key;  // t_key > 0: excluded keys (0) are never ahead
        if constexpr (!kDraw) add_masses(key, y);
        if (kDraw && is_ahead) {
          uint32_t const index = top_candidate_index(key);
          if (in.greedy) {
            offer(x, index);
          } else if (!(fs_perturbed_score(x, inv_t, max_noise) < floor)) {
            uint32_t const bits =
                fs_philox_lane(fs_noise_block(noise.seed, noise.offset, index, noise.stream >> 2), noise.stream & 3u);
            if (!(fs_perturbed_score(x, inv_t, fs_gumbel_upper_bound_from_bits(bits)) < floor)) {
              offer(fs_perturbed_score(x, inv_t, fs_gumbel_from_bits(bits)), index);
            }
          }
        }
      }
      if constexpr (kDraw) floor = warp_max(best_score);
    }
  }

  // run<true> of a verifying round (with_total in round 0), four tokens a thread and load: the masses of
  // every key and of the keys strictly ahead of t. The chunk's whole steps test no bounds (its last
  // partial step, if any, does), and "ahead of t" compares the key's two 32-bit halves (its order
  // bits, then the index) rather than building the 64-bit key: the loop's cost is its
  // instructions an element.
  __device__ __forceinline__ void run_verify_vectorized(int64_t begin, int64_t end, float inv_t) {
    constexpr int64_t kStep = int64_t{kRoundUnroll} * kThreads * 4;
    uint32_t const t_order = static_cast<uint32_t>(t_key >> 32);
    uint32_t const t_index = top_candidate_index(t_key);
    FixedMass every = 0;  // the masses of every key, the row's total where with_total
    int64_t base = begin;
    // Where t's y is a number, "ahead of t" is two float comparisons and the index's: the order
    // bits map every number monotonically (-0 and +0 alike), and a NaN y is behind every number
    // in both orders (and has no mass).
    float const t_y = from_order_bits(t_order);
    if (t_y == t_y) {
      for (; base + kStep <= end; base += kStep) verify_step<false, true>(base, end, inv_t, t_order, t_index, t_y, every);
      if (base < end) verify_step<true, true>(base, end, inv_t, t_order, t_index, t_y, every);
    } else {
      for (; base + kStep <= end; base += kStep) verify_step<false, false>(base, end, inv_t, t_order, t_index, t_y, every);
      if (base < end) verify_step<true, false>(base, end, inv_t, t_order, t_index, t_y, every);
    }
    total += with_total ? every : 0ull;
  }

  // One step of run_verify_vectorized: kRoundUnroll float4 loads a thread from `base`; kBounded
  // for a step that reaches past `end` (its tokens there load nothing and add no mass).
  template <bool kBounded, bool kFloatOrder>
  __device__ __forceinline__ void verify_step(int64_t base, int64_t end, float inv_t, uint32_t t_order,
                                              uint32_t t_index, float t_y, FixedMass& every) {
    float4 raw[kRoundUnroll];
#pragma unroll
    for (int j = 0; j < kRoundUnroll; ++j) {
      int64_t const v = base + (int64_t{j} * kThreads + threadIdx.x) * 4;
      if (!kBounded || v + 3 < end) {
        raw[j] = __ldg(reinterpret_cast<float4 const*>(in.logits + v));
      } else {
        raw[j].x = v < end ? __ldg(in.logits + v) : 0.0f;
        raw[j].y = v + 1 < end ? __ldg(in.logits + v + 1) : 0.0f;
        raw[j].z = v + 2 < end ? __ldg(in.logits + v + 2) : 0.0f;
        raw[j].w = 0.0f;  // v + 3 >= end
      }
    }
#pragma unroll
    for (int j = 0; j < kRoundUnroll; ++j) {
      int64_t const v = base + (int64_t{j} * kThreads + threadIdx.x) * 4;
      uint32_t const index = in.vocab_start + static_cast<uint32_t>(v);
      float const xs[4] = {raw[j].x, raw[j].y, raw[j].z, raw[j].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float const y = fs_mul(xs[e], inv_t);
        bool is_ahead;
        if constexpr (kFloatOrder) {
          is_ahead = y > t_y || (y == t_y && static_cast<int32_t>(index) < static_cast<int32_t>(t_index) - e);
        } else {
          uint32_t const order = order_bits(y);  // pack_top_candidate's high half
          is_ahead = order > t_order || (order == t_order && index + e < t_index);
        }
        FixedMass m = fixed_mass(y, y0);
        if constexpr (kBounded) m = v + e < end ? m : 0ull;
        every += m;
        if (is_ahead) ahead += m;
      }
    }
  }

  // A token's fixed-point mass into the row's (with_total) and, if its key is strictly ahead of
  // t, the mass ahead (excluded keys, 0, add nothing).
  __device__ __forceinline__ void add_masses(PackedCandidate key, float y) {
    FixedMass const m = key != 0 ? fixed_mass(y, y0) : 0ull;
    total += with_total ? m : 0ull;
    ahead += key > t_key ? m : 0ull;
  }

  __device__ __forceinline__ void offer(float score, uint32_t index) {
    if (fs_candidate_better(score, static_cast<int32_t>(index), best_score, best_index)) {
      best_score = score;
      best_index = static_cast<int32_t>(index);
    }
  }
};

// The truncation key of t, the GEMM's winner of a streamed row (kListsWinners); `first` (one
// thread of the row's chunk 0) also writes it as the row's sample, as the cut path would, and
// keeps the key for the next round.
__device__ PackedCandidate start_from_winner(LogitsSamplerParams const& p, Workspace const& ws, int64_t row,
                                             RowInput const& in, RowNoiseKey const& noise, double y0, bool first) {
  uint32_t const index = ~static_cast<uint32_t>(__ldg(p.streamed_winners + row));
  float x, y;
  PackedCandidate const t_key = in.token(index, x, y);
  if (first) {
    float const score = perturbed_score(in, noise, 0, index, x);
    write_sample(p, row, 0, score, static_cast<int32_t>(index), static_cast<double>(y), y0, true, 1.0);
    ws.round_rows[row].t_key = t_key;
  }
  return t_key;
}

// round_chunk_tokens with the kRoundMostWaves splits in the warp's lanes side by side (warp-wide;
// every lane gets it): the least cost, the fewest waves of equals.
static_assert(kRoundMostWaves <= 32, "a lane a wave count");
__device__ int64_t warp_round_chunk_tokens(int64_t rows, int64_t vocab, int64_t ctas, int64_t step) {
  if (rows < 1 || rows >= ctas) return vocab;
  uint32_t const lane = threadIdx.x % 32;
  RoundSplit const split = round_split(static_cast<uint32_t>(rows), static_cast<uint32_t>(vocab),
                                       static_cast<uint32_t>(ctas), lane < kRoundMostWaves ? lane + 1 : 1,
                                       static_cast<uint32_t>(step));
  uint32_t const least = __reduce_min_sync(kFullMask, split.cost);
  int const first = __ffs(__ballot_sync(kFullMask, split.cost == least)) - 1;
  return __shfl_sync(kFullMask, split.tokens, first);
}

// A round's launch. kListsWinners: round 0 where the GEMM drew the streamed rows' winners
// (streamed_winners): no kernel ran between stage 2 and this round, so each CTA lists the
// streaming rows itself (a flag a row) and takes t from the winners, and each row's chunk 0 writes
// t as the row's sample and keeps its key for the rounds after.
template <bool kDraw, bool kListsWinners = false>
__global__ void __launch_bounds__(kThreads, kRoundCtasPerSm) top_p_round_kernel(LogitsSamplerParams const p, Workspace ws,
                                                               int round) {
  static_assert(!(kDraw && kListsWinners), "the winners' round verifies");
  __shared__ RoundPartial warp_partial[kWarps];
  __shared__ bool last_cta;
  int32_t const* const list = ws.round_lists + int64_t{round} * (p.batch_size + 1);
  int64_t const rows = kListsWinners ? count_listed<RowStreams>(p, p.batch_size) : __ldcg(list);
  // A CTA past the items of every split has none; the others take the split from warp 0, whose
  // lanes weigh the waves side by side (the divisions are most of an item's setup otherwise, and
  // every CTA of the grid would run them).
  constexpr int64_t kStep = kDraw ? kRoundDrawChunkTokens : kRoundChunkTokens;
  if (blockIdx.x >= rows * flashsampling::round_chunks(p.vocab_size, kStep)) return;
  int const warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __shared__ int64_t round_chunk;
  if (warp == 0) {
    int64_t const tokens = warp_round_chunk_tokens(rows, p.vocab_size, gridDim.x, kStep);
    if (lane == 0) round_chunk = tokens;
  }
  __syncthreads();
  int64_t const chunk_tokens = round_chunk;
  int const round_chunks = static_cast<int>((p.vocab_size + chunk_tokens - 1) / chunk_tokens);
  int64_t const items = rows * round_chunks;
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    int64_t const slot = item / round_chunks;
    int64_t const row =
        kListsWinners ? listed_at<RowStreams>(p, p.batch_size, rows, slot) : __ldcg(list + 1 + slot);
    int const chunk = static_cast<int>(item % round_chunks);
    float const inv_t = row_inv_t(p, row);
    RowInput const in = row_input(p, row, inv_t);
    RowNoiseKey const noise = row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(row), 0);
    double const y0 = static_cast<double>(__ldcg(p.streamed_first_y + row));  // the last round writes it
    PackedCandidate t_key;
    if constexpr (kListsWinners) {
      t_key = start_from_winner(p, ws, row, in, noise, y0, chunk == 0 && threadIdx.x == 0);
    } else {
      t_key = __ldcg(&ws.round_rows[row].t_key);
    }
    int64_t const begin = int64_t{chunk} * chunk_tokens;
    int64_t const end = begin + chunk_tokens < p.vocab_size ? begin + chunk_tokens : p.vocab_size;
    RoundChunk<kDraw> part{t_key, y0, round == 0, in, noise};
    // Without bias and mask (the fused truncation's stored x, when the call has no mask) the
    // element's arithmetic has no branch on them.
    if (in.bias == nullptr && in.mask == nullptr) {
      part.template run<true>(begin, end);
    } else {
      part.template run<false>(begin, end);
    }
    FixedMass ahead = part.ahead, total = part.total;
    PackedCandidate best = pack_candidate(part.best_score, part.best_index);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      ahead += __shfl_xor_sync(kFullMask, ahead, d);
      total += __shfl_xor_sync(kFullMask, total, d);
    }
    best = warp_max(best);
    if (lane == 0) warp_partial[warp] = {ahead, total, best};
    __syncthreads();
    if (threadIdx.x == 0) {
      RoundPartial out = warp_partial[0];
      for (int w = 1; w < kWarps; ++w) {
        out.ahead += warp_partial[w].ahead;
        out.total += warp_partial[w].total;
        out.best = warp_partial[w].best > out.best ? warp_partial[w].best : out.best;
      }
      ws.round_partials[row * round_chunks + chunk] = out;
      // The last CTA of the row's chunks sees every partial: fence, then the ticket.
      __threadfence();
      uint32_t const ticket = atomicAdd(ws.round_tickets + int64_t{round} * p.batch_size + row, 1u);
      last_cta = ticket == static_cast<uint32_t>(round_chunks - 1);
    }
    __syncthreads();
    if (last_cta && warp == 0) {
      __threadfence();
      RoundPartial const* partials = ws.round_partials + row * round_chunks;
      FixedMass row_ahead = 0, row_total = 0;
      PackedCandidate row_best = 0;
      for (int c = lane; c < round_chunks; c += 32) {
        row_ahead += __ldcg(&partials[c].ahead);
        row_total += __ldcg(&partials[c].total);
        PackedCandidate const b = __ldcg(&partials[c].best);
        row_best = b > row_best ? b : row_best;
      }
#pragma unroll
      for (int d = 16; d > 0; d >>= 1) {
        row_ahead += __shfl_xor_sync(kFullMask, row_ahead, d);
        row_total += __shfl_xor_sync(kFullMask, row_total, d);
      }
      row_best = warp_max(row_best);
      if (lane == 0) decide_round(p, ws, round, row, in, noise, y0, row_ahead, row_total, row_best, kDraw);
    }
    __syncthreads();  // warp_partial and last_cta are written again for the next item
  }
}

// Whether a launch samples its rows with the kMinPRows instance: it has streamed_first_y, and a
// row can be cut by min_p (a top_p call's rows are not); not where the GEMM drew the winners.
bool streams_min_p_rows(LogitsSamplerParams const& p) {
  return p.streamed_winners == nullptr && p.streamed_first_y != nullptr && (p.min_ps != nullptr || p.min_p > 0.0);
}

}  // namespace

size_t streaming_rows_workspace_bytes(LogitsSamplerParams const& p, int sm_count) {
  int64_t const items = workspace_streaming_items((p.batch_size + kQuad - 1) / kQuad, p.vocab_size, sm_count);
  return WorkspaceLayout(p.batch_size, p.num_samples, items, p.vocab_size, streams_top_p_rows(p)).total;
}

cudaError_t launch_streaming_rows(LogitsSamplerParams const& p, void* workspace, int sm_count, cudaStream_t stream) {
  int64_t const quads = (p.batch_size + kQuad - 1) / kQuad;
  int64_t const items = workspace_streaming_items(quads, p.vocab_size, sm_count);
  bool const rounds = streams_top_p_rows(p) && p.streamed_first_y != nullptr && p.rows != nullptr;
  WorkspaceLayout const layout(p.batch_size, p.num_samples, items, p.vocab_size, rounds);
  Workspace const ws = layout.carve(workspace);
  cudaError_t const err = launch_zero_bytes(ws.floors, layout.total - layout.floors, stream);
  if (err != cudaSuccess) return err;
  bool const min_p_rows = streams_min_p_rows(p);
  unsigned const grid = static_cast<unsigned>(most_streaming_items(quads, p.vocab_size, sm_count, min_p_rows));
  // No pass where the GEMM drew every streamed row's winner; the min_p instance only where a row
  // can be cut by min_p (a top_p call's rows are not).
  if (p.streamed_winners != nullptr) {
    if (!rounds) return cudaErrorInvalidValue;  // the winners are for the rounds
  } else if (min_p_rows) {
    streaming_sample_kernel<true><<<grid, kThreads, 0, stream>>>(p, ws, sm_count);
  } else {
    streaming_sample_kernel<false><<<grid, kThreads, 0, stream>>>(p, ws, sm_count);
  }
  // Where the GEMM drew the winners no pass ran, and round 0 lists the rows itself.
  if (p.streamed_winners == nullptr) {
    streaming_finish_kernel<<<static_cast<unsigned>((p.batch_size + 3) / 4), 128, 0, stream>>>(p, ws);
  }
  if (rounds) {
    // Four CTAs an SM, or one an item where the batch has fewer (an empty round's launch is then
    // small too); the drawing rounds' rows have more, smaller chunks.
    int64_t const ctas = kRoundCtasPerSm * int64_t{sm_count < 1 ? 1 : sm_count};
    auto round_grid = [&](int64_t step) {
      return static_cast<int>(std::min<int64_t>(ctas, p.batch_size * round_chunks(p.vocab_size, step)));
    };
    int const verify_grid = round_grid(kRoundChunkTokens), draw_grid = round_grid(kRoundDrawChunkTokens);
    for (int round = 0; round < kRounds; ++round) {
      if (round == 0 && p.streamed_winners != nullptr) {
        top_p_round_kernel<false, true><<<verify_grid, kThreads, 0, stream>>>(p, ws, round);
      } else if (round % 2 == 0) {
        top_p_round_kernel<false><<<verify_grid, kThreads, 0, stream>>>(p, ws, round);
      } else {
        top_p_round_kernel<true><<<draw_grid, kThreads, 0, stream>>>(p, ws, round);
      }
    }
  }
  return cudaGetLastError();
}

}  // namespace flashsampling
