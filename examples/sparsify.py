"""Sparsify a trained dense model, fine-tune it one-shot or gradually, and compare (scikit-learn digits).

    python examples/sparsify.py --seeds 0 1 2 3 4                 # the table in README: 25 min on 2 CPU cores
    python examples/sparsify.py --densities 0.1                   # one seed, one density: minutes
    python examples/sparsify.py --steps 20 --finetune-steps 5 --densities 0.5 --width 16   # seconds

1. Train a dense CNN (Flax NNX) on scikit-learn's digits (8x8 grayscale images,
   1,797 of them, shipped with scikit-learn; split 75/25 stratified): three 3x3
   ``nnx.Conv`` (the first sees one input channel), a hidden ``nnx.Linear`` and a
   10-way ``nnx.Linear`` head.
2. One-shot, for each density: ``jbs.nnx.sparsify(dense_model, density, block_size)``
   keeps the blocks of largest norm of every layer that fits (the first conv, one input
   channel, and the head, 10 outputs, do not: the report lists them as left dense);
   measure the accuracy, then fine-tune ``--finetune-steps`` steps ("fine-tuned").
3. Gradual: ``jbs.nnx.sparsify(dense_model, 1.0, block_size, dynamic=True)`` (every
   block kept), then fine-tune ``--steps + --finetune-steps`` steps while gradual
   magnitude pruning takes the density from 1 to the target on the cubic schedule of
   Zhu & Gupta (``jbs.training.cubic_density``), every ``--prune-every`` steps until
   step ``--prune-end`` x the fine-tuning steps, then fine-tune at the target density:

   * the hidden linear layer has a dynamic layout: ``jbs.training.MagnitudePruning``
     and ``jbs.training.nnx_update`` drop its weakest blocks at each update;
   * the convs have no dynamic layout (``BlockSparseConv`` is static), so they keep
     every block stored while pruning and are pruned by a block mask instead, at the
     same steps to the same schedule: the weakest of their remaining blocks (norm over
     all taps, as ``sparsify`` ranks them) are set to zero and held at zero after every
     optimiser step (the computation stays dense-sized for them until the end);
   * at the end the model is rebuilt with ``jbs.nnx.sparsify(jbs.nnx.densify(model),
     density, block_size, selection=masks)``: a static block-sparse model storing only
     the remaining blocks, as many per layer as the one-shot model's (checked), whose
     accuracy is the one reported.
4. From scratch: the same architecture sparsified at random (same per-layer block
   counts), its blocks redrawn with the block-sparse layers' own initialisation,
   trained for ``--steps + --finetune-steps`` steps.

Every model trains with the same optimiser (Adam), batch size and data order (the
fine-tuning of both recipes draws the same batches). With several ``--seeds`` (each
one its own data split, init and batch order) everything runs once per seed and the
table shows the mean over seeds with the standard deviation, then the min-max.
Prints the sparsify report of the densest setting, then one table row per density:
parameters, test accuracy of each recipe side by side, and the median train-step time
of the fine-tuned model (ms: one jitted step per model over its split parameters,
timed after training, round-robin over the models ``--time-reps`` times so that load
from other processes falls on all alike; median over seeds). Ends with
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
from jax_blocksparse.layers.sparsify import block_scores
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
# Gradual magnitude pruning
# ---------------------------------------------------------------------------------


def _at(model, path):
    """The node of ``model`` at ``path`` (a tuple of attribute names or indices)."""
    return functools.reduce(lambda node, key: node[key] if isinstance(key, int) else getattr(node, key), path, model)


def _name(path) -> str:
    return "/".join(str(key) for key in path)


def conv_block_norms(layer: BlockSparseConv) -> np.ndarray:
    """float64 [C // bs, K // bs]: the L2 norm of every block of a conv, over all its taps."""
    return block_scores(jbs.conv_to_dense(layer.kernel[...], layer.layout), layer.block_size)


def conv_slot_mask(layer: BlockSparseConv, mask: np.ndarray):
    """``mask`` (bool [C // bs, K // bs]) in the layout of the conv's stored kernel: 1.0 at kept blocks."""
    full = np.kron(mask, np.ones((layer.block_size, layer.block_size))).astype(np.float32)
    return jbs.conv_from_dense(np.broadcast_to(full, (*layer.kernel_size, *full.shape)), layer.layout)


class GradualPruning:
    """Fine-tuning from density 1 to ``targets`` (blocks per layer) by gradual magnitude pruning.

    The dynamic linear layers are pruned by ``jbs.training.MagnitudePruning`` through
    ``jbs.training.nnx_update`` (Adam's state moves with their blocks); the static convs
    by a block mask at the same steps, to the same cubic schedule (see the module's
    docstring). ``finish()`` returns the block-sparse model holding the blocks left.
    """

    def __init__(self, dense, density: float, block_size: int, targets: dict, lr: float, end_step, every, seed):
        model, _ = jbs.nnx.sparsify(dense, 1.0, block_size, dynamic=True)
        self.density, self.block_size, self.targets = density, block_size, targets
        self.method = jbs.training.MagnitudePruning(density=density, end_step=end_step, update_every=every, seed=seed)
        optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
        self.convs = {_name(p): p for p, node in nnx.iter_graph(model) if isinstance(node, BlockSparseConv)}
        self.masks = {name: np.ones(_at(model, p).layout.grid, bool) for name, p in self.convs.items()}
        self.slot_masks = {
            name: conv_slot_mask(_at(model, p), m) for (name, p), m in zip(self.convs.items(), self.masks.values())
        }
        self.graphdef, self.state = nnx.split((model, optimizer))
        graphdef, convs, method = self.graphdef, self.convs, self.method

        @jax.jit
        def train_step(state, slot_masks, x, y):
            model, optimizer = nnx.merge(graphdef, state)

            def loss_fn(model):
                return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            for name, path in convs.items():  # pruned conv blocks stay zero
                layer = _at(model, path)
                layer.kernel[...] = layer.kernel[...] * slot_masks[name]
            return nnx.state((model, optimizer)), loss

        @jax.jit
        def prune_linear(state, step):
            model, optimizer = nnx.merge(graphdef, state)
            jbs.training.nnx_update(method, step, model, optimizer)
            return nnx.state((model, optimizer))

        self.train_step, self.prune_linear = train_step, prune_linear

    def prune_convs(self, step: int):
        """Masks each conv down to the schedule's block count at ``step`` (weakest remaining blocks first)."""
        model, optimizer = nnx.merge(self.graphdef, self.state)
        m = self.method
        for name, path in self.convs.items():
            layer, alive = _at(model, path), self.masks[name]
            final = self.targets[name]
            d = float(jbs.training.cubic_density(step, m.begin_step, m.end_step, final / alive.size, m.initial_density))
            keep = max(int(np.round(d * alive.size)), final)
            drop = int(alive.sum()) - keep
            if drop <= 0:
                continue
            scores = np.where(alive, conv_block_norms(layer), np.inf).reshape(-1)
            alive = alive.copy().reshape(-1)
            alive[np.argsort(scores, kind="stable")[:drop]] = False
            self.masks[name] = alive.reshape(self.masks[name].shape)
            self.slot_masks[name] = conv_slot_mask(layer, self.masks[name])
            layer.kernel[...] = layer.kernel[...] * self.slot_masks[name]
        self.state = nnx.state((model, optimizer))

    def train(self, steps: int, data):
        for step in range(1, steps + 1):
            self.state, _ = self.train_step(self.state, self.slot_masks, *next(data))
            if self.method.is_update_step(step):
                self.state = self.prune_linear(self.state, step)
                self.prune_convs(step)
        jax.block_until_ready(self.state)
        return self

    def finish(self):
        """The block-sparse model storing only the blocks left (static layouts, like the one-shot model's)."""
        model, _ = nnx.merge(self.graphdef, self.state)
        masks = dict(self.masks)
        for path, node in nnx.iter_graph(model):
            if isinstance(node, BlockSparseLinear):
                masks[_name(path)] = np.asarray(node.layout.mask)
        sparse, report = jbs.nnx.sparsify(jbs.nnx.densify(model), self.density, self.block_size, selection=masks)
        blocks = {path: report.row(path).blocks for path in report.converted}
        if blocks != self.targets:
            raise RuntimeError(f"gradual pruning ended with blocks {blocks}, the one-shot model has {self.targets}")
        return sparse


# ---------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------

RECIPES = ("one-shot", "fine-tuned", "gradual", "from scratch")


def run_seed(args, seed: int, verbose: bool) -> list[dict]:
    """Every model for one seed: rows of (model, density, params, accuracy, step_ms)."""
    x_train, x_test, y_train, y_test = load_data(seed)
    make_data = functools.partial(batches, x_train, y_train, args.batch_size)
    total = args.steps + args.finetune_steps
    end_step = max(1, round(args.prune_end * total))

    dense = CNN(args.width, args.hidden, nnx.Rngs(seed))
    trainers = {("dense", 1.0): Trainer(dense, args.lr).train(args.steps, make_data(seed))}
    rows = [dict(model="dense", density=1.0, params=count_params(dense), accuracy=accuracy(dense, x_test, y_test))]
    print(f"seed {seed}: dense: {rows[0]['params']:,} params, test accuracy {rows[0]['accuracy']:.4f}", flush=True)

    for i, density in enumerate(args.densities):
        sparse, report = jbs.nnx.sparsify(dense, density, args.block_size)
        if i == 0 and verbose:
            print(report)
        params = count_params(sparse)
        rows.append(dict(model="one-shot", density=density, params=params, accuracy=accuracy(sparse, x_test, y_test)))
        trainers["fine-tuned", density] = Trainer(sparse, args.lr).train(args.finetune_steps, make_data(seed + 1))
        rows.append(dict(model="fine-tuned", density=density, params=params, accuracy=accuracy(sparse, x_test, y_test)))

        # Gradual: from every block to the one-shot model's block counts, over all the steps (MagnitudePruning
        # rounds the hidden layer's budget as sparsify does; finish() checks that the counts agree).
        targets = {path: report.row(path).blocks for path in report.converted}
        pruning = GradualPruning(
            dense, density, args.block_size, targets, args.gradual_lr or args.lr, end_step, args.prune_every, seed
        )
        gradual = pruning.train(total, make_data(seed + 1)).finish()
        trainers["gradual", density] = Trainer(gradual, args.lr)  # for its step time only
        rows.append(
            dict(
                model="gradual",
                density=density,
                params=count_params(gradual),
                accuracy=accuracy(gradual, x_test, y_test),
            )
        )

        # The same density from scratch: random blocks (same counts per layer), fresh init, all the steps.
        untrained = CNN(args.width, args.hidden, nnx.Rngs(seed + 100))
        scratch, _ = jbs.nnx.sparsify(
            untrained, density, args.block_size, selection=functools.partial(jbs.layouts.random, seed=seed)
        )
        fresh_blocks(scratch, seed + 200)
        trainers["from scratch", density] = Trainer(scratch, args.lr).train(total, make_data(seed))
        rows.append(
            dict(
                model="from scratch",
                density=density,
                params=count_params(scratch),
                accuracy=accuracy(scratch, x_test, y_test),
            )
        )
        print(
            f"seed {seed}: density {density}: "
            + ", ".join(f"{r['model']} {r['accuracy']:.4f}" for r in rows[-len(RECIPES) :]),
            flush=True,
        )

    times = step_ms(trainers, next(make_data(seed + 2)), args.time_reps)
    for row in rows:
        row["step_ms"] = times.get((row["model"], row["density"]))
    return rows


def run(args) -> dict:
    print(
        f"digits: block size {args.block_size}; {args.steps} dense steps, {args.finetune_steps} fine-tuning steps "
        f"(one-shot), {args.steps + args.finetune_steps} (gradual: pruned every {args.prune_every} steps until "
        f"{args.prune_end:g} of them; from scratch); seeds {args.seeds}; device {jax.devices()[0].device_kind}"
    )
    start = time.perf_counter()
    per_seed = [run_seed(args, seed, verbose=(k == 0)) for k, seed in enumerate(args.seeds)]
    rows = summarize(per_seed)
    wall = time.perf_counter() - start
    print_table(rows, len(args.seeds))
    print(f"wall time {wall:.0f} s")
    print(f"dense_accuracy={rows[0]['accuracy']:.4f}")
    return {"rows": rows, "seeds": list(args.seeds), "wall_s": wall}


def summarize(per_seed: list[list[dict]]) -> list[dict]:
    """One row per model over the seeds: the mean accuracy, its std, min, max and the
    per-seed values; the median step time."""
    rows = []
    for same in zip(*per_seed, strict=True):  # the same (model, density) under every seed
        first = same[0]
        assert all(
            (r["model"], r["density"], r["params"]) == (first["model"], first["density"], first["params"]) for r in same
        )
        accs = np.asarray([r["accuracy"] for r in same])
        ms = [r["step_ms"] for r in same]
        rows.append(
            dict(
                model=first["model"],
                density=first["density"],
                params=first["params"],
                accuracy=float(accs.mean()),
                accuracy_std=float(accs.std()),
                accuracy_min=float(accs.min()),
                accuracy_max=float(accs.max()),
                accuracies=accs.tolist(),
                step_ms=None if ms[0] is None else float(np.median(ms)),
            )
        )
    return rows


def print_table(rows, n_seeds: int):
    """One line per density: parameters, each recipe's test accuracy side by side, the step time."""
    by = {(r["model"], r["density"]): r for r in rows}
    densities = [r["density"] for r in rows if r["model"] == "one-shot"]
    width = 15 if n_seeds > 1 else 8

    def cell(model, density, spread=False):
        r = by.get((model, density))
        if r is None:
            return f"{'':>{width}}"
        if spread:
            return f"{r['accuracy_min']:.4f}-{r['accuracy_max']:.4f}".rjust(width)
        text = f"{r['accuracy']:.4f}" + (f" ±{r['accuracy_std']:.4f}" if n_seeds > 1 else "")
        return text.rjust(width)

    def table(spread):
        head = "".join(f" {name:>{width}}" for name in RECIPES)
        print(f"\n{'density':>9} {'params':>9}{head} {'step ms':>8}")
        dense = by["dense", 1.0]
        blank = " " * (3 * (width + 1))
        print(f"{'1 (dense)':>9} {dense['params']:>9,} {cell('dense', 1.0, spread)}{blank} {dense['step_ms']:>8.2f}")
        for d in densities:
            cells = "".join(f" {cell(name, d, spread)}" for name in RECIPES)
            print(f"{d:>9g} {by['one-shot', d]['params']:>9,}{cells} {by['fine-tuned', d]['step_ms']:>8.2f}")

    if n_seeds > 1:
        print(f"\ntest accuracy, mean ±std over {n_seeds} seeds")
    table(False)
    if n_seeds > 1:
        print(f"\ntest accuracy, min-max over {n_seeds} seeds")
        table(True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="one run per seed (data split, init, batch order); means"
    )
    parser.add_argument("--steps", type=int, default=1500, help="dense training steps")
    parser.add_argument("--finetune-steps", type=int, default=300, help="one-shot fine-tuning steps after sparsifying")
    parser.add_argument(
        "--prune-end",
        type=float,
        default=0.5,
        help="gradual: the schedule reaches the target density at this fraction of its steps "
        "(--steps + --finetune-steps)",
    )
    parser.add_argument("--prune-every", type=int, default=50, help="gradual: steps between pruning updates")
    parser.add_argument("--gradual-lr", type=float, default=None, help="gradual: Adam's learning rate (default --lr)")
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
    if not 0.0 < args.prune_end <= 1.0:
        parser.error(f"--prune-end must be in (0, 1], got {args.prune_end}")
    print(f"jax {jax.__version__}, jax-blocksparse {jbs.__version__}")
    return run(args)


if __name__ == "__main__":
    main()
