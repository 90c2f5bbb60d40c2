"""Sharding rules for the bsmm and bsconv primitives: partition the op, never gather its operands.

Under ``jit`` with sharded inputs (``NamedSharding`` on a ``Mesh``) XLA's SPMD
partitioner splits the program across devices. It can split the pure-JAX reference
lowering by itself, but not an opaque custom call (the CUDA kernels, native CPU
kernels): those it would run on replicated, all-gathered operands. This module gives
every lowering of the three bsmm primitives the same explicit rule, through the
public :func:`jax.experimental.custom_partitioning`:

=======  ===================================  ======================================
prim     operands                             per-device program
=======  ===================================  ======================================
fprop    a [..., C] sharded on its leading    the same primitive on the local rows;
bprop    dims; w and the layout replicated    out [..., K] sharded like a's rows
updat    a [..., C], b [..., K], leading dims the same primitive on the local rows
         sharded alike                        (float32), then ``psum`` over the mesh
                                              axes of the leading dims; out replicated
bsconv   as fprop, split over N (dim 0) only  as fprop (the window crosses the
         (a [N, *spatial, C])                 spatial dims, which stay whole)
bsconv_  as updat, split over N only          as updat
wgrad
=======  ===================================  ======================================

The feature dimension of a (and of b) is gathered if it was sharded (the kernels
need whole rows); so are w and the tables (model-parallel weights are
:mod:`jax_blocksparse.sharding`'s business, with ``shard_map``).

How: :func:`partitioned` wraps any lowering rule of a primitive. When the lowering
context is an SPMD program over several known devices, the wrapped rule emits a
``custom_partitioning`` call whose per-device body binds the *same primitive* again;
that body is lowered with every mesh axis manual, where the wrapped rule lowers
directly. So the per-shard program takes exactly the path (reference, CPU or CUDA
kernels) the primitive would take on one device. Everywhere else (one device,
``pmap``, inside ``shard_map``) the wrapped rule lowers directly, at no cost.

``custom_partitioning`` needs the program's devices at lowering time, which JAX only
provides when the traced program contains a ``custom_partitioning`` call.
:func:`mark_partitioned` records a trivial one (identity on a constant scalar) when an
operand's type carries a multi-device mesh, i.e. inside ``jit`` with sharded inputs;
the library calls it at every bind.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_blocksparse.layout import LayoutTables

# Primitives whose leading dims are contracted (the result is weight-shaped).
_CONTRACTING = frozenset({"bsmm_updat", "bsconv_wgrad"})
# Primitives split over their first dim only (a convolution's window crosses the spatial
# dims); the bsmm ones over all dims of a but the last.
_BATCH_ONLY = frozenset({"bsconv", "bsconv_wgrad"})
_PARTITIONED = frozenset({"bsmm_fprop", "bsmm_bprop", "bsmm_updat"}) | _BATCH_ONLY
_NUM_TABLES = len(LayoutTables._fields)


# ---------------------------------------------------------------------------------
# When to partition
# ---------------------------------------------------------------------------------


def _spmd_devices(ctx) -> int:
    """How many devices the program being lowered is automatically partitioned over.

    0 (lower directly) for one device, ``pmap`` (a replica context), a ``shard_map``
    body (its manual axes are already split by hand; any automatic ones are left to
    XLA) and a program whose devices JAX has not resolved (one without a
    ``custom_partitioning`` call: see :func:`mark_partitioned`).
    """
    axis_context = ctx.module_context.axis_context
    if getattr(axis_context, "manual_axes", None) is not None:  # inside shard_map
        return 0
    devices = getattr(axis_context, "device_assignment", None)
    return len(devices) if devices is not None and len(devices) > 1 else 0


def _multi_device_mesh(aval) -> bool:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
        return False
    manual = getattr(jax.sharding.AxisType, "Manual", None)
    return any(t != manual for t in getattr(mesh, "axis_types", ()))


def _replicated_scalar_partition(mesh, arg_shapes, result_shape):
    replicated = NamedSharding(mesh, P())
    return mesh, lambda z: z, replicated, (replicated,)


# Identity on an int32 scalar: the custom_partitioning call that mark_partitioned records.
_marker = custom_partitioning(lambda z: z)
_marker.def_partition(
    _replicated_scalar_partition,
    infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: NamedSharding(mesh, P()),
    sharding_rule=SdyShardingRule(operand_mappings=((),), result_mappings=((),)),
)


def mark_partitioned(operands: list) -> list:
    """Makes the program being traced ready for :func:`partitioned` lowerings.

    Call on a primitive's operands ``[a, b, *tables]`` before binding it. Unless an
    operand's type carries a mesh of several devices with an automatic (non-manual)
    axis, as inside ``jit`` of sharded arrays, returns them unchanged. Otherwise adds
    the (zero) result of a trivial ``custom_partitioning`` call to ``col_ptr``: that
    call makes JAX resolve the program's devices before lowering, which
    ``custom_partitioning`` needs, and using its result keeps it from being pruned.
    It is an identity on a constant, so it passes through vmap and differentiation
    (the tables are integers), and costs one scalar add.
    """
    if not any(_multi_device_mesh(jax.typeof(o)) for o in operands[:2]):
        return list(operands)
    a, b, block_rows, block_cols, col_ptr, *rest = operands
    zero = _marker(np.zeros((), np.int32))
    return [a, b, block_rows, block_cols, col_ptr + zero.astype(col_ptr.dtype), *rest]


# ---------------------------------------------------------------------------------
# The rule
# ---------------------------------------------------------------------------------


def _spec(sharding, ndim: int):
    """The PartitionSpec of ``sharding`` padded to ``ndim`` entries, or None if not named."""
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _axes(entries) -> tuple[str, ...]:
    """Mesh axis names used by PartitionSpec entries (None, a name or a tuple of names)."""
    names = []
    for e in entries:
        if e is None:
            continue
        names.extend(e if isinstance(e, tuple) else (e,))
    return tuple(names)


def _leading_spec(a, ndim: int, n_lead: int):
    """The spec entries of a's ``n_lead`` leading dims (kept), or all None if a's sharding is not named."""
    spec = _spec(a.sharding, ndim)
    return spec[:n_lead] if spec is not None else (None,) * n_lead


def _num_leading(name: str, ndim_a: int) -> int:
    return 1 if name in _BATCH_ONLY else ndim_a - 1


def _sharding_rule(name: str, ranks: tuple[int, int, int]) -> tuple[str, dict]:
    """Shardy rule: leading dims free (contracted for updat / wgrad), every other dim
    replicated. ``ranks``: of a, of the second float operand, of the result."""
    ndim_a, ndim_b, ndim_out = ranks
    n_lead = _num_leading(name, ndim_a)
    lead = [f"n{i}" for i in range(n_lead)]
    tables = [f"t{i}" for i in range(_NUM_TABLES)]
    lhs = lead + [f"a{i}" for i in range(ndim_a - n_lead)]
    if name in _CONTRACTING:
        operands, result = [lhs, lead + [f"b{i}" for i in range(ndim_b - n_lead)]], [f"w{i}" for i in range(ndim_out)]
    else:
        operands, result = [lhs, [f"w{i}" for i in range(ndim_b)]], lead + [f"o{i}" for i in range(ndim_out - n_lead)]
    operands += [[t] for t in tables]
    rule = ", ".join(" ".join(o) for o in operands) + " -> " + " ".join(result)
    # Special factors are listed in the order of their first appearance in the rule.
    order = list(dict.fromkeys(f for o in operands + [result] for f in o))
    extra = {"need_replication_factors": tuple(f for f in order if f not in lead)}
    if name in _CONTRACTING and lead:
        extra["reduction_factors"] = tuple(lead)
    return rule, extra


def _partition_rule(primitive, params: dict, ranks: tuple[int, int, int]):
    name = primitive.name
    contracting = name in _CONTRACTING
    ndim_a, ndim_b, ndim_out = ranks
    n_lead = _num_leading(name, ndim_a)

    def bind(*operands, **overrides):
        return primitive.bind(*operands, **{**params, **overrides})

    def shardings(mesh, arg_shapes):
        """(leading spec, operand shardings, result sharding) from a's sharding."""
        lead = _leading_spec(arg_shapes[0], ndim_a, n_lead)
        replicated = NamedSharding(mesh, P())

        def rows(ndim):
            return NamedSharding(mesh, P(*lead, *(None,) * (ndim - n_lead)))

        if contracting:  # b's rows must be split like a's
            return lead, (rows(ndim_a), rows(ndim_b), *([replicated] * _NUM_TABLES)), replicated
        return lead, (rows(ndim_a), replicated, *([replicated] * _NUM_TABLES)), rows(ndim_out)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        return shardings(mesh, arg_shapes)[2]

    def partition(mesh, arg_shapes, result_shape):
        lead, arg_shardings, out_sharding = shardings(mesh, arg_shapes)
        if not contracting:
            return mesh, bind, out_sharding, arg_shardings
        axes = _axes(lead)
        out_dtype = np.dtype(params["out_dtype"])

        def local_then_sum(*operands):
            partial = bind(*operands, out_dtype=np.dtype(np.float32))
            if axes:
                partial = jax.lax.psum(partial, axes)
            return partial.astype(out_dtype)

        return mesh, local_then_sum, out_sharding, arg_shardings

    cp = custom_partitioning(bind)
    rule, extra = _sharding_rule(name, ranks)
    cp.def_partition(
        partition,
        infer_sharding_from_operands=infer_sharding_from_operands,
        sharding_rule=rule,
        **extra,
    )
    return cp


