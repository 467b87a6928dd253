// The fused sampling GEMM for Hopper (sm90a) -- wgmma, pingpong or cooperative
// schedule: CUTLASS collective builder, TMA,
// warp-specialised persistent schedule, and the Gumbel-argmax EVT node as the
// whole epilogue (ElementD = void: no logits are stored).
//
// Included only by the small per-config instantiation files
// instantiations/sampler_<dtype>_n<N>_<loop>_<schedule>[_cluster_m2|_cluster_n2]_sm90.cu
// (written by generate_kernels.py), so each config compiles in its own process.
#pragma once

#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"

#include "cutlass/cluster_launch.hpp"
#include "cutlass/device_kernel.h"

#include "flashsampling/epilogue/sm90_visitor_gumbel_argmax.hpp"
#include "flashsampling/kernel/gemm_setup.hpp"
#include "flashsampling/kernel/sm90_sampler_epilogue_warpgroups.hpp"
#include "sampler_gemm_common.cuh"

namespace flashsampling {

// kClusterM = 2: two CTAs on neighbouring vocabulary tiles form a cluster and receive
// each hidden tile by TMA multicast, halving its L2 -> SM traffic.
template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM = 1>
struct SamplerGemmSm90 {
  using Config = SamplerTileConfig<TileN, kPingpong>;
  using TileShape = cute::Shape<cute::Int<Config::kTileM>, cute::Int<TileN>, cute::Int<Config::kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::_1, cute::_1>;

  // Sm90 EVT nodes serve both architectures (the sm100 collective reuses them).
  using FusionCallbacks = cutlass::epilogue::fusion::Sm90EVT<
      epilogue::Sm90GumbelArgmaxRowReduction<TileShape, float, kLoop>, cutlass::epilogue::fusion::Sm90AccFetch>;

  // No D: the logits stay on chip.
  using Setup = kernel::Sm90PersistentGemm<Element, TileShape, ClusterShape, kPingpong, void, cutlass::layout::RowMajor,
                                           kernel::kOperandAlignment<Element>, FusionCallbacks>;
  using GemmKernel = typename Setup::GemmKernel;
  using Gemm = typename Setup::Gemm;
  using Launcher = SamplerGemmLauncher<Gemm, Element, Config::kTileM, /*kScratchD=*/false>;
};

// The top-k pass on the epilogue-warpgroup kernel reproduces the visitor's scan on the
// cooperative 128 x 128 tile (runs of 16 rows: a 128 x 32 epilogue subtile over 256 threads, 8
// a column); this holds it to that geometry should CUTLASS's choice of subtile change.
template <class Element, SamplerLoop kLoop>
struct TopScanGeometryOfCooperativeTile {
  static constexpr bool kMatches = true;
};
template <class Element>
struct TopScanGeometryOfCooperativeTile<Element, SamplerLoop::kTopCandidates> {
  using Setup = typename SamplerGemmSm90<Element, 128, /*kPingpong=*/false, SamplerLoop::kTopCandidates>::Setup;
  using EpilogueTile = typename Setup::CollectiveEpilogue::EpilogueTile;
  static constexpr bool kMatches = SamplerTileConfig<128, false>::kTileM == 128 &&
                                   decltype(cute::size<0>(EpilogueTile{}))::value == 128 &&
                                   decltype(cute::size<1>(EpilogueTile{}))::value == 32 &&
                                   decltype(cute::size(typename Setup::GemmKernel::TiledMma{}))::value == 256;
};

// The plain loop (or the common controls' loop, or the fused top-k pass's) on a kernel of our own
// with two epilogue warpgroups beside the two MMA warpgroups
// (kernel/sm90_sampler_epilogue_warpgroups.hpp): 128 x TileN tiles, candidates per 64-row half
// tile (the top-k pass: per tile, as the cooperative schedule's visitor writes them). kClusterM / kClusterN = 2: two CTAs on
// neighbouring vocabulary / column tiles share each hidden / W tile by TMA multicast.
template <class Element, int TileN, SamplerLoop kLoop, int kClusterM = 1, int kClusterN = 1>
struct SamplerGemmSm90EpilogueWarpGroups {
  using HandOver = kernel::EpilogueWarpGroupsStorage<TileN, kLoop == SamplerLoop::kCommonControls>;
  // K per stage as on the CUTLASS schedules' tiles: 128 for N <= 64, whose mainloop streams W
  // (memory-bound), 64 at N = 128.
  using TileShape = cute::Shape<cute::_128, cute::Int<TileN>, cute::Int<SamplerTileConfig<TileN, false>::kTileK>>;
  using ClusterShape = cute::Shape<cute::Int<kClusterM>, cute::Int<kClusterN>, cute::_1>;
  using CollectiveMainloop =
      kernel::Sm90WeightHiddenMainloop<Element, TileShape, ClusterShape, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                       static_cast<int>(sizeof(HandOver))>;
  using GemmKernel = kernel::Sm90SamplerEpilogueWarpGroups<CollectiveMainloop, kLoop>;
  static_assert(GemmKernel::kCandidateTileM == (kLoop == SamplerLoop::kTopCandidates
                                                    ? kEpilogueWarpGroupsTopCandidatesVocabTile
                                                    : kEpilogueWarpGroupsVocabTile),
                "stage 2 reads candidates per half tile (the top-k pass's: per tile)");
  static_assert(TopScanGeometryOfCooperativeTile<Element, kLoop>::kMatches,
                "the top-k scan's runs are those of the cooperative tile's visitor");
  // The hand-over's shared memory leaves the mainloop 5 stages at N = 128 (4 are slower:
  // docs/kernel.md); anything added to it must fit in what is left.
  static_assert(TileN != 128 || CollectiveMainloop::DispatchPolicy::Stages >= 5, "5 mainloop stages at N = 128");

