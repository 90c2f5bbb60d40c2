"""Whole training steps through the CUDA kernels, run the way XLA runs real programs.

XLA runs larger jitted programs as CUDA graphs (command buffers): it records the
program's kernels by stream capture, and a custom-call handler that makes a CUDA call
that is illegal during capture (a synchronisation, an allocation, a device-wide
attribute change, an error query of the wrong kind) breaks the capture and the whole
step fails, although every single op works on its own (XLA does not capture one small
op, which is all the kernel tests run). These tests run real training steps (loss,
``jax.grad``, Adam, several block-sparse layers) from ``tests/training_steps.py``:

* a linen MLP of ``BlockSparseDense`` and an NNX MLP of ``BlockSparseLinear``;
* a conv net (``BlockSparseConv``, ``BlockSparseConvTranspose``);
* ``BlockSparseLSTMCell`` and ``BlockSparseMLSTMCell`` stepped by flax's ``nn.RNN``;
* the same cells in the fused ``BlockSparseLSTM``;
* dynamic sparse training with RigL (train steps and layout updates),

each in float32 and bfloat16 mixed precision, 4 steps, on the kernels and on the
pure-JAX reference (see ``training_steps.check`` for what must agree), under two XLA
settings (``training_steps.SETTINGS``):

* ``default``: XLA's own command-buffer settings;
* ``graphs``: ``--xla_gpu_enable_command_buffer=`` every command type the installed
  XLA accepts (``training_steps.command_buffer_types``) and
  ``--xla_gpu_graph_min_graph_size=1``: everything XLA can capture is captured, the
  kernels' custom calls included (their FFI handlers declare themselves command-buffer
  compatible).

XLA reads XLA_FLAGS once, when the backend starts, so each (setting, model) runs in a
child process (``training_steps.run_child``); the child prints a JSON line and the test
asserts on it, showing the child's stderr on failure. A failure of the reference path
alone (an XLA problem under forced graphs, not ours) is reported as xfail.

Precision: the children compile both paths under ``jax.default_matmul_precision("highest")``
(``training_steps.compile_programs``), so float32 means exact float32 there; this module
makes no product itself.

The whole directory skips where there is no GPU (tests/gpu/conftest.py).
"""

from __future__ import annotations

import warnings

import pytest

import jax_blocksparse as jbs
import training_steps as ts

# The recurrent models compile longest: first, so that `-n 8` starts them early.
ORDER = ("rnn_cells", "lstm_fused", "rigl", "conv", "mlp", "mlp_nnx")
CASES = [(setting, model) for model in ORDER for setting in ts.SETTINGS]
CHILD_TIMEOUT_S = 300


@pytest.fixture(scope="module", autouse=True)
def _need_kernels():
    if not jbs.has_cuda_kernels():
        pytest.fail(f"GPU present but the CUDA extension is not loaded: {jbs._native.load_error('cuda')}")


def test_cases_cover_every_model():
    assert sorted(ORDER) == sorted(ts.MODELS)


def test_forced_graphs_cover_the_command_types_that_matter():
    """The "graphs" setting names only types the installed XLA accepts, and at least the
    ones the kernels' programs need: custom calls, fusions, loops (lax.scan)."""
    types = ts.command_buffer_types()
    assert {"CUSTOM_CALL", "FUSION", "WHILE", "CONDITIONAL"} <= set(types), types


def _command_buffer_problems(dtype, result) -> list[str]:
    """Under forced graphs, the kernels' custom calls must sit inside XLA's command
    buffers (else this test exercises no capture). Warns where the compiled HLO shows
    no command buffer at all (an XLA that forms them from thunks, after the HLO)."""
    problems = []
    for program, found in result["command_buffers"].items():
        if found["computations"] == 0:
            warnings.warn(
                f"{result['model']} {dtype} {program}: the compiled HLO shows no command_buffer "
                "computation; cannot tell whether the kernels were captured",
                stacklevel=2,
            )
        elif found["jbs_calls_inside"] == 0:
            problems.append(
                f"{result['model']} {dtype} {program}: XLA formed {found['computations']} command "
                "buffers but none holds a jbs custom call: the kernels were not captured (are the "
                "FFI handlers still registered with kCmdBufferCompatible?)"
            )
    return problems


@pytest.mark.parametrize("setting, model", CASES, ids=[f"{s}-{m}" for s, m in CASES])
def test_training_steps(setting, model):
    child = ts.run_child(model, ts.xla_flags(setting), timeout=CHILD_TIMEOUT_S)
    where = f"[{setting}] {model}"
    assert child.result is not None, f"{where}: the child printed no result (crashed?): {child.describe()}"
    out = child.result
    assert out["platform"] == "gpu", f"{where}: the child ran on {out['platform']!r}, not the GPU: {child.describe()}"
    failures, reference_failures = [], []
    for dtype, result in out["results"].items():
        if "exception" in result:
            line = f"{where} {dtype}: raised in phase {result['phase']!r}: {result['exception']}"
            (reference_failures if result["phase"] in ("build", "reference") else failures).append(line)
            continue
        failures += result["errors"]
        if setting == "graphs":
            failures += _command_buffer_problems(dtype, result)
        print(
            f"{where} {dtype}: step_grad_err={result['step_grad_err']:.3g} loss_err={result['loss_err']:.3g} "
            f"param_err={result['param_err']:.3g} command_buffers={result['command_buffers']} "
            f"seconds={result['seconds']}"
        )
    if failures:
        pytest.fail("\n".join(failures + reference_failures) + "\n" + child.describe(), pytrace=False)
    if reference_failures:
        pytest.xfail(
            "the pure-JAX reference failed under these XLA flags (an XLA problem, not the kernels): "
            + "; ".join(reference_failures)
        )
