// Epilogue-visitor-tree node: Gumbel-Max sampling over the M (vocabulary) mode.
//
// The GEMM computes logits[v, b] = W[v, :] . h[b, :] with the vocabulary on M and
// the batch on N. This node sits at the root of the tree over Sm90AccFetch:
//
//   Sm90EVT<Sm90GumbelArgmaxRowReduction<CtaTileShapeMNK>, Sm90AccFetch>
//
// While an accumulator tile is in registers it perturbs every logit with the
// Philox Gumbel noise of its global (batch row, vocab index), keeps the best
// (score, index) per batch column and writes one packed candidate per
// (vocabulary tile, batch column) to a workspace; kernels/reduce_candidates.cu
// reduces those to one token per row. No logits reach global memory.
//
// Layout and reduction choreography follow Sm90RowReduction
// (sm90_visitor_store_tma_warpspecialized.hpp), which also reduces over M and
// emits one value per N column: per-thread registers aliased over M (stride-0
// modes), a warp-shuffle stage over the lanes that share a column, a
// shared-memory stage over the warps stacked in M, then a global write. Two
// differences: the reduced value is a (score, index) pair packed into 64 bits,
// and the cross-thread stages run once per epilogue column strip (epi_n) instead
// of once per tile, so each thread keeps state only for the columns of one
// strip; that keeps the register budget flat at batch 256.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/fusion/sm90_visitor_tma_warpspecialized.hpp"

#include "flashsampling/philox_gumbel.h"
#include "flashsampling/sampler_params.h"

namespace flashsampling::epilogue {

using namespace cute;
using cutlass::epilogue::fusion::ConsumerStoreArgs;
using cutlass::epilogue::fusion::ProducerLoadArgs;
using cutlass::epilogue::fusion::detail::EmptyConsumerStoreCallbacks;
using cutlass::epilogue::fusion::detail::EmptyProducerLoadCallbacks;
using cutlass::epilogue::fusion::detail::sm90_partition_for_epilogue;

// Packs a candidate so that unsigned max == "better" of philox_gumbel.h.
CUTLASS_DEVICE PackedCandidate pack_candidate(float score, int32_t index) {
  // +0.0f folds -0 into +0: the two compare equal as floats, so must as keys.
  uint32_t bits = __float_as_uint(score + 0.0f);
  bits = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  bits = (score != score) ? 0u : bits;  // NaN loses to everything, like fs_candidate_better
  return (static_cast<PackedCandidate>(bits) << 32) | static_cast<uint32_t>(~index);
}

CUTLASS_DEVICE PackedCandidate max_candidate(PackedCandidate a, PackedCandidate b) {
  return a > b ? a : b;
}

// Out-of-line noise for wide tiles: the collective unrolls every epilogue subtile of
// the CTA tile, so an inlined Philox + two logs per element grows the kernel with the
// tile's N extent. Calling it out of line halved B = 128 / 256 times on H200 (the inlined
// N = 128 kernel issued on 13% of cycles); N = 64 measured the same either way.
// benchmarks/NOTES.md has the numbers.
static __device__ __noinline__ Philox4 noise_block_out_of_line(uint64_t seed, uint64_t offset_plus_sample,
                                                        uint32_t vocab_index, uint32_t stream_quad) {
  return fs_noise_block(seed, offset_plus_sample, vocab_index, stream_quad);
}

static __device__ __noinline__ float gumbel_from_bits_out_of_line(uint32_t bits) { return fs_gumbel_from_bits(bits); }

// Reads seed/offset from device memory when the caller passed pointers (CUDA-graph
// replay sees fresh values), else uses the values.
CUTLASS_DEVICE void resolve_noise_source(NoiseSource const& src, uint64_t& seed, uint64_t& offset) {
  seed = src.seed_device ? static_cast<uint64_t>(*src.seed_device) : src.seed;
  offset = src.offset_device ? static_cast<uint64_t>(*src.offset_device) + src.offset_device_add
                             : src.offset;
}

// ElementOutput: what visit() hands on to the collective. With ElementD = void
// (sm90) nothing is stored and the collective takes its shared-memory element from
// ElementAux; the reduce() stage reuses that epilogue buffer as scratch, as
// Sm90RowReduction does. Where a D store cannot be switched off (sm100 in CUTLASS
// 4.2), ElementOutput is the scratch D element and visit() emits zeros.
template <class CtaTileShapeMNK, class ElementOutput = float>
struct Sm90GumbelArgmaxRowReduction {
  using ElementAux = ElementOutput;
  static constexpr bool kNoiseOutOfLine = decltype(size<1>(CtaTileShapeMNK{}))::value >= 64;

