"""One mixture-of-experts layer, forward + backward: the dropless block-sparse MoE against the usual ways.

Four layers of the same shape (``--tokens`` tokens of width ``--d-model``, ``--experts``
experts of ``--d-ff`` hidden units, ``--top-k`` experts per token, GELU), each timed as one
jitted ``jax.value_and_grad`` of a sum-of-squares loss with respect to the inputs and
every weight:

- ``block-sparse``: :func:`jax_blocksparse.layers.moe.forward`, the dropless layer
  (tokens sorted by expert and padded per expert to ``--block-size``; the up product an
  SDD, the down product a DSD over the routing's topology);
- ``capacity``: the capacity-factor MoE with batched per-expert matmuls
  (``--capacity-factor``, 1.25: each expert takes ``ceil(1.25 * T * k / E)`` rows, the
  rest are dropped; tokens scattered into [E, capacity, D], two batched einsums);
- ``ragged_dot``: the same routing, rows sorted by expert without padding, through
  ``jax.lax.ragged_dot``;
- ``dense``: a dense MLP with the same active FLOPs (d_ff = ``top_k * d_ff``), no router.

The router (a float32 [D, E] product and top-k) is in every MoE row. The rows are timed
round-robin ``--steps`` times after ``--warmup`` steps, so load falls on all alike; the
medians are reported, with each row's time over the block-sparse layer's. ``copies``
times, alone, the transposes the block-sparse composition adds (the rows [R, D] and the
down product's [D, R] result, forward and backward), as a share of its step.

Usage::

    python bench/moe.py                                  # the table in the docs (minutes on 2 CPU cores)
    python bench/moe.py --tokens 256 --d-model 64 --d-ff 128 --steps 2 --warmup 1   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import git_commit, measured_on, write_report  # noqa: E402

from jax_blocksparse.layers import moe as moe_core  # noqa: E402
from jax_blocksparse.ops import moe as moe_ops  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _router(x, router, top_k):
    return moe_core.route(moe_core.router_logits(x, router), top_k)


def block_sparse(params, x, args, dtype):
    config = moe_core.check_moe(args.experts, args.d_ff, args.top_k, args.block_size, "softmax", False, False, "bench")
    return moe_core.forward(x, params, config, dtype=dtype)[0]


def capacity_moe(params, x, args, dtype):
    """Capacity-factor MoE: each expert's first ``capacity`` rows kept, the rest dropped."""
    t, d = x.shape
    e, k = args.experts, args.top_k
    capacity = math.ceil(args.capacity_factor * t * k / e)
    routed = _router(x, params["router"], k)
    flat = routed.experts.reshape(-1)
    one_hot = jax.nn.one_hot(flat, e, dtype=jnp.int32)
    position = jnp.sum(jnp.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1  # row within its expert
    kept = position < capacity
    slot = jnp.where(kept, flat * capacity + position, e * capacity)  # dropped: past the end
    token = jnp.arange(t * k) // k
    buffer = jnp.zeros((e * capacity + 1, d), dtype).at[slot].set(x.astype(dtype)[token])[:-1]
    buffer = buffer.reshape(e, capacity, d)
    w_in = params["w_in"].astype(dtype).transpose(1, 0, 2)  # [E, D, F]
    w_out = params["w_out"].astype(dtype).transpose(1, 2, 0)  # [E, F, D]
    h = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", buffer, w_in))
    y = jnp.einsum("ecf,efd->ecd", h, w_out).reshape(e * capacity, d)
    y = jnp.concatenate([y, jnp.zeros((1, d), dtype)])[slot]  # dropped choices read zeros
    gates = (routed.gates.reshape(-1) * kept).astype(dtype)
    return jnp.sum((y * gates[:, None]).reshape(t, k, d), axis=1)


def ragged_moe(params, x, args, dtype):
    """The same routing through jax.lax.ragged_dot: rows sorted by expert, no padding."""
    t, d = x.shape
    e, k = args.experts, args.top_k
    routed = _router(x, params["router"], k)
    flat = routed.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros(e, jnp.int32).at[flat].add(1)
    rows = x.astype(dtype)[order // k]
    w_in = params["w_in"].astype(dtype).transpose(1, 0, 2)  # [E, D, F]
    w_out = params["w_out"].astype(dtype).transpose(1, 2, 0)  # [E, F, D]
    h = jax.nn.gelu(jax.lax.ragged_dot(rows, w_in, sizes))
    y = jax.lax.ragged_dot(h, w_out, sizes)
    y = jnp.zeros_like(y).at[order].set(y)
    return jnp.sum(y.reshape(t, k, d) * routed.gates[..., None].astype(dtype), axis=1)


def dense_mlp(params, x, args, dtype):
    h = jax.nn.gelu(jnp.dot(x.astype(dtype), params["w1"].astype(dtype)))
    return jnp.dot(h, params["w2"].astype(dtype))


def make_step(layer, args, dtype):
    def loss(params, x):
        return jnp.sum(jnp.square(layer(params, x, args, dtype).astype(jnp.float32)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_round_robin(steps: dict, inputs: dict, repeats: int, warmup: int) -> dict:
    for name, step in steps.items():
        for _ in range(warmup):
            jax.block_until_ready(step(*inputs[name]))
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(*inputs[name]))
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def run(args) -> dict:
    rows = []
    key = jax.random.key(0)
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        config = moe_core.check_moe(args.experts, args.d_ff, args.top_k, args.block_size, "softmax", False, False, "b")
        shapes = moe_core.param_shapes(config, args.d_model)
        keys = jax.random.split(key, len(shapes) + 3)
        moe_params = {n: moe_core.default_init(n)(k, s, jnp.float32) for k, (n, s) in zip(keys, shapes.items())}
        wide = args.top_k * args.d_ff
        dense_params = {
            "w1": jax.random.normal(keys[-3], (args.d_model, wide)) / math.sqrt(args.d_model),
            "w2": jax.random.normal(keys[-2], (wide, args.d_model)) / math.sqrt(wide),
        }
        x = jax.random.normal(keys[-1], (args.tokens, args.d_model), jnp.float32)
        layers = {"block-sparse": block_sparse, "capacity": capacity_moe, "ragged_dot": ragged_moe, "dense": dense_mlp}
        steps = {name: make_step(layer, args, dtype) for name, layer in layers.items()}
        inputs = {name: (dense_params if name == "dense" else moe_params, x) for name in layers}
        # The composition's own copies: the rows transposed for the up product and the down
        # product's result transposed back, forward and backward (4 transposes of [R, D]).
        r = moe_ops.padded_rows(args.tokens, args.top_k, args.experts, args.block_size)
        copy = jax.random.normal(keys[0], (r, args.d_model)).astype(dtype)
        steps["copies"] = jax.jit(lambda a: [(a * (i + 1)).T for i in range(4)])
        inputs["copies"] = (copy,)
        times = time_round_robin(steps, inputs, args.steps, args.warmup)
        ours = statistics.median(times["block-sparse"])
        for name in steps:
            ms = statistics.median(times[name])
            row = {
                "dtype": dtype_name,
                "layer": name,
                "ms": round(ms, 2),
                "over_block_sparse": round(ms / ours, 3),
                "ms_all": [round(t, 2) for t in times[name]],
            }
            rows.append(row)
            print(f"{dtype_name:>9} {name:>13} {ms:9.2f} ms  {ms / ours:6.2f}x the block-sparse layer's time")
    return {
        "benchmark": "moe",
        **measured_on(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "sizes": {
            k: getattr(args, k)
            for k in ("tokens", "d_model", "d_ff", "experts", "top_k", "block_size", "capacity_factor")
        },
        "steps": args.steps,
        "rows": rows,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--d-ff", type=int, default=4096)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for name in ("tokens", "d_model", "d_ff", "experts", "top_k", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_ff % args.block_size:
        p.error(f"--d-ff {args.d_ff} must be a multiple of --block-size {args.block_size}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args)
    write_report(args.json, "moe", report)
    return report


if __name__ == "__main__":
    main()
