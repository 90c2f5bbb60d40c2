"""Runs pytest selections each in its own process, several at a time, so that a crash
ends only its own process.

A CUDA kernel fault (misaligned address, illegal access) kills the CUDA context of its
process for good: every later test in that process fails the same way, and under
pytest-xdist one fault turns into hundreds of failures. Here each job (a test file, a
test function of it with ``--split function``, or a ``-k`` selection of it with
``--keyword``) runs in its own ``python3 -m pytest SELECTION -x -q --junitxml=...``
process, ``--parallel`` at a time (they share the GPU), each under its own time limit
and in its own process group (a job that is killed takes its children, such as the
training steps' child processes, with it). A job whose process dies (a signal, a
segfault, ``os._exit``, its time limit, a dead CUDA context) is that job's failure
alone; the other jobs still run.

With ``--resume N``, a job that failed or died goes on in a new process (its id with
`` (resumed 1)`` and so on, at most N times): the same selection with every test the
failed process already ran, and the one it died in, deselected. So a fault early in a
parametrized function (``-x`` stops a job at its first failure) does not leave the
function's other cases unrun.

Then the first failing test of each failing job runs once more, alone, under
``compute-sanitizer --tool memcheck`` (where compute-sanitizer is found), and its first
report is kept.

Usage::

    python3 tests/gpu/run_isolated.py --out OUT/gpu-tests --split function \\
        tests/gpu/test_bsmm_kernels.py tests/gpu/test_bsmm_sm90.py
    python3 tests/gpu/run_isolated.py --out OUT/training --keyword rnn_cells \\
        --keyword "mlp and not mlp_nnx" tests/gpu/test_training_steps.py
    python3 tests/gpu/run_isolated.py --out OUT/suite --order size tests/test_*.py -- -p no:cacheprovider

Everything goes under ``--out``: per job ``<job>.log`` (pytest's output), ``<job>.xml``
(JUnit) and ``<job>.memcheck.log``, and ``--json`` (default ``OUT/isolated.json``),
rewritten whenever a job ends, so a runner that is itself killed leaves every finished
job. Per job: ``id``, ``status``, ``rc``, ``signal``, ``seconds``, ``counts`` (from the
JUnit XML), ``first_failure`` (``test``: its node id, ``error``: its first error line),
``cuda_error`` (the first CUDA error line of the log), ``log``, ``junit`` and
``sanitizer`` (``status``, ``errors``, ``first_report``, ``log``). Status:

* ``pass``: pytest exited 0 and wrote its report;
* ``fail``: pytest reported a failing test (exit 1);
* ``error``: pytest could not run the selection (collection or usage error, exit 2-4);
* ``empty``: no test was selected (exit 5);
* ``died``: the process ended without pytest's report (a signal, a crash, ``os._exit``);
  ``first_failure.test`` is then the test that was running;
* ``timeout``: killed at its time limit (also the test that was running);
* ``not-run``: the budget was spent before it could start.

Exit status: 0 if every job passed, 1 otherwise, 2 for bad arguments.

This module is also the pytest plugin each job loads (``-p run_isolated``): its one
hook appends the node id of each test starting to the file named by ``$JBS_ISOLATED_CURRENT``,
which is how a job that dies names the test it died in (the last line) and how a resumed
job knows what already ran.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

CURRENT_ENV = "JBS_ISOLATED_CURRENT"
PLUGIN = Path(__file__).resolve().stem
STATUSES = ("pass", "fail", "error", "empty", "died", "timeout", "not-run")
MIN_START_S = 15.0  # a job (or sanitizer rerun) starts only with at least this much budget left
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL this much later
POLL_S = 0.1
_CUDA_ERROR = re.compile(r"CUDA_ERROR_\w+|CUDA error|cudaError\w+|illegal memory access|misaligned address")
# compute-sanitizer's line prefix (nine "=", not a longer pytest rule), possibly after pytest's dots.
_SANITIZER_PREFIX = re.compile(r"(?<!=)========= ")
_SANITIZER_BORING = (
    "COMPUTE-SANITIZER",
    "ERROR SUMMARY",
    "LEAK SUMMARY",
    "RACECHECK SUMMARY",
    "Target application returned",
)


# ---------------------------------------------------------------------------------
# The pytest plugin (loaded into each job with -p)
# ---------------------------------------------------------------------------------


def pytest_runtest_logstart(nodeid, location):
    """Appends the node id of the test starting now to the file the runner reads should the
    process die: its last line is the test that was running, the lines before it the
    tests that ran (``--resume`` skips them all)."""
    path = os.environ.get(CURRENT_ENV)
    if path:
        with open(path, "a") as f:
            f.write(nodeid + "\n")


def started_tests(path: Path) -> list[str]:
    """The node ids a job's process started, in order (its ``.current`` file)."""
    try:
        return [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []


# ---------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------


def test_functions(path: Path) -> list[str]:
    """The top-level test functions and ``Test*`` classes of a test file, in source order
    (read with ``ast``: nothing is imported)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            names.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.append(node.name)
    return names


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")[:150] or "job"


def make_jobs(targets: list[str], split: str, keywords: list[str], order: str) -> list[dict]:
    """One job per target (a file or a node id), per test function of a file target
    (``split="function"``), or per keyword of a file target (``keywords``)."""
    jobs = []
    for target in targets:
        file = target.split("::", 1)[0]
        is_file = "::" not in target
        if is_file and keywords:
            selections = [(f"{target} -k {k}", [target, "-k", k]) for k in keywords]
        elif is_file and split == "function":
            names = test_functions(Path(file))
            selections = [(f"{target}::{n}", [f"{target}::{n}"]) for n in names] or [(target, [target])]
        else:
            selections = [(target, [target])]
        for job_id, selection in selections:
            jobs.append(dict(id=job_id, file=file, selection=selection))
    if order == "size":  # the largest files first: a proxy for the longest jobs
        sizes = {j["file"]: (Path(j["file"]).stat().st_size if Path(j["file"]).exists() else 0) for j in jobs}
        jobs.sort(key=lambda j: -sizes[j["file"]])
    seen: dict[str, int] = {}
    for job in jobs:
        slug = _slug(job["id"])
        seen[slug] = seen.get(slug, 0) + 1
        job["slug"] = slug if seen[slug] == 1 else f"{slug}_{seen[slug]}"
    return jobs


# ---------------------------------------------------------------------------------
# Reading what a job left
# ---------------------------------------------------------------------------------


def _first_line(text: str | None) -> str | None:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:400]
    return None


def _node_id(case, file: str) -> str:
    """pytest's node id of a JUnit testcase (classname ``tests.gpu.test_x[.Class]``)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    module = file[:-3].replace("/", ".") if file.endswith(".py") else file
    if classname == module:
        return f"{file}::{name}"
    if classname.startswith(module + "."):
        return f"{file}::{classname[len(module) + 1 :].replace('.', '::')}::{name}"
    return f"{classname}::{name}" if classname else name


def read_junit(path: Path, file: str):
    """(counts, first failure) from a JUnit XML file; (None, None) if missing or unreadable.

    counts: tests, passed, failed, errors, skipped. First failure: the first testcase
    with a failure or error: its node id and its message's first line."""
    if not path.exists():
        return None, None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None, None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts = dict(
        tests=counts["tests"],
        passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        failed=counts["failures"],
        errors=counts["errors"],
        skipped=counts["skipped"],
    )
    for suite in suites:
        for case in suite.iter("testcase"):
            bad = case.find("failure")
            if bad is None:
                bad = case.find("error")
            if bad is None:
                continue
            error = _first_line(bad.get("message"))
            if error is None:
                lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
                error = _first_line("\n".join(lines)) or _first_line(bad.text)
            return counts, dict(test=_node_id(case, file), error=error)
    return counts, None


def junit_cases(path: Path, file: str) -> list[tuple[str, str]]:
    """(node id, outcome) of every testcase of a JUnit XML file, in order; outcome is
    "passed", "failed", "error" or "skipped"; [] where the file is missing or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    out = []
    for case in root.iter("testcase"):
        outcome = next((tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None), "passed")
        out.append((_node_id(case, file), {"failure": "failed"}.get(outcome, outcome)))
    return out


def cuda_error_line(log: Path) -> str | None:
    """The first line of a log that reports a CUDA error."""
    if not log.exists():
        return None
    with open(log, errors="replace") as f:
        for line in f:
            if _CUDA_ERROR.search(line):
                return line.strip()[:400]
    return None


_PROGRESS = re.compile(r"[.sSFExX]*\s*(\[\s*\d+%\])?")  # pytest -q's progress line: says nothing


def _last_line(log: Path) -> str | None:
    """The last line of a log that says something (not pytest's progress dots)."""
    if not log.exists():
        return None
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    lines = [ln for ln in lines if not _PROGRESS.fullmatch(ln)]
    return lines[-1][:400] if lines else None


def classify(rc: int | None, timed_out: bool, junit_written: bool) -> str:
    """A job's status from its exit (see the module docstring)."""
    if timed_out:
        return "timeout"
    if rc is None or rc < 0 or not junit_written:
        return "died"
    return {0: "pass", 1: "fail", 5: "empty"}.get(rc, "error")


def sanitizer_first_report(text: str) -> str | None:
    """The first report of a compute-sanitizer log: its header line (e.g. ``Invalid
    __global__ read``, ``Misaligned shared or local address``) and the lines of it that
    follow (where, which thread), host frames left out."""
    report: list[str] = []
    for raw in text.splitlines():
        found = _SANITIZER_PREFIX.search(raw)
        if found is None:
            if report:
                break
            continue
        line = raw[found.end() :]
        if not report:
            if line.strip() and not line.startswith(" ") and not any(b in line for b in _SANITIZER_BORING):
                report.append(line.strip())
            continue
        if not line.strip() or not line.startswith(" "):
            break
        if "Host Frame" not in line and "Saved host backtrace" not in line:
            report.append(line.strip()[:400])
        if len(report) >= 8:
            break
    return "\n".join(report) if report else None


def sanitizer_errors(text: str) -> int | None:
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    return int(found[-1]) if found else None


# ---------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------


class Runner:
    """Starts the jobs ``parallel`` at a time, kills those over their limit, records each."""

    def __init__(self, args, jobs: list[dict]):
        self.args = args
        self.jobs = jobs
        self.out = Path(args.out)
        self.json_path = Path(args.json) if args.json else self.out / "isolated.json"
        self.t0 = time.monotonic()
        self.running: list[tuple[dict, subprocess.Popen, float, float]] = []  # job, process, start, limit
        self.pending: list[dict] = list(jobs)
        self.sanitizing: list[tuple] = []  # job, process, start, limit, log, argv
        self.report = dict(
            runner="tests/gpu/run_isolated.py",
            started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            cwd=os.getcwd(),
            parallel=args.parallel,
            timeout_s=args.timeout,
            budget_s=args.budget,
            pytest_args=self.pytest_args(),
            complete=False,
            jobs=jobs,
        )
        for job in jobs:
            self._blank(job)

    @staticmethod
    def _blank(job) -> None:
        """A job's fields before it runs."""
        job.update(
            status="not-run",
            rc=None,
            signal=None,
            seconds=None,
            counts=None,
            first_failure=None,
            cuda_error=None,
            log=f"{job['slug']}.log",
            junit=f"{job['slug']}.xml",
            sanitizer=None,
        )

    def pytest_args(self) -> list[str]:
        return ["-x", "-q", "-p", PLUGIN, *self.args.pytest_args]

    def left(self) -> float:
        if not self.args.budget:
            return float("inf")
        return self.args.budget - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.t0, 1)
        self.report["totals"] = totals(self.jobs)
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(self.report, indent=2) + "\n")
        tmp.replace(self.json_path)

    def _env(self, job) -> dict:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env[CURRENT_ENV] = str(self.out / f"{job['slug']}.current")
        here = str(Path(__file__).resolve().parent)  # this module, as the plugin -p loads
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), here) if p)
        return env

    def start(self, job) -> None:
        limit = min(self.args.timeout, self.left())
        cmd = [
            self.args.python,
            "-m",
            "pytest",
            *job["selection"],
            *self.pytest_args(),
            f"--junitxml={self.out / job['junit']}",
        ]
        job["argv"] = cmd
        for name in (job["junit"], f"{job['slug']}.current"):
            (self.out / name).unlink(missing_ok=True)
        with open(self.out / job["log"], "w") as log:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(job),
                start_new_session=True,
            )
        self.running.append((job, proc, time.monotonic(), limit))

    def finish(self, job, proc, started, timed_out) -> None:
        rc = proc.returncode
        junit = self.out / job["junit"]
        log = self.out / job["log"]
        counts, first = read_junit(junit, job["file"])
        status = classify(rc, timed_out, junit.exists())
        job.update(
            status=status,
            rc=rc,
            seconds=round(time.monotonic() - started, 1),
            counts=counts,
            signal=signal.Signals(-rc).name if rc is not None and rc < 0 else None,
            cuda_error=cuda_error_line(log),
        )
        if status in ("died", "timeout"):
            started = started_tests(self.out / f"{job['slug']}.current")
            test = started[-1] if started else ""
            if status == "timeout":
                why = f"timed out after {job['seconds']} s"
            elif job["signal"]:
                why = f"process killed by {job['signal']}"
            else:
                why = f"process exited with status {rc} without pytest's report"
            detail = job["cuda_error"] or _last_line(log)
            first = dict(test=test or None, error=f"{why}: {detail}" if detail else why)
        elif status in ("error", "empty") and first is None:
            first = dict(test=None, error=_first_line(_tail_error(log)) or f"pytest exit status {rc}")
        job["first_failure"] = first
        counts_text = _counts_text(counts)
        print(
            f"[{sum(j['status'] != 'not-run' for j in self.jobs):>3}/{len(self.jobs)}] {status:7} "
            f"{job['seconds']:7.1f}s  {job['id']}" + (f"  ({counts_text})" if counts_text else ""),
            flush=True,
        )
        if first and status != "pass":
            print(f"      first failure: {first.get('test') or '?'}: {first.get('error')}", flush=True)
        if status in ("fail", "died"):
            self.resume(job, first)

    def resume(self, job, first) -> None:
        """Queues the rest of a failed job's selection in a new process (``--resume``): the
        tests its process ran, and the one it died in, deselected."""
        rounds = job.get("resumed", 0) + 1
        if rounds > self.args.resume:
            return
        ran = [node for node, _ in junit_cases(self.out / job["junit"], job["file"])]
        ran += [node for node in started_tests(self.out / f"{job['slug']}.current") if node not in ran]
        if first and first.get("test") and first["test"] not in ran:
            ran.append(first["test"])
        if not ran:  # nothing known to skip: a new process would fail the same way
            return
        deselect = [*job.get("deselect", []), *ran]
        base, base_slug = job.get("base_id", job["id"]), job.get("base_slug", job["slug"])
        rest = dict(
            id=f"{base} (resumed {rounds})",
            base_id=base,
            base_slug=base_slug,
            file=job["file"],
            selection=[*job["selection"][: job.get("n_selection", len(job["selection"]))]],
            n_selection=job.get("n_selection", len(job["selection"])),
            deselect=deselect,
            resumed=rounds,
            slug=f"{base_slug}.r{rounds}",
        )
        rest["selection"] += [arg for node in deselect for arg in ("--deselect", node)]
        self._blank(rest)
        self.jobs.append(rest)
        self.pending.append(rest)

    def reap(self) -> None:
        still = []
        for job, proc, started, limit in self.running:
            if proc.poll() is not None:
                self.finish(job, proc, started, timed_out=False)
                self.save()
            elif time.monotonic() - started > limit:
                kill_group(proc)
                self.finish(job, proc, started, timed_out=True)
                self.save()
            else:
                still.append((job, proc, started, limit))
        self.running = still

    def run_jobs(self) -> None:
        pending = self.pending  # resume() appends to it while jobs end
        while pending or self.running:
            while pending and len(self.running) < self.args.parallel and self.left() >= MIN_START_S:
                self.start(pending.pop(0))
            if pending and not self.running and self.left() < MIN_START_S:
                break  # the rest stay not-run
            time.sleep(POLL_S)
            self.reap()

    def stop_all(self) -> None:
        """Kills every running job (the runner itself was told to stop; they count as timed
        out) and every sanitizer rerun."""
        for job, proc, started, _ in self.running:
            kill_group(proc)
            self.finish(job, proc, started, timed_out=True)
        self.running = []
        for job, proc, *_ in self.sanitizing:
            kill_group(proc)
            job["sanitizer"] = dict(status="not-run", why="the runner was stopped")
        self.sanitizing = []

    # -- sanitizer reruns --------------------------------------------------------

    def sanitizer_reruns(self) -> None:
        tool = shutil.which(self.args.sanitizer) if self.args.sanitizer else None
        todo = [j for j in self.jobs if j["status"] in ("fail", "died") and (j["first_failure"] or {}).get("test")]
        if not todo:
            return
        if tool is None:
            for job in todo:
                job["sanitizer"] = dict(status="not-run", why=f"{self.args.sanitizer or 'compute-sanitizer'} not found")
            self.save()
            return
        print(f"== memcheck on the first failure of {len(todo)} job(s)", flush=True)
        while todo or self.sanitizing:
            while todo and len(self.sanitizing) < self.args.parallel and self.left() >= MIN_START_S:
                job = todo.pop(0)
                log = self.out / f"{job['slug']}.memcheck.log"
                cmd = [
                    tool,
                    "--tool",
                    "memcheck",
                    "--print-limit",
                    "20",
                    self.args.python,
                    "-m",
                    "pytest",
                    job["first_failure"]["test"],
                    "-x",
                    "-q",
                    *self.args.pytest_args,
                ]
                with open(log, "w") as f:
                    proc = subprocess.Popen(
                        cmd,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=dict(os.environ, PYTHONUNBUFFERED="1"),
                        start_new_session=True,
                    )
                limit = min(self.args.sanitizer_timeout, self.left())
                self.sanitizing.append((job, proc, time.monotonic(), limit, log, cmd))
            if todo and not self.sanitizing and self.left() < MIN_START_S:
                for job in todo:
                    job["sanitizer"] = dict(status="not-run", why="budget spent")
                break
            time.sleep(POLL_S)
            still = []
            for job, proc, started, limit, log, cmd in self.sanitizing:
                timed_out = proc.poll() is None and time.monotonic() - started > limit
                if timed_out:
                    kill_group(proc)
                if proc.returncode is None:
                    still.append((job, proc, started, limit, log, cmd))
                    continue
                text = log.read_text(errors="replace") if log.exists() else ""
                errors = sanitizer_errors(text)
                report = sanitizer_first_report(text)
                status = "timeout" if timed_out else ("errors" if report or errors else "clean")
                job["sanitizer"] = dict(
                    status=status,
                    rc=proc.returncode,
                    seconds=round(time.monotonic() - started, 1),
                    errors=errors,
                    first_report=report,
                    log=log.name,
                    argv=cmd,
                )
                print(
                    f"      memcheck {status}: {job['first_failure']['test']}"
                    + (f": {report.splitlines()[0]}" if report else ""),
                    flush=True,
                )
                self.save()
            self.sanitizing = still


