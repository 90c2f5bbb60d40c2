"""Dynamic sparse training of a block-sparse MLP (LeNet-300-100-like) on digits or MNIST.

    python examples/sparse_training.py                                   # sparse momentum, 10%
    python examples/sparse_training.py --method rigl --density 0.05
    python examples/sparse_training.py --method dense
    python examples/sparse_training.py --data-dir ~/mnist                # MNIST IDX files
    python examples/sparse_training.py --method rigl --json run.json     # the result as JSON
    python examples/sparse_training.py --sweep                           # methods x densities x seeds

Model: in -> 320 -> 96 -> classes with ReLU, every layer a ``BlockSparseDense`` in
dynamic mode (its layout lives in the "layout" variable collection), blocks of 8x8
by default. Inputs are zero-padded to a multiple of the block size (digits: 64
features, already one; MNIST: 784 = 98 * 8) and the last layer's outputs are
padded to one (10 -> 16: logits 0-4 in the first output block, 5-9 in the second,
see ``logit_positions``); the padding outputs are dropped before the loss. So every
weight matrix, the first and the last included, is block-sparse and counts toward
``--density`` (global, over all three layers; layer budgets by ERK by default).
``--method dense`` trains the same widths with ``flax.linen.Dense``.

Every training step runs the block-sparse ops (``bsmm`` forward, its bprop and
updat in the backward pass) with the current layouts. Only at layout updates (every
epoch by default) does anything touch the full grid: RigL and sparse momentum ask
for the dense block gradients (one full-layout ``bsmm_updat`` per layer, no dense
forward pass). Sparse momentum's momentum is estimated as the mean dense gradient
over ``--momentum-batches`` minibatches at each update (SGD momentum 0.9 averages
about the last 10 gradients; truly block-sparse training keeps no dense momentum).

Data: scikit-learn's digits (8x8 images, 1797 samples, shipped with scikit-learn),
split 75/25 stratified with ``--split-seed``; with ``--data-dir`` holding the MNIST
IDX files (``train-images-idx3-ubyte`` etc., optionally ``.gz``), MNIST.

Optimizer: AdamW (lr 3e-3, cosine decay, batch 32), 60 epochs; ``--optimizer sgd``
for SGD with Nesterov momentum 0.9. Prints a progress bar, the layout changes
(``--log``), the median train-step time (``--time-steps``) and finally
``test_accuracy=0.xxxx``. The default run takes about 10-20 s on a 2-core CPU.

Results as JSON: ``--json PATH`` writes the run's result with its settings, date,
commit and device. ``--sweep`` trains every method of ``--methods`` at every density of
``--densities`` (``dense`` at density 1 only) with every seed of ``--seeds`` in one
process and writes one file, by default
``bench/results/sparse_training-<device>-<date>.json``: every run, and per method and
density the mean and standard deviation of the test accuracy over the seeds (the docs
plot it, ``docs/_plots.py``). The file is rewritten after each seed's round, so an
interrupted sweep leaves the rounds it finished. The defaults, 5 methods x 4 densities
x 3 seeds (51 runs), take about 10-15 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import os
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jax_blocksparse import training as jst
from jax_blocksparse.nn import BlockSparseDense

# The result files follow bench/'s conventions (commit, device, file name, atomic write).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _report import default_report_path, git_commit, measured_on, write_json  # noqa: E402

METHODS = ("dense", "static", "set", "rigl", "sparse_momentum", "magnitude")
SWEEP_METHODS = ("dense", "static", "set", "rigl", "sparse_momentum")
SWEEP_DENSITIES = (0.5, 0.25, 0.1, 0.05)
SWEEP_SEEDS = (0, 1, 2)
#: The arguments that say which run it is, or how it is reported, rather than how it trains.
NOT_SETTINGS = ("method", "density", "seed", "json", "sweep", "methods", "densities", "seeds", "quiet", "log")

# ---------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------


def _read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        _, dtype, ndim = struct.unpack(">HBB", f.read(4))
        shape = struct.unpack(">" + "I" * ndim, f.read(4 * ndim))
        return np.frombuffer(f.read(), np.uint8).reshape(shape)


def _find(data_dir, stem):
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(data_dir, name)
        if os.path.exists(path):
            return path
    return None


def load_data(data_dir: str | None, split_seed: int):
    """(x_train, y_train, x_test, y_test, name): float32 features in [0, 1], int32 labels."""
    if data_dir:
        stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
        stems += ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
        paths = [_find(data_dir, s) for s in stems]
        if all(paths):
            xtr, ytr, xte, yte = (_read_idx(p) for p in paths)
            prep = lambda x: x.reshape(len(x), -1).astype(np.float32) / 255.0  # noqa: E731
            return prep(xtr), ytr.astype(np.int32), prep(xte), yte.astype(np.int32), "mnist"
        print(f"MNIST IDX files not found in {data_dir!r}; using scikit-learn digits")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.data.astype(np.float32) / 16.0
    y = digits.target.astype(np.int32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=split_seed, stratify=y)
    return xtr, ytr, xte, yte, "digits"


def pad_features(x, block_size):
    pad = (-x.shape[1]) % block_size
    return np.pad(x, ((0, 0), (0, pad))) if pad else x


# ---------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------


def logit_positions(num_classes: int, out_features: int, block_size: int) -> np.ndarray:
    """Where the real logits sit in the padded output: spread evenly over the output blocks.

    With 10 classes in 2 blocks of 8, logits 0-4 are in block 0 and 5-9 in block 1, so
    no output block column is mostly padding (a block of padding has no gradient and
    would lose every magnitude and gradient comparison).
    """
    blocks = out_features // block_size
    per_block = np.full(blocks, num_classes // blocks) + (np.arange(blocks) < num_classes % blocks)
    return np.concatenate([b * block_size + np.arange(n) for b, n in enumerate(per_block)])


class SparseMLP(nn.Module):
    """ReLU MLP of dynamic BlockSparseDense layers named layer0, layer1, ..."""

    plan: dict  # name -> LayerPlan
    features: Sequence[int]
    block_size: int
    num_classes: int
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        for i, feats in enumerate(self.features):
            p = self.plan[f"layer{i}"]
            x = BlockSparseDense(
                feats, p.mask, self.block_size, capacity=p.capacity, dynamic=True, dtype=self.dtype, name=f"layer{i}"
            )(x)
            if i < len(self.features) - 1:
                x = nn.relu(x)
        positions = logit_positions(self.num_classes, self.features[-1], self.block_size)
        return x[..., positions].astype(jnp.float32)


class DenseMLP(nn.Module):
    features: Sequence[int]
    num_classes: int
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        for i, feats in enumerate(self.features):
            x = nn.Dense(feats, dtype=self.dtype, name=f"layer{i}")(x)
            if i < len(self.features) - 1:
                x = nn.relu(x)
        return x[..., : self.num_classes].astype(jnp.float32)


def make_method(args, total_steps: int, steps_per_epoch: int) -> jst.DynamicSparsity:
    every = args.update_every or steps_per_epoch
    common = dict(density=args.density, distribution=args.distribution, update_every=every, seed=args.seed)
    if args.method == "static":
        return jst.StaticSparse(**common)
    if args.method in ("set", "rigl"):
        cls = jst.RigL if args.method == "rigl" else jst.SET
        stop = 0.75 if args.stop_fraction is None else args.stop_fraction
        return cls(total_steps=total_steps, drop_fraction=args.drop_fraction, stop_fraction=stop, **common)
    if args.method == "sparse_momentum":
        stop = 1.0 if args.stop_fraction is None else args.stop_fraction
        return jst.SparseMomentum(
            total_steps=total_steps,
            prune_rate=args.prune_rate,
            capacity_factor=args.capacity_factor,
            stop_fraction=stop,
            redistribution=args.redistribution,
            **common,
        )
    if args.method == "magnitude":
        return jst.MagnitudePruning(begin_step=int(0.1 * total_steps), end_step=int(0.6 * total_steps), **common)
    raise ValueError(args.method)


# ---------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------


def run(args) -> dict:
    xtr, ytr, xte, yte, data_name = load_data(args.data_dir, args.split_seed)
    num_classes = int(max(ytr.max(), yte.max())) + 1
    bs = args.block_size
    xtr, xte = pad_features(xtr, bs), pad_features(xte, bs)
    hidden = [int(h) for h in args.hidden.split(",")]
    out_features = num_classes + (-num_classes) % bs
    features = hidden + [out_features]
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else None

    steps_per_epoch = len(xtr) // args.batch_size
    total_steps = steps_per_epoch * args.epochs
    rng = np.random.default_rng(args.seed)

    method = None
    if args.method == "dense":
        model = DenseMLP(features, num_classes, dtype)
    else:
        method = make_method(args, total_steps, steps_per_epoch)
        dims = [xtr.shape[1]] + features
        shapes = {f"layer{i}": (dims[i], dims[i + 1]) for i in range(len(features))}
        plan = method.plan(shapes, bs)
        model = SparseMLP(plan, features, bs, num_classes, dtype)

    variables = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, xtr.shape[1])))
    params = variables["params"]
    layouts = variables.get("layout", {})
    if args.optimizer == "adam":
        schedule = optax.cosine_decay_schedule(args.lr, total_steps)
        tx = optax.adamw(schedule, weight_decay=args.weight_decay)
    else:
        schedule = optax.cosine_decay_schedule(args.lr, total_steps)
        tx = optax.chain(optax.add_decayed_weights(args.weight_decay), optax.sgd(schedule, momentum=0.9, nesterov=True))
    opt_state = tx.init(params)

    def loss_fn(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, layouts, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, layouts, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def sparsity_step(step, params, layouts, opt_state, xs, ys):
        grads = None
        if method.needs_grads:
            # The mean dense block gradient over the minibatches (equal sizes): the gradient
            # of the mean loss over all of them at once.
            x, y = xs.reshape(-1, xs.shape[-1]), ys.reshape(-1)
            grads = jst.dense_grads(loss_fn, params, layouts, x, y)
        return method.update(step, params, layouts, opt_state, grads)

    @jax.jit
    def accuracy(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    def batches():
        order = rng.permutation(len(xtr))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            yield jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx])

    n_grad_batches = args.momentum_batches if args.method == "sparse_momentum" else 1
    logs, step_times, update_times, step = [], [], [], 0
    bar = tqdm(total=total_steps, desc=f"{args.method} d={args.density:g}", disable=args.quiet, ncols=100)
    for _ in range(args.epochs):
        for x, y in batches():
            t0 = time.perf_counter()
            params, opt_state, loss = train_step(params, layouts, opt_state, x, y)
            if args.time_steps:
                loss.block_until_ready()
                step_times.append(time.perf_counter() - t0)
            step += 1
            if method is not None and method.is_update_step(step):
                idx = rng.choice(len(xtr), size=(n_grad_batches, args.batch_size))
                t0 = time.perf_counter()
                params, layouts, opt_state, log = sparsity_step(
                    step, params, layouts, opt_state, jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx])
                )
                logs.append(log)
                if args.time_steps:
                    jax.block_until_ready(params)
                    update_times.append(time.perf_counter() - t0)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{float(loss):.4f}")
            bar.update(1)
    bar.close()

    acc = float(accuracy(params, layouts, jnp.asarray(xte), jnp.asarray(yte)))
    density = 1.0 if args.method == "dense" else args.density
    result = {"method": args.method, "density": density, "seed": args.seed, "data": data_name, "test_accuracy": acc}
    if step_times:
        warm = step_times[min(5, len(step_times) - 1) :]
        result["step_ms"] = 1e3 * float(np.median(warm))
    if len(update_times) > 1:
        result["update_ms"] = 1e3 * float(np.median(update_times[1:]))  # the first one compiles
    if method is not None:
        final = {name: (l.nnz, l.capacity, l.grid[0] * l.grid[1]) for name, l in jst.named_layouts(layouts)}
        result["layers"] = final
        nnz = sum(v[0] for v in final.values())
        result["final_density"] = nnz / sum(v[2] for v in final.values())
        if args.log and logs:
            print(jst.format_log(logs))
        if logs:
            print(
                f"layout updates: {len(logs)}, blocks moved: {sum(log.totals()['grown'] for log in logs)} grown, "
                f"{sum(log.totals()['pruned'] for log in logs)} pruned"
            )
        print("final layers (nnz/capacity/grid): " + ", ".join(f"{k}={v[0]}/{v[1]}/{v[2]}" for k, v in final.items()))
        print(f"final density: {result['final_density']:.4f}")
    if "step_ms" in result:
        print(f"train_step_ms={result['step_ms']:.3f}")
    if "update_ms" in result:
        print(f"layout_update_ms={result['update_ms']:.3f}")
    print(f"test_accuracy={acc:.4f}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=METHODS, default="sparse_momentum")
    p.add_argument("--density", type=float, default=0.1, help="global fraction of weights kept")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--seed", type=int, default=0, help="init, layouts, batches and update choices")
    p.add_argument("--split-seed", type=int, default=0, help="digits train/test split")
    p.add_argument("--data-dir", default=None, help="directory with the MNIST IDX files (else digits)")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--hidden", default="320,96", help="hidden widths, multiples of the block size")
    p.add_argument("--distribution", choices=("uniform", "erk"), default="erk", help="layer budget")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--update-every", type=int, default=0, help="steps between layout updates (0: each epoch)")
    p.add_argument("--prune-rate", type=float, default=0.5, help="sparse momentum's initial prune rate")
    p.add_argument(
        "--redistribution",
        choices=("momentum", "none"),
        default="momentum",
        help="sparse momentum: move the pruned budget across layers by mean momentum",
    )
    p.add_argument("--capacity-factor", type=float, default=1.5, help="sparse momentum's room per layer")
    p.add_argument(
        "--stop-fraction",
        type=float,
        default=None,
        help="layout frozen after this fraction of training (rigl/set: 0.75, sparse momentum: 1.0)",
    )
    p.add_argument("--drop-fraction", type=float, default=0.3, help="RigL / SET initial drop fraction")
    p.add_argument("--momentum-batches", type=int, default=10, help="minibatches averaged for sparse momentum")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--log", action="store_true", help="print every layout update")
    p.add_argument("--time-steps", action="store_true", help="time each train step (blocks on every step)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, default=None, help="write the result (with --sweep: every run) here")
    p.add_argument("--sweep", action="store_true", help="train --methods x --densities x --seeds; write one JSON")
    p.add_argument("--methods", nargs="+", choices=METHODS, help=f"with --sweep (default: {' '.join(SWEEP_METHODS)})")
    p.add_argument("--densities", nargs="+", type=float, help=f"with --sweep (default: {SWEEP_DENSITIES})")
    p.add_argument("--seeds", nargs="+", type=int, help=f"with --sweep (default: {SWEEP_SEEDS})")
    args = p.parse_args(argv)
    grid = {"methods": SWEEP_METHODS, "densities": SWEEP_DENSITIES, "seeds": SWEEP_SEEDS}
    if not args.sweep and any(getattr(args, name) is not None for name in grid):
        p.error("--methods, --densities and --seeds go with --sweep")
    for name, default in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, list(default))
    for name in ("epochs", "batch_size", "block_size", "momentum_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for density in [args.density] + (args.densities if args.sweep else []):
        if not 0 < density <= 1:
            p.error(f"a density must be in (0, 1], got {density}")
    try:
        hidden = [int(h) for h in args.hidden.split(",")]
    except ValueError:
        p.error(f"--hidden must be comma-separated integers, got {args.hidden!r}")
    if any(h < 1 or h % args.block_size for h in hidden):
        p.error(f"--hidden {args.hidden}: every width must be a positive multiple of --block-size {args.block_size}")
    if args.sweep and len(set(args.seeds)) != len(args.seeds):
        p.error(f"--seeds must differ, got {args.seeds}")
    return args


# ---------------------------------------------------------------------------------
# JSON results
# ---------------------------------------------------------------------------------


def header(args) -> dict:
    """What every result file shares: the example, device, commit, date and the training settings."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in NOT_SETTINGS}
    return {
        "benchmark": "sparse_training",
        **measured_on(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "settings": settings,
    }


def summarize(runs: list[dict]) -> list[dict]:
    """Per (method, density), in the order first run: the mean and (population) standard
    deviation of the test accuracy over the seeds, with each seed's value."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["method"], r["density"]), []).append(r)
    rows = []
    for (method, density), rs in groups.items():
        accs = np.array([r["test_accuracy"] for r in rs])
        rows.append(
            {
                "method": method,
                "density": density,
                "seeds": [r["seed"] for r in rs],
                "test_accuracies": accs.tolist(),
                "mean": float(accs.mean()),
                "std": float(accs.std()),
            }
        )
    return rows


def sweep(args) -> dict:
    """Every method x density x seed, one seed's round at a time; the file is rewritten
    after each round, so it always holds whole rounds (the same seeds for every cell)."""
    plan = [(m, d) for m in args.methods for d in ([1.0] if m == "dense" else args.densities)]
    report = dict(header(args), methods=list(args.methods), densities=list(args.densities), seeds=[], runs=[])
    path = args.json or default_report_path("sparse_training", report)
    start = time.perf_counter()
    for seed in args.seeds:
        for i, (method, density) in enumerate(plan):
            print(f"seed {seed}, run {i + 1}/{len(plan)}: {method} density {density:g}", flush=True)
            one = argparse.Namespace(**dict(vars(args), method=method, density=density, seed=seed, quiet=True))
            t0 = time.perf_counter()
            result = run(one)
            result["seconds"] = round(time.perf_counter() - t0, 1)
            report["runs"].append(result)
        report["seeds"].append(seed)
        report["summary"] = summarize(report["runs"])
        report["seconds"] = round(time.perf_counter() - start, 1)
        write_json(path, report)
        print(f"wrote {path} ({len(report['seeds'])} of {len(args.seeds)} seeds)", flush=True)
    print(f"{'method':<16} {'density':>7}  mean ±std over {len(report['seeds'])} seeds")
    for row in report["summary"]:
        print(f"{row['method']:<16} {row['density']:>7g}  {row['mean']:.4f} ±{row['std']:.4f}")
    report["path"] = str(path)
    return report


def main(argv=None):
    args = parse_args(argv)
    if args.sweep:
        return sweep(args)
    result = run(args)
    if args.json:
        write_json(args.json, dict(header(args), run=result))
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
