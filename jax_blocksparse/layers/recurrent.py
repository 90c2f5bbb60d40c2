"""The block-sparse LSTM cells' core: static configuration, parameter init, shared checks.

Framework-neutral (no flax): the linen cells (:mod:`jax_blocksparse.nn.recurrent`)
and the nnx cells (:mod:`jax_blocksparse.nnx.recurrent`) validate their masks with
:func:`cell_config`, declare the parameters named by :meth:`CellConfig.param_shapes`
with the values of :func:`init_param`, and run the functional op
:mod:`jax_blocksparse.ops.recurrence` with :meth:`CellConfig.spec`.

Masks are block masks (bool, one entry per block; see :class:`CellConfig`); the op
sees their cached host layouts.

Example::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.layers import recurrent
    >>> from jax_blocksparse.ops.recurrence import bs_lstm_step
    >>> config = recurrent.cell_config("MyCell", 64, jbs.layouts.barabasi_albert(4, 1, seed=0), 16,
    ...                                multiplicative=False, internal_steps=1)
    >>> sorted(config.param_shapes(8))  # doctest: +NORMALIZE_WHITESPACE
    ['bias', 'input_kernel', 'input_scale', 'recurrent_kernel', 'recurrent_scale',
     'step0_bias', 'step0_kernel', 'step0_scale']
    >>> params = {name: recurrent.init_param(config, name, jax.random.key(i), 8, kernel_init=None,
    ...                                      recurrent_kernel_init=None, bias_init=jax.nn.initializers.zeros,
    ...                                      param_dtype=jnp.float32)
    ...           for i, name in enumerate(config.param_shapes(8))}
    >>> carry = (jnp.zeros((2, 64)), jnp.zeros((2, 64)))
    >>> (c, h), y = bs_lstm_step(config.spec(), params, carry, jnp.ones((2, 8)))
    >>> y.shape
    (2, 64)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layers.common import StaticMask, init_kernel, layout_for
from jax_blocksparse.layout import Layout, check_block_size
from jax_blocksparse.ops.recurrence import LSTMSpec, LSTMStage, lstm_spec, lstm_stages

__all__ = [
    "CellConfig",
    "cached_config",
    "cell_config",
    "compute_dtype",
    "host_layout",
    "init_param",
    "run_sequence",
    "static_mask",
]


def static_mask(mask, name: str, layer: str) -> StaticMask:
    """A :class:`~jax_blocksparse.layers.StaticMask` from a bool mask, a StaticMask or a concrete Layout."""
    if isinstance(mask, Layout):
        mask = np.asarray(mask.mask)
    try:
        return StaticMask(mask)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{layer}: {name}: {err}") from None


@functools.lru_cache(maxsize=256)
def host_layout(mask: StaticMask, block_size: int) -> Layout:
    """The (cached) layout of a static mask at its exact capacity; host index tables."""
    return layout_for(mask, block_size, None)


@dataclasses.dataclass(frozen=True)
class CellConfig:
    """Everything static about a block-sparse LSTM cell (validated, hashable).

    Built by :func:`cell_config`; shared by the linen and nnx cells so that both
    declare the same parameters and run the same math.

    Attributes:
      features: hidden size H.
      block_size: the block edge bs.
      multiplicative: the mLSTM.
      gate_mask: bool [H/bs, 4H/bs], the gates' mask.
      step_masks: one bool [H/bs, H/bs] per internal step.
      mh_mask: bool [H/bs, H/bs] (mLSTM) or None.
      input_mask: bool [D/bs, G*H/bs], or None for a dense input kernel.
      layer_norm, epsilon: layer norm and its epsilon.
    """

    features: int
    block_size: int
    multiplicative: bool
    gate_mask: StaticMask  # [H/bs, 4H/bs]
    step_masks: tuple[StaticMask, ...]
    mh_mask: StaticMask | None
    input_mask: StaticMask | None  # [D/bs, G*H/bs] or None for dense
    layer_norm: bool
    epsilon: float

    @property
    def groups(self) -> int:
        """Number of H-wide groups in the input projection: 4 gates (+ m for mLSTM)."""
        return 5 if self.multiplicative else 4

    @property
    def internal_steps(self) -> int:
        return len(self.step_masks)

    @property
    def stages(self) -> tuple[LSTMStage, ...]:
        """The op's stages (:class:`~jax_blocksparse.ops.recurrence.LSTMStage`): name, layout, vector params."""
        layout = functools.partial(host_layout, block_size=self.block_size)
        mh = None if self.mh_mask is None else layout(self.mh_mask)
        return lstm_stages(layout(self.gate_mask), tuple(layout(m) for m in self.step_masks), mh, self.layer_norm)

    def mask_of(self, kernel: str) -> StaticMask:
        """The block mask of a block-sparse kernel parameter, by name (KeyError if none)."""
        masks = {"recurrent_kernel": self.gate_mask, "mh_kernel": self.mh_mask}
        masks.update({f"step{i}_kernel": m for i, m in enumerate(self.step_masks)})
        if self.input_mask is not None:
            masks["input_kernel"] = self.input_mask
        if masks.get(kernel) is None:
            raise KeyError(f"no block-sparse kernel named {kernel!r}")
        return masks[kernel]

    def input_layout(self) -> Layout | None:
        if self.input_mask is None:
            return None
        return host_layout(self.input_mask, self.block_size)

    def layout_of(self, param_name: str, layer: str) -> Layout | None:
        """The layout of a block-sparse kernel parameter, by name (None for a dense input kernel)."""
        if param_name == "input_kernel":
            return self.input_layout()
        try:
            return host_layout(self.mask_of(param_name), self.block_size)
        except KeyError:
            raise KeyError(f"{layer} has no block-sparse kernel named {param_name!r}") from None

    def spec(
        self,
        gate_fn: Callable = jax.nn.sigmoid,
        activation_fn: Callable = jnp.tanh,
        internal_activation: Callable | None = jax.nn.relu,
        dtype=jnp.float32,
        float32_dw: bool = False,
        *,
        precision=None,
        impl: str | None = None,
    ) -> LSTMSpec:
        """The op's :class:`~jax_blocksparse.ops.recurrence.LSTMSpec` for these masks and settings.

        ``precision`` and ``impl`` (a cell's, from
        :func:`~jax_blocksparse.layers.common.check_options`) rule every product of
        the step and of the sequence, forward and backward.
        """
        stages = self.stages
        return lstm_spec(
            self.features,
            stages[-1].layout,
            step_layouts=[s.layout for s in stages if s.kind == "step"],
            mh_layout=stages[0].layout if self.multiplicative else None,
            input_layout=self.input_layout(),
            layer_norm=self.layer_norm,
            epsilon=self.epsilon,
            gate_fn=gate_fn,
            activation_fn=activation_fn,
            internal_activation=internal_activation,
            dtype=dtype,
            float32_dw=float32_dw,
            precision=precision,
            impl=impl,
        )

    def param_shapes(self, in_features: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, for inputs of ``in_features`` features."""
        self.check_in_features(in_features)
        return self.spec().param_shapes(in_features)

    def check_in_features(self, in_features: int):
        if self.input_mask is not None and in_features != self.input_mask.shape[0] * self.block_size:
            raise ValueError(
                f"inputs must have {self.input_mask.shape[0]} * {self.block_size} = "
                f"{self.input_mask.shape[0] * self.block_size} features for input_mask of shape "
                f"{self.input_mask.shape}, got {in_features}"
            )


def cell_config(
    layer: str,
    features: int,
    mask,
    block_size,
    *,
    multiplicative: bool,
    internal_steps: int = 0,
    step_masks=None,
    mh_mask=None,
    input_mask=None,
    in_features: int | None = None,
    layer_norm: bool = True,
    epsilon: float = 1e-5,
) -> CellConfig:
    """Validates a cell's static arguments; raises ValueError naming shapes."""
    block_size = check_block_size(block_size)
    if isinstance(features, bool) or not isinstance(features, (int, np.integer)) or features <= 0:
        raise ValueError(f"{layer}: features must be a positive int, got {features!r}")
    features = int(features)
    if features % block_size:
        raise ValueError(f"{layer}: features ({features}) must be a multiple of block_size ({block_size})")
    hb = features // block_size
    mask = static_mask(mask, "mask", layer)
    if mask.shape == (hb, hb):
        base = mask
        gate_mask = StaticMask(np.tile(mask.array, (1, 4)))
    elif mask.shape == (hb, 4 * hb):
        base = None
        gate_mask = mask
    else:
        raise ValueError(
            f"{layer}: mask must have shape [features/bs, features/bs] = {(hb, hb)} (shared by the 4 gates) "
            f"or [features/bs, 4*features/bs] = {(hb, 4 * hb)} (one block column range per gate), "
            f"got {mask.shape} (features={features}, block_size={block_size})"
        )
    if isinstance(internal_steps, bool) or not isinstance(internal_steps, (int, np.integer)) or internal_steps < 0:
        raise ValueError(f"{layer}: internal_steps must be an int >= 0, got {internal_steps!r}")
    internal_steps = int(internal_steps)

    def square(m, name):
        m = static_mask(m, name, layer)
        if m.shape != (hb, hb):
            raise ValueError(f"{layer}: {name} must have shape {(hb, hb)} = [features/bs, features/bs], got {m.shape}")
        return m

    def default_square(name):
        if base is None:
            raise ValueError(
                f"{layer}: {name} is required when mask has the per-gate shape {mask.shape}: "
                f"give a [features/bs, features/bs] = {(hb, hb)} mask"
            )
        return base

    if step_masks is None:
        steps = tuple(default_square("step_masks") for _ in range(internal_steps))
    else:
        if isinstance(step_masks, (np.ndarray, StaticMask, Layout)) or hasattr(step_masks, "shape"):
            raise TypeError(f"{layer}: step_masks must be a sequence of masks (one per internal step), got one array")
        steps = tuple(square(m, f"step_masks[{i}]") for i, m in enumerate(step_masks))
        if len(steps) != internal_steps:
            raise ValueError(
                f"{layer}: got {len(steps)} step_masks for internal_steps={internal_steps}; give one mask per step"
            )
    mh = None
    if multiplicative:
        mh = square(mh_mask, "mh_mask") if mh_mask is not None else default_square("mh_mask")
    elif mh_mask is not None:
        raise ValueError(f"{layer}: mh_mask is only for the multiplicative LSTM")
    groups = 5 if multiplicative else 4
    imask = None
    if input_mask is not None:
        imask = static_mask(input_mask, "input_mask", layer)
        if imask.shape[1] == hb:
            imask = StaticMask(np.tile(imask.array, (1, groups)))
        elif imask.shape[1] != groups * hb:
            raise ValueError(
                f"{layer}: input_mask must have shape [in_features/bs, {hb}] (tiled for the {groups} "
                f"input groups) or [in_features/bs, {groups * hb}], got {imask.shape}"
            )
    config = CellConfig(
        features, block_size, bool(multiplicative), gate_mask, steps, mh, imask, bool(layer_norm), float(epsilon)
    )
    if in_features is not None:
        try:
            config.check_in_features(int(in_features))
        except ValueError as err:
            raise ValueError(f"{layer}: {err}") from None
    return config


@functools.lru_cache(maxsize=256)
def cached_config(
    layer,
    features,
    mask,
    block_size,
    multiplicative,
    internal_steps,
    step_masks,
    mh_mask,
    input_mask,
    layer_norm,
    epsilon,
) -> CellConfig:
    """:func:`cell_config` of hashable arguments, built once (what a linen cell reads per call)."""
    return cell_config(
        layer,
        features,
        mask,
        block_size,
        multiplicative=multiplicative,
        internal_steps=internal_steps,
        step_masks=step_masks,
        mh_mask=mh_mask,
        input_mask=input_mask,
        layer_norm=layer_norm,
        epsilon=epsilon,
    )


def init_param(
    config: CellConfig, name: str, key, in_features: int, *, kernel_init, recurrent_kernel_init, bias_init, param_dtype
):
    """The initial value of one parameter.

    Block-sparse kernels default to LeCun normal with their true fan-in (see
    :func:`jax_blocksparse.layers.common.default_kernel_init`); a dense input kernel to
    ``jax.nn.initializers.lecun_normal()``; scales to one, biases to ``bias_init``
    (the gate bias) or zero (internal-step and mLSTM biases).
    """
    shapes = config.param_shapes(in_features)
    shape = shapes[name]
    if name == "input_kernel":
        if config.input_mask is None:
            init = kernel_init if kernel_init is not None else jax.nn.initializers.lecun_normal()
            return init(key, shape, param_dtype)
        return init_kernel(kernel_init, key, config.input_layout(), config.input_mask, param_dtype)
    if name == "bias":
        return bias_init(key, shape, param_dtype)
    if name.endswith("_scale"):
        return jnp.ones(shape, param_dtype)
    if name.endswith("_bias"):
        return jnp.zeros(shape, param_dtype)
    mask = config.mask_of(name)
    return init_kernel(recurrent_kernel_init, key, host_layout(mask, config.block_size), mask, param_dtype)


def compute_dtype(dtype, inputs, param_dtype) -> np.dtype:
    """Flax's rule: ``dtype`` if given, else the promotion of the inputs and params."""
    if dtype is not None:
        return np.dtype(dtype)
    return np.dtype(jnp.result_type(inputs, param_dtype))


def run_sequence(
    cell, inputs, time_major, initial_carry, return_carry, initialize_carry, *, precision=None, impl: str | None = None
):
    """The body of the linen and nnx ``BlockSparseLSTM``: batch-major in and out, ``cell.sequence``.

    Args:
      cell: a linen or nnx block-sparse cell (its ``sequence(carry, xs, precision=, impl=)``
        runs the op).
      inputs: [*batch, T, D] (or [T, *batch, D] with ``time_major``).
      time_major, return_carry: the layer's settings.
      initial_carry: (c, h) [*batch, H], or None for ``initialize_carry(batch + (D,))``.
      precision, impl: the layer's (checked); None keeps the cell's own.

    Returns:
      outputs [*batch, T, H] (time-major if ``time_major``), or ``((c_T, h_T), outputs)``.
    """
    if jnp.ndim(inputs) < 2:
        raise ValueError(f"BlockSparseLSTM: inputs must be [*batch, T, D] (at least 2-D), got {jnp.shape(inputs)}")
    xs = inputs if time_major else jnp.moveaxis(inputs, -2, 0)
    carry = initial_carry if initial_carry is not None else initialize_carry(xs.shape[1:])
    carry, ys = cell.sequence(carry, xs, precision=precision, impl=impl)
    if not time_major:
        ys = jnp.moveaxis(ys, 0, -2)
    return (carry, ys) if return_carry else ys
