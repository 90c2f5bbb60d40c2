"""jax-blocksparse quickstart: correctness, speed, and a small block-sparse MLP.

    python examples/quickstart.py                 # about a minute on a 2-core CPU
    python examples/quickstart.py --no-bench      # skip the timing table
    python examples/quickstart.py --seed 1 --steps 300
    python examples/quickstart.py --steps 20 --bench-size 256 --bench-reps 2   # seconds: a smoke run

1. A block-sparse layer on a small-world (Barabasi-Albert) layout, checked against
   the dense product it stands for.
2. bsmm against a dense ``x @ W`` at several densities, on ``jax.devices()[0]``.
3. A block-sparse MLP (BlockSparseDense hidden layers) trained with optax adam on
   scikit-learn's digits; prints ``test_accuracy=...`` at the end.
"""

from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jax_blocksparse as jbs
from jax_blocksparse.nn import BlockSparseDense
from jax_blocksparse.ops import paths  # which path the products take here
from jax_blocksparse.tune import call_times


def header(title: str):
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


# ---------------------------------------------------------------------------------
# 1. Correctness on a small-world layout
# ---------------------------------------------------------------------------------


def check_small_world(seed: int):
    header("1. block-sparse layer on a Barabasi-Albert layout")
    bs, nblocks = 32, 32  # W is [1024, 1024]
    mask = jbs.layouts.barabasi_albert(nblocks, 2, seed=seed)
    layer = BlockSparseDense(features=nblocks * bs, mask=mask, block_size=bs)
    layout = layer.layout
    x = jax.random.normal(jax.random.key(seed), (128, nblocks * bs))
    params = layer.init(jax.random.key(seed + 1), x)
    kernel, bias = params["params"]["kernel"], params["params"]["bias"]
    W = jbs.to_dense(kernel, layout)  # [1024, 1024], zero outside the blocks

    y_bsmm = jax.jit(jbs.bsmm)(x, kernel, layout)
    y_layer = jax.jit(layer.apply)(params, x)
    y_dense = jnp.matmul(x, W, precision="highest")
    print(f"{layout}")
    print(f"density {layout.density:.3f}: {layout.nnz} of {nblocks * nblocks} blocks of {bs}x{bs}")
    print(f"max |bsmm(x, w) - x @ W|           = {float(jnp.abs(y_bsmm - y_dense).max()):.2e}")
    print(f"max |layer(x) - (x @ W + b)|       = {float(jnp.abs(y_layer - (y_dense + bias)).max()):.2e}")

    # Gradients flow through the sparse product: dW only at the layout's blocks.
    g_w = jax.grad(lambda w: jnp.sum(jbs.bsmm(x, w, layout) ** 2))(kernel)
    g_dense = jax.grad(lambda W: jnp.sum(jnp.matmul(x, W, precision="highest") ** 2))(W)
    err = float(jnp.abs(g_w - jbs.from_dense(g_dense, layout)).max() / jnp.abs(g_dense).max())
    print(f"max rel |grad_w - blocks(grad_W)|  = {err:.2e}")
    print(f"output variance with the default init (unit-variance input): {float(jnp.var(y_layer)):.3f}")


# ---------------------------------------------------------------------------------
# 2. Timing against a dense matmul
# ---------------------------------------------------------------------------------


def median_ms_in_turn(calls, reps: int) -> list[float]:
    """Median milliseconds per call of each ``(fn, args)``, their samples taken in turn: a
    shared machine's speed drifts by tens of percent, and so moves them alike."""
    return [1e3 * t for t in call_times(calls, repeats=reps, min_time=0.02, statistic="median")]


