"""The convolution primitives (ops/conv_primitives.py) and their CPU kernels, against the reference.

tests/test_conv.py checks bsconv / bsconv_transpose against dense lax convolutions over
geometries and transforms on the default path (the CPU kernels where they are built).
Here each case runs the same function twice, ``impl="kernels"`` and
``impl="reference"``, forward and both gradients in one compiled program: every block
size, dtype, stride, padding, dilation and adversarial layout (empty block columns and
rows, one block, full, no block at all). Also: the kernels' float32 accumulation of
16-bit inputs, the handlers' checks, JVP / vmap / second order, sharded jit without
gathers, and the values of the bsmm compositions that the "cuda" lowering uses
(computed here with the CPU bsmm kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import (
    NUM_DEVICES,
    VECTOR_ISAS,
    assert_close,
    collectives,
    cpu_mesh,
    force_cpu_isa,
    kernel_calls,
    make_mask,
    rand,
    require_kernels,
    xla_optimizations_off,
)
from jax_blocksparse import targets
from jax_blocksparse.ops import conv_primitives
from jax_blocksparse.ops.conv_spec import ConvSpec

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
KERNELS = {"jbs_bsconv", "jbs_bsconv_wgrad"}


@pytest.fixture(autouse=True, scope="module")
def _setup():
    require_kernels("cpu")
    with xla_optimizations_off():
        yield


def _problem(kind, bs, grid, kernel_size, dtype, capacity_extra=1, seed=0):
    mask = make_mask(kind, grid, seed)
    layout = jbs.Layout.from_mask(mask, bs, capacity=int(mask.sum()) + capacity_extra)
    w = rand((layout.capacity, *kernel_size, bs, bs), F32, seed + 1)
    w = jbs.conv_from_dense(jbs.conv_to_dense(w, layout), layout).astype(dtype)  # zero padding slots
    return layout, w


def _fwd_and_grads(op, layout, impl, **kw):
    """(y, dx, dw) of ``op`` in one jitted function."""

    def loss(x, w):
        y = op(x, w, layout, impl=impl, **kw)
        return jnp.sum(y.astype(F32) * jnp.cos(jnp.arange(y.size, dtype=F32).reshape(y.shape))), y

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def _check(op, x, w, layout, dtype, length, **kw):
    fk, fr = (_fwd_and_grads(op, layout, impl, **kw) for impl in ("kernels", "reference"))
    calls = kernel_calls(fk.lower(x, w).as_text())
    assert calls == KERNELS, calls
    (dx, dw), y = fk(x, w)
    (dx_r, dw_r), y_r = fr(x, w)
    for got, want in ((y, y_r), (dx, dx_r), (dw, dw_r)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, np.asarray(want.astype(F32)), dtype, length)


# ---------------------------------------------------------------------------------
# Every block size x dtype (2-D, strided SAME), adversarial layouts
# ---------------------------------------------------------------------------------

GRIDS = {8: (3, 2), 16: (2, 3), 32: (2, 2), 64: (1, 2), 128: (1, 1)}


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("bs", sorted(GRIDS))
def test_block_sizes_and_dtypes(bs, dtype):
    layout, w = _problem("random", bs, GRIDS[bs], (3, 3), dtype)
    x = rand((2, 5, 6, layout.shape[0]), dtype, 2)
    _check(jbs.bsconv, x, w, layout, dtype, 9 * layout.shape[0], strides=2)


@pytest.mark.parametrize("kind", ["empty", "single", "full", "empty_rows_cols", "long_column"])
def test_adversarial_layouts(kind):
    layout, w = _problem(kind, 8, (3, 4), (3, 2), F32, capacity_extra=2)
    x = rand((3, 6, 5, layout.shape[0]), F32, 2)
    _check(jbs.bsconv, x, w, layout, F32, 6 * layout.shape[0], padding=[(1, 2), (0, 1)])
    xt = rand((2, 4, 3, layout.shape[1]), F32, 3)
    _check(jbs.bsconv_transpose, xt, w, layout, F32, 6 * layout.shape[1], strides=2, transpose_kernel=True)


# ---------------------------------------------------------------------------------
# Geometry: strides, padding, dilation, input dilation; 1-D, 2-D, 3-D; transposed
# ---------------------------------------------------------------------------------

# name -> (kernel_size, input spatial, bsconv keyword arguments)
GEOMETRIES = {
    "1d_same": ((3,), (11,), {}),
    "1d_stride3_valid": ((4,), (13,), dict(strides=3, padding="VALID")),
    "1d_crop_dilated": ((3,), (12,), dict(padding=[(-1, 3)], dilation=2)),
    "2d_same_lower_s2": ((3, 3), (7, 8), dict(strides=2, padding="SAME_LOWER")),
    "2d_valid_dilated": ((3, 2), (8, 7), dict(padding="VALID", dilation=(2, 3))),
    "2d_stride_gt_kernel": ((2, 2), (9, 9), dict(strides=3, padding=[(1, 0), (0, 2)])),
    "2d_input_dilation": ((3, 3), (4, 5), dict(input_dilation=2, padding=[(2, 1), (1, 2)])),
    "2d_input_dilation_s3": ((3, 2), (5, 4), dict(input_dilation=(2, 3), strides=(3, 2), padding=[(1, 2), (0, 1)])),
    "2d_1x1_s2": ((1, 1), (6, 5), dict(strides=2)),
    "2d_big_pad": ((2, 2), (3, 3), dict(padding=[(4, 5), (3, 0)])),
    "3d_same_s2": ((3, 2, 3), (4, 5, 5), dict(strides=(1, 2, 2))),
    "3d_valid_dilated": ((2, 2, 2), (4, 3, 5), dict(padding="VALID", dilation=(1, 1, 2))),
}


@pytest.mark.parametrize("bs", sorted(GRIDS))
@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_transposed_kernels_on_each_vector_instruction_set(monkeypatch, isa, bs):
    # transpose_kernel transposes each (slot, tap) block in the kernels, a routine of its
    # own per instruction set.
    force_cpu_isa(monkeypatch, isa)
    layout, w = _problem("random", bs, GRIDS[bs], (2, 3), F16)
    xt = rand((2, 3, 4, layout.shape[1]), F16, 3)
    _check(jbs.bsconv_transpose, xt, w, layout, F16, 6 * layout.shape[1], strides=2, transpose_kernel=True)


# name -> (kernel_size, input spatial, bsconv_transpose keyword arguments)
TRANSPOSE_GEOMETRIES = {
    "1d_s2_same": ((3,), (6,), dict(strides=2)),
    "2d_s2_valid_k4": ((4, 4), (3, 4), dict(strides=(2, 3), padding="VALID")),
    "2d_explicit_dilated": ((3, 2), (4, 3), dict(strides=2, padding=[(3, 1), (0, 2)], dilation=2)),
    "3d_s2": ((2, 2, 2), (2, 3, 2), dict(strides=2)),
}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_bsconv_geometry(name):
    kernel_size, spatial, kw = GEOMETRIES[name]
    layout, w = _problem("random", 8, (2, 3), kernel_size, F32)
    x = rand((2, *spatial, layout.shape[0]), F32, 2)
    _check(jbs.bsconv, x, w, layout, F32, 27 * 16, **kw)


@pytest.mark.parametrize("transpose_kernel", [False, True], ids=["plain", "transpose_kernel"])
@pytest.mark.parametrize("name", sorted(TRANSPOSE_GEOMETRIES))
def test_bsconv_transpose_geometry(name, transpose_kernel):
    kernel_size, spatial, kw = TRANSPOSE_GEOMETRIES[name]
    layout, w = _problem("random", 8, (2, 3), kernel_size, F32)
    channels = layout.shape[1] if transpose_kernel else layout.shape[0]
    x = rand((2, *spatial, channels), F32, 2)
    _check(jbs.bsconv_transpose, x, w, layout, F32, 27 * 24, transpose_kernel=transpose_kernel, **kw)


# ---------------------------------------------------------------------------------
# Numerics: float32 accumulation, output dtypes, float32_dw
# ---------------------------------------------------------------------------------


def test_16bit_inputs_accumulate_in_float32():
    """Terms that cancel: a 16-bit accumulator would lose the small ones."""
    layout, _ = _problem("full", 16, (1, 1), (1, 3), BF16)
    x = jnp.tile(jnp.asarray([1024.0, 1.0, -1024.0], BF16), 6)[None, None, :16, None]
    x = jnp.broadcast_to(x, (1, 1, 16, 16)).astype(BF16)
    w = jnp.ones((layout.capacity, 1, 3, 16, 16), BF16)
    got = jbs.bsconv(x, w, layout, padding="VALID", impl="kernels", preferred_element_type=F32)
    want = jbs.bsconv(x, w, layout, padding="VALID", impl="reference", preferred_element_type=F32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("out", [F32, F16], ids=["f32", "f16"])
def test_output_dtype_and_float32_dw(out):
    layout, w = _problem("random", 16, (2, 2), (3, 3), F32)
    x = rand((2, 5, 5, 32), F32, 2)
    kw = dict(compute_dtype=BF16, preferred_element_type=out, float32_dw=True)
    _check(jbs.bsconv, x, w, layout, BF16, 9 * 32, **kw)
    (_, dw), _ = _fwd_and_grads(jbs.bsconv, layout, "kernels", **kw)(x, w)
    assert dw.dtype == F32


# ---------------------------------------------------------------------------------
# Transforms: JVP, vmap, second order
# ---------------------------------------------------------------------------------


def _problem_2d():
    layout, w = _problem("random", 8, (2, 3), (3, 3), F32)
    return layout, w, rand((2, 6, 5, layout.shape[0]), F32, 2)


def test_jvp():
    layout, w, x = _problem_2d()
    tx, tw = rand(x.shape, F32, 5), rand(w.shape, F32, 6)

    def f(impl):
        return jax.jit(
            lambda x, w, tx, tw: jax.jvp(lambda x, w: jbs.bsconv(x, w, layout, strides=2, impl=impl), (x, w), (tx, tw))
        )

    for got, want in zip(f("kernels")(x, w, tx, tw), f("reference")(x, w, tx, tw)):
        assert_close(got, want, F32, 9 * 16)


@pytest.mark.parametrize("batched", ["x", "w", "both"])
def test_vmap(batched):
    layout, w, x = _problem_2d()
    xs = jnp.stack([x, 2 * x]) if batched in ("x", "both") else x
    ws = jnp.stack([w, -w + 1]) if batched in ("w", "both") else w
    axes = (0 if batched in ("x", "both") else None, 0 if batched in ("w", "both") else None)

    def f(impl):
        def loss(x, w):
            return jnp.sum(jnp.sin(jbs.bsconv(x, w, layout, strides=(1, 2), impl=impl)))

        return jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1)), in_axes=axes))

    for got, want in zip(jax.tree.leaves(f("kernels")(xs, ws)), jax.tree.leaves(f("reference")(xs, ws))):
        assert_close(got, want, F32, 9 * 16)


def test_second_order():
    """grad of a function of the gradient: transposes of bsconv_wgrad and of the dual conv."""
    layout, w, x = _problem_2d()

    def f(impl):
        def inner(x, w):
            return jnp.sum(jnp.sin(jbs.bsconv(x, w, layout, strides=2, impl=impl)))

        def outer(x, w):
            dx, dw = jax.grad(inner, argnums=(0, 1))(x, w)
            return jnp.sum(dx**2) + jnp.sum(jnp.cos(dw))

        return jax.jit(jax.grad(outer, argnums=(0, 1)))

    for got, want in zip(f("kernels")(x, w), f("reference")(x, w)):
        assert_close(got, want, F32, 9 * 16 * 16)


# ---------------------------------------------------------------------------------
# Sharded jit: split over the batch, no gathers
# ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("cpu_default_device")
def test_jit_batch_sharded_does_not_gather():
    layout, w, _ = _problem_2d()
    x = rand((NUM_DEVICES, 6, 5, layout.shape[0]), F32, 2)
    mesh = cpu_mesh((NUM_DEVICES,), ("batch",))
    x_s = jax.device_put(x, NamedSharding(mesh, P("batch")))
    w_s = jax.device_put(w, NamedSharding(mesh, P()))

    def loss(x, w):
        return jnp.sum(jnp.sin(jbs.bsconv(x, w, layout, strides=2)))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    lowered = f.lower(x_s, w_s)
    assert "CustomSPMDPartitioning" in lowered.as_text()
    compiled = lowered.compile().as_text()
    assert kernel_calls(compiled) == KERNELS
    found = collectives(compiled)
    assert found["all-gather"] == [] and found["all-to-all"] == [], found
    for got, want in zip(jax.tree.leaves(f(x_s, w_s)), jax.tree.leaves(f(x, w))):
        assert_close(got, want, F32, 9 * 16)


# ---------------------------------------------------------------------------------
# The "cuda" lowering's bsmm compositions, by value (on the CPU bsmm kernels)
# ---------------------------------------------------------------------------------

SPECS = {
    "im2col": ConvSpec((2, 1), ((1, 1), (0, 2)), (1, 1), (1, 2), False),
    "im2col_transpose_kernel": ConvSpec((2, 3), ((2, 0), (1, 1)), (1, 1), (1, 1), True),
    "im2col_dilated_strided": ConvSpec((2, 2), ((1, 1), (0, 1)), (2, 3), (1, 1), True),
    "col2im": ConvSpec((1, 1), ((2, 1), (1, 2)), (2, 2), (1, 1), False),
    "col2im_transpose_kernel": ConvSpec((1, 1), ((0, 2), (2, 2)), (3, 2), (2, 1), True),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_compositions_by_value(name):
    spec = SPECS[name]
    layout, w = _problem("random", 8, (2, 3), (3, 2), F32)
    channels = layout.shape[1] if spec.transpose_kernel else layout.shape[0]
    x = rand((2, 5, 6, channels), F32, 2)
    params = dict(spec=spec, compute_dtype=F32, out_dtype=F32, impl="auto", precision=None)
    want = conv_primitives.conv_reference(x, w, *layout.tables, **params)
    assert_close(conv_primitives.conv_composed(x, w, *layout.tables, **params), want, F32, 6 * 24)
    b = rand(want.shape, F32, 3)
    wg = dict(params, kernel_size=(3, 2), block_size=8)
    want_dw = conv_primitives.wgrad_reference(x, b, *layout.tables, **wg)
    assert_close(conv_primitives.wgrad_composed(x, b, *layout.tables, **wg), want_dw, F32, 60)


# ---------------------------------------------------------------------------------
# The handlers check their operands
# ---------------------------------------------------------------------------------


def _raw_call(target, out_shape, *operands, **attrs):
    call = jax.ffi.ffi_call(targets.target_name(target), jax.ShapeDtypeStruct(out_shape, F32))
    return jax.jit(lambda *ops: call(*ops, **attrs))(*operands)


def _attrs(nd=2, **over):
    attrs = dict(
        window_strides=np.ones(nd, np.int64),
        lhs_dilation=np.ones(nd, np.int64),
        rhs_dilation=np.ones(nd, np.int64),
        padding_low=np.zeros(nd, np.int64),
        transpose_kernel=np.bool_(False),
    )
    return {**attrs, **over}


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("channels", r"jbs_bsconv: need a \[\.\.\., 16\] and out \[\.\.\., 24\]"),
        ("attr_length", r"window_strides must have one entry per spatial dim \(2\)"),
        ("stride_zero", r"window_strides out of range"),
        ("dtype", r"jbs_bsconv"),
        ("wgrad_channels", r"jbs_bsconv_wgrad: need a \[\.\.\., 16\] and b \[\.\.\., 24\]"),
    ],
)
def test_handlers_reject_bad_operands(case, pattern):
    layout, w = _problem("random", 8, (2, 3), (3, 3), F32)
    t = layout.tables
    x, y = rand((1, 4, 4, 16), F32), (1, 4, 4, 24)
    ops = [x, w, *t[:5], t.col_order]
    if case == "channels":
        ops[0] = rand((1, 4, 4, 8), F32)
    if case == "dtype":
        ops[1] = w.astype(BF16)
    attrs = {
        "attr_length": _attrs(window_strides=np.ones(3, np.int64)),
        "stride_zero": _attrs(window_strides=np.zeros(2, np.int64)),
    }.get(case, _attrs())
    with pytest.raises(Exception, match=pattern):
        if case == "wgrad_channels":
            _raw_call("jbs_bsconv_wgrad", w.shape, x, rand((1, 4, 4, 16), F32), *t[:5], **attrs)
        else:
            _raw_call("jbs_bsconv", y, *ops, **attrs)


def test_four_spatial_dims_run_as_bsmm_products():
    """The kernels take 1 to 3 spatial dims; a 4-D convolution lowers to the bsmm compositions."""
    layout, w = _problem("random", 8, (2, 2), (2, 1, 2, 2), F32)
    x = rand((2, 3, 2, 3, 4, 16), F32, 2)
    fk, fr = (_fwd_and_grads(jbs.bsconv, layout, impl, strides=(1, 1, 2, 1)) for impl in ("kernels", "reference"))
    calls = kernel_calls(fk.lower(x, w).as_text())
    assert calls and calls <= {"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"}, calls
    for got, want in zip(jax.tree.leaves(fk(x, w)), jax.tree.leaves(fr(x, w))):
        assert_close(got, want, F32, 8 * 16)


# ---------------------------------------------------------------------------------
# The lowering policy: bsmm's seam (ops/_lowering.register_lowerings) with the
# convolution's kernel calls, platforms and compositions
# ---------------------------------------------------------------------------------


def test_auto_runs_the_kernels_at_any_density():
    """The crossover table measures the bsmm targets only: under "auto" a full layout still
    runs the convolution's own kernels on CPU, not the dense product."""
    layout, w = _problem("full", 8, (2, 2), (3, 3), F32, capacity_extra=0)
    x = rand((2, 5, 5, 16), F32, 2)
    calls = kernel_calls(_fwd_and_grads(jbs.bsconv, layout, "auto").lower(x, w).as_text())
    assert calls == KERNELS, calls


def test_the_seam_rejects_unknown_target_platforms():
    from jax.extend.core import Primitive

    from jax_blocksparse.ops import _lowering

    def reference(a, *_, **__):
        return a

    with pytest.raises(ValueError, match="target_platforms must be among"):
        _lowering.register_lowerings(
            Primitive("bsconv_test_only"), reference, target="jbs_bsconv", dense=reference, target_platforms=("tpu",)
        )
