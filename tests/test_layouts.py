"""Block-mask generators in jax_blocksparse.layouts."""

import textwrap

import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import rand, run_python

L = jbs.layouts


def num_undirected_edges(mask):
    """Edges i < j of a symmetric mask (self-loops not counted)."""
    return int(np.triu(mask, k=1).sum())


@pytest.mark.parametrize("grid", [(1, 1), (4, 7), (8, 8), (16, 3)])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_random_exact_count(grid, density):
    mask = L.random(grid, density, seed=3)
    assert mask.shape == grid and mask.dtype == np.bool_
    assert mask.sum() == round(density * grid[0] * grid[1])


def test_random_seeds():
    np.testing.assert_array_equal(L.random((8, 8), 0.3, seed=1), L.random((8, 8), 0.3, seed=1))
    assert (L.random((8, 8), 0.3, seed=1) != L.random((8, 8), 0.3, seed=2)).any()


GRAPHS = {
    "barabasi_albert": lambda n, seed=0, extra_edges=0: L.barabasi_albert(n, 2, seed=seed, extra_edges=extra_edges),
    "watts_strogatz": lambda n, seed=0, extra_edges=0: L.watts_strogatz(n, 4, 0.3, seed=seed, extra_edges=extra_edges),
}


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("n", [6, 16, 33])
def test_graph_layouts_symmetric_with_self_loops(name, n):
    mask = GRAPHS[name](n, seed=5)
    assert mask.shape == (n, n) and mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, mask.T)
    assert mask.diagonal().all()
    assert (mask.sum(axis=1) >= 2).all()  # every node has at least one neighbour besides itself


def test_barabasi_albert_edge_count():
    # Preferential attachment: m edges from each node after the first m (node m links to all m).
    n, m = 20, 3
    assert num_undirected_edges(L.barabasi_albert(n, m, seed=0)) == (n - m) * m


def test_watts_strogatz_ring_without_rewiring():
    n, k = 10, 4
    mask = L.watts_strogatz(n, k, 0.0)
    assert num_undirected_edges(mask) == n * k // 2
    i, j = np.nonzero(mask)
    ring_distance = np.minimum((i - j) % n, (j - i) % n)
    assert ring_distance.max() == k // 2  # a 1-D ring: only the k // 2 nearest each side
    assert num_undirected_edges(L.watts_strogatz(n, k, 0.5, seed=1)) == n * k // 2  # rewiring keeps the count


@pytest.mark.parametrize("name", GRAPHS)
def test_graph_seeds(name):
    make = GRAPHS[name]
    np.testing.assert_array_equal(make(24, seed=7), make(24, seed=7))
    assert (make(24, seed=7) != make(24, seed=8)).any()


@pytest.mark.parametrize("name", GRAPHS)
@pytest.mark.parametrize("extra", [1, 5, 17])
def test_extra_edges_adds_exactly_that_many(name, extra):
    make = GRAPHS[name]
    base, more = make(16, seed=2), make(16, seed=2, extra_edges=extra)
    assert (more | base == more).all()  # a superset
    assert num_undirected_edges(more) == num_undirected_edges(base) + extra
    np.testing.assert_array_equal(more, more.T)
    np.testing.assert_array_equal(more, make(16, seed=2, extra_edges=extra))


# The graph generators are the package's own numpy code: with networkx unimportable the
# package imports and both run (16 nodes: BA m=2 has 2 * 14 edges, WS k=4 has 16 * 2).
WITHOUT_NETWORKX = textwrap.dedent(
    """
    import sys
    sys.modules["networkx"] = None  # any import of it raises ImportError
    import jax_blocksparse as jbs
    ba = jbs.layouts.barabasi_albert(16, 2, seed=0)
    ws = jbs.layouts.watts_strogatz(16, 4, 0.3, seed=0)
    print(int(ba.sum()), int(ws.sum()))
    """
)


def test_package_and_graph_layouts_need_no_networkx():
    proc = run_python(WITHOUT_NETWORKX)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(16 + 2 * 2 * 14), str(16 + 2 * 16 * 2)]


def test_extra_edges_can_fill_the_graph():
    base = L.barabasi_albert(8, 2, seed=0)
    free = 8 * 7 // 2 - num_undirected_edges(base)
    assert L.barabasi_albert(8, 2, seed=0, extra_edges=free).all()
    with pytest.raises(ValueError, match=f"extra_edges={free + 1}"):
        L.barabasi_albert(8, 2, seed=0, extra_edges=free + 1)