def _tail_error(log: Path) -> str | None:
    """The first line of a log's last error block (``ERROR ...`` / ``E ...``), else its last line."""
    if not log.exists():
        return None
    lines = log.read_text(errors="replace").splitlines()
    for ln in lines:
        if ln.startswith(("ERROR ", "E ")):
            return ln.lstrip("E").strip()
    return _last_line(log)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the job's process group, SIGKILL after a grace period; reaps the process."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # a child that outlived the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _counts_text(counts) -> str:
    if not counts:
        return ""
    parts = [f"{counts['passed']} passed"]
    parts += [f"{counts[k]} {k}" for k in ("failed", "errors", "skipped") if counts.get(k)]
    return ", ".join(parts)


def totals(jobs: list[dict]) -> dict:
    """Jobs per status and the summed test counts."""
    out = {s: sum(j["status"] == s for j in jobs) for s in STATUSES}
    tests = {
        k: sum((j["counts"] or {}).get(k, 0) for j in jobs) for k in ("tests", "passed", "failed", "errors", "skipped")
    }
    return dict(jobs=len(jobs), **out, tests=tests)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("targets", nargs="+", help="test files or node ids (FILE::NAME)")
    p.add_argument("--out", required=True, help="directory for the logs, JUnit XML and (by default) the JSON")
    p.add_argument("--json", help="the JSON report (default OUT/isolated.json)")
    p.add_argument(
        "--split",
        choices=("file", "function"),
        default="file",
        help="one process per file (default) or per test function of each file",
    )
    p.add_argument(
        "--keyword",
        action="append",
        default=[],
        help="one process per -k EXPR of each file (repeatable; instead of --split)",
    )
    p.add_argument(
        "--order",
        choices=("given", "size"),
        default="given",
        help="start jobs in the order given, or the largest files first",
    )
    p.add_argument("--parallel", "-P", type=int, default=min(6, os.cpu_count() or 1), help="jobs at a time")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds for everything, sanitizer reruns included (0: no limit); no job starts "
        f"with under {MIN_START_S:.0f} s left, and none runs past it",
    )
    p.add_argument(
        "--sanitizer",
        default=os.environ.get("COMPUTE_SANITIZER", "compute-sanitizer"),
        help="compute-sanitizer to rerun first failures under ('' : none)",
    )
    p.add_argument("--sanitizer-timeout", type=float, default=120.0, help="seconds per sanitizer rerun")
    p.add_argument(
        "--resume",
        type=int,
        default=0,
        help="go on with a failed job's remaining tests in a new process, at most this many times per job (default 0)",
    )
    p.add_argument("--python", default=sys.executable or "python3", help="the interpreter of the jobs")
    args = p.parse_args(argv)
    args.pytest_args = extra
    if args.parallel < 1 or args.timeout <= 0 or args.budget < 0 or args.sanitizer_timeout <= 0 or args.resume < 0:
        p.error("--parallel, --timeout and --sanitizer-timeout must be positive, --budget and --resume >= 0")
    if args.keyword and args.split == "function":
        p.error("--keyword and --split function exclude each other")
    for target in args.targets:
        if not Path(target.split("::", 1)[0]).is_file():
            p.error(f"no such test file: {target}")
    return args


class _Stop(Exception):
    pass


def _stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def main(argv=None) -> int:
    args = parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runner = Runner(args, make_jobs(args.targets, args.split, args.keyword, args.order))
    print(
        f"run_isolated: {len(runner.jobs)} job(s), {args.parallel} at a time, {args.timeout:.0f} s each"
        + (f", budget {args.budget:.0f} s" if args.budget else ""),
        flush=True,
    )
    old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        runner.save()
        runner.run_jobs()
        runner.sanitizer_reruns()
        runner.report["complete"] = True
    except _Stop as stop:
        runner.report["stopped"] = f"runner received {stop}"
        runner.stop_all()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        runner.save()
    t = runner.report["totals"]
    print(
        f"run_isolated: {t['pass']}/{t['jobs']} jobs passed"
        + "".join(f", {t[s]} {s}" for s in STATUSES[1:] if t[s])
        + f"; tests: {_counts_text(t['tests']) or 'none'}; {runner.report['seconds']} s; {runner.json_path}",
        flush=True,
    )
    return 0 if t["pass"] == t["jobs"] else 1


if __name__ == "__main__":
    sys.exit(main())
