"""The Hopper (sm_90a) targets: when the lowering picks them, and what they take.

The extension built for sm_90a registers, for CUDA, ``jbs_bsmm_{fprop,bprop,updat}_sm90``
(cuda/sm90/; FFI targets ``jax_blocksparse_bsmm_*_sm90_v1``): persistent, warp-specialized
kernels with TMA loads, wgmma and TMA stores, for 16-bit inputs (fprop, bprop and updat
at every block size: at blocks 8/16/32 fprop/bprop pack 64 / bs outputs per tile and updat
stacks 64 / bs slots along wgmma's M) and for float32 inputs on TF32 tensor cores (see
below). The other problems (exact float32) run the portable
kernels from inside the same targets. They take the operands of the portable targets;
``jbs_bsmm_updat_sm90`` returns a second result, a uint8 workspace for the float32
partial sums of a split N reduction, sized by the extension (:func:`updat_workspace_bytes`:
the ``SddWorkspaceBytes`` the handler checks it with).

What the kernels are, the extension says (:func:`facts`, from the host-only headers
cuda/sm90/bsmm_sm90_plan.h and bsmm_sm90_tf32.h, in every build, a CPU-only one too):
nothing here restates a C++ constant.

Variants (:func:`variants`; cuda/sm90/bsmm_sm90_variants.h): a Hopper target may hold
several kernel designs of one product. fprop and bprop emit their ``_v2`` FFI targets,
which take the layout's flat work list (``col_work``/``col_work_ptr`` for fprop,
``row_work``/``row_work_ptr`` for bprop) after ``order`` and a string attribute
``variant``; the ``_v1`` targets stay registered for exported programs. Which variant
runs is decided before, and apart from, kernel-or-dense (ops/_lowering.py,
:func:`~jax_blocksparse.ops._lowering.choose_variant`): ``JAX_BLOCKSPARSE_SM90_VARIANT``
where it names one (:func:`forced_variant`), else the crossover table's winner for the
layout's block capacity where the gate verified that variant's own key
(:func:`kernel_key`: ``"jbs_bsmm_fprop_sm90:stacked"``), else the baseline. A variant runs
only where it can (:func:`variant_runs`); elsewhere the baseline does.

Float32 precision (:func:`use_tf32`): every sm_90 target takes a bool attribute
``tf32``. It is true for float32 inputs when the primitive's ``precision`` is None,
DEFAULT or HIGH, at the block sizes where the target's TF32 kernel is on
(:func:`tf32_block_sizes`: every block size of every product since the DSD kernel at
block 8, which once faulted, ran clean on an H100): the products then run on TF32 tensor
cores (10-bit mantissa inputs, float32 accumulation), as ``jnp.dot`` does on the GPU.
HIGHEST, and a block size a table leaves out (:func:`tf32_off`, empty today), give
false: the exact float32 kernels, which also satisfy DEFAULT/HIGH. The targets refuse
``tf32=true`` where TF32 is off. TF32 wgmma reads both operands K-major only, so
with ``tf32`` the lowering passes some operands transposed (:func:`tf32_operands`):
fprop's w as ``jnp.swapaxes(w, -1, -2)`` (each block transposed), updat's x and dy as
x^T [C, n] and dy^T [K, n] with n padded by zero rows to a multiple of 4
(``facts()["tf32_row_multiple"]``: TMA strides are multiples of 16 bytes; zero rows add
nothing to the sum over n). bprop's operands
are K-major as they are. The updat workspace of a TF32 updat is that of the 16-bit
kernel over the padded n (same plan).

The Hopper gate: the lowering for "cuda" picks the sm_90 target only when the extension
has it, the target GPU is sm_90 (:func:`hopper_variant`) and the gate is open:

* closed whatever the gate says: ``JAX_BLOCKSPARSE_HOPPER=0`` (the portable kernels only,
  to time or compare them on an sm_90 GPU);
* open: the environment variable ``JAX_BLOCKSPARSE_HOPPER=1``, or the sm_90 target
  verified for the product's arithmetic mode and block size on this compute capability
  (:mod:`jax_blocksparse.verified`; under ``impl="auto"`` the crossover table then picks
  between it, the portable target and the dense product: ops/_lowering.py);
* sm_90: the first CUDA device's compute capability is 9.x; with no CUDA device at
  lowering time (cross-lowering), the environment variable alone decides.
"""

from __future__ import annotations

import os

import numpy as np

from jax_blocksparse import _native, targets

