// Host-side dispatch of the fused sampler: architecture, element type and batch
// bucket -> one pre-compiled config, then the stage-2 reduction.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "cutlass/numeric_types.h"
#include "sampler_config.h"

namespace flashsampling {
namespace {

// Whether the environment variable `name` is set to `value` (the dispatch's A/B knobs, each read
// once per process into a static).
bool env_is(char const* name, std::string_view value) {
  char const* env = std::getenv(name);
  return env != nullptr && std::string_view(env) == value;
}

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
};

#if defined(FLASHSAMPLING_ENABLE_SM90)
template <class Element, int TileN, bool kPingpong, SamplerLoop kLoop, int kClusterM = 1>
ConfigEntry sm90_entry() {
  return {run_sampler_gemm_sm90<Element, TileN, kPingpong, kLoop, kClusterM>,
          sampler_gemm_workspace_sm90<Element, TileN, kPingpong, kLoop, kClusterM>,
          SamplerTileConfig<TileN, kPingpong>::kTileM, TileN, /*skips_unreachable_noise=*/false,
          /*loads_inv_temperatures=*/kLoop == SamplerLoop::kAllControls};
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

#if defined(FLASHSAMPLING_ENABLE_SM100)
template <class Element, int TileN, SamplerLoop kLoop>
ConfigEntry sm100_entry() {
  return {run_sampler_gemm_sm100<Element, TileN, kLoop>, sampler_gemm_workspace_sm100<Element, TileN, kLoop>,
          SamplerTileConfig<TileN, false>::kTileM, TileN, /*skips_unreachable_noise=*/false,
          /*loads_inv_temperatures=*/kLoop == SamplerLoop::kAllControls};
}
#endif

#if defined(FLASHSAMPLING_ENABLE_SM90)
// Plain passes of more than 64 columns on sm90 run the kernel with epilogue warpgroups of its
// own: there the epilogue's noise is as long as the mainloop, and warpgroups of its own overlap
// it with the next tile's GEMM, which CUTLASS's schedules do not (docs/kernel.md). A/B knob:
// FLASHSAMPLING_PLAIN_WIDE_SCHEDULE=cutlass runs those (pingpong clusters up to 128 columns,
// cooperative beyond).
bool plain_wide_on_cutlass_schedules() {
  static bool const on = env_is("FLASHSAMPLING_PLAIN_WIDE_SCHEDULE", "cutlass");
  return on;
}

// Common-controls passes of more than 16 columns (tiles 32, 64 and 128 wide) run the epilogue-
// warpgroup kernel with the common controls' loop: the controls' per-element work is longer
// still than plain sampling's, so overlapping it with the mainloop gains more (docs/kernel.md;
// at 16 columns and below the CUTLASS pingpong tile is as fast). A/B knob:
// FLASHSAMPLING_CONTROLS_SCHEDULE=cutlass runs the CUTLASS schedules.
bool controls_on_epilogue_warpgroups(int tile_n) {
  static bool const cutlass_schedules = env_is("FLASHSAMPLING_CONTROLS_SCHEDULE", "cutlass");
  return tile_n >= 32 && !cutlass_schedules;
}

// Epilogue-warpgroup passes of an even number of 128-wide column tiles run in clusters of two
// CTAs on neighbouring column tiles, which receive each W tile by TMA multicast: W is read from
// L2 once per pair instead of once per CTA (a few percent at B = 256, docs/kernel.md); clusters
// along the vocabulary (sharing the hidden tile) gain nothing measurable and are not built. An
// odd tile count would round up to a whole cluster (an empty tile's mainloop). A/B knob:
// FLASHSAMPLING_EWG_CLUSTER=1 runs one CTA per cluster.
bool epilogue_warpgroups_in_column_clusters(int tile_n, int64_t columns) {  // 128-wide tiles only
  static bool const single = env_is("FLASHSAMPLING_EWG_CLUSTER", "1");
  int64_t const column_tiles = (columns + tile_n - 1) / tile_n;
  return !single && column_tiles % 2 == 0;
}

template <class Element, int TileN, SamplerLoop kLoop>
ConfigEntry sm90_epilogue_warpgroups_entry_for(int64_t columns) {
  if constexpr (TileN == 128) {
    if (epilogue_warpgroups_in_column_clusters(TileN, columns)) {
      return sm90_epilogue_warpgroups_entry<Element, TileN, kLoop, /*kClusterM=*/1, /*kClusterN=*/2>();
    }
  }
  (void)columns;
  return sm90_epilogue_warpgroups_entry<Element, TileN, kLoop>();
}
#endif

// One config per batch bucket (`columns` GEMM columns, tile_n wide), the same table for the
// plain loop and the common controls' loop: the pingpong schedule, whose epilogue overlaps the
// other warpgroup's mainloop, for one N tile, in clusters of two CTAs sharing each hidden tile by
// multicast from N = 32 on (at N = 16 the pair's synchronisation costs more than the hidden
// tile's traffic it saves). With more columns than one 128-wide tile, the cooperative schedule,
// one CTA per cluster: there pingpong + clusters is slower at D = 4096 (docs/kernel.md has the
// A/B). The plain loop beyond 64 columns runs the kernel with epilogue warpgroups instead
// (above).
template <class Element, SamplerLoop kLoop>
ConfigEntry select_entry(int device_arch, int tile_n, int64_t columns) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (device_arch == 90) {
    if (kLoop == SamplerLoop::kPlain && tile_n == 128 && !plain_wide_on_cutlass_schedules()) {
      return sm90_epilogue_warpgroups_entry_for<Element, 128, SamplerLoop::kPlain>(columns);
    }
    if (kLoop == SamplerLoop::kCommonControls && controls_on_epilogue_warpgroups(tile_n)) {
      switch (tile_n) {
        case 32: return sm90_epilogue_warpgroups_entry_for<Element, 32, SamplerLoop::kCommonControls>(columns);
        case 64: return sm90_epilogue_warpgroups_entry_for<Element, 64, SamplerLoop::kCommonControls>(columns);
        default: return sm90_epilogue_warpgroups_entry_for<Element, 128, SamplerLoop::kCommonControls>(columns);
      }
    }
    switch (tile_n) {
      case 16: return sm90_entry<Element, 16, /*kPingpong=*/true, kLoop>();
      case 32: return sm90_entry<Element, 32, true, kLoop, /*kClusterM=*/2>();
      case 64: return sm90_entry<Element, 64, true, kLoop, 2>();
      default:
        return columns <= 128 ? sm90_entry<Element, 128, true, kLoop, 2>()
                              : sm90_entry<Element, 128, false, kLoop>();
    }
  }
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (device_arch == 100) {
    switch (tile_n) {
      case 16: return sm100_entry<Element, 16, kLoop>();
      case 32: return sm100_entry<Element, 32, kLoop>();
      case 64: return sm100_entry<Element, 64, kLoop>();
      default: return sm100_entry<Element, 128, kLoop>();
    }
  }
#endif
  (void)device_arch;
  (void)tile_n;
  (void)columns;
  return {nullptr, nullptr, 0, 0};
}

// The loop for all controls is compiled for N = 16 and 32 only: its per-element code is large
// and the epilogue inlines it once per subtile, so wider tiles are slower; wider batches run
// several N tiles, which re-read W from L2: 16 up to 32 GEMM columns, 32 beyond.
template <class Element>
ConfigEntry select_all_controls(int device_arch, int64_t columns) {
  bool const narrow = columns <= 32;
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (device_arch == 90) {
    return narrow ? sm90_entry<Element, 16, /*kPingpong=*/true, SamplerLoop::kAllControls>()
                  : sm90_entry<Element, 32, true, SamplerLoop::kAllControls>();
  }
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (device_arch == 100) {
    return narrow ? sm100_entry<Element, 16, SamplerLoop::kAllControls>()
                  : sm100_entry<Element, 32, SamplerLoop::kAllControls>();
  }
#endif
  (void)device_arch;
  (void)narrow;
  return {nullptr, nullptr, 0, 0};
}

// The fused top-k pass: its per-element work (a transform and a 4-key insert, no noise) is
// lighter than plain sampling's, so fewer configs than the plain table: N = 16 up to 32 rows
// (two N tiles at 17-32: a 64-wide tile half empty at B = 32 is slower than two narrow ones),
// 64 (pingpong, clusters of two) up to 64, the cooperative 128-wide tile beyond.
template <class Element>
ConfigEntry select_top_candidates(int device_arch, int64_t columns) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  if (device_arch == 90) {
    if (columns <= 32) return sm90_entry<Element, 16, /*kPingpong=*/true, SamplerLoop::kTopCandidates>();
    if (columns <= 64) return sm90_entry<Element, 64, true, SamplerLoop::kTopCandidates, /*kClusterM=*/2>();
    return sm90_entry<Element, 128, false, SamplerLoop::kTopCandidates>();
  }
#endif
#if defined(FLASHSAMPLING_ENABLE_SM100)
  if (device_arch == 100) {
    if (columns <= 32) return sm100_entry<Element, 16, SamplerLoop::kTopCandidates>();
    if (columns <= 64) return sm100_entry<Element, 64, SamplerLoop::kTopCandidates>();
    return sm100_entry<Element, 128, SamplerLoop::kTopCandidates>();
  }
#endif
  (void)device_arch;
  (void)columns;
  return {nullptr, nullptr, 0, 0};
}

