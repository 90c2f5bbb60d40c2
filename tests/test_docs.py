"""The documentation builds and covers the public API; its examples are collected.

* The Sphinx build (``docs/``: API reference from the docstrings, user guide) runs with
  warnings as errors, as ``python -m sphinx -W --keep-going -b html docs OUT``.
* Every name a public module exports (``__all__``) has an entry in the built reference.
* The examples themselves run elsewhere in the same ``pytest`` run: pyproject's pytest
  options collect every docstring example of the package (``--doctest-modules``) and
  every ``>>>`` example of ``docs/**/*.rst`` (``--doctest-glob=*.rst``); checked here
  so that dropping those options fails.

Sphinx is in the ``test`` extra. Without it these tests skip, unless
``JBS_REQUIRE_TOOLS=1`` (CI sets it): then they fail.
"""

import importlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Module -> the page that documents it, and the exported names documented elsewhere.
API_PAGES = {
    "jax_blocksparse": ("api/jax_blocksparse.html", set()),
    "jax_blocksparse.layouts": ("api/layouts.html", set()),
    "jax_blocksparse.config": ("api/config.html", set()),
    "jax_blocksparse.crossover": ("api/crossover.html", set()),
    "jax_blocksparse.verified": ("api/verified.html", set()),
    "jax_blocksparse.tune": ("api/tune.html", set()),
    "jax_blocksparse.export": ("api/export.html", set()),
    "jax_blocksparse.targets": ("api/targets.html", set()),
    "jax_blocksparse.sharding": ("api/sharding.html", set()),
    # The sparsify reports they re-export are documented with the core that defines them.
    "jax_blocksparse.nn": ("api/nn.html", {"LayerReport", "SparsifyReport"}),
    "jax_blocksparse.nnx": ("api/nnx.html", {"LayerReport", "SparsifyReport"}),
    # StaticMask is documented where jax_blocksparse.nn re-exports it.
    "jax_blocksparse.layers.common": ("api/layers.html", {"StaticMask"}),
    "jax_blocksparse.layers.dense": ("api/layers.html", set()),
    "jax_blocksparse.layers.conv": ("api/layers.html", set()),
    "jax_blocksparse.layers.parallel": ("api/layers.html", set()),
    "jax_blocksparse.layers.recurrent": ("api/layers.html", set()),
    "jax_blocksparse.layers.sparsify": ("api/layers.html", set()),
    "jax_blocksparse.ops.recurrence": ("api/ops.html", set()),
    "jax_blocksparse.ops.paths": ("api/ops.html", set()),
    "jax_blocksparse.ops.probe": ("api/ops.html", set()),
    # Re-exports documented where they are defined: jax_blocksparse.ops.probe.
    "jax_blocksparse.training": ("api/training.html", {"ProbedLayout", "probe_product", "unwrap"}),
    "jax_blocksparse.mixed_precision": ("api/mixed_precision.html", set()),
    # jbs.attention is the module jax_blocksparse.ops.attention; the block masks it re-exports
    # are documented there, under the public name.
    "jax_blocksparse.ops.attention": ("api/attention.html", set()),
    "jax_blocksparse.ops.block_mask": (
        "api/attention.html",
        {"BlockMask", "block_mask_from_segments", "create_block_mask"},
    ),
    "jax_blocksparse.ops.attention_layout": ("api/attention.html", set()),
    "jax_blocksparse.layers.attention": ("api/layers.html", set()),
    "jax_blocksparse.layers.general": ("api/layers.html", set()),
    # jbs.moe is the module jax_blocksparse.ops.moe; the layers' core is on the same page.
    "jax_blocksparse.ops.moe": ("api/moe.html", set()),
    "jax_blocksparse.layers.moe": ("api/moe.html", set()),
}


def _exports(module) -> list:
    """``module.__all__``, else its public functions and classes (those autodoc documents);
    submodules left out (each has a page of its own, see test_every_public_module_has_a_page)."""
    if hasattr(module, "__all__"):
        names = list(module.__all__)
    else:
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_") and callable(value) and getattr(value, "__module__", None) == module.__name__
        ]
    return [name for name in names if not isinstance(getattr(module, name, None), types.ModuleType)]


