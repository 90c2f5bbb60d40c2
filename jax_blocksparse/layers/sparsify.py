"""Sparsifying a dense model, framework-neutral: which layers, which blocks, and a report.

The Flax entry points (:func:`jax_blocksparse.nnx.sparsify`,
:func:`jax_blocksparse.nn.sparsify`) find the model's dense and conv layers and hand
them here as :class:`Candidate` s; :func:`plan_sparsity` decides, for both frameworks
alike:

* **what fits**: a layer whose input and output features (channels) are multiples of
  the block size, which the caller found no other reason to keep dense, and which no
  ``keep_dense`` pattern names (:func:`shape_reason`, :func:`path_filter`);
* **how many blocks** each layer keeps: a per-layer budget over the converted layers,
  ``"uniform"`` or ``"erk"`` (:mod:`~jax_blocksparse.layers.budgets`; a conv's ERK
  counts its kernel dims), rounded to whole blocks;
* **which blocks**: by default those of largest norm (:func:`block_scores`: the
  norm of a [bs, bs] block of a dense kernel, or of a conv's [*kernel_size, bs, bs]
  block over all its taps), or a mask or a mask generator per layer;
* **the report** (:class:`SparsifyReport`, which :mod:`jax_blocksparse.nn` and
  :mod:`jax_blocksparse.nnx` export): every layer's path, kernel shape, density and
  parameters before and after; the layers left dense with their reason.

The kernels themselves move with :func:`sparse_kernel` (the selected blocks of a
dense kernel) and :func:`dense_kernel` (back, zeros elsewhere). Like the rest of
:mod:`jax_blocksparse.layers`, nothing here imports Flax.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_blocksparse.layers import budgets, select
from jax_blocksparse.layers.common import StaticMask, layout_for
from jax_blocksparse.layers.general import FlatLinear
from jax_blocksparse.layout import Layout, check_block_size
from jax_blocksparse.ops.conv import conv_from_dense, conv_to_dense
from jax_blocksparse.ops.matmul import from_dense, to_dense

__all__ = [
    "Candidate",
    "LayerReport",
    "LayerSparsity",
    "SparsifyReport",
    "block_axis_names",
    "block_scores",
    "dense_kernel",
    "non_default",
    "path_filter",
    "plan_sparsity",
    "shape_reason",
    "sparse_kernel",
]

#: The layer kinds a model's layers convert to: a dense layer, a convolution.
KINDS = ("linear", "conv")


def _not_an_array(path: str, kind: str, kernel) -> str:
    """Why a candidate's kernel is refused when it is not an array: the path, the type found
    and what to do (a metadata box, the usual case, is unboxed first)."""
    found = f"{type(kernel).__module__}.{type(kernel).__qualname__}"
    if hasattr(kernel, "unbox"):  # flax.core.meta.AxisMetadata: nn.Partitioned, nn.LogicallyPartitioned, ...
        todo = (
            "it is a Flax metadata box (nn.with_partitioning / nn.with_logical_partitioning); pass the unboxed "
            "variables, flax.linen.unbox(variables), and box the converted ones again if you need the names"
        )
    else:
        todo = "sparsify reads each kernel as a concrete array: pass the variables as arrays"
    return f"Candidate {path!r}: the {kind} kernel must be an array, found a {found}: {todo}"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One dense layer of a model, as an entry point found it.

    Attributes:
      path: the layer's path in the model, "/"-joined ("encoder/layers/0").
      kind: ``"linear"`` (kernel [C, K]) or ``"conv"`` (kernel [*kernel_size, C, K]).
      layer_type: the layer's class name, for the report ("Linear", "Dense", "Conv").
      kernel: the dense kernel, a concrete array.
      bias_size: the number of bias parameters (0 without a bias).
      reason: why the layer cannot be converted whatever its shape (a custom
        ``dot_general``, a grouped convolution, ...); None if it can.
      dynamic_reason: why the layer cannot have a dynamic layout (None if it can);
        with ``dynamic=True`` it is converted with a static one.
      flat: for a linear-like layer whose kernel is [*in_shape, *out_shape]
        (DenseGeneral, LinearGeneral, an Einsum that is one matrix product), how it
        flattens to [C, K] (:class:`~jax_blocksparse.layers.general.FlatLinear`);
        None for a [C, K] or conv kernel.
    """

    path: str
    kind: str
    layer_type: str
    kernel: Any
    bias_size: int = 0
    reason: str | None = None
    dynamic_reason: str | None = None
    flat: FlatLinear | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Candidate {self.path!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if isinstance(self.kernel, jax.core.Tracer):
            raise TypeError(
                f"sparsify needs the model's weights as concrete arrays (the block masks are static), but the "
                f"kernel of {self.path!r} is traced: call it outside jit/grad"
            )
        if self.reason is None and not (hasattr(self.kernel, "shape") and hasattr(self.kernel, "dtype")):
            raise ValueError(_not_an_array(self.path, self.kind, self.kernel))
        if self.reason is None and self.flat is not None and self.shape != self.flat.kernel_shape:
            raise ValueError(
                f"Candidate {self.path!r}: the kernel's shape {self.shape} is not {self.flat.kernel_shape}, "
                f"[*in_shape, *out_shape] of its {self.flat}"
            )
        ndim = len(self.matrix_shape)
        # A layer kept dense for another reason may hold any kernel (e.g. stacked by nn.scan).
        if self.reason is None and ((self.kind == "linear" and ndim != 2) or (self.kind == "conv" and ndim < 3)):
            expected = "[C, K]" if self.kind == "linear" else "[*kernel_size, C, K]"
            raise ValueError(
                f"Candidate {self.path!r}: a {self.kind} kernel must be {expected}, got shape {np.shape(self.kernel)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(s) for s in np.shape(self.kernel))

    @property
    def matrix_shape(self) -> tuple[int, ...]:
        """The kernel's shape as the product sees it: [C, K] (flattened for a general
        layer), or a conv's [*kernel_size, C, K]."""
        return self.shape if self.flat is None or self.reason is not None else self.flat.features

    @property
    def matrix(self):
        """The kernel as :attr:`matrix_shape`."""
        return self.kernel if self.flat is None else self.flat.flat_kernel(self.kernel)

    @property
    def params(self) -> int:
        return math.prod(self.shape) + int(self.bias_size)


@dataclasses.dataclass(frozen=True)
class LayerSparsity:
    """What one converted layer becomes: hashable (a static configuration).

    Attributes:
      mask: the block mask, a :class:`~jax_blocksparse.layers.StaticMask` [C // bs, K // bs].
      block_size: the block edge.
      capacity: the number of storage slots (None: the mask's block count).
      dynamic: whether the layout is state that dynamic sparse training moves.
      flat: a general layer's [*in_shape, *out_shape] <-> [C, K] (None for a
        [C, K] or conv kernel).
    """

    mask: StaticMask
    block_size: int
    capacity: int | None = None
    dynamic: bool = False
    flat: FlatLinear | None = None

    @property
    def layout(self) -> Layout:
        """The (cached) layout of ``mask``: the layer's initial one if dynamic."""
        return layout_for(self.mask, self.block_size, self.capacity)


@dataclasses.dataclass(frozen=True)
class LayerReport:
    """One row of a :class:`SparsifyReport`.

    Attributes:
      path: the layer's path.
      layer_type: its class name.
      shape: its dense kernel's shape.
      params_before: kernel and bias parameters of the dense layer.
      params_after: the same after conversion (the stored blocks, up to the
        capacity, and the bias); equal to ``params_before`` for a layer left dense.
      block_size: the converted layer's block size (None for a layer left dense).
      blocks: its number of blocks (None for a layer left dense).
      grid_blocks: the number of blocks of its grid (None for a layer left dense).
      capacity: its storage slots (None for a layer left dense).
      dynamic: whether its layout is dynamic.
      reason: why the layer was left dense (None if it was converted).
      note: something else worth saying (e.g. a static layout where a dynamic one
        was asked for), or None.
      partitioning: for a converted layer whose kernel carried axis names, which
        names its block kernel could not keep and why (:func:`block_axis_names`);
        None if it kept them all, or had none.
    """

    path: str
    layer_type: str
    shape: tuple[int, ...]
    params_before: int
    params_after: int
    block_size: int | None = None
    blocks: int | None = None
    grid_blocks: int | None = None
    capacity: int | None = None
    dynamic: bool = False
    reason: str | None = None
    note: str | None = None
    partitioning: str | None = None

    @property
    def converted(self) -> bool:
        return self.reason is None

    @property
    def density(self) -> float:
        """The fraction of the kernel's blocks kept (1.0 for a layer left dense)."""
        return 1.0 if self.blocks is None else self.blocks / self.grid_blocks


@dataclasses.dataclass(frozen=True)
class SparsifyReport:
    """What a sparsify call did, layer by layer (``print(report)`` shows a table).

    Attributes:
      layers: one :class:`LayerReport` per dense or conv layer found, in model order.
      block_size: the block size asked for.
      density: the target density.
      distribution: the budget (``"uniform"`` or ``"erk"``).
    """

    layers: tuple[LayerReport, ...]
    block_size: int
    density: float
    distribution: str

    @property
    def converted(self) -> tuple[str, ...]:
        """The paths of the converted layers."""
        return tuple(r.path for r in self.layers if r.converted)

    @property
    def left_dense(self) -> dict[str, str]:
        """``{path: reason}`` of the layers left dense."""
        return {r.path: r.reason for r in self.layers if not r.converted}

    @property
    def lost_partitioning(self) -> dict[str, str]:
        """``{path: why}`` of the converted layers whose kernel lost axis names."""
        return {r.path: r.partitioning for r in self.layers if r.partitioning}

    def with_partitioning(self, dropped: Mapping[str, str | None]) -> SparsifyReport:
        """This report with each layer's dropped axis names (:func:`block_axis_names`)."""
        rows = tuple(dataclasses.replace(r, partitioning=dropped.get(r.path, r.partitioning)) for r in self.layers)
        return dataclasses.replace(self, layers=rows)

    @property
    def params_before(self) -> int:
        """Kernel and bias parameters of all listed layers, before."""
        return sum(r.params_before for r in self.layers)

    @property
    def params_after(self) -> int:
        """Kernel and bias parameters of all listed layers, after."""
        return sum(r.params_after for r in self.layers)

    def row(self, path: str) -> LayerReport:
        """The row of the layer at ``path`` (KeyError if there is none)."""
        for r in self.layers:
            if r.path == path:
                return r
        raise KeyError(f"no layer {path!r} in the report; layers: {[r.path for r in self.layers]}")

    def __str__(self) -> str:
        head = ("layer", "type", "kernel", "density", "blocks", "params before", "params after", "")
        rows = []
        for r in self.layers:
            blocks = "" if r.blocks is None else f"{r.blocks}/{r.grid_blocks}"
            if r.capacity is not None and r.capacity != r.blocks:
                blocks += f" (capacity {r.capacity})"
            what = f"left dense: {r.reason}" if r.reason else ("dynamic" if r.dynamic else "")
            for extra in (r.note, r.partitioning and f"partitioning: {r.partitioning}"):
                if extra:
                    what = f"{what}; {extra}" if what else extra
            density = "dense" if r.blocks is None else f"{r.density:.3f}"
            rows.append(
                (
                    r.path,
                    r.layer_type,
                    str(r.shape),
                    density,
                    blocks,
                    f"{r.params_before:,}",
                    f"{r.params_after:,}",
                    what,
                )
            )
        before, after = self.params_before, self.params_after
        share = f" ({after / before:.1%})" if before else ""
        rows.append(("total", "", "", "", "", f"{before:,}", f"{after:,}{share}", ""))
        widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
        lines = [
            f"sparsify: {len(self.converted)} of {len(self.layers)} layers block-sparse "
            f"(block {self.block_size}, density {self.density:g}, {self.distribution} budget)"
        ]
        for row in [head, *rows]:
            lines.append("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


def shape_reason(kind: str, shape, block_size: int) -> str | None:
    """Why a kernel of ``shape`` does not fit ``block_size`` (None if it does).

    A dense kernel [C, K] or a conv kernel [*kernel_size, C, K] fits when C and K
    are multiples of the block size.

    Example::

        >>> from jax_blocksparse.layers.sparsify import shape_reason
        >>> shape_reason("linear", (64, 10), 16)
        'output features 10 not a multiple of block_size 16'
        >>> shape_reason("conv", (3, 3, 32, 64), 16) is None
        True
    """
    c, k = (int(s) for s in tuple(shape)[-2:])
    what = "channels" if kind == "conv" else "features"
    bad = [f"{side} {what} {n}" for side, n in (("input", c), ("output", k)) if n % block_size]
    if not bad:
        return None
    return f"{' and '.join(bad)} not a multiple of block_size {block_size}"


def non_default(layer, defaults: Mapping[str, Any], names: Sequence[str]) -> str | None:
    """Why ``layer`` computes something else than its class's default (None if it does not).

    The first of ``names`` whose attribute is not the default in ``defaults``
    (compared by identity, as the defaults are functions and dtypes): ``"custom
    dot_general"`` for a function, ``"preferred_element_type=float32"`` for a dtype.
    Names missing from ``defaults`` (another Flax version) are skipped.
    """
    for name in names:
        if name not in defaults:
            continue
        value = getattr(layer, name, defaults[name])
        if value is defaults[name]:
            continue
        if name.endswith("_type"):  # a dtype (jnp.float32 is callable too)
            return f"{name}={np.dtype(value).name}"
        return f"custom {name}" if callable(value) else f"{name}={value!r}"
    return None


def path_filter(keep_dense) -> Callable[[str], bool]:
    """``keep_dense`` as a predicate on "/"-joined layer paths.

    ``keep_dense`` is None (keep nothing), a glob pattern (``fnmatch``, matched
    against the whole path: ``"head"``, ``"*/embed*"``), a sequence of patterns, or
    a callable ``fn(path: str) -> bool``.

    Example::

        >>> from jax_blocksparse.layers.sparsify import path_filter
        >>> keep = path_filter(["head", "blocks/*/attn*"])
        >>> keep("head"), keep("blocks/0/attn_out"), keep("blocks/0/mlp")
        (True, True, False)
    """
    if keep_dense is None:
        return lambda path: False
    if isinstance(keep_dense, str):
        keep_dense = (keep_dense,)
    if callable(keep_dense):
        return lambda path: bool(keep_dense(path))
    if isinstance(keep_dense, Sequence) and all(isinstance(p, str) for p in keep_dense):
        patterns = tuple(keep_dense)
        return lambda path: any(fnmatch.fnmatchcase(path, p) for p in patterns)
    raise TypeError(
        f"keep_dense must be a glob pattern, a sequence of patterns or a callable(path) -> bool, got {keep_dense!r}"
    )


def block_scores(kernel, block_size: int, norm: str = "l2") -> np.ndarray:
    """float64 [C // bs, K // bs]: the norm of every block of a dense or conv kernel.

    ``kernel`` is [C, K] or [*kernel_size, C, K]; a conv block's norm runs over all
    its taps (the block is kept or dropped at every tap at once). ``norm`` is
    ``"l2"`` (Frobenius) or ``"l1"``.
    """
    if norm not in select.NORMS:
        raise ValueError(f"norm must be one of {select.NORMS}, got {norm!r}")
    w = np.asarray(kernel, np.float64)
    c, k = w.shape[-2:]
    blocks = w.reshape(-1, c // block_size, block_size, k // block_size, block_size)
    if norm == "l2":
        return np.sqrt(np.square(blocks).sum(axis=(0, 2, 4)))
    return np.abs(blocks).sum(axis=(0, 2, 4))


def _top_blocks(scores: np.ndarray, count: int) -> np.ndarray:
    """bool mask of the ``count`` largest scores; ties toward the lower row-major index."""
    order = np.argsort(-scores.reshape(-1), kind="stable")[:count]
    mask = np.zeros(scores.size, bool)
    mask[order] = True
    return mask.reshape(scores.shape)


def sparse_kernel(kernel, layout: Layout, flat: FlatLinear | None = None):
    """The layout's blocks of a dense kernel: [C, K] -> [capacity, bs, bs], or a conv's
    [*kernel_size, C, K] -> [capacity, *kernel_size, bs, bs] (padding slots zero).
    With ``flat``, a general layer's [*in_shape, *out_shape] kernel, flattened first."""
    if flat is not None:
        kernel = flat.flat_kernel(kernel)
    return from_dense(kernel, layout) if np.ndim(kernel) == 2 else conv_from_dense(kernel, layout)


def dense_kernel(blocks, layout: Layout, flat: FlatLinear | None = None):
    """Back from :func:`sparse_kernel`: the dense kernel, zero outside the layout's blocks
    (with ``flat``, in the general layer's [*in_shape, *out_shape])."""
    kernel = to_dense(blocks, layout) if np.ndim(blocks) == 3 else conv_to_dense(blocks, layout)
    return kernel if flat is None else flat.general_kernel(kernel)


def block_axis_names(names, plan: LayerSparsity) -> tuple[tuple, str | None]:
    """The axis names of a converted kernel, from the dense kernel's, and why any were dropped.

    ``names`` name the dense kernel's axes (as ``nn.with_partitioning`` /
    ``nnx.with_partitioning`` give them): [C, K], a conv's [*kernel_size, C, K], or a
    general layer's [*in_shape, *out_shape]. The converted kernel is [capacity, bs, bs]
    (a conv's [capacity, *kernel_size, bs, bs]). The rule, so that every name is one
    the block layout honours:

    * the **capacity axis** takes the output axis's name (a general layer's leading
      output axis; its other output axes unnamed) when every output block column holds
      the same number of blocks and there are no padding slots. Slots are stored
      column by column, so a split of the slots into n equal runs is then a split of
      the output columns into n groups, as the dense kernel's output axis was split
      (when KB is a multiple of n). Otherwise it is unnamed (replicated);
      ``selection="column_balanced"`` keeps the same count in every column.
    * a conv's **tap axes** keep their names.
    * the **input axis** and the **block axes** are unnamed: a block is stored whole,
      so its rows (a split of the contraction) cannot be spread over devices.

    Returns:
      ``(new_names, dropped)``: the names of the converted kernel's axes, and None
      if every name of ``names`` was kept, else a sentence saying which were dropped
      and why.
    """
    names = tuple(names)
    flat = plan.flat
    n_in = len(flat.in_shape) if flat is not None else 1
    n_out = len(flat.out_shape) if flat is not None else 1
    taps = () if flat is not None else names[: len(names) - 2]
    in_names, out_names = names[len(names) - n_out - n_in : len(names) - n_out], names[len(names) - n_out :]
    mask = np.asarray(plan.mask)
    per_column = mask.sum(axis=0)
    capacity = int(mask.sum()) if plan.capacity is None else plan.capacity
    balanced = bool((per_column == per_column[0]).all()) and capacity == int(mask.sum())
    out_name = out_names[0] if out_names else None
    keep_out = out_name is not None and balanced and all(n is None for n in out_names[1:])
    new = ((out_name if keep_out else None), *taps, None, None)
    why = []
    if any(n is not None for n in in_names):
        why.append(f"input axis {in_names} unnamed: a block is stored whole, its rows are not split")
    if any(n is not None for n in out_names) and not keep_out:
        if not balanced:
            counts = sorted(set(per_column.tolist()))
            pad = "" if capacity == int(mask.sum()) else f", {capacity - int(mask.sum())} padding slots"
            cause = (
                f"output block columns hold {counts[0]} to {counts[-1]} blocks{pad} "
                "(selection='column_balanced' evens them)"
            )
        else:
            cause = "only the leading output axis can name the slots"
        why.append(f"output axis {out_names} unnamed: {cause}")
    return new, ("; ".join(why) or None)


def _check_density(density) -> float:
    if isinstance(density, bool) or not isinstance(density, (int, float, np.integer, np.floating)):
        raise TypeError(f"density must be a number in (0, 1], got {type(density).__name__} {density!r}")
    return budgets.check_density(density)


def _given_mask(path: str, mask, grid) -> np.ndarray:
    if isinstance(mask, jax.core.Tracer):
        raise TypeError(f"selection for {path!r}: the mask must be concrete (numpy), got a traced array")
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        if not np.issubdtype(array.dtype, np.integer) or not np.isin(array, (0, 1)).all():
            raise TypeError(f"selection for {path!r}: the mask must be boolean (or 0/1 integers), got {array.dtype}")
        array = array.astype(bool)
    if array.shape != tuple(grid):
        raise ValueError(
            f"selection for {path!r}: the mask must have the layer's block grid shape {tuple(grid)}, got {array.shape}"
        )
    if not array.any():
        raise ValueError(
            f"selection for {path!r}: the mask selects no block; keep the layer dense with keep_dense instead"
        )
    return array


def _top_blocks_per_column(scores: np.ndarray, count: int) -> np.ndarray:
    """bool mask of the largest scores of every output block column, the same number in
    each: ``count / KB`` rounded to a whole number, at least 1."""
    kb = scores.shape[1]
    per_column = min(scores.shape[0], max(1, round(count / kb)))
    rows = np.argsort(-scores, axis=0, kind="stable")[:per_column]
    mask = np.zeros(scores.shape, bool)
    mask[rows, np.arange(kb)[None, :]] = True
    return mask


#: The named selection rules: the largest blocks of the layer, or of every output block
#: column alike (which keeps a sharding of the output axis, see :func:`block_axis_names`).
RULES = ("magnitude", "column_balanced")


def _select(path: str, rule, scores: np.ndarray, count: int, layer_density: float):
    """The block mask of one layer from its selection rule."""
    if rule is None or (isinstance(rule, str) and rule == "magnitude"):
        return _top_blocks(scores, count)
    if isinstance(rule, str) and rule == "column_balanced":
        return _top_blocks_per_column(scores, count)
    if isinstance(rule, str):
        raise ValueError(f"selection for {path!r}: the named rules are {RULES}, got {rule!r}")
    if callable(rule):
        return _given_mask(path, rule(scores.shape, layer_density), scores.shape)
    return _given_mask(path, rule, scores.shape)


def plan_sparsity(
    candidates: Sequence[Candidate],
    density,
    block_size,
    *,
    distribution: str = "uniform",
    selection=None,
    keep_dense=None,
    dynamic: bool = False,
    capacity_factor: float = 1.0,
    norm: str = "l2",
    strict: bool = False,
) -> tuple[dict[str, LayerSparsity], SparsifyReport]:
    """Decides which candidates become block-sparse and with which blocks.

    Args:
      candidates: the model's dense and conv layers, in model order.
      density: the target density (fraction of the converted layers' weights
        kept), in (0, 1]; 1 keeps every block.
      block_size: the block edge, one of :data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`.
      distribution: ``"uniform"`` (every converted layer at ``density``) or
        ``"erk"`` (Erdos-Renyi(-Kernel): small layers denser, the same total).
      selection: which blocks: None or ``"magnitude"`` (the largest norms under the
        layer's budget, the default); ``"column_balanced"`` (the largest norms of
        every output block column, the same number in each, so a sharded output axis
        carries over: :func:`block_axis_names`); a callable ``fn(grid, density) -> bool mask``
        (e.g. ``functools.partial(jbs.layouts.random, seed=0)``) called with each
        layer's block grid and budget density; or a mapping ``{path: rule}`` whose
        rules are a bool mask [C // bs, K // bs], such a callable, or
        a named rule (layers not in it: magnitude). A given mask replaces the
        layer's budget.
      keep_dense: layers to leave dense: a glob pattern on the path, a sequence of
        them, or a callable ``fn(path) -> bool`` (see :func:`path_filter`).
      dynamic: give the converted layers a dynamic layout (for
        :mod:`jax_blocksparse.training`'s methods); layers that cannot have one
        (``Candidate.dynamic_reason``) get a static layout and a note.
      capacity_factor: a dynamic layer's capacity is
        ``min(grid blocks, ceil(blocks * capacity_factor))`` (>= 1; room for
        :class:`~jax_blocksparse.training.SparseMomentum` to move blocks in).
      norm: the block norm of the magnitude rule, ``"l2"`` or ``"l1"``.
      strict: raise a ValueError naming every layer that does not fit instead of
        leaving it dense (layers named by ``keep_dense`` are never an error).

    Returns:
      ``({path: LayerSparsity}, SparsifyReport)``: what to build for each converted
      layer, and the report of every candidate.
    """
    density = _check_density(density)
    block_size = check_block_size(block_size)
    if distribution not in budgets.DISTRIBUTIONS:
        raise ValueError(f"distribution must be one of {budgets.DISTRIBUTIONS}, got {distribution!r}")
    if norm not in select.NORMS:
        raise ValueError(f"norm must be one of {select.NORMS}, got {norm!r}")
    if not isinstance(dynamic, (bool, np.bool_)):
        raise TypeError(f"dynamic must be a bool, got {dynamic!r}")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor < 1:
        raise ValueError(f"capacity_factor must be a number >= 1, got {capacity_factor!r}")
    keep = path_filter(keep_dense)
    paths = [c.path for c in candidates]
    if len(set(paths)) != len(paths):
        raise ValueError(f"plan_sparsity: candidate paths must be unique, got {paths}")

    reasons = {}
    for c in candidates:
        if keep(c.path):
            reasons[c.path] = "keep_dense"
        else:
            reasons[c.path] = c.reason or shape_reason(c.kind, c.matrix_shape, block_size)
    unfit = {p: r for p, r in reasons.items() if r is not None and r != "keep_dense"}
    if strict and unfit:
        listed = "; ".join(f"{p}: {r}" for p, r in unfit.items())
        raise ValueError(f"sparsify(strict=True): {len(unfit)} layer(s) cannot be made block-sparse: {listed}")

    converted = [c for c in candidates if reasons[c.path] is None]
    rules = _check_selection(selection, {c.path: reasons[c.path] for c in candidates})

    grids = [(c.matrix_shape[-2] // block_size, c.matrix_shape[-1] // block_size) for c in converted]
    if converted:
        densities = (budgets.erk_densities if distribution == "erk" else budgets.uniform_densities)(
            [c.matrix_shape for c in converted], density
        )
        counts = budgets.allocate_blocks(densities, [cb * kb for cb, kb in grids])
    else:
        densities, counts = [], []

    plans, rows = {}, {}
    for c, grid, layer_density, count in zip(converted, grids, densities, counts):
        rule = rules(c.path)
        mask = _select(c.path, rule, block_scores(c.matrix, block_size, norm), int(count), float(layer_density))
        nnz, total = int(mask.sum()), grid[0] * grid[1]
        is_dynamic = bool(dynamic) and c.dynamic_reason is None
        capacity = min(total, max(nnz, math.ceil(nnz * float(capacity_factor) - 1e-9))) if is_dynamic else None
        plans[c.path] = LayerSparsity(StaticMask(mask), block_size, capacity, is_dynamic, c.flat)
        slots = nnz if capacity is None else capacity
        taps = math.prod(c.matrix_shape[:-2])
        note = f"static layout: {c.dynamic_reason}" if dynamic and c.dynamic_reason else None
        rows[c.path] = LayerReport(
            c.path,
            c.layer_type,
            c.shape,
            c.params,
            slots * block_size * block_size * taps + int(c.bias_size),
            block_size=block_size,
            blocks=nnz,
            grid_blocks=total,
            capacity=slots,
            dynamic=is_dynamic,
            note=note,
        )
    for c in candidates:
        if c.path not in rows:
            reason = reasons[c.path]
            reason = "matches keep_dense" if reason == "keep_dense" else reason
            rows[c.path] = LayerReport(c.path, c.layer_type, c.shape, c.params, c.params, reason=reason)
    report = SparsifyReport(tuple(rows[p] for p in paths), block_size, density, distribution)
    return plans, report


def _check_selection(selection, reasons: Mapping[str, str | None]) -> Callable[[str], Any]:
    """The selection argument checked: a function from a converted layer's path to its rule."""
    if selection is None or isinstance(selection, str) or callable(selection):
        if isinstance(selection, str) and selection not in RULES:
            raise ValueError(f"selection: the named rules are {RULES}, got {selection!r}")
        return lambda path: selection
    if isinstance(selection, Mapping):
        unknown = [p for p in selection if p not in reasons]
        if unknown:
            raise ValueError(
                f"selection names {unknown}, which are not dense or conv layers of the model; "
                f"its layers: {list(reasons)}"
            )
        dense = {p: reasons[p] for p in selection if reasons[p] is not None}
        if dense:
            listed = "; ".join(f"{p} ({'matches keep_dense' if r == 'keep_dense' else r})" for p, r in dense.items())
            raise ValueError(f"selection names layers that stay dense: {listed}")
        return lambda path: selection.get(path)
    raise TypeError(
        "selection must be None, 'magnitude', a callable(grid, density) -> mask, or a mapping {path: mask, "
        f"callable or 'magnitude'}}, got {type(selection).__name__}"
    )
