#!/usr/bin/env python3
"""Builds the CUDA extension ``jax_blocksparse/_jbs_cuda*.so`` from ``cuda/`` with nvcc.

Every translation unit in ``cuda/`` (``*.cu`` device code, ``*.cc`` host code: the XLA
FFI handlers and the pybind11 module) is compiled in parallel into ``build/``, then
linked into one shared library with the CUDA runtime linked statically, so that the
module imports on a machine without a GPU (``jax_blocksparse.has_cuda_kernels()``).

Headers: XLA FFI from ``jax.ffi.include_dir()``, pybind11 from ``pybind11.get_include()``,
Python from ``sysconfig``. Every nvcc command is printed before it runs.

Usage::

    python build.py                              # sm_80, sm_90a SASS + compute_90 PTX
    python build.py --cuda-arch sm_90a --jobs 8  # one architecture, 8 parallel nvcc
    python build.py --dry-run                    # print the commands only

``setup.py`` imports this file and calls :func:`find_nvcc` and :func:`main`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SRC_DIR = ROOT / "cuda"
BUILD_DIR = ROOT / "build"
DEFAULT_OUTPUT_DIR = ROOT / "jax_blocksparse"
MODULE_NAME = "_jbs_cuda"
# SASS for Ampere and Hopper, plus compute_90 PTX that newer GPUs JIT-compile.
DEFAULT_ARCHS = ("sm_80", "sm_90a", "compute_90")
COMMON_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden")
DEVICE_FLAGS = ("-lineinfo", "--expt-relaxed-constexpr")


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


def include_flags() -> list[str]:
    import jax  # noqa: PLC0415  (only the build needs it)
    import pybind11  # noqa: PLC0415

    # Third-party headers as system headers: their warnings are not ours.
    system = [jax.ffi.include_dir(), pybind11.get_include(), sysconfig.get_paths()["include"]]
    flags = []
    for d in dict.fromkeys(system):
        flags += ["-isystem", d]
    return flags + [f"-I{SRC_DIR}", f"-I{BUILD_DIR}"]


def _sources() -> list[Path]:
    return sorted(list(SRC_DIR.glob("*.cu")) + list(SRC_DIR.glob("*.cc")))


def _headers() -> list[Path]:
    return sorted(list(SRC_DIR.glob("*.h")) + list(SRC_DIR.glob("*.cuh")))


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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Build the jax-blocksparse CUDA extension with nvcc.")
    parser.add_argument(
        "--cuda-arch",
        default=",".join(DEFAULT_ARCHS),
        help="comma-separated sm_XY (SASS) and compute_XY (PTX) targets (default: %(default)s)",
    )
    parser.add_argument("--jobs", "-j", type=int, default=os.cpu_count() or 1,
                        help="parallel nvcc processes (default: CPU count, %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    parser.add_argument("--output-dir", default=str(DEFAULT_OUTPUT_DIR),
                        help="where the extension goes (default: %(default)s)")
    parser.add_argument("--nvcc", default=None, help="nvcc to use (default: $CUDA_HOME/bin/nvcc or PATH)")
    parser.add_argument("--force", action="store_true", help="rebuild every object even if up to date")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    nvcc = args.nvcc or find_nvcc()
    if nvcc is None:
        print("build.py: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 1
    archs = [a.strip() for a in args.cuda_arch.split(",") if a.strip()]
    try:
        gencode = gencode_flags(archs)
    except ValueError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 2
    includes = include_flags()
    output = Path(args.output_dir) / f"{MODULE_NAME}{sysconfig.get_config_var('EXT_SUFFIX')}"

    if not args.dry_run:
        BUILD_DIR.mkdir(exist_ok=True)
        info = BUILD_DIR / "jbs_build_info.h"
        text = f'#define JBS_CUDA_ARCHS "{",".join(archs)}"\n'
        if not info.exists() or info.read_text() != text:
            info.write_text(text)

    jobs = []
    for src in _sources():
        obj = BUILD_DIR / (src.name + ".o")
        device = src.suffix == ".cu"
        cmd = [nvcc, *COMMON_FLAGS, *(DEVICE_FLAGS + tuple(gencode) if device else ()), "-cudart=static",
               *includes, "-c", str(src), "-o", str(obj)]
        jobs.append((src, obj, cmd))

    start = time.perf_counter()
    pending = [(s, o, c) for s, o, c in jobs if args.force or args.dry_run or not _up_to_date(o, s, c)]
    for src, _, _ in jobs:
        if all(src != p[0] for p in pending):
            print(f"  (up to date: {src.relative_to(ROOT)})")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = {pool.submit(_run, cmd, args.dry_run): (src, obj, cmd) for src, obj, cmd in pending}
            for fut in concurrent.futures.as_completed(futures):
                src, obj, cmd = futures[fut]
                seconds, log = fut.result()
                if not args.dry_run:
                    obj.with_suffix(obj.suffix + ".cmd").write_text(shlex.join(cmd))
                    print(f"  compiled {src.relative_to(ROOT)} in {seconds:.1f} s")
                    if log.strip():
                        print(log.rstrip())
    except RuntimeError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 1

    link = [nvcc, "-shared", "-cudart=static", *[str(o) for _, o, _ in jobs], "-o", str(output)]
    try:
        _run(link, args.dry_run)
    except RuntimeError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 1
    if not args.dry_run:
        print(f"built {output} in {time.perf_counter() - start:.1f} s (archs: {', '.join(archs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
