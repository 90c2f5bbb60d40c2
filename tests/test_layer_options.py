"""``precision=`` and ``impl=`` on every block-sparse layer (linen and nnx).

Each layer takes the two options of its ops (:func:`jax_blocksparse.bsmm`,
:func:`~jax_blocksparse.bsconv`, ...) and hands them to every product of its forward
and backward pass, whatever the global default:

* ``impl``: the jaxpr's ``bsmm_*`` equations carry it, and the CPU lowering calls the
  FFI targets of the ``jbs_bsmm_*`` kernels under ``"kernels"`` and none of them under
  ``"reference"`` (as tests/test_impl.py reads it), under jit and grad, through
  ``nn.RNN``'s (linen) or ``lax.scan``'s (nnx) scan for the cells and the fused sequence's custom
  backward pass for ``BlockSparseLSTM``, while the default is the other one;
* ``precision``: every ``bsmm_*`` equation (and a dense input kernel's ``dot_general``)
  of the gradient's jaxpr records it;
* both implementations give the same loss and gradients (float32 tolerance);
* bad values raise a ValueError naming the layer and the attribute.

One small configuration per layer (block size 8, float32); each case is traced,
lowered and compiled once per implementation.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import cpu_mesh, eqns_named, kernel_calls, rand, require_kernels, xla_optimizations_off
from jax_blocksparse.ops.probe import ProbedLayout, dense_grid_blocks

pytestmark = pytest.mark.usefixtures("cpu_default_device")

BS = 8
MASK = np.array([[1, 0, 1, 1], [0, 1, 1, 0], [1, 1, 0, 1], [0, 0, 1, 1]], bool)  # [4, 4] blocks: 32 -> 32
CELL_MASK = np.array([[1, 1], [0, 1]], bool)  # H = 16
OTHER = {"reference": "kernels", "kernels": "reference"}
# The products' primitives: bsmm's, and the convolution's (ops/conv_primitives.py).
BSMM = ("bsmm_fprop", "bsmm_bprop", "bsmm_updat", "bsconv", "bsconv_wgrad")
HIGHEST = jax.lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------
# The cases: name -> build(**options) -> (loss, args); loss(*args) is a scalar and
# every arg is differentiated. Parameters do not depend on the options.
# ---------------------------------------------------------------------------------


def _mesh():
    return cpu_mesh((2,), ("model",))


@functools.cache
def _linen_variables(name):
    """Variables of a linen case: small random values of the shapes ``init`` gives
    (traced, not run: compiling the cells' init would cost more than the tests)."""
    module, x = LINEN[name]()
    shapes = jax.eval_shape(module.init, jax.random.key(0), x)
    leaves, tree = jax.tree.flatten(shapes)
    return jax.tree.unflatten(tree, [0.3 * rand(a.shape, a.dtype, seed=i) for i, a in enumerate(leaves)])


def _linen(name, **options):
    module, x = LINEN[name](**options)
    params = _linen_variables(name)["params"]
    return (lambda p, x: jnp.sum(module.apply({"params": p}, x) ** 2)), (params, x)


def _linen_dynamic(**options):
    """A dynamic dense layer given a probed layout: the probe's bsmm_updat too."""
    module = jbs.nn.BlockSparseDense(32, MASK, BS, capacity=int(MASK.sum()) + 1, dynamic=True, **options)
    x = rand((3, 32), seed=1)
    layout = module.layout  # what init puts in the "layout" collection
    probe = jnp.zeros(dense_grid_blocks(layout.grid, layout.block_size), jnp.float32)

    def loss(params, x, probe):
        y = module.apply({"params": params, "layout": {"kernel": ProbedLayout(layout, probe)}}, x)
        return jnp.sum(y**2)

    params = {"kernel": 0.3 * rand(layout.w_shape, seed=2), "bias": 0.3 * rand((32,), seed=3)}
    return loss, (params, x, probe)


def _nnx(make, x, **options):
    graphdef, state = nnx.split(make(rngs=nnx.Rngs(0), **options))
    return (lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x) ** 2)), (state, x)


def _lstm_cell(cls, **options):
    return cls(16, CELL_MASK, BS, internal_steps=1, **options)


def _nnx_cell(cls, **options):
    return cls(8, 16, CELL_MASK, BS, internal_steps=1, **options)


class _Scanned(nnx.Module):
    """An nnx cell over [B, T, D] with ``lax.scan`` (nnx.RNN keeps an rng count that
    a gradient trace may not mutate)."""

    def __init__(self, cell):
        self.cell = cell

    def __call__(self, x):
        carry = self.cell.initialize_carry(x[:, 0].shape)
        return jax.lax.scan(lambda c, xt: self.cell(c, xt), carry, jnp.swapaxes(x, 0, 1))[1]


