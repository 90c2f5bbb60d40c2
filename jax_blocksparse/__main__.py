"""``python -m jax_blocksparse``: an environment report.

Prints versions, devices, whether the native extension is built (the CPU instruction
set its kernels use; CUDA or not, and for which architectures) and the FFI targets it
registered (the names a ``jax.export`` artifact calls), the implementation
switch in force, for each platform which path bsmm takes there, and the crossovers in
force for this machine's devices (where "auto" computes a product densely instead).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import jax

import jax_blocksparse as jbs
from jax_blocksparse import _native, crossover
from jax_blocksparse.ops import _lowering, _sm90, paths


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
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
    lines.append("")
    lines.extend(crossover_lines(crossover.table_in_force()))
    return "\n".join(lines)


def crossover_lines(table: crossover.CrossoverTable) -> list[str]:
    """The crossovers in force for this machine's devices, one line per kernel and mode:
    the block capacity above which "auto" computes that product densely, per block size."""
    lines = ['crossovers in force ("auto" computes a product densely above these block densities):']
    for plat in ("cpu", "cuda"):
        kind = _lowering.device_kind(plat)
        if kind is None:
            lines.append(f"  {plat:5} no device here")
            continue
        entries = table.for_device(plat, kind)
        if not entries:
            lines.append(f'  {plat:5} {kind}: none measured (the kernels run wherever "auto" picks them)')
            continue
        groups: dict[tuple, list] = {}
        for e in entries:
            groups.setdefault((e.target, e.mode), []).append(f"bs{e.block_size} {e.crossover:.2f}")
        lines.append(f"  {plat:5} {kind}:")
        lines.extend(f"    {target:22} {mode:9} " + "  ".join(vals) for (target, mode), vals in sorted(groups.items()))
    return lines


if __name__ == "__main__":
    print(report())
