"""Tests of the conv layers: jbs.nn.BlockSparseConv / BlockSparseConvTranspose (linen) and
jbs.nnx.BlockSparseConv / BlockSparseConvTranspose.

Each layer must equal the dense Flax layer (``nn.Conv`` / ``nn.ConvTranspose`` /
``nnx.Conv`` / ``nnx.ConvTranspose``) whose kernel is the masked dense HWIO kernel
``jbs.conv_to_dense(kernel, layout)``.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import xla_optimizations_off
from jax_blocksparse import nn as jnn
from jax_blocksparse import nnx as jnnx

# Relative tolerance per computation dtype (scaled by the largest reference value).
TOL = {np.dtype(jnp.float32): 1e-5, np.dtype(jnp.bfloat16): 2e-2}
FRAMEWORKS = ("linen", "nnx")
KINDS = ("conv", "transpose")
BS = 8


# Tests compiled with XLA's full optimisation pipeline, as a training step is.
OPTIMIZED = {"test_grads_match_masked_dense_grads", "test_nnx_layer_under_nnx_jit_and_grad"}


@pytest.fixture(autouse=True)
def _quick_compiles(request):
    """The other tests check values, not speed: skip XLA's optimisation passes (~2x faster compiles)."""
    with xla_optimizations_off(request.node.originalname not in OPTIMIZED):
        yield


def _mask(grid=(3, 2), density=0.5, seed=0):
    mask = jbs.layouts.random(grid, density, seed=seed)
    mask[0, 0] = True  # never empty
    return mask


LAYERS = {
    "linen": {"conv": (jnn.BlockSparseConv, nn.Conv), "transpose": (jnn.BlockSparseConvTranspose, nn.ConvTranspose)},
    "nnx": {"conv": (jnnx.BlockSparseConv, nnx.Conv), "transpose": (jnnx.BlockSparseConvTranspose, nnx.ConvTranspose)},
}


class ConvLayer:
    """One block-sparse conv layer and its dense twin, in either framework, as pure functions.

    ``params`` is {"kernel": [capacity, *ks, bs, bs], "bias": [features] (optional)};
    ``sparse`` and ``dense`` map (params, x) -> y; ``dense`` uses the masked dense kernel;
    ``dense_apply`` maps (params with a dense HWIO kernel, x) -> y. ``in_features`` is
    the input channel count.
    """

    def __init__(
        self, framework, kind, mask, kernel_size, *, seed=0, capacity=None, use_bias=True, dtype=None, init=True, **kw
    ):
        """``init=False`` builds the parameters' shapes only (for tests that replace them)."""
        transposed = kw.get("transpose_kernel", False)
        rows, cols = mask.shape[0] * BS, mask.shape[1] * BS
        c_in, c_out = (cols, rows) if transposed else (rows, cols)
        self.in_features, self.features, self.kernel_size = c_in, c_out, kernel_size
        n = len(kernel_size) if isinstance(kernel_size, tuple) else 1
        common = dict(use_bias=use_bias, dtype=dtype, **kw)
        dense_kw = {k: v for k, v in common.items() if k not in ("kernel_init", "bias_init")}
        cls, dense_cls = LAYERS[framework][kind]
        if framework == "linen":
            self.module = cls(c_out, kernel_size, mask, BS, capacity=capacity, **common)
            self.layout = self.module.layout
            x0 = jnp.zeros((1,) + (4,) * n + (c_in,))
            init_fn = jax.jit(self.module.init) if init else functools.partial(jax.eval_shape, self.module.init)
            self.params = init_fn(jax.random.key(seed), x0)["params"]
            dense = dense_cls(c_out, kernel_size, **dense_kw)
            self.sparse = lambda p, x: self.module.apply({"params": p}, x)
            self.dense_apply = lambda dp, x: dense.apply({"params": dp}, x)
        else:

            def make():
                return cls(c_in, c_out, kernel_size, mask, BS, capacity=capacity, rngs=nnx.Rngs(seed), **common)

            # Built under nnx.jit: one compile instead of one per eager init op.
            module = nnx.jit(make)() if init else nnx.eval_shape(make)
            self.module, self.layout = module, module.layout
            graphdef, state = nnx.split(module)
            self.params = {path[0]: (v[...] if init else v.get_value()) for path, v in nnx.to_flat_state(state)}
            dense_module = nnx.eval_shape(lambda: dense_cls(c_in, c_out, kernel_size, rngs=nnx.Rngs(0), **dense_kw))
            dense_graphdef, _ = nnx.split(dense_module)

            def apply(graphdef, p, x):
                state = nnx.State({name: nnx.Param(value) for name, value in p.items()})
                return nnx.merge(graphdef, state)(x)

            self.sparse = lambda p, x: apply(graphdef, p, x)
            self.dense_apply = lambda dp, x: apply(dense_graphdef, dp, x)

    def dense(self, p, x):
        return self.dense_apply(self.dense_params(p), x)

    def dense_params(self, p):
        out = {"kernel": jbs.conv_to_dense(p["kernel"], self.layout)}
        if "bias" in p:
            out["bias"] = p["bias"]
        return out


