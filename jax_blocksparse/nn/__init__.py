"""Flax linen layers with block-sparse kernels.

    import jax_blocksparse as jbs
    layer = jbs.nn.BlockSparseDense(features=256, mask=mask, block_size=32)

The nnx counterpart is :class:`jax_blocksparse.nnx.BlockSparseLinear`.
"""

from jax_blocksparse.nn._common import StaticMask
from jax_blocksparse.nn.dense import BlockSparseDense

__all__ = ["BlockSparseDense", "StaticMask"]
