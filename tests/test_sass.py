"""The built extension's sm_90a machine code, read with cuobjdump (no GPU needed).

* Every Hopper kernel (``jbs::sm90``) that multiplies issues HGMMA (wgmma): a change that
  silently fell back to another instruction would keep the tests green and lose the
  speed.
* No kernel of either path touches local memory (LDL / STL): a spill or a local array in
  a hot loop costs more than any tuning gains.
* The ptxas report kept with the build (``_jbs_kernels.ptxas.json``, shown by
  ``python -m jax_blocksparse --verbose``) names the same sm_90a kernels and agrees:
  no spills.

cuobjdump and the nvdisasm it runs for ``-sass`` come from the test extra's
``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm`` wheels (or the CUDA toolkit).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import jax_blocksparse as jbs
from jax_blocksparse import __main__ as env_report
from jax_blocksparse import _native

# Kernels of the Hopper path that do no matrix product: the split-N reduction of updat's
# float32 partials, and the per-call preparation.
NO_GEMM = re.compile(r"Reduce|Prepare|Zero|Fill")


def _tool_dirs() -> list[str]:
    """Where cuobjdump and nvdisasm may be: the nvidia-* wheels' bin folders, then the PATH."""
    dirs = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations if spec else None) or ():
        dirs += [str(p) for p in sorted(Path(root).glob("cu*/bin")) if (p / "cuobjdump").exists()]
    return dirs


def _require(condition: bool, reason: str):
    if condition:
        return
    if os.environ.get("JBS_REQUIRE_KERNELS") == "1":
        pytest.fail(f"JBS_REQUIRE_KERNELS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def sass() -> dict[str, str]:
    """mangled kernel name -> its sm_90a SASS text."""
    _require(jbs.has_cuda_kernels(), "the extension has no CUDA kernels")
    _require("sm_90a" in _native.extension_info().get("archs", []), "the extension was built without sm_90a")
    path = os.pathsep.join([*_tool_dirs(), os.environ.get("PATH", "")])
    tool = shutil.which("cuobjdump", path=path)
    _require(tool is not None, "cuobjdump not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    out = subprocess.run(
        [tool, "-sass", "-arch", "sm_90a", _native.module().__file__],
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH=path),
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    functions: dict[str, list[str]] = {}
    current = None
    for line in out.stdout.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            current = m.group(1)
            functions.setdefault(current, [])
        elif current is not None:
            functions[current].append(line)
    assert functions, f"no sm_90a function in cuobjdump's output:\n{out.stdout[:2000]}"
    return {name: "\n".join(lines) for name, lines in functions.items()}


def _hopper(name: str) -> bool:
    return "N3jbs4sm90" in name or "3jbs4sm90" in name


def test_every_hopper_kernel_issues_hgmma(sass):
    hopper = [n for n in sass if _hopper(n)]
    assert len(hopper) >= 50, f"only {len(hopper)} sm90 kernels in the sm_90a code"
    gemm = [n for n in hopper if not NO_GEMM.search(n)]
    without = [n for n in gemm if "HGMMA" not in sass[n]]
    assert not without, f"{len(without)} Hopper kernels without HGMMA, e.g. {without[:3]}"


def test_no_kernel_touches_local_memory(sass):
    local = [n for n, text in sass.items() if re.search(r"\b(LDL|STL)\b", text)]
    assert not local, f"{len(local)} of {len(sass)} sm_90a kernels use local memory (LDL/STL), e.g. {local[:3]}"


def test_ptxas_report_agrees(sass):
    report = _native.ptxas_report()
    assert report, "the build kept no ptxas report (_jbs_kernels.ptxas.json beside the module)"
    sm90a = {k["mangled"]: k for k in report if k["arch"] == "sm_90a"}
    assert set(sass) <= set(sm90a), sorted(set(sass) - set(sm90a))[:3]
    for name in sass:
        k = sm90a[name]
        assert k["spill_stores"] == k["spill_loads"] == 0, k
        assert 0 < k["registers"] <= 255, k
    text = env_report.ptxas_lines(report)
    assert text[0].startswith(f"ptxas report: {len(report)} kernels")
