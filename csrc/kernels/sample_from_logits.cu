// Sampling from materialised fp32 logits with per-row top-k / top-p / min-p
// (flashsampling/sample_from_logits.h has the contract). One kernel: a cluster of CTAs takes a
// row at a time, each CTA a slice of its vocabulary, and every decision is made from
// histograms summed over the cluster through distributed shared memory, so all CTAs of the
// cluster take the same branches with no second launch and no host round trip.
//
// Winner-first path (winner_first_row). A row without top_k (k < 1), with one sample, no
// log-probabilities and top_p and / or min_p given, that is greedy or has top_p in a launch of at
// most kWinnerFirstMaxRows rows (a device-side test per row, the same in every CTA of the
// cluster), finds the sample before the cut: pass 1 also takes t, the best perturbed score
// (fs_candidate_better, the sample pass's noise) over every allowed token. t is the sample if it
// is the first token, or passes min_p and (top_p) the fixed-point mass strictly ahead of it in
// the truncation order does not reach top_p of the row's mass (top_p_reached, the cut rule's
// comparison on the same integers: a key survives iff its predecessor's inclusive mass does not
// reach top_p). Else each further pass (winner_first_pass) sums the mass ahead of t (and, the
// first time, the row's) and takes the best score strictly ahead of t, which replaces t if t
// fails. Survivors form a prefix of the order, so the sample always lies at or ahead of t, and
// the token and score equal the cut path's bit for bit. A row still undecided after
// kWinnerFirstPasses (3) such passes, a min_p-alone row whose t fails min_p, a row without a
// finite first y or whose top_p keeps only the first token goes on to the cut path below, from
// pass 1's results.
//
// A row's survivors are the keys >= one threshold key (a prefix of the truncation order)
// that also pass min_p, a test of each element against the row's first. Keys are 64 bits:
// the order bits of y (hi; NaN 1, excluded tokens key 0) and ~global index (lo), so unsigned
// order is the truncation order and every key is distinct. Per row:
//
//  1. one pass: the largest key (the first token, y0), the allowed tokens and the smallest
//     finite y;
//  2. (top_k or top_p) one pass histograms the keys by bins of y over [min y, y0] (2048 bins,
//     monotone in the key): counts, and for top_p alone masses (exp(y - y0) in fp32, in fixed
//     point with 41 fraction bits, so the sums are exact integers whatever the order:
//     deterministic). The cut's bin follows from the histogram (top_k: the k-th key's; top_p:
//     the first whose inclusive mass reaches top_p);
//  3. one pass gathers keys into the leader CTA's list (4096 keys): every key from the cut's bin
//     up where they fit (the usual case for top_k, and for top_p on a peaked row), else the
//     cut's bin alone; the leader sorts the list and reads the exact cut off it (top_p over the
//     top_k survivors from the list's masses). A bin too full for the list (massive ties) sends
//     the row to a radix descent over key digits (11, 11, 10 bits of y, then of the index), one
//     pass a level, with the same arithmetic;
//  4. per sample, Gumbel-Max over the survivors with the noise of plain sampling and (for
//     log-probabilities) their mass: from the list where it holds every survivor (no pass),
//     else a pass over the row whose survivors queue per warp for their noise.
//
// top_p's masses are fp32 exponentials rounded to multiples of 2^-41 of the first token's,
// where truncation.py sums float64 ones in order: the fp32 exponentials differ from float64
// ones by ~1e-7 relative (the tolerance the float64 reference grants the fp32 logits anyway),
// and the rounding adds at most V * 2^-42 of the first token's mass (1e-6 of it at V = 2^22;
// masses below 2^-42 of it count as 0), so the two keep a different last token only where the
// prefix mass lies that close to top_p.
#include <cooperative_groups.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sample_from_logits.h"
#include "logits_rows.cuh"

namespace flashsampling {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
// Elements a thread uses a step. One CTA an SM streams its slice from L2 or HBM, so the loads in
// flight set a pass's bandwidth: the next step's are issued before this step's are used (16
// loads a thread in flight, 32 KiB an SM, overlapping the work; 16 a step without the overlap
// took 1.1-1.3x longer on an H100).
constexpr int kUnroll = 8;
constexpr int kLevels = 6;  // digits of a key: 11, 11, 10 bits of y, then of ~index
constexpr int kMaxBins = 2048;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Which rows take the winner-first path (winner_first_row) besides greedy ones: top_p rows in a
// launch of at most this many rows. Pass 1 then draws noise for every allowed token; with few
// rows the cluster's passes are bound by their latency and two passes with noise beat the cut's
// ~7, but a launch of many flat rows is bound by that noise and the cut path is faster (the A/B
// in docs/truncation_kernels.md: on flat rows 0.4-0.9x from 16 rows, up to 1.9x faster at one). The
// fused truncation's fallback rows of LLM-like batches are few, long-tailed ones. min_p-alone rows
// never take it (its pass 1 cost 1.5x the cut path's one sample pass at every row count).
constexpr int64_t kWinnerFirstMaxRows = 8;

__device__ __forceinline__ int level_shift(int level) {
  return level == 0 ? 53 : level == 1 ? 42 : level == 2 ? 32 : level == 3 ? 21 : level == 4 ? 10 : 0;
}
__device__ __forceinline__ int level_bits(int level) {
  return (level == 0 ? 64 : level_shift(level - 1)) - level_shift(level);
}

// A mass (<= 2^41, 42 bits) enters the histogram as four 11-bit parts, each summed in a 32-bit
// word of its own: shared memory adds 32-bit integers natively (its float and 64-bit adds are
// compare-and-swap loops), with no carry to propagate. A word holds the parts of 2^21 elements:
// a CTA's slice is at most ceil(V / 2) <= 2^21 (kLogitsSamplerMaxVocab).
constexpr int kMassParts = 4;
constexpr int kMassPartBits = 11;

// Keys of one bin of the row, gathered from the cluster into the leader CTA and sorted there.
constexpr int kListCapacity = 4096;

// A survivor waiting in its warp's queue for its noise (the sample pass).
struct QueuedSurvivor {
  uint32_t index;
  float x, y;
};
constexpr int kQueue = 64;  // a warp's queue: 32 drawn at a time, up to 31 left plus 32 added

struct SharedState {
  // This CTA's histogram of the current level (the cluster's peers read it) and the cluster's sum.
  unsigned count[kMaxBins];
  unsigned mass_part[kMassParts][kMaxBins];
  unsigned total_count[kMaxBins];
  FixedMass total_mass[kMaxBins];
  // The leader's list: the keys of one bin (every CTA adds its own through distributed shared
  // memory), sorted descending, with their inclusive prefix masses; and the cut found in it.
  PackedCandidate list[kListCapacity];
  FixedMass list_mass[kListCapacity];
  unsigned list_size;
  PackedCandidate list_cut;    // top_k's
  PackedCandidate list_cut_p;  // top_p's
  // This CTA's partial results of a pass over the row that every CTA reads from every peer after
  // one cluster barrier: pass 1 and the winner-first passes, two slots used in turn (the step
  // counter `phase`, the same in every CTA of the cluster), so a slot is written again only after
  // the barrier of the next step, which every peer passes once it has read it.
  struct Partials {
    PackedCandidate max_key;  // pass 1
    unsigned allowed;         // pass 1
    float min_y;              // pass 1: of its finite allowed y
    float score;              // winner-first: the best perturbed score (fs_candidate_better) ...
    int32_t index;            // ... its token (kNoCandidate: none)
    double y;                 // ... and its y
    FixedMass ahead;          // winner-first: the mass strictly ahead of the candidate
    FixedMass total;          // winner-first: the row's mass
  } partials[2];
  double kept_mass;  // of the survivors
  float best_score;
  int32_t best_index;
  double best_y;
  QueuedSurvivor queue[kWarps][kQueue];
  // Block reductions.
  PackedCandidate warp_key[kWarps];
  unsigned warp_count[kWarps];
  double warp_mass[kWarps];
  float warp_min[kWarps];
  FixedMass warp_fixed[kWarps];
  float warp_score[kWarps];
  int32_t warp_index[kWarps];
  double warp_y[kWarps];
  // Warp 0's choice of digit at a level.
  int digit;
  unsigned digit_count;
  unsigned count_above;
  FixedMass mass_above;
  FixedMass mass_total;  // of the keys >= the top_k cut
};

// Calls f(v, x, y, key) for the elements [begin, end) of the row, warp-uniformly (lanes past
// `end` get key 0), so f may use warp collectives.
template <class F>
__device__ __forceinline__ void for_each_element(RowInput const& in, int64_t begin, int64_t end, F&& f) {
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // The next step's loads are in flight while this step's elements are used.
  float raw[kUnroll], next[kUnroll];
  int64_t base = begin + warp * 32;
#pragma unroll
  for (int j = 0; j < kUnroll; ++j) {
    int64_t const v = base + j * kThreads + lane;
    raw[j] = v < end ? __ldg(in.logits + v) : 0.0f;
  }
  for (; base < end; base += int64_t{kUnroll} * kThreads) {
    int64_t const following = base + int64_t{kUnroll} * kThreads;
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      int64_t const v = following + j * kThreads + lane;
      next[j] = v < end ? __ldg(in.logits + v) : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      int64_t const v = base + j * kThreads + lane;
      float x, y;
      PackedCandidate const key = in.key(v, v < end, raw[j], x, y);
      f(v, x, y, key);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) raw[j] = next[j];
  }
}

