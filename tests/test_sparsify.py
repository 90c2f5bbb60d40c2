"""Sparsify an NNX model in one call, and back (jbs.nnx.sparsify / jbs.nnx.densify),
and the framework-neutral decisions behind it (jax_blocksparse.layers.sparsify).

The oracle of every conversion is the dense model itself: at density 1 the converted
model computes the dense model's outputs, at density d the outputs of the dense model
whose kernels are zeroed outside the selected blocks (built here with numpy from the
report's masks, not with the library's gather/scatter). float32 at HIGHEST precision
(tests/conftest.py), so the only difference is the summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_blocksparse as jbs
from jax_blocksparse import training as jst
from jax_blocksparse.layers import budgets
from jax_blocksparse.layers.sparsify import Candidate, block_scores, path_filter, plan_sparsity, shape_reason
from jax_blocksparse.nnx import BlockLayout, BlockSparseConv, BlockSparseLinear

RTOL, ATOL = 2e-5, 2e-5


def expand(mask, block_size):
    """bool [C, K] from a block mask [CB, KB] (numpy, independent of the layout tables)."""
    return np.kron(np.asarray(mask, np.int8), np.ones((block_size, block_size), np.int8)).astype(bool)


class CNN(nnx.Module):
    """conv1 has 3 input channels (does not fit), head has 10 outputs (does not fit)."""

    def __init__(self, rngs, *, dtype=None, precision=None):
        kw = dict(dtype=dtype, precision=precision, rngs=rngs)
        self.conv1 = nnx.Conv(3, 16, (3, 3), **kw)
        self.conv2 = nnx.Conv(16, 32, (3, 3), strides=2, **kw)
        self.conv3 = nnx.Conv(32, 32, (3, 3), padding=((1, 1), (0, 2)), kernel_dilation=(1, 2), use_bias=False, **kw)
        self.fc = nnx.Linear(4 * 2 * 32, 64, **kw)  # conv3 maps 4 x 4 to 4 x 2
        self.head = nnx.Linear(64, 10, **kw)

    def __call__(self, x):
        x = nnx.relu(self.conv1(x))
        x = nnx.relu(self.conv2(x))
        x = nnx.relu(self.conv3(x))
        x = nnx.relu(self.fc(x.reshape(x.shape[0], -1)))
        return self.head(x)


class MLP(nnx.Module):
    """Layers in an nnx.List, one of them used twice (shared)."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs)])
        self.tied = self.layers[1]
        self.out = nnx.Linear(64, 16, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.layers[0](x))
        x = nnx.relu(self.layers[1](x))
        x = nnx.relu(self.tied(x))
        return self.out(x)


def trained_like(make, seed=1):
    """``make()``'s model with unit-scale weights and non-zero biases, as a trained model has
    (drawn with numpy into an abstract model: nothing to compile)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)
    fan_in = lambda s: s[-2] if len(s) > 1 else 4  # noqa: E731
    state = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) / np.sqrt(fan_in(a.shape)), a.dtype), state)
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def cnn():
    return trained_like(lambda: CNN(nnx.Rngs(0)))


@pytest.fixture(scope="module")
def images():
    return jnp.asarray(np.random.default_rng(7).normal(size=(2, 8, 8, 3)), jnp.float32)


def masked_dense(model, report, sparse):
    """The dense model with each converted layer's kernel zeroed outside its blocks (numpy)."""
    model = nnx.clone(model)
    for path in report.converted:
        layer, new = _at(model, path), _at(sparse, path)
        keep = expand(np.asarray(new.mask), new.block_size)
        layer.kernel[...] = jnp.where(keep, layer.kernel[...], 0)
    return model


def _at(model, path):
    node = model
    for key in path.split("/"):
        node = node[int(key)] if key.isdigit() else getattr(node, key)
    return node


# ---------------------------------------------------------------------------------
# The framework-neutral decisions
# ---------------------------------------------------------------------------------


def test_block_scores_match_the_block_norms_and_count_every_tap():
    W = np.random.default_rng(0).normal(size=(32, 48))
    np.testing.assert_allclose(block_scores(W, 16), jbs.layouts.block_norms(W, 16), rtol=1e-6)
    np.testing.assert_allclose(block_scores(W, 16, "l1"), np.abs(W).reshape(2, 16, 3, 16).sum((1, 3)))
    K = np.random.default_rng(1).normal(size=(3, 3, 32, 48))
    want = np.sqrt(sum(jbs.layouts.block_norms(K[i, j], 16) ** 2 for i in range(3) for j in range(3)))
    np.testing.assert_allclose(block_scores(K, 16), want, rtol=1e-6)
    with pytest.raises(ValueError, match="norm"):
        block_scores(W, 16, "l3")


