#!/usr/bin/env python3
"""Builds the native extension ``jax_blocksparse/_jbs_kernels*.so`` from ``cuda/``.

The extension always holds the CPU kernels (``cuda/cpu/``), compiled by the host C++
compiler alone, so a CPU-only machine gets them from ``pip install``. When nvcc is
found (and ``--cpu-only`` is not given) it also holds the CUDA kernels (``cuda/*.cu``)
and their handlers, with the CUDA runtime linked statically so that the module still
imports on a machine without a GPU. One module registers both platforms
(``jax_blocksparse/_native.py``).

Translation units compile in parallel into ``build/``; each command is printed before
it runs, and an object is rebuilt only when its source, a header or its command
changed. The CPU kernels are compiled once per instruction set (on x86-64: baseline,
AVX2+FMA, AVX-512; elsewhere baseline only) and the best one is chosen at run time.

Headers: XLA FFI from ``jax.ffi.include_dir()``, pybind11 from ``pybind11.get_include()``,
Python from ``sysconfig``. When sm_90a is among the architectures, the Hopper kernels
(``cuda/sm90/*.cu``, CuTe/CUTLASS: TMA, wgmma, warp-specialized pipelines) are compiled
for sm_90a alone, with the CUTLASS headers of the ``nvidia-cutlass`` package (a build
requirement; ``cutlass_library.source_path``/include) as system headers for those sources
only; without the package that is a build error naming it.

Usage::

    python build.py                              # CPU + CUDA (sm_80, sm_90a, compute_90 PTX)
    python build.py --cuda-arch sm_90a --jobs 8  # one architecture, 8 parallel compilers
    python build.py --cpu-only                   # no nvcc needed
    python build.py --dry-run                    # print the commands only

``setup.py`` imports this file and calls :func:`find_nvcc` and :func:`main`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SRC_DIR = ROOT / "cuda"
CPU_DIR = SRC_DIR / "cpu"
BUILD_DIR = ROOT / "build"
DEFAULT_OUTPUT_DIR = ROOT / "jax_blocksparse"
MODULE_NAME = "_jbs_kernels"
# SASS for Ampere and Hopper, plus compute_90 PTX that newer GPUs JIT-compile.
DEFAULT_ARCHS = ("sm_80", "sm_90a", "compute_90")
HOST_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden")
NVCC_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden")
DEVICE_FLAGS = ("-lineinfo", "--expt-relaxed-constexpr")
# The CPU kernels per instruction set: namespace -> (floats per vector register, flags).
CPU_KERNELS = CPU_DIR / "bsmm_cpu_kernels.cc"
X86_ISAS = {
    "baseline": (4, ()),
    "avx2": (8, ("-mavx2", "-mfma")),
    "avx512": (16, ("-mavx512f", "-mavx2", "-mfma")),
}
PORTABLE_ISAS = {"baseline": (4, ())}
# Host-compiled with nvcc because they include CUDA headers.
CUDA_HOST_SOURCES = (SRC_DIR / "bsmm_cuda_handlers.cc",)
# The Hopper kernels (CuTe/CUTLASS: TMA, wgmma): compiled only when sm_90a is among the
# architectures, for sm_90a alone, with the CUTLASS headers of the nvidia-cutlass package.
SM90_DIR = SRC_DIR / "sm90"
SM90_ARCH = "sm_90a"
SM90_HOST_SOURCES = (SM90_DIR / "bsmm_sm90_handlers.cc",)


def is_x86_64() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def find_cxx() -> str | None:
    """The host C++ compiler: $CXX, else sysconfig's CXX, else c++ or g++ or clang++ on PATH."""
    candidates = [os.environ.get("CXX"), (sysconfig.get_config_var("CXX") or "").split(" ")[0], "c++", "g++", "clang++"]
    for name in candidates:
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def find_nvcc() -> str | None:
    """Path of nvcc: $CUDA_HOME/bin/nvcc (or $CUDA_PATH), else PATH, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    fallback = "/usr/local/cuda/bin/nvcc"
    return fallback if os.access(fallback, os.X_OK) else None


def gencode_flags(archs) -> list[str]:
    """``sm_XY`` -> SASS for XY, ``compute_XY`` -> PTX for XY (``a`` suffixes kept)."""
    flags = []
    for arch in archs:
        kind, _, num = arch.partition("_")
        if kind not in ("sm", "compute") or not num[:2].isdigit():
            raise ValueError(f"--cuda-arch: expected sm_XY or compute_XY, got {arch!r}")
        code = arch if kind == "sm" else f"compute_{num}"
        flags += ["-gencode", f"arch=compute_{num},code={code}"]
    return flags



def cutlass_include() -> str:
    """The CUTLASS/CuTe C++ headers shipped by the ``nvidia-cutlass`` package (a build requirement)."""
    try:
        import cutlass_library  # noqa: PLC0415  (only the sm_90a build needs it)
    except ImportError as err:
        raise RuntimeError(
            "the sm_90a kernels need the CUTLASS headers of the Python package 'nvidia-cutlass' "
            f"(pip install 'nvidia-cutlass>=4.2'), which cannot be imported ({err}); "
            f"or build without {SM90_ARCH} (--cuda-arch sm_80,compute_90)"
        ) from None
    include = Path(cutlass_library.source_path) / "include"
    if not (include / "cute" / "tensor.hpp").is_file():
        raise RuntimeError(f"nvidia-cutlass at {cutlass_library.__file__} has no CuTe headers under {include}")
    return str(include)


def include_flags() -> list[str]:
    import jax  # noqa: PLC0415  (only the build needs it)
    import pybind11  # noqa: PLC0415

    # Third-party headers as system headers: their warnings are not ours.
    system = [jax.ffi.include_dir(), pybind11.get_include(), sysconfig.get_paths()["include"]]
    flags = []
    for d in dict.fromkeys(system):
        flags += ["-isystem", d]
    return flags + [f"-I{SRC_DIR}", f"-I{BUILD_DIR}"]


def _headers() -> list[Path]:
    return sorted(p for pattern in ("*.h", "*.cuh") for p in SRC_DIR.rglob(pattern))


def _up_to_date(obj: Path, src: Path, cmd: list[str]) -> bool:
    """True when obj is newer than its source and every header, and was built by cmd."""
    stamp = obj.with_suffix(obj.suffix + ".cmd")
    if not obj.exists() or not stamp.exists() or stamp.read_text() != shlex.join(cmd):
        return False
    newest = max(p.stat().st_mtime for p in [src, *_headers()])
    return obj.stat().st_mtime >= newest


def _run(cmd: list[str], dry_run: bool) -> tuple[float, str]:
    print("+", shlex.join(cmd), flush=True)
    if dry_run:
        return 0.0, ""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return time.perf_counter() - start, proc.stdout + proc.stderr


def _object(src: Path, tag: str = "") -> Path:
    name = "__".join(src.relative_to(SRC_DIR).parts)
    return BUILD_DIR / (f"{name}.{tag}.o" if tag else f"{name}.o")


def compile_jobs(cxx: str, nvcc: str | None, archs: list[str], includes: list[str],
                 cutlass: str | None = None) -> list[tuple[Path, Path, list[str]]]:
    """(source, object, command) for every translation unit of this build.

    ``cutlass``: the CUTLASS include directory; the sm_90a kernels are built when it is
    given (``main`` passes it when sm_90a is among ``archs``).
    """
    with_cuda = nvcc is not None
    with_sm90 = with_cuda and cutlass is not None
    isas = X86_ISAS if is_x86_64() else PORTABLE_ISAS
    cpu_defines = ["-DJBS_CPU_X86_VARIANTS"] if is_x86_64() else []
    jobs = []
    for isa, (lanes, flags) in isas.items():
        obj = _object(CPU_KERNELS, isa)
        cmd = [cxx, *HOST_FLAGS, "-ffp-contract=fast", *flags, f"-DJBS_CPU_ISA={isa}", f"-DJBS_CPU_LANES={lanes}",
               *includes, "-c", str(CPU_KERNELS), "-o", str(obj)]
        jobs.append((CPU_KERNELS, obj, cmd))
    host_sources = [SRC_DIR / "bsmm_checks.cc", SRC_DIR / "module.cc", *sorted(CPU_DIR.glob("*.cc"))]
    for src in host_sources:
        if src == CPU_KERNELS:
            continue
        defines = [*cpu_defines, *(["-DJBS_WITH_CUDA"] if with_cuda and src.name == "module.cc" else []),
                   *(["-DJBS_WITH_SM90"] if with_sm90 and src.name == "module.cc" else [])]
        cmd = [cxx, *HOST_FLAGS, *defines, *includes, "-c", str(src), "-o", str(_object(src))]
        jobs.append((src, _object(src), cmd))
    if with_cuda:
        gencode = gencode_flags(archs)
        for src in sorted(SRC_DIR.glob("*.cu")):
            cmd = [nvcc, *NVCC_FLAGS, *DEVICE_FLAGS, *gencode, "-cudart=static", *includes, "-c", str(src),
                   "-o", str(_object(src))]
            jobs.append((src, _object(src), cmd))
        for src in CUDA_HOST_SOURCES:
            cmd = [nvcc, *NVCC_FLAGS, "-cudart=static", *includes, "-c", str(src), "-o", str(_object(src))]
            jobs.append((src, _object(src), cmd))
    if with_sm90:
        for src in sorted(SM90_DIR.glob("*.cu")):
            cmd = [nvcc, *NVCC_FLAGS, *DEVICE_FLAGS, *gencode_flags([SM90_ARCH]), "-cudart=static",
                   "-isystem", cutlass, *includes, "-c", str(src), "-o", str(_object(src))]
            jobs.append((src, _object(src), cmd))
        for src in SM90_HOST_SOURCES:
            cmd = [nvcc, *NVCC_FLAGS, "-cudart=static", *includes, "-c", str(src), "-o", str(_object(src))]
            jobs.append((src, _object(src), cmd))
    return jobs


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Build the jax-blocksparse native extension (CPU, and CUDA with nvcc).")
    parser.add_argument(
        "--cuda-arch",
        default=",".join(DEFAULT_ARCHS),
        help="comma-separated sm_XY (SASS) and compute_XY (PTX) targets (default: %(default)s)",
    )
    parser.add_argument("--cpu-only", action="store_true", help="build the CPU kernels only, even if nvcc is found")
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                        help="parallel compiler processes (default: CPU count, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help="where the extension goes (default: %(default)s)")
    parser.add_argument("--build-dir", default=str(BUILD_DIR),
                        help="where objects go (default: %(default)s); a second build tree keeps builds apart")
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDA_HOME/bin/nvcc or PATH)")
    parser.add_argument("--cxx", default=None, help="host C++ compiler (default: $CXX, sysconfig's CXX, c++)")
    parser.add_argument("--force", action="store_true", help="rebuild every object even if up to date")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    global BUILD_DIR
    args = parse_args(argv)
    BUILD_DIR = Path(args.build_dir).resolve()
    cxx = args.cxx or find_cxx()
    if cxx is None:
        print("build.py: no C++ compiler found (set CXX or install g++)", file=sys.stderr)
        return 1
    nvcc = None if args.cpu_only else (args.nvcc or find_nvcc())
    if nvcc is not None and not os.access(nvcc, os.X_OK):
        print(f"build.py: --nvcc {nvcc} is not an executable (or use --cpu-only)", file=sys.stderr)
        return 1
    archs = [a.strip() for a in args.cuda_arch.split(",") if a.strip()]
    try:
        gencode_flags(archs)
    except ValueError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 2
    includes = include_flags()
    cutlass = None
    if nvcc and SM90_ARCH in archs:
        try:
            cutlass = cutlass_include()
        except RuntimeError as err:
            print(f"build.py: {err}", file=sys.stderr)
            return 1
    output = Path(args.output_dir) / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    print(f"build.py: CPU kernels with {cxx}; " + (f"CUDA kernels with {nvcc} for {', '.join(archs)}"
                                                    if nvcc else "no CUDA kernels (nvcc not found or --cpu-only)"))

    if not args.dry_run:
        BUILD_DIR.mkdir(exist_ok=True)
        info = BUILD_DIR / "jbs_build_info.h"
        text = f'#define JBS_CUDA_ARCHS "{",".join(archs) if nvcc else ""}"\n'
        if not info.exists() or info.read_text() != text:
            info.write_text(text)

    jobs = compile_jobs(cxx, nvcc, archs, includes, cutlass)
    start = time.perf_counter()
    pending = [(s, o, c) for s, o, c in jobs if args.force or args.dry_run or not _up_to_date(o, s, c)]
    for _src, obj, _ in jobs:
        if all(obj != p[1] for p in pending):
            print(f"  (up to date: {obj.name})")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(_run, cmd, args.dry_run): (src, obj, cmd) for src, obj, cmd in pending}
            for fut in concurrent.futures.as_completed(futures):
                src, obj, cmd = futures[fut]
                seconds, log = fut.result()
                if not args.dry_run:
                    obj.with_suffix(obj.suffix + ".cmd").write_text(shlex.join(cmd))
                    print(f"  compiled {obj.name} in {seconds:.1f} s")
                    if log.strip():
                        print(log.rstrip())
    except RuntimeError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 1

    objects = [str(o) for _, o, _ in jobs]
    if not args.dry_run:
        output.parent.mkdir(parents=True, exist_ok=True)
    if nvcc:
        link = [nvcc, "-shared", "-cudart=static", *objects, "-o", str(output)]
    else:
        link = [cxx, "-shared", *objects, "-o", str(output), "-lpthread"]
    try:
        _run(link, args.dry_run)
    except RuntimeError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 1
    if not args.dry_run:
        kinds = "CPU + CUDA (" + ", ".join(archs) + ")" if nvcc else "CPU only"
        print(f"built {output} in {time.perf_counter() - start:.1f} s ({kinds})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
