"""Column-parallel layers (8 simulated CPU devices, see conftest): linen ColumnParallelDense
and nnx ColumnParallelLinear against the single-device BlockSparseDense / BlockSparseLinear
with the same (unsharded) weights.

* outputs and gradients, meshes (2, 4) ("batch", "model") and (8,) ("model"),
  gather_output True / False, with and without batch_axis; bfloat16 with float32_dw;
* init: the same key gives the single-device layer's kernel, sharded; partition specs;
  jit with the params' shardings puts shard i on the devices of model index i;
* gather_output=False compiles to no all-gather;
* errors for bad configurations.

Meshes are built from the CPU backend's devices and CPU is the default device inside
every test, whatever the default backend is.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import assert_close, collectives, cpu_mesh, make_mask, rand, xla_optimizations_off
from jax_blocksparse import sharding

F32, BF16 = jnp.float32, jnp.bfloat16
BS = 8
GRID = (3, 8)  # C = 24, K = 64
C, K = GRID[0] * BS, GRID[1] * BS
# "explicit": jax.make_mesh's default axis type, where shardings are part of the types.
MESHES = {"2x4": ((2, 4), ("batch", "model")), "8": ((8,), ("model",)), "2x4 explicit": ((2, 4), ("batch", "model"))}
LAYERS = ["linen", "nnx"]
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _mesh(name):
    shape, names = MESHES[name]
    if name.endswith("explicit"):
        return cpu_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))
    return cpu_mesh(shape, names)


def _in_mesh(mesh):
    """Explicit axes are used under ``jax.set_mesh``; Auto ones need no context."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    return jax.set_mesh(mesh) if explicit else contextlib.nullcontext()


@pytest.fixture
def quick_compiles():
    """For tests that compare with a tolerance; the init tests compare bits and compile as
    usual (with most optimisations off, a jitted truncated normal can differ by an ulp)."""
    with xla_optimizations_off():
        yield


@pytest.fixture(scope="module")
def mask():
    m = make_mask("random", GRID, seed=3)
    m[:, 2:4] = False  # shard 1 of 4 (and shards 2, 3 of 8) hold no blocks at all
    return m


def _pure(tree):
    """linen params dict or nnx State -> {"kernel": array, "bias": array}."""
    return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else dict(tree)


def _pair(kind, mask, mesh, dtype=None, float32_dw=False, **kw):
    """The column-parallel layer and the single-device one with equal weights (random bias).

    Returns (par_fn, par_params, ref_fn, ref_params, layer): fn(params, x) -> y.
    """
    bias = rand((K,), F32, 11)
    if kind == "linen":
        ref = jbs.nn.BlockSparseDense(K, mask, BS, dtype=dtype, float32_dw=float32_dw)
        layer = jbs.nn.ColumnParallelDense(K, mask, BS, mesh, "model", dtype=dtype, float32_dw=float32_dw, **kw)
        ref_params = {**ref.init(jax.random.key(0), jnp.ones((1, C)))["params"], "bias": bias}
        par_params = {"kernel": layer.shard_kernel(ref_params["kernel"]), "bias": bias}
        return (
            lambda p, x: layer.apply({"params": p}, x),
            par_params,
            lambda p, x: ref.apply({"params": p}, x),
            ref_params,
            layer,
        )
    ref = jbs.nnx.BlockSparseLinear(C, K, mask, BS, dtype=dtype, float32_dw=float32_dw, rngs=nnx.Rngs(0))
    layer = jbs.nnx.ColumnParallelLinear(
        C, K, mask, BS, mesh, "model", dtype=dtype, float32_dw=float32_dw, rngs=nnx.Rngs(1), **kw
    )
    ref.bias[...] = bias
    layer.kernel[...] = layer.shard_kernel(ref.kernel[...])
    layer.bias[...] = bias
    (ref_def, ref_state), (par_def, par_state) = nnx.split(ref), nnx.split(layer)
    return (lambda s, x: nnx.merge(par_def, s)(x), par_state, lambda s, x: nnx.merge(ref_def, s)(x), ref_state, layer)


