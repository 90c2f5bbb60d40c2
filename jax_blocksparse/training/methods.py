"""The dynamic-sparsity methods, at block granularity.

Every method is a frozen dataclass (hashable, so it can be closed over or passed
as a static argument of ``jax.jit``) with the same three calls:

* ``plan(shapes, block_size)``: the initial mask and the fixed capacity of every
  layer (see :func:`~jax_blocksparse.training.plan_layouts`);
* ``is_update_step(step)``: whether to update the layouts after ``step`` training
  steps (a host-side Python bool);
* ``update(step, params, layouts, opt_state, grads)``: the new params, layouts and
  optimizer state, and a :class:`~jax_blocksparse.training.LayoutChangeLog`.
  Pure and jittable; ``step`` may be traced. Shapes never change (each layer keeps
  its capacity), so the training step and the update step each compile once.

=======================  =============================================================
method                   at each update, per layer
=======================  =============================================================
:class:`StaticSparse`    nothing (the baseline: a fixed random layout)
:class:`SET`             drop the ``drop_fraction`` weakest blocks (by block norm), grow
                         as many at random (Mocanu et al. 2018)
:class:`RigL`            drop as SET, grow where the dense gradient's block norm is
                         largest (Evci et al. 2020); needs ``grads`` from
                         :func:`~jax_blocksparse.training.dense_grads`
:class:`SparseMomentum`  prune a cosine-decayed ``prune_rate`` (0.5 -> 0) of the
                         weakest blocks of each layer; give the pruned total back to the
                         layers in proportion to their mean momentum magnitude, capped by
                         each layer's free room; grow where the momentum's block norm is
                         largest (Dettmers & Zettlemoyer 2019); needs ``grads``: an
                         estimate of the dense momentum (mean of dense gradients)
:class:`MagnitudePruning`  dense start; prune the weakest blocks down to the cubic
                         schedule's density (Zhu & Gupta 2017); never grows
=======================  =============================================================

Grown blocks start at zero and every per-block leaf of the optimizer state is reset
at them (:func:`~jax_blocksparse.training.remap_tree`); surviving blocks keep their
values and state, moved to their new slots. A block pruned in an update is not
regrown in the same update, so "grown" blocks are always new. Ties are broken by a
random key derived from ``seed`` and ``step``: results are deterministic given the
seed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layers import budgets, select
from jax_blocksparse.layout import Layout
from jax_blocksparse.training import _paths, schedules
from jax_blocksparse.training.log import LayoutChangeLog
from jax_blocksparse.training.remap import remap_tree


class SparsityUpdate(NamedTuple):
    """What ``update`` returns."""

    params: Any
    layouts: Any
    opt_state: Any
    log: LayoutChangeLog


@dataclasses.dataclass
class _Layer:
    """One layer seen by a method's decision rule (all arrays may be traced)."""

    name: str
    layout: Layout
    kernel: jax.Array
    grads: jax.Array | None  # dense blocks [CB * KB, bs, bs] or block scores [CB, KB]
    mask: jax.Array  # bool [CB, KB]
    nnz: jax.Array  # int32
    magnitude: jax.Array  # float32 [CB, KB], block norms of the kernel (0 where absent)
    target_blocks: int  # the budget's final number of blocks
    random: jax.Array  # float32 [3, CB, KB] uniform: prune tiebreak, grow tiebreak, grow at random

    @property
    def grid_size(self) -> int:
        return self.layout.grid[0] * self.layout.grid[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DynamicSparsity:
    """Base class: the common configuration and the update machinery.

    Attributes:
      density: global target density (fraction of weights kept), in (0, 1].
      distribution: layer budget, "uniform" or "erk".
      update_every: training steps between layout updates.
      seed: seed of the initial masks and of the update's random choices.
      norm: block norm for magnitudes and gradient scores, "l2" or "l1".
    """

    density: float
    distribution: str = "uniform"
    update_every: int = 100
    seed: int = 0
    norm: str = "l2"

    needs_grads: ClassVar[bool] = False
    dense_start: ClassVar[bool] = False

    def __post_init__(self):
        budgets.check_density(self.density)
        if self.distribution not in budgets.DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {budgets.DISTRIBUTIONS}, got {self.distribution!r}")
        if int(self.update_every) < 1:
            raise ValueError(f"update_every must be >= 1, got {self.update_every}")
        if self.norm not in select.NORMS:
            raise ValueError(f"norm must be one of {select.NORMS}, got {self.norm!r}")

    # -- configuration ----------------------------------------------------------------

    @property
    def capacity_factor(self) -> float:
        return 1.0

    @property
    def last_update_step(self) -> float:
        """No update happens after this step."""
        return math.inf

    @property
    def first_update_step(self) -> int:
        return 0

    def plan(self, shapes: Mapping[str, tuple[int, int]], block_size) -> dict[str, budgets.LayerPlan]:
        """Initial masks and capacities: ``{name: LayerPlan(mask, capacity, ...)}``."""
        return budgets.plan_layouts(
            shapes,
            block_size,
            self.density,
            distribution=self.distribution,
            capacity_factor=self.capacity_factor,
            dense_start=self.dense_start,
            seed=self.seed,
        )

    def is_update_step(self, step: int) -> bool:
        """Whether to call ``update`` after ``step`` (>= 1) completed training steps."""
        step = int(step)
        first = self.first_update_step
        return step > 0 and first <= step <= self.last_update_step and (step - first) % int(self.update_every) == 0

    def schedule(self, step):
        """The method's schedule value at ``step`` (prune rate, drop fraction or density)."""
        return jnp.zeros((), jnp.float32)

    def target_blocks(self, layouts) -> dict[str, int]:
        """The budget's final number of blocks per layer, from the layouts' shapes."""
        entries = _paths.layout_leaves(layouts)
        return dict(zip((_paths.path_string(p) for p, _ in entries), self._targets([l for _, l in entries])))

    def _targets(self, layouts: list[Layout]) -> list[int]:
        shapes = [l.shape for l in layouts]
        fn = budgets.erk_densities if self.distribution == "erk" else budgets.uniform_densities
        densities = fn(shapes, self.density)
        return [int(c) for c in budgets.allocate_blocks(densities, [l.grid[0] * l.grid[1] for l in layouts])]

    # -- the update -------------------------------------------------------------------

    def update(self, step, params, layouts, opt_state=None, grads=None) -> SparsityUpdate:
        """Prunes and grows blocks; moves params and optimizer state to the new slots.

        Args:
          step: the training step (int, may be traced).
          params: the parameters (linen ``variables["params"]``, an nnx state, any
            pytree); the leaves described by ``layouts`` are the kernels
            [capacity, bs, bs]; other leaves (biases, norms) are passed through.
          layouts: pytree of :class:`~jax_blocksparse.Layout` beside ``params`` (the
            linen "layout" collection; see :mod:`~jax_blocksparse.training._paths`).
          opt_state: any optax state (or None): every leaf for a kernel (same path
            suffix, leading dimension = capacity) is moved with its blocks and reset
            to zero at grown blocks.
          grads: for :class:`RigL` and :class:`SparseMomentum`: a pytree like
            ``layouts`` holding dense block gradients [CB * KB, bs, bs] (from
            :func:`~jax_blocksparse.training.dense_grads`, or their running mean)
            or block scores [CB, KB].

        Returns:
          ``SparsityUpdate(params, layouts, opt_state, log)``.
        """
        entries = _paths.layout_leaves(layouts)
        if not entries:
            raise ValueError("update: `layouts` holds no jax_blocksparse.Layout")
        names = [_paths.path_string(p) for p, _ in entries]
        kernels = self._find_kernels(params, entries)
        grad_leaves = self._check_grads(grads, entries)
        targets = self._targets([l for _, l in entries])
        step = jnp.asarray(step, jnp.int32)

        # One draw of random numbers for the whole update (threefry is slow to compile).
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        sizes = [l.grid[0] * l.grid[1] for _, l in entries]
        random = jax.random.uniform(key, (3, sum(sizes)))
        offsets = np.cumsum([0] + sizes)

        layers = []
        for i, ((path, layout), kernel, g, target) in enumerate(zip(entries, kernels, grad_leaves, targets)):
            layers.append(
                _Layer(
                    name=_paths.path_string(path),
                    layout=layout,
                    kernel=kernel,
                    grads=g,
                    mask=layout.mask,
                    nnz=jnp.asarray(layout.tables.col_ptr[-1], jnp.int32),
                    magnitude=select.block_magnitude(kernel, layout, self.norm),
                    target_blocks=target,
                    random=random[:, offsets[i] : offsets[i + 1]].reshape((3,) + layout.grid),
                )
            )
        decisions = self._decide(step, layers)

        new_layouts = []
        counts = {f: [] for f in ("nnz_before", "pruned", "grown", "nnz_after")}
        for layer, (prune, grow) in zip(layers, decisions):
            new_mask = (layer.mask & ~prune) | (grow & ~layer.mask)
            new_layouts.append(Layout.from_mask(new_mask, layer.layout.block_size, capacity=layer.layout.capacity))
            new_mask = new_layouts[-1].mask  # what the layout holds (never over capacity)
            counts["nnz_before"].append(layer.nnz)
            counts["pruned"].append(jnp.sum(layer.mask & ~new_mask, dtype=jnp.int32))
            counts["grown"].append(jnp.sum(new_mask & ~layer.mask, dtype=jnp.int32))
            counts["nnz_after"].append(jnp.sum(new_mask, dtype=jnp.int32))

        leaves, treedef = jax.tree_util.tree_flatten(layouts, is_leaf=_paths.is_layout)
        it = iter(new_layouts)
        new_leaves = [next(it) if _paths.is_layout(x) else x for x in leaves]
        new_layouts_tree = jax.tree_util.tree_unflatten(treedef, new_leaves)

        new_params = remap_tree(params, layouts, new_layouts_tree)
        new_opt_state = None if opt_state is None else remap_tree(opt_state, layouts, new_layouts_tree)
        log = LayoutChangeLog(
            step,
            *(jnp.stack(counts[f]) for f in ("nnz_before", "pruned", "grown", "nnz_after")),
            names=names,
            capacities=[l.layout.capacity for l in layers],
            grid_sizes=[l.grid_size for l in layers],
        )
        return SparsityUpdate(new_params, new_layouts_tree, new_opt_state, log)

    def _decide(self, step, layers: list[_Layer]) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer: (bool grid of blocks to prune, bool grid of blocks to grow)."""
        raise NotImplementedError

    # -- helpers ----------------------------------------------------------------------

    @staticmethod
    def _find_kernels(params, entries):
        flat, _ = jax.tree_util.tree_flatten_with_path(params)
        by_path = {_paths.normalize(path): leaf for path, leaf in flat}
        kernels = []
        for path, layout in entries:
            kernel = by_path.get(path)
            if kernel is None:
                raise ValueError(
                    f"update: no parameter at {_paths.path_string(path)!r} for the layout there "
                    f"({layout}); parameter paths: {sorted(_paths.path_string(p) for p in by_path)[:8]}"
                )
            if tuple(kernel.shape) != layout.w_shape:
                raise ValueError(
                    f"update: parameter {_paths.path_string(path)!r} has shape {tuple(kernel.shape)}, "
                    f"its layout needs {layout.w_shape}"
                )
            kernels.append(kernel)
        return kernels

    def _check_grads(self, grads, entries):
        if grads is None:
            if self.needs_grads:
                raise ValueError(
                    f"{type(self).__name__}.update needs `grads`: dense block gradients from "
                    "jax_blocksparse.training.dense_grads(loss_fn, params, layouts, *batch)"
                )
            return [None] * len(entries)
        leaves = jax.tree.leaves(grads)
        if len(leaves) != len(entries):
            raise ValueError(f"update: `grads` must hold one array per layout ({len(entries)}), got {len(leaves)}")
        for g, (path, layout) in zip(leaves, entries):
            cb, kb = layout.grid
            ok = tuple(g.shape) in ((cb * kb, layout.block_size, layout.block_size), (cb, kb))
            if not ok:
                raise ValueError(
                    f"update: grads for {_paths.path_string(path)!r} must be [CB * KB, bs, bs] = "
                    f"{(cb * kb, layout.block_size, layout.block_size)} or [CB, KB] = {(cb, kb)}, got {tuple(g.shape)}"
                )
        return leaves

    def _grad_scores(self, layer: _Layer, norm: str | None = None):
        g = layer.grads
        if g.ndim == 2:
            return jnp.abs(g.astype(jnp.float32))
        return select.grid_scores(g, layer.layout.grid, norm or self.norm)


def _round_count(rate, n):
    return jnp.round(rate * n.astype(jnp.float32)).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StaticSparse(DynamicSparsity):
    """A fixed random layout (uniform or ERK budget): the static-sparse baseline."""

    def is_update_step(self, step: int) -> bool:
        return False

    def _decide(self, step, layers):
        return [(jnp.zeros_like(l.mask), jnp.zeros_like(l.mask)) for l in layers]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SET(DynamicSparsity):
    """Sparse Evolutionary Training at block level: drop weakest, grow at random.

    Attributes:
      total_steps: the length of training in steps.
      drop_fraction: fraction of each layer's blocks replaced at the first update.
      stop_fraction: no updates after ``stop_fraction * total_steps``.
      drop_schedule: "cosine" (anneal the fraction to 0 at the stop step, as RigL)
        or "constant" (Mocanu et al.).
    """

    total_steps: int
    drop_fraction: float = 0.3
    stop_fraction: float = 0.75
    drop_schedule: str = "cosine"

    def __post_init__(self):
        super().__post_init__()
        if int(self.total_steps) < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= float(self.drop_fraction) <= 1.0:
            raise ValueError(f"drop_fraction must be in [0, 1], got {self.drop_fraction}")
        if not 0.0 < float(self.stop_fraction) <= 1.0:
            raise ValueError(f"stop_fraction must be in (0, 1], got {self.stop_fraction}")
        schedules.annealed_fraction(0, 1, 0.0, self.drop_schedule)  # validates the name

    @property
    def end_step(self) -> float:
        return float(self.stop_fraction) * int(self.total_steps)

    @property
    def last_update_step(self) -> float:
        return self.end_step - 1e-9  # updates strictly before the stop step

    def schedule(self, step):
        return schedules.annealed_fraction(step, self.end_step, self.drop_fraction, self.drop_schedule)

    def _grow_scores(self, layer: _Layer):
        return layer.random[2]

    def _decide(self, step, layers):
        rate = self.schedule(step)
        out = []
        for layer in layers:
            # Never drop more than can be regrown among the blocks absent before the update.
            k = jnp.minimum(_round_count(rate, layer.nnz), layer.grid_size - layer.nnz)
            prune = select.smallest(layer.magnitude, layer.mask, k, layer.random[0])
            grow = select.largest(self._grow_scores(layer), ~layer.mask, k, layer.random[1])
            out.append((prune, grow))
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class RigL(SET):
    """Rigged Lottery at block level: drop weakest, grow where the dense gradient is largest.

    ``update`` needs ``grads``: the dense block gradients at the update step from
    :func:`~jax_blocksparse.training.dense_grads` (one full-layout ``bsmm_updat``
    per layer). Defaults follow Evci et al.: drop fraction 0.3, cosine annealed,
    updates every 100 steps until 75% of training; ERK budget.
    """

    distribution: str = "erk"
    needs_grads: ClassVar[bool] = True

    def _grow_scores(self, layer: _Layer):
        return self._grad_scores(layer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseMomentum(DynamicSparsity):
    """Sparse momentum (Dettmers & Zettlemoyer 2019) at block level.

    At each update (the paper: every epoch, so ``update_every = steps per epoch``):

    1. prune ``round(p * nnz_l)`` weakest blocks of each layer ``l`` (block norm),
       ``p`` = ``prune_rate`` cosine-decayed to ``final_prune_rate`` at
       ``stop_fraction * total_steps`` (the paper: 1.0, the end of training), after
       which the layout is frozen;
    2. split the pruned total among the layers in proportion to each layer's mean
       momentum magnitude over its present weights, capped by its free room (its
       capacity minus its remaining blocks, and the blocks absent before the update);
       what a capped layer cannot take goes to the others;
    3. grow each layer's share where the momentum's block norm is largest.

    The global number of blocks is preserved; a layer's may change, up to its
    capacity (``capacity_factor`` times its initial budget, at most the grid).

    ``update`` needs ``grads``: the momentum of every block of the grid. With truly
    block-sparse training there is no dense momentum buffer, so pass an estimate:
    the mean of dense block gradients (:func:`~jax_blocksparse.training.dense_grads`)
    over a few minibatches at the update step (SGD momentum 0.9 averages about 10).
    """

    total_steps: int
    prune_rate: float = 0.5
    final_prune_rate: float = 0.0
    stop_fraction: float = 1.0
    capacity_factor: float = 1.5
    redistribution: str = "momentum"

    needs_grads: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if int(self.total_steps) < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if not 0.0 <= float(self.prune_rate) <= 1.0 or not 0.0 <= float(self.final_prune_rate) <= 1.0:
            raise ValueError(f"prune rates must be in [0, 1], got {self.prune_rate}, {self.final_prune_rate}")
        if float(self.capacity_factor) < 1.0:
            raise ValueError(f"capacity_factor must be >= 1, got {self.capacity_factor}")
        if not 0.0 < float(self.stop_fraction) <= 1.0:
            raise ValueError(f"stop_fraction must be in (0, 1], got {self.stop_fraction}")
        if self.redistribution not in ("momentum", "none"):
            raise ValueError(f"redistribution must be 'momentum' or 'none', got {self.redistribution!r}")

    @property
    def end_step(self) -> float:
        return float(self.stop_fraction) * int(self.total_steps)

    @property
    def last_update_step(self) -> float:
        return self.end_step - 1e-9

    def schedule(self, step):
        rate = schedules.cosine_decay(step, self.end_step, self.prune_rate, self.final_prune_rate)
        return jnp.where(jnp.asarray(step, jnp.float32) < self.end_step, rate, 0.0)

    def _decide(self, step, layers):
        rate = self.schedule(step)
        prunes, ks, means, caps = [], [], [], []
        for layer in layers:
            k = jnp.minimum(_round_count(rate, layer.nnz), layer.grid_size - layer.nnz)
            prunes.append(select.smallest(layer.magnitude, layer.mask, k, layer.random[0]))
            ks.append(k)
            # Mean momentum magnitude over the layer's present weights.
            l1 = self._grad_scores(layer, "l1")
            weights_per_block = 1.0 if layer.grads.ndim == 2 else float(layer.layout.block_size**2)
            mean = jnp.sum(jnp.where(layer.mask, l1, 0.0)) / (jnp.maximum(layer.nnz, 1) * weights_per_block)
            means.append(mean)
            free = layer.layout.capacity - (layer.nnz - k)
            caps.append(jnp.minimum(free, layer.grid_size - layer.nnz))
        ks = jnp.stack(ks)
        if self.redistribution == "momentum":
            alloc = select.redistribute(jnp.sum(ks), jnp.stack(means), jnp.stack(caps))
        else:
            alloc = ks
        out = []
        for i, (layer, prune) in enumerate(zip(layers, prunes)):
            grow = select.largest(self._grad_scores(layer), ~layer.mask, alloc[i], layer.random[1])
            out.append((prune, grow))
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class MagnitudePruning(DynamicSparsity):
    """Gradual magnitude pruning (Zhu & Gupta 2017) at block level.

    Every layer starts dense (capacity = its whole grid) and is pruned, every
    ``update_every`` steps between ``begin_step`` and ``end_step``, to
    ``round(d_t * grid blocks)`` blocks (at least its final budget), where ``d_t``
    follows :func:`~jax_blocksparse.training.cubic_density` from ``initial_density``
    to the layer's final budget (uniform or ERK). Blocks are never regrown.
    """

    end_step: int
    begin_step: int = 0
    initial_density: float = 1.0

    dense_start: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if int(self.end_step) < int(self.begin_step):
            raise ValueError(f"end_step ({self.end_step}) must be >= begin_step ({self.begin_step})")

    @property
    def first_update_step(self) -> int:
        return int(self.begin_step)

    @property
    def last_update_step(self) -> float:
        return int(self.end_step)

    def is_update_step(self, step: int) -> bool:
        # Also update at end_step itself so that the final density is reached.
        return super().is_update_step(step) or (int(step) == int(self.end_step) and int(step) > 0)

    def schedule(self, step):
        return schedules.cubic_density(step, self.begin_step, self.end_step, self.density, self.initial_density)

    def _decide(self, step, layers):
        final = jnp.asarray([l.target_blocks / max(l.grid_size, 1) for l in layers], jnp.float32)
        density = schedules.cubic_density(step, self.begin_step, self.end_step, final, self.initial_density)
        out = []
        for i, layer in enumerate(layers):
            target = jnp.maximum(jnp.round(density[i] * layer.grid_size).astype(jnp.int32), layer.target_blocks)
            k = jnp.maximum(layer.nnz - target, 0)
            prune = select.smallest(layer.magnitude, layer.mask, k, layer.random[0])
            out.append((prune, jnp.zeros_like(layer.mask)))
        return out


METHODS = {
    "static": StaticSparse,
    "set": SET,
    "rigl": RigL,
    "sparse_momentum": SparseMomentum,
    "magnitude": MagnitudePruning,
}


def get_method(name: str, **kwargs) -> DynamicSparsity:
    """``get_method("rigl", density=0.1, total_steps=1000)``: a method by name."""
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name](**kwargs)
