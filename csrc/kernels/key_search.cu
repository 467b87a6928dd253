// The truncation cut's radix search over order keys (flashsampling/key_search.h): the rows' first
// keys, one round (the choice from the previous round's summed histogram, then this round's
// histogram) and the survivors' bitmask. A grid of (chunks of the vocabulary, rows); a CTA reads
// its chunk of one row's y once, 16-byte loads where the rows allow them, and works on a token's
// key as two 32-bit words (the rank of its y and its id): most rounds test only the rank. A
// round's histogram is a CTA's 32-bit shared-memory sums; a thread first adds up its keys of up
// to two digits in registers (a flat row's first round puts most of a thread's 16 keys in a few
// bins, where one atomic a key contends), the others one atomic each. Warp reductions over the
// lanes of one digit were slower: groups of lanes with different digits reduce one at a time
// (benchmarks/probes/results/ab_key_search_kernels_*).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cmath>
#include <cstdint>

#include "flashsampling/key_search.h"
#include "logits_rows.cuh"

namespace flashsampling {
namespace {

constexpr int kThreads = kKeySearchBins;  // a thread a bin in the choice
constexpr int kVector = 4;                // a thread's consecutive tokens in one load
constexpr int kLoads = 4;                 // a thread's loads of a step
constexpr int kTokensPerThread = kVector * kLoads;
constexpr int64_t kStepTokens = int64_t{kThreads} * kTokensPerThread;  // a CTA's step: 4096 tokens
constexpr int kMaxStepsPerCta = 4;
constexpr int kIdBits = 31;           // an order key: rank << 31 | id
constexpr int kSlots = 2;  // the digits a thread sums in registers over a step
constexpr unsigned long long kNoKey = 0x7FFFFFFFFFFFFFFFull;
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

// The rank of y in the truncation order as the key's upper 32 bits (truncation.py:
// truncation_rank + 2^31): y descending, -0 as +0, an allowed NaN after -inf.
__device__ __forceinline__ uint32_t rank_bits(float y) {
  if (y != y) return 0xFF800001u;
  uint32_t const bits = __float_as_uint(-y);
  return (bits & 0x80000000u) ? 0x80000000u - (bits & 0x7FFFFFFFu) : (bits | 0x80000000u);
}

__device__ __forceinline__ unsigned long long key_of(uint32_t rank, uint32_t id) {
  return (static_cast<unsigned long long>(rank) << kIdBits) | id;
}

// The top_p mass of a token whose row's first y is y0 (0 where y0 is not finite).
__device__ __forceinline__ unsigned long long key_mass(float y, float y0) {
  return isfinite(y0) ? fixed_mass(y, static_cast<double>(y0)) : 0ull;
}

// min_p's test of a token (truncation.py: keep_prefix): logits_rows.cuh's MinP, or the row's
// first key.
struct MinPKeys {
  MinP test;
  uint32_t first_rank, first_id;

  __device__ __forceinline__ bool keeps(float y, uint32_t rank, uint32_t id) const {
    return test.keeps(y) || (rank == first_rank && id == first_id);
  }
};

__device__ __forceinline__ MinPKeys min_p_keys(const double* min_ps, const int64_t* first, float y0, int64_t row) {
  MinPKeys m;
  m.test = min_p_test(min_ps != nullptr, min_ps ? min_ps[row] : 0.0);
  m.test.set_first(static_cast<double>(y0), isfinite(y0));
  unsigned long long const f = first ? static_cast<unsigned long long>(first[row]) : kNoKey;
  m.first_rank = static_cast<uint32_t>(f >> kIdBits);
  m.first_id = static_cast<uint32_t>(f & ((1u << kIdBits) - 1));
  return m;
}

struct RowPointers {
  const float* y;
  const uint32_t* mask;
  float scale;  // y = fl32(stored * scale): 1 where the stored values are y
};

__device__ __forceinline__ RowPointers row_pointers(KeySearchRows const& r, int64_t row) {
  return {r.y + row * r.row_stride, r.allowed_mask ? r.allowed_mask + row * r.mask_words : nullptr,
          r.row_scales ? r.row_scales[row] : 1.0f};
}

// A thread's tokens of one step: load l covers tokens first + l * kThreads * kVector +
// threadIdx.x * kVector + j, j < kVector (a warp's load: 128 consecutive tokens), every load
// issued before any is used; bit l * kVector + j of `allowed` is set where that token lies in the
// row and is allowed.
struct Tile {
  float y[kTokensPerThread];
  unsigned allowed;