// FLASHSAMPLING_PLAIN_TILE_N / FLASHSAMPLING_CONTROLS_TILE_N = 16, 32 or 64 cap the N tile of
// plain / common-controls passes (for A/B runs; wider batches then run several N tiles).
int64_t tile_n_cap(char const* env_name) {
  char const* env = std::getenv(env_name);
  int64_t const n = env ? std::atoll(env) : int64_t{0};
  return n == 16 || n == 32 || n == 64 ? n : int64_t{128};
}

// Calls that need the loop for all controls (per-row seeds / offsets, several samples, sparse
// bias): on sm90 from 17 columns they run the epilogue-warpgroup kernels' controls loop too
// (per-row keys; several samples, GEMM column s * B + b drawing sample s of row b with its own
// key; sparse bias, looked up where a column's row has entries), whose tiles are wider and whose
// skip draws the logs only where they can matter. A/B knob:
// FLASHSAMPLING_ALL_CONTROLS_SCHEDULE=narrow_tiles runs them on the loop for all controls
// (16/32-wide tiles).
bool all_controls_on_epilogue_warpgroups(int device_arch, int controls_tile_n) {
#if defined(FLASHSAMPLING_ENABLE_SM90)
  static bool const narrow_tiles = env_is("FLASHSAMPLING_ALL_CONTROLS_SCHEDULE", "narrow_tiles");
  return device_arch == 90 && !narrow_tiles && controls_on_epilogue_warpgroups(controls_tile_n);
#else
  (void)device_arch;
  (void)controls_tile_n;
  return false;
#endif
}

