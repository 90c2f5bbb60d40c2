"""Attention block masks: which [bs, bs] tiles of the score matrix exist, and which are full.

An attention score matrix [T_q, T_kv] (per batch row and head) is cut into square tiles
of ``block_size``. A :class:`BlockMask` holds, per (batch row, head), the bool tile grid
[T_q / bs, T_kv / bs]: a tile that is absent is never computed; a present tile is
computed, and a token-level ``mask_fn`` (if the mask has one) is applied inside it unless
the tile is *full*, i.e. known to be allowed at every element. Building one:

* from a boolean tile grid (:mod:`jax_blocksparse.layouts` makes the classic patterns):
  ``BlockMask(blocks, block_size)``;
* from a token-level predicate, :func:`create_block_mask`: a tile is present where the
  predicate holds anywhere in it and full where it holds everywhere;
* from segment ids (packed documents), :func:`block_mask_from_segments`, inside ``jit``
  from data, at a fixed ``capacity`` so that new data does not recompile.

Token-level functions (``mask_fn(b, h, q_idx, kv_idx) -> bool`` and the attention's
``score_fn(score, b, h, q_idx, kv_idx) -> score``) are written for one element, with
int32 scalar indices (the batch row, the query head, the query and key positions), and
are traced elementwise with ``jax.vmap``: write them with ``jnp`` operations; they may
close over arrays (a per-document table, ALiBi slopes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import check_block_size

__all__ = ["BlockMask", "block_mask_from_segments", "create_block_mask"]


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _grid4(array, name: str):
    """bool [n_q, n_kv] | [heads, n_q, n_kv] | [batch, heads, n_q, n_kv] -> 4-D (numpy if concrete)."""
    if not hasattr(array, "shape"):
        array = np.asarray(array)
    if np.dtype(array.dtype) != np.bool_:
        raise TypeError(
            f"{name} must be a boolean block grid, got dtype {np.dtype(array.dtype)} with shape {tuple(array.shape)}"
        )
    if array.ndim not in (2, 3, 4):
        raise ValueError(
            f"{name} must be [T_q/bs, T_kv/bs], [heads, T_q/bs, T_kv/bs] or "
            f"[batch, heads, T_q/bs, T_kv/bs], got shape {tuple(array.shape)}"
        )
    shape = (1,) * (4 - array.ndim) + tuple(array.shape)
    if _is_concrete(array):
        return np.asarray(array).reshape(shape)
    return array.reshape(shape)


def _check_capacity(capacity):
    if capacity is None:
        return None
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or int(capacity) < 0:
        raise TypeError(f"capacity must be a non-negative int, got {capacity!r}")
    return int(capacity)


def check_token_fn(fn, name: str, *, takes_score: bool):
    """Checks that ``fn`` is callable and gives one bool (mask) or float (score) per element."""
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__} {fn!r}")
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = ((jax.ShapeDtypeStruct((), jnp.float32),) if takes_score else ()) + (index,) * 4
    try:
        out = jax.eval_shape(fn, *args)
    except Exception as e:
        signature = "(score, b, h, q_idx, kv_idx)" if takes_score else "(b, h, q_idx, kv_idx)"
        raise TypeError(
            f"{name} must take {signature} as int32 scalars{' and a float32 score' if takes_score else ''}"
            f" (it is traced elementwise); calling it failed with {type(e).__name__}: {e}"
        ) from e
    if not hasattr(out, "shape") or out.shape != ():
        raise TypeError(f"{name} must return one value per element (a scalar), got {out}")
    if takes_score and not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"{name} must return a float score, got dtype {out.dtype}")
    if not takes_score and out.dtype != jnp.bool_:
        raise TypeError(f"{name} must return a bool per element, got dtype {out.dtype}")
    return fn


def elementwise(fn, *args):
    """``fn`` applied to every element of the broadcast ``args`` (nested ``jax.vmap``)."""
    args = jnp.broadcast_arrays(*args)
    mapped = fn
    for _ in range(args[0].ndim):
        mapped = jax.vmap(mapped)
    return mapped(*args)


@jax.tree_util.register_pytree_node_class
class BlockMask:
    """The tiles of an attention score matrix that exist, per (batch row, head).

    Args:
      blocks: bool [n_q, n_kv] (every batch row and head), [heads, n_q, n_kv] (one grid
        per head) or [batch, heads, n_q, n_kv] (a leading 1 broadcasts), where n_q =
        T_q / block_size and n_kv = T_kv / block_size: ``blocks[..., i, j]`` lets query
        block i see key block j. numpy or jax; traced (inside ``jit``) when ``capacity``
        is given.
      block_size: the tile edge, one of :data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`.
      full: None, or bool of ``blocks``' shape: tiles where ``mask_fn`` holds at every
        element (it is then not evaluated there). Without it every present tile is
        partial. Ignored without ``mask_fn``.
      mask_fn: None, or ``mask_fn(b, h, q_idx, kv_idx) -> bool`` (int32 scalars; traced
        elementwise), the token-level mask inside the partial tiles.
      capacity: the tiles of one (batch row, head) problem, on average: the attention's
        stacked layout holds batch x heads x capacity tiles, so a traced grid of up to
        that many compiles once. Default (concrete grids only): the largest count of
        one problem. A traced grid with more tiles than batch x heads x capacity cannot
        raise inside ``jit``: the attention then returns NaN (``num_blocks`` counts them).

    Concrete masks are hashable by content (a layer may hold one as a static field);
    a ``BlockMask`` is also a pytree (its arrays are the leaves).

    Example::

        >>> import jax_blocksparse as jbs
        >>> mask = jbs.attention.BlockMask(jbs.layouts.causal(jbs.layouts.local(8, 2)), block_size=16)
        >>> mask
        BlockMask(block_size=16, grid=(1, 1, 8, 8), capacity=15, concrete)
        >>> mask.q_len, mask.kv_len, mask.density
        (128, 128, 0.234375)
    """

    __slots__ = ("blocks", "full", "block_size", "mask_fn", "capacity")

    def __init__(self, blocks, block_size: int, *, full=None, mask_fn=None, capacity=None):
        block_size = check_block_size(block_size)
        blocks = _grid4(blocks, "blocks")
        if full is not None:
            full = _grid4(full, "full")
            if tuple(full.shape) != tuple(blocks.shape):
                raise ValueError(f"full must have the shape of blocks {tuple(blocks.shape)}, got {tuple(full.shape)}")
            full = full & blocks
        if mask_fn is not None:
            check_token_fn(mask_fn, "mask_fn", takes_score=False)
        capacity = _check_capacity(capacity)
        concrete = _is_concrete(blocks) and (full is None or _is_concrete(full))
        if concrete:
            blocks = np.array(blocks, bool)
            blocks.flags.writeable = False
            if full is not None:
                full = np.array(full, bool)
                full.flags.writeable = False
            most = int(blocks.reshape(-1, blocks.shape[-2] * blocks.shape[-1]).sum(1).max(initial=0))
            if capacity is None:
                capacity = most
            elif capacity < most:
                raise ValueError(
                    f"capacity={capacity} is smaller than the {most} blocks of one (batch, head) grid "
                    f"of blocks {blocks.shape}"
                )
        elif capacity is None:
            raise ValueError(
                f"a traced block grid (shape {tuple(blocks.shape)}) needs capacity=<blocks per (batch, head)>: "
                "the attention's layout is built inside jit with that many slots"
            )
        self.blocks, self.full, self.block_size, self.mask_fn, self.capacity = (
            blocks,
            full,
            block_size,
            mask_fn,
            capacity,
        )

    # -- pytree -------------------------------------------------------------------

    def tree_flatten(self):
        return (self.blocks, self.full), (self.block_size, self.mask_fn, self.capacity)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        obj = object.__new__(cls)  # no checks: leaves may be tracers or placeholders
        obj.blocks, obj.full = leaves
        obj.block_size, obj.mask_fn, obj.capacity = aux
        return obj

    # -- properties ---------------------------------------------------------------

    @property
    def is_concrete(self) -> bool:
        """True when the grids are numpy (host) arrays: the layout is then built once, on the host."""
        return isinstance(self.blocks, np.ndarray) and (self.full is None or isinstance(self.full, np.ndarray))

    @property
    def grid(self) -> tuple[int, int, int, int]:
        """(batch or 1, heads or 1, n_q, n_kv)."""
        return tuple(int(d) for d in self.blocks.shape)

    @property
    def q_len(self) -> int:
        """T_q = n_q * block_size."""
        return self.grid[2] * self.block_size

    @property
    def kv_len(self) -> int:
        """T_kv = n_kv * block_size."""
        return self.grid[3] * self.block_size

    @property
    def num_blocks(self):
        """int [batch or 1, heads or 1]: present tiles per problem (numpy, or traced)."""
        xp = np if self.is_concrete else jnp
        return xp.sum(self.blocks, axis=(-2, -1))

    @property
    def density(self):
        """Fraction of the tiles present (over all batch rows and heads of the grid)."""
        total = math.prod(self.grid)
        if total == 0:
            return 0.0
        return float(self.blocks.sum()) / total if self.is_concrete else jnp.sum(self.blocks) / total

    # -- hashing (concrete masks) -----------------------------------------------

    def _key(self):
        full = None if self.full is None else self.full.tobytes()
        return (self.block_size, self.mask_fn, self.capacity, self.blocks.shape, self.blocks.tobytes(), full)

    def __hash__(self):
        if not self.is_concrete:
            return id(self)
        return hash(self._key())

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        if not (self.is_concrete and other.is_concrete):
            return self is other
        return self._key() == other._key()

    def __repr__(self):
        state = "concrete" if self.is_concrete else "traced"
        fn = "" if self.mask_fn is None else f", mask_fn={getattr(self.mask_fn, '__name__', self.mask_fn)}"
        return f"BlockMask(block_size={self.block_size}, grid={self.grid}, capacity={self.capacity}{fn}, {state})"


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _length(value, name, block_size):
    value = _positive(value, name)
    if value % block_size:
        raise ValueError(f"{name}={value} must be a multiple of block_size={block_size}")
    return value


def create_block_mask(
    mask_fn, batch, heads, q_len: int, kv_len: int, block_size: int, *, capacity: int | None = None
) -> BlockMask:
    """The :class:`BlockMask` of a token-level mask: tiles where ``mask_fn`` holds anywhere.

    ``mask_fn(b, h, q_idx, kv_idx) -> bool`` is evaluated at every element of the
    [q_len, kv_len] grid (one block row at a time, so memory stays O(bs x kv_len) per
    batch row and head). A tile is present where it holds at one element at least, and
    *full* where it holds at all: the attention then skips ``mask_fn`` in full tiles and
    evaluates it in the partial ones only. The mask keeps ``mask_fn``.

    Args:
      mask_fn: ``mask_fn(b, h, q_idx, kv_idx) -> bool`` on int32 scalars.
      batch, heads: the sizes ``mask_fn`` depends on; None when it does not (it is then
        called with 0, and the mask serves every batch row / head).
      q_len, kv_len: T_q and T_kv, multiples of ``block_size``.
      block_size: the tile edge.
      capacity: tiles per (batch, head); needed when the result is traced, i.e. when
        ``mask_fn`` closes over traced values (inside ``jit``).

    Returns:
      a :class:`BlockMask` of grid [batch or 1, heads or 1, q_len / bs, kv_len / bs].

    Example (causal attention with a sliding window of 32 keys)::

        >>> import jax_blocksparse as jbs
        >>> def window(b, h, q_idx, kv_idx):
        ...     return (q_idx >= kv_idx) & (q_idx - kv_idx < 32)
        >>> mask = jbs.attention.create_block_mask(window, None, None, 128, 128, block_size=16)
        >>> mask.blocks[0, 0, 5].astype(int)          # query block 5 sees key blocks 3, 4, 5
        array([0, 0, 0, 1, 1, 1, 0, 0])
        >>> mask.full[0, 0, 5].astype(int)            # block 4 is entirely inside the window
        array([0, 0, 0, 0, 1, 0, 0, 0])
    """
    block_size = check_block_size(block_size)
    check_token_fn(mask_fn, "mask_fn", takes_score=False)
    nb = 1 if batch is None else _positive(batch, "batch")
    nh = 1 if heads is None else _positive(heads, "heads")
    q_len = _length(q_len, "q_len", block_size)
    kv_len = _length(kv_len, "kv_len", block_size)
    n_q, n_kv = q_len // block_size, kv_len // block_size
    b = np.arange(nb, dtype=np.int32)[:, None, None, None]
    h = np.arange(nh, dtype=np.int32)[None, :, None, None]
    kv = np.arange(kv_len, dtype=np.int32)[None, None, None, :]

    def block_row(i):  # -> (any, all) over each tile of query block row i: [nb, nh, n_kv]
        q = (i * block_size + jnp.arange(block_size, dtype=jnp.int32))[None, None, :, None]
        allowed = elementwise(mask_fn, b, h, q, kv).reshape(nb, nh, block_size, n_kv, block_size)
        return allowed.any(axis=(2, 4)), allowed.all(axis=(2, 4))

    with jax.ensure_compile_time_eval():  # concrete (numpy) unless mask_fn closes over tracers
        blocks, full = jax.lax.map(block_row, jnp.arange(n_q, dtype=jnp.int32))
        blocks, full = jnp.moveaxis(blocks, 0, 2), jnp.moveaxis(full, 0, 2)
    if _is_concrete(blocks) and _is_concrete(full):
        blocks, full = np.asarray(blocks), np.asarray(full)
    elif capacity is None:
        raise ValueError(
            "create_block_mask: mask_fn depends on traced values (inside jit), so the block mask is "
            "traced and needs capacity=<blocks per (batch, head)>"
        )
    return BlockMask(blocks, block_size, full=full, mask_fn=mask_fn, capacity=capacity)


def block_mask_from_segments(
    query_segment_ids,
    key_value_segment_ids=None,
    *,
    block_size: int,
    capacity: int | None = None,
    is_causal: bool = False,
    pattern=None,
) -> BlockMask:
    """The tiles where a query and a key of the same segment (packed document) can meet.

    A tile (i, j) of batch row b is present when the segment ids of query block i and
    those of key block j overlap as ranges ([min, max] of each block), which for packed
    documents (ids non-decreasing along T) is exactly "some query and key share a
    document"; for other orders it is a superset (still correct: the attention's
    ``query_segment_ids`` mask decides per element). Runs inside ``jit`` on traced ids in
    O(T + n_q x n_kv), with a fixed ``capacity``: new documents do not recompile.

    Pass the same ids to the attention as ``query_segment_ids`` and
    ``key_value_segment_ids``: this mask only chooses the tiles.

    Args:
      query_segment_ids: int [batch, T_q]; key_value_segment_ids: int [batch, T_kv]
        (default: the query's).
      block_size: the tile edge; T_q and T_kv must be multiples of it.
      capacity: tiles per batch row (the grid has one head); required for traced ids,
        default for concrete ones: the largest count of a row.
      is_causal: also drop the tiles above the diagonal (key block > query block).
      pattern: None, or a further bool [n_q, n_kv] grid the tiles must lie in (e.g. a
        :func:`jax_blocksparse.layouts.local` window).

    Returns:
      a :class:`BlockMask` of grid [batch, 1, n_q, n_kv] (traced under ``jit``).

    Example (two documents of 48 and 16 tokens packed into T = 64)::

        >>> import numpy as np, jax_blocksparse as jbs
        >>> seg = np.array([[1] * 48 + [2] * 16])
        >>> jbs.attention.block_mask_from_segments(seg, block_size=16).blocks[0, 0].astype(int)
        array([[1, 1, 1, 0],
               [1, 1, 1, 0],
               [1, 1, 1, 0],
               [0, 0, 0, 1]])
    """
    block_size = check_block_size(block_size)
    q_ids = _segment_ids(query_segment_ids, "query_segment_ids", block_size)
    kv_ids = (
        q_ids
        if key_value_segment_ids is None
        else _segment_ids(key_value_segment_ids, "key_value_segment_ids", block_size)
    )
    if kv_ids.shape[0] != q_ids.shape[0]:
        raise ValueError(
            f"key_value_segment_ids must have the batch of query_segment_ids {tuple(q_ids.shape)}, "
            f"got {tuple(kv_ids.shape)}"
        )
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    xp = np if _is_concrete(q_ids) and _is_concrete(kv_ids) else jnp
    batch = q_ids.shape[0]
    q_blocks = q_ids.reshape(batch, -1, block_size)
    kv_blocks = kv_ids.reshape(batch, -1, block_size)
    q_lo, q_hi = q_blocks.min(-1)[:, :, None], q_blocks.max(-1)[:, :, None]
    kv_lo, kv_hi = kv_blocks.min(-1)[:, None, :], kv_blocks.max(-1)[:, None, :]
    blocks = (q_lo <= kv_hi) & (kv_lo <= q_hi)  # [batch, n_q, n_kv]
    n_q, n_kv = blocks.shape[1:]
    if is_causal:
        blocks = blocks & xp.asarray(np.tril(np.ones((n_q, n_kv), bool)))
    if pattern is not None:
        pattern = _grid4(pattern, "pattern")
        if pattern.shape[:2] != (1, 1) or pattern.shape[2:] != (n_q, n_kv):
            raise ValueError(f"pattern must be bool [n_q, n_kv] = [{n_q}, {n_kv}], got {tuple(pattern.shape)[2:]}")
        blocks = blocks & xp.asarray(pattern[0, 0])
    return BlockMask(blocks[:, None], block_size, capacity=capacity)


def _segment_ids(ids, name, block_size):
    if not hasattr(ids, "dtype"):
        ids = np.asarray(ids)
    if ids.ndim != 2:
        raise ValueError(f"{name} must be int [batch, T], got shape {tuple(ids.shape)}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got dtype {ids.dtype}")
    if ids.shape[1] % block_size:
        raise ValueError(f"{name}: T={ids.shape[1]} must be a multiple of block_size={block_size}")
    return ids
