"""bsmm: dense activations times a block-sparse weight, and its two partners.

For y = x @ W with x [N, C] and W block-sparse [C, K] (stored as w [capacity, bs, bs]
with a :class:`~jax_blocksparse.Layout`):

======  =====================================  ==================================
prim    computes                               shapes
======  =====================================  ==================================
fprop   y  = x @ W                             x [..., C], w -> y [..., K]
bprop   dx = g @ W.T                           g [..., K], w -> dx [..., C]
updat   dW = x.T @ dy, only at layout blocks   x [..., C], dy [..., K] -> [cap, bs, bs]
======  =====================================  ==================================

All three are bilinear, and each one's transposes are the other two, so their JVP
and transpose rules close over this set: grad, jvp, jacfwd, hessian and
linear_transpose need nothing else. Products accumulate in float32; the output
dtype is the ``out_dtype`` parameter.

Mixed precision and float32 weight gradients
--------------------------------------------
``bsmm(x, w, layout, compute_dtype=jnp.bfloat16)`` multiplies in bfloat16 (float32
accumulation) whatever the dtypes of x and w. Autodiff of that cast-then-multiply
rounds the weight gradient to bfloat16 (the transpose of fprop gives the cotangent of
its bfloat16 weight operand) before the cast's transpose widens it back. With
``float32_dw=True`` and a float32 ``w`` the gradient is instead the float32
accumulator itself: ``bsmm_updat(x16, dy16, out_dtype=float32)``. How, with every
primitive still bound with two operands of one dtype:

* a ``jax.custom_jvp`` (:func:`_f32_dw_product`) keeps the primal product in 16 bits
  and writes the tangent with respect to w as ``prim(x16 widened to f32, tw, lhs_dtype=
  bf16)``: a float32 bind, so its transpose returns a float32 cotangent for w;
* the primitives' ``lhs_dtype`` parameter records that their lhs holds widened 16-bit
  values. When the output dtype is that same 16-bit dtype (so the incoming cotangent
  is 16-bit too), the transpose for the weight narrows both operands back losslessly
  and binds ``bsmm_updat`` with 16-bit operands and ``out_dtype=float32``: the native
  kernels' own form. Only transpose rules read ``lhs_dtype``; the lowerings ignore it.

Under ``jax.grad`` every bind is then 16-bit x 16-bit (fprop, bprop: 16-bit out;
updat: float32 out). Under ``jax.jvp`` the weight tangent's product runs in float32.
The same holds under ``vmap`` and ``jit`` (custom_jvp and the batching rule keep the
parameter).

Precision
---------
``precision=`` means what it means for :func:`jax.lax.dot_general`. It is resolved when
the op is traced (None reads :func:`jax.default_matmul_precision`) and kept as the
primitives' ``precision`` parameter, which the JVP, transpose and batching rules pass
on, so a gradient's products run at the forward's precision. The reference lowering
gives it to XLA's dot: on GPU, float32 at DEFAULT may use TF32 tensor cores, as
``jnp.dot`` does, and HIGHEST is exact float32. The CPU and Ampere CUDA kernels compute
float32 exactly at every precision (DEFAULT allows TF32; it does not require it). The
Hopper kernels (behind ``JAX_BLOCKSPARSE_HOPPER=1``, see :mod:`jax_blocksparse.ops._sm90`)
run float32 at DEFAULT and HIGH on TF32 tensor cores, as ``jnp.dot`` does there, and
exactly at HIGHEST; at block size 8, :func:`bsmm` (fprop, and its transpose, bprop) runs
float32 exactly at every precision: its TF32 kernel is off until it has run clean on a
GPU (``python -m jax_blocksparse`` prints where TF32 is off and why), while
:func:`bsmm_updat` keeps TF32 there.

Implementation
--------------
``impl=`` chooses the lowering of one call: ``"auto"``, ``"reference"``, ``"kernels"``
or ``"dense"`` (:mod:`jax_blocksparse.config`). ``"dense"`` scatters the present blocks
into a dense weight and uses XLA's dot; ``"auto"`` does that too where the native
kernel is slower than it at the layout's block capacity on this device
(:mod:`jax_blocksparse.crossover`). Like ``precision=`` it is resolved when the op is
traced (None reads :func:`jax_blocksparse.config.get_implementation`) and kept as the
primitives' ``impl`` parameter, which the JVP, transpose and batching rules pass on:
the gradient, JVP and vmap of a call lower the way the call does.

Order of this module: public functions, shape rules, references, primitives and
abstract eval, lowerings, batching, JVP, transpose, registration.
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from jax.sharding import PartitionSpec as P

from jax_blocksparse import _native, config, targets
from jax_blocksparse.layout import Layout, LayoutTables, check_layout
from jax_blocksparse.ops._checks import (
    as_float_array,
    canonical_precision,
    check_float32_dw,
    compute_dtype_of,
    out_dtype_of,
    pvary,
    varying_axes,
)
from jax_blocksparse.ops._lowering import register_lowerings
from jax_blocksparse.ops._partitioning import mark_partitioned

# ---------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------


def bsmm(
    x,
    w,
    layout: Layout,
    *,
    transpose: bool = False,
    preferred_element_type=None,
    compute_dtype=None,
    float32_dw: bool = False,
    precision=None,
    impl: str | None = None,
):
    """Block-sparse matmul: ``x @ to_dense(w, layout)`` (or ``@ ...T``), blocks only.

    Args:
      x: [..., C] (or [..., K] with ``transpose=True``), float32/bfloat16/float16.
      w: [capacity, bs, bs], the stored blocks (``layout.w_shape``).
      layout: the :class:`Layout` of ``w``; W is [C, K] = ``layout.shape``.
      transpose: multiply by W.T instead of W.
      preferred_element_type: output dtype; default ``compute_dtype`` if given, else
        the promoted dtype of x and w.
      compute_dtype: the dtype both operands are cast to for the product (e.g.
        bfloat16 with float32 ``w``); default the promoted dtype of x and w.
      float32_dw: keep the gradient with respect to ``w`` in float32: computed from
        the float32 accumulator of ``bsmm_updat(x, dy, out_dtype=float32)`` instead of
        being rounded to ``compute_dtype`` and widened (see the module docstring).
        Needs a float32 ``w``; no effect when ``compute_dtype`` is float32.
      precision: as in :func:`jax.lax.dot_general`: None, a
        :class:`jax.lax.Precision` (or its name), or a pair of them (the higher one
        applies). None reads :func:`jax.default_matmul_precision`, as ``jnp.dot``
        does. It matters for float32 products on GPU only: at ``DEFAULT`` they may
        run on TF32 tensor cores, as ``jnp.dot`` does; ``HIGHEST`` is exact float32
        (see "Precision" in the module docstring). The gradient's products keep it.
      impl: the implementation of this call: ``"auto"`` (the native kernels where
        built, verified and faster than the dense product at this layout's capacity,
        the dense product where they are slower, else the reference), ``"reference"``
        (pure JAX), ``"kernels"`` (the native kernels, an error at lowering if not
        built) or ``"dense"`` (the blocks scattered into a dense weight, XLA's dot). None
        reads :func:`jax_blocksparse.config.get_implementation` at trace time (the
        :func:`~jax_blocksparse.config.implementation` context, else the environment
        variable ``JAX_BLOCKSPARSE_IMPL``, else "auto"). The gradient's, JVP's and
        vmap's products keep it.

    Returns:
      [..., K] (or [..., C] with ``transpose=True``). Products are accumulated in
      float32 whatever the input dtype.

    Example::

        layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5), block_size=16)
        w = jnp.ones(layout.w_shape)
        y = jbs.bsmm(jnp.ones((8, 64)), w, layout)    # [8, 64]
    """
    layout = check_layout(layout)
    x = as_float_array(x, "x")
    w = as_float_array(w, "w")
    _check_w(w, layout)
    c, k = layout.shape
    expected, name = (k, "K") if transpose else (c, "C")
    if x.ndim < 1 or x.shape[-1] != expected:
        raise ValueError(
            f"bsmm: x must have shape [..., {name}={expected}] for a layout of shape "
            f"{layout.shape}{' (transpose=True)' if transpose else ''}, got x {x.shape}"
        )
    compute = compute_dtype_of(compute_dtype, x.dtype, w.dtype)
    out_dtype = out_dtype_of(preferred_element_type, compute, name="preferred_element_type")
    prim = bsmm_bprop_p if transpose else bsmm_fprop_p
    params = _params(layout, out_dtype, precision, impl)
    if check_float32_dw("bsmm", float32_dw, w, compute):
        return _f32_dw_product((prim, compute, tuple(sorted(params.items()))), x, w, layout.tables)
    return _bind(prim, x.astype(compute), w.astype(compute), layout.tables, **params)


def bsmm_updat(x, dy, layout: Layout, *, out_dtype=None, precision=None, impl: str | None = None):
    """The weight gradient of bsmm at the layout's blocks only (SDDMM).

    ``bsmm_updat(x, dy, layout) == from_dense(x.T @ dy, layout)`` with all leading
    dims of x and dy contracted.

    Args:
      x: [..., C] float; dy: [..., K] float with the same leading dims.
      layout: the :class:`Layout`.
      out_dtype: dtype of the result (e.g. float32 from bfloat16 inputs); default
        the promoted dtype of x and dy.
      precision: as in :func:`bsmm` (and :func:`jax.lax.dot_general`).
      impl: ``"auto"``, ``"reference"``, ``"kernels"``, ``"dense"`` or None (the default read at
        trace time), as in :func:`bsmm`.

    Returns:
      [capacity, bs, bs]; padding slots are zero.
    """
    layout = check_layout(layout)
    x = as_float_array(x, "x")
    dy = as_float_array(dy, "dy")
    c, k = layout.shape
    if x.ndim < 1 or dy.ndim < 1 or x.shape[-1] != c or dy.shape[-1] != k or x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(
            f"bsmm_updat: need x [..., C={c}] and dy [..., K={k}] with equal leading dims "
            f"for a layout of shape {layout.shape}, got x {x.shape} and dy {dy.shape}"
        )
    out_dtype = out_dtype_of(out_dtype, x.dtype, dy.dtype, name="out_dtype")
    return _bind(bsmm_updat_p, x, dy, layout.tables, **_params(layout, out_dtype, precision, impl))


def from_dense(W, layout: Layout):
    """Gathers the layout's blocks out of a dense weight.

    Args:
      W: [C, K] = ``layout.shape``.
    Returns:
      [capacity, bs, bs] in storage order; padding slots are zero.
    """
    layout = check_layout(layout)
    W = jnp.asarray(W)
    if W.shape != layout.shape:
        raise ValueError(f"from_dense: W must have shape {layout.shape} (layout.shape), got {W.shape}")
    return _gather_blocks(W, layout.tables, layout.block_size)


def to_dense(w, layout: Layout):
    """Scatters stored blocks into a dense [C, K] weight, zero outside the layout.

    Args:
      w: [capacity, bs, bs] = ``layout.w_shape``; padding slots are ignored.
    Returns:
      [C, K] = ``layout.shape``, dtype of ``w``.
    """
    layout = check_layout(layout)
    w = jnp.asarray(w)
    _check_w(w, layout)
    return _scatter_blocks(w, layout.tables, layout.block_size)


def _gather_blocks(W, tables: LayoutTables, block_size: int):
    """[C, K] -> [capacity, bs, bs]: the blocks at the tables' slots, zero at padding."""
    t, bs, (cb, kb) = tables, block_size, _grid_of(tables)
    blocks = W.reshape(cb, bs, kb, bs).transpose(0, 2, 1, 3)
    w = blocks.at[t.block_rows, t.block_cols].get(mode="fill", fill_value=0)
    return jnp.where(_valid(t)[:, None, None], w, jnp.zeros((), W.dtype))


