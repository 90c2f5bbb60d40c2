"""The package's import graph: layers are thin siblings over one core, dependencies point down.

Read from the source with ``ast`` (nothing is imported), every ``import`` statement of
every module of jax_blocksparse, at module level and inside functions:

* ``nnx/`` never imports ``flax.linen`` or ``jax_blocksparse.nn``; ``nn/`` never
  imports ``flax.nnx`` or ``jax_blocksparse.nnx``.
* ``layers/`` (the neutral core) imports no flax, no optax and none of ``nn``,
  ``nnx``, ``training``; ``ops/`` imports none of ``layers``, ``nn``, ``nnx``,
  ``training``, ``sharding`` (ops <- layers <- training).
* Module-level imports between the package's modules form no cycle, and a module
  of a lower level never imports one of a higher level.
* No function imports a ``jax_blocksparse`` module (an import hidden in a function
  is how a cycle gets dodged), except the few in ``ALLOWED_FUNCTION_IMPORTS``.

And, in a fresh interpreter, ``import jax_blocksparse.nn`` loads neither optax nor
``jax_blocksparse.training``, and ``import jax_blocksparse.nnx`` loads no
``jax_blocksparse.training`` and no optax beyond what ``flax.nnx`` itself loads.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

PACKAGE = "jax_blocksparse"
ROOT = pathlib.Path(__file__).resolve().parents[1] / PACKAGE

#: (importing module, imported module) -> why a function-level import is right there.
ALLOWED_FUNCTION_IMPORTS = {
    ("jax_blocksparse._native", "jax_blocksparse._jbs_kernels"): (
        "the compiled extension is optional: loaded (and its FFI targets registered) when the "
        "package is imported, inside a try, since a missing or broken build must leave the package "
        "importable (the reference implementation runs)"
    ),
}

#: Levels, lowest first: a module may import (at module level) only modules of its own
#: level or lower. Modules not named here (the package root, __main__, new top-level
#: modules) are held only to the cycle check and the explicit rules.
LEVELS = {
    "jax_blocksparse.layout": 0,
    "jax_blocksparse.layouts": 0,
    "jax_blocksparse.config": 0,
    "jax_blocksparse.crossover": 0,
    "jax_blocksparse.verified": 0,
    "jax_blocksparse._native": 0,
    "jax_blocksparse.targets": 0,
    "jax_blocksparse.export": 0,
    "jax_blocksparse._jbs_kernels": 0,
    "jax_blocksparse.mixed_precision": 0,
    "jax_blocksparse.ops": 1,
    "jax_blocksparse.tune": 2,
    "jax_blocksparse.sharding": 2,
    "jax_blocksparse.layers": 3,
    "jax_blocksparse.nn": 4,
    "jax_blocksparse.nnx": 4,
    "jax_blocksparse.training": 5,
}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_module(name: str) -> bool:
    """A module of the package: a .py file, or a compiled extension (``_jbs_kernels*.so``)."""
    if name in MODULES:
        return True
    parts = name.split(".")
    return parts[0] == PACKAGE and any(ROOT.joinpath(*parts[1:-1]).glob(f"{parts[-1]}.*.so"))


def _resolve(module: str, node) -> list[str]:
    """The modules an import statement names.

    ``from X import Y`` names X.Y when that is one of the package's modules, else X;
    for another package it names X.Y (``from flax import nnx`` is ``flax.nnx``).
    """
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative import
        package = module if MODULES.get(module, pathlib.Path()).name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if _under(base, PACKAGE):
            names.append(sub if _is_module(sub) else base)
        else:  # another package's name may be a module or an attribute: keep the longer spelling
            names.append(sub)
    return names


def _imports(module: str):
    """[(imported module, in a function?, line)] for every import statement of ``module``."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend((name, in_function, child.lineno) for name in _resolve(module, child))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def _violations(prefix: str, forbidden: tuple[str, ...]):
    return [
        f"{module}:{line} imports {name}"
        for module, found in IMPORTS.items()
        if _under(module, prefix)
        for name, _, line in found
        if any(_under(name, f) for f in forbidden)
    ]


def test_the_walk_sees_the_package():
    assert {
        "jax_blocksparse.nn.dense",
        "jax_blocksparse.nnx.linear",
        "jax_blocksparse.layers.dense",
        "jax_blocksparse.layers.common",
        "jax_blocksparse.ops.recurrence",
        "jax_blocksparse.ops.probe",
    } <= set(MODULES)
    assert any(name == "flax.linen" for name, _, _ in IMPORTS["jax_blocksparse.nn.dense"])
    assert any(name == "flax.nnx" for name, _, _ in IMPORTS["jax_blocksparse.nnx.linear"])


