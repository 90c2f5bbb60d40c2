"""``impl=`` per call on bsmm, bsmm_updat, bsconv and bsconv_transpose, and the default
context without cache clearing.

The contract (jbs.config): an explicit ``impl=`` chooses the lowering of that call and
of its gradient, JVP and vmap, whatever the default; ``impl=None`` reads the default
(the innermost ``jbs.config.implementation`` context, else the environment variable)
at trace time. The context is part of ``jax.jit``'s cache key: a function that uses the
ops is traced anew inside it, while a user's jitted function called outside is never
traced or compiled again because a context was entered and left.

Which path a call takes is read from the CPU lowering: under "kernels" the StableHLO
calls the FFI targets of the ``jbs_bsmm_*`` and ``jbs_bsconv*`` kernels, under "reference"
none of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import eqns_named, kernel_calls, rand, require_kernels

BSMM_PRIMITIVES = ("bsmm_fprop", "bsmm_bprop", "bsmm_updat")
# The convolution's primitives and their CPU kernels (on CUDA it lowers to bsmm products).
PRIMITIVES = (*BSMM_PRIMITIVES, "bsconv", "bsconv_wgrad")
BSMM_TARGETS = tuple(f"jbs_{p}" for p in BSMM_PRIMITIVES)
TARGETS = tuple(f"jbs_{p}" for p in PRIMITIVES)
OTHER = {"reference": "kernels", "kernels": "reference"}


@pytest.fixture(autouse=True, scope="module")
def _cpu_kernels():
    # "kernels" must lower to the custom calls: the check needs the CPU kernels built.
    require_kernels("cpu")


def _layout():
    mask = np.array([[1, 0, 1], [0, 1, 1]], bool)
    return jbs.Layout.from_mask(mask, 8, capacity=int(mask.sum()) + 1)  # a padding slot


# op name -> (operand maker, function of (a, b, **kw)); every op is linear in both operands.
def _ops():
    lay = _layout()
    c, k = lay.shape
    conv_w = (lay.capacity, 3, 3, 8, 8)
    return {
        "bsmm": (
            lambda: (rand((3, c), seed=1), rand(lay.w_shape, seed=2)),
            lambda a, b, **kw: jbs.bsmm(a, b, lay, **kw),
        ),
        "bsmm_transpose": (
            lambda: (rand((3, k), seed=1), rand(lay.w_shape, seed=2)),
            lambda a, b, **kw: jbs.bsmm(a, b, lay, transpose=True, **kw),
        ),
        "bsmm_float32_dw": (
            lambda: (rand((3, c), seed=1), rand(lay.w_shape, seed=2)),
            lambda a, b, **kw: jbs.bsmm(a, b, lay, compute_dtype=jnp.bfloat16, float32_dw=True, **kw),
        ),
        "bsmm_updat": (
            lambda: (rand((3, c), seed=1), rand((3, k), seed=2)),
            lambda a, b, **kw: jbs.bsmm_updat(a, b, lay, **kw),
        ),
        "bsconv": (
            lambda: (rand((1, 5, 5, c), seed=1), rand(conv_w, seed=2)),
            lambda a, b, **kw: jbs.bsconv(a, b, lay, strides=2, **kw),
        ),
        "bsconv_transpose": (
            lambda: (rand((1, 3, 3, c), seed=1), rand(conv_w, seed=2)),
            lambda a, b, **kw: jbs.bsconv_transpose(a, b, lay, strides=2, **kw),
        ),
    }


OPS = _ops()


# transform name -> function of (op, **kw) to (a, b) -> outputs
def _grad(fn, **kw):
    return jax.grad(lambda a, b: jnp.sum(fn(a, b, **kw).astype(jnp.float32) ** 2), argnums=(0, 1))


def _jvp(fn, **kw):
    return lambda a, b: jax.jvp(lambda a_, b_: fn(a_, b_, **kw), (a, b), (2 * a, 3 * b))


def _vmap(fn, **kw):
    # Both operands batched: the batching rule stacks the layouts (the general path).
    batched = jax.vmap(lambda a, b: fn(a, b, **kw))
    return lambda a, b: batched(jnp.stack([a, 2 * a]), jnp.stack([b, -b]))


TRANSFORMS = {"jit": lambda fn, **kw: lambda a, b: fn(a, b, **kw), "grad": _grad, "jvp": _jvp, "vmap": _vmap}


def _path(fun, *args, platform="cpu"):
    """(impl parameters of every bsmm equation, FFI targets called by the lowering for
    ``platform``)."""
    impls = {e.params["impl"] for e in _bsmm_eqns(jax.make_jaxpr(fun)(*args).jaxpr)}
    text = jax.jit(fun).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return impls, kernel_calls(text) & set(TARGETS)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("impl", ["reference", "kernels"])
def test_impl_per_call_survives_every_transform(op, transform, impl):
    """impl= beats the opposite default, through jit, grad, jvp and vmap."""
    make, fn = OPS[op]
    fun = TRANSFORMS[transform](fn, impl=impl)
    with jbs.config.implementation(OTHER[impl]):
        impls, targets = _path(fun, *make())
    assert impls == {impl}
    if impl == "reference":
        assert targets == set(), f"{op} under {transform} with impl='reference' calls {targets}"
    else:
        assert targets, f"{op} under {transform} with impl='kernels' calls no kernel"


@pytest.mark.parametrize("op", ["bsmm", "bsconv_transpose"])
@pytest.mark.parametrize("impl", ["reference", "kernels"])
def test_impl_per_call_on_the_cuda_lowering(op, impl):
    """The same choice on the 'cuda' lowering (lowered as text: no GPU needed)."""
    require_kernels("cuda")
    make, fn = OPS[op]
    with jbs.config.implementation(OTHER[impl]):
        impls, targets = _path(_grad(fn, impl=impl), *make(), platform="cuda")
    assert impls == {impl}
    assert targets == (set() if impl == "reference" else set(BSMM_TARGETS)), targets


@pytest.mark.parametrize("default", ["reference", "kernels"])
@pytest.mark.parametrize("op", sorted(OPS))
def test_impl_none_reads_the_default_at_trace_time(op, default):
    make, fn = OPS[op]
    with jbs.config.implementation(default):
        impls, targets = _path(_grad(fn), *make())  # a fresh function: traced inside
    assert impls == {default}
    assert bool(targets) == (default == "kernels"), targets


@pytest.mark.parametrize("impl", ["auto", "reference", "kernels"])
def test_results_agree_across_implementations(impl):
    make, fn = OPS["bsconv"]
    a, b = make()
    want = jax.jit(_grad(fn, impl="reference"))(a, b)
    got = jax.jit(_grad(fn, impl=impl))(a, b)
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("bad", ["cuda", "Reference", "", 1, ("reference",)])
def test_bad_impl_raises(op, bad):
    make, fn = OPS[op]
    with pytest.raises(ValueError, match=r"impl must be None or one of \('auto', 'reference', 'kernels', 'dense'\)"):
        fn(*make(), impl=bad)


def test_bad_impl_raises_for_empty_convolutions():
    """The zero-size shortcut of bsconv still checks impl."""
    lay = _layout()
    x, w = jnp.zeros((0, 5, 5, lay.shape[0])), jnp.zeros((lay.capacity, 3, 3, 8, 8))
    with pytest.raises(ValueError, match="impl must be"):
        jbs.bsconv(x, w, lay, impl="fast")
    assert jbs.bsconv(x, w, lay, impl="reference").shape == (0, 5, 5, lay.shape[1])


# ---------------------------------------------------------------------------------
# The default context is part of jit's cache key; no cache is ever cleared
# ---------------------------------------------------------------------------------


class _Compiles:
    """Counts XLA backend compilations (a jax.monitoring duration event) while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def test_switching_does_not_recompile_unrelated_functions():
    traces = []

    @jax.jit
    def user_fn(x):  # the user's own jitted code, no block-sparse op in it
        traces.append(1)
        return jnp.tanh(x) @ x.T

    make, fn = OPS["bsmm"]
    a, b = make()
    x = rand((4, 4), seed=3)
    with _Compiles() as compiles:
        user_fn(x)
    assert compiles.count == 1 and len(traces) == 1 and user_fn._cache_size() == 1
    sparse = jax.jit(lambda a_, b_: fn(a_, b_))
    with _Compiles() as compiles:
        for impl in ("reference", "kernels", "auto"):
            with jbs.config.implementation(impl):
                sparse(a, b)
    assert compiles.count == 3  # the listener sees the compilations that do happen
    with _Compiles() as compiles:
        user_fn(x)  # outside again: the program compiled before is still cached
        with jbs.config.implementation("reference"):
            pass
        user_fn(x)
    assert compiles.count == 0 and len(traces) == 1 and user_fn._cache_size() == 1


