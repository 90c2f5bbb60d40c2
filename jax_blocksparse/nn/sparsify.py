"""Sparsify an unmodified Flax linen model in one call, and back: ``jbs.nn.sparsify`` / ``jbs.nn.densify``.

A linen model's layers are created by its own code (often inline, in ``nn.compact``
methods), so they cannot be swapped from outside. :func:`sparsify` leaves the
model's code alone: it returns a :class:`SparsifiedModule` that applies the model
under Flax's method interception (``nn.intercept_methods``), and every selected
``nn.Dense`` / ``nn.Conv`` call is answered by the block-sparse layer core
(:mod:`jax_blocksparse.layers`) reading its parameters at the same path: the kernel
as the stored blocks, [capacity, bs, bs] (a conv's [capacity, *kernel_size, bs, bs]),
the bias as it was. :func:`densify` gives the dense model's variables back. The
decisions (what fits, the budget, the blocks, the report) are the framework-neutral
core's, :mod:`jax_blocksparse.layers.sparsify`, shared with the NNX entry points.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import conv as _conv
from jax_blocksparse.layers import dense as _dense
from jax_blocksparse.layers import general as _general
from jax_blocksparse.layers import sparsify as _core
from jax_blocksparse.nn.dense import LAYOUT_COLLECTION

__all__ = ["SparsifiedModule", "densify", "sparsify"]

#: The linear-like layers the report lists: the first four convert when they fit; the
#: transposed and unshared-weight convolutions are listed, and left dense.
LINEAR_LIKE = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv, nn.ConvTranspose, nn.ConvLocal)
_CONVERTIBLE = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Conv)
_DEFAULTS = {cls: {f.name: f.default for f in dataclasses.fields(cls)} for cls in _CONVERTIBLE}
_PRODUCT_OPTIONS = ("dot_general", "dot_general_cls", "promote_dtype", "preferred_element_type")
_CONV_OPTIONS = ("conv_general_dilated", "conv_general_dilated_cls", "promote_dtype", "preferred_element_type")


def _base(module) -> type | None:
    """The linear-like Flax class ``module`` is (the first of :data:`LINEAR_LIKE`)."""
    return next((cls for cls in LINEAR_LIKE if isinstance(module, cls)), None)


def _describe(module, kernel_shape, call: Mapping) -> tuple[str, _general.FlatLinear | None, str | None]:
    """``(kind, flat, reason)`` of a linear-like module seen in a call: "linear" or "conv";
    how a general layer's kernel flattens to [C, K]; why it cannot be answered by the
    block-sparse core (None if it can)."""
    base = _base(module)
    kind = "linear" if base in (nn.Dense, nn.DenseGeneral, nn.Einsum) else "conv"
    if base not in _CONVERTIBLE:
        what = "a transposed convolution" if base is nn.ConvTranspose else "an unshared-weight convolution"
        return kind, None, f"{what} ({base.__name__}) has no block-sparse counterpart in sparsify"
    if type(module).__call__ is not base.__call__:
        return kind, None, f"{type(module).__name__} overrides {base.__name__}.__call__"
    if base is nn.Conv:
        if module.feature_group_count != 1:
            return kind, None, f"feature_group_count={module.feature_group_count} (grouped convolution)"
        if module.mask is not None:
            return kind, None, "a kernel mask (mask=...)"
        return kind, None, _core.non_default(module, _DEFAULTS[base], _CONV_OPTIONS)
    reason = _core.non_default(module, _DEFAULTS[base], _PRODUCT_OPTIONS)
    if reason or base is nn.Dense or kernel_shape is None:
        return kind, None, reason
    if base is nn.DenseGeneral:
        flat, reason = _general.dense_general_shape(kernel_shape, module.axis, module.batch_dims, call["ndim"])
    else:
        bias_shape = call["bias_shape"] if module.use_bias else None
        flat, reason = _general.einsum_shape(call["einsum_str"] or "", kernel_shape, bias_shape)
    return kind, flat, reason and f"not one matrix product: {reason}"


def _lookup(tree, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _with(tree, path: tuple[str, ...], value):
    """A copy of the nested dict ``tree`` with ``value`` at ``path`` (dicts copied along the path)."""
    tree = dict(tree) if tree is not None else {}
    if len(path) == 1:
        tree[path[0]] = value
    else:
        tree[path[0]] = _with(tree.get(path[0]), path[1:], value)
    return tree


def _without(tree, path: tuple[str, ...]):
    """A copy of ``tree`` without the entry at ``path``, dropping dicts left empty."""
    if not isinstance(tree, Mapping) or path[0] not in tree:
        return tree
    tree = dict(tree)
    if len(path) == 1:
        del tree[path[0]]
    else:
        child = _without(tree[path[0]], path[1:])
        if child:
            tree[path[0]] = child
        else:
            del tree[path[0]]
    return tree


@dataclasses.dataclass(frozen=True)
class SparsifiedModule:
    """An unmodified linen module applied with block-sparse dense and conv layers.

    Made by :func:`sparsify`. ``apply`` and ``init`` are the module's own,
    run under :meth:`intercept`: every ``nn.Dense`` / ``nn.Conv`` at a converted
    path computes its block-sparse product (:func:`jax_blocksparse.bsmm`,
    :func:`jax_blocksparse.bsconv`) with the variables at that path, and every other
    call runs as written. Hashable: close over it in ``jax.jit``.

    ``init`` gives a block-sparse model trained from scratch: the converted layers'
    kernels are drawn with the block-sparse layers' default initialiser (LeCun
    normal with the true fan-in), not the dense layer's.

    Attributes:
      module: the linen module, as given.
      layers: ``((module path, LayerSparsity), ...)``: the converted layers.
      impl: the products' ``impl`` (None: :mod:`jax_blocksparse.config`'s default).
      dense_names: ``((module path, names), ...)``: the axis names of the dense
        kernels that came boxed (``nn.with_partitioning``), for :func:`densify`.
    """

    module: nn.Module
    layers: tuple[tuple[tuple[str, ...], _core.LayerSparsity], ...]
    impl: str | None = None
    dense_names: tuple[tuple[tuple[str, ...], tuple], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "_by_path", dict(self.layers))
        _common.check_options(None, self.impl, "SparsifiedModule")

    @property
    def paths(self) -> tuple[str, ...]:
        """The "/"-joined paths of the converted layers."""
        return tuple("/".join(p) for p, _ in self.layers)

    def intercept(self):
        """A context in which the converted layers of ``module`` compute block-sparse.

        For calls other than ``apply`` / ``init`` (``module.bind``, the module used
        inside a larger model): ``with sparse.intercept(): ...``.
        """
        return nn.intercept_methods(self._interceptor)

    def apply(self, variables, *args, **kwargs):
        """``module.apply(variables, *args, **kwargs)`` with the converted layers block-sparse."""
        with self.intercept():
            return self.module.apply(variables, *args, **kwargs)

    def init(self, rngs, *args, **kwargs):
        """``module.init(rngs, *args, **kwargs)`` with the converted layers block-sparse (from scratch)."""
        with self.intercept():
            return self.module.init(rngs, *args, **kwargs)

    def _interceptor(self, next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, _CONVERTIBLE):
            return next_fun(*args, **kwargs)
        plan = self._by_path.get(tuple(module.path))
        if plan is None:
            return next_fun(*args, **kwargs)
        inputs, call = _call_arguments(module, args, kwargs)
        name = f"{type(module).__name__} at {'/'.join(module.path)!r}"
        precision, impl = _common.check_options(module.precision, self.impl, name)
        if isinstance(module, nn.Conv):
            return _conv_call(module, plan, inputs, name, precision, impl)
        return _dense_call(module, plan, inputs, call, name, precision, impl)


def _call_arguments(module, args, kwargs) -> tuple[Any, dict]:
    """A linear-like call's inputs, and what else the conversion reads of the call: the
    inputs' rank, and an Einsum's equation (the call's, else the module's)."""
    bound = inspect.signature(type(module).__call__).bind(module, *args, **kwargs)
    inputs = bound.arguments["inputs"]
    call = {"ndim": len(np.shape(inputs)), "einsum_str": None, "bias_shape": None}
    if isinstance(module, nn.Einsum):
        given = bound.arguments.get("einsum_str")
        call["einsum_str"] = (given if given is not None else module.einsum_str or "").replace(" ", "")
    return inputs, call


def _boxed_like(value, init, key, shape, dtype, plan: _core.LayerSparsity):
    """``value`` in the box the layer's ``init`` makes (``nn.with_partitioning`` and the
    like), with the names the block kernel keeps; ``value`` itself if ``init`` boxes nothing."""
    box = jax.eval_shape(lambda k: init(k, shape, dtype), key)
    return _rebox(box, value, plan)[0] if isinstance(box, meta.AxisMetadata) else value


def _dense_call(module, plan: _core.LayerSparsity, inputs, call, name, precision, impl):
    """``nn.Dense`` / ``nn.DenseGeneral`` / ``nn.Einsum.__call__`` on the stored blocks:
    the block-sparse dense layer's forward pass (a general layer's axes flattened)."""
    layout, flat = plan.layout, plan.flat
    if flat is None:
        out_shape = (module.features,)
        if module.features != layout.shape[1]:
            raise ValueError(f"{name}: features={module.features}, but its block mask has {layout.shape[1]} outputs")
    else:
        out_shape = flat.out_shape
        seen = _describe(module, flat.kernel_shape, call)[1]
        if seen != flat:
            raise ValueError(f"{name}: this call contracts as {seen}, but the layer was sparsified as {flat}")
        inputs = flat.flat_inputs(inputs, name)
    _dense.check_inputs(inputs, layout, name)
    dense_shape = flat.kernel_shape if flat is not None else layout.shape

    def init(key):
        blocks = _common.init_kernel(None, key, layout, plan.mask, module.param_dtype)
        return _boxed_like(blocks, module.kernel_init, key, dense_shape, module.param_dtype, plan)

    kernel = module.param("kernel", init)
    bias = module.param("bias", module.bias_init, out_shape, module.param_dtype) if module.use_bias else None
    if flat is not None:
        bias = flat.flat_bias(bias, name)
    current = module.variable(LAYOUT_COLLECTION, "kernel", lambda: layout).value if plan.dynamic else None
    y = _dense.forward(
        inputs,
        kernel,
        bias,
        layout,
        dtype=module.dtype,
        float32_dw=False,
        current=current,
        layer=name,
        precision=precision,
        impl=impl,
    )
    return y if flat is None else flat.general_outputs(y)


def _conv_call(module: nn.Conv, plan: _core.LayerSparsity, inputs, name, precision, impl):
    """``nn.Conv.__call__`` on the stored blocks: the block-sparse conv layer's forward pass."""
    cfg = _conv.check_conv(
        plan.mask,
        plan.block_size,
        module.kernel_size,
        plan.capacity,
        None,
        module.features,
        strides=module.strides,
        padding=module.padding,
        input_dilation=module.input_dilation,
        kernel_dilation=module.kernel_dilation,
        float32_dw=False,
        param_dtype=module.param_dtype,
        layer=name,
    )
    layout = cfg.layout(plan.capacity)
    _conv.check_conv_inputs(inputs, layout.shape[0], len(cfg.kernel_size), name, layout)
    kernel = module.param(
        "kernel",
        lambda key: _conv.init_conv_kernel(None, key, layout, cfg.mask, cfg.kernel_size, module.param_dtype),
    )
    bias = module.param("bias", module.bias_init, (module.features,), module.param_dtype) if module.use_bias else None
    attributes = SimpleNamespace(**cfg._asdict(), dtype=module.dtype, precision=precision, impl=impl)
    return _conv.apply_layer(attributes, inputs, kernel, bias, layout)


