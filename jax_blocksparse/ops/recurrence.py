"""Block-sparse LSTM and multiplicative LSTM as functional ops: one step, a whole sequence.

The recurrence of OpenAI's block-sparse LSTM (2017), in the spirit of
``jax.experimental.rnn.lstm``: pure functions of a parameter dict, which the Flax
cells (:class:`jax_blocksparse.nn.BlockSparseLSTMCell`,
:class:`jax_blocksparse.nnx.BlockSparseLSTMCell` and the fused ``BlockSparseLSTM``)
only wrap. The recurrent weights are block-sparse with a small-world layout and, at
every timestep, a few *internal steps* (a block-sparse transition followed by layer
norm) run before the gates, so that information from every unit reaches every other
unit despite the sparsity.

* :func:`bs_lstm_step`: one timestep, ``(c, h), x -> ((c', h'), h')``.
* :func:`bs_lstm_sequence`: a whole (time-major) sequence, with the input projection
  of all timesteps in one product and a custom backward pass that computes each
  recurrent weight gradient with a single ``bsmm_updat``.
* :class:`LSTMSpec` (built by :func:`lstm_spec`): everything static: the layouts,
  layer norm, the activations, the compute dtype. Hashable, so jit can close over it.

The math of one timestep, with ``r`` the "recurrent input" (block-sparse products are
``bsmm``; ``LN_g`` is layer norm over each of ``g`` equal groups of features, with
gain and no bias unless stated; everything elementwise runs in float32)::

    p       = LN_G(x @ W_in) * input_scale               # [.., G*H], G = 4 (5 for mLSTM)
    xg      = p[:, :4H] + bias                           # input part of the 4 gates
    r       = h                                          # LSTM
    r       = (LN(h @ W_mh) * mh_scale + mh_bias) * p[:, 4H:]   # mLSTM: m = (W_mx x) * (W_mh h)
    for i in range(internal_steps):                      # internal steps
        r   = act(LN(r @ W_i) * step{i}_scale + step{i}_bias)
    i, f, g, o = split(LN_4(r @ W_h) * recurrent_scale + xg, 4)
    c'      = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h'      = sigmoid(o) * tanh(c')

Without ``layer_norm`` every ``LN(.) * scale`` is the identity (internal steps keep
their bias; the mLSTM factor is ``(h @ W_mh) * (x @ W_mx)``), and the cell with no
internal steps is exactly ``flax.linen.LSTMCell`` with masked kernels.

Parameters (the dict's keys; shapes from :meth:`LSTMSpec.param_shapes`):
``input_kernel`` [D, G*H] (or [capacity, bs, bs] with an input layout), ``bias``
[4H], ``recurrent_kernel`` [capacity, bs, bs] (layout [H, 4H]: the four gates, order
i, f, g, o, share one product), ``step{i}_kernel`` [capacity, bs, bs] (layout [H, H]),
``mh_kernel`` (mLSTM, layout [H, H]); with ``layer_norm``: ``input_scale`` [G*H],
``recurrent_scale`` [4H], ``step{i}_scale`` and ``step{i}_bias`` [H], ``mh_scale`` and
``mh_bias`` [H]; without it only ``step{i}_bias``.

Recurrent weight gradients in one call each: under a plain scan over
:func:`bs_lstm_step`, autodiff puts one small ``bsmm_updat`` (SDDMM) per recurrent
weight in the backward scan body: T calls of B rows each. :func:`bs_lstm_sequence`
wraps its scan in a ``jax.custom_vjp`` whose forward saves each product's input ``r``
and output ``z`` per step, whose backward scan computes cotangents only for
activations (``bsmm(dz, W, transpose=True)``), and which then calls ``bsmm_updat``
once per recurrent weight on the stacked [T, B, in] inputs and [T, B, out]
cotangents: a constant ``1 + internal_steps`` (+1 for mLSTM) calls however long the
sequence. The input projection's weight gradient is also one call, by ordinary
autodiff of the one projection over all timesteps. Forward-mode autodiff does not go
through the sequence op (custom VJP); scan :func:`bs_lstm_step` for that.

Dtypes: carries keep their own dtype; the products run in ``spec.dtype`` (float32
accumulation) while the cell state and all elementwise math stay in float32. The
kernel gradients are then rounded to ``spec.dtype`` (as autodiff of a 16-bit product
gives them) unless ``spec.float32_dw``: then every kernel gradient (block-sparse and
the dense input kernel) is the float32 accumulator of its weight-gradient product.

Example::

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> import jax_blocksparse as jbs
    >>> from jax_blocksparse.ops.recurrence import bs_lstm_sequence, bs_lstm_step, lstm_spec
    >>> base = jbs.layouts.barabasi_albert(4, 1, seed=0)                   # [H/bs, H/bs], H = 64
    >>> gates = jbs.Layout.from_mask(np.tile(base, (1, 4)), 16)             # [H, 4H], 4 * 10 blocks
    >>> spec = lstm_spec(64, gates, layer_norm=False)
    >>> spec.param_shapes(8)
    {'input_kernel': (8, 256), 'bias': (256,), 'recurrent_kernel': (40, 16, 16)}
    >>> keys = iter(jax.random.split(jax.random.key(0), 3))
    >>> params = {k: 0.1 * jax.random.normal(next(keys), s) for k, s in spec.param_shapes(8).items()}
    >>> carry = (jnp.zeros((2, 64)), jnp.zeros((2, 64)))                   # (c, h) [B, H]
    >>> (c, h), y = bs_lstm_step(spec, params, carry, jnp.ones((2, 8)))    # x [B, D]
    >>> (c, h), ys = bs_lstm_sequence(spec, params, carry, jnp.ones((5, 2, 8)))   # xs [T, B, D]
    >>> ys.shape, h.dtype
    ((5, 2, 64), dtype('float32'))
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse import config
from jax_blocksparse.layout import Layout, check_layout
from jax_blocksparse.ops._checks import canonical_precision, pvary, varying_axes
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

__all__ = [
    "LSTMSpec",
    "LSTMStage",
    "bs_lstm_sequence",
    "bs_lstm_step",
    "check_step_inputs",
    "lstm_spec",
    "project_inputs",
]

_F32 = jnp.float32
_F32_DTYPE = np.dtype(np.float32)


@dataclasses.dataclass(frozen=True)
class LSTMStage:
    """One block-sparse product of the recurrence and the elementwise piece after it.

    Attributes:
      kind: "mult" (the mLSTM factor), "step" (an internal step) or "gate".
      kernel: the parameter name of its [capacity, bs, bs] weight.
      layout: its :class:`~jax_blocksparse.Layout` ([H, H], or [H, 4H] for "gate").
      small: the names of its vector parameters (scales, biases).
      index: the internal step's number (0 for the others).
    """

    kind: str
    kernel: str
    layout: Layout
    small: tuple[str, ...]
    index: int = 0


@dataclasses.dataclass(frozen=True)
class LSTMSpec:
    """Everything static about a block-sparse (m)LSTM recurrence (hashable); see :func:`lstm_spec`.

    Attributes:
      features: hidden size H.
      stages: the block-sparse products in order (mLSTM factor, internal steps, gates).
      input_layout: the input kernel's layout [D, G*H], or None for a dense one.
      multiplicative: the mLSTM (an ``m`` group in the input projection).
      layer_norm, epsilon: layer norm on the products (and its epsilon).
      gate_fn, activation_fn, internal_activation: sigmoid, tanh and ReLU by default.
      dtype: the compute dtype of the products.
      float32_dw: kernel gradients from the float32 accumulators.
      precision: the ``precision`` of every product, forward and backward (the
        block-sparse ones and a dense input kernel's): a :class:`jax.lax.Precision`,
        or None for :func:`jax.default_matmul_precision` read at trace time.
      impl: the ``impl`` of every ``bsmm`` / ``bsmm_updat`` (``"auto"``,
        ``"reference"``, ``"kernels"``, ``"dense"``), or None for
        :func:`jax_blocksparse.config.get_implementation` read at trace time.
    """

    features: int
    stages: tuple[LSTMStage, ...]
    input_layout: Layout | None = None
    multiplicative: bool = False
    layer_norm: bool = True
    epsilon: float = 1e-5
    gate_fn: Callable = jax.nn.sigmoid
    activation_fn: Callable = jnp.tanh
    internal_activation: Callable | None = jax.nn.relu
    dtype: Any = _F32_DTYPE
    float32_dw: bool = False
    precision: Any = None
    impl: str | None = None

    @property
    def groups(self) -> int:
        """Number of H-wide groups in the input projection: 4 gates (+ m for mLSTM)."""
        return 5 if self.multiplicative else 4

    @property
    def block_size(self) -> int:
        return self.stages[-1].layout.block_size

    @property
    def internal_steps(self) -> int:
        return sum(1 for s in self.stages if s.kind == "step")

    def param_shapes(self, in_features: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, for inputs of ``in_features`` features.

        A block-sparse input kernel fixes ``in_features``: ValueError if it differs.
        """
        h = self.features
        shapes = {}
        if self.input_layout is None:
            shapes["input_kernel"] = (int(in_features), self.groups * h)
        else:
            if in_features != self.input_layout.shape[0]:
                raise ValueError(
                    f"inputs must have {self.input_layout.shape[0]} features for the input layout "
                    f"{self.input_layout}, got {in_features}"
                )
            shapes["input_kernel"] = self.input_layout.w_shape
        shapes["bias"] = (4 * h,)
        if self.layer_norm:
            shapes["input_scale"] = (self.groups * h,)
        for stage in self.stages:
            shapes[stage.kernel] = stage.layout.w_shape
            for name in stage.small:
                shapes[name] = (4 * h,) if stage.kind == "gate" else (h,)
        return shapes


def lstm_stages(
    recurrent_layout: Layout, step_layouts=(), mh_layout: Layout | None = None, layer_norm: bool = True
) -> tuple[LSTMStage, ...]:
    """The products of one timestep, named: ``mh_kernel`` (if ``mh_layout``), ``step{i}_kernel``,
    ``recurrent_kernel``, each with its vector parameters. No checks (see :func:`lstm_spec`)."""
    stages = []
    if mh_layout is not None:
        small = ("mh_scale", "mh_bias") if layer_norm else ()
        stages.append(LSTMStage("mult", "mh_kernel", mh_layout, small))
    for i, layout in enumerate(step_layouts):
        small = (f"step{i}_scale", f"step{i}_bias") if layer_norm else (f"step{i}_bias",)
        stages.append(LSTMStage("step", f"step{i}_kernel", layout, small, i))
    small = ("recurrent_scale",) if layer_norm else ()
    stages.append(LSTMStage("gate", "recurrent_kernel", recurrent_layout, small))
    return tuple(stages)


def lstm_spec(
    features: int,
    recurrent_layout: Layout,
    *,
    step_layouts=(),
    mh_layout: Layout | None = None,
    input_layout: Layout | None = None,
    layer_norm: bool = True,
    epsilon: float = 1e-5,
    gate_fn: Callable = jax.nn.sigmoid,
    activation_fn: Callable = jnp.tanh,
    internal_activation: Callable | None = jax.nn.relu,
    dtype=jnp.float32,
    float32_dw: bool = False,
    precision=None,
    impl: str | None = None,
) -> LSTMSpec:
    """Checks the static configuration of a block-sparse (m)LSTM and returns its :class:`LSTMSpec`.

    Args:
      features: hidden size H.
      recurrent_layout: the gates' layout, [H, 4H] (gate order i, f, g, o).
      step_layouts: one [H, H] layout per internal step.
      mh_layout: the mLSTM's ``W_mh`` layout, [H, H]; given, the cell is multiplicative.
      input_layout: None for a dense input kernel, else its layout [D, G*H]
        (G = 4, or 5 for the mLSTM).
      layer_norm, epsilon: layer norm on the products and its epsilon.
      gate_fn, activation_fn, internal_activation: the nonlinearities (the last may
        be None).
      dtype: compute dtype of the products: float32, bfloat16 or float16.
      float32_dw: kernel gradients from the float32 accumulators (needs float32
        kernels).
      precision: of every product, forward and backward, as in
        :func:`jax.lax.dot_general` (a pair resolves to the higher); None reads
        :func:`jax.default_matmul_precision` at trace time.
      impl: ``"auto"``, ``"reference"``, ``"kernels"`` or ``"dense"`` for every block-sparse
        product, forward and backward; None reads the default at trace time.

    Raises ValueError naming the layout and the expected shape.
    """
    if isinstance(features, bool) or not isinstance(features, (int, np.integer)) or features <= 0:
        raise ValueError(f"lstm_spec: features must be a positive int, got {features!r}")
    h = int(features)
    recurrent_layout = check_layout(recurrent_layout, name="recurrent_layout")

    def expect(layout, shape, name):
        layout = check_layout(layout, name=name)
        if layout.shape != shape or layout.block_size != recurrent_layout.block_size:
            raise ValueError(
                f"lstm_spec: {name} must be a layout of shape {shape} with block_size "
                f"{recurrent_layout.block_size} (features={h}), got {layout}"
            )
        return layout

    expect(recurrent_layout, (h, 4 * h), "recurrent_layout")
    steps = tuple(expect(l, (h, h), f"step_layouts[{i}]") for i, l in enumerate(step_layouts))
    mh = None if mh_layout is None else expect(mh_layout, (h, h), "mh_layout")
    groups = 4 if mh is None else 5
    if input_layout is not None:
        input_layout = check_layout(input_layout, name="input_layout")
        if input_layout.shape[1] != groups * h or input_layout.block_size != recurrent_layout.block_size:
            raise ValueError(
                f"lstm_spec: input_layout must have shape [in_features, {groups} * {h}] and block_size "
                f"{recurrent_layout.block_size}, got {input_layout}"
            )
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)):
        raise TypeError(f"lstm_spec: dtype must be float32, bfloat16 or float16, got {dtype}")
    if not isinstance(float32_dw, (bool, np.bool_)):
        raise TypeError(f"lstm_spec: float32_dw must be a bool, got {float32_dw!r}")
    # None stays None: the ops read their defaults when traced, not when the spec is built.
    if precision is not None:
        precision = canonical_precision(precision, name="lstm_spec: precision")
    if impl is not None:
        impl = config.canonical_impl(impl, name="lstm_spec: impl")
    stages = lstm_stages(recurrent_layout, steps, mh, bool(layer_norm))
    return LSTMSpec(
        h,
        stages,
        input_layout,
        mh is not None,
        bool(layer_norm),
        float(epsilon),
        gate_fn,
        activation_fn,
        internal_activation,
        dtype,
        bool(float32_dw),
        precision,
        impl,
    )


