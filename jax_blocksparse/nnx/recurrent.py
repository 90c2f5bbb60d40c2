"""Flax NNX block-sparse recurrent cells and the fused sequence layer.

The NNX twins of the linen cells (same math, same parameter names and shapes, same
initialisation, from the same core): :class:`BlockSparseLSTMCell` and
:class:`BlockSparseMLSTMCell` mirror ``flax.nnx.LSTMCell`` (constructor takes
``in_features, hidden_features``; ``initialize_carry(input_shape, rngs)``; works with
``nnx.RNN``), and :class:`BlockSparseLSTM` runs a cell over a whole sequence with one
input projection and one ``bsmm_updat`` per recurrent weight in the backward pass.
The equations and the fused backward pass are the op
:mod:`jax_blocksparse.ops.recurrence`; the configuration and init are
:mod:`jax_blocksparse.layers.recurrent`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import recurrent as _core
from jax_blocksparse.layers.common import check_float32_dw, check_options
from jax_blocksparse.layout import Layout
from jax_blocksparse.ops.recurrence import (
    LSTMSpec,
    bs_lstm_sequence,
    bs_lstm_step,
    check_step_inputs,
)

Array = jax.Array
Initializer = Callable[..., Array]

__all__ = ["BlockSparseLSTM", "BlockSparseLSTMCell", "BlockSparseMLSTMCell"]


@attribute_docs.fill
class BlockSparseLSTMCell(nnx.RNNCellBase):
    """An LSTM cell with block-sparse recurrent weights, internal steps and layer norm.

    ``flax.nnx.LSTMCell`` with block-sparse recurrent kernels; with
    ``layer_norm=False`` and ``internal_steps=0`` it equals ``nnx.LSTMCell`` with masked
    kernels. Parameters are attributes named as the linen cell's parameters
    (``input_kernel``, ``recurrent_kernel``, ``bias``, ``input_scale``,
    ``recurrent_scale``, ``step{i}_kernel``, ``step{i}_scale``, ``step{i}_bias``).

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)        # [8, 8] blocks
        >>> cell = jbs.nnx.BlockSparseLSTMCell(32, 128, mask, 16, internal_steps=2, rngs=nnx.Rngs(0))
        >>> x = jnp.ones((4, 10, 32))                                # [B, T, D]
        >>> nnx.RNN(cell)(x).shape
        (4, 10, 128)
        >>> jbs.nnx.BlockSparseLSTM(cell)(x).shape                  # fused, same params
        (4, 10, 128)

    Args:
      in_features: input size D.
      hidden_features: hidden size H, a multiple of ``block_size``.
      {lstm.mask, block_size, internal_steps, step_masks, input_mask, layer_norm}
      {internal_activation, gate_fn, activation_fn, lstm.kernel_init, recurrent_kernel_init}
      {lstm.bias_init, lstm.dtype, lstm.param_dtype, carry_init, epsilon, lstm.float32_dw}
      {lstm.precision, lstm.impl}
      rngs: parameter initialisation keys.
    """

    multiplicative = False

    def __init__(
        self,
        in_features: int,
        hidden_features: int,
        mask: Any,
        block_size: int,
        *,
        internal_steps: int = 0,
        step_masks: Sequence[Any] | None = None,
        input_mask: Any = None,
        layer_norm: bool = True,
        internal_activation: Callable[..., Any] | None = nnx.relu,
        gate_fn: Callable[..., Any] = nnx.sigmoid,
        activation_fn: Callable[..., Any] = nnx.tanh,
        kernel_init: Initializer | None = None,
        recurrent_kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        carry_init: Initializer | None = None,
        epsilon: float = 1e-5,
        mh_mask: Any = None,
        float32_dw: bool = False,
        precision: PrecisionLike = None,
        impl: str | None = None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        self.float32_dw = check_float32_dw(float32_dw, param_dtype, name)
        self.precision, self.impl = check_options(precision, impl, name)
        config = _core.cell_config(
            name,
            hidden_features,
            mask,
            block_size,
            multiplicative=self.multiplicative,
            internal_steps=internal_steps,
            step_masks=step_masks,
            mh_mask=mh_mask,
            input_mask=input_mask,
            in_features=in_features,
            layer_norm=layer_norm,
            epsilon=epsilon,
        )
        self.in_features = int(in_features)
        self.hidden_features = config.features
        self.config = config
        self.block_size = config.block_size
        self.gate_fn = gate_fn
        self.activation_fn = activation_fn
        self.internal_activation = internal_activation
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.carry_init = carry_init
        self.param_names = tuple(config.param_shapes(self.in_features))
        for pname in self.param_names:
            value = _core.init_param(
                config,
                pname,
                rngs.params(),
                self.in_features,
                kernel_init=kernel_init,
                recurrent_kernel_init=recurrent_kernel_init,
                bias_init=bias_init,
                param_dtype=param_dtype,
            )
            setattr(self, pname, nnx.Param(value))

    @property
    def recurrent_layout(self) -> Layout:
        """Layout of ``recurrent_kernel`` ([H, 4H]: the gates' mask tiled four times)."""
        return self.layout_of("recurrent_kernel")

    def layout_of(self, param_name: str) -> Layout | None:
        """The layout of a block-sparse kernel parameter (None for a dense input kernel)."""
        return self.config.layout_of(param_name, type(self).__name__)

    def _params(self) -> dict[str, Array]:
        return {pname: getattr(self, pname)[...] for pname in self.param_names}

    def _spec(self, inputs, precision=None, impl=None) -> LSTMSpec:
        """The op's spec; ``precision`` / ``impl`` (checked) override the cell's when not None."""
        return self.config.spec(
            self.gate_fn,
            self.activation_fn,
            self.internal_activation,
            _core.compute_dtype(self.dtype, inputs, self.param_dtype),
            self.float32_dw,
            precision=self.precision if precision is None else precision,
            impl=self.impl if impl is None else impl,
        )

    def _check_inputs(self, inputs):
        if jnp.shape(inputs)[-1:] != (self.in_features,):
            raise ValueError(
                f"{type(self).__name__}: inputs must have shape [..., {self.in_features}], got {jnp.shape(inputs)}"
            )

    def __call__(self, carry, inputs):  # type: ignore[override]
        """One timestep: ``carry`` (c, h) [..., H], ``inputs`` [..., D] -> ``((c', h'), h')``."""
        check_step_inputs(type(self).__name__, carry, inputs, self.hidden_features)
        self._check_inputs(inputs)
        return bs_lstm_step(self._spec(inputs), self._params(), tuple(carry), inputs)

    def sequence(self, carry, inputs, *, precision=None, impl: str | None = None):
        """A whole sequence: inputs [T, *batch, D] (time-major) -> ``((c_T, h_T), [T, *batch, H])``.

        ``precision`` and ``impl`` override the cell's for this call when not None.
        """
        if jnp.ndim(inputs) < 2:
            raise ValueError(f"{type(self).__name__}.sequence: inputs must be [T, ..., D], got {jnp.shape(inputs)}")
        check_step_inputs(type(self).__name__, carry, inputs[0], self.hidden_features)
        self._check_inputs(inputs)
        precision, impl = check_options(precision, impl, f"{type(self).__name__}.sequence")
        return bs_lstm_sequence(self._spec(inputs, precision, impl), self._params(), tuple(carry), inputs)

    def initialize_carry(  # type: ignore[override]
        self, input_shape: tuple[int, ...], rngs=None, carry_init: Initializer | None = None
    ):
        """(c, h) of shape ``input_shape[:-1] + (hidden_features,)`` in ``param_dtype``.

        ``rngs`` (an ``nnx.Rngs`` or stream) is only needed by a random ``carry_init``;
        without it, ``random.key(0)`` is used.
        """
        init = carry_init or self.carry_init or nnx.initializers.zeros_init()
        if isinstance(rngs, nnx.Rngs):
            rngs = rngs.carry
        key = rngs() if rngs is not None else jax.random.key(0)
        k1, k2 = jax.random.split(key)
        shape = tuple(input_shape[:-1]) + (self.hidden_features,)
        return (init(k1, shape, self.param_dtype), init(k2, shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return 1


class BlockSparseMLSTMCell(BlockSparseLSTMCell):
    """A multiplicative LSTM cell with block-sparse recurrent weights (NNX).

    ``m = (x @ W_mx) * (h @ W_mh)`` replaces ``h`` before the internal steps and the
    gates; ``input_kernel`` is [D, 5H] (four gates, then m) and ``mh_kernel`` is
    block-sparse with ``mh_mask`` (default ``mask``). Same arguments as
    :class:`BlockSparseLSTMCell` plus ``mh_mask``.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nnx.BlockSparseMLSTMCell(8, 64, jbs.layouts.barabasi_albert(4, 1), 16, rngs=nnx.Rngs(0))
        >>> jbs.nnx.BlockSparseLSTM(cell)(jnp.ones((2, 5, 8))).shape
        (2, 5, 64)
    """

    multiplicative = True


@attribute_docs.fill
class BlockSparseLSTM(nnx.Module):
    """A block-sparse (m)LSTM cell over a whole sequence: ``nnx.RNN(cell)``, fused.

    Uses the cell's parameters (so it can wrap a cell also used with ``nnx.RNN``);
    projects the inputs of all timesteps in one product, scans the recurrence with
    ``lax.scan`` and computes each recurrent weight gradient with one ``bsmm_updat``
    over all timesteps. Not differentiable in forward mode (custom VJP).

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nnx.BlockSparseLSTMCell(32, 128, jbs.layouts.barabasi_albert(8, 2), 16, rngs=nnx.Rngs(0))
        >>> lstm = jbs.nnx.BlockSparseLSTM(cell, return_carry=True)
        >>> (c, h), y = lstm(jnp.ones((4, 10, 32)))
        >>> y.shape, h.shape
        ((4, 10, 128), (4, 128))

    Args:
      {cell, time_major, return_carry, sequence.precision, sequence.impl}
    """

    def __init__(
        self,
        cell: BlockSparseLSTMCell,
        *,
        time_major: bool = False,
        return_carry: bool = False,
        precision: PrecisionLike = None,
        impl: str | None = None,
    ):
        if not isinstance(cell, BlockSparseLSTMCell):
            raise TypeError(
                "BlockSparseLSTM: cell must be a BlockSparseLSTMCell or BlockSparseMLSTMCell, "
                f"got {type(cell).__name__}"
            )
        self.precision, self.impl = check_options(precision, impl, type(self).__name__)
        self.cell = cell
        self.time_major = time_major
        self.return_carry = return_carry

    def __call__(self, inputs, *, initial_carry=None, return_carry: bool | None = None, rngs=None):
        """inputs [*batch, T, D] -> outputs [*batch, T, H] (or ``(carry, outputs)``)."""
        return _core.run_sequence(
            self.cell,
            inputs,
            self.time_major,
            initial_carry,
            self.return_carry if return_carry is None else return_carry,
            lambda shape: self.cell.initialize_carry(shape, rngs),
            precision=self.precision,
            impl=self.impl,
        )
