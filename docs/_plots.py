"""The guides' figures, drawn from the benchmark results under ``bench/results/``.

Each figure reads the newest committed JSON of one benchmark (the date ends its file
name) and returns None when there is none, so a page can leave it out: the GPU figure
waits for a GPU session's results. The docs build draws them (``docs/_bench_figures.py``);
run this file to refresh the PNG that README shows::

    python docs/_plots.py        # writes docs/_static/speedup-cpu.png

matplotlib with its Agg backend (no display, no network).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README_FIGURE = ROOT / "docs" / "_static" / "speedup-cpu.png"

OPS = ("fprop", "bprop", "updat")
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})\.json$")


def newest(results: Path, prefix: str) -> Path | None:
    """The newest ``<prefix>-...-<date>.json`` under ``results`` (by the date in its name)."""
    found = [p for p in results.glob(f"{prefix}-*.json") if _DATE.search(p.name)]
    return max(found, key=lambda p: (_DATE.search(p.name).group(1), p.name), default=None)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: the docs build and CI run headless
    import matplotlib.pyplot as plt

    return plt


def _speedup_axes(ax, xlabel: str):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axhline(1.0, color="0.4", linewidth=0.8, linestyle="--")  # as fast as dense
    ax.set_xlabel(xlabel)
    ax.grid(True, which="major", alpha=0.3)


def speedup_by_density(panels: dict[str, list[dict]], title: str, baseline: str = "dense"):
    """A panel per entry of ``panels`` (title -> rows with ``density``, ``block_size`` and
    ``speedup``): speedup over ``baseline`` against density, a line per block size, and
    1 / density (every stored block at dense speed) for scale."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels.items()):
        densities = sorted({r["density"] for r in rows})
        ax.plot(densities, [1 / d for d in densities], color="0.75", linewidth=3, label="1 / density")
        for bs in sorted({r["block_size"] for r in rows}):
            points = sorted((r["density"], r["speedup"]) for r in rows if r["block_size"] == bs)
            ax.plot(*zip(*points), marker="o", markersize=3, label=f"block {bs}")
        _speedup_axes(ax, "density")
        ax.set_title(name)
    axes[0][0].set_ylabel(f"speedup over {baseline}")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def by_op(rows: list[dict]) -> dict[str, list[dict]]:
    """The product rows of ``bench/bsmm.py`` per op, each at the density it asked for (the
    layout's own differs a little per block size)."""
    return {
        op: [dict(r, density=r["requested_density"]) for r in rows if r["op"] == op]
        for op in OPS
        if any(r["op"] == op for r in rows)
    }


def cpu_speedup(results: Path = RESULTS):
    """The native CPU kernels against the dense path, float32 (``bench/bsmm.py --preset
    crossover-cpu``)."""
    path = newest(results, "crossover-cpu")
    if path is None:
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["dtype"] == "float32"]
    size = data["size"]
    title = (
        f"{data['cpu_cores']}-core CPU ({data['extension']['cpu_isa']}), float32, W {size['C']} x {size['K']}, "
        f"N = {size['N']}, {data['date']} ({path.name})"
    )
    return speedup_by_density(by_op(rows), title)


def gpu_speedup(results: Path = RESULTS):
    """A GPU session's products against ``jnp.dot`` (``bench/session.py``): bfloat16 at its
    largest shape, on the Hopper kernels where they ran; None until a GPU result is committed."""
    path = newest(results, "gpu")
    if path is None:
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r["dtype"] == "bfloat16" and r.get("speedup")]
    if not rows:
        return None
    paths = {r["path"] for r in rows}
    kernels = "hopper" if "hopper" in paths else sorted(paths)[0]
    size = max(tuple(r["size"]) for r in rows)
    rows = [r for r in rows if r["path"] == kernels and tuple(r["size"]) == size]
    title = (
        f"{data['device_kind']}, {kernels} kernels, bfloat16, W {size[1]} x {size[2]}, N = {size[0]}, "
        f"{data['date']} ({path.name})"
    )
    return speedup_by_density(by_op(rows), title)


def conv_speedup(results: Path = RESULTS):
    """``bsconv`` against ``lax.conv`` (``bench/bsconv.py``): a panel per pass."""
    path = newest(results, "bsconv")
    if path is None:
        return None
    data = json.loads(path.read_text())
    passes = {p: [r for r in data["results"] if r["pass_"] == p] for p in sorted({r["pass_"] for r in data["results"]})}
    shape = data["shape"]
    title = (
        f"{shape['kernel']}x{shape['kernel']} conv, {shape['batch']} x {shape['spatial']} x {shape['spatial']} x "
        f"{shape['channels']}, float32, CPU, {data['date']} ({path.name})"
    )
    return speedup_by_density(passes, title, baseline="lax.conv")