def _random_params(layer, seed=1):
    """Non-trivial kernel and bias (the default bias is zero); padding slots stay zero.

    Drawn with numpy: no compile per shape.
    """
    rng = np.random.default_rng(seed)
    params = {name: rng.standard_normal(p.shape).astype(np.float32) for name, p in layer.params.items()}
    params["kernel"] *= 0.1
    params["kernel"][layer.layout.nnz :] = 0.0
    return {name: jnp.asarray(p) for name, p in params.items()}


def _assert_close(actual, expected, dtype):
    tol = TOL[np.dtype(dtype)]
    actual = np.asarray(actual, np.float32)
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * max(1.0, np.abs(expected).max()))


# name -> (kind, kernel_size, input spatial shape, layer keyword arguments)
CONFIGS = {
    "conv_2d_same": ("conv", (3, 3), (6, 5), {}),
    "conv_2d_strided_int_padding": ("conv", (3, 3), (7, 6), dict(strides=2, padding=1)),
    "conv_1d_int_kernel_causal": ("conv", 3, (7,), dict(padding="CAUSAL", kernel_dilation=2)),
    "conv_2d_circular": ("conv", (3, 2), (5, 4), dict(padding="CIRCULAR", strides=(1, 2))),
    "conv_2d_reflect": ("conv", (3, 3), (5, 5), dict(padding="REFLECT")),
    "conv_2d_input_dilation": ("conv", (3, 3), (3, 4), dict(padding=((2, 1), (1, 1)), input_dilation=2)),
    "conv_3d_valid": ("conv", (2, 2, 2), (3, 4, 3), dict(padding="VALID")),
    "transpose_2d_same": ("transpose", (3, 3), (3, 4), dict(strides=2)),
    "transpose_2d_valid_transpose_kernel": (
        "transpose",
        (4, 3),
        (3, 3),
        dict(strides=2, padding="VALID", transpose_kernel=True),
    ),
    "transpose_1d_circular": ("transpose", (3,), (5,), dict(strides=2, padding="CIRCULAR")),
    "transpose_2d_circular_transpose_kernel": (
        "transpose",
        (4, 4),
        (3, 3),
        dict(strides=2, padding="CIRCULAR", transpose_kernel=True),
    ),
    "transpose_2d_pairs_dilated": (
        "transpose",
        (2, 3),
        (3, 3),
        dict(strides=(2, 1), padding=[(1, 2), (2, 3)], kernel_dilation=2),
    ),
}


def _cases():
    # Each config in one framework (alternating), two in both; dtype and spare capacity
    # cycle over the configs.
    out = []
    for i, name in enumerate(CONFIGS):
        frameworks = FRAMEWORKS if i in (0, 7) else (FRAMEWORKS[i % 2],)
        for framework in frameworks:
            dtype = jnp.bfloat16 if (i + (framework == "nnx")) % 3 == 0 else None
            extra = 3 if i % 2 else 0
            ids = f"{framework}-{name}-{'bf16' if dtype else 'f32'}-extra{extra}"
            out.append(pytest.param(framework, name, dtype, extra, id=ids))
    return out


