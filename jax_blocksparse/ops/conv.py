"""bsconv: N-d convolution with a block-sparse channel mixing.

A convolution kernel W of shape [*kernel_size, C, K] (HWIO) is block-sparse when its
[C, K] channel matrix is: one :class:`~jax_blocksparse.Layout` of grid
[C // bs, K // bs] says which (input block, output block) pairs exist, the same for
every spatial tap. Only those blocks are stored, as ``w`` of shape
[capacity, *kernel_size, bs, bs]: slot ``s`` holds block
(``layout.tables.block_rows[s]``, ``layout.tables.block_cols[s]``) at every tap.

============================  ===================================================
function                      computes (NHWC / HWIO, any number of spatial dims)
============================  ===================================================
bsconv                        ``lax.conv_general_dilated(x, conv_to_dense(w))``
bsconv_transpose              ``lax.conv_transpose(x, conv_to_dense(w))``
conv_to_dense                 w [cap, *ks, bs, bs] -> W [*ks, C, K]
conv_from_dense               W [*ks, C, K] -> w [cap, *ks, bs, bs]
bsconv_reference              the dense definition of ``bsconv``
bsconv_transpose_reference    the dense definition of ``bsconv_transpose``
============================  ===================================================

Where it runs
-------------
Both functions bind one primitive, ``bsconv`` (:mod:`jax_blocksparse.ops.conv_primitives`),
whose JVP and transpose are ``bsconv`` again (the input gradient) and ``bsconv_wgrad``
(the weight gradient). Its lowering picks the path per platform:

* "cpu": implicit-GEMM kernels (cuda/cpu/bsconv_cpu.h) that read the NHWC input with
  the taps as offsets: no im2col, nothing of size taps x input is made, and the work
  is the layout's blocks only;
* "cuda": the bsmm compositions below (im2col / col2im), whose products are the CUDA
  bsmm kernels;
* the reference everywhere (``impl="reference"``, or where no kernels are built):
  ``lax.conv_general_dilated`` on the dense kernel.

How a convolution becomes one block-sparse matmul (the "cuda" path)
-------------------------------------------------------------------
A convolution is a sum over the T = prod(kernel_size) taps of (shifted, strided
input window) @ (channel matrix of that tap). All taps share one layout, so the T
channel matrices stacked along their rows form one block-sparse matrix
W_rows [T * C, K] whose block row ``c * T + t`` is block row ``c`` of tap ``t``
(the *tap-stacked layout*, grid [CB * T, KB], capacity ``T * capacity``). In that
order the stored blocks of W_rows are exactly ``w.reshape(capacity * T, bs, bs)``
(storage order sorts by column, then row; each slot ``s`` becomes ``T``
consecutive slots ``s * T + t``), so no weight is copied.

* ``bsconv`` (im2col): gather the T shifted windows of the padded input into
  x_col [N, *out, CB * T * bs] (same block order) and make **one**
  ``bsmm(x_col, w_rows)`` call: its fprop sums over the taps inside the kernel,
  accumulating in float32.
* ``bsconv_transpose`` (col2im): the transposed convolution is the adjoint of
  a strided one, so it multiplies the *un-dilated* input once by every tap,
  ``P = bsmm(x, w_cols)`` with the taps stacked along the columns
  (W_cols [C, K * T], block column ``k * T + t``; its blocks are a permutation of
  ``w``), then adds each tap's product into the output at stride ``s``
  (``lax.pad`` with interior padding). With ``transpose_kernel=True`` the product
  is ``bsmm(x, w_rows, transpose=True)`` on the row-stacked layout instead.
  This never multiplies the zeros that an input-dilated formulation inserts
  (``strides ** ndim`` fewer products). ``bsconv`` with ``input_dilation`` > 1 and
  unit strides is such a convolution and takes this path too (with both > 1 it
  falls back to im2col of the dilated input).

On "cuda" the input gradient of a strided ``bsconv`` is im2col with the kernel flipped
(windows in reverse tap order, one bsmm bprop over the column-stacked layout) and the
weight gradient is the composition's linear transpose: one bsmm updat (SDDMM) over the
tap-stacked layout, with no dense [*ks, C, K] weight anywhere.

Cost (both paths): the GEMM work is ``T * nnz * bs * bs`` multiply-adds per output position
(``bsconv``) or per input position (``bsconv_transpose``), the dense convolution's
work times the block density. Memory on "cuda": im2col materialises x_col, T times
the (strided) output positions times C; col2im materialises P in float32, T times the
input positions times K. The CPU kernels make one float32 copy of the input (with the
zero border its taps read) and of the weights.

The tap-stacked layouts are computed from the layout's index tables with integer
arithmetic (numpy for a concrete layout, jnp for a traced one, e.g. inside jit
during dynamic sparse training), so a layout that changes with the same capacity
does not recompile.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blocksparse import config
from jax_blocksparse.layout import Layout, LayoutTables, check_layout
from jax_blocksparse.ops import conv_primitives
from jax_blocksparse.ops._checks import (
    as_float_array,
    canonical_precision,
    check_float32_dw,
    compute_dtype_of,
    out_dtype_of,
)
from jax_blocksparse.ops.conv_spec import ConvSpec
from jax_blocksparse.ops.matmul import bsmm, from_dense, to_dense

PADDING_STRINGS = ("SAME", "SAME_LOWER", "VALID")
TRANSPOSE_PADDING_STRINGS = ("SAME", "VALID")

# ---------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------


def bsconv(
    x,
    w,
    layout: Layout,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    input_dilation=1,
    preferred_element_type=None,
    compute_dtype=None,
    float32_dw: bool = False,
    precision=None,
    impl: str | None = None,
):
    """Block-sparse convolution: ``lax.conv_general_dilated(x, conv_to_dense(w, layout))``.

    Channels-last: for ``n`` spatial dims (1-D, 2-D, 3-D, ...), NWC / HWIO style.

    Args:
      x: [N, *spatial, C], float32/bfloat16/float16; ``n = w.ndim - 3`` spatial dims.
      w: [capacity, *kernel_size, bs, bs], the stored blocks of every tap; slot ``s``
        is block (``layout.tables.block_rows[s]``, ``layout.tables.block_cols[s]``).
      layout: the :class:`~jax_blocksparse.Layout` of the [C, K] channel matrix,
        shared by all taps.
      strides: window strides, an int or ``n`` ints >= 1.
      padding: ``"SAME"``, ``"SAME_LOWER"``, ``"VALID"`` (as in ``lax``) or ``n``
        ``(low, high)`` int pairs (negative pads crop).
      dilation: kernel (rhs) dilation, an int or ``n`` ints >= 1.
      input_dilation: input (lhs) dilation, an int or ``n`` ints >= 1; with any value
        > 1 the padding must be explicit pairs (as in ``lax.conv_general_dilated``).
      preferred_element_type: output dtype; default ``compute_dtype`` if given, else
        the promoted dtype of x and w.
      compute_dtype: the dtype both operands are cast to for the products (e.g.
        bfloat16 with a float32 ``w``); default the promoted dtype of x and w.
      float32_dw: keep the gradient with respect to a float32 ``w`` in float32, straight
        from the float32 accumulator of its ``bsmm_updat`` (see :func:`~jax_blocksparse.bsmm`).
      precision: as in :func:`jax.lax.conv_general_dilated` and
        :func:`~jax_blocksparse.bsmm`: None (read from :func:`jax.default_matmul_precision`),
        a :class:`jax.lax.Precision` or its name, or a pair.
      impl: the implementation of this call's products, as in
        :func:`~jax_blocksparse.bsmm`: ``"auto"``, ``"reference"``, ``"kernels"``, ``"dense"``, or
        None for the default read at trace time
        (:func:`jax_blocksparse.config.get_implementation`). Its gradient, JVP and vmap
        keep it.

    Returns:
      [N, *out_spatial, K], with ``out_spatial`` that of ``lax.conv_general_dilated``
      (e.g. ``ceil(spatial / strides)`` for ``"SAME"``). Products accumulate in
      float32.

    Example::

        layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5), block_size=16)
        w = jnp.ones((layout.capacity, 3, 3, 16, 16))
        y = jbs.bsconv(jnp.ones((2, 8, 8, 64)), w, layout, strides=2)   # [2, 4, 4, 64]
    """
    layout = check_layout(layout)
    x, w = jnp.asarray(as_float_array(x, "x")), jnp.asarray(as_float_array(w, "w"))
    g = _geometry("bsconv", x, w, layout, strides, padding, dilation, input_dilation, transpose=False)
    prec = _precision("bsconv", x, w, preferred_element_type, compute_dtype, float32_dw, precision, impl)
    out_shape = (x.shape[0], *g.out_spatial, layout.shape[1])
    if _is_empty(out_shape) or _is_empty(x.shape[1:-1]):
        return jnp.zeros(out_shape, prec.out_dtype)
    return _bind(x, w, layout, g, prec, transpose_kernel=False)


def bsconv_transpose(
    x,
    w,
    layout: Layout,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    transpose_kernel: bool = False,
    preferred_element_type=None,
    compute_dtype=None,
    float32_dw: bool = False,
    precision=None,
    impl: str | None = None,
):
    """Block-sparse transposed (fractionally strided) convolution.

    Matches ``jax.lax.conv_transpose(x, conv_to_dense(w, layout), strides, padding,
    rhs_dilation=dilation, dimension_numbers=<NHWC, HWIO, NHWC>, transpose_kernel=...)``
    with its default ``use_consistent_padding=False``: ``"SAME"`` and ``"VALID"``
    name the padding of the *forward* convolution this one inverts (output
    ``spatial * strides`` for ``"SAME"``, ``spatial * strides + max(k_eff - strides, 0)``
    for ``"VALID"``, ``k_eff = dilation * (k - 1) + 1``); explicit ``(low, high)``
    pairs are the padding of the transposed convolution itself, i.e. of the
    stride-dilated input. That is also ``flax.linen.ConvTranspose``'s convention.

    Args:
      x: [N, *spatial, Cx], float32/bfloat16/float16, ``n = w.ndim - 3`` spatial dims.
      w: [capacity, *kernel_size, bs, bs].
      layout: the layout of the [Cx, Cy] channel matrix, or of [Cy, Cx] with
        ``transpose_kernel=True``.
      strides: the fractional strides (the input dilation), an int or ``n`` ints >= 1.
      padding: ``"SAME"``, ``"VALID"`` or ``n`` ``(low, high)`` int pairs.
      dilation: kernel dilation, an int or ``n`` ints >= 1.
      transpose_kernel: flip the kernel's spatial axes and swap its channel axes,
        as ``lax.conv_transpose`` (the gradient of ``bsconv`` with the same w).
      preferred_element_type, compute_dtype, float32_dw, precision, impl: as in
        :func:`bsconv`.

    Returns:
      [N, *out_spatial, Cy]; ``out_spatial[i] = (spatial[i] - 1) * strides[i] + 1
      + low[i] + high[i] - k_eff[i] + 1`` with the transposed convolution's pads.
    """
    layout = check_layout(layout)
    x, w = jnp.asarray(as_float_array(x, "x")), jnp.asarray(as_float_array(w, "w"))
    g = _geometry(
        "bsconv_transpose", x, w, layout, strides, padding, dilation, 1, transpose=True,
        transpose_kernel=transpose_kernel,
    )
    prec = _precision(
        "bsconv_transpose", x, w, preferred_element_type, compute_dtype, float32_dw, precision, impl
    )
    k_out = layout.shape[0] if transpose_kernel else layout.shape[1]
    out_shape = (x.shape[0], *g.out_spatial, k_out)
    if _is_empty(out_shape) or _is_empty(x.shape[1:-1]):
        return jnp.zeros(out_shape, prec.out_dtype)
    return _bind(x, w, layout, g, prec, transpose_kernel=bool(transpose_kernel))


def conv_to_dense(w, layout: Layout):
    """Scatters stored conv blocks into a dense HWIO kernel, zero outside the layout.

    Args:
      w: [capacity, *kernel_size, bs, bs]; padding slots are ignored.
      layout: the layout of the [C, K] channel matrix.

    Returns:
      [*kernel_size, C, K], dtype of ``w``.
    """
    layout = check_layout(layout)
    w = jnp.asarray(w)
    kernel_size = _check_conv_w("conv_to_dense", w, layout)
    taps = math.prod(kernel_size)
    per_tap = jnp.moveaxis(w.reshape(layout.capacity, taps, *w.shape[-2:]), 1, 0)  # [T, cap, bs, bs]
    W = jax.vmap(to_dense, in_axes=(0, None))(per_tap, layout)  # [T, C, K]
    return W.reshape(*kernel_size, *layout.shape)


def conv_from_dense(W, layout: Layout):
    """Gathers the layout's blocks of every tap out of a dense HWIO kernel.

    Args:
      W: [*kernel_size, C, K] with [C, K] = ``layout.shape``.
      layout: the layout of the [C, K] channel matrix.

    Returns:
      [capacity, *kernel_size, bs, bs]; padding slots are zero.
    """
    layout = check_layout(layout)
    W = jnp.asarray(W)
    if W.ndim < 3 or tuple(W.shape[-2:]) != layout.shape:
        raise ValueError(
            f"conv_from_dense: W must have shape [*kernel_size, C, K] with [C, K] = "
            f"{layout.shape} (layout.shape), got W {tuple(W.shape)}"
        )
    kernel_size = tuple(W.shape[:-2])
    per_tap = W.reshape(math.prod(kernel_size), *layout.shape)
    w = jax.vmap(from_dense, in_axes=(0, None))(per_tap, layout)  # [T, cap, bs, bs]
    return jnp.moveaxis(w, 0, 1).reshape(layout.capacity, *kernel_size, *w.shape[-2:])


def bsconv_reference(
    x,
    w,
    layout: Layout,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    input_dilation=1,
    preferred_element_type=None,
    compute_dtype=None,
):
    """The definition of :func:`bsconv`: ``lax.conv_general_dilated`` on the dense kernel."""
    layout = check_layout(layout)
    x, w = jnp.asarray(as_float_array(x, "x")), jnp.asarray(as_float_array(w, "w"))
    g = _geometry("bsconv_reference", x, w, layout, strides, padding, dilation, input_dilation, transpose=False)
    common = compute_dtype_of(compute_dtype, x.dtype, w.dtype)
    out_dtype = out_dtype_of(preferred_element_type, common)
    y = lax.conv_general_dilated(
        x.astype(common),
        conv_to_dense(w, layout).astype(common),
        g.strides,
        g.pads,
        lhs_dilation=g.lhs_dilation,
        rhs_dilation=g.rhs_dilation,
        dimension_numbers=_dimension_numbers(x.ndim),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)


def bsconv_transpose_reference(
    x,
    w,
    layout: Layout,
    *,
    strides=1,
    padding="SAME",
    dilation=1,
    transpose_kernel: bool = False,
    preferred_element_type=None,
    compute_dtype=None,
):
    """The definition of :func:`bsconv_transpose`: ``lax.conv_transpose`` on the dense kernel."""
    layout = check_layout(layout)
    x, w = jnp.asarray(as_float_array(x, "x")), jnp.asarray(as_float_array(w, "w"))
    g = _geometry(
        "bsconv_transpose_reference", x, w, layout, strides, padding, dilation, 1, transpose=True,
        transpose_kernel=transpose_kernel,
    )
    common = compute_dtype_of(compute_dtype, x.dtype, w.dtype)
    out_dtype = out_dtype_of(preferred_element_type, common)
    y = lax.conv_transpose(
        x.astype(common),
        conv_to_dense(w, layout).astype(common),
        g.lhs_dilation,
        padding if isinstance(padding, str) else g.pads,
        rhs_dilation=g.rhs_dilation,
        dimension_numbers=_dimension_numbers(x.ndim),
        transpose_kernel=bool(transpose_kernel),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)


# ---------------------------------------------------------------------------------
# Shape rules
# ---------------------------------------------------------------------------------


class _Geometry(NamedTuple):
    """A convolution in lax.conv_general_dilated terms, with explicit pads."""

    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]  # window strides
    pads: tuple[tuple[int, int], ...]  # on the lhs-dilated input
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    out_spatial: tuple[int, ...]


class _Precision(NamedTuple):
    """The numerics of one call: the products' input and output dtypes, float32_dw, the
    matmul precision (``lax.Precision`` or None) and the implementation (one of
    ``config.IMPLEMENTATIONS``), both resolved at trace time."""

    compute_dtype: np.dtype
    out_dtype: np.dtype
    float32_dw: bool
    precision: object
    impl: str

    def bsmm_args(self, out_dtype=None) -> dict:
        """The keyword arguments of the bsmm calls that compute this call's products."""
        return dict(
            preferred_element_type=self.out_dtype if out_dtype is None else out_dtype,
            compute_dtype=self.compute_dtype,
            float32_dw=self.float32_dw,
            precision=self.precision,
            impl=self.impl,
        )


