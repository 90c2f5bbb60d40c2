"""The summary of tests/gpu/check.sh: each step's status, counts and seconds, every
failing test with its first error line, this run's headline bench numbers (bf16
efficiency and speedup per op and block size at density 0.1, per kernel path) and, last,
pass or fail per kernel target, mode and block size (what the gate would say: bench/_gate.py).

    python3 bench/check_summary.py OUTDIR      # reads OUTDIR/steps.tsv and the steps' outputs

Reads what check.sh leaves in OUTDIR: ``steps.tsv`` (name, status, exit code, seconds,
time limit, log), ``meta.txt``, the JSON of tests/gpu/run_isolated.py for the isolated
test steps (``gpu-tests.json``, ``training.json``, ``suite.json``), the sanitizer logs,
``bench.json``, ``crossovers.json`` and ``ncu_summary.json``. Prints the table and
writes ``summary.json`` beside them. Exit status 1 if any step did not pass (or none
ran), else 0.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_gate.py, also when loaded by path
import _gate  # noqa: E402

HEADLINE_DTYPE = "bfloat16"
HEADLINE_DENSITY = 0.1
OPS = ("fprop", "bprop", "updat")
PATH_ORDER = ("ampere", "hopper", "native")
ISOLATED_STEPS = ("gpu-tests", "training", "suite")  # steps run by tests/gpu/run_isolated.py
PASSING = ("pass", "unavailable")  # a step whose tool does not work on this machine is no failure
HEADLINE_FIELDS = (
    "efficiency",
    "speedup",
    "call_efficiency",
    "roofline_speedup_bound",
    "sparse_s",
    "dense_s",
    "dense_path_s",
    "torch_bsr_s",
    "speedup_vs_torch_bsr",
    "target",
    "mode",
)


def read_steps(out: Path) -> list[dict]:
    """The rows of OUTDIR/steps.tsv."""
    steps = []
    path = out / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 6 or parts[0] == "name":
            continue
        name, status, rc, secs, limit, log = parts[:6]
        steps.append(
            dict(
                name=name,
                status=status,
                rc=int(rc) if rc.lstrip("-").isdigit() else None,
                seconds=float(secs) if secs else None,
                limit_s=int(limit) if limit.isdigit() else None,
                log=log,
            )
        )
    return steps


def _read_json(out: Path, name: str):
    """(report, None), or (None, why) when OUTDIR/name is missing (why None) or unreadable."""
    path = out / name
    if not path.exists():
        return None, None
    try:
        return json.loads(path.read_text()), None
    except json.JSONDecodeError:
        return None, f"{name} unreadable"


def isolated_counts(out: Path, step: str) -> str | None:
    """ "J jobs: P passed, F fail, ...; tests: ..." from a run_isolated.py JSON."""
    report, why = _read_json(out, f"{step}.json")
    if report is None:
        return why
    totals = report.get("totals") or {}
    jobs = [f"{totals.get('pass', 0)} passed"]
    jobs += [f"{totals[s]} {s}" for s in ("fail", "died", "timeout", "error", "empty", "not-run") if totals.get(s)]
    tests = totals.get("tests") or {}
    text = f"{totals.get('jobs', 0)} jobs: {', '.join(jobs)}; tests: {tests.get('passed', 0)} passed"
    text += "".join(f", {tests[k]} {k}" for k in ("failed", "errors", "skipped") if tests.get(k))
    if not report.get("complete", False):
        text += "; runner cut short"
    return text


def sanitizer_counts(out: Path) -> str | None:
    parts = []
    for tool in ("memcheck", "racecheck"):
        log = out / f"sanitizer_{tool}.log"
        if not log.exists():
            continue
        text = log.read_text(errors="replace")
        passed = re.findall(r"(\d+) passed", text)
        failed = re.findall(r"(\d+) failed", text)
        errors = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: (\d+)", text)
        parts.append(
            f"{tool}: {passed[-1] if passed else 0} passed"
            + (f", {failed[-1]} failed" if failed else "")
            + f", {errors[-1] if errors else '?'} errors"
        )
    return "; ".join(parts) or None


def bench_counts(out: Path) -> str | None:
    report, why = _read_json(out, "bench.json")
    if report is None:
        return why
    rows = report.get("results", [])
    per_path: dict[str, int] = {}
    for r in rows:
        per_path[r.get("path", "?")] = per_path.get(r.get("path", "?"), 0) + 1
    paths = ", ".join(f"{p} {n}" for p, n in sorted(per_path.items()))
    torch = sum(1 for r in rows if r.get("torch_bsr_s"))
    errors = sum(1 for r in rows if r.get("error"))
    text = f"{len(rows)} rows ({paths or 'none'}; {torch} with torch BSR"
    text += f"; {errors} errors)" if errors else ")"
    dtypes = sorted({r.get("dtype") for r in rows if r.get("dtype")})
    if dtypes:
        text += f" {'/'.join(dtypes)}"
    if not report.get("complete", True):
        text += f"; incomplete: {report.get('stopped') or 'cut short'}"
    return text


def crossover_counts(out: Path) -> str | None:
    table, why = _read_json(out, "crossovers.json")
    if table is None:
        return why
    return f"{len(table.get('entries', []))} entries"


def ncu_counts(out: Path) -> str | None:
    s, why = _read_json(out, "ncu_summary.json")
    if s is None:
        return why
    text = f"{len(s.get('rows', []))} kernels ({s.get('matched_by', '?')})"
    if s.get("warnings"):
        text += f", {len(s['warnings'])} warnings"
    return text


def ncu_profiled(out: Path) -> str | None:
    profiled = 0
    for name in ("ncu_raw.csv", "ncu.log"):
        if (out / name).exists():
            profiled = max(profiled, (out / name).read_text(errors="replace").count("==PROF== Profiling"))
    problems = None
    if (out / "ncu_problems.json").exists():
        try:
            problems = len(json.loads((out / "ncu_problems.json").read_text())["problems"])
        except (json.JSONDecodeError, KeyError):
            pass
    if not profiled and problems is None:
        return None
    return f"{profiled} launches profiled" + (f" for {problems} problems" if problems is not None else "")


COUNTS = {
    **{step: (lambda out, step=step: isolated_counts(out, step)) for step in ISOLATED_STEPS},
    "sanitizer": sanitizer_counts,
    "bench": bench_counts,
    "crossover": crossover_counts,
    "ncu": ncu_profiled,
    "ncu-summary": ncu_counts,
}


def failures(out: Path) -> list[dict]:
    """Every job of the isolated steps that did not pass (not-run left out): its first
    failing test, first error line and, where memcheck reran it, its first report."""
    found = []
    for step in ISOLATED_STEPS:
        report, _ = _read_json(out, f"{step}.json")
        for job in (report or {}).get("jobs", []):
            if job.get("status") in ("pass", "not-run"):
                continue
            first = job.get("first_failure") or {}
            sanitizer = job.get("sanitizer") or {}
            found.append(
                dict(
                    step=step,
                    job=job.get("id"),
                    status=job.get("status"),
                    test=first.get("test"),
                    error=first.get("error"),
                    cuda_error=job.get("cuda_error"),
                    memcheck=sanitizer.get("status"),
                    memcheck_report=sanitizer.get("first_report"),
                    log=f"{step}/{job['log']}" if job.get("log") else None,
                )
            )
    return found


def not_run(out: Path) -> dict[str, list[str]]:
    """Per isolated step, the jobs its budget left unstarted."""
    left = {}
    for step in ISOLATED_STEPS:
        report, _ = _read_json(out, f"{step}.json")
        ids = [j.get("id") for j in (report or {}).get("jobs", []) if j.get("status") == "not-run"]
        if ids:
            left[step] = ids
    return left


def _size(row) -> tuple:
    return tuple(row.get("size") or ())


def headline(out: Path) -> list[dict]:
    """bf16 rows at density ~0.1 of bench.json: per block size, per path, per op (of each
    block size, the rows of the largest problem measured: the session's 8192^3)."""
    report, _ = _read_json(out, "bench.json")
    rows = [
        r
        for r in (report or {}).get("results", [])
        if r.get("dtype") == HEADLINE_DTYPE and abs(r.get("density", 0) - HEADLINE_DENSITY) <= 0.02
    ]
    largest: dict[int, tuple] = {}
    for r in rows:
        largest[r["block_size"]] = max(largest.get(r["block_size"], ()), _size(r))
    by_bs: dict[int, dict] = {}
    for r in rows:
        if _size(r) != largest[r["block_size"]]:
            continue
        path = r.get("path", "native")
        by_bs.setdefault(r["block_size"], {}).setdefault(path, {})[r["op"]] = {k: r.get(k) for k in HEADLINE_FIELDS}
    return [dict(block_size=bs, paths=paths) for bs, paths in sorted(by_bs.items())]


def _f(v, spec="5.2f"):
    return "-" if v is None else format(v, spec)


def _headline_table(heads: list[dict]) -> list[str]:
    paths = [p for p in PATH_ORDER if any(p in h["paths"] for h in heads)]
    paths += sorted({p for h in heads for p in h["paths"]} - set(paths))
    cell = 12  # "0.12  1.18x"
    lines = [
        f"bench, {HEADLINE_DTYPE}, density {HEADLINE_DENSITY}: efficiency (dense time x density / sparse "
        "time) and speedup (dense time / sparse time), device time"
    ]
    top = f"{'':>4} " + " | ".join(f"{p:^{3 * cell + 2}}" for p in paths)
    sub = f"{'bs':>4} " + " | ".join(" ".join(f"{op:>{cell}}" for op in OPS) for _ in paths)
    lines += [top, sub]
    for h in heads:
        cells = []
        for p in paths:
            ops = h["paths"].get(p, {})
            cells.append(
                " ".join(
                    f"{_f(ops.get(op, {}).get('efficiency'), '.2f')} "
                    f"{_f(ops.get(op, {}).get('speedup'), '.2f')}x".rjust(cell)
                    for op in OPS
                )
            )
        lines.append(f"{h['block_size']:>4} " + " | ".join(cells))
    return lines


def gate_keys(out: Path) -> tuple[dict, dict] | None:
    """(passed: target -> mode -> block sizes, failed: key -> why) of this run's GPU tests
    (bench/_gate.py: the keys each test exercises, from pytest's collection); None where
    the run has no gpu-tests results or they cannot be read."""
    folder = out / "gpu-tests"
    if not folder.is_dir():
        return None
    try:
        params = _gate.collect_params()
        outcomes = _gate.junit_outcomes(folder)
        outcomes.update({k: f"died ({v[:80]})" for k, v in _gate.died_tests(out / "gpu-tests.json").items()})
        tests = {nodeid: dict(outcome=o, params=params.get(nodeid, {})) for nodeid, o in outcomes.items()}
        status = {s["name"]: s["status"] for s in read_steps(out)}.get("sanitizer")
        return _gate.key_results(
            tests, sanitizer_ok=status in ("pass", "unavailable"), sanitizer_why=f"sanitizer {status}"
        )
    except Exception as err:  # noqa: BLE001 - the summary must print whatever else it has
        print(f"check_summary: the per-key results could not be computed: {err}", file=sys.stderr)
        return None


def _gate_table(keys: tuple[dict, dict]) -> list[str]:
    passed, failed = keys
    lines = ["tests per target, dtype (mode) and block size: passed / failed"]
    modes: dict[tuple, dict] = {}
    for target, by_mode in passed.items():
        for mode, sizes in by_mode.items():
            modes.setdefault((target, mode), {}).update({bs: "pass" for bs in sizes})
    for target, mode, bs in failed:
        modes.setdefault((target, mode), {})[bs] = "FAIL"
    for (target, mode), by_bs in sorted(modes.items()):
        cells = "  ".join(f"{bs}:{by_bs[bs]}" for bs in sorted(by_bs))
        lines.append(f"  {target:22} {mode:9} {cells}")
    lines += [f"  FAILED {t} {m} block {bs}: {why}" for (t, m, bs), why in sorted(failed.items())]
    return lines


def render(
    out: Path,
    steps: list[dict],
    heads: list[dict],
    meta: str,
    failed_tests: list[dict],
    left: dict[str, list[str]],
    keys: tuple[dict, dict] | None = None,
) -> str:
    lines = []
    if meta:
        keep = [m for m in meta.splitlines() if m.split(":")[0] in ("date", "commit", "gpu", "cuda_arch")]
        lines += keep + [""]
    head = f"{'step':12} {'status':8} {'rc':>4} {'seconds':>8} {'limit':>6}  counts"
    lines += [head, "-" * 100]
    for s in steps:
        counts = COUNTS.get(s["name"], lambda _: None)(out) or ""
        lines.append(
            f"{s['name']:12} {s['status']:8} {_f(s['rc'], 'd'):>4} {_f(s['seconds'], '8.1f')} "
            f"{_f(s['limit_s'], 'd'):>6}  {counts}"
        )
    total = sum(s["seconds"] or 0 for s in steps)
    lines.append(f"{'total':12} {'':8} {'':>4} {total:8.1f}")
    if failed_tests:
        lines += ["", f"failing tests ({len(failed_tests)}): first failure of each job, its first error line"]
        for f in failed_tests:
            lines.append(f"  [{f['step']}] {f['status']:7} {f['test'] or f['job']}: {f['error'] or '?'}")
            if f.get("memcheck_report"):  # what the fault was, and where
                lines.append(f"      memcheck: {' | '.join(f['memcheck_report'].splitlines()[:2])}")
            elif f.get("memcheck"):
                lines.append(f"      memcheck: {f['memcheck']}")
    for step, ids in left.items():
        lines.append(
            f"  [{step}] not run (budget spent): {len(ids)} job(s): {', '.join(ids[:6])}"
            + (" ..." if len(ids) > 6 else "")
        )
    if heads:
        lines += [""] + _headline_table(heads)
    if keys is not None:
        lines += [""] + _gate_table(keys)
    failed = [s["name"] for s in steps if s["status"] not in PASSING]
    lines += ["", f"FAILED steps: {', '.join(failed)}" if failed else ("all steps passed" if steps else "no step ran")]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    steps = read_steps(out)
    heads = headline(out)
    failed_tests = failures(out)
    left = not_run(out)
    meta = (out / "meta.txt").read_text(errors="replace") if (out / "meta.txt").exists() else ""
    keys = gate_keys(out)
    print(render(out, steps, heads, meta, failed_tests, left, keys))
    summary = dict(
        steps=[dict(s, counts=COUNTS.get(s["name"], lambda _: None)(out)) for s in steps],
        failures=failed_tests,
        not_run=left,
        headline=dict(dtype=HEADLINE_DTYPE, density=HEADLINE_DENSITY, rows=heads),
        keys=None
        if keys is None
        else dict(
            passed=keys[0], failed=[dict(target=t, mode=m, block_size=b, why=w) for (t, m, b), w in keys[1].items()]
        ),
        passed=bool(steps) and all(s["status"] in PASSING for s in steps),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
