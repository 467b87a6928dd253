// The fused sampling GEMM for Hopper with epilogue warpgroups of its own (the plain loop beyond
// 32 columns; beyond 16, the controls' loop: the common controls, and also per-row seeds /
// offsets, several samples and sparse bias; sampler_dispatch.cu).
//
// CUTLASS's cooperative kernel runs each tile's epilogue on the two MMA warpgroups after
// the tile's mainloop, so at B = 256 the noise (~190 instructions per logit, latency-bound)
// adds to the GEMM instead of overlapping it (docs/kernel.md). Here five
// warpgroups split the work:
//
//   warpgroup 0      producer: TMA loads of W and h tiles (CUTLASS's mainloop collective)
//   warpgroups 1, 2  MMA: wgmma over K (the same collective), then each hands its 64 x N
//                    accumulator half to shared memory and goes on with the next tile
//   warpgroups 3, 4  epilogue: warpgroup 3 + w takes MMA warpgroup 1 + w's half: once its
//                    logits are in shared memory it draws their noise, keeps the best
//                    (score, index) of every column of its 64 vocabulary rows, writes one
//                    candidate per column and frees the buffer, while the MMA warps already
//                    run the next tile's mainloop.
//
// The epilogue draws the contract's exact noise (Philox, two logs) only where it can matter:
// each column's best score so far (its floor, raised by every CTA through a small global array)
// rules out elements whose score with an upper bound of their noise stays below it, and a step
// of eight elements per thread in which no lane of the warp has such an element keeps no
// candidate (fs_gumbel_upper_bound_from_bits; the same tokens as drawing everything).
//
// Each (MMA, epilogue) pair shares one accumulator buffer and two mbarriers (full / empty);
// the epilogue warpgroup thread t reads exactly what MMA thread t wrote, so it knows the
// coordinates of each value from the MMA's own partition. Candidates are written per
// 64-row half tile: the candidate table has ceil(V / 64) rows and stage 2 reduces it as
// for any other tile height.
//
// The fused top-k pass (SamplerLoop::kTopCandidates, N = 128 or 64) is the exception: its outputs must
// be those of the visitor's top-k scan on CUTLASS's cooperative 128 x 128 tile bit for bit
// (stage 2 and the logits sampler read them, and the log-mass parts' merge order is part of
// their bits), so it writes per 128-row tile, and the two epilogue warpgroups meet at a named
// barrier to merge their halves (run_top_candidates_epilogue).
//
// The structure follows CUTLASS's sm90_gemm_tma_warpspecialized_cooperative.hpp (roles by
// warpgroup, one persistent tile scheduler walked by every role, the producer's registers
// given back with setmaxnreg).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/pipeline/pipeline.hpp"

#include "flashsampling/epilogue/candidate_math.cuh"
#include "flashsampling/epilogue/sm90_visitor_gumbel_argmax.hpp"

namespace flashsampling::kernel {

using namespace cute;

// Shared memory of the hand-over, outside the mainloop's (its size sets the mainloop's
// stage count: StageCountAutoCarveout). The per-column results of each warp (best keys; for
// the common controls' loop also the log-sum-exp parts and the winners' logits) go into slots
// of this buffer that their writers have already read (result_slot below), so the final merge
// needs no buffer of its own: at N = 128 the mainloop gets 5 stages (with a separate buffer it
// would get 4 for the plain loop, 3 for the common controls', and 4 are slower).
template <int kTileN, bool kControls = false>
struct EpilogueWarpGroupsStorage {
  static constexpr int kHalves = 2;                        // one per MMA warpgroup
  static constexpr int kValuesPerThread = 64 * kTileN / 128;  // a 64 x N half over 128 threads
  // accumulators[w][q][t]: values 4q .. 4q + 3 of MMA thread t of warpgroup w (16-byte
  // stores, a warp's 32 consecutive: no bank conflicts).
  alignas(128) float4 accumulators[kHalves][kValuesPerThread / 4][128];
  // The common controls' allowed-token bits of each half's 64 vocabulary rows for every column
  // of the tile (two words per column, side by side: a block's column pair is one 16-byte load),
  // loaded from global memory one tile ahead.
  alignas(16) uint2 mask_bits[kHalves][kControls ? kTileN : 2];
  // Sparse per-row bias: bit t of word t / 32 set where column t's row has a sparse entry
  // among the half's 64 vocabulary rows (its sparse bitmap's two words there are not zero), so the
  // loop looks at the bitmap and the row's entries only in the rare steps that may need them.
  uint32_t sparse_columns[kHalves][kControls ? (kTileN + 31) / 32 : 1];
  // The floors of the exact skip (philox_gumbel.h) for the tile's columns, rounded down to
  // bf16: the best exact score each column has drawn so far, here or on any SM. Any score a
  // column really drew is a valid floor, and so is anything below it.
  alignas(4) __nv_bfloat16 score_floor[kHalves][kTileN];
  // The filtered min_p winners' floors in y (min_p_floor, rounded down to bf16) of the tile's
  // columns: a token below its column's is no candidate (the plain loop only).
  alignas(4) __nv_bfloat16 min_p_floor[kHalves][kControls ? 2 : kTileN];
  alignas(8) uint64_t full[kHalves];   // logits of half w are in shared memory
  alignas(8) uint64_t empty[kHalves];  // half w's buffer may be overwritten
};

template <class CollectiveMainloop_, SamplerLoop kLoop = SamplerLoop::kPlain>
class Sm90SamplerEpilogueWarpGroups {
 public:
  static_assert(kLoop == SamplerLoop::kPlain || kLoop == SamplerLoop::kCommonControls ||
                    kLoop == SamplerLoop::kTopCandidates,
                "the plain loop, the common controls' loop or the top-k pass's");
  static constexpr bool kControls = kLoop == SamplerLoop::kCommonControls;
  static constexpr bool kTopCandidates = kLoop == SamplerLoop::kTopCandidates;
  using CollectiveMainloop = CollectiveMainloop_;
  using TileShape = typename CollectiveMainloop::TileShape;
  using TiledMma = typename CollectiveMainloop::TiledMma;
  using ArchTag = typename CollectiveMainloop::ArchTag;
  using ClusterShape = typename CollectiveMainloop::DispatchPolicy::ClusterShape;
  using ProblemShape = Shape<int, int, int, int>;
  using StrideA = typename CollectiveMainloop::StrideA;
  using StrideB = typename CollectiveMainloop::StrideB;
  using MainloopArguments = typename CollectiveMainloop::Arguments;
  using MainloopParams = typename CollectiveMainloop::Params;
  using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
  using TileScheduler = typename cutlass::gemm::kernel::detail::TileSchedulerSelector<
      cutlass::gemm::PersistentScheduler, ArchTag, TileShape, ClusterShape>::Scheduler;
  using TileSchedulerArguments = typename TileScheduler::Arguments;
  using TileSchedulerParams = typename TileScheduler::Params;
  // The visitor's arguments (candidates, noise source, controls, temperature, greedy, offsets).
  using NodeArguments = typename epilogue::Sm90GumbelArgmaxRowReduction<TileShape, float, kLoop>::Arguments;

  static constexpr int kTileM = size<0>(TileShape{});
  static constexpr int kTileN = size<1>(TileShape{});
  static constexpr int kHalfM = 64;
  using HandOver = EpilogueWarpGroupsStorage<kTileN, kControls>;
  static constexpr int kValuesPerThread = HandOver::kValuesPerThread;
  static_assert(kTileM == 128 && size(TiledMma{}) == 256, "two MMA warpgroups of 64 rows each (cooperative MMA)");
  static_assert(kTileN <= 128 && kValuesPerThread % 4 == 0, "one epilogue thread per column");
  static constexpr int kBlocksPerThread = kValuesPerThread / 4;  // blocks of 8 columns (4 values)
  static constexpr int kBlocksPerStep = 2;
  static_assert(kBlocksPerThread % kBlocksPerStep == 0, "whole steps");
  static constexpr int kEpilogueWarpGroups = HandOver::kHalves;
  // M of a candidate row: a half tile, or for the top-k pass the whole tile (the visitor's).
  static constexpr int kCandidateTileM = kTopCandidates ? kTileM : kHalfM;
  // The top-k scan: a 128 x 128 tile reproduces CUTLASS's cooperative tile bit for bit; a 128 x 64
  // one writes the same per column (each column's runs and merge do not depend on N).
  static_assert(!kTopCandidates || kTileN == 128 || kTileN == 64, "the top-k scan's tiles: 128 x 128 or 128 x 64");
  // Clusters of two CTAs share one operand tile by TMA multicast: along M the hidden tile
  // (two vocabulary tiles, the same columns), along N the W tile (one vocabulary tile, two column
  // tiles). Only the mainloop sees the cluster; each CTA's epilogue is its own.
  static constexpr int kClusterSize = size(ClusterShape{});
  static_assert(kClusterSize <= 2 && size<2>(ClusterShape{}) == 1, "one CTA, or two along M or N");

  static constexpr uint32_t NumThreadsPerWarpGroup = cutlass::NumThreadsPerWarpGroup;
  static constexpr uint32_t MaxThreadsPerBlock = (3 + kEpilogueWarpGroups) * NumThreadsPerWarpGroup;
  static constexpr uint32_t MinBlocksPerMultiprocessor = 1;
  // Registers per thread: the launch count is 65536 / 640 in units of 8 = 96 (wgmma over 64 fp32
  // accumulators needs 90, so there is no room for more warpgroups). The producer gives back what
  // it does not need; nobody takes it: setmaxnreg.inc could only take what the CTA's own warps gave
  // back (ptxas does allocate past 96 after it), and more registers for the MMA warps change
  // nothing in their loop.
  static constexpr uint32_t kLaunchRegisters = (65536 / MaxThreadsPerBlock) / 8 * 8;
  static constexpr uint32_t kLoadRegisters = 40;
  static_assert(kLoadRegisters <= kLaunchRegisters, "the producer only gives registers back");

  struct SharedStorage {
    struct PipelineStorage : aligned_struct<16, _1> {
      alignas(16) typename CollectiveMainloop::PipelineStorage mainloop;
    } pipelines;
    struct TensorStorage : aligned_struct<128, _1> {
      typename CollectiveMainloop::TensorStorage mainloop;
      HandOver hand_over;
    } tensors;
  };
  static constexpr int SharedStorageSize = sizeof(SharedStorage);

