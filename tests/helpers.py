"""Test helpers: 8 host devices, a per-dtype tolerance table, layout and array makers.

Imported by the tests as ``from helpers import ...`` (tests/conftest.py holds the
fixtures only).

Everything here is independent of the library's own index arithmetic: the oracles
(``np_blocks``, ``dense_of``) rebuild storage order from the mask alone, so they
check the layout tables rather than reuse them.

The suite runs on any default backend (CPU or GPU); what it needs from the platform
it states here:

* multi-device tests take their devices from the CPU backend (:func:`cpu_devices`,
  :func:`cpu_mesh`, the :func:`cpu_default_device` fixture): XLA is asked for 8 host
  devices below, while a GPU machine's default backend may have one device;
* every matmul runs at ``jax.default_matmul_precision("highest")``
  (:func:`exact_float32_matmuls`): the float32 comparisons mean exact float32, which
  is not the GPU default (TF32);
* 16-bit roundings that XLA may skip as "excess precision" on GPU are checked where
  it keeps them (:func:`keeps_16bit_roundings`, :func:`rerun_keeping_16bit_roundings`).
"""

import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# Must run before jax is imported so that pmap / shard_map tests see 8 CPU devices.
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import jax  # noqa: E402,F401  (after XLA_FLAGS, on purpose)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.extend.core import ClosedJaxpr, Jaxpr  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_blocksparse as jbs  # noqa: E402

NUM_DEVICES = 8
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Relative tolerance per dtype for a short dot product (see `tolerance`).
RTOL = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2, np.dtype(jnp.float16): 2e-3}
# Small grids per block size so that the whole suite stays fast on 2 CPU cores.
GRIDS = {8: (5, 4), 16: (4, 3), 32: (3, 3), 64: (2, 3), 128: (2, 2)}
MASK_KINDS = ("random", "empty", "single", "full", "empty_rows_cols", "long_column")


def tolerance(dtype, length: int = 1) -> float:
    """Relative tolerance for ``dtype``, grown with sqrt(length / 64) for long dot products."""
    return RTOL[np.dtype(dtype)] * max(1.0, float(np.sqrt(length / 64)))


def assert_close(got, want, dtype, length: int = 1):
    """|got - want| <= tol * (|want| + max |want|): relative, robust to cancellation near 0."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    tol = tolerance(dtype, length)
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def make_mask(kind: str, grid, seed: int = 0) -> np.ndarray:
    """A bool block mask of ``grid``; ``kind`` is one of MASK_KINDS (several adversarial)."""
    cb, kb = grid
    rng = np.random.default_rng(seed)
    mask = np.zeros(grid, bool)
    if kind == "random":
        mask = rng.random(grid) < 0.5
        mask[rng.integers(cb), rng.integers(kb)] = True
    elif kind == "single":
        mask[rng.integers(cb), rng.integers(kb)] = True
    elif kind == "full":
        mask[:] = True
    elif kind == "empty_rows_cols":  # row 1 and column 0 empty, everything else present
        mask[:] = True
        mask[1 % cb, :] = False
        mask[:, 0] = False
    elif kind == "long_column":  # one full column, one lone block elsewhere
        mask[:, kb // 2] = True
        mask[0, (kb // 2 + 1) % kb] = True
    elif kind != "empty":
        raise ValueError(f"unknown mask kind {kind!r}")
    return mask


def rand(shape, dtype=jnp.float32, seed: int = 0):
    """Standard-normal jax array of ``shape`` in ``dtype``."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def storage_order(mask):
    """(rows, cols) of the blocks in storage order: sorted by column, then row."""
    cols, rows = np.nonzero(np.asarray(mask).T)
    return rows, cols


def np_blocks(W, mask, block_size: int, capacity=None) -> np.ndarray:
    """numpy oracle of ``from_dense``: [capacity, bs, bs] gathered in storage order."""
    W = np.asarray(W).astype(np.float32)
    cb, kb = np.shape(mask)
    rows, cols = storage_order(mask)
    blocks = W.reshape(cb, block_size, kb, block_size).transpose(0, 2, 1, 3)[rows, cols]
    pad = (capacity or len(rows)) - len(rows)
    return np.concatenate([blocks, np.zeros((pad, block_size, block_size), np.float32)])


def np_dense(w, mask, block_size: int) -> np.ndarray:
    """numpy float32 oracle of ``to_dense``: w[:nnz] scattered into [C, K] by the mask."""
    cb, kb = np.shape(mask)
    rows, cols = storage_order(mask)
    blocks = np.zeros((cb, kb, block_size, block_size), np.float32)
    blocks[rows, cols] = np.asarray(w).astype(np.float32)[: len(rows)]
    return blocks.transpose(0, 2, 1, 3).reshape(cb * block_size, kb * block_size)


def dense_of(w, mask, block_size: int):
    """Differentiable jnp oracle of ``to_dense``: scatters w[:nnz] into [C, K] by the mask."""
    cb, kb = np.shape(mask)
    rows, cols = storage_order(mask)
    blocks = jnp.zeros((cb, kb, block_size, block_size), w.dtype)
    blocks = blocks.at[rows, cols].set(w[: len(rows)], unique_indices=True)
    return blocks.transpose(0, 2, 1, 3).reshape(cb * block_size, kb * block_size)


