"""BlockSparseSelfAttention: multi-head self-attention whose scores exist only at a block mask."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_blocksparse.layers import attention as _core
from jax_blocksparse.nn.dense import BlockSparseDense

Array = jax.Array
Initializer = Callable[..., Array]


class BlockSparseSelfAttention(nn.Module):
    """Multi-head self-attention over a block-sparse attention pattern (linen).

    ``out = out_proj(blocksparse_attention(query(x), key(x), value(x)))`` with the heads
    split from the projected features, where :func:`jax_blocksparse.attention.blocksparse_attention`
    computes scores only at the present blocks of ``mask`` (memory O(nnz blocks x bs^2)
    per head, never T x T). The four projections are ``flax.linen.Dense`` layers, or
    :class:`~jax_blocksparse.nn.BlockSparseDense` with ``qkv_mask`` / ``out_mask``;
    their parameters are under ``query``, ``key``, ``value`` and ``out``.

    There is no decode (incremental, key-value cache) mode: the layer attends over the
    whole sequence of T = ``mask.shape[-1] * block_size`` positions at every call.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.causal(jbs.layouts.fixed(8, stride=4, summary=1))  # T = 8 * 16
        >>> layer = jbs.nn.BlockSparseSelfAttention(num_heads=4, mask=mask, block_size=16, causal=True)
        >>> x = jnp.ones((2, 128, 64))                            # [batch, T, features]
        >>> params = layer.init(jax.random.key(0), x)
        >>> layer.apply(params, x).shape
        (2, 128, 64)

    Attributes:
      num_heads: number of heads; ``qkv_features`` must be divisible by it.
      mask: static boolean attention block mask, [T/bs, T/bs] (shared by the heads) or
        [num_heads, T/bs, T/bs]: ``mask[i, j]`` lets query block i see key block j (see
        :mod:`jax_blocksparse.layouts`: ``local``, ``strided``, ``fixed``, ``bigbird``).
      block_size: the attention block edge (8, 16, 32, 64 or 128).
      causal: mask later keys inside the diagonal blocks too (autoregressive); the mask
        must then be lower triangular (``jbs.layouts.causal``).
      qkv_features: features of the projected queries, keys and values (default: the
        input features); head_dim = qkv_features // num_heads.
      out_features: output features (default: the input features).
      dtype: computation dtype (default: inferred from inputs and params). float32,
        bfloat16 or float16; the softmax statistics are float32 in any case.
      param_dtype: dtype of the parameters (default float32).
      dropout_rate: dropout on the attention probabilities (the "dropout" rng).
      deterministic: no dropout if True; may also be passed to ``__call__``.
      kernel_init: initializer of the projection kernels (default: LeCun normal for
        dense projections; the block-sparse layer's fan-in aware default otherwise).
      bias_init: initializer of the projection biases. use_bias: whether they exist.
      qkv_mask: block mask [in_features / pbs, qkv_features / pbs] of the query, key
        and value projections (block-sparse), or None for dense ones.
      out_mask: block mask [qkv_features / pbs, out_features / pbs] of the output
        projection, or None for a dense one.
      projection_block_size: ``pbs``, the projections' block edge (default block_size).
      precision: as in :func:`jax.lax.dot_general`, for the attention products and the
        dense projections.
    """

    num_heads: int
    mask: Any
    block_size: int
    causal: bool = False
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
        # Keep the masks hashable (the module may be a static jit argument).
        self.mask, self.qkv_mask, self.out_mask = cfg.mask, cfg.qkv_mask, cfg.out_mask
        super().__post_init__()

    def _config(self) -> _core.AttentionConfig:
        return _core.check_attention(
            type(self).__name__, num_heads=self.num_heads, mask=self.mask, block_size=self.block_size,
            causal=self.causal, dropout_rate=self.dropout_rate, qkv_features=self.qkv_features,
            out_features=self.out_features, qkv_mask=self.qkv_mask, out_mask=self.out_mask,
            projection_block_size=self.projection_block_size,
        )

    def _projection(self, name: str, spec: _core.Projection):
        if spec.mask is None:
            init = nn.initializers.lecun_normal() if self.kernel_init is None else self.kernel_init
            return nn.Dense(spec.out_features, use_bias=self.use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                            kernel_init=init, bias_init=self.bias_init, precision=self.precision, name=name)
        return BlockSparseDense(spec.out_features, spec.mask, spec.block_size, use_bias=self.use_bias,
                                dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                                bias_init=self.bias_init, name=name)

    @nn.compact
    def __call__(self, inputs: Array, *, deterministic: bool | None = None) -> Array:
        """Self-attention of ``inputs`` [..., T, in_features] -> [..., T, out_features].

        ``deterministic`` (here or as an attribute) is needed when ``dropout_rate > 0``;
        dropout then draws from the ``"dropout"`` rng.
        """
        cfg = self._config()
        _core.check_inputs(cfg, inputs, type(self).__name__)
        specs = _core.projections(cfg, inputs.shape[-1])
        q, k, v = (self._projection(name, specs[name])(inputs) for name in ("query", "key", "value"))
        if cfg.dropout_rate > 0.0:
            deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
        else:
            deterministic = True
        rng = None if deterministic else self.make_rng("dropout")
        y = _core.attend(cfg, q, k, v, deterministic=deterministic, dropout_rng=rng, precision=self.precision)
        return self._projection("out", specs["out"])(y)
