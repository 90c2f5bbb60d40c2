"""One module per op family; each reads top to bottom: public function, shape rule,
reference, primitives, abstract eval, lowerings, batching, JVP, transpose.

Besides the primitives (:mod:`.matmul`, :mod:`.conv`), functional ops built on them
live here, below the layers that call them: block-sparse attention (:mod:`.attention`,
public as ``jax_blocksparse.attention``; its block masks in :mod:`.block_mask`, its
stacked layout in :mod:`.attention_layout`), the block-sparse (m)LSTM recurrence
(:mod:`.recurrence`) and the probed layout of dynamic sparse training (:mod:`.probe`).
:mod:`.paths` says which path the products take on a platform.

The ops are exported here, the products and convolutions also at the package root
(``jax_blocksparse.bsmm`` is ``jax_blocksparse.ops.bsmm``).
"""

from jax_blocksparse.ops.attention import (
    BlockMask,
    block_mask_from_segments,
    blocksparse_attention,
    blocksparse_decode,
    create_block_mask,
)
from jax_blocksparse.ops.conv import (
    bsconv,
    bsconv_reference,
    bsconv_transpose,
    bsconv_transpose_reference,
    conv_from_dense,
    conv_to_dense,
)
from jax_blocksparse.ops.matmul import bsmm, bsmm_reference, bsmm_updat, from_dense, to_dense
from jax_blocksparse.ops.recurrence import (
    LSTMSpec,
    LSTMStage,
    bs_lstm_sequence,
    bs_lstm_step,
    lstm_spec,
)

__all__ = [
    "BlockMask",
    "LSTMSpec",
    "LSTMStage",
    "block_mask_from_segments",
    "blocksparse_attention",
    "blocksparse_decode",
    "bs_lstm_sequence",
    "bs_lstm_step",
    "bsconv",
    "bsconv_reference",
    "bsconv_transpose",
    "bsconv_transpose_reference",
    "bsmm",
    "bsmm_reference",
    "bsmm_updat",
    "conv_from_dense",
    "conv_to_dense",
    "create_block_mask",
    "from_dense",
    "lstm_spec",
    "to_dense",
]
