"""Per-platform lowering of an op's primitives: the one place that picks a path.

Every platform gets the pure-JAX reference (``mlir.lower_fun``). On "cuda" the
primitive's ``impl`` parameter (see :mod:`jax_blocksparse.config`) chooses between
the reference and the XLA FFI custom call into the CUDA extension:

* ``"reference"``: never the kernels.
* ``"kernels"``: always the kernels; a clear ``RuntimeError`` at lowering time when the
  extension is not built.
* ``"auto"``: the kernels when the extension is loaded *and* the op's target is listed
  in :data:`VERIFIED_CUDA_TARGETS` (checked against the reference on GPU hardware),
  else the reference. A kernel that gives a wrong answer is worse than none.

The kernel lowering is itself ``mlir.lower_fun`` of a small jnp function
(:func:`_kernel_call`): it computes the extra int32 operands a target wants (see
:data:`_EXTRA_OPERANDS`) on the device, calls ``jax.ffi.ffi_call`` and casts the result
to the requested dtype. The layout stays data: no host reads, no recompiles when it
changes.

Operands of the bsmm targets (documented with the handlers in cuda/bsmm_handlers.cc):
``a, b, block_rows, block_cols, col_ptr, row_ptr, row_slots`` and, for fprop and bprop
only, ``order``: the output block columns (fprop) or block rows (bprop) sorted by their
number of blocks, longest first, so that the longest outputs start first (load balance).
The handlers write the input dtype or float32; any other requested dtype is produced by
casting a float32 result.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_blocksparse import _cuda
from jax_blocksparse.ops._partitioning import partitioned

# FFI targets whose kernels have been checked against the reference on a GPU
# (tests/gpu/test_bsmm_kernels.py and tests/gpu/run_sanitizer.sh). Only these are used by
# implementation "auto". Empty until someone runs those tests on GPU hardware.
VERIFIED_CUDA_TARGETS: frozenset[str] = frozenset()


def _reference_rule(reference: Callable):
    return mlir.lower_fun(reference, multiple_results=False)


def cuda_kernels_selected(impl: str, target: str | None = None) -> bool:
    """Whether a primitive traced with ``impl`` lowers to the CUDA kernel ``target``.

    Raises a clear error (at lowering time) when kernels are demanded but not built.
    """
    if impl == "reference":
        return False
    if impl == "kernels":
        if _cuda.has_cuda_kernels():
            return True
        raise RuntimeError(
            "jax_blocksparse: implementation 'kernels' was requested for platform 'cuda' "
            f"but the CUDA extension is not available: {_cuda.load_error()}. Build it with "
            "`python build.py` (needs nvcc), or use implementation 'auto' or 'reference'."
        )
    return _cuda.has_cuda_kernels() and target is not None and target in VERIFIED_CUDA_TARGETS


# ---------------------------------------------------------------------------------
# The kernel call
# ---------------------------------------------------------------------------------


def _longest_first(ptr):
    """int32 permutation of the segments of ``ptr`` ([S + 1]), longest first (stable)."""
    lengths = ptr[1:] - ptr[:-1]
    return jnp.argsort(-lengths, stable=True).astype(jnp.int32)


def _bsmm_order_by_cols(a, b, block_rows, block_cols, col_ptr, row_ptr, row_slots):
    return (_longest_first(col_ptr),)


def _bsmm_order_by_rows(a, b, block_rows, block_cols, col_ptr, row_ptr, row_slots):
    return (_longest_first(row_ptr),)


# target -> function of the operands returning the extra operands appended to them.
_EXTRA_OPERANDS: dict[str, Callable] = {
    "jbs_bsmm_fprop": _bsmm_order_by_cols,
    "jbs_bsmm_bprop": _bsmm_order_by_rows,
}

# Output dtypes a handler can write besides the input dtype.
_KERNEL_OUT_DTYPES = (np.dtype(np.float32),)


def _kernel_call(target: str, out_shape, out_dtype, *operands):
    """jnp function: extra operands, the FFI custom call, the cast to ``out_dtype``."""
    out_dtype = np.dtype(out_dtype)
    in_dtype = np.dtype(operands[0].dtype)
    kernel_dtype = out_dtype if out_dtype in (in_dtype, *_KERNEL_OUT_DTYPES) else np.dtype(np.float32)
    extra = _EXTRA_OPERANDS.get(target, lambda *_: ())(*operands)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(tuple(out_shape), kernel_dtype))
    return call(*operands, *extra).astype(out_dtype)


def _kernel_rule(target: str):
    def rule(ctx, *operands):
        (aval_out,) = ctx.avals_out
        fun = functools.partial(_kernel_call, target, aval_out.shape, aval_out.dtype)
        return mlir.lower_fun(fun, multiple_results=False)(ctx, *operands)

    return rule


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
    mlir.register_lowering(primitive, partitioned(primitive, reference_rule))
    if cpu_reference is not None:
        mlir.register_lowering(primitive, partitioned(primitive, _reference_rule(cpu_reference)), platform="cpu")
    kernel_rule = _kernel_rule(cuda_target)

    def cuda_rule(ctx, *operands, impl, **params):
        if cuda_kernels_selected(impl, cuda_target):
            return kernel_rule(ctx, *operands)
        return reference_rule(ctx, *operands, impl=impl, **params)

    mlir.register_lowering(primitive, partitioned(primitive, cuda_rule), platform="cuda")


def describe_path(platform: str, impl: str) -> str:
    """One line saying which path bsmm takes on ``platform`` under ``impl`` (for reports)."""
    if platform != "cuda":
        return "pure-JAX reference (no native kernels for this platform)"
    if impl == "reference":
        return "pure-JAX reference (implementation 'reference')"
    built = _cuda.has_cuda_kernels()
    if impl == "kernels":
        return "CUDA kernels" if built else f"error at lowering: kernels requested but {_cuda.load_error()}"
    if not built:
        return f"pure-JAX reference (CUDA extension not available: {_cuda.load_error()})"
    verified = sorted(VERIFIED_CUDA_TARGETS)
    if verified:
        return f"CUDA kernels for {', '.join(verified)}; reference for the rest"
    return (
        "pure-JAX reference: the CUDA kernels are built but not yet verified on GPU hardware "
        "(set JAX_BLOCKSPARSE_IMPL=kernels to use them)"
    )
