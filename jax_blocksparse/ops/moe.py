"""Dropless mixture-of-experts as block-sparse products: the routing topology and its two products.

A token routed to k experts is k rows of work. Sorted by expert and padded, per
expert, to a multiple of the block size, the rows form row blocks that each belong to
one expert. The hidden activation [R, E * F] (E experts of F hidden units) is then
block-sparse: row block r holds the F / bs blocks of its expert's columns and nothing
else. Its topology is runtime data that changes with every routing; its capacity is
static, so a new routing does not recompile:

* :func:`padded_rows`: R, the bound on the padded rows,
  ``bs * floor((T * k + E * (bs - 1)) / bs)``; every routing of T tokens fits, and no
  token is dropped;
* :func:`route_topology`: a routing ``experts`` [T, k] -> :class:`Topology`: where each
  (token, choice) lands among the rows, which token each row holds, and the
  :class:`~jax_blocksparse.Layout` of the hidden activation at capacity
  ``(R / bs) * (F / bs)`` blocks (traced: built inside jit);
* :func:`expert_up` (SDD): ``hidden = rows @ w_in`` at the topology's blocks only, with
  :func:`~jax_blocksparse.bsmm_updat` (rows transposed: ``updat`` contracts its
  operands' leading axis);
* :func:`expert_down` (DSD): ``rows_out = hidden @ w_out``, with
  :func:`~jax_blocksparse.bsmm` (``transpose=True``: ``w_out`` is stored [D, E * F], the
  product's dense operand as it reads it);
* :func:`dispatch` / :func:`combine`: tokens to rows, and rows back to tokens weighted
  by their gates (:func:`collect`: each choice's row);
* :func:`group_ranks`: items counted per group and ranked within it, the stable sort
  behind the rows (and behind expert parallelism's exchange buffers).

Every function is differentiable in its arrays (the products' rules), and works under
jit, vmap and export; the products follow :func:`~jax_blocksparse.bsmm`'s ``impl``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import Layout, check_block_size
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

__all__ = [
    "Topology",
    "collect",
    "combine",
    "dispatch",
    "expert_down",
    "expert_up",
    "group_ranks",
    "padded_rows",
    "route_topology",
]


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def padded_rows(tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """R: the rows of every routing of ``tokens`` tokens to ``top_k`` of ``num_experts``
    experts, each expert's rows padded to a multiple of ``block_size``.

    Expert e gets n_e rows, padded to ``ceil(n_e / bs) * bs < n_e + bs``; the n_e sum to
    ``tokens * top_k``. So the padded rows are a multiple of bs and at most
    ``tokens * top_k + num_experts * (bs - 1)``: ``R = bs * floor((T * k + E * (bs - 1)) / bs)``.

    Example::

        >>> from jax_blocksparse.ops.moe import padded_rows
        >>> padded_rows(4096, 2, 8, 64)        # 8192 routed rows, 7 padding blocks at most
        8640
    """
    tokens, top_k = _positive_int("tokens", tokens), _positive_int("top_k", top_k)
    num_experts, block_size = _positive_int("num_experts", num_experts), check_block_size(block_size)
    return block_size * ((tokens * top_k + num_experts * (block_size - 1)) // block_size)


class Topology(NamedTuple):
    """A routing's place in the padded rows, and the hidden activation's layout.

    Attributes:
      row_of: int32 [T, k]: the row of each (token, choice).
      token_of: int32 [R]: the token each row holds; T for a padding row.
      counts: int32 [E]: the tokens routed to each expert (choices counted).
      layout: the :class:`~jax_blocksparse.Layout` of the hidden activation [R, E * F]:
        row block r holds its expert's F / bs column blocks; padding row blocks none.
    """

    row_of: jax.Array
    token_of: jax.Array
    counts: jax.Array
    layout: Layout


def group_ranks(groups, num_groups: int):
    """``(counts, rank)``: int32 [G] items per group, and int32 [N] each item's place among
    its group's items in item order (a stable sort by group).

    ``groups`` is int [N]; an item of group ``num_groups`` or more belongs to none: it is
    not counted and its rank means nothing.
    """
    counts = jnp.zeros(num_groups, jnp.int32).at[groups].add(1, mode="drop")
    first = jnp.cumsum(counts) - counts  # each group's first place in sorted order
    order = jnp.argsort(groups, stable=True)
    sorted_rank = jnp.arange(groups.size, dtype=jnp.int32) - first[jnp.minimum(groups[order], num_groups - 1)]
    return counts, jnp.zeros(groups.size, jnp.int32).at[order].set(sorted_rank)


def route_topology(experts, num_experts: int, ffn: int, block_size: int, valid=None) -> Topology:
    """The :class:`Topology` of a routing, built with jnp (inside jit: no recompile per routing).

    Rows are sorted by expert, and within an expert by (token, choice): a stable order,
    so equal routings give equal rows.

    Args:
      experts: int [T, k]: the experts of each token (top-k choices, distinct per token
        or not).
      num_experts: E.
      ffn: F, the hidden units of one expert (a multiple of ``block_size``).
      block_size: the block edge, one of :data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`.
      valid: bool [T, k] or None (all valid): choices that are not valid take no row
        (their ``row_of`` is R, past the rows; :func:`combine` reads zeros there) and
        are not counted. Expert parallelism uses it for the empty places of its
        exchange buffers.
    """
    experts = jnp.asarray(experts)
    if experts.ndim != 2 or not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must be an int array [tokens, top_k], got {experts.dtype} {experts.shape}")
    tokens, top_k = experts.shape
    num_experts, ffn = _positive_int("num_experts", num_experts), _positive_int("ffn", ffn)
    block_size = check_block_size(block_size)
    if ffn % block_size:
        raise ValueError(f"ffn={ffn} must be a multiple of block_size={block_size}")
    rows = padded_rows(tokens, top_k, num_experts, block_size)
    row_blocks, ffn_blocks = rows // block_size, ffn // block_size

    flat = experts.reshape(-1).astype(jnp.int32)
    if valid is not None:  # an invalid choice sorts past every expert and is not counted
        flat = jnp.where(jnp.asarray(valid).reshape(-1), flat, num_experts)
    counts, rank = group_ranks(flat, num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    first_row = jnp.cumsum(padded) - padded  # each expert's first row
    known = flat < num_experts
    row_of = jnp.where(known, first_row[jnp.minimum(flat, num_experts - 1)] + rank, rows)
    token = jnp.arange(flat.size, dtype=jnp.int32) // top_k
    token_of = jnp.full(rows, tokens, jnp.int32).at[row_of].set(token, mode="drop")

    # Row block r belongs to the expert whose padded rows cover it; past the last, to none.
    ends = jnp.cumsum(padded) // block_size
    block_expert = jnp.searchsorted(ends, jnp.arange(row_blocks), side="right")
    column_expert = jnp.arange(num_experts * ffn_blocks) // ffn_blocks
    mask = block_expert[:, None] == column_expert[None, :]
    layout = Layout.from_mask(mask, block_size, capacity=row_blocks * ffn_blocks)
    return Topology(row_of.reshape(tokens, top_k), token_of, counts, layout)


def dispatch(x, topology: Topology):
    """Tokens to rows: [T, D] -> [R, D], a padding row zero (a gather; its gradient scatters back)."""
    padded = jnp.concatenate([x, jnp.zeros((1, x.shape[-1]), x.dtype)])
    return padded[topology.token_of]


def collect(rows, topology: Topology):
    """The row of every (token, choice): [R, D] -> [T, k, D], zeros for a choice without a row."""
    return rows.at[topology.row_of].get(mode="fill", fill_value=0)


def combine(rows, gates, topology: Topology):
    """Rows back to tokens: ``out[t] = sum_j gates[t, j] * rows[row_of[t, j]]``, [R, D] -> [T, D]."""
    picked = collect(rows, topology)
    return jnp.einsum("tkd,tk->td", picked, gates.astype(picked.dtype))


def expert_up(rows, w_in, topology: Topology, *, precision=None, impl: str | None = None):
    """SDD: the hidden activation's blocks, ``rows @ w_in`` at the topology only.

    Args:
      rows: [R, D], :func:`dispatch`'s.
      w_in: [D, E * F]: every expert's input projection, side by side.

    Returns:
      [capacity, bs, bs] in the operands' dtype: the blocks of the [R, E * F] hidden
      activation at ``topology.layout`` (padding slots zero).
    """
    return bsmm_updat(rows.T, w_in, topology.layout, precision=precision, impl=impl)


def expert_down(hidden, w_out, topology: Topology, *, precision=None, impl: str | None = None):
    """DSD: ``hidden @ w_out`` for the block-sparse hidden activation.

    Args:
      hidden: [capacity, bs, bs], the blocks of [R, E * F] at ``topology.layout``.
      w_out: [D, E * F]: every expert's output projection, transposed (expert e's
        [F, D] projection is ``w_out[:, e * F:(e + 1) * F].T``), as the product reads it.

    Returns:
      [R, D].
    """
    return bsmm(w_out, hidden, topology.layout, transpose=True, precision=precision, impl=impl).T
