"""GPU-only tests: the whole directory skips cleanly where JAX sees no GPU.

The CUDA extension is imported lazily (through ``jax_blocksparse.has_cuda_kernels``),
so collecting these tests on a CPU-only machine never touches CUDA.

Precision: tests/conftest.py's ``exact_float32_matmuls`` (HIGHEST for every other test)
skips this directory, and no fixture here sets one: on a GPU JAX's float32 default is TF32,
and on the Hopper targets the precision picks the kernel, so each product in these tests
states the precision it means (``precision=`` on the call, or inside a
``jax.default_matmul_precision(...)`` block). tests/test_gpu_tests_on_cpu.py checks that
on CPU.
"""

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="no GPU: jax.devices() has no 'gpu' platform")
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)