ConfigEntry select_config(SamplerParams const& p, int device_arch) {
  static int64_t const plain_cap = tile_n_cap("FLASHSAMPLING_PLAIN_TILE_N");
  static int64_t const controls_cap = tile_n_cap("FLASHSAMPLING_CONTROLS_TILE_N");
  int64_t const columns = sampler_gemm_columns(p);
  bool const bf16 = p.element_type == ElementType::kBFloat16;
  if (p.top_k > 0) {
    return bf16 ? select_top_candidates<cutlass::bfloat16_t>(device_arch, columns)
                : select_top_candidates<cutlass::half_t>(device_arch, columns);
  }
  int const controls_tile_n = sampler_tile_n_for_batch(std::min<int64_t>(columns, controls_cap));
  SamplerLoop loop = sampler_loop_for(p.controls, p.noise, p.num_samples, p.logprobs);
  if (loop == SamplerLoop::kAllControls && all_controls_on_epilogue_warpgroups(device_arch, controls_tile_n)) {
    loop = SamplerLoop::kCommonControls;
  }
  switch (loop) {
    case SamplerLoop::kPlain: {
      int const tile_n = sampler_tile_n_for_batch(std::min<int64_t>(columns, plain_cap));
      return bf16 ? select_entry<cutlass::bfloat16_t, SamplerLoop::kPlain>(device_arch, tile_n, columns)
                  : select_entry<cutlass::half_t, SamplerLoop::kPlain>(device_arch, tile_n, columns);
    }
    case SamplerLoop::kCommonControls:
      return bf16 ? select_entry<cutlass::bfloat16_t, SamplerLoop::kCommonControls>(device_arch, controls_tile_n,
                                                                                     columns)
                  : select_entry<cutlass::half_t, SamplerLoop::kCommonControls>(device_arch, controls_tile_n, columns);
    default:
      return bf16 ? select_all_controls<cutlass::bfloat16_t>(device_arch, columns)
                  : select_all_controls<cutlass::half_t>(device_arch, columns);
  }
}

