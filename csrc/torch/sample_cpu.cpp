// CPU implementation of flashsampling::sample and flashsampling::sample_with_scores (and
// flashsampling::_sample_logits, the same from precomputed logits).
//
// One parallel pass over blocks of the vocabulary: a thread computes the fp32 logits of a
// block for every row (logits_cpu.h: register-tiled dot products, [B, block] in cache, never
// [B, V]), then scores them with the noise, the perturbed score and the running argmax of
// philox_gumbel.h, so the CPU picks the tokens the GPU kernels pick (up to the accumulation
// order of the fp32 logits).
//
// With logit biases, an allowed-token mask or log-probabilities, a transform pass over each
// block (before the scan) turns the logits into the transformed logits x of checks.h in
// place, accumulates the online logsumexp of y = x / T (fp32 exp terms below 1, summed in
// float64) and writes NaN over the excluded tokens (a NaN score never wins), so the scan
// itself, and with it the plain path, is unchanged. The transform is compiled per
// instruction set like the scan, written so that it vectorises.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "flashsampling/philox_gumbel.h"
#include "logits_cpu.h"

namespace flashsampling {
namespace {

constexpr int64_t kUnitVocab = 512;    // most vocabulary entries of one transform call
constexpr int kTile = 64;              // vocabulary entries scored at once (stack buffers)
constexpr int kGroupRows = 4;          // rows of one work unit: the 4 lanes of a Philox block

struct Candidate {
  float score;
  int32_t index;
};
constexpr Candidate kNone{-std::numeric_limits<float>::infinity(), kNoCandidate};

inline bool keep_better(Candidate& best, const Candidate& candidate) {
  if (fs_candidate_better(candidate.score, candidate.index, best.score, best.index)) {
    best = candidate;
    return true;
  }
  return false;
}

// Noise coordinates and temperature of one batch row.
struct RowParams {
  uint64_t seed;
  uint64_t offset;
  uint32_t stream;
  float inv_temperature;
  bool greedy;  // T == 0: score = logit, no noise
};

// Up to kGroupRows consecutive rows of the batch.
struct RowGroup {
  int64_t first_row;
  int num_rows;
  // Equal seeds and offsets and streams 4q + r in row order (a batch-wide seed's aligned rows):
  // row r is lane r of one Philox block, so one Philox call serves the whole group.
  bool shared_block;
};

// One work unit: a row group, one sample index, vocabulary [begin, end) of the block.
struct UnitArgs {
  const float* logits;  // logit of (first row, vocabulary index block_begin); rows ld apart
  int64_t ld;
  int64_t block_begin;
  int64_t vocab_start;  // global index of local vocabulary index 0 (noise and tokens)
  const RowParams* rows;
  RowGroup group;
  uint32_t sample;
  int64_t begin, end;
  Candidate* best;  // [group.num_rows], updated
};

#if defined(__GNUC__)
#define FS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FS_ALWAYS_INLINE inline
#endif

// Keeps the best of `score[0, n)` (vocabulary indices first_index + i) in `best`.
FS_ALWAYS_INLINE void keep_tile_best(Candidate& best, const float* score, int n,
                                     int32_t first_index) {
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) tile_max = score[i] > tile_max ? score[i] : tile_max;  // skips NaN
  if (!(tile_max >= best.score)) return;  // nothing in the tile can win
  for (int i = 0; i < n; ++i) {
    if (score[i] == tile_max) {
      keep_better(best, Candidate{tile_max, first_index + i});
      return;
    }
  }
}

// The hot loop, compiled once per instruction set below; every variant gives the same
// bits (philox_gumbel.h fixes each rounding) and tests/test_sample_cpu.py checks it.
FS_ALWAYS_INLINE void scan_unit_body(const UnitArgs& a) {
  alignas(64) float noise[kGroupRows][kTile];
  alignas(64) float score[kTile];
  for (int64_t tile_begin = a.begin; tile_begin < a.end; tile_begin += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, a.end - tile_begin));
    const auto vocab_index = static_cast<uint32_t>(a.vocab_start + tile_begin);  // global
    if (a.group.shared_block) {
      const RowParams& p = a.rows[0];
      const uint64_t offset_plus_sample = p.offset + a.sample;
      const uint32_t quad = p.stream >> 2;
      for (int i = 0; i < n; ++i) {
        const Philox4 r = fs_noise_block(p.seed, offset_plus_sample, vocab_index + i, quad);
        noise[0][i] = fs_gumbel_from_bits(r.x);
        noise[1][i] = fs_gumbel_from_bits(r.y);
        noise[2][i] = fs_gumbel_from_bits(r.z);
        noise[3][i] = fs_gumbel_from_bits(r.w);
      }
    } else {
      for (int r = 0; r < a.group.num_rows; ++r) {
        const RowParams& p = a.rows[r];
        if (p.greedy) continue;
        for (int i = 0; i < n; ++i) {
          noise[r][i] = fs_gumbel_noise(p.seed, p.offset, p.stream, a.sample, vocab_index + i);
        }
      }
    }
    for (int r = 0; r < a.group.num_rows; ++r) {
      const RowParams& p = a.rows[r];
      const float* logit = a.logits + r * a.ld + (tile_begin - a.block_begin);
      if (p.greedy) {
        keep_tile_best(a.best[r], logit, n, static_cast<int32_t>(vocab_index));
        continue;
      }
      for (int i = 0; i < n; ++i) {
        score[i] = fs_perturbed_score(logit[i], p.inv_temperature, noise[r][i]);
      }
      keep_tile_best(a.best[r], score, n, static_cast<int32_t>(vocab_index));
    }
  }
}

