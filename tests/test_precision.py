"""``precision=`` on bsmm, bsmm_updat, bsconv and bsconv_transpose: lax.dot_general's meaning.

The contract (docs/guide/precision.rst): None reads :func:`jax.default_matmul_precision` at
trace time and is recorded in the primitive, so every product of a gradient runs at the
precision its forward was traced with. The reference lowering hands it to XLA's dot (on
GPU, float32 at DEFAULT may use TF32 as ``jnp.dot`` does); HIGHEST is exact float32.
The CPU kernels and the CUDA kernels for Ampere and later compute float32 exactly at every
precision, which the contract allows; the Hopper kernels use TF32 below HIGHEST.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jax_blocksparse as jbs
from helpers import eqns_named, make_problem, rand
from jax_blocksparse.ops._checks import canonical_precision

# bsmm's primitives and the convolution's (ops/conv_primitives.py).
PRIMITIVES = ("bsmm_fprop", "bsmm_bprop", "bsmm_updat", "bsconv", "bsconv_wgrad")


@pytest.fixture(autouse=True)
def _no_default_precision():
    """These tests set the precision themselves: start from JAX's own default (None),
    whatever the suite pins for its float32 comparisons (tests/conftest.py)."""
    with jax.default_matmul_precision(None):
        yield


def _problem():
    _, layout, w = make_problem(block_size=16, grid=(3, 4))
    x = rand((5, layout.shape[0]), jnp.float32, 1)
    return layout, x, w


def _loss(layout, **kw):
    return lambda x, w: jnp.sum(jbs.bsmm(x, w, layout, **kw) ** 2)


@pytest.mark.parametrize(
    "given, want",
    [
        (None, None),
        ("highest", lax.Precision.HIGHEST),
        ("float32", lax.Precision.HIGHEST),
        ("tensorfloat32", lax.Precision.HIGH),
        (lax.Precision.DEFAULT, lax.Precision.DEFAULT),
        ((lax.Precision.DEFAULT, lax.Precision.HIGHEST), lax.Precision.HIGHEST),
        (("high", None), lax.Precision.HIGH),
        (("default", "default"), lax.Precision.DEFAULT),
    ],
)
def test_canonical_precision(given, want):
    assert canonical_precision(given) == want


def test_none_reads_the_default_matmul_precision():
    with jax.default_matmul_precision("highest"):
        assert canonical_precision(None) == lax.Precision.HIGHEST
    with jax.default_matmul_precision("tensorfloat32"):
        assert canonical_precision(None) == lax.Precision.HIGH


@pytest.mark.parametrize("context", [False, True])
def test_gradient_products_keep_the_precision(context):
    """Explicit or from the context: fprop, bprop and updat of grad all record HIGHEST."""
    layout, x, w = _problem()
    if context:
        with jax.default_matmul_precision("highest"):
            jaxpr = jax.make_jaxpr(jax.grad(_loss(layout), argnums=(0, 1)))(x, w)
    else:
        jaxpr = jax.make_jaxpr(jax.grad(_loss(layout, precision="highest"), argnums=(0, 1)))(x, w)
    eqns = _bsmm_eqns(jaxpr.jaxpr)
    assert {e.primitive.name for e in eqns} == {"bsmm_fprop", "bsmm_bprop", "bsmm_updat"}
    assert all(e.params["precision"] == lax.Precision.HIGHEST for e in eqns), [e.params for e in eqns]


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_reference_lowering_passes_the_precision_to_xla(platform):
    layout, x, w = _problem()
    grad = jax.grad(_loss(layout, precision="highest"), argnums=(0, 1))
    with jbs.config.implementation("reference"):
        text = jax.jit(grad).trace(x, w).lower(lowering_platforms=(platform,)).as_text()
        default = jax.jit(jax.grad(_loss(layout), argnums=(0, 1))).trace(x, w).lower(lowering_platforms=(platform,))
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots), dots
    assert "HIGHEST" not in default.as_text()


@pytest.mark.parametrize("impl", ["reference", "kernels"])
def test_highest_is_exact_float32(impl):
    """At HIGHEST both paths match a float64 product to float32 rounding."""
    if impl == "kernels":
        from helpers import require_kernels

        require_kernels("cpu")
    layout, x, w = _problem()
    W = np.asarray(jbs.to_dense(w, layout), np.float64)
    want = np.asarray(x, np.float64) @ W
    with jbs.config.implementation(impl):
        got = jax.jit(lambda x, w: jbs.bsmm(x, w, layout, precision="highest"))(x, w)
        dw = jax.jit(lambda x, g: jbs.bsmm_updat(x, g, layout, precision="highest"))(x, got)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    want_dw = np.asarray(jbs.from_dense(jnp.asarray(np.asarray(x, np.float64).T @ want, jnp.float32), layout))
    np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=1e-4, atol=1e-5 * np.abs(want_dw).max())


@pytest.mark.parametrize("op", ["bsconv", "bsconv_transpose"])
def test_convolutions_take_precision(op):
    layout = jbs.Layout.from_mask(jbs.layouts.random((2, 2), 0.5, seed=0), 16)
    x = rand((2, 6, 6, 32), jnp.float32, 1)
    w = rand((layout.capacity, 3, 3, 16, 16), jnp.float32, 2)
    fn = getattr(jbs, op)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(fn(x, w, layout, precision="highest")), argnums=(0, 1)))(x, w)
    eqns = _bsmm_eqns(jaxpr.jaxpr)
    assert eqns and all(e.params["precision"] == lax.Precision.HIGHEST for e in eqns)


@pytest.mark.parametrize(
    "precision, error, match",
    [
        ("fast", TypeError, r"precision must be None, a jax.lax.Precision.*got 'fast'"),
        (3, TypeError, r"precision must be None.*got 3"),
        (("high", "high", "high"), ValueError, r"precision must be one value or a \(lhs, rhs\) pair"),
    ],
)
def test_bad_precision_raises(precision, error, match):
    layout, x, w = _problem()
    with pytest.raises(error, match=match):
        jbs.bsmm(x, w, layout, precision=precision)
    with pytest.raises(error, match=match):
        jbs.bsmm_updat(x, jnp.ones((5, layout.shape[1])), layout, precision=precision)


def _bsmm_eqns(jaxpr):
    """Every bsmm or bsconv primitive equation of a jaxpr, nested jaxprs included."""
    return eqns_named(jaxpr, PRIMITIVES)
