"""Which path the block-sparse products take on a platform: the native kernels or the
pure-JAX reference (and, under "auto", the dense product above a crossover).

The choice is made when an op is lowered, from the platform, the implementation in force
(:mod:`jax_blocksparse.config`), the native extension's build and the kernels verified on
that hardware. These functions give the same answer without lowering anything, for
reports, benchmarks and scripts that size their work by it::

    >>> from jax_blocksparse.ops import paths
    >>> paths.describe_path("cpu", "reference")
    "pure-JAX reference (implementation 'reference')"
    >>> paths.kernels_selected("cpu", "reference")
    False
    >>> paths.KERNELS
    ('jbs_bsmm_bprop', 'jbs_bsmm_fprop', 'jbs_bsmm_updat')

``platform`` is a lowering platform ("cpu", "cuda") or a device's ``platform`` attribute
("gpu" names CUDA there); None is JAX's default backend. ``impl`` is one of
:data:`jax_blocksparse.config.IMPLEMENTATIONS`; None is the default in force
(:func:`jax_blocksparse.config.get_implementation`).
"""

from __future__ import annotations

import contextlib
import os

import jax

from jax_blocksparse import config
from jax_blocksparse.ops import _lowering, _sm90

__all__ = [
    "HOPPER_ENV",
    "KERNELS",
    "describe_path",
    "hopper_available",
    "hopper_gate",
    "kernels_selected",
    "lowering_platform",
]

#: The short names of the bsmm kernels (forward, input gradient, weight gradient), as
#: :mod:`jax_blocksparse.targets` and the crossover table name them.
KERNELS: tuple[str, ...] = tuple(sorted(_lowering.BSMM_TARGETS))

#: The environment variable that opens the Hopper gate: ``JAX_BLOCKSPARSE_HOPPER=1`` lets
#: the CUDA lowering pick the sm_90a kernels on a compute capability 9.x GPU before they
#: are listed as verified (see :func:`hopper_available`).
HOPPER_ENV: str = _sm90.HOPPER_ENV


def lowering_platform(platform: str | None = None) -> str:
    """The lowering platform of ``platform``: "cuda" for a device's "gpu", JAX's default
    backend for None, else ``platform`` itself.

    Example::

        >>> from jax_blocksparse.ops import paths
        >>> paths.lowering_platform("gpu"), paths.lowering_platform("cpu")
        ('cuda', 'cpu')
    """
    if platform is None:
        platform = jax.default_backend()
    if not isinstance(platform, str):
        raise TypeError(f"platform must be a str such as 'cpu', 'cuda' or 'gpu', got {platform!r}")
    return {"gpu": "cuda"}.get(platform, platform)


def describe_path(platform: str | None = None, impl: str | None = None) -> str:
    """One line saying which path bsmm takes on ``platform`` under ``impl``, and why.

    E.g. "native CPU kernels (avx2)", "CUDA kernels", "pure-JAX reference (CUDA kernels
    not available: ...)", or, for ``impl="kernels"`` without them, the error the lowering
    will raise.
    """
    platform, impl = lowering_platform(platform), config.canonical_impl(impl)
    if impl == "dense":
        return "dense product (implementation 'dense': the blocks scattered into a dense weight, then XLA's dot)"
    return _lowering.describe_path(platform, impl)


def kernels_selected(platform: str | None = None, impl: str | None = None, kernel: str | None = None) -> bool:
    """Whether products traced under ``impl`` lower to the native ``kernel`` on ``platform``
    (every one of :data:`KERNELS` when ``kernel`` is None) rather than to the reference.

    Under "auto" a product whose layout holds more blocks than the crossover table allows
    still runs densely on that path (:mod:`jax_blocksparse.crossover`); under "dense" no
    kernel is selected.

    Raises:
      ValueError: ``kernel`` is not one of :data:`KERNELS`, or ``impl`` is unknown.
      RuntimeError: ``impl`` is "kernels" and the platform's kernels are not built (the
        error the lowering raises).
    """
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel must be None or one of {KERNELS}, got {kernel!r}")
    platform, impl = lowering_platform(platform), config.canonical_impl(impl)
    if platform not in _lowering.KERNEL_PLATFORMS:  # no kernel lowering is registered there
        return False
    return all(_lowering.kernels_selected(platform, impl, name) for name in ((kernel,) if kernel else KERNELS))


def hopper_available() -> bool:
    """Whether the Hopper (sm_90a) kernels can run here: the extension was built with them
    and the first CUDA device has compute capability 9.x. The CUDA lowering picks them
    where this holds and the gate is open (:data:`HOPPER_ENV`, or the kernels verified)."""
    if not _sm90.built_targets():
        return False
    try:
        devices = jax.devices("cuda")
    except (RuntimeError, ValueError):  # no CUDA backend
        return False
    capability = getattr(devices[0], "compute_capability", None) if devices else None
    return capability is not None and str(capability).split(".")[0] == "9"


@contextlib.contextmanager
def hopper_gate(open_: bool):
    """Inside, :data:`HOPPER_ENV` is ``"1"`` (``open_``: the Hopper kernels, verified or
    not, where they can run) or ``"0"`` (the portable kernels only, verified Hopper ones
    or not); restored after. The gate is read when a program is lowered, so a benchmark
    lowers each kernel path's programs inside its own setting::

        >>> from jax_blocksparse.ops import paths
        >>> import os
        >>> with paths.hopper_gate(False):
        ...     os.environ[paths.HOPPER_ENV]
        '0'
    """
    before = os.environ.get(HOPPER_ENV)
    os.environ[HOPPER_ENV] = "1" if open_ else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HOPPER_ENV, None)
        else:
            os.environ[HOPPER_ENV] = before
