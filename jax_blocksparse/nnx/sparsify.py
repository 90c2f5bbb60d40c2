"""Sparsify a Flax NNX model in one call, and back: ``jbs.nnx.sparsify`` / ``jbs.nnx.densify``.

:func:`sparsify` returns a copy of the model in which every ``nnx.Linear`` and
``nnx.Conv`` that fits is a :class:`~jax_blocksparse.nnx.BlockSparseLinear` /
:class:`~jax_blocksparse.nnx.BlockSparseConv` holding the selected blocks of the
dense kernel; :func:`densify` turns every block-sparse linear and conv layer back
into the dense one, zeros outside the blocks. The decisions (what fits, the budget,
the blocks, the report) are the framework-neutral core's,
:mod:`jax_blocksparse.layers.sparsify`, shared with the linen entry points.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import general as _general
from jax_blocksparse.layers import sparsify as _core
from jax_blocksparse.layers.general import FlatLinear
from jax_blocksparse.nnx.conv import BlockSparseConv
from jax_blocksparse.nnx.linear import BlockSparseEinsum, BlockSparseLinear, BlockSparseLinearGeneral, StackedLayout

__all__ = ["densify", "sparsify"]


def _defaults(cls) -> dict:
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()}


#: The linear-like layers the report lists; the transposed convolution is listed and
#: left dense.
LINEAR_LIKE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.ConvTranspose)
_CONVERTIBLE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv)
# What a layer built with the defaults holds; a layer with another value computes
# something the block-sparse layer does not.
_DEFAULTS = {cls: _defaults(cls) for cls in _CONVERTIBLE}
_OPTIONS = {
    nnx.Linear: ("dot_general", "promote_dtype", "preferred_element_type"),
    nnx.LinearGeneral: ("dot_general", "dot_general_cls", "promote_dtype", "preferred_element_type"),
    nnx.Einsum: ("einsum_op", "promote_dtype", "preferred_element_type"),
    nnx.Conv: ("conv_general_dilated", "promote_dtype", "preferred_element_type"),
}


def _layer_ndim(layer, base) -> int:
    """The rank of one layer's kernel (a stacked one has more axes in front)."""
    if base is nnx.Linear:
        return 2
    if base is nnx.LinearGeneral:
        return len(layer.batch_axis) + len(layer.in_features) + len(layer.out_features)
    if base is nnx.Einsum:
        return len(layer.kernel_shape)
    return len(layer.kernel_size) + 2


def _describe(layer) -> tuple[str, FlatLinear | None, str | None, int]:
    """``(kind, flat, reason, stack)`` of a linear-like layer: "linear" or "conv"; how a
    general layer's kernel flattens to [C, K]; why it stays dense (None if it can
    convert); and the number of layers stacked on the kernel's leading axis (a layer
    created under ``nnx.vmap`` for ``nnx.scan``; 0 if not stacked)."""
    base = next(cls for cls in LINEAR_LIKE if isinstance(layer, cls))
    kind = "conv" if base in (nnx.Conv, nnx.ConvTranspose) else "linear"
    if base is nnx.ConvTranspose:
        return kind, None, "a transposed convolution (ConvTranspose) has no block-sparse counterpart in sparsify", 0
    if type(layer).__call__ is not base.__call__:
        return kind, None, f"{type(layer).__name__} overrides nnx.{base.__name__}.__call__", 0
    if base is nnx.Conv:
        if layer.feature_group_count != 1:
            return kind, None, f"feature_group_count={layer.feature_group_count} (grouped convolution)", 0
        if layer.mask is not None:
            return kind, None, "a kernel mask (mask=...)", 0
    reason = _core.non_default(layer, _DEFAULTS[base], _OPTIONS[base])
    shape = tuple(np.shape(layer.kernel[...]))
    extra = len(shape) - _layer_ndim(layer, base)
    stack = shape[0] if extra == 1 else 0
    if reason is None and extra and (extra != 1 or kind == "conv"):
        what = "a stacked convolution" if kind == "conv" else f"{extra} stacking axes"
        reason = f"its kernel {shape} has {what}; sparsify converts linear layers stacked once (nnx.vmap)"
    if reason:
        return kind, None, reason, 0
    shape = shape[1:] if stack else shape
    if base in (nnx.Linear, nnx.Conv):
        return kind, None, None, stack
    if base is nnx.LinearGeneral:
        flat, reason = _general.dense_general_shape(shape, layer.axis, tuple(layer.batch_axis))
    elif layer.einsum_str is None:
        flat, reason = None, "its equation is given at call time (einsum_str=None)"
    else:
        bias_shape = None if layer.bias is None else tuple(np.shape(layer.bias[...]))[1 if stack else 0 :]
        flat, reason = _general.einsum_shape(layer.einsum_str, shape, bias_shape)
    return kind, flat, reason and f"not one matrix product: {reason}", stack if not reason else 0


