"""BlockSparseSelfAttention: multi-head self-attention whose scores exist only at a block mask (NNX)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_blocksparse.layers import attention as _core
from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.nnx.linear import BlockSparseLinear

Array = jax.Array
Initializer = Callable[..., Array]


@attribute_docs.fill
class BlockSparseSelfAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse attention pattern (NNX).

    The NNX twin of :class:`jax_blocksparse.nn.BlockSparseSelfAttention` (same arguments,
    same math, same parameter shapes): ``out(blocksparse_attention(query(x), key(x),
    value(x)))`` with scores only at the present tiles of ``mask``. The projections
    ``query``, ``key``, ``value``, ``out`` are ``nnx.Linear``, or
    :class:`~jax_blocksparse.nnx.BlockSparseLinear` with ``qkv_mask`` / ``out_mask``.

    Decoding follows ``flax.nnx.MultiHeadAttention``: construct with ``decode=True`` (or
    pass ``decode=True`` to the call), call :meth:`init_cache` with the input shape
    [..., T, in_features] once, then feed one token [..., 1, in_features] per call; the
    cache is ``nnx.Cache`` variables ``cached_key``, ``cached_value`` and ``cache_index``.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.fixed(8, stride=4, summary=1)            # T = 8 * 16
        >>> layer = jbs.nnx.BlockSparseSelfAttention(4, 64, mask, 16, is_causal=True, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 128, 64))).shape
        (2, 128, 64)
        >>> layer.init_cache((2, 128, 64))
        >>> layer(jnp.ones((2, 1, 64)), decode=True).shape, int(layer.cache_index[...])
        ((2, 1, 64), 1)

    The arguments ``mask``, ``block_size``, ``is_causal``, ``num_kv_heads``, ``mask_fn``,
    ``score_fn``, ``qkv_features``, ``out_features``, ``dtype``, ``param_dtype``,
    ``dropout_rate``, ``kernel_init``, ``bias_init``, ``use_bias``, ``qkv_mask``,
    ``out_mask``, ``projection_block_size`` and ``precision`` mean what the linen
    layer's attributes of those names mean.

    Args:
      {num_heads}
      in_features: input features.
      deterministic: default of ``__call__``'s ``deterministic`` (no dropout if True).
      decode: default of ``__call__``'s ``decode``.
      rngs: ``nnx.Rngs`` for the parameters (``params``) and, with ``dropout_rate > 0``,
        the stream the dropout keys come from (``dropout``).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        mask: Any,
        block_size: int | None = None,
        *,
        is_causal: bool = False,
        num_kv_heads: int | None = None,
        mask_fn: Callable | None = None,
        score_fn: Callable | None = None,
        decode: bool = False,
        qkv_features: int | None = None,
        out_features: int | None = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        dropout_rate: float = 0.0,
        deterministic: bool = False,
        kernel_init: Initializer | None = None,
        bias_init: Initializer = nnx.initializers.zeros_init(),
        use_bias: bool = True,
        qkv_mask: Any = None,
        out_mask: Any = None,
        projection_block_size: int | None = None,
        precision: Any = None,
        rngs: nnx.Rngs,
    ):
        self.config = nnx.static(
            _core.check_attention(
                type(self).__name__,
                num_heads=num_heads,
                mask=mask,
                block_size=block_size,
                is_causal=is_causal,
                dropout_rate=dropout_rate,
                qkv_features=qkv_features,
                out_features=out_features,
                qkv_mask=qkv_mask,
                out_mask=out_mask,
                projection_block_size=projection_block_size,
                num_kv_heads=num_kv_heads,
                mask_fn=mask_fn,
                score_fn=score_fn,
            )
        )
        self.in_features = in_features
        self.deterministic = deterministic
        self.decode = decode
        self.precision = precision
        self.dtype = dtype
        specs = _core.projections(self.config, in_features)

        def projection(spec: _core.Projection):
            if spec.mask is None:
                init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init
                return nnx.Linear(
                    spec.in_features,
                    spec.out_features,
                    use_bias=use_bias,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    kernel_init=init,
                    bias_init=bias_init,
                    precision=precision,
                    rngs=rngs,
                )
            return BlockSparseLinear(
                spec.in_features,
                spec.out_features,
                spec.mask,
                spec.block_size,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                kernel_init=kernel_init,
                bias_init=bias_init,
                rngs=rngs,
            )

        self.query, self.key, self.value, self.out = (projection(specs[n]) for n in ("query", "key", "value", "out"))
        self.rngs = rngs["dropout"].fork() if self.config.dropout_rate > 0.0 else nnx.data(None)
        self.cached_key = self.cached_value = self.cache_index = nnx.data(None)

    def init_cache(self, input_shape, dtype: Any = jnp.float32) -> None:
        """Makes a zero cache for inputs of ``input_shape`` [..., T, in_features] (T the mask's)."""
        cfg = self.config
        *lead, t, f = input_shape
        if t != cfg.seq_len or f != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: init_cache needs input_shape [..., T={cfg.seq_len}, "
                f"in_features={self.in_features}], got {tuple(input_shape)}"
            )
        qkv = _core.projections(cfg, f)["query"].out_features
        shape = (*lead, t, cfg.num_kv_heads, qkv // cfg.num_heads)
        dtype = self.dtype or dtype
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(
        self,
        inputs: Array,
        *,
        segment_ids: Array | None = None,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | None = None,
        decode: bool | None = None,
    ) -> Array:
        """Self-attention of ``inputs`` [..., T, in_features] -> [..., T, out_features].

        ``segment_ids`` (int [..., T]): packed documents. ``deterministic`` and ``decode``
        override the constructor's; ``rngs`` (optional) overrides the dropout stream kept
        from construction. Decoding takes one token [..., 1, in_features].
        """
        cfg = self.config
        name = type(self).__name__
        decode = self.decode if decode is None else decode
        _core.check_inputs(cfg, inputs, name, decode=decode)
        if inputs.shape[-1] != self.in_features:
            raise ValueError(
                f"{name}: inputs must have in_features={self.in_features} features, got {tuple(inputs.shape)}"
            )
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        if decode:
            if self.cached_key is None:
                raise ValueError(f"{name}: decoding needs a cache: call init_cache(input_shape) first")
            if segment_ids is not None:
                raise ValueError(f"{name}: segment_ids are not supported while decoding")
            _core.check_cache(cfg, self.cached_key[...], q, name)
            index = self.cache_index[...]
            self.cached_key[...], self.cached_value[...] = _core.update_cache(
                self.cached_key[...], self.cached_value[...], index, k, v
            )
            self.cache_index[...] = index + 1
            y = _core.decode(cfg, q, self.cached_key[...], self.cached_value[...], index, precision=self.precision)
            return self.out(y)
        deterministic = self.deterministic if deterministic is None else deterministic
        rng = None
        if cfg.dropout_rate > 0.0 and not deterministic:
            stream = self.rngs if rngs is None else rngs["dropout"]
            if stream is None:
                raise ValueError(f"{name}: dropout needs rngs (none were kept or given)")
            rng = stream()
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
        return self.out(y)
