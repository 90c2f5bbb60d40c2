"""Layout: construction, index tables, determinism, pytree structure, no recompiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import GRIDS, MASK_KINDS, make_mask, np_blocks, rand, storage_order

TABLE_NAMES = (
    "block_rows",
    "block_cols",
    "col_ptr",
    "row_ptr",
    "row_slots",
    "col_order",
    "row_order",
    "col_work",
    "col_work_ptr",
    "row_work",
    "row_work_ptr",
)


def longest_first_oracle(counts):
    """Indices sorted by count, longest first, ties by index (a plain Python sort)."""
    return sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))


def expected_tables(mask, capacity):
    """The tables exactly as layout.py's docstring defines them, from the mask alone."""
    mask = np.asarray(mask, bool)
    rows, cols = storage_order(mask)
    nnz, pad = len(rows), capacity - len(rows)
    slot = {(c, k): s for s, (c, k) in enumerate(zip(rows, cols))}
    row_major = [slot[c, k] for c, k in zip(*np.nonzero(mask))]

    def padded(a):
        return np.concatenate([np.asarray(a, np.int64), np.zeros(pad, np.int64)])

    def work(order, segments):
        """The visiting order's (input block, slot) pairs, flat, and where each segment starts."""
        pairs, ptr = [], [0]
        for q in order:
            pairs += [v for pair in segments[q] for v in pair]
            ptr.append(ptr[-1] + len(segments[q]))
        return np.asarray(pairs + [0] * (2 * pad), np.int64), np.asarray(ptr, np.int64)

    col_order = longest_first_oracle(mask.sum(0))
    row_order = longest_first_oracle(mask.sum(1))
    cb, kb = mask.shape
    col_work, col_work_ptr = work(col_order, [[(c, slot[c, k]) for c in range(cb) if mask[c, k]] for k in range(kb)])
    row_work, row_work_ptr = work(row_order, [[(k, slot[c, k]) for k in range(kb) if mask[c, k]] for c in range(cb)])
    return dict(
        block_rows=padded(rows),
        block_cols=padded(cols),
        col_ptr=np.concatenate([[0], np.cumsum(mask.sum(0))]),
        row_ptr=np.concatenate([[0], np.cumsum(mask.sum(1))]),
        row_slots=padded(row_major),
        col_order=np.asarray(col_order, np.int64),
        row_order=np.asarray(row_order, np.int64),
        col_work=col_work,
        col_work_ptr=col_work_ptr,
        row_work=row_work,
        row_work_ptr=row_work_ptr,
    ), nnz


def assert_tables_equal(a, b):
    for name in TABLE_NAMES:
        ta, tb = getattr(a.tables, name), getattr(b.tables, name)
        assert ta.dtype == tb.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(ta), np.asarray(tb), err_msg=name)


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
def test_block_size_and_shapes(block_size):
    grid = GRIDS[block_size]
    layout = jbs.Layout.from_mask(np.eye(*grid, dtype=bool), block_size, capacity=5)
    assert layout.block_size == block_size and layout.grid == grid
    assert layout.shape == (grid[0] * block_size, grid[1] * block_size)
    assert layout.w_shape == (5, block_size, block_size)
    assert layout.nnz == min(grid) and layout.density == pytest.approx(min(grid) / (grid[0] * grid[1]))


@pytest.mark.parametrize("extra", [0, 3], ids=["exact", "padded"])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("grid", [(5, 4), (7, 3), (2, 9)])
def test_properties_and_tables(grid, kind, extra):
    block_size = 16
    mask = make_mask(kind, grid, seed=3)
    nnz = int(mask.sum())
    layout = jbs.Layout.from_mask(mask, block_size, capacity=nnz + extra)
    cb, kb = grid
    assert layout.block_size == block_size and layout.grid == grid
    assert layout.shape == (cb * block_size, kb * block_size)
    assert layout.capacity == nnz + extra and layout.nnz == nnz
    assert layout.w_shape == (nnz + extra, block_size, block_size)
    assert layout.density == pytest.approx(nnz / (cb * kb))
    np.testing.assert_array_equal(np.asarray(layout.valid), np.arange(nnz + extra) < nnz)
    np.testing.assert_array_equal(np.asarray(layout.mask), mask)
    want, _ = expected_tables(mask, nnz + extra)
    for name in TABLE_NAMES:
        got = getattr(layout.tables, name)
        assert got.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(got), want[name], err_msg=name)
    assert "Layout(" in repr(layout) and f"nnz={nnz}" in repr(layout)


