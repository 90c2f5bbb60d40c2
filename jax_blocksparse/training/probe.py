"""Dense block gradients at update steps, without a dense forward pass.

RigL grows the blocks where the gradient of the loss with respect to the *whole*
weight is largest; sparse momentum grows where its momentum is. For a block-sparse
layer ``y = x @ W`` that gradient is ``x.T @ dy`` at every block of the grid:
``jbs.bsmm_updat(x, dy, Layout.dense(grid, bs))``. It is only needed at layout
updates, so the layers compute it on request only:

* :func:`dense_grads` replaces each :class:`~jax_blocksparse.Layout` handed to the
  model by a :class:`ProbedLayout`: the layout plus a zero "probe" of shape
  [CB * KB, bs, bs] (every block of the grid, in the dense layout's storage order).
* A layer that finds a :class:`ProbedLayout` adds :func:`probe_product` ``(x, probe)``
  to its output. Its value is zero and costs nothing in the forward pass; its
  gradient with respect to the probe is ``bsmm_updat(x, dy, dense_layout)``, the
  dense block gradient. The rest of the forward and backward pass stays
  block-sparse (``bsmm`` with the layer's own layout).

``jbs.nn.BlockSparseDense`` and ``jbs.nnx.BlockSparseLinear`` in dynamic mode do
this; a custom layer calls :func:`unwrap` and :func:`probe_product` the same way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_blocksparse.layout import Layout
from jax_blocksparse.ops.matmul import bsmm_updat
from jax_blocksparse.training import _paths


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def probe_product(x, probe, grid, block_size):
    """Zero [..., K], whose gradient w.r.t. ``probe`` is the dense block gradient.

    ``probe_product(x, P, grid, bs) == x @ to_dense(P, dense_layout)`` for ``P == 0``
    (which is what :func:`dense_grads` passes): its value is zero and it is not
    computed; its gradient with respect to ``P`` is
    ``bsmm_updat(x, dy, Layout.dense(grid, bs))`` and with respect to ``x`` it is
    ``dy @ P.T == 0``.
    """
    del probe
    return jnp.zeros(x.shape[:-1] + (grid[1] * block_size,), x.dtype)


def _probe_fwd(x, probe, grid, block_size):
    return probe_product(x, probe, grid, block_size), (x, jnp.zeros((), probe.dtype))


def _probe_bwd(grid, block_size, residuals, dy):
    x, probe_zero = residuals
    with jax.ensure_compile_time_eval():
        dense = Layout.dense(tuple(grid), block_size)
    d_probe = bsmm_updat(x, dy.astype(x.dtype), dense, out_dtype=probe_zero.dtype)
    return jnp.zeros_like(x), d_probe


probe_product.defvjp(_probe_fwd, _probe_bwd)


def linear(inputs, kernel, layout_like, bias=None, compute_dtype=None, float32_dw: bool = False):
    """``bsmm(inputs, kernel, layout) + bias``, plus the probe term for a ProbedLayout.

    ``compute_dtype`` and ``float32_dw`` are passed to :func:`~jax_blocksparse.bsmm`.
    """
    from jax_blocksparse.ops.matmul import bsmm

    layout, probe = unwrap(layout_like)
    y = bsmm(inputs, kernel, layout, compute_dtype=compute_dtype, float32_dw=float32_dw)
    if probe is not None:
        y = y + probe_product(inputs, probe, layout.grid, layout.block_size).astype(y.dtype)
    if bias is not None:
        y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


def zero_probes(layouts):
    """A pytree like ``layouts`` with a float32 zero probe in place of each Layout."""
    return _paths.map_layouts(lambda l: jnp.zeros(dense_grid_blocks(l.grid, l.block_size), jnp.float32), layouts)


def probed(layouts, probes):
    """``layouts`` with every Layout wrapped with its probe from ``probes``."""
    return _paths.map_layouts(ProbedLayout, layouts, probes)


def dense_grads(loss_fn, params, layouts, *args, has_aux: bool = False):
    """Gradient of the loss with respect to every block of every layer's grid.

    Args:
      loss_fn: ``loss_fn(params, layouts, *args) -> scalar`` (or ``(scalar, aux)``
        with ``has_aux``), where the model reads its layouts from ``layouts`` (for
        linen: ``model.apply({"params": params, "layout": layouts}, x)``).
      params: passed through to ``loss_fn`` (not differentiated).
      layouts: pytree of :class:`~jax_blocksparse.Layout` (e.g. the "layout"
        collection).
      *args: passed through to ``loss_fn`` (the batch).

    Returns:
      A pytree like ``layouts`` holding, in place of each Layout, float32
      [CB * KB, bs, bs]: the loss gradient at every block of the grid, in the
      storage order of ``Layout.dense(grid, bs)`` (column-major over the grid; see
      :func:`grid_view`). With ``has_aux``, ``(grads, aux)``.

    Only the layers that read a :class:`ProbedLayout` (the library's layers in
    dynamic mode, or custom layers using :func:`linear`) contribute; the extra cost
    is one ``bsmm_updat`` with the full layout per layer.
    """

    def wrt_probes(probes):
        return loss_fn(params, probed(layouts, probes), *args)

    return jax.grad(wrt_probes, has_aux=has_aux)(zero_probes(layouts))


def grid_view(dense_blocks, grid):
    """[CB * KB, bs, bs] in dense storage order -> [CB, KB, bs, bs]."""
    cb, kb = grid
    bs = dense_blocks.shape[-1]
    return dense_blocks.reshape(kb, cb, bs, bs).transpose(1, 0, 2, 3)
