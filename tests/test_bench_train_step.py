"""bench/train_step.py: its JSON and table, finite losses, and a dense LSTM baseline that
computes what the fused block-sparse LSTM computes (no timing asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import load_script

BENCH = Path(__file__).resolve().parents[1] / "bench" / "train_step.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/train_step.py")


def test_quick_run_writes_rows_for_both_models(bench, tmp_path, capsys):
    out = tmp_path / "train_step.json"
    # Quick preset, smaller still: one block size, one density, two timed steps.
    report = bench.main(
        [
            "--preset",
            "quick",
            "--mlp-hidden",
            "64",
            "--mlp-layers",
            "2",
            "--mlp-batch",
            "16",
            "--lstm-hidden",
            "64",
            "--lstm-steps",
            "3",
            "--lstm-batch",
            "4",
            "--block-sizes",
            "32",
            "--densities",
            "0.5",
            "--steps",
            "2",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(report))
    fields = {
        "device",
        "commit",
        "date",
        "jax_version",
        "implementation_path",
        "on_kernels",
        "baselines",
        "sizes",
        "rows",
        "complete",
    }
    assert fields <= set(result)
    assert result["complete"] and result["preset"] == "quick"
    assert result["jax_version"] == jax.__version__
    assert result["sizes"]["lstm"] == dict(hidden=64, input=64, steps=3, batch=4)
    rows = result["rows"]
    assert [(r["model"], r["kind"], r["block"]) for r in rows] == [
        ("mlp", "dense", None),
        ("mlp", "sparse", 32),
        ("lstm", "dense", None),
        ("lstm", "sparse", 32),
    ]
    for row in rows:
        assert {"model", "block", "density", "ms_per_step", "dense_ms_per_step", "speedup"} <= set(row)
        assert len(row["step_ms"]) == 2 and row["ms_per_step"] > 0
        assert math.isclose(row["speedup"], row["dense_ms_per_step"] / row["ms_per_step"])
        assert math.isfinite(row["first_loss"]) and math.isfinite(row["last_loss"])
    assert rows[0]["dense_ms_per_step"] == rows[0]["ms_per_step"] and rows[0]["speedup"] == 1.0
    assert len(rows[1]["dense_step_ms"]) == 2  # the dense steps alternated with the row's own
    assert rows[1]["density"] == 0.5  # 2 x 2 grid per layer, 2 blocks each
    table = capsys.readouterr().out
    assert "ms/step" in table and "dense ms/step" in table and "speedup" in table
    assert result["implementation_path"] in table


def test_dense_lstm_equals_the_fused_layer_at_full_density(bench):
    """The LSTM baseline (dense products, the fused layer's backward pass) gives the fused
    block-sparse layer's outputs and gradients when every block is present."""
    hidden, d, batch, steps, bs = 32, 16, 3, 5, 8
    sparse = bench.sparse_lstm(hidden, d, bs, 1.0, jnp.float32, seed=0)
    x = jax.random.normal(jax.random.key(1), (batch, steps, d))
    target = jax.random.normal(jax.random.key(2), (batch, steps, hidden))
    sp = bench.host_params(sparse, x, 4 * hidden, seed=0)
    sp["cell"]["bias"] = jax.random.normal(jax.random.key(3), (4 * hidden,)) / 4  # not all zero
    cell = sparse.cell
    to_dense = jax.jit(
        lambda cell_params: dict(
            input_kernel=jbs.to_dense(cell_params["input_kernel"], cell.config.input_layout()),
            recurrent_kernel=jbs.to_dense(cell_params["recurrent_kernel"], cell.recurrent_layout),
            bias=cell_params["bias"],
        )
    )
    dense_params = to_dense(sp["cell"])
    dense = bench.DenseLSTM(hidden, jnp.float32)
    assert jax.tree.map(jnp.shape, dense.init(jax.random.key(0), x)["params"]) == jax.tree.map(jnp.shape, dense_params)

    def loss(model, params):
        return jnp.mean(jnp.square(model.apply({"params": params}, x) - target))

    ls, gs = jax.jit(jax.value_and_grad(lambda p: loss(sparse, p)))(sp)
    ld, gd = jax.jit(jax.value_and_grad(lambda p: loss(dense, p)))(dense_params)
    np.testing.assert_allclose(ld, ls, rtol=1e-5)
    want = to_dense(gs["cell"])
    for name in ("input_kernel", "recurrent_kernel", "bias"):
        np.testing.assert_allclose(gd[name], want[name], atol=1e-5, err_msg=name)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--block-sizes", "48"], "--block-sizes"),
        (["--mlp-hidden", "100", "--block-sizes", "32"], "--mlp-hidden (100)"),
        (["--densities", "0"], "--densities"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_are_named(bench, capsys, flags, message):
    with pytest.raises(SystemExit):
        bench.parse_args(["--preset", "quick", "--no-json", *flags])
    assert message in capsys.readouterr().err
