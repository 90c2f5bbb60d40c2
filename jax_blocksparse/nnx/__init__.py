"""Flax nnx layers with block-sparse kernels.

    from flax import nnx
    from jax_blocksparse.nnx import BlockSparseLinear
    layer = BlockSparseLinear(256, 256, mask, block_size=32, rngs=nnx.Rngs(0))

The linen counterpart is :class:`jax_blocksparse.nn.BlockSparseDense`.
"""

from jax_blocksparse.nnx.linear import BlockSparseLinear

__all__ = ["BlockSparseLinear"]
