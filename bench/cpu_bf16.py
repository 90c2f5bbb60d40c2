"""bfloat16 block-sparse products on the CPU's matrix units against the widening kernels and XLA's dense dot.

For each size (``1024``: x [1024, 1024] @ W [1024, 1024]; ``4096``: x [4096, 4096] @ W
[4096, 4096]), each block size of ``--blocks`` and each density of ``--densities`` (random
layouts), three products are timed in bfloat16 (bf16 outputs, float32 sums):

- ``fprop`` y = x @ W, ``bprop`` dx = dy @ W^T and ``updat`` dW = x^T @ dy at the layout's
  blocks, with the kernels of the matrix units (``amx``: AMX tiles, or ``avx512_bf16``:
  dot products, the widest this CPU has) and with the kernels that widen bf16 to float32
  (``avx512``, or the widest below the matrix units), forced in turn through
  ``JAX_BLOCKSPARSE_CPU_ISA`` in this one process;
- XLA's dense bf16 ``x @ W`` of the same shape, once per size: the baseline of every
  ``*_vs_dense`` ratio (the product as a user writes it, bf16 result);
- XLA's dense product of each kind (``x @ W``, ``dy @ W.T``, ``x.T @ dy``) in two forms,
  once per size: with a bf16 result, and with a float32 result
  (``preferred_element_type=float32``) rounded to bf16, which XLA may run on the matrix
  units. The faster of the two per product is the baseline of ``*_vs_best_dense``.

Each row gives the milliseconds, the speedups over the dense dot and, for AMX, the share
of the unit's peak the product reached: its useful FLOPs (2 x rows x blocks x bs^2) over
the time, divided by the peak measured in this run (every core running TDPBF16PS on
operands held in the tiles, :func:`jax_blocksparse.tune.amx_peak_flops`). Variants are timed
round-robin ``--repeats`` times after one warm-up; medians are reported.

Usage::

    python bench/cpu_bf16.py                         # both sizes (minutes on 2 cores)
    python bench/cpu_bf16.py --sizes 1024 --repeats 3 --blocks 32 --densities 1,0.1   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import cpu_cores, git_commit, measured_on, write_report  # noqa: E402

import jax_blocksparse as jbs  # noqa: E402
from jax_blocksparse import tune  # noqa: E402

ENV = "JAX_BLOCKSPARSE_CPU_ISA"
PRODUCTS = ("fprop", "bprop", "updat")


def instruction_sets() -> tuple[str | None, str]:
    """(the matrix units' set, or None where the CPU has neither; the widening set below it)."""
    info = jbs.extension_info()
    order, detected = info["cpu_isas"], info["cpu_isa_detected"]  # lowest to widest
    level = order.index(detected)
    matrix = detected if level >= order.index("avx512_bf16") else None
    return matrix, order[min(level, order.index("avx512"))]


def _timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def time_round_robin(calls: dict, repeats: int) -> dict:
    """{name: median seconds} of calls {name: (isa or None, fn, args)}, timed in turn."""
    times = {name: [] for name in calls}
    for rep in range(repeats + 1):
        for name, (isa, fn, args) in calls.items():
            if isa is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = isa
            elapsed = _timed(fn, args)
            if rep > 0:  # the first round compiles and warms up
                times[name].append(elapsed)
    os.environ.pop(ENV, None)
    return {name: statistics.median(t) for name, t in times.items()}


def products(layout):
    """The three jitted products of ``layout`` on the kernels."""
    return {
        "fprop": jax.jit(lambda x, w, dy: jbs.bsmm(x, w, layout, impl="kernels")),
        "bprop": jax.jit(lambda x, w, dy: jbs.bsmm(dy, w, layout, transpose=True, impl="kernels")),
        "updat": jax.jit(lambda x, w, dy: jbs.bsmm_updat(x, dy, layout, impl="kernels")),
    }


def xla_products():
    """XLA's dense product of each kind, ``fn(x, W, dy, result=None)``: bf16 operands, the
    float32 sums returned in bf16 (``result=None``) or as ``result`` rounded to bf16."""

    def dot(a, b, result):
        return jnp.dot(a, b, preferred_element_type=result).astype(jnp.bfloat16)

    return {
        "fprop": lambda x, W, dy, result: dot(x, W, result),
        "bprop": lambda x, W, dy, result: dot(dy, W.T, result),
        "updat": lambda x, W, dy, result: dot(x.T, dy, result),
    }


def measure_size(n: int, blocks, densities, repeats: int, matrix: str | None, widening: str, peak) -> dict:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((n, n), np.float32), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((n, n), np.float32), jnp.bfloat16)
    W = jnp.asarray(rng.standard_normal((n, n), np.float32), jnp.bfloat16)
    dense_calls = {"dense": (None, jax.jit(lambda x, W: x @ W), (x, W))}
    for op, fn in xla_products().items():
        for result, dtype in (("bf16_result", None), ("f32_result", jnp.float32)):
            dense_calls[f"{op}/{result}"] = (None, jax.jit(functools.partial(fn, result=dtype)), (x, W, dy))
    dense_times = time_round_robin(dense_calls, repeats)
    dense_s = dense_times.pop("dense")
    xla_ms = {key: s * 1e3 for key, s in dense_times.items()}
    best_dense = {op: min(dense_times[f"{op}/bf16_result"], dense_times[f"{op}/f32_result"]) for op in PRODUCTS}
    print(
        f"{n} x {n} @ {n} x {n}: XLA dense bf16 {dense_s * 1e3:.2f} ms; per product, bf16 / float32 result: "
        + ", ".join(f"{op} {xla_ms[op + '/bf16_result']:.2f} / {xla_ms[op + '/f32_result']:.2f} ms" for op in PRODUCTS),
        flush=True,
    )
    rows = []
    for bs in blocks:
        for density in densities:
            grid = (n // bs, n // bs)
            layout = jbs.Layout.from_mask(jbs.layouts.random(grid, density, seed=bs), bs)
            w = jnp.asarray(rng.standard_normal(layout.w_shape, np.float32), jnp.bfloat16)
            blocks_present = int(layout.tables.col_ptr[-1])
            flops = 2.0 * n * blocks_present * bs * bs
            calls = {}
            for op, fn in products(layout).items():
                for isa in filter(None, (matrix, widening)):
                    calls[f"{op}/{isa}"] = (isa, fn, (x, w, dy))
            times = time_round_robin(calls, repeats)
            row = {
                "block_size": bs,
                "density": density,
                "block_fraction": blocks_present / (grid[0] * grid[1]),
                "gflop": flops / 1e9,
            }
            for op in PRODUCTS:
                for isa in filter(None, (matrix, widening)):
                    s = times[f"{op}/{isa}"]
                    row[f"{op}_{isa}_ms"] = s * 1e3
                    row[f"{op}_{isa}_vs_dense"] = dense_s / s
                    row[f"{op}_{isa}_vs_best_dense"] = best_dense[op] / s
                    if isa == "amx" and peak:
                        row[f"{op}_amx_peak_fraction"] = flops / s / peak
            rows.append(row)
            shown = " ".join(
                f"{op} {row[f'{op}_{isa}_vs_dense']:.1f}x" for op in PRODUCTS for isa in filter(None, (matrix,))
            )
            print(f"  bs {bs:3d} density {density:<5}: {matrix}: {shown}", flush=True)
    return {"n": n, "dense_bf16_ms": dense_s * 1e3, "xla_dense_ms": xla_ms, "rows": rows}


def report_header(benchmark: str, where: dict) -> dict:
    """The fields every CPU bf16 report starts with: what ran, where (``measured_on``) and when."""
    return {
        "benchmark": benchmark,
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        **where,
        "cpu_isa_detected": jbs.extension_info()["cpu_isa_detected"],
        "cpu_cores": cpu_cores(),
        "jax": jax.__version__,
    }


def targets(sizes: list[dict], matrix: str | None) -> dict:
    """The goals of the matrix units' path, per size: the worst product's speedup at density 1
    (>= 3x) and at density 0.1 (>= 25x) over XLA's dense bf16 ``x @ W``; beside them, the
    same against XLA's faster form of each product. The goals are set for AMX tiles
    (``applies``); on a CPU whose matrix path is AVX512-BF16 the figures are kept, not judged."""
    out = {}
    if matrix is None:
        return out
    for size in sizes:
        for density, goal in ((1.0, 3.0), (0.1, 25.0)):
            picked = [r for r in size["rows"] if r["density"] == density]
            if not picked:
                continue
            by_block = {r["block_size"]: min(r[f"{op}_{matrix}_vs_dense"] for op in PRODUCTS) for r in picked}
            best = max(by_block, key=by_block.get)
            out[f"{size['n']}_density_{density}"] = {
                "goal": goal,
                "applies": matrix == "amx",
                "worst_product_by_block": by_block,
                "best_block": best,
                "met": by_block[best] >= goal,
                # the same against XLA's faster form of each product (not the goal's baseline)
                "worst_product_vs_best_dense_by_block": {
                    r["block_size"]: min(r[f"{op}_{matrix}_vs_best_dense"] for op in PRODUCTS) for r in picked
                },
            }
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1024,4096", help="square sizes n (x [n, n] @ W [n, n])")
    parser.add_argument("--blocks", default="16,32,64,128")
    parser.add_argument("--densities", default="1,0.5,0.25,0.1,0.05")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per size (plus one warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args(argv)
    matrix, widening = instruction_sets()
    peak = tune.amx_peak_flops() if matrix == "amx" else None
    where = measured_on()
    print(
        f"{where['device']}: matrix units {matrix or 'none'}, widening {widening}; AMX peak {peak / 1e9:.0f} GFLOP/s"
        if peak
        else f"{where['device']}: matrix units {matrix or 'none'}"
    )
    sizes = []
    for n in (int(s) for s in args.sizes.split(",")):
        repeats = args.repeats if n <= 2048 else max(1, args.repeats // 2)
        sizes.append(
            measure_size(
                n,
                [int(b) for b in args.blocks.split(",")],
                [float(d) for d in args.densities.split(",")],
                repeats,
                matrix,
                widening,
                peak,
            )
        )
    report = {
        **report_header("cpu_bf16", where),
        "matrix_isa": matrix,
        "widening_isa": widening,
        "amx_peak_gflops": peak / 1e9 if peak else None,
        "sizes": sizes,
        "targets": targets(sizes, matrix),
    }
    write_report(args.out, "cpu_bf16", report)
    for name, t in report["targets"].items():
        verdict = ("met" if t["met"] else "NOT met") if t["applies"] else f"not judged: no AMX, {matrix} here"
        print(
            f"{name}: best block {t['best_block']}: {t['worst_product_by_block'][t['best_block']]:.1f}x "
            f"(goal on an AMX machine {t['goal']}x): {verdict}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