  struct Arguments {
    cutlass::gemm::GemmUniversalMode mode{};
    ProblemShape problem_shape{};
    MainloopArguments mainloop{};
    NodeArguments node{};
    cutlass::KernelHardwareInfo hw_info{};
    TileSchedulerArguments scheduler{};
    // [N] zeroed order codes (number_order_bits) of each GEMM column's best score so far, raised
    // with atomicMax by every CTA: the exact skip (philox_gumbel.h); nullptr: no skip.
    uint32_t* noise_floors = nullptr;
    // The controls' loop sums log-sum-exp terms against references (LseReferences).
    bool lse_references = true;
    // SamplerParams::min_p_filtered_winners (the plain loop, storing x, no exact skip): [N] zeroed
    // order codes of each GEMM column's largest x so far, raised with atomicMax by every CTA, and
    // the rows' min_p (the [B] float64 tensor where there is one, else the call's value); each
    // column's candidate is then the best of the tile's tokens whose y reaches min_p_floor.
    uint32_t* column_max_codes = nullptr;
    double const* min_ps = nullptr;
    double min_p = 0.0;
  };

  struct Params {
    ProblemShape problem_shape{};
    MainloopParams mainloop{};
    NodeArguments node{};
    cutlass::KernelHardwareInfo hw_info{};
    TileSchedulerParams scheduler{};
    uint32_t* noise_floors = nullptr;
    bool lse_references = true;
    uint32_t* column_max_codes = nullptr;
    double const* min_ps = nullptr;
    double min_p = 0.0;
  };

  static Params to_underlying_arguments(Arguments const& args, void* /*workspace*/) {
    auto problem_shape_mnkl = append<4>(args.problem_shape, 1);
    return {args.problem_shape,
            CollectiveMainloop::to_underlying_arguments(args.problem_shape, args.mainloop, nullptr),
            args.node,
            args.hw_info,
            TileScheduler::to_underlying_arguments(problem_shape_mnkl, TileShape{}, ClusterShape{}, args.hw_info,
                                                   args.scheduler, nullptr),
            args.noise_floors,
            args.lse_references,
            args.column_max_codes,
            args.min_ps,
            args.min_p};
  }

  static bool can_implement(Arguments const& args) {
    SamplingControls const& controls = args.node.controls;
    return args.mode == cutlass::gemm::GemmUniversalMode::kGemm &&
           CollectiveMainloop::can_implement(args.problem_shape, args.mainloop) &&
           args.node.ptr_candidates != nullptr && args.node.batch_size >= 1 &&
           args.node.ptr_tile_winners == nullptr &&  // the visitor's scan draws them, this one does not
           // the controls' loop here takes every control, the plain loop none, the top-k pass's
           // what the visitor's takes (its noise is drawn in stage 2)
           (static_cast<int>(sampler_loop_for(controls, args.node.noise, args.node.num_samples,
                                              args.node.logprobs)) <=
                static_cast<int>(kTopCandidates ? SamplerLoop::kTopCandidates
                                 : kControls    ? SamplerLoop::kAllControls
                                                : SamplerLoop::kPlain) ||
            // the plain loop also applies logit_scale / logit_softcap and the penalties alone, and
            // several samples on row quads alone (kernel_choice.h)
            (kLoop == SamplerLoop::kPlain &&
             needs_only_plain_loop_extras(
                 loop_needs(controls, args.node.noise, args.node.num_samples, args.node.logprobs),
                 args.node.batch_size))) &&
           (!kTopCandidates || (controls.sparse_ids == nullptr && controls.logit_scale == 1.0f &&
                                controls.logit_softcap == 0.0f &&
                                (args.node.ptr_row_logits == nullptr || args.node.ptr_lse_parts != nullptr))) &&
           // each run's keys in place of x (SamplerParams::large_top_k_run_keys)
           (args.node.ptr_run_keys == nullptr || (kTopCandidates && args.node.ptr_row_logits == nullptr)) &&
           // top_p or min_p alone on the plain pass: the plain and the controls' loop store x of one
           // sample, without logprobs (their result slots), the model-side transforms, penalties or
           // sparse bias
           (args.node.ptr_tile_max_logits == nullptr ||
            (!kTopCandidates && args.node.num_samples == 1 && !args.node.logprobs && controls.logit_scale == 1.0f &&
             controls.logit_softcap == 0.0f && controls.penalty_ids == nullptr && controls.sparse_ids == nullptr)) &&
           (kTopCandidates || (args.node.ptr_row_logits == nullptr) == (args.node.ptr_tile_max_logits == nullptr)) &&
           // the filtered min_p winners: the plain loop of a call storing x, none of its logit
           // transforms (the floors are of y = x / T)
           (args.column_max_codes == nullptr ||
            (kLoop == SamplerLoop::kPlain && args.node.ptr_tile_max_logits != nullptr && !args.node.greedy &&
             controls.logit_scale == 1.0f && controls.logit_softcap == 0.0f && controls.penalty_ids == nullptr)) &&
           (!args.node.logprobs || (args.node.ptr_candidate_logits != nullptr && args.node.ptr_lse_parts != nullptr));
  }

  static size_t get_workspace_size(Arguments const&) { return 0; }

  static dim3 get_grid_shape(Params const& params) {
    TileSchedulerArguments args{};
    args.raster_order = params.scheduler.raster_order_ == TileScheduler::RasterOrder::AlongN
                            ? TileScheduler::RasterOrderOptions::AlongN
                            : TileScheduler::RasterOrderOptions::AlongM;
    return TileScheduler::get_grid_shape(params.scheduler, append<4>(params.problem_shape, 1), TileShape{},
                                         ClusterShape{}, params.hw_info, args);
  }

  static dim3 get_block_shape() { return dim3(MaxThreadsPerBlock, 1, 1); }

  CUTLASS_DEVICE void operator()(Params const& params, char* smem_buf) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    enum class Role { kProducer = 0, kMma = 1, kEpilogue = 2 };
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem_buf);
    HandOver& hand_over = storage.tensors.hand_over;
    int const thread_idx = static_cast<int>(threadIdx.x);
    int const warp_group = cutlass::canonical_warp_group_idx();
    int const warp_idx = cutlass::canonical_warp_idx_sync();
    Role const role = warp_group == 0 ? Role::kProducer : warp_group <= 2 ? Role::kMma : Role::kEpilogue;
    int const lane_predicate = cute::elect_one_sync();

    if (warp_idx == 0 && lane_predicate) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
    }

    typename MainloopPipeline::Params pipeline_params;
    if (role == Role::kProducer && warp_idx == 0) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Producer;
    }
    if (role == Role::kMma) {
      pipeline_params.role = MainloopPipeline::ThreadCategory::Consumer;
    }
    pipeline_params.is_leader = thread_idx % NumThreadsPerWarpGroup == 0;
    pipeline_params.num_consumers = size(TiledMma{});
    pipeline_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline pipeline(storage.pipelines.mainloop, pipeline_params, ClusterShape{});

    if (warp_idx == 1 && lane_predicate) {
      for (int w = 0; w < HandOver::kHalves; ++w) {
        cutlass::arch::ClusterBarrier::init(&hand_over.full[w], NumThreadsPerWarpGroup);
        // The top-k pass's merge reads both halves, so both epilogue warpgroups free each half.
        cutlass::arch::ClusterBarrier::init(&hand_over.empty[w], kTopCandidates
                                                                     ? kEpilogueWarpGroups * NumThreadsPerWarpGroup
                                                                     : NumThreadsPerWarpGroup);
      }
    }
    cutlass::arch::fence_barrier_init();
    // The pipeline's barriers must be initialised in both CTAs of a cluster before either's TMA
    // multicast or consumer release reaches them.
    if constexpr (kClusterSize > 1) {
      cute::cluster_arrive_relaxed();
      cute::cluster_wait();
    } else {
      __syncthreads();
    }

    auto problem_shape_mnkl = append<4>(params.problem_shape, Int<1>{});
    CollectiveMainloop collective_mainloop;
    TileScheduler scheduler{params.scheduler};
    auto work = scheduler.initial_work_tile_info(ClusterShape{});
    int const k_tile_count = TileScheduler::get_work_k_tile_count(work, problem_shape_mnkl, TileShape{});

    if (role == Role::kProducer) {
      cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
      if (warp_idx != 0) {
        return;
      }
      auto load_inputs = collective_mainloop.load_init(problem_shape_mnkl, params.mainloop);
      Tensor gA_mkl = get<0>(load_inputs);
      Tensor gB_nkl = get<1>(load_inputs);
      auto write_state = cutlass::make_producer_start_state<MainloopPipeline>();
      while (work.is_valid()) {
        auto blk_coord = make_coord(idx2crd(work.M_idx, shape<2>(gA_mkl)), idx2crd(work.N_idx, shape<2>(gB_nkl)), _,
                                    idx2crd(work.L_idx, shape<4>(gB_nkl)));
        auto k_tile_iter = make_coord_iterator(idx2crd(0, shape<3>(gA_mkl)), shape<3>(gA_mkl));
        collective_mainloop.load(params.mainloop, pipeline, write_state, load_inputs, blk_coord, k_tile_iter,
                                 k_tile_count, cutlass::canonical_lane_idx(), cute::block_rank_in_cluster(),
                                 storage.tensors.mainloop);
        write_state.advance(k_tile_count);
        work = get<0>(scheduler.fetch_next_work(work));
      }
      collective_mainloop.load_tail(pipeline, write_state);
    } else if (role == Role::kMma) {
      int const mma_thread_idx = thread_idx - NumThreadsPerWarpGroup;
      // From the shuffled warpgroup index, not from threadIdx: ptxas then knows the hand-over's
      // barrier addresses are warp-uniform, so the mainloop's control flow stays uniform and its
      // pipeline stage and wgmma descriptors live in uniform registers (with half from threadIdx
      // every k tile would move 16 descriptor words through R2UR).
      int const half = warp_group - 1;
      int const t = mma_thread_idx % NumThreadsPerWarpGroup;
      TiledMma tiled_mma;
      typename CollectiveMainloop::PipelineState read_state;
      uint32_t empty_phase = 1;  // a fresh buffer counts as emptied
      while (work.is_valid()) {
        auto accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));  // (MMA, MMA_M, MMA_N)
        static_assert(decltype(size(accumulators))::value == kValuesPerThread, "a 64 x N half per warpgroup");
        collective_mainloop.mma(pipeline, read_state, accumulators, k_tile_count, mma_thread_idx,
                                storage.tensors.mainloop, params.mainloop);
        collective_mainloop.mma_tail(pipeline, read_state, k_tile_count);
        read_state.advance(k_tile_count);

        cutlass::arch::ClusterBarrier::wait(&hand_over.empty[half], empty_phase);
        empty_phase ^= 1;
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kValuesPerThread / 4; ++q) {
          hand_over.accumulators[half][q][t] = make_float4(accumulators(4 * q), accumulators(4 * q + 1),
                                                           accumulators(4 * q + 2), accumulators(4 * q + 3));
        }
        cutlass::arch::ClusterBarrier::arrive(&hand_over.full[half]);
        work = get<0>(scheduler.fetch_next_work(work));
      }
    } else if constexpr (kTopCandidates) {
      run_top_candidates_epilogue(params, hand_over, scheduler, work, warp_group - 3,
                                  thread_idx % NumThreadsPerWarpGroup);
    } else {
      run_epilogue(params, hand_over, scheduler, work, warp_group - 3, thread_idx % NumThreadsPerWarpGroup);
    }
