"""The block-sparse mixture-of-experts layer's core: its checks, router, losses and forward pass.

Framework-neutral (no flax): :class:`jax_blocksparse.nn.BlockSparseMoE` and
:class:`jax_blocksparse.nnx.BlockSparseMoE` declare the parameters and call
:func:`forward`. The layer is dropless: every token reaches its ``top_k`` experts, its
rows padded per expert to a block multiple (:mod:`jax_blocksparse.ops.moe`), and the
experts' MLPs are two block-sparse products over the routing's topology.

* :func:`route`: the router in float32 whatever the layer's ``dtype``: softmax or
  sigmoid scores, the top-k experts of each token (ties to the lower expert index, as
  :func:`jax.lax.top_k` breaks them), optionally renormalised gates.
* :func:`load_balancing_loss` (Switch Transformer) and :func:`router_z_loss` (ST-MoE).
* :func:`forward`: the whole layer, returning the output and what it measured
  (:class:`MoEStats`: tokens per expert, the two losses).

Parameters (:func:`param_shapes`): ``router`` [D, E]; ``w_in`` [D, E, F] (expert e's
input projection is ``w_in[:, e]``); ``w_gate`` [D, E, F] for a gated (GLU) MLP;
``w_out`` [D, E, F], expert e's output projection transposed (``w_out[:, e].T`` is its
[F, D]), the layout the down product reads without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_blocksparse.layers.common import canonicalize_dtype
from jax_blocksparse.layout import check_block_size
from jax_blocksparse.ops import moe as _moe
from jax_blocksparse.sharding import shard_map

__all__ = [
    "GATES",
    "MoEConfig",
    "MoEStats",
    "Routed",
    "apply",
    "check_moe",
    "default_init",
    "exchange_rows",
    "forward",
    "forward_expert_parallel",
    "load_balancing_loss",
    "param_shapes",
    "route",
    "router_logits",
    "router_z_loss",
]

#: The router's score functions: a softmax over the experts, or a sigmoid per expert.
GATES = ("softmax", "sigmoid")


class MoEConfig(NamedTuple):
    """A MoE layer's static configuration, checked by :func:`check_moe`."""

    num_experts: int
    ffn: int
    top_k: int
    block_size: int
    gate: str
    renormalize: bool
    glu: bool