def test_erk_counts_the_kernel_dims_of_a_conv():
    shapes = [(3, 3, 32, 64), (64, 64), (1024, 64)]
    d = budgets.erk_densities(shapes, 0.3)
    sizes = np.array([np.prod(s) for s in shapes], float)
    assert float((d * sizes).sum()) == pytest.approx(0.3 * sizes.sum())
    raw = np.array([sum(s) / np.prod(s) for s in shapes])
    free = d < 1
    np.testing.assert_allclose(d[free] / raw[free], (d[free] / raw[free])[0], rtol=1e-9)
    np.testing.assert_allclose(budgets.erk_densities([(64, 64)], 0.3), [0.3])
    with pytest.raises(ValueError, match="positive"):
        budgets.erk_densities([(3, 0, 16)], 0.3)


def test_shape_reason_and_path_filter():
    assert shape_reason("linear", (48, 64), 16) is None
    assert shape_reason("conv", (3, 3, 3, 16), 16) == "input channels 3 not a multiple of block_size 16"
    assert "input features 20 and output features 10" in shape_reason("linear", (20, 10), 8)
    keep = path_filter("*head")
    assert keep("head") and keep("model/head") and not keep("head/fc")
    assert path_filter(lambda p: p.startswith("enc"))("encoder/0")
    assert not path_filter(None)("anything")
    with pytest.raises(TypeError, match="keep_dense"):
        path_filter(3)


def _candidates():
    rng = np.random.default_rng(0)
    return [
        Candidate("a", "linear", "Linear", rng.normal(size=(64, 64)), 64),
        Candidate("b", "conv", "Conv", rng.normal(size=(3, 3, 32, 64)), 64),
        Candidate("c", "linear", "Linear", rng.normal(size=(64, 10)), 10),
        Candidate("d", "linear", "Linear", rng.normal(size=(64, 64)), 0, reason="custom dot_general"),
    ]


def test_plan_magnitude_uniform_budget_and_report():
    cands = _candidates()
    plans, report = plan_sparsity(cands, 0.25, 16)
    assert list(plans) == ["a", "b"] and report.converted == ("a", "b")
    assert report.left_dense == {"c": "output features 10 not a multiple of block_size 16", "d": "custom dot_general"}
    for c in cands[:2]:
        plan, scores = plans[c.path], block_scores(c.kernel, 16)
        mask = np.asarray(plan.mask)
        assert mask.sum() == round(0.25 * mask.size) and plan.capacity is None and not plan.dynamic
        assert scores[mask].min() >= scores[~mask].max()  # the blocks of largest norm
    a, b = report.row("a"), report.row("b")
    assert (a.params_before, a.params_after) == (64 * 64 + 64, 4 * 256 + 64)
    assert (b.params_before, b.params_after) == (9 * 32 * 64 + 64, 2 * 9 * 256 + 64)
    assert report.params_before == sum(c.params for c in cands)
    assert report.params_after == a.params_after + b.params_after + cands[2].params + cands[3].params
    text = str(report)
    assert "left dense: custom dot_general" in text and "4/16" in text and "total" in text


