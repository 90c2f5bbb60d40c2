"""Character-level causal transformer: dense attention against block-sparse attention.

The Sparse Transformer's claim (Child et al., 2019) at laptop scale: replacing full
causal attention by a block-sparse pattern (here the "fixed" or "strided" pattern)
costs little model quality while the attention's time and memory stop growing as T^2.
Two transformers with the same parameters (same embedding, blocks, projections) are
trained on the same characters for the same number of steps; they differ only in the
attention: ``jax.nn.dot_product_attention`` (full causal T x T) or
``jbs.nn.BlockSparseSelfAttention`` (the causal pattern's blocks only).

    python examples/char_transformer.py                      # T=1024 then T=4096, ~4-5 min on 2 CPU cores
    python examples/char_transformer.py --seq-lens 1024 --steps 400
    python examples/char_transformer.py --pattern strided --data book.txt

Data: the Python standard-library source that examples/char_lstm.py uses (offline, about
350 KB); every 10th chunk of 4096 characters is validation text.

After training, the block-sparse model of the first T samples text: the linen layers with
``decode=True`` keep a key-value cache (Flax's "cache" collection), and each new character
costs one decoding step whose attention reads only the key blocks of its block row. The
script checks that the cached, token-by-token logits equal the full-sequence forward pass
on the sampled text, and prints the sample and the time per character.

For each T in ``--seq-lens`` it prints, for both models, the parameter count, ms/step,
the peak memory of one attention layer's forward and backward (the compiled program's
``memory_analysis()``: its intermediates, where dense attention keeps the T x T scores)
and validation bits per character; then ``T=... dense_bpc=... sparse_bpc=...``. The
first T trains ``--steps`` steps; longer ones ``--long-steps`` (timing and a few steps of
learning). A dense model whose attention's peak exceeds ``--memory-budget-mb`` is not
trained (its bpc prints as ``skipped``) but its compiled memory and, with
``--time-over-budget``, its step time are still reported.
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
from char_lstm import STDLIB_MODULES, encode, windows


class DenseSelfAttention(nn.Module):
    """Full causal multi-head self-attention with the block-sparse layer's parameters
    (``query``, ``key``, ``value``, ``out`` Dense layers), so that the models are equal."""

    num_heads: int

    @nn.compact
    def __call__(self, x):
        *lead, t, f = x.shape
        q, k, v = (
            nn.Dense(f, name=n)(x).reshape(*lead, t, self.num_heads, f // self.num_heads)
            for n in ("query", "key", "value")
        )
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # [B, T, H, D]
        return nn.Dense(f, name="out")(y.reshape(*lead, t, f))


def attention_layer(kind: str, args, seq_len: int, decode: bool = False) -> nn.Module:
    if kind == "dense":
        return DenseSelfAttention(args.heads)
    n = seq_len // args.block_size
    stride = args.stride or max(2, round(math.sqrt(n)))
    mask = jbs.layouts.fixed(n, stride, 1) if args.pattern == "fixed" else jbs.layouts.strided(n, stride)
    return jbs.nn.BlockSparseSelfAttention(args.heads, mask, args.block_size, is_causal=True, decode=decode)


class Block(nn.Module):
    attention: nn.Module

    @nn.compact
    def __call__(self, x):
        x = x + self.attention(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(4 * x.shape[-1])(nn.LayerNorm()(x)))
        return x + nn.Dense(x.shape[-1])(h)


def sinusoid(t: int, d: int) -> np.ndarray:
    """Fixed sinusoidal positions [T, d] (no parameters, any T)."""
    pos = np.arange(t)[:, None] / (10000 ** (np.arange(0, d, 2)[None, :] / d))
    out = np.zeros((t, d), np.float32)
    out[:, 0::2], out[:, 1::2] = np.sin(pos), np.cos(pos)
    return out


class CharTransformer(nn.Module):
    vocab: int
    d_model: int
    layers: tuple  # attention modules, one per block

    @nn.compact
    def __call__(self, tokens, position=None):
        """tokens [B, T] -> logits [B, T, vocab]; when decoding, one token [B, 1] at ``position``."""
        positions = sinusoid(tokens.shape[-1], self.d_model)
        if position is not None:  # a decoding step: the sinusoid row of that position
            t = self.layers[0].mask.q_len
            positions = jax.lax.dynamic_slice_in_dim(jnp.asarray(sinusoid(t, self.d_model)), position, 1)
        x = nn.Embed(self.vocab, self.d_model)(tokens) + positions
        for attention in self.layers:
            x = Block(attention)(x)
        return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def attention_peak_bytes(layer: nn.Module, args, seq_len: int) -> int:
    """Temp bytes of one attention layer's jitted forward + backward at this batch and T."""
    x = jnp.zeros((args.batch, seq_len, args.d_model), jnp.float32)
    params = jax.eval_shape(layer.init, jax.random.key(0), x)

    def loss(params, x):
        return jnp.sum(layer.apply(params, x) ** 2)

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).compile()
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else -1


