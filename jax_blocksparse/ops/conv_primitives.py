"""The block-sparse convolution primitives: one general convolution and its weight gradient.

==============  ==================================================  ===========================
primitive       computes (:mod:`~jax_blocksparse.ops.conv_spec`)    shapes
==============  ==================================================  ===========================
bsconv          out = conv(a, W; spec)                              a [N, *in, Cin],
                                                                    w [cap, *k, bs, bs]
                                                                    -> [N, *out, Cout]
bsconv_wgrad    dw = d<conv(a, W; spec), b>/dW at the layout's      a [N, *in, Cin],
                blocks (0 at padding slots)                         b [N, *out, Cout]
                                                                    -> [cap, *k, bs, bs]
==============  ==================================================  ===========================

``Cin, Cout = C, K`` (the layout's [C, K]), or ``K, C`` with ``spec.transpose_kernel``.
:func:`~jax_blocksparse.bsconv`, its input gradient and
:func:`~jax_blocksparse.bsconv_transpose` are all ``bsconv`` with some spec; the three
are closed under JVP and transpose:

* ``bsconv``:       ct_a = bsconv(ct, w; dual(spec)),  ct_w = bsconv_wgrad(a, ct; spec)
* ``bsconv_wgrad``: ct_a = bsconv(b, ct; dual(spec)),  ct_b = bsconv(a, ct; spec)

Both operands are cast to the ``compute_dtype`` parameter for the products, which
accumulate in float32; ``w`` may stay float32 while ``a`` is 16-bit (``float32_dw``: the
weight's cotangent is then ``bsconv_wgrad``'s float32 accumulator).

Lowerings (the ``impl`` parameter, :mod:`jax_blocksparse.config`):

* everywhere: the reference, ``lax.conv_general_dilated`` on the dense kernel scattered
  from the blocks (also ``impl="dense"``);
* "cpu": the implicit-GEMM kernels of the native extension (``jbs_bsconv``,
  ``jbs_bsconv_wgrad``: cuda/cpu/bsconv_cpu.h), which read the NHWC input with the taps
  as offsets and make nothing of size taps x input; 1 to 3 spatial dims (more: the bsmm
  compositions below, on the CPU bsmm kernels);
* "cuda": the bsmm compositions of :mod:`jax_blocksparse.ops.conv_im2col` (im2col, or col2im
  for an input-dilated convolution without strides), whose bsmm products take the CUDA
  kernels; the weight gradient is the composition's linear transpose (one
  ``bsmm_updat`` over the tap-stacked layout).

The policy is bsmm's (:func:`~jax_blocksparse.ops._lowering.register_lowerings`), given
the convolution's kernel calls, its platforms and where the compositions run.

Batching: an extra batch axis of ``a`` alone (``bsconv``) folds into N; anything else
batched runs as a ``lax.map`` of the primitive over that axis. Under ``jit`` with
sharded inputs both primitives are split over N (:mod:`jax_blocksparse.ops._partitioning`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from jax.sharding import PartitionSpec as P

from jax_blocksparse import targets
from jax_blocksparse.layout import Layout, LayoutTables
from jax_blocksparse.ops._lowering import register_lowerings
from jax_blocksparse.ops._partitioning import mark_partitioned
from jax_blocksparse.ops.conv_im2col import Geometry, Precision, conv_col2im, conv_im2col, conv_to_dense
from jax_blocksparse.ops.conv_spec import ConvSpec, dimension_numbers, dual, output_spatial
from jax_blocksparse.ops.matmul import _matchvarying_axes

# Spatial dims the CPU kernels take (cuda/cpu/bsconv_cpu.h: kMaxConvDims).
MAX_KERNEL_DIMS = 3
CONV_TARGET = "jbs_bsconv"
WGRAD_TARGET = "jbs_bsconv_wgrad"

bsconv_p = Primitive("bsconv")
bsconv_wgrad_p = Primitive("bsconv_wgrad")

# ---------------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------------


def conv(a, w, tables, *, spec: ConvSpec, compute_dtype, out_dtype, impl: str, precision):
    """Binds ``bsconv``: a [N, *in, Cin], w [cap, *k, bs, bs] -> [N, *out, Cout] of ``out_dtype``."""
    return bsconv_p.bind(
        *mark_partitioned(_matchvarying_axes([a, w, *tables])),
        spec=spec,
        compute_dtype=np.dtype(compute_dtype),
        out_dtype=np.dtype(out_dtype),
        impl=impl,
        precision=precision,
    )


def wgrad(a, b, tables, *, spec: ConvSpec, kernel_size, block_size, compute_dtype, out_dtype, impl: str, precision):
    """Binds ``bsconv_wgrad``: a [N, *in, Cin], b [N, *out, Cout] -> [cap, *kernel_size, bs, bs] (bs = block_size)."""
    return bsconv_wgrad_p.bind(
        *mark_partitioned(_matchvarying_axes([a, b, *tables])),
        spec=spec,
        kernel_size=tuple(int(k) for k in kernel_size),
        block_size=int(block_size),
        compute_dtype=np.dtype(compute_dtype),
        out_dtype=np.dtype(out_dtype),
        impl=impl,
        precision=precision,
    )


def _grid(tables) -> tuple[int, int]:
    """(CB, KB) from the pointer tables' static lengths."""
    return tables[3].shape[-1] - 1, tables[2].shape[-1] - 1