  static cudaError_t run(SamplerParams const& p, SamplerBuffers const& buffers, cudaStream_t stream) {
    typename GemmKernel::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = sampler_problem_shape(p);
    fill_sampler_mainloop_arguments<Element, GemmKernel>(args.mainloop, p);
    fill_sampler_node_arguments(args.node, p, buffers);
    fill_sampler_schedule_arguments(args, p);
    args.noise_floors = buffers.noise_floors;
    args.column_max_codes = buffers.column_max_codes;
    args.min_ps = p.min_ps;
    args.min_p = p.min_p;
    args.lse_references = p.lse_references;
    if (!GemmKernel::can_implement(args)) {
      return cudaErrorInvalidValue;
    }
    auto const params = GemmKernel::to_underlying_arguments(args, nullptr);
    auto* kernel_fn = &cutlass::device_kernel<GemmKernel>;
    cudaError_t err = cudaFuncSetAttribute(kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           GemmKernel::SharedStorageSize);
    if (err != cudaSuccess) {
      return err;
    }
    if constexpr (kClusterM * kClusterN == 1) {
      kernel_fn<<<GemmKernel::get_grid_shape(params), GemmKernel::get_block_shape(), GemmKernel::SharedStorageSize,
                  stream>>>(params);
      return cudaGetLastError();
    } else {
      void* kernel_params[] = {const_cast<void*>(static_cast<void const*>(&params))};
      cutlass::Status const status = cutlass::ClusterLauncher::launch(
          GemmKernel::get_grid_shape(params), dim3(kClusterM, kClusterN, 1), GemmKernel::get_block_shape(),
          GemmKernel::SharedStorageSize, stream, reinterpret_cast<void const*>(kernel_fn), kernel_params);
      cudaError_t const err = cudaGetLastError();
      return status == cutlass::Status::kSuccess ? err : (err == cudaSuccess ? cudaErrorLaunchFailure : err);
    }
  }
};

template <class Element, int TileN, SamplerLoop kLoop, int kClusterM, int kClusterN>
cudaError_t run_sampler_gemm_sm90_epilogue_warpgroups(SamplerParams const& p, SamplerBuffers const& buffers,
                                                      void* /*gemm_workspace*/, cudaStream_t stream) {
  return SamplerGemmSm90EpilogueWarpGroups<Element, TileN, kLoop, kClusterM, kClusterN>::run(p, buffers, stream);
}

#define FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS_CLUSTER(Element, TileN, kLoop, kClusterM, kClusterN)     \
  template cudaError_t run_sampler_gemm_sm90_epilogue_warpgroups<Element, TileN, kLoop, kClusterM, kClusterN>( \
      SamplerParams const&, SamplerBuffers const&, void*, cudaStream_t);

#define FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS(Element, TileN, kLoop) \
  FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS_CLUSTER(Element, TileN, kLoop, 1, 1)

template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM>
cudaError_t run_sampler_gemm_sm90(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                                  cudaStream_t stream) {
  return SamplerGemmSm90<Element, TileN, kPingpong, kLoop, kClusterM>::Launcher::run(p, buffers, gemm_workspace,
                                                                                        stream);
}

template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM>
size_t sampler_gemm_workspace_sm90(SamplerParams const& p) {
  return SamplerGemmSm90<Element, TileN, kPingpong, kLoop, kClusterM>::Launcher::gemm_workspace_bytes(p);
}

#define FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(Element, TileN, kPingpong, kLoop, kClusterM)            \
  template cudaError_t run_sampler_gemm_sm90<Element, TileN, kPingpong, kLoop, kClusterM>(             \
      SamplerParams const&, SamplerBuffers const&, void*, cudaStream_t);                                 \
  template size_t sampler_gemm_workspace_sm90<Element, TileN, kPingpong, kLoop, kClusterM>(           \
      SamplerParams const&);

#define FLASHSAMPLING_INSTANTIATE_SM90(Element, TileN, kPingpong, kLoop) \
  FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER(Element, TileN, kPingpong, kLoop, 1)

}  // namespace flashsampling
