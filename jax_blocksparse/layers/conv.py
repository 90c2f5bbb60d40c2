"""The block-sparse convolution layers' core: configuration, init and forward passes.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.BlockSparseConv` /
``BlockSparseConvTranspose`` and their nnx twins declare their parameters and call
these functions. The kernel's [C, K] channel matrix is block-sparse with one block
mask for every spatial tap; only the present blocks are stored, as
[capacity, *kernel_size, bs, bs], and :func:`conv_apply` /
:func:`conv_transpose_apply` follow ``flax.linen.Conv`` / ``ConvTranspose`` for
padding, dilation and batch dims.

Example::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.layers import conv
    >>> cfg = conv.check_conv(jbs.layouts.random((4, 4), 0.5, seed=0), 16, (3, 3), None, None, 64,
    ...                       strides=2, padding="SAME", input_dilation=1, kernel_dilation=1,
    ...                       float32_dw=False, param_dtype=jnp.float32, layer="MyConv")
    >>> layout = cfg.layout(None)
    >>> kernel = conv.init_conv_kernel(None, jax.random.key(0), layout, cfg.mask, cfg.kernel_size, jnp.float32)
    >>> kernel.shape
    (8, 3, 3, 16, 16)
    >>> y = conv.conv_apply(jnp.ones((2, 8, 8, 64)), kernel, None, layout, cfg.kernel_size, cfg.strides,
    ...                     cfg.padding, cfg.input_dilation, cfg.kernel_dilation, None)
    >>> y.shape
    (2, 4, 4, 64)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layers.common import (
    StaticMask,
    add_bias,
    check_config,
    check_float32_dw,
    fan_in,
    layout_for,
    promote,
)
from jax_blocksparse.layout import Layout
from jax_blocksparse.ops.conv import bsconv, bsconv_transpose

__all__ = [
    "ConvConfig",
    "apply_layer",
    "canonicalize_padding",
    "check_conv",
    "check_conv_inputs",
    "conv_apply",
    "conv_transpose_apply",
    "hashable",
    "init_conv_kernel",
    "kernel_size_tuple",
]


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


class ConvConfig(NamedTuple):
    """A conv layer's checked static configuration (hashable: tuples, a StaticMask)."""

    mask: StaticMask
    block_size: int
    kernel_size: tuple[int, ...]
    strides: Any
    padding: Any
    input_dilation: Any
    kernel_dilation: Any
    float32_dw: bool

    def layout(self, capacity) -> Layout:
        """The kernel's (cached) layout at ``capacity`` slots (None: the mask's block count)."""
        return layout_for(self.mask, self.block_size, capacity)


def check_conv(
    mask,
    block_size,
    kernel_size,
    capacity,
    in_features,
    features,
    *,
    strides,
    padding,
    input_dilation,
    kernel_dilation,
    float32_dw,
    param_dtype,
    layer: str,
    transpose_kernel: bool = False,
) -> ConvConfig:
    """Checks a conv (or transposed conv) layer's configuration.

    ``in_features`` may be None (linen infers it); with ``transpose_kernel`` the
    mask's rows are the outputs. Sequences become tuples (the layer
    stays hashable); errors name ``layer`` and the shapes.
    """
    float32_dw = check_float32_dw(float32_dw, param_dtype, layer)
    mask = StaticMask(mask)
    kernel_size = kernel_size_tuple(kernel_size, layer)
    block_size = check_config(
        mask, block_size, capacity, in_features, features, layer, transpose=bool(transpose_kernel)
    )
    return ConvConfig(
        mask,
        block_size,
        kernel_size,
        hashable(strides),
        hashable(padding),
        hashable(input_dilation),
        hashable(kernel_dilation),
        float32_dw,
    )


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
        fan_mask = StaticMask(mask.array.T) if fan_in_rows else mask
        blocks = fan_in(fan_mask, bs) / bs
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


def canonicalize_padding(padding, rank: int):
    """A conv layer's ``padding`` as ``lax`` takes it: a string, or ``rank`` (low, high) pairs.

    Strings pass through (the layer or the op checks their names); an int pads every
    spatial dim by that much on both sides; a sequence of ``rank`` ints or pairs
    gives each dim its own. Flax's rule, written without Flax.

    Example::

        >>> from jax_blocksparse.layers.conv import canonicalize_padding
        >>> canonicalize_padding(1, 2), canonicalize_padding((1, (0, 2)), 2)
        (((1, 1), (1, 1)), ((1, 1), (0, 2)))
    """
    if isinstance(padding, str):
        return padding
    if isinstance(padding, (int, np.integer)) and not isinstance(padding, bool):
        return ((int(padding), int(padding)),) * rank
    if isinstance(padding, Sequence) and len(padding) == rank:
        pairs = []
        for p in padding:
            if isinstance(p, (int, np.integer)) and not isinstance(p, bool):
                pairs.append((int(p), int(p)))
            elif isinstance(p, Sequence) and len(p) == 2 and all(isinstance(v, (int, np.integer)) for v in p):
                pairs.append((int(p[0]), int(p[1])))
            else:
                break
        if len(pairs) == rank:
            return tuple(pairs)
    raise ValueError(
        f"padding must be a string, an int, or a sequence of {rank} ints or (low, high) pairs (one per "
        f"spatial dim), got {padding!r}"
    )


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
    y = add_bias(y, bias)
    if batch_shape is not None:
        y = jnp.reshape(y, batch_shape + y.shape[1:])
    return y


