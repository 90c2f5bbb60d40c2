"""The column-parallel layers' core: one validated split of the output block columns.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.ColumnParallelDense` and
:class:`jax_blocksparse.nnx.ColumnParallelLinear` check their mesh with
:func:`column_split` and get a :class:`ColumnSplit`: the split layouts, the sharded
init (the unsplit layer's values, placed shard by shard), the conversions from and to
the unsplit kernel, and the product (:func:`jax_blocksparse.sharding.column_parallel_bsmm`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
from jax.sharding import PartitionSpec as P

from jax_blocksparse import sharding
from jax_blocksparse.layers.common import (
    StaticMask,
    add_bias,
    init_kernel,
    layout_for,
    promote,
)
from jax_blocksparse.layout import Layout

__all__ = ["ColumnSplit", "column_split", "shard_layouts_for"]


@functools.lru_cache(maxsize=256)
def shard_layouts_for(mask: StaticMask, block_size: int, num_shards: int, shard_capacity: int) -> Layout:
    """``split_columns(layout_for(mask, block_size, None), num_shards)``, built once (numpy tables)."""
    return sharding.split_columns(layout_for(mask, block_size, None), num_shards, capacity=shard_capacity)


class ColumnSplit(NamedTuple):
    """A block mask's output block columns split over a mesh axis: layouts, init, product.

    The kernel is stored as [num_shards, shard_capacity, bs, bs] (shard ``i`` on the
    devices of ``mesh``'s ``axis`` index ``i``), :func:`jax_blocksparse.sharding.shard_blocks`
    of the [nnz, bs, bs] kernel of the unsplit layer.
    """

    mask: StaticMask
    block_size: int
    mesh: Any
    axis: Any
    batch_axis: Any
    gather_output: bool
    num_shards: int
    shard_capacity: int

    @property
    def layout(self) -> Layout:
        """The full layout (grid [CB, KB], capacity nnz): the unsplit layer's."""
        return layout_for(self.mask, self.block_size, None)

    @property
    def shard_layouts(self) -> Layout:
        """The stacked layouts of the shards (tables with a leading [num_shards] axis)."""
        return shard_layouts_for(self.mask, self.block_size, self.num_shards, self.shard_capacity)

    @property
    def kernel_spec(self) -> tuple:
        """The kernel's partition: its leading (shard) axis over ``axis``."""
        return (self.axis, None, None, None)

    def shard(self, kernel):
        """[nnz, bs, bs] (the unsplit layer's kernel) -> [num_shards, shard_capacity, bs, bs]."""
        return sharding.shard_blocks(kernel, self.layout, self.num_shards, capacity=self.shard_capacity)

    def unshard(self, kernel):
        """[num_shards, shard_capacity, bs, bs] -> [nnz, bs, bs] (the unsplit layer's kernel)."""
        return sharding.unshard_blocks(kernel, self.layout)

    def init_kernel(self, kernel_init, key, param_dtype):
        """The unsplit layer's :func:`~jax_blocksparse.layers.common.init_kernel` (same key use,
        same values), sharded and placed: shard ``i`` on the devices of ``axis`` index ``i``."""
        kernel = self.shard(init_kernel(kernel_init, key, self.layout, self.mask, param_dtype))
        return sharding.place(kernel, self.mesh, P(*self.kernel_spec))

    def apply(self, inputs, kernel, bias, dtype, float32_dw: bool, *, precision=None, impl: str | None = None):
        """``inputs @ W + bias`` for inputs checked by
        :func:`~jax_blocksparse.layers.dense.check_inputs`: promote, then ``column_parallel_bsmm``
        (with the layer's ``precision`` and ``impl``)."""
        inputs, kernel, bias, compute = promote(inputs, kernel, bias, dtype, float32_dw)
        y = sharding.column_parallel_bsmm(
            inputs,
            kernel,
            self.shard_layouts,
            self.mesh,
            self.axis,
            batch_axis=self.batch_axis,
            gather_output=self.gather_output,
            compute_dtype=compute,
            float32_dw=float32_dw,
            precision=precision,
            impl=impl,
        )
        return add_bias(y, bias)


def column_split(mask: StaticMask, block_size: int, mesh, axis, batch_axis, gather_output, shard_capacity, layer: str):
    """Validates a column-parallel layer's mesh configuration; returns a :class:`ColumnSplit`."""
    num_shards = sharding.check_mesh(mesh, axis, batch_axis, layer)
    if not isinstance(gather_output, (bool, np.bool_)):
        raise TypeError(f"{layer}: gather_output must be a bool, got {gather_output!r}")
    kb = mask.shape[1]
    if kb % num_shards:
        raise ValueError(
            f"{layer}: the size {num_shards} of mesh axis {axis!r} must divide the number of output block "
            f"columns KB={kb} (mask shape {mask.shape}, mesh {dict(mesh.shape)})"
        )
    layout = layout_for(mask, block_size, None)
    shard_capacity = sharding.default_capacity(layout, num_shards, shard_capacity, layer, arg="shard_capacity")
    return ColumnSplit(mask, block_size, mesh, axis, batch_axis, bool(gather_output), num_shards, shard_capacity)
