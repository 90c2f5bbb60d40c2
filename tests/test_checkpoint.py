"""Checkpoints with orbax (the ``checkpoint`` extra): what a training run holds round-trips.

* layouts (from a mask, padded, built under jit, stacked by ``split_columns``) restore
  as equal :class:`jax_blocksparse.Layout` s into an abstract target, their tables
  saved by name; without a target they come back as those named tables;
* an NNX model (a dynamic layer: its layout in a ``BlockLayout`` variable) with its
  ``nnx.Optimizer`` (Adam inside dynamic loss scaling) restores bit for bit, and the
  next training step from the restored state equals the one from the original;
* sharded state (a column-parallel kernel, replicated layouts) restores onto the
  shardings of the target;
* a linen RigL run (params, "layout" collection, Adam inside dynamic loss scaling, the
  step) stopped halfway, restored in a new process and continued, ends bit-identical to
  the uninterrupted run (tests/checkpoint_resume.py, two child processes).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint_resume
import children
import jax_blocksparse as jbs
from helpers import cpu_mesh, save_restore
from jax_blocksparse import mixed_precision as jmp

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the checkpoint extra) is not installed")

BS = 8
TIMEOUT = 300  # seconds per child process (about 10 s each on 2 idle cores)
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _assert_same_tree(got, want):
    """Same pytree structure (static parts included), same dtypes, equal bits."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _layouts():
    mask = jbs.layouts.random((4, 8), 0.4, seed=0)
    full = jbs.Layout.from_mask(mask, BS)
    return {
        "exact": full,
        "padded": jbs.Layout.from_mask(mask, BS, capacity=20),
        "traced": jax.jit(lambda m: jbs.Layout.from_mask(m, BS, capacity=20))(jnp.asarray(mask)),
        "stacked": jbs.sharding.split_columns(full, 4),
    }


def test_layouts_round_trip(tmp_path):
    layouts = _layouts()
    restored = save_restore(tmp_path / "layouts", layouts, jax.eval_shape(lambda: layouts))
    _assert_same_tree(restored, layouts)
    for name, layout in layouts.items():
        assert isinstance(restored[name], jbs.Layout) and repr(restored[name]) == repr(layout)
    x = jax.random.normal(jax.random.key(0), (4, 32))
    w = jax.random.normal(jax.random.key(1), layouts["padded"].w_shape)
    np.testing.assert_array_equal(jbs.bsmm(x, w, restored["padded"]), jbs.bsmm(x, w, layouts["padded"]))

    # Without a target: the tables by name, as the checkpoint stores them.
    raw = save_restore(tmp_path / "raw", {"layout": layouts["padded"]})["layout"]
    assert set(raw) == set(jbs.layout.LayoutTables._fields)
    np.testing.assert_array_equal(raw["col_ptr"], layouts["padded"].tables.col_ptr)


def test_nnx_model_and_optimizer_round_trip(tmp_path):
    mask = jbs.layouts.random((4, 8), 0.4, seed=0)

    def create():
        model = jbs.nnx.BlockSparseLinear(32, 64, mask, BS, capacity=20, dynamic=True, rngs=nnx.Rngs(0))
        tx = jmp.dynamic_loss_scaling(optax.adam(1e-2), initial_scale=2.0**8, growth_interval=1)
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, x):
        def scaled_loss(m):
            return jmp.scale_loss(jnp.mean(m(x) ** 2), optimizer.opt_state)

        optimizer.update(model, nnx.grad(scaled_loss)(model))

    x = jax.random.normal(jax.random.key(2), (8, 32))
    model, optimizer = create()
    train_step(model, optimizer, x)
    state = nnx.state((model, optimizer))

    _, abstract = nnx.split(nnx.eval_shape(create))
    new_model, new_optimizer = create()
    nnx.update((new_model, new_optimizer), save_restore(tmp_path / "nnx", state, abstract))
    _assert_same_tree(nnx.state((new_model, new_optimizer)), state)
    assert isinstance(new_model.kernel_layout.get_value(), jbs.Layout)
    assert float(jmp.loss_scale(new_optimizer.opt_state)) == 2.0**9
    train_step(model, optimizer, x)
    train_step(new_model, new_optimizer, x)
    _assert_same_tree(nnx.state((new_model, new_optimizer)), nnx.state((model, optimizer)))


def test_sharded_state_restores_onto_the_target_shardings(tmp_path):
    mesh = cpu_mesh((2, 4), ("data", "model"))
    mask = jbs.layouts.random((4, 8), 0.5, seed=0)
    layer = jbs.nn.ColumnParallelDense(64, mask, BS, mesh, "model", batch_axis="data")
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, 32)), NamedSharding(mesh, P("data")))
    abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
    variables = jax.jit(layer.init, out_shardings=nn.get_sharding(abstract, mesh))(jax.random.key(0), x)
    layout = jbs.Layout.from_mask(jbs.layouts.random((4, 4), 0.5, seed=1), BS, capacity=12)
    state = {"params": nn.unbox(variables)["params"], "layout": layout}

    # The target says where each array goes: the params' shardings, layouts replicated.
    replicated = NamedSharding(mesh, P())
    target = {
        "params": nn.unbox(nn.get_sharding(abstract, mesh))["params"],
        "layout": jax.tree.map(lambda _: replicated, layout),
    }
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), jax.eval_shape(lambda: state), target
    )
    restored = save_restore(tmp_path / "sharded", state, target)
    _assert_same_tree(restored, state)
    assert restored["params"]["kernel"].sharding.spec == P("model", None, None, None)
    assert restored["layout"].tables.col_ptr.sharding == replicated

    @jax.jit
    def apply(state, x):  # x is split over "data": the restored arrays must sit on the mesh
        return layer.apply({"params": state["params"]}, x), jbs.bsmm(x, jnp.ones(layout.w_shape), state["layout"])

    _assert_same_tree(apply(restored, x), apply(state, x))


def test_rigl_resumed_in_a_new_process_is_bit_identical(tmp_path):
    run = checkpoint_resume
    ckpt, env = str(tmp_path / "ckpt"), children.environment(cpu_devices=1)
    full = children.run_together(
        [children.script("checkpoint_resume.py", "--run", "full", "--ckpt", ckpt, "--out", tmp_path / "full.npz")],
        [env],
        timeout=TIMEOUT,
    )
    assert full[0].ok, "the uninterrupted run failed:\n" + children.report(full)
    resumed = children.run_together(
        [children.script("checkpoint_resume.py", "--run", "resume", "--ckpt", ckpt, "--out", tmp_path / "resumed.npz")],
        [env],
        timeout=TIMEOUT,
    )
    assert resumed[0].ok, "the resumed run failed:\n" + children.report(resumed)

    want, got = dict(np.load(tmp_path / "full.npz")), dict(np.load(tmp_path / "resumed.npz"))
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    # The run did what makes a resume hard: RigL moved blocks, the loss scale grew.
    plan = run.METHOD.plan(run.SHAPES, run.BS)
    assert any((want[f"mask:{name}/kernel"] != plan[name].mask).any() for name in run.SHAPES)
    assert float(want["loss_scale"]) == 2.0**8 * 2 ** (run.STEPS // run.GROWTH_INTERVAL)
