// The key search's kernels alone (csrc/kernels/key_search.cu), no torch: deterministic rows, each
// search form run back to back in a stream, the median time, a digest of its keys / masks (equal
// digests: equal results), and at B = 64 and 256 each round's time. For an A/B, build one binary
// per copy of the kernel file and compare their lines (probe, not a benchmark):
//   CUT=$(python -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))")/source
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -I csrc/include -I csrc/kernels \
//     -I $CUT/include -DKS_SRC='"../../csrc/kernels/key_search.cu"' -o key_search_bench benchmarks/probes/key_search_bench.cu
// (KS_SRC is included from this file's folder.) Output: "regime B=.. form us T digest D found/pop N key0 K".
#ifndef KS_SRC
#define KS_SRC "../../csrc/kernels/key_search.cu"
#endif
#include KS_SRC
#include <cstdio>
#include <vector>
#include <algorithm>
#include <cstring>
#include <cmath>
using namespace flashsampling;
constexpr int kPlanes = kKeySearchPlanes;
static int g_sms = 1;  // the device's SM count, read once in main
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__device__ uint32_t hash32(uint32_t x) { x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16; return x; }
__global__ void gen(float* y, int64_t V, int llm, uint32_t salt) {
  int64_t row = blockIdx.y;
  for (int64_t v = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; v < V; v += (int64_t)gridDim.x * blockDim.x) {
    uint32_t h1 = hash32((uint32_t)(row * 2654435761u) ^ (uint32_t)v ^ salt), h2 = hash32(h1 + 0x9e3779b9u);
    float u1 = (h1 >> 8) * (1.0f / 16777216.0f) + 1e-7f, u2 = (h2 >> 8) * (1.0f / 16777216.0f);
    float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    y[row * V + v] = llm ? z : 1.25f * z;
  }
}
__global__ void peaks(float* y, int64_t V) {
  int64_t row = blockIdx.x; int r = threadIdx.x + 1;
  int64_t v = (row * 7919 + r * 4099) % V;
  y[row * V + v] = 14.0f - 2.0f * logf((float)r) + (row % 5) * 0.5f;
}

struct Bufs { int64_t *state[2], *hist[2], *first, *cut_k, *cut_p, *k, *limit; double *p, *minp; float* y0; uint32_t* mask; };

// a search: returns the final state buffer index
static int search(KeySearchRows const& rows, Bufs& b, bool by_mass, const int64_t* limit, const double* minps, cudaStream_t st) {
  int B = rows.batch_size; int cur = 0; bool first_round = true;
  for (int shift = 56; shift >= -8; shift -= 8) {
    KeySearchRound q; q.rows = rows; q.shift = shift;
    if (by_mass) { q.top_ps = b.p; q.y0 = b.y0; q.min_ps = minps; q.first = minps ? b.first : nullptr; } else q.top_ks = b.k;
    q.limit = limit;
    int out = first_round ? 0 : 1 - cur;
    q.state_in = first_round ? nullptr : b.state[cur];
    q.hist_in = first_round ? nullptr : b.hist[cur];
    q.state_out = b.state[out];
    if (shift >= 0) { CK(cudaMemsetAsync(b.hist[out], 0, sizeof(int64_t) * B * kPlanes * 256, st)); q.hist_out = (unsigned long long*)b.hist[out]; }
    CK(launch_key_search_round(q, g_sms, st));
    cur = out; first_round = false;
  }
  return cur;
}

