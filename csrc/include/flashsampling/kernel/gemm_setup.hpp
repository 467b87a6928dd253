/*! \file
  \brief The GEMM setup the sampler's kernels share with benchmarks/probes/gemm_probe.

  Every GEMM here computes logits[v, b] = W[v, :] . h[b, :] with the vocabulary on M and the
  batch (times the samples) on N: A = weight [V, D] and B = hidden [B, D], both K-major. The
  operands' layouts, strides and the problem shape serve every architecture;
  Sm90PersistentGemm assembles a persistent sm90 GEMM of CUTLASS's pingpong or cooperative
  schedule around an epilogue without C, so a probe of a tile or cluster shape measures the
  mainloop the sampler would run with it.
*/
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace flashsampling::kernel {

// A = weight [V, D] (M x K), B = hidden [B, D] (N x K): K-major both.
using WeightLayout = cutlass::layout::RowMajor;
using HiddenLayout = cutlass::layout::ColumnMajor;

// The operands' alignment in elements: 16 bytes, what TMA loads.
template <class Element>
inline constexpr int kOperandAlignment = 16 / sizeof(Element);

// (M, N, K, L) = (vocabulary, GEMM columns, hidden, 1).
using GemmProblemShape = cute::Shape<int, int, int, int>;

inline GemmProblemShape weight_hidden_problem_shape(int vocab, int columns, int hidden_dim) {
  return {vocab, columns, hidden_dim, 1};
}

// A = W, B = h: pointers and row strides (in elements; K-major both, one batch).
template <class Element, class GemmKernel, class MainloopArguments>
void fill_weight_hidden_operands(MainloopArguments& mainloop, void const* weight, int64_t weight_row_stride,
                                 void const* hidden, int64_t hidden_row_stride) {
  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  mainloop.ptr_A = static_cast<Element const*>(weight);
  mainloop.dA = StrideA{weight_row_stride, cute::_1{}, int64_t(0)};
  mainloop.ptr_B = static_cast<Element const*>(hidden);
  mainloop.dB = StrideB{hidden_row_stride, cute::_1{}, int64_t(0)};
}

// CUTLASS's persistent warp-specialised schedules on sm90: pingpong (the two consumer
// warpgroups take alternate tiles, so one's epilogue overlaps the other's mainloop) or
// cooperative (both on one tile).
template <bool kPingpong>
struct Sm90Schedule {
  using Kernel = cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                     cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using Epilogue = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                       cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

// The sm90 mainloop over W and h (TMA, wgmma, fp32 accumulators) with as many stages as fit
// beside kEpilogueSmemBytes of shared memory that the epilogue keeps for itself.
template <class Element, class TileShape, class ClusterShape, class KernelSchedule, int kEpilogueSmemBytes>
using Sm90WeightHiddenMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, WeightLayout, kOperandAlignment<Element>, Element,
    HiddenLayout, kOperandAlignment<Element>, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<kEpilogueSmemBytes>, KernelSchedule>::CollectiveOp;

// A persistent sm90 GEMM of one of CUTLASS's schedules: an epilogue without C that runs
// FusionOp and stores ElementD (void: nothing), and the mainloop in the shared memory it leaves.
template <class Element, class TileShape, class ClusterShape, bool kPingpong, class ElementD, class LayoutD,
          int kAlignmentD,
          class FusionOp = cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>
struct Sm90PersistentGemm {
  using Schedule = Sm90Schedule<kPingpong>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, LayoutD, kAlignmentD,  // no C
      ElementD, LayoutD, kAlignmentD, typename Schedule::Epilogue, FusionOp>::CollectiveOp;
  using CollectiveMainloop =
      Sm90WeightHiddenMainloop<Element, TileShape, ClusterShape, typename Schedule::Kernel,
                               static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<GemmProblemShape, CollectiveMainloop, CollectiveEpilogue,
                                                          cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

}  // namespace flashsampling::kernel
