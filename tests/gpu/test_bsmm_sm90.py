"""Hopper (sm_90a) targets against float64 numpy oracles, on an sm_90 GPU.

Runs the cases of tests/gpu/test_bsmm_kernels.py (every op at blocks 64/128 and at the
packed blocks 8/16/32, where fprop/bprop pack outputs block-diagonally and updat stacks
slots along M; the adversarial layouts:
empty, single, full, empty rows/columns, a long column, padding with garbage tables;
odd row counts; f32 outputs) with the Hopper gate open (JAX_BLOCKSPARSE_HOPPER=1), and
checks that the lowering really called the *_sm90 targets. Float32 inputs at every
block size (8/16/32 packed as above): TF32 tensor cores at DEFAULT/HIGH (within TF32 tolerance, and measurably less
exact than float32, so the TF32 kernels really ran) where TF32 is on (``_sm90.tf32_block_sizes``:
every block size; where a table leaves one out, ``_sm90.tf32_off()``, DEFAULT is exact
there), exact at HIGHEST. Split and unsplit updat
reductions are both reached (few slots split N; a large N with many slots does not).
Skips without a GPU (tests/gpu/conftest.py) and on a GPU that is not compute 9.x.

Precision: every product here states it, since it picks the kernel (tests/conftest.py's
HIGHEST default does not reach tests/gpu; tests/test_gpu_tests_on_cpu.py checks on
CPU that nothing is left to a default). ``precision="highest"`` where a test means exact
float32 (and in the 16-bit tests, whose kernels do not depend on it), "default" or "high"
where it means TF32, with the TF32 tolerance.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from jax_blocksparse.ops import _sm90

from .test_bsmm_kernels import LAYOUT_KINDS, OPS, _check, _layout, _run

SM90_BLOCKS = (64, 128)
PACKED_BLOCKS = (8, 16, 32)  # DSD: block-diagonal packing; SDD: 64 / bs slots along M
TF32_BLOCKS = SM90_BLOCKS + PACKED_BLOCKS
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    cc = _sm90.cuda_compute_capability()
    if cc is None or cc.split(".")[0] != "9":
        pytest.skip(f"needs a compute capability 9.x GPU (have {cc})")
    if not _sm90.built_targets():
        pytest.fail("sm_90 GPU present but the extension was built without sm_90a")
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")


def _lowered(op, layout, dtype, *, precision):
    """The StableHLO text of one ``op`` on ``layout`` (8 rows) under ``impl="kernels"``."""
    c, k = layout.shape
    bs = layout.block_size
    x = jnp.zeros((8, k if op == "bprop" else c), dtype)
    if op == "updat":
        fun = lambda x: jbs.bsmm_updat(x, jnp.zeros((8, k), dtype), layout, precision=precision)  # noqa: E731
    else:
        w = jnp.zeros((layout.capacity, bs, bs), dtype)
        fun = lambda x: jbs.bsmm(x, w, layout, transpose=op == "bprop", precision=precision)  # noqa: E731
    with jbs.config.implementation("kernels"):
        return jax.jit(fun).lower(x).as_text()


def _lowers_to_sm90(op, layout, dtype, *, precision):
    return f"@{jbs.targets.target_name(f'jbs_bsmm_{op}_sm90')}(" in _lowered(op, layout, dtype, precision=precision)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", SM90_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_layouts(dtype, bs, op, kind):
    mask, layout = _layout(kind, bs)
    assert _lowers_to_sm90(op, layout, DTYPES[dtype], precision="highest")
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (129,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("n", (1, 7, 129, 1000, 5000))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", SM90_BLOCKS)
def test_rows(bs, op, n):
    mask, layout = _layout("random", bs)
    got, want, length = _run(op, layout, mask, jnp.bfloat16, (n,), precision="highest")
    _check(got, want, jnp.bfloat16, length)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", SM90_BLOCKS)
def test_f32_output(bs, op):
    mask, layout = _layout("padded", bs)
    got, want, length = _run(op, layout, mask, jnp.bfloat16, (3, 43), out_dtype=jnp.float32, precision="highest")
    assert got.dtype == jnp.float32
    _check(got, want, jnp.bfloat16, length, out_dtype=jnp.float32)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", (16, 64, 128))
def test_sanitizer_subset(bs, op):
    # The reduced set tests/gpu/run_sanitizer.sh runs under compute-sanitizer (memcheck,
    # racecheck): padded layouts (garbage tables, NaN padding blocks), a partial row tile.
    mask, layout = _layout("padded", bs)
    got, want, length = _run(op, layout, mask, jnp.bfloat16, (133,), precision="highest")
    _check(got, want, jnp.bfloat16, length)


# The DSD variants other than the baseline (cuda/sm90/bsmm_sm90_variants.h), each asked
# for by name (JAX_BLOCKSPARSE_SM90_VARIANT): the gate keys their results on their own
# ("jbs_bsmm_fprop_sm90:stacked": bench/_gate.py reads the ``variant`` parameter).
VARIANTS = ("stacked",)
STACKED_BLOCKS = (*PACKED_BLOCKS, 64)


def _variant_attr(op, layout, dtype, *, precision):
    """The ``variant`` attribute of the lowering's Hopper call (None where it has none)."""
    for line in _lowered(op, layout, dtype, precision=precision).splitlines():
        if f"@{jbs.targets.target_name(f'jbs_bsmm_{op}_sm90')}(" in line:
            found = re.search(r'variant = "(\w+)"', line)
            return found.group(1) if found else None
    return None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", ("fprop", "bprop"))