_CASES = {"step": "training step", "gqa": "training step, GQA", "packed": "packed documents", "decode": "decoding"}


def attention_speedup(results: Path = RESULTS):
    """Block-sparse attention against ``jax.nn.dot_product_attention`` (``bench/attention.py``):
    a bar per case that both ran (the dense one is skipped where its scores exceed memory)."""
    path = newest(results, "attention")
    if path is None:
        return None
    data = json.loads(path.read_text())
    rows = [r for r in data["results"] if r.get("speedup_vs_dense")]
    plt = _pyplot()

    def label(r):
        kv = r.get("kv_heads", r["heads"])
        heads = f"{r['heads']} heads" + (f" ({kv} kv)" if kv != r["heads"] else "")
        return f"{_CASES.get(r.get('case'), 'training step')}, T = {r['seq_len']}, {heads}, density {r['density']:.3g}"

    speedups = [r["speedup_vs_dense"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.2, 0.35 * len(rows) + 1.3))
    ax.barh(range(len(rows)), speedups, color="C0")
    ax.set_yticks(range(len(rows)), [label(r) for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(1, 2 * max(speedups))  # from "as fast as dense", with room for the numbers
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 2 * max(speedups)]
    ax.set_xticks(ticks, [f"{t}x" for t in ticks])
    ax.minorticks_off()
    for i, s in enumerate(speedups):
        ax.text(s, i, f" {s:.1f}x", va="center", fontsize=7)
    ax.set_xlabel("speedup over jax.nn.dot_product_attention")
    config = data["config"]
    fig.suptitle(
        f"block {config['block_size']}, head_dim {config['head_dim']}, {config['dtype']}, CPU, {data['date']} "
        f"({path.name})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def sparse_training_accuracy(results: Path = RESULTS):
    """Test accuracy against density for each dynamic sparse training method
    (``examples/sparse_training.py --sweep``): the mean over the seeds with a band of one
    standard deviation either side, the dense model's accuracy as a horizontal line."""
    path = newest(results, "sparse_training")
    if path is None:
        return None
    data = json.loads(path.read_text())
    rows = data["summary"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for row in (r for r in rows if r["method"] == "dense"):
        mean, std = row["mean"], row["std"]
        ax.axhspan(mean - std, mean + std, color="0.85")
        ax.axhline(mean, color="0.3", linewidth=1.2, linestyle="--", label=f"dense ({mean:.3f})")
    methods = [m for m in dict.fromkeys(r["method"] for r in rows) if m != "dense"]
    for i, method in enumerate(methods):
        points = sorted((r["density"], r["mean"], r["std"]) for r in rows if r["method"] == method)
        density, mean, std = (np.array(v) for v in zip(*points))
        color = f"C{i}"
        ax.fill_between(density, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
        ax.errorbar(density, mean, yerr=std, marker="o", markersize=3, capsize=2, color=color, label=method)
    ax.set_xscale("log")
    densities = sorted({r["density"] for r in rows} | {1.0}, reverse=True)
    ax.set_xlim(1.08, 0.9 * min(densities))  # dense on the left, the sparsest on the right
    ax.set_xticks(densities, [f"{d:g}" for d in densities])
    ax.minorticks_off()
    ax.set_xlabel("density (fraction of weights kept)")
    ax.set_ylabel("test accuracy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    settings, bs = data["settings"], data["settings"]["block_size"]
    fig.suptitle(
        f"block-sparse MLP, hidden {settings['hidden'].replace(',', '-')}, on digits, {bs}x{bs} blocks, "
        f"{settings['epochs']} epochs, mean ±std over seeds {', '.join(map(str, data['seeds']))}\n"
        f"{data['device']}, {data['date']} ({path.name})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


#: name (the PNG's stem) -> the function that draws it.
FIGURES = {
    "speedup-cpu": cpu_speedup,
    "speedup-gpu": gpu_speedup,
    "speedup-conv": conv_speedup,
    "speedup-attention": attention_speedup,
    "sparse-training-accuracy": sparse_training_accuracy,
}


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No software version in the file: the same results give the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    _pyplot().close(fig)
    return path


def write_all(out: Path, results: Path = RESULTS) -> dict[str, Path | None]:
    """Draws every figure into ``out/<name>.png``; None for those without results."""
    written = {}
    for name, draw in FIGURES.items():
        fig, path = draw(results), out / f"{name}.png"
        if fig is None:
            path.unlink(missing_ok=True)  # an earlier build's figure must not outlive its results
        written[name] = None if fig is None else save(fig, path)
    return written


if __name__ == "__main__":
    print(save(cpu_speedup(), README_FIGURE), file=sys.stderr)
