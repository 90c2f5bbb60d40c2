"""tests/gpu/check.sh and its helpers, checked where there is no GPU (CI).

- check.sh: syntax, ``--dry-run`` (every step's exact command, in order: measure first,
  then test; nothing run), the compute capability -> arch mapping, the step runner (a
  failing step does not stop the next; the budget skips steps; the exit status says so),
  and its list of training-step models against tests/gpu/test_training_steps.py.
- tests/gpu/run_isolated.py: a job whose process dies (SIGKILL, ``os._exit``) or hangs
  is reported alone, naming the test it died in, while the jobs after it pass; the
  memcheck rerun of a first failure (a stand-in compute-sanitizer) and its first report;
  a runner stopped by SIGTERM keeps what finished and takes its jobs down with it.
- bench/ncu_summary.py: ncu's CSV layouts. tests/data/ncu_raw_page_sample.csv and
  ncu_details_page_sample.csv hold the values of three H100 kernels from an ncu run of
  2026-11-22 (bf16, block 128, density 0.1) laid out as ``ncu --csv --page raw`` (header
  row, units row, one row per launch) and ``--page details`` (one row per launch and
  metric) print them; ncu_kernels_h100_excerpt.csv is the first lines of that run's CSV.
- bench/bsmm.py: its quick preset on the CPU and the JSON it writes (the fields the
  crossover table reads); a run killed mid-way keeps every finished row; its chains of
  products survive XLA (one product per link); each kernel path lowers to its own
  targets (cross-lowered for CUDA where the extension has the sm_90 targets).
- bench/check_summary.py: the final table from a made-up OUTDIR with both kernel paths
  and the JSON of the isolated steps.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "check.sh"
SANITIZER = ROOT / "tests" / "gpu" / "run_sanitizer.sh"
RUNNER = ROOT / "tests" / "gpu" / "run_isolated.py"
DATA = ROOT / "tests" / "data"
METRICS = (
    "gpu__time_duration.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
)


def _load(name):
    """A bench/ script as a module (bench/ is not a package)."""
    return load_script(f"bench/{name}.py")


def _check(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CHECK_")}
    full_env.update(env or {})
    return subprocess.run(
        ["bash", str(CHECK), *args], capture_output=True, text=True, env=full_env, timeout=timeout, cwd=ROOT
    )


# ---------------------------------------------------------------------------------
# check.sh
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [CHECK, SANITIZER], ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


# Every step, in check.sh's order; a session runs all but training and suite by default.
STEPS = (
    "preflight",
    "build",
    "env",
    "bench",
    "crossover",
    "gpu-tests",
    "training",
    "sanitizer",
    "suite",
    "ncu",
    "ncu-summary",
)
SESSION_STEPS = tuple(s for s in STEPS if s not in ("training", "suite"))


def _dry_steps(text):
    return [line[2:] for line in text.splitlines() if line[2:] in STEPS]


def test_dry_run_lists_the_session_steps_by_default(tmp_path):
    res = _check("--dry-run", str(tmp_path / "out"), env={"CHECK_CUDA_ARCH": "sm_90a"})
    assert res.returncode == 0, res.stderr
    assert _dry_steps(res.stdout) == list(SESSION_STEPS)
    assert "# budget 420s; steps: " + " ".join(SESSION_STEPS) in res.stdout
    assert "python3 build.py --cuda-arch sm_90a -j " in res.stdout


def _dry_limit(text, script):
    """The time limit of the dry run's command running ``script``."""
    line = next(line for line in text.splitlines() if line.startswith("timeout ") and script in line)
    return int(line.split()[2])


def test_the_bench_leaves_the_tests_and_the_sanitizer_their_time(tmp_path):
    # A short budget: the bench (first) gets what the isolated tests (130 s) and a finished
    # compute-sanitizer run (45 s) leave; the tests leave the sanitizer its share.
    env = {"CHECK_CUDA_ARCH": "sm_90a", "CHECK_BUDGET_S": "300"}
    text = _check("--dry-run", str(tmp_path / "out"), env=env).stdout
    assert _dry_limit(text, "bench/session.py") == 300 - 15 - 130 - 45
    assert "--budget 105 " in text
    assert _dry_limit(text, "run_isolated.py") == 150 and _dry_limit(text, "run_sanitizer.sh") == 60
    # Without the sanitizer step nothing is kept for it.
    text = _check("--dry-run", str(tmp_path / "out"), env={**env, "CHECK_STEPS": "bench gpu-tests"}).stdout
    assert _dry_limit(text, "bench/session.py") == 300 - 15 - 130
    # The default budget leaves every step its whole limit.
    text = _check("--dry-run", str(tmp_path / "out"), env={"CHECK_CUDA_ARCH": "sm_90a"}).stdout
    assert _dry_limit(text, "bench/session.py") == 170 and _dry_limit(text, "run_isolated.py") == 150


