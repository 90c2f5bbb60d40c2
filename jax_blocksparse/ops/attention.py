"""Block-sparse attention on the bsmm primitives: scores only at the present tiles of a block mask.

:func:`blocksparse_attention` takes what :func:`jax.nn.dot_product_attention` takes (query
[B, T_q, H, D], key and value [B, T_kv, KVH, D], ``scale``, ``bias``, ``is_causal``,
``query_seq_lengths``, ``key_value_seq_lengths``; KVH divides H: grouped-query and
multi-query attention) and a block mask: a bool tile grid [T_q/bs, T_kv/bs] or a
:class:`BlockMask`. It computes ``softmax(score) @ value`` where each query row's softmax
runs over the keys of its present tiles only, and

``score = score_fn(scale * q . k + bias, b, h, q_idx, kv_idx)``, masked (set to -inf) where
``mask_fn(b, h, q_idx, kv_idx)`` is false (in the partial tiles only), where
``is_causal`` and ``kv_idx > q_idx``, past the sequence lengths, and where the segment
ids of query and key differ. Nothing of size T_q x T_kv exists at any point: the scores,
probabilities and their gradients are [tiles, bs, bs] arrays.

How it is built from the bsmm primitives (:mod:`jax_blocksparse.ops.matmul`): every
(batch row, head) problem is a set of tiles of one stacked block-sparse matrix
(:mod:`jax_blocksparse.ops.attention_layout`; grouped query heads share their key
rows, nothing is repeated), so that

* the scores are one ``bsmm_updat(key^T, query^T)`` (an SDD product: a [bs_kv, bs_q]
  tile per present block), accumulated in float32;
* the softmax has float32 statistics per query row (segment reductions over the tiles
  of a query block row, which are consecutive slots); a row with no allowed key gets
  zeros, not NaN;
* the output is one ``bsmm(value^T, P)`` (a DSD product).

Gradients (``grad``, ``jvp``, ``vjp``) and ``vmap`` come from the primitives' rules; the
backward pass is the same three products. Under ``jit`` over several devices with
batch-sharded inputs, each device attends its own batch rows.

:func:`blocksparse_decode` is the one-token step of autoregressive decoding with a
key-value cache: it gathers the key blocks of the current query's block row only, so a
step costs work in proportion to that row's tiles, not to T.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import check_block_size
from jax_blocksparse.ops._checks import as_float_array
from jax_blocksparse.ops.attention_layout import stacked_plan
from jax_blocksparse.ops.block_mask import (
    BlockMask,
    block_mask_from_segments,
    check_token_fn,
    create_block_mask,
    elementwise,
)
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

__all__ = [
    "BlockMask",
    "block_mask_from_segments",
    "blocksparse_attention",
    "blocksparse_decode",
    "create_block_mask",
]


# ---------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------


def _check_qkv(query, key, value):
    """Shapes [B, T_q, H, D], [B, T_kv, KVH, D], [B, T_kv, KVH, Dv] with H % KVH == 0, one dtype."""
    query, key, value = (as_float_array(a, n) for a, n in ((query, "query"), (key, "key"), (value, "value")))
    if query.ndim != 4:
        raise ValueError(f"query must be [batch, T_q, heads, head_dim], got shape {tuple(query.shape)}")
    b, _, h, d = query.shape
    if key.ndim != 4 or key.shape[0] != b or key.shape[3] != d:
        raise ValueError(
            f"key must be [batch={b}, T_kv, kv_heads, head_dim={d}] (query {tuple(query.shape)}), "
            f"got shape {tuple(key.shape)}"
        )
    if value.ndim != 4 or value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"value must be [batch, T_kv, kv_heads, head_dim_v] with the first three of key "
            f"{tuple(key.shape)}, got shape {tuple(value.shape)}"
        )
    if key.shape[2] == 0 or h % key.shape[2]:
        raise ValueError(
            f"the query heads ({h}, query {tuple(query.shape)}) must be a multiple of the key/value "
            f"heads ({key.shape[2]}, key {tuple(key.shape)})"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must have one dtype, got {query.dtype}, {key.dtype} and {value.dtype}")
    return query, key, value


def as_block_mask(block_mask, block_size, *, mask_fn=None) -> BlockMask:
    """``block_mask`` (a bool grid or a :class:`BlockMask`) as a BlockMask, with ``mask_fn`` attached."""
    if isinstance(block_mask, BlockMask):
        if block_size is not None and check_block_size(block_size) != block_mask.block_size:
            raise ValueError(f"block_size={block_size} differs from the block mask's {block_mask.block_size}")
        if mask_fn is not None:
            if block_mask.mask_fn is not None:
                raise ValueError(
                    "mask_fn is given twice: the BlockMask already carries one (its full tiles "
                    "are full for that function)"
                )
            block_mask = BlockMask(
                block_mask.blocks, block_mask.block_size, mask_fn=mask_fn, capacity=block_mask.capacity
            )
        return block_mask
    if block_size is None:
        raise TypeError("block_size is required when block_mask is a bool grid (a BlockMask carries its own)")
    if isinstance(block_mask, jax.core.Tracer):
        raise TypeError(
            f"block_mask is traced (shape {tuple(block_mask.shape)}): wrap it as "
            "jbs.attention.BlockMask(blocks, block_size, capacity=...) so that the layout has a fixed size"
        )
    try:
        return BlockMask(block_mask, block_size, mask_fn=mask_fn)
    except (TypeError, ValueError) as e:
        raise type(e)(f"block_mask: {e}") from None


def _check_grid(bm: BlockMask, batch, heads, q_len, kv_len):
    gb, gh, n_q, n_kv = bm.grid
    bs = bm.block_size
    if q_len % bs or kv_len % bs:
        raise ValueError(f"T_q={q_len} and T_kv={kv_len} must be multiples of block_size={bs}")
    if (n_q, n_kv) != (q_len // bs, kv_len // bs):
        raise ValueError(
            f"block_mask of grid {bm.grid} does not match T_q={q_len}, T_kv={kv_len} at block_size={bs}: "
            f"its last two dims must be [{q_len // bs}, {kv_len // bs}]"
        )
    if gb not in (1, batch) or gh not in (1, heads):
        raise ValueError(f"block_mask of grid {bm.grid} must have batch 1 or {batch} and heads 1 or {heads}")


def _int_array(a, name, shape):
    a = jnp.asarray(a) if not hasattr(a, "dtype") else a
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got dtype {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")
    return a


def _check_bias(bias, batch, heads, q_len, kv_len):
    bias = jnp.asarray(bias)
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a float array, got dtype {bias.dtype} with shape {bias.shape}")
    full = (batch, heads, q_len, kv_len)
    shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    if bias.ndim > 4 or any(s not in (1, f) for s, f in zip(shape, full)) or shape[2:] != full[2:]:
        raise ValueError(
            f"bias must broadcast to [batch, heads, T_q, T_kv] = {list(full)} with its last two dims "
            f"[T_q, T_kv], got shape {tuple(bias.shape)}"
        )
    return bias.reshape(shape)


def _check_dropout(dropout_rate, dropout_rng):
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a PRNG key)")
    return dropout_rate


# ---------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------


def blocksparse_attention(
    query,
    key,
    value,
    block_mask,
    block_size: int | None = None,
    *,
    bias=None,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    query_segment_ids=None,
    key_value_segment_ids=None,
    mask_fn=None,
    score_fn=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    precision=None,
    impl: str | None = None,
):
    """Multi-head attention whose scores exist only at the present tiles of ``block_mask``.

    Equal to ``jax.nn.dot_product_attention`` with the dense mask that allows exactly
    the (query, key) pairs inside present tiles that pass every token-level mask below,
    except that a query row with no allowed key gets a zero output (the dense op
    averages over all keys there; for rows past ``query_seq_lengths`` both give zeros).

    Args:
      query: [batch, T_q, heads, head_dim]; float32, bfloat16 or float16.
      key: [batch, T_kv, kv_heads, head_dim], ``heads % kv_heads == 0``: query head h
        reads key head ``h // (heads // kv_heads)`` (grouped-query attention; multi-query
        with one key head).
      value: [batch, T_kv, kv_heads, head_dim_v]. One dtype for the three.
      block_mask: the tiles that are computed. A concrete bool grid [T_q/bs, T_kv/bs],
        [heads, T_q/bs, T_kv/bs] or [batch, heads, T_q/bs, T_kv/bs] (a leading 1
        broadcasts; patterns in :mod:`jax_blocksparse.layouts`), or a :class:`BlockMask`
        (from :func:`create_block_mask`, :func:`block_mask_from_segments`, or traced
        inside ``jit`` with a capacity). Its layout is cached per concrete mask.
      block_size: the tile edge, one of :data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`; a
        BlockMask carries its own.
      bias: None or a float bias broadcastable to [batch, heads, T_q, T_kv], added to
        the scaled scores (as ``jax.nn.dot_product_attention``'s; only its present tiles
        are read). For long sequences prefer ``score_fn``, which is never T_q x T_kv.
      scale: score scale, default ``1 / sqrt(head_dim)``.
      is_causal: query i sees keys j <= i only (top-left aligned, as in JAX); tiles
        above the diagonal are dropped from the layout, the rest of the mask is kept.
      query_seq_lengths, key_value_seq_lengths: None or int [batch]: positions at or
        past them are padding (no key there is seen; rows there give zeros).
      query_segment_ids, key_value_segment_ids: None or int [batch, T_q] and [batch,
        T_kv] (the latter defaults to the former when T_q == T_kv): a query sees only
        keys of its own segment (packed documents). :func:`block_mask_from_segments`
        makes the matching block mask from the same ids.
      mask_fn: None or ``mask_fn(b, h, q_idx, kv_idx) -> bool`` (int32 scalars; traced
        elementwise in the partial tiles only). Not with a BlockMask that has its own.
      score_fn: None or ``score_fn(score, b, h, q_idx, kv_idx) -> score`` (a float32
        scalar score; traced elementwise in the present tiles), applied after scale
        and bias, before the masks: ALiBi, soft-capping, relative biases.
      dropout_rate: probability of dropping an attention probability, in [0, 1).
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      precision: as in :func:`jax.lax.dot_general`, for both products.
      impl: the bsmm implementation of both products (see :func:`jax_blocksparse.bsmm`).

    Returns:
      [batch, T_q, heads, head_dim_v] in query's dtype. The scores, the softmax
      statistics and the products' accumulation are float32; the probabilities are cast
      to value's dtype for the product with value.

    Example (a causal "fixed" pattern; 4 query heads share 2 key heads)::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.fixed(8, stride=4, summary=1)            # T = 8 x 16 = 128
        >>> q = jax.random.normal(jax.random.key(0), (2, 128, 4, 32))  # [batch, T, heads, head_dim]
        >>> k = v = jax.random.normal(jax.random.key(1), (2, 128, 2, 32))
        >>> jbs.attention.blocksparse_attention(q, k, v, mask, 16, is_causal=True).shape
        (2, 128, 4, 32)
    """
    query, key, value = _check_qkv(query, key, value)
    batch, q_len, heads, head_dim = query.shape
    kv_len = key.shape[1]
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    if mask_fn is not None:
        check_token_fn(mask_fn, "mask_fn", takes_score=False)
    if score_fn is not None:
        check_token_fn(score_fn, "score_fn", takes_score=True)
    bm = as_block_mask(block_mask, block_size, mask_fn=mask_fn)
    _check_grid(bm, batch, heads, q_len, kv_len)
    dropout_rate = _check_dropout(dropout_rate, dropout_rng)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)

    data = {}  # the arrays that vary per batch row: split across devices under data-parallel jit
    if bias is not None:
        data["bias"] = _check_bias(bias, batch, heads, q_len, kv_len)
    if query_seq_lengths is not None:
        data["q_lengths"] = _int_array(query_seq_lengths, "query_seq_lengths", (batch,))
    if key_value_seq_lengths is not None:
        data["kv_lengths"] = _int_array(key_value_seq_lengths, "key_value_seq_lengths", (batch,))
    if key_value_segment_ids is not None and query_segment_ids is None:
        raise ValueError("key_value_segment_ids needs query_segment_ids")
    if query_segment_ids is not None:
        data["q_segments"] = _int_array(query_segment_ids, "query_segment_ids", (batch, q_len))
        if key_value_segment_ids is None:
            if q_len != kv_len:
                raise ValueError(
                    f"T_q={q_len} != T_kv={kv_len}: key_value_segment_ids is needed with query_segment_ids"
                )
            data["kv_segments"] = data["q_segments"]
        else:
            data["kv_segments"] = _int_array(key_value_segment_ids, "key_value_segment_ids", (batch, kv_len))

    body = functools.partial(
        _attend,
        block_size=bm.block_size,
        mask_fn=bm.mask_fn,
        capacity=bm.capacity,
        is_causal=bool(is_causal),
        scale=scale,
        score_fn=score_fn,
        dropout_rate=dropout_rate,
        precision=precision,
        impl=impl,
    )
    grids = {"blocks": bm.blocks, "full": bm.full}
    axes, size = _auto_mesh_axes(query)
    if size > 1 and batch % size == 0:
        return _batch_parallel(body, axes, query, key, value, data, grids, dropout_rng)
    return body(query, key, value, data, grids, dropout_rng)


def _batch_parallel(body, axes, query, key, value, data, grids, rng):
    """``body`` under shard_map over the batch: each device attends its own batch rows.

    The stacked layout folds the batch into the products' feature dim, which their
    sharding rule would gather; splitting the batch first keeps every product local.
    Arrays with a batch dim of 1 (a shared bias or block grid) are replicated.
    """
    batch = query.shape[0]
    mesh = jax.typeof(query).sharding.mesh
    split, whole = jax.sharding.PartitionSpec(axes), jax.sharding.PartitionSpec()

    def spec(a):
        return split if a is not None and a.shape[0] == batch > 1 else whole

    # A concrete grid shared by the batch stays a host constant (closed over); one with a
    # batch dim, or a traced one, becomes an operand (split like the data if it has the batch).
    concrete = all(isinstance(v, np.ndarray) for v in grids.values() if v is not None)
    operand = grids["blocks"].shape[0] == batch > 1 or not concrete
    operands = {"grids": {k: (None if v is None else jnp.asarray(v)) for k, v in grids.items()}} if operand else {}
    specs = {"grids": {k: spec(v) for k, v in grids.items()}} if operand else {}

    def local(query, key, value, data, operands, rng):
        if rng is not None:  # a different dropout mask on every device
            rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
        return body(query, key, value, data, operands.get("grids", grids), rng)

    in_specs = (split, split, split, {k: spec(v) for k, v in data.items()}, specs, whole)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=split)(query, key, value, data, operands, rng)


def _auto_mesh_axes(x) -> tuple[tuple, int]:
    """The automatic mesh axes of ``x``'s type under jit over several devices, and their size.

    ((), 1) outside such a jit, inside ``shard_map`` (manual axes) and on meshes with
    explicit axes (their shardings are in the types, and XLA partitions by them).
    """
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
        return (), 1
    auto = getattr(jax.sharding.AxisType, "Auto", None)
    if any(t != auto for t in mesh.axis_types):
        return (), 1
    axes = tuple(mesh.axis_names)
    return axes, math.prod(mesh.shape[a] for a in axes)


def _features(a):
    """[B, T, H, D] -> [D, B*H*T]: the stacked positions (problem-major) are the products' features."""
    b, t, h, d = a.shape
    return a.transpose(3, 0, 2, 1).reshape(d, b * h * t)


def _attend(
    query,
    key,
    value,
    data,
    grids,
    rng,
    *,
    block_size,
    mask_fn,
    capacity,
    is_causal,
    scale,
    score_fn,
    dropout_rate,
    precision,
    impl,
):
    """The attention of checked operands on one device: see :func:`blocksparse_attention`."""
    batch, q_len, heads, _ = query.shape
    kv_heads, dv = key.shape[2], value.shape[3]
    bm = BlockMask.tree_unflatten((block_size, mask_fn, capacity), (grids["blocks"], grids["full"]))
    plan = stacked_plan(bm, batch, heads, kv_heads, is_causal)
    layout, total = plan.layout, plan.layout.capacity
    if total == 0:  # no tile anywhere: every row is empty
        return jnp.zeros((batch, q_len, heads, dv), query.dtype)

    # scores[s] = k_block @ q_block^T: [total, bs_kv, bs_q], float32
    scores = bsmm_updat(
        _features(key), _features(query), layout, out_dtype=jnp.float32, precision=precision, impl=impl
    ) * jnp.float32(scale)
    if "bias" in data:
        bias = data["bias"]
        tiles = bias.reshape(bias.shape[:2] + (q_len // block_size, block_size, -1, block_size))
        pick = (
            plan.batch if bias.shape[0] > 1 else 0,
            plan.head if bias.shape[1] > 1 else 0,
            plan.q_block,
            slice(None),
            plan.kv_block,
            slice(None),
        )
        scores = scores + tiles[pick].swapaxes(-1, -2).astype(jnp.float32)  # [total, bs_kv, bs_q]
    if score_fn is not None:
        scores = elementwise(
            lambda s, *i: jnp.asarray(score_fn(s, *i), jnp.float32), scores, *_element_indices(plan, block_size)
        )
    keep = _kept(plan, mask_fn, is_causal, data, block_size)
    if keep is not None:
        scores = jnp.where(keep, scores, -jnp.inf)

    # Softmax over each query row's tiles: the tiles of a query block row share plan.column.
    column, rows = plan.column, plan.num_columns
    row_max = jax.ops.segment_max(scores.max(axis=1), column, num_segments=rows)  # [rows, bs_q]
    # stop_gradient: the softmax does not depend on it; a row without a finite score uses 0
    # (exp then gives 0s, not NaN).
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(scores - row_max[column][:, None, :])
    row_sum = jax.ops.segment_sum(e.sum(axis=1), column, num_segments=rows)
    inv = jnp.where(row_sum > 0, 1.0 / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    probs = e * inv[column][:, None, :]
    if dropout_rate > 0.0:
        kept = jax.random.bernoulli(rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(kept, probs / (1.0 - dropout_rate), 0.0)

    out_t = bsmm(
        _features(value),
        probs.astype(value.dtype),
        layout,
        preferred_element_type=query.dtype,
        precision=precision,
        impl=impl,
    )  # [Dv, B*H*T_q] = (P @ v)^T
    out = out_t.reshape(dv, batch, heads, q_len).transpose(1, 3, 2, 0)
    if plan.overflow is not None:  # tiles were dropped: say so loudly (nothing can raise inside jit)
        out = jnp.where(plan.overflow, jnp.nan, out)
    return out


def _element_indices(plan, bs: int, slots=None):
    """(b, h, q_idx, kv_idx) of the elements of the plan's tiles (or of ``slots``), broadcastable
    to [slots, bs_kv, bs_q]; numpy (constants) for a host plan."""
    pick = (lambda a: a) if slots is None else (lambda a: a[slots])
    offsets = np.arange(bs, dtype=np.int32)
    b, h, i, j = (pick(a)[:, None, None] for a in (plan.batch, plan.head, plan.q_block, plan.kv_block))
    return b, h, i * bs + offsets[None, None, :], j * bs + offsets[None, :, None]


def _kept(plan, mask_fn, is_causal, data, bs: int):
    """bool, broadcastable to [total, bs_kv, bs_q]: the elements the token-level masks keep (None: all).

    The structured masks (``mask_fn`` and the causal triangle) are evaluated in the tiles
    that are not full only: a static list of slots for a host plan, else in every tile and
    overridden where the tile is full. Lengths and segment ids are cheap comparisons of
    per-tile vectors, applied everywhere.
    """
    keep = None

    def both(a, c):
        return c if a is None else a & c

    if mask_fn is not None or is_causal:

        def structured(b, h, q, kv):
            m = mask_fn(b, h, q, kv) if mask_fn is not None else True
            return m & (q >= kv) if is_causal else m

        total = plan.layout.capacity
        if plan.partial is not None:  # host plan: the partial slots are known
            if plan.partial.size:
                m = elementwise(structured, *_element_indices(plan, bs, plan.partial))
                keep = jnp.ones((total, bs, bs), bool).at[plan.partial].set(m, unique_indices=True)
        else:
            keep = elementwise(structured, *_element_indices(plan, bs)) | plan.full[:, None, None]
    if plan.valid is not None:
        keep = both(keep, plan.valid[:, None, None])
    _, _, q_idx, kv_idx = _element_indices(plan, bs)
    if "q_lengths" in data:
        keep = both(keep, q_idx < data["q_lengths"][plan.batch][:, None, None])
    if "kv_lengths" in data:
        keep = both(keep, kv_idx < data["kv_lengths"][plan.batch][:, None, None])
    if "q_segments" in data:
        q_seg, kv_seg = data["q_segments"], data["kv_segments"]
        q_seg = q_seg.reshape(q_seg.shape[0], -1, bs)[plan.batch, plan.q_block]  # [total, bs_q]
        kv_seg = kv_seg.reshape(kv_seg.shape[0], -1, bs)[plan.batch, plan.kv_block]  # [total, bs_kv]
        keep = both(keep, q_seg[:, None, :] == kv_seg[:, :, None])
    return keep


# ---------------------------------------------------------------------------------
# Decoding: one query token against a key-value cache
# ---------------------------------------------------------------------------------


class _RowTable:
    """Per query block row of a concrete mask: its key blocks (causal), padded into size buckets."""

    def __init__(self, blocks: np.ndarray):
        gb, gh, n_q, n_kv = blocks.shape
        blocks = blocks & np.tril(np.ones((n_q, n_kv), bool))
        counts = blocks.sum(-1)  # [gb, gh, n_q]
        widest = int(counts.max(initial=0))
        ids = np.zeros((gb, gh, n_q, max(widest, 1)), np.int32)
        for index in np.ndindex(gb, gh, n_q):
            (present,) = np.nonzero(blocks[index])
            ids[index][: present.size] = present
        # Power-of-two buckets up to the widest row: a row of c tiles runs in the branch
        # of the smallest bucket >= c, so a step costs at most twice its own tiles.
        need = counts.max(axis=(0, 1))  # [n_q]
        buckets = sorted({min(widest, 1 << max(int(c) - 1, 0).bit_length()) for c in need} | {max(widest, 1)})
        self.ids, self.counts, self.buckets = ids, counts.astype(np.int32), tuple(max(r, 1) for r in buckets)
        self.bucket_of_row = np.searchsorted(np.array(self.buckets), np.maximum(need, 1)).astype(np.int32)


@functools.lru_cache(maxsize=32)
def _row_table(blocks_key: bytes, grid: tuple) -> _RowTable:
    return _RowTable(np.frombuffer(blocks_key, bool).reshape(grid))


def blocksparse_decode(
    query,
    key_cache,
    value_cache,
    position,
    block_mask,
    block_size: int | None = None,
    *,
    scale: float | None = None,
    mask_fn=None,
    score_fn=None,
    precision=None,
):
    """One causal decoding step: the attention of the token at ``position`` over a key-value cache.

    Equal to row ``position`` of ``blocksparse_attention(..., is_causal=True)`` over the
    full sequence whose first ``position + 1`` keys and values are in the cache. Only the
    key blocks of the query's block row ``position // bs`` are gathered (the row's
    present tiles, padded to a power-of-two bucket; one branch per bucket size), so a
    step costs work in proportion to that row's tiles, not to T.

    Args:
      query: [batch, 1, heads, head_dim], the new token's queries.
      key_cache: [batch, T, kv_heads, head_dim]: keys of positions 0..position (later
        positions are ignored). value_cache: [batch, T, kv_heads, head_dim_v].
      position: int scalar (traced or not), the query's position, 0 <= position < T.
      block_mask: a concrete bool grid [T/bs, T/bs] (or per head / batch) or a concrete
        :class:`BlockMask`, as for :func:`blocksparse_attention` (tiles above the
        diagonal are ignored).
      block_size: the tile edge (a BlockMask carries its own).
      scale, mask_fn, score_fn, precision: as for :func:`blocksparse_attention`.

    Returns:
      [batch, 1, heads, head_dim_v] in query's dtype.
    """
    query, key_cache, value_cache = _check_qkv(query, key_cache, value_cache)
    batch, one, heads, head_dim = query.shape
    if one != 1:
        raise ValueError(f"query must be one token [batch, 1, heads, head_dim], got shape {tuple(query.shape)}")
    t, kv_heads = key_cache.shape[1:3]
    if mask_fn is not None:
        check_token_fn(mask_fn, "mask_fn", takes_score=False)
    if score_fn is not None:
        check_token_fn(score_fn, "score_fn", takes_score=True)
    bm = as_block_mask(block_mask, block_size, mask_fn=mask_fn)
    if not bm.is_concrete:
        raise TypeError("blocksparse_decode needs a concrete block mask (its rows' key blocks are host tables)")
    _check_grid(bm, batch, heads, t, t)
    position = jnp.asarray(position)
    if position.shape != () or not jnp.issubdtype(position.dtype, jnp.integer):
        raise TypeError(f"position must be an int scalar, got {position.dtype} with shape {position.shape}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    table = _row_table(np.ascontiguousarray(bm.blocks).tobytes(), bm.grid)
    bs, group = bm.block_size, heads // kv_heads
    position = position.astype(jnp.int32)
    fn = bm.mask_fn

    def step(width, query, key_cache, value_cache, position):
        row = position // bs
        ids = jnp.asarray(table.ids)[:, :, row, :width]  # [gb, gh, width]
        present = jnp.arange(width) < jnp.asarray(table.counts)[:, :, row][..., None]
        ids = jnp.broadcast_to(ids, (batch, heads, width))
        present = jnp.broadcast_to(present, (batch, heads, width))
        b_ix = jnp.arange(batch)[:, None, None]
        kv_head = (jnp.arange(heads) // group)[None, :, None]
        keys = key_cache.reshape(batch, -1, bs, kv_heads, head_dim)[b_ix, ids, :, kv_head, :]  # [B, H, w, bs, D]
        values = value_cache.reshape(batch, -1, bs, kv_heads, value_cache.shape[-1])[b_ix, ids, :, kv_head, :]
        s = jnp.einsum(
            "bhd,bhwkd->bhwk", query[:, 0], keys, preferred_element_type=jnp.float32, precision=precision
        ) * jnp.float32(scale)
        kv_idx = ids[..., None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [B, H, w, bs]
        b_i = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
        h_i = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
        if score_fn is not None:
            s = elementwise(lambda *a: jnp.asarray(score_fn(*a), jnp.float32), s, b_i, h_i, position, kv_idx)
        keep = present[..., None] & (kv_idx <= position)
        if fn is not None:
            keep = keep & elementwise(fn, b_i, h_i, position, kv_idx)
        s = jnp.where(keep, s, -jnp.inf)
        top = jax.lax.stop_gradient(s.max(axis=(2, 3), keepdims=True))
        e = jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0))
        total = e.sum(axis=(2, 3), keepdims=True)
        p = e * jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
        out = jnp.einsum(
            "bhwk,bhwkd->bhd",
            p.astype(value_cache.dtype),
            values,
            preferred_element_type=jnp.float32,
            precision=precision,
        )
        return out.astype(query.dtype)[:, None]

    branches = [functools.partial(step, width) for width in table.buckets]
    if len(branches) == 1:
        return branches[0](query, key_cache, value_cache, position)
    bucket = jnp.asarray(table.bucket_of_row)[position // bs]
    return jax.lax.switch(bucket, branches, query, key_cache, value_cache, position)