@pytest.mark.parametrize("bs", STACKED_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_variant_small_blocks(monkeypatch, dtype, bs, op, kind, variant):
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    mask, layout = _layout(kind, bs)
    assert _variant_attr(op, layout, DTYPES[dtype], precision="highest") == variant
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (129,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("n", (1, 200, 1000, 5000))
@pytest.mark.parametrize("bs", STACKED_BLOCKS)
def test_variant_rows_and_f32_output(monkeypatch, bs, n, variant):
    # 5000 rows: more tiles than SMs, so both consumer warpgroups of a CTA take tiles in turn.
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    mask, layout = _layout("padded", bs)
    for op in ("fprop", "bprop"):
        for out_dtype in (jnp.float32, None):
            got, want, length = _run(op, layout, mask, jnp.bfloat16, (n,), out_dtype=out_dtype, precision="highest")
            _check(got, want, jnp.bfloat16, length, out_dtype=out_dtype)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", ("fprop", "bprop"))
@pytest.mark.parametrize("bs", STACKED_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_variant_long_outputs_taken_in_turn(monkeypatch, dtype, bs, op, variant):
    # A full 1024 x 1024 layout: every output has 1024 / bs entries, 16 stages' worth at
    # every block size (more than the pipeline's 6-8 stages), and 5000 rows make several
    # tiles per CTA, so the two consumer warpgroups take turns over long tiles. A
    # warpgroup that skips the other's tile then waits more than a ring of stages ahead:
    # before the mainloops took turns that read stale stages, then hung or faulted (seen at
    # 8192 cubed in the bench; the small layouts above never have that many steps).
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    mask = np.ones((1024 // bs, 1024 // bs), bool)
    layout = jbs.Layout.from_mask(mask, bs)
    assert _variant_attr(op, layout, DTYPES[dtype], precision="highest") == variant
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (5000,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", ("fprop", "bprop"))
@pytest.mark.parametrize("bs", (8, 16, 64))
def test_sanitizer_subset_variant(monkeypatch, bs, op, variant):
    # Run under compute-sanitizer with test_sanitizer_subset (its -k selects both).
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    mask, layout = _layout("padded", bs)
    got, want, length = _run(op, layout, mask, jnp.bfloat16, (133,), precision="highest")
    _check(got, want, jnp.bfloat16, length)


def _updat_workspace(layout, n, dtype=jnp.bfloat16):
    """The uint8 workspace bytes of the lowering's updat_sm90 call."""
    c, k = layout.shape
    x, dy = jnp.zeros((n, c), dtype), jnp.zeros((n, k), dtype)
    with jbs.config.implementation("kernels"):
        text = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, precision="highest")).lower(x, dy).as_text()
    found = re.findall(r"tensor<(\d+)xui8>", text)
    return int(found[0]) if found else 0


@pytest.mark.parametrize("variant", ("capped",))
@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", ("updat",))
@pytest.mark.parametrize("bs", PACKED_BLOCKS + SM90_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_updat_variant(monkeypatch, dtype, bs, op, kind, variant):
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    mask, layout = _layout(kind, bs)
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (5000,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("variant", ("capped",))
@pytest.mark.parametrize("op", ("updat",))
@pytest.mark.parametrize("bs", (64, 128))
def test_updat_variant_splits_fewer_and_stays_deterministic(monkeypatch, bs, op, variant):
    # A full 8 x 8 grid and 1000 rows: the baseline's workspace is over the capped budget,
    # so the capped updat really plans fewer splits (a smaller workspace), and still sums
    # them in a fixed order.
    mask = np.ones((8, 8), bool)
    layout = jbs.Layout.from_mask(mask, bs)
    baseline = _updat_workspace(layout, 1000)
    monkeypatch.setenv(_sm90.VARIANT_ENV, variant)
    capped = _updat_workspace(layout, 1000)
    budget = _sm90.facts()["updat_capped_workspace_bytes"]
    assert baseline > budget >= capped > 0
    got, want, length = _run(op, layout, mask, jnp.bfloat16, (1000,), precision="highest")
    _check(got, want, jnp.bfloat16, length)
    again, _, _ = _run(op, layout, mask, jnp.bfloat16, (1000,), precision="highest")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


def test_updat_split_is_deterministic():
    mask, layout = _layout("single", 128)
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, 4096, layout.grid, layout.capacity, 128) > 0
    x = jax.random.normal(jax.random.PRNGKey(0), (4096, layout.shape[0]), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (4096, layout.shape[1]), jnp.bfloat16)
    with jbs.config.implementation("kernels"):
        f = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, out_dtype=jnp.float32, precision="highest"))
        first = np.asarray(f(x, dy))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x, dy)), first)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", ("fprop", "bprop"))
