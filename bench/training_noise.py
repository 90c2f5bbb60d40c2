"""Noise floor of the training-step checks: how far rounding alone moves the reference.

tests/training_steps.py runs real jitted training steps through the kernels and through
the pure-JAX reference and bounds their differences (``training_steps.TOLERANCES``).
This script measures, per model (``training_steps.MODELS``), dtype and quantity, how
large those same differences are when nothing but rounding differs, with the same
builders and the same metrics (``training_steps.run``, ``compare``, ``replay``). Each
comparison is a candidate path against a baseline run, as the check compares the
kernels against the reference:

* ``split_*`` (float32 and bfloat16, :data:`SPLITS`): the reference in another summation
  order against the reference. Every block-sparse product's contraction (bsmm's three
  and the convolution's two primitives) is split in
  parts (halves, even and odd indices, thirds, quarters, indices mod 4, eighths), each
  part accumulated in float32 by the reference's own code (the other parts' terms
  zeroed), and the parts added in float32 before the cast to the output dtype. The
  contraction runs over each block's rows of w (fprop), its columns (bprop) or the rows
  N (updat); for the convolution, over w's input channels or the input's positions (the
  weight gradient). These are installed as the CPU lowering of the primitives once every
  other path of the model is compiled, so each model runs in a process of its own.
* ``cpu_kernels``: the native CPU kernels against the reference (float32 accumulation in
  the kernels' order): what tests/test_training_steps_cpu.py checks.
* ``bf16_vs_f32`` (bfloat16): the bfloat16 reference against the float32 reference
  (the baseline): the rounding bfloat16 itself brings, an upper scale for the others.
* ``excess_precision`` (bfloat16): the CPU kernels against the reference as XLA:GPU
  runs it with its default ``--xla_allow_excess_precision=true``, emulated: its
  SimplifyFPConversions pass deletes an f32 -> bf16 -> f32 round trip, so a product's
  float32 accumulation that the reference casts to bfloat16 and the next op widens
  again reaches that op unrounded; the kernels' custom calls hand over bfloat16. The
  emulation evaluates the reference's jaxpr with every bfloat16 product computed in
  float32, the widening convert right after it taking the float32 value (only those
  round trips: XLA:GPU also removes the ones both paths share).

The floor of a quantity is its largest value over the splits and ``cpu_kernels`` (seven
other orders of the same products, all accumulating in float32). The JSON holds every
comparison and ``floors[dtype][model]``; tests/training_steps.py's tolerances are stated
multiples of these floors. Each model runs in a child process on the CPU, with the XLA
flags of the GPU test's children (``training_steps.child_environment``).

Usage::

    python bench/training_noise.py                  # every model; bench/results/training_noise-cpu-<n>cores-<date>.json
    python bench/training_noise.py --models mlp rnn_cells --steps 2 --json /tmp/noise.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import mlir

import jax_blocksparse as jbs
from jax_blocksparse.ops import conv_primitives, matmul

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH))  # bench/_report.py
sys.path.insert(0, str(_BENCH.parent / "tests"))  # tests/training_steps.py
from _report import git_commit, write_json  # noqa: E402

import training_steps as ts  # noqa: E402

#: The quantities of :func:`training_steps.check`, and the layout update's (rigl).
QUANTITIES = ("step_loss_err", "step_grad_err", "loss_err", "param_err", "update_param_diff")
RESULT_MARKER = "JBS_TRAINING_NOISE "
_F32 = np.dtype(np.float32)
_BF16 = np.dtype(jnp.bfloat16)


# ---------------------------------------------------------------------------------
# The reference in a second summation order
# ---------------------------------------------------------------------------------


#: The second summation orders: name -> (parts, interleaved). The contraction's index i
#: goes to part i // (n / parts) (blocks of consecutive indices) or, interleaved, i % parts.
SPLITS = {
    "split_halves": (2, False),
    "split_even_odd": (2, True),
    "split_thirds": (3, False),
    "split_quarters": (4, False),
    "split_mod4": (4, True),
    "split_eighths": (8, False),
}
#: Comparisons whose largest value is the floor: other orders of the same float32 accumulations.
FLOOR_OF = (*SPLITS, "cpu_kernels")


def _part_masks(n: int, parts: int, interleaved: bool):
    """``parts`` bool [n] masks, one per part of a contraction of length ``n``."""
    i = jnp.arange(n)
    group = i % parts if interleaved else i * parts // n
    return [group == g for g in range(parts)]


def _split_sum(reference, operand, axes, parts, interleaved, *args, out_dtype, **params):
    """``reference(*args)`` as the sum, in float32 and in part order, of ``parts`` products,
    each with operand ``args[operand]`` zero outside one part of its (row-major flattened)
    ``axes``: each part is the reference's own float32 accumulation of that part's terms
    (a zeroed term adds 0). ``axes`` is a function of the primitive's params and the
    operand's rank."""
    f = functools.partial(reference, out_dtype=_F32, **params)
    x = args[operand]
    axes = [a % x.ndim for a in axes(params, x.ndim)]
    n = math.prod(x.shape[a] for a in axes)
    shape = [x.shape[a] if a in axes else 1 for a in range(x.ndim)]
    terms = []
    for m in _part_masks(n, parts, interleaved):
        parted = list(args)
        parted[operand] = jnp.where(m.reshape(shape), x, jnp.zeros((), x.dtype))
        terms.append(f(*parted))
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total.astype(out_dtype)


