// CPU implementation of flashsampling::sample.
//
// Streams over the vocabulary in chunks: one fp32 at::mm gives the logits of a chunk
// for every row ([B, chunk] in memory, never [B, V]); the noise, the perturbed score
// and the running argmax are those of philox_gumbel.h, so the CPU picks the tokens
// the GPU kernels pick (up to the accumulation order of the fp32 logits).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "checks.h"
#include "flashsampling/philox_gumbel.h"

namespace flashsampling {
namespace {

// Vocabulary rows per at::mm: their fp32 copy (chunk x D) stays near 2 MiB so the
// conversion and the GEMM run from cache (4x faster at D = 4096 than 2048 rows);
// memory is O(B * chunk).
constexpr int64_t kChunkBytes = int64_t{2} << 20;
constexpr int64_t kMinVocabChunk = 256, kMaxVocabChunk = 2048;
constexpr int64_t kUnitVocab = 512;    // vocabulary entries of one parallel work unit
constexpr int kTile = 64;              // vocabulary entries scored at once (stack buffers)
constexpr int kGroupRows = 4;          // rows of one work unit: the 4 lanes of a Philox block

struct Candidate {
  float score;
  int32_t index;
};
constexpr Candidate kNone{-std::numeric_limits<float>::infinity(), kNoCandidate};

inline void keep_better(Candidate& best, const Candidate& candidate) {
  if (fs_candidate_better(candidate.score, candidate.index, best.score, best.index)) {
    best = candidate;
  }
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
  // Batch-wide seed, equal offsets and aligned rows: row r is lane r of one Philox
  // block, so one Philox call serves the whole group.
  bool shared_block;
};

// One work unit: a row group, one sample index, vocabulary [begin, end) of the chunk.
struct UnitArgs {
  const float* logits;  // logit of (first row, vocabulary index chunk_begin); rows ld apart
  int64_t ld;
  int64_t chunk_begin;
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
    const auto vocab_index = static_cast<uint32_t>(tile_begin);
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
      const float* logit = a.logits + r * a.ld + (tile_begin - a.chunk_begin);
      if (p.greedy) {
        keep_tile_best(a.best[r], logit, n, static_cast<int32_t>(tile_begin));
        continue;
      }
      for (int i = 0; i < n; ++i) {
        score[i] = fs_perturbed_score(logit[i], p.inv_temperature, noise[r][i]);
      }
      keep_tile_best(a.best[r], score, n, static_cast<int32_t>(tile_begin));
    }
  }
}

using ScanUnitFn = void (*)(const UnitArgs&);

void scan_unit_default(const UnitArgs& a) { scan_unit_body(a); }

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
#endif

// The widest variant this CPU runs; FLASHSAMPLING_CPU_ISA=default|avx2|avx512 pins one
// (tests compare them).
ScanUnitFn select_scan_unit() {
  const char* env = std::getenv("FLASHSAMPLING_CPU_ISA");
  const std::string wanted = env != nullptr ? env : "";
  ScanUnitFn widest = scan_unit_default, pinned = wanted == "default" ? scan_unit_default : nullptr;
#ifdef FS_HAVE_X86_VARIANTS
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    widest = scan_unit_avx2;
    if (wanted == "avx2") pinned = scan_unit_avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")) {
      widest = scan_unit_avx512;
      if (wanted == "avx512") pinned = scan_unit_avx512;
    }
  }
#endif
  if (wanted.empty()) return widest;
  TORCH_CHECK(pinned != nullptr, "flashsampling.sample: FLASHSAMPLING_CPU_ISA=", wanted,
              " is not default, avx2 or avx512, or this CPU cannot run it");
  return pinned;
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
std::vector<RowParams> resolve_rows(int64_t batch, double temperature,
                                    const std::optional<at::Tensor>& temperatures,
                                    const std::optional<at::Tensor>& seed,
                                    const std::optional<at::Tensor>& offset,
                                    const std::optional<at::Generator>& generator) {
  uint64_t generator_seed = 0;
  if (!seed.has_value()) {
    auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
        generator, at::detail::getDefaultCPUGenerator());
    std::lock_guard<std::mutex> lock(gen->mutex_);
    generator_seed = gen->random64();
  }
  const std::vector<uint64_t> seeds = per_row_values(seed, batch, generator_seed);
  const std::vector<uint64_t> offsets = per_row_values(offset, batch, 0);
  const bool per_row_seed = has_per_row_seed(seed);
  at::Tensor temps;
  if (temperatures.has_value()) temps = temperatures->contiguous();

  std::vector<RowParams> rows(batch);
  for (int64_t row = 0; row < batch; ++row) {
    const float t = temps.defined() ? temps.const_data_ptr<float>()[row]
                                    : static_cast<float>(temperature);
    rows[row] = RowParams{seeds[row], offsets[row],
                          per_row_seed ? 0u : static_cast<uint32_t>(row),
                          t == 0.0f ? 0.0f : fs_div(1.0f, t), t == 0.0f};
  }
  return rows;
}