def test_plan_erk_selection_rules_keep_dense_and_dynamic():
    cands = _candidates()[:2]
    plans, report = plan_sparsity(cands, 0.25, 16, distribution="erk", dynamic=True, capacity_factor=1.5)
    d = budgets.erk_densities([c.shape for c in cands], 0.25)
    assert [np.asarray(p.mask).sum() for p in plans.values()] == list(budgets.allocate_blocks(d, [16, 8]))
    assert all(p.dynamic for p in plans.values())
    assert [p.capacity for p in plans.values()] == [
        min(16, int(np.ceil(1.5 * np.asarray(p.mask).sum()))) for p in plans.values()
    ]
    given = np.eye(4, dtype=bool)
    plans, report = plan_sparsity(
        cands, 0.5, 16, selection={"a": given, "b": functools.partial(jbs.layouts.random, seed=3)}
    )
    np.testing.assert_array_equal(np.asarray(plans["a"].mask), given)
    np.testing.assert_array_equal(np.asarray(plans["b"].mask), jbs.layouts.random((2, 4), 0.5, seed=3))
    plans, report = plan_sparsity(cands, 0.5, 16, keep_dense=["a"])
    assert list(plans) == ["b"] and report.left_dense == {"a": "matches keep_dense"}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(density=0.0), ValueError, r"density must be in \(0, 1\]"),
        (dict(density=1.5), ValueError, r"density must be in \(0, 1\]"),
        (dict(density="half"), TypeError, "density must be a number"),
        (dict(density=None), TypeError, "density must be a number"),
        (dict(block_size=12), ValueError, "block_size must be one of"),
        (dict(distribution="normal"), ValueError, "distribution must be one of"),
        (dict(norm="max"), ValueError, "norm must be one of"),
        (dict(capacity_factor=0.5), ValueError, "capacity_factor"),
        (dict(dynamic="yes"), TypeError, "dynamic must be a bool"),
        (dict(selection="largest"), ValueError, r"named rules are \('magnitude', 'column_balanced'\), got 'largest'"),
        (dict(selection=3), TypeError, "selection must be"),
        (dict(selection={"zz": np.ones((4, 4), bool)}), ValueError, r"selection names \['zz'\]"),
        (dict(selection={"c": np.ones((4, 1), bool)}), ValueError, "stay dense: c"),
        (dict(selection={"a": np.ones((2, 4), bool)}), ValueError, r"grid shape \(4, 4\), got \(2, 4\)"),
        (dict(selection={"a": np.zeros((4, 4), bool)}), ValueError, "selects no block"),
        (dict(selection={"a": np.full((4, 4), 0.5)}), TypeError, "boolean"),
        (dict(selection={"a": lambda grid, d: np.ones((3, 3), bool)}), ValueError, "grid shape"),
        (dict(strict=True), ValueError, r"2 layer\(s\) cannot be made block-sparse: c: output features 10"),
    ],
)
def test_plan_rejects_bad_arguments(kwargs, error, match):
    args = dict(density=0.5, block_size=16)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        plan_sparsity(_candidates(), args.pop("density"), args.pop("block_size"), **args)


def test_strict_does_not_count_keep_dense_and_traced_kernels_are_refused():
    plan_sparsity(_candidates()[:2], 0.5, 16, strict=True, keep_dense=["c", "d"])
    with pytest.raises(TypeError, match="concrete"):
        jax.jit(lambda w: Candidate("a", "linear", "Linear", w).shape)(jnp.ones((16, 16)))


# ---------------------------------------------------------------------------------
# NNX: the conversion is the dense model with blocks zeroed
# ---------------------------------------------------------------------------------


