"""Tests of the block-sparse recurrent cells, the fused sequence layer and the mixing tools.

The oracle is a masked dense (m)LSTM written here from the equations in
``jax_blocksparse.nn.recurrent`` with plain ``jnp.matmul`` on ``jbs.to_dense`` kernels;
with ``layer_norm=False`` and no internal steps the cell must also equal Flax's own
``nn.LSTMCell``. The sequence layer must equal the cell under ``nn.RNN`` (outputs and
gradients) and must compute each recurrent weight gradient with one ``bsmm_updat``
whatever the sequence length.
"""

from __future__ import annotations

import collections
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import jaxprs_in_params, storage_order
from jax_blocksparse.nn import BlockSparseLSTM, BlockSparseLSTMCell, BlockSparseMLSTMCell

BS = 8
HB = 4  # hidden block grid: H = 32
H = HB * BS
D = 16
B, T = 3, 5
TOL = {np.dtype(jnp.float32): 2e-5, np.dtype(jnp.bfloat16): 6e-2}
CELLS = {"lstm": BlockSparseLSTMCell, "mlstm": BlockSparseMLSTMCell}
NNX_CELLS = {"lstm": jbs.nnx.BlockSparseLSTMCell, "mlstm": jbs.nnx.BlockSparseMLSTMCell}


