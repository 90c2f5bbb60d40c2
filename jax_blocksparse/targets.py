"""The XLA FFI targets of the native extension: their names, versions and platforms.

Inside the library a kernel has a short name, ``jbs_bsmm_{fprop,bprop,updat}``, the
Hopper variants ``jbs_bsmm_{fprop,bprop,updat}_sm90``, the CPU convolution kernels
``jbs_bsconv`` / ``jbs_bsconv_wgrad`` and the CPU dense path's conversions
``jbs_blocks_to_dense`` / ``jbs_dense_to_blocks`` / ``jbs_transpose`` (the lowering, the crossover table
and the benchmarks' rows use these). A compiled program calls each kernel through an FFI
target whose name spells out the package and a version::

    >>> from jax_blocksparse import targets
    >>> targets.target_name("jbs_bsmm_fprop")
    'jax_blocksparse_bsmm_fprop_v1'
    >>> targets.kernel_of("jax_blocksparse_bsmm_updat_sm90_v1")
    'jbs_bsmm_updat_sm90'

These names are what a serialized program (:mod:`jax.export`) stores. The extension
registers them with XLA when ``jax_blocksparse`` is imported; a process that loads such a
program without that import fails with XLA's ``No FFI handler registered for
jax_blocksparse_bsmm_fprop_v1``, which names the package to import.

This table is the one place the names are defined: the lowering emits
:func:`target_name`, :func:`jax_blocksparse.export.disabled_checks` allows every name
of :func:`all_targets`, and the extension's ``registrations()`` (cuda/module.cc)
reports exactly these names (checked by tests/test_export.py).

Compatibility promise (what a version means):

* A target's version changes whenever a program serialized today could run differently
  against the new handler: its operands (number, order, dtypes, shapes or their meaning),
  its attributes (names, types, meaning), its results (number, dtypes, shapes), or its
  semantics (what it computes, the rounding it promises: e.g. the precision a float32
  product runs at). Faster kernels with the same results keep the version.
* A new version is registered beside the old one. The old one stays registered, with its
  old behaviour, for at least the next 3 minor releases of jax-blocksparse and at least
  6 months after the release that superseded it, whichever is longer (JAX keeps its own
  custom calls 6 months): a program exported by release ``0.x`` runs on ``0.x`` to
  ``0.(x+3)`` at least. Dropping one is written in the release notes.
* The lowering always emits the newest version. Exported programs also depend on JAX's
  own compatibility window for the serialized StableHLO (see JAX's export docs).
"""

from __future__ import annotations

import re

#: How every FFI target name of the library starts: the package's name.
PREFIX = "jax_blocksparse_"
_KERNEL_PREFIX = "jbs_"

#: kernel -> versions of its FFI target that the extension registers, oldest first;
#: the lowering emits the newest (the last).
VERSIONS: dict[str, tuple[int, ...]] = {
    "jbs_bsmm_fprop": (1,),
    "jbs_bsmm_bprop": (1,),
    "jbs_bsmm_updat": (1,),
    "jbs_bsmm_fprop_sm90": (1, 2),
    "jbs_bsmm_bprop_sm90": (1, 2),
    "jbs_bsmm_updat_sm90": (1,),
    "jbs_bsconv": (1,),
    "jbs_bsconv_wgrad": (1,),
    "jbs_blocks_to_dense": (1, 2),
    "jbs_dense_to_blocks": (1,),
    "jbs_transpose": (1,),
}

#: Kernels with a CPU handler only: on CUDA the convolution runs as bsmm products, and the
#: dense path's conversions (between blocks and a dense matrix, updat's x^T) are XLA's
#: scatter, gather and transpose.
_CPU_ONLY = frozenset({"jbs_bsconv", "jbs_bsconv_wgrad", "jbs_blocks_to_dense", "jbs_dense_to_blocks", "jbs_transpose"})

#: kernel -> the JAX platforms whose handlers the extension holds: the portable kernels
#: on "cpu" and "cuda" (the latter when built with nvcc), the Hopper ones on "cuda" in a
#: build for sm_90a only, the convolution ones on "cpu" only.
PLATFORMS: dict[str, tuple[str, ...]] = {
    kernel: ("cuda",) if kernel.endswith("_sm90") else ("cpu",) if kernel in _CPU_ONLY else ("cpu", "cuda")
    for kernel in VERSIONS
}

_TARGET_RE = re.compile(rf"^{PREFIX}(\w+?)_v(\d+)$")


def _check_kernel(kernel: str) -> None:
    if kernel not in VERSIONS:
        raise ValueError(f"unknown kernel {kernel!r}: expected one of {sorted(VERSIONS)}")


def target_name(kernel: str, version: int | None = None) -> str:
    """The FFI target name of ``kernel`` (e.g. "jbs_bsmm_fprop") at ``version`` (the newest
    when None): ``"jax_blocksparse_" + kernel without "jbs_" + "_v" + version``."""
    _check_kernel(kernel)
    if version is None:
        version = VERSIONS[kernel][-1]
    elif version not in VERSIONS[kernel]:
        raise ValueError(f"kernel {kernel!r} has no version {version!r}: it has {VERSIONS[kernel]}")
    return f"{PREFIX}{kernel.removeprefix(_KERNEL_PREFIX)}_v{version}"


def kernel_of(target: str) -> str | None:
    """The kernel an FFI target name calls (any registered version), or None where
    ``target`` is not one of this library's targets."""
    m = _TARGET_RE.match(target)
    if m is None:
        return None
    kernel = _KERNEL_PREFIX + m.group(1)
    return kernel if int(m.group(2)) in VERSIONS.get(kernel, ()) else None


def all_targets(platform: str | None = None) -> tuple[str, ...]:
    """Every FFI target name the extension registers (every version of every kernel), for
    ``platform`` ("cpu" or "cuda") or for any platform when None; sorted."""
    if platform not in (None, "cpu", "cuda"):
        raise ValueError(f"platform must be 'cpu', 'cuda' or None; got {platform!r}")
    return tuple(
        sorted(
            target_name(kernel, version)
            for kernel, versions in VERSIONS.items()
            if platform is None or platform in PLATFORMS[kernel]
            for version in versions
        )
    )