// Adds `active` lanes' digits to the histogram: one atomic per distinct digit of the warp.
__device__ __forceinline__ void add_counts(unsigned* count, unsigned digit, bool active) {
  unsigned const active_lanes = __ballot_sync(kFullMask, active);
  if (!active) return;
  unsigned const peers = __match_any_sync(active_lanes, digit);
  if (static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1) atomicAdd(count + digit, __popc(peers));
}

// Adds `active` lanes' digits and masses: the lanes of one digit (one match) sum each part of
// their masses in one warp reduction, and the digit's first lane adds the sums, with no return
// value to wait for.
__device__ __forceinline__ void add_counts_and_masses(SharedState& sh, unsigned digit, FixedMass m, bool active) {
  unsigned const active_lanes = __ballot_sync(kFullMask, active);
  if (!active) return;
  unsigned const peers = __match_any_sync(active_lanes, digit);
  bool const first = static_cast<int>(threadIdx.x % 32) == __ffs(peers) - 1;
  if (first) atomicAdd(sh.count + digit, __popc(peers));
#pragma unroll
  for (int part = 0; part < kMassParts; ++part) {
    unsigned const bits = static_cast<unsigned>(m >> (part * kMassPartBits)) & ((1u << kMassPartBits) - 1u);
    unsigned const sum = __reduce_add_sync(peers, bits);
    if (first && sum != 0) atomicAdd(sh.mass_part[part] + digit, sum);
  }
}

// Block-wide reductions in a fixed order (deterministic). Every thread gets the result.
__device__ PackedCandidate block_max(PackedCandidate v, SharedState& sh) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    PackedCandidate const other = __shfl_xor_sync(kFullMask, v, delta);
    v = other > v ? other : v;
  }
  if (threadIdx.x % 32 == 0) sh.warp_key[threadIdx.x / 32] = v;
  __syncthreads();
  PackedCandidate r = sh.warp_key[0];
  for (int w = 1; w < kWarps; ++w) r = sh.warp_key[w] > r ? sh.warp_key[w] : r;
  __syncthreads();
  return r;
}

// The CTA's sum of one value a thread, through one shared slot a warp (`slots`: the slots of the
// value's type in SharedState). Integer sums are exact.
template <typename T>
__device__ T block_sum_through(T v, T (&slots)[kWarps]) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) v += __shfl_xor_sync(kFullMask, v, delta);
  if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
  __syncthreads();
  T r = 0;
  for (int w = 0; w < kWarps; ++w) r += slots[w];
  __syncthreads();
  return r;
}
__device__ unsigned block_sum(unsigned v, SharedState& sh) { return block_sum_through(v, sh.warp_count); }
__device__ double block_sum(double v, SharedState& sh) { return block_sum_through(v, sh.warp_mass); }
__device__ FixedMass block_sum(FixedMass v, SharedState& sh) { return block_sum_through(v, sh.warp_fixed); }

__device__ float block_min(float v, SharedState& sh) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, delta));
  if (threadIdx.x % 32 == 0) sh.warp_min[threadIdx.x / 32] = v;
  __syncthreads();
  float r = sh.warp_min[0];
  for (int w = 1; w < kWarps; ++w) r = fminf(r, sh.warp_min[w]);
  __syncthreads();
  return r;
}

// The best (score, index) of the block by fs_candidate_better, with its y.
__device__ void block_best(float& score, int32_t& index, double& y, SharedState& sh) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    float const s = __shfl_xor_sync(kFullMask, score, delta);
    int32_t const i = __shfl_xor_sync(kFullMask, index, delta);
    double const yy = __shfl_xor_sync(kFullMask, y, delta);
    if (fs_candidate_better(s, i, score, index)) {
      score = s;
      index = i;
      y = yy;
    }
  }
  int const warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
    sh.warp_score[warp] = score;
    sh.warp_index[warp] = index;
    sh.warp_y[warp] = y;
  }
  __syncthreads();
  score = sh.warp_score[0];
  index = sh.warp_index[0];
  y = sh.warp_y[0];
  for (int w = 1; w < kWarps; ++w) {
    if (fs_candidate_better(sh.warp_score[w], sh.warp_index[w], score, index)) {
      score = sh.warp_score[w];
      index = sh.warp_index[w];
      y = sh.warp_y[w];
    }
  }
  __syncthreads();
}

