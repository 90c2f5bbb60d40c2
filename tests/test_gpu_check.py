"""tests/gpu/check.sh and its helpers, checked where there is no GPU (CI).

- check.sh: syntax, ``--dry-run`` (every step's exact command, in order, nothing run),
  the compute capability -> arch mapping, and the step runner (a failing step does not
  stop the next; the budget skips steps; the exit status says so).
- bench/ncu_summary.py: ncu's CSV layouts. tests/data/ncu_raw_page_sample.csv and
  ncu_details_page_sample.csv hold the values of three H100 kernels from
  shared/measurements/h100-2026-11-22/ncu_kernels.csv (bf16, block 128, density 0.1)
  laid out as ``ncu --csv --page raw`` (header row, units row, one row per launch) and
  ``--page details`` (one row per launch and metric) print them;
  ncu_kernels_h100_excerpt.csv is the first lines of that file as they are.
- bench/bsmm.py: its quick preset on the CPU, and the JSON it writes; its chains of
  products survive XLA (one product per link).
- bench/check_summary.py: the final table from a made-up OUTDIR.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "gpu" / "check.sh"
SANITIZER = ROOT / "tests" / "gpu" / "run_sanitizer.sh"
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
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def _check(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("CHECK_")}
    full_env.update(env or {})
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=ROOT)


# ---------------------------------------------------------------------------------
# check.sh
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("script", [CHECK, SANITIZER], ids=lambda p: p.name)
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout


def test_dry_run_prints_every_step_in_order_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    res = _check("--dry-run", str(out), env={"CHECK_CUDA_ARCH": "sm_90a", "XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert res.returncode == 0, res.stderr
    assert not out.exists(), "a dry run creates nothing"
    text = res.stdout
    expected = [
        "unset XLA_FLAGS JAX_PLATFORMS JAX_BLOCKSPARSE_IMPL",
        "PYTHONPATH=", "XLA_PYTHON_CLIENT_PREALLOCATE=false", "PYTHONUNBUFFERED=1",
        "python3 build.py --cuda-arch sm_90a -j ",
        "nvidia-smi >>",
        "python3 -m jax_blocksparse >",
        "python3 -m pytest tests/gpu -n 8 ",
        "env JAX_BLOCKSPARSE_IMPL=kernels JBS_REQUIRE_KERNELS=1 python3 -m pytest tests -n 14 ",
        f"bash tests/gpu/run_sanitizer.sh --log-dir {out}",
        "JAX_BLOCKSPARSE_IMPL=kernels python3 bench/bsmm.py --preset check --deadline ",
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
    assert f"--junitxml={out}/pytest_gpu.xml" in text and f"--junitxml={out}/pytest_suite.xml" in text
    assert f"--json {out}/bench.json" in text and f"--json {out}/ncu_summary.json" in text
    steps = [line for line in text.splitlines() if line.startswith("timeout ")]
    assert len(steps) == 8  # build env gpu-tests suite sanitizer bench ncu ncu-summary
    assert all(line.startswith("timeout --kill-after=10 ") for line in steps)
    assert "--xla_dump_to" not in text  # XLA's default settings


@pytest.mark.parametrize("cap, arch", [("9.0", "sm_90a"), ("8.0", "sm_80"), ("8.6", "sm_86"), ("8.9", "sm_89"),
                                       ("10.0", "sm_100")])
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
    res = _check(str(out), env={"CHECK_STEPS": "sanitizer ncu-summary",
                                "COMPUTE_SANITIZER": str(tmp_path / "no-such-sanitizer")})
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
# ncu_summary.py
# ---------------------------------------------------------------------------------

# bf16, block 128, density 0.1 on an H100 (shared/measurements/h100-2026-11-22/ncu_kernels.csv)
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


@pytest.mark.parametrize("name, layout", [("ncu_raw_page_sample.csv", "raw"),
                                          ("ncu_details_page_sample.csv", "details"),
                                          ("ncu_kernels_h100_excerpt.csv", "summary")])
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


@pytest.mark.parametrize("name, expected", [
    ("void jbs::DsdTcKernel<__half, __half, 32, 128, 4, 1, 32, 3, (bool)1>(jbs::DsdParams)", ("bprop", "float16", 32)),
    ("void jbs::DsdTcKernel<__nv_bfloat16, float, 64, 128, 4, 2, 32, 3, false>(jbs::DsdParams)",
     ("fprop", "bfloat16", 64)),
    ("void jbs::DsdF32Kernel<16, 64, 16, 16, 32, 1>(jbs::DsdParams)", ("bprop", "float32", 16)),
    ("void jbs::SddF32Kernel<128, 8, 8, 16>(jbs::SddParams)", ("updat", "float32", 128)),
    ("void jbs::SddTcKernel<__nv_bfloat16, __nv_bfloat16, 8, 8, 1, 1, 32, 3>(jbs::SddParams)",
     ("updat", "bfloat16", 8)),
    ("nvjet_sm90_tss_256x128_64x4_1x2_h_bz_coopA_NNT", (None, None, None)),
])
def test_kernel_names(ncu_summary, name, expected):
    info = ncu_summary.parse_kernel_name(name)
    assert (info["op"], info["dtype"], info["block_size"]) == expected


def test_ncu_summary_cli(ncu_summary, tmp_path, capsys):
    problems = tmp_path / "problems.json"
    problems.write_text(json.dumps(dict(problems=_problems())))
    out = tmp_path / "summary.json"
    missing = tmp_path / "no-such.csv"  # the --log-file may be missing: the next file is read
    rc = ncu_summary.main([str(missing), str(DATA / "ncu_details_page_sample.csv"), "--problems", str(problems),
                           "--json", str(out)])
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


def test_bench_quick_json(bsmm, tmp_path):
    path = tmp_path / "bench.json"
    bsmm.main(["--preset", "quick", "--json", str(path)])
    report = json.loads(path.read_text())
    for field in ("device", "device_kind", "platform", "commit", "date", "datetime", "jax_version", "implementation",
                  "size", "timing", "results"):
        assert field in report, field
    import jax

    assert report["platform"] == jax.devices()[0].platform and report["complete"] is True
    assert report["commit"] and report["date"].count("-") == 2
    assert report["timing"]["chain"] == 2 and "layout" in report["timing"]
    rows = report["results"]
    assert len(rows) == 2 * 3  # densities x ops
    assert {r["op"] for r in rows} == {"fprop", "bprop", "updat"}
    for r in rows:
        for field in ("sparse_s", "dense_s", "sparse_call_s", "dense_call_s", "efficiency", "speedup",
                      "call_efficiency"):
            assert math.isfinite(r[field]) and r[field] > 0, (field, r)
        assert r["efficiency"] == pytest.approx(r["dense_s"] * r["density"] / r["sparse_s"])
        assert r["block_size"] == 32 and r["dtype"] == "float32" and r["nnz"] > 0


def test_bench_deadline_keeps_what_it_has(bsmm, tmp_path):
    path = tmp_path / "bench.json"
    bsmm.main(["--preset", "quick", "--deadline", "0", "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["complete"] is False and "deadline" in report["stopped"] and report["results"] == []


def test_bench_chains_keep_every_product(bsmm):
    """XLA must neither merge nor hoist the products of a chain (the device time relies on it)."""
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
            hlo = jax.jit(bsmm.chained(sparse, 3)).lower(*s_args).compile().as_text()
            assert hlo.count(f'custom_call_target="jbs_bsmm_{op}"') == 3, op
            hlo = jax.jit(bsmm.chained(dense, 3)).lower(*d_args).compile().as_text()
            assert hlo.count(" dot(") == 3, op


def test_ncu_driver_problems(tmp_path):
    driver = _load("ncu_driver")
    path = tmp_path / "problems.json"
    meta = driver.main(["--size", "128", "128", "16", "--block-sizes", "32", "--dtypes", "float32",
                        "--impl", "auto", "--problems", str(path)])
    saved = json.loads(path.read_text())
    assert saved["problems"] == meta["problems"]
    assert [(p["op"], p["dtype"], p["block_size"]) for p in saved["problems"]] == [
        ("fprop", "float32", 32), ("bprop", "float32", 32), ("updat", "float32", 32)]
    assert all(p["nnz"] > 0 and p["index"] == i for i, p in enumerate(saved["problems"]))


def test_check_summary_table(tmp_path, capsys):
    summary = _load("check_summary")
    out = tmp_path
    (out / "steps.tsv").write_text("build\tpass\t0\t15.2\t120\tbuild.log\n"
                                   "gpu-tests\tfail\t1\t48.0\t150\tpytest_gpu.log\n"
                                   "bench\tpass\t0\t99.5\t180\tbench.log\n")
    (out / "meta.txt").write_text("date: 2026-11-22T10:00:00Z\ncommit: abc1234\ngpu: NVIDIA H100 80GB HBM3\n")
    (out / "pytest_gpu.xml").write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="10" failures="2" errors="1" '
        'skipped="3"></testsuite></testsuites>')
    rows = [dict(op=op, dtype="bfloat16", block_size=bs, density=0.1000061, efficiency=0.2 + i / 100, speedup=2.0,
                 call_efficiency=0.1, roofline_speedup_bound=6.6, sparse_s=1e-4, dense_s=2e-4,
                 torch_bsr_s=3e-4, speedup_vs_torch_bsr=3.0)
            for bs in (64, 128) for i, op in enumerate(("fprop", "bprop", "updat"))]
    rows.append(dict(rows[0], dtype="float32", efficiency=0.05))  # not a headline row
    (out / "bench.json").write_text(json.dumps(dict(results=rows, complete=True)))
    assert summary.main([str(out)]) == 1  # a step failed
    text = capsys.readouterr().out
    assert "4 passed, 2 failed, 1 errors, 3 skipped" in text
    assert "7 rows (7 with torch BSR)" in text
    assert "FAILED steps: gpu-tests" in text and "commit: abc1234" in text
    headline = [line.split() for line in text.splitlines() if line.strip().startswith(("64 ", "128 "))]
    assert [h[:4] for h in headline] == [["64", "0.20", "0.21", "0.22"], ["128", "0.20", "0.21", "0.22"]]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["passed"] is False and saved["headline"]["rows"][1]["fprop"]["efficiency"] == 0.2
