"""``python -m jax_blocksparse``: an environment report; ``... tune``: this machine's crossovers.

The report prints versions, devices, whether the native extension is built (the CPU
instruction set its kernels use; CUDA or not, and for which architectures) and the FFI
targets it registered (the names a ``jax.export`` artifact calls), the implementation
switch in force, for each platform which path bsmm takes there, what the gate verified on
this GPU's compute capability and what it turned off and why
(:mod:`jax_blocksparse.verified`), and the crossovers in force for this machine's devices
(where "auto" computes a product densely instead) with where they come from.

    python -m jax_blocksparse             # the report
    python -m jax_blocksparse tune        # measure this machine's crossovers (jax_blocksparse/tune.py)
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import jax

import jax_blocksparse as jbs
from jax_blocksparse import _native, crossover, tune, verified
from jax_blocksparse.ops import _lowering, _sm90, paths


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report(verbose: bool = False) -> str:
    lines = ["jax-blocksparse environment report", ""]
    lines.append(f"python            {sys.version.split()[0]} ({platform.platform()})")
    for dist in ("jax-blocksparse", "jax", "jaxlib", "flax", "optax", "numpy"):
        lines.append(f"{dist:17} {_version(dist)}")
    lines.append("")
    lines.append("devices:")
    for device in jax.devices():
        lines.append(f"  {device.platform:5} {getattr(device, 'device_kind', '')} ({device})")
    lines.append("")
    info = _native.extension_info()
    if info:
        # (build_info()["sm90"], the Hopper kernels' tables: the TF32 line below says what matters)
        facts = ", ".join(f"{k}={v}" for k, v in info.items() if k != "sm90")
        lines.append("native extension: built and loaded " + facts)
    else:
        lines.append(f"native extension: not available: {_native.load_error()}")
    # Registered at import; jax.export artifacts name these (jbs.export.disabled_checks()).
    for plat in ("cpu", "cuda"):
        if names := sorted(_native.registered_targets(plat)):
            lines.append(f"  FFI targets for {plat}: {', '.join(names)}")
    impl = jbs.config.get_implementation()
    lines.append(f"implementation:   {impl} (env {jbs.config.ENV_VAR}, or jbs.config.implementation(...))")
    lines.append("")
    lines.append("bsmm path by platform:")
    for plat in ("cpu", "cuda"):
        lines.append(f"  {plat:5} {paths.describe_path(plat, impl)}")
    lines.append(f"  float32 on the Hopper targets' TF32 below HIGHEST: {_sm90.tf32_summary()}")
    lines.append(f"  Hopper kernel variants besides the baseline: {_sm90.variants_summary()}")
    lines.append("")
    lines.extend(gate_lines(verified.default_gate(), _sm90.cuda_compute_capability()))
    lines.append("")
    lines.extend(crossover_lines(crossover.table_in_force()))
    if verbose:
        lines.append("")
        lines.extend(ptxas_lines(_native.ptxas_report()))
    return "\n".join(lines)


def _short(kernel: str) -> str:
    """A kernel's demangled name without the namespaces and the parameter list."""
    name = kernel.split("(")[0].removeprefix("void ")
    return (
        name.replace("jbs::sm90::detail::", "")
        .replace("jbs::sm90::", "")
        .replace("jbs::detail::", "")
        .replace("jbs::", "")
    )


def ptxas_lines(report: list[dict] | None) -> list[str]:
    """The build's ptxas report: per architecture and CUDA kernel, registers, shared
    memory, stack frame and spills (the kernels that spill first)."""
    if report is None:
        return ["ptxas report: none (a build without CUDA kernels, or made before the report existed)"]
    spilling = [k for k in report if k.get("spill_stores") or k.get("spill_loads")]
    lines = [
        f"ptxas report: {len(report)} kernels x architectures, {len(spilling)} spilling "
        "(registers, shared memory bytes, stack bytes, spill stores / loads bytes):"
    ]
    ordered = sorted(
        report, key=lambda k: (not (k.get("spill_stores") or k.get("spill_loads")), k["arch"], k["kernel"])
    )
    for k in ordered:
        lines.append(
            f"  {k['arch']:7} regs {k.get('registers', '?'):>3}  smem {k.get('smem_bytes', 0):>6}  "
            f"stack {k.get('stack_bytes', 0):>4}  spills {k.get('spill_stores', 0)}/{k.get('spill_loads', 0)}  "
            f"{_short(k['kernel'])[:140]}"
        )
    return lines


