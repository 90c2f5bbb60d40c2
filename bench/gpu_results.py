"""Turns a GPU check's results into what ships: one command after a GPU session.

    python bench/gpu_results.py OUT/check [OUT2/check ...] [--commit SHA]
    python bench/gpu_results.py              # rewrite what ships from bench/results/ alone
    python bench/gpu_results.py --check      # exit 1 if what ships is not what bench/results/ says

From one or more folders written by tests/gpu/check.sh (or their .tgz, as
tests/gpu/device_call.sh brings them back), on one GPU:

1. **The results**, ``bench/results/gpu-<device>-<date>.json``: the benchmark rows of
   every bench item (bench/session.py; of an item measured in several folders, the run
   with the most rows; each row's roofline recomputed with the session's lowest measured
   memory bandwidth), the device (name, kind, compute capability), the commit and date
   measured, each check step's status, every GPU test's outcome and parameters, and every
   product the bench could not measure (``bench_faults``: an error row, a process killed
   in a hang or dead in a fault, in any run of an item).
2. **The gate**, ``jax_blocksparse/verified_gpu.json`` (:mod:`jax_blocksparse.verified`):
   for the device's compute capability, the keys (target, arithmetic mode, block size)
   whose isolated tests all passed with a clean or unavailable compute-sanitizer and whose
   bench products all ran, and why each other key failed (bench/_gate.py). Other compute
   capabilities' entries stay.
3. **The crossover table**, ``jax_blocksparse/crossovers.json``, rebuilt from every
   committed result, complete sweeps only (bench/crossover.py).
4. **The GPU tables** of README.md and docs/guide/performance.rst, between their
   ``gpu-results`` markers, from the newest GPU result: the bfloat16 efficiency and
   speedup at density 0.1 per block size for both kernel paths, and what passed and
   failed per target, mode and block size.

Everything is computed from committed files, so ``--check`` (a CPU test runs it) finds
any of them edited by hand or left stale.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gate  # noqa: E402
import crossover as crossover_script  # noqa: E402
from _bsmm_report import faults_of  # noqa: E402
from _report import write_json  # noqa: E402
from _timing import roofline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GATE = ROOT / "jax_blocksparse" / "verified_gpu.json"
README = ROOT / "README.md"
PERFORMANCE = ROOT / "docs" / "guide" / "performance.rst"
KIND = "gpu-check"  # the results' "benchmark" field
HEADLINE = dict(dtype="bfloat16", density=0.1)
OPS = ("fprop", "bprop", "updat")
ABOUT = (
    "Written by bench/gpu_results.py from the GPU checks under bench/results/: do not edit. "
    "passed: target -> arithmetic mode -> block sizes whose isolated GPU tests all passed "
    "with a clean (or unavailable) compute-sanitizer; failed: the other keys the tests exercised, and why."
)


# ---------------------------------------------------------------------------------
# Reading check folders
# ---------------------------------------------------------------------------------


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def open_check(source: Path, scratch: Path) -> list[Path]:
    """The check folders of ``source``: itself, or those inside a .tgz of them."""
    if source.is_dir():
        return [source]
    with tarfile.open(source) as tar:
        tar.extractall(scratch, filter="data")
    found = sorted({p.parent for p in scratch.rglob("steps.tsv")})
    if not found:
        raise SystemExit(f"gpu_results.py: {source}: no check folder (steps.tsv) inside")
    return found


def steps_of(folder: Path) -> dict[str, str]:
    """step -> status, from steps.tsv."""
    out = {}
    path = folder / "steps.tsv"
    for line in path.read_text().splitlines() if path.exists() else ():
        parts = line.split("\t")
        if len(parts) >= 2:
            out[parts[0]] = parts[1]
    return out


def meta_of(folder: Path) -> dict[str, str]:
    out = {}
    path = folder / "meta.txt"
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        key, sep, value = line.partition(": ")
        if sep and key.isidentifier():
            out.setdefault(key, value.strip())
    return out


def device_of(folders: list[Path]) -> dict:
    """name, compute capability and driver of the GPU, from preflight.json (else meta.txt)."""
    for folder in folders:
        gpu = (_json(folder / "preflight.json") or {}).get("gpu") or {}
        if gpu.get("present"):
            return dict(name=gpu["name"], compute_capability=gpu["compute_cap"], driver=gpu.get("driver", ""))
    for folder in folders:
        fields = [f.strip() for f in meta_of(folder).get("gpu", "").split(",")]
        if len(fields) >= 3:
            return dict(name=fields[0], compute_capability=fields[2], driver=fields[1])
    raise SystemExit("gpu_results.py: no GPU named in the check folders (preflight.json, meta.txt)")


def bench_items(folders: list[Path]) -> dict[str, dict]:
    """item -> its report, of the folder that measured it with the most rows (the later on a tie)."""
    best: dict[str, dict] = {}
    for folder in folders:
        for path in sorted((folder / "bench").glob("bench-*.json")):
            report = _json(path)
            if not report:
                continue
            name = path.stem.removeprefix("bench-")
            if name not in best or len(report.get("results", [])) >= len(best[name].get("results", [])):
                best[name] = report
    return best


def tests_of(folders: list[Path], params: dict[str, dict]) -> dict[str, dict]:
    """node id -> {"outcome", "params"} over every folder's gpu-tests (a failure anywhere wins)."""
    tests: dict[str, dict] = {}
    for folder in folders:
        outcomes = _gate.junit_outcomes(folder / "gpu-tests")
        outcomes.update({k: f"died ({v[:160]})" for k, v in _gate.died_tests(folder / "gpu-tests.json").items()})
        for nodeid, outcome in outcomes.items():
            if tests.get(nodeid, {}).get("outcome") not in (None, "passed", "skipped"):
                continue
            tests[nodeid] = dict(outcome=outcome, params=params.get(nodeid, {}))
    return tests


