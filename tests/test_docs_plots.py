"""The benchmark figures (``docs/_plots.py``): drawn from the committed results, left out
cleanly without them, and the one README shows is committed.

The docs build draws them (``tests/test_docs.py`` checks the built page); here the
drawing itself, on the results under ``bench/results/`` and on an empty folder.
"""

import importlib.util
import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def plots():
    if importlib.util.find_spec("matplotlib") is None:
        if os.environ.get("JBS_REQUIRE_TOOLS") == "1":
            pytest.fail('JBS_REQUIRE_TOOLS=1 but matplotlib is not installed (pip install -e ".[test]")')
        pytest.skip("matplotlib is not installed")
    sys.path.insert(0, str(DOCS))
    try:
        import _plots
    finally:
        sys.path.remove(str(DOCS))
    return _plots


def test_every_figure_is_drawn_from_the_committed_results(plots, tmp_path):
    written = plots.write_all(tmp_path)
    assert set(written) == set(plots.FIGURES)
    for name, path in written.items():
        if name == "speedup-gpu" and plots.newest(plots.RESULTS, "gpu") is None:
            assert path is None
            continue
        assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_no_results_no_figure(plots, tmp_path):
    # A GPU figure before any GPU session: nothing drawn, and an earlier build's PNG removed.
    out = tmp_path / "out"
    out.mkdir()
    (out / "speedup-gpu.png").write_bytes(b"stale")
    assert plots.write_all(out, results=tmp_path / "empty") == dict.fromkeys(plots.FIGURES)
    assert not list(out.iterdir())


def test_sparse_training_figure_and_its_caption(plots, tmp_path):
    # Drawn from the sweep's summary (a line per method, dense as a horizontal line); the
    # guide's caption names the newest committed sweep, so a newer one needs a new caption.
    path = plots.newest(plots.RESULTS, "sparse_training")
    assert path is not None, "no bench/results/sparse_training-*.json committed"
    data = json.loads(path.read_text())
    methods = {row["method"] for row in data["summary"]}
    assert "dense" in methods and len(methods) > 1
    fig = plots.sparse_training_accuracy()
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlim()[0] > ax.get_xlim()[1]  # dense on the left
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= methods - {"dense"}
    assert path.name in fig._suptitle.get_text()
    plots.save(fig, tmp_path / "figure.png")
    guide = (DOCS / "guide" / "sparse_training.rst").read_text(encoding="utf-8")
    caption = guide.split(".. bench-figure:: sparse-training-accuracy", 1)[1].split("\n\n", 2)[1]
    assert f"bench/results/{path.name}" in caption and data["date"] in caption and data["device"] in caption


def test_newest_reads_the_date_in_the_name(tmp_path):
    spec = importlib.util.spec_from_file_location("plots_module", DOCS / "_plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # no matplotlib needed to pick a file
    for name in ("gpu-h100-2026-11-24.json", "gpu-a100-2026-11-26.json", "gpu-notes.json"):
        (tmp_path / name).write_text(json.dumps({}))
    assert module.newest(tmp_path, "gpu").name == "gpu-a100-2026-11-26.json"
    assert module.newest(tmp_path, "attention") is None


def test_readme_shows_the_committed_cpu_figure():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    figure = "docs/_static/speedup-cpu.png"
    assert f"]({figure})" in readme, f"README.md does not show {figure}"
    assert (ROOT / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
