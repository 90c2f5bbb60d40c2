"""The CUDA lowering, checked on any machine: lower for 'cuda' and read the custom calls.

No GPU is needed: ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs
the 'cuda' lowering rules and gives StableHLO text. Under implementation "kernels" the
text must call the expected FFI targets and never build the dense [C, K] weight; under
"reference" it must call none of them.

Skips when the extension is not built, unless JBS_REQUIRE_KERNELS=1 (CI), where
a missing extension is a failure.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import kernel_calls, require_cuda_extension
from jax_blocksparse import _native

TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")
BLOCK = 16
GRID = (3, 5)  # C = 48 != K = 80, so a dense weight would show up as tensor<48x80 / 80x48
C, K = GRID[0] * BLOCK, GRID[1] * BLOCK
N = 7


@pytest.fixture(autouse=True)
def _need_extension():
    require_cuda_extension()


def _layout():
    mask = np.zeros(GRID, bool)
    mask[0, 1] = mask[2, 1] = mask[1, 3] = mask[2, 4] = True
    return jbs.Layout.from_mask(mask, BLOCK, capacity=6)  # capacity > nnz: padding slots


def _lower(fun, *args, impl):
    # A fresh wrapper per call: jit's trace cache is keyed on the function, not on the
    # implementation in force, so reusing `fun` could return a jaxpr traced under another.
    with jbs.config.implementation(impl):
        return jax.jit(lambda *a: fun(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text):
    return kernel_calls(text) & set(TARGETS)


def _dense_weight_in(text):
    return f"tensor<{C}x{K}x" in text or f"tensor<{K}x{C}x" in text


# name -> (function of (x, w, dy, layout), argument maker, targets expected under "kernels")
def _cases():
    lay = _layout()

    def fprop(x, w, dy):
        return jbs.bsmm(x, w, lay)

    def bprop(x, w, dy):
        return jbs.bsmm(dy, w, lay, transpose=True)

    def updat(x, w, dy):
        return jbs.bsmm_updat(x, dy, lay)

    def loss(x, w, dy):
        return jnp.sum(jbs.bsmm(x, w, lay).astype(jnp.float32) ** 2)

    def grad_x(x, w, dy):
        return jax.grad(loss, argnums=0)(x, w, dy)

    def grad_w(x, w, dy):
        return jax.grad(loss, argnums=1)(x, w, dy)

    def vmap_x(x, w, dy):
        return jax.vmap(lambda xi: jbs.bsmm(xi, w, lay))(jnp.stack([x, 2 * x]))

    def vmap_w(x, w, dy):
        return jax.vmap(lambda wi: jbs.bsmm(x, wi, lay))(jnp.stack([w, 2 * w]))

    def batch_dims(x, w, dy):
        return jbs.bsmm(x.reshape(1, N, C), w, lay, preferred_element_type=jnp.float16)

    return {
        "fprop": (fprop, {"jbs_bsmm_fprop"}),
        "bprop": (bprop, {"jbs_bsmm_bprop"}),
        "updat": (updat, {"jbs_bsmm_updat"}),
        "grad_x": (grad_x, {"jbs_bsmm_fprop", "jbs_bsmm_bprop"}),
        "grad_w": (grad_w, {"jbs_bsmm_fprop", "jbs_bsmm_updat"}),
        "vmap_x": (vmap_x, {"jbs_bsmm_fprop"}),
        "vmap_w": (vmap_w, {"jbs_bsmm_fprop"}),
        "batch_dims_f16_out": (batch_dims, {"jbs_bsmm_fprop"}),
    }


CASES = _cases()


def _args(dtype):
    lay = _layout()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N, C)), dtype)
    w = jnp.asarray(rng.standard_normal(lay.w_shape), dtype)
    dy = jnp.asarray(rng.standard_normal((N, K)), dtype)
    return x, w, dy


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_lower_to_custom_calls(name, dtype):
    fun, expected = CASES[name]
    text = _lower(fun, *_args(dtype), impl="kernels")
    assert _calls(text) == expected, (name, _calls(text))
    assert not _dense_weight_in(text), f"{name}: a dense [{C}, {K}] weight appears in the lowering"


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_lowers_without_custom_calls(name):
    fun, _ = CASES[name]
    text = _lower(fun, *_args(jnp.float32), impl="reference")
    assert _calls(text) == set()


def test_auto_without_a_cuda_device_takes_the_reference():
    # Cross-lowering: no GPU here, so no compute capability the gate verified anything on
    # (tests/test_gate.py checks the choice on a verified one).
    fun, _ = CASES["grad_w"]
    text = _lower(fun, *_args(jnp.float32), impl="auto")
    assert _calls(text) == set()


def test_order_operand_and_out_dtype_cast():
    # fprop takes the extra `order` operand; a float16 result from bfloat16 inputs is a
    # float32 kernel output cast by the lowering (handlers write the input dtype or f32).
    fun, _ = CASES["batch_dims_f16_out"]
    text = _lower(fun, *_args(jnp.bfloat16), impl="kernels")
    call = next(line for line in text.splitlines() if kernel_calls(line) == {"jbs_bsmm_fprop"})
    assert call.count("%") - 1 == 8, call  # x, w, five tables, order
    assert "-> tensor<1x7x80xf32>" in call, call


def test_kernels_without_extension_raise_at_lowering(monkeypatch):
    monkeypatch.setattr(_native, "_load", lambda: (None, {}, "simulated: extension not built"))
    fun, _ = CASES["fprop"]
    with pytest.raises(RuntimeError, match="implementation 'kernels'.*simulated: extension not built"):
        _lower(fun, *_args(jnp.float32), impl="kernels")
    # "auto" and "reference" quietly use the reference instead.
    for impl in ("auto", "reference"):
        assert _calls(_lower(fun, *_args(jnp.float32), impl=impl)) == set()


def test_extension_info():
    info = _native.extension_info()
    assert info["cuda"] and info["cuda_version"] and info["archs"], info
    assert {jbs.targets.target_name(t) for t in TARGETS} <= _native.registered_targets("cuda")


@pytest.mark.parametrize("as_argument", [False, True], ids=["closed_over", "argument"])
@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
def test_no_device_work_besides_the_product(op, as_argument):
    """The work plan comes with the layout: the kernel call is the program's only op.

    A layout closed over or passed as an argument adds nothing (no sort of the column
    lengths, no arithmetic on the tables) on 'cuda', and on 'cpu' after XLA's passes.
    """
    layout = _layout()
    x, dy = jnp.ones((N, C)), jnp.ones((N, K))
    w = jnp.ones(layout.w_shape)
    fun = {
        "fprop": lambda x, w, dy, lay: jbs.bsmm(x, w, lay),
        "bprop": lambda x, w, dy, lay: jbs.bsmm(dy, w, lay, transpose=True),
        "updat": lambda x, w, dy, lay: jbs.bsmm_updat(x, dy, lay),
    }[op]
    args = (x, w, dy, layout) if as_argument else (x, w, dy)
    call = fun if as_argument else (lambda x, w, dy: fun(x, w, dy, layout))
    text = _lower(call, *args, impl="kernels")
    ops = set(re.findall(r"= (?:stablehlo|mhlo|chlo)\.([a-z_]+)", text))
    assert ops <= {"custom_call", "constant"}, ops
    with jbs.config.implementation("kernels"):
        compiled = jax.jit(call).lower(*args).compile().as_text()
    entry = compiled[compiled.index("ENTRY") :]
    hlo_ops = set(re.findall(r"= \S+ ([a-z-]+)\(", entry))
    assert hlo_ops <= {"parameter", "constant", "custom-call"}, hlo_ops
