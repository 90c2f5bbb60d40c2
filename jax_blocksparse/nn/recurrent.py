"""Block-sparse recurrent cells (LSTM, multiplicative LSTM) and a fused sequence layer.

OpenAI's block-sparse LSTM (2017) made the recurrent weights block-sparse with a
small-world layout and, at every timestep, ran a few *internal steps* (a block-sparse
transition followed by layer norm) before the gates, so that information from every
unit reaches every other unit despite the sparsity. This module has:

* :class:`BlockSparseLSTMCell` and :class:`BlockSparseMLSTMCell`: ``flax.linen``
  RNN cells (the ``nn.RNN`` / ``nn.scan`` carry API), one timestep per call.
* :class:`BlockSparseLSTM`: the same cells over a whole sequence, with the input
  projection of all timesteps in one product and a custom backward pass that
  computes each recurrent weight gradient with a single ``bsmm_updat``.

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
their bias; the mLSTM factor is ``(h @ W_mh) * (x @ W_mx)``), and the cell with
``internal_steps=0`` is exactly ``flax.linen.LSTMCell`` with masked kernels.

Design choices:

* **The four gates share one layout and one product.** ``W_h`` is one block-sparse
  [H, 4H] weight whose mask is the base [H/bs, H/bs] mask tiled four times along the
  output axis (gate order i, f, g, o as in Flax), so one ``bsmm`` produces all four
  gate pre-activations; an explicit [H/bs, 4H/bs] mask may give each gate its own.
  Layer norm (when on) is per gate, as in OpenAI's code.
* **Internal steps** each have their own weight (and, optionally, their own layout)
  and use a ReLU after the layer norm by default (``internal_activation``), as
  OpenAI's mLSTM did: without a nonlinearity the internal steps compose into one
  linear map that only widens the receptive field; with it they also add depth.
  Use :func:`jax_blocksparse.layouts.mixing_steps` to choose their number:
  ``internal_steps = mixing_steps(mask) - 1`` lets every unit reach every other
  unit within one timestep.
* **The input projection** is dense by default (``input_mask=None``), or
  block-sparse with ``input_mask``.
* **Recurrent weight gradients in one call each.** Under ``nn.RNN`` (a scan over the
  cell), autodiff puts one small ``bsmm_updat`` (SDDMM) per recurrent weight in the
  backward scan body: T calls of B rows each. :class:`BlockSparseLSTM` wraps its scan
  in a ``jax.custom_vjp`` whose forward saves each product's input ``r`` and output
  ``z`` per step, whose backward scan computes cotangents only for activations
  (``bsmm(dz, W, transpose=True)``), and which then calls ``bsmm_updat`` once per
  recurrent weight on the stacked [T, B, in] inputs and [T, B, out] cotangents: a
  constant ``1 + internal_steps`` (+1 for mLSTM) calls however long the sequence.
  The input projection's weight gradient is also one call, by ordinary autodiff
  of the one projection over all timesteps.

Carries are kept in their own dtype (``param_dtype`` from ``initialize_carry``);
with ``dtype=jnp.bfloat16`` the products run in bfloat16 (float32 accumulation) while
the cell state and all elementwise math stay in float32. The kernel gradients are
then rounded to bfloat16 (as autodiff of a bfloat16 product gives them) unless
``float32_dw=True``: then every kernel gradient (block-sparse and the dense input
kernel) is the float32 accumulator of its weight-gradient product. On a GPU, XLA's
default ``--xla_allow_excess_precision`` may skip a rounding to 16 bits that is widened
straight back (the input kernel's gradient, whose product has a float32 output; the
gate inputs): README, "Mixed precision".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layout import Layout, check_block_size
from jax_blocksparse.nn import _common
from jax_blocksparse.ops._checks import varying_axes
from jax_blocksparse.ops.matmul import bsmm, bsmm_updat

Array = jax.Array
Initializer = Callable[..., Array]

__all__ = ["BlockSparseLSTM", "BlockSparseLSTMCell", "BlockSparseMLSTMCell"]

_F32 = jnp.float32


# ---------------------------------------------------------------------------------
# Static configuration shared by the linen and nnx cells
# ---------------------------------------------------------------------------------


def static_mask(mask, name: str, layer: str) -> _common.StaticMask:
    """A :class:`StaticMask` from a bool mask, a StaticMask or a concrete Layout."""
    if isinstance(mask, Layout):
        mask = np.asarray(mask.mask)
    try:
        return _common.StaticMask(mask)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{layer}: {name}: {err}") from None


@functools.lru_cache(maxsize=256)
def host_layout(mask: _common.StaticMask, block_size: int) -> Layout:
    """The (cached) layout of a static mask at its exact capacity; host index tables."""
    return _common.layout_for(mask, block_size, None)


@dataclasses.dataclass(frozen=True)
class _Stage:
    """One block-sparse product of the recurrence and the elementwise piece after it."""

    kind: str  # "mult" (mLSTM factor), "step" (internal step) or "gate"
    kernel: str  # parameter name of its [capacity, bs, bs] weight
    mask: _common.StaticMask
    small: tuple[str, ...]  # names of its vector parameters
    index: int = 0

    def layout(self, block_size) -> Layout:
        return host_layout(self.mask, block_size)


@dataclasses.dataclass(frozen=True)
class CellConfig:
    """Everything static about a block-sparse LSTM cell (validated, hashable).

    Built by :func:`cell_config`; shared by the linen and nnx cells so that both
    declare the same parameters and run the same math.
    """

    features: int
    block_size: int
    multiplicative: bool
    gate_mask: _common.StaticMask  # [H/bs, 4H/bs]
    step_masks: tuple[_common.StaticMask, ...]
    mh_mask: _common.StaticMask | None
    input_mask: _common.StaticMask | None  # [D/bs, G*H/bs] or None for dense
    layer_norm: bool
    epsilon: float

    @property
    def groups(self) -> int:
        """Number of H-wide groups in the input projection: 4 gates (+ m for mLSTM)."""
        return 5 if self.multiplicative else 4

    @property
    def internal_steps(self) -> int:
        return len(self.step_masks)

    @property
    def stages(self) -> tuple[_Stage, ...]:
        stages = []
        if self.multiplicative:
            small = ("mh_scale", "mh_bias") if self.layer_norm else ()
            stages.append(_Stage("mult", "mh_kernel", self.mh_mask, small))
        for i, m in enumerate(self.step_masks):
            small = (f"step{i}_scale", f"step{i}_bias") if self.layer_norm else (f"step{i}_bias",)
            stages.append(_Stage("step", f"step{i}_kernel", m, small, i))
        small = ("recurrent_scale",) if self.layer_norm else ()
        stages.append(_Stage("gate", "recurrent_kernel", self.gate_mask, small))
        return tuple(stages)

    def input_layout(self) -> Layout | None:
        if self.input_mask is None:
            return None
        return host_layout(self.input_mask, self.block_size)

    def param_shapes(self, in_features: int) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, for inputs of ``in_features`` features."""
        h = self.features
        self.check_in_features(in_features)
        shapes = {}
        if self.input_mask is None:
            shapes["input_kernel"] = (in_features, self.groups * h)
        else:
            shapes["input_kernel"] = self.input_layout().w_shape
        shapes["bias"] = (4 * h,)
        if self.layer_norm:
            shapes["input_scale"] = (self.groups * h,)
        for stage in self.stages:
            shapes[stage.kernel] = stage.layout(self.block_size).w_shape
            for name in stage.small:
                shapes[name] = (4 * h,) if stage.kind == "gate" else (h,)
        return shapes

    def check_in_features(self, in_features: int):
        if self.input_mask is not None and in_features != self.input_mask.shape[0] * self.block_size:
            raise ValueError(
                f"inputs must have {self.input_mask.shape[0]} * {self.block_size} = "
                f"{self.input_mask.shape[0] * self.block_size} features for input_mask of shape "
                f"{self.input_mask.shape}, got {in_features}"
            )


