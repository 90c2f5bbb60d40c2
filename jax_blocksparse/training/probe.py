"""Dense block gradients at update steps, without a dense forward pass.

RigL grows the blocks where the gradient of the loss with respect to the *whole*
weight is largest; sparse momentum grows where its momentum is. For a block-sparse
layer ``y = x @ W`` that gradient is ``x.T @ dy`` at every block of the grid:
``jbs.bsmm_updat(x, dy, Layout.dense(grid, bs))``. :func:`dense_grads` computes it
for every dynamic layer of a model at once, by handing the model
:class:`ProbedLayout` s in place of its layouts; the layers' half of the trick
(:class:`ProbedLayout`, :func:`probe_product`, :func:`linear`) is the op module
:mod:`jax_blocksparse.ops.probe`, re-exported here.

``jbs.nn.BlockSparseDense`` and ``jbs.nnx.BlockSparseLinear`` in dynamic mode read
probed layouts; a custom layer calls :func:`unwrap` and :func:`probe_product` (or
:func:`linear`) the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_blocksparse.ops.probe import (
    ProbedLayout,
    dense_grid_blocks,
    linear,
    probe_product,
    unwrap,
)
from jax_blocksparse.training import _paths

__all__ = [
    "ProbedLayout",
    "dense_grads",
    "dense_grid_blocks",
    "grid_view",
    "linear",
    "probe_product",
    "probed",
    "unwrap",
    "zero_probes",
]


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
