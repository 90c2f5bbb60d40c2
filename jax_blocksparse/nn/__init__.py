"""Flax linen layers with block-sparse kernels.

    import jax_blocksparse as jbs
    layer = jbs.nn.BlockSparseDense(features=256, mask=mask, block_size=32)

The nnx counterparts are :class:`jax_blocksparse.nnx.BlockSparseLinear` and
:class:`jax_blocksparse.nnx.ColumnParallelLinear` (model parallel, like
:class:`ColumnParallelDense`).

An existing dense model needs no rewrite: :func:`sparsify` applies an unmodified linen
module with its ``nn.Dense`` / ``nn.Conv`` layers block-sparse (a
:class:`SparsifiedModule` and converted variables), and :func:`densify` gives the dense
variables back.
"""

from jax_blocksparse.layers.common import StaticMask
from jax_blocksparse.layers.sparsify import LayerReport, SparsifyReport
from jax_blocksparse.nn.attention import BlockSparseSelfAttention
from jax_blocksparse.nn.conv import BlockSparseConv, BlockSparseConvTranspose
from jax_blocksparse.nn.dense import BlockSparseDense
from jax_blocksparse.nn.moe import BlockSparseMoE
from jax_blocksparse.nn.parallel import ColumnParallelDense
from jax_blocksparse.nn.recurrent import BlockSparseLSTM, BlockSparseLSTMCell, BlockSparseMLSTMCell
from jax_blocksparse.nn.sparsify import SparsifiedModule, densify, sparsify

__all__ = ["BlockSparseConv", "BlockSparseConvTranspose", "BlockSparseDense", "StaticMask"]
__all__ += ["BlockSparseLSTM", "BlockSparseLSTMCell", "BlockSparseMLSTMCell", "ColumnParallelDense"]
__all__ += ["BlockSparseMoE", "BlockSparseSelfAttention"]
__all__ += ["LayerReport", "SparsifiedModule", "SparsifyReport", "densify", "sparsify"]
