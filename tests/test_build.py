"""build.py's plan of compiler commands (--dry-run): nothing is compiled here.

The real compile runs in CI's install; these tests pin what a CPU-only machine gets
(the host compiler alone, one copy of the CPU kernels per instruction set) and that
nvcc is used only for the CUDA half.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("jbs_build_under_test", ROOT / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _commands(build, capsys, *argv):
    assert build.main(["--dry-run", *argv]) == 0
    return [line[2:] for line in capsys.readouterr().out.splitlines() if line.startswith("+ ")]


def test_cpu_only_needs_no_nvcc(build, capsys):
    commands = _commands(build, capsys, "--cpu-only", "--nvcc", "/nonexistent/nvcc")
    assert commands and not any("nvcc" in c.split()[0] for c in commands)
    kernels = [c for c in commands if "bsmm_cpu_kernels.cc" in c]
    isas = {part.split("=", 1)[1] for c in kernels for part in c.split() if part.startswith("-DJBS_CPU_ISA=")}
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert isas == ({"baseline", "avx2", "avx512"} if x86 else {"baseline"})
    assert all("-DJBS_WITH_CUDA" not in c for c in commands)
    assert commands[-1].split()[1] == "-shared"  # linked by the host compiler


def test_with_nvcc_the_cuda_half_uses_nvcc(build, capsys, tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    commands = _commands(build, capsys, "--nvcc", str(fake), "--cuda-arch", "sm_90a")
    cuda = [c for c in commands if c.startswith(str(fake))]
    assert any(".cu " in c and "arch=compute_90a,code=sm_90a" in c for c in cuda)
    assert any("bsmm_cuda_handlers.cc" in c for c in cuda)
    assert any("module.cc" in c and "-DJBS_WITH_CUDA" in c for c in commands)
    assert "-cudart=static" in commands[-1] and commands[-1].startswith(str(fake))


def test_bad_arch_is_a_clear_error(build, capsys):
    assert build.main(["--dry-run", "--cuda-arch", "volta"]) == 2
    assert "expected sm_XY or compute_XY" in capsys.readouterr().err


def _fake_nvcc(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    return fake


def test_hopper_kernels_only_for_sm90a_with_cutlass_headers(build, capsys, tmp_path):
    pytest.importorskip("cutlass_library")
    fake = _fake_nvcc(tmp_path)
    commands = _commands(build, capsys, "--nvcc", str(fake), "--cuda-arch", "sm_80,sm_90a,compute_90")
    include = build.cutlass_include()
    sm90 = [c for c in commands if "/sm90/" in c and " -c " in c]
    names = {c.split(" -c ", 1)[1].split()[0].rsplit("/", 1)[1] for c in sm90}
    assert {"bsmm_sm90_dsd_bf16.cu", "bsmm_sm90_sdd_f16.cu", "bsmm_sm90_dsd_small_bf16.cu",
            "bsmm_sm90_handlers.cc"} <= names
    for c in sm90:
        if c.split(" -c ", 1)[1].split()[0].endswith(".cu"):
            # sm_90a SASS only (wgmma and setmaxnreg exist on no other target), CUTLASS as a system header.
            assert "arch=compute_90a,code=sm_90a" in c and "sm_80" not in c and "compute_90," not in c, c
            assert f"-isystem {include}" in c, c
    # Only the Hopper sources see the CUTLASS headers.
    assert all(include not in c for c in commands if "/sm90/" not in c)
    assert any("module.cc" in c and "-DJBS_WITH_SM90" in c for c in commands)


def test_no_hopper_kernels_without_sm90a(build, capsys, tmp_path):
    fake = _fake_nvcc(tmp_path)
    commands = _commands(build, capsys, "--nvcc", str(fake), "--cuda-arch", "sm_80,compute_90")
    assert not any("/sm90/" in c for c in commands)
    assert not any("-DJBS_WITH_SM90" in c for c in commands)


def test_missing_cutlass_is_a_clear_error(build, capsys, tmp_path, monkeypatch):
    import sys  # noqa: PLC0415

    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # import fails
    fake = _fake_nvcc(tmp_path)
    assert build.main(["--dry-run", "--nvcc", str(fake), "--cuda-arch", "sm_90a"]) == 1
    err = capsys.readouterr().err
    assert "nvidia-cutlass" in err and "sm_90a" in err
