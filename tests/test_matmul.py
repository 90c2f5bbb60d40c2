"""bsmm / bsmm(transpose=True) / bsmm_updat against a dense reference, under every transform.

The oracles here never call the library: they rebuild the dense masked weight from
the mask (``helpers.dense_of``) and compute x @ W in float32.

Every test runs twice: on the native CPU kernels (the XLA FFI custom calls, the default
CPU path when built) and on the pure-JAX reference lowering.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_blocksparse as jbs
from helpers import (
    DTYPES,
    GRIDS,
    MASK_KINDS,
    NUM_DEVICES,
    assert_close,
    cpu_devices,
    cpu_mesh,
    dense_of,
    make_mask,
    make_problem,
    np_blocks,
    np_dense,
    rand,
    require_kernels,
    shard_map,
    storage_order,
)

HIGHEST = jax.lax.Precision.HIGHEST


@pytest.fixture(autouse=True, scope="module", params=["kernels", "reference"])
def implementation(request):
    """Runs the module on the CPU kernels and on the reference lowering.

    Module scope: pytest runs every test of one implementation before switching; the
    setting is part of jit's cache key (see jbs.config), so compiled functions stay
    cached between the tests of one implementation."""
    if request.param == "kernels":
        require_kernels("cpu")
    with jbs.config.implementation(request.param):
        yield request.param


F32 = jnp.float32
LEADS = {"1d": (), "lead1": (3,), "lead2": (2, 3)}

# ---------------------------------------------------------------------------------
# The three ops, each with its dense oracle and operand shapes: name -> (op, ref, shapes)
# ---------------------------------------------------------------------------------


def blocks_of(D, mask, block_size, capacity):
    """Differentiable jnp gather of the mask's blocks of D [C, K], padded to capacity."""
    cb, kb = mask.shape
    rows, cols = storage_order(mask)
    blocks = D.reshape(cb, block_size, kb, block_size).transpose(0, 2, 1, 3)[rows, cols]
    return jnp.concatenate([blocks, jnp.zeros((capacity - len(rows), block_size, block_size), D.dtype)])


def _ref_fprop(a, b, mask, layout):
    return jnp.matmul(a.astype(F32), dense_of(b.astype(F32), mask, layout.block_size), precision=HIGHEST)


def _ref_bprop(a, b, mask, layout):
    return jnp.matmul(a.astype(F32), dense_of(b.astype(F32), mask, layout.block_size).T, precision=HIGHEST)


def _ref_updat(a, b, mask, layout):
    D = jnp.einsum("...c,...k->ck", a.astype(F32), b.astype(F32), precision=HIGHEST)
    return blocks_of(D, mask, layout.block_size, layout.capacity)


OPS = {
    "fprop": (
        lambda a, b, layout, **kw: jbs.bsmm(a, b, layout, **kw),
        _ref_fprop,
        lambda layout, lead: (lead + (layout.shape[0],), layout.w_shape),
    ),
    "transpose": (
        lambda a, b, layout, **kw: jbs.bsmm(a, b, layout, transpose=True, **kw),
        _ref_bprop,
        lambda layout, lead: (lead + (layout.shape[1],), layout.w_shape),
    ),
    "updat": (
        lambda a, b, layout, preferred_element_type=None: jbs.bsmm_updat(
            a, b, layout, out_dtype=preferred_element_type
        ),
        _ref_updat,
        lambda layout, lead: (lead + (layout.shape[0],), lead + (layout.shape[1],)),
    ),
}


def np_reference(op, a, b, mask, layout):
    """The dense oracle in float32 numpy (no JAX, so nothing to compile)."""
    a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
    if op == "updat":
        D = a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])
        return np_blocks(D, mask, layout.block_size, layout.capacity)
    W = np_dense(b, mask, layout.block_size)
    return a @ (W.T if op == "transpose" else W)


def contraction(op, layout, lead):
    """Length of the dot products behind each output element (for the tolerance)."""
    return {"fprop": layout.shape[0], "transpose": layout.shape[1], "updat": int(np.prod(lead))}[op]