def check_step_inputs(fn: str, carry, inputs, features: int):
    """Raises ValueError naming ``fn`` unless ``carry`` is (c, h) [..., H] and ``inputs`` [..., D]."""
    if not isinstance(carry, (tuple, list)) or len(carry) != 2:
        raise ValueError(f"{fn}: carry must be a pair (c, h) from initialize_carry, got {type(carry).__name__}")
    c, h = carry
    if jnp.shape(c)[-1:] != (features,) or jnp.shape(h)[-1:] != (features,):
        raise ValueError(f"{fn}: carry (c, h) must have shape [..., {features}], got {jnp.shape(c)} and {jnp.shape(h)}")
    if jnp.ndim(inputs) < 1:
        raise ValueError(f"{fn}: inputs must have shape [..., in_features], got {jnp.shape(inputs)}")


def _check_params(fn: str, spec: LSTMSpec, params, in_features: int):
    """Raises naming ``fn`` and the parameter unless ``params`` has every shape of the spec."""
    try:
        shapes = spec.param_shapes(in_features)
    except ValueError as err:
        raise ValueError(f"{fn}: {err}") from None
    missing = [name for name in shapes if name not in params]
    if missing:
        raise ValueError(f"{fn}: params lack {missing} (expected the keys {list(shapes)})")
    for name, shape in shapes.items():
        if tuple(jnp.shape(params[name])) != shape:
            raise ValueError(f"{fn}: params[{name!r}] must have shape {shape}, got {tuple(jnp.shape(params[name]))}")


