"""The bfloat16 block-sparse convolution on the CPU's matrix units against the widening kernels and XLA's dense conv.

For each shape of ``--shapes`` (batch x map x channels, a 3 x 3 SAME convolution over an
NHWC map, the residual-block convolution of a ResNet stage), each block size of
``--blocks`` and each density of ``--densities`` (random layouts, every block row and
column kept), three products are timed in bfloat16 (bf16 outputs, float32 sums):

- ``conv`` y = bsconv(x, w), ``dx`` its input gradient and ``dw`` its weight gradient,
  with the AMX kernels and with the kernels that widen bf16 to float32 (``avx512``),
  forced in turn through ``JAX_BLOCKSPARSE_CPU_ISA`` in this one process;
- XLA's dense bf16 convolution of the same shapes (``lax.conv_general_dilated``), forward
  and its two gradients, once per shape: the baselines of every ratio.

Each row gives the milliseconds, each product's speedup over XLA's dense product of the
same kind, and for AMX the share of the unit's peak reached (the useful FLOPs, 2 x
positions x 9 x blocks x bs^2, over the time, divided by the peak measured in this run).
Variants are timed round-robin ``--repeats`` times after one warm-up; medians are
reported. On a CPU without AMX there is nothing to compare: it says so and exits.

Usage::

    python bench/cpu_bf16_conv.py                      # about a minute on 2 cores
    python bench/cpu_bf16_conv.py --shapes 8x32x128 --blocks 32 --densities 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import measured_on, write_report  # noqa: E402
from cpu_bf16 import instruction_sets, report_header, time_round_robin  # noqa: E402

import jax_blocksparse as jbs  # noqa: E402
from jax_blocksparse import tune  # noqa: E402

PRODUCTS = ("conv", "dx", "dw")
DIMENSIONS = ("NHWC", "HWIO", "NHWC")


def parse_shape(text: str) -> tuple[int, int, int]:
    """ "8x32x128" -> (batch 8, map 32 x 32, channels 128)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is BATCHxMAPxCHANNELS of positive ints, got {text!r}")
    return tuple(int(p) for p in parts)


def with_gradients(conv):
    """{"conv", "dx", "dw"}: jitted (x, w, dy) -> the product of ``conv(x, w)``."""

    def grads(x, w, dy):
        return jax.vjp(conv, x, w)[1](dy)

    return {
        "conv": jax.jit(lambda x, w, dy: conv(x, w)),
        "dx": jax.jit(lambda x, w, dy: grads(x, w, dy)[0]),
        "dw": jax.jit(lambda x, w, dy: grads(x, w, dy)[1]),
    }


def dense_conv(x, W):
    """XLA's 3 x 3 SAME convolution of NHWC x with HWIO W."""
    return jax.lax.conv_general_dilated(x, W, (1, 1), "SAME", dimension_numbers=DIMENSIONS)


def mask_of(grid: int, density: float, seed: int) -> np.ndarray:
    """A random block mask of about ``density`` with every block row and column kept."""
    if density >= 1:
        return np.ones((grid, grid), bool)
    return jbs.layouts.random((grid, grid), density, seed=seed) | np.eye(grid, dtype=bool)


def measure_shape(shape, blocks, densities, repeats: int, widening: str, peak) -> dict:
    batch, size, channels = shape
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, size, size, channels), np.float32), jnp.bfloat16)
    dy = jnp.asarray(rng.standard_normal((batch, size, size, channels), np.float32), jnp.bfloat16)
    W = jnp.asarray(rng.standard_normal((3, 3, channels, channels), np.float32) / (3 * channels**0.5), jnp.bfloat16)
    dense = with_gradients(dense_conv)
    dense_s = time_round_robin({op: (None, fn, (x, W, dy)) for op, fn in dense.items()}, repeats)
    shown = ", ".join(f"{op} {dense_s[op] * 1e3:.2f}" for op in PRODUCTS)
    print(f"{batch} x {size} x {size} x {channels}: XLA dense bf16 {shown} ms", flush=True)
    rows = []
    for bs in blocks:
        if channels % bs:
            continue
        for density in densities:
            layout = jbs.Layout.from_mask(mask_of(channels // bs, density, seed=bs), bs)
            w = jnp.asarray(rng.standard_normal((layout.capacity, 3, 3, bs, bs), np.float32) / 30, jnp.bfloat16)
            present = int(layout.tables.col_ptr[-1])
            flops = 2.0 * batch * size * size * 9 * present * bs * bs
            fns = with_gradients(lambda x, w, layout=layout: jbs.bsconv(x, w, layout, impl="kernels"))
            calls = {f"{op}/{isa}": (isa, fn, (x, w, dy)) for op, fn in fns.items() for isa in ("amx", widening)}
            times = time_round_robin(calls, repeats)
            row = {"block_size": bs, "density": density, "block_fraction": present / (channels // bs) ** 2}
            row["gflop"] = flops / 1e9
            for op in PRODUCTS:
                for isa in ("amx", widening):
                    s = times[f"{op}/{isa}"]
                    row[f"{op}_{isa}_ms"] = s * 1e3
                    row[f"{op}_{isa}_vs_dense"] = dense_s[op] / s
                row[f"{op}_amx_vs_{widening}"] = times[f"{op}/{widening}"] / times[f"{op}/amx"]
                if peak:
                    row[f"{op}_amx_peak_fraction"] = flops / times[f"{op}/amx"] / peak
            rows.append(row)
            shown = " ".join(
                f"{op} {row[f'{op}_amx_ms']:.2f} ms ({row[f'{op}_amx_vs_{widening}']:.1f}x {widening}, "
                f"{row[f'{op}_amx_vs_dense']:.1f}x dense)"
                for op in PRODUCTS
            )
            print(f"  bs {bs:3d} density {density:<5}: {shown}", flush=True)
    return {
        "batch": batch,
        "map": size,
        "channels": channels,
        "dense_bf16_ms": {op: dense_s[op] * 1e3 for op in PRODUCTS},
        "rows": rows,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shape, nargs="+", default=[(8, 32, 128), (8, 16, 256), (32, 8, 256)])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--densities", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (plus one warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/...)")
    args = parser.parse_args(argv)
    matrix, widening = instruction_sets()
    if matrix != "amx":
        print(f"this CPU's widest kernels are {widening!r}: no AMX tiles to compare (nothing measured)")
        return 0
    peak = tune.amx_peak_flops()
    where = measured_on()
    print(f"{where['device']}: AMX against {widening}; AMX peak {peak / 1e9:.0f} GFLOP/s")
    shapes = [measure_shape(s, args.blocks, args.densities, args.repeats, widening, peak) for s in args.shapes]
    report = {
        **report_header("cpu_bf16_conv", where),
        "widening_isa": widening,
        "amx_peak_gflops": peak / 1e9,
        "shapes": shapes,
    }
    write_report(args.out, "cpu_bf16_conv", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
