"""Summarizes Nsight Compute's CSV of the jbs kernels into JSON and a table.

Reads what ``ncu --csv`` wrote (``--log-file``, or its stdout saved to a file) in either
of its layouts:

- ``--page raw`` (one row per kernel launch): a header row (ID, Process ID, ...,
  Kernel Name, ..., one column per metric), then a units row, then the launches;
- ``--page details`` (ncu's default): one row per launch and metric, with the columns
  ID, Kernel Name, ..., Metric Name, Metric Unit, Metric Value;

and, for old measurements, the hand-made summary of the 2026-11-22 H100 run
(``kernel,duration_ns,...,warps_active_pct,tensor_pipe_pct,...,dram_pct``). Lines that
are not CSV rows (``==PROF==`` messages, the program's own output) are skipped; numbers
may carry thousands separators; durations in any time unit become microseconds.

Each launch is paired with a problem of bench/ncu_driver.py's ``--problems`` JSON: in
launch order when the counts match (the driver runs one jbs kernel per problem), else by
what the kernel's name says (family, dtype, block size). Without ``--problems`` the
name alone says what it can.

    python3 bench/ncu_summary.py out/ncu_raw.csv --problems out/ncu_problems.json \\
        --json out/ncu_summary.json
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

DURATION = "gpu__time_duration.sum"
OCCUPANCY = "sm__warps_active.avg.pct_of_peak_sustained_active"
TENSOR = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
REGISTERS = "launch__registers_per_thread"
METRICS = (DURATION, OCCUPANCY, TENSOR, DRAM, REGISTERS)

# The hand-made summary's columns (ncu_kernels.csv of the 2026-11-22 H100 run;
# tests/data/ncu_kernels_h100_excerpt.csv is its first lines).
SUMMARY_COLUMNS = {
    "duration_ns": (DURATION, "nsecond"),
    "warps_active_pct": (OCCUPANCY, "%"),
    "tensor_pipe_pct": (TENSOR, "%"),
    "dram_pct": (DRAM, "%"),
    "regs": (REGISTERS, "register"),
}
KERNEL_COLUMNS = ("Kernel Name", "Function Name", "Demangled Name", "kernel")

TIME_TO_US = {
    "ns": 1e-3,
    "nsecond": 1e-3,
    "us": 1.0,
    "usecond": 1.0,
    "\u00b5s": 1.0,
    "ms": 1e3,
    "msecond": 1e3,
    "s": 1e6,
    "second": 1e6,
}

DTYPES = {
    "__nv_bfloat16": "bfloat16",
    "nv_bfloat16": "bfloat16",
    "bfloat16": "bfloat16",
    "__half": "float16",
    "half": "float16",
    "float": "float32",
}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def number(text):
    """A float from ncu's text ("1,205.00", "n/a", ""), or None."""
    text = (text or "").strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


def _csv_rows(text: str) -> list[list[str]]:
    """The CSV rows of ncu's output: its quoted lines (or, in the hand-made summary, every
    line from its ``kernel,`` header on that is not a ``#`` comment)."""
    lines, summary = [], False
    for line in text.splitlines():
        summary = summary or line.startswith("kernel,duration_ns")
        if line.startswith('"') or (summary and line.strip() and not line.startswith(("#", "=="))):
            lines.append(line)
    return [row for row in csv.reader(lines) if row]


def read_launches(text: str) -> tuple[str, list[dict]]:
    """(layout name, launches): each launch {id, kernel, block, grid, metrics: {name: (value, unit)}}."""
    rows = _csv_rows(text)
    for i, row in enumerate(rows):
        if row and row[0] == "kernel" and "duration_ns" in row:
            return "summary", _summary_launches(row, rows[i + 1 :])
        kernel_col = next((c for c in KERNEL_COLUMNS if c in row), None)
        if kernel_col is None:
            continue
        if "Metric Name" in row and "Metric Value" in row:
            return "details", _details_launches(row, rows[i + 1 :], kernel_col)
        return "raw", _raw_launches(row, rows[i + 1 :], kernel_col)
    return "none", []


def _raw_launches(header, rows, kernel_col):
    idx = {name: j for j, name in enumerate(header)}
    k = idx[kernel_col]
    units = {}
    launches = []
    for row in rows:
        if row == header:  # a second process or report repeats the header
            continue
        if len(row) < len(header):  # (a trailing comma adds an empty field: harmless)
            continue
        if not row[k].strip() and not units:  # the units row: no kernel name
            units = {name: row[j] for name, j in idx.items()}
            continue
        metrics = {
            name: (row[j], units.get(name, "")) for name, j in idx.items() if "__" in name
        }  # metric names look like unit__counter.rollup
        launches.append(
            dict(
                id=row[idx["ID"]] if "ID" in idx else str(len(launches)),
                kernel=row[k],
                block=row[idx["Block Size"]] if "Block Size" in idx else "",
                grid=row[idx["Grid Size"]] if "Grid Size" in idx else "",
                metrics=metrics,
            )
        )
    return launches


