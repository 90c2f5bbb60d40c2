"""The native CPU kernels behind the XLA FFI layer: what the bsmm suite does not cover.

tests/test_matmul.py runs every bsmm case on these kernels and on the reference. Here:
the default CPU lowering is the custom call, the handlers reject malformed calls with
an error (never a crash), long inputs processed in several chunks of rows, empty
problems, and determinism across runs (each output element is summed by one worker).

Everything runs on the CPU backend, whatever the default backend is: lowered for the
"cpu" platform, run with the CPU as the default device.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import (
    VECTOR_ISAS,
    assert_close,
    cpu_devices,
    force_cpu_isa,
    kernel_calls,
    make_problem,
    rand,
    require_kernels,
)
from jax_blocksparse.ops import _lowering

TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")


def require_conversions():
    """Skips the calling test unless the extension's CPU dense-path conversions (between
    blocks and a dense matrix, and updat's x^T) are registered; without the CPU kernels at
    all it fails instead where CI requires them (require_kernels)."""
    require_kernels("cpu")
    if not _lowering.native_conversions("cpu"):
        pytest.skip("the CPU extension's conversions are not built")


@pytest.fixture(autouse=True)
def _on_the_cpu_kernels():
    """The CPU kernels are built, and the test runs on the CPU (also where a GPU is the default)."""
    require_kernels("cpu")
    with jax.default_device(cpu_devices(1)[0]):
        yield


def _ops(layout):
    return {
        "fprop": lambda x, w, dy: jbs.bsmm(x, w, layout),
        "bprop": lambda x, w, dy: jbs.bsmm(dy, w, layout, transpose=True),
        "updat": lambda x, w, dy: jbs.bsmm_updat(x, dy, layout),
    }


def test_auto_lowers_to_the_cpu_kernels():
    _, layout, w = make_problem(block_size=16)
    x = rand((5, layout.shape[0]), jnp.float32, 1)
    grad = jax.grad(lambda x, w: jnp.sum(jbs.bsmm(x, w, layout) ** 2), argnums=(0, 1))
    # A table where every kernel wins (the shipped one decides per machine and batch).
    kind = jbs.crossover.cpu_device_kind()
    wins = [
        dict(platform="cpu", device_kind=kind, target=t, mode="float32", block_size=16, crossover=1.0) for t in TARGETS
    ]
    with jbs.config.implementation("auto"), jbs.crossover.use_table(jbs.crossover.CrossoverTable.from_entries(wins)):
        text = jax.jit(grad).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert kernel_calls(text) == set(TARGETS)
    assert "native CPU kernels" in _lowering.describe_path("cpu", "auto")
    with jbs.config.implementation("reference"):
        assert "custom_call" not in jax.jit(grad).trace(x, w).lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("isa", VECTOR_ISAS)
def test_each_vector_instruction_set_matches_the_reference(monkeypatch, isa, dtype, block_size):
    # Each set is its own compilation of the kernels (register tiles, transposes of the
    # weights in bprop): a layout with a full column and an empty one, 19 rows (tails).
    force_cpu_isa(monkeypatch, isa)
    _, layout, w = make_problem("empty_rows_cols", block_size=block_size, dtype=dtype, seed=block_size)
    C, K = layout.shape
    x, dy = rand((19, C), dtype, 1), rand((19, K), dtype, 2)
    ops = {
        "fprop": lambda impl: jbs.bsmm(x, w, layout, impl=impl),
        "bprop": lambda impl: jbs.bsmm(dy, w, layout, transpose=True, impl=impl),
        "updat": lambda impl: jbs.bsmm_updat(x, dy, layout, impl=impl),
    }
    for name, op in ops.items():
        want = np.asarray(op("reference").astype(jnp.float32))
        assert_close(op("kernels"), want, dtype, length=19 if name == "updat" else max(C, K))


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("rows", [803, 37])
def test_dense_layouts_match_the_reference(dtype, block_size, rows):
    # With AVX-512, fprop and bprop of blocks 8-32 in dense layouts run as panels of
    # g = 128 / block_size neighbouring output blocks: float32 fprop's weights read where
    # they lie (a missing block as zeros; at blocks 16 and 32 from 64 rows, the block
    # kernels below that), the others' copied by the items that first need each panel. At
    # blocks 64 and 128 float32 rows are read in place and a run of consecutive input
    # blocks (at most 1024 deep) is one product, and the weights bprop transposes (or 16-bit
    # ones widened) are copied per output block as the items need them. Here: partial last
    # panels (fprop's: half a panel, g / 2 output blocks; bprop's: g - 1), an input block
    # missing from a whole panel, which splits its run of input blocks (row 2 in fprop's
    # first panel, column g + 1 in bprop's), one missing block inside a panel, padding
    # slots, and tail tiles.
    g = 128 // block_size
    mask = np.ones((8 * g - 1, 8 * g - g // 2), bool)
    mask[2, :g] = False
    mask[:g, g + 1] = False
    mask[g + 1, 2 * g + 1] = False
    layout = jbs.Layout.from_mask(mask, block_size, capacity=int(mask.sum()) + 3)
    C, K = layout.shape
    w = rand(layout.w_shape, dtype, 0)
    x, dy = rand((rows, C), dtype, 1), rand((rows, K), dtype, 2)
    for op in (
        lambda impl: jbs.bsmm(x, w, layout, impl=impl),
        lambda impl: jbs.bsmm(dy, w, layout, transpose=True, impl=impl),
    ):
        assert_close(op("kernels"), np.asarray(op("reference").astype(jnp.float32)), dtype, length=max(C, K))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_float32_fprop_panels_over_long_inputs_match_the_reference(block_size):
    # Float32 fprop's panels read in place pass over the input 1024 steps of k at a time
    # (the row tiles, then the next 1024): here 1024 + 3 blocks deep, with input blocks
    # missing from a whole panel across the step and from one output block, and two
    # panels of output blocks (dense enough for the panels at every block size).
    g = 128 // block_size
    cb = 1024 // block_size + 3
    mask = np.ones((cb, 2 * g), bool)
    mask[cb - 4 : cb - 2, :g] = False
    mask[5, 1] = False
    layout = jbs.Layout.from_mask(mask, block_size)
    C, K = layout.shape
    w = rand(layout.w_shape, jnp.float32, 0)
    x = rand((70, C), jnp.float32, 1)
    want = np.asarray(jbs.bsmm(x, w, layout, impl="reference"))
    assert_close(jbs.bsmm(x, w, layout, impl="kernels"), want, jnp.float32, length=C)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "dtype, out_dtype, rows",
    [
        (jnp.float32, jnp.float32, 803),
        (jnp.float16, jnp.float16, 803),
        # 16-bit rows are widened in chunks of about 4M / (C + K), about 2060 rows here:
        # three chunks summed in a float32 buffer (16-bit dw), or in dw itself (float32)
        (jnp.bfloat16, jnp.bfloat16, 4500),
        (jnp.float16, jnp.float32, 4500),
    ],
    ids=["f32", "f16", "bf16-chunks", "f16-f32dw-chunks"],
)
def test_dense_layouts_of_small_blocks_match_the_reference_in_updat(dtype, out_dtype, rows, block_size):
    # With AVX-512, updat of blocks 8 and 16 in a dense layout computes whole 128 x 128
    # tiles of dW and copies the present blocks out of them. Here: a partial last row
    # panel (C = 1016 or 1008), a tile with no block (skipped), missing blocks, padding
    # slots (zeros).
    g = 128 // block_size
    mask = np.ones((16 * g - 1, 16 * g), bool)
    mask[:g, :g] = False
    mask[20, 30] = False
    mask[12 * g :, 3] = False
    nnz = int(mask.sum())
    layout = jbs.Layout.from_mask(mask, block_size, capacity=nnz + 5)
    C, K = layout.shape
    x, dy = rand((rows, C), dtype, 1), rand((rows, K), dtype, 2)
    got = jbs.bsmm_updat(x, dy, layout, out_dtype=out_dtype, impl="kernels")
    # the oracle: x.T @ dy in float64, its blocks taken (the reference's per-block sums
    # take 20 s at 4500 rows of block 8)
    dense = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    want = np.asarray(jbs.from_dense(jnp.asarray(dense, jnp.float32), layout))
    assert_close(got, want, dtype, length=rows)
    assert not np.asarray(got[nnz:], np.float32).any()


def _call(kernel, out_shape, out_dtype, *operands):
    """The kernel's FFI target called directly (the handlers' messages name the kernel)."""
    target = jbs.targets.target_name(kernel)
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, out_dtype))(*operands)


def _tables(layout):
    """The five index tables every target takes (the orders are passed on their own)."""
    t = layout.tables
    return [jnp.asarray(a) for a in (t.block_rows, t.block_cols, t.col_ptr, t.row_ptr, t.row_slots)]


# The handlers' kBlockSizesText: the table in braces.
SIZES_TEXT = "{" + ", ".join(map(str, jbs.SUPPORTED_BLOCK_SIZES)) + "}"


@pytest.mark.parametrize(
    "case, message",
    [
        ("w_shape", "w must be \\[capacity=.*bs in " + re.escape(SIZES_TEXT)),
        ("features", "need lhs \\[\\.\\.\\., 48\\] and out"),
        ("dtypes", "inputs must share one dtype"),
        ("out_dtype", "output dtype must be the input dtype or float32"),
        ("table_dtype", "block_rows must be a rank-1 int32 table"),
        ("order", "order must be int32 \\[5\\]"),
    ],
)
def test_handler_rejects_malformed_fprop(case, message):
    _, layout, w = make_problem(block_size=16, grid=(3, 5))
    x = jnp.ones((4, 48), jnp.float32)
    tables = _tables(layout)
    order = jnp.arange(5, dtype=jnp.int32)
    out_shape, out_dtype = (4, 80), jnp.float32
    if case == "w_shape":
        w = jnp.ones((layout.capacity, 16, 8), jnp.float32)
    elif case == "features":
        x = jnp.ones((4, 40), jnp.float32)
    elif case == "dtypes":
        w = w.astype(jnp.bfloat16)
    elif case == "out_dtype":
        x, w, out_dtype = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.float16
    elif case == "table_dtype":
        tables[0] = tables[0].astype(jnp.float32)
    elif case == "order":
        order = jnp.arange(4, dtype=jnp.int32)
    with pytest.raises(Exception, match="jbs_bsmm_fprop: " + message):
        jax.block_until_ready(_call("jbs_bsmm_fprop", out_shape, out_dtype, x, w, *tables, order))


def test_handler_rejects_malformed_updat():
    _, layout, _ = make_problem(block_size=16, grid=(3, 5))
    x, dy = jnp.ones((4, 48)), jnp.ones((3, 80))
    with pytest.raises(Exception, match="jbs_bsmm_updat: x and dy must share leading dims"):
        jax.block_until_ready(_call("jbs_bsmm_updat", layout.w_shape, jnp.float32, x, dy, *_tables(layout)))


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_blocks_to_dense_as_w_or_its_transpose_in_both_versions(dtype, block_size):
    # The dense path's conversion: version 2 writes W [C, K] or, with transpose, W^T
    # [K, C] (bprop's dense path in 16 bits, in micro tiles of 8 x 8 or 4 x 4); version 1
    # (no attribute) stays for programs exported before it. Empty block rows and columns,
    # and padding slots.
    bs = block_size
    mask, layout, w = make_problem("empty_rows_cols", block_size=bs, grid=(3, 5), dtype=dtype)
    layout = jbs.Layout.from_mask(mask, bs, capacity=layout.capacity + 2)
    w = jnp.concatenate([w, jnp.full((2, bs, bs), 7, dtype)])  # padding slots are never read
    want = np.asarray(jbs.to_dense(w, layout).astype(jnp.float32))
    C, K = layout.shape
    v2 = jbs.targets.target_name("jbs_blocks_to_dense")
    v1 = jbs.targets.target_name("jbs_blocks_to_dense", 1)
    assert v2.endswith("_v2")

    def call(target, shape, **attrs):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(shape, dtype))(w, *_tables(layout), **attrs)

    np.testing.assert_array_equal(np.asarray(call(v2, (C, K), transpose=False).astype(jnp.float32)), want)
    np.testing.assert_array_equal(np.asarray(call(v2, (K, C), transpose=True).astype(jnp.float32)), want.T)
    np.testing.assert_array_equal(np.asarray(call(v1, (C, K)).astype(jnp.float32)), want)
    with pytest.raises(Exception, match=r"jbs_blocks_to_dense: .*the dense matrix \(transposed\) \[5 \* bs, 3 \* bs\]"):
        jax.block_until_ready(call(v2, (C, K), transpose=True))


@pytest.mark.parametrize(
    "isa, dtype, transposed",
    [
        ("amx", jnp.bfloat16, True),
        ("avx512_bf16", jnp.bfloat16, True),
        ("avx512", jnp.bfloat16, False),
        ("avx512_bf16", jnp.float16, False),
        ("avx512_bf16", jnp.float32, False),
    ],
)
def test_bprop_dense_path_builds_w_transposed_for_bf16_dot_instructions(monkeypatch, isa, dtype, transposed):
    # XLA runs g @ W^T of a row-major W^T on a CPU's bfloat16 dot instructions (AMX or
    # AVX512-BF16), and g @ W.T of a row-major W as a float32 dot, about 2x slower there.
    from jax_blocksparse.ops import matmul

    require_conversions()
    info = dict(jbs.extension_info(), cpu_isa_detected=isa)
    monkeypatch.setattr(matmul._native, "extension_info", lambda: info)
    _, layout, w = make_problem("random", block_size=16, grid=(3, 5), dtype=dtype)
    g = jnp.ones((4, layout.shape[1]), dtype)
    text = jax.jit(lambda g, w: jbs.bsmm(g, w, layout, transpose=True, impl="dense")).lower(g, w).as_text()
    assert "jax_blocksparse_blocks_to_dense" in text
    assert ("transpose = true" in text) == transposed


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", [(1, 1), (3, 70), (37, 5), (32, 32), (33, 65), (64, 1000), (0, 8), (8, 0)])
def test_transpose_target(dtype, shape):
    # updat's dense path makes x^T row-major first. Shapes that fill no micro tile (8 x 8
    # in 16 bits, 4 x 4 in 32) or no 32 x 32 tile, and empty ones.
    require_conversions()
    a = (np.arange(np.prod(shape)).reshape(shape) % 251).astype(np.float32)
    got = jax.ffi.ffi_call(jbs.targets.target_name("jbs_transpose"), jax.ShapeDtypeStruct(shape[::-1], dtype))(
        jnp.asarray(a, dtype)
    )
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), a.T)


@pytest.mark.parametrize(
    "operand, result",
    [
        (jnp.ones((3, 4)), jax.ShapeDtypeStruct((3, 4), jnp.float32)),  # not the transposed shape
        (jnp.ones((3, 4)), jax.ShapeDtypeStruct((4, 3), jnp.bfloat16)),  # another dtype
        (jnp.ones((3, 4), jnp.int32), jax.ShapeDtypeStruct((4, 3), jnp.int32)),
        (jnp.ones((2, 3, 4)), jax.ShapeDtypeStruct((4, 3, 2), jnp.float32)),
    ],
    ids=["shape", "dtype", "int32", "rank3"],
)
def test_transpose_target_rejects_bad_operands(operand, result):
    require_conversions()
    call = jax.ffi.ffi_call(jbs.targets.target_name("jbs_transpose"), result)
    with pytest.raises(Exception, match=r"jbs_transpose: expects a 2-D float32, float16 or bfloat16 \[R, C\]"):
        jax.block_until_ready(call(operand))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_updat_dense_path_takes_x_transposed(dtype):
    # XLA runs x.T @ dy slower than the dot with x^T ready (2.5x in bfloat16 on a CPU's
    # bfloat16 dot instructions); leading dims of x and dy are contracted too.
    require_conversions()
    _, layout, _ = make_problem("random", block_size=16, grid=(3, 5), dtype=dtype)
    x, dy = rand((2, 7, layout.shape[0]), dtype, 1), rand((2, 7, layout.shape[1]), dtype, 2)
    dense = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, impl="dense"))
    assert "jax_blocksparse_transpose" in dense.lower(x, dy).as_text()
    want = jbs.bsmm_updat(x, dy, layout, impl="reference")
    assert_close(dense(x, dy), np.asarray(jnp.asarray(want, jnp.float32)), dtype, length=14)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_long_inputs_run_in_chunks_of_rows(dtype):
    # 16 MiB of packed rows per chunk: 4100 rows of 1024 + 1024 features is > 2 chunks
    # for updat and > 1 for fprop/bprop; bfloat16 with a bfloat16 dW also takes the
    # float32 accumulator path across chunks.
    grid, bs, n = (8, 8), 128, 4100
    _, layout, w = make_problem("random", block_size=bs, grid=grid, dtype=dtype)
    x = rand((n, grid[0] * bs), dtype, 3)
    dy = rand((n, grid[1] * bs), dtype, 4)
    for name, op in _ops(layout).items():
        with jbs.config.implementation("kernels"):
            got = jax.jit(op)(x, w, dy)
        with jbs.config.implementation("reference"):
            want = jax.jit(op)(x, w, dy)
        # The kernels and the reference sum in different orders: a 16-bit output can
        # differ by one rounding, hence the length of the dot product in the tolerance.
        assert_close(got, np.asarray(jnp.asarray(want, jnp.float32)), dtype, length=n if name == "updat" else bs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["f32", "f16"])
def test_copied_panels_over_chunks_of_rows(dtype):
    # The copied panels (bprop's transposed weights; 16-bit fprop's widened ones) are held a
    # few at a time (four on a 2-core machine), each reused by a later panel, and made again
    # for each chunk of rows (4M floats of lhs a chunk: 1023 rows of 4096, so 4200 rows are
    # five). Six panels of output blocks (block 16), a missing block, 4096 deep: fprop of
    # W [4096, 768] and bprop of W^T's shape [768, 4096].
    bs, n, depth = 16, 4200, 4096
    mask = np.ones((depth // bs, 48), bool)
    mask[7, 40] = False
    for op, mask_ in (("fprop", mask), ("bprop", mask.T)):
        layout = jbs.Layout.from_mask(mask_, bs)
        w = rand(layout.w_shape, dtype, 0)
        lhs = rand((n, depth), dtype, 1)
        got = jbs.bsmm(lhs, w, layout, transpose=op == "bprop", impl="kernels")
        W = np.asarray(jbs.to_dense(w, layout), np.float32)
        want = np.asarray(lhs, np.float32) @ (W.T if op == "bprop" else W)
        assert_close(got, want, dtype, length=depth)


@pytest.mark.parametrize("block_size", jbs.SUPPORTED_BLOCK_SIZES)
def test_float32_outputs_summed_in_place_overwrite_the_buffer(block_size):
    # Where an item's products are one product over the whole depth, float32 outputs are
    # summed where they lie, from zero, with no copy: an output block (or a whole panel of
    # them, at blocks 8 to 32) that reads no block must still be written, with zeros. Each
    # product runs right after one of the same shape whose result was freed, so that its
    # output most likely lands on that buffer, nonzero throughout.
    g = max(1, 128 // block_size)
    cb, kb = 512 // block_size, 3 * g
    full = jbs.Layout.from_mask(np.ones((cb, kb), bool), block_size)
    mask = np.ones((cb, kb), bool)
    mask[:, g : 2 * g] = False  # fprop: the second panel (or output block) reads nothing
    mask[3, 0] = False  # a gap in the first output block's run of input blocks
    for op, layout_mask in (("fprop", mask), ("bprop", mask.T)):
        layout = jbs.Layout.from_mask(layout_mask, block_size)
        full_ = full if op == "fprop" else jbs.Layout.from_mask(np.ones((kb, cb), bool), block_size)
        w, w_full = rand(layout.w_shape, jnp.float32, 0), rand(full_.w_shape, jnp.float32, 3)
        lhs = rand((70, layout.shape[1] if op == "bprop" else layout.shape[0]), jnp.float32, 1)
        W = np.asarray(jbs.to_dense(w, layout))
        want = np.asarray(lhs) @ (W.T if op == "bprop" else W)
        f = jax.jit(lambda a, w, lay: jbs.bsmm(a, w, lay, transpose=op == "bprop", impl="kernels"))
        for _ in range(3):
            f(lhs, w_full, full_).block_until_ready()  # freed at once: its buffer is free again
            assert_close(f(lhs, w, layout), want, jnp.float32, length=512)


def test_results_of_many_megabytes():
    # Results of 4 MiB or more get huge pages advised for their aligned interior (the
    # handlers and the dense path's conversions): here the dense weight is 16 MiB, its
    # blocks about 8 MiB, dx 16 MiB.
    mask = np.random.default_rng(0).random((16, 16)) < 0.5
    layout = jbs.Layout.from_mask(mask, 128)
    w = rand(layout.w_shape, jnp.float32, 2)
    x, dy, g = rand((8, 2048), jnp.float32, 3), rand((8, 2048), jnp.float32, 4), rand((2048, 2048), jnp.float32, 5)

    def products(x, w, dy, g):
        return [op(x, w, dy) for op in _ops(layout).values()] + [jbs.bsmm(g, w, layout, transpose=True)]

    with jbs.config.implementation("reference"):
        want = jax.jit(products)(x, w, dy, g)
    for impl in ("kernels", "dense"):
        with jbs.config.implementation(impl):
            got = jax.jit(products)(x, w, dy, g)
        for a, b in zip(got, want):
            assert_close(a, np.asarray(b), jnp.float32, length=2048)


def test_empty_rows_and_empty_layout():
    _, layout, w = make_problem(block_size=8, grid=(2, 3))
    with jbs.config.implementation("kernels"):
        assert jbs.bsmm(jnp.zeros((0, 16)), w, layout).shape == (0, 24)
        dw = jbs.bsmm_updat(jnp.zeros((0, 16)), jnp.zeros((0, 24)), layout)
        np.testing.assert_array_equal(dw, 0)
        empty = jbs.Layout.from_mask(np.zeros((2, 3), bool), 8, capacity=2)
        w0 = jnp.ones(empty.w_shape)
        np.testing.assert_array_equal(jbs.bsmm(jnp.ones((4, 16)), w0, empty), 0)
        np.testing.assert_array_equal(jbs.bsmm(jnp.ones((4, 24)), w0, empty, transpose=True), 0)
        np.testing.assert_array_equal(jbs.bsmm_updat(jnp.ones((4, 16)), jnp.ones((4, 24)), empty), 0)


def test_results_do_not_depend_on_scheduling():
    _, layout, w = make_problem("long_column", block_size=32, grid=(16, 16))
    x = rand((300, 512), jnp.float32, 5)
    dy = rand((300, 512), jnp.float32, 6)
    with jbs.config.implementation("kernels"):
        for op in _ops(layout).values():
            f = jax.jit(op)
            first = np.asarray(f(x, w, dy))
            for _ in range(3):
                np.testing.assert_array_equal(np.asarray(f(x, w, dy)), first)