def _path(parts) -> str:
    return "/".join(str(p) for p in parts)


def _candidates(model):
    """[(Candidate, layer, stack)] for every linear-like layer of the model, in graph order.

    A stacked layer (``stack`` layers on its kernel's leading axis) gives one candidate
    per layer, at ``path[i]``: each gets its own budget, blocks and layout.
    """
    found = []
    for parts, node in nnx.iter_graph(model):
        if isinstance(node, LINEAR_LIKE):
            kind, flat, reason, stack = _describe(node)
            bias = 0 if node.bias is None else int(np.size(node.bias[...]))
            kernel = node.kernel[...]
            members = (
                [(_path(parts), kernel)] if not stack else [(f"{_path(parts)}[{i}]", kernel[i]) for i in range(stack)]
            )
            for path, member in members:
                candidate = _core.Candidate(
                    path,
                    kind,
                    type(node).__name__,
                    member,
                    bias // max(stack, 1),
                    reason,
                    dynamic_reason="BlockSparseConv has no dynamic layout" if kind == "conv" else None,
                    flat=flat,
                )
                found.append((candidate, node, stack))
    return found


def _replace_all(root, replacements: dict[int, object]):
    """Swaps every reference to an old layer (by id) for its new layer; returns the root.

    A layer reachable along several paths (a shared layer) is seen at one path per
    walk, so the walk repeats until no old layer is left.
    """
    if id(root) in replacements:
        return replacements[id(root)]
    for _ in range(len(replacements) + 1):
        found = [(parts, node) for parts, node in nnx.iter_graph(root) if id(node) in replacements and parts]
        if not found:
            return root
        for parts, node in found:
            _set_at(root, parts, replacements[id(node)])
    raise RuntimeError("sparsify: layers could not be replaced in the model graph")  # unreachable


def _child(parent, key):
    return parent[key] if isinstance(parent, (Mapping, Sequence)) else getattr(parent, key)


def _set_at(root, parts, value):
    """Sets the node at path ``parts`` of ``root`` (attributes, list and dict items; a tuple is rebuilt)."""
    parent = root
    for key in parts[:-1]:
        parent = _child(parent, key)
    key = parts[-1]
    if isinstance(parent, tuple):
        items = list(parent)
        items[key] = value
        _set_at(root, parts[:-1], type(parent)(*items) if hasattr(parent, "_fields") else type(parent)(items))
    elif isinstance(parent, (MutableMapping, MutableSequence)):
        parent[key] = value
    else:
        setattr(parent, key, value)


def _constant(value):
    """An initializer that returns ``value`` (the layers call it with a key, a shape and a dtype)."""
    return lambda *_: value


#: The metadata keys under which a Flax version keeps a variable's axis names.
_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")
#: Where a converted kernel keeps the dense kernel's names, for densify.
_DENSE_PREFIX = "dense_"


