"""bench/attention.py runs its quick preset and writes what the attention tables are made of.

No speed is asserted (the machine is shared); every case (training step, grouped-query
step, packed documents, decoding) must have rows with times for the block-sparse and
the dense attention, and the block-sparse steps must hold less memory.
"""

from __future__ import annotations

import json

from helpers import load_script


def test_attention_bench_writes_its_json(tmp_path):
    out = tmp_path / "attention.json"
    load_script("bench/attention.py").main(["--preset", "quick", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"device", "commit", "date", "config", "results", "timing"} <= set(result) and result["complete"]
    rows = result["results"]
    assert [(r["case"], r["seq_len"]) for r in rows] == [
        ("step", 256),
        ("step", 512),
        ("gqa", 256),
        ("packed", 256),
        ("decode", 512),
    ]
    for row in rows:
        assert row["sparse_s"] > 0 and row["dense_s"] > 0 and row["speedup_vs_dense"] > 0, row
        assert 0 < row["density"] < 1
    for row in rows[:4]:  # the steps: the block-sparse intermediates are smaller than the T x T scores
        assert 0 < row["sparse_memory"]["temp_bytes"] < row["dense_memory"]["temp_bytes"], row
    assert rows[0]["sparse_reference_s"] > 0 and rows[2]["kv_heads"] == 1
    assert rows[3]["capacity"] >= 1 and rows[4]["row_blocks"] >= 1


def test_attention_bench_skips_dense_past_its_budget(tmp_path):
    out = tmp_path / "attention.json"
    load_script("bench/attention.py").main(
        [
            "--preset",
            "quick",
            "--cases",
            "step",
            "--seq-lens",
            "256",
            "--repeats",
            "1",
            "--no-reference",
            "--dense-budget-gb",
            "0",
            "--json",
            str(out),
        ]
    )
    row = json.loads(out.read_text())["results"][0]
    assert row["dense_s"] is None and "budget" in row["dense_error"] and row["sparse_s"] > 0
