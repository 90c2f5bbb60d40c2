"""The tree is clean under the project's linters and formatters, configured once:

* ruff lint and ruff format over the Python files, with the settings of pyproject.toml
  (``[tool.ruff]``);
* clang-format over the tracked C++/CUDA sources under ``cuda/``, with the style of
  ``.clang-format`` at the root.

``.pre-commit-config.yaml`` runs the same tools as local hooks (the versions are the ones
the ``test`` extra installs), so a commit is checked as CI checks it. The tools come with
the ``test`` extra; without one the test skips, unless ``JBS_REQUIRE_TOOLS=1`` (CI sets
it): then it fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUDA_SUFFIXES = (".cc", ".h", ".cu", ".cuh")


def _require(tool: str, found: bool):
    if found:
        return
    if os.environ.get("JBS_REQUIRE_TOOLS") == "1":
        pytest.fail(f"JBS_REQUIRE_TOOLS=1 but {tool} is not installed (it is in the test extra)")
    pytest.skip(f"{tool} is not installed (pip install -e '.[test]')")


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    _require("ruff", importlib.util.find_spec("ruff") is not None)
    result = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "."])
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    _require("ruff", importlib.util.find_spec("ruff") is not None)
    result = _run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."])
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def _tracked_cuda_sources() -> list[str] | None:
    """The C++/CUDA files under cuda/ that git tracks (a checkout's other files are not
    the project's); None outside a git checkout (an unpacked sdist)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return None
    listed = _run(["git", "ls-files", "cuda"])
    assert listed.returncode == 0, listed.stderr
    return [name for name in listed.stdout.split() if name.endswith(CUDA_SUFFIXES)]


def _clang_format() -> str | None:
    """The clang-format of the test extra: beside this Python's executable, else on PATH."""
    beside = Path(sys.executable).parent / "clang-format"
    return str(beside) if beside.is_file() else shutil.which("clang-format")


def test_clang_format_is_clean():
    clang_format = _clang_format()
    _require("clang-format", clang_format is not None)
    sources = _tracked_cuda_sources()
    if sources is None:
        pytest.skip("not a git checkout: the tracked cuda/ files are unknown")
    assert sources, "git lists no C++/CUDA files under cuda/"
    result = _run([clang_format, "--dry-run", "--Werror", *sources])
    assert result.returncode == 0, "run clang-format -i over cuda/:\n" + result.stderr[-8000:]


def test_pre_commit_runs_the_same_tools():
    """Every hook is local (no second copy of a tool at another version) and the three
    checks above are among them."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [hook for repo in config["repos"] for hook in repo["hooks"]]
    assert {repo["repo"] for repo in config["repos"]} == {"local"}
    assert all(hook["language"] == "system" for hook in hooks), hooks
    entries = {hook["id"]: hook["entry"] for hook in hooks}
    assert entries["ruff-check"].startswith("ruff check"), entries
    assert entries["ruff-format"].startswith("ruff format"), entries
    assert entries["clang-format"].startswith("clang-format"), entries