def _channels(tables, block_size: int, transpose_kernel: bool) -> tuple[int, int]:
    """(Cin, Cout) of the convolution."""
    cb, kb = _grid(tables)
    cin, cout = (kb, cb) if transpose_kernel else (cb, kb)
    return cin * block_size, cout * block_size


# ---------------------------------------------------------------------------------
# Abstract evaluation
# ---------------------------------------------------------------------------------


def _batch_sharded(a, ndim: int):
    """a's sharding with only its batch dim (0) kept: the result of a split over N."""
    sharding = a.sharding
    spec = tuple(getattr(sharding, "spec", ()))
    if not (hasattr(sharding, "update") and spec):
        return sharding
    return sharding.update(spec=P(spec[0], *(None,) * (ndim - 1)))


def _conv_abstract_eval(a, w, *tables, spec, out_dtype, **_):
    bs = w.shape[-1]
    _, cout = _channels(tables, bs, spec.transpose_kernel)
    out_shape = (a.shape[0], *output_spatial(a.shape[1:-1], w.shape[1:-2], spec), cout)
    return a.update(shape=out_shape, dtype=out_dtype, weak_type=False, sharding=_batch_sharded(a, len(out_shape)))


def _wgrad_abstract_eval(a, b, *tables, kernel_size, block_size, out_dtype, **_):
    shape = (tables[0].shape[-1], *kernel_size, block_size, block_size)
    sharding = a.sharding
    if hasattr(sharding, "update") and tuple(getattr(sharding, "spec", ())):
        sharding = sharding.update(spec=P(*(None,) * len(shape)))
    return a.update(shape=shape, dtype=out_dtype, weak_type=False, sharding=sharding)


# ---------------------------------------------------------------------------------
# Lowerings: the reference (and dense) everywhere
# ---------------------------------------------------------------------------------


def _layout(tables, block_size: int) -> Layout:
    tables = LayoutTables(*tables)
    return Layout(block_size, _grid(tables), tables.block_rows.shape[-1], tables)


def _dense_kernel(w, tables, spec: ConvSpec):
    """The dense kernel [*k, Cin, Cout] the convolution applies (flipped, channels swapped
    with ``transpose_kernel``)."""
    W = conv_to_dense(w, _layout(tables, w.shape[-1]))
    if spec.transpose_kernel:
        W = jnp.flip(W, axis=tuple(range(spec.ndim))).swapaxes(-1, -2)
    return W


def conv_reference(a, w, *tables, spec, compute_dtype, out_dtype, precision=None, **_):
    """``lax.conv_general_dilated`` of a and the dense kernel, float32 accumulation."""
    y = lax.conv_general_dilated(
        a.astype(compute_dtype),
        _dense_kernel(w, tables, spec).astype(compute_dtype),
        spec.strides,
        spec.padding,
        lhs_dilation=spec.lhs_dilation,
        rhs_dilation=spec.rhs_dilation,
        dimension_numbers=dimension_numbers(a.ndim),
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)