def _record(module: nn.Module, variables, args, apply_kwargs) -> list[tuple[tuple[str, ...], nn.Module, tuple, dict]]:
    """[(path, module, kernel shape seen, call)] of every linear-like call of one
    (abstract) apply; ``call`` as :func:`_call_arguments` reads it."""
    seen = {}

    def recorder(next_fun, call_args, call_kwargs, context):
        m = context.module
        if context.method_name == "__call__" and isinstance(m, LINEAR_LIKE) and tuple(m.path) not in seen:
            _, call = _call_arguments(m, call_args, call_kwargs)
            kernel, bias = (
                m.get_variable("params", n) if m.has_variable("params", n) else None for n in ("kernel", "bias")
            )
            call["bias_shape"] = None if bias is None else tuple(np.shape(bias))
            seen[tuple(m.path)] = (m, None if kernel is None else tuple(np.shape(kernel)), call)
        return next_fun(*call_args, **call_kwargs)

    kwargs = dict(apply_kwargs)
    kwargs.setdefault("mutable", True)  # a model that updates batch statistics runs too
    with nn.intercept_methods(recorder):
        jax.eval_shape(lambda v: module.apply(v, *args, **kwargs), variables)
    return [(path, m, shape, call) for path, (m, shape, call) in seen.items()]


