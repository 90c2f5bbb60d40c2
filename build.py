#!/usr/bin/env python3
"""Builds the native extension ``jax_blocksparse/_jbs_kernels*.so`` in place, for developers.

A thin driver of the CMake project in ``CMakeLists.txt``, the same one that
``pip install`` runs through scikit-build-core: it configures a build tree
(``build/`` by default, with ``compile_commands.json``), builds it with Ninja (or make)
and writes the module into ``jax_blocksparse/``, so that ``PYTHONPATH=$PWD`` (or an
editable install) imports it. Objects are rebuilt only when a source, a header it
includes or its command changed.

Which kernels: the CPU kernels always (one copy per instruction set, chosen at run
time); the CUDA kernels for ``--cuda-arch`` when given, else for the architectures the
environment variable ``CUDAARCHS`` names (CMake's form: ``80-real;90a-real;90-virtual``),
else for the GPUs ``nvidia-smi`` reports, else none. The Hopper kernels
(``cuda/sm90/``) come with ``sm_90a``, against the CUTLASS headers of the
``nvidia-cutlass`` package.

Usage::

    python build.py                                     # CPU + the GPUs of this machine
    python build.py --cuda-arch sm_90a -j 16            # CPU + CUDA for sm_90a
    python build.py --cuda-arch sm_80,sm_90a,compute_90 # what CI and release builds hold
    python build.py --cpu-only                          # no nvcc needed
    python build.py --dry-run                           # configure, print the commands only

Needs cmake (3.24 or newer) and, preferably, ninja: on the PATH, or the ``cmake`` and
``ninja`` packages of PyPI.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
BUILD_DIR = ROOT / "build"
DEFAULT_OUTPUT_DIR = ROOT / "jax_blocksparse"
MODULE_NAME = "_jbs_kernels"
# What CI builds and a release wheel should hold: SASS for Ampere and Hopper (sm_90a:
# the Hopper kernels), plus compute_90 PTX that newer GPUs JIT-compile.
RELEASE_ARCHS = ("sm_80", "sm_90a", "compute_90")


def cmake_architectures(archs) -> str:
    """nvcc's names to CMake's: ``sm_XY`` -> ``XY-real`` (SASS), ``compute_XY`` -> ``XY-virtual`` (PTX).

    Raises ValueError naming ``--cuda-arch`` for anything else.
    """
    out = []
    for arch in archs:
        kind, _, num = arch.partition("_")
        if kind not in ("sm", "compute") or not num[:2].isdigit() or not num.rstrip("af").isdigit():
            raise ValueError(f"--cuda-arch: expected sm_XY or compute_XY, got {arch!r}")
        out.append(f"{num}-real" if kind == "sm" else f"{num}-virtual")
    return ";".join(out)


def _tool(name: str) -> str | None:
    """``name`` on the PATH, else the copy its PyPI package (``cmake``, ``ninja``) ships."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
    except ImportError:
        return None
    bin_dir = getattr(module, "BIN_DIR", None) or getattr(module, "CMAKE_BIN_DIR", None)
    candidate = Path(bin_dir) / name if bin_dir else None
    return str(candidate) if candidate and os.access(candidate, os.X_OK) else None


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Build the jax-blocksparse native extension in place (drives CMakeLists.txt)."
    )
    parser.add_argument(
        "--cuda-arch",
        default=None,
        help="comma-separated sm_XY (SASS) and compute_XY (PTX) targets; default: $CUDAARCHS, else the GPUs "
        f"nvidia-smi reports, else none (release set: {','.join(RELEASE_ARCHS)})",
    )
    parser.add_argument("--cpu-only", action="store_true", help="build the CPU kernels only, even if nvcc is found")
    parser.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=os.cpu_count() or 1,
        help="parallel compiler processes (default: CPU count, %(default)s)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="configure, then print the compiler commands without running them"
    )
    parser.add_argument(
        "--output-dir", default=str(DEFAULT_OUTPUT_DIR), help="where the extension goes (default: %(default)s)"
    )
    parser.add_argument(
        "--build-dir",
        default=str(BUILD_DIR),
        help="the CMake build tree (default: %(default)s); a second one keeps builds apart",
    )
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDACXX, $CUDA_HOME/bin/nvcc, PATH)")
    parser.add_argument("--cxx", default=None, help="host C++ compiler (default: CMake's choice: $CXX, c++)")
    parser.add_argument("--force", action="store_true", help="rebuild every object even if up to date")
    return parser.parse_args(argv)