def cell_config(
    layer: str,
    features: int,
    mask,
    block_size,
    *,
    multiplicative: bool,
    internal_steps: int = 0,
    step_masks=None,
    mh_mask=None,
    input_mask=None,
    in_features: int | None = None,
    layer_norm: bool = True,
    epsilon: float = 1e-5,
) -> CellConfig:
    """Validates a cell's static arguments; raises ValueError naming shapes."""
    block_size = check_block_size(block_size)
    if isinstance(features, bool) or not isinstance(features, (int, np.integer)) or features <= 0:
        raise ValueError(f"{layer}: features must be a positive int, got {features!r}")
    features = int(features)
    if features % block_size:
        raise ValueError(f"{layer}: features ({features}) must be a multiple of block_size ({block_size})")
    hb = features // block_size
    mask = static_mask(mask, "mask", layer)
    if mask.shape == (hb, hb):
        base = mask
        gate_mask = _common.StaticMask(np.tile(mask.array, (1, 4)))
    elif mask.shape == (hb, 4 * hb):
        base = None
        gate_mask = mask
    else:
        raise ValueError(
            f"{layer}: mask must have shape [features/bs, features/bs] = {(hb, hb)} (shared by the 4 gates) "
            f"or [features/bs, 4*features/bs] = {(hb, 4 * hb)} (one block column range per gate), "
            f"got {mask.shape} (features={features}, block_size={block_size})"
        )
    if isinstance(internal_steps, bool) or not isinstance(internal_steps, (int, np.integer)) or internal_steps < 0:
        raise ValueError(f"{layer}: internal_steps must be an int >= 0, got {internal_steps!r}")
    internal_steps = int(internal_steps)

    def square(m, name):
        m = static_mask(m, name, layer)
        if m.shape != (hb, hb):
            raise ValueError(f"{layer}: {name} must have shape {(hb, hb)} = [features/bs, features/bs], got {m.shape}")
        return m

    def default_square(name):
        if base is None:
            raise ValueError(
                f"{layer}: {name} is required when mask has the per-gate shape {mask.shape}: "
                f"give a [features/bs, features/bs] = {(hb, hb)} mask"
            )
        return base

    if step_masks is None:
        steps = tuple(default_square("step_masks") for _ in range(internal_steps))
    else:
        if isinstance(step_masks, (np.ndarray, _common.StaticMask, Layout)) or hasattr(step_masks, "shape"):
            raise TypeError(f"{layer}: step_masks must be a sequence of masks (one per internal step), got one array")
        steps = tuple(square(m, f"step_masks[{i}]") for i, m in enumerate(step_masks))
        if len(steps) != internal_steps:
            raise ValueError(
                f"{layer}: got {len(steps)} step_masks for internal_steps={internal_steps}; give one mask per step"
            )
    mh = None
    if multiplicative:
        mh = square(mh_mask, "mh_mask") if mh_mask is not None else default_square("mh_mask")
    elif mh_mask is not None:
        raise ValueError(f"{layer}: mh_mask is only for the multiplicative LSTM")
    groups = 5 if multiplicative else 4
    imask = None
    if input_mask is not None:
        imask = static_mask(input_mask, "input_mask", layer)
        if imask.shape[1] == hb:
            imask = _common.StaticMask(np.tile(imask.array, (1, groups)))
        elif imask.shape[1] != groups * hb:
            raise ValueError(
                f"{layer}: input_mask must have shape [in_features/bs, {hb}] (tiled for the {groups} "
                f"input groups) or [in_features/bs, {groups * hb}], got {imask.shape}"
            )
    config = CellConfig(
        features, block_size, bool(multiplicative), gate_mask, steps, mh, imask, bool(layer_norm), float(epsilon)
    )
    if in_features is not None:
        try:
            config.check_in_features(int(in_features))
        except ValueError as err:
            raise ValueError(f"{layer}: {err}") from None
    return config


