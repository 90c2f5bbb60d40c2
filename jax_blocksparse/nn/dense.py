"""BlockSparseDense: ``flax.linen.Dense`` with a block-sparse kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import dense as _core
from jax_blocksparse.layout import Layout

#: The linen variable collection that holds the layouts of dynamic layers.
LAYOUT_COLLECTION = "layout"

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class BlockSparseDense(nn.Module):
    """A linear transformation over the last axis whose kernel is block-sparse.

    Equal to ``flax.linen.Dense(features)`` with the kernel
    ``jbs.to_dense(params["kernel"], layer.layout)``: a [C, K] matrix that is zero
    outside the blocks of ``mask``. Only the present blocks are stored and
    multiplied (with :func:`jax_blocksparse.bsmm`).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)     # [8, 8] blocks
        >>> layer = jbs.nn.BlockSparseDense(features=128, mask=mask, block_size=16)
        >>> params = layer.init(jax.random.key(0), jnp.ones((4, 128)))
        >>> params["params"]["kernel"].shape == layer.layout.w_shape  # (nnz, 16, 16)
        True
        >>> y = layer.apply(params, jnp.ones((4, 128)))
        >>> y.shape
        (4, 128)
        >>> W = jbs.to_dense(params["params"]["kernel"], layer.layout)  # [128, 128]

    Attributes:
      features: the number of output features K; must be ``mask.shape[1] * block_size``.
      {mask, block_size, use_bias, dtype, param_dtype, float32_dw, kernel_init, bias_init}
      {capacity}
      dynamic: if True, the layout is data, not configuration: it lives in the
        ``"layout"`` variable collection (``variables["layout"][...]["kernel"]``, a
        :class:`~jax_blocksparse.Layout` of fixed ``capacity``), initialised from
        ``mask``, and the layer multiplies with whatever layout it is given there.
        Dynamic sparse training (:mod:`jax_blocksparse.training`) changes it inside
        jit without recompiling. ``mask`` is then only the initial layout (and sets
        the default init's fan-in). Apply with
        ``model.apply({"params": params, "layout": layouts}, x)``.
      {precision}
        Also a dynamic layer's dense-gradient probe.
      {impl}

    Dynamic example::

        >>> layer = jbs.nn.BlockSparseDense(128, mask, 16, capacity=40, dynamic=True)
        >>> variables = layer.init(jax.random.key(0), jnp.ones((4, 128)))
        >>> variables["layout"]["kernel"].capacity
        40
        >>> y = layer.apply(variables, jnp.ones((4, 128)))
    """

    features: int
    mask: Any
    block_size: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    capacity: int | None = None
    dynamic: bool = False
    float32_dw: bool = False
    precision: PrecisionLike = None
    impl: str | None = None

    def __post_init__(self):
        # Attributes may be set until Module.__post_init__ runs; keep the mask hashable.
        self.mask, self.block_size, self.float32_dw = _core.check_dense(
            self.mask,
            self.block_size,
            self.capacity,
            None,
            self.features,
            self.float32_dw,
            self.param_dtype,
            type(self).__name__,
        )
        self.precision, self.impl = _common.check_options(self.precision, self.impl, type(self).__name__)
        super().__post_init__()

    @property
    def layout(self) -> Layout:
        """The :class:`~jax_blocksparse.Layout` of the kernel (for ``jbs.to_dense``).

        With ``dynamic=True`` this is the initial layout; the current one is
        ``variables["layout"][...]["kernel"]``.
        """
        return _common.layout_for(self.mask, self.block_size, self.capacity)

    @nn.compact
    def __call__(self, inputs: Array) -> Array:
        """Applies the block-sparse linear map to the last axis of ``inputs``.

        Args:
          inputs: [..., C] with ``C = mask.shape[0] * block_size``.

        Returns:
          [..., features].
        """
        layout = self.layout
        _core.check_inputs(inputs, layout, type(self).__name__)
        kernel = self.param(
            "kernel",
            lambda key: _common.init_kernel(self.kernel_init, key, layout, self.mask, self.param_dtype),
        )
        bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        current = self.variable(LAYOUT_COLLECTION, "kernel", lambda: layout).value if self.dynamic else None
        return _core.forward(
            inputs,
            kernel,
            bias,
            layout,
            dtype=self.dtype,
            float32_dw=self.float32_dw,
            current=current,
            layer=type(self).__name__,
            precision=self.precision,
            impl=self.impl,
        )
