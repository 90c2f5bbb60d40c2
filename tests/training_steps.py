"""Real jitted training steps through the block-sparse kernels, checked against the reference.

Each builder here returns a :class:`Problem`: a small model, its initial training state,
a few batches and a pure ``train_step(state, batch) -> (state, (loss, grads))`` (an MSE
loss, ``jax.grad``, an optax Adam update, several block-sparse layers), plus, for
dynamic sparse training, an ``update_step`` that prunes and regrows blocks.
:func:`evaluate` compiles each program once per implementation and calls it once per
step (so every compiled program runs several times: a first run, then replays with
new inputs):

1. the reference run: ``implementation("reference")`` (pure JAX), every step;
2. the kernels run: ``implementation("kernels")``, the same steps from the same state;
3. a replay: each program call of the reference run made again with the kernels'
   program on the very same inputs (no drift between the two paths).

Both compilations are made under ``jax.default_matmul_precision("highest")``: JAX's
default float32 precision on a GPU is TF32 for XLA's own dots (the reference path,
the dense layers), which the float32 kernels do not use. :func:`check` then asserts:

* every step's loss, and the final params, are finite on both paths;
* on the same inputs, each step's loss and gradients agree; over the two runs, the
  losses and the final params agree; a layout update picks the same blocks and moves
  params the same way (tolerances per model and dtype, :data:`TOLERANCES`: 3x the
  noise floor that bench/training_noise.py measures on CPU);
* the compiled kernels program calls every expected kernel (``jbs_bsmm_fprop``,
  ``jbs_bsmm_bprop``, ``jbs_bsmm_updat``, through their versioned FFI targets) and the
  reference program none.

Models (``MODELS``), each in float32 and in mixed precision (``dtype=bfloat16``,
``param_dtype=float32``), batch 16-64, hidden 256, blocks of 32 (one layer 64), GELU
activations, 4 steps:

* ``mlp``: linen MLP of three ``jbs.nn.BlockSparseDense``;
* ``mlp_nnx``: the same with ``jbs.nnx.BlockSparseLinear`` (functional nnx step);
* ``conv``: ``BlockSparseConv`` x2 (one strided) then ``BlockSparseConvTranspose``;
* ``rnn_cells``: ``BlockSparseLSTMCell`` then ``BlockSparseMLSTMCell``, each stepped by
  flax's ``nn.RNN`` over T=8, then a ``BlockSparseDense`` head;
* ``lstm_fused``: the same cells through the fused ``jbs.nn.BlockSparseLSTM``;
* ``rigl``: dynamic ``BlockSparseDense`` MLP trained with ``jbs.training.RigL``: a
  train step, and after steps 2 and 4 a layout update (dense block gradients by a
  full-layout ``bsmm_updat``, prune, regrow, optimizer state moved with its blocks).

Run as a script (the GPU tests run it in a subprocess per XLA setting and model, with
:data:`KEEP_ROUNDINGS_FLAGS`), it evaluates one model on whatever platform JAX picks and
prints one line ``JBS_TRAINING_RESULT {json}``::

    python tests/training_steps.py --model mlp [--dtypes float32,bfloat16] [--steps 4]

Only the public API of jax_blocksparse is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_blocksparse as jbs
from jax_blocksparse import training as jst

MODELS = ("mlp", "mlp_nnx", "conv", "rnn_cells", "lstm_fused", "rigl")
DTYPES = ("float32", "bfloat16")
STEPS = 4
TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")
# A convolution's kernels on CPU (ops/conv_primitives.py); on CUDA it is bsmm products.
CONV_CPU_TARGETS = ("jbs_bsconv", "jbs_bsconv_wgrad")
RESULT_MARKER = "JBS_TRAINING_RESULT "
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Smooth on purpose: with ReLU, a unit whose pre-activation is ~0 for one example is
# alive on one path and dead on the other after a rounding difference; its whole row
# of gradients then differs, and Adam turns that into +-lr steps (float32 runs drifted
# apart by 1% of the update).
ACTIVATION = nn.gelu

LEARNING_RATE = 1e-3

# Per model and compute dtype, the largest allowed (:func:`check`):
# * step_loss_err, step_grad_err: a train step of the kernels on the reference run's
#   inputs (state and batch) against the reference's outputs: |loss_k - loss_r| /
#   |loss_r|; per gradient leaf, ||g_k - g_r|| / ||g_r||.
# * loss_err: the kernels' own run against the reference run, step by step:
#   |loss_k - loss_r| / |loss_r|.
# * param_err: per parameter leaf, ||p_k - p_r|| / ||p_r - p_initial|| after the runs:
#   the difference relative to how far training moved the leaf.
# * update_param_diff (rigl): a layout update on the reference run's inputs: per
#   parameter leaf, max |p_k - p_r| / max |p_r| (0 when the same blocks move).
#
# Each is MULTIPLE times its noise floor, rounded up to two significant digits: the
# largest value of the quantity when the reference runs against itself in seven other
# summation orders (every product's contraction split in parts added in float32, six
# ways, and the native CPU kernels), measured on CPU by bench/training_noise.py
# (NOISE_FLOORS). A floor under float32's epsilon (some are 0: every order gave the same
# bits) counts as epsilon. The floors are per model: in bfloat16 the step gradients'
# range from 1.2e-4 (rigl) to 0.0146 (the recurrent models, where one product rounded to
# the other bfloat16 neighbour spreads through T = 8 steps of layer norms).
#
# Why 3: a GPU kernel is one more order (tensor-core accumulation). Over the seven CPU
# orders the recurrent models' numbers spread by up to 1.6x (step gradients) and 4.2x
# (losses, params), conv's step gradients by 3.1x. Elsewhere (the feedforward models'
# free runs and bfloat16 steps) the differences are a few flipped roundings of the same
# fragile entries: values orders of magnitude apart, the largest recurring across
# orders. The floors of four of the orders (halves, even/odd, quarters, CPU kernels) lie
# at most 1.74x below those of all seven. Two more samples: the CPU test of this file
# (tests/test_training_steps_cpu.py; XLA's optimisations off, so the elementwise math
# runs in another order too) measured up to 1.74x a floor (lstm_fused's bfloat16
# losses); the H100's float32 rnn_cells numbers (step gradients 4.94e-6, losses 3.91e-7,
# params 3.07e-4) lie at 0.87-1.03x the floors. And 3x still tells an order from a different
# computation: the reference with XLA:GPU's excess precision (see KEEP_ROUNDINGS_FLAGS;
# bench/training_noise.py's ``excess_precision``) moves the recurrent models' bfloat16
# step gradients by 3.6x and 3.7x their floors (rnn_cells 0.0531; the H100 measured
# 0.0555).
#
# Free runs in bfloat16: Adam moves every entry by about +-lr whatever its gradient's
# size, so where a small gradient differs in sign the runs' params part. For the
# recurrent models that saturates (0.43 of the update for another order, 0.55 for
# bfloat16 against float32), so 3x their floor passes any run that does not fall apart:
# their same-input gradient check is the tight one. rigl's bfloat16 losses came out
# identical (free and on the same inputs) and its params equal to float32 rounding under
# all seven orders; a GPU order that flips a rounding none of them did may exceed those
# tolerances, which would be news about that order, to be measured there.
NOISE_FLOORS = "bench/results/training_noise-cpu-2cores-2026-11-25.json"
MULTIPLE = 3
FLOAT32_EPS = 2.0**-23
TOLERANCES = {
    "float32": {
        "mlp": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 9.00e-8)
            "step_grad_err": 1.5e-6,  # 3 x 4.68e-7
            "loss_err": 3.6e-7,  # 3 x eps (floor 9.00e-8)
            "param_err": 1.9e-4,  # 3 x 6.13e-5
        },
        "mlp_nnx": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 7.53e-8)
            "step_grad_err": 1.6e-6,  # 3 x 5.15e-7
            "loss_err": 3.6e-7,  # 3 x eps (floor 7.53e-8)
            "param_err": 9.0e-5,  # 3 x 2.98e-5
        },
        "conv": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 0)
            "step_grad_err": 3.1e-6,  # 3 x 1.01e-6
            "loss_err": 3.6e-7,  # 3 x eps (floor 0)
            "param_err": 4.1e-5,  # 3 x 1.35e-5
        },
        "rnn_cells": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 9.92e-8)
            "step_grad_err": 1.5e-5,  # 3 x 4.80e-6
            "loss_err": 1.2e-6,  # 3 x 3.91e-7
            "param_err": 0.0011,  # 3 x 3.52e-4
        },
        "lstm_fused": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 9.92e-8)
            "step_grad_err": 1.6e-5,  # 3 x 5.22e-6
            "loss_err": 8.9e-7,  # 3 x 2.93e-7
            "param_err": 7.7e-4,  # 3 x 2.56e-4
        },
        "rigl": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 1.09e-7)
            "step_grad_err": 1.1e-6,  # 3 x 3.38e-7
            "loss_err": 3.6e-7,  # 3 x eps (floor 1.09e-7)
            "param_err": 1.2e-6,  # 3 x 3.72e-7
            "update_param_diff": 3.6e-7,  # 3 x eps (floor 0)
        },
    },
    "bfloat16": {
        "mlp": {
            "step_loss_err": 8.4e-6,  # 3 x 2.80e-6
            "step_grad_err": 0.0019,  # 3 x 6.23e-4
            "loss_err": 8.3e-5,  # 3 x 2.74e-5
            "param_err": 0.021,  # 3 x 0.00683
        },
        "mlp_nnx": {
            "step_loss_err": 8.6e-6,  # 3 x 2.84e-6
            "step_grad_err": 0.0024,  # 3 x 7.78e-4
            "loss_err": 2.0e-4,  # 3 x 6.52e-5
            "param_err": 0.0055,  # 3 x 0.00181
        },
        "conv": {
            "step_loss_err": 1.4e-6,  # 3 x 4.59e-7
            "step_grad_err": 0.011,  # 3 x 0.00342
            "loss_err": 2.8e-5,  # 3 x 9.15e-6
            # The split orders of the convolution's weight gradient (quarters, mod 4) move
            # the parameters after four bfloat16 steps this far; the kernels: 0.0032.
            "param_err": 0.22,  # 3 x 0.0729
        },
        "rnn_cells": {
            "step_loss_err": 1.3e-4,  # 3 x 4.11e-5
            "step_grad_err": 0.044,  # 3 x 0.0146
            "loss_err": 0.0072,  # 3 x 0.00238
            "param_err": 1.3,  # 3 x 0.43
        },
        "lstm_fused": {
            "step_loss_err": 1.1e-4,  # 3 x 3.43e-5
            "step_grad_err": 0.044,  # 3 x 0.0146
            "loss_err": 0.0086,  # 3 x 0.00284
            "param_err": 1.3,  # 3 x 0.427
        },
        "rigl": {
            "step_loss_err": 3.6e-7,  # 3 x eps (floor 0)
            "step_grad_err": 3.7e-4,  # 3 x 1.21e-4
            "loss_err": 3.6e-7,  # 3 x eps (floor 0)
            "param_err": 6.3e-7,  # 3 x 2.09e-7
            "update_param_diff": 3.6e-7,  # 3 x eps (floor 0)
        },
    },
}


def tolerances(model: str, dtype: str) -> dict:
    """:data:`TOLERANCES` of ``model`` (one of :data:`MODELS`) in ``dtype`` (one of :data:`DTYPES`)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if model not in TOLERANCES[dtype]:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    return TOLERANCES[dtype][model]


