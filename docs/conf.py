"""Sphinx configuration: the API reference (autodoc + napoleon) and the user guide.

Build with ``python -m sphinx -W --keep-going -b html docs docs/_build/html``; the
build needs no network: no intersphinx, the sphinx-book-theme (the theme of the Flax and
Optax docs; the ``docs`` and ``test`` extras install it), and the benchmark figures drawn
from ``bench/results/`` with matplotlib (``_plots.py``, placed by ``_bench_figures.py``).
``tests/test_docs.py`` runs that command in CI, warnings as errors.
"""

import os
import pathlib
import re
import sys

# Eight host devices, as the tests have, before anything imports jax: autodoc imports
# the package, and the guide's multi-device examples (run by pytest) assume them.
_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

# Document the source tree next to this file, installed or not; this folder holds the
# figures' extension.
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs"))

import jax_blocksparse  # noqa: E402  (after XLA_FLAGS, on purpose)
from jax_blocksparse.layers.attribute_docs import block_sizes_text  # noqa: E402

project = "jax-blocksparse"
author = "jax-blocksparse authors"
copyright = "2026, jax-blocksparse authors"
release = jax_blocksparse.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "_bench_figures",
]

# The block sizes as the package reads them (block_sizes.json), for every page: write
# |block_sizes| (the sizes, the last joined by "or"), never the list by hand.
rst_epilog = f"\n.. |block_sizes| replace:: {block_sizes_text()}\n"

exclude_patterns = ["_build", "_generated"]
root_doc = "index"

html_theme = "sphinx_book_theme"
html_title = f"jax-blocksparse {release}"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {
    # Nothing fetched at build or view time: no repository buttons, no launch buttons.
    "use_download_button": False,
    "use_fullscreen_button": False,
    "show_toc_level": 2,
    "navigation_with_keys": False,
    # The sidebar has the search field; no second one in a header bar above the page.
    "navbar_persistent": [],
}

# Google-style docstrings ("Args:", "Returns:") as the package writes them.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

autodoc_default_options = {"members": True, "show-inheritance": False}
autodoc_member_order = "bysource"
# Signatures keep the annotations as written (``Layout``, ``jax.Array``): resolving
# them against the jax and flax types would need those projects' inventories.
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True

# Single backticks, which some docstrings use for code, render as code (not as
# reStructuredText's default, an italic title reference).
default_role = "code"
# Shapes are written in plain text ("x [..., C]"): keep "..." and quotes as typed.
smartquotes = False

# "Attributes:" sections as fields of their class: the dataclass fields (flax
# modules) and NamedTuple fields are also class members that autodoc documents, and
# the two descriptions of one name would collide.
napoleon_use_ivar = True


# Shapes in docstrings are plain text, as ``help()`` shows them: ``w [capacity,
# *kernel_size, bs, bs]``, where ``*name`` stands for several dims. To
# reStructuredText a ``*`` opening a word is the start of an emphasis; escape it when
# it opens an entry of a shape (right after "[", "(" or ", "), outside ``literals``,
# literal blocks and doctest lines, so the page shows what help() shows.
_SHAPE_STAR = re.compile(r"(?:(?<=[\[(])|(?<=, ))\*(?=[A-Za-z_])")


def _escape_shape_stars(lines):
    literal_indent = None  # indentation of the paragraph that opened a literal block
    in_literal = False  # inside a ``literal`` that began on an earlier line
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        indent = len(line) - len(stripped)
        if not stripped:
            in_literal = False  # inline markup never spans paragraphs
        if literal_indent is not None:
            if not stripped or indent > literal_indent:
                continue
            literal_indent = None
        if stripped.startswith((">>>", "...")):
            continue
        parts = line.split("``")
        outside = 1 if in_literal else 0  # parts[outside::2] lie outside ``...``
        parts[outside::2] = [_SHAPE_STAR.sub(r"\\*", p) for p in parts[outside::2]]
        lines[i] = "``".join(parts)
        in_literal ^= (len(parts) - 1) % 2 == 1
        if stripped.endswith("::"):
            literal_indent = indent


def _process_docstring(app, what, name, obj, options, lines):
    _escape_shape_stars(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process_docstring)
