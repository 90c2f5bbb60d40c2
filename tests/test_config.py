"""The implementation switch (jbs.config): context, environment variable, retracing.

Kept apart from tests/test_matmul.py, whose every test runs under both implementations.
"""

import jax
import jax.numpy as jnp
import pytest
from test_matmul import F32, OPS, operands

import jax_blocksparse as jbs
from helpers import assert_close, make_mask, np_blocks, rand


@pytest.fixture(scope="module")
def problem():
    """A small layout with empty rows and columns and two padding slots."""
    mask = make_mask("empty_rows_cols", (3, 4))
    layout = jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 2)
    return mask, layout, jnp.asarray(np_blocks(rand(layout.shape, seed=1), mask, 8, layout.capacity))


def _impls(f, *args):
    jaxpr = jax.make_jaxpr(f)(*args)
    return {str(e.params["impl"]) for e in jaxpr.jaxpr.eqns if e.primitive.name.startswith("bsmm")}


@pytest.mark.parametrize("op", OPS)
def test_reference_implementation_gives_same_results(problem, op):
    _, layout, w = problem
    a, b = operands(op, layout, (2,), F32, w)
    fn = OPS[op][0]

    def value_and_grads():  # a fresh function each call: JAX caches traces per function
        return jax.value_and_grad(lambda a_, b_: jnp.sum(fn(a_, b_, layout) ** 2), argnums=(0, 1))

    before = jbs.config.get_implementation()
    auto = jax.jit(value_and_grads())(a, b)
    with jbs.config.implementation("reference"):
        assert jbs.config.get_implementation() == "reference"
        f = value_and_grads()
        assert _impls(f, a, b) == {"reference"}  # grads too: JVP and transpose keep impl
        reference = jax.jit(f)(a, b)
    assert jbs.config.get_implementation() == before
    for g, r in zip(jax.tree_util.tree_leaves(auto), jax.tree_util.tree_leaves(reference)):
        assert_close(g, r, F32, 32)


def test_context_retraces_already_traced_functions(problem):
    _, layout, w = problem
    x = rand((2, 24))
    f = lambda x_: jbs.bsmm(x_, w, layout)  # noqa: E731
    jitted = jax.jit(f)
    jitted(x)  # traced and cached outside the context
    with jbs.config.implementation("reference"):
        assert _impls(f, x) == {"reference"}
        assert "impl=reference" in str(jax.jit(f).trace(x).jaxpr)
        jitted(x)
    assert _impls(f, x) == {jbs.config.get_implementation()}  # nothing traced inside leaks out


def test_config_env_var_and_nesting(problem, monkeypatch):
    _, layout, w = problem
    x = rand((2, 24))

    def impls():  # a fresh function each time, so that JAX traces it anew
        return _impls(lambda x_: jbs.bsmm(x_, w, layout), x)

    monkeypatch.setenv(jbs.config.ENV_VAR, " Reference ")
    assert jbs.config.get_implementation() == "reference" and impls() == {"reference"}
    with jbs.config.implementation("auto"):  # the context beats the environment
        assert impls() == {"auto"}
        with jbs.config.implementation("reference"):
            assert impls() == {"reference"}
        assert jbs.config.get_implementation() == "auto"
    monkeypatch.delenv(jbs.config.ENV_VAR)
    assert impls() == {"auto"}
    f = lambda x_: jbs.bsmm(x_, w, layout)  # noqa: E731
    monkeypatch.setenv(jbs.config.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="JAX_BLOCKSPARSE_IMPL must be one of"):
        f(x)
    with pytest.raises(ValueError, match="implementation must be one of"), jbs.config.implementation("cuda"):
        pass


def test_context_never_clears_jax_caches(problem, monkeypatch):
    """Switching keys jit's caches on the setting instead of emptying them."""
    _, layout, w = problem
    x = rand((2, 24))

    def refuse():
        raise AssertionError("jbs.config must not clear JAX's caches")

    monkeypatch.setattr(jax, "clear_caches", refuse)
    f = jax.jit(lambda x_: jbs.bsmm(x_, w, layout))
    f(x)
    for impl in jbs.config.IMPLEMENTATIONS:
        with jbs.config.implementation(impl):
            f(x)
    assert f._cache_size() == 1 + len({*jbs.config.IMPLEMENTATIONS})


def test_context_restores_the_default_after_an_exception():
    before = jbs.config.get_implementation()
    with pytest.raises(KeyError), jbs.config.implementation("reference"), jbs.config.implementation("kernels"):
        raise KeyError("inside")
    assert jbs.config.get_implementation() == before


def test_env_var_is_read_at_trace_time(problem, monkeypatch):
    """The environment variable is the default of calls traced after it is set; impl= and
    the context both beat it."""
    _, layout, w = problem
    x = rand((2, 24))
    monkeypatch.setenv(jbs.config.ENV_VAR, "reference")
    assert _impls(lambda x_: jbs.bsmm(x_, w, layout), x) == {"reference"}
    assert _impls(lambda x_: jbs.bsmm(x_, w, layout, impl="auto"), x) == {"auto"}
    monkeypatch.setenv(jbs.config.ENV_VAR, "kernels")
    assert _impls(lambda x_: jbs.bsmm(x_, w, layout), x) == {"kernels"}


@pytest.mark.parametrize("given", ["auto", "reference", "kernels", "dense"])
def test_canonical_impl(given):
    want = given
    assert jbs.config.canonical_impl(given) == want
    with jbs.config.implementation("reference"):
        assert jbs.config.canonical_impl(None) == "reference"
        assert jbs.config.canonical_impl(given) == want


@pytest.mark.parametrize("bad", ["REFERENCE", "cuda", "", 0, ["auto"]])
def test_canonical_impl_rejects_bad_values(bad):
    message = r"impl must be None or one of \('auto', 'reference', 'kernels', 'dense'\), got"
    with pytest.raises(ValueError, match=message):
        jbs.config.canonical_impl(bad)
    with pytest.raises(ValueError, match="implementation must be one of"), jbs.config.implementation(bad):
        pass


def test_context_on_a_jax_without_user_contexts(monkeypatch):
    """Where jax has no make_user_context the context manager says so; impl= and the
    environment variable still work."""
    monkeypatch.setattr(jbs.config, "_context", None)
    monkeypatch.setenv(jbs.config.ENV_VAR, "reference")
    assert jbs.config.get_implementation() == "reference"
    with pytest.raises(RuntimeError, match="needs jax.make_user_context.*impl="), jbs.config.implementation("auto"):
        pass