LINEN = {
    "nn.BlockSparseDense": lambda **o: (jbs.nn.BlockSparseDense(32, MASK, BS, **o), rand((3, 32), seed=1)),
    "nn.BlockSparseConv": lambda **o: (
        jbs.nn.BlockSparseConv(32, (3, 3), MASK, BS, strides=2, **o),
        rand((1, 5, 5, 32), seed=1),
    ),
    "nn.BlockSparseConvTranspose": lambda **o: (
        jbs.nn.BlockSparseConvTranspose(32, (3, 3), MASK, BS, strides=2, **o),
        rand((1, 3, 3, 32), seed=1),
    ),
    "nn.ColumnParallelDense": lambda **o: (
        jbs.nn.ColumnParallelDense(32, MASK, BS, _mesh(), "model", **o),
        rand((2, 32), seed=1),
    ),
    "nn.BlockSparseLSTMCell": lambda **o: (nn.RNN(_lstm_cell(jbs.nn.BlockSparseLSTMCell, **o)), rand((2, 3, 8))),
    "nn.BlockSparseMLSTMCell": lambda **o: (nn.RNN(_lstm_cell(jbs.nn.BlockSparseMLSTMCell, **o)), rand((2, 3, 8))),
    # The fused sequence with its own options over a cell without (a block-sparse input kernel).
    "nn.BlockSparseLSTM": lambda **o: (
        jbs.nn.BlockSparseLSTM(
            jbs.nn.BlockSparseMLSTMCell(16, CELL_MASK, BS, internal_steps=1, input_mask=CELL_MASK), **o
        ),
        rand((2, 3, 16)),
    ),
}

NNX = {
    "nnx.BlockSparseLinear": (lambda **o: jbs.nnx.BlockSparseLinear(32, 32, MASK, BS, **o), (3, 32)),
    "nnx.BlockSparseConv": (
        lambda **o: jbs.nnx.BlockSparseConv(32, 32, (3, 3), MASK, BS, strides=2, **o),
        (1, 5, 5, 32),
    ),
    "nnx.BlockSparseConvTranspose": (
        lambda **o: jbs.nnx.BlockSparseConvTranspose(32, 32, (3, 3), MASK, BS, strides=2, **o),
        (1, 3, 3, 32),
    ),
    "nnx.ColumnParallelLinear": (
        lambda **o: jbs.nnx.ColumnParallelLinear(32, 32, MASK, BS, _mesh(), "model", **o),
        (2, 32),
    ),
    "nnx.BlockSparseLSTMCell": (lambda **o: _Scanned(_nnx_cell(jbs.nnx.BlockSparseLSTMCell, **o)), (2, 3, 8)),
    "nnx.BlockSparseMLSTMCell": (lambda **o: _Scanned(_nnx_cell(jbs.nnx.BlockSparseMLSTMCell, **o)), (2, 3, 8)),
    "nnx.BlockSparseLSTM": (
        lambda rngs, **o: jbs.nnx.BlockSparseLSTM(
            jbs.nnx.BlockSparseMLSTMCell(16, 16, CELL_MASK, BS, internal_steps=1, input_mask=CELL_MASK, rngs=rngs), **o
        ),
        (2, 3, 16),
    ),
}


def _case(name, **options):
    if name == "nn.BlockSparseDense(dynamic)":
        return _linen_dynamic(**options)
    if name in LINEN:
        return _linen(name, **options)
    make, shape = NNX[name]
    return _nnx(make, rand(shape, seed=1), **options)


CASES = sorted(LINEN) + ["nn.BlockSparseDense(dynamic)"] + sorted(NNX)


# ---------------------------------------------------------------------------------
# Reading a traced gradient
# ---------------------------------------------------------------------------------


@functools.cache
def _traced(name, impl):
    """(bsmm equations, dot_general equations, CPU lowering text, loss and gradients)
    of the case's value_and_grad with ``impl`` and precision HIGHEST, traced under
    the opposite default."""
    loss, args = _case(name, impl=impl, precision=HIGHEST)
    fun = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args)))))
    with jbs.config.implementation(OTHER[impl]):
        traced = fun.trace(*args)
        lowered = traced.lower(lowering_platforms=("cpu",))
    jaxpr = traced.jaxpr.jaxpr
    with xla_optimizations_off():
        values = lowered.compile()(*args)
    return eqns_named(jaxpr, BSMM), eqns_named(jaxpr, ("dot_general",)), lowered.as_text(), values


@pytest.mark.parametrize("impl", ["reference", "kernels"])
@pytest.mark.parametrize("name", CASES)
def test_impl_and_precision_reach_every_product(name, impl):
    """impl= beats the opposite default and precision= reaches every product, forward and backward."""
    require_kernels("cpu")  # "kernels" must lower to the custom calls
    bsmm, dots, text, _ = _traced(name, impl)
    names = {e.primitive.name for e in bsmm}
    forward, weight_grad = names & {"bsmm_fprop", "bsconv"}, names & {"bsmm_updat", "bsconv_wgrad"}
    assert forward and weight_grad, f"{name}: no forward or weight-gradient product in {names}"
    assert {e.params["impl"] for e in bsmm} == {impl}
    assert {e.params["precision"] for e in bsmm} == {HIGHEST}
    # A dense input projection (the cells) or a transpose in the layers' glue runs at it too.
    assert all(set(e.params["precision"] or (None,)) == {HIGHEST} for e in dots), [e.params["precision"] for e in dots]
    calls = bool(kernel_calls(text))
    assert calls == (impl == "kernels"), f"{name} with impl={impl!r}: FFI kernel calls in the lowering: {calls}"


