"""bsconv / bsconv_transpose against dense lax convolutions, under every transform.

The oracles are ``lax.conv_general_dilated`` and ``lax.conv_transpose`` on the dense
HWIO kernel, built here from the mask alone (``helpers.dense_of`` per tap), so they
check ``conv_to_dense`` and the tap-stacked layouts rather than reuse them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import jax_blocksparse as jbs
from helpers import (
    assert_close,
    dense_of,
    kernel_calls,
    make_mask,
    rand,
    require_cuda_extension,
    storage_order,
    xla_optimizations_off,
)
from jax_blocksparse.ops.conv_im2col import stack_taps

F32, BF16 = jnp.float32, jnp.bfloat16
HIGHEST = lax.Precision.HIGHEST
N = 2


@pytest.fixture(autouse=True, scope="module")
def _quick_compiles():
    """These tests check values, not speed: skip XLA's optimisation passes (~2x faster compiles).

    The optimised pipeline runs the same ops in tests/test_nn_conv.py and examples/resnet.py.
    """
    with xla_optimizations_off():
        yield


# ---------------------------------------------------------------------------------
# Problems: a layout kind, a geometry, a dtype
# ---------------------------------------------------------------------------------

# name -> (mask kind, block size, grid, extra capacity)
LAYOUTS = {
    "random_bs8": ("random", 8, (3, 2), 2),
    "empty_bs8": ("empty", 8, (2, 3), 1),
    "full_bs16": ("full", 16, (2, 2), 0),
    "long_column_bs32": ("long_column", 32, (2, 3), 1),
}

# name -> (kernel_size, input spatial shape, keyword arguments of bsconv)
GEOMETRIES = {
    "1d_same": ((3,), (9,), {}),
    "1d_valid_stride2": ((3,), (9,), dict(strides=2, padding="VALID")),
    "1d_explicit_negative_dilated": ((2,), (8,), dict(padding=[(2, -1)], dilation=3)),
    "2d_same": ((3, 3), (6, 5), {}),
    "2d_same_lower_strided": ((3, 2), (7, 6), dict(strides=(2, 1), padding="SAME_LOWER")),
    "2d_valid_dilated": ((3, 3), (7, 7), dict(dilation=2, padding="VALID")),
    "2d_1x1_stride2": ((1, 1), (5, 6), dict(strides=2)),
    "2d_input_dilation": ((3, 3), (4, 5), dict(input_dilation=2, padding=[(2, 1), (1, 2)])),
    "2d_input_dilation_strided": ((3, 2), (4, 5), dict(input_dilation=(2, 1), strides=2, padding=[(1, 1), (0, 0)])),
    "3d_same_strided": ((2, 3, 2), (4, 3, 4), dict(strides=(1, 2, 1))),
    "3d_valid_dilated": ((1, 2, 2), (3, 4, 5), dict(padding="VALID", dilation=(1, 1, 2))),
}


# name -> (kernel_size, input spatial shape, keyword arguments of bsconv_transpose)
TRANSPOSE_GEOMETRIES = {
    "1d_same_s2": ((3,), (5,), dict(strides=2)),
    "1d_valid_s3_k2": ((2,), (4,), dict(strides=3, padding="VALID")),
    "1d_explicit_dilated": ((3,), (5,), dict(strides=2, padding=[(3, 1)], dilation=2)),
    "2d_same_s2": ((3, 3), (3, 4), dict(strides=2)),
    "2d_valid_s2_k4": ((4, 4), (3, 3), dict(strides=(2, 1), padding="VALID")),
    "2d_explicit_negative": ((3, 2), (4, 3), dict(strides=2, padding=[(-1, 2), (0, 1)])),
    "3d_same_s2": ((2, 2, 3), (2, 3, 2), dict(strides=(2, 1, 2))),
}


def make_conv_problem(layout_name, kernel_size, dtype=F32, seed=0):
    """(mask, layout, w) for a conv: w [capacity, *kernel_size, bs, bs], padding slots zero."""
    kind, bs, grid, extra = LAYOUTS[layout_name]
    mask = make_mask(kind, grid, seed)
    layout = jbs.Layout.from_mask(mask, bs, capacity=int(mask.sum()) + extra)
    w = rand((layout.capacity, *kernel_size, bs, bs), dtype, seed + 1)
    valid = (np.arange(layout.capacity) < mask.sum()).reshape(-1, *(1,) * (len(kernel_size) + 2))
    return mask, layout, jnp.where(valid, w, 0).astype(dtype)


def dense_kernel(w, mask, block_size):
    """Oracle of conv_to_dense: [*ks, C, K] from the mask alone (differentiable in w)."""
    kernel_size = w.shape[1:-2]
    taps = jnp.moveaxis(w.reshape(w.shape[0], -1, block_size, block_size), 1, 0)
    per_tap = jnp.stack([dense_of(t, mask, block_size) for t in taps])
    return per_tap.reshape(*kernel_size, *per_tap.shape[-2:])


def dnums(ndim):
    spatial = "DHW"[3 - (ndim - 2) :] if ndim <= 5 else None
    return ("N" + spatial + "C", spatial + "IO", "N" + spatial + "C")


def ref_conv(x, w, mask, layout, strides=1, padding="SAME", dilation=1, input_dilation=1):
    n = x.ndim - 2
    tup = lambda v: (v,) * n if isinstance(v, int) else tuple(v)  # noqa: E731
    W = dense_kernel(w.astype(F32), mask, layout.block_size)
    return lax.conv_general_dilated(
        x.astype(F32),
        W,
        tup(strides),
        padding,
        lhs_dilation=tup(input_dilation),
        rhs_dilation=tup(dilation),
        dimension_numbers=dnums(x.ndim),
        precision=HIGHEST,
    )


def ref_conv_transpose(x, w, mask, layout, strides=1, padding="SAME", dilation=1, transpose_kernel=False):
    n = x.ndim - 2
    tup = lambda v: (v,) * n if isinstance(v, int) else tuple(v)  # noqa: E731
    W = dense_kernel(w.astype(F32), mask, layout.block_size)
    return lax.conv_transpose(
        x.astype(F32),
        W,
        tup(strides),
        padding,
        rhs_dilation=tup(dilation),
        dimension_numbers=dnums(x.ndim),
        transpose_kernel=transpose_kernel,
        precision=HIGHEST,
    )


def conv_operands(layout_name, geometry, dtype=F32, seed=0):
    kernel_size, spatial, kw = GEOMETRIES[geometry]
    mask, layout, w = make_conv_problem(layout_name, kernel_size, dtype, seed)
    x = rand((N, *spatial, layout.shape[0]), dtype, seed + 2)
    return mask, layout, w, x, kw


# ---------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------


# Each geometry runs on one layout and dtype (cycling through all of them), and two
# geometries run on every one: all combinations are covered without a full product.
LAYOUT_DTYPES = [
    ("random_bs8", F32),
    ("random_bs8", BF16),
    ("empty_bs8", F32),
    ("full_bs16", F32),
    ("long_column_bs32", BF16),
]
FULL_PRODUCT = ("2d_same_lower_strided", "2d_input_dilation")


def _geometry_cases(geometries, full_product):
    cases = []
    for i, name in enumerate(geometries):
        combos = LAYOUT_DTYPES if name in full_product else [LAYOUT_DTYPES[i % len(LAYOUT_DTYPES)]]
        cases += [pytest.param(name, lay, dt, id=f"{name}-{lay}-{np.dtype(dt).name}") for lay, dt in combos]
    return cases


@pytest.mark.parametrize("geometry,layout_name,dtype", _geometry_cases(GEOMETRIES, FULL_PRODUCT))
def test_bsconv_against_dense_conv(geometry, layout_name, dtype):
    mask, layout, w, x, kw = conv_operands(layout_name, geometry, dtype)
    got, want = jax.jit(lambda x, w: (jbs.bsconv(x, w, layout, **kw), ref_conv(x, w, mask, layout, **kw)))(x, w)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype, math.prod(w.shape[1:-2]) * layout.shape[0])


def test_references_are_the_definitions():
    mask, layout, w, x, kw = conv_operands("random_bs8", "2d_input_dilation_strided")
    both = lambda x, w: (jbs.bsconv_reference(x, w, layout, **kw), ref_conv(x, w, mask, layout, **kw))  # noqa: E731
    got, want = jax.jit(both)(x, w)
    assert_close(got, want, F32, 64)
    kernel_size, spatial, kw = TRANSPOSE_GEOMETRIES["2d_explicit_negative"]
    mask, layout, w = make_conv_problem("random_bs8", kernel_size)
    x = rand((N, *spatial, layout.shape[1]), F32, 3)

    def both(x, w):
        kw2 = dict(kw, transpose_kernel=True)
        return jbs.bsconv_transpose_reference(x, w, layout, **kw2), ref_conv_transpose(x, w, mask, layout, **kw2)

    got, want = jax.jit(both)(x, w)
    assert_close(got, want, F32, 64)
    low = jbs.bsconv_reference(rand((N, 4, 4, 24), BF16), w, layout, preferred_element_type=BF16)
    assert low.dtype == BF16


@pytest.mark.parametrize("transpose_kernel", [False, True], ids=["plain", "transpose_kernel"])
@pytest.mark.parametrize("geometry,layout_name,dtype", _geometry_cases(TRANSPOSE_GEOMETRIES, ("2d_same_s2",)))
def test_bsconv_transpose_against_lax_conv_transpose(geometry, layout_name, dtype, transpose_kernel):
    kernel_size, spatial, kw = TRANSPOSE_GEOMETRIES[geometry]
    kw = dict(kw, transpose_kernel=transpose_kernel)
    mask, layout, w = make_conv_problem(layout_name, kernel_size, dtype)
    c_in = layout.shape[1] if transpose_kernel else layout.shape[0]
    x = rand((N, *spatial, c_in), dtype, 3)

    def both(x, w):
        return jbs.bsconv_transpose(x, w, layout, **kw), ref_conv_transpose(x, w, mask, layout, **kw)

    got, want = jax.jit(both)(x, w)
    assert got.dtype == dtype and got.shape == want.shape
    assert_close(got, want, dtype, math.prod(kernel_size) * c_in)


def test_bsconv_transpose_with_transpose_kernel_is_the_input_gradient_of_bsconv():
    # lax.conv_transpose(transpose_kernel=True) is the input gradient of a strided conv.
    mask, layout, w = make_conv_problem("random_bs8", (3, 3))
    x = rand((N, 8, 8, layout.shape[0]), seed=4)
    g = rand((N, 4, 4, layout.shape[1]), seed=5)

    def both(x, w, g):
        (dx,) = jax.vjp(lambda x: jbs.bsconv(x, w, layout, strides=2, padding="SAME"), x)[1](g)
        return dx, jbs.bsconv_transpose(g, w, layout, strides=2, padding="SAME", transpose_kernel=True)

    dx, got = jax.jit(both)(x, w, g)
    assert_close(got, dx, F32, 9 * layout.shape[1])


def test_preferred_element_type_and_mixed_dtypes():
    mask, layout, w = make_conv_problem("random_bs8", (3, 3), BF16)
    x = rand((N, 5, 5, layout.shape[0]), BF16, 6)

    @jax.jit
    def run(x, w):
        return (
            jbs.bsconv(x, w, layout, preferred_element_type=F32),
            jbs.bsconv(x.astype(F32), w, layout),  # f32 x bf16 promotes to f32
            jbs.bsconv_transpose(x, w, layout, strides=2, preferred_element_type=jnp.float16),
            ref_conv(x, w, mask, layout),
        )

    y32, promoted, y16, want = run(x, w)
    assert (y32.dtype, promoted.dtype, y16.dtype) == (F32, F32, jnp.float16)
    assert_close(y32, want, F32, 9 * 24)
    assert_close(promoted, want, F32, 9 * 24)


def test_padding_slots_with_garbage_are_ignored():
    mask, layout, w = make_conv_problem("random_bs8", (3, 2))
    nnz = layout.nnz
    assert layout.capacity > nnz
    garbage = w.at[nnz:].set(jnp.nan)
    x = rand((N, 5, 4, layout.shape[0]), seed=7)
    xk = rand((N, 3, 3, layout.shape[1]), seed=8)

    @jax.jit
    def run(w):
        return (
            jbs.bsconv(x, w, layout),
            jbs.bsconv_transpose(x, w, layout, strides=2),
            jbs.bsconv_transpose(xk, w, layout, strides=2, transpose_kernel=True),
            jax.grad(lambda w: jnp.sum(jbs.bsconv(x, w, layout) ** 2))(w),
            jax.grad(lambda w: jnp.sum(jbs.bsconv_transpose(x, w, layout, strides=2) ** 2))(w),
        )

    got, want = run(garbage), run(w)
    for a, b in zip(got, want):
        assert_close(a, b, F32, 6 * 24)
    np.testing.assert_array_equal(np.asarray(got[3][nnz:]), 0.0)
    np.testing.assert_array_equal(np.asarray(got[4][nnz:]), 0.0)
    assert_close(want[0], ref_conv(x, w, mask, layout), F32, 6 * 24)


@pytest.mark.parametrize(
    "spatial,kw", [((2, 2), dict(padding="VALID")), ((0, 3), {}), ((3, 3), dict(padding=[(-1, -1), (0, 0)]))]
)
def test_empty_outputs(spatial, kw):
    mask, layout, w = make_conv_problem("random_bs8", (3, 3))
    x = rand((N, *spatial, layout.shape[0]))
    got = jbs.bsconv(x, w, layout, **kw)
    want = ref_conv(x, w, mask, layout, **kw)
    assert got.shape == want.shape and 0 in got.shape
    grad = jax.grad(lambda w: jnp.sum(jbs.bsconv(x, w, layout, **kw)))(w)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_layout_without_blocks_or_slots():
    layout = jbs.Layout.from_mask(np.zeros((3, 2), bool), 8)  # capacity 0
    x, w = rand((N, 5, 5, 24)), jnp.zeros((0, 3, 3, 8, 8))

    @jax.jit
    def run(x, w):
        y = jbs.bsconv(x, w, layout, strides=2)
        yt = jbs.bsconv_transpose(x, w, layout, strides=2)
        gx = jax.grad(lambda x: jnp.sum(jbs.bsconv(x, w, layout)))(x)
        gw = jax.grad(lambda w: jnp.sum(jbs.bsconv_transpose(x, w, layout)))(w)
        return y, yt, gx, gw

    y, yt, gx, gw = run(x, w)
    assert (y.shape, yt.shape, gx.shape, gw.shape) == ((N, 3, 3, 16), (N, 10, 10, 16), x.shape, w.shape)
    for a in (y, yt, gx):
        np.testing.assert_array_equal(np.asarray(a), 0.0)


# ---------------------------------------------------------------------------------
# Dense conversion and tap-stacked layouts
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kernel_size,layout_name",
    [((3,), "random_bs8"), ((2, 3), "empty_bs8"), ((1, 2, 2), "full_bs16")],
    ids=["1d", "2d", "3d"],
)
def test_conv_to_dense_and_back(kernel_size, layout_name):
    mask, layout, w = make_conv_problem(layout_name, kernel_size)
    bs = layout.block_size
    D = rand((*kernel_size, *layout.shape), seed=3)

    @jax.jit
    def run(w, D):
        W = jbs.conv_to_dense(w, layout)
        back = jbs.conv_from_dense(D, layout)
        return W, dense_kernel(w, mask, bs), jbs.conv_from_dense(W, layout), back, jbs.conv_to_dense(back, layout)

    W, W_oracle, w_again, back, D_masked = run(w, D)
    assert W.shape == (*kernel_size, *layout.shape) and back.shape == w.shape
    np.testing.assert_array_equal(np.asarray(W), np.asarray(W_oracle))
    np.testing.assert_array_equal(np.asarray(w_again), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(D_masked), np.asarray(D) * np.kron(mask, np.ones((bs, bs))))
    # from dense gathers the mask's blocks in storage order, zero in padding slots.
    rows, cols = storage_order(mask)
    blocks = np.asarray(D).reshape(*kernel_size, mask.shape[0], bs, mask.shape[1], bs)
    for s, (r, c) in enumerate(zip(rows, cols)):
        np.testing.assert_array_equal(np.asarray(back[s]), blocks[..., r, :, c, :])
    np.testing.assert_array_equal(np.asarray(back[len(rows) :]), 0.0)


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "cols"])
@pytest.mark.parametrize("kind", ["random", "empty", "full", "empty_rows_cols", "long_column"])
def test_stacked_layout_equals_layout_of_repeated_mask(kind, axis):
    mask = make_mask(kind, (4, 3), seed=1)
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 2)
    for taps in (1, 2, 9):
        want = jbs.Layout.from_mask(np.repeat(mask, taps, axis=axis), 8, capacity=taps * layout.capacity)
        concrete_result = stack_taps(layout, taps, axis)  # numpy arithmetic
        results = [concrete_result]
        if taps == 9:  # jnp arithmetic on traced tables
            results.append(jax.jit(stack_taps, static_argnums=(1, 2))(layout, taps, axis))
        for stacked, source in results:
            assert (stacked.grid, stacked.capacity, stacked.block_size) == (want.grid, want.capacity, 8)
            for name, got, expected in zip(want.tables._fields, stacked.tables, want.tables):
                np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=f"{name}, {taps} taps")
            if axis == 1:
                np.testing.assert_array_equal(np.asarray(source), np.asarray(concrete_result[1]))
                assert sorted(np.asarray(source).tolist()) == list(range(taps * layout.capacity))  # a permutation


@pytest.mark.parametrize("axis", [0, 1], ids=["rows", "cols"])
def test_stacked_layout_holds_every_tap(axis):
    mask, taps, bs = make_mask("random", (4, 3), seed=2), 6, 8
    layout = jbs.Layout.from_mask(mask, bs, capacity=int(mask.sum()) + 2)
    stacked, source = stack_taps(layout, taps, axis)
    w = rand((layout.capacity, taps, bs, bs), seed=1)
    w = jnp.where((jnp.arange(layout.capacity) < layout.nnz)[:, None, None, None], w, 0)
    cb, kb = layout.grid

    @jax.jit
    def run(w):
        flat = w.reshape(-1, bs, bs)
        blocks = flat if axis == 0 else flat[source]
        W = jnp.stack([dense_of(w[:, t], mask, bs) for t in range(taps)], axis=1)  # [C, T, K]
        if axis == 0:  # block row c*T + t: [CB, bs, T, K] -> [CB, T, bs, K]
            W = W.reshape(cb, bs, taps, kb * bs).swapaxes(1, 2).reshape(cb * taps * bs, kb * bs)
        else:  # block column k*T + t: [C, T, KB, bs] -> [C, KB, T, bs]
            W = W.reshape(cb * bs, taps, kb, bs).swapaxes(1, 2).reshape(cb * bs, kb * taps * bs)
        return jbs.to_dense(blocks, stacked), W

    got, want = run(w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ---------------------------------------------------------------------------------
# Transforms: grad, check_grads, vmap, jvp, linear_transpose, traced layouts
# ---------------------------------------------------------------------------------

GRAD_CASES = {
    "conv_2d_strided": ("conv", (3, 3), (6, 5), dict(strides=2)),
    "conv_1d_dilated_valid": ("conv", (3,), (9,), dict(dilation=2, padding="VALID")),
    "conv_2d_input_dilation": ("conv", (3, 2), (3, 4), dict(input_dilation=2, padding=[(1, 2), (1, 1)])),
    "conv_3d": ("conv", (2, 2, 2), (3, 3, 3), {}),
    "transpose_2d": ("transpose", (3, 3), (3, 3), dict(strides=2)),
    "transpose_kernel_1d": ("transpose", (4,), (4,), dict(strides=2, padding="VALID", transpose_kernel=True)),
}


def _grad_case(name):
    op, kernel_size, spatial, kw = GRAD_CASES[name]
    mask, layout, w = make_conv_problem("random_bs8", kernel_size)
    c_in = layout.shape[1] if kw.get("transpose_kernel") else layout.shape[0]
    x = rand((N, *spatial, c_in), seed=11)
    if op == "conv":
        return (lambda x, w: jbs.bsconv(x, w, layout, **kw)), (lambda x, w: ref_conv(x, w, mask, layout, **kw)), x, w
    return (
        (lambda x, w: jbs.bsconv_transpose(x, w, layout, **kw)),
        (lambda x, w: ref_conv_transpose(x, w, mask, layout, **kw)),
        x,
        w,
    )


@pytest.mark.parametrize("name", GRAD_CASES)
def test_grad_and_jvp_against_dense(name):
    f, ref, x, w = _grad_case(name)
    target = rand(jax.eval_shape(f, x, w).shape, seed=12)
    tx, tw = rand(x.shape, seed=13), rand(w.shape, seed=14)

    @jax.jit
    def run(x, w, tx, tw):
        out = []
        for fn in (f, ref):
            loss = lambda x, w: jnp.sum(jnp.tanh(fn(x, w)) * target)  # noqa: E731
            out.append((*jax.grad(loss, argnums=(0, 1))(x, w), jax.jvp(fn, (x, w), (tx, tw))[1]))
        return out

    (gx, gw, jvp), (rx, rw, rjvp) = run(x, w, tx, tw)
    assert_close(gx, rx, F32, 9 * 24)
    assert_close(gw, rw, F32, int(np.prod(target.shape[:-1])))
    assert_close(jvp, rjvp, F32, 9 * 24)


@pytest.mark.parametrize("op", ["conv", "transpose"])
def test_check_grads_tiny(op):
    mask, layout, w = make_conv_problem("random_bs8", (2, 2), seed=3)
    x = rand((1, 3, 3, layout.shape[0]), seed=15)
    if op == "conv":
        f = jax.jit(lambda x, w: jbs.bsconv(x, w, layout, strides=(1, 2)))
    else:
        f = jax.jit(lambda x, w: jbs.bsconv_transpose(x, w, layout, strides=2))
    check_grads(f, (x, w), order=1, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_vmap_over_x_and_w_and_of_grad():
    mask, layout, w = make_conv_problem("random_bs8", (3, 3))
    xs = rand((2, N, 5, 4, layout.shape[0]), seed=16)
    ws = jnp.stack([w, 2 * w])
    f = lambda x, w: jbs.bsconv(x, w, layout, strides=(2, 1))  # noqa: E731
    ref = lambda x, w: ref_conv(x, w, mask, layout, strides=(2, 1))  # noqa: E731
    sq = lambda fn: jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), argnums=1)  # noqa: E731

    @jax.jit
    def run(xs, ws):
        return [
            (
                jax.vmap(fn, in_axes=(0, None))(xs, ws[0]),
                # x mapped on a middle axis, w mapped too, output mapped on axis 1
                jax.vmap(fn, in_axes=(2, 0), out_axes=1)(jnp.moveaxis(xs, 0, 2), ws),
                jax.vmap(sq(fn), in_axes=(0, None))(xs, ws[0]),
            )
            for fn in (f, ref)
        ]

    got, want = run(xs, ws)
    assert_close(got[0], want[0], F32, 9 * 24)
    assert_close(got[1], want[1], F32, 9 * 24)
    assert got[1].shape == (N, 2, 3, 4, layout.shape[1])
    assert_close(got[2], want[2], F32, 100)


def test_vmap_over_layouts():
    # One mask per ensemble member, equal capacity: the layout tables are batched.
    masks = [make_mask("random", (3, 2), seed=s) for s in (0, 9)]
    cap = max(int(m.sum()) for m in masks)
    layouts = [jbs.Layout.from_mask(m, 8, capacity=cap) for m in masks]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layouts)
    w = rand((cap, 3, 3, 8, 8), seed=23)
    x = rand((N, 3, 3, 24), seed=17)
    got = jax.jit(jax.vmap(lambda lay: (jbs.bsconv_transpose(x, w, lay, strides=2), jbs.bsconv(x, w, lay))))(stacked)

    @jax.jit
    def want():
        return [(ref_conv_transpose(x, w, m, lay, strides=2), ref_conv(x, w, m, lay)) for m, lay in zip(masks, layouts)]

    for i, expected in enumerate(want()):
        assert_close(got[0][i], expected[0], F32, 9 * 24)
        assert_close(got[1][i], expected[1], F32, 9 * 24)


def test_linear_transpose():
    mask, layout, w = make_conv_problem("random_bs8", (3, 3))
    x = rand((N, 5, 5, layout.shape[0]), seed=18)
    ct = rand((N, 3, 3, layout.shape[1]), seed=19)
    ct_w = rand((N, 10, 10, layout.shape[1]), seed=20)  # SAME, stride 2: 5 -> 10

    @jax.jit
    def run(x, w, ct, ct_w):
        (tx,) = jax.linear_transpose(lambda x: jbs.bsconv(x, w, layout, strides=2), x)(ct)
        (rx,) = jax.linear_transpose(lambda x: ref_conv(x, w, mask, layout, strides=2), x)(ct)
        (tw,) = jax.linear_transpose(lambda w: jbs.bsconv_transpose(x, w, layout, strides=2), w)(ct_w)
        (rw,) = jax.vjp(lambda w: ref_conv_transpose(x, w, mask, layout, strides=2), w)[1](ct_w)
        return tx, rx, tw, rw

    tx, rx, tw, rw = run(x, w, ct, ct_w)
    assert_close(tx, rx, F32, 9 * 16)
    assert_close(tw, rw, F32, 500)


def test_layout_as_jit_argument_does_not_recompile():
    kernel_size = (3, 3)
    masks = [make_mask("random", (3, 2), seed=s) for s in (0, 1)]
    cap = max(int(m.sum()) for m in masks) + 1
    traces = []

    @jax.jit
    def f(x, w, layout):
        traces.append(1)
        return jbs.bsconv(x, w, layout, strides=2), jbs.bsconv_transpose(x, w, layout, strides=2)

    x = rand((N, 5, 5, 24), seed=21)
    w = rand((cap, *kernel_size, 8, 8), seed=22)
    # The library's references (checked against lax above) take the layout as data too.
    ref = jax.jit(
        lambda x, w, lay: (
            jbs.bsconv_reference(x, w, lay, strides=2),
            jbs.bsconv_transpose_reference(x, w, lay, strides=2),
        )
    )
    for m in masks:
        layout = jbs.Layout.from_mask(m, 8, capacity=cap)
        got, want = f(x, w, layout), ref(x, w, layout)
        assert_close(got[0], want[0], F32, 9 * 24)
        assert_close(got[1], want[1], F32, 9 * 24)
    assert len(traces) == 1


# ---------------------------------------------------------------------------------
# Errors name the argument and the shapes
# ---------------------------------------------------------------------------------


def _err_operands():
    mask, layout, w = make_conv_problem("random_bs8", (3, 3))  # C = 24, K = 16
    return layout, w, rand((N, 5, 5, 24))


# name -> (call of (layout, w [cap, 3, 3, 8, 8], x [2, 5, 5, 24]), error type, message pattern)
ERRORS = {
    "x_rank": (
        lambda lay, w, x: jbs.bsconv(x[0], w, lay),
        ValueError,
        r"x must have shape \[N, \*spatial, C\] with 2 spatial dims.*\(5, 5, 24\)",
    ),
    "x_channels": (
        lambda lay, w, x: jbs.bsconv(x[..., :16], w, lay),
        ValueError,
        r"x has 16 channels.*\(24, 16\).*C \(layout.shape\[0\]\) = 24",
    ),
    "kernel_shape": (
        lambda lay, w, x: jbs.bsconv(x, w[..., :4], lay),
        ValueError,
        r"w must have shape \[capacity, \*kernel_size, bs, bs\].*\(\d+, 3, 3, 8, 4\)",
    ),
    "w_capacity": (lambda lay, w, x: jbs.bsconv(x, w[1:], lay), ValueError, r"w must have shape"),
    "w_no_spatial": (lambda lay, w, x: jbs.bsconv(x, w[:, 0, 0], lay), ValueError, r"at least one spatial dim"),
    "padding_string": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, padding="CIRCULAR"),
        ValueError,
        r"padding must be one of \('SAME', 'SAME_LOWER', 'VALID'\).*'CIRCULAR'",
    ),
    "padding_pairs": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, padding=[(1, 1)]),
        ValueError,
        r"padding must be .* 2 \(low, high\) int pairs",
    ),
    "padding_transpose": (
        lambda lay, w, x: jbs.bsconv_transpose(x, w, lay, padding="SAME_LOWER"),
        ValueError,
        r"padding must be one of \('SAME', 'VALID'\)",
    ),
    "padding_crops_too_much": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, padding=[(-3, -3), (0, 0)]),
        ValueError,
        r"negative padding \(\(-3, -3\), \(0, 0\)\) crops more than the \(dilated\) input.*\(2, 5, 5, 24\)",
    ),
    "strides_length": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, strides=(1, 1, 1)),
        ValueError,
        r"strides must have one entry per spatial dim \(2\)",
    ),
    "strides_zero": (lambda lay, w, x: jbs.bsconv(x, w, lay, strides=0), ValueError, r"strides must be >= 1, got 0"),
    "dilation_type": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, dilation=1.5),
        TypeError,
        r"dilation must be an int or a sequence of 2 ints",
    ),
    "dilation_negative": (
        lambda lay, w, x: jbs.bsconv_transpose(x, w, lay, dilation=(1, -1)),
        ValueError,
        r"dilation must be >= 1",
    ),
    "input_dilation_string_padding": (
        lambda lay, w, x: jbs.bsconv(x, w, lay, input_dilation=2),
        ValueError,
        r"string padding 'SAME' is not defined with input_dilation \(2, 2\)",
    ),
    "transpose_kernel_channels": (
        lambda lay, w, x: jbs.bsconv_transpose(x, w, lay, transpose_kernel=True),
        ValueError,
        r"x has 24 channels.*K \(layout.shape\[1\], transpose_kernel=True\) = 16",
    ),
    "x_dtype": (
        lambda lay, w, x: jbs.bsconv(x.astype(jnp.int32), w, lay),
        TypeError,
        r"x must be float32, bfloat16 or float16, got int32",
    ),
    "not_a_layout": (lambda lay, w, x: jbs.bsconv(x, w, None), TypeError, r"layout must be a jax_blocksparse.Layout"),
    "to_dense_shape": (
        lambda lay, w, x: jbs.conv_to_dense(w[:, :, :, :4], lay),
        ValueError,
        r"conv_to_dense: w must have shape",
    ),
    "from_dense_shape": (
        lambda lay, w, x: jbs.conv_from_dense(jnp.zeros((3, 3, 24, 8)), lay),
        ValueError,
        r"conv_from_dense: W must have shape \[\*kernel_size, C, K\] with \[C, K\] = \(24, 16\).*\(3, 3, 24, 8\)",
    ),
}


@pytest.mark.parametrize("name", ERRORS)
def test_bad_input_raises(name):
    call, error, pattern = ERRORS[name]
    with pytest.raises(error, match=pattern):
        call(*_err_operands())


# ---------------------------------------------------------------------------------
# Cross-lowering for 'cuda': the convs are bsmm custom calls, with no dense kernel
# ---------------------------------------------------------------------------------

CUDA_TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")


@pytest.fixture
def cuda_extension():
    require_cuda_extension()


def _lowering_cases():
    # grid (2, 3) with bs 16: C = 32, K = 48; kernel 3x3 -> a dense kernel would be 3x3x32x48.
    mask = np.array([[1, 0, 1], [0, 1, 1]], bool)
    layout = jbs.Layout.from_mask(mask, 16, capacity=5)
    conv = lambda x, w: jbs.bsconv(x, w, layout, strides=2)  # noqa: E731
    tconv = lambda x, w: jbs.bsconv_transpose(x, w, layout, strides=2)  # noqa: E731
    tconv_k = lambda x, w: jbs.bsconv_transpose(x, w, layout, strides=2, transpose_kernel=True)  # noqa: E731

    def grad(f):
        return jax.grad(lambda x, w: jnp.sum(f(x, w).astype(F32) ** 2), argnums=(0, 1))

    # name -> (function, input channels, custom calls expected under "kernels")
    return layout, {
        "bsconv": (conv, 32, {"jbs_bsmm_fprop"}),
        "grad_bsconv": (grad(conv), 32, set(CUDA_TARGETS)),
        "bsconv_transpose": (tconv, 32, {"jbs_bsmm_fprop"}),
        "grad_bsconv_transpose": (grad(tconv), 32, set(CUDA_TARGETS)),
        "bsconv_transpose_kernel": (tconv_k, 48, {"jbs_bsmm_bprop"}),
        "grad_bsconv_transpose_kernel": (grad(tconv_k), 48, set(CUDA_TARGETS)),
    }


LOWERING_CASES = sorted(_lowering_cases()[1])


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", LOWERING_CASES)
def test_cuda_lowering_uses_bsmm_kernels(cuda_extension, name, dtype):
    layout, cases = _lowering_cases()
    fun, channels, expected = cases[name]
    x = rand((2, 6, 6, channels), dtype)
    w = rand((layout.capacity, 3, 3, 16, 16), dtype, 1)
    with jbs.config.implementation("kernels"):
        text = jax.jit(fun).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = kernel_calls(text) & set(CUDA_TARGETS)
    assert calls == expected, (name, calls)
    for dense in ("tensor<3x3x32x48x", "tensor<3x3x48x32x", "tensor<288x48x", "tensor<32x432x", "tensor<432x32x"):
        assert dense not in text, f"{name}: a dense kernel {dense} appears in the lowering"