def _leading(params, ndim):
    return tuple(range(ndim - 1))


#: primitive -> (its reference, the operand and the axes its contraction is split over).
#: Every term of a contraction reads one element of that operand along those axes, so
#: zeroing a part of them keeps exactly that part's terms.
_CONTRACTIONS = {
    matmul.bsmm_fprop_p: (matmul.bsmm_fprop_reference, 1, lambda p, nd: (1,)),  # w's rows: C
    matmul.bsmm_bprop_p: (matmul.bsmm_bprop_reference, 1, lambda p, nd: (2,)),  # w's columns: K
    matmul.bsmm_updat_p: (matmul.bsmm_updat_reference, 0, _leading),  # x's rows N
    # The convolution: w's input channels (its columns with the kernel channel-swapped) ...
    conv_primitives.bsconv_p: (
        conv_primitives.conv_reference,
        1,
        lambda p, nd: (-1 if p["spec"].transpose_kernel else -2,),
    ),
    # ... and, for the weight gradient, the input's batch and spatial positions.
    conv_primitives.bsconv_wgrad_p: (conv_primitives.wgrad_reference, 0, _leading),
}


#: The product primitives: those the split orders and the excess-precision emulation reach.
_PRIMITIVES = tuple(_CONTRACTIONS)


def split_reference(prim, split: str):
    """The reference of ``prim`` in the summation order ``split`` (a key of :data:`SPLITS`)."""
    reference, operand, axes = _CONTRACTIONS[prim]
    return functools.partial(_split_sum, reference, operand, axes, *SPLITS[split])


#: What :func:`install_split_references`' lowerings do: ``split`` names the order now in
#: force, ``lowered`` counts the lowerings.
SPLIT_STATE = {"split": None, "lowered": 0}


def install_split_references() -> None:
    """Makes the split references the CPU lowering of the product primitives, whatever their
    ``impl``, for the rest of this process (there is no public way back: call it after
    compiling everything else). Each lowering reads ``SPLIT_STATE["split"]``."""
    for prim in _CONTRACTIONS:

        def rule(ctx, *args, _prim=prim, **params):
            SPLIT_STATE["lowered"] += 1
            fn = split_reference(_prim, SPLIT_STATE["split"])
            return mlir.lower_fun(fn, multiple_results=False)(ctx, *args, **params)

        mlir.register_lowering(prim, rule, platform="cpu")


# ---------------------------------------------------------------------------------
# The reference as XLA:GPU runs it by default (excess precision), emulated
# ---------------------------------------------------------------------------------


def _with_sub_jaxpr(params: dict, counter) -> dict:
    """``params`` of jit / scan with their ``jaxpr`` evaluated by :func:`eval_excess_precision`."""
    closed = params["jaxpr"]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type) for v in closed.jaxpr.invars]
    inner = jax.make_jaxpr(lambda *a: eval_excess_precision(closed.jaxpr, closed.consts, *a, counter=counter))(*avals)
    return dict(params, jaxpr=inner)