  struct SharedStorage {};

  struct Arguments {
    PackedCandidate* ptr_candidates = nullptr;  // [ceil(M / CTA_M), N] row-major
    NoiseSource noise = {};
    float inv_temperature = 1.0f;
    bool greedy = false;
    uint32_t sample = 0;  // sample index drawn by this pass
  };

  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.ptr_candidates != nullptr;
  }

  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }

  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE Sm90GumbelArgmaxRowReduction() {}

  CUTLASS_HOST_DEVICE Sm90GumbelArgmaxRowReduction(Params const& params, SharedStorage const&)
      : params(params) {}

  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(ProducerLoadArgs<Args...> const&) {
    return EmptyProducerLoadCallbacks{};
  }

  template <class ArgsTuple>
  struct ConsumerStoreCallbacks : EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(ArgsTuple&& args_tuple, Params const& params)
        : args_tuple(cute::forward<ArgsTuple>(args_tuple)), params(params) {}

    ArgsTuple args_tuple;
    Params const& params;
    uint64_t seed = 0;
    uint64_t offset_plus_sample = 0;

    CUTLASS_DEVICE void begin() {
      uint64_t offset;
      resolve_noise_source(params.noise, seed, offset);
      offset_plus_sample = offset + params.sample;
      reset_strip();
    }

    CUTLASS_DEVICE void reset_strip() {
      auto& tCrScore = get<1>(args_tuple);
      auto& tCrIndex = get<2>(args_tuple);
      fill(tCrScore, -INFINITY);
      fill(tCrIndex, int32_t{kNoCandidate});
    }

    template <typename ElementAccumulator, typename ElementInput, int FragmentSize>
    CUTLASS_DEVICE auto visit(cutlass::Array<ElementAccumulator, FragmentSize> const& frg_acc, int epi_v, int epi_m,
                              int epi_n, cutlass::Array<ElementInput, FragmentSize> const& frg_logits) {
      auto& [ref_src, tCrScore, tCrIndex, tCcD, residue_tCcD, problem_mn, sBuf_layout, lane_layout_MN, lane_mn,
             warp_layout_MN, warp_mn, tile_coord_mnkl, epi_tile, tiled_copy, thread_idx] = args_tuple;
      Tensor tCcD_mn = tCcD(_, _, _, epi_m, epi_n);
      // Absolute coordinate = problem extent - residue of this thread + relative coordinate.
      int const m_origin = get<0>(problem_mn) - get<0>(residue_tCcD);
      int const n_origin = get<1>(problem_mn) - get<1>(residue_tCcD);

      // One Philox block holds the noise of 4 consecutive batch rows at one vocab
      // index; accumulator layouts keep neighbouring columns in neighbouring
      // fragment slots (wgmma: pairs, tcgen05: runs), so reuse the last block.
      uint32_t block_vocab = ~0u, block_quad = ~0u;
      Philox4 block{};
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) {
        int const frg_idx = epi_v * FragmentSize + i;
        auto const coord = tCcD_mn(frg_idx);
        if (elem_less(coord, residue_tCcD)) {
          uint32_t const vocab_index = static_cast<uint32_t>(m_origin + get<0>(coord));
          uint32_t const batch_row = static_cast<uint32_t>(n_origin + get<1>(coord));
          float const logit = static_cast<float>(frg_logits[i]);
          float score = logit;
          if (!params.greedy) {
            if (vocab_index != block_vocab || (batch_row >> 2) != block_quad) {
              block = kNoiseOutOfLine ? noise_block_out_of_line(seed, offset_plus_sample, vocab_index, batch_row >> 2)
                                      : fs_noise_block(seed, offset_plus_sample, vocab_index, batch_row >> 2);
              block_vocab = vocab_index;
              block_quad = batch_row >> 2;
            }
            uint32_t const bits = fs_philox_lane(block, batch_row & 3u);
            float const gumbel = kNoiseOutOfLine ? gumbel_from_bits_out_of_line(bits) : fs_gumbel_from_bits(bits);
            score = fs_perturbed_score(logit, params.inv_temperature, gumbel);
          }
          // Registers alias over M (stride-0 modes): rows of one column share a slot.
          float& best_score = tCrScore(frg_idx);
          int32_t& best_index = tCrIndex(frg_idx);
          if (fs_candidate_better(score, static_cast<int32_t>(vocab_index), best_score, best_index)) {
            best_score = score;
            best_index = static_cast<int32_t>(vocab_index);
          }
        }
      }
      if constexpr (cute::is_same_v<ElementOutput, ElementInput>) {
        return frg_logits;
      } else {
        cutlass::Array<ElementOutput, FragmentSize> zeros;
        zeros.fill(ElementOutput(0));
        return zeros;
      }
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&& smem_buffer, SyncFn const& sync_fn, int epi_m, int epi_n,
                               bool is_last_iteration, VTensor visit_results) {
      auto& [ref_src, tCrScore, tCrIndex, tCcD, residue_tCcD, problem_mn, sBuf_layout, lane_layout_MN, lane_mn,
             warp_layout_MN, warp_mn, tile_coord_mnkl, epi_tile, tiled_copy, thread_idx] = args_tuple;
      constexpr int EpiM = decltype(size<3>(tCcD))::value;
      // The epilogue walks epi_m fastest: a column strip is complete after its last epi_m.
      if (epi_m != EpiM - 1) {
        return;
      }
      constexpr bool ReferenceSrc = decltype(ref_src)::value;

      // 1. Pack this thread's distinct columns and reduce over the lanes that share them.
      Tensor tCrScore_flt = filter(tCrScore);
      Tensor tCrIndex_flt = filter(tCrIndex);
      constexpr int NumCols = decltype(size(tCrScore_flt))::value;
      PackedCandidate packed[NumCols];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < NumCols; ++i) {
        packed[i] = pack_candidate(tCrScore_flt(i), tCrIndex_flt(i));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int rows = size<0>(lane_layout_MN) / 2; rows > 0; rows /= 2) {
        int const lane_delta = lane_layout_MN(rows, _0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          packed[i] = max_candidate(packed[i], __shfl_down_sync(0xFFFFFFFF, packed[i], lane_delta));
        }
      }

      // 2. Lanes at M position 0 hold their warp's result: stage it per warp in shared memory.
      Tensor sBuf = make_tensor(make_smem_ptr<PackedCandidate>(raw_pointer_cast(smem_buffer.data())),
                                sBuf_layout);  // (EPI_TILE_M, EPI_TILE_N, WARPS_M), stride-0 over EPI_TILE_M
      static_assert(decltype(cosize(sBuf_layout))::value * sizeof(PackedCandidate) <=
                        decltype(cosize(smem_buffer.layout()))::value *
                            sizeof(typename remove_cvref_t<STensor>::value_type),
                    "epilogue smem buffer too small for the candidate reduction");
      sync_fn();  // the previous strip's readers are done with sBuf
      if (get<0>(lane_mn) == 0) {
        Tensor tCsBuf = sm90_partition_for_epilogue<ReferenceSrc>(sBuf(_, _, get<0>(warp_mn)), epi_tile,
                                                                  tiled_copy, thread_idx);
        Tensor tCsBuf_flt = filter(tCsBuf);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < NumCols; ++i) {
          tCsBuf_flt(i) = packed[i];
        }
      }
      sync_fn();

      // 3. Reduce over the warps stacked in M and write one candidate per column.
      constexpr int WarpsM = decltype(size<0>(warp_layout_MN))::value;
      constexpr int EpiTileN = decltype(size<1>(epi_tile))::value;
      auto [m_tile, n_tile, k_tile, l_tile] = tile_coord_mnkl;
      int const num_cols = get<1>(problem_mn);
      int const col_base = static_cast<int>(n_tile) * size<1>(CtaTileShapeMNK{}) + epi_n * EpiTileN;
      PackedCandidate* out = params.ptr_candidates + static_cast<int64_t>(m_tile) * num_cols;
      for (int col = thread_idx; col < EpiTileN; col += size(tiled_copy)) {
        PackedCandidate best = sBuf(0, col, 0);
        CUTLASS_PRAGMA_UNROLL
        for (int w = 1; w < WarpsM; ++w) {
          best = max_candidate(best, sBuf(0, col, w));
        }
        if (col_base + col < num_cols) {
          out[col_base + col] = best;
        }
      }
      reset_strip();
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(ConsumerStoreArgs<Args...> const& args) {
    // Which lanes and warps of the epilogue share a column: tile (m, n) -> thread/value index,
    // then thread -> lane / warp, restricted to each mode.
    Layout ref_layout_MN = [&]() {
      auto mn_shape = shape(typename decltype(args.tiled_copy)::Tiler_MN{});
      if constexpr (ReferenceSrc) {
        return right_inverse(args.tiled_copy.get_layoutS_TV()).with_shape(mn_shape);
      } else {
        return right_inverse(args.tiled_copy.get_layoutD_TV()).with_shape(mn_shape);
      }
    }();
    using NumWarps = Int<decltype(args.tiled_copy)::TiledNumThr::value / cutlass::NumThreadsPerWarp>;
    Layout tv2lane = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, NumWarps, _1>, Stride<_1, _0, _0>>{};
    Layout ref2lane = composition(tv2lane, ref_layout_MN);
    Layout lane_layout_MN = make_layout(filter(get<0>(ref2lane)), filter(get<1>(ref2lane)));
    auto lane_mn = idx2crd(right_inverse(lane_layout_MN)(cutlass::canonical_lane_idx()), shape(lane_layout_MN));

    Layout tv2warp = Layout<Shape<Int<cutlass::NumThreadsPerWarp>, NumWarps, _1>, Stride<_0, _1, _0>>{};
    Layout ref2warp = composition(tv2warp, ref_layout_MN);
    Layout warp_layout_MN = make_layout(filter(get<0>(ref2warp)), filter(get<1>(ref2warp)));
    auto warp_mn = idx2crd(right_inverse(warp_layout_MN)(args.thread_idx / cutlass::NumThreadsPerWarp), shape(warp_layout_MN));

    // Per-thread best (score, index) for the columns of one epilogue strip: a
    // (CTA_M, CTA_N) layout with stride 0 over M, partitioned like the accumulators.
    auto [M, N, K, L] = args.problem_shape_mnkl;
    Layout col_layout = make_layout(take<0, 2>(args.tile_shape_mnk), Stride<_0, _1>{});
    Tensor tCcol = sm90_partition_for_epilogue<ReferenceSrc>(make_tensor(make_gmem_ptr<float>(nullptr), col_layout),
                                                             args.epi_tile, args.tiled_copy, args.thread_idx);
    Tensor tCrScore = make_tensor_like<float>(tCcol(_, _, _, _0{}, _0{}));    // (CPY, CPY_M, CPY_N)
    Tensor tCrIndex = make_tensor_like<int32_t>(tCcol(_, _, _, _0{}, _0{}));  // (CPY, CPY_M, CPY_N)

    // Shared-memory scratch: one candidate per (strip column, warp in M).
    Layout sBuf_layout = make_layout(
        make_shape(size<0>(args.epi_tile), size<1>(args.epi_tile), size<0>(warp_layout_MN)),
        make_stride(_0{}, _1{}, size<1>(args.epi_tile)));

    auto args_tuple = make_tuple(bool_constant<ReferenceSrc>{}, cute::move(tCrScore), cute::move(tCrIndex),
                                 args.tCcD, args.residue_tCcD, make_coord(int(M), int(N)), sBuf_layout,
                                 lane_layout_MN, lane_mn, warp_layout_MN, warp_mn, args.tile_coord_mnkl,
                                 args.epi_tile, args.tiled_copy, args.thread_idx);
    return ConsumerStoreCallbacks<decltype(args_tuple)>(cute::move(args_tuple), params);
  }
};

}  // namespace flashsampling::epilogue
