"""Builds the CUDA extension while the package is installed, when nvcc is found.

Everything else about the package is in pyproject.toml. ``pip install .`` (or -e .)
runs build.py with the default architectures; set JBS_SKIP_CUDA_BUILD=1 to skip it.
A CUDA compile error fails the install, so CI turns red on it.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        spec = importlib.util.spec_from_file_location("jbs_build", ROOT / "build.py")
        cuda_build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cuda_build)

        if os.environ.get("JBS_SKIP_CUDA_BUILD", "") not in ("", "0"):
            print("jax-blocksparse: JBS_SKIP_CUDA_BUILD is set: not building the CUDA extension", flush=True)
            return
        if cuda_build.find_nvcc() is None:
            print("jax-blocksparse: nvcc not found: CUDA kernels not built (the reference path will be used)", flush=True)
            return
        editable = getattr(self, "editable_mode", False)
        out_dir = ROOT / "jax_blocksparse" if editable else Path(self.build_lib) / "jax_blocksparse"
        if cuda_build.main(["--output-dir", str(out_dir)]) != 0:
            raise RuntimeError("jax-blocksparse: building the CUDA extension failed (see the nvcc output above)")


setup(cmdclass={"build_py": BuildPyWithCuda})
