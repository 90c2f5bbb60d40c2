"""The bfloat16 CPU kernels of the matrix units: AMX tiles and AVX512-BF16 dot products.

Each test runs once per instruction set of the matrix units ("amx", "avx512_bf16"),
forced through JAX_BLOCKSPARSE_CPU_ISA; a set the CPU lacks is skipped with the reason
(pytest -rs lists them: CI's log says how many ran). The oracle is float64 numpy on the
bf16 operands: the kernels multiply bf16 exactly and sum in float32, so a float32 output
is within float32 summation error of it and a bf16 output within one bf16 rounding.
Also here, on every CPU with the kernels: the variable's checks and effects.
"""

from __future__ import annotations

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import assert_close, cpu_devices, force_cpu_isa, make_mask, make_problem, rand, require_kernels

MATRIX_UNIT_ISAS = ("amx", "avx512_bf16")
ENV = "JAX_BLOCKSPARSE_CPU_ISA"


@pytest.fixture(autouse=True)
def _on_the_cpu_kernels():
    require_kernels("cpu")
    with jax.default_device(cpu_devices(1)[0]):
        yield


def detected_isa() -> str:
    return jbs.extension_info()["cpu_isa_detected"]


@pytest.fixture(params=MATRIX_UNIT_ISAS)
def isa(request, monkeypatch):
    """Runs the test with the kernels of this instruction set in force."""
    return force_cpu_isa(monkeypatch, request.param)


def _dense(w, layout):
    return np.asarray(jbs.to_dense(jnp.asarray(w, jnp.float32), layout), np.float64)


def _oracles(x, w, dy, layout):
    """float64 fprop, bprop and updat of the bf16 operands."""
    W = _dense(w, layout)
    x64, dy64 = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (x, dy))
    dW = x64.T @ dy64
    t = layout.tables
    bs = layout.block_size
    nnz = int(t.col_ptr[-1])
    dw = np.zeros(layout.w_shape)
    for s in range(nnz):
        r, c = int(t.block_rows[s]), int(t.block_cols[s])
        dw[s] = dW[r * bs : (r + 1) * bs, c * bs : (c + 1) * bs]
    return {"fprop": x64 @ W, "bprop": dy64 @ W.T, "updat": dw}