def test_density_one_computes_the_dense_model(cnn, images):
    sparse, report = jbs.nnx.sparsify(cnn, 1.0, 16)
    assert report.converted == ("conv2", "conv3", "fc")
    assert set(report.left_dense) == {"conv1", "head"}
    assert isinstance(sparse.conv2, BlockSparseConv) and isinstance(sparse.fc, BlockSparseLinear)
    assert isinstance(cnn.conv2, nnx.Conv)  # the input model is left alone
    np.testing.assert_allclose(sparse(images), cnn(images), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("density, distribution", [(0.5, "uniform"), (0.25, "erk")])
def test_density_d_computes_the_dense_model_with_blocks_zeroed(cnn, images, density, distribution):
    sparse, report = jbs.nnx.sparsify(cnn, density, 16, distribution=distribution)
    want = masked_dense(cnn, report, sparse)(images)
    np.testing.assert_allclose(sparse(images), want, rtol=RTOL, atol=ATOL)
    assert report.params_after < report.params_before
    # densify is the same dense model.
    dense = jbs.nnx.densify(sparse)
    assert type(dense.conv3) is nnx.Conv and type(dense.fc) is nnx.Linear and dense.conv3.bias is None
    np.testing.assert_allclose(dense(images), want, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(dense.fc.kernel[...], masked_dense(cnn, report, sparse).fc.kernel[...])


def test_attributes_carry_over():
    model = CNN(nnx.Rngs(0), dtype=jnp.bfloat16, precision="highest")
    sparse, _ = jbs.nnx.sparsify(model, 0.5, 16, impl="reference")
    for name in ("conv2", "conv3", "fc"):
        dense, new = getattr(model, name), getattr(sparse, name)
        assert new.dtype == jnp.bfloat16 and new.param_dtype == jnp.float32 and new.impl == "reference"
        assert new.precision == jax.lax.Precision.HIGHEST and new.use_bias == dense.use_bias
    assert (sparse.conv2.strides, sparse.conv3.padding, sparse.conv3.kernel_dilation) == (2, ((1, 1), (0, 2)), (1, 2))
    back = jbs.nnx.densify(sparse)
    assert back.fc.dtype == jnp.bfloat16 and back.conv3.kernel_dilation == (1, 2) and back.conv2.strides == 2


def test_shared_layers_stay_shared_and_containers_are_walked():
    model = trained_like(lambda: MLP(nnx.Rngs(0)))
    x = jnp.asarray(np.random.default_rng(3).normal(size=(4, 32)), jnp.float32)
    sparse, report = jbs.nnx.sparsify(model, 0.5, 16, keep_dense="out")
    assert report.converted == ("layers/0", "layers/1") and report.left_dense == {"out": "matches keep_dense"}
    assert isinstance(sparse.layers[1], BlockSparseLinear) and sparse.tied is sparse.layers[1]
    np.testing.assert_allclose(sparse(x), masked_dense(model, report, sparse)(x), rtol=RTOL, atol=ATOL)
    # A bare layer is replaced too.
    layer, _ = jbs.nnx.sparsify(nnx.Linear(32, 32, rngs=nnx.Rngs(0)), 0.5, 16)
    assert isinstance(layer, BlockSparseLinear)


def test_layers_that_do_not_fit_are_listed_or_an_error():
    class Odd(nnx.Module):
        def __init__(self, rngs):
            self.grouped = nnx.Conv(16, 16, (3, 3), feature_group_count=2, rngs=rngs)
            self.custom = nnx.Linear(16, 16, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k), rngs=rngs)
            self.typed = nnx.Linear(16, 16, preferred_element_type=jnp.float32, rngs=rngs)

    odd = trained_like(lambda: Odd(nnx.Rngs(0)))
    _, report = jbs.nnx.sparsify(odd, 0.5, 16)
    assert report.converted == ()
    assert report.left_dense == {
        "grouped": "feature_group_count=2 (grouped convolution)",
        "custom": "custom dot_general",
        "typed": "preferred_element_type=float32",
    }
    with pytest.raises(ValueError, match="strict=True.*grouped"):
        jbs.nnx.sparsify(odd, 0.5, 16, strict=True)


# ---------------------------------------------------------------------------------
# NNX: transforms, optax, orbax
# ---------------------------------------------------------------------------------


def test_jit_grad_vmap(cnn, images):
    sparse, report = jbs.nnx.sparsify(cnn, 0.5, 16)
    dense = masked_dense(cnn, report, sparse)
    loss = lambda m: jnp.sum(m(images) ** 2)  # noqa: E731
    graphdef, state = nnx.split(sparse)

    @nnx.jit  # one compilation for all of it
    def both(sparse, dense):
        batched = jax.vmap(lambda x: nnx.merge(graphdef, state)(x[None])[0])(images)
        return sparse(images), dense(images), nnx.grad(loss)(sparse), nnx.grad(loss)(dense), batched

    y_sparse, y_dense, g_sparse, g_dense, batched = both(sparse, dense)
    np.testing.assert_allclose(y_sparse, y_dense, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(batched, y_dense, rtol=RTOL, atol=ATOL)
    for name in ("conv2", "fc"):
        layer = getattr(sparse, name)
        gather = jbs.conv_from_dense if name == "conv2" else jbs.from_dense
        np.testing.assert_allclose(
            g_sparse[name]["kernel"][...], gather(g_dense[name]["kernel"][...], layer.layout), rtol=1e-4, atol=1e-4
        )
    np.testing.assert_allclose(g_sparse["head"]["bias"][...], g_dense["head"]["bias"][...], rtol=1e-4, atol=1e-4)


def test_optax_fine_tuning_lowers_the_loss(cnn, images):
    sparse, _ = jbs.nnx.sparsify(cnn, 0.25, 16)
    target = jnp.arange(2) % 10
    optimizer = nnx.Optimizer(sparse, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(images), target).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(sparse, optimizer)) for _ in range(5)]
    assert losses[-1] < losses[0]
    assert sparse.fc.kernel.shape == sparse.fc.layout.w_shape  # still block-sparse


def test_orbax_round_trip(cnn, images, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")
    sparse, report = jbs.nnx.sparsify(cnn, 0.5, 16, dynamic=True)
    assert report.row("conv2").note == "static layout: BlockSparseConv has no dynamic layout"
    graphdef, state = nnx.split(sparse)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", state)
    checkpointer.wait_until_finished()
    fresh, _ = jbs.nnx.sparsify(trained_like(lambda: CNN(nnx.Rngs(5)), seed=5), 0.5, 16, dynamic=True)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(fresh))
    restored = nnx.merge(graphdef, checkpointer.restore(tmp_path / "ckpt", abstract))
    np.testing.assert_array_equal(restored(images), sparse(images))
    assert np.asarray(restored.fc.layout.mask).tolist() == np.asarray(sparse.fc.layout.mask).tolist()


