"""Loads the native extension and registers its XLA FFI targets, per platform.

The extension (``jax_blocksparse/_jbs_kernels*.so``, built by ``CMakeLists.txt`` during
``pip install``, or in place by ``build.py``) always holds the CPU kernels, compiled with
the host C++ compiler, and holds the CUDA kernels too when it was built with nvcc for a
GPU seen at build time or for the architectures ``CUDAARCHS`` named. It links the CUDA
runtime statically, so it imports on a machine without a GPU. Every handler it
exports through ``registrations()`` is registered here, once, for its platform, when
``jax_blocksparse`` is imported (:func:`register`): a program deserialized with
:mod:`jax.export` then finds its targets (names: :mod:`jax_blocksparse.targets`).
A missing or broken extension leaves the package importable: the reference runs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax

from jax_blocksparse import targets

# registrations() keys -> jax platform names used by lowerings.
_PLATFORMS = {"cpu": "cpu", "CUDA": "cuda"}
# The kernels every build holds for a platform it has (those of targets.PLATFORMS that
# name it); the Hopper ones are optional.
_PORTABLE = tuple(k for k in targets.VERSIONS if not k.endswith("_sm90"))


@functools.cache
def _load():
    """Returns (module, {platform: registered target names}, None) or (None, {}, reason)."""
    try:
        from jax_blocksparse import _jbs_kernels  # type: ignore[attr-defined]
    except ImportError as err:  # not built, or built for another Python / missing symbols
        return None, {}, f"extension not built ({err}); build it with `python build.py`"
    except Exception as err:  # noqa: BLE001  (a module whose initialization fails: keep the package importable)
        return None, {}, f"extension failed to load ({err!r}); rebuild it with `python build.py`"
    registered: dict[str, frozenset[str]] = {}
    try:
        for ffi_platform, handlers in _jbs_kernels.registrations().items():
            for name, capsule in handlers.items():
                jax.ffi.register_ffi_target(name, capsule, platform=ffi_platform, api_version=1)
            registered[_PLATFORMS.get(ffi_platform, ffi_platform.lower())] = frozenset(handlers)
    except Exception as err:  # noqa: BLE001  (report any registration failure as "not loaded")
        return None, {}, f"extension loaded but its FFI targets could not be registered ({err!r})"
    return _jbs_kernels, registered, None


def register() -> None:
    """Loads the extension and registers its FFI targets (once; ``import jax_blocksparse``
    calls it). Never raises: :func:`load_error` says what went wrong."""
    _load()


def registered_targets(platform: str) -> frozenset[str]:
    """The FFI target names the extension registered for ``platform`` ("cpu", "cuda")."""
    return _load()[1].get(platform, frozenset())


def _stale(platform: str) -> str | None:
    """Why the extension's targets for ``platform`` are not the ones this package calls
    (an extension built from older sources), or None when they are."""
    names = registered_targets(platform)
    wanted = (k for k in _PORTABLE if platform in targets.PLATFORMS[k])
    missing = sorted(targets.target_name(k) for k in wanted if targets.target_name(k) not in names)
    if not missing:
        return None
    return (
        f"the extension is out of date: it registers {sorted(names)} for {platform!r}, this jax_blocksparse "
        f"calls {missing}; rebuild it with `python build.py` (or reinstall)"
    )


def has_kernels(platform: str) -> bool:
    """Whether native kernels for ``platform`` ("cpu" or "cuda") are built and registered
    under the target names this package calls."""
    return platform in _load()[1] and _stale(platform) is None


def has_cuda_kernels() -> bool:
    """Whether the CUDA kernels are built and their FFI targets registered."""
    return has_kernels("cuda")


def has_cpu_kernels() -> bool:
    """Whether the native CPU kernels are built and their FFI targets registered."""
    return has_kernels("cpu")


def load_error(platform: str | None = None) -> str | None:
    """Why kernels for ``platform`` (any platform if None) are not available, or None."""
    module, registered, reason = _load()
    if module is None:
        return reason
    if platform is None:
        return next(filter(None, map(_stale, registered)), None)
    if platform in registered:
        return _stale(platform)
    if platform == "cuda":
        return (
            "the extension was built without CUDA (no GPU seen and no CUDA architecture named, or no nvcc, "
            "at build time); rebuild with nvcc: `python build.py` on the GPU machine, or "
            'CUDAARCHS="80-real;90a-real;90-virtual" pip install ...'
        )
    return f"the extension has no kernels for platform {platform!r}"


def module():
    """The loaded extension module ``_jbs_kernels``, or None when it is not loaded
    (:func:`load_error` says why)."""
    return _load()[0]


def extension_info() -> dict:
    """What the extension reports about itself (CPU instruction set, CUDA version, archs).

    Empty when the extension is not loaded.
    """
    module = _load()[0]
    return dict(module.build_info()) if module is not None else {}


# What each instruction set of the CPU kernels runs (the extension's ``cpu_isa``).
_CPU_KERNEL_PATHS = {
    "amx": (
        "amx: bfloat16 products and convolutions on AMX tiles (a convolution's weight gradient without unit "
        "steps or with odd line lengths on AVX-512); float32 and float16 on AVX-512"
    ),
    "avx512_bf16": (
        "avx512_bf16: bfloat16 products on AVX512-BF16 dot products; float32, float16 and the convolutions on AVX-512"
    ),
    "avx512": "avx512: AVX-512 FMA, 16-bit inputs widened to float32",
    "avx2": "avx2: AVX2 FMA, 16-bit inputs widened to float32",
    "baseline": "baseline: portable C++, 16-bit inputs widened to float32",
}


def cpu_kernels_in_force() -> str:
    """What the CPU kernels run now: the instruction set in force (``cpu_isa``, which
    ``JAX_BLOCKSPARSE_CPU_ISA`` may lower) and what it does for each dtype; why the variable
    is refused where it is; "unknown" without the extension."""
    info = extension_info()
    if info.get("cpu_isa_error"):
        return info["cpu_isa_error"]
    isa = info.get("cpu_isa")
    if isa is None:
        return "unknown"
    forced = "" if isa == info.get("cpu_isa_detected") else f", forced below {info['cpu_isa_detected']}"
    return _CPU_KERNEL_PATHS.get(isa, isa) + forced


def ptxas_report() -> list[dict] | None:
    """The ptxas report the build kept beside the module (``_jbs_kernels.ptxas.json``,
    written by cmake/ptxas_report.py): per CUDA kernel and architecture its registers,
    shared memory, stack frame and spills. None for a build without CUDA kernels (or
    without the report)."""
    module = _load()[0]
    if module is None or not getattr(module, "__file__", None):
        return None
    path = Path(module.__file__).with_name("_jbs_kernels.ptxas.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