def _forward_and_grads(fn, params, x, cotangent):
    y, vjp = jax.vjp(fn, params, x)
    grads, dx = vjp(cotangent.astype(y.dtype))
    return y, _pure(grads), dx


CASES = [
    ("2x4", None, True),
    ("2x4", None, False),
    ("2x4", "batch", True),
    ("2x4", "batch", False),
    ("8", None, True),
    ("8", None, False),
    ("2x4 explicit", "batch", True),
    ("2x4 explicit", None, False),
]


@pytest.mark.usefixtures("quick_compiles")
@pytest.mark.parametrize("kind", LAYERS)
@pytest.mark.parametrize("mesh_name, batch_axis, gather_output", CASES)
def test_equals_single_device(mask, kind, mesh_name, batch_axis, gather_output):
    mesh = _mesh(mesh_name)
    x, dy = rand((4, 2, C), F32, 12), rand((4, 2, K), F32, 13)
    with _in_mesh(mesh):
        par_fn, par_params, ref_fn, ref_params, layer = _pair(
            kind, mask, mesh, batch_axis=batch_axis, gather_output=gather_output
        )
        y, grads, dx = jax.jit(lambda p, x: _forward_and_grads(par_fn, p, x, dy))(par_params, x)
    ry, rgrads, rdx = _forward_and_grads(ref_fn, ref_params, x, dy)
    assert_close(y, ry, F32, C)
    assert_close(dx, rdx, F32, K)
    assert_close(grads["bias"], rgrads["bias"], F32, 8)
    # The weight gradient stays split: shard i holds the gradient of shard i's blocks.
    assert grads["kernel"].shape == (mesh.shape["model"], layer.shard_layouts.capacity, BS, BS)
    assert_close(grads["kernel"], layer.shard_kernel(rgrads["kernel"]), F32, 8)
    spec = tuple(y.sharding.spec) + (None,) * (y.ndim - len(y.sharding.spec))
    assert spec[-1] == (None if gather_output else "model"), y.sharding
    assert spec[0] == batch_axis, y.sharding


@pytest.mark.usefixtures("quick_compiles")
@pytest.mark.parametrize("kind, float32_dw", [("linen", True), ("nnx", False)])
def test_bfloat16(mask, kind, float32_dw):
    """dtype=bfloat16 (params float32): same as the single-device layer; float32_dw keeps dW float32."""
    par_fn, par_params, ref_fn, ref_params, layer = _pair(
        kind, mask, _mesh("2x4"), dtype=BF16, float32_dw=float32_dw, batch_axis="batch"
    )
    x, dy = rand((4, C), F32, 14), rand((4, K), F32, 15)
    y, grads, dx = jax.jit(lambda p, x: _forward_and_grads(par_fn, p, x, dy))(par_params, x)
    ry, rgrads, rdx = _forward_and_grads(ref_fn, ref_params, x, dy)
    assert y.dtype == BF16 and grads["kernel"].dtype == F32
    assert_close(y, ry, BF16, C)
    assert_close(dx, rdx, BF16, K)
    assert_close(grads["kernel"], layer.shard_kernel(rgrads["kernel"]), BF16, 8)
    if float32_dw:  # against the float32 product: only the bf16 rounding of x and dy
        x32, dy32 = x.astype(BF16).astype(F32), dy.astype(BF16).astype(F32)
        want = jbs.bsmm_updat(x32, dy32, layer.layout)
        assert_close(grads["kernel"], layer.shard_kernel(want), F32, 8)


def _check_placed(kernel, mesh, want):
    """kernel [n, cap, bs, bs] split over "model": every device holds shard i = its "model" index."""
    assert kernel.sharding.spec[0] == "model", kernel.sharding
    axis = mesh.axis_names.index("model")
    model_index = {d: idx[axis] for idx, d in np.ndenumerate(mesh.devices)}
    assert len(kernel.addressable_shards) == mesh.size
    for shard in kernel.addressable_shards:
        i = model_index[shard.device]
        assert shard.data.shape == (1,) + kernel.shape[1:] and shard.index[0] == slice(i, i + 1)
        np.testing.assert_array_equal(shard.data[0], want[i])


