"""Sparsify a trained dense model in one call, fine-tune it, and compare (scikit-learn digits).

    python examples/sparsify.py                                   # the table in README: minutes on 2 CPU cores
    python examples/sparsify.py --densities 0.5 0.1 --finetune-steps 600 --block-size 16
    python examples/sparsify.py --steps 20 --finetune-steps 5 --densities 0.5 --width 16   # seconds

1. Train a dense CNN (Flax NNX) on scikit-learn's digits (8x8 grayscale images,
   1,797 of them, shipped with scikit-learn; split 75/25 stratified): three 3x3
   ``nnx.Conv`` (the first sees one input channel), a hidden ``nnx.Linear`` and a
   10-way ``nnx.Linear`` head.
2. For each density: ``jbs.nnx.sparsify(dense_model, density, block_size)`` keeps the
   blocks of largest norm of every layer that fits (the first conv, one input channel,
   and the head, 10 outputs, do not: the report lists them as left dense); measure the
   one-shot accuracy, then fine-tune ``--finetune-steps`` steps.
3. Against the same density trained from scratch: the same architecture sparsified at
   random (same per-layer block counts), its blocks redrawn with the block-sparse
   layers' own initialisation, trained for ``--steps + --finetune-steps`` steps.

Every model trains with the same optimiser (Adam), batch size and data order. Prints
the sparsify report of the densest setting, then one table row per model: parameters,
test accuracy, and the median train-step time (ms: one jitted step per model over its
split parameters, timed after training, round-robin over the models ``--time-reps``
times so that load from other processes falls on all alike). Ends with
``dense_accuracy=...``.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jax_blocksparse as jbs
from jax_blocksparse.layers import common as layer_common
from jax_blocksparse.layers import conv as conv_core
from jax_blocksparse.nnx import BlockSparseConv, BlockSparseLinear

# ---------------------------------------------------------------------------------
# Data and model
# ---------------------------------------------------------------------------------


def load_data(seed: int):
    """(x_train, x_test, y_train, y_test): images [N, 8, 8, 1] in [0, 1], int32 labels."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    return x_train, x_test, y_train.astype(np.int32), y_test.astype(np.int32)


