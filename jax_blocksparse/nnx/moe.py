"""BlockSparseMoE: a dropless mixture-of-experts layer for Flax NNX, on block-sparse products."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.typing import PrecisionLike

from jax_blocksparse.layers import common as _common
from jax_blocksparse.layers import moe as _core


class BlockSparseMoE(nnx.Module):
    """A dropless mixture-of-experts MLP: every token through its ``top_k`` experts.

    The NNX twin of :class:`jax_blocksparse.nn.BlockSparseMoE` (same parameters,
    defaults and math; see it for the attributes). Each call sows, as
    ``nnx.Intermediate``: ``expert_counts`` (int32 [E]), ``load_balancing_loss`` and
    ``router_z_loss`` (float32 scalars); read them with
    ``nnx.capture(model, nnx.Intermediate)(x)`` (on a Flax without ``nnx.capture``:
    ``nnx.pop(model, nnx.Intermediate)`` after the call).

    Example::

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jax_blocksparse as jbs
        >>> layer = jbs.nnx.BlockSparseMoE(32, num_experts=4, ffn=64, block_size=16, rngs=nnx.Rngs(0))
        >>> y, sown = nnx.capture(layer, nnx.Intermediate)(jnp.ones((2, 8, 32)))
        >>> y.shape, int(sown["expert_counts"][0].sum())
        ((2, 8, 32), 32)

    Args:
      in_features: D, the model width (inputs and outputs [..., D]).
      num_experts: E; the other keyword arguments (``ffn``, ``top_k``, ``block_size``,
        ``gate``, ``renormalize``, ``glu``, ``activation``, ``dtype``, ``param_dtype``,
        ``precision``, ``impl``, ``mesh``, ``expert_axis``, ``capacity_factor``,
        ``router_init``, ``kernel_init``) are
        :class:`jax_blocksparse.nn.BlockSparseMoE`'s attributes.
      rngs: rng key.
    """

    def __init__(
        self,
        in_features: int,
        num_experts: int,
        ffn: int,
        *,
        top_k: int = 2,
        block_size: int = 64,
        gate: str = "softmax",
        renormalize: bool = False,
        glu: bool = False,
        activation: Callable = jax.nn.gelu,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: PrecisionLike = None,
        impl: str | None = None,
        mesh: Any = None,
        expert_axis: str | None = None,
        capacity_factor: float | None = None,
        router_init: Callable | None = None,
        kernel_init: Callable | None = None,
        rngs: nnx.Rngs,
    ):
        name = type(self).__name__
        self.config = _core.check_moe(num_experts, ffn, top_k, block_size, gate, renormalize, glu, name)
        self.precision, self.impl = _common.check_options(precision, impl, name)
        self.in_features, self.activation, self.dtype, self.param_dtype = in_features, activation, dtype, param_dtype
        self.mesh, self.expert_axis, self.capacity_factor = mesh, expert_axis, capacity_factor
        for param, shape in _core.param_shapes(self.config, in_features).items():
            init = (router_init if param == "router" else kernel_init) or _core.default_init(param)
            setattr(self, param, nnx.Param(init(rngs.params(), shape, param_dtype)))

    def __call__(self, inputs):
        """[..., D] -> [..., D]."""
        params = {name: getattr(self, name)[...] for name in _core.param_shapes(self.config, self.in_features)}
        out, stats = _core.apply(
            inputs,
            params,
            self.config,
            activation=self.activation,
            dtype=self.dtype,
            precision=self.precision,
            impl=self.impl,
            layer=type(self).__name__,
            mesh=self.mesh,
            expert_axis=self.expert_axis,
            capacity_factor=self.capacity_factor,
        )
        for field, value in stats._asdict().items():
            self.sow(nnx.Intermediate, field, value)
        return out
