"""bench/moe.py: the four layers compute the same MoE where nothing is dropped, and a tiny run
writes its JSON (no timing asserted)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from helpers import load_script


def _setup(bench, **sizes):
    args = bench.parse_args(
        ["--tokens", "48", "--d-model", "32", "--d-ff", "64", "--experts", "4", "--block-size", "16"]
        + [f"--{k.replace('_', '-')}={v}" for k, v in sizes.items()]
    )
    config = bench.moe_core.check_moe(
        args.experts, args.d_ff, args.top_k, args.block_size, "softmax", False, False, "t"
    )
    shapes = bench.moe_core.param_shapes(config, args.d_model)
    keys = jax.random.split(jax.random.key(0), len(shapes) + 1)
    params = {n: bench.moe_core.default_init(n)(k, s, jnp.float32) for k, (n, s) in zip(keys, shapes.items())}
    return args, params, jax.random.normal(keys[-1], (args.tokens, args.d_model))


def test_the_baselines_compute_the_block_sparse_layer():
    bench = load_script("bench/moe.py")
    # A capacity factor of E drops nothing: every layer computes the same MoE.
    args, params, x = _setup(bench, capacity_factor=4.0)
    with jax.default_matmul_precision("highest"):
        want = bench.block_sparse(params, x, args, jnp.float32)
        for layer in (bench.capacity_moe, bench.ragged_moe):
            np.testing.assert_allclose(layer(params, x, args, jnp.float32), want, rtol=1e-5, atol=1e-5)


def test_tiny_run_writes_its_rows(tmp_path, capsys):
    out = tmp_path / "moe.json"
    report = load_script("bench/moe.py").main(
        ["--tokens", "64", "--d-model", "32", "--d-ff", "64", "--block-size", "16", "--steps", "1", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == report
    layers = [(r["dtype"], r["layer"]) for r in report["rows"]]
    assert layers == [
        (d, n) for d in ("float32", "bfloat16") for n in ("block-sparse", "capacity", "ragged_dot", "dense", "copies")
    ]
    assert all(r["ms"] > 0 for r in report["rows"]) and "ragged_dot" in capsys.readouterr().out
