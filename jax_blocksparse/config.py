"""Which implementation the ops lower to: native kernels or the pure-JAX reference.

``"auto"`` (default) uses the native kernels where they are built and verified for
the platform, else the reference; ``"reference"`` always uses the pure-JAX
reference (for debugging and comparison); ``"kernels"`` demands the native kernels
and fails at lowering time if they are not built.

Set it with the environment variable ``JAX_BLOCKSPARSE_IMPL`` or, in Python::

    with jbs.config.implementation("reference"):
        y = jax.jit(f)(x)      # traced (and lowered) inside the context

The choice is read when an op is traced and stored in the primitive's
parameters, so it is part of the jaxpr. ``jax.jit`` caches traces per function
and does not know about this setting, so the context manager clears JAX's caches
when it changes the setting (on entry and on exit): everything called inside is
traced anew with the setting in force, and nothing traced inside leaks out.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax

IMPLEMENTATIONS = ("auto", "reference", "kernels")
ENV_VAR = "JAX_BLOCKSPARSE_IMPL"

_implementation: contextvars.ContextVar[str | None] = contextvars.ContextVar("jbs_impl", default=None)


def _check(value: str, source: str) -> str:
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"{source} must be one of {IMPLEMENTATIONS}, got {value!r}")
    return value


def get_implementation() -> str:
    """The implementation in force: the innermost context, else the env var, else "auto"."""
    value = _implementation.get()
    if value is not None:
        return value
    return _check(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto", ENV_VAR)


@contextlib.contextmanager
def implementation(value: str):
    """Context manager selecting "auto", "reference" or "kernels" for ops traced inside."""
    value = _check(value, "implementation")
    changes = value != get_implementation()
    token = _implementation.set(value)
    if changes:
        jax.clear_caches()
    try:
        yield
    finally:
        _implementation.reset(token)
        if changes:
            jax.clear_caches()
