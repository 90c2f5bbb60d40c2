"""bench/cpu_bf16.py and bench/cpu_bf16_conv.py: tiny runs write their JSON (no timing asserted)."""

from __future__ import annotations

import json

import pytest

import jax_blocksparse as jbs
from helpers import load_script, require_kernels


def _has_amx() -> bool:
    return jbs.extension_info()["cpu_isa_detected"] == "amx"


def test_conv_bench_tiny_run(tmp_path, capsys):
    require_kernels("cpu")
    out = tmp_path / "conv.json"
    argv = ["--shapes", "2x8x32", "--blocks", "16", "--densities", "1", "0.5", "--repeats", "1", "--out", str(out)]
    assert load_script("bench/cpu_bf16_conv.py").main(argv) == 0
    if not _has_amx():
        assert "no AMX tiles to compare" in capsys.readouterr().out and not out.exists()
        return
    report = json.loads(out.read_text())
    assert report["benchmark"] == "cpu_bf16_conv" and report["cpu_isa_detected"] == "amx"
    (shape,) = report["shapes"]
    assert (shape["batch"], shape["map"], shape["channels"]) == (2, 8, 32)
    assert [(r["block_size"], r["density"]) for r in shape["rows"]] == [(16, 1.0), (16, 0.5)]
    for row in shape["rows"]:
        for op in ("conv", "dx", "dw"):
            assert row[f"{op}_amx_ms"] > 0 and row[f"{op}_{report['widening_isa']}_ms"] > 0


def test_conv_bench_rejects_a_bad_shape(capsys):
    with pytest.raises(SystemExit):
        load_script("bench/cpu_bf16_conv.py").main(["--shapes", "8x32"])
    assert "BATCHxMAPxCHANNELS" in capsys.readouterr().err


def test_bsmm_bench_tiny_run(tmp_path):
    require_kernels("cpu")
    out = tmp_path / "bsmm.json"
    argv = ["--sizes", "64", "--blocks", "16", "--densities", "1", "--repeats", "1", "--out", str(out)]
    assert load_script("bench/cpu_bf16.py").main(argv) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "cpu_bf16" and [s["n"] for s in report["sizes"]] == [64]