# ---------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    """One model's training loop: initial state, batches, and the pure step functions.

    ``train_step(state, batch) -> (state, (loss, grads))``; ``update_step(state, batch,
    step) -> state`` runs after training step ``i`` (1-based) when ``is_update_step(i)``.
    ``targets`` maps each program ("train", "update") to the custom calls its compiled
    kernels version must contain.
    """

    name: str
    dtype: str
    state: Any
    batches: list
    train_step: Callable
    update_step: Callable | None = None
    is_update_step: Callable[[int], bool] = lambda i: False
    targets: dict = dataclasses.field(default_factory=lambda: {"train": TARGETS})


def _compute_dtype(dtype: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]


def _batches(x_shape, y_shape, steps, seed=0):
    """``steps`` (x, y) float32 standard-normal batches (numpy: no compile); y is one
    fixed random target for all steps, scaled by 0.5."""
    rng = np.random.default_rng(seed)
    y = jnp.asarray(0.5 * rng.standard_normal(y_shape, np.float32))
    return [(jnp.asarray(rng.standard_normal(x_shape, np.float32)), y) for _ in range(steps)]


def _mask(rows: str) -> np.ndarray:
    """bool [n, n] block mask from its rows of 0s and 1s, separated by spaces."""
    return np.array([[ch == "1" for ch in row] for row in rows.split()], bool)


# The models' small-world masks (Barabasi-Albert graphs of 8 nodes with self-loops,
# m = 2; m = 1 for the mLSTM), written out: the noise floors (NOISE_FLOORS) hold for
# these problems, so they must not move with a graph generator's random stream.
MASKS = {
    "mlp": _mask("11111100 11000000 10110000 10111101 10011010 10010110 00001111 00010011"),
    "mlp_nnx": _mask("11111110 11010000 10100000 11011101 10011000 10010111 10000110 00010101"),
    "lstm": _mask("11101100 11011010 10110100 01110000 11001001 10100111 01000110 00001101"),
    "mlstm": _mask("11100100 11000000 10111010 00110000 00101001 10000100 00100010 00001001"),
}


def _mse(pred, target):
    return jnp.mean((pred.astype(jnp.float32) - target) ** 2)


def _adam():
    return optax.adam(LEARNING_RATE)


def _linen_problem(name, dtype, model, batches, targets=None) -> Problem:
    """A linen model trained on MSE with Adam: state = (params, opt_state)."""
    tx = _adam()
    params = jax.jit(model.init)(jax.random.key(0), batches[0][0])["params"]

    def loss_fn(params, batch):
        x, y = batch
        return _mse(model.apply({"params": params}, x), y)

    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, grads)

    problem = Problem(name, dtype, (params, tx.init(params)), batches, train_step)
    if targets is not None:
        problem.targets = targets
    return problem


class _MLP(nn.Module):
    """256 -> 256 -> 256 -> 128: BlockSparseDense layers with GELU between."""

    dtype: Any

    @nn.compact
    def __call__(self, x):
        mask = MASKS["mlp"]
        x = ACTIVATION(jbs.nn.BlockSparseDense(256, mask, 32, dtype=self.dtype)(x))
        # float32_dw: the weight gradient straight from the float32 accumulator (16-bit only).
        f32_dw = self.dtype != jnp.float32
        x = ACTIVATION(
            jbs.nn.BlockSparseDense(
                256, jbs.layouts.random((8, 8), 0.4, seed=1), 32, dtype=self.dtype, float32_dw=f32_dw
            )(x)
        )
        return jbs.nn.BlockSparseDense(128, jbs.layouts.random((4, 2), 0.6, seed=2), 64, dtype=self.dtype)(x)


def build_mlp(dtype: str, steps: int = STEPS) -> Problem:
    """Linen MLP, x [64, 256] -> 256 -> 256 -> 128 (MSE to a random target).

    Three ``BlockSparseDense``: Barabasi-Albert [8, 8] blocks of 32, random [8, 8] blocks
    of 32 at 40% (``float32_dw`` in mixed precision), random [4, 2] blocks of 64 at 60%.
    Params float32; compute ``dtype``.
    """
    model = _MLP(_compute_dtype(dtype))
    return _linen_problem("mlp", dtype, model, _batches((64, 256), (64, 128), steps))


class _NnxMLP(nnx.Module):
    """256 -> 256 -> 256 -> 128: BlockSparseLinear layers with GELU between."""

    def __init__(self, dtype, rngs: nnx.Rngs):
        f32_dw = dtype != jnp.float32
        self.l1 = jbs.nnx.BlockSparseLinear(256, 256, MASKS["mlp_nnx"], 32, dtype=dtype, rngs=rngs)
        self.l2 = jbs.nnx.BlockSparseLinear(
            256, 256, jbs.layouts.random((8, 8), 0.4, seed=4), 32, dtype=dtype, float32_dw=f32_dw, rngs=rngs
        )
        self.l3 = jbs.nnx.BlockSparseLinear(
            256, 128, jbs.layouts.random((4, 2), 0.6, seed=5), 64, dtype=dtype, rngs=rngs
        )

    def __call__(self, x):
        return self.l3(ACTIVATION(self.l2(ACTIVATION(self.l1(x)))))


def build_mlp_nnx(dtype: str, steps: int = STEPS) -> Problem:
    """NNX MLP, x [64, 256] -> 256 -> 256 -> 128, three ``jbs.nnx.BlockSparseLinear``.

    Same shapes and dtypes as :func:`build_mlp`. The step is functional
    (``nnx.split`` / ``nnx.merge`` around ``jax.grad``), so it is a plain ``jax.jit``
    program: state = (nnx.Param state, opt_state).
    """
    model = _NnxMLP(_compute_dtype(dtype), nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = _adam()

    def loss_fn(params, batch):
        x, y = batch
        return _mse(nnx.merge(graphdef, params, rest)(x), y)

    def train_step(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), (loss, grads)

    batches = _batches((64, 256), (64, 128), steps, seed=10)
    return Problem("mlp_nnx", dtype, (params, tx.init(params)), batches, train_step)


class _ConvNet(nn.Module):
    """[B, 8, 8, 64] -> conv 3x3 128 -> conv 3x3/2 128 -> conv-transpose 3x3/2 64."""

    dtype: Any

    @nn.compact
    def __call__(self, x):
        x = ACTIVATION(
            jbs.nn.BlockSparseConv(128, (3, 3), jbs.layouts.random((2, 4), 0.5, seed=6), 32, dtype=self.dtype)(x)
        )
        x = ACTIVATION(
            jbs.nn.BlockSparseConv(
                128, (3, 3), jbs.layouts.random((4, 4), 0.5, seed=7), 32, strides=2, dtype=self.dtype
            )(x)
        )
        return jbs.nn.BlockSparseConvTranspose(
            64, (3, 3), jbs.layouts.random((4, 2), 0.5, seed=8), 32, strides=2, dtype=self.dtype
        )(x)


def build_conv(dtype: str, steps: int = STEPS) -> Problem:
    """Conv net on x [16, 8, 8, 64] (NHWC) -> [16, 8, 8, 64], MSE to a random target.

    ``BlockSparseConv`` 64 -> 128 (3x3, SAME), ``BlockSparseConv`` 128 -> 128 (3x3,
    stride 2), ``BlockSparseConvTranspose`` 128 -> 64 (3x3, stride 2); random block
    masks at 50%, blocks of 32. Params float32; compute ``dtype``.
    """
    model = _ConvNet(_compute_dtype(dtype))
    targets = {"train": CONV_CPU_TARGETS if jax.default_backend() == "cpu" else TARGETS}
    return _linen_problem("conv", dtype, model, _batches((16, 8, 8, 64), (16, 8, 8, 64), steps, seed=20), targets)


class _Recurrent(nn.Module):
    """x [B, T, 64] -> LSTM 256 -> mLSTM 256 -> BlockSparseDense head 64, per timestep."""

    dtype: Any
    fused: bool

    @nn.compact
    def __call__(self, x):
        lstm = jbs.nn.BlockSparseLSTMCell(
            256,
            MASKS["lstm"],
            32,
            internal_steps=1,
            internal_activation=ACTIVATION,
            dtype=self.dtype,
        )
        mlstm = jbs.nn.BlockSparseMLSTMCell(
            256,
            MASKS["mlstm"],
            32,
            internal_steps=1,
            input_mask=jbs.layouts.random((8, 8), 0.5, seed=11),
            internal_activation=ACTIVATION,
            dtype=self.dtype,
        )
        wrap = jbs.nn.BlockSparseLSTM if self.fused else nn.RNN
        x = wrap(lstm)(x)
        x = wrap(mlstm)(x)
        return jbs.nn.BlockSparseDense(64, jbs.layouts.random((8, 2), 0.5, seed=12), 32, dtype=self.dtype)(x)


def _build_recurrent(name, fused, dtype, steps):
    model = _Recurrent(_compute_dtype(dtype), fused)
    return _linen_problem(name, dtype, model, _batches((32, 8, 64), (32, 8, 64), steps, seed=30))


def build_rnn_cells(dtype: str, steps: int = STEPS) -> Problem:
    """Two recurrent layers stepped by flax's ``nn.RNN`` (a ``lax.scan`` of the cell).

    x [32, T=8, 64] -> ``BlockSparseLSTMCell`` (hidden 256, Barabasi-Albert [8, 8]
    blocks of 32, one internal step, dense input projection) -> ``BlockSparseMLSTMCell``
    (hidden 256, one internal step, block-sparse input projection at 50%) ->
    ``BlockSparseDense`` 256 -> 64; MSE over all timesteps. Params float32; products in
    ``dtype`` (cell state and elementwise math float32).
    """
    return _build_recurrent("rnn_cells", False, dtype, steps)


def build_lstm_fused(dtype: str, steps: int = STEPS) -> Problem:
    """The model of :func:`build_rnn_cells` with each cell run by the fused
    ``jbs.nn.BlockSparseLSTM`` (input projection in one product, one ``bsmm_updat`` per
    recurrent weight over the whole sequence)."""
    return _build_recurrent("lstm_fused", True, dtype, steps)


RIGL_SHAPES = {"layer0": (128, 256), "layer1": (256, 256), "layer2": (256, 64)}


class _DynamicMLP(nn.Module):
    """GELU MLP of dynamic BlockSparseDense layers (layouts in the "layout" collection)."""

    plan: dict
    dtype: Any

    @nn.compact
    def __call__(self, x):
        for i, (name, (_, features)) in enumerate(RIGL_SHAPES.items()):
            p = self.plan[name]
            x = jbs.nn.BlockSparseDense(
                features, p.mask, 32, capacity=p.capacity, dynamic=True, dtype=self.dtype, name=name
            )(x)
            if i < len(RIGL_SHAPES) - 1:
                x = ACTIVATION(x)
        return x


def build_rigl(dtype: str, steps: int = STEPS) -> Problem:
    """Dynamic sparse training with RigL: MLP 128 -> 256 -> 256 -> 64, blocks of 32.

    Three dynamic ``BlockSparseDense`` (ERK budget, global density 0.3; layouts are data
    in the "layout" collection). ``train_step``: MSE loss, grad, Adam on x [64, 128].
    ``update_step`` after steps 2 and 4 (``RigL(update_every=2, total_steps=2 *
    steps)``): dense block gradients from ``jst.dense_grads`` (a full-layout
    ``bsmm_updat`` per layer), then ``RigL.update`` drops the weakest 30% (cosine
    annealed) of each layer's blocks and grows as many where the dense gradient is
    largest, moving params and Adam state with their blocks. state = (params, layouts,
    opt_state). Params float32; compute ``dtype``.
    """
    method = jst.RigL(density=0.3, total_steps=2 * steps, update_every=2, drop_fraction=0.3, seed=0)
    plan = method.plan(RIGL_SHAPES, 32)
    model = _DynamicMLP(plan, _compute_dtype(dtype))
    tx = _adam()
    batches = _batches((64, 128), (64, 64), steps, seed=40)
    variables = jax.jit(model.init)(jax.random.key(0), batches[0][0])
    params, layouts = variables["params"], variables["layout"]

    def loss_fn(params, layouts, x, y):
        return _mse(model.apply({"params": params, "layout": layouts}, x), y)

    def train_step(state, batch):
        params, layouts, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, layouts, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), layouts, opt_state), (loss, grads)

    def update_step(state, batch, step):
        params, layouts, opt_state = state
        dense = jst.dense_grads(loss_fn, params, layouts, *batch)
        params, layouts, opt_state, _ = method.update(step, params, layouts, opt_state, dense)
        return params, layouts, opt_state

    # The update's dense gradients: a block-sparse forward (fprop), activation gradients
    # back through the layers (bprop) and the probes' full-layout updat.
    return Problem(
        "rigl",
        dtype,
        (params, layouts, tx.init(params)),
        batches,
        train_step,
        update_step,
        method.is_update_step,
        {"train": TARGETS, "update": TARGETS},
    )


BUILDERS = {
    "mlp": build_mlp,
    "mlp_nnx": build_mlp_nnx,
    "conv": build_conv,
    "rnn_cells": build_rnn_cells,
    "lstm_fused": build_lstm_fused,
    "rigl": build_rigl,
}


def build(name: str, dtype: str, steps: int = STEPS) -> Problem:
    """The :class:`Problem` of model ``name`` (one of MODELS) in ``dtype`` (one of DTYPES)."""
    return BUILDERS[name](dtype, steps)


# ---------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------


def compile_programs(problem: Problem, impl: str) -> dict:
    """The problem's programs ("train", and "update" if any), lowered under
    ``implementation(impl)`` and ``default_matmul_precision("highest")``, compiled."""
    state, batch = problem.state, problem.batches[0]
    with jbs.config.implementation(impl), jax.default_matmul_precision("highest"):
        programs = {"train": jax.jit(problem.train_step).lower(state, batch).compile()}
        if problem.update_step is not None:
            step = jnp.asarray(1, jnp.int32)
            programs["update"] = jax.jit(problem.update_step).lower(state, batch, step).compile()
    return programs


@dataclasses.dataclass
class Run:
    """A training run: per-step losses, the final state, and every program call
    ``(program, args, outputs)`` in order."""

    losses: list
    state: Any
    calls: list
    seconds: float


def run(problem: Problem, programs: dict) -> Run:
    """Runs every training step (and the update steps) with the compiled ``programs``."""
    t0 = time.perf_counter()
    state, losses, calls = problem.state, [], []
    for i, batch in enumerate(problem.batches, start=1):
        args = (state, batch)
        state, (loss, grads) = programs["train"](*args)
        losses.append(float(loss))  # waits for the step: an execution error surfaces here
        calls.append(("train", args, (loss, grads)))
        if "update" in programs and problem.is_update_step(i):
            args = (state, batch, jnp.asarray(i, jnp.int32))
            state = programs["update"](*args)
            calls.append(("update", args, state))
    jax.block_until_ready(state)
    return Run(losses, state, calls, time.perf_counter() - t0)


def _floats(tree) -> list[np.ndarray]:
    return [
        np.asarray(leaf, np.float64)
        for leaf in jax.tree.leaves(tree)
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating)
    ]


def _ratio(num, den) -> float:
    """num / den for num, den >= 0: 0 when num is 0, inf when only den is."""
    return float(num / den) if den > 0 else (0.0 if num == 0 else math.inf)


def _rel(a, b) -> float:
    """|a - b| / |b|."""
    return _ratio(abs(a - b), abs(b))


def _worst(values) -> float:
    """The largest of ``values``, NaN if any is NaN (Python's max may skip a NaN)."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def _masks(layouts) -> list[np.ndarray]:
    return [np.asarray(layout.mask) for _, layout in jst.named_layouts(layouts)]


def _same_masks(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(_masks(a), _masks(b)))


def replay(problem: Problem, programs: dict, reference: Run) -> dict:
    """Each program call of the reference run made again with ``programs`` on the same
    inputs (teacher forcing: no drift between the paths). Per train step: the loss's
    relative difference and, per gradient leaf, ||g - g_ref|| / ||g_ref||; per update
    step: whether the same layouts came out and, per parameter leaf, max |p - p_ref| /
    max |p_ref| (0 when the same blocks move: the update only moves and zeroes blocks)."""
    step_loss, step_grads, update_layouts, update_params = [], [], [], []
    for program, args, want in reference.calls:
        got = programs[program](*args)
        if program == "train":
            (_, (loss, grads)), (want_loss, want_grads) = got, want
            step_loss.append(_rel(float(loss), float(want_loss)))
            pairs = zip(_floats(grads), _floats(want_grads))
            step_grads.append(_worst(_ratio(np.linalg.norm(g - w), np.linalg.norm(w)) for g, w in pairs))
        else:
            update_layouts.append(_same_masks(got[1], want[1]))
            pairs = zip(_floats(got[0]), _floats(want[0]))
            update_params.append(_worst(_ratio(np.max(np.abs(g - w)), np.max(np.abs(w))) for g, w in pairs))
    out = {"step_loss_err": _worst(step_loss), "step_grad_err": _worst(step_grads)}
    if update_layouts:
        out["update_layouts_equal"] = all(update_layouts)
        out["update_param_diff"] = _worst(update_params)
    return out


_LIBRARY_TARGET = 'custom_call_target="' + jbs.targets.PREFIX


def _custom_calls(hlo_text: str) -> list[str]:
    """The kernels (short names) whose FFI targets compiled HLO text calls, sorted, without repeats."""
    found = re.findall(re.escape(_LIBRARY_TARGET) + r'(\w+)"', hlo_text)
    return sorted({jbs.targets.kernel_of(jbs.targets.PREFIX + t) or t for t in found})


def command_buffer_calls(hlo_text: str) -> dict:
    """What compiled (GPU) HLO text says about command buffers: the number of
    ``command_buffer`` computations, and of jbs custom calls inside them.

    XLA's CommandBufferScheduling pass moves the ops that it will run as a CUDA graph
    into computations named ``command_buffer``, ``command_buffer.1``, ... called from
    the entry computation. (An XLA that forms command buffers elsewhere, from the
    thunks, shows none here.)
    """
    computations = inside = 0
    current = ""
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current = header.group(1)
            computations += current.startswith("command_buffer")
        elif current.startswith("command_buffer") and _LIBRARY_TARGET in line:
            inside += 1
    return {"computations": computations, "jbs_calls_inside": inside}


def compare(problem: Problem, kernels: Run, reference: Run) -> dict:
    """Numbers for :func:`check` from the two free-running runs: losses, their largest
    relative difference, and the final parameters' difference relative to how far
    training moved them (per leaf, the largest)."""
    lk, lr = np.asarray(kernels.losses), np.asarray(reference.losses)
    p0, pk, pr = (_floats(s[0]) for s in (problem.state, kernels.state, reference.state))
    param_err = _worst(_ratio(np.linalg.norm(a - b), np.linalg.norm(b - c)) for a, b, c in zip(pk, pr, p0))
    out = {
        "losses_kernels": lk.tolist(),
        "losses_reference": lr.tolist(),
        "all_finite": bool(
            np.all(np.isfinite(lk)) and np.all(np.isfinite(lr)) and all(np.all(np.isfinite(p)) for p in pk + pr)
        ),
        "loss_err": _worst(_rel(a, b) for a, b in zip(lk, lr)),
        "param_err": param_err,
    }
    if problem.update_step is not None:  # dynamic layouts: both paths must choose the same blocks
        out["layouts_equal"] = _same_masks(kernels.state[1], reference.state[1])
        out["layouts_changed"] = not _same_masks(reference.state[1], problem.state[1])
    return out


def evaluate(
    name: str, dtype: str, steps: int = STEPS, progress: dict | None = None, log: Callable[[str], None] | None = None
) -> dict:
    """Model ``name`` in ``dtype``: ``steps`` steps on the reference path, the same steps
    on the kernels, then the reference's program calls replayed on the kernels; returns
    the numbers that :func:`check` judges. ``progress["phase"]`` says how far it got
    ("build", "reference", "kernels", "replay", "done") if it raises; ``log`` is called
    with a line as each phase starts."""
    progress = {} if progress is None else progress

    def phase(value):
        progress["phase"] = value
        if log is not None:
            log(f"{name} {dtype}: {value}")

    phase("build")
    problem = build(name, dtype, steps)
    phase("reference")
    t0 = time.perf_counter()
    ref_programs = compile_programs(problem, "reference")
    reference = run(problem, ref_programs)
    t1 = time.perf_counter()
    phase("kernels")
    programs = compile_programs(problem, "kernels")
    kernels = run(problem, programs)
    phase("replay")
    replayed = replay(problem, programs, reference)
    t2 = time.perf_counter()
    result = {"model": name, "dtype": dtype, "steps": steps, "platform": jax.devices()[0].platform}
    result.update(compare(problem, kernels, reference))
    result.update(replayed)
    hlo = {k: p.as_text() for k, p in programs.items()}
    result["expected_calls"] = {k: list(v) for k, v in problem.targets.items()}
    result["kernels_calls"] = {k: _custom_calls(t) for k, t in hlo.items()}
    result["reference_calls"] = {k: _custom_calls(p.as_text()) for k, p in ref_programs.items()}
    result["command_buffers"] = {k: command_buffer_calls(t) for k, t in hlo.items()}
    # Compile and run: the reference's, then the kernels' (with the replay).
    result["seconds"] = {"reference": round(t1 - t0, 3), "kernels": round(t2 - t1, 3)}
    phase("done")
    return result


def check(result: dict) -> list[str]:
    """What is wrong with an :func:`evaluate` result (empty when it passes)."""
    tol = tolerances(result["model"], result["dtype"])
    where = f"{result['model']} {result['dtype']}"
    errors = []
    if not result["all_finite"]:
        errors.append(
            f"{where}: non-finite loss or params: kernels {result['losses_kernels']}, "
            f"reference {result['losses_reference']}"
        )
    limits = (
        ("step_loss_err", "a step's loss on the same inputs differs by {:.3g} (relative)"),
        ("step_grad_err", "a step's gradients on the same inputs differ by {:.3g} (relative norm)"),
        ("loss_err", "the runs' losses differ by {:.3g} (relative)"),
        ("param_err", "the runs' final params differ by {:.3g} of the training update"),
    )
    for key, message in limits:
        if not result[key] <= tol[key]:  # also catches NaN
            errors.append(
                f"{where}: {message.format(result[key])} > {tol[key]}; kernels losses "
                f"{result['losses_kernels']}, reference {result['losses_reference']}"
            )
    for program, expected in result["expected_calls"].items():
        have = result["kernels_calls"].get(program, [])
        missing = sorted(set(expected) - set(have))
        if missing:
            errors.append(f"{where}: the compiled {program} program under 'kernels' lacks {missing} (has {have})")
        if result["reference_calls"].get(program):
            errors.append(
                f"{where}: the compiled {program} program under 'reference' calls {result['reference_calls'][program]}"
            )
    if "layouts_equal" in result:
        if not (result["layouts_equal"] and result["update_layouts_equal"]):
            errors.append(
                f"{where}: the kernels and the reference chose different layouts "
                f"(free run: {result['layouts_equal']}, same inputs: {result['update_layouts_equal']})"
            )
        if not result["layouts_changed"]:
            errors.append(f"{where}: the layout updates changed no layout")
        if not result["update_param_diff"] <= tol["update_param_diff"]:
            errors.append(
                f"{where}: a layout update on the same inputs moved params differently "
                f"(largest difference {result['update_param_diff']:.3g} of the largest param)"
            )
    return errors


# ---------------------------------------------------------------------------------
# XLA settings and the child process
# ---------------------------------------------------------------------------------

# Command types of ``--xla_gpu_enable_command_buffer`` (XLA's
# DebugOptions.CommandBufferCmdType, xla/xla.proto): those of jaxlib 0.10's XLA, and
# DYNAMIC_SLICE_COPY_FUSION of some earlier ones. XLA aborts on a name it does not know,
# so :func:`command_buffer_types` keeps only those the installed jaxlib accepts. A type
# added by a newer XLA is captured only once it is listed here.
KNOWN_COMMAND_BUFFER_TYPES = (
    "FUSION",
    "CUBLAS",
    "CUBLASLT",
    "CUSTOM_CALL",
    "CUDNN",
    "COLLECTIVES",
    "CONDITIONAL",
    "WHILE",
    "DYNAMIC_SLICE_FUSION",
    "DYNAMIC_SLICE_COPY_FUSION",
    "CONVOLUTION",
)


@functools.cache
def command_buffer_types() -> tuple[str, ...]:
    """The command types of :data:`KNOWN_COMMAND_BUFFER_TYPES` that the installed XLA
    accepts in ``--xla_gpu_enable_command_buffer``.

    Checked by starting JAX's CPU backend in a subprocess with the flag (it parses every
    XLA flag; the CUDA plugin is built from the same XLA): a rejected name ("Illegal
    value for --xla_gpu_enable_command_buffer 'NAME'") is dropped and the rest tried again.
    """
    names = list(KNOWN_COMMAND_BUFFER_TYPES)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    while names:
        env["XLA_FLAGS"] = "--xla_gpu_enable_command_buffer=" + ",".join(names)
        proc = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices('cpu')"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode == 0:
            return tuple(names)
        bad = re.search(r"Illegal value for --xla_gpu_enable_command_buffer '(\w+)'", proc.stderr)
        if not bad or bad.group(1) not in names:
            raise RuntimeError(f"XLA rejected {env['XLA_FLAGS']!r}:\n{proc.stderr[-3000:]}")
        names.remove(bad.group(1))
    return ()


#: XLA flags of every child process, whatever the setting. XLA:GPU's default
#: ``--xla_allow_excess_precision=true`` lets its SimplifyFPConversions pass delete any
#: f32 -> bf16 -> f32 round trip: a reference product's float32 accumulation, cast to
#: bfloat16 and widened again by the next op, then reaches that op unrounded, while the
#: kernels' custom calls hand over bfloat16. The bfloat16 check would then compare
#: rounded products against unrounded ones, not two summation orders of one program
#: (bench/training_noise.py emulates that pass on CPU: ``excess_precision``). The flag
#: makes XLA keep every rounding the program asks for, on any backend (tests/helpers.py's
#: KEEP_ROUNDINGS_FLAG).
KEEP_ROUNDINGS_FLAGS = ("--xla_allow_excess_precision=false",)

#: The two XLA settings of the GPU tests: extra XLA_FLAGS. "default": XLA's own
#: command-buffer settings. "graphs": every command type XLA has, in graphs of any size.
SETTINGS = ("default", "graphs")


def xla_flags(setting: str) -> list[str]:
    """The XLA flags that :data:`SETTINGS` ``setting`` adds."""
    if setting == "default":
        return []
    if setting == "graphs":
        return [
            "--xla_gpu_enable_command_buffer=" + ",".join(command_buffer_types()),
            "--xla_gpu_graph_min_graph_size=1",
        ]
    raise ValueError(f"unknown setting {setting!r}")


@dataclasses.dataclass
class Child:
    """A finished child process: its exit status, output, the parsed result line (or
    None) and its wall time."""

    returncode: int
    stdout: str
    stderr: str
    result: dict | None
    seconds: float

    def describe(self, limit: int = 6000) -> str:
        """Exit status (negative: killed by that signal; -1 also on timeout), XLA's error
        and fatal log lines, and the tail of stderr, for assertion messages."""
        logged = [line for line in self.stderr.splitlines() if re.match(r"[EF]\d{4} ", line)][:20]
        text = f"child exit status {self.returncode}, {self.seconds:.1f} s"
        if logged:
            text += "; XLA errors:\n" + "\n".join(logged)
        return text + f"\nstderr tail:\n{self.stderr[-limit:]}"


def child_environment(flags=(), env: dict | None = None) -> dict:
    """The environment of a child process: ``env`` (default ``os.environ``) with
    :data:`KEEP_ROUNDINGS_FLAGS` and ``flags`` appended to XLA_FLAGS (read once, when the
    backend starts), the checkout first on PYTHONPATH, XLA_PYTHON_CLIENT_PREALLOCATE=false
    (processes share the GPU) and PYTHONUNBUFFERED=1."""
    child_env = dict(os.environ if env is None else env)
    added = [f for f in KEEP_ROUNDINGS_FLAGS + tuple(flags) if f not in child_env.get("XLA_FLAGS", "").split()]
    child_env["XLA_FLAGS"] = " ".join([child_env.get("XLA_FLAGS", "")] + added).strip()
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, child_env.get("PYTHONPATH")) if p)
    child_env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    child_env["PYTHONUNBUFFERED"] = "1"
    return child_env


