"""The CUDA handlers are safe inside CUDA graphs (XLA's command buffers), checked without a GPU.

XLA records larger jitted programs into CUDA graphs by stream capture and calls a
command-buffer-compatible handler's execute stage while capturing; any per-device setup
call there (module loading, ``cudaFuncSetAttribute``, ``cudaSetDevice``) fails the whole
program. The handlers therefore prepare every kernel in their initialize stage
(cuda/bsmm_cuda_handlers.cc). Here: that stage is registered for every CUDA target, and
the sources keep each capture-unsafe call inside a marked preparation region, reached
only through ``Launch::prepare_only``. tests/gpu/test_training_steps.py runs real
training steps through the kernels with graphs on, on a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import require_kernels
from jax_blocksparse import _native, targets

CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"
TARGETS = ("jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat")

# CUDA runtime calls allowed on the execute path, i.e. during stream capture.
CAPTURE_SAFE = {
    "cudaGetLastError",  # reads this thread's last error
    "cudaGetErrorString",
    "cudaGetDevice",  # the thread's current device (no context work)
    "cudaStreamIsCapturing",  # made to be called during capture
    "cudaRuntimeGetVersion",  # build facts for the Python module, never in a handler
}
# Calls that are illegal (or may load modules) during capture: preparation regions only.
PREPARATION_ONLY = {"cudaFuncGetAttributes", "cudaFuncSetAttribute", "cudaSetDevice", "cudaStreamGetDevice"}
CALL = re.compile(r"\b(cuda[A-Z]\w*)\s*\(")
BEGIN, END = "// capture-unsafe: begin", "// capture-unsafe: end"


def _cuda_sources():
    # Every directory under cuda/ (the Hopper kernels live in cuda/sm90/).
    files = [p for ext in ("*.cc", "*.cu", "*.cuh", "*.h") for p in CUDA_DIR.rglob(ext)]
    assert files, f"no CUDA sources under {CUDA_DIR}"
    return sorted(files)


def _calls_outside_preparation(text: str):
    """(line number, call) of every cuda* call outside the marked regions."""
    found, inside = [], False
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped == BEGIN:
            assert not inside, f"nested {BEGIN} at line {number}"
            inside = True
        elif stripped == END:
            assert inside, f"{END} without a begin at line {number}"
            inside = False
        elif not inside:
            code = line.split("//", 1)[0]
            found += [(number, call) for call in CALL.findall(code)]
    assert not inside, "unterminated capture-unsafe region"
    return found


@pytest.mark.parametrize("path", _cuda_sources(), ids=lambda p: p.name)
def test_capture_unsafe_calls_only_in_preparation_regions(path):
    for number, call in _calls_outside_preparation(path.read_text()):
        assert call in CAPTURE_SAFE, (
            f"{path.name}:{number}: {call} outside a '{BEGIN}' region; the execute stage runs "
            "during CUDA-graph capture, so only these calls may run there: " + ", ".join(sorted(CAPTURE_SAFE))
        )


def test_every_preparation_call_is_marked():
    """The regions hold what they claim: each preparation-only call sits in one."""
    seen = set()
    for path in _cuda_sources():
        text = path.read_text()
        for region in re.findall(re.escape(BEGIN) + r"(.*?)" + re.escape(END), text, re.S):
            seen.update(CALL.findall(region))
    assert PREPARATION_ONLY <= seen | CAPTURE_SAFE, PREPARATION_ONLY - seen


def test_launchers_prepare_instead_of_launching():
    """A launcher reaches PrepareKernel only under Launch::prepare_only (never on a launch)."""
    for path in _cuda_sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "PrepareKernel(" in line and "inline cudaError_t PrepareKernel" not in line:
                assert line.strip().startswith("if (launch.prepare_only) return PrepareKernel("), (path.name, number)


def test_handlers_register_an_initialize_stage():
    require_kernels("cuda")
    registrations = _native._load()[0].registrations()
    for target in map(targets.target_name, TARGETS):
        stages = registrations["CUDA"][target]
        assert isinstance(stages, dict) and set(stages) == {"initialize", "execute"}, (target, stages)
        assert stages["initialize"] is not stages["execute"]


def test_hopper_handlers_register_an_initialize_stage():
    require_kernels("cuda")
    registrations = _native._load()[0].registrations()["CUDA"]
    hopper = [targets.target_name(t + "_sm90") for t in TARGETS]
    if not any(t in registrations for t in hopper):
        pytest.skip("extension built without sm_90a")
    for target in hopper:
        stages = registrations[target]
        assert isinstance(stages, dict) and set(stages) == {"initialize", "execute"}, (target, stages)


def test_sources_cover_the_hopper_kernels():
    names = {p.relative_to(CUDA_DIR).as_posix() for p in _cuda_sources()}
    assert {"sm90/bsmm_sm90_handlers.cc", "sm90/bsmm_sm90_dsd.cuh", "sm90/bsmm_sm90_sdd.cuh"} <= names
