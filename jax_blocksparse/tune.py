"""``python -m jax_blocksparse tune``: this machine's crossovers, measured here.

A kernel's speed beside the dense product depends on the machine (a CPU's instruction set
and cores, a GPU's kind), so the table shipped with the package cannot be right
everywhere. ``tune`` measures, on each device present, every verified kernel against the
dense path ``"auto"`` would run instead (``impl="dense"``: the blocks into a dense weight,
then XLA's dot, within a few percent of ``x @ W`` on a ready weight) at one stated shape per
platform (:data:`SHAPES`), and writes the crossovers to the user cache
(:func:`jax_blocksparse.crossover.cache_path`), which ``impl="auto"`` prefers to the
shipped table from then on (:mod:`jax_blocksparse.crossover`). So ``"auto"`` takes the
faster of the two at every density.

Per kernel (op, dtype, block size and, on CUDA, each verified kernel path) it times the
product at densities 1, 0.5, 0.25, 0.1 and 0.05, from the top, and stops at the first
density where the kernel wins (below it the kernel does less work still); the crossover is
where its time meets the dense product's, interpolated between the measured densities
(:func:`jax_blocksparse.crossover.crossover_density`). At density 1 it also times both
at a quarter and a sixty-fourth of the batch (:func:`batch_rows`): what each side costs
per call whatever the batch, from which ``"auto"`` moves the crossover for the batch of
each product (:meth:`jax_blocksparse.crossover.Crossover.at_rows`). Each time is the fastest of a few
samples of back-to-back calls of one compiled program (:func:`call_times`), the dense
path's samples taken in turn with each kernel product's: on a shared machine a burst of
load or a drift of speed then moves neither alone.

Defaults: every supported block size, float32 and bfloat16, under 4 minutes on a 2-core CPU;
``--quick``: blocks 16 to 64, float32, under a minute. A progress bar goes to stderr.

    python -m jax_blocksparse tune            # measure, write the cache, print the table
    python -m jax_blocksparse tune --quick
    python -m jax_blocksparse tune --out table.json   # elsewhere (load it with crossover.load_table)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse import _native, crossover, layouts
from jax_blocksparse.layout import SUPPORTED_BLOCK_SIZES, Layout
from jax_blocksparse.ops import _lowering, _sm90, matmul, paths

__all__ = [
    "DENSITIES",
    "SHAPES",
    "call_time",
    "call_times",
    "median_call_time",
    "measure",
    "batch_rows",
    "tune",
    "main",
]

#: The problem measured per platform: (C, K, N): W [C, K], activations [N, C] / [N, K].
SHAPES = {"cpu": (1024, 1024, 1024), "cuda": (4096, 4096, 4096)}
#: The densities measured, from the top (each kernel stops at its first win).
DENSITIES = (1.0, 0.5, 0.25, 0.1, 0.05)
#: A product whose kernel and dense path measure within the win margin of each other is
#: sampled again with this many times the repeats, and each side keeps its fastest sample.
NEAR_TIE_REPEATS = 3


def batch_rows(rows: int) -> tuple[int, ...]:
    """The batches timed at density 1: the stated one, a quarter and a sixty-fourth of it
    (at least 1), so that each side's cost per call is measured, not extrapolated."""
    return tuple(sorted({rows, max(1, rows // 4), max(1, rows // 64)}, reverse=True))


OPS = ("fprop", "bprop", "updat")
_TARGETS = {op: f"jbs_bsmm_{op}" for op in OPS}


def call_time(
    fn: Callable, *args, repeats: int = 5, min_time: float = 0.05, max_inner: int = 1000, statistic: str = "median"
) -> float:
    """Seconds per call of ``fn(*args)``: after a warm-up call, ``repeats`` samples, each of
    back-to-back calls for about ``min_time`` seconds, waited for at its end; their median
    (``statistic="median"``) or their fastest (``"min"``: on a shared machine, what the
    program costs when nothing else runs, which a comparison of two programs needs).

    That is device time only while a call's host work is shorter than its device work
    (otherwise host time)."""
    return call_times([(fn, args)], repeats=repeats, min_time=min_time, max_inner=max_inner, statistic=statistic)[0]


def call_times(
    calls: Sequence[tuple[Callable, tuple]],
    *,
    repeats: int = 5,
    min_time: float = 0.05,
    max_inner: int = 1000,
    statistic: str = "min",
) -> list[float]:
    """:func:`call_time` of each ``(fn, args)`` in ``calls``, their samples interleaved: each
    of the ``repeats`` rounds takes one sample of every call in turn, so a drift of a shared
    machine's speed (tens of percent over seconds) moves them alike and a comparison of
    programs holds. Default statistic: the fastest sample of each."""
    if statistic not in ("median", "min"):
        raise ValueError(f"statistic must be 'median' or 'min', got {statistic!r}")
    inner = []
    for fn, args in calls:
        jax.block_until_ready(fn(*args))  # compile and warm up
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        one = max(time.perf_counter() - t0, 1e-7)
        inner.append(int(min(max(1, min_time / one), max_inner)))
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(max(1, repeats)):
        for i, (fn, args) in enumerate(calls):
            t0 = time.perf_counter()
            out = None
            for _ in range(inner[i]):
                out = fn(*args)
            jax.block_until_ready(out)
            samples[i].append((time.perf_counter() - t0) / inner[i])
    pick = np.median if statistic == "median" else np.min
    return [float(pick(s)) for s in samples]


def median_call_time(fn: Callable, *args, repeats: int = 5, min_time: float = 0.05, max_inner: int = 1000) -> float:
    """:func:`call_time`'s median: what a benchmark row reports."""
    return call_time(fn, *args, repeats=repeats, min_time=min_time, max_inner=max_inner, statistic="median")


def _product(op: str, impl: str):
    """One op as users write it, ``f(a, b, layout)``, with ``impl``."""
    if op == "fprop":
        return lambda x, w, lay: matmul.bsmm(x, w, lay, impl=impl)
    if op == "bprop":
        return lambda g, w, lay: matmul.bsmm(g, w, lay, transpose=True, impl=impl)
    return lambda x, g, lay: matmul.bsmm_updat(x, g, lay, impl=impl)


def kernel_paths(platform: str, dtype, block_size: int) -> list[tuple[str, bool]]:
    """(a label, whether the Hopper gate is open) per kernel path to measure: on CPU its
    kernels; on CUDA the portable kernels and, where they can run, the Hopper ones."""
    if platform != "cuda":
        return [("native", False)]
    paths = [("portable", False)]
    if _sm90.hopper_variant("jbs_bsmm_fprop") is not None:
        paths.append(("hopper", True))
    return paths


def _target_of(platform: str, op: str, hopper: bool, dtype, block_size: int) -> tuple[str, str]:
    """(FFI target, arithmetic mode) that the product runs on that path."""
    base = _TARGETS[op]
    name = _sm90.SM90_TARGETS[base] if (platform == "cuda" and hopper) else base
    return name, _lowering.kernel_mode(name, dtype, block_size, None)


def _kernel_and_dense_times(op, dense, hopper, a, b, lay, rows, timing) -> tuple[float, float]:
    """Seconds of one product on the kernels (``hopper``: the Hopper gate open) and on the
    dense path ``dense`` (what "auto" runs instead), for the first ``rows`` rows of its
    activations (``a``, and ``b`` in updat), their samples taken in turn: a shared
    machine's speed drifts."""
    if rows < a.shape[0]:
        a, b = a[:rows], b[:rows] if op == "updat" else b
    args = (a, b, lay)
    with paths.hopper_gate(hopper):
        compiled = jax.jit(_product(op, "kernels")).lower(*args).compile()
    dense_s, kernel_s = call_times([(dense, args), (compiled, args)], **timing)
    return kernel_s, dense_s


def measure(
    platform: str,
    *,
    shape: Sequence[int] | None = None,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    block_sizes: Sequence[int] = SUPPORTED_BLOCK_SIZES,
    densities: Sequence[float] = DENSITIES,
    repeats: int = 5,
    min_time: float = 0.05,
    progress: Callable[[int, int, str], None] | None = None,
    seed: int = 0,
    timings: list | None = None,
    ops: Sequence[str] = OPS,
) -> list[dict]:
    """The crossover of every kernel of ``platform`` on its first device: a list of
    :class:`jax_blocksparse.crossover.Crossover` fields (see the module docstring).

    ``timings``, a list, receives one row per product timed, in the fields of a bench
    report's rows (``bench/crossover.py`` reads them): op, dtype, block_size, density (the
    layout's), requested_density, batch (the rows of activations), target, mode,
    sparse_s and dense_path_s. ``ops``: the products measured, among :data:`OPS`."""
    device = jax.devices(platform)[0]
    c, k, n = SHAPES[platform] if shape is None else shape
    kind = _lowering.device_kind(platform)
    family = _lowering.device_family(platform) or ""
    if not set(ops) <= set(OPS):
        raise ValueError(f"measure: ops must be among {OPS}, got {list(ops)}")
    ops = [op for op in OPS if op in ops]
    work = [(dt, bs, op) for dt in dtypes for bs in block_sizes if c % bs == 0 and k % bs == 0 for op in ops]
    total = sum(len(kernel_paths(platform, dt, bs)) for dt, bs, _ in work)
    done, entries = 0, []
    key = jax.random.key(seed)
    source = f"python -m jax_blocksparse tune, {datetime.date.today().isoformat()}, W {c} x {k}, N = {n}"
    # The fastest sample of each: two programs compared on a shared machine (the kernel and
    # the dense path), each at its cost when nothing else runs.
    timing = dict(repeats=repeats, min_time=min_time, statistic="min")

    def layout_at(bs, density, kw):
        lay = Layout.from_mask(layouts.random((c // bs, k // bs), density, seed=seed), bs)
        w = (jax.random.normal(kw, lay.w_shape, jnp.float32) / np.sqrt(c * density)).astype(dtype)
        return lay, w

    for dtype in dtypes:
        kx, kg, kw = jax.random.split(jax.random.fold_in(key, len(entries)), 3)
        x = jax.device_put(jax.random.normal(kx, (n, c), dtype), device)
        g = jax.device_put(jax.random.normal(kg, (n, k), dtype), device)
        for bs in block_sizes:
            if c % bs or k % bs:
                continue
            for op in ops:
                dense = jax.jit(_product(op, "dense"))
                for label, hopper in kernel_paths(platform, dtype, bs):
                    target, mode = _target_of(platform, op, hopper, jnp.dtype(dtype), bs)
                    if progress:
                        progress(done, total, f"{op} {dtype} bs{bs} {label}")
                    points, full = [], []
                    for density in sorted(densities, reverse=True):
                        lay, w = layout_at(bs, density, kw)
                        operands = {"fprop": (x, w), "bprop": (g, w), "updat": (x, g)}[op]
                        # At density 1, smaller batches too: how each side's cost per call
                        # (the dense path's conversion, a kernel's transposes) moves the
                        # crossover with the batch (Crossover.at_rows).
                        for rows in batch_rows(n) if lay.density == 1.0 else (n,):
                            t, dense_s = _kernel_and_dense_times(op, dense, hopper, *operands, lay, rows, timing)
                            if abs(dense_s / t - 1.0) < crossover.WIN_MARGIN:
                                # A near tie, which the machine's noise decides from one set of
                                # samples (bprop at block 32, density 1: 1.26 in one sweep, 1.01
                                # in the next): sampled again, longer, each side at its fastest.
                                again = dict(timing, repeats=NEAR_TIE_REPEATS * timing["repeats"])
                                t2, dense2 = _kernel_and_dense_times(op, dense, hopper, *operands, lay, rows, again)
                                t, dense_s = min(t, t2), min(dense_s, dense2)
                            if lay.density == 1.0:
                                full.append((rows, t, dense_s))
                            if rows == n:
                                ratio = dense_s / t
                            if timings is not None:
                                timings.append(
                                    dict(
                                        op=op,
                                        dtype=str(dtype),
                                        block_size=bs,
                                        density=lay.density,
                                        requested_density=density,
                                        batch=rows,
                                        target=target,
                                        mode=mode,
                                        sparse_s=t,
                                        dense_path_s=dense_s,
                                    )
                                )
                        points.append((lay.density, ratio))
                        if ratio >= 1.0 + crossover.WIN_MARGIN:
                            break  # a win: below it the kernel does less work still
                    done += 1
                    entries.append(
                        dict(
                            platform=platform,
                            device_kind=kind,
                            target=target,
                            mode=mode,
                            block_size=bs,
                            crossover=crossover.crossover_density(points, crossover.WIN_MARGIN),
                            source=source,
                            family=family,
                            **(dict(rows=n, full_density=tuple(full)) if len(full) > 1 else {}),
                        )
                    )
    if progress:
        progress(total, total, "done")
    return entries


def amx_peak_flops(seconds: float = 0.5, threads: int | None = None) -> float | None:
    """The AMX unit's bfloat16 peak on this machine, FLOP/s: ``threads`` threads (default:
    the cores this process may use) at once running TDPBF16PS on operands held in the tiles
    for about ``seconds``. None where the CPU or the build has no AMX. What the
    benchmarks divide by for the share of the peak a product reached."""
    module = _native.module()
    probe = getattr(module, "amx_peak_probe", None)
    if probe is None or probe(1) is None:
        return None
    if threads is None:
        threads = crossover.usable_cores()
    start = time.perf_counter()
    probe(1 << 16)
    steps = max(1, int(seconds / ((time.perf_counter() - start) / (1 << 16))))
    done = []
    workers = [threading.Thread(target=lambda: done.append(probe(steps))) for _ in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done) / (time.perf_counter() - start)


def progress_bar(stream=sys.stderr, width: int = 30) -> Callable[[int, int, str], None]:
    """A one-line text progress bar: ``[#####-----] 12/30 fprop bfloat16 bs32``."""

    def show(done: int, total: int, what: str) -> None:
        filled = int(width * done / max(1, total))
        end = "\n" if done >= total else ""
        stream.write(f"\r  [{'#' * filled}{'-' * (width - filled)}] {done}/{total} {what:40}{end}")
        stream.flush()

    return show


def tune(
    platforms: Sequence[str] | None = None,
    *,
    quick: bool = False,
    out: str | os.PathLike | None = None,
    progress: bool = True,
    **options,
) -> crossover.CrossoverTable:
    """Measures the crossovers of each platform with native kernels present here (default:
    every such device), writes them to ``out`` (default: the user cache, merged with its
    entries of other devices), and returns the table written. ``options`` go to
    :func:`measure`."""
    if platforms is None:
        platforms = [
            p
            for p in ("cpu", "cuda")
            if _lowering.device_kind(p) is not None and _lowering.kernels_selected(p, "auto", "jbs_bsmm_fprop")
        ]
    if quick:
        options = dict(dict(dtypes=("float32",), block_sizes=(16, 32, 64), repeats=3, min_time=0.02), **options)
    path = crossover.cache_path() if out is None else out
    entries = []
    for platform in platforms:
        if progress:
            print(f"tune: {platform} ({_lowering.device_kind(platform)})", file=sys.stderr)
        entries += measure(platform, progress=progress_bar() if progress else None, **options)
    table = crossover.CrossoverTable.from_entries(entries)
    if os.path.exists(path):
        try:
            table = crossover.merged(table, crossover.load_table(path))
        except (OSError, ValueError, TypeError):
            pass  # an unreadable cache is replaced
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(table.to_json(about="Written by python -m jax_blocksparse tune on this machine."), f, indent=2)
    os.replace(tmp, path)
    crossover.reset_default_table()
    return table


def main(argv=None) -> int:
    """``python -m jax_blocksparse tune [--quick] [--platform P] [--out FILE] ...``: measures,
    writes the table (the user cache by default) and prints it; exit status 0."""
    p = argparse.ArgumentParser(
        prog="python -m jax_blocksparse tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="blocks 16-64, float32 only: under a minute on 2 cores")
    p.add_argument("--platform", action="append", choices=["cpu", "cuda"], help="only these (default: every one here)")
    p.add_argument("--out", help=f"write here instead of the user cache ({crossover.cache_path()})")
    p.add_argument("--block-sizes", type=int, nargs="+", choices=SUPPORTED_BLOCK_SIZES)
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--size", type=int, nargs=3, metavar=("C", "K", "N"), help="the problem instead of SHAPES'")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    options = {k: tuple(v) for k, v in (("block_sizes", args.block_sizes), ("dtypes", args.dtypes)) if v}
    if args.size:
        if any(v <= 0 or v % 128 for v in args.size[:2]) or args.size[2] <= 0:
            p.error(f"--size: C and K must be positive multiples of 128 and N positive, got {args.size}")
        options["shape"] = tuple(args.size)
    start = time.perf_counter()
    table = tune(args.platform, quick=args.quick, out=args.out, progress=not args.no_progress, **options)
    where = args.out or crossover.cache_path()
    print(f"tune: wrote {len(table.entries)} entries to {where} in {time.perf_counter() - start:.0f} s")
    for e in table.entries:
        print(f"  {e.device_kind:24} {e.target:22} {e.mode:9} bs {e.block_size:>3}: {e.crossover:.3f}")
    return 0
