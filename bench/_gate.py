"""From a GPU check's test results to the gate's keys: which (target, mode, block size)
each GPU test exercises, and which keys passed.

A key is (FFI target, arithmetic mode, block size): ``("jbs_bsmm_fprop_sm90", "tf32", 8)``.
The GPU tests are parametrized by op, dtype and block size; a test exercises

* the targets of its file's kernel path (tests/gpu/test_bsmm_kernels.py and
  test_bsconv_kernels.py: the portable ``jbs_bsmm_*``; test_bsmm_sm90.py: the Hopper
  ``jbs_bsmm_*_sm90``), for its ``op`` parameter or, without one, all three ops;
* the mode of its ``dtype`` (or ``in_dtype``) parameter; without one, every mode its path
  has (the Hopper file's ``test_tf32_*`` functions: "tf32" and the exact "float32" they
  also check at HIGHEST);
* its ``bs`` parameter's block size, or every block size;
* on the Hopper targets, the kernel variant of its ``variant`` parameter
  (``"jbs_bsmm_fprop_sm90:stacked"``: the key of that variant alone, so that a baseline
  test's pass opens no other variant), or the baseline.

Where a test names no parameter, it counts for all of them: the guess errs towards
exercising more, so a failure turns off more, never less. A key passes when at least one
test that exercises it passed and none failed (skipped tests say nothing), the bench
measured every product it ran on that key (a kernel fault or a hang there turns it off,
and every key of a Hopper variant with it: see :func:`key_results`), and the check's
compute-sanitizer run was clean or unavailable on that machine.

The parameters come from pytest's own collection (run on any machine: the GPU tests
collect without a GPU), so results of a check that did not record them can be read too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = ("fprop", "bprop", "updat")
BLOCK_SIZES = tuple(json.loads((ROOT / "jax_blocksparse" / "block_sizes.json").read_text())["block_sizes"])
DTYPE_MODES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
# Test file -> (the targets' suffix: "" portable, "_sm90" Hopper; the modes its path has).
FILES = {
    "tests/gpu/test_bsmm_kernels.py": ("", ("float32", "bfloat16", "float16")),
    "tests/gpu/test_bsconv_kernels.py": ("", ("float32", "bfloat16", "float16")),
    "tests/gpu/test_bsmm_sm90.py": ("_sm90", ("bfloat16", "float16", "float32", "tf32")),
}
GPU_TEST_FILES = tuple(FILES)

# The pytest plugin that collects the parameters (loaded with -p bench_gate_collect).
_PLUGIN = """
import json, os

def _plain(v):
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)

def pytest_collection_finish(session):
    out = {}
    for item in session.items:
        spec = getattr(item, "callspec", None)
        out[item.nodeid] = {k: _plain(v) for k, v in (spec.params if spec else {}).items()}
    with open(os.environ["JBS_GATE_PARAMS"], "w") as f:
        json.dump(out, f)
"""


def collect_params(files=GPU_TEST_FILES) -> dict[str, dict]:
    """node id -> its parametrization (plain values), from ``pytest --collect-only``."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bench_gate_collect.py").write_text(_PLUGIN)
        out = Path(tmp) / "params.json"
        env = dict(os.environ, JBS_GATE_PARAMS=str(out), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [tmp, str(ROOT), env.get("PYTHONPATH")]))
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "bench_gate_collect",
                "-p",
                "no:cacheprovider",
                *files,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if not out.exists():
            raise RuntimeError(
                f"collecting the GPU tests failed (exit {res.returncode}):\n{res.stdout[-2000:]}{res.stderr[-2000:]}"
            )
        return json.loads(out.read_text())


def _target(op: str, suffix: str, variant) -> str:
    """A key's target: ``jbs_bsmm_<op><suffix>`` ("" portable, "_sm90" Hopper), with
    ``:<variant>`` for a Hopper variant other than the baseline."""
    tail = f":{variant}" if suffix and isinstance(variant, str) and variant not in ("", "baseline") else ""
    return f"jbs_bsmm_{op}{suffix}{tail}"


def keys_of(nodeid: str, params: dict) -> list[tuple[str, str, int]]:
    """The keys a GPU test exercises (see the module docstring); [] for a file outside the gate."""
    file, _, name = nodeid.partition("::")
    if file not in FILES:
        return []
    suffix, path_modes = FILES[file]
    ops = [params["op"]] if params.get("op") in OPS else list(OPS)
    dtype = params.get("dtype", params.get("in_dtype"))
    if dtype in DTYPE_MODES:
        modes = [DTYPE_MODES[dtype]]
    elif suffix and name.startswith("test_tf32"):
        modes = ["tf32", "float32"]
    else:
        modes = list(path_modes)
    bs = params.get("bs")
    sizes = [int(bs)] if isinstance(bs, int) or (isinstance(bs, str) and bs.isdigit()) else list(BLOCK_SIZES)
    target = {op: _target(op, suffix, params.get("variant")) for op in ops}
    return [(target[op], mode, size) for op in ops for mode in modes for size in sizes]


