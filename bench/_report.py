"""What every benchmark's JSON report shares: the commit and the device it measured, and an atomic write."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def git_commit() -> str:
    """JBS_COMMIT if set (tests/gpu/check.sh sets it), else git's short HEAD, else "unknown"."""
    if os.environ.get("JBS_COMMIT"):
        return os.environ["JBS_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).resolve().parent,
            timeout=10,
            check=False,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one), else the machine's."""
    from jax_blocksparse import crossover

    return crossover.usable_cores()


def write_json(path: Path, report: dict) -> None:
    """Writes ``report`` to ``path`` through a temporary file, so a reader never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)


def measured_on() -> dict:
    """``{"device", "cpu_isa"}`` of the first device: on a CPU the crossover table's name
    for it, ``"cpu:<isa>:<cores>"`` (the instruction set the CPU kernels dispatch to), and
    that instruction set; an accelerator's device kind, and None."""
    import jax

    from jax_blocksparse import crossover

    device = jax.devices()[0]
    if device.platform != "cpu":
        return {"device": device.device_kind, "cpu_isa": None}
    kind = crossover.cpu_device_kind()
    return {"device": kind, "cpu_isa": kind.split(":")[1]}


def default_report_path(benchmark: str, report: dict) -> Path:
    """``bench/results/<benchmark>-<device>-<date>.json`` for ``report`` (its ``device``, as
    :func:`measured_on` names it, made file-name friendly, and its ``date``)."""
    device = "".join(ch if ch.isalnum() else "-" for ch in report["device"].lower()).strip("-")
    return Path(__file__).resolve().parent / "results" / f"{benchmark}-{device}-{report['date']}.json"


def write_report(path, benchmark: str, report: dict) -> Path:
    """Writes ``report`` to ``path``, by default :func:`default_report_path`; prints and
    returns the path."""
    if path is None:
        path = default_report_path(benchmark, report)
    write_json(path, report)
    print(f"wrote {path}")
    return Path(path)
