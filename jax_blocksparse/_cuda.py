"""Loads the compiled extension and registers its XLA FFI targets.

The extension (``jax_blocksparse/_jbs_cuda*.so``, built by ``build.py``) links the
CUDA runtime statically, so it imports on a machine without a GPU. Every target it
exports through ``registrations()`` is registered here, once, for platform "CUDA".
"""

from __future__ import annotations

import functools

import jax


@functools.lru_cache(maxsize=None)
def _load():
    """Returns (module, None) when the extension imports, else (None, reason)."""
    try:
        from jax_blocksparse import _jbs_cuda  # type: ignore[attr-defined]
    except ImportError as err:
        return None, f"extension not built ({err})"
    try:
        for name, capsule in _jbs_cuda.registrations().items():
            jax.ffi.register_ffi_target(name, capsule, platform="CUDA", api_version=1)
    except Exception as err:  # noqa: BLE001  (report any registration failure as "not loaded")
        return None, f"extension loaded but its FFI targets could not be registered ({err!r})"
    return _jbs_cuda, None


def has_cuda_kernels() -> bool:
    """Whether the CUDA extension is built and its FFI targets are registered."""
    return _load()[0] is not None


def load_error() -> str | None:
    """Why the extension did not load, or None when it did."""
    return _load()[1]


def extension_info() -> dict:
    """What the extension reports about itself: CUDA version, architectures, targets.

    Empty when the extension is not loaded.
    """
    module, _ = _load()
    return dict(module.build_info()) if module is not None else {}
