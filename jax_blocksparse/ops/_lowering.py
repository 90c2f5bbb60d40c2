"""Per-platform lowering of an op's primitives: the one place that picks a path.

Every platform gets the pure-JAX reference (``mlir.lower_fun``) and the dense product.
On "cpu" and "cuda" the primitive's ``impl`` parameter (see :mod:`jax_blocksparse.config`)
chooses between the reference, the dense product and the XLA FFI custom call into the
native extension, which registers the same target names for both platforms
(``_native.py``):

* ``"reference"``: never the kernels.
* ``"dense"``: the present blocks scattered into a dense weight, then XLA's dot (the
  primitive's ``dense`` function): the same values, at dense cost.
* ``"kernels"``: always the kernels; a clear ``RuntimeError`` at lowering time when the
  extension has no kernels for that platform.
* ``"auto"``: the kernels when they are built for the platform *and* the op's target
  is listed as verified for it (:data:`VERIFIED_TARGETS`: checked against the
  reference on that hardware), else the reference. A kernel that gives a wrong answer
  is worse than none. Where the kernels are chosen, the crossover table in force
  (:mod:`jax_blocksparse.crossover`) may send the product to the dense path instead:
  when the layout's block capacity exceeds the density at which that kernel stops
  beating the dense product on this device (:func:`dense_instead`).

The kernel lowering is itself ``mlir.lower_fun`` of a small jnp function
(:func:`_kernel_call`): it picks the operands a target takes (see
:data:`_KERNEL_OPERANDS`), calls ``jax.ffi.ffi_call`` and casts the result to the
requested dtype. Here a "target" is the kernel's short name (``jbs_bsmm_fprop``); the
custom call names its versioned FFI target (``jax_blocksparse_bsmm_fprop_v1``:
:mod:`jax_blocksparse.targets`). The layout stays data: no host reads, no recompiles when it changes,
and no device work besides the product (the work plan, ``col_order``/``row_order``,
is part of the layout's tables).

Operands of the bsmm targets (documented with the shared checks in cuda/bsmm_checks.h):
``a, b, block_rows, block_cols, col_ptr, row_ptr, row_slots`` and, for fprop and bprop
only, ``order``: the layout's ``col_order`` (fprop) or ``row_order`` (bprop), the
output block columns or rows sorted by their number of blocks, longest first, so that
the longest outputs start first (load balance).
The handlers write the input dtype or float32; any other requested dtype is produced by
casting a float32 result.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.interpreters import mlir

from jax_blocksparse import _native, crossover, targets
from jax_blocksparse.layout import LayoutTables
from jax_blocksparse.ops import _sm90
from jax_blocksparse.ops._partitioning import partitioned

KERNEL_PLATFORMS = ("cpu", "cuda")

# FFI targets whose kernels have been checked against the reference on real hardware,
# per platform; only these are used by implementation "auto".
# CPU: the whole test suite runs on the CPU kernels in CI (tests/test_matmul.py runs
# every case on both paths, tests/test_conv_kernels.py the convolution's).
BSMM_TARGETS = frozenset({"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"})
CONV_TARGETS = frozenset({"jbs_bsconv", "jbs_bsconv_wgrad"})  # CPU only (ops/conv_primitives.py)
VERIFIED_CPU_TARGETS: frozenset[str] = BSMM_TARGETS | CONV_TARGETS
# CUDA: tests/gpu/test_bsmm_kernels.py and tests/gpu/run_sanitizer.sh on a GPU. Empty
# until someone runs those tests on GPU hardware.
VERIFIED_CUDA_TARGETS: frozenset[str] = frozenset()


def verified_targets(platform: str) -> frozenset[str]:
    return {"cpu": VERIFIED_CPU_TARGETS, "cuda": VERIFIED_CUDA_TARGETS}.get(platform, frozenset())


def _reference_rule(reference: Callable):
    return mlir.lower_fun(reference, multiple_results=False)


def kernels_selected(platform: str, impl: str, target: str | None = None) -> bool:
    """Whether a primitive traced with ``impl`` lowers to the native ``target`` on ``platform``.

    Raises a clear error (at lowering time) when kernels are demanded but not built.
    """
    if impl in ("reference", "dense"):
        return False
    if impl == "kernels":
        if _native.has_kernels(platform):
            return True
        hint = "needs nvcc at build time" if platform == "cuda" else "needs a C++ compiler"
        raise RuntimeError(
            f"jax_blocksparse: implementation 'kernels' was requested for platform {platform!r} "
            f"but its native kernels are not available: {_native.load_error(platform)}. Build them "
            f"with `python build.py` ({hint}), or use implementation 'auto' or 'reference'."
        )
    if not (_native.has_kernels(platform) and target is not None):
        return False
    if target in verified_targets(platform):
        return True
    # A verified Hopper variant counts where the lowering would pick it (ops/_sm90.py).
    return platform == "cuda" and _sm90.select_target(target, VERIFIED_CUDA_TARGETS) in VERIFIED_CUDA_TARGETS


# ---------------------------------------------------------------------------------
# The kernel call
# ---------------------------------------------------------------------------------


# target -> the operands it takes: the two float operands, the five index tables and,
# for fprop and bprop, the layout's order of the outputs it writes (longest first).
# The primitives carry all seven tables (jax_blocksparse/layout.py).
_KERNEL_OPERANDS: dict[str, Callable] = {
    "jbs_bsmm_fprop": lambda a, b, t: (a, b, *t[:5], t.col_order),
    "jbs_bsmm_bprop": lambda a, b, t: (a, b, *t[:5], t.row_order),
    "jbs_bsmm_updat": lambda a, b, t: (a, b, *t[:5]),
}

# Output dtypes a handler can write besides the input dtype.
_KERNEL_OUT_DTYPES = (np.dtype(np.float32),)


def _kernel_call(target: str, out_shape, out_dtype, *operands, precision=None):
    """jnp function: the FFI custom call on the target's operands, the cast to ``out_dtype``.

    The sm_90 targets also take the ``tf32`` attribute (float32 on TF32 tensor cores at
    ``precision`` None/DEFAULT/HIGH, with some operands transposed: ops/_sm90.py)."""
    out_dtype = np.dtype(out_dtype)
    in_dtype = np.dtype(operands[0].dtype)
    kernel_dtype = out_dtype if out_dtype in (in_dtype, *_KERNEL_OUT_DTYPES) else np.dtype(np.float32)
    a, b, *tables = operands
    result = jax.ShapeDtypeStruct(tuple(out_shape), kernel_dtype)
    base = _sm90.BASE_TARGETS.get(target, target)
    ffi_target = targets.target_name(target)
    if base == target:  # a portable target
        args = _KERNEL_OPERANDS[base](a, b, LayoutTables(*tables))
        return jax.ffi.ffi_call(ffi_target, result)(*args).astype(out_dtype)
    tf32 = _sm90.use_tf32(base, in_dtype, out_shape[-1] if base == "jbs_bsmm_updat" else b.shape[-1], precision)
    if tf32:
        a, b = _sm90.tf32_operands(base, a, b)
    args = _KERNEL_OPERANDS[base](a, b, LayoutTables(*tables))
    if target == "jbs_bsmm_updat_sm90":  # + its split-reduction workspace (ops/_sm90.py)
        bs = out_shape[-1]
        if tf32:  # x^T [C, n], dy^T [K, n]
            n, c, k = a.shape[1], a.shape[0], b.shape[0]
        else:  # x [n..., C], dy [n..., K]
            n, c, k = int(np.prod(a.shape[:-1], dtype=np.int64)), a.shape[-1], b.shape[-1]
        ws = _sm90.updat_workspace_bytes(in_dtype, n, (c // bs, k // bs), out_shape[0], bs, tf32=tf32)
        call = jax.ffi.ffi_call(ffi_target, (result, jax.ShapeDtypeStruct((ws,), np.uint8)))
        return call(*args, tf32=np.bool_(tf32))[0].astype(out_dtype)
    return jax.ffi.ffi_call(ffi_target, result)(*args, tf32=np.bool_(tf32)).astype(out_dtype)


def _kernel_rule(target: str):
    def rule(ctx, *operands, platform: str = "cpu", precision=None):
        (aval_out,) = ctx.avals_out
        # On "cuda", the Hopper variant of the target when its gate is open (ops/_sm90.py).
        name = _sm90.select_target(target, VERIFIED_CUDA_TARGETS) if platform == "cuda" else target
        fun = functools.partial(_kernel_call, name, aval_out.shape, aval_out.dtype, precision=precision)
        return mlir.lower_fun(fun, multiple_results=False)(ctx, *operands)

    return rule


# ---------------------------------------------------------------------------------
# "auto" beside the dense product (jax_blocksparse/crossover.py)
# ---------------------------------------------------------------------------------


def device_kind(platform: str) -> str | None:
    """``device_kind`` of the first device of ``platform``, or None where it has none here
    (cross-lowering for "cuda" on a machine without a GPU)."""
    try:
        devices = jax.devices(platform)
    except (RuntimeError, ValueError):
        return None
    return getattr(devices[0], "device_kind", platform) if devices else None


def kernel_mode(target: str, dtype, block_size: int, precision) -> str:
    """The arithmetic a kernel target runs: "tf32" for float32 on an sm_90 target's TF32
    tensor cores (``_sm90.use_tf32``), else the dtype's name."""
    if target in _sm90.BASE_TARGETS and _sm90.use_tf32(target, dtype, block_size, precision):
        return "tf32"
    return np.dtype(dtype).name


