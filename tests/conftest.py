"""The suite's fixtures; the helpers they and the tests share are in tests/helpers.py.

* :func:`cpu_default_device`: the first CPU device is JAX's default inside a test;
* :func:`exact_float32_matmuls` (autouse): every module runs at
  ``jax.default_matmul_precision("highest")`` (the float32 comparisons mean exact
  float32, not the GPU's TF32 default).
"""

import pathlib

import jax
import pytest

from helpers import MATMUL_PRECISION, cpu_devices

_GPU_TESTS = pathlib.Path(__file__).resolve().parent / "gpu"


@pytest.fixture
def cpu_default_device():
    """Makes the first CPU device JAX's default device inside the test.

    For the multi-device tests: arrays they create and single-device results they
    compare against (one-device oracles, uncommitted inputs) live on the CPU backend,
    next to the CPU devices their meshes and pmaps use, not on a GPU.
    """
    with jax.default_device(cpu_devices(1)[0]):
        yield


@pytest.fixture(autouse=True, scope="module")
def exact_float32_matmuls(request):
    """Every test module here runs under ``jax.default_matmul_precision("highest")``.

    The tests compare float32 results with float32 oracles (``jnp.dot``/``einsum``,
    the reference lowering, ``check_grads``' numerical derivatives) at float32
    tolerances, so the precision they mean is exact float32. JAX's default is
    platform dependent: exact on CPU, TF32 (a 10-bit mantissa) on GPU. This pins it
    for the oracles and for the library's own products alike (a product traced with
    no explicit precision reads this default), on every platform.

    Module scope, so that module-scoped fixtures computing oracles run under it too.
    tests/gpu states its own precision where it means one and is left as it is.
    """
    if _GPU_TESTS in request.path.resolve().parents:
        yield
        return
    with jax.default_matmul_precision(MATMUL_PRECISION):
        yield