def benchmark(seed: int, size: int | None = None, reps: int | None = None):
    """Times x @ W against bsmm at several densities; ``size`` and ``reps`` override the
    device's defaults (W is [size, size], x [size // 8, size] then). Returns the rows."""
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    platform = paths.lowering_platform(device.platform)
    impl = jbs.config.get_implementation()
    kernels = on_gpu and paths.kernels_selected(platform, impl, "jbs_bsmm_fprop")
    # The reference path materialises one [n, bs] slice of x per block: keep it modest.
    default_size, n, default_reps = (8192, 4096, 20) if kernels else (4096, 2048, 10) if on_gpu else (2048, 256, 7)
    if size is not None:
        n = max(size // 8, 8)
    size, reps = size or default_size, reps or default_reps
    bs = 32
    header("2. bsmm vs dense x @ W")
    print(
        f"device: {device.device_kind} ({device.platform}); bsmm path: {paths.describe_path(platform, impl)} "
        f"(implementation={impl!r})"
    )
    print(f"x [{n}, {size}] @ W [{size}, {size}], float32, block {bs}, median of {reps} samples taken in turn")

    x = jax.random.normal(jax.random.key(seed), (n, size), jnp.float32)
    W = jax.random.normal(jax.random.key(seed + 1), (size, size), jnp.float32)
    dense = jax.jit(lambda x, W: x @ W)
    sparse = jax.jit(lambda x, w, layout: jbs.bsmm(x, w, layout))
    print(f"{'density':>8} {'dense ms':>10} {'sparse ms':>10} {'speedup':>8}")
    rows = []
    for density in (1.0, 0.5, 0.25, 0.1, 0.05):
        mask = jbs.layouts.random((size // bs, size // bs), density, seed=seed)
        layout = jbs.Layout.from_mask(mask, bs)
        w = jbs.from_dense(W, layout)
        dense_ms, sparse_ms = median_ms_in_turn([(dense, (x, W)), (sparse, (x, w, layout))], reps)
        print(f"{density:>8.2f} {dense_ms:>10.2f} {sparse_ms:>10.2f} {dense_ms / sparse_ms:>7.2f}x")
        rows.append(dict(density=density, dense_ms=dense_ms, sparse_ms=sparse_ms))
    return rows


# ---------------------------------------------------------------------------------
# 3. A block-sparse MLP on digits
# ---------------------------------------------------------------------------------


class SparseMLP(nn.Module):
    """64 -> 256 -> 256 -> 10: two block-sparse hidden layers and a dense read-out."""

    hidden: int = 256
    block_size: int = 16
    seed: int = 0

    @nn.compact
    def __call__(self, x):
        bs, nb = self.block_size, self.hidden // self.block_size
        # 64 inputs = 4 block rows; a band gives every hidden block 2 or 3 input blocks.
        x = nn.relu(BlockSparseDense(self.hidden, jbs.layouts.banded((x.shape[-1] // bs, nb), 1), bs)(x))
        # Hidden to hidden: a small-world graph of 16 blocks.
        x = nn.relu(BlockSparseDense(self.hidden, jbs.layouts.barabasi_albert(nb, 2, seed=self.seed), bs)(x))
        return nn.Dense(10)(x)


def load_data(seed: int):
    digits = load_digits()
    x = digits.data.astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, random_state=seed, stratify=digits.target
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6  # standardize with training statistics
    return (x_train - mean) / std, (x_test - mean) / std, y_train.astype(np.int32), y_test.astype(np.int32)


def train(seed: int, steps: int, batch_size: int = 128):
    header("3. block-sparse MLP on scikit-learn digits")
    x_train, x_test, y_train, y_test = load_data(seed)
    model = SparseMLP(seed=seed)
    params = model.init(jax.random.key(seed), jnp.zeros((1, x_train.shape[1])))
    n_params = sum(p.size for p in jax.tree.leaves(params))
    n_dense = (64 * 256 + 256) + (256 * 256 + 256) + (256 * 10 + 10)
    print(
        f"train {len(x_train)}, test {len(x_test)}; parameters: {n_params:,} "
        f"(a dense 64-256-256-10 MLP has {n_dense:,})"
    )

    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss_fn(params):
            logits = model.apply(params, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(model.apply(params, x), -1) == y)

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step")
    for i in bar:
        idx = rng.choice(len(x_train), size=batch_size, replace=False)
        params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
        if i % 25 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{float(loss):.4f}")
    bar.close()
    elapsed = time.perf_counter() - start
    train_acc = float(accuracy(params, x_train, y_train))
    test_acc = float(accuracy(params, x_test, y_test))
    print(f"{steps} steps in {elapsed:.1f} s; train_accuracy={train_acc:.4f}")
    print(f"test_accuracy={test_acc:.4f}")
    return test_acc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="random seed (layouts, data split, init)")
    parser.add_argument("--steps", type=int, default=600, help="training steps for the MLP")
    parser.add_argument("--no-bench", action="store_true", help="skip the timing table")
    parser.add_argument(
        "--bench-size",
        type=int,
        default=None,
        help="W is [size, size] in the timing table (default: by device; a multiple of 32)",
    )
    parser.add_argument("--bench-reps", type=int, default=None, help="timed runs per row (default: by device)")
    args = parser.parse_args(argv)

    print(f"jax {jax.__version__}, jax-blocksparse {jbs.__version__}, devices: {jax.devices()}")
    check_small_world(args.seed)
    rows = None if args.no_bench else benchmark(args.seed, args.bench_size, args.bench_reps)
    return dict(bench=rows, test_accuracy=train(args.seed, args.steps))


if __name__ == "__main__":
    main()
