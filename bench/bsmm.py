"""Benchmark bsmm (fprop, bprop, updat) against the dense product on the same device.

For each (op, dtype, block size, density) it times the block-sparse product and the
dense product of the same shape in the same process, and reports

    efficiency = dense_time * density / sparse_time      (1.0: blocks at dense speed)
    speedup    = dense_time / sparse_time                (= efficiency / density)
    bound      = best speedup a perfect kernel could reach on this device (roofline),
                 where the device's peak numbers are known (H100, H200), else "n/a"

Peers, where importable and on a GPU: torch's BSR matmul (Triton ``bsr_dense_mm``)
and ``jax.experimental.sparse`` (BCOO, element-sparse), both on the fprop problem.

On CPU the block-sparse column is the native CPU kernels (the default CPU path when
built) and an extra column times the pure-JAX reference lowering of the same op.

Usage::

    python bench/bsmm.py                       # preset chosen by the device: cpu or gpu
    python bench/bsmm.py --preset cpu --json bench/results/cpu.json
    python bench/bsmm.py --ops fprop --block-sizes 32 64 --densities 1 0.1 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs

PRESETS = {
    # The CPU measurement: 4096 x 4096 weight, block 32, N = 256, float32.
    "cpu": dict(size=(4096, 4096, 256), block_sizes=[32], densities=[1.0, 0.5, 0.25, 0.1, 0.05],
                dtypes=["float32"], ops=["fprop", "bprop", "updat"]),
    "gpu": dict(size=(4096, 4096, 4096), block_sizes=[8, 16, 32, 64, 128],
                densities=[1.0, 0.5, 0.25, 0.1, 0.05, 0.01], dtypes=["bfloat16", "float16", "float32"],
                ops=["fprop", "bprop", "updat"]),
    "quick": dict(size=(512, 512, 128), block_sizes=[32], densities=[1.0, 0.1],
                  dtypes=["float32"], ops=["fprop", "bprop", "updat"]),
}

# Peak dense throughput (FLOP/s) by dtype and memory bandwidth (B/s), for the roofline.
DEVICE_PEAKS = {
    "H100": dict(flops={"bfloat16": 990e12, "float16": 990e12, "float32": 67e12}, bandwidth=3.35e12),
    "H200": dict(flops={"bfloat16": 990e12, "float16": 990e12, "float32": 67e12}, bandwidth=4.8e12),
}


def time_fn(fn, *args, repeats: int, min_time: float = 0.2) -> float:
    """Median seconds per call: calls are dispatched back to back, then blocked on."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    inner = int(min(max(1, min_time / one), 200))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return float(np.median(samples))


def roofline_bound(op, c, k, n, density, dtype, device_kind):
    """Best achievable sparse speedup over dense given compute and memory limits."""
    peaks = next((p for name, p in DEVICE_PEAKS.items() if name in device_kind), None)
    if peaks is None:
        return None
    item = np.dtype(dtype).itemsize
    flops = 2.0 * n * c * k
    weight = c * k * item
    acts = {"fprop": (n * c + n * k), "bprop": (n * k + n * c), "updat": (n * c + n * k)}[op] * item

    def model(d):
        return max(flops * d / peaks["flops"][dtype], (acts + weight * d) / peaks["bandwidth"])

    return model(1.0) / model(density)


def _problem(op, c, k, n, layout, dtype, key):
    kx, kw, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, c), dtype)
    g = jax.random.normal(kg, (n, k), dtype)
    w = jax.random.normal(kw, layout.w_shape, dtype)
    W = jax.random.normal(kw, (c, k), dtype)
    if op == "fprop":
        sparse = jax.jit(lambda x, w, layout: jbs.bsmm(x, w, layout))
        dense = jax.jit(lambda x, W: jnp.dot(x, W, preferred_element_type=jnp.float32).astype(dtype))
        return (sparse, (x, w, layout)), (dense, (x, W))
    if op == "bprop":
        sparse = jax.jit(lambda g, w, layout: jbs.bsmm(g, w, layout, transpose=True))
        dense = jax.jit(lambda g, W: jnp.dot(g, W.T, preferred_element_type=jnp.float32).astype(dtype))
        return (sparse, (g, w, layout)), (dense, (g, W))
    sparse = jax.jit(lambda x, g, layout: jbs.bsmm_updat(x, g, layout))
    dense = jax.jit(lambda x, g: jnp.dot(x.T, g, preferred_element_type=jnp.float32).astype(dtype))
    return (sparse, (x, g, layout)), (dense, (x, g))


def _torch_bsr_time(c, k, n, bs, mask, dtype, repeats):
    """torch BSR (Triton bsr_dense_mm) on y.T = W.T @ x.T, or None where unavailable."""
    try:
        import torch
        from torch.sparse._triton_ops import bsr_dense_mm
    except Exception:
        return None
    if not torch.cuda.is_available():
        return None
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    dense_mask = torch.from_numpy(np.kron(mask.T, np.ones((bs, bs), bool))).cuda()
    wt = (torch.randn(k, c, device="cuda", dtype=tdtype) * dense_mask).to_sparse_bsr((bs, bs))
    xt = torch.randn(c, n, device="cuda", dtype=tdtype)
    try:
        bsr_dense_mm(wt, xt)
    except Exception:
        return None
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            bsr_dense_mm(wt, xt)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / 10)
    return float(np.median(samples))