def _products(x, w, dy, layout, out_dtype):
    kw = {"impl": "kernels"}
    return {
        "fprop": jbs.bsmm(x, w, layout, preferred_element_type=out_dtype, **kw),
        "bprop": jbs.bsmm(dy, w, layout, transpose=True, preferred_element_type=out_dtype, **kw),
        "updat": jbs.bsmm_updat(x, dy, layout, out_dtype=out_dtype, **kw),
    }


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("kind", ["random", "full", "empty_rows_cols", "long_column"])
@pytest.mark.parametrize("rows", [1, 19, 50, 300])
def test_products_match_float64(isa, block_size, kind, rows):
    _, layout, w = make_problem(kind, block_size=block_size, dtype=jnp.bfloat16, seed=rows)
    C, K = layout.shape
    x, dy = rand((rows, C), jnp.bfloat16, 1), rand((rows, K), jnp.bfloat16, 2)
    want = _oracles(x, w, dy, layout)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        got = _products(x, w, dy, layout, out_dtype)
        for name in want:
            assert got[name].dtype == out_dtype, name
            length = rows if name == "updat" else max(C, K)
            assert_close(got[name], want[name], out_dtype, length=length)


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("C", [512, 2048])
def test_wide_inputs_copied_into_tiles_or_read_in_place(isa, block_size, C):
    # The matrix units read input rows up to 1 KiB apart where they are (512 bf16
    # features) and copy wider ones into tiles first: both forms, with a tail of rows.
    _, layout, w = make_problem("random", block_size=block_size, grid=(C // block_size, 2), dtype=jnp.bfloat16)
    x, dy = rand((77, C), jnp.bfloat16, 1), rand((77, 2 * block_size), jnp.bfloat16, 2)
    want = _oracles(x, w, dy, layout)
    got = _products(x, w, dy, layout, jnp.float32)
    for name in want:
        assert_close(got[name], want[name], jnp.float32, length=77 if name == "updat" else C)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_updat_over_several_chunks_of_rows(isa, out_dtype):
    # The packed activations of one chunk stay under 32 MiB: 1024 bytes per row here, so
    # 40000 rows are two chunks (a bf16 dW then sums across them in float32 scratch).
    _, layout, _ = make_problem("random", block_size=128, grid=(2, 2), dtype=jnp.bfloat16)
    rows = 40000
    x, dy = rand((rows, 256), jnp.bfloat16, 3), rand((rows, 256), jnp.bfloat16, 4)
    got = jbs.bsmm_updat(x, dy, layout, out_dtype=out_dtype, impl="kernels")
    want = _oracles(x, jnp.zeros(layout.w_shape, jnp.bfloat16), dy, layout)["updat"]
    assert_close(got, want, out_dtype, length=rows)


def test_gradients_match_the_reference(isa):
    _, layout, w = make_problem("random", block_size=32, grid=(4, 3), dtype=jnp.bfloat16)
    x = rand((70, layout.shape[0]), jnp.bfloat16, 5)

    def loss(x, w, impl):
        y = jbs.bsmm(x, w, layout, preferred_element_type=jnp.float32, impl=impl)
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for got, want in zip(grad(x, w, "kernels"), grad(x, w, "reference")):
        assert_close(got, np.asarray(jnp.asarray(want, jnp.float32)), jnp.bfloat16, length=layout.shape[0])


def test_runs_are_deterministic(isa):
    # Each output element (and each block of dW) is summed by one worker in a fixed order.
    _, layout, w = make_problem("random", block_size=64, grid=(3, 4), dtype=jnp.bfloat16)
    x, dy = rand((333, 192), jnp.bfloat16, 6), rand((333, 256), jnp.bfloat16, 7)
    first = _products(x, w, dy, layout, jnp.float32)
    again = _products(x, w, dy, layout, jnp.float32)
    for name in first:
        np.testing.assert_array_equal(np.asarray(first[name]), np.asarray(again[name]), err_msg=name)


def test_eight_threads_at_once(isa):
    # Tile configurations differ per block size and product; every thread configures its
    # own tiles per work item and releases them, so concurrent callers cannot see each
    # other's. Four threads run products, four convolutions (and their gradients).
    problems = []
    for i, bs in enumerate((16, 32, 64, 128, 16, 32, 64, 128)):
        _, layout, w = make_problem("random", block_size=bs, dtype=jnp.bfloat16, seed=i)
        if i < 4:
            x = rand((40 + 13 * i, layout.shape[0]), jnp.bfloat16, 10 + i)
            product = jbs.bsmm
        else:
            w = rand((layout.capacity, 3, 3, bs, bs), jnp.bfloat16, 20 + i)
            x = rand((2, 5, 18 + 4 * i, layout.shape[0]), jnp.bfloat16, 10 + i)
            product = jbs.bsconv

        def step(x, w, layout=layout, product=product):
            def loss(x, w):
                return jnp.sum(product(x, w, layout, preferred_element_type=jnp.float32, impl="kernels") ** 2)

            return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

        step = jax.jit(step)
        problems.append((step, x, w, jax.tree.map(np.asarray, step(x, w))))

    def run(i):
        step, x, w, want = problems[i]
        for _ in range(5):
            got = step(x, w)
            for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(np.asarray(g), v)
        return i

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        assert sorted(pool.map(run, range(8))) == list(range(8))


# The convolution: on "amx" its forward and input gradient run on the tiles, and its
# weight gradient where the innermost dim has unit steps and an even number of outputs
# (else it widens: the strided, input-dilated and odd cases here). Runs longer than one
# work item (64 outputs), tails of fewer than 16 rows or 32 positions, strides,
# dilations, big padding and the transposed kernel, against the reference path.

# name -> (op, kernel_size, input spatial, keyword arguments)
CONV_CASES = {
    "1d_long_same": ("bsconv", (3,), (150,), {}),
    "1d_stride2": ("bsconv", (4,), (101,), dict(strides=2, padding="VALID")),
    "2d_dilated": ("bsconv", (3, 3), (5, 37), dict(dilation=(1, 2))),
    "2d_input_dilation": ("bsconv", (3, 3), (4, 23), dict(input_dilation=2, padding=[(2, 1), (1, 2)])),
    "2d_transpose_s2": ("bsconv_transpose", (3, 3), (4, 19), dict(strides=2, transpose_kernel=True)),
    "3d_same": ("bsconv", (3, 2, 3), (3, 4, 20), {}),
    "2d_same_tail8": ("bsconv", (3, 3), (3, 40), {}),
    "2d_valid": ("bsconv", (3, 3), (4, 34), dict(padding="VALID")),
    "1d_dilated_big_pad": ("bsconv", (3,), (30,), dict(dilation=2, padding=[(7, 3)])),
    "2d_outer_pad": ("bsconv", (2, 3), (2, 16), dict(padding=[(3, 2), (1, 1)])),
    "2d_transpose_s1": ("bsconv_transpose", (3, 3), (3, 26), dict(transpose_kernel=True)),
}
CONV_GRIDS = {16: (3, 2), 32: (2, 3), 64: (2, 1), 128: (1, 1)}


@pytest.mark.parametrize("block_size", sorted(CONV_GRIDS))
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_convolution_matches_the_reference(isa, name, block_size):
    op_name, kernel_size, spatial, kw = CONV_CASES[name]
    op = getattr(jbs, op_name)
    mask = make_mask("random", CONV_GRIDS[block_size], seed=block_size)
    layout = jbs.Layout.from_mask(mask, block_size, capacity=int(mask.sum()) + 1)
    w = rand((layout.capacity, *kernel_size, block_size, block_size), jnp.float32, 1)
    w = jbs.conv_from_dense(jbs.conv_to_dense(w, layout), layout).astype(jnp.bfloat16)  # zero padding slots
    channels = layout.shape[1] if kw.get("transpose_kernel") else layout.shape[0]
    x = rand((2, *spatial, channels), jnp.bfloat16, 2)

    def loss(x, w, impl):
        y = op(x, w, layout, impl=impl, preferred_element_type=jnp.float32, **kw)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), y

    run = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (dx, dw), y = run(x, w, "kernels")
    (dx_r, dw_r), y_r = run(x, w, "reference")
    length = int(np.prod(kernel_size)) * max(layout.shape)
    assert_close(y, np.asarray(y_r), jnp.float32, length=length)
    for got, want in ((dx, dx_r), (dw, dw_r)):  # bf16, as the operands
        assert_close(got, np.asarray(want.astype(jnp.float32)), jnp.bfloat16, length=length)
    # A bf16 output: the float32 sums narrowed once.
    got = op(x, w, layout, impl="kernels", **kw)
    want = op(x, w, layout, impl="reference", preferred_element_type=jnp.float32, **kw)
    assert got.dtype == jnp.bfloat16
    assert_close(got, np.asarray(want), jnp.bfloat16, length=length)


# --------------------------------------------------------------------------------------
# The variable, on every CPU
# --------------------------------------------------------------------------------------


def test_a_lower_isa_is_used_and_named(monkeypatch):
    _, layout, w = make_problem("random", block_size=16, dtype=jnp.bfloat16)
    x = rand((9, layout.shape[0]), jnp.bfloat16, 8)
    widest = jbs.bsmm(x, w, layout, preferred_element_type=jnp.float32, impl="kernels")
    monkeypatch.setenv(ENV, "baseline")
    info = jbs.extension_info()
    assert (info["cpu_isa"], info["cpu_isa_detected"], info["cpu_isa_error"]) == ("baseline", detected_isa(), None)
    assert jbs.crossover.cpu_device_kind().startswith("cpu:baseline:")
    # the extension names every set it can run, lowest first, and the report describes each
    assert info["cpu_isas"][0] == "baseline" and detected_isa() in info["cpu_isas"]
    assert set(jbs._native._CPU_KERNEL_PATHS) == set(info["cpu_isas"])
    described = jbs._native.cpu_kernels_in_force()
    assert described.startswith("baseline: portable C++")
    assert ("forced below" in described) == (detected_isa() != "baseline")
    lowest = jbs.bsmm(x, w, layout, preferred_element_type=jnp.float32, impl="kernels")
    assert_close(lowest, np.asarray(widest, np.float64), jnp.float32, length=layout.shape[0])


@pytest.mark.parametrize(
    "value, message",
    [("avx1024", "expected one of amx, avx512_bf16"), ("amx", "at most")],
    ids=["unknown", "above-the-cpu"],
)
def test_a_bad_isa_is_an_error(monkeypatch, value, message):
    if value == "amx" and detected_isa() == "amx":
        pytest.skip("this CPU has AMX: forcing it is valid here")
    monkeypatch.setenv(ENV, value)
    assert message in jbs.extension_info()["cpu_isa_error"]
    with pytest.raises(ValueError, match=ENV):
        jbs.crossover.cpu_device_kind()
    assert jbs._native.cpu_kernels_in_force().startswith(ENV)
    _, layout, w = make_problem("random", block_size=16)
    with pytest.raises(Exception, match=ENV):  # the handler refuses rather than run another set
        jax.block_until_ready(jbs.bsmm(jnp.ones((3, layout.shape[0])), w, layout, impl="kernels"))