// Sums every CTA's histogram of `bins` digits into total_count (and total_mass) of each.
// Ends with a cluster barrier, after which the CTAs may reset their own histograms.
__device__ void cluster_sum_histograms(cg::cluster_group& cluster, SharedState& sh, int bins, bool with_mass) {
  cluster.sync();  // every CTA's histogram is complete
  unsigned const ctas = cluster.num_blocks();
  if (bins == 4 * kThreads) {  // four neighbouring bins a thread, in 16-byte reads of each peer
    int const i = 4 * threadIdx.x;
    uint4 c = {0, 0, 0, 0};
    FixedMass m[4] = {0, 0, 0, 0};
    for (unsigned r = 0; r < ctas; ++r) {
      SharedState const* peer = cluster.map_shared_rank(&sh, r);
      uint4 const pc = *reinterpret_cast<uint4 const*>(peer->count + i);
      c.x += pc.x, c.y += pc.y, c.z += pc.z, c.w += pc.w;
      for (int part = 0; with_mass && part < kMassParts; ++part) {
        uint4 const pm = *reinterpret_cast<uint4 const*>(peer->mass_part[part] + i);
        int const shift = part * kMassPartBits;
        m[0] += static_cast<FixedMass>(pm.x) << shift, m[1] += static_cast<FixedMass>(pm.y) << shift;
        m[2] += static_cast<FixedMass>(pm.z) << shift, m[3] += static_cast<FixedMass>(pm.w) << shift;
      }
    }
    *reinterpret_cast<uint4*>(sh.total_count + i) = c;
    for (int j = 0; with_mass && j < 4; ++j) sh.total_mass[i + j] = m[j];
    cluster.sync();  // every CTA has read the others'
    return;
  }
  for (int i = threadIdx.x; i < bins; i += kThreads) {
    unsigned c = 0;
    FixedMass m = 0;
    for (unsigned r = 0; r < ctas; ++r) {
      SharedState const* peer = cluster.map_shared_rank(&sh, r);
      c += peer->count[i];
      for (int part = 0; with_mass && part < kMassParts; ++part) {
        m += static_cast<FixedMass>(peer->mass_part[part][i]) << (part * kMassPartBits);
      }
    }
    sh.total_count[i] = c;
    if (with_mass) sh.total_mass[i] = m;
  }
  cluster.sync();  // every CTA has read the others'
}

__device__ void reset_histogram(SharedState& sh, int bins, bool with_mass) {
  uint4 const zero = {0, 0, 0, 0};
  for (int i = 4 * threadIdx.x; i < bins; i += 4 * kThreads) {
    *reinterpret_cast<uint4*>(sh.count + i) = zero;
    for (int part = 0; with_mass && part < kMassParts; ++part) *reinterpret_cast<uint4*>(sh.mass_part[part] + i) = zero;
  }
  __syncthreads();
}

// Warp 0: the first digit, from the top, at which the running count of total_count reaches
// `target` (>= 1, and <= the histogram's total): sh.digit, its count and the count above it.
__device__ void choose_digit_by_count(SharedState& sh, int bins, unsigned target) {
  int const lane = threadIdx.x % 32;
  int const per_lane = bins / 32;  // lane l holds digits bins - 1 - l * per_lane downwards
  auto digit_at = [&](int j) { return bins - 1 - lane * per_lane - j; };
  unsigned local = 0;
  for (int j = 0; j < per_lane; ++j) local += sh.total_count[digit_at(j)];
  unsigned inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    unsigned const other = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  int const owner = __ffs(__ballot_sync(kFullMask, inclusive >= target)) - 1;
  if (lane == owner) {
    unsigned running = inclusive - local;
    for (int j = 0; j < per_lane; ++j) {
      unsigned const c = sh.total_count[digit_at(j)];
      if (running + c >= target) {
        sh.digit = digit_at(j);
        sh.digit_count = c;
        sh.count_above = running;
        break;
      }
      running += c;
    }
  }
}

// Warp 0: the first digit, from the top, at which (mass_above + running mass) / total reaches
// top_p: sh.digit (-1 where rounding keeps it from being reached), its count, and the mass
// above it.
// At level 0 (total == 0) the total is the histogram's, and goes to sh.mass_total.
__device__ void choose_digit_by_mass(SharedState& sh, int bins, FixedMass mass_above, FixedMass total,
                                     double top_p) {
  int const lane = threadIdx.x % 32;
  int const per_lane = bins / 32;
  auto digit_at = [&](int j) { return bins - 1 - lane * per_lane - j; };
  FixedMass local = 0;
  for (int j = 0; j < per_lane; ++j) local += sh.total_mass[digit_at(j)];
  FixedMass inclusive = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    FixedMass const other = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  FixedMass const exclusive = inclusive - local;
  if (total == 0) total = mass_above + __shfl_sync(kFullMask, inclusive, 31);
  if (lane == 0) sh.mass_total = total;
  auto reaches = [&](FixedMass mass) { return top_p_reached(mass, total, top_p); };
  unsigned const reached = __ballot_sync(kFullMask, reaches(mass_above + inclusive));
  if (lane == 0) sh.digit = -1;
  __syncwarp();
  // Without a lane that reaches it (rounding), the last lane's last non-empty digit closes the prefix.
  int const owner = reached ? __ffs(reached) - 1 : 31;
  if (lane == owner) {
    FixedMass running = mass_above + exclusive;
    for (int j = 0; j < per_lane; ++j) {
      int const digit = digit_at(j);
      FixedMass const m = sh.total_mass[digit];
      if (sh.total_count[digit] != 0) {
        sh.digit = digit;
        sh.digit_count = sh.total_count[digit];
        sh.mass_above = running;
        if (reaches(running + m)) break;
      }
      running += m;
    }
  }
}

struct Slice {
  int64_t begin, end;
};

// The k-th largest key of the row (k < the allowed tokens), as the smallest key of a digit
// prefix that holds exactly the first k: keys >= it are the top k. The fallback of
// cut_by_bins: one pass per digit level over the whole row.
__device__ PackedCandidate select_top_k(cg::cluster_group& cluster, SharedState& sh, RowInput const& in,
                                        Slice slice, unsigned k) {
  PackedCandidate prefix = 0, prefix_mask = 0;
  unsigned remaining = k;
  for (int level = 0; level < kLevels; ++level) {
    int const shift = level_shift(level), bins = 1 << level_bits(level);
    reset_histogram(sh, bins, false);
    for_each_element(in, slice.begin, slice.end, [&](int64_t, float, float, PackedCandidate key) {
      bool const active = key != 0 && (key & prefix_mask) == prefix;
      add_counts(sh.count, static_cast<unsigned>(key >> shift) & (bins - 1), active);
    });
    __syncthreads();
    cluster_sum_histograms(cluster, sh, bins, false);
    if (threadIdx.x < 32) choose_digit_by_count(sh, bins, remaining);
    __syncthreads();
    remaining -= sh.count_above;
    prefix |= static_cast<PackedCandidate>(sh.digit) << shift;
    prefix_mask |= static_cast<PackedCandidate>(bins - 1) << shift;
    bool const whole_digit = sh.digit_count == remaining;
    __syncthreads();
    if (whole_digit) break;
  }
  return prefix;
}

