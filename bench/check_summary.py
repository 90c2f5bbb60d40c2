"""The summary table of tests/gpu/check.sh: each step's status, counts and seconds, and
the headline bench numbers (bf16 efficiency per op and block size at density 0.1).

    python3 bench/check_summary.py OUTDIR      # reads OUTDIR/steps.tsv and the steps' outputs

Reads what check.sh leaves in OUTDIR: ``steps.tsv`` (name, status, exit code, seconds,
time limit, log), ``meta.txt``, the JUnit XML of the pytest steps, the sanitizer logs,
``bench.json`` and ``ncu_summary.json``. Writes ``summary.json`` beside them. Exit
status 1 if any step did not pass (or none ran), else 0.
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HEADLINE_DTYPE = "bfloat16"
HEADLINE_DENSITY = 0.1


def read_steps(out: Path) -> list[dict]:
    steps = []
    path = out / "steps.tsv"
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) < 6 or parts[0] == "name":
            continue
        name, status, rc, secs, limit, log = parts[:6]
        steps.append(dict(name=name, status=status, rc=int(rc) if rc.lstrip("-").isdigit() else None,
                          seconds=float(secs) if secs else None, limit_s=int(limit) if limit.isdigit() else None,
                          log=log))
    return steps


def junit_counts(path: Path) -> str | None:
    """"N passed, N failed, N errors, N skipped" from a pytest JUnit XML file."""
    if not path.exists():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return "junit xml unreadable"
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return (f"{passed} passed, {total['failures']} failed, {total['errors']} errors, "
            f"{total['skipped']} skipped")


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
        parts.append(f"{tool}: {passed[-1] if passed else 0} passed"
                     + (f", {failed[-1]} failed" if failed else "")
                     + f", {errors[-1] if errors else '?'} errors")
    return "; ".join(parts) or None


def _read_json(out: Path, name: str):
    """(report, None), or (None, why) when OUTDIR/name is missing (why None) or unreadable."""
    path = out / name
    if not path.exists():
        return None, None
    try:
        return json.loads(path.read_text()), None
    except json.JSONDecodeError:
        return None, f"{name} unreadable"


def bench_counts(out: Path) -> str | None:
    report, why = _read_json(out, "bench.json")
    if report is None:
        return why
    rows = report.get("results", [])
    torch = sum(1 for r in rows if r.get("torch_bsr_s"))
    text = f"{len(rows)} rows ({torch} with torch BSR)"
    if not report.get("complete", True):
        text += f"; incomplete: {report.get('stopped') or 'cut short'}"
    return text


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
    "gpu-tests": lambda out: junit_counts(out / "pytest_gpu.xml"),
    "suite": lambda out: junit_counts(out / "pytest_suite.xml"),
    "sanitizer": sanitizer_counts,
    "bench": bench_counts,
    "ncu": ncu_profiled,
    "ncu-summary": ncu_counts,
}


def headline(out: Path) -> list[dict]:
    """bf16 rows at density ~0.1 of bench.json, one per block size."""
    path = out / "bench.json"
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text()).get("results", [])
    except json.JSONDecodeError:
        return []
    by_bs: dict[int, dict] = {}
    for r in rows:
        if r.get("dtype") != HEADLINE_DTYPE or abs(r.get("density", 0) - HEADLINE_DENSITY) > 0.02:
            continue
        by_bs.setdefault(r["block_size"], {})[r["op"]] = r
    return [dict(block_size=bs, **ops) for bs, ops in sorted(by_bs.items())]


def _f(v, spec="5.2f"):
    return "-" if v is None else format(v, spec)


def render(out: Path, steps: list[dict], heads: list[dict], meta: str) -> str:
    lines = []
    if meta:
        keep = [m for m in meta.splitlines() if m.split(":")[0] in ("date", "commit", "gpu", "cuda_arch")]
        lines += keep + [""]
    head = f"{'step':12} {'status':8} {'rc':>4} {'seconds':>8} {'limit':>6}  counts"
    lines += [head, "-" * 100]
    for s in steps:
        counts = COUNTS.get(s["name"], lambda _: None)(out) or ""
        lines.append(f"{s['name']:12} {s['status']:8} {_f(s['rc'], 'd'):>4} {_f(s['seconds'], '8.1f')} "
                     f"{_f(s['limit_s'], 'd'):>6}  {counts}")
    total = sum(s["seconds"] or 0 for s in steps)
    lines.append(f"{'total':12} {'':8} {'':>4} {total:8.1f}")
    if heads:
        lines += ["", f"bench, {HEADLINE_DTYPE}, density {HEADLINE_DENSITY}: efficiency = dense time x density / "
                      "sparse time (device time); call = the same from single calls; bound = roofline speedup",
                  f"{'bs':>4} {'fprop':>6} {'bprop':>6} {'updat':>6} {'fprop call':>10} {'fprop speedup':>13} "
                  f"{'bound':>6} {'fprop ms':>8} {'torch ms':>8} {'vs torch':>8}"]
        for h in heads:
            fp = h.get("fprop", {})
            lines.append(
                f"{h['block_size']:>4} {_f(h.get('fprop', {}).get('efficiency'), '6.2f')} "
                f"{_f(h.get('bprop', {}).get('efficiency'), '6.2f')} "
                f"{_f(h.get('updat', {}).get('efficiency'), '6.2f')} "
                f"{_f(fp.get('call_efficiency'), '10.2f')} {_f(fp.get('speedup'), '13.2f')} "
                f"{_f(fp.get('roofline_speedup_bound'), '6.1f')} "
                f"{_f(fp['sparse_s'] * 1e3 if fp.get('sparse_s') else None, '8.3f')} "
                f"{_f(fp['torch_bsr_s'] * 1e3 if fp.get('torch_bsr_s') else None, '8.3f')} "
                f"{_f(fp.get('speedup_vs_torch_bsr'), '7.2f')}x")
    failed = [s["name"] for s in steps if s["status"] != "pass"]
    lines += ["", f"FAILED steps: {', '.join(failed)}" if failed else
              ("all steps passed" if steps else "no step ran")]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    steps = read_steps(out)
    heads = headline(out)
    meta = (out / "meta.txt").read_text(errors="replace") if (out / "meta.txt").exists() else ""
    print(render(out, steps, heads, meta))
    summary = dict(steps=[dict(s, counts=COUNTS.get(s["name"], lambda _: None)(out)) for s in steps],
                   headline=dict(dtype=HEADLINE_DTYPE, density=HEADLINE_DENSITY,
                                 rows=[{"block_size": h["block_size"],
                                        **{op: {k: h[op].get(k) for k in ("efficiency", "call_efficiency", "speedup",
                                                                          "roofline_speedup_bound", "sparse_s",
                                                                          "torch_bsr_s", "speedup_vs_torch_bsr")}
                                           for op in ("fprop", "bprop", "updat") if op in h}} for h in heads]),
                   passed=bool(steps) and all(s["status"] == "pass" for s in steps))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