def bench_faults(folders: list[Path]) -> list[dict]:
    """Every product a bench item could not measure (bench/_bsmm_report.faults_of), over
    every run of every item in the folders (not only the one kept for its rows: a rerun
    that left a faulting path out must not hide the fault)."""
    out = []
    for folder in folders:
        for path in sorted((folder / "bench").glob("bench-*.json")):
            report = _json(path)
            for fault in faults_of(report) if report else ():
                fault["item"] = path.stem.removeprefix("bench-")
                if fault not in out:  # an item resumed in a later folder repeats its kept faults
                    out.append(fault)
    return out


def sanitizer_of(folders: list[Path]) -> tuple[str, str]:
    """("clean" / "unavailable" / "errors" / "not run", the evidence), over the folders: a
    run that found errors anywhere decides; one cut short by its time limit is superseded
    by a run of the same subset that finished clean (a second call of the session)."""
    statuses = [steps_of(f).get("sanitizer") for f in folders]
    if "fail" in statuses:
        return "errors", "compute-sanitizer found errors (sanitizer.log)"
    if "pass" in statuses:
        return "clean", "memcheck and racecheck clean"
    if "timeout" in statuses:
        return "errors", "compute-sanitizer did not finish (sanitizer.log)"
    if "unavailable" in statuses:
        return "unavailable", "compute-sanitizer does not work on that machine"
    return "not run", "the check did not run compute-sanitizer"


# ---------------------------------------------------------------------------------
# What ships
# ---------------------------------------------------------------------------------


def results_of(folders: list[Path], commit: str | None) -> dict:
    """The results file: the device, the check, the bench rows and the tests."""
    device = device_of(folders)
    items = bench_items(folders)
    meta = meta_of(folders[0])
    date = (meta.get("date") or datetime.datetime.now(datetime.UTC).isoformat())[:10]
    rows, configs, header = [], {}, {}
    for name, report in sorted(items.items()):
        if not header:
            header = {
                k: report.get(k) for k in ("device", "device_kind", "platform", "versions", "extension", "timing")
            }
        configs[name] = report.get("config") or {}
        rows.extend(dict(row, item=name) for row in report.get("results", []))
    sanitizer, why = sanitizer_of(folders)
    tests = tests_of(folders, _gate.collect_params())
    faults = bench_faults(folders)
    # One memory ceiling for the session: the lowest an item measured (a bench that timed
    # a chain of elementwise updates, which XLA fuses into one pass, read several times the
    # real bandwidth); every row's roofline is recomputed with it.
    bandwidths = [r.get("bandwidth_Bps") for r in items.values() if r.get("bandwidth_Bps")]
    bandwidth = min(bandwidths) if bandwidths else None
    for row in rows:
        size = row.get("size") or [0, 0, 0]
        row.update(
            roofline(row["op"], *size, row["density"], row["dtype"], dense_s=row.get("dense_s"), bandwidth=bandwidth)
        )
    return dict(
        benchmark=KIND,
        **header,
        device_name=device["name"],
        compute_capability=device["compute_capability"],
        driver=device["driver"],
        commit=commit or meta.get("commit", "unknown"),
        date=date,
        datetime=meta.get("date", date),
        checks=[dict(steps=steps_of(f), meta=meta_of(f)) for f in folders],
        sanitizer=dict(status=sanitizer, why=why),
        bandwidth_Bps=bandwidth,
        configs=configs,
        results=rows,
        tests=tests,
        bench_faults=faults,
    )


