"""The framework-neutral core of the block-sparse layers.

The math, the parameter shapes, the initialisation and the checks of every layer live
here once; :mod:`jax_blocksparse.nn` (Flax linen) and :mod:`jax_blocksparse.nnx`
(Flax NNX) are thin siblings that declare parameters and call these modules. Nothing
here imports Flax:

* :mod:`~jax_blocksparse.layers.dense`: :class:`StaticMask`, layouts, init and the
  forward pass of the block-sparse dense layer (static or dynamic layout).
* :mod:`~jax_blocksparse.layers.conv`: the convolution and transposed convolution.
* :mod:`~jax_blocksparse.layers.parallel`: the column-parallel split over a mesh axis.
* :mod:`~jax_blocksparse.layers.recurrent`: the LSTM/mLSTM cell configuration and
  init; the recurrence itself is the op :mod:`jax_blocksparse.ops.recurrence`.
* :mod:`~jax_blocksparse.layers.budgets`: how many blocks each layer gets (uniform,
  ERK) and initial layouts; :mod:`~jax_blocksparse.layers.select`: block scores and
  top-k selection on the block grid (both re-exported by :mod:`jax_blocksparse.training`).
* :mod:`~jax_blocksparse.layers.sparsify`: turning a dense model's layers block-sparse,
  framework-neutral (what fits, the budget, the blocks, the report) under
  ``jbs.nn.sparsify`` and ``jbs.nnx.sparsify``.
* :mod:`~jax_blocksparse.layers.attribute_docs`: what each layer attribute means,
  written once; the linen and NNX docstrings are filled from it.
"""

from jax_blocksparse.layers.common import StaticMask

__all__ = ["StaticMask"]
