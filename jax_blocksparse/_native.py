"""Loads the native extension and registers its XLA FFI targets, per platform.

The extension (``jax_blocksparse/_jbs_kernels*.so``, built by ``build.py`` during
``pip install``) always holds the CPU kernels, compiled with the host C++ compiler,
and holds the CUDA kernels too when nvcc was found at build time. It links the CUDA
runtime statically, so it imports on a machine without a GPU. Every handler it
exports through ``registrations()`` is registered here, once, for its platform.
"""

from __future__ import annotations

import functools

import jax

# registrations() keys -> jax platform names used by lowerings.
_PLATFORMS = {"cpu": "cpu", "CUDA": "cuda"}


@functools.cache
def _load():
    """Returns (module, registered platforms, None) or (None, frozenset(), reason)."""
    try:
        from jax_blocksparse import _jbs_kernels  # type: ignore[attr-defined]
    except ImportError as err:
        return None, frozenset(), f"extension not built ({err}); build it with `python build.py`"
    registered = set()
    try:
        for ffi_platform, targets in _jbs_kernels.registrations().items():
            for name, capsule in targets.items():
                jax.ffi.register_ffi_target(name, capsule, platform=ffi_platform, api_version=1)
            registered.add(_PLATFORMS.get(ffi_platform, ffi_platform.lower()))
    except Exception as err:  # noqa: BLE001  (report any registration failure as "not loaded")
        return None, frozenset(), f"extension loaded but its FFI targets could not be registered ({err!r})"
    return _jbs_kernels, frozenset(registered), None


def has_kernels(platform: str) -> bool:
    """Whether native kernels for ``platform`` ("cpu" or "cuda") are built and registered."""
    return platform in _load()[1]


def has_cuda_kernels() -> bool:
    """Whether the CUDA kernels are built and their FFI targets registered."""
    return has_kernels("cuda")


def has_cpu_kernels() -> bool:
    """Whether the native CPU kernels are built and their FFI targets registered."""
    return has_kernels("cpu")


def load_error(platform: str | None = None) -> str | None:
    """Why kernels for ``platform`` (any platform if None) are not available, or None."""
    module, platforms, reason = _load()
    if module is None:
        return reason
    if platform is None or platform in platforms:
        return None
    if platform == "cuda":
        return "the extension was built without CUDA (nvcc was not found at build time); rebuild with nvcc"
    return f"the extension has no kernels for platform {platform!r}"


def extension_info() -> dict:
    """What the extension reports about itself (CPU instruction set, CUDA version, archs).

    Empty when the extension is not loaded.
    """
    module = _load()[0]
    return dict(module.build_info()) if module is not None else {}
