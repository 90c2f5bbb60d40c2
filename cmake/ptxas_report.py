"""The ptxas report of the CUDA kernels, kept with the build: registers, shared memory,
stack frame and spills per kernel and architecture.

Two modes, both run by the build (CMakeLists.txt):

* ``--record DIR -- COMPILER ARGS...``: the CUDA compiler launcher. Runs the compile
  (with ``-Xptxas=-v``), writes ptxas's lines to ``DIR/<object file name>.txt`` and passes
  every other line of the compiler's stderr through, so the build's output stays as it
  was. Exit status: the compiler's.
* ``--collect DIR --out FILE``: after the module is linked, every recorded file parsed
  into one JSON list, one entry per kernel and architecture: ``kernel`` (demangled where
  c++filt is found), ``mangled``, ``arch``, ``registers``, ``barriers``, ``smem_bytes``,
  ``cmem_bytes``, ``stack_bytes``, ``spill_stores``, ``spill_loads``, ``object``.

``python -m jax_blocksparse --verbose`` shows it (jax_blocksparse/_native.py reads FILE,
``_jbs_kernels.ptxas.json`` beside the module).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '(\w+)' for '(\w+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers(.*)")


def record(folder: Path, command: list[str]) -> int:
    proc = subprocess.run(command, capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    kept, passed = [], []
    in_props = False
    for line in proc.stderr.splitlines():
        if line.startswith("ptxas info") or (in_props and line.startswith("    ")):
            kept.append(line)
            in_props = "Function properties" in line
        else:
            passed.append(line)
            in_props = False
    if passed:
        sys.stderr.write("\n".join(passed) + "\n")
    obj = command[command.index("-o") + 1] if "-o" in command else "unknown.o"
    if kept:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{Path(obj).name}.txt").write_text("\n".join(kept) + "\n")
    return proc.returncode


def parse(text: str, obj: str) -> list[dict]:
    """The kernels of one recorded ptxas log."""
    out, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = dict(mangled=m.group(1), arch=m.group(2), object=obj)
            out.append(current)
        elif current is not None and (m := _PROPS.search(line)):
            current.update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            rest = m.group(2)
            current["registers"] = int(m.group(1))
            for field, pattern in (
                ("barriers", r"(\d+) barriers"),
                ("smem_bytes", r"(\d+) bytes smem"),
                ("cmem_bytes", r"(\d+) bytes cmem\[0\]"),
            ):
                found = re.search(pattern, rest)
                current[field] = int(found.group(1)) if found else 0
    return out


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return names
    proc = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    lines = proc.stdout.splitlines()
    return lines if proc.returncode == 0 and len(lines) == len(names) else names


def collect(folder: Path, out: Path) -> int:
    kernels = []
    for path in sorted(folder.glob("*.txt")):
        kernels += parse(path.read_text(), path.stem)
    for kernel, name in zip(kernels, demangle([k["mangled"] for k in kernels])):
        kernel["kernel"] = name
    out.write_text(json.dumps(sorted(kernels, key=lambda k: (k["arch"], k["kernel"])), indent=1) + "\n")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--record"] and len(argv) > 3 and argv[2] == "--":
        return record(Path(argv[1]), argv[3:])
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--collect", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    return collect(args.collect, args.out)


if __name__ == "__main__":
    sys.exit(main())
