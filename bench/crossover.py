"""The crossover table of ``impl="auto"``, computed from benchmark results.

``bench/bsmm.py`` times each kernel and the dense product (``impl="dense"``: the present
blocks scattered into a dense weight, then XLA's dot) at several densities, one JSON row
per (op, dtype, block size, density, kernel path). This script turns such rows into the
crossover table that :mod:`jax_blocksparse.crossover` reads: for each (platform, device
kind, FFI target, arithmetic mode, block size), the block density at which the kernel's
time meets the dense product's.

The crossover of one kernel comes from its rows sorted by density (ratio = dense time /
kernel time; the kernel wins where it is at least 1 + ``WIN_MARGIN``, 3%), by the
package's own rule (:func:`jax_blocksparse.crossover.crossover_density`, which ``tune``
uses too).

Usage::

    python bench/crossover.py OUT/bench.json --out OUT/crossovers.json   # one run's table
    python bench/crossover.py --package          # bench/results/ -> jax_blocksparse/crossovers.json
    python bench/crossover.py --package --check  # exit 1 if the package's table is not that

With ``--package`` every JSON file under ``bench/results/`` whose rows carry the fields
below is read; where several files measured the same kernel on the same device, the
newest (its ``datetime``) wins. The package's table is therefore written from committed
results only, never by hand (tests/test_crossover.py checks it).

Only complete sweeps count: a kernel (target, mode, block size) gets an entry where its
rows cover every density its run asked for (the run's ``config``, or for a GPU session
the ``configs`` of its items) and none of them failed. A sweep cut short by a deadline or
a fault leaves no entry, so ``"auto"`` falls back to its rule for unmeasured kernels
rather than to half a measurement.

Kernel variants: a Hopper target's rows carry the path they ran ("hopper" for its baseline,
``"hopper:<variant>"`` for another variant, bench/bsmm.py). Each variant gets its own
entry, keyed ``"<target>:<variant>"`` (the gate keys variants the same way), and where a
report timed several variants of one kernel, the table's ``variants`` say which won over
which densities: at each density every variant measured, the fastest, if it beat the
baseline by ``WIN_MARGIN``; a run of consecutive measured densities won by one variant gives
its range ``[low, high]``. Elsewhere the baseline runs.

The batch: a run may time density 1 at several batches (rows of activations; ``tune``'s
timings do: ``bench/tune_sweep.py``). Its ``config.batch`` names the batch its crossovers
are measured at; rows of another ``batch`` give the entry's ``rows`` and ``full_density``
only, from which ``"auto"`` moves the crossover for each product's batch
(``jax_blocksparse.crossover.Crossover.at_rows``). A run whose ``config.stop_at_win`` is
true stopped each kernel at its first win from the top, so its sweep is complete down to
that win.

Fields read: the file's ``platform`` ("gpu" means "cuda"), ``device_kind``,
``datetime``, ``compute_capability`` (CUDA), ``extension.cpu_isa`` and ``cpu_cores``
(CPU: the entry's device kind is ``cpu:<isa>:<cores>``, its family the instruction set);
each row's ``op``, ``dtype``, ``block_size``, ``density`` (and ``requested_density``),
``target``, ``mode``, ``sparse_s`` and ``dense_path_s`` (``dense_s``, XLA's dot on a ready
dense weight, where the dense path was not timed), and ``batch`` where timed at several.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _report import write_json  # noqa: E402

from jax_blocksparse.crossover import WIN_MARGIN, crossover_density  # noqa: E402  (the rule tune uses too)


def _platform(report) -> str:
    return {"gpu": "cuda"}.get(report.get("platform"), report.get("platform"))


def device_of(report) -> tuple[str, str]:
    """(device kind, family) of a report's entries: on CPU ``cpu:<isa>:<cores>`` and the
    instruction set; on CUDA JAX's device kind and the compute capability."""
    if _platform(report) == "cpu":
        isa = (report.get("extension") or {}).get("cpu_isa") or "unknown"
        cores = report.get("cpu_cores")
        kind = f"cpu:{isa}:{cores}" if cores else f"cpu:{isa}"
        return kind, isa
    return report["device_kind"], str(report.get("compute_capability") or "")


def crossover_rows(report) -> list[dict]:
    """The rows of a bench report that a crossover can be computed from (fields above)."""
    return [
        r
        for r in report.get("results", [])
        if all(r.get(f) is not None for f in ROW_FIELDS) and (r.get("dense_path_s") or r.get("dense_s"))
    ]


def _config(report, row) -> dict:
    return (report.get("configs") or {}).get(row.get("item")) or report.get("config") or {}


def _asked(config) -> set[float] | None:
    """The densities a run (its ``config``) asked for (None where the report does not say)."""
    densities = config.get("densities")
    return {round(float(d), 6) for d in densities} if densities else None


def _near(measured: float, asked: float) -> bool:
    """Whether a layout's density is the asked one (a row that does not record the density
    it asked for has its layout's own, which random masks put within a block or two)."""
    return abs(measured - asked) <= max(0.01, 0.05 * asked)


def _covers(points: list[tuple[float, float]], asked: set[float], stops_at_win: bool) -> bool:
    """Whether a kernel's ``(requested density, ratio)`` points are a complete sweep: every
    asked density measured or, for a run that stops at a kernel's first win from the top
    (``tune``'s rule: below a win the kernel does less work still), every asked density
    down to a measured win."""
    for a in sorted(asked, reverse=True):
        hit = [r for d, r in points if _near(d, a)]
        if not hit:
            return False
        if stops_at_win and hit[0] >= 1.0 + WIN_MARGIN:
            return True
    return True


