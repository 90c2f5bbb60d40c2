"""Pieces shared by the linen and nnx block-sparse layers.

Both layers keep the block mask as a :class:`StaticMask` (hashable, compared by
value, so the layer is a valid static argument and jit cache key), build their
:class:`~jax_blocksparse.Layout` through the cached :func:`layout_for`, initialise
the kernel with :func:`init_kernel` and check inputs with :func:`check_inputs`.
The column-parallel layers share :func:`column_split` (mesh checks, split layouts,
sharded init and the product).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as nn_dtypes
from jax.sharding import PartitionSpec as P

from jax_blocksparse import sharding
from jax_blocksparse.layout import Layout, check_block_size, check_mask
from jax_blocksparse.ops.matmul import bsmm


class StaticMask:
    """A read-only, hashable block mask: bool [CB, KB].

    Equality and hashing are by shape and content, so two layers built from equal
    masks compare equal and share jit caches. ``np.asarray(mask)`` gives the bool
    array back (read-only).
    """

    __slots__ = ("_array", "_key")

    def __init__(self, mask):
        if isinstance(mask, StaticMask):
            array = mask._array
        else:
            if isinstance(mask, jax.core.Tracer):
                raise TypeError(
                    "mask must be a concrete (numpy) bool array: a layer's block mask is static, "
                    f"got a traced array of shape {tuple(mask.shape)}"
                )
            array = check_mask(np.asarray(mask))
            array = np.array(array, dtype=bool)  # a private copy
            array.flags.writeable = False
        self._array = array
        self._key = (array.shape, array.tobytes())

    @property
    def shape(self) -> tuple[int, int]:
        return self._array.shape

    @property
    def array(self) -> np.ndarray:
        """The mask as a read-only numpy bool array."""
        return self._array

    @property
    def nnz(self) -> int:
        return int(self._array.sum())

    def __array__(self, dtype=None, copy=None):
        if dtype is None and not copy:
            return self._array
        return np.array(self._array, dtype=dtype)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        if not isinstance(other, StaticMask):
            return NotImplemented
        return self._key == other._key

    def __repr__(self):
        return f"StaticMask(shape={self.shape}, nnz={self.nnz})"


@functools.lru_cache(maxsize=256)
def layout_for(mask: StaticMask, block_size: int, capacity: int | None) -> Layout:
    """The layout of ``mask``, built once per (mask, block_size, capacity).

    Its tables are numpy arrays (a concrete mask gives host tables), so caching is
    safe even when the first request comes from inside a trace.
    """
    return Layout.from_mask(mask.array, block_size, capacity)


def check_config(mask: StaticMask, block_size, capacity, in_features: int | None, out_features: int, layer: str):
    """Validates a layer's static configuration; returns the canonical block size."""
    block_size = check_block_size(block_size)
    cb, kb = mask.shape
    if out_features != kb * block_size:
        raise ValueError(
            f"{layer}: output features ({out_features}) must equal mask.shape[1] * block_size = "
            f"{kb} * {block_size} = {kb * block_size} (mask shape {mask.shape})"
        )
    if in_features is not None and in_features != cb * block_size:
        raise ValueError(
            f"{layer}: in_features ({in_features}) must equal mask.shape[0] * block_size = "
            f"{cb} * {block_size} = {cb * block_size} (mask shape {mask.shape})"
        )
    if capacity is not None and capacity < mask.nnz:
        raise ValueError(f"{layer}: capacity={capacity} is smaller than the {mask.nnz} blocks of the mask {mask.shape}")
    return block_size


def check_inputs(inputs, layout: Layout, layer: str):
    """Raises a ValueError naming the shapes if ``inputs`` is not [..., C]."""
    c, k = layout.shape
    shape = tuple(jnp.shape(inputs))
    if len(shape) < 1 or shape[-1] != c:
        raise ValueError(
            f"{layer}: inputs must have shape [..., {c}] (mask {layout.grid} x block_size "
            f"{layout.block_size} -> kernel [{c}, {k}]), got inputs of shape {shape}"
        )


def fan_in(mask: StaticMask, block_size: int) -> float:
    """The true fan-in of a block-sparse layer.

    The average number of present blocks per non-empty output block column, times
    ``block_size``: the number of inputs an average output unit sums over.
    """
    per_column = mask.array.sum(axis=0)
    nonempty = per_column[per_column > 0]
    blocks = float(nonempty.mean()) if nonempty.size else 1.0
    return blocks * block_size


