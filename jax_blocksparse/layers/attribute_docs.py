"""What each layer attribute means, written once for :mod:`jax_blocksparse.nn` and
:mod:`jax_blocksparse.nnx`.

A linen layer takes its attributes as dataclass fields and its NNX twin as constructor
arguments, but they mean the same, so they are described here once. A docstring in
``nn/`` or ``nnx/`` names shared attributes by a line that holds only ``{key}`` (or
several, ``{key, key}``) in its ``Attributes:`` or ``Args:`` section, and :func:`fill` (a
class or function decorator) writes ``name: description`` there for each when the module
is imported; lines indented below such a line add to its last entry what is particular
to that layer. A key is the attribute's name, or
``context.name`` where one name means different things (``lstm.mask``, ``conv.kernel_init``).
Docstrings then read the same in ``help()``, the API reference and the source of truth.

    >>> from jax_blocksparse.layers import attribute_docs
    >>> @attribute_docs.fill
    ... def f(use_bias=True):
    ...     '''Args:
    ...       {use_bias}
    ...     '''
    >>> print(f.__doc__.strip())
    Args:
      use_bias: whether to add a bias to the output (default: True).
"""

from __future__ import annotations

import re
import textwrap

from jax_blocksparse.layout import SUPPORTED_BLOCK_SIZES

__all__ = ["ATTRIBUTES", "block_sizes_text", "fill"]


def block_sizes_text() -> str:
    """The supported block sizes as prose, the last joined by "or" (the docstrings' and the
    Sphinx pages' ``|block_sizes|``)."""
    *head, last = map(str, SUPPORTED_BLOCK_SIZES)
    return f"{', '.join(head)} or {last}" if head else last


_SIZES = block_sizes_text()
_PRECISION = (
    "None (the default: ``jax.default_matmul_precision`` when traced), a :class:`jax.lax.Precision`, "
    "its name, or a pair (the higher one applies), as ``precision`` in ``lax.dot_general`` and Flax's "
    "dense layers."
)
_IMPL = (
    '``"auto"``, ``"reference"`` (XLA ops), ``"kernels"`` (the native kernels) or ``"dense"`` (a dense '
    "weight and XLA's dot); None (the default) reads :func:`jax_blocksparse.config.get_implementation` "
    "when traced (:mod:`jax_blocksparse.config`)."
)

