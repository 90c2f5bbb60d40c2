"""The probed layout: dense block gradients of a block-sparse product, on request.

RigL grows the blocks where the gradient of the loss with respect to the *whole*
weight is largest; sparse momentum grows where its momentum is. For a block-sparse
product ``y = x @ W`` that gradient is ``x.T @ dy`` at every block of the grid:
``jbs.bsmm_updat(x, dy, Layout.dense(grid, bs))``. It is only needed at layout
updates, so a layer computes it on request only:

* :func:`jax_blocksparse.training.dense_grads` replaces each
  :class:`~jax_blocksparse.Layout` handed to the model by a :class:`ProbedLayout`: the
  layout plus a zero "probe" of shape [CB * KB, bs, bs] (every block of the grid, in
  the dense layout's storage order).
* A layer that finds a :class:`ProbedLayout` adds :func:`probe_product` ``(x, probe)``
  to its output (:func:`linear` does both). Its value is zero and costs nothing in the
  forward pass; its gradient with respect to the probe is
  ``bsmm_updat(x, dy, dense_layout)``, the dense block gradient. The rest of the
  forward and backward pass stays block-sparse (``bsmm`` with the layer's own layout).

This module is the op half of the trick (what a layer calls); the training half
(:func:`~jax_blocksparse.training.dense_grads`) lives in
:mod:`jax_blocksparse.training.probe`, which re-exports these names.

Example::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.ops.probe import ProbedLayout, linear
    >>> layout = jbs.Layout.from_mask(jnp.eye(2, dtype=bool), 8)      # [16, 16], 2 blocks
    >>> x, w = jnp.ones((3, 16)), jnp.ones(layout.w_shape)
    >>> probe = jnp.zeros((4, 8, 8))                                 # CB * KB = 4 blocks
    >>> g = jax.grad(lambda p: linear(x, w, ProbedLayout(layout, p)).sum())(probe)
    >>> g.shape, float(g[0, 0, 0])                                   # x.T @ ones, per block
    ((4, 8, 8), 3.0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_blocksparse import config
from jax_blocksparse.layout import Layout
from jax_blocksparse.ops._checks import canonical_precision
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

__all__ = ["ProbedLayout", "dense_grid_blocks", "linear", "probe_product", "unwrap"]


@jax.tree_util.register_pytree_node_class
class ProbedLayout:
    """A :class:`~jax_blocksparse.Layout` plus a zero probe [CB * KB, bs, bs] (float32)."""

    __slots__ = ("layout", "probe")

    def __init__(self, layout: Layout, probe):
        self.layout = layout
        self.probe = probe

    def tree_flatten(self):
        return (self.layout, self.probe), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    def __repr__(self):
        return f"ProbedLayout({self.layout!r})"


def unwrap(layout_like):
    """(layout, probe or None) from a Layout or a ProbedLayout."""
    if isinstance(layout_like, ProbedLayout):
        return layout_like.layout, layout_like.probe
    return layout_like, None


def dense_grid_blocks(grid, block_size) -> tuple[int, int, int]:
    """Shape of the probe of a layout: (CB * KB, bs, bs)."""
    return (grid[0] * grid[1], block_size, block_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def probe_product(x, probe, grid, block_size, precision=None, impl=None):
    """Zero [..., K], whose gradient w.r.t. ``probe`` is the dense block gradient.

    ``probe_product(x, P, grid, bs) == x @ to_dense(P, dense_layout)`` for ``P == 0``
    (which is what :func:`~jax_blocksparse.training.dense_grads` passes): its value
    is zero and it is not computed; its gradient with respect to ``P`` is
    ``bsmm_updat(x, dy, Layout.dense(grid, bs))`` and with respect to ``x`` it is
    ``dy @ P.T == 0``.

    Args:
      x: [..., C] with ``C = grid[0] * block_size``.
      probe: [CB * KB, bs, bs] (its values are not read).
      grid: the block grid (CB, KB), static.
      block_size: the block edge, static.
      precision, impl: the ``bsmm_updat`` of the gradient's (static, hashable; None:
        the defaults read when the gradient is traced).
    """
    del probe, precision, impl
    return jnp.zeros(x.shape[:-1] + (grid[1] * block_size,), x.dtype)


def _probe_fwd(x, probe, grid, block_size, precision, impl):
    return probe_product(x, probe, grid, block_size, precision, impl), (x, jnp.zeros((), probe.dtype))


def _probe_bwd(grid, block_size, precision, impl, residuals, dy):
    x, probe_zero = residuals
    with jax.ensure_compile_time_eval():
        dense = Layout.dense(tuple(grid), block_size)
    d_probe = bsmm_updat(x, dy.astype(x.dtype), dense, out_dtype=probe_zero.dtype, precision=precision, impl=impl)
    return jnp.zeros_like(x), d_probe


probe_product.defvjp(_probe_fwd, _probe_bwd)


def linear(
    inputs,
    kernel,
    layout_like,
    bias=None,
    compute_dtype=None,
    float32_dw: bool = False,
    *,
    precision=None,
    impl: str | None = None,
):
    """``bsmm(inputs, kernel, layout) + bias``, plus the probe term for a ProbedLayout.

    Args:
      inputs: [..., C].
      kernel: [capacity, bs, bs] for the layout.
      layout_like: a :class:`~jax_blocksparse.Layout` or a :class:`ProbedLayout`.
      bias: None or [K].
      compute_dtype, float32_dw: passed to :func:`~jax_blocksparse.bsmm`.
      precision, impl: passed to :func:`~jax_blocksparse.bsmm` and to the probe's
        ``bsmm_updat``; None reads the defaults now (at trace time), as the ops do.

    Returns:
      [..., K].
    """
    layout, probe = unwrap(layout_like)
    # Resolved here, so the probe's gradient runs as the forward product was traced.
    precision, impl = canonical_precision(precision), config.canonical_impl(impl)
    y = bsmm(inputs, kernel, layout, compute_dtype=compute_dtype, float32_dw=float32_dw, precision=precision, impl=impl)
    if probe is not None:
        y = y + probe_product(inputs, probe, layout.grid, layout.block_size, precision, impl).astype(y.dtype)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y