def _carry_metadata(old, new, plan: _core.LayerSparsity | None, stacked: bool = False) -> str | None:
    """``new`` gets ``old``'s variable metadata (``kernel_metadata``, ``nnx.with_partitioning``).

    With ``plan`` (sparsify), axis names become the block kernel's
    (:func:`~jax_blocksparse.layers.sparsify.block_axis_names`) and the dense ones are
    kept beside them; without (densify), the kept dense names come back. The value is
    placed on the mesh the old one was on; a stacked kernel's leading (layer) axis keeps
    its name. Returns the names dropped (None if none).
    """
    metadata, dropped = dict(old.get_metadata()), None
    for key in _SHARDING_KEYS:
        names = metadata.get(key)
        if plan is not None and isinstance(names, (tuple, list)) and len(names) == np.ndim(old[...]):
            lead = tuple(names[:1]) if stacked else ()
            block_names, dropped = _core.block_axis_names(names[len(lead) :], plan)
            metadata[key] = lead + tuple(block_names)
            metadata[_DENSE_PREFIX + key] = tuple(names)
        elif plan is None and _DENSE_PREFIX + key in metadata:
            metadata[key] = metadata.pop(_DENSE_PREFIX + key)
    new.set_metadata(**metadata)
    sharding = getattr(old[...], "sharding", None)
    names = next((metadata[k] for k in _SHARDING_KEYS if isinstance(metadata.get(k), (tuple, list))), None)
    if isinstance(sharding, NamedSharding) and names is not None and len(names) == np.ndim(new[...]):
        if all(n is None or n in sharding.mesh.axis_names for n in names):
            new.set_value(jax.device_put(new[...], NamedSharding(sharding.mesh, P(*names))))
    return dropped


def _block_sparse(layer, plan: _core.LayerSparsity, impl, stacked=None):
    """The block-sparse layer holding the selected blocks of ``layer`` (a converted
    nnx.Linear, nnx.LinearGeneral, nnx.Einsum or nnx.Conv), and the axis names its
    kernel dropped. ``stacked``: for a stacked layer, the plans of its layers (``plan``
    is then the first layer's, with the stack's capacity and a dynamic layout)."""
    layout = plan.layout
    # On the host: a kernel sharded over an explicit mesh has no reshape into blocks.
    dense = np.asarray(layer.kernel[...])
    bias = None if layer.bias is None else layer.bias[...]
    if stacked:
        layouts = [_common.layout_for(p.mask, p.block_size, plan.capacity) for p in stacked]
        kernel = np.stack([np.asarray(_core.sparse_kernel(w, l, plan.flat)) for w, l in zip(dense, layouts)])
        layout = jax.tree.map(lambda *tables: np.stack(tables), *layouts)
    else:
        kernel = _core.sparse_kernel(dense, layout, plan.flat)
    common = dict(
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        kernel_init=_constant(kernel[0] if stacked else kernel),
        bias_init=_constant(None if bias is None else (bias[0] if stacked else bias)),
        capacity=plan.capacity,
        impl=impl,
        rngs=nnx.Rngs(0),
    )
    if isinstance(layer, nnx.Conv):
        new = BlockSparseConv(
            layer.in_features,
            layer.out_features,
            layer.kernel_size,
            plan.mask,
            plan.block_size,
            layer.strides,
            padding=layer.padding,
            input_dilation=layer.input_dilation,
            kernel_dilation=layer.kernel_dilation,
            use_bias=bias is not None,
            **common,
        )
    elif isinstance(layer, nnx.Einsum):
        new = BlockSparseEinsum(
            layer.einsum_str,
            plan.flat.kernel_shape,
            None if bias is None else plan.flat.out_shape,
            plan.mask,
            plan.block_size,
            dynamic=plan.dynamic,
            **common,
        )
    elif isinstance(layer, nnx.LinearGeneral):
        in_shape, out_shape = plan.flat
        new = BlockSparseLinearGeneral(
            in_shape, out_shape, plan.mask, plan.block_size, use_bias=bias is not None, dynamic=plan.dynamic, **common
        )
    else:
        new = BlockSparseLinear(
            layer.in_features,
            layer.out_features,
            plan.mask,
            plan.block_size,
            use_bias=bias is not None,
            dynamic=plan.dynamic,
            **common,
        )
    if stacked:  # the layer-0 layer built above, given the whole stack
        new.kernel.set_value(jnp.asarray(kernel))
        new.kernel_layout = StackedLayout(layout)
        if bias is not None:
            new.bias.set_value(bias)
    dropped = _carry_metadata(layer.kernel, new.kernel, plan, stacked=bool(stacked))
    if bias is not None:
        _carry_metadata(layer.bias, new.bias, None)
    return new, dropped


