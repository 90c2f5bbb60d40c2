"""Every script of examples/ runs end to end here, at a small size (seconds each).

Each example is imported by its path and its ``main`` called with the flags of a quick
run; the test checks what the script reports (its printed summary and the values it
returns), not the quality or speed claims of a full run (README and docs/guide state
those, measured with the default flags). :func:`test_every_example_is_run` keeps the
list complete: a new example needs a test here.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

import jax
import pytest

from helpers import cpu_devices, load_script

ROOT = Path(__file__).resolve().parents[1]

#: The examples this file runs, one test each (or more).
RUN_HERE = (
    "char_lstm.py",
    "char_moe.py",
    "char_transformer.py",
    "data_parallel.py",
    "quickstart.py",
    "resnet.py",
    "sparse_training.py",
    "sparsify.py",
)


def test_every_example_is_run():
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(RUN_HERE)


def test_quickstart(capsys):
    result = load_script("examples/quickstart.py").main(["--steps", "20", "--bench-size", "256", "--bench-reps", "1"])
    out = capsys.readouterr().out
    assert "max |bsmm(x, w) - x @ W|" in out and "bsmm path: " in out
    assert [row["density"] for row in result["bench"]] == [1.0, 0.5, 0.25, 0.1, 0.05]
    assert all(row["dense_ms"] > 0 and row["sparse_ms"] > 0 for row in result["bench"])
    assert out.strip().splitlines()[-1] == f"test_accuracy={result['test_accuracy']:.4f}"
    assert result["test_accuracy"] > 0.5  # 20 adam steps on digits: well above chance (0.1)


def test_resnet(capsys):
    results = load_script("examples/resnet.py").main(
        ["--epochs", "1", "--width", "8", "--block-size", "8", "--batch-size", "128"]
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert set(results) == {"dense", "sparse"}
    for name, line in zip(("dense", "sparse"), lines[-2:]):
        r = results[name]
        assert line == f"{name}: params={r['params']} step_ms={r['step_ms']:.2f} test_accuracy={r['test_accuracy']:.4f}"
        assert r["params"] > 0 and 0.0 <= r["test_accuracy"] <= 1.0
    # Equal parameter budgets by construction: the sparse model is deeper at half the blocks.
    assert 0.5 < results["sparse"]["params"] / results["dense"]["params"] < 2.0


def test_char_lstm(capsys):
    result = load_script("examples/char_lstm.py").main(
        [
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--embed",
            "8",
            "--block-size",
            "8",
            "--dense-hidden",
            "16",
            "--sparse-hidden",
            "32",
            "--eval-windows",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"dense_bpc={result['dense_bpc']:.3f} sparse_bpc={result['sparse_bpc']:.3f}"
    for key in ("dense_bpc", "sparse_bpc"):
        assert 0 < result[key] < 8, result  # untrained: about log2(vocabulary) bits per character
    assert result["dense_params"] > 0 and result["sparse_params"] > 0


def test_data_parallel_on_8_devices_equals_one(capsys, monkeypatch):
    # The example trains on the default backend's local devices (jax.local_devices()):
    # here those are the CPU backend's 8 (conftest), also on a machine whose default is a GPU.
    cpus = cpu_devices(8)
    monkeypatch.setattr(jax, "local_devices", lambda *args, **kwargs: list(cpus))
    monkeypatch.setattr(jax, "local_device_count", lambda *args, **kwargs: len(cpus))
    results = load_script("examples/data_parallel.py").main(["--steps", "4", "--batch-size", "64", "--hidden", "64"])
    out = capsys.readouterr().out
    assert list(results) == ["single", "pmap", "shard_map", "jit"] and "bsmm path: " in out
    assert results["single"]["devices"] == 1
    for mode in ("pmap", "shard_map", "jit"):
        assert results[mode]["devices"] == 8
        # The same training up to float32 summation order: params of magnitude ~0.1 after 4 steps.
        assert results[mode]["max_difference"] < 1e-5, (mode, results[mode])
        assert math.isclose(results[mode]["loss"], results["single"]["loss"], rel_tol=1e-5)


def test_sparse_training(capsys):
    result = load_script("examples/sparse_training.py").main(
        ["--method", "set", "--density", "0.3", "--epochs", "2", "--quiet", "--log"]
    )
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] == f"test_accuracy={result['test_accuracy']:.4f}"
    assert "layer2/kernel" in out and result["final_density"] == pytest.approx(0.3, abs=0.01)
    assert result["test_accuracy"] > 0.8


def test_sparse_training_json(capsys, tmp_path):
    script = load_script("examples/sparse_training.py")
    path = tmp_path / "run.json"
    result = script.main(["--method", "static", "--density", "0.5", "--epochs", "1", "--quiet", "--json", str(path)])
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {path}"
    report = json.loads(path.read_text())
    assert report["benchmark"] == "sparse_training" and report["device"] and report["commit"]
    assert report["date"] == datetime.date.today().isoformat()
    assert report["settings"]["epochs"] == 1 and report["settings"]["hidden"] == "320,96"
    assert report["run"] == json.loads(json.dumps(result))
    assert (report["run"]["method"], report["run"]["density"], report["run"]["seed"]) == ("static", 0.5, 0)
    assert 0.0 <= report["run"]["test_accuracy"] <= 1.0


def test_sparse_training_sweep(capsys, tmp_path):
    path = tmp_path / "sweep.json"
    flags = ["--sweep", "--methods", "dense", "static", "--densities", "0.5", "--seeds", "0", "1", "--epochs", "1"]
    load_script("examples/sparse_training.py").main([*flags, "--json", str(path)])
    assert f"wrote {path} (2 of 2 seeds)" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["seeds"] == [0, 1] and report["methods"] == ["dense", "static"]
    # dense at density 1 only; each seed's round in the order of the grid
    assert [(r["method"], r["density"], r["seed"]) for r in report["runs"]] == [
        ("dense", 1.0, 0),
        ("static", 0.5, 0),
        ("dense", 1.0, 1),
        ("static", 0.5, 1),
    ]
    for row in report["summary"]:
        accs = [
            r["test_accuracy"] for r in report["runs"] if (r["method"], r["density"]) == (row["method"], row["density"])
        ]
        assert row["test_accuracies"] == accs and row["seeds"] == [0, 1]
        assert row["mean"] == pytest.approx(sum(accs) / 2) and row["std"] == pytest.approx(abs(accs[0] - accs[1]) / 2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--density", "0"], "a density must be in (0, 1]"),
        (["--sweep", "--densities", "0.5", "1.5"], "a density must be in (0, 1]"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--hidden", "320,90"], "multiple of --block-size 8"),
        (["--seeds", "0", "1"], "go with --sweep"),
        (["--sweep", "--seeds", "1", "1"], "--seeds must differ"),
    ],
)
def test_sparse_training_bad_arguments(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        load_script("examples/sparse_training.py").parse_args(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


SPARSIFY_TINY = [
    "--steps",
    "3",
    "--finetune-steps",
    "2",
    "--densities",
    "0.5",
    "--width",
    "8",
    "--hidden",
    "16",
    "--block-size",
    "8",
    "--time-reps",
    "2",
]


def test_sparsify(capsys):
    script = load_script("examples/sparsify.py")
    result = script.main(SPARSIFY_TINY)
    rows = result["rows"]
    out = capsys.readouterr().out
    assert "left dense: input channels 1 not a multiple of block_size 8" in out
    assert "left dense: output features 10 not a multiple of block_size 8" in out
    assert out.strip().splitlines()[-1] == f"dense_accuracy={rows[0]['accuracy']:.4f}"
    assert [(r["model"], r["density"]) for r in rows] == [
        ("dense", 1.0),
        ("one-shot", 0.5),
        ("fine-tuned", 0.5),
        ("gradual", 0.5),
        ("from scratch", 0.5),
    ]
    dense, one_shot, tuned, gradual, scratch = rows
    # conv1 (1 -> 8) and the head (16 -> 10) stay dense; the other kernels halve, their biases stay.
    kept, kernels, biases = (9 * 8 + 8) + (16 * 10 + 10), 9 * 8 * 16 + 9 * 16 * 16 + 256 * 16, 16 + 16 + 16
    assert dense["params"] == kept + kernels + biases
    assert one_shot["params"] == kept + kernels // 2 + biases
    # Gradual pruning ends with the one-shot model's blocks per layer, in a static block-sparse model.
    assert one_shot["params"] == tuned["params"] == gradual["params"] == scratch["params"]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert one_shot["step_ms"] is None and all(r["step_ms"] > 0 for r in (dense, tuned, gradual, scratch))
    # One line per density, the recipes side by side.
    line = next(l for l in out.splitlines() if l.split()[:2] == ["0.5", f"{one_shot['params']:,}"])
    assert line.split()[2:6] == [f"{r['accuracy']:.4f}" for r in (one_shot, tuned, gradual, scratch)]

    # Several seeds: each row is the mean over them, with the spread and the per-seed values.
    halved = [dict(r, accuracy=r["accuracy"] / 2) for r in rows]
    two = script.summarize([rows, halved])
    for r, one in zip(two, rows, strict=True):
        assert (r["model"], r["density"], r["params"]) == (one["model"], one["density"], one["params"])
        assert r["accuracies"] == [one["accuracy"], one["accuracy"] / 2]
        assert r["accuracy"] == pytest.approx(0.75 * one["accuracy"])
        assert r["accuracy_std"] == pytest.approx(0.25 * one["accuracy"])
        assert (r["accuracy_min"], r["accuracy_max"]) == (one["accuracy"] / 2, one["accuracy"])
    script.print_table(two, 2)
    out = capsys.readouterr().out
    assert "mean ±std over 2 seeds" in out and "min-max over 2 seeds" in out
    assert f"{two[3]['accuracy']:.4f} ±{two[3]['accuracy_std']:.4f}" in out


CHAR_TRANSFORMER_TINY = [
    "--steps",
    "3",
    "--long-steps",
    "1",
    "--block-size",
    "16",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--layers",
    "1",
    "--batch",
    "1",
    "--eval-windows",
    "2",
]


def test_char_transformer(capsys):
    results = load_script("examples/char_transformer.py").main(
        ["--seq-lens", "128", *CHAR_TRANSFORMER_TINY, "--sample-chars", "24"]
    )
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


def test_char_moe(capsys):
    tiny = ["--steps", "3", "--seq-len", "32", "--d-model", "32", "--d-ff", "32", "--block-size", "16"]
    results = load_script("examples/char_moe.py").main([*tiny, "--eval-windows", "2", "--batch", "2"])
    out = capsys.readouterr().out
    assert "dense_bpc=" in out and "moe_bpc=" in out and "tokens per expert" in out
    dense, moe = results["dense"], results["moe"]
    for row in (dense, moe):
        assert 0 < row["bpc"] < 8 and row["ms"] > 0
    # Equal active feed-forward sizes; the MoE holds experts / top_k times the feed-forward weights.
    assert moe["params"] > dense["params"]
    # Every validation token reaches 2 experts in each of the 2 layers: 2 windows of 2 x 32 tokens.
    assert sum(moe["expert_counts"]) == 2 * 2 * 2 * 32 and len(moe["expert_counts"]) == 8


def test_char_transformer_skips_dense_over_budget(capsys):
    results = load_script("examples/char_transformer.py").main(
        [
            "--seq-lens",
            "128",
            *CHAR_TRANSFORMER_TINY,
            "--memory-budget-mb",
            "0",
            "--no-time-over-budget",
            "--sample-chars",
            "0",
        ]
    )
    out = capsys.readouterr().out
    assert results[128]["dense"]["bpc"] is None and results[128]["dense"]["ms"] is None
    assert results[128]["sparse"]["bpc"] > 0 and "dense_bpc=skipped" in out and "sample" not in results[128]