def _details_launches(header, rows, kernel_col):
    idx = {name: j for j, name in enumerate(header)}
    need = max(idx[kernel_col], idx["Metric Name"], idx["Metric Unit"], idx["Metric Value"])
    by_id: dict[tuple, dict] = {}
    for row in rows:
        if row == header or len(row) <= need:
            continue
        try:
            key = (row[idx["ID"]] if "ID" in idx else "0", row[idx.get("Process ID", idx[kernel_col])])
            launch = by_id.setdefault(
                key,
                dict(
                    id=key[0],
                    kernel=row[idx[kernel_col]],
                    block=row[idx["Block Size"]] if "Block Size" in idx else "",
                    grid=row[idx["Grid Size"]] if "Grid Size" in idx else "",
                    metrics={},
                ),
            )
            launch["metrics"][row[idx["Metric Name"]]] = (row[idx["Metric Value"]], row[idx["Metric Unit"]])
        except (IndexError, KeyError):
            continue
    return list(by_id.values())


def _summary_launches(header, rows):
    idx = {name: j for j, name in enumerate(header)}
    launches = []
    for row in rows:
        if len(row) != len(header):
            continue
        metrics = {metric: (row[idx[col]], unit) for col, (metric, unit) in SUMMARY_COLUMNS.items() if col in idx}
        launches.append(
            dict(
                id=str(len(launches)),
                kernel=row[idx["kernel"]].replace(";", ","),
                block=row[idx["block"]] if "block" in idx else "",
                grid=row[idx["grid"]] if "grid" in idx else "",
                metrics=metrics,
            )
        )
    return launches


def parse_kernel_name(name: str) -> dict:
    """What a jbs kernel's demangled name says: short name, op family, dtype, block size.

    ``void jbs::DsdTcKernel<__nv_bfloat16, __nv_bfloat16, 128, 128, 2, 4, 32, 3, 0>(jbs::DsdParams)``
    -> DSD (fprop; last template argument 1: bprop), bfloat16, block 128. Unknown
    names give None fields.
    """
    out = dict(short=name, op=None, dtype=None, block_size=None)
    # The namespace is there in ncu's demangled names, not in its "function" names.
    m = re.search(r"(?:jbs::(?:sm90::(?:detail::)?)?)?([A-Za-z_]\w*)<(.*)>", name)
    if not m:
        m2 = re.search(r"jbs::(\w+)", name)
        if m2:
            out["short"] = m2.group(1)
        return out
    base, targs = m.group(1), [a.strip() for a in re.split(r"[,;]", m.group(2))]
    out["short"] = f"{base.removesuffix('Kernel')}<{','.join(SHORT_DTYPE.get(DTYPES.get(a, ''), a) for a in targs)}>"
    ints = [int(a) for a in targs if re.fullmatch(r"\d+", a)]
    typed = targs and targs[0] in DTYPES
    if typed:
        out["dtype"] = DTYPES[targs[0]]
        nums = [a for a in targs[1:] if a not in DTYPES]
        out["block_size"] = int(nums[0]) if nums and nums[0].isdigit() else None
    elif ints:
        out["dtype"] = "float32" if "F32" in base or "Simt" in base else None
        out["block_size"] = ints[0]
    last = targs[-1] if targs else ""
    transposed = bool(re.fullmatch(r"(\(bool\))?(1|true)", last))
    if base.startswith("Dsd"):
        out["op"] = "bprop" if transposed else "fprop"
    elif base.startswith("Sdd"):
        out["op"] = "updat"
    return out


def _value(metrics, name):
    value, unit = metrics.get(name, (None, ""))
    v = number(value)
    if v is None:
        return None
    if name == DURATION:
        return v * TIME_TO_US.get(unit.strip(), 1e-3)  # no unit: ncu's base unit, nanoseconds
    return v


