"""The dropless mixture-of-experts: topology, products and layers against a per-token dense reference.

The reference sends each token through its k experts one by one (dense einsums with the
expert's own weights) and sums the outputs weighted by the gates: no sorting, no
padding, no blocks. Values and gradients must agree in float32 at HIGHEST; bf16 within
its rounding. Routing edge cases: every token to one expert, experts with no token, fewer
rows than one block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import save_restore
from jax_blocksparse.layers import moe as core
from jax_blocksparse.ops import moe

pytestmark = pytest.mark.usefixtures("cpu_default_device")

D, E, F, BS = 32, 4, 32, 16


def reference_moe(x, params, experts, gates, activation=jax.nn.gelu, glu=False):
    """Each token through its experts, one choice at a time, weighted by its gates: [T, D]."""
    out = jnp.zeros_like(x)
    for j in range(experts.shape[1]):
        pick = experts[:, j]
        w_in = params["w_in"][:, pick].transpose(1, 0, 2)  # [T, D, F]
        w_out = params["w_out"][:, pick].transpose(1, 0, 2)  # [T, D, F] (stored transposed)
        h = jnp.einsum("td,tdf->tf", x, w_in)
        if glu:
            h = activation(jnp.einsum("td,tdf->tf", x, params["w_gate"][:, pick].transpose(1, 0, 2))) * h
        else:
            h = activation(h)
        out = out + gates[:, j : j + 1] * jnp.einsum("tf,tdf->td", h, w_out)
    return out


def _params(key, glu=False, dtype=jnp.float32):
    config = core.check_moe(E, F, 2, BS, "softmax", False, glu, "test")
    keys = jax.random.split(key, 4)
    return {
        name: core.default_init(name)(k, shape, dtype)
        for k, (name, shape) in zip(keys, core.param_shapes(config, D).items())
    }


def _products(x, params, experts, gates, activation=jax.nn.gelu):
    topology = moe.route_topology(experts, E, F, BS)
    rows = moe.dispatch(x, topology)
    hidden = activation(moe.expert_up(rows, params["w_in"].reshape(D, -1), topology))
    return moe.combine(moe.expert_down(hidden, params["w_out"].reshape(D, -1), topology), gates, topology)


ROUTINGS = {
    "random": lambda t: jax.random.randint(jax.random.key(3), (t, 2), 0, E),
    "all_to_one": lambda t: jnp.stack([jnp.full(t, 2), jnp.full(t, 2)], axis=1),
    "one_expert_idle": lambda t: jax.random.randint(jax.random.key(4), (t, 2), 0, E - 1),
    "distinct_pairs": lambda t: jnp.stack([jnp.arange(t) % E, (jnp.arange(t) + 1) % E], axis=1),
}


@pytest.mark.parametrize("tokens", [3, 37], ids=["fewer_rows_than_a_block", "several_blocks"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_products_match_the_per_token_reference_with_gradients(routing, tokens):
    x = jax.random.normal(jax.random.key(0), (tokens, D))
    params = _params(jax.random.key(1))
    experts = ROUTINGS[routing](tokens).astype(jnp.int32)
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(2), (tokens, 2)))
    with jax.default_matmul_precision("highest"):
        got = jax.jit(_products)(x, params, experts, gates)
        want = reference_moe(x, params, experts, gates)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        grads = jax.grad(lambda *a: jnp.sum(_products(*a) ** 2), argnums=(0, 1, 3))(x, params, experts, gates)
        wants = jax.grad(lambda *a: jnp.sum(reference_moe(*a) ** 2), argnums=(0, 1, 3))(x, params, experts, gates)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(wants)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_topology_rows_are_sorted_padded_and_bounded():
    experts = jnp.array([[1, 0], [1, 3], [1, 0]], jnp.int32)
    topology = moe.route_topology(experts, E, F, BS)
    rows = moe.padded_rows(3, 2, E, BS)
    assert rows == BS * ((6 + E * (BS - 1)) // BS) and topology.token_of.shape == (rows,)
    np.testing.assert_array_equal(topology.counts, [2, 3, 0, 1])
    # expert 0 first (rows 0, 1: tokens 0 and 2), expert 1 from row 16, expert 3 from row 32
    np.testing.assert_array_equal(topology.row_of, [[16, 0], [17, 32], [18, 1]])
    token_of = np.asarray(topology.token_of)
    assert token_of[[0, 1, 16, 17, 18, 32]].tolist() == [0, 2, 0, 1, 2, 1] and (token_of[2:16] == 3).all()
    layout = topology.layout
    assert int(layout.nnz) == 3 * (F // BS) and layout.capacity == (rows // BS) * (F // BS)
    mask = np.asarray(layout.mask)
    assert mask[0, :2].all() and mask[1, 2:4].all() and mask[2, 6:8].all() and mask.sum() == 6


def test_a_new_routing_does_not_recompile():
    x = jax.random.normal(jax.random.key(0), (24, D))
    params, gates = _params(jax.random.key(1)), jnp.full((24, 2), 0.5)
    traces = []

    @jax.jit
    def f(experts):
        traces.append(1)
        return _products(x, params, experts, gates)

    for routing in ("random", "all_to_one", "distinct_pairs"):
        f(ROUTINGS[routing](24).astype(jnp.int32))
    assert len(traces) == 1


def test_vmap_over_groups_of_tokens():
    x = jax.random.normal(jax.random.key(0), (3, 10, D))
    params = _params(jax.random.key(1))
    experts = jax.random.randint(jax.random.key(2), (3, 10, 2), 0, E)
    gates = jnp.full((3, 10, 2), 0.5)
    with jax.default_matmul_precision("highest"):
        got = jax.vmap(_products, in_axes=(0, None, 0, 0))(x, params, experts, gates)
        for g in range(3):
            np.testing.assert_allclose(got[g], reference_moe(x[g], params, experts[g], gates[g]), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------
# Router and losses
# ---------------------------------------------------------------------------------


def test_router_ties_go_to_the_lower_expert_and_renormalised_gates_sum_to_one():
    logits = jnp.array([[1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    routed = core.route(logits, 2, renormalize=True)
    np.testing.assert_array_equal(routed.experts, [[1, 2], [0, 1]])
    np.testing.assert_allclose(routed.gates.sum(-1), 1.0, rtol=1e-6)
    sigmoid = core.route(logits.astype(jnp.bfloat16), 1, gate="sigmoid")
    assert sigmoid.gates.dtype == jnp.float32
    np.testing.assert_allclose(sigmoid.gates[:, 0], jax.nn.sigmoid(jnp.array([3.0, 0.0])), rtol=1e-6)


def test_losses_are_switch_and_st_moe():
    probs = jnp.full((8, E), 1 / E)
    uniform = jnp.stack([jnp.arange(8) % E, (jnp.arange(8) + 1) % E], 1)
    assert float(core.load_balancing_loss(probs, uniform, E)) == pytest.approx(1.0)
    one_hot = jnp.zeros((8, E)).at[:, 0].set(1.0)
    assert float(core.load_balancing_loss(one_hot, jnp.zeros((8, 1), jnp.int32), E)) == pytest.approx(E)
    logits = jax.random.normal(jax.random.key(0), (8, E))
    want = np.mean(np.log(np.exp(np.asarray(logits, np.float64)).sum(-1)) ** 2)
    assert float(core.router_z_loss(logits)) == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------


def _layer_reference(x, params, top_k=2, glu=False, gate="softmax", renormalize=False):
    tokens = x.reshape(-1, D)
    logits = jnp.dot(tokens, params["router"], precision="highest")
    routed = core.route(logits, top_k, gate, renormalize)
    return reference_moe(tokens, params, routed.experts, routed.gates, glu=glu).reshape(x.shape)


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
def test_linen_layer_matches_the_reference_and_sows_its_stats(glu):
    layer = jbs.nn.BlockSparseMoE(num_experts=E, ffn=F, block_size=BS, glu=glu, renormalize=True)
    x = jax.random.normal(jax.random.key(0), (2, 9, D))
    variables = layer.init(jax.random.key(1), x)
    assert variables["params"]["w_in"].shape == (D, E, F) and ("w_gate" in variables["params"]) == glu
    with jax.default_matmul_precision("highest"):
        y, state = layer.apply(variables, x, mutable=["intermediates"])
        np.testing.assert_allclose(
            y, _layer_reference(x, variables["params"], glu=glu, renormalize=True), rtol=1e-5, atol=1e-5
        )
        grads = jax.grad(lambda p: jnp.sum(layer.apply({"params": p}, x) ** 2))(variables["params"])
        wants = jax.grad(lambda p: jnp.sum(_layer_reference(x, p, glu=glu, renormalize=True) ** 2))(variables["params"])
    for name in ("w_in", "w_out") + (("w_gate",) if glu else ()):
        np.testing.assert_allclose(grads[name], wants[name], rtol=1e-4, atol=1e-5)
    # The router's gradient flows through the gates (top-k itself is piecewise constant).
    np.testing.assert_allclose(grads["router"], wants["router"], rtol=1e-4, atol=1e-5)
    stats = state["intermediates"]
    assert int(stats["expert_counts"][0].sum()) == 2 * 18
    assert float(stats["load_balancing_loss"][0]) > 0 and float(stats["router_z_loss"][0]) > 0


def _call_capturing(model, x):
    """``model(x)`` and what it sowed: nnx.capture where Flax has it, else a call and nnx.pop."""
    if hasattr(nnx, "capture"):
        return nnx.capture(model, nnx.Intermediate)(x)
    y = model(x)
    return y, nnx.pop(model, nnx.Intermediate)


def test_nnx_layer_matches_linen_and_trains():
    x = jax.random.normal(jax.random.key(0), (16, D))
    model = jbs.nnx.BlockSparseMoE(D, E, F, block_size=BS, gate="sigmoid", rngs=nnx.Rngs(0))
    params = {name: getattr(model, name)[...] for name in ("router", "w_in", "w_out")}
    linen = jbs.nn.BlockSparseMoE(num_experts=E, ffn=F, block_size=BS, gate="sigmoid")
    with jax.default_matmul_precision("highest"):
        y, sown = _call_capturing(model, x)
        np.testing.assert_allclose(y, linen.apply({"params": params}, x), rtol=1e-6, atol=1e-6)
    assert sown["expert_counts"][0].shape == (E,)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    target = jax.random.normal(jax.random.key(1), (16, D))

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(m):
            y, aux = _call_capturing(m, x)
            return jnp.mean((y - target) ** 2) + 1e-2 * aux["load_balancing_loss"][0]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(5)]
    assert losses[-1] < losses[0]


def test_bf16_layer_is_within_bf16_rounding_of_float32():
    x = jax.random.normal(jax.random.key(0), (32, D))
    layer = jbs.nn.BlockSparseMoE(num_experts=E, ffn=F, block_size=BS, dtype=jnp.bfloat16)
    variables = layer.init(jax.random.key(1), x)
    y = layer.apply(variables, x)
    assert y.dtype == jnp.bfloat16
    want = _layer_reference(x, variables["params"])
    # bf16 keeps 8 bits: two products of length 32 each round to about 2**-8 relative.
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=0, atol=4e-2 * float(jnp.abs(want).max()))


def test_layer_exports_and_checkpoints(tmp_path):
    pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint (the checkpoint extra) is not installed")
    layer = jbs.nn.BlockSparseMoE(num_experts=E, ffn=F, block_size=BS, glu=True)
    x = jax.random.normal(jax.random.key(0), (12, D))
    variables = layer.init(jax.random.key(1), x)
    want = layer.apply(variables, x)
    exported = jbs.export.export(jax.jit(layer.apply), platforms=("cpu",))(variables, x)
    np.testing.assert_allclose(jax.export.deserialize(exported.serialize()).call(variables, x), want, rtol=1e-6)
    np.testing.assert_array_equal(layer.apply(save_restore(tmp_path / "moe", variables), x), want)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_experts=0), ValueError, "num_experts must be a positive int, got 0"),
        (dict(top_k=5), ValueError, "top_k=5 is more than num_experts=4"),
        (dict(ffn=40), ValueError, "ffn=40 must be a multiple of block_size=16"),
        (dict(block_size=12), ValueError, "block_size"),
        (dict(gate="relu"), ValueError, r"gate must be one of \('softmax', 'sigmoid'\), got 'relu'"),
        (dict(glu=1), TypeError, "glu must be a bool"),
        (dict(impl="fast"), ValueError, "impl"),
    ],
)
def test_bad_configuration_is_named(kwargs, error, match):
    args = dict(num_experts=E, ffn=F, block_size=BS)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        jbs.nn.BlockSparseMoE(**args).init(jax.random.key(0), jnp.ones((4, D)))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"experts must be an int array \[tokens, top_k\], got float32"):
        moe.route_topology(jnp.zeros((4, 2)), E, F, BS)
    layer = jbs.nn.BlockSparseMoE(num_experts=E, ffn=F, block_size=BS)
    variables = layer.init(jax.random.key(0), jnp.ones((4, D)))
    with pytest.raises(ValueError, match=r"inputs must have shape \[\.\.\., 32\], got \(4, 16\)"):
        layer.apply(variables, jnp.ones((4, 16)))
    with pytest.raises(ValueError, match="hold no token"):
        layer.apply(variables, jnp.ones((0, D)))


# ---------------------------------------------------------------------------------
# Expert parallelism on 8 devices
# ---------------------------------------------------------------------------------


def _mesh():
    return jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("glu", [False, True], ids=["plain", "glu"])
def test_expert_parallel_layer_equals_one_device_in_values_and_gradients(glu):
    mesh = _mesh()
    single = jbs.nn.BlockSparseMoE(num_experts=16, ffn=F, block_size=BS, glu=glu)
    split = jbs.nn.BlockSparseMoE(num_experts=16, ffn=F, block_size=BS, glu=glu, mesh=mesh, expert_axis="expert")
    x = jax.random.normal(jax.random.key(0), (4, 16, D))  # 64 tokens, 8 per device
    variables = single.init(jax.random.key(1), x)

    def loss(layer, params):
        y, state = layer.apply({"params": params}, x, mutable=["intermediates"])
        return jnp.sum(y**2) + state["intermediates"]["load_balancing_loss"][0], (y, state["intermediates"])

    with jax.default_matmul_precision("highest"):
        (l1, (y1, s1)), g1 = jax.value_and_grad(lambda p: loss(single, p), has_aux=True)(variables["params"])
        (l2, (y2, s2)), g2 = jax.jit(jax.value_and_grad(lambda p: loss(split, p), has_aux=True))(variables["params"])
    np.testing.assert_allclose(y2, y1, rtol=1e-5, atol=1e-6)
    assert "all_to_all" in str(jax.make_jaxpr(lambda p: split.apply({"params": p}, x))(variables["params"]))
    for name in g1:
        np.testing.assert_allclose(g2[name], g1[name], rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(s2["expert_counts"][0], s1["expert_counts"][0])
    assert int(s2["overflow"][0]) == 0
    np.testing.assert_allclose(s2["load_balancing_loss"][0], s1["load_balancing_loss"][0], rtol=1e-6)
    np.testing.assert_allclose(s2["router_z_loss"][0], s1["router_z_loss"][0], rtol=1e-6)


def test_a_capacity_factor_counts_the_choices_it_drops():
    mesh = _mesh()
    x = jnp.abs(jax.random.normal(jax.random.key(0), (64, D))) + 0.1
    # Every token to experts 0 and 1 (positive inputs, logits 10 * sum(x) there), both on
    # device 0: its buffers overflow.
    router_init = lambda key, shape, dtype: jnp.zeros(shape, dtype).at[:, :2].set(10.0)  # noqa: E731
    layer = jbs.nn.BlockSparseMoE(
        num_experts=16,
        ffn=F,
        block_size=BS,
        mesh=mesh,
        expert_axis="expert",
        capacity_factor=2.0,
        router_init=router_init,
    )
    variables = layer.init(jax.random.key(1), x)
    _, state = jax.jit(lambda v: layer.apply(v, x, mutable=["intermediates"]))(variables)
    # Each device's 8 tokens make 16 choices for device 0, whose buffer from it holds 2 * 16 / 8 = 4.
    assert int(state["intermediates"]["overflow"][0]) == 8 * (16 - 4)
    dropless = layer.clone(capacity_factor=None)
    _, state = jax.jit(lambda v: dropless.apply(v, x, mutable=["intermediates"]))(variables)
    assert int(state["intermediates"]["overflow"][0]) == 0


def test_expert_parallel_nnx_layer_and_its_errors():
    mesh = _mesh()
    x = jax.random.normal(jax.random.key(0), (32, D))
    model = jbs.nnx.BlockSparseMoE(D, 8, F, block_size=BS, mesh=mesh, expert_axis="expert", rngs=nnx.Rngs(0))
    plain = jbs.nnx.BlockSparseMoE(D, 8, F, block_size=BS, rngs=nnx.Rngs(0))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(_call_capturing(model, x)[0], _call_capturing(plain, x)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="num_experts=4 and the 32 tokens must be multiples of it"):
        _call_capturing(
            jbs.nnx.BlockSparseMoE(D, 4, F, block_size=BS, mesh=mesh, expert_axis="expert", rngs=nnx.Rngs(0)), x
        )
    with pytest.raises(ValueError, match=r"axis 'model' is not an axis of the mesh \('expert',\)"):
        _call_capturing(
            jbs.nnx.BlockSparseMoE(D, 8, F, block_size=BS, mesh=mesh, expert_axis="model", rngs=nnx.Rngs(0)), x
        )
    with pytest.raises(ValueError, match="needs both mesh and expert_axis"):
        _call_capturing(jbs.nnx.BlockSparseMoE(D, 8, F, block_size=BS, expert_axis="expert", rngs=nnx.Rngs(0)), x)
    with pytest.raises(ValueError, match="capacity_factor applies to expert parallelism"):
        _call_capturing(jbs.nnx.BlockSparseMoE(D, 8, F, block_size=BS, capacity_factor=1.0, rngs=nnx.Rngs(0)), x)