static void detail(KeySearchRows const& rows, Bufs& b, bool by_mass, cudaStream_t st, const char* tag) {
  int B = rows.batch_size; const int reps = 10; std::vector<double> acc(10, 0.0);
  cudaEvent_t ev[11]; for (auto& e : ev) cudaEventCreate(&e);
  for (int rep = 0; rep < reps + 1; ++rep) {
    int cur = 0; bool first_round = true; int n = 0;
    for (int shift = 56; shift >= -8; shift -= 8, ++n) {
      KeySearchRound q; q.rows = rows; q.shift = shift;
      if (by_mass) { q.top_ps = b.p; q.y0 = b.y0; } else q.top_ks = b.k;
      int out = first_round ? 0 : 1 - cur;
      q.state_in = first_round ? nullptr : b.state[cur];
      q.hist_in = first_round ? nullptr : b.hist[cur];
      q.state_out = b.state[out];
      if (shift >= 0) { CK(cudaMemsetAsync(b.hist[out], 0, sizeof(int64_t) * B * kPlanes * 256, st)); q.hist_out = (unsigned long long*)b.hist[out]; }
      CK(cudaEventRecord(ev[n], st));
      CK(launch_key_search_round(q, g_sms, st));
      cur = out; first_round = false;
    }
    CK(cudaEventRecord(ev[n], st)); CK(cudaEventSynchronize(ev[n]));
    if (rep > 0) for (int i = 0; i < n; ++i) { float ms; cudaEventElapsedTime(&ms, ev[i], ev[i + 1]); acc[i] += ms * 1000 / reps; }
  }
  printf("%s rounds us:", tag); for (int i = 0; i < 9; ++i) printf(" %.1f", acc[i]); printf("\n");
  std::vector<int64_t> s(B * kKeySearchStateWords);
}

