"""BlockSparseSelfAttention: multi-head self-attention whose scores exist only at a block mask (NNX)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax_blocksparse.layers import attention as _core
from jax_blocksparse.nnx.linear import BlockSparseLinear

Array = jax.Array
Initializer = Callable[..., Array]


class BlockSparseSelfAttention(nnx.Module):
    """Multi-head self-attention over a block-sparse attention pattern (NNX).

    The NNX twin of :class:`jax_blocksparse.nn.BlockSparseSelfAttention` (same arguments,
    same math, same parameter shapes): ``out(blocksparse_attention(query(x), key(x),
    value(x)))`` with scores only at the present blocks of ``mask``. The projections
    ``query``, ``key``, ``value``, ``out`` are ``nnx.Linear``, or
    :class:`~jax_blocksparse.nnx.BlockSparseLinear` with ``qkv_mask`` / ``out_mask``.

    There is no decode (incremental, key-value cache) mode: the layer attends over the
    whole sequence of T = ``mask.shape[-1] * block_size`` positions at every call.

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.causal(jbs.layouts.fixed(8, stride=4, summary=1))  # T = 8 * 16
        >>> layer = jbs.nnx.BlockSparseSelfAttention(4, 64, mask, 16, causal=True, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((2, 128, 64))).shape
        (2, 128, 64)

    The arguments ``mask``, ``block_size``, ``causal``, ``qkv_features``, ``out_features``,
    ``dtype``, ``param_dtype``, ``dropout_rate``, ``kernel_init``, ``bias_init``,
    ``use_bias``, ``qkv_mask``, ``out_mask``, ``projection_block_size`` and ``precision``
    mean what the linen layer's attributes of those names mean.

    Args:
      num_heads: number of heads.
      in_features: input features.
      deterministic: default of ``__call__``'s ``deterministic`` (no dropout if True).
      rngs: ``nnx.Rngs`` for the parameters (``params``) and, with ``dropout_rate > 0``,
        the stream the dropout keys come from (``dropout``).
    """

    def __init__(
        self,
        num_heads: int,
        in_features: int,
        mask: Any,
        block_size: int,
        *,
        causal: bool = False,
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
        self.config = nnx.static(_core.check_attention(
            type(self).__name__, num_heads=num_heads, mask=mask, block_size=block_size, causal=causal,
            dropout_rate=dropout_rate, qkv_features=qkv_features, out_features=out_features, qkv_mask=qkv_mask,
            out_mask=out_mask, projection_block_size=projection_block_size,
        ))
        self.in_features = in_features
        self.deterministic = deterministic
        self.precision = precision
        specs = _core.projections(self.config, in_features)

        def projection(spec: _core.Projection):
            if spec.mask is None:
                init = nnx.initializers.lecun_normal() if kernel_init is None else kernel_init
                return nnx.Linear(spec.in_features, spec.out_features, use_bias=use_bias, dtype=dtype,
                                  param_dtype=param_dtype, kernel_init=init, bias_init=bias_init,
                                  precision=precision, rngs=rngs)
            return BlockSparseLinear(spec.in_features, spec.out_features, spec.mask, spec.block_size,
                                     use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                                     kernel_init=kernel_init, bias_init=bias_init, rngs=rngs)

        self.query, self.key, self.value, self.out = (projection(specs[n]) for n in ("query", "key", "value", "out"))
        self.rngs = rngs["dropout"].fork() if self.config.dropout_rate > 0.0 else nnx.data(None)

    def __call__(self, inputs: Array, *, deterministic: bool | None = None, rngs: nnx.Rngs | None = None) -> Array:
        """Self-attention of ``inputs`` [..., T, in_features] -> [..., T, out_features].

        ``deterministic`` overrides the constructor's; ``rngs`` (optional) overrides the
        dropout stream kept from construction.
        """
        cfg = self.config
        _core.check_inputs(cfg, inputs, type(self).__name__)
        if inputs.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: inputs must have in_features={self.in_features} features, "
                f"got {tuple(inputs.shape)}"
            )
        q, k, v = self.query(inputs), self.key(inputs), self.value(inputs)
        deterministic = self.deterministic if deterministic is None else deterministic
        rng = None
        if cfg.dropout_rate > 0.0 and not deterministic:
            stream = self.rngs if rngs is None else rngs["dropout"]
            if stream is None:
                raise ValueError(f"{type(self).__name__}: dropout needs rngs (none were kept or given)")
            rng = stream()
        y = _core.attend(cfg, q, k, v, deterministic=deterministic, dropout_rng=rng, precision=self.precision)
        return self.out(y)