@pytest.mark.parametrize("name", CASES)
def test_reference_and_kernels_agree(name):
    require_kernels("cpu")
    want = jax.tree.leaves(_traced(name, "reference")[3])
    got = jax.tree.leaves(_traced(name, "kernels")[3])
    assert len(got) == len(want)
    for g, w in zip(got, want):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5 * scale, err_msg=name)


@pytest.mark.parametrize("default", ["reference", "kernels"])
def test_none_reads_the_default_when_traced(default):
    """The layers' default (None) still follows the global default at trace time."""
    require_kernels("cpu")
    loss, args = _case("nn.BlockSparseLSTM")
    with jbs.config.implementation(default):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(*args).jaxpr
    assert {e.params["impl"] for e in eqns_named(jaxpr, BSMM)} == {default}


# ---------------------------------------------------------------------------------
# Bad values
# ---------------------------------------------------------------------------------

# class name -> construct(**options), without running anything.
CONSTRUCT = {
    "BlockSparseDense": lambda **o: jbs.nn.BlockSparseDense(32, MASK, BS, **o),
    "BlockSparseLinear": lambda **o: jbs.nnx.BlockSparseLinear(32, 32, MASK, BS, rngs=nnx.Rngs(0), **o),
    "nn.BlockSparseConv": lambda **o: jbs.nn.BlockSparseConv(32, (3, 3), MASK, BS, **o),
    "nnx.BlockSparseConv": lambda **o: jbs.nnx.BlockSparseConv(32, 32, (3, 3), MASK, BS, rngs=nnx.Rngs(0), **o),
    "nn.BlockSparseConvTranspose": lambda **o: jbs.nn.BlockSparseConvTranspose(32, (3, 3), MASK, BS, **o),
    "nnx.BlockSparseConvTranspose": lambda **o: jbs.nnx.BlockSparseConvTranspose(
        32, 32, (3, 3), MASK, BS, rngs=nnx.Rngs(0), **o
    ),
    "ColumnParallelDense": lambda **o: jbs.nn.ColumnParallelDense(32, MASK, BS, _mesh(), "model", **o),
    "ColumnParallelLinear": lambda **o: jbs.nnx.ColumnParallelLinear(
        32, 32, MASK, BS, _mesh(), "model", rngs=nnx.Rngs(0), **o
    ),
    "nn.BlockSparseLSTMCell": lambda **o: _lstm_cell(jbs.nn.BlockSparseLSTMCell, **o),
    "nnx.BlockSparseLSTMCell": lambda **o: _nnx_cell(jbs.nnx.BlockSparseLSTMCell, rngs=nnx.Rngs(0), **o),
    "nn.BlockSparseMLSTMCell": lambda **o: _lstm_cell(jbs.nn.BlockSparseMLSTMCell, **o),
    "nnx.BlockSparseMLSTMCell": lambda **o: _nnx_cell(jbs.nnx.BlockSparseMLSTMCell, rngs=nnx.Rngs(0), **o),
    "nn.BlockSparseLSTM": lambda **o: jbs.nn.BlockSparseLSTM(_lstm_cell(jbs.nn.BlockSparseLSTMCell), **o),
    "nnx.BlockSparseLSTM": lambda **o: jbs.nnx.BlockSparseLSTM(
        _nnx_cell(jbs.nnx.BlockSparseLSTMCell, rngs=nnx.Rngs(0)), **o
    ),
}


@pytest.mark.parametrize(
    "attribute, bad",
    [
        ("precision", "ultra"),
        ("precision", 3),
        ("precision", ("highest",)),
        ("impl", "fast"),
        ("impl", "Reference"),
        ("impl", 1),
    ],
)
@pytest.mark.parametrize("layer", sorted(CONSTRUCT))
def test_bad_values_raise_naming_the_layer_and_attribute(layer, attribute, bad):
    cls = layer.rsplit(".", 1)[-1]
    with pytest.raises(ValueError, match=rf"^{cls}: {attribute} must be"):
        CONSTRUCT[layer](**{attribute: bad})


@pytest.mark.parametrize("layer", sorted(CONSTRUCT))
def test_good_values_are_kept_canonical(layer):
    """Names and pairs become one jax.lax.Precision; None stays None (read when traced)."""
    module = CONSTRUCT[layer](precision=("high", "highest"), impl="reference")
    assert (module.precision, module.impl) == (HIGHEST, "reference")
    module = CONSTRUCT[layer]()
    assert (module.precision, module.impl) == (None, None)


def test_bad_sequence_override_raises():
    cell = _lstm_cell(jbs.nn.BlockSparseLSTMCell)
    x = jnp.ones((3, 2, 8))
    carry = cell.initialize_carry(jax.random.key(0), x.shape[1:])
    with pytest.raises(ValueError, match=r"^BlockSparseLSTMCell\.sequence: impl must be"):
        nn.apply(lambda c: c.sequence(carry, x, impl="fast"), cell)({})