@pytest.mark.parametrize("framework,config,dtype,extra_capacity", _cases())
def test_equals_dense_layer_with_masked_kernel(framework, config, dtype, extra_capacity):
    kind, kernel_size, spatial, kw = CONFIGS[config]
    mask = _mask()
    capacity = int(mask.sum()) + extra_capacity if extra_capacity else None
    layer = ConvLayer(framework, kind, mask, kernel_size, dtype=dtype, capacity=capacity, init=False, **kw)
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(2), (2, *spatial, layer.in_features))
    y, y_dense = jax.jit(lambda p, x: (layer.sparse(p, x), layer.dense(p, x)))(params, x)
    assert y.shape == y_dense.shape and y.shape[-1] == layer.features
    assert y.dtype == y_dense.dtype == (jnp.float32 if dtype is None else dtype)
    _assert_close(y, y_dense, y.dtype)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", KINDS)
def test_batch_dims_and_unbatched_inputs(framework, kind):
    layer = ConvLayer(framework, kind, _mask(), (3, 3), strides=2, init=False)
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(3), (2, 3, 4, 4, layer.in_features))

    @jax.jit
    def run(p, x):
        return layer.sparse(p, x), layer.dense(p, x), layer.sparse(p, x[0, 0]), layer.dense(p, x[0, 0])

    y, y_dense, y1, y1_dense = run(params, x)
    assert y.shape[:2] == (2, 3) and y1.shape == y.shape[2:]
    _assert_close(y, y_dense, jnp.float32)
    _assert_close(y1, y1_dense, jnp.float32)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("use_bias,extra_capacity", [(True, 0), (False, 5)])
def test_parameter_count(framework, kind, use_bias, extra_capacity):
    mask, kernel_size = _mask(), (3, 2)
    nnz = int(mask.sum())
    capacity = nnz + extra_capacity
    layer = ConvLayer(framework, kind, mask, kernel_size, use_bias=use_bias, capacity=capacity)
    shape = (capacity, *kernel_size, BS, BS)
    assert layer.params["kernel"].shape == shape
    count = sum(p.size for p in jax.tree.leaves(layer.params))
    assert count == math.prod(shape) + (layer.features if use_bias else 0)
    assert set(layer.params) == ({"kernel", "bias"} if use_bias else {"kernel"})
    np.testing.assert_array_equal(np.asarray(layer.params["kernel"][nnz:]), 0.0)  # padding slots
    # The dense twin has prod(ks) * C * K weights; the sparse one the present blocks only.
    dense_count = math.prod(kernel_size) * layer.in_features * layer.features
    assert math.prod((nnz, *shape[1:])) == dense_count * nnz / mask.size


@pytest.mark.parametrize(
    "framework,config",
    [
        ("linen", "conv_2d_strided_int_padding"),
        ("nnx", "conv_2d_strided_int_padding"),
        ("nnx", "transpose_2d_same"),
        ("linen", "transpose_2d_valid_transpose_kernel"),
    ],
)
def test_grads_match_masked_dense_grads(framework, config):
    kind, kernel_size, spatial, kw = CONFIGS[config]
    mask = _mask(seed=3)
    layer = ConvLayer(framework, kind, mask, kernel_size, capacity=int(mask.sum()) + 2, init=False, **kw)
    params = _random_params(layer)
    x = jax.random.normal(jax.random.key(4), (2, *spatial, layer.in_features))
    target = jax.random.normal(jax.random.key(5), jax.eval_shape(layer.sparse, params, x).shape)

    def loss(apply):
        return lambda p, x: jnp.sum((jnp.tanh(apply(p, x)) - target) ** 2)

    @jax.jit
    def run(params, x):
        g_params, g_x = jax.grad(loss(layer.sparse), argnums=(0, 1))(params, x)
        gd_params, gd_x = jax.grad(loss(layer.dense_apply), argnums=(0, 1))(layer.dense_params(params), x)
        return g_params, g_x, jbs.conv_from_dense(gd_params["kernel"], layer.layout), gd_params["bias"], gd_x

    g_params, g_x, gd_kernel, gd_bias, gd_x = run(params, x)
    _assert_close(g_params["kernel"], gd_kernel, jnp.float32)
    np.testing.assert_array_equal(np.asarray(g_params["kernel"][int(mask.sum()) :]), 0.0)  # padding
    _assert_close(g_params["bias"], gd_bias, jnp.float32)
    _assert_close(g_x, gd_x, jnp.float32)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", ["conv", "transpose_kernel"])