def _count(name: str, value, layer: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{layer}: {name} must be a positive int, got {value!r}")
    return int(value)


def check_moe(num_experts, ffn, top_k, block_size, gate, renormalize, glu, layer: str) -> MoEConfig:
    """The layer's configuration, checked: a ValueError / TypeError naming ``layer``."""
    num_experts, ffn, top_k = (
        _count(n, v, layer) for n, v in (("num_experts", num_experts), ("ffn", ffn), ("top_k", top_k))
    )
    block_size = check_block_size(block_size, name=f"{layer}: block_size")
    if top_k > num_experts:
        raise ValueError(f"{layer}: top_k={top_k} is more than num_experts={num_experts}")
    if ffn % block_size:
        raise ValueError(f"{layer}: ffn={ffn} must be a multiple of block_size={block_size}")
    if gate not in GATES:
        raise ValueError(f"{layer}: gate must be one of {GATES}, got {gate!r}")
    for name, value in (("renormalize", renormalize), ("glu", glu)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{layer}: {name} must be a bool, got {value!r}")
    return MoEConfig(num_experts, ffn, top_k, block_size, gate, bool(renormalize), bool(glu))


def param_shapes(config: MoEConfig, in_features: int) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` of the layer's parameters for inputs [..., in_features]."""
    d, e, f = in_features, config.num_experts, config.ffn
    shapes = {"router": (d, e), "w_in": (d, e, f), "w_out": (d, e, f)}
    if config.glu:
        shapes["w_gate"] = (d, e, f)
    return shapes


def default_init(name: str) -> Callable:
    """The default initializer of a parameter: LeCun normal over each expert's true fan-in
    (D for ``router``, ``w_in`` and ``w_gate``; F for ``w_out``, stored transposed)."""
    if name == "w_out":
        return jax.nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=-1, out_axis=0, batch_axis=1
        )
    if name == "router":
        return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=1)
    return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=-1, batch_axis=1)


class Routed(NamedTuple):
    """The router's decision for T tokens.

    Attributes:
      gates: float32 [T, k]: the weight of each chosen expert.
      experts: int32 [T, k]: the chosen experts, best first.
      probs: float32 [T, E]: the scores of every expert (softmax or sigmoid).
      logits: float32 [T, E]: the router's logits.
    """

    gates: jax.Array
    experts: jax.Array
    probs: jax.Array
    logits: jax.Array


def route(logits, top_k: int, gate: str = "softmax", renormalize: bool = False) -> Routed:
    """The top-k experts of each token, in float32.

    Args:
      logits: [T, E] (any float dtype; widened to float32).
      top_k: experts per token.
      gate: ``"softmax"`` (scores sum to 1 over the experts) or ``"sigmoid"`` (each in (0, 1)).
      renormalize: divide each token's k gates by their sum.

    Ties go to the lower expert index (:func:`jax.lax.top_k`), so a routing is a
    deterministic function of the logits.

    Example::

        >>> import jax.numpy as jnp
        >>> from jax_blocksparse.layers.moe import route
        >>> r = route(jnp.array([[0.0, 2.0, 2.0, 1.0]]), 2)
        >>> r.experts.tolist(), round(float(r.gates.sum()), 4)
        ([[1, 2]], 0.799)
    """
    logits = jnp.asarray(logits, jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1) if gate == "softmax" else jax.nn.sigmoid(logits)
    gates, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    return Routed(gates, experts.astype(jnp.int32), probs, logits)


def router_logits(x, router):
    """float32 [T, E]: ``x`` [T, D] times the router [D, E], in float32 at HIGHEST precision
    whatever their dtypes (routing decisions should not round)."""
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _balance(fraction, mean_probs, num_experts: int):
    """``E * sum_e fraction_e * mean_probs_e``: the load-balancing loss from its two factors."""
    return num_experts * jnp.sum(fraction * mean_probs)


def load_balancing_loss(probs, experts, num_experts: int):
    """Switch Transformer's auxiliary loss: ``E * sum_e f_e * P_e``, float32 scalar.

    ``f_e`` is the fraction of the routed choices (T * k) that went to expert e, ``P_e``
    the mean score of expert e over the tokens. 1 when routing is uniform; up to E when
    every token goes to one expert.
    """
    counts = jnp.zeros(num_experts, jnp.float32).at[experts.reshape(-1)].add(1.0)
    return _balance(counts / experts.size, jnp.mean(probs.astype(jnp.float32), axis=0), num_experts)


def router_z_loss(logits):
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``, float32 scalar."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=-1)))


#: The experts' parameters, [D, E, F] each (``w_gate`` with ``glu`` only).
_EXPERT_WEIGHTS = ("w_in", "w_gate", "w_out")


class MoEStats(NamedTuple):
    """What one call of the layer measured (sown by the Flax layers).

    Attributes:
      expert_counts: int32 [E]: tokens routed to each expert (choices counted).
      load_balancing_loss: float32 scalar (:func:`load_balancing_loss`).
      router_z_loss: float32 scalar (:func:`router_z_loss`).
      overflow: int32 scalar: the choices dropped because an expert-parallel exchange
        buffer was full (:func:`forward_expert_parallel` with a ``capacity_factor``);
        0 for a dropless layer.
    """

    expert_counts: jax.Array
    load_balancing_loss: jax.Array
    router_z_loss: jax.Array
    overflow: jax.Array


def _experts(rows, params: dict, topology, config: MoEConfig, activation, precision, impl):
    """The experts' MLPs on the dispatched rows [R, D] -> [R, D] in ``rows``' dtype: the up
    product (and the gate's, with ``glu``), the activation, the down product.
    ``params``: ``w_in``, ``w_out`` (and ``w_gate``) [D, E, F], the experts here."""
    weights = {n: params[n].astype(rows.dtype).reshape(rows.shape[-1], -1) for n in _EXPERT_WEIGHTS if n in params}
    hidden = _moe.expert_up(rows, weights["w_in"], topology, precision=precision, impl=impl)
    if config.glu:
        hidden = activation(_moe.expert_up(rows, weights["w_gate"], topology, precision=precision, impl=impl)) * hidden
    else:
        hidden = activation(hidden)
    return _moe.expert_down(hidden, weights["w_out"], topology, precision=precision, impl=impl)


def forward(
    inputs,
    params: dict,
    config: MoEConfig,
    *,
    activation: Callable = jax.nn.gelu,
    dtype=None,
    precision=None,
    impl: str | None = None,
    layer: str = "BlockSparseMoE",
) -> tuple[jax.Array, MoEStats]:
    """The dropless MoE layer: route, dispatch, the experts' block-sparse MLPs, combine.

    Args:
      inputs: [..., D]; every position is a token.
      params: ``{"router", "w_in", "w_out"[, "w_gate"]}`` with :func:`param_shapes`' shapes.
      config: the checked :class:`MoEConfig`.
      activation: the MLP's nonlinearity (of the gate branch with ``glu``).
      dtype: the computation's dtype (None: promote inputs and params); the router is
        float32 whatever it is.
      precision, impl: the products' (:func:`jax_blocksparse.bsmm`).
      layer: the layer's name, for errors.

    Returns:
      ``(outputs [..., D] in the compute dtype, MoEStats)``.
    """
    inputs, d = _check_inputs(inputs, params, config, layer)
    x = inputs.reshape(-1, d)
    routed = route(router_logits(x, params["router"]), config.top_k, config.gate, config.renormalize)

    compute = canonicalize_dtype(inputs, params["w_in"], dtype=dtype)
    topology = _moe.route_topology(routed.experts, config.num_experts, config.ffn, config.block_size)
    out_rows = _experts(
        _moe.dispatch(x.astype(compute), topology), params, topology, config, activation, precision, impl
    )
    out = _moe.combine(out_rows, routed.gates.astype(compute), topology)
    stats = MoEStats(
        topology.counts,
        load_balancing_loss(routed.probs, routed.experts, config.num_experts),
        router_z_loss(routed.logits),
        jnp.zeros((), jnp.int32),
    )
    return out.reshape(inputs.shape).astype(compute), stats


def _check_inputs(inputs, params: dict, config: MoEConfig, layer: str):
    """inputs [..., D] and the parameters' shapes checked; returns (inputs, D)."""
    inputs = jnp.asarray(inputs)
    d = params["router"].shape[0]
    if inputs.ndim < 1 or inputs.shape[-1] != d:
        raise ValueError(f"{layer}: inputs must have shape [..., {d}], got {inputs.shape}")
    for name, shape in param_shapes(config, d).items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{layer}: parameter {name!r} must have shape {shape}, got {tuple(params[name].shape)}")
    if inputs.size == 0:
        raise ValueError(f"{layer}: inputs {inputs.shape} hold no token")
    return inputs, d


def exchange_rows(tokens_per_device: int, top_k: int, devices: int, capacity_factor=None) -> int:
    """B: the rows each device sends to each other device in an expert-parallel exchange.

    Dropless (``capacity_factor=None``): ``tokens_per_device * top_k``, the worst case
    (every choice of a device's tokens to one device's experts). With a capacity factor:
    ``ceil(capacity_factor * tokens_per_device * top_k / devices)``; choices past it are
    dropped and counted (:attr:`MoEStats.overflow`).
    """
    routed = tokens_per_device * top_k
    if capacity_factor is None:
        return routed
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be a positive number or None, got {capacity_factor!r}")
    return max(1, min(routed, math.ceil(capacity_factor * routed / devices)))


def forward_expert_parallel(
    inputs,
    params: dict,
    config: MoEConfig,
    *,
    mesh,
    axis: str,
    capacity_factor=None,
    activation: Callable = jax.nn.gelu,
    dtype=None,
    precision=None,
    impl: str | None = None,
    layer: str = "BlockSparseMoE",
) -> tuple[jax.Array, MoEStats]:
    """The MoE layer with its experts split over the mesh axis ``axis``: :func:`forward`'s values.

    The n devices of ``axis`` each hold E / n experts (``w_in`` / ``w_gate`` / ``w_out``
    split on their expert axis, ``P(None, axis, None)``) and T / n of the tokens (the
    leading axis of ``inputs`` split on ``axis``). Under ``shard_map``, each device
    routes its tokens, sends every (token, choice) to the device of its expert in one
    ``all_to_all`` (exchange buffers [n, B, D], :func:`exchange_rows`), runs the dropless
    block-sparse MLP of its experts on what it received, and sends the results back in
    a second ``all_to_all``; the gates combine them at the token's device.

    Memory per device, D the width: the two exchange buffers hold ``n * B * D`` values
    each way. Dropless (``capacity_factor=None``, B = (T / n) * k) that is n times the
    device's routed rows, the price of never dropping; with a capacity factor c it is
    ``c * (T / n) * k * D``, and choices past a full buffer are dropped and counted in
    :attr:`MoEStats.overflow` (never silently). A device's hidden activation then has
    :func:`~jax_blocksparse.ops.moe.padded_rows` ``(n * B, 1, E / n, bs)`` rows of its
    experts' F units, as in :func:`forward`.

    Args:
      inputs: [T, D] or [..., D] whose leading axis is split over ``axis`` (T a multiple
        of the axis size).
      params, config, activation, dtype, precision, impl, layer: as :func:`forward`.
      mesh: the ``jax.sharding.Mesh``.
      axis: the mesh axis name the experts (and the tokens) are split over.
      capacity_factor: None (dropless) or a positive number (see :func:`exchange_rows`).

    Returns:
      ``(outputs, MoEStats)``: outputs like ``inputs``, split the same way; the stats over
      all devices.
    """
    inputs, d = _check_inputs(inputs, params, config, layer)
    if axis not in mesh.axis_names:
        raise ValueError(f"{layer}: axis {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    n = mesh.shape[axis]
    shape = inputs.shape
    x = inputs.reshape(-1, d)
    if config.num_experts % n or x.shape[0] % n:
        raise ValueError(
            f"{layer}: the mesh axis {axis!r} has {n} devices; num_experts={config.num_experts} and the "
            f"{x.shape[0]} tokens must be multiples of it"
        )
    local_experts, k = config.num_experts // n, config.top_k
    rows = exchange_rows(x.shape[0] // n, k, n, capacity_factor)
    compute = canonicalize_dtype(inputs, params["w_in"], dtype=dtype)
    local = config._replace(num_experts=local_experts, top_k=1)
    weights = [name for name in _EXPERT_WEIGHTS if name in params]

    def per_device(x, router, *expert_weights):
        routed = route(router_logits(x, router), k, config.gate, config.renormalize)
        flat = routed.experts.reshape(-1)
        dest = flat // local_experts
        # Each choice's place in its destination's buffer: stable by (token, choice).
        _, place = _moe.group_ranks(dest, n)
        kept = place < rows
        slot = jnp.where(kept, dest * rows + place, n * rows)  # past the end: dropped
        token = jnp.arange(flat.size) // k
        send = jnp.zeros((n * rows + 1, d), compute).at[slot].set(x.astype(compute)[token])[:-1]
        send_expert = jnp.full(n * rows + 1, -1, jnp.int32).at[slot].set(flat % local_experts)[:-1]
        received = jax.lax.all_to_all(send.reshape(n, rows, d), axis, 0, 0).reshape(n * rows, d)
        received_expert = jax.lax.all_to_all(send_expert.reshape(n, rows), axis, 0, 0).reshape(n * rows, 1)
        valid = received_expert >= 0
        topology = _moe.route_topology(
            jnp.maximum(received_expert, 0), local_experts, config.ffn, config.block_size, valid
        )
        rows_here = _moe.dispatch(received, topology)
        out_rows = _experts(rows_here, dict(zip(weights, expert_weights)), topology, local, activation, precision, impl)
        results = _moe.collect(out_rows, topology)[:, 0]
        back = jax.lax.all_to_all(results.reshape(n, rows, d), axis, 0, 0).reshape(n * rows, d)
        per_choice = jnp.concatenate([back, jnp.zeros((1, d), compute)])[slot]
        out = jnp.einsum("tkd,tk->td", per_choice.reshape(-1, k, d), routed.gates.astype(compute))
        counts = jax.lax.psum(jnp.zeros(config.num_experts, jnp.int32).at[flat].add(1), axis)
        mean_probs = jax.lax.pmean(jnp.mean(routed.probs, axis=0), axis)
        stats = MoEStats(
            counts,
            _balance(counts / counts.sum(), mean_probs, config.num_experts),
            jax.lax.pmean(router_z_loss(routed.logits), axis),
            jax.lax.psum(jnp.sum(~kept).astype(jnp.int32), axis),
        )
        return out, stats

    expert_spec = P(None, axis, None)
    specs = (P(axis), P(), *([expert_spec] * len(weights)))
    run = shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=(P(axis), MoEStats(P(), P(), P(), P())))
    out, stats = run(x, params["router"], *(params[name] for name in weights))
    return out.reshape(shape).astype(compute), stats


def apply(inputs, params: dict, config: MoEConfig, *, mesh=None, expert_axis=None, capacity_factor=None, **kwargs):
    """The layers' one entry: :func:`forward` on one device, or
    :func:`forward_expert_parallel` when ``mesh`` and ``expert_axis`` are both given."""
    layer = kwargs.get("layer", "BlockSparseMoE")
    if (mesh is None) != (expert_axis is None):
        raise ValueError(f"{layer}: expert parallelism needs both mesh and expert_axis, got {mesh=}, {expert_axis=}")
    if mesh is None:
        if capacity_factor is not None:
            raise ValueError(f"{layer}: capacity_factor applies to expert parallelism (mesh, expert_axis) only")
        return forward(inputs, params, config, **kwargs)
    return forward_expert_parallel(
        inputs, params, config, mesh=mesh, axis=expert_axis, capacity_factor=capacity_factor, **kwargs
    )