@functools.lru_cache(maxsize=256)
def _cached_config(layer, features, mask, block_size, multiplicative, internal_steps, step_masks, mh_mask,
                   input_mask, layer_norm, epsilon) -> CellConfig:
    return cell_config(
        layer, features, mask, block_size, multiplicative=multiplicative, internal_steps=internal_steps,
        step_masks=step_masks, mh_mask=mh_mask, input_mask=input_mask, layer_norm=layer_norm, epsilon=epsilon,
    )


def init_param(config: CellConfig, name: str, key, in_features: int, *, kernel_init, recurrent_kernel_init,
               bias_init, param_dtype):
    """The initial value of one parameter.

    Block-sparse kernels default to LeCun normal with their true fan-in (see
    :func:`jax_blocksparse.nn._common.default_kernel_init`); a dense input kernel to
    ``flax.linen.initializers.lecun_normal()``; scales to one, biases to ``bias_init``
    (the gate bias) or zero (internal-step and mLSTM biases).
    """
    shapes = config.param_shapes(in_features)
    shape = shapes[name]
    if name == "input_kernel":
        if config.input_mask is None:
            init = kernel_init if kernel_init is not None else nn.initializers.lecun_normal()
            return init(key, shape, param_dtype)
        return _common.init_kernel(kernel_init, key, config.input_layout(), config.input_mask, param_dtype)
    if name == "bias":
        return bias_init(key, shape, param_dtype)
    if name.endswith("_scale"):
        return jnp.ones(shape, param_dtype)
    if name.endswith("_bias"):
        return jnp.zeros(shape, param_dtype)
    stage = next(s for s in config.stages if s.kernel == name)
    return _common.init_kernel(recurrent_kernel_init, key, stage.layout(config.block_size), stage.mask, param_dtype)


# ---------------------------------------------------------------------------------
# The math (pure functions of a params dict), shared by cells and sequence layers
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Fns:
    """Per-call settings: the static config plus functions and dtypes."""

    config: CellConfig
    gate_fn: Callable
    activation_fn: Callable
    internal_activation: Callable | None
    dtype: Any  # compute dtype of the products
    float32_dw: bool = False  # kernel gradients from the float32 accumulators


def _product_weights(fns: _Fns, weights):
    """Kernels as the products take them: float32 with ``float32_dw``, else in the compute dtype."""
    return tuple(weights) if fns.float32_dw else tuple(w.astype(fns.dtype) for w in weights)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _dense_f32_dw(x, kernel, compute):
    """``x @ kernel`` in ``compute`` (float32 accumulation and result) for a float32 kernel
    whose gradient stays float32: the dense counterpart of ``bsmm(..., float32_dw=True)``.

    The tangent in the kernel is a float32 product of the (exactly) widened ``x``, so
    its transpose is the float32 accumulator ``x.T @ dy``, never rounded to ``compute``.
    """
    return jnp.matmul(x.astype(compute), kernel.astype(compute), preferred_element_type=_F32)


