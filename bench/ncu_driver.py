"""Runs each jbs kernel once, for Nsight Compute: one problem per op x dtype x block size.

Each problem (4096 x 4096 weight, N = 4096, block density 0.1 by default) is jitted,
called once and waited for, in a fixed order: kernel path (the Ampere-design targets, then
the Hopper ones where they run: ``--paths``), dtype, then block size, then op (fprop,
bprop, updat). With ``--kernel-name regex:jbs`` ncu then profiles one launch per
problem (an op launches one jbs kernel; XLA's own kernels, random inputs included,
are filtered out). ``--problems`` writes that order as JSON before anything runs;
bench/ncu_summary.py pairs it with ncu's CSV.

    ncu --clock-control none --kernel-name-base demangled --kernel-name regex:jbs --csv \\
        --page raw --metrics gpu__time_duration.sum,... --log-file out/ncu_raw.csv \\
        python3 bench/ncu_driver.py --problems out/ncu_problems.json
    python3 bench/ncu_summary.py out/ncu_raw.csv --problems out/ncu_problems.json --json out/ncu_summary.json

It runs anywhere (on CPU the CPU kernels run: useful only to test it).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs
from jax_blocksparse.ops import paths

OPS = ("fprop", "bprop", "updat")
# What each op launches: DSD (dense = dense x sparse) or SDD (sparse = dense x dense).
FAMILY = {"fprop": "dsd", "bprop": "dsd_t", "updat": "sdd"}


def problems(args) -> list[dict]:
    c, k, n = args.size
    out = []
    for path in args.paths:
        for dtype in args.dtypes:
            for bs in args.block_sizes:
                if c % bs or k % bs:
                    continue
                for op in args.ops:
                    out.append(
                        dict(
                            index=len(out),
                            path=path,
                            op=op,
                            family=FAMILY[op],
                            dtype=dtype,
                            block_size=bs,
                            density=args.density,
                            size=dict(C=c, K=k, N=n),
                        )
                    )
    return out


def _fn(op):
    if op == "fprop":
        return jax.jit(lambda x, w, layout: jbs.bsmm(x, w, layout))
    if op == "bprop":
        return jax.jit(lambda g, w, layout: jbs.bsmm(g, w, layout, transpose=True))
    return jax.jit(lambda x, g, layout: jbs.bsmm_updat(x, g, layout))


def run(args, plan: list[dict]) -> list[dict]:
    c, k, n = args.size
    key = jax.random.key(args.seed)
    fns = {(path, op): _fn(op) for path in args.paths for op in OPS}  # a jit cache per path
    inputs, layouts = {}, {}
    for p in plan:
        dtype, bs, op = p["dtype"], p["block_size"], p["op"]
        if dtype not in inputs:
            kx, kg = jax.random.split(jax.random.fold_in(key, len(inputs)))
            inputs = {dtype: (jax.random.normal(kx, (n, c), dtype), jax.random.normal(kg, (n, k), dtype))}
        x, g = inputs[dtype]
        if (dtype, bs) not in layouts:
            mask = jbs.layouts.random((c // bs, k // bs), args.density, seed=args.seed)
            layout = jbs.Layout.from_mask(mask, bs)
            w = (jax.random.normal(key, layout.w_shape, jnp.float32) / np.sqrt(c * layout.density)).astype(dtype)
            layouts = {(dtype, bs): (layout, w)}
        layout, w = layouts[(dtype, bs)]
        p["nnz"] = layout.nnz
        p["density"] = layout.density
        operands = {"fprop": (x, w, layout), "bprop": (g, w, layout), "updat": (x, g, layout)}[op]
        with paths.hopper_gate(p["path"] == "hopper"):  # the gate is read when the problem is lowered
            fn = fns[(p["path"], op)].lower(*operands).compile()  # compile first: only the call launches a kernel
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*operands))
        p["wall_s"] = time.perf_counter() - t0
        print(
            f"{p['index']:3d} {p['path']:6} {op:6} {dtype:9} bs={bs:<4d} nnz={p['nnz']:<6d} "
            f"{p['wall_s'] * 1e3:9.3f} ms (wall)",
            flush=True,
        )
    return plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, nargs=3, metavar=("C", "K", "N"), default=[4096, 4096, 4096])
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument(
        "--dtypes", nargs="+", choices=["bfloat16", "float16", "float32"], default=["bfloat16", "float16", "float32"]
    )
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS))
    p.add_argument(
        "--paths",
        nargs="+",
        choices=["ampere", "hopper"],
        default=None,
        help="kernel paths, each problem once per path (default: ampere, and hopper where the sm_90a kernels run)",
    )
    p.add_argument(
        "--impl",
        choices=jbs.config.IMPLEMENTATIONS,
        default="kernels",
        help="implementation to trace with (default kernels: the reference launches no jbs kernel)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--problems", type=Path, help="write the problems, in launch order, here (JSON)")
    args = p.parse_args(argv)
    if args.paths is None:
        args.paths = ["ampere", "hopper"] if paths.hopper_available() else ["ampere"]
    return args


def main(argv=None):
    args = parse_args(argv)
    plan = problems(args)
    meta = dict(
        device=str(jax.devices()[0]),
        device_kind=getattr(jax.devices()[0], "device_kind", ""),
        impl=args.impl,
        problems=plan,
    )
    if args.problems:
        args.problems.parent.mkdir(parents=True, exist_ok=True)
        args.problems.write_text(json.dumps(meta, indent=2))
    with jbs.config.implementation(args.impl):
        run(args, plan)
    if args.problems:  # again, with nnz and wall times
        args.problems.write_text(json.dumps(meta, indent=2))
    return meta


if __name__ == "__main__":
    main()