def _rebox(box, value, plan: _core.LayerSparsity, names=None) -> tuple[Any, str | None]:
    """``value`` in a box of ``box``'s type: a box with axis names (``nn.Partitioned``,
    ``nn.LogicallyPartitioned``) gets the block kernel's names from
    :func:`~jax_blocksparse.layers.sparsify.block_axis_names` (or ``names`` where
    given: densify's way back), any other ``AxisMetadata`` its own metadata. Returns
    the box and the names dropped (None if none was)."""
    if not (dataclasses.is_dataclass(box) and "names" in {f.name for f in dataclasses.fields(box)}):
        return box.replace_boxed(value), None
    dropped = None
    if names is None:
        names, dropped = _core.block_axis_names(box.names, plan)
    return dataclasses.replace(box, value=value, names=tuple(names)), dropped


@attribute_docs.fill
def sparsify(
    module: nn.Module,
    variables,
    *args,
    density,
    block_size: int,
    distribution: str = "uniform",
    selection=None,
    keep_dense=None,
    dynamic: bool = False,
    capacity_factor: float = 1.0,
    norm: str = "l2",
    impl: str | None = None,
    strict: bool = False,
    apply_kwargs: Mapping | None = None,
):
    """Block-sparse dense and conv layers for an unmodified linen model and its variables.

    Runs the model once abstractly (``jax.eval_shape``: no computation) on ``args``
    to find every ``nn.Dense`` and ``nn.Conv`` it calls, including those created
    inline in ``nn.compact`` methods, decides which fit and which blocks each keeps
    (:func:`~jax_blocksparse.layers.sparsify.plan_sparsity`), and converts the
    variables: at each converted path the kernel becomes its selected blocks. A
    layer fits when its input and output features are multiples of ``block_size``,
    it uses the default ``dot_general`` / ``conv_general_dilated`` and
    ``promote_dtype``, and (a conv) ``feature_group_count=1`` and no ``mask``.
    Bias, ``dtype``, ``param_dtype``, ``precision``, strides, padding and dilations
    are the module's own, read at every call.

    Args:
      module: the linen module (not modified).
      variables: its variables, ``{"params": ..., ...}`` with concrete arrays.
      *args: example inputs for one call of ``module.apply(variables, *args)``
        (only their shapes and dtypes are used).
      {density, block_size, distribution}
      selection: which blocks each layer keeps, as in
        :func:`jax_blocksparse.nnx.sparsify`; paths are the linen module
        paths, "/"-joined (``"Dense_0"``, ``"encoder/fc"``).
      {keep_dense}
      dynamic: give the converted dense layers a dynamic layout: a
        :class:`~jax_blocksparse.Layout` of fixed capacity in the ``"layout"``
        collection (``variables["layout"][...path]["kernel"]``), as
        ``jbs.nn.BlockSparseDense(dynamic=True)`` keeps it, so
        :mod:`jax_blocksparse.training`'s methods continue from them. Conv layers
        keep a static layout.
      {capacity_factor, norm, sparsify.impl, strict}
      apply_kwargs: keyword arguments of that one call (``{"train": False}``,
        ``{"method": ...}``, ``{"rngs": ...}``); all collections are mutable in it.

    Returns:
      ``(sparse_module, sparse_variables, report)``: a :class:`SparsifiedModule`
      (``sparse_module.apply(sparse_variables, x)``), the converted variables, and
      the :class:`~jax_blocksparse.layers.sparsify.SparsifyReport`.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import flax.linen as nn
        >>> import jax_blocksparse as jbs
        >>> class MLP(nn.Module):
        ...     @nn.compact
        ...     def __call__(self, x):
        ...         x = nn.relu(nn.Dense(128)(x))           # "Dense_0"
        ...         return nn.Dense(10)(x)                  # "Dense_1": 10 outputs, left dense
        >>> model, x = MLP(), jnp.ones((2, 64))
        >>> variables = model.init(jax.random.key(0), x)
        >>> sparse, sparse_vars, report = jbs.nn.sparsify(model, variables, x, density=0.25, block_size=16)
        >>> sparse.paths, sparse_vars["params"]["Dense_0"]["kernel"].shape
        (('Dense_0',), (8, 16, 16))
        >>> sparse.apply(sparse_vars, x).shape
        (2, 10)
        >>> dense_vars = jbs.nn.densify(sparse, sparse_vars)    # for model.apply
        >>> dense_vars["params"]["Dense_0"]["kernel"].shape
        (64, 128)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a flax.linen.Module, got {type(module).__name__}")
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError("variables must be the module's variables, a mapping with a 'params' collection")
    boxed_params = variables["params"]
    params = meta.unbox(boxed_params)  # nn.Partitioned / nn.LogicallyPartitioned / any AxisMetadata: arrays
    candidates, paths = [], {}
    for path, m, seen_shape, call in _record(module, {**variables, "params": params}, args, apply_kwargs or {}):
        name = "/".join(path)
        entry = _lookup(params, path)
        entry = entry if isinstance(entry, Mapping) else {}
        kernel, bias = entry.get("kernel"), entry.get("bias")
        kind, flat, reason = _describe(m, seen_shape, call)
        if kernel is None or tuple(np.shape(kernel)) != seen_shape:
            found = "none" if kernel is None else f"shape {tuple(np.shape(kernel))}"
            reason = reason or (
                f"its kernel at params/{name}/kernel ({found}) is not the {seen_shape} the layer sees: "
                "stacked by a lifted transform (nn.scan, nn.vmap), whose body sees one layer's kernel but "
                "not the per-layer layouts; stacked layers convert in NNX (nnx.vmap + nnx.scan)"
            )
            kernel = np.zeros(seen_shape or (0, 0), np.float32) if kernel is None else kernel
        candidates.append(
            _core.Candidate(
                name,
                kind,
                type(m).__name__,
                kernel,
                0 if bias is None else int(np.size(bias)),
                reason,
                dynamic_reason="conv layers have no dynamic layout" if kind == "conv" else None,
                flat=None if reason else flat,
            )
        )
        paths[name] = path
    plans, report = _core.plan_sparsity(
        candidates,
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
    new_variables = dict(variables)
    dropped, dense_names = {}, []
    for name, plan in plans.items():
        path = paths[name] + ("kernel",)
        kernel = _core.sparse_kernel(_lookup(params, path), plan.layout, plan.flat)
        box = _lookup(boxed_params, path)
        if isinstance(box, meta.AxisMetadata):
            kernel, dropped[name] = _rebox(box, kernel, plan)
            dense_names.append((paths[name], tuple(getattr(box, "names", ()) or ())))
        new_variables["params"] = _with(new_variables["params"], path, kernel)
        if plan.dynamic:
            new_variables[LAYOUT_COLLECTION] = _with(new_variables.get(LAYOUT_COLLECTION), path, plan.layout)
    layers = tuple((paths[name], plan) for name, plan in plans.items())
    sparse = SparsifiedModule(module, layers, impl, tuple(dense_names))
    report = report.with_partitioning(dropped)
    return sparse, new_variables, report


def densify(sparse: SparsifiedModule, variables):
    """The dense variables of ``sparse.module``: every converted kernel scattered back.

    Each converted layer's kernel becomes the dense [C, K] (a conv's
    [*kernel_size, C, K]) with its blocks (a dynamic layer's current layout, from
    the ``"layout"`` collection) and zeros elsewhere, and its layout leaves the
    ``"layout"`` collection. ``sparse.module.apply(dense_variables, x)`` then
    computes what ``sparse.apply(variables, x)`` does.
    """
    if not isinstance(sparse, SparsifiedModule):
        raise TypeError(f"sparse must be the SparsifiedModule of sparsify, got {type(sparse).__name__}")
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError("variables must be a mapping with a 'params' collection")
    variables = dict(variables)
    dense_names = dict(sparse.dense_names)
    for path, plan in sparse.layers:
        entry = _lookup(variables["params"], path)
        if not isinstance(entry, Mapping) or "kernel" not in entry:
            raise ValueError(f"densify: no kernel at params/{'/'.join(path)}")
        layout = plan.layout
        if plan.dynamic:
            current = _lookup(variables.get(LAYOUT_COLLECTION), path + ("kernel",))
            if current is None:
                raise ValueError(
                    f"densify: the dynamic layer {'/'.join(path)} has no layout in variables[{LAYOUT_COLLECTION!r}]"
                )
            layout = current
            variables[LAYOUT_COLLECTION] = _without(variables[LAYOUT_COLLECTION], path + ("kernel",))
        box = entry["kernel"]
        kernel = _core.dense_kernel(meta.unbox(box), layout, plan.flat)
        if isinstance(box, meta.AxisMetadata):  # the dense kernel's own box and names back
            kernel = _rebox(box, kernel, plan, dense_names.get(path))[0]
        variables["params"] = _with(variables["params"], path + ("kernel",), kernel)
    if LAYOUT_COLLECTION in variables and not variables[LAYOUT_COLLECTION]:
        del variables[LAYOUT_COLLECTION]
    return variables