@attribute_docs.fill
def sparsify(
    model,
    density,
    block_size: int,
    *,
    distribution: str = "uniform",
    selection=None,
    keep_dense=None,
    dynamic: bool = False,
    capacity_factor: float = 1.0,
    norm: str = "l2",
    impl: str | None = None,
    strict: bool = False,
):
    """A block-sparse copy of an NNX model: its dense and conv layers hold their selected blocks.

    Every ``nnx.Linear`` becomes a :class:`~jax_blocksparse.nnx.BlockSparseLinear`
    and every ``nnx.Conv`` a :class:`~jax_blocksparse.nnx.BlockSparseConv` when it
    fits (input and output features multiples of ``block_size``; the default
    ``dot_general`` / ``conv_general_dilated`` and ``promote_dtype``; no
    ``preferred_element_type``; a conv: ``feature_group_count=1``, no ``mask``).
    The new layer stores the selected blocks of the dense kernel, so at density 1
    it computes what the dense layer does, and at density d what the dense layer
    does with the unselected blocks zeroed. Bias, ``dtype``, ``param_dtype``,
    ``precision``, strides, padding and dilations carry over. Everything else of the
    model (other layers, shared references, rngs, batch statistics) is kept; the
    input model is not changed.

    Args:
      model: an ``nnx.Module`` (or any nnx graph node) with concrete weights.
      {density, block_size, distribution}
      selection: which blocks each layer keeps: by default (None, ``"magnitude"``)
        those of largest norm under its budget; a callable ``fn(grid, density) ->
        bool mask``; or ``{path: mask | callable | "magnitude"}`` per layer (see
        :func:`~jax_blocksparse.layers.sparsify.plan_sparsity`).
      {keep_dense}
      dynamic: give the converted linear layers a dynamic layout (a
        :class:`~jax_blocksparse.nnx.BlockLayout` variable of fixed capacity), so
        :func:`~jax_blocksparse.training.nnx_update` with RigL, SET, sparse momentum
        or magnitude pruning continues from them. Conv layers keep a static layout.
      {capacity_factor, norm, sparsify.impl, strict}

    Returns:
      ``(sparse_model, report)``: the converted copy and a
      :class:`~jax_blocksparse.layers.sparsify.SparsifyReport` (``print(report)`` shows each
      layer's path, kernel shape, density and parameters before and after, and the
      layers left dense with their reason).

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> class MLP(nnx.Module):
        ...     def __init__(self, rngs):
        ...         self.fc1 = nnx.Linear(64, 128, rngs=rngs)
        ...         self.fc2 = nnx.Linear(128, 10, rngs=rngs)
        ...     def __call__(self, x):
        ...         return self.fc2(nnx.relu(self.fc1(x)))
        >>> model = MLP(nnx.Rngs(0))
        >>> sparse, report = jbs.nnx.sparsify(model, 0.25, 16)
        >>> type(sparse.fc1).__name__, sparse.fc1.kernel.shape    # 8 of 32 blocks
        ('BlockSparseLinear', (8, 16, 16))
        >>> report.left_dense
        {'fc2': 'output features 10 not a multiple of block_size 16'}
        >>> sparse(jnp.ones((2, 64))).shape
        (2, 10)
    """
    found = _candidates(model)
    plans, report = _core.plan_sparsity(
        [c for c, _, _ in found],
        density,
        block_size,
        distribution=distribution,
        selection=selection,
        keep_dense=keep_dense,
        dynamic=dynamic,
        capacity_factor=capacity_factor,
        norm=norm,
        strict=strict,
    )
    model = nnx.clone(model)
    # The clone holds new layer objects: find them again, by path.
    layers = {_path(parts): node for parts, node in nnx.iter_graph(model) if isinstance(node, _CONVERTIBLE)}
    replacements, dropped = {}, {}
    for path, plan in plans.items():
        if path in layers:  # not a member of a stack
            replacements[id(layers[path])], dropped[path] = _block_sparse(layers[path], plan, impl)
    for path, stack in _stacks(found).items():
        members = [plans.get(f"{path}[{i}]") for i in range(stack)]
        if not any(members):
            continue
        if not all(members):
            dense = [f"{path}[{i}]" for i, p in enumerate(members) if p is None]
            raise ValueError(
                f"sparsify: the layers of the stacked {path!r} must all convert or all stay dense (one array "
                f"holds them), but {dense} stay dense: name the whole stack in keep_dense ({path!r}[*]) or none of it"
            )
        capacity = max(int(np.asarray(p.mask).sum()) for p in members)
        first = dataclasses.replace(members[0], capacity=capacity, dynamic=True)
        replacements[id(layers[path])], lost = _block_sparse(layers[path], first, impl, stacked=members)
        dropped.update({f"{path}[{i}]": lost for i in range(stack)})
    return _replace_all(model, replacements), report.with_partitioning(dropped)


