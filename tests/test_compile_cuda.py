"""Compile check (no GPU needed): the CUDA kernel sources compile with the local nvcc
against the nvidia-cutlass headers, for sm_90a and/or sm_100a as its name says
(tools/build_config.py: the same sources and command setup.py builds with).

Each fused GEMM unit (csrc/kernels/instantiations/, written by generate_kernels.py) takes
about a minute on CI's two cores, so by default the check compiles every hand-written source
plus one unit per (epilogue loop, architecture, schedule family) (REPRESENTATIVE_GEMMS): the
units differ only in template arguments of the same headers. FLASHSAMPLING_COMPILE_CHECK=all
compiles every unit (the GPU machine's build does anyway)."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import build_config as cfg  # noqa: E402

NVCC = cfg.find_nvcc()
ALL_ARCHS = list(cfg.CUDA_ARCHS.values())
# The plain, common and all controls' loops, the top-k pass; pingpong, clusters, cooperative
# and the kernel with epilogue
# warpgroups (one CTA and column pairs: the cluster launch) on sm90; bf16 only (the
# fp16 units instantiate the same code with another element type).
REPRESENTATIVE_GEMMS = {
    "sampler_bf16_n16_plain_pingpong_sm90.cu",
    "sampler_bf16_n128_plain_epilogue_warpgroups_sm90.cu",
    "sampler_bf16_n128_common_controls_epilogue_warpgroups_sm90.cu",
    "sampler_bf16_n128_plain_epilogue_warpgroups_cluster_n2_sm90.cu",
    "sampler_bf16_n64_plain_epilogue_warpgroups_sm90.cu",
    "sampler_bf16_n32_plain_pingpong_cluster_m2_sm90.cu",
    "sampler_bf16_n16_all_controls_pingpong_sm90.cu",
    "sampler_bf16_n128_top_candidates_cooperative_sm90.cu",
    "sampler_bf16_n16_plain_sm100.cu",
    "sampler_bf16_n64_common_controls_sm100.cu",
    "sampler_bf16_n16_all_controls_sm100.cu",
    "sampler_bf16_n64_top_candidates_sm100.cu",
}


def selected_sources() -> list:
    if os.environ.get("FLASHSAMPLING_COMPILE_CHECK") == "all":
        return cfg.kernel_sources()
    generated = cfg.generated_kernel_sources()
    missing = REPRESENTATIVE_GEMMS - {s.name for s in generated}
    assert not missing, f"REPRESENTATIVE_GEMMS names units generate_kernels.py does not list: {sorted(missing)}"
    return sorted([*cfg.handwritten_kernel_sources(), *(s for s in generated if s.name in REPRESENTATIVE_GEMMS)])


SOURCES = selected_sources()
PARALLEL_COMPILES = 2

pytestmark = [
    pytest.mark.compile_check,
    pytest.mark.skipif(NVCC is None, reason="nvcc not found: the CUDA compile check needs the CUDA toolkit"),
]

# The noise header must compile as device code too (kernels include it).
NOISE_HEADER_PROBE = r"""
#include "flashsampling/philox_gumbel.h"
__global__ void probe(unsigned long long seed, float* out) {
  out[threadIdx.x] = flashsampling::fs_perturbed_score(
      1.0f, 0.5f, flashsampling::fs_gumbel_noise(seed, 0, threadIdx.x, 0, blockIdx.x));
}
"""


def nvcc_compile(source: Path, obj: Path) -> tuple[int, str]:
    command = cfg.nvcc_command(NVCC, source, obj, ALL_ARCHS)
    proc = subprocess.run(command, capture_output=True, text=True)
    return proc.returncode, " ".join(command) + "\n" + proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def compile_results(request, tmp_path_factory):
    """The selected kernel sources compiled once, PARALLEL_COMPILES at a time: {source: (rc, log)}."""
    params = [item.callspec.params for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    selected = [p["source"] for p in params if "source" in p]
    out_dir = tmp_path_factory.mktemp("kernel_objects")
    objects = [out_dir / (str(s.relative_to(cfg.KERNEL_DIR)).replace("/", "__") + ".o") for s in selected]
    with ThreadPoolExecutor(max_workers=PARALLEL_COMPILES) as pool:
        return dict(zip(selected, pool.map(nvcc_compile, selected, objects)))


@pytest.mark.parametrize("source", SOURCES, ids=[str(s.relative_to(cfg.KERNEL_DIR)) for s in SOURCES])
def test_kernel_source_compiles(source, compile_results):
    returncode, log = compile_results[source]
    assert returncode == 0, log


def test_noise_header_compiles_as_device_code(tmp_path):
    probe = tmp_path / "noise_probe.cu"
    probe.write_text(NOISE_HEADER_PROBE)
    returncode, log = nvcc_compile(probe, tmp_path / "noise_probe.o")
    assert returncode == 0, log
