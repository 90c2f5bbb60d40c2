"""The block-sparse dense layer's core: its checks and its forward pass.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.BlockSparseDense` and
:class:`jax_blocksparse.nnx.BlockSparseLinear` declare their parameters and call
these functions. What every layer shares (the :class:`~jax_blocksparse.layers.StaticMask`,
the cached layout, the init, the dtype rule) lives in
:mod:`jax_blocksparse.layers.common`; :func:`forward` is the whole forward pass.

Example (the layer without a framework)::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.layers import common, dense
    >>> mask, bs, dw = dense.check_dense(jbs.layouts.barabasi_albert(4, 1, seed=0), 16, None, 64, 64,
    ...                                  False, jnp.float32, "MyDense")
    >>> layout = common.layout_for(mask, bs, None)
    >>> kernel = common.init_kernel(None, jax.random.key(0), layout, mask, jnp.float32)
    >>> x = jnp.ones((2, 64))
    >>> dense.check_inputs(x, layout, "MyDense")
    >>> dense.forward(x, kernel, jnp.zeros(64), layout, dtype=None, float32_dw=dw).shape
    (2, 64)
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_blocksparse.layers.common import StaticMask, add_bias, check_config, check_float32_dw, promote
from jax_blocksparse.layout import Layout
from jax_blocksparse.ops.matmul import bsmm
from jax_blocksparse.ops.probe import linear, unwrap

__all__ = ["apply", "check_dense", "check_dynamic_layout", "check_inputs", "forward"]


def check_dense(mask, block_size, capacity, in_features, out_features, float32_dw, param_dtype, layer: str):
    """A dense layer's static configuration, checked: ``(StaticMask, block_size, float32_dw)``.

    ``in_features`` may be None (linen infers it from the inputs); every check
    raises naming ``layer`` and the shapes.
    """
    mask = StaticMask(mask)
    float32_dw = check_float32_dw(float32_dw, param_dtype, layer)
    block_size = check_config(mask, block_size, capacity, in_features, out_features, layer)
    return mask, block_size, float32_dw


def check_inputs(inputs, layout: Layout, layer: str):
    """Raises a ValueError naming the shapes if ``inputs`` is not [..., C]."""
    c, k = layout.shape
    shape = tuple(jnp.shape(inputs))
    if len(shape) < 1 or shape[-1] != c:
        raise ValueError(
            f"{layer}: inputs must have shape [..., {c}] (mask {layout.grid} x block_size "
            f"{layout.block_size} -> kernel [{c}, {k}]), got inputs of shape {shape}"
        )


def apply(
    inputs,
    kernel,
    bias,
    layout: Layout,
    compute_dtype=None,
    float32_dw: bool = False,
    *,
    precision=None,
    impl: str | None = None,
):
    """``inputs @ to_dense(kernel, layout) + bias`` for operands from :func:`promote`.

    ``precision`` and ``impl`` go to :func:`~jax_blocksparse.bsmm` (and so to its gradient).
    """
    y = bsmm(inputs, kernel, layout, compute_dtype=compute_dtype, float32_dw=float32_dw, precision=precision, impl=impl)
    return add_bias(y, bias)


def check_dynamic_layout(layout, expected: Layout, layer: str):
    """Raises if a dynamic layer's current layout does not fit its configuration.

    The current layout (a :class:`~jax_blocksparse.Layout`, or one wrapped in a
    :class:`~jax_blocksparse.ops.probe.ProbedLayout`) must have the grid, block size
    and capacity the layer was built with (those fix the kernel's shape).
    """
    layout = unwrap(layout)[0]
    if not isinstance(layout, Layout):
        raise TypeError(f"{layer}: the layout variable must hold a jax_blocksparse.Layout, got {type(layout).__name__}")
    if (layout.grid, layout.block_size, layout.capacity) != (expected.grid, expected.block_size, expected.capacity):
        raise ValueError(
            f"{layer}: the current layout {layout} does not match the layer's grid {expected.grid}, "
            f"block_size {expected.block_size} and capacity {expected.capacity}"
        )


def forward(
    inputs,
    kernel,
    bias,
    layout: Layout,
    *,
    dtype,
    float32_dw: bool,
    current=None,
    layer: str = "layer",
    precision=None,
    impl: str | None = None,
):
    """The forward pass of the block-sparse dense layer (linen and nnx).

    Args:
      inputs: [..., C], checked by :func:`check_inputs`.
      kernel: [capacity, bs, bs] in ``param_dtype``.
      bias: [K] or None.
      layout: the layer's static layout (its initial one if dynamic).
      dtype: the layer's ``dtype`` (None: promote inputs and params).
      float32_dw: the layer's checked ``float32_dw``.
      current: for a dynamic layer, the layout it holds now (a Layout or a
        :class:`~jax_blocksparse.ops.probe.ProbedLayout`); None for a static one.
      layer: the layer's name, for errors.
      precision, impl: the layer's (:func:`check_options`), for every product of
        the forward and backward pass (a dynamic layer's probe product too).

    Returns:
      [..., K] in the compute dtype.
    """
    inputs, kernel, bias, compute = promote(inputs, kernel, bias, dtype, float32_dw)
    if current is None:
        return apply(inputs, kernel, bias, layout, compute, float32_dw, precision=precision, impl=impl)
    check_dynamic_layout(current, layout, layer)
    return linear(inputs, kernel, current, bias, compute, float32_dw, precision=precision, impl=impl)
