"""jax_blocksparse/_jbs_kernels.pyi describes the extension that build.py builds.

Every public function of the module has a stub with the same parameter names (read
from pybind11's signature line), and the stub declares nothing the module lacks; every
key that build_info() returns is declared in the stub's _BuildInfo, and those of
build_info()["sm90"] in its _Sm90Facts.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import require_kernels

STUB = Path(__file__).resolve().parents[1] / "jax_blocksparse" / "_jbs_kernels.pyi"


def _stub_functions() -> dict[str, list[str]]:
    tree = ast.parse(STUB.read_text())
    return {
        node.name: [a.arg for a in node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
    }


def _module_functions(module) -> dict[str, list[str]]:
    found = {}
    for name in dir(module):
        fn = getattr(module, name)
        if name.startswith("_") or not callable(fn):
            continue
        # pybind11 puts "name(arg0: type, arg1: type) -> type" on the docstring's first line.
        signature = (fn.__doc__ or "").splitlines()[0]
        inside = re.match(rf"{name}\((.*)\) ->", signature)
        assert inside, f"{name}: no pybind11 signature line in {fn.__doc__!r}"
        found[name] = [part.split(":")[0].strip() for part in inside.group(1).split(",") if part.strip()]
    return found


def test_stub_matches_the_extension():
    require_kernels("cpu")
    from jax_blocksparse import _jbs_kernels

    stub, module = _stub_functions(), _module_functions(_jbs_kernels)
    assert sorted(stub) == sorted(module), "update jax_blocksparse/_jbs_kernels.pyi"
    for name, params in module.items():
        # Unnamed pybind11 arguments appear as arg0, arg1...: compare the count only.
        if all(re.fullmatch(r"arg\d+", p) for p in params):
            assert len(stub[name]) == len(params), name
        else:
            assert stub[name] == params, name


def _stub_keys(typed_dict: str = "_BuildInfo") -> set[str]:
    tree = ast.parse(STUB.read_text())
    (cls,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == typed_dict)
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}


def test_stub_declares_every_build_info_key():
    require_kernels("cpu")
    from jax_blocksparse import _jbs_kernels

    info = _jbs_kernels.build_info()
    undeclared = set(info) - _stub_keys()
    assert not undeclared, f"declare {sorted(undeclared)} in _BuildInfo of jax_blocksparse/_jbs_kernels.pyi"
    assert {"block_sizes", "sm90"} <= _stub_keys()
    assert set(info["sm90"]) == _stub_keys("_Sm90Facts"), "update _Sm90Facts in jax_blocksparse/_jbs_kernels.pyi"
