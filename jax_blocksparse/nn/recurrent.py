"""Block-sparse recurrent cells (LSTM, multiplicative LSTM) and a fused sequence layer (linen).

OpenAI's block-sparse LSTM (2017) made the recurrent weights block-sparse with a
small-world layout and, at every timestep, ran a few *internal steps* (a block-sparse
transition followed by layer norm) before the gates, so that information from every
unit reaches every other unit despite the sparsity. This module has:

* :class:`BlockSparseLSTMCell` and :class:`BlockSparseMLSTMCell`: ``flax.linen``
  RNN cells (the ``nn.RNN`` / ``nn.scan`` carry API), one timestep per call.
* :class:`BlockSparseLSTM`: the same cells over a whole sequence, with the input
  projection of all timesteps in one product and a custom backward pass that
  computes each recurrent weight gradient with a single ``bsmm_updat``.

The cells declare their parameters; the equations, the fused sequence and its
backward pass are the functional op :mod:`jax_blocksparse.ops.recurrence`
(:func:`~jax_blocksparse.ops.recurrence.bs_lstm_step`,
:func:`~jax_blocksparse.ops.recurrence.bs_lstm_sequence`), and the configuration and
initialisation are :mod:`jax_blocksparse.layers.recurrent`, both shared with the NNX
cells (:mod:`jax_blocksparse.nnx.recurrent`).

Design choices:

* **The four gates share one layout and one product.** ``W_h`` is one block-sparse
  [H, 4H] weight whose mask is the base [H/bs, H/bs] mask tiled four times along the
  output axis (gate order i, f, g, o as in Flax), so one ``bsmm`` produces all four
  gate pre-activations; an explicit [H/bs, 4H/bs] mask may give each gate its own.
  Layer norm (when on) is per gate, as in OpenAI's code.
* **Internal steps** each have their own weight (and, optionally, their own layout)
  and use a ReLU after the layer norm by default (``internal_activation``), as
  OpenAI's mLSTM did: without a nonlinearity the internal steps compose into one
  linear map that only widens the receptive field; with it they also add depth.
  Use :func:`jax_blocksparse.layouts.mixing_steps` to choose their number:
  ``internal_steps = mixing_steps(mask) - 1`` lets every unit reach every other
  unit within one timestep.
* **The input projection** is dense by default (``input_mask=None``), or
  block-sparse with ``input_mask``.

Carries are kept in their own dtype (``param_dtype`` from ``initialize_carry``);
with ``dtype=jnp.bfloat16`` the products run in bfloat16 (float32 accumulation) while
the cell state and all elementwise math stay in float32. The kernel gradients are
then rounded to bfloat16 (as autodiff of a bfloat16 product gives them) unless
``float32_dw=True``: then every kernel gradient (block-sparse and the dense input
kernel) is the float32 accumulator of its weight-gradient product. On a GPU, XLA's
default ``--xla_allow_excess_precision`` may skip a rounding to 16 bits that is widened
straight back (the input kernel's gradient, whose product has a float32 output; the
gate inputs): docs/guide/mixed_precision.rst.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
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
class BlockSparseLSTMCell(nn.RNNCellBase):
    """An LSTM cell with block-sparse recurrent weights, internal steps and layer norm.

    A ``flax.linen`` RNN cell: use it with ``nn.RNN`` (or ``nn.scan``), or give it to
    :class:`BlockSparseLSTM` to run a whole sequence with fused input projection and
    grouped weight gradients (same parameters). The math is the op
    :mod:`jax_blocksparse.ops.recurrence`; with ``layer_norm=False`` and
    ``internal_steps=0`` it is ``nn.LSTMCell`` with masked kernels.

    Example::

        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)        # [8, 8] blocks
        >>> cell = jbs.nn.BlockSparseLSTMCell(128, mask, 16, internal_steps=2)
        >>> x = jnp.ones((4, 10, 32))                                # [B, T, D]
        >>> rnn = nn.RNN(cell)
        >>> params = rnn.init(jax.random.key(0), x)
        >>> rnn.apply(params, x).shape
        (4, 10, 128)
        >>> fast = jbs.nn.BlockSparseLSTM(cell)                     # same params, fused
        >>> bool(jnp.allclose(fast.apply(params, x), rnn.apply(params, x), atol=1e-5))
        True

    Attributes:
      features: hidden size H, a multiple of ``block_size``.
      {lstm.mask, block_size, internal_steps, step_masks, input_mask, layer_norm}
      {internal_activation, gate_fn, activation_fn, lstm.kernel_init, recurrent_kernel_init}
      {lstm.bias_init, lstm.dtype, lstm.param_dtype, carry_init, epsilon, lstm.float32_dw}
      {lstm.precision, lstm.impl}
    """

    multiplicative: ClassVar[bool] = False

    features: int
    mask: Any
    block_size: int
    internal_steps: int = 0
    step_masks: Sequence[Any] | None = None
    input_mask: Any = None
    layer_norm: bool = True
    internal_activation: Callable[..., Any] | None = nn.relu
    gate_fn: Callable[..., Any] = nn.sigmoid
    activation_fn: Callable[..., Any] = nn.tanh
    kernel_init: Initializer | None = None
    recurrent_kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: Initializer = nn.initializers.zeros_init()
    epsilon: float = 1e-5
    float32_dw: bool = False
    precision: PrecisionLike = None
    impl: str | None = None

    def _mh_mask(self):
        return None

    def __post_init__(self):
        self.float32_dw = check_float32_dw(self.float32_dw, self.param_dtype, type(self).__name__)
        self.precision, self.impl = check_options(self.precision, self.impl, type(self).__name__)
        config = _core.cell_config(
            type(self).__name__,
            self.features,
            self.mask,
            self.block_size,
            multiplicative=self.multiplicative,
            internal_steps=self.internal_steps,
            step_masks=self.step_masks,
            mh_mask=self._mh_mask(),
            input_mask=self.input_mask,
            layer_norm=self.layer_norm,
            epsilon=self.epsilon,
        )
        # Keep every mask hashable (the module is a jit cache key / static argument).
        self.mask = _core.static_mask(self.mask, "mask", type(self).__name__)
        if self.step_masks is not None:
            self.step_masks = config.step_masks
        if self.input_mask is not None:
            self.input_mask = _core.static_mask(self.input_mask, "input_mask", type(self).__name__)
        self.block_size = config.block_size
        super().__post_init__()

    @property
    def config(self) -> _core.CellConfig:
        """The validated static configuration (layouts: ``config.stages[k].layout``)."""
        return _core.cached_config(
            type(self).__name__,
            self.features,
            self.mask,
            self.block_size,
            self.multiplicative,
            self.internal_steps,
            self.step_masks,
            self._mh_mask(),
            self.input_mask,
            self.layer_norm,
            self.epsilon,
        )

    @property
    def recurrent_layout(self) -> Layout:
        """Layout of ``recurrent_kernel``: [H, 4H], the gates' shared mask tiled 4 times."""
        return self.config.layout_of("recurrent_kernel", type(self).__name__)

    def layout_of(self, param_name: str) -> Layout | None:
        """The layout of a block-sparse kernel parameter, by name (None for a dense one)."""
        return self.config.layout_of(param_name, type(self).__name__)

    @nn.compact
    def _params(self, in_features: int) -> dict[str, Array]:
        config = self.config
        try:
            shapes = config.param_shapes(in_features)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        out = {}
        for name in shapes:
            out[name] = self.param(
                name,
                lambda key, _n=name: _core.init_param(
                    config,
                    _n,
                    key,
                    in_features,
                    kernel_init=self.kernel_init,
                    recurrent_kernel_init=self.recurrent_kernel_init,
                    bias_init=self.bias_init,
                    param_dtype=self.param_dtype,
                ),
            )
        return out

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

    def __call__(self, carry, inputs):
        """One timestep.

        Args:
          carry: (c, h), each [..., H], from :meth:`initialize_carry`.
          inputs: [..., D]; all but the last axis are batch axes.

        Returns:
          ``((c', h'), h')``.
        """
        check_step_inputs(type(self).__name__, carry, inputs, self.features)
        params = self._params(jnp.shape(inputs)[-1])
        return bs_lstm_step(self._spec(inputs), params, tuple(carry), inputs)

    def sequence(self, carry, inputs, *, precision=None, impl: str | None = None):
        """A whole sequence at once (what :class:`BlockSparseLSTM` calls).

        Args:
          carry: (c, h), each [*batch, H].
          inputs: [T, *batch, D], time-major.
          precision, impl: override the cell's for this call when not None (checked
            as the attributes are).

        Returns:
          ``((c_T, h_T), outputs [T, *batch, H])``, equal to scanning ``__call__``,
          with the input projection in one product and one ``bsmm_updat`` per
          recurrent weight in the backward pass.
        """
        if jnp.ndim(inputs) < 2:
            raise ValueError(f"{type(self).__name__}.sequence: inputs must be [T, ..., D], got {jnp.shape(inputs)}")
        check_step_inputs(type(self).__name__, carry, inputs[0], self.features)
        precision, impl = check_options(precision, impl, f"{type(self).__name__}.sequence")
        params = self._params(jnp.shape(inputs)[-1])
        return bs_lstm_sequence(self._spec(inputs, precision, impl), params, tuple(carry), inputs)

    @nn.nowrap
    def initialize_carry(self, rng, input_shape: tuple[int, ...]):
        """(c, h) of shape ``input_shape[:-1] + (features,)`` and dtype ``param_dtype``."""
        batch_dims = tuple(input_shape[:-1])
        key1, key2 = jax.random.split(rng)
        mem_shape = batch_dims + (self.features,)
        return (self.carry_init(key1, mem_shape, self.param_dtype), self.carry_init(key2, mem_shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return 1


class BlockSparseMLSTMCell(BlockSparseLSTMCell):
    """A multiplicative LSTM (Krause et al. 2016) cell with block-sparse recurrent weights.

    ``m = (x @ W_mx) * (h @ W_mh)`` replaces ``h`` as the input of the internal steps
    and the gates (with layer norm on both factors when ``layer_norm``). ``W_mx`` is
    part of the input projection (``input_kernel`` is [D, 5H]: four gates then m);
    ``W_mh`` is block-sparse with ``mh_mask`` (default ``mask``).

    Same attributes as :class:`BlockSparseLSTMCell`, plus ``mh_mask`` (bool
    [H/bs, H/bs]). Works with ``nn.RNN`` and :class:`BlockSparseLSTM`.

    Example::

        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nn.BlockSparseMLSTMCell(64, jbs.layouts.barabasi_albert(4, 1), 16)
        >>> rnn = jbs.nn.BlockSparseLSTM(cell)
        >>> params = rnn.init(jax.random.key(0), jnp.ones((2, 5, 8)))
        >>> rnn.apply(params, jnp.ones((2, 5, 8))).shape
        (2, 5, 64)
    """

    multiplicative: ClassVar[bool] = True
    mh_mask: Any = None

    def _mh_mask(self):
        return self.mh_mask

    def __post_init__(self):
        if self.mh_mask is not None:
            self.mh_mask = _core.static_mask(self.mh_mask, "mh_mask", type(self).__name__)
        super().__post_init__()


@attribute_docs.fill
class BlockSparseLSTM(nn.Module):
    """A block-sparse LSTM over a whole sequence: ``nn.RNN(cell)``, fused.

    Takes a :class:`BlockSparseLSTMCell` or :class:`BlockSparseMLSTMCell` and has
    the same parameters as ``nn.RNN(cell)`` (under ``"cell"``), so the two are
    interchangeable. It projects the inputs of all timesteps with one product
    ([B*T, D] @ W_in), runs the recurrence with ``lax.scan``, and in the backward pass
    computes each recurrent weight gradient with one ``bsmm_updat`` over all timesteps
    (see :mod:`jax_blocksparse.ops.recurrence`). Forward-mode autodiff (``jax.jvp``) is
    not supported through it (it has a custom VJP); use ``nn.RNN(cell)`` for that.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nn.BlockSparseLSTMCell(128, jbs.layouts.barabasi_albert(8, 2), 16)
        >>> lstm = jbs.nn.BlockSparseLSTM(cell, return_carry=True)
        >>> x = jnp.ones((4, 10, 32))                               # [B, T, D]
        >>> params = lstm.init(jax.random.key(0), x)
        >>> (c, h), y = lstm.apply(params, x)
        >>> y.shape, h.shape
        ((4, 10, 128), (4, 128))

    Attributes:
      {cell, time_major, return_carry, sequence.precision, sequence.impl}
    """

    cell: BlockSparseLSTMCell
    time_major: bool = False
    return_carry: bool = False
    precision: PrecisionLike = None
    impl: str | None = None

    def __post_init__(self):
        self.precision, self.impl = check_options(self.precision, self.impl, type(self).__name__)
        super().__post_init__()

    def __call__(self, inputs, *, initial_carry=None, init_key=None, return_carry: bool | None = None):
        """Runs the cell over the time axis.

        Args:
          inputs: [*batch, T, D] (or [T, *batch, D] with ``time_major``).
          initial_carry: (c, h) [*batch, H]; default ``cell.initialize_carry``.
          init_key: key for ``cell.initialize_carry`` (default ``random.key(0)``).
          return_carry: overrides the attribute.

        Returns:
          outputs [*batch, T, H] (or time-major), or ``((c_T, h_T), outputs)``.
        """
        if not isinstance(self.cell, BlockSparseLSTMCell):
            raise TypeError(
                f"BlockSparseLSTM: cell must be a BlockSparseLSTMCell or BlockSparseMLSTMCell, "
                f"got {type(self.cell).__name__}"
            )
        return _core.run_sequence(
            self.cell,
            inputs,
            self.time_major,
            initial_carry,
            return_carry if return_carry is not None else self.return_carry,
            lambda shape: self.cell.initialize_carry(init_key if init_key is not None else jax.random.key(0), shape),
            precision=self.precision,
            impl=self.impl,
        )
