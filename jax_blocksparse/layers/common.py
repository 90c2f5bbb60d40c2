"""What every block-sparse layer shares: the static mask, its layout, the checks, the init
and the dtype rule.

Framework-neutral (no flax). The layer cores (:mod:`~jax_blocksparse.layers.dense`,
:mod:`~jax_blocksparse.layers.conv`, :mod:`~jax_blocksparse.layers.parallel`,
:mod:`~jax_blocksparse.layers.recurrent`, :mod:`~jax_blocksparse.layers.attention`,
:mod:`~jax_blocksparse.layers.sparsify`) and the Flax classes over them import these:

* :class:`StaticMask`: a layer's block mask, hashable and compared by value, so that a
  layer is a valid static argument and jit cache key; :func:`layout_for` its cached
  :class:`~jax_blocksparse.Layout`.
* :func:`check_config`, :func:`check_float32_dw`, :func:`check_options`: a layer's
  static configuration, checked, with errors that name the layer.
* :func:`fan_in`, :func:`default_kernel_init`, :func:`init_kernel`: the
  [capacity, bs, bs] kernel's initialisation with the layer's true fan-in.
* :func:`canonicalize_dtype`, :func:`promote`, :func:`add_bias`: Flax's dtype rule
  without Flax, and the bias.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse import config
from jax_blocksparse.layout import Layout, check_block_size, check_mask
from jax_blocksparse.ops._checks import canonical_precision

__all__ = [
    "StaticMask",
    "add_bias",
    "canonicalize_dtype",
    "check_config",
    "check_float32_dw",
    "check_options",
    "default_kernel_init",
    "fan_in",
    "init_kernel",
    "layout_for",
    "promote",
]


class StaticMask:
    """A read-only, hashable block mask: bool [CB, KB].

    Equality and hashing are by shape and content, so two layers built from equal
    masks compare equal and share jit caches. ``np.asarray(mask)`` gives the bool
    array back (read-only).

    Example::

        >>> import numpy as np
        >>> from jax_blocksparse.layers import StaticMask
        >>> a, b = StaticMask(np.eye(2, dtype=bool)), StaticMask([[1, 0], [0, 1]])
        >>> a == b, hash(a) == hash(b), a
        (True, True, StaticMask(shape=(2, 2), nnz=2))
    """

    __slots__ = ("_array", "_key")

    def __init__(self, mask):
        if isinstance(mask, type(self)):
            array = mask._array
        else:
            array = np.array(self._checked(mask), dtype=bool)  # a private copy
            array.flags.writeable = False
        self._array = array
        self._key = (array.shape, array.tobytes())

    @staticmethod
    def _checked(mask) -> np.ndarray:
        """The validated mask (subclasses check other shapes)."""
        if isinstance(mask, jax.core.Tracer):
            raise TypeError(
                "mask must be a concrete (numpy) bool array: a layer's block mask is static, "
                f"got a traced array of shape {tuple(mask.shape)}"
            )
        return check_mask(np.asarray(mask))

    @property
    def shape(self) -> tuple[int, ...]:
        return self._array.shape

    @property
    def array(self) -> np.ndarray:
        """The mask as a read-only numpy bool array."""
        return self._array

    @property
    def nnz(self) -> int:
        return int(self._array.sum())

    def __array__(self, dtype=None, copy=None):
        if dtype is None and not copy:
            return self._array
        return np.array(self._array, dtype=dtype)

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._key == other._key

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, nnz={self.nnz})"


@functools.lru_cache(maxsize=256)
def layout_for(mask: StaticMask, block_size: int, capacity: int | None) -> Layout:
    """The layout of ``mask``, built once per (mask, block_size, capacity).

    Its tables are numpy arrays (a concrete mask gives host tables), so caching is
    safe even when the first request comes from inside a trace.
    """
    return Layout.from_mask(mask.array, block_size, capacity)


def check_config(
    mask: StaticMask,
    block_size,
    capacity,
    in_features: int | None,
    out_features: int,
    layer: str,
    *,
    transpose: bool = False,
):
    """Validates a layer's static configuration; returns the canonical block size.

    The mask's rows are the inputs and its columns the outputs, or the other way
    round with ``transpose`` (a transposed conv's ``transpose_kernel=True``).
    ``in_features`` may be None (not known yet).
    """
    block_size = check_block_size(block_size)
    in_axis, out_axis = (1, 0) if transpose else (0, 1)
    suffix = " with transpose_kernel=True" if transpose else ""
    for name, value, axis in (("output features", out_features, out_axis), ("in_features", in_features, in_axis)):
        blocks = mask.shape[axis]
        if value is not None and value != blocks * block_size:
            raise ValueError(
                f"{layer}: {name} ({value}) must equal mask.shape[{axis}] * block_size = {blocks} * {block_size} = "
                f"{blocks * block_size}{suffix} (mask shape {mask.shape})"
            )
    if capacity is not None and capacity < mask.nnz:
        raise ValueError(f"{layer}: capacity={capacity} is smaller than the {mask.nnz} blocks of the mask {mask.shape}")
    return block_size


def check_float32_dw(float32_dw, param_dtype, layer: str) -> bool:
    """Validates a layer's ``float32_dw`` against its ``param_dtype``; returns it as a bool."""
    if not isinstance(float32_dw, (bool, np.bool_)):
        raise TypeError(f"{layer}: float32_dw must be a bool, got {float32_dw!r}")
    if float32_dw and np.dtype(param_dtype) != np.dtype(np.float32):
        raise ValueError(
            f"{layer}: float32_dw=True keeps the kernel gradients in float32, which needs "
            f"param_dtype float32, got param_dtype {np.dtype(param_dtype)}"
        )
    return bool(float32_dw)


def check_options(precision, impl, layer: str):
    """Validates a layer's ``precision`` and ``impl``; returns them canonical (hashable).

    ``precision`` is anything :func:`jax.lax.dot_general` takes (None, a
    :class:`jax.lax.Precision`, its name, or a pair), returned as one
    ``jax.lax.Precision``; ``impl`` is None, ``"auto"``, ``"reference"``, ``"dense"`` or
    ``"kernels"``. None stays None for both: the ops read their defaults
    (:func:`jax.default_matmul_precision`, :func:`jax_blocksparse.config.get_implementation`)
    when they are traced, not when the layer is built. Raises ValueError naming
    ``layer`` and the attribute.

    Example::

        >>> from jax_blocksparse.layers.common import check_options
        >>> check_options("highest", "reference", "MyDense")
        (Precision.HIGHEST, 'reference')
        >>> check_options(None, None, "MyDense")
        (None, None)
    """
    if precision is not None:
        try:
            precision = canonical_precision(precision, name="precision")
        except (TypeError, ValueError) as err:
            raise ValueError(f"{layer}: {err}") from None
    if impl is not None:
        try:
            impl = config.canonical_impl(impl, name="impl")
        except ValueError as err:
            raise ValueError(f"{layer}: {err}") from None
    return precision, impl


def fan_in(mask: StaticMask, block_size: int) -> float:
    """The true fan-in of a block-sparse layer.

    The average number of present blocks per non-empty output block column, times
    ``block_size``: the number of inputs an average output unit sums over.
    """
    per_column = mask.array.sum(axis=0)
    nonempty = per_column[per_column > 0]
    blocks = float(nonempty.mean()) if nonempty.size else 1.0
    return blocks * block_size


def default_kernel_init(mask: StaticMask, block_size: int):
    """LeCun normal (truncated, variance 1 / fan_in) with the layer's true fan-in."""
    blocks_per_column = fan_in(mask, block_size) / block_size
    # variance_scaling with batch_axis=0 sees fan_in = block_size for [capacity, bs, bs].
    return jax.nn.initializers.variance_scaling(
        1.0 / blocks_per_column, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
    )


def init_kernel(kernel_init, key, layout: Layout, mask: StaticMask, param_dtype):
    """Initialises a [capacity, bs, bs] kernel; padding slots are set to zero.

    ``kernel_init=None`` means :func:`default_kernel_init`; otherwise it is called
    as ``kernel_init(key, (capacity, bs, bs), param_dtype)``.
    """
    if kernel_init is None:
        kernel_init = default_kernel_init(mask, layout.block_size)
    kernel = kernel_init(key, layout.w_shape, param_dtype)
    if tuple(kernel.shape) != layout.w_shape:
        raise ValueError(f"kernel_init returned shape {tuple(kernel.shape)}, expected {layout.w_shape}")
    if layout.capacity > mask.nnz:
        kernel = jnp.where(layout.valid[:, None, None], kernel, jnp.zeros((), kernel.dtype))
    return kernel


def canonicalize_dtype(*args, dtype=None) -> np.dtype:
    """The compute dtype of a layer: ``dtype`` if given, else the promotion of ``args``.

    ``args`` are arrays (or None, skipped); JAX's promotion (``jnp.result_type``)
    decides, and a non-float result (integer inputs) widens to float32. The rule of
    Flax's layers, written without Flax. Raises ValueError for a non-float ``dtype``.

    Example::

        >>> import jax.numpy as jnp
        >>> from jax_blocksparse.layers.common import canonicalize_dtype
        >>> canonicalize_dtype(jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float32), None)
        dtype('float32')
        >>> canonicalize_dtype(jnp.ones(2, jnp.int32))
        dtype('float32')
    """
    if dtype is None:
        dtype = jnp.result_type(*(a for a in args if a is not None))
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        raise ValueError(f"dtype must be a floating (or complex) dtype, got {dtype}")
    return dtype


def promote(inputs, kernel, bias, dtype, float32_dw: bool):
    """Flax's dtype promotion for a layer with a ``float32_dw`` option.

    The compute dtype is ``dtype``, else the promotion of inputs, kernel and bias
    (:func:`canonicalize_dtype`). Inputs and bias are cast to it; so is the kernel,
    unless ``float32_dw``: then it stays float32 and the product casts it (the op's
    ``compute_dtype``), so that its gradient comes out of the float32 accumulator.

    Returns ``(inputs, kernel, bias, compute_dtype)``.
    """
    compute = canonicalize_dtype(inputs, kernel, bias, dtype=dtype)
    inputs, bias = jnp.asarray(inputs, compute), None if bias is None else jnp.asarray(bias, compute)
    if not float32_dw:
        kernel = jnp.asarray(kernel, compute)
    return inputs, kernel, bias, compute


def add_bias(y, bias):
    """``y + bias`` over the last axis (``bias`` [K] or None).

    With 16-bit y and bias of one dtype the sum is taken in float32 and rounded once, as
    XLA computes a 16-bit add anyway: the forward pass is the same, and the bias gradient
    becomes a float32 sum over the rows. XLA on CPU turns a bfloat16 one into a
    reduce-window that took 350 us for [256, 512] (90 us this way), a fifth of a
    block-sparse MLP's training step at density 0.1.
    """
    if bias is None:
        return y
    bias = jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    if y.dtype == bias.dtype and y.dtype in (jnp.bfloat16, jnp.float16):
        return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)
    return y + bias


def place_output(y, out_sharding):
    """``y`` where a call's ``out_sharding`` puts it, as ``flax.nnx.Linear`` and
    ``flax.nnx.Conv`` do with theirs (the sharding of their product's result, on a mesh
    with explicit axes): ``jax.sharding.reshard(y, out_sharding)``; None leaves ``y`` as
    it is. ``out_sharding``: a ``PartitionSpec`` or a ``NamedSharding``."""
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)
