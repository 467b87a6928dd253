// Host-side dispatch of the fused sampler: the kernel choice (flashsampling/kernel_choice.h, a
// pure function of architecture, loop and batch) -> its pre-compiled instantiation, then the
// stage-2 reduction.
#include <atomic>
#include <cstdint>

#include "cutlass/numeric_types.h"
#include "flashsampling/kernel_choice.h"
#include "flashsampling/sample_from_logits.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

struct ConfigEntry {
  cudaError_t (*run)(SamplerParams const&, SamplerBuffers const&, void*, cudaStream_t);
  size_t (*gemm_workspace)(SamplerParams const&);
  int vocab_tile;   // M extent of one candidate row
  int column_tile;  // N extent of the CTA tile
  bool skips_unreachable_noise = false;  // the epilogue-warpgroup kernels (the exact skip)
  // Whether the kernel loads per-row temperatures as the prepared [B] fl(1 / T) array
  // (SamplerParams::prepare_inv_temperatures): the epilogue-warpgroup kernels and the loop for
  // all controls. The others divide a loaded temperature themselves.
  bool loads_inv_temperatures = false;
  // Whether the kernel's top-k scan can draw the tile winners (SamplerParams::draw_tile_winners):
  // the visitor's scan on CUTLASS's sm90 schedules.
  bool scans_tile_winners = false;
  // Whether the kernel's top-k scan can store each 16-token run's four largest keys in place of x
  // (SamplerParams::large_top_k_run_keys): the epilogue-warpgroup kernel's.
  bool stores_run_keys = false;
};

#if defined(FLASHSAMPLING_ENABLE_SM90)
template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM = 1>
ConfigEntry sm90_entry() {
  return {run_sampler_gemm_sm90<Element, TileN, kPingpong, kLoop, kClusterM>,
          sampler_gemm_workspace_sm90<Element, TileN, kPingpong, kLoop, kClusterM>,
          SamplerTileConfig<TileN, kPingpong>::kTileM, TileN, /*skips_unreachable_noise=*/false,
          /*loads_inv_temperatures=*/kLoop == SamplerLoop::kAllControls,
          /*scans_tile_winners=*/kLoop == SamplerLoop::kTopCandidates};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM90)
template <class Element, int TileN, SamplerLoop kLoop = SamplerLoop::kPlain, int kClusterM = 1, int kClusterN = 1>
ConfigEntry sm90_epilogue_warpgroups_entry() {
  return {run_sampler_gemm_sm90_epilogue_warpgroups<Element, TileN, kLoop, kClusterM, kClusterN>,
          [](SamplerParams const&) { return size_t{0}; }, kEpilogueWarpGroupsVocabTile, TileN,
          /*skips_unreachable_noise=*/true, /*loads_inv_temperatures=*/true};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM90)
// The fused top-k pass there: candidates per 128-row tile, as the cooperative tile's visitor
// writes them; no noise (so no skip), and per-row temperatures divided where the scan needs them,
// as the visitor does (no kernel before the GEMM).
template <class Element, int TileN = 128, int kClusterN = 1>
ConfigEntry sm90_top_candidates_epilogue_warpgroups_entry() {
  return {run_sampler_gemm_sm90_epilogue_warpgroups<Element, TileN, SamplerLoop::kTopCandidates, 1, kClusterN>,
          [](SamplerParams const&) { return size_t{0}; }, kEpilogueWarpGroupsTopCandidatesVocabTile, TileN,
          /*skips_unreachable_noise=*/false, /*loads_inv_temperatures=*/false, /*scans_tile_winners=*/false,
          /*stores_run_keys=*/true};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM100)
template <class Element, int TileN, SamplerLoop kLoop>
ConfigEntry sm100_entry() {
  return {run_sampler_gemm_sm100<Element, TileN, kLoop>, sampler_gemm_workspace_sm100<Element, TileN, kLoop>,
          SamplerTileConfig<TileN, false>::kTileM, TileN, /*skips_unreachable_noise=*/false,
          /*loads_inv_temperatures=*/kLoop == SamplerLoop::kAllControls};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM90)
