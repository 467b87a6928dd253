#!/usr/bin/env python3
"""Writes csrc/kernels/instantiations/*.cu: one translation unit per fused-GEMM config.

Each config of the fused sampler (sampler_gemm_sm90.cuh / sampler_gemm_sm100.cuh) is
instantiated in a file of its own so that the build compiles them in parallel. The configs
are the points of these axes that the dispatch can select (choose_kernel in
csrc/include/flashsampling/kernel_choice.h; tests/test_kernel_choice.py checks the two agree):

  arch      sm90 (sm_90a) | sm100 (sm_100a)
  dtype     bf16 | fp16
  tile_n    the CTA tile's N (GEMM columns): 16 | 32 | 64 | 128
  loop      the epilogue's element loop (SamplerLoop): plain | common_controls |
            all_controls | top_candidates
  schedule  sm90: pingpong | cooperative (CUTLASS's warp-specialised schedules) |
            epilogue_warpgroups (sm90_sampler_epilogue_warpgroups.hpp); sm100: one schedule
  cluster   CTAs per cluster along M (the vocabulary: the pair multicasts each hidden tile)
            or along N (the columns: the pair multicasts each W tile); 1 x 1 unless named

File names spell every axis: sampler_<dtype>_n<N>_<loop>[_<schedule>][_cluster_m2 |
_cluster_n2]_<arch>.cu. The suffix _sm90 / _sm100 is what the build keys the -gencode on
(tools/build_config.py).

    python3 csrc/kernels/generate_kernels.py           # rewrite instantiations/
    python3 csrc/kernels/generate_kernels.py --check   # exit 1 if instantiations/ is stale

tools/build_config.py (setup.py, tests/test_compile_cuda.py) and CMakeLists.txt take the
list of units from kernels() below; tests/test_generate_kernels.py checks that the committed
files equal a fresh generation.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
INSTANTIATION_DIR = KERNEL_DIR / "instantiations"
GENERATOR = "csrc/kernels/generate_kernels.py"

DTYPES = {"bf16": "cutlass::bfloat16_t", "fp16": "cutlass::half_t"}
LOOPS = {
    "plain": "SamplerLoop::kPlain",
    "common_controls": "SamplerLoop::kCommonControls",
    "all_controls": "SamplerLoop::kAllControls",
    "top_candidates": "SamplerLoop::kTopCandidates",
}
LOOP_TEXT = {
    "plain": "the plain loop",
    "common_controls": "the common controls' loop",
    "all_controls": "the loop for every control",
    "top_candidates": "the fused top-k pass's loop",
}
SCHEDULE_TEXT = {
    "pingpong": "pingpong schedule",
    "cooperative": "cooperative schedule",
    "epilogue_warpgroups": "epilogue warpgroups of its own",
}


@dataclass(frozen=True)
class Kernel:
    arch: str  # "sm90" | "sm100"
    dtype: str  # key of DTYPES
    tile_n: int
    loop: str  # key of LOOPS
    schedule: str = ""  # sm90: key of SCHEDULE_TEXT; sm100: ""
    cluster_m: int = 1
    cluster_n: int = 1

    @property
    def filename(self) -> str:
        parts = ["sampler", self.dtype, f"n{self.tile_n}", self.loop]
        if self.schedule:
            parts.append(self.schedule)
        if self.cluster_m > 1:
            parts.append(f"cluster_m{self.cluster_m}")
        if self.cluster_n > 1:
            parts.append(f"cluster_n{self.cluster_n}")
        parts.append(self.arch)
        return "_".join(parts) + ".cu"

    @property
    def header(self) -> str:
        return "sampler_gemm_sm90.cuh" if self.arch == "sm90" else "sampler_gemm_sm100.cuh"

    @property
    def instantiation(self) -> str:
        element, loop = DTYPES[self.dtype], LOOPS[self.loop]
        if self.arch == "sm100":
            assert self.cluster_m == self.cluster_n == 1 and not self.schedule
            return f"FLASHSAMPLING_INSTANTIATE_SM100({element}, {self.tile_n}, {loop})"
        if self.schedule == "epilogue_warpgroups":
            if self.cluster_m == self.cluster_n == 1:
                return f"FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS({element}, {self.tile_n}, {loop})"
            return (
                f"FLASHSAMPLING_INSTANTIATE_SM90_EPILOGUE_WARPGROUPS_CLUSTER({element}, {self.tile_n}, {loop}, "
                f"{self.cluster_m}, {self.cluster_n})"
            )
        assert self.cluster_n == 1, "the CUTLASS schedules cluster along M only"
        pingpong = "true" if self.schedule == "pingpong" else "false"
        if self.cluster_m == 1:
            return f"FLASHSAMPLING_INSTANTIATE_SM90({element}, {self.tile_n}, {pingpong}, {loop})"
        return f"FLASHSAMPLING_INSTANTIATE_SM90_CLUSTER({element}, {self.tile_n}, {pingpong}, {loop}, {self.cluster_m})"

    def description(self) -> str:
        arch = "sm90a" if self.arch == "sm90" else "sm100a"
        text = f"{arch}, {self.dtype}, CTA tile N = {self.tile_n}, {LOOP_TEXT[self.loop]}"
        if self.schedule:
            text += f", {SCHEDULE_TEXT[self.schedule]}"
        if self.cluster_m > 1:
            text += f", clusters of {self.cluster_m} CTAs along M (the vocabulary)"
        if self.cluster_n > 1:
            text += f", clusters of {self.cluster_n} CTAs along N (the columns)"
        return text + "."

    def source(self) -> str:
        lines = [
            f"// Auto-generated: do not edit; generated by {GENERATOR}.",
            f"// Fused sampler: {self.description()}",
        ]
        lines += [
            f'#include "../{self.header}"',
            "",
            "namespace flashsampling {",
            self.instantiation,
            "}  // namespace flashsampling",
        ]
        return "\n".join(lines) + "\n"


def sm90_kernels(dtype: str) -> list[Kernel]:
    """The sm90 units: every choice of choose_kernel (csrc/include/flashsampling/kernel_choice.h)."""
    k = lambda *a, **kw: Kernel("sm90", dtype, *a, **kw)  # noqa: E731
    return [
        # One N tile on the pingpong schedule (clusters of two along M at N = 32): plain passes
        # up to 32 columns, the controls' loops up to 16.
        k(16, "plain", "pingpong"),
        k(32, "plain", "pingpong", cluster_m=2),
        k(16, "common_controls", "pingpong"),
        k(16, "all_controls", "pingpong"),
        # The kernel with epilogue warpgroups of its own: plain passes of more than 32 columns,
        # controls passes (and those needing every control) of more than 16; an even number of
        # 128-wide column tiles runs in clusters of two along N; plain passes of 129-192 columns
        # run three 64-wide tiles (kernel_choice.h's narrow_ragged_column_tiles), and so do
        # those of 33-64 columns on one.
        k(64, "plain", "epilogue_warpgroups"),
        k(128, "plain", "epilogue_warpgroups"),
        k(128, "plain", "epilogue_warpgroups", cluster_n=2),
        k(32, "common_controls", "epilogue_warpgroups"),
        k(64, "common_controls", "epilogue_warpgroups"),
        k(128, "common_controls", "epilogue_warpgroups"),
        k(128, "common_controls", "epilogue_warpgroups", cluster_n=2),
        # The fused top-k pass: N = 16 up to 32 rows; 33-64 the kernel with epilogue warpgroups'
        # 64-wide scan, or the 64-wide pingpong tile where the pass draws the tile winners; beyond,
        # that kernel's 128-wide scan (an even number of column tiles in clusters of two along N).
        # CUTLASS's tiles, whose visitor's tokens and scores the kernel reproduces bit for bit, also
        # serve DispatchOptions::top_candidates_epilogue_warpgroups = false (the A/B's reference).
        k(16, "top_candidates", "pingpong"),
        k(64, "top_candidates", "pingpong", cluster_m=2),
        k(64, "top_candidates", "epilogue_warpgroups"),
        k(128, "top_candidates", "epilogue_warpgroups"),
        k(128, "top_candidates", "epilogue_warpgroups", cluster_n=2),
        k(128, "top_candidates", "cooperative"),
    ]


def sm100_kernels(dtype: str) -> list[Kernel]:
    """The sm100 units: one schedule, so one unit per (loop, N tile) select_* can choose."""
    tiles = {
        "plain": (16, 32, 64, 128),
        "common_controls": (16, 32, 64, 128),
        "all_controls": (16, 32),
        "top_candidates": (16, 64, 128),
    }
    return [Kernel("sm100", dtype, n, loop) for loop, ns in tiles.items() for n in ns]


def kernels() -> list[Kernel]:
    """Every instantiation unit, sorted by file name."""
    units = [u for dtype in DTYPES for u in (*sm90_kernels(dtype), *sm100_kernels(dtype))]
    names = [u.filename for u in units]
    assert len(set(names)) == len(names), "two units share a file name"
    return sorted(units, key=lambda u: u.filename)


def instantiation_sources() -> list[Path]:
    """Paths of the generated units (what the build compiles)."""
    return [INSTANTIATION_DIR / u.filename for u in kernels()]


def stale_files(out_dir: Path = INSTANTIATION_DIR) -> list[str]:
    """Files of out_dir that differ from a fresh generation, are missing or are extra."""
    expected = {u.filename: u.source() for u in kernels()}
    present = {p.name for p in out_dir.glob("*.cu")} if out_dir.is_dir() else set()
    stale = [n for n, text in expected.items() if n not in present or (out_dir / n).read_text() != text]
    return sorted(stale + [n for n in present if n not in expected])


def generate(out_dir: Path = INSTANTIATION_DIR) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    expected = {u.filename: u.source() for u in kernels()}
    for stale in out_dir.glob("*.cu"):
        if stale.name not in expected:
            stale.unlink()
    for name, text in expected.items():
        path = out_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if instantiations/ is stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale (run python3 {GENERATOR}): {', '.join(stale)}", file=sys.stderr)
            return 1
        return 0
    generate()
    print(f"{len(kernels())} units in {INSTANTIATION_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