HOPPER_ENV = "JAX_BLOCKSPARSE_HOPPER"
VARIANT_ENV = "JAX_BLOCKSPARSE_SM90_VARIANT"
BASELINE = "baseline"

# portable target -> Hopper target, and back.
SM90_TARGETS = {
    "jbs_bsmm_fprop": "jbs_bsmm_fprop_sm90",
    "jbs_bsmm_bprop": "jbs_bsmm_bprop_sm90",
    "jbs_bsmm_updat": "jbs_bsmm_updat_sm90",
}
BASE_TARGETS = {v: k for k, v in SM90_TARGETS.items()}


def _op(target: str) -> str:
    """The op ("fprop", "bprop" or "updat") of a portable or sm_90 target name, or of the op itself."""
    op = BASE_TARGETS.get(target, target).removeprefix("jbs_bsmm_")
    if op not in ("fprop", "bprop", "updat"):
        raise ValueError(f"unknown target {target!r}: expected one of {sorted(SM90_TARGETS)} or their _sm90 variants")
    return op


def facts() -> dict:
    """What the extension says about the sm_90 kernels (its ``build_info()["sm90"]``):
    ``plan_sms`` (the SM count the updat workspace is sized for), ``tf32_block_sizes``
    (op -> the block sizes with TF32), ``tf32_off`` (op -> {block size -> why TF32 is off
    there}) and ``tf32_row_multiple`` (the rows a TF32 updat pads n to). Every build
    reports them; empty without the extension, where no sm_90 target is ever picked."""
    return _native.extension_info().get("sm90") or {}


def _fact(name: str):
    found = facts().get(name)
    if found is None:
        raise RuntimeError(
            f"the extension does not report the sm_90 kernels' {name!r} (build_info()['sm90']): "
            f"{_native.load_error() or 'it is out of date'}; rebuild it with `python build.py`"
        )
    return found


def tf32_block_sizes(target: str) -> tuple[int, ...]:
    """Block sizes at which the sm_90 target of ``target`` (a portable or sm_90 target name,
    or "fprop" / "bprop" / "updat") runs float32 on TF32 tensor cores, as the extension
    reports them (cuda/sm90/bsmm_sm90_tf32.h); none without the extension."""
    op = _op(target)
    return tuple(facts().get("tf32_block_sizes", {}).get(op, ()))


def tf32_off() -> dict[tuple[str, int], str]:
    """(op, block size) -> why the sm_90 target of op does not run float32 on TF32 at that
    block size (cuda/sm90/bsmm_sm90_tf32.h, through the extension); empty without it."""
    return {(op, int(bs)): why for op, by_bs in facts().get("tf32_off", {}).items() for bs, why in by_bs.items()}


def tf32_summary() -> str:
    """One line: where the sm_90 targets do not run float32 on TF32, and why."""
    if not facts():
        return f"unknown: {_native.load_error() or 'the extension does not report its sm_90 kernels'}"
    off = tf32_off()
    if not off:
        return "on for every op and block size below HIGHEST"
    by_reason: dict[tuple[int, str], list[str]] = {}
    for (op, bs), why in off.items():
        by_reason.setdefault((bs, why), []).append(op)
    parts = [f"{'/'.join(ops)} at block {bs}: {why}" for (bs, why), ops in sorted(by_reason.items())]
    return "exact float32 instead for " + "; ".join(parts)


def use_tf32(target: str, dtype, bs: int, precision) -> bool:
    """Whether the sm_90 target of ``target`` (a portable or sm_90 target name, or "fprop" /
    "bprop" / "updat") runs a product of ``dtype`` inputs at block size ``bs`` on TF32
    tensor cores: float32 at ``precision`` None, DEFAULT or HIGH (a
    :class:`jax.lax.Precision` or None, as the primitives carry it), at the block sizes of
    :func:`tf32_block_sizes` (where a block size is left out: :func:`tf32_off`)."""
    from jax import lax  # noqa: PLC0415

    return (
        np.dtype(dtype) == np.dtype(np.float32)
        and precision in (None, lax.Precision.DEFAULT, lax.Precision.HIGH)
        and bs in tf32_block_sizes(target)
    )


