"""Moving per-block arrays from an old layout's slots to a new layout's slots.

A layout stores its blocks in column-major order of the mask, so when blocks are
pruned and grown, a surviving block (r, c) may move to another slot. Every array
indexed by slot (the kernel, the fp32 master copy, Adam's ``mu`` and ``nu``, ...)
must move with it: :func:`remap_blocks` does it for one array and
:func:`remap_tree` for every such leaf of a pytree (params or any optax state).
Blocks that are new in the new layout get ``fill`` (zero: grown weights start at
zero and their optimizer state is reset); blocks absent from the new layout are
dropped; padding slots are ``fill``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_blocksparse.layout import Layout, check_layout
from jax_blocksparse.training import _paths


def _check_pair(old_layout: Layout, new_layout: Layout):
    old_layout = check_layout(old_layout, name="old_layout")
    new_layout = check_layout(new_layout, name="new_layout")
    if old_layout.grid != new_layout.grid or old_layout.block_size != new_layout.block_size:
        raise ValueError(
            "remap_blocks: old and new layouts must have the same grid and block size, got "
            f"{old_layout} and {new_layout}"
        )
    return old_layout, new_layout


def slot_map(old_layout: Layout, new_layout: Layout) -> jax.Array:
    """int32 [new capacity]: the old slot of the block in each new slot, -1 if none.

    -1 marks blocks that are new (grown) and padding slots. Works under jit.
    """
    old_layout, new_layout = _check_pair(old_layout, new_layout)
    cb, kb = old_layout.grid
    if old_layout.capacity == 0 or cb * kb == 0:
        return jnp.full((new_layout.capacity,), -1, jnp.int32)
    t_old, t_new = old_layout.tables, new_layout.tables
    rows = jnp.where(old_layout.valid, t_old.block_rows, cb)  # padding -> out of range -> dropped
    slot_of = jnp.full((cb, kb), -1, jnp.int32)
    slot_of = slot_of.at[rows, t_old.block_cols].set(jnp.arange(old_layout.capacity, dtype=jnp.int32), mode="drop")
    src = slot_of[t_new.block_rows, t_new.block_cols]
    return jnp.where(new_layout.valid, src, -1).astype(jnp.int32)


def remap_blocks(values, old_layout: Layout, new_layout: Layout, fill=0):
    """Moves per-block values from the slots of ``old_layout`` to those of ``new_layout``.

    Args:
      values: [old_layout.capacity, ...], e.g. a kernel [capacity, bs, bs] or any
        optimizer-state leaf of that shape.
      old_layout, new_layout: layouts of the same grid and block size (capacities
        may differ); concrete or traced.
      fill: value of the blocks that are new in ``new_layout`` and of padding slots.

    Returns:
      [new_layout.capacity, ...], same dtype: slot ``s`` holds the old value of
      block ``(new.block_rows[s], new.block_cols[s])`` if it was in ``old_layout``,
      else ``fill``. So ``to_dense(remap_blocks(w, old, new), new)`` equals
      ``to_dense(w, old)`` on the blocks of both layouts and ``fill`` elsewhere.

    Example::

        new_w = remap_blocks(w, layout, Layout.from_mask(new_mask, 16, capacity=layout.capacity))
    """
    values = jnp.asarray(values)
    old_layout, new_layout = _check_pair(old_layout, new_layout)
    if values.ndim < 1 or values.shape[0] != old_layout.capacity:
        raise ValueError(
            f"remap_blocks: values must have shape [old capacity={old_layout.capacity}, ...], got {tuple(values.shape)}"
        )
    return _move(values, slot_map(old_layout, new_layout), fill)


def _move(values, src, fill):
    """values[src] where src >= 0, else fill: [len(src), ...]."""
    fill = jnp.asarray(fill, values.dtype)
    if values.shape[0] == 0:
        return jnp.full(src.shape + values.shape[1:], fill, values.dtype)
    gathered = jnp.take(values, jnp.maximum(src, 0), axis=0)
    keep = (src >= 0).reshape((-1,) + (1,) * (values.ndim - 1))
    return jnp.where(keep, gathered, fill)


def remap_tree(tree, old_layouts, new_layouts, fill=0):
    """Applies :func:`remap_blocks` to every per-block leaf of ``tree``.

    Args:
      tree: any pytree: params (a linen ``variables["params"]`` dict, an nnx state)
        or an optimizer state (any optax state: chains, ``inject_hyperparams``,
        ``masked``, ``multi_transform``, an ``nnx.Optimizer`` state).
      old_layouts, new_layouts: pytrees of the same structure with
        :class:`~jax_blocksparse.Layout` leaves, placed beside the params (see
        :mod:`jax_blocksparse.training._paths`: the layout at path ``P``, or at
        ``P[:-1] + (name + "_layout",)``, describes the leaves at ``P``).
      fill: value for new blocks (zero resets optimizer state).

    A leaf is remapped when its path ends with a layout's parameter path and its
    leading dimension equals that layout's capacity. Everything else (biases,
    norms, step counters) is returned unchanged.
    """
    old = _paths.layout_leaves(old_layouts)
    new = _paths.layout_leaves(new_layouts)
    if [p for p, _ in old] != [p for p, _ in new]:
        raise ValueError("remap_tree: old_layouts and new_layouts must have the same paths")
    targets = [p for p, _ in old]
    srcs = {}  # one slot map per layout, shared by all its leaves

    def remap_leaf(path, leaf):
        i = _paths.match(_paths.normalize(path), targets)
        if i is None or not hasattr(leaf, "shape") or len(leaf.shape) < 1:
            return leaf
        if leaf.shape[0] != old[i][1].capacity:
            return leaf
        if i not in srcs:
            srcs[i] = slot_map(old[i][1], new[i][1])
        return _move(jnp.asarray(leaf), srcs[i], fill)

    return jax.tree_util.tree_map_with_path(remap_leaf, tree)