def _product_weights(spec: LSTMSpec, weights):
    """Kernels as the products take them: float32 with ``float32_dw``, else in the compute dtype."""
    return tuple(weights) if spec.float32_dw else tuple(w.astype(spec.dtype) for w in weights)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _dense_f32_dw(x, kernel, compute, precision):
    """``x @ kernel`` in ``compute`` (float32 accumulation and result) for a float32 kernel
    whose gradient stays float32: the dense counterpart of ``bsmm(..., float32_dw=True)``.

    The tangent in the kernel is a float32 product of the (exactly) widened ``x``, so
    its transpose is the float32 accumulator ``x.T @ dy``, never rounded to ``compute``.
    Every product runs at ``precision`` (hashable: a ``lax.Precision`` or None).
    """
    return jnp.matmul(x.astype(compute), kernel.astype(compute), precision=precision, preferred_element_type=_F32)


@_dense_f32_dw.defjvp
def _dense_f32_dw_jvp(compute, precision, primals, tangents):
    x, kernel = primals
    tx, tk = tangents
    xc = x.astype(compute)
    matmul = functools.partial(jnp.matmul, precision=precision, preferred_element_type=_F32)
    y = matmul(xc, kernel.astype(compute))
    ty = matmul(tx.astype(compute), kernel.astype(compute))
    ty = ty + matmul(xc.astype(_F32), tk.astype(_F32))
    return y, ty


