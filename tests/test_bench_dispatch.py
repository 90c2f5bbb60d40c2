"""bench/dispatch.py runs and reports what docs/guide/performance.rst's dispatch table holds (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench" / "dispatch.py"


def test_dispatch_bench_writes_its_json(tmp_path):
    module = load_script("bench/dispatch.py")
    out = tmp_path / "dispatch.json"
    module.main(["--calls", "3", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"device", "commit", "date", "jax", "rows"} <= set(result)
    assert [r["op"] for r in result["rows"]] == ["fprop", "bprop", "updat"]
    for row in result["rows"]:
        assert row["ratio_argument"] > 0 and row["ratio_closed_over"] > 0
