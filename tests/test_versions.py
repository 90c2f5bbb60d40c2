"""The supported dependency range: pyproject's lower bounds, the oldest versions CI pins
(.ci/oldest.txt) and the jaxlib the extension is compiled against agree."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import jax
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The extras whose packages the library itself imports (orbax for checkpoints, flatbuffers
# for serialized exports): their lower bounds are supported versions too.
RUNTIME_EXTRAS = ("checkpoint", "export")


def _lower_bounds(requirements) -> dict[str, str]:
    """{name: version} of every requirement's ``>=`` bound; each must have exactly one."""
    bounds = {}
    for text in requirements:
        req = Requirement(text)
        lows = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{text!r}: one lower bound (>=) expected"
        bounds[req.name] = lows[0]
    return bounds


def _pins(path: Path) -> dict[str, str]:
    """{name: version} of a requirements file that pins every line with ``==``."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not an exact pin"
            pins[req.name] = spec.version
    return pins


def _declared() -> dict[str, str]:
    project = PYPROJECT["project"]
    extras = [r for name in RUNTIME_EXTRAS for r in project["optional-dependencies"][name]]
    return _lower_bounds(project["dependencies"] + extras)


def test_oldest_pins_are_the_declared_lower_bounds():
    assert _pins(ROOT / ".ci" / "oldest.txt") == _declared()


def test_extension_is_built_against_the_oldest_jaxlib():
    """The XLA FFI headers the extension is compiled with set the FFI API version of its
    handlers, and a jaxlib refuses handlers newer than its own: compiled against the
    oldest supported jaxlib, the extension registers on every supported one."""
    build = {Requirement(r).name: Requirement(r) for r in PYPROJECT["build-system"]["requires"]}
    declared = _declared()
    for name in ("jax", "jaxlib"):
        assert str(build[name].specifier) == f"=={declared[name]}", (name, str(build[name].specifier))


def test_python_floor_is_the_oldest_jax_floor():
    # jax 0.7 needs Python 3.11 (the wheels' Requires-Python).
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"


def test_installed_versions_are_within_the_declared_range():
    for name, low in _declared().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:  # an extra that is not installed
            continue
        assert Version(installed) >= Version(low), f"{name} {installed} is older than the declared {low}"
    assert Version(jax.__version__) >= Version(_declared()["jax"])
