"""Which implementation the ops lower to: native kernels or the pure-JAX reference.

``"auto"`` (default) uses the native kernels where they are built and verified for
the platform and faster than the dense product at the layout's density (the crossover
table, :mod:`jax_blocksparse.crossover`), the dense product where they are built but
slower, else the reference; ``"reference"`` always uses the pure-JAX reference (for
debugging and comparison); ``"dense"`` always scatters the present blocks into a dense
weight and multiplies with XLA's dot (same values, dense cost); ``"kernels"`` demands
the native kernels and fails at lowering time if they are not built.

Choose it per call with the ``impl=`` argument of the ops (:func:`~jax_blocksparse.bsmm`,
:func:`~jax_blocksparse.bsmm_updat`, :func:`~jax_blocksparse.bsconv`,
:func:`~jax_blocksparse.bsconv_transpose`), as ``precision=`` is chosen for
:func:`jax.lax.dot_general`. ``impl=None`` (the default) reads the default in force
when the op is traced: the innermost :func:`implementation` context, else the
environment variable ``JAX_BLOCKSPARSE_IMPL``, else ``"auto"``::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5), block_size=16)
    >>> x, w = jnp.ones((8, 64)), jnp.ones(layout.w_shape)
    >>> y = jbs.bsmm(x, w, layout, impl="reference")        # this call only
    >>> f = jax.jit(lambda x, w: jbs.bsmm(x, w, layout))
    >>> with jbs.config.implementation("reference"):        # the default for calls traced inside
    ...     print(jbs.config.get_implementation())
    ...     y = f(x, w)
    reference

The choice is stored in the primitives' ``impl`` parameter, so it is part of the
jaxpr, and the JVP, transpose and batching rules keep it: the gradient of a call
lowers the way the call does.

The context's value is part of ``jax.jit``'s cache key (a :func:`jax.make_user_context`),
so JAX's caches are never cleared. A jitted function called inside the context is
looked up (and, the first time, traced and compiled) for that setting, and its
programs for other settings stay cached: leaving the context finds them again, and
functions that were never called inside it are not touched. Like any setting in
the cache key (e.g. :func:`jax.default_matmul_precision`), it is the context in
force when a jitted function is *called* that counts, also for functions whose
graph holds no block-sparse op.

The environment variable is read when an op is traced and is not part of the cache
key: set it before the process starts (or before anything using the ops is
traced); to switch within a process use the context or ``impl=``.
"""

from __future__ import annotations

import contextlib
import os

import jax

IMPLEMENTATIONS = ("auto", "reference", "kernels", "dense")
ENV_VAR = "JAX_BLOCKSPARSE_IMPL"


def _make_jit_keyed_context():
    """A JAX user context (the value set by :func:`implementation`) in jit's cache keys.

    ``jax.make_user_context`` is public API: changing its value misses jit's tracing,
    lowering and compilation caches, and each value keeps its own entries. It is made
    once, at import, before anything here is traced. Returns None on a jax without it;
    :func:`implementation` then raises (``impl=`` and the environment variable work
    on any jax).
    """
    make = getattr(jax, "make_user_context", None)
    return None if make is None else make(None)


_context = _make_jit_keyed_context()


def _check(value, source: str) -> str:
    if not isinstance(value, str) or value not in IMPLEMENTATIONS:
        raise ValueError(f"{source} must be one of {IMPLEMENTATIONS}, got {value!r}")
    return value


def get_implementation() -> str:
    """The default in force: the innermost :func:`implementation` context, else the
    environment variable ``JAX_BLOCKSPARSE_IMPL`` (case and spaces ignored), else "auto"."""
    value = None if _context is None else _context.value
    if value is not None:
        return value
    return _check(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


def canonical_impl(impl, *, name: str = "impl") -> str:
    """The ``impl=`` argument of an op resolved to one of :data:`IMPLEMENTATIONS`.

    None reads :func:`get_implementation` now (at trace time, as ``precision=None``
    reads :func:`jax.default_matmul_precision`); a string must be one of
    :data:`IMPLEMENTATIONS`, else a ``ValueError`` naming ``name``.
    """
    if impl is None:
        return get_implementation()
    if not isinstance(impl, str) or impl not in IMPLEMENTATIONS:
        raise ValueError(f"{name} must be None or one of {IMPLEMENTATIONS}, got {impl!r}")
    return impl


@contextlib.contextmanager
def implementation(value: str):
    """Sets the default implementation ("auto", "reference", "kernels" or "dense") inside.

    Ops called with ``impl=None`` and traced inside use ``value``; an explicit
    ``impl=`` wins. Nests (the innermost wins) and beats the environment variable.
    The value is part of ``jax.jit``'s cache key, so functions jitted before are
    traced anew when called inside, without clearing any cache (module docstring).
    Thread-local, like JAX's own contexts.
    """
    value = _check(value, "implementation")
    if _context is None:
        raise RuntimeError(
            f"jbs.config.implementation needs jax.make_user_context, which jax {jax.__version__} "
            f"lacks: pass impl= to the ops, or set {ENV_VAR} before starting the process"
        )
    with _context(value):
        yield