def conv_apply(
    inputs,
    kernel,
    bias,
    layout,
    kernel_size,
    strides,
    padding,
    input_dilation,
    kernel_dilation,
    dtype,
    float32_dw=False,
    *,
    precision=None,
    impl: str | None = None,
):
    """The forward pass of BlockSparseConv (linen and nnx), as ``flax.linen.Conv``.

    Args:
      inputs: [*batch_dims, *spatial, C] (checked by :func:`check_conv_inputs`).
      kernel: [capacity, *kernel_size, bs, bs]; bias: [K] or None.
      layout: the kernel's layout; the other arguments as the layer's attributes
        (``precision`` and ``impl`` go to :func:`~jax_blocksparse.bsconv`).

    Returns:
      [*batch_dims, *out_spatial, K] in the compute dtype.
    """
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
    inputs, kernel, bias, compute = promote(inputs, kernel, bias, dtype, float32_dw)
    y = bsconv(
        inputs,
        kernel,
        layout,
        strides=strides,
        padding=padding_lax,
        dilation=kernel_dilation,
        input_dilation=input_dilation,
        compute_dtype=compute,
        float32_dw=float32_dw,
        precision=precision,
        impl=impl,
    )
    return _finish(y, bias, batch_shape)


def conv_transpose_apply(
    inputs,
    kernel,
    bias,
    layout,
    kernel_size,
    strides,
    padding,
    kernel_dilation,
    transpose_kernel,
    dtype,
    float32_dw=False,
    *,
    precision=None,
    impl: str | None = None,
):
    """The forward pass of BlockSparseConvTranspose (linen and nnx), as ``flax.linen.ConvTranspose``.

    Shapes as :func:`conv_apply`; ``transpose_kernel`` flips the kernel's taps and
    swaps its channel axes; ``precision`` and ``impl`` go to
    :func:`~jax_blocksparse.bsconv_transpose`.
    """
    n = len(kernel_size)
    inputs, batch_shape = _flatten_batch(inputs, n)
    strides, kernel_dilation = _broadcast(strides, n), _broadcast(kernel_dilation, n)
    padding_lax = canonicalize_padding(padding, n)
    if padding_lax == "CIRCULAR":
        padding_lax = "VALID"
    inputs, kernel, bias, compute = promote(inputs, kernel, bias, dtype, float32_dw)
    y = bsconv_transpose(
        inputs,
        kernel,
        layout,
        strides=strides,
        padding=padding_lax,
        dilation=kernel_dilation,
        transpose_kernel=bool(transpose_kernel),
        compute_dtype=compute,
        float32_dw=float32_dw,
        precision=precision,
        impl=impl,
    )
    if padding == "CIRCULAR":
        y = _wrap_circular(y, inputs.shape[1:-1], strides, transpose_kernel)
    return _finish(y, bias, batch_shape)


def apply_layer(layer, inputs, kernel, bias, layout):
    """A conv layer's forward pass from its checked attributes.

    ``layer`` is a linen or NNX layer (or any object with the same attributes):
    ``kernel_size``, ``strides``, ``padding``, ``kernel_dilation``, ``dtype``,
    ``float32_dw``, ``precision``, ``impl``, and ``transpose_kernel`` for a transposed
    convolution (:func:`conv_transpose_apply`) or ``input_dilation`` for a plain one
    (:func:`conv_apply`). ``inputs``, ``kernel``, ``bias`` and ``layout`` as those take them.
    """
    options = dict(precision=layer.precision, impl=layer.impl)
    if hasattr(layer, "transpose_kernel"):
        return conv_transpose_apply(
            inputs,
            kernel,
            bias,
            layout,
            layer.kernel_size,
            layer.strides,
            layer.padding,
            layer.kernel_dilation,
            layer.transpose_kernel,
            layer.dtype,
            layer.float32_dw,
            **options,
        )
    return conv_apply(
        inputs,
        kernel,
        bias,
        layout,
        layer.kernel_size,
        layer.strides,
        layer.padding,
        layer.input_dilation,
        layer.kernel_dilation,
        layer.dtype,
        layer.float32_dw,
        **options,
    )


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
