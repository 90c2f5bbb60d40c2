"""BlockSparseSelfAttention (linen and NNX): the math, jit/grad/vmap, dropout, projections, errors.

The oracle rebuilds the layer by hand from its parameters: dense projections, the heads
split, masked softmax attention in float64 numpy over the expanded block mask, and the
output projection. Data parallelism is in tests/test_multidevice_layers.py.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import assert_close, rand, xla_optimizations_off

F32 = jnp.float32
BS = 16
MASK = jbs.layouts.causal(jbs.layouts.fixed(4, 2, 1))  # T = 64
T, F, HEADS = 4 * BS, 32, 2


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    with xla_optimizations_off():
        yield


def oracle(params, x, mask, num_heads, causal=True):
    """The layer by hand in float64 numpy; params: {name: {"kernel": [in, out], "bias": [out]}}."""
    x = np.asarray(x, np.float64)

    def dense(name, a):
        p = params[name]
        out = a @ np.asarray(p["kernel"], np.float64)
        return out + np.asarray(p["bias"], np.float64) if "bias" in p else out

    q, k, v = (dense(n, x) for n in ("query", "key", "value"))
    *lead, t, f = q.shape
    def heads(a):
        return a.reshape(*lead, t, num_heads, f // num_heads).swapaxes(-2, -3)
    q, k, v = heads(q), heads(k), heads(v)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(f // num_heads)
    allowed = np.kron(np.asarray(mask).reshape(-1, *np.shape(mask)[-2:]), np.ones((BS, BS), bool))
    if causal:
        allowed = allowed & np.tril(np.ones((t, t), bool))
    s = np.where(allowed, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    y = (e / e.sum(-1, keepdims=True)) @ v
    return dense("out", y.swapaxes(-2, -3).reshape(*lead, t, f))


def linen_layer(**kw):
    return jbs.nn.BlockSparseSelfAttention(num_heads=HEADS, mask=MASK, block_size=BS, causal=True, **kw)


def test_linen_matches_oracle_under_jit_grad_vmap():
    layer = linen_layer()
    x = rand((3, T, F), F32, 0)
    params = jax.jit(layer.init)(jax.random.key(0), x)
    y = jax.jit(layer.apply)(params, x)
    assert y.shape == (3, T, F) and y.dtype == F32
    assert_close(y, oracle(params["params"], x, MASK, HEADS), F32, T)

    # Extra leading dims and vmap give the same rows.
    x4 = x.reshape(3, 1, T, F)
    assert_close(jax.jit(layer.apply)(params, x4)[:, 0], np.asarray(y), F32, T)
    vmapped = jax.jit(jax.vmap(layer.apply, in_axes=(None, 0)))(params, x)
    assert_close(vmapped, np.asarray(y), F32, T)

    # Gradients: finite, and equal to the gradient of the float32 dense oracle in jax.
    def loss(p, x):
        return jnp.mean(jnp.sin(layer.apply(p, x)) ** 2)

    grads = jax.jit(jax.grad(loss))(params, x)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    dense_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=F, out_features=F)
    dense_params = {"params": {n: {"kernel": p["kernel"].reshape(F, HEADS, F // HEADS) if n != "out"
                                   else p["kernel"].reshape(HEADS, F // HEADS, F),
                                   "bias": p["bias"].reshape(HEADS, F // HEADS) if n != "out" else p["bias"]}
                               for n, p in params["params"].items()}}
    causal_mask = jnp.asarray(np.kron(MASK, np.ones((BS, BS), bool)) & np.tril(np.ones((T, T), bool)))

    def dense_loss(p, x):
        return jnp.mean(jnp.sin(dense_layer.apply(p, x, mask=causal_mask)) ** 2)

    dense_grads = jax.jit(jax.grad(dense_loss))(dense_params, x)
    for name in ("query", "key", "value", "out"):
        got = grads["params"][name]["kernel"]
        assert_close(got, np.asarray(dense_grads["params"][name]["kernel"]).reshape(got.shape), F32, T)


def test_nnx_equals_linen_with_the_same_params():
    x = rand((2, T, F), F32, 1)
    layer = linen_layer()
    params = layer.init(jax.random.key(0), x)["params"]
    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, causal=True, rngs=nnx.Rngs(0))
    for name in ("query", "key", "value", "out"):
        getattr(model, name).kernel[...] = params[name]["kernel"]
        getattr(model, name).bias[...] = params[name]["bias"]
    want = layer.apply({"params": params}, x)
    assert_close(nnx.jit(lambda m, x: m(x))(model, x), np.asarray(want), F32, T)
    grads = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(model, x)
    assert np.isfinite(np.asarray(grads.query.kernel[...])).all()
    # vmap over a batch axis of inputs (the module broadcast)
    vmapped = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, x[:, None])
    assert_close(vmapped[:, 0], np.asarray(want), F32, T)


def test_block_sparse_projections_and_per_head_masks():
    qkv_mask = jbs.layouts.random((F // BS, 4), 0.75, seed=1) | np.eye(F // BS, 4, dtype=bool)  # 32 -> 64
    out_mask = np.ones((4, F // BS), bool)
    per_head = np.stack([MASK, jbs.layouts.causal(jbs.layouts.local(4, 1))])
    layer = jbs.nn.BlockSparseSelfAttention(HEADS, per_head, BS, causal=True, qkv_mask=qkv_mask, out_mask=out_mask)
    x = rand((2, T, F), F32, 2)
    params = layer.init(jax.random.key(0), x)["params"]
    assert params["query"]["kernel"].shape == (int(qkv_mask.sum()), BS, BS)
    assert params["out"]["kernel"].shape == (int(out_mask.sum()), BS, BS)
    dense = {
        n: {"kernel": jbs.to_dense(p["kernel"], jbs.Layout.from_mask(qkv_mask if n != "out" else out_mask, BS)),
            "bias": p["bias"]}
        for n, p in params.items()
    }
    y = jax.jit(layer.apply)({"params": params}, x)
    assert_close(y, oracle(dense, x, per_head, HEADS), F32, T)

    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, per_head, BS, causal=True, qkv_mask=qkv_mask,
                                             out_mask=out_mask, rngs=nnx.Rngs(0))
    assert isinstance(model.query, jbs.nnx.BlockSparseLinear) and model(x).shape == (2, T, F)


def test_dropout_and_deterministic():
    x = rand((2, T, F), F32, 3)
    layer = linen_layer(dropout_rate=0.5)
    params = layer.init(jax.random.key(0), x, deterministic=True)
    apply = jax.jit(layer.apply, static_argnames="deterministic")
    plain = apply(params, x, deterministic=True)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(linen_layer().apply(params, x)))
    a = apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    b = apply(params, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
    assert not np.allclose(np.asarray(a), np.asarray(plain)) and not np.allclose(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="deterministic"):
        layer.apply(params, x)

    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, causal=True, dropout_rate=0.5, rngs=nnx.Rngs(0))
    first, second = model(x), model(x)  # the kept stream advances: two masks
    assert not np.allclose(np.asarray(first), np.asarray(second))
    np.testing.assert_array_equal(np.asarray(model(x, deterministic=True)), np.asarray(model(x, deterministic=True)))


def test_bfloat16():
    layer = linen_layer(dtype=jnp.bfloat16)
    x = rand((2, T, F), F32, 4)
    params = layer.init(jax.random.key(0), x)
    y = jax.jit(layer.apply)(params, x)
    assert y.dtype == jnp.bfloat16
    assert_close(y, oracle(params["params"], x, MASK, HEADS), jnp.bfloat16, 4 * T)


def test_bad_configurations():
    x = rand((2, T, F), F32, 5)
    with pytest.raises(ValueError, match="above the diagonal"):
        jbs.nn.BlockSparseSelfAttention(HEADS, jbs.layouts.fixed(4, 2, 1), BS, causal=True).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        jbs.nn.BlockSparseSelfAttention(3, MASK, BS, causal=True).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="num_heads must be"):
        jbs.nn.BlockSparseSelfAttention(0, MASK, BS)
    with pytest.raises(ValueError, match="T=64"):
        linen_layer().init(jax.random.key(0), x[:, :32])
    with pytest.raises(ValueError, match="qkv_mask must have shape"):
        linen_layer(qkv_features=F, qkv_mask=np.ones((3, 2), bool)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="heads=2"):
        jbs.nn.BlockSparseSelfAttention(HEADS, np.stack([MASK] * 3), BS, causal=True)
    with pytest.raises(TypeError, match="boolean"):
        jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK.astype(int), BS, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="dropout_rate"):
        jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, dropout_rate=1.5, rngs=nnx.Rngs(0))
    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=32"):
        model(jnp.ones((2, T, 16)))
