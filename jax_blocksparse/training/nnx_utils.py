"""Dynamic sparsity for Flax NNX models, in place (use inside ``nnx.jit``).

An nnx model built from :class:`jax_blocksparse.nnx.BlockSparseLinear` layers with
``dynamic=True`` keeps each layer's layout in a
:class:`jax_blocksparse.nnx.linear.BlockLayout` variable (attribute
``kernel_layout``, beside ``kernel``). These helpers split the model into params
and layouts, call the functional API and write the results back::

    @nnx.jit
    def sparsity_step(model, optimizer, step, x, y):
        grads = nnx_dense_grads(lambda m: loss(m(x), y), model)   # RigL / sparse momentum
        return nnx_update(method, step, model, optimizer, grads)  # -> LayoutChangeLog
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_blocksparse.nnx.linear import BlockLayout
from jax_blocksparse.training.probe import dense_grads


def nnx_dense_grads(loss_fn, model, *args, has_aux: bool = False):
    """Dense block gradients of ``loss_fn(model, *args)`` for every dynamic layer.

    Returns a pytree like ``nnx.state(model, BlockLayout)`` with float32
    [CB * KB, bs, bs] in place of each layout (see
    :func:`~jax_blocksparse.training.dense_grads`).
    """
    graphdef, layouts, rest = nnx.split(model, BlockLayout, ...)

    def loss_of(params, probed_layouts, *args):
        del params
        # Rebuilt here (new variables at this trace level): nnx.scan in the model refuses
        # variables created outside the transform.
        return loss_fn(nnx.merge(graphdef, probed_layouts, jax.tree.map(lambda v: v, rest)), *args)

    return dense_grads(loss_of, None, layouts, *args, has_aux=has_aux)


def nnx_update(method, step, model, optimizer=None, grads=None):
    """Updates the layouts of ``model`` in place; moves its kernels and the optimizer state.

    Args:
      method: a :class:`~jax_blocksparse.training.DynamicSparsity` method.
      step: the training step.
      model: an nnx module holding dynamic block-sparse layers.
      optimizer: an ``nnx.Optimizer`` over the model's ``nnx.Param`` (or None);
        its per-block state moves with the blocks and is reset at grown blocks.
      grads: for RigL / sparse momentum, from :func:`nnx_dense_grads`.

    Returns:
      The :class:`~jax_blocksparse.training.LayoutChangeLog`.
    """
    params = nnx.state(model, nnx.Param)
    layouts = nnx.state(model, BlockLayout)
    opt_state = nnx.state(optimizer) if optimizer is not None else None
    result = method.update(step, params, layouts, opt_state, grads)
    nnx.update(model, result.params, result.layouts)
    if optimizer is not None:
        nnx.update(optimizer, result.opt_state)
    return result.log
