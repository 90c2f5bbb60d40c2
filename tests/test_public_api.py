"""The examples and benchmarks use the public API only.

Read from the source with ``ast`` (nothing runs): no script of ``examples/`` or ``bench/``
imports a private module of the package (``jax_blocksparse.ops._lowering``), imports a
private name from it (``from jax_blocksparse.ops import _sm90``), or reaches one through
an attribute (``jbs._native.extension_info``, ``jbs.ops._lowering``). What such a script
needs is made public instead (e.g. :mod:`jax_blocksparse.ops.paths`). Dunder names
(``jbs.__version__``) are public.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "jax_blocksparse"
SCRIPTS = sorted([*ROOT.glob("examples/*.py"), *ROOT.glob("bench/*.py")])


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_part(dotted: str) -> str | None:
    return next((part for part in dotted.split(".") if _private(part)), None)


def private_uses(source: str, filename: str = "<script>") -> list[str]:
    """``"line: what"`` for every private part of the package that ``source`` reaches."""
    tree = ast.parse(source, filename=filename)
    bound = set()  # local names that refer to the package or one of its modules or names
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                    if _private_part(alias.name):
                        found.append(f"{node.lineno}: import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE or node.module.startswith(PACKAGE + "."):
                for alias in node.names:
                    dotted = f"{node.module}.{alias.name}"
                    if _private_part(dotted):
                        found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                    bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_the_scripts_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in SCRIPTS}
    assert {"examples/quickstart.py", "bench/train_step.py", "bench/bsmm.py"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_script_uses_the_public_api_only(path):
    assert private_uses(path.read_text(), str(path)) == []


def test_the_check_sees_every_spelling():
    source = "\n".join(
        [
            "import jax_blocksparse as jbs",
            "import jax_blocksparse.ops._lowering",
            "from jax_blocksparse.ops._lowering import describe_path",
            "from jax_blocksparse.ops import _sm90",
            "from jax_blocksparse.ops import paths",
            "from jax_blocksparse import ops as o",
            "jbs._native.extension_info()",
            "jbs.ops._lowering.describe_path('cpu', 'auto')",
            "paths._lowering",
            "o._sm90.HOPPER_ENV",
            "print(jbs.__version__, jbs.ops.paths.describe_path())",
            "other._private",
        ]
    )
    assert private_uses(source) == [
        "2: import jax_blocksparse.ops._lowering",
        "3: from jax_blocksparse.ops._lowering import describe_path",
        "4: from jax_blocksparse.ops import _sm90",
        "7: jbs._native",
        "8: jbs.ops._lowering",
        "9: paths._lowering",
        "10: o._sm90",
    ]


# ---------------------------------------------------------------------------------
# jax_blocksparse.ops.paths answers as the lowering decides
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["auto", "reference", "kernels", "dense"])
def test_paths_agree_with_the_lowering_on_cpu(impl):
    import jax
    import jax.numpy as jnp

    import jax_blocksparse as jbs
    from jax_blocksparse.ops import paths

    if impl == "kernels" and not jbs.has_cpu_kernels():
        with pytest.raises(RuntimeError, match="kernels"):
            paths.kernels_selected("cpu", impl)
        return
    layout = jbs.Layout.from_mask(jbs.layouts.banded((8, 8), 0), 8)  # 8 of 64 blocks
    x, w = jnp.ones((4, 64)), jnp.ones(layout.w_shape)
    text = jax.jit(lambda x, w: jbs.bsmm(x, w, layout, impl=impl)).lower(x, w).as_text()
    assert ("jax_blocksparse_bsmm_fprop" in text) == paths.kernels_selected("cpu", impl, "jbs_bsmm_fprop")
    assert paths.kernels_selected("cpu", impl) == (impl in ("auto", "kernels") and jbs.has_cpu_kernels())
    with jbs.config.implementation(impl):
        assert paths.kernels_selected("cpu") == paths.kernels_selected("cpu", impl)
        assert paths.describe_path("cpu") == paths.describe_path("cpu", impl)
    if impl in ("reference", "dense"):
        assert paths.describe_path("cpu", impl).startswith({"reference": "pure-JAX reference", "dense": "dense"}[impl])


def test_paths_arguments():
    from jax_blocksparse.ops import paths

    assert paths.lowering_platform("gpu") == "cuda" and paths.lowering_platform("cpu") == "cpu"
    assert paths.describe_path("gpu", "reference") == paths.describe_path("cuda", "reference")
    assert paths.kernels_selected("tpu", "auto") is False  # no kernel lowering there
    assert set(paths.KERNELS) == {"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"}
    with pytest.raises(ValueError, match="kernel must be"):
        paths.kernels_selected("cpu", "auto", "jbs_bsmm_nope")
    with pytest.raises(ValueError, match="impl"):
        paths.kernels_selected("cpu", "fast")
    with pytest.raises(TypeError, match="platform"):
        paths.describe_path(3)
    assert paths.HOPPER_ENV == "JAX_BLOCKSPARSE_HOPPER"
    assert isinstance(paths.hopper_available(), bool)