def test_linen_init_partitioning_and_placement(mask):
    mesh = _mesh("2x4")
    layer = jbs.nn.ColumnParallelDense(K, mask, BS, mesh, "model", bias_init=nn.initializers.normal(1.0))
    dense = jbs.nn.BlockSparseDense(K, mask, BS, bias_init=nn.initializers.normal(1.0))
    x, key = jnp.ones((2, C)), jax.random.key(7)
    abstract = jax.eval_shape(layer.init, key, x)
    specs = nn.get_partition_spec(abstract)["params"]
    assert specs["kernel"] == P("model", None, None, None) and specs["bias"] == P(None)
    variables = jax.jit(layer.init, out_shardings=nn.get_sharding(abstract, mesh))(key, x)
    assert isinstance(variables["params"]["kernel"], nn.Partitioned)
    params = nn.unbox(variables)["params"]
    # Same key: the same weights, sharded. Bits are compared jit to jit (eager, a jitted
    # initializer runs an executable cached by earlier tests, maybe with other flags).
    want = jax.jit(dense.init)(key, x)["params"]
    kernel = sharding.shard_blocks(want["kernel"], dense.layout, 4)
    np.testing.assert_array_equal(params["kernel"], kernel)
    np.testing.assert_array_equal(params["bias"], want["bias"])
    np.testing.assert_array_equal(layer.unshard_kernel(params["kernel"]), want["kernel"])
    _check_placed(params["kernel"], mesh, np.asarray(kernel))
    assert params["bias"].sharding.is_fully_replicated
    # Layouts: the full one is BlockSparseDense's; the shards' are split_columns of it.
    for t, w in zip(layer.layout.tables, dense.layout.tables):
        np.testing.assert_array_equal(t, w)
    for t, w in zip(layer.shard_layouts.tables, sharding.split_columns(dense.layout, 4).tables):
        np.testing.assert_array_equal(t, w)
    # The boxed (partitioned) variables apply as they are.
    assert_close(jax.jit(layer.apply)(variables, x), dense.apply({"params": want}, x), F32, C)


def test_nnx_init_partitioning_and_placement(mask):
    mesh = _mesh("2x4")
    kw = dict(bias_init=nnx.initializers.normal(1.0))
    layer = jbs.nnx.ColumnParallelLinear(C, K, mask, BS, mesh, "model", rngs=nnx.Rngs(3), **kw)
    lin = jbs.nnx.BlockSparseLinear(C, K, mask, BS, rngs=nnx.Rngs(3), **kw)
    specs = nnx.get_partition_spec(nnx.state(layer))
    assert specs["kernel"].get_value() == P("model", None, None, None)
    assert specs["bias"].get_value() == P(None)
    # Same rngs: the same weights, sharded (eager to eager; see the linen test).
    kernel = np.asarray(sharding.shard_blocks(lin.kernel[...], lin.layout, 4))
    np.testing.assert_array_equal(layer.kernel[...], kernel)
    np.testing.assert_array_equal(layer.bias[...], lin.bias[...])
    np.testing.assert_array_equal(layer.unshard_kernel(), lin.kernel[...])
    # Flax's eager sharding placed them as they were created.
    _check_placed(layer.kernel[...], mesh, kernel)
    assert layer.bias[...].sharding.is_fully_replicated
    # Host values placed from the annotations with plain jax.jit, as for a checkpoint restore.
    state = nnx.state(layer)
    host = jax.tree.map(np.asarray, state)
    placed = jax.jit(lambda s: s, out_shardings=nnx.get_named_sharding(state, mesh))(host)
    _check_placed(placed["kernel"].get_value(), mesh, kernel)
    for t, w in zip(layer.shard_layouts.tables, sharding.split_columns(lin.layout, 4).tables):
        np.testing.assert_array_equal(t, w)