def test_default_capacity_is_nnz_and_dense_constructor():
    mask = make_mask("random", (4, 6))
    assert jbs.Layout.from_mask(mask, 16).capacity == mask.sum()
    dense = jbs.Layout.dense((3, 2), 16)
    assert dense.nnz == dense.capacity == 6 and dense.density == 1.0
    assert dense.shape == (48, 32)
    np.testing.assert_array_equal(np.asarray(dense.mask), np.ones((3, 2), bool))


@pytest.mark.parametrize("capacity", [None, 0, 4])
def test_empty_layout(capacity):
    layout = jbs.Layout.from_mask(np.zeros((3, 2), bool), 8, capacity=capacity)
    assert layout.nnz == 0 and layout.density == 0.0
    assert layout.w_shape == (capacity or 0, 8, 8)
    assert not np.asarray(layout.mask).any() and not np.asarray(layout.valid).any()
    np.testing.assert_array_equal(np.asarray(layout.tables.col_ptr), np.zeros(3))
    np.testing.assert_array_equal(np.asarray(layout.tables.row_ptr), np.zeros(4))
    W = rand(layout.shape)
    np.testing.assert_array_equal(np.asarray(jbs.to_dense(jbs.from_dense(W, layout), layout)), 0)


def test_zero_sized_grid():
    layout = jbs.Layout.from_mask(np.zeros((0, 3), bool), 8)
    assert layout.shape == (0, 24) and layout.nnz == 0 and layout.density == 0.0


@pytest.mark.parametrize("kind", MASK_KINDS)
def test_deterministic_order_numpy_jax_and_traced(kind):
    mask = make_mask(kind, (5, 4), seed=1)
    capacity = int(mask.sum()) + 2
    base = jbs.Layout.from_mask(mask, 16, capacity=capacity)
    assert_tables_equal(base, jbs.Layout.from_mask(mask.copy(), 16, capacity=capacity))
    assert_tables_equal(base, jbs.Layout.from_mask(jnp.asarray(mask), 16, capacity=capacity))
    assert_tables_equal(base, jbs.Layout.from_mask(mask.astype(np.int32), 16, capacity=capacity))
    traced = jax.jit(lambda m: jbs.Layout.from_mask(m, 16, capacity=capacity))(jnp.asarray(mask))
    assert isinstance(traced, jbs.Layout) and traced.capacity == capacity and traced.grid == (5, 4)
    assert_tables_equal(base, traced)
    assert traced.nnz == base.nnz


def test_traced_mask_over_capacity_keeps_first_blocks_in_storage_order():
    mask = make_mask("full", (3, 4))
    layout = jax.jit(lambda m: jbs.Layout.from_mask(m, 8, capacity=5))(jnp.asarray(mask))
    kept = np.zeros_like(mask)
    rows, cols = storage_order(mask)
    kept[rows[:5], cols[:5]] = True
    assert layout.nnz == 5
    assert_tables_equal(layout, jbs.Layout.from_mask(kept, 8))


def test_traced_properties_inside_jit():
    mask = make_mask("random", (4, 4), seed=2)

    def props(m):
        layout = jbs.Layout.from_mask(m, 8, capacity=16)
        return layout.nnz, layout.density, layout.mask, layout.valid

    nnz, density, got_mask, valid = jax.jit(props)(jnp.asarray(mask))
    assert int(nnz) == mask.sum() and float(density) == pytest.approx(mask.mean())
    np.testing.assert_array_equal(np.asarray(got_mask), mask)
    np.testing.assert_array_equal(np.asarray(valid), np.arange(16) < mask.sum())


