// Standalone timing and A/B check of the logits sampler (csrc/kernels/sample_from_logits.cu),
// without torch: synthetic fp32 logits of both regimes (flat: N(0, 1); llm: a Zipf head of 32
// tokens over a N(0, 2.5^2) bulk, as flashsampling_cuda/problems.py's logits), the forms of
// benchmarks/bench_truncation.py, CUDA-event medians. Two builds of the kernel link in: the
// working tree's and a reference one (launch_sample_from_logits_reference, build.sh compiles it
// from a git revision), and every case compares their tokens, scores and log-probabilities bit
// for bit. Build and run: benchmarks/probes/logits_sampler/build.sh.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sample_from_logits.h"

namespace flashsampling {
cudaError_t launch_sample_from_logits_reference(const LogitsSamplerParams& params, int sm_count, cudaStream_t stream);
}
using namespace flashsampling;

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

__device__ __forceinline__ uint32_t mix(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__device__ __forceinline__ float normal(uint64_t i) {
  float const u1 = (mix(2 * i + 1) + 1.0f) * 2.3283064e-10f, u2 = mix(2 * i + 2) * 2.3283064e-10f;
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

// regime 0: flat, 1: llm (bulk), 2: tied (N(0, 1) rounded to multiples of 1/2: bins too full
// for the list, the kernel's fallback), 3: special (flat with every 7th logit -inf and every
// 1009th NaN).
__global__ void fill_logits(float* logits, int64_t batch, int64_t vocab, int regime, uint64_t seed) {
  int64_t const n = batch * vocab;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    float const z = normal(seed * 0x9E3779B97F4A7C15ull + i);
    logits[i] = regime == 1 ? 2.5f * z : regime == 2 ? 0.5f * rintf(2.0f * z) : z;
    if (regime == 3 && i % 7 == 3) logits[i] = -INFINITY;
    if (regime == 3 && i % 1009 == 5) logits[i] = NAN;
  }
}

// The llm regime's head: row b's tokens t_{b,r} (r = 1..32) get c_b - s_b ln r added.
__global__ void add_head(float* logits, int64_t vocab, uint64_t seed) {
  int64_t const b = blockIdx.x;
  int const r = threadIdx.x + 1;
  float const c = 12.0f + 10.0f * (mix(seed + 7 * b) * 2.3283064e-10f);
  float const s = 1.0f + 2.0f * (mix(seed + 7 * b + 3) * 2.3283064e-10f);
  int64_t const token = mix(seed * 31 + b * 977 + r) % vocab;
  atomicAdd(logits + b * vocab + token, c - s * logf(static_cast<float>(r)));
}

struct Form {
  const char* name;
  float temperature;
  int64_t top_k;  // per row when rows_k
  bool rows_k;
  double top_p;   // per row (when < 1)
  double min_p;   // per row (when > 0)
  bool mixed;     // per-row top_p / min_p from kMixedTopP / kMixedMinP (row b: entry b mod their sizes)
};

// Rows of the "mixed" forms: top_p off (1), first token only (0, NaN), min_p off (0), min_p that
// keeps only the first token (> 1, NaN).
static const double kMixedTopP[] = {0.9, 0.5, 1.0, 0.99, 0.0, 0.95, NAN};
static const double kMixedMinP[] = {0.0, 0.05, 0.0, 0.2, 0.0, 1e-4, 0.0, 2.0, NAN};

static const Form kForms[] = {
    {"k50 p0.9 [B]", 0.8f, 50, true, 0.9, 0.0},   {"k20 [B]", 0.8f, 20, true, 1.0, 0.0},
    {"p0.9 [B]", 0.8f, 0, false, 0.9, 0.0},       {"min_p0.05 [B]", 0.8f, 0, false, 1.0, 0.05},
    {"k1000 (int)", 0.8f, 1000, false, 1.0, 0.0}, {"qwen3 k20 p0.95 [B]", 0.6f, 20, true, 0.95, 0.0},
    {"k50 p0.9 min_p0.05", 1.0f, 50, true, 0.9, 0.05},
    // No top_k: the winner-first path's rows (sample_from_logits.cu, winner_first_row).
    {"p0.5 [B]", 1.0f, 0, false, 0.5, 0.0},       {"p0.9 min_p0.05 [B]", 1.0f, 0, false, 0.9, 0.05},
    {"greedy p0.9 [B]", 0.0f, 0, false, 0.9, 0.0}, {"mixed p / min_p [B]", 0.8f, 0, false, 0.9, 0.05, true},
};

struct Outputs {
  int64_t* tokens;
  float* scores;
  float* logprobs;
  float* lse;
};

int main(int argc, char** argv) {
  int64_t vocab = 151936;
  std::vector<int64_t> batches = {1, 16, 64, 256};
  int iters = 20;
  std::string only_form;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string const a = argv[i];
    if (a == "--vocab") vocab = std::atoll(argv[i + 1]);
    if (a == "--iters") iters = std::atoi(argv[i + 1]);
    if (a == "--form") only_form = argv[i + 1];
    if (a == "--batches") {
      batches.clear();
      for (char* t = std::strtok(argv[i + 1], ","); t; t = std::strtok(nullptr, ",")) batches.push_back(std::atoll(t));
    }
  }
  int const max_batch = *std::max_element(batches.begin(), batches.end());
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  float* logits;
  CHECK(cudaMalloc(&logits, sizeof(float) * max_batch * vocab));
  int64_t* ks;
  double *ps, *mps;
  CHECK(cudaMalloc(&ks, sizeof(int64_t) * max_batch));
  CHECK(cudaMalloc(&ps, sizeof(double) * max_batch));
  CHECK(cudaMalloc(&mps, sizeof(double) * max_batch));
  Outputs out[2];
  for (auto& o : out) {
    CHECK(cudaMalloc(&o.tokens, sizeof(int64_t) * max_batch));
    CHECK(cudaMalloc(&o.scores, sizeof(float) * max_batch));
    CHECK(cudaMalloc(&o.logprobs, sizeof(float) * max_batch));
    CHECK(cudaMalloc(&o.lse, sizeof(float) * max_batch));
  }
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::printf("%s, V = %lld, median of %d launches (us); ref = reference build, new = working tree\n", props.name,
              static_cast<long long>(vocab), iters);
  std::printf("| regime | B | form | ref us | new us | ref/new | same outputs |\n|---|---|---|---|---|---|---|\n");
  int mismatches = 0;
  // TIED=1 adds the tied regime, SPECIAL=1 the special one (-inf and NaN logits).
  std::vector<int> regimes = {0, 1};
  if (std::getenv("TIED")) regimes.push_back(2);
  if (std::getenv("SPECIAL")) regimes.push_back(3);
  for (int regime : regimes) {
    int const llm = regime == 1;
    for (int64_t batch : batches) {
      fill_logits<<<1024, 256>>>(logits, batch, vocab, regime, 17 + batch);
      if (llm) add_head<<<batch, 32>>>(logits, vocab, 5 + batch);
      CHECK(cudaGetLastError());
      for (Form const& f : kForms) {
        if (!only_form.empty() && only_form != f.name) continue;
        std::vector<int64_t> hk(batch, f.top_k);
        std::vector<double> hp(batch, f.top_p), hm(batch, f.min_p);
        for (int64_t b = 0; f.mixed && b < batch; ++b) {
          hp[b] = kMixedTopP[b % (sizeof(kMixedTopP) / sizeof(double))];
          hm[b] = kMixedMinP[b % (sizeof(kMixedMinP) / sizeof(double))];
        }
        CHECK(cudaMemcpy(ks, hk.data(), sizeof(int64_t) * batch, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(ps, hp.data(), sizeof(double) * batch, cudaMemcpyHostToDevice));
        CHECK(cudaMemcpy(mps, hm.data(), sizeof(double) * batch, cudaMemcpyHostToDevice));
        LogitsSamplerParams p;
        p.logits = logits;
        p.logits_row_stride = vocab;
        p.batch_size = batch;
        p.vocab_size = vocab;
        p.inv_temperature = fs_inv_temperature(f.temperature);
        if (f.rows_k) p.top_ks = ks; else p.top_k = f.top_k;
        if (f.top_p < 1.0) p.top_ps = ps;
        if (f.min_p > 0.0) p.min_ps = mps;
        p.noise.seed = 1234;
        double us[2];
        for (int which = 0; which < 2; ++which) {
          auto launch = which == 0 ? launch_sample_from_logits_reference : launch_sample_from_logits;
          // Outputs with log-probabilities (compared), then timing without them (as sample() calls it).
          p.tokens = out[which].tokens;
          p.scores = out[which].scores;
          p.token_logprobs = out[which].logprobs;
          p.logsumexp = out[which].lse;
          CHECK(launch(p, props.multiProcessorCount, 0));
          p.token_logprobs = nullptr;
          p.logsumexp = nullptr;
          std::vector<float> times;
          for (int i = 0; i < iters + 3; ++i) {
            CHECK(cudaEventRecord(start));
            CHECK(launch(p, props.multiProcessorCount, 0));
            CHECK(cudaEventRecord(stop));
            CHECK(cudaEventSynchronize(stop));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, start, stop));
            if (i >= 3) times.push_back(ms);
          }
          if (which == 1 && std::getenv("PHASES")) {  // one launch printing its phase times (FS_PHASE_TIMES build)
            p.empty_mask_token = -7;
            CHECK(launch(p, props.multiProcessorCount, 0));
            CHECK(cudaDeviceSynchronize());
            p.empty_mask_token = -1;
          }
          std::sort(times.begin(), times.end());
          us[which] = 1000.0 * times[times.size() / 2];
        }
        CHECK(cudaDeviceSynchronize());
        // Tokens and scores bit for bit; log-probabilities to 1e-5 (a survivor's mass may be
        // summed in another order), and NaN where the reference has NaN. The tokens and scores
        // compared are the last timed launch's (without log-probabilities: the winner-first path
        // where it applies), the log-probabilities the first launch's (with them: the cut path).
        bool same = true;
        auto fetch = [&](auto member, auto& a, auto& b) {
          a.resize(batch);
          b.resize(batch);
          CHECK(cudaMemcpy(a.data(), out[0].*member, sizeof(a[0]) * batch, cudaMemcpyDeviceToHost));
          CHECK(cudaMemcpy(b.data(), out[1].*member, sizeof(b[0]) * batch, cudaMemcpyDeviceToHost));
        };
        std::vector<int64_t> ta, tb;
        fetch(&Outputs::tokens, ta, tb);
        same = same && ta == tb;
        std::vector<float> fa, fb;
        fetch(&Outputs::scores, fa, fb);
        same = same && std::memcmp(fa.data(), fb.data(), sizeof(float) * batch) == 0;
        double worst = 0.0;
        for (auto member : {&Outputs::logprobs, &Outputs::lse}) {
          fetch(member, fa, fb);
          for (int64_t i = 0; i < batch; ++i) {
            if (std::isnan(fa[i]) != std::isnan(fb[i])) same = false;
            else if (!std::isnan(fa[i]) && fa[i] != fb[i]) worst = std::max(worst, std::fabs(double(fa[i]) - fb[i]));
          }
        }
        same = same && worst <= 1e-5;
        mismatches += !same;
        std::printf("| %s | %lld | %s | %.1f | %.1f | %.2f | %s%s |\n", regime == 3 ? "special" : regime == 2 ? "tied" : llm ? "llm" : "flat",
                    static_cast<long long>(batch), f.name, us[0], us[1], us[0] / us[1], same ? "yes" : "NO",
                    worst > 0 ? " (logprobs within 1e-5)" : "");
        std::fflush(stdout);
      }
    }
  }
  std::printf("%d case(s) with different outputs\n", mismatches);
  return mismatches != 0;
}
