"""The block-sparse LSTM lowered for 'cuda': its training step calls the CUDA kernels.

No GPU is needed: ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))``
runs the 'cuda' lowering rules. Under implementation "kernels" the gradient of a
loss through ``BlockSparseLSTM`` must call ``jbs_bsmm_fprop`` (forward products),
``jbs_bsmm_bprop`` (activation gradients in the backward scan) and ``jbs_bsmm_updat``
(one weight gradient per block-sparse weight, outside the loops); under
"reference" it must call none of them.

The kernel checks skip when the extension is not built, unless
JBS_REQUIRE_KERNELS=1 (CI), where a missing extension is a failure.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import kernel_calls, require_cuda_extension
from jax_blocksparse.nn import BlockSparseLSTM, BlockSparseLSTMCell, BlockSparseMLSTMCell

TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")
BS, HB, D, B, T = 16, 4, 32, 2, 6


def _need_extension():
    require_cuda_extension()


CELLS = {
    # name -> (cell, number of block-sparse weights: recurrent stages + sparse input)
    "lstm_2steps_sparse_in": (
        BlockSparseLSTMCell(
            HB * BS, jbs.layouts.barabasi_albert(HB, 1), BS, internal_steps=2, input_mask=np.ones((D // BS, HB), bool)
        ),
        4,
    ),
    "mlstm_1step_bf16": (
        BlockSparseMLSTMCell(HB * BS, jbs.layouts.barabasi_albert(HB, 1), BS, internal_steps=1, dtype=jnp.bfloat16),
        3,
    ),
}


def _lower_grad(cell, impl):
    lstm = BlockSparseLSTM(cell)
    x = jnp.ones((B, T, D))
    params = jax.eval_shape(lstm.init, jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(lstm.apply(params, x).astype(jnp.float32) ** 2)

    # A fresh function per call: jit's trace cache does not key on the implementation.
    with jbs.config.implementation(impl):
        fun = jax.jit(lambda p, x: jax.grad(loss)(p, x))
        return fun.trace(params, x).lower(lowering_platforms=("cuda",)).as_text()


def _count(text, kernel):
    return len(re.findall(rf"@{jbs.targets.target_name(kernel)}\(", text))


@pytest.mark.parametrize("name", list(CELLS))
def test_loss_grad_calls_the_kernels(name):
    _need_extension()
    cell, weights = CELLS[name]
    text = _lower_grad(cell, "kernels")
    missing = set(TARGETS) - kernel_calls(text)
    assert not missing, f"{sorted(missing)} missing from the lowered gradient of {name}"
    # One updat call site per block-sparse weight (the backward scan has none).
    assert _count(text, "jbs_bsmm_updat") == weights


def test_reference_implementation_calls_no_kernel():
    cell, _ = CELLS["lstm_2steps_sparse_in"]
    text = _lower_grad(cell, "reference")
    assert not kernel_calls(text) & set(TARGETS)
