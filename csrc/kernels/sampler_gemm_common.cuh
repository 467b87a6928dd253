// Arch-independent part of the fused sampling GEMM: building CUTLASS arguments
// from SamplerParams and the launch loop. Included by sampler_gemm_sm90.cuh and
// sampler_gemm_sm100.cuh, which supply the collectives.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"

#include "flashsampling/sampler_params.h"
#include "sampler_config.h"

namespace flashsampling {

// A = weight [V, D] (M x K, K-major), B = hidden [B, D] (N x K, K-major).
using SamplerLayoutA = cutlass::layout::RowMajor;
using SamplerLayoutB = cutlass::layout::ColumnMajor;

// Element of the scratch D an architecture without a void-D epilogue stores into
// (column-major [V, B], leading dimension padded to 16 bytes for TMA).
using SamplerScratchD = uint8_t;

inline int64_t scratch_d_leading_dim(SamplerParams const& p) { return (p.vocab_size + 15) / 16 * 16; }

template <class Gemm, class Element, int kVocabTile, int kMaxSamplesPerPass, bool kScratchD>
struct SamplerGemmLauncher {
  static size_t scratch_d_bytes(SamplerParams const& p) {
    return kScratchD ? static_cast<size_t>(scratch_d_leading_dim(p) * p.batch_size + 256) : 0;
  }

  // Arguments of the pass that draws samples [first_sample, first_sample + count).
  static typename Gemm::Arguments make_arguments(SamplerParams const& p, SamplerBuffers const& buffers,
                                                 int first_sample, int count, void* scratch_d = nullptr) {
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {static_cast<int>(p.vocab_size), static_cast<int>(p.batch_size),
                          static_cast<int>(p.hidden_dim), 1};
    args.mainloop.ptr_A = static_cast<Element const*>(p.weight);
    args.mainloop.dA = StrideA{p.weight_row_stride, cute::_1{}, int64_t(0)};
    args.mainloop.ptr_B = static_cast<Element const*>(p.hidden);
    args.mainloop.dB = StrideB{p.hidden_row_stride, cute::_1{}, int64_t(0)};

    int64_t const sample_stride = num_vocab_tiles(p, kVocabTile) * p.batch_size;
    auto& node = args.epilogue.thread.op_1;  // Tree arguments nest as { child args..., node args }.
    node = {};
    node.ptr_candidates = buffers.candidates ? buffers.candidates + first_sample * sample_stride : nullptr;
    node.ptr_candidate_logits =
        buffers.candidate_logits ? buffers.candidate_logits + first_sample * sample_stride : nullptr;
    node.ptr_lse_parts = first_sample == 0 ? buffers.lse_parts : nullptr;  // the first pass reduces it
    node.sample_stride = sample_stride;
    node.noise = p.noise;
    node.controls = p.controls;
    node.inv_temperature = p.inv_temperature;
    node.greedy = p.greedy;
    node.logprobs = p.logprobs;
    node.first_sample = static_cast<uint32_t>(first_sample);
    node.num_samples = count;
    node.vocab_start = static_cast<uint32_t>(p.vocab_start);
    if constexpr (kScratchD) {
      using StrideD = typename Gemm::GemmKernel::StrideD;
      args.epilogue.ptr_D = static_cast<SamplerScratchD*>(scratch_d);
      args.epilogue.dD = StrideD{cute::_1{}, scratch_d_leading_dim(p), int64_t(0)};
    }
    args.hw_info.device_id = 0;
    args.hw_info.sm_count = p.device_sm_count;
    // Neighbouring CTAs take the N tiles of one vocabulary tile, so W is read from
    // HBM once even when the batch spans several N tiles.
    args.scheduler.raster_order = cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN;
    return args;
  }

  static size_t gemm_workspace_bytes(SamplerParams const& p) {
    return scratch_d_bytes(p) + Gemm::get_workspace_size(make_arguments(p, SamplerBuffers{}, 0, 1));
  }

  // One GEMM pass per kMaxSamplesPerPass samples; the epilogue draws them all from
  // the same accumulators.
  static cudaError_t run(SamplerParams const& p, SamplerBuffers const& buffers, void* gemm_workspace,
                         cudaStream_t stream) {
    // Layout of gemm_workspace: [scratch D (kScratchD only)] [CUTLASS workspace].
    void* scratch_d = gemm_workspace;
    void* cutlass_workspace = static_cast<char*>(gemm_workspace) + scratch_d_bytes(p);
    Gemm gemm;
    for (int first = 0; first < p.num_samples; first += kMaxSamplesPerPass) {
      int const count = p.num_samples - first < kMaxSamplesPerPass ? p.num_samples - first : kMaxSamplesPerPass;
      auto args = make_arguments(p, buffers, first, count, scratch_d);
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
    }
    return cudaSuccess;
  }
};

}  // namespace flashsampling
