"""ColumnParallelDense: BlockSparseDense with its output block columns split over a mesh axis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import dense as _dense
from jax_blocksparse.layers import parallel as _core
from jax_blocksparse.layout import Layout

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class ColumnParallelDense(nn.Module):
    """:class:`~jax_blocksparse.nn.BlockSparseDense` split by output block columns (model parallel).

    The same map, ``inputs @ jbs.to_dense(<unsplit kernel>, layer.layout) + bias``,
    with the kernel's output block columns split over the mesh axis ``axis``:
    ``n = mesh.shape[axis]`` shards of ``KB / n`` consecutive block columns each, shard
    ``i`` stored (only) on the devices at index ``i`` of ``axis``. Each device
    multiplies the inputs by its own columns
    (:func:`jax_blocksparse.sharding.column_parallel_bsmm`); only the output is
    communicated, and only if ``gather_output``.

    Parameters:

    * ``kernel``: [n, shard_capacity, bs, bs] in ``param_dtype``, partitioned
      ``P(axis, None, None, None)``: ``jbs.sharding.shard_blocks(k, layer.layout, n,
      capacity=shard_capacity)`` of the [nnz, bs, bs] kernel ``k`` of the equivalent
      ``BlockSparseDense(features, mask, block_size)`` (default capacity). With the same
      key, ``init`` gives exactly that layer's kernel, sharded (same initializer, same
      rng use), and the same bias.
    * ``bias``: [features] in ``param_dtype``, replicated (``P(None)``) whatever
      ``gather_output``: with ``gather_output=False`` each device adds its slice.

    Both carry flax partitioning metadata (``nn.with_partitioning`` with ``mesh``), so
    ``init`` returns them boxed (``nn.Partitioned``; ``nn.unbox`` gives the arrays)
    and ``nn.get_sharding`` places them. Convert parameters with the unsplit layer
    with :meth:`shard_kernel` / :meth:`unshard_kernel` (the bias is the same array).

    Example (8 devices, e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
    on CPU)::

        >>> import jax, jax.numpy as jnp, numpy as np
        >>> import flax.linen as nn
        >>> from jax.sharding import Mesh
        >>> import jax_blocksparse as jbs
        >>> mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 4), ("batch", "model"))
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)     # [8, 8] blocks
        >>> layer = jbs.nn.ColumnParallelDense(128, mask, 16, mesh, "model", batch_axis="batch")
        >>> x = jnp.ones((4, 128))
        >>> abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
        >>> tuple(nn.get_partition_spec(abstract)["params"]["kernel"])
        ('model', None, None, None)
        >>> init = jax.jit(layer.init, out_shardings=nn.get_sharding(abstract, mesh))
        >>> variables = init(jax.random.key(0), x)                # each device: its shard
        >>> kernel = nn.unbox(variables)["params"]["kernel"]
        >>> kernel.shape == (4, layer.shard_layouts.capacity, 16, 16)
        True
        >>> y = jax.jit(layer.apply)(variables, x)                # [4, 128]
        >>> dense = jbs.nn.BlockSparseDense(128, mask, 16)        # the same map, one device
        >>> params = {"kernel": layer.unshard_kernel(kernel), "bias": nn.unbox(variables)["params"]["bias"]}
        >>> bool(jnp.allclose(dense.apply({"params": params}, x), y, atol=1e-5))
        True

    Attributes:
      features: the number of output features K; must be ``mask.shape[1] * block_size``.
      {parallel.mask, block_size, mesh, axis, batch_axis, gather_output, use_bias, dtype}
      {param_dtype, parallel.kernel_init, bias_init, parallel.float32_dw, shard_capacity}
      {parallel.precision, impl}
    """

    features: int
    mask: Any
    block_size: int
    mesh: jax.sharding.Mesh
    axis: str
    batch_axis: str | None = None
    gather_output: bool = True
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    float32_dw: bool = False
    shard_capacity: int | None = None
    precision: PrecisionLike = None
    impl: str | None = None

    def __post_init__(self):
        self.mask, self.block_size, self.float32_dw = _dense.check_dense(
            self.mask,
            self.block_size,
            None,
            None,
            self.features,
            self.float32_dw,
            self.param_dtype,
            type(self).__name__,
        )
        self.precision, self.impl = _common.check_options(self.precision, self.impl, type(self).__name__)
        self._split()  # validates mesh, axes, gather_output and shard_capacity
        super().__post_init__()

    def _split(self) -> _core.ColumnSplit:
        return _core.column_split(
            self.mask,
            self.block_size,
            self.mesh,
            self.axis,
            self.batch_axis,
            self.gather_output,
            self.shard_capacity,
            type(self).__name__,
        )

    @property
    def layout(self) -> Layout:
        """The full :class:`~jax_blocksparse.Layout` (grid [CB, KB], capacity nnz):
        the unsplit ``BlockSparseDense``'s, for ``jbs.to_dense(layer.unshard_kernel(k), layer.layout)``."""
        return self._split().layout

    @property
    def shard_layouts(self) -> Layout:
        """The shards' layouts, stacked: grid [CB, KB / n], capacity ``shard_capacity``,
        tables with a leading [n] axis (``jbs.sharding.split_columns(layer.layout, n)``)."""
        return self._split().shard_layouts

    @nn.nowrap
    def shard_kernel(self, kernel: Array) -> Array:
        """A ``BlockSparseDense`` kernel [nnz, bs, bs] -> this layer's [n, shard_capacity, bs, bs]."""
        return self._split().shard(kernel)

    @nn.nowrap
    def unshard_kernel(self, kernel: Array) -> Array:
        """This layer's kernel [n, shard_capacity, bs, bs] -> the ``BlockSparseDense`` kernel [nnz, bs, bs]."""
        return self._split().unshard(kernel)

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the block-sparse linear map to the last axis of ``inputs``.

        Args:
          inputs: [..., C] with ``C = mask.shape[0] * block_size`` (a leading batch dim
            split over ``batch_axis`` if given).

        Returns:
          [..., features] in the compute dtype; its last dim split over ``axis`` if
          not ``gather_output``.
        """
        split = self._split()
        _dense.check_inputs(inputs, split.layout, type(self).__name__)
        kernel = self.param(
            "kernel",
            nn.with_partitioning(
                lambda key: split.init_kernel(self.kernel_init, key, self.param_dtype), split.kernel_spec, self.mesh
            ),
        )
        bias = None
        if self.use_bias:
            bias_init = nn.with_partitioning(self.bias_init, (None,), self.mesh)
            bias = self.param("bias", bias_init, (self.features,), self.param_dtype)
        return split.apply(inputs, kernel, bias, self.dtype, self.float32_dw, precision=self.precision, impl=self.impl)