class CNN(nnx.Module):
    """[N, 8, 8, 1] -> conv 3x3 (width) -> conv 3x3 stride 2 (2 width) -> conv 3x3 (2 width)
    -> linear (hidden) -> linear (10)."""

    def __init__(self, width: int, hidden: int, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, width, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(width, 2 * width, (3, 3), strides=2, rngs=rngs)
        self.conv3 = nnx.Conv(2 * width, 2 * width, (3, 3), rngs=rngs)
        self.fc = nnx.Linear(4 * 4 * 2 * width, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.relu(self.conv3(x))
        x = nnx.relu(self.fc(x.reshape(x.shape[0], -1)))
        return self.head(x)


def count_params(model) -> int:
    return sum(int(np.size(p)) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def fresh_blocks(model, seed: int):
    """Redraws every stored block with the block-sparse layers' own init (LeCun normal, true fan-in)."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    for _, node in nnx.iter_graph(model):
        if isinstance(node, BlockSparseLinear):
            node.kernel[...] = layer_common.init_kernel(None, next(keys), node.layout, node.mask, node.param_dtype)
        elif isinstance(node, BlockSparseConv):
            node.kernel[...] = conv_core.init_conv_kernel(
                None, next(keys), node.layout, node.mask, node.kernel_size, node.param_dtype
            )
    return model


# ---------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------


def batches(x, y, batch_size: int, seed: int):
    """An endless stream of minibatches, the same order for every model."""
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.choice(len(x), size=batch_size, replace=False)
        yield x[idx], y[idx]


class Trainer:
    """Adam on one model: a jitted step over its split parameters (no graph walk per step)."""

    def __init__(self, model, lr: float):
        self.model = model
        self.graphdef, self.params, self.rest = nnx.split(model, nnx.Param, ...)
        self.tx = optax.adam(lr)
        self.opt_state = self.tx.init(self.params)
        graphdef, rest, tx = self.graphdef, self.rest, self.tx

        @jax.jit
        def step(params, opt_state, x, y):
            def loss_fn(params):
                logits = nnx.merge(graphdef, params, rest)(x)
                return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self.step = step

    def train(self, steps: int, data):
        """``steps`` training steps on batches from ``data``; writes the params back into the model."""
        for _ in range(steps):
            self.params, self.opt_state, _ = self.step(self.params, self.opt_state, *next(data))
        jax.block_until_ready(self.params)
        nnx.update(self.model, self.params)
        return self

    def step_seconds(self, batch) -> float:
        """The wall time of one training step on ``batch`` (its result is discarded)."""
        start = time.perf_counter()
        jax.block_until_ready(self.step(self.params, self.opt_state, *batch))
        return time.perf_counter() - start


def step_ms(trainers: dict, batch, reps: int) -> dict:
    """Median step time (ms) of every trainer, timed round-robin so that load from other
    processes falls on all of them alike."""
    for t in trainers.values():
        t.step_seconds(batch)  # compiled already; one warm-up call each
    times = {name: [] for name in trainers}
    for _ in range(reps):
        for name, t in trainers.items():
            times[name].append(t.step_seconds(batch))
    return {name: 1e3 * float(np.median(ts)) for name, ts in times.items()}


def accuracy(model, x, y) -> float:
    graphdef, state = nnx.split(model)
    logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, x)
    return float(jnp.mean(jnp.argmax(logits, -1) == y))


# ---------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------


def run(args) -> dict:
    x_train, x_test, y_train, y_test = load_data(args.seed)
    make_data = functools.partial(batches, x_train, y_train, args.batch_size)
    print(
        f"digits: train {len(x_train)}, test {len(x_test)}; block size {args.block_size}; "
        f"{args.steps} dense steps, {args.finetune_steps} fine-tuning steps; device {jax.devices()[0].device_kind}"
    )

    dense = CNN(args.width, args.hidden, nnx.Rngs(args.seed))
    trainers = {("dense", 1.0): Trainer(dense, args.lr).train(args.steps, make_data(args.seed))}
    rows = [dict(model="dense", density=1.0, params=count_params(dense), accuracy=accuracy(dense, x_test, y_test))]
    print(f"dense: {rows[0]['params']:,} params, test accuracy {rows[0]['accuracy']:.4f}")

    for i, density in enumerate(args.densities):
        sparse, report = jbs.nnx.sparsify(dense, density, args.block_size)
        if i == 0:
            print(report)
        params = count_params(sparse)
        rows.append(dict(model="one-shot", density=density, params=params, accuracy=accuracy(sparse, x_test, y_test)))
        trainers["fine-tuned", density] = Trainer(sparse, args.lr).train(args.finetune_steps, make_data(args.seed + 1))
        rows.append(dict(model="fine-tuned", density=density, params=params, accuracy=accuracy(sparse, x_test, y_test)))

        # The same density from scratch: random blocks (same counts per layer), fresh init, all the steps.
        untrained = CNN(args.width, args.hidden, nnx.Rngs(args.seed + 100))
        scratch, _ = jbs.nnx.sparsify(
            untrained, density, args.block_size, selection=functools.partial(jbs.layouts.random, seed=args.seed)
        )
        fresh_blocks(scratch, args.seed + 200)
        trainers["from scratch", density] = Trainer(scratch, args.lr).train(
            args.steps + args.finetune_steps, make_data(args.seed)
        )
        rows.append(
            dict(
                model="from scratch",
                density=density,
                params=count_params(scratch),
                accuracy=accuracy(scratch, x_test, y_test),
            )
        )

    times = step_ms(trainers, next(make_data(args.seed + 2)), args.time_reps)
    for row in rows:
        row["step_ms"] = times.get((row["model"], row["density"]))
    print_table(rows)
    print(f"dense_accuracy={rows[0]['accuracy']:.4f}")
    return {"rows": rows}


def print_table(rows):
    print(f"\n{'model':<14} {'density':>7} {'params':>9} {'test acc':>9} {'step ms':>8}")
    for r in rows:
        ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.2f}"
        print(f"{r['model']:<14} {r['density']:>7.2f} {r['params']:>9,} {r['accuracy']:>9.4f} {ms:>8}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="data split, init and batch order")
    parser.add_argument("--steps", type=int, default=1500, help="dense training steps")
    parser.add_argument("--finetune-steps", type=int, default=300, help="fine-tuning steps after sparsifying")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.5, 0.25, 0.1])
    parser.add_argument(
        "--block-size",
        type=int,
        default=8,
        help="8 keeps a grid of 4 x 8 and 8 x 8 blocks in the convs (16 leaves 2 x 4 and 4 x 4: at "
        "density 0.1 one block each, which can disconnect the network)",
    )
    parser.add_argument("--width", type=int, default=32, help="channels of the first conv (then 2x)")
    parser.add_argument("--hidden", type=int, default=256, help="features of the hidden linear layer")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--time-reps", type=int, default=50, help="timed steps per model (round-robin, median)")
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, jax-blocksparse {jbs.__version__}")
    return run(args)


if __name__ == "__main__":
    main()