def _precision(op, x, w, preferred_element_type, compute_dtype, float32_dw, precision, impl) -> _Precision:
    compute = compute_dtype_of(compute_dtype, x.dtype, w.dtype)
    out_dtype = out_dtype_of(preferred_element_type, compute, name="preferred_element_type")
    return _Precision(
        compute,
        out_dtype,
        check_float32_dw(op, float32_dw, w, compute),
        canonical_precision(precision),
        config.canonical_impl(impl),
    )


def _dimension_numbers(ndim: int):
    """NWC / HWIO / NWC dimension numbers for ``ndim - 2`` spatial dims."""
    spatial = tuple(range(1, ndim - 1))
    lhs = (0, ndim - 1) + spatial
    rhs = (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)


def _is_empty(shape) -> bool:
    return any(d == 0 for d in shape)


def _check_conv_w(op: str, w, layout: Layout) -> tuple[int, ...]:
    """Checks w is [capacity, *kernel_size, bs, bs]; returns kernel_size."""
    cap, bs = layout.capacity, layout.block_size
    shape = tuple(w.shape)
    if len(shape) < 4 or shape[0] != cap or shape[-2:] != (bs, bs) or any(k < 1 for k in shape[1:-2]):
        raise ValueError(
            f"{op}: w must have shape [capacity, *kernel_size, bs, bs] = [{cap}, *kernel_size, {bs}, {bs}] "
            f"with at least one spatial dim of size >= 1 for {layout}, got w {shape}"
        )
    return shape[1:-2]


