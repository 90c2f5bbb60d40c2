"""Tests of the Flax layers: jbs.nn.BlockSparseDense (linen) and jbs.nnx.BlockSparseLinear.

Each layer must equal the dense Flax layer (``nn.Dense`` / ``nnx.Linear``) whose
kernel is the masked dense matrix ``jbs.to_dense(kernel, layout)``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from jax_blocksparse.nn import BlockSparseDense, StaticMask
from jax_blocksparse.nnx import BlockSparseLinear

# Relative tolerance per computation dtype (scaled by the largest reference value).
TOL = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}

FRAMEWORKS = ("linen", "nnx")


def _mask(grid=(4, 6), density=0.5, seed=0):
    mask = jbs.layouts.random(grid, density, seed=seed)
    mask[0, 0] = True  # never empty
    return mask


class Layer:
    """One block-sparse layer and its dense twin, in either framework, as pure functions.

    ``params`` is {"kernel": [capacity, bs, bs], "bias": [K] (optional)}; ``sparse``
    and ``dense`` map (params, x) -> y; ``dense`` uses the masked dense kernel;
    ``dense_apply`` maps (dense params with a [C, K] kernel, x) -> y.
    """

    def __init__(self, framework, mask, block_size, *, seed=0, capacity=None, use_bias=True, dtype=None, **kw):
        cb, kb = mask.shape
        c, k = cb * block_size, kb * block_size
        self.framework = framework
        if framework == "linen":
            self.module = BlockSparseDense(k, mask, block_size, use_bias=use_bias, dtype=dtype, capacity=capacity, **kw)
            self.layout = self.module.layout
            self.params = self.module.init(jax.random.key(seed), jnp.zeros((1, c)))["params"]
            dense = nn.Dense(k, use_bias=use_bias, dtype=dtype)
            self.sparse = lambda p, x: self.module.apply({"params": p}, x)
            self.dense_apply = lambda dp, x: dense.apply({"params": dp}, x)
        else:
            module = BlockSparseLinear(
                c, k, mask, block_size, use_bias=use_bias, dtype=dtype, capacity=capacity, rngs=nnx.Rngs(seed), **kw
            )
            self.module = module
            self.layout = module.layout
            graphdef, state = nnx.split(module)
            self.params = {path[0]: v[...] for path, v in nnx.to_flat_state(state)}
            dense_graphdef, _ = nnx.split(nnx.Linear(c, k, use_bias=use_bias, dtype=dtype, rngs=nnx.Rngs(0)))

            def apply(graphdef, p, x):
                state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
                return nnx.merge(graphdef, state)(x)

            self.sparse = lambda p, x: apply(graphdef, p, x)
            self.dense_apply = lambda dp, x: apply(dense_graphdef, dp, x)

    def dense(self, p, x):
        return self.dense_apply(self._dense_params(p), x)

    def _dense_params(self, p):
        out = {"kernel": jbs.to_dense(p["kernel"], self.layout)}
        if "bias" in p:
            out["bias"] = p["bias"]
        return out


def _random_params(layer, seed=1):
    """Non-trivial kernel and bias (the default bias is zero)."""
    keys = jax.random.split(jax.random.key(seed), 2)
    params = dict(layer.params)
    params["kernel"] = jax.random.normal(keys[0], params["kernel"].shape) * 0.1
    if "bias" in params:
        params["bias"] = jax.random.normal(keys[1], params["bias"].shape)
    return params


def _assert_close(actual, expected, dtype):
    tol = TOL[np.dtype(dtype)]
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * max(1.0, np.abs(expected).max()))


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16], ids=["dtype_none", "bf16"])
@pytest.mark.parametrize("extra_capacity", [0, 3])
def test_equals_dense_layer_with_masked_kernel(framework, dtype, extra_capacity):
    mask = _mask()
    capacity = int(mask.sum()) + extra_capacity if extra_capacity else None
    layer = Layer(framework, mask, 16, dtype=dtype, capacity=capacity)
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(2), (2, 3, mask.shape[0] * 16))
    y = layer.sparse(params, x)
    y_dense = layer.dense(params, x)
    assert y.shape == y_dense.shape == (2, 3, mask.shape[1] * 16)
    assert y.dtype == y_dense.dtype == (jnp.float32 if dtype is None else dtype)
    _assert_close(y, y_dense, y.dtype)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("extra_capacity", [0, 5])
def test_parameter_count(framework, use_bias, extra_capacity):
    mask, bs = _mask(), 16
    nnz = int(mask.sum())
    capacity = nnz + extra_capacity
    layer = Layer(framework, mask, bs, use_bias=use_bias, capacity=capacity)
    assert layer.params["kernel"].shape == layer.layout.w_shape == (capacity, bs, bs)
    count = sum(p.size for p in jax.tree.leaves(layer.params))
    assert count == capacity * bs * bs + (mask.shape[1] * bs if use_bias else 0)
    assert set(layer.params) == ({"kernel", "bias"} if use_bias else {"kernel"})
    # Padding slots start at zero.
    np.testing.assert_array_equal(np.asarray(layer.params["kernel"][nnz:]), 0.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_grads_match_masked_dense_grads(framework):
    mask = _mask(seed=3)
    layer = Layer(framework, mask, 16, capacity=int(mask.sum()) + 2)
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(4), (5, mask.shape[0] * 16))
    target = jax.random.normal(jax.random.key(5), (5, mask.shape[1] * 16))

    def loss(apply):
        return lambda p, x: jnp.sum((jnp.tanh(apply(p, x)) - target) ** 2)

    # Sparse: grads w.r.t. the stored blocks. Dense: grads w.r.t. the dense kernel.
    g_params, g_x = jax.jit(jax.grad(loss(layer.sparse), argnums=(0, 1)))(params, x)
    dense_params = layer._dense_params(params)
    gd_params, gd_x = jax.jit(jax.grad(loss(layer.dense_apply), argnums=(0, 1)))(dense_params, x)

    _assert_close(g_params["kernel"], jbs.from_dense(gd_params["kernel"], layer.layout), jnp.float32)
    np.testing.assert_array_equal(np.asarray(g_params["kernel"][int(mask.sum()) :]), 0.0)  # padding
    _assert_close(g_params["bias"], gd_params["bias"], jnp.float32)
    _assert_close(g_x, gd_x, jnp.float32)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(
    "mask",
    [jbs.layouts.barabasi_albert(16, 2, seed=0), jbs.layouts.random((16, 8), 0.25, seed=1)],
    ids=["barabasi_albert", "random"],
)
def test_default_init_gives_unit_output_variance(framework, mask):
    layer = Layer(framework, mask, 16, use_bias=False, capacity=int(mask.sum()) + 4)
    x = jax.random.normal(jax.random.key(7), (512, mask.shape[0] * 16))
    y = jax.jit(layer.sparse)(layer.params, x)
    assert 0.75 < float(jnp.var(y)) < 1.3
    # The sparse init is much larger than a dense LeCun init would be.
    assert float(jnp.var(layer.params["kernel"][: int(mask.sum())])) > 1.5 / (mask.shape[0] * 16)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_user_kernel_init_is_called_with_block_shape(framework):
    mask, bs = _mask(), 8
    capacity = int(mask.sum()) + 2
    calls = []

    def kernel_init(key, shape, dtype):
        calls.append((shape, np.dtype(dtype)))
        return jnp.ones(shape, dtype)

    layer = Layer(framework, mask, bs, capacity=capacity, kernel_init=kernel_init, bias_init=nn.initializers.ones)
    assert calls == [((capacity, bs, bs), np.dtype(jnp.float32))]
    W = jbs.to_dense(layer.params["kernel"], layer.layout)
    np.testing.assert_array_equal(np.asarray(W), np.kron(mask, np.ones((bs, bs))))
    np.testing.assert_array_equal(np.asarray(layer.params["bias"]), 1.0)


def test_linen_layer_is_hashable_and_jittable_as_static():
    mask = _mask()
    a = BlockSparseDense(96, mask, 16)
    b = BlockSparseDense(96, mask.astype(np.int32), 16)  # 0/1 ints mean the same mask
    other = BlockSparseDense(96, ~mask, 16)
    assert a == b and hash(a) == hash(b) and a != other
    assert a.mask == StaticMask(mask) and np.array_equal(np.asarray(a.mask), mask)
    mask[0, 1] = not mask[0, 1]  # the layer keeps its own copy
    assert a == b

    params = a.init(jax.random.key(0), jnp.ones((1, 64)))
    apply = jax.jit(lambda module, p, x: module.apply(p, x), static_argnums=0)
    np.testing.assert_allclose(apply(a, params, jnp.ones((2, 64))), apply(b, params, jnp.ones((2, 64))))


def test_nnx_layer_under_nnx_jit_and_grad():
    mask = _mask()
    model = BlockSparseLinear(64, 96, mask, 16, rngs=nnx.Rngs(0))
    x = jnp.ones((3, 64))

    @nnx.jit
    def loss_and_grad(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    loss, grads = loss_and_grad(model, x)
    assert np.isfinite(float(loss))
    assert grads["kernel"][...].shape == model.layout.w_shape
    assert grads["bias"][...].shape == (96,)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_shapes_raise(framework):
    mask = _mask()  # [4, 6]: C = 64, K = 96 with block 16
    if framework == "linen":
        with pytest.raises(ValueError, match=r"output features \(80\).*6 \* 16 = 96"):
            BlockSparseDense(80, mask, 16)
        layer = BlockSparseDense(96, mask, 16)
        with pytest.raises(ValueError, match=r"inputs must have shape \[\.\.\., 64\].*\(2, 48\)"):
            layer.init(jax.random.key(0), jnp.ones((2, 48)))
        with pytest.raises(ValueError, match="block_size must be one of"):
            BlockSparseDense(4 * 6, mask, 4)
        with pytest.raises(ValueError, match="capacity=3 is smaller"):
            BlockSparseDense(96, mask, 16, capacity=3)
        with pytest.raises(ValueError, match="2-D"):
            BlockSparseDense(96, mask[0], 16)
    else:
        with pytest.raises(ValueError, match=r"output features \(80\)"):
            BlockSparseLinear(64, 80, mask, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"in_features \(48\).*4 \* 16 = 64"):
            BlockSparseLinear(48, 96, mask, 16, rngs=nnx.Rngs(0))
        layer = BlockSparseLinear(64, 96, mask, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"inputs must have shape \[\.\.\., 64\].*\(2, 96\)"):
            layer(jnp.ones((2, 96)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_bias_add_is_the_dtypes_add_and_sums_its_gradient_in_float32(dtype):
    # 16-bit: y + bias taken in float32 and rounded once (what XLA computes for the
    # 16-bit add), so the bias gradient is a float32 sum over the rows, rounded once.
    from jax_blocksparse.layers.common import add_bias

    rng = np.random.default_rng(0)
    y, bias, ct = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((3, 100, 64), (64,), (3, 100, 64)))
    out, vjp = jax.vjp(add_bias, y, bias)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(y + bias, np.float32))
    dy, dbias = vjp(ct)
    np.testing.assert_array_equal(np.asarray(dy, np.float32), np.asarray(ct, np.float32))
    want = np.asarray(ct, np.float64).sum(axis=(0, 1))
    got = np.asarray(dbias, np.float64)
    assert dbias.dtype == dtype
    if dtype == jnp.float32:  # y + bias as written: float32 summation error
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    else:  # within one 16-bit rounding of the exact sum
        ulp = np.abs(np.asarray(jnp.asarray(want, dtype), np.float64)) * 2.0 ** -jnp.finfo(dtype).nmant
        assert np.all(np.abs(got - want) <= ulp), (got, want)
