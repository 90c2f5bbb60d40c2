"""``python -m build`` gives an sdist that builds and a platform-tagged wheel that
installs into a fresh virtual environment and works there.

The wheel is built from the sdist (as ``python -m build`` does), with the CPU kernels
only to keep CI fast (the CUDA half is compiled by CI's own install); then installed
with ``--no-index --no-deps`` (nothing is built: a wheel needs no compiler) into a new
venv whose dependencies (jax, flax, ...) come from this interpreter's site-packages
through a path file, so nothing is downloaded. The smoke test runs outside the source
tree: import, one bsmm on the CPU kernels, ``python -m jax_blocksparse``.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _require(dist: str):
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if os.environ.get("JBS_REQUIRE_KERNELS") == "1":
            pytest.fail(f"JBS_REQUIRE_KERNELS=1 but {dist} (test extra) is not installed")
        pytest.skip(f"{dist} is not installed (pip install -e '.[test]')")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDAARCHS", "JBS_SKIP_NATIVE_BUILD")}
    env.update(extra)
    return env


def _run(cmd, cwd, env, timeout=600):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _build_sdist_and_wheel(out: Path) -> tuple[Path, Path]:
    for name in ("build", "scikit-build-core"):
        _require(name)
    # --no-isolation: the build tools are those of the test extra, already here. Their jax is
    # the newest, not the oldest the build system pins (pyproject.toml): --skip-dependency-check
    # lets this wheel, a packaging check, compile against the jaxlib at hand.
    _run(
        [sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", str(out), str(ROOT)],
        cwd=out,
        env=_env(JBS_SKIP_CUDA_BUILD="1"),
    )
    (sdist,) = out.glob("jax_blocksparse-*.tar.gz")
    (wheel,) = out.glob("jax_blocksparse-*.whl")
    return sdist, wheel


def test_python_m_build_in_the_source_tree_is_pypa_build():
    """build.py sits where `python -m build` looks first; it hands over to PyPA's build."""
    _require("build")
    out = _run([sys.executable, "-m", "build", "--version"], cwd=ROOT, env=_env())
    assert out.startswith("build ") and "site-packages" in out, out


def _check_sdist(sdist: Path):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {
        "CMakeLists.txt",
        "cmake/JbsCudaArchitectures.cmake",
        "build.py",
        "pyproject.toml",
        "cuda/module.cc",
        "cuda/cpu/bsmm_cpu_kernels.cc",
        "cuda/sm90/bsmm_sm90_dsd_bf16.cu",
        "jax_blocksparse/crossovers.json",
        "jax_blocksparse/verified_gpu.json",
        "jax_blocksparse/block_sizes.json",
        "tests/test_build.py",
    } <= names
    assert not any(n.endswith((".so", ".o")) for n in names)


def _check_wheel(wheel: Path):
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    tag = wheel.name.removesuffix(".whl").split("-", 2)[2]
    assert tag == f"{py}-{py}-{sysconfig.get_platform().replace('-', '_').replace('.', '_')}", wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert f"jax_blocksparse/_jbs_kernels{sysconfig.get_config_var('EXT_SUFFIX')}" in names
    package = {
        "crossovers.json",
        "verified_gpu.json",
        "block_sizes.json",
        "_jbs_kernels.pyi",
        "__init__.py",
        "ops/__init__.py",
    }
    assert {f"jax_blocksparse/{name}" for name in package} <= names


SMOKE = textwrap.dedent("""
    import sys
    from pathlib import Path

    import jax
    import numpy as np

    import jax_blocksparse as jbs
    from jax_blocksparse import _jbs_kernels, _native

    venv = Path(sys.prefix).resolve()
    for module in (jbs, _jbs_kernels):
        assert Path(module.__file__).resolve().is_relative_to(venv), module.__file__
    assert _native.has_cpu_kernels(), _native.load_error("cpu")
    mask = np.eye(4, dtype=bool) | np.eye(4, k=1, dtype=bool)
    layout = jbs.Layout.from_mask(mask, block_size=8)
    w = jbs.from_dense(jax.random.normal(jax.random.key(0), layout.shape), layout)
    x = jax.random.normal(jax.random.key(1), (5, layout.shape[0]))
    y = jax.jit(lambda x, w: jbs.bsmm(x, w, layout, impl="kernels"))(x, w)
    expected = np.asarray(x, np.float64) @ np.asarray(jbs.to_dense(w, layout), np.float64)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=1e-5, atol=1e-5)
    print("smoke ok")
""")


def test_sdist_and_wheel_build_and_the_wheel_works_in_a_fresh_venv(tmp_path):
    """One test, so that pytest-xdist builds the wheel once."""
    dist = tmp_path / "dist"
    dist.mkdir()
    sdist, wheel = _build_sdist_and_wheel(dist)
    _check_sdist(sdist)
    _check_wheel(wheel)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path, env=_env())
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-index",
            "--no-deps",
            "--only-binary=:all:",
            "--no-compile",
            str(wheel),
        ],
        cwd=tmp_path,
        env=_env(),
    )
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path, env=_env()
        ).strip()
    )
    # The dependencies, from this interpreter: appended to sys.path after the venv's own
    # site-packages (path entries of a .pth file are not scanned for .pth files, so an
    # editable install of this package here stays out of the venv).
    deps = dict.fromkeys(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))
    (site / "_jbs_test_dependencies.pth").write_text("\n".join(deps) + "\n")
    env = _env(JAX_PLATFORMS="cpu")
    assert "smoke ok" in _run([str(python), "-c", SMOKE], cwd=tmp_path, env=env)
    report = _run([str(python), "-m", "jax_blocksparse"], cwd=tmp_path, env=env)
    assert "native extension: built and loaded" in report and "cpu_isa=" in report, report