def block_fraction(table_avals) -> float:
    """The layout's block capacity over its grid, from the tables' static shapes."""
    block_rows, _, col_ptr, row_ptr = table_avals[:4]
    grid = (row_ptr.shape[-1] - 1) * (col_ptr.shape[-1] - 1)
    return block_rows.shape[-1] / grid if grid else 0.0


def dense_instead(platform: str, target: str, ctx, *, block_size: int, precision) -> bool:
    """Whether "auto" computes this product densely although ``target``'s kernels are chosen:
    the crossover table in force has an entry for the kernel that runs (the Hopper variant
    where the gate opens it) on this device, and the layout's block capacity exceeds it."""
    name = _sm90.select_target(target, VERIFIED_CUDA_TARGETS) if platform == "cuda" else target
    dtype = ctx.avals_in[0].dtype
    return crossover.prefers_dense(
        platform,
        device_kind(platform),
        name,
        kernel_mode(name, dtype, block_size, precision),
        block_size,
        block_fraction(ctx.avals_in[2:]),
    )


def register_lowerings(
    primitive,
    reference: Callable,
    *,
    target: str,
    dense: Callable,
    cpu_reference: Callable | None = None,
) -> None:
    """Registers the reference and dense lowerings everywhere and the kernel seam on 'cpu'
    and 'cuda'.

    Args:
      primitive: the primitive; its params must include ``impl``, ``block_size`` and
        ``precision``.
      reference: pure-JAX function ``(*operands, **params) -> out``.
      target: the kernel's short name (its versioned FFI target, registered by the native
        extension for both platforms, is ``targets.target_name(target)``).
      dense: pure-JAX function ``(*operands, **params) -> out``: the product through a
        dense weight and XLA's dot (``impl="dense"``, and "auto" above the crossover).
      cpu_reference: an optional CPU-tuned variant of ``reference``.
    """
    reference_rule = _reference_rule(reference)
    dense_rule = _reference_rule(dense)

    def portable_rule(ctx, *operands, impl, **params):
        rule = dense_rule if impl == "dense" else reference_rule
        return rule(ctx, *operands, impl=impl, **params)

    # Every rule is wrapped by the sharding rule (ops/_partitioning.py), so that jit with
    # sharded inputs splits the op over the devices instead of gathering its operands.
    mlir.register_lowering(primitive, partitioned(primitive, portable_rule))
    kernel_rule = _kernel_rule(target)
    for platform in KERNEL_PLATFORMS:
        fallback = _reference_rule(cpu_reference) if platform == "cpu" and cpu_reference else reference_rule

        def rule(ctx, *operands, impl, _platform=platform, _fallback=fallback, **params):
            if impl == "dense":
                return dense_rule(ctx, *operands, impl=impl, **params)
            if kernels_selected(_platform, impl, target):
                precision = params.get("precision")
                if impl == "auto" and dense_instead(
                    _platform, target, ctx, block_size=params["block_size"], precision=precision
                ):
                    return dense_rule(ctx, *operands, impl=impl, **params)
                # precision: the Hopper targets run float32 on TF32 below HIGHEST (ops/_sm90.py).
                return kernel_rule(ctx, *operands, platform=_platform, precision=precision)
            return _fallback(ctx, *operands, impl=impl, **params)

        mlir.register_lowering(primitive, partitioned(primitive, rule), platform=platform)


