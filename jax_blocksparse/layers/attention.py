"""The block-sparse self-attention layer's core: configuration, projections, heads, attention, decoding.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.BlockSparseSelfAttention` (linen)
and :class:`jax_blocksparse.nnx.BlockSparseSelfAttention` (NNX) declare their four
projections (``query``, ``key``, ``value``, ``out``: dense, or block-sparse with
``qkv_mask`` / ``out_mask``) as :func:`projections` lists them, and call :func:`attend`
(whole sequences) or :func:`decode` (one token against a key-value cache) between them.
:func:`check_attention` validates the configuration once; :func:`check_inputs` the inputs
at each call.

Example (the layer without a framework)::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.layers import attention
    >>> cfg = attention.check_attention("MyAttention", num_heads=2, mask=jbs.layouts.local(4, 2),
    ...                                 block_size=16, is_causal=True, dropout_rate=0.0)
    >>> sorted((name, spec.in_features, spec.out_features) for name, spec in attention.projections(cfg, 32).items())
    [('key', 32, 32), ('out', 32, 32), ('query', 32, 32), ('value', 32, 32)]
    >>> x = jnp.ones((3, 64, 32))                       # [batch, T, features]
    >>> attention.check_inputs(cfg, x, "MyAttention")
    >>> attention.attend(cfg, x, x, x, deterministic=True, dropout_rng=None).shape
    (3, 64, 32)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layers.common import StaticMask
from jax_blocksparse.layout import check_block_size
from jax_blocksparse.ops.attention import BlockMask, as_block_mask, blocksparse_attention, blocksparse_decode
from jax_blocksparse.ops.block_mask import check_token_fn

__all__ = [
    "AttentionConfig",
    "Projection",
    "attend",
    "check_attention",
    "check_inputs",
    "decode",
    "merge_heads",
    "projections",
    "split_heads",
    "update_cache",
]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A checked configuration (hashable; not a pytree, so that NNX keeps it static whole).
    Feature counts of None follow the input."""

    layer: str
    num_heads: int
    num_kv_heads: int
    mask: BlockMask  # concrete, square, no batch dim
    is_causal: bool
    dropout_rate: float
    qkv_features: int | None
    out_features: int | None
    qkv_mask: StaticMask | None
    out_mask: StaticMask | None
    projection_block_size: int
    score_fn: Any

    @property
    def block_size(self) -> int:
        return self.mask.block_size

    @property
    def seq_len(self) -> int:
        """The sequence length T the mask describes: ``n * block_size``."""
        return self.mask.q_len


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


def _layer_mask(mask, block_size, mask_fn, num_heads) -> BlockMask:
    if isinstance(mask, jax.core.Tracer) or isinstance(mask, BlockMask) and not mask.is_concrete:
        raise TypeError(
            "mask must be concrete (a numpy bool grid or a concrete BlockMask): a layer's block mask is static"
        )
    bm = as_block_mask(mask, block_size, mask_fn=mask_fn)
    gb, gh, n_q, n_kv = bm.grid
    if gb != 1 or gh not in (1, num_heads) or n_q != n_kv:
        raise ValueError(
            f"mask must be a square grid [T/bs, T/bs] or [heads={num_heads}, T/bs, T/bs] (no batch dim), "
            f"got grid {bm.grid}"
        )
    return bm