// The hidden rows padded with zero rows to a whole number of N tiles where the last tile's TMA
// box would reach far past the last hidden row: a ragged box (the TMA unit filling the rows past
// the tensor with zeros) is slower than reading zero rows from memory when the last tile is
// mostly empty, and no faster when it is nearly full (docs/kernel.md has the A/B). So: one N
// tile, always; several, when the last one is at most half full. The padding costs a copy and a
// memset node. FLASHSAMPLING_PAD_COLUMNS=0 turns it off (A/B knob).
//
// And the exact skip of the epilogue-warpgroup kernels (docs/noise.md): elements that cannot
// reach their column's best score so far draw no exact noise (in a greedy batch, whose bound is
// the logit itself, such steps merge no keys); the same tokens with it or without.
// FLASHSAMPLING_NOISE_SKIP=0 turns it off (A/B knob, tests). Their log-sum-exp terms are summed
// against each column's log-sum-exp of the half's earlier tiles; FLASHSAMPLING_LSE_REFERENCE=0
// takes each step's max over the lanes instead (A/B knob, tests).
SamplerParams launch_params(SamplerParams const& params, ConfigEntry const& entry) {
  static bool const pad = !env_is("FLASHSAMPLING_PAD_COLUMNS", "0");
  static bool const skip = !env_is("FLASHSAMPLING_NOISE_SKIP", "0");
  static bool const lse_references = !env_is("FLASHSAMPLING_LSE_REFERENCE", "0");
  SamplerParams p = params;
  p.skip_unreachable_noise = skip && entry.skips_unreachable_noise;
  p.lse_references = lse_references && entry.skips_unreachable_noise;
  p.prepare_inv_temperatures = p.controls.temperatures != nullptr && entry.loads_inv_temperatures;
  int64_t const columns = sampler_unpadded_columns(p);
  int64_t const tile = entry.column_tile;
  int64_t const last_tile_rows = tile > 0 ? columns % tile : 0;
  bool const ragged = last_tile_rows != 0 && (columns < tile || 2 * last_tile_rows <= tile);
  p.padded_columns = pad && ragged ? (columns + tile - 1) / tile * tile : 0;
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

const char* sampler_compiled_archs() {
#if defined(FLASHSAMPLING_ENABLE_SM90) && defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm90a,sm100a";
#elif defined(FLASHSAMPLING_ENABLE_SM90)
  return "sm90a";
#elif defined(FLASHSAMPLING_ENABLE_SM100)
  return "sm100a";
#else
  return "";
#endif
}

bool fused_top_k_fits(SamplerParams const& p, int device_arch) {
  ConfigEntry const entry = select_config(p, device_arch);
  return entry.run != nullptr &&
         truncate_candidates_smem_bytes(num_vocab_tiles(p, entry.vocab_tile), entry.vocab_tile) > 0;
}

size_t sampler_workspace_bytes(SamplerParams const& params, int device_arch) {
  ConfigEntry const entry = select_config(params, device_arch);
  if (entry.run == nullptr) return 0;
  SamplerParams const p = launch_params(params, entry);
  return SamplerWorkspaceLayout(p, entry.vocab_tile, entry.gemm_workspace(p)).total;
}

cudaError_t launch_sampler(SamplerParams const& params, void* workspace, size_t workspace_bytes, int device_arch,
                           cudaStream_t stream) {
  ConfigEntry const entry = select_config(params, device_arch);
  if (entry.run == nullptr) return cudaErrorNotSupported;
  if (params.batch_size == 0) return cudaSuccess;
  SamplerParams p = launch_params(params, entry);
  SamplerWorkspaceLayout const layout(p, entry.vocab_tile, entry.gemm_workspace(p));
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
  if (cudaError_t err = launch_prepare_gemm_inputs(p, buffers, stream); err != cudaSuccess) return err;
  p.controls.inv_temperatures = buffers.inv_temperatures;
  cudaError_t err = entry.run(p, buffers, static_cast<char*>(workspace) + layout.gemm, stream);
  if (err != cudaSuccess) return err;
  if (p.top_k > 0) {
    return launch_truncate_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), entry.vocab_tile, stream);
  }
  return launch_reduce_candidates(p, buffers, num_vocab_tiles(p, entry.vocab_tile), stream);
}

}  // namespace flashsampling