def tf32_operands(base_target: str, a, b):
    """The two float operands of ``base_target`` (a portable target name) as its sm_90
    target takes them with ``tf32=True``: fprop (x, w^T per block), bprop (g, w),
    updat (x^T [C, n], dy^T [K, n], n padded with zero rows to a multiple of
    ``facts()["tf32_row_multiple"]``, 4)."""
    import jax.numpy as jnp  # noqa: PLC0415

    if base_target == "jbs_bsmm_fprop":
        return a, jnp.swapaxes(b, -1, -2)
    if base_target == "jbs_bsmm_bprop":
        return a, b
    if base_target == "jbs_bsmm_updat":
        n = int(np.prod(a.shape[:-1], dtype=np.int64))
        pad = -n % int(_fact("tf32_row_multiple"))

        def t(v):
            v = v.reshape(n, v.shape[-1])
            return jnp.pad(v, ((0, pad), (0, 0))).T if pad else v.T

        return t(a), t(b)
    raise ValueError(f"tf32_operands: unknown target {base_target!r}")


# ---------------------------------------------------------------------------------
# Variants: which kernel design a Hopper target runs (cuda/sm90/bsmm_sm90_variants.h)
# ---------------------------------------------------------------------------------


def variants(target: str) -> dict[str, dict[str, tuple[int, ...]]]:
    """The variants of the sm_90 target of ``target`` (a portable or sm_90 target name, or
    "fprop" / "bprop" / "updat") as the extension reports them: variant -> arithmetic mode
    -> block sizes it runs. Always ``"baseline"`` (every product of the target); fprop and
    bprop also ``"stacked"`` (16-bit inputs at blocks 8/16/32). Empty without the
    extension."""
    by_variant = facts().get("variants", {}).get(_op(target), {})
    return {v: {mode: tuple(sizes) for mode, sizes in by_mode.items()} for v, by_mode in by_variant.items()}


def variant_runs(target: str, variant: str, mode: str, bs: int) -> bool:
    """Whether ``variant`` of ``target``'s sm_90 target runs a product of arithmetic
    ``mode`` ("bfloat16", "float16", "float32", "tf32") at block size ``bs``."""
    return bs in variants(target).get(variant, {}).get(mode, ())


def kernel_key(target: str, variant: str = BASELINE) -> str:
    """The name of one kernel variant, as the gate and the crossover table key it:
    ``target`` itself for the baseline, ``"<target>:<variant>"`` for another."""
    return target if variant == BASELINE else f"{target}:{variant}"


def split_key(key: str) -> tuple[str, str]:
    """(target, variant) of a :func:`kernel_key`."""
    target, _, variant = key.partition(":")
    return target, variant or BASELINE


def forced_variant(target: str) -> str | None:
    """The variant ``JAX_BLOCKSPARSE_SM90_VARIANT`` asks for the sm_90 target of ``target``,
    or None where it asks nothing. The value is one variant for every op ("stacked") or
    per op ("fprop=stacked,bprop=baseline"); an op it does not name gets None. Raises
    ValueError for a name the extension does not know."""
    raw = os.environ.get(VARIANT_ENV, "").strip()
    if not raw:
        return None
    op = _op(target)
    known = sorted({v for o in ("fprop", "bprop", "updat") for v in variants(o)}) or [BASELINE]
    chosen = None
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        scope, variant = (name.strip(), value.strip()) if sep else (None, name)
        if scope is not None and scope not in ("fprop", "bprop", "updat"):
            raise ValueError(f"{VARIANT_ENV}={raw!r}: {scope!r} is not an op (fprop, bprop, updat)")
        if variant not in known:
            raise ValueError(f"{VARIANT_ENV}={raw!r}: unknown variant {variant!r}; the extension has {known}")
        if scope in (None, op):
            chosen = variant
    return chosen


def variants_summary() -> str:
    """One line: the Hopper targets' variants besides the baseline, and which one
    ``JAX_BLOCKSPARSE_SM90_VARIANT`` asks for (for the environment report)."""
    if not facts():
        return f"unknown: {_native.load_error() or 'the extension does not report its sm_90 kernels'}"
    parts = []
    for op in ("fprop", "bprop", "updat"):
        for variant, by_mode in sorted(variants(op).items()):
            if variant != BASELINE:
                sizes = sorted({bs for s in by_mode.values() for bs in s})
                parts.append(f"{op} {variant} ({'/'.join(sorted(by_mode))} at blocks {', '.join(map(str, sizes))})")
    asked = os.environ.get(VARIANT_ENV, "").strip()
    said = (
        f"; {VARIANT_ENV}={asked!r}"
        if asked
        else f"; {VARIANT_ENV} unset: the crossover table's winners, else the baseline"
    )
    return ("; ".join(parts) if parts else "the baseline only") + said