@pytest.mark.parametrize("extra", [0, 3])
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_from_dense_to_dense_round_trip(kind, extra):
    bs, grid = 16, (4, 3)
    mask = make_mask(kind, grid, seed=4)
    layout = jbs.Layout.from_mask(mask, bs, capacity=int(mask.sum()) + extra)
    W = rand(layout.shape, seed=5)
    w = jbs.from_dense(W, layout)
    assert w.shape == layout.w_shape and w.dtype == W.dtype
    np.testing.assert_array_equal(np.asarray(w), np_blocks(W, mask, bs, layout.capacity))  # padding is 0
    masked = np.asarray(W) * np.kron(mask, np.ones((bs, bs)))
    np.testing.assert_array_equal(np.asarray(jbs.to_dense(w, layout)), masked)
    # Padding slots are ignored by to_dense, whatever they hold.
    garbage = w.at[layout.nnz :].set(jnp.nan)
    np.testing.assert_array_equal(np.asarray(jbs.to_dense(garbage, layout)), masked)
    np.testing.assert_array_equal(np.asarray(jbs.from_dense(jbs.to_dense(w, layout), layout)), np.asarray(w))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_round_trip_keeps_dtype(dtype):
    layout = jbs.Layout.from_mask(make_mask("random", (2, 2)), 8)
    W = rand(layout.shape, dtype)
    w = jbs.from_dense(W, layout)
    assert w.dtype == dtype and jbs.to_dense(w, layout).dtype == dtype


def test_mask_round_trip_through_traced_layout():
    masks = [make_mask(kind, (4, 5), seed=7) for kind in MASK_KINDS]
    roundtrip = jax.jit(lambda m: jbs.Layout.from_mask(m, 8, capacity=20).mask)
    for mask in masks:
        np.testing.assert_array_equal(np.asarray(roundtrip(jnp.asarray(mask))), mask)


def test_pytree_leaves_and_treedef():
    mask = make_mask("random", (3, 4))
    layout = jbs.Layout.from_mask(mask, 32, capacity=9)
    leaves, treedef = jax.tree_util.tree_flatten(layout)
    assert len(leaves) == len(TABLE_NAMES) and all(leaf.dtype == jnp.int32 for leaf in leaves)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (rebuilt.block_size, rebuilt.grid, rebuilt.capacity) == (32, (3, 4), 9)
    assert_tables_equal(layout, rebuilt)
    other = jbs.Layout.from_mask(make_mask("single", (3, 4)), 32, capacity=9)
    assert jax.tree_util.tree_structure(other) == treedef
    for changed in [
        jbs.Layout.from_mask(mask, 16, capacity=9),  # block_size
        jbs.Layout.from_mask(mask, 32, capacity=10),  # capacity
        jbs.Layout.from_mask(np.eye(4, 3, dtype=bool), 32, capacity=9),  # grid
    ]:
        assert jax.tree_util.tree_structure(changed) != treedef
    doubled = jax.tree_util.tree_map(lambda t: t * 2, layout)
    assert isinstance(doubled, jbs.Layout) and doubled.capacity == 9


def test_pytree_paths_name_the_tables():
    # Path-keyed serialisers (orbax) store a layout's tables under these names.
    layout = jbs.Layout.from_mask(make_mask("random", (3, 4)), 32, capacity=9)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path({"w": layout})[0]]
    assert paths == [f"['w'].{name}" for name in TABLE_NAMES]


def test_repr_of_stacked_traced_and_abstract_layouts():
    layout = jbs.Layout.from_mask(np.eye(4, 8, dtype=bool), 8)
    assert repr(layout).endswith("capacity=4, nnz=4)")
    assert repr(jbs.sharding.split_columns(layout, 4)).endswith("capacity=2, nnz=[2, 2, 0, 0])")
    assert repr(jax.eval_shape(lambda: layout)).endswith("nnz=?)")  # ShapeDtypeStruct tables
    seen = []
    jax.jit(lambda m: seen.append(repr(jbs.Layout.from_mask(m, 8, capacity=4))))(jnp.eye(4, 8, dtype=bool))
    assert seen[0].endswith("nnz=traced)")