// ---------------------------------------------------------------- transform pass

// Per-row entries sorted by local vocabulary index (CSR): the sparse biases and the penalties.
template <class Entry>
struct RowEntries {
  std::vector<int64_t> row_begin;  // [B + 1]
  std::vector<Entry> entries;

  // fn(entry) for row `row`'s entries with index in [begin, end), in index order.
  template <class Fn>
  void for_each_in(int64_t row, int64_t begin, int64_t end, Fn&& fn) const {
    const Entry* first = entries.data() + row_begin[row];
    const Entry* last = entries.data() + row_begin[row + 1];
    const Entry* e = std::lower_bound(first, last, begin, [](const Entry& s, int64_t v) { return s.index < v; });
    for (; e != last && e->index < end; ++e) fn(*e);
  }
};

// One sparse bias of a row: local vocabulary index and the sum of its values.
struct SparseEntry {
  int64_t index;
  float value;
};

// The sparse biases of every row, by local index (CSR). Ids outside
// [vocab_start, vocab_start + V) are dropped; the values of a repeated id are summed
// in fp32 in list order, and that sum is added to the logit once (checks.h).
using SparseBias = RowEntries<SparseEntry>;

SparseBias gather_sparse_bias(const at::Tensor& ids_in, const at::Tensor& values_in, int64_t vocab_start,
                              int64_t vocab) {
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const at::Tensor values = values_in.contiguous();
  const int64_t batch = ids.size(0), width = ids.size(1);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const float* value = values.const_data_ptr<float>();
  SparseBias out;
  out.row_begin.assign(1, 0);
  std::vector<SparseEntry> row;
  for (int64_t b = 0; b < batch; ++b) {
    row.clear();
    for (int64_t k = 0; k < width; ++k) {
      const int64_t local = id[b * width + k] - vocab_start;
      if (local >= 0 && local < vocab) row.push_back(SparseEntry{local, value[b * width + k]});
    }
    std::stable_sort(row.begin(), row.end(),
                     [](const SparseEntry& a, const SparseEntry& c) { return a.index < c.index; });
    for (const SparseEntry& e : row) {  // stable sort: equal ids stay in list order
      const bool repeat = static_cast<int64_t>(out.entries.size()) > out.row_begin.back() &&
                          out.entries.back().index == e.index;
      if (!repeat) out.entries.push_back(SparseEntry{e.index, 0.0f});
      out.entries.back().value = fs_add(out.entries.back().value, e.value);  // sum = 0 + v1 + v2 ...
    }
    out.row_begin.push_back(static_cast<int64_t>(out.entries.size()));
  }
  return out;
}

// The penalties of a row's seen tokens (checks.h), by local index (CSR): the CPU's form of the
// CUDA epilogue's rank bitmap, the same {r, add} per token. Free slots (negative ids) and ids
// outside [vocab_start, vocab_start + V) are dropped; r = 1 and add = -0.0f where not given
// (fs_penalized_logit then leaves x as it is). Ids are distinct in a row (a PenaltyState's);
// a repeated one is applied once per entry.
struct PenaltyEntry {
  int64_t index;
  float r, add;
};

using PenaltyTable = RowEntries<PenaltyEntry>;

