// Host-side dispatch of the fused sampler: architecture, element type and batch
// bucket -> one pre-compiled config, then the stage-2 reduction.
#include <cstdint>

#include "cutlass/numeric_types.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

struct ConfigEntry {
  cudaError_t (*run)(SamplerParams const&, PackedCandidate*, void*, cudaStream_t);
  size_t (*gemm_workspace)(SamplerParams const&);
};

template <class Element>
ConfigEntry select_sm90(int tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  switch (tile_n) {
    case 16: return {run_sampler_gemm_sm90<Element, 16>, sampler_gemm_workspace_sm90<Element, 16>};
    case 32: return {run_sampler_gemm_sm90<Element, 32>, sampler_gemm_workspace_sm90<Element, 32>};
    case 64: return {run_sampler_gemm_sm90<Element, 64>, sampler_gemm_workspace_sm90<Element, 64>};
    case 128: return {run_sampler_gemm_sm90<Element, 128>, sampler_gemm_workspace_sm90<Element, 128>};
    default: return {run_sampler_gemm_sm90<Element, 256>, sampler_gemm_workspace_sm90<Element, 256>};
  }
#else
  (void)tile_n;
  return {nullptr, nullptr};
#endif
}

template <class Element>
ConfigEntry select_sm100(int tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM100)
  switch (tile_n) {
    case 16: return {run_sampler_gemm_sm100<Element, 16>, sampler_gemm_workspace_sm100<Element, 16>};
    case 32: return {run_sampler_gemm_sm100<Element, 32>, sampler_gemm_workspace_sm100<Element, 32>};
    case 64: return {run_sampler_gemm_sm100<Element, 64>, sampler_gemm_workspace_sm100<Element, 64>};
    case 128: return {run_sampler_gemm_sm100<Element, 128>, sampler_gemm_workspace_sm100<Element, 128>};
    default: return {run_sampler_gemm_sm100<Element, 256>, sampler_gemm_workspace_sm100<Element, 256>};
  }
#else
  (void)tile_n;
  return {nullptr, nullptr};
#endif
}

template <class Element>
ConfigEntry select_for_arch(int device_arch, int tile_n) {
  if (device_arch == 90) return select_sm90<Element>(tile_n);
  if (device_arch == 100) return select_sm100<Element>(tile_n);
  return {nullptr, nullptr};
}

ConfigEntry select_config(SamplerParams const& p, int device_arch) {
  int const tile_n = sampler_tile_n_for_batch(p.batch_size);
  return p.element_type == ElementType::kBFloat16 ? select_for_arch<cutlass::bfloat16_t>(device_arch, tile_n)
                                                  : select_for_arch<cutlass::half_t>(device_arch, tile_n);
}

size_t round_up_256(size_t bytes) { return (bytes + 255) / 256 * 256; }

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
  return round_up_256(candidate_bytes(p)) + entry.gemm_workspace(p);
}

cudaError_t launch_sampler(SamplerParams const& p, void* workspace, size_t workspace_bytes, int device_arch,
                           cudaStream_t stream) {
  ConfigEntry const entry = select_config(p, device_arch);
  if (entry.run == nullptr) return cudaErrorNotSupported;
  if (p.batch_size == 0) return cudaSuccess;
  size_t const candidates_size = round_up_256(candidate_bytes(p));
  if (workspace_bytes < candidates_size + entry.gemm_workspace(p)) return cudaErrorInvalidValue;
  auto* candidates = static_cast<PackedCandidate*>(workspace);
  void* gemm_workspace = static_cast<char*>(workspace) + candidates_size;
  cudaError_t err = entry.run(p, candidates, gemm_workspace, stream);
  if (err != cudaSuccess) return err;
  return launch_reduce_candidates(candidates, num_vocab_tiles(p), p.batch_size, p.num_samples, p.tokens, stream);
}

}  // namespace flashsampling
