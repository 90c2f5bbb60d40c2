"""The functional recurrence op (jax_blocksparse.ops.recurrence) on its own, without flax.

The cells' math is tested through the layers in test_recurrent.py; here: the op's
public entries agree with each other (the fused sequence, its custom VJP included,
equals a scan of the step), and their argument checks name the argument and shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from jax_blocksparse.ops.recurrence import bs_lstm_sequence, bs_lstm_step, lstm_spec

BS, H, D = 8, 32, 16


def _layout(mask):
    return jbs.Layout.from_mask(np.asarray(mask, bool), BS)


def _spec(multiplicative=False, **kwargs):
    base = jbs.layouts.barabasi_albert(H // BS, 1, seed=0)
    return lstm_spec(
        H,
        _layout(np.tile(base, (1, 4))),
        step_layouts=[_layout(base)],
        mh_layout=_layout(base) if multiplicative else None,
        **kwargs,
    )


def _params(spec, seed=0):
    shapes = spec.param_shapes(D)
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return {name: 0.3 * jax.random.normal(k, shape) for k, (name, shape) in zip(keys, shapes.items())}


def test_sequence_equals_a_scan_of_steps_and_its_gradient():
    spec = _spec(multiplicative=True)  # every kind of stage: the mLSTM factor, a step, the gates
    params = _params(spec)
    xs = jax.random.normal(jax.random.key(1), (5, 3, D))
    carry = (jnp.zeros((3, H)), 0.1 * jnp.ones((3, H)))

    def scanned(params, xs):
        return jax.lax.scan(lambda c, x: bs_lstm_step(spec, params, c, x), carry, xs)

    def fused(params, xs):
        return bs_lstm_sequence(spec, params, carry, xs)

    (c1, h1), ys1 = scanned(params, xs)
    (c2, h2), ys2 = fused(params, xs)
    assert ys2.shape == (5, 3, H) and h2.shape == (3, H) and c2.dtype == jnp.float32
    np.testing.assert_allclose(ys2, ys1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c2, c1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h2, h1, rtol=1e-5, atol=1e-5)

    def loss(run):
        return lambda p, x: jnp.sum(run(p, x)[1] ** 2) + jnp.sum(run(p, x)[0][0])

    g1 = jax.grad(loss(scanned), argnums=(0, 1))(params, xs)
    g2 = jax.grad(loss(fused), argnums=(0, 1))(params, xs)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_spec_is_hashable_and_equal_for_equal_layouts():
    a, b = _spec(), _spec()
    assert a.param_shapes(D) == b.param_shapes(D)
    assert hash(a) == hash(a) and a.internal_steps == 1 and a.groups == 4 and a.block_size == BS


def test_errors_name_the_argument_and_shapes():
    spec = _spec()
    params = _params(spec)
    carry = (jnp.zeros((2, H)), jnp.zeros((2, H)))
    with pytest.raises(ValueError, match=r"recurrent_layout must be a layout of shape \(32, 128\)"):
        lstm_spec(H, _layout(np.ones((4, 4))))
    with pytest.raises(ValueError, match=r"step_layouts\[0\] must be a layout of shape \(32, 32\)"):
        lstm_spec(H, _layout(np.ones((4, 16))), step_layouts=[_layout(np.ones((4, 8)))])
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        lstm_spec(H, _layout(np.ones((4, 16))), dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"bs_lstm_step: carry \(c, h\) must have shape \[\.\.\., 32\]"):
        bs_lstm_step(spec, params, (jnp.zeros((2, 16)), jnp.zeros((2, 16))), jnp.ones((2, D)))
    with pytest.raises(ValueError, match=r"bs_lstm_step: params lack \['step0_bias'\]"):
        bs_lstm_step(spec, {k: v for k, v in params.items() if k != "step0_bias"}, carry, jnp.ones((2, D)))
    with pytest.raises(ValueError, match=r"params\['input_kernel'\] must have shape \(8, 128\), got \(16, 128\)"):
        bs_lstm_step(spec, params, carry, jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=r"bs_lstm_sequence: xs must be \[T, \.\.\., D\]"):
        bs_lstm_sequence(spec, params, carry, jnp.ones((D,)))
