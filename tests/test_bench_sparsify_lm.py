"""bench/sparsify_lm.py: a tiny run writes its JSON, one row per model, with the layers each
converted (no timing asserted)."""

from __future__ import annotations

import json

from helpers import load_script


def test_tiny_run_writes_a_row_per_model(tmp_path, capsys):
    out = tmp_path / "lm.json"
    tiny = ["--vocab", "32", "--emb", "32", "--mlp", "64", "--heads", "2", "--seq", "8", "--batch", "2"]
    report = load_script("bench/sparsify_lm.py").main(
        [*tiny, "--block-size", "16", "--density", "0.5", "--steps", "2", "--warmup", "1", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == report
    rows = {r["model"]: r for r in report["rows"]}
    # Two blocks: the MLPs (two Dense each) alone, then with the four attention projections.
    assert [rows[m]["converted"] for m in ("dense", "mlp", "mlp+attention")] == [0, 4, 12]
    assert rows["dense"]["params"] > rows["mlp"]["params"] > rows["mlp+attention"]["params"]
    assert all(r["step_ms"] > 0 and len(r["step_ms_all"]) == 2 for r in rows.values())
    assert report["density"] == 0.5 and report["block_size"] == 16 and report["commit"]
    assert "mlp+attention" in capsys.readouterr().out