// The instantiation of an sm90 choice (generate_kernels.py lists the same units).
template <class Element>
ConfigEntry sm90_config(KernelChoice const& c) {
  using L = SamplerLoop;
  switch (c.schedule) {
    case SamplerSchedule::kEpilogueWarpGroups:
      if (c.loop == L::kTopCandidates) {
        if (c.tile_n == 64) return sm90_top_candidates_epilogue_warpgroups_entry<Element, 64>();
        return c.cluster_n == 2 ? sm90_top_candidates_epilogue_warpgroups_entry<Element, 128, 2>()
                                : sm90_top_candidates_epilogue_warpgroups_entry<Element>();
      }
      if (c.loop == L::kPlain) {
        if (c.tile_n == 64) return sm90_epilogue_warpgroups_entry<Element, 64, L::kPlain>();
        return c.cluster_n == 2 ? sm90_epilogue_warpgroups_entry<Element, 128, L::kPlain, 1, 2>()
                                : sm90_epilogue_warpgroups_entry<Element, 128, L::kPlain>();
      }
      switch (c.tile_n) {
        case 32: return sm90_epilogue_warpgroups_entry<Element, 32, L::kCommonControls>();
        case 64: return sm90_epilogue_warpgroups_entry<Element, 64, L::kCommonControls>();
        default:
          return c.cluster_n == 2 ? sm90_epilogue_warpgroups_entry<Element, 128, L::kCommonControls, 1, 2>()
                                  : sm90_epilogue_warpgroups_entry<Element, 128, L::kCommonControls>();
      }
    case SamplerSchedule::kCooperative:
      return sm90_entry<Element, 128, /*kPingpong=*/false, L::kTopCandidates>();
    default:
      switch (c.loop) {
        case L::kPlain:
          return c.tile_n == 16 ? sm90_entry<Element, 16, /*kPingpong=*/true, L::kPlain>()
                                : sm90_entry<Element, 32, true, L::kPlain, /*kClusterM=*/2>();
        case L::kCommonControls: return sm90_entry<Element, 16, true, L::kCommonControls>();
        case L::kAllControls: return sm90_entry<Element, 16, true, L::kAllControls>();
        default:
          return c.tile_n == 16 ? sm90_entry<Element, 16, true, L::kTopCandidates>()
                                : sm90_entry<Element, 64, true, L::kTopCandidates, 2>();
      }
  }
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM100)
template <class Element, SamplerLoop kLoop>
ConfigEntry sm100_config_of_loop(int tile_n) {
  switch (tile_n) {
    case 16: return sm100_entry<Element, 16, kLoop>();
    case 32: return sm100_entry<Element, 32, kLoop>();
    case 64: return sm100_entry<Element, 64, kLoop>();
    default: return sm100_entry<Element, 128, kLoop>();
  }
}

// The instantiation of an sm100 choice: every tile of the plain and controls loops, N = 16 and
// 32 of the loop for all controls, 16, 64 and 128 of the top-k pass.
template <class Element>
ConfigEntry sm100_config(KernelChoice const& c) {
  using L = SamplerLoop;
  switch (c.loop) {
    case L::kPlain: return sm100_config_of_loop<Element, L::kPlain>(c.tile_n);
    case L::kCommonControls: return sm100_config_of_loop<Element, L::kCommonControls>(c.tile_n);
    case L::kAllControls:
      return c.tile_n == 16 ? sm100_entry<Element, 16, L::kAllControls>() : sm100_entry<Element, 32, L::kAllControls>();
    default:
      return c.tile_n == 16   ? sm100_entry<Element, 16, L::kTopCandidates>()
             : c.tile_n == 64 ? sm100_entry<Element, 64, L::kTopCandidates>()
                              : sm100_entry<Element, 128, L::kTopCandidates>();
  }
}
#endif

template <class Element>
ConfigEntry config_for(KernelChoice const& c) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (c.arch == 90) return sm90_config<Element>(c);
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (c.arch == 100) return sm100_config<Element>(c);
#endif
  (void)c;
  return {nullptr, nullptr, 0, 0};
}

// Bit i of the options word: DispatchOptions' fields in order, set where a test turned one off.
std::atomic<unsigned> g_disabled_options{0};