def _scatter_blocks(w, tables: LayoutTables, block_size: int):
    """[capacity, bs, bs] -> [C, K]: the blocks at the tables' slots, zero elsewhere."""
    t, bs, (cb, kb) = tables, block_size, _grid_of(tables)
    capacity = t.block_rows.shape[0]
    # Padding slot s -> row cb + s: out of range, so dropped, and distinct from every other
    # index, so the scatter is unique and hence transposable (linear_transpose, from_dense).
    rows = jnp.where(_valid(t), t.block_rows, cb + jnp.arange(capacity, dtype=t.block_rows.dtype))
    blocks = jnp.zeros((cb, kb, bs, bs), w.dtype).at[rows, t.block_cols].set(w, mode="drop", unique_indices=True)
    return blocks.transpose(0, 2, 1, 3).reshape(cb * bs, kb * bs)


def bsmm_reference(
    x, w, layout: Layout, *, transpose: bool = False, preferred_element_type=None, compute_dtype=None, precision=None
):
    """The definition of :func:`bsmm` as a dense product (for tests and debugging)."""
    x = jnp.asarray(x)
    W = to_dense(w, layout)
    compute = compute_dtype_of(compute_dtype, x.dtype, W.dtype)
    out_dtype = out_dtype_of(preferred_element_type, compute, name="preferred_element_type")
    if transpose:
        W = W.T
    product = jnp.matmul(
        x.astype(compute),
        W.astype(compute),
        precision=canonical_precision(precision),
        preferred_element_type=jnp.float32,
    )
    return product.astype(out_dtype)


