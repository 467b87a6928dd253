// The fused GEMM's epilogue loops (SamplerLoop): torch-free and CUDA-free, so that the kernel
// choice (kernel_choice.h) builds without the CUDA toolkit.
#pragma once

namespace flashsampling {

// The epilogue's element loops, each compiled into kernels of its own (code of a loop that
// is not taken still costs instruction cache: docs/epilogue.md).
//   kPlain:          is_plain_sampling; on sm90 beyond 32 columns also logit_scale /
//                    logit_softcap and the penalties alone, or several samples of a batch of
//                    B % 4 == 0 rows alone (the epilogue-warpgroup kernel's plain loop applies
//                    them: kernel_choice.h, needs_only_plain_loop_extras).
//   kCommonControls: one sample, batch-wide seed; per-row temperatures (greedy rows), dense
//                    logit bias, allowed-token mask, logprobs: what serving engines send every step;
//                    and the model-side logit_scale / logit_softcap, and the penalties of
//                    the tokens each row has seen (repetition, frequency, presence).
//   (On sm90 the plain and common controls' loops of the epilogue-warpgroup kernel beyond 32
//   columns, and the plain loop of CUTLASS's narrow tiles up to 32, also store the logits for top_p
//   or min_p alone on plain sampling's pass, where a call asks: SamplerParams::truncation_on_plain_pass.)
//   kAllControls:    anything, also sparse bias, per-row seeds / offsets and several samples (on
//                    sm90 beyond 16 GEMM columns the epilogue-warpgroup kernels' kCommonControls
//                    loop takes these too: kernel_choice.h).
//   kTopCandidates:  fused truncation (SamplerParams::fused_truncation): each (vocabulary
//                    tile, row) keeps its kTopCandidatesPerTile largest transformed logits (dense
//                    bias and mask applied) and stage 2 (truncate_candidates.cu) selects the
//                    row's top-k, truncates (top-p, min-p) and samples the survivors. No noise in
//                    the epilogue, but in top_p calls that draw the tile winners
//                    (SamplerParams::draw_tile_winners).
enum class SamplerLoop : int { kPlain = 0, kCommonControls = 1, kAllControls = 2, kTopCandidates = 3 };
constexpr int kSamplerLoops = 4;

// A loop's name: in the generated units' file names (generate_kernels.py) and in the test ops
// _kernel_choice / _sampler_loop.
inline char const* sampler_loop_name(SamplerLoop loop) {
  static char const* const kNames[kSamplerLoops] = {"plain", "common_controls", "all_controls", "top_candidates"};
  return kNames[static_cast<int>(loop)];
}

// What of a sampling call decides its loop (sampler_params.h's sampler_loop_for reads it off the
// call; tests/test_kernel_choice.py through flashsampling::_sampler_loop).
struct LoopNeeds {
  bool model_transform = false;       // logit_scale != 1 or a logit_softcap
  bool penalties = false;             // the seen tokens' penalties (SamplingControls::penalty_ids)
  bool per_row_temperatures = false;
  bool logit_bias = false;
  bool allowed_mask = false;
  bool logprobs = false;
  bool sparse_bias = false;
  bool per_row_keys = false;  // per-row seeds, offsets or streams
  int num_samples = 1;
};

// The loop of a call (not the fused top-k pass, which is kTopCandidates whatever it needs).
inline SamplerLoop sampler_loop_for(LoopNeeds const& n) {
  bool const common = n.num_samples == 1 && !n.sparse_bias && !n.per_row_keys;
  bool const plain = common && !n.model_transform && !n.penalties && !n.per_row_temperatures && !n.logit_bias &&
                     !n.allowed_mask && !n.logprobs;
  return plain ? SamplerLoop::kPlain : common ? SamplerLoop::kCommonControls : SamplerLoop::kAllControls;
}

// Whether a call's needs beyond plain sampling are ones the plain loop of the epilogue-warpgroup
// kernel also applies, which takes it on sm90 beyond 32 columns (kernel_choice.h): logit_scale /
// logit_softcap and / or the penalties (its steps apply them), or several samples of a batch of
// `batch_size` rows with B % 4 == 0 (a quad of GEMM columns is a quad of batch rows of one
// sample, so the batch-wide seed's Philox block serves it as in plain sampling), each with
// nothing else.
inline bool needs_only_plain_loop_extras(LoopNeeds const& n, long long batch_size) {
  LoopNeeds without = n;
  without.model_transform = false;
  without.penalties = false;
  without.num_samples = 1;
  bool const transforms = n.model_transform || n.penalties;
  bool const samples = n.num_samples > 1;
  if (samples && (transforms || batch_size % 4 != 0)) return false;
  return (transforms || samples) && sampler_loop_for(without) == SamplerLoop::kPlain;
}

}  // namespace flashsampling
