"""BlockSparseLinear: ``flax.nnx.Linear`` with a block-sparse kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import dense as _core
from jax_blocksparse.layers.general import FlatLinear, as_tuple, einsum_shape
from jax_blocksparse.layout import Layout
from jax_blocksparse.ops.probe import unwrap

Array = jax.Array
Initializer = Callable[..., Array]


class BlockLayout(nnx.Variable):
    """An nnx variable holding a :class:`~jax_blocksparse.Layout` (a dynamic layer's layout).

    Filter with it to separate layouts from params:
    ``graphdef, params, layouts, rest = nnx.split(model, nnx.Param, BlockLayout, ...)``.
    It is not an ``nnx.Param``, so ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and
    ``nnx.grad`` leave it alone.
    """


class StackedLayout(nnx.Variable):
    """An nnx variable holding the layouts of a layer stack: one
    :class:`~jax_blocksparse.Layout` whose tables carry a leading layer axis.

    :func:`jax_blocksparse.nnx.sparsify` gives it to a layer created under ``nnx.vmap``
    (kernel [layers, capacity, bs, bs]); ``nnx.scan`` slices it with the weights, so each
    step multiplies with its own layer's layout. It is not a :class:`BlockLayout`: the
    dynamic sparse training methods (:func:`~jax_blocksparse.training.nnx_update`), which
    move one layer's blocks at a time, leave a stack's blocks where they are.
    """


@attribute_docs.fill
class BlockSparseLinear(nnx.Module):
    """A linear transformation over the last axis whose kernel is block-sparse.

    Equal to ``flax.nnx.Linear(in_features, out_features)`` with the kernel
    ``jbs.to_dense(layer.kernel[...], layer.layout)``: a [C, K] matrix that is zero
    outside the blocks of ``mask``. Only the present blocks are stored and
    multiplied (with :func:`jax_blocksparse.bsmm`). Same parameters, defaults and
    initialisation as :class:`jax_blocksparse.nn.BlockSparseDense`.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> from jax_blocksparse.nnx import BlockSparseLinear
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)     # [8, 8] blocks
        >>> layer = BlockSparseLinear(128, 128, mask, 16, rngs=nnx.Rngs(0))
        >>> layer.kernel.shape == layer.layout.w_shape            # (nnz, 16, 16)
        True
        >>> layer(jnp.ones((4, 128))).shape
        (4, 128)
        >>> W = jbs.to_dense(layer.kernel[...], layer.layout)     # [128, 128]

    Args:
      in_features: the number of input features C; must be ``mask.shape[0] * block_size``.
      out_features: the number of output features K; must be ``mask.shape[1] * block_size``.
      {mask, block_size, use_bias, dtype, param_dtype, float32_dw, kernel_init, bias_init}
      {capacity}
      dynamic: if True, the layout is state: the attribute ``kernel_layout`` (a
        :class:`BlockLayout` variable holding a :class:`~jax_blocksparse.Layout` of
        fixed ``capacity``), initialised from ``mask``. Dynamic sparse training
        (:mod:`jax_blocksparse.training`, e.g. :func:`~jax_blocksparse.training.nnx_update`)
        replaces it inside ``nnx.jit`` without recompiling; ``layout`` returns it.
      {precision}
        Also a dynamic layer's dense-gradient probe.
      {impl}
      rngs: rng key.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mask: Any,
        block_size: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        capacity: int | None = None,
        dynamic: bool = False,
        float32_dw: bool = False,
        precision: PrecisionLike = None,
        impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        mask, block_size, self.float32_dw = _core.check_dense(
            mask, block_size, capacity, in_features, out_features, float32_dw, param_dtype, type(self).__name__
        )
        self.precision, self.impl = _common.check_options(precision, impl, type(self).__name__)
        self.in_features = in_features
        self.out_features = out_features
        self.mask = mask
        self.block_size = block_size
        self.capacity = capacity
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.dynamic = bool(dynamic)

        layout = _common.layout_for(mask, block_size, capacity)
        self.kernel = nnx.Param(_common.init_kernel(kernel_init, rngs.params(), layout, mask, param_dtype))
        self.bias: nnx.Param[jax.Array] | None
        if use_bias:
            self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype))
        else:
            self.bias = nnx.data(None)
        if self.dynamic:
            self.kernel_layout = BlockLayout(layout)

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.to_dense``).

        With ``dynamic=True``, the current layout (``self.kernel_layout``).
        """
        if self.dynamic:
            return unwrap(self.kernel_layout.get_value())[0]
        return _common.layout_for(self.mask, self.block_size, self.capacity)

    def __call__(self, inputs: Array, out_sharding=None) -> Array:
        """Applies the block-sparse linear map to the last axis of ``inputs``.

        Takes the call arguments of ``flax.nnx.Linear`` (a drop-in replacement).

        Args:
          inputs: [..., in_features].
          out_sharding: where the result goes on a mesh with explicit axes (a
            ``PartitionSpec`` or ``NamedSharding``), as ``nnx.Linear`` takes it; None
            leaves it to the inputs.

        Returns:
          [..., out_features].
        """
        bias = self.bias[...] if self.bias is not None else None
        return _common.place_output(self._product(inputs, bias), out_sharding)

    def _product(self, inputs: Array, bias) -> Array:
        """[..., in_features] @ the kernel + ``bias`` ([out_features] or None)."""
        layout = _common.layout_for(self.mask, self.block_size, self.capacity)
        _core.check_inputs(inputs, layout, type(self).__name__)
        current = self.kernel_layout.get_value() if self.dynamic else None
        return _core.forward(
            inputs,
            self.kernel[...],
            bias,
            layout,
            dtype=self.dtype,
            float32_dw=self.float32_dw,
            current=current,
            layer=type(self).__name__,
            precision=self.precision,
            impl=self.impl,
        )


class BlockSparseLinearGeneral(BlockSparseLinear):
    """``flax.nnx.LinearGeneral`` over the inputs' trailing axes, with a block-sparse kernel.

    The kernel [*in_features, *out_features] is the [C, K] matrix of
    :class:`BlockSparseLinear` with ``C = prod(in_features)`` and
    ``K = prod(out_features)`` (:class:`~jax_blocksparse.layers.general.FlatLinear`):
    ``mask`` is its block mask, ``kernel`` its stored blocks [capacity, bs, bs]. The
    bias keeps the shape [*out_features]. Inputs [..., *in_features] give
    [..., *out_features], as ``nnx.LinearGeneral(in_features, out_features,
    axis=(-len(in_features), ..., -1))`` does. :func:`jax_blocksparse.nnx.sparsify`
    makes one of every ``nnx.LinearGeneral`` that fits (the projections of
    ``nnx.MultiHeadAttention``).

    Example::

        >>> import numpy as np, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jax_blocksparse.nnx import BlockSparseLinearGeneral
        >>> mask = np.eye(4, dtype=bool)                          # [64 / 16, (4 * 16) / 16]
        >>> layer = BlockSparseLinearGeneral(64, (4, 16), mask, 16, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 8, 64))).shape, layer.bias.shape
        ((2, 8, 4, 16), (4, 16))

    Args:
      in_features: the contracted axes' sizes (an int or a tuple).
      out_features: the output axes' sizes (an int or a tuple).
      mask, block_size, ...: as :class:`BlockSparseLinear`, for the [C, K] matrix.
    """

    def __init__(
        self,
        in_features,
        out_features,
        mask: Any,
        block_size: int,
        *,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        **kwargs,
    ):
        flat = FlatLinear(as_tuple(in_features), as_tuple(out_features))
        # The bias is drawn in its own shape, [*out_features], not the flattened [K].
        super().__init__(
            *flat.features,
            mask,
            block_size,
            bias_init=lambda key, _, dtype: bias_init(key, flat.out_shape, dtype),
            **kwargs,
        )
        self.flat = flat
        self.in_features, self.out_features = flat.in_shape, flat.out_shape
        self.axis = tuple(range(-len(flat.in_shape), 0))

    def __call__(self, inputs: Array, out_sharding=None) -> Array:
        """[..., *in_features] -> [..., *out_features]; ``out_sharding`` as ``nnx.LinearGeneral`` takes it."""
        name = type(self).__name__
        bias = self.flat.flat_bias(self.bias[...], name) if self.bias is not None else None
        y = self._product(self.flat.flat_inputs(inputs, name), bias)
        return _common.place_output(self.flat.general_outputs(y), out_sharding)


class BlockSparseEinsum(BlockSparseLinearGeneral):
    """``flax.nnx.Einsum`` with a block-sparse kernel, for an equation that is one matrix product.

    ``einsum_str`` must read ``<batch><contracted>,<contracted><features>-><batch><features>``
    (:func:`~jax_blocksparse.layers.general.einsum_shape`), e.g. ``"btd,dnh->btnh"``;
    the layer is then a :class:`BlockSparseLinearGeneral` from the contracted axes to
    the features. ``bias_shape`` (None: no bias) must be the features' shape.

    Args:
      einsum_str: the equation.
      kernel_shape: the kernel's shape, as ``nnx.Einsum`` takes it.
      bias_shape: the bias's shape, or None.
      mask, block_size, ...: as :class:`BlockSparseLinear`, for the flattened [C, K] matrix.
    """

    def __init__(self, einsum_str: str, kernel_shape, bias_shape, mask: Any, block_size: int, **kwargs):
        flat, reason = einsum_shape(einsum_str, kernel_shape, bias_shape)
        if reason:
            raise ValueError(f"{type(self).__name__}: einsum_str {einsum_str!r} is not one matrix product: {reason}")
        super().__init__(flat.in_shape, flat.out_shape, mask, block_size, use_bias=bias_shape is not None, **kwargs)
        self.einsum_str = einsum_str.replace(" ", "")
        self.kernel_shape = flat.kernel_shape
        self.bias_shape = None if bias_shape is None else flat.out_shape

    def __call__(self, inputs: Array, einsum_str: str | None = None, out_sharding=None) -> Array:
        """``inputs`` contracted as ``einsum_str`` says (None: the layer's), which must be the
        same product; ``out_sharding`` as ``nnx.Einsum`` takes it."""
        if einsum_str is not None and einsum_shape(einsum_str, self.kernel_shape, self.bias_shape)[0] != self.flat:
            raise ValueError(
                f"{type(self).__name__}: einsum_str {einsum_str!r} is not the product {self.einsum_str!r} "
                f"the layer was built for ({self.flat})"
            )
        return super().__call__(inputs, out_sharding)
