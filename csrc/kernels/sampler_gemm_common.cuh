// Arch-independent part of the fused sampling GEMM: building CUTLASS arguments
// from SamplerParams and the launch loop. Included by sampler_gemm_sm90.cuh and
// sampler_gemm_sm100.cuh, which supply the collectives.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"

#include "flashsampling/kernel/gemm_setup.hpp"
#include "flashsampling/sampler_params.h"
#include "sampler_config.h"

namespace flashsampling {

// Element of the scratch D an architecture without a void-D epilogue stores into
// (column-major [V, B], leading dimension padded to 16 bytes for TMA).
using SamplerScratchD = uint8_t;

inline int64_t scratch_d_leading_dim(SamplerParams const& p) { return (p.vocab_size + 15) / 16 * 16; }

// The GEMM's (M, N, K, L): vocabulary x GEMM columns x hidden. N = S * B columns: p.hidden
// holds the batch repeated num_samples times.
inline kernel::GemmProblemShape sampler_problem_shape(SamplerParams const& p) {
  return kernel::weight_hidden_problem_shape(static_cast<int>(p.vocab_size), static_cast<int>(sampler_gemm_columns(p)),
                                             static_cast<int>(p.hidden_dim));
}

// A = W, B = h.
template <class Element, class GemmKernel, class MainloopArguments>
void fill_sampler_mainloop_arguments(MainloopArguments& mainloop, SamplerParams const& p) {
  kernel::fill_weight_hidden_operands<Element, GemmKernel>(mainloop, p.weight, p.weight_row_stride, p.hidden,
                                                           p.hidden_row_stride);
}

// The Gumbel-argmax node's arguments (epilogue/sm90_visitor_gumbel_argmax.hpp).
template <class NodeArguments>
void fill_sampler_node_arguments(NodeArguments& node, SamplerParams const& p, SamplerBuffers const& buffers) {
  node = {};
  node.ptr_candidates = buffers.candidates;
  node.ptr_candidate_logits = buffers.candidate_logits;
  node.ptr_lse_parts = buffers.lse_parts;
  node.noise = p.noise;
  node.controls = p.controls;
  node.inv_temperature = p.inv_temperature;
  node.greedy = p.greedy;
  // The fused truncation's scan keeps no log-probability state: its stage 2 computes them from
  // the candidates and the stored logits' log-masses (so the scan may draw the tile winners too).
  node.logprobs = p.logprobs && !p.fused_truncation;
  node.num_samples = p.num_samples;
  node.batch_size = static_cast<uint32_t>(p.batch_size);
  node.batch_divmod = cutlass::FastDivmod(static_cast<int>(p.batch_size));
  node.vocab_start = static_cast<uint32_t>(p.vocab_start);
  node.ptr_row_logits = p.row_logits;
  node.row_logits_stride = p.row_logits_stride;
  node.ptr_row_top_ks = p.row_logits_by_top_k ? p.top_ks : nullptr;
  node.ptr_tile_winners = p.draw_tile_winners ? buffers.tile_winners : nullptr;
  node.ptr_tile_max_logits = buffers.tile_max_logits;
  node.ptr_run_keys = buffers.run_keys;
  node.run_keys_stride = buffers.run_keys != nullptr ? large_top_k_runs(p) * kTopCandidatesPerTile : 0;
}

// Persistent grid over the device's SMs; neighbouring CTAs take the N tiles of one vocabulary
// tile, so W is read from HBM once even when the columns span several N tiles.
template <class KernelArguments>
void fill_sampler_schedule_arguments(KernelArguments& args, SamplerParams const& p) {
  args.hw_info.device_id = 0;
  args.hw_info.sm_count = p.device_sm_count;
  args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
}

template <class Gemm, class Element, int kVocabTile, bool kScratchD>
struct SamplerGemmLauncher {
  static size_t scratch_d_bytes(SamplerParams const& p) {
    return kScratchD ? static_cast<size_t>(scratch_d_leading_dim(p) * sampler_gemm_columns(p) + 256) : 0;
  }

  static typename Gemm::Arguments make_arguments(SamplerParams const& p, SamplerBuffers const& buffers,
                                                 void* scratch_d = nullptr) {
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = sampler_problem_shape(p);
    fill_sampler_mainloop_arguments<Element, typename Gemm::GemmKernel>(args.mainloop, p);
    // Tree arguments nest as { child args..., node args }.
    fill_sampler_node_arguments(args.epilogue.thread.op_1, p, buffers);
    if constexpr (kScratchD) {
      using StrideD = typename Gemm::GemmKernel::StrideD;
      args.epilogue.ptr_D = static_cast<SamplerScratchD*>(scratch_d);
      args.epilogue.dD = StrideD{cute::_1{}, scratch_d_leading_dim(p), int64_t(0)};
    }
    fill_sampler_schedule_arguments(args, p);
    return args;
  }

  static size_t gemm_workspace_bytes(SamplerParams const& p) {
    return scratch_d_bytes(p) + Gemm::get_workspace_size(make_arguments(p, SamplerBuffers{}));
  }

  // One GEMM pass for every sample.
  static cudaError_t run(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                         cudaStream_t stream) {
    // Layout of gemm_workspace: [scratch D (kScratchD only)] [CUTLASS workspace].
    void* scratch_d = gemm_workspace;
    void* cutlass_workspace = static_cast<char*>(gemm_workspace) + scratch_d_bytes(p);
    Gemm gemm;
    auto args = make_arguments(p, buffers, scratch_d);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      return cudaErrorInvalidValue;
    }
    if (gemm.initialize(args, cutlass_workspace, stream) != cutlass::Status::kSuccess) {
      return cudaErrorUnknown;
    }
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      cudaError_t err = cudaGetLastError();
      return err == cudaSuccess ? cudaErrorLaunchFailure : err;
    }
    return cudaSuccess;
  }
};

}  // namespace flashsampling