def _batch(row, config) -> int | None:
    """The rows of activations ``row`` was timed at: its ``batch``, else its run's."""
    batch = row.get("batch") or config.get("batch")
    return int(batch) if batch else None


def kernel_key(row) -> str:
    """The row's kernel as the table keys it: its target, with ``:<variant>`` for a Hopper
    variant other than the baseline (its ``path``, "hopper:stacked")."""
    _, _, variant = str(row.get("path") or "").partition(":")
    return f"{row['target']}:{variant}" if variant and variant != "baseline" else row["target"]


def _requested(row) -> float:
    return round(float(row.get("requested_density", row["density"])), 6)


def entries_of(report, source: str) -> list[dict]:
    """The table entries one bench report gives, in the form of ``Crossover``'s fields:
    one per kernel whose sweep is complete (see the module docstring)."""
    kind, family = device_of(report)
    groups: dict[tuple, list] = {}  # (density, ratio, requested density) per kernel
    configs: dict[tuple, dict] = {}  # the run of each kernel's first row
    full: dict[tuple, dict[int, tuple]] = {}  # density-1 times per batch
    for r in crossover_rows(report):
        dense = r.get("dense_path_s") or r["dense_s"]
        key = (_platform(report), kind, kernel_key(r), r["mode"], int(r["block_size"]))
        config = configs.setdefault(key, _config(report, r))
        batch, main = _batch(r, config), config.get("batch")
        if _requested(r) == 1.0 and batch:
            full.setdefault(key, {})[batch] = (batch, r["sparse_s"], dense)
        if batch and main and batch != int(main):
            continue  # another batch than the run's: for the batch model only
        groups.setdefault(key, []).append((float(r["density"]), dense / r["sparse_s"], _requested(r)))
    failed = {
        (kernel_key(r), r.get("mode"), r.get("block_size"))
        for r in report.get("results", [])
        if r.get("error") and r.get("target")
    }
    out = []
    for key, points in sorted(groups.items()):
        p, kind_, t, m, bs = key
        config = configs[key]
        asked = _asked(config)
        swept = sorted(((q, ratio) for _, ratio, q in points), reverse=True)
        if (t, m, bs) in failed or (asked is not None and not _covers(swept, asked, bool(config.get("stop_at_win")))):
            continue  # an incomplete sweep: no entry
        entry = dict(
            platform=p,
            device_kind=kind_,
            target=t,
            mode=m,
            block_size=bs,
            crossover=crossover_density([(d, ratio) for d, ratio, _ in points], WIN_MARGIN),
            source=source,
            family=family,
        )
        batches = full.get(key, {})
        main = config.get("batch")
        if main and int(main) in batches and len(batches) > 1:
            entry.update(rows=int(main), full_density=[list(batches[b]) for b in sorted(batches)])
        out.append(entry)
    return out


def variants_of(report, source: str) -> list[dict]:
    """The variant choices one bench report gives, in the form of ``VariantChoice``'s fields
    (see the module docstring): none where it timed no variant beside a baseline."""
    kind, family = device_of(report)
    times: dict[tuple, dict[float, dict[str, float]]] = {}
    for r in crossover_rows(report):
        key = kernel_key(r)
        target, _, variant = key.partition(":")
        kernel = (_platform(report), kind, target, r["mode"], int(r["block_size"]))
        times.setdefault(kernel, {}).setdefault(_requested(r), {})[variant or "baseline"] = r["sparse_s"]
    out = []
    for (p, kind_, target, mode, bs), by_density in sorted(times.items()):
        winners = []  # (density, winner or None), by density
        for density in sorted(by_density):
            timed = by_density[density]
            base = timed.get("baseline")
            others = {v: t for v, t in timed.items() if v != "baseline"}
            if base is None or not others:
                winners.append((density, None))
                continue
            best = min(others, key=others.get)
            winners.append((density, best if base / others[best] >= 1.0 + WIN_MARGIN else None))
        run: list = []
        for density, winner in [*winners, (None, None)]:
            if run and winner != run[0][1]:
                if run[0][1] is not None:
                    out.append(
                        dict(
                            platform=p,
                            device_kind=kind_,
                            target=target,
                            mode=mode,
                            block_size=bs,
                            variant=run[0][1],
                            low=run[0][0],
                            high=run[-1][0],
                            source=source,
                            family=family,
                        )
                    )
                run = []
            run.append((density, winner))
    return out


def table_of(reports: list[tuple[str, dict]]) -> dict:
    """The table (JSON form) of several ``(source, report)``: per key, the newest report's
    entry; per kernel, the newest report's variant choices ("variants", where any)."""
    best: dict[tuple, tuple] = {}
    chosen: dict[tuple, tuple] = {}
    for source, report in reports:
        stamp = report.get("datetime") or report.get("date") or ""
        for e in entries_of(report, source):
            key = (e["platform"], e["device_kind"], e["target"], e["mode"], e["block_size"])
            if key not in best or (stamp, source) > best[key][0]:
                best[key] = ((stamp, source), e)
        by_kernel: dict[tuple, list] = {}
        for v in variants_of(report, source):
            by_kernel.setdefault((v["platform"], v["device_kind"], v["target"], v["mode"], v["block_size"]), []).append(
                v
            )
        for kernel, choices in by_kernel.items():
            if kernel not in chosen or (stamp, source) > chosen[kernel][0]:
                chosen[kernel] = ((stamp, source), choices)
    entries = [e for _, e in (best[k] for k in sorted(best))]
    table = {"format": 1, "about": ABOUT, "entries": entries}
    variants = [v for k in sorted(chosen) for v in chosen[k][1]]
    if variants:
        table["variants"] = variants
    return table


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
