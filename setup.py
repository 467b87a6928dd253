"""Builds flashsampling_cuda._C (metadata lives in pyproject.toml).

    pip install --no-build-isolation .      # or -e .

CPU path always; with a CUDA build of torch and nvcc also the CUDA path:
csrc/torch/*_cuda.cpp plus the kernels csrc/kernels/**/*.cu, each kernel compiled by
our own ninja file with its own -gencode list (tools/build_config.py has the rules).

Environment:
  FLASHSAMPLING_WITH_CUDA   auto (default) | 0 (CPU only) | 1 (fail unless CUDA can be built)
  FLASHSAMPLING_CUDA_ARCHS  e.g. "90a;100a" (default: those of both that nvcc supports)
  FLASHSAMPLING_ELEMENT_TYPES  "bf16;fp16" (default) or one of them: the fused-GEMM units built
  MAX_JOBS                  parallel compile jobs (torch's ninja and the kernel ninja)
"""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
import build_config as cfg  # noqa: E402

EXTENSION_NAME = "flashsampling_cuda._C"


def cuda_nvcc() -> str | None:
    """nvcc to build the CUDA path with, or None for a CPU-only build."""
    mode = os.environ.get("FLASHSAMPLING_WITH_CUDA", "auto").lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"FLASHSAMPLING_WITH_CUDA must be auto, 0 or 1, got {mode!r}")
    nvcc = cfg.find_nvcc()
    if mode == "0":
        return None
    if torch.version.cuda is None or nvcc is None:
        if mode == "1":
            raise RuntimeError(
                "FLASHSAMPLING_WITH_CUDA=1 needs a CUDA build of torch and nvcc; "
                f"torch.version.cuda={torch.version.cuda}, nvcc={nvcc}"
            )
        return None
    return nvcc


def openmp_flags() -> list[str]:
    """-fopenmp where torch runs its CPU threads on OpenMP (Linux builds): at::parallel_for
    is an inline `#pragma omp parallel` there, so without the flag the CPU ops would run on
    one thread. The extension then needs libgomp.so.1, which torch has already loaded."""
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        return ["-fopenmp"]
    return []


def _ninja_escape_path(path: Path) -> str:
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


class BuildExtensionWithKernels(BuildExtension):
    """torch's BuildExtension, plus the CUDA kernel objects linked into the extension.

    CUDAExtension applies one set of nvcc flags to every .cu file; the kernels need a
    -gencode list per file (*_sm90.cu -> sm_90a only, ...), so they are compiled here
    through a ninja file of their own and handed to the link as extra objects.
    """

    def build_extensions(self):
        for ext in self.extensions:
            kernel_build = getattr(ext, "kernel_build", None)
            if kernel_build is not None:
                ext.extra_objects = list(ext.extra_objects) + self._compile_kernels(*kernel_build)
        super().build_extensions()
        for ext in self.extensions:
            self._check_no_embedded_libstdcxx(self.get_ext_fullpath(ext.name))

    @staticmethod
    def _check_no_embedded_libstdcxx(library: str) -> None:
        """Fails the build if the extension defines libstdc++'s locale internals.

        A devtoolset-style compiler (libstdc++.so a linker script adding
        libstdc++_nonshared.a) links part of libstdc++ statically; the extension then
        holds a second copy of the locale state and crashes as soon as an error message
        formats a number. Seen with the GPU machine's /opt/gcc wrapper.
        """
        if shutil.which("nm") is None:
            return
        symbols = subprocess.run(
            ["nm", "-D", "--defined-only", library], capture_output=True, text=True
        ).stdout
        if "_ZNSt6locale5_Impl" in symbols:
            raise RuntimeError(
                f"{library} embeds part of libstdc++ (compiler: {os.environ.get('CXX', 'c++')}); "
                "it would crash when formatting numbers. Rebuild with the system compiler, "
                "e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc pip install --no-build-isolation -e ."
            )

    def _compile_kernels(self, nvcc: str, archs: list) -> list[str]:
        build_dir = Path(self.build_temp).resolve() / "kernels"
        build_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "ninja_required_version = 1.3",
            "rule nvcc",
            "  command = $cmd --generate-dependencies-with-compile --dependency-output $out.d",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = nvcc $out",
        ]
        objects = []
        for source in cfg.kernel_sources():
            obj = build_dir / source.relative_to(cfg.KERNEL_DIR).with_suffix(".o")
            command = cfg.nvcc_command(nvcc, source, obj, archs)
            if command is None:  # a per-arch file whose arch is not enabled
                continue
            obj.parent.mkdir(parents=True, exist_ok=True)
            cmd = " ".join(shlex.quote(arg) for arg in command).replace("$", "$$")
            lines += [
                f"build {_ninja_escape_path(obj)}: nvcc {_ninja_escape_path(source)}",
                f"  cmd = {cmd}",
            ]
            objects.append(str(obj))
        if not objects:
            return []
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["ninja", "-C", str(build_dir), "-j", jobs], check=True)
        return objects


def make_extension():
    root = Path(__file__).resolve().parent
    sources = sorted(cfg.TORCH_SRC_DIR.glob("*.cpp"))
    is_cuda_only = lambda p: p.stem.endswith("_cuda")  # noqa: E731
    rel = lambda paths: [os.path.relpath(p, root) for p in paths]  # noqa: E731
    nvcc = cuda_nvcc()
    if nvcc is None:
        print("flashsampling: building the CPU path only", file=sys.stderr)
        return CppExtension(
            EXTENSION_NAME,
            rel(p for p in sources if not is_cuda_only(p)),
            include_dirs=[str(cfg.INCLUDE_DIR)],
            extra_compile_args={"cxx": cfg.HOST_FLAGS + openmp_flags()},
            extra_link_args=openmp_flags(),
            py_limited_api=True,
        )
    archs = cfg.enabled_cuda_archs(nvcc)
    print(f"flashsampling: building CPU + CUDA for {[a.name for a in archs]}", file=sys.stderr)
    ext = CUDAExtension(
        EXTENSION_NAME,
        rel(sources),
        include_dirs=[str(cfg.INCLUDE_DIR), *cfg.cutlass_include_dirs()],
        extra_compile_args={
            "cxx": [*cfg.HOST_FLAGS, *openmp_flags(), "-DFLASHSAMPLING_WITH_CUDA", *cfg.arch_defines(archs)],
            "nvcc": [],
        },
        extra_link_args=openmp_flags(),
        py_limited_api=True,
    )
    ext.kernel_build = (nvcc, archs)  # read by BuildExtensionWithKernels
    return ext


setup(
    packages=["flashsampling_cuda", "flashsampling_cuda.integrations",
              "flashsampling_cuda.integrations.transformers"],
    ext_modules=[make_extension()],
    cmdclass={"build_ext": BuildExtensionWithKernels},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
