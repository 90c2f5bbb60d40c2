"""The suite's fixtures; the helpers they and the tests share are in tests/helpers.py.

* :func:`cpu_default_device`: the first CPU device is JAX's default inside a test;
* :func:`exact_float32_matmuls` (autouse): every module runs at
  ``jax.default_matmul_precision("highest")`` (the float32 comparisons mean exact
  float32, not the GPU's TF32 default).

The suite never reads the user's crossover cache (``python -m jax_blocksparse tune``'s): the
cache folder is an empty one of its own, so "auto" decides from the shipped table as on a
fresh machine (tests of the cache point it elsewhere themselves).
"""

import os
import pathlib
import tempfile

import jax
import pytest

from helpers import MATMUL_PRECISION, cpu_devices

os.environ["JAX_BLOCKSPARSE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jbs-test-cache-")

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


def pytest_terminal_summary(terminalreporter):
    """One line on the matrix-unit kernels (tests/test_cpu_bf16.py): how many of their
    tests ran per instruction set and how many were skipped, and on which CPU, so that a
    CI log says whether its machine ran the AMX path at all."""
    counts = {}
    for outcome in ("passed", "failed", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "test_cpu_bf16.py" not in nodeid or getattr(report, "when", "call") not in ("call", "setup"):
                continue
            isa = next((name for name in ("amx", "avx512_bf16") if f"[{name}" in nodeid), "any")
            counts.setdefault(isa, {}).setdefault(outcome, 0)
            counts[isa][outcome] += 1
    if not counts:
        return
    import jax_blocksparse as jbs

    detected = jbs.extension_info().get("cpu_isa_detected", "no extension")
    parts = [f"{isa}: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items())) for isa, c in sorted(counts.items())]
    terminalreporter.write_line(f"matrix-unit kernel tests on this CPU ({detected}): " + "; ".join(parts))