  __device__ __forceinline__ static int64_t token(int64_t first, int i) {
    return first + (i / kVector) * (kThreads * kVector) + threadIdx.x * kVector + i % kVector;
  }
};

__device__ __forceinline__ Tile load_tile(KeySearchRows const& r, RowPointers const& p, int64_t first, bool vector) {
  Tile t;
  t.allowed = 0;
#pragma unroll
  for (int l = 0; l < kLoads; ++l) {
    int64_t const v = Tile::token(first, l * kVector);
    unsigned inside;
    if (vector && v + kVector <= r.vocab_size) {
      float4 const q = __ldg(reinterpret_cast<const float4*>(p.y + v));
      t.y[l * kVector + 0] = fs_mul(q.x, p.scale);
      t.y[l * kVector + 1] = fs_mul(q.y, p.scale);
      t.y[l * kVector + 2] = fs_mul(q.z, p.scale);
      t.y[l * kVector + 3] = fs_mul(q.w, p.scale);
      inside = 0xFu;
    } else {
      inside = 0;
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        bool const in = v + j < r.vocab_size;
        t.y[l * kVector + j] = in ? fs_mul(__ldg(p.y + v + j), p.scale) : 0.0f;
        inside |= static_cast<unsigned>(in) << j;
      }
    }
    // v is a multiple of 4: its 4 tokens share a mask word
    if (p.mask != nullptr && inside != 0) inside &= __ldg(p.mask + (v >> 5)) >> (v & 31);
    t.allowed |= (inside & 0xFu) << (l * kVector);
  }
  return t;
}

// A CTA's tokens: `steps` steps of kStepTokens from its chunk's first.
struct Chunk {
  int64_t first;
  int steps;
};

__device__ __forceinline__ Chunk cta_chunk(int steps) {
  return {int64_t{blockIdx.x} * steps * kStepTokens, steps};
}

__global__ void __launch_bounds__(kThreads) first_keys_kernel(KeySearchRows const r, int64_t* first, bool vector,
                                                              int steps) {
  int64_t const row = blockIdx.y;
  RowPointers const p = row_pointers(r, row);
  Chunk const c = cta_chunk(steps);
  uint32_t const id0 = static_cast<uint32_t>(r.vocab_start);
  unsigned long long best = kNoKey;
  for (int s = 0; s < c.steps; ++s) {
    int64_t const step_first = c.first + s * kStepTokens;
    Tile const t = load_tile(r, p, step_first, vector);
#pragma unroll
    for (int i = 0; i < kTokensPerThread; ++i) {
      unsigned long long const key = key_of(rank_bits(t.y[i]), id0 + static_cast<uint32_t>(Tile::token(step_first, i)));
      if (((t.allowed >> i) & 1u) && key < best) best = key;
    }
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
  long long prefix, need_or_ahead, total, found, complete;
};

__device__ SearchState choose_bin(KeySearchRound const& q, int64_t row) {
  __shared__ SearchState shared;
  __shared__ int last_bin;
  using Scan = cub::BlockScan<long long, kThreads>;
  __shared__ typename Scan::TempStorage scan_temp;
  bool const by_mass = q.top_ps != nullptr;
  SearchState s;
  if (q.state_in == nullptr) {
    s = {0, by_mass ? 0 : static_cast<long long>(q.top_ks[row]), 0, kKeySearchUnknown, 0};
  } else {
    int64_t const* in = q.state_in + row * kKeySearchStateWords;
    s = {in[kStatePrefix], in[kStateNeedOrAhead], in[kStateTotal], in[kStateFound], in[kStateComplete]};
  }
  if (q.hist_in == nullptr || s.complete) return s;
  int const d = threadIdx.x;
  int64_t const* hist = q.hist_in + row * kKeySearchPlanes * kKeySearchBins;
  long long const count = hist[d];
  long long upto_count;
  Scan(scan_temp).InclusiveSum(count, upto_count);
  __syncthreads();
  int bin;
  long long found, total = 0;
  if (!by_mass) {
    // the first bin whose keys up to it reach `need`; what lies in earlier bins is ahead
    int const below = __syncthreads_count(upto_count < s.need_or_ahead);
    bin = below < kKeySearchBins ? below : kKeySearchBins - 1;
    if (d == kKeySearchBins - 1) {
      shared.found = s.found == kKeySearchUnknown ? (upto_count >= s.need_or_ahead ? 1 : 0) : s.found;
    }
    if (d == bin) shared.need_or_ahead = s.need_or_ahead - (upto_count - count);
  } else {
    long long const mass = hist[kKeySearchBins + d];
    long long upto_mass;
    Scan(scan_temp).InclusiveSum(mass, upto_mass);
    if (d == 0) last_bin = 0;
    if (d == kKeySearchBins - 1) shared.total = s.found == kKeySearchUnknown ? upto_mass : s.total;
    __syncthreads();
    total = shared.total;
    long long const before = s.need_or_ahead + (upto_mass - mass);  // the mass ahead of the bin's first key
    // the negation of top_p_reached's test (logits_rows.cuh) on the same integers, false for a NaN
    // top_p and a total of 0 (a row whose first y is not finite: its first token alone survives)
    bool const survives = count > 0 && static_cast<double>(before) / static_cast<double>(total) < q.top_ps[row];
    if (survives) atomicMax(&last_bin, d + 1);
    __syncthreads();
    int const last = last_bin;
    bin = last > 0 ? last - 1 : 0;
    if (d == bin) shared.need_or_ahead = before;
    if (d == 0) shared.found = s.found == kKeySearchUnknown ? (last > 0 ? 1 : 0) : s.found;
  }
  if (d == bin) {
    shared.complete = count == 1;
    shared.prefix = count == 1 ? hist[2 * kKeySearchBins + d] : (s.prefix << kKeySearchDigitBits) | bin;
  }
  __syncthreads();
  found = shared.found;
  return {shared.prefix, shared.need_or_ahead, total, found, shared.complete};
}

// The keys of a round's range (the bits above the digit equal the prefix) that are at most the
// limit, tested on (rank, id): above the id's bits the prefix is a prefix of the rank alone.
struct KeyRange {
  bool all;  // the first round: no prefix yet
  int rank_shift, id_shift;
  uint32_t rank_prefix, id_prefix;
  uint32_t limit_rank, limit_id;

  __device__ __forceinline__ bool contains(uint32_t rank, uint32_t id) const {
    bool const below_limit = rank < limit_rank || (rank == limit_rank && id <= limit_id);
    return below_limit && (all || ((rank >> rank_shift) == rank_prefix && (id >> id_shift) == id_prefix));
  }
};

__device__ __forceinline__ KeyRange key_range(int shift, long long prefix, unsigned long long limit) {
  int const above = shift + kKeySearchDigitBits;
  KeyRange k;
  k.all = above >= 63;
  if (above >= kIdBits) {
    k.rank_shift = above - kIdBits;
    k.rank_prefix = static_cast<uint32_t>(prefix);
    k.id_shift = kIdBits;  // ids lie below 2^31
    k.id_prefix = 0;
  } else {
    k.rank_shift = 0;
    k.rank_prefix = static_cast<uint32_t>(prefix >> (kIdBits - above));
    k.id_shift = above;
    k.id_prefix = static_cast<uint32_t>(prefix & ((1ll << (kIdBits - above)) - 1));
  }
  k.limit_rank = static_cast<uint32_t>(limit >> kIdBits);
  k.limit_id = static_cast<uint32_t>(limit & ((1u << kIdBits) - 1));
  return k;
}

// The key's 8 bits at `shift`.
__device__ __forceinline__ int key_digit(uint32_t rank, uint32_t id, int shift) {
  uint32_t const bits = shift >= kIdBits ? rank >> (shift - kIdBits) : (rank << (kIdBits - shift)) | (id >> shift);
  return static_cast<int>(bits & (kKeySearchBins - 1));
}

// A CTA's sums of masses (each below 2^42, at most 2^14 tokens), three 14-bit parts a bin.
__device__ __forceinline__ void add_mass(uint32_t (&parts)[3][kKeySearchBins], int digit, unsigned long long mass) {
  if (mass == 0) return;
  atomicAdd(&parts[0][digit], static_cast<uint32_t>(mass & 0x3FFFu));
  atomicAdd(&parts[1][digit], static_cast<uint32_t>((mass >> 14) & 0x3FFFu));
  atomicAdd(&parts[2][digit], static_cast<uint32_t>(mass >> 28));
}

// A CTA's sums of `count` keys of one digit (rank and id: one key's, a sum only where the bin
// ends up holding one key).
__device__ __forceinline__ void add_key(uint32_t* counts, uint32_t* rank_sums, uint32_t* id_sums,
                                        uint32_t (&mass_parts)[3][kKeySearchBins], int digit, uint32_t count,
                                        uint32_t rank, uint32_t id, unsigned long long mass) {
  atomicAdd(counts + digit, count);
  atomicAdd(rank_sums + digit, rank);
  atomicAdd(id_sums + digit, id);
  add_mass(mass_parts, digit, mass);
}

__global__ void __launch_bounds__(kThreads) search_round_kernel(KeySearchRound const q, bool vector, int steps) {
  int64_t const row = blockIdx.y;
  SearchState const s = choose_bin(q, row);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    int64_t* out = q.state_out + row * kKeySearchStateWords;
    out[kStatePrefix] = s.prefix;
    out[kStateNeedOrAhead] = s.need_or_ahead;
    out[kStateTotal] = s.total;
    out[kStateFound] = s.found;
    out[kStateComplete] = s.complete;
  }
  if (q.shift < 0 || s.complete) return;

  // 32-bit sums a bin (a CTA's at most 2^14 tokens): counts; masses (below 2^42) in three 14-bit
  // parts; and the ranks and ids, whose sums are a key where the bin holds one.
  __shared__ uint32_t counts[kKeySearchBins], rank_sums[kKeySearchBins], id_sums[kKeySearchBins];
  __shared__ uint32_t mass_parts[3][kKeySearchBins];
  int const d = threadIdx.x;
  counts[d] = rank_sums[d] = id_sums[d] = 0;
  mass_parts[0][d] = mass_parts[1][d] = mass_parts[2][d] = 0;
  __syncthreads();
  KeySearchRows const& r = q.rows;
  RowPointers const p = row_pointers(r, row);
  bool const by_mass = q.top_ps != nullptr;
  KeyRange const range = key_range(q.shift, s.prefix, q.limit ? static_cast<unsigned long long>(q.limit[row]) : kNoKey);
  float const y0 = by_mass ? q.y0[row] : 0.0f;
  MinPKeys const min_p = min_p_keys(q.min_ps, q.first, y0, row);
  uint32_t const id0 = static_cast<uint32_t>(r.vocab_start);
  // A thread's keys of one digit add up in registers (kSlots digits a step), the others one
  // atomic each.
  Chunk const c = cta_chunk(steps);
  for (int step = 0; step < c.steps; ++step) {
    int64_t const step_first = c.first + step * kStepTokens;
    Tile const t = load_tile(r, p, step_first, vector);
    int slot_digit[kSlots];
    uint32_t slot_count[kSlots], slot_rank[kSlots], slot_id[kSlots];
    unsigned long long slot_mass[kSlots];
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      slot_digit[j] = -1;
      slot_count[j] = slot_rank[j] = slot_id[j] = 0;
      slot_mass[j] = 0;
    }
#pragma unroll
    for (int i = 0; i < kTokensPerThread; ++i) {
      float const y = t.y[i];
      uint32_t const rank = rank_bits(y);
      uint32_t const id = id0 + static_cast<uint32_t>(Tile::token(step_first, i));
      if (!((t.allowed >> i) & 1u) || !range.contains(rank, id)) continue;
      int const digit = key_digit(rank, id, q.shift);
      bool const keeps_mass = by_mass && (q.min_ps == nullptr || min_p.keeps(y, rank, id));
      unsigned long long const mass = keeps_mass ? key_mass(y, y0) : 0ull;
      bool placed = false;
#pragma unroll
      for (int j = 0; j < kSlots; ++j) {
        if (!placed && (slot_digit[j] == digit || slot_digit[j] < 0)) {
          slot_digit[j] = digit;
          ++slot_count[j];
          slot_mass[j] += mass;
          slot_rank[j] = rank;  // the key where the slot holds one
          slot_id[j] = id;
          placed = true;
        }
      }
      if (!placed) add_key(counts, rank_sums, id_sums, mass_parts, digit, 1, rank, id, mass);
    }
#pragma unroll
    for (int j = 0; j < kSlots; ++j) {
      if (slot_digit[j] >= 0) {
        add_key(counts, rank_sums, id_sums, mass_parts, slot_digit[j], slot_count[j], slot_rank[j], slot_id[j], slot_mass[j]);
      }
    }
  }
  __syncthreads();
  if (counts[d] == 0) return;
  unsigned long long* hist = q.hist_out + row * kKeySearchPlanes * kKeySearchBins;
  atomicAdd(hist + d, static_cast<unsigned long long>(counts[d]));
  unsigned long long const mass = mass_parts[0][d] + (static_cast<unsigned long long>(mass_parts[1][d]) << 14) +
                                  (static_cast<unsigned long long>(mass_parts[2][d]) << 28);
  if (mass != 0) atomicAdd(hist + kKeySearchBins + d, mass);
  atomicAdd(hist + 2 * kKeySearchBins + d, key_of(rank_sums[d], id_sums[d]));
}