# ---------------------------------------------------------------------------------
# NNX: dynamic sparse training continues from the converted model
# ---------------------------------------------------------------------------------


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
    model = trained_like(
        lambda: nnx.Sequential(
            nnx.Linear(32, 64, rngs=nnx.Rngs(0)),
            nnx.relu,
            nnx.Linear(64, 64, rngs=nnx.Rngs(1)),
            nnx.relu,
            nnx.Linear(64, 16, rngs=nnx.Rngs(2)),
        )
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)
    target = jnp.arange(8) % 16
    sparse, report = jbs.nnx.sparsify(model, density, 16, dynamic=True, capacity_factor=capacity_factor)
    hidden = sparse.layers[2]
    assert isinstance(hidden.kernel_layout, BlockLayout) and all(r.dynamic for r in report.layers)
    before = int(np.asarray(hidden.layout.mask).sum())
    optimizer = nnx.Optimizer(sparse, optax.adam(1e-2), wrt=nnx.Param)
    loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), target).mean()  # noqa: E731

    @nnx.jit
    def train_step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    @nnx.jit(static_argnums=2)
    def sparsity_step(model, optimizer, step):
        grads = jst.nnx_dense_grads(loss_fn, model) if method.needs_grads else None
        return jst.nnx_update(method, step, model, optimizer, grads)

    changed = 0
    for step in (1, 2):  # one update, after step 2
        train_step(sparse, optimizer)
        if method.is_update_step(step):
            log = sparsity_step(sparse, optimizer, step)
            changed += int(np.asarray(log.pruned).sum())
    after = int(np.asarray(hidden.layout.mask).sum())
    assert changed > 0
    if isinstance(method, jst.MagnitudePruning):
        assert (before, after) == (16, 4)
    elif not isinstance(method, jst.SparseMomentum):
        assert after == before
    # The layout the layer multiplies with is the one dynamic training left: densify agrees.
    np.testing.assert_allclose(jbs.nnx.densify(sparse)(x), sparse(x), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------------
# Drop-in replacements: the call arguments of the layers they replace
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dense, sparse",
    [
        (nnx.Linear, BlockSparseLinear),
        (nnx.Conv, BlockSparseConv),
        (nnx.LinearGeneral, jbs.nnx.BlockSparseLinearGeneral),
        (nnx.Einsum, jbs.nnx.BlockSparseEinsum),
    ],
)
def test_replacements_take_every_call_argument_of_the_layer_they_replace(dense, sparse):
    # Against the installed Flax: an argument a new Flax adds fails here, not in a user's model.
    import inspect

    want = inspect.signature(dense.__call__).parameters
    got = inspect.signature(sparse.__call__).parameters
    for name, param in want.items():
        assert name in got, f"{sparse.__name__}.__call__ lacks {dense.__name__}'s argument {name!r}"
        assert (got[name].kind, got[name].default) == (param.kind, param.default), name
    assert list(got)[: len(want)] == list(want)  # the same order, for positional calls


class _ShardedMLP(nnx.Module):
    """An MLP written as Flax's NNX examples write them: products called with out_sharding."""

    def __init__(self, rngs):
        self.up = nnx.Linear(64, 128, rngs=rngs)
        self.down = nnx.Linear(128, 64, rngs=rngs)

    def __call__(self, x):
        from jax.sharding import PartitionSpec as P

        h = jax.nn.relu(self.up(x, out_sharding=P("data", "model")))
        return self.down(h, out_sharding=P("data", None))


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10),
    reason="the products on Explicit mesh axes need jax 0.10: jaxlib 0.8.1 leaves a 'Sharding' custom call "
    "around the custom_partitioning call that its CPU backend cannot run",
)
def test_out_sharding_places_the_result_as_the_dense_layer_does():
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from helpers import cpu_devices

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=cpu_devices(8))
    model = _ShardedMLP(nnx.Rngs(0))
    sparse, report = jbs.nnx.sparsify(model, density=1.0, block_size=16)
    assert all(layer.converted for layer in report.layers)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 64)), jnp.float32)
    with jax.set_mesh(mesh):
        x = jax.device_put(x, NamedSharding(mesh, P("data", None)))

        @jax.jit
        def both(x):
            return model(x), sparse(x), sparse.up(x, out_sharding=P("data", "model"))

        want, got, hidden = both(x)
    assert got.sharding.spec == want.sharding.spec == P("data", None)
    assert hidden.sharding.spec == P("data", "model")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
