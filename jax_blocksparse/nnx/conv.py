"""BlockSparseConv / BlockSparseConvTranspose: ``flax.nnx.Conv`` / ``ConvTranspose``
with a block-sparse kernel.

Same computation, parameters, defaults and initialisation as the linen layers
:class:`jax_blocksparse.nn.BlockSparseConv` and
:class:`jax_blocksparse.nn.BlockSparseConvTranspose`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import conv as _core
from jax_blocksparse.layers.common import check_options, place_output
from jax_blocksparse.layout import Layout

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class BlockSparseConv(nnx.Module):
    """A convolution whose kernel mixes channels through a block-sparse matrix.

    Equal to ``flax.nnx.Conv(in_features, out_features, kernel_size, ...)`` with the
    HWIO kernel ``jbs.conv_to_dense(layer.kernel[...], layer.layout)``:
    [*kernel_size, in_features, out_features], zero outside the blocks of ``mask`` at
    every tap. Only the present blocks are stored and multiplied.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> from jax_blocksparse.nnx import BlockSparseConv
        >>> mask = jbs.layouts.random((4, 4), 0.5, seed=0)
        >>> layer = BlockSparseConv(64, 64, (3, 3), mask, 16, strides=2, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape                                   # (nnz, 3, 3, 16, 16)
        (8, 3, 3, 16, 16)
        >>> layer(jnp.ones((2, 8, 8, 64))).shape
        (2, 4, 4, 64)

    Args:
      in_features: input channels C; must be ``mask.shape[0] * block_size``.
      out_features: output channels K; must be ``mask.shape[1] * block_size``.
      {kernel_size, conv.mask, block_size, strides, padding, input_dilation}
      {kernel_dilation, use_bias, dtype, param_dtype, conv.kernel_init, bias_init, capacity}
      {float32_dw, precision, impl}
      rngs: rng key.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        mask: Any,
        block_size: int,
        strides: None | int | Sequence[int] = 1,
        *,
        padding: Any = "SAME",
        input_dilation: None | int | Sequence[int] = 1,
        kernel_dilation: None | int | Sequence[int] = 1,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        capacity: int | None = None,
        float32_dw: bool = False,
        precision: PrecisionLike = None,
        impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = _core.check_conv(
            mask,
            block_size,
            kernel_size,
            capacity,
            in_features,
            out_features,
            strides=strides,
            padding=padding,
            input_dilation=input_dilation,
            kernel_dilation=kernel_dilation,
            float32_dw=float32_dw,
            param_dtype=param_dtype,
            layer=type(self).__name__,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.mask, self.block_size, self.kernel_size, self.strides, self.padding = cfg[:5]
        self.input_dilation, self.kernel_dilation, self.float32_dw = cfg[5:]
        self.precision, self.impl = check_options(precision, impl, type(self).__name__)
        self.capacity = capacity
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype

        layout = self.layout
        self.kernel_shape = (layout.capacity, *self.kernel_size, self.block_size, self.block_size)
        self.kernel = nnx.Param(
            _core.init_conv_kernel(kernel_init, rngs.params(), layout, self.mask, self.kernel_size, param_dtype)
        )
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _core.layout_for(self.mask, self.block_size, self.capacity)

    def __call__(self, inputs: Array, out_sharding=None) -> Array:
        """Applies the convolution to ``inputs`` [*batch_dims, *spatial, in_features].

        Takes the call arguments of ``flax.nnx.Conv`` (a drop-in replacement):
        ``out_sharding`` puts the result where ``nnx.Conv`` would (a ``PartitionSpec`` or
        ``NamedSharding`` on a mesh with explicit axes; None leaves it to the inputs)."""
        layout = self.layout
        _core.check_conv_inputs(inputs, self.in_features, len(self.kernel_size), type(self).__name__, layout)
        bias = self.bias[...] if self.bias is not None else None
        y = _core.apply_layer(self, inputs, self.kernel[...], bias, layout)
        return place_output(y, out_sharding)


@attribute_docs.fill
class BlockSparseConvTranspose(nnx.Module):
    """A transposed convolution whose kernel mixes channels through a block-sparse matrix.

    Equal to ``flax.nnx.ConvTranspose(in_features, out_features, kernel_size, ...)``
    (``lax.conv_transpose``) with the kernel ``jbs.conv_to_dense(layer.kernel[...],
    layer.layout)``: [*kernel_size, in_features, out_features], or
    [*kernel_size, out_features, in_features] with ``transpose_kernel=True``.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> from jax_blocksparse.nnx import BlockSparseConvTranspose
        >>> mask = jbs.layouts.random((4, 2), 0.5, seed=0)        # 64 -> 32 channels
        >>> layer = BlockSparseConvTranspose(64, 32, (3, 3), mask, 16, strides=2, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 4, 4, 64))).shape
        (2, 8, 8, 32)

    Args:
      in_features, out_features: channels of the input and the output.
      {kernel_size, conv_transpose.mask, block_size, conv_transpose.strides}
      {conv_transpose.padding, kernel_dilation, conv_transpose.kernel_init}
      {transpose_kernel}
      use_bias, dtype, param_dtype, bias_init, capacity, float32_dw: as in
        :class:`BlockSparseConv`.
      precision, impl: as in :class:`BlockSparseConv`.
      rngs: rng key.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int | Sequence[int],
        mask: Any,
        block_size: int,
        strides: None | int | Sequence[int] = 1,
        *,
        padding: Any = "SAME",
        kernel_dilation: None | int | Sequence[int] = 1,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        transpose_kernel: bool = False,
        capacity: int | None = None,
        float32_dw: bool = False,
        precision: PrecisionLike = None,
        impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        cfg = _core.check_conv(
            mask,
            block_size,
            kernel_size,
            capacity,
            in_features,
            out_features,
            strides=strides,
            padding=padding,
            input_dilation=1,
            kernel_dilation=kernel_dilation,
            float32_dw=float32_dw,
            param_dtype=param_dtype,
            layer=type(self).__name__,
            transpose_kernel=transpose_kernel,
        )
        self.in_features = in_features
        self.out_features = out_features
        self.mask, self.block_size, self.kernel_size, self.strides, self.padding = cfg[:5]
        self.kernel_dilation, self.float32_dw = cfg.kernel_dilation, cfg.float32_dw
        self.precision, self.impl = check_options(precision, impl, type(self).__name__)
        self.capacity = capacity
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.transpose_kernel = transpose_kernel

        layout = self.layout
        self.kernel_shape = (layout.capacity, *self.kernel_size, self.block_size, self.block_size)
        self.kernel = nnx.Param(
            _core.init_conv_kernel(
                kernel_init,
                rngs.params(),
                layout,
                self.mask,
                self.kernel_size,
                param_dtype,
                fan_in_rows=transpose_kernel,
            )
        )
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _core.layout_for(self.mask, self.block_size, self.capacity)

    def __call__(self, inputs: Array) -> Array:
        """Applies the transposed convolution to ``inputs`` [*batch_dims, *spatial, in_features]."""
        layout = self.layout
        _core.check_conv_inputs(inputs, self.in_features, len(self.kernel_size), type(self).__name__, layout)
        bias = self.bias[...] if self.bias is not None else None
        return _core.apply_layer(self, inputs, self.kernel[...], bias, layout)
