"""The benchmark of a GPU session: the most valuable rows first, one process per block size,
within a time budget, resumable.

A lent GPU machine gives a session minutes, not hours, so this runs ``bench/bsmm.py`` as a
plan of items in priority order (:data:`PLAN`), each in its own process:

1. the headline, bfloat16 at the MLP's shape (W 8192 x 8192, N = 8192), blocks 128, 64,
   32 and 16, one process each (``--preset session``: densities 0.1, 0.05, 0.25, 1, 0.01,
   0.5; fprop, bprop and updat; the Hopper kernels, each of their variants where it runs
   (bench/bsmm.py's kernel paths "hopper", "hopper:stacked", "hopper:capped"), the Ampere
   kernels and XLA's dot in the same process, so that bench/crossover.py can say which
   variant won over which densities; torch's BSR at density 0.1 after the kernel rows);
2. then, at 4096^3, as time allows: bfloat16 at block 8, float16 at every block size,
   float32 (TF32 on the Hopper targets) at blocks 128-16, then float32 at block 8.

A kernel fault kills its process's CUDA context: here it loses that item's remaining rows
only until the item runs once more (resumed, without the path that faulted or hung:
bench/bsmm.py skips it at that dtype and block size, and bench/gpu_results.py turns its
key off), so one bad kernel loses its own rows alone. Each
headline item may run until its fair share of what is left of the budget (the rest over
the headline items not yet run); the later items take what is left. An item's process
stops starting products at its deadline (``--deadline``) and is killed 20 s after it.
Every item writes its own JSON (``bench-<item>.json``) row by row, and ``bench.json``
merges them after every item: the rows, each with its ``item``, each item's ``config`` (in
``configs``: bench/crossover.py reads the densities a sweep asked for there) and
``session`` (per item: status, exit code, seconds, rows, whether complete, why it
stopped). Run again on
the same OUTDIR, a session skips the items that completed and resumes the others
(``--resume``: the products already measured are not measured again).

Usage::

    python3 bench/session.py --out OUTDIR --budget 150     # on the GPU (tests/gpu/check.sh's bench step)
    python3 bench/session.py --out OUTDIR --budget 150 --dry-run   # the plan and each item's share

Exit status: 0 when every item that ran finished without an error row (items the budget
did not reach are not failures: ``bench.json`` says which), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

BENCH = Path(__file__).resolve().with_name("bsmm.py")
sys.path.insert(0, str(BENCH.parent))
from _bsmm_report import faults_of  # noqa: E402
from _report import write_json  # noqa: E402

KILL_AFTER_S = 20.0  # an item's process is killed this long after its deadline
MIN_START_S = 10.0  # an item starts only with at least this much budget left
RETRIES = 1  # an item that faulted or hung runs once more, resumed, without what failed
SMALL = ["--size", "4096", "4096", "4096"]


@dataclasses.dataclass(frozen=True)
class Item:
    """One process of the plan: ``bench/bsmm.py --preset session`` with ``argv``.

    ``headline``: the item shares the budget fairly with the other headline items (see
    :func:`deadline_for`); the others take what is left."""

    name: str
    argv: tuple[str, ...]
    headline: bool = False


PLAN: tuple[Item, ...] = (
    Item("bf16-b128", ("--block-sizes", "128"), headline=True),
    Item("bf16-b64", ("--block-sizes", "64"), headline=True),
    Item("bf16-b32", ("--block-sizes", "32"), headline=True),
    Item("bf16-b16", ("--block-sizes", "16"), headline=True),
    Item("bf16-b8", (*SMALL, "--block-sizes", "8")),
    Item("f16", (*SMALL, "--dtypes", "float16", "--block-sizes", "128", "64", "32", "16", "8")),
    Item("f32", (*SMALL, "--dtypes", "float32", "--block-sizes", "128", "64", "32", "16")),
    Item("f32-b8", (*SMALL, "--dtypes", "float32", "--block-sizes", "8")),
)


def item_json(out: Path, item: Item) -> Path:
    return out / f"bench-{item.name}.json"


def deadline_for(plan: Sequence[Item], index: int, left: float) -> float:
    """Seconds item ``index`` may run with ``left`` seconds of the budget left: a headline
    item its fair share (``left`` over the headline items from it on), others ``left``;
    all of ``left`` where the share is too short to start (the plan's order is its
    priority). Less the kill margin, so a killed process still ends within the budget."""
    item = plan[index]
    usable = max(0.0, left - KILL_AFTER_S)
    if not item.headline:
        return usable
    share = usable / max(1, sum(1 for it in plan[index:] if it.headline))
    return share if share >= MIN_START_S else usable


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_item(item: Item, json_path: Path, deadline: float, env: dict) -> int:
    """Runs one item's process (its own process group, killed with its children at
    ``deadline + KILL_AFTER_S``); returns its exit status (negative: the signal)."""
    cmd = [
        sys.executable,
        str(BENCH),
        "--preset",
        "session",
        *item.argv,
        "--deadline",
        f"{deadline:.0f}",
        "--json",
        str(json_path),
        "--resume",
    ]
    print(f"== [{item.name}] deadline {deadline:.0f} s: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=deadline + KILL_AFTER_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -signal.SIGKILL


def merge(out: Path, plan: Sequence[Item], session: list[dict], merged_path: Path | None = None) -> dict:
    """``bench.json`` (or ``merged_path``): the first item's header, every item's rows (each with its ``item``),
    and ``session``; ``complete`` when every item completed."""
    merged: dict = {}
    rows: list[dict] = []
    configs: dict[str, dict] = {}
    for item in plan:
        report = _read(item_json(out, item))
        if report is None:
            continue
        if not merged:
            merged = {k: v for k, v in report.items() if k not in ("results", "complete", "stopped", "config")}
        configs[item.name] = report.get("config") or {}
        rows.extend(dict(row, item=item.name) for row in report.get("results", []))
    merged.update(
        results=rows,
        configs=configs,
        session=session,
        plan=[dict(name=it.name, argv=list(it.argv), headline=it.headline) for it in plan],
        complete=bool(session) and all(s["complete"] for s in session) and len(session) == len(plan),
        stopped=next((f"{s['name']}: {s['stopped']}" for s in session if s.get("stopped")), None),
    )
    write_json(merged_path or out / "bench.json", merged)
    return merged


def run_session(
    out: Path,
    budget: float,
    *,
    plan: Sequence[Item] = PLAN,
    runner: Callable[[Item, Path, float, dict], int] = run_item,
    clock: Callable[[], float] = time.perf_counter,
    merged_path: Path | None = None,
) -> dict:
    """Runs the plan within ``budget`` seconds; returns the merged report (also in
    ``merged_path``, default ``out/bench.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    start = clock()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    session: list[dict] = []
    for index, item in enumerate(plan):
        path = item_json(out, item)
        before = _read(path)
        entry = dict(name=item.name, status="not-run", rc=None, seconds=0.0, rows=0, complete=False, stopped=None)
        if before is not None and before.get("complete"):
            entry.update(status="done-before", rows=len(before.get("results", [])), complete=True)
            session.append(entry)
            continue
        for attempt in range(1 + RETRIES):
            left = budget - (clock() - start)
            deadline = deadline_for(plan, index, left)
            if deadline < MIN_START_S:
                entry["stopped"] = entry["stopped"] or f"budget spent ({left:.0f} s left)"
                break
            t0 = clock()
            rc = runner(item, path, deadline, env)
            after = _read(path) or {}
            rows = after.get("results", [])
            entry.update(
                rc=rc,
                seconds=round(entry["seconds"] + clock() - t0, 1),
                rows=len(rows),
                complete=bool(after.get("complete")),
                stopped=after.get("stopped"),
                retries=attempt,
            )
            if rc == -signal.SIGKILL and rows:  # killed past its deadline: it kept what it measured
                entry["status"] = "partial"
                entry["stopped"] = entry["stopped"] or f"killed {KILL_AFTER_S:.0f} s after its deadline"
            elif rc < 0 or (rc != 0 and not rows):
                entry["status"] = "died"
                entry["stopped"] = entry["stopped"] or f"process ended with {'signal ' + str(-rc) if rc < 0 else rc}"
            elif any(r.get("error") for r in rows):
                entry["status"] = "error"
            else:
                entry["status"] = "pass" if entry["complete"] else "partial"
            failed = faults_of(after) if rows else []
            if entry["complete"] or not failed:
                break
            # A kernel fault or a hang: once more, resumed, without the paths that failed
            # (bench/bsmm.py skips them), so one bad kernel costs its own rows only.
            names = sorted({f"{f['path']} bs={f['block_size']}" for f in failed})
            print(f"== [{item.name}] {entry['status']} ({', '.join(names)} failed): resuming without them", flush=True)
        session.append(entry)
        merge(out, plan, session, merged_path)
        print(f"== [{item.name}] {entry['status']}: {entry['rows']} rows in {entry['seconds']} s", flush=True)
    return merge(out, plan, session, merged_path)


def describe(plan: Sequence[Item], budget: float) -> str:
    """The plan as a dry run prints it: each item, its arguments and its share of the
    whole budget were every item before it to use its share in full."""
    lines = [f"# bench/session.py: {len(plan)} items in order, budget {budget:.0f} s"]
    left = budget
    for index, item in enumerate(plan):
        deadline = deadline_for(plan, index, left)
        kind = "headline" if item.headline else "as time allows"
        lines.append(
            f"{item.name:10} {kind:14} deadline <= {deadline:4.0f} s  bsmm.py --preset session {' '.join(item.argv)}"
        )
        left -= deadline
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="where the items' JSON and bench.json go")
    p.add_argument("--json", type=Path, default=None, help="the merged report (default: OUT/bench.json)")
    p.add_argument("--budget", type=float, required=True, help="seconds for the whole session")
    p.add_argument("--only", nargs="+", choices=[it.name for it in PLAN], help="these items only, in plan order")
    p.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget must be positive, got {args.budget}")
    plan = tuple(it for it in PLAN if not args.only or it.name in args.only)
    if args.dry_run:
        print(describe(plan, args.budget))
        return 0
    report = run_session(args.out, args.budget, plan=plan, merged_path=args.json)
    return 0 if all(s["status"] in ("pass", "partial", "done-before", "not-run") for s in report["session"]) else 1


if __name__ == "__main__":
    sys.exit(main())
