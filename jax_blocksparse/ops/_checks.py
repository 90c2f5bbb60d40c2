"""Argument checks and dtype/precision rules shared by the op modules (matmul, conv).

Each raises a ``TypeError``/``ValueError`` that names the argument and its dtype,
shape or value. Used by :mod:`jax_blocksparse.ops.matmul`, :mod:`jax_blocksparse.ops.conv`
and the layers; not part of the public API (the module is private, its functions are
the shared vocabulary of the package).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

#: The float dtypes every op takes (accumulation is always float32).
SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def as_float_array(a, name):
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        a = jnp.asarray(a)
    if not any(np.dtype(a.dtype) == np.dtype(d) for d in SUPPORTED_DTYPES):
        raise TypeError(
            f"{name} must be float32, bfloat16 or float16, got {np.dtype(a.dtype)} with shape {tuple(a.shape)}"
        )
    return a


def out_dtype_of(requested, *input_dtypes, name="out_dtype"):
    """The requested output dtype (``name`` is the argument, for the error), else the promoted one."""
    if requested is None:
        return np.dtype(functools.reduce(jnp.promote_types, input_dtypes))
    dtype = np.dtype(requested)
    if not any(dtype == np.dtype(d) for d in SUPPORTED_DTYPES):
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype}")
    return dtype


def compute_dtype_of(requested, *input_dtypes):
    """``compute_dtype`` checked (a supported float dtype), else the promoted input dtype."""
    return out_dtype_of(requested, *input_dtypes, name="compute_dtype")


def check_float32_dw(op: str, float32_dw, w, compute) -> bool:
    """Validates ``float32_dw``; True when the float32-dW product is needed."""
    if not isinstance(float32_dw, (bool, np.bool_)):
        raise TypeError(f"{op}: float32_dw must be a bool, got {float32_dw!r}")
    if not float32_dw:
        return False
    if np.dtype(w.dtype) != np.dtype(np.float32):
        raise ValueError(
            f"{op}: float32_dw=True needs a float32 w (its gradient has w's dtype), got w "
            f"{np.dtype(w.dtype)} with shape {tuple(w.shape)}"
        )
    return np.dtype(compute) != np.dtype(np.float32)


def canonical_precision(precision, *, name: str = "precision"):
    """``precision`` as :func:`jax.lax.dot_general` takes it, resolved to one value.

    Returns a :class:`jax.lax.Precision`, or None for XLA's default. None reads
    :func:`jax.default_matmul_precision` now (at trace time, as ``dot_general``
    does), so a primitive records the precision it was traced with. A pair (lhs,
    rhs) resolves to the higher of the two: a product is only as exact as its less
    exact operand allows, and XLA runs it at the higher request.
    """
    if precision is None:
        default = jax.config.jax_default_matmul_precision
        try:
            return None if default is None else lax.Precision(default)
        except ValueError:  # an algorithm name (e.g. "F32_F32_F32"): XLA's default here
            return None
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise ValueError(f"{name} must be one value or a (lhs, rhs) pair, got {precision!r}")
        pair = [canonical_precision(p, name=name) or lax.Precision.DEFAULT for p in precision]
        return max(pair, key=lambda p: p.value)
    if isinstance(precision, lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return lax.Precision(precision)
        except ValueError:
            pass
    raise TypeError(
        f"{name} must be None, a jax.lax.Precision, one of its names ('default', 'high', 'highest', "
        f"'bfloat16', 'tensorfloat32', 'float32') or a pair of them, got {precision!r}"
    )


def varying_axes(aval) -> frozenset:
    """The shard_map mesh axes an aval varies over (jax 0.10 and 0.11 spell it differently)."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def pvary(x, axes: tuple):
    """``x`` marked device-varying over the shard_map mesh ``axes`` (a cast, no data moves).

    ``jax.lax.pcast(x, axes, to="varying")`` from jax 0.8.2 on; ``jax.lax.pvary`` before
    (removed in jax 0.10)."""
    pcast = getattr(lax, "pcast", None)
    if pcast is not None:
        return pcast(x, axes, to="varying")
    return lax.pvary(x, axes)
