"""bench/attention.py runs its quick preset and writes what README's attention table is made of.

No speed is asserted (the machine is shared); the rows must have times and memory for
the block-sparse and the dense step, and the block-sparse step must hold less memory.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "attention.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_attention_bench_writes_its_json(tmp_path):
    out = tmp_path / "attention.json"
    _bench().main(["--preset", "quick", "--seq-lens", "256", "512", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"device", "commit", "date", "config", "results", "timing"} <= set(result) and result["complete"]
    assert [r["seq_len"] for r in result["results"]] == [256, 512]
    for row in result["results"]:
        assert row["sparse_s"] > 0 and row["dense_s"] > 0 and row["sparse_reference_s"] > 0
        assert 0 < row["density"] < 1 and row["speedup_vs_dense"] > 0
        # The block-sparse step's intermediates are smaller than the dense step's (T x T scores).
        assert 0 < row["sparse_memory"]["temp_bytes"] < row["dense_memory"]["temp_bytes"]


def test_attention_bench_skips_dense_past_its_budget(tmp_path):
    out = tmp_path / "attention.json"
    _bench().main(["--preset", "quick", "--seq-lens", "256", "--repeats", "1", "--no-reference",
                   "--dense-budget-gb", "0", "--json", str(out)])
    row = json.loads(out.read_text())["results"][0]
    assert row["dense_s"] is None and "budget" in row["dense_error"] and row["sparse_s"] > 0
