"""Build configuration shared by setup.py and tests/test_compile_cuda.py.

Torch-free on purpose: it describes how the CUDA kernels (csrc/kernels/**/*.cu, which
never include torch) are compiled, one object per source with its own -gencode list.
The kernel sources are the hand-written ones (every .cu under csrc/kernels/ outside
instantiations/) plus the units csrc/kernels/generate_kernels.py lists, which it writes to
csrc/kernels/instantiations/. CMakeLists.txt mirrors the same rules and asks kernel_sources()
below for the list.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INCLUDE_DIR = ROOT / "csrc" / "include"
TORCH_SRC_DIR = ROOT / "csrc" / "torch"
KERNEL_DIR = ROOT / "csrc" / "kernels"
INSTANTIATION_DIR = KERNEL_DIR / "instantiations"
GENERATOR = KERNEL_DIR / "generate_kernels.py"

# philox_gumbel.h relies on the host compiler not contracting a * b + c into an fma.
HOST_FLAGS = ["-O3", "-ffp-contract=off"]
NVCC_FLAGS = [
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-DNDEBUG",
    "-Xcompiler=-fPIC,-ffp-contract=off",
]


@dataclass(frozen=True)
class CudaArch:
    name: str  # as in FLASHSAMPLING_CUDA_ARCHS, e.g. "90a"
    define: str  # defined for every translation unit when this arch is built
    file_suffix: str  # kernel files named *<suffix>.cu are built for this arch only

    @property
    def gencode(self) -> str:
        return f"-gencode=arch=compute_{self.name},code=sm_{self.name}"


CUDA_ARCHS = {
    arch.name: arch
    for arch in (
        CudaArch("90a", "FLASHSAMPLING_ENABLE_SM90", "_sm90"),
        CudaArch("100a", "FLASHSAMPLING_ENABLE_SM100", "_sm100"),
    )
}


def find_nvcc() -> str | None:
    """nvcc of CUDA_HOME / CUDA_PATH, else the one on PATH, else None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def nvcc_supported_archs(nvcc: str) -> set[str]:
    """Numeric compute capabilities nvcc can target, e.g. {"90", "100"}."""
    listing = subprocess.run(
        [nvcc, "--list-gpu-arch"], check=True, capture_output=True, text=True
    ).stdout
    return set(re.findall(r"compute_(\d+)", listing))


def enabled_cuda_archs(nvcc: str) -> list[CudaArch]:
    """Archs from FLASHSAMPLING_CUDA_ARCHS ("90a;100a"), or by default every known arch
    nvcc supports. An explicitly requested arch nvcc cannot build is an error."""
    supported = nvcc_supported_archs(nvcc)
    requested = os.environ.get("FLASHSAMPLING_CUDA_ARCHS")
    if requested is None:
        return [a for a in CUDA_ARCHS.values() if a.name.rstrip("a") in supported]
    archs = []
    for name in filter(None, (n.strip() for n in re.split(r"[;, ]", requested))):
        if name not in CUDA_ARCHS:
            raise ValueError(
                f"FLASHSAMPLING_CUDA_ARCHS: unknown arch {name!r}; known: {', '.join(CUDA_ARCHS)}"
            )
        if name.rstrip("a") not in supported:
            raise ValueError(f"FLASHSAMPLING_CUDA_ARCHS: {nvcc} cannot build sm_{name}")
        archs.append(CUDA_ARCHS[name])
    return archs


