// Plain CUTLASS GEMMs (no sampling) with the sampler's operands: out[B, V] = h[B, D] . W[V, D]^T
// in bf16, as torch.mm(h, W.t()) computes it. They measure what a mainloop of a given tile and
// cluster shape costs under the power cap beside cuBLAS (docs/controls.md), before any
// tile is built into the sampler. Torch-free; gemm_probe.py loads them through ctypes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cutlass/cutlass.h"
#include "cutlass/util/packed_stride.hpp"

#include "flashsampling/kernel/gemm_setup.hpp"

namespace gemm_probe {

// The sampler's sm90 GEMM (kernel/gemm_setup.hpp) with CUTLASS's linear-combination epilogue
// in place of the sampling node.
template <int M, int N, int K, int ClusterM, int ClusterN, bool kPingpong>
struct ProbeGemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  // D column-major [V, B]: the same bytes as torch's row-major [B, V] result.
  using Setup = flashsampling::kernel::Sm90PersistentGemm<Element, TileShape, ClusterShape, kPingpong, Element,
                                                          cutlass::layout::ColumnMajor,
                                                          flashsampling::kernel::kOperandAlignment<Element>>;
  using GemmKernel = typename Setup::GemmKernel;
  using Gemm = typename Setup::Gemm;

  // raster: 0 CUTLASS's heuristic, 1 along M (vocabulary tiles first), 2 along N (a vocabulary
  // tile's column tiles on neighbouring CTAs, as the sampler runs them).
  static typename Gemm::Arguments arguments(void const* weight, void const* hidden, void* out, int vocab, int batch,
                                            int dim, int raster) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = flashsampling::kernel::weight_hidden_problem_shape(vocab, batch, dim);
    flashsampling::kernel::fill_weight_hidden_operands<Element, GemmKernel>(args.mainloop, weight, dim, hidden, dim);
    auto const c = cutlass::make_cute_packed_stride(typename GemmKernel::StrideC{}, cute::make_shape(vocab, batch, 1));
    auto const d = cutlass::make_cute_packed_stride(typename GemmKernel::StrideD{}, cute::make_shape(vocab, batch, 1));
    args.epilogue = {{1.0f, 0.0f}, nullptr, c, static_cast<Element*>(out), d};
    cudaGetDevice(&args.hw_info.device_id);
    args.hw_info.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(args.hw_info.device_id);
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
    return args;
  }

  // Returns 0 or a CUTLASS status / CUDA error code. workspace == nullptr: only its size.
  static int run(void const* weight, void const* hidden, void* out, int vocab, int batch, int dim, int raster,
                 void* workspace, size_t* workspace_bytes, cudaStream_t stream) {
    auto args = arguments(weight, hidden, out, vocab, batch, dim, raster);
    if (workspace == nullptr) {
      *workspace_bytes = Gemm::get_workspace_size(args);
      return 0;
    }
    Gemm gemm;
    cutlass::Status status = gemm.can_implement(args);
    if (status != cutlass::Status::kSuccess) return 1000 + int(status);
    status = gemm.initialize(args, workspace, stream);
    if (status != cutlass::Status::kSuccess) return 2000 + int(status);
    status = gemm.run(stream);
    if (status != cutlass::Status::kSuccess) return 3000 + int(status);
    return int(cudaGetLastError());
  }
};

}  // namespace gemm_probe

// One exported entry point per config file: gemm_probe_<name>(...).
#define GEMM_PROBE_DEFINE(name, M, N, K, ClusterM, ClusterN, Pingpong)                                            \
  extern "C" int gemm_probe_##name(void const* weight, void const* hidden, void* out, int vocab, int batch,     \
                                   int dim, int raster, void* workspace, size_t* workspace_bytes,               \
                                   cudaStream_t stream) {                                                       \
    return gemm_probe::ProbeGemm<M, N, K, ClusterM, ClusterN, Pingpong>::run(weight, hidden, out, vocab, batch, \
                                                                           dim, raster, workspace,              \
                                                                           workspace_bytes, stream);            \
  }
