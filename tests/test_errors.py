"""Bad inputs raise ValueError / TypeError whose message names the argument and the shapes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import make_mask, rand

MASK = make_mask("random", (3, 4), seed=1)  # W is [24, 32] at block size 8
LAYOUT = jbs.Layout.from_mask(MASK, 8)
CAP = LAYOUT.capacity
W = jnp.zeros(LAYOUT.w_shape)
X, G = rand((5, 24)), rand((5, 32))

CASES = {
    # operand shapes
    "x last dim": (
        lambda: jbs.bsmm(rand((5, 23)), W, LAYOUT),
        ValueError,
        r"x must have shape \[\.\.\., C=24\].*\(24, 32\).*\(5, 23\)",
    ),
    "x is 0-d": (
        lambda: jbs.bsmm(jnp.float32(1), W, LAYOUT),
        ValueError,
        r"x must have shape \[\.\.\., C=24\].*got x \(\)",
    ),
    "transpose x last dim": (
        lambda: jbs.bsmm(X, W, LAYOUT, transpose=True),
        ValueError,
        r"x must have shape \[\.\.\., K=32\].*transpose=True.*\(5, 24\)",
    ),
    "w block shape": (
        lambda: jbs.bsmm(X, jnp.zeros((CAP, 8, 16)), LAYOUT),
        ValueError,
        rf"w must have shape \[capacity, bs, bs\] = \({CAP}, 8, 8\).*got \({CAP}, 8, 16\)",
    ),
    "w capacity": (
        lambda: jbs.bsmm(X, jnp.zeros((CAP + 1, 8, 8)), LAYOUT),
        ValueError,
        rf"w must have shape.*got \({CAP + 1}, 8, 8\)",
    ),
    "w rank": (lambda: jbs.bsmm(X, jnp.zeros((24, 32)), LAYOUT), ValueError, r"w must have shape.*got \(24, 32\)"),
    "w rank transpose": (
        lambda: jbs.bsmm(G, jnp.zeros((CAP, 64)), LAYOUT, transpose=True),
        ValueError,
        rf"w must have shape.*got \({CAP}, 64\)",
    ),
    "to_dense w shape": (
        lambda: jbs.to_dense(jnp.zeros((CAP, 16, 16)), LAYOUT),
        ValueError,
        rf"w must have shape.*got \({CAP}, 16, 16\)",
    ),
    "from_dense W shape": (
        lambda: jbs.from_dense(jnp.zeros((25, 32)), LAYOUT),
        ValueError,
        r"W must have shape \(24, 32\).*got \(25, 32\)",
    ),
    "from_dense W rank": (
        lambda: jbs.from_dense(jnp.zeros((24 * 32,)), LAYOUT),
        ValueError,
        r"W must have shape \(24, 32\).*got \(768,\)",
    ),
    "updat leading dims": (
        lambda: jbs.bsmm_updat(rand((5, 24)), rand((4, 32)), LAYOUT),
        ValueError,
        r"x \[\.\.\., C=24\] and dy \[\.\.\., K=32\] with equal leading dims.*\(5, 24\).*\(4, 32\)",
    ),
    "updat leading rank": (
        lambda: jbs.bsmm_updat(rand((2, 5, 24)), G, LAYOUT),
        ValueError,
        r"equal leading dims.*\(2, 5, 24\).*\(5, 32\)",
    ),
    "updat dy last dim": (
        lambda: jbs.bsmm_updat(X, rand((5, 24)), LAYOUT),
        ValueError,
        r"dy \[\.\.\., K=32\].*\(5, 24\)",
    ),
    # dtypes
    "integer x": (
        lambda: jbs.bsmm(jnp.ones((5, 24), jnp.int32), W, LAYOUT),
        TypeError,
        r"x must be float32, bfloat16 or float16, got int32 with shape \(5, 24\)",
    ),
    "python int x": (
        lambda: jbs.bsmm([[1] * 24], W, LAYOUT),
        TypeError,
        r"x must be float32.*got int32 with shape \(1, 24\)",
    ),
    "float64 w": (
        lambda: jbs.bsmm(X, np.zeros(LAYOUT.w_shape), LAYOUT),
        TypeError,
        rf"w must be float32.*got float64 with shape \({CAP}, 8, 8\)",
    ),
    "int w": (
        lambda: jbs.bsmm(X, jnp.zeros(LAYOUT.w_shape, jnp.int8), LAYOUT),
        TypeError,
        r"w must be float32.*got int8",
    ),
    "bool dy": (
        lambda: jbs.bsmm_updat(X, jnp.ones((5, 32), bool), LAYOUT),
        TypeError,
        r"dy must be float32.*got bool with shape \(5, 32\)",
    ),
    "preferred_element_type int": (
        lambda: jbs.bsmm(X, W, LAYOUT, preferred_element_type=jnp.int32),
        TypeError,
        r"preferred_element_type must be float32, bfloat16 or float16, got int32",
    ),
    "updat out_dtype float64": (
        lambda: jbs.bsmm_updat(X, G, LAYOUT, out_dtype=np.float64),
        TypeError,
        r"out_dtype must be float32.*got float64",
    ),
    # the layout argument
    "layout is a mask": (
        lambda: jbs.bsmm(X, W, MASK),
        TypeError,
        r"layout must be a jax_blocksparse.Layout, got ndarray",
    ),
    "layout is tables": (
        lambda: jbs.bsmm_updat(X, G, LAYOUT.tables),
        TypeError,
        r"layout must be a jax_blocksparse.Layout, got LayoutTables",
    ),
    "to_dense layout": (
        lambda: jbs.to_dense(W, None),
        TypeError,
        r"layout must be a jax_blocksparse.Layout, got NoneType",
    ),
    "from_dense layout": (
        lambda: jbs.from_dense(jnp.zeros((24, 32)), (8, (3, 4))),
        TypeError,
        r"layout must be a jax_blocksparse.Layout, got tuple",
    ),
    # block sizes
    "block_size 24": (
        lambda: jbs.Layout.from_mask(MASK, 24),
        ValueError,
        re.escape(f"block_size must be one of {jbs.SUPPORTED_BLOCK_SIZES}, got 24"),
    ),
    "block_size 256": (lambda: jbs.Layout.from_mask(MASK, 256), ValueError, r"block_size must be one of .* got 256"),
    "block_size 32.0": (
        lambda: jbs.Layout.from_mask(MASK, 32.0),
        TypeError,
        r"block_size must be an int, got float 32.0",
    ),
    "block_size True": (lambda: jbs.Layout.from_mask(MASK, True), TypeError, r"block_size must be an int, got bool"),
    "dense block_size": (lambda: jbs.Layout.dense((2, 2), 12), ValueError, r"block_size must be one of .* got 12"),
    "topk not divisible": (
        lambda: jbs.layouts.from_dense_topk(np.ones((24, 36)), 8, 0.5),
        ValueError,
        r"W shape \(24, 36\) is not divisible by block_size=8",
    ),
    "topk bad block_size": (
        lambda: jbs.layouts.from_dense_topk(np.ones((48, 48)), 24, 0.5),
        ValueError,
        r"block_size must be one of .* got 24",
    ),
    # masks
    "3-D mask": (
        lambda: jbs.Layout.from_mask(np.ones((2, 3, 4), bool), 8),
        ValueError,
        r"mask must be 2-D .* got shape \(2, 3, 4\)",
    ),
    "1-D mask": (lambda: jbs.Layout.from_mask([True, False], 8), ValueError, r"mask must be 2-D .* got shape \(2,\)"),
    "float mask": (
        lambda: jbs.Layout.from_mask(MASK.astype(np.float32), 8),
        TypeError,
        r"mask must be boolean .* got dtype float32 with shape \(3, 4\)",
    ),
    "jax float mask": (
        lambda: jbs.Layout.from_mask(jnp.asarray(MASK, jnp.float32), 8),
        TypeError,
        r"mask must be boolean .* float32 with shape \(3, 4\)",
    ),
    "int mask with 2": (
        lambda: jbs.Layout.from_mask(np.array([[0, 1], [2, 1]]), 8),
        ValueError,
        r"mask of dtype int64 with shape \(2, 2\) must hold only 0 and 1, got values \[0 1 2\]",
    ),
    "jax int mask with 2": (
        lambda: jbs.Layout.from_mask(jnp.array([[0, 1], [2, 1]], jnp.int32), 8),
        ValueError,
        r"mask of dtype int32 with shape \(2, 2\) must hold only 0 and 1",
    ),
    "int mask with -1": (
        lambda: jbs.Layout.from_mask(np.array([[0, -1]], np.int8), 8),
        ValueError,
        r"must hold only 0 and 1.*-1",
    ),
    # capacity
    "capacity < nnz": (
        lambda: jbs.Layout.from_mask(MASK, 8, capacity=CAP - 1),
        ValueError,
        rf"capacity={CAP - 1} is smaller than the number of blocks in the mask \({CAP} of grid \(3, 4\)\)",
    ),
    "capacity negative": (
        lambda: jbs.Layout.from_mask(np.zeros((2, 2), bool), 8, capacity=-1),
        ValueError,
        r"capacity must be >= 0, got -1",
    ),
    "capacity float": (
        lambda: jbs.Layout.from_mask(MASK, 8, capacity=20.0),
        TypeError,
        r"capacity must be an int, got float 20.0",
    ),
    "traced mask without capacity": (
        lambda: jax.jit(lambda m: jbs.Layout.from_mask(m, 8).tables)(jnp.asarray(MASK)),
        ValueError,
        r"a traced mask needs an explicit capacity \(mask shape \(3, 4\)\)",
    ),
    "traced float mask": (
        lambda: jax.jit(lambda m: jbs.Layout.from_mask(m, 8, capacity=4).tables)(jnp.ones((3, 4))),
        TypeError,
        r"mask must be boolean .* float32 with shape \(3, 4\)",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case):
    call, exc, match = CASES[case]
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("transpose", [False, True])
def test_errors_inside_jit_name_shapes_too(transpose):
    f = jax.jit(lambda x, w: jbs.bsmm(x, w, LAYOUT, transpose=transpose))
    with pytest.raises(ValueError, match=r"\(5, 7\)"):
        f(rand((5, 7)), W)
    with pytest.raises(ValueError, match=r"w must have shape.*\(2, 8, 8\)"):
        f(G if transpose else X, jnp.zeros((2, 8, 8)))


def test_vmapped_bad_w_names_shapes():
    with pytest.raises(ValueError, match=rf"w must have shape.*got \({CAP}, 8, 4\)"):
        jax.vmap(lambda w: jbs.bsmm(X, w, LAYOUT))(jnp.zeros((3, CAP, 8, 4)))