PenaltyTable gather_penalties(const SampleArgs& args, int64_t vocab) {
  const at::Tensor ids = args.penalty_ids->contiguous();
  const at::Tensor values = args.penalty_values.has_value() ? args.penalty_values->contiguous() : at::Tensor();
  const at::Tensor repetition =
      args.repetition_penalties.has_value() ? args.repetition_penalties->contiguous() : at::Tensor();
  const int64_t batch = ids.size(0), capacity = ids.size(1);
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const float* value = values.defined() ? values.const_data_ptr<float>() : nullptr;
  const float* r = repetition.defined() ? repetition.const_data_ptr<float>() : nullptr;
  PenaltyTable out;
  out.row_begin.assign(1, 0);
  for (int64_t b = 0; b < batch; ++b) {
    const auto first = static_cast<std::ptrdiff_t>(out.entries.size());
    for (int64_t k = 0; k < capacity; ++k) {
      const int64_t local = id[b * capacity + k] - args.vocab_start;
      if (local >= 0 && local < vocab) {
        out.entries.push_back(PenaltyEntry{local, r != nullptr ? r[b] : 1.0f,
                                           value != nullptr ? value[b * capacity + k] : -0.0f});
      }
    }
    std::stable_sort(out.entries.begin() + first, out.entries.end(),
                     [](const PenaltyEntry& a, const PenaltyEntry& c) { return a.index < c.index; });
    out.row_begin.push_back(static_cast<int64_t>(out.entries.size()));
  }
  return out;
}

// Online logsumexp: lse = max + log(sum), sum of exp(y - max) over the non-NaN values;
// any NaN makes it NaN. Empty: max = -inf, sum = 0 (lse = -inf).
struct LogSumExp {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0.0;
  bool nan = false;

  void merge(const LogSumExp& o) {
    nan = nan || o.nan;
    if (o.max == -std::numeric_limits<double>::infinity()) return;
    if (max == -std::numeric_limits<double>::infinity()) {
      max = o.max;
      sum = o.sum;
    } else if (std::isinf(max) || std::isinf(o.max)) {  // +inf dominates
      max = std::numeric_limits<double>::infinity();
      sum = 1.0;
    } else if (o.max > max) {
      sum = sum * std::exp(max - o.max) + o.sum;
      max = o.max;
    } else {
      sum += o.sum * std::exp(o.max - max);
    }
  }
  double value() const {
    if (nan) return std::numeric_limits<double>::quiet_NaN();
    if (max == -std::numeric_limits<double>::infinity() || std::isinf(max)) return max;
    return max + std::log(sum);
  }
};

// What the transform pass applies; null / false members are skipped.
struct Transform {
  ModelTransform model;           // logit_scale, logit_softcap (first, on the raw logit)
  const float* bias = nullptr;    // logit_bias [V]
  const int32_t* mask = nullptr;  // allowed_mask [B, mask_words]
  int64_t mask_words = 0;
  const SparseBias* sparse = nullptr;
  const PenaltyTable* penalties = nullptr;  // after the biases
  bool logsumexp = false;
};

// One transform work unit: row `row`, local vocabulary [begin, end) (begin % 32 == 0).
struct TransformArgs {
  const Transform* t;
  const RowParams* p;
  int64_t row;
  float* x;  // the row's logit of local index begin, transformed in place
  int64_t begin, end;
  LogSumExp* lse;  // updated when t->logsumexp
};

// a where c, else b, without control flow: a float compare may trap, so GCC does not
// if-convert `c ? a : b` into a blend and the loop would not vectorise.
FS_ALWAYS_INLINE float select_float(bool c, float a, float b) {
  const uint32_t keep = 0u - static_cast<uint32_t>(c);
  return fs_uint_as_float((fs_float_as_uint(a) & keep) | (fs_float_as_uint(b) & ~keep));
}