def hopper_env() -> bool:
    """Whether ``JAX_BLOCKSPARSE_HOPPER=1`` opens the Hopper gate."""
    return os.environ.get(HOPPER_ENV, "").strip() == "1"


def hopper_closed() -> bool:
    """Whether ``JAX_BLOCKSPARSE_HOPPER=0`` keeps the Hopper targets out, verified or not
    (to run, time or compare the portable kernels on an sm_90 GPU)."""
    return os.environ.get(HOPPER_ENV, "").strip() == "0"


def built_targets() -> frozenset[str]:
    """The Hopper kernels (``jbs_bsmm_*_sm90``) whose current FFI targets this extension
    registered (empty unless built for sm_90a)."""
    if not _native.has_kernels("cuda"):
        return frozenset()
    registered = _native.registered_targets("cuda")
    return frozenset(k for k in SM90_TARGETS.values() if targets.target_name(k) in registered)


def cuda_compute_capability() -> str | None:
    """The first CUDA device's compute capability ("9.0"), or None without a CUDA device."""
    import jax  # noqa: PLC0415

    try:
        devices = jax.devices("cuda")
    except (RuntimeError, ValueError):  # no CUDA backend (cross-lowering)
        return None
    cc = getattr(devices[0], "compute_capability", None) if devices else None
    return str(cc) if cc is not None else None


def hopper_variant(target: str) -> str | None:
    """The sm_90 variant of ``target`` where it can run: the extension has it and the first
    CUDA device is compute 9.x; with no CUDA device at lowering time (cross-lowering), only
    where ``JAX_BLOCKSPARSE_HOPPER=1`` asks for it. None otherwise, and always under
    ``JAX_BLOCKSPARSE_HOPPER=0``."""
    sm90 = SM90_TARGETS.get(target)
    if sm90 is None or sm90 not in built_targets() or hopper_closed():
        return None
    cc = cuda_compute_capability()
    if cc is None:
        return sm90 if hopper_env() else None
    return sm90 if cc.split(".")[0] == "9" else None


def select_target(target: str, *, verified: bool = False) -> str:
    """The FFI target the "cuda" lowering calls for ``target`` where no table chooses:
    its sm_90 variant where that can run (:func:`hopper_variant`) and the Hopper gate is
    open (``JAX_BLOCKSPARSE_HOPPER=1``, or ``verified``: the gate verified the sm_90
    variant for this product), else ``target`` itself."""
    sm90 = hopper_variant(target)
    return sm90 if sm90 is not None and (hopper_env() or verified) else target


def updat_workspace_bytes(
    dtype,
    n: int,
    grid: tuple[int, int],
    capacity: int,
    bs: int,
    *,
    tf32: bool = False,
    num_sms: int | None = None,
    variant: str = BASELINE,
) -> int:
    """Bytes of the updat_sm90 workspace: float32 partials [splits, capacity, bs, bs] when the
    kernel's plan splits the N reduction, else 0 (also for the problems the portable kernels
    run). The extension computes it with the function the handler checks the workspace with
    (``SddWorkspaceBytes``, cuda/sm90/bsmm_sm90_plan.h), for ``num_sms`` SMs (default: the
    handler's own, ``facts()["plan_sms"]``).

    ``dtype``: the input dtype; ``n``: rows of x/dy (product of their leading dims; with
    ``tf32``, the padded rows of x^T/dy^T); ``grid``: (C // bs, K // bs); ``capacity`` and
    ``bs``: those of dw [capacity, bs, bs]; ``variant``: the updat variant ("capped": the
    reduction split into fewer pieces, so that the workspace is at most
    ``facts()["updat_capped_workspace_bytes"]``; the handler plans for the SMs the
    workspace it is given allows, so this size is what selects the variant)."""
    module = _native.module()
    compute = getattr(module, "sm90_updat_workspace_bytes", None)
    if compute is None:
        raise RuntimeError(
            "updat_workspace_bytes needs the extension's sm90_updat_workspace_bytes: "
            f"{_native.load_error() or 'it is out of date'}; rebuild it with `python build.py`"
        )
    cb, kb = grid
    extra = {} if num_sms is None else {"num_sms": num_sms}
    if variant != BASELINE:
        extra["variant"] = variant
    return compute(np.dtype(dtype).name, n, cb, kb, capacity, bs, tf32=tf32, **extra)
