"""End-to-end training step, block-sparse against dense, in one process.

Two models, each trained with a full step (forward, backward, ``optax.adam`` update),
jitted with the training state donated:

- ``mlp``: ``--mlp-layers`` square layers of width ``--mlp-hidden`` (ReLU between
  them, mean-squared error against a fixed random target), batch ``--mlp-batch``.
  Dense: ``flax.linen.Dense``. Sparse: ``jbs.nn.BlockSparseDense`` with the same
  widths, every layer a random layout (``jbs.layouts.random``) at the row's density.
- ``lstm``: one LSTM layer of hidden size ``--lstm-hidden`` over ``--lstm-steps``
  timesteps, batch ``--lstm-batch``, input width ``--lstm-input`` (default: the hidden
  size), mean-squared error of the outputs [B, T, H] against a fixed random target.
  Sparse: the fused ``jbs.nn.BlockSparseLSTM`` with a random per-gate recurrent layout
  ([H/bs, 4H/bs]) and a random block-sparse input projection ([D/bs, 4H/bs]), both at
  the row's density, without layer norm and internal steps (so the cell's math is
  ``flax.linen.LSTMCell``'s). Dense (:class:`DenseLSTM`): the same math and the same
  algorithm with dense ``jnp.matmul`` products: one input projection over all T steps,
  one [B, H] x [H, 4H] product per step, and the fused layer's backward pass (a
  reverse scan for the activations, then one weight-gradient product over all T*B
  rows). That is the strongest dense LSTM with this cell: plain autodiff of a scan
  (``nn.RNN``) makes one small weight-gradient product per step (T in all), which
  could only make dense slower and the speedups larger.

Both compute in ``--dtype`` (default bfloat16) with float32 master parameters and
float32 Adam state; the elementwise LSTM math and its cell state stay float32. Both
models of a row start from parameters drawn on the host (:func:`host_params`: normal,
variance 1 / fan-in, zero biases), not from the layers' initializers, whose compilation
would double a CPU run's time; the step's cost does not depend on the values.

Timing: each jitted step (state donated) is compiled and run ``--warmup`` times,
then ``--steps`` samples are timed, each ``--group`` consecutive steps dispatched as a
training loop does and timed to ``jax.block_until_ready`` of the last new state and loss,
per step; the median is reported (``step_ms`` keeps them all). A training step is
milliseconds of device work, far above its host dispatch cost, so this is device
time on a GPU. The model's dense step stays compiled for the whole model's rows, and
every (block, density) row alternates its samples with dense samples, so both medians
come from the same stretch of time (a shared CPU's load, a GPU's clocks). A group of
steps, not one: on a CPU a dense step's 13 ms evict a short step's working set from the
caches, so a sparse step timed right after a dense one ran cold, as in no training loop
(``--group 1`` times single steps):

    speedup = dense ms/step / sparse ms/step      (dense: its steps timed beside the row's)

The dense row itself reports its own steps, timed before the sparse rows.
Density 1.0 rows are the block-sparse kernels at full density: their speedup is the
kernels' efficiency against the dense library for the whole step.

The JSON (``--json``; default ``bench/results/train_step-<device>-<date>.json``) holds
the device, commit (``JBS_COMMIT`` or ``git rev-parse --short HEAD``), date, jax
version, bsmm implementation path, the sizes, the baselines and one row per model and
configuration (dense rows have ``kind: "dense"``). It is rewritten after every row;
``complete`` is false when ``--deadline`` stopped the run early.

Usage::

    python bench/train_step.py                      # preset by device: full on a GPU, quick on CPU
    python bench/train_step.py --preset full --json bench/results/train_step-h100.json
    python bench/train_step.py --preset quick --models mlp --block-sizes 32 --densities 1 0.1
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # --deadline counts from here

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_blocksparse as jbs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _report import git_commit, write_json  # noqa: E402

from jax_blocksparse.ops import paths

MODELS = ("mlp", "lstm")

PRESETS = {
    # The sizes of the GPU measurement: MLP 4 x 8192, batch 8192; LSTM 4096, T = 64.
    "full": dict(
        mlp_hidden=8192,
        mlp_layers=4,
        mlp_batch=8192,
        lstm_hidden=4096,
        lstm_input=None,
        lstm_steps=64,
        lstm_batch=64,
        block_sizes=[32, 64, 128],
        densities=[1.0, 0.25, 0.1, 0.05],
        steps=10,
        warmup=2,
    ),
    # About 35 s of CPU time on a 2-core CPU (26 rows), most of it compiling.
    "quick": dict(
        mlp_hidden=512,
        mlp_layers=4,
        mlp_batch=256,
        lstm_hidden=512,
        lstm_input=None,
        lstm_steps=8,
        lstm_batch=32,
        block_sizes=[32, 64, 128],
        densities=[1.0, 0.25, 0.1, 0.05],
        steps=7,
        warmup=2,
    ),
}

DTYPES = ("bfloat16", "float16", "float32")

BASELINES = {
    "mlp": "flax.linen.Dense layers of the same widths (same dtype, float32 params, same Adam)",
    "lstm": (
        "DenseLSTM: the same cell math (flax LSTMCell, gates i,f,g,o, float32 state) with dense "
        "jnp.matmul products: one input projection over all T steps, one [B,H]x[H,4H] product per "
        "step, and the fused layer's backward pass (one weight-gradient product over all T*B rows)"
    ),
}

SPARSE = {
    "mlp": "jbs.nn.BlockSparseDense layers, each a random layout (jbs.layouts.random) at the row's density",
    "lstm": (
        "jbs.nn.BlockSparseLSTM (fused) of a BlockSparseLSTMCell with layer_norm=False, internal_steps=0: "
        "random per-gate recurrent layout [H/bs, 4H/bs] and random block-sparse input projection "
        "[D/bs, 4H/bs], both at the row's density"
    ),
}

_F32 = jnp.float32


# ---------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------


class MLP(nn.Module):
    """``layers`` square layers of ``hidden`` features, ReLU between them.

    ``masks`` None: ``flax.linen.Dense``; else one bool [hidden/bs, hidden/bs] mask per
    layer and ``jbs.nn.BlockSparseDense``. Inputs [B, hidden] -> outputs [B, hidden] in ``dtype``.
    """

    hidden: int
    layers: int
    dtype: object
    masks: tuple | None = None
    block_size: int | None = None

    @nn.compact
    def __call__(self, x):
        for i in range(self.layers):
            if self.masks is None:
                x = nn.Dense(self.hidden, dtype=self.dtype, param_dtype=_F32, name=f"layer{i}")(x)
            else:
                x = jbs.nn.BlockSparseDense(
                    self.hidden, self.masks[i], self.block_size, dtype=self.dtype, param_dtype=_F32, name=f"layer{i}"
                )(x)
            if i + 1 < self.layers:
                x = nn.relu(x)
        return x


def _gates(z, xg, c):
    """flax LSTMCell's update from the recurrent product z [B, 4H] and the input part xg
    [B, 4H] (gate order i, f, g, o), in float32: (c', h')."""
    g = z.astype(_F32) + xg.astype(_F32)
    i, f, u, o = jnp.split(g, 4, axis=-1)
    new_c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(u)
    return new_c, jax.nn.sigmoid(o) * jnp.tanh(new_c)


@jax.custom_vjp
def _dense_recurrence(w, xg, c0, h0):
    """The recurrence of :class:`DenseLSTM`: w [H, 4H] (compute dtype), xg [T, B, 4H],
    c0/h0 [B, H] float32 -> hs [T, B, H] float32."""
    return _dense_scan(w, xg, c0, h0, save=False)


def _dense_scan(w, xg, c0, h0, save):
    def body(carry, xg_t):
        c, h = carry
        r = h.astype(w.dtype)
        z = jnp.matmul(r, w)
        new_c, new_h = _gates(z, xg_t, c)
        return (new_c, new_h), ((new_h, r, z, c) if save else new_h)

    return jax.lax.scan(body, (c0, h0), xg)[1]


def _dense_recurrence_fwd(w, xg, c0, h0):
    hs, rs, zs, c_prev = _dense_scan(w, xg, c0, h0, save=True)
    return hs, (w, xg, rs, zs, c_prev)


def _dense_recurrence_bwd(res, ct_hs):
    # As the fused block-sparse layer: the reverse scan computes only activation
    # cotangents; the weight gradient is one product over all T*B rows afterwards.
    w, xg, rs, zs, c_prev = res

    def body(carry, xs):
        dc, dh = carry
        ct_h, xg_t, z_t, c_t = xs
        _, vjp = jax.vjp(_gates, z_t, xg_t, c_t)
        dz, dxg, dc = vjp((dc, dh + ct_h))
        return (dc, jnp.matmul(dz, w.T).astype(_F32)), (dz, dxg)

    zero = jnp.zeros(ct_hs.shape[1:], _F32)
    (dc0, dh0), (dzs, dxg) = jax.lax.scan(body, (zero, zero), (ct_hs, xg, zs, c_prev), reverse=True)
    dw = jnp.einsum("tbi,tbo->io", rs, dzs, preferred_element_type=_F32).astype(w.dtype)
    return dw, dxg, dc0, dh0


_dense_recurrence.defvjp(_dense_recurrence_fwd, _dense_recurrence_bwd)


class DenseLSTM(nn.Module):
    """The dense counterpart of the fused ``jbs.nn.BlockSparseLSTM`` (no layer norm, no
    internal steps): inputs [B, T, D] -> outputs [B, T, H] float32.

    Parameters (float32): ``input_kernel`` [D, 4H], ``recurrent_kernel`` [H, 4H] (both
    LeCun normal), ``bias`` [4H] (zeros). Products run in ``dtype`` with float32
    accumulation; the state starts at zero.
    """

    hidden: int
    dtype: object

    @nn.compact
    def __call__(self, x):
        h = self.hidden
        d = x.shape[-1]
        w_in = self.param("input_kernel", nn.initializers.lecun_normal(), (d, 4 * h), _F32)
        w_h = self.param("recurrent_kernel", nn.initializers.lecun_normal(), (h, 4 * h), _F32)
        bias = self.param("bias", nn.initializers.zeros_init(), (4 * h,), _F32)
        xs = jnp.moveaxis(x, -2, 0).astype(self.dtype)  # [T, B, D]
        p = jnp.matmul(xs, w_in.astype(self.dtype), preferred_element_type=_F32)
        xg = (p + bias).astype(self.dtype)
        zero = jnp.zeros(xs.shape[1:-1] + (h,), _F32)
        hs = _dense_recurrence(w_h.astype(self.dtype), xg, zero, zero)
        return jnp.moveaxis(hs, 0, -2)


def sparse_lstm(hidden, in_features, block_size, density, dtype, seed):
    """The fused block-sparse LSTM of a row: random recurrent and input layouts at ``density``."""
    hb, db = hidden // block_size, in_features // block_size
    cell = jbs.nn.BlockSparseLSTMCell(
        hidden,
        jbs.layouts.random((hb, 4 * hb), density, seed=seed),
        block_size,
        input_mask=jbs.layouts.random((db, 4 * hb), density, seed=seed + 1),
        layer_norm=False,
        internal_steps=0,
        dtype=dtype,
        param_dtype=_F32,
    )
    return jbs.nn.BlockSparseLSTM(cell)


# ---------------------------------------------------------------------------------
# The training step and its timing
# ---------------------------------------------------------------------------------


def make_problem(model_name, args, dtype):
    """(inputs, target) of a model, fixed for the whole run: inputs in ``dtype``, target float32."""
    kx, ky = jax.random.split(jax.random.key(args.seed + (0 if model_name == "mlp" else 1)))
    if model_name == "mlp":
        shape_x = shape_y = (args.mlp_batch, args.mlp_hidden)
    else:
        shape_x = (args.lstm_batch, args.lstm_steps, args.lstm_input)
        shape_y = (args.lstm_batch, args.lstm_steps, args.lstm_hidden)
    return jax.random.normal(kx, shape_x, dtype), 0.5 * jax.random.normal(ky, shape_y, _F32)


def build_model(model_name, args, dtype, block_size=None, density=None):
    """The flax module of a row: dense when ``block_size`` is None."""
    if model_name == "mlp":
        if block_size is None:
            return MLP(args.mlp_hidden, args.mlp_layers, dtype)
        grid = (args.mlp_hidden // block_size,) * 2
        masks = tuple(jbs.layouts.random(grid, density, seed=args.seed + i) for i in range(args.mlp_layers))
        return MLP(args.mlp_hidden, args.mlp_layers, dtype, masks, block_size)
    if block_size is None:
        return DenseLSTM(args.lstm_hidden, dtype)
    return sparse_lstm(args.lstm_hidden, args.lstm_input, block_size, density, dtype, args.seed)


def make_step(model, optimizer):
    """The jitted training step ``(params, opt_state), x, y -> ((params, opt_state), loss)``,
    the state donated."""

    def loss_fn(params, x, y):
        out = model.apply({"params": params}, x)
        return jnp.mean(jnp.square(out.astype(_F32) - y))

    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=(0,))


def host_params(model, x, out_features: int, seed: int):
    """Parameters of ``model`` for inputs like ``x``, drawn on the host: every kernel normal
    with variance 1 / fan-in, every vector (bias) zero; float32 device arrays.

    The fan-in of a kernel leaf is its size / ``out_features`` (the model's output width
    per kernel: ``hidden`` for the MLP, ``4 * hidden`` for the LSTM's gates): C for a
    dense [C, K] kernel and the average number of present inputs per output feature
    (density * C) for a block-sparse [nnz, bs, bs] one, as the layers' own default
    initializers give it. Drawing on the host costs no compilation; the layers' own
    (truncated-normal) initializers compile one sampler per row, which on a CPU takes as
    long as compiling the training step.
    """
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    rng = np.random.default_rng(seed)

    def draw(leaf):
        if len(leaf.shape) < 2:
            return jnp.zeros(leaf.shape, leaf.dtype)
        scale = np.float32(1.0 / np.sqrt(max(1.0, leaf.size / out_features)))
        return jnp.asarray(rng.standard_normal(leaf.shape, dtype=np.float32) * scale, leaf.dtype)

    return jax.tree.map(draw, shapes)


class Trainer:
    """One model's training: parameters (:func:`host_params`), Adam state, the compiled
    step (state donated) and its fixed batch.

    Construction compiles the step and runs it once (``first_loss``); :meth:`run` takes
    untimed steps, :meth:`timed_steps` consecutive steps timed to ``block_until_ready``.
    """

    def __init__(self, model, x, y, *, out_features: int, learning_rate: float, seed: int):
        params = host_params(model, x, out_features, seed)
        optimizer = optax.adam(learning_rate)
        self.state = (params, optimizer.init(params))
        self.params = int(sum(p.size for p in jax.tree.leaves(params)))
        del params  # the state holds them; donation invalidates this reference anyway
        self.x, self.y = x, y
        t0 = time.perf_counter()
        self.step = make_step(model, optimizer).lower(self.state, x, y).compile()
        self.compile_s = time.perf_counter() - t0
        self.loss = None
        self.run(1)
        self.first_loss = float(self.loss)

    def run(self, n: int):
        """``n`` untimed steps, then a block."""
        for _ in range(n):
            self.state, self.loss = self.step(self.state, self.x, self.y)
        jax.block_until_ready((self.state, self.loss))

    def timed_steps(self, n: int) -> float:
        """Seconds per step of ``n`` consecutive steps, from the first dispatch to
        ``block_until_ready`` of the last new state and loss."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.state, self.loss = self.step(self.state, self.x, self.y)
        jax.block_until_ready((self.state, self.loss))
        return (time.perf_counter() - t0) / n

    def summary(self, times) -> dict:
        """The row fields of this model from its timed steps' seconds."""
        return dict(
            ms_per_step=1e3 * float(np.median(times)),
            step_ms=[1e3 * t for t in times],
            compile_s=self.compile_s,
            first_loss=self.first_loss,
            last_loss=float(self.loss),
            params=self.params,
        )


# ---------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------


def device_name(device) -> str:
    """A file-name friendly device name: ``cpu-<n>cores`` or the GPU's kind (``nvidia-h100-80gb-hbm3``)."""
    if device.platform == "cpu":
        return f"cpu-{os.cpu_count()}cores"
    kind = getattr(device, "device_kind", device.platform).lower()
    return "".join(ch if ch.isalnum() else "-" for ch in kind).strip("-") or device.platform


def bsmm_path(device) -> str:
    """jax_blocksparse's own description of the bsmm path on ``device``."""
    return paths.describe_path(device.platform)


def on_kernels(device) -> bool:
    """Whether all three bsmm ops lower to the native kernels on ``device`` (not the reference)."""
    try:
        return paths.kernels_selected(device.platform)
    except RuntimeError:  # kernels demanded but not built: the step would fail to lower
        return False


def _sizes(args) -> dict:
    return dict(
        mlp=dict(hidden=args.mlp_hidden, layers=args.mlp_layers, batch=args.mlp_batch),
        lstm=dict(hidden=args.lstm_hidden, input=args.lstm_input, steps=args.lstm_steps, batch=args.lstm_batch),
    )


def header(args, device) -> dict:
    now = datetime.datetime.now(datetime.UTC)
    return dict(
        benchmark="train_step",
        device=str(device),
        device_kind=getattr(device, "device_kind", device.platform),
        platform=device.platform,
        device_name=device_name(device),
        host=platform.node(),
        cpu_count=os.cpu_count(),
        commit=git_commit(),
        date=now.date().isoformat(),
        datetime=now.isoformat(timespec="seconds"),
        jax_version=jax.__version__,
        jax_blocksparse_version=jbs.__version__,
        flax_version=_version("flax"),
        optax_version=optax.__version__,
        python=sys.version.split()[0],
        implementation=jbs.config.get_implementation(),
        implementation_path=bsmm_path(device),
        on_kernels=on_kernels(device),
        preset=args.preset,
        dtype=args.dtype,
        param_dtype="float32",
        optimizer=f"optax.adam({args.learning_rate})",
        models=args.models,
        sizes=_sizes(args),
        block_sizes=args.block_sizes,
        densities=args.densities,
        seed=args.seed,
        baselines={m: BASELINES[m] for m in args.models},
        sparse_models={m: SPARSE[m] for m in args.models},
        init="host_params: kernels normal with variance 1 / fan-in (size / output width), biases zero",
        timing=dict(
            steps=args.steps,
            group=args.group,
            warmup=args.warmup,
            statistic="median",
            method="jax.jit(step, donate_argnums=0), compiled once; each sample `group` consecutive steps "
            "blocked on the last (new state, loss) with jax.block_until_ready, per step; warmup steps not timed",
        ),
    )


def _version(module) -> str | None:
    try:
        return __import__(module).__version__
    except (ImportError, AttributeError):
        return None


TABLE_HEADER = (
    f"{'model':5} {'kind':6} {'block':>5} {'density':>8} {'ms/step':>10} {'dense ms/step':>13} "
    f"{'speedup':>8} {'loss first->last':>22}"
)


def table_line(row) -> str:
    block = "-" if row["block"] is None else str(row["block"])
    return (
        f"{row['model']:5} {row['kind']:6} {block:>5} {row['density']:>8.3f} {row['ms_per_step']:>10.3f} "
        f"{row['dense_ms_per_step']:>13.3f} {row['speedup']:>7.2f}x "
        f"{row['first_loss']:>10.4g} ->{row['last_loss']:>10.4g}"
    )


def run(args) -> dict:
    """Times every model's dense step and each (block, density) sparse step; returns the report."""
    device = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    report = header(args, device)
    report.update(rows=[], complete=False, stopped=None)
    print(
        f"train step, {device.platform} ({report['device_kind']}), {args.dtype} compute, preset "
        f"{args.preset}; bsmm path: {report['implementation_path']}"
    )
    if not report["on_kernels"]:
        print(
            "  note: the block-sparse rows run bsmm's pure-JAX reference lowering, not the native kernels "
            "(JAX_BLOCKSPARSE_IMPL=kernels selects kernels not yet verified on this hardware)"
        )
    for m in args.models:
        print(f"  {m} {report['sizes'][m]}: dense = {BASELINES[m]}")
    print(TABLE_HEADER)
    print("-" * len(TABLE_HEADER), flush=True)
    setup = dict(learning_rate=args.learning_rate, seed=args.seed)
    for model_name in args.models:
        x, y = make_problem(model_name, args, dtype)
        out_features = args.mlp_hidden if model_name == "mlp" else 4 * args.lstm_hidden
        dense = Trainer(build_model(model_name, args, dtype), x, y, out_features=out_features, **setup)
        dense.run(args.warmup - 1)
        dense_times = [dense.timed_steps(args.group) for _ in range(args.steps)]
        dense_row = dense.summary(dense_times)
        _add_row(
            report,
            args,
            dict(
                model=model_name,
                kind="dense",
                block=None,
                density=1.0,
                requested_density=1.0,
                **dense_row,
                dense_ms_per_step=dense_row["ms_per_step"],
                speedup=1.0,
            ),
        )
        for bs in args.block_sizes:
            for density in args.densities:
                if args.deadline is not None and time.perf_counter() - _T_START > args.deadline:
                    report["stopped"] = (
                        f"deadline of {args.deadline} s reached before {model_name} block={bs} density={density}"
                    )
                    break
                model = build_model(model_name, args, dtype, bs, density)
                sparse = Trainer(model, x, y, out_features=out_features, **setup)
                sparse.run(args.warmup - 1)
                dense.run(1)
                # Alternate dense and sparse steps: both see the same machine (a shared CPU's
                # load, a GPU's clocks), so their ratio holds even when the load drifts.
                times = {"dense": [], "sparse": []}
                for _ in range(args.steps):
                    times["dense"].append(dense.timed_steps(args.group))
                    times["sparse"].append(sparse.timed_steps(args.group))
                row = sparse.summary(times["sparse"])
                dense_ms = 1e3 * float(np.median(times["dense"]))
                _add_row(
                    report,
                    args,
                    dict(
                        model=model_name,
                        kind="sparse",
                        block=bs,
                        density=_model_density(model),
                        requested_density=density,
                        **row,
                        dense_ms_per_step=dense_ms,
                        dense_step_ms=[1e3 * t for t in times["dense"]],
                        speedup=dense_ms / row["ms_per_step"],
                    ),
                )
                del sparse
            if report["stopped"]:
                break
        del dense
        if report["stopped"]:
            break
    report["complete"] = report["stopped"] is None
    report["elapsed_s"] = time.perf_counter() - _T_START
    if report["stopped"]:
        print(f"stopped early: {report['stopped']}", flush=True)
    return report


def _add_row(report, args, row):
    report["rows"].append(row)
    print(table_line(row), flush=True)
    if args.json:
        write_json(args.json, report)


def _model_density(model) -> float:
    """The stored fraction of the model's block-sparse weights (all its layouts together)."""
    if isinstance(model, MLP):
        masks = [np.asarray(m) for m in model.masks]
    else:
        cfg = model.cell.config
        masks = [np.asarray(cfg.gate_mask.array), np.asarray(cfg.input_mask.array)]
    return float(sum(m.sum() for m in masks) / sum(m.size for m in masks))


# ---------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------


def _positive(name, value):
    if value is None or isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_args(args):
    """Raises ValueError naming the argument when sizes, blocks or densities do not fit."""
    for name in (
        "mlp_hidden",
        "mlp_layers",
        "mlp_batch",
        "lstm_hidden",
        "lstm_input",
        "lstm_steps",
        "lstm_batch",
        "steps",
        "group",
    ):
        _positive(f"--{name.replace('_', '-')}", getattr(args, name))
    if args.warmup < 1:
        raise ValueError(f"--warmup must be >= 1 (the first call compiles and runs), got {args.warmup}")
    if not args.models:
        raise ValueError("--models must name at least one of " + ", ".join(MODELS))
    for d in args.densities:
        if not 0.0 < d <= 1.0:
            raise ValueError(f"--densities must lie in (0, 1], got {d}")
    for bs in args.block_sizes:
        if bs not in jbs.SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"--block-sizes must be among {', '.join(map(str, jbs.SUPPORTED_BLOCK_SIZES))}, got {bs}")
        widths = {
            "mlp": [("--mlp-hidden", args.mlp_hidden)],
            "lstm": [("--lstm-hidden", args.lstm_hidden), ("--lstm-input", args.lstm_input)],
        }
        for m in args.models:
            for name, width in widths[m]:
                if width % bs:
                    raise ValueError(
                        f"{name} ({width}) must be a multiple of every block size; {width} % {bs} = {width % bs}"
                    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="sizes; default 'full' on a GPU, else 'quick'"
    )
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--mlp-hidden", type=int)
    p.add_argument("--mlp-layers", type=int)
    p.add_argument("--mlp-batch", type=int)
    p.add_argument("--lstm-hidden", type=int)
    p.add_argument("--lstm-input", type=int, help="input features D; default the hidden size")
    p.add_argument("--lstm-steps", type=int, help="sequence length T")
    p.add_argument("--lstm-batch", type=int)
    p.add_argument("--block-sizes", type=int, nargs="+")
    p.add_argument("--densities", type=float, nargs="+")
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16", help="compute dtype (params stay float32)")
    p.add_argument("--steps", type=int, help="timed samples (the median is reported)")
    p.add_argument("--group", type=int, default=5, help="consecutive steps per timed sample, per step")
    p.add_argument("--warmup", type=int, help="untimed steps after compiling, the first included")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="start no new row after this many seconds from the start of the process",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="write the results here (default bench/results/train_step-<device>-<date>.json)",
    )
    p.add_argument("--no-json", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    args.preset = args.preset or ("full" if device.platform == "gpu" else "quick")
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.lstm_input is None:
        args.lstm_input = args.lstm_hidden
    try:
        check_args(args)
    except ValueError as err:
        p.error(str(err))
    if args.no_json:
        args.json = None
    elif args.json is None:
        date = datetime.datetime.now(datetime.UTC).date().isoformat()
        args.json = Path(__file__).resolve().parent / "results" / f"train_step-{device_name(device)}-{date}.json"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
