"""BlockSparseSelfAttention: multi-head self-attention whose scores exist only at a block mask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_blocksparse.layers import attention as _core
from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.nn.dense import BlockSparseDense

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class BlockSparseSelfAttention(nn.Module):
    """Multi-head self-attention over a block-sparse attention pattern (linen).

    ``out = out_proj(blocksparse_attention(query(x), key(x), value(x)))`` with the heads
    split from the projected features, where
    :func:`~jax_blocksparse.ops.attention.blocksparse_attention` computes scores only at
    the present tiles of ``mask`` (memory O(tiles x bs^2) per head, never T x T). The
    four projections are ``flax.linen.Dense`` layers, or
    :class:`~jax_blocksparse.nn.BlockSparseDense` with ``qkv_mask`` / ``out_mask``; their
    parameters are under ``query``, ``key``, ``value`` and ``out``.

    With ``decode=True`` the layer keeps a key-value cache in Flax's ``"cache"``
    collection (``cached_key``, ``cached_value`` [..., T, num_kv_heads, head_dim] and
    ``cache_index``), as ``flax.linen.MultiHeadDotProductAttention`` does: the first call
    (``init``, with a whole [..., T, features] input) creates it, and every later call
    takes one token [..., 1, features], writes its key and value at ``cache_index`` and
    attends over the cache with :func:`~jax_blocksparse.ops.attention.blocksparse_decode`
    (work in proportion to the tiles of the token's block row). Decoding steps use no
    dropout and need ``is_causal=True``.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.fixed(8, stride=4, summary=1)            # T = 8 * 16
        >>> layer = jbs.nn.BlockSparseSelfAttention(num_heads=4, mask=mask, block_size=16, is_causal=True)
        >>> x = jnp.ones((2, 128, 64))                                 # [batch, T, features]
        >>> params = layer.init(jax.random.key(0), x)
        >>> layer.apply(params, x).shape
        (2, 128, 64)

    Decoding, token by token::

        >>> decoder = layer.clone(decode=True)
        >>> cache = decoder.init(jax.random.key(0), x)["cache"]          # zeros, cache_index 0
        >>> y, state = decoder.apply({**params, "cache": cache}, x[:, :1], mutable=["cache"])
        >>> y.shape, int(state["cache"]["cache_index"])
        ((2, 1, 64), 1)

    Attributes:
      {num_heads}
      mask: static block mask: a bool grid [T/bs, T/bs] (shared by the heads) or
        [num_heads, T/bs, T/bs], ``mask[i, j]`` letting query block i see key block j (see
        :mod:`jax_blocksparse.layouts`: ``local``, ``strided``, ``fixed``, ``bigbird``), or
        a concrete :class:`~jax_blocksparse.ops.attention.BlockMask` (e.g. from
        :func:`~jax_blocksparse.ops.attention.create_block_mask`).
      {block_size}
        Here: the attention tile edge; a BlockMask carries its own.
      is_causal: query i sees keys j <= i only (autoregressive); tiles above the
        diagonal are dropped.
      num_kv_heads: key/value heads (default num_heads): grouped-query attention with
        fewer, multi-query with 1; must divide num_heads.
      mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool``, a token-level mask inside the tiles
        (moved into ``mask``, a BlockMask, when the layer is built).
      score_fn: ``score_fn(score, b, h, q_idx, kv_idx) -> score`` (ALiBi, soft-capping, ...).
      decode: keep and use a key-value cache (see above).
      qkv_features: features of the projected queries (default: the input features);
        head_dim = qkv_features // num_heads; keys and values have num_kv_heads * head_dim.
      out_features: output features (default: the input features).
      {dtype}
        The softmax statistics are float32 in any case.
      {param_dtype}
      dropout_rate: dropout on the attention probabilities (the "dropout" rng).
      deterministic: no dropout if True; may also be passed to ``__call__``.
      kernel_init: initializer of the projection kernels (default: LeCun normal for
        dense projections; the block-sparse layer's fan-in aware default otherwise).
      bias_init: initializer of the projection biases. use_bias: whether they exist.
      qkv_mask: block mask [in_features / pbs, qkv_features / pbs] of the query, key
        and value projections (block-sparse; needs num_kv_heads == num_heads), or None
        for dense ones.
      out_mask: block mask [qkv_features / pbs, out_features / pbs] of the output
        projection, or None for a dense one.
      projection_block_size: ``pbs``, the projections' block edge (default block_size).
      {precision}
        Here: the attention products and the dense projections.
    """

    num_heads: int
    mask: Any
    block_size: int | None = None
    is_causal: bool = False
    num_kv_heads: int | None = None
    mask_fn: Callable | None = None
    score_fn: Callable | None = None
    decode: bool = False
    qkv_features: int | None = None
    out_features: int | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    dropout_rate: float = 0.0
    deterministic: bool | None = None
    kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    use_bias: bool = True
    qkv_mask: Any = None
    out_mask: Any = None
    projection_block_size: int | None = None
    precision: Any = None

    def __post_init__(self):
        cfg = self._config()
        # Keep the masks hashable (the module may be a static jit argument); the mask
        # carries mask_fn and block_size from here on.
        self.mask, self.qkv_mask, self.out_mask = cfg.mask, cfg.qkv_mask, cfg.out_mask
        self.block_size, self.mask_fn = cfg.mask.block_size, None
        super().__post_init__()

    def _config(self) -> _core.AttentionConfig:
        return _core.check_attention(
            type(self).__name__,
            num_heads=self.num_heads,
            mask=self.mask,
            block_size=self.block_size,
            is_causal=self.is_causal,
            dropout_rate=self.dropout_rate,
            qkv_features=self.qkv_features,
            out_features=self.out_features,
            qkv_mask=self.qkv_mask,
            out_mask=self.out_mask,
            projection_block_size=self.projection_block_size,
            num_kv_heads=self.num_kv_heads,
            mask_fn=self.mask_fn,
            score_fn=self.score_fn,
        )

    def _projection(self, name: str, spec: _core.Projection):
        if spec.mask is None:
            init = nn.initializers.lecun_normal() if self.kernel_init is None else self.kernel_init
            return nn.Dense(
                spec.out_features,
                use_bias=self.use_bias,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=init,
                bias_init=self.bias_init,
                precision=self.precision,
                name=name,
            )
        return BlockSparseDense(
            spec.out_features,
            spec.mask,
            spec.block_size,
            use_bias=self.use_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            name=name,
        )

    @nn.compact
    def __call__(self, inputs: Array, *, segment_ids: Array | None = None, deterministic: bool | None = None) -> Array:
        """Self-attention of ``inputs`` [..., T, in_features] -> [..., T, out_features].

        ``segment_ids`` (int [..., T], optional): packed documents, a token attends to
        its own segment only. ``deterministic`` (here or as an attribute) is needed when
        ``dropout_rate > 0``; dropout then draws from the ``"dropout"`` rng. With
        ``decode=True``, after the cache exists, ``inputs`` is one token [..., 1, in_features].
        """
        cfg = self._config()
        name = type(self).__name__
        stepping = self.decode and self.has_variable("cache", "cached_key")
        _core.check_inputs(cfg, inputs, name, decode=stepping)
        specs = _core.projections(cfg, inputs.shape[-1])
        q, k, v = (self._projection(n, specs[n])(inputs) for n in ("query", "key", "value"))
        if self.decode:
            head_dim = q.shape[-1] // cfg.num_heads
            shape = k.shape[:-1] + (cfg.num_kv_heads, head_dim)
            cached_key = self.variable("cache", "cached_key", jnp.zeros, shape, k.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, shape, v.dtype)
            cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if stepping:
                if segment_ids is not None:
                    raise ValueError(f"{name}: segment_ids are not supported while decoding")
                _core.check_cache(cfg, cached_key.value, q, name)
                index = cache_index.value
                cached_key.value, cached_value.value = _core.update_cache(
                    cached_key.value, cached_value.value, index, k, v
                )
                cache_index.value = index + 1
                y = _core.decode(cfg, q, cached_key.value, cached_value.value, index, precision=self.precision)
                return self._projection("out", specs["out"])(y)
        if cfg.dropout_rate > 0.0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        else:
            deterministic = True
        rng = None if deterministic else self.make_rng("dropout")
        y = _core.attend(
            cfg,
            q,
            k,
            v,
            deterministic=deterministic,
            dropout_rng=rng,
            precision=self.precision,
            segment_ids=segment_ids,
        )
        return self._projection("out", specs["out"])(y)
