"""The geometry of a block-sparse convolution primitive, and of its adjoint.

One general convolution (``lax.conv_general_dilated`` terms) covers ``bsconv``, its input
gradient and ``bsconv_transpose``. Per spatial dim, for an input of ``n`` positions, a
kernel of ``k`` taps and :class:`ConvSpec` ``(strides s, padding (lo, hi), lhs_dilation
ld, rhs_dilation d, transpose_kernel)``::

    out[o] = sum over taps t of  A(o * s + t * d - lo) @ M(t),   0 <= o < out_size
    A(j)   = a[j / ld] where ld divides j and 0 <= j / ld < n, else 0
    M(t)   = W(t), or with transpose_kernel W(k - 1 - t)^T  (all spatial dims flipped)
    out_size = (ld * (n - 1) + 1 + lo + hi - k_eff) // s + 1,  k_eff = d * (k - 1) + 1

The adjoint in ``a`` of that convolution is a convolution of the same kind
(:func:`dual`): strides and input dilation swap, the kernel flips and its channels swap
(``transpose_kernel`` toggles), ``lo' = k_eff - 1 - lo``, and ``hi'`` makes its output
exactly ``n`` positions. So the input gradient of ``bsconv`` is such a convolution, and
so is ``bsconv_transpose`` (strides 1, input dilation = its strides).
"""

from __future__ import annotations

from typing import NamedTuple

from jax import lax


class ConvSpec(NamedTuple):
    """A convolution's geometry, one entry per spatial dim (hashable: a primitive parameter)."""

    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]  # (low, high) on the lhs-dilated input
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    transpose_kernel: bool  # M(t) = W(k - 1 - t)^T: the input has the layout's K channels

    @property
    def ndim(self) -> int:
        return len(self.strides)


def effective_kernel(kernel_size, rhs_dilation) -> tuple[int, ...]:
    """The dilated kernel's extent per dim, ``d * (k - 1) + 1``."""
    return tuple((k - 1) * d + 1 for k, d in zip(kernel_size, rhs_dilation))


def output_spatial(in_spatial, kernel_size, spec: ConvSpec) -> tuple[int, ...]:
    """The output's spatial shape (0 where the padded, dilated input is shorter than the kernel)."""
    out = []
    for n, ke, (lo, hi), s, ld in zip(
        in_spatial, effective_kernel(kernel_size, spec.rhs_dilation), spec.padding, spec.strides, spec.lhs_dilation
    ):
        padded = ((n - 1) * ld + 1 if n > 0 else 0) + lo + hi
        out.append((padded - ke) // s + 1 if padded >= ke else 0)
    return tuple(out)


def dual(spec: ConvSpec, in_spatial, kernel_size) -> ConvSpec:
    """The spec of the adjoint in ``a``: a convolution of the output back to ``in_spatial``.

    Needs every ``in_spatial`` and output entry >= 1 (the ops never bind an empty one).
    """
    out = output_spatial(in_spatial, kernel_size, spec)
    padding = []
    for n, o, ke, (lo, _), s, ld in zip(
        in_spatial,
        out,
        effective_kernel(kernel_size, spec.rhs_dilation),
        spec.padding,
        spec.strides,
        spec.lhs_dilation,
    ):
        lo2 = ke - 1 - lo
        # The dual's dilated, padded input spans exactly ld * (n - 1) + k_eff positions.
        hi2 = ld * (n - 1) + ke - 1 - s * (o - 1) - lo2
        padding.append((lo2, hi2))
    return ConvSpec(spec.lhs_dilation, tuple(padding), spec.strides, spec.rhs_dilation, not spec.transpose_kernel)


def dimension_numbers(ndim: int) -> lax.ConvDimensionNumbers:
    """NWC / HWIO / NWC dimension numbers for arrays of ``ndim`` dims (``ndim - 2`` spatial)."""
    spatial = tuple(range(1, ndim - 1))
    lhs = (0, ndim - 1) + spatial
    rhs = (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
    return lax.ConvDimensionNumbers(lhs, rhs, lhs)
