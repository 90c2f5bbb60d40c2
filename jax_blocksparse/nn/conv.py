"""BlockSparseConv / BlockSparseConvTranspose: ``flax.linen.Conv`` / ``ConvTranspose``
with a block-sparse kernel.

The kernel's [C, K] channel matrix is block-sparse with one block mask for every
spatial tap; only the present blocks are stored, as a [capacity, *kernel_size, bs, bs]
parameter, and only they are multiplied (:func:`jax_blocksparse.bsconv`,
:func:`jax_blocksparse.bsconv_transpose`). The dense equivalent is the HWIO kernel
``jbs.conv_to_dense(params["kernel"], layer.layout)``.

The layers declare their parameters; the configuration, the init and the forward
passes are :mod:`jax_blocksparse.layers.conv` (shared with :mod:`jax_blocksparse.nnx.conv`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import conv as _core
from jax_blocksparse.layers.common import check_options
from jax_blocksparse.layout import Layout

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class BlockSparseConv(nn.Module):
    """A convolution whose kernel mixes channels through a block-sparse matrix.

    Equal to ``flax.linen.Conv(features, kernel_size, ...)`` with the HWIO kernel
    ``jbs.conv_to_dense(params["kernel"], layer.layout)``: [*kernel_size, C, K], zero
    outside the blocks of ``mask`` at every tap.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.random((4, 4), 0.5, seed=0)          # [4, 4] blocks
        >>> layer = jbs.nn.BlockSparseConv(64, (3, 3), mask, block_size=16, strides=2)
        >>> params = layer.init(jax.random.key(0), jnp.ones((1, 8, 8, 64)))
        >>> params["params"]["kernel"].shape                     # (nnz, 3, 3, 16, 16)
        (8, 3, 3, 16, 16)
        >>> layer.apply(params, jnp.ones((2, 8, 8, 64))).shape
        (2, 4, 4, 64)
        >>> W = jbs.conv_to_dense(params["params"]["kernel"], layer.layout)  # [3, 3, 64, 64]

    Attributes:
      features: the number of output channels K; must be ``mask.shape[1] * block_size``.
      {kernel_size, conv.mask, block_size, strides, padding, input_dilation}
      {kernel_dilation, use_bias, dtype, param_dtype, conv.kernel_init, bias_init, capacity}
      {float32_dw, precision, impl}
    """

    features: int
    kernel_size: int | Sequence[int]
    mask: Any
    block_size: int
    strides: None | int | Sequence[int] = 1
    padding: Any = "SAME"
    input_dilation: None | int | Sequence[int] = 1
    kernel_dilation: None | int | Sequence[int] = 1
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    capacity: int | None = None
    float32_dw: bool = False
    precision: PrecisionLike = None
    impl: str | None = None

    def __post_init__(self):
        cfg = _core.check_conv(
            self.mask,
            self.block_size,
            self.kernel_size,
            self.capacity,
            None,
            self.features,
            strides=self.strides,
            padding=self.padding,
            input_dilation=self.input_dilation,
            kernel_dilation=self.kernel_dilation,
            float32_dw=self.float32_dw,
            param_dtype=self.param_dtype,
            layer=type(self).__name__,
        )
        self.mask, self.block_size, self.kernel_size, self.strides, self.padding = cfg[:5]
        self.input_dilation, self.kernel_dilation, self.float32_dw = cfg[5:]
        self.precision, self.impl = check_options(self.precision, self.impl, type(self).__name__)
        super().__post_init__()

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _core.layout_for(self.mask, self.block_size, self.capacity)

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the block-sparse convolution.

        Args:
          inputs: [*batch_dims, *spatial, C] (channels last; any number of batch dims,
            none for a single example), ``n = len(kernel_size)`` spatial dims.

        Returns:
          [*batch_dims, *out_spatial, features].
        """
        layout = self.layout
        _core.check_conv_inputs(inputs, layout.shape[0], len(self.kernel_size), type(self).__name__, layout)
        kernel = self.param(
            "kernel",
            lambda key: _core.init_conv_kernel(
                self.kernel_init, key, layout, self.mask, self.kernel_size, self.param_dtype
            ),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return _core.apply_layer(self, inputs, kernel, bias, layout)


@attribute_docs.fill
class BlockSparseConvTranspose(nn.Module):
    """A transposed convolution whose kernel mixes channels through a block-sparse matrix.

    Equal to ``flax.linen.ConvTranspose(features, kernel_size, ...)`` (and so to
    ``lax.conv_transpose``) with the kernel ``jbs.conv_to_dense(params["kernel"],
    layer.layout)``: [*kernel_size, C, features], or [*kernel_size, features, C] with
    ``transpose_kernel=True``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.random((4, 2), 0.5, seed=0)        # 64 -> 32 channels
        >>> layer = jbs.nn.BlockSparseConvTranspose(32, (3, 3), mask, block_size=16, strides=2)
        >>> params = layer.init(jax.random.key(0), jnp.ones((1, 4, 4, 64)))
        >>> layer.apply(params, jnp.ones((2, 4, 4, 64))).shape
        (2, 8, 8, 32)

    Attributes:
      features: the number of output channels.
      {kernel_size, conv_transpose.mask, block_size, conv_transpose.strides}
      {conv_transpose.padding, kernel_dilation, conv_transpose.kernel_init}
      {transpose_kernel}
      use_bias, dtype, param_dtype, bias_init, capacity, float32_dw: as in
        :class:`BlockSparseConv`.
      precision, impl: as in :class:`BlockSparseConv`.
    """

    features: int
    kernel_size: int | Sequence[int]
    mask: Any
    block_size: int
    strides: None | int | Sequence[int] = 1
    padding: Any = "SAME"
    kernel_dilation: None | int | Sequence[int] = 1
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    transpose_kernel: bool = False
    capacity: int | None = None
    float32_dw: bool = False
    precision: PrecisionLike = None
    impl: str | None = None

    def __post_init__(self):
        cfg = _core.check_conv(
            self.mask,
            self.block_size,
            self.kernel_size,
            self.capacity,
            None,
            self.features,
            strides=self.strides,
            padding=self.padding,
            input_dilation=1,
            kernel_dilation=self.kernel_dilation,
            float32_dw=self.float32_dw,
            param_dtype=self.param_dtype,
            layer=type(self).__name__,
            transpose_kernel=self.transpose_kernel,
        )
        self.mask, self.block_size, self.kernel_size, self.strides, self.padding = cfg[:5]
        self.kernel_dilation, self.float32_dw = cfg.kernel_dilation, cfg.float32_dw
        self.precision, self.impl = check_options(self.precision, self.impl, type(self).__name__)
        super().__post_init__()

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _core.layout_for(self.mask, self.block_size, self.capacity)

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the block-sparse transposed convolution.

        Args:
          inputs: [*batch_dims, *spatial, C], ``n = len(kernel_size)`` spatial dims.

        Returns:
          [*batch_dims, *out_spatial, features].
        """
        layout = self.layout
        channels = layout.shape[1] if self.transpose_kernel else layout.shape[0]
        _core.check_conv_inputs(inputs, channels, len(self.kernel_size), type(self).__name__, layout)
        kernel = self.param(
            "kernel",
            lambda key: _core.init_conv_kernel(
                self.kernel_init,
                key,
                layout,
                self.mask,
                self.kernel_size,
                self.param_dtype,
                fan_in_rows=self.transpose_kernel,
            ),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return _core.apply_layer(self, inputs, kernel, bias, layout)