// A warp's load covers 128 consecutive tokens: four mask words, each the nibbles of 8 lanes.
__global__ void __launch_bounds__(kThreads) cut_mask_kernel(KeyCutMask const c, bool vector, int steps) {
  int64_t const row = blockIdx.y;
  KeySearchRows const& r = c.rows;
  RowPointers const p = row_pointers(r, row);
  unsigned long long const cut = static_cast<unsigned long long>(c.cut[row]);
  uint32_t const cut_rank = static_cast<uint32_t>(cut >> kIdBits);
  uint32_t const cut_id = static_cast<uint32_t>(cut & ((1u << kIdBits) - 1));
  MinPKeys const min_p = min_p_keys(c.min_ps, c.first, c.y0 != nullptr ? c.y0[row] : 0.0f, row);
  uint32_t const id0 = static_cast<uint32_t>(r.vocab_start);
  int const lane = threadIdx.x & 31;
  Chunk const ch = cta_chunk(steps);
  for (int step = 0; step < ch.steps; ++step) {
    int64_t const step_first = ch.first + step * kStepTokens;
    Tile const t = load_tile(r, p, step_first, vector);
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      unsigned nibble = 0;
#pragma unroll
      for (int j = 0; j < kVector; ++j) {
        int const i = l * kVector + j;
        float const y = t.y[i];
        uint32_t const rank = rank_bits(y);
        uint32_t const id = id0 + static_cast<uint32_t>(Tile::token(step_first, i));
        bool keep = ((t.allowed >> i) & 1u) && (rank < cut_rank || (rank == cut_rank && id <= cut_id));
        if (keep && c.min_ps != nullptr) keep = min_p.keeps(y, rank, id);
        nibble |= static_cast<unsigned>(keep) << j;
      }
      unsigned word = nibble << ((lane & 7) * kVector);
      word |= __shfl_xor_sync(kFullMask, word, 1);
      word |= __shfl_xor_sync(kFullMask, word, 2);
      word |= __shfl_xor_sync(kFullMask, word, 4);
      int64_t const w = Tile::token(step_first, l * kVector) / 32;  // this lane's word
      if ((lane & 7) == 0 && w < r.mask_words) c.mask[row * r.mask_words + w] = word;
    }
  }
}

