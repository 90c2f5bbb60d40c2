"""``tune``'s measurement as a benchmark report: the rows ``bench/crossover.py`` reads.

``python -m jax_blocksparse tune`` writes this machine's crossovers to a user cache. This
script runs the same measurement (:func:`jax_blocksparse.tune.measure`: each kernel against
the dense path at densities 1 to 0.05 from the top, stopping at its first win, and at
density 1 also at a quarter and a sixty-fourth of the batch) and writes every timed
product as a row, so a machine's sweep can be committed under ``bench/results/`` and
become the package's shipped entries for its kind (``python bench/crossover.py
--package``), batch model included.

    python bench/tune_sweep.py                       # bench/results/tune_sweep-<device>-<date>.json
    python bench/tune_sweep.py --block-sizes 32 --dtypes float32 --json /tmp/t.json
    python bench/tune_sweep.py --ops updat   # one product again, after a change to its path only
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax

import jax_blocksparse as jbs
from jax_blocksparse import crossover, tune

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import cpu_cores, git_commit, measured_on, write_report  # noqa: E402


def run(args) -> dict:
    platform = args.platform
    c, k, n = tune.SHAPES[platform] if args.size is None else args.size
    timings: list[dict] = []
    entries = tune.measure(
        platform,
        shape=(c, k, n),
        dtypes=tuple(args.dtypes),
        block_sizes=tuple(args.block_sizes),
        densities=tuple(args.densities),
        ops=tuple(args.ops),
        repeats=args.repeats,
        min_time=args.min_time,
        progress=tune.progress_bar(),
        timings=timings,
    )
    now = datetime.datetime.now(datetime.UTC)
    device = jax.devices(platform)[0]
    return dict(
        benchmark="tune_sweep",
        **measured_on(),
        platform=platform,
        device_kind=crossover.cpu_device_kind() if platform == "cpu" else device.device_kind,
        extension=jbs.extension_info(),
        cpu_cores=cpu_cores(),
        commit=git_commit(),
        date=now.date().isoformat(),
        datetime=now.isoformat(timespec="seconds"),
        jax_version=jax.__version__,
        config=dict(
            size=dict(C=c, K=k, N=n),
            batch=n,
            densities=list(args.densities),
            stop_at_win=True,
            dtypes=list(args.dtypes),
            block_sizes=list(args.block_sizes),
            ops=list(args.ops),
            timing=f"fastest of {args.repeats} samples (>= {args.min_time} s of back-to-back calls each), the kernel's "
            "and the dense path's taken in turn",
        ),
        results=timings,
        crossovers=entries,
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", type=int, nargs=3, metavar=("C", "K", "N"), help="default: tune.SHAPES")
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(jbs.SUPPORTED_BLOCK_SIZES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--densities", type=float, nargs="+", default=list(tune.DENSITIES))
    p.add_argument(
        "--ops",
        nargs="+",
        choices=tune.OPS,
        default=list(tune.OPS),
        help="the products to measure (default: all); the package's table keeps the other products' entries "
        "from the newest sweep that measured them",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--min-time", type=float, default=0.05)
    p.add_argument("--json", type=Path, help="default: bench/results/tune_sweep-<device>-<date>.json")
    args = p.parse_args(argv)
    report = run(args)
    write_report(args.json, "tune_sweep", report)
    return report


if __name__ == "__main__":
    main()
