"""The block-sparse self-attention layer's core: configuration, projections, heads, attention.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.BlockSparseSelfAttention` (linen)
and :class:`jax_blocksparse.nnx.BlockSparseSelfAttention` (NNX) declare their four
projections (``query``, ``key``, ``value``, ``out``: dense, or block-sparse with
``qkv_mask`` / ``out_mask``) as :func:`projections` lists them, and call :func:`attend`
between them. :func:`check_attention` validates the configuration once;
:func:`check_inputs` the inputs at each call.

Example (the layer without a framework)::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.layers import attention
    >>> cfg = attention.check_attention("MyAttention", num_heads=2, mask=jbs.layouts.causal(jbs.layouts.local(4, 2)),
    ...                                 block_size=16, causal=True, dropout_rate=0.0)
    >>> sorted((name, spec.in_features, spec.out_features) for name, spec in attention.projections(cfg, 32).items())
    [('key', 32, 32), ('out', 32, 32), ('query', 32, 32), ('value', 32, 32)]
    >>> x = jnp.ones((3, 64, 32))                       # [batch, T, features]
    >>> attention.check_inputs(cfg, x, "MyAttention")
    >>> attention.attend(cfg, x, x, x, deterministic=True, dropout_rng=None).shape
    (3, 64, 32)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_blocksparse.attention import blocksparse_attention, check_attention_mask
from jax_blocksparse.layers.dense import StaticMask
from jax_blocksparse.layout import check_block_size

__all__ = [
    "AttentionConfig", "AttentionMask", "Projection", "attend", "check_attention", "check_inputs", "merge_heads",
    "projections", "split_heads",
]


class AttentionMask(StaticMask):
    """A read-only, hashable attention block mask: bool [n, n] or [heads, n, n].

    Compared and hashed by shape and content (so a layer holding one is a valid static
    argument and jit cache key); ``np.asarray(mask)`` gives the bool array back.
    """

    __slots__ = ()

    @staticmethod
    def _checked(mask) -> np.ndarray:
        array = check_attention_mask(mask)  # [H_m, n, n]
        return array[0] if np.ndim(mask) == 2 else array


class AttentionConfig(NamedTuple):
    """A checked configuration (hashable). Feature counts of None follow the input."""

    layer: str
    num_heads: int
    mask: AttentionMask
    block_size: int
    causal: bool
    dropout_rate: float
    qkv_features: int | None
    out_features: int | None
    qkv_mask: StaticMask | None
    out_mask: StaticMask | None
    projection_block_size: int

    @property
    def seq_len(self) -> int:
        """The sequence length T the mask describes: ``n * block_size``."""
        return self.mask.shape[-1] * self.block_size


class Projection(NamedTuple):
    """One projection: [..., in_features] -> [..., out_features]; block-sparse when mask is set."""

    in_features: int
    out_features: int
    mask: StaticMask | None
    block_size: int


def _positive_int(value, name, layer):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")
    return int(value)


def check_attention(
    layer: str,
    *,
    num_heads,
    mask,
    block_size,
    causal=False,
    dropout_rate=0.0,
    qkv_features=None,
    out_features=None,
    qkv_mask=None,
    out_mask=None,
    projection_block_size=None,
) -> AttentionConfig:
    """Validates a self-attention layer's arguments (see the linen layer's docstring)."""
    num_heads = _positive_int(num_heads, "num_heads", layer)
    block_size = check_block_size(block_size)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{layer}: causal must be a bool, got {causal!r}")
    try:
        mask = AttentionMask(mask)
        check_attention_mask(mask.array, num_heads=num_heads, causal=bool(causal))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{layer}: {e}") from None
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"{layer}: dropout_rate must be in [0, 1), got {dropout_rate}")
    if qkv_features is not None:
        qkv_features = _positive_int(qkv_features, "qkv_features", layer)
        if qkv_features % num_heads:
            raise ValueError(f"{layer}: qkv_features={qkv_features} must be divisible by num_heads={num_heads}")
    if out_features is not None:
        out_features = _positive_int(out_features, "out_features", layer)
    projection_block_size = check_block_size(
        block_size if projection_block_size is None else projection_block_size, name="projection_block_size"
    )
    qkv_mask = None if qkv_mask is None else StaticMask(qkv_mask)
    out_mask = None if out_mask is None else StaticMask(out_mask)
    if qkv_mask is not None and qkv_features is None:
        qkv_features = qkv_mask.shape[1] * projection_block_size
        if qkv_features % num_heads:
            raise ValueError(
                f"{layer}: qkv_mask of shape {qkv_mask.shape} gives qkv_features={qkv_features} (mask columns x "
                f"projection_block_size), which must be divisible by num_heads={num_heads}"
            )
    return AttentionConfig(layer, num_heads, mask, block_size, bool(causal), dropout_rate, qkv_features,
                           out_features, qkv_mask, out_mask, projection_block_size)


def projections(cfg: AttentionConfig, in_features: int) -> dict[str, Projection]:
    """The four projections for inputs of ``in_features``: name -> :class:`Projection`.

    ``query``, ``key``, ``value``: in_features -> qkv_features (default in_features), with
    ``qkv_mask`` if set; ``out``: qkv_features -> out_features (default in_features), with
    ``out_mask`` if set. Block-sparse masks must match the feature counts.
    """
    in_features = _positive_int(in_features, "in_features", cfg.layer)
    qkv = cfg.qkv_features or in_features
    out = cfg.out_features or in_features
    if qkv % cfg.num_heads:
        raise ValueError(
            f"{cfg.layer}: qkv_features={qkv} (default: the input's {in_features} features) must be divisible "
            f"by num_heads={cfg.num_heads}"
        )
    bs = cfg.projection_block_size
    for name, mask, c, k in (("qkv_mask", cfg.qkv_mask, in_features, qkv), ("out_mask", cfg.out_mask, qkv, out)):
        if mask is not None and mask.shape != (c // bs, k // bs) or mask is not None and (c % bs or k % bs):
            raise ValueError(
                f"{cfg.layer}: {name} must have shape [{c} / {bs}, {k} / {bs}] for a [{c}, {k}] projection at "
                f"projection_block_size={bs}, got {mask.shape}"
            )
    return {
        "query": Projection(in_features, qkv, cfg.qkv_mask, bs),
        "key": Projection(in_features, qkv, cfg.qkv_mask, bs),
        "value": Projection(in_features, qkv, cfg.qkv_mask, bs),
        "out": Projection(qkv, out, cfg.out_mask, bs),
    }


def check_inputs(cfg: AttentionConfig, x, layer: str) -> None:
    """Inputs must be [..., T, features] with T = ``mask.shape[-1] * block_size``."""
    if x.ndim < 2 or x.shape[-2] != cfg.seq_len:
        raise ValueError(
            f"{layer}: inputs must be [..., T={cfg.seq_len}, features] for a mask of shape {cfg.mask.shape} at "
            f"block_size={cfg.block_size}, got {tuple(x.shape)}"
        )


def split_heads(x, num_heads: int):
    """[..., T, H*D] -> [N, H, T, D] with N the product of the leading dims (1 if none)."""
    *lead, t, f = x.shape
    return x.reshape(math.prod(lead), t, num_heads, f // num_heads).transpose(0, 2, 1, 3)


def merge_heads(y, lead: tuple):
    """[N, H, T, D] -> [*lead, T, H*D]: the inverse of :func:`split_heads`."""
    _, h, t, d = y.shape
    return y.transpose(0, 2, 1, 3).reshape(*lead, t, h * d)


def attend(cfg: AttentionConfig, query, key, value, *, deterministic: bool, dropout_rng, precision=None):
    """Block-sparse multi-head attention of projected [..., T, qkv_features] inputs.

    Splits the heads, runs :func:`~jax_blocksparse.attention.blocksparse_attention` with
    the layer's mask (dropout on the probabilities unless ``deterministic``) and merges
    the heads back: returns [..., T, qkv_features] in the inputs' dtype.
    """
    if query.shape != key.shape or query.shape != value.shape:
        raise ValueError(
            f"{cfg.layer}: projected query, key and value must have one shape, got {query.shape}, {key.shape} and "
            f"{value.shape}"
        )
    dtype = jnp.result_type(query, key, value)
    q, k, v = (split_heads(a.astype(dtype), cfg.num_heads) for a in (query, key, value))
    rate = 0.0 if deterministic else cfg.dropout_rate
    if rate > 0.0 and dropout_rng is None:
        raise ValueError(f"{cfg.layer}: dropout_rate={rate} with deterministic=False needs a dropout rng")
    out = blocksparse_attention(q, k, v, cfg.mask.array, cfg.block_size, causal=cfg.causal, dropout_rate=rate,
                                dropout_rng=dropout_rng if rate > 0.0 else None, precision=precision)
    return merge_heads(out, tuple(query.shape[:-2]))