// exp(x) for x <= 0 (below -87, -inf and NaN give 0), relative error < 1e-6,
// branch-free so that it vectorises: Cody-Waite reduction x = k ln2 + r, |r| <= ln2 / 2,
// degree-7 Taylor polynomial of exp(r), times 2^k. Only for the logsumexp, which needs
// no bit-exactness.
FS_ALWAYS_INLINE float exp_nonpositive(float x) {
  constexpr float kLog2e = 1.44269504088896341f, kRound = 12582912.0f;  // 1.5 * 2^23
  constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-06f;
  const bool tiny = !(x >= -87.0f);
  const float xc = select_float(tiny, -87.0f, x);
  const float k = (xc * kLog2e + kRound) - kRound;  // round to nearest (host TUs do not contract)
  const float r = (xc - k * kLn2Hi) - k * kLn2Lo;
  float q = 1.0f / 5040.0f;
  q = q * r + 1.0f / 720.0f;
  q = q * r + 1.0f / 120.0f;
  q = q * r + 1.0f / 24.0f;
  q = q * r + 1.0f / 6.0f;
  q = q * r + 0.5f;
  q = q * r + 1.0f;
  q = q * r + 1.0f;
  const float scale = fs_uint_as_float(static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23);
  return select_float(tiny, 0.0f, q * scale);
}

// Signed-integer key with the order of the non-NaN floats (integer max vectorises, a
// float max does not without -ffinite-math-only), and back.
FS_ALWAYS_INLINE int32_t order_key(float f) {
  const auto b = static_cast<int32_t>(fs_float_as_uint(f));
  return b ^ ((b >> 31) & 0x7fffffff);
}
FS_ALWAYS_INLINE float from_order_key(int32_t key) {
  return fs_uint_as_float(static_cast<uint32_t>(key ^ ((key >> 31) & 0x7fffffff)));
}

// v[j] = fill where bit j of bits is clear, j < count (<= 32); branch-free bit blends
// so that it vectorises.
FS_ALWAYS_INLINE void fill_excluded(float* v, uint32_t bits, int count, float fill) {
  const uint32_t fill_bits = fs_float_as_uint(fill);
  for (int j = 0; j < count; ++j) {
    const uint32_t keep = 0u - ((bits >> j) & 1u);
    v[j] = fs_uint_as_float((fs_float_as_uint(v[j]) & keep) | (fill_bits & ~keep));
  }
}

FS_ALWAYS_INLINE void fill_excluded_range(float* v, const uint32_t* words, int64_t n, float fill) {
  for (int64_t w = 0; w * 32 < n; ++w) {
    const int count = static_cast<int>(std::min<int64_t>(32, n - w * 32));
    if (words[w] != ~0u) fill_excluded(v + w * 32, words[w], count, fill);
  }
}

// Applies the model transforms, adds the biases, accumulates the logsumexp of y = x / T over the allowed tokens and
// writes NaN over the excluded ones (so the scan never picks them).
FS_ALWAYS_INLINE void transform_unit_body(const TransformArgs& a) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const Transform& t = *a.t;
  float* xs = a.x;
  const int64_t n = a.end - a.begin;
  if (t.model.on()) {
    const ModelTransform m = t.model;
    for (int64_t i = 0; i < n; ++i) xs[i] = fs_model_logit(xs[i], m.scale, m.softcap, m.inv_softcap);
  }
  if (t.bias != nullptr) {
    const float* bias = t.bias + a.begin;
    for (int64_t i = 0; i < n; ++i) xs[i] = fs_add(xs[i], bias[i]);
  }
  if (t.sparse != nullptr) {
    t.sparse->for_each_in(a.row, a.begin, a.end, [&](const SparseEntry& e) {
      xs[e.index - a.begin] = fs_add(xs[e.index - a.begin], e.value);
    });
  }
  if (t.penalties != nullptr) {
    t.penalties->for_each_in(a.row, a.begin, a.end, [&](const PenaltyEntry& e) {
      float& x = xs[e.index - a.begin];
      x = fs_penalized_logit(x, e.r, e.add);
    });
  }
  const uint32_t* words = t.mask == nullptr ? nullptr
                         : reinterpret_cast<const uint32_t*>(t.mask + a.row * t.mask_words) + (a.begin >> 5);
  if (t.logsumexp) {
    // y = x / T with the excluded tokens at -inf; NaN makes the logsumexp NaN.
    alignas(64) float y[kUnitVocab];
    const float scale = a.p->greedy ? 1.0f : a.p->inv_temperature;
    for (int64_t i = 0; i < n; ++i) y[i] = fs_mul(xs[i], scale);  // x * 1 == x (greedy)
    if (words != nullptr) fill_excluded_range(y, words, n, kMinusInf);
    // Max over the non-NaN values and whether there is a NaN, with integer ops.
    int32_t max_key = order_key(kMinusInf);
    uint32_t any_nan = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t is_nan = (fs_float_as_uint(y[i]) & 0x7fffffffu) > 0x7f800000u;
      const int32_t key = order_key(y[i]);
      any_nan |= is_nan;
      max_key = std::max(max_key, is_nan ? max_key : key);
    }
    const float max = from_order_key(max_key);
    LogSumExp part;
    part.nan = any_nan != 0;
    if (max == std::numeric_limits<float>::infinity()) {
      part.max = max;
      part.sum = 1.0;
    } else if (max != kMinusInf) {
      // exp(y - max) in [0, 1] (NaN terms, already flagged, count 0), summed in float64.
      for (int64_t i = 0; i < n; ++i) y[i] = exp_nonpositive(y[i] - max);
      constexpr int kLanes = 8;
      alignas(64) double lane_sum[kLanes] = {};
      const int64_t whole = n / kLanes * kLanes;
      for (int64_t i = 0; i < whole; i += kLanes) {
        for (int j = 0; j < kLanes; ++j) lane_sum[j] += static_cast<double>(y[i + j]);
      }
      double sum = 0.0;
      for (int64_t i = whole; i < n; ++i) sum += static_cast<double>(y[i]);
      for (int j = 0; j < kLanes; ++j) sum += lane_sum[j];
      part.max = max;
      part.sum = sum;
    }
    a.lse->merge(part);
  }
  if (words != nullptr) fill_excluded_range(xs, words, n, std::numeric_limits<float>::quiet_NaN());
}

