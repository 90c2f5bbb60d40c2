"""One module per op family; each reads top to bottom: public function, shape rule,
reference, primitives, abstract eval, lowerings, batching, JVP, transpose.

Besides the primitives (:mod:`.matmul`, :mod:`.conv`), two functional ops built on
them live here, below the layers that call them: the block-sparse (m)LSTM recurrence
(:mod:`.recurrence`, exported below) and the probed layout of dynamic sparse
training (:mod:`.probe`).
"""

from jax_blocksparse.ops.recurrence import (
    LSTMSpec,
    LSTMStage,
    bs_lstm_sequence,
    bs_lstm_step,
    lstm_spec,
)

__all__ = ["LSTMSpec", "LSTMStage", "bs_lstm_sequence", "bs_lstm_step", "lstm_spec"]
