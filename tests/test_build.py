"""The CMake build's plan of compiler commands (``build.py --dry-run``): nothing is compiled.

``--dry-run`` configures CMakeLists.txt in a scratch tree and prints the commands the
build would run. These tests pin what a CPU-only machine gets (the host compiler alone,
one copy of the CPU kernels per instruction set), that nvcc compiles only the CUDA
sources, each for the architectures asked for, that the Hopper sources alone see the
CUTLASS headers and compile for sm_90a alone, and how the architectures are chosen when
none is named (nvidia-smi's GPUs, else the CPU kernels and one line on building for a
GPU). The real compile runs in CI's install.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RELEASE = "sm_80,sm_90a,compute_90"


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("jbs_build_under_test", ROOT / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nvcc():
    found = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None
    )
    if found is None:
        if os.environ.get("JBS_REQUIRE_KERNELS") == "1":
            pytest.fail("JBS_REQUIRE_KERNELS=1 but nvcc is not found")
        pytest.skip("nvcc not found")
    return found


def _plan(build, capfd, build_dir, *argv):
    """(compiler/linker commands, everything printed) of a dry run into build_dir."""
    rc = build.main(["--dry-run", "--build-dir", str(build_dir), "--output-dir", str(build_dir / "out"), *argv])
    out, err = capfd.readouterr()
    assert rc == 0, out + err
    return [line[2:] for line in out.splitlines() if line.startswith("+ ")], out + err


def _source(cmd: str) -> str:
    return cmd.split(" -c ", 1)[1].split()[0] if " -c " in cmd else ""


@pytest.fixture(scope="module")
def cpu_tree(tmp_path_factory):
    return tmp_path_factory.mktemp("cpu-tree")


@pytest.fixture(scope="module")
def cuda_tree(tmp_path_factory):
    return tmp_path_factory.mktemp("cuda-tree")


@pytest.fixture
def no_named_archs(monkeypatch):
    monkeypatch.delenv("CUDAARCHS", raising=False)
    for name in ("JBS_SKIP_CUDA_BUILD", "JBS_SKIP_NATIVE_BUILD"):
        monkeypatch.delenv(name, raising=False)


def _fake_nvidia_smi(monkeypatch, tmp_path, script: str):
    """Puts an nvidia-smi first on the PATH that runs ``script`` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + script + "\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_cpu_only_needs_no_nvcc(build, capfd, cpu_tree, no_named_archs):
    commands, _ = _plan(build, capfd, cpu_tree, "--cpu-only")
    assert commands and not any("nvcc" in c.split()[0] for c in commands)
    kernels = [c for c in commands if _source(c).endswith("bsmm_cpu_kernels.cc")]
    isas = {m for c in kernels for m in re.findall(r"-DJBS_CPU_ISA=(\w+)", c)}
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    assert isas == ({"baseline", "avx2", "avx512"} if x86 else {"baseline"})
    assert all("-ffp-contract=fast" in c for c in kernels)
    compiles = [c for c in commands if " -c " in c]
    assert all("-fvisibility=hidden" in c and "-fPIC" in c and "-std=c++17" in c and "-O3" in c for c in compiles)
    assert all("-DNDEBUG" not in c for c in compiles)  # as the extension has always been built
    # Per-file header dependencies, and a compilation database for tools.
    assert all(" -MD " in c or " -MMD " in c for c in compiles)
    assert (cpu_tree / "compile_commands.json").is_file()
    assert all("-DJBS_WITH_CUDA" not in c for c in commands)
    link = commands[-1]
    assert " -shared " in link and "out/_jbs_kernels" in link  # into --output-dir (relative to the tree)
    assert "cudart" not in link
    # The block sizes' one table (jax_blocksparse/block_sizes.json, which Python reads) is
    # the header every translation unit sees (cuda/bsmm_block_sizes.h includes it).
    sizes = ", ".join(map(str, json.loads((ROOT / "jax_blocksparse" / "block_sizes.json").read_text())["block_sizes"]))
    header = (cpu_tree / "generated" / "jbs_block_sizes.h").read_text()
    assert f"#define JBS_BLOCK_SIZES {sizes}\n" in header and f'"{{{sizes}}}"' in header, header
    assert all(f"-I{cpu_tree}/generated" in c for c in compiles)


