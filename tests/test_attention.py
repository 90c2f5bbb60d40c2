"""blocksparse_attention against dense masked attention in float64, and the attention layouts.

The oracle never calls the library: it expands the block mask to a [T, T] boolean
(np.kron), adds the causal triangle, and runs plain softmax attention in float64
numpy, with empty rows giving zeros; its vjp and jvp are the analytic ones (numpy,
so the oracle compiles nothing). Forward values, the vjp for q, k, v (and bias) and
the jvp are compared. Every op call is jitted (a compile per case, no op-by-op
dispatch) and XLA's optimisation passes are skipped (the tests check values).

The module runs twice: on the native CPU kernels and on the pure-JAX reference lowering
(as tests/test_matmul.py does).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import (
    assert_close,
    collectives,
    cpu_mesh,
    rand,
    require_kernels,
    xla_optimizations_off,
)
from jax_blocksparse.attention import bias_blocks, blocksparse_attention

F32 = jnp.float32


@pytest.fixture(autouse=True, scope="module", params=["kernels", "reference"])
def implementation(request):
    """Every test on the CPU kernels and on the reference lowering (module scope: the
    compiled functions of one implementation stay cached between its tests)."""
    if request.param == "kernels":
        require_kernels("cpu")
    with jbs.config.implementation(request.param), xla_optimizations_off():
        yield request.param


# ---------------------------------------------------------------------------------
# The float64 oracle
# ---------------------------------------------------------------------------------


def dense_mask(mask, block_size, causal):
    """bool [H_m, T, T] from a [n, n] or [heads, n, n] block mask."""
    mask = np.asarray(mask).reshape((-1,) + np.shape(mask)[-2:])
    full = np.stack([np.kron(m, np.ones((block_size, block_size), bool)) for m in mask])
    if causal:
        full &= np.tril(np.ones(full.shape[-2:], bool))
    return full


def f64(a):
    return np.asarray(jnp.asarray(a, F32), np.float64)


def dense_probs(q, k, mask, block_size, causal=False, scale=None, bias=None):
    """float64 numpy softmax over each row's allowed keys: [B, H, T, T]; empty rows are 0."""
    q, k = f64(q), f64(k)
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if bias is not None:
        s = s + f64(bias)
    s = np.where(dense_mask(mask, block_size, causal)[None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - np.where(np.isfinite(m), m, 0))
    total = e.sum(-1, keepdims=True)
    return e / np.where(total > 0, total, 1), scale


def reference_vjp(q, k, v, ct, mask, block_size, **kw):
    """(out, (dq, dk, dv), dscores) of masked attention in float64 numpy (analytic vjp)."""
    p, scale = dense_probs(q, k, mask, block_size, **kw)
    v, ct = f64(v), f64(ct)
    out = p @ v
    dp = ct @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))  # d(scores incl. bias)
    dq = ds @ f64(k) * scale
    dk = np.swapaxes(ds, -1, -2) @ f64(q) * scale
    dv = np.swapaxes(p, -1, -2) @ ct
    return out, [dq, dk, dv], ds


def reference_jvp(q, k, v, tq, tk, tv, mask, block_size, **kw):
    """(out, tangent) of masked attention in float64 numpy."""
    p, scale = dense_probs(q, k, mask, block_size, **kw)
    ds = (f64(tq) @ np.swapaxes(f64(k), -1, -2) + f64(q) @ np.swapaxes(f64(tk), -1, -2)) * scale
    dp = p * (ds - (p * ds).sum(-1, keepdims=True))
    return p @ f64(v), dp @ f64(v) + p @ f64(tv)


def check(mask, block_size, shape, causal=False, dtype=F32, dv=None, seed=0, length=None):
    """Forward and the q, k, v vjp of the op (jitted) against the float64 oracle."""
    b, h, t, d = shape
    q, k = rand(shape, dtype, seed), rand(shape, dtype, seed + 1)
    v = rand((b, h, t, dv or d), dtype, seed + 2)
    ct = rand((b, h, t, dv or d), dtype, seed + 3)
    op = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, mask, block_size, causal=causal))
    out, pullback = jax.vjp(op, q, k, v)
    assert out.shape == v.shape and out.dtype == q.dtype
    grads = pullback(ct)
    want, want_grads, _ = reference_vjp(q, k, v, ct, mask, block_size, causal=causal)
    length = length or t
    assert_close(out, want, dtype, length)
    for name, got, ref in zip("qkv", grads, want_grads):
        assert got.dtype == dtype, name
        assert_close(got, ref, dtype, length)
    return out


# ---------------------------------------------------------------------------------
# Patterns, causal and not
# ---------------------------------------------------------------------------------