def make_problem(kind="random", block_size=8, grid=None, dtype=jnp.float32, capacity=None, seed=0):
    """(mask, layout, w) with w drawn at random for the layout (padding slots zero)."""
    grid = grid or GRIDS[block_size]
    mask = make_mask(kind, grid, seed)
    layout = jbs.Layout.from_mask(mask, block_size, capacity=capacity)
    W = rand(layout.shape, dtype, seed + 1)
    return mask, layout, jnp.asarray(np_blocks(W, mask, block_size, layout.capacity), dtype)


def shard_map():
    """``jax.shard_map`` (``jax.experimental.shard_map.shard_map`` on JAX < 0.7): the
    package's one shim, :data:`jax_blocksparse.sharding.shard_map`."""
    return jbs.sharding.shard_map


def collectives(compiled_text: str) -> dict:
    """Collective ops in compiled HLO text: {kind: [shape of each result]}."""
    found = {}
    for kind in ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter"):
        found[kind] = re.findall(rf"= (\S+) {kind}(?:-start)?\(", compiled_text)
    return found


def require_kernels(platform: str):
    """Skips the calling test unless the native kernels for ``platform`` ("cpu" or
    "cuda") are built (fails instead when JBS_REQUIRE_KERNELS=1, as CI sets: there the
    install builds both, and a missing build must not pass)."""
    if jbs._native.has_kernels(platform):
        return
    reason = f"{platform} kernels not built: {jbs._native.load_error(platform)} (run `python build.py`)"
    if os.environ.get("JBS_REQUIRE_KERNELS") == "1":
        pytest.fail(f"JBS_REQUIRE_KERNELS=1 but {reason}")
    pytest.skip(reason)


# The vector instruction sets of the float kernels, lowest first (the machine's widest is the
# one the rest of the suite runs on).
VECTOR_ISAS = ("baseline", "avx2", "avx512")


def force_cpu_isa(monkeypatch, name: str) -> str:
    """Puts the CPU kernels of instruction set ``name`` in force for the test
    (``JAX_BLOCKSPARSE_CPU_ISA``, read at every call); skips, with the reason, where this
    CPU's widest set is below it."""
    info = jbs.extension_info()
    order, detected = info["cpu_isas"], info["cpu_isa_detected"]  # lowest to widest
    if order.index(name) > order.index(detected):
        pytest.skip(f"{name} kernels not run: this CPU's widest kernels are {detected!r} (no {name} here)")
    monkeypatch.setenv("JAX_BLOCKSPARSE_CPU_ISA", name)
    assert jbs.extension_info()["cpu_isa"] == name
    return name


def require_cuda_extension():
    """The CUDA kernels are built (see :func:`require_kernels`)."""
    require_kernels("cuda")


# A custom call of the library in StableHLO (``@name(``) or compiled HLO text.
_LIBRARY_CALL_RE = re.compile(r'(?:@|custom_call_target=")(' + jbs.targets.PREFIX + r'\w+?)(?:\(|")')


def kernel_calls(text: str) -> set[str]:
    """The kernels (short names: ``"jbs_bsmm_fprop"``, ``"jbs_bsmm_updat_sm90"``) whose
    versioned FFI targets (:mod:`jax_blocksparse.targets`) a lowered or compiled
    program's text calls."""
    return {jbs.targets.kernel_of(t) or t for t in _LIBRARY_CALL_RE.findall(text)}


@contextlib.contextmanager
def xla_optimizations_off(off: bool = True):
    """Skips most of XLA's optimisation passes inside (about 2x faster compiles), for
    tests that check values, not speed. A jax without the option compiles as usual."""
    try:
        previous = jax.config.read("jax_disable_most_optimizations")
    except (AttributeError, KeyError):
        yield
        return
    jax.config.update("jax_disable_most_optimizations", off)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)


# ---------------------------------------------------------------------------------
# Devices: the multi-device tests run on the CPU backend's 8 host devices
# ---------------------------------------------------------------------------------


def cpu_devices(n: int) -> list:
    """The first ``n`` CPU devices, whatever the default backend is.

    The XLA_FLAGS above give the CPU backend 8 devices; on a GPU machine the default
    backend (``jax.devices()``) is the GPU, often with one device, so multi-device
    tests name the CPU backend. Skips the calling test when it has fewer than ``n``.
    """
    devices = jax.devices("cpu")
    if len(devices) < n:
        pytest.skip(
            f"needs {n} CPU devices, the CPU backend has {len(devices)}: XLA_FLAGS must hold "
            f"{_FLAG}={NUM_DEVICES} before jax is imported (got XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})"
        )
    return devices[:n]


