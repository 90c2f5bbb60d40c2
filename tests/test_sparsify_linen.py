"""Sparsify an unmodified linen model in one call, and back (jbs.nn.sparsify /
jbs.nn.densify): the model's own code runs, its nn.Dense / nn.Conv calls are answered
block-sparse through Flax's method interception.

Oracle: the dense model applied to variables whose kernels are zeroed outside the
selected blocks (numpy, from the masks), float32 at HIGHEST precision.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_blocksparse as jbs
from jax_blocksparse import training as jst

RTOL, ATOL = 2e-5, 2e-5


def expand(mask, block_size):
    return np.kron(np.asarray(mask, np.int8), np.ones((block_size, block_size), np.int8)).astype(bool)


class Block(nn.Module):
    """A submodule defined in setup (not compact), with a bias-free layer."""

    features: int

    def setup(self):
        self.fc = nn.Dense(self.features)
        self.proj = nn.Dense(self.features, use_bias=False)

    def __call__(self, x):
        return self.proj(nn.relu(self.fc(x)))


class CNN(nn.Module):
    """Layers created inline in nn.compact; Conv_0 (3 channels in) and the head (10 out) do not fit."""

    dtype: object = None
    precision: object = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        kw = dict(dtype=self.dtype, precision=self.precision)
        x = nn.relu(nn.Conv(16, (3, 3), **kw)(x))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2, **kw)(x))
        x = nn.relu(nn.Conv(32, (3, 3), padding=((1, 1), (0, 2)), kernel_dilation=(1, 2), **kw)(x))
        x = x.reshape(x.shape[0], -1)  # [N, 4 * 2 * 32]
        x = nn.relu(nn.Dense(64, **kw)(x))
        block = Block(64)
        x = block(block(x))  # one module called twice
        x = nn.Dropout(0.5, deterministic=not train)(x)
        return nn.Dense(10, name="head", **kw)(x)


def weights_like(abstract, seed=1):
    """Unit-scale weights and non-zero biases, as a trained model has (numpy: nothing to compile)."""
    rng = np.random.default_rng(seed)
    fan_in = lambda s: s[-2] if len(s) > 1 else 4  # noqa: E731
    return jax.tree.map(lambda a: (rng.normal(size=a.shape) / np.sqrt(fan_in(a.shape))).astype(a.dtype), abstract)


@pytest.fixture(scope="module")
def setup():
    model = CNN()
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 8, 8, 3)), jnp.float32)
    return model, weights_like(jax.eval_shape(model.init, jax.random.key(0), x)), x


def masked(variables, sparse):
    """The dense variables with each converted kernel zeroed outside its blocks (numpy)."""
    params = jax.tree.map(np.asarray, variables["params"])
    for path, plan in sparse.layers:
        entry = params
        for key in path:
            entry = entry[key]
        entry["kernel"] = entry["kernel"] * expand(np.asarray(plan.mask), plan.block_size)
    return {**variables, "params": params}


CONVERTED = ("Conv_1", "Conv_2", "Dense_0", "Block_0/fc", "Block_0/proj")


def test_density_one_computes_the_dense_model(setup):
    model, variables, x = setup
    sparse, sparse_vars, report = jbs.nn.sparsify(model, variables, x, density=1.0, block_size=16)
    assert report.converted == CONVERTED and set(report.left_dense) == {"Conv_0", "head"}
    assert sparse_vars["params"]["Dense_0"]["kernel"].shape == (16 * 4, 16, 16)
    assert sparse_vars["params"]["Conv_1"]["kernel"].shape == (2, 3, 3, 16, 16)
    assert variables["params"]["Dense_0"]["kernel"].shape == (256, 64)  # the input is left alone
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), model.apply(variables, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("density, distribution", [(0.5, "uniform"), (0.25, "erk")])
def test_density_d_computes_the_dense_model_with_blocks_zeroed(setup, density, distribution):
    model, variables, x = setup
    sparse, sparse_vars, report = jbs.nn.sparsify(
        model, variables, x, density=density, block_size=16, distribution=distribution
    )
    want = model.apply(masked(variables, sparse), x)
    np.testing.assert_allclose(sparse.apply(sparse_vars, x), want, rtol=RTOL, atol=ATOL)
    dense_vars = jbs.nn.densify(sparse, sparse_vars)
    np.testing.assert_allclose(model.apply(dense_vars, x), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(
        dense_vars["params"]["Conv_2"]["kernel"], masked(variables, sparse)["params"]["Conv_2"]["kernel"]
    )
    assert report.params_after < report.params_before


def test_precision_and_dtype_are_the_modules(setup):
    _, variables, x = setup
    model = CNN(dtype=jnp.bfloat16, precision="highest")
    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, x, density=0.5, block_size=16)
    y = sparse.apply(sparse_vars, x)
    assert y.dtype == jnp.bfloat16
    jaxpr = jax.make_jaxpr(lambda v: sparse.apply(v, x))(sparse_vars)
    precisions = {e.params.get("precision") for e in jaxpr.jaxpr.eqns if "bsmm" in e.primitive.name}
    assert precisions == {jax.lax.Precision.HIGHEST}, precisions


def test_keep_dense_strict_selection_and_bad_arguments(setup):
    model, variables, x = setup
    sparse, _, report = jbs.nn.sparsify(
        model,
        variables,
        x,
        density=0.5,
        block_size=16,
        keep_dense=["Block_0/*"],
        selection={"Dense_0": np.eye(16, 4, dtype=bool)},
    )
    assert sparse.paths == ("Conv_1", "Conv_2", "Dense_0")
    assert report.left_dense["Block_0/fc"] == "matches keep_dense"
    np.testing.assert_array_equal(np.asarray(dict(sparse.layers)[("Dense_0",)].mask), np.eye(16, 4, dtype=bool))
    with pytest.raises(ValueError, match="strict=True.*Conv_0: input channels 3"):
        jbs.nn.sparsify(model, variables, x, density=0.5, block_size=16, strict=True)
    with pytest.raises(ValueError, match=r"density must be in \(0, 1\]"):
        jbs.nn.sparsify(model, variables, x, density=2, block_size=16)
    with pytest.raises(TypeError, match="'params' collection"):
        jbs.nn.sparsify(model, variables["params"], x, density=0.5, block_size=16)
    with pytest.raises(TypeError, match="flax.linen.Module"):
        jbs.nn.sparsify(lambda x: x, variables, x, density=0.5, block_size=16)


def test_layers_that_do_not_fit_are_listed():
    class Odd(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Conv(16, (3,), feature_group_count=2)(x)
            x = nn.Dense(16, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k))(x)
            stack = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=0)
            return stack(16, name="stack")(x)  # one Dense per example: kernels [2, 16, 16]

    x = jnp.ones((2, 5, 16))
    variables = weights_like(jax.eval_shape(Odd().init, jax.random.key(0), x))
    _, _, report = jbs.nn.sparsify(Odd(), variables, x, density=0.5, block_size=16)
    assert report.converted == ()
    reasons = report.left_dense
    assert reasons["Conv_0"] == "feature_group_count=2 (grouped convolution)"
    assert reasons["Dense_0"] == "custom dot_general"
    assert "lifted transform" in reasons["stack"] and report.row("stack").shape == (2, 16, 16)


def test_jit_grad_vmap_and_init_from_scratch(setup):
    model, variables, x = setup
    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, x, density=0.5, block_size=16)
    dense_vars = masked(variables, sparse)
    loss = lambda apply, v: jnp.sum(apply(v, x) ** 2)  # noqa: E731

    @jax.jit  # one compilation for all of it
    def both(sparse_vars, dense_vars):
        return (
            sparse.apply(sparse_vars, x),
            model.apply(dense_vars, x),
            jax.grad(lambda v: loss(sparse.apply, v))(sparse_vars)["params"],
            jax.grad(lambda v: loss(model.apply, v))(dense_vars)["params"],
            jax.vmap(lambda xi: sparse.apply(sparse_vars, xi[None])[0])(x),
        )

    y_sparse, y_dense, g_sparse, g_dense, batched = both(sparse_vars, dense_vars)
    np.testing.assert_allclose(y_sparse, y_dense, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(batched, y_dense, rtol=RTOL, atol=ATOL)
    layouts = dict(sparse.layers)
    np.testing.assert_allclose(
        g_sparse["Dense_0"]["kernel"],
        jbs.from_dense(g_dense["Dense_0"]["kernel"], layouts[("Dense_0",)].layout),
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(
        g_sparse["Conv_1"]["kernel"],
        jbs.conv_from_dense(g_dense["Conv_1"]["kernel"], layouts[("Conv_1",)].layout),
        rtol=1e-4,
        atol=1e-4,
    )
    np.testing.assert_allclose(g_sparse["head"]["bias"], g_dense["head"]["bias"], rtol=1e-4, atol=1e-4)
    # init through the sparse module: the same structure, fresh block-sparse kernels.
    fresh = jax.eval_shape(sparse.init, jax.random.key(3), x)
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, sparse_vars)


def test_optax_training_and_dropout(setup):
    model, variables, x = setup
    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, x, density=0.25, block_size=16)
    params, target = sparse_vars["params"], jnp.arange(2) % 10
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, key):
        def loss_fn(p):
            logits = sparse.apply({"params": p}, x, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for i in range(6):
        params, opt_state, loss = step(params, opt_state, jax.random.key(i))
        losses.append(float(loss))
    assert np.mean(losses[3:]) < np.mean(losses[:3])
    assert params["Dense_0"]["kernel"].shape == sparse_vars["params"]["Dense_0"]["kernel"].shape


def test_orbax_round_trip(setup, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")
    model, variables, x = setup
    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, x, density=0.5, block_size=16, dynamic=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", sparse_vars)
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, sparse_vars)
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    assert isinstance(restored["layout"]["Dense_0"]["kernel"], jbs.Layout)
    np.testing.assert_array_equal(sparse.apply(restored, x), sparse.apply(sparse_vars, x))


@pytest.mark.parametrize(
    "method, density, capacity_factor",
    [
        (jst.RigL(density=0.5, total_steps=8, update_every=2, drop_fraction=0.5), 0.5, 1.0),
        (jst.SET(density=0.5, total_steps=8, update_every=2, drop_fraction=0.5), 0.5, 1.0),
        (jst.SparseMomentum(density=0.5, total_steps=8, update_every=2), 0.5, 1.5),
        (jst.MagnitudePruning(density=0.25, end_step=2, update_every=2), 1.0, 1.0),  # from a dense start
    ],
    ids=["rigl", "set", "sparse_momentum", "magnitude"],
)
def test_dynamic_methods_continue_from_the_converted_model(method, density, capacity_factor):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(nn.relu(nn.Dense(64)(nn.relu(nn.Dense(64)(x)))))

    model, x = MLP(), jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)
    y = jnp.arange(8) % 16
    variables = weights_like(jax.eval_shape(model.init, jax.random.key(1), x))
    sparse, sparse_vars, report = jbs.nn.sparsify(
        model, variables, x, density=density, block_size=16, dynamic=True, capacity_factor=capacity_factor
    )
    params, layouts = sparse_vars["params"], sparse_vars["layout"]
    assert set(layouts) == {"Dense_0", "Dense_1", "Dense_2"} and all(r.dynamic for r in report.layers)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(params, layouts, x, y):
        logits = sparse.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, layouts, opt_state):
        grads = jax.grad(loss_fn)(params, layouts, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def sparsity_step(step, params, layouts, opt_state):
        grads = jst.dense_grads(loss_fn, params, layouts, x, y) if method.needs_grads else None
        return method.update(step, params, layouts, opt_state, grads)

    before = int(np.asarray(layouts["Dense_1"]["kernel"].mask).sum())
    changed = 0
    for step in (1, 2):  # one update, after step 2
        params, opt_state = train_step(params, layouts, opt_state)
        if method.is_update_step(step):
            params, layouts, opt_state, log = sparsity_step(step, params, layouts, opt_state)
            changed += int(np.asarray(log.pruned).sum())
    assert changed > 0
    after = int(np.asarray(layouts["Dense_1"]["kernel"].mask).sum())
    if isinstance(method, jst.MagnitudePruning):
        assert (before, after) == (16, 4)
    elif not isinstance(method, jst.SparseMomentum):
        assert after == before
    final = {"params": params, "layout": layouts}
    dense_vars = jbs.nn.densify(sparse, final)
    assert "layout" not in dense_vars
    np.testing.assert_allclose(model.apply(dense_vars, x), sparse.apply(final, x), rtol=RTOL, atol=ATOL)


def test_dense_grads_reach_the_intercepted_layers():
    """RigL's dense gradient comes through the interceptor: the probe equals x^T dy."""
    model, x = nn.Dense(32), jnp.asarray(np.random.default_rng(0).normal(size=(4, 16)), jnp.float32)
    variables = weights_like(jax.eval_shape(model.init, jax.random.key(1), x))
    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, x, density=0.5, block_size=16, dynamic=True)
    assert sparse.paths == ("",)  # a bare Dense is the root: the empty path
    layouts = sparse_vars["layout"]
    loss = lambda p, l, x: jnp.sum(sparse.apply({"params": p, "layout": l}, x))  # noqa: E731
    grads = jst.dense_grads(loss, sparse_vars["params"], layouts, x)
    leaf = jax.tree.leaves(grads)[0]
    want = jbs.from_dense(x.T @ jnp.ones((4, 32)), jbs.Layout.dense((1, 2), 16))
    np.testing.assert_allclose(leaf, want, rtol=1e-5)