@pytest.mark.parametrize(
    "grid,bandwidth", [((6, 6), 0), ((6, 6), 1), ((8, 8), 3), ((8, 4), 1), ((4, 8), 0), ((5, 5), 10)]
)
def test_banded(grid, bandwidth):
    mask = L.banded(grid, bandwidth)
    assert mask.shape == grid and mask.dtype == np.bool_
    if grid[0] == grid[1]:
        c, k = np.indices(grid)
        np.testing.assert_array_equal(mask, np.abs(c - k) <= bandwidth)
    assert mask.any(axis=0).all() and mask.any(axis=1).all()  # no empty block row or column


def test_banded_rectangular_follows_scaled_diagonal():
    np.testing.assert_array_equal(L.banded((4, 8), 0), np.kron(np.eye(4, dtype=bool), np.ones((1, 2), bool)))
    np.testing.assert_array_equal(L.banded((8, 4), 0), np.kron(np.eye(4, dtype=bool), np.ones((2, 1), bool)))
    assert L.banded((3, 7), 0).sum(axis=0).min() >= 1


@pytest.mark.parametrize("density", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("block_size", [8, 16])
def test_from_dense_topk_picks_largest_blocks(block_size, density):
    grid = (4, 6)
    scale = np.random.default_rng(0).permutation(grid[0] * grid[1]).reshape(grid) + 1.0  # distinct
    W = np.asarray(rand((grid[0] * block_size, grid[1] * block_size))) * np.kron(
        scale, np.ones((block_size, block_size))
    )
    norms = L.block_norms(W, block_size)
    assert norms.shape == grid
    blocks = W.reshape(grid[0], block_size, grid[1], block_size)
    np.testing.assert_allclose(norms, np.sqrt((blocks**2).sum(axis=(1, 3))), rtol=1e-5)
    mask = L.from_dense_topk(W, block_size, density)
    count = round(density * mask.size)
    assert mask.shape == grid and mask.sum() == count
    if 0 < count < mask.size:
        assert norms[mask].min() > norms[~mask].max()


def test_from_dense_topk_ties_are_deterministic():
    mask = L.from_dense_topk(np.ones((32, 32)), 8, 0.25)
    expected = np.zeros(16, bool)
    expected[:4] = True  # ties break toward the lower row-major index
    np.testing.assert_array_equal(mask, expected.reshape(4, 4))


def test_generators_feed_layouts():
    for mask in (L.random((4, 4), 0.5), L.barabasi_albert(6, 2), L.watts_strogatz(6, 2, 0.1), L.banded((4, 4), 1)):
        layout = jbs.Layout.from_mask(mask, 8)
        assert layout.nnz == mask.sum()


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda: L.random((4, 4), 1.5), ValueError, "density must be in"),
        (lambda: L.random((4, 4), -0.1), ValueError, "density must be in"),
        (lambda: L.random((4, -1), 0.5), ValueError, "grid must be non-negative"),
        (lambda: L.random(4, 0.5), TypeError, "grid must be a pair"),
        (lambda: L.random((4, 4, 4), 0.5), TypeError, "grid must be a pair"),
        (lambda: L.barabasi_albert(5, 0), ValueError, "1 <= m < n"),
        (lambda: L.barabasi_albert(5, 5), ValueError, "1 <= m < n"),
        (lambda: L.watts_strogatz(5, 5, 0.1), ValueError, "0 <= k < n"),
        (lambda: L.watts_strogatz(5, 2, 1.5), ValueError, "p must be in"),
        (lambda: L.banded((4, 4), -1), ValueError, "bandwidth must be >= 0"),
        (lambda: L.banded((4,), 1), TypeError, "grid must be a pair"),
        (lambda: L.block_norms(np.ones((4, 4, 4)), 2), ValueError, r"W must be 2-D.*\(4, 4, 4\)"),
        (lambda: L.from_dense_topk(np.ones((20, 32)), 8, 0.5), ValueError, r"\(20, 32\).*block_size=8"),
        (lambda: L.from_dense_topk(np.ones((32, 32)), 24, 0.5), ValueError, "block_size must be one of"),
        (lambda: L.from_dense_topk(np.ones((32, 32)), 8.0, 0.5), TypeError, "block_size must be an int"),
        (lambda: L.from_dense_topk(np.ones((32, 32)), 8, 2.0), ValueError, "density must be in"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()
