// The fused sampling GEMM for Blackwell (sm100a) -- tcgen05 with TMEM accumulators, 1-SM MMA: CUTLASS collective builder, TMA,
// warp-specialised persistent schedule, and the Gumbel-argmax EVT node as the
// whole epilogue.
//
// Included only by the small per-config instantiation files
// instantiations/sampler_<dtype>_n<N>_<loop>_sm100.cu (written by generate_kernels.py), so
// each config compiles in its own process.
#pragma once

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

#include "flashsampling/epilogue/sm90_visitor_gumbel_argmax.hpp"
#include "sampler_gemm_common.cuh"

namespace flashsampling {

template <class Element, int TileN, SamplerLoop kLoop>
struct SamplerGemmSm100 {
  using Config = SamplerTileConfig<TileN, /*kPingpong=*/false>;
  // One 128-row tcgen05 MMA per CTA (1-SM); the vocabulary tile matches sm90.
  using TileShape = cute::Shape<cute::Int<Config::kTileM>, cute::Int<TileN>, cute::Int<Config::kTileK>>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignment = kernel::kOperandAlignment<Element>;

  // Sm90 EVT nodes serve both architectures (the sm100 collective reuses them).
  using FusionCallbacks = cutlass::epilogue::fusion::Sm90EVT<
      epilogue::Sm90GumbelArgmaxRowReduction<TileShape, SamplerScratchD, kLoop>, cutlass::epilogue::fusion::Sm90AccFetch>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, cutlass::layout::RowMajor, kAlignment,  // no C
      // CUTLASS 4.2's sm100 epilogues have no void-D path (the sm90 one does), so the
      // tree's pass-through output lands in a 1-byte scratch D: V*B bytes, 1/(2D) of
      // the weight traffic. The sampled logits themselves never leave the chip.
      SamplerScratchD, cutlass::layout::ColumnMajor, 16,
      cutlass::epilogue::TmaWarpSpecialized1Sm, FusionCallbacks>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, Element, kernel::WeightLayout, kAlignment, Element,
      kernel::HiddenLayout, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecialized1SmSm100>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, CollectiveMainloop,
                                                          CollectiveEpilogue, void>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Launcher = SamplerGemmLauncher<Gemm, Element, Config::kTileM, /*kScratchD=*/true>;
};

template <class Element, int TileN, SamplerLoop kLoop>
cudaError_t run_sampler_gemm_sm100(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                                  cudaStream_t stream) {
  return SamplerGemmSm100<Element, TileN, kLoop>::Launcher::run(p, buffers, gemm_workspace, stream);
}

template <class Element, int TileN, SamplerLoop kLoop>
size_t sampler_gemm_workspace_sm100(SamplerParams const& p) {
  return SamplerGemmSm100<Element, TileN, kLoop>::Launcher::gemm_workspace_bytes(p);
}

#define FLASHSAMPLING_INSTANTIATE_SM100(Element, TileN, kLoop)                                        \
  template cudaError_t run_sampler_gemm_sm100<Element, TileN, kLoop>(SamplerParams const&,                  \
                                                                        SamplerBuffers const&, void*, cudaStream_t); \
  template size_t sampler_gemm_workspace_sm100<Element, TileN, kLoop>(SamplerParams const&);

}  // namespace flashsampling
