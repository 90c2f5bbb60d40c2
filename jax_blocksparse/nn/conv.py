"""BlockSparseConv / BlockSparseConvTranspose: ``flax.linen.Conv`` / ``ConvTranspose``
with a block-sparse kernel.

The kernel's [C, K] channel matrix is block-sparse with one block mask for every
spatial tap; only the present blocks are stored, as a [capacity, *kernel_size, bs, bs]
parameter, and only they are multiplied (:func:`jax_blocksparse.bsconv`,
:func:`jax_blocksparse.bsconv_transpose`). The dense equivalent is the HWIO kernel
``jbs.conv_to_dense(params["kernel"], layer.layout)``.

The functions below the layers are shared with the nnx layers
(:mod:`jax_blocksparse.nnx.conv`).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.linear import canonicalize_padding

from jax_blocksparse.layout import Layout
from jax_blocksparse.nn import _common
from jax_blocksparse.ops.conv import bsconv, bsconv_transpose

Array = jax.Array
Initializer = Callable[..., Array]


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
      kernel_size: the spatial shape of the kernel; an int means a 1-D kernel ``(k,)``.
      mask: the block mask, bool [C // block_size, K // block_size], static (numpy;
        stored as a hashable :class:`~jax_blocksparse.nn.StaticMask`). Inputs must have
        C channels. The same blocks are present at every spatial tap.
      block_size: the block edge, one of 8, 16, 32, 64, 128.
      strides: an int or a sequence of ``n`` ints (default 1).
      padding: ``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``, ``"CIRCULAR"``, ``"REFLECT"``,
        ``"CAUSAL"`` (1-D), an int, or a sequence of ``n`` ints or ``(low, high)``
        pairs, as in ``flax.linen.Conv``.
      input_dilation: an int or ``n`` ints (default 1); with values > 1 the padding
        must be explicit, as in ``flax.linen.Conv``.
      kernel_dilation: an int or ``n`` ints (default 1).
      use_bias: whether to add a bias (default: True).
      dtype: the dtype of the computation (default: infer from input and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      kernel_init: initializer for the stored blocks, called as
        ``kernel_init(key, (capacity, *kernel_size, bs, bs), param_dtype)``. The default
        (None) is LeCun normal with the layer's true fan-in: the average number of
        blocks per non-empty output block column, times ``block_size * prod(kernel_size)``.
      bias_init: initializer for the bias, ``bias_init(key, (features,), param_dtype)``.
      capacity: number of storage slots (default: the number of blocks in ``mask``);
        padding slots initialise to zero and do not contribute.
      float32_dw: keep the kernel's gradient in float32 when ``dtype`` is 16-bit,
        straight from the float32 accumulator of its weight-gradient product (see
        :class:`~jax_blocksparse.nn.BlockSparseDense`). Needs ``param_dtype`` float32.
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

    def __post_init__(self):
        self.mask = _common.StaticMask(self.mask)
        self.float32_dw = _common.check_float32_dw(self.float32_dw, self.param_dtype, type(self).__name__)
        self.kernel_size = kernel_size_tuple(self.kernel_size, type(self).__name__)
        self.block_size = _common.check_config(
            self.mask, self.block_size, self.capacity, None, self.features, type(self).__name__
        )
        self.strides, self.input_dilation, self.kernel_dilation, self.padding = (
            hashable(v) for v in (self.strides, self.input_dilation, self.kernel_dilation, self.padding)
        )
        super().__post_init__()

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _common.layout_for(self.mask, self.block_size, self.capacity)

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
        check_conv_inputs(inputs, layout.shape[0], len(self.kernel_size), type(self).__name__, layout)
        kernel = self.param(
            "kernel",
            lambda key: init_conv_kernel(
                self.kernel_init, key, layout, self.mask, self.kernel_size, self.param_dtype
            ),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return conv_apply(
            inputs, kernel, bias, layout, self.kernel_size, self.strides, self.padding,
            self.input_dilation, self.kernel_dilation, self.dtype, self.float32_dw,
        )


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
      kernel_size: the spatial shape of the kernel; an int means ``(k,)``.
      mask: the block mask, static: [C // bs, features // bs], or
        [features // bs, C // bs] with ``transpose_kernel=True``.
      block_size: the block edge, one of 8, 16, 32, 64, 128.
      strides: the fractional strides, an int or ``n`` ints (default 1).
      padding: ``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, an int, or ``n`` ints or
        ``(low, high)`` pairs, as in ``flax.linen.ConvTranspose`` (strings name the
        forward conv's padding; pairs pad the stride-dilated input).
      kernel_dilation: an int or ``n`` ints (default 1).
      use_bias, dtype, param_dtype, bias_init, capacity, float32_dw: as in
        :class:`BlockSparseConv`.
      kernel_init: as in :class:`BlockSparseConv`; the default's fan-in counts the
        blocks that feed an output channel (per block column of the mask, or per
        block row with ``transpose_kernel=True``).
      transpose_kernel: flip the kernel's spatial axes and swap its channel axes, as
        ``lax.conv_transpose`` (the layer is then the input gradient of a
        :class:`BlockSparseConv` with the same kernel).
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

    def __post_init__(self):
        self.mask = _common.StaticMask(self.mask)
        self.float32_dw = _common.check_float32_dw(self.float32_dw, self.param_dtype, type(self).__name__)
        self.kernel_size = kernel_size_tuple(self.kernel_size, type(self).__name__)
        self.block_size = check_transpose_config(
            self.mask, self.block_size, self.capacity, None, self.features, self.transpose_kernel,
            type(self).__name__,
        )
        self.strides, self.kernel_dilation, self.padding = (
            hashable(v) for v in (self.strides, self.kernel_dilation, self.padding)
        )
        super().__post_init__()

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.conv_to_dense``)."""
        return _common.layout_for(self.mask, self.block_size, self.capacity)

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
        check_conv_inputs(inputs, channels, len(self.kernel_size), type(self).__name__, layout)
        kernel = self.param(
            "kernel",
            lambda key: init_conv_kernel(
                self.kernel_init, key, layout, self.mask, self.kernel_size, self.param_dtype,
                fan_in_rows=self.transpose_kernel,
            ),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        return conv_transpose_apply(
            inputs, kernel, bias, layout, self.kernel_size, self.strides, self.padding,
            self.kernel_dilation, self.transpose_kernel, self.dtype, self.float32_dw,
        )


# ---------------------------------------------------------------------------------
# Shared with the nnx layers
# ---------------------------------------------------------------------------------


def hashable(value):
    """Lists (of lists) as tuples, so that a layer stays hashable (a static jit argument)."""
    if isinstance(value, (list, tuple)):
        return tuple(hashable(v) for v in value)
    return value


def kernel_size_tuple(kernel_size, layer: str) -> tuple[int, ...]:
    """``kernel_size`` as a tuple of positive ints; an int means a 1-D kernel."""
    if isinstance(kernel_size, (int, np.integer)) and not isinstance(kernel_size, bool):
        kernel_size = (kernel_size,)
    try:
        kernel_size = tuple(kernel_size)
    except TypeError:
        raise TypeError(f"{layer}: kernel_size must be an int or a sequence of ints, got {kernel_size!r}") from None
    bad = [k for k in kernel_size if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1]
    if not kernel_size or bad:
        raise ValueError(f"{layer}: kernel_size must be one or more ints >= 1, got {kernel_size!r}")
    return tuple(int(k) for k in kernel_size)


def check_transpose_config(mask, block_size, capacity, in_features, features, transpose_kernel, layer):
    """Like ``_common.check_config`` for a transposed conv; mask rows are outputs if transposed."""
    if not transpose_kernel:
        return _common.check_config(mask, block_size, capacity, in_features, features, layer)
    block_size = _common.check_config(mask, block_size, capacity, None, mask.shape[1] * block_size, layer)
    cb, kb = mask.shape
    if features != cb * block_size:
        raise ValueError(
            f"{layer}: output features ({features}) must equal mask.shape[0] * block_size = {cb} * "
            f"{block_size} = {cb * block_size} with transpose_kernel=True (mask shape {mask.shape})"
        )
    if in_features is not None and in_features != kb * block_size:
        raise ValueError(
            f"{layer}: in_features ({in_features}) must equal mask.shape[1] * block_size = {kb} * "
            f"{block_size} = {kb * block_size} with transpose_kernel=True (mask shape {mask.shape})"
        )
    return block_size


def check_conv_inputs(inputs, channels: int, num_spatial: int, layer: str, layout: Layout):
    """Raises a ValueError naming the shapes unless inputs is [*batch, *spatial, channels]."""
    shape = tuple(jnp.shape(inputs))
    if len(shape) < num_spatial + 1 or shape[-1] != channels:
        raise ValueError(
            f"{layer}: inputs must have shape [*batch_dims, *spatial ({num_spatial} dims), {channels}] "
            f"(mask {layout.grid} x block_size {layout.block_size} -> channels {layout.shape}), "
            f"got inputs of shape {shape}"
        )


def init_conv_kernel(kernel_init, key, layout: Layout, mask, kernel_size, param_dtype, *, fan_in_rows=False):
    """Initialises a [capacity, *kernel_size, bs, bs] kernel; padding slots are zero.

    ``kernel_init=None`` is LeCun normal (truncated) with the true fan-in: the
    average number of blocks per non-empty output block column (block row if
    ``fan_in_rows``), times ``bs * prod(kernel_size)``. Otherwise ``kernel_init`` is
    called as ``kernel_init(key, (capacity, *kernel_size, bs, bs), param_dtype)``.
    """
    bs, taps = layout.block_size, math.prod(kernel_size)
    shape = (layout.capacity, *kernel_size, bs, bs)
    if kernel_init is None:
        fan_mask = _common.StaticMask(mask.array.T) if fan_in_rows else mask
        blocks = _common.fan_in(fan_mask, bs) / bs
        # variance_scaling(1, "fan_in", "truncated_normal") with the true fan-in, drawn as
        # a flat vector (same distribution; XLA compiles the random bits of a rank-5
        # array many times slower than those of a vector).
        stddev = math.sqrt(1.0 / (blocks * taps * bs)) / 0.87962566103423978
        flat = jax.random.truncated_normal(key, -2.0, 2.0, (math.prod(shape),), param_dtype)
        kernel = (flat * jnp.asarray(stddev, param_dtype)).reshape(shape)
    else:
        kernel = kernel_init(key, shape, param_dtype)
    if tuple(kernel.shape) != shape:
        raise ValueError(f"kernel_init returned shape {tuple(kernel.shape)}, expected {shape}")
    if layout.capacity > mask.nnz:
        valid = layout.valid.reshape(-1, *(1,) * (kernel.ndim - 1))
        kernel = jnp.where(valid, kernel, jnp.zeros((), kernel.dtype))
    return kernel


def _broadcast(value, n: int) -> tuple[int, ...]:
    if value is None:
        value = 1
    if isinstance(value, (int, np.integer)):
        return (int(value),) * n
    return tuple(value)


def _flatten_batch(inputs, num_spatial: int):
    """[*batch, *spatial, C] -> ([B, *spatial, C], batch shape or None if already one dim)."""
    num_batch = inputs.ndim - (num_spatial + 1)
    if num_batch == 1:
        return inputs, None
    batch_shape = inputs.shape[:num_batch]
    return jnp.reshape(inputs, (-1,) + inputs.shape[num_batch:]), batch_shape


def _finish(y, bias, batch_shape):
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if batch_shape is not None:
        y = jnp.reshape(y, batch_shape + y.shape[1:])
    return y


def conv_apply(inputs, kernel, bias, layout, kernel_size, strides, padding, input_dilation, kernel_dilation, dtype,
               float32_dw=False):
    """The forward pass of BlockSparseConv (linen and nnx), as ``flax.linen.Conv``."""
    n = len(kernel_size)
    inputs, batch_shape = _flatten_batch(inputs, n)
    strides, input_dilation, kernel_dilation = (_broadcast(v, n) for v in (strides, input_dilation, kernel_dilation))
    padding_lax = canonicalize_padding(padding, n)
    if padding_lax in ("CIRCULAR", "REFLECT"):
        dilated = [(k - 1) * d + 1 for k, d in zip(kernel_size, kernel_dilation)]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        inputs = jnp.pad(inputs, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding_lax])
        padding_lax = "VALID"
    elif padding_lax == "CAUSAL":
        if n != 1:
            raise ValueError(f"CAUSAL padding is only implemented for 1-D convolutions, got kernel_size {kernel_size}")
        inputs = jnp.pad(inputs, [(0, 0), (kernel_dilation[0] * (kernel_size[0] - 1), 0), (0, 0)])
        padding_lax = "VALID"
    inputs, kernel, bias, compute = _common.promote(inputs, kernel, bias, dtype, float32_dw)
    y = bsconv(
        inputs, kernel, layout, strides=strides, padding=padding_lax, dilation=kernel_dilation,
        input_dilation=input_dilation, compute_dtype=compute, float32_dw=float32_dw,
    )
    return _finish(y, bias, batch_shape)


