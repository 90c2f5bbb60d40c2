"""BlockSparseSelfAttention (linen and NNX): the math, jit/grad/vmap, dropout, projections, GQA, decoding, errors.

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
MASK = jbs.layouts.fixed(4, 2, 1)  # T = 64
T, F, HEADS = 4 * BS, 32, 2


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    with xla_optimizations_off():
        yield


def oracle(params, x, mask, num_heads, causal=True, num_kv_heads=None, segments=None):
    """The layer by hand in float64 numpy; params: {name: {"kernel": [in, out], "bias": [out]}}."""
    x = np.asarray(x, np.float64)

    def dense(name, a):
        p = params[name]
        out = a @ np.asarray(p["kernel"], np.float64)
        return out + np.asarray(p["bias"], np.float64) if "bias" in p else out

    q, k, v = (dense(n, x) for n in ("query", "key", "value"))
    *lead, t, f = q.shape
    d = f // num_heads
    kv_heads = num_kv_heads or num_heads

    def heads(a, h):  # [..., T, h*d] -> [..., num_heads, T, d], each key head repeated for its query heads
        a = a.reshape(*lead, t, h, d).swapaxes(-2, -3)
        return np.repeat(a, num_heads // h, axis=-3)

    q, k, v = heads(q, num_heads), heads(k, kv_heads), heads(v, kv_heads)
    s = q @ k.swapaxes(-1, -2) / np.sqrt(d)
    allowed = np.kron(np.asarray(mask).reshape(-1, *np.shape(mask)[-2:]), np.ones((BS, BS), bool))
    if causal:
        allowed = allowed & np.tril(np.ones((t, t), bool))
    if segments is not None:
        seg = np.asarray(segments)
        allowed = allowed & (seg[..., None, :, None] == seg[..., None, None, :])
    s = np.where(allowed, s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    y = (e / e.sum(-1, keepdims=True)) @ v
    return dense("out", y.swapaxes(-2, -3).reshape(*lead, t, f))


def linen_layer(**kw):
    return jbs.nn.BlockSparseSelfAttention(num_heads=HEADS, mask=MASK, block_size=BS, is_causal=True, **kw)


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
    dense_params = {
        "params": {
            n: {
                "kernel": p["kernel"].reshape(F, HEADS, F // HEADS)
                if n != "out"
                else p["kernel"].reshape(HEADS, F // HEADS, F),
                "bias": p["bias"].reshape(HEADS, F // HEADS) if n != "out" else p["bias"],
            }
            for n, p in params["params"].items()
        }
    }
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
    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, is_causal=True, rngs=nnx.Rngs(0))
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
    layer = jbs.nn.BlockSparseSelfAttention(HEADS, per_head, BS, is_causal=True, qkv_mask=qkv_mask, out_mask=out_mask)
    x = rand((2, T, F), F32, 2)
    params = layer.init(jax.random.key(0), x)["params"]
    assert params["query"]["kernel"].shape == (int(qkv_mask.sum()), BS, BS)
    assert params["out"]["kernel"].shape == (int(out_mask.sum()), BS, BS)
    dense = {
        n: {
            "kernel": jbs.to_dense(p["kernel"], jbs.Layout.from_mask(qkv_mask if n != "out" else out_mask, BS)),
            "bias": p["bias"],
        }
        for n, p in params.items()
    }
    y = jax.jit(layer.apply)({"params": params}, x)
    assert_close(y, oracle(dense, x, per_head, HEADS), F32, T)

    model = jbs.nnx.BlockSparseSelfAttention(
        HEADS, F, per_head, BS, is_causal=True, qkv_mask=qkv_mask, out_mask=out_mask, rngs=nnx.Rngs(0)
    )
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

    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, is_causal=True, dropout_rate=0.5, rngs=nnx.Rngs(0))
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


def test_grouped_query_heads_mask_fn_score_fn_and_segments():
    """num_kv_heads < num_heads, a token-level mask and score function, and packed
    documents: linen against the oracle, NNX against linen."""
    slopes = jnp.asarray([0.25, 0.5, 1.0, 2.0])

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx) / T

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 40

    kw = dict(is_causal=True, num_kv_heads=2, mask_fn=window, score_fn=alibi)
    layer = jbs.nn.BlockSparseSelfAttention(4, MASK, BS, **kw)
    x = rand((2, T, F), F32, 6)
    seg = np.repeat([[0, 1], [0, 0]], [20, 44], axis=1)  # batch row 0: two documents
    params = layer.init(jax.random.key(0), x)["params"]
    assert params["key"]["kernel"].shape == (F, F // 2)  # 2 key heads of head_dim 8
    y = jax.jit(lambda p, x, s: layer.apply({"params": p}, x, segment_ids=s))(params, x, seg)

    q_i, kv_i = np.arange(T)[:, None], np.arange(T)[None, :]
    bias = -np.asarray(slopes)[:, None, None] * (q_i - kv_i) / T  # [H, T, T]
    allowed = np.kron(MASK, np.ones((BS, BS), bool)) & (q_i - kv_i < 40) & (q_i >= kv_i)
    allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
    p = {n: {k: jnp.asarray(a) for k, a in d.items()} for n, d in params.items()}

    def dense(x):
        q = (x @ p["query"]["kernel"] + p["query"]["bias"]).reshape(2, T, 4, 8)
        k = (x @ p["key"]["kernel"] + p["key"]["bias"]).reshape(2, T, 2, 8)
        v = (x @ p["value"]["kernel"] + p["value"]["bias"]).reshape(2, T, 2, 8)
        out = jax.nn.dot_product_attention(q, k, v, bias=jnp.asarray(bias, F32)[None], mask=jnp.asarray(allowed))
        return out.reshape(2, T, F) @ p["out"]["kernel"] + p["out"]["bias"]

    assert_close(y, np.asarray(dense(x)), F32, T)
    model = jbs.nnx.BlockSparseSelfAttention(4, F, MASK, BS, rngs=nnx.Rngs(0), **kw)
    for name in ("query", "key", "value", "out"):
        getattr(model, name).kernel[...] = params[name]["kernel"]
        getattr(model, name).bias[...] = params[name]["bias"]
    assert_close(model(x, segment_ids=seg), np.asarray(y), F32, T)


def test_linen_decoding_equals_the_full_sequence_row_by_row():
    """decode=True: init makes Flax's cache collection; feeding the tokens one at a time
    gives the full-sequence outputs, row by row (GQA and a bfloat16 layer too)."""
    for dtype, kv_heads in ((F32, HEADS), (jnp.bfloat16, 1)):
        layer = linen_layer(num_kv_heads=kv_heads, dtype=dtype)
        x = rand((2, T, F), F32, 7)
        params = layer.init(jax.random.key(0), x)
        full = jax.jit(layer.apply)(params, x)
        decoder = layer.clone(decode=True)
        cache = decoder.init(jax.random.key(0), x)["cache"]
        assert set(cache) == {"cached_key", "cached_value", "cache_index"}
        assert cache["cached_key"].shape == (2, T, kv_heads, F // HEADS) and int(cache["cache_index"]) == 0

        @jax.jit
        def step(cache, token):
            y, state = decoder.apply({**params, "cache": cache}, token, mutable=["cache"])
            return y, state["cache"]

        rows = []
        for t in range(T):
            y, cache = step(cache, x[:, t : t + 1])
            rows.append(y[:, 0])
        assert int(cache["cache_index"]) == T
        assert_close(jnp.stack(rows, 1), np.asarray(full, np.float32), dtype, 4 * T if dtype != F32 else T)


def test_nnx_decoding_equals_the_full_sequence_row_by_row():
    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, is_causal=True, num_kv_heads=1, rngs=nnx.Rngs(0))
    x = rand((2, T, F), F32, 8)
    full = model(x)
    with pytest.raises(ValueError, match="init_cache"):
        model(x[:, :1], decode=True)
    model.init_cache(x.shape)
    assert model.cached_key.shape == (2, T, 1, F // HEADS)
    step = nnx.jit(lambda m, token: m(token, decode=True))
    rows = [step(model, x[:, t : t + 1])[:, 0] for t in range(T)]
    assert int(model.cache_index[...]) == T
    assert_close(jnp.stack(rows, 1), np.asarray(full), F32, T)


def test_bad_configurations():
    x = rand((2, T, F), F32, 5)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        jbs.nn.BlockSparseSelfAttention(3, MASK, BS, is_causal=True).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="num_heads must be"):
        jbs.nn.BlockSparseSelfAttention(0, MASK, BS)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        jbs.nn.BlockSparseSelfAttention(HEADS, MASK, BS, num_kv_heads=3)
    with pytest.raises(ValueError, match="needs num_kv_heads == num_heads"):
        jbs.nn.BlockSparseSelfAttention(HEADS, MASK, BS, num_kv_heads=1, qkv_mask=np.ones((2, 2), bool))
    with pytest.raises(ValueError, match="T=64"):
        linen_layer().init(jax.random.key(0), x[:, :32])
    with pytest.raises(ValueError, match="qkv_mask must have shape"):
        linen_layer(qkv_features=F, qkv_mask=np.ones((3, 2), bool)).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="heads=2"):
        jbs.nn.BlockSparseSelfAttention(HEADS, np.stack([MASK] * 3), BS, is_causal=True)
    with pytest.raises(ValueError, match="square grid"):
        jbs.nn.BlockSparseSelfAttention(HEADS, np.ones((4, 2), bool), BS)
    with pytest.raises(TypeError, match="boolean"):
        jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK.astype(int), BS, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="block_size is required"):
        jbs.nn.BlockSparseSelfAttention(HEADS, MASK)
    with pytest.raises(TypeError, match="score_fn must return a float"):
        jbs.nn.BlockSparseSelfAttention(HEADS, MASK, BS, score_fn=lambda s, b, h, i, j: i > j)
    with pytest.raises(ValueError, match="dropout_rate"):
        jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, dropout_rate=1.5, rngs=nnx.Rngs(0))
    model = jbs.nnx.BlockSparseSelfAttention(HEADS, F, MASK, BS, is_causal=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=32"):
        model(jnp.ones((2, T, 16)))
    with pytest.raises(ValueError, match="init_cache needs input_shape"):
        model.init_cache((2, 32, F))
    model.init_cache((2, T, F))
    with pytest.raises(ValueError, match="one token per decoding step"):
        model(x, decode=True)
    bidirectional = jbs.nn.BlockSparseSelfAttention(HEADS, MASK, BS, decode=True)
    variables = bidirectional.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="decoding needs is_causal=True"):
        bidirectional.apply(variables, x[:, :1], mutable=["cache"])
