"""bench/training_noise.py: its second summation orders compute the reference's sums, its
emulation of XLA:GPU's excess precision removes exactly the round trips that pass
removes, its floors; and tests/training_steps.py's tolerances are the stated multiple
of the floors in the committed result."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
import training_steps as ts
from helpers import load_script
from jax_blocksparse.ops import matmul

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "training_noise.py"


@pytest.fixture(scope="module")
def bench():
    return load_script("bench/training_noise.py")


def _operands(dtype, integers=False):
    """A [64, 128] layout of blocks of 16 at 50%, x [2, 3, 64], w, dy [2, 3, 128]."""
    layout = jbs.Layout.from_mask(jbs.layouts.random((4, 8), 0.5, seed=0), 16)
    rng = np.random.default_rng(0)

    def draw(shape):
        a = rng.integers(-4, 5, shape) if integers else rng.standard_normal(shape)
        return jnp.asarray(a, dtype)

    return layout, draw((2, 3, 64)), draw(layout.w_shape), draw((2, 3, 128))


def _all_orders(bench, prim, layout, x, w, dy):
    """One jit: the reference (float32 out) and, per split, the split (float32 and
    bfloat16 out) of ``prim``'s operands among x, w, dy."""
    a, b = {matmul.bsmm_fprop_p: (x, w), matmul.bsmm_bprop_p: (dy, w), matmul.bsmm_updat_p: (x, dy)}[prim]
    params = dict(block_size=layout.block_size, impl="reference", lhs_dtype=None, precision=jax.lax.Precision.HIGHEST)

    def call(fn, a, b, dtype):
        return fn(a, b, *layout.tables, out_dtype=np.dtype(dtype), **params)

    def every(a, b):
        splits = {s: bench.split_reference(prim, s) for s in bench.SPLITS}
        return call(bench._CONTRACTIONS[prim][0], a, b, jnp.float32), {
            s: (call(fn, a, b, jnp.float32), call(fn, a, b, jnp.bfloat16)) for s, fn in splits.items()
        }

    return jax.jit(every)(a, b)


@pytest.mark.parametrize("prim", [matmul.bsmm_fprop_p, matmul.bsmm_bprop_p, matmul.bsmm_updat_p], ids=lambda p: p.name)
def test_split_references_sum_the_same_terms(bench, prim):
    # Small integers: every partial sum is exact, so any order gives the same bits.
    want, splits = _all_orders(bench, prim, *_operands(jnp.float32, integers=True))
    for split, (got, _) in splits.items():
        np.testing.assert_array_equal(got, want, err_msg=split)
    # Random bfloat16 operands: float32 sums that differ by their order, then the cast.
    want, splits = _all_orders(bench, prim, *_operands(jnp.bfloat16))
    want = np.asarray(want)
    for split, (got, rounded) in splits.items():
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=split)
        np.testing.assert_array_equal(
            np.asarray(rounded, np.float32), np.asarray(jnp.asarray(got, jnp.bfloat16), np.float32), err_msg=split
        )
    # ... and another order indeed: some float32 bits differ from the reference's.
    assert any(not np.array_equal(got, want) for got, _ in splits.values())


def test_part_masks_partition_the_contraction(bench):
    for parts, interleaved in bench.SPLITS.values():
        masks = np.stack([np.asarray(m) for m in bench._part_masks(16, parts, interleaved)])
        assert masks.shape == (parts, 16) and np.all(masks.sum(axis=0) == 1)  # each index in one part
        assert masks.sum(axis=1).min() >= 16 // parts
    halves = np.asarray(bench._part_masks(16, 2, False)[0])
    assert halves[:8].all() and not halves[8:].any()
    even = np.asarray(bench._part_masks(16, 2, True)[0])
    assert even[::2].all() and not even[1::2].any()


def test_excess_precision_emulation(bench):
    """A bf16 product widened to float32 keeps its float32 value, also inside jit and
    scan; the product used as bfloat16 keeps the rounding."""
    layout, x, w, _ = _operands(jnp.bfloat16)
    x = x[0]

    def product(x):
        return jbs.bsmm(x, w, layout, impl="reference")

    def f(x):
        widened = jax.jit(lambda x: product(x).astype(jnp.float32))(x)
        _, scanned = jax.lax.scan(lambda c, xi: (c, product(xi).astype(jnp.float32)), 0.0, x[None])
        return widened, scanned[0], product(x)  # the last one stays bfloat16

    closed = jax.make_jaxpr(f)(x)
    counter = {}
    widened, scanned, kept = jax.jit(
        lambda x: bench.eval_excess_precision(closed.jaxpr, closed.consts, x, counter=counter)
    )(x)
    full = np.asarray(jbs.bsmm(x, w, layout, preferred_element_type=jnp.float32, impl="reference"))
    rounded = np.asarray(product(x), np.float32)
    assert not np.array_equal(full, rounded)
    np.testing.assert_array_equal(widened, full)
    np.testing.assert_array_equal(scanned, full)
    assert kept.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kept, np.float32), rounded)
    assert counter["collapsed"] >= 2


def test_floors_take_the_largest_order(bench):
    numbers = {"step_grad_err": 1e-3, "loss_err": 2e-4}
    comparisons = {name: dict(numbers) for name in bench.FLOOR_OF}
    comparisons[bench.FLOOR_OF[1]]["step_grad_err"] = 3e-3
    comparisons["cpu_kernels"]["loss_err"] = 5e-4
    comparisons["bf16_vs_f32"] = {"step_grad_err": 1.0, "loss_err": 1.0}  # not an order: not in the floor
    models = {"mlp": {"bfloat16": comparisons}}
    assert bench.floors(models) == {"bfloat16": {"mlp": {"step_grad_err": 3e-3, "loss_err": 5e-4}}}
    comparisons["cpu_kernels"]["loss_err"] = math.nan
    assert math.isnan(bench.floors(models)["bfloat16"]["mlp"]["loss_err"])


def test_tolerances_are_the_stated_multiples_of_the_committed_floors():
    report = json.loads((ROOT / ts.NOISE_FLOORS).read_text())
    assert report["device"] == "cpu" and report["steps"] == ts.STEPS and report["commit"] != "unknown"
    for dtype in ts.DTYPES:
        for model in ts.MODELS:
            floors, tolerances = report["floors"][dtype][model], ts.tolerances(model, dtype)
            assert set(floors) == set(tolerances), (dtype, model)
            for quantity, floor in floors.items():
                want = ts.MULTIPLE * max(floor, ts.FLOAT32_EPS)
                # Written with two significant digits, rounded up.
                assert want <= tolerances[quantity] <= 1.1 * want, (dtype, model, quantity, floor)
