"""BlockSparseMoE: a dropless mixture-of-experts layer for Flax linen, on block-sparse products."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.typing import PrecisionLike

from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import moe as _core


@attribute_docs.fill
class BlockSparseMoE(nn.Module):
    """A dropless mixture-of-experts MLP: every token through its ``top_k`` experts.

    Each token's router scores (float32, whatever ``dtype`` is) pick its ``top_k``
    experts; every expert is an MLP ``D -> ffn -> D``; the output is the gate-weighted
    sum of the chosen experts' outputs. No token is dropped and there is no capacity
    factor: the tokens are sorted by expert and padded per expert to a block multiple,
    and the experts' MLPs are two block-sparse products over that routing's topology
    (:mod:`jax_blocksparse.ops.moe`), whose layout is runtime data of static capacity (a
    new routing does not recompile).

    Sown in ``"intermediates"`` at every call (``mutable=["intermediates"]`` to read them):
    ``expert_counts`` (int32 [E]), ``load_balancing_loss`` (Switch Transformer's) and
    ``router_z_loss`` (ST-MoE's), float32 scalars. Add the losses to the training loss
    with your coefficients (typically 1e-2 and 1e-3).

    Example::

        >>> import jax, jax.numpy as jnp
        >>> import jax_blocksparse as jbs
        >>> layer = jbs.nn.BlockSparseMoE(num_experts=4, ffn=64, top_k=2, block_size=16)
        >>> x = jnp.ones((2, 8, 32))
        >>> variables = layer.init(jax.random.key(0), x)
        >>> y, state = layer.apply(variables, x, mutable=["intermediates"])
        >>> y.shape, state["intermediates"]["expert_counts"][0].sum()
        ((2, 8, 32), Array(32, dtype=int32))

    Attributes:
      num_experts: E.
      ffn: each expert's hidden units F, a multiple of ``block_size``.
      top_k: experts per token (default 2).
      {block_size}
        The products' block edge (default 64); each expert's rows are padded to a multiple of it.
      gate: the router's scores, ``"softmax"`` (default) or ``"sigmoid"``.
      renormalize: divide each token's gates by their sum (default False).
      glu: a gated MLP, ``activation(x @ w_gate) * (x @ w_in)`` (default False:
        ``activation(x @ w_in)``).
      activation: the nonlinearity (default ``jax.nn.gelu``).
      {dtype}
        The router is float32 whatever it is.
      {param_dtype, precision}
        Here: the experts' products.
      {impl}
      mesh, expert_axis: expert parallelism: with both set, the experts are split over
        the mesh axis ``expert_axis`` (the parameters ``w_in`` / ``w_gate`` / ``w_out`` on
        their expert axis) and so are the tokens (the inputs' leading axis); tokens
        travel to their experts' devices and back with ``all_to_all``
        (:func:`jax_blocksparse.layers.moe.forward_expert_parallel`). Default None: one
        device's layer (data parallelism needs nothing).
      capacity_factor: with expert parallelism, None (dropless: exchange buffers sized
        for the worst case) or a number c: buffers of ``c * tokens * top_k / devices``
        rows, choices past them dropped and counted (sown as ``overflow``).
      router_init, kernel_init: initializers; None for the defaults
        (:func:`jax_blocksparse.layers.moe.default_init`: LeCun normal over each
        expert's fan-in). ``kernel_init`` is called for ``w_in``, ``w_gate`` and
        ``w_out``, each [D, E, F] (``w_out`` holds each expert's [F, D] projection
        transposed).
    """

    num_experts: int
    ffn: int
    top_k: int = 2
    block_size: int = 64
    gate: str = "softmax"
    renormalize: bool = False
    glu: bool = False
    activation: Callable = jax.nn.gelu
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: PrecisionLike = None
    impl: str | None = None
    mesh: Any = None
    expert_axis: str | None = None
    capacity_factor: float | None = None
    router_init: Callable | None = None
    kernel_init: Callable | None = None

    @nn.compact
    def __call__(self, inputs):
        """[..., D] -> [..., D]."""
        name = type(self).__name__
        config = _core.check_moe(
            self.num_experts, self.ffn, self.top_k, self.block_size, self.gate, self.renormalize, self.glu, name
        )
        precision, impl = _common.check_options(self.precision, self.impl, name)
        if self.has_variable("params", "router"):  # inputs of another width than the parameters'
            d = jnp.shape(self.get_variable("params", "router"))[0]
            if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != d:
                raise ValueError(f"{name}: inputs must have shape [..., {d}], got {jnp.shape(inputs)}")
        params = {}
        for param, shape in _core.param_shapes(config, jnp.shape(inputs)[-1]).items():
            init = self.router_init if param == "router" else self.kernel_init
            params[param] = self.param(param, init or _core.default_init(param), shape, self.param_dtype)
        out, stats = _core.apply(
            inputs,
            params,
            config,
            activation=self.activation,
            dtype=self.dtype,
            precision=precision,
            impl=impl,
            layer=name,
            mesh=self.mesh,
            expert_axis=self.expert_axis,
            capacity_factor=self.capacity_factor,
        )
        for field, value in stats._asdict().items():
            self.sow("intermediates", field, value)
        return out
