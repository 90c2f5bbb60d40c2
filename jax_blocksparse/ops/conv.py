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

The "cuda" path, how a convolution becomes one block-sparse matmul, is described in
:mod:`jax_blocksparse.ops.conv_im2col`, with the dense-kernel conversions.

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

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blocksparse import config
from jax_blocksparse.layout import Layout, check_layout
from jax_blocksparse.ops import conv_primitives
from jax_blocksparse.ops._checks import (
    as_float_array,
    canonical_precision,
    check_float32_dw,
    compute_dtype_of,
    out_dtype_of,
)
from jax_blocksparse.ops.conv_im2col import (
    Geometry,
    Precision,
    check_conv_w,
    conv_from_dense,
    conv_to_dense,
    weight_for_products,
)
from jax_blocksparse.ops.conv_spec import ConvSpec

__all__ = [
    "bsconv",
    "bsconv_transpose",
    "bsconv_reference",
    "bsconv_transpose_reference",
    "conv_to_dense",
    "conv_from_dense",
]

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
        "bsconv_transpose",
        x,
        w,
        layout,
        strides,
        padding,
        dilation,
        1,
        transpose=True,
        transpose_kernel=transpose_kernel,
    )
    prec = _precision("bsconv_transpose", x, w, preferred_element_type, compute_dtype, float32_dw, precision, impl)
    k_out = layout.shape[0] if transpose_kernel else layout.shape[1]
    out_shape = (x.shape[0], *g.out_spatial, k_out)
    if _is_empty(out_shape) or _is_empty(x.shape[1:-1]):
        return jnp.zeros(out_shape, prec.out_dtype)
    return _bind(x, w, layout, g, prec, transpose_kernel=bool(transpose_kernel))


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
        "bsconv_transpose_reference",
        x,
        w,
        layout,
        strides,
        padding,
        dilation,
        1,
        transpose=True,
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


def _precision(op, x, w, preferred_element_type, compute_dtype, float32_dw, precision, impl) -> Precision:
    compute = compute_dtype_of(compute_dtype, x.dtype, w.dtype)
    out_dtype = out_dtype_of(preferred_element_type, compute, name="preferred_element_type")
    return Precision(
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
    kernel_size = check_conv_w(op, w, layout)
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
    return Geometry(kernel_size, strides, pads, lhs_dilation, rhs_dilation, tuple(out_spatial))


# ---------------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------------


def _bind(x, w, layout: Layout, g: Geometry, prec: Precision, *, transpose_kernel: bool):
    """The convolution primitive (ops/conv_primitives.py) of geometry ``g``."""
    spec = ConvSpec(g.strides, g.pads, g.lhs_dilation, g.rhs_dilation, transpose_kernel)
    return conv_primitives.conv(
        x.astype(prec.compute_dtype),
        weight_for_products(w, prec),
        layout.tables,
        spec=spec,
        compute_dtype=prec.compute_dtype,
        out_dtype=prec.out_dtype,
        impl=prec.impl,
        precision=prec.precision,
    )