def run_child(
    model: str, flags=(), *, dtypes=DTYPES, steps: int = STEPS, timeout: float = 600, env: dict | None = None
) -> Child:
    """Runs this file as a script for ``model`` in a fresh Python (``sys.executable``),
    in :func:`child_environment` of ``flags`` and ``env``."""
    child_env = child_environment(flags, env)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--model",
        model,
        "--dtypes",
        ",".join(dtypes),
        "--steps",
        str(steps),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
        code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = -1
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        err += f"\n[timed out after {timeout} s]"
    return Child(code, out, err, parse_result(out), time.perf_counter() - t0)


# ---------------------------------------------------------------------------------
# Subprocess entry point
# ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    """Evaluates one model in each dtype; prints ``JBS_TRAINING_RESULT {json}``.

    The JSON holds the platform, device, jax version, XLA_FLAGS, which kernels are
    built, and per dtype either the :func:`evaluate` numbers with ``errors``
    (:func:`check`), or ``exception`` and the ``phase`` it was raised in. The exit
    status is 0 whenever the line was printed; a crash of XLA or a kernel (abort,
    segfault) leaves no line and a non-zero status.
    """
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=MODELS, required=True)
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--steps", type=int, default=STEPS)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    out = {
        "model": args.model,
        "platform": device.platform,
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "kernels_built": {"cpu": jbs.has_cpu_kernels(), "cuda": jbs.has_cuda_kernels()},
        "results": {},
    }

    def log(line):
        print(line, file=sys.stderr, flush=True)

    for dtype in args.dtypes.split(","):
        progress = {}
        try:
            result = evaluate(args.model, dtype, args.steps, progress, log)
            result["errors"] = check(result)
        except Exception as err:  # an XLA or kernel error returned to Python
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            result = {"exception": f"{type(err).__name__}: {err}"[:4000], "phase": progress.get("phase")}
        out["results"][dtype] = result
        log(f"{args.model} {dtype}: " + ("FAILED" if result.get("errors") or "exception" in result else "ok"))
    print(RESULT_MARKER + json.dumps(out), flush=True)
    return 0


def parse_result(stdout: str) -> dict | None:
    """The JSON of the :data:`RESULT_MARKER` line in a child's stdout (None if absent)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None


if __name__ == "__main__":
    sys.exit(main())
