"""Tests of jax_blocksparse.training: dynamic sparse training with block-sparse layers.

Small grids and few steps throughout (2 shared CPU cores): what is tested is the
bookkeeping (budgets, schedules, remapping, invariants, compile counts), against
dense references built from the masks alone.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jax_blocksparse as jbs
from jax_blocksparse import training as jst
from jax_blocksparse.nn import BlockSparseDense
from jax_blocksparse.nnx import BlockSparseLinear
from jax_blocksparse.nnx.linear import BlockLayout

BS = 8
SHAPES = {"layer0": (32, 64), "layer1": (64, 16)}  # grids 4x8 and 8x2
TOTAL_STEPS = 40


def _method(name, **kw):
    base = dict(density=0.3, update_every=5, seed=0)
    if name in ("set", "rigl", "sparse_momentum"):
        base["total_steps"] = TOTAL_STEPS
    if name == "rigl":
        base["drop_fraction"] = 0.5
    if name == "sparse_momentum":
        base["capacity_factor"] = 2.0
    if name == "magnitude":
        base.update(begin_step=0, end_step=20)
    base.update(kw)
    return jst.get_method(name, **base)


class MLP(nn.Module):
    plan: dict
    dtype: object = None

    @nn.compact
    def __call__(self, x):
        for i, (name, p) in enumerate(self.plan.items()):
            x = BlockSparseDense(
                SHAPES[name][1], p.mask, BS, capacity=p.capacity, dynamic=True, dtype=self.dtype, name=name
            )(x)
            if i < len(self.plan) - 1:
                x = nn.relu(x)
        return x


def _data(seed=0, n=24):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, 32)), jax.random.randint(ky, (n,), 0, 16)


TRACES = {}  # (kind, key) -> number of traces


@functools.cache
def _compiled(method, dtype=None):
    """Model, loss and jitted init / train / update steps for a method (cached: compile once)."""
    plan = method.plan(SHAPES, BS)
    model = MLP(plan, dtype)
    tx = optax.adam(1e-2)
    key = (method, dtype)

    def loss_fn(params, layouts, x, y):
        logits = model.apply({"params": params, "layout": layouts}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()

    @jax.jit
    def init(rng, x):
        variables = model.init(rng, x)
        return variables["params"], variables["layout"], tx.init(variables["params"])

    @jax.jit
    def train_step(params, layouts, opt_state, x, y):
        TRACES[("train", key)] = TRACES.get(("train", key), 0) + 1
        grads = jax.grad(loss_fn)(params, layouts, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def update_step(step, params, layouts, opt_state, x, y):
        TRACES[("update", key)] = TRACES.get(("update", key), 0) + 1
        grads = jst.dense_grads(loss_fn, params, layouts, x, y) if method.needs_grads else None
        return method.update(step, params, layouts, opt_state, grads)

    return plan, model, loss_fn, init, train_step, update_step


@functools.cache
def _dense_grads_fn(method):
    loss_fn = _compiled(method)[2]
    return jax.jit(lambda params, layouts, x, y: jst.dense_grads(loss_fn, params, layouts, x, y))


class Run:
    """A small linen MLP trained with a method (Adam), using the cached jitted steps."""

    def __init__(self, method, *, dtype=None, seed=0):
        self.method = method
        self.key = (method, dtype)
        self.plan, self.model, self.loss_fn, init, self.train_step, self.update_step = _compiled(method, dtype)
        self.params, self.layouts, self.opt_state = init(jax.random.key(seed), _data()[0])
        self.logs = []

    def train(self, steps, *, start=1):
        for step in range(start, start + steps):
            x, y = _data(step)
            self.params, self.opt_state = self.train_step(self.params, self.layouts, self.opt_state, x, y)
            if self.method.is_update_step(step):
                out = self.update_step(step, self.params, self.layouts, self.opt_state, x, y)
                self.params, self.layouts, self.opt_state, log = out
                self.logs.append(log)
        return self

    def traces(self):
        return {kind: TRACES.get((kind, self.key), 0) for kind in ("train", "update")}

    def layout_list(self):
        return [self.layouts[name]["kernel"] for name in SHAPES]


def _np_mask(layout):
    return np.asarray(layout.mask)


# ---------------------------------------------------------------------------------
# Schedules and budgets
# ---------------------------------------------------------------------------------


def test_cosine_decay_values():
    f = lambda t: float(jst.cosine_decay(t, 100, 0.5))  # noqa: E731
    assert f(0) == pytest.approx(0.5)
    assert f(50) == pytest.approx(0.25)
    assert f(25) == pytest.approx(0.25 * (1 + np.cos(np.pi / 4)))
    assert f(100) == pytest.approx(0.0, abs=1e-7) and f(150) == pytest.approx(0.0, abs=1e-7)
    assert float(jst.cosine_decay(100, 100, 0.5, 0.1)) == pytest.approx(0.1)
    # Traced step: same values under jit.
    np.testing.assert_allclose(
        jax.jit(lambda t: jst.cosine_decay(t, 100, 0.5))(jnp.arange(0, 101, 25)),
        [f(t) for t in range(0, 101, 25)],
        rtol=1e-6,
        atol=1e-7,
    )


def test_annealed_fraction_values():
    assert float(jst.annealed_fraction(0, 75, 0.3)) == pytest.approx(0.3)
    assert float(jst.annealed_fraction(37.5, 75, 0.3)) == pytest.approx(0.15)
    assert float(jst.annealed_fraction(75, 75, 0.3)) == 0.0  # stopped
    assert float(jst.annealed_fraction(10, 75, 0.3, "constant")) == pytest.approx(0.3)
    assert float(jst.annealed_fraction(80, 75, 0.3, "constant")) == 0.0
    with pytest.raises(ValueError, match="schedule"):
        jst.annealed_fraction(0, 10, 0.3, "linear")


def test_cubic_density_values():
    f = lambda t: float(jst.cubic_density(t, 10, 110, 0.1))  # noqa: E731
    assert f(0) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5**3)
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.75**3)
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    # Per-layer final densities broadcast.
    np.testing.assert_allclose(jst.cubic_density(60, 10, 110, jnp.array([0.1, 0.5])), [0.2125, 0.5625], rtol=1e-6)


@pytest.mark.parametrize("density", [0.05, 0.1, 0.3, 0.7])
def test_erk_budget_sums_to_target(density):
    shapes = [(64, 320), (320, 96), (96, 16), (16, 16)]
    d = jst.erk_densities(shapes, density)
    sizes = np.array([c * k for c, k in shapes])
    assert np.all(d <= 1.0) and np.all(d > 0)
    assert float((d * sizes).sum()) == pytest.approx(density * sizes.sum())
    raw = np.array([(c + k) / (c * k) for c, k in shapes])
    free = d < 1.0
    ratio = d[free] / raw[free]  # proportional to (C + K) / (C K) where not capped
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-9)
    if density >= 0.3:
        assert d[-1] == 1.0  # the tiny layer is capped at dense, the rest rescaled
    grids = [(c // 16) * (k // 16) for c, k in shapes]
    counts = jst.allocate_blocks(d, grids)
    assert counts.sum() == round(density * sum(grids)) or d.min() * min(grids) < 1  # min one block per layer
    plans = jst.plan_layouts(dict(zip("abcd", shapes)), 16, density, distribution="erk")
    assert sum(p.nnz for p in plans.values()) == counts.sum()
    assert [p.nnz for p in plans.values()] == list(counts)


def test_uniform_budget_and_capacities():
    plans = jst.plan_layouts(SHAPES, BS, 0.3, capacity_factor=1.5, seed=3)
    total = sum(p.mask.size for p in plans.values())
    assert sum(p.nnz for p in plans.values()) == round(0.3 * total)
    for p in plans.values():
        assert abs(p.nnz - 0.3 * p.mask.size) <= 1
        assert p.capacity == min(p.mask.size, int(np.ceil(1.5 * p.nnz)))
    dense = jst.plan_layouts(SHAPES, BS, 0.3, dense_start=True)
    assert all(p.mask.all() and p.capacity == p.mask.size and p.target_blocks < p.nnz for p in dense.values())
    again = jst.plan_layouts(SHAPES, BS, 0.3, capacity_factor=1.5, seed=3)
    assert all(np.array_equal(plans[n].mask, again[n].mask) for n in SHAPES)


def test_allocate_blocks_keeps_one_block_and_exact_total():
    counts = jst.allocate_blocks([0.001, 0.5, 0.2], [10, 10, 10], total=7)
    assert counts.sum() == 7 and counts.min() >= 1


def test_redistribute_is_proportional_capped_and_exact():
    alloc = np.asarray(jst.redistribute(10, jnp.array([1.0, 1.0, 2.0]), jnp.array([100, 100, 100])))
    assert alloc.sum() == 10 and alloc[2] == 5
    alloc = np.asarray(jst.redistribute(10, jnp.array([1.0, 1.0, 8.0]), jnp.array([100, 100, 2])))
    np.testing.assert_array_equal(alloc, [4, 4, 2])  # the capped layer's excess goes to the others
    alloc = np.asarray(jax.jit(jst.redistribute)(50, jnp.array([0.0, 0.0]), jnp.array([3, 4])))
    np.testing.assert_array_equal(alloc, [3, 4])  # more budget than room: fill every layer


# ---------------------------------------------------------------------------------
# remap_blocks, remap_tree
# ---------------------------------------------------------------------------------


def _random_layouts(seed, grid=(5, 4), capacity=12, jit=False):
    rng = np.random.default_rng(seed)
    old_mask = rng.random(grid) < 0.4
    new_mask = old_mask.copy()
    drop = np.flatnonzero(old_mask)[: max(1, old_mask.sum() // 3)]
    new_mask.flat[drop] = False
    grow = rng.permutation(np.flatnonzero(~old_mask))[: len(drop)]
    new_mask.flat[grow] = True
    old = jbs.Layout.from_mask(old_mask, BS, capacity=capacity)
    make_new = lambda m: jbs.Layout.from_mask(m, BS, capacity=capacity + 2)  # noqa: E731
    new = jax.jit(make_new)(jnp.asarray(new_mask)) if jit else make_new(new_mask)
    return old_mask, new_mask, old, new


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "traced_layout"])
def test_remap_blocks_matches_dense_reference(jit):
    old_mask, new_mask, old, new = _random_layouts(1, jit=jit)
    w = jax.random.normal(jax.random.key(0), old.w_shape)
    w = jnp.where(old.valid[:, None, None], w, 0)
    fn = jax.jit(jst.remap_blocks) if jit else jst.remap_blocks
    new_w = fn(w, old, new)
    assert new_w.shape == new.w_shape
    keep = np.kron(old_mask & new_mask, np.ones((BS, BS)))
    np.testing.assert_array_equal(np.asarray(jbs.to_dense(new_w, new)), np.asarray(jbs.to_dense(w, old)) * keep)
    # New blocks take `fill`; padding slots too.
    filled = jst.remap_blocks(w, old, new, fill=7.0)
    dense = np.asarray(jbs.to_dense(filled, new))
    grown = np.kron(new_mask & ~old_mask, np.ones((BS, BS))).astype(bool)
    assert np.all(dense[grown] == 7.0)
    np.testing.assert_array_equal(np.asarray(filled[int(new_mask.sum()) :]), 7.0)
    src = np.asarray(jst.slot_map(old, new))
    assert (src >= 0).sum() == (old_mask & new_mask).sum()


def test_remap_blocks_moves_trailing_shapes_and_rejects_mismatch():
    _, _, old, new = _random_layouts(2)
    values = jnp.arange(old.capacity * 3, dtype=jnp.float32).reshape(old.capacity, 3)
    out = jst.remap_blocks(values, old, new)
    src = np.asarray(jst.slot_map(old, new))
    for s, o in enumerate(src):
        np.testing.assert_array_equal(np.asarray(out[s]), np.asarray(values[o]) if o >= 0 else 0.0)
    with pytest.raises(ValueError, match="same grid"):
        jst.remap_blocks(jnp.zeros(old.w_shape), old, jbs.Layout.dense((2, 2), BS))
    with pytest.raises(ValueError, match="old capacity"):
        jst.remap_blocks(jnp.zeros((3, BS, BS)), old, new)


@pytest.mark.parametrize(
    "tx",
    [
        optax.adam(1e-2),
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-4)),
        optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
        optax.masked(optax.adam(1e-2), {"a": {"kernel": True, "bias": False}}),
    ],
    ids=["adam", "chain_adamw", "inject_hyperparams", "masked"],
)
def test_remap_tree_moves_optimizer_state_and_resets_grown(tx):
    old_mask, new_mask, old, new = _random_layouts(3)
    params = {"a": {"kernel": jax.random.normal(jax.random.key(0), old.w_shape), "bias": jnp.ones(32)}}
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    state = tx.init(params)
    _, state = tx.update(grads, state, params)
    new_state = jst.remap_tree(state, {"a": {"kernel": old}}, {"a": {"kernel": new}})
    src = np.asarray(jst.slot_map(old, new))
    moved = 0
    for (path, before), after in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(new_state)):
        names = jax.tree_util.keystr(path)
        if "kernel" in names and before.shape == old.w_shape:
            assert after.shape == new.w_shape
            for s, o in enumerate(src):
                want = np.asarray(before[o]) if o >= 0 else np.zeros((BS, BS))
                np.testing.assert_array_equal(np.asarray(after[s]), want)
            moved += 1
        else:
            np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    assert moved >= 2  # mu and nu


# ---------------------------------------------------------------------------------
# Dense block gradients
# ---------------------------------------------------------------------------------


def test_dense_grads_equal_full_layout_gradient():
    run = Run(_method("rigl"))
    x, y = _data(5)
    got = _dense_grads_fn(run.method)(run.params, run.layouts, x, y)

    # Reference: the same MLP written with dense matrices W = to_dense(kernel, layout);
    # the gradient w.r.t. each whole W, cut into the blocks of the dense layout.
    def dense_loss(Ws):
        h = x
        for i, n in enumerate(SHAPES):
            h = h @ Ws[n] + run.params[n]["bias"]
            h = jax.nn.relu(h) if i < len(SHAPES) - 1 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    Ws = {n: jbs.to_dense(run.params[n]["kernel"], run.layouts[n]["kernel"]) for n in SHAPES}
    want = jax.jit(jax.grad(dense_loss))(Ws)
    sparse = jax.jit(jax.grad(run.loss_fn))(run.params, run.layouts, x, y)
    for n in SHAPES:
        layout = run.layouts[n]["kernel"]
        full = jbs.Layout.dense(layout.grid, BS)
        g = got[n]["kernel"]
        assert g.shape == full.w_shape and g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(jbs.from_dense(want[n], full)), rtol=1e-4, atol=1e-6)
        grid = np.asarray(jst.grid_view(g, layout.grid))  # [CB, KB, bs, bs]
        blocks = np.asarray(want[n]).reshape(layout.grid[0], BS, layout.grid[1], BS).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(grid, blocks, rtol=1e-4, atol=1e-6)
        # At the layout's own blocks it is the ordinary block-sparse gradient.
        np.testing.assert_allclose(
            np.asarray(jst.remap_blocks(g, full, layout)), np.asarray(sparse[n]["kernel"]), rtol=1e-4, atol=1e-6
        )


def test_training_step_is_block_sparse():
    """The gradient of an ordinary step runs bsmm fprop / bprop / updat, no dense matmul."""
    run = Run(_method("rigl"))
    x, y = _data()
    text = str(jax.make_jaxpr(jax.grad(run.loss_fn))(run.params, run.layouts, x, y))
    assert all(p in text for p in ("bsmm_fprop", "bsmm_bprop", "bsmm_updat"))
    assert "dot_general" not in text and "probe" not in text


# ---------------------------------------------------------------------------------
# Methods: invariants, compile counts, optimizer state, determinism
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["static", "set", "rigl", "sparse_momentum", "magnitude"])
def test_method_invariants_and_single_compilation(name):
    method = _method(name)
    run = Run(method).train(TOTAL_STEPS - 1)
    n_updates = sum(method.is_update_step(s) for s in range(1, TOTAL_STEPS))
    assert len(run.logs) == n_updates and (n_updates == 0) == (name == "static")
    assert run.traces() == {"train": 1, "update": int(n_updates > 0)}  # one compile each

    plans = list(run.plan.values())
    initial = sum(p.nnz for p in plans)
    for n, layout, p in zip(SHAPES, run.layout_list(), plans):
        assert layout.capacity == p.capacity and layout.nnz <= layout.capacity
        assert run.params[n]["kernel"].shape == layout.w_shape
    for log in run.logs:
        r = {k: np.asarray(getattr(log, k)) for k in ("nnz_before", "pruned", "grown", "nnz_after")}
        np.testing.assert_array_equal(r["nnz_after"], r["nnz_before"] - r["pruned"] + r["grown"])
        assert np.all(r["nnz_after"] <= np.array(log.capacities))
        if name in ("set", "rigl"):
            np.testing.assert_array_equal(r["pruned"], r["grown"])  # per layer
        if name == "sparse_momentum":
            assert r["pruned"].sum() == r["grown"].sum()  # globally
        if name == "magnitude":  # follows the cubic schedule down to each layer's budget
            assert r["grown"].sum() == 0
            for i, p in enumerate(plans):
                d = float(jst.cubic_density(int(log.step), 0, 20, p.target_blocks / p.mask.size))
                assert r["nnz_after"][i] == max(round(d * p.mask.size), p.target_blocks)
    nnz = [l.nnz for l in run.layout_list()]
    if name in ("static", "set", "rigl"):
        assert nnz == [p.nnz for p in plans]
    if name == "sparse_momentum":
        assert sum(nnz) == initial
        assert nnz != [p.nnz for p in plans]  # the budget moved between layers
    if name == "magnitude":
        assert nnz == [p.target_blocks for p in plans]
    if name in ("set", "rigl", "sparse_momentum"):
        assert sum(int(log.grown.sum()) for log in run.logs) > 0  # the layout did change
    # Kernels are zero outside the current layout (padding slots) after every move.
    for n, layout in zip(SHAPES, run.layout_list()):
        k = np.asarray(run.params[n]["kernel"])
        assert np.all(k[layout.nnz :] == 0)


def test_grown_blocks_start_at_zero_with_reset_adam_state():
    method = _method("rigl")
    run = Run(method)
    run.train(method.update_every - 1)  # up to just before the first update
    step = method.update_every
    x, y = _data(step)
    params, opt_state = run.train_step(run.params, run.layouts, run.opt_state, x, y)
    new_params, new_layouts, new_opt, log = run.update_step(step, params, run.layouts, opt_state, x, y)
    assert int(log.grown.sum()) > 0
    adam_old, adam_new = opt_state[0], new_opt[0]
    for n in SHAPES:
        old, new = run.layouts[n]["kernel"], new_layouts[n]["kernel"]
        src = np.asarray(jst.slot_map(old, new))
        grown_slots = np.flatnonzero((src < 0) & np.asarray(new.valid))
        kept_slots = np.flatnonzero(src >= 0)
        assert len(grown_slots) == int(log.grown[list(SHAPES).index(n)])
        for tree_old, tree_new in ((params, new_params), (adam_old.mu, adam_new.mu), (adam_old.nu, adam_new.nu)):
            a, b = np.asarray(tree_old[n]["kernel"]), np.asarray(tree_new[n]["kernel"])
            assert np.all(b[grown_slots] == 0)  # grown: zero weight, zero mu and nu
            np.testing.assert_array_equal(b[kept_slots], a[src[kept_slots]])  # moved with the block
            assert np.abs(a[src[kept_slots]]).sum() > 0
        # Biases are never touched.
        np.testing.assert_array_equal(np.asarray(new_params[n]["bias"]), np.asarray(params[n]["bias"]))
        np.testing.assert_array_equal(np.asarray(adam_new.mu[n]["bias"]), np.asarray(adam_old.mu[n]["bias"]))
    assert int(adam_new.count) == int(adam_old.count)


def test_rigl_grows_where_dense_gradient_is_largest():
    method = _method("rigl")
    run = Run(method).train(2)
    x, y = _data(0)
    grads = _dense_grads_fn(method)(run.params, run.layouts, x, y)
    out = run.update_step(5, run.params, run.layouts, run.opt_state, x, y)
    for n in SHAPES:
        old, new = run.layouts[n]["kernel"], out.layouts[n]["kernel"]
        scores = np.asarray(jst.grid_scores(grads[n]["kernel"], old.grid))
        old_m, new_m = _np_mask(old), _np_mask(new)
        grown = new_m & ~old_m
        candidates = ~old_m
        if grown.any():  # every grown block scores at least as high as every non-grown candidate
            assert scores[grown].min() >= scores[candidates & ~grown].max()
        pruned = old_m & ~new_m
        mags = np.asarray(jst.block_magnitude(run.params[n]["kernel"], old))
        if pruned.any():
            assert mags[pruned].max() <= mags[old_m & ~pruned].min()


def test_mixed_precision_moves_fp32_master_blocks():
    method = _method("set")
    run = Run(method, dtype=jnp.bfloat16)  # compute in bf16, fp32 params and Adam state
    run.train(method.update_every - 1)
    x, y = _data()
    # SET's update does not use the model: the float32 run's compiled update serves.
    update_step = _compiled(method)[5]
    p = jax.tree.map(lambda a: a + jnp.float32(1e-7), run.params)  # not representable in bf16
    new_params, new_layouts, new_opt, log = update_step(method.update_every, p, run.layouts, run.opt_state, x, y)
    assert int(log.grown.sum()) > 0
    for n in SHAPES:
        assert new_params[n]["kernel"].dtype == jnp.float32 and new_opt[0].mu[n]["kernel"].dtype == jnp.float32
        src = np.asarray(jst.slot_map(run.layouts[n]["kernel"], new_layouts[n]["kernel"]))
        kept = np.flatnonzero(src >= 0)
        # The fp32 master blocks move bit for bit (no rounding through bf16).
        np.testing.assert_array_equal(np.asarray(new_params[n]["kernel"])[kept], np.asarray(p[n]["kernel"])[src[kept]])
    # Training goes on in bf16 with the new layouts, without recompiling.
    params, _ = run.train_step(new_params, new_layouts, new_opt, x, y)
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(params))
    assert run.traces()["train"] == 1


def test_reproducible_by_seed():
    def final(seed):
        run = Run(_method("set", seed=seed)).train(15)
        assert len(run.logs) == 3
        return [_np_mask(l) for l in run.layout_list()], jax.tree.leaves(run.params)

    (m1, p1), (m2, p2) = final(0), final(0)
    assert all(np.array_equal(a, b) for a, b in zip(m1, m2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(p1, p2))
    # The seed sets the initial layouts and the update's random numbers.
    plan0, plan1 = _method("set", seed=0).plan(SHAPES, BS), _method("set", seed=1).plan(SHAPES, BS)
    assert not all(np.array_equal(plan0[n].mask, plan1[n].mask) for n in SHAPES)


def test_log_rows_and_format():
    run = Run(_method("set")).train(10)
    rows = jst.log_rows(run.logs)
    assert len(rows) == len(run.logs) * len(SHAPES)
    assert rows[0]["layer"] == "layer0/kernel" and rows[0]["step"] == 5
    assert rows[0]["nnz_after"] == rows[0]["nnz_before"] - rows[0]["pruned"] + rows[0]["grown"]
    text = jst.format_log(run.logs)
    assert "layer1/kernel" in text and "(all layers)" in text


def test_update_errors():
    run = Run(_method("rigl"))
    with pytest.raises(ValueError, match="needs `grads`"):
        run.method.update(5, run.params, run.layouts, run.opt_state)
    bad = {n: {"kernel": run.params[n]["kernel"]} for n in list(SHAPES)[:1]}
    with pytest.raises(ValueError, match="no parameter at 'layer1/kernel'"):
        _method("set").update(5, bad, run.layouts)
    with pytest.raises(ValueError, match="distribution"):
        _method("set", distribution="er")


# ---------------------------------------------------------------------------------
# Layers in dynamic mode
# ---------------------------------------------------------------------------------


def test_linen_dynamic_layer_reads_layout_collection():
    mask = jbs.layouts.random((4, 6), 0.4, seed=0)
    static = BlockSparseDense(48, mask, BS, capacity=12)
    dynamic = BlockSparseDense(48, mask, BS, capacity=12, dynamic=True)
    x = jax.random.normal(jax.random.key(1), (3, 32))
    v = dynamic.init(jax.random.key(0), x)
    assert set(v) == {"params", "layout"} and v["layout"]["kernel"].capacity == 12
    np.testing.assert_allclose(dynamic.apply(v, x), static.apply({"params": v["params"]}, x), rtol=1e-6)
    # A different layout of the same capacity: the layer multiplies with it.
    other = jbs.Layout.from_mask(jbs.layouts.random((4, 6), 0.3, seed=5), BS, capacity=12)
    y = dynamic.apply({"params": v["params"], "layout": {"kernel": other}}, x)
    want = x @ jbs.to_dense(v["params"]["kernel"], other) + v["params"]["bias"]
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        dynamic.apply({"params": v["params"], "layout": {"kernel": jbs.Layout.from_mask(mask, BS)}}, x)


def test_nnx_dynamic_training_loop_compiles_once():
    method = _method("rigl")
    plan = method.plan(SHAPES, BS)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [
                    BlockSparseLinear(*SHAPES[n], plan[n].mask, BS, capacity=plan[n].capacity, dynamic=True, rngs=rngs)
                    for n in SHAPES
                ]
            )

        def __call__(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x) if i == len(self.layers) - 1 else nnx.relu(layer(x))
            return x

    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    traces = {"train": 0, "update": 0}

    def loss(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    @nnx.jit
    def train_step(model, optimizer, x, y):
        traces["train"] += 1
        optimizer.update(model, nnx.grad(loss)(model, x, y))

    @nnx.jit
    def update_step(model, optimizer, step, x, y):
        traces["update"] += 1
        return jst.nnx_update(method, step, model, optimizer, jst.nnx_dense_grads(loss, model, x, y))

    logs = []
    for step in range(1, 16):
        x, y = _data(step)
        train_step(model, optimizer, x, y)
        if method.is_update_step(step):
            logs.append(update_step(model, optimizer, step, x, y))
    assert traces == {"train": 1, "update": 1} and len(logs) == 3
    assert sum(int(log.grown.sum()) for log in logs) > 0
    for layer, n in zip(model.layers, SHAPES):
        assert isinstance(layer.kernel_layout, BlockLayout)
        assert layer.layout.nnz == plan[n].nnz
        k = np.asarray(layer.kernel[...])
        assert np.all(k[layer.layout.nnz :] == 0)
    # The optimizer's mu moved with the blocks: zero exactly at padding, like the kernel.
    mu = nnx.state(optimizer)["opt_state"][0]["mu"]["layers"][0]["kernel"][...]
    assert np.all(np.asarray(mu)[model.layers[0].layout.nnz :] == 0)
