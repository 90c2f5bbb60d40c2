"""Block scores and top-k selection on the block grid, with traced counts (jit-safe).

Everything works on [CB, KB] grids so that old and new layouts compare block by
block whatever their storage order:

* :func:`block_magnitude`: the norm of every stored block, placed on the grid.
* :func:`grid_scores`: the norm of every block of a dense [CB * KB, bs, bs] array
  (a dense gradient from :func:`~jax_blocksparse.training.dense_grads`).
* :func:`smallest` / :func:`largest`: the ``k`` candidate blocks of lowest / highest
  score, ``k`` a traced int; ties are broken by a second key (random numbers drawn
  from the method's seed), so the choice is deterministic given the seed.
* :func:`redistribute`: integer water-filling of a budget across layers in
  proportion to weights, capped per layer (sparse momentum).

:mod:`jax_blocksparse.training` re-exports :func:`block_magnitude`,
:func:`grid_scores` and :func:`redistribute`; its methods use all of them, and the
sparsify core (:mod:`~jax_blocksparse.layers.sparsify`) shares its ``NORMS``.
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_blocksparse.layout import Layout

NORMS = ("l2", "l1")


def _norm(blocks, norm: str):
    blocks = blocks.astype(jnp.float32)
    if norm == "l2":
        return jnp.sqrt(jnp.sum(blocks * blocks, axis=(-2, -1)))
    if norm == "l1":
        return jnp.sum(jnp.abs(blocks), axis=(-2, -1))
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def block_magnitude(w, layout: Layout, norm: str = "l2"):
    """float32 [CB, KB]: the norm of each stored block of ``w`` on the grid, 0 where absent."""
    t, (cb, kb) = layout.tables, layout.grid
    rows = jnp.where(layout.valid, t.block_rows, cb)  # padding -> dropped
    return jnp.zeros((cb, kb), jnp.float32).at[rows, t.block_cols].set(_norm(w, norm), mode="drop")


def grid_scores(dense_blocks, grid, norm: str = "l2"):
    """float32 [CB, KB]: the norm of each block of a dense-layout array [CB * KB, bs, bs]."""
    cb, kb = grid
    return _norm(dense_blocks, norm).reshape(kb, cb).T


def _rank(keys, tiebreak):
    """Rank of every entry when sorted ascending by (keys, tiebreak)."""
    order = jnp.lexsort((tiebreak.reshape(-1), keys.reshape(-1)))
    return jnp.zeros(order.shape, jnp.int32).at[order].set(jnp.arange(order.size, dtype=jnp.int32)).reshape(keys.shape)


def smallest(scores, candidates, k, tiebreak):
    """bool grid: the ``k`` candidates with the smallest scores (fewer if there are fewer).

    Equal scores are ordered by ``tiebreak`` (same shape, e.g. uniform random numbers).
    """
    keys = jnp.where(candidates, jnp.nan_to_num(scores, nan=-jnp.inf), jnp.inf)
    return candidates & (_rank(keys, tiebreak) < k)


def largest(scores, candidates, k, tiebreak):
    """bool grid: the ``k`` candidates with the largest scores (fewer if there are fewer)."""
    keys = jnp.where(candidates, -jnp.nan_to_num(scores, nan=-jnp.inf), jnp.inf)
    return candidates & (_rank(keys, tiebreak) < k)


def redistribute(total, weights, caps):
    """Splits the integer ``total`` across layers in proportion to ``weights``, capped.

    Args:
      total: int scalar (may be traced), the budget.
      weights: float [L] >= 0; all zero (or non-finite) means equal shares.
      caps: int [L] >= 0, the most each layer may take.

    Returns:
      int32 [L] with ``alloc <= caps`` and ``sum(alloc) == min(total, sum(caps))``.
      Water-filling: the budget a capped layer cannot take is split among the
      others in proportion to their weights, repeatedly; fractional shares are
      rounded by largest remainder (ties to the lower index).
    """
    caps = jnp.maximum(jnp.asarray(caps, jnp.int32), 0)
    weights = jnp.asarray(weights, jnp.float32)
    weights = jnp.where(jnp.isfinite(weights) & (weights > 0), weights, 0.0)
    n = caps.shape[0]
    alloc = jnp.zeros((n,), jnp.int32)
    remaining = jnp.minimum(jnp.asarray(total, jnp.int32), jnp.sum(caps))
    index = jnp.arange(n)
    for _ in range(n + 1):
        active = alloc < caps
        w = jnp.where(active, weights, 0.0)
        w = jnp.where(jnp.sum(w) > 0, w, active.astype(jnp.float32))
        share = remaining.astype(jnp.float32) * w / jnp.maximum(jnp.sum(w), 1e-30)
        base = jnp.floor(share).astype(jnp.int32)
        extra = remaining - jnp.sum(base)
        frac = jnp.where(active, share - base, -1.0)
        rank = _rank(-frac, index.astype(jnp.float32))
        add = base + (active & (rank < extra)).astype(jnp.int32)
        add = jnp.minimum(add, caps - alloc)
        alloc = alloc + add
        remaining = remaining - jnp.sum(add)
    return alloc