def _wgrad_by_transpose(conv_fun, a, b, tables, spec, kernel_size, block_size, out_dtype):
    """The weight gradient as the linear transpose in w of ``conv_fun(a, w)`` at ``b``."""
    w_shape = (tables[0].shape[-1], *kernel_size, block_size, block_size)
    w_aval = jax.ShapeDtypeStruct(w_shape, jnp.float32)
    (dw,) = jax.linear_transpose(lambda w: conv_fun(a, w), w_aval)(b.astype(jnp.float32))
    return dw.astype(out_dtype)


def wgrad_reference(a, b, *tables, spec, kernel_size, block_size, compute_dtype, out_dtype, precision=None, **_):
    """The transpose in w of :func:`conv_reference` (operands rounded to ``compute_dtype``,
    then the products in float32)."""
    a = a.astype(compute_dtype).astype(jnp.float32)
    b = b.astype(compute_dtype).astype(jnp.float32)

    def conv_fun(a, w):
        return conv_reference(
            a, w, *tables, spec=spec, compute_dtype=jnp.float32, out_dtype=jnp.float32, precision=precision
        )

    return _wgrad_by_transpose(conv_fun, a, b, tables, spec, kernel_size, block_size, out_dtype)


# ---------------------------------------------------------------------------------
# Lowerings: the bsmm compositions on "cuda"
# ---------------------------------------------------------------------------------


def _composition(spec: ConvSpec):
    """The bsmm composition of ops/conv_im2col.py for ``spec``: a function of (a, w, layout, g, prec)."""
    strided = any(s != 1 for s in spec.strides)
    dilated = any(d != 1 for d in spec.lhs_dilation)
    # Input dilation without strides: col2im skips the dilation's zeros.
    body = conv_col2im if dilated and not strided else conv_im2col
    return functools.partial(body, transpose_kernel=spec.transpose_kernel)


def _composed_conv(a, w, tables, spec, compute_dtype, out_dtype, precision, impl):
    kernel_size = tuple(w.shape[1:-2])
    layout = _layout(tables, w.shape[-1])
    g = Geometry(
        kernel_size,
        spec.strides,
        spec.padding,
        spec.lhs_dilation,
        spec.rhs_dilation,
        output_spatial(a.shape[1:-1], kernel_size, spec),
    )
    prec = Precision(np.dtype(compute_dtype), np.dtype(out_dtype), False, precision, impl)
    return _composition(spec)(a.astype(compute_dtype), w.astype(compute_dtype), layout, g, prec)


def conv_composed(a, w, *tables, spec, compute_dtype, out_dtype, impl, precision=None, **params):
    return _composed_conv(a, w, tables, spec, compute_dtype, out_dtype, precision, impl)


def wgrad_composed(a, b, *tables, spec, kernel_size, block_size, compute_dtype, out_dtype, impl, precision=None, **_):
    a = a.astype(compute_dtype)

    def conv_fun(a, w):
        # float32 products of compute_dtype operands: dw is the float32 accumulator.
        return _composed_conv(a, w, tables, spec, compute_dtype, jnp.float32, precision, impl)

    w_shape = (tables[0].shape[-1], *kernel_size, block_size, block_size)
    (dw,) = jax.linear_transpose(lambda w: conv_fun(a, w), jax.ShapeDtypeStruct(w_shape, compute_dtype))(
        b.astype(jnp.float32)
    )
    return dw.astype(out_dtype)


# ---------------------------------------------------------------------------------
# Lowerings: the native CPU kernels
# ---------------------------------------------------------------------------------


def _kernel_dtype(in_dtype, out_dtype):
    """What the handler writes: the input dtype or float32 (any other is a cast of that)."""
    out_dtype, in_dtype = np.dtype(out_dtype), np.dtype(in_dtype)
    return out_dtype if out_dtype in (in_dtype, np.dtype(np.float32)) else np.dtype(np.float32)