def _int_tuple(value, n: int, name: str, op: str) -> tuple[int, ...]:
    """An int or a sequence of ``n`` ints, each >= 1, as a tuple."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        values = (int(value),) * n
    else:
        try:
            values = tuple(value)
        except TypeError:
            raise TypeError(f"{op}: {name} must be an int or a sequence of {n} ints, got {value!r}") from None
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in values):
            raise TypeError(f"{op}: {name} must be an int or a sequence of {n} ints, got {value!r}")
        if len(values) != n:
            raise ValueError(
                f"{op}: {name} must have one entry per spatial dim ({n}), got {value!r} of length {len(values)}"
            )
        values = tuple(int(v) for v in values)
    if any(v < 1 for v in values):
        raise ValueError(f"{op}: {name} must be >= 1, got {value!r}")
    return values


def _explicit_pads(padding, n: int, op: str, strings=PADDING_STRINGS) -> tuple[tuple[int, int], ...]:
    try:
        pads = tuple(tuple(p) for p in padding)
    except TypeError:
        pads = None
    if (
        pads is None
        or len(pads) != n
        or any(len(p) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in p) for p in pads)
    ):
        raise ValueError(
            f"{op}: padding must be one of {strings} or a sequence of {n} (low, high) int pairs "
            f"(one per spatial dim), got {padding!r}"
        )
    return tuple((int(lo), int(hi)) for lo, hi in pads)


def _conv_transpose_pads(k_eff: int, stride: int, padding: str) -> tuple[int, int]:
    """Pads of the stride-dilated input for a transposed conv of a forward ``padding``.

    The rule of ``lax.conv_transpose`` (strings name the forward conv's padding).
    """
    if padding == "SAME":
        total = k_eff + stride - 2
        low = k_eff - 1 if stride > k_eff - 1 else int(math.ceil(total / 2))
    else:  # VALID
        total = k_eff + stride - 2 + max(k_eff - stride, 0)
        low = k_eff - 1
    return low, total - low


def _geometry(op, x, w, layout, strides, padding, dilation, input_dilation, *, transpose, transpose_kernel=False):
    """Validates the operands and returns the convolution's explicit geometry."""
    kernel_size = _check_conv_w(op, w, layout)
    n = len(kernel_size)
    x_shape = tuple(x.shape)
    c_rows, c_cols = layout.shape
    c_in = c_cols if transpose and transpose_kernel else c_rows
    if len(x_shape) != n + 2:
        raise ValueError(
            f"{op}: x must have shape [N, *spatial, C] with {n} spatial dims (as w "
            f"{tuple(w.shape)} = [capacity, *kernel_size, bs, bs] has), got x {x_shape}"
        )
    if x_shape[-1] != c_in:
        side = "K (layout.shape[1], transpose_kernel=True)" if transpose and transpose_kernel else "C (layout.shape[0])"
        raise ValueError(
            f"{op}: x has {x_shape[-1]} channels but the layout {layout.shape} needs {side} = {c_in}; "
            f"x {x_shape}, w {tuple(w.shape)}"
        )
    strides = _int_tuple(strides, n, "strides", op)
    rhs_dilation = _int_tuple(dilation, n, "dilation", op)
    lhs_dilation = _int_tuple(input_dilation, n, "input_dilation", op)
    spatial = x_shape[1:-1]
    k_eff = tuple((k - 1) * d + 1 for k, d in zip(kernel_size, rhs_dilation))

    if transpose:
        # The transposed conv: a stride-1 conv of the strides-dilated input.
        if isinstance(padding, str):
            if padding not in TRANSPOSE_PADDING_STRINGS:
                raise ValueError(
                    f"{op}: padding must be one of {TRANSPOSE_PADDING_STRINGS} or a sequence of {n} "
                    f"(low, high) int pairs, got {padding!r}"
                )
            pads = tuple(_conv_transpose_pads(k, s, padding) for k, s in zip(k_eff, strides))
        else:
            pads = _explicit_pads(padding, n, op, TRANSPOSE_PADDING_STRINGS)
        lhs_dilation, strides = strides, (1,) * n
    elif isinstance(padding, str):
        if padding.upper() not in PADDING_STRINGS:
            raise ValueError(
                f"{op}: padding must be one of {PADDING_STRINGS} or a sequence of {n} (low, high) int pairs, "
                f"got {padding!r}"
            )
        if any(d != 1 for d in lhs_dilation):
            raise ValueError(
                f"{op}: string padding {padding!r} is not defined with input_dilation {lhs_dilation}; give "
                "explicit (low, high) pairs, or use bsconv_transpose"
            )
        pads = tuple(tuple(int(p) for p in pair) for pair in lax.padtype_to_pads(spatial, k_eff, strides, padding))
    else:
        pads = _explicit_pads(padding, n, op)

    out_spatial = []
    for size, (lo, hi), s, ld, ke in zip(spatial, pads, strides, lhs_dilation, k_eff):
        dilated = (size - 1) * ld + 1 if size > 0 else 0
        padded = dilated + lo + hi
        if padded < 0:
            raise ValueError(
                f"{op}: negative padding {pads} crops more than the (dilated) input: spatial dims "
                f"{spatial} of x {x_shape} with input dilation {lhs_dilation}"
            )
        out_spatial.append(max(0, (padded - ke) // s + 1) if padded >= ke else 0)
    return _Geometry(kernel_size, strides, pads, lhs_dilation, rhs_dilation, tuple(out_spatial))


# ---------------------------------------------------------------------------------
# Tap-stacked layouts: one layout of T taps that share a channel layout
# ---------------------------------------------------------------------------------


def _is_concrete(tables: LayoutTables) -> bool:
    return not any(isinstance(t, jax.core.Tracer) for t in tables)


def _stacked_tables_rows(t: LayoutTables, taps: int, capacity: int, xp) -> LayoutTables:
    """Tables of W_rows [T*C, K]: block (c, k) of tap j is block (c*T + j, k).

    Storage slot ``s`` of the channel layout becomes slots ``s*T + j``.
    """
    j = xp.arange(taps)
    nnz = t.col_ptr[-1]
    valid = (xp.arange(capacity) < nnz)[:, None]
    block_rows = xp.where(valid, t.block_rows[:, None] * taps + j, 0).reshape(-1)
    block_cols = xp.where(valid, t.block_cols[:, None] + 0 * j, 0).reshape(-1)
    col_ptr = t.col_ptr * taps
    count = t.row_ptr[1:] - t.row_ptr[:-1]  # blocks per block row
    row_ptr = xp.concatenate([(taps * t.row_ptr[:-1, None] + j * count[:, None]).reshape(-1), (taps * nnz)[None]])
    # Row-major order of W_rows: stacked row r = c*T + j lists row c's slots (by column), tap j.
    i = xp.arange(taps * capacity)
    r = xp.clip(xp.searchsorted(row_ptr, i, side="right") - 1, 0, max(row_ptr.shape[0] - 2, 0))
    c, tap = r // taps, r % taps
    src = xp.clip(t.row_ptr[c] + i - row_ptr[r], 0, max(capacity - 1, 0))
    row_slots = xp.where(i < taps * nnz, t.row_slots[src] * taps + tap, 0)
    tables = (block_rows, block_cols, col_ptr, row_ptr, row_slots)
    return LayoutTables.with_orders(*(a.astype(np.int32) for a in tables))


def _stacked_tables_cols(t: LayoutTables, taps: int, capacity: int, xp):
    """Tables of W_cols [C, K*T]: block (c, k) of tap j is block (c, k*T + j).

    Returns (tables, source) where stacked slot ``q`` holds ``w_flat[source[q]]``
    with ``w_flat = w.reshape(capacity * T, bs, bs)`` (a permutation).
    """
    j = xp.arange(taps)
    nnz = t.col_ptr[-1]
    count = t.col_ptr[1:] - t.col_ptr[:-1]  # blocks per block column
    col_ptr = xp.concatenate([(taps * t.col_ptr[:-1, None] + j * count[:, None]).reshape(-1), (taps * nnz)[None]])
    q = xp.arange(taps * capacity)
    valid = q < taps * nnz
    r = xp.clip(xp.searchsorted(col_ptr, q, side="right") - 1, 0, max(col_ptr.shape[0] - 2, 0))  # k*T + j
    k, tap = r // taps, r % taps
    slot = t.col_ptr[k] + q - col_ptr[r]  # the channel layout's slot
    pad = q - taps * nnz  # padding: after all blocks, in (slot, tap) order
    slot = xp.where(valid, slot, nnz + pad // taps)
    tap = xp.where(valid, tap, pad % taps)
    source = slot * taps + tap
    block_rows = xp.where(valid, t.block_rows[xp.clip(slot, 0, max(capacity - 1, 0))], 0)
    block_cols = xp.where(valid, r, 0)
    row_ptr = t.row_ptr * taps
    # Row-major order of W_cols: each entry (slot s, column k) of row c becomes T entries.
    s = t.row_slots
    ks = t.block_cols[s]
    stacked = taps * t.col_ptr[ks][:, None] + j * count[ks][:, None] + (s - t.col_ptr[ks])[:, None]
    row_slots = xp.where((xp.arange(capacity) < nnz)[:, None], stacked, 0).reshape(-1)
    tables = (block_rows, block_cols, col_ptr, row_ptr, row_slots)
    tables = LayoutTables.with_orders(*(a.astype(np.int32) for a in tables))
    return tables, source.astype(np.int32)


def stack_taps(layout: Layout, taps: int, axis: int):
    """The layout of ``taps`` copies of ``layout``'s channel matrix stacked along ``axis``.

    ``axis=0``: W_rows [T*C, K], block row ``c*T + t`` = block row ``c`` of tap ``t``;
    the stored blocks are ``w.reshape(capacity*T, bs, bs)`` (returns ``source=None``).
    ``axis=1``: W_cols [C, K*T], block column ``k*T + t`` = block column ``k`` of tap
    ``t``; the stored blocks are ``w.reshape(capacity*T, bs, bs)[source]``.

    Returns ``(stacked_layout, source)``. Works for concrete (numpy tables) and
    traced layouts; the result equals ``Layout.from_mask`` of the repeated mask
    with capacity ``T * capacity``.
    """
    t, cap = layout.tables, layout.capacity
    concrete = _is_concrete(t)
    xp = np if concrete else jnp
    if concrete:
        t = LayoutTables(*(np.asarray(a).astype(np.int64) for a in t))
    cb, kb = layout.grid
    if axis == 0:
        tables, source, grid = _stacked_tables_rows(t, taps, cap, xp), None, (cb * taps, kb)
    elif axis == 1:
        tables, source = _stacked_tables_cols(t, taps, cap, xp)
        source = jnp.asarray(source) if concrete else source
        grid = (cb, kb * taps)
    else:
        raise ValueError(f"stack_taps: axis must be 0 or 1, got {axis}")
    # Concrete tables stay numpy, like Layout.from_mask's: constants in the program.
    return Layout(layout.block_size, grid, cap * taps, tables), source


# ---------------------------------------------------------------------------------
# The compositions
# ---------------------------------------------------------------------------------


def _tap_offsets(kernel_size):
    return list(itertools.product(*(range(k) for k in kernel_size)))


def _weight_for_products(w, prec: _Precision):
    """w as the products take it: float32 (master) with float32_dw, else in the compute dtype."""
    return w if prec.float32_dw else w.astype(prec.compute_dtype)


def _bind(x, w, layout: Layout, g: _Geometry, prec: _Precision, *, transpose_kernel: bool):
    """The convolution primitive (ops/conv_primitives.py) of geometry ``g``."""
    spec = ConvSpec(g.strides, g.pads, g.lhs_dilation, g.rhs_dilation, transpose_kernel)
    return conv_primitives.conv(
        x.astype(prec.compute_dtype),
        _weight_for_products(w, prec),
        layout.tables,
        spec=spec,
        compute_dtype=prec.compute_dtype,
        out_dtype=prec.out_dtype,
        impl=prec.impl,
        precision=prec.precision,
    )


def _conv_im2col(x, w, layout: Layout, g: _Geometry, prec: _Precision, *, transpose_kernel: bool = False):
    """y = bsmm(x_col, W_rows): one fprop over the tap-stacked layout.

    With ``transpose_kernel`` (W flipped and channel-swapped: the input gradient of a
    strided ``bsconv``) the windows are gathered in reverse tap order and
    y = x_col @ W_cols^T, one bprop over the column-stacked layout.
    """
    n, c = x.shape[0], x.shape[-1]
    bs, taps = layout.block_size, math.prod(g.kernel_size)
    config = [(0, 0, 0)] + [(lo, hi, ld - 1) for (lo, hi), ld in zip(g.pads, g.lhs_dilation)] + [(0, 0, 0)]
    xp = lax.pad(x, jnp.zeros((), x.dtype), config)
    windows = []
    offsets = _tap_offsets(g.kernel_size)
    for tap in offsets[::-1] if transpose_kernel else offsets:
        start = [t * d for t, d in zip(tap, g.rhs_dilation)]
        limit = [s0 + (o - 1) * s + 1 for s0, o, s in zip(start, g.out_spatial, g.strides)]
        windows.append(lax.slice(xp, (0, *start, 0), (n, *limit, c), (1, *g.strides, 1)))
    lead = (n, *g.out_spatial)
    cols = jnp.stack(windows, axis=-2)  # [N, *out, T, C]
    cols = cols.reshape(*lead, taps, c // bs, bs).swapaxes(-3, -2).reshape(*lead, taps * c)  # [.., CB, T, bs]
    if transpose_kernel:
        stacked, source = stack_taps(layout, taps, axis=1)
        w_cols = _weight_for_products(w, prec).reshape(layout.capacity * taps, bs, bs)
        w_cols = w_cols.at[source].get(unique_indices=True)
        return bsmm(cols, w_cols, stacked, transpose=True, **prec.bsmm_args())
    stacked, _ = stack_taps(layout, taps, axis=0)
    w_rows = _weight_for_products(w, prec).reshape(layout.capacity * taps, bs, bs)
    return bsmm(cols, w_rows, stacked, **prec.bsmm_args())


def _conv_col2im(x, w, layout: Layout, g: _Geometry, prec: _Precision, *, transpose_kernel: bool):
    """y = sum over taps of (x @ W_tap) added at stride ``lhs_dilation``: col2im.

    Computes ``conv_general_dilated(x, W, 1, pads, lhs_dilation, rhs_dilation)``
    (with W flipped and channel-swapped when ``transpose_kernel``) without forming
    the dilated input.
    """
    bs, taps = layout.block_size, math.prod(g.kernel_size)
    lead = x.shape[:-1]
    w = _weight_for_products(w, prec)
    dtypes = prec.bsmm_args(out_dtype=jnp.float32)
    if transpose_kernel:
        # P[..., t, :] = x @ W_t.T: bprop over the row-stacked layout.
        stacked, _ = stack_taps(layout, taps, axis=0)
        w_rows = w.reshape(layout.capacity * taps, bs, bs)
        prod = bsmm(x, w_rows, stacked, transpose=True, **dtypes)
        k_out = layout.shape[0]
    else:
        # P[..., t, :] = x @ W_t: fprop over the column-stacked layout.
        stacked, source = stack_taps(layout, taps, axis=1)
        w_cols = w.reshape(layout.capacity * taps, bs, bs).at[source].get(unique_indices=True)
        prod = bsmm(x, w_cols, stacked, **dtypes)
        k_out = layout.shape[1]
    prod = prod.reshape(*lead, k_out // bs, taps, bs).swapaxes(-3, -2).reshape(*lead, taps, k_out)
    zero = jnp.zeros((), prod.dtype)
    y = None
    for index, tap in enumerate(_tap_offsets(g.kernel_size)):
        config = [(0, 0, 0)]
        for t, k, (lo, hi), s, d in zip(tap, g.kernel_size, g.pads, g.lhs_dilation, g.rhs_dilation):
            # Output j = i*s - t'*d + lo receives input i of tap t' (t' = flipped tap if transposed).
            tt = k - 1 - t if transpose_kernel else t
            config.append((lo - tt * d, hi - (k - 1 - tt) * d, s - 1))
        config.append((0, 0, 0))
        term = lax.pad(prod[..., index, :], zero, config)
        y = term if y is None else y + term
    return y.astype(prec.out_dtype)