def _assert_close(got, want, tol):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want, jnp.float32), np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def _tree_close(got, want, tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = _at(want, path)
        try:
            _assert_close(g, w, tol)
        except AssertionError as err:
            raise AssertionError(f"at {jax.tree_util.keystr(path)}: {err}") from None


def _at(tree, path):
    for key in path:
        tree = tree[key.key if hasattr(key, "key") else key.idx]
    return tree


def _ring(n):
    """Undirected ring with self-loops."""
    eye = np.eye(n, dtype=bool)
    return eye | np.roll(eye, 1, axis=1) | np.roll(eye, -1, axis=1)


# name -> (cell kind, cell kwargs); together they cover every option at least once.
CASES = {
    "lstm_ln_2steps_own_masks_sparse_in": (
        "lstm",
        dict(
            internal_steps=2,
            step_masks=[np.eye(HB, dtype=bool), _ring(HB)],
            input_mask=jbs.layouts.random((2, HB), 0.5, 1) | np.eye(2, HB, dtype=bool),
        ),
    ),
    "lstm_no_ln_1step_tanh_per_gate_mask": (
        "lstm",
        dict(
            mask=jbs.layouts.random((HB, 4 * HB), 0.5, 2),
            internal_steps=1,
            step_masks=[_ring(HB)],
            layer_norm=False,
            internal_activation=jnp.tanh,
        ),
    ),
    "mlstm_ln_1step_own_mh_mask": ("mlstm", dict(internal_steps=1, mh_mask=_ring(HB))),
    "mlstm_no_ln_sparse_in": ("mlstm", dict(layer_norm=False, input_mask=np.ones((2, HB), bool))),
}


def _make_cell(kind, dtype=None, **kw):
    kw.setdefault("mask", jbs.layouts.barabasi_albert(HB, 1, seed=0))
    return CELLS[kind](features=H, block_size=BS, dtype=dtype, **kw)


def _init(module, *args, seed=0):
    """Random parameters with the shapes ``module.init`` gives, drawn with numpy.

    (Compiling ``module.init`` costs more than the rest of a test on a small CPU;
    ``test_default_initialisation`` runs the real one.) Kernels are normal with
    standard deviation 0.25; scales are near 1 and biases near 0, but not exactly.
    """
    shapes = jax.eval_shape(module.init, jax.random.key(0), *args)
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "scale" in name:
            return jnp.asarray(1 + 0.2 * noise, leaf.dtype)
        return jnp.asarray((0.2 if "bias" in name else 0.25) * noise, leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _setup(case, dtype=None, seed=0):
    kind, kw = CASES[case]
    cell = _make_cell(kind, dtype=dtype, **kw)
    x = jax.random.normal(jax.random.key(seed + 1), (B, T, D))
    params = _init(nn.RNN(cell), x, seed=seed)["params"]["cell"]
    carry = tuple(0.5 * jax.random.normal(k, (B, H)) for k in jax.random.split(jax.random.key(seed + 3)))
    return cell, params, x, carry


def _rnn(cell, params, x, carry):
    return nn.RNN(cell, return_carry=True).apply({"params": {"cell": params}}, x, initial_carry=carry)


def _fused(cell, params, x, carry):
    return BlockSparseLSTM(cell, return_carry=True).apply({"params": {"cell": params}}, x, initial_carry=carry)


# -- the masked dense oracle ----------------------------------------------------------


def _dense_params(cell, params):
    """Float64 numpy params with every block-sparse kernel scattered into its dense matrix.

    Storage order comes from the mask alone (helpers.storage_order), not the layout tables.
    """
    out = {}
    for name, v in params.items():
        v = np.asarray(v, np.float64)
        layout = cell.layout_of(name) if name.endswith("_kernel") else None
        if layout is not None:
            (cb, kb), bs = layout.grid, layout.block_size
            rows, cols = storage_order(np.asarray(layout.mask))
            dense = np.zeros((cb, kb, bs, bs))
            dense[rows, cols] = v[: len(rows)]
            v = dense.transpose(0, 2, 1, 3).reshape(cb * bs, kb * bs)
        out[name] = v
    return out


def _reference(cell, dense, x, carry):
    """Masked dense (m)LSTM over x [B, T, D] in float64 numpy: ((c, h), ys [B, T, H])."""
    xp = np
    ln, steps = cell.layer_norm, cell.internal_steps
    mult = isinstance(cell, BlockSparseMLSTMCell)
    acts = {nn.relu: lambda a: xp.maximum(a, 0), jnp.tanh: xp.tanh, None: lambda a: a}
    act = acts[cell.internal_activation]
    sigmoid = lambda a: 1 / (1 + xp.exp(-a))  # noqa: E731
    x, carry = np.asarray(x, np.float64), tuple(np.asarray(c, np.float64) for c in carry)

    def norm(v, groups, eps=1e-5):
        g = v.reshape(*v.shape[:-1], groups, -1)
        g = (g - g.mean(-1, keepdims=True)) / xp.sqrt(g.var(-1, keepdims=True) + eps)
        return g.reshape(v.shape)

    c, h = carry
    ys = []
    for t in range(x.shape[1]):
        p = x[:, t] @ dense["input_kernel"]
        if ln:
            p = norm(p, 5 if mult else 4) * dense["input_scale"]
        xg, xm = p[:, : 4 * H] + dense["bias"], p[:, 4 * H :]
        r = h
        if mult:
            z = h @ dense["mh_kernel"]
            r = (norm(z, 1) * dense["mh_scale"] + dense["mh_bias"] if ln else z) * xm
        for i in range(steps):
            z = r @ dense[f"step{i}_kernel"]
            r = act((norm(z, 1) * dense[f"step{i}_scale"] if ln else z) + dense[f"step{i}_bias"])
        z = r @ dense["recurrent_kernel"]
        g = (norm(z, 4) * dense["recurrent_scale"] if ln else z) + xg
        i_, f, u, o = xp.split(g, 4, axis=-1)
        c = sigmoid(f) * c + sigmoid(i_) * xp.tanh(u)
        h = sigmoid(o) * xp.tanh(c)
        ys.append(h)
    return (c, h), xp.stack(ys, axis=1)


def _loss_weights(seed=9):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return jax.random.normal(k1, (B, T, H)), jax.random.normal(k2, (B, H)), jax.random.normal(k3, (B, H))


def _loss(apply):
    """A loss touching every output and the final carry; returns the outputs as aux."""
    wy, wc, wh = _loss_weights()

    def loss(params, x, carry):
        out = apply(params, x, carry)
        (c, h), ys = out
        return jnp.sum(ys.astype(jnp.float32) * wy) + jnp.sum(c * wc) + jnp.sum(jnp.sin(h) * wh), out

    return loss


def _reference_loss(cell, params, x, carry):
    """The same loss on the float64 numpy oracle (block params -> masked dense)."""
    wy, wc, wh = (np.asarray(w, np.float64) for w in _loss_weights())
    (c, h), ys = _reference(cell, _dense_params(cell, params), x, carry)
    return float(np.sum(ys * wy) + np.sum(c * wc) + np.sum(np.sin(h) * wh))


def _outputs_and_grads(apply, *args):
    """One compilation: (outputs, grads w.r.t. params, inputs and initial carry)."""
    (_, out), grads = jax.jit(jax.value_and_grad(_loss(apply), argnums=(0, 1, 2), has_aux=True))(*args)
    return out, grads


@functools.cache
def _results(case):
    """Oracle outputs and both layers' outputs and gradients for a case (shared by tests)."""
    cell, params, x, carry = _setup(case)
    ref = _reference(cell, _dense_params(cell, params), x, carry)
    rnn = _outputs_and_grads(lambda p, x, c: _rnn(cell, p, x, c), params, x, carry)
    seq = _outputs_and_grads(lambda p, x, c: _fused(cell, p, x, c), params, x, carry)
    return ref, rnn, seq


def _check_grads_by_finite_differences(cell, params, x, carry, grads, eps=1e-6, seed=0):
    """<grad, v> == (L(a + eps v) - L(a - eps v)) / 2 eps on the float64 oracle, one random
    direction v per parameter and for the inputs and the initial carry."""
    args = (params, x, carry)
    rng = np.random.default_rng(seed)
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        v = rng.standard_normal(g.shape)

        def shifted(sign):
            def f(p, leaf):
                return np.asarray(leaf, np.float64) + sign * eps * v if p == path else np.asarray(leaf, np.float64)

            return jax.tree_util.tree_map_with_path(f, args)

        fd = (_reference_loss(cell, *shifted(1)) - _reference_loss(cell, *shifted(-1))) / (2 * eps)
        analytic = float(np.sum(np.asarray(g, np.float64) * v))
        scale = np.linalg.norm(np.asarray(g, np.float64)) * np.linalg.norm(v)
        assert abs(fd - analytic) <= 1e-4 * max(scale, 1.0), (jax.tree_util.keystr(path), fd, analytic)


# -- cells against the masked dense oracle ---------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_cell_and_sequence_layer_match_masked_dense(case):
    """nn.RNN(cell) and BlockSparseLSTM(cell) equal the masked dense oracle (outputs and
    gradients), and each other."""
    cell, params, x, carry = _setup(case)
    ref, (out_rnn, g_rnn), (out_seq, g_seq) = _results(case)
    _tree_close(out_rnn, ref, TOL[np.dtype(jnp.float32)])
    _tree_close(out_seq, ref, TOL[np.dtype(jnp.float32)])
    _check_grads_by_finite_differences(cell, params, x, carry, g_rnn)
    _tree_close(g_seq, g_rnn, 5e-5)


def test_equals_flax_lstm_cell_without_layer_norm():
    """layer_norm=False, no internal steps: exactly nn.LSTMCell with masked kernels."""
    cell = _make_cell("lstm", layer_norm=False)
    x = jax.random.normal(jax.random.key(1), (B, D))
    carry = cell.initialize_carry(jax.random.key(2), x.shape)
    carry = tuple(c + 0.3 for c in carry)
    params = _init(cell, carry, x)["params"]
    assert set(params) == {"input_kernel", "recurrent_kernel", "bias"}
    dense = _dense_params(cell, params)

    def split(a):
        return dict(zip("ifgo", jnp.split(a, 4, axis=-1)))

    wi, wh, b = split(dense["input_kernel"]), split(dense["recurrent_kernel"]), split(dense["bias"])
    flax_params = {f"i{g}": {"kernel": wi[g]} for g in "ifgo"}
    flax_params.update({f"h{g}": {"kernel": wh[g], "bias": b[g]} for g in "ifgo"})
    want = jax.jit(nn.LSTMCell(H).apply)({"params": flax_params}, carry, x)
    got = jax.jit(cell.apply)({"params": params}, carry, x)
    _tree_close(got, want, 1e-5)


# -- the sequence layer ----------------------------------------------------------------


def _count(jaxpr, name):
    """How many times ``name`` executes: scan bodies count ``length`` times."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        total += times * sum(_count(sub, name) for sub in jaxprs_in_params(eqn.params))
    return total


@pytest.mark.parametrize("case", ["lstm_ln_2steps_own_masks_sparse_in", "mlstm_ln_1step_own_mh_mask"])
def test_weight_gradient_is_one_updat_per_weight_whatever_the_length(case):
    cell, params, _, carry = _setup(case)
    stages = len(cell.config.stages)  # recurrent block-sparse weights
    sparse_in = cell.input_mask is not None
    for t in (3, 7):
        x = jnp.ones((B, t, D))

        def loss(apply):
            return lambda p: jnp.sum(apply(cell, p, x, carry)[1] ** 2)

        fused = _count(jax.make_jaxpr(jax.grad(loss(_fused)))(params).jaxpr, "bsmm_updat")
        naive = _count(jax.make_jaxpr(jax.grad(loss(_rnn)))(params).jaxpr, "bsmm_updat")
        assert fused == stages + sparse_in  # O(1): one SDDMM per weight over all T*B rows
        assert naive == t * (stages + sparse_in)  # what autodiff of nn.RNN does: O(T)


@pytest.mark.parametrize(
    "time_major,batch", [(False, ()), (True, (2, 3))], ids=["unbatched", "time_major_2_batch_axes"]
)
def test_sequence_layer_batch_axes_and_default_carry(time_major, batch):
    cell = _make_cell("lstm", internal_steps=1)
    shape = (T,) + batch + (D,) if time_major else batch + (T, D)
    x = jax.random.normal(jax.random.key(0), shape)
    params = _init(nn.RNN(cell, time_major=time_major), x)

    @jax.jit
    def run(params, x):
        want = nn.RNN(cell, time_major=time_major, return_carry=True).apply(params, x)
        got = BlockSparseLSTM(cell, time_major=time_major, return_carry=True).apply(params, x)
        return want, got, BlockSparseLSTM(cell, time_major=time_major).apply(params, x)

    want, got, outputs_only = run(params, x)
    assert got[1].shape == shape[:-1] + (H,) and got[0][0].shape == batch + (H,)
    _tree_close(got, want, 2e-5)
    _assert_close(outputs_only, want[1], 2e-5)


def test_vmap_over_batch():
    cell = _make_cell("mlstm", internal_steps=1)
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    params = _init(nn.RNN(cell), x)
    carry = cell.initialize_carry(jax.random.key(2), (B, D))

    # One timestep of the cell, vmapped over the batch (each example unbatched).
    step = jax.jit(lambda c, xt: cell.apply({"params": params["params"]["cell"]}, c, xt))
    _tree_close(jax.vmap(step)(carry, x[:, 0]), step(carry, x[:, 0]), 1e-5)

    # The sequence layer, vmapped: outputs and the gradient of the vmapped sum.
    lstm = BlockSparseLSTM(cell)

    def loss(p, vmapped):
        ys = jax.vmap(lstm.apply, in_axes=(None, 0))(p, x) if vmapped else lstm.apply(p, x)
        return jnp.sum(jnp.sin(ys)), ys

    (_, ys_v), g_v = jax.jit(jax.value_and_grad(lambda p: loss(p, True), has_aux=True))(params)
    (_, ys_b), g_b = jax.jit(jax.value_and_grad(lambda p: loss(p, False), has_aux=True))(params)
    _assert_close(ys_v, ys_b, 1e-5)
    _tree_close(g_v, g_b, 5e-5)


def test_bf16_compute_with_fp32_params():
    cell32, params, x, carry = _setup("lstm_ln_2steps_own_masks_sparse_in")
    cell16 = cell32.clone(dtype=jnp.bfloat16)
    want = _reference(cell32, _dense_params(cell32, params), x, carry)
    (c, h), ys = jax.jit(lambda p, x, c: _rnn(cell16, p, x, c))(params, x, carry)
    assert c.dtype == h.dtype == ys.dtype == jnp.float32  # carries keep their dtype
    _tree_close(((c, h), ys), want, TOL[np.dtype(jnp.bfloat16)])
    # The products run in bf16 (they show in the jaxpr); gradients are float32 and close.
    assert "bf16[" in str(jax.make_jaxpr(lambda p: _fused(cell16, p, x, carry))(params))
    out16, g16 = _outputs_and_grads(lambda p, x, c: _fused(cell16, p, x, c), params, x, carry)
    _, _, (_, g32) = _results("lstm_ln_2steps_own_masks_sparse_in")
    _tree_close(out16, want, TOL[np.dtype(jnp.bfloat16)])
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(g16))
    # bf16 products through layer norms, ReLUs and 5 steps: a few % off in norm (measured
    # 3-15% per parameter; the cell under nn.RNN in bf16 is off by the same amounts).
    for g, w in zip(jax.tree.leaves(g16), jax.tree.leaves(g32)):
        assert float(jnp.linalg.norm(g - w)) <= 0.25 * float(jnp.linalg.norm(w))


def test_internal_steps_reach_as_far_as_mixing_steps_says():
    """d h_1 / d h_0 is nonzero exactly where (mask | I) ** (internal_steps + 1) is."""
    mask = np.eye(8, dtype=bool) | np.roll(np.eye(8, dtype=bool), 1, axis=1)  # directed ring of 8 blocks
    assert jbs.layouts.mixing_steps(mask) == 7
    x = jax.random.normal(jax.random.key(0), (D,))
    for steps in (2, 6):
        cell = BlockSparseLSTMCell(
            8 * BS, mask, BS, internal_steps=steps, layer_norm=False, internal_activation=jnp.tanh
        )
        carry = cell.initialize_carry(jax.random.key(1), x.shape)
        params = _init(cell, carry, x)
        jac = jax.jit(jax.jacobian(lambda h0: cell.apply(params, (carry[0], h0), x)[1]))(carry[1] + 0.1)  # [out, in]
        reach = np.abs(np.asarray(jac)).reshape(8, BS, 8, BS).max(axis=(1, 3)).T > 0  # [in block, out block]
        power = np.linalg.matrix_power(mask.astype(int), steps + 1) > 0
        np.testing.assert_array_equal(reach, power)
        assert reach.all() == (steps + 1 >= jbs.layouts.mixing_steps(mask))


# -- nnx --------------------------------------------------------------------------------


def test_nnx_cells_equal_linen_cells():
    kind, kw = CASES["mlstm_ln_1step_own_mh_mask"]
    cell, params, x, carry = _setup("mlstm_ln_1step_own_mh_mask")
    # Built abstractly (no init compilations), then given the linen cell's parameters.
    ncell = nnx.eval_shape(
        lambda: NNX_CELLS[kind](D, H, jbs.layouts.barabasi_albert(HB, 1, seed=0), BS, rngs=nnx.Rngs(0), **kw)
    )
    assert set(ncell.param_names) == set(params)
    for name, value in params.items():
        assert getattr(ncell, name).shape == value.shape
        getattr(ncell, name).set_value(value)
    want = _rnn(cell, params, x, carry)
    fused = jbs.nnx.BlockSparseLSTM(ncell, return_carry=True)
    rnn = nnx.RNN(ncell, return_carry=True)

    @nnx.jit
    def outputs_and_grads(model):
        loss = lambda m: (jnp.sum(jnp.sin(m(x, initial_carry=carry)[1])), m(x, initial_carry=carry))  # noqa: E731
        return nnx.grad(loss, has_aux=True)(model)

    g_fused, out_fused = outputs_and_grads(fused)
    g_rnn, out_rnn = outputs_and_grads(rnn)
    _tree_close(out_fused, want, 2e-5)
    _tree_close(out_rnn, want, 2e-5)
    for name in params:
        _assert_close(getattr(g_fused.cell, name)[...], getattr(g_rnn.cell, name)[...], 5e-5)


def test_nnx_cell_default_init_carry_and_shapes():
    mask = jbs.layouts.barabasi_albert(HB, 1)
    cell = jbs.nnx.BlockSparseLSTMCell(D, H, mask, BS, internal_steps=1, rngs=nnx.Rngs(0))
    # Default initialisation: block kernels LeCun normal with their true fan-in, a dense
    # input kernel LeCun normal, scales one, biases zero.
    fan_in = BS * mask.sum(axis=0).mean()
    for name in ("recurrent_kernel", "step0_kernel"):
        assert 0.8 < float(jnp.std(getattr(cell, name)[...])) * np.sqrt(fan_in) < 1.2
    assert 0.8 < float(jnp.std(cell.input_kernel[...])) * np.sqrt(D) < 1.2
    assert cell.input_kernel[...].shape == (D, 4 * H)
    for name in ("input_scale", "recurrent_scale", "step0_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(cell, name)[...]), 1.0)
    for name in ("bias", "step0_bias"):
        np.testing.assert_array_equal(np.asarray(getattr(cell, name)[...]), 0.0)
    c, h = cell.initialize_carry((B, D))
    assert c.shape == h.shape == (B, H) and not np.asarray(c).any()
    assert cell.recurrent_kernel[...].shape == cell.recurrent_layout.w_shape == (4 * int(mask.sum()), BS, BS)
    (c, h), y = nnx.jit(lambda cell, carry, x: cell(carry, x))(cell, (c, h), jnp.ones((B, D)))
    assert y.shape == (B, H) and np.isfinite(np.asarray(y)).all()
    with pytest.raises(ValueError, match=r"inputs must have shape \[\.\.\., 16\]"):
        cell((c, h), jnp.ones((B, D + 1)))


# -- configuration -------------------------------------------------------------------


def test_parameters_and_layouts():
    mask = jbs.layouts.barabasi_albert(HB, 1)
    cell = BlockSparseMLSTMCell(H, mask, BS, internal_steps=2, input_mask=np.ones((2, HB), bool))
    x = jnp.ones((B, D))
    params = jax.eval_shape(cell.init, jax.random.key(0), cell.initialize_carry(jax.random.key(1), x.shape), x)
    params = params["params"]
    nnz = int(mask.sum())
    assert params["recurrent_kernel"].shape == (4 * nnz, BS, BS)  # the 4 gates share the tiled mask
    np.testing.assert_array_equal(np.asarray(cell.recurrent_layout.mask), np.tile(mask, (1, 4)))
    assert params["mh_kernel"].shape == params["step0_kernel"].shape == params["step1_kernel"].shape == (nnz, BS, BS)
    assert params["input_kernel"].shape == (2 * 5 * HB, BS, BS)  # [D, 5H] block-sparse (gates + m)
    assert params["input_scale"].shape == (5 * H,) and params["bias"].shape == (4 * H,)
    assert params["step0_scale"].shape == params["step0_bias"].shape == params["mh_bias"].shape == (H,)
    # Hashable, so usable as a static argument.
    assert cell == BlockSparseMLSTMCell(H, mask.astype(int), BS, internal_steps=2, input_mask=np.ones((2, HB), bool))
    assert hash(cell) == hash(cell.clone())


def test_bad_configurations_raise():
    mask = jbs.layouts.barabasi_albert(HB, 1)
    with pytest.raises(ValueError, match=r"mask must have shape .*\(4, 4\).*\(4, 16\).*got \(4, 5\)"):
        BlockSparseLSTMCell(H, np.ones((HB, 5), bool), BS)
    with pytest.raises(ValueError, match="got 1 step_masks for internal_steps=2"):
        BlockSparseLSTMCell(H, mask, BS, internal_steps=2, step_masks=[mask])
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockSparseLSTMCell(H + 4, mask, BS)
    with pytest.raises(ValueError, match="step_masks is required"):
        BlockSparseLSTMCell(H, np.ones((HB, 4 * HB), bool), BS, internal_steps=1)
    cell = BlockSparseLSTMCell(H, mask, BS, input_mask=np.ones((2, HB), bool))
    x = jnp.ones((B, D + 8))
    with pytest.raises(ValueError, match="inputs must have 2 \\* 8 = 16 features"):
        jax.eval_shape(cell.init, jax.random.key(0), cell.initialize_carry(jax.random.key(1), x.shape), x)
    with pytest.raises(ValueError, match=r"carry \(c, h\) must have shape \[\.\.\., 32\]"):
        jax.eval_shape(cell.init, jax.random.key(0), (jnp.ones((B, 8)), jnp.ones((B, 8))), jnp.ones((B, D)))


# -- layout tools ------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 8, 13])
def test_mixing_steps_of_a_ring(n):
    eye = np.eye(n, dtype=bool)
    assert jbs.layouts.mixing_steps(_ring(n)) == n // 2  # undirected ring: its diameter
    assert jbs.layouts.mixing_steps(eye | np.roll(eye, 1, axis=1)) == n - 1  # directed ring
    assert jbs.layouts.mixing_steps(np.roll(eye, 1, axis=1)) == n - 1  # self-loops are implied


def _diameter(mask) -> int:
    """The longest shortest path of a connected undirected graph (bool adjacency [n, n]),
    by a breadth-first search from every node: an oracle apart from mixing_steps' matrix
    powers."""
    n, longest = mask.shape[0], 0
    for source in range(n):
        distance = np.full(n, -1)
        distance[source] = 0
        queue = collections.deque([source])
        while queue:
            node = queue.popleft()
            for other in np.flatnonzero(mask[node]):
                if distance[other] < 0:
                    distance[other] = distance[node] + 1
                    queue.append(other)
        assert (distance >= 0).all(), "the graph is not connected"
        longest = max(longest, int(distance.max()))
    return longest


@pytest.mark.parametrize("n,m", [(16, 1), (64, 2), (256, 3)])
def test_mixing_steps_of_barabasi_albert_is_its_diameter(n, m):
    mask = jbs.layouts.barabasi_albert(n, m, seed=1)
    steps = jbs.layouts.mixing_steps(mask)
    assert steps == _diameter(mask)
    reach = np.linalg.matrix_power(mask.astype(np.int64), steps) > 0
    assert reach.all() and not (np.linalg.matrix_power(mask.astype(np.int64), steps - 1) > 0).all()


def test_mixing_steps_edge_cases():
    ms = jbs.layouts.mixing_steps
    assert ms(np.ones((3, 3), bool)) == 1
    assert ms(np.eye(3, dtype=bool)) is None  # never mixes
    two_islands = np.kron(np.eye(2, dtype=bool), np.ones((3, 3), bool))
    assert ms(two_islands) is None
    assert ms(_ring(16), max_steps=3) is None and ms(_ring(16), max_steps=8) == 8
    with pytest.raises(ValueError, match="square"):
        ms(np.ones((2, 3), bool))


def test_plot_writes_png(tmp_path):
    path = tmp_path / "layout.png"
    assert jbs.layouts.plot(jbs.layouts.barabasi_albert(32, 2), path, title="BA") == path
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    jbs.layouts.plot(jbs.layouts.random((3, 12), 0.5), tmp_path / "wide.png")
    assert (tmp_path / "wide.png").stat().st_size > 0
