"""examples/char_transformer.py runs end to end with tiny flags (seconds) and reports both models.

The quality and speed claims are the full run's (README); here: the script trains both
attention kinds, with equal parameter counts, prints its summary line, samples text from
the block-sparse model with the key-value cache (whose logits equal the full forward
pass), and skips a dense model over the memory budget instead of training it.
"""

from __future__ import annotations

from helpers import load_script

TINY = ["--steps", "3", "--long-steps", "1", "--block-size", "16", "--d-model", "16", "--heads", "2",
        "--layers", "1", "--batch", "1", "--eval-windows", "2"]


def test_char_transformer_tiny(capsys):
    results = load_script("examples/char_transformer.py").main(["--seq-lens", "128", *TINY, "--sample-chars", "24"])
    out = capsys.readouterr().out
    assert "T=128 dense_bpc=" in out and "sparse_bpc=" in out and "sparse_attention_peak_MiB=" in out
    dense, sparse = results[128]["dense"], results[128]["sparse"]
    assert dense["params"] == sparse["params"]
    for row in (dense, sparse):
        assert 0 < row["bpc"] < 8 and row["ms"] > 0 and row["peak"] > 0
    assert sparse["peak"] < dense["peak"]
    sample = results[128]["sample"]
    assert len(sample["text"]) == 24 and sample["ms_per_char"] > 0 and "T=128 sparse sample" in out
    assert sample["logit_error"] < 1e-4  # decoding with the cache gives the full forward's logits


def test_char_transformer_skips_dense_over_budget(capsys):
    results = load_script("examples/char_transformer.py").main(
        ["--seq-lens", "128", *TINY, "--memory-budget-mb", "0", "--no-time-over-budget", "--sample-chars", "0"])
    out = capsys.readouterr().out
    assert results[128]["dense"]["bpc"] is None and results[128]["dense"]["ms"] is None
    assert results[128]["sparse"]["bpc"] > 0 and "dense_bpc=skipped" in out and "sample" not in results[128]
