"""Dynamic loss scaling for float16 training, as an optax ``GradientTransformation``.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the
loss by a scale S before differentiating lifts the gradients into range; dividing
them by S afterwards gives the true gradients. S is chosen dynamically: a step whose
scaled gradients are not finite (overflow) is skipped and S shrinks; after
``growth_interval`` finite steps in a row S grows. bfloat16 has float32's exponent
range and does not need this.

:func:`dynamic_loss_scaling` wraps any optax optimizer and keeps S in the optimizer
state, so it composes with ``optax.chain``, ``optax.apply_updates`` and
``flax.nnx.Optimizer``::

    import optax
    from jax_blocksparse import mixed_precision as jmp   # also in jax_blocksparse.training

    tx = jmp.dynamic_loss_scaling(optax.adam(1e-3))
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        def scaled_loss(p):
            loss = loss_fn(p, x, y)                        # float32 loss of a float16 model
            return jmp.scale_loss(loss, opt_state), loss
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)   # unscales, or skips
        return optax.apply_updates(params, updates), opt_state, loss

The update step: ``grads / S`` go to the inner optimizer when every scaled gradient
is finite; otherwise the updates are zero (``apply_updates`` leaves the params as
they are) and the inner optimizer state is kept, so the step is skipped entirely.
Clipping and other gradient transformations belong inside ``inner``: they then see
the unscaled gradients.

Why not ``flax.training.dynamic_scale.DynamicScale`` (still in flax 0.12.8)? It
wraps ``jax.value_and_grad`` and returns a finite flag, but skipping is left to the
caller (``jnp.where`` over params and optimizer state by hand), it is not an optax
transformation (so it does not plug into ``nnx.Optimizer`` or ``optax.chain``), it
grows the scale after ``growth_interval + 1`` finite steps, and its Python-float
fields make the first jitted call retrace. This module puts the whole policy in the
optimizer state instead.

It depends on optax only, not on the layers or on dynamic sparse training;
:mod:`jax_blocksparse.training` re-exports its names.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["LossScaleState", "all_finite", "dynamic_loss_scaling", "loss_scale", "scale_loss"]


class LossScaleState(NamedTuple):
    """State of :func:`dynamic_loss_scaling` (a pytree of arrays; jit-friendly).

    Attributes:
      scale: float32 [], the current loss scale S.
      good_steps: int32 [], finite steps in a row since S last changed.
      skipped_steps: int32 [], non-finite steps skipped so far (for logging).
      inner_state: the wrapped optimizer's state.
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array
    inner_state: Any


def all_finite(tree) -> jax.Array:
    """bool []: whether every element of every array leaf of ``tree`` is finite."""
    leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(tree)]
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.asarray(True)


def _positive_number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"dynamic_loss_scaling: {name} must be a number, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"dynamic_loss_scaling: {name} must be a finite number > 0, got {value!r}")
    return value


