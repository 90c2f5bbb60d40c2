"""The stacked layout attention runs on: every (batch row, head) problem in one block-sparse matrix.

For queries [B, T_q, H, D] and keys [B, T_kv, KVH, D] (H = G x KVH; query head h reads
key head h // G), attention's scores are the tiles of one block-sparse matrix W' of grid
[B*KVH*n_kv, B*H*n_q]: rows are key blocks (problem-major: key problem b*KVH + h//G, key
block j), columns are query blocks (problem p = b*H + h, query block i). Tile
(row, column) holds ``k_block @ q_block^T`` ([bs_kv, bs_q]). Keys are not repeated for
the G query heads that share them: those heads' tiles sit in the same block rows.

Storage order is the layout's (by column, then row), which here is the row-major order
of the per-problem grids stacked as [B, H, n_q, n_kv]: all tiles of one query block row
are consecutive slots, sorted by key block. :func:`stacked_plan` builds the layout and,
per slot, the (batch row, head, query block, key block) it belongs to, on the host from
a concrete :class:`~jax_blocksparse.ops.block_mask.BlockMask` (cached: compile-time
constants) or with jnp ops from a traced one (at its fixed capacity).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import Layout, LayoutTables
from jax_blocksparse.ops.block_mask import BlockMask

__all__ = ["StackedPlan", "stacked_plan"]


class StackedPlan(NamedTuple):
    """The stacked layout and what each of its ``total`` slots is (numpy if concrete, else jnp)."""

    layout: Layout  # grid (B*KVH*n_kv, B*H*n_q), capacity total
    batch: jax.Array  # int32 [total]: batch row b of the slot
    head: jax.Array  # int32 [total]: query head h
    q_block: jax.Array  # int32 [total]: query block i (within the problem)
    kv_block: jax.Array  # int32 [total]: key block j
    column: jax.Array  # int32 [total]: stacked query block b*H*n_q + h*n_q + i (the softmax segment)
    valid: jax.Array | None  # bool [total]: slot holds a tile (None: all do)
    full: jax.Array | None  # bool [total]: the structured token mask holds everywhere (None: no such mask)
    partial: np.ndarray | None  # int32 [n]: the slots that are not full, when known on the host
    num_columns: int  # B*H*n_q
    overflow: jax.Array | None  # bool []: a traced grid had more tiles than the capacity (None: host plan)


def _problem_grid(xp, blocks, full, has_fn: bool, batch: int, heads: int, is_causal: bool):
    """bool [B, H, n_q, n_kv] of present tiles (causal: none above the diagonal), and the full ones (or None)."""
    n_q, n_kv = blocks.shape[2:]
    shape = (batch, heads, n_q, n_kv)
    blocks = xp.broadcast_to(blocks, shape)
    if has_fn:
        full = xp.broadcast_to(full, shape) if full is not None else xp.zeros(shape, bool)
    else:
        full = None
    if is_causal:
        # Query i sees key j when i >= j (top-left aligned, as jax.nn.dot_product_attention):
        # tile (i, j) has such a pair iff j <= i, and all of them iff j < i.
        i, j = np.arange(n_q)[:, None], np.arange(n_kv)[None, :]
        blocks = blocks & xp.asarray(j <= i)
        below = xp.asarray(j < i)
        full = xp.broadcast_to(below, shape) if full is None else full & below
    return blocks, full


@functools.lru_cache(maxsize=64)
def _host_plan(blocks_key, full_key, grid, block_size, batch, heads, kv_heads, is_causal, has_fn) -> StackedPlan:
    blocks = np.frombuffer(blocks_key, bool).reshape(grid)
    full = None if full_key is None else np.frombuffer(full_key, bool).reshape(grid)
    m, full = _problem_grid(np, blocks, full, has_fn, batch, heads, is_causal)
    n_q, n_kv = grid[2:]
    group = heads // kv_heads
    slots = np.flatnonzero(m).astype(np.int32)
    p, rest = np.divmod(slots, n_q * n_kv)
    i, j = np.divmod(rest, n_kv)
    b, h = np.divmod(p, heads)
    column = (p * n_q + i).astype(np.int32)
    row = ((b * kv_heads + h // group) * n_kv + j).astype(np.int32)
    column_counts = m.sum(-1).reshape(-1)
    row_counts = m.reshape(batch, kv_heads, group, n_q, n_kv).sum((2, 3)).reshape(-1)
    tables = LayoutTables.with_orders(
        block_rows=row,
        block_cols=column,
        col_ptr=np.concatenate([[0], np.cumsum(column_counts)]).astype(np.int32),
        row_ptr=np.concatenate([[0], np.cumsum(row_counts)]).astype(np.int32),
        row_slots=np.lexsort((column, row)).astype(np.int32),
    )
    grid2 = (batch * kv_heads * n_kv, batch * heads * n_q)
    layout = Layout(block_size, grid2, int(slots.size), tables)
    full_s = None if full is None else full.reshape(-1)[slots]
    partial = None if full_s is None else np.flatnonzero(~full_s).astype(np.int32)
    as32 = functools.partial(np.asarray, dtype=np.int32)
    return StackedPlan(layout, as32(b), as32(h), as32(i), as32(j), column, None, full_s, partial, grid2[1], None)


def _traced_plan(bm: BlockMask, batch, heads, kv_heads, is_causal) -> StackedPlan:
    m, full = _problem_grid(jnp, bm.blocks, bm.full, bm.mask_fn is not None, batch, heads, is_causal)
    n_q, n_kv = bm.grid[2:]
    group = heads // kv_heads
    total = batch * heads * bm.capacity
    flat = m.reshape(-1)
    rank = jnp.cumsum(flat, dtype=jnp.int32) - 1
    overflow = rank[-1] >= total if flat.size else jnp.bool_(False)
    flat = flat & (rank < total)  # what does not fit is dropped, so that the tables stay consistent
    m = flat.reshape(m.shape)
    (slots,) = jnp.nonzero(flat, size=total, fill_value=0)
    slots = slots.astype(jnp.int32)
    valid = jnp.arange(total) < jnp.sum(flat, dtype=jnp.int32)
    p, rest = jnp.divmod(slots, n_q * n_kv)
    i, j = jnp.divmod(rest, n_kv)
    b, h = jnp.divmod(p, heads)
    column = jnp.where(valid, p * n_q + i, 0)
    row = jnp.where(valid, (b * kv_heads + h // group) * n_kv + j, 0)
    zero = jnp.zeros((1,), jnp.int32)
    column_counts = m.sum(-1, dtype=jnp.int32).reshape(-1)
    row_counts = m.reshape(batch, kv_heads, group, n_q, n_kv).sum((2, 3), dtype=jnp.int32).reshape(-1)
    # Row-major order of the valid slots (by row, then column), padding last and then 0.
    order = jnp.lexsort((column, row, ~valid)).astype(jnp.int32)
    row_slots = jnp.where(valid, order, 0)
    tables = LayoutTables.with_orders(
        block_rows=row.astype(jnp.int32),
        block_cols=column.astype(jnp.int32),
        col_ptr=jnp.concatenate([zero, jnp.cumsum(column_counts)]),
        row_ptr=jnp.concatenate([zero, jnp.cumsum(row_counts)]),
        row_slots=row_slots,
    )
    grid2 = (batch * kv_heads * n_kv, batch * heads * n_q)
    layout = Layout(bm.block_size, grid2, total, tables)
    full_s = None if full is None else full.reshape(-1)[slots] & valid
    return StackedPlan(layout, b, h, i, j, column, valid, full_s, None, grid2[1], overflow)


def stacked_plan(bm: BlockMask, batch: int, heads: int, kv_heads: int, is_causal: bool) -> StackedPlan:
    """The stacked layout of ``bm`` for ``batch`` x ``heads`` problems over ``kv_heads`` key heads.

    ``bm``'s grid must broadcast to [batch, heads, n_q, n_kv]; ``heads % kv_heads == 0``.
    ``full`` in the plan combines the mask's full tiles (for its ``mask_fn``) and, with
    ``is_causal``, the tiles strictly below the diagonal; it is None when there is no
    token-level mask of either kind.
    """
    if bm.is_concrete:
        full_key = None if bm.full is None else np.ascontiguousarray(bm.full).tobytes()
        return _host_plan(
            np.ascontiguousarray(bm.blocks).tobytes(),
            full_key,
            bm.grid,
            bm.block_size,
            batch,
            heads,
            kv_heads,
            bool(is_causal),
            bm.mask_fn is not None,
        )
    return _traced_plan(bm, batch, heads, kv_heads, is_causal)