def test_default_init_gives_unit_output_variance(framework, kind):
    # 16 x 8 blocks at density 1/4: each output sees ~4 blocks * 8 channels * 9 taps.
    mask = jbs.layouts.random((16, 8), 0.25, seed=1)
    kw = dict(transpose_kernel=True, strides=1) if kind == "transpose_kernel" else {}
    if kind == "transpose_kernel":
        mask = mask.T.copy()  # rows are the outputs: the same fan-in per output channel
    layer_kind = "conv" if kind == "conv" else "transpose"
    layer = ConvLayer(framework, layer_kind, mask, (3, 3), use_bias=False, capacity=int(mask.sum()) + 4, **kw)
    x = jax.random.normal(jax.random.key(7), (16, 10, 10, layer.in_features))
    y = jax.jit(layer.sparse)(layer.params, x)[:, 1:-1, 1:-1]  # away from the zero padding
    assert 0.75 < float(jnp.var(y)) < 1.3
    # Much larger than a dense LeCun init (fan-in = C * 9) would be.
    assert float(jnp.var(layer.params["kernel"][: int(mask.sum())])) > 2.0 / (layer.in_features * 9)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("kind", KINDS)
def test_user_kernel_init_is_called_with_block_shape(framework, kind):
    mask, kernel_size = _mask(), (2, 3)
    capacity = int(mask.sum()) + 2
    calls = []

    def kernel_init(key, shape, dtype):
        calls.append((shape, np.dtype(dtype)))
        return jnp.ones(shape, dtype)

    layer = ConvLayer(
        framework, kind, mask, kernel_size, capacity=capacity, kernel_init=kernel_init, bias_init=nn.initializers.ones
    )
    assert calls == [((capacity, *kernel_size, BS, BS), np.dtype(jnp.float32))]
    W = jbs.conv_to_dense(layer.params["kernel"], layer.layout)
    np.testing.assert_array_equal(np.asarray(W), np.broadcast_to(np.kron(mask, np.ones((BS, BS))), W.shape))
    np.testing.assert_array_equal(np.asarray(layer.params["bias"]), 1.0)


def test_linen_layers_are_hashable_and_jittable_as_static():
    mask = _mask()
    a = jnn.BlockSparseConv(16, (3, 3), mask, 8, padding=[(1, 1), (0, 0)], strides=[2, 1])
    b = jnn.BlockSparseConv(16, [3, 3], mask.astype(np.int32), 8, padding=((1, 1), (0, 0)), strides=(2, 1))
    other = jnn.BlockSparseConv(16, (3, 3), ~mask, 8)
    assert a == b and hash(a) == hash(b) and a != other
    t = jnn.BlockSparseConvTranspose(16, (3, 3), mask, 8, strides=[2, 2])
    assert hash(t) == hash(jnn.BlockSparseConvTranspose(16, (3, 3), mask, 8, strides=(2, 2)))

    x = jnp.ones((2, 5, 5, 24))
    params = a.init(jax.random.key(0), x)
    apply = jax.jit(lambda module, p, x: module.apply(p, x), static_argnums=0)
    np.testing.assert_allclose(apply(a, params, x), apply(b, params, x))


