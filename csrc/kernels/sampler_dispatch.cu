// Host-side dispatch of the fused sampler: architecture, element type and batch
// bucket -> one pre-compiled config, then the stage-2 reduction.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cutlass/numeric_types.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

struct ConfigEntry {
  cudaError_t (*run)(SamplerParams const&, SamplerBuffers const&, void*, cudaStream_t);
  size_t (*gemm_workspace)(SamplerParams const&);
  int vocab_tile;  // M extent of one candidate row
};

#if defined(FLASHSAMPLING_ENABLE_SM90)
template <class Element, int TileN, bool kPingpong, bool kControls, int kClusterM = 1>
ConfigEntry sm90_entry() {
  return {run_sampler_gemm_sm90<Element, TileN, kPingpong, kControls, kClusterM>,
          sampler_gemm_workspace_sm90<Element, TileN, kPingpong, kControls, kClusterM>,
          SamplerTileConfig<TileN, kPingpong>::kTileM};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM100)
template <class Element, int TileN, bool kControls>
ConfigEntry sm100_entry() {
  return {run_sampler_gemm_sm100<Element, TileN, kControls>, sampler_gemm_workspace_sm100<Element, TileN, kControls>,
          SamplerTileConfig<TileN, false>::kTileM};
}
#endif

// Plain sampling, one config per batch bucket (`columns` GEMM columns, tile_n wide). Measured
// on H200 (benchmarks/NOTES.md, v9): the pingpong schedule, whose epilogue overlaps the other
// warpgroup's mainloop, for one N tile, in clusters of two CTAs sharing each hidden tile by
// multicast from N = 32 on (4% faster at B = 32 and 64 than one CTA per cluster; at N = 16
// clusters were 6-8% slower at B = 1-8; at B = 128, D = 8192, 9-11% faster than the
// cooperative tile, at D = 4096 0-7%). With more columns than one 128-wide
// tile, the cooperative schedule, one CTA per cluster: pingpong + clusters measured 16% slower
// at B = 256, D = 4096 (5% faster at D = 8192).
template <class Element>
ConfigEntry select_plain(int device_arch, int tile_n, int64_t columns) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (device_arch == 90) {
    switch (tile_n) {
      case 16: return sm90_entry<Element, 16, /*kPingpong=*/true, false>();
      case 32: return sm90_entry<Element, 32, true, false, /*kClusterM=*/2>();
      case 64: return sm90_entry<Element, 64, true, false, 2>();
      default:
        return columns <= 128 ? sm90_entry<Element, 128, true, false, 2>() : sm90_entry<Element, 128, false, false>();
    }
  }
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (device_arch == 100) {
    switch (tile_n) {
      case 16: return sm100_entry<Element, 16, false>();
      case 32: return sm100_entry<Element, 32, false>();
      case 64: return sm100_entry<Element, 64, false>();
      default: return sm100_entry<Element, 128, false>();
    }
  }
#endif
  (void)device_arch;
  (void)tile_n;
  (void)columns;
  return {nullptr, nullptr, 0};
}

// The controls' loop is compiled for N = 16 and 32 only: wider tiles measured slower
// (general_tile_n_cap).
template <class Element>
ConfigEntry select_controls(int device_arch, int tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (device_arch == 90) {
    return tile_n <= 16 ? sm90_entry<Element, 16, /*kPingpong=*/true, true>() : sm90_entry<Element, 32, true, true>();
  }
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (device_arch == 100) {
    return tile_n <= 16 ? sm100_entry<Element, 16, true>() : sm100_entry<Element, 32, true>();
  }
#endif
  (void)device_arch;
  (void)tile_n;
  return {nullptr, nullptr, 0};
}

