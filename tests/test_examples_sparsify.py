"""examples/sparsify.py runs end to end with tiny flags (seconds) and prints its table.

The accuracy and speed claims are the full run's (README, docs/guide/sparsify.rst);
here: the script trains, sparsifies, fine-tunes and trains from scratch, prints the
report (the layers that do not fit, left dense) and one row per model with the
parameter counts the densities imply.
"""

from __future__ import annotations

from helpers import load_script

TINY = ["--steps", "3", "--finetune-steps", "2", "--densities", "0.5", "--width", "8", "--hidden", "16",
        "--block-size", "8", "--time-reps", "2"]


def test_sparsify_example_tiny(capsys):
    rows = load_script("examples/sparsify.py").main(TINY)["rows"]
    out = capsys.readouterr().out
    assert "left dense: input channels 1 not a multiple of block_size 8" in out
    assert "left dense: output features 10 not a multiple of block_size 8" in out
    assert "dense_accuracy=" in out
    assert [(r["model"], r["density"]) for r in rows] == [
        ("dense", 1.0), ("one-shot", 0.5), ("fine-tuned", 0.5), ("from scratch", 0.5)]
    dense, one_shot, tuned, scratch = rows
    # conv1 (1 -> 8) and the head (16 -> 10) stay dense; the other kernels halve, their biases stay.
    kept, kernels, biases = (9 * 8 + 8) + (16 * 10 + 10), 9 * 8 * 16 + 9 * 16 * 16 + 256 * 16, 16 + 16 + 16
    assert dense["params"] == kept + kernels + biases
    assert one_shot["params"] == kept + kernels // 2 + biases
    assert one_shot["params"] == tuned["params"] == scratch["params"]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert one_shot["step_ms"] is None and all(r["step_ms"] > 0 for r in (dense, tuned, scratch))