def _geometry_attrs(spec: ConvSpec) -> dict:
    def dims(values):
        return np.asarray(values, np.int64)

    return dict(
        window_strides=dims(spec.strides),
        lhs_dilation=dims(spec.lhs_dilation),
        rhs_dilation=dims(spec.rhs_dilation),
        padding_low=dims([lo for lo, _ in spec.padding]),
        transpose_kernel=np.bool_(spec.transpose_kernel),
    )


def conv_kernel(a, w, *tables, spec, compute_dtype, out_dtype, **_):
    """The ``jbs_bsconv`` custom call (operands and attributes: cuda/cpu/bsconv_cpu_handlers.cc)."""
    t = LayoutTables(*tables)
    a, w = a.astype(compute_dtype), w.astype(compute_dtype)
    _, cout = _channels(tables, w.shape[-1], spec.transpose_kernel)
    shape = (a.shape[0], *output_spatial(a.shape[1:-1], w.shape[1:-2], spec), cout)
    order = t.row_order if spec.transpose_kernel else t.col_order
    result = jax.ShapeDtypeStruct(shape, _kernel_dtype(compute_dtype, out_dtype))
    call = jax.ffi.ffi_call(targets.target_name(CONV_TARGET), result)
    return call(a, w, *t[:5], order, **_geometry_attrs(spec)).astype(out_dtype)


def wgrad_kernel(a, b, *tables, spec, kernel_size, block_size, compute_dtype, out_dtype, **_):
    """The ``jbs_bsconv_wgrad`` custom call."""
    t = LayoutTables(*tables)
    a, b = a.astype(compute_dtype), b.astype(compute_dtype)
    shape = (t.block_rows.shape[-1], *kernel_size, block_size, block_size)
    result = jax.ShapeDtypeStruct(shape, _kernel_dtype(compute_dtype, out_dtype))
    call = jax.ffi.ffi_call(targets.target_name(WGRAD_TARGET), result)
    return call(a, b, *t[:5], **_geometry_attrs(spec)).astype(out_dtype)


def _composed_where(composed):
    """The ``composed`` hook of :func:`~jax_blocksparse.ops._lowering.register_lowerings`:
    the bsmm composition on "cuda" (no convolution kernels there) and on "cpu" beyond the
    kernels' :data:`MAX_KERNEL_DIMS` spatial dims; elsewhere None (the op's own path)."""

    def where(platform: str, params: dict):
        if platform == "cuda" or params["spec"].ndim > MAX_KERNEL_DIMS:
            return composed
        return None

    return where


# ---------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------


def _mapped(prim, args, dims, params):
    """The primitive over a batch axis with ``lax.map`` (any operands batched)."""
    batched = [i for i, d in enumerate(dims) if d is not None]
    moved = tuple(jnp.moveaxis(args[i], dims[i], 0) for i in batched)

    def one(slices):
        operands = list(args)
        for i, s in zip(batched, slices):
            operands[i] = s
        return prim.bind(*operands, **params)

    return lax.map(one, moved), 0


def _conv_batch(args, dims, **params):
    a, *rest = args
    a_dim, *rest_dims = dims
    if any(d is not None for d in rest_dims):
        return _mapped(bsconv_p, args, dims, params)
    a = jnp.moveaxis(a, a_dim, 0)
    nb, n = a.shape[:2]
    out = bsconv_p.bind(a.reshape(nb * n, *a.shape[2:]), *rest, **params)
    return out.reshape(nb, n, *out.shape[1:]), 0


def _wgrad_batch(args, dims, **params):
    return _mapped(bsconv_wgrad_p, args, dims, params)


# ---------------------------------------------------------------------------------
# JVP: both primitives are bilinear in their two float operands
# ---------------------------------------------------------------------------------


def _jvp(prim):
    def rule(primals, tangents, **params):
        a, b, *tables = primals
        ta, tb = tangents[:2]
        out = prim.bind(a, b, *tables, **params)
        terms = []
        if type(ta) is not ad.Zero:
            terms.append(prim.bind(ta, b, *tables, **params))
        if type(tb) is not ad.Zero:
            terms.append(prim.bind(a, tb, *tables, **params))
        if not terms:
            return out, ad.Zero.from_primal_value(out)
        return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]

    return rule


