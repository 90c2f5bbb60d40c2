"""Character-level language model: a dense LSTM against a wider block-sparse LSTM.

OpenAI's block-sparse result (2017): at the same parameter count, a wider LSTM whose
recurrent weights are block-sparse with a small-world (Barabasi-Albert) layout, with a
few internal steps per timestep, models text better than a dense one. This script
trains both on the same characters for the same number of steps and reports bits per
character on held-out text.

    python examples/char_lstm.py                       # Python stdlib source, ~3 min on 2 CPU cores
    python examples/char_lstm.py --data book.txt       # any text file
    python examples/char_lstm.py --steps 2000 --seq-len 128 --dense-hidden 512 --sparse-hidden 1024

Data: by default the source of a fixed list of Python standard-library modules (found
with ``inspect.getsourcefile``, so it is there offline), about 350 KB; every 10th chunk
of 4096 characters is validation text. Both models: embedding -> LSTM -> dense softmax,
trained with Adam on random windows, carries starting at zero.

* dense: ``jbs.nn.BlockSparseLSTMCell`` with a full mask (every block present), layer
  norm, no internal steps; that is a dense layer-norm LSTM (``--dense-cell flax`` uses
  ``flax.linen.OptimizedLSTMCell`` instead, without layer norm).
* sparse: ``jbs.nn.BlockSparseLSTM`` over a wider ``BlockSparseLSTMCell`` whose gates
  and internal steps use one Barabasi-Albert layout; ``internal_steps`` defaults to
  ``mixing_steps(mask) - 1`` capped at ``--max-internal-steps``.

Prints each model's parameter count, layout, step time and validation bits per
character, and at the end one line ``dense_bpc=... sparse_bpc=...``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import jax_blocksparse as jbs

# A fixed, deterministic selection of standard-library modules (about 350 KB of source).
STDLIB_MODULES = (
    "argparse",
    "collections",
    "dataclasses",
    "functools",
    "heapq",
    "json.decoder",
    "json.encoder",
    "string",
    "textwrap",
    "tokenize",
)


def load_text(path: str | None) -> str:
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    parts = []
    for name in STDLIB_MODULES:
        source = inspect.getsourcefile(importlib.import_module(name))
        with open(source, encoding="utf-8") as f:
            parts.append(f.read())
    return "\n".join(parts)


class CharModel(nn.Module):
    """Embedding -> LSTM (any sequence layer) -> logits."""

    vocab: int
    embed: int
    rnn: nn.Module

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.embed)(tokens)  # [B, T, E]
        h = self.rnn(x)  # [B, T, H]
        return nn.Dense(self.vocab)(h)


def make_models(args, vocab: int):
    """(dense model, sparse model, description of the sparse layout)."""
    if args.dense_cell == "flax":
        dense_rnn = nn.RNN(nn.OptimizedLSTMCell(args.dense_hidden))
    else:
        full = np.ones((args.dense_hidden // args.block_size,) * 2, bool)
        dense_rnn = jbs.nn.BlockSparseLSTM(jbs.nn.BlockSparseLSTMCell(args.dense_hidden, full, args.block_size))
    n = args.sparse_hidden // args.block_size
    mask = jbs.layouts.barabasi_albert(n, args.ba_m, seed=args.seed)
    mixing = jbs.layouts.mixing_steps(mask)
    steps = args.internal_steps
    if steps is None:
        steps = min(args.max_internal_steps, (mixing or 1) - 1)
    cell = jbs.nn.BlockSparseLSTMCell(args.sparse_hidden, mask, args.block_size, internal_steps=steps)
    layout = (
        f"Barabasi-Albert n={n} m={args.ba_m}, block {args.block_size}: density {mask.mean():.1%} "
        f"(sparsity {1 - mask.mean():.1%}), mixing_steps={mixing}, internal_steps={steps}"
    )
    if args.plot:
        jbs.layouts.plot(mask, args.plot, title="sparse LSTM layout")
    return CharModel(vocab, args.embed, dense_rnn), CharModel(vocab, args.embed, jbs.nn.BlockSparseLSTM(cell)), layout


def split_chunks(data: np.ndarray, chunk: int):
    """Every 10th chunk of ``chunk`` characters is validation text, the rest training text.

    (Holding out the tail instead would validate on one or two modules only.)
    """
    n = -(-len(data) // chunk)
    pieces = [data[i * chunk : (i + 1) * chunk] for i in range(n)]
    valid = [p for i, p in enumerate(pieces) if i % 10 == 9] or pieces[-1:]
    train = [p for i, p in enumerate(pieces) if i % 10 != 9]
    return np.concatenate(train), np.concatenate(valid)


def encode(path: str | None, chunk: int):
    """``(text, chars, train, valid)``: the text (:func:`load_text`), its sorted characters,
    and its character ids split into training and validation (:func:`split_chunks`)."""
    text = load_text(path)
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    return (text, chars, *split_chunks(data, chunk))


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return data[starts[:, None] + np.arange(length + 1)[None, :]]


def train_and_evaluate(name, model, train, valid, args):
    rng = np.random.default_rng(args.seed)
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    schedule = optax.cosine_decay_schedule(args.lr, args.steps)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(schedule))
    opt_state = optimizer.init(params)

    def loss_fn(params, batch):
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    eval_loss = jax.jit(loss_fn)
    t0 = time.perf_counter()
    first = train[: args.batch * (args.seq_len + 1)].reshape(args.batch, -1)
    jax.block_until_ready(train_step(params, opt_state, jnp.asarray(first)))  # compile
    compile_s = time.perf_counter() - t0

    bar = tqdm(range(args.steps), desc=f"{name:>6}", unit="step", mininterval=1.0)
    t0 = time.perf_counter()
    for step in bar:
        starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch)
        params, opt_state, loss = train_step(params, opt_state, jnp.asarray(windows(train, starts, args.seq_len)))
        if step % 10 == 9:
            bar.set_postfix(train_bpc=f"{float(loss) / math.log(2):.3f}", refresh=False)
    jax.block_until_ready(params)
    step_ms = 1000 * (time.perf_counter() - t0) / args.steps

    # Validation: consecutive windows of the held-out text.
    n_win = min(args.eval_windows, (len(valid) - 1) // args.seq_len)
    starts = np.arange(n_win) * args.seq_len
    losses = [
        float(eval_loss(params, jnp.asarray(windows(valid, starts[i : i + args.batch], args.seq_len))))
        * len(starts[i : i + args.batch])
        for i in range(0, n_win, args.batch)
    ]
    bpc = sum(losses) / n_win / math.log(2)
    print(
        f"{name}: {n_params:,} parameters, compile {compile_s:.1f} s, {step_ms:.1f} ms/step, "
        f"validation {bpc:.3f} bits/char ({n_win} windows of {args.seq_len})"
    )
    return bpc, n_params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a text file (default: Python standard-library source)")
    parser.add_argument("--steps", type=int, default=250, help="training steps for each model")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--embed", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dense-hidden", type=int, default=192)
    parser.add_argument("--sparse-hidden", type=int, default=384, help="wider, at about the dense parameter count")
    parser.add_argument("--ba-m", type=int, default=1, help="Barabasi-Albert edges per new node")
    parser.add_argument("--internal-steps", type=int, default=None, help="default: mixing_steps(mask) - 1, capped")
    parser.add_argument("--max-internal-steps", type=int, default=2)
    parser.add_argument("--dense-cell", choices=("jbs", "flax"), default="jbs")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--chunk", type=int, default=4096, help="every 10th chunk of this many chars is validation")
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--plot", help="write a PNG of the sparse layout here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    text, chars, train, valid = encode(args.data, args.chunk)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; text: {len(text):,} chars "
        f"({'stdlib: ' + ', '.join(STDLIB_MODULES) if args.data is None else args.data}), "
        f"vocab {len(chars)}; train {len(train):,}, valid {len(valid):,}"
    )

    dense, sparse, layout = make_models(args, len(chars))
    print(f"dense: hidden {args.dense_hidden} ({args.dense_cell} cell); sparse: hidden {args.sparse_hidden}, {layout}")
    dense_bpc, dense_n = train_and_evaluate("dense", dense, train, valid, args)
    sparse_bpc, sparse_n = train_and_evaluate("sparse", sparse, train, valid, args)
    print(f"parameters sparse/dense = {sparse_n / dense_n:.2f}")
    print(f"dense_bpc={dense_bpc:.3f} sparse_bpc={sparse_bpc:.3f}")
    return dict(dense_bpc=dense_bpc, sparse_bpc=sparse_bpc, dense_params=dense_n, sparse_params=sparse_n)


if __name__ == "__main__":
    main()