std::vector<RowGroup> make_groups(const std::vector<RowParams>& rows, bool per_row_seed) {
  const auto batch = static_cast<int64_t>(rows.size());
  std::vector<RowGroup> groups;
  for (int64_t first = 0; first < batch; first += kGroupRows) {
    const int n = static_cast<int>(std::min<int64_t>(kGroupRows, batch - first));
    int noisy = 0;
    bool same_offset = true;
    for (int r = 0; r < n; ++r) {
      noisy += rows[first + r].greedy ? 0 : 1;
      same_offset = same_offset && rows[first + r].offset == rows[first].offset;
    }
    // One block costs about as much as two single-lane draws.
    groups.push_back(RowGroup{first, n, !per_row_seed && same_offset && noisy >= 2});
  }
  return groups;
}

at::Tensor sample_cpu(const at::Tensor& hidden, const at::Tensor& weight, double temperature,
                      const std::optional<at::Tensor>& temperatures, int64_t num_samples,
                      const std::optional<at::Tensor>& seed,
                      const std::optional<at::Tensor>& offset,
                      std::optional<at::Generator> generator) {
  check_sample_args(hidden, weight, temperature, temperatures, num_samples, seed, offset,
                    generator);
  const int64_t batch = hidden.size(0);
  const int64_t vocab = weight.size(0);
  at::Tensor tokens = at::empty({batch, num_samples}, hidden.options().dtype(at::kLong));
  if (batch == 0) return tokens;

  const std::vector<RowParams> rows =
      resolve_rows(batch, temperature, temperatures, seed, offset, generator);
  const std::vector<RowGroup> groups = make_groups(rows, has_per_row_seed(seed));
  const ScanUnitFn scan_unit = select_scan_unit();
  const auto num_groups = static_cast<int64_t>(groups.size());
  const at::Tensor hidden_f = hidden.to(at::kFloat).contiguous();

  const int64_t vocab_chunk = std::clamp(
      kChunkBytes / (static_cast<int64_t>(sizeof(float)) * std::max<int64_t>(hidden.size(1), 1)),
      kMinVocabChunk, kMaxVocabChunk);
  std::vector<Candidate> best(batch * num_samples, kNone);  // [B, num_samples]
  std::vector<Candidate> partial;                           // [units, kGroupRows]
  for (int64_t chunk_begin = 0; chunk_begin < vocab; chunk_begin += vocab_chunk) {
    const int64_t chunk = std::min(vocab_chunk, vocab - chunk_begin);
    const at::Tensor logits =
        at::mm(hidden_f, weight.narrow(0, chunk_begin, chunk).to(at::kFloat).t()).contiguous();
    const float* logits_data = logits.const_data_ptr<float>();
    const int64_t units_per_sample = (chunk + kUnitVocab - 1) / kUnitVocab;
    const int64_t num_units = num_groups * num_samples * units_per_sample;
    partial.assign(num_units * kGroupRows, kNone);

    at::parallel_for(0, num_units, 1, [&](int64_t unit_begin, int64_t unit_end) {
      for (int64_t unit = unit_begin; unit < unit_end; ++unit) {
        const int64_t part = unit % units_per_sample;
        const int64_t sample = (unit / units_per_sample) % num_samples;
        const RowGroup& group = groups[unit / (units_per_sample * num_samples)];
        const int64_t begin = chunk_begin + part * kUnitVocab;
        scan_unit(UnitArgs{logits_data + group.first_row * chunk, chunk, chunk_begin,
                           &rows[group.first_row], group, static_cast<uint32_t>(sample), begin,
                           std::min(begin + kUnitVocab, chunk_begin + chunk),
                           &partial[unit * kGroupRows]});
      }
    });
    // Merging in any order gives the same winner (fs_candidate_better is a total order).
    for (int64_t unit = 0; unit < num_units; ++unit) {
      const int64_t sample = (unit / units_per_sample) % num_samples;
      const RowGroup& group = groups[unit / (units_per_sample * num_samples)];
      for (int r = 0; r < group.num_rows; ++r) {
        keep_better(best[(group.first_row + r) * num_samples + sample],
                    partial[unit * kGroupRows + r]);
      }
    }
  }

  int64_t* out = tokens.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * num_samples; ++i) {
    out[i] = best[i].index == kNoCandidate ? -1 : best[i].index;  // -1: every score was NaN
  }
  return tokens;
}

}  // namespace

TORCH_LIBRARY_IMPL(flashsampling, CPU, m) { m.impl("sample", &sample_cpu); }

}  // namespace flashsampling