def dynamic_loss_scaling(
    inner: optax.GradientTransformation,
    *,
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` with dynamic loss scaling: unscale, skip non-finite steps, adapt S.

    Differentiate ``scale_loss(loss, opt_state)`` (the loss times the current S) and
    pass those scaled gradients to ``update``. Per step:

    * all scaled gradients finite: ``inner`` updates with ``grads / S`` (computed in
      float32, returned in each gradient's dtype); after ``growth_interval`` such
      steps in a row, S becomes ``min(S * growth_factor, max_scale)``.
    * any inf or nan: zero updates, ``inner``'s state unchanged, S becomes
      ``max(S * backoff_factor, min_scale)``, the run of finite steps restarts.

    Args:
      inner: the optimizer (any ``optax.GradientTransformation``).
      initial_scale: S at step 0 (default 2**15).
      growth_interval: finite steps in a row before S grows (default 2000).
      growth_factor: S's growth, >= 1 (default 2).
      backoff_factor: S's shrink on overflow, in (0, 1) (default 0.5).
      min_scale, max_scale: bounds of S (default 1 and 2**24);
        ``min_scale <= initial_scale <= max_scale``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LossScaleState` (extra arguments are passed on to ``inner``).

    Example::

        >>> import jax.numpy as jnp, optax
        >>> from jax_blocksparse import mixed_precision as jmp
        >>> tx = jmp.dynamic_loss_scaling(optax.sgd(0.5), initial_scale=2.0**10)
        >>> params = {"w": jnp.ones(3, jnp.float16)}
        >>> state = tx.init(params)
        >>> updates, state = tx.update({"w": jnp.full(3, 2048.0, jnp.float16)}, state, params)
        >>> updates["w"].tolist(), float(jmp.loss_scale(state))      # -0.5 * 2048 / 1024
        ([-1.0, -1.0, -1.0], 1024.0)
        >>> updates, state = tx.update({"w": jnp.full(3, jnp.inf, jnp.float16)}, state, params)
        >>> updates["w"].tolist(), float(jmp.loss_scale(state)), int(state.skipped_steps)   # skipped
        ([0.0, 0.0, 0.0], 512.0, 1)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        raise TypeError(f"dynamic_loss_scaling: inner must be an optax GradientTransformation, got {inner!r}")
    initial_scale = _positive_number(initial_scale, "initial_scale")
    growth_factor = _positive_number(growth_factor, "growth_factor")
    backoff_factor = _positive_number(backoff_factor, "backoff_factor")
    min_scale = _positive_number(min_scale, "min_scale")
    max_scale = _positive_number(max_scale, "max_scale")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)) or growth_interval < 1:
        raise ValueError(f"dynamic_loss_scaling: growth_interval must be an int >= 1, got {growth_interval!r}")
    if growth_factor < 1:
        raise ValueError(f"dynamic_loss_scaling: growth_factor must be >= 1, got {growth_factor}")
    if backoff_factor >= 1:
        raise ValueError(f"dynamic_loss_scaling: backoff_factor must be in (0, 1), got {backoff_factor}")
    if not min_scale <= initial_scale <= max_scale:
        raise ValueError(
            "dynamic_loss_scaling: need min_scale <= initial_scale <= max_scale, got "
            f"min_scale={min_scale}, initial_scale={initial_scale}, max_scale={max_scale}"
        )
    if max_scale > float(jnp.finfo(jnp.float32).max):
        raise ValueError(f"dynamic_loss_scaling: max_scale must fit in float32, got {max_scale}")
    interval = int(growth_interval)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return LossScaleState(
            scale=jnp.asarray(initial_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
        )

    def update_fn(updates, state, params=None, **extra_args):
        finite = all_finite(updates)
        inv_scale = 1.0 / state.scale
        grads = jax.tree.map(
            lambda g: jnp.where(finite, g.astype(jnp.float32) * inv_scale, 0.0).astype(g.dtype), updates
        )
        new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        inner_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state)

        grow = finite & (state.good_steps + 1 >= interval)
        scale = jnp.where(
            finite,
            jnp.where(grow, jnp.minimum(state.scale * growth_factor, max_scale), state.scale),
            jnp.maximum(state.scale * backoff_factor, min_scale),
        ).astype(jnp.float32)
        good_steps = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
        skipped = (state.skipped_steps + jnp.where(finite, 0, 1)).astype(jnp.int32)
        return new_updates, LossScaleState(scale, good_steps, skipped, inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find_state(opt_state) -> LossScaleState:
    found = [
        node
        for node in jax.tree.leaves(opt_state, is_leaf=lambda n: isinstance(n, LossScaleState))
        if isinstance(node, LossScaleState)
    ]
    if len(found) != 1:
        raise ValueError(
            "loss_scale: opt_state must hold exactly one LossScaleState (from dynamic_loss_scaling), "
            f"found {len(found)} in a {type(opt_state).__name__}"
        )
    return found[0]


def loss_scale(opt_state) -> jax.Array:
    """float32 []: the current loss scale S held in ``opt_state``.

    ``opt_state`` is the state of :func:`dynamic_loss_scaling` or any optimizer state
    that contains exactly one such state (e.g. inside ``optax.chain``).
    """
    scale = _find_state(opt_state).scale
    if hasattr(scale, "get_value"):  # a flax.nnx.Optimizer wraps state leaves in variables
        scale = scale.get_value()
    return jnp.asarray(scale, jnp.float32)


def scale_loss(loss, opt_state) -> jax.Array:
    """``loss`` (cast to float32) times the current loss scale of ``opt_state``."""
    return jnp.asarray(loss, jnp.float32) * loss_scale(opt_state)
