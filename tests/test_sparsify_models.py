"""sparsify on models written the way Flax users write them.

Four models in the styles of Flax's own examples and large JAX codebases, each
sparsified in one call and checked the same way: exact at density 1 (float32, HIGHEST),
trained under jit + optax at density 0.25, and through a checkpoint (orbax) and an
export (``jax.export``) round trip:

* a linen Transformer LM: ``nn.with_logical_partitioning`` on every kernel,
  ``nn.MultiHeadDotProductAttention`` (its projections are ``nn.DenseGeneral``); also run
  sharded on 8 CPU devices under a mesh with logical axis rules, against one device;
* an NNX Transformer: ``nnx.MultiHeadAttention`` (``nnx.LinearGeneral``), a gated FFN
  with an ``nnx.Einsum`` branch, ``out_sharding`` calls and ``nnx.RMSNorm``;
* a scanned stack of NNX blocks (``nnx.vmap`` to create, ``nnx.scan`` to run): one
  layout per layer, stacked;
* a linen ResNet whose ``nn.BatchNorm`` normalises over a named axis (``axis_name``).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import save_restore
from jax_blocksparse.layers.sparsify import block_scores

ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the checkpoint extra) is not installed")

pytestmark = pytest.mark.usefixtures("cpu_default_device")

BS = 16
VOCAB, EMB, HEADS, MLP, T = 64, 32, 2, 64, 8


def _logical(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


def _causal(batch, t):
    return nn.make_causal_mask(jnp.ones((batch, t), jnp.int32))


def _close(got, want, atol=1e-5):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=atol)


def _save_restore(path, state):
    """``state`` through an orbax checkpoint, restored into its own shapes and dtypes."""
    return save_restore(path, state, jax.tree.map(ocp.utils.to_shape_dtype_struct, state))


def _exported_call(fun, *args):
    """``fun(*args)`` through jax.export: exported, serialized, deserialized and called."""
    exported = jbs.export.export(jax.jit(fun), platforms=("cpu",))(*args)
    return jax.export.deserialize(exported.serialize()).call(*args)


def _train(loss_fn, params, steps: int = 4):
    """Adam steps under jit; the losses."""
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = optimizer.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return params, losses


def _next_token_loss(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


# ---------------------------------------------------------------------------------
# A linen Transformer LM with logical partitioning
# ---------------------------------------------------------------------------------


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        attention = nn.MultiHeadDotProductAttention(
            HEADS, kernel_init=_logical(("embed", "heads", "kv")), out_kernel_init=_logical(("heads", "kv", "embed"))
        )
        x = x + attention(nn.LayerNorm()(x), mask=_causal(*x.shape[:2]))
        y = nn.Dense(MLP, kernel_init=_logical(("embed", "mlp")))(nn.LayerNorm()(x))
        return x + nn.Dense(EMB, kernel_init=_logical(("mlp", "embed")))(nn.gelu(y))


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, EMB, embedding_init=_logical(("vocab", "embed")))(tokens)
        for _ in range(2):
            x = LinenBlock()(x)
        return nn.Dense(VOCAB, kernel_init=_logical(("embed", "vocab")), name="head")(x)


@pytest.fixture(scope="module")
def linen_lm():
    model = LinenLM()
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    return model, model.init(jax.random.key(1), tokens), tokens


def test_linen_lm_converts_every_projection_and_is_exact_at_density_1(linen_lm):
    model, variables, tokens = linen_lm
    sparse, sparse_vars, report = jbs.nn.sparsify(model, variables, tokens, density=1.0, block_size=BS)
    # Every DenseGeneral of the attention, every Dense of the MLPs and the head.
    assert len(report.converted) == 2 * (4 + 2) + 1 and not report.left_dense
    assert {r.layer_type for r in report.layers} == {"DenseGeneral", "Dense"}
    query = report.row("LinenBlock_0/MultiHeadDotProductAttention_0/query")
    assert query.shape == (EMB, HEADS, EMB // HEADS) and query.blocks == (EMB // BS) ** 2
    with jax.default_matmul_precision("highest"):
        _close(sparse.apply(sparse_vars, tokens), model.apply(variables, tokens))
    # The boxes stay boxes, with the names the layouts honour.
    assert isinstance(sparse_vars["params"]["head"]["kernel"], nn.LogicallyPartitioned)
    specs = nn.get_partition_spec(sparse_vars)["params"]
    assert specs["LinenBlock_0"]["Dense_0"]["kernel"] == P("mlp", None, None)
    dense_vars = jbs.nn.densify(sparse, sparse_vars)
    assert nn.get_partition_spec(dense_vars) == nn.get_partition_spec(variables)
    for got, want in zip(jax.tree.leaves(nn.unbox(dense_vars)), jax.tree.leaves(nn.unbox(variables))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_linen_lm_trains_checkpoints_and_exports_at_density_quarter(linen_lm, tmp_path):
    model, variables, tokens = linen_lm
    sparse, sparse_vars, report = jbs.nn.sparsify(model, variables, tokens, density=0.25, block_size=BS)
    assert report.row("LinenBlock_1/MultiHeadDotProductAttention_0/out").density == 0.25
    params = nn.unbox(sparse_vars)["params"]
    params, losses = _train(lambda p: _next_token_loss(sparse.apply({"params": p}, tokens), tokens), params)
    assert losses[-1] < losses[0]
    restored = _save_restore(tmp_path / "lm", params)
    want = sparse.apply({"params": params}, tokens)
    _close(sparse.apply({"params": restored}, tokens), want, atol=0)
    _close(_exported_call(lambda p, t: sparse.apply({"params": p}, t), params, tokens), want)


RULES = (("batch", "data"), ("vocab", None), ("embed", None), ("mlp", "model"), ("heads", "model"), ("kv", None))


def test_linen_lm_runs_sharded_on_8_devices_with_its_logical_rules(linen_lm):
    model, variables, tokens = linen_lm
    sparse, sparse_vars, report = jbs.nn.sparsify(
        model, variables, tokens, density=0.5, block_size=BS, selection="column_balanced"
    )
    single = sparse.apply(nn.unbox(sparse_vars), tokens)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(sparse_vars), mesh, RULES)
    placed = jax.device_put(nn.unbox(sparse_vars), shardings)
    up = placed["params"]["LinenBlock_0"]["Dense_0"]["kernel"]
    assert up.sharding.spec == P("model", None, None) and len(up.sharding.device_set) == 8
    batch = jax.device_put(jnp.tile(tokens, (4, 1)), jax.sharding.NamedSharding(mesh, P("data")))
    with jax.default_matmul_precision("highest"):
        sharded = jax.jit(sparse.apply)(placed, batch)
        want = jnp.tile(sparse.apply(nn.unbox(sparse_vars), tokens), (4, 1, 1))
    _close(sharded, want)
    _close(single, want[:2])
    # The report says which kernels lost names: the input axes of every kernel.
    assert "LinenBlock_0/Dense_1" in report.lost_partitioning


# ---------------------------------------------------------------------------------
# An NNX Transformer: gated FFN with an Einsum branch, out_sharding calls, RMSNorm
# ---------------------------------------------------------------------------------


class NNXBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, out_sharding=None):
        self.out_sharding = out_sharding
        self.norm1, self.norm2 = nnx.RMSNorm(EMB, rngs=rngs), nnx.RMSNorm(EMB, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, EMB, decode=False, rngs=rngs)
        self.gate = nnx.Linear(EMB, MLP, use_bias=False, rngs=rngs)
        self.up = nnx.Einsum("btd,df->btf", (EMB, MLP), rngs=rngs)
        self.down = nnx.Linear(MLP, EMB, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x), mask=_causal(*x.shape[:2]))
        h = self.norm2(x)
        hidden = nnx.silu(self.gate(h, out_sharding=self.out_sharding)) * self.up(h, out_sharding=self.out_sharding)
        return x + self.down(hidden, out_sharding=self.out_sharding)


class NNXLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, out_sharding=None):
        self.out_sharding = out_sharding
        self.embed = nnx.Embed(VOCAB, EMB, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs, out_sharding) for _ in range(2)])
        self.head = nnx.Linear(EMB, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens, out_sharding=self.out_sharding)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _nnx_round_trips(sparse, tokens, tmp_path):
    """Trains ``sparse`` a few steps (nnx.jit, nnx.Optimizer), then checks a checkpoint and
    an export round trip of its state."""
    optimizer = nnx.Optimizer(sparse, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(lambda m: _next_token_loss(m(tokens), tokens))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(sparse, optimizer)) for _ in range(4)]
    assert losses[-1] < losses[0]
    want = sparse(tokens)
    graphdef, state = nnx.split(sparse)
    pure = nnx.to_pure_dict(state)
    restored = _save_restore(tmp_path / "nnx", pure)
    nnx.replace_by_pure_dict(state, restored)
    _close(nnx.merge(graphdef, state)(tokens), want, atol=0)

    # An exported program's arguments are serialized with their tree: string keys only, so a
    # list of leaves (nnx.List's keys are ints).
    leaves, treedef = jax.tree.flatten(state)

    def call(leaves, t):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(t)

    _close(_exported_call(call, leaves, tokens), want)


def test_nnx_transformer_converts_linear_general_and_einsum_and_is_exact(tmp_path):
    model = NNXLM(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    sparse, report = jbs.nnx.sparsify(model, 1.0, BS)
    types = {r.path: r.layer_type for r in report.layers}
    assert types["blocks/0/attn/query"] == "LinearGeneral" and types["blocks/0/up"] == "Einsum"
    assert not report.left_dense and len(report.converted) == 2 * (4 + 3) + 1
    assert type(sparse.blocks[0].attn.out).__name__ == "BlockSparseLinearGeneral"
    assert type(sparse.blocks[0].up).__name__ == "BlockSparseEinsum"
    with jax.default_matmul_precision("highest"):
        _close(sparse(tokens), model(tokens))
        dense = jbs.nnx.densify(sparse)
        assert type(dense.blocks[1].attn.key) is nnx.LinearGeneral and type(dense.blocks[1].up) is nnx.Einsum
        _close(dense(tokens), model(tokens))
    quarter, _ = jbs.nnx.sparsify(model, 0.25, BS)
    _nnx_round_trips(quarter, tokens, tmp_path)


def test_nnx_transformer_with_out_sharding_runs_on_an_explicit_mesh():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tokens = jax.random.randint(jax.random.key(0), (8, T), 0, VOCAB)
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        model = NNXLM(nnx.Rngs(0), out_sharding=P("data", None, None))
        sparse, _ = jbs.nnx.sparsify(model, 0.5, BS)
        batch = jax.device_put(tokens, P("data"))
        out = nnx.jit(lambda m, t: m(t))(sparse, batch)
        assert out.sharding.spec[0] == "data"
    reference = NNXLM(nnx.Rngs(0))
    plain, _ = jbs.nnx.sparsify(reference, 0.5, BS)
    _close(out, plain(tokens), atol=1e-4)


# ---------------------------------------------------------------------------------
# A scanned stack of blocks
# ---------------------------------------------------------------------------------


class ScannedMLPs(nnx.Module):
    """``layers`` residual MLP blocks created under nnx.vmap and run by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs, layers: int = 3):
        self.embed = nnx.Embed(VOCAB, EMB, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0)
        def create(key):
            block_rngs = nnx.Rngs(key)
            return nnx.Sequential(
                nnx.LayerNorm(EMB, rngs=block_rngs),
                nnx.Linear(EMB, MLP, rngs=block_rngs),
                nnx.gelu,
                nnx.Linear(MLP, EMB, rngs=block_rngs),
            )

        self.blocks = create(jax.random.split(rngs.params(), layers))
        self.head = nnx.Linear(EMB, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block, x):
            return x + block(x)

        return self.head(run(self.blocks, self.embed(tokens)))