def operands(op, layout, lead, dtype=F32, w=None, seed=10):
    a_shape, b_shape = OPS[op][2](layout, lead)
    b = rand(b_shape, dtype, seed + 1) if op == "updat" or w is None else w
    return rand(a_shape, dtype, seed), b


# ---------------------------------------------------------------------------------
# Values: block sizes x dtypes x layouts x leading dims x ops
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lead", LEADS.values(), ids=LEADS.keys())
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
def test_against_dense_reference(block_size, dtype, kind, op, lead):
    # Capacity = the whole grid: every layout kind of one shape shares a compiled program
    # (and most get padding slots); exact capacities are tested below.
    grid = GRIDS[block_size]
    mask, layout, w = make_problem(kind, block_size, dtype=dtype, capacity=grid[0] * grid[1], seed=block_size)
    a, b = operands(op, layout, lead, dtype, w)
    got = OPS[op][0](a, b, layout)
    want = np_reference(op, a, b, mask, layout)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype, contraction(op, layout, lead))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", MASK_KINDS)
def test_exact_capacity(kind, op):
    mask, layout, w = make_problem(kind, 8, grid=(4, 3), seed=1)
    assert layout.capacity == mask.sum()  # 0 for the empty layout
    a, b = operands(op, layout, (3,), F32, w)
    assert_close(OPS[op][0](a, b, layout), np_reference(op, a, b, mask, layout), F32, contraction(op, layout, (3,)))