def eval_excess_precision(jaxpr, consts, *args, counter: dict | None = None):
    """Evaluates ``jaxpr`` (traceable) with each bfloat16 block-sparse product computed in
    float32, and a ``convert_element_type`` to float32 of its result taking the float32
    value (what XLA:GPU's SimplifyFPConversions does); every other use sees the bfloat16
    rounding. Recurses into jit and scan; other higher-order primitives are bound as they are.
    ``counter["collapsed"]`` counts the round trips removed (at trace time).
    """
    env, unrounded = {}, {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        prim, params, invals = eqn.primitive, dict(eqn.params), [read(v) for v in eqn.invars]
        source = eqn.invars[0] if eqn.invars and not isinstance(eqn.invars[0], jcore.Literal) else None
        if prim in _PRIMITIVES and np.dtype(params["out_dtype"]) == _BF16:
            full = prim.bind(*invals, **dict(params, out_dtype=_F32))
            unrounded[eqn.outvars[0]] = full
            outs = [full.astype(jnp.bfloat16)]
        elif prim.name == "convert_element_type" and source in unrounded and np.dtype(params["new_dtype"]) == _F32:
            if counter is not None:
                counter["collapsed"] = counter.get("collapsed", 0) + 1
            outs = [unrounded[source]]
        else:
            if prim.name in ("jit", "pjit", "scan"):
                params = _with_sub_jaxpr(params, counter)
            bind_params, subfuns = prim.get_bind_params(params), ()
            if isinstance(bind_params, tuple):  # jax before 0.9.2: (subfuns, params)
                subfuns, bind_params = bind_params
            with eqn.ctx.manager:  # as jax's own eval_jaxpr binds
                outs = prim.bind(*subfuns, *invals, **bind_params)
            outs = outs if prim.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def excess_precision_programs(problem: ts.Problem) -> dict:
    """:func:`training_steps.compile_programs` of the reference, each program evaluated by
    :func:`eval_excess_precision` (same signatures, compiled)."""
    state, batch = problem.state, problem.batches[0]
    functions = {"train": (problem.train_step, (state, batch))}
    if problem.update_step is not None:
        functions["update"] = (problem.update_step, (state, batch, jnp.asarray(1, jnp.int32)))
    programs = {}
    for name, (fn, args) in functions.items():
        with jbs.config.implementation("reference"), jax.default_matmul_precision("highest"):
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        tree = jax.tree.structure(shape)

        def emulated(*a, _closed=closed, _tree=tree):
            return jax.tree.unflatten(_tree, eval_excess_precision(_closed.jaxpr, _closed.consts, *jax.tree.leaves(a)))

        with jax.default_matmul_precision("highest"):
            programs[name] = jax.jit(emulated).lower(*args).compile()
    return programs


# ---------------------------------------------------------------------------------
# One model (a child process)
# ---------------------------------------------------------------------------------


def differences(problem: ts.Problem, programs: dict, baseline: ts.Run) -> dict:
    """The numbers :func:`training_steps.check` judges for ``programs`` against ``baseline``
    (their own run from the problem's state, and the replay of the baseline's calls)."""
    out = ts.compare(problem, ts.run(problem, programs), baseline)
    out.update(ts.replay(problem, programs, baseline))
    return {k: out[k] for k in (*QUANTITIES, "layouts_equal", "update_layouts_equal") if k in out}


def measure_model(name: str, steps: int = ts.STEPS, log=None) -> dict:
    """Every comparison of the module docstring for model ``name``: {dtype: {comparison: numbers}}.

    Installs the split references at the end (see :func:`install_split_references`).
    """
    log = log or (lambda line: None)
    problems = {d: ts.build(name, d, steps) for d in ts.DTYPES}
    compiled, runs = {}, {}
    for dtype, problem in problems.items():
        for impl in ("reference", "kernels"):
            log(f"{name} {dtype}: {impl}")
            compiled[dtype, impl] = ts.compile_programs(problem, impl)
            runs[dtype, impl] = ts.run(problem, compiled[dtype, impl])
    log(f"{name} bfloat16: excess_precision")
    emulated = excess_precision_programs(problems["bfloat16"])
    emulated_run = ts.run(problems["bfloat16"], emulated)

    install_split_references()
    split = {}
    for order in SPLITS:
        SPLIT_STATE["split"] = order
        for dtype in ts.DTYPES:  # a new problem: new functions to trace, so nothing cached is reused
            log(f"{name} {dtype}: {order}")
            before = SPLIT_STATE["lowered"]
            split[dtype, order] = ts.compile_programs(ts.build(name, dtype, steps), "reference")
            if SPLIT_STATE["lowered"] == before:
                raise RuntimeError(f"{name} {dtype}: the {order} references were never lowered")

    out = {}
    for dtype, problem in problems.items():
        base = runs[dtype, "reference"]
        out[dtype] = {order: differences(problem, split[dtype, order], base) for order in SPLITS}
        out[dtype]["cpu_kernels"] = differences(problem, compiled[dtype, "kernels"], base)
    f32 = problems["float32"]
    out["bfloat16"]["bf16_vs_f32"] = differences(f32, compiled["bfloat16", "reference"], runs["float32", "reference"])
    out["bfloat16"]["excess_precision"] = differences(
        problems["bfloat16"], compiled["bfloat16", "kernels"], emulated_run
    )
    return out


def floors(models: dict) -> dict:
    """``floors[dtype][model][quantity]``: the largest value over :data:`FLOOR_OF`."""
    out = {}
    for model, by_dtype in models.items():
        for dtype, comparisons in by_dtype.items():
            row = {}
            for q in QUANTITIES:
                values = [comparisons[c][q] for c in FLOOR_OF if q in comparisons[c]]
                if values:  # NaN, the check's failure, wins
                    row[q] = math.nan if any(math.isnan(v) for v in values) else max(values)
            out.setdefault(dtype, {})[model] = row
    return out


def child_main(model: str, steps: int) -> int:
    t0 = time.perf_counter()
    result = measure_model(model, steps, log=lambda line: print(line, file=sys.stderr, flush=True))
    payload = {"model": model, "results": result, "seconds": round(time.perf_counter() - t0, 1)}
    print(RESULT_MARKER + json.dumps(payload), flush=True)
    return 0


def run_model(model: str, steps: int, timeout: float) -> dict:
    """:func:`measure_model` in a fresh Python (the split lowering stays installed) on the
    CPU, in :func:`training_steps.child_environment` (the GPU test's XLA flags)."""
    env = dict(ts.child_environment(), JAX_PLATFORMS="cpu")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model, "--steps", str(steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ts.REPO_ROOT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    raise RuntimeError(f"{model}: the child printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


# ---------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------


def default_json_path() -> Path:
    date = datetime.date.today().isoformat()
    return _BENCH / "results" / f"training_noise-cpu-{os.cpu_count()}cores-{date}.json"


def table(report: dict) -> str:
    """One line per model, dtype and comparison: the quantities, 3 significant digits."""
    lines = [f"{'model':<11}{'dtype':<10}{'comparison':<18}" + "".join(f"{q:>19}" for q in QUANTITIES)]
    for model, by_dtype in report["models"].items():
        for dtype, comparisons in by_dtype.items():
            for name, numbers in comparisons.items():
                cells = "".join(f"{numbers[q]:>19.3g}" if q in numbers else f"{'-':>19}" for q in QUANTITIES)
                lines.append(f"{model:<11}{dtype:<10}{name:<18}{cells}")
    return "\n".join(lines)


def main(argv=None) -> dict | int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=ts.MODELS, default=list(ts.MODELS))
    p.add_argument("--steps", type=int, default=ts.STEPS)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per model")
    p.add_argument("--child", choices=ts.MODELS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(args.child, args.steps)
    report = {
        "device": "cpu",
        "cpus": os.cpu_count(),
        "commit": git_commit(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "jax": jax.__version__,
        "xla_flags": ts.child_environment()["XLA_FLAGS"],
        "steps": args.steps,
        "floor_of": list(FLOOR_OF),
        "models": {},
        "seconds": {},
    }
    path = args.json or default_json_path()
    for model in args.models:
        result = run_model(model, args.steps, args.timeout)
        report["models"][model] = result["results"]
        report["seconds"][model] = result["seconds"]
        report["floors"] = floors(report["models"])
        write_json(path, report)
        print(f"{model}: {result['seconds']} s", flush=True)
    print(table(report))
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    out = main()
    sys.exit(out if isinstance(out, int) else 0)
