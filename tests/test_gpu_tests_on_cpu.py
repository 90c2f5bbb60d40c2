"""What a CPU can check of tests/gpu, whose tests themselves skip without a GPU.

* Every product in tests/gpu states its precision. tests/conftest.py pins HIGHEST for
  the rest of the suite but skips tests/gpu, and on a GPU JAX's float32 default is TF32
  (on the Hopper targets the precision even picks the kernel), so a GPU test that leaves
  it to the default does not test what it says. The rule, checked on the source with
  :mod:`ast`: each call of a product (a library op, a ``jnp``/``lax`` product, or a
  tests/gpu helper with a ``precision`` parameter) passes ``precision=`` as a keyword,
  not None, or sits lexically inside ``with jax.default_matmul_precision(p)`` with ``p``
  other than None. The rule holds for 16-bit calls too: it stays simple, and a
  reader need not work out operand dtypes. Not covered: the ``@`` operator (the oracles
  there are float64 numpy) and products reached through a function passed as a value.
* The GPU test modules import, and their pure helpers work where they can run on CPU:
  the float64 oracles against the CPU kernels on empty and padded layouts, and the error
  measure of the TF32 tests on an empty result (updat of an empty layout is [0, bs, bs]).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import require_kernels

GPU_TESTS = Path(__file__).resolve().parent / "gpu"
GPU_MODULES = ("test_bsmm_kernels", "test_bsconv_kernels", "test_bsmm_sm90", "test_training_steps")
# Functions with a ``precision`` parameter that is not a product's (it formats numbers).
NOT_PRODUCTS = frozenset({"array_repr", "array_str"})
# Roots of calls that are never JAX products (numpy takes no precision).
NUMPY_ROOTS = frozenset({"np", "numpy"})


def _takes_precision(obj) -> bool:
    if not callable(obj) or inspect.isclass(obj):
        return False
    try:
        return "precision" in inspect.signature(obj).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def library_products() -> frozenset[str]:
    """Names of the public functions of jax_blocksparse, jnp and lax that take ``precision``
    (read from their signatures, so that a new op is covered without editing this file)."""
    names = set()
    for module in (jbs, jbs.ops, jbs.attention, jnp, jnp.linalg, jax.lax):
        names |= {n for n in dir(module) if not n.startswith("_") and _takes_precision(getattr(module, n))}
    return frozenset(names - NOT_PRODUCTS)


def helpers_taking_precision(trees) -> frozenset[str]:
    """Names of the functions defined in ``trees`` (parsed modules) with a ``precision`` parameter."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                params = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(a.arg == "precision" for a in params):
                    names.add(node.name)
    return frozenset(names)


