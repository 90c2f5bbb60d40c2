"""What ``impl="auto"`` runs on CUDA: the gate of verified kernels and the crossover table,
checked by cross-lowering for "cuda" on a machine without a GPU.

* :mod:`jax_blocksparse.verified`: the gate's checks and lookups; the shipped gate,
  ``verified_gpu.json``, is the one bench/gpu_results.py computes from the committed GPU
  results (as are the crossover table and README's and the docs' GPU tables).
* bench/_gate.py: which keys a GPU test exercises; a failure or a dead process turns its
  keys off; an unclean sanitizer turns every key off.
* bench/gpu_results.py on a made-up check folder (some tests passing, one failing, one
  process that died): the gate it writes, and the dispatch that follows.
* The choice (ops/_lowering.auto_choice), with a compute capability 9.0 GPU standing in:
  the verified kernel that beats the dense product up to the highest density, the dense
  product above it, the dense product where nothing was measured, an H200 on an H100's
  entries, the reference where nothing is verified.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import kernel_calls, load_script, require_cuda_extension
from jax_blocksparse import crossover, verified
from jax_blocksparse.ops import _lowering, _sm90

ROOT = Path(__file__).resolve().parents[1]
gate_script = load_script("bench/_gate.py")
results_script = load_script("bench/gpu_results.py")


# ---------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------


def _gate(passed, failed=(), cc="9.0"):
    return verified.Gate.from_json(
        {
            "format": 1,
            "devices": [
                {
                    "compute_capability": cc,
                    "passed": passed,
                    "failed": [dict(target=t, mode=m, block_size=b, why=w) for t, m, b, w in failed],
                }
            ],
        }
    )


def test_gate_lookups():
    gate = _gate({"jbs_bsmm_fprop": {"bfloat16": [32, 64]}}, [("jbs_bsmm_fprop", "tf32", 8, "it faulted")])
    assert gate.allows("9.0", "jbs_bsmm_fprop", "bfloat16", 64)
    assert not gate.allows("9.0", "jbs_bsmm_fprop", "bfloat16", 16)
    assert not gate.allows("9.0", "jbs_bsmm_fprop", "float16", 64)
    assert not gate.allows(None, "jbs_bsmm_fprop", "bfloat16", 64)
    assert gate.verified_targets("9.0") == {"jbs_bsmm_fprop"} and gate.verified_targets("8.0") == frozenset()
    assert gate.why_not("9.0", "jbs_bsmm_fprop", "tf32", 8) == "it faulted"
    assert "no test exercised it" in gate.why_not("9.0", "jbs_bsmm_bprop", "bfloat16", 64)
    assert "compute capability 8.0" in gate.why_not("8.0", "jbs_bsmm_fprop", "bfloat16", 64)
    assert verified.Gate.from_json(gate.to_json()) == gate


def test_the_report_puts_the_keys_a_target_lost_for_one_reason_on_one_line():
    from jax_blocksparse.__main__ import gate_lines

    failed = [("jbs_bsmm_fprop_sm90:stacked", m, b, "hung") for m in ("bfloat16", "float16") for b in (8, 16)]
    failed.append(("jbs_bsmm_fprop_sm90:stacked", "bfloat16", 64, "faulted"))
    off = [
        line.strip()
        for line in gate_lines(_gate({"jbs_bsmm_fprop": {"bfloat16": [64]}}, failed), None)
        if "off:" in line
    ]
    assert off == [
        "off: jbs_bsmm_fprop_sm90:stacked bfloat16 8/16; float16 8/16: hung",
        "off: jbs_bsmm_fprop_sm90:stacked bfloat16 64: faulted",
    ]


@pytest.mark.parametrize(
    "data, match",
    [
        ({"format": 2}, "format 1"),
        ({"format": 1, "devices": [{"compute_capability": 9}]}, "compute_capability"),
        ({"format": 1, "devices": [{"compute_capability": "9.0", "passed": {"t": {"fp8": [8]}}}]}, "mode"),
        ({"format": 1, "devices": [{"compute_capability": "9.0"}, {"compute_capability": "9.0"}]}, "one entry"),
    ],
)
def test_bad_gates_raise(data, match):
    with pytest.raises(ValueError, match=match):
        verified.Gate.from_json(data)


def test_shipped_gate_crossovers_and_tables_match_the_committed_results():
    # bench/gpu_results.py writes them from bench/results/ only: never by hand.
    assert results_script.main(["--check"]) == 0


def test_shipped_gate_on_compute_capability_9():
    # The newest check there (an H200): every baseline key verified; the "stacked" variant
    # passed its tests but faulted (block 64) and hung (blocks 16, 32) in the bench at
    # 8192^3, so it is off in every op; "capped" is on where it runs.
    device = verified.default_gate().device("9.0")
    assert device is not None and device.sanitizer == "clean"
    for op in ("fprop", "bprop", "updat"):
        for mode in ("bfloat16", "float16", "float32", "tf32"):
            assert device.passed[f"jbs_bsmm_{op}_sm90"][mode] == jbs.SUPPORTED_BLOCK_SIZES
        for mode in ("bfloat16", "float16", "float32"):
            assert device.passed[f"jbs_bsmm_{op}"][mode] == jbs.SUPPORTED_BLOCK_SIZES
    assert device.failed and all(key[0].endswith(":stacked") for key, _ in device.failed)
    assert not any(target.endswith(":stacked") for target in device.passed)
    assert device.passed["jbs_bsmm_updat_sm90:capped"]["bfloat16"] == jbs.SUPPORTED_BLOCK_SIZES


# ---------------------------------------------------------------------------------
# bench/_gate.py: tests -> keys
# ---------------------------------------------------------------------------------


def test_keys_of_a_test():
    keys = gate_script.keys_of(
        "tests/gpu/test_bsmm_kernels.py::test_layouts[bf16-8-fprop-random]",
        {"dtype": "bf16", "bs": 8, "op": "fprop", "kind": "random"},
    )
    assert keys == [("jbs_bsmm_fprop", "bfloat16", 8)]
    tf32 = gate_script.keys_of(
        "tests/gpu/test_bsmm_sm90.py::test_tf32_rows[8-bprop-1]", {"bs": 8, "op": "bprop", "n": 1}
    )
    assert tf32 == [("jbs_bsmm_bprop_sm90", "tf32", 8), ("jbs_bsmm_bprop_sm90", "float32", 8)]
    # No parameter: every op, mode and block size of the path (a failure turns off more).
    bare = gate_script.keys_of("tests/gpu/test_bsmm_sm90.py::test_updat_split_is_deterministic", {})
    assert len(bare) == 3 * 4 * len(jbs.SUPPORTED_BLOCK_SIZES)
    assert gate_script.keys_of("tests/test_matmul.py::test_x", {}) == []
    # A Hopper variant's test exercises that variant's own key; the baseline's keys stay plain.
    stacked = gate_script.keys_of(
        "tests/gpu/test_bsmm_sm90.py::test_variant_small_blocks[bf16-16-fprop-random-stacked]",
        {"dtype": "bf16", "bs": 16, "op": "fprop", "kind": "random", "variant": "stacked"},
    )
    assert stacked == [("jbs_bsmm_fprop_sm90:stacked", "bfloat16", 16)]
    baseline = gate_script.keys_of(
        "tests/gpu/test_bsmm_sm90.py::t[x]", {"bs": 16, "op": "fprop", "variant": "baseline"}
    )
    assert {k[0] for k in baseline} == {"jbs_bsmm_fprop_sm90"}


def test_key_results():
    tests = {
        "tests/gpu/test_bsmm_kernels.py::test_a[bf16-8-fprop]": dict(
            outcome="passed", params={"dtype": "bf16", "bs": 8, "op": "fprop"}
        ),
        "tests/gpu/test_bsmm_kernels.py::test_a[bf16-16-fprop]": dict(
            outcome="passed", params={"dtype": "bf16", "bs": 16, "op": "fprop"}
        ),
        "tests/gpu/test_bsmm_kernels.py::test_b[bf16-16-fprop]": dict(
            outcome="failed", params={"dtype": "bf16", "bs": 16, "op": "fprop"}
        ),
        "tests/gpu/test_bsmm_kernels.py::test_a[bf16-32-fprop]": dict(
            outcome="skipped", params={"dtype": "bf16", "bs": 32, "op": "fprop"}
        ),
    }
    passed, failed = gate_script.key_results(tests, sanitizer_ok=True)
    assert passed == {"jbs_bsmm_fprop": {"bfloat16": [8]}}
    assert failed == {("jbs_bsmm_fprop", "bfloat16", 16): "test_b[bf16-16-fprop] failed"}
    passed, failed = gate_script.key_results(tests, sanitizer_ok=False, sanitizer_why="memcheck: 2 errors")
    assert passed == {} and failed[("jbs_bsmm_fprop", "bfloat16", 8)] == "memcheck: 2 errors"


def _sm90_test(bs, variant, dtype="bf16"):
    name = f"tests/gpu/test_bsmm_sm90.py::test_variants[{dtype}-{bs}-fprop-{variant}]"
    return name, dict(outcome="passed", params={"dtype": dtype, "bs": bs, "op": "fprop", "variant": variant})


def test_a_bench_fault_turns_its_key_off_and_a_variant_everywhere():
    tests = dict(
        _sm90_test(bs, variant, dtype)
        for bs in (32, 64)
        for variant in ("baseline", "stacked")
        for dtype in ("bf16", "f16")
    )
    bprop = "tests/gpu/test_bsmm_sm90.py::test_variants[bf16-32-bprop-stacked]"
    tests[bprop] = dict(outcome="passed", params={"dtype": "bf16", "bs": 32, "op": "bprop", "variant": "stacked"})
    fault = dict(
        op="fprop",
        dtype="bfloat16",
        block_size=64,
        requested_density=0.1,
        path="hopper:stacked",
        size=[8192, 8192, 8192],
        why="error: CUDA_ERROR_LAUNCH_FAILED",
    )
    hang = dict(fault, path="hopper", block_size=32, why="killed or died while measuring it")
    passed, failed = gate_script.key_results(tests, sanitizer_ok=True, bench_faults=[fault])
    # The variant is off in every op, mode and block size its tests passed; the baseline stays.
    assert "jbs_bsmm_fprop_sm90:stacked" not in passed and "jbs_bsmm_bprop_sm90:stacked" not in passed
    assert "the variant failed in the bench" in failed[("jbs_bsmm_bprop_sm90:stacked", "bfloat16", 32)]
    assert passed["jbs_bsmm_fprop_sm90"] == {"bfloat16": [32, 64], "float16": [32, 64]}
    assert failed[("jbs_bsmm_fprop_sm90:stacked", "bfloat16", 64)].startswith(
        "bench at 8192x8192x8192, density 0.1: error: CUDA_ERROR_LAUNCH_FAILED"
    )
    assert "the variant failed in the bench" in failed[("jbs_bsmm_fprop_sm90:stacked", "float16", 32)]
    # A baseline key's fault (a hang) turns that key alone off.
    passed, failed = gate_script.key_results(tests, sanitizer_ok=True, bench_faults=[hang])
    assert passed["jbs_bsmm_fprop_sm90"] == {"bfloat16": [64], "float16": [32, 64]}
    assert "killed or died" in failed[("jbs_bsmm_fprop_sm90", "bfloat16", 32)]
    assert passed["jbs_bsmm_fprop_sm90:stacked"]["bfloat16"] == [32, 64]
    assert passed["jbs_bsmm_bprop_sm90:stacked"] == {"bfloat16": [32]}
    # Float32 on the Hopper targets is benched as TF32; an error row names its own mode.
    assert gate_script.bench_key(dict(fault, dtype="float32", path="hopper")) == ("jbs_bsmm_fprop_sm90", "tf32", 64)
    assert gate_script.bench_key(dict(fault, dtype="float32", path="ampere")) == ("jbs_bsmm_fprop", "float32", 64)
    assert gate_script.bench_key(dict(fault, dtype="float32", path="hopper", mode="float32"))[1] == "float32"


def _bench_report(rows, **fields):
    """A bench/bsmm.py report of bf16 fprop at block 32, densities 0.1 and 0.5, on the
    ampere, hopper and hopper:stacked paths."""
    config = dict(dtypes=["bfloat16"], block_sizes=[32], densities=[0.1, 0.5], ops=["fprop"])
    report = dict(config=config, size=dict(C=1024, K=1024, N=1024), paths=["ampere", "hopper", "hopper:stacked"])
    report["results"] = [
        dict(
            op="fprop",
            dtype="bfloat16",
            block_size=32,
            density=d,
            requested_density=d,
            path=path,
            requested_path=path,
            size=[1024, 1024, 1024],
            mode="bfloat16",
            error=None,
        )
        for d, path in rows
    ]
    return {**report, "complete": False, "stopped": None, **fields}


def test_the_faults_of_a_bench_report():
    faults_of = load_script("bench/_bsmm_report.py").faults_of
    done = [(0.1, "ampere"), (0.1, "hopper")]
    # Killed in a hang: the path it was in (saved before it started) is named.
    flight = dict(op="fprop", dtype="bfloat16", bs=32, density=0.1, path="hopper:stacked")
    (fault,) = faults_of(_bench_report(done, in_flight=flight))
    assert (fault["path"], fault["block_size"], fault["requested_density"]) == ("hopper:stacked", 32, 0.1)
    assert fault["why"].startswith("killed") and fault["size"] == [1024, 1024, 1024]
    assert faults_of(_bench_report(done, in_flight=None)) == []  # killed between paths: nothing to blame
    # A report written before in_flight: the first planned path missing from a product
    # that has rows; a kill in a product with none (its dense timing) blames no kernel.
    (fault,) = faults_of(_bench_report(done))
    assert fault["path"] == "hopper:stacked" and fault["requested_density"] == 0.1
    assert faults_of(_bench_report(done + [(0.1, "hopper:stacked")])) == []
    # Finished or stopped for a reason of its own: error rows and earlier faults only.
    errored = _bench_report(done, complete=True)
    errored["results"][1]["error"] = "JaxRuntimeError: CUDA_ERROR_LAUNCH_FAILED"
    earlier = dict(fault, why="killed or died while measuring it")
    errored["faults"] = [earlier]
    errored["results"][0].update(error="XlaRuntimeError: RESOURCE_EXHAUSTED", shared_error=True)  # the dense dot's
    found = faults_of(errored)
    assert [f["path"] for f in found] == ["hopper", "hopper:stacked"] and found[0]["row"] is True
    assert found[0]["why"] == "error: JaxRuntimeError: CUDA_ERROR_LAUNCH_FAILED"


# ---------------------------------------------------------------------------------
# bench/gpu_results.py on a made-up check folder
# ---------------------------------------------------------------------------------

_PASS = '<testcase classname="tests.gpu.{mod}" name="{name}" time="0.1" />'
_FAIL = (
    '<testcase classname="tests.gpu.{mod}" name="{name}" time="0.1">'
    '<failure message="AssertionError: off">x</failure></testcase>'
)


def _check_folder(tmp_path) -> Path:
    """A check folder as tests/gpu/check.sh leaves it: bf16 fprop on both paths passes at
    every block size but the Hopper one at 64 (a test failed); bprop's Hopper job died at
    block 128; a complete bench sweep of the Hopper fprop at block 128."""
    out = tmp_path / "check"
    tests = out / "gpu-tests"
    tests.mkdir(parents=True)
    (out / "steps.tsv").write_text(
        "preflight\tpass\t0\t5\t40\tpreflight.log\nsanitizer\tpass\t0\t40\t60\tsanitizer.log\n"
    )
    (out / "meta.txt").write_text("date: 2026-11-26T11:00:00Z\ncommit: abc1234\n")
    (out / "preflight.json").write_text(
        json.dumps({"gpu": {"present": True, "name": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0", "driver": "580"}})
    )
    cases_k = [
        _PASS.format(mod="test_bsmm_kernels", name=f"test_layouts[bf16-{bs}-fprop-random]")
        for bs in jbs.SUPPORTED_BLOCK_SIZES
    ]
    cases_h = [
        (_FAIL if bs == 64 else _PASS).format(mod="test_bsmm_sm90", name=f"test_layouts[bf16-{bs}-fprop-random]")
        for bs in jbs.SUPPORTED_BLOCK_SIZES
    ]
    (tests / "k.xml").write_text(f"<testsuites><testsuite>{''.join(cases_k)}</testsuite></testsuites>")
    (tests / "h.xml").write_text(f"<testsuites><testsuite>{''.join(cases_h)}</testsuite></testsuites>")
    died = {
        "status": "died",
        "first_failure": {
            "test": "tests/gpu/test_bsmm_sm90.py::test_layouts[bf16-128-bprop-random]",
            "error": "SIGSEGV",
        },
    }
    (out / "gpu-tests.json").write_text(json.dumps({"jobs": [died]}))
    bench = out / "bench"
    bench.mkdir()
    rows = [
        dict(
            op="fprop",
            dtype="bfloat16",
            block_size=128,
            density=d,
            requested_density=d,
            target="jbs_bsmm_fprop_sm90",
            mode="bfloat16",
            path="hopper",
            sparse_s=0.1 + d,
            dense_s=0.6,
            size=[1024, 1024, 1024],
            efficiency=0.5,
            speedup=1.0,
        )
        for d in (0.1, 0.5, 1.0)
    ]
    report = dict(
        device_kind="NVIDIA H100 80GB HBM3",
        platform="gpu",
        config={"densities": [0.1, 0.5, 1.0]},
        results=rows,
        complete=True,
        bandwidth_Bps=3e12,
    )
    (bench / "bench-bf16-b128.json").write_text(json.dumps(report))
    return out


def test_gpu_results_of_a_made_up_check(tmp_path, monkeypatch):
    folder = _check_folder(tmp_path)
    params = {
        f"tests/gpu/{mod}.py::test_layouts[bf16-{bs}-{op}-random]": {
            "dtype": "bf16",
            "bs": bs,
            "op": op,
            "kind": "random",
        }
        for mod in ("test_bsmm_kernels", "test_bsmm_sm90")
        for bs in jbs.SUPPORTED_BLOCK_SIZES
        for op in ("fprop", "bprop")
    }
    monkeypatch.setattr(results_script._gate, "collect_params", lambda: params)
    report = results_script.results_of([folder], "abc1234")
    assert report["compute_capability"] == "9.0" and report["commit"] == "abc1234" and report["date"] == "2026-11-26"
    assert report["sanitizer"]["status"] == "clean" and len(report["results"]) == 3
    entry = results_script.gate_entry(report, "bench/results/gpu-h100-2026-11-26.json")
    gate = verified.Gate.from_json({"format": 1, "devices": [entry]})
    assert gate.allows("9.0", "jbs_bsmm_fprop", "bfloat16", 64)
    assert gate.allows("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 128)
    assert not gate.allows("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 64)  # its test failed
    assert "failed" in gate.why_not("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 64)
    assert not gate.allows("9.0", "jbs_bsmm_bprop_sm90", "bfloat16", 128)  # its process died
    assert "died" in gate.why_not("9.0", "jbs_bsmm_bprop_sm90", "bfloat16", 128)
    # The dispatch that follows, on a 9.0 GPU with that gate: the Hopper kernel where it
    # passed, the portable one where the Hopper one failed.
    require_cuda_extension()
    if not _sm90.built_targets():
        pytest.skip("the extension was built without sm_90a")
    monkeypatch.setattr(verified, "default_gate", lambda: gate)
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    table = crossover.CrossoverTable.from_entries(
        [
            _entry("jbs_bsmm_fprop_sm90", 128, 0.5),
            _entry("jbs_bsmm_fprop_sm90", 64, 0.5),
            _entry("jbs_bsmm_fprop", 64, 0.3),
        ]
    )
    assert _auto("fprop", 128, 0.25, table) == {"jbs_bsmm_fprop_sm90"}
    assert _auto("fprop", 64, 0.25, table) == {"jbs_bsmm_fprop"}


def test_gpu_results_of_two_calls_a_sanitizer_rerun_and_a_hang_in_the_bench(tmp_path, monkeypatch):
    # The first call's sanitizer ran out of time and its bench hung in the Hopper fprop at
    # block 32; a second call reran the sanitizer clean and the bench item without a fault.
    first = _check_folder(tmp_path / "1")
    steps = (first / "steps.tsv").read_text().replace("sanitizer\tpass", "sanitizer\ttimeout")
    (first / "steps.tsv").write_text(steps)
    hung = _bench_report(
        [(0.1, "ampere")], in_flight=dict(op="fprop", dtype="bfloat16", bs=32, density=0.1, path="hopper")
    )
    (first / "bench" / "bench-bf16-b32.json").write_text(json.dumps(dict(hung, device_kind="NVIDIA H200")))
    second = tmp_path / "2"
    (second / "bench").mkdir(parents=True)
    (second / "steps.tsv").write_text("sanitizer\tpass\t0\t40\t60\tsanitizer.log\n")
    rerun = _bench_report([(0.1, "ampere"), (0.5, "ampere"), (0.5, "hopper")], complete=True, in_flight=None)
    (second / "bench" / "bench-bf16-b32.json").write_text(json.dumps(dict(rerun, device_kind="NVIDIA H200")))
    params = {
        f"tests/gpu/{mod}.py::test_layouts[bf16-{bs}-{op}-random]": {"dtype": "bf16", "bs": bs, "op": op}
        for mod in ("test_bsmm_kernels", "test_bsmm_sm90")
        for bs in jbs.SUPPORTED_BLOCK_SIZES
        for op in ("fprop", "bprop")
    }
    monkeypatch.setattr(results_script._gate, "collect_params", lambda: params)
    assert results_script.sanitizer_of([first])[0] == "errors"  # cut short, alone
    report = results_script.results_of([first, second], "abc1234")
    assert report["sanitizer"]["status"] == "clean"
    assert len([r for r in report["results"] if r["item"] == "bf16-b32"]) == 3  # the rerun, with the most rows
    assert [(f["path"], f["block_size"], f["item"]) for f in report["bench_faults"]] == [("hopper", 32, "bf16-b32")]
    gate = verified.Gate.from_json({"format": 1, "devices": [results_script.gate_entry(report, "x.json")]})
    assert not gate.allows("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 32)
    assert "killed or died while measuring it" in gate.why_not("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 32)
    assert gate.allows("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 16)
    assert gate.allows("9.0", "jbs_bsmm_fprop", "bfloat16", 32)


# ---------------------------------------------------------------------------------
# The choice on a compute capability 9.0 GPU (cross-lowered)
# ---------------------------------------------------------------------------------


def _entry(target, bs, value, mode="bfloat16", kind="NVIDIA H100 80GB HBM3", family="9.0"):
    return dict(
        platform="cuda", device_kind=kind, target=target, mode=mode, block_size=bs, crossover=value, family=family
    )


def _auto(op, bs, density, table, dtype=jnp.bfloat16, precision=None):
    """The kernels "auto" calls for one product at this block density (empty: dense or the reference)."""
    grid = (8, 8)
    mask = np.zeros(grid, bool)
    mask.flat[: max(1, round(density * mask.size))] = True
    lay = jbs.Layout.from_mask(mask, bs)
    x = jnp.zeros((16, grid[0] * bs), dtype)
    dy = jnp.zeros((16, grid[1] * bs), dtype)
    w = jnp.zeros(lay.w_shape, dtype)
    fun = {
        "fprop": lambda: jbs.bsmm(x, w, lay, precision=precision),
        "bprop": lambda: jbs.bsmm(dy, w, lay, transpose=True, precision=precision),
        "updat": lambda: jbs.bsmm_updat(x, dy, lay, precision=precision),
    }[op]
    with jbs.config.implementation("auto"), crossover.use_table(table):
        text = jax.jit(fun).trace().lower(lowering_platforms=("cuda",)).as_text()
    return kernel_calls(text)


@pytest.fixture
def h100(monkeypatch):
    """A compute capability 9.0 GPU at lowering time, the shipped gate in force."""
    require_cuda_extension()
    if not _sm90.built_targets():
        pytest.skip("the extension was built without sm_90a")
    monkeypatch.delenv(_sm90.HOPPER_ENV, raising=False)
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    monkeypatch.setattr(
        _lowering, "device_kind", lambda platform: "NVIDIA H100 80GB HBM3" if platform == "cuda" else "cpu"
    )


def test_auto_takes_the_kernel_that_wins_furthest_then_dense(h100):
    table = crossover.CrossoverTable.from_entries(
        [
            _entry("jbs_bsmm_fprop_sm90", 128, 0.6),
            _entry("jbs_bsmm_fprop", 128, 0.3),
            _entry("jbs_bsmm_fprop_sm90", 32, 0.08),
            _entry("jbs_bsmm_fprop", 32, 0.1),
        ]
    )
    assert _auto("fprop", 128, 0.25, table) == {"jbs_bsmm_fprop_sm90"}
    assert _auto("fprop", 128, 0.75, table) == set()  # above every crossover: the dense product
    assert _auto("fprop", 32, 0.0625, table) == {"jbs_bsmm_fprop"}  # the portable kernel wins further there


def test_auto_is_dense_where_nothing_was_measured_on_a_verified_gpu(h100):
    assert crossover.UNMEASURED["cuda"] == 0.0
    assert _auto("fprop", 128, 0.0625, crossover.CrossoverTable()) == set()


def test_an_h200_uses_the_h100_entries(h100, monkeypatch):
    monkeypatch.setattr(_lowering, "device_kind", lambda platform: "NVIDIA H200")
    table = crossover.CrossoverTable.from_entries([_entry("jbs_bsmm_updat_sm90", 64, 0.5)])
    assert _auto("updat", 64, 0.25, table) == {"jbs_bsmm_updat_sm90"}
    # Another compute capability shares nothing.
    table = crossover.CrossoverTable.from_entries([_entry("jbs_bsmm_updat_sm90", 64, 0.5, family="8.0")])
    assert _auto("updat", 64, 0.25, table) == set()


def test_the_shipped_table_on_the_h100(h100):
    shipped = crossover.default_table()
    assert _auto("fprop", 128, 0.0625, shipped) == {"jbs_bsmm_fprop_sm90"}
    assert _auto("updat", 64, 0.0625, shipped) == {"jbs_bsmm_updat_sm90"}
    assert _auto("fprop", 128, 1.0, shipped) == set()  # dense: no kernel wins at density 1
    assert _auto("fprop", 8, 0.0625, shipped) == set()  # block 8: slower than dense at every density
    assert _auto("fprop", 64, 0.0625, shipped, dtype=jnp.float32, precision="default") == {
        "jbs_bsmm_fprop_sm90"
    }  # TF32
    # Exact float32 (HIGHEST): no sm_90 measurement; the portable kernel loses to TF32 dense above 0.05.
    assert _auto("fprop", 64, 0.0625, shipped, dtype=jnp.float32, precision="highest") == set()


def test_nothing_verified_for_this_gpu_means_the_reference(h100, monkeypatch):
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "8.0")
    table = crossover.CrossoverTable.from_entries([_entry("jbs_bsmm_fprop", 128, 1.0, family="8.0")])
    assert _auto("fprop", 128, 0.25, table) == set()
    assert "not verified on compute capability 8.0" in jbs.ops.paths.describe_path("cuda", "auto")


def test_the_report_names_the_gate(h100):
    line = jbs.ops.paths.describe_path("cuda", "auto")
    assert "verified on compute capability 9.0" in line and verified.default_gate().device("9.0").source in line