using ScanUnitFn = void (*)(const UnitArgs&);
using TransformUnitFn = void (*)(const TransformArgs&);

void scan_unit_default(const UnitArgs& a) { scan_unit_body(a); }
void transform_unit_default(const TransformArgs& a) { transform_unit_body(a); }

// Without FMA in the target, std::fma is a library call that also blocks
// vectorisation (about 7x slower), so x86 gets AVX2 and AVX-512 variants.
#if defined(__x86_64__) && defined(__GNUC__)
#define FS_HAVE_X86_VARIANTS 1
__attribute__((target("avx2,fma"))) void scan_unit_avx2(const UnitArgs& a) {
  scan_unit_body(a);
}
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void scan_unit_avx512(
    const UnitArgs& a) {
  scan_unit_body(a);
}
__attribute__((target("avx2,fma"))) void transform_unit_avx2(const TransformArgs& a) {
  transform_unit_body(a);
}
__attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma"))) void transform_unit_avx512(
    const TransformArgs& a) {
  transform_unit_body(a);
}
#endif

struct CpuKernels {
  ScanUnitFn scan;
  TransformUnitFn transform;
};

// The variants of the instruction set select_logits_isa() picks (the widest this CPU runs,
// or the one FLASHSAMPLING_CPU_ISA=default|avx2|avx512|avx512bf16 pins; tests compare them).
CpuKernels select_kernels() {
  switch (select_logits_isa()) {
#ifdef FS_HAVE_X86_VARIANTS
    case LogitsIsa::kAvx512Bf16:
    case LogitsIsa::kAvx512:
      return CpuKernels{scan_unit_avx512, transform_unit_avx512};
    case LogitsIsa::kAvx2:
      return CpuKernels{scan_unit_avx2, transform_unit_avx2};
#endif
    default:
      return CpuKernels{scan_unit_default, transform_unit_default};
  }
}

// Value of a seed-like tensor ([] or [B]) for every row; `fallback` when absent.
std::vector<uint64_t> per_row_values(const std::optional<at::Tensor>& t, int64_t batch,
                                     uint64_t fallback) {
  std::vector<uint64_t> values(batch, fallback);
  if (!t.has_value()) return values;
  const at::Tensor host = t->to(at::kCPU).contiguous();
  const int64_t* p = host.const_data_ptr<int64_t>();
  for (int64_t row = 0; row < batch; ++row) {
    values[row] = static_cast<uint64_t>(p[host.dim() == 0 ? 0 : row]);
  }
  return values;
}

