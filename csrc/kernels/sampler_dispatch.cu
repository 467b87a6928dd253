// Host-side dispatch of the fused sampler: architecture, element type and batch
// bucket -> one pre-compiled config, then the stage-2 reduction.
#include <algorithm>
#include <cstdint>
#include <cstdlib>

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
template <class Element, int TileN, bool kPingpong>
ConfigEntry sm90_entry() {
  return {run_sampler_gemm_sm90<Element, TileN, kPingpong>, sampler_gemm_workspace_sm90<Element, TileN, kPingpong>,
          SamplerTileConfig<TileN, kPingpong>::kTileM};
}

// Measured on H200 (benchmarks/NOTES.md): narrow tiles are memory-bound and gain from
// pingpong, whose epilogue overlaps the other warpgroup's mainloop; the 128- and
// 256-wide tiles measured 13-30% faster cooperative (not yet profiled why).
template <class Element>
ConfigEntry select_sm90_config(int tile_n) {
  switch (tile_n) {
    case 16: return sm90_entry<Element, 16, /*kPingpong=*/true>();
    case 32: return sm90_entry<Element, 32, /*kPingpong=*/true>();
    case 64: return sm90_entry<Element, 64, /*kPingpong=*/true>();
    case 128: return sm90_entry<Element, 128, /*kPingpong=*/false>();
    default: return sm90_entry<Element, 256, /*kPingpong=*/false>();
  }
}
#endif

template <class Element>
ConfigEntry select_sm90(int tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  return select_sm90_config<Element>(tile_n);
#else
  (void)tile_n;
  return {nullptr, nullptr, 0};
#endif
}

#if defined(FLASHSAMPLING_ENABLE_SM100)
template <class Element, int TileN>
ConfigEntry sm100_entry() {
  return {run_sampler_gemm_sm100<Element, TileN>, sampler_gemm_workspace_sm100<Element, TileN>,
          SamplerTileConfig<TileN, false>::kTileM};
}
#endif

template <class Element>
ConfigEntry select_sm100(int tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM100)
  switch (tile_n) {
    case 16: return sm100_entry<Element, 16>();
    case 32: return sm100_entry<Element, 32>();
    case 64: return sm100_entry<Element, 64>();
    case 128: return sm100_entry<Element, 128>();
    default: return sm100_entry<Element, 256>();
  }
#else
  (void)tile_n;
  return {nullptr, nullptr, 0};
#endif
}

template <class Element>
ConfigEntry select_for_arch(int device_arch, int tile_n) {
  if (device_arch == 90) return select_sm90<Element>(tile_n);
  if (device_arch == 100) return select_sm100<Element>(tile_n);
  return {nullptr, nullptr, 0};
}

// Whether the epilogue runs its plain loop (the node's plain_pass(), seen from the host).
bool plain_sampling(SamplerParams const& p) {
  SamplingControls const& c = p.controls;
  return p.num_samples == 1 && !p.logprobs && c.temperatures == nullptr && c.logit_bias == nullptr &&
         c.allowed_mask == nullptr && c.sparse_ids == nullptr && p.noise.row_seeds == nullptr &&
         p.noise.row_offsets == nullptr;
}

// Widest N tile for the controls' (general) loop: its per-element code is large and the
// epilogue inlines it once per subtile, so wide tiles overflow the instruction cache.
// Measured on H200 (benchmarks/NOTES.md, v5d): 16 up to 64 columns, 32 beyond (all3 at
// B = 64: 1417 us uncapped, 803 capped at 16; B = 256: 2896 -> 2863 at 32, 3049 at 16).
// FLASHSAMPLING_GENERAL_TILE_N overrides it.
int64_t general_tile_n_cap(int64_t columns) {
  static int64_t const forced = [] {
    char const* env = std::getenv("FLASHSAMPLING_GENERAL_TILE_N");
    return env ? std::atoll(env) : int64_t{0};
  }();
  if (forced > 0) return forced;
  return columns <= 64 ? 16 : 32;
}

ConfigEntry select_config(SamplerParams const& p, int device_arch) {
  int64_t const columns = sampler_gemm_columns(p);
  int const tile_n =
      sampler_tile_n_for_batch(plain_sampling(p) ? columns : std::min<int64_t>(columns, general_tile_n_cap(columns)));
  return p.element_type == ElementType::kBFloat16 ? select_for_arch<cutlass::bfloat16_t>(device_arch, tile_n)
                                                  : select_for_arch<cutlass::half_t>(device_arch, tile_n);
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
  cudaError_t err = entry.run(p, buffers, static_cast<char*>(workspace) + layout.gemm, stream);
  if (err != cudaSuccess) return err;
  return launch_reduce_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), stream);
}

}  // namespace flashsampling