@pytest.mark.parametrize("kind", KINDS)
def test_nnx_layer_under_nnx_jit_and_grad(kind):
    mask = _mask()
    if kind == "conv":
        model = jnnx.BlockSparseConv(24, 16, (3, 3), mask, 8, strides=2, rngs=nnx.Rngs(0))
    else:
        model = jnnx.BlockSparseConvTranspose(24, 16, (3, 3), mask, 8, strides=2, rngs=nnx.Rngs(0))
    x = jnp.ones((3, 4, 4, 24))

    @nnx.jit
    def loss_and_grad(model, x):
        return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(model)

    loss, grads = loss_and_grad(model, x)
    assert np.isfinite(float(loss))
    assert grads["kernel"][...].shape == (model.layout.capacity, 3, 3, 8, 8)
    assert grads["bias"][...].shape == (16,)


INPUTS_24 = r"inputs must have shape \[\*batch_dims, \*spatial \(2 dims\), 24\]"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_bad_shapes_raise(framework):
    mask = _mask()  # [3, 2]: C = 24, K = 16 with block 8
    if framework == "linen":
        with pytest.raises(ValueError, match=r"output features \(20\).*2 \* 8 = 16"):
            jnn.BlockSparseConv(20, (3, 3), mask, 8)
        layer = jnn.BlockSparseConv(16, (3, 3), mask, 8)
        with pytest.raises(ValueError, match=INPUTS_24 + r".*\(2, 5, 5, 16\)"):
            layer.init(jax.random.key(0), jnp.ones((2, 5, 5, 16)))
        with pytest.raises(ValueError, match=r"inputs must have shape.*\(2, 24\)"):
            layer.init(jax.random.key(0), jnp.ones((2, 24)))
        with pytest.raises(ValueError, match="kernel_size must be one or more ints >= 1"):
            jnn.BlockSparseConv(16, (3, 0), mask, 8)
        with pytest.raises(ValueError, match="block_size must be one of"):
            jnn.BlockSparseConv(16, (3, 3), mask, 4)
        pattern = r"output features \(16\) must equal mask.shape\[0\] \* block_size = 3 \* 8 = 24 with transpose_kernel"
        with pytest.raises(ValueError, match=pattern):
            jnn.BlockSparseConvTranspose(16, (3, 3), mask, 8, transpose_kernel=True)
        with pytest.raises(ValueError, match=r"strides must have one entry per spatial dim \(2\)"):
            jnn.BlockSparseConv(16, (3, 3), mask, 8, strides=(1, 1, 1)).init(jax.random.key(0), jnp.ones((1, 5, 5, 24)))
        with pytest.raises(ValueError, match="Causal padding|CAUSAL padding is only implemented for 1-D"):
            jnn.BlockSparseConv(16, (3, 3), mask, 8, padding="CAUSAL").init(jax.random.key(0), jnp.ones((1, 5, 5, 24)))
    else:
        with pytest.raises(ValueError, match=r"in_features \(16\).*3 \* 8 = 24"):
            jnnx.BlockSparseConv(16, 16, (3, 3), mask, 8, rngs=nnx.Rngs(0))
        pattern = r"in_features \(24\) must equal mask.shape\[1\] \* block_size = 2 \* 8 = 16 with transpose_kernel"
        with pytest.raises(ValueError, match=pattern):
            jnnx.BlockSparseConvTranspose(24, 24, (3, 3), mask, 8, transpose_kernel=True, rngs=nnx.Rngs(0))
        layer = jnnx.BlockSparseConvTranspose(24, 16, (3, 3), mask, 8, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=INPUTS_24 + r".*\(2, 4, 4, 16\)"):
            layer(jnp.ones((2, 4, 4, 16)))
        with pytest.raises(ValueError, match=r"padding must be one of \('SAME', 'VALID'\)"):
            layer = jnnx.BlockSparseConvTranspose(24, 16, (3, 3), mask, 8, padding="REFLECT", rngs=nnx.Rngs(0))
            layer(jnp.ones((1, 4, 4, 24)))
