"""The Hopper (sm_90a) targets in the CUDA lowering, checked without a GPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the 'cuda' lowering
rules (tests/test_cuda_lowering.py). With the Hopper gate open (JAX_BLOCKSPARSE_HOPPER=1;
see jax_blocksparse/ops/_sm90.py) the text must call ``jbs_bsmm_*_sm90`` with the
operands of the portable targets, updat_sm90 with its uint8 workspace result; with the
gate closed, the portable targets only. The workspace size mirrors the C++ work plan.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_cuda_extension

import jax_blocksparse as jbs
from jax_blocksparse.ops import _lowering, _sm90

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
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: None)


def _layout():
    mask = np.zeros(GRID, bool)
    mask[0, 1] = mask[2, 1] = mask[1, 3] = mask[2, 4] = True
    return jbs.Layout.from_mask(mask, BLOCK, capacity=6), int(mask.sum())


def _lower(op, dtype=jnp.bfloat16):
    lay, _ = _layout()
    x = jnp.zeros((N, C), dtype)
    dy = jnp.zeros((N, K), dtype)
    w = jnp.zeros((lay.capacity, BLOCK, BLOCK), dtype)
    fun = {
        "fprop": lambda x, w, dy: jbs.bsmm(x, w, lay),
        "bprop": lambda x, w, dy: jbs.bsmm(dy, w, lay, transpose=True),
        "updat": lambda x, w, dy: jbs.bsmm_updat(x, dy, lay),
    }[op]
    with jbs.config.implementation("kernels"):
        return jax.jit(fun).trace(x, w, dy).lower(lowering_platforms=("cuda",)).as_text()


def _operands(text, target):
    """Operand lists of every call of ``target`` in the StableHLO text."""
    return [m.split(",") for m in re.findall(rf"@{target}\(([^)]*)\)", text)]


def test_targets_registered_with_initialize_stage():
    regs = jbs._native._load()[0].registrations()["CUDA"]
    for target in SM90:
        assert set(regs[target]) == {"initialize", "execute"}, target
    assert set(jbs._native.extension_info()["sm90_targets"]) == set(SM90)


def test_nothing_verified_on_hardware():
    # The gate stays closed for "auto" until tests/gpu/test_bsmm_sm90.py passes on an H100.
    assert not (_lowering.VERIFIED_CUDA_TARGETS & set(SM90))


@pytest.mark.parametrize("op", ["fprop", "bprop", "updat"])
def test_gate_closed_lowers_to_portable_targets(op):
    text = _lower(op)
    assert f"@jbs_bsmm_{op}(" in text
    assert "_sm90" not in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("op", ["fprop", "bprop"])
def test_gate_open_dsd(monkeypatch, op, dtype):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower(op, dtype)
    calls = _operands(text, f"jbs_bsmm_{op}_sm90")
    assert len(calls) == 1, text
    assert len(calls[0]) == 8  # a, w, five tables, order
    assert f"@jbs_bsmm_{op}(" not in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gate_open_updat_has_workspace(monkeypatch, dtype):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    text = _lower("updat", dtype)
    calls = _operands(text, "jbs_bsmm_updat_sm90")
    assert len(calls) == 1 and len(calls[0]) == 7, text  # x, dy, five tables
    lay, _ = _layout()
    ws = _sm90.updat_workspace_bytes(dtype, N, lay.capacity, BLOCK)
    assert ws > 0  # 6 slots and 2 k-steps: the plan splits N
    line = next(l for l in text.splitlines() if "@jbs_bsmm_updat_sm90(" in l)
    assert f"tensor<{ws}xui8>" in line, line
    assert f"tensor<{lay.capacity}x{BLOCK}x{BLOCK}x" in line


def test_gate_requires_sm90_device(monkeypatch):
    monkeypatch.setenv(_sm90.HOPPER_ENV, "1")
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: "8.0")
    assert "_sm90" not in _lower("fprop")
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: "9.0")
    assert "@jbs_bsmm_fprop_sm90(" in _lower("fprop")


def test_verified_target_opens_gate_only_on_sm90(monkeypatch):
    monkeypatch.setattr(_lowering, "VERIFIED_CUDA_TARGETS", frozenset({"jbs_bsmm_fprop_sm90"}))
    assert "_sm90" not in _lower("fprop")  # cross-lowering: only the env var counts
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: "9.0")
    assert "@jbs_bsmm_fprop_sm90(" in _lower("fprop")
    assert "_sm90" not in _lower("bprop")  # not verified


def test_auto_uses_a_verified_hopper_target_on_sm90(monkeypatch):
    lay, _ = _layout()
    x = jnp.zeros((N, C), jnp.bfloat16)
    w = jnp.zeros((lay.capacity, BLOCK, BLOCK), jnp.bfloat16)

    def lower():
        with jbs.config.implementation("auto"):
            return jax.jit(lambda x, w: jbs.bsmm(x, w, lay)).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()

    assert "@jbs_bsmm_fprop" not in lower()  # nothing verified: the reference
    monkeypatch.setattr(_lowering, "VERIFIED_CUDA_TARGETS", frozenset({"jbs_bsmm_fprop_sm90"}))
    assert "@jbs_bsmm_fprop" not in lower()  # no sm_90 device at lowering: still the reference
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: "9.0")
    assert "@jbs_bsmm_fprop_sm90(" in lower()
    monkeypatch.setattr(_sm90, "_cuda_compute_capability", lambda: "8.0")
    assert "@jbs_bsmm_fprop" not in lower()


@pytest.mark.parametrize("bs", [64, 128])
@pytest.mark.parametrize("n", [0, 1, 31, 32, 1000, 4096, 100_000])
@pytest.mark.parametrize("capacity", [1, 5, 64, 263, 264, 265, 1000])
def test_workspace_mirrors_the_work_plan(bs, n, capacity):
    module = jbs._native._load()[0]
    if not hasattr(module, "work_plan_sdd"):
        pytest.skip("extension without the work-plan bindings")
    plan = module.work_plan_sdd(capacity, _sm90.sdd_group(bs), n, _sm90.SDD_TILE_K, _sm90.PLAN_SMS, bs)
    assert _sm90.updat_workspace_bytes(jnp.bfloat16, n, capacity, bs) == plan["workspace_elems"] * 4
    assert _sm90.updat_workspace_bytes(jnp.float32, n, capacity, bs) == 0  # f32 runs the portable kernels
