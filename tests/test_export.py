"""jax.export of everything the library offers, run in a fresh process.

Every op (bsmm, its transpose, bsmm_updat, a gradient through all three, bsconv,
bsconv_transpose, block-sparse attention, the fused LSTM sequence) and every layer
(linen ``apply`` and NNX ``nnx.merge(graphdef, params)``) is exported here on the CPU
kernels and on the reference path, serialized, then deserialized and called in child
processes (one per mode, all artifacts at once, to keep this file fast):

* a child that imports ``jax_blocksparse`` runs every artifact, with results equal to
  the ones computed here (bit for bit: the same program on the same CPU);
* a child that never imports it runs every reference artifact (they hold no custom
  call of the library: JAX's own safety check passes without any help), and fails on a
  kernel artifact with an error that names ``jax_blocksparse``;
* an artifact exported for ``("cpu", "cuda")`` at once (no GPU here) runs on the CPU.

Also: the FFI target table (jax_blocksparse/targets.py) agrees with what the extension
registers; ``jax.export.export`` refuses the kernels' custom calls without
:func:`jax_blocksparse.export.disabled_checks` and accepts them with it; an extension
that is missing, broken or out of date leaves the package importable.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_blocksparse as jbs
from helpers import kernel_calls, rand, require_kernels, run_python
from jax_blocksparse import _native, targets
from jax_blocksparse.ops.recurrence import bs_lstm_sequence, lstm_spec

BS = 8  # small programs: the compile times of the artifacts are this file's run time
IMPLS = ("kernels", "reference")
# "auto" lowers for "cuda" whatever the build holds (the reference until the CUDA kernels
# are verified); "kernels" needs the CUDA kernels built (CI builds them: nvcc is there).
MULTI_PLATFORM_IMPLS = ("auto", "reference") + (("kernels",) if _native.has_kernels("cuda") else ())
MASK = jbs.layouts.barabasi_albert(4, 1, seed=0)  # [4, 4] blocks
ATTENTION_MASK = jbs.layouts.causal(jbs.layouts.local(4, 2))  # T = 32
OPS = (
    "bsmm",
    "bsmm_layout_argument",
    "bsmm_transpose",
    "bsmm_updat",
    "bsmm_grad",
    "bsconv",
    "bsconv_transpose",
    "attention",
    "lstm_sequence",
)
LAYERS = tuple(
    f"{flavour}_{layer}"
    for flavour in ("linen", "nnx")
    for layer in ("dense", "conv", "conv_transpose", "attention", "lstm")
)
# A crossover table where the CPU kernels win at every density (the export's "auto").
KERNELS_WIN = jbs.crossover.CrossoverTable.from_entries(
    dict(
        platform="cpu",
        device_kind=jbs.crossover.cpu_device_kind(),
        target=f"jbs_bsmm_{op}",
        mode="float32",
        block_size=BS,
        crossover=1.0,
    )
    for op in ("fprop", "bprop", "updat")
)
# artifact names: "<case>.<impl>" on the CPU, "<case>.<impl>.cpu+cuda" for both platforms
ARTIFACTS = [f"{case}.{impl}" for impl in IMPLS for case in OPS + LAYERS]
ARTIFACTS += [f"bsmm_grad.{impl}.cpu+cuda" for impl in MULTI_PLATFORM_IMPLS]
# What the child without the import runs: the reference artifacts (a Layout argument needs
# the import to deserialize: its pytree is the library's) and one on the kernels.
NO_IMPORT = [a for a in ARTIFACTS if ".reference" in a and "layout_argument" not in a] + ["bsmm_grad.kernels"]

# ---------------------------------------------------------------------------------
# The exported functions: name -> (function of array pytrees, its arguments)
# ---------------------------------------------------------------------------------


def _op_cases():
    mask = MASK  # C = K = 32
    layout = jbs.Layout.from_mask(mask, BS)
    x, dy, w = rand((6, 32), seed=1), rand((6, 32), seed=2), rand(layout.w_shape, seed=3)
    conv_w = rand((layout.capacity, 2, 2, BS, BS), seed=4)
    img = rand((2, 4, 4, 32), seed=5)
    q, k, v = (rand((2, 32, 2, 8), seed=s) for s in (6, 7, 8))  # [batch, T, heads, head_dim]
    gates = jbs.Layout.from_mask(np.tile(mask, (1, 4)), BS)
    spec = lstm_spec(32, gates, layer_norm=False)
    keys = iter(jax.random.split(jax.random.key(0), 8))
    lstm_params = {n: 0.1 * jax.random.normal(next(keys), s) for n, s in spec.param_shapes(8).items()}
    carry = (jnp.zeros((2, 32)), jnp.zeros((2, 32)))

    def loss(x, w):
        return jnp.sum(jbs.bsmm(x, w, layout) ** 2)

    return {
        "bsmm": (lambda x, w: jbs.bsmm(x, w, layout), (x, w)),
        "bsmm_layout_argument": (lambda x, w, lay: jbs.bsmm(x, w, lay), (x, w, layout)),
        "bsmm_transpose": (lambda dy, w: jbs.bsmm(dy, w, layout, transpose=True), (dy, w)),
        "bsmm_updat": (lambda x, dy: jbs.bsmm_updat(x, dy, layout), (x, dy)),
        "bsmm_grad": (jax.value_and_grad(loss, argnums=(0, 1)), (x, w)),
        "bsconv": (lambda x, w: jbs.bsconv(x, w, layout, strides=2), (img, conv_w)),
        "bsconv_transpose": (lambda x, w: jbs.bsconv_transpose(x, w, layout, strides=2), (img, conv_w)),
        "attention": (
            lambda q, k, v: jbs.attention.blocksparse_attention(q, k, v, ATTENTION_MASK, BS, is_causal=True),
            (q, k, v),
        ),
        "lstm_sequence": (lambda p, xs: bs_lstm_sequence(spec, p, carry, xs), (lstm_params, rand((3, 2, 8), seed=9))),
    }


def _layers(rngs=None):
    """name -> (layer, input): the linen layers (rngs None) or their NNX siblings."""
    mask, attn = MASK, ATTENTION_MASK
    lstm_in, img, seq = rand((2, 3, 8), seed=10), rand((2, 4, 4, 32), seed=11), rand((2, 32, 16), seed=13)
    if rngs is None:
        m = jbs.nn
        return {
            "dense": (m.BlockSparseDense(32, mask, block_size=BS), rand((3, 32), seed=12)),
            "conv": (m.BlockSparseConv(32, (2, 2), mask, block_size=BS, strides=2), img),
            "conv_transpose": (m.BlockSparseConvTranspose(32, (2, 2), mask, block_size=BS, strides=2), img),
            "attention": (m.BlockSparseSelfAttention(num_heads=2, mask=attn, block_size=BS, is_causal=True), seq),
            "lstm": (m.BlockSparseLSTM(m.BlockSparseLSTMCell(32, mask, BS)), lstm_in),
        }
    m = jbs.nnx
    return {
        "dense": (m.BlockSparseLinear(32, 32, mask, BS, rngs=rngs), rand((3, 32), seed=12)),
        "conv": (m.BlockSparseConv(32, 32, (2, 2), mask, BS, strides=2, rngs=rngs), img),
        "conv_transpose": (m.BlockSparseConvTranspose(32, 32, (2, 2), mask, BS, strides=2, rngs=rngs), img),
        "attention": (m.BlockSparseSelfAttention(2, 16, attn, BS, is_causal=True, rngs=rngs), seq),
        "lstm": (m.BlockSparseLSTM(m.BlockSparseLSTMCell(8, 32, mask, BS, rngs=rngs)), lstm_in),
    }


def _layer_cases():
    """The recipes of docs/guide/deployment.rst: linen ``apply`` on (variables, x); NNX
    ``nnx.merge(graphdef, params)`` on (pure-dict params, x)."""
    cases = {}
    for name, (layer, x) in _layers().items():
        variables = layer.init(jax.random.key(0), x)
        cases[f"linen_{name}"] = (layer.apply, (variables, x))
    for name, (layer, x) in _layers(rngs=nnx.Rngs(0)).items():
        graphdef, state = nnx.split(layer)
        cases[f"nnx_{name}"] = (lambda p, x, _g=graphdef: nnx.merge(_g, p)(x), (nnx.to_pure_dict(state), x))
    return cases


# ---------------------------------------------------------------------------------
# Export here, run in children
# ---------------------------------------------------------------------------------

# Runs the artifacts of a directory; imports jax_blocksparse unless told not to. Writes
# {name: "ok" or the error} and each result's leaves.
CHILD = textwrap.dedent(
    """
    import json, pathlib, pickle, sys
    folder, mode = pathlib.Path(sys.argv[1]), sys.argv[2]
    if mode == "import":
        import jax_blocksparse  # registers the FFI targets
    import jax
    status = {}
    for name in json.loads((folder / f"names.{mode}.json").read_text()):
        exported = jax.export.deserialize(bytearray((folder / f"{name}.bin").read_bytes()))
        args = pickle.loads((folder / f"{name}.args").read_bytes())
        try:
            result = exported.call(*args)
            leaves = [jax.device_get(v) for v in jax.tree.leaves(result)]
            (folder / f"{name}.{mode}.out").write_bytes(pickle.dumps(leaves))
            status[name] = "ok"
        except Exception as err:
            status[name] = f"{type(err).__name__}: {err}"
    status["<imported>"] = "jax_blocksparse" in sys.modules
    (folder / f"status.{mode}.json").write_text(json.dumps(status))
    """
)


def _run_child(folder, mode: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder), mode], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((folder / f"status.{mode}.json").read_text())


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """Exports every case (both implementations, and two multi-platform artifacts), runs the
    two children; returns (folder, {artifact: (expected leaves, custom-call kernels)},
    {mode: status})."""
    require_kernels("cpu")
    folder = tmp_path_factory.mktemp("export")
    cases = {**_op_cases(), **_layer_cases()}
    assert sorted(cases) == sorted(OPS + LAYERS)
    info = {}
    for name in ARTIFACTS:
        case, impl, *both = name.split(".")
        fun, args = cases[case]
        platforms = ("cpu", "cuda") if both else ("cpu",)  # several at once: no GPU needed
        # "auto" on the CPU kernels, whatever this machine's own crossovers say (MASK is dense
        # enough for the dense product on some machines).
        with jbs.config.implementation(impl), jbs.crossover.use_table(KERNELS_WIN):
            if impl == "reference":  # no custom call of the library: JAX's check passes as it is
                exported = jax.export.export(jax.jit(fun), platforms=platforms)(*args)
            else:
                exported = jbs.export.export(jax.jit(fun), platforms=platforms)(*args)
            expected = jax.jit(fun)(*args)
        (folder / f"{name}.bin").write_bytes(exported.serialize())
        (folder / f"{name}.args").write_bytes(pickle.dumps(jax.device_get(args)))
        info[name] = ([np.asarray(v) for v in jax.tree.leaves(expected)], kernel_calls(exported.mlir_module()))
    (folder / "names.import.json").write_text(json.dumps(ARTIFACTS))
    (folder / "names.no-import.json").write_text(json.dumps(NO_IMPORT))
    status = {mode: _run_child(folder, mode) for mode in ("import", "no-import")}
    return folder, info, status


def _outputs(folder, name, mode):
    return pickle.loads((folder / f"{name}.{mode}.out").read_bytes())


@pytest.mark.parametrize("name", ARTIFACTS)
def test_round_trip_in_a_fresh_process(round_trip, name):
    folder, info, status = round_trip
    expected, calls = info[name]
    if ".reference" not in name:
        assert calls, f"{name}: exported on the kernels, yet calls none of the library's targets"
    else:
        assert not calls, f"{name}: the reference path calls {calls}"
    assert status["import"][name] == "ok", status["import"][name]
    got = _outputs(folder, name, "import")
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e, err_msg=name)


@pytest.mark.parametrize("name", NO_IMPORT[:-1])
def test_reference_artifact_needs_no_import(round_trip, name):
    folder, info, status = round_trip
    assert status["no-import"]["<imported>"] is False
    assert status["no-import"][name] == "ok", status["no-import"][name]
    for g, e in zip(_outputs(folder, name, "no-import"), info[name][0]):
        np.testing.assert_array_equal(g, e, err_msg=name)


def test_kernel_artifact_without_the_import_names_the_package(round_trip):
    _, info, status = round_trip
    message = status["no-import"]["bsmm_grad.kernels"]
    assert message != "ok"
    # XLA's own words, with the target name that names the package to import.
    assert "No FFI handler registered for jax_blocksparse_bsmm_" in message, message
    assert info["bsmm_grad.kernels"][1] == {"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"}


def test_multi_platform_artifact_holds_both_lowerings(round_trip):
    folder, _, _ = round_trip
    exported = jax.export.deserialize(bytearray((folder / "bsmm_grad.auto.cpu+cuda.bin").read_bytes()))
    assert exported.platforms == ("cpu", "cuda")
    calls = kernel_calls(exported.mlir_module())
    assert calls == {"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"}, calls


# ---------------------------------------------------------------------------------
# The safety check, the target table, the extension
# ---------------------------------------------------------------------------------


def _kernels_fun():
    layout = jbs.Layout.from_mask(np.eye(2, dtype=bool), 8)
    return jax.jit(lambda x, w: jbs.bsmm(x, w, layout, impl="kernels")), (jnp.ones((3, 16)), jnp.ones((2, 8, 8)))


def test_plain_export_refuses_the_kernels_and_the_helpers_allow_them():
    require_kernels("cpu")
    fun, args = _kernels_fun()
    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(fun, platforms=("cpu",))(*args)
    exported = jax.export.export(fun, platforms=("cpu",), disabled_checks=jbs.export.disabled_checks())(*args)
    assert kernel_calls(exported.mlir_module()) == {"jbs_bsmm_fprop"}
    wrapped = jbs.export.export(fun, platforms=("cpu",), disabled_checks=[jax.export.DisabledSafetyCheck.platform()])
    assert jax.export.DisabledSafetyCheck.platform() in wrapped(*args).disabled_safety_checks
    with pytest.raises(TypeError, match="platforms"):
        jbs.export.export(fun, platforms="cpu")
    with pytest.raises(TypeError, match="disabled_checks"):
        jbs.export.export(fun, disabled_checks=["custom_call:foo"])


def test_disabled_checks_name_every_target_and_nothing_else():
    checks = jbs.export.disabled_checks()
    assert sorted(c.is_custom_call() for c in checks) == sorted(targets.all_targets())
    assert all(name.startswith("jax_blocksparse_") for name in targets.all_targets())


def test_target_names():
    assert targets.target_name("jbs_bsmm_fprop") == "jax_blocksparse_bsmm_fprop_v1"
    assert targets.target_name("jbs_bsmm_updat_sm90", 1) == "jax_blocksparse_bsmm_updat_sm90_v1"
    for kernel in targets.VERSIONS:
        for version in targets.VERSIONS[kernel]:
            assert targets.kernel_of(targets.target_name(kernel, version)) == kernel
    assert targets.kernel_of("jax_blocksparse_bsmm_fprop_v999") is None  # not a registered version
    assert targets.kernel_of("lapack_sgetrf_ffi") is None
    with pytest.raises(ValueError, match="unknown kernel"):
        targets.target_name("bsmm_fprop")
    with pytest.raises(ValueError, match="no version 2"):
        targets.target_name("jbs_bsmm_fprop", 2)
    with pytest.raises(ValueError, match="platform"):
        targets.all_targets("tpu")
    cpu, cuda = set(targets.all_targets("cpu")), set(targets.all_targets("cuda"))
    assert cpu | cuda == set(targets.all_targets())
    # The bsmm kernels on both; the convolution kernels and the dense path's conversions on
    # "cpu" only, the Hopper ones on "cuda" only.
    cpu_only = ("jbs_bsconv", "jbs_bsconv_wgrad", "jbs_blocks_to_dense", "jbs_dense_to_blocks", "jbs_transpose")
    assert cpu - cuda == {targets.target_name(k, v) for k in cpu_only for v in targets.VERSIONS[k]}
    assert all("_sm90_" in name for name in cuda - cpu)


def test_extension_registers_exactly_the_table():
    """The names are defined once: cuda/module.cc's registrations() reports the table's."""
    require_kernels("cpu")
    registrations = _native._load()[0].registrations()
    assert set(registrations["cpu"]) == set(targets.all_targets("cpu"))
    if "CUDA" in registrations:
        cuda = set(registrations["CUDA"])
        portable = {name for name in targets.all_targets("cuda") if "_sm90_" not in name}
        assert cuda in (portable, set(targets.all_targets("cuda"))), sorted(cuda)  # Hopper ones with sm_90a
    assert _native.registered_targets("cpu") == set(targets.all_targets("cpu"))


def test_out_of_date_extension_is_reported(monkeypatch):
    old = {"cpu": frozenset({"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat"})}
    monkeypatch.setattr(_native, "_load", lambda: (object(), old, None))
    assert not jbs.has_cpu_kernels()
    assert "out of date" in _native.load_error("cpu") and "jax_blocksparse_bsmm_fprop_v1" in _native.load_error("cpu")
    assert "out of date" in _native.load_error()
    fun, args = _kernels_fun()
    with pytest.raises(RuntimeError, match="out of date"):
        fun.lower(*args)


BROKEN_EXTENSION = textwrap.dedent(
    """
    import sys, types
    sys.modules["jax_blocksparse._jbs_kernels"] = None  # as if not built: import fails
    import jax, jax.numpy as jnp
    import jax_blocksparse as jbs
    assert not jbs.has_cpu_kernels() and "extension not built" in jbs._native.load_error("cpu")
    layout = jbs.Layout.from_mask([[1, 0], [1, 1]], 8)
    x, w = jnp.ones((2, 16)), jnp.ones(layout.w_shape)
    assert jnp.array_equal(jbs.bsmm(x, w, layout), jbs.bsmm_reference(x, w, layout))  # "auto": the reference
    broken = types.ModuleType("jax_blocksparse._jbs_kernels")
    def registrations():
        raise RuntimeError("simulated")
    broken.registrations = registrations
    sys.modules["jax_blocksparse._jbs_kernels"] = broken
    jbs._native._load.cache_clear()
    jbs._native.register()
    assert not jbs.has_cpu_kernels() and "could not be registered" in jbs._native.load_error("cpu")
    print("ok")
    """
)


def test_package_imports_without_a_working_extension():
    proc = run_python(BROKEN_EXTENSION)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