def _jax_sparse_time(x, W_masked, repeats):
    """jax.experimental.sparse BCOO (element-sparse) x @ W, or None where unavailable."""
    try:
        from jax.experimental import sparse as jsparse

        W_bcoo = jsparse.BCOO.fromdense(W_masked)
        fn = jax.jit(lambda x, W: x @ W)
        return time_fn(fn, x, W_bcoo, repeats=repeats)
    except Exception:
        return None


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run(args) -> dict:
    c, k, n = args.size
    device = jax.devices()[0]
    device_kind = getattr(device, "device_kind", device.platform)
    results = []
    header = (f"{'op':6} {'dtype':9} {'bs':>4} {'density':>8} {'dense ms':>9} {'sparse ms':>10} "
              f"{'effic.':>7} {'speedup':>8} {'bound':>6} {'torch_bsr':>10} {'jax_bcoo':>9} {'ref ms':>9}")
    print(header)
    print("-" * len(header))
    key = jax.random.key(args.seed)
    for dtype in args.dtypes:
        for bs in args.block_sizes:
            if c % bs or k % bs:
                print(f"skip bs={bs}: {c}x{k} not divisible")
                continue
            for density in args.densities:
                mask = jbs.layouts.random((c // bs, k // bs), density, seed=args.seed)
                layout = jbs.Layout.from_mask(mask, bs)
                real_density = layout.density
                for op in args.ops:
                    (sparse, s_args), (dense, d_args) = _problem(op, c, k, n, layout, dtype, key)
                    t_dense = time_fn(dense, *d_args, repeats=args.repeats)
                    t_sparse = time_fn(sparse, *s_args, repeats=args.repeats)
                    bound = roofline_bound(op, c, k, n, real_density, dtype, device_kind)
                    row = dict(op=op, dtype=dtype, block_size=bs, density=real_density, nnz=layout.nnz,
                               dense_s=t_dense, sparse_s=t_sparse,
                               efficiency=t_dense * real_density / t_sparse, speedup=t_dense / t_sparse,
                               roofline_speedup_bound=bound)
                    if op == "fprop" and args.peers and device.platform == "gpu":
                        row["torch_bsr_s"] = _torch_bsr_time(c, k, n, bs, mask, dtype, args.repeats)
                        W_masked = jbs.to_dense(jbs.from_dense(d_args[1], layout), layout)
                        row["jax_bcoo_s"] = _jax_sparse_time(d_args[0], W_masked, args.repeats)
                    if args.reference:  # the switch clears JAX's caches: `sparse` is traced anew
                        with jbs.config.implementation("reference"):
                            row["reference_s"] = time_fn(sparse, *s_args, repeats=args.repeats)
                    results.append(row)

                    def ms(v):
                        return f"{v * 1e3:.3f}" if v else "-"

                    print(f"{op:6} {dtype:9} {bs:>4} {real_density:>8.3f} {t_dense * 1e3:>9.3f} "
                          f"{t_sparse * 1e3:>10.3f} {row['efficiency']:>7.2f} {row['speedup']:>8.2f} "
                          f"{(f'{bound:.1f}' if bound else 'n/a'):>6} {ms(row.get('torch_bsr_s')):>10} "
                          f"{ms(row.get('jax_bcoo_s')):>9} {ms(row.get('reference_s')):>9}", flush=True)
    return dict(
        device=str(device), device_kind=device_kind, platform=device.platform,
        jax_version=jax.__version__, jax_blocksparse_version=jbs.__version__,
        implementation=jbs.config.get_implementation(), cuda_kernels=jbs.has_cuda_kernels(),
        cpu_kernels=jbs.has_cpu_kernels(), extension=jbs._native.extension_info(),
        commit=git_commit(), date=datetime.date.today().isoformat(),
        host=platform.node(), python=sys.version.split()[0],
        size=dict(C=c, K=k, N=n), results=results,
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="parameter set; default 'gpu' on a GPU, else 'cpu'")
    p.add_argument("--size", type=int, nargs=3, metavar=("C", "K", "N"))
    p.add_argument("--block-sizes", type=int, nargs="+")
    p.add_argument("--densities", type=float, nargs="+")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ops", nargs="+", choices=["fprop", "bprop", "updat"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-peers", dest="peers", action="store_false", help="skip torch / jax.experimental.sparse")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="also time the pure-JAX reference lowering (default: on CPU only)")
    p.add_argument("--json", type=Path, help="write results here")
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    preset = PRESETS[args.preset or ("gpu" if on_gpu else "cpu")]
    if args.reference is None:
        args.reference = not on_gpu
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