def conv_transpose_apply(inputs, kernel, bias, layout, kernel_size, strides, padding, kernel_dilation,
                         transpose_kernel, dtype, float32_dw=False):
    """The forward pass of BlockSparseConvTranspose (linen and nnx), as ``flax.linen.ConvTranspose``."""
    n = len(kernel_size)
    inputs, batch_shape = _flatten_batch(inputs, n)
    strides, kernel_dilation = _broadcast(strides, n), _broadcast(kernel_dilation, n)
    padding_lax = canonicalize_padding(padding, n)
    if padding_lax == "CIRCULAR":
        padding_lax = "VALID"
    inputs, kernel, bias, compute = _common.promote(inputs, kernel, bias, dtype, float32_dw)
    y = bsconv_transpose(
        inputs, kernel, layout, strides=strides, padding=padding_lax, dilation=kernel_dilation,
        transpose_kernel=bool(transpose_kernel), compute_dtype=compute, float32_dw=float32_dw,
    )
    if padding == "CIRCULAR":
        y = _wrap_circular(y, inputs.shape[1:-1], strides, transpose_kernel)
    return _finish(y, bias, batch_shape)


def _wrap_circular(y, spatial, strides, transpose_kernel):
    """flax.linen.ConvTranspose's periodic wrap of a VALID result to ``spatial * strides``."""
    periods = [size * s for size, s in zip(spatial, strides)]
    diffs = [-(y_dim - p) % (2 * p) for y_dim, p in zip(y.shape[1:-1], periods)]
    if transpose_kernel:
        pads = [(d // 2, (d + 1) // 2) for d in diffs]
    else:
        pads = [((d + 1) // 2, d // 2) for d in diffs]
    y = jnp.pad(y, [(0, 0)] + pads + [(0, 0)])
    for i in range(1, y.ndim - 1):
        y = y.reshape(y.shape[:i] + (-1, periods[i - 1]) + y.shape[i + 1 :]).sum(axis=i)
    return y