def cpu_mesh(shape, axis_names, **kwargs) -> Mesh:
    """A ``jax.sharding.Mesh`` of ``shape`` over the first CPU devices (see :func:`cpu_devices`).

    ``kwargs`` go to ``Mesh`` (e.g. ``axis_types``). An explicit Mesh has Auto axes on
    every JAX version unless told otherwise (``jax.make_mesh`` may default to Explicit).
    """
    shape = tuple(shape)
    return Mesh(np.array(cpu_devices(int(np.prod(shape)))).reshape(shape), tuple(axis_names), **kwargs)


# ---------------------------------------------------------------------------------
# Precision: exact float32 matmuls, 16-bit roundings where XLA keeps them
# ---------------------------------------------------------------------------------

# The matmul precision the suite's float32 comparisons mean (see exact_float32_matmuls).
MATMUL_PRECISION = "highest"


# XLA flag that makes every backend keep each rounding to a narrower float type.
KEEP_ROUNDINGS_FLAG = "--xla_allow_excess_precision=false"
_CHILD_ENV = "JBS_TESTS_KEEP_ROUNDINGS_CHILD"


def keeps_16bit_roundings() -> bool:
    """Whether XLA on the default backend keeps a float32 -> 16-bit -> float32 round trip.

    With ``--xla_allow_excess_precision`` (XLA's default: true) a backend may drop
    such a round trip as excess precision and go on in float32: XLA:GPU does (its
    simplify-fp-conversions pass). XLA:CPU keeps this probe's round trip, but drops some
    inside larger programs (seen in the bfloat16 conv model's training step), so a test
    that needs every rounding of a whole step runs it in a child with the flag off
    (:func:`rerun_keeping_16bit_roundings`) whatever this says. A library result that is
    an XLA cast to 16 bits widened back to float32 (see docs/guide/mixed_precision.rst)
    is then not rounded. Probed with one tiny jit under the caller's configuration, not
    guessed from the platform name.
    """
    x = np.float32(1 + 2**-12)  # neither a bfloat16 nor a float16 value
    round_trips = jax.jit(lambda v: [v.astype(t).astype(jnp.float32) for t in (jnp.bfloat16, jnp.float16)])(x)
    return all(float(r) != float(x) for r in round_trips)


def rerun_keeping_16bit_roundings(request, timeout: float = 600):
    """Runs the calling test again in a child pytest whose XLA keeps every 16-bit rounding.

    For tests whose 16-bit rounding assertions hold only where XLA keeps the roundings
    (:func:`keeps_16bit_roundings`): they run those assertions in this process when it
    does, and call this when it does not. XLA_FLAGS is read once, when the backend
    starts, so the child gets ``XLA_FLAGS += --xla_allow_excess_precision=false``.
    Fails unless the child ran the test and it passed.
    """
    if os.environ.get(_CHILD_ENV):
        pytest.fail(f"XLA drops 16-bit roundings even with XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {KEEP_ROUNDINGS_FLAG}".strip()
    env[_CHILD_ENV] = "1"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the GPU is shared with this process
    for name in [n for n in env if n == "PYTEST_ADDOPTS" or n.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_"))]:
        del env[name]  # a plain pytest run of one test (no -n, not an xdist worker)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid]
    child = subprocess.run(
        command, cwd=request.config.rootpath, env=env, capture_output=True, text=True, timeout=timeout
    )
    output = f"{' '.join(command)}\n{child.stdout[-6000:]}\n{child.stderr[-3000:]}"
    assert child.returncode == 0 and re.search(r"\b1 passed\b", child.stdout), output


def eqns_named(jaxpr, names) -> list:
    """The equations of ``jaxpr`` (a core Jaxpr) whose primitive is in ``names``, nested
    jaxprs (pjit, custom_jvp/vjp, scan, cond branches) included."""
    found = [e for e in jaxpr.eqns if e.primitive.name in names]
    for eqn in jaxpr.eqns:
        for inner in jaxprs_in_params(eqn.params):
            found += eqns_named(inner, names)
    return found


def jaxprs_in_params(params):
    """The jaxprs an equation's params hold (a call's, a scan's body, cond's branches).

    jax.extend.core.jaxprs_in_params does the same from jax 0.10 on; the oldest
    supported jax lacks it."""
    for value in params.values():
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, Jaxpr):
                yield v
            elif isinstance(v, ClosedJaxpr):
                yield v.jaxpr


ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``code`` run by this Python in a child process on the CPU (``JAX_PLATFORMS=cpu``),
    its stdout and stderr captured as text; never raises on a failing child."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def load_script(relpath: str, name: str | None = None):
    """A script of bench/ or examples/ (not packages) imported by its path, e.g.
    ``load_script("bench/crossover.py")``. It is registered in ``sys.modules`` (under
    ``name``, default the path with "/" and "." as "_") before it runs: flax's dataclasses
    look their module up there."""
    path = ROOT / relpath
    name = name or relpath.removesuffix(".py").replace("/", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def save_restore(path, state, target=None):
    """``state`` saved by orbax's StandardCheckpointer and restored (into ``target`` if
    given: e.g. ``jax.tree.map(orbax.checkpoint.utils.to_shape_dtype_struct, state)``).
    Callers skip first when orbax-checkpoint (the checkpoint extra) is missing."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
        return checkpointer.restore(path, target)
