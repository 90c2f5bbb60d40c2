"""Host cost of one jitted bsmm call against a jitted ``jnp.dot`` with as many arguments.

On a problem so small that the product itself costs next to nothing, the time per call
of N back-to-back calls (then one block) is what JAX, XLA and the custom call's handler
spend around the product: the dispatch cost that a training step pays per op. Each bsmm
op is timed with its layout passed as a jit argument (the layout's pytree leaves: seven
int32 tables) and closed over (constants), and compared with ``jnp.dot`` given the same
number of arguments (the extra ones unused but kept, ``keep_unused=True``, so that they
reach the executable as the tables do), in the same process.

    ratio = bsmm time per call / dense time per call with as many arguments

Usage::

    python bench/dispatch.py                  # default device; prints a table
    python bench/dispatch.py --json bench/results/dispatch-cpu.json --calls 3000
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs
from jax_blocksparse.ops import paths

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _report import git_commit  # noqa: E402


def per_call_us(fn, *args, calls: int, repeats: int = 5) -> float:
    """Best over ``repeats`` of (time of ``calls`` back-to-back calls, then a block) / calls."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def measure(calls: int, block_size: int = 16, grid=(4, 4), rows: int = 8) -> list[dict]:
    mask = np.random.default_rng(0).random(grid) < 0.5
    layout = jbs.Layout.from_mask(mask, block_size)
    c, k = layout.shape
    x, dy = jnp.ones((rows, c)), jnp.ones((rows, k))
    w = jnp.ones(layout.w_shape)
    dense_w = jnp.ones((c, k))
    tables = jax.tree_util.tree_leaves(layout)
    ops = {
        "fprop": (lambda x, w, dy, lay: jbs.bsmm(x, w, lay), lambda x, W, dy: x @ W),
        "bprop": (lambda x, w, dy, lay: jbs.bsmm(dy, w, lay, transpose=True), lambda x, W, dy: dy @ W.T),
        "updat": (lambda x, w, dy, lay: jbs.bsmm_updat(x, dy, lay), lambda x, W, dy: x.T @ dy),
    }
    rows_out = []
    for name, (sparse, dense) in ops.items():
        as_argument = per_call_us(jax.jit(sparse), x, w, dy, layout, calls=calls)
        closed = per_call_us(jax.jit(lambda x, w, dy, s=sparse: s(x, w, dy, layout)), x, w, dy, calls=calls)
        # keep_unused: the extra arguments reach the executable, as the layout's tables do.
        dense_many = per_call_us(
            jax.jit(lambda x, W, dy, *unused, d=dense: d(x, W, dy), keep_unused=True),
            x,
            dense_w,
            dy,
            *tables,
            calls=calls,
        )
        dense_few = per_call_us(jax.jit(dense), x, dense_w, dy, calls=calls)
        rows_out.append(
            dict(
                op=name,
                bsmm_layout_argument_us=as_argument,
                dense_same_arguments_us=dense_many,
                bsmm_layout_closed_over_us=closed,
                dense_us=dense_few,
                ratio_argument=as_argument / dense_many,
                ratio_closed_over=closed / dense_few,
            )
        )
    return rows_out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="back-to-back calls per timing")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    rows = measure(args.calls)
    print(
        f"host time per jitted call, {device.platform} ({device.device_kind}); "
        f"bsmm path: {paths.describe_path(device.platform)}"
    )
    print(
        f"{'op':6} {'bsmm(arg) us':>13} {'dot(same #args) us':>19} {'ratio':>6}   "
        f"{'bsmm(closed) us':>16} {'dot us':>7} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['op']:6} {r['bsmm_layout_argument_us']:13.1f} {r['dense_same_arguments_us']:19.1f} "
            f"{r['ratio_argument']:6.2f}   {r['bsmm_layout_closed_over_us']:16.1f} {r['dense_us']:7.1f} "
            f"{r['ratio_closed_over']:6.2f}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                dict(
                    benchmark="dispatch",
                    device=f"{device.platform}:{device.device_kind}",
                    host=platform.node(),
                    cpu_count=__import__("os").cpu_count(),
                    jax=jax.__version__,
                    commit=git_commit(),
                    date=datetime.date.today().isoformat(),
                    calls=args.calls,
                    rows=rows,
                ),
                indent=2,
            )
            + "\n"
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
