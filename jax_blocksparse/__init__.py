"""jax-blocksparse: block-sparse matrix products for JAX, with kernels that skip absent blocks.

Example::

    >>> import jax, jax.numpy as jnp
    >>> import jax_blocksparse as jbs
    >>> layout = jbs.Layout.from_mask(jbs.layouts.barabasi_albert(16, 2), block_size=32)
    >>> W = jax.random.normal(jax.random.key(0), layout.shape)    # [512, 512]
    >>> w = jbs.from_dense(W, layout)                             # [capacity, 32, 32]
    >>> x = jnp.ones((8, 512))
    >>> y = jbs.bsmm(x, w, layout)                                # == x @ jbs.to_dense(w, layout)
    >>> y.shape
    (8, 512)
"""

from jax_blocksparse import _native, config, crossover, export, layouts, sharding, targets
from jax_blocksparse._native import extension_info, has_cpu_kernels, has_cuda_kernels
from jax_blocksparse.layout import SUPPORTED_BLOCK_SIZES, Layout
from jax_blocksparse.ops import (
    attention,  # the public namespace jbs.attention is the op's module
    moe,  # likewise jbs.moe: the dropless MoE's topology and products
)
from jax_blocksparse.ops.conv import (
    bsconv,
    bsconv_reference,
    bsconv_transpose,
    bsconv_transpose_reference,
    conv_from_dense,
    conv_to_dense,
)
from jax_blocksparse.ops.matmul import bsmm, bsmm_reference, bsmm_updat, from_dense, to_dense

__version__ = "0.1.0"

# Register the native kernels' FFI targets now, not at first use: a program deserialized
# with jax.export in this process finds them (jax_blocksparse.export). Never raises.
_native.register()

__all__ = [
    "Layout",
    "SUPPORTED_BLOCK_SIZES",
    "attention",
    "bsconv",
    "bsconv_reference",
    "bsconv_transpose",
    "bsconv_transpose_reference",
    "bsmm",
    "bsmm_reference",
    "bsmm_updat",
    "config",
    "crossover",
    "export",
    "extension_info",
    "conv_from_dense",
    "conv_to_dense",
    "from_dense",
    "has_cpu_kernels",
    "has_cuda_kernels",
    "layers",
    "layouts",
    "mixed_precision",
    "moe",
    "sharding",
    "targets",
    "nn",
    "nnx",
    "training",
    "to_dense",
]


def __getattr__(name):
    # The layers, Flax and optax import lazily so that the ops import without flax or optax.
    if name in ("layers", "mixed_precision", "nn", "nnx", "training"):
        import importlib

        return importlib.import_module(f"jax_blocksparse.{name}")
    raise AttributeError(f"module 'jax_blocksparse' has no attribute {name!r}")