def check_attention(
    layer: str,
    *,
    num_heads,
    mask,
    block_size,
    is_causal=False,
    dropout_rate=0.0,
    qkv_features=None,
    out_features=None,
    qkv_mask=None,
    out_mask=None,
    projection_block_size=None,
    num_kv_heads=None,
    mask_fn=None,
    score_fn=None,
) -> AttentionConfig:
    """Validates a self-attention layer's arguments (see the linen layer's docstring)."""
    num_heads = _positive_int(num_heads, "num_heads", layer)
    num_kv_heads = num_heads if num_kv_heads is None else _positive_int(num_kv_heads, "num_kv_heads", layer)
    if num_heads % num_kv_heads:
        raise ValueError(f"{layer}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"{layer}: is_causal must be a bool, got {is_causal!r}")
    try:
        mask = _layer_mask(mask, block_size, mask_fn, num_heads)
        if score_fn is not None:
            check_token_fn(score_fn, "score_fn", takes_score=True)
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
        mask.block_size if projection_block_size is None else projection_block_size, name="projection_block_size"
    )
    qkv_mask = None if qkv_mask is None else StaticMask(qkv_mask)
    out_mask = None if out_mask is None else StaticMask(out_mask)
    if qkv_mask is not None and num_kv_heads != num_heads:
        raise ValueError(
            f"{layer}: qkv_mask (block-sparse query, key and value projections) needs num_kv_heads == "
            f"num_heads, got {num_kv_heads} and {num_heads}"
        )
    if qkv_mask is not None and qkv_features is None:
        qkv_features = qkv_mask.shape[1] * projection_block_size
        if qkv_features % num_heads:
            raise ValueError(
                f"{layer}: qkv_mask of shape {qkv_mask.shape} gives qkv_features={qkv_features} (mask columns x "
                f"projection_block_size), which must be divisible by num_heads={num_heads}"
            )
    return AttentionConfig(
        layer,
        num_heads,
        num_kv_heads,
        mask,
        bool(is_causal),
        dropout_rate,
        qkv_features,
        out_features,
        qkv_mask,
        out_mask,
        projection_block_size,
        score_fn,
    )


