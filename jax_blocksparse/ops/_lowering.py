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
* ``"auto"``: a native kernel when the extension has the platform's kernels and the
  kernel is verified there (:mod:`jax_blocksparse.verified`: every CPU target; on CUDA the
  gate's keys for the GPU's compute capability, the product's arithmetic mode and block
  size), else the reference. A kernel that gives a wrong answer is worse than none. Among
  the verified kernels of a product (on an sm_90 GPU the Hopper target and the portable
  one) the crossover table in force (:mod:`jax_blocksparse.crossover`) picks the one that
  beats the dense product up to the highest density, and the dense product where the
  layout's block capacity exceeds that density (:func:`auto_choice`).

An op whose kernel exists on only some platforms, or does not take every parameter, names
a composition of other primitives for the rest (``register_lowerings``' ``composed``: the
convolution runs as bsmm products on CUDA, ops/conv_primitives.py); those primitives then
pick their own paths here.

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

from jax_blocksparse import _native, crossover, targets, verified
from jax_blocksparse.layout import LayoutTables
from jax_blocksparse.ops import _sm90
from jax_blocksparse.ops._partitioning import partitioned

KERNEL_PLATFORMS = ("cpu", "cuda")

BSMM_TARGETS = frozenset({"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"})
CONV_TARGETS = frozenset({"jbs_bsconv", "jbs_bsconv_wgrad"})  # CPU only (ops/conv_primitives.py)
DENSE = "dense"  # auto_choice's answer where the dense product is the faster


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
    if platform == "cpu":
        return target in verified.CPU_TARGETS
    if platform != "cuda":
        return False
    # On CUDA, where the gate verified some key of the target (or of its Hopper variant,
    # which the environment variable may also open) on this GPU: auto_choice then decides
    # per product.
    cc = _sm90.cuda_compute_capability()
    gate = verified.default_gate()
    sm90 = _sm90.hopper_variant(target)
    verified_here = {_sm90.split_key(key)[0] for key in gate.verified_targets(cc)}  # any variant
    return target in verified_here or (sm90 is not None and (sm90 in verified_here or _sm90.hopper_env()))


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

# Hopper target -> the layout's work list its _v2 FFI target takes after ``order``.
_SM90_WORK_OPERANDS: dict[str, Callable] = {
    "jbs_bsmm_fprop_sm90": lambda t: (t.col_work, t.col_work_ptr),
    "jbs_bsmm_bprop_sm90": lambda t: (t.row_work, t.row_work_ptr),
}

# Output dtypes a handler can write besides the input dtype.
_KERNEL_OUT_DTYPES = (np.dtype(np.float32),)