// Resolves seed/offset/generator and temperatures into per-row noise coordinates
// (rules in checks.h). Temperatures are rounded to fp32; inv_temperature = fl(1 / T).
std::vector<RowParams> resolve_rows(int64_t batch, const SampleArgs& args) {
  uint64_t generator_seed = 0;
  if (!args.seed.has_value()) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        args.generator, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    generator_seed = gen->random64();
  }
  const std::vector<uint64_t> seeds = per_row_values(args.seed, batch, generator_seed);
  const std::vector<uint64_t> offsets = per_row_values(args.offset, batch, 0);
  const bool per_row_seed = has_per_row_seed(args.seed);
  const std::vector<uint64_t> streams = per_row_values(args.streams, batch, 0);
  at::Tensor temps;
  if (args.temperatures.has_value()) temps = args.temperatures->contiguous();

  std::vector<RowParams> rows(batch);
  for (int64_t row = 0; row < batch; ++row) {
    const float t = temps.defined() ? temps.const_data_ptr<float>()[row]
                                    : static_cast<float>(args.temperature);
    // The same rule as the CUDA kernel: 0 = greedy (checks.cpp has refused invalid values).
    const float inv_temperature = fs_inv_temperature(t);
    const uint32_t stream = args.streams.has_value() ? static_cast<uint32_t>(streams[row])
                            : per_row_seed           ? 0u
                                                     : static_cast<uint32_t>(row);
    rows[row] = RowParams{seeds[row], offsets[row], stream,
                          inv_temperature, inv_temperature == 0.0f};
  }
  return rows;
}

std::vector<RowGroup> make_groups(const std::vector<RowParams>& rows) {
  const auto batch = static_cast<int64_t>(rows.size());
  std::vector<RowGroup> groups;
  for (int64_t first = 0; first < batch; first += kGroupRows) {
    const int n = static_cast<int>(std::min<int64_t>(kGroupRows, batch - first));
    int noisy = 0;
    bool one_block = rows[first].stream % 4 == 0;
    for (int r = 0; r < n; ++r) {
      const RowParams& p = rows[first + r];
      noisy += p.greedy ? 0 : 1;
      one_block = one_block && p.seed == rows[first].seed && p.offset == rows[first].offset &&
                  p.stream == rows[first].stream + static_cast<uint32_t>(r);
    }
    // One block costs about as much as two single-lane draws.
    groups.push_back(RowGroup{first, n, one_block && noisy >= 2});
  }
  return groups;
}

// Rows of allowed_mask with no bit set in [0, V).
std::vector<char> empty_mask_rows(const at::Tensor& mask, int64_t vocab) {
  const int64_t batch = mask.size(0), words = mask.size(1);
  const int32_t* m = mask.const_data_ptr<int32_t>();
  const uint32_t tail = vocab % 32 == 0 ? ~0u : (uint32_t{1} << (vocab % 32)) - 1u;
  std::vector<char> empty(batch, 1);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t w = 0; w < words && empty[b]; ++w) {
      const uint32_t bits = static_cast<uint32_t>(m[b * words + w]) & (w == words - 1 ? tail : ~0u);
      if (bits != 0) empty[b] = 0;
    }
  }
  return empty;
}

// ---------------------------------------------------------------- the op

// Vocabulary rows of one block: one thread computes their logits for every batch row (kept in
// cache, [B, kBlockVocab] fp32), transforms and scans them. A multiple of kTile, so every block
// starts on a word of allowed_mask; at most kUnitVocab (the transform's stack buffer).
constexpr int64_t kBlockVocab = 256;
static_assert(kBlockVocab % kTile == 0 && kBlockVocab <= kUnitVocab, "block size");

// A candidate with the transformed logit x of its token (for the log-probabilities).
struct Winner {
  Candidate candidate = kNone;
  float x = 0.0f;
};

// Fills out[b * ld + j], b < B, j < n, with the raw fp32 logits of vocabulary rows
// [begin, begin + n): computed (CpuLogits) or copied from precomputed logits.
using LogitsSource = std::function<void(int64_t begin, int64_t n, float* out, int64_t ld)>;

