"""Benchmark block-sparse attention against dense attention: forward+backward time and memory.

For each sequence length T it times one jitted training-style step, the value and the
gradient with respect to q, k and v of ``vdot(attention(q, k, v), ct)`` (``ct`` a random
[B, H, T, D] argument, as a training step's cotangent), of

* ``sparse``: :func:`jax_blocksparse.attention.blocksparse_attention` over a block mask
  (``--pattern``, causal by default) at ``--block-size`` (64), on the default
  implementation (the native kernels where built); on CPU also ``sparse_reference``,
  the pure-JAX reference lowering of the same primitives;
* ``dense``: ``jax.nn.dot_product_attention`` (``implementation="xla"``, causal), the
  full T x T attention; skipped (``null``, with the reason) where its float32 scores
  of one batch x heads would exceed ``--dense-budget-gb``;
* on a GPU: ``dense_cudnn``, ``jax.nn.dot_product_attention(implementation="cudnn")``
  (16-bit inputs only), and ``flex``, PyTorch FlexAttention with a ``BlockMask`` of the
  same blocks (and the causal triangle), compiled with ``torch.compile``, when torch
  is importable and has a GPU.

Per T and method: median seconds per step (back-to-back calls, blocked on), and the
compiled program's memory (``compiled.memory_analysis()``: temp, argument and output
bytes; ``temp`` is the peak of intermediates, where the T x T scores of dense attention
live). The JSON (``--json``, default bench/results/attention-<device>-<date>.json) holds
the device, commit, date, the configuration and one row per T; it is rewritten after
every row.

Usage::

    python bench/attention.py                          # preset by device: cpu or gpu
    python bench/attention.py --preset quick           # seconds: tests/test_bench_attention.py
    python bench/attention.py --seq-lens 1024 4096 --pattern strided --dtype bfloat16
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _report import git_commit, write_json  # noqa: E402
from bsmm import time_calls  # noqa: E402

from jax_blocksparse.attention import blocksparse_attention

RESULTS = Path(__file__).resolve().parent / "results"
PATTERNS = ("fixed", "strided", "local", "bigbird")
PRESETS = {
    # CPU: dense attention up to T = 4k (its fp32 scores at 8k, 1 GiB for 4 heads, are past the
    # budget: a step there takes minutes on 2 cores); block-sparse up to 16k.
    "cpu": dict(seq_lens=[1024, 2048, 4096, 8192, 16384], batch=1, heads=4, head_dim=64, dtype="float32",
                dense_budget_gb=0.5, repeats=3),
    "gpu": dict(seq_lens=[1024, 2048, 4096, 8192, 16384], batch=1, heads=16, head_dim=64, dtype="bfloat16",
                dense_budget_gb=40.0, repeats=10),
    # A few seconds on CPU, for the test.
    "quick": dict(seq_lens=[256, 512], batch=1, heads=2, head_dim=32, dtype="float32", dense_budget_gb=1.0,
                  repeats=2),
}


def make_mask(pattern: str, n: int, causal: bool, stride: int | None = None) -> np.ndarray:
    """The block mask of ``pattern`` over n x n blocks (stride ~ sqrt(n) by default)."""
    stride = stride or max(2, round(math.sqrt(n)))
    L = jbs.layouts
    mask = {
        "fixed": lambda: L.fixed(n, stride, 1),
        "strided": lambda: L.strided(n, stride),
        "local": lambda: L.local(n, stride),
        "bigbird": lambda: L.bigbird(n, 2, 1, 2, seed=0),
    }[pattern]()
    return L.causal(mask) if causal else mask



def memory(fn, *args) -> dict | None:
    """Bytes of the compiled program: temp (intermediates' peak), arguments, outputs."""
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return None
    return dict(temp_bytes=int(analysis.temp_size_in_bytes), argument_bytes=int(analysis.argument_size_in_bytes),
                output_bytes=int(analysis.output_size_in_bytes))


def step(attention):
    """jit(value_and_grad) of <attention(q, k, v), ct> for q, k, v, ct [B, H, T, D]: one training step's
    attention. The cotangent ``ct`` is an argument (data, as in training), not a constant that XLA
    could fold into the backward pass."""

    def loss(q, k, v, ct):
        return jnp.vdot(attention(q, k, v).astype(jnp.float32), ct.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def dense_attention(implementation: str, causal: bool):
    def attend(q, k, v):  # jax.nn.dot_product_attention takes [B, T, H, D]
        out = jax.nn.dot_product_attention(q.swapaxes(1, 2), k.swapaxes(1, 2), v.swapaxes(1, 2), is_causal=causal,
                                           implementation=implementation)
        return out.swapaxes(1, 2)

    return attend


def flex_peer(mask, block_size, causal, shape, dtype, repeats):
    """PyTorch FlexAttention with a BlockMask of the same blocks: (seconds per fwd+bwd, peak bytes)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no GPU")
    blocks = torch.as_tensor(mask, device="cuda")

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = blocks[q_idx // block_size, kv_idx // block_size]
        return allowed & (q_idx >= kv_idx) if causal else allowed

    t = shape[2]
    block_mask = create_block_mask(mask_mod, None, None, t, t, device="cuda", BLOCK_SIZE=block_size)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    q, k, v = (torch.randn(shape, device="cuda", dtype=tdtype, requires_grad=True) for _ in range(3))
    compiled = torch.compile(flex_attention)

    def run():
        out = compiled(q, k, v, block_mask=block_mask)
        out.float().sum().backward()

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            run()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 5 / 1e3)
    return float(np.median(samples)), int(torch.cuda.max_memory_allocated())




def _measure(row, name, fn, args, repeats):
    """Times fn and records its memory into row[name + ...]; an error is recorded, not raised."""
    try:
        row[f"{name}_s"] = time_calls(fn, *args, repeats=repeats, min_time=0.2, max_inner=100)
        row[f"{name}_memory"] = memory(fn, *args)
    except Exception as e:  # a peer that cannot run here (e.g. cudnn on float32): say why
        row[f"{name}_s"] = None
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def run_one(args, seq_len: int, on_gpu: bool) -> dict:
    bs = args.block_size
    n = seq_len // bs
    mask = make_mask(args.pattern, n, args.causal, args.stride)
    shape = (args.batch, args.heads, seq_len, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(args.seed), 4)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
    row = dict(seq_len=seq_len, blocks=n, density=float(mask.mean()), nnz_blocks=int(mask.sum()))

    sparse = step(lambda q, k, v: blocksparse_attention(q, k, v, mask, bs, causal=args.causal))
    _measure(row, "sparse", sparse, (q, k, v, ct), args.repeats)
    if not on_gpu and args.reference:
        with jbs.config.implementation("reference"):
            ref = step(lambda q, k, v: blocksparse_attention(q, k, v, mask, bs, causal=args.causal))
            _measure(row, "sparse_reference", ref, (q, k, v, ct), args.repeats)

    dense_scores_gb = args.batch * args.heads * seq_len * seq_len * 4 / 2**30
    row["dense_scores_gb"] = dense_scores_gb
    if dense_scores_gb > args.dense_budget_gb:
        row["dense_s"] = None
        row["dense_error"] = f"skipped: float32 scores {dense_scores_gb:.1f} GiB > budget {args.dense_budget_gb} GiB"
    else:
        _measure(row, "dense", step(dense_attention("xla", args.causal)), (q, k, v, ct), args.repeats)
    if on_gpu:
        _measure(row, "dense_cudnn", step(dense_attention("cudnn", args.causal)), (q, k, v, ct), args.repeats)
        if "flex" in args.peers:
            try:
                row["flex_s"], row["flex_peak_bytes"] = flex_peer(mask, bs, args.causal, shape, args.dtype,
                                                                  args.repeats)
            except Exception as e:
                row["flex_s"] = None
                row["flex_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    for name in ("dense", "dense_cudnn", "flex", "sparse_reference"):
        if row.get(f"{name}_s") and row.get("sparse_s"):
            row[f"speedup_vs_{name}"] = row[f"{name}_s"] / row["sparse_s"]
    return row


def _mb(memory_row):
    return f"{memory_row['temp_bytes'] / 2**20:.1f}" if memory_row else "-"


def _ms(v):
    return f"{v * 1e3:.1f}" if v else "-"


HEADER = (f"{'T':>6} {'density':>8} {'sparse ms':>10} {'ref ms':>8} {'dense ms':>9} {'cudnn ms':>9} "
          f"{'flex ms':>8} {'speedup':>8} {'sparse MiB':>10} {'dense MiB':>10}")


def line(row) -> str:
    speedup = row.get("speedup_vs_dense")
    return (f"{row['seq_len']:>6} {row['density']:>8.3f} {_ms(row.get('sparse_s')):>10} "
            f"{_ms(row.get('sparse_reference_s')):>8} {_ms(row.get('dense_s')):>9} {_ms(row.get('dense_cudnn_s')):>9} "
            f"{_ms(row.get('flex_s')):>8} {(f'{speedup:.1f}x' if speedup else '-'):>8} "
            f"{_mb(row.get('sparse_memory')):>10} {_mb(row.get('dense_memory')):>10}")


def run(args) -> dict:
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    now = datetime.datetime.now(datetime.timezone.utc)
    report = dict(
        device=str(device), device_kind=getattr(device, "device_kind", device.platform), platform=device.platform,
        jax_version=jax.__version__, jax_blocksparse_version=jbs.__version__, commit=git_commit(),
        date=now.date().isoformat(), datetime=now.isoformat(timespec="seconds"), host=platform.node(),
        python=sys.version.split()[0], implementation=jbs.config.get_implementation(),
        cpu_kernels=jbs.has_cpu_kernels(), cuda_kernels=jbs.has_cuda_kernels(),
        config=dict(preset=args.preset, seq_lens=args.seq_lens, block_size=args.block_size, batch=args.batch,
                    heads=args.heads, head_dim=args.head_dim, dtype=args.dtype, pattern=args.pattern,
                    stride=args.stride, causal=args.causal, dense_budget_gb=args.dense_budget_gb,
                    peers=args.peers, repeats=args.repeats),
        timing=("jit(value_and_grad) of vdot(attention(q, k, v), ct) w.r.t. q, k, v (ct: a random argument): "
                "median seconds per call of back-to-back calls; memory from compiled.memory_analysis() "
                "(temp = intermediates' peak)"),
        results=[], complete=False,
    )
    print(f"# {report['device_kind']}  B={args.batch} H={args.heads} D={args.head_dim} bs={args.block_size} "
          f"{args.dtype} pattern={args.pattern} causal={args.causal}")
    print(HEADER)
    for seq_len in args.seq_lens:
        row = run_one(args, seq_len, on_gpu)
        report["results"].append(row)
        print(line(row), flush=True)
        if args.json:
            write_json(args.json, report)
    report["complete"] = True
    if args.json:
        write_json(args.json, report)
    return report




def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default 'gpu' on a GPU, else 'cpu'")
    p.add_argument("--seq-lens", type=int, nargs="+")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pattern", choices=PATTERNS, default="fixed")
    p.add_argument("--stride", type=int, default=None, help="pattern stride in blocks (default ~sqrt(T/bs))")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dense-budget-gb", type=float, help="skip dense attention past this much fp32 score memory")
    p.add_argument("--peers", nargs="*", default=["flex"], choices=["flex"], help="GPU peers besides cudnn")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="on CPU, also time the pure-JAX reference lowering")
    p.add_argument("--repeats", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None,
                   help="output JSON (default bench/results/attention-<device>-<date>.json; 'none' for no file)")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    args.preset = args.preset or ("gpu" if device.platform == "gpu" else "cpu")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    bad = [t for t in args.seq_lens if t % args.block_size]
    if bad:
        p.error(f"--seq-lens {bad} are not multiples of --block-size {args.block_size}")
    if args.json is None:
        kind = (getattr(device, "device_kind", "gpu").replace(" ", "_") if device.platform == "gpu"
                else f"cpu-{_cores()}cores")
        args.json = RESULTS / f"attention-{kind}-{datetime.date.today().isoformat()}.json"
    elif str(args.json) == "none":
        args.json = None
    return args


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