def _kernel_call(key: str, out_shape, out_dtype, *operands, precision=None):
    """jnp function: the FFI custom call on the target's operands, the cast to ``out_dtype``.

    ``key``: a target, or a Hopper target's variant (``_sm90.kernel_key``:
    "jbs_bsmm_fprop_sm90:stacked"), whose fprop/bprop ``_v2`` FFI targets also take the
    layout's work list and the ``variant`` attribute.

    The sm_90 targets also take the ``tf32`` attribute (float32 on TF32 tensor cores at
    ``precision`` None/DEFAULT/HIGH, with some operands transposed: ops/_sm90.py)."""
    out_dtype = np.dtype(out_dtype)
    in_dtype = np.dtype(operands[0].dtype)
    kernel_dtype = out_dtype if out_dtype in (in_dtype, *_KERNEL_OUT_DTYPES) else np.dtype(np.float32)
    a, b, *tables = operands
    result = jax.ShapeDtypeStruct(tuple(out_shape), kernel_dtype)
    target, variant = _sm90.split_key(key)
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
        # The workspace's size is the variant: the handler plans for what it holds.
        ws = _sm90.updat_workspace_bytes(in_dtype, n, (c // bs, k // bs), out_shape[0], bs, tf32=tf32, variant=variant)
        call = jax.ffi.ffi_call(ffi_target, (result, jax.ShapeDtypeStruct((ws,), np.uint8)))
        return call(*args, tf32=np.bool_(tf32))[0].astype(out_dtype)
    work = _SM90_WORK_OPERANDS[target](LayoutTables(*tables))
    call = jax.ffi.ffi_call(ffi_target, result)
    return call(*args, *work, tf32=np.bool_(tf32), variant=variant).astype(out_dtype)


def _kernel_rule(name: str):
    """The lowering rule of a call into the kernel target ``name`` (portable or sm_90)."""

    def rule(ctx, *operands, precision=None):
        (aval_out,) = ctx.avals_out
        fun = functools.partial(_kernel_call, name, aval_out.shape, aval_out.dtype, precision=precision)
        return mlir.lower_fun(fun, multiple_results=False)(ctx, *operands)

    return rule


# ---------------------------------------------------------------------------------
# "auto" beside the dense product (jax_blocksparse/crossover.py)
# ---------------------------------------------------------------------------------


def device_kind(platform: str) -> str | None:
    """The device as the crossover table names it: on CPU this machine's signature
    (:func:`jax_blocksparse.crossover.cpu_device_kind`: instruction set and cores), on CUDA
    the first device's ``device_kind``; None where the platform has no device here
    (cross-lowering for "cuda" on a machine without a GPU)."""
    try:
        devices = jax.devices(platform)
    except (RuntimeError, ValueError):
        return None
    if not devices:
        return None
    if platform == "cpu":
        return crossover.cpu_device_kind()
    return getattr(devices[0], "device_kind", platform)


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


def product_rows(activation_aval) -> int:
    """A product's rows of activations, from its first operand's static shape (x in fprop
    and updat, dy in bprop): every dim but the feature dim. What a crossover is measured
    per (:meth:`jax_blocksparse.crossover.Crossover.at_rows`)."""
    return int(np.prod(activation_aval.shape[:-1], dtype=np.int64))


def choose_variant(sm90: str, mode: str, block_size: int, fraction: float) -> str:
    """Which variant of the Hopper target ``sm90`` runs a product (the first of the two
    decisions; kernel-or-dense comes after, with that variant's crossover):

    * the variant ``JAX_BLOCKSPARSE_SM90_VARIANT`` names for this op (an explicit request,
      as ``JAX_BLOCKSPARSE_HOPPER=1`` is), where that variant runs this product;
    * else the crossover table's winner for the layout's block capacity ``fraction``
      (:func:`jax_blocksparse.crossover.variant_for`), where the gate verified that
      variant's own key on this GPU (or ``JAX_BLOCKSPARSE_HOPPER=1`` opens the gate);
    * else the baseline.
    """
    forced = _sm90.forced_variant(sm90)
    if forced is not None:
        return forced if _sm90.variant_runs(sm90, forced, mode, block_size) else _sm90.BASELINE
    chosen = crossover.variant_for(
        "cuda", device_kind("cuda"), sm90, mode, block_size, fraction, family=device_family("cuda")
    )
    if chosen is None or chosen == _sm90.BASELINE or not _sm90.variant_runs(sm90, chosen, mode, block_size):
        return _sm90.BASELINE
    key = _sm90.kernel_key(sm90, chosen)
    if _sm90.hopper_env() or verified.default_gate().allows(_sm90.cuda_compute_capability(), key, mode, block_size):
        return chosen
    return _sm90.BASELINE


def kernels_target(platform: str, target: str, dtype, block_size: int, precision, fraction: float = 1.0) -> str:
    """The kernel ``impl="kernels"`` runs for ``target``: on CUDA its Hopper target where that
    can run and the Hopper gate is open for this product (the environment variable, or the
    gate's key), in the variant :func:`choose_variant` picks for a layout of block capacity
    ``fraction`` (a :func:`_sm90.kernel_key`), else ``target``."""
    if platform != "cuda":
        return target
    sm90 = _sm90.hopper_variant(target)
    if sm90 is None:
        return target
    mode = kernel_mode(sm90, dtype, block_size, precision)
    allowed = verified.default_gate().allows(_sm90.cuda_compute_capability(), sm90, mode, block_size)
    chosen = _sm90.select_target(target, verified=allowed)
    if chosen != sm90:
        return chosen
    return _sm90.kernel_key(sm90, choose_variant(sm90, mode, block_size, fraction))


def auto_choice(platform: str, target: str, ctx, *, block_size: int, precision) -> str | None:
    """What ``impl="auto"`` runs for one product whose platform has ``target``'s kernels
    (:func:`kernels_selected`): a kernel target's name, :data:`DENSE`, or None for the
    reference (no kernel verified for this product's mode and block size).

    The candidates are the verified kernels of the product: on CPU ``target``; on CUDA the
    portable ``target`` and, on an sm_90 GPU, its Hopper target (also where
    ``JAX_BLOCKSPARSE_HOPPER=1`` opens it) in the variant :func:`choose_variant` picks
    (a :func:`_sm90.kernel_key`: the gate and the table key each variant on its own; a
    variant other than the baseline is verified by its own key or asked for by name).
    Each has a crossover density from the table in
    force (:func:`jax_blocksparse.crossover.crossover_for`; where nothing was measured: 0.5
    on CPU, 0 on a verified GPU, that is the dense product, and 1 for a Hopper kernel the
    environment variable forces), for the product's batch (:func:`product_rows`). The
    candidate with the highest crossover runs (the Hopper one on a tie), unless the
    layout's block capacity exceeds it: then the dense product."""
    dtype = ctx.avals_in[0].dtype
    fraction = block_fraction(ctx.avals_in[2:])
    rows = product_rows(ctx.avals_in[0])
    kind = device_kind(platform)
    if platform == "cpu":
        candidates = [(target, None)]
    else:
        cc = _sm90.cuda_compute_capability()
        gate = verified.default_gate()
        candidates = []
        sm90 = _sm90.hopper_variant(target)
        if sm90 is not None:
            mode = kernel_mode(sm90, dtype, block_size, precision)
            key = _sm90.kernel_key(sm90, choose_variant(sm90, mode, block_size, fraction))
            if gate.allows(cc, key, mode, block_size):
                candidates.append((key, None))
            elif _sm90.hopper_env() or (key != sm90 and _sm90.forced_variant(sm90) is not None):
                candidates.append((key, 1.0))  # asked for by name: runs unless the table says otherwise
        mode = kernel_mode(target, dtype, block_size, precision)
        if gate.allows(cc, target, mode, block_size):
            candidates.append((target, None))
    if not candidates:
        return None
    best, best_crossover = None, -1.0
    for name, unmeasured in candidates:
        mode = kernel_mode(_sm90.split_key(name)[0], dtype, block_size, precision)
        found = crossover.crossover_for(
            platform, kind, name, mode, block_size, family=device_family(platform), rows=rows
        )
        if found is None:
            found = crossover.UNMEASURED[platform] if unmeasured is None else unmeasured
        if found > best_crossover:
            best, best_crossover = name, found
    return DENSE if fraction > best_crossover else best


def device_family(platform: str) -> str | None:
    """What decides a kernel's speed beside the device kind: the compute capability of the
    first CUDA device, the instruction set the CPU kernels run (the crossover table's
    ``family``)."""
    if platform == "cuda":
        return _sm90.cuda_compute_capability()
    if platform == "cpu":
        return _native.extension_info().get("cpu_isa")
    return None


def native_conversions(platform: str) -> bool:
    """Whether the extension converts between blocks and a dense matrix on ``platform``
    (the CPU dense path's ``jbs_blocks_to_dense`` / ``jbs_dense_to_blocks``, and updat's
    ``jbs_transpose``)."""
    names = {targets.target_name(k) for k in ("jbs_blocks_to_dense", "jbs_dense_to_blocks", "jbs_transpose")}
    return _native.has_kernels(platform) and names <= _native.registered_targets(platform)


def _bsmm_choice(platform: str, impl: str, target: str, ctx, params: dict) -> str | None:
    """What runs one bsmm product whose ``target`` is selected on ``platform`` under
    ``impl`` ("kernels" or "auto"): a kernel target's name (a :func:`_sm90.kernel_key`),
    :data:`DENSE`, or None for the reference."""
    # precision: the Hopper targets run float32 on TF32 below HIGHEST (ops/_sm90.py).
    precision, bs = params.get("precision"), params["block_size"]
    if impl == "kernels":
        fraction = block_fraction(ctx.avals_in[2:])
        return kernels_target(platform, target, ctx.avals_in[0].dtype, bs, precision, fraction)
    return auto_choice(platform, target, ctx, block_size=bs, precision=precision)


def register_lowerings(
    primitive,
    reference: Callable,
    *,
    target: str,
    dense: Callable,
    cpu_reference: Callable | None = None,
    cpu_dense: Callable | None = None,
    kernel: Callable | None = None,
    target_platforms: tuple[str, ...] = KERNEL_PLATFORMS,
    composed: Callable[[str, dict], Callable | None] | None = None,
) -> None:
    """Registers the reference and dense lowerings everywhere and the kernel seam on 'cpu'
    and 'cuda'.

    Args:
      primitive: the primitive; its params must include ``impl`` and ``precision`` (and
        ``block_size`` where ``kernel`` is None).
      reference: pure-JAX function ``(*operands, **params) -> out``.
      target: the kernel's short name (its versioned FFI target, registered by the native
        extension, is ``targets.target_name(target)``).
      dense: pure-JAX function ``(*operands, **params) -> out``: the product through a
        dense weight and XLA's dot (``impl="dense"``, and "auto" above the crossover).
      cpu_reference: an optional CPU-tuned variant of ``reference``.
      cpu_dense: an optional variant of ``dense`` for CPU, whose conversions between the
        blocks and the dense matrix the extension runs (where it has them:
        :func:`native_conversions`).
      kernel: pure-JAX function ``(*operands, **params) -> out`` calling ``target``'s FFI
        target; it runs wherever the target is selected (:func:`kernels_selected`). None:
        a bsmm target, whose kernel (portable or Hopper, and its variant) or the dense
        product is chosen per product (:func:`kernels_target`, :func:`auto_choice`: the
        crossover table measures the bsmm targets).
      target_platforms: the platforms whose native kernels include ``target`` (the bsmm
        targets': both; the convolution's: "cpu").
      composed: ``composed(platform, params)``: the op as a pure-JAX composition of other
        primitives, which pick their own paths, for a lowering platform and the
        primitive's params, or None. Under "auto" and "kernels" it runs on a platform
        outside ``target_platforms``, and in place of the op's selected kernel where it
        answers (params the kernel does not take).

    Raises:
      ValueError: ``target_platforms`` names a platform outside :data:`KERNEL_PLATFORMS`.
    """
    unknown = sorted(set(target_platforms) - set(KERNEL_PLATFORMS))
    if unknown:
        raise ValueError(
            f"register_lowerings({primitive}): target_platforms must be among {KERNEL_PLATFORMS}, got {unknown}"
        )
    reference_rule = _reference_rule(reference)
    dense_rule = _reference_rule(dense)
    cpu_dense_rule = _reference_rule(cpu_dense) if cpu_dense is not None else None
    kernel_rule = _reference_rule(kernel) if kernel is not None else None

    def portable_rule(ctx, *operands, impl, **params):
        rule = dense_rule if impl == "dense" else reference_rule
        return rule(ctx, *operands, impl=impl, **params)

    # Every rule is wrapped by the sharding rule (ops/_partitioning.py), so that jit with
    # sharded inputs splits the op over the devices instead of gathering its operands.
    mlir.register_lowering(primitive, partitioned(primitive, portable_rule))
    for platform in KERNEL_PLATFORMS:
        fallback = _reference_rule(cpu_reference) if platform == "cpu" and cpu_reference else reference_rule

        def rule(ctx, *operands, impl, _platform=platform, _fallback=fallback, **params):
            dense_here = dense_rule
            if _platform == "cpu" and cpu_dense_rule is not None and native_conversions("cpu"):
                dense_here = cpu_dense_rule
            if impl == "dense":
                return dense_here(ctx, *operands, impl=impl, **params)
            own = _platform in target_platforms  # the op's own kernel exists here
            if impl == "reference" or (own and not kernels_selected(_platform, impl, target)):
                return _fallback(ctx, *operands, impl=impl, **params)
            composition = composed(_platform, params) if composed is not None else None
            if composition is not None:
                return _reference_rule(composition)(ctx, *operands, impl=impl, **params)
            if not own:
                return _fallback(ctx, *operands, impl=impl, **params)
            if kernel_rule is not None:
                return kernel_rule(ctx, *operands, impl=impl, **params)
            name = _bsmm_choice(_platform, impl, target, ctx, params)
            if name == DENSE:
                return dense_here(ctx, *operands, impl=impl, **params)
            if name is None:
                return _fallback(ctx, *operands, impl=impl, **params)
            return _kernel_rule(name)(ctx, *operands, precision=params.get("precision"))

        mlir.register_lowering(primitive, partitioned(primitive, rule), platform=platform)


# A device's ``platform`` attribute names CUDA "gpu"; JAX's lowering platforms say "cuda".
_DEVICE_PLATFORMS = {"gpu": "cuda"}


def lowering_platform(platform: str) -> str:
    """The lowering platform of a device's ``platform`` attribute ("gpu" -> "cuda"); a
    lowering platform is itself."""
    return _DEVICE_PLATFORMS.get(platform, platform)


def describe_path(platform: str, impl: str) -> str:
    """One line saying which path bsmm takes on ``platform`` under ``impl`` (for reports).

    ``platform`` is a lowering platform ("cpu", "cuda") or a device's ``platform``
    attribute ("gpu" names CUDA there); ``impl`` one of
    :data:`jax_blocksparse.config.IMPLEMENTATIONS`. The public entry, with defaults and
    argument checks, is :func:`jax_blocksparse.ops.paths.describe_path`."""
    platform = lowering_platform(platform)
    if impl == "dense":
        return "dense product (implementation 'dense': the blocks scattered into a dense weight, then XLA's dot)"
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
    if platform == "cpu":
        return f"{kind} ({_native.cpu_kernels_in_force()})"
    cc = _sm90.cuda_compute_capability()
    device = verified.default_gate().device(cc)
    if device is not None and device.passed:
        dense_note = "the crossover table picks the kernel, or the dense product above its density"
        return f"{kind} verified on compute capability {cc} ({device.source or 'the gate'}); {dense_note}"
    where = f"compute capability {cc}" if cc else "this machine (no CUDA device to check)"
    return (
        f"pure-JAX reference: the {kind} are built but not verified on {where} "
        "(set JAX_BLOCKSPARSE_IMPL=kernels to use them)"
    )
