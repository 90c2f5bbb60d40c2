"""Exporting programs that use the library with :mod:`jax.export`.

``jax.export.export`` refuses custom calls whose targets have no compatibility
guarantee it knows of. The native kernels' FFI targets are versioned, with a written
promise (:mod:`jax_blocksparse.targets`); :func:`disabled_checks` lists the safety-check
exceptions for them, and :func:`export` is ``jax.export.export`` with those added::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5, seed=0), block_size=8)
    >>> w = jnp.ones(layout.w_shape)
    >>> f = jax.jit(lambda x, w: jbs.bsmm(x, w, layout))
    >>> exported = jbs.export.export(f, platforms=("cpu", "cuda"))(jnp.ones((2, 32)), w)
    >>> blob = exported.serialize()                  # bytes (needs the flatbuffers package)
    >>> restored = jax.export.deserialize(blob)      # here, or in another process
    >>> bool(jnp.array_equal(restored.call(jnp.ones((2, 32)), w), f(jnp.ones((2, 32)), w)))
    True

The process that runs a deserialized program must ``import jax_blocksparse`` first
when the program calls the native kernels (the import registers their targets);
without it XLA fails with ``No FFI handler registered for jax_blocksparse_...``. A
program exported with ``impl="reference"`` (or ``"dense"``) calls no custom call of
this library and needs nothing at load time, unless it takes a :class:`Layout` as an
argument: the layout's pytree is registered for serialization (names
``jax_blocksparse.Layout``, ``jax_blocksparse.LayoutTables``) at import too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

import jax

from jax_blocksparse import targets
from jax_blocksparse.layout import Layout, LayoutTables


def disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """The ``disabled_checks`` that let ``jax.export.export`` serialize the library's custom
    calls: one ``DisabledSafetyCheck.custom_call`` per FFI target name, every platform and
    every registered version (:func:`jax_blocksparse.targets.all_targets`).

    Pass it as ``jax.export.export(f, disabled_checks=jbs.export.disabled_checks())``, or
    use :func:`export`. It allows these targets only: any other custom call without a
    compatibility guarantee is still refused."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in targets.all_targets()]


def export(
    fun_jit: Callable,
    *,
    platforms: Sequence[str] | None = None,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
    **kwargs,
) -> Callable[..., jax.export.Exported]:
    """``jax.export.export(fun_jit, ...)`` with the library's targets allowed.

    Args:
      fun_jit: the function to export, a ``jax.jit`` of it (as ``jax.export.export`` takes).
      platforms: as in ``jax.export.export`` (the default backend's platform when None);
        several at once, e.g. ``("cpu", "cuda")``, work on a machine without a GPU.
      disabled_checks: further safety checks to disable, added to the library's.
      **kwargs: passed on to ``jax.export.export``.

    Returns:
      what ``jax.export.export`` returns: a function of example arguments (or
      ``jax.ShapeDtypeStruct`` specs) giving a :class:`jax.export.Exported`.
    """
    if isinstance(platforms, str):
        raise TypeError(f"platforms must be a sequence of platform names, got the string {platforms!r}")
    extra = list(disabled_checks)
    if not all(isinstance(c, jax.export.DisabledSafetyCheck) for c in extra):
        raise TypeError(f"disabled_checks must hold jax.export.DisabledSafetyCheck objects, got {extra!r}")
    ours = [c for c in _disabled_checks() if c not in extra]
    return jax.export.export(fun_jit, platforms=platforms, disabled_checks=[*extra, *ours], **kwargs)


_disabled_checks = disabled_checks  # export()'s argument of the same name hides it there


# The Layout pytree in serialized in/out trees (registered at import).


def _layout_aux_bytes(aux) -> bytes:
    block_size, grid, capacity = aux
    return json.dumps({"block_size": block_size, "grid": list(grid), "capacity": capacity}).encode()


def _layout_aux_from_bytes(data: bytes):
    d = json.loads(data)
    return (int(d["block_size"]), (int(d["grid"][0]), int(d["grid"][1])), int(d["capacity"]))


jax.export.register_pytree_node_serialization(
    Layout,
    serialized_name="jax_blocksparse.Layout",
    serialize_auxdata=_layout_aux_bytes,
    deserialize_auxdata=_layout_aux_from_bytes,
)
jax.export.register_namedtuple_serialization(LayoutTables, serialized_name="jax_blocksparse.LayoutTables")
