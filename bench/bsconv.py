"""Benchmark bsconv against the dense convolution (``lax.conv``, cuDNN on a GPU).

For each (dtype, block size, density) it times forward and forward+backward of a 2-D
3x3 convolution, block-sparse over the channel dimensions, against ``lax.conv`` of the
same shapes in the same run (dense then sparse for each row, so that both see the same
machine load), and prints efficiency (dense_time * density / sparse_time), speedup
(dense_time / sparse_time), the useful GFLOP/s of each and, on a CPU, their fraction of
its FMA peak (``--peak-gflops``, default: cores x 2 FMA pipes x SIMD lanes x 2 x clock,
read from /proc/cpuinfo), and the load average beside each row (the machine may be
shared); ``--json`` writes the results.

    python bench/bsconv.py                       # preset by device: cpu or gpu
    python bench/bsconv.py --channels 512 --spatial 28 --batch 64 --block-sizes 32 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from _report import git_commit
from _timing import time_fn

import jax_blocksparse as jbs

PRESETS = {
    "cpu": dict(
        batch=8,
        spatial=16,
        channels=256,
        kernel=3,
        block_sizes=[32],
        densities=[1.0, 0.5, 0.25, 0.1],
        dtypes=["float32"],
    ),
    "gpu": dict(
        batch=64,
        spatial=28,
        channels=512,
        kernel=3,
        block_sizes=[16, 32, 64],
        densities=[1.0, 0.5, 0.25, 0.1, 0.05],
        dtypes=["bfloat16", "float32"],
    ),
}


def cpu_fma_peak_gflops() -> float | None:
    """Float32 FMA peak of this machine's CPUs in GFLOP/s: cores x 2 FMA pipes x lanes x 2
    flops x clock (the clock of /proc/cpuinfo; lanes 16 with AVX-512, 8 with AVX2), or None
    where that cannot be read."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    mhz = [float(line.split(":")[1]) for line in info.splitlines() if line.startswith("cpu MHz")]
    flags = next((line for line in info.splitlines() if line.startswith("flags")), "")
    if not mhz:
        return None
    lanes = 16 if " avx512f" in flags else 8 if " avx2" in flags else 4
    return (os.cpu_count() or 1) * 2 * lanes * 2 * max(mhz) / 1e3


def _dense_flops(args, name: str) -> float:
    """Multiply-add flops of the dense convolution (SAME, stride 1); the backward pass is twice
    the forward."""
    fwd = 2.0 * args.batch * args.spatial**2 * args.channels**2 * args.kernel**2
    return fwd if name == "fwd" else 3 * fwd


def _problems(args, bs, density, dtype, key):
    c = args.channels
    mask = jbs.layouts.random((c // bs, c // bs), density, seed=args.seed)
    layout = jbs.Layout.from_mask(mask, bs)
    kx, kw = jax.random.split(key)
    ksz = (args.kernel, args.kernel)
    x = jax.random.normal(kx, (args.batch, args.spatial, args.spatial, c), dtype)
    w = jax.random.normal(kw, (layout.capacity, *ksz, bs, bs), dtype)
    W = jbs.conv_to_dense(w, layout)

    def sparse(x, w, layout):
        return jbs.bsconv(x, w, layout, padding="SAME")

    def dense(x, W):
        return jax.lax.conv_general_dilated(x, W, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def with_grad(f):
        return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1)))

    return layout, {
        "fwd": ((jax.jit(sparse), (x, w, layout)), (jax.jit(dense), (x, W))),
        "fwd+bwd": ((with_grad(sparse), (x, w, layout)), (with_grad(dense), (x, W))),
    }


def run(args):
    device = jax.devices()[0]
    peak = args.peak_gflops if args.peak_gflops else cpu_fma_peak_gflops() if device.platform == "cpu" else None
    rows = []
    print(
        f"{'pass':8} {'dtype':9} {'bs':>4} {'density':>8} {'dense ms':>9} {'sparse ms':>10} "
        f"{'effic.':>7} {'speedup':>8} {'dense GF/s':>10} {'sparse GF/s':>11} {'load':>5}"
    )
    key = jax.random.key(args.seed)
    for dtype in args.dtypes:
        for bs in args.block_sizes:
            for density in args.densities:
                layout, problems = _problems(args, bs, density, dtype, key)
                for name, ((sparse, s_args), (dense, d_args)) in problems.items():
                    t_dense = time_fn(dense, *d_args, repeats=args.repeats)
                    t_sparse = time_fn(sparse, *s_args, repeats=args.repeats)
                    d = layout.density
                    flops = _dense_flops(args, name)
                    row = dict(
                        pass_=name,
                        dtype=dtype,
                        block_size=bs,
                        density=d,
                        dense_s=t_dense,
                        sparse_s=t_sparse,
                        efficiency=t_dense * d / t_sparse,
                        speedup=t_dense / t_sparse,
                        dense_gflops=flops / t_dense / 1e9,
                        sparse_gflops=flops * d / t_sparse / 1e9,
                        load_average=os.getloadavg()[0],
                    )
                    if peak:
                        row["dense_peak_fraction"] = row["dense_gflops"] / peak
                        row["sparse_peak_fraction"] = row["sparse_gflops"] / peak
                    rows.append(row)
                    print(
                        f"{name:8} {dtype:9} {bs:>4} {d:>8.3f} {t_dense * 1e3:>9.3f} {t_sparse * 1e3:>10.3f} "
                        f"{row['efficiency']:>7.2f} {row['speedup']:>8.2f} {row['dense_gflops']:>10.1f} "
                        f"{row['sparse_gflops']:>11.1f} {row['load_average']:>5.1f}",
                        flush=True,
                    )
    return dict(
        device=str(device),
        device_kind=getattr(device, "device_kind", device.platform),
        jax_version=jax.__version__,
        implementation=jbs.config.get_implementation(),
        cuda_kernels=jbs.has_cuda_kernels(),
        cpu_kernels=jbs.has_cpu_kernels(),
        cpu_isa=jbs.extension_info().get("cpu_isa"),
        cpu_count=os.cpu_count(),
        peak_gflops=peak,
        commit=git_commit(),
        date=datetime.date.today().isoformat(),
        shape=dict(batch=args.batch, spatial=args.spatial, channels=args.channels, kernel=args.kernel),
        results=rows,
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int)
    p.add_argument("--spatial", type=int)
    p.add_argument("--channels", type=int)
    p.add_argument("--kernel", type=int)
    p.add_argument("--block-sizes", type=int, nargs="+")
    p.add_argument("--densities", type=float, nargs="+")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peak-gflops", type=float, help="the device's float32 FMA peak (default: estimated on a CPU)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    preset = PRESETS[args.preset or ("gpu" if jax.devices()[0].platform == "gpu" else "cpu")]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