def gate_lines(gate: verified.Gate, cc: str | None) -> list[str]:
    """What the gate verified for the CUDA kernels, per compute capability (this GPU's
    marked), and every key it turned off with why (the keys of a target that failed for one
    reason on one line)."""
    lines = ['CUDA kernels verified on hardware (what "auto" may run: jax_blocksparse/verified_gpu.json):']
    if not gate.devices:
        return lines + ["  none yet: auto takes the reference on CUDA (JAX_BLOCKSPARSE_IMPL=kernels runs them)"]
    for device in gate.devices:
        here = " (this GPU)" if device.compute_capability == cc else ""
        lines.append(
            f"  compute capability {device.compute_capability}{here}: {', '.join(device.device_kinds)}, "
            f"{device.date}, commit {device.commit}, compute-sanitizer {device.sanitizer} ({device.source})"
        )
        for target, modes in sorted(device.passed.items()):
            lines.append(
                f"    {target:22} " + "; ".join(f"{m} {'/'.join(map(str, bs))}" for m, bs in sorted(modes.items()))
            )
        off: dict[tuple[str, str], dict[str, list[int]]] = {}  # (target, why) -> mode -> block sizes
        for (target, mode, bs), why in device.failed:
            off.setdefault((target, why), {}).setdefault(mode, []).append(bs)
        for (target, why), modes in off.items():
            keys = "; ".join(f"{m} {'/'.join(map(str, sorted(bs)))}" for m, bs in sorted(modes.items()))
            lines.append(f"    off: {target} {keys}: {why}")
    if cc is not None and gate.device(cc) is None:
        lines.append(f"  this GPU (compute capability {cc}) is not verified: auto takes the reference on it")
    return lines


def crossover_lines(table: crossover.CrossoverTable) -> list[str]:
    """The crossovers in force for this machine's devices, one line per kernel and mode:
    the block capacity above which "auto" computes that product densely, per block size;
    where the device has none of its own, those of its family that it uses instead."""
    lines = ['crossovers in force ("auto" computes a product densely above these block densities), from:']
    lines += [f"  {source}" for source in crossover.table_sources()]
    for plat in ("cpu", "cuda"):
        kind = _lowering.device_kind(plat)
        if kind is None:
            lines.append(f"  {plat:5} no device here")
            continue
        family = _lowering.device_family(plat)
        entries = table.for_device(plat, kind)
        borrowed = ""
        if not entries and family:
            entries = tuple(e for e in table.entries if (e.platform, e.family) == (plat, family))
            borrowed = f" (none of its own: those of its family {family}, the nearest used)" if entries else ""
        if not entries:
            fallback = crossover.UNMEASURED.get(plat)
            lines.append(
                f"  {plat:5} {kind}: none measured; "
                + (f"the kernels below density {fallback}, dense above" if fallback else "the dense product")
                + " (python -m jax_blocksparse tune measures them)"
            )
            continue
        groups: dict[tuple, list] = {}
        for e in entries:
            groups.setdefault((e.target, e.mode), []).append(f"bs{e.block_size} {e.crossover:.2f}")
        lines.append(f"  {plat:5} {kind}{borrowed}:")
        lines.extend(f"    {target:22} {mode:9} " + "  ".join(vals) for (target, mode), vals in sorted(groups.items()))
        batches = sorted({e.rows for e in entries if e.full_density})
        if batches:
            lines.append(
                f"    measured at {', '.join(map(str, batches))} rows of activations; a product of another batch "
                "moves them (the entries' density-1 times at several batches: Crossover.at_rows)"
            )
    return lines


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["tune"]:
        return tune.main(argv[1:])
    if argv and argv[0] not in ("--verbose", "-v"):
        print(
            "usage: python -m jax_blocksparse [--verbose] | python -m jax_blocksparse tune [--quick] ...",
            file=sys.stderr,
        )
        return 2
    print(report(verbose=bool(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