# ---------------------------------------------------------------------------------
# Transpose
# ---------------------------------------------------------------------------------


def _aval(x):
    return x.aval if ad.is_undefined_primal(x) else jax.typeof(x)


def _common(params, ct):
    """The products of a cotangent run at the forward's compute dtype, or wider for a wider
    cotangent (as bsmm's do)."""
    return np.dtype(jnp.promote_types(params["compute_dtype"], ct.dtype))


def _conv_transpose(ct, a, w, *tables, spec, compute_dtype, out_dtype, impl, precision):
    if any(ad.is_undefined_primal(t) for t in tables):
        raise ValueError("bsconv: the layout tables are not differentiable")
    nones = [None] * len(tables)
    if type(ct) is ad.Zero:
        return [None, None, *nones]
    params = dict(compute_dtype=compute_dtype, impl=impl, precision=precision)
    common = _common(params, ct)
    a_aval, w_aval = _aval(a), _aval(w)
    kernel_size = tuple(w_aval.shape[1:-2])
    ct_a = ct_w = None
    if ad.is_undefined_primal(a):
        back = dual(spec, a_aval.shape[1:-1], kernel_size)
        ct_a = conv(ct, w, tables, spec=back, **dict(params, compute_dtype=common), out_dtype=a_aval.dtype)
    if ad.is_undefined_primal(w):
        ct_w = wgrad(
            a,
            ct,
            tables,
            spec=spec,
            kernel_size=kernel_size,
            block_size=w_aval.shape[-1],
            **dict(params, compute_dtype=common),
            out_dtype=w_aval.dtype,
        )
    return [ct_a, ct_w, *nones]


def _wgrad_transpose(ct, a, b, *tables, spec, kernel_size, block_size, compute_dtype, out_dtype, impl, precision):
    if any(ad.is_undefined_primal(t) for t in tables):
        raise ValueError("bsconv_wgrad: the layout tables are not differentiable")
    nones = [None] * len(tables)
    if type(ct) is ad.Zero:
        return [None, None, *nones]
    params = dict(compute_dtype=compute_dtype, impl=impl, precision=precision)
    a_aval, b_aval = _aval(a), _aval(b)
    ct_a = ct_b = None
    if ad.is_undefined_primal(a):
        back = dual(spec, a_aval.shape[1:-1], kernel_size)
        ct_a = conv(b, ct, tables, spec=back, **params, out_dtype=a_aval.dtype)
    if ad.is_undefined_primal(b):
        ct_b = conv(a, ct, tables, spec=spec, **params, out_dtype=b_aval.dtype)
    return [ct_a, ct_b, *nones]


# ---------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------


@functools.cache
def _jitted_bind(prim, params: tuple):
    return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _eager_impl(prim):
    # Eager calls run the same lowering as jit (one compile per shape and params).
    return lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args)


def _register(prim, abstract_eval, reference, kernel, composed, target: str, batch, transpose) -> None:
    """Every rule of one convolution primitive. Its lowering policy is bsmm's; the reference
    is its dense path too (lax.conv_general_dilated on the dense kernel)."""
    prim.def_impl(_eager_impl(prim))
    prim.def_abstract_eval(abstract_eval)
    register_lowerings(
        prim,
        reference,
        target=target,
        dense=reference,
        kernel=kernel,
        target_platforms=("cpu",),
        composed=_composed_where(composed),
    )
    batching.primitive_batchers[prim] = batch
    ad.primitive_jvps[prim] = _jvp(prim)
    ad.primitive_transposes[prim] = transpose


_register(
    bsconv_p, _conv_abstract_eval, conv_reference, conv_kernel, conv_composed, CONV_TARGET, _conv_batch, _conv_transpose
)
_register(
    bsconv_wgrad_p,
    _wgrad_abstract_eval,
    wgrad_reference,
    wgrad_kernel,
    wgrad_composed,
    WGRAD_TARGET,
    _wgrad_batch,
    _wgrad_transpose,
)

__all__ = ["bsconv_p", "bsconv_wgrad_p", "conv", "wgrad", "conv_reference", "wgrad_reference"]