def summarize(launches: list[dict], problems: list[dict] | None = None) -> dict:
    """Rows (one per jbs launch) paired with the driver's problems; warnings where they disagree."""
    warnings = []
    # ncu's --kernel-name regex:jbs kept only our launches; its CSV may name them without
    # the namespace (newer ncu prints the function name), so all launches count then.
    ours = [launch for launch in launches if "jbs" in launch["kernel"]]
    jbs_launches = ours or launches
    parsed = [parse_kernel_name(launch["kernel"]) for launch in jbs_launches]
    pairs: list[dict | None]
    # A problem may launch a helper after its product (updat's split-N reduction,
    # SddReduce): it belongs to the problem before it.
    helper = [bool(re.match(r"\w*Reduce", info["short"])) for info in parsed]
    if problems and len(problems) == len(jbs_launches):
        matched_by, pairs = "order", list(problems)
    elif problems and len(problems) == helper.count(False) and not (helper and helper[0]):
        matched_by, pairs, at = "order (helpers with their product)", [], -1
        for is_helper in helper:
            at += 0 if is_helper else 1
            pairs.append(problems[at])
    else:
        matched_by, pairs = "name", []
        if problems:
            warnings.append(f"{len(jbs_launches)} jbs launches for {len(problems)} problems: paired by kernel name")
        free = list(problems or [])
        for info in parsed:
            hit = next(
                (
                    p
                    for p in free
                    if (p["op"], p["dtype"], p["block_size"]) == (info["op"], info["dtype"], info["block_size"])
                ),
                None,
            )
            if hit is not None:
                free.remove(hit)
            pairs.append(hit)
    rows = []
    for launch, info, problem in zip(jbs_launches, parsed, pairs):
        m = launch["metrics"]
        row = dict(
            kernel=info["short"],
            kernel_full=launch["kernel"],
            op=(problem or {}).get("op", info["op"]),
            dtype=(problem or {}).get("dtype", info["dtype"]),
            block_size=(problem or {}).get("block_size", info["block_size"]),
            density=(problem or {}).get("density"),
            nnz=(problem or {}).get("nnz"),
            duration_us=_value(m, DURATION),
            occupancy_pct=_value(m, OCCUPANCY),
            tensor_pipe_pct=_value(m, TENSOR),
            dram_pct=_value(m, DRAM),
            registers=_value(m, REGISTERS),
            grid=launch["grid"],
            block=launch["block"],
        )
        if problem is not None:
            said = {f: info[f] for f in ("op", "dtype", "block_size") if info[f] is not None}
            wrong = {f: v for f, v in said.items() if v != problem[f]}
            if wrong:
                row["name_disagrees"] = wrong
                warnings.append(
                    f"launch {launch['id']} ({info['short']}) paired with problem {problem['index']} "
                    f"({problem['op']} {problem['dtype']} bs={problem['block_size']}), name says {wrong}"
                )
        rows.append(row)
    missing = [
        name for name in METRICS if rows and all(_value(launch["metrics"], name) is None for launch in jbs_launches)
    ]
    if missing:
        warnings.append(f"metrics without values: {', '.join(missing)}")
    return dict(
        launches=len(launches),
        jbs_launches=len(jbs_launches),
        problems=len(problems or []),
        matched_by=matched_by,
        rows=rows,
        warnings=warnings,
    )


def table(rows: list[dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    head = (
        f"{'kernel':44} {'op':6} {'dtype':9} {'bs':>4} {'duration us':>11} {'occupancy %':>11} "
        f"{'tensor %':>8} {'DRAM %':>7} {'regs':>5}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kernel'][:44]:44} {r['op'] or '-':6} {r['dtype'] or '-':9} {f(r['block_size'], 'd'):>4} "
            f"{f(r['duration_us'], '.1f'):>11} {f(r['occupancy_pct'], '.1f'):>11} "
            f"{f(r['tensor_pipe_pct'], '.1f'):>8} {f(r['dram_pct'], '.1f'):>7} {f(r['registers'], '.0f'):>5}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "csv",
        type=Path,
        nargs="+",
        help="ncu's CSV output; with several files, the first that holds launches is read "
        "(e.g. the --log-file, then the console log)",
    )
    p.add_argument("--problems", type=Path, help="bench/ncu_driver.py --problems JSON (skipped if missing)")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--min-rows", type=int, default=1, help="exit 1 with fewer jbs rows than this (default 1)")
    args = p.parse_args(argv)
    source, layout, launches = None, "none", []
    for path in args.csv:
        if path.exists():
            layout, launches = read_launches(path.read_text(errors="replace"))
            if launches:
                source = path
                break
    problems = None
    if args.problems and args.problems.exists():
        problems = json.loads(args.problems.read_text())["problems"]
    summary = summarize(launches, problems)
    summary.update(source=str(source) if source else None, csv_layout=layout)
    print(table(summary["rows"]))
    for w in summary["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    if len(summary["rows"]) < args.min_rows:
        print(
            f"ncu_summary: {len(summary['rows'])} jbs kernel rows in {', '.join(map(str, args.csv))}, "
            f"expected at least {args.min_rows}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