@functools.cache
def kernel_generator():
    """csrc/kernels/generate_kernels.py as a module (it is not part of any package)."""
    spec = importlib.util.spec_from_file_location("flashsampling_generate_kernels", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def handwritten_kernel_sources() -> list[Path]:
    """Every .cu under csrc/kernels/ except the generated units."""
    return sorted(p for p in KERNEL_DIR.rglob("*.cu") if INSTANTIATION_DIR not in p.parents)


def generated_kernel_sources() -> list[Path]:
    """The units generate_kernels.py writes to csrc/kernels/instantiations/."""
    return kernel_generator().instantiation_sources()


def kernel_sources() -> list[Path]:
    return sorted([*handwritten_kernel_sources(), *generated_kernel_sources()])


def archs_for_source(source: Path, enabled: list[CudaArch]) -> list[CudaArch]:
    """*_sm90.cu / *_sm100.cu build for their own arch only; other sources for all."""
    for arch in CUDA_ARCHS.values():
        if source.stem.endswith(arch.file_suffix):
            return [arch] if arch in enabled else []
    return list(enabled)


def cutlass_include_dirs() -> list[str]:
    """CUTLASS headers of the installed nvidia-cutlass package (cutlass_library/source)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "CUTLASS headers not found: pip install --no-deps nvidia-cutlass==4.2.0.0"
        )
    source = Path(spec.origin).parent / "source"
    dirs = [source / "include", source / "tools" / "util" / "include"]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise RuntimeError(f"nvidia-cutlass is installed without its headers: {missing}")
    return [str(d) for d in dirs]


def arch_defines(enabled: list[CudaArch]) -> list[str]:
    return [f"-D{arch.define}" for arch in enabled]


# Element types of the fused-GEMM units: generate_kernels.py's DTYPES.
ELEMENT_TYPES = tuple(kernel_generator().DTYPES)


@functools.cache
def _unit_element_types() -> dict[str, str]:
    """Each generated unit's file name -> its element type."""
    return {u.filename: u.dtype for u in kernel_generator().kernels()}


def enabled_element_types() -> list[str]:
    """Element types whose fused-GEMM units are built: FLASHSAMPLING_ELEMENT_TYPES ("bf16;fp16",
    the default: both). A build of one (a same-run A/B of bf16 forms builds about half the units)
    defines FLASHSAMPLING_NO_<TYPE>_KERNELS for the other, whose calls then fail with the op's
    error that the build has no kernel for them."""
    requested = os.environ.get("FLASHSAMPLING_ELEMENT_TYPES")
    if requested is None:
        return list(ELEMENT_TYPES)
    names = [n for n in (n.strip() for n in re.split(r"[;, ]", requested)) if n]
    unknown = [n for n in names if n not in ELEMENT_TYPES]
    if unknown or not names:
        raise ValueError(
            f"FLASHSAMPLING_ELEMENT_TYPES: {requested!r} names no element type or an unknown one; "
            f"known: {', '.join(ELEMENT_TYPES)}"
        )
    return [t for t in ELEMENT_TYPES if t in names]


def element_type_defines(enabled: list[str]) -> list[str]:
    return [f"-DFLASHSAMPLING_NO_{t.upper()}_KERNELS" for t in ELEMENT_TYPES if t not in enabled]


def element_type_of_source(source: Path) -> str | None:
    """The element type of a generated fused-GEMM unit (None for a hand-written source)."""
    if INSTANTIATION_DIR not in source.parents:
        return None
    return _unit_element_types().get(source.name)


def extra_nvcc_flags() -> list[str]:
    """FLASHSAMPLING_NVCC_EXTRA, split on spaces: flags for profiling builds (e.g. -lineinfo,
    which lets Nsight Compute attribute stalls to source lines); empty by default."""
    return os.environ.get("FLASHSAMPLING_NVCC_EXTRA", "").split()


def nvcc_command(
    nvcc: str, source: Path, output: Path, enabled: list[CudaArch]
) -> list[str] | None:
    """The nvcc -c command line of one kernel source; None when none of its archs is enabled, or
    it is a fused-GEMM unit of an element type the build leaves out (enabled_element_types)."""
    archs = archs_for_source(source, enabled)
    element_types = enabled_element_types()
    if not archs or element_type_of_source(source) not in (None, *element_types):
        return None
    includes = [f"-I{d}" for d in [str(INCLUDE_DIR), *cutlass_include_dirs()]]
    return [
        nvcc,
        *NVCC_FLAGS,
        *extra_nvcc_flags(),
        *arch_defines(enabled),
        *element_type_defines(element_types),
        *includes,
        *(arch.gencode for arch in archs),
        "-c",
        str(source),
        "-o",
        str(output),
    ]