@pytest.mark.usefixtures("quick_compiles")
@pytest.mark.parametrize("kind, gather_output", [("linen", False), ("nnx", False), ("linen", True)])
def test_only_gather_output_gathers(mask, kind, gather_output):
    par_fn, par_params, *_ = _pair(kind, mask, _mesh("2x4"), batch_axis="batch", gather_output=gather_output)
    hlo = jax.jit(par_fn).lower(par_params, rand((4, C), F32, 16)).compile().as_text()
    gathers = collectives(hlo)["all-gather"]
    assert (gathers == []) != gather_output, gathers  # True: exactly the output's column blocks
    assert all(g.startswith(f"f32[2,{K}]") for g in gathers), gathers


def test_split_columns_inside_a_trace(mask):
    """A concrete layout split while tracing (a layer's first call under jit) gives the same tables."""
    layout = jbs.Layout.from_mask(mask, BS)
    traced = jax.jit(lambda: sharding.split_columns(layout, 4).tables)()
    for t, want in zip(traced, sharding.split_columns(layout, 4).tables):
        np.testing.assert_array_equal(t, want)


def _build(kind, mask, mesh, axis="model", **kw):
    if kind == "linen":
        return jbs.nn.ColumnParallelDense(mask.shape[1] * BS, mask, BS, mesh, axis, **kw)
    return jbs.nnx.ColumnParallelLinear(
        mask.shape[0] * BS, mask.shape[1] * BS, mask, BS, mesh, axis, rngs=nnx.Rngs(0), **kw
    )


@pytest.mark.parametrize("kind", LAYERS)
def test_bad_input(mask, kind):
    name = "ColumnParallelDense" if kind == "linen" else "ColumnParallelLinear"
    mesh = _mesh("2x4")
    with pytest.raises(ValueError, match=rf"{name}: the size 8 of mesh axis 'model' must divide .* KB=6"):
        _build(kind, mask[:, :6], _mesh("8"))
    with pytest.raises(ValueError, match=rf"{name}: axis='rows' is not an axis of the mesh"):
        _build(kind, mask, mesh, axis="rows")
    with pytest.raises(ValueError, match=rf"{name}: batch_axis='data' is not an axis of the mesh"):
        _build(kind, mask, mesh, batch_axis="data")
    with pytest.raises(ValueError, match=rf"{name}: batch_axis must differ from axis, got both 'model'"):
        _build(kind, mask, mesh, batch_axis="model")
    with pytest.raises(TypeError, match=rf"{name}: mesh must be a jax.sharding.Mesh, got dict"):
        _build(kind, mask, {"model": 4})
    fullest = int(mask.reshape(GRID[0], 4, 2).sum(axis=(0, 2)).max())
    with pytest.raises(ValueError, match=rf"{name}: shard_capacity=1 is smaller than the {fullest} blocks"):
        _build(kind, mask, mesh, shard_capacity=1)
    with pytest.raises(TypeError, match=rf"{name}: gather_output must be a bool, got 'no'"):
        _build(kind, mask, mesh, gather_output="no")
    with pytest.raises(ValueError, match=rf"{name}: output features \(40\) must equal mask.shape\[1\] \* block_size"):
        if kind == "linen":
            jbs.nn.ColumnParallelDense(40, mask, BS, mesh, "model")
        else:
            jbs.nnx.ColumnParallelLinear(C, 40, mask, BS, mesh, "model", rngs=nnx.Rngs(0))
    layer = _build(kind, mask, mesh, shard_capacity=fullest + 1)
    assert layer.shard_layouts.capacity == fullest + 1
    x = jnp.ones((2, C + BS))
    expected = rf"{name}: inputs must have shape \[\.\.\., {C}\].*got inputs of shape \(2, 32\)"
    with pytest.raises(ValueError, match=expected):
        layer.init(jax.random.key(0), x) if kind == "linen" else layer(x)
