"""Flax nnx layers with block-sparse kernels.

    from flax import nnx
    from jax_blocksparse.nnx import BlockSparseLinear
    layer = BlockSparseLinear(256, 256, mask, block_size=32, rngs=nnx.Rngs(0))

The linen counterpart is :class:`jax_blocksparse.nn.BlockSparseDense`.
"""

from jax_blocksparse.nnx.attention import BlockSparseSelfAttention
from jax_blocksparse.nnx.conv import BlockSparseConv, BlockSparseConvTranspose
from jax_blocksparse.nnx.linear import BlockLayout, BlockSparseLinear
from jax_blocksparse.nnx.parallel import ColumnParallelLinear
from jax_blocksparse.nnx.recurrent import BlockSparseLSTM, BlockSparseLSTMCell, BlockSparseMLSTMCell

__all__ = ["BlockLayout", "BlockSparseLinear", "ColumnParallelLinear"]
__all__ += ["BlockSparseConv", "BlockSparseConvTranspose"]
__all__ += ["BlockSparseLSTM", "BlockSparseLSTMCell", "BlockSparseMLSTMCell"]
__all__ += ["BlockSparseSelfAttention"]