#endif
  }

 private:
  CUTLASS_DEVICE static PackedCandidate key_max(PackedCandidate a, PackedCandidate b) { return a > b ? a : b; }

  // Where a warp's results for a column wait for the merge. In the wgmma accumulator layout
  // block q of lane l holds columns 8q + 2 (l % 4) + {0, 1}, and after the shuffles the eight
  // lanes of a column pair hold the same results, so lane l < 4 writes the pair's two keys,
  // lane l + 4 their (max2, sum) parts and lane l + 8 their winners' logits: slot
  // [q][32 w + lane] of warp w, each lane's own, which it has read before (load_step), so the
  // loops store to the address they loaded from. The buffer is given back (empty) only after the
  // merge has read them.
  enum ResultSlot { kKeys = 0, kLseParts = 1, kWinnerLogits = 2 };
  CUTLASS_DEVICE static float4& result_slot(HandOver& hand_over, int half, int column, int warp, ResultSlot kind) {
    return hand_over.accumulators[half][column / 8][32 * warp + 4 * kind + (column % 8) / 2];
  }
  CUTLASS_DEVICE static PackedCandidate result_key(HandOver& hand_over, int half, int column, int warp) {
    ulonglong2 const keys = reinterpret_cast<ulonglong2 const&>(result_slot(hand_over, half, column, warp, kKeys));
    return column % 2 ? keys.y : keys.x;
  }

  static constexpr int kStepElements = 4 * kBlocksPerStep;
  static constexpr int kSteps = kBlocksPerThread / kBlocksPerStep;
  // The largest exponent of a log-sum-exp term against its column's reference (controls_half_tile):
  // 16 terms below 2^96 sum to a finite float, and stage 2 rescales the parts.
  static constexpr float kLargestTermExponent = 96.0f;

  // The log-sum-exp references of the controls' loop: per column the largest log-sum-exp
  // (log2 units) of its elements in the half's earlier tiles of the current N tile, -inf before
  // the first. Held in registers, spread over the lanes: lane l keeps the four columns of step
  // l / 4 that lane l's column pair takes (block 2 (l / 4) + s, column c: 8 (2 (l / 4) + s) +
  // 2 (l % 4) + c), and each step fetches its four with shuffles. A tile's merge writes each
  // column's log-sum-exp to a free slot of the hand-over buffer, from where the lanes take the
  // larger of it and what they held.
  struct LseReferences {
    float held[kBlocksPerStep][2];
    int n_origin = -1;
  };
  // Slot of column n's tile log-sum-exp: float4s 16 and 17 of block n / 8, which neither the
  // warps' results (result_slot: 32 w + 0 .. 11) nor anything else written after the loop use.
  CUTLASS_DEVICE static float& lse_reference_slot(HandOver& hand_over, int half, int column) {
    return reinterpret_cast<float*>(&hand_over.accumulators[half][column / 8][16])[column % 8];
  }

  // The Philox bits of a step's blocks at the batch-wide seed (stream = batch row). Lanes l and
  // l ^ 1 hold the same vocabulary rows m, m + 8 and the two halves of one batch quad (columns
  // 4k .. 4k + 3: the even lane 4k, 4k + 1, the odd lane 4k + 2, 4k + 3), and the contract draws a
  // quad's four streams at one vocabulary index from one Philox block. So each lane computes one
  // block of the pair's two (the even lane row m's, the odd lane row m + 8's) and hands its
  // partner the two words the partner's columns take: one Philox call per four elements instead
  // of two, the same bits.
  // With S samples and B % 4 == 0 a quad of GEMM columns is a quad of batch rows of one sample
  // (column s * B + b), so the same holds with stream b and offset + s (kSeveralSamples; other
  // batches take keyed_step_noise_bits).
  template <bool kSeveralSamples>
  CUTLASS_DEVICE static void step_noise_bits(NodeArguments const& node, int t, uint64_t seed, uint64_t offset,
                                             uint32_t const (&vocab_index)[kStepElements],
                                             uint32_t const (&column)[kStepElements],
                                             uint32_t (&bits)[kStepElements]) {
    bool const odd = t % 2;  // MMA thread t's lane parity
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kBlocksPerStep; ++s) {
      // values 4s .. 4s + 3: (m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1), n = 4k (+ 2 if odd)
      uint32_t const own_row = odd ? vocab_index[4 * s + 2] : vocab_index[4 * s];  // a select, not an index
      uint32_t row = column[4 * s], sample = 0;
      if constexpr (kSeveralSamples) {
        // (with one sample the column is the row: the quads of padding columns past B stay whole)
        if (node.num_samples > 1) {
          column_row_and_sample<true>(node, column[4 * s], row, sample);
        }
      }
      Philox4 const own = fs_noise_block(seed, offset + sample, own_row, row >> 2);
      uint32_t const got0 = __shfl_xor_sync(0xFFFFFFFF, odd ? own.x : own.z, 1);
      uint32_t const got1 = __shfl_xor_sync(0xFFFFFFFF, odd ? own.y : own.w, 1);
      bits[4 * s] = odd ? got0 : own.x;
      bits[4 * s + 1] = odd ? got1 : own.y;
      bits[4 * s + 2] = odd ? own.z : got0;
      bits[4 * s + 3] = odd ? own.w : got1;
    }
  }

  // One step of a half tile: the logits of blocks q0 .. q0 + kBlocksPerStep - 1 from the
  // hand-over buffer, their global vocabulary indices and GEMM columns, and the Philox bits of
  // their noise (none for a greedy batch). Two blocks (eight elements, two Philox chains per
  // thread), inlined so the compiler interleaves their chains; the logs follow in
  // exact_noise_needed. kGeneralColumns: see controls_half_tile.
  template <bool kGeneralColumns, class CoordTensor>
  CUTLASS_DEVICE static void load_step(NodeArguments const& node, HandOver const& hand_over,
                                       CoordTensor const& tCcAcc, int half, int t, int q0, int m_origin, int n_origin,
                                       uint64_t seed, uint64_t offset, float (&x)[kStepElements],
                                       uint32_t (&vocab_index)[kStepElements], uint32_t (&column_index)[kStepElements],
                                       uint32_t (&bits)[kStepElements], bool keyed_noise = false) {
    constexpr int N = kStepElements;
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kBlocksPerStep; ++s) {
      float4 const logit = hand_over.accumulators[half][q0 + s][t];
      x[4 * s] = logit.x;
      x[4 * s + 1] = logit.y;
      x[4 * s + 2] = logit.z;
      x[4 * s + 3] = logit.w;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < N; ++e) {
      auto const coord = tCcAcc(4 * q0 + e);
      vocab_index[e] = node.vocab_start + static_cast<uint32_t>(m_origin + get<0>(coord));
      column_index[e] = static_cast<uint32_t>(n_origin + get<1>(coord));
      bits[e] = 0u;
    }
    if (node.greedy) {
      return;
    }
    if constexpr (kControls) {
      if (keyed_noise) {  // needs_keyed_noise, once per half tile (per step it cost ~16 instructions)
        keyed_step_noise_bits<kGeneralColumns>(node, seed, offset, vocab_index, column_index, bits);
        return;
      }
    }
    // The batch-wide seed: one Philox block per lane pair, both lanes of every pair calling.
    step_noise_bits<kGeneralColumns>(node, t, seed, offset, vocab_index, column_index, bits);
  }

  // GEMM column `column` holds batch row column % B and draws sample column / B (S samples:
  // SamplerParams::hidden); kSeveralSamples = false: one sample, row min(column, B - 1). Padding
  // columns map to in-range rows and are never written.
  template <bool kSeveralSamples>
  CUTLASS_DEVICE static void column_row_and_sample(NodeArguments const& node, uint32_t column, uint32_t& row,
                                                   uint32_t& sample) {
    if constexpr (kSeveralSamples) {
      int quotient, remainder;
      node.batch_divmod(quotient, remainder, static_cast<int>(column));
      row = static_cast<uint32_t>(remainder);
      sample = static_cast<uint32_t>(quotient);
    } else {
      row = min(column, node.batch_size - 1);
      sample = 0;
    }
  }

  // Whether the common controls' loop draws a step's noise key by key (keyed_step_noise_bits):
  // per-row seeds / offsets / streams, or several samples whose column quads are not row quads.
  CUTLASS_DEVICE static bool needs_keyed_noise(NodeArguments const& node) {
    return node.noise.row_seeds != nullptr || node.noise.row_offsets != nullptr || node.noise.row_streams != nullptr ||
           (node.num_samples > 1 && node.batch_size % 4 != 0);
  }

  // The Philox bits of a step with per-row seeds and / or offsets (the common controls' loop)
  // or several samples on columns that are not whole row quads: each column its own key or
  // counter (with per-row seeds every row is stream 0; sample s counts from offset + s), so a block
  // serves two elements only where both columns share it (noise_bits_lanes checks); the contract's
  // bits either way. Out-of-range columns read in-range rows' values and are not kept.
  template <bool kSeveralSamples>
  CUTLASS_DEVICE static void keyed_step_noise_bits(NodeArguments const& node, uint64_t seed, uint64_t offset,
                                                   uint32_t const (&vocab_index)[kStepElements],
                                                   uint32_t const (&column_index)[kStepElements],
                                                   uint32_t (&bits)[kStepElements]) {
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kBlocksPerStep; ++s) {
      uint64_t seeds[4], offsets[4];
      uint32_t v[4], streams[4], block_bits[4];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {  // values 4s + 2r + c: (m + 8r, n + c)
        uint32_t row, sample;
        column_row_and_sample<kSeveralSamples>(node, column_index[4 * s + c], row, sample);
        RowNoiseKey const key = row_noise_key(node.noise, seed, offset, row, sample);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          int const e = 2 * r + c;
          seeds[e] = key.seed;
          offsets[e] = key.offset;
          streams[e] = key.stream;
          v[e] = vocab_index[4 * s + e];
        }
      }
      // noise_bits_lanes pairs elements (0, 1) and (2, 3): one vocabulary row, columns n and n + 1.
      epilogue::noise_bits_lanes<4>(seeds, offsets, v, streams, block_bits);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 4; ++e) bits[4 * s + e] = block_bits[e];
    }
  }

  // top_p or min_p alone on the plain pass (SamplerParams::truncation_on_plain_pass), in the plain
  // and the controls' loop: the step's x to the stored rows, row_logits[column * stride + v], as the top-k scan
  // stores them (top_scan_value: kExcludedLogitBits where `allowed` is false, the mask's) (a store
  // an element: each is a warp's four columns of eight neighbouring vocabulary rows, whole 32-byte
  // sectors, kept in L2 for the rounds that read them next), and each of the step's columns'
  // largest allowed x, merged over the column's eight lanes: lane l + 4 of a column pair keeps the
  // pair's two in its kLseParts slot (result_slot), which these loops use only with logprobs (not
  // such a call), and the merge takes the largest over the warps. Columns past the batch (padding)
  // are not stored; rows past the vocabulary neither, nor counted.
  CUTLASS_DEVICE static void store_step_logits(NodeArguments const& node, HandOver& hand_over, int half, int t, int q0,
                                               int num_rows, uint64_t l2_policy, float const (&x)[kStepElements],
                                               uint32_t const (&vocab_index)[kStepElements],
                                               uint32_t const (&column_index)[kStepElements],
                                               bool const (&allowed)[kStepElements]) {
    int const lane = t % 32;
    CUTLASS_PRAGMA_UNROLL
    for (int s = 0; s < kBlocksPerStep; ++s) {
      float column_max[2] = {-INFINITY, -INFINITY};
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {  // values (m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1)
        int const e = 4 * s + j;
        uint32_t const local = vocab_index[e] - node.vocab_start;
        bool const in_range = local < static_cast<uint32_t>(num_rows);
        if (in_range && column_index[e] < node.batch_size) {
          store_with_l2_policy(node.ptr_row_logits + static_cast<int64_t>(column_index[e]) * node.row_logits_stride + local,
                               top_scan_value(x[e], allowed[e]), l2_policy);
        }
        column_max[j % 2] = in_range && allowed[e] ? fmaxf(column_max[j % 2], x[e]) : column_max[j % 2];
      }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < 2; ++c) {
        CUTLASS_PRAGMA_UNROLL
        for (int delta = 4; delta < 32; delta *= 2) {
          column_max[c] = fmaxf(column_max[c], __shfl_xor_sync(0xFFFFFFFF, column_max[c], delta));
        }
      }
      if (lane >= 4 && lane < 8) {  // result_slot(kLseParts) of the block's column pair: the lane's own slot
        hand_over.accumulators[half][q0 + s][t] = make_float4(column_max[0], 0.0f, column_max[1], 0.0f);
      }
    }
  }

  // The floors of a block's column pair (n, n + 1): the exact skip's (score_floor) or the filtered
  // min_p winners' (min_p_floor).
  CUTLASS_DEVICE static float2 column_floors(__nv_bfloat16 const (&floors)[HandOver::kHalves][kTileN], int half,
                                             int column) {
    return __bfloat1622float2(reinterpret_cast<__nv_bfloat162 const&>(floors[half][column]));
  }

  // A score from its order code (number_order_bits); codes at or below -inf's (0: nothing yet) -inf.
  CUTLASS_DEVICE static float score_from_code(uint32_t code) {
    return code <= number_order_bits(-INFINITY) ? -INFINITY : from_order_bits(code);
  }

  // Whether an element may still be its column's sample: it is kept and its score bound (its score
  // with the noise's upper bound; its exact score on a greedy column, inv_temperature 0) is not
  // below the column's floor. Strict, so ties go to the exact path; a NaN bound counts as reaching.
  // Branch-free (selects, and callers OR the results with |, not ||): with branches per element
  // the loop spends several control instructions on each (docs/epilogue.md).
  CUTLASS_DEVICE static bool may_reach_floor(bool kept, float x, float inv_temperature, uint32_t bits, float floor) {
    float const noisy = fs_perturbed_score(x, inv_temperature, fs_gumbel_upper_bound_from_bits(bits));
    float const bound = inv_temperature == 0.0f ? x : noisy;
    return kept & !(bound < floor);
  }

  // Whether the warp needs the step's exact scores: some lane has an element that is kept and
  // whose score bound (its score with the noise's upper bound; its exact score where it draws
  // none) is not below its column's floor. If so, the contract's noise of the whole step
  // (eight elements, the two logs of each side by side; none for a greedy batch, whose scores
  // are its logits); if not, no element of the step can be its column's sample and the step
  // keeps no candidate. Warp-uniform.
  CUTLASS_DEVICE static bool exact_noise_needed(bool any_reachable, bool greedy, uint32_t const (&bits)[kStepElements],
                                                float (&gumbel)[kStepElements]) {
    if (!__any_sync(0xFFFFFFFF, any_reachable)) {
      return false;
    }
    if (!greedy) {
      fs_gumbel_from_bits_lanes<kStepElements>(bits, gumbel);
    }
    return true;
  }

  // Floors of the exact skip, thread t (< N) for column t. At the start of a tile: the best of the
  // half's own floor (when it belongs to the same N tile) and the global one, loaded a tile ahead.
  CUTLASS_DEVICE static void refresh_floor(HandOver& hand_over, int half, int t, int n_origin, int& floor_n_origin,
                                           uint32_t global_code) {
    float const own = floor_n_origin == n_origin ? __bfloat162float(hand_over.score_floor[half][t]) : -INFINITY;
    hand_over.score_floor[half][t] = __float2bfloat16_rd(fmaxf(own, score_from_code(global_code)));
    floor_n_origin = n_origin;
  }
  // After the tile's merge: a best score above the floor raises it, here and globally.
  CUTLASS_DEVICE static void raise_floor(HandOver& hand_over, uint32_t* noise_floors, int half, int t, int column,
                                         PackedCandidate best) {
    float const floor = __bfloat162float(hand_over.score_floor[half][t]);
    float const score = unpack_score(best);  // -inf for "no candidate"
    if (score > floor) {
      hand_over.score_floor[half][t] = __float2bfloat16_rd(score);
      atomicMax(noise_floors + column, number_order_bits(score));
    }
  }

  // The controls' loop over one 64 x N half tile (the visitor's loops, element for element:
  // the model-side scale and soft-cap, dense bias, then sparse bias, then the seen tokens'
  // penalties, then 1/T per column (0: a greedy row), masked or out-of-range elements no candidate and no mass), then per column the
  // best key with its transformed logit y and the (max2, sum) log-sum-exp part, merged over the
  // column's eight lanes here and over the four warps by the caller.
  //
  // kGeneralColumns: the loop for several samples (GEMM column s * B + b) and sparse bias, a copy
  // of its own: behind runtime branches in one loop, their per-column division and look-ups
  // would slow the common controls by about a tenth at B = 128-256 (docs/epilogue.md).
  template <bool kGeneralColumns, class CoordTensor>
  CUTLASS_DEVICE static void controls_half_tile(NodeArguments const& node, HandOver& hand_over,
                                                CoordTensor const& tCcAcc, int half, int t, int m_origin,
                                                int n_origin, int num_rows, uint64_t seed, uint64_t offset,
                                                bool skip, LseReferences const& references) {
    SamplingControls const& controls = node.controls;
    int const lane = t % 32;
    PackedCandidate const no_candidate = pack_candidate(-INFINITY, kNoCandidate);
    uint32_t const last_vocab = static_cast<uint32_t>(num_rows) - 1;
    static_assert(decltype(size<1>(tCcAcc))::value == 1, "one M block per thread: rows m and m + 8 in every block");
    // The thread's two vocabulary rows (m and m + 8 of every block) and their dense bias. Loads
    // of out-of-range rows and columns read in-range entries; those elements are not kept.
    uint32_t vocab_local[2];
    float row_bias[2];
    bool row_in_range[2];
    // Row r's bit in its mask word, 0 past the vocabulary: an element is kept where its column's
    // word has it (one LOP3 per element). Rows m and m + 8 lie in one 16-row group of the
    // half's 64 rows, so both sit in the same of its two words (the high one for warps 2 and 3).
    uint32_t row_mask_bit[2];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      vocab_local[r] = static_cast<uint32_t>(m_origin + get<0>(tCcAcc(2 * r)));
      row_bias[r] = controls.logit_bias ? __ldg(controls.logit_bias + min(vocab_local[r], last_vocab)) : 0.0f;
      row_in_range[r] = vocab_local[r] < static_cast<uint32_t>(num_rows);
      row_mask_bit[r] = row_in_range[r] ? 1u << (vocab_local[r] & 31u) : 0u;
    }
    bool const mask_high_word = (vocab_local[0] >> 5) & 1u;  // the half's 64 rows start a word pair
    bool const keyed_noise = needs_keyed_noise(node);
    bool const model_transform = controls.logit_scale != 1.0f || controls.logit_softcap != 0.0f;
    bool const penalties = controls.penalty_words != nullptr;
    bool const stores_logits = node.ptr_row_logits != nullptr;  // the plain pass (store_step_logits)
    uint64_t const keep_in_l2 = stores_logits ? l2_evict_last_policy() : 0ull;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int q0 = 0; q0 < kBlocksPerThread; q0 += kBlocksPerStep) {
      constexpr int N = kStepElements;
      float x[N], gumbel[N];
      uint32_t vocab_index[N], column_index[N], bits[N];
      // (rows made greedy by a per-row T of 0 draw noise they do not use)
      load_step<kGeneralColumns>(node, hand_over, tCcAcc, half, t, q0, m_origin, n_origin, seed, offset, x,
                                 vocab_index, column_index, bits, keyed_noise);
      // The model-side transforms of the raw logits (fs_model_logit), one warp-uniform branch per
      // step ahead of the element loop, which stays the same code without them.
      if (model_transform) {
        CUTLASS_PRAGMA_UNROLL
        for (int e = 0; e < N; ++e) {
          x[e] = fs_model_logit(x[e], controls.logit_scale, controls.logit_softcap, controls.inv_logit_softcap);
        }
      }
      // The log-sum-exp references of the step's columns, from the lanes that hold them.
      float reference2[kBlocksPerStep][2];
      if (node.logprobs) {
        int const holder = 4 * (q0 / kBlocksPerStep) + lane % 4;
        CUTLASS_PRAGMA_UNROLL
        for (int s = 0; s < kBlocksPerStep; ++s) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) reference2[s][c] = __shfl_sync(0xFFFFFFFF, references.held[s][c], holder);
        }
      }
      // The transformed inputs of the step: biased logits, each column's 1/T, the kept elements.
      float inv_temperature[kBlocksPerStep][2];
      bool keep[N];
      bool any_reachable = !skip;
      // Sparse bias: bit 2s + c where block s's column c has an entry among the half's rows;
      // the warp looks them up only if some lane has one.
      uint32_t sparse_blocks = 0;
      bool sparse_step = false;
      if constexpr (kGeneralColumns) {
        if (controls.sparse_bitmap) {
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < kBlocksPerStep; ++s) {
            int const tile_column = static_cast<int>(column_index[4 * s]) - n_origin;  // even: both in one word
            uint32_t const word = hand_over.sparse_columns[half][tile_column / 32];
            sparse_blocks |= ((word >> (tile_column % 32)) & 3u) << (2 * s);
          }
          sparse_step = __any_sync(0xFFFFFFFF, sparse_blocks != 0u);
        }
      }
      uint32_t column_row[kBlocksPerStep][2];  // the batch row of each block's two columns
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kBlocksPerStep; ++s) {
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          uint32_t row, sample;
          column_row_and_sample<kGeneralColumns>(node, column_index[4 * s + c], row, sample);
          column_row[s][c] = row;
          // (launch_sampler prepares the [B] array for these kernels: no division in this loop)
          inv_temperature[s][c] = controls.inv_temperatures ? __ldg(controls.inv_temperatures + row)
                                  : node.greedy                ? 0.0f
                                                               : node.inv_temperature;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            int const e = 4 * s + 2 * r + c;  // values (m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1)
            x[e] = controls.logit_bias ? fs_add(x[e], row_bias[r]) : x[e];
            if constexpr (kGeneralColumns) {
              if (sparse_step && ((sparse_blocks >> (2 * s + c)) & 1u) &&
                  row_in_range[r]) {
                x[e] = epilogue::add_sparse_bias(controls, row, vocab_local[r], vocab_index[e], x[e]);
              }
            }
          }
        }
      }
      // The penalties of the rows' seen tokens, after the biases (docs/penalties.md) and before
      // the skip's bounds: one warp-uniform branch per step, so without them the loops are the
      // code they were. Rows past the vocabulary look up the last one and are not kept.
      if (penalties) {
        CUTLASS_PRAGMA_UNROLL
        for (int s = 0; s < kBlocksPerStep; ++s) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              int const e = 4 * s + 2 * r + c;
              x[e] = epilogue::penalized_logit(controls, column_row[s][c], min(vocab_local[r], last_vocab), x[e]);
            }
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kBlocksPerStep; ++s) {
        int const tile_column = static_cast<int>(column_index[4 * s]) - n_origin;  // even
        float2 const floors = skip ? column_floors(hand_over.score_floor, half, tile_column) : float2{};
        // the mask words of the block's column pair: (n, low), (n, high), (n + 1, low), (n + 1, high)
        uint4 const mask_words = controls.allowed_mask
                                     ? reinterpret_cast<uint4 const&>(hand_over.mask_bits[half][tile_column])
                                     : make_uint4(~0u, ~0u, ~0u, ~0u);
        uint32_t const column_mask_word[2] = {mask_high_word ? mask_words.y : mask_words.x,
                                              mask_high_word ? mask_words.w : mask_words.z};
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            int const e = 4 * s + 2 * r + c;  // values (m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1)
            keep[e] = (column_mask_word[c] & row_mask_bit[r]) != 0u;
            // (without the skip any_reachable starts true: no branch per element either way)
            any_reachable |= may_reach_floor(keep[e], x[e], inv_temperature[s][c], bits[e], c ? floors.y : floors.x);
          }
        }
      }
      if (stores_logits) {  // the plain pass: x after the biases, the mask's tokens excluded
        store_step_logits(node, hand_over, half, t, q0, num_rows, keep_in_l2, x, vocab_index, column_index, keep);
      }
      bool const exact = exact_noise_needed(any_reachable, node.greedy, bits, gumbel);
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kBlocksPerStep; ++s) {
        // The transformed logits y of the block's elements, (column c, row r).
        bool greedy[2];
        float y[2][2];
        CUTLASS_PRAGMA_UNROLL
        for (int c = 0; c < 2; ++c) {
          greedy[c] = inv_temperature[s][c] == 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            int const e = 4 * s + 2 * r + c;  // values (m, n), (m, n + 1), (m + 8, n), (m + 8, n + 1)
            y[c][r] = greedy[c] ? x[e] : fs_mul(x[e], inv_temperature[s][c]);
          }
        }
        // Each column's best key over its eight lanes (lane bits 2-4) with its y; without exact
        // noise every key of the step is "no candidate". One branch per block, not per element.
        PackedCandidate column_key[2] = {no_candidate, no_candidate};
        float column_logit[2] = {0.0f, 0.0f};
        if (exact) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              int const e = 4 * s + 2 * r + c;
              float const score = greedy[c] ? x[e] : fs_perturbed_score(x[e], inv_temperature[s][c], gumbel[e]);
              PackedCandidate const key =
                  keep[e] ? pack_candidate(score, static_cast<int32_t>(vocab_index[e])) : PackedCandidate{0};
              column_logit[c] = key > column_key[c] ? y[c][r] : column_logit[c];
              column_key[c] = key_max(column_key[c], key);
            }
            CUTLASS_PRAGMA_UNROLL
            for (int delta = 4; delta < 32; delta *= 2) {
              PackedCandidate const other_key = __shfl_xor_sync(0xFFFFFFFF, column_key[c], delta);
              if (node.logprobs) {
                float const other_logit = __shfl_xor_sync(0xFFFFFFFF, column_logit[c], delta);
                column_logit[c] = other_key > column_key[c] ? other_logit : column_logit[c];
              }
              column_key[c] = key_max(column_key[c], other_key);
            }
          }
        }
        // Log-sum-exp parts (max2, sum of 2^(y2 - max2)) of each column over its eight lanes, one
        // exp2 per element. A part's max2 may be any reference that no term overflows against and
        // under which the column's mass does not vanish (stage 2 merges the parts with lse_merge):
        // the column's largest log-sum-exp over the half's earlier tiles of this N tile
        // (LseReferences) serves, and with every term of the block below 2^96 the parts are
        // (reference, sum), no max over the lanes (the max's three shuffles per column and its
        // selects would take ~6 of the ~15 instructions per element). Deterministic: the
        // persistent schedule gives a CTA the same tiles in the same order on every run.
        float column_max2[2] = {-INFINITY, -INFINITY}, column_sum[2] = {0.0f, 0.0f};
        bool referenced = false;
        if (node.logprobs) {
          float term_exponent[2][2];
          bool beyond = false;  // a term that might overflow, a NaN, or no reference yet: exact path
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              int const e = 4 * s + 2 * r + c;
              term_exponent[c][r] = keep[e] ? fmaf(y[c][r], epilogue::kLog2e, -reference2[s][c]) : -INFINITY;
              beyond |= !(term_exponent[c][r] <= kLargestTermExponent);
            }
          }
          referenced = !__any_sync(0xFFFFFFFF, beyond);
          if (referenced) {
            CUTLASS_PRAGMA_UNROLL
            for (int c = 0; c < 2; ++c) {
              column_max2[c] = reference2[s][c];
              column_sum[c] = exp2_approx(term_exponent[c][0]) + exp2_approx(term_exponent[c][1]);
              CUTLASS_PRAGMA_UNROLL
              for (int delta = 4; delta < 32; delta *= 2) {
                column_sum[c] += __shfl_xor_sync(0xFFFFFFFF, column_sum[c], delta);
              }
            }
          }
        }
        // The exact path (a half's first tile of an N tile, before it holds references, and
        // blocks with a NaN or a term beyond 2^96 against its reference): the column's max first
        // (shuffles of fmaxf), then the terms 2^(y2 - max), then their sum. An element equal to
        // the max adds 1 (a +inf max gives no inf - inf), -inf adds 0, NaN makes the sum NaN; a
        // column with nothing kept gets (-inf, 0).
        if (node.logprobs && !referenced) {
          CUTLASS_PRAGMA_UNROLL
          for (int c = 0; c < 2; ++c) {
            float term_y2[2];  // y * log2(e); -inf where the element adds no mass
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              term_y2[r] = keep[4 * s + 2 * r + c] ? y[c][r] * epilogue::kLog2e : -INFINITY;
              column_max2[c] = fmaxf(column_max2[c], term_y2[r]);  // a NaN y2 leaves the max
            }
            CUTLASS_PRAGMA_UNROLL
            for (int delta = 4; delta < 32; delta *= 2) {
              column_max2[c] = fmaxf(column_max2[c], __shfl_xor_sync(0xFFFFFFFF, column_max2[c], delta));
            }
            CUTLASS_PRAGMA_UNROLL
            for (int r = 0; r < 2; ++r) {
              float const y2 = term_y2[r];
              float const term = exp2_approx(y2 == column_max2[c] ? 0.0f : y2 - column_max2[c]);
              column_sum[c] += y2 == -INFINITY ? 0.0f : term;
            }
            CUTLASS_PRAGMA_UNROLL
            for (int delta = 4; delta < 32; delta *= 2) {
              column_sum[c] += __shfl_xor_sync(0xFFFFFFFF, column_sum[c], delta);
            }
          }
        }
        // The eight lanes of a column hold the same results now; lanes 0-3 keep their warp's keys,
        // 4-7 the (max2, sum) parts, 8-11 the winners' logits, each in its own slot of the block it
        // has just read (result_slot): one select and one store, no branches.
        uint4 const keys = make_uint4(static_cast<uint32_t>(column_key[0]), static_cast<uint32_t>(column_key[0] >> 32),
                                      static_cast<uint32_t>(column_key[1]), static_cast<uint32_t>(column_key[1] >> 32));
        uint4 const parts = make_uint4(__float_as_uint(column_max2[0]), __float_as_uint(column_sum[0]),
                                       __float_as_uint(column_max2[1]), __float_as_uint(column_sum[1]));
        uint4 const logits = make_uint4(__float_as_uint(column_logit[0]), __float_as_uint(column_logit[1]), 0u, 0u);
        uint4 const result = lane < 4 ? keys : lane < 8 ? parts : logits;
        if (lane < (node.logprobs ? 12 : 4)) {
          reinterpret_cast<uint4&>(hand_over.accumulators[half][q0 + s][t]) = result;
        }
      }
    }
  }

  // The mask words and dense bias a half tile's loop reads come from HBM (no other tile reads
  // them) while the W stream keeps HBM busy. Loads the loop waits for cost a round trip per
  // step, so thread t loads the two mask words of column t's batch row for the next
  // tile into registers (stored to shared memory when that tile starts), and the bias, read once
  // per tile, is asked into L2 one tile ahead.
  template <class WorkTileInfo>
  CUTLASS_DEVICE static void load_controls_ahead(NodeArguments const& node, WorkTileInfo const& work, int half,
                                                 int t, int num_rows, uint32_t (&mask_bits)[2], bool& sparse_column) {
    SamplingControls const& controls = node.controls;
    int const vocab_origin = work.M_idx * kTileM + half * kHalfM;
    if ((controls.allowed_mask || controls.sparse_bitmap) && t < kTileN) {
      // padding columns and rows past the vocabulary read in-range words; the loop keeps none of them
      uint32_t row, sample;
      uint32_t const column = static_cast<uint32_t>(work.N_idx * kTileN + t);
      if (node.num_samples > 1) {
        column_row_and_sample<true>(node, column, row, sample);
      } else {
        column_row_and_sample<false>(node, column, row, sample);
      }
      int64_t const last_word = controls.mask_words - 1;
      int64_t const first = static_cast<int64_t>(row) * controls.mask_words +
                            min(static_cast<int64_t>(vocab_origin >> 5), last_word);
      int64_t const second = first + (vocab_origin >> 5 < last_word ? 1 : 0);
      if (controls.allowed_mask) {
        mask_bits[0] = __ldg(controls.allowed_mask + first);
        mask_bits[1] = __ldg(controls.allowed_mask + second);
      }
      if (controls.sparse_bitmap) {
        sparse_column = (__ldg(controls.sparse_bitmap + first) | __ldg(controls.sparse_bitmap + second)) != 0u;
      }
    }
    if (controls.logit_bias && t < kHalfM / 32 && vocab_origin + 32 * t < num_rows) {
      prefetch_to_l2(controls.logit_bias + vocab_origin + 32 * t);  // 64 floats: two 128-byte lines
    }
  }
  // Column t's global floor code for tile `work` (L2: other SMs raise it); 0 past the columns.
  template <class WorkTileInfo>
  CUTLASS_DEVICE static uint32_t load_floor_code(Params const& params, WorkTileInfo const& work, int t) {
    int const column = work.N_idx * kTileN + t;
    return t < kTileN && column < get<1>(params.problem_shape) ? __ldcg(params.noise_floors + column) : 0u;
  }
  // The filtered min_p winners (Params::column_max_codes): column `column`'s min_p (where it does
  // not cut, sampler_params.h's min_p_cuts, the reduction does not read the row's candidates).
  CUTLASS_DEVICE static double column_min_p(Params const& params, int column) {
    return params.min_ps ? params.min_ps[min(static_cast<uint32_t>(column), params.node.batch_size - 1)] : params.min_p;
  }
  // The floor in y of the column's tokens that may pass its row's min_p. A survivor's y is at least
  // y0 + log(min_p) - 1e-9 (logits_rows.cuh's MinP::keeps, y0 the row's first y), and y0 is at
  // least fl(x * fl(1 / T)) of the column's largest x so far on any SM (rounding is monotone), so
  // this floor, 1e-8 lower and rounded down, is below every survivor. -inf before the column has a
  // largest x, or where min_p does not cut.
  CUTLASS_DEVICE static float min_p_floor(Params const& params, int column, double min_p) {
    if (column >= get<1>(params.problem_shape)) return -INFINITY;
    uint32_t const code = __ldcg(params.column_max_codes + column);
    float const first_y_bound = code > 1u ? fs_mul(from_order_bits(code), params.node.inv_temperature) : -INFINITY;
    if (!min_p_cuts(min_p) || !(fabsf(first_y_bound) < 1e6f)) return -INFINITY;
    return __double2float_rd(static_cast<double>(first_y_bound) + log(min_p) - 1e-8);
  }
  // Whether a column's tile winner may raise the exact skip's floors: not where min_p cuts. The
  // reduction needs every token the skip leaves out below the row's best surviving candidate, and
  // a floor from a winner that later fails min_p can lie above it (on LLM-like rows, whose first
  // token may come late, most early winners fail, and raising only winners some way above the
  // min_p floor still made many rows stream: docs/truncation_kernels.md). Rows whose min_p does
  // not cut raise them as plain sampling does.
  CUTLASS_DEVICE static bool may_raise_floor(bool filters_min_p, bool cuts) { return !filters_min_p || !cuts; }
  CUTLASS_DEVICE static void prefetch_to_l2(void const* address) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(address));
  }

  // One epilogue warpgroup: for each tile of the schedule, the loop over the 64 x N half that
  // MMA warpgroup `half` computed, then one candidate per column.
  template <class WorkTileInfo>
  CUTLASS_DEVICE static void run_epilogue(Params const& params, HandOver& hand_over, TileScheduler& scheduler,
                                          WorkTileInfo work, int half, int t) {
    NodeArguments const& node = params.node;
    int const lane = t % 32;
    // Coordinates (m, n) in the tile of each value, as MMA thread (half, t) holds them. In the
    // wgmma accumulator layout values 4q .. 4q + 3 are (m, n), (m, n + 1), (m + 8, n),
    // (m + 8, n + 1) with n even: four elements on two vocabulary rows and one batch quad,
    // the noise call's shape, and 4q / 4q + 2 (4q + 1 / 4q + 3) share a column.
    TiledMma tiled_mma;
    Tensor tCcAcc = tiled_mma.get_slice(half * NumThreadsPerWarpGroup + t)
                        .partition_C(make_identity_tensor(take<0, 2>(TileShape{})));  // (MMA, MMA_M, MMA_N)
    int const num_rows = get<0>(params.problem_shape);
    int const num_cols = get<1>(params.problem_shape);
    uint64_t seed = 0, offset = 0;
    resolve_noise_source(node.noise, seed, offset);
    PackedCandidate const no_candidate = pack_candidate(-INFINITY, kNoCandidate);
    uint32_t full_phase = 0;
    LseReferences references;
    // Whether the controls' loop sums log-sum-exp terms against references (FLASHSAMPLING_LSE_REFERENCE).
    bool const lse_references = kControls && node.logprobs && params.lse_references;
    uint32_t next_mask_bits[2] = {~0u, ~0u};
    bool next_sparse_column = false;
    if constexpr (kControls) {
      load_controls_ahead(node, work, half, t, num_rows, next_mask_bits, next_sparse_column);
    }
    // The exact skip: column t's global floor code for the next tile, and the N tile the
    // half's own floor of column t belongs to. A greedy batch skips too: its score bound is
    // the logit itself (inv_temperature 0), and a step below every floor needs no key merge.
    bool const skip = params.noise_floors != nullptr;
    // The plain loop's logit transforms (a call with logit_scale / logit_softcap / penalties alone).
    float const logit_scale = node.controls.logit_scale;
    float const softcap = node.controls.logit_softcap, inv_softcap = node.controls.inv_logit_softcap;
    bool const model_transform = !kControls && (logit_scale != 1.0f || softcap != 0.0f);
    bool const penalties = !kControls && node.controls.penalty_words != nullptr;
    // the plain pass of top_p or min_p alone (store_step_logits; the logit transforms and penalties are not among its calls).
    bool const stores_logits = !kTopCandidates && node.ptr_row_logits != nullptr;
    uint64_t const keep_in_l2 = stores_logits ? l2_evict_last_policy() : 0ull;
    // min_p alone with filtered winners: each column's min_p floor in hand_over.min_p_floor, read
    // at each tile's start for the freshest largest x; thread t keeps whether column t's min_p
    // cuts for the tile's merge (may_raise_floor).
    bool const filters_min_p = kLoop == SamplerLoop::kPlain && params.column_max_codes != nullptr;
    bool column_min_p_cuts = false;
    uint32_t next_floor_code = 0;
    int floor_n_origin = -1;
    if (skip) {
      next_floor_code = load_floor_code(params, work, t);
    }
    while (work.is_valid()) {
      int const m_origin = work.M_idx * kTileM;
      int const n_origin = work.N_idx * kTileN;
      auto const next_work = get<0>(scheduler.fetch_next_work(work));
      if constexpr (kControls) {
        uint32_t const mask_bits[2] = {next_mask_bits[0], next_mask_bits[1]};
        bool const sparse_column = next_sparse_column;
        if (next_work.is_valid()) {
          load_controls_ahead(node, next_work, half, t, num_rows, next_mask_bits, next_sparse_column);
        }
        // Every thread has left the previous tile's loop (the merge's barrier), so its bits may
        // be overwritten; the barrier below orders them before the loop's reads.
        if (node.controls.allowed_mask && t < kTileN) {
          hand_over.mask_bits[half][t] = make_uint2(mask_bits[0], mask_bits[1]);
        }
        if (node.controls.sparse_bitmap) {  // (every lane of the warp: a ballot)
          uint32_t const columns = __ballot_sync(0xFFFFFFFF, sparse_column);
          if (lane == 0 && t < kTileN) {
            hand_over.sparse_columns[half][t / 32] = columns;
          }
        }
      }
      if (skip && t < kTileN) {
        refresh_floor(hand_over, half, t, n_origin, floor_n_origin, next_floor_code);
      }
      if (filters_min_p && t < kTileN) {
        double const min_p = column_min_p(params, n_origin + t);
        column_min_p_cuts = min_p_cuts(min_p);
        hand_over.min_p_floor[half][t] = __float2bfloat16_rd(min_p_floor(params, n_origin + t, min_p));
      }
      // Orders this tile's floors (and the mask bits above) before the loop's reads.
      cutlass::arch::NamedBarrier::sync(NumThreadsPerWarpGroup, half);
      cutlass::arch::ClusterBarrier::wait(&hand_over.full[half], full_phase);
      full_phase ^= 1;
      if constexpr (kControls) {
        // (with logprobs always: without references held the loop takes the exact path)
        if (node.logprobs && references.n_origin != n_origin) {  // a new N tile: no references yet
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < kBlocksPerStep; ++s) references.held[s][0] = references.held[s][1] = -INFINITY;
          references.n_origin = n_origin;
        }
        if (node.num_samples > 1 || node.controls.sparse_bitmap != nullptr) {  // uniform: a loop each
          controls_half_tile<true>(node, hand_over, tCcAcc, half, t, m_origin, n_origin, num_rows, seed, offset, skip,
                                   references);
        } else {
          controls_half_tile<false>(node, hand_over, tCcAcc, half, t, m_origin, n_origin, num_rows, seed, offset,
                                    skip, references);
        }
      } else {
        // Two blocks (eight elements: four Philox chains, eight logs where drawn) per step, inlined
        // so the compiler interleaves their chains; a rolled loop keeps the code small.
        CUTLASS_PRAGMA_NO_UNROLL
        for (int q0 = 0; q0 < kBlocksPerThread; q0 += kBlocksPerStep) {
          constexpr int N = kStepElements;
          float x[N], gumbel[N];
          uint32_t vocab_index[N], column_index[N], bits[N];
          // (several samples: step_noise_bits' uniform branch on num_samples per block)
          load_step<true>(node, hand_over, tCcAcc, half, t, q0, m_origin, n_origin, seed, offset, x, vocab_index,
                          column_index, bits);
          if (stores_logits) {
            bool every_token[N];  // (no mask in the plain loop)
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < N; ++e) every_token[e] = true;
            store_step_logits(node, hand_over, half, t, q0, num_rows, keep_in_l2, x, vocab_index, column_index,
                              every_token);
          }
          // A call with logit_scale / logit_softcap and / or the penalties alone (fs_model_logit,
          // split, then the penalties, as the controls' loop applies them): the scale here, the
          // soft-cap and the penalties below, in steps whose exact scores are needed. The skip
          // bounds a capped logit without the tanh (fs_softcap_upper_bound) and a penalised one
          // by the logit where the row's penalties only lower logits (penalty_lowers; other rows'
          // elements always reach). Warp-uniform branches, so the loop of a plain call is the
          // code it was.
          float bounded_x[N];
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < N; ++e) bounded_x[e] = x[e];
          if (model_transform) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < N; ++e) {
              x[e] = logit_scale != 1.0f ? fs_mul(x[e], logit_scale) : x[e];
              bounded_x[e] = softcap != 0.0f ? fs_softcap_upper_bound(x[e], softcap) : x[e];
            }
          }
          uint32_t column_row[N];  // (penalties only) padding columns read the last row's
          if (penalties) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < N; ++e) {
              column_row[e] = min(column_index[e], node.batch_size - 1);
              bool const lowers = __ldg(node.controls.penalty_lowers + column_row[e]) != 0u;
              bounded_x[e] = lowers ? bounded_x[e] : INFINITY;
            }
          }
          bool in_range[N];
          bool any_reachable = !skip;
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < kBlocksPerStep; ++s) {
            int const tile_column = static_cast<int>(column_index[4 * s]) - n_origin;
            float2 const floors = skip ? column_floors(hand_over.score_floor, half, tile_column) : float2{};
            float2 const min_p_floors =
                filters_min_p ? column_floors(hand_over.min_p_floor, half, tile_column) : float2{};
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 4; ++j) {
              int const e = 4 * s + j;
              in_range[e] = vocab_index[e] - node.vocab_start < static_cast<uint32_t>(num_rows);
              if (filters_min_p) {  // a token below its min_p floor is no candidate (a NaN stays one)
                in_range[e] = in_range[e] & !(fs_mul(x[e], node.inv_temperature) < (j % 2 ? min_p_floors.y : min_p_floors.x));
              }
              any_reachable |= may_reach_floor(in_range[e], bounded_x[e], node.inv_temperature, bits[e],
                                               j % 2 ? floors.y : floors.x);
            }
          }
          bool const exact = exact_noise_needed(any_reachable, node.greedy, bits, gumbel);
          if (exact && softcap != 0.0f) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < N; ++e) x[e] = fs_mul(softcap, fs_tanhf(fs_mul(x[e], inv_softcap)));
          }
          if (exact && penalties) {  // rows past the vocabulary look up the last one and are not kept
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < N; ++e) {
              uint32_t const vocab_local = min(vocab_index[e] - node.vocab_start, static_cast<uint32_t>(num_rows) - 1);
              x[e] = epilogue::penalized_logit(node.controls, column_row[e], vocab_local, x[e]);
            }
          }
          // Per block: the thread's two rows of each of its two columns, then the eight lanes of
          // the column (lane bits 2-4); lanes 0-3 keep their warp's result for the step below.
          CUTLASS_PRAGMA_UNROLL
          for (int s = 0; s < kBlocksPerStep; ++s) {
            PackedCandidate column_key[2] = {no_candidate, no_candidate};
            if (exact) {  // (else every key of the step is "no candidate")
              PackedCandidate key[4];
              CUTLASS_PRAGMA_UNROLL
              for (int j = 0; j < 4; ++j) {
                int const e = 4 * s + j;
                float const score = node.greedy ? x[e] : fs_perturbed_score(x[e], node.inv_temperature, gumbel[e]);
                key[j] = in_range[e] ? pack_candidate(score, static_cast<int32_t>(vocab_index[e])) : PackedCandidate{0};
              }
              column_key[0] = key_max(no_candidate, key_max(key[0], key[2]));
              column_key[1] = key_max(no_candidate, key_max(key[1], key[3]));
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < 2; ++c) {
                CUTLASS_PRAGMA_UNROLL
                for (int delta = 4; delta < 32; delta *= 2) {
                  column_key[c] = key_max(column_key[c], __shfl_xor_sync(0xFFFFFFFF, column_key[c], delta));
                }
              }
            }
            if (lane < 4) {  // result_slot(kKeys) of the block's column pair: the lane's own slot
              reinterpret_cast<ulonglong2&>(hand_over.accumulators[half][q0 + s][t]) =
                  make_ulonglong2(column_key[0], column_key[1]);
            }
          }
        }
      }
      // The next tile's global floors, asked for after this tile's loop (the merge runs under the
      // load): the later, the more CTAs have raised them. Loaded a whole tile ahead, a CTA's
      // second tile would read them before any CTA's first merge.
      if (skip && next_work.is_valid()) {
        next_floor_code = load_floor_code(params, next_work, t);
      }
      cutlass::arch::NamedBarrier::sync(NumThreadsPerWarpGroup, half);
      int const candidate_row = work.M_idx * (kTileM / kHalfM) + half;
      int const column = t;
      if (t < kTileN) {
        PackedCandidate best = result_key(hand_over, half, column, 0);
        int best_warp = 0;
        CUTLASS_PRAGMA_UNROLL
        for (int w = 1; w < 4; ++w) {
          PackedCandidate const other = result_key(hand_over, half, column, w);
          if constexpr (kControls) {
            best_warp = other > best ? w : best_warp;
          }
          best = key_max(best, other);
        }
        bool const written = n_origin + column < num_cols && candidate_row * kHalfM < num_rows;
        int64_t const out = static_cast<int64_t>(candidate_row) * num_cols + n_origin + column;
        if (written) {
          node.ptr_candidates[out] = best;
        }
        if (stores_logits && written) {  // the column's largest logit over the warps (store_step_logits)
          float tile_max = -INFINITY;
          CUTLASS_PRAGMA_UNROLL
          for (int w = 0; w < 4; ++w) {
            float4 const parts = result_slot(hand_over, half, column, w, kLseParts);
            tile_max = fmaxf(tile_max, column % 2 ? parts.z : parts.x);
          }
          node.ptr_tile_max_logits[out] = tile_max;
          if (filters_min_p && tile_max > -INFINITY) {  // the later tiles' min_p floors
            atomicMax(params.column_max_codes + n_origin + column, number_order_bits(tile_max));
          }
        }
        if constexpr (kControls) {
          if (node.logprobs) {
            // (every column, padding ones too: their lanes need references like the others)
            bool const odd = column % 2;
            float4 parts = result_slot(hand_over, half, column, 0, kLseParts);
            float2 lse = odd ? make_float2(parts.z, parts.w) : make_float2(parts.x, parts.y);
            CUTLASS_PRAGMA_UNROLL
            for (int w = 1; w < 4; ++w) {
              parts = result_slot(hand_over, half, column, w, kLseParts);
              lse_merge(lse.x, lse.y, odd ? parts.z : parts.x, odd ? parts.w : parts.y);
            }
            if (lse_references) {
              lse_reference_slot(hand_over, half, column) = lse.x + log2_approx(lse.y);  // -inf: no mass
            }
            if (written) {
              float4 const logits = result_slot(hand_over, half, column, best_warp, kWinnerLogits);
              node.ptr_candidate_logits[out] = odd ? logits.y : logits.x;
              node.ptr_lse_parts[out] = lse;
            }
          }
        }
        if (skip && n_origin + column < num_cols && may_raise_floor(filters_min_p, column_min_p_cuts)) {
          raise_floor(hand_over, params.noise_floors, half, t, n_origin + column, best);
        }
      }
      if constexpr (kControls) {
        if (lse_references) {  // each lane: the larger of what it held and the tile's
          cutlass::arch::NamedBarrier::sync(NumThreadsPerWarpGroup, half);
          int const step = lane / 4;
          if (step < kSteps) {
            CUTLASS_PRAGMA_UNROLL
            for (int s = 0; s < kBlocksPerStep; ++s) {
              int const pair_column = 8 * (kBlocksPerStep * step + s) + 2 * (lane % 4);
              float2 const pair = reinterpret_cast<float2 const&>(lse_reference_slot(hand_over, half, pair_column));
              float const tile_lse2[2] = {pair.x, pair.y};
              CUTLASS_PRAGMA_UNROLL
              for (int c = 0; c < 2; ++c) {
                // (a NaN or +inf log-sum-exp leaves the reference: such columns take the exact path)
                if (tile_lse2[c] < INFINITY) references.held[s][c] = fmaxf(references.held[s][c], tile_lse2[c]);
              }
            }
          }
        }
      }
      cutlass::arch::ClusterBarrier::arrive(&hand_over.empty[half]);  // after the merge's reads
      work = next_work;
    }
  }

  // The fused top-k pass (kTopCandidates). Its outputs are the visitor's top-k scan's on CUTLASS's
  // cooperative 128 x 128 tile (reduce_top_candidates_scan), bit for bit: there the epilogue
  // subtile is 128 x 32 over 256 threads, so 8 threads share a column and each scans a run of 16
  // rows (run r: rows 16 r .. 16 r + 15 of the tile), and a column's log-mass part is a butterfly
  // over its 8 runs' parts in which thread r merges r ^ 4, then r ^ 2, then r ^ 1 into its own
  // (lse_merge is not symmetric, so the order is part of the bits) and thread 0 writes. Here run r
  // is warp r % 4 of half r / 4 (an MMA warp holds 16 rows of its 64): each epilogue thread scans
  // whole runs with the shared steps of candidate_math.cuh (top_scan_value, top_scan_key,
  // add_top_scan_run_mass), leaves each run's keys and part in the slots it has read, and after
  // the two warpgroups meet one thread per column merges its eight runs in the butterfly's order.
  // The keys' merge order does not matter: the four largest of distinct keys are the same.
  static constexpr int kScanRunRows = 16;                                // rows of a run
  static constexpr int kColumnPairs = kTileN / 2;                        // a float4 slot holds two columns
  static constexpr int kRunsPerHalf = kHalfM / kScanRunRows;             // one per MMA warp
  static constexpr int kScanItems = kColumnPairs * kRunsPerHalf;         // (column pair, run) of a half
  static constexpr int kScanItemsPerThread = kScanItems / NumThreadsPerWarpGroup;
  static_assert(!kTopCandidates || kScanItems % NumThreadsPerWarpGroup == 0, "whole items per thread");
  // Named barrier of the two epilogue warpgroups together (0 and 1 are each one's own).
  static constexpr uint32_t kTopMergeBarrier = 2;
  // The result slots of an item, among its eight (scan_slot's row8): each column's four keys in
  // two, both columns' log-mass parts (max2, sum) in one.
  static constexpr int kKeySlot = 0;   // column c's keys: row8 2c and 2c + 1
  static constexpr int kPartSlot = 4;  // (max2, sum) of column 0, then of column 1

  // Slot row8 of a scan item: rows row8 and row8 + 8 of MMA warp `warp`'s 16 rows of the half,
  // columns 2 pair and 2 pair + 1 of the tile, as the wgmma layout puts them in MMA thread
  // 32 warp + 4 row8 + pair % 4's block pair / 4: (row8, 2 pair), (row8, 2 pair + 1),
  // (row8 + 8, 2 pair), (row8 + 8, 2 pair + 1).
  CUTLASS_DEVICE static float4& scan_slot(HandOver& hand_over, int half, int pair, int warp, int row8) {
    return hand_over.accumulators[half][pair / 4][32 * warp + 4 * row8 + pair % 4];
  }

  // One run of two columns: the visitor's element steps (x, + dense bias, mask -> the scanned
  // value), the four largest keys of each column, its values to row_logits and its log-mass part
  // (both only where the fused truncation stores rows), then the results to the item's slots.
  CUTLASS_DEVICE static void scan_top_candidates_run(NodeArguments const& node, HandOver& hand_over, int half,
                                                     int pair, int warp, int m_origin, int n_origin, int num_rows) {
    SamplingControls const& controls = node.controls;
    // The eight slots, loaded with row8 = j ^ (block parity): the eight threads of a quarter warp
    // (neighbouring pairs of one warp) then read eight different 16-byte bank groups (in row8
    // order two of them share each); back in row order by a select per pair of slots. The dense
    // bias is added as the visitor adds it (rows past the vocabulary read an in-range entry and
    // are not kept).
    uint32_t const first_local = static_cast<uint32_t>(m_origin + half * kHalfM + warp * kScanRunRows);
    uint32_t const last_vocab = static_cast<uint32_t>(num_rows) - 1;
    int const swap = (pair / 4) % 2;
    float x[2][kScanRunRows];  // (column, row of the run)
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < 8; j += 2) {
      float4 const a = scan_slot(hand_over, half, pair, warp, j + swap);
      float4 const b = scan_slot(hand_over, half, pair, warp, j + 1 - swap);
      float4 const block[2] = {swap ? b : a, swap ? a : b};  // rows j, j + 1 (and + 8)
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 2; ++k) {
        int const i = j + k;
        x[0][i] = block[k].x;
        x[1][i] = block[k].y;
        x[0][i + 8] = block[k].z;
        x[1][i + 8] = block[k].w;
        if (controls.logit_bias) {
          float const bias = __ldg(controls.logit_bias + min(first_local + i, last_vocab));
          float const bias8 = __ldg(controls.logit_bias + min(first_local + i + 8, last_vocab));
          x[0][i] = fs_add(x[0][i], bias);
          x[1][i] = fs_add(x[1][i], bias);
          x[0][i + 8] = fs_add(x[0][i + 8], bias8);
          x[1][i + 8] = fs_add(x[1][i + 8], bias8);
        }
      }
    }
    float2 part[2];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < 2; ++c) {
      uint32_t const column = static_cast<uint32_t>(n_origin + 2 * pair + c);
      // the run's 16 rows lie in one mask word (runs start at multiples of 16)
      uint32_t const mask_row = min(column, node.batch_size - 1);
      uint32_t const mask_word =
          controls.allowed_mask
              ? __ldg(controls.allowed_mask + static_cast<int64_t>(mask_row) * controls.mask_words +
                      (min(first_local, last_vocab) >> 5))
              : ~0u;
      float (&value)[kScanRunRows] = x[c];  // the scanned values replace x
      PackedCandidate top[kTopCandidatesPerTile] = {};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kScanRunRows; ++i) {
        uint32_t const v = first_local + i;
        bool const keep = v < static_cast<uint32_t>(num_rows) && ((mask_word >> (v & 31u)) & 1u);
        value[i] = top_scan_value(value[i], keep);
        insert_top_candidate(top, top_scan_key(value[i], node.vocab_start + v));
      }
      // (the keys first: their registers are free for the mass)
      reinterpret_cast<ulonglong2&>(scan_slot(hand_over, half, pair, warp, kKeySlot + 2 * c)) =
          make_ulonglong2(top[0], top[1]);
      reinterpret_cast<ulonglong2&>(scan_slot(hand_over, half, pair, warp, kKeySlot + 2 * c + 1)) =
          make_ulonglong2(top[2], top[3]);
      if (node.ptr_run_keys != nullptr && column < node.batch_size && first_local < static_cast<uint32_t>(num_rows)) {
        // the run's keys where the large top_k's selection reads them in place of its x
        static_assert(kScanRunRows == kRunKeysRunTokens && kTopCandidatesPerTile == 4, "a run's keys: two 16-byte stores");
        ulonglong2* const out = reinterpret_cast<ulonglong2*>(node.ptr_run_keys +
                                                              static_cast<int64_t>(column) * node.run_keys_stride +
                                                              (first_local / kScanRunRows) * kTopCandidatesPerTile);
        out[0] = make_ulonglong2(top[0], top[1]);
        out[1] = make_ulonglong2(top[2], top[3]);
      }
      part[c] = make_float2(-INFINITY, 0.0f);
      if (node.ptr_row_logits != nullptr && column < node.batch_size) {
        // x where a later kernel may read them (the row's stride covers whole 128-row tiles, so
        // the tail past V needs no bound)
        if (scan_stores_row_logits(node.ptr_row_top_ks, static_cast<uint32_t>(column))) {
          float4* stored = reinterpret_cast<float4*>(node.ptr_row_logits +
                                                     static_cast<int64_t>(column) * node.row_logits_stride + first_local);
          CUTLASS_PRAGMA_UNROLL
          for (int q = 0; q < kScanRunRows / 4; ++q) {
            stored[q] = make_float4(value[4 * q], value[4 * q + 1], value[4 * q + 2], value[4 * q + 3]);
          }
        }
        add_top_scan_run_mass<kScanRunRows>(value, top_scan_log2_scale(controls, column, node.inv_temperature),
                                            part[c].x, part[c].y);
      }
    }
    scan_slot(hand_over, half, pair, warp, kPartSlot) = make_float4(part[0].x, part[0].y, part[1].x, part[1].y);
  }

  // Column `column` of the tile (both halves' runs in their slots): the four largest of its eight
  // runs' keys and its log-mass part merged in the visitor's butterfly order, written where the
  // visitor writes them (slot m_tile * N + column).
  CUTLASS_DEVICE static void merge_top_candidates_column(NodeArguments const& node, HandOver& hand_over, int column,
                                                         int m_tile, int n_origin, int num_cols) {
    constexpr int kRuns = 2 * kRunsPerHalf;
    int const pair = column / 2;
    int const odd = column % 2;
    int const tile_column = n_origin + column;
    bool const written = tile_column < num_cols;
    int64_t const slot = static_cast<int64_t>(m_tile) * num_cols + tile_column;
    // The keys, then the parts: one of the two held at a time (both at once spilled).
    PackedCandidate best[kTopCandidatesPerTile];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRuns; ++r) {
      int const half = r / kRunsPerHalf, warp = r % kRunsPerHalf;
      ulonglong2 const first =
          reinterpret_cast<ulonglong2 const&>(scan_slot(hand_over, half, pair, warp, kKeySlot + 2 * odd));
      ulonglong2 const second =
          reinterpret_cast<ulonglong2 const&>(scan_slot(hand_over, half, pair, warp, kKeySlot + 2 * odd + 1));
      PackedCandidate const keys[kTopCandidatesPerTile] = {first.x, first.y, second.x, second.y};
      if (r == 0) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kTopCandidatesPerTile; ++j) best[j] = keys[j];
      } else {
        merge_top_candidates(best, keys);
      }
    }
    if (written) {
      PackedCandidate* out = node.ptr_candidates + slot * kTopCandidatesPerTile;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kTopCandidatesPerTile; ++j) out[j] = best[j];
    }
    if (node.ptr_row_logits == nullptr) {  // no mass: the visitor writes no part either
      return;
    }
    float2 part[kRuns];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRuns; ++r) {
      float4 const parts = scan_slot(hand_over, r / kRunsPerHalf, pair, r % kRunsPerHalf, kPartSlot);
      part[r] = odd ? make_float2(parts.z, parts.w) : make_float2(parts.x, parts.y);
    }
    // The butterfly: at step delta, run r < delta merges run r + delta (= r ^ delta) into its own.
    CUTLASS_PRAGMA_UNROLL
    for (int delta = kRuns / 2; delta > 0; delta /= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < delta; ++r) lse_merge(part[r].x, part[r].y, part[r + delta].x, part[r + delta].y);
    }
    if (written && static_cast<uint32_t>(tile_column) < node.batch_size) node.ptr_lse_parts[slot] = part[0];
  }

  // The top-k pass's epilogue warpgroup: for each tile, its half's runs, then (both warpgroups at
  // the barrier) the merge of its half of the columns (64 of 128, 32 of 64) over both halves; each thread gives
  // both buffers back once it has read them. The next tile is fetched after the tile (nothing is loaded
  // ahead here): fetched first, its coordinates and the scheduler's 64-bit index stayed live
  // through the scan and spilled (80 bytes of spill stores at 96 registers).
  template <class WorkTileInfo>
  CUTLASS_DEVICE static void run_top_candidates_epilogue(Params const& params, HandOver& hand_over,
                                                         TileScheduler& scheduler, WorkTileInfo work, int half,
                                                         int t) {
    NodeArguments const& node = params.node;
    int const num_rows = get<0>(params.problem_shape);
    int const num_cols = get<1>(params.problem_shape);
    constexpr uint32_t kBothWarpGroups = kEpilogueWarpGroups * NumThreadsPerWarpGroup;
    uint32_t full_phase = 0;
    while (work.is_valid()) {
      int const m_origin = work.M_idx * kTileM;
      int const n_origin = work.N_idx * kTileN;
      cutlass::arch::ClusterBarrier::wait(&hand_over.full[half], full_phase);
      full_phase ^= 1;
      // Item t + 128 i: column pair item % kColumnPairs, run (MMA warp) item / kColumnPairs; a
      // warp's 32 threads take neighbouring pairs of one run.
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0; i < kScanItemsPerThread; ++i) {
        int const item = t + i * NumThreadsPerWarpGroup;
        scan_top_candidates_run(node, hand_over, half, item % kColumnPairs, item / kColumnPairs, m_origin, n_origin,
                                num_rows);
      }
      cutlass::arch::NamedBarrier::sync(kBothWarpGroups, kTopMergeBarrier);  // both halves' runs are in place
      constexpr int kColumnsPerWarpGroup = kTileN / kEpilogueWarpGroups;
      if (t < kColumnsPerWarpGroup) {
        merge_top_candidates_column(node, hand_over, half * kColumnsPerWarpGroup + t, work.M_idx, n_origin, num_cols);
      }
      // Each thread frees both halves after its own reads (an MMA warpgroup overwrites its half
      // once all 256 threads have arrived): every reader orders its reads before the MMA's writes
      // by its own arrive, not through a barrier with the other warpgroup.
      for (int w = 0; w < HandOver::kHalves; ++w) cutlass::arch::ClusterBarrier::arrive(&hand_over.empty[w]);
      work = get<0>(scheduler.fetch_next_work(work));
    }
  }
};

}  // namespace flashsampling::kernel