def _group_norm(z, groups: int, eps: float):
    """Layer norm (no gain) over each of ``groups`` equal slices of the last axis, in float32."""
    z = z.astype(_F32)
    g = z.reshape(*z.shape[:-1], groups, z.shape[-1] // groups)
    mean = jnp.mean(g, axis=-1, keepdims=True)
    centered = g - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return (centered * jax.lax.rsqrt(var + eps)).reshape(z.shape)


def project_inputs(spec: LSTMSpec, params, x):
    """Input part of the gates (and the mLSTM input factor) for inputs x [..., D].

    Returns ``(xg [..., 4H], xm [..., H] or None)`` in the compute dtype; ``xg``
    includes the gate bias.
    """
    h = spec.features
    x = x.astype(spec.dtype)
    (kernel,) = _product_weights(spec, (params["input_kernel"],))
    if spec.input_layout is None and spec.float32_dw and np.dtype(spec.dtype) != np.dtype(_F32):
        p = _dense_f32_dw(x, kernel, np.dtype(spec.dtype), spec.precision)
    elif spec.input_layout is None:
        p = jnp.matmul(x, kernel, precision=spec.precision, preferred_element_type=_F32)
    else:
        p = bsmm(
            x,
            kernel,
            spec.input_layout,
            preferred_element_type=_F32,
            compute_dtype=spec.dtype,
            float32_dw=spec.float32_dw,
            precision=spec.precision,
            impl=spec.impl,
        )
    if spec.layer_norm:
        p = _group_norm(p, spec.groups, spec.epsilon) * params["input_scale"].astype(_F32)
    xg = (p[..., : 4 * h] + params["bias"].astype(_F32)).astype(spec.dtype)
    xm = p[..., 4 * h :].astype(spec.dtype) if spec.multiplicative else None
    return xg, xm


def _mult_piece(spec: LSTMSpec, z, xm, small):
    """mLSTM: m = LN(h W_mh) * (LN(x W_mx))."""
    a = z.astype(_F32)
    if spec.layer_norm:
        a = _group_norm(a, 1, spec.epsilon) * small["mh_scale"].astype(_F32) + small["mh_bias"].astype(_F32)
    return (a * xm.astype(_F32)).astype(spec.dtype)


def _step_piece(spec: LSTMSpec, stage: LSTMStage, z, small):
    """Internal step: act(LN(r W_i) * scale + bias)."""
    a = z.astype(_F32)
    i = stage.index
    if spec.layer_norm:
        a = _group_norm(a, 1, spec.epsilon) * small[f"step{i}_scale"].astype(_F32)
    a = a + small[f"step{i}_bias"].astype(_F32)
    if spec.internal_activation is not None:
        a = spec.internal_activation(a)
    return a.astype(spec.dtype)


def _gate_piece(spec: LSTMSpec, z, xg, c, h_dtype, small):
    """All four gates and the state update in one elementwise pass (float32)."""
    g = z.astype(_F32)
    if spec.layer_norm:
        g = _group_norm(g, 4, spec.epsilon) * small["recurrent_scale"].astype(_F32)
    g = g + xg.astype(_F32)
    i, f, u, o = jnp.split(g, 4, axis=-1)
    new_c = spec.gate_fn(f) * c.astype(_F32) + spec.gate_fn(i) * spec.activation_fn(u)
    new_h = spec.gate_fn(o) * spec.activation_fn(new_c)
    return new_c.astype(c.dtype), new_h.astype(h_dtype)


def _piece(spec: LSTMSpec, stage: LSTMStage, z, aux, carry_c, h_dtype, small):
    """The elementwise function after ``stage``'s product."""
    if stage.kind == "mult":
        return _mult_piece(spec, z, aux[1], small)
    if stage.kind == "step":
        return _step_piece(spec, stage, z, small)
    return _gate_piece(spec, z, aux[0], carry_c, h_dtype, small)


def _split_params(spec: LSTMSpec, params):
    stages = spec.stages
    weights = tuple(params[s.kernel] for s in stages)
    small = tuple({name: params[name] for name in s.small} for s in stages)
    return weights, small


def _chain(spec: LSTMSpec, weights, small, carry, aux):
    """One timestep of the recurrence given the projected inputs ``aux = (xg, xm)``.

    ``weights`` come from :func:`_product_weights`. Returns the new carry and, per
    stage, the product's input ``r`` and output ``z`` (what the backward pass needs).
    """
    c, h = carry
    r = h.astype(spec.dtype)
    rs, zs = [], []
    for stage, w, sm in zip(spec.stages, weights, small):
        z = bsmm(
            r,
            w,
            stage.layout,
            compute_dtype=spec.dtype,
            float32_dw=spec.float32_dw,
            precision=spec.precision,
            impl=spec.impl,
        )
        rs.append(r)
        zs.append(z)
        out = _piece(spec, stage, z, aux, c, h.dtype, sm)
        if stage.kind == "gate":
            c, h = out
        else:
            r = out
    return (c, h), rs, zs


def _cell_step(spec: LSTMSpec, params, carry, x):
    """One timestep: carry (c, h) [..., H], x [..., D] -> (new carry, h)."""
    aux = project_inputs(spec, params, x)
    weights, small = _split_params(spec, params)
    (c, h), _, _ = _chain(spec, _product_weights(spec, weights), small, carry, aux)
    return (c, h), h


def _vary_like(tree, *refs):
    """Under shard_map, marks ``tree``'s leaves varying over every mesh axis ``refs`` vary over.

    A scan carry must keep its type: an initial carry built from constants (zeros, a
    replicated initial state) becomes device-varying once it meets batch-sharded inputs.
    """
    axes = frozenset().union(*(varying_axes(jax.typeof(r)) for r in jax.tree.leaves(refs)))
    if not axes:
        return tree

    def cast(a):
        missing = tuple(sorted(axes - varying_axes(jax.typeof(a))))
        return pvary(a, missing) if missing else a

    return jax.tree.map(cast, tree)


def _sum_like(cts, primals):
    """Under shard_map, sums each cotangent over the mesh axes its primal does not vary over.

    The transpose of :func:`_vary_like`: a custom VJP must give an invariant (replicated)
    input an invariant cotangent, the sum of the per-device contributions.
    """

    def total(ct, primal):
        if ct is None:
            return ct
        extra = tuple(sorted(varying_axes(jax.typeof(ct)) - varying_axes(jax.typeof(primal))))
        return jax.lax.psum(ct, extra) if extra else ct

    return jax.tree.map(total, cts, primals, is_leaf=lambda x: x is None)


@functools.lru_cache(maxsize=64)
def _recurrence(spec: LSTMSpec):
    """The scan over time with a custom VJP (see the module docstring), built once per spec.

    ``run(weights, small, aux, carry0) -> (hs [T, B, H], (c_T, h_T))`` with
    ``aux = (xg [T, B, 4H], xm [T, B, H] or None)``.

    Forward (when differentiated): saves, per step and stage, the product's input
    ``r`` [B, in] and output ``z`` [B, out], and the previous cell state. Backward: a
    reverse scan that re-runs only the elementwise pieces (their VJPs) and one
    ``bsmm(dz, W, transpose=True)`` per stage, accumulating the small (vector)
    parameters' gradients in its carry; then one ``bsmm_updat`` per stage on the
    stacked [T, B, in] and [T, B, out] arrays (all T*B rows at once). No product is recomputed.
    """
    stages = spec.stages

    def scan_forward(weights, small, aux, carry0, save):
        wc = _product_weights(spec, weights)

        def body(carry, aux_t):
            new_carry, rs, zs = _chain(spec, wc, small, carry, aux_t)
            ys = (new_carry[1], tuple(rs), tuple(zs), carry[0]) if save else new_carry[1]
            return new_carry, ys

        return jax.lax.scan(body, _vary_like(carry0, aux), aux)

    @jax.custom_vjp
    def run(weights, small, aux, carry0):
        carry, hs = scan_forward(weights, small, aux, carry0, save=False)
        return hs, carry

    def run_fwd(weights, small, aux, carry0):
        carry, (hs, rs, zs, c_prev) = scan_forward(weights, small, aux, carry0, save=True)
        return (hs, carry), (weights, small, aux, carry0, rs, zs, c_prev)

    def run_bwd(res, cts):
        weights, small, aux, carry0, rs, zs, c_prev = res
        ct_hs, (ct_c, ct_h) = cts
        h_dtype = ct_hs.dtype
        wc = tuple(w.astype(spec.dtype) for w in weights)
        zero_small = jax.tree.map(jnp.zeros_like, small)

        def body(carry, xs):
            dc, dh, dsmall = carry
            ct_h_t, aux_t, zs_t, c_prev_t = xs
            dh = dh + ct_h_t
            dzs = [None] * len(stages)
            daux = [None, None]
            dsmall = list(dsmall)
            dr = None
            for k in reversed(range(len(stages))):
                stage = stages[k]
                if stage.kind == "gate":
                    fn = lambda z, xg, c, sm: _gate_piece(spec, z, xg, c, h_dtype, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], aux_t[0], c_prev_t, small[k])
                    dz, daux[0], dc, ds = vjp((dc, dh))
                elif stage.kind == "mult":
                    fn = lambda z, xm, sm: _mult_piece(spec, z, xm, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], aux_t[1], small[k])
                    dz, daux[1], ds = vjp(dr)
                else:
                    fn = lambda z, sm, _s=stage: _step_piece(spec, _s, z, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], small[k])
                    dz, ds = vjp(dr)
                dsmall[k] = jax.tree.map(jnp.add, dsmall[k], ds)
                dzs[k] = dz
                dr = bsmm(dz, wc[k], stage.layout, transpose=True, precision=spec.precision, impl=spec.impl)
            dh_prev = dr.astype(dh.dtype)
            daux_t = tuple(d for d in daux if d is not None)
            return (dc, dh_prev, tuple(dsmall)), (tuple(dzs), daux_t)

        # dsmall keeps small's type: each step's vjp already sums an invariant one's share.
        init = (*_vary_like((ct_c, ct_h), ct_hs, aux), zero_small)
        (dc0, dh0, dsmall), (dzs, daux) = jax.lax.scan(body, init, (ct_hs, aux, zs, c_prev), reverse=True)
        # One SDDMM per recurrent weight over all T*B rows, accumulated in float32 and
        # delivered as autodiff of the cell would: rounded to the compute dtype, unless
        # float32_dw.
        dw_dtype = _F32 if spec.float32_dw else spec.dtype
        dweights = tuple(
            bsmm_updat(r, dz, stage.layout, out_dtype=dw_dtype, precision=spec.precision, impl=spec.impl).astype(
                w.dtype
            )
            for stage, w, r, dz in zip(stages, weights, rs, dzs)
        )
        daux_full = (daux[0], daux[1] if aux[1] is not None else None)
        return _sum_like((dweights, dsmall, daux_full, (dc0, dh0)), (weights, small, aux, carry0))

    run.defvjp(run_fwd, run_bwd)
    return run