def test_dry_run_prints_every_step_in_order_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    res = _check(
        "--dry-run",
        str(out),
        env={
            "CHECK_CUDA_ARCH": "sm_90a",
            "XLA_FLAGS": "--xla_dump_to=/tmp/x",
            "JAX_BLOCKSPARSE_HOPPER": "1",
            "CHECK_STEPS": " ".join(STEPS),
        },
    )
    assert res.returncode == 0, res.stderr
    assert not out.exists(), "a dry run creates nothing"
    text = res.stdout
    # Measure first, then test: the steps in this order, each under its own limit.
    assert _dry_steps(text) == list(STEPS)
    expected = [
        "unset XLA_FLAGS JAX_PLATFORMS JAX_BLOCKSPARSE_IMPL JAX_BLOCKSPARSE_HOPPER",
        "PYTHONPATH=",
        "XLA_PYTHON_CLIENT_PREALLOCATE=false",
        "PYTHONUNBUFFERED=1",
        f"python3 tests/gpu/preflight.py --out {out} --arch sm_90a",
        "python3 build.py --cuda-arch sm_90a -j ",
        "nvidia-smi >>",
        "python3 -m jax_blocksparse >",
        f"env JAX_BLOCKSPARSE_IMPL=kernels python3 bench/session.py --out {out}/bench --json {out}/bench.json "
        "--budget ",
        f"python3 bench/crossover.py {out}/bench.json --out {out}/crossovers.json",
        f"python3 tests/gpu/run_isolated.py --out {out}/gpu-tests --json {out}/gpu-tests.json --parallel 8 ",
        "--split function --resume 2 ",
        "tests/gpu/test_bsmm_kernels.py tests/gpu/test_bsmm_sm90.py tests/gpu/test_bsconv_kernels.py",
        f"python3 tests/gpu/run_isolated.py --out {out}/training --json {out}/training.json --parallel 8 ",
        "--keyword 'rnn_cells]' ",
        "tests/gpu/test_training_steps.py ",
        f"bash tests/gpu/run_sanitizer.sh --log-dir {out}",
        "env JAX_BLOCKSPARSE_IMPL=kernels JBS_REQUIRE_KERNELS=1 python3 tests/gpu/run_isolated.py "
        f"--out {out}/suite --json {out}/suite.json --parallel 8 ",
        "--order size ",
        "tests/test_matmul.py",
        "ncu --clock-control none --kernel-name-base demangled --kernel-name regex:jbs --csv ",
        "python3 bench/ncu_driver.py --density 0.1",
        "python3 bench/ncu_summary.py ",
        f"python3 bench/check_summary.py {out}",
    ]
    at = 0
    for piece in expected:
        found = text.find(piece, at)
        assert found >= 0, f"{piece!r} missing (or out of order) in:\n{text}"
        at = found
    assert f"--metrics {','.join(METRICS)} " in text
    assert f"--json {out}/bench.json" in text and f"--json {out}/ncu_summary.json" in text
    steps = [line for line in text.splitlines() if line.startswith("timeout ")]
    assert len(steps) == len(STEPS)
    assert all(line.startswith("timeout --kill-after=10 ") for line in steps)
    # Each isolated step's runner stops 10 s before its step's limit (it writes its JSON first).
    for line in steps:
        if "run_isolated.py" in line:
            limit = int(line.split()[2])
            assert f"--budget {limit - 10} " in line, line
            name = re.search(rf"--out {re.escape(str(out))}/(\S+) ", line).group(1)
            assert line.endswith(f" -- -p no:cacheprovider > {out}/{name}.log 2>&1 < /dev/null"), line
    assert "--xla_dump_to" not in text  # XLA's default settings
    assert "pytest tests/gpu -n" not in text and " -n 14" not in text  # no shared xdist workers any more


def test_default_run_fits_the_budget():
    """The session's steps up to the sanitizer fit its 420 s budget (ncu gets the rest), the
    default step list is the session's, and the header's table states the limits the
    script uses."""
    text = CHECK.read_text()
    header = {}
    for line in text.splitlines():
        m = re.match(r"#   (\S+)\s+.*?\s(\d+)\s+(\d+)$", line)
        if m and m.group(1) in STEPS:
            header[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert list(header) == list(STEPS)
    limits = {}
    for step in STEPS:
        call = re.search(rf"(?:run_step|isolated) {re.escape(step)} \"\$\(limit_for (\d+)\)\"", text)
        bench = re.search(r'limit="\$\(limit_for (\d+)\)"\n\s+run_step bench', text)
        limits[step] = int(call.group(1)) if call else int(bench.group(1))
    assert {s: lim for s, (_, lim) in header.items()} == limits
    assert 'BUDGET="${CHECK_BUDGET_S:-420}"' in text
    assert f'SESSION_STEPS="{" ".join(SESSION_STEPS)}"' in text
    expected = sum(header[s][0] for s in SESSION_STEPS[: SESSION_STEPS.index("sanitizer") + 1])
    assert expected <= 420 - 15, expected


def test_training_models_are_those_of_the_tests():
    """check.sh's one process per model covers exactly tests/gpu/test_training_steps.py's ORDER."""
    listed = re.search(r"^TRAINING_MODELS=\(([^)]*)\)", CHECK.read_text(), re.M).group(1).split()
    tree = ast.parse((ROOT / "tests" / "gpu" / "test_training_steps.py").read_text())
    order = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ORDER"
    )
    assert listed == list(order)