def _require_sphinx():
    # The build needs the theme and matplotlib (the figures) beside sphinx.
    missing = [name for name in ("sphinx", "sphinx_book_theme", "matplotlib") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    reason = f'{", ".join(missing)} not installed (pip install -e ".[test]" installs them)'
    if os.environ.get("JBS_REQUIRE_TOOLS") == "1":
        pytest.fail(f"JBS_REQUIRE_TOOLS=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def html(tmp_path_factory):
    """Builds the HTML docs once (warnings are errors); returns the output directory."""
    _require_sphinx()
    out = tmp_path_factory.mktemp("docs")
    command = [
        sys.executable,
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-q",
        "-b",
        "html",
        "-d",
        str(out / "doctrees"),
        str(DOCS),
        str(out / "html"),
    ]
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # autodoc imports jax; a GPU may be shared
    build = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert build.returncode == 0, (
        f"the docs build failed (exit {build.returncode}); every warning is an error:\n"
        f"{' '.join(command)}\n{build.stdout[-8000:]}\n{build.stderr[-8000:]}"
    )
    return out / "html"


def test_docs_build_without_warnings(html):
    for page in ["index.html", "guide/index.html", "api/index.html"] + sorted({p for p, _ in API_PAGES.values()}):
        assert (html / page).is_file(), f"the docs build wrote no {page}"


#: The guide page that places each figure of docs/_plots.py, where not the performance guide.
FIGURE_PAGES = {"sparse-training-accuracy": "sparse_training"}


def test_the_guides_show_the_benchmark_figures(html, tmp_path):
    # Drawn at build time from bench/results/ (docs/_plots.py): each whose results are
    # committed (the GPU one only after a GPU session), none of the others.
    sys.path.insert(0, str(DOCS))
    try:
        import _plots
    finally:
        sys.path.remove(str(DOCS))
    drawn = {name for name, path in _plots.write_all(tmp_path).items() if path is not None}
    assert set(FIGURE_PAGES) <= set(_plots.FIGURES)
    for name in _plots.FIGURES:
        page_name = f"{FIGURE_PAGES.get(name, 'performance')}.html"
        page = (html / "guide" / page_name).read_text(encoding="utf-8")
        shown = f'src="../_images/{name}.png"' in page
        assert shown == (name in drawn), f"{page_name} {'lacks' if name in drawn else 'shows'} the figure {name}"
        assert shown <= (html / "_images" / f"{name}.png").is_file()


@pytest.mark.parametrize("module_name", sorted(API_PAGES))
def test_every_export_is_documented(html, module_name):
    page, elsewhere = API_PAGES[module_name]
    module = importlib.import_module(module_name)
    text = (html / page).read_text(encoding="utf-8")
    missing = [name for name in _exports(module) if name not in elsewhere and f'id="{module_name}.{name}"' not in text]
    assert not missing, f"{page} has no entry for {module_name}.{missing}: add them to docs/{page[:-5]}.rst"


def test_every_public_module_has_a_page():
    import jax_blocksparse as jbs

    modules = [name for name in jbs.__all__ if isinstance(getattr(jbs, name), types.ModuleType)]
    assert modules, jbs.__all__
    for name in modules:
        full = getattr(jbs, name).__name__  # jbs.attention is jax_blocksparse.ops.attention
        assert any(key == full or key.startswith(full + ".") for key in API_PAGES), (
            f"{full} is public (in jax_blocksparse.__all__) but has no API page: add docs/api/{name}.rst "
            f"and an entry in API_PAGES"
        )


def test_examples_are_collected(request):
    """pytest's own options run the examples: the package's docstrings and the guide's .rst files."""
    testpaths = request.config.getini("testpaths")
    assert "jax_blocksparse" in testpaths and "docs" in testpaths, testpaths
    assert request.config.getoption("doctestmodules"), "pyproject's addopts must hold --doctest-modules"
    assert "*.rst" in request.config.getoption("doctestglob"), "pyproject's addopts must hold --doctest-glob=*.rst"
    guide = sorted((DOCS / "guide").glob("*.rst"))
    assert guide, "docs/guide/ holds no pages"
    for page in guide:
        text = page.read_text(encoding="utf-8")
        # Python in the guide is written as doctest (>>>) blocks, which pytest runs;
        # a plain code block would go unchecked.
        assert not re.search(r"^\.\. code-block:: *(python|pycon)\b", text, re.MULTILINE), (
            f"{page.relative_to(ROOT)}: write Python examples as >>> blocks (they run), not code-block"
        )


def test_scripts_named_in_the_docs_exist():
    """The scripts and modules the pages name (shell blocks, which cannot run here, and
    prose) exist: e.g. tests/gpu/check.sh, examples/sparse_training.py."""
    for page in sorted(DOCS.rglob("*.rst")):
        text = page.read_text(encoding="utf-8")
        for path in re.findall(r"(?<![\w/.*-])((?:[\w.-]+/)+[\w.-]+\.(?:sh|py))\b", text):
            assert (ROOT / path).is_file(), f"{page.relative_to(ROOT)} names {path}, which does not exist"


def test_the_hopper_model_in_the_docs_is_the_scripts():
    # The model of the Hopper kernels is written before a GPU times them; the page holds
    # exactly what bench/hopper_model.py computes from the committed session results.
    from helpers import load_script

    model = load_script("bench/hopper_model.py")
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "guide" / "performance.rst").read_text()
    assert model.table() in page
    # Stacking wastes no math; the packed baseline multiplies 64 / block times the useful FLOPs.
    ceil = model.ceilings(model.session_results())
    for bs in (8, 16, 32):
        stacked, packed = model.design("stacked", bs, ceil), model.design("packed", bs, ceil)
        assert stacked["issued"] == stacked["flops"] and packed["issued"] == packed["flops"] * (64 // bs)
        assert stacked["efficiency"] >= packed["efficiency"]