@_dense_f32_dw.defjvp
def _dense_f32_dw_jvp(compute, primals, tangents):
    x, kernel = primals
    tx, tk = tangents
    xc = x.astype(compute)
    y = jnp.matmul(xc, kernel.astype(compute), preferred_element_type=_F32)
    ty = jnp.matmul(tx.astype(compute), kernel.astype(compute), preferred_element_type=_F32)
    ty = ty + jnp.matmul(xc.astype(_F32), tk.astype(_F32), preferred_element_type=_F32)
    return y, ty


def _group_norm(z, groups: int, eps: float):
    """Layer norm (no gain) over each of ``groups`` equal slices of the last axis, in float32."""
    z = z.astype(_F32)
    g = z.reshape(*z.shape[:-1], groups, z.shape[-1] // groups)
    mean = jnp.mean(g, axis=-1, keepdims=True)
    centered = g - mean
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    return (centered * jax.lax.rsqrt(var + eps)).reshape(z.shape)


def project_inputs(fns: _Fns, params, x):
    """Input part of the gates (and the mLSTM input factor) for inputs x [..., D].

    Returns ``(xg [..., 4H], xm [..., H] or None)`` in the compute dtype; ``xg``
    includes the gate bias.
    """
    cfg, h = fns.config, fns.config.features
    x = x.astype(fns.dtype)
    (kernel,) = _product_weights(fns, (params["input_kernel"],))
    if cfg.input_mask is None and fns.float32_dw and np.dtype(fns.dtype) != np.dtype(_F32):
        p = _dense_f32_dw(x, kernel, np.dtype(fns.dtype))
    elif cfg.input_mask is None:
        p = jnp.matmul(x, kernel, preferred_element_type=_F32)
    else:
        p = bsmm(
            x, kernel, cfg.input_layout(), preferred_element_type=_F32, compute_dtype=fns.dtype,
            float32_dw=fns.float32_dw,
        )
    if cfg.layer_norm:
        p = _group_norm(p, cfg.groups, cfg.epsilon) * params["input_scale"].astype(_F32)
    xg = (p[..., : 4 * h] + params["bias"].astype(_F32)).astype(fns.dtype)
    xm = p[..., 4 * h :].astype(fns.dtype) if cfg.multiplicative else None
    return xg, xm


def _mult_piece(fns: _Fns, z, xm, small):
    """mLSTM: m = LN(h W_mh) * (LN(x W_mx))."""
    a = z.astype(_F32)
    if fns.config.layer_norm:
        a = _group_norm(a, 1, fns.config.epsilon) * small["mh_scale"].astype(_F32) + small["mh_bias"].astype(_F32)
    return (a * xm.astype(_F32)).astype(fns.dtype)


def _step_piece(fns: _Fns, stage: _Stage, z, small):
    """Internal step: act(LN(r W_i) * scale + bias)."""
    a = z.astype(_F32)
    i = stage.index
    if fns.config.layer_norm:
        a = _group_norm(a, 1, fns.config.epsilon) * small[f"step{i}_scale"].astype(_F32)
    a = a + small[f"step{i}_bias"].astype(_F32)
    if fns.internal_activation is not None:
        a = fns.internal_activation(a)
    return a.astype(fns.dtype)


def _gate_piece(fns: _Fns, z, xg, c, h_dtype, small):
    """All four gates and the state update in one elementwise pass (float32)."""
    g = z.astype(_F32)
    if fns.config.layer_norm:
        g = _group_norm(g, 4, fns.config.epsilon) * small["recurrent_scale"].astype(_F32)
    g = g + xg.astype(_F32)
    i, f, u, o = jnp.split(g, 4, axis=-1)
    new_c = fns.gate_fn(f) * c.astype(_F32) + fns.gate_fn(i) * fns.activation_fn(u)
    new_h = fns.gate_fn(o) * fns.activation_fn(new_c)
    return new_c.astype(c.dtype), new_h.astype(h_dtype)


def _piece(fns: _Fns, stage: _Stage, z, aux, carry_c, h_dtype, small):
    """The elementwise function after ``stage``'s product."""
    if stage.kind == "mult":
        return _mult_piece(fns, z, aux[1], small)
    if stage.kind == "step":
        return _step_piece(fns, stage, z, small)
    return _gate_piece(fns, z, aux[0], carry_c, h_dtype, small)


def _split_params(fns: _Fns, params):
    stages = fns.config.stages
    weights = tuple(params[s.kernel] for s in stages)
    small = tuple({name: params[name] for name in s.small} for s in stages)
    return weights, small


def _chain(fns: _Fns, weights, small, carry, aux):
    """One timestep of the recurrence given the projected inputs ``aux = (xg, xm)``.

    ``weights`` come from :func:`_product_weights`. Returns the new carry and, per
    stage, the product's input ``r`` and output ``z`` (what the backward pass needs).
    """
    c, h = carry
    bs = fns.config.block_size
    r = h.astype(fns.dtype)
    rs, zs = [], []
    for stage, w, sm in zip(fns.config.stages, weights, small):
        z = bsmm(r, w, stage.layout(bs), compute_dtype=fns.dtype, float32_dw=fns.float32_dw)
        rs.append(r)
        zs.append(z)
        out = _piece(fns, stage, z, aux, c, h.dtype, sm)
        if stage.kind == "gate":
            c, h = out
        else:
            r = out
    return (c, h), rs, zs


def cell_step(fns: _Fns, params, carry, x):
    """One timestep: carry (c, h) [..., H], x [..., D] -> (new carry, h)."""
    aux = project_inputs(fns, params, x)
    weights, small = _split_params(fns, params)
    (c, h), _, _ = _chain(fns, _product_weights(fns, weights), small, carry, aux)
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
        return jax.lax.pcast(a, missing, to="varying") if missing else a

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
def _recurrence(fns: _Fns):
    """The scan over time with a custom VJP (see the module docstring).

    ``run(weights, small, aux, carry0) -> (hs [T, B, H], (c_T, h_T))`` with
    ``aux = (xg [T, B, 4H], xm [T, B, H] or None)``.

    Forward (when differentiated): saves, per step and stage, the product's input
    ``r`` [B, in] and output ``z`` [B, out], and the previous cell state. Backward: a
    reverse scan that re-runs only the elementwise pieces (their VJPs) and one
    ``bsmm(dz, W, transpose=True)`` per stage, accumulating the small (vector)
    parameters' gradients in its carry; then one ``bsmm_updat`` per stage on the
    stacked [T, B, in] and [T, B, out] arrays (all T*B rows at once). No product is recomputed.
    """
    stages = fns.config.stages
    bs = fns.config.block_size

    def scan_forward(weights, small, aux, carry0, save):
        wc = _product_weights(fns, weights)

        def body(carry, aux_t):
            new_carry, rs, zs = _chain(fns, wc, small, carry, aux_t)
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
        wc = tuple(w.astype(fns.dtype) for w in weights)
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
                    fn = lambda z, xg, c, sm: _gate_piece(fns, z, xg, c, h_dtype, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], aux_t[0], c_prev_t, small[k])
                    dz, daux[0], dc, ds = vjp((dc, dh))
                elif stage.kind == "mult":
                    fn = lambda z, xm, sm: _mult_piece(fns, z, xm, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], aux_t[1], small[k])
                    dz, daux[1], ds = vjp(dr)
                else:
                    fn = lambda z, sm, _s=stage: _step_piece(fns, _s, z, sm)  # noqa: E731
                    _, vjp = jax.vjp(fn, zs_t[k], small[k])
                    dz, ds = vjp(dr)
                dsmall[k] = jax.tree.map(jnp.add, dsmall[k], ds)
                dzs[k] = dz
                dr = bsmm(dz, wc[k], stage.layout(bs), transpose=True)
            dh_prev = dr.astype(dh.dtype)
            daux_t = tuple(d for d in daux if d is not None)
            return (dc, dh_prev, tuple(dsmall)), (tuple(dzs), daux_t)

        # dsmall keeps small's type: each step's vjp already sums an invariant one's share.
        init = (*_vary_like((ct_c, ct_h), ct_hs, aux), zero_small)
        (dc0, dh0, dsmall), (dzs, daux) = jax.lax.scan(body, init, (ct_hs, aux, zs, c_prev), reverse=True)
        # One SDDMM per recurrent weight over all T*B rows, accumulated in float32 and
        # delivered as autodiff of the cell would: rounded to the compute dtype, unless
        # float32_dw.
        dw_dtype = _F32 if fns.float32_dw else fns.dtype
        dweights = tuple(
            bsmm_updat(r, dz, stage.layout(bs), out_dtype=dw_dtype).astype(w.dtype)
            for stage, w, r, dz in zip(stages, weights, rs, dzs)
        )
        daux_full = (daux[0], daux[1] if aux[1] is not None else None)
        return _sum_like((dweights, dsmall, daux_full, (dc0, dh0)), (weights, small, aux, carry0))

    run.defvjp(run_fwd, run_bwd)
    return run


