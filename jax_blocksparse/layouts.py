"""Block-mask generators: random, small-world graphs, banded, top-k of a dense weight.

Every generator returns a numpy bool array (a block mask) that
:meth:`jax_blocksparse.Layout.from_mask` turns into a layout. Graph layouts are
square [n, n] adjacency matrices of an undirected graph with self-loops, as OpenAI
used for recurrent weights: unit block i feeds unit block j when they are linked.
"""

from __future__ import annotations

import numpy as np

from jax_blocksparse.layout import check_block_size


def _check_grid(grid, name="grid"):
    try:
        cb, kb = (int(g) for g in grid)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a pair of ints (CB, KB), got {grid!r}") from None
    if cb < 0 or kb < 0:
        raise ValueError(f"{name} must be non-negative, got {grid!r}")
    return cb, kb


def _check_fraction(value, name):
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")
    return value


def random(grid, density: float, seed: int = 0) -> np.ndarray:
    """Uniformly random mask with exactly ``round(density * CB * KB)`` blocks.

    Args:
      grid: (CB, KB), the block grid.
      density: fraction of blocks present, in [0, 1].
      seed: numpy random seed.
    Returns:
      bool [CB, KB].
    """
    cb, kb = _check_grid(grid)
    density = _check_fraction(density, "density")
    total = cb * kb
    count = int(round(density * total))
    flat = np.zeros(total, bool)
    flat[np.random.default_rng(seed).choice(total, size=count, replace=False)] = True
    return flat.reshape(cb, kb)