def partitioned(primitive, rule: Callable) -> Callable:
    """Wraps a lowering ``rule`` of a bsmm ``primitive`` with the sharding rule above.

    Args:
      primitive: ``bsmm_fprop``, ``bsmm_bprop``, ``bsmm_updat``, ``bsconv`` or
        ``bsconv_wgrad`` (by name): operands ``a, b`` and the layout's tables
        (:class:`~jax_blocksparse.layout.LayoutTables`).
      rule: a lowering rule ``(ctx, *operands, **params) -> results``: the reference,
        the CPU or the CUDA kernel lowering.

    Returns:
      A lowering rule: ``rule`` itself where the program is not automatically
      partitioned; otherwise a ``custom_partitioning`` call whose per-device body
      binds ``primitive`` again (and so reaches ``rule`` on the local shards).
    """
    if primitive.name not in _PARTITIONED:
        raise ValueError(f"partitioned: no sharding rule for primitive {primitive.name!r}")

    @functools.wraps(rule)
    def wrapped(ctx, *operands, **params):
        if not _spmd_devices(ctx):
            return rule(ctx, *operands, **params)
        ranks = (len(ctx.avals_in[0].shape), len(ctx.avals_in[1].shape), len(ctx.avals_out[0].shape))
        cp = _partition_rule(primitive, params, ranks)
        return mlir.lower_fun(lambda *ops: cp(*ops), multiple_results=False)(ctx, *operands)

    return wrapped


__all__ = ["mark_partitioned", "partitioned"]