def _callee(call: ast.Call) -> str | None:
    """The called name (``f`` of ``f(...)``, ``g`` of ``a.b.g(...)``), None for numpy calls."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id
    if not isinstance(func, ast.Attribute):
        return None
    root = func.value
    while isinstance(root, ast.Attribute):
        root = root.value
    if isinstance(root, ast.Name) and root.id in NUMPY_ROOTS:
        return None
    return func.attr


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _states_precision(call: ast.Call) -> bool:
    return any(k.arg == "precision" and not _is_none(k.value) for k in call.keywords)


def _pins_precision(expr) -> bool:
    """``jax.default_matmul_precision(p)`` with ``p`` given and not None."""
    return (
        isinstance(expr, ast.Call)
        and _callee(expr) == "default_matmul_precision"
        and bool(expr.args or expr.keywords)
        and not any(_is_none(a) for a in [*expr.args, *(k.value for k in expr.keywords)])
    )


def unstated_precisions(tree: ast.AST, products: frozenset[str], filename: str = "<source>") -> list[str]:
    """``file:line: call`` of every product call in ``tree`` that states no precision and is
    not inside a ``default_matmul_precision`` block."""
    found = []

    def visit(node, pinned: bool):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            inside = pinned or any(_pins_precision(item.context_expr) for item in node.items)
            for item in node.items:
                visit(item.context_expr, pinned)
            for stmt in node.body:
                visit(stmt, inside)
            return
        if isinstance(node, ast.Call) and not pinned and _callee(node) in products and not _states_precision(node):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:100]}")
        for child in ast.iter_child_nodes(node):
            visit(child, pinned)

    visit(tree, False)
    return found


def _gpu_trees() -> dict[str, ast.Module]:
    files = sorted(GPU_TESTS.glob("*.py"))
    assert {f"{m}.py" for m in GPU_MODULES} <= {f.name for f in files}
    return {f.name: ast.parse(f.read_text(), str(f)) for f in files}


def _products(trees) -> frozenset[str]:
    return library_products() | helpers_taking_precision(trees)


def test_product_names_cover_the_ops_and_oracles():
    products = library_products()
    expected = {
        "bsmm",
        "bsmm_updat",
        "bsconv",
        "bsconv_transpose",
        "dot",
        "einsum",
        "matmul",
        "dot_general",
        "conv_general_dilated",
        "tensordot",
        "blocksparse_attention",
    }
    assert expected <= products, sorted(expected - products)
    assert not NOT_PRODUCTS & products


def test_every_gpu_product_states_its_precision():
    trees = _gpu_trees()
    products = _products(trees.values())
    # The helpers that run the ops take the precision from their callers.
    assert {"_run", "_run_f32", "_lowers_to_sm90"} <= products
    problems = [p for name, tree in trees.items() for p in unstated_precisions(tree, products, f"tests/gpu/{name}")]
    assert not problems, "products in tests/gpu that leave the precision to JAX's default (TF32 on a GPU):\n" + (
        "\n".join(problems)
    )


def test_the_rule_sees_the_gpu_products():
    # Not vacuous: the scan finds the calls it checks (with precision= stated) in each file.
    trees = _gpu_trees()
    products = _products(trees.values())
    counts = {}
    for name, tree in trees.items():
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in products]
        counts[name] = sum(_states_precision(c) for c in calls)
    assert counts["test_bsmm_kernels.py"] >= 10 and counts["test_bsmm_sm90.py"] >= 20, counts
    assert counts["test_bsconv_kernels.py"] >= 3, counts


_HELPER = "def _go(x, *, precision):\n    return jbs.bsmm(x, w, l, precision=precision)\n"
RULE_CASES = {
    "bare op": ("jbs.bsmm(x, w, layout)", 1),
    "stated": ('jbs.bsmm(x, w, layout, precision="highest")', 0),
    "stated None": ("jbs.bsmm_updat(x, dy, layout, precision=None)", 1),
    "jnp oracle": ("jnp.einsum('ij,jk->ik', a, b)", 1),
    "numpy oracle": ("np.dot(a, b) + numpy.matmul(a, b)", 0),
    "lax inside a lambda": ("jax.jit(lambda a, b: lax.dot_general(a, b, dims))(a, b)", 1),
    "pinned block": ('with jax.default_matmul_precision("default"):\n    jnp.dot(a, b)\n    jbs.bsconv(x, w, l)', 0),
    "pinned to None": ("with jax.default_matmul_precision(None):\n    jnp.dot(a, b)", 1),
    "after the block": ('with jax.default_matmul_precision("highest"):\n    pass\njnp.matmul(a, b)', 1),
    "other context": ('with jbs.config.implementation("kernels"):\n    jbs.bsmm(x, w, l)', 1),
    "helper": (_HELPER + "_go(x)", 1),
    "helper stated": (_HELPER + '_go(x, precision="high")', 0),
    "helper positional": (_HELPER.replace("*, ", "") + '_go(x, "high")', 1),  # the rule wants the keyword
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_the_rule(case):
    source, expected = RULE_CASES[case]
    tree = ast.parse(source)
    assert len(unstated_precisions(tree, _products([tree]))) == expected, source


# ---------------------------------------------------------------------------------
# The GPU test modules import; their pure helpers run on CPU
# ---------------------------------------------------------------------------------


def _gpu_module(name):
    # tests/ is on sys.path (as for `helpers`), tests/gpu is the package `gpu`: the name
    # pytest gives these modules when it collects them.
    return importlib.import_module(f"gpu.{name}")


@pytest.mark.parametrize("name", GPU_MODULES)
def test_gpu_modules_import(name):
    assert _gpu_module(name).__file__ == str(GPU_TESTS / f"{name}.py")


def test_rel_err_of_an_empty_result():
    sm90 = _gpu_module("test_bsmm_sm90")
    empty = np.zeros((0, 64, 64))
    assert sm90._rel_err(empty, empty) == 0.0
    assert sm90._rel_err(np.zeros((3, 4)), np.zeros((3, 4))) == 0.0
    assert sm90._rel_err(np.full((2, 2), 0.5), np.zeros((2, 2))) == 0.5  # all-zero oracle: max |got|
    assert sm90._rel_err(np.array([1.0, 2.1]), np.array([1.0, 2.0])) == pytest.approx(0.05)
    with pytest.raises(AssertionError, match="non-finite"):
        sm90._rel_err(np.array([np.nan]), np.array([1.0]))
    with pytest.raises(AssertionError):
        sm90._rel_err(np.zeros((0, 8, 8)), np.zeros((1, 8, 8)))


@pytest.mark.parametrize("bs", (8, 64))
@pytest.mark.parametrize("kind", ("empty", "padded"))
def test_gpu_oracles_against_the_cpu_kernels(kind, bs):
    """The helpers of tests/gpu run as written on the CPU kernels: the float64 oracles match
    them (shapes of empty layouts, NaN padding blocks and garbage padding entries
    included), and the TF32 tests' error measure is 0 for an empty result."""
    require_kernels("cpu")
    kernels, sm90 = _gpu_module("test_bsmm_kernels"), _gpu_module("test_bsmm_sm90")
    mask, layout = kernels._layout(kind, bs)
    for op in kernels.OPS:
        got, want, length = kernels._run(op, layout, mask, jnp.float32, (3, 43), precision="highest")
        kernels._check(got, want, jnp.float32, length)
        got, want, _ = sm90._run_f32(op, layout, mask, (3, 43), precision="highest")
        err = sm90._rel_err(got, want)
        assert err <= 1e-5, (op, err)
        if kind == "empty" and op == "updat":
            assert got.shape == (0, bs, bs) and err == 0.0
