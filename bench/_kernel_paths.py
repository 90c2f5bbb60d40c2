"""Which kernel path a bench/bsmm.py row timed: the paths a device has, the Hopper gate each
is lowered under, and what its compiled program called.

A path is "native" (the CPU kernels), "ampere" (the portable CUDA targets
``jbs_bsmm_{fprop,bprop,updat}``), "hopper" (their ``*_sm90`` targets' baseline) or
``"hopper:<variant>"``. The gate, ``JAX_BLOCKSPARSE_HOPPER``, is read when a call is
lowered, so each path's functions are lowered and compiled ahead of time with the gate set
as that path needs it (:func:`compile_checked`); the compiled HLO text then names the FFI
target that ran (:func:`kernel_target`).
"""

from __future__ import annotations

import re

from jax_blocksparse import targets
from jax_blocksparse.ops import paths

#: Every path a row may name (a Hopper variant as "hopper:<variant>").
PATHS = ("ampere", "hopper", "native")

# A custom call's target in compiled HLO text, or in StableHLO (lowered) text.
_TARGET_RE = re.compile(r'custom_call_target="(\w+)"|stablehlo\.custom_call @(\w+)\(')


def kernel_paths(device) -> list[str]:
    """The paths to time on ``device``: ["native"] on CPU; on CUDA ["ampere"], plus
    "hopper" (the Hopper targets' baseline) and one ``"hopper:<variant>"`` per other variant
    where the extension has the sm_90 targets and the GPU is compute 9.x: every variant in
    the same process, on the same operands."""
    if device.platform != "gpu":
        return ["native"]
    if not paths.hopper_available():
        return ["ampere"]
    return ["ampere", "hopper", *(f"hopper:{v}" for v in paths.hopper_variants())]


def hopper_gate(path: str):
    """The Hopper gate as ``path`` needs it while its functions are lowered:
    ``JAX_BLOCKSPARSE_HOPPER=1`` for "hopper" and its variants (with
    ``JAX_BLOCKSPARSE_SM90_VARIANT`` naming the variant: "baseline" for "hopper"), ``=0``
    for the others (the portable kernels, also where the gate verified the Hopper ones);
    restored after."""
    name, _, variant = path.partition(":")
    if name != "hopper":
        return paths.hopper_gate(False)
    return paths.hopper_gate(True, variant=variant or paths.BASELINE)


def kernel_target(hlo_text: str) -> str | None:
    """The kernel a program calls (its short name, ``jbs_bsmm_fprop``, read from the
    versioned FFI target: jax_blocksparse/targets.py), from its compiled HLO (or StableHLO)
    text; None where it calls none (the pure-JAX reference ran); several are joined by
    commas. Rows and the crossover table keep these unversioned names."""
    kernels = sorted(filter(None, (targets.kernel_of(a or b) for a, b in _TARGET_RE.findall(hlo_text))))
    return ",".join(sorted(set(kernels))) if kernels else None


_VARIANT_RE = re.compile(r'variant = "(\w+)"')


def path_of(target: str | None, platform_name: str, requested: str, lowered_text: str = "") -> str:
    """The path a target belongs to: "hopper" for the *_sm90 targets (``"hopper:<variant>"``
    where the lowered call's ``variant`` attribute names another than the baseline),
    "ampere" for the other CUDA ones, "native" on CPU; ``requested`` where no kernel ran.
    A variant asked for where it does not run lowers to the baseline: its row is then the
    baseline's, and the bench keeps one of the two. updat's call has no ``variant``
    attribute (its workspace's size selects the variant): its path is the one requested."""
    if platform_name != "gpu":
        return "native"
    if target is None:
        return requested
    if not target.endswith("_sm90"):
        return "ampere"
    variant = _VARIANT_RE.search(lowered_text)
    if variant is None:  # updat: its workspace is the variant (where the target has the one asked for)
        _, _, asked = requested.partition(":")
        return (
            requested
            if requested.startswith("hopper") and (not asked or asked in paths.hopper_variants(target))
            else "hopper"
        )
    return f"hopper:{variant.group(1)}" if variant.group(1) != paths.BASELINE else "hopper"


def arithmetic_mode(dtype: str, target: str | None, lowered_text: str, platform_name: str) -> str:
    """The kernel's arithmetic: the dtype's name, or "tf32" for float32 on TF32 tensor
    cores (a Hopper target called with ``tf32 = true``; XLA's own dot at default
    precision on a GPU, where no kernel ran). The portable and CPU kernels compute
    float32 exactly."""
    if dtype != "float32":
        return dtype
    if target is None:
        return "tf32" if platform_name == "gpu" else "float32"
    if target.endswith("_sm90"):
        return "tf32" if "tf32 = true" in lowered_text else "float32"
    return "float32"


def compile_checked(fn, args, path: str):
    """``fn`` (a jitted function) lowered and compiled for ``args`` with the Hopper gate
    as ``path`` needs it: (compiled executable, target, lowered StableHLO text). Calling
    the executable takes the same C++ fast path as calling a jitted function."""
    with hopper_gate(path):
        lowered = fn.lower(*args)
        compiled = lowered.compile()
    lowered_text = lowered.as_text()
    hlo = compiled.as_text() or lowered_text
    return compiled, kernel_target(hlo), lowered_text


def context_lost(err: BaseException) -> bool:
    """Whether ``err`` says the CUDA context is gone (a kernel fault: misaligned address,
    illegal access): every later call in this process would fail the same way."""
    text = str(err)
    return "CUDA_ERROR_" in text or "CUDA error" in text or "cudaError" in text
