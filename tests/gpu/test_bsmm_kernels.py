"""CUDA kernels (implementation "kernels") against float64 numpy oracles, on a GPU.

Covers every dtype x block size x op (fprop, bprop, updat), random and adversarial
layouts (empty columns and rows, one very long column, full mask, empty layout,
capacity > nnz with NaN in the padding blocks and garbage in the padding table
entries), odd row counts, leading batch dims, output dtypes, vmap and grad through the
kernels, and a layout change without recompiling.

Precision: every product here states it (tests/test_gpu_tests_on_cpu.py checks
that on CPU; tests/conftest.py's HIGHEST default does not reach tests/gpu). These tests
compare against float64 oracles at the input dtype's tolerance, so they mean exact float32:
``precision="highest"`` (on the Hopper targets DEFAULT/HIGH would run float32 on TF32;
16-bit inputs run the same kernels at any precision).

The whole directory skips where there is no GPU (tests/gpu/conftest.py).
Tests whose id contains ``sanitizer_subset`` are the reduced set that
tests/gpu/run_sanitizer.sh runs under compute-sanitizer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import make_mask, tolerance
from jax_blocksparse.layout import Layout, LayoutTables

BLOCK_SIZES = jbs.SUPPORTED_BLOCK_SIZES
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
OPS = ("fprop", "bprop", "updat")
# (CB, KB) per block size: C != K, a few hundred to a few thousand features.
GRIDS = {8: (12, 10), 16: (9, 7), 32: (6, 5), 64: (4, 5), 128: (3, 2)}
LAYOUT_KINDS = ("random", "empty", "single", "full", "empty_rows_cols", "long_column", "padded")
ROWS = (1, 7, 129, 1000)


@pytest.fixture(scope="module", autouse=True)
def _need_kernels():
    if not jbs.has_cuda_kernels():
        pytest.fail(f"GPU present but the CUDA extension is not loaded: {jbs._native.load_error('cuda')}")


# ---------------------------------------------------------------------------------
# Problems and oracles
# ---------------------------------------------------------------------------------


def _layout(kind, bs, seed=0):
    """(mask, layout). "padded": random mask, capacity nnz + 5, garbage padding entries."""
    grid = GRIDS[bs]
    if kind == "long_column":  # a column much longer than the others
        grid = (4 * grid[0], grid[1])
    mask = make_mask("random" if kind == "padded" else kind, grid, seed)
    nnz = int(mask.sum())
    if kind != "padded":
        return mask, Layout.from_mask(mask, bs)
    layout = Layout.from_mask(mask, bs, capacity=nnz + 5)
    t = layout.tables
    rng = np.random.default_rng(seed + 7)
    cap = layout.capacity

    def garbage(table, high):  # in-range junk in padding entries: kernels must ignore it
        table = np.asarray(table).copy()
        table[nnz:] = rng.integers(0, high, cap - nnz)
        return jnp.asarray(table, jnp.int32)

    def garbage_pairs(work, blocks):  # the work lists' (input block, slot) pairs past nnz
        pairs = np.asarray(work).reshape(cap, 2).copy()
        pairs[nnz:, 0] = rng.integers(0, blocks, cap - nnz)
        pairs[nnz:, 1] = rng.integers(0, cap, cap - nnz)
        return jnp.asarray(pairs.reshape(-1), jnp.int32)

    tables = LayoutTables(
        block_rows=garbage(t.block_rows, grid[0]),
        block_cols=garbage(t.block_cols, grid[1]),
        col_ptr=t.col_ptr,
        row_ptr=t.row_ptr,
        row_slots=garbage(t.row_slots, cap),
        col_order=t.col_order,
        row_order=t.row_order,
        col_work=garbage_pairs(t.col_work, grid[0]),
        col_work_ptr=t.col_work_ptr,
        row_work=garbage_pairs(t.row_work, grid[1]),
        row_work_ptr=t.row_work_ptr,
    )
    return mask, Layout(bs, grid, cap, tables)


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def _weights(layout, dtype, seed):
    """Random blocks; padding slots hold NaN, which must never reach any output."""
    w = np.random.default_rng(seed).standard_normal(layout.w_shape).astype(np.float32)
    w[layout.nnz :] = np.nan
    return jnp.asarray(w, dtype)


def _f64(a):
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _dense(w, mask, bs):
    """float64 [C, K] from the first nnz blocks in storage order (sorted by column, row)."""
    cb, kb = mask.shape
    cols, rows = np.nonzero(mask.T)
    blocks = np.zeros((cb, kb, bs, bs))
    blocks[rows, cols] = _f64(w)[: len(rows)]
    return blocks.transpose(0, 2, 1, 3).reshape(cb * bs, kb * bs)


def _blocks(full, mask, bs, capacity):
    """[capacity, bs, bs] float64 blocks of a dense [C, K] in storage order, zero padding."""
    cb, kb = mask.shape
    cols, rows = np.nonzero(mask.T)
    out = np.zeros((capacity, bs, bs))
    out[: len(rows)] = full.reshape(cb, bs, kb, bs).transpose(0, 2, 1, 3)[rows, cols]
    return out


def _run(op, layout, mask, dtype, lead, out_dtype=None, seed=0, *, precision):
    """(kernel result, float64 oracle, reduction length) for one op at ``precision``
    (required: the GPU's float32 default is TF32 on the Hopper targets)."""
    bs = layout.block_size
    c, k = layout.shape
    if op == "updat":
        x, dy = _rand((*lead, c), dtype, seed), _rand((*lead, k), dtype, seed + 1)
        with jbs.config.implementation("kernels"):
            got = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, out_dtype=out_dtype, precision=precision))(x, dy)
        full = _f64(x).reshape(-1, c).T @ _f64(dy).reshape(-1, k)
        return got, _blocks(full, mask, bs, layout.capacity), max(1, int(np.prod(lead)))
    w = _weights(layout, dtype, seed + 2)
    transpose = op == "bprop"
    x = _rand((*lead, k if transpose else c), dtype, seed)
    with jbs.config.implementation("kernels"):
        got = jax.jit(
            lambda x, w: jbs.bsmm(
                x, w, layout, transpose=transpose, preferred_element_type=out_dtype, precision=precision
            )
        )(x, w)
    W = _dense(w, mask, bs)
    want = _f64(x) @ (W.T if transpose else W)
    return got, want, (k if transpose else c)