int main(int argc, char** argv) {
  int64_t V = 151936; std::vector<int> batches = {1, 16, 64, 256};
  int reps = 20;
  CK(cudaDeviceGetAttribute(&g_sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t st; CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int llm = 0; llm < 2; ++llm) for (int B : batches) {
    float* y; CK(cudaMalloc(&y, sizeof(float) * B * V));
    gen<<<dim3(64, B), 256>>>(y, V, llm, 12345); if (llm) peaks<<<B, 32>>>(y, V);
    Bufs b; for (int i = 0; i < 2; ++i) { CK(cudaMalloc(&b.state[i], 8 * B * 8)); CK(cudaMalloc(&b.hist[i], 8 * B * 3 * 256)); }
    CK(cudaMalloc(&b.first, 8 * B)); CK(cudaMalloc(&b.cut_k, 8 * B * 8)); CK(cudaMalloc(&b.k, 8 * B)); CK(cudaMalloc(&b.p, 8 * B)); CK(cudaMalloc(&b.minp, 8 * B)); CK(cudaMalloc(&b.y0, 4 * B));
    int64_t words = (V + 31) / 32; CK(cudaMalloc(&b.mask, 4 * B * words));
    std::vector<int64_t> hk(B); std::vector<double> hp(B), hm(B);
    for (int i = 0; i < B; ++i) { hk[i] = 20 + (i % 3) * 15; hp[i] = 0.9 - 0.05 * (i % 3); hm[i] = 0.05; }
    CK(cudaMemcpy(b.k, hk.data(), 8 * B, cudaMemcpyHostToDevice)); CK(cudaMemcpy(b.p, hp.data(), 8 * B, cudaMemcpyHostToDevice)); CK(cudaMemcpy(b.minp, hm.data(), 8 * B, cudaMemcpyHostToDevice));
    KeySearchRows rows; rows.y = y; rows.row_stride = V; rows.batch_size = B; rows.vocab_size = V; rows.vocab_start = 0; rows.mask_words = words;
    auto first_keys = [&] { std::vector<int64_t> f(B, INT64_MAX); CK(cudaMemcpyAsync(b.first, f.data(), 8 * B, cudaMemcpyHostToDevice, st)); CK(launch_first_order_keys(rows, b.first, g_sms, st)); };
    first_keys(); CK(cudaStreamSynchronize(st));
    std::vector<int64_t> hf(B); CK(cudaMemcpy(hf.data(), b.first, 8 * B, cudaMemcpyDeviceToHost));
    std::vector<float> hy0(B); for (int i = 0; i < B; ++i) CK(cudaMemcpy(&hy0[i], y + i * V + (hf[i] & 0x7FFFFFFF), 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.y0, hy0.data(), 4 * B, cudaMemcpyHostToDevice));
    if (B == 64 || B == 256) { char tag[64]; snprintf(tag, 64, "%s B=%d k", llm ? "llm" : "flat", B); detail(rows, b, false, st, tag);
                   snprintf(tag, 64, "%s B=%d p", llm ? "llm" : "flat", B); detail(rows, b, true, st, tag); }
    const char* forms[] = {"first", "k[B]", "p[B]", "k,p[B]", "min_p", "mask"};
    for (int f = 0; f < 6; ++f) {
      std::vector<int64_t> keys(B, 0); int found_sum = 0;
      auto run = [&]() {
        int s;
        switch (f) {
          case 0: first_keys(); break;
          case 1: s = search(rows, b, false, nullptr, nullptr, st); CK(cudaMemcpyAsync(b.cut_k, b.state[s], 8 * B * kKeySearchStateWords, cudaMemcpyDeviceToDevice, st)); break;
          case 2: s = search(rows, b, true, nullptr, nullptr, st); CK(cudaMemcpyAsync(b.cut_k, b.state[s], 8 * B * kKeySearchStateWords, cudaMemcpyDeviceToDevice, st)); break;
          case 3: { s = search(rows, b, false, nullptr, nullptr, st);
                    // limit = the k search's keys (found everywhere here): column 0 of the state
                    static int64_t* lim = nullptr; if (!lim) CK(cudaMalloc(&lim, 8 * 256));
                    CK(cudaMemcpy2DAsync(lim, 8, b.state[s], 8 * kKeySearchStateWords, 8, B, cudaMemcpyDeviceToDevice, st));
                    s = search(rows, b, true, lim, nullptr, st); CK(cudaMemcpyAsync(b.cut_k, b.state[s], 8 * B * kKeySearchStateWords, cudaMemcpyDeviceToDevice, st)); break; }
          case 4: case 5: {
            KeyCutMask c; c.rows = rows; c.cut = b.cut_k; c.first = b.first; c.y0 = b.y0; c.min_ps = f == 4 ? b.minp : nullptr; c.mask = b.mask;
            static int64_t* none = nullptr; if (!none) { CK(cudaMalloc(&none, 8 * 256)); std::vector<int64_t> n(256, INT64_MAX); CK(cudaMemcpy(none, n.data(), 8 * 256, cudaMemcpyHostToDevice)); }
            if (f == 4) c.cut = none; else { /* cut = k [B] search's key from form 1's state copy: recompute */ }
            CK(launch_key_cut_mask(c, g_sms, st)); break; }
        }
      };
      if (f == 5) { int s = search(rows, b, false, nullptr, nullptr, st); CK(cudaMemcpy2DAsync(b.cut_k, 8, b.state[s], 8 * kKeySearchStateWords, 8, B, cudaMemcpyDeviceToDevice, st)); }
      run(); CK(cudaStreamSynchronize(st));
      // results
      unsigned long long digest = 1469598103934665603ull;
      if (f == 0) { CK(cudaMemcpy(keys.data(), b.first, 8 * B, cudaMemcpyDeviceToHost)); for (auto k : keys) digest = (digest ^ (unsigned long long)k) * 1099511628211ull; }
      else if (f <= 3) { std::vector<int64_t> s(B * kKeySearchStateWords); CK(cudaMemcpy(s.data(), b.cut_k, 8 * B * kKeySearchStateWords, cudaMemcpyDeviceToHost));
        for (int i = 0; i < B; ++i) { digest = (digest ^ (unsigned long long)s[i * kKeySearchStateWords]) * 1099511628211ull; found_sum += s[i * kKeySearchStateWords + 3] == 1; keys[i] = s[i * kKeySearchStateWords]; } }
      else { std::vector<uint32_t> m(B * words); CK(cudaMemcpy(m.data(), b.mask, 4 * B * words, cudaMemcpyDeviceToHost)); long long pop = 0;
        for (auto w : m) { digest = (digest ^ w) * 1099511628211ull; pop += __builtin_popcount(w); } found_sum = (int)(pop / B); }
      std::vector<float> t;
      for (int r = 0; r < 5; ++r) {
        CK(cudaEventRecord(e0, st)); for (int i = 0; i < reps; ++i) run(); CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1));
        float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms * 1000 / reps);
      }
      std::sort(t.begin(), t.end());
      printf("%s B=%d %-8s us %8.1f digest %016llx found/pop %d key0 %lld\n", llm ? "llm " : "flat", B, forms[f], t[2], digest, found_sum, (long long)keys[0]);
    }
    cudaFree(y); for (int i = 0; i < 2; ++i) { cudaFree(b.state[i]); cudaFree(b.hist[i]); }
    cudaFree(b.first); cudaFree(b.cut_k); cudaFree(b.k); cudaFree(b.p); cudaFree(b.minp); cudaFree(b.y0); cudaFree(b.mask);
  }
  return 0;
}
