"""bsconv / bsconv_transpose through the CUDA kernels (implementation "kernels") on a GPU.

bsconv is built from the bsmm primitives, so on 'cuda' it runs the bsmm kernels; these
tests check the whole composition on hardware against the dense ``lax`` convolution
(cuDNN), forward and backward. The directory skips where there is no GPU.

Precision: every bsconv call states ``precision="highest"`` (exact float32, as the float32
tolerances mean; on the Hopper targets DEFAULT would run float32 on TF32), and the oracles
``bsconv_reference`` / ``bsconv_transpose_reference`` are exact by definition (HIGHEST).
tests/test_gpu_tests_on_cpu.py checks on CPU that no product here is left to a
default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import assert_close, make_mask, rand

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# (spatial shape, kernel size, strides, padding, dilation)
GEOMETRIES = [
    ((9,), (3,), 1, "SAME", 1),
    ((8, 7), (3, 3), 1, "SAME", 1),
    ((8, 8), (3, 3), 2, "VALID", 1),
    ((7, 9), (3, 1), (1, 2), ((1, 0), (2, 1)), (2, 1)),
    ((4, 5, 6), (3, 3, 3), 1, "SAME", 1),
]


@pytest.fixture(scope="module", autouse=True)
def _need_kernels():
    if not jbs.has_cuda_kernels():
        pytest.fail(f"GPU present but the CUDA extension is not loaded: {jbs._native.load_error('cuda')}")


def _problem(bs, grid, spatial, kernel_size, dtype, kind="random", seed=0):
    layout = jbs.Layout.from_mask(make_mask(kind, grid, seed), bs)
    x = rand((3, *spatial, grid[0] * bs), dtype, seed + 1)
    w = rand((layout.capacity, *kernel_size, bs, bs), dtype, seed + 2)
    return x, w, layout


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("bs", [8, 16, 32, 64])
@pytest.mark.parametrize("geometry", range(len(GEOMETRIES)))
def test_bsconv_kernels_match_dense_conv(dtype, bs, geometry):
    spatial, kernel_size, strides, padding, dilation = GEOMETRIES[geometry]
    dtype = DTYPES[dtype]
    x, w, layout = _problem(bs, (3, 2), spatial, kernel_size, dtype)
    kwargs = dict(strides=strides, padding=padding, dilation=dilation)
    with jbs.config.implementation("kernels"):
        got = jax.jit(lambda x, w: jbs.bsconv(x, w, layout, **kwargs, precision="highest"))(x, w)
    want = jbs.bsconv_reference(x.astype(jnp.float32), w.astype(jnp.float32), layout, **kwargs)
    assert_close(got, want, dtype, length=int(np.prod(kernel_size)) * x.shape[-1])


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["random", "empty_rows_cols", "full"])
def test_bsconv_grad_through_kernels(dtype, kind):
    dtype = DTYPES[dtype]
    x, w, layout = _problem(16, (3, 4), (6, 5), (3, 3), dtype, kind)

    def loss(y):
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    def kernels_loss(x, w):
        return loss(jbs.bsconv(x, w, layout, strides=(1, 2), precision="highest"))

    def reference_loss(x, w):
        return loss(jbs.bsconv_reference(x, w, layout, strides=(1, 2)))

    with jbs.config.implementation("kernels"):
        got = jax.jit(jax.grad(kernels_loss, argnums=(0, 1)))(x, w)
    x32, w32 = x.astype(jnp.float32), w.astype(jnp.float32)
    want = jax.grad(reference_loss, argnums=(0, 1))(x32, w32)
    for g, r in zip(got, want):
        assert_close(g, r, dtype, length=9 * 64)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_bsconv_transpose_kernels(dtype):
    dtype = DTYPES[dtype]
    x, w, layout = _problem(16, (2, 3), (5, 4), (3, 3), dtype)
    with jbs.config.implementation("kernels"):
        got = jax.jit(lambda x, w: jbs.bsconv_transpose(x, w, layout, strides=2, padding="SAME", precision="highest"))(
            x, w
        )
    want = jbs.bsconv_transpose_reference(
        x.astype(jnp.float32), w.astype(jnp.float32), layout, strides=2, padding="SAME"
    )
    assert_close(got, want, dtype, length=9 * 32)