# ---------------------------------------------------------------------------------
# Shape and dtype rules
# ---------------------------------------------------------------------------------


def _check_w(w, layout: Layout):
    if w.shape != layout.w_shape:
        raise ValueError(f"w must have shape [capacity, bs, bs] = {layout.w_shape} for {layout}, got {tuple(w.shape)}")


def _params(layout: Layout, out_dtype, precision, impl) -> dict:
    """The parameters a public function binds its primitive with (``impl`` and
    ``precision`` resolved now, at trace time)."""
    return dict(
        block_size=layout.block_size,
        out_dtype=np.dtype(out_dtype),
        impl=config.canonical_impl(impl),
        precision=canonical_precision(precision),
    )


def _grid_of(tables: LayoutTables):
    return (tables.row_ptr.shape[-1] - 1, tables.col_ptr.shape[-1] - 1)


def _operand_shapes(prim_name, a, b, tables, block_size):
    """Shape rule shared by the three primitives: returns the output shape."""
    cb, kb = _grid_of(tables)
    capacity = tables.block_rows.shape[-1]
    c, k = cb * block_size, kb * block_size
    w_shape = (capacity, block_size, block_size)
    if prim_name == "bsmm_updat":
        if a.shape[-1:] != (c,) or b.shape[-1:] != (k,) or a.shape[:-1] != b.shape[:-1]:
            raise ValueError(f"{prim_name}: need x [..., {c}] and dy [..., {k}], got {a.shape} and {b.shape}")
        return w_shape
    in_features, out_features = (c, k) if prim_name == "bsmm_fprop" else (k, c)
    if tuple(b.shape) != w_shape:
        raise ValueError(f"{prim_name}: w must have shape {w_shape}, got {b.shape}")
    if a.shape[-1:] != (in_features,):
        raise ValueError(f"{prim_name}: lhs must have shape [..., {in_features}], got {a.shape}")
    return tuple(a.shape[:-1]) + (out_features,)