def _check(got, want, dtype, length, out_dtype=None):
    got_np = _f64(got)
    assert got_np.shape == want.shape, (got_np.shape, want.shape)
    assert np.isfinite(got_np).all(), "non-finite output (padding leaked, or uninitialised memory)"
    tol = tolerance(dtype, length)
    if out_dtype is not None and np.dtype(out_dtype) != np.dtype(jnp.float32):
        tol = max(tol, tolerance(out_dtype, 1))
    scale = np.abs(want).max() if want.size else 0.0
    np.testing.assert_allclose(got_np, want, rtol=tol, atol=tol * max(scale, 1e-30))


# ---------------------------------------------------------------------------------
# Every dtype x block size x op x layout (N = 129) and every N (random layout)
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_layouts(dtype, bs, op, kind):
    mask, layout = _layout(kind, bs)
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (129,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("n", ROWS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_rows(dtype, bs, op, n):
    mask, layout = _layout("random", bs, seed=n)
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (n,), seed=n, precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_sanitizer_subset(dtype, bs, op):
    """Small but complete: every kernel instantiation with padding and a partial row tile."""
    mask, layout = _layout("padded", bs, seed=3)
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (3, 43), seed=3, precision="highest")
    _check(got, want, DTYPES[dtype], length)


def test_zero_rows():
    for op in OPS:
        mask, layout = _layout("random", 16)
        got, want, length = _run(op, layout, mask, jnp.bfloat16, (0,), precision="highest")
        _check(got, want, jnp.bfloat16, length)


@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [("bf16", "f32"), ("f16", "f32"), ("f16", "bf16"), ("f32", "bf16"), ("bf16", "f16")],
)
@pytest.mark.parametrize("op", OPS)
def test_output_dtypes(op, in_dtype, out_dtype):
    mask, layout = _layout("random", 32)
    got, want, length = _run(
        op, layout, mask, DTYPES[in_dtype], (2, 65), out_dtype=DTYPES[out_dtype], precision="highest"
    )
    assert got.dtype == DTYPES[out_dtype]
    _check(got, want, DTYPES[in_dtype], length, out_dtype=DTYPES[out_dtype])