// The sample of checks.h from the logits `source` gives, for a batch of `batch` rows and a
// vocabulary of `vocab` rows; `options` are those of the outputs (the CPU). One parallel pass
// over vocabulary blocks: the winners do not depend on the block order (fs_candidate_better is
// a total order) and the logsumexp is merged in block order, so no output depends on the
// thread count.
SampleResult sample_blocks(int64_t batch, int64_t vocab, const at::TensorOptions& options, const SampleArgs& args,
                           const LogitsSource& source) {
  const int64_t num_samples = args.num_samples;
  const auto float_options = options.dtype(at::kFloat);
  SampleResult result;
  result.tokens = at::empty({batch, num_samples}, options.dtype(at::kLong));
  result.scores = at::empty({batch, num_samples}, float_options);
  result.token_logprobs = args.return_logprobs ? at::empty({batch, num_samples}, float_options)
                                               : at::empty({0}, float_options);
  result.logsumexp = at::empty({args.return_logprobs ? batch : 0}, float_options);
  if (batch == 0) return result;

  const std::vector<RowParams> rows = resolve_rows(batch, args);
  const std::vector<RowGroup> groups = make_groups(rows);
  const CpuKernels kernels = select_kernels();

  // The transform pass (only when something asks for it).
  Transform transform;
  at::Tensor bias, mask;
  SparseBias sparse;
  PenaltyTable penalties;
  std::vector<char> empty_row(batch, 0);
  if (args.logit_bias.has_value()) {
    bias = args.logit_bias->contiguous();
    transform.bias = bias.const_data_ptr<float>();
  }
  if (args.sparse_bias_ids.has_value() && args.sparse_bias_ids->numel() > 0) {
    sparse = gather_sparse_bias(*args.sparse_bias_ids, *args.sparse_bias_values, args.vocab_start, vocab);
    if (!sparse.entries.empty()) transform.sparse = &sparse;
  }
  if (args.allowed_mask.has_value()) {
    mask = args.allowed_mask->contiguous();
    transform.mask = mask.const_data_ptr<int32_t>();
    transform.mask_words = mask.size(1);
    empty_row = empty_mask_rows(mask, vocab);  // only with empty_mask_token (else checked before)
  }
  transform.logsumexp = args.return_logprobs;
  transform.model = model_transform(args.logit_scale, args.logit_softcap);
  if (args.penalty_ids.has_value()) {
    penalties = gather_penalties(args, vocab);
    if (!penalties.entries.empty()) transform.penalties = &penalties;
  }
  const bool run_transform = transform.model.on() || transform.bias != nullptr || transform.sparse != nullptr ||
                             transform.penalties != nullptr || transform.mask != nullptr || transform.logsumexp;

  const int64_t num_blocks = (vocab + kBlockVocab - 1) / kBlockVocab;
  const int64_t num_winners = batch * num_samples;
  std::vector<Winner> best(num_winners);                                          // [B, S]
  std::vector<LogSumExp> block_lse(args.return_logprobs ? num_blocks * batch : 0);  // [blocks, B]
  std::mutex best_mutex;
  at::parallel_for(0, num_blocks, 1, [&](int64_t first_block, int64_t last_block) {
    std::vector<float> logits(batch * kBlockVocab);
    std::vector<Winner> local(num_winners);
    Candidate block_best[kGroupRows];
    for (int64_t block = first_block; block < last_block; ++block) {
      const int64_t begin = block * kBlockVocab, end = std::min(vocab, begin + kBlockVocab);
      float* x = logits.data();
      source(begin, end - begin, x, kBlockVocab);
      if (run_transform) {
        for (int64_t row = 0; row < batch; ++row) {
          kernels.transform(TransformArgs{&transform, &rows[row], row, x + row * kBlockVocab, begin, end,
                                          transform.logsumexp ? &block_lse[block * batch + row] : nullptr});
        }
      }
      for (const RowGroup& group : groups) {
        for (int64_t sample = 0; sample < num_samples; ++sample) {
          std::fill(block_best, block_best + kGroupRows, kNone);
          kernels.scan(UnitArgs{x + group.first_row * kBlockVocab, kBlockVocab, begin, args.vocab_start,
                                &rows[group.first_row], group, static_cast<uint32_t>(sample), begin, end,
                                block_best});
          for (int r = 0; r < group.num_rows; ++r) {
            const int64_t row = group.first_row + r;
            Winner& w = local[row * num_samples + sample];
            if (keep_better(w.candidate, block_best[r]) && args.return_logprobs) {
              w.x = x[row * kBlockVocab + (block_best[r].index - args.vocab_start - begin)];
            }
          }
        }
      }
    }
    // Merging in any order gives the same winners (fs_candidate_better is a total order).
    std::lock_guard<std::mutex> lock(best_mutex);
    for (int64_t i = 0; i < num_winners; ++i) {
      if (keep_better(best[i].candidate, local[i].candidate)) best[i].x = local[i].x;
    }
  });
  std::vector<LogSumExp> row_lse(args.return_logprobs ? batch : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(block_lse.size()); ++i) row_lse[i % batch].merge(block_lse[i]);

  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  int64_t* tokens = result.tokens.mutable_data_ptr<int64_t>();
  float* scores = result.scores.mutable_data_ptr<float>();
  float* token_logprobs = args.return_logprobs ? result.token_logprobs.mutable_data_ptr<float>() : nullptr;
  float* logsumexp = args.return_logprobs ? result.logsumexp.mutable_data_ptr<float>() : nullptr;
  for (int64_t row = 0; row < batch; ++row) {
    const double lse = args.return_logprobs ? row_lse[row].value() : 0.0;
    if (logsumexp != nullptr) logsumexp[row] = empty_row[row] ? -kInf : static_cast<float>(lse);
    for (int64_t s = 0; s < num_samples; ++s) {
      const int64_t i = row * num_samples + s;
      const Candidate& c = best[i].candidate;
      const bool none = c.index == kNoCandidate;  // every score NaN
      if (empty_row[row]) {
        tokens[i] = *args.empty_mask_token;
        scores[i] = -kInf;
      } else {
        tokens[i] = none ? -1 : c.index;
        scores[i] = c.score;  // -inf when none
      }
      if (token_logprobs != nullptr) {
        const float y = rows[row].greedy ? best[i].x : fs_mul(best[i].x, rows[row].inv_temperature);
        token_logprobs[i] = empty_row[row] || none ? kNaN : static_cast<float>(static_cast<double>(y) - lse);
      }
    }
  }
  return result;
}

