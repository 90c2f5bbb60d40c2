"""Character-level transformer with mixture-of-experts feed-forward layers, against the dense one.

Two causal transformers (full attention, pre-norm blocks) are trained on the same
characters for the same steps. They differ only in the feed-forward layer:

* dense: an MLP ``d_model -> top_k * d_ff -> d_model``;
* MoE: ``jbs.nn.BlockSparseMoE`` with ``--experts`` experts of ``d_ff`` hidden units,
  ``top_k`` per token: dropless, the experts' MLPs two block-sparse products over each
  step's routing.

Each token runs ``top_k * d_ff`` hidden units in both, so the two have the same active
parameters and FLOPs in their feed-forward layers; the MoE holds ``experts / top_k``
times the feed-forward parameters. The MoE's training loss adds the sown load-balancing
loss (times 1e-2) and router z-loss (times 1e-3).

    python examples/char_moe.py                        # the table in the docs: minutes on 2 CPU cores
    python examples/char_moe.py --steps 50 --seq-len 64 --d-model 32 --d-ff 64   # seconds

Data: the Python standard-library source of examples/char_lstm.py (offline); every 10th
chunk of 4,096 characters is validation text. Prints, per model, the parameter count,
ms per training step (after compiling) and validation bits per character, then
``dense_bpc=... moe_bpc=...`` and the MoE's tokens per expert on the validation text.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_blocksparse as jbs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from char_lstm import encode, windows  # noqa: E402
from char_transformer import DenseSelfAttention, sinusoid  # noqa: E402


class Block(nn.Module):
    heads: int
    ffn: nn.Module

    @nn.compact
    def __call__(self, x):
        x = x + DenseSelfAttention(self.heads)(nn.LayerNorm()(x))
        return x + self.ffn(nn.LayerNorm()(x))


class DenseFFN(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.hidden)(x)))


class CharModel(nn.Module):
    vocab: int
    d_model: int
    heads: int
    ffns: tuple  # one feed-forward module per block

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, self.d_model)(tokens) + sinusoid(tokens.shape[-1], self.d_model)
        for ffn in self.ffns:
            x = Block(self.heads, ffn)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def feed_forward(kind: str, args) -> nn.Module:
    if kind == "dense":
        return DenseFFN(args.top_k * args.d_ff)
    return jbs.nn.BlockSparseMoE(args.experts, args.d_ff, top_k=args.top_k, block_size=args.block_size)


def _aux_loss(state) -> jax.Array:
    """The sown MoE losses of every layer, weighted (0 for the dense model)."""
    sown = state.get("intermediates", {})
    balance = sum(jax.tree.leaves({k: v for k, v in _flat(sown).items() if k.endswith("load_balancing_loss")}))
    z = sum(jax.tree.leaves({k: v for k, v in _flat(sown).items() if k.endswith("router_z_loss")}))
    return 1e-2 * balance + 1e-3 * z


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}"
        out.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return out


def train_and_evaluate(kind, model, train, valid, args) -> dict:
    rng = np.random.default_rng(args.seed)
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, args.seq_len), jnp.int32))["params"]
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    warmup = min(50, args.steps // 5)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state = optimizer.init(params)

    def loss_fn(params, batch):
        logits, state = model.apply({"params": params}, batch[:, :-1], mutable=["intermediates"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss + _aux_loss(state), loss

    @jax.jit
    def train_step(params, opt_state, batch):
        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch():
        starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch)
        return jnp.asarray(windows(train, starts, args.seq_len))

    jax.block_until_ready(train_step(params, opt_state, batch()))  # compile (not timed)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        params, opt_state, _ = train_step(params, opt_state, batch())
    jax.block_until_ready(params)
    step_ms = 1000 * (time.perf_counter() - t0) / args.steps

    @jax.jit
    def evaluate(params, batch):
        logits, state = model.apply({"params": params}, batch[:, :-1], mutable=["intermediates"])
        counts = [v for k, v in _flat(state.get("intermediates", {})).items() if k.endswith("expert_counts")]
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, (sum(c[0] for c in counts) if counts else jnp.zeros(1, jnp.int32))

    n_win = max(1, min(args.eval_windows, (len(valid) - 1) // args.seq_len))
    starts = np.arange(n_win) * args.seq_len
    total, counts = 0.0, 0
    for i in range(0, n_win, args.batch):
        loss, c = evaluate(params, jnp.asarray(windows(valid, starts[i : i + args.batch], args.seq_len)))
        total += float(loss) * len(starts[i : i + args.batch])
        counts = counts + np.asarray(c)
    return dict(bpc=total / n_win / math.log(2), params=n_params, ms=step_ms, expert_counts=np.asarray(counts).tolist())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a text file (default: Python standard-library source)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--d-ff", type=int, default=256, help="hidden units of one expert")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4096, help="every 10th chunk of this many chars is validation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.d_ff % args.block_size:
        parser.error(f"--d-ff {args.d_ff} must be a multiple of --block-size {args.block_size}")

    text, chars, train, valid = encode(args.data, args.chunk)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform}; {len(text):,} chars, vocab {len(chars)}; "
        f"{args.layers} layers, d_model {args.d_model}, T {args.seq_len}, batch {args.batch}, {args.steps} steps; "
        f"feed-forward: dense {args.top_k * args.d_ff} hidden against {args.experts} experts of {args.d_ff}, "
        f"top-{args.top_k}, block {args.block_size}"
    )
    results = {}
    for kind in ("dense", "moe"):
        model = CharModel(
            len(chars), args.d_model, args.heads, tuple(feed_forward(kind, args) for _ in range(args.layers))
        )
        results[kind] = row = train_and_evaluate(kind, model, train, valid, args)
        print(
            f"{kind:>5}: {row['params']:,} parameters, {row['ms']:.1f} ms/step, validation {row['bpc']:.3f} bits/char",
            flush=True,
        )
    d, m = results["dense"], results["moe"]
    print(f"tokens per expert on the validation text (all layers): {m['expert_counts']}")
    print(
        f"dense_bpc={d['bpc']:.3f} moe_bpc={m['bpc']:.3f} dense_ms/step={d['ms']:.1f} moe_ms/step={m['ms']:.1f}",
        flush=True,
    )
    return results


if __name__ == "__main__":
    main()