def _sequence(spec: LSTMSpec, params, carry, xs):
    """The whole sequence: xs [T, *batch, D] (time-major) -> (final carry, hs [T, *batch, H])."""
    t = xs.shape[0]
    batch = xs.shape[1:-1]
    n = math.prod(batch)
    h = spec.features
    # One product for all steps. Leading dims stay apart (no [T * n, D] reshape): with
    # the batch split over devices, merging it under T would make XLA gather it.
    xg, xm = project_inputs(spec, params, xs)
    aux = (xg.reshape(t, n, 4 * h), None if xm is None else xm.reshape(t, n, h))
    c0, h0 = carry
    c0 = jnp.broadcast_to(c0, batch + (h,)).reshape(n, h)
    h0 = jnp.broadcast_to(h0, batch + (h,)).reshape(n, h)
    weights, small = _split_params(spec, params)
    hs, (c_t, h_t) = _recurrence(spec)(weights, small, aux, (c0, h0))
    return (c_t.reshape(batch + (h,)), h_t.reshape(batch + (h,))), hs.reshape((t,) + batch + (h,))


def bs_lstm_step(spec: LSTMSpec, params, carry, x):
    """One timestep of the block-sparse (m)LSTM.

    Args:
      spec: the static configuration (:func:`lstm_spec`).
      params: dict name -> array with the shapes of ``spec.param_shapes(D)``.
      carry: (c, h), each [..., H], in any float dtype (kept).
      x: [..., D]; its leading dims broadcast with the carry's.

    Returns:
      ``((c', h'), h')``: c' and h' [..., H] in the dtypes of c and h.
    """
    check_step_inputs("bs_lstm_step", carry, x, spec.features)
    _check_params("bs_lstm_step", spec, params, jnp.shape(x)[-1])
    return _cell_step(spec, params, tuple(carry), x)


def bs_lstm_sequence(spec: LSTMSpec, params, carry, xs):
    """A whole sequence of the block-sparse (m)LSTM, scanned with grouped weight gradients.

    Equal to scanning :func:`bs_lstm_step` over the leading axis of ``xs``, with the
    input projection of all timesteps in one product and one ``bsmm_updat`` per
    recurrent weight in the backward pass (a custom VJP: reverse mode only).

    Args:
      spec: the static configuration (:func:`lstm_spec`).
      params: dict name -> array with the shapes of ``spec.param_shapes(D)``.
      carry: (c, h), each [*batch, H] (or broadcastable to it), in any float dtype.
      xs: [T, *batch, D], time-major.

    Returns:
      ``((c_T, h_T), hs)``: the final carry [*batch, H] in the carry's dtypes and
      every step's h, [T, *batch, H].
    """
    if jnp.ndim(xs) < 2:
        raise ValueError(f"bs_lstm_sequence: xs must be [T, ..., D] (time-major), got shape {jnp.shape(xs)}")
    check_step_inputs("bs_lstm_sequence", carry, xs[0], spec.features)
    _check_params("bs_lstm_sequence", spec, params, jnp.shape(xs)[-1])
    return _sequence(spec, params, tuple(carry), xs)
