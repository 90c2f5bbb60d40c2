"""Linear-like layers that are one matrix product once their axes are flattened.

Flax's ``DenseGeneral`` / ``LinearGeneral`` contract some axes of the inputs with the
leading axes of the kernel, and ``Einsum`` may do the same with any subscripts. When
the contracted axes are the inputs' trailing ones, in the kernel's order, and no axis
is batched through the kernel, the layer is a [C, K] dense layer with
``C = prod(in_shape)`` and ``K = prod(out_shape)``:

    inputs [..., *in_shape] -> [..., C] @ kernel [C, K] -> [..., K] -> [..., *out_shape]

and a kernel [*in_shape, *out_shape] reshapes to [C, K] without moving data. The
attention projections are of this kind (query/key/value [embed] -> [heads, head_dim],
output [heads, head_dim] -> [embed]). :class:`FlatLinear` is that reshaping, and
:func:`dense_general_shape` and :func:`einsum_shape` decide whether a layer has one,
or say why not. Framework-neutral (no flax).

Example::

    >>> from jax_blocksparse.layers.general import einsum_shape
    >>> einsum_shape("btd,dnh->btnh", (64, 4, 16))
    (FlatLinear(in_shape=(64,), out_shape=(4, 16)), None)
    >>> einsum_shape("btd,dnh->bnth", (64, 4, 16))[1]
    "output subscripts 'bnth' are not the inputs' leading 'bt' followed by the kernel's features 'nh'"
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

__all__ = ["FlatLinear", "as_tuple", "dense_general_shape", "einsum_shape"]


class FlatLinear(NamedTuple):
    """A linear-like layer's kernel [*in_shape, *out_shape] seen as [C, K].

    Attributes:
      in_shape: the contracted axes' sizes, the inputs' trailing axes.
      out_shape: the output features' sizes, the result's trailing axes.
    """

    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def features(self) -> tuple[int, int]:
        """(C, K): the flattened input and output features."""
        return math.prod(self.in_shape), math.prod(self.out_shape)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return self.in_shape + self.out_shape

    def flat_kernel(self, kernel):
        """[*in_shape, *out_shape] -> [C, K]."""
        return kernel.reshape(self.features)  # numpy stays numpy (sparsify reads host arrays)

    def general_kernel(self, kernel):
        """[C, K] -> [*in_shape, *out_shape]."""
        return kernel.reshape(self.kernel_shape)

    def flat_inputs(self, inputs, layer: str):
        """[..., *in_shape] -> [..., C]; a ValueError naming ``layer`` and the shapes otherwise."""
        shape, n = tuple(jnp.shape(inputs)), len(self.in_shape)
        if len(shape) < n or shape[len(shape) - n :] != self.in_shape:
            raise ValueError(
                f"{layer}: inputs must have shape [..., {', '.join(map(str, self.in_shape))}] (the contracted "
                f"axes of its kernel {list(self.kernel_shape)}), got inputs of shape {shape}"
            )
        return jnp.reshape(inputs, shape[: len(shape) - n] + (self.features[0],))

    def general_outputs(self, y):
        """[..., K] -> [..., *out_shape]."""
        return jnp.reshape(y, tuple(jnp.shape(y))[:-1] + self.out_shape)

    def flat_bias(self, bias, layer: str):
        """A bias over the output features, [*out_shape] -> [K] (None stays None)."""
        if bias is None:
            return None
        if tuple(jnp.shape(bias)) != self.out_shape:
            raise ValueError(
                f"{layer}: the bias must have the output features' shape {self.out_shape}, got {tuple(jnp.shape(bias))}"
            )
        return jnp.reshape(bias, (self.features[1],))


def as_tuple(value) -> tuple[int, ...]:
    """An int or a sequence of ints (axes, sizes) as a tuple of ints."""
    return tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),)


def dense_general_shape(kernel_shape, axis, batch_dims=(), ndim: int | None = None):
    """``(FlatLinear, None)`` for a DenseGeneral / LinearGeneral, or ``(None, reason)``.

    Args:
      kernel_shape: the kernel's shape, [*contracted sizes, *features].
      axis: the contracted input axes (an int or a sequence).
      batch_dims: axes batched through the kernel (must be empty).
      ndim: the inputs' rank where known (linen sees the call); None where it is not
        (then ``axis`` must be negative: ``-1`` or ``(-2, -1)``).
    """
    axis, batch_dims = as_tuple(axis), as_tuple(batch_dims) if batch_dims is not None else ()
    if batch_dims:
        return None, f"batch axes {batch_dims} (a kernel per batch index)"
    n = len(axis)
    if ndim is not None:
        axis = tuple(int(a) - ndim if int(a) >= 0 else int(a) for a in axis)
    if axis != tuple(range(-n, 0)):
        where = "negative trailing axes" if ndim is None else "the inputs' trailing axes"
        return None, f"contracted axes {axis} are not {where} {tuple(range(-n, 0))} in order"
    kernel_shape = tuple(int(s) for s in kernel_shape)
    if len(kernel_shape) <= n:
        return None, f"a kernel of shape {kernel_shape} has no output axis past {n} contracted ones"
    return FlatLinear(kernel_shape[:n], kernel_shape[n:]), None


def einsum_shape(einsum_str: str, kernel_shape, bias_shape=None):
    """``(FlatLinear, None)`` for an Einsum layer that is one matrix product, or ``(None, reason)``.

    It is one when the subscripts read ``<batch><contracted>,<contracted><features>->
    <batch><features>``: the inputs' trailing axes are contracted with the kernel's
    leading ones in the same order, the kernel's other axes are the result's trailing
    ones in order, and the bias (if any) is over those features.
    """
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1:
        return None, f"einsum {einsum_str!r} is not 'inputs,kernel->output'"
    operands, out = spec.split("->")
    lhs, rhs = operands.split(",")
    if "." in rhs:
        return None, f"kernel subscripts {rhs!r} have an ellipsis"
    if len(set(rhs)) != len(rhs) or len(set(lhs.replace("...", "."))) != len(lhs.replace("...", ".")):
        return None, f"einsum {einsum_str!r} repeats a subscript (a diagonal or a trace)"
    contracted = "".join(c for c in rhs if c in lhs and c not in out)
    features = rhs[len(contracted) :]
    if not contracted or rhs[: len(contracted)] != contracted:
        return None, f"kernel subscripts {rhs!r} do not start with the contracted axes {contracted!r}"
    if any(c in lhs for c in features):
        return None, f"kernel axes {features!r} are shared with the inputs {lhs!r} (batched through the kernel)"
    if not lhs.endswith(contracted):
        return None, f"the contracted axes {contracted!r} are not the trailing axes of the inputs {lhs!r}"
    batch = lhs[: len(lhs) - len(contracted)]
    if any(c in rhs for c in batch):
        return None, f"input axes {batch!r} meet the kernel {rhs!r} without being contracted"
    if out != batch + features:
        return None, (
            f"output subscripts {out!r} are not the inputs' leading {batch!r} followed by the kernel's features "
            f"{features!r}"
        )
    kernel_shape = tuple(int(s) for s in kernel_shape)
    if len(kernel_shape) != len(rhs):
        return None, f"kernel shape {kernel_shape} does not have the {len(rhs)} axes of {rhs!r}"
    flat = FlatLinear(kernel_shape[: len(contracted)], kernel_shape[len(contracted) :])
    if bias_shape is not None and tuple(int(s) for s in bias_shape) != flat.out_shape:
        return None, f"the bias {tuple(bias_shape)} is not over the output features {flat.out_shape}"
    return flat, None