def projections(cfg: AttentionConfig, in_features: int) -> dict[str, Projection]:
    """The four projections for inputs of ``in_features``: name -> :class:`Projection`.

    ``query``: in_features -> qkv_features (default in_features); ``key``, ``value``:
    in_features -> qkv_features * num_kv_heads / num_heads; all with ``qkv_mask`` if set;
    ``out``: qkv_features -> out_features (default in_features), with ``out_mask`` if set.
    Block-sparse masks must match the feature counts.
    """
    in_features = _positive_int(in_features, "in_features", cfg.layer)
    qkv = cfg.qkv_features or in_features
    out = cfg.out_features or in_features
    if qkv % cfg.num_heads:
        raise ValueError(
            f"{cfg.layer}: qkv_features={qkv} (default: the input's {in_features} features) must be divisible "
            f"by num_heads={cfg.num_heads}"
        )
    kv = qkv // cfg.num_heads * cfg.num_kv_heads
    bs = cfg.projection_block_size
    for name, mask, c, k in (("qkv_mask", cfg.qkv_mask, in_features, qkv), ("out_mask", cfg.out_mask, qkv, out)):
        if mask is not None and (c % bs or k % bs or mask.shape != (c // bs, k // bs)):
            raise ValueError(
                f"{cfg.layer}: {name} must have shape [{c} / {bs}, {k} / {bs}] for a [{c}, {k}] projection at "
                f"projection_block_size={bs}, got {mask.shape}"
            )
    return {
        "query": Projection(in_features, qkv, cfg.qkv_mask, bs),
        "key": Projection(in_features, kv, cfg.qkv_mask, bs),
        "value": Projection(in_features, kv, cfg.qkv_mask, bs),
        "out": Projection(qkv, out, cfg.out_mask, bs),
    }


def check_inputs(cfg: AttentionConfig, x, layer: str, *, decode: bool = False) -> None:
    """Inputs must be [..., T, features] with T = ``mask.shape[-1] * block_size`` (T = 1 when decoding)."""
    want = 1 if decode else cfg.seq_len
    if x.ndim < 2 or x.shape[-2] != want:
        what = (
            "one token per decoding step"
            if decode
            else (f"a mask of grid {cfg.mask.grid[2:]} at block_size={cfg.block_size}")
        )
        raise ValueError(f"{layer}: inputs must be [..., T={want}, features] for {what}, got {tuple(x.shape)}")


def split_heads(x, num_heads: int):
    """[..., T, H*D] -> [N, T, H, D] with N the product of the leading dims (1 if none)."""
    *lead, t, f = x.shape
    return x.reshape(math.prod(lead), t, num_heads, f // num_heads)


def merge_heads(y, lead: tuple):
    """[N, T, H, D] -> [*lead, T, H*D]: the inverse of :func:`split_heads`."""
    _, t, h, d = y.shape
    return y.reshape(*lead, t, h * d)


def _heads(cfg: AttentionConfig, query, key, value):
    dtype = jnp.result_type(query, key, value)
    q = split_heads(query.astype(dtype), cfg.num_heads)
    k, v = (split_heads(a.astype(dtype), cfg.num_kv_heads) for a in (key, value))
    return q, k, v


def attend(
    cfg: AttentionConfig, query, key, value, *, deterministic: bool, dropout_rng, precision=None, segment_ids=None
):
    """Block-sparse multi-head attention of projected [..., T, features] inputs.

    ``query`` has num_heads heads, ``key`` and ``value`` num_kv_heads. Splits the heads,
    runs :func:`~jax_blocksparse.ops.attention.blocksparse_attention` with the layer's
    mask (dropout on the probabilities unless ``deterministic``; ``segment_ids`` [..., T]
    for packed documents) and merges the heads back: returns [..., T, qkv_features] in
    the inputs' dtype.
    """
    if query.shape[:-1] != key.shape[:-1] or key.shape != value.shape:
        raise ValueError(
            f"{cfg.layer}: projected query, key and value must share [..., T], and key and value one shape; got "
            f"{query.shape}, {key.shape} and {value.shape}"
        )
    q, k, v = _heads(cfg, query, key, value)
    rate = 0.0 if deterministic else cfg.dropout_rate
    if rate > 0.0 and dropout_rng is None:
        raise ValueError(f"{cfg.layer}: dropout_rate={rate} with deterministic=False needs a dropout rng")
    segments = None
    if segment_ids is not None:
        segment_ids = jnp.asarray(segment_ids)
        if segment_ids.shape != query.shape[:-1]:
            raise ValueError(
                f"{cfg.layer}: segment_ids must have the inputs' [..., T] = {query.shape[:-1]}, got {segment_ids.shape}"
            )
        segments = segment_ids.reshape(q.shape[:2])
    out = blocksparse_attention(
        q,
        k,
        v,
        cfg.mask,
        is_causal=cfg.is_causal,
        score_fn=cfg.score_fn,
        query_segment_ids=segments,
        dropout_rate=rate,
        dropout_rng=dropout_rng if rate > 0.0 else None,
        precision=precision,
    )
    return merge_heads(out, tuple(query.shape[:-2]))


def update_cache(cached_key, cached_value, index, key, value):
    """Writes one token's projected ``key`` and ``value`` [..., 1, KVH*D] into the caches at ``index``.

    The caches are [..., T, num_kv_heads, head_dim] (Flax's ``cached_key`` and
    ``cached_value``); returns the updated pair.
    """
    kv_heads, head_dim = cached_key.shape[-2:]
    key = key.reshape(key.shape[:-1] + (kv_heads, head_dim)).astype(cached_key.dtype)
    value = value.reshape(value.shape[:-1] + (kv_heads, cached_value.shape[-1])).astype(cached_value.dtype)
    start = (0,) * (cached_key.ndim - 3) + (index, 0, 0)
    return (
        jax.lax.dynamic_update_slice(cached_key, key, start),
        jax.lax.dynamic_update_slice(cached_value, value, start),
    )


def check_cache(cfg: AttentionConfig, cached_key, query, layer: str) -> None:
    """The cache must be [*lead, T, num_kv_heads, head_dim] for a query token [*lead, 1, qkv_features]."""
    head_dim = query.shape[-1] // cfg.num_heads
    want = tuple(query.shape[:-2]) + (cfg.seq_len, cfg.num_kv_heads, head_dim)
    if tuple(cached_key.shape) != want:
        raise ValueError(
            f"{layer}: the key-value cache is {tuple(cached_key.shape)}, but a query token "
            f"{tuple(query.shape)} needs {want}"
        )


def decode(cfg: AttentionConfig, query, cached_key, cached_value, index, *, precision=None):
    """One decoding step: the projected query token [..., 1, qkv_features] at position ``index``
    against the caches [..., T, num_kv_heads, head_dim] (which already hold its own key and
    value). Returns [..., 1, qkv_features]."""
    if not cfg.is_causal:
        raise ValueError(f"{cfg.layer}: decoding needs is_causal=True (a token cannot see keys not yet generated)")
    lead = tuple(query.shape[:-2])
    q = split_heads(query, cfg.num_heads)
    n = q.shape[0]
    caches = (c.reshape((n,) + c.shape[-3:]) for c in (cached_key, cached_value))
    out = blocksparse_decode(
        q.astype(cached_key.dtype), *caches, index, cfg.mask, score_fn=cfg.score_fn, precision=precision
    )
    return merge_heads(out.astype(query.dtype), lead)