// Whether a top_p call's tile winners pay at these GEMM columns and hidden size. At 33-64 columns
// only the 64-wide pingpong tile draws them, and their noise is a fixed cost a tile in its
// epilogue, which a short mainloop does not hide: up to D = 3072 the epilogue-warpgroup kernel's
// 64-wide scan without them, then the streaming pass over the rows stage 2 hands on, takes less;
// from D = 3584 the pingpong tile with them takes less on flat rows (docs/truncation_kernels.md
// has the A/B by hidden size). Up to 32 columns the 16-wide tile's winners pay at every D. A top_p
// call takes the top-k scan only where it does not run on plain sampling's pass
// (runs_on_plain_pass: a greedy call, up to 32 rows a call of the controls' loops, or the option
// off).
bool top_p_tile_winners_pay(int64_t columns, int64_t hidden_dim) {
  return columns <= 32 || columns > 64 || hidden_dim > 3072;
}

// Whether min_p alone pays on plain sampling's pass at these GEMM columns. Its flat rows' winners
// mostly fail min_p, so the pass saves stage 2 and little else, and at 256 columns, where its
// stores of the logits cost the most, it loses (the A/B: docs/truncation.md, min_p alone).
bool min_p_plain_pass_pays(int64_t columns) { return columns <= 128; }

// Whether min_p alone on the plain pass pays with filtered winners (SamplerParams::
// min_p_filtered_winners) at these GEMM columns. A row whose min_p cuts draws the noise of every
// token that may pass it (no exact skip for it), which the epilogue hides under the weight's
// stream on 64-wide column tiles but not on 128-wide ones (docs/truncation.md, min_p alone, has
// the A/B).
bool min_p_filtered_winners_pay(int64_t columns) { return columns <= 64; }

// Whether the call's fused truncation is to draw the tile winners: the kernel choice keeps a scan
// that can draw them (kernel_choice.h), and the launch draws them where the chosen one can. A
// large top_k's or the top-N logprobs' sample has no streaming pass to take it instead (its rows
// would go to the logits sampler), so they keep them.
bool call_wants_tile_winners(SamplerParams const& p, DispatchOptions const& options) {
  bool const for_top_p_rows = fused_truncation_streams_top_p_rows(p);
  return p.fused_truncation && options.top_p_tile_winners && fused_truncation_draws_tile_winners(p) &&
         (!for_top_p_rows || top_p_tile_winners_pay(sampler_gemm_columns(p), p.hidden_dim));
}

// Whether a fused truncation call of top_p alone (or min_p alone, below) runs on plain sampling's pass instead of the
// top-k scan (SamplerParams::truncation_on_plain_pass). A top_p row needs from the GEMM only its
// plain-sampling token (the first t its rounds verify), its first y and its stored logits: plain
// sampling's pass draws that token with its exact skip of the noise, where the top-k scan either
// draws the tile winners without one or leaves the draw to a streaming pass over the stored
// logits, and stage 2 and its launch go. Every row then takes round 0 (stage 2 decided most
// LLM-like rows from their candidates), which the rest pays for (docs/truncation_kernels.md has
// the A/B). Beyond 32 rows, where sampling runs the epilogue-warpgroup kernels, whose plain and
// controls' loops store the logits (per-row temperatures, greedy rows, the dense bias, the mask,
// per-row seeds); up to 32 rows only in calls of the plain loop, whose narrow CUTLASS tiles store
// them (DispatchOptions::narrow_plain_pass); sm90 (the fused truncation's other forms are sm90's).
// Not a greedy call (its rows keep their argmax), nor the model-side transforms, penalties or
// sparse bias, which the fused truncation does not take.
//
// min_p alone takes the same pass up to 128 GEMM columns (min_p_plain_pass_pays): a row whose
// plain-sampling token passes min_p has it as its sample (it beats every survivor), and the
// others go to the streaming pass over their survivors with their first y, as stage 2 hands on
// the flat rows.
bool runs_on_plain_pass(SamplerParams const& p, int device_arch, DispatchOptions const& options) {
  LoopNeeds const needs = loop_needs(p.controls, p.noise, p.num_samples, p.logprobs);
  bool const one_cut_alone = p.top_ks == nullptr && p.top_k < 1 && p.num_samples == 1 && !p.logprobs &&
                             call_may_cut_top_p(p) != call_may_cut_min_p(p);
  bool const asked = call_may_cut_top_p(p)
                         ? options.top_p_on_plain_pass
                         : options.min_p_on_plain_pass && min_p_plain_pass_pays(sampler_gemm_columns(p));
  // Up to 32 rows the plain loop runs CUTLASS's narrow pingpong tiles, whose visitor stores the
  // logits; the controls' loops there do not.
  bool const narrow = options.narrow_plain_pass && sampler_loop_for(needs) == SamplerLoop::kPlain;
  return asked && one_cut_alone && device_arch == 90 && p.fused_truncation && (p.batch_size > 32 || narrow) &&
         fused_truncation_streams_rows(p) && p.top_logprobs.top_n < 0 && p.row_logits != nullptr && !p.greedy &&
         !needs.model_transform && !needs.penalties && !needs.sparse_bias;
}