def test_scanned_stack_gets_one_layout_per_layer(tmp_path):
    model = ScannedMLPs(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    sparse, report = jbs.nnx.sparsify(model, 1.0, BS)
    assert [p for p in report.converted if p.startswith("blocks/layers/1")] == [
        f"blocks/layers/1[{i}]" for i in range(3)
    ]
    with jax.default_matmul_precision("highest"):
        _close(sparse(tokens), model(tokens))
    quarter, report = jbs.nnx.sparsify(model, 0.25, BS)
    layer = quarter.blocks.layers[1]
    layout = layer.kernel_layout.get_value()
    assert layer.kernel.shape == (3, 2, BS, BS) and np.asarray(layout.tables.col_ptr).shape == (3, MLP // BS + 1)
    masks = np.asarray(jax.vmap(lambda lo: lo.mask)(layout))
    dense = np.asarray(model.blocks.layers[1].kernel[...])
    for i in range(3):  # each layer kept its own largest blocks
        scores = block_scores(dense[i], BS)
        assert masks[i].sum() == 2 and scores[masks[i]].min() >= scores[~masks[i]].max()
    dense_again = jbs.nnx.densify(quarter)
    assert dense_again.blocks.layers[1].kernel.shape == (3, EMB, MLP)
    _close(dense_again(tokens), quarter(tokens))
    _nnx_round_trips(quarter, tokens, tmp_path)


def test_a_partly_kept_stack_is_refused_by_name():
    model = ScannedMLPs(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"stacked 'blocks/layers/1' must all convert.*\['blocks/layers/1\[0\]'\]"):
        jbs.nnx.sparsify(model, 0.5, BS, keep_dense="blocks/layers/1[[]0]")


# ---------------------------------------------------------------------------------
# A BatchNorm ResNet that normalises over a named axis
# ---------------------------------------------------------------------------------


class ResBlock(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        norm = dict(use_running_average=not train, axis_name="data" if train else None, momentum=0.9)
        y = nn.relu(nn.BatchNorm(**norm)(nn.Conv(32, (3, 3), use_bias=False)(x)))
        y = nn.BatchNorm(**norm)(nn.Conv(32, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        norm = dict(use_running_average=not train, axis_name="data" if train else None, momentum=0.9)
        x = nn.relu(nn.BatchNorm(**norm)(nn.Conv(32, (3, 3), use_bias=False)(x)))
        for _ in range(2):
            x = ResBlock()(x, train)
        return nn.Dense(10)(x.mean(axis=(1, 2)))


def test_batchnorm_resnet_over_a_named_axis(tmp_path):
    model = ResNet()
    images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
    labels = jnp.arange(4) % 10
    variables = model.init(jax.random.key(1), images)
    sparse, sparse_vars, report = jbs.nn.sparsify(model, variables, images, density=1.0, block_size=BS)
    # The first conv sees 3 channels and the head has 10 outputs: both stay dense.
    assert set(report.left_dense) == {"Conv_0", "Dense_0"} and len(report.converted) == 4
    with jax.default_matmul_precision("highest"):
        _close(sparse.apply(sparse_vars, images), model.apply(variables, images), atol=1e-4)

    sparse, sparse_vars, _ = jbs.nn.sparsify(model, variables, images, density=0.25, block_size=BS)
    stats = sparse_vars["batch_stats"]

    def loss(params):
        def group(x, y):  # each group normalised with the statistics of all groups (axis "data")
            logits, updates = sparse.apply(
                {"params": params, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        return jax.vmap(group, axis_name="data")(images.reshape(2, 2, 8, 8, 3), labels.reshape(2, 2)).mean()

    params, losses = _train(loss, sparse_vars["params"])
    assert losses[-1] < losses[0]
    trained = {"params": params, "batch_stats": stats}
    want = sparse.apply(trained, images)
    _close(sparse.apply(_save_restore(tmp_path / "resnet", trained), images), want, atol=0)
    _close(_exported_call(sparse.apply, trained, images), want, atol=1e-5)


def test_dynamic_training_moves_the_unstacked_layers_and_leaves_a_stack():
    from jax_blocksparse import training as jst

    model = ScannedMLPs(nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, T), 0, VOCAB)
    sparse, _ = jbs.nnx.sparsify(model, 0.5, BS, dynamic=True)  # the head: a dynamic layer
    assert isinstance(sparse.blocks.layers[1].kernel_layout, jbs.nnx.StackedLayout)
    assert isinstance(sparse.head.kernel_layout, jbs.nnx.BlockLayout)
    stacked_before = np.asarray(sparse.blocks.layers[1].kernel[...])
    optimizer = nnx.Optimizer(sparse, optax.adam(1e-2), wrt=nnx.Param)
    method = jst.get_method("rigl", density=0.5, total_steps=10, update_every=1)
    grads = jst.nnx_dense_grads(lambda m: _next_token_loss(m(tokens), tokens), sparse)
    jst.nnx_update(method, 1, sparse, optimizer, grads)
    np.testing.assert_array_equal(sparse.blocks.layers[1].kernel[...], stacked_before)
    assert sparse(tokens).shape == (2, T, VOCAB)
