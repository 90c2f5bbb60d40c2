"""Sphinx glue for the benchmark figures of ``docs/_plots.py``.

When the build starts, every figure is drawn from the committed results into
``docs/_generated/`` (ignored by git). A page places one with::

    .. bench-figure:: speedup-cpu

       The caption.

which is ``.. figure::`` on that PNG, or nothing at all when its results are not
committed (the GPU figure before a GPU session), so the page builds either way.
"""

from __future__ import annotations

from pathlib import Path

import _plots
from docutils.parsers.rst.directives.images import Figure

GENERATED = "_generated"


class BenchFigure(Figure):
    """``.. bench-figure:: NAME``: the figure ``NAME`` of ``_plots.FIGURES``, if drawn."""

    def run(self):
        name = self.arguments[0]
        if name not in _plots.FIGURES:
            raise self.error(f"bench-figure: unknown figure {name!r}; one of {sorted(_plots.FIGURES)}")
        env = self.state.document.settings.env
        if not (Path(env.srcdir) / GENERATED / f"{name}.png").is_file():
            return []  # no results for it: the page goes on without it
        self.arguments[0] = f"/{GENERATED}/{name}.png"
        self.options.setdefault("width", "100%")
        return super().run()


def _draw(app):
    _plots.write_all(Path(app.srcdir) / GENERATED)


def setup(app):
    app.add_directive("bench-figure", BenchFigure)
    app.connect("builder-inited", _draw)
    return {"parallel_read_safe": True}