// The parameters of the pass a call runs: the plain pass (runs_on_plain_pass), else the call's own.
SamplerParams route_params(SamplerParams const& params, int device_arch) {
  DispatchOptions const options = sampler_dispatch_options();
  if (!runs_on_plain_pass(params, device_arch, options)) return params;
  SamplerParams p = params;
  p.fused_truncation = false;
  p.truncation_on_plain_pass = true;
  p.first_winners_in_reduction = options.first_winners_in_reduction;
  return p;
}

ConfigEntry select_config(SamplerParams const& p, int device_arch) {
  LoopNeeds const needs = loop_needs(p.controls, p.noise, p.num_samples, p.logprobs);
  SamplerLoop const loop = p.fused_truncation ? SamplerLoop::kTopCandidates : sampler_loop_for(needs);
  DispatchOptions const options = sampler_dispatch_options();
  KernelChoice const choice =
      choose_kernel(device_arch, loop, sampler_gemm_columns(p), options.column_clusters,
                    options.top_candidates_epilogue_warpgroups,
                    !p.fused_truncation && needs_only_plain_loop_extras(needs, p.batch_size),
                    options.narrow_ragged_columns, call_wants_tile_winners(p, options));
  if (p.element_type == ElementType::kBFloat16) {
#if defined(FLASHSAMPLING_NO_BF16_KERNELS)  // FLASHSAMPLING_ELEMENT_TYPES left them out
    return {nullptr, nullptr, 0, 0};
#else
    return config_for<cutlass::bfloat16_t>(choice);
#endif
  }
#if defined(FLASHSAMPLING_NO_FP16_KERNELS)
  return {nullptr, nullptr, 0, 0};
#else
  return config_for<cutlass::half_t>(choice);
#endif
}

// Whether a call's GEMM stores each 16-token run's four largest keys in place of x
// (SamplerParams::large_top_k_run_keys): a host top_k in (kMaxFusedTopK, kMaxFusedLargeTopK] on
// the epilogue-warpgroup top-k scan. Its selection reads x only in the tiles it repairs (about 1%
// of a flat row's at k = 1000); a run's keys give it those x, but for a run that may hide more of
// the top k (four of them in 16 tokens), whose other 12 it recomputes. The keys are half the
// bytes of x, whose write-back (a [B, V] fp32 array) the GEMM pays while the weight streams in.
bool stores_run_keys(SamplerParams const& p, ConfigEntry const& entry) {
  return entry.stores_run_keys && p.fused_truncation && fused_truncation_selects_large_top_k(p) &&
         p.top_logprobs.top_n < 0;
}