def junit_outcomes(folder: Path) -> dict[str, str]:
    """node id -> "passed" / "failed" / "error" / "skipped", from every JUnit XML of a
    run_isolated.py folder (a test that several jobs ran keeps its last word; a failure
    is never overwritten by a later pass)."""
    out: dict[str, str] = {}
    for xml in sorted(folder.glob("*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError:
            continue
        for case in root.iter("testcase"):
            classname, name = case.get("classname", ""), case.get("name", "")
            file = classname.replace(".", "/") + ".py"
            nodeid = f"{file}::{name}"
            outcome = next((t for t in ("failure", "error", "skipped") if case.find(t) is not None), "passed")
            outcome = {"failure": "failed"}.get(outcome, outcome)
            if out.get(nodeid) in ("failed", "error"):
                continue
            out[nodeid] = outcome
    return out


def died_tests(isolated_json: Path) -> dict[str, str]:
    """node id -> why, for each test a job's process died or timed out in."""
    try:
        report = json.loads(isolated_json.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for job in report.get("jobs", []):
        first = job.get("first_failure") or {}
        if job.get("status") in ("died", "timeout") and first.get("test"):
            out[first["test"]] = f"{job['status']}: {first.get('error') or ''}".strip()
    return out


def bench_key(fault: dict) -> tuple[str, str, int]:
    """The key of a bench fault (bench/_bsmm_report.faults_of): its path's target ("ampere"
    the portable ``jbs_bsmm_<op>``, "hopper[:variant]" the ``_sm90`` one with the variant), the
    row's mode where it has one, else its dtype's (float32 on the Hopper targets: "tf32",
    the bench's default precision), and the block size."""
    kernel, _, variant = fault["path"].partition(":")
    hopper = kernel == "hopper"
    mode = fault.get("mode") or ("tf32" if hopper and fault["dtype"] == "float32" else fault["dtype"])
    return _target(fault["op"], "_sm90" if hopper else "", variant), mode, int(fault["block_size"])


def _fault_why(fault: dict) -> str:
    size = "x".join(str(v) for v in fault.get("size") or ())
    return f"bench at {size}, density {fault['requested_density']}: {fault['why'][:160]}"


def key_results(
    tests: dict[str, dict], *, sanitizer_ok: bool, sanitizer_why: str = "", bench_faults=()
) -> tuple[dict, dict]:
    """(passed: target -> mode -> [block sizes], failed: key -> why) from ``tests``
    (node id -> {"outcome", "params"}; outcome "died: ..." for a test a process died in)
    and ``bench_faults`` (bench/_bsmm_report.faults_of's entries: a product the bench could
    not measure, at sizes the tests do not reach). A fault turns its key off; a fault of a
    Hopper variant turns off every key of that variant, in every op (its design failed at
    scale, and the tests of its other keys ran smaller problems: it comes back on when a
    bench at scale measures it)."""
    seen: dict[tuple, list[str]] = {}
    bad: dict[tuple, str] = {}
    for nodeid, test in sorted(tests.items()):
        outcome = test["outcome"]
        for key in keys_of(nodeid, test.get("params") or {}):
            if outcome == "passed":
                seen.setdefault(key, []).append(nodeid)
            elif outcome != "skipped" and key not in bad:
                bad[key] = f"{nodeid.split('::', 1)[1]} {outcome}"
    faulty_variants: dict[str, str] = {}
    for fault in bench_faults:
        key = bench_key(fault)
        bad.setdefault(key, _fault_why(fault))
        _, _, variant = key[0].partition(":")
        if variant:
            faulty_variants.setdefault(
                variant, f"the variant failed in the {_fault_why(fault)} ({key[0]}, {key[1]}, block {key[2]})"
            )
    for key in seen:
        _, _, variant = key[0].partition(":")
        if variant in faulty_variants:
            bad.setdefault(key, faulty_variants[variant])
    passed: dict[str, dict[str, list[int]]] = {}
    failed: dict[tuple, str] = {}
    for key in sorted(set(seen) | set(bad)):
        if key in bad:
            failed[key] = bad[key]
        elif not sanitizer_ok:
            failed[key] = sanitizer_why or "compute-sanitizer did not run clean"
        else:
            target, mode, bs = key
            passed.setdefault(target, {}).setdefault(mode, []).append(bs)
    return passed, failed
