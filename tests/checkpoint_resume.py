"""A RigL run checkpointed with orbax halfway and resumed in another process.

Run as a script by tests/test_checkpoint.py, twice, each time in a fresh Python:

* ``--run full``: trains :data:`STEPS` steps uninterrupted; after step
  :data:`SAVE_AT` it saves the whole training state with orbax's ``CheckpointManager``
  (``StandardSave``) and trains on;
* ``--run resume``: builds the same model, restores that checkpoint into the abstract
  state of a fresh start (``StandardRestore`` of ``jax.eval_shape(initial_state)``)
  and trains from step ``SAVE_AT + 1`` to :data:`STEPS`.

Each writes its final state to ``--out`` (an .npz keyed by pytree path, plus the
layouts' masks and the loss scale); the test compares the two files bit for bit.

The state is everything the run depends on: the step, the params, the layouts (linen
"layout" collection, changed by RigL inside jit), and the optimizer state (Adam inside
:func:`jax_blocksparse.mixed_precision.dynamic_loss_scaling`, whose loss scale grows
every :data:`GROWTH_INTERVAL` steps). The method itself is configuration (a frozen
dataclass) and the batches are a function of the step, so neither is saved.

    python tests/checkpoint_resume.py --run full --ckpt DIR --out full.npz
    python tests/checkpoint_resume.py --run resume --ckpt DIR --out resumed.npz
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_blocksparse as jbs
from jax_blocksparse import mixed_precision as jmp
from jax_blocksparse import training as jst

BS = 8
SHAPES = {"fc1": (32, 64), "fc2": (64, 16)}  # grids 4 x 8 and 8 x 2
STEPS = 8
SAVE_AT = 4  # after step 4's layout update: the second half has one more update (step 6)
GROWTH_INTERVAL = 3  # the loss scale doubles at steps 3 and 6: the restored scale matters
METHOD = jst.RigL(density=0.4, total_steps=STEPS, update_every=2, drop_fraction=0.5, seed=0)


class MLP(nn.Module):
    """Two dynamic block-sparse layers (RigL moves their blocks) and a dense head."""

    plan: dict

    @nn.compact
    def __call__(self, x):
        for name, p in self.plan.items():
            x = nn.relu(
                jbs.nn.BlockSparseDense(SHAPES[name][1], p.mask, BS, capacity=p.capacity, dynamic=True, name=name)(x)
            )
        return nn.Dense(4)(x)


def batch(step: int):
    """The batch of ``step``: a function of the step alone, as a resumable loader's."""
    rng = np.random.default_rng(step)
    return rng.standard_normal((16, 32)).astype(np.float32), rng.integers(0, 4, 16).astype(np.int32)


def build():
    """(initial_state, train_step, sparsity_step) of the run."""
    model = MLP(METHOD.plan(SHAPES, BS))
    tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), initial_scale=2.0**8, growth_interval=GROWTH_INTERVAL)

    def initial_state():
        variables = model.init(jax.random.key(0), jnp.zeros((1, 32)))
        params = variables["params"]
        return {"step": 0, "params": params, "layouts": variables["layout"], "opt_state": tx.init(params)}

    def loss_fn(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, layouts, opt_state, x, y):
        grads = jax.grad(lambda p: jmp.scale_loss(loss_fn(p, layouts, x, y), opt_state))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def sparsity_step(step, params, layouts, opt_state, x, y):
        grads = jst.dense_grads(loss_fn, params, layouts, x, y)  # RigL's dense block gradients
        params, layouts, opt_state, _ = METHOD.update(step, params, layouts, opt_state, grads)
        return params, layouts, opt_state

    return initial_state, train_step, sparsity_step


def train(state, last_step, train_step, sparsity_step, on_step=None):
    """Trains from ``state["step"] + 1`` to ``last_step``; ``on_step(state)`` after each step."""
    params, layouts, opt_state = state["params"], state["layouts"], state["opt_state"]
    for step in range(int(state["step"]) + 1, last_step + 1):
        x, y = batch(step)
        params, opt_state = train_step(params, layouts, opt_state, x, y)
        if METHOD.is_update_step(step):
            params, layouts, opt_state = sparsity_step(step, params, layouts, opt_state, x, y)
        state = {"step": step, "params": params, "layouts": layouts, "opt_state": opt_state}
        if on_step is not None:
            on_step(state)
    return state


def flat_state(state) -> dict:
    """The state as {pytree path: numpy array}, with the masks and the loss scale."""
    out = {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
    for name, layout in jst.named_layouts(state["layouts"]):
        out[f"mask:{name}"] = np.asarray(layout.mask)
    out["loss_scale"] = np.asarray(jmp.loss_scale(state["opt_state"]))
    return out


def main(argv=None) -> int:
    import orbax.checkpoint as ocp  # the optional extra; only the child processes need it

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", choices=("full", "resume"), required=True)
    p.add_argument("--ckpt", required=True, help="the checkpoint directory (absolute)")
    p.add_argument("--out", required=True, help="the .npz to write the final state to")
    args = p.parse_args(argv)

    initial_state, train_step, sparsity_step = build()
    with ocp.CheckpointManager(args.ckpt) as manager:
        if args.run == "full":

            def save(state):
                if state["step"] == SAVE_AT:
                    manager.save(SAVE_AT, args=ocp.args.StandardSave(state))

            state = train(jax.jit(initial_state)(), STEPS, train_step, sparsity_step, on_step=save)
            manager.wait_until_finished()
        else:
            abstract = jax.eval_shape(initial_state)  # the target: Layouts, LossScaleState, ...
            state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
            layouts = jax.tree.leaves(state["layouts"], is_leaf=jst.is_layout)
            if (
                int(state["step"]) != SAVE_AT
                or not isinstance(state["opt_state"], jmp.LossScaleState)
                or not all(isinstance(layout, jbs.Layout) for layout in layouts)
            ):
                raise SystemExit(f"restored an unexpected state: {jax.tree.map(jnp.shape, state)}")
            state = train(state, STEPS, train_step, sparsity_step)
    np.savez(args.out, **flat_state(state))
    return 0


if __name__ == "__main__":
    sys.exit(main())
