"""Model parallelism: a block-sparse weight split by output block columns across devices.

A layout of grid [CB, KB] is cut into ``num_shards`` groups of ``KB / num_shards``
consecutive output block columns. Shard ``i`` holds the blocks of columns
``[i * KB / n, (i + 1) * KB / n)`` and a :class:`~jax_blocksparse.Layout` of grid
[CB, KB / n] for them; every shard has the same capacity (by default the largest
shard's block count), so the shards stack into one array and one layout pytree with
a leading axis of size ``num_shards``, to be split over a mesh axis with
``shard_map``::

    layouts = jbs.sharding.split_columns(layout, 8)       # tables [8, ...]
    w_sh = jbs.sharding.shard_blocks(w, layout, 8)         # [8, cap, bs, bs]
    y = jbs.sharding.column_parallel_bsmm(x, w_sh, layouts, mesh, "model")
    # == jbs.bsmm(x, w, layout); each device multiplied only its columns

Storage order makes the split cheap: slots are sorted by output column, so shard
``i``'s blocks are the contiguous slots ``col_ptr[i * KB / n] : col_ptr[(i + 1) * KB / n]``
of the full weight, in the same order as in the shard's own layout.

Data parallelism (batch split, weights replicated) needs nothing from this module:
:func:`jax_blocksparse.bsmm` and every layer work under ``pmap``, ``shard_map`` and
``jit`` with sharded inputs as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_blocksparse.layout import Layout, LayoutTables, check_layout
from jax_blocksparse.ops.matmul import bsmm

# check_mesh, default_capacity and place are the helpers the column-parallel layers
# share with this module; shard_map is the package's one spelling of the transform.
__all__ = [
    "column_parallel_bsmm",
    "shard_blocks",
    "split_columns",
    "unshard_blocks",
    "check_mesh",
    "default_capacity",
    "place",
    "shard_map",
]

#: ``jax.shard_map`` (``jax.experimental.shard_map.shard_map`` on JAX < 0.7): the one
#: compatibility shim of the package, used by the library, its tests and examples.
if hasattr(jax, "shard_map"):
    shard_map = jax.shard_map
else:  # pragma: no cover - jax < 0.7
    from jax.experimental.shard_map import shard_map


def _check_num_shards(layout: Layout, num_shards, fn: str) -> int:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)):
        raise TypeError(f"{fn}: num_shards must be an int, got {type(num_shards).__name__} {num_shards!r}")
    num_shards = int(num_shards)
    kb = layout.grid[1]
    if num_shards < 1 or kb % num_shards:
        raise ValueError(
            f"{fn}: num_shards={num_shards} must be >= 1 and divide the number of output block "
            f"columns KB={kb} of {layout}"
        )
    return num_shards


def _shard_bounds(layout: Layout, num_shards: int):
    """Per shard: first slot [n] and block count [n] (jnp int32; concrete layouts give numpy)."""
    per = layout.grid[1] // num_shards
    ptr = layout.tables.col_ptr
    starts = ptr[0 : layout.grid[1] : per]
    ends = ptr[per::per]
    return starts, ends - starts


def default_capacity(layout: Layout, num_shards: int, capacity, fn: str, arg: str = "capacity") -> int:
    """Slots per shard: ``capacity`` (the argument named ``arg`` of ``fn``) checked
    against the fullest shard of ``layout``, or that shard's block count if None."""
    _, counts = _shard_bounds(layout, num_shards)
    concrete = not isinstance(counts, jax.core.Tracer)
    largest = int(np.max(np.asarray(counts))) if concrete and num_shards else 0
    if capacity is None:
        if not concrete:
            raise ValueError(
                f"{fn}: a traced layout needs an explicit capacity (the largest number of blocks "
                f"one shard may hold) for {layout}"
            )
        return largest
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)):
        raise TypeError(f"{fn}: {arg} must be an int, got {type(capacity).__name__} {capacity!r}")
    if concrete and capacity < largest:
        raise ValueError(
            f"{fn}: {arg}={capacity} is smaller than the {largest} blocks of the fullest of "
            f"{num_shards} column shards of {layout}"
        )
    return int(capacity)


# Mesh axis types whose shardings column_parallel_bsmm can place (see place).
_PLACEABLE = (jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit)


def place(value, mesh, spec):
    """``value`` with the sharding ``spec`` on ``mesh``.

    On Auto axes a constraint XLA honours; on Explicit axes the sharding is part of the
    type and must be changed with ``reshard`` (shard_map checks its inputs' types).
    """
    sharding = NamedSharding(mesh, spec)
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(value, sharding)
    return jax.lax.with_sharding_constraint(value, sharding)


