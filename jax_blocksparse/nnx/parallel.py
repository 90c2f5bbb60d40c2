"""ColumnParallelLinear: BlockSparseLinear with its output block columns split over a mesh axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import dense as _dense
from jax_blocksparse.layers import parallel as _core
from jax_blocksparse.layout import Layout

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class ColumnParallelLinear(nnx.Module):
    """:class:`~jax_blocksparse.nnx.BlockSparseLinear` split by output block columns (model parallel).

    The nnx counterpart of :class:`jax_blocksparse.nn.ColumnParallelDense`, with the
    same semantics: ``n = mesh.shape[axis]`` shards of ``KB / n`` consecutive output
    block columns, shard ``i`` on the devices at index ``i`` of ``axis``; each
    device multiplies by its own columns
    (:func:`jax_blocksparse.sharding.column_parallel_bsmm`).

    Parameters (``nnx.Param`` with sharding metadata ``out_sharding`` and ``mesh``, so
    ``nnx.get_partition_spec(nnx.state(layer))`` gives their specs; with flax's eager
    sharding, on by default, they are placed on ``mesh`` as they are created):

    * ``kernel``: [n, shard_capacity, bs, bs] in ``param_dtype``, ``out_sharding``
      ``(axis, None, None, None)``. With the same ``rngs``, it equals
      ``jbs.sharding.shard_blocks(lin.kernel[...], lin.layout, n)`` for
      ``lin = BlockSparseLinear(in_features, out_features, mask, block_size, ...)``
      (same initializer, same rng use), and the bias equals ``lin.bias``.
    * ``bias``: [out_features] in ``param_dtype``, replicated (``out_sharding``
      ``(None,)``) whatever ``gather_output``.

    :meth:`shard_kernel` / :meth:`unshard_kernel` convert kernels from / to
    ``BlockSparseLinear`` (the bias is the same array).

    Example (8 devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    on CPU)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from flax import nnx
        >>> from jax.sharding import Mesh
        >>> import jax_blocksparse as jbs
        >>> mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("batch", "model"))
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)     # [8, 8] blocks
        >>> layer = jbs.nnx.ColumnParallelLinear(128, 128, mask, 16, mesh, "model",
        ...                                      batch_axis="batch", rngs=nnx.Rngs(0))
        >>> tuple(nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value())
        ('model', None, None, None)
        >>> layer.kernel.shape == (4, layer.shard_layouts.capacity, 16, 16)
        True
        >>> y = nnx.jit(lambda m, x: m(x))(layer, jnp.ones((4, 128)))   # [4, 128]
        >>> lin = jbs.nnx.BlockSparseLinear(128, 128, mask, 16, rngs=nnx.Rngs(0))
        >>> bool(jnp.array_equal(layer.unshard_kernel(), lin.kernel[...]))
        True

    Args:
      in_features: the number of input features C; must be ``mask.shape[0] * block_size``.
      out_features: the number of output features K; must be ``mask.shape[1] * block_size``.
      {parallel.mask, block_size, mesh, axis, batch_axis, gather_output, use_bias, dtype}
      {param_dtype, parallel.kernel_init, bias_init, parallel.float32_dw, shard_capacity}
      {parallel.precision, impl}
      rngs: rng key.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mask: Any,
        block_size: int,
        mesh: jax.sharding.Mesh,
        axis: str,
        *,
        batch_axis: str | None = None,
        gather_output: bool = True,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        float32_dw: bool = False,
        shard_capacity: int | None = None,
        precision: PrecisionLike = None,
        impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        mask, block_size, self.float32_dw = _dense.check_dense(
            mask, block_size, None, in_features, out_features, float32_dw, param_dtype, name
        )
        self.precision, self.impl = _common.check_options(precision, impl, name)
        split = _core.column_split(mask, block_size, mesh, axis, batch_axis, gather_output, shard_capacity, name)
        self.in_features = in_features
        self.out_features = out_features
        self.mask = mask
        self.block_size = block_size
        self.mesh = mesh
        self.axis = axis
        self.batch_axis = batch_axis
        self.gather_output = split.gather_output
        self.shard_capacity = split.shard_capacity
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype

        kernel = split.init_kernel(kernel_init, rngs.params(), param_dtype)
        self.kernel = nnx.Param(kernel, out_sharding=split.kernel_spec, mesh=mesh)
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            bias = bias_init(rngs.params(), (out_features,), param_dtype)
            self.bias = nnx.Param(bias, out_sharding=(None,), mesh=mesh)
        else:
            self.bias = nnx.data(None)

    def _split(self) -> _core.ColumnSplit:
        return _core.ColumnSplit(
            self.mask,
            self.block_size,
            self.mesh,
            self.axis,
            self.batch_axis,
            self.gather_output,
            self.mesh.shape[self.axis],
            self.shard_capacity,
        )

    @property
    def layout(self) -> Layout:
        """The full :class:`~jax_blocksparse.Layout` (grid [CB, KB], capacity nnz): the
        unsplit ``BlockSparseLinear``'s, for ``jbs.to_dense(layer.unshard_kernel(), layer.layout)``."""
        return self._split().layout

    @property
    def shard_layouts(self) -> Layout:
        """The shards' layouts, stacked: grid [CB, KB / n], capacity ``shard_capacity``,
        tables with a leading [n] axis (``jbs.sharding.split_columns(layer.layout, n)``)."""
        return self._split().shard_layouts

    def shard_kernel(self, kernel: Array) -> Array:
        """A ``BlockSparseLinear`` kernel [nnz, bs, bs] -> this layer's [n, shard_capacity, bs, bs].

        E.g. ``layer.kernel[...] = layer.shard_kernel(lin.kernel[...])``.
        """
        return self._split().shard(kernel)

    def unshard_kernel(self, kernel: Array | None = None) -> Array:
        """This layer's kernel (default ``self.kernel``) [n, shard_capacity, bs, bs] -> the
        ``BlockSparseLinear`` kernel [nnz, bs, bs]."""
        return self._split().unshard(self.kernel[...] if kernel is None else kernel)

    def __call__(self, inputs: Array) -> Array:
        """Applies the block-sparse linear map to the last axis of ``inputs``.

        Args:
          inputs: [..., in_features] (a leading batch dim split over ``batch_axis`` if given).

        Returns:
          [..., out_features] in the compute dtype; its last dim split over ``axis``
          if not ``gather_output``.
        """
        split = self._split()
        _dense.check_inputs(inputs, split.layout, type(self).__name__)
        bias = self.bias[...] if self.bias is not None else None
        return split.apply(
            inputs, self.kernel[...], bias, self.dtype, self.float32_dw, precision=self.precision, impl=self.impl
        )