# ---------------------------------------------------------------------------------
# Transforms through the kernels, against the reference, both at HIGHEST (exact float32:
# the precision each call states is kept by the JVP, transpose and batching rules)
# ---------------------------------------------------------------------------------


def _both(fun, *args):
    with jbs.config.implementation("kernels"):
        got = jax.jit(lambda *a: fun(*a))(*args)
    with jbs.config.implementation("reference"):
        want = jax.jit(lambda *a: fun(*a))(*args)
    return got, want


@pytest.mark.parametrize("bs", (8, 32, 128))
def test_grad(bs):
    mask, layout = _layout("padded", bs)
    w = jnp.nan_to_num(_weights(layout, jnp.float32, 1))
    c, k = layout.shape
    x, cot = _rand((5, 37, c), jnp.float32, 2), _rand((5, 37, k), jnp.float32, 3)

    def loss(x, w):
        return jnp.sum(jbs.bsmm(x, w, layout, precision="highest") * cot)

    (gx, gw), (rx, rw) = _both(jax.grad(loss, argnums=(0, 1)), x, w)
    _check(gx, _f64(rx), jnp.float32, k)
    _check(gw[: layout.nnz], _f64(rw)[: layout.nnz], jnp.float32, 5 * 37)
    assert not np.asarray(gw[layout.nnz :]).any(), "padding slots of dw must be zero"


@pytest.mark.parametrize("bs", (16, 64))
def test_vmap(bs):
    mask, layout = _layout("random", bs)
    c, k = layout.shape
    w = jnp.stack([_weights(layout, jnp.float32, 1), _weights(layout, jnp.float32, 2)])
    x = _rand((2, 9, c), jnp.float32, 4)
    dy = _rand((2, 9, k), jnp.float32, 5)
    got, want = _both(jax.vmap(lambda x, w: jbs.bsmm(x, w, layout, precision="highest")), x, w)
    _check(got, _f64(want), jnp.float32, c)
    got, want = _both(jax.vmap(lambda x: jbs.bsmm(x, w[0], layout, transpose=True, precision="highest")), dy)
    _check(got, _f64(want), jnp.float32, k)
    got, want = _both(jax.vmap(lambda x, dy: jbs.bsmm_updat(x, dy, layout, precision="highest")), x, dy)
    _check(got, _f64(want), jnp.float32, 9)


def test_layout_change_does_not_recompile():
    bs, grid, cap = 32, GRIDS[32], 20
    traces = []

    def f(x, w, layout):
        traces.append(1)
        return jbs.bsmm(x, w, layout, precision="highest")

    with jbs.config.implementation("kernels"):
        jf = jax.jit(f)
        for seed in range(3):
            mask = make_mask("random", grid, seed)
            extra = np.argwhere(mask)[cap:]
            mask[extra[:, 0], extra[:, 1]] = False  # at most `cap` blocks
            layout = Layout.from_mask(mask, bs, capacity=cap)
            w = jnp.nan_to_num(_weights(layout, jnp.float32, seed))
            x = _rand((33, layout.shape[0]), jnp.float32, seed)
            got = jf(x, w, layout)
            _check(got, _f64(x) @ _dense(w, mask, bs), jnp.float32, layout.shape[0])
    assert len(traces) == 1, f"traced {len(traces)} times for 3 layouts of one capacity"
