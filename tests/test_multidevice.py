"""Multiple devices (8 simulated CPU devices, see conftest): data and model parallelism.

Every test runs on the CPU backend (meshes of conftest's ``cpu_devices``, CPU as the
default device), whatever the default backend is.

* jit with a batch-sharded NamedSharding: the sharding rule (ops/_partitioning.py)
  splits bsmm instead of gathering its input, under both partitioners, and also for a
  lowering XLA cannot see into (a host callback standing in for a custom call).
* Every layer under pmap and shard_map: tests/test_multidevice_layers.py.
* 8-device training (examples/data_parallel.py) equals 1-device training: tests/test_examples.py.
* Model parallel: jbs.sharding, weights split by output block columns.
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_blocksparse as jbs
from helpers import (
    NUM_DEVICES,
    assert_close,
    collectives,
    cpu_mesh,
    make_mask,
    make_problem,
    rand,
    shard_map,
)
from jax_blocksparse import sharding
from jax_blocksparse.ops import matmul
from jax_blocksparse.ops._partitioning import mark_partitioned, partitioned

F32 = jnp.float32
ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("cpu_default_device")


def _mesh(shape=(NUM_DEVICES,), names=("batch",)):
    return cpu_mesh(shape, names)


# ---------------------------------------------------------------------------------
# jit with NamedSharding inputs: the sharding rule
# ---------------------------------------------------------------------------------

OPS = {
    "fprop": lambda a, b, layout: jbs.bsmm(a, b, layout),
    "transpose": lambda a, b, layout: jbs.bsmm(a, b, layout, transpose=True),
    "updat": lambda a, b, layout: jbs.bsmm_updat(a, b, layout),
}


@pytest.fixture(scope="module")
def problem():
    return make_problem("random", 8, grid=(3, 4))


def _operands(op, layout, w, lead=(NUM_DEVICES * 2,)):
    c, k = layout.shape
    if op == "fprop":
        return rand(lead + (c,), F32, 1), w
    if op == "transpose":
        return rand(lead + (k,), F32, 1), w
    return rand(lead + (c,), F32, 1), rand(lead + (k,), F32, 2)


@pytest.mark.parametrize(
    "op, partitioner",
    [("fprop", "shardy"), ("transpose", "shardy"), ("updat", "shardy"), ("fprop", "gspmd")],
)
def test_jit_batch_sharded_does_not_gather(problem, op, partitioner):
    """Forward and grad (which uses all three primitives), Shardy and the GSPMD partitioner."""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", partitioner == "shardy")
    try:
        _check_jit_batch_sharded(problem, op)
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


def _check_jit_batch_sharded(problem, op):
    mask, layout, w = problem
    mesh = _mesh()
    a, b = _operands(op, layout, w, lead=(NUM_DEVICES * 2, 3))
    rows, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    a_s = jax.device_put(a, rows)
    b_s = jax.device_put(b, rows if op == "updat" else replicated)
    fn = OPS[op]

    def loss(a, b):
        return jnp.sum(jnp.sin(fn(a, b, layout)))

    cases = ((lambda a, b: fn(a, b, layout), fn(a, b, layout)), (jax.grad(loss, (0, 1)), jax.grad(loss, (0, 1))(a, b)))
    for f, want in cases:
        lowered = jax.jit(f).lower(a_s, b_s)
        assert "CustomSPMDPartitioning" in lowered.as_text()  # the rule is in the program
        found = collectives(lowered.compile().as_text())
        assert found["all-gather"] == [] and found["all-to-all"] == [], found
        # Only weight-shaped sums cross devices (updat's result, grads of w), never rows.
        assert all(s.startswith(f"f32[{layout.capacity},") for s in found["all-reduce"]), found
        got = jax.jit(f)(a_s, b_s)
        for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert_close(g, wnt, F32, 64)
    out = jax.jit(lambda a, b: fn(a, b, layout))(a_s, b_s)
    assert out.sharding.is_fully_replicated if op == "updat" else out.sharding.spec[0] == "batch"


def test_jit_two_dim_mesh_and_vmap(problem):
    """Rows split over two mesh axes at once; a vmapped batch of layouts inside jit."""
    mask, layout, w = problem
    mesh = _mesh((2, 4), ("data", "seq"))
    x = rand((4, 8, 24), F32, 3)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "seq")))
    f = jax.jit(jax.grad(lambda x, w: jnp.sum(jbs.bsmm(x, w, layout) ** 2), argnums=(0, 1)))
    found = collectives(f.lower(xs, w).compile().as_text())
    assert found["all-gather"] == [], found
    for g, want in zip(f(xs, w), jax.grad(lambda x, w: jnp.sum(jbs.bsmm(x, w, layout) ** 2), argnums=(0, 1))(x, w)):
        assert_close(g, want, F32, 64)
    ws = jnp.stack([w, 2 * w])
    got = jax.jit(jax.vmap(lambda w_: jbs.bsmm(xs, w_, layout)))(ws)
    assert_close(got, jnp.stack([jbs.bsmm(x, w, layout), jbs.bsmm(x, 2 * w, layout)]), F32, 32)


# A stand-in for a custom call XLA cannot partition: the primitive's lowering is a host
# callback. Without the rule XLA gathers x to run it; with the rule each device runs it
# on its own rows. (Compiled, not run: a host callback inside a custom_partitioning
# body is not kept alive for execution, unlike an FFI kernel.)
_opaque_p = Primitive("bsmm_fprop")
_opaque_p.def_abstract_eval(lambda *args, **params: matmul.bsmm_fprop_p.abstract_eval(*args, **params)[0])


def _opaque_rule(ctx, *operands, block_size, out_dtype, impl, lhs_dtype=None):
    (out,) = ctx.avals_out

    def host(x, w, block_rows, block_cols, col_ptr, row_ptr, row_slots, *orders):  # numpy only; orders unused
        cb, kb = len(row_ptr) - 1, len(col_ptr) - 1
        W = np.zeros((cb, block_size, kb, block_size), np.float32)
        for s in range(int(col_ptr[-1])):
            W[block_rows[s], :, block_cols[s], :] += w[s]
        return (np.asarray(x, np.float32) @ W.reshape(cb * block_size, kb * block_size)).astype(out_dtype)

    def call(*ops):
        return jax.pure_callback(host, jax.ShapeDtypeStruct(out.shape, out.dtype), *ops, vmap_method="sequential")

    return mlir.lower_fun(call, multiple_results=False)(ctx, *operands)


def _bind_opaque(x, w, layout):
    return _opaque_p.bind(
        *mark_partitioned([x, w, *layout.tables]),
        block_size=layout.block_size,
        out_dtype=np.dtype(F32),
        impl="reference",
        lhs_dtype=None,
    )


@pytest.mark.parametrize("with_rule", [True, False])
def test_rule_partitions_an_opaque_lowering(problem, with_rule):
    mask, layout, w = problem
    mlir.register_lowering(_opaque_p, partitioned(_opaque_p, _opaque_rule) if with_rule else _opaque_rule)
    x = rand((NUM_DEVICES * 2, 24), F32, 4)
    xs = jax.device_put(x, NamedSharding(_mesh(), P("batch")))
    f = jax.jit(lambda x: _bind_opaque(x, w, layout))
    hlo = f.lower(xs).compile().as_text()
    assert (collectives(hlo)["all-gather"] == []) == with_rule, collectives(hlo)
    # The callback's result: the local rows [2, 32] with the rule, all rows without.
    calls = [line for line in hlo.splitlines() if "custom-call(" in line]
    rows = {int(r) for line in calls for r in re.findall(r"f32\[(\d+),32\]", line)}
    assert rows == {2} if with_rule else 2 not in rows, calls
    if not with_rule:
        assert_close(f(xs), jbs.bsmm(x, w, layout), F32, 32)


# ---------------------------------------------------------------------------------
# Model parallel: output block columns split over devices
# ---------------------------------------------------------------------------------


BS = 8


@pytest.fixture(scope="module")
def wide():
    mask = make_mask("random", (3, 8), seed=7)
    mask[:, 2:4] = False  # one shard (of 4) with no blocks at all
    layout = jbs.Layout.from_mask(mask, BS, capacity=int(mask.sum()) + 2)
    w = jbs.from_dense(rand(layout.shape, F32, 8), layout)
    return mask, layout, w


@pytest.mark.parametrize("num_shards", [1, 4, 8])
def test_split_columns_and_blocks(wide, num_shards):
    mask, layout, w = wide
    layouts = sharding.split_columns(layout, num_shards)
    w_sh = sharding.shard_blocks(w, layout, num_shards)
    per = layout.grid[1] // num_shards
    assert layouts.grid == (3, per) and w_sh.shape == (num_shards,) + layouts.w_shape
    assert layouts.capacity == max(int(mask[:, i * per : (i + 1) * per].sum()) for i in range(num_shards))
    W = jbs.to_dense(w, layout)
    for i in range(num_shards):
        shard = jax.tree.map(lambda t: t[i], layouts)
        np.testing.assert_array_equal(shard.mask, mask[:, i * per : (i + 1) * per])
        np.testing.assert_array_equal(jbs.to_dense(w_sh[i], shard), W[:, i * per * BS : (i + 1) * per * BS])
    np.testing.assert_array_equal(sharding.unshard_blocks(w_sh, layout), w)
    if num_shards != 4:
        return
    # A traced layout (inside jit) with an explicit capacity gives the same tables.
    traced = jax.jit(
        lambda m: sharding.split_columns(
            jbs.Layout.from_mask(m, BS, capacity=layout.capacity), num_shards, capacity=layouts.capacity
        )
    )(mask)
    for t, want in zip(traced.tables, layouts.tables):
        np.testing.assert_array_equal(t, want)


@pytest.mark.parametrize("gather_output", [True, False])
def test_column_parallel_equals_one_device(wide, gather_output):
    mask, layout, w = wide
    mesh = _mesh((2, 4), ("batch", "model"))
    layouts, w_sh = sharding.split_columns(layout, 4), sharding.shard_blocks(w, layout, 4)
    x = rand((6, 3 * BS), F32, 9)

    def mp(x, w_sh):
        return sharding.column_parallel_bsmm(
            x, w_sh, layouts, mesh, "model", batch_axis="batch", gather_output=gather_output
        )

    y = jax.jit(mp)(x, w_sh)
    assert_close(y, jbs.bsmm(x, w, layout), F32, 32)
    assert y.sharding.spec[-1] == (None if gather_output else "model") or len(y.sharding.spec) < 2
    if gather_output:  # no activation crosses devices but the column blocks of y
        found = collectives(jax.jit(mp).lower(x, w_sh).compile().as_text())
        assert all(s.startswith("f32[3,") or s.startswith("f32[6,") for s in found["all-gather"]), found

    def loss_mp(x, w_sh):
        return jnp.sum(jnp.sin(mp(x, w_sh)))

    gx, gw = jax.jit(jax.grad(loss_mp, argnums=(0, 1)))(x, w_sh)
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(jbs.bsmm(x, w, layout))), argnums=(0, 1))(x, w)
    assert_close(gx, rx, F32, 32)
    assert_close(sharding.unshard_blocks(gw, layout), rw, F32, 32)
    assert_close(gw, sharding.shard_blocks(rw, layout, 4), F32, 32)


def test_sharding_bad_input(wide):
    mask, layout, w = wide
    mesh = _mesh((2, 4), ("batch", "model"))
    with pytest.raises(ValueError, match=r"num_shards=3 must be >= 1 and divide .* KB=8"):
        sharding.split_columns(layout, 3)
    with pytest.raises(TypeError, match="num_shards must be an int"):
        sharding.split_columns(layout, 2.0)
    with pytest.raises(ValueError, match=r"capacity=1 is smaller than the \d+ blocks"):
        sharding.split_columns(layout, 2, capacity=1)
    with pytest.raises(ValueError, match=r"traced layout needs an explicit capacity"):
        jax.jit(lambda m: sharding.split_columns(jbs.Layout.from_mask(m, BS, capacity=24), 2).tables)(mask)
    with pytest.raises(ValueError, match=r"shard_blocks: w must have shape \(\d+, 8, 8\)"):
        sharding.shard_blocks(w[1:], layout, 2)
    with pytest.raises(ValueError, match=r"unshard_blocks: w_shards must have shape \[num_shards, capacity, 8, 8\]"):
        sharding.unshard_blocks(w, layout)
    layouts, w_sh = sharding.split_columns(layout, 4), sharding.shard_blocks(w, layout, 4)
    with pytest.raises(ValueError, match=r"axis='rows' is not an axis of the mesh"):
        sharding.column_parallel_bsmm(rand((2, 24)), w_sh, layouts, mesh, "rows")
    with pytest.raises(ValueError, match=r"need w_shards \(2, .*mesh axis 'batch'.*got w_shards \(4,"):
        sharding.column_parallel_bsmm(rand((2, 24)), w_sh, layouts, mesh, "batch")
    with pytest.raises(ValueError, match=r"x must have shape \[\.\.\., C=24\].*got \(2, 16\)"):
        sharding.column_parallel_bsmm(rand((2, 16)), w_sh, layouts, mesh, "model")
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        sharding.column_parallel_bsmm(rand((2, 24)), w_sh, layouts, None, "model")
    with pytest.raises(ValueError, match="no sharding rule for primitive 'not_a_library_op'"):
        partitioned(Primitive("not_a_library_op"), _opaque_rule)


def test_shard_map_with_automatic_axes(problem):
    """shard_map manual over one axis, the batch axis left to XLA: right results.

    The sharding rule stands aside there (JAX passes custom_partitioning no mesh), so
    an opaque kernel is run on operands gathered over the automatic axis (docs/guide/multi_device.rst).
    """
    mask, layout, w = problem
    mesh = _mesh((2, 4), ("batch", "model"))
    x = rand((8, 24), F32, 5)
    xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
    f = jax.jit(
        shard_map()(
            lambda x, w: jax.grad(lambda x: jnp.sum(jbs.bsmm(x, w, layout) ** 2))(x),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(),
            axis_names={"model"},
        )
    )
    assert_close(f(xs, w), jax.grad(lambda x: jnp.sum(jbs.bsmm(x, w, layout) ** 2))(x), F32, 64)


@pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 10),
    reason="the gradient on Explicit mesh axes needs jax 0.10: the XLA of jaxlib 0.8.1 fails to compile it "
    "('Unsupported reduction computation' of the psum around the custom_partitioning call)",
)
def test_explicit_mesh_axes(problem):
    """On Explicit mesh axes (jax.make_mesh's default) shardings are types: the
    primitives' abstract eval states the rule (rows kept, updat replicated)."""
    mask, layout, w = problem
    mesh = cpu_mesh((2, 4), ("batch", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = rand((NUM_DEVICES * 2, 24), F32, 6)

    def loss(x, w):
        return jnp.sum(jnp.sin(jbs.bsmm(x, w, layout)))

    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
        y = jax.jit(lambda x, w: jbs.bsmm(x, w, layout))(xs, w)
        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        gx, gw = f(xs, w)
        compiled = f.lower(xs, w).compile().as_text()
    assert tuple(y.sharding.spec)[:1] == ("batch",) and tuple(gx.sharding.spec)[:1] == ("batch",)
    assert all(s is None for s in gw.sharding.spec), gw.sharding
    assert collectives(compiled)["all-gather"] == [], collectives(compiled)
    assert_close(y, jbs.bsmm(x, w, layout), F32, 32)
    for got, want in zip((gx, gw), jax.grad(loss, argnums=(0, 1))(x, w)):
        assert_close(got, want, F32, 64)
