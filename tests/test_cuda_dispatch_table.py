"""The CUDA dispatch table, written out: which FFI target each product lowers to, and how.

For every op (fprop = ``bsmm``, bprop = ``bsmm(transpose=True)``, updat = ``bsmm_updat``),
block size, dtype and precision, a jitted call under implementation "kernels" is
cross-lowered for "cuda" (no GPU needed: ``jax.jit(f).trace(...).lower(
lowering_platforms=("cuda",))``, as in tests/test_cuda_lowering.py) with the Hopper gate
closed and open, and the one custom call in the text is read back: its target and its
``tf32`` attribute. The expected tables below are literals, not recomputed from the
library, so that any change of the dispatch (a target, a block size or precision moved
on or off TF32) fails here and has to be written into them.

Cross-lowering has no CUDA device, so the environment variable alone opens the gate
(jax_blocksparse/ops/_sm90.py); the test pins that by patching the device probe. Skips
where the CUDA extension or its sm_90a targets are not built, and fails there instead
under JBS_REQUIRE_KERNELS=1 (CI, whose default build includes sm_90a).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_blocksparse as jbs
from helpers import require_cuda_extension
from jax_blocksparse.ops import _sm90

HOPPER_ENV = "JAX_BLOCKSPARSE_HOPPER"
OPS = ("fprop", "bprop", "updat")
BLOCK_SIZES = jbs.SUPPORTED_BLOCK_SIZES
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # the columns of the tables, in this order
PRECISIONS = (None, "default", "high", "highest")  # within each dtype, in this order
GRID = (2, 2)  # full: capacity 4
N = 8  # rows of x: one k-step of every updat kernel, so the Hopper updat splits nothing

# One character per (dtype, precision):
#   P  the portable target jbs_bsmm_{op} (no tf32 attribute, one result);
#   T  jbs_bsmm_{op}_sm90 with tf32 = true (float32 on TF32 tensor cores);
#   F  jbs_bsmm_{op}_sm90 with tf32 = false (16-bit wgmma kernels, or exact float32).
# (fprop and bprop's sm90 calls also carry variant = "baseline": no variant is asked for here.)
# precision None is traced with no default_matmul_precision in force (JAX's default).

# JAX_BLOCKSPARSE_HOPPER unset: the portable (Ampere) targets, everything.
#                     float32  bfloat16  float16
GATE_CLOSED = {
    ("fprop", 8): ("PPPP", "PPPP", "PPPP"),
    ("fprop", 16): ("PPPP", "PPPP", "PPPP"),
    ("fprop", 32): ("PPPP", "PPPP", "PPPP"),
    ("fprop", 64): ("PPPP", "PPPP", "PPPP"),
    ("fprop", 128): ("PPPP", "PPPP", "PPPP"),
    ("bprop", 8): ("PPPP", "PPPP", "PPPP"),
    ("bprop", 16): ("PPPP", "PPPP", "PPPP"),
    ("bprop", 32): ("PPPP", "PPPP", "PPPP"),
    ("bprop", 64): ("PPPP", "PPPP", "PPPP"),
    ("bprop", 128): ("PPPP", "PPPP", "PPPP"),
    ("updat", 8): ("PPPP", "PPPP", "PPPP"),
    ("updat", 16): ("PPPP", "PPPP", "PPPP"),
    ("updat", 32): ("PPPP", "PPPP", "PPPP"),
    ("updat", 64): ("PPPP", "PPPP", "PPPP"),
    ("updat", 128): ("PPPP", "PPPP", "PPPP"),
}

# JAX_BLOCKSPARSE_HOPPER=1: the sm_90 targets take every problem; float32 runs on TF32
# below HIGHEST at every block size (cuda/sm90/bsmm_sm90_tf32.h; fprop and bprop at block 8
# since their fixed kernel ran clean on an H100), 16-bit inputs never do.
#                     float32  bfloat16  float16
GATE_OPEN = {
    ("fprop", 8): ("TTTF", "FFFF", "FFFF"),
    ("fprop", 16): ("TTTF", "FFFF", "FFFF"),
    ("fprop", 32): ("TTTF", "FFFF", "FFFF"),
    ("fprop", 64): ("TTTF", "FFFF", "FFFF"),
    ("fprop", 128): ("TTTF", "FFFF", "FFFF"),
    ("bprop", 8): ("TTTF", "FFFF", "FFFF"),
    ("bprop", 16): ("TTTF", "FFFF", "FFFF"),
    ("bprop", 32): ("TTTF", "FFFF", "FFFF"),
    ("bprop", 64): ("TTTF", "FFFF", "FFFF"),
    ("bprop", 128): ("TTTF", "FFFF", "FFFF"),
    ("updat", 8): ("TTTF", "FFFF", "FFFF"),
    ("updat", 16): ("TTTF", "FFFF", "FFFF"),
    ("updat", 32): ("TTTF", "FFFF", "FFFF"),
    ("updat", 64): ("TTTF", "FFFF", "FFFF"),
    ("updat", 128): ("TTTF", "FFFF", "FFFF"),
}

TABLES = {"closed": GATE_CLOSED, "open": GATE_OPEN}


@pytest.fixture(autouse=True)
def _cross_lowering(monkeypatch):
    require_cuda_extension()
    if not _sm90.built_targets():
        reason = "the CUDA extension was built without sm_90a (no Hopper targets)"
        if os.environ.get("JBS_REQUIRE_KERNELS") == "1":
            pytest.fail(f"JBS_REQUIRE_KERNELS=1 but {reason}")
        pytest.skip(reason)
    monkeypatch.delenv(HOPPER_ENV, raising=False)
    # No CUDA device at lowering time, whatever this machine has: the env var alone decides.
    monkeypatch.setattr(_sm90, "cuda_compute_capability", lambda: None)


def _lower(op, bs, dtype, precision, n=N):
    """StableHLO text of ``op`` cross-lowered for "cuda" under implementation "kernels".

    Traced afresh each time: JAX caches the lowering of a traced jaxpr, and the gate is
    read at lowering time."""
    layout = jbs.Layout.from_mask(np.ones(GRID, bool), bs)
    c, k = layout.shape
    w = jnp.zeros((layout.capacity, bs, bs), dtype)
    fun, arg = {
        "fprop": (lambda x: jbs.bsmm(x, w, layout, precision=precision), jnp.zeros((n, c), dtype)),
        "bprop": (lambda g: jbs.bsmm(g, w, layout, transpose=True, precision=precision), jnp.zeros((n, k), dtype)),
        "updat": (
            lambda x: jbs.bsmm_updat(x, jnp.zeros((n, k), dtype), layout, precision=precision),
            jnp.zeros((n, c), dtype),
        ),
    }[op]
    with jbs.config.implementation("kernels"), jax.default_matmul_precision(None):
        return jax.jit(fun).trace(arg).lower(lowering_platforms=("cuda",)).as_text()


def _custom_calls(text):
    """(kernel, backend_config attributes, result types) of each custom call of the library
    (the kernel's short name, read from its versioned FFI target)."""
    calls = []
    for line in text.splitlines():
        m = re.search(r"stablehlo\.custom_call @(\w+)\(", line)
        if m and jbs.targets.kernel_of(m.group(1)):
            config = re.search(r"mhlo\.backend_config = \{([^}]*)\}", line)
            results = re.findall(r"tensor<[^>]*>", line.rsplit(" -> ", 1)[1])
            calls.append((jbs.targets.kernel_of(m.group(1)), config.group(1).strip() if config else None, results))
    return calls


def _cell(op, text):
    """The table character for the one custom call in ``text`` (see the legend above), or
    a description of what was found instead."""
    calls = _custom_calls(text)
    if len(calls) != 1:
        return f"<{len(calls)} calls: {calls}>"
    target, config, results = calls[0]
    if target == f"jbs_bsmm_{op}" and config == "" and len(results) == 1:
        return "P"
    if target.endswith("_sm90") and op != "updat" and config:  # the v2 DSD targets: their variant, the baseline here
        config = config.replace(', variant = "baseline"', "") if config.endswith('variant = "baseline"') else "?"
    if target == f"jbs_bsmm_{op}_sm90" and config in ("tf32 = true", "tf32 = false"):
        # updat_sm90's second result is the split-N workspace: empty here (N = one k-step).
        if results[1:] == (["tensor<0xui8>"] if op == "updat" else []):
            return "T" if config == "tf32 = true" else "F"
    return f"<{target} {{{config}}} -> {results}>"


@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("gate", sorted(TABLES))
def test_dispatch_table(monkeypatch, gate, op, bs):
    if gate == "open":
        monkeypatch.setenv(HOPPER_ENV, "1")
    got = tuple("".join(_cell(op, _lower(op, bs, dtype, p)) for p in PRECISIONS) for dtype in DTYPES)
    want = TABLES[gate][op, bs]
    assert got == want, f"gate {gate}, {op}, block {bs}: lowered to {got}, the table says {want}"


def test_tables_cover_every_case():
    for table in TABLES.values():
        assert sorted(table) == sorted((op, bs) for op in OPS for bs in BLOCK_SIZES)
        for row in table.values():
            assert len(row) == len(DTYPES) and all(len(cells) == len(PRECISIONS) for cells in row)


# updat_sm90's workspace: float32 partial sums [splits, capacity, bs, bs] when the plan splits
# the N reduction. Capacity 4 (the full 2 x 2 grid), n = 200 rows (a multiple of 4: the TF32
# operands need no padding). Rows of n per k-step: 64 at blocks 8/16/32, 32 at 64/128; the
# plan splits up to one k-step per split while it has fewer work items than 2 x 132 SMs.
#   (block size, dtype, precision): workspace bytes
WORKSPACE_N = 200
WORKSPACE = {
    (16, jnp.bfloat16, "default"): 4 * 4 * 16 * 16 * 4,  # 4 k-steps, 1 item of 4 slots: 4 splits
    (128, jnp.bfloat16, "default"): 7 * 4 * 128 * 128 * 4,  # 7 k-steps, 2 items of 2 slots: 7 splits
    (64, jnp.float32, "default"): 7 * 4 * 64 * 64 * 4,  # TF32: the 16-bit plan over x^T / dy^T
    (64, jnp.float32, "highest"): 0,  # exact float32: the portable kernel, no workspace
}


@pytest.mark.parametrize("bs, dtype, precision", list(WORKSPACE), ids=lambda v: getattr(v, "__name__", str(v)))
def test_updat_workspace(monkeypatch, bs, dtype, precision):
    monkeypatch.setenv(HOPPER_ENV, "1")
    ((target, _, results),) = _custom_calls(_lower("updat", bs, dtype, precision, n=WORKSPACE_N))
    dt = {jnp.float32: "f32", jnp.bfloat16: "bf16"}[dtype]
    assert target == "jbs_bsmm_updat_sm90"
    assert results == [f"tensor<4x{bs}x{bs}x{dt}>", f"tensor<{WORKSPACE[bs, dtype, precision]}xui8>"], results
