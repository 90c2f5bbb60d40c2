"""Benchmark block-sparse attention against dense attention: training steps, GQA, packed documents, decoding.

Four cases (``--cases``), one JSON row per (case, T):

* ``step``: one jitted training-style step, the value and the gradient with respect to
  query, key and value of ``vdot(attention(q, k, v), ct)`` (``ct`` a random [B, T, H, D]
  argument, as a training step's cotangent), of

  - ``sparse``: :func:`jax_blocksparse.attention.blocksparse_attention` over a causal
    block mask (``--pattern``) at ``--block-size`` (64), on the default implementation
    (the native kernels where built); on CPU also ``sparse_reference``, the pure-JAX
    reference lowering of the same primitives;
  - ``dense``: ``jax.nn.dot_product_attention(implementation="xla", is_causal=True)``,
    the full T x T attention; skipped (``null``, with the reason) where its float32 scores
    of one batch x heads would exceed ``--dense-budget-gb``;
  - on a GPU: ``dense_cudnn`` (``implementation="cudnn"``, 16-bit inputs only) and
    ``flex``, PyTorch FlexAttention with a ``BlockMask`` of the same blocks and the causal
    triangle (``torch.compile``), when torch is importable and has a GPU.

* ``gqa``: the ``step`` case with ``--gqa-kv-heads`` key/value heads (grouped-query
  attention: query heads share key heads; the peers run it natively too).
* ``packed``: documents of random lengths (mean ``--doc-len``) packed into each row of
  T: the block mask is made from the segment ids inside the jitted step
  (:func:`~jax_blocksparse.attention.block_mask_from_segments`, causal, at a fixed
  capacity) and the attention masks by segment; dense attention gets the [B, 1, T, T]
  segment mask (and FlexAttention a document ``mask_mod``).
* ``decode``: one autoregressive step at the last position of a T-token key-value cache:
  :func:`~jax_blocksparse.attention.blocksparse_decode` (the tiles of the query's block
  row only) against ``jax.nn.dot_product_attention`` of the token over the whole cache
  with ``key_value_seq_lengths`` (what a dense KV-cache decoder does): seconds per token.

Per row: median seconds per call (back-to-back calls, blocked on) and, for the steps,
the compiled program's memory (``compiled.memory_analysis()``: temp, argument and
output bytes; ``temp`` is the peak of intermediates, where the T x T scores of dense
attention live). The JSON (``--json``, default bench/results/attention-<device>-<date>.json)
holds the device, commit, date, the configuration and the rows; it is rewritten after
every row.

Usage::

    python bench/attention.py                          # preset by device: cpu or gpu
    python bench/attention.py --preset quick           # seconds: tests/test_bench_attention.py
    python bench/attention.py --cases step --seq-lens 1024 4096 --pattern strided --dtype bfloat16
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
from _report import cpu_cores, git_commit, write_json  # noqa: E402
from _timing import time_calls  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PATTERNS = ("fixed", "strided", "local", "bigbird")
CASES = ("step", "gqa", "packed", "decode")
PRESETS = {
    # CPU: dense attention up to T = 4k (its fp32 scores at 8k, 1 GiB for 4 heads, are past the
    # budget: a step there takes minutes on 2 cores); block-sparse up to 16k.
    "cpu": dict(
        seq_lens=[1024, 2048, 4096, 8192, 16384],
        gqa_seq_lens=[4096],
        packed_seq_lens=[4096],
        decode_seq_lens=[4096, 16384],
        batch=1,
        heads=4,
        gqa_heads=8,
        gqa_kv_heads=2,
        head_dim=64,
        dtype="float32",
        dense_budget_gb=0.5,
        repeats=3,
        doc_len=512,
    ),
    "gpu": dict(
        seq_lens=[1024, 2048, 4096, 8192, 16384],
        gqa_seq_lens=[4096, 16384],
        packed_seq_lens=[8192],
        decode_seq_lens=[8192, 32768],
        batch=1,
        heads=16,
        gqa_heads=16,
        gqa_kv_heads=4,
        head_dim=64,
        dtype="bfloat16",
        dense_budget_gb=40.0,
        repeats=10,
        doc_len=1024,
    ),
    # A few seconds on CPU, for the test.
    "quick": dict(
        seq_lens=[256, 512],
        gqa_seq_lens=[256],
        packed_seq_lens=[256],
        decode_seq_lens=[512],
        batch=1,
        heads=2,
        gqa_heads=4,
        gqa_kv_heads=1,
        head_dim=32,
        dtype="float32",
        dense_budget_gb=1.0,
        repeats=2,
        doc_len=64,
    ),
}


def make_mask(pattern: str, n: int, stride: int | None = None) -> np.ndarray:
    """The causal block mask of ``pattern`` over n x n blocks (stride ~ sqrt(n) by default)."""
    stride = stride or max(2, round(math.sqrt(n)))
    L = jbs.layouts
    mask = {
        "fixed": lambda: L.fixed(n, stride, 1),
        "strided": lambda: L.strided(n, stride),
        "local": lambda: L.local(n, stride),
        "bigbird": lambda: L.bigbird(n, 2, 1, 2, seed=0),
    }[pattern]()
    return L.causal(mask)


def memory(fn, *args) -> dict | None:
    """Bytes of the compiled program: temp (intermediates' peak), arguments, outputs."""
    analysis = fn.lower(*args).compile().memory_analysis()
    if analysis is None:
        return None
    return dict(
        temp_bytes=int(analysis.temp_size_in_bytes),
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
    )


def step(attention):
    """jit(value_and_grad) of <attention(q, k, v, *data), ct> w.r.t. q, k, v: one training step's attention.
    The cotangent ``ct`` is an argument (data, as in training), not a constant that XLA could fold
    into the backward pass; ``data`` (segment ids) are arguments too."""

    def loss(q, k, v, ct, *data):
        return jnp.vdot(attention(q, k, v, *data).astype(jnp.float32), ct.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def dense_attention(implementation: str, mask=None):
    def attend(q, k, v, *data):
        extra = {"mask": mask(*data)} if mask is not None else {"is_causal": True}
        return jax.nn.dot_product_attention(q, k, v, implementation=implementation, **extra)

    return attend


def flex_peer(shape, kv_heads, dtype, repeats, block_size, mask=None, documents=None):
    """PyTorch FlexAttention, fwd+bwd: (seconds per step, peak bytes). ``mask``: a causal tile grid;
    ``documents``: int [B, T] segment ids (causal within a document)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no GPU")
    b, t, h, d = shape
    blocks = None if mask is None else torch.as_tensor(mask, device="cuda")
    docs = None if documents is None else torch.as_tensor(np.asarray(documents), device="cuda")

    def mask_mod(bi, hi, q_idx, kv_idx):
        allowed = q_idx >= kv_idx
        if blocks is not None:
            allowed = allowed & blocks[q_idx // block_size, kv_idx // block_size]
        if docs is not None:
            allowed = allowed & (docs[bi, q_idx] == docs[bi, kv_idx])
        return allowed

    block_mask = create_block_mask(
        mask_mod, b if docs is not None else None, None, t, t, device="cuda", BLOCK_SIZE=block_size
    )
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    q = torch.randn((b, h, t, d), device="cuda", dtype=tdtype, requires_grad=True)  # torch: [B, H, T, D]
    k, v = (torch.randn((b, kv_heads, t, d), device="cuda", dtype=tdtype, requires_grad=True) for _ in range(2))
    compiled = torch.compile(flex_attention)

    def run():
        out = compiled(q, k, v, block_mask=block_mask, enable_gqa=kv_heads != h)
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


def _error(e) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _measure(row, name, fn, args, repeats, with_memory=True):
    """Times fn and records its memory into row[name + ...]; an error is recorded, not raised."""
    try:
        row[f"{name}_s"] = time_calls(fn, *args, repeats=repeats, min_time=0.2, max_inner=100)
        if with_memory:
            row[f"{name}_memory"] = memory(fn, *args)
    except Exception as e:  # a peer that cannot run here (e.g. cudnn on float32): say why
        row[f"{name}_s"] = None
        row[f"{name}_error"] = _error(e)


def _flex(row, args, **kw):
    if "flex" not in args.peers:
        return
    try:
        row["flex_s"], row["flex_peak_bytes"] = flex_peer(
            dtype=args.dtype, repeats=args.repeats, block_size=args.block_size, **kw
        )
    except Exception as e:
        row["flex_s"] = None
        row["flex_error"] = _error(e)


def _randoms(args, shapes):
    keys = jax.random.split(jax.random.key(args.seed), len(shapes))
    return [jax.random.normal(key, s, jnp.float32).astype(args.dtype) for key, s in zip(keys, shapes)]


def _dense_budget(row, args, batch, heads, seq_len) -> bool:
    """Whether dense attention's float32 scores of one step fit the budget (else the row says why)."""
    gb = batch * heads * seq_len * seq_len * 4 / 2**30
    row["dense_scores_gb"] = gb
    if gb > args.dense_budget_gb:
        row["dense_s"] = None
        row["dense_error"] = f"skipped: float32 scores {gb:.1f} GiB > budget {args.dense_budget_gb} GiB"
        return False
    return True


def run_step(args, seq_len: int, on_gpu: bool, heads: int, kv_heads: int, case: str) -> dict:
    bs = args.block_size
    n = seq_len // bs
    mask = make_mask(args.pattern, n, args.stride)
    shape = (args.batch, seq_len, heads, args.head_dim)
    kv_shape = (args.batch, seq_len, kv_heads, args.head_dim)
    q, k, v, ct = _randoms(args, [shape, kv_shape, kv_shape, shape])
    row = dict(
        case=case,
        seq_len=seq_len,
        heads=heads,
        kv_heads=kv_heads,
        blocks=n,
        density=float(mask.mean()),
        nnz_blocks=int(mask.sum()),
    )

    def sparse(q, k, v):
        return jbs.attention.blocksparse_attention(q, k, v, mask, bs, is_causal=True)

    _measure(row, "sparse", step(sparse), (q, k, v, ct), args.repeats)
    if not on_gpu and args.reference:
        with jbs.config.implementation("reference"):
            _measure(row, "sparse_reference", step(sparse), (q, k, v, ct), args.repeats)
    if _dense_budget(row, args, args.batch, heads, seq_len):
        _measure(row, "dense", step(dense_attention("xla")), (q, k, v, ct), args.repeats)
    if on_gpu:
        _measure(row, "dense_cudnn", step(dense_attention("cudnn")), (q, k, v, ct), args.repeats)
        _flex(row, args, shape=shape, kv_heads=kv_heads, mask=mask)
    return row


def documents(args, batch: int, seq_len: int) -> np.ndarray:
    """int32 [batch, T] segment ids: documents of exponential lengths (mean doc_len, at least one block)
    packed from position 0, the last one cut at T."""
    rng = np.random.default_rng(args.seed)
    ids = np.zeros((batch, seq_len), np.int32)
    for b in range(batch):
        start, doc = 0, 0
        while start < seq_len:
            length = max(args.block_size, int(rng.exponential(args.doc_len)))
            ids[b, start : start + length] = doc
            start, doc = start + length, doc + 1
    return ids


def packed_blocks(seg: np.ndarray, block_size: int) -> np.ndarray:
    """Tiles per batch row that block_mask_from_segments (causal) gives for these ids."""
    return np.asarray(jbs.attention.block_mask_from_segments(seg, block_size=block_size, is_causal=True).num_blocks)


def run_packed(args, seq_len: int, on_gpu: bool) -> dict:
    bs, heads = args.block_size, args.heads
    shape = (args.batch, seq_len, heads, args.head_dim)
    q, k, v, ct = _randoms(args, [shape] * 4)
    seg = documents(args, args.batch, seq_len)
    tiles = packed_blocks(seg, bs)
    # The step's fixed capacity: these documents' tiles rounded up to a multiple of n (at most
    # the causal triangle), so that other documents of similar lengths run in the same step.
    n = seq_len // bs
    capacity = int(min(-(-tiles.max() // n) * n, n * (n + 1) // 2))
    row = dict(
        case="packed",
        seq_len=seq_len,
        heads=heads,
        kv_heads=heads,
        blocks=n,
        capacity=capacity,
        documents=float(seg.max(axis=1).mean() + 1),
        density=float(tiles.mean()) / (n * n),
    )
    seg = jnp.asarray(seg)

    def sparse(q, k, v, seg):
        mask = jbs.attention.block_mask_from_segments(seg, block_size=bs, capacity=capacity, is_causal=True)
        return jbs.attention.blocksparse_attention(q, k, v, mask, is_causal=True, query_segment_ids=seg)

    def segment_mask(seg):
        return (seg[:, None, :, None] == seg[:, None, None, :]) & jnp.tril(jnp.ones((seq_len, seq_len), bool))

    _measure(row, "sparse", step(sparse), (q, k, v, ct, seg), args.repeats)
    if _dense_budget(row, args, args.batch, heads, seq_len):
        _measure(row, "dense", step(dense_attention("xla", segment_mask)), (q, k, v, ct, seg), args.repeats)
    if on_gpu:
        _flex(row, args, shape=shape, kv_heads=heads, documents=seg)
    return row


def run_decode(args, seq_len: int, on_gpu: bool) -> dict:
    bs, heads = args.block_size, args.heads
    mask = make_mask(args.pattern, seq_len // bs, args.stride)
    cache = (args.batch, seq_len, heads, args.head_dim)
    q, k, v = _randoms(args, [(args.batch, 1, heads, args.head_dim), cache, cache])
    position = jnp.int32(seq_len - 1)
    row = dict(
        case="decode",
        seq_len=seq_len,
        heads=heads,
        kv_heads=heads,
        position=seq_len - 1,
        row_blocks=int(mask[-1].sum()),
        density=float(mask.mean()),
    )

    sparse = jax.jit(lambda q, k, v, p: jbs.attention.blocksparse_decode(q, k, v, p, mask, bs))
    dense = jax.jit(
        lambda q, k, v, p: jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=jnp.full((q.shape[0],), p + 1, jnp.int32)
        )
    )
    _measure(row, "sparse", sparse, (q, k, v, position), args.repeats, with_memory=False)
    _measure(row, "dense", dense, (q, k, v, position), args.repeats, with_memory=False)
    return row


def run_case(args, case: str, seq_len: int, on_gpu: bool) -> dict:
    if case == "step":
        row = run_step(args, seq_len, on_gpu, args.heads, args.kv_heads or args.heads, "step")
    elif case == "gqa":
        row = run_step(args, seq_len, on_gpu, args.gqa_heads, args.gqa_kv_heads, "gqa")
    elif case == "packed":
        row = run_packed(args, seq_len, on_gpu)
    else:
        row = run_decode(args, seq_len, on_gpu)
    for name in ("dense", "dense_cudnn", "flex", "sparse_reference"):
        if row.get(f"{name}_s") and row.get("sparse_s"):
            row[f"speedup_vs_{name}"] = row[f"{name}_s"] / row["sparse_s"]
    return row


def _mb(memory_row):
    return f"{memory_row['temp_bytes'] / 2**20:.1f}" if memory_row else "-"


def _ms(v):
    return f"{v * 1e3:.2f}" if v and v < 0.01 else (f"{v * 1e3:.1f}" if v else "-")


HEADER = (
    f"{'case':>6} {'T':>6} {'H/KVH':>6} {'density':>8} {'sparse ms':>10} {'ref ms':>8} {'dense ms':>9} "
    f"{'cudnn ms':>9} {'flex ms':>8} {'speedup':>8} {'sparse MiB':>10} {'dense MiB':>10}"
)


def line(row) -> str:
    speedup = row.get("speedup_vs_dense")
    return (
        f"{row['case']:>6} {row['seq_len']:>6} {str(row['heads']) + '/' + str(row['kv_heads']):>6} "
        f"{row['density']:>8.3f} {_ms(row.get('sparse_s')):>10} "
        f"{_ms(row.get('sparse_reference_s')):>8} {_ms(row.get('dense_s')):>9} {_ms(row.get('dense_cudnn_s')):>9} "
        f"{_ms(row.get('flex_s')):>8} {(f'{speedup:.1f}x' if speedup else '-'):>8} "
        f"{_mb(row.get('sparse_memory')):>10} {_mb(row.get('dense_memory')):>10}"
    )


def run(args) -> dict:
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    now = datetime.datetime.now(datetime.UTC)
    config = {
        name: getattr(args, name)
        for name in (
            "preset",
            "cases",
            "seq_lens",
            "gqa_seq_lens",
            "packed_seq_lens",
            "decode_seq_lens",
            "block_size",
            "batch",
            "heads",
            "kv_heads",
            "gqa_heads",
            "gqa_kv_heads",
            "head_dim",
            "dtype",
            "pattern",
            "stride",
            "doc_len",
            "dense_budget_gb",
            "peers",
            "repeats",
        )
    }
    report = dict(
        device=str(device),
        device_kind=getattr(device, "device_kind", device.platform),
        platform=device.platform,
        jax_version=jax.__version__,
        jax_blocksparse_version=jbs.__version__,
        commit=git_commit(),
        date=now.date().isoformat(),
        datetime=now.isoformat(timespec="seconds"),
        host=platform.node(),
        python=sys.version.split()[0],
        implementation=jbs.config.get_implementation(),
        cpu_kernels=jbs.has_cpu_kernels(),
        cuda_kernels=jbs.has_cuda_kernels(),
        config=config,
        timing=(
            "step, gqa, packed: jit(value_and_grad) of vdot(attention(q, k, v), ct) w.r.t. q, k, v (ct: a "
            "random argument); decode: one token at position T-1 against a T-token cache; median seconds per "
            "call of back-to-back calls; memory from compiled.memory_analysis() (temp = intermediates' peak)"
        ),
        results=[],
        complete=False,
    )
    print(
        f"# {report['device_kind']}  B={args.batch} D={args.head_dim} bs={args.block_size} {args.dtype} "
        f"pattern=causal {args.pattern}"
    )
    print(HEADER)
    lens = {
        "step": args.seq_lens,
        "gqa": args.gqa_seq_lens,
        "packed": args.packed_seq_lens,
        "decode": args.decode_seq_lens,
    }
    for case in args.cases:
        for seq_len in lens[case]:
            row = run_case(args, case, seq_len, on_gpu)
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
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--seq-lens", type=int, nargs="+", help="T of the step case")
    p.add_argument("--gqa-seq-lens", type=int, nargs="+")
    p.add_argument("--packed-seq-lens", type=int, nargs="+")
    p.add_argument("--decode-seq-lens", type=int, nargs="+", help="cache lengths of the decode case")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads of the step case (default: heads)")
    p.add_argument("--gqa-heads", type=int)
    p.add_argument("--gqa-kv-heads", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pattern", choices=PATTERNS, default="fixed")
    p.add_argument("--stride", type=int, default=None, help="pattern stride in blocks (default ~sqrt(T/bs))")
    p.add_argument("--doc-len", type=int, help="mean document length of the packed case")
    p.add_argument("--dense-budget-gb", type=float, help="skip dense attention past this much fp32 score memory")
    p.add_argument("--peers", nargs="*", default=["flex"], choices=["flex"], help="GPU peers besides cudnn")
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CPU, also time the pure-JAX reference lowering (step and gqa cases)",
    )
    p.add_argument("--repeats", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="output JSON (default bench/results/attention-<device>-<date>.json; 'none' for no file)",
    )
    args = p.parse_args(argv)
    device = jax.devices()[0]
    args.preset = args.preset or ("gpu" if device.platform == "gpu" else "cpu")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    lens = args.seq_lens + args.gqa_seq_lens + args.packed_seq_lens + args.decode_seq_lens
    bad = [t for t in lens if t % args.block_size]
    if bad:
        p.error(f"sequence lengths {bad} are not multiples of --block-size {args.block_size}")
    if args.json is None:
        kind = (
            getattr(device, "device_kind", "gpu").replace(" ", "_")
            if device.platform == "gpu"
            else f"cpu-{cpu_cores()}cores"
        )
        args.json = RESULTS / f"attention-{kind}-{datetime.date.today().isoformat()}.json"
    elif str(args.json) == "none":
        args.json = None
    return args


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
