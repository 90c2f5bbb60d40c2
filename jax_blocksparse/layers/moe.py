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

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.layers.common import canonicalize_dtype
from jax_blocksparse.layout import check_block_size
from jax_blocksparse.ops import moe as _moe

__all__ = [
    "GATES",
    "MoEConfig",
    "MoEStats",
    "Routed",
    "check_moe",
    "default_init",
    "forward",
    "load_balancing_loss",
    "param_shapes",
    "route",
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


def load_balancing_loss(probs, experts, num_experts: int):
    """Switch Transformer's auxiliary loss: ``E * sum_e f_e * P_e``, float32 scalar.

    ``f_e`` is the fraction of the routed choices (T * k) that went to expert e, ``P_e``
    the mean score of expert e over the tokens. 1 when routing is uniform; up to E when
    every token goes to one expert.
    """
    counts = jnp.zeros(num_experts, jnp.float32).at[experts.reshape(-1)].add(1.0)
    fraction = counts / experts.size
    return num_experts * jnp.sum(fraction * jnp.mean(probs.astype(jnp.float32), axis=0))


def router_z_loss(logits):
    """ST-MoE's router z-loss: the mean over tokens of ``logsumexp(logits) ** 2``, float32 scalar."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=-1)))


class MoEStats(NamedTuple):
    """What one call of the layer measured (sown by the Flax layers).

    Attributes:
      expert_counts: int32 [E]: tokens routed to each expert (choices counted).
      load_balancing_loss: float32 scalar (:func:`load_balancing_loss`).
      router_z_loss: float32 scalar (:func:`router_z_loss`).
    """

    expert_counts: jax.Array
    load_balancing_loss: jax.Array
    router_z_loss: jax.Array


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
    inputs = jnp.asarray(inputs)
    d = params["router"].shape[0]
    if inputs.ndim < 1 or inputs.shape[-1] != d:
        raise ValueError(f"{layer}: inputs must have shape [..., {d}], got {inputs.shape}")
    for name, shape in param_shapes(config, d).items():
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{layer}: parameter {name!r} must have shape {shape}, got {tuple(params[name].shape)}")
    x = inputs.reshape(-1, d)
    tokens = x.shape[0]
    if tokens == 0:
        raise ValueError(f"{layer}: inputs {inputs.shape} hold no token")
    logits = jnp.dot(x.astype(jnp.float32), params["router"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    routed = route(logits, config.top_k, config.gate, config.renormalize)

    compute = canonicalize_dtype(inputs, params["w_in"], dtype=dtype)
    flat = {n: params[n].astype(compute).reshape(d, -1) for n in ("w_in", "w_out", "w_gate") if n in params}
    topology = _moe.route_topology(routed.experts, config.num_experts, config.ffn, config.block_size)
    rows = _moe.dispatch(x.astype(compute), topology)
    hidden = _moe.expert_up(rows, flat["w_in"], topology, precision=precision, impl=impl)
    if config.glu:
        hidden = activation(_moe.expert_up(rows, flat["w_gate"], topology, precision=precision, impl=impl)) * hidden
    else:
        hidden = activation(hidden)
    out_rows = _moe.expert_down(hidden, flat["w_out"], topology, precision=precision, impl=impl)
    out = _moe.combine(out_rows, routed.gates.astype(compute), topology)
    stats = MoEStats(
        topology.counts,
        load_balancing_loss(routed.probs, routed.experts, config.num_experts),
        router_z_loss(routed.logits),
    )
    return out.reshape(inputs.shape).astype(compute), stats
