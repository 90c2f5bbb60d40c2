"""A small ResNet, dense vs. block-sparse at equal parameter count, on real images.

    python examples/resnet.py                       # scikit-learn digits, a few minutes on 2 CPU cores
    python examples/resnet.py --epochs 30 --seed 1 --width 64 --block-size 16
    python examples/resnet.py --dtype bfloat16      # bf16 convs (AMX tiles on CPUs that have them)
    python examples/resnet.py --data-dir ~/data/mnist       # MNIST IDX files
    python examples/resnet.py --data-dir ~/data/cifar-10-batches-py

Two models, trained with the same optimiser, epochs, batch size and seed:

* dense: a ResNet whose residual blocks are two dense 3x3 ``flax.linen.Conv``;
* sparse: the same ResNet, twice as deep, whose residual-block 3x3 convs are
  ``jbs.nn.BlockSparseConv`` at ``--density`` block density (default 0.5), so both
  have about the same number of parameters. The stem, the strided transitions
  between stages and the classifier are dense in both.

Data: scikit-learn's digits (8x8 grayscale, 10 classes, shipped with scikit-learn)
by default. ``--data-dir`` takes a folder with the MNIST IDX files
(``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``) or the CIFAR-10
python batches (``data_batch_1`` .. ``data_batch_5``, ``test_batch``).

Prints the parameter count, the median train-step time after warm-up (ms) and the
test accuracy of both models, ending with the lines
``dense: params=... step_ms=... test_accuracy=...`` and
``sparse: params=... step_ms=... test_accuracy=...``.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jax_blocksparse as jbs
from jax_blocksparse.nn import BlockSparseConv

# ---------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------


def load_digits_data(seed: int):
    """scikit-learn's 8x8 digits: (x_train, y_train, x_test, y_test), x in [0, 1], NHWC."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test, "digits (scikit-learn, 8x8x1)"


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.exists():
            return candidate
    return None


