"""The repository stands on its own: no tracked file points outside it or cites an issue.

A reader of a clone has neither the directories that sat beside the working copy nor
the tracker where the work was planned, so a path such as ``../shared/...`` or a
reference such as "issue 15" or "the issue's targets" tells them nothing: say what is
meant instead, and commit the data a statement rests on (benchmark results go under
``bench/results/``).

Every tracked text file is read (``git ls-files``), but binary files (those with a NUL
byte) and this file, which must name what it forbids.
"""

import pathlib
import re
import shutil
import subprocess

import pytest

THIS = pathlib.Path(__file__).resolve()
ROOT = THIS.parent.parent

# Paths that lead out of the repository.
OUTSIDE = [
    re.compile(r"\.\./shared\b"),
    re.compile(r"\bshared/measurements\b"),
    re.compile(r"/work/"),
]
# Citations of a tracker's issues or pull requests.
CITATIONS = [
    re.compile(r"(?i)\b(?:issue|pull request|PR)s?\s*(?:#|no\.\s*|number\s*)?\d+\b"),
    re.compile(r"(?i)\bthe issue(?:'s)?\b"),
    re.compile(r"(?<![\w&#/=\"'])#\d+\b(?![;\w])"),
]
# Files whose text is data, where "#123" may be a colour or an anchor.
DATA_SUFFIXES = {".css", ".svg", ".json", ".html"}


def tracked_text_files() -> list[pathlib.Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = []
    for name in out.decode("utf-8", "surrogateescape").split("\0"):
        path = ROOT / name
        if name and path.is_file() and path != THIS and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def offending_lines(text: str, patterns) -> list[tuple[int, str]]:
    """(line number, line) of every line that one of ``patterns`` matches."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in patterns)
    ]


def test_no_file_points_outside_the_repository():
    found = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in offending_lines(text, OUTSIDE)]
    assert not found, "tracked files point outside the repository:\n" + "\n".join(found)


def test_no_file_cites_an_issue():
    found = []
    for path in tracked_text_files():
        if path.suffix in DATA_SUFFIXES or path.name == "LICENSE":
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        found += [f"{path.relative_to(ROOT)}:{n}: {line}" for n, line in offending_lines(text, CITATIONS)]
    assert not found, "tracked files cite issues a reader cannot follow (say what is meant):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "numbers in `../shared/measurements`",
        "see shared/measurements/h100/README.md",
        "the file /work/shared/design/GPU.md",
    ],
)
def test_outside_paths_are_caught(line):
    assert offending_lines(line, OUTSIDE)


@pytest.mark.parametrize(
    "line",
    [
        "as issue 15, item 5 asks",
        "fixed in issue #30",
        "the issue's targets",
        "see #42.",
        "(PR 7)",
    ],
)
def test_citations_are_caught(line):
    assert offending_lines(line, CITATIONS)


@pytest.mark.parametrize(
    "line",
    [
        "#include <cuda.h>",
        "#define N 8",
        "x = y  # 3 blocks",
        "color: #333;",
        "issues the TMA loads",
        "sm_8#1",
        "a[#]",
    ],
)
def test_ordinary_text_passes(line):
    assert not offending_lines(line, CITATIONS + OUTSIDE)
