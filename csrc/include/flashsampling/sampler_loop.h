// The fused GEMM's epilogue loops (SamplerLoop): torch-free and CUDA-free, so that the kernel
// choice (kernel_choice.h) builds without the CUDA toolkit.
#pragma once

namespace flashsampling {

// The epilogue's element loops, each compiled into kernels of its own (code of a loop that
// is not taken still costs instruction cache: docs/epilogue.md).
//   kPlain:          is_plain_sampling.
//   kCommonControls: one sample, batch-wide seed; per-row temperatures (greedy rows), dense
//                    logit bias, allowed-token mask, logprobs: what serving engines send every step.
//   kAllControls:    anything, also sparse bias, per-row seeds / offsets and several samples (on
//                    sm90 beyond 16 GEMM columns the epilogue-warpgroup kernels' kCommonControls
//                    loop takes these too: kernel_choice.h).
//   kTopCandidates:  fused truncation (SamplerParams::fused_truncation): no noise in the
//                    epilogue; each (vocabulary tile, row) keeps its kTopCandidatesPerTile largest
//                    transformed logits (dense bias and mask applied) and stage 2
//                    (truncate_candidates.cu) selects the row's top-k, truncates (top-p, min-p)
//                    and samples the survivors.
enum class SamplerLoop : int { kPlain = 0, kCommonControls = 1, kAllControls = 2, kTopCandidates = 3 };

}  // namespace flashsampling
