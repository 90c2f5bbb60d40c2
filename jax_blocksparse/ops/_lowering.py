"""Per-platform lowering of an op's primitives: the one place that picks a path.

Every platform gets the pure-JAX reference (``mlir.lower_fun``). On "cuda" the
primitive's ``impl`` parameter (see :mod:`jax_blocksparse.config`) chooses between
the reference and the XLA FFI custom call into the CUDA extension.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.interpreters import mlir

from jax_blocksparse import _cuda


def _reference_rule(reference: Callable):
    return mlir.lower_fun(reference, multiple_results=False)


def cuda_kernels_selected(impl: str) -> bool:
    """Whether a primitive traced with ``impl`` lowers to the CUDA kernels.

    Raises a clear error (at lowering time) when kernels are demanded but not built.
    """
    if impl == "reference":
        return False
    if _cuda.has_cuda_kernels():
        return True
    if impl == "kernels":
        raise RuntimeError(
            "jax_blocksparse: implementation 'kernels' was requested for platform 'cuda' "
            f"but the CUDA extension is not available: {_cuda.load_error()}. Build it with "
            "`python build.py` (needs nvcc), or use implementation 'auto' or 'reference'."
        )
    return False


def register_lowerings(
    primitive,
    reference: Callable,
    *,
    cuda_target: str,
    cpu_reference: Callable | None = None,
) -> None:
    """Registers the reference lowering everywhere and the CUDA seam on 'cuda'.

    Args:
      primitive: the primitive; its params must include ``impl``.
      reference: pure-JAX function ``(*operands, **params) -> out``.
      cuda_target: the FFI target name the CUDA extension registers.
      cpu_reference: an optional CPU-tuned variant of ``reference``.
    """
    reference_rule = _reference_rule(reference)
    mlir.register_lowering(primitive, reference_rule)
    if cpu_reference is not None:
        mlir.register_lowering(primitive, _reference_rule(cpu_reference), platform="cpu")
    kernel_rule = jax.ffi.ffi_lowering(cuda_target)

    def cuda_rule(ctx, *operands, impl, **params):
        if cuda_kernels_selected(impl):
            return kernel_rule(ctx, *operands)
        return reference_rule(ctx, *operands, impl=impl, **params)

    mlir.register_lowering(primitive, cuda_rule, platform="cuda")