def gate_entry(results: dict, source: str) -> dict:
    """The gate's entry for the results' compute capability (verified.Device's JSON)."""
    status = results["sanitizer"]["status"]
    passed, failed = _gate.key_results(
        results["tests"],
        sanitizer_ok=status in ("clean", "unavailable"),
        sanitizer_why=results["sanitizer"]["why"],
        bench_faults=results.get("bench_faults", ()),
    )
    return dict(
        compute_capability=results["compute_capability"],
        device_kinds=[results.get("device_kind") or results["device_name"]],
        date=results["date"],
        commit=results["commit"],
        source=source,
        sanitizer=status,
        passed=passed,
        failed=[dict(target=t, mode=m, block_size=bs, why=why) for (t, m, bs), why in sorted(failed.items())],
    )


def committed_results() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(RESULTS.glob("gpu-*.json")):
        report = _json(path)
        if isinstance(report, dict) and report.get("benchmark") == KIND:
            out.append((path.relative_to(ROOT).as_posix(), report))
    return out


def gate_of(results: list[tuple[str, dict]]) -> dict:
    """The gate from every committed GPU check: per compute capability, the newest."""
    newest: dict[str, tuple[str, str, dict]] = {}
    for source, report in results:
        cc = report["compute_capability"]
        stamp = report.get("datetime") or report["date"]
        if cc not in newest or (stamp, source) > newest[cc][:2]:
            newest[cc] = (stamp, source, report)
    devices = [gate_entry(report, source) for _, (_, source, report) in sorted(newest.items())]
    return {"format": 1, "about": ABOUT, "devices": devices}


# ---------------------------------------------------------------------------------
# The tables of README and docs
# ---------------------------------------------------------------------------------


def _headline_rows(report: dict) -> dict[int, dict]:
    """block size -> path -> op -> row, bf16 at density 0.1 of the largest problem measured."""
    rows = [
        r
        for r in report["results"]
        if r.get("dtype") == HEADLINE["dtype"]
        and abs(float(r.get("requested_density", r["density"])) - HEADLINE["density"]) < 1e-6
        and r.get("efficiency")
    ]
    size = {}
    for r in rows:
        size[r["block_size"]] = max(size.get(r["block_size"], []), r.get("size") or [])
    out: dict[int, dict] = {}
    for r in rows:
        if (r.get("size") or []) == size[r["block_size"]]:
            out.setdefault(r["block_size"], {}).setdefault(r["path"], {})[r["op"]] = r
    return out


def _cell(row) -> str:
    return f"{row['efficiency']:.2f} / {row['speedup']:.2f}x" if row else "-"


def _gate_lines(entry: dict) -> list[tuple[str, str, str]]:
    """(target, mode, "passed: 8 16 ... / failed: ...") per target and mode."""
    out = []
    failed: dict[tuple, list] = {}
    for f in entry["failed"]:
        failed.setdefault((f["target"], f["mode"]), []).append(f["block_size"])
    keys = sorted({(t, m) for t, modes in entry["passed"].items() for m in modes} | set(failed))
    for t, m in keys:
        ok = entry["passed"].get(t, {}).get(m, [])
        bad = sorted(failed.get((t, m), []))
        text = ("passed " + " ".join(map(str, ok))) if ok else ""
        if bad:
            why = next(f["why"] for f in entry["failed"] if (f["target"], f["mode"]) == (t, m))
            why = why if len(why) <= 200 else why[:197] + "..."
            text += ("; " if text else "") + "failed " + " ".join(map(str, bad)) + f" ({why})"
        out.append((t, m, text))
    return out


def _failed_by_target(failed: list[dict], width: int = 150) -> list[str]:
    """One phrase per reason of the failed keys (a target's first): the targets that failed
    for it, their modes and block sizes."""
    groups: dict[str, list[dict]] = {}
    for target in sorted({f["target"] for f in failed}):
        mine = [f for f in failed if f["target"] == target]
        groups.setdefault(mine[0]["why"], []).extend(mine)
    out = []
    for why, keys in groups.items():
        targets = ", ".join(f"`{t}`" for t in sorted({f["target"] for f in keys}))
        modes = ", ".join(sorted({f["mode"] for f in keys}))
        sizes = " ".join(str(b) for b in sorted({f["block_size"] for f in keys}))
        why = why if len(why) <= width else why[: width - 3] + "..."
        out.append(f"{targets} ({modes}; blocks {sizes}): {why}")
    return out


