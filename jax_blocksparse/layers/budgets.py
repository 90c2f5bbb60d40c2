"""Layer budgets: how many blocks each layer gets, and the initial layouts.

A budget turns a global target density into a number of blocks per layer:

* ``"uniform"``: every layer gets the target density (up to rounding).
* ``"erk"`` (Erdos-Renyi(-Kernel), Mocanu et al. 2018, Evci et al. 2020): the density
  of a [C, K] layer is proportional to ``(C + K) / (C * K)`` (sum of dims over their
  product; a convolution's [*kernel_size, C, K] counts its kernel dims too), scaled so
  that the layers together hold the target fraction of all weights.
  A layer whose density would exceed 1 is made dense and the rest is rescaled
  (repeated until no layer exceeds 1).

Block counts are rounded with the largest-remainder method so that, for layers of
one block size, they sum exactly to ``round(density * total number of blocks)``.
Every layer with a non-zero density keeps at least one block.

:func:`plan_layouts` draws the initial random masks and picks each layer's fixed
``capacity`` (number of storage slots): the shapes of the kernels never change
during training, so the training step compiles once.

The budgets serve both :mod:`jax_blocksparse.training`'s methods (which re-export
the public names: ``jbs.training.plan_layouts``, ...) and the one-call conversion of a
dense model (:mod:`~jax_blocksparse.layers.sparsify`); they need only numpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jax_blocksparse.layout import check_block_size

DISTRIBUTIONS = ("uniform", "erk")


def check_density(density, name="density") -> float:
    density = float(density)
    if not 0.0 < density <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {density}")
    return density


def _check_shapes(shapes) -> list[tuple[int, int]]:
    out = []
    for shape in shapes:
        try:
            c, k = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise TypeError(f"each layer shape must be a pair (C, K) of ints, got {shape!r}") from None
        if c <= 0 or k <= 0:
            raise ValueError(f"layer shapes must be positive, got {shape!r}")
        out.append((c, k))
    return out


def _check_dims(shapes) -> list[tuple[int, ...]]:
    """Weight shapes of any rank >= 1 (a dense [C, K], a conv [*kernel_size, C, K]), checked."""
    out = []
    for shape in shapes:
        try:
            dims = tuple(int(s) for s in shape)
        except (TypeError, ValueError):
            raise TypeError(f"each layer shape must be a sequence of ints, e.g. (C, K), got {shape!r}") from None
        if not dims or min(dims) <= 0:
            raise ValueError(f"layer shapes must be non-empty and positive, got {shape!r}")
        out.append(dims)
    return out


def uniform_densities(shapes, density: float) -> np.ndarray:
    """The target ``density`` for every layer: float64 [num_layers]."""
    shapes = _check_dims(shapes)
    return np.full(len(shapes), check_density(density))


def erk_densities(shapes, density: float) -> np.ndarray:
    """Erdos-Renyi layer densities for weights of shapes [(C, K), ...]: float64 [num_layers].

    ``density_l = min(1, eps * (C_l + K_l) / (C_l * K_l))`` with ``eps`` chosen so
    that ``sum_l density_l * C_l * K_l == density * sum_l C_l * K_l`` (the global
    target, counted in weights). Layers capped at 1 are dense; the remaining budget
    is spread over the others with a new ``eps``. A shape of another rank (a
    convolution's [*kernel_size, C, K]) counts all its dims: the sum of its dims over
    their product (Evci et al.'s Erdos-Renyi-Kernel), and its size is their product.
    """
    shapes = _check_dims(shapes)
    density = check_density(density)
    sizes = np.array([math.prod(s) for s in shapes], np.float64)
    raw = np.array([sum(s) / math.prod(s) for s in shapes], np.float64)
    target = density * sizes.sum()
    dense = np.zeros(len(shapes), bool)
    for _ in range(len(shapes) + 1):
        budget = target - sizes[dense].sum()
        eps = budget / float((raw * sizes)[~dense].sum()) if (~dense).any() else 0.0
        over = ~dense & (eps * raw > 1.0)
        if not over.any():
            break
        dense |= over
    return np.where(dense, 1.0, np.minimum(1.0, eps * raw))


def allocate_blocks(densities, grid_sizes, total: int | None = None) -> np.ndarray:
    """Rounds per-layer densities to block counts: int64 [num_layers].

    ``counts[l] ~ densities[l] * grid_sizes[l]``, each in [1, grid_sizes[l]] (0 only
    for a zero density), summing exactly to ``total`` (default: the rounded sum of
    the ideal counts) when that is reachable. Largest remainder first, ties by
    layer order: deterministic.
    """
    densities = np.asarray(densities, np.float64)
    sizes = np.asarray(grid_sizes, np.int64)
    ideal = densities * sizes
    if total is None:
        total = int(round(float(ideal.sum())))
    lower = np.where(densities > 0, 1, 0)
    counts = np.clip(np.floor(ideal).astype(np.int64), lower, sizes)
    remainder = ideal - np.floor(ideal)
    # Add to the largest remainders (then the largest layers) while under the total.
    while counts.sum() < total:
        room = counts < sizes
        if not room.any():
            break
        score = np.where(room, remainder - (counts - ideal), -np.inf)
        i = int(np.argmax(score))
        counts[i] += 1
    # Take from the layers furthest above their ideal count while over the total.
    while counts.sum() > total:
        room = counts > lower
        if not room.any():
            break
        score = np.where(room, counts - ideal, -np.inf)
        i = int(np.argmax(score))
        counts[i] -= 1
    return counts


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """The initial layout of one layer: pass ``mask`` and ``capacity`` to the layer.

    Attributes:
      mask: bool [C // block_size, K // block_size], the initial block mask.
      capacity: the fixed number of storage slots (>= the blocks of ``mask``).
      block_size: the block edge.
      target_blocks: the number of blocks the layer should hold at the end of
        training (== ``mask.sum()`` except for magnitude pruning's dense start).
    """

    mask: np.ndarray
    capacity: int
    block_size: int
    target_blocks: int

    @property
    def grid(self) -> tuple[int, int]:
        return tuple(self.mask.shape)

    @property
    def nnz(self) -> int:
        return int(self.mask.sum())

    @property
    def density(self) -> float:
        return self.nnz / self.mask.size

    def __repr__(self):
        return (
            f"LayerPlan(grid={self.grid}, block_size={self.block_size}, nnz={self.nnz}, "
            f"capacity={self.capacity}, target_blocks={self.target_blocks})"
        )


def _random_mask(grid, count: int, rng: np.random.Generator) -> np.ndarray:
    total = grid[0] * grid[1]
    flat = np.zeros(total, bool)
    flat[rng.choice(total, size=int(count), replace=False)] = True
    return flat.reshape(grid)


def plan_layouts(
    shapes: Mapping[str, tuple[int, int]],
    block_size,
    density: float,
    *,
    distribution: str = "uniform",
    capacity_factor: float = 1.0,
    dense_start: bool = False,
    seed: int = 0,
) -> dict[str, LayerPlan]:
    """Initial masks and capacities for a set of block-sparse layers.

    Args:
      shapes: ``{name: (C, K)}``, the dense weight shape of each layer (multiples
        of its block size). The order of the mapping is the layer order.
      block_size: one block size for all layers, or ``{name: block_size}``.
      density: the global target density (fraction of weights kept), in (0, 1].
      distribution: ``"uniform"`` or ``"erk"`` (see the module docstring).
      capacity_factor: each layer's capacity is
        ``min(grid blocks, ceil(target_blocks * capacity_factor))``; > 1 leaves room
        for methods that move blocks between layers (sparse momentum).
      dense_start: start every layer dense (capacity = the whole grid), as gradual
        magnitude pruning does; ``target_blocks`` still follows the budget.
      seed: seed of the random initial masks (numpy; one stream per layer).

    Returns:
      ``{name: LayerPlan}`` in the order of ``shapes``.

    Example::

        plan = plan_layouts({"fc1": (64, 320), "fc2": (320, 96)}, 16, 0.1, distribution="erk")
        layer = BlockSparseDense(320, plan["fc1"].mask, 16, capacity=plan["fc1"].capacity,
                                 dynamic=True)
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
    if float(capacity_factor) < 1.0:
        raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor}")
    names = list(shapes)
    dims = _check_shapes([shapes[n] for n in names])
    sizes = {n: check_block_size(block_size[n] if isinstance(block_size, Mapping) else block_size) for n in names}
    grids = []
    for name, (c, k) in zip(names, dims):
        bs = sizes[name]
        if c % bs or k % bs:
            raise ValueError(f"plan_layouts: layer {name!r} of shape {(c, k)} is not a multiple of block_size {bs}")
        grids.append((c // bs, k // bs))
    densities = (erk_densities if distribution == "erk" else uniform_densities)(dims, density)
    counts = allocate_blocks(densities, [cb * kb for cb, kb in grids])
    plans = {}
    for i, (name, grid, count) in enumerate(zip(names, grids, counts)):
        total = grid[0] * grid[1]
        if dense_start:
            mask, capacity = np.ones(grid, bool), total
        else:
            mask = _random_mask(grid, count, np.random.default_rng([seed, i]))
            capacity = min(total, max(int(count), math.ceil(count * float(capacity_factor) - 1e-9)))
        plans[name] = LayerPlan(mask=mask, capacity=int(capacity), block_size=sizes[name], target_blocks=int(count))
    return plans
