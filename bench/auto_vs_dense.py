"""``impl="auto"`` against what a user would otherwise write, ``x @ W`` with W dense.

For each dtype, block size, density and op (fprop ``x @ W``, bprop ``dy @ W.T``, updat
``x.T @ dy`` at the blocks) it times, in one process, on one device:

* ``auto_s``: the op with ``impl="auto"`` (the kernels, or the dense product above the
  crossover in force: this machine's ``tune`` cache where there is one, else the shipped
  table), and what auto chose (``choice``: the kernel called, or "dense");
* ``dense_path_s``: the op with ``impl="dense"`` (the blocks into a dense weight, then
  XLA's dot: what auto runs above the crossover);
* ``xw_s``: XLA's dot on a ready dense weight, ``jnp.dot``.

Every time is the fastest (``--statistic min``, the default; or the median) of a few
samples of back-to-back calls of one compiled program, the three programs' samples taken
in turn (``jax_blocksparse.tune.call_times``): on a shared machine, each program at its
cost when nothing else runs, and a drift of the machine's speed moves all three alike.
The whole grid is measured ``--runs`` times and each row keeps the median of its runs'
ratios, so a burst of load moves one run, not the result. ``ratio`` = xw_s / auto_s
(>= 1: auto at least as fast as ``x @ W``); ``dense_path_ratio`` = xw_s / dense_path_s.
``--size`` sets the batch N too: "auto" moves each crossover for it (the batch model of
``jax_blocksparse.crossover.Crossover.at_rows``).

    python bench/auto_vs_dense.py --json bench/results/auto-vs-dense-cpu-avx512-2c-DATE.json
    python bench/auto_vs_dense.py --quick          # seconds: one block size and density
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs
from jax_blocksparse import crossover
from jax_blocksparse.tune import call_times

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _kernel_paths import kernel_target  # noqa: E402
from _report import git_commit, write_json  # noqa: E402

OPS = ("fprop", "bprop", "updat")


def _ops(impl):
    return {
        "fprop": lambda x, w, g, lay: jbs.bsmm(x, w, lay, impl=impl),
        "bprop": lambda x, w, g, lay: jbs.bsmm(g, w, lay, transpose=True, impl=impl),
        "updat": lambda x, w, g, lay: jbs.bsmm_updat(x, g, lay, impl=impl),
    }


XW = {
    "fprop": lambda x, W, g: jnp.dot(x, W),
    "bprop": lambda x, W, g: jnp.dot(g, W.T),
    "updat": lambda x, W, g: jnp.dot(x.T, g),
}


def _choice(fn, args) -> str:
    """The kernel ``auto`` calls in ``fn``'s program, or "dense"."""
    return kernel_target(fn.lower(*args).as_text()) or "dense"


def run(args) -> dict:
    c, k, n = args.size
    device = jax.devices()[0]
    key = jax.random.key(0)
    kx, kg, kw = jax.random.split(key, 3)
    rows: dict[tuple, dict] = {}
    for run_index in range(args.runs):
        for dtype in args.dtypes:
            x = jax.random.normal(kx, (n, c), dtype)
            g = jax.random.normal(kg, (n, k), dtype)
            W = (jax.random.normal(kw, (c, k), jnp.float32) / np.sqrt(c)).astype(dtype)
            xw_fns = {op: jax.jit(f) for op, f in XW.items()}
            for bs in args.block_sizes:
                for density in args.densities:
                    mask = jbs.layouts.random((c // bs, k // bs), density, seed=0)
                    lay = jbs.Layout.from_mask(mask, bs)
                    w = jbs.from_dense(W, lay)
                    for op in args.ops:
                        auto = jax.jit(_ops("auto")[op])
                        dense = jax.jit(_ops("dense")[op])
                        timing = dict(repeats=args.repeats, min_time=args.min_time, statistic=args.statistic)
                        # The three programs' samples in turn: a shared machine's speed
                        # drifts over a run by tens of percent, and so moves them alike.
                        xw_s, auto_s, dense_s = call_times(
                            [(xw_fns[op], (x, W, g)), (auto, (x, w, g, lay)), (dense, (x, w, g, lay))], **timing
                        )
                        row = rows.setdefault(
                            (dtype, bs, density, op),
                            dict(
                                op=op,
                                dtype=dtype,
                                block_size=bs,
                                density=density,
                                real_density=lay.density,
                                choice=_choice(auto, (x, w, g, lay)),
                                auto_runs=[],
                                dense_path_runs=[],
                                xw_runs=[],
                            ),
                        )
                        row["auto_runs"].append(auto_s)
                        row["dense_path_runs"].append(dense_s)
                        row["xw_runs"].append(xw_s)
                        print(
                            f"run {run_index + 1}/{args.runs} {op:5} {dtype:8} bs {bs:>3} d {density:<4} "
                            f"x@W {xw_s * 1e3:8.3f} ms  auto {auto_s * 1e3:8.3f} ms ({row['choice']})  "
                            f"dense path {dense_s * 1e3:8.3f} ms  ratio {xw_s / auto_s:5.2f}",
                            flush=True,
                        )
    out = []
    for row in rows.values():
        for name in ("auto", "dense_path", "xw"):
            row[f"{name}_s"] = float(np.median(row[f"{name}_runs"]))
        row["ratio"] = float(np.median(np.array(row["xw_runs"]) / np.array(row["auto_runs"])))
        row["dense_path_ratio"] = float(np.median(np.array(row["xw_runs"]) / np.array(row["dense_path_runs"])))
        out.append(row)
    now = datetime.datetime.now(datetime.UTC)
    return dict(
        benchmark="auto_vs_dense",
        device=str(device),
        device_kind=crossover.cpu_device_kind() if device.platform == "cpu" else device.device_kind,
        platform=device.platform,
        extension=jbs.extension_info(),
        cpu_cores=crossover.usable_cores(),
        # where the table in force came from, paths inside the repository made relative to it
        crossover_sources=[line.replace(str(ROOT) + "/", "") for line in crossover.table_sources()],
        commit=git_commit(),
        date=now.date().isoformat(),
        datetime=now.isoformat(timespec="seconds"),
        host=platform.node(),
        jax_version=jax.__version__,
        size=dict(C=c, K=k, N=n),
        runs=args.runs,
        timing=f"{args.statistic} of {args.repeats} samples of back-to-back calls (>= {args.min_time} s each), the "
        f"samples of x @ W, auto and the dense path taken in turn; per row the median of {args.runs} runs' ratios",
        results=sorted(out, key=lambda r: (r["dtype"], r["block_size"], -r["density"], r["op"])),
        worst_ratio=min(r["ratio"] for r in out),
        worst_dense_path_ratio=min(r["dense_path_ratio"] for r in out),
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, nargs=3, default=[1024, 1024, 1024], metavar=("C", "K", "N"))
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(jbs.SUPPORTED_BLOCK_SIZES))
    p.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.1])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05)
    p.add_argument(
        "--statistic",
        choices=["median", "min"],
        default="min",
        help="of each time's samples: the fastest (default: a program's cost when nothing else runs) or the median",
    )
    p.add_argument("--quick", action="store_true", help="one block size, one density, one run (seconds)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.block_sizes, args.densities, args.runs, args.repeats = [256, 256, 64], [32], [1.0], 1, 2
    report = run(args)
    print(
        f"worst auto / x@W: {report['worst_ratio']:.3f}; worst dense path / x@W: {report['worst_dense_path_ratio']:.3f}"
    )
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
