"""examples/char_transformer.py runs end to end with tiny flags (seconds) and reports both models.

The quality and speed claims are the full run's (README); here: the script trains both
attention kinds, with equal parameter counts, prints its summary line, and skips a dense
model over the memory budget instead of training it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "char_transformer.py"
TINY = ["--steps", "3", "--long-steps", "1", "--block-size", "16", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--batch", "1", "--eval-windows", "2"]


def _example():
    """The example as a module (registered in sys.modules: its flax modules are dataclasses)."""
    name = "examples_char_transformer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def test_char_transformer_tiny(capsys):
    results = _example().main(["--seq-lens", "128", *TINY])
    out = capsys.readouterr().out
    assert "T=128 dense_bpc=" in out and "sparse_bpc=" in out and "sparse_attention_peak_MiB=" in out
    dense, sparse = results[128]["dense"], results[128]["sparse"]
    assert dense["params"] == sparse["params"]
    for row in (dense, sparse):
        assert 0 < row["bpc"] < 8 and row["ms"] > 0 and row["peak"] > 0
    assert sparse["peak"] < dense["peak"]


def test_char_transformer_skips_dense_over_budget(capsys):
    results = _example().main(["--seq-lens", "128", *TINY, "--memory-budget-mb", "0", "--no-time-over-budget"])
    out = capsys.readouterr().out
    assert results[128]["dense"]["bpc"] is None and results[128]["dense"]["ms"] is None
    assert results[128]["sparse"]["bpc"] > 0 and "dense_bpc=skipped" in out
