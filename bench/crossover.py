"""The crossover table of ``impl="auto"``, computed from benchmark results.

``bench/bsmm.py`` times each kernel and the dense product (``impl="dense"``: the present
blocks scattered into a dense weight, then XLA's dot) at several densities, one JSON row
per (op, dtype, block size, density, kernel path). This script turns such rows into the
crossover table that :mod:`jax_blocksparse.crossover` reads: for each (platform, device
kind, FFI target, arithmetic mode, block size), the block density at which the kernel's
time meets the dense product's.

The crossover of one kernel, from its rows sorted by density (ratio = dense time /
kernel time, >= 1 where the kernel wins): 1.0 where it wins at every measured density;
0.0 where it loses already at the lowest; else the density where the ratio crosses 1,
interpolated linearly between the last winning density and the first losing one (a loss
below a win counts: "auto" must never be slower than dense where it was measured).

Usage::

    python bench/crossover.py OUT/bench.json --out OUT/crossovers.json   # one run's table
    python bench/crossover.py --package          # bench/results/ -> jax_blocksparse/crossovers.json
    python bench/crossover.py --package --check  # exit 1 if the package's table is not that

With ``--package`` every JSON file under ``bench/results/`` whose rows carry the fields
below is read; where several files measured the same kernel on the same device, the
newest (its ``datetime``) wins. The package's table is therefore written from committed
results only, never by hand (tests/test_crossover.py checks it).

Fields read: the file's ``platform`` ("gpu" means "cuda"), ``device_kind`` and
``datetime``; each row's ``op``, ``dtype``, ``block_size``, ``density``, ``target``,
``mode``, ``sparse_s`` and ``dense_path_s`` (``dense_s``, XLA's dot on a ready dense
weight, where the dense path was not timed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PACKAGE_TABLE = ROOT / "jax_blocksparse" / "crossovers.json"
ROW_FIELDS = ("op", "block_size", "density", "target", "mode", "sparse_s")
ABOUT = (
    "Written by bench/crossover.py from the results under bench/results/: do not edit. "
    "crossover: the block density above which the dense product beats the kernel."
)
DIGITS = 3

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _report import write_json  # noqa: E402


def crossover_density(points) -> float:
    """The crossover of one kernel from ``(density, dense_s / kernel_s)`` points (see the
    module docstring)."""
    points = sorted(points)
    if not points:
        raise ValueError("crossover_density: no points")
    prev = None
    for density, ratio in points:
        if ratio < 1.0:
            if prev is None:
                return 0.0
            d0, r0 = prev
            t = (r0 - 1.0) / (r0 - ratio)
            return round(d0 + t * (density - d0), DIGITS)
        prev = (density, ratio)
    return 1.0


def _platform(report) -> str:
    return {"gpu": "cuda"}.get(report.get("platform"), report.get("platform"))


def crossover_rows(report) -> list[dict]:
    """The rows of a bench report that a crossover can be computed from (fields above)."""
    return [
        r
        for r in report.get("results", [])
        if all(r.get(f) is not None for f in ROW_FIELDS) and (r.get("dense_path_s") or r.get("dense_s"))
    ]


def entries_of(report, source: str) -> list[dict]:
    """The table entries one bench report gives, in the form of ``Crossover``'s fields."""
    groups: dict[tuple, list] = {}
    for r in crossover_rows(report):
        dense = r.get("dense_path_s") or r["dense_s"]
        key = (_platform(report), report["device_kind"], r["target"], r["mode"], int(r["block_size"]))
        groups.setdefault(key, []).append((float(r["density"]), dense / r["sparse_s"]))
    return [
        dict(
            platform=p,
            device_kind=kind,
            target=t,
            mode=m,
            block_size=bs,
            crossover=crossover_density(points),
            source=source,
        )
        for (p, kind, t, m, bs), points in sorted(groups.items())
    ]


def table_of(reports: list[tuple[str, dict]]) -> dict:
    """The table (JSON form) of several ``(source, report)``: per key, the newest report's entry."""
    best: dict[tuple, tuple] = {}
    for source, report in reports:
        stamp = report.get("datetime") or report.get("date") or ""
        for e in entries_of(report, source):
            key = (e["platform"], e["device_kind"], e["target"], e["mode"], e["block_size"])
            if key not in best or (stamp, source) > best[key][0]:
                best[key] = ((stamp, source), e)
    entries = [e for _, e in (best[k] for k in sorted(best))]
    return {"format": 1, "about": ABOUT, "entries": entries}


def _read(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"crossover.py: cannot read {path}: {err}") from None


def committed_reports() -> list[tuple[str, dict]]:
    """Every JSON under bench/results/ that has crossover rows, as (path relative to the repo, report)."""
    out = []
    for path in sorted(RESULTS.rglob("*.json")):
        report = _read(path)
        if isinstance(report, dict) and crossover_rows(report):
            out.append((path.relative_to(ROOT).as_posix(), report))
    return out


def package_table() -> dict:
    """The table the package must ship: computed from the committed results."""
    return table_of(committed_reports())


def _summary(table) -> str:
    lines = [f"{len(table['entries'])} entries"]
    for e in table["entries"]:
        lines.append(
            f"  {e['platform']:5} {e['device_kind'][:28]:28} {e['target']:22} {e['mode']:9} "
            f"bs {e['block_size']:>3}: {e['crossover']:.3f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="*", type=Path, help="bench/bsmm.py JSON files (not with --package)")
    p.add_argument("--out", type=Path, help="write the table of RESULTS here")
    p.add_argument(
        "--package",
        action="store_true",
        help="the table of every result under bench/results/, into jax_blocksparse/crossovers.json",
    )
    p.add_argument("--check", action="store_true", help="with --package: only check the package's table")
    args = p.parse_args(argv)
    if args.package == bool(args.results):
        p.error("give RESULTS files or --package (one of the two)")
    if args.check and not args.package:
        p.error("--check goes with --package")
    if args.package:
        table = package_table()
        if args.check:
            shipped = _read(PACKAGE_TABLE) if PACKAGE_TABLE.exists() else None
            if shipped != table:
                print(
                    f"{PACKAGE_TABLE.relative_to(ROOT)} is not the table of bench/results/: "
                    "run python bench/crossover.py --package",
                    file=sys.stderr,
                )
                return 1
            print(f"{PACKAGE_TABLE.relative_to(ROOT)} is up to date ({len(table['entries'])} entries)")
            return 0
        write_json(PACKAGE_TABLE, table)
        print(f"wrote {PACKAGE_TABLE.relative_to(ROOT)}: {_summary(table)}")
        return 0
    table = table_of([(str(path), _read(path)) for path in args.results])
    if args.out:
        write_json(args.out, table)
        print(f"wrote {args.out}")
    print(_summary(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