def sequence(fns: _Fns, params, carry, xs):
    """The whole sequence: xs [T, *batch, D] (time-major) -> (final carry, hs [T, *batch, H])."""
    t = xs.shape[0]
    batch = xs.shape[1:-1]
    n = math.prod(batch)
    h = fns.config.features
    # One product for all steps. Leading dims stay apart (no [T * n, D] reshape): with
    # the batch split over devices, merging it under T would make XLA gather it.
    xg, xm = project_inputs(fns, params, xs)
    aux = (xg.reshape(t, n, 4 * h), None if xm is None else xm.reshape(t, n, h))
    c0, h0 = carry
    c0 = jnp.broadcast_to(c0, batch + (h,)).reshape(n, h)
    h0 = jnp.broadcast_to(h0, batch + (h,)).reshape(n, h)
    weights, small = _split_params(fns, params)
    hs, (c_t, h_t) = _recurrence(fns)(weights, small, aux, (c0, h0))
    return (c_t.reshape(batch + (h,)), h_t.reshape(batch + (h,))), hs.reshape((t,) + batch + (h,))


def compute_dtype(dtype, inputs, param_dtype):
    """Flax's rule: ``dtype`` if given, else the promotion of the inputs and params."""
    if dtype is not None:
        return np.dtype(dtype)
    return np.dtype(jnp.result_type(inputs, param_dtype))