def default_kernel_init(mask: StaticMask, block_size: int):
    """LeCun normal (truncated, variance 1 / fan_in) with the layer's true fan-in."""
    blocks_per_column = fan_in(mask, block_size) / block_size
    # variance_scaling with batch_axis=0 sees fan_in = block_size for [capacity, bs, bs].
    return jax.nn.initializers.variance_scaling(
        1.0 / blocks_per_column, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
    )


def init_kernel(kernel_init, key, layout: Layout, mask: StaticMask, param_dtype):
    """Initialises a [capacity, bs, bs] kernel; padding slots are set to zero.

    ``kernel_init=None`` means :func:`default_kernel_init`; otherwise it is called
    as ``kernel_init(key, (capacity, bs, bs), param_dtype)``.
    """
    if kernel_init is None:
        kernel_init = default_kernel_init(mask, layout.block_size)
    kernel = kernel_init(key, layout.w_shape, param_dtype)
    if tuple(kernel.shape) != layout.w_shape:
        raise ValueError(f"kernel_init returned shape {tuple(kernel.shape)}, expected {layout.w_shape}")
    if layout.capacity > mask.nnz:
        kernel = jnp.where(layout.valid[:, None, None], kernel, jnp.zeros((), kernel.dtype))
    return kernel


def check_float32_dw(float32_dw, param_dtype, layer: str) -> bool:
    """Validates a layer's ``float32_dw`` against its ``param_dtype``; returns it as a bool."""
    if not isinstance(float32_dw, (bool, np.bool_)):
        raise TypeError(f"{layer}: float32_dw must be a bool, got {float32_dw!r}")
    if float32_dw and np.dtype(param_dtype) != np.dtype(np.float32):
        raise ValueError(
            f"{layer}: float32_dw=True keeps the kernel gradients in float32, which needs "
            f"param_dtype float32, got param_dtype {np.dtype(param_dtype)}"
        )
    return bool(float32_dw)


def promote(inputs, kernel, bias, dtype, float32_dw: bool):
    """``flax.linen.dtypes.promote_dtype`` for a layer with a ``float32_dw`` option.

    The compute dtype is ``dtype``, else the promotion of inputs, kernel and bias
    (Flax's rule). Inputs and bias are cast to it; so is the kernel, unless
    ``float32_dw``: then it stays float32 and the product casts it (the op's
    ``compute_dtype``), so that its gradient comes out of the float32 accumulator.

    Returns ``(inputs, kernel, bias, compute_dtype)``.
    """
    compute = np.dtype(nn_dtypes.canonicalize_dtype(inputs, kernel, bias, dtype=dtype))
    inputs, bias = jnp.asarray(inputs, compute), None if bias is None else jnp.asarray(bias, compute)
    if not float32_dw:
        kernel = jnp.asarray(kernel, compute)
    return inputs, kernel, bias, compute


def apply(inputs, kernel, bias, layout: Layout, compute_dtype=None, float32_dw: bool = False):
    """``inputs @ to_dense(kernel, layout) + bias`` for operands from :func:`promote`."""
    y = bsmm(inputs, kernel, layout, compute_dtype=compute_dtype, float32_dw=float32_dw)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def check_dynamic_layout(layout, expected: Layout, layer: str):
    """Raises if a dynamic layer's current layout does not fit its configuration.

    The current layout (from the "layout" collection / variable) must be a
    :class:`~jax_blocksparse.Layout` with the grid, block size and capacity the
    layer was built with (those fix the kernel's shape).
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"{layer}: the layout variable must hold a jax_blocksparse.Layout, got {type(layout).__name__}")
    if (layout.grid, layout.block_size, layout.capacity) != (expected.grid, expected.block_size, expected.capacity):
        raise ValueError(
            f"{layer}: the current layout {layout} does not match the layer's grid {expected.grid}, "
            f"block_size {expected.block_size} and capacity {expected.capacity}"
        )


# ---------------------------------------------------------------------------------
# Column-parallel layers (jax_blocksparse.nn.ColumnParallelDense and
# jax_blocksparse.nnx.ColumnParallelLinear): one validated split, shared by both.
# ---------------------------------------------------------------------------------


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
        """The unsplit layer's :func:`init_kernel` (same key use, same values), sharded
        and placed: shard ``i`` on the devices of ``axis`` index ``i``."""
        kernel = self.shard(init_kernel(kernel_init, key, self.layout, self.mask, param_dtype))
        return sharding.place(kernel, self.mesh, P(*self.kernel_spec))

    def apply(self, inputs, kernel, bias, dtype, float32_dw: bool):
        """``inputs @ W + bias`` for inputs checked by :func:`check_inputs`: :func:`promote`,
        then ``column_parallel_bsmm``."""
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
        )
        if bias is not None:
            y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


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