// The smallest key of the shortest prefix, among the keys >= floor, whose mass reaches top_p
// (0 < top_p < 1, y0 finite): keys >= it are top_p's survivors.
__device__ PackedCandidate select_top_p(cg::cluster_group& cluster, SharedState& sh, RowInput const& in, Slice slice,
                                        PackedCandidate floor, double y0, double top_p) {
  PackedCandidate prefix = 0, prefix_mask = 0;
  FixedMass mass_above = 0, total = 0;
  for (int level = 0; level < kLevels; ++level) {
    int const shift = level_shift(level), bins = 1 << level_bits(level);
    reset_histogram(sh, bins, true);
    for_each_element(in, slice.begin, slice.end, [&](int64_t, float, float y, PackedCandidate key) {
      bool const active = key != 0 && key >= floor && (key & prefix_mask) == prefix;
      FixedMass const m = active ? fixed_mass(y, y0) : 0ull;
      add_counts_and_masses(sh, static_cast<unsigned>(key >> shift) & (bins - 1), m, active);
    });
    __syncthreads();
    cluster_sum_histograms(cluster, sh, bins, true);
    if (threadIdx.x < 32) choose_digit_by_mass(sh, bins, mass_above, total, top_p);
    __syncthreads();
    total = sh.mass_total;
    int const digit = sh.digit;
    if (digit < 0) break;  // not reached within rounding: the whole prefix so far stays
    mass_above = sh.mass_above;
    prefix |= static_cast<PackedCandidate>(digit) << shift;
    prefix_mask |= static_cast<PackedCandidate>(bins - 1) << shift;
    bool const single = sh.digit_count == 1;
    __syncthreads();
    if (single) break;
  }
  return prefix;
}

// ---- The bin route: a row's cuts from one histogram over bins of y, then one sorted bin.
//
// Digits of the key put most of a flat row's tokens into a few digits at the first level (its
// exponent bits), whose histogram then contends on a few shared-memory words and takes several
// passes to resolve. Bins of y spread over the row's range instead: digit(y) is monotone in the
// key (fp32 subtraction and multiplication by a positive number are monotone), ties share a
// bin, so each bin holds a contiguous range of keys, and the cut lies in one bin whose keys are
// few. One pass histograms counts (and masses for top_p) by bin; the crossing bin's keys are
// gathered into the leader CTA, sorted, and the cut read off them exactly. A bin too full for
// the list (massive ties) sends the row to the digit descent above.
struct Binning {
  float y0, scale;
  // 2047 for the first token's bin down to 0; NaN and -inf y (and overflowing distances) in 0.
  __device__ __forceinline__ int digit(float y) const {
    float const d = (y0 - y) * scale;
    return d < static_cast<float>(kMaxBins - 1) ? kMaxBins - 1 - static_cast<int>(d) : 0;
  }
};

// The bins over [min_y, y0] of the row's finite y (y0 finite): 2040 bins wide, so the smallest
// finite y lands below bin 2047 - 2040 whatever the rounding.
__device__ __forceinline__ Binning row_binning(float y0, float min_y) {
  float const range = y0 - min_y;
  float scale = 2040.0f / range;
  if (!(range > 0.0f) || !(scale > 0.0f) || !(scale <= 1e30f)) scale = 1.0f;
  return {y0, scale};
}

// Counts (and fixed-point masses) of the allowed keys by bin: total_count (total_mass).
__device__ void histogram_by_bin(cg::cluster_group& cluster, SharedState& sh, RowInput const& in, Slice slice,
                                 Binning bins, bool with_mass, double y0) {
  reset_histogram(sh, kMaxBins, with_mass);
  for_each_element(in, slice.begin, slice.end, [&](int64_t, float, float y, PackedCandidate key) {
    if (key == 0) return;
    int const digit = bins.digit(y);
    atomicAdd(sh.count + digit, 1u);
    if (!with_mass) return;
    FixedMass const m = fixed_mass(y, y0);
#pragma unroll
    for (int part = 0; part < kMassParts; ++part) {
      unsigned const bits = static_cast<unsigned>(m >> (part * kMassPartBits)) & ((1u << kMassPartBits) - 1u);
      if (bits != 0) atomicAdd(sh.mass_part[part] + digit, bits);
    }
  });
  __syncthreads();
  cluster_sum_histograms(cluster, sh, kMaxBins, with_mass);
}

// Gathers the allowed keys of bin `digit` (or of every bin from `digit` up) into the leader's
// list (one remote atomic a warp step); returns their number, the same in every CTA (more than
// kListCapacity: not all kept).
__device__ unsigned gather_bins(cg::cluster_group& cluster, SharedState& sh, RowInput const& in, Slice slice,
                                Binning bins, int digit, bool and_above) {
  SharedState* lead = cluster.map_shared_rank(&sh, 0);
  if (cluster.block_rank() == 0 && threadIdx.x == 0) sh.list_size = 0;
  cluster.sync();  // the reset is visible, and the previous readers of the list are done
  int const lane = threadIdx.x % 32;
  for_each_element(in, slice.begin, slice.end, [&](int64_t, float, float y, PackedCandidate key) {
    int const d = bins.digit(y);
    bool const active = key != 0 && (d == digit || (and_above && d > digit));
    unsigned const lanes = __ballot_sync(kFullMask, active);
    if (lanes == 0) return;
    int const first = __ffs(lanes) - 1;
    unsigned base = 0;
    if (lane == first) base = atomicAdd(&lead->list_size, static_cast<unsigned>(__popc(lanes)));
    base = __shfl_sync(kFullMask, base, first);
    unsigned const position = base + __popc(lanes & ((1u << lane) - 1u));
    if (active && position < kListCapacity) lead->list[position] = key;
  });
  cluster.sync();  // every key is in
  return lead->list_size;
}