#: key -> description. The entry's name is the key's last dotted part.
ATTRIBUTES: dict[str, str] = {
    # Every block-sparse layer.
    "block_size": f"the block edge, one of {_SIZES} (:data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`).",
    "mask": "the block mask, bool [C // block_size, K // block_size] for C input and K output features, "
    "static (numpy; stored as a hashable :class:`~jax_blocksparse.layers.StaticMask`).",
    "use_bias": "whether to add a bias to the output (default: True).",
    "dtype": "the dtype of the computation, float32, bfloat16 or float16 (default: inferred from the "
    "inputs and the parameters).",
    "param_dtype": "the dtype of the parameters, passed to their initializers (default: float32).",
    "kernel_init": "initializer for the stored blocks, called as ``kernel_init(key, (capacity, "
    "block_size, block_size), param_dtype)``; slot ``s`` holds block ``(layout.tables.block_rows[s], "
    "layout.tables.block_cols[s])``. Shape-based initializers see that [capacity, bs, bs] shape, not "
    "[C, K]: a ``lecun_normal()`` would take fan_in = capacity * bs. The default (None) is LeCun normal "
    "with the layer's true fan-in (the average number of blocks per non-empty output block column, "
    "times ``block_size``), so outputs have unit variance for unit-variance inputs.",
    "bias_init": "initializer for the bias, called as ``bias_init(key, (K,), param_dtype)`` for K "
    "output features (default: zeros).",
    "capacity": "number of storage slots (default: the number of blocks in ``mask``); slots beyond the "
    "blocks of ``mask`` are padding: they initialise to zero and do not contribute to the output.",
    "float32_dw": "keep the kernel's gradient in float32 when ``dtype`` is 16-bit: computed from the "
    "float32 accumulator of the weight-gradient product (``bsmm_updat(x, dy, out_dtype=float32)``) "
    "rather than rounded to ``dtype`` and widened, which is what autodiff of the usual "
    "cast-then-multiply gives (see :func:`jax_blocksparse.bsmm`). Needs ``param_dtype`` float32. "
    "Default False.",
    "precision": f"numerical precision of the products, forward and backward: {_PRECISION}",
    "impl": f"how the products are lowered, forward and backward: {_IMPL}",
    # Convolutions.
    "kernel_size": "the spatial shape of the kernel; an int means a 1-D kernel ``(k,)``.",
    "conv.mask": "the block mask, bool [C // block_size, K // block_size] for C input and K output "
    "channels, static (numpy; stored as a hashable :class:`~jax_blocksparse.layers.StaticMask`). The "
    "same blocks are present at every spatial tap.",
    "strides": "an int or ``n`` ints (default 1).",
    "padding": '``"SAME"``, ``"VALID"``, ``"SAME_LOWER"``, ``"CIRCULAR"``, ``"REFLECT"``, ``"CAUSAL"`` '
    "(1-D), an int, or ``n`` ints or ``(low, high)`` pairs, as in Flax's Conv.",
    "input_dilation": "an int or ``n`` ints (default 1); with values > 1 the padding must be explicit, "
    "as in Flax's Conv.",
    "kernel_dilation": "an int or ``n`` ints (default 1).",
    "conv.kernel_init": "initializer for the stored blocks, called as ``kernel_init(key, (capacity, "
    "*kernel_size, bs, bs), param_dtype)``. The default (None) is LeCun normal with the layer's true "
    "fan-in: the average number of blocks per non-empty output block column, times "
    "``block_size * prod(kernel_size)``.",
    "conv_transpose.mask": "the block mask, static: [C // bs, K // bs] for C input and K output "
    "channels, or [K // bs, C // bs] with ``transpose_kernel=True``.",
    "conv_transpose.strides": "the fractional strides, an int or ``n`` ints (default 1).",
    "conv_transpose.padding": '``"SAME"``, ``"VALID"``, ``"CIRCULAR"``, an int, or ``n`` ints or '
    "``(low, high)`` pairs, as in Flax's ConvTranspose (strings name the forward conv's padding; "
    "pairs pad the stride-dilated input).",
    "conv_transpose.kernel_init": "as a convolution's ``kernel_init``; the default's fan-in counts the "
    "blocks that feed an output channel (per block column of the mask, or per block row with "
    "``transpose_kernel=True``).",
    "transpose_kernel": "flip the kernel's spatial axes and swap its channel axes, as "
    "``lax.conv_transpose`` (the layer is then the input gradient of a block-sparse convolution with "
    "the same kernel).",
    # Column-parallel layers.
    "mesh": "a :class:`jax.sharding.Mesh` whose axes used here are ``AxisType.Auto`` (the default of "
    "``Mesh(devices, names)``) or ``Explicit`` (the default of ``jax.make_mesh``; then call the layer "
    "under ``jax.set_mesh(mesh)``).",
    "axis": "the mesh axis the output block columns are split over; its size must divide ``mask.shape[1]``.",
    "batch_axis": "optional mesh axis (not ``axis``) that the first dim of the inputs is split over: "
    "data and model parallel at once. The inputs then need a leading batch dim divisible by its size.",
    "gather_output": "True: the output [..., K] is replicated over ``axis`` (one all-gather). False: its "
    "last dim stays split over ``axis`` (no communication), e.g. to feed a row-parallel layer.",
    "parallel.mask": "the block mask, bool [C // block_size, K // block_size], static (numpy).",
    "parallel.kernel_init": "initializer for the unsplit kernel, called as ``kernel_init(key, (nnz, "
    "block_size, block_size), param_dtype)`` exactly as in the block-sparse dense layer; default "
    "(None) its LeCun normal with the true fan-in.",
    "parallel.float32_dw": "as in the block-sparse dense layer: with a 16-bit ``dtype``, keep the "
    "kernel's gradient in float32 (needs ``param_dtype`` float32).",
    "shard_capacity": "storage slots per shard (default: the block count of the fullest shard); "
    "padding slots are zero and do not contribute.",
    "parallel.precision": f"numerical precision of every device's products, forward and backward: {_PRECISION}",
    # Recurrent cells.
    "lstm.mask": "recurrent block mask, bool [H/bs, H/bs] shared by the four gates (the gate weight "
    "[H, 4H] uses it tiled four times), or [H/bs, 4H/bs] for one mask per gate (order i, f, g, o). A "
    "concrete :class:`~jax_blocksparse.Layout` is accepted too.",
    "internal_steps": "number of internal steps per timestep (default 0).",
    "step_masks": "one [H/bs, H/bs] mask per internal step (default ``mask``).",
    "input_mask": "None for a dense input projection [D, 4H]; else a block mask [D/bs, H/bs] (tiled "
    "for the four gates) or [D/bs, 4H/bs].",
    "layer_norm": "layer norm on the input projection (per gate), the recurrent gate product (per "
    "gate) and every internal step (default True).",
    "internal_activation": "the nonlinearity after each internal step (default ReLU, as OpenAI's "
    "mLSTM); None for none.",
    "gate_fn": "the gates' nonlinearity (default sigmoid), as in Flax's LSTMCell.",
    "activation_fn": "the nonlinearity of the cell input and output (default tanh), as in Flax's LSTMCell.",
    "lstm.kernel_init": "initializer of the input kernel; None means LeCun normal (with the true fan-in "
    "when ``input_mask`` is given).",
    "recurrent_kernel_init": "initializer of the block-sparse recurrent kernels, called as "
    "``init(key, (capacity, bs, bs), dtype)``; None means LeCun normal with the true fan-in.",
    "lstm.bias_init": "initializer of the gate bias [4H] (default zeros).",
    "lstm.dtype": "computation dtype of the products (default: inferred from inputs and params); "
    "elementwise math and the cell state stay in float32.",
    "lstm.param_dtype": "parameter (and carry) dtype (default float32).",
    "carry_init": "initializer of the carry (default zeros).",
    "epsilon": "layer-norm epsilon.",
    "lstm.float32_dw": "keep every kernel gradient in float32 when ``dtype`` is 16-bit, straight from "
    "the float32 accumulator of its weight-gradient product (see :func:`jax_blocksparse.bsmm`); also in "
    "the fused sequence layer. Needs ``param_dtype`` float32. Default False: each kernel gradient is "
    "rounded to ``dtype``, then widened; on a GPU with XLA's default flags the input kernel's rounding "
    '(an XLA cast widened straight back) may be skipped, see docs/guide/mixed_precision.rst ("16-bit '
    'roundings on GPUs"; ``XLA_FLAGS=--xla_allow_excess_precision=false`` keeps it).',
    "lstm.precision": "numerical precision of every product (input projection, mLSTM factor, internal "
    f"steps, gates), forward and backward: {_PRECISION}",
    "lstm.impl": "how the block-sparse products are lowered, forward and backward (also in the fused "
    f"sequence layer's custom backward pass): {_IMPL}",
    # The fused recurrent sequence layer.
    "cell": "the block-sparse LSTM or mLSTM cell whose configuration and parameters the layer uses.",
    "time_major": "inputs are [T, *batch, D] instead of [*batch, T, D].",
    "return_carry": "also return the final carry: ``(carry, outputs)``.",
    "sequence.precision": "numerical precision of every product of the sequence, forward and backward, "
    "as the cell's ``precision``; None (the default) keeps the cell's.",
    "sequence.impl": '``"auto"``, ``"reference"``, ``"kernels"`` or ``"dense"`` for every block-sparse '
    "product of the sequence, forward and custom backward; None (the default) keeps the cell's (whose "
    "own None reads the default when traced).",
    # Attention.
    "num_heads": "number of query heads; ``qkv_features`` must be divisible by it.",
    # sparsify: a dense model's layers made block-sparse.
    "density": "the target fraction of the converted layers' weights, in (0, 1].",
    "distribution": 'the per-layer budget, ``"uniform"`` or ``"erk"``.',
    "keep_dense": 'layers to leave dense (the embedding, the classifier): a glob pattern on the "/"-joined '
    'path (``"head"``, ``"blocks/*/out"``), a sequence of them, or a callable ``fn(path) -> bool``.',
    "capacity_factor": "a dynamic layer's capacity over its blocks (>= 1; sparse momentum moves blocks "
    "between layers and needs room: e.g. 1.5).",
    "norm": 'the block norm of the magnitude rule, ``"l2"`` or ``"l1"``.',
    "sparsify.impl": "the converted layers' ``impl`` (None: :mod:`jax_blocksparse.config`'s default).",
    "strict": "raise a ValueError naming every layer that does not fit, instead of leaving it dense "
    "and listing it in the report.",
}

# A line that holds only "{key}" or "{key, key, ...}" (and its indentation).
_PLACEHOLDER = re.compile(r"^(?P<indent>[ \t]*)\{(?P<keys>[\w.]+(?:,[ \t]*[\w.]+)*)\}[ \t]*$", re.MULTILINE)


def entry(key: str, indent: str = "") -> str:
    """``name: description`` of ``key``, wrapped as a docstring's entry at ``indent``."""
    if key not in ATTRIBUTES:
        raise KeyError(f"{key!r} is not described in jax_blocksparse.layers.attribute_docs.ATTRIBUTES")
    return textwrap.fill(
        f"{key.rsplit('.', 1)[-1]}: {ATTRIBUTES[key]}",
        width=92,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_long_words=False,
        break_on_hyphens=False,
    )


def fill(obj):
    """Writes the shared descriptions into ``obj``'s docstring in place of its ``{key}``
    lines; returns ``obj`` (a class or function decorator). An unknown key raises KeyError
    when the module that uses it is imported."""
    if obj.__doc__:
        obj.__doc__ = _PLACEHOLDER.sub(
            lambda m: "\n".join(entry(key.strip(), m["indent"]) for key in m["keys"].split(",")), obj.__doc__
        )
    return obj
