"""Flax nnx layers with block-sparse kernels.

    from flax import nnx
    from jax_blocksparse.nnx import BlockSparseLinear
    layer = BlockSparseLinear(256, 256, mask, block_size=32, rngs=nnx.Rngs(0))

The linen counterpart is :class:`jax_blocksparse.nn.BlockSparseDense`.

An existing dense model needs no rewrite: :func:`sparsify` returns a copy whose
``nnx.Linear`` / ``nnx.Conv`` layers are block-sparse ones holding their selected
blocks, and :func:`densify` goes back.
"""

from jax_blocksparse.layers.sparsify import LayerReport, SparsifyReport
from jax_blocksparse.nnx.attention import BlockSparseSelfAttention
from jax_blocksparse.nnx.conv import BlockSparseConv, BlockSparseConvTranspose
from jax_blocksparse.nnx.linear import (
    BlockLayout,
    BlockSparseEinsum,
    BlockSparseLinear,
    BlockSparseLinearGeneral,
    StackedLayout,
)
from jax_blocksparse.nnx.moe import BlockSparseMoE
from jax_blocksparse.nnx.parallel import ColumnParallelLinear
from jax_blocksparse.nnx.recurrent import BlockSparseLSTM, BlockSparseLSTMCell, BlockSparseMLSTMCell
from jax_blocksparse.nnx.sparsify import densify, sparsify

__all__ = [
    "BlockLayout",
    "StackedLayout",
    "BlockSparseLinear",
    "BlockSparseLinearGeneral",
    "BlockSparseEinsum",
    "ColumnParallelLinear",
]
__all__ += ["BlockSparseConv", "BlockSparseConvTranspose"]
__all__ += ["BlockSparseLSTM", "BlockSparseLSTMCell", "BlockSparseMLSTMCell"]
__all__ += ["BlockSparseMoE", "BlockSparseSelfAttention"]
__all__ += ["LayerReport", "SparsifyReport", "densify", "sparsify"]
