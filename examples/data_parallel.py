"""Data-parallel training of a block-sparse MLP on every local device: pmap, shard_map, jit.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/data_parallel.py
    python examples/data_parallel.py --steps 300 --batch-size 256

On a CPU the script asks XLA for 8 host devices itself (``--devices``) unless
XLA_FLAGS already says how many; on GPUs it uses all local devices.

The same model (two BlockSparseDense hidden layers and a dense classifier) is trained
with SGD + momentum on scikit-learn's digits four times, on the same global batches:

* ``single``: ``jax.jit`` on one device: the reference run.
* ``pmap``: the batch split over devices, parameters replicated, gradients averaged
  with ``lax.pmean``.
* ``shard_map``: the same with ``jax.shard_map`` over a 1-D mesh; the local loss is
  averaged with ``lax.pmean``, whose transpose all-reduces the gradients.
* ``jit``: a plain ``jax.jit`` step on inputs with a batch-sharded ``NamedSharding``;
  XLA partitions it, and bsmm's sharding rule keeps each device on its own rows.

Prints, per mode, test accuracy, ms per step and the largest difference of its final
parameters from the single-device run (equal up to float32 summation order).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before jax is imported: several host devices on CPU
    _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), "8")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_n}"

import argparse  # noqa: E402
import time  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import jax_blocksparse as jbs  # noqa: E402
from jax_blocksparse.nn import BlockSparseDense  # noqa: E402
from jax_blocksparse.ops import paths  # noqa: E402

MODES = ("single", "pmap", "shard_map", "jit")
BS = 16


class MLP(nn.Module):
    """64 -> hidden (random blocks, half dense) -> hidden (Barabasi-Albert blocks) -> 10."""

    hidden: int = 256
    seed: int = 0

    @nn.compact
    def __call__(self, x):
        kb = self.hidden // BS
        x = nn.relu(BlockSparseDense(self.hidden, jbs.layouts.random((64 // BS, kb), 0.5, seed=self.seed), BS)(x))
        x = nn.relu(BlockSparseDense(self.hidden, jbs.layouts.barabasi_albert(kb, 2, seed=self.seed), BS)(x))
        return nn.Dense(10)(x)


def load_data(seed: int):
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-3)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed, stratify=y)


def batches(num_train: int, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """[steps, batch_size] example indices: the same global batches for every mode."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(num_train, batch_size, replace=False) for _ in range(steps)])


def train(
    mode: str,
    steps: int = 200,
    batch_size: int = 128,
    seed: int = 0,
    num_devices: int | None = None,
    data=None,
    lr: float = 0.05,
    hidden: int = 256,
):
    """Trains the MLP in ``mode`` (one of MODES); returns (params, metrics dict)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    devices = jax.local_devices()[: num_devices or jax.local_device_count()]
    n = 1 if mode == "single" else len(devices)
    if batch_size % n:
        raise ValueError(f"batch_size={batch_size} must be divisible by the number of devices ({n})")
    x_train, x_test, y_train, y_test = data if data is not None else load_data(seed)
    model, tx = MLP(hidden, seed), optax.sgd(lr, momentum=0.9)
    params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 64)))["params"]
    opt_state = tx.init(params)
    idx = batches(len(x_train), steps, batch_size, seed)

    def local_loss(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def update(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def sgd_step(loss_fn, reduce_grads=lambda g: g):
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            params, opt_state = update(params, opt_state, reduce_grads(grads))
            return params, opt_state, reduce_grads(loss)

        return step

    if mode in ("single", "jit"):
        step = jax.jit(sgd_step(local_loss))
        if mode == "jit":  # batch split over devices by its sharding; params replicated
            mesh = Mesh(np.array(devices), ("batch",))
            rows, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
            params, opt_state = jax.device_put((params, opt_state), replicated)
        else:
            rows = devices[0]

        def run(params, opt_state, i):
            xb, yb = jax.device_put((x_train[idx[i]], y_train[idx[i]]), rows)
            return step(params, opt_state, xb, yb)

    elif mode == "pmap":
        step = jax.pmap(sgd_step(local_loss, lambda g: jax.lax.pmean(g, "batch")), axis_name="batch", devices=devices)
        params, opt_state = jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), (params, opt_state))

        def run(params, opt_state, i):
            xb = x_train[idx[i]].reshape(n, batch_size // n, -1)
            return step(params, opt_state, xb, y_train[idx[i]].reshape(n, -1))

    else:  # shard_map
        mesh = Mesh(np.array(devices), ("batch",))

        def global_mean_loss(params, x, y):  # the transpose of pmean all-reduces the grads
            return jax.lax.pmean(local_loss(params, x, y), "batch")

        step = jax.jit(
            jbs.sharding.shard_map(
                sgd_step(global_mean_loss),
                mesh=mesh,
                in_specs=(P(), P(), P("batch"), P("batch")),
                out_specs=(P(), P(), P()),
            )
        )

        def run(params, opt_state, i):
            return step(params, opt_state, x_train[idx[i]], y_train[idx[i]])

    params, opt_state, loss = run(params, opt_state, 0)  # compile
    jax.block_until_ready(params)
    start = time.perf_counter()
    for i in range(1, steps):
        params, opt_state, loss = run(params, opt_state, i)
        # One step in flight at a time: simulated CPU devices share a small thread pool,
        # and a second step's collectives could take the threads the first one waits for.
        jax.block_until_ready(loss)
    jax.block_until_ready(params)
    ms = 1e3 * (time.perf_counter() - start) / max(1, steps - 1)
    if mode == "pmap":  # every device holds the same copy
        params, loss = jax.tree.map(lambda a: a[0], (params, loss))
    params = jax.device_get(params)
    logits = jax.jit(lambda p, x: model.apply({"params": p}, x))(params, x_test)
    accuracy = float((np.argmax(logits, -1) == y_test).mean())
    return params, {"mode": mode, "devices": n, "loss": float(loss), "test_accuracy": accuracy, "ms_per_step": ms}


def max_difference(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b))
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in pairs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per mode")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (divisible by the devices)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", type=int, default=None, help="devices to use (default: all local; 8 on CPU)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--hidden", type=int, default=256, help="hidden width (a multiple of 16)")
    args = parser.parse_args(argv)
    devices = jax.local_devices()[: args.devices or jax.local_device_count()]
    print(f"{len(devices)} x {devices[0].platform} devices; bsmm path: {paths.describe_path(devices[0].platform)}")
    data = load_data(args.seed)
    reference, results = None, {}
    for mode in args.modes.split(","):
        params, m = train(mode, args.steps, args.batch_size, args.seed, len(devices), data, hidden=args.hidden)
        if reference is None and mode == "single":
            reference = params
        diff = f"{max_difference(params, reference):.1e}" if reference is not None else "n/a"
        print(
            f"{mode:>9}: devices={m['devices']} loss={m['loss']:.4f} test_accuracy={m['test_accuracy']:.4f} "
            f"{m['ms_per_step']:.1f} ms/step  max|params - single|={diff}"
        )
        results[mode] = dict(m, max_difference=None if reference is None else max_difference(params, reference))
    return results


if __name__ == "__main__":
    main()
