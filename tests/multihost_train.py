"""Data-parallel training of a block-sparse MLP over a mesh that may span processes.

Run as a script by tests/test_multihost.py: two processes of one ``jax.distributed``
job on this machine (coordinator on 127.0.0.1, CPU collectives through gloo), each
with 2 host CPU devices, and once more as a single process with 4 devices. The global
mesh is 2 x 2, ``("data", "model")``; the first mesh row is process 0's devices.

The model (linen): a dynamic :class:`jax_blocksparse.nn.BlockSparseDense` (its layout
in the "layout" collection, moved by RigL at step 2), a
:class:`jax_blocksparse.nn.ColumnParallelDense` whose output block columns are split
over "model" (inputs split over "data"), and a dense head; every block-sparse product
on the CPU kernels (``impl="kernels"``). Parameters are initialised by ``jax.jit``
with the global shardings flax's metadata gives; the layouts start as layouts built on
the host (each process builds the same); each step's global batch is built from the
rows this process holds (``jax.make_array_from_process_local_data``), the way a real
multi-host input pipeline feeds it.

Each process writes to ``--out`` (``<out>.<process index>.npz``): the final params
and layout masks gathered to every process (``process_allgather``), and the FFI
targets the compiled training step calls.

    python tests/multihost_train.py --out OUT [--coordinator 127.0.0.1:PORT --num-processes 2 --process-id I]
"""

from __future__ import annotations

import argparse
import re
import sys

GLOBAL_BATCH = 16
STEPS = 4
BS = 8


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output prefix: writes <out>.<process index>.npz")
    p.add_argument("--coordinator", help="host:port of the jax.distributed coordinator (omit: one process)")
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--timeout", type=int, default=120, help="seconds to wait for the other processes at start")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import jax  # after parse: --help needs no backend

    if args.coordinator:
        # Before any other JAX call: CPU collectives across processes go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.timeout,
        )

    import flax.linen as nn
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_blocksparse as jbs
    from jax_blocksparse import training as jst

    devices = np.array(jax.devices()).reshape(2, -1)
    if jax.process_count() > 1 and any(d.process_index != row for row in range(2) for d in devices[row]):
        raise SystemExit(f"expected mesh row i to hold process i's devices, got {devices}")
    mesh = Mesh(devices, ("data", "model"))
    method = jst.RigL(density=0.5, total_steps=STEPS, update_every=2, drop_fraction=0.5, seed=0)
    plan = method.plan({"fc1": (32, 64)}, BS)["fc1"]
    mask2 = jbs.layouts.random((8, 4), 0.5, seed=1)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jbs.nn.BlockSparseDense(
                64, plan.mask, BS, capacity=plan.capacity, dynamic=True, impl="kernels", name="fc1"
            )(x)
            x = jbs.nn.ColumnParallelDense(32, mask2, BS, mesh, "model", batch_axis="data", impl="kernels", name="fc2")(
                nn.relu(x)
            )
            return nn.Dense(4, name="head")(nn.relu(x))

    model = MLP()
    tx = optax.adam(1e-2)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((STEPS, GLOBAL_BATCH, 32)).astype(np.float32)
    ys = rng.integers(0, 4, (STEPS, GLOBAL_BATCH)).astype(np.int32)
    batch_sharding = NamedSharding(mesh, P("data"))
    per_process = GLOBAL_BATCH // jax.process_count()
    rows = slice(jax.process_index() * per_process, (jax.process_index() + 1) * per_process)

    def global_batch(step):
        """The step's global batch from this process's rows only."""
        return tuple(jax.make_array_from_process_local_data(batch_sharding, a[step, rows]) for a in (xs, ys))

    abstract = jax.eval_shape(model.init, jax.random.key(0), xs[0])
    variables = jax.jit(model.init, out_shardings=nn.get_sharding(abstract, mesh))(jax.random.key(0), xs[0])
    params = variables["params"]
    # The layouts as a host builds them from a mask (numpy tables, the same on every
    # process), not init's global arrays: the first steps take them as they are; from
    # RigL's update on, the layouts are the update's global (replicated) outputs.
    layouts = {"fc1": {"kernel": jbs.Layout.from_mask(plan.mask, BS, capacity=plan.capacity)}}
    assert jax.tree.structure(layouts) == jax.tree.structure(variables["layout"])
    opt_state = jax.jit(tx.init)(params)

    def loss_fn(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, layouts, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, layouts, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def sparsity_step(step, params, layouts, opt_state, x, y):
        grads = jst.dense_grads(loss_fn, params, layouts, x, y)
        params, layouts, opt_state, _ = method.update(step, params, layouts, opt_state, grads)
        return params, layouts, opt_state

    hlo = train_step.lower(params, layouts, opt_state, *global_batch(0)).compile().as_text()
    for step in range(1, STEPS + 1):
        x, y = global_batch(step - 1)
        params, opt_state = train_step(params, layouts, opt_state, x, y)
        if method.is_update_step(step):
            params, layouts, opt_state = sparsity_step(step, params, layouts, opt_state, x, y)

    masks = {f"mask:{name}": layout.mask for name, layout in jst.named_layouts(layouts)}
    gathered = multihost_utils.process_allgather({"params": nn.unbox(params), **masks}, tiled=True)
    out = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(gathered)}
    out["custom_call_targets"] = np.array(sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo))))
    out["initial_mask:fc1/kernel"] = np.asarray(plan.mask)
    np.savez(f"{args.out}.{jax.process_index()}.npz", **out)
    print(f"process {jax.process_index()} of {jax.process_count()}: {STEPS} steps done", flush=True)
    if args.coordinator:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