def _preferential_attachment(n: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """bool [n, n] adjacency, no self-loops, of a Barabasi-Albert graph: node m links to the
    m nodes before it, and each later node t to m distinct nodes of 0..t-1, each drawn with
    probability proportional to its degree. m * (n - m) edges; connected."""
    mask = np.zeros((n, n), bool)
    degree = np.zeros(n, np.float64)
    for t in range(m, n):
        if t == m:  # no node has a degree yet: the first one links to all m
            targets = np.arange(m)
        else:
            targets = rng.choice(t, size=m, replace=False, p=degree[:t] / degree[:t].sum())
        mask[t, targets] = mask[targets, t] = True
        degree[targets] += 1
        degree[t] = m
    return mask


def _rewired_ring(n: int, k: int, p: float, rng: np.random.Generator) -> np.ndarray:
    """bool [n, n] adjacency, no self-loops, of a Watts-Strogatz graph: a ring where each node
    links to its k // 2 nearest on each side; then each edge (u, u + j), j = 1..k // 2 in
    turn, moves with probability p to (u, w), w drawn uniformly from the nodes u lacks
    (kept where u lacks none). n * (k // 2) edges whatever p."""
    mask = np.zeros((n, n), bool)
    nodes = np.arange(n)
    for j in range(1, k // 2 + 1):
        mask[nodes, (nodes + j) % n] = mask[(nodes + j) % n, nodes] = True
    for j in range(1, k // 2 + 1):
        for u in range(n):
            if rng.random() >= p:
                continue
            free = np.flatnonzero(~mask[u])
            free = free[free != u]
            if free.size == 0:
                continue
            v, w = (u + j) % n, rng.choice(free)
            # u keeps its degree (so every node keeps its own k // 2 links); v gives one up.
            mask[u, v] = mask[v, u] = False
            mask[u, w] = mask[w, u] = True
    return mask


def _with_self_loops(mask: np.ndarray) -> np.ndarray:
    np.fill_diagonal(mask, True)
    return mask


def _add_random_edges(mask: np.ndarray, extra_edges: int, seed: int) -> np.ndarray:
    """Adds ``extra_edges`` random undirected edges that are not already present."""
    if extra_edges <= 0:
        return mask
    n = mask.shape[0]
    iu, ju = np.triu_indices(n, k=1)
    free = np.flatnonzero(~mask[iu, ju])
    if extra_edges > free.size:
        raise ValueError(f"extra_edges={extra_edges} exceeds the {free.size} absent edges of an {n}-node graph")
    pick = np.random.default_rng(seed + 1).choice(free, size=extra_edges, replace=False)
    mask = mask.copy()
    mask[iu[pick], ju[pick]] = mask[ju[pick], iu[pick]] = True
    return mask


def barabasi_albert(n: int, m: int, seed: int = 0, extra_edges: int = 0) -> np.ndarray:
    """Barabasi-Albert scale-free graph mask (preferential attachment).

    Args:
      n: number of block rows = block columns.
      m: edges attached from each new node, 1 <= m < n.
      seed: random seed.
      extra_edges: additional uniformly random undirected edges.
    Returns:
      bool [n, n], symmetric, self-loops included.
    """
    n, m = int(n), int(m)
    if not 1 <= m < n:
        raise ValueError(f"barabasi_albert needs 1 <= m < n, got n={n}, m={m}")
    mask = _with_self_loops(_preferential_attachment(n, m, np.random.default_rng(seed)))
    return _add_random_edges(mask, int(extra_edges), seed)


def watts_strogatz(n: int, k: int, p: float, seed: int = 0, extra_edges: int = 0) -> np.ndarray:
    """Watts-Strogatz small-world mask: a 1-D ring lattice with rewired edges.

    Args:
      n: number of block rows = block columns.
      k: each node links to its k nearest ring neighbours (k // 2 each side), k < n.
      p: probability of rewiring each edge, in [0, 1].
      seed: random seed.
      extra_edges: additional uniformly random undirected edges.
    Returns:
      bool [n, n], symmetric, self-loops included.
    """
    n, k = int(n), int(k)
    if not 0 <= k < n:
        raise ValueError(f"watts_strogatz needs 0 <= k < n, got n={n}, k={k}")
    p = _check_fraction(p, "p")
    mask = _with_self_loops(_rewired_ring(n, k, p, np.random.default_rng(seed)))
    return _add_random_edges(mask, int(extra_edges), seed)


def banded(grid, bandwidth: int) -> np.ndarray:
    """Band mask of half-width ``bandwidth`` blocks around the (scaled) diagonal.

    Block column k spans rows [k * CB / KB, (k + 1) * CB / KB) of the diagonal;
    block (c, k) is present when that span meets rows [c - bandwidth, c + bandwidth].
    For a square grid this is the usual band ``|c - k| <= bandwidth``; for a
    rectangular grid every block row and every block column gets at least one block.

    Returns:
      bool [CB, KB].
    """
    cb, kb = _check_grid(grid)
    bandwidth = int(bandwidth)
    if bandwidth < 0:
        raise ValueError(f"bandwidth must be >= 0, got {bandwidth}")
    c = np.arange(cb)[:, None]
    k = np.arange(kb)[None, :]
    # Integer form of: k * CB/KB < c + 1 + bandwidth and (k + 1) * CB/KB > c - bandwidth
    # (exact, unlike rounding k * CB/KB, which left the last column empty on wide grids).
    return (k * cb < (c + 1 + bandwidth) * kb) & ((k + 1) * cb > (c - bandwidth) * kb)


def block_norms(W, block_size: int) -> np.ndarray:
    """Frobenius norm of each block of a dense [C, K] matrix: float [CB, KB]."""
    W = np.asarray(W, dtype=np.float32)
    if W.ndim != 2:
        raise ValueError(f"W must be 2-D [C, K], got shape {W.shape}")
    c, k = W.shape
    if c % block_size or k % block_size:
        raise ValueError(f"W shape {W.shape} is not divisible by block_size={block_size}")
    blocks = W.reshape(c // block_size, block_size, k // block_size, block_size)
    return np.sqrt(np.square(blocks).sum(axis=(1, 3)))


def from_dense_topk(W, block_size: int, density: float) -> np.ndarray:
    """Keeps the ``round(density * CB * KB)`` blocks of W with the largest norms.

    Ties break toward the lower (row-major) block index, so the result is
    deterministic.

    Args:
      W: dense [C, K], C and K divisible by ``block_size``.
      block_size: block edge.
      density: fraction of blocks to keep, in [0, 1].
    Returns:
      bool [C // block_size, K // block_size].
    """
    block_size = check_block_size(block_size)
    density = _check_fraction(density, "density")
    norms = block_norms(W, block_size)
    count = int(round(density * norms.size))
    order = np.argsort(-norms.reshape(-1), kind="stable")[:count]
    mask = np.zeros(norms.size, bool)
    mask[order] = True
    return mask.reshape(norms.shape)


def mixing_steps(mask, max_steps: int | None = None):
    """How many sparse transitions until every block can reach every other block.

    The smallest ``s >= 1`` such that ``(mask | I) ** s`` (boolean matrix power, the
    mask read as the adjacency matrix of a directed graph with self-loops added) has
    no zeros: after ``s`` products with a weight of this layout, every output unit
    block depends on every input unit block. A block-sparse LSTM whose gate product
    and internal steps all use ``mask`` mixes all units within one timestep when
    ``internal_steps >= mixing_steps(mask) - 1``.

    Args:
      mask: square bool [n, n] block mask (e.g. :func:`barabasi_albert`).
      max_steps: give up after this many steps (default n, enough for any graph).
    Returns:
      the number of steps (int), or None if some block never reaches another
      (a disconnected graph) within ``max_steps``.

    Example::

        >>> ring = np.eye(8, dtype=bool) | np.roll(np.eye(8, dtype=bool), 1, axis=1)
        >>> mixing_steps(ring)          # a directed ring of 8 needs 7 hops
        7
    """
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(f"mixing_steps needs a square [n, n] mask, got shape {mask.shape}")
    n = mask.shape[0]
    if n == 0:
        return 0
    adjacency = (mask != 0) | np.eye(n, dtype=bool)
    step = adjacency.astype(np.int64)
    limit = n if max_steps is None else int(max_steps)
    reach = adjacency.copy()
    for s in range(1, limit + 1):
        if reach.all():
            return s
        grown = (reach.astype(np.int64) @ step) > 0
        if (grown == reach).all():
            return None  # reachability stopped growing: never full
        reach = grown
    return None


# ---------------------------------------------------------------------------------
# Attention patterns: square [n, n] masks, query block rows x key block columns
# ---------------------------------------------------------------------------------
# Non-causal (symmetric where the pattern is); jbs.layouts.causal keeps the lower
# triangle for autoregressive models. Pictures: docs/_static/layouts/, made by
# bench/plot_attention_layouts.py with :func:`plot`.


def _check_count(value, name, low=0):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _distance(n: int) -> np.ndarray:
    i = np.arange(n)
    return i[:, None] - i[None, :]  # query block - key block


def local(n: int, window: int) -> np.ndarray:
    """Local (sliding window) attention: query block i sees key blocks j with ``|i - j| < window``.

    ``causal(local(n, w))`` is the Sparse Transformer's local pattern: each block sees
    itself and the ``w - 1`` blocks before it.

    .. image:: /_static/layouts/local.png

    Args:
      n: blocks per side (T / block_size).
      window: >= 1; 1 is the diagonal only.
    Returns:
      bool [n, n], symmetric.
    """
    n = _check_count(n, "n")
    window = _check_count(window, "window", 1)
    return np.abs(_distance(n)) < window


def strided(n: int, stride: int) -> np.ndarray:
    """The Sparse Transformer's strided pattern (both of its heads in one mask).

    Query block i sees key block j when they are within ``stride`` blocks (``|i - j| <
    stride``: the local head) or a multiple of ``stride`` apart ((i - j) % stride == 0:
    the strided head). With ``stride ~ sqrt(n)`` every block reaches every other in two
    steps. Use :func:`causal` for autoregressive attention.

    .. image:: /_static/layouts/strided.png

    Args:
      n: blocks per side; stride: >= 1.
    Returns:
      bool [n, n], symmetric.
    """
    n = _check_count(n, "n")
    stride = _check_count(stride, "stride", 1)
    d = _distance(n)
    return (np.abs(d) < stride) | (d % stride == 0)


def fixed(n: int, stride: int, summary: int) -> np.ndarray:
    """The Sparse Transformer's fixed pattern (both of its heads in one mask).

    Blocks are grouped in chunks of ``stride``. Query block i sees every key block of its
    own chunk (i // stride == j // stride), and the last ``summary`` blocks of every chunk
    (j % stride >= stride - summary), which carry information between chunks.

    .. image:: /_static/layouts/fixed.png

    Args:
      n: blocks per side; stride: chunk length in blocks, >= 1;
      summary: summary blocks per chunk, 0 <= summary <= stride.
    Returns:
      bool [n, n].
    """
    n = _check_count(n, "n")
    stride = _check_count(stride, "stride", 1)
    summary = _check_count(summary, "summary")
    if summary > stride:
        raise ValueError(f"fixed needs summary <= stride, got summary={summary}, stride={stride}")
    i = np.arange(n)
    same_chunk = (i[:, None] // stride) == (i[None, :] // stride)
    summary_cols = (i % stride) >= stride - summary
    return same_chunk | summary_cols[None, :]


def bigbird(n: int, window: int, num_global: int, num_random: int, seed: int = 0) -> np.ndarray:
    """BigBird's pattern: a sliding window, global blocks and random blocks.

    * window: query block i sees key blocks j with ``|i - j| < window`` (as :func:`local`);
    * global: the first ``num_global`` blocks see, and are seen by, every block;
    * random: each other query block row gets ``num_random`` more key blocks, drawn
      uniformly from those it does not see yet (fewer when fewer are left).

    .. image:: /_static/layouts/bigbird.png

    Args:
      n: blocks per side; window >= 1; num_global in [0, n]; num_random >= 0;
      seed: numpy random seed for the random blocks.
    Returns:
      bool [n, n].
    """
    n = _check_count(n, "n")
    window = _check_count(window, "window", 1)
    num_global = _check_count(num_global, "num_global")
    num_random = _check_count(num_random, "num_random")
    if num_global > n:
        raise ValueError(f"bigbird needs num_global <= n, got num_global={num_global}, n={n}")
    mask = local(n, window)
    mask[:num_global, :] = True
    mask[:, :num_global] = True
    rng = np.random.default_rng(seed)
    for i in range(num_global, n):
        free = np.flatnonzero(~mask[i])
        if free.size and num_random:
            mask[i, rng.choice(free, size=min(num_random, free.size), replace=False)] = True
    return mask


def causal(mask) -> np.ndarray:
    """Keeps the lower triangle (key block <= query block) of a square attention mask.

    .. image:: /_static/layouts/causal_fixed.png

    Args:
      mask: bool [n, n], or [heads, n, n] (each head's mask is cut).
    Returns:
      bool, mask's shape.
    """
    mask = np.asarray(mask)
    if mask.ndim not in (2, 3) or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"causal needs a square [n, n] or [heads, n, n] mask, got shape {mask.shape}")
    n = mask.shape[-1]
    return (mask != 0) & np.tril(np.ones((n, n), bool))


def plot(mask, path, *, title: str | None = None):
    """Writes a picture of a block mask (present blocks dark) to ``path`` as PNG.

    Uses matplotlib's Agg canvas directly (no pyplot state, no display needed). The
    title gives the shape and density (and ``title`` before them, if given).

    Args:
      mask: bool [CB, KB] block mask.
      path: output file (``.png``).
      title: optional prefix of the title.
    Returns:
      ``path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"plot needs a 2-D [CB, KB] mask, got shape {mask.shape}")
    cb, kb = mask.shape
    density = float((mask != 0).mean()) if mask.size else 0.0
    scale = 6.0 / max(cb, kb, 1)
    fig = Figure(figsize=(max(2.5, kb * scale), max(2.5, cb * scale) + 0.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(mask != 0, cmap="Greys", vmin=0, vmax=1, interpolation="nearest", aspect="equal")
    ax.set_xlabel("output block column")
    ax.set_ylabel("input block row")
    label = f"{cb} x {kb} blocks, density {density:.1%} ({int((mask != 0).sum())} blocks)"
    ax.set_title(f"{title}: {label}" if title else label, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