def check_step_inputs(layer: str, carry, inputs, features: int):
    if not isinstance(carry, (tuple, list)) or len(carry) != 2:
        raise ValueError(f"{layer}: carry must be a pair (c, h) from initialize_carry, got {type(carry).__name__}")
    c, h = carry
    if jnp.shape(c)[-1:] != (features,) or jnp.shape(h)[-1:] != (features,):
        raise ValueError(
            f"{layer}: carry (c, h) must have shape [..., {features}], got {jnp.shape(c)} and {jnp.shape(h)}"
        )
    if jnp.ndim(inputs) < 1:
        raise ValueError(f"{layer}: inputs must have shape [..., in_features], got {jnp.shape(inputs)}")


# ---------------------------------------------------------------------------------
# Linen cells
# ---------------------------------------------------------------------------------


class BlockSparseLSTMCell(nn.RNNCellBase):
    """An LSTM cell with block-sparse recurrent weights, internal steps and layer norm.

    A ``flax.linen`` RNN cell: use it with ``nn.RNN`` (or ``nn.scan``), or give it to
    :class:`BlockSparseLSTM` to run a whole sequence with fused input projection and
    grouped weight gradients (same parameters). The math is in
    :mod:`jax_blocksparse.nn.recurrent`; with ``layer_norm=False`` and
    ``internal_steps=0`` it is ``nn.LSTMCell`` with masked kernels.

    Example::

        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jax_blocksparse as jbs
        >>> mask = jbs.layouts.barabasi_albert(8, 2, seed=0)        # [8, 8] blocks
        >>> cell = jbs.nn.BlockSparseLSTMCell(128, mask, 16, internal_steps=2)
        >>> x = jnp.ones((4, 10, 32))                                # [B, T, D]
        >>> rnn = nn.RNN(cell)
        >>> params = rnn.init(jax.random.key(0), x)
        >>> rnn.apply(params, x).shape
        (4, 10, 128)
        >>> fast = jbs.nn.BlockSparseLSTM(cell)                     # same params, fused
        >>> bool(jnp.allclose(fast.apply(params, x), rnn.apply(params, x), atol=1e-5))
        True

    Attributes:
      features: hidden size H, a multiple of ``block_size``.
      mask: recurrent block mask, bool [H/bs, H/bs] shared by the four gates (the
        gate weight [H, 4H] uses it tiled four times), or [H/bs, 4H/bs] for one
        mask per gate (order i, f, g, o). A concrete :class:`~jax_blocksparse.Layout`
        is accepted too.
      block_size: 8, 16, 32, 64 or 128.
      internal_steps: number of internal steps per timestep (default 0).
      step_masks: one [H/bs, H/bs] mask per internal step; default ``mask``.
      input_mask: None for a dense input projection [D, 4H]; else a block mask
        [D/bs, H/bs] (tiled for the four gates) or [D/bs, 4H/bs].
      layer_norm: layer norm on the input projection (per gate), the recurrent gate
        product (per gate) and every internal step (default True).
      internal_activation: the nonlinearity after each internal step (default
        ``nn.relu``, as OpenAI's mLSTM); None for none.
      gate_fn, activation_fn: as ``nn.LSTMCell`` (sigmoid, tanh).
      kernel_init: initializer of the input kernel; None means LeCun normal (with
        the true fan-in when ``input_mask`` is given).
      recurrent_kernel_init: initializer of the block-sparse recurrent kernels,
        called as ``init(key, (capacity, bs, bs), dtype)``; None means LeCun normal
        with the true fan-in.
      bias_init: initializer of the gate bias [4H] (default zeros).
      dtype: computation dtype of the products (default: inferred from inputs and
        params); elementwise math and the cell state stay in float32.
      param_dtype: parameter (and carry) dtype (default float32).
      carry_init: initializer of the carry (default zeros).
      epsilon: layer-norm epsilon.
      float32_dw: keep every kernel gradient in float32 when ``dtype`` is 16-bit,
        straight from the float32 accumulator of its weight-gradient product (see
        :func:`jax_blocksparse.bsmm`); also in :class:`BlockSparseLSTM`. Needs
        ``param_dtype`` float32. Default False: each kernel gradient is rounded to
        ``dtype``, then widened; on a GPU with XLA's default flags the input kernel's
        rounding (an XLA cast widened straight back) may be skipped, see README,
        "Mixed precision" (``XLA_FLAGS=--xla_allow_excess_precision=false`` keeps it).
    """

    multiplicative: ClassVar[bool] = False

    features: int
    mask: Any
    block_size: int
    internal_steps: int = 0
    step_masks: Sequence[Any] | None = None
    input_mask: Any = None
    layer_norm: bool = True
    internal_activation: Callable[..., Any] | None = nn.relu
    gate_fn: Callable[..., Any] = nn.sigmoid
    activation_fn: Callable[..., Any] = nn.tanh
    kernel_init: Initializer | None = None
    recurrent_kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    carry_init: Initializer = nn.initializers.zeros_init()
    epsilon: float = 1e-5
    float32_dw: bool = False

    def _mh_mask(self):
        return None

    def __post_init__(self):
        self.float32_dw = _common.check_float32_dw(self.float32_dw, self.param_dtype, type(self).__name__)
        config = cell_config(
            type(self).__name__, self.features, self.mask, self.block_size,
            multiplicative=self.multiplicative, internal_steps=self.internal_steps, step_masks=self.step_masks,
            mh_mask=self._mh_mask(), input_mask=self.input_mask, layer_norm=self.layer_norm, epsilon=self.epsilon,
        )
        # Keep every mask hashable (the module is a jit cache key / static argument).
        self.mask = static_mask(self.mask, "mask", type(self).__name__)
        if self.step_masks is not None:
            self.step_masks = config.step_masks
        if self.input_mask is not None:
            self.input_mask = static_mask(self.input_mask, "input_mask", type(self).__name__)
        self.block_size = config.block_size
        super().__post_init__()

    @property
    def config(self) -> CellConfig:
        """The validated static configuration (layouts: ``config.stages[k].layout(bs)``)."""
        return _cached_config(
            type(self).__name__, self.features, self.mask, self.block_size, self.multiplicative,
            self.internal_steps, self.step_masks, self._mh_mask(), self.input_mask, self.layer_norm, self.epsilon,
        )

    @property
    def recurrent_layout(self) -> Layout:
        """Layout of ``recurrent_kernel``: [H, 4H], the gates' shared mask tiled 4 times."""
        return host_layout(self.config.gate_mask, self.block_size)

    def layout_of(self, param_name: str) -> Layout | None:
        """The layout of a block-sparse kernel parameter, by name (None for a dense one)."""
        config = self.config
        if param_name == "input_kernel":
            return config.input_layout()
        for stage in config.stages:
            if stage.kernel == param_name:
                return stage.layout(self.block_size)
        raise KeyError(f"{type(self).__name__} has no block-sparse kernel named {param_name!r}")

    @nn.compact
    def _params(self, in_features: int) -> dict[str, Array]:
        config = self.config
        try:
            shapes = config.param_shapes(in_features)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        out = {}
        for name in shapes:
            out[name] = self.param(
                name,
                lambda key, _n=name: init_param(
                    config, _n, key, in_features, kernel_init=self.kernel_init,
                    recurrent_kernel_init=self.recurrent_kernel_init, bias_init=self.bias_init,
                    param_dtype=self.param_dtype,
                ),
            )
        return out

    def _fns(self, inputs) -> _Fns:
        return _Fns(self.config, self.gate_fn, self.activation_fn, self.internal_activation,
                    compute_dtype(self.dtype, inputs, self.param_dtype), self.float32_dw)

    def __call__(self, carry, inputs):
        """One timestep.

        Args:
          carry: (c, h), each [..., H], from :meth:`initialize_carry`.
          inputs: [..., D]; all but the last axis are batch axes.

        Returns:
          ``((c', h'), h')``.
        """
        check_step_inputs(type(self).__name__, carry, inputs, self.features)
        params = self._params(jnp.shape(inputs)[-1])
        return cell_step(self._fns(inputs), params, tuple(carry), inputs)

    def sequence(self, carry, inputs):
        """A whole sequence at once (what :class:`BlockSparseLSTM` calls).

        Args:
          carry: (c, h), each [*batch, H].
          inputs: [T, *batch, D], time-major.

        Returns:
          ``((c_T, h_T), outputs [T, *batch, H])``, equal to scanning ``__call__``,
          with the input projection in one product and one ``bsmm_updat`` per
          recurrent weight in the backward pass.
        """
        if jnp.ndim(inputs) < 2:
            raise ValueError(f"{type(self).__name__}.sequence: inputs must be [T, ..., D], got {jnp.shape(inputs)}")
        check_step_inputs(type(self).__name__, carry, inputs[0], self.features)
        params = self._params(jnp.shape(inputs)[-1])
        return sequence(self._fns(inputs), params, tuple(carry), inputs)

    @nn.nowrap
    def initialize_carry(self, rng, input_shape: tuple[int, ...]):
        """(c, h) of shape ``input_shape[:-1] + (features,)`` and dtype ``param_dtype``."""
        batch_dims = tuple(input_shape[:-1])
        key1, key2 = jax.random.split(rng)
        mem_shape = batch_dims + (self.features,)
        return (self.carry_init(key1, mem_shape, self.param_dtype), self.carry_init(key2, mem_shape, self.param_dtype))

    @property
    def num_feature_axes(self) -> int:
        return 1