@pytest.mark.parametrize("bs", PACKED_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_packed_small_blocks(dtype, bs, op, kind):
    mask, layout = _layout(kind, bs)
    assert _lowers_to_sm90(op, layout, DTYPES[dtype], precision="highest")
    got, want, length = _run(op, layout, mask, DTYPES[dtype], (129,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("n", (1, 200, 1000))
@pytest.mark.parametrize("bs", PACKED_BLOCKS)
def test_packed_rows_and_f32_output(bs, n):
    mask, layout = _layout("padded", bs)
    for op in ("fprop", "bprop"):
        got, want, length = _run(op, layout, mask, jnp.bfloat16, (n,), out_dtype=jnp.float32, precision="highest")
        _check(got, want, jnp.bfloat16, length, out_dtype=jnp.float32)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("bs", PACKED_BLOCKS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_small_block_updat(dtype, bs, kind):
    # bsmm_sm90_sdd_small.cuh: runs of slots sharing a column, mixed-column items, padding.
    mask, layout = _layout(kind, bs)
    assert _lowers_to_sm90("updat", layout, DTYPES[dtype], precision="highest")
    got, want, length = _run("updat", layout, mask, DTYPES[dtype], (129,), precision="highest")
    _check(got, want, DTYPES[dtype], length)


@pytest.mark.parametrize("n", (1, 7, 200, 5000))
@pytest.mark.parametrize("bs", PACKED_BLOCKS)
def test_small_block_updat_rows_and_f32_output(bs, n):
    # Small n splits the reduction (workspace + reduce kernel); a large n with the random
    # layout at block 8 may not.
    for kind in ("random", "padded"):
        mask, layout = _layout(kind, bs)
        got, want, length = _run("updat", layout, mask, jnp.bfloat16, (n,), precision="highest")
        _check(got, want, jnp.bfloat16, length)
        got, want, length = _run("updat", layout, mask, jnp.float16, (n,), out_dtype=jnp.float32, precision="highest")
        assert got.dtype == jnp.float32
        _check(got, want, jnp.float16, length, out_dtype=jnp.float32)


@pytest.mark.parametrize("bs", PACKED_BLOCKS)
def test_small_block_updat_split_is_deterministic(bs):
    mask, layout = _layout("single", bs)
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, 4096, layout.grid, layout.capacity, bs) > 0
    x = jax.random.normal(jax.random.PRNGKey(0), (4096, layout.shape[0]), jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(1), (4096, layout.shape[1]), jnp.bfloat16)
    with jbs.config.implementation("kernels"):
        f = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, out_dtype=jnp.float32, precision="highest"))
        first = np.asarray(f(x, dy))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x, dy)), first)