# ---------------------------------------------------------------------------------
# References (the definition of each primitive, and its default lowering)
# ---------------------------------------------------------------------------------
# Blocks are processed in up to `parts` independent chunks of slots: XLA:CPU runs a
# batched dot of small matrices on one thread, but runs independent chunks in parallel.


def _chunks(capacity: int, parts: int):
    parts = max(1, min(parts, capacity // 64))
    bounds = [capacity * i // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _valid(tables: LayoutTables):
    return jnp.arange(tables.block_rows.shape[0]) < tables.col_ptr[-1]


def _fprop_like(lhs, w, gather_idx, scatter_idx, num_in, num_out, block_size, out_dtype, transpose_w, parts, precision):
    """sum over slots s: lhs[:, gather_idx[s]] @ w[s] (or w[s].T) into block scatter_idx[s]."""
    lead = lhs.shape[:-1]
    n = math.prod(lead)
    lhs_blocks = lhs.reshape(n, num_in, block_size).transpose(1, 0, 2)  # [num_in, n, bs]
    spec = "snb,skb->snk" if transpose_w else "snb,sbk->snk"
    out = jnp.zeros((num_out, n, block_size), jnp.float32)
    for lo, hi in _chunks(w.shape[0], parts):
        prod = jnp.einsum(
            spec, lhs_blocks[gather_idx[lo:hi]], w[lo:hi], precision=precision, preferred_element_type=jnp.float32
        )
        out = out + jax.ops.segment_sum(prod, scatter_idx[lo:hi], num_segments=num_out)
    return out.transpose(1, 0, 2).reshape(*lead, num_out * block_size).astype(out_dtype)


def bsmm_fprop_reference(x, w, *tables, block_size, out_dtype, impl="auto", lhs_dtype=None, precision=None, parts=1):
    """y[..., k] = sum over slots s in column k of x[..., rows[s]] @ w[s]."""
    t = LayoutTables(*tables)
    cb, kb = _grid_of(t)
    cols = jnp.where(_valid(t), t.block_cols, kb)  # padding -> dropped by segment_sum
    return _fprop_like(x, w, t.block_rows, cols, cb, kb, block_size, out_dtype, False, parts, precision)


def bsmm_bprop_reference(g, w, *tables, block_size, out_dtype, impl="auto", lhs_dtype=None, precision=None, parts=1):
    """dx[..., c] = sum over slots s in row c of g[..., cols[s]] @ w[s].T."""
    t = LayoutTables(*tables)
    cb, kb = _grid_of(t)
    rows = jnp.where(_valid(t), t.block_rows, cb)
    return _fprop_like(g, w, t.block_cols, rows, kb, cb, block_size, out_dtype, True, parts, precision)


def bsmm_updat_reference(x, dy, *tables, block_size, out_dtype, impl="auto", lhs_dtype=None, precision=None, parts=1):
    """dw[s] = x[..., rows[s]].T @ dy[..., cols[s]] over all leading dims; 0 at padding."""
    t = LayoutTables(*tables)
    cb, kb = _grid_of(t)
    n = math.prod(x.shape[:-1])
    x_blocks = x.reshape(n, cb, block_size).transpose(1, 0, 2)
    dy_blocks = dy.reshape(n, kb, block_size).transpose(1, 0, 2)
    pieces = [
        jnp.einsum(
            "snb,snk->sbk",
            x_blocks[t.block_rows[lo:hi]],
            dy_blocks[t.block_cols[lo:hi]],
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        for lo, hi in _chunks(t.block_rows.shape[0], parts)
    ]
    capacity = t.block_rows.shape[0]
    dw = jnp.concatenate(pieces) if pieces else jnp.zeros((capacity, block_size, block_size), jnp.float32)
    return jnp.where(_valid(t)[:, None, None], dw, 0).astype(out_dtype)


# ---------------------------------------------------------------------------------
# Dense products (impl="dense", and "auto" above the crossover density)
# ---------------------------------------------------------------------------------
# The present blocks scattered into a dense weight (or, for updat, the dense x^T dy
# gathered at the blocks) and XLA's dot: the same values at dense cost, which beats a
# kernel wherever the layout is dense enough (jax_blocksparse/crossover.py).


def _dense_dot(a, b, precision, out_dtype):
    return jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32).astype(out_dtype)


def bsmm_fprop_dense(x, w, *tables, block_size, out_dtype, precision=None, **_):
    """y = x @ W with W the dense [C, K] scattered from w."""
    return _dense_dot(x, _scatter_blocks(w, LayoutTables(*tables), block_size), precision, out_dtype)


def bsmm_bprop_dense(g, w, *tables, block_size, out_dtype, precision=None, **_):
    """dx = g @ W.T with W the dense [C, K] scattered from w."""
    return _dense_dot(g, _scatter_blocks(w, LayoutTables(*tables), block_size).T, precision, out_dtype)


def bsmm_updat_dense(x, dy, *tables, block_size, out_dtype, precision=None, **_):
    """dw = the layout's blocks of x.T @ dy (all leading dims contracted); 0 at padding."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dW = jnp.matmul(x2.T, dy2, precision=precision, preferred_element_type=jnp.float32)
    return _gather_blocks(dW, LayoutTables(*tables), block_size).astype(out_dtype)


# The same on CPU, with the conversions between blocks and the dense matrix done by the
# extension (cuda/cpu/bsmm_cpu_dense.cc: a row copy per block, one pass over W) instead of
# XLA's scatter and gather of [bs, bs] slices, which cost 10-50% of the dot there; and
# updat's x^T made row-major by it (XLA's dot of x.T runs slower, below).


def _to_dense_native(w, tables, block_size, *, transpose: bool = False):
    """W [C, K] from the blocks, or W^T [K, C] with ``transpose``."""
    cb, kb = _grid_of(LayoutTables(*tables))
    rows, cols = (kb, cb) if transpose else (cb, kb)
    out = jax.ShapeDtypeStruct((rows * block_size, cols * block_size), w.dtype)
    return jax.ffi.ffi_call(targets.target_name("jbs_blocks_to_dense"), out)(w, *tables[:5], transpose=transpose)


def _to_blocks_native(W, tables, block_size):
    out = jax.ShapeDtypeStruct((tables[0].shape[0], block_size, block_size), W.dtype)
    return jax.ffi.ffi_call(targets.target_name("jbs_dense_to_blocks"), out)(W, *tables[:5])


def _transpose_native(a):
    """``a.T`` [C, R] of a 2-D ``a`` [R, C], written row-major by the CPU extension."""
    return jax.ffi.ffi_call(targets.target_name("jbs_transpose"), jax.ShapeDtypeStruct(a.shape[::-1], a.dtype))(a)


def bsmm_fprop_dense_cpu(x, w, *tables, block_size, out_dtype, precision=None, **_):
    """:func:`bsmm_fprop_dense`, the dense W built by the CPU extension."""
    return _dense_dot(x, _to_dense_native(w, tables, block_size), precision, out_dtype)


def _xla_runs_bf16_dots_natively() -> bool:
    """Whether this CPU has bfloat16 dot instructions (the extension's detected instruction
    set: AMX tiles, or AVX512-BF16): there XLA runs a bfloat16 dot with float32 sums on
    them where both operands are row-major, and as a float32 dot otherwise."""
    return _native.extension_info().get("cpu_isa_detected") in ("amx", "avx512_bf16")


def bsmm_bprop_dense_cpu(g, w, *tables, block_size, out_dtype, precision=None, **_):
    """:func:`bsmm_bprop_dense`, the dense W built by the CPU extension. In bfloat16 on a
    CPU with bfloat16 dot instructions it is built as W^T, row-major: XLA runs ``g @ W.T``
    of a row-major W as a float32 dot, the same product with W^T ready on the bfloat16 dot
    instructions. At 1024 cubed on 2 cores: AMX, 8.9-11.8 ms against 2.2-3.7 ms with the
    conversion (0.25-0.75 ms transposed against 0.13-0.21 ms as W); AVX512-BF16 (AMD
    EPYC), 5.5-5.7 ms against 2.7-2.9 ms. Elsewhere it is built as W, the cheaper copy (in
    float32 and float16 both forms of the dot ran alike, or W ahead by 4-5%)."""
    if w.dtype == jnp.bfloat16 and _xla_runs_bf16_dots_natively():
        return _dense_dot(g, _to_dense_native(w, tables, block_size, transpose=True), precision, out_dtype)
    return _dense_dot(g, _to_dense_native(w, tables, block_size).T, precision, out_dtype)


def bsmm_updat_dense_cpu(x, dy, *tables, block_size, out_dtype, precision=None, **_):
    """:func:`bsmm_updat_dense`, the blocks gathered by the CPU extension and x^T made
    row-major by it first: XLA runs ``x.T @ dy`` slower than the same dot with x^T ready,
    which in bfloat16 runs on the CPU's bfloat16 dot instructions where it has them. At
    1024 cubed on 2 cores (AMD EPYC, AVX512-BF16), the dot with the transpose against
    ``x.T @ dy``: bfloat16 2.2 + 0.09 ms against 5.6 ms, float32 4.2-4.5 + 0.2 ms against
    5.4 ms, float16 4.5 + 0.1 ms against 5.5 ms (jax 0.8.1 and 0.10.2 alike)."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    dW = jnp.matmul(_transpose_native(x2), dy2, precision=precision, preferred_element_type=jnp.float32)
    return _to_blocks_native(dW, tables, block_size).astype(out_dtype)


# ---------------------------------------------------------------------------------
# Primitives and abstract evaluation
# ---------------------------------------------------------------------------------

bsmm_fprop_p = Primitive("bsmm_fprop")
bsmm_bprop_p = Primitive("bsmm_bprop")
bsmm_updat_p = Primitive("bsmm_updat")
_PRIMITIVES = (bsmm_fprop_p, bsmm_bprop_p, bsmm_updat_p)


def _matchvarying_axes(operands):
    """Under shard_map, marks every operand varying over the union of their mesh axes.

    A replicated weight used with a batch-sharded x becomes device-varying before the
    product, as jax does for its own primitives: then the weight's cotangent is
    summed over the mesh axes by the transpose of that cast, and every aval matches.
    """
    vmas = [varying_axes(jax.typeof(o)) for o in operands]
    union = frozenset().union(*vmas)
    if not union:
        return list(operands)
    return [o if v == union else pvary(o, tuple(sorted(union - v))) for o, v in zip(operands, vmas)]


def _bind(prim, a, b, tables, *, block_size, out_dtype, impl, precision, lhs_dtype=None):
    """Binds ``prim`` with both float operands cast to their common dtype.

    Parameters of all three primitives: ``block_size``; ``out_dtype``; ``impl`` (see
    :mod:`jax_blocksparse.config`); ``precision`` (:func:`canonical_precision`);
    ``lhs_dtype``: None, or (fprop and bprop only) a 16-bit dtype whose values the
    float32 lhs holds exactly (see the module docstring; read only by the transpose
    rule). Rules that bind a partner primitive pass their own parameters on.
    """
    common = jnp.promote_types(a.dtype, b.dtype)
    return prim.bind(
        *mark_partitioned(_matchvarying_axes([a.astype(common), b.astype(common), *tables])),
        block_size=block_size,
        out_dtype=np.dtype(out_dtype),
        impl=impl,
        precision=precision,
        lhs_dtype=None if lhs_dtype is None else np.dtype(lhs_dtype),
    )


def _abstract_eval(prim_name, a, b, *tables, block_size, out_dtype, **_):
    out_shape = _operand_shapes(prim_name, a, b, LayoutTables(*tables), block_size)
    sharding = _out_sharding(prim_name, a, len(out_shape))
    return a.update(shape=out_shape, dtype=out_dtype, weak_type=False, sharding=sharding)


def _out_sharding(prim_name, a, ndim: int):
    """The result's sharding type (it matters on meshes with Explicit axes).

    fprop/bprop keep a's leading-dim sharding and replicate the feature dim; updat
    contracts the leading dims, so its weight-shaped result is replicated. This is the
    sharding rule of ops/_partitioning.py, stated for the type system.
    """
    sharding = a.sharding
    spec = tuple(getattr(sharding, "spec", ()))
    if prim_name == "bsmm_updat":
        out = (None,) * ndim
    else:
        out = (spec + (None,) * ndim)[: ndim - 1] + (None,)
    return sharding.update(spec=P(*out)) if hasattr(sharding, "update") and spec else sharding


# ---------------------------------------------------------------------------------
# Lowerings: reference and dense everywhere (CPU-tuned reference on 'cpu'), native kernels on 'cpu' and 'cuda'
# ---------------------------------------------------------------------------------

_CPU_PARTS = max(1, min(os.cpu_count() or 1, 8))
_REFERENCES = {
    bsmm_fprop_p: bsmm_fprop_reference,
    bsmm_bprop_p: bsmm_bprop_reference,
    bsmm_updat_p: bsmm_updat_reference,
}
_DENSE = {
    bsmm_fprop_p: bsmm_fprop_dense,
    bsmm_bprop_p: bsmm_bprop_dense,
    bsmm_updat_p: bsmm_updat_dense,
}
_CPU_DENSE = {
    bsmm_fprop_p: bsmm_fprop_dense_cpu,
    bsmm_bprop_p: bsmm_bprop_dense_cpu,
    bsmm_updat_p: bsmm_updat_dense_cpu,
}


def _with_parts(reference, parts):
    def cpu_reference(*operands, **params):
        return reference(*operands, parts=parts, **params)

    return cpu_reference


# ---------------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------------
# Only the lhs of fprop/bprop batched: fold the batch axis into the leading dims.
# Anything else batched (w, the layout tables, or any operand of updat): stack the B
# problems into one block-diagonal layout of grid (B*CB, B*KB), so a single call of
# the same primitive does all of them.


def _move_to_front(a, bdim, size):
    if bdim is None:
        return jnp.broadcast_to(a, (size,) + a.shape)
    return jnp.moveaxis(a, bdim, 0)


def _stack_tables(tables: LayoutTables):
    """Block-diagonal layout of B stacked layouts (tables carry a leading B axis).

    Returns (stacked tables, pos) where pos [B, capacity] is each (b, slot)'s slot
    in the stacked layout: all B*nnz blocks first (sorted by stacked column), then
    every padding slot.
    """
    nb, capacity = tables.block_rows.shape
    cb, kb = _grid_of(tables)
    nnz = tables.col_ptr[:, -1]
    offset = jnp.cumsum(nnz) - nnz  # blocks before batch b
    total = jnp.sum(nnz)
    slot = jnp.arange(capacity)[None, :]
    valid = slot < nnz[:, None]
    b_index = jnp.arange(nb)[:, None]
    pads_before = b_index * capacity - offset[:, None]
    pos = jnp.where(valid, offset[:, None] + slot, total + pads_before + slot - nnz[:, None])
    flat_pos = pos.reshape(-1)

    def scatter(values):
        out = jnp.zeros((nb * capacity,), jnp.int32)
        return out.at[flat_pos].set(values.reshape(-1).astype(jnp.int32), unique_indices=True)

    def ptrs(ptr, width):
        starts = (offset[:, None] + ptr[:, :width]).reshape(-1)
        return jnp.concatenate([starts, total[None]]).astype(jnp.int32)

    row_slots = jnp.take_along_axis(pos, tables.row_slots, axis=1)
    stacked = LayoutTables.with_orders(
        block_rows=scatter(jnp.where(valid, tables.block_rows + b_index * cb, 0)),
        block_cols=scatter(jnp.where(valid, tables.block_cols + b_index * kb, 0)),
        col_ptr=ptrs(tables.col_ptr, kb),
        row_ptr=ptrs(tables.row_ptr, cb),
        row_slots=scatter(jnp.where(valid, row_slots, 0)),
    )
    return stacked, pos


def _fold_features(a, nb):
    """[B, ..., F] -> [..., B*F]."""
    return jnp.moveaxis(a, 0, -2).reshape(*a.shape[1:-1], nb * a.shape[-1])


def _unfold_features(a, nb):
    """[..., B*F] -> [B, ..., F]."""
    return jnp.moveaxis(a.reshape(*a.shape[:-1], nb, a.shape[-1] // nb), -2, 0)


def _batch_rule(prim):
    def rule(args, dims, **params):
        a, b, *tables = args
        a_dim, b_dim, *table_dims = dims
        others_batched = any(d is not None for d in [b_dim, *table_dims])
        if prim is not bsmm_updat_p and not others_batched:
            a = jnp.moveaxis(a, a_dim, 0)
            return prim.bind(a, b, *tables, **params), 0

        nb = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
        tables = LayoutTables(*(_move_to_front(t, d, nb) for t, d in zip(tables, table_dims)))
        stacked, pos = _stack_tables(tables)
        a = _fold_features(_move_to_front(a, a_dim, nb), nb)
        b = _move_to_front(b, b_dim, nb)
        if prim is bsmm_updat_p:
            dw = prim.bind(a, _fold_features(b, nb), *stacked, **params)
            return dw[pos], 0
        capacity = b.shape[1]
        b_stacked = (
            jnp.zeros((nb * capacity,) + b.shape[2:], b.dtype)
            .at[pos.reshape(-1)]
            .set(b.reshape(nb * capacity, *b.shape[2:]), unique_indices=True)
        )
        out = prim.bind(a, b_stacked, *stacked, **params)
        return _unfold_features(out, nb), 0

    return rule


# ---------------------------------------------------------------------------------
# JVP: each primitive is bilinear in its two float operands
# ---------------------------------------------------------------------------------


def _jvp_rule(prim):
    def rule(primals, tangents, **params):
        a, b, *tables = primals
        ta, tb = tangents[:2]
        out = prim.bind(a, b, *tables, **params)
        terms = []
        # A tangent of a widened 16-bit lhs is widened 16-bit too: lhs_dtype carries over.
        if type(ta) is not ad.Zero:
            terms.append(_bind(prim, ta, b, tables, **params))
        if type(tb) is not ad.Zero:
            terms.append(_bind(prim, a, tb, tables, **params))
        if not terms:
            return out, ad.Zero.from_primal_value(out)
        return out, terms[0] if len(terms) == 1 else terms[0] + terms[1]

    return rule


# float32 weight gradients of a 16-bit product (bsmm's float32_dw; module docstring).


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _f32_dw_product(static, x, w, tables):
    """``prim(x, w)`` computed in 16 bits whose derivative in float32 ``w`` stays float32.

    ``static = (prim, compute_dtype, params)`` with prim fprop or bprop, a 16-bit
    compute dtype and the primitive's parameters as sorted items (hashable); ``w`` is
    float32; ``tables`` the LayoutTables.
    """
    prim, compute, params = static
    return _bind(prim, x.astype(compute), w.astype(compute), tables, **dict(params))


def _f32_dw_product_jvp(static, primals, tangents):
    prim, compute, params = static
    params = dict(params)
    x, w, tables = primals
    tx, tw, _ = tangents
    xc, wc = x.astype(compute), w.astype(compute)
    y = _bind(prim, xc, wc, tables, **params)
    terms = []
    if not isinstance(tx, SymbolicZero):
        terms.append(_bind(prim, tx.astype(compute), wc, tables, **params))
    if not isinstance(tw, SymbolicZero):
        # A float32 bind (the widening of xc is exact), so the transpose for tw is
        # float32; lhs_dtype lets it run as bsmm_updat(x16, dy16, out_dtype=float32).
        lhs = xc.astype(tw.dtype)
        terms.append(_bind(prim, lhs, tw, tables, **params, lhs_dtype=compute))
    if not terms:
        return y, jnp.zeros_like(y)
    return y, terms[0] if len(terms) == 1 else terms[0] + terms[1]


_f32_dw_product.defjvp(_f32_dw_product_jvp, symbolic_zeros=True)


# ---------------------------------------------------------------------------------
# Transpose: the cotangent of each operand is one of the other two primitives
# ---------------------------------------------------------------------------------
#   fprop(x, w) = y:    ct_x = bprop(ct, w)     ct_w = updat(x, ct)
#   bprop(g, w) = dx:   ct_g = fprop(ct, w)     ct_w = updat(ct, g)
#   updat(x, dy) = dw:  ct_x = bprop(dy, ct)    ct_dy = fprop(x, ct)

_TRANSPOSES = {
    # prim: (prim and operands for ct of operand 0, prim and operands for ct of operand 1)
    "bsmm_fprop": ((lambda ct, a, b: (bsmm_bprop_p, ct, b)), (lambda ct, a, b: (bsmm_updat_p, a, ct))),
    "bsmm_bprop": ((lambda ct, a, b: (bsmm_fprop_p, ct, b)), (lambda ct, a, b: (bsmm_updat_p, ct, a))),
    "bsmm_updat": ((lambda ct, a, b: (bsmm_bprop_p, b, ct)), (lambda ct, a, b: (bsmm_fprop_p, a, ct))),
}


def _transpose_rule(prim):
    ct_a_rule, ct_b_rule = _TRANSPOSES[prim.name]

    def rule(ct, a, b, *tables, lhs_dtype, **params):
        if any(ad.is_undefined_primal(t) for t in tables):
            raise ValueError(f"{prim.name}: the layout tables are not differentiable")
        none_for_tables = [None] * len(tables)
        if type(ct) is ad.Zero:
            return [None, None, *none_for_tables]
        ct_a = ct_b = None
        if ad.is_undefined_primal(a):
            p, lhs, rhs = ct_a_rule(ct, a, b)
            ct_a = _bind(p, lhs, rhs, tables, **dict(params, out_dtype=a.aval.dtype))
        if ad.is_undefined_primal(b):
            p, lhs, rhs = ct_b_rule(ct, a, b)
            if lhs_dtype is not None and np.dtype(ct.dtype) == lhs_dtype and not ad.is_undefined_primal(a):
                # Both operands of the weight's updat (the lhs and ct) hold lhs_dtype values:
                # narrow them losslessly and accumulate straight into b's float32.
                lhs, rhs = lhs.astype(lhs_dtype), rhs.astype(lhs_dtype)
            ct_b = _bind(p, lhs, rhs, tables, **dict(params, out_dtype=b.aval.dtype))
        return [ct_a, ct_b, *none_for_tables]

    return rule


# ---------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------


@functools.cache
def _jitted_bind(prim, params: tuple):
    return jax.jit(lambda *args: prim.bind(*args, **dict(params)))


def _eager_impl(prim):
    # Eager calls run the same lowering as jit (one compile per shape and params).
    return lambda *args, **params: _jitted_bind(prim, tuple(sorted(params.items())))(*args)


for _prim in _PRIMITIVES:
    _prim.def_impl(_eager_impl(_prim))
    _prim.def_abstract_eval(lambda *args, _n=_prim.name, **params: _abstract_eval(_n, *args, **params))
    register_lowerings(
        _prim,
        _REFERENCES[_prim],
        cpu_reference=_with_parts(_REFERENCES[_prim], _CPU_PARTS),
        dense=_DENSE[_prim],
        cpu_dense=_CPU_DENSE[_prim],
        target=f"jbs_{_prim.name}",
    )
    batching.primitive_batchers[_prim] = _batch_rule(_prim)
    ad.primitive_jvps[_prim] = _jvp_rule(_prim)
    ad.primitive_transposes[_prim] = _transpose_rule(_prim)