def _stacks(found) -> dict[str, int]:
    """``{path: number of layers}`` of the stacked layers among the candidates."""
    return {c.path.rsplit("[", 1)[0]: stack for c, _, stack in found if stack}


def _dense(layer):
    """The nnx.Linear / LinearGeneral / Einsum / Conv equal to a block-sparse layer."""
    flat = getattr(layer, "flat", None)
    blocks = np.asarray(layer.kernel[...])
    if isinstance(layer, BlockSparseLinear) and blocks.ndim == 4:  # stacked: one layout per layer
        kernel = jax.vmap(lambda b, layout: _core.dense_kernel(b, layout, flat))(blocks, layer.layout)
    else:
        kernel = _core.dense_kernel(blocks, layer.layout, flat)
    bias = None if layer.bias is None else layer.bias[...]
    common = dict(
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        kernel_init=_constant(kernel),
        rngs=nnx.Rngs(0),
    )
    if bias is not None:
        common["bias_init"] = _constant(bias)
    if isinstance(layer, BlockSparseConv):
        dense = nnx.Conv(
            layer.in_features,
            layer.out_features,
            layer.kernel_size,
            layer.strides,
            padding=layer.padding,
            input_dilation=layer.input_dilation,
            kernel_dilation=layer.kernel_dilation,
            use_bias=bias is not None,
            **common,
        )
    elif isinstance(layer, BlockSparseEinsum):
        dense = nnx.Einsum(layer.einsum_str, layer.kernel_shape, layer.bias_shape, **common)
    elif isinstance(layer, BlockSparseLinearGeneral):
        dense = nnx.LinearGeneral(flat.in_shape, flat.out_shape, axis=layer.axis, use_bias=bias is not None, **common)
    else:
        dense = nnx.Linear(layer.in_features, layer.out_features, use_bias=bias is not None, **common)
    _carry_metadata(layer.kernel, dense.kernel, None)
    if bias is not None:
        _carry_metadata(layer.bias, dense.bias, None)
    return dense


def densify(model):
    """A dense copy of an NNX model: its block-sparse linear and conv layers made dense.

    Every :class:`~jax_blocksparse.nnx.BlockSparseLinear` becomes an ``nnx.Linear``
    and every :class:`~jax_blocksparse.nnx.BlockSparseConv` an ``nnx.Conv`` whose
    kernel is the block-sparse one (a dynamic layer's current layout) with zeros
    outside its blocks: the model computes what it computed. Bias, ``dtype``,
    ``param_dtype``, ``precision``, strides, padding and dilations carry over
    (``impl`` and ``float32_dw`` have no dense counterpart). The input model is
    not changed.

    Example::

        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> model = nnx.Sequential(nnx.Linear(32, 32, rngs=nnx.Rngs(0)))
        >>> sparse, _ = jbs.nnx.sparsify(model, 0.5, 16)
        >>> dense = jbs.nnx.densify(sparse)
        >>> type(dense.layers[0]).__name__, dense.layers[0].kernel.shape
        ('Linear', (32, 32))
    """
    model = nnx.clone(model)
    sparse = [node for _, node in nnx.iter_graph(model) if isinstance(node, (BlockSparseLinear, BlockSparseConv))]
    replacements = {id(node): _dense(node) for node in sparse}
    return _replace_all(model, replacements)
