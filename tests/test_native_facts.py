"""What Python and the C++ extension share is defined once, and each side reads it there.

* The block sizes: jax_blocksparse/block_sizes.json. Python reads it
  (``jbs.SUPPORTED_BLOCK_SIZES``, with or without the extension) and the build turns it
  into the C++ table (cuda/bsmm_block_sizes.h), so the extension reports the very table
  it was compiled with.
* The Hopper kernels' facts (cuda/sm90/bsmm_sm90_plan.h, bsmm_sm90_tf32.h): the lowering
  (jax_blocksparse/ops/_sm90.py) asks the extension, ``build_info()["sm90"]`` and
  ``sm90_updat_workspace_bytes``, which every build holds, a CPU-only one too. So this
  file runs on any machine: the updat workspace is that of the work plan, the TF32 tables
  fit the block sizes, and _sm90 follows whatever the extension reports.
* The dtypes: Python's table (ops/_checks.py) is needed without the extension and the
  C++ one is code (one kernel per dtype), so the two are kept, and the test below asks
  the handlers themselves which input dtypes they take.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import require_kernels
from jax_blocksparse.ops import _checks, _sm90

TABLE = Path(jbs.__file__).resolve().with_name("block_sizes.json")
OPS = ("fprop", "bprop", "updat")
BASE = tuple(_sm90.SM90_TARGETS)
SM90 = tuple(_sm90.SM90_TARGETS.values())
# The updat kernels' tiling as cuda/sm90/bsmm_sm90_plan.h documents it: block size ->
# (slots per work item, rows of n per k-step). The test's own statement of it, to check
# the workspace against the work plan those parameters give.
SDD_TILING = {8: (8, 64), 16: (4, 64), 32: (2, 64), 64: (4, 32), 128: (2, 32)}


@pytest.fixture
def native():
    require_kernels("cpu")
    return jbs._native.module()


def test_block_sizes_come_from_the_package_table():
    table = tuple(json.loads(TABLE.read_text())["block_sizes"])
    assert jbs.SUPPORTED_BLOCK_SIZES == table
    assert table == tuple(sorted(set(table))) and all(isinstance(bs, int) and bs > 0 for bs in table)
    for bs in table:
        assert jbs.Layout.from_mask(np.eye(2, dtype=bool), bs).block_size == bs
    with pytest.raises(ValueError, match="block_size must be one of"):
        jbs.Layout.from_mask(np.eye(2, dtype=bool), max(table) * 2)


def test_the_extension_was_built_from_the_same_table(native):
    assert tuple(native.build_info()["block_sizes"]) == jbs.SUPPORTED_BLOCK_SIZES


# Every dtype Python takes, and some it does not.
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.float8_e4m3fn)


def test_the_dtype_probe_covers_python_s_table():
    assert {np.dtype(d) for d in _checks.SUPPORTED_DTYPES} < {np.dtype(d) for d in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_handlers_take_exactly_the_supported_dtypes(native, dtype):
    # The CPU fprop target called directly (no Python check in between), float32 output.
    layout = jbs.Layout.from_mask(np.eye(2, dtype=bool), 8)
    t = layout.tables
    tables = [jnp.asarray(a) for a in (t.block_rows, t.block_cols, t.col_ptr, t.row_ptr, t.row_slots, t.col_order)]
    x, w = jnp.ones((3, 16), dtype), jnp.ones(layout.w_shape, dtype)
    call = jax.ffi.ffi_call(jbs.targets.target_name("jbs_bsmm_fprop"), jax.ShapeDtypeStruct((3, 16), jnp.float32))
    supported = any(np.dtype(dtype) == np.dtype(d) for d in _checks.SUPPORTED_DTYPES)
    if supported:
        np.testing.assert_allclose(np.asarray(jax.jit(call)(x, w, *tables)), 8.0)
    else:
        with pytest.raises(Exception, match="inputs must share one dtype among"):
            jax.block_until_ready(jax.jit(call)(x, w, *tables))


# ---------------------------------------------------------------------------------
# The Hopper kernels' facts
# ---------------------------------------------------------------------------------


def test_sm90_facts_fit_the_block_sizes(native):
    facts = native.build_info()["sm90"]
    assert facts == _sm90.facts()
    assert set(facts) == {
        "plan_sms",
        "tf32_block_sizes",
        "tf32_off",
        "tf32_row_multiple",
        "variants",
        "updat_capped_workspace_bytes",
    }
    assert facts["plan_sms"] > 0 and facts["tf32_row_multiple"] > 0
    on = facts["tf32_block_sizes"]
    assert set(on) == set(OPS)
    assert all(set(sizes) <= set(jbs.SUPPORTED_BLOCK_SIZES) for sizes in on.values())
    # tf32_off names exactly the block sizes each op leaves out, each with its reason.
    left_out = {(op, bs) for op in OPS for bs in jbs.SUPPORTED_BLOCK_SIZES if bs not in on[op]}
    assert {(op, bs) for op, by_bs in facts["tf32_off"].items() for bs in by_bs} == left_out
    assert all(why.strip() for by_bs in facts["tf32_off"].values() for why in by_bs.values())
    assert set(_sm90.tf32_off()) == left_out
    for op in OPS:
        assert _sm90.tf32_block_sizes(op) == tuple(on[op])
    # The kernel variants: the baseline runs every product; the others a part of them.
    every = {mode: list(jbs.SUPPORTED_BLOCK_SIZES) for mode in ("bfloat16", "float16", "float32", "tf32")}
    assert set(facts["variants"]) == set(OPS)
    for op in OPS:
        by_variant = {v: {m: list(s) for m, s in by_mode.items()} for v, by_mode in facts["variants"][op].items()}
        assert by_variant["baseline"] == every
        assert all(
            set(s) <= set(jbs.SUPPORTED_BLOCK_SIZES) for by_mode in by_variant.values() for s in by_mode.values()
        )
    assert facts["updat_capped_workspace_bytes"] > 0


def test_build_info_serialises_as_json(native, monkeypatch):
    # Benches and bug reports record it (bench/_report.py writes it into every JSON report),
    # tf32_off's block-size keys included (op -> {block size -> why}).
    info = jbs.extension_info()
    assert json.loads(json.dumps(info))["sm90"] == json.loads(json.dumps(info["sm90"]))
    assert json.loads(json.dumps({"tf32_off": {"fprop": {8: "why"}}}))["tf32_off"]["fprop"]["8"] == "why"


def test_tf32_is_on_for_every_product_and_block_size(native):
    # The TF32 DSD kernel at block 8 ran clean on an H100 (2026-11-26): nothing is off.
    assert _sm90.tf32_off() == {}
    assert all(_sm90.tf32_block_sizes(op) == jbs.SUPPORTED_BLOCK_SIZES for op in OPS)
    assert _sm90.tf32_summary() == "on for every op and block size below HIGHEST"


def test_sm90_helpers_follow_what_the_extension_reports(monkeypatch):
    facts = {
        "plan_sms": 7,
        "tf32_block_sizes": {"fprop": jbs.SUPPORTED_BLOCK_SIZES, "bprop": (16,), "updat": (64,)},
        "tf32_off": {"bprop": {8: "a reason"}},
        "tf32_row_multiple": 8,
    }
    monkeypatch.setattr(jbs._native, "extension_info", lambda: {"sm90": facts})
    assert _sm90.tf32_block_sizes("jbs_bsmm_fprop_sm90") == jbs.SUPPORTED_BLOCK_SIZES
    assert _sm90.tf32_block_sizes("bprop") == (16,)
    assert _sm90.use_tf32("jbs_bsmm_updat", np.float32, 64, None)
    assert not _sm90.use_tf32("jbs_bsmm_updat", np.float32, 16, None)
    assert _sm90.tf32_off() == {("bprop", 8): "a reason"}
    assert _sm90.tf32_summary() == "exact float32 instead for bprop at block 8: a reason"
    x, dy = np.ones((2, 3, 8), np.float32), np.ones((2, 3, 16), np.float32)
    xt, dyt = _sm90.tf32_operands("jbs_bsmm_updat", x, dy)
    assert xt.shape == (8, 8) and dyt.shape == (16, 8)  # n = 6 padded to a multiple of 8


def test_sm90_helpers_without_the_extension(monkeypatch):
    # No extension (JBS_SKIP_NATIVE_BUILD=1): no sm_90 target can be picked, nothing runs on TF32.
    monkeypatch.setattr(jbs._native, "extension_info", lambda: {})
    monkeypatch.setattr(jbs._native, "module", lambda: None)
    assert _sm90.facts() == {}
    assert all(_sm90.tf32_block_sizes(op) == () for op in OPS)
    assert not _sm90.use_tf32("jbs_bsmm_fprop", np.float32, 64, None)
    assert _sm90.tf32_off() == {}
    assert _sm90.tf32_summary().startswith("unknown: ")
    with pytest.raises(RuntimeError, match="tf32_row_multiple"):
        _sm90.tf32_operands("jbs_bsmm_updat", np.ones((4, 8), np.float32), np.ones((4, 8), np.float32))
    with pytest.raises(RuntimeError, match="sm90_updat_workspace_bytes"):
        _sm90.updat_workspace_bytes(jnp.bfloat16, 64, (1, 1), 1, 64)


def test_use_tf32_rule(native):
    from jax import lax

    f32, bf16 = np.dtype(np.float32), jnp.bfloat16
    for target in (*BASE, *SM90):
        op = _sm90.BASE_TARGETS.get(target, target).removeprefix("jbs_bsmm_")
        for prec in (None, lax.Precision.DEFAULT, lax.Precision.HIGH):
            for bs in jbs.SUPPORTED_BLOCK_SIZES:
                # TF32 at every block size below HIGHEST.
                assert _sm90.use_tf32(target, f32, bs, prec), (target, bs)
                assert _sm90.use_tf32(op, f32, bs, prec) == _sm90.use_tf32(target, f32, bs, prec)
                assert not _sm90.use_tf32(target, bf16, bs, prec)
            assert not _sm90.use_tf32(target, f32, 4, prec)  # no kernel at other block sizes
        for bs in jbs.SUPPORTED_BLOCK_SIZES:
            assert not _sm90.use_tf32(target, f32, bs, lax.Precision.HIGHEST)
    with pytest.raises(ValueError, match="unknown target"):
        _sm90.use_tf32("jbs_bsmm_nope", f32, 64, None)


def test_tf32_operands_values(native):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4, 4)).astype(np.float32)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)  # n = 6 -> padded to 8
    dy = rng.standard_normal((2, 3, 12)).astype(np.float32)
    a, b = _sm90.tf32_operands("jbs_bsmm_fprop", x, w)
    assert a is x and np.array_equal(np.asarray(b), w.transpose(0, 2, 1))
    a, b = _sm90.tf32_operands("jbs_bsmm_bprop", x, w)
    assert a is x and b is w
    xt, dyt = (np.asarray(v) for v in _sm90.tf32_operands("jbs_bsmm_updat", x, dy))
    assert xt.shape == (8, 8) and dyt.shape == (12, 8)
    assert np.array_equal(xt[:, :6], x.reshape(6, 8).T) and not xt[:, 6:].any()
    assert np.array_equal(dyt[:, :6], dy.reshape(6, 12).T) and not dyt[:, 6:].any()
    # x^T dy over the padded rows is the product over the real ones.
    np.testing.assert_allclose(xt @ dyt.T, x.reshape(6, 8).T @ dy.reshape(6, 12), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="unknown target"):
        _sm90.tf32_operands("jbs_bsmm_nope", x, w)


# ---------------------------------------------------------------------------------
# The updat workspace: the extension's SddWorkspaceBytes over the kernels' work plan
# ---------------------------------------------------------------------------------


def test_sdd_tiling_covers_every_block_size():
    assert tuple(SDD_TILING) == jbs.SUPPORTED_BLOCK_SIZES


@pytest.mark.parametrize("bs", list(SDD_TILING))
@pytest.mark.parametrize("n", [0, 1, 31, 32, 1000, 4096, 100_000])
@pytest.mark.parametrize("capacity", [1, 5, 64, 263, 264, 265, 1000])
def test_workspace_is_the_work_plans(native, bs, n, capacity):
    group, tile_k = SDD_TILING[bs]
    plan_sms = _sm90.facts()["plan_sms"]
    grid = (3, 5)
    plan = native.work_plan_sdd(capacity, group, n, tile_k, plan_sms, bs)
    ws = _sm90.updat_workspace_bytes(jnp.bfloat16, n, grid, capacity, bs)
    assert ws == plan["workspace_elems"] * 4
    assert _sm90.updat_workspace_bytes(jnp.float16, n, grid, capacity, bs) == ws
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, n, grid, capacity, bs, num_sms=plan_sms) == ws
    few = native.work_plan_sdd(capacity, group, n, tile_k, 2, bs)
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, n, grid, capacity, bs, num_sms=2) == few["workspace_elems"] * 4
    assert _sm90.updat_workspace_bytes(jnp.float32, n, grid, capacity, bs) == 0  # exact f32: the portable kernels
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, n, (0, 5), capacity, bs) == 0  # C = 0: the portable kernels
    # TF32: the same plan over the rows of x^T / dy^T, which the lowering pads.
    padded = n + (-n % _sm90.facts()["tf32_row_multiple"])
    assert _sm90.updat_workspace_bytes(jnp.float32, padded, grid, capacity, bs, tf32=True) == (
        _sm90.updat_workspace_bytes(jnp.bfloat16, padded, grid, capacity, bs)
    )
    if n != padded:
        assert _sm90.updat_workspace_bytes(jnp.float32, n, grid, capacity, bs, tf32=True) == 0
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, padded, grid, capacity, bs, tf32=True) == 0


def test_workspace_bad_arguments(native):
    with pytest.raises(ValueError, match="dtype"):
        native.sm90_updat_workspace_bytes("float64", 64, 1, 1, 1, 64)
    with pytest.raises(ValueError, match="n >= 0"):
        native.sm90_updat_workspace_bytes("bfloat16", -1, 1, 1, 1, 64)
    with pytest.raises(ValueError, match="num_sms > 0"):
        native.sm90_updat_workspace_bytes("bfloat16", 64, 1, 1, 1, 64, num_sms=0)
    assert native.sm90_updat_workspace_bytes("bfloat16", 4096, 1, 1, 1, 24) == 0  # no kernel at block 24