def test_no_gpu_and_no_arch_builds_the_cpu_kernels_and_says_how_to_build_for_a_gpu(
    build, capfd, cpu_tree, tmp_path, monkeypatch, no_named_archs
):
    _fake_nvidia_smi(monkeypatch, tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    commands, printed = _plan(build, capfd, cpu_tree)
    assert not any("nvcc" in c.split()[0] for c in commands)
    hints = [line for line in printed.splitlines() if "CUDAARCHS" in line]
    assert len(hints) == 1 and "CPU kernels only" in hints[0] and "--cuda-arch" in hints[0], printed


def test_bad_arch_is_a_clear_error(build, capsys):
    assert build.main(["--dry-run", "--cuda-arch", "volta"]) == 2
    assert "expected sm_XY or compute_XY" in capsys.readouterr().err


def test_arch_names_map_to_cmake_architectures(build):
    assert build.cmake_architectures(["sm_80", "sm_90a", "compute_90"]) == "80-real;90a-real;90-virtual"
    with pytest.raises(ValueError, match="--cuda-arch"):
        build.cmake_architectures(["sm_9x"])


def test_ci_names_every_release_architecture(build):
    """CI builds the CUDA kernels for the release set, so a CUDA compile error fails CI."""
    text = (ROOT / ".ci" / "run").read_text()
    match = re.search(r'^export CUDAARCHS="([^"]*)"', text, re.MULTILINE)
    assert match, ".ci/run must export CUDAARCHS"
    assert match.group(1) == build.cmake_architectures(build.RELEASE_ARCHS)
    assert ",".join(build.RELEASE_ARCHS) == RELEASE


def test_cuda_sources_compile_with_nvcc_for_the_architectures_asked(build, capfd, cuda_tree, no_named_archs):
    pytest.importorskip("cutlass_library")
    nvcc = _nvcc()
    commands, _ = _plan(build, capfd, cuda_tree, "--nvcc", nvcc, "--cuda-arch", RELEASE)
    by_source = {_source(c): c for c in commands if _source(c)}
    ampere = [s for s in by_source if s.endswith(".cu") and "/sm90/" not in s]
    hopper = [s for s in by_source if s.endswith(".cu") and "/sm90/" in s]
    assert {Path(s).name for s in ampere} >= {"bsmm_fprop.cu", "bsmm_updat_bf16.cu", "bsmm_prepare.cu"}
    assert {Path(s).name for s in hopper} >= {
        "bsmm_sm90_dsd_bf16.cu",
        "bsmm_sm90_sdd_f16.cu",
        "bsmm_sm90_dsd_small_bf16.cu",
    }
    # Each CUDA compile runs under cmake/ptxas_report.py, which keeps ptxas's -v report.
    launcher = f"{sys.executable} {ROOT / 'cmake' / 'ptxas_report.py'} --record "
    for src in ampere + hopper:
        c = by_source[src]
        assert c.startswith(launcher) and f" -- {nvcc} " in c and "-Xptxas=-v" in c, c
    for src in ampere:
        c = by_source[src]
        assert "-lineinfo" in c and "--expt-relaxed-constexpr" in c, c
        gencode = set(re.findall(r"arch=(compute_\w+),code=\[?(\w+)", c))
        assert gencode == {("compute_80", "sm_80"), ("compute_90a", "sm_90a"), ("compute_90", "compute_90")}, c
    include = Path(__import__("cutlass_library").source_path) / "include"
    for src in hopper:
        c = by_source[src]
        # sm_90a SASS only (wgmma and setmaxnreg exist on no other target), CUTLASS as a system header.
        assert set(re.findall(r"arch=(compute_\w+),code=\[?(\w+)", c)) == {("compute_90a", "sm_90a")}, c
        assert re.search(rf"-isystem[= ]{re.escape(str(include))}", c), c
    assert all(str(include) not in c for s, c in by_source.items() if "/sm90/" not in s)
    # Host code is compiled by the host compiler, the handlers included.
    for name in ("module.cc", "bsmm_cuda_handlers.cc", "bsmm_sm90_handlers.cc", "bsmm_cpu_handlers.cc"):
        (src,) = [s for s in by_source if s.endswith("/" + name)]
        assert not by_source[src].startswith((nvcc, launcher)), by_source[src]
    module = by_source[next(s for s in by_source if s.endswith("/module.cc"))]
    assert "-DJBS_WITH_CUDA" in module and "-DJBS_WITH_SM90" in module
    link = commands[-1]
    assert " -shared " in link and "cudart_static" in link and "libcudart.so" not in link
    info = (cuda_tree / "generated" / "jbs_build_info.h").read_text()
    assert '"sm_80,sm_90a,compute_90"' in info  # build_info()["archs"]


def test_no_hopper_kernels_without_sm90a(build, capfd, cuda_tree, no_named_archs):
    nvcc = _nvcc()
    commands, _ = _plan(build, capfd, cuda_tree, "--nvcc", nvcc, "--cuda-arch", "sm_80,compute_90")
    assert any(_source(c).endswith(".cu") for c in commands)
    assert not any("/sm90/" in c for c in commands)
    assert not any("-DJBS_WITH_SM90" in c for c in commands)


def test_without_a_named_arch_the_gpus_nvidia_smi_reports(
    build, capfd, cuda_tree, tmp_path, monkeypatch, no_named_archs
):
    """9.0 -> sm_90a (the Hopper kernels need it), 8.6 -> sm_86; SASS only."""
    pytest.importorskip("cutlass_library")
    nvcc = _nvcc()
    monkeypatch.setenv("CUDACXX", nvcc)
    _fake_nvidia_smi(monkeypatch, tmp_path, "printf '9.0\\n8.6\\n9.0\\n'")
    commands, _ = _plan(build, capfd, cuda_tree)
    fprop = next(c for c in commands if _source(c).endswith("/bsmm_fprop.cu"))
    assert set(re.findall(r"arch=(compute_\w+),code=\[?(\w+)", fprop)) == {
        ("compute_90a", "sm_90a"),
        ("compute_86", "sm_86"),
    }
    assert any("/sm90/" in c for c in commands)
    assert '"sm_90a,sm_86"' in (cuda_tree / "generated" / "jbs_build_info.h").read_text()


def test_cuda_archs_environment_variable_names_the_architectures(build, capfd, cuda_tree, monkeypatch, no_named_archs):
    nvcc = _nvcc()
    monkeypatch.setenv("CUDACXX", nvcc)
    monkeypatch.setenv("CUDAARCHS", "80-real;90-virtual")
    commands, _ = _plan(build, capfd, cuda_tree)
    fprop = next(c for c in commands if _source(c).endswith("/bsmm_fprop.cu"))
    assert set(re.findall(r"arch=(compute_\w+),code=\[?(\w+)", fprop)) == {
        ("compute_80", "sm_80"),
        ("compute_90", "compute_90"),
    }
    assert not any("/sm90/" in c for c in commands)


def test_missing_cutlass_is_a_clear_error(build, capfd, cuda_tree, tmp_path, monkeypatch, no_named_archs):
    nvcc = _nvcc()
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "cutlass_library.py").write_text("raise ImportError('hidden by the test')\n")
    monkeypatch.setenv("PYTHONPATH", f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rc = build.main(
        [
            "--dry-run",
            "--build-dir",
            str(cuda_tree),
            "--output-dir",
            str(cuda_tree / "out"),
            "--nvcc",
            nvcc,
            "--cuda-arch",
            "sm_90a",
        ]
    )
    out, err = capfd.readouterr()
    assert rc == 1
    text = " ".join((out + err).split())
    assert "nvidia-cutlass" in text and "sm_90a" in text, text
