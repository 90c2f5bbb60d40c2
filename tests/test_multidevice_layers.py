"""Every Flax layer (linen and NNX) data parallel on 8 simulated CPU devices.

(The CPU backend's, see conftest, whatever the default backend is; CPU is the default
device inside every test.)

For each layer: loss and gradients with the batch split over devices, under
``jax.pmap`` (grads ``pmean``'d), ``jax.shard_map`` (loss ``pmean``'d, its transpose
all-reduces the grads) and ``jit`` of a batch-sharded ``NamedSharding`` input, equal
the one-device result; the compiled ``shard_map`` and ``jit`` programs contain no
all-gather (activations never cross devices, only weight-shaped gradient sums).

A new layer joins ``CASES``; ``test_every_layer_has_a_case`` fails until it does.
"""

import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import NUM_DEVICES, assert_close, collectives, cpu_devices, cpu_mesh, make_mask, rand, shard_map

F32 = jnp.float32
BS = 8
# Model-parallel layers split weights, not the batch: tests/test_parallel_layers.py.
MODEL_PARALLEL = {"ColumnParallelDense", "ColumnParallelLinear"}
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _mesh():
    return cpu_mesh((NUM_DEVICES,), ("batch",))


# ---------------------------------------------------------------------------------
# One small instance of each layer: (module or graphdef, params, x, loss(params, x))
# ---------------------------------------------------------------------------------

MASK = make_mask("random", (2, 3), seed=5)  # 16 -> 24 features
SQUARE = make_mask("random", (3, 3), seed=5)  # recurrent: 24 -> 24
DENSE_X = rand((NUM_DEVICES * 2, 2 * BS), F32, 6)
IMAGE_X = rand((NUM_DEVICES, 4, 4, 2 * BS), F32, 6)
SEQUENCE_X = rand((NUM_DEVICES, 2, 2 * BS), F32, 6)
ATTENTION_MASK = jbs.layouts.causal(jbs.layouts.local(4, 2))  # attention over T = 4 * BS
ATTENTION_X = rand((NUM_DEVICES, 4 * BS, 2 * BS), F32, 6)


def _linen(layer, x):
    params = jax.jit(layer.init)(jax.random.key(0), x[:1])["params"]

    def loss(params, x):
        return jnp.mean(jnp.sin(layer.apply({"params": params}, x)) ** 2)

    return params, x, loss


def _nnx(model, x):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # rest: the layout, if dynamic

    def loss(params, x):
        return jnp.mean(jnp.sin(nnx.merge(graphdef, params, rest)(x)) ** 2)

    return params, x, loss


def _linen_cell(kind):
    return getattr(jbs.nn, kind)(3 * BS, SQUARE, BS, layer_norm=False)


def _nnx_cell(kind):
    return getattr(jbs.nnx, kind)(2 * BS, 3 * BS, SQUARE, BS, layer_norm=False, rngs=nnx.Rngs(0))