def configure_command(args, cmake: str, ninja: str | None, build_dir: Path) -> list[str]:
    """The ``cmake`` configure call for these arguments (every choice passed, so that a
    reused build tree never keeps an earlier run's)."""
    cmd = [cmake, "-S", str(ROOT), "-B", str(build_dir)]
    if ninja and not (build_dir / "CMakeCache.txt").exists():
        cmd += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    cmd += [f"-DPython_EXECUTABLE={sys.executable}", f"-DJBS_OUTPUT_DIR={Path(args.output_dir).resolve()}"]
    if args.cpu_only:
        cmd += ["-DJBS_CUDA=OFF", "-UCMAKE_CUDA_ARCHITECTURES"]
    elif args.cuda_arch is not None:
        archs = [a.strip() for a in args.cuda_arch.split(",") if a.strip()]
        cmd += ["-DJBS_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cmake_architectures(archs)}"]
    else:
        cmd += ["-DJBS_CUDA=ON" if args.nvcc else "-DJBS_CUDA=AUTO", "-UCMAKE_CUDA_ARCHITECTURES"]
    if args.nvcc:
        cmd.append(f"-DCMAKE_CUDA_COMPILER={args.nvcc}")
    if args.cxx:
        cmd.append(f"-DCMAKE_CXX_COMPILER={args.cxx}")
    return cmd


def planned_commands(build_dir: Path, ninja: str | None) -> list[str]:
    """The compiler and linker commands a build of a configured tree runs, in order
    (all of them, whether or not up to date)."""
    if ninja and (build_dir / "build.ninja").exists():
        out = subprocess.run(
            [ninja, "-C", str(build_dir), "-t", "commands"], capture_output=True, text=True, check=True
        ).stdout
        # Ninja wraps a link in ": && ... && :"; keep the command itself.
        return [line.removeprefix(": && ").removesuffix(" && :").strip() for line in out.splitlines() if line.strip()]
    import json  # noqa: PLC0415  (Makefiles: compile commands only, from compile_commands.json)

    entries = json.loads((build_dir / "compile_commands.json").read_text())
    return [e["command"] for e in entries]


def _built_kinds(build_dir: Path) -> str:
    info = build_dir / "generated" / "jbs_build_info.h"
    archs = info.read_text().split('"')[1] if info.exists() else ""
    return f"CPU + CUDA ({archs.replace(',', ', ')})" if archs else "CPU only"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cuda_arch is not None:
        try:
            cmake_architectures(a.strip() for a in args.cuda_arch.split(",") if a.strip())
        except ValueError as err:
            print(f"build.py: {err}", file=sys.stderr)
            return 2
    if args.nvcc is not None and not os.access(args.nvcc, os.X_OK):
        print(f"build.py: --nvcc {args.nvcc} is not an executable (or use --cpu-only)", file=sys.stderr)
        return 1
    cmake = _tool("cmake")
    if cmake is None:
        print("build.py: cmake not found (install it, or: pip install cmake ninja)", file=sys.stderr)
        return 1
    ninja = _tool("ninja")
    build_dir = Path(args.build_dir).resolve()
    build_dir.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    configure = configure_command(args, cmake, ninja, build_dir)
    print("$", shlex.join(configure), flush=True)
    if subprocess.run(configure).returncode != 0:
        print("build.py: configuring failed (see CMake's output above)", file=sys.stderr)
        return 1
    if args.dry_run:
        for cmd in planned_commands(build_dir, ninja):
            print("+", cmd)
        return 0
    build = [cmake, "--build", str(build_dir), "--parallel", str(max(1, args.jobs))]
    if args.force:
        build.append("--clean-first")
    print("$", shlex.join(build), flush=True)
    if subprocess.run(build).returncode != 0:
        print("build.py: the build failed (see the compiler output above)", file=sys.stderr)
        return 1
    output = Path(args.output_dir).resolve() / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"
    print(f"built {output} in {time.perf_counter() - start:.1f} s ({_built_kinds(build_dir)})")
    return 0


def _hand_over_to_pypa_build() -> None:
    """``python -m build`` (PyPA's sdist/wheel frontend) run in the repository root finds
    this file first, the current directory leading sys.path: run the real one instead."""
    import importlib.util  # noqa: PLC0415
    import runpy  # noqa: PLC0415

    sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
    if importlib.util.find_spec("build") is None:
        print("build.py: `python -m build` needs PyPA's build: pip install build", file=sys.stderr)
        sys.exit(1)
    runpy.run_module("build", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if __spec__ is not None and __spec__.name == "build":  # python -m build, not python build.py
        _hand_over_to_pypa_build()
    else:
        sys.exit(main())