class BlockSparseMLSTMCell(BlockSparseLSTMCell):
    """A multiplicative LSTM (Krause et al. 2016) cell with block-sparse recurrent weights.

    ``m = (x @ W_mx) * (h @ W_mh)`` replaces ``h`` as the input of the internal steps
    and the gates (with layer norm on both factors when ``layer_norm``). ``W_mx`` is
    part of the input projection (``input_kernel`` is [D, 5H]: four gates then m);
    ``W_mh`` is block-sparse with ``mh_mask`` (default ``mask``).

    Same attributes as :class:`BlockSparseLSTMCell`, plus ``mh_mask`` (bool
    [H/bs, H/bs]). Works with ``nn.RNN`` and :class:`BlockSparseLSTM`.

    Example::

        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nn.BlockSparseMLSTMCell(64, jbs.layouts.barabasi_albert(4, 1), 16)
        >>> rnn = jbs.nn.BlockSparseLSTM(cell)
        >>> params = rnn.init(jax.random.key(0), jnp.ones((2, 5, 8)))
        >>> rnn.apply(params, jnp.ones((2, 5, 8))).shape
        (2, 5, 64)
    """

    multiplicative: ClassVar[bool] = True
    mh_mask: Any = None

    def _mh_mask(self):
        return self.mh_mask

    def __post_init__(self):
        if self.mh_mask is not None:
            self.mh_mask = static_mask(self.mh_mask, "mh_mask", type(self).__name__)
        super().__post_init__()