def describe_path(platform: str, impl: str) -> str:
    """One line saying which path bsmm takes on ``platform`` under ``impl`` (for reports).

    ``platform`` is a lowering platform ("cpu", "cuda") or a device's ``platform``
    attribute ("gpu" names CUDA there)."""
    platform = {"gpu": "cuda"}.get(platform, platform)
    if platform not in KERNEL_PLATFORMS:
        return "pure-JAX reference (no native kernels for this platform)"
    kind = "CUDA kernels" if platform == "cuda" else "native CPU kernels"
    if impl == "reference":
        return "pure-JAX reference (implementation 'reference')"
    built = _native.has_kernels(platform)
    if impl == "kernels":
        return kind if built else f"error at lowering: kernels requested but {_native.load_error(platform)}"
    if not built:
        return f"pure-JAX reference ({kind} not available: {_native.load_error(platform)})"
    verified = sorted(verified_targets(platform))
    if verified_targets(platform) >= BSMM_TARGETS:
        isa = _native.extension_info().get("cpu_isa") if platform == "cpu" else None
        return kind + (f" ({isa})" if isa else "")
    if verified:
        return f"{kind} for {', '.join(verified)}; reference for the rest"
    return (
        f"pure-JAX reference: the {kind} are built but not yet verified on this hardware "
        "(set JAX_BLOCKSPARSE_IMPL=kernels to use them)"
    )