@pytest.mark.parametrize("bs", (16, 32))
def test_small_block_updat_sm90_and_highest_f32_portable(bs):
    """The sm90 targets take every problem: bfloat16 updat at a small block runs the sm_90a
    kernel; float32 at HIGHEST lowers to them with ``tf32 = false``, which launches the
    exact portable (Ampere) kernels from inside, so the result meets float32 tolerance
    (TF32's error is far above it)."""
    mask, layout = _layout("random", bs)
    assert _lowers_to_sm90("updat", layout, jnp.bfloat16, precision="highest")
    got, want, length = _run("updat", layout, mask, jnp.bfloat16, (129,), precision="highest")
    _check(got, want, jnp.bfloat16, length)
    for op in OPS:
        got, want, text = _run_f32(op, layout, mask, (129,), precision="highest")
        assert not _tf32_flag(text, op), f"{op}: float32 at HIGHEST must not run on TF32"
        _check(got, want, jnp.float32, _length(op, layout, 129))


# ---------------------------------------------------------------------------------
# float32 on TF32 tensor cores (precision DEFAULT/HIGH) and exact float32 (HIGHEST)
# ---------------------------------------------------------------------------------

# TF32 keeps 10 mantissa bits of each input (the tensor cores may truncate): products
# are off by up to ~2^-9 relative, and a sum of L random terms by about that times the
# output scale. Against the float64 oracle, relative to the largest |output|:
TF32_TOL = 5e-3
# Above exact float32 (about 1e-6 here): the error level that shows TF32 really ran.
TF32_MIN_ERR = 1e-5


def _run_f32(op, layout, mask, lead, seed=0, *, precision):
    """(result, float64 oracle) of ``op`` on float32 inputs at ``precision``, and the
    StableHLO of the call (to check the target and its tf32 attribute)."""
    from .test_bsmm_kernels import _blocks, _dense, _f64, _rand, _weights

    bs = layout.block_size
    c, k = layout.shape
    if op == "updat":
        x, dy = _rand((*lead, c), jnp.float32, seed), _rand((*lead, k), jnp.float32, seed + 1)
        fun = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, precision=precision))
        args = (x, dy)
        want = _blocks(_f64(x).reshape(-1, c).T @ _f64(dy).reshape(-1, k), mask, bs, layout.capacity)
    else:
        transpose = op == "bprop"
        w = _weights(layout, jnp.float32, seed + 2)
        x = _rand((*lead, k if transpose else c), jnp.float32, seed)
        fun = jax.jit(lambda x, w: jbs.bsmm(x, w, layout, transpose=transpose, precision=precision))
        args = (x, w)
        W = _dense(w, mask, bs)
        want = _f64(x) @ (W.T if transpose else W)
    with jbs.config.implementation("kernels"):
        text = fun.lower(*args).as_text()
        got = fun(*args)
    assert got.dtype == jnp.float32
    return _f64(got), want, text