@pytest.mark.parametrize("transpose", [False, True])
def test_bsmm_reference_is_the_definition(transpose):
    mask, layout, w = make_problem("empty_rows_cols", 16)
    x = rand((2, layout.shape[1] if transpose else layout.shape[0]), jnp.bfloat16)
    got = jbs.bsmm_reference(x, w, layout, transpose=transpose)
    W = dense_of(w, mask, 16)
    assert got.dtype == F32  # bf16 x f32 promotes to f32
    assert_close(got, x.astype(F32) @ (W.T if transpose else W), F32, 64)
    assert_close(jbs.bsmm(x, w, layout, transpose=transpose), got, F32, 64)
    low = jbs.bsmm_reference(x, w, layout, transpose=transpose, preferred_element_type=jnp.bfloat16)
    assert low.dtype == jnp.bfloat16


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "in_dtype,out_dtype",
    [(jnp.bfloat16, F32), (jnp.float16, F32), (F32, jnp.bfloat16), (jnp.bfloat16, jnp.float16)],
    ids=["bf16->f32", "f16->f32", "f32->bf16", "bf16->f16"],
)
def test_preferred_element_type(op, in_dtype, out_dtype):
    mask, layout, w = make_problem("random", 32, dtype=in_dtype)
    a, b = operands(op, layout, (4,), in_dtype, w)
    got = OPS[op][0](a, b, layout, preferred_element_type=out_dtype)
    assert got.dtype == out_dtype
    # Inputs are already rounded; with float32 accumulation only the output rounding remains.
    assert_close(got, np_reference(op, a, b, mask, layout), out_dtype, contraction(op, layout, (4,)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(
    "a_dtype,b_dtype,out_dtype",
    [
        (jnp.bfloat16, F32, F32),
        (F32, jnp.float16, F32),
        (jnp.float16, jnp.bfloat16, F32),
        (jnp.bfloat16, jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_mixed_dtypes_promote(op, a_dtype, b_dtype, out_dtype):
    mask, layout, w = make_problem("random", 16)
    a, b = operands(op, layout, (3,), F32, w)
    a, b = a.astype(a_dtype), b.astype(b_dtype)
    got = OPS[op][0](a, b, layout)
    assert got.dtype == out_dtype
    assert_close(got, np_reference(op, a, b, mask, layout), out_dtype, contraction(op, layout, (3,)))


@pytest.mark.parametrize("kind,jit", [("random", False), ("random", True), ("empty", True), ("full", True)])
def test_padding_slots_with_garbage_are_ignored(kind, jit):
    mask = make_mask(kind, (3, 4), seed=2)
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 3)
    W = rand(layout.shape, seed=3)
    w = jnp.asarray(np_blocks(W, mask, 8, layout.capacity)).at[layout.nnz :].set(jnp.nan)
    w = w.at[layout.nnz + 1 :].set(1e30)
    x, g = rand((2, 24), seed=4), rand((2, 32), seed=5)
    maybe_jit = jax.jit if jit else (lambda f: f)
    y = maybe_jit(lambda x, w: jbs.bsmm(x, w, layout))(x, w)
    z = maybe_jit(lambda g, w: jbs.bsmm(g, w, layout, transpose=True))(g, w)
    dw = maybe_jit(lambda x, g: jbs.bsmm_updat(x, g, layout))(x, g)
    masked = np.asarray(W) * np.kron(mask, np.ones((8, 8)))
    assert_close(y, np.asarray(x) @ masked, F32, 24)
    assert_close(z, np.asarray(g) @ masked.T, F32, 32)
    np.testing.assert_array_equal(np.asarray(dw[layout.nnz :]), 0)
    assert_close(dw, np_blocks(np.asarray(x).T @ np.asarray(g), mask, 8, layout.capacity), F32, 2)
    gw = maybe_jit(jax.grad(lambda w: jnp.sum(jbs.bsmm(x, w, layout) ** 2)))(w)
    np.testing.assert_array_equal(np.asarray(gw[layout.nnz :]), 0)
    assert np.isfinite(np.asarray(gw)).all()


# ---------------------------------------------------------------------------------
# Transforms: the library under each transform == the oracle under the same transform
# ---------------------------------------------------------------------------------

B = 3  # vmap batch


def _stacked(shape, axis, seed):
    return jnp.moveaxis(rand((B,) + shape, F32, seed), 0, axis)


def _loss(f):
    return lambda a, b: 0.5 * jnp.sum(f(a, b) ** 2)


def _vmap(in_axes, out_axes=0):
    def run(f, a, b):
        args = [x if ax is None else _stacked(x.shape, ax, 20 + i) for i, (x, ax) in enumerate(zip((a, b), in_axes))]
        return jax.vmap(f, in_axes=in_axes, out_axes=out_axes)(*args)

    return run


def _linear_transpose(f, a, b):
    ct = rand(jax.eval_shape(f, a, b).shape, F32, 30)
    (ct_a,) = jax.linear_transpose(lambda a_: f(a_, b), a)(ct)
    (ct_b,) = jax.linear_transpose(lambda b_: f(a, b_), b)(ct)
    return ct_a, ct_b


def _vjp(f, a, b):
    out, pullback = jax.vjp(f, a, b)
    return out, pullback(rand(out.shape, F32, 31))


def _vmap_of_grad(argnum):
    def run(f, a, b):
        # Per-example gradients: each row of the batch alone, through vmap. For updat
        # both operands are per-example rows; for bsmm the weight b is shared.
        b_axis = 0 if b.ndim == a.ndim else None
        per_example = jax.grad(lambda a1, b1: _loss(f)(a1[None], b1 if b_axis is None else b1[None]), argnums=argnum)
        return jax.vmap(per_example, in_axes=(0, b_axis))(a, b)

    return run


def _jit(run):
    """Runs a transform under jit: op-by-op dispatch of big transforms is slow to compile."""
    return lambda f, a, b: jax.jit(lambda a_, b_: run(f, a_, b_))(a, b)


TRANSFORMS = {
    # Eager: the primitives' impls and rules run op by op.
    "eager_grad": lambda f, a, b: jax.grad(_loss(f), argnums=(0, 1))(a, b),
    # The rest under jit (op-by-op dispatch of big transforms is slow to compile).
    "jit": lambda f, a, b: jax.jit(f)(a, b),
    "grad_a": _jit(lambda f, a, b: jax.grad(_loss(f), argnums=0)(a, b)),
    "grad_b": _jit(lambda f, a, b: jax.grad(_loss(f), argnums=1)(a, b)),
    "jvp": _jit(lambda f, a, b: jax.jvp(f, (a, b), (rand(a.shape, F32, 32), rand(b.shape, F32, 33)))),
    "jvp_a_only": _jit(lambda f, a, b: jax.jvp(lambda a_: f(a_, b), (a,), (rand(a.shape, F32, 32),))),
    "vjp": _jit(_vjp),
    "jacfwd": _jit(lambda f, a, b: jax.jacfwd(f, argnums=(0, 1))(a, b)),
    "jacrev": _jit(lambda f, a, b: jax.jacrev(f, argnums=(0, 1))(a, b)),
    "hessian": _jit(lambda f, a, b: jax.hessian(_loss(f), argnums=(0, 1))(a, b)),
    "linear_transpose": _jit(_linear_transpose),
    "vmap_a": _jit(_vmap((0, None))),
    "vmap_a_axis1_out1": _jit(_vmap((1, None), 1)),
    "vmap_a_axis-1_out-1": _jit(_vmap((-1, None), -1)),
    "vmap_b": _jit(_vmap((None, 0))),
    "vmap_b_axis1": _jit(_vmap((None, 1))),
    "vmap_b_axis-1_out1": _jit(_vmap((None, -1), 1)),
    "vmap_both": _jit(_vmap((0, 0))),
    "vmap_both_axes1,-1_out-1": _jit(_vmap((1, -1), -1)),
    "vmap_vmap": _jit(lambda f, a, b: _vmap((None, 0))(lambda a_, b_: _vmap((0, None))(f, a_, b_), a, b)),
    "vmap_of_grad_b_both_batched": _jit(lambda f, a, b: _vmap((0, 0))(jax.grad(_loss(f), 1), a, b)),
    "vmap_of_grad_a": _jit(_vmap_of_grad(0)),
    "vmap_of_grad_b": _jit(_vmap_of_grad(1)),
}


@pytest.fixture(scope="module")
def problem():
    """A small layout with empty rows and columns and two padding slots."""
    mask = make_mask("empty_rows_cols", (3, 4))
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 2)
    return mask, layout, jnp.asarray(np_blocks(rand(layout.shape, seed=1), mask, 8, layout.capacity))


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("op", OPS)
def test_transform(problem, op, transform):
    mask, layout, w = problem
    a, b = operands(op, layout, (2,), F32, w)
    fn, ref, _ = OPS[op]
    got = TRANSFORMS[transform](lambda a_, b_: fn(a_, b_, layout), a, b)
    want = TRANSFORMS[transform](lambda a_, b_: ref(a_, b_, mask, layout), a, b)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w_ in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_close(g, w_, F32, 32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", ["empty_rows_cols", "empty"])
def test_check_grads(op, kind):
    mask = make_mask(kind, (3, 4))
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 1)
    w = jnp.asarray(np_blocks(rand(layout.shape, seed=1), mask, 8, layout.capacity))
    a, b = operands(op, layout, (2,), F32, w)
    # The oracle is finite differences of float32 products, so it states its precision:
    # * exact float32 matmuls (as conftest's exact_float32_matmuls pins; GPU's default,
    #   TF32, rounds each product to ~1e-3 and misses order 2 by far);
    # * the step: the ops are bilinear, so central differences have no truncation error
    #   and the step only sets their float32 roundoff, ~ulp(f) / eps. JAX's default 1e-4
    #   puts that at the tolerance (2e-3) itself; at 1e-3 it stays below 3e-4.
    with jax.default_matmul_precision("highest"):
        check_grads(lambda a_, b_: OPS[op][0](a_, b_, layout), (a, b), order=2, modes=("fwd", "rev"), eps=1e-3)


# ---------------------------------------------------------------------------------
# vmap over a batch of layouts (masks stacked; Layout built inside with a fixed capacity)
# ---------------------------------------------------------------------------------

# in_axes of (mask, a, b)
LAYOUT_BATCH_AXES = {
    "all": (0, 0, 0),
    "shared_a": (0, None, 0),
    "shared_b": (0, 0, None),
    "layout_only": (0, None, None),
}


@pytest.mark.parametrize("axes", LAYOUT_BATCH_AXES)
@pytest.mark.parametrize("op", OPS)
def test_vmap_over_layouts(op, axes):
    bs, grid, capacity = 8, (3, 4), 9
    kinds = ("random", "empty", "single", "long_column")
    masks = np.stack([make_mask(k, grid, seed=i) for i, k in enumerate(kinds)])
    layout0 = jbs.Layout.from_mask(masks[0], bs, capacity=capacity)
    in_axes = LAYOUT_BATCH_AXES[axes]
    a, b = (
        rand((len(kinds),) + s, F32, 40 + i) if ax == 0 else rand(s, F32, 40 + i)
        for i, (s, ax) in enumerate(zip(OPS[op][2](layout0, (2,)), in_axes[1:]))
    )
    fn = OPS[op][0]

    def f(mask, a_, b_):
        return fn(a_, b_, jbs.Layout.from_mask(mask, bs, capacity=capacity))

    got = jax.jit(jax.vmap(f, in_axes=in_axes))(jnp.asarray(masks), a, b)
    for i, mask in enumerate(masks):
        ai, bi = (x[i] if ax == 0 else x for x, ax in zip((a, b), in_axes[1:]))
        layout_i = jbs.Layout.from_mask(mask, bs, capacity=capacity)
        assert_close(got[i], np_reference(op, ai, bi, mask, layout_i), F32, 32)


def test_grad_through_vmap_over_layouts():
    bs, grid, capacity = 8, (3, 4), 9
    masks = np.stack([make_mask(k, grid, seed=i) for i, k in enumerate(("random", "single", "empty_rows_cols"))])
    x, w = rand((3, 2, 24), F32, 1), rand((3, capacity, bs, bs), F32, 2)

    def loss(x, w):
        f = lambda m, x_, w_: jbs.bsmm(x_, w_, jbs.Layout.from_mask(m, bs, capacity=capacity))  # noqa: E731
        return jnp.sum(jax.vmap(f)(jnp.asarray(masks), x, w) ** 2)

    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    for i, m in enumerate(masks):
        layout = jbs.Layout.from_mask(m, bs, capacity=capacity)
        dy = 2 * np_reference("fprop", x[i], w[i], m, layout)  # d/dy sum(y^2)
        assert_close(dx[i], np_reference("transpose", dy, w[i], m, layout), F32, 32)
        assert_close(dw[i], np_reference("updat", x[i], dy, m, layout), F32, 32)  # 0 at padding


# ---------------------------------------------------------------------------------
# Multiple devices: pmap and shard_map over the batch, weights and layout replicated,
# on the CPU backend's 8 devices (conftest) whatever the default backend is
# ---------------------------------------------------------------------------------


def _mesh():
    return cpu_mesh((NUM_DEVICES,), ("batch",))


def test_eight_devices():
    assert len(jax.devices("cpu")) == NUM_DEVICES, "conftest must set XLA_FLAGS before jax is imported"


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("op", OPS)
def test_pmap(problem, op):
    mask, layout, w = problem
    a, b = operands(op, layout, (NUM_DEVICES, 2), F32, w)
    fn = OPS[op][0]
    b_axis = 0 if op == "updat" else None
    pmapped = jax.pmap(lambda a_, b_, l_: fn(a_, b_, l_), in_axes=(0, b_axis, None), devices=cpu_devices(NUM_DEVICES))
    got = pmapped(a, b, layout)
    if op == "updat":
        want = jnp.stack([fn(a[i], b[i], layout) for i in range(NUM_DEVICES)])
    else:
        want = fn(a, b, layout)
    assert_close(got, want, F32, 32)


@pytest.mark.usefixtures("cpu_default_device")
def test_pmap_per_device_layouts_and_grad():
    bs, grid, capacity = 8, (3, 4), 12
    masks = [make_mask(MASK_KINDS[i % len(MASK_KINDS)], grid, seed=i) for i in range(NUM_DEVICES)]
    layouts = [jbs.Layout.from_mask(m, bs, capacity=capacity) for m in masks]
    stacked = jax.tree_util.tree_map(lambda *t: jnp.stack(t), *layouts)
    x, w = rand((NUM_DEVICES, 2, 24), F32, 1), rand((capacity, bs, bs), F32, 2)

    def step(x, w, layout):
        loss = lambda w_: jnp.sum(jbs.bsmm(x, w_, layout) ** 2)  # noqa: E731
        return jbs.bsmm(x, w, layout), jax.lax.psum(jax.grad(loss)(w), "d")

    y, dw = jax.pmap(step, axis_name="d", in_axes=(0, None, 0), devices=cpu_devices(NUM_DEVICES))(x, w, stacked)
    want_dw = 0
    for i, (m, layout) in enumerate(zip(masks, layouts)):
        want_y = np_reference("fprop", x[i], w, m, layout)
        assert_close(y[i], want_y, F32, 24)
        want_dw = want_dw + np_reference("updat", x[i], 2 * want_y, m, layout)  # d/dw sum((x W)^2)
    for i in range(NUM_DEVICES):
        assert_close(dw[i], want_dw, F32, 16)


@pytest.mark.usefixtures("cpu_default_device")
@pytest.mark.parametrize("op", OPS)
def test_shard_map(problem, op):
    mask, layout, w = problem
    mesh = _mesh()
    a, b = operands(op, layout, (NUM_DEVICES * 2,), F32, w)
    fn = OPS[op][0]
    if op == "updat":  # a weight-shaped result: sum the per-shard partial products
        specs, out = (P("batch"), P("batch"), P()), P()
        body = lambda a_, b_, l_: jax.lax.psum(fn(a_, b_, l_), "batch")  # noqa: E731
    else:
        specs, out = (P("batch"), P(), P()), P("batch")
        body = lambda a_, b_, l_: fn(a_, b_, l_)  # noqa: E731
    sharded = jax.jit(shard_map()(body, mesh=mesh, in_specs=specs, out_specs=out))
    assert_close(sharded(a, b, layout), fn(a, b, layout), F32, 32)


@pytest.mark.usefixtures("cpu_default_device")
def test_shard_map_grad():
    """Data-parallel step: grads outside and inside shard_map equal those on one device."""
    mask, layout, w = make_problem("empty_rows_cols", 8, grid=(3, 4), capacity=8)
    mesh, smap = _mesh(), shard_map()
    x = rand((NUM_DEVICES * 2, 24), F32, 3)

    def loss(x, w, layout, fn=jbs.bsmm):
        return jnp.sum(fn(x, w, layout) ** 2)

    def ref(x, w, layout):
        return _ref_fprop(x, w, mask, layout)

    want = jax.grad(loss, argnums=(0, 1))(x, w, layout)
    specs = (P("batch"), P(), P())
    fwd = smap(lambda x_, w_, l_: jbs.bsmm(x_, w_, l_), mesh=mesh, in_specs=specs, out_specs=P("batch"))
    outside = jax.jit(jax.grad(lambda x_, w_: jnp.sum(fwd(x_, w_, layout) ** 2), argnums=(0, 1)))(x, w)
    assert_close(outside[0], want[0], F32, 24)
    assert_close(outside[1], want[1], F32, 16)

    # Inside: how JAX reduces the replicated w's cotangent across shards (implicitly
    # with check_vma) is JAX's business; the library must match dense ops under it.
    def inside(fn):
        local = lambda x_, w_, l_: jax.grad(loss, argnums=(0, 1))(x_, w_, l_, fn)  # noqa: E731
        return jax.jit(smap(local, mesh=mesh, in_specs=specs, out_specs=(P("batch"), P())))(x, w, layout)

    got, oracle = inside(jbs.bsmm), inside(ref)
    assert_close(got[0], want[0], F32, 24)
    assert_close(got[1], oracle[1], F32, 16)
