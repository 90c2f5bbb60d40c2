"""Schedules of dynamic sparse training: how much to prune at a given step.

Every function takes ``step`` as a Python number or a (possibly traced) JAX scalar
and returns a float32 JAX scalar, so the same code runs on the host and inside a
jitted update step (where ``step`` is a traced int and nothing recompiles).

==========================  ====================================================
function                    value at step t
==========================  ====================================================
:func:`cosine_decay`        ``final + (init - final) * (1 + cos(pi * p)) / 2``,
                            p = clip(t / decay_steps, 0, 1) (sparse momentum's
                            prune rate: 0.5 -> 0 over training)
:func:`annealed_fraction`   RigL / SET drop fraction: ``cosine_decay`` until
                            ``end_step``, 0 from then on (updates stop)
:func:`cubic_density`       Zhu & Gupta (2017): ``d_f + (d_i - d_f) (1 - p)^3``,
                            p = clip((t - begin) / (end - begin), 0, 1)
==========================  ====================================================
"""

from __future__ import annotations

import jax.numpy as jnp


def _progress(step, begin, end):
    """clip((step - begin) / (end - begin), 0, 1) as float32; 1 when end <= begin."""
    step = jnp.asarray(step, jnp.float32)
    span = float(end) - float(begin)
    if span <= 0:
        return jnp.where(step >= float(begin), 1.0, 0.0).astype(jnp.float32)
    return jnp.clip((step - float(begin)) / span, 0.0, 1.0)


def cosine_decay(step, decay_steps: int, init_value: float, final_value: float = 0.0):
    """Cosine decay from ``init_value`` at step 0 to ``final_value`` at ``decay_steps``.

    ``cosine_decay(0, T, 0.5) == 0.5``, ``cosine_decay(T / 2, T, 0.5) == 0.25``,
    ``cosine_decay(T, T, 0.5) == 0`` and it stays at ``final_value`` after ``T``.
    This is sparse momentum's prune rate (Dettmers & Zettlemoyer 2019: 0.5 -> 0).
    """
    p = _progress(step, 0, decay_steps)
    return (final_value + (init_value - final_value) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))).astype(jnp.float32)


def annealed_fraction(step, end_step: int, init_fraction: float, schedule: str = "cosine"):
    """RigL's drop fraction (Evci et al. 2020): ``alpha/2 * (1 + cos(pi t / T_end))``.

    Args:
      step: the training step t.
      end_step: T_end; from this step on the fraction is 0 (no more updates).
      init_fraction: alpha, the fraction at step 0 (RigL: 0.3).
      schedule: "cosine" (RigL) or "constant" (SET as in Mocanu et al. 2018: alpha
        at every update before ``end_step``).
    """
    step = jnp.asarray(step, jnp.float32)
    if schedule == "cosine":
        value = cosine_decay(step, end_step, init_fraction, 0.0)
    elif schedule == "constant":
        value = jnp.asarray(init_fraction, jnp.float32)
    else:
        raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
    return jnp.where(step < float(end_step), value, 0.0).astype(jnp.float32)


def cubic_density(step, begin_step: int, end_step: int, final_density, initial_density=1.0):
    """Gradual magnitude pruning's density (Zhu & Gupta 2017), cubic in the progress.

    ``s_t = s_f + (s_i - s_f) (1 - (t - t_0) / (n dt))^3`` written for densities
    ``d = 1 - s``: ``d_t = d_f + (d_i - d_f) (1 - p)^3`` with
    ``p = clip((t - begin_step) / (end_step - begin_step), 0, 1)``. So the density is
    ``initial_density`` until ``begin_step``, falls fastest at first, and reaches
    ``final_density`` at ``end_step``. ``final_density`` may be an array (one per layer).
    """
    p = _progress(step, begin_step, end_step)
    final_density = jnp.asarray(final_density, jnp.float32)
    return (final_density + (initial_density - final_density) * (1.0 - p) ** 3).astype(jnp.float32)
