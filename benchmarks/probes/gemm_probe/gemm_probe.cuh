// Plain CUTLASS GEMMs (no sampling) with the sampler's operands: out[B, V] = h[B, D] . W[V, D]^T
// in bf16, as torch.mm(h, W.t()) computes it. They measure what a mainloop of a given tile and
// cluster shape costs under the power cap beside cuBLAS (docs/controls.md), before any
// tile is built into the sampler. Torch-free; gemm_probe.py loads them through ctypes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace gemm_probe {

template <int M, int N, int K, int ClusterM, int ClusterN, bool kPingpong>
struct ProbeGemm {
  using Element = cutlass::bfloat16_t;
  using TileShape = cute::Shape<cute::Int<M>, cute::Int<N>, cute::Int<K>>;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  static constexpr int kAlignment = 8;
  // D column-major [V, B]: the same bytes as torch's row-major [B, V] result.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::ColumnMajor,
      kAlignment, Element, cutlass::layout::ColumnMajor, kAlignment,
      cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                          cutlass::epilogue::TmaWarpSpecializedCooperative>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlignment, Element,
      cutlass::layout::ColumnMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  // raster: 0 CUTLASS's heuristic, 1 along M (vocabulary tiles first), 2 along N (a vocabulary
  // tile's column tiles on neighbouring CTAs, as the sampler runs them).
  static typename Gemm::Arguments arguments(void const* weight, void const* hidden, void* out, int vocab, int batch,
                                            int dim, int raster) {
    using cute::make_shape;
    auto a = cutlass::make_cute_packed_stride(typename GemmKernel::StrideA{}, make_shape(vocab, dim, 1));
    auto b = cutlass::make_cute_packed_stride(typename GemmKernel::StrideB{}, make_shape(batch, dim, 1));
    auto c = cutlass::make_cute_packed_stride(typename GemmKernel::StrideC{}, make_shape(vocab, batch, 1));
    auto d = cutlass::make_cute_packed_stride(typename GemmKernel::StrideD{}, make_shape(vocab, batch, 1));
    cutlass::KernelHardwareInfo hw;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {vocab, batch, dim, 1},
                                  {static_cast<Element const*>(weight), a, static_cast<Element const*>(hidden), b},
                                  {{1.0f, 0.0f}, nullptr, c, static_cast<Element*>(out), d},
                                  hw};
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