// The launch of a pass over every row: 16-byte loads where every row starts 16-byte aligned; a CTA
// takes up to 4 steps of 4096 tokens while the grid still fills two waves (fewer CTAs, each
// paying its choice and histogram once for more tokens; waves counted at 8 CTAs an SM).
struct PassLaunch {
  dim3 grid;
  bool vector;
  int steps;
};

PassLaunch pass_launch(KeySearchRows const& r, int sm_count) {
  int64_t const steps_per_row = (r.vocab_size + kStepTokens - 1) / kStepTokens;
  int64_t const two_waves = int64_t{2} * (sm_count > 0 ? sm_count : 1) * (2048 / kThreads);
  int64_t const steps = steps_per_row * r.batch_size / (two_waves > 0 ? two_waves : 1);
  PassLaunch l;
  l.steps = static_cast<int>(steps < 1 ? 1 : steps > kMaxStepsPerCta ? kMaxStepsPerCta : steps);
  l.grid = dim3(static_cast<unsigned>((steps_per_row + l.steps - 1) / l.steps), static_cast<unsigned>(r.batch_size));
  l.vector = reinterpret_cast<uintptr_t>(r.y) % 16 == 0 && r.row_stride % kVector == 0;
  return l;
}

}  // namespace

cudaError_t launch_first_order_keys(KeySearchRows const& rows, int64_t* first, int sm_count, cudaStream_t stream) {
  if (rows.batch_size == 0 || rows.vocab_size == 0) return cudaSuccess;
  PassLaunch const l = pass_launch(rows, sm_count);
  first_keys_kernel<<<l.grid, kThreads, 0, stream>>>(rows, first, l.vector, l.steps);
  return cudaGetLastError();
}

cudaError_t launch_key_search_round(KeySearchRound const& round, int sm_count, cudaStream_t stream) {
  if (round.rows.batch_size == 0) return cudaSuccess;
  PassLaunch l = pass_launch(round.rows, sm_count);
  if (round.shift < 0 || l.grid.x == 0) l.grid.x = 1;  // the choice alone: a CTA a row
  search_round_kernel<<<l.grid, kThreads, 0, stream>>>(round, l.vector, l.steps);
  return cudaGetLastError();
}

cudaError_t launch_key_cut_mask(KeyCutMask const& cut, int sm_count, cudaStream_t stream) {
  if (cut.rows.batch_size == 0 || cut.rows.mask_words == 0) return cudaSuccess;
  PassLaunch const l = pass_launch(cut.rows, sm_count);
  cut_mask_kernel<<<l.grid, kThreads, 0, stream>>>(cut, l.vector, l.steps);
  return cudaGetLastError();
}

}  // namespace flashsampling
