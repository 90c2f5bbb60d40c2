"""A convolution as block-sparse products: the dense-kernel conversions, the
tap-stacked layouts and the im2col / col2im bsmm compositions.

The convolution primitives (:mod:`jax_blocksparse.ops.conv_primitives`) lower to these
compositions on "cuda", whose products are the CUDA bsmm kernels; on "cpu" they have
implicit-GEMM kernels of their own. The public entry points are in
:mod:`jax_blocksparse.ops.conv` (``bsconv``, ``bsconv_transpose``), which re-exports
``conv_to_dense`` and ``conv_from_dense``.

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
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_blocksparse.layout import Layout, LayoutTables, check_layout
from jax_blocksparse.ops.matmul import bsmm, from_dense, to_dense

# ---------------------------------------------------------------------------------
# A call's geometry and numerics
# ---------------------------------------------------------------------------------


class Geometry(NamedTuple):
    """A convolution in lax.conv_general_dilated terms, with explicit pads."""

    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]  # window strides
    pads: tuple[tuple[int, int], ...]  # on the lhs-dilated input
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    out_spatial: tuple[int, ...]


class Precision(NamedTuple):
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


def check_conv_w(op: str, w, layout: Layout) -> tuple[int, ...]:
    """Checks w is [capacity, *kernel_size, bs, bs]; returns kernel_size."""
    cap, bs = layout.capacity, layout.block_size
    shape = tuple(w.shape)
    if len(shape) < 4 or shape[0] != cap or shape[-2:] != (bs, bs) or any(k < 1 for k in shape[1:-2]):
        raise ValueError(
            f"{op}: w must have shape [capacity, *kernel_size, bs, bs] = [{cap}, *kernel_size, {bs}, {bs}] "
            f"with at least one spatial dim of size >= 1 for {layout}, got w {shape}"
        )
    return shape[1:-2]


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
    kernel_size = check_conv_w("conv_to_dense", w, layout)
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


def _tap_offsets(kernel_size):
    return list(itertools.product(*(range(k) for k in kernel_size)))


def weight_for_products(w, prec: Precision):
    """w as the products take it: float32 (master) with float32_dw, else in the compute dtype."""
    return w if prec.float32_dw else w.astype(prec.compute_dtype)


def conv_im2col(x, w, layout: Layout, g: Geometry, prec: Precision, *, transpose_kernel: bool = False):
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
        w_cols = weight_for_products(w, prec).reshape(layout.capacity * taps, bs, bs)
        w_cols = w_cols.at[source].get(unique_indices=True)
        return bsmm(cols, w_cols, stacked, transpose=True, **prec.bsmm_args())
    stacked, _ = stack_taps(layout, taps, axis=0)
    w_rows = weight_for_products(w, prec).reshape(layout.capacity * taps, bs, bs)
    return bsmm(cols, w_rows, stacked, **prec.bsmm_args())


def conv_col2im(x, w, layout: Layout, g: Geometry, prec: Precision, *, transpose_kernel: bool):
    """y = sum over taps of (x @ W_tap) added at stride ``lhs_dilation``: col2im.

    Computes ``conv_general_dilated(x, W, 1, pads, lhs_dilation, rhs_dilation)``
    (with W flipped and channel-swapped when ``transpose_kernel``) without forming
    the dilated input.
    """
    bs, taps = layout.block_size, math.prod(g.kernel_size)
    lead = x.shape[:-1]
    w = weight_for_products(w, prec)
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
