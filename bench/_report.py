"""What every benchmark's JSON report shares: the commit it measured and an atomic write."""

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


def write_json(path: Path, report: dict) -> None:
    """Writes ``report`` to ``path`` through a temporary file, so a reader never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