SampleResult sample_cpu(const at::Tensor& hidden, const at::Tensor& weight, const SampleArgs& args) {
  check_sample_args(hidden, weight, args);
  check_mask_rows_nonempty(weight, args);
  const int64_t batch = hidden.size(0);
  std::optional<CpuLogits> logits;
  if (batch > 0) logits.emplace(hidden, weight);
  return sample_blocks(batch, weight.size(0), hidden.options(), args,
                       [&](int64_t begin, int64_t n, float* out, int64_t ld) { logits->compute(begin, n, out, ld); });
}

// flashsampling::_sample_logits: the same sample from precomputed fp32 logits [B, V].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_logits_cpu(
    const at::Tensor& logits_in, double temperature, const std::optional<at::Tensor>& temperatures,
    int64_t num_samples, const std::optional<at::Tensor>& seed, const std::optional<at::Tensor>& offset,
    std::optional<at::Generator> generator, const std::optional<at::Tensor>& logit_bias,
    const std::optional<at::Tensor>& sparse_bias_ids, const std::optional<at::Tensor>& sparse_bias_values,
    const std::optional<at::Tensor>& allowed_mask, std::optional<int64_t> empty_mask_token, int64_t vocab_start,
    bool return_logprobs) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat && logits_in.size(1) >= 1,
              "flashsampling._sample_logits: logits must be float32 [B, V] with V >= 1, got ",
              logits_in.scalar_type(), " of shape ", logits_in.sizes());
  const SampleArgs args = SampleOps<&sample_cpu>::make_args(
      temperature, temperatures, num_samples, seed, offset, std::move(generator), logit_bias, sparse_bias_ids,
      sparse_bias_values, allowed_mask, empty_mask_token, vocab_start, return_logprobs);
  const int64_t vocab = logits_in.size(1);
  TORCH_CHECK(vocab_start >= 0 && vocab_start + vocab <= (int64_t{1} << 31) - 1,
              "flashsampling.sample: vocab_start must be >= 0 with vocab_start + V < 2^31, got vocab_start=",
              vocab_start, " and V=", vocab);
  TORCH_CHECK(num_samples >= 1, "flashsampling.sample: num_samples must be >= 1, got ", num_samples);
  check_control_args(logits_in, vocab, args);
  check_mask_rows_nonempty(vocab, args);
  const at::Tensor logits = logits_in.contiguous();
  const float* data = logits.const_data_ptr<float>();
  const int64_t batch = logits.size(0);
  SampleResult r = sample_blocks(batch, vocab, logits.options(), args,
                                 [&](int64_t begin, int64_t n, float* out, int64_t ld) {
                                   for (int64_t b = 0; b < batch; ++b) {
                                     std::memcpy(out + b * ld, data + b * vocab + begin, n * sizeof(float));
                                   }
                                 });
  return {r.tokens, r.scores, r.token_logprobs, r.logsumexp};
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CPU, m) {
  SampleOps<&sample_cpu>::register_impls(m);
  m.impl("_sample_logits", &sample_logits_cpu);
}

}  // namespace flashsampling