def _read_idx(path: Path) -> np.ndarray:
    """Reads an IDX file (the MNIST format), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = data[0] * 256 + data[1], data[2], data[3]
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file (magic {data[:4].hex()})")
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_mnist_data(folder: Path):
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    paths = [_find(folder, n) for n in names]
    if any(p is None for p in paths):
        return None
    x_train, y_train, x_test, y_test = (_read_idx(p) for p in paths)
    scale = lambda x: (x.astype(np.float32) / 255.0)[..., None]  # noqa: E731
    return scale(x_train), y_train.astype(np.int32), scale(x_test), y_test.astype(np.int32), "MNIST (28x28x1)"


def load_cifar10_data(folder: Path):
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    if not all((folder / n).exists() for n in names):
        return None

    def batch(name):
        with open(folder / name, "rb") as f:
            d = pickle.load(f, encoding="bytes")
        x = np.asarray(d[b"data"], np.uint8).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return x.astype(np.float32) / 255.0, np.asarray(d[b"labels"], np.int32)

    parts = [batch(n) for n in names[:5]]
    x_train, y_train = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    x_test, y_test = batch("test_batch")
    mean, std = x_train.mean(axis=(0, 1, 2)), x_train.std(axis=(0, 1, 2))
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test, "CIFAR-10 (32x32x3)"


def load_data(data_dir: str | None, seed: int):
    if data_dir is None:
        return load_digits_data(seed)
    folder = Path(data_dir).expanduser()
    for loader in (load_mnist_data, load_cifar10_data):
        data = loader(folder)
        if data is not None:
            return data
    raise SystemExit(
        f"--data-dir {folder}: found neither the MNIST IDX files (train-images-idx3-ubyte[.gz], ...) "
        "nor the CIFAR-10 python batches (data_batch_1..5, test_batch)"
    )


# ---------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------


def block_mask(kind: str, grid: tuple[int, int], density: float, seed: int) -> np.ndarray:
    """A block mask of about ``density``: every block row and column has a block.

    "random": the diagonal plus uniformly random off-diagonal blocks up to the count;
    "banded": the narrowest band around the diagonal with at least that density.
    """
    cb, kb = grid
    count = max(min(cb, kb), int(round(density * cb * kb)))
    if kind == "banded":
        for bandwidth in range(max(cb, kb)):
            mask = jbs.layouts.banded(grid, bandwidth)
            if mask.sum() >= count:
                return mask
        return np.ones(grid, bool)
    mask = np.zeros(grid, bool)
    mask[np.arange(max(cb, kb)) % cb, np.arange(max(cb, kb)) % kb] = True
    free = np.flatnonzero(~mask.reshape(-1))
    extra = max(0, count - int(mask.sum()))
    chosen = np.random.default_rng(seed).choice(free, size=min(extra, free.size), replace=False)
    mask.reshape(-1)[chosen] = True
    return mask


class ResidualBlock(nn.Module):
    """x + conv(relu(norm(conv(x)))), normed, then relu; the 3x3 convs dense or block-sparse."""

    width: int
    masks: Sequence[Any] | None = None  # two block masks: block-sparse convs; None: dense
    block_size: int = 8
    dtype: Any = None  # the convs' computation dtype (float32 parameters either way)

    def conv(self, i):
        if self.masks is None:
            return nn.Conv(self.width, (3, 3), use_bias=False, dtype=self.dtype, name=f"conv{i}")
        return BlockSparseConv(
            self.width, (3, 3), self.masks[i], self.block_size, use_bias=False, dtype=self.dtype, name=f"conv{i}"
        )

    @nn.compact
    def __call__(self, x):
        y = nn.relu(nn.LayerNorm(name="norm0")(self.conv(0)(x)))
        y = nn.LayerNorm(name="norm1", scale_init=nn.initializers.zeros)(self.conv(1)(y))  # starts as identity
        return nn.relu(x + y)


class ResNet(nn.Module):
    """stem -> [residual blocks, strided transition] x stages -> global pool -> dense."""

    num_classes: int
    widths: Sequence[int]
    blocks_per_stage: int
    masks: Sequence[Any] | None = None  # per stage, per block: two masks; None: dense
    block_size: int = 8
    dtype: Any = None  # every conv's computation dtype; the norms and the head stay float32

    def conv(self, width, **kwargs):
        return nn.Conv(width, (3, 3), use_bias=False, dtype=self.dtype, **kwargs)

    @nn.compact
    def __call__(self, x):
        conv = self.conv
        x = nn.relu(nn.LayerNorm()(conv(self.widths[0], name="stem")(x)))
        for s, width in enumerate(self.widths):
            if s > 0:  # dense strided transition to the next stage's width
                x = nn.relu(nn.LayerNorm()(conv(width, strides=2, name=f"down{s}")(x)))
            for b in range(self.blocks_per_stage):
                masks = None if self.masks is None else self.masks[s][b]
                x = ResidualBlock(width, masks, self.block_size, self.dtype, name=f"stage{s}_block{b}")(x)
        return nn.Dense(self.num_classes, name="head")(x.astype(jnp.float32).mean(axis=(1, 2)))


def make_models(args, image_size: int, num_classes: int):
    stages = 2 if image_size <= 8 else 3
    widths = [args.width * 2**s for s in range(stages)]
    for w in widths:
        if w % args.block_size:
            raise SystemExit(f"--width {args.width}: every stage width {widths} must be a multiple of --block-size")
    dtype = jnp.dtype(args.dtype)
    dense = ResNet(num_classes, widths, args.blocks, dtype=dtype)
    rng = np.random.default_rng(args.seed)

    def mask(width):
        grid = (width // args.block_size,) * 2
        return block_mask(args.layout, grid, args.density, int(rng.integers(1 << 30)))

    # per stage, per residual block (twice as many), per conv: a block mask
    masks = [[[mask(w) for _conv in range(2)] for _block in range(2 * args.blocks)] for w in widths]
    sparse = ResNet(num_classes, widths, 2 * args.blocks, masks, args.block_size, dtype)
    return dense, sparse, masks


# ---------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------


def count_params(params) -> int:
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def train_and_evaluate(name, model, data, args, warmup: int = 5):
    x_train, y_train, x_test, y_test = data
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.asarray(x_train[:1]))["params"]
    optimizer = optax.adam(args.lr)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss_fn(params):
            logits = model.apply({"params": params}, xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def predict(params, xb):
        return jnp.argmax(model.apply({"params": params}, xb), axis=-1)

    steps_per_epoch = len(x_train) // args.batch_size
    order_rng = np.random.default_rng(args.seed)  # same batches for both models
    times, loss = [], float("nan")
    bar = tqdm(total=args.epochs * steps_per_epoch, desc=f"{name:>6}", unit="step")
    for epoch in range(args.epochs):
        order = order_rng.permutation(len(x_train))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            xb, yb = jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])
            start = time.perf_counter()
            params, opt_state, loss = step(params, opt_state, xb, yb)
            loss.block_until_ready()
            times.append(time.perf_counter() - start)
            bar.update()
        bar.set_postfix(epoch=epoch + 1, loss=f"{float(loss):.3f}")
    bar.close()

    correct = 0
    for i in range(0, len(x_test), 512):
        correct += int(jnp.sum(predict(params, jnp.asarray(x_test[i : i + 512])) == jnp.asarray(y_test[i : i + 512])))
    # The median: a shared machine's bursts (other processes) move a mean by tens of percent.
    step_ms = 1e3 * float(np.median(times[warmup:])) if len(times) > warmup else float("nan")
    return dict(params=count_params(params), step_ms=step_ms, test_accuracy=correct / len(x_test))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12, help="training epochs (both models)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split, layouts, init and batches")
    parser.add_argument("--width", type=int, default=32, help="channels of the first stage (doubled per stage)")
    parser.add_argument("--data-dir", default=None, help="folder with MNIST IDX files or CIFAR-10 python batches")
    # Blocks of 16 by default: at these small maps (8 x 8 and 4 x 4) blocks of 8 cost the
    # CPU kernels about twice the time per multiply-add (their per-block overhead).
    parser.add_argument("--block-size", type=int, default=16, choices=jbs.SUPPORTED_BLOCK_SIZES, help="block edge")
    parser.add_argument("--density", type=float, default=0.5, help="block density of the sparse model's 3x3 convs")
    parser.add_argument("--layout", default="random", choices=("random", "banded"), help="block layout kind")
    parser.add_argument("--blocks", type=int, default=1, help="residual blocks per stage of the dense model")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="adam learning rate")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the convs' computation dtype (mixed precision: float32 parameters, norms and head)",
    )
    args = parser.parse_args(argv)

    *data, description = load_data(args.data_dir, args.seed)
    x_train, y_train, x_test, y_test = data
    num_classes = int(max(y_train.max(), y_test.max())) + 1
    dense, sparse, masks = make_models(args, x_train.shape[1], num_classes)
    density = np.mean([m.mean() for stage in masks for block in stage for m in block])
    print(f"data: {description}: {len(x_train)} train / {len(x_test)} test images, {num_classes} classes")
    print(f"devices: {jax.devices()}")
    for name, model in (("dense ", dense), ("sparse", sparse)):
        stages = f"{len(model.widths)} stages x {model.blocks_per_stage} residual blocks"
        print(f"{name}: {stages}, widths {list(model.widths)}")
    print(
        "residual-block 3x3 convs: dense nn.Conv vs. "
        f"BlockSparseConv at block density {density:.2f} ({args.layout} layouts, "
        f"{args.block_size}x{args.block_size} blocks)"
    )
    print(
        f"training: adam lr={args.lr}, batch {args.batch_size}, {args.epochs} epochs, seed {args.seed}, "
        f"convs in {args.dtype}"
    )

    results = {
        name: train_and_evaluate(name, model, data, args) for name, model in (("dense", dense), ("sparse", sparse))
    }
    for name, r in results.items():
        print(f"{name}: params={r['params']} step_ms={r['step_ms']:.2f} test_accuracy={r['test_accuracy']:.4f}")
    return results


if __name__ == "__main__":
    main()