def tables(source: str, report: dict, entry: dict) -> tuple[str, str]:
    """(README's markdown table, performance.rst's reST tables) of the newest GPU result."""
    heads = _headline_rows(report)
    size = next((r.get("size") for paths in heads.values() for ops in paths.values() for r in ops.values()), None)
    shape = f"W {size[0]} x {size[1]}, N = {size[2]}" if size else ""
    what = (
        f"{report['device_name']} (compute capability {report['compute_capability']}), {report['date']}, "
        f"commit {report['commit']}, bf16, {shape}, density 0.1: efficiency / speedup over `jnp.dot`"
    )
    md = [f"{what} ([{Path(source).name}]({source})):", ""]
    md.append("| block | Hopper fprop | Hopper bprop | Hopper updat | Ampere-design fprop | Ampere-design updat |")
    md.append("|---:|---:|---:|---:|---:|---:|")
    for bs in sorted(heads, reverse=True):
        h, a = heads[bs].get("hopper", {}), heads[bs].get("ampere", {})
        cells = [_cell(h.get(op)) for op in OPS] + [_cell(a.get("fprop")), _cell(a.get("updat"))]
        md.append(f"| {bs} | " + " | ".join(cells) + " |")
    failed = entry["failed"]
    md.append("")
    md.append(
        f"Verified there (isolated tests, compute-sanitizer {entry['sanitizer']}): "
        + (
            f"{sum(len(v) for m in entry['passed'].values() for v in m.values())} keys passed, {len(failed)} failed"
            + (": " + "; ".join(_failed_by_target(failed)) if failed else "")
        )
        + "."
    )
    rst = [what.replace("`", "``") + f" (``{source}``).", ""]
    rst += [".. list-table::", "   :header-rows: 1", ""]
    rst.append("   * - block")
    rst += [f"     - {p} {op}" for p in ("Hopper", "Ampere-design") for op in OPS]
    for bs in sorted(heads, reverse=True):
        rst.append(f"   * - {bs}")
        for p in ("hopper", "ampere"):
            rst += [f"     - {_cell(heads[bs].get(p, {}).get(op))}" for op in OPS]
    rst += [
        "",
        f"What the gate verified on compute capability {entry['compute_capability']} "
        f"(``jax_blocksparse/verified_gpu.json``; compute-sanitizer {entry['sanitizer']}):",
        "",
    ]
    rst += [".. list-table::", "   :header-rows: 1", "", "   * - target", "     - mode", "     - block sizes"]
    for t, m, text in _gate_lines(entry):
        rst += [f"   * - ``{t}``", f"     - {m}", f"     - {text}"]
    return "\n".join(md), "\n".join(rst)


MARKERS = {
    README: ("<!-- gpu-results:start -->", "<!-- gpu-results:end -->"),
    PERFORMANCE: (".. gpu-results:start", ".. gpu-results:end"),
}


def with_table(path: Path, table: str) -> str:
    """The text of ``path`` with ``table`` between its markers."""
    start, end = MARKERS[path]
    text = path.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"gpu_results.py: {path.relative_to(ROOT)} has no {start} ... {end} markers")
    return pattern.sub(lambda _: f"{start}\n\n{table}\n\n{end}", text, count=1)


def shipped() -> dict[Path, str]:
    """path -> the text it must have, from the committed results."""
    results = committed_results()
    out: dict[Path, str] = {}
    gate = gate_of(results)
    out[GATE] = json.dumps(gate, indent=2) + "\n"
    out[crossover_script.PACKAGE_TABLE] = json.dumps(crossover_script.package_table(), indent=2) + "\n"
    if results:
        source, newest = max(results, key=lambda sr: (sr[1].get("datetime") or sr[1]["date"], sr[0]))
        entry = next(d for d in gate["devices"] if d["compute_capability"] == newest["compute_capability"])
        md, rst = tables(source, newest, entry)
        out[README] = with_table(README, md)
        out[PERFORMANCE] = with_table(PERFORMANCE, rst)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checks", nargs="*", type=Path, help="check folders (or their .tgz) of one GPU session")
    p.add_argument("--commit", help="the commit measured (default: the check's meta.txt)")
    p.add_argument("--name", help="the results file's device part (default: from the GPU's name, e.g. h100)")
    p.add_argument("--check", action="store_true", help="only check that what ships matches bench/results/")
    args = p.parse_args(argv)
    if args.check and args.checks:
        p.error("give check folders, or --check, not both")
    if args.checks:
        with tempfile.TemporaryDirectory() as tmp:
            folders = [f for i, c in enumerate(args.checks) for f in open_check(c, Path(tmp) / str(i))]
            report = results_of(folders, args.commit)
        name = (
            args.name
            or (re.search(r"\b([HAB]\d{2,3})\b", report["device_name"]) or re.search(r"(\w+)$", report["device_name"]))
            .group(1)
            .lower()
        )
        path = RESULTS / f"gpu-{name}-{report['date']}.json"
        write_json(path, report)
        print(f"wrote {path.relative_to(ROOT)}: {len(report['results'])} bench rows, {len(report['tests'])} tests")
    stale = []
    for path, text in shipped().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(path.relative_to(ROOT).as_posix())
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(
            f"not what bench/results/ says: {', '.join(stale)} (run python bench/gpu_results.py CHECK...)",
            file=sys.stderr,
        )
        return 1
    if args.check:
        print("the gate, the crossover table and the GPU tables match bench/results/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