// Widest N tile for the controls' loop. Its per-element code is large and the epilogue
// inlines it once per subtile; narrow tiles re-read W from L2 once per N tile instead.
// Measured on H200 (benchmarks/NOTES.md, v5e, separate controls kernels, all3 / temps
// alone, us): B = 32: N 16 453 / 299, N 32 484 / 307; B = 64: N 16 761 / 513, N 32
// 753 / 446, N 64 1280 / 927; B = 128: N 32 1390, N 128 1421. So 16 up to 32 columns,
// 32 beyond. FLASHSAMPLING_GENERAL_TILE_N = 16 or 32 overrides it.
int64_t general_tile_n_cap(int64_t columns) {
  static int64_t const forced = [] {
    char const* env = std::getenv("FLASHSAMPLING_GENERAL_TILE_N");
    return env ? std::atoll(env) : int64_t{0};
  }();
  if (forced == 16 || forced == 32) return forced;
  return columns <= 32 ? 16 : 32;
}

// FLASHSAMPLING_PLAIN_TILE_N = 16, 32 or 64 caps the plain passes' N tile (for A/B runs;
// wider batches then run several N tiles).
int64_t plain_tile_n_cap() {
  static int64_t const forced = [] {
    char const* env = std::getenv("FLASHSAMPLING_PLAIN_TILE_N");
    int64_t const n = env ? std::atoll(env) : int64_t{0};
    return n == 16 || n == 32 || n == 64 ? n : int64_t{128};
  }();
  return forced;
}

ConfigEntry select_config(SamplerParams const& p, int device_arch) {
  int64_t const columns = sampler_gemm_columns(p);
  bool const bf16 = p.element_type == ElementType::kBFloat16;
  if (is_plain_sampling(p.controls, p.noise, p.num_samples, p.logprobs)) {
    int const tile_n = sampler_tile_n_for_batch(std::min<int64_t>(columns, plain_tile_n_cap()));
    return bf16 ? select_plain<cutlass::bfloat16_t>(device_arch, tile_n, columns)
                : select_plain<cutlass::half_t>(device_arch, tile_n, columns);
  }
  int const tile_n = sampler_tile_n_for_batch(std::min<int64_t>(columns, general_tile_n_cap(columns)));
  return bf16 ? select_controls<cutlass::bfloat16_t>(device_arch, tile_n)
              : select_controls<cutlass::half_t>(device_arch, tile_n);
}

}  // namespace

const char* sampler_compiled_archs() {
#if defined(FLASHSAMPLING_ENABLE_SM90) && defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm90a,sm100a";
#elif defined(FLASHSAMPLING_ENABLE_SM90)
  return "sm90a";
#elif defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm100a";
#else
  return "";
#endif
}

size_t sampler_workspace_bytes(SamplerParams const& p, int device_arch) {
  ConfigEntry const entry = select_config(p, device_arch);
  if (entry.run == nullptr) return 0;
  return SamplerWorkspaceLayout(p, entry.vocab_tile, entry.gemm_workspace(p)).total;
}

cudaError_t launch_sampler(SamplerParams const& params, void* workspace, size_t workspace_bytes, int device_arch,
                           cudaStream_t stream) {
  ConfigEntry const entry = select_config(params, device_arch);
  if (entry.run == nullptr) return cudaErrorNotSupported;
  if (params.batch_size == 0) return cudaSuccess;
  SamplerWorkspaceLayout const layout(params, entry.vocab_tile, entry.gemm_workspace(params));
  if (workspace_bytes < layout.total) return cudaErrorInvalidValue;
  SamplerBuffers const buffers = layout.buffers(params, workspace);
  SamplerParams p = params;
  if (buffers.sparse_bitmap != nullptr) {
    cudaError_t err = launch_build_sparse_bitmap(p, buffers.sparse_bitmap, stream);
    if (err != cudaSuccess) return err;
    p.controls.sparse_bitmap = buffers.sparse_bitmap;
  }
  if (buffers.inv_temperatures != nullptr) {
    cudaError_t err = launch_inv_temperatures(p, buffers.inv_temperatures, stream);
    if (err != cudaSuccess) return err;
    p.controls.inv_temperatures = buffers.inv_temperatures;
  }
  cudaError_t err = entry.run(p, buffers, static_cast<char*>(workspace) + layout.gemm, stream);
  if (err != cudaSuccess) return err;
  return launch_reduce_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), stream);
}

}  // namespace flashsampling
