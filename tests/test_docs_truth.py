"""What the docs and comments say about the package is written where it cannot drift.

* **Block sizes.** ``jax_blocksparse/block_sizes.json`` is the one table of them: Python
  reads it (``jbs.SUPPORTED_BLOCK_SIZES``), the build turns it into the C++ kernels'
  ``kBlockSizes``, the Sphinx pages write ``|block_sizes|`` (``docs/conf.py`` defines it
  from the constant), docstrings name ``SUPPORTED_BLOCK_SIZES`` or format it, error
  messages format it. A list of every size written out by hand anywhere else goes
  stale the day a size is added, so none may appear outside the places named in
  ``ALLOWED``; README, which cannot include generated text, may list them only as they
  are now.
* **The CUDA gate.** Whether ``impl="auto"`` runs a CUDA kernel is the verified-targets
  gate's decision (``jax_blocksparse/verified_gpu.json``, :mod:`jax_blocksparse.verified`);
  the pages that say when the CUDA kernels run name the gate, and none says they wait
  for a crossover table.

Every tracked source and documentation file is read (``git ls-files``).
"""

import pathlib
import re
import shutil
import subprocess

import pytest

import jax_blocksparse as jbs

ROOT = pathlib.Path(__file__).resolve().parent.parent

SOURCE_SUFFIXES = {".py", ".pyi", ".rst", ".md", ".h", ".cuh", ".cu", ".cc", ".txt", ".toml", ".sh", ".cmake"}

# Files that may list the sizes by hand, and why.
ALLOWED = {
    "cuda/sm90/bsmm_sm90_tf32.h": "the sizes the TF32 kernels were written for, a fact of those kernels "
    "(tests/test_native_facts.py compares it with the table)",
}
# Text a script writes from data (bench/gpu_results.py: the gate's table), between markers.
GENERATED = re.compile(r"gpu-results:start.*?gpu-results:end", re.DOTALL)

# Numbers set apart by commas, slashes, one space, "and" / "or": "8, 16, 32, 64 or 128",
# "{8, 16, 32, 64, 128}", "8/16/32/64/128", "8 16 32 64 128". Wider gaps are a table's
# columns: measured results, whose header names the blocks that were measured.
_NUMBER = re.compile(r"(?<![\w.])\d+(?!\w|\.\d)")
_SEPARATOR = re.compile(r"\s*[,/]\s*(?:(?:and|or)\s+)?|\s(?:(?:and|or)\s+)?")


def size_lists(text: str) -> list[tuple[int, tuple[int, ...]]]:
    """(line, sizes) of every list of doubling numbers in ``text`` that reads as the block
    sizes: five or more from 8 (a stale copy of the table counts too), or exactly the
    table. Shorter runs such as one kernel variant's blocks (8, 16, 32) are other facts."""
    found, run, last_end, start = [], [], None, 0
    matches = list(_NUMBER.finditer(text)) + [None]
    for match in matches:
        value = int(match.group()) if match else None
        joined = (
            match is not None
            and run
            and value == 2 * run[-1]
            and _SEPARATOR.fullmatch(text[last_end : match.start()]) is not None
        )
        if joined:
            run.append(value)
        else:
            if (len(run) >= 5 and run[0] == 8) or tuple(run) == jbs.SUPPORTED_BLOCK_SIZES:
                found.append((text.count("\n", 0, start) + 1, tuple(run)))
            run, start = ([value], match.start()) if match else ([], 0)
        if match:
            last_end = match.end()
    return found


def tracked_sources() -> list[pathlib.Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
    return [ROOT / n for n in names if pathlib.PurePath(n).suffix in SOURCE_SUFFIXES and (ROOT / n).is_file()]


def test_the_finder_reads_the_forms_the_sizes_are_written_in():
    table = jbs.SUPPORTED_BLOCK_SIZES
    for text in ("8, 16, 32, 64 or 128", "{8, 16, 32, 64, 128}", "8/16/32/64/128", "x 8 16 32 64 128 y"):
        assert [sizes for _, sizes in size_lists(text)] == [(8, 16, 32, 64, 128)], text
    assert size_lists("a\nblocks 8, 16, 32, 64, 128 and 256") == [(2, (8, 16, 32, 64, 128, 256))]
    assert size_lists(", ".join(map(str, table))) == [(1, table)]
    # One variant's blocks, a range, a table's columns, decimals: not the table.
    assert size_lists("stacked at blocks 8, 16, 32 and 64; measured at 8 to 128; 1.28") == []
    assert size_lists("dtype  bs 8   16     32     64     128") == []


def test_no_block_size_list_by_hand():
    offending = []
    for path in tracked_sources():
        relative = path.relative_to(ROOT).as_posix()
        if relative in ALLOWED or relative == "tests/test_docs_truth.py":
            continue
        text = GENERATED.sub(lambda m: "\n" * m.group().count("\n"), path.read_text(encoding="utf-8"))
        for line, sizes in size_lists(text):
            if relative == "README.md" and sizes == jbs.SUPPORTED_BLOCK_SIZES:
                continue  # README cannot include the table; it must say it as it is
            offending.append(f"{relative}:{line}: {sizes}")
    assert not offending, (
        "block sizes listed by hand (use jbs.SUPPORTED_BLOCK_SIZES in code, |block_sizes| in the docs' "
        "pages, kBlockSizes in C++):\n" + "\n".join(offending)
    )


def test_the_allowed_places_still_list_them():
    # An entry of ALLOWED that no longer lists the sizes is stale: drop it.
    for relative in ALLOWED:
        assert size_lists((ROOT / relative).read_text(encoding="utf-8")), f"{relative} lists no block sizes now"


def test_the_docs_substitution_is_the_table():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    *head, last = map(str, jbs.SUPPORTED_BLOCK_SIZES)
    assert f"|block_sizes| replace:: {', '.join(head)} or {last}" in conf.rst_epilog


GATE_PAGES = ["README.md", "docs/guide/performance.rst", "docs/guide/gpu.rst"]


@pytest.mark.parametrize("page", GATE_PAGES)
def test_the_pages_say_the_gate_decides(page):
    text = " ".join((ROOT / page).read_text(encoding="utf-8").split())
    assert "verified_gpu.json" in text, f"{page} does not name the gate that decides which CUDA kernels auto runs"
    stale = re.search(r"(?i)until (?:a|the) GPU check writes the (?:CUDA )?crossover table", text)
    assert stale is None, f"{page}: the gate, not the crossover table, decides whether auto runs a CUDA kernel"
