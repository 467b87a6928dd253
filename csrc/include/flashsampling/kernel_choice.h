// Which compiled fused-GEMM unit runs a call: a pure function of (architecture, element loop,
// GEMM columns), read from no environment and no device (as FlashAttention-3's heuristics.h).
// The dispatch (csrc/kernels/sampler_dispatch.cu) maps a choice to its instantiation; a choice's
// unit_name is the file stem csrc/kernels/generate_kernels.py gives that unit, so a CPU test can
// check every choice against the generated list (tests/test_kernel_choice.py, through the op
// flashsampling::_kernel_choice). Torch-free and CUDA-free.
#pragma once

#include <cstdint>
#include <string>

#include "flashsampling/sampler_loop.h"

namespace flashsampling {

// sm90: CUTLASS's warp-specialised schedules (pingpong: each consumer warpgroup's epilogue
// overlaps the other's mainloop; cooperative: both share a 128-row tile) or the kernel with
// epilogue warpgroups of its own (kernel/sm90_sampler_epilogue_warpgroups.hpp). sm100: one.
enum class SamplerSchedule { kPingpong, kCooperative, kEpilogueWarpGroups, kSm100 };

struct KernelChoice {
  int arch = 0;  // 90 or 100; 0: no kernel
  SamplerLoop loop = SamplerLoop::kPlain;
  int tile_n = 0;  // the CTA tile's N (GEMM columns)
  SamplerSchedule schedule = SamplerSchedule::kPingpong;
  int cluster_m = 1;  // CTAs per cluster along the vocabulary (they share each hidden tile)
  int cluster_n = 1;  // CTAs per cluster along the columns (they share each W tile)
};

// Batch buckets: the narrowest N tile that covers the GEMM columns, at most 128; more columns
// run several N tiles (neighbouring CTAs share each W tile through L2). Two 128-wide tiles are
// faster than one 256-wide tile at B = 256 (docs/kernel.md).
inline int sampler_tile_n_for_batch(int64_t columns) {
  return columns <= 16 ? 16 : columns <= 32 ? 32 : columns <= 64 ? 64 : 128;
}

// Plain passes of 129-192 columns run three 64-wide column tiles instead of two 128-wide ones
// (the second at most half full, padded to 128): every tile costs its whole width in MMA and
// epilogue work, and the narrow tiles pad to 192 columns instead of 256 (144 columns: speculative
// verification's 16 x (8 + 1) rows). Where more 64-wide tiles would share each W tile (320 = 5 x 64
// columns) they were slower than 128-wide ones, and so was the common controls' loop at D = 4096
// (docs/kernel.md has the A/B).
inline bool narrow_ragged_column_tiles(int64_t columns) { return columns > 128 && columns <= 192; }

// `loop`: sampler_loop_for's loop of the call, or kTopCandidates for the fused top-k pass;
// `columns`: its GEMM columns before padding. `column_clusters` = false gives the one-CTA
// variant of a column-clustered choice (the same tiles; tests compare the two).
// `top_candidates_epilogue_warpgroups` = false gives the top-k pass on sm90 CUTLASS's tiles
// (beyond 64 columns the cooperative one, 33-64 the 64-wide pingpong) instead of the
// epilogue-warpgroup kernel (the same tokens and scores bit for bit, beyond 64 columns every
// output; tests and benchmarks compare the two). `plain_loop_extras`: the call needs nothing but
// what the plain epilogue-warpgroup loop also applies (sampler_loop.h's
// needs_only_plain_loop_extras: logit_scale / logit_softcap and / or the penalties, or several
// samples on row quads). `narrow_ragged_columns` = false keeps the 128-wide tiles where
// narrow_ragged_column_tiles would take 64-wide ones (the same tokens; tests compare the two).
// `tile_winners`: the top-k pass is to draw the tile winners (SamplerParams::draw_tile_winners,
// which only the CUTLASS schedules' scan draws): such a pass of 33-64 columns keeps the 64-wide
// pingpong tile; one that draws none runs the epilogue-warpgroup kernel's 64-wide scan, whose
// epilogue keeps up with a short mainloop where the pingpong tile's does not (the same tokens and
// scores; the A/B, and the forms it does not help, in docs/truncation_kernels.md).
inline KernelChoice choose_kernel(int arch, SamplerLoop loop, int64_t columns, bool column_clusters = true,
                                  bool top_candidates_epilogue_warpgroups = true, bool plain_loop_extras = false,
                                  bool narrow_ragged_columns = true, bool tile_winners = false) {
  KernelChoice c;
  if (arch != 90 && arch != 100) return c;
  c.arch = arch;
  c.loop = loop;
  bool const sm90 = arch == 90;
  if (loop == SamplerLoop::kTopCandidates) {
    // Its per-element work (a transform and a 4-key insert, no noise) is lighter than plain
    // sampling's: N = 16 up to 32 rows (a 64-wide tile half empty at B = 32 is slower than two
    // narrow ones), 64 up to 64. From 33 columns on sm90 the epilogue-warpgroup kernel, whose
    // epilogue overlaps the next tile's GEMM as for plain sampling (column tiles paired as there),
    // writing per column what the cooperative 128-wide tile's visitor writes
    // (kernel/sm90_sampler_epilogue_warpgroups.hpp); the cooperative tile where asked. A pass of
    // 33-64 columns that draws the tile winners keeps the 64-wide pingpong tile (clusters of two
    // along M), whose visitor draws them.
    c.tile_n = columns <= 32 ? 16 : columns <= 64 ? 64 : 128;
    bool const epilogue_warpgroups = c.tile_n == 128 || (c.tile_n == 64 && !tile_winners);
    if (!sm90) {
      c.schedule = SamplerSchedule::kSm100;
    } else if (epilogue_warpgroups && top_candidates_epilogue_warpgroups) {
      c.schedule = SamplerSchedule::kEpilogueWarpGroups;
      int64_t const column_tiles = (columns + 127) / 128;
      c.cluster_n = column_tiles % 2 == 0 && column_clusters ? 2 : 1;
    } else {
      c.schedule = c.tile_n == 128 ? SamplerSchedule::kCooperative : SamplerSchedule::kPingpong;
      c.cluster_m = c.tile_n == 64 ? 2 : 1;
    }
    return c;
  }
  int const tile_n = sampler_tile_n_for_batch(columns);
  if (!sm90) {
    // The loop for all controls is compiled for N = 16 and 32 only: its per-element code is
    // large and the epilogue inlines it once per subtile, so wider tiles are slower.
    c.tile_n = loop == SamplerLoop::kAllControls ? (columns <= 32 ? 16 : 32) : tile_n;
    c.schedule = SamplerSchedule::kSm100;
    return c;
  }
  // sm90. From 17 columns the epilogue-warpgroup kernels' controls loop takes every control
  // (per-row keys, several samples, sparse bias) on wider tiles, and its skip draws the logs
  // only where they can matter.
  if (loop == SamplerLoop::kAllControls && tile_n >= 32) c.loop = SamplerLoop::kCommonControls;
  // A call with logit_scale / logit_softcap and / or the penalties alone beyond 32 columns: the
  // plain loop of the epilogue-warpgroup kernel applies them, the soft-cap's tanh and the
  // penalties' look-ups only in steps whose exact scores the skip needs (its bounds:
  // fs_softcap_upper_bound, and the logit itself in rows whose penalties only lower logits),
  // where the controls' loop would pay them on every element, which a short mainloop (D = 2048)
  // hides least (the A/B: docs/epilogue.md). So does a call of several samples alone on row quads
  // (speculative verification's positions): the plain loop draws their noise as plain sampling's,
  // where the controls' loop pays for its per-column controls. Up to 32 columns the controls' loop
  // stays.
  if (c.loop == SamplerLoop::kCommonControls && plain_loop_extras && tile_n >= 64) c.loop = SamplerLoop::kPlain;
  // Plain passes of more than 32 columns and controls passes of more than 16 run the kernel with
  // epilogue warpgroups: there the epilogue's work is as long as the mainloop (at D = 2048 longer,
  // where the 64-wide pingpong tile fell furthest behind; docs/kernel.md, *Short K*), and
  // warpgroups of its own overlap it with the next tile's GEMM, which CUTLASS's schedules do not
  // (docs/kernel.md). An even number of 128-wide column tiles runs in clusters of
  // two along N, which receive each W tile by TMA multicast (an odd count would round up to an
  // empty tile).
  bool const wide_plain = c.loop == SamplerLoop::kPlain && tile_n >= 64;
  bool const wide_controls = c.loop == SamplerLoop::kCommonControls && tile_n >= 32;
  if (wide_plain || wide_controls) {
    c.tile_n = wide_plain && narrow_ragged_columns && narrow_ragged_column_tiles(columns) ? 64 : tile_n;
    c.schedule = SamplerSchedule::kEpilogueWarpGroups;
    int64_t const column_tiles = (columns + c.tile_n - 1) / c.tile_n;
    c.cluster_n = c.tile_n == 128 && column_tiles % 2 == 0 && column_clusters ? 2 : 1;
    return c;
  }
  // Otherwise one N tile on the pingpong schedule, in clusters of two along M at N = 32 (at
  // N = 16 the pair's synchronisation costs more than the hidden tile's traffic it saves).
  c.tile_n = tile_n;
  c.schedule = SamplerSchedule::kPingpong;
  c.cluster_m = tile_n >= 32 ? 2 : 1;
  return c;
}

// The unit's file stem in csrc/kernels/instantiations/ (generate_kernels.py's Kernel.filename).
inline std::string kernel_unit_name(KernelChoice const& c, bool bf16) {
  if (c.arch == 0) return "";
  std::string name = std::string("sampler_") + (bf16 ? "bf16" : "fp16") + "_n" + std::to_string(c.tile_n) + "_" +
                     sampler_loop_name(c.loop);
  switch (c.schedule) {
    case SamplerSchedule::kPingpong: name += "_pingpong"; break;
    case SamplerSchedule::kCooperative: name += "_cooperative"; break;
    case SamplerSchedule::kEpilogueWarpGroups: name += "_epilogue_warpgroups"; break;
    case SamplerSchedule::kSm100: break;
  }
  if (c.cluster_m > 1) name += "_cluster_m" + std::to_string(c.cluster_m);
  if (c.cluster_n > 1) name += "_cluster_n" + std::to_string(c.cluster_n);
  return name + (c.arch == 90 ? "_sm90" : "_sm100");
}

}  // namespace flashsampling