@pytest.mark.parametrize(
    "cap, arch", [("9.0", "sm_90a"), ("8.0", "sm_80"), ("8.6", "sm_86"), ("8.9", "sm_89"), ("10.0", "sm_100")]
)
def test_arch_from_nvidia_smi(tmp_path, cap, arch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\necho ' {cap}'\necho ' {cap}'\n")  # two GPUs: the first counts
    fake.chmod(0o755)
    res = _check("--dry-run", str(tmp_path / "out"), env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert res.returncode == 0, res.stderr
    assert f"python3 build.py --cuda-arch {arch} -j " in res.stdout


def test_usage_errors():
    assert _check().returncode == 2
    assert _check("--no-such-option", "out").returncode == 2
    help_text = _check("--help")
    assert help_text.returncode == 0 and "--dry-run" in help_text.stdout and "CHECK_BUDGET_S" in help_text.stdout


def test_failing_steps_run_on_and_fail_the_check(tmp_path):
    out = tmp_path / "out"
    res = _check(
        str(out), env={"CHECK_STEPS": "sanitizer ncu-summary", "COMPUTE_SANITIZER": str(tmp_path / "no-such-sanitizer")}
    )
    assert res.returncode == 1, res.stdout + res.stderr
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert [(s[0], s[1]) for s in steps] == [("sanitizer", "fail"), ("ncu-summary", "fail")]
    assert "FAILED steps: sanitizer, ncu-summary" in res.stdout
    assert (out / "summary.json").exists() and (out / "meta.txt").exists()
    assert "summary" in res.stdout and "seconds" in res.stdout


def test_budget_skips_steps(tmp_path):
    out = tmp_path / "out"
    res = _check(str(out), env={"CHECK_STEPS": "sanitizer ncu-summary", "CHECK_BUDGET_S": "2"})
    assert res.returncode == 1
    statuses = [line.split("\t")[1] for line in (out / "steps.tsv").read_text().splitlines()]
    assert statuses == ["skipped", "skipped"]


# ---------------------------------------------------------------------------------
# run_isolated.py
# ---------------------------------------------------------------------------------

# Test files the runner runs on CPU: their crashes stand in for a CUDA fault.
ISOLATED_FILES = {
    "test_1_killed.py": """
import os, signal
def test_before():
    pass
def test_killed():
    os.kill(os.getpid(), signal.SIGKILL)
def test_after():
    pass
""",
    "test_2_exits.py": """
import os
def test_exits():
    os._exit(1)
""",
    "test_3_passes.py": """
import pytest
@pytest.mark.parametrize("i", range(3))
def test_passes(i):
    assert i >= 0
""",
    "test_4_fails.py": """
def test_fails():
    assert 1 == 2, "one is not two"
def test_fine():
    pass
""",
    "test_5_hangs.py": """
import os, time
def test_hangs():
    with open("hang.pid", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
""",
}

# What compute-sanitizer prints around a fault (the report's first line can follow pytest's dots).
FAKE_SANITIZER = """#!/bin/sh
# tests/test_gpu_check.py's stand-in: --tool memcheck --print-limit 20 PYTHON ARGS...
shift 4
echo "========= COMPUTE-SANITIZER"
"$@"
printf '..========= Invalid __global__ read of size 4 bytes\n'
echo "=========     at void jbs::DsdTcKernel<bf16>(jbs::DsdParams)+0x5600"
echo "=========     by thread (0,0,0) in block (2,0,0)"
echo "=========     Saved host backtrace up to driver entry point at kernel launch time"
echo "=========         Host Frame: cudaLaunchKernel [0x190037] in _jbs_kernels.so"
echo "========="
echo "========= ERROR SUMMARY: 1 error"
"""


def _isolated_tree(tmp_path):
    for name, text in ISOLATED_FILES.items():
        (tmp_path / name).write_text(text)
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    return fake


def _runner(tmp_path, *args, **kw):
    return subprocess.Popen(
        [sys.executable, str(RUNNER), *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def test_runner_reports_a_dead_process_alone(tmp_path):
    fake = _isolated_tree(tmp_path)
    files = ["test_1_killed.py", "test_2_exits.py", "test_3_passes.py", "test_4_fails.py"]
    proc = _runner(
        tmp_path, "--out", "out", "--parallel", "2", "--sanitizer", str(fake), *files, "--", "-p", "no:cacheprovider"
    )
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, stdout
    report = json.loads((tmp_path / "out" / "isolated.json").read_text())
    assert report["complete"] is True
    jobs = {j["id"]: j for j in report["jobs"]}
    assert list(jobs) == files
    killed, exits, passes, fails = (jobs[f] for f in files)
    # Killed by a signal: its own failure, named by the test it died in.
    assert killed["status"] == "died" and killed["signal"] == "SIGKILL" and killed["counts"] is None
    assert killed["first_failure"]["test"] == "test_1_killed.py::test_killed"
    assert "SIGKILL" in killed["first_failure"]["error"]
    assert exits["status"] == "died" and exits["rc"] == 1 and exits["signal"] is None
    assert exits["first_failure"]["test"] == "test_2_exits.py::test_exits"
    assert "without pytest's report" in exits["first_failure"]["error"]
    # The jobs after them still ran.
    assert passes["status"] == "pass" and passes["counts"]["passed"] == 3 and passes["first_failure"] is None
    assert fails["status"] == "fail" and fails["counts"]["failed"] == 1
    assert fails["first_failure"] == {"test": "test_4_fails.py::test_fails", "error": "AssertionError: one is not two"}
    # memcheck reran the first failure of each failing job, alone; its first report is kept.
    for job in (killed, exits, fails):
        sanitizer = job["sanitizer"]
        assert sanitizer["status"] == "errors" and sanitizer["errors"] == 1, job
        assert sanitizer["first_report"].splitlines() == [
            "Invalid __global__ read of size 4 bytes",
            "at void jbs::DsdTcKernel<bf16>(jbs::DsdParams)+0x5600",
            "by thread (0,0,0) in block (2,0,0)",
        ]
        assert (tmp_path / "out" / sanitizer["log"]).exists()
        assert sanitizer["argv"][1:3] == ["--tool", "memcheck"] and job["first_failure"]["test"] in sanitizer["argv"]
    assert passes["sanitizer"] is None
    assert report["totals"]["jobs"] == 4 and report["totals"]["died"] == 2 and report["totals"]["pass"] == 1
    for job in jobs.values():
        assert (tmp_path / "out" / job["log"]).exists()
        assert job["argv"][1:4] == ["-m", "pytest", job["id"]] and "-x" in job["argv"]
    assert "test_1_killed.py::test_killed: process killed by SIGKILL" in stdout


def test_runner_kills_a_job_at_its_limit(tmp_path):
    _isolated_tree(tmp_path)
    proc = _runner(tmp_path, "--out", "out", "--timeout", "4", "--sanitizer", "", "test_5_hangs.py")
    stdout, _ = proc.communicate(timeout=60)
    (job,) = json.loads((tmp_path / "out" / "isolated.json").read_text())["jobs"]
    assert job["status"] == "timeout" and job["first_failure"]["test"] == "test_5_hangs.py::test_hangs", stdout
    assert "timed out after" in job["first_failure"]["error"]
    with pytest.raises(ProcessLookupError):  # killed, not left behind
        os.kill(int((tmp_path / "hang.pid").read_text()), 0)


def test_runner_splits_files_into_functions_and_keywords(tmp_path):
    _isolated_tree(tmp_path)
    proc = _runner(
        tmp_path,
        "--out",
        "out",
        "--parallel",
        "2",
        "--split",
        "function",
        "--sanitizer",
        "",
        "test_1_killed.py",
        "test_3_passes.py::test_passes",
        "--",
        "-p",
        "no:cacheprovider",
    )
    stdout, _ = proc.communicate(timeout=120)
    jobs = {j["id"]: j["status"] for j in json.loads((tmp_path / "out" / "isolated.json").read_text())["jobs"]}
    # Only the function that kills its process fails; those before and after it pass.
    assert jobs == {
        "test_1_killed.py::test_before": "pass",
        "test_1_killed.py::test_killed": "died",
        "test_1_killed.py::test_after": "pass",
        "test_3_passes.py::test_passes": "pass",
    }, stdout
    proc = _runner(
        tmp_path,
        "--out",
        "kw",
        "--json",
        "kw.json",
        "--keyword",
        "passes[1]",
        "--keyword",
        "nothing",
        "test_3_passes.py",
        "--",
        "-p",
        "no:cacheprovider",
    )
    stdout, _ = proc.communicate(timeout=120)
    jobs = json.loads((tmp_path / "kw.json").read_text())["jobs"]
    assert [(j["id"], j["status"]) for j in jobs] == [
        ("test_3_passes.py -k passes[1]", "pass"),
        ("test_3_passes.py -k nothing", "empty"),
    ], stdout
    assert jobs[0]["counts"]["passed"] == 1


def test_runner_stopped_keeps_what_finished_and_kills_its_jobs(tmp_path):
    _isolated_tree(tmp_path)
    proc = _runner(
        tmp_path,
        "--out",
        "out",
        "--parallel",
        "2",
        "--sanitizer",
        "",
        "test_3_passes.py",
        "test_5_hangs.py",
        "test_4_fails.py",
        "--",
        "-p",
        "no:cacheprovider",
    )
    path = tmp_path / "out" / "isolated.json"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:  # until the first job has finished and the hang has started
        done = json.loads(path.read_text())["jobs"] if path.exists() else []
        if (tmp_path / "hang.pid").exists() and any(j["status"] == "pass" for j in done):
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what `timeout` sends
    stdout, _ = proc.communicate(timeout=60)
    report = json.loads(path.read_text())
    assert report["complete"] is False and "SIGTERM" in report["stopped"], stdout
    status = {j["id"]: j["status"] for j in report["jobs"]}
    assert status["test_3_passes.py"] == "pass" and status["test_5_hangs.py"] == "timeout"
    assert status["test_4_fails.py"] in ("not-run", "fail", "timeout")
    with pytest.raises(ProcessLookupError):
        os.kill(int((tmp_path / "hang.pid").read_text()), 0)


def test_runner_budget_leaves_jobs_not_run(tmp_path):
    _isolated_tree(tmp_path)
    proc = _runner(tmp_path, "--out", "out", "--budget", "1", "--sanitizer", "", "test_3_passes.py")
    stdout, _ = proc.communicate(timeout=60)
    report = json.loads((tmp_path / "out" / "isolated.json").read_text())
    assert proc.returncode == 1 and [j["status"] for j in report["jobs"]] == ["not-run"], stdout


def test_runner_rejects_bad_arguments(tmp_path):
    for args in (
        ["--out", "o", "no_such_test.py"],
        ["--out", "o", "--parallel", "0", str(RUNNER)],
        ["--out", "o", "--split", "function", "--keyword", "x", str(RUNNER)],
    ):
        res = subprocess.run([sys.executable, str(RUNNER), *args], cwd=tmp_path, capture_output=True, text=True)
        assert res.returncode == 2, (args, res.stderr)


# ---------------------------------------------------------------------------------
# ncu_summary.py
# ---------------------------------------------------------------------------------

# bf16, block 128, density 0.1 on an H100 (the ncu run of 2026-11-22)
H100_B128 = {  # op: (duration us, occupancy %, tensor %, DRAM %, registers)
    "fprop": (85.856, 23.70, 26.24, 24.76, 120),
    "bprop": (92.352, 23.72, 24.95, 23.28, 121),
    "updat": (191.968, 12.47, 15.41, 5.58, 94),
}


@pytest.fixture(scope="module")
def ncu_summary():
    return _load("ncu_summary")


def _problems(ops=("fprop", "bprop", "updat"), dtype="bfloat16", bs=128):
    return [dict(index=i, op=op, dtype=dtype, block_size=bs, density=0.1, nnz=102) for i, op in enumerate(ops)]


@pytest.mark.parametrize(
    "name, layout",
    [
        ("ncu_raw_page_sample.csv", "raw"),
        ("ncu_details_page_sample.csv", "details"),
        ("ncu_kernels_h100_excerpt.csv", "summary"),
    ],
)
def test_ncu_csv_layouts(ncu_summary, name, layout):
    found, launches = ncu_summary.read_launches((DATA / name).read_text())
    assert found == layout
    summary = ncu_summary.summarize(launches, _problems())
    assert summary["matched_by"] == "order" and summary["warnings"] == []
    assert [r["op"] for r in summary["rows"]] == ["fprop", "bprop", "updat"]  # nvjet (not ours) left out
    for row in summary["rows"]:
        duration, occupancy, tensor, dram, regs = H100_B128[row["op"]]
        assert row["dtype"] == "bfloat16" and row["block_size"] == 128
        assert row["duration_us"] == pytest.approx(duration, abs=0.01)  # raw: "85.86" usecond
        assert row["occupancy_pct"] == pytest.approx(occupancy)
        assert row["tensor_pipe_pct"] == pytest.approx(tensor)
        assert row["dram_pct"] == pytest.approx(dram)
        assert row["registers"] == regs
    table = ncu_summary.table(summary["rows"])
    assert "duration us" in table and "occupancy %" in table and "tensor %" in table and "DRAM %" in table
    assert "DsdTc<bf16,bf16,128,128,2,4,32,3,1>" in table


def test_ncu_pairing_by_name_when_counts_differ(ncu_summary):
    _, launches = ncu_summary.read_launches((DATA / "ncu_raw_page_sample.csv").read_text())
    problems = _problems(ops=("updat", "fprop", "bprop", "fprop"))  # 4 problems, 3 launches
    summary = ncu_summary.summarize(launches, problems)
    assert summary["matched_by"] == "name" and summary["warnings"]
    assert [(r["op"], r["block_size"]) for r in summary["rows"]] == [("fprop", 128), ("bprop", 128), ("updat", 128)]
    # Same count, wrong order: paired by order, and the disagreement is reported.
    summary = ncu_summary.summarize(launches, _problems(ops=("bprop", "fprop", "updat")))
    assert summary["matched_by"] == "order"
    assert summary["rows"][0]["name_disagrees"] == {"op": "fprop"} and len(summary["warnings"]) == 2


@pytest.mark.parametrize(
    "name, expected",
    [
        (
            "void jbs::DsdTcKernel<__half, __half, 32, 128, 4, 1, 32, 3, (bool)1>(jbs::DsdParams)",
            ("bprop", "float16", 32),
        ),
        (
            "void jbs::DsdTcKernel<__nv_bfloat16, float, 64, 128, 4, 2, 32, 3, false>(jbs::DsdParams)",
            ("fprop", "bfloat16", 64),
        ),
        ("void jbs::DsdF32Kernel<16, 64, 16, 16, 32, 1>(jbs::DsdParams)", ("bprop", "float32", 16)),
        ("void jbs::SddF32Kernel<128, 8, 8, 16>(jbs::SddParams)", ("updat", "float32", 128)),
        (
            "void jbs::SddTcKernel<__nv_bfloat16, __nv_bfloat16, 8, 8, 1, 1, 32, 3>(jbs::SddParams)",
            ("updat", "bfloat16", 8),
        ),
        ("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", (None, None, None)),
    ],
)
def test_kernel_names(ncu_summary, name, expected):
    info = ncu_summary.parse_kernel_name(name)
    assert (info["op"], info["dtype"], info["block_size"]) == expected


def test_ncu_summary_cli(ncu_summary, tmp_path, capsys):
    problems = tmp_path / "problems.json"
    problems.write_text(json.dumps(dict(problems=_problems())))
    out = tmp_path / "summary.json"
    missing = tmp_path / "no-such.csv"  # the --log-file may be missing: the next file is read
    rc = ncu_summary.main(
        [str(missing), str(DATA / "ncu_details_page_sample.csv"), "--problems", str(problems), "--json", str(out)]
    )
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["csv_layout"] == "details" and len(summary["rows"]) == 3
    assert summary["rows"][2]["nnz"] == 102
    assert "SddTc<bf16,bf16,128,1,2,4,32,3>" in capsys.readouterr().out
    assert ncu_summary.main([str(missing), "--json", str(out)]) == 1  # nothing profiled: the step fails


# ---------------------------------------------------------------------------------
# bsmm.py, ncu_driver.py, check_summary.py
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bsmm():
    return _load("bsmm")


@pytest.fixture(scope="module")
def kernel_paths():
    return _load("_kernel_paths")


# The fields bench/crossover.py (and the summary) read from every row.
ROW_FIELDS = ("op", "dtype", "block_size", "density", "path", "target", "mode", "sparse_s", "dense_s", "dense_path_s")


def test_bench_quick_json(bsmm, tmp_path, monkeypatch):
    import jax

    import jax_blocksparse as jbs

    kernels = jbs.has_cpu_kernels() or jax.devices()[0].platform != "cpu"
    if kernels:
        monkeypatch.setenv("JAX_BLOCKSPARSE_IMPL", "kernels")  # not "auto": it may choose the dense product
    path = tmp_path / "bench.json"
    bsmm.main(["--preset", "quick", "--json", str(path)])
    report = json.loads(path.read_text())
    for field in (
        "device",
        "device_kind",
        "platform",
        "commit",
        "date",
        "datetime",
        "jax_version",
        "implementation",
        "size",
        "timing",
        "results",
        "paths",
        "dense_path",
    ):
        assert field in report, field
    on_cpu = jax.devices()[0].platform == "cpu"
    assert report["platform"] == jax.devices()[0].platform and report["complete"] is True
    assert report["commit"] and report["date"].count("-") == 2
    assert report["timing"]["chain"] == 2 and "layout" in report["timing"]
    assert report["paths"] == (["native"] if on_cpu else report["paths"][:1] + report["paths"][1:])
    assert on_cpu or report["paths"][0] == "ampere"
    rows = report["results"]
    assert len(rows) == 2 * 3 * len(report["paths"])  # densities x ops x paths
    assert {r["op"] for r in rows} == {"fprop", "bprop", "updat"}
    dense_impl = "dense" in jbs.config.IMPLEMENTATIONS
    assert report["dense_path"] is dense_impl
    for r in rows:
        assert all(field in r for field in ROW_FIELDS), r
        assert "error" not in r, r
        for field in (
            "sparse_s",
            "dense_s",
            "sparse_call_s",
            "dense_call_s",
            "efficiency",
            "speedup",
            "call_efficiency",
        ) + (("dense_path_s",) if dense_impl else ()):
            assert math.isfinite(r[field]) and r[field] > 0, (field, r)
        assert r["dense_path_s"] is None or dense_impl
        assert r["efficiency"] == pytest.approx(r["dense_s"] * r["density"] / r["sparse_s"])
        assert r["block_size"] == 32 and r["dtype"] == "float32" and r["nnz"] > 0
        assert r["path"] in report["paths"]
        if on_cpu:
            assert r["path"] == "native" and r["mode"] == "float32"
            assert r["target"] == (f"jbs_bsmm_{r['op']}" if kernels else None)
    # bench/crossover.py reads them (the lead's script: where it exists).
    crossover = ROOT / "bench" / "crossover.py"
    if kernels and crossover.exists():
        out = tmp_path / "crossovers.json"
        res = subprocess.run(
            [sys.executable, str(crossover), str(path), "--out", str(out)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert res.returncode == 0, res.stderr
        entries = json.loads(out.read_text())["entries"]
        assert {e["target"] for e in entries} == {r["target"] for r in rows}


def test_bench_deadline_keeps_what_it_has(bsmm, tmp_path):
    path = tmp_path / "bench.json"
    bsmm.main(["--preset", "quick", "--deadline", "0", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["complete"] is False and "deadline" in report["stopped"] and report["results"] == []


def test_bench_errors_are_rows_and_a_dead_context_ends_the_run(bsmm, tmp_path, monkeypatch):
    """A product that raises gets a row with its error and the run goes on; an error that
    says the CUDA context is gone (a kernel fault) ends the run, keeping what it has."""
    real, calls = bsmm.compile_checked, []

    def flaky(fn, args, path):
        calls.append(path)
        if len(calls) == 3:  # the second product's chain
            raise ValueError("a bad product")
        if len(calls) == 7:  # the fourth product's single call
            raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned address")
        return real(fn, args, path)

    monkeypatch.setattr(bsmm, "compile_checked", flaky)
    path = tmp_path / "bench.json"
    report = bsmm.main(["--preset", "quick", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    rows = report["results"]
    assert [r.get("error", "").split(":")[0] for r in rows] == ["", "ValueError", "", "RuntimeError"]
    assert rows[1]["sparse_s"] is None and rows[1]["efficiency"] is None and rows[1]["dense_s"] > 0
    assert rows[2]["sparse_s"] > 0
    assert report["complete"] is False and report["stopped"].startswith("CUDA context lost at fprop float32")


def test_bench_killed_keeps_every_finished_row(tmp_path):
    """A bench killed by `timeout` (SIGTERM) leaves a readable JSON with every row it had
    finished: the JSON is rewritten after each row through a temporary file and a rename."""
    path = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_BLOCKSPARSE_", "CHECK_"))}
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "bsmm.py"),
        "--preset",
        "quick",
        "--block-sizes",
        "32",
        "64",
        "--densities",
        "1",
        "0.5",
        "0.25",
        "0.1",
        "0.05",
        "--json",
        str(path),
    ]  # 30 rows: killed long before
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + 180
        while seen < 2 and time.monotonic() < deadline and proc.poll() is None:
            if path.exists():
                seen = len(json.loads(path.read_text())["results"])  # readable whenever it exists
            time.sleep(0.02)
        assert seen >= 2, proc.stderr.read() if proc.poll() is not None else "no rows in time"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report = json.loads(path.read_text())
    assert report["complete"] is False and 2 <= len(report["results"]) < 30
    assert all(r["sparse_s"] and r["dense_s"] for r in report["results"])


def test_bench_paths_lower_to_their_own_targets(bsmm, kernel_paths, monkeypatch):
    """The Hopper gate is read at lowering and jit's caches do not know it: each path's own
    function objects, lowered under hopper_gate(path), call that path's targets, in
    either order, whatever the environment had (cross-lowered for CUDA here)."""
    import jax.numpy as jnp

    import jax_blocksparse as jbs
    from jax_blocksparse.ops import _sm90
    from jax_blocksparse.ops import paths as ops_paths

    if not _sm90.built_targets():
        pytest.skip("the extension was built without the sm_90 targets")
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: None)  # no CUDA device: the env decides
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")  # hopper_gate("ampere") must close it, and restore it after
    monkeypatch.setenv("JAX_BLOCKSPARSE_IMPL", "kernels")
    layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5, seed=0), 32)
    x = jnp.ones((16, 128), jnp.bfloat16)
    w = jnp.ones(layout.w_shape, jnp.bfloat16)
    W = jnp.ones((128, 128), jnp.bfloat16)
    paths = ("hopper", "ampere", *(f"hopper:{v}" for v in ops_paths.hopper_variants()))
    assert "hopper:stacked" in paths and "hopper:capped" in paths
    jitted = {path: bsmm.Jitted(2) for path in paths}
    for path in ("hopper", "ampere", "hopper", *paths[2:]):
        for op in ("fprop", "bprop", "updat"):
            s_args, _ = bsmm._args(op, x, x, W, w, layout)
            with kernel_paths.hopper_gate(path):
                text = jitted[path].chains[op][0].trace(*s_args).lower(lowering_platforms=("cuda",)).as_text()
            target = kernel_paths.kernel_target(text)
            assert target == f"jbs_bsmm_{op}" + ("_sm90" if path.startswith("hopper") else ""), (path, op)
            # block 32: the stacked variant runs fprop/bprop, the capped one updat
            ran = path if path in ("hopper", "ampere") or (op == "updat") == path.endswith("capped") else "hopper"
            assert kernel_paths.path_of(target, "gpu", path, text) == ran, (path, op)
            assert kernel_paths.arithmetic_mode("bfloat16", target, text, "gpu") == "bfloat16"
            assert os.environ[_sm90.HOPPER_ENV] == "1"


def test_bench_target_and_mode_from_hlo(kernel_paths):
    compiled = (
        "%custom-call.1 = f32[16,128]{1,0} custom-call(f32[16,128]{1,0} %p0, ...), "
        'custom_call_target="jax_blocksparse_bsmm_fprop_sm90_v1", api_version=API_VERSION_TYPED_FFI, '
        "backend_config={tf32 = true}"
    )
    lowered = (
        '%0 = stablehlo.custom_call @jax_blocksparse_bsmm_updat_sm90_v1(%arg0, %arg1) {backend_config = "", '
        "mhlo.backend_config = {tf32 = true}} : (tensor<16x128xf32>) -> tensor<8x32x32xf32>"
    )
    assert kernel_paths.kernel_target(compiled) == "jbs_bsmm_fprop_sm90"
    assert kernel_paths.kernel_target(lowered) == "jbs_bsmm_updat_sm90"
    assert kernel_paths.kernel_target("%dot.1 = f32[16,128] dot(...)") is None
    assert kernel_paths.kernel_target('custom_call_target="lapack_sgetrf_ffi"') is None  # not one of ours
    both = compiled + "\n" + compiled.replace("_sm90_v1", "_v1")
    assert kernel_paths.kernel_target(both) == "jbs_bsmm_fprop,jbs_bsmm_fprop_sm90"
    assert kernel_paths.arithmetic_mode("float32", "jbs_bsmm_updat_sm90", lowered, "gpu") == "tf32"
    assert (
        kernel_paths.arithmetic_mode("float32", "jbs_bsmm_updat_sm90", lowered.replace("true", "false"), "gpu")
        == "float32"
    )
    assert kernel_paths.arithmetic_mode("float32", "jbs_bsmm_fprop", "", "gpu") == "float32"  # exact portable kernels
    assert kernel_paths.arithmetic_mode("float32", None, "", "gpu") == "tf32"  # XLA's dot at default precision
    assert kernel_paths.arithmetic_mode("float32", None, "", "cpu") == "float32"
    assert kernel_paths.arithmetic_mode("float16", "jbs_bsmm_fprop_sm90", lowered, "gpu") == "float16"
    assert [kernel_paths.path_of(t, "gpu", "ampere") for t in ("jbs_bsmm_bprop_sm90", "jbs_bsmm_bprop", None)] == [
        "hopper",
        "ampere",
        "ampere",
    ]
    assert kernel_paths.path_of("jbs_bsmm_bprop", "cpu", "native") == "native"
    # A Hopper variant: from the call's variant attribute (fprop/bprop), or as requested
    # (updat, whose workspace is its variant); a variant that did not run is the baseline.
    stacked = lowered.replace("{tf32 = true}", '{tf32 = false, variant = "stacked"}')
    assert kernel_paths.path_of("jbs_bsmm_fprop_sm90", "gpu", "hopper:stacked", stacked) == "hopper:stacked"
    baseline = stacked.replace('"stacked"', '"baseline"')
    assert kernel_paths.path_of("jbs_bsmm_fprop_sm90", "gpu", "hopper:stacked", baseline) == "hopper"
    assert kernel_paths.path_of("jbs_bsmm_updat_sm90", "gpu", "hopper:capped", lowered) == "hopper:capped"


def test_bench_chains_keep_every_product(bsmm):
    """XLA must neither merge nor hoist the products of a chain (the device time relies on it)."""
    timing = _load("_timing")
    import jax
    import jax.numpy as jnp

    import jax_blocksparse as jbs

    if not jbs.has_cpu_kernels():
        pytest.skip("CPU kernels not built: the products are not custom calls")
    with jax.default_device(jax.devices("cpu")[0]), jbs.config.implementation("kernels"):  # CPU HLO everywhere
        layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5, seed=0), 32)
        x = jnp.ones((16, 128))
        w = jnp.ones(layout.w_shape)
        W = jnp.ones((128, 128))
        ops = bsmm._single_ops()
        for op in ("fprop", "bprop", "updat"):
            sparse, dense = ops[op]
            s_args, d_args = bsmm._args(op, x, x, W, w, layout)
            hlo = jax.jit(timing.chained(sparse, 3)).lower(*s_args).compile().as_text()
            assert hlo.count(f'custom_call_target="{jbs.targets.target_name(f"jbs_bsmm_{op}")}"') == 3, op
            hlo = jax.jit(timing.chained(dense, 3)).lower(*d_args).compile().as_text()
            assert hlo.count(" dot(") == 3, op


def test_ncu_driver_problems(tmp_path):
    driver = _load("ncu_driver")
    path = tmp_path / "problems.json"
    meta = driver.main(
        [
            "--size",
            "128",
            "128",
            "16",
            "--block-sizes",
            "32",
            "--dtypes",
            "float32",
            "--impl",
            "auto",
            "--problems",
            str(path),
        ]
    )
    saved = json.loads(path.read_text())
    assert saved["problems"] == meta["problems"]
    assert [(p["op"], p["dtype"], p["block_size"]) for p in saved["problems"]] == [
        ("fprop", "float32", 32),
        ("bprop", "float32", 32),
        ("updat", "float32", 32),
    ]
    assert all(p["nnz"] > 0 and p["index"] == i for i, p in enumerate(saved["problems"]))


def _job(runner, job_id, status, test=None, error=None, memcheck=None, passed=3):
    """A job of tests/gpu/run_isolated.py's JSON."""
    counts = (
        None
        if status in ("died", "timeout", "not-run")
        else dict(tests=passed + (status == "fail"), passed=passed, failed=int(status == "fail"), errors=0, skipped=0)
    )
    return dict(
        id=job_id,
        status=status,
        counts=counts,
        log=f"{runner._slug(job_id)}.log",
        first_failure=dict(test=test, error=error) if test else None,
        sanitizer=dict(status="errors", first_report=memcheck) if memcheck else None,
    )


def test_check_summary_table(tmp_path, capsys):
    summary = _load("check_summary")
    runner = _load_runner()
    out = tmp_path
    (out / "steps.tsv").write_text(
        "build\tpass\t0\t80.2\t150\tbuild.log\n"
        "bench\tpass\t0\t128.5\t170\tbench.log\n"
        "crossover\tpass\t0\t1.5\t20\tcrossover.log\n"
        "gpu-tests\tfail\t1\t70.0\t130\tgpu-tests.log\n"
        "training\tpass\t0\t81.0\t120\ttraining.log\n"
        "suite\ttimeout\t124\t120.0\t120\tsuite.log\n"
    )
    (out / "meta.txt").write_text("date: 2026-11-22T10:00:00Z\ncommit: abc1234\ngpu: NVIDIA H100 80GB HBM3\n")
    fault = "Misaligned shared or local address\nat void jbs::sm90::detail::DsdPackedSm90Kernel<...>+0x5600"
    gpu_jobs = [
        _job(runner, "tests/gpu/test_bsmm_kernels.py::test_layouts", "pass", passed=360),
        _job(
            runner,
            "tests/gpu/test_bsmm_sm90.py::test_tf32_rows",
            "died",
            "tests/gpu/test_bsmm_sm90.py::test_tf32_rows[8-fprop-1]",
            "process killed by SIGABRT: CUDA_ERROR_MISALIGNED_ADDRESS",
            fault,
        ),
        _job(
            runner,
            "tests/gpu/test_bsmm_sm90.py::test_rows",
            "fail",
            "tests/gpu/test_bsmm_sm90.py::test_rows[64-updat-7]",
            "AssertionError: max error 0.5 > 0.01",
        ),
    ]
    suite_jobs = [
        _job(runner, "tests/test_matmul.py", "pass", passed=400),
        _job(runner, "tests/test_lint.py", "not-run"),
    ]
    for name, jobs, complete in (
        ("gpu-tests", gpu_jobs, True),
        ("training", [_job(runner, "x.py -k mlp]", "pass")], True),
        ("suite", suite_jobs, False),
    ):
        (out / f"{name}.json").write_text(json.dumps(dict(jobs=jobs, totals=runner.totals(jobs), complete=complete)))
    rows = [
        dict(
            op=op,
            dtype="bfloat16",
            block_size=bs,
            density=0.1000061,
            path=path,
            target=f"jbs_bsmm_{op}" + ("_sm90" if path == "hopper" else ""),
            mode="bfloat16",
            efficiency=(0.2 if path == "ampere" else 0.4) + i / 100,
            speedup=2.0 + i,
            call_efficiency=0.1,
            roofline_speedup_bound=6.6,
            sparse_s=1e-4,
            dense_s=2e-4,
            dense_path_s=2.5e-4,
            torch_bsr_s=3e-4,
            speedup_vs_torch_bsr=3.0,
        )
        for bs in (64, 128)
        for i, op in enumerate(("fprop", "bprop", "updat"))
        for path in ("ampere", "hopper")
    ]
    rows.append(dict(rows[0], dtype="float32", mode="float32", efficiency=0.05))  # not a headline row
    rows.append(dict(rows[0], density=0.25, efficiency=0.5))  # nor this
    (out / "bench.json").write_text(json.dumps(dict(results=rows, complete=True)))
    (out / "crossovers.json").write_text(json.dumps(dict(format=1, entries=[{}, {}, {}])))
    assert summary.main([str(out)]) == 1  # a step failed
    text = capsys.readouterr().out
    assert "3 jobs: 1 passed, 1 fail, 1 died; tests: 363 passed, 1 failed" in text
    assert "2 jobs: 1 passed, 1 not-run; tests: 400 passed; runner cut short" in text
    assert "14 rows (ampere 8, hopper 6; 14 with torch BSR) bfloat16/float32" in text
    assert "FAILED steps: gpu-tests, suite" in text and "commit: abc1234" in text
    # Every failing test named with its first error line, and memcheck's first report.
    assert (
        "[gpu-tests] died    tests/gpu/test_bsmm_sm90.py::test_tf32_rows[8-fprop-1]: process killed by SIGABRT: "
        "CUDA_ERROR_MISALIGNED_ADDRESS"
    ) in text
    assert "      memcheck: Misaligned shared or local address" in text
    assert "[gpu-tests] fail    tests/gpu/test_bsmm_sm90.py::test_rows[64-updat-7]: AssertionError: max error" in text
    assert "[suite] not run (budget spent): 1 job(s): tests/test_lint.py" in text
    # The headline: per block size, fprop/bprop/updat efficiency and speedup, Ampere then Hopper.
    table = text[text.index("bench, bfloat16, density 0.1") :]
    assert "ampere" in table.splitlines()[1] and "hopper" in table.splitlines()[1]
    headline = [line.split() for line in table.splitlines() if line.strip().startswith(("64 ", "128 "))]
    assert headline[0] == [
        "64",
        "0.20",
        "2.00x",
        "0.21",
        "3.00x",
        "0.22",
        "4.00x",
        "|",
        "0.40",
        "2.00x",
        "0.41",
        "3.00x",
        "0.42",
        "4.00x",
    ]
    assert len(headline) == 2
    saved = json.loads((out / "summary.json").read_text())
    assert saved["passed"] is False
    assert saved["headline"]["rows"][1]["block_size"] == 128
    assert saved["headline"]["rows"][1]["paths"]["hopper"]["fprop"]["efficiency"] == 0.4
    assert saved["headline"]["rows"][1]["paths"]["hopper"]["fprop"]["target"] == "jbs_bsmm_fprop_sm90"
    assert [f["test"] for f in saved["failures"]] == [
        gpu_jobs[1]["first_failure"]["test"],
        gpu_jobs[2]["first_failure"]["test"],
    ]
    assert saved["not_run"] == {"suite": ["tests/test_lint.py"]}
    assert {s["name"]: s["counts"] for s in saved["steps"]}["crossover"] == "3 entries"


def test_check_summary_reads_a_real_runner_json(tmp_path, capsys):
    """The summary reads what run_isolated.py really writes (a job that dies, one that passes)."""
    _isolated_tree(tmp_path)
    proc = _runner(
        tmp_path,
        "--out",
        "gpu-tests",
        "--json",
        "gpu-tests.json",
        "--sanitizer",
        "",
        "--parallel",
        "2",
        "test_1_killed.py",
        "test_3_passes.py",
        "--",
        "-p",
        "no:cacheprovider",
    )
    proc.communicate(timeout=120)
    (tmp_path / "steps.tsv").write_text("gpu-tests\tfail\t1\t5.0\t130\tgpu-tests.log\n")
    assert _load("check_summary").main([str(tmp_path)]) == 1
    text = capsys.readouterr().out
    assert "2 jobs: 1 passed, 1 died; tests: 3 passed" in text
    assert "[gpu-tests] died    test_1_killed.py::test_killed: process killed by SIGKILL" in text


def _load_runner():
    return load_script("tests/gpu/run_isolated.py")
