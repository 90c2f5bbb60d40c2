"""The GPU session kit, checked where there is no GPU (CI).

- tests/gpu/preflight.py: the build arch from the compute capability and the CUTLASS
  headers; without them it says so and picks the portable kernels' arch; tools that do not
  run the probe are "unavailable" (stand-in nvidia-smi, nvcc, compute-sanitizer and ncu).
- tests/gpu/check.sh with preflight: the steps of unavailable tools are "unavailable",
  which does not fail the check.
- bench/session.py: the plan's order (the headline first, one block size per process),
  each item's share of the budget, a run with a stand-in runner (a process that dies loses
  its item alone; the budget leaves the rest unrun), the merged report, and a rerun that
  skips what completed.
- bench/bsmm.py: ``--resume`` measures only the products missing from its JSON; the
  session options (no call time, no dense path, peers only at some densities, after the
  kernel rows); the roofline from the run's own ceilings.
- tests/gpu/run_isolated.py ``--resume``: a failed or dead job goes on with its remaining
  tests in a new process.
- tests/gpu/device_call.sh: packs the check's folder into $OUT even when the check is cut
  short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "check.sh"
PREFLIGHT = ROOT / "tests" / "gpu" / "preflight.py"
RUNNER = ROOT / "tests" / "gpu" / "run_isolated.py"
DEVICE_CALL = ROOT / "tests" / "gpu" / "device_call.sh"


def _fake_tools(tmp_path, *, sanitizer: str, ncu: str) -> Path:
    """A bin folder of stand-ins: nvidia-smi (an H100), nvcc (writes a probe that prints
    what a clean CUDA program prints), compute-sanitizer and ncu running the scripts given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {
        "nvidia-smi": "#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 580.159.04, 9.0, 81559 MiB'\n",
        "nvcc": '#!/bin/sh\nwhile [ "$1" != -o ]; do shift; done\n'
        'printf \'#!/bin/sh\\necho "probe: no error"\\n\' > "$2"\nchmod +x "$2"\n',
        "compute-sanitizer": sanitizer,
        "ncu": ncu,
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


WORKING_SANITIZER = '#!/bin/sh\nfor a; do last="$a"; done\n"$last"\necho "========= ERROR SUMMARY: 0 errors"\n'
BROKEN_SANITIZER = '#!/bin/sh\necho "========= Error: Device not supported"\nexit 1\n'
BROKEN_NCU = '#!/bin/sh\necho "==ERROR== Failed to initialize the profiler: LibraryNotLoaded"\nexit 1\n'


def _env(tmp_path, bin_dir) -> dict:
    """The stand-ins first on the PATH, no wheel carried and no CUTLASS to import."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHECK_", "PREFLIGHT_"))}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        JBS_WHEEL_DIR=str(tmp_path / "no-wheels"),
        JBS_CUTLASS_MODULE="no_such_cutlass_module",
    )
    return env


def _preflight(tmp_path, bin_dir, *args):
    """(the completed preflight, its preflight.json) on the stand-ins."""
    out = tmp_path / "out"
    res = subprocess.run(
        ["python3", str(PREFLIGHT), "--out", str(out), *args],
        capture_output=True,
        text=True,
        env=_env(tmp_path, bin_dir),
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res, json.loads((out / "preflight.json").read_text())


# ---------------------------------------------------------------------------------
# preflight.py
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cap, cutlass, arch",
    [
        ("9.0", True, "sm_90a"),
        ("9.0", False, "sm_90"),
        ("8.0", True, "sm_80"),
        ("8.6", False, "sm_86"),
        (None, True, None),
    ],
)
def test_preflight_arch(cap, cutlass, arch):
    assert load_script("tests/gpu/preflight.py").arch_of(cap, cutlass) == arch


def test_preflight_without_cutlass_says_so_and_tells_unavailable_tools(tmp_path):
    bin_dir = _fake_tools(tmp_path, sanitizer=BROKEN_SANITIZER, ncu=BROKEN_NCU)
    res, facts = _preflight(tmp_path, bin_dir)
    out = tmp_path / "out"
    assert facts["gpu"]["compute_cap"] == "9.0" and facts["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
    # No CUTLASS (none to import, no wheel carried): the portable kernels, for sm_90.
    assert not facts["cutlass"]["available"] and "carry" in facts["cutlass"]["why"]
    assert facts["arch"] == "sm_90"
    assert "cutlass: MISSING" in res.stdout and "portable (Ampere-design) kernels alone, for sm_90" in res.stdout
    assert facts["tools"]["sanitizer"]["status"] == "unavailable"
    assert "Device not supported" in facts["tools"]["sanitizer"]["why"]
    assert facts["tools"]["ncu"]["status"] == "unavailable" and "LibraryNotLoaded" in facts["tools"]["ncu"]["why"]
    env = (out / "preflight.env").read_text()
    assert "PREFLIGHT_ARCH=sm_90\n" in env and "PREFLIGHT_CUTLASS=0\n" in env
    assert "PREFLIGHT_SANITIZER=unavailable\n" in env and "PREFLIGHT_NCU=unavailable\n" in env


def test_preflight_finds_working_tools(tmp_path):
    bin_dir = _fake_tools(tmp_path, sanitizer=WORKING_SANITIZER, ncu="#!/bin/sh\necho '\"gpu__time_duration.sum\"'\n")
    _, facts = _preflight(tmp_path, bin_dir, "--arch", "sm_90a")
    assert facts["arch"] == "sm_90a"  # --arch wins
    assert {k: v["status"] for k, v in facts["tools"].items()} == {"sanitizer": "available", "ncu": "available"}


def test_check_records_unavailable_tools_as_no_failure(tmp_path):
    bin_dir = _fake_tools(tmp_path, sanitizer=BROKEN_SANITIZER, ncu=BROKEN_NCU)
    out = tmp_path / "out"
    env = _env(tmp_path, bin_dir)
    env["CHECK_STEPS"] = "preflight sanitizer ncu ncu-summary"
    res = subprocess.run(["bash", str(CHECK), str(out)], capture_output=True, text=True, env=env, timeout=180, cwd=ROOT)
    steps = [line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines()]
    assert steps == [
        ["preflight", "pass"],
        ["sanitizer", "unavailable"],
        ["ncu", "unavailable"],
        ["ncu-summary", "unavailable"],
    ], res.stdout
    assert res.returncode == 0, res.stdout + res.stderr
    assert "cutlass: MISSING" in res.stdout  # said at once, on the console
    assert json.loads((out / "summary.json").read_text())["passed"] is True


# ---------------------------------------------------------------------------------
# bench/session.py
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def session():
    return load_script("bench/session.py")


def test_session_plan_measures_the_headline_first(session):
    names = [item.name for item in session.PLAN]
    assert names[:4] == ["bf16-b128", "bf16-b64", "bf16-b32", "bf16-b16"]
    assert all(item.headline for item in session.PLAN[:4]) and not any(i.headline for i in session.PLAN[4:])
    assert all(item.argv == ("--block-sizes", name.split("-b")[1]) for item, name in zip(session.PLAN, names[:4]))
    # One block size per headline process; the later items at 4096^3.
    assert all("--size" in item.argv for item in session.PLAN[4:])
    bsmm = load_script("bench/bsmm.py")
    preset = bsmm.PRESETS["session"]
    assert preset["size"] == (8192, 8192, 8192) and preset["dtypes"] == ["bfloat16"]
    assert preset["densities"] == [0.1, 0.05, 0.25, 1.0, 0.01, 0.5]
    assert preset["peer_densities"] == [0.1] and not preset["call_time"] and not preset["dense_path"]


def test_session_shares_the_budget(session):
    plan = session.PLAN
    kill = session.KILL_AFTER_S
    # Each headline item: its fair share of what is left; the others: all that is left.
    assert session.deadline_for(plan, 0, 160 + kill) == pytest.approx(40)
    assert session.deadline_for(plan, 3, 40 + kill) == pytest.approx(40)
    assert session.deadline_for(plan, 4, 30 + kill) == pytest.approx(30)
    assert session.deadline_for(plan, 0, 5) == 0
    text = session.describe(plan, 165)
    assert text.splitlines()[1].startswith("bf16-b128") and "deadline <=   36 s" in text


class _Clock:
    """Time that passes only while an item runs: ``step`` seconds per item."""

    def __init__(self, step):
        self.now, self.step = 0.0, step

    def __call__(self):
        return self.now


def _fake_runner(behaviour, calls, clock=None):
    """A stand-in for one bsmm.py process: writes the JSON an item would (rows per
    behaviour: "ok", "partial", "error") or dies; moves ``clock`` on by its step."""

    def run(item, path, deadline, env):
        calls.append((item.name, round(deadline)))
        if clock is not None:
            clock.now += clock.step
        what = behaviour.get(item.name, "ok")
        if isinstance(what, list):  # one behaviour per run of the item
            what = what.pop(0)
        if what == "die":
            return -11  # a segfault, before any row
        rows = [dict(op="fprop", dtype="bfloat16", block_size=128, density=0.1, path="hopper", sparse_s=1.0)]
        if what == "error":
            rows.append(dict(rows[0], error="RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS"))
        report = dict(device_kind="NVIDIA H100 80GB HBM3", commit="abc", results=rows, complete=what == "ok")
        report["stopped"] = None if what in ("ok", "hang") else "deadline of 10 s reached"
        if what == "hang":  # killed past its deadline inside a path
            report["in_flight"] = dict(op="fprop", dtype="bfloat16", bs=128, density=0.1, path="hopper:stacked")
        path.write_text(json.dumps(report))
        return {"error": 1, "hang": -signal.SIGKILL}.get(what, 0)

    return run


def test_session_run_loses_only_a_dead_item_and_resumes(session, tmp_path):
    out = tmp_path / "bench"
    plan = session.PLAN[:5]
    clock = _Clock(10)
    calls = []
    report = session.run_session(
        out,
        200,
        plan=plan,
        runner=_fake_runner({"bf16-b64": "die", "bf16-b32": "error", "bf16-b16": "partial"}, calls, clock),
        clock=clock,
    )
    status = {s["name"]: s["status"] for s in report["session"]}
    assert status == {
        "bf16-b128": "pass",
        "bf16-b64": "died",
        "bf16-b32": "error",
        "bf16-b16": "partial",
        "bf16-b8": "pass",
    }
    # The item with an error row ran once more (resumed without the path that failed); the
    # one that stopped at its deadline did not (nothing failed there).
    assert [name for name, _ in calls] == ["bf16-b128", "bf16-b64", "bf16-b32", "bf16-b32", "bf16-b16", "bf16-b8"]
    assert {s["name"]: s["retries"] for s in report["session"] if "retries" in s}["bf16-b32"] == 1
    # Rows of every item that wrote some, each naming its item; the device and commit kept.
    assert sorted({r["item"] for r in report["results"]}) == ["bf16-b128", "bf16-b16", "bf16-b32", "bf16-b8"]
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["complete"] is False
    assert json.loads((out / "bench.json").read_text())["session"] == report["session"]
    # A rerun skips what completed and runs the rest again (bsmm.py --resume goes on there).
    calls.clear()
    clock = _Clock(10)
    again = session.run_session(out, 200, plan=plan, runner=_fake_runner({}, calls, clock), clock=clock)
    assert [name for name, _ in calls] == ["bf16-b64", "bf16-b32", "bf16-b16"]
    assert {s["name"]: s["status"] for s in again["session"]}["bf16-b128"] == "done-before"


def test_session_runs_an_item_that_hung_once_more(session, tmp_path):
    clock = _Clock(10)
    calls = []
    runner = _fake_runner({"bf16-b64": ["hang", "ok"], "bf16-b32": ["hang", "hang"]}, calls, clock)
    report = session.run_session(tmp_path / "bench", 300, plan=session.PLAN[:3], runner=runner, clock=clock)
    assert [name for name, _ in calls] == ["bf16-b128", "bf16-b64", "bf16-b64", "bf16-b32", "bf16-b32"]
    entry = {s["name"]: s for s in report["session"]}
    assert entry["bf16-b64"]["status"] == "pass" and entry["bf16-b64"]["retries"] == 1
    assert entry["bf16-b64"]["seconds"] == 20  # both runs
    # Hung twice: once more only, then it keeps what it measured.
    assert entry["bf16-b32"]["status"] == "partial" and "killed" in entry["bf16-b32"]["stopped"]


def test_session_budget_leaves_later_items_unrun(session, tmp_path):
    clock = _Clock(60)  # each item takes 60 s
    calls = []
    report = session.run_session(
        tmp_path / "bench", 150, plan=session.PLAN, runner=_fake_runner({}, calls, clock), clock=clock
    )
    # 150 s: the first item's share is (150 - 20) / 4; after it 90 s are left, 70 / 3 for the
    # second; after it 30 s, 10 / 2 = 5 s for the third, too short to start: it gets all 10 s
    # (priority), and nothing is left for the rest.
    ran = [name for name, _ in calls]
    assert ran == ["bf16-b128", "bf16-b64", "bf16-b32"]
    assert [round(deadline) for _, deadline in calls] == [32, 23, 10]
    assert [s["status"] for s in report["session"]].count("not-run") == len(session.PLAN) - 3
    assert all("budget spent" in s["stopped"] for s in report["session"] if s["status"] == "not-run")


# ---------------------------------------------------------------------------------
# bench/bsmm.py: resume, the session's options, the roofline
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bsmm():
    return load_script("bench/bsmm.py")


def test_bsmm_resume_measures_only_what_is_missing(bsmm, tmp_path):
    path = tmp_path / "bench.json"
    argv = ["--preset", "quick", "--no-call-time", "--no-dense-path", "--json", str(path)]
    first = bsmm.main(argv)
    assert first["complete"] and first["resumed_rows"] == 0
    n = len(first["results"])
    assert n == 2 * 3 and all(r["sparse_call_s"] is None and r["dense_path_s"] is None for r in first["results"])
    assert first["dense_path"] is False and first["config"]["call_time"] is False
    # The roofline from this run's own ceilings.
    assert first["bandwidth_Bps"] > 0
    for row in first["results"]:
        assert row["roofline_s"] > 0 and row["roofline_speedup_bound"] > 0
        assert row["requested_density"] in (1.0, 0.25) and row["size"] == [256, 256, 64]
    # Everything there: nothing measured again.
    again = bsmm.main([*argv, "--resume"])
    assert again["resumed_rows"] == n and len(again["results"]) == n
    assert [r["sparse_s"] for r in again["results"]] == [r["sparse_s"] for r in first["results"]]
    # Two rows gone (say the process died there): only that product is measured again.
    report = json.loads(path.read_text())
    report["results"] = [r for r in report["results"] if not (r["op"] == "updat" and r["requested_density"] == 0.25)]
    path.write_text(json.dumps(report))
    resumed = bsmm.main([*argv, "--resume"])
    assert resumed["resumed_rows"] == n - 1 and len(resumed["results"]) == n
    assert resumed["results"][-1]["op"] == "updat" and resumed["results"][-1]["requested_density"] == 0.25
    assert resumed["in_flight"] is None and resumed["faults"] == []
    # The path that was measuring it hung there (the process killed, in_flight left): a
    # resumed run keeps that as a fault and does not try the path again at that block size.
    report = json.loads(path.read_text())
    gone = report["results"].pop()
    report.update(
        complete=False,
        in_flight=dict(
            op="updat", dtype=gone["dtype"], bs=gone["block_size"], density=0.25, path=gone["requested_path"]
        ),
    )
    path.write_text(json.dumps(report))
    skipped = bsmm.main([*argv, "--resume"])
    assert len(skipped["results"]) == n - 1 and skipped["complete"]
    assert [(f["op"], f["path"], f["why"]) for f in skipped["faults"]] == [
        ("updat", gone["requested_path"], "killed or died while measuring it")
    ]


def test_roofline_takes_the_larger_floor():
    timing = load_script("bench/_timing.py")
    c = k = n = 1024
    dense_s = 2.0 * n * c * k / 1e12  # 1 TFLOP/s
    low = timing.roofline("fprop", c, k, n, 0.01, "float32", dense_s=dense_s, bandwidth=1e12)
    flops, nbytes = timing.problem_cost("fprop", c, k, n, 0.01, "float32")
    assert nbytes == (n * c + n * k + 0.01 * c * k) * 4 and flops == 2.0 * n * c * k * 0.01
    assert low["roofline_s"] == pytest.approx(max(flops / 1e12, nbytes / 1e12))
    full = timing.roofline("fprop", c, k, n, 1.0, "float32", dense_s=dense_s, bandwidth=1e15)
    assert full["roofline_speedup_bound"] == pytest.approx(1.0)  # compute-bound at density 1: dense is the floor
    assert timing.roofline("fprop", c, k, n, 0.1, "float32", dense_s=None, bandwidth=1e12)["roofline_s"] is None


# ---------------------------------------------------------------------------------
# run_isolated.py --resume
# ---------------------------------------------------------------------------------

RESUME_FILES = {
    "test_a_fails_first.py": """
import pytest
@pytest.mark.parametrize("i", range(4))
def test_cases(i):
    assert i != 1, "case 1 is broken"
""",
    "test_b_dies.py": """
import os, signal
def test_before():
    pass
def test_killed():
    os.kill(os.getpid(), signal.SIGKILL)
def test_after():
    pass
""",
}


def test_runner_resume_runs_the_rest_of_a_failed_job(tmp_path):
    for name, text in RESUME_FILES.items():
        (tmp_path / name).write_text(text)
    res = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--out",
            "out",
            "--resume",
            "2",
            "--sanitizer",
            "",
            *RESUME_FILES,
            "--",
            "-p",
            "no:cacheprovider",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 1, res.stdout
    jobs = {j["id"]: j for j in json.loads((tmp_path / "out" / "isolated.json").read_text())["jobs"]}
    assert list(jobs)[:2] == list(RESUME_FILES)  # then the resumed ones, as their first ends
    assert sorted(list(jobs)[2:]) == ["test_a_fails_first.py (resumed 1)", "test_b_dies.py (resumed 1)"]
    first, resumed = jobs["test_a_fails_first.py"], jobs["test_a_fails_first.py (resumed 1)"]
    assert first["status"] == "fail" and first["counts"]["passed"] == 1  # -x: stopped at case 1
    # The rest ran in a new process: cases 2 and 3, not 0 and 1 again.
    assert resumed["status"] == "pass" and resumed["counts"]["passed"] == 2 and resumed["counts"]["tests"] == 2
    assert resumed["slug"].endswith(".r1") and (tmp_path / "out" / resumed["junit"]).exists()
    died, after = jobs["test_b_dies.py"], jobs["test_b_dies.py (resumed 1)"]
    assert died["status"] == "died" and died["first_failure"]["test"] == "test_b_dies.py::test_killed"
    assert after["status"] == "pass" and after["counts"] == dict(tests=1, passed=1, failed=0, errors=0, skipped=0)


# ---------------------------------------------------------------------------------
# device_call.sh
# ---------------------------------------------------------------------------------


def test_device_call_packs_what_the_check_wrote(tmp_path):
    out = tmp_path / "OUT"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHECK_")}
    env.update(OUT=str(out), CHECK_DIR=str(tmp_path / "check"), CHECK_STEPS="ncu-summary", CHECK_BUDGET_S="60")
    res = subprocess.run(["bash", str(DEVICE_CALL)], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 1, res.stdout + res.stderr  # ncu-summary fails without ncu's CSV
    assert "device_call.sh: check.sh exit 1" in res.stdout
    listing = subprocess.run(["tar", "tzf", str(out / "check.tgz")], capture_output=True, text=True, check=True).stdout
    assert "check/steps.tsv" in listing and "check/summary.json" in listing
    assert (out / "summary.json").exists() and "summary" in (out / "console.log").read_text()
    # At most 8 files come back from $OUT: the call writes five at most.
    assert len(list(out.iterdir())) <= 5