// Leader CTA: sorts list[0, n) descending (n <= kListCapacity) and, with masses, writes their
// inclusive prefix sums to list_mass (exact integers: the same sums as the histograms').
__device__ void sort_list(SharedState& sh, unsigned n, bool with_mass, double y0) {
  unsigned padded = 32;
  while (padded < n) padded <<= 1;
  for (unsigned i = n + threadIdx.x; i < padded; i += kThreads) sh.list[i] = 0;  // below every allowed key
  __syncthreads();
  for (unsigned k = 2; k <= padded; k <<= 1) {
    for (unsigned j = k >> 1; j > 0; j >>= 1) {
      for (unsigned i = threadIdx.x; i < padded; i += kThreads) {
        unsigned const partner = i ^ j;
        if (partner > i) {
          PackedCandidate const a = sh.list[i], b = sh.list[partner];
          if (((i & k) == 0) ? a < b : a > b) {
            sh.list[i] = b;
            sh.list[partner] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  if (!with_mass) return;
  constexpr int kChunk = kListCapacity / kThreads;
  unsigned const begin = threadIdx.x * kChunk;
  FixedMass running[kChunk];
  FixedMass sum = 0;
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    unsigned const i = begin + j;
    sum += i < n ? fixed_mass(from_order_bits(static_cast<uint32_t>(sh.list[i] >> 32)), y0) : 0ull;
    running[j] = sum;
  }
  int const lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  FixedMass inclusive = sum;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    FixedMass const other = __shfl_up_sync(kFullMask, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) sh.warp_fixed[warp] = inclusive;
  __syncthreads();
  FixedMass before = inclusive - sum;
  for (int w = 0; w < warp; ++w) before += sh.warp_fixed[w];
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if (begin + j < n) sh.list_mass[begin + j] = before + running[j];
  }
  __syncthreads();
}

// What cut_by_bins decided.
enum class BinRoute { kDone, kTopKFallback, kTopPFallback };

// The first index i < n of the sorted list whose inclusive mass (above + list_mass[i]) reaches
// top_p of `total`: the number of those before it that do not (leader CTA).
__device__ unsigned first_reaching(SharedState& sh, unsigned n, FixedMass above, FixedMass total, double top_p) {
  unsigned short_of = 0;
  for (unsigned i = threadIdx.x; i < n; i += kThreads) {
    short_of += !top_p_reached(above + sh.list_mass[i], total, top_p);  // top_p in (0, 1): no NaN
  }
  unsigned const index = block_sum(short_of, sh);
  return index < n ? index : n - 1;
}

// The top_k cut (need_k: k < the allowed tokens) and the top_p cut over the keys >= it
// (need_p: 0 < top_p < 1), y0 finite. kDone: `threshold` is the row's cut. kTopKFallback: no
// cut yet (the top_k bin is too full); kTopPFallback: `threshold` is the top_k cut (or 0), the
// top_p bin is too full.
//
// Where the keys from the crossing bin up fit the list (most rows: top_k's first keys, or the
// few top_p survivors of a peaked row), they are all gathered, the cuts are read off the
// sorted list from its first key, and `complete` gets their number: every survivor is in the
// leader's list, and the samples come from it without another pass over the row.
__device__ BinRoute cut_by_bins(cg::cluster_group& cluster, SharedState& sh, RowInput const& in, Slice slice,
                                Binning bins, double y0, bool need_k, unsigned k, bool need_p, double top_p,
                                PackedCandidate& threshold, unsigned& complete) {
  bool const leader = cluster.block_rank() == 0;
  SharedState const* lead = cluster.map_shared_rank(&sh, 0);
  complete = 0;
  // With top_k the masses come from the list, unless its bin is too full.
  histogram_by_bin(cluster, sh, in, slice, bins, need_p && !need_k, y0);
  int digit_k = -1;
  unsigned kept = 0;
  if (need_k) {
    if (threadIdx.x < 32) choose_digit_by_count(sh, kMaxBins, k);
    __syncthreads();
    digit_k = sh.digit;
    kept = k - sh.count_above;  // of the bin's keys, from its first
    bool const whole = sh.count_above + sh.digit_count <= kListCapacity;
    __syncthreads();
    unsigned const n = gather_bins(cluster, sh, in, slice, bins, digit_k, whole);
    if (n > kListCapacity) return BinRoute::kTopKFallback;
    if (whole) {  // the list holds the row's first n >= k keys
      if (leader) {
        sort_list(sh, n, need_p, y0);
        if (threadIdx.x == 0) sh.list_cut = sh.list[k - 1];
        if (need_p) {
          unsigned const index = first_reaching(sh, k, 0, sh.list_mass[k - 1], top_p);
          if (threadIdx.x == 0) sh.list_cut = sh.list[index];
        }
      }
      cluster.sync();
      threshold = lead->list_cut;
      complete = n;
      return BinRoute::kDone;
    }
    if (leader) {
      sort_list(sh, n, need_p, y0);
      if (threadIdx.x == 0) sh.list_cut = sh.list[kept - 1];
    }
    cluster.sync();
    threshold = lead->list_cut;
    if (!need_p) return BinRoute::kDone;
    histogram_by_bin(cluster, sh, in, slice, bins, true, y0);
  }
  if (!need_p) return BinRoute::kDone;
  // top_p's histogram: the keys >= the top_k cut (bins below digit_k out, `kept` keys of it).
  if (need_k) {
    FixedMass const kept_mass = lead->list_mass[kept - 1];
    for (int i = threadIdx.x; i <= digit_k; i += kThreads) {
      sh.total_count[i] = i == digit_k ? kept : 0u;
      sh.total_mass[i] = i == digit_k ? kept_mass : 0ull;
    }
    __syncthreads();
  }
  if (threadIdx.x < 32) choose_digit_by_mass(sh, kMaxBins, 0, 0, top_p);
  __syncthreads();
  int const digit_p = sh.digit;
  FixedMass const above = sh.mass_above, total = sh.mass_total;
  unsigned from_digit_p = 0;  // keys from digit_p up
  for (int i = threadIdx.x; i < kMaxBins; i += kThreads) from_digit_p += i >= digit_p ? sh.total_count[i] : 0u;
  from_digit_p = block_sum(from_digit_p, sh);
  if (digit_p < 0) return BinRoute::kDone;  // not reached within rounding: the top_k cut stays
  bool const whole = !need_k && from_digit_p <= kListCapacity;
  unsigned limit = kept;
  if (whole || digit_p != digit_k) {
    limit = gather_bins(cluster, sh, in, slice, bins, digit_p, whole);
    if (limit > kListCapacity) return BinRoute::kTopPFallback;
    if (leader) sort_list(sh, limit, true, y0);
  }
  if (leader) {
    unsigned const index = first_reaching(sh, limit, whole ? 0 : above, total, top_p);
    if (threadIdx.x == 0) sh.list_cut_p = sh.list[index];
  }
  cluster.sync();
  PackedCandidate const cut = lead->list_cut_p;
  threshold = cut > threshold ? cut : threshold;
  if (whole) complete = limit;
  return BinRoute::kDone;
}

// A candidate of the winner-first path: the best (score, index) by fs_candidate_better among a
// set of allowed tokens (index kNoCandidate: none with a score that is not NaN), and its y.
struct Candidate {
  float score = -INFINITY;
  int32_t index = kNoCandidate;
  double y = 0.0;

  __device__ __forceinline__ void offer(float s, int32_t i, double yy) {
    if (fs_candidate_better(s, i, score, index)) {
      score = s;
      index = i;
      y = yy;
    }
  }
  // Its truncation key (the same bits as RowInput::key's: y is an fp32 value).
  __device__ __forceinline__ PackedCandidate key() const {
    return pack_top_candidate(static_cast<float>(y), static_cast<uint32_t>(index));
  }
};

// The cluster's best of the CTAs' candidates in partials[slot] (after the cluster barrier that
// follows their writes); fs_candidate_better is a strict total order (distinct indices), so the
// result does not depend on the order.
__device__ Candidate cluster_best(cg::cluster_group& cluster, SharedState& sh, int slot) {
  Candidate best;
  for (unsigned r = 0; r < cluster.num_blocks(); ++r) {
    SharedState::Partials const& peer = cluster.map_shared_rank(&sh, r)->partials[slot];
    best.offer(peer.score, peer.index, peer.y);
  }
  return best;
}

// At most this many winner-first passes after pass 1 before a row goes to the cut (histograms).
constexpr int kWinnerFirstPasses = 3;

// One winner-first pass: over the allowed keys strictly ahead of `behind` in the truncation
// order, their fixed-point mass relative to y0 (`ahead`, the same integers as the histograms'
// and the sorted list's) and their best candidate (returned); with `with_total`, the mass of
// every allowed key (`total`). Every CTA gets the cluster's results (one cluster barrier).
__device__ Candidate winner_first_pass(cg::cluster_group& cluster, SharedState& sh, RowInput const& in, Slice slice,
                                       RowNoiseKey const& noise, PackedCandidate behind, double y0, bool with_total,
                                       unsigned& phase, FixedMass& ahead, FixedMass& total) {
  Candidate best;
  FixedMass local_ahead = 0, local_total = 0;
  for_each_element(in, slice.begin, slice.end, [&](int64_t, float x, float y, PackedCandidate key) {
    bool const is_ahead = key > behind;  // behind > 0: excluded keys (0) are never ahead
    if (key == 0 || !(is_ahead || with_total)) return;
    FixedMass const m = fixed_mass(y, y0);
    local_total += m;
    if (!is_ahead) return;
    local_ahead += m;
    uint32_t const index = top_candidate_index(key);
    best.offer(perturbed_score(in, noise, 0, index, x), static_cast<int32_t>(index), static_cast<double>(y));
  });
  block_best(best.score, best.index, best.y, sh);
  FixedMass const block_ahead = block_sum(local_ahead, sh);
  FixedMass const block_total = with_total ? block_sum(local_total, sh) : 0ull;
  int const slot = static_cast<int>(phase & 1u);
  if (threadIdx.x == 0) {
    SharedState::Partials& mine = sh.partials[slot];
    mine.score = best.score;
    mine.index = best.index;
    mine.y = best.y;
    mine.ahead = block_ahead;
    mine.total = block_total;
  }
  cluster.sync();
  best = cluster_best(cluster, sh, slot);
  ahead = 0;
  FixedMass sum = 0;
  for (unsigned r = 0; r < cluster.num_blocks(); ++r) {
    SharedState::Partials const& peer = cluster.map_shared_rank(&sh, r)->partials[slot];
    ahead += peer.ahead;
    sum += peer.total;
  }
  if (with_total) total = sum;
  ++phase;
  return best;
}

// The winner-first path of a row without top_k, one sample and no log-probabilities, y0 finite
// (docs/truncation_kernels.md, "the winner first"). Its survivors (top_p's prefix of the truncation order
// and min_p's test) are a prefix of the order, and its sample is their best candidate. `t` comes
// in as the best candidate of every allowed token (pass 1); invariant: the sample is t or lies
// strictly ahead of it. t is the sample when it survives: it is first, or it passes min_p and
// the mass strictly ahead of it does not reach top_p (the cut rule of choose_digit_by_mass /
// first_reaching: a key survives iff its predecessor's inclusive mass does not reach top_p,
// the same top_p_reached on the same integers). Else every survivor lies strictly ahead of t,
// and the best candidate strictly ahead (from the same pass) replaces it. Writes the sample and
// returns true, or returns false (nothing written) for the existing path to take the row: a
// min_p-alone row whose t fails min_p (the sample pass over its survivors is one pass), or a row
// still undecided after kWinnerFirstPasses passes.
__device__ bool winner_first_row(cg::cluster_group& cluster, SharedState& sh, LogitsSamplerParams const& p,
                                 int64_t row, RowInput const& in, Slice slice, RowNoiseKey const& noise,
                                 PackedCandidate first, double y0, bool need_p, double top_p, MinP const& min_p,
                                 Candidate t, unsigned& phase) {
  FixedMass total = 0;
  for (int pass = 0;; ++pass) {
    // No candidate: no score at or ahead of the last t that is not NaN, so no sample (token -1).
    bool decided = t.index == kNoCandidate;
    PackedCandidate const key_t = t.key();
    bool const keeps = key_t == first || min_p.keeps(static_cast<float>(t.y));
    decided = decided || key_t == first || (keeps && !need_p);
    if (!decided) {
      if (!need_p || pass == kWinnerFirstPasses) return false;
      FixedMass ahead = 0;
      Candidate const next = winner_first_pass(cluster, sh, in, slice, noise, key_t, y0, pass == 0, phase, ahead, total);
      if (!(keeps && !top_p_reached(ahead, total, top_p))) {
        t = next;
        continue;
      }
    }
    if (cluster.block_rank() == 0 && threadIdx.x == 0) {
      write_sample(p, row, 0, t.score, t.index, t.y, y0, true, 1.0);  // no log-probabilities on this path
    }
    return true;
  }
}

__device__ void sample_row(cg::cluster_group& cluster, SharedState& sh, LogitsSamplerParams const& p, int64_t row,
                           int64_t launch_rows, uint64_t batch_seed, uint64_t batch_offset, unsigned& phase) {
  if (p.streaming_rows && is_streaming_row(p, row)) return;  // streaming_rows.cu samples it
  unsigned const rank = cluster.block_rank(), ctas = cluster.num_blocks();
  bool const leader = rank == 0;
  float const inv_t = row_inv_t(p, row);
  if (inv_t != inv_t) {  // an invalid temperature in a device tensor: no candidate
    if (leader) {
      // A row whose mask allows nothing still reports empty_mask_token (as the fused op does).
      bool empty = false;
      if (p.allowed_mask) {
        uint32_t const* words = p.allowed_mask + row * p.mask_words;
        int any = 0;
        for (int64_t w = threadIdx.x; w < p.mask_words; w += kThreads) {
          int64_t const tail = p.vocab_size - 32 * w;  // bits past V do not count
          uint32_t const valid = tail >= 32 ? 0xFFFFFFFFu : (1u << tail) - 1u;
          any |= (__ldg(words + w) & valid) != 0;
        }
        empty = !__syncthreads_or(any);
      }
      write_row_without_sample(p, row, threadIdx.x, kThreads, empty ? p.empty_mask_token : -1,
                               empty ? -INFINITY : __uint_as_float(0x7fc00000u));
    }
    return;
  }
  RowInput const in = row_input(p, row, inv_t);
  Slice const slice{p.vocab_size * rank / ctas, p.vocab_size * (rank + 1) / ctas};
  int64_t const k = p.top_ks ? __ldg(p.top_ks + row) : p.top_k;
  bool const top_p_on = p.top_ps != nullptr || p.top_p < 1.0;
  double const top_p = row_top_p(p, row);
  MinP min_p = row_min_p(p, row);
  RowNoiseKey const noise = row_noise_key(p.noise, batch_seed, batch_offset, static_cast<uint32_t>(row), 0);
  // The winner-first path's rows (winner_first_row): top_p and / or min_p without top_k, one
  // sample, no log-probabilities; greedy, or top_p in a launch of few rows (kWinnerFirstMaxRows).
  // Pass 1 then also takes the best candidate of every allowed token. The same in every CTA of
  // the cluster.
  bool const winner_first = p.num_samples == 1 && k < 1 && p.token_logprobs == nullptr && (top_p_on || min_p.on) &&
                            (in.greedy || (top_p_on && launch_rows <= kWinnerFirstMaxRows));

  // 1. The first key, the allowed tokens and the smallest finite y (and the winner-first t).
  PackedCandidate local_max = 0;
  unsigned local_allowed = 0;
  float local_min = INFINITY;
  Candidate local_best;
  for_each_element(in, slice.begin, slice.end, [&](int64_t, float x, float y, PackedCandidate key) {
    local_max = key > local_max ? key : local_max;
    local_allowed += key != 0;
    if (key != 0 && isfinite(y)) local_min = fminf(local_min, y);
    if (winner_first && key != 0) {
      uint32_t const index = top_candidate_index(key);
      local_best.offer(perturbed_score(in, noise, 0, index, x), static_cast<int32_t>(index), static_cast<double>(y));
    }
  });
  PackedCandidate const block_first = block_max(local_max, sh);
  unsigned const block_allowed = block_sum(local_allowed, sh);
  float const block_min_y = block_min(local_min, sh);
  if (winner_first) block_best(local_best.score, local_best.index, local_best.y, sh);
  int const slot = static_cast<int>(phase & 1u);
  if (threadIdx.x == 0) {
    SharedState::Partials& mine = sh.partials[slot];
    mine.max_key = block_first;
    mine.allowed = block_allowed;
    mine.min_y = block_min_y;
    mine.score = local_best.score;
    mine.index = local_best.index;
    mine.y = local_best.y;
  }
  cluster.sync();
  PackedCandidate first = 0;
  int64_t allowed = 0;
  float min_y = INFINITY;
  for (unsigned r = 0; r < ctas; ++r) {
    SharedState::Partials const& peer = cluster.map_shared_rank(&sh, r)->partials[slot];
    first = peer.max_key > first ? peer.max_key : first;
    allowed += peer.allowed;
    min_y = fminf(min_y, peer.min_y);
  }
  Candidate const t = winner_first ? cluster_best(cluster, sh, slot) : Candidate{};
  ++phase;  // this slot is written again two steps on, after a barrier every peer passes once it has read it
  if (allowed == 0) {
    if (leader) write_row_without_sample(p, row, threadIdx.x, kThreads, p.allowed_mask ? p.empty_mask_token : -1, -INFINITY);
    cluster.sync();
    return;
  }
  float const y0f = from_order_bits(static_cast<uint32_t>(first >> 32));
  double const y0 = static_cast<double>(y0f);
  bool const y0_finite = isfinite(y0f);
  min_p.set_first(y0, y0_finite);

  // 2.-3. The cut: top_k, then top_p over its survivors. A top_p of NaN or <= 0, or a row
  // without a finite y0 (NaN probabilities, as in truncation.py's float64 arithmetic), keeps
  // only the first token.
  bool const first_only = top_p_on && !(top_p >= 1.0) && !(top_p > 0.0 && y0_finite);
  bool const need_k = !first_only && k >= 1 && k < allowed;
  bool const need_p = !first_only && top_p_on && top_p > 0.0 && top_p < 1.0;  // y0 finite here
  // The winner first where it applies (a row that keeps only its first token, or without a finite
  // y0, takes the existing path); the existing path takes the rows it leaves undecided.
  if (winner_first && y0_finite && !first_only &&
      winner_first_row(cluster, sh, p, row, in, slice, noise, first, y0, need_p, top_p, min_p, t, phase)) {
    return;
  }
  PackedCandidate threshold = first_only ? first : 0;
  BinRoute route = need_k ? BinRoute::kTopKFallback : BinRoute::kTopPFallback;
  unsigned complete = 0;  // > 0: every survivor is among the leader's first `complete` list keys
  if (y0_finite && (need_k || need_p)) {
    route = cut_by_bins(cluster, sh, in, slice, row_binning(y0f, min_y), y0, need_k, static_cast<unsigned>(k), need_p,
                        top_p, threshold, complete);
  }
  if (route == BinRoute::kTopKFallback && need_k) {
    threshold = select_top_k(cluster, sh, in, slice, static_cast<unsigned>(k));
  }
  if (route != BinRoute::kDone && need_p) {
    PackedCandidate const cut = select_top_p(cluster, sh, in, slice, threshold, y0, top_p);
    threshold = cut > threshold ? cut : threshold;
  }

  // 4. The samples, and the survivors' mass for the log-probabilities.
  // At most top_k survivors, few against the row: drawing their noise where they lie is cheaper
  // than queueing every survivor; a large top_k queues them (docs/truncation.md).
  bool const few_survivors = need_k && k <= p.vocab_size / 1024;
  double kept_mass = 0.0;
  for (int s = 0; s < p.num_samples; ++s) {
    float best_score = -INFINITY;
    int32_t best_index = kNoCandidate;
    double best_y = 0.0;
    double local_mass = 0.0;
    bool const with_mass = s == 0 && p.token_logprobs != nullptr;
    auto draw = [&](uint32_t index, float x, float y) {
      float const score = perturbed_score(in, noise, static_cast<uint32_t>(s), index, x);
      if (fs_candidate_better(score, static_cast<int32_t>(index), best_score, best_index)) {
        best_score = score;
        best_index = static_cast<int32_t>(index);
        best_y = static_cast<double>(y);
      }
    };
    auto add_mass = [&](float y) {
      // A NaN y makes the log-sum-exp NaN, as in the fused op (top_p gives it no mass, above).
      if (with_mass) local_mass += y != y ? static_cast<double>(NAN) : y0_finite ? double{mass_of(y, y0)} : 0.0;
    };
    if (complete > 0) {
      // Every survivor is in the leader's sorted list: the leader draws from it, and the other
      // CTAs go on to their next row (the list is written again only after the next row's
      // barriers, which wait for the leader).
      if (!leader) break;
      for (unsigned i = threadIdx.x; i < complete; i += kThreads) {
        PackedCandidate const key = sh.list[i];
        if (key < threshold) continue;
        uint32_t const index = top_candidate_index(key);
        float x, y;
        in.token(index, x, y);
        if (key != first && !min_p.keeps(y)) continue;
        draw(index, x, y);
        add_mass(y);
      }
      block_best(best_score, best_index, best_y, sh);
      double const mass = with_mass ? block_sum(local_mass, sh) : 0.0;
      if (with_mass) kept_mass = mass;
      if (threadIdx.x == 0) write_sample(p, row, s, best_score, best_index, best_y, y0, y0_finite, kept_mass);
      continue;
    }
    if (few_survivors) {
      for_each_element(in, slice.begin, slice.end, [&](int64_t, float x, float y, PackedCandidate key) {
        if (key == 0 || key < threshold || (key != first && !min_p.keeps(y))) return;
        draw(top_candidate_index(key), x, y);
        add_mass(y);
      });
    } else {
      // The survivors queue up in their warp's buffer, and the noise (Philox and two logarithms)
      // is drawn for 32 of them at a time, one a lane: drawn where they lie, it would cost a
      // whole warp step for every step that holds any survivor.
      int const lane = threadIdx.x % 32;
      QueuedSurvivor* const queue = sh.queue[threadIdx.x / 32];
      int head = 0, queued = 0;  // warp-uniform
      for_each_element(in, slice.begin, slice.end, [&](int64_t, float x, float y, PackedCandidate key) {
        bool const survivor = key != 0 && key >= threshold && (key == first || min_p.keeps(y));
        unsigned const lanes = __ballot_sync(kFullMask, survivor);
        if (lanes == 0) return;
        if (survivor) {
          queue[(head + queued + __popc(lanes & ((1u << lane) - 1u))) % kQueue] = {top_candidate_index(key), x, y};
          add_mass(y);
        }
        queued += __popc(lanes);
        __syncwarp();
        if (queued >= 32) {
          QueuedSurvivor const c = queue[(head + lane) % kQueue];
          draw(c.index, c.x, c.y);
          head = (head + 32) % kQueue;
          queued -= 32;
          __syncwarp();
        }
      });
      if (lane < queued) {
        QueuedSurvivor const c = queue[(head + lane) % kQueue];
        draw(c.index, c.x, c.y);
      }
      __syncwarp();
    }
    block_best(best_score, best_index, best_y, sh);
    double const block_mass = with_mass ? block_sum(local_mass, sh) : 0.0;
    if (threadIdx.x == 0) {
      sh.best_score = best_score;
      sh.best_index = best_index;
      sh.best_y = best_y;
      sh.kept_mass = block_mass;
    }
    cluster.sync();
    if (leader && threadIdx.x == 0) {
      double mass = 0.0;
      for (unsigned r = 0; r < ctas; ++r) {
        SharedState const* peer = cluster.map_shared_rank(&sh, r);
        if (fs_candidate_better(peer->best_score, peer->best_index, best_score, best_index)) {
          best_score = peer->best_score;
          best_index = peer->best_index;
          best_y = peer->best_y;
        }
        mass += peer->kept_mass;
      }
      if (with_mass) kept_mass = mass;
      write_sample(p, row, s, best_score, best_index, best_y, y0, y0_finite, kept_mass);
    }
    cluster.sync();  // the leader has read every peer's partials
  }
}

__global__ void __launch_bounds__(kThreads, 1) sample_from_logits_kernel(LogitsSamplerParams const p) {
  extern __shared__ __align__(16) unsigned char smem[];
  SharedState& sh = *reinterpret_cast<SharedState*>(smem);
  cg::cluster_group cluster = cg::this_cluster();
  int64_t const ctas = cluster.num_blocks();
  uint64_t batch_seed = 0, batch_offset = 0;
  resolve_noise_source(p.noise, batch_seed, batch_offset);
  int64_t const rows = p.rows ? static_cast<int64_t>(*p.rows) : p.batch_size;
  if (rows < p.min_rows || rows > p.max_rows) return;  // the other launch's (same for every CTA)
  unsigned phase = 0;  // steps that used SharedState::partials (the same count in every CTA of the cluster)
  for (int64_t i = blockIdx.x / ctas; i < rows; i += gridDim.x / ctas) {
    sample_row(cluster, sh, p, p.rows ? static_cast<int64_t>(p.rows[1 + i]) : i, rows, batch_seed, batch_offset, phase);
  }
  cluster.sync();  // no CTA leaves while a peer may still read its shared memory
}

}  // namespace

namespace {

cudaLaunchConfig_t launch_config(int cluster_size, int clusters, size_t smem, cudaStream_t stream,
                                 cudaLaunchAttribute* attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(clusters * cluster_size));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = static_cast<unsigned>(cluster_size);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// Clusters of 2, 4 and 8 CTAs the current device runs at once, asked once per device.
cudaError_t resident_clusters(size_t smem, int resident[3]) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices][3] = {};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  for (int i = 0; i < 3; ++i) {
    int n = device < kMaxDevices ? cache[device][i].load(std::memory_order_relaxed) : 0;
    if (n == 0) {
      cudaLaunchAttribute attribute;
      cudaLaunchConfig_t const config = launch_config(2 << i, 2 << i, smem, nullptr, &attribute);
      err = cudaOccupancyMaxActiveClusters(&n, sample_from_logits_kernel, &config);
      if (err != cudaSuccess) return err;
      if (device < kMaxDevices) cache[device][i].store(n, std::memory_order_relaxed);
    }
    resident[i] = n;
  }
  return cudaSuccess;
}

}  // namespace

