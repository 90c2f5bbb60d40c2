"""Builds the native extension while the package is installed.

Everything else about the package is in pyproject.toml. ``pip install .`` (or -e .)
runs build.py: the CPU kernels always (host C++ compiler), the CUDA kernels too when
nvcc is found. Environment switches: JBS_SKIP_CUDA_BUILD=1 builds the CPU kernels only;
JBS_SKIP_NATIVE_BUILD=1 builds nothing (the pure-JAX reference is used everywhere).
A compile error fails the install, so CI turns red on it.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if _flag("JBS_SKIP_NATIVE_BUILD"):
            print("jax-blocksparse: JBS_SKIP_NATIVE_BUILD is set: no native kernels (reference path only)", flush=True)
            return
        spec = importlib.util.spec_from_file_location("jbs_build", ROOT / "build.py")
        native_build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native_build)

        args = []
        if _flag("JBS_SKIP_CUDA_BUILD"):
            print("jax-blocksparse: JBS_SKIP_CUDA_BUILD is set: building the CPU kernels only", flush=True)
            args.append("--cpu-only")
        elif native_build.find_nvcc() is None:
            print("jax-blocksparse: nvcc not found: building the CPU kernels only (no CUDA kernels)", flush=True)
            args.append("--cpu-only")
        editable = getattr(self, "editable_mode", False)
        out_dir = ROOT / "jax_blocksparse" if editable else Path(self.build_lib) / "jax_blocksparse"
        if native_build.main([*args, "--output-dir", str(out_dir)]) != 0:
            raise RuntimeError("jax-blocksparse: building the native extension failed (see the compiler output above)")


setup(cmdclass={"build_py": BuildPyWithKernels})
