"""The training-step builders of tests/training_steps.py, on CPU.

tests/gpu/test_training_steps.py runs every model of ``training_steps`` in float32
and bfloat16 on the CUDA kernels, in child processes under two XLA command-buffer
settings. Here the same builders and the same checks run on the native CPU kernels
against the reference, in process (the bfloat16 cases in a child that keeps every 16-bit
rounding, as the noise floors were measured), so that the builders, the comparison and its
tolerances are verified in CI (each model once, the dtypes alternating, to keep this
quick); plus the pieces of the GPU test that need no GPU: the check flags wrong
results, the command-buffer HLO scan, the command types XLA accepts, and one child process
run end to end (on CPU, under the forced-graphs XLA flags, which jaxlib parses and
validates on every platform).
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import training_steps as ts
from helpers import KEEP_ROUNDINGS_FLAG, require_kernels, rerun_keeping_16bit_roundings, xla_optimizations_off

CASES = [
    ("mlp", "bfloat16"),
    ("mlp_nnx", "float32"),
    ("conv", "bfloat16"),
    ("rnn_cells", "float32"),
    ("lstm_fused", "bfloat16"),
    ("rigl", "float32"),
]


@pytest.fixture
def _cpu_kernels():
    require_kernels("cpu")


def test_cases_cover_every_model_and_dtype():
    assert sorted({m for m, _ in CASES}) == sorted(ts.MODELS)
    assert {d for _, d in CASES} == set(ts.DTYPES)


@pytest.mark.usefixtures("_cpu_kernels")
@pytest.mark.parametrize("model, dtype", CASES)
def test_training_steps_match_reference(model, dtype, request):
    if dtype == "bfloat16" and KEEP_ROUNDINGS_FLAG not in os.environ.get("XLA_FLAGS", "").split():
        # The tolerances are multiples of noise floors measured with every 16-bit rounding
        # kept (bench/training_noise.py's children); XLA:CPU drops some of the reference's
        # by default, so the bfloat16 cases run in a child with the flag, as on the GPU.
        rerun_keeping_16bit_roundings(request)
        return
    with xla_optimizations_off():  # values, not speed: ~2x faster compiles
        result = ts.evaluate(model, dtype)
    assert result["platform"] == "cpu"
    assert ts.check(result) == []
    # Not vacuous: training moved the loss, and the kernels ran every product.
    assert result["losses_reference"][0] != result["losses_reference"][-1]
    assert result["kernels_calls"]["train"] == sorted(ts.CONV_CPU_TARGETS if model == "conv" else ts.TARGETS)
    assert result["command_buffers"]["train"] == {"computations": 0, "jbs_calls_inside": 0}  # CPU: none
    if model == "rigl":
        assert result["layouts_changed"] and result["update_layouts_equal"]


def _passing_result(model="mlp"):
    """A float32 result of ``model`` that passes: every difference half its tolerance."""
    tol = ts.tolerances(model, "float32")
    out = {
        "model": model,
        "dtype": "float32",
        "all_finite": True,
        "losses_kernels": [1.0, 0.9],
        "losses_reference": [1.0, 0.9],
        "expected_calls": {"train": list(ts.TARGETS)},
        "kernels_calls": {"train": sorted(ts.TARGETS)},
        "reference_calls": {"train": []},
    }
    out.update({key: tol[key] / 2 for key in ("step_loss_err", "step_grad_err", "loss_err", "param_err")})
    if model == "rigl":
        out.update(
            layouts_equal=True,
            update_layouts_equal=True,
            layouts_changed=True,
            update_param_diff=tol["update_param_diff"] / 2,
        )
    return out


@pytest.mark.parametrize(
    "model, change, message",
    [
        ("mlp", {"all_finite": False}, "non-finite"),
        ("mlp", {"step_grad_err": float("nan")}, "gradients on the same inputs"),
        ("mlp", {"step_loss_err": 1e-3}, "loss on the same inputs"),
        ("mlp", {"loss_err": 1e-3}, "losses differ"),
        ("mlp", {"param_err": 0.5}, "final params differ"),
        ("mlp", {"kernels_calls": {"train": ["jbs_bsmm_fprop"]}}, "lacks \\['jbs_bsmm_bprop', 'jbs_bsmm_updat'\\]"),
        ("mlp", {"reference_calls": {"train": ["jbs_bsmm_fprop"]}}, "under 'reference' calls"),
        ("rigl", {"update_layouts_equal": False}, "chose different layouts"),
        ("rigl", {"layouts_changed": False}, "changed no layout"),
        ("rigl", {"update_param_diff": 1e-3}, "a layout update on the same inputs moved params differently"),
    ],
)
def test_check_flags_wrong_results(model, change, message):
    assert ts.check(_passing_result(model)) == []
    assert np.isnan(ts._worst([0.1, float("nan"), 0.2]))  # a NaN anywhere is the worst
    errors = ts.check({**_passing_result(model), **change})
    assert len(errors) == 1 and re.search(message, errors[0]), errors


def test_tolerances_cover_every_model_and_dtype():
    for dtype in ts.DTYPES:
        assert sorted(ts.TOLERANCES[dtype]) == sorted(ts.MODELS)
        for model in ts.MODELS:
            quantities = {"step_loss_err", "step_grad_err", "loss_err", "param_err"}
            if model == "rigl":
                quantities.add("update_param_diff")
            assert set(ts.tolerances(model, dtype)) == quantities, (model, dtype)
    with pytest.raises(ValueError, match="model"):
        ts.tolerances("resnet", "float32")
    with pytest.raises(ValueError, match="dtype"):
        ts.tolerances("mlp", "float16")


def test_command_buffer_scan():
    # The shape of XLA's compiled HLO after CommandBufferScheduling: outlined
    # computations named command_buffer*, called from the entry computation.
    hlo = "\n".join(
        [
            "HloModule jit_train_step, is_scheduled=true",
            "",
            "%fused_add (p0: f32[4], p1: f32[4]) -> f32[4] {",
            '  ROOT %x = f32[4]{0} custom-call(%p0), custom_call_target="jax_blocksparse_bsmm_fprop_v1"',
            "}",
            "",
            "%command_buffer (p: f32[4]) -> (f32[4], f32[4]) {",
            "  %p = f32[4]{0} parameter(0)",
            '  %a = f32[4]{0} custom-call(%p), custom_call_target="jax_blocksparse_bsmm_fprop_v1", '
            "api_version=API_VERSION_TYPED_FFI",
            '  %b = f32[4]{0} custom-call(%a), custom_call_target="jax_blocksparse_bsmm_updat_v1", backend_config={}',
            "  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%a, %b)",
            "}",
            "",
            "%command_buffer.1 (p: f32[4]) -> f32[4] {",
            "  ROOT %f = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_add",
            "}",
            "",
            "ENTRY %main.3 (a: f32[4]) -> f32[4] {",
            "  %call = (f32[4]{0}, f32[4]{0}) call(%a), to_apply=%command_buffer",
            '  ROOT %c = f32[4]{0} custom-call(%call), custom_call_target="jax_blocksparse_bsmm_bprop_v1"',
            "}",
        ]
    )
    assert ts.command_buffer_calls(hlo) == {"computations": 2, "jbs_calls_inside": 2}
    assert ts._custom_calls(hlo) == sorted(ts.TARGETS)


def test_accepted_command_types():
    accepted = ts.command_buffer_types()  # probed against this jaxlib: only names it accepts
    assert {"FUSION", "CUSTOM_CALL", "WHILE", "CONDITIONAL"} <= set(accepted), accepted
    assert set(accepted) <= set(ts.KNOWN_COMMAND_BUFFER_TYPES), accepted


@pytest.mark.usefixtures("_cpu_kernels")
def test_child_process_end_to_end():
    """The GPU test's plumbing on CPU: a child under the forced-graphs flags, one model."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = ts.run_child("mlp", ts.xla_flags("graphs"), dtypes=("float32",), steps=2, timeout=300, env=env)
    assert child.returncode == 0 and child.result is not None, child.describe()
    out = child.result
    assert out["platform"] == "cpu" and "--xla_gpu_graph_min_graph_size=1" in out["xla_flags"], out
    # Every child keeps each rounding its program asks for (no excess precision).
    assert KEEP_ROUNDINGS_FLAG in ts.KEEP_ROUNDINGS_FLAGS
    assert set(ts.KEEP_ROUNDINGS_FLAGS) <= set(out["xla_flags"].split()), out["xla_flags"]
    result = out["results"]["float32"]
    assert "exception" not in result and result["errors"] == [], (result, child.describe())
    assert result["steps"] == 2 and np.all(np.isfinite(result["losses_kernels"]))