def test_new_mask_same_capacity_does_not_recompile():
    traces = []

    def f(x, w, layout):
        traces.append(1)  # Python side effect: runs once per trace
        return jbs.bsmm(x, w, layout)

    jitted = jax.jit(f)
    bs, grid, capacity = 8, (4, 4), 10
    x = rand((3, 32))
    results = []
    for kind in ("random", "single", "long_column", "empty"):
        mask = make_mask(kind, grid, seed=1)
        layout = jbs.Layout.from_mask(mask, bs, capacity=capacity)
        W = rand(layout.shape, seed=2)
        y = jitted(x, jbs.from_dense(W, layout), layout)
        masked = np.asarray(W) * np.kron(mask, np.ones((bs, bs)))
        np.testing.assert_allclose(np.asarray(y), np.asarray(x) @ masked, rtol=1e-5, atol=1e-5)
        results.append(y)
    assert len(traces) == 1
    if hasattr(jitted, "_cache_size"):
        assert jitted._cache_size() == 1
    jitted(x, jnp.zeros((capacity + 1, bs, bs)), jbs.Layout.from_mask(np.eye(*grid, dtype=bool), bs, capacity=11))
    assert len(traces) == 2  # a new capacity is a new static structure


def test_concrete_layout_flattens_to_device_arrays_once():
    """Host tables for constants; device leaves made once, so a jit argument costs no copy."""
    layout = jbs.Layout.from_mask(make_mask("random", (4, 5), seed=3), 16)
    assert all(isinstance(t, np.ndarray) for t in layout.tables)
    leaves = jax.tree_util.tree_leaves(layout)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    again = jax.tree_util.tree_leaves(layout)
    assert all(a is b for a, b in zip(leaves, again))  # the same buffers, not new copies
    for leaf, table in zip(leaves, layout.tables):
        np.testing.assert_array_equal(np.asarray(leaf), table)


def test_first_flatten_inside_a_trace_captures_no_tracer():
    layout = jbs.Layout.from_mask(make_mask("single", (3, 3), seed=2), 8)

    @jax.jit
    def f(x):
        leaves = jax.tree_util.tree_leaves(layout)  # first flatten: inside this trace
        assert not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
        return x + leaves[2][-1]

    assert int(f(jnp.int32(1))) == 2
    assert not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(layout))


def test_layout_as_jit_argument_reuses_its_device_tables():
    """Calls after the first hand the same device buffers to jit: nothing is copied."""
    layout = jbs.Layout.from_mask(make_mask("random", (4, 4), seed=5), 8)
    w = rand(layout.w_shape, seed=1)
    x = rand((3, 32), seed=2)
    f = jax.jit(jbs.bsmm)
    first = f(x, w, layout)
    with jax.transfer_guard("disallow"):  # x and w are device arrays already
        second = f(x, w, layout)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


@pytest.mark.parametrize("kind", ["random", "empty"])
def test_from_dense_and_to_dense_are_adjoint_linear_maps(kind):
    mask = make_mask(kind, (3, 4), seed=6)
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 2)
    W, w = rand(layout.shape, seed=1), rand(layout.w_shape, seed=2)
    (to_dense_t,) = jax.jit(jax.linear_transpose(lambda w_: jbs.to_dense(w_, layout), w))(W)
    (from_dense_t,) = jax.jit(jax.linear_transpose(lambda W_: jbs.from_dense(W_, layout), W))(w)
    np.testing.assert_array_equal(np.asarray(to_dense_t), np.asarray(jbs.from_dense(W, layout)))
    np.testing.assert_array_equal(np.asarray(from_dense_t), np.asarray(jbs.to_dense(w, layout)))
    grad_w = jax.jit(jax.grad(lambda w_: jnp.sum(jbs.to_dense(w_, layout) * W)))(w)
    np.testing.assert_array_equal(np.asarray(grad_w), np.asarray(jbs.from_dense(W, layout)))