def _tf32_flag(text, op):
    lines = [l for l in text.splitlines() if f"@{jbs.targets.target_name(f'jbs_bsmm_{op}_sm90')}(" in l]
    assert len(lines) == 1, f"expected one call of jbs_bsmm_{op}_sm90 in:\n{text}"
    assert "tf32 = " in lines[0], lines[0]
    return "tf32 = true" in lines[0]


def _tf32_on(op, bs):
    """Whether the lowering asks for TF32 for ``op`` at block size ``bs`` below HIGHEST."""
    return bs in _sm90.tf32_block_sizes(op)


def _length(op, layout, rows):
    """Reduction length of ``op`` with ``rows`` rows of x: C (fprop), K (bprop), rows (updat)."""
    return rows if op == "updat" else layout.shape[1 if op == "bprop" else 0]


def _rel_err(got, want):
    """max |got - want| relative to max |want|; max |got| where want is all zeros, and 0
    for an empty result (updat of an empty layout: [0, bs, bs])."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.isfinite(got).all(), "non-finite output (padding leaked, or uninitialised memory)"
    if got.size == 0:
        return 0.0
    scale = np.abs(want).max()
    return float(np.abs(got - want).max() / scale) if scale > 0 else float(np.abs(got).max())


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", TF32_BLOCKS)
def test_tf32_layouts(bs, op, kind):
    mask, layout = _layout(kind, bs)
    got, want, text = _run_f32(op, layout, mask, (129,), precision="default")
    assert _tf32_flag(text, op) == _tf32_on(op, bs)
    assert _rel_err(got, want) <= TF32_TOL


@pytest.mark.parametrize("n", (1, 7, 129, 1000, 5000))
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", TF32_BLOCKS)
def test_tf32_rows(bs, op, n):
    # Odd n: updat pads x^T / dy^T to a multiple of 4; small n splits the updat reduction.
    mask, layout = _layout("random", bs)
    got, want, text = _run_f32(op, layout, mask, (n,), precision="high")
    assert _tf32_flag(text, op) == _tf32_on(op, bs)
    assert _rel_err(got, want) <= TF32_TOL


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", TF32_BLOCKS)
def test_tf32_really_runs_and_highest_is_exact(bs, op):
    mask, layout = _layout("random", bs)
    got, want, text = _run_f32(op, layout, mask, (3, 43), precision="default")
    assert _tf32_flag(text, op) == _tf32_on(op, bs)
    if _tf32_on(op, bs):
        err = _rel_err(got, want)
        assert TF32_MIN_ERR < err <= TF32_TOL, err  # TF32, not exact float32
    else:  # TF32 off here: DEFAULT runs the exact kernel
        _check(got, want, jnp.float32, _length(op, layout, 129))
    got, want, text = _run_f32(op, layout, mask, (3, 43), precision="highest")
    assert not _tf32_flag(text, op)
    _check(got, want, jnp.float32, _length(op, layout, 129))


@pytest.mark.parametrize("bs", (16, 128))
def test_tf32_updat_split_is_deterministic(bs):
    mask, layout = _layout("single", bs)
    assert _sm90.updat_workspace_bytes(jnp.float32, 4096, layout.grid, layout.capacity, bs, tf32=True) > 0
    x = jax.random.normal(jax.random.PRNGKey(0), (4096, layout.shape[0]), jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(1), (4096, layout.shape[1]), jnp.float32)
    with jbs.config.implementation("kernels"):
        f = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, layout, precision="default"))
        first = np.asarray(f(x, dy))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x, dy)), first)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("bs", (8, 16, 64, 128))
def test_tf32_sanitizer_subset(bs, op):
    # Run by tests/gpu/run_sanitizer.sh with the 16-bit subset (-k sanitizer_subset).
    mask, layout = _layout("padded", bs)
    got, want, text = _run_f32(op, layout, mask, (133,), precision="default")
    assert _tf32_flag(text, op)
    assert _rel_err(got, want) <= TF32_TOL
