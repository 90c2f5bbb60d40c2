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

import inspect
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence

import numpy as np
from flax import nnx

from jax_blocksparse.layers import sparsify as _core
from jax_blocksparse.nnx.conv import BlockSparseConv
from jax_blocksparse.nnx.linear import BlockSparseLinear

__all__ = ["densify", "sparsify"]


def _defaults(cls) -> dict:
    return {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()}


# What a layer built with the defaults holds; a layer with another value computes
# something the block-sparse layer does not.
_LINEAR_DEFAULTS = _defaults(nnx.Linear)
_CONV_DEFAULTS = _defaults(nnx.Conv)


def _linear_reason(layer: nnx.Linear) -> str | None:
    if type(layer).__call__ is not nnx.Linear.__call__:
        return f"{type(layer).__name__} overrides nnx.Linear.__call__"
    return _core.non_default(layer, _LINEAR_DEFAULTS, ("dot_general", "promote_dtype", "preferred_element_type"))


def _conv_reason(layer: nnx.Conv) -> str | None:
    if type(layer).__call__ is not nnx.Conv.__call__:
        return f"{type(layer).__name__} overrides nnx.Conv.__call__"
    if layer.feature_group_count != 1:
        return f"feature_group_count={layer.feature_group_count} (grouped convolution)"
    if layer.mask is not None:
        return "a kernel mask (mask=...)"
    return _core.non_default(layer, _CONV_DEFAULTS, ("conv_general_dilated", "promote_dtype", "preferred_element_type"))


def _path(parts) -> str:
    return "/".join(str(p) for p in parts)


def _candidates(model):
    """[(Candidate, layer)] for every nnx.Linear / nnx.Conv of the model, in graph order."""
    found = []
    for parts, node in nnx.iter_graph(model):
        if isinstance(node, (nnx.Linear, nnx.Conv)):
            conv = isinstance(node, nnx.Conv)
            reason = _conv_reason(node) if conv else _linear_reason(node)
            bias = 0 if node.bias is None else int(np.size(node.bias[...]))
            candidate = _core.Candidate(
                _path(parts),
                "conv" if conv else "linear",
                type(node).__name__,
                node.kernel[...],
                bias,
                reason,
                dynamic_reason="BlockSparseConv has no dynamic layout" if conv else None,
            )
            found.append((candidate, node))
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


def _block_sparse(layer, plan: _core.LayerSparsity, impl):
    """The block-sparse layer holding the selected blocks of ``layer`` (nnx.Linear or nnx.Conv)."""
    layout = plan.layout
    kernel = _core.sparse_kernel(layer.kernel[...], layout)
    bias = None if layer.bias is None else layer.bias[...]
    common = dict(
        use_bias=bias is not None,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        kernel_init=_constant(kernel),
        bias_init=_constant(bias),
        capacity=plan.capacity,
        impl=impl,
        rngs=nnx.Rngs(0),
    )
    if isinstance(layer, nnx.Conv):
        return BlockSparseConv(
            layer.in_features,
            layer.out_features,
            layer.kernel_size,
            plan.mask,
            plan.block_size,
            layer.strides,
            padding=layer.padding,
            input_dilation=layer.input_dilation,
            kernel_dilation=layer.kernel_dilation,
            **common,
        )
    return BlockSparseLinear(
        layer.in_features, layer.out_features, plan.mask, plan.block_size, dynamic=plan.dynamic, **common
    )


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
      density: the target fraction of the converted layers' weights, in (0, 1].
      block_size: the block edge, one of 8, 16, 32, 64, 128.
      distribution: the per-layer budget, ``"uniform"`` or ``"erk"``.
      selection: which blocks each layer keeps: by default (None, ``"magnitude"``)
        those of largest norm under its budget; a callable ``fn(grid, density) ->
        bool mask``; or ``{path: mask | callable | "magnitude"}`` per layer (see
        :func:`~jax_blocksparse.layers.sparsify.plan_sparsity`).
      keep_dense: layers to leave dense (the embedding, the classifier): a glob
        pattern on the "/"-joined path (``"head"``, ``"blocks/*/out"``), a sequence of
        them, or a callable ``fn(path) -> bool``.
      dynamic: give the converted linear layers a dynamic layout (a
        :class:`~jax_blocksparse.nnx.BlockLayout` variable of fixed capacity), so
        :func:`~jax_blocksparse.training.nnx_update` with RigL, SET, sparse momentum
        or magnitude pruning continues from them. Conv layers keep a static layout.
      capacity_factor: a dynamic layer's capacity over its blocks (>= 1; sparse
        momentum moves blocks between layers and needs room: e.g. 1.5).
      norm: the block norm of the magnitude rule, ``"l2"`` or ``"l1"``.
      impl: the converted layers' ``impl`` (None: :mod:`jax_blocksparse.config`'s default).
      strict: raise a ValueError naming every layer that does not fit, instead of
        leaving it dense and listing it in the report.

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
        [c for c, _ in found],
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
    layers = {_path(parts): node for parts, node in nnx.iter_graph(model) if isinstance(node, (nnx.Linear, nnx.Conv))}
    replacements = {id(layers[path]): _block_sparse(layers[path], plan, impl) for path, plan in plans.items()}
    return _replace_all(model, replacements), report


def _dense(layer):
    """The nnx.Linear / nnx.Conv equal to a BlockSparseLinear / BlockSparseConv."""
    kernel = _core.dense_kernel(layer.kernel[...], layer.layout)
    bias = None if layer.bias is None else layer.bias[...]
    common = dict(
        use_bias=bias is not None,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
        precision=layer.precision,
        kernel_init=_constant(kernel),
        rngs=nnx.Rngs(0),
    )
    if bias is not None:
        common["bias_init"] = _constant(bias)
    if isinstance(layer, BlockSparseConv):
        return nnx.Conv(
            layer.in_features,
            layer.out_features,
            layer.kernel_size,
            layer.strides,
            padding=layer.padding,
            input_dilation=layer.input_dilation,
            kernel_dilation=layer.kernel_dilation,
            **common,
        )
    return nnx.Linear(layer.in_features, layer.out_features, **common)


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