CASES = {
    "nn.BlockSparseDense": lambda: _linen(jbs.nn.BlockSparseDense(3 * BS, MASK, BS), DENSE_X),
    "nn.BlockSparseConv": lambda: _linen(jbs.nn.BlockSparseConv(3 * BS, (3, 3), MASK, BS), IMAGE_X),
    "nn.BlockSparseConvTranspose": lambda: _linen(
        jbs.nn.BlockSparseConvTranspose(3 * BS, (3, 3), MASK, BS, strides=2), IMAGE_X
    ),
    # Cells step by step under flax's own nn.RNN; the fused sequence layer with an mLSTM.
    "nn.BlockSparseLSTMCell": lambda: _linen(nn.RNN(_linen_cell("BlockSparseLSTMCell")), SEQUENCE_X),
    "nn.BlockSparseMLSTMCell": lambda: _linen(nn.RNN(_linen_cell("BlockSparseMLSTMCell")), SEQUENCE_X),
    "nn.BlockSparseLSTM": lambda: _linen(jbs.nn.BlockSparseLSTM(_linen_cell("BlockSparseMLSTMCell")), SEQUENCE_X),
    "nnx.BlockSparseLinear": lambda: _nnx(
        jbs.nnx.BlockSparseLinear(2 * BS, 3 * BS, MASK, BS, rngs=nnx.Rngs(0)), DENSE_X
    ),
    "nnx.BlockSparseConv": lambda: _nnx(
        jbs.nnx.BlockSparseConv(2 * BS, 3 * BS, (3, 3), MASK, BS, rngs=nnx.Rngs(0)), IMAGE_X
    ),
    "nnx.BlockSparseConvTranspose": lambda: _nnx(
        jbs.nnx.BlockSparseConvTranspose(2 * BS, 3 * BS, (3, 3), MASK, BS, strides=2, rngs=nnx.Rngs(0)), IMAGE_X
    ),
    "nnx.BlockSparseLSTMCell": lambda: _nnx(nnx.RNN(_nnx_cell("BlockSparseLSTMCell"), rngs=False), SEQUENCE_X),
    "nnx.BlockSparseMLSTMCell": lambda: _nnx(nnx.RNN(_nnx_cell("BlockSparseMLSTMCell"), rngs=False), SEQUENCE_X),
    "nnx.BlockSparseLSTM": lambda: _nnx(jbs.nnx.BlockSparseLSTM(_nnx_cell("BlockSparseLSTMCell")), SEQUENCE_X),
    # Block-sparse q/k/v projections (MASK: 16 -> 24 features) in one, dense in the other. No
    # biases: the key bias's gradient is 0 (softmax ignores a shift), so its values are noise.
    "nn.BlockSparseSelfAttention": lambda: _linen(
        jbs.nn.BlockSparseSelfAttention(2, ATTENTION_MASK, BS, is_causal=True, qkv_mask=MASK, use_bias=False),
        ATTENTION_X,
    ),
    "nnx.BlockSparseSelfAttention": lambda: _nnx(
        jbs.nnx.BlockSparseSelfAttention(
            2, 2 * BS, ATTENTION_MASK, BS, is_causal=True, use_bias=False, rngs=nnx.Rngs(0)
        ),
        ATTENTION_X,
    ),
    # The general layers sparsify makes of nnx.LinearGeneral / nnx.Einsum (MASK over the flattened axes).
    "nnx.BlockSparseLinearGeneral": lambda: _nnx(
        jbs.nnx.BlockSparseLinearGeneral(2 * BS, (3, BS), MASK, BS, rngs=nnx.Rngs(0)), DENSE_X
    ),
    "nnx.BlockSparseEinsum": lambda: _nnx(
        jbs.nnx.BlockSparseEinsum("bd,df->bf", (2 * BS, 3 * BS), (3 * BS,), MASK, BS, rngs=nnx.Rngs(0)), DENSE_X
    ),
    "nn.BlockSparseMoE": lambda: _linen(jbs.nn.BlockSparseMoE(num_experts=4, ffn=2 * BS, block_size=BS), DENSE_X),
    "nnx.BlockSparseMoE": lambda: _nnx(
        jbs.nnx.BlockSparseMoE(2 * BS, 4, 2 * BS, block_size=BS, glu=True, rngs=nnx.Rngs(0)), DENSE_X
    ),
}
# A MoE layer routes its tokens together: under a jit of a batch-sharded input XLA gathers
# them to sort them by expert. Per device (pmap, shard_map) it routes its own tokens and
# nothing crosses devices; expert parallelism is tests/test_moe.py's.
ROUTES_ACROSS_THE_BATCH = {"nn.BlockSparseMoE", "nnx.BlockSparseMoE"}


def test_every_layer_has_a_case():
    layers = set()
    for prefix, module, base in (("nn", jbs.nn, nn.Module), ("nnx", jbs.nnx, nnx.Module)):
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, base) and name not in MODEL_PARALLEL:
                layers.add(f"{prefix}.{name}")
    assert layers == set(CASES), f"missing: {layers - set(CASES)}, stale: {set(CASES) - layers}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_layer_data_parallel(name):
    params, x, loss = CASES[name]()
    want_loss, want = jax.value_and_grad(loss)(params, x)
    mesh, n = _mesh(), NUM_DEVICES

    def averaged(params, x):  # per device: local loss and grads, then the mean over devices
        return jax.lax.pmean(jax.value_and_grad(loss)(params, x), "batch")

    split = x.reshape((n, x.shape[0] // n) + x.shape[1:])
    pmapped = jax.pmap(averaged, axis_name="batch", in_axes=(None, 0), devices=cpu_devices(n))(params, split)
    results = {"pmap": jax.tree.map(lambda a: a[0], pmapped)}

    in_specs = (P(), P("batch"))
    if name.endswith("Cell"):
        # Flax's RNN scans from a zero carry that does not vary over the mesh axis while
        # the step's output does, which replication checking rejects (flax's own LSTMCell
        # too): map pmap-style, unchecked, and pmean the grads by hand.
        kwargs = {"check_vma": False} if hasattr(jax, "shard_map") else {"check_rep": False}
        mapped = jax.jit(shard_map()(averaged, mesh=mesh, in_specs=in_specs, out_specs=P(), **kwargs))
    else:
        # With replication checking: pmean the loss; its transpose all-reduces grads.
        def global_loss(params, x):
            return jax.lax.pmean(loss(params, x), "batch")

        mapped = jax.jit(shard_map()(jax.value_and_grad(global_loss), mesh=mesh, in_specs=in_specs, out_specs=P()))
    # jit of a batch-sharded input: XLA partitions the program, bsmm by its sharding rule.
    xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
    sharded = jax.jit(jax.value_and_grad(loss))
    for mode, fn, arg in (("shard_map", mapped, x), ("jit", sharded, xs)):
        if not (mode == "jit" and name in ROUTES_ACROSS_THE_BATCH):
            assert collectives(fn.lower(params, arg).compile().as_text())["all-gather"] == [], mode
        results[mode] = fn(params, arg)

    for got_loss, got in results.values():
        assert_close(got_loss, want_loss, F32, 64)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, w, F32, 64)