def train_and_evaluate(kind, model, train, valid, seq_len, steps, args, train_it=True):
    """(bpc or None, parameter count, ms/step or None, the trained parameters)."""
    rng = np.random.default_rng(args.seed)
    params = jax.jit(model.init)(jax.random.key(args.seed), jnp.zeros((1, seq_len), jnp.int32))
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    warmup = min(50, steps // 5)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(steps, warmup + 1))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
    opt_state = optimizer.init(params)

    def loss_fn(params, batch):
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch():
        starts = rng.integers(0, len(train) - seq_len - 1, size=args.batch)
        return jnp.asarray(windows(train, starts, seq_len))

    jax.block_until_ready(train_step(params, opt_state, batch()))  # compile (not timed)
    if not train_it:
        if not args.time_over_budget:
            return None, n_params, None, params["params"]
        steps = 2  # a step time only
    t0 = time.perf_counter()
    for step in range(steps):
        params, opt_state, loss = train_step(params, opt_state, batch())
        if args.log_every and step % args.log_every == args.log_every - 1:
            print(f"  {kind} T={seq_len} step {step + 1}: train bpc {float(loss) / math.log(2):.3f}", flush=True)
    jax.block_until_ready(params)
    step_ms = 1000 * (time.perf_counter() - t0) / steps
    if not train_it:
        return None, n_params, step_ms, params["params"]

    eval_loss = jax.jit(loss_fn)
    n_win = max(1, min(args.eval_windows, (len(valid) - 1) // seq_len))
    starts = np.arange(n_win) * seq_len
    losses = [
        float(eval_loss(params, jnp.asarray(windows(valid, starts[i : i + args.batch], seq_len))))
        * len(starts[i : i + args.batch])
        for i in range(0, n_win, args.batch)
    ]
    return sum(losses) / n_win / math.log(2), n_params, step_ms, params["params"]


def sample(model, params, prompt: np.ndarray, length: int, args):
    """Continues ``prompt`` (int [P]) by ``length`` characters with the decoding model: one cached
    step per character (the prompt is fed the same way). Returns (tokens [P + length], the
    decoding logits of each position [P + length - 1, vocab], seconds per step)."""
    tokens = np.zeros((1, model.layers[0].mask.q_len), np.int32)
    cache = jax.jit(model.init)(jax.random.key(0), tokens)["cache"]

    @jax.jit
    def step(cache, token, position, key):
        logits, state = model.apply({"params": params, "cache": cache}, token, position, mutable=["cache"])
        logits = logits[:, -1]
        return state["cache"], logits, jax.random.categorical(key, logits / args.temperature)

    out, all_logits = list(prompt), []
    keys = jax.random.split(jax.random.key(args.seed), len(prompt) + length)
    jax.block_until_ready(step(cache, jnp.zeros((1, 1), jnp.int32), 0, keys[0]))  # compile (not timed)
    t0 = time.perf_counter()
    for position in range(len(prompt) + length - 1):
        token = jnp.asarray([[out[position]]], jnp.int32)
        cache, logits, drawn = step(cache, token, position, keys[position])
        all_logits.append(logits[0])
        if position + 1 >= len(prompt):
            out.append(int(drawn[0]))
    seconds = (time.perf_counter() - t0) / max(1, len(all_logits))
    return np.array(out), np.asarray(jnp.stack(all_logits)), seconds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a text file (default: Python standard-library source)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--steps", type=int, default=250, help="training steps at the first T")
    parser.add_argument("--long-steps", type=int, default=8, help="training steps at the other T's")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--pattern", choices=("fixed", "strided"), default="fixed")
    parser.add_argument("--stride", type=int, default=None, help="pattern stride in blocks (default ~sqrt(T/bs))")
    parser.add_argument("--lr", type=float, default=6e-3)
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=512.0,
        help="train a dense model only if its attention's peak memory fits this",
    )
    parser.add_argument(
        "--time-over-budget",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="still time 2 steps of a dense model over the budget",
    )
    parser.add_argument("--eval-windows", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=4096, help="every 10th chunk of this many chars is validation")
    parser.add_argument("--log-every", type=int, default=0)
    parser.add_argument("--sample-chars", type=int, default=300, help="characters the sparse model samples")
    parser.add_argument("--prompt-chars", type=int, default=64, help="validation characters that start the sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    text, chars, train, valid = encode(args.data, args.chunk)
    print(
        f"jax {jax.__version__} on {jax.devices()[0].platform} ({jbs.config.get_implementation()} implementation); "
        f"text: {len(text):,} chars ({'stdlib: ' + ', '.join(STDLIB_MODULES) if args.data is None else args.data}), "
        f"vocab {len(chars)}; train {len(train):,}, valid {len(valid):,}"
    )
    print(
        f"model: {args.layers} layers, d_model {args.d_model}, {args.heads} heads, batch {args.batch}; "
        f"sparse attention: causal {args.pattern} pattern, block {args.block_size}"
    )

    results = {}
    for i, seq_len in enumerate(args.seq_lens):
        if seq_len % args.block_size:
            parser.error(f"--seq-lens {seq_len} is not a multiple of --block-size {args.block_size}")
        steps = args.steps if i == 0 else args.long_steps
        row = {}
        for kind in ("dense", "sparse"):
            layer = attention_layer(kind, args, seq_len)
            peak = attention_peak_bytes(layer, args, seq_len)
            fits = kind == "sparse" or peak <= args.memory_budget_mb * 2**20
            model = CharTransformer(
                len(chars), args.d_model, tuple(attention_layer(kind, args, seq_len) for _ in range(args.layers))
            )
            bpc, n_params, ms, params = train_and_evaluate(
                kind, model, train, valid, seq_len, steps, args, train_it=fits
            )
            row[kind] = dict(bpc=bpc, params=n_params, ms=ms, peak=peak)
            trained = (model, params)  # the sparse model (trained last) samples below
            detail = f"density {np.tril(layer.mask.blocks[0, 0]).mean():.1%}, " if kind == "sparse" else ""
            print(
                f"T={seq_len} {kind:>6}: {n_params:,} parameters, {detail}"
                f"{f'{ms:.1f} ms/step' if ms else 'not timed'}, attention peak {peak / 2**20:.1f} MiB, "
                f"validation {f'{bpc:.3f} bits/char' if bpc is not None else 'skipped (over the memory budget)'}"
                f" after {steps if bpc is not None else 0} steps",
                flush=True,
            )
        results[seq_len] = row
        d, s = row["dense"], row["sparse"]

        def fmt(v, spec):
            return format(v, spec) if v is not None else "skipped"

        speed = f"{d['ms'] / s['ms']:.1f}x" if d["ms"] and s["ms"] else "n/a"
        print(
            f"T={seq_len} dense_bpc={fmt(d['bpc'], '.3f')} sparse_bpc={fmt(s['bpc'], '.3f')} "
            f"dense_ms/step={fmt(d['ms'], '.1f')} sparse_ms/step={fmt(s['ms'], '.1f')} speedup={speed} "
            f"dense_attention_peak_MiB={d['peak'] / 2**20:.1f} sparse_attention_peak_MiB={s['peak'] / 2**20:.1f}",
            flush=True,
        )
        if i == 0 and args.sample_chars > 0:
            row["sample"] = sample_and_check(*trained, valid, chars, args, seq_len)
    return results


def sample_and_check(model, params, valid, chars, args, seq_len) -> dict:
    """Samples from the trained sparse model with its decoding twin; checks the cached logits
    against the full-sequence forward pass on the same text."""
    decoder = CharTransformer(
        model.vocab,
        model.d_model,
        tuple(attention_layer("sparse", args, seq_len, decode=True) for _ in range(args.layers)),
    )
    prompt = valid[: min(args.prompt_chars, seq_len - 1)]
    length = min(args.sample_chars, seq_len - len(prompt))
    tokens, logits, seconds = sample(decoder, params, prompt, length, args)
    padded = np.zeros((1, seq_len), np.int32)
    padded[0, : len(tokens)] = tokens
    full = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(padded)))[0, : len(logits)]
    error = float(np.abs(full - logits).max())
    text = "".join(chars[t] for t in tokens[len(prompt) :])
    print(
        f"T={seq_len} sparse sample ({seconds * 1e3:.2f} ms/char, cached logits vs full forward: max diff "
        f"{error:.1e}):\n{''.join(chars[t] for t in prompt)}|{text}",
        flush=True,
    )
    return dict(text=text, ms_per_char=seconds * 1e3, logit_error=error)


if __name__ == "__main__":
    main()
