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
    "BASELINE",
    "HOPPER_ENV",
    "KERNELS",
    "VARIANT_ENV",
    "describe_path",
    "hopper_available",
    "hopper_gate",
    "hopper_variants",
    "kernels_selected",
    "lowering_platform",
    "variant_runs",
]

#: The short names of the bsmm kernels (forward, input gradient, weight gradient), as
#: :mod:`jax_blocksparse.targets` and the crossover table name them.
KERNELS: tuple[str, ...] = tuple(sorted(_lowering.BSMM_TARGETS))

#: The environment variable that opens the Hopper gate: ``JAX_BLOCKSPARSE_HOPPER=1`` lets
#: the CUDA lowering pick the sm_90a kernels on a compute capability 9.x GPU before they
#: are listed as verified (see :func:`hopper_available`).
HOPPER_ENV: str = _sm90.HOPPER_ENV

#: The environment variable that names the Hopper targets' kernel variant
#: (``JAX_BLOCKSPARSE_SM90_VARIANT=stacked``, or per op ``fprop=stacked,updat=capped``).
VARIANT_ENV: str = _sm90.VARIANT_ENV

#: The variant every Hopper target has, which runs where nothing chooses another.
BASELINE: str = _sm90.BASELINE


def hopper_variants(kernel: str | None = None) -> tuple[str, ...]:
    """The Hopper targets' kernel variants besides the baseline, as the extension reports
    them: of ``kernel`` ("fprop", "bprop", "updat" or a target name), or of any (None).
    Empty without an extension built for sm_90a::

        >>> from jax_blocksparse.ops import paths
        >>> set(paths.hopper_variants()) <= {"stacked", "capped"}
        True
    """
    ops = ("fprop", "bprop", "updat") if kernel is None else (kernel,)
    return tuple(sorted({v for op in ops for v in _sm90.variants(op)} - {BASELINE}))


def variant_runs(kernel: str, variant: str, mode: str, block_size: int) -> bool:
    """Whether ``variant`` of the Hopper target of ``kernel`` ("fprop", "bprop", "updat" or
    a target name) runs a product of arithmetic ``mode`` ("bfloat16", "float16", "float32",
    "tf32") at ``block_size`` (the baseline runs every product)."""
    return _sm90.variant_runs(kernel, variant, mode, block_size)


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
    return _lowering.lowering_platform(platform)


def describe_path(platform: str | None = None, impl: str | None = None) -> str:
    """One line saying which path bsmm takes on ``platform`` under ``impl``, and why.

    E.g. "native CPU kernels (avx2)", "CUDA kernels", "pure-JAX reference (CUDA kernels
    not available: ...)", or, for ``impl="kernels"`` without them, the error the lowering
    will raise.
    """
    return _lowering.describe_path(lowering_platform(platform), config.canonical_impl(impl))


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
def hopper_gate(open_: bool, *, variant: str | None = None):
    """Inside, :data:`HOPPER_ENV` is ``"1"`` (``open_``: the Hopper kernels, verified or
    not, where they can run) or ``"0"`` (the portable kernels only, verified Hopper ones
    or not), and where ``variant`` is given, ``JAX_BLOCKSPARSE_SM90_VARIANT`` names it
    (the Hopper targets' kernel variant, ops/_sm90.py); restored after. Both are read when
    a program is lowered, so a benchmark lowers each kernel path's programs inside its own
    setting::

        >>> from jax_blocksparse.ops import paths
        >>> import os
        >>> with paths.hopper_gate(False):
        ...     os.environ[paths.HOPPER_ENV]
        '0'
    """
    settings = {HOPPER_ENV: "1" if open_ else "0"}
    if variant is not None:
        settings[_sm90.VARIANT_ENV] = variant
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
