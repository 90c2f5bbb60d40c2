"""A Transformer LM written the way Flax users write one, sparsified in one call: its gradient step against dense.

The model (:class:`LM`) is plain linen: token embedding, ``--layers`` pre-norm blocks of
``nn.MultiHeadDotProductAttention`` (causal; its query/key/value/out projections are
``nn.DenseGeneral``) and a ReLU MLP of two ``nn.Dense``, every kernel annotated with
``nn.with_logical_partitioning``, and a dense vocabulary head. ``jbs.nn.sparsify``
converts it at ``--density`` and ``--block-size`` (largest-norm blocks) in two ways:

- ``mlp``: only the MLPs (the attention projections kept dense with ``keep_dense``);
- ``mlp+attention``: the MLPs and the attention projections.

The head stays dense in both. Each model's step is one jitted
``jax.value_and_grad`` of the next-token cross-entropy plus an ``optax.adam`` update
(float32), the state donated. After ``--warmup`` steps, the models' steps are timed
round-robin ``--steps`` times (dense, mlp, mlp+attention, dense, ...), so a shared
machine's load falls on all alike; the medians are reported and
``speedup = dense median / model median``.

The JSON (``--json``; default ``bench/results/sparsify_lm-<device>-<date>.json``) holds
the device, the CPU's ISA, the commit, the date, the sizes and one row per model.

Usage::

    python bench/sparsify_lm.py                          # the table in the docs (minutes on 2 CPU cores)
    python bench/sparsify_lm.py --emb 64 --mlp 256 --seq 16 --batch 2 --steps 2 --warmup 1   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import git_commit, measured_on, write_report  # noqa: E402

import jax_blocksparse as jbs  # noqa: E402


def _init(names):
    return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
    """A pre-norm Transformer block: causal multi-head attention and a ReLU MLP."""

    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x):
        emb, t = x.shape[-1], x.shape[-2]
        causal = nn.make_causal_mask(jnp.ones(x.shape[:-1], jnp.int32))
        h = nn.MultiHeadDotProductAttention(
            self.heads, kernel_init=_init(("embed", "heads", "kv")), out_kernel_init=_init(("heads", "kv", "embed"))
        )(nn.LayerNorm()(x), mask=causal)
        x = x + h
        y = nn.Dense(self.mlp, kernel_init=_init(("embed", "mlp")))(nn.LayerNorm()(x))
        y = nn.Dense(emb, kernel_init=_init(("mlp", "embed")))(nn.relu(y))
        del t
        return x + y


class LM(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    vocab: int
    emb: int
    mlp: int
    heads: int
    layers: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.emb)(tokens)
        for _ in range(self.layers):
            x = Block(self.heads, self.mlp)(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


def make_step(apply, optimizer):
    def loss_fn(params, rest, tokens):
        logits = apply({"params": params, **rest}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def step(params, opt_state, rest, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def run(args) -> dict:
    model = LM(args.vocab, args.emb, args.mlp, args.heads, args.layers)
    tokens = jax.random.randint(jax.random.key(0), (args.batch, args.seq + 1), 0, args.vocab)
    variables = model.init(jax.random.key(1), tokens[:, :-1])
    optimizer = optax.adam(1e-4)
    models = {"dense": (model.apply, variables, None)}
    for name, keep in (("mlp", ["head", "*/MultiHeadDotProductAttention_0/*"]), ("mlp+attention", ["head"])):
        sparse, sparse_vars, report = jbs.nn.sparsify(
            model, variables, tokens[:, :-1], density=args.density, block_size=args.block_size, keep_dense=keep
        )
        models[name] = (sparse.apply, sparse_vars, report)
    states, steps = {}, {}
    for name, (apply, v, _) in models.items():
        v = nn.unbox(v)
        params, rest = v["params"], {k: c for k, c in v.items() if k != "params"}
        steps[name] = make_step(apply, optimizer)
        states[name] = (params, optimizer.init(params), rest)
        for _ in range(args.warmup):
            p, o, r = states[name]
            p, o, loss = steps[name](p, o, r, tokens)
            jax.block_until_ready(loss)
            states[name] = (p, o, r)
    times = {name: [] for name in models}
    for _ in range(args.steps):
        for name in models:
            p, o, r = states[name]
            start = time.perf_counter()
            p, o, loss = steps[name](p, o, r, tokens)
            jax.block_until_ready((p, loss))
            times[name].append((time.perf_counter() - start) * 1e3)
            states[name] = (p, o, r)
    dense_ms = statistics.median(times["dense"])
    rows = []
    for name, (_, v, report) in models.items():
        ms = statistics.median(times[name])
        params = sum(int(np.size(x)) for x in jax.tree.leaves(nn.unbox(v)["params"]))
        rows.append(
            {
                "model": name,
                "converted": 0 if report is None else len(report.converted),
                "params": params,
                "step_ms": round(ms, 2),
                "speedup": round(dense_ms / ms, 3),
                "step_ms_all": [round(t, 2) for t in times[name]],
            }
        )
        print(
            f"{name:>14}  {rows[-1]['converted']:>2} layers  {params:>10,} params  {ms:8.2f} ms  {dense_ms / ms:5.2f}x"
        )
    return {
        "benchmark": "sparsify_lm",
        **measured_on(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "impl": jbs.config.get_implementation(),
        "sizes": {k: getattr(args, k) for k in ("vocab", "emb", "mlp", "heads", "layers", "seq", "batch")},
        "density": args.density,
        "block_size": args.block_size,
        "steps": args.steps,
        "rows": rows,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--emb", type=int, default=512)
    p.add_argument("--mlp", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per model (the median is reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    for name in ("vocab", "emb", "mlp", "heads", "layers", "seq", "batch", "steps", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args)
    write_report(args.json, "sparsify_lm", report)
    return report


if __name__ == "__main__":
    main()