class BlockSparseLSTM(nn.Module):
    """A block-sparse LSTM over a whole sequence: ``nn.RNN(cell)``, fused.

    Takes a :class:`BlockSparseLSTMCell` or :class:`BlockSparseMLSTMCell` and has
    the same parameters as ``nn.RNN(cell)`` (under ``"cell"``), so the two are
    interchangeable. It projects the inputs of all timesteps with one product
    ([B*T, D] @ W_in), runs the recurrence with ``lax.scan``, and in the backward pass
    computes each recurrent weight gradient with one ``bsmm_updat`` over all timesteps
    (see :mod:`jax_blocksparse.nn.recurrent`). Forward-mode autodiff (``jax.jvp``) is
    not supported through it (it has a custom VJP); use ``nn.RNN(cell)`` for that.

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> cell = jbs.nn.BlockSparseLSTMCell(128, jbs.layouts.barabasi_albert(8, 2), 16)
        >>> lstm = jbs.nn.BlockSparseLSTM(cell, return_carry=True)
        >>> x = jnp.ones((4, 10, 32))                               # [B, T, D]
        >>> params = lstm.init(jax.random.key(0), x)
        >>> (c, h), y = lstm.apply(params, x)
        >>> y.shape, h.shape
        ((4, 10, 128), (4, 128))

    Attributes:
      cell: the cell (its configuration and parameters).
      time_major: inputs are [T, *batch, D] instead of [*batch, T, D].
      return_carry: also return the final carry: ``(carry, outputs)``.
    """

    cell: BlockSparseLSTMCell
    time_major: bool = False
    return_carry: bool = False

    def __call__(self, inputs, *, initial_carry=None, init_key=None, return_carry: bool | None = None):
        """Runs the cell over the time axis.

        Args:
          inputs: [*batch, T, D] (or [T, *batch, D] with ``time_major``).
          initial_carry: (c, h) [*batch, H]; default ``cell.initialize_carry``.
          init_key: key for ``cell.initialize_carry`` (default ``random.key(0)``).
          return_carry: overrides the attribute.

        Returns:
          outputs [*batch, T, H] (or time-major), or ``((c_T, h_T), outputs)``.
        """
        if not isinstance(self.cell, BlockSparseLSTMCell):
            raise TypeError(f"BlockSparseLSTM: cell must be a BlockSparseLSTMCell or BlockSparseMLSTMCell, "
                            f"got {type(self.cell).__name__}")
        return run_sequence(self.cell, inputs, self.time_major, initial_carry,
                            return_carry if return_carry is not None else self.return_carry,
                            lambda shape: self.cell.initialize_carry(
                                init_key if init_key is not None else jax.random.key(0), shape))


def run_sequence(cell, inputs, time_major, initial_carry, return_carry, initialize_carry):
    """Shared body of the linen and nnx sequence layers."""
    if jnp.ndim(inputs) < 2:
        raise ValueError(f"BlockSparseLSTM: inputs must be [*batch, T, D] (at least 2-D), got {jnp.shape(inputs)}")
    xs = inputs if time_major else jnp.moveaxis(inputs, -2, 0)
    carry = initial_carry if initial_carry is not None else initialize_carry(xs.shape[1:])
    carry, ys = cell.sequence(carry, xs)
    if not time_major:
        ys = jnp.moveaxis(ys, 0, -2)
    return (carry, ys) if return_carry else ys