def test_context_retraces_a_function_using_the_ops_and_keeps_both_programs():
    traces = []
    make, fn = OPS["bsmm"]
    a, b = make()

    @jax.jit
    def step(a_, b_):
        traces.append(jbs.config.get_implementation())
        return fn(a_, b_)

    outer = jbs.config.get_implementation()
    inner = OTHER.get(outer, "reference")
    y = step(a, b)
    with jbs.config.implementation(inner):
        assert {e.params["impl"] for e in _bsmm_eqns(step.trace(a, b).jaxpr.jaxpr)} == {inner}
        y_inner = step(a, b)
        step(a, b)
    with _Compiles() as compiles:
        step(a, b)  # the outer program again: cached, not traced or compiled anew
    assert traces == [outer, inner] and compiles.count == 0 and step._cache_size() == 2
    np.testing.assert_allclose(np.asarray(y_inner), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_explicit_impl_is_not_retraced_by_the_context():
    """A call with impl= means the same program in every context; still, jit keys on the
    context, so it is traced once per context value (and only once)."""
    traces = []
    make, fn = OPS["bsmm"]
    a, b = make()

    @jax.jit
    def step(a_, b_):
        traces.append(1)
        return fn(a_, b_, impl="reference")

    for _ in range(2):
        with jbs.config.implementation("kernels"):
            assert {e.params["impl"] for e in _bsmm_eqns(step.trace(a, b).jaxpr.jaxpr)} == {"reference"}
            step(a, b)
    assert len(traces) == 1


def test_context_is_per_thread():
    """Like JAX's own contexts: another thread sees the default, not this thread's context."""
    import threading

    seen = []
    with jbs.config.implementation("reference"):
        thread = threading.Thread(target=lambda: seen.append(jbs.config.get_implementation()))
        thread.start()
        thread.join()
        assert jbs.config.get_implementation() == "reference"
    assert seen == [jbs.config.get_implementation()]


def _bsmm_eqns(jaxpr):
    """Every bsmm primitive equation of a jaxpr, nested jaxprs included."""
    return eqns_named(jaxpr, PRIMITIVES)