// The hidden rows padded with zero rows to a whole number of N tiles where the last tile's TMA
// box would reach far past the last hidden row: a ragged box (the TMA unit filling the rows past
// the tensor with zeros) is slower than reading zero rows from memory when the last tile is
// mostly empty, and no faster when it is nearly full (docs/kernel.md has the A/B). So: one N
// tile, always; several, when the last one is at most half full, or when they are the plain
// loop's three 64-wide tiles (narrow_ragged_column_tiles: there a ragged last tile 3/4 full
// made the call slower than 192 whole columns, docs/kernel.md). The padding costs a copy and a
// memset node.
//
// And the exact skip of the epilogue-warpgroup kernels (docs/noise.md): elements that cannot
// reach their column's best score so far draw no exact noise (in a greedy batch, whose bound is
// the logit itself, such steps merge no keys); the same tokens with it or without. Their
// log-sum-exp terms are summed against each column's log-sum-exp of the half's earlier tiles
// (DispatchOptions::lse_references = false: each step's max over the lanes).
SamplerParams launch_params(SamplerParams const& params, ConfigEntry const& entry) {
  DispatchOptions const options = sampler_dispatch_options();
  SamplerParams p = params;
  p.skip_unreachable_noise = options.noise_skip && entry.skips_unreachable_noise;
  // min_p alone on the plain pass, on the epilogue-warpgroup kernel's plain loop (beyond 32 columns).
  p.min_p_filtered_winners = options.min_p_filtered_winners && p.truncation_on_plain_pass &&
                             min_p_filtered_winners_pay(sampler_gemm_columns(p)) &&
                             !call_may_cut_top_p(p) && entry.skips_unreachable_noise &&
                             sampler_loop_for(loop_needs(p.controls, p.noise, p.num_samples, p.logprobs)) ==
                                 SamplerLoop::kPlain;
  p.lse_references = options.lse_references && entry.skips_unreachable_noise;
  p.prepare_inv_temperatures = p.controls.temperatures != nullptr && entry.loads_inv_temperatures;
  p.draw_tile_winners = entry.scans_tile_winners && call_wants_tile_winners(p, options);
  p.row_logits_by_top_k = fused_truncation_stores_logits_by_top_k(p);
  p.large_top_k_run_keys = stores_run_keys(p, entry);
  if (p.large_top_k_run_keys) {  // the runs' keys in the workspace take the place of x
    p.row_logits = nullptr;
    p.row_logits_stride = 0;
  }
  int64_t const columns = sampler_unpadded_columns(p);
  int64_t const tile = entry.column_tile;
  int64_t const last_tile_rows = tile > 0 ? columns % tile : 0;
  bool const narrow_tiles = tile == 64 && narrow_ragged_column_tiles(columns);
  bool const ragged = last_tile_rows != 0 && (columns < tile || 2 * last_tile_rows <= tile || narrow_tiles);
  p.padded_columns = options.pad_columns && ragged ? (columns + tile - 1) / tile * tile : 0;
  return p;
}

// Copies the hidden rows into the padded buffer (row stride D) and zeroes the rows after them.
cudaError_t pad_hidden_rows(SamplerParams& p, void* padded_hidden, cudaStream_t stream) {
  size_t const row_bytes = static_cast<size_t>(p.hidden_dim) * kElementBytes;
  int64_t const rows = sampler_unpadded_columns(p);
  cudaError_t err = cudaMemcpy2DAsync(padded_hidden, row_bytes, p.hidden,
                                      static_cast<size_t>(p.hidden_row_stride) * kElementBytes,
                                      row_bytes, static_cast<size_t>(rows), cudaMemcpyDeviceToDevice, stream);
  if (err != cudaSuccess) return err;
  err = cudaMemsetAsync(static_cast<char*>(padded_hidden) + rows * row_bytes, 0,
                        static_cast<size_t>(p.padded_columns - rows) * row_bytes, stream);
  if (err != cudaSuccess) return err;
  p.hidden = padded_hidden;
  p.hidden_row_stride = p.hidden_dim;
  return cudaSuccess;
}

}  // namespace

void set_sampler_dispatch_options(DispatchOptions const& options) {
  g_disabled_options.store((options.column_clusters ? 0u : 1u) | (options.pad_columns ? 0u : 2u) |
                               (options.noise_skip ? 0u : 4u) | (options.lse_references ? 0u : 8u) |
                               (options.top_candidates_epilogue_warpgroups ? 0u : 16u) |
                               (options.top_p_tile_winners ? 0u : 32u) |
                               (options.narrow_ragged_columns ? 0u : 64u) |
                               (options.top_p_on_plain_pass ? 0u : 128u) |
                               (options.min_p_on_plain_pass ? 0u : 256u) |
                               (options.first_winners_in_reduction ? 0u : 512u) |
                               (options.narrow_plain_pass ? 0u : 1024u) |
                               (options.min_p_filtered_winners ? 0u : 2048u),
                           std::memory_order_relaxed);
}