// Which rows the streaming kernels take (is_streaming_row): with a row list (the fused
// truncation's leftovers) those of streamed_first_y, if given; else none where a host top_k /
// top_p or any min_p cuts the rows, and every row where neither top_k nor top_p is given per row
// (the cut path's kernel is then not launched).
struct StreamingPlan {
  bool launch;     // the streaming kernels run
  bool every_row;  // ... and take every row
};

static StreamingPlan streaming_plan(LogitsSamplerParams const& p) {
  bool const cut = (p.top_ks == nullptr && p.top_k >= 1 && p.top_k < p.vocab_size) ||
                   (p.top_ps == nullptr && p.top_p < 1.0) || p.min_ps != nullptr || p.min_p > 0.0;
  if (p.rows != nullptr) return {p.streamed_first_y != nullptr, false};
  if (cut) return {false, false};
  return {true, p.top_ks == nullptr && p.top_ps == nullptr};
}

size_t sample_from_logits_workspace_bytes(LogitsSamplerParams const& params, int sm_count) {
  return streaming_plan(params).launch ? streaming_rows_workspace_bytes(params, sm_count) : 0;
}

cudaError_t launch_sample_from_logits(LogitsSamplerParams const& in_params, void* workspace, int sm_count,
                                      cudaStream_t stream) {
  if (in_params.batch_size == 0) return cudaSuccess;
  if (in_params.num_samples < 1 || in_params.vocab_size < 1 || in_params.vocab_size > kLogitsSamplerMaxVocab) {
    return cudaErrorInvalidValue;
  }
  LogitsSamplerParams params = in_params;
  StreamingPlan const plan = streaming_plan(params);
  params.streaming_rows = plan.launch;
  if (plan.launch) {
    if (workspace == nullptr) return cudaErrorInvalidValue;
    cudaError_t const err = launch_streaming_rows(params, workspace, sm_count, stream);
    if (err != cudaSuccess || plan.every_row) return err;
  }
  size_t const smem = sizeof(SharedState);
  cudaError_t err = cudaFuncSetAttribute(sample_from_logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  int resident[3];
  err = resident_clusters(smem, resident);
  if (err != cudaSuccess) return err;
  LogitsSamplerGrid const grid = logits_sampler_grid(params.batch_size, sm_count, resident);
  cudaLaunchAttribute attribute;
  LogitsSamplerGrid const few = logits_sampler_grid(1, sm_count, resident);  // a row's widest cluster
  int const few_rows = std::min<int>(resident_clusters_of_size(few.cluster_size, resident),
                                     static_cast<int>(params.batch_size));
  if (params.rows != nullptr && grid.cluster_size < few.cluster_size && few_rows >= 1) {
    // A row list of unknown length: up to few_rows of them one per wide cluster, more on the
    // batch's grid (each launch returns at once when the count is the other's).
    LogitsSamplerParams narrow = params;
    narrow.max_rows = few_rows;
    cudaLaunchConfig_t const config = launch_config(few.cluster_size, few_rows, smem, stream, &attribute);
    err = cudaLaunchKernelEx(&config, sample_from_logits_kernel, narrow);
    // A batch whose every row fits the wide clusters lists no more (a launch saved: the fused
    // truncation's list is usually empty).
    if (err != cudaSuccess || few_rows >= params.batch_size) return err;
    LogitsSamplerParams wide = params;
    wide.min_rows = few_rows + 1;
    cudaLaunchConfig_t const wide_config = launch_config(grid.cluster_size, grid.clusters, smem, stream, &attribute);
    return cudaLaunchKernelEx(&wide_config, sample_from_logits_kernel, wide);
  }
  cudaLaunchConfig_t const config = launch_config(grid.cluster_size, grid.clusters, smem, stream, &attribute);
  return cudaLaunchKernelEx(&config, sample_from_logits_kernel, params);
}

}  // namespace flashsampling