def check_mesh(mesh, axis, batch_axis, fn: str) -> int:
    """Validates a column-parallel mesh and its axes; returns the size of ``axis``.

    ``mesh`` must be a :class:`jax.sharding.Mesh` with ``axis`` (and ``batch_axis``,
    if not None, a different axis); both must be ``AxisType.Auto`` axes (the default
    of ``Mesh(devices, names)``) or ``Explicit`` ones (``jax.make_mesh``'s default),
    not Manual. Raises TypeError / ValueError naming ``fn``.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"{fn}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names)
    types = dict(zip(names, getattr(mesh, "axis_types", None) or ()))
    for name, value in (("axis", axis), ("batch_axis", batch_axis)):
        if value is None and name == "batch_axis":
            continue
        if value not in names:
            raise ValueError(f"{fn}: {name}={value!r} is not an axis of the mesh {dict(mesh.shape)}")
        kind = types.get(value)
        if kind is not None and kind not in _PLACEABLE:
            raise ValueError(
                f"{fn}: mesh axis {name}={value!r} is {kind}; column parallelism needs Auto or Explicit "
                f"mesh axes, got mesh {mesh}"
            )
    if batch_axis is not None and batch_axis == axis:
        raise ValueError(f"{fn}: batch_axis must differ from axis, got both {axis!r}")
    return int(mesh.shape[axis])


def split_columns(layout: Layout, num_shards: int, *, capacity: int | None = None) -> Layout:
    """The layouts of ``num_shards`` groups of consecutive output block columns, stacked.

    Args:
      layout: a :class:`~jax_blocksparse.Layout` of grid [CB, KB].
      num_shards: how many shards; must divide KB.
      capacity: slots per shard; default the largest shard's block count (needs a
        concrete layout). Must be given for a traced layout.

    Returns:
      A Layout of grid [CB, KB / num_shards] and the common capacity whose tables
      carry a leading axis [num_shards] (``jax.tree.map(lambda t: t[i], result)`` is
      shard ``i``'s layout). Split it with ``shard_map`` (``in_specs=P(axis)``).
    """
    layout = check_layout(layout)
    num_shards = _check_num_shards(layout, num_shards, "split_columns")
    capacity = default_capacity(layout, num_shards, capacity, "split_columns")
    cb, kb = layout.grid
    per = kb // num_shards
    if all(not isinstance(t, jax.core.Tracer) for t in layout.tables):
        # numpy throughout: layout.mask (jnp) would be staged, not computed, inside a trace.
        t = layout.tables
        nnz = int(np.asarray(t.col_ptr)[-1])
        mask = np.zeros((cb, kb), bool)
        mask[np.asarray(t.block_rows)[:nnz], np.asarray(t.block_cols)[:nnz]] = True
        # [CB, n, KB / n] -> [n, CB, KB / n]: shard i's columns.
        masks = mask.reshape(cb, num_shards, per).transpose(1, 0, 2)
        shards = [Layout.from_mask(m, layout.block_size, capacity) for m in masks]
        tables = LayoutTables(*(np.stack(t) for t in zip(*(s.tables for s in shards))))
    else:
        masks = layout.mask.reshape(cb, num_shards, per).transpose(1, 0, 2)
        stacked = jax.vmap(lambda m: Layout.from_mask(m, layout.block_size, capacity))(masks)
        tables = stacked.tables
    return Layout(layout.block_size, (cb, per), capacity, tables)


def shard_blocks(w, layout: Layout, num_shards: int, *, capacity: int | None = None):
    """Splits stored blocks ``w`` [capacity, bs, bs] into per-shard blocks, stacked.

    Returns:
      [num_shards, shard_capacity, bs, bs]: shard ``i``'s blocks in the storage order of
      ``split_columns(layout, num_shards)``'s shard ``i``; padding slots are zero.
      Differentiable (a gather); :func:`unshard_blocks` is its inverse.
    """
    layout = check_layout(layout)
    num_shards = _check_num_shards(layout, num_shards, "shard_blocks")
    capacity = default_capacity(layout, num_shards, capacity, "shard_blocks")
    w = jnp.asarray(w)
    if w.shape != layout.w_shape:
        raise ValueError(f"shard_blocks: w must have shape {layout.w_shape} for {layout}, got {tuple(w.shape)}")
    starts, counts = _shard_bounds(layout, num_shards)
    local = jnp.arange(capacity)[None, :]
    slots = jnp.asarray(starts)[:, None] + local  # [n, capacity]
    valid = local < jnp.asarray(counts)[:, None]
    blocks = w.at[jnp.where(valid, slots, 0)].get(mode="fill", fill_value=0)
    return jnp.where(valid[..., None, None], blocks, jnp.zeros((), w.dtype))


def unshard_blocks(w_shards, layout: Layout):
    """The inverse of :func:`shard_blocks`: per-shard blocks back to ``layout``'s storage.

    Args:
      w_shards: [num_shards, shard_capacity, bs, bs].
      layout: the full (unsplit) layout.

    Returns:
      [layout.capacity, bs, bs]; padding slots are zero.
    """
    layout = check_layout(layout)
    w_shards = jnp.asarray(w_shards)
    bs = layout.block_size
    if w_shards.ndim != 4 or w_shards.shape[2:] != (bs, bs):
        raise ValueError(
            f"unshard_blocks: w_shards must have shape [num_shards, capacity, {bs}, {bs}] for {layout}, "
            f"got {tuple(w_shards.shape)}"
        )
    num_shards = _check_num_shards(layout, w_shards.shape[0], "unshard_blocks")
    starts, counts = _shard_bounds(layout, num_shards)
    if not isinstance(counts, jax.core.Tracer) and num_shards and int(np.max(np.asarray(counts))) > w_shards.shape[1]:
        raise ValueError(
            f"unshard_blocks: shard capacity {w_shards.shape[1]} is smaller than the "
            f"{int(np.max(np.asarray(counts)))} blocks of the fullest shard of {layout}"
        )
    per = layout.grid[1] // num_shards
    shard = layout.tables.block_cols // per  # [capacity]
    local = jnp.arange(layout.capacity) - jnp.asarray(starts)[shard]
    w = w_shards.at[shard, local].get(mode="fill", fill_value=0)
    return jnp.where(layout.valid[:, None, None], w, jnp.zeros((), w.dtype))


def column_parallel_bsmm(
    x,
    w_shards,
    layouts: Layout,
    mesh: jax.sharding.Mesh,
    axis: str,
    *,
    batch_axis: str | None = None,
    gather_output: bool = True,
    preferred_element_type=None,
    compute_dtype=None,
    float32_dw: bool = False,
    precision=None,
    impl: str | None = None,
):
    """``x @ W`` with W's output block columns split over the mesh axis ``axis``.

    Each device multiplies x by its own shard of columns (``shard_map``); only the
    output is communicated. Gradients: the weight shards' cotangents stay on their
    devices, x's cotangent is summed over ``axis``.

    Args:
      x: [..., C], replicated over ``axis`` (split over ``batch_axis`` along its first
        dim if given: data and model parallel at once).
      w_shards: [num_shards, capacity, bs, bs] from :func:`shard_blocks`;
        ``num_shards`` must equal the size of ``axis``.
      layouts: the stacked layouts from :func:`split_columns`.
      mesh: a :class:`jax.sharding.Mesh` with ``axis`` (and ``batch_axis``).
      axis: the mesh axis the columns are split over.
      batch_axis: optional mesh axis x's first dim is split over.
      gather_output: True: return [..., K] replicated over ``axis`` (an all-gather of
        the column blocks). False: return [..., K] whose last dim stays split over
        ``axis`` (no communication), e.g. to feed a row-parallel layer.
      preferred_element_type, compute_dtype, float32_dw, precision, impl: as in
        :func:`jax_blocksparse.bsmm`, applied on every device (``float32_dw`` needs
        float32 ``w_shards``; ``precision`` and ``impl`` also rule the gradient's products).

    Returns:
      [..., K] equal to ``bsmm(x, unshard_blocks(w_shards, full_layout), full_layout)``.
    """
    layouts = check_layout(layouts, name="layouts")
    num_shards = check_mesh(mesh, axis, batch_axis, "column_parallel_bsmm")
    w_shards = jnp.asarray(w_shards)
    expected = (num_shards,) + layouts.w_shape
    if w_shards.shape != expected or layouts.tables.col_ptr.shape != (num_shards, layouts.grid[1] + 1):
        raise ValueError(
            f"column_parallel_bsmm: need w_shards {expected} and layouts stacked over {num_shards} shards "
            f"(mesh axis {axis!r}) of grid {layouts.grid}, block_size {layouts.block_size}, capacity "
            f"{layouts.capacity}, got w_shards {tuple(w_shards.shape)} and tables "
            f"col_ptr {tuple(layouts.tables.col_ptr.shape)}"
        )
    x = jnp.asarray(x)
    c = layouts.shape[0]
    if x.ndim < 1 or x.shape[-1] != c or (batch_axis is not None and x.ndim < 2):
        raise ValueError(
            f"column_parallel_bsmm: x must have shape [..., C={c}]"
            f"{' with a leading batch dim' if batch_axis else ''}, got {tuple(x.shape)}"
        )
    lead = (batch_axis,) + (None,) * (x.ndim - 2) if batch_axis is not None else (None,) * (x.ndim - 1)
    x_spec = P(*lead, None)

    def body(x, w, tables):
        local = Layout(layouts.block_size, layouts.grid, layouts.capacity, LayoutTables(*(t[0] for t in tables)))
        return bsmm(
            x,
            w[0],
            local,
            preferred_element_type=preferred_element_type,
            compute_dtype=compute_dtype,
            float32_dw=float32_dw,
            precision=precision,
            impl=impl,
        )

    table_specs = LayoutTables(*([P(axis)] * len(layouts.tables)))
    in_specs = (x_spec, P(axis), table_specs)
    operands = (x, w_shards, layouts.tables)
    operands = jax.tree.map(
        lambda v, spec: place(v, mesh, spec), operands, in_specs, is_leaf=lambda v: isinstance(v, P)
    )
    fn = shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=P(*lead, axis))
    y = fn(*operands)  # [..., K], the last dim split over `axis`
    if gather_output:
        y = place(y, mesh, P(*lead, None))
    return y