DispatchOptions sampler_dispatch_options() {
  unsigned const off = g_disabled_options.load(std::memory_order_relaxed);
  DispatchOptions o;
  o.column_clusters = !(off & 1u);
  o.pad_columns = !(off & 2u);
  o.noise_skip = !(off & 4u);
  o.lse_references = !(off & 8u);
  o.top_candidates_epilogue_warpgroups = !(off & 16u);
  o.top_p_tile_winners = !(off & 32u);
  o.narrow_ragged_columns = !(off & 64u);
  o.top_p_on_plain_pass = !(off & 128u);
  o.min_p_on_plain_pass = !(off & 256u);
  o.first_winners_in_reduction = !(off & 512u);
  o.narrow_plain_pass = !(off & 1024u);
  o.min_p_filtered_winners = !(off & 2048u);
  return o;
}

const char* sampler_compiled_archs() {
#if defined(FLASHSAMPLING_NO_FP16_KERNELS)
#define FLASHSAMPLING_ELEMENT_TYPES_BUILT " (bf16 only)"
#elif defined(FLASHSAMPLING_NO_BF16_KERNELS)
#define FLASHSAMPLING_ELEMENT_TYPES_BUILT " (fp16 only)"
#else
#define FLASHSAMPLING_ELEMENT_TYPES_BUILT ""
#endif
#if defined(FLASHSAMPLING_ENABLE_SM90) && defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm90a,sm100a" FLASHSAMPLING_ELEMENT_TYPES_BUILT;
#elif defined(FLASHSAMPLING_ENABLE_SM90)
  return "sm90a" FLASHSAMPLING_ELEMENT_TYPES_BUILT;
#elif defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm100a" FLASHSAMPLING_ELEMENT_TYPES_BUILT;
#else
  return "";
#endif
#undef FLASHSAMPLING_ELEMENT_TYPES_BUILT
}

bool sampler_stores_run_keys(SamplerParams const& call, int device_arch) {
  SamplerParams const params = route_params(call, device_arch);
  return stores_run_keys(params, select_config(params, device_arch));
}

bool fused_top_k_fits(SamplerParams const& p, int device_arch) {
  ConfigEntry const entry = select_config(p, device_arch);
  return entry.run != nullptr &&
         truncate_candidates_smem_bytes(num_vocab_tiles(p, entry.vocab_tile), entry.vocab_tile) > 0;
}

// The logits sampler's call for the rows the fused truncation's stage 2 left: the same controls,
// truncation, noise and outputs over the x the GEMM stored (bias added, mask kept).
// streamed_first_y: stage 2's rows for the streaming kernels (fused_truncation_streams_rows), and
// streamed_winners their winners where the GEMM drew them (draw_tile_winners).
static LogitsSamplerParams fallback_logits_params(SamplerParams const& p, float* streamed_first_y,
                                                  PackedCandidate const* streamed_winners = nullptr) {
  LogitsSamplerParams l;
  l.logits = p.row_logits;
  l.logits_row_stride = p.row_logits_stride;
  l.rows = p.fallback_rows;
  l.batch_size = p.batch_size;
  l.vocab_size = p.vocab_size;
  l.vocab_start = p.vocab_start;
  l.allowed_mask = p.controls.allowed_mask;
  l.mask_words = p.controls.mask_words;
  l.inv_temperature = p.inv_temperature;
  l.temperatures = p.controls.temperatures;
  l.top_k = p.top_k;
  l.top_ks = p.top_ks;
  l.top_p = p.top_p;
  l.top_ps = p.top_ps;
  l.min_p = p.min_p;
  l.min_ps = p.min_ps;
  l.noise = p.noise;
  l.num_samples = p.num_samples;
  l.tokens = p.tokens;
  l.scores = p.scores;
  l.token_logprobs = p.logprobs ? p.token_logprobs : nullptr;
  l.logsumexp = p.logprobs ? p.logsumexp : nullptr;
  l.empty_mask_token = p.empty_mask_token;
  l.streamed_first_y = streamed_first_y;
  l.streamed_winners = streamed_winners;
  return l;
}