N = 8  # blocks per side: T = 8 * block_size
PATTERNS = {
    "local": lambda: jbs.layouts.local(N, 2),
    "strided": lambda: jbs.layouts.strided(N, 3),
    "fixed": lambda: jbs.layouts.fixed(N, 4, 1),
    "bigbird": lambda: jbs.layouts.bigbird(N, 2, 1, 1, seed=3),
    "random": lambda: jbs.layouts.random((N, N), 0.4, seed=1) | np.eye(N, dtype=bool),
    "full": lambda: np.ones((N, N), bool),
}


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_patterns(pattern, causal):
    mask = PATTERNS[pattern]()
    if causal:
        mask = jbs.layouts.causal(mask)
    check(mask, 16, (2, 2, N * 16, 16), causal=causal, seed=len(pattern))


def test_empty_rows_give_zeros_not_nan():
    mask = jbs.layouts.causal(jbs.layouts.local(N, 2))
    mask[3] = False  # query block 3 sees nothing
    out = check(mask, 16, (1, 2, N * 16, 16), causal=True)
    assert np.all(np.asarray(out)[:, :, 3 * 16 : 4 * 16] == 0)
    # The gradient of an empty row is zero too, not NaN.
    q, k, v = (rand((1, 2, N * 16, 16), F32, s) for s in range(3))
    grads = jax.jit(jax.grad(lambda q, k, v: blocksparse_attention(q, k, v, mask, 16, causal=True).sum(), (0, 1, 2)))(
        q, k, v
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_empty_mask():
    mask = np.zeros((4, 4), bool)
    q = rand((1, 2, 64, 16))
    out = jax.jit(lambda q: blocksparse_attention(q, q, q, mask, 16))(q)
    assert out.shape == q.shape and not np.asarray(out).any()
    grads = jax.jit(jax.grad(lambda q: blocksparse_attention(q, q, q, mask, 16).sum()))(q)
    assert not np.asarray(grads).any()


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_one_block(causal):
    check(np.ones((1, 1), bool), 32, (2, 1, 32, 16), causal=causal)


def test_per_head_masks():
    masks = np.stack([
        jbs.layouts.causal(jbs.layouts.local(N, 1)),  # 8 blocks
        jbs.layouts.causal(jbs.layouts.fixed(N, 4, 1)),  # more blocks: padding in the bias form
        jbs.layouts.causal(jbs.layouts.strided(N, 3)),
    ])
    check(masks, 16, (2, 3, N * 16, 16), causal=True)


def test_head_dim_80_and_distinct_value_dim():
    mask = jbs.layouts.causal(jbs.layouts.fixed(4, 2, 1))
    check(mask, 32, (1, 2, 128, 80), causal=True)
    check(mask, 32, (1, 2, 128, 80), causal=True, dv=48, seed=5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_16bit(dtype):
    mask = jbs.layouts.causal(jbs.layouts.strided(N, 3))
    # Probabilities are rounded to 16 bits before the product with v: looser tolerance.
    check(mask, 16, (1, 2, N * 16, 32), causal=True, dtype=dtype, length=4 * N * 16)


def test_block_64():
    mask = jbs.layouts.causal(jbs.layouts.fixed(4, 2, 1))
    check(mask, 64, (1, 1, 256, 64), causal=True)


# ---------------------------------------------------------------------------------
# Options: scale, bias, dropout, precision
# ---------------------------------------------------------------------------------


def test_scale_and_bias():
    masks = np.stack([jbs.layouts.local(N, 2), jbs.layouts.fixed(N, 4, 1)])
    shape = (2, 2, N * 16, 16)
    q, k, v = (rand(shape, F32, s) for s in range(3))
    dense_bias = rand((1, 2, N * 16, N * 16), F32, 7)
    bias = bias_blocks(dense_bias, masks, 16)
    assert bias.shape == (1, 2, int(masks.reshape(2, -1).sum(1).max()), 16, 16)

    def op(q, k, v, bias):
        return blocksparse_attention(q, k, v, masks, 16, scale=0.3, bias=bias)

    ct = rand(shape, F32, 9)
    def value_and_vjp(q, k, v, bias, ct):
        out, pullback = jax.vjp(op, q, k, v, bias)
        return out, pullback(ct)

    out, grads = jax.jit(value_and_vjp)(q, k, v, bias, ct)
    want, want_grads, dscores = reference_vjp(q, k, v, ct, masks, 16, scale=0.3, bias=dense_bias)
    assert_close(out, want, F32, 128)
    for got, ref in zip(grads[:3], want_grads):
        assert_close(got, ref, F32, 128)
    # The bias gradient is the score gradient at the present blocks (0 at padding).
    assert_close(grads[3], np.asarray(bias_blocks(dscores.sum(0, keepdims=True), masks, 16)), F32, 128)


def test_minus_inf_bias_row_gives_zeros():
    mask = jbs.layouts.local(4, 2)
    q = rand((1, 1, 64, 16))
    dense_bias = np.zeros((1, 1, 64, 64), np.float32)
    dense_bias[..., 5, :] = -np.inf
    out = jax.jit(lambda q, b: blocksparse_attention(q, q, q, mask, 16, bias=b))(q, bias_blocks(dense_bias, mask, 16))
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out)[0, 0, 5].any()


def test_dropout():
    mask = jbs.layouts.causal(jbs.layouts.local(N, 3))
    q, k, v = (rand((2, 2, N * 16, 16), F32, s) for s in range(3))
    key = jax.random.key(0)
    op = jax.jit(lambda q, k, v, key: blocksparse_attention(q, k, v, mask, 16, causal=True, dropout_rate=0.5,
                                                             dropout_rng=key))
    a, b = op(q, k, v, key), op(q, k, v, key)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # deterministic in the key
    c = op(q, k, v, jax.random.key(1))
    plain = jax.jit(lambda q, k, v: blocksparse_attention(q, k, v, mask, 16, causal=True))(q, k, v)
    assert not np.allclose(np.asarray(a), np.asarray(c)) and not np.allclose(np.asarray(a), np.asarray(plain))
    # Inverted dropout keeps the expectation: v = 1 gives outputs whose mean over keys is 1.
    ones = jnp.ones_like(v)
    mean = np.asarray(op(q, k, ones, key)).mean()
    assert abs(mean - 1.0) < 0.05, mean
    grads = jax.jit(jax.grad(lambda q: op(q, k, v, key).sum()))(q)
    assert np.isfinite(np.asarray(grads)).all()


# ---------------------------------------------------------------------------------
# Transformations
# ---------------------------------------------------------------------------------


def test_vmap_and_jvp():
    mask = jbs.layouts.causal(jbs.layouts.fixed(N, 4, 1))
    shape = (3, 1, 2, N * 16, 16)  # an extra leading axis, vmapped
    q, k, v = (rand(shape, F32, s) for s in range(3))

    def op(q, k, v):
        return blocksparse_attention(q, k, v, mask, 16, causal=True)

    got = jax.jit(jax.vmap(op))(q, k, v)
    for i in range(3):
        assert_close(got[i], reference_vjp(q[i], k[i], v[i], v[i], mask, 16, causal=True)[0], F32, 128)

    tq, tk, tv = (rand(shape[1:], F32, s + 10) for s in range(3))
    out, tangent = jax.jit(lambda p, t: jax.jvp(op, p, t))((q[0], k[0], v[0]), (tq, tk, tv))
    want_out, want_tangent = reference_jvp(q[0], k[0], v[0], tq, tk, tv, mask, 16, causal=True)
    assert_close(out, want_out, F32, 128)
    assert_close(tangent, want_tangent, F32, 128)
    # vmap of the gradient: each problem's gradient is its own vjp with a ones cotangent.
    grads = jax.jit(jax.vmap(jax.grad(lambda q, k, v: op(q, k, v).sum())))(q, k, v)
    want = reference_vjp(q[1], k[1], v[1], np.ones(shape[1:]), mask, 16, causal=True)[1][0]
    assert_close(grads[1], want, F32, 128)


def _all_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from _all_avals(getattr(inner, "jaxpr", inner))


def test_nothing_t_by_t():
    """No intermediate of forward + backward has T x T elements per head."""
    t, bs = 512, 32
    mask = jbs.layouts.causal(jbs.layouts.local(t // bs, 2))  # 31 of 256 blocks
    shape = (1, 2, t, 16)
    q, k, v = (rand(shape, F32, s) for s in range(3))

    def loss(q, k, v):
        return blocksparse_attention(q, k, v, mask, bs, causal=True).sum()

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    largest = max(int(np.prod(a.shape)) for a in _all_avals(jaxpr.jaxpr) if hasattr(a, "shape"))
    nnz = int(mask.sum())
    assert largest == 2 * nnz * bs * bs  # the scores (of both heads) are the largest arrays
    assert largest < 2 * t * t / 4
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile()
    memory = compiled.memory_analysis()
    if memory is not None:
        dense_scores = 2 * t * t * 4  # one float32 [heads, T, T]
        assert memory.temp_size_in_bytes < dense_scores, memory


@pytest.mark.usefixtures("cpu_default_device")
def test_jit_over_a_batch_sharded_mesh():
    """Under jit of batch-sharded inputs each device attends its own rows: no all-gather, the
    one-device values and gradients, and a different dropout mask on every device."""
    mask = jbs.layouts.causal(jbs.layouts.fixed(4, 2, 1))
    mesh = cpu_mesh((8,), ("batch",))
    shape = (8, 2, 64, 16)
    q, k, v, ct = (rand(shape, F32, s) for s in range(4))

    def loss(q, k, v):
        return jnp.vdot(blocksparse_attention(q, k, v, mask, 16, causal=True), ct)

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in (q, k, v)]
    assert collectives(step.lower(*sharded).compile().as_text())["all-gather"] == []
    got, want = step(*sharded), step(q, k, v)
    assert_close(got[0], np.asarray(want[0]), F32, 64)
    for g, w in zip(got[1], want[1]):
        assert_close(g, np.asarray(w), F32, 64)

    ones = jax.device_put(jnp.ones(shape), NamedSharding(mesh, P("batch")))
    dropped = jax.jit(lambda q, v: blocksparse_attention(q, q, v, mask, 16, causal=True, dropout_rate=0.5,
                                                          dropout_rng=jax.random.key(0)))(ones, ones)
    # One batch row per device, equal inputs: with one key for all devices every row would get the same mask.
    rows = np.asarray(dropped)
    assert not np.array_equal(rows[0], rows[1])


# ---------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------


def test_bad_inputs():
    mask = jbs.layouts.local(4, 2)
    q = rand((1, 2, 64, 16))
    with pytest.raises(ValueError, match="q must be"):
        blocksparse_attention(q[0], q[0], q[0], mask, 16)
    with pytest.raises(ValueError, match="k must have"):
        blocksparse_attention(q, q[..., :8], q, mask, 16)
    with pytest.raises(ValueError, match="v must be"):
        blocksparse_attention(q, q, q[:, :, :32], mask, 16)
    with pytest.raises(TypeError, match="one dtype"):
        blocksparse_attention(q, q, q.astype(jnp.bfloat16), mask, 16)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        blocksparse_attention(q.astype(jnp.int32), q, q, mask, 16)
    with pytest.raises(ValueError, match="multiple of block_size"):
        blocksparse_attention(q[:, :, :56], q[:, :, :56], q[:, :, :56], mask, 16)
    with pytest.raises(ValueError, match="block_size must be one of"):
        blocksparse_attention(q, q, q, mask, 12)
    with pytest.raises(ValueError, match="does not match T=64"):
        blocksparse_attention(q, q, q, jbs.layouts.local(8, 2), 16)
    with pytest.raises(ValueError, match=r"\[T/bs, T/bs\]"):
        blocksparse_attention(q, q, q, np.ones((4, 8), bool), 16)
    with pytest.raises(ValueError, match="heads=2"):
        blocksparse_attention(q, q, q, np.ones((3, 4, 4), bool), 16)
    with pytest.raises(TypeError, match="boolean"):
        blocksparse_attention(q, q, q, mask.astype(np.int32), 16)
    with pytest.raises(ValueError, match="above the diagonal"):
        blocksparse_attention(q, q, q, mask, 16, causal=True)
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda m: blocksparse_attention(q, q, q, m, 16))(mask)
    with pytest.raises(ValueError, match="dropout_rng"):
        blocksparse_attention(q, q, q, mask, 16, dropout_rate=0.1)
    with pytest.raises(ValueError, match="dropout_rate"):
        blocksparse_attention(q, q, q, mask, 16, dropout_rate=1.0, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="bias must be"):
        blocksparse_attention(q, q, q, mask, 16, bias=jnp.zeros((1, 2, 64, 64)))


# ---------------------------------------------------------------------------------
# Layout generators
# ---------------------------------------------------------------------------------


def test_layout_generators():
    L = jbs.layouts
    n = 12
    d = np.subtract.outer(np.arange(n), np.arange(n))
    np.testing.assert_array_equal(L.local(n, 3), np.abs(d) <= 2)
    np.testing.assert_array_equal(L.local(n, 1), np.eye(n, dtype=bool))
    s = L.strided(n, 4)
    assert s[8, 0] and s[0, 8] and s[5, 3] and not s[5, 0]
    f = L.fixed(n, 4, 1)
    assert f[5, 4] and f[5, 7] and f[0, 3] and f[0, 11] and not f[0, 4] and not f[5, 2]
    b = L.bigbird(n, 2, 1, 2, seed=0)
    assert b[0].all() and b[:, 0].all()
    base = (np.abs(d) <= 1) | (np.arange(n) == 0)[None, :]  # window and global column
    np.testing.assert_array_equal(b[1:].sum(1), np.minimum(base[1:].sum(1) + 2, n))  # + 2 random each
    assert (b >= base).all()
    np.testing.assert_array_equal(L.bigbird(n, 2, 1, 2, seed=0), b)  # seeded
    c = L.causal(f)
    assert not np.triu(c, 1).any() and (np.tril(f) == c).all()
    assert L.causal(np.stack([f, s])).shape == (2, n, n)
    for bad in (lambda: L.local(4, 0), lambda: L.strided(4, 0), lambda: L.fixed(4, 2, 3),
                lambda: L.bigbird(4, 1, 5, 0), lambda: L.causal(np.ones((3, 4), bool))):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        L.local(4.5, 1)
