"""The Hopper (sm_90a) targets in the CUDA lowering, checked without a GPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the 'cuda' lowering
rules (tests/test_cuda_lowering.py). With the Hopper gate open (JAX_BLOCKSPARSE_HOPPER=1;
see jax_blocksparse/ops/_sm90.py) the text must call ``jbs_bsmm_*_sm90`` with the
operands of the portable targets, updat_sm90 with its uint8 workspace result; with the
gate closed, the portable targets only, the workspace sized by the extension
(tests/test_native_facts.py checks that size against the work plan on any machine).
Float32 at DEFAULT/HIGH precision calls the sm_90 targets with ``tf32 = true`` and the
K-major operands TF32 wgmma needs (fprop: w's blocks transposed; updat: x^T, dy^T);
HIGHEST with ``tf32 = false`` and the operands as they are. Where the gate
(:mod:`jax_blocksparse.verified`) verified a key on compute capability 9.0, the lowering
picks the Hopper target for it without the environment variable.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import kernel_calls, require_cuda_extension
from jax_blocksparse import verified
from jax_blocksparse.ops import _sm90

BASE = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")
SM90 = tuple(_sm90.SM90_TARGETS[t] for t in BASE)
BLOCK = 64
GRID = (3, 5)
C, K = GRID[0] * BLOCK, GRID[1] * BLOCK
N = 40


@pytest.fixture(autouse=True)
def _need_sm90(monkeypatch):
    require_cuda_extension()
    if not _sm90.built_targets():
        pytest.skip("the extension was built without sm_90a (no Hopper targets)")
    monkeypatch.delenv(_sm90.HOPPER_ENV, raising=False)
    # Cross-lowering: no CUDA device, whatever the machine has.
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: None)


def _layout():
    mask = np.zeros(GRID, bool)
    mask[0, 1] = mask[2, 1] = mask[1, 3] = mask[2, 4] = True
    return jbs.Layout.from_mask(mask, BLOCK, capacity=6), int(mask.sum())


def _lower(op, dtype=jnp.bfloat16, precision=None, n=N):
    lay, _ = _layout()
    x = jnp.zeros((n, C), dtype)
    dy = jnp.zeros((n, K), dtype)
    w = jnp.zeros((lay.capacity, BLOCK, BLOCK), dtype)
    fun = {
        "fprop": lambda x, w, dy: jbs.bsmm(x, w, lay, precision=precision),
        "bprop": lambda x, w, dy: jbs.bsmm(dy, w, lay, transpose=True, precision=precision),
        "updat": lambda x, w, dy: jbs.bsmm_updat(x, dy, lay, precision=precision),
    }[op]
    with jbs.config.implementation("kernels"):
        return jax.jit(fun).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()


def _at(kernel):
    """How a call of ``kernel`` ("jbs_bsmm_fprop_sm90") starts in StableHLO text: its
    versioned FFI target (jax_blocksparse/targets.py)."""
    return f"@{jbs.targets.target_name(kernel)}("


def _operands(text, target):
    """Operand lists of every call of ``target`` in the StableHLO text."""
    return [m.split(",") for m in re.findall(rf"{re.escape(_at(target))}([^)]*)\)", text)]


def test_targets_registered_with_initialize_stage():
    regs = jbs._native._load()[0].registrations()["CUDA"]
    for target in SM90:
        assert set(regs[jbs.targets.target_name(target)]) == {"initialize", "execute"}, target
    assert _sm90.built_targets() == set(SM90)


@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
def test_gate_closed_lowers_to_portable_targets(op):
    text = _lower(op)
    assert _at(f"jbs_bsmm_{op}") in text
    assert "_sm90" not in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("op", ["fprop", "bprop"])
def test_gate_open_dsd(monkeypatch, op, dtype):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower(op, dtype)
    calls = _operands(text, f"jbs_bsmm_{op}_sm90")
    assert len(calls) == 1, text
    assert len(calls[0]) == 10  # a, w, five tables, order, the work list and its pointers (v2)
    assert _at(f"jbs_bsmm_{op}") not in text
    assert _variant_attr(_call_line(text, f"jbs_bsmm_{op}_sm90")) == "baseline"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gate_open_updat_has_workspace(monkeypatch, dtype):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower("updat", dtype)
    calls = _operands(text, "jbs_bsmm_updat_sm90")
    assert len(calls) == 1 and len(calls[0]) == 7, text  # x, dy, five tables
    lay, _ = _layout()
    ws = _sm90.updat_workspace_bytes(dtype, N, GRID, lay.capacity, BLOCK)
    assert ws > 0  # 6 slots and 2 k-steps: the plan splits N
    line = next(l for l in text.splitlines() if _at("jbs_bsmm_updat_sm90") in l)
    assert f"tensor<{ws}xui8>" in line, line
    assert f"tensor<{lay.capacity}x{BLOCK}x{BLOCK}x" in line


def test_gate_requires_sm90_device(monkeypatch):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "8.0")
    assert "_sm90" not in _lower("fprop")
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    assert _at("jbs_bsmm_fprop_sm90") in _lower("fprop")


def _gate_with(monkeypatch, target, mode="bfloat16", block_size=BLOCK, cc="9.0"):
    """The gate in force verifies one key on one compute capability."""
    gate = verified.Gate((verified.Device(cc, passed={target: {mode: (block_size,)}}),))
    monkeypatch.setattr(verified, "default_gate", lambda: gate)


def test_verified_key_opens_gate_only_on_sm90(monkeypatch):
    _gate_with(monkeypatch, "jbs_bsmm_fprop_sm90")
    assert "_sm90" not in _lower("fprop")  # cross-lowering: only the env var counts
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    assert _at("jbs_bsmm_fprop_sm90") in _lower("fprop")
    assert "_sm90" not in _lower("bprop")  # not verified
    assert "_sm90" not in _lower("fprop", jnp.float16)  # another mode: not verified


def test_auto_uses_a_verified_hopper_target_on_sm90(monkeypatch):
    lay, _ = _layout()
    x = jnp.zeros((N, C), jnp.bfloat16)
    w = jnp.zeros((lay.capacity, BLOCK, BLOCK), jnp.bfloat16)
    # A table in force where the Hopper kernel wins up to density 1 (nothing is dense).
    table = jbs.crossover.CrossoverTable.from_entries(
        [
            dict(
                platform="cuda",
                device_kind="any",
                target="jbs_bsmm_fprop_sm90",
                mode="bfloat16",
                block_size=BLOCK,
                crossover=1.0,
                family="9.0",
            )
        ]
    )

    def lower():
        with jbs.config.implementation("auto"), jbs.crossover.use_table(table):
            return jax.jit(lambda x, w: jbs.bsmm(x, w, lay)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()

    _gate_with(monkeypatch, "jbs_bsmm_fprop_sm90", cc="7.0")
    assert not kernel_calls(lower())  # nothing verified for this GPU: the reference
    _gate_with(monkeypatch, "jbs_bsmm_fprop_sm90")
    assert not kernel_calls(lower())  # no sm_90 device at lowering: still the reference
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    assert _at("jbs_bsmm_fprop_sm90") in lower()
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "8.0")
    assert not kernel_calls(lower())


@pytest.mark.parametrize("bs", [8, 16, 32], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gate_open_small_block_updat_has_workspace(monkeypatch, dtype, bs):
    # Blocks 8/16/32 run the sm_90a updat too (64 / bs slots stacked along wgmma's M), so
    # the target carries the workspace of their plan (group 64 / bs, 64 rows per k-step).
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    lay = jbs.Layout.from_mask(np.eye(4, 6, dtype=bool), bs, capacity=6)
    n = 200  # 4 k-steps of 64 rows; 6 slots in at most 2 items: the plan splits N
    x, dy = jnp.zeros((n, 4 * bs), dtype), jnp.zeros((n, 6 * bs), dtype)
    with jbs.config.implementation("kernels"):
        lowered = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, lay)).trace(x, dy).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    calls = _operands(text, "jbs_bsmm_updat_sm90")
    assert len(calls) == 1 and len(calls[0]) == 7, text
    assert _at("jbs_bsmm_updat") not in text
    ws = _sm90.updat_workspace_bytes(dtype, n, lay.grid, lay.capacity, bs)
    assert ws == 4 * lay.capacity * bs * bs * 4  # splits = k-steps = 4
    line = _call_line(text, "jbs_bsmm_updat_sm90")
    assert f"tensor<{ws}xui8>" in line, line
    assert f"tensor<{lay.capacity}x{bs}x{bs}x" in line


# ---------------------------------------------------------------------------------
# float32: TF32 tensor cores below HIGHEST
# ---------------------------------------------------------------------------------


def _call_line(text, target):
    lines = [l for l in text.splitlines() if _at(target) in l]
    assert len(lines) == 1, text
    return lines[0]


def _tf32_attr(line):
    m = re.search(r"tf32 = (true|false)", line)
    assert m, line
    return m.group(1) == "true"


def _defs(text, target):
    """SSA name -> its defining line, in the function that calls ``target`` (names repeat
    across the private functions of the lowering)."""
    out = {}
    for l in text.splitlines():
        if "func.func" in l:
            out = {}
        m = re.match(r"\s*(%[\w#]+)(?::\d+)? = ", l)
        if m:
            out[m.group(1)] = l
        if _at(target) in l:
            return out
    raise AssertionError(f"no call of {target}")


@pytest.mark.parametrize("precision", [None, "default", "high", "tensorfloat32", "bfloat16"])
def test_f32_default_fprop_is_tf32_with_transposed_w(monkeypatch, precision):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    # conftest runs every test under default_matmul_precision("highest"): None reads XLA's default here.
    with jax.default_matmul_precision(None):
        text = _lower("fprop", jnp.float32, precision)
    line = _call_line(text, "jbs_bsmm_fprop_sm90")
    assert _tf32_attr(line)
    x_arg, w_arg = (v.strip() for v in _operands(text, "jbs_bsmm_fprop_sm90")[0][:2])
    # w reaches the kernel with each block transposed: w^T = transpose(w, [0, 2, 1]).
    w_def = _defs(text, "jbs_bsmm_fprop_sm90")[w_arg]
    assert "stablehlo.transpose" in w_def and "dims = [0, 2, 1]" in w_def, w_def
    assert "tensor<6x64x64xf32>" in w_def
    assert x_arg.startswith("%arg"), x_arg  # x unchanged


def test_f32_default_bprop_is_tf32_with_operands_unchanged(monkeypatch):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower("bprop", jnp.float32, "default")
    assert _tf32_attr(_call_line(text, "jbs_bsmm_bprop_sm90"))
    g_arg, w_arg = (v.strip() for v in _operands(text, "jbs_bsmm_bprop_sm90")[0][:2])
    assert g_arg.startswith("%arg") and w_arg.startswith("%arg")  # already K-major
    assert "stablehlo.transpose" not in text


@pytest.mark.parametrize("n", [N, 42, 1], ids=["n40", "n42-padded", "n1-padded"])
def test_f32_default_updat_is_tf32_with_transposed_operands(monkeypatch, n):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower("updat", jnp.float32, "default", n=n)
    line = _call_line(text, "jbs_bsmm_updat_sm90")
    assert _tf32_attr(line)
    padded = n + (-n % 4)
    # x^T [C, n] and dy^T [K, n], n padded with zero rows to a multiple of 4.
    assert f"(tensor<{C}x{padded}xf32>, tensor<{K}x{padded}xf32>," in line, line
    defs = _defs(text, "jbs_bsmm_updat_sm90")
    for arg, cols in zip(_operands(text, "jbs_bsmm_updat_sm90")[0][:2], (C, K)):
        d = defs[arg.strip()]
        assert "stablehlo.transpose" in d and "dims = [1, 0]" in d, d
        assert f"tensor<{padded}x{cols}xf32>" in d
    assert ("stablehlo.pad" in text) == (padded != n)
    lay, _ = _layout()
    ws = _sm90.updat_workspace_bytes(jnp.float32, padded, GRID, lay.capacity, BLOCK, tf32=True)
    assert f"tensor<{ws}xui8>" in line, line


@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
def test_f32_highest_is_exact_with_operands_unchanged(monkeypatch, op):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower(op, jnp.float32, "highest")
    line = _call_line(text, f"jbs_bsmm_{op}_sm90")
    assert not _tf32_attr(line)
    assert "stablehlo.transpose" not in text and "stablehlo.pad" not in text
    for arg in _operands(text, f"jbs_bsmm_{op}_sm90")[0][:2]:
        assert arg.strip().startswith("%arg"), line
    if op == "updat":
        assert f"(tensor<{N}x{C}xf32>, tensor<{N}x{K}xf32>," in line
        assert "tensor<0xui8>" in line  # the exact kernel needs no workspace


def test_f32_default_matmul_precision_context(monkeypatch):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    with jax.default_matmul_precision("highest"):
        assert not _tf32_attr(_call_line(_lower("fprop", jnp.float32), "jbs_bsmm_fprop_sm90"))
    with jax.default_matmul_precision("tensorfloat32"):
        assert _tf32_attr(_call_line(_lower("fprop", jnp.float32), "jbs_bsmm_fprop_sm90"))


@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_16bit_never_tf32(monkeypatch, op, dtype):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower(op, dtype)
    assert not _tf32_attr(_call_line(text, f"jbs_bsmm_{op}_sm90"))
    assert "stablehlo.transpose" not in text


@pytest.mark.parametrize("precision", ["default", "highest"])
@pytest.mark.parametrize("bs", [8, 16, 32], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
def test_f32_small_blocks_tf32_below_highest(monkeypatch, op, bs, precision):
    # Blocks 8/16/32 in float32 run the packed TF32 kernels at DEFAULT, with the K-major
    # operands of blocks 64/128 (fprop: w blocks transposed; updat: x^T, dy^T padded to 4
    # rows, and the 16-bit plan's workspace over them); HIGHEST keeps the exact kernels.
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    n = 42  # not a multiple of 4: updat pads x^T / dy^T to 44 rows
    lay = jbs.Layout.from_mask(np.eye(4, 6, dtype=bool), bs)
    x, dy = jnp.zeros((n, 4 * bs), jnp.float32), jnp.zeros((n, 6 * bs), jnp.float32)
    w = jnp.zeros((lay.capacity, bs, bs), jnp.float32)
    fun = {
        "fprop": lambda x, w, dy: jbs.bsmm(x, w, lay, precision=precision),
        "bprop": lambda x, w, dy: jbs.bsmm(dy, w, lay, transpose=True, precision=precision),
        "updat": lambda x, w, dy: jbs.bsmm_updat(x, dy, lay, precision=precision),
    }[op]
    with jbs.config.implementation("kernels"):
        text = jax.jit(fun).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    target = f"jbs_bsmm_{op}_sm90"
    line = _call_line(text, target)
    a_arg, b_arg = (v.strip() for v in _operands(text, target)[0][:2])
    if precision == "highest":
        assert not _tf32_attr(line)
        assert "stablehlo.transpose" not in text and "stablehlo.pad" not in text
        assert a_arg.startswith("%arg") and b_arg.startswith("%arg"), line
        return
    assert _tf32_attr(line)
    defs = _defs(text, target)
    if op == "fprop":
        w_def = defs[b_arg]
        assert "stablehlo.transpose" in w_def and "dims = [0, 2, 1]" in w_def, w_def
        assert f"tensor<{lay.capacity}x{bs}x{bs}xf32>" in w_def
        assert a_arg.startswith("%arg"), a_arg
    elif op == "bprop":
        assert a_arg.startswith("%arg") and b_arg.startswith("%arg"), line
        assert "stablehlo.transpose" not in text
    else:
        padded = n + (-n % 4)
        assert f"(tensor<{4 * bs}x{padded}xf32>, tensor<{6 * bs}x{padded}xf32>," in line, line
        for arg, cols in ((a_arg, 4 * bs), (b_arg, 6 * bs)):
            d = defs[arg]
            assert "stablehlo.transpose" in d and "dims = [1, 0]" in d, d
            assert f"tensor<{padded}x{cols}xf32>" in d
        assert "stablehlo.pad" in text
        ws = _sm90.updat_workspace_bytes(jnp.float32, padded, lay.grid, lay.capacity, bs, tf32=True)
        assert ws == _sm90.updat_workspace_bytes(jnp.bfloat16, padded, lay.grid, lay.capacity, bs)
        assert f"tensor<{ws}xui8>" in line, line


def test_portable_targets_take_no_attribute(monkeypatch):
    # The Ampere targets are unchanged: no tf32 attribute, whatever the precision.
    for op in ("fprop", "updat"):
        line = _call_line(_lower(op, jnp.float32, "default"), f"jbs_bsmm_{op}")
        assert "tf32" not in line, line


# ---------------------------------------------------------------------------------
# Variants of the Hopper targets: the v2 fprop/bprop targets' work list and `variant`
# ---------------------------------------------------------------------------------


def _variant_attr(line):
    m = re.search(r'variant = "(\w+)"', line)
    return m.group(1) if m else None


def _lower_small(op, bs, dtype=jnp.bfloat16, precision=None, impl="kernels"):
    """An fprop/bprop at block ``bs`` on a grid (4, 6) with capacity 8 (block fraction 1/3)."""
    mask = np.zeros((4, 6), bool)
    mask[0, 1] = mask[2, 1] = mask[1, 3] = mask[3, 5] = mask[0, 0] = True
    lay = jbs.Layout.from_mask(mask, bs, capacity=8)
    x = jnp.zeros((N, (6 if op == "bprop" else 4) * bs), dtype)
    w = jnp.zeros((lay.capacity, bs, bs), dtype)
    with jbs.config.implementation(impl):
        fun = jax.jit(lambda x, w: jbs.bsmm(x, w, lay, transpose=op == "bprop", precision=precision))
        return fun.trace(x, w).lower(lowering_platforms=("cuda",)).as_text(), lay


@pytest.mark.parametrize("op", ["fprop", "bprop"])
def test_v2_targets_take_the_layouts_work_list(monkeypatch, op):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text, lay = _lower_small(op, 16)
    assert jbs.targets.target_name(f"jbs_bsmm_{op}_sm90").endswith("_v2")
    line = _call_line(text, f"jbs_bsmm_{op}_sm90")
    cap = lay.capacity
    outputs = lay.grid[1] if op == "fprop" else lay.grid[0]
    # The work list [2 * cap] and its pointers [outputs + 1] follow the order [outputs].
    shapes = re.findall(r"tensor<([\dx]+?)x(?:i32|bf16)>", line.split("->")[0].split(":")[-1])
    assert shapes[-3:] == [f"{outputs}", f"{2 * cap}", f"{outputs + 1}"], line
    assert _variant_attr(line) == "baseline" and "tf32 = false" in line


@pytest.mark.parametrize("bs", jbs.SUPPORTED_BLOCK_SIZES)
@pytest.mark.parametrize("op", ["fprop", "bprop"])
def test_variant_env_asks_for_a_variant_where_it_runs(monkeypatch, op, bs):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    monkeypatch.setenv(_sm90.VARIANT_ENV, "stacked")
    want = "stacked" if _sm90.variant_runs(op, "stacked", "bfloat16", bs) else "baseline"
    assert want == ("stacked" if bs <= 64 else "baseline")  # what the extension reports
    text, _ = _lower_small(op, bs)
    assert _variant_attr(_call_line(text, f"jbs_bsmm_{op}_sm90")) == want
    # float32 (TF32 or exact) has the baseline only.
    for precision in ("default", "highest"):
        text, _ = _lower_small(op, bs, jnp.float32, precision)
        assert _variant_attr(_call_line(text, f"jbs_bsmm_{op}_sm90")) == "baseline"


def test_variant_env_per_op_and_its_errors(monkeypatch):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    monkeypatch.setenv(_sm90.VARIANT_ENV, "fprop=stacked, bprop=baseline")
    assert _variant_attr(_call_line(_lower_small("fprop", 16)[0], "jbs_bsmm_fprop_sm90")) == "stacked"
    assert _variant_attr(_call_line(_lower_small("bprop", 16)[0], "jbs_bsmm_bprop_sm90")) == "baseline"
    # updat keeps its v1 target: no work list, no variant.
    line = _call_line(_lower("updat"), "jbs_bsmm_updat_sm90")
    assert jbs.targets.target_name("jbs_bsmm_updat_sm90").endswith("_v1") and "variant" not in line
    for bad, said in (("packed", "unknown variant 'packed'"), ("fwd=stacked", "'fwd' is not an op")):
        monkeypatch.setenv(_sm90.VARIANT_ENV, bad)
        with pytest.raises(ValueError, match=said):
            _lower_small("fprop", 16)


def _variant_table(variant="stacked", low=0.0, high=0.5, crossover=1.0):
    """A table in force on the 9.0 family: ``variant`` of fprop wins over [low, high]; the
    baseline and the variant beat dense up to ``crossover``."""
    common = dict(platform="cuda", device_kind="any", mode="bfloat16", block_size=16, family="9.0")
    entries = [
        dict(common, target=key, crossover=crossover)
        for key in ("jbs_bsmm_fprop_sm90", _sm90.kernel_key("jbs_bsmm_fprop_sm90", variant))
    ]
    variants = [dict(common, target="jbs_bsmm_fprop_sm90", variant=variant, low=low, high=high)]
    return jbs.crossover.CrossoverTable.from_entries(entries, variants)


def test_table_winner_runs_only_where_its_own_gate_key_passed(monkeypatch):
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: "9.0")
    table = _variant_table()
    # The baseline verified: the table's winner is not, so the baseline runs.
    _gate_with(monkeypatch, "jbs_bsmm_fprop_sm90", block_size=16)
    with jbs.crossover.use_table(table):
        text, _ = _lower_small("fprop", 16, impl="auto")
    assert _variant_attr(_call_line(text, "jbs_bsmm_fprop_sm90")) == "baseline"
    # Its own key verified: the winner runs where the layout's block fraction (1/3) is in its range.
    gate = verified.Gate(
        (
            verified.Device(
                "9.0",
                passed={
                    "jbs_bsmm_fprop_sm90": {"bfloat16": (16,)},
                    "jbs_bsmm_fprop_sm90:stacked": {"bfloat16": (16,)},
                },
            ),
        )
    )
    monkeypatch.setattr(verified, "default_gate", lambda: gate)
    with jbs.crossover.use_table(table):
        text, _ = _lower_small("fprop", 16, impl="auto")
    assert _variant_attr(_call_line(text, "jbs_bsmm_fprop_sm90")) == "stacked"
    with jbs.crossover.use_table(_variant_table(low=0.5, high=1.0)):  # 1/3 is outside its range
        text, _ = _lower_small("fprop", 16, impl="auto")
    assert _variant_attr(_call_line(text, "jbs_bsmm_fprop_sm90")) == "baseline"
    # Kernel or dense is the chosen variant's own crossover: below the fraction, dense.
    with jbs.crossover.use_table(_variant_table(crossover=0.2)):
        text, _ = _lower_small("fprop", 16, impl="auto")
    assert not kernel_calls(text)


def test_variant_keys_split_and_join():
    assert _sm90.kernel_key("jbs_bsmm_fprop_sm90") == "jbs_bsmm_fprop_sm90"
    assert _sm90.kernel_key("jbs_bsmm_fprop_sm90", "stacked") == "jbs_bsmm_fprop_sm90:stacked"
    assert _sm90.split_key("jbs_bsmm_fprop_sm90:stacked") == ("jbs_bsmm_fprop_sm90", "stacked")
    assert _sm90.split_key("jbs_bsmm_fprop_sm90") == ("jbs_bsmm_fprop_sm90", "baseline")
    assert set(_sm90.variants("fprop")) == {"baseline", "stacked"}
    assert set(_sm90.variants("updat")) == {"baseline", "capped"}
    assert _sm90.variants("bprop")["stacked"] == {"bfloat16": (8, 16, 32, 64), "float16": (8, 16, 32, 64)}


@pytest.mark.parametrize("bs", [64, 128])
def test_capped_updat_variant_is_a_smaller_workspace(monkeypatch, bs):
    # The capped updat runs the same kernels with fewer reduction splits: its variant is the
    # workspace the lowering gives the v1 target (the handler plans for what it holds).
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    lay = jbs.Layout.from_mask(np.ones((8, 8), bool), bs)
    n = 1000
    x, dy = jnp.zeros((n, 8 * bs), jnp.bfloat16), jnp.zeros((n, 8 * bs), jnp.bfloat16)

    def workspace():
        with jbs.config.implementation("kernels"):
            fun = jax.jit(lambda x, dy: jbs.bsmm_updat(x, dy, lay))
            line = _call_line(fun.trace(x, dy).lower(lowering_platforms=("cuda",)).as_text(), "jbs_bsmm_updat_sm90")
        assert "variant" not in line
        return int(re.search(r"tensor<(\d+)xui8>", line).group(1))

    baseline = workspace()
    assert baseline == _sm90.updat_workspace_bytes(jnp.bfloat16, n, lay.grid, lay.capacity, bs)
    monkeypatch.setenv(_sm90.VARIANT_ENV, "updat=capped")
    capped = workspace()
    budget = _sm90.facts()["updat_capped_workspace_bytes"]
    assert baseline > budget >= capped > 0
    assert capped == _sm90.updat_workspace_bytes(jnp.bfloat16, n, lay.grid, lay.capacity, bs, variant="capped")
    # The capped plan is one the handler's own search reaches: a halving of the SM count.
    sms = _sm90.facts()["plan_sms"]
    reachable = set()
    while sms >= 1:
        reachable.add(_sm90.updat_workspace_bytes(jnp.bfloat16, n, lay.grid, lay.capacity, bs, num_sms=sms))
        sms //= 2
    assert capped in reachable
    with pytest.raises(ValueError, match="unknown updat variant"):
        _sm90.updat_workspace_bytes(jnp.bfloat16, n, lay.grid, lay.capacity, bs, variant="stacked")