@pytest.mark.parametrize(
    "box, names, block_names, lost",
    [
        (nn.with_logical_partitioning, ("embed", "mlp"), ("mlp", None, None), "input axis ('embed',) unnamed"),
        (nn.with_partitioning, (None, "model"), ("model", None, None), None),
    ],
    ids=["logical", "mesh"],
)
def test_boxed_parameters_are_unboxed_converted_and_boxed_again(box, names, block_names, lost):
    # A kernel in a Flax metadata box converts, comes back in the same box type with the
    # names its block layout honours, and densify gives the original box back.
    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            up = nn.Dense(64, kernel_init=box(nn.initializers.lecun_normal(), names), name="up")
            return nn.Dense(32)(nn.relu(up(x)))

    model, x = Boxed(), jnp.ones((2, 32))
    variables = model.init(jax.random.key(0), x)
    sparse, sparse_vars, report = jbs.nn.sparsify(
        model, variables, x, density=1.0, block_size=16, selection="column_balanced"
    )
    kernel = sparse_vars["params"]["up"]["kernel"]
    assert type(kernel) is type(variables["params"]["up"]["kernel"])
    assert kernel.names == block_names and kernel.value.shape == (8, 16, 16)
    assert nn.get_partition_spec(sparse_vars)["params"]["up"]["kernel"] == jax.sharding.PartitionSpec(*block_names)
    # A named input axis is dropped (a block is stored whole), and the report says so.
    assert report.lost_partitioning.get("up", "").startswith(lost or "") and bool(lost) == (
        "up" in report.lost_partitioning
    )
    np.testing.assert_allclose(
        np.asarray(sparse.apply(sparse_vars, x)), np.asarray(model.apply(variables, x)), rtol=1e-5, atol=1e-5
    )
    dense_vars = jbs.nn.densify(sparse, sparse_vars)
    back = dense_vars["params"]["up"]["kernel"]
    assert type(back) is type(variables["params"]["up"]["kernel"]) and back.names == names
    np.testing.assert_array_equal(np.asarray(back.value), np.asarray(variables["params"]["up"]["kernel"].value))
    # Trained from scratch, the converted layer's kernel comes boxed the same way.
    fresh = sparse.init(jax.random.key(1), x)
    assert fresh["params"]["up"]["kernel"].names == block_names


def test_unbalanced_layouts_lose_the_output_name_and_the_report_says_why():
    class Boxed(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(64, kernel_init=init, name="up")(x)

    model, x = Boxed(), jnp.ones((2, 32))
    variables = model.init(jax.random.key(0), x)
    mask = np.zeros((2, 4), bool)
    mask[0, :] = mask[1, 0] = True  # column 0 holds two blocks, the others one
    sparse, sparse_vars, report = jbs.nn.sparsify(
        model, variables, x, density=0.5, block_size=16, selection={"up": mask}
    )
    assert sparse_vars["params"]["up"]["kernel"].names == (None, None, None)
    why = report.lost_partitioning["up"]
    assert "input axis ('embed',) unnamed" in why and "output block columns hold 1 to 2 blocks" in why
    assert "partitioning: input axis" in str(report)