@pytest.mark.parametrize(
    "prefix, forbidden",
    [
        ("jax_blocksparse.nnx", ("flax.linen", "jax_blocksparse.nn", "jax_blocksparse.training", "optax")),
        ("jax_blocksparse.nn", ("flax.nnx", "jax_blocksparse.nnx", "jax_blocksparse.training", "optax")),
        (
            "jax_blocksparse.layers",
            ("flax", "optax", "jax_blocksparse.nn", "jax_blocksparse.nnx", "jax_blocksparse.training"),
        ),
        (
            "jax_blocksparse.ops",
            (
                "flax",
                "optax",
                "jax_blocksparse.layers",
                "jax_blocksparse.nn",
                "jax_blocksparse.nnx",
                "jax_blocksparse.training",
                "jax_blocksparse.sharding",
            ),
        ),
        (
            "jax_blocksparse.mixed_precision",
            ("flax", "jax_blocksparse.nn", "jax_blocksparse.nnx", "jax_blocksparse.training", "jax_blocksparse.layers"),
        ),
    ],
)
def test_package_does_not_import(prefix, forbidden):
    # "from flax import nnx" resolves to flax.nnx (a module), so both spellings are caught.
    assert _violations(prefix, forbidden) == []


def _level(name: str):
    best = None
    for prefix, level in LEVELS.items():
        if _under(name, prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, level)
    return None if best is None else best[1]


def test_dependencies_point_down():
    bad = []
    for module, found in IMPORTS.items():
        mine = _level(module)
        for name, _in_function, line in found:
            theirs = _level(name)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{module} (level {mine}):{line} imports {name} (level {theirs})")
    assert bad == []


def test_no_import_cycle():
    edges = {
        module: {
            name
            for name, in_function, _ in found
            if not in_function and name in MODULES and name != module and not module.startswith(name + ".")
        }
        for module, found in IMPORTS.items()
    }
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert cycles == []


def test_no_function_level_import_of_the_package():
    hidden = [
        f"{module}:{line} imports {name} inside a function"
        for module, found in IMPORTS.items()
        for name, in_function, line in found
        if in_function and _under(name, PACKAGE) and (module, name) not in ALLOWED_FUNCTION_IMPORTS
    ]
    assert hidden == []
    for (module, name), reason in ALLOWED_FUNCTION_IMPORTS.items():
        assert (name, True) in {(n, f) for n, f, _ in IMPORTS[module]}, f"stale allow-list entry {module} -> {name}"
        assert reason


def _loaded_after(code: str) -> set[str]:
    script = textwrap.dedent(code) + "\nimport sys\nprint('\\n'.join(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT.parent, check=True
    )
    return set(out.stdout.split())


def test_importing_the_layers_loads_no_training_and_no_optax():
    linen = _loaded_after("import jax_blocksparse.nn")
    assert "jax_blocksparse.nn" in linen
    assert "optax" not in linen
    assert not {m for m in linen if _under(m, "jax_blocksparse.training") or _under(m, "jax_blocksparse.nnx")}

    both = _loaded_after("import jax_blocksparse.nn; import jax_blocksparse.nnx")
    assert not {m for m in both if _under(m, "jax_blocksparse.training")}
    # flax.nnx imports optax itself (nnx.Optimizer); the layers add nothing of it.
    flax_nnx = _loaded_after("from flax import nnx")
    assert {m for m in both if _under(m, "optax")} <= {m for m in flax_nnx if _under(m, "optax")}


def test_importing_every_submodule_keeps_the_exported_functions():
    """A package attribute shared with a submodule's name (a function ``f`` exported by
    a package that also holds a module ``f.py``) must stay the function after every
    submodule is imported, as doctest collection and Sphinx do."""
    import importlib
    import pkgutil

    import jax_blocksparse

    for info in pkgutil.walk_packages(jax_blocksparse.__path__, "jax_blocksparse."):
        if not info.name.split(".")[-1].startswith("_jbs"):
            importlib.import_module(info.name)
    for package in (
        "jax_blocksparse",
        "jax_blocksparse.training",
        "jax_blocksparse.ops",
        "jax_blocksparse.nn",
        "jax_blocksparse.nnx",
        "jax_blocksparse.layers",
    ):
        module = importlib.import_module(package)
        clobbered = [
            n
            for n in getattr(module, "__all__", ())
            if type(getattr(module, n, None)).__name__ == "module"
            and n
            not in (
                "attention",
                "config",
                "crossover",
                "export",
                "layers",
                "layouts",
                "mixed_precision",
                "moe",
                "nn",
                "nnx",
                "sharding",
                "targets",
                "training",
            )
        ]
        assert not clobbered, f"{package}: {clobbered} became modules"