// Bytes of the fallback's streaming kernels' workspace (a function of the shapes).
static size_t fallback_workspace_bytes(SamplerParams const& p) {
  if (!fused_truncation_streams_rows(p)) return 0;
  return streaming_rows_workspace_bytes(fallback_logits_params(p, nullptr), p.device_sm_count);
}

size_t sampler_workspace_bytes(SamplerParams const& call, int device_arch) {
  SamplerParams const params = route_params(call, device_arch);
  ConfigEntry const entry = select_config(params, device_arch);
  if (entry.run == nullptr) return 0;
  SamplerParams const p = launch_params(params, entry);
  return SamplerWorkspaceLayout(p, entry.vocab_tile, entry.gemm_workspace(p), fallback_workspace_bytes(p)).total;
}

cudaError_t launch_sampler(SamplerParams const& call, void* workspace, size_t workspace_bytes, int device_arch,
                           cudaStream_t stream) {
  SamplerParams const params = route_params(call, device_arch);
  ConfigEntry const entry = select_config(params, device_arch);
  if (entry.run == nullptr) return cudaErrorNotSupported;
  if (params.batch_size == 0) return cudaSuccess;
  SamplerParams p = launch_params(params, entry);
  SamplerWorkspaceLayout const layout(p, entry.vocab_tile, entry.gemm_workspace(p), fallback_workspace_bytes(p));
  if (workspace_bytes < layout.total) return cudaErrorInvalidValue;
  SamplerBuffers const buffers = layout.buffers(p, workspace);
  if (p.padded_columns > 0) {
    cudaError_t err = pad_hidden_rows(p, static_cast<char*>(workspace) + layout.padded_hidden, stream);
    if (err != cudaSuccess) return err;
  }
  if (buffers.sparse_bitmap != nullptr) {
    cudaError_t err = launch_build_sparse_bitmap(p, buffers.sparse_bitmap, stream);
    if (err != cudaSuccess) return err;
    p.controls.sparse_bitmap = buffers.sparse_bitmap;
  }
  if (buffers.penalty_words != nullptr) {
    cudaError_t err = launch_build_penalty_table(p, buffers, stream);
    if (err != cudaSuccess) return err;
    p.controls.penalty_words = buffers.penalty_words;
    p.controls.penalty_slots = buffers.penalty_slots;
    p.controls.penalty_lowers = buffers.penalty_lowers;
  }
  if (cudaError_t err = launch_prepare_gemm_inputs(p, buffers, stream); err != cudaSuccess) return err;
  p.controls.inv_temperatures = buffers.inv_temperatures;
  cudaError_t err = entry.run(p, buffers, static_cast<char*>(workspace) + layout.gemm, stream);
  if (err != cudaSuccess) return err;
  if (p.fused_truncation) {
    err = launch_truncate_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), entry.vocab_tile, stream);
    if (err != cudaSuccess || p.fallback_rows == nullptr) return err;
    // The row list goes to the cut path's kernel (no workspace); the rows stage 2 marked in
    // streamed_first_y, if any, to the streaming kernels.
    return launch_sample_from_logits(fallback_logits_params(p, buffers.streamed_first_y, buffers.streamed_winners),
                                     buffers.logits_sampler, p.device_sm_count, stream);
  }
  err = launch_reduce_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), entry.vocab_tile, stream);
  if (err != cudaSuccess || !p.truncation_on_plain_pass) return err;
  // The top_p rows the reduction handed on, to the rounds (with their winners), or the min_p rows,
  // to the streaming pass; the rows it listed, to the cut kernel.
  return launch_sample_from_logits(fallback_logits_params(p, buffers.streamed_first_y, buffers.streamed_winners),
                                   buffers.logits_sampler, p.device_sm_count, stream);
}

}  // namespace flashsampling
