"""Block-sparse attention on the bsmm primitives: scores only at the present blocks.

For q, k, v of shape [batch, heads, T, head_dim] and a boolean block mask M of shape
[T/bs, T/bs] (query block rows x key block columns), :func:`blocksparse_attention`
computes ``softmax(q k^T * scale + bias) v`` where the softmax of each query row runs
over the keys of that row's present blocks only. Nothing of size T x T exists at any
point: the scores, probabilities and their gradients are [nnz, bs, bs] arrays, one
bs x bs tile per present block, in the layout's storage order.

How it is built from the three bsmm primitives (:mod:`jax_blocksparse.ops.matmul`):

* scores: ``bsmm_updat(q^T, k^T)`` with q^T, k^T as [head_dim, T] operands gives
  ``S[s] = q[query block of s] @ k[key block of s]^T`` for every present block s
  (an SDD product), accumulated in float32;
* softmax: float32 statistics per query row. The row max and the row sum are
  segment reductions over the blocks' ``block_rows``; a causal mask applies inside
  the diagonal blocks; a row with no present key gets zeros (not NaN);
* output: ``bsmm(v^T, P, transpose=True)`` = ``(P @ v)^T`` (a DSD product; bprop).

Batch and heads: the batch x heads independent problems are stacked into one
block-diagonal layout of grid (B*H*T/bs, B*H*T/bs), exactly what the primitives'
batching rule builds under ``vmap``, but built once on the host from the concrete
mask and cached, so that its tables are compile-time constants and no scores are
permuted at run time. ``jax.vmap`` of this function over further axes uses the
primitives' batching rules. Gradients (``grad``, ``jvp``, ``vjp``) come from the
primitives' JVP and transpose rules: the backward pass is the same three products.

Memory: the scores, probabilities (and, under ``grad``, their cotangents) are
[B*H*nnz, bs, bs] float32 arrays: O(nnz blocks x bs^2) per head instead of T^2.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import Layout, LayoutTables, check_block_size
from jax_blocksparse.ops._checks import as_float_array
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

__all__ = ["attention_layout", "bias_blocks", "blocksparse_attention", "check_attention_mask"]


# ---------------------------------------------------------------------------------
# Mask checks and the cached plan (stacked layout and per-slot constants)
# ---------------------------------------------------------------------------------


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_attention_mask(mask, *, seq_len: int | None = None, block_size: int | None = None,
                         num_heads: int | None = None, causal: bool = False) -> np.ndarray:
    """Validates an attention block mask and returns it as a numpy bool [H_m, n, n] array.

    Args:
      mask: concrete boolean [n, n] (shared by all heads) or [heads, n, n] (one mask
        per head); n = T / block_size. numpy or a concrete jax array.
      seq_len, block_size: when given, n must equal seq_len // block_size.
      num_heads: when given, a 3-D mask must have this many masks.
      causal: when True, no block may lie above the diagonal.

    Returns:
      numpy bool [1, n, n] (shared) or [heads, n, n].
    """
    if not _is_concrete(mask):
        raise TypeError(
            "mask must be a concrete boolean array (numpy, or a jax array outside any trace): "
            "attention layouts are built on the host from it. Close over the mask (or pass it "
            f"as a static argument) instead of passing it into jit; got a tracer of shape {tuple(mask.shape)}"
        )
    if not hasattr(mask, "dtype"):
        mask = np.asarray(mask)
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(
            f"mask must be a boolean block mask, got dtype {np.dtype(mask.dtype)} with shape {tuple(mask.shape)}"
        )
    mask = np.asarray(mask)
    if mask.ndim not in (2, 3) or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(
            f"mask must be [T/bs, T/bs] (shared by all heads) or [heads, T/bs, T/bs], got shape {mask.shape}"
        )
    n = mask.shape[-1]
    if seq_len is not None and block_size is not None and n * block_size != seq_len:
        raise ValueError(
            f"mask of shape {mask.shape} does not match T={seq_len} at block_size={block_size}: "
            f"its last two dims must be T/bs = {seq_len // block_size}"
        )
    if mask.ndim == 3 and num_heads is not None and mask.shape[0] != num_heads:
        raise ValueError(
            f"a per-head mask [heads, T/bs, T/bs] must have heads={num_heads} masks, got shape {mask.shape}"
        )
    if causal:
        above = np.argwhere(np.triu(mask, k=1) if mask.ndim == 2 else np.triu(mask, k=1).any(0))
        if above.size:
            i, j = above[0]
            raise ValueError(
                f"causal=True but the mask of shape {mask.shape} has {len(above)} block(s) above the "
                f"diagonal (e.g. query block {i}, key block {j}); apply jbs.layouts.causal(mask) first"
            )
    return mask.reshape((-1,) + mask.shape[-2:])


class _Plan(NamedTuple):
    layout: Layout  # the stacked block-diagonal layout of all B*H problems
    row_ids: np.ndarray  # int32 [total]: stacked query block row of each slot
    diag: np.ndarray  # bool [total]: slot is a diagonal block (query block == key block)
    bias_index: np.ndarray  # int32 [total]: slot's index into bias reshaped [B*H*capacity]
    capacity: int  # max number of blocks of one head's mask (the bias' block axis)
    num_rows: int  # B*H*n: number of stacked query block rows


def _stack(per_head: list[LayoutTables], batch: int, n: int) -> tuple[LayoutTables, np.ndarray]:
    """numpy tables of the block-diagonal layout of ``batch`` copies of the heads' layouts.

    Problem p = b * H + h sits at block offset p * n. Slots are in storage order of the
    stacked mask (by stacked column, then row), which is problem-major. Returns the tables
    and, per stacked slot, (p, slot within the problem) flattened as p * capacity + slot.
    """
    problems = per_head * batch
    capacity = max((int(t.col_ptr[-1]) for t in per_head), default=0)
    rows, cols, col_ptr, row_ptr, row_slots, bias_index = [], [], [], [], [], []
    offset = 0
    for p, t in enumerate(problems):
        nnz = int(t.col_ptr[-1])
        rows.append(t.block_rows[:nnz] + p * n)
        cols.append(t.block_cols[:nnz] + p * n)
        col_ptr.append(t.col_ptr[:-1] + offset)
        row_ptr.append(t.row_ptr[:-1] + offset)
        row_slots.append(t.row_slots[:nnz] + offset)
        bias_index.append(p * capacity + np.arange(nnz))
        offset += nnz
    total = np.array([offset])

    def cat(parts, tail=None):
        parts = parts + ([tail] if tail is not None else [])
        return np.concatenate(parts).astype(np.int32) if parts else np.zeros((0,), np.int32)

    tables = LayoutTables.with_orders(
        block_rows=cat(rows),
        block_cols=cat(cols),
        col_ptr=cat(col_ptr, total),
        row_ptr=cat(row_ptr, total),
        row_slots=cat(row_slots),
    )
    return tables, cat(bias_index)


@functools.lru_cache(maxsize=64)
def _plan(mask_bytes: bytes, mask_shape: tuple, block_size: int, batch: int, heads: int) -> _Plan:
    masks = np.frombuffer(mask_bytes, dtype=np.bool_).reshape(mask_shape)
    n = mask_shape[-1]
    per_mask = [Layout.from_mask(m, block_size).tables for m in masks]
    per_head = per_mask if len(per_mask) == heads else per_mask * heads
    tables, bias_index = _stack(per_head, batch, n)
    total = int(tables.col_ptr[-1])
    grid = (batch * heads * n,) * 2
    layout = Layout(block_size, grid, total, tables)
    capacity = max(int(t.col_ptr[-1]) for t in per_head) if per_head else 0
    return _Plan(
        layout=layout,
        row_ids=tables.block_rows,
        diag=tables.block_rows == tables.block_cols,
        bias_index=bias_index,
        capacity=capacity,
        num_rows=grid[0],
    )


def attention_layout(mask, block_size: int, *, batch: int = 1, num_heads: int | None = None) -> Layout:
    """The stacked block-diagonal :class:`Layout` that attention over ``mask`` runs on.

    For inspection and benchmarks: grid (batch*heads*n, batch*heads*n), storage order of
    each problem's mask, problems in the order (batch, head). Cached per mask.
    """
    block_size = check_block_size(block_size)
    masks = check_attention_mask(mask, num_heads=num_heads)
    heads = num_heads or masks.shape[0]
    return _plan(masks.tobytes(), masks.shape, block_size, int(batch), int(heads)).layout


def bias_blocks(bias, mask, block_size: int):
    """Gathers the present blocks of a dense attention bias into the layout's block form.

    A convenience for building ``bias=`` of :func:`blocksparse_attention` from a dense
    [..., T, T] bias (which is T x T: for short sequences and tests). Long-sequence
    code should build the [..., capacity, bs, bs] blocks directly.

    Args:
      bias: [..., T, T] (query, key), any float dtype.
      mask: bool [n, n] or [heads, n, n] (n = T / block_size). A 3-D mask needs
        ``bias.shape[-3]`` to be heads (or 1).
      block_size: the block edge.

    Returns:
      [..., capacity, bs, bs] where capacity is the largest number of blocks of one head's
      mask; head h's blocks come first in its mask's storage order (sorted by key block,
      then query block; see :class:`Layout`), the rest are zero padding.
    """
    block_size = check_block_size(block_size)
    masks = check_attention_mask(mask)
    bias = jnp.asarray(bias)
    n = masks.shape[-1]
    t = n * block_size
    if bias.ndim < 2 or bias.shape[-2:] != (t, t):
        raise ValueError(f"bias must be [..., T, T] with T={t} for a mask of shape {masks.shape}, got {bias.shape}")
    capacity = int(masks.reshape(masks.shape[0], -1).sum(1).max(initial=0))
    rows, cols, valid = [], [], []
    for m in masks:
        k_idx, c_idx = np.nonzero(m.T)  # storage order: by key block, then query block
        pad = capacity - k_idx.size
        rows.append(np.concatenate([c_idx, np.zeros(pad, int)]))
        cols.append(np.concatenate([k_idx, np.zeros(pad, int)]))
        valid.append(np.arange(capacity) < k_idx.size)
    rows, cols, valid = np.stack(rows), np.stack(cols), np.stack(valid)  # [H_m, capacity]
    blocks = bias.reshape(*bias.shape[:-2], n, block_size, n, block_size)
    blocks = jnp.moveaxis(blocks, -3, -2)  # [..., n, n, bs, bs]
    if masks.shape[0] == 1:
        out = blocks[..., rows[0], cols[0], :, :]
        return jnp.where(valid[0][:, None, None], out, jnp.zeros((), out.dtype))
    if bias.ndim < 3 or bias.shape[-3] not in (1, masks.shape[0]):
        raise ValueError(
            f"with a per-head mask of shape {masks.shape} the bias must be [..., heads={masks.shape[0]} or 1, T, T], "
            f"got {bias.shape}"
        )
    blocks = jnp.broadcast_to(blocks, blocks.shape[:-5] + (masks.shape[0],) + blocks.shape[-4:])
    heads = np.arange(masks.shape[0])[:, None]
    out = blocks[..., heads, rows, cols, :, :]
    return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))


# ---------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------


def _check_qkv(q, k, v):
    q, k, v = (as_float_array(a, name) for a, name in ((q, "q"), (k, "k"), (v, "v")))
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, heads, T, head_dim], got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape [batch, heads, T, head_dim] = {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must be [batch, heads, T, head_dim_v] with batch, heads, T of q {tuple(q.shape)}, got {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    return q, k, v


def blocksparse_attention(
    q,
    k,
    v,
    mask,
    block_size: int,
    *,
    causal: bool = False,
    scale=None,
    bias=None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    precision=None,
):
    """Multi-head attention whose scores exist only at the present blocks of ``mask``.

    ``out[b, h, i] = sum_j P[b, h, i, j] v[b, h, j]`` with ``P`` the softmax over the keys j
    of the present blocks of query row i of ``scale * q[b, h, i] . k[b, h, j] + bias``.
    Equal to dense attention with every absent block's score at -inf, except that a
    query row with no present key gets a zero output (dense attention would give NaN).

    Args:
      q, k: [batch, heads, T, head_dim]; v: [batch, heads, T, head_dim_v] (usually
        head_dim). One dtype: float32, bfloat16 or float16. T must be a multiple of
        ``block_size``.
      mask: concrete boolean block mask, [T/bs, T/bs] (shared by all heads) or
        [heads, T/bs, T/bs] (one per head): ``mask[i, j]`` says query block i sees key
        block j. Generators: :mod:`jax_blocksparse.layouts` (``local``, ``strided``,
        ``fixed``, ``bigbird``, ``causal``). The layout built from it is cached.
      block_size: block edge, one of 8, 16, 32, 64, 128.
      causal: also mask keys after the query inside the diagonal blocks. The mask must
        then have no block above the diagonal (use ``jbs.layouts.causal(mask)``).
      scale: score scale, default ``1 / sqrt(head_dim)``.
      bias: None, or an additive score bias in block form, [batch or 1, heads or 1,
        capacity, bs, bs], where capacity is the largest number of blocks of one head's
        mask and each head's blocks are in its mask's storage order (padding ignored).
        Build it from a dense [.., T, T] bias with :func:`bias_blocks`. -inf is allowed
        (a row whose scores are all -inf gets zeros). Differentiable.
      dropout_rate: probability of dropping an attention probability, in [0, 1).
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      precision: as in :func:`jax.lax.dot_general`, for both products.

    Returns:
      [batch, heads, T, head_dim_v] in q's dtype. Products accumulate in float32; the
      softmax statistics (row max, row sum) are float32 whatever the input dtype; the
      probabilities are cast to v's dtype for the product with v.

    Example::

        mask = jbs.layouts.causal(jbs.layouts.fixed(16, stride=4, summary=1))
        out = jbs.attention.blocksparse_attention(q, k, v, mask, 64, causal=True)
        # q, k, v: [batch, heads, 1024, head_dim]
    """
    q, k, v = _check_qkv(q, k, v)
    block_size = check_block_size(block_size)
    batch, heads, seq_len, head_dim = q.shape
    if seq_len % block_size:
        raise ValueError(
            f"T={seq_len} (q shape {tuple(q.shape)}) must be a multiple of block_size={block_size}"
        )
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    masks = check_attention_mask(mask, seq_len=seq_len, block_size=block_size, num_heads=heads, causal=bool(causal))
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} needs a dropout_rng (a PRNG key)")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    capacity = int(masks.reshape(masks.shape[0], -1).sum(1).max(initial=0))
    if bias is not None:
        bias = _check_bias(bias, capacity, batch, heads, block_size)
    body = functools.partial(
        _attend, masks=masks, block_size=block_size, causal=bool(causal), scale=scale,
        dropout_rate=dropout_rate, precision=precision,
    )
    axes, size = _auto_mesh_axes(q)
    if size > 1 and batch % size == 0:
        # jit over several devices: each device attends its own batch rows. The stacked
        # layout folds the batch into the primitives' feature dim, which their sharding
        # rule would gather; splitting the batch first keeps every product local.
        mesh = jax.typeof(q).sharding.mesh
        batch_spec = jax.sharding.PartitionSpec(axes)
        bias_spec = batch_spec if bias is not None and bias.shape[0] == batch > 1 else jax.sharding.PartitionSpec()
        specs = (batch_spec,) * 3 + (bias_spec, jax.sharding.PartitionSpec())

        def local(q, k, v, bias, rng):
            if rng is not None:  # a different dropout mask on every device
                rng = jax.random.fold_in(rng, jax.lax.axis_index(axes))
            return body(q, k, v, bias, rng)

        return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=batch_spec)(q, k, v, bias, dropout_rng)
    return body(q, k, v, bias, dropout_rng)


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


def _attend(q, k, v, bias, dropout_rng, *, masks, block_size, causal, scale, dropout_rate, precision):
    """The attention of checked operands on one device: see :func:`blocksparse_attention`."""
    batch, heads, seq_len, _ = q.shape
    plan = _plan(masks.tobytes(), masks.shape, block_size, batch, heads)
    layout, total = plan.layout, plan.layout.capacity
    if total == 0:  # no block anywhere: every row is empty
        return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)

    problems = batch * heads

    def features(a):  # [B, H, T, D] -> [D, B*H*T]: the stacked positions are the features
        return a.reshape(problems * seq_len, a.shape[-1]).T

    scores = bsmm_updat(features(q), features(k), layout, out_dtype=jnp.float32, precision=precision)
    scores = scores * jnp.float32(scale)  # [total, bs, bs] float32 (query, key)
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(jnp.float32), (batch, heads) + bias.shape[2:])
        scores = scores + bias.reshape(problems * plan.capacity, block_size, block_size)[plan.bias_index]
    if causal:
        upper = np.triu(np.ones((block_size, block_size), bool), k=1)
        scores = jnp.where(plan.diag[:, None, None] & upper, -jnp.inf, scores)

    row_ids = plan.row_ids
    # Row max over each query row's present blocks (stop_gradient: the softmax does not
    # depend on it); a row with no finite score uses 0, so exp gives 0s, not NaN.
    row_max = jax.ops.segment_max(scores.max(axis=-1), row_ids, num_segments=plan.num_rows)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    e = jnp.exp(scores - row_max[row_ids][:, :, None])
    row_sum = jax.ops.segment_sum(e.sum(axis=-1), row_ids, num_segments=plan.num_rows)
    inv = jnp.where(row_sum > 0, 1.0 / jnp.where(row_sum > 0, row_sum, 1.0), 0.0)
    probs = e * inv[row_ids][:, :, None]
    if dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)

    out_t = bsmm(features(v), probs.astype(v.dtype), layout, transpose=True, preferred_element_type=q.dtype,
                 precision=precision)  # [Dv, B*H*T] = (P @ v)^T
    return out_t.T.reshape(batch, heads, seq_len, v.shape[-1])


def _check_bias(bias, capacity: int, batch: int, heads: int, block_size: int):
    """Checks a [B|1, H|1, capacity, bs, bs] block-form bias and returns it as an array."""
    bias = jnp.asarray(bias)
    want = (capacity, block_size, block_size)
    if bias.ndim != 5 or bias.shape[2:] != want or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads):
        raise ValueError(
            f"bias must be [batch={batch} or 1, heads={heads} or 1, capacity={capacity}, {block_size}, "
            f"{block_size}] (the blocks of each head's mask in storage order; see bias_blocks), got {bias.shape}"
        )
    if not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"bias must be a float array, got dtype {bias.dtype} with shape {bias.shape}")
    return bias
