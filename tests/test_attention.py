"""blocksparse_attention and blocksparse_decode against jax.nn.dot_product_attention with the dense mask.

The reference is ``jax.nn.dot_product_attention`` (XLA) given the [B, H, T_q, T_kv] boolean
mask that the block mask and the token-level masks mean, expanded in numpy here (np.kron
of the tile grid, the causal triangle, mask functions evaluated on index grids), never by
the library. Values and the vjp for query, key and value are compared under ``jit``;
every query row compared has an allowed key (the dense op averages over all keys on an
empty row, where the block-sparse one gives zeros: tested on its own). XLA's
optimisation passes are skipped (the tests check values).

Most tests run on the default implementation (the native CPU kernels where built); a
few run on the pure-JAX reference lowering too (``impl=``).
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
    eqns_named,
    jaxprs_in_params,
    rand,
    require_kernels,
    xla_optimizations_off,
)

F32, BF16 = jnp.float32, jnp.bfloat16
att = jbs.attention


@pytest.fixture(autouse=True, scope="module")
def fast_compiles():
    with xla_optimizations_off():
        yield


# ---------------------------------------------------------------------------------
# The dense reference
# ---------------------------------------------------------------------------------


def expand(blocks, block_size, batch=1, heads=1):
    """bool [B|1, H|1, T_q, T_kv] from a tile grid [n_q, n_kv], [H, ...] or [B, H, ...]."""
    blocks = np.asarray(blocks)
    blocks = blocks.reshape((1,) * (4 - blocks.ndim) + blocks.shape)
    return np.kron(blocks, np.ones((1, 1, block_size, block_size), bool))


def causal(t_q, t_kv):
    return np.tril(np.ones((t_q, t_kv), bool))


def on_grid(fn, batch, heads, t_q, t_kv):
    """fn(b, h, q, kv) on the full index grid: [batch, heads, T_q, T_kv] (numpy)."""
    b, h, q, kv = np.ix_(np.arange(batch), np.arange(heads), np.arange(t_q), np.arange(t_kv))
    return np.broadcast_to(np.asarray(fn(b, h, q, kv)), (batch, heads, t_q, t_kv))


def qkv(batch, t_q, heads, dim, t_kv=None, kv_heads=None, dtype=F32, seed=0):
    t_kv, kv_heads = t_kv or t_q, kv_heads or heads
    return (
        rand((batch, t_q, heads, dim), dtype, seed),
        rand((batch, t_kv, kv_heads, dim), dtype, seed + 1),
        rand((batch, t_kv, kv_heads, dim), dtype, seed + 2),
    )


def compare(op, allowed, args, dtype=F32, bias=None, scale=None, rows=None, **dense_kw):
    """op(q, k, v) against jax.nn.dot_product_attention(q, k, v, mask=allowed): values and vjp.

    ``rows``: bool [B, T_q] of query rows to compare (default: all). The reference runs in
    float32 on the same (rounded) inputs; the tolerance is ``dtype``'s.
    """
    q, k, v = args
    keep = np.ones(q.shape[:2], bool) if rows is None else rows
    # Rows left out of the comparison get no cotangent: their gradients are not compared either.
    ct = rand(q.shape[:3] + v.shape[3:], dtype, 99) * jnp.asarray(keep, dtype)[:, :, None, None]

    def dense(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, bias=bias, mask=jnp.asarray(allowed), scale=scale, implementation="xla", **dense_kw
        )

    def value_and_vjp(f, *a):
        out, pullback = jax.vjp(f, *a)
        return out, pullback(ct.astype(out.dtype))

    got, grads = jax.jit(value_and_vjp, static_argnums=0)(op, q, k, v)
    up = [a.astype(F32) for a in (q, k, v)]
    want, want_grads = jax.jit(value_and_vjp, static_argnums=0)(dense, *up)
    assert got.shape == want.shape and got.dtype == q.dtype
    length = k.shape[1] * (4 if dtype != F32 else 1)
    assert_close(np.asarray(got, np.float32)[keep], np.asarray(want)[keep], dtype, length)
    for name, g, w in zip(("query", "key", "value"), grads, want_grads):
        assert g.dtype == dtype, name
        assert_close(g, np.asarray(w), dtype, length)
    return got


# ---------------------------------------------------------------------------------
# Patterns, heads, shapes
# ---------------------------------------------------------------------------------

N, BS = 8, 16  # blocks per side, block size: T = 128
T = N * BS
PATTERNS = {
    "local": lambda: jbs.layouts.local(N, 2),
    "strided": lambda: jbs.layouts.strided(N, 3),
    "fixed": lambda: jbs.layouts.fixed(N, 4, 1),
    "bigbird": lambda: jbs.layouts.bigbird(N, 2, 1, 1, seed=3),
    "random": lambda: jbs.layouts.random((N, N), 0.4, seed=1) | np.eye(N, dtype=bool),
    "full": lambda: np.ones((N, N), bool),
}


@pytest.mark.parametrize(
    "pattern, is_causal", [(p, True) for p in sorted(PATTERNS)] + [("fixed", False), ("bigbird", False)]
)
def test_patterns(pattern, is_causal):
    mask = PATTERNS[pattern]()
    allowed = expand(mask, BS) & (causal(T, T) if is_causal else True)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=is_causal),
        allowed,
        qkv(2, T, 2, 16, seed=len(pattern)),
    )


@pytest.mark.parametrize("impl", ["kernels", "reference"])
@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa"])
def test_grouped_and_multi_query_with_per_head_masks(kv_heads, impl):
    if impl == "kernels":
        require_kernels("cuda" if jax.default_backend() == "gpu" else "cpu")
    masks = np.stack(
        [jbs.layouts.local(N, 1), jbs.layouts.fixed(N, 4, 1), jbs.layouts.strided(N, 3), jbs.layouts.local(N, 3)]
    )
    allowed = expand(masks, BS) & causal(T, T)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, masks, BS, is_causal=True, impl=impl),
        allowed,
        qkv(2, T, 4, 16, kv_heads=kv_heads),
    )


def test_cross_attention_rectangular_mask():
    t_q, t_kv = 64, 128
    mask = jbs.layouts.banded((t_q // BS, t_kv // BS), 1)
    mask[:, 0] = True  # a global first key block: every causal row has a key
    args = qkv(2, t_q, 2, 16, t_kv=t_kv)
    compare(lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS), expand(mask, BS), args)
    # Causal cross-attention is top-left aligned, as in jax.nn (query i sees keys j <= i).
    allowed = expand(mask, BS) & causal(t_q, t_kv)
    compare(lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=True), allowed, args)


def test_head_dim_80_and_block_64():
    mask = jbs.layouts.fixed(4, 2, 1)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, 64, is_causal=True),
        expand(mask, 64) & causal(256, 256),
        qkv(1, 256, 2, 80),
    )


def test_bfloat16():
    mask = jbs.layouts.strided(N, 3)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=True),
        expand(mask, BS) & causal(T, T),
        qkv(2, T, 4, 32, kv_heads=2, dtype=BF16),
        dtype=BF16,
    )


def test_per_batch_block_mask():
    masks = np.stack([jbs.layouts.local(N, 2), jbs.layouts.fixed(N, 4, 1)])[:, None]  # [B, 1, n, n]
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, masks, BS, is_causal=True),
        expand(masks, BS) & causal(T, T),
        qkv(2, T, 2, 16),
    )


# ---------------------------------------------------------------------------------
# Token-level masks and score functions
# ---------------------------------------------------------------------------------


def sliding_window(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 40)


def prefix_lm(b, h, q_idx, kv_idx):  # the first 48 tokens see each other; the rest is causal
    return (kv_idx <= q_idx) | (kv_idx < 48)


@pytest.mark.parametrize("fn", [sliding_window, prefix_lm], ids=lambda f: f.__name__)
def test_mask_fn_through_create_block_mask(fn):
    mask = att.create_block_mask(fn, None, None, T, T, BS)
    # A tile is present where fn holds somewhere in it and full where it holds everywhere.
    grid = on_grid(fn, 1, 1, T, T).reshape(N, BS, N, BS)
    np.testing.assert_array_equal(mask.blocks[0, 0], grid.any((1, 3)))
    np.testing.assert_array_equal(mask.full[0, 0], grid.all((1, 3)))
    assert 0 < mask.full.sum() < mask.blocks.sum()
    compare(lambda q, k, v: att.blocksparse_attention(q, k, v, mask), on_grid(fn, 1, 1, T, T), qkv(2, T, 2, 16))


def test_full_tiles_skip_the_mask_fn():
    """A mask_fn that would mask everything is not evaluated in tiles declared full."""
    blocks = jbs.layouts.local(N, 2)
    full = np.eye(N, dtype=bool)
    mask = att.BlockMask(blocks, BS, full=full, mask_fn=lambda b, h, q, kv: q < 0)  # never true
    compare(lambda q, k, v: att.blocksparse_attention(q, k, v, mask), expand(full, BS), qkv(1, T, 2, 16))


def test_mask_fn_per_head_and_batch_with_causal():
    def fn(b, h, q_idx, kv_idx):  # head 1 and batch row 1 see a shorter window
        return q_idx - kv_idx < 24 + 24 * (h == 0) + 16 * (b == 0)

    mask = att.create_block_mask(fn, 2, 2, T, T, BS)
    assert mask.grid == (2, 2, N, N)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, is_causal=True),
        on_grid(fn, 2, 2, T, T) & causal(T, T),
        qkv(2, T, 2, 16),
    )
    # The same function as mask_fn= with a plain tile grid: every tile partial.
    grid = np.asarray(mask.blocks).any((0, 1))
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, grid, BS, is_causal=True, mask_fn=fn),
        expand(grid, BS) & on_grid(fn, 2, 2, T, T) & causal(T, T),
        qkv(2, T, 2, 16),
    )


def test_score_fn_alibi_and_bias():
    slopes = jnp.asarray([0.5, 0.125], F32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    mask = jbs.layouts.local(N, 3)
    allowed = expand(mask, BS) & causal(T, T)
    q_i, kv_i = np.arange(T)[:, None], np.arange(T)[None, :]
    dense_bias = -np.asarray(slopes)[None, :, None, None] * (q_i - kv_i)[None, None]
    args = qkv(2, T, 2, 16)
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=True, score_fn=alibi, scale=0.3),
        allowed,
        args,
        bias=jnp.asarray(dense_bias, F32),
        scale=0.3,
    )
    compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=True, bias=dense_bias),
        allowed,
        args,
        bias=jnp.asarray(dense_bias, F32),
    )


def test_bias_gradient():
    mask = jbs.layouts.fixed(N, 4, 1)
    allowed = jnp.asarray(expand(mask, BS) & causal(T, T))
    q, k, v = qkv(1, T, 2, 16)
    bias = rand((1, 2, T, T), F32, 7)

    def loss(f, bias):
        return jnp.sum(jnp.sin(f(bias)))

    got = jax.jit(
        jax.grad(lambda b: loss(lambda b: att.blocksparse_attention(q, k, v, mask, BS, bias=b, is_causal=True), b))
    )(bias)
    want = jax.jit(jax.grad(lambda b: loss(lambda b: jax.nn.dot_product_attention(q, k, v, bias=b, mask=allowed), b)))(
        bias
    )
    assert_close(got, np.asarray(want), F32, T)


def test_score_fn_soft_capping():
    cap = 2.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * jnp.tanh(score / cap)

    mask = jbs.layouts.local(N, 2)
    allowed = jnp.asarray(expand(mask, BS) & causal(T, T))
    q, k, v = qkv(2, T, 2, 16)

    def dense(q, k, v):  # jax.nn has no score function: the same softmax, written out
        s = jnp.einsum("bthd,bshd->bhts", q, k) / 4.0
        s = jnp.where(allowed, cap * jnp.tanh(s / cap), -jnp.inf)
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v)

    def sparse(q, k, v):
        return att.blocksparse_attention(q, k, v, mask, BS, is_causal=True, score_fn=softcap)

    got = jax.jit(jax.value_and_grad(lambda *a: jnp.sin(sparse(*a)).sum(), (0, 1, 2)))(q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: jnp.sin(dense(*a)).sum(), (0, 1, 2)))(q, k, v)
    assert_close(got[0], np.asarray(want[0]), F32, T)
    for g, w in zip(got[1], want[1]):
        assert_close(g, np.asarray(w), F32, T)


# ---------------------------------------------------------------------------------
# Per-batch and data-dependent masks
# ---------------------------------------------------------------------------------


def test_sequence_lengths():
    q_len, kv_len = np.array([128, 72]), np.array([100, 128])
    mask = jbs.layouts.fixed(N, 4, 1)
    rows = np.arange(T)[None, :] < q_len[:, None]
    got = compare(
        lambda q, k, v: att.blocksparse_attention(
            q, k, v, mask, BS, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len
        ),
        expand(mask, BS) & causal(T, T),
        qkv(2, T, 2, 16),
        rows=rows,
        query_seq_lengths=jnp.asarray(q_len),
        key_value_seq_lengths=jnp.asarray(kv_len),
    )
    assert not np.asarray(got)[1, 72:].any()  # padded query rows are zeros, as in jax.nn


def packed(lengths_per_row, t=T):
    """int32 [B, T] segment ids of documents of the given lengths, packed from position 0."""
    return np.stack([np.repeat(np.arange(len(ls)), ls) for ls in lengths_per_row]).astype(np.int32)


def test_packed_documents_inside_jit_compile_once():
    """The block mask is computed from segment ids inside jit at a fixed capacity: new
    documents do not recompile, and each matches jax.nn with the segment mask."""
    traces = []

    def op(q, k, v, segments):
        traces.append(1)
        mask = att.block_mask_from_segments(segments, block_size=BS, capacity=N * (N + 1) // 2, is_causal=True)
        return att.blocksparse_attention(q, k, v, mask, is_causal=True, query_segment_ids=segments)

    args = qkv(2, T, 2, 16)
    jitted = jax.jit(op)
    for lengths in ([[40, 60, 28], [128]], [[16, 16, 96], [70, 58]]):
        seg = packed(lengths)
        allowed = (seg[:, None, :, None] == seg[:, None, None, :]) & causal(T, T)
        want = jax.nn.dot_product_attention(*args, mask=jnp.asarray(allowed))
        assert_close(jitted(*args, seg), np.asarray(want), F32, T)
    assert len(traces) == 1
    # The gradient through the traced layout, again one trace for two data.
    traces.clear()
    step = jax.jit(jax.grad(lambda q, k, v, s: jnp.sum(jnp.sin(op(q, k, v, s))), (0, 1, 2)))
    for lengths in ([[40, 60, 28], [128]], [[100, 28], [8, 120]]):
        seg = packed(lengths)
        allowed = jnp.asarray((seg[:, None, :, None] == seg[:, None, None, :]) & causal(T, T))
        want = jax.grad(
            lambda q, k, v: jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, mask=allowed))), (0, 1, 2)
        )(*args)
        for g, w in zip(step(*args, seg), want):
            assert_close(g, np.asarray(w), F32, T)
    assert len(traces) == 1


def test_traced_block_mask_from_data_and_overflow():
    """A tile grid computed from data inside jit (here: the 12 strongest key blocks per
    problem by a block-mean score) runs at its capacity; more tiles than that give NaN."""
    q, k, v = qkv(2, T, 2, 16)

    def pick(q, k, count):
        qm, km = q.reshape(2, N, BS, 2, 16).mean(2), k.reshape(2, N, BS, 2, 16).mean(2)
        score = jnp.einsum("bihd,bjhd->bhij", qm, km).reshape(2, 2, -1)
        chosen = (
            jnp.zeros_like(score, bool)
            .at[jnp.arange(2)[:, None, None], jnp.arange(2)[None, :, None], jax.lax.top_k(score, count)[1]]
            .set(True)
        )
        return chosen.reshape(2, 2, N, N) | jnp.eye(N, dtype=bool)

    @jax.jit
    def op(q, k, v):
        mask = att.BlockMask(pick(q, k, 12), BS, capacity=N + 12)
        return att.blocksparse_attention(q, k, v, mask), mask.blocks

    got, blocks = op(q, k, v)
    allowed = jnp.asarray(expand(np.asarray(blocks), BS))
    assert_close(got, np.asarray(jax.nn.dot_product_attention(q, k, v, mask=allowed)), F32, T)
    small = jax.jit(lambda q, k, v: att.blocksparse_attention(q, k, v, att.BlockMask(pick(q, k, 12), BS, capacity=8)))
    assert np.isnan(np.asarray(small(q, k, v))).all()


def test_token_level_features_in_bfloat16():
    """GQA, a mask function with full and partial tiles, a score function (ALiBi), packed
    documents and key lengths together, on bfloat16 inputs: values and gradients."""
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], F32)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    seg = packed([[40, 60, 28], [70, 58]])
    kv_len = np.array([128, 100])
    mask = att.create_block_mask(sliding_window, None, None, T, T, BS)
    allowed = (
        on_grid(sliding_window, 1, 1, T, T)
        & (seg[:, None, :, None] == seg[:, None, None, :])
        & (np.arange(T) < kv_len[:, None])[:, None, None, :]
    )
    q_i, kv_i = np.arange(T)[:, None], np.arange(T)[None, :]
    dense_bias = jnp.asarray(-np.asarray(slopes)[None, :, None, None] * (q_i - kv_i)[None, None], F32)
    compare(
        lambda q, k, v: att.blocksparse_attention(
            q, k, v, mask, score_fn=alibi, query_segment_ids=seg, key_value_seq_lengths=kv_len
        ),
        allowed,
        qkv(2, T, 4, 32, kv_heads=2, dtype=BF16),
        dtype=BF16,
        bias=dense_bias,
        rows=allowed[:, 0].any(-1),
    )


def test_vmap_of_data_dependent_masks_and_decoding():
    """vmap over a leading axis of a step that builds its block mask from traced segment ids,
    and of decoding steps at different positions: each slice equals its own call."""
    q, k, v = (rand((3,) + a.shape, F32, s) for s, a in enumerate(qkv(2, 64, 2, 16)))
    seg = np.stack([packed([[16 * (i + 1), 64 - 16 * (i + 1)], [64]], 64) for i in range(3)])

    def op(q, k, v, seg):
        mask = att.block_mask_from_segments(seg, block_size=BS, capacity=10, is_causal=True)
        return att.blocksparse_attention(q, k, v, mask, is_causal=True, query_segment_ids=seg)

    got = jax.jit(jax.vmap(op))(q, k, v, seg)
    for i in range(3):
        allowed = (seg[i][:, None, :, None] == seg[i][:, None, None, :]) & causal(64, 64)
        assert_close(got[i], np.asarray(jax.nn.dot_product_attention(q[i], k[i], v[i], mask=allowed)), F32, 64)

    mask = jbs.layouts.fixed(4, 2, 1)
    positions = jnp.asarray([5, 33, 63])
    steps = jax.jit(jax.vmap(lambda q, k, v, p: att.blocksparse_decode(q, k, v, p, mask, BS)))
    tokens = jnp.stack([q[i][:, p : p + 1] for i, p in enumerate(np.asarray(positions))])  # [3, B, 1, H, D]
    got = steps(tokens, k, v, positions)
    allowed = expand(mask, BS) & causal(64, 64)
    for i, p in enumerate(np.asarray(positions)):
        want = jax.nn.dot_product_attention(q[i], k[i], v[i], mask=allowed)[:, p]
        assert_close(got[i, :, 0], np.asarray(want), F32, 64)


# ---------------------------------------------------------------------------------
# Empty rows, dropout, memory
# ---------------------------------------------------------------------------------


def test_empty_rows_give_zeros_not_nan():
    mask = jbs.layouts.local(N, 2)
    mask[3] = False  # query block 3 sees nothing
    q, k, v = qkv(1, T, 2, 16)
    rows = np.ones((1, T), bool)
    rows[:, 3 * BS : 4 * BS] = False
    out = compare(
        lambda q, k, v: att.blocksparse_attention(q, k, v, mask, BS, is_causal=True),
        expand(mask, BS) & causal(T, T),
        (q, k, v),
        rows=rows,
    )
    assert not np.asarray(out)[:, 3 * BS : 4 * BS].any()
    empty = np.zeros((N, N), bool)
    out, grads = jax.jit(jax.value_and_grad(lambda q: att.blocksparse_attention(q, k, v, empty, BS).sum()))(q)
    assert float(out) == 0 and not np.asarray(grads).any()


def test_dropout():
    mask = jbs.layouts.local(N, 3)
    q, k, v = qkv(2, T, 2, 16)
    op = jax.jit(
        lambda q, k, v, key: att.blocksparse_attention(
            q, k, v, mask, BS, is_causal=True, dropout_rate=0.5, dropout_rng=key
        )
    )
    key = jax.random.key(0)
    a, b, c = op(q, k, v, key), op(q, k, v, key), op(q, k, v, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # deterministic in the key
    assert not np.allclose(np.asarray(a), np.asarray(c))
    # Inverted dropout keeps the expectation: v = 1 gives outputs whose mean is 1.
    assert abs(float(op(q, k, jnp.ones_like(v), key).mean()) - 1.0) < 0.05


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jaxprs_in_params(eqn.params):
            yield from all_eqns(inner)


def test_nothing_t_by_t():
    """No intermediate of forward + backward has T x T elements per head."""
    t, bs = 512, 32
    mask = jbs.layouts.local(t // bs, 2)
    q, k, v = qkv(1, t, 2, 16)

    def loss(q, k, v):
        return att.blocksparse_attention(q, k, v, mask, bs, is_causal=True).sum()

    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    sizes = [
        int(np.prod(var.aval.shape))
        for eqn in all_eqns(jaxpr.jaxpr)
        for var in eqn.outvars
        if hasattr(var.aval, "shape")
    ]
    nnz = int((mask & causal(t // bs, t // bs)).sum())
    assert max(sizes) == 2 * nnz * bs * bs < 2 * t * t / 4  # the scores (both heads) are the largest


# ---------------------------------------------------------------------------------
# Transformations
# ---------------------------------------------------------------------------------


def test_vmap_and_jvp():
    mask = jbs.layouts.fixed(N, 4, 1)
    allowed = jnp.asarray(expand(mask, BS) & causal(T, T))
    q, k, v = (rand((3,) + a.shape, F32, s) for s, a in enumerate(qkv(1, T, 2, 16)))

    def op(q, k, v):
        return att.blocksparse_attention(q, k, v, mask, BS, is_causal=True)

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=allowed)

    assert_close(jax.jit(jax.vmap(op))(q, k, v), np.asarray(jax.vmap(dense)(q, k, v)), F32, T)
    tangents = tuple(rand(a.shape[1:], F32, 10 + i) for i, a in enumerate((q, k, v)))
    primals = (q[0], k[0], v[0])
    got = jax.jit(lambda p, t: jax.jvp(op, p, t))(primals, tangents)
    want = jax.jvp(dense, primals, tangents)
    for g, w in zip(got, want):
        assert_close(g, np.asarray(w), F32, T)
    grads = jax.jit(jax.vmap(jax.grad(lambda q, k, v: op(q, k, v).sum())))(q, k, v)
    assert_close(grads, np.asarray(jax.vmap(jax.grad(lambda q, k, v: dense(q, k, v).sum()))(q, k, v)), F32, T)


@pytest.mark.usefixtures("cpu_default_device")
def test_jit_over_a_batch_sharded_mesh():
    """Under jit of batch-sharded inputs each device attends its own rows: no all-gather, the
    one-device values and gradients (GQA, packed documents with a traced block mask), and
    a different dropout mask on every device."""
    mesh = cpu_mesh((8,), ("batch",))
    q, k, v = qkv(8, 64, 4, 16, kv_heads=2)
    ct = rand(q.shape, F32, 9)
    seg = packed([[16 * (i % 3 + 1), 64 - 16 * (i % 3 + 1)] for i in range(8)], 64)

    def loss(q, k, v, seg):
        mask = att.block_mask_from_segments(seg, block_size=16, capacity=10, is_causal=True)
        out = att.blocksparse_attention(q, k, v, mask, is_causal=True, query_segment_ids=seg)
        return jnp.vdot(out, ct)

    step = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
    sharded = [jax.device_put(a, NamedSharding(mesh, P("batch"))) for a in (q, k, v, seg)]
    assert collectives(step.lower(*sharded).compile().as_text())["all-gather"] == []
    got, want = step(*sharded), step(q, k, v, seg)
    allowed = jnp.asarray((seg[:, None, :, None] == seg[:, None, None, :]) & causal(64, 64))
    dense = jax.value_and_grad(
        lambda q, k, v: jnp.vdot(jax.nn.dot_product_attention(q, k, v, mask=allowed), ct), (0, 1, 2)
    )(q, k, v)
    assert_close(got[0], np.asarray(want[0]), F32, 64)
    assert_close(got[0], np.asarray(dense[0]), F32, 64)
    for g, w, d in zip(got[1], want[1], dense[1]):
        assert_close(g, np.asarray(w), F32, 64)
        assert_close(g, np.asarray(d), F32, 64)

    mask = jbs.layouts.fixed(4, 2, 1)
    ones = jax.device_put(jnp.ones((8, 64, 2, 16)), NamedSharding(mesh, P("batch")))
    dropped = jax.jit(
        lambda q: att.blocksparse_attention(
            q, q, q, mask, 16, is_causal=True, dropout_rate=0.5, dropout_rng=jax.random.key(0)
        )
    )(ones)
    rows = np.asarray(dropped)  # equal inputs: one key for all devices would give every row one mask
    assert not np.array_equal(rows[0], rows[1])


# ---------------------------------------------------------------------------------
# Decoding with a key-value cache
# ---------------------------------------------------------------------------------


def test_decode_equals_full_attention_row_by_row():
    """Token t against a cache holding keys 0..t equals row t of full causal attention
    (GQA, per-head masks, a mask function and a score function); later cache entries
    are ignored."""
    masks = np.stack([jbs.layouts.local(N, 2), jbs.layouts.fixed(N, 4, 1)])

    def fn(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 40 + 40 * h

    def soft(score, b, h, q_idx, kv_idx):
        return 3.0 * jnp.tanh(score / 3.0)

    q, k, v = qkv(2, T, 4, 16, kv_heads=2)
    masks4 = np.repeat(masks, 2, axis=0)  # one per query head
    kw = dict(mask_fn=fn, score_fn=soft)
    full = jax.jit(lambda q, k, v: att.blocksparse_attention(q, k, v, masks4, BS, is_causal=True, **kw))(q, k, v)
    garbage = rand(k.shape, F32, 42)
    step = jax.jit(lambda q, k, v, t: att.blocksparse_decode(q, k, v, t, masks4, BS, **kw))
    for t in range(T):
        later = np.arange(T)[None, :, None, None] > t  # the cache beyond t holds other values
        k_t, v_t = jnp.where(later, garbage, k), jnp.where(later, garbage, v)
        assert_close(step(q[:, t : t + 1], k_t, v_t, t)[:, 0], np.asarray(full[:, t]), F32, T)


def test_decode_work_follows_the_row_not_t():
    """Every product of a decode step takes at most twice the widest row's tiles of keys,
    whatever T: a causal local window of 3 blocks gathers at most 4 blocks at T = 1024."""
    t = 1024
    mask = jbs.layouts.local(t // BS, 3)
    q, k, v = qkv(1, t, 2, 16)
    jaxpr = jax.make_jaxpr(lambda q, k, v, p: att.blocksparse_decode(q, k, v, p, mask, BS))(q[:, :1], k, v, 5)
    dots = eqns_named(jaxpr.jaxpr, {"dot_general"})
    assert dots and all(int(np.prod(x.aval.shape)) <= 1 * 2 * 4 * BS * 16 for e in dots for x in e.invars)
    assert len(eqns_named(jaxpr.jaxpr, {"cond"})) == 1  # one branch per bucket of row sizes (1, 2, 3 -> 4)


# ---------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------


def test_bad_inputs():
    mask = jbs.layouts.local(4, 2)
    q, k, v = qkv(1, 64, 2, 16)
    a = att.blocksparse_attention
    cases = [
        (ValueError, "query must be", lambda: a(q[0], k, v, mask, 16)),
        (ValueError, "key must be", lambda: a(q, k[..., :8], v, mask, 16)),
        (ValueError, "value must be", lambda: a(q, k, v[:, :32], mask, 16)),
        (ValueError, "multiple of the key/value heads", lambda: a(jnp.tile(q, (1, 1, 2, 1))[:, :, :3], k, v, mask, 16)),
        (TypeError, "one dtype", lambda: a(q, k, v.astype(BF16), mask, 16)),
        (TypeError, "float32, bfloat16 or float16", lambda: a(q.astype(jnp.int32), k, v, mask, 16)),
        (ValueError, "multiples of block_size", lambda: a(q[:, :56], k[:, :56], v[:, :56], mask, 16)),
        (ValueError, "block_size must be one of", lambda: a(q, k, v, mask, 12)),
        (TypeError, "block_size is required", lambda: a(q, k, v, mask)),
        (ValueError, "does not match T_q=64", lambda: a(q, k, v, jbs.layouts.local(8, 2), 16)),
        (ValueError, "heads 1 or 2", lambda: a(q, k, v, np.ones((3, 4, 4), bool), 16)),
        (TypeError, "block_mask: blocks must be a boolean", lambda: a(q, k, v, mask.astype(np.int32), 16)),
        (TypeError, "BlockMask", lambda: jax.jit(lambda m: a(q, k, v, m, 16))(mask)),
        (TypeError, "is_causal must be a bool", lambda: a(q, k, v, mask, 16, is_causal=1)),
        (ValueError, "dropout_rng", lambda: a(q, k, v, mask, 16, dropout_rate=0.1)),
        (ValueError, "dropout_rate", lambda: a(q, k, v, mask, 16, dropout_rate=1.0, dropout_rng=jax.random.key(0))),
        (ValueError, "bias must broadcast", lambda: a(q, k, v, mask, 16, bias=jnp.zeros((1, 2, 64, 32)))),
        (TypeError, "bias must be a float", lambda: a(q, k, v, mask, 16, bias=jnp.zeros((64, 64), int))),
        (ValueError, "query_seq_lengths must have shape", lambda: a(q, k, v, mask, 16, query_seq_lengths=[3, 4])),
        (
            TypeError,
            "key_value_seq_lengths must be integers",
            lambda: a(q, k, v, mask, 16, key_value_seq_lengths=jnp.ones(1)),
        ),
        (
            ValueError,
            "query_segment_ids must have shape",
            lambda: a(q, k, v, mask, 16, query_segment_ids=np.zeros((1, 32), int)),
        ),
        (TypeError, "mask_fn must return a bool", lambda: a(q, k, v, mask, 16, mask_fn=lambda b, h, i, j: i - j)),
        (TypeError, "mask_fn must take", lambda: a(q, k, v, mask, 16, mask_fn=lambda b, h: True)),
        (TypeError, "score_fn must return a float", lambda: a(q, k, v, mask, 16, score_fn=lambda s, b, h, i, j: s > 0)),
        (TypeError, "score_fn must be callable", lambda: a(q, k, v, mask, 16, score_fn=3.0)),
        (
            ValueError,
            "mask_fn is given twice",
            lambda: a(q, k, v, att.BlockMask(mask, 16, mask_fn=lambda *i: True), mask_fn=lambda *i: True),
        ),
        (ValueError, "block_size=32 differs", lambda: a(q, k, v, att.BlockMask(mask, 16), 32)),
        (ValueError, "needs capacity", lambda: jax.jit(lambda m: att.BlockMask(m, 16))(mask)),
        (ValueError, "capacity=2 is smaller", lambda: att.BlockMask(mask, 16, capacity=2)),
        (ValueError, "one token", lambda: att.blocksparse_decode(q, k, v, 0, mask, 16)),
        (TypeError, "position must be an int", lambda: att.blocksparse_decode(q[:, :1], k, v, 1.5, mask, 16)),
        (
            ValueError,
            "needs capacity",
            lambda: jax.jit(lambda s: att.block_mask_from_segments(s, block_size=16))(np.zeros((1, 64), int)),
        ),
        (
            ValueError,
            "multiple of block_size=16",
            lambda: att.create_block_mask(lambda b, h, i, j: i >= j, None, None, 60, 64, 16),
        ),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


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
    for bad in (
        lambda: L.local(4, 0),
        lambda: L.strided(4, 0),
        lambda: L.fixed(4, 2, 3),
        lambda: L.bigbird(4, 1, 5, 0),
        lambda: L.causal(np.ones((3, 4), bool)),
    ):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(TypeError):
        L.local(4.5, 1)
