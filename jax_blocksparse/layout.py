"""The block layout: a boolean block mask turned into int32 index tables.

A weight matrix W of shape [C, K] is cut into square blocks of size ``bs``. The
block mask ``mask`` of shape [CB, KB] = [C // bs, K // bs] says which blocks exist.
Only those are stored, as ``w`` of shape [capacity, bs, bs]; ``capacity`` is a
static upper bound on the number of blocks so that a layout can change without
changing array shapes.

Storage order (the "slot" of each block) is a deterministic function of the mask:
blocks are sorted by output block column ``k``, then by input block row ``c``
(column-major order of the mask). Slots ``[nnz, capacity)`` are padding: their
table entries point at block (0, 0) and every op ignores them.

Index tables (all int32, all pytree leaves, so a new mask with the same capacity
never triggers a recompile):

========== =========== ========================================================
name       shape       meaning
========== =========== ========================================================
block_rows [capacity]  input block row ``c`` of each slot (0 for padding)
block_cols [capacity]  output block column ``k`` of each slot (0 for padding)
col_ptr    [KB + 1]    slots of column ``k`` are ``col_ptr[k]:col_ptr[k + 1]``;
                       ``col_ptr[KB] == nnz``
row_ptr    [CB + 1]    entries of block row ``c`` in ``row_slots`` are
                       ``row_ptr[c]:row_ptr[c + 1]``
row_slots  [capacity]  slot indices in row-major order of the mask (0 for padding)
col_order  [KB]        the block columns, longest first (stable): the order in
                       which the fprop kernels visit their output columns
row_order  [CB]        the block rows, longest first (stable): bprop's order
col_work   [2 * cap]   fprop's work list: the pairs (input block row ``c``, slot
                       ``s``) of every block, column by column in ``col_order``,
                       each column's blocks in slot order; (0, 0) past ``nnz``
col_work_ptr [KB + 1]  the pairs of the ``q``-th column visited (``col_order[q]``)
                       are ``col_work_ptr[q]:col_work_ptr[q + 1]``
row_work   [2 * cap]   bprop's work list: the pairs (output block column ``k``, slot
                       ``s``), row by row in ``row_order``, each row in ``row_slots``
                       order; (0, 0) past ``nnz``
row_work_ptr [CB + 1]  the same pointers for ``row_order``
========== =========== ========================================================

The orders and the work lists are the kernels' work plan. They are part of the layout,
built once with it (on the host for a concrete mask, with jnp ops under a trace at the
same static capacity), so that no call sorts anything and a kernel reads each work
item's (input block, slot) pair in one load, with no chain of dependent index loads
(order, then pointer, then slot, then input block).

Where the tables live: a layout built from a concrete mask keeps numpy tables, so
that wherever it is closed over they are compile-time constants, and a layout built
(and cached) during any trace never captures a tracer. As a pytree it flattens into
device arrays, made once per layout and kept: ``jax.jit(f)(x, w, layout)`` then
copies nothing from the host after the first call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The block sizes with kernels: block_sizes.json in this package is the one table of
# them, read here and, by the build (CMakeLists.txt), into the C++ kernels' checks.
SUPPORTED_BLOCK_SIZES: tuple[int, ...] = tuple(
    json.loads(Path(__file__).with_name("block_sizes.json").read_text())["block_sizes"]
)


class LayoutTables(NamedTuple):
    """The int32 index tables of a layout, in the order ops take them as operands."""

    block_rows: jax.Array
    block_cols: jax.Array
    col_ptr: jax.Array
    row_ptr: jax.Array
    row_slots: jax.Array
    col_order: jax.Array
    row_order: jax.Array
    col_work: jax.Array
    col_work_ptr: jax.Array
    row_work: jax.Array
    row_work_ptr: jax.Array

    @classmethod
    def with_orders(cls, block_rows, block_cols, col_ptr, row_ptr, row_slots) -> LayoutTables:
        """The tables with the orders and work lists derived from the first five.

        numpy tables give numpy ones (built on the host); jax ones, jnp ones.
        """
        col_order, row_order = longest_first(col_ptr), longest_first(row_ptr)
        col_work, col_work_ptr = work_list(col_ptr, col_order, None, block_rows)
        row_work, row_work_ptr = work_list(row_ptr, row_order, row_slots, block_cols)
        return cls(
            block_rows,
            block_cols,
            col_ptr,
            row_ptr,
            row_slots,
            col_order,
            row_order,
            col_work,
            col_work_ptr,
            row_work,
            row_work_ptr,
        )


def longest_first(ptr):
    """int32 [S]: the segments of ``ptr`` ([S + 1]) ordered by length, longest first (stable)."""
    if isinstance(ptr, np.ndarray):
        return np.argsort(-np.diff(ptr), kind="stable").astype(np.int32)
    ptr = jnp.asarray(ptr)
    return jnp.argsort(ptr[:-1] - ptr[1:], stable=True).astype(jnp.int32)


def work_list(seg_ptr, order, seg_slots, in_block):
    """A DSD product's flat work list: (pairs int32 [2 * capacity], ptr int32 [S + 1]).

    The segments of ``seg_ptr`` ([S + 1]) are visited in ``order`` ([S]); entry ``e`` of a
    segment is slot ``seg_slots[e]`` (``e`` itself where ``seg_slots`` is None: fprop,
    whose slots are sorted by column). ``pairs[2 i], pairs[2 i + 1]`` are the input block
    (``in_block[slot]``) and the slot of the ``i``-th entry visited; ``ptr[q]`` is where
    the ``q``-th segment visited starts. Entries past the last segment's end are (0, 0).
    numpy in, numpy out; jax in (traced or not), jnp out.
    """
    xp = np if isinstance(seg_ptr, np.ndarray) else jnp
    capacity = in_block.shape[0]
    lengths = (seg_ptr[1:] - seg_ptr[:-1])[order]
    ptr = xp.concatenate([xp.zeros((1,), np.int32), xp.cumsum(lengths).astype(np.int32)])
    e = xp.arange(capacity, dtype=np.int32)
    # The position q of the segment entry e falls in, and its index in the segment tables.
    q = xp.clip(xp.searchsorted(ptr, e, side="right") - 1, 0, max(order.shape[0] - 1, 0))
    visited = e < ptr[-1]
    if order.shape[0] == 0:
        index = xp.zeros_like(e)
    else:
        index = xp.clip(seg_ptr[order[q]] + (e - ptr[q]), 0, max(capacity - 1, 0))
    slot = index if seg_slots is None else (seg_slots[index] if capacity else index)
    block = in_block[slot] if capacity else slot
    pairs = xp.stack([xp.where(visited, block, 0), xp.where(visited, slot, 0)], axis=1).reshape(-1)
    return pairs.astype(np.int32), ptr.astype(np.int32)


def check_block_size(block_size, *, name: str = "block_size") -> int:
    """Returns ``block_size`` as an int, or raises if it is not one we support."""
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(block_size).__name__} {block_size!r}")
    if int(block_size) not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"{name} must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    return int(block_size)


def check_mask(mask):
    """Validates a block mask (numpy or jax, concrete or traced) and returns it."""
    if not hasattr(mask, "shape"):
        mask = np.asarray(mask)
    if len(mask.shape) != 2:
        raise ValueError(f"mask must be 2-D [C // block_size, K // block_size], got shape {tuple(mask.shape)}")
    dtype = np.dtype(mask.dtype)
    if not (dtype == np.bool_ or np.issubdtype(dtype, np.integer)):
        raise TypeError(f"mask must be boolean (or 0/1 integers), got dtype {dtype} with shape {tuple(mask.shape)}")
    # Any concrete mask (numpy or jax) is checked; only a traced one cannot be.
    if dtype != np.bool_ and _is_concrete(mask):
        values = np.asarray(mask)
        if not np.isin(values, (0, 1)).all():
            raise ValueError(
                f"mask of dtype {dtype} with shape {tuple(mask.shape)} must hold only 0 and 1, "
                f"got values {np.unique(values)[:8]}"
            )
    return mask


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _tables_numpy(mask: np.ndarray, capacity: int) -> LayoutTables:
    """Builds the tables on the host from a concrete mask."""
    cb, kb = mask.shape
    k_idx, c_idx = np.nonzero(mask.T)  # column-major order: sorted by k, then c
    nnz = k_idx.size
    slot_of = np.zeros((cb, kb), np.int64)
    slot_of[c_idx, k_idx] = np.arange(nnz)
    rm_c, rm_k = np.nonzero(mask)  # row-major order
    pad = capacity - nnz

    def padded(a):
        return np.concatenate([a, np.zeros(pad, a.dtype)]).astype(np.int32)

    return LayoutTables.with_orders(
        block_rows=padded(c_idx),
        block_cols=padded(k_idx),
        col_ptr=np.concatenate([[0], np.cumsum(mask.sum(axis=0))]).astype(np.int32),
        row_ptr=np.concatenate([[0], np.cumsum(mask.sum(axis=1))]).astype(np.int32),
        row_slots=padded(slot_of[rm_c, rm_k]),
    )


def _tables_traced(mask: jax.Array, capacity: int) -> LayoutTables:
    """Builds the same tables as ``_tables_numpy`` with jnp ops (works under jit).

    Blocks beyond ``capacity`` (in storage order) are dropped, so the tables stay
    consistent: a traced mask cannot raise on overflow.
    """
    cb, kb = mask.shape
    mask = mask.astype(bool)
    flat_cm = mask.T.reshape(-1)  # column-major flattening: index k * cb + c
    rank_cm = jnp.cumsum(flat_cm.astype(jnp.int32)) - 1
    keep_cm = flat_cm & (rank_cm < capacity)
    mask = keep_cm.reshape(kb, cb).T
    slot_of = jnp.where(mask, rank_cm.reshape(kb, cb).T, 0)

    (flat_idx,) = jnp.nonzero(keep_cm, size=capacity, fill_value=0)
    nnz = jnp.sum(keep_cm, dtype=jnp.int32)
    valid = jnp.arange(capacity) < nnz
    block_cols = jnp.where(valid, flat_idx // cb, 0)
    block_rows = jnp.where(valid, flat_idx % cb, 0)

    (flat_rm,) = jnp.nonzero(mask.reshape(-1), size=capacity, fill_value=0)
    row_slots = jnp.where(valid, slot_of.reshape(-1)[flat_rm], 0)

    zero = jnp.zeros((1,), jnp.int32)
    return LayoutTables.with_orders(
        block_rows=block_rows.astype(jnp.int32),
        block_cols=block_cols.astype(jnp.int32),
        col_ptr=jnp.concatenate([zero, jnp.cumsum(mask.sum(axis=0, dtype=jnp.int32))]),
        row_ptr=jnp.concatenate([zero, jnp.cumsum(mask.sum(axis=1, dtype=jnp.int32))]),
        row_slots=row_slots.astype(jnp.int32),
    )


@jax.tree_util.register_pytree_with_keys_class
class Layout:
    """Which blocks of a [C, K] weight exist, and where each one is stored.

    Build one with :meth:`Layout.from_mask`. ``block_size``, ``grid`` and
    ``capacity`` are static (part of the pytree structure); the index tables are
    int32 leaves, so two layouts of equal capacity are interchangeable inside a
    jitted function without recompiling.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.random((8, 8), density=0.25, seed=0)
        >>> layout = jbs.Layout.from_mask(mask, block_size=32)      # W is [256, 256]
        >>> layout
        Layout(block_size=32, grid=(8, 8), shape=(256, 256), capacity=16, nnz=16)
        >>> layout.w_shape                                          # the stored blocks w
        (16, 32, 32)

    With a fixed ``capacity`` every mask of up to that many blocks gives the same
    pytree structure, so a jitted function takes a new one without recompiling::

        >>> traces = []
        >>> @jax.jit
        ... def f(x, w, layout):
        ...     traces.append(layout)                               # runs once per trace
        ...     return jbs.bsmm(x, w, layout)
        >>> other = jbs.Layout.from_mask(jbs.layouts.random((8, 8), 0.2, seed=1), 32, capacity=16)
        >>> x, w = jnp.ones((4, 256)), jnp.ones(layout.w_shape)
        >>> f(x, w, layout).shape, f(x, w, other).shape
        ((4, 256), (4, 256))
        >>> len(traces)                                             # traced and compiled once
        1
    """

    __slots__ = ("block_size", "grid", "capacity", "tables", "_device_tables", "_static")

    def __init__(self, block_size: int, grid: tuple[int, int], capacity: int, tables: LayoutTables):
        self.block_size = block_size
        self.grid = grid
        self.capacity = capacity
        self.tables = tables
        self._device_tables = None  # made on the first flatten of host tables
        self._static = (block_size, grid, capacity)  # the pytree's aux data, built once

    # -- construction -------------------------------------------------------------

    @classmethod
    def from_mask(cls, mask, block_size: int, capacity: int | None = None) -> Layout:
        """Builds a layout from a block mask.

        Args:
          mask: bool (or 0/1 int) array [C // block_size, K // block_size], numpy
            or jax. May be traced (inside jit) when ``capacity`` is given.
          block_size: one of :data:`SUPPORTED_BLOCK_SIZES`.
          capacity: number of storage slots, >= the number of blocks. Defaults to
            the number of blocks (requires a concrete mask). With a traced mask,
            blocks beyond ``capacity`` in storage order are dropped.
        """
        block_size = check_block_size(block_size)
        mask = check_mask(mask)
        grid = (int(mask.shape[0]), int(mask.shape[1]))
        concrete = _is_concrete(mask)
        if concrete:
            mask_np = np.asarray(mask).astype(bool)
            nnz = int(mask_np.sum())
        if capacity is None:
            if not concrete:
                raise ValueError(
                    "Layout.from_mask: a traced mask needs an explicit capacity "
                    f"(mask shape {grid}); pass capacity=<max number of blocks>"
                )
            capacity = nnz
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__} {capacity!r}")
        capacity = int(capacity)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if concrete:
            if capacity < nnz:
                raise ValueError(
                    f"capacity={capacity} is smaller than the number of blocks in the mask ({nnz} of grid {grid})"
                )
            # Host (numpy) tables: constants wherever the layout is used, so a layout
            # built (and cached) during any trace never captures a tracer.
            tables = _tables_numpy(mask_np, capacity)
        else:
            tables = _tables_traced(jnp.asarray(mask), capacity)
        return cls(block_size, grid, capacity, tables)

    @classmethod
    def dense(cls, grid: tuple[int, int], block_size: int) -> Layout:
        """A layout with every block present."""
        return cls.from_mask(np.ones(grid, bool), block_size)

    # -- pytree -------------------------------------------------------------------

    def tree_flatten(self):
        # Runs on every jit call that takes the layout: returns prebuilt objects only.
        return self._leaves(), self._static

    def tree_flatten_with_keys(self):
        # The tables by name (paths ``...block_rows``, ``...col_ptr``): what path-keyed
        # serialisers such as orbax name the arrays of a layout in a checkpoint.
        leaves = self._leaves()
        return [(jax.tree_util.GetAttrKey(name), leaf) for name, leaf in zip(leaves._fields, leaves)], self._static

    def _leaves(self) -> LayoutTables:
        """The tables as pytree leaves: host (numpy) tables become device arrays, once.

        Made under ``ensure_compile_time_eval``, so even a flatten inside a trace gives
        concrete arrays (never a tracer) that later calls reuse. They are uncommitted:
        a jitted function running elsewhere moves them like any default-device array.
        """
        if self._device_tables is None:
            if not all(isinstance(t, np.ndarray) for t in self.tables):
                return self.tables
            with jax.ensure_compile_time_eval():
                self._device_tables = LayoutTables(*(jnp.asarray(t) for t in self.tables))
        return self._device_tables

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        block_size, grid, capacity = aux
        return cls(block_size, grid, capacity, LayoutTables(*leaves))

    # -- derived properties ---------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """(C, K): the shape of the dense weight."""
        return (self.grid[0] * self.block_size, self.grid[1] * self.block_size)

    @property
    def w_shape(self) -> tuple[int, int, int]:
        """(capacity, bs, bs): the shape of the stored blocks."""
        return (self.capacity, self.block_size, self.block_size)

    @property
    def nnz(self):
        """Number of blocks present: an int for a concrete layout, else a traced int32."""
        nnz = self.tables.col_ptr[-1]
        return int(nnz) if _is_concrete(nnz) else nnz

    @property
    def density(self):
        """Fraction of the grid's blocks that are present."""
        total = self.grid[0] * self.grid[1]
        if total == 0:
            return 0.0
        nnz = self.nnz
        return nnz / total if isinstance(nnz, int) else nnz.astype(jnp.float32) / total

    @property
    def valid(self) -> jax.Array:
        """bool [capacity]: which slots hold a block (the rest are padding)."""
        return jnp.arange(self.capacity) < self.tables.col_ptr[-1]

    @property
    def mask(self) -> jax.Array:
        """bool [CB, KB]: the block mask this layout was built from."""
        t = self.tables
        m = jnp.zeros(self.grid, bool)
        return m.at[t.block_rows, t.block_cols].max(self.valid, mode="drop")

    def __repr__(self):
        col_ptr = self.tables.col_ptr
        if not _is_concrete(col_ptr):
            nnz_s = "traced"
        elif not isinstance(col_ptr, (np.ndarray, jax.Array)):
            nnz_s = "?"  # abstract leaves: jax.eval_shape's ShapeDtypeStructs, shardings
        else:
            nnz = np.asarray(col_ptr)[..., -1]  # one count per layout of a stack (split_columns)
            nnz_s = str(nnz.tolist())
        return (
            f"Layout(block_size={self.block_size}, grid={self.grid}, shape={self.shape}, "
            f"capacity={self.capacity}, nnz={nnz_s})"
        )


def check_layout(layout, *, name: str = "layout") -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"{name} must be a jax_blocksparse.Layout, got {type(layout).__name__}")
    return layout
