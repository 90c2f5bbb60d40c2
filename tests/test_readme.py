"""README.md is the front door, and what it shows is true.

* Its ```python blocks run, in order, as one script in a fresh process (each block may use
  what the ones before it defined). A block that cannot run in CI (it needs a GPU or large
  data) must say so on the line before its fence: ``<!-- not run: <why> -->``.
* It stays short (the details live in docs/), and every repository file it names or links
  exists.
* Its test command is what CI (``.ci/run``) runs.
"""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 260

_FENCE = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_NOT_RUN = re.compile(r"<!-- not run: \S.*-->\s*$")


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks to run, as (line of the fence, code), in order; blocks marked
    ``<!-- not run: why -->`` on the line before their fence are left out."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not _NOT_RUN.search(before):
            blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


def test_python_blocks_run(tmp_path):
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert blocks, "README.md has no ```python block"
    # One script, each block preceded by a marker naming its line, so that a failure says where.
    script = "\n".join(f"print('README block at line {line}', flush=True)\n{code}" for line, code in blocks)
    path = tmp_path / "readme_blocks.py"
    path.write_text(script, encoding="utf-8")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    run = subprocess.run(
        [sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert run.returncode == 0, (
        f"README's python blocks failed (exit {run.returncode}); the last block started is where:\n"
        f"{run.stdout[-4000:]}\n{run.stderr[-6000:]}"
    )


def test_not_run_marker_is_recognised():
    text = "a\n<!-- not run: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    assert python_blocks(text) == [(7, "y = 2\n")]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_LINES, (
        f"README.md has {lines} lines (at most {MAX_LINES}): it is the front door; put details in docs/guide/"
    )


def test_named_files_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#\s]+)\)", text)
    paths = re.findall(r"(?<![\w/.*-])((?:[\w.-]+/)+[\w.-]+\.(?:sh|py|rst|json|toml))\b", text)
    named = [p for p in links + paths if "://" not in p]
    assert named, "README names no file"
    missing = sorted({p for p in named if not (ROOT / p).exists()})
    assert not missing, f"README.md names files that do not exist: {missing}"


def test_test_command_is_what_ci_runs():
    readme = README.read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -e ".[test]" && python -m pytest -n 2' in readme
    assert re.search(r'^python3? -m pip install -e "\.\[test\]"', ci, re.MULTILINE), (
        ".ci/run no longer installs .[test]"
    )
    assert re.search(r"^python3? -m pytest -n 2\s*$", ci, re.MULTILINE), ".ci/run no longer runs pytest -n 2"
