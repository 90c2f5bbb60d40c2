"""Benchmark bsmm (fprop, bprop, updat) against the dense product on the same device.

For each (op, dtype, block size, density) it times the block-sparse product on every
kernel path the device has and the dense product of the same shapes, in the same
process, and reports

    efficiency = dense_time * density / sparse_time      (1.0: blocks at dense speed)
    speedup    = dense_time / sparse_time                (= efficiency / density)
    bound      = best speedup a perfect kernel could reach on this device (roofline,
                 from this run's own ceilings: the dense product's measured rate
                 and the memory bandwidth measured at the start of the run)

Kernel paths (one JSON row per path): on CUDA "ampere" (the portable targets
``jbs_bsmm_{fprop,bprop,updat}``) and, on an sm_90 GPU with an extension built for
sm_90a, "hopper" (``jbs_bsmm_*_sm90``); on CPU "native" (the CPU kernels). The Hopper
gate, ``JAX_BLOCKSPARSE_HOPPER=1``, is read when a call is lowered and jit's caches do
not know about it, so each path has its own function objects, lowered and compiled
ahead of time with the gate set as that path needs it (bench/_kernel_paths.py); the
compiled executable is what is timed, and its HLO text says which FFI target ran
(``target``) and, for float32 on the Hopper targets, whether on TF32 (``mode``).

What is timed is what users write: ``f(x, w, layout)`` with the layout passed as an
argument straight from ``jbs.Layout.from_mask`` (never device_put here, never closed
over). Two times per product:

- device time (``sparse_s``, ``dense_s``, ``dense_path_s``; efficiency and speedup use
  the first two): one function applies the op ``--chain`` times in a data-dependent
  chain (each output is the next input; for updat, whose output has another shape,
  one element of it is written into the next input), so XLA can neither hoist nor
  merge the products. Calls of it are dispatched back to back and the median per-call
  time is divided by the chain length. A call's host work (dispatch, argument
  flattening) is then well below its device time, so this is device time, not host
  time (single calls back to back measure host time wherever that is longer).
- call time (``sparse_call_s``, ``dense_call_s``): back-to-back calls of the single op,
  per call: what a user's loop sees; host time wherever that exceeds device time.

``dense_s`` is XLA's dot (``jnp.dot``, cuBLAS on a GPU) on a ready dense weight;
``dense_path_s`` is the same op through ``impl="dense"`` (the present blocks scattered
into a dense weight, then XLA's dot), None where the installed package has no such
implementation. ``bench/crossover.py`` turns the rows into the crossover table of
``impl="auto"``.

Peers, on a GPU and where importable, on the same problem in the same run (timed once
per problem, shared by the paths' rows): ``torch_bsr``, torch's BSR kernels (Triton
``bsr_dense_mm`` for fprop and bprop, ``sampled_addmm`` for updat), device time from a
CUDA graph of ``--chain`` calls (``torch_bsr_method`` says which way it was measured),
and ``jax_bcoo``, ``jax.experimental.sparse`` BCOO (element-sparse, fprop only; slow:
it is not in the ``check`` preset).

On CPU an extra column times the pure-JAX reference lowering of the same op.

The JSON (``--json``) holds the device, commit, date, the timing method and one row per
(product, path); it is rewritten (atomically: a temporary file, then a rename) after
every row, so a run cut short, even killed, still leaves every finished row
(``complete`` is false then). ``--deadline`` stops starting new products after that
many seconds; ``--resume`` keeps the rows already in ``--json`` and measures only the
products missing there (bench/session.py runs a GPU session that way, one process per
block size). A product that raises gets a row with ``error`` (and the exit status is
1); an error that leaves the CUDA context unusable (a kernel fault) ends the run there
(``stopped`` says why).

Usage::

    python bench/bsmm.py                       # preset chosen by the device: cpu or gpu
    python bench/bsmm.py --preset check --json out/bench.json     # tests/gpu/check.sh's run
    python bench/bsmm.py --preset cpu --json bench/results/cpu.json
    python bench/bsmm.py --ops fprop --block-sizes 32 64 --densities 1 0.1 --dtypes bfloat16
"""

from __future__ import annotations

import time

_T_START = time.perf_counter()  # --deadline counts from here: imports and device start-up included

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_blocksparse as jbs
from jax_blocksparse.ops import paths

# The bench's parts beside it (bench/ is not a package): _timing (how a product is timed,
# its roofline), _kernel_paths (which kernel a path ran), _peers (torch, BCOO),
# _bsmm_report (the rows, the table, the JSON header), _report (what every bench shares).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bsmm_report import (  # noqa: E402
    HEADER,
    add_ratios,
    json_header,
    line,
    product_key,
    resumed_faults,
    resumed_rows,
)
from _kernel_paths import arithmetic_mode, compile_checked, context_lost, kernel_paths, path_of  # noqa: E402
from _peers import PEERS, jax_bcoo_peer, torch_bsr_peer  # noqa: E402
from _report import write_json  # noqa: E402
from _timing import chained, measure_bandwidth, roofline, time_calls, time_chain  # noqa: E402

OPS = ("fprop", "bprop", "updat")

PRESETS = {
    # One CPU measurement: 4096 x 4096 weight, block 32, N = 256, float32.
    "cpu": dict(
        size=(4096, 4096, 256),
        block_sizes=[32],
        densities=[1.0, 0.5, 0.25, 0.1, 0.05],
        dtypes=["float32"],
        ops=list(OPS),
    ),
    "gpu": dict(
        size=(4096, 4096, 4096),
        block_sizes=list(jbs.SUPPORTED_BLOCK_SIZES),
        densities=[1.0, 0.5, 0.25, 0.1, 0.05, 0.01],
        dtypes=["bfloat16", "float16", "float32"],
        ops=list(OPS),
    ),
    # tests/gpu/check.sh: bf16 first (both paths, 72 rows), then f16 and f32 (TF32 on
    # the Hopper path) until its deadline; torch's BSR beside them.
    "check": dict(
        size=(4096, 4096, 4096),
        block_sizes=[32, 64, 128],
        densities=[1.0, 0.25, 0.1, 0.05],
        dtypes=["bfloat16", "float16", "float32"],
        ops=list(OPS),
        repeats=3,
        min_time=0.01,
        chain=10,
        peers=["torch_bsr"],
    ),
    # The CPU crossovers of "auto" (bench/crossover.py): the native kernels against the dense
    # product at every block size, float32 and bfloat16, at tune's shape: a 1024 x 1024 weight,
    # N = 1024 (the committed AVX2 file of 2026-11-25 was measured at 2048 x 2048, N = 512).
    "crossover-cpu": dict(
        size=(1024, 1024, 1024),
        block_sizes=list(jbs.SUPPORTED_BLOCK_SIZES),
        densities=[1.0, 0.5, 0.25, 0.1, 0.05],
        dtypes=["float32", "bfloat16"],
        ops=list(OPS),
        reference=False,
    ),
    # One block size of a GPU session (bench/session.py runs one process per block size,
    # headline first): bf16 at the MLP's shape, densities in order of value, both kernel
    # paths and XLA's dot; one compiled program per product and path (no call time, no
    # impl="dense" path); torch's BSR only at density 0.1, after every kernel row.
    "session": dict(
        size=(8192, 8192, 8192),
        block_sizes=[128, 64, 32, 16],
        densities=[0.1, 0.05, 0.25, 1.0, 0.01, 0.5],
        dtypes=["bfloat16"],
        ops=list(OPS),
        repeats=3,
        min_time=0.01,
        chain=10,
        peers=["torch_bsr"],
        peer_densities=[0.1],
        call_time=False,
        dense_path=False,
    ),
    # Seconds on a CPU: tests/test_gpu_check.py checks the JSON with it.
    "quick": dict(
        size=(256, 256, 64),
        block_sizes=[32],
        densities=[1.0, 0.25],
        dtypes=["float32"],
        ops=list(OPS),
        repeats=1,
        min_time=0.0,
        chain=2,
        peers=[],
        reference=False,
    ),
}

# Where neither the command line nor the preset sets them. chain None: 10 on a GPU,
# 1 on a CPU (no host-bound regime there: one product takes milliseconds). peer_densities
# None: the peers at every density.
DEFAULTS = dict(
    repeats=5, min_time=0.05, chain=None, peers=list(PEERS), peer_densities=None, call_time=True, dense_path=True
)


# ---------------------------------------------------------------------------------
# Problems
# ---------------------------------------------------------------------------------


def _single_ops(impl=None):
    """op -> (sparse(a, b, layout), dense(a, b)): one product each, as users write them.

    New function objects on every call: jit keys its caches on the function, so two
    paths (or implementations) never share a trace or an executable. ``impl`` is passed
    to the ops where given (else the configured default applies)."""
    kw = {} if impl is None else dict(impl=impl)
    return {
        "fprop": (lambda x, w, layout: jbs.bsmm(x, w, layout, **kw), lambda x, W: jnp.dot(x, W)),
        "bprop": (lambda g, w, layout: jbs.bsmm(g, w, layout, transpose=True, **kw), lambda g, W: jnp.dot(g, W.T)),
        "updat": (lambda x, g, layout: jbs.bsmm_updat(x, g, layout, **kw), lambda x, g: jnp.dot(x.T, g)),
    }


class Jitted:
    """The jitted functions of one path (or implementation), made once, from function
    objects of its own: ``single[op]`` and ``chains[op]`` are (sparse, dense) pairs."""

    def __init__(self, chain: int, impl=None):
        self.chain = chain
        self.single = {}
        self.chains = {}
        for op, (sparse, dense) in _single_ops(impl).items():
            self.single[op] = (jax.jit(sparse), jax.jit(dense))
            self.chains[op] = (jax.jit(chained(sparse, chain)), jax.jit(chained(dense, chain)))


def _operands(c, k, n, dtype, key):
    """Activations (x [N, C], dy [N, K]) and the dense weight, scaled so chains stay O(1)."""
    kx, kg, kw = jax.random.split(key, 3)
    x = jax.random.normal(kx, (n, c), dtype)
    g = jax.random.normal(kg, (n, k), dtype)
    W = (jax.random.normal(kw, (c, k), jnp.float32) / np.sqrt(c)).astype(dtype)
    return x, g, W


def _blocks(layout, dtype, key):
    """Stored blocks, scaled by 1/sqrt(blocks per column * bs) so a chain keeps its scale."""
    c = layout.shape[0]
    fan_in = max(1.0, c * layout.density)
    return (jax.random.normal(key, layout.w_shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)


def _args(op, x, g, W, w, layout):
    """(sparse args, dense args) of op."""
    if op == "fprop":
        return (x, w, layout), (x, W)
    if op == "bprop":
        return (g, w, layout), (g, W)
    return (x, g, layout), (x, g)


# ---------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------


def dense_impl_available() -> bool:
    """Whether the package has ``impl="dense"`` (then ``dense_path_s`` is timed)."""
    return "dense" in jbs.config.IMPLEMENTATIONS


class Bench:
    """One run: the functions of every path made once, the dense times cached per
    (dtype, op), one row per (product, path) appended to ``report``."""

    def __init__(self, args, device):
        self.args = args
        self.device = device
        self.platform = device.platform
        self.device_kind = getattr(device, "device_kind", device.platform)
        self.paths = kernel_paths(device)
        # impl="kernels": a kernel row times the kernel, wherever "auto" would go dense.
        self.kernels = {path: Jitted(args.chain, impl="kernels") for path in self.paths}
        self.dense_impl = Jitted(args.chain, impl="dense") if args.dense_path and dense_impl_available() else None
        self.report = json_header(args, device, self.device_kind, self.paths, dense_path=self.dense_impl is not None)
        # in_flight: the (product, path) being measured, saved before it starts, so that a
        # process killed in a hang or dead in a fault leaves its name (bench/gpu_results.py
        # turns that key off); faults: those an earlier run of a resumed report left.
        self.report.update(results=[], complete=False, stopped=None, in_flight=None, faults=[])
        self.faulted: set[tuple] = set()  # (path, dtype, block size): set by run() from a resumed report
        self.reference = Jitted(1, impl="reference") if args.reference else None
        self.dense_times: dict[tuple, tuple] = {}
        self.timing = dict(repeats=args.repeats, min_time=args.min_time)
        # The memory ceiling of the roofline, measured once per run (the compute ceiling is
        # the dense product's own rate, per dtype and op).
        self.bandwidth = measure_bandwidth(device, nbytes=(1 << 30) if self.platform == "gpu" else (1 << 27))
        self.report["bandwidth_Bps"] = self.bandwidth

    def _dense(self, op, dtype, d_args) -> tuple:
        """(device s, call s or None) of XLA's dot for (dtype, op), measured once per run:
        the dense product's shapes do not depend on the layout."""
        args, timing = self.args, self.timing
        if (dtype, op) not in self.dense_times:
            _, dense1 = self.kernels[self.paths[0]].single[op]
            _, densek = self.kernels[self.paths[0]].chains[op]
            self.dense_times[(dtype, op)] = (
                time_chain(densek, args.chain, *d_args, **timing),
                time_calls(dense1, *d_args, **timing) if args.call_time else None,
            )
        return self.dense_times[(dtype, op)]

    def peers_at(self, density: float) -> bool:
        """Whether the peers are timed at this density (``--peer-densities``)."""
        wanted = self.args.peer_densities
        return wanted is None or any(abs(density - d) < 1e-9 for d in wanted)

    def peers(self, op, dtype, bs, mask, layout, d_args) -> dict:
        """The peers on this product (GPU only): torch's BSR and JAX's BCOO where asked for."""
        args = self.args
        c, k, n = args.size
        out = {}
        if self.platform == "gpu" and "torch_bsr" in args.peers:
            out.update(
                torch_bsr_peer(
                    op,
                    c,
                    k,
                    n,
                    bs,
                    np.asarray(mask),
                    dtype,
                    repeats=args.repeats,
                    min_time=args.min_time,
                    chain=args.chain,
                )
            )
        if self.platform == "gpu" and "jax_bcoo" in args.peers and op == "fprop":
            x, W = d_args
            W_masked = jbs.to_dense(jbs.from_dense(W, layout), layout)
            out["jax_bcoo_s"] = jax_bcoo_peer(x, W_masked, repeats=args.repeats, min_time=args.min_time)
        return out

    def _shared(self, op, dtype, bs, mask, layout, s_args, d_args, *, with_peers: bool) -> dict:
        """What every path's row of this product shares: the dense times, the roofline and
        (``with_peers``) the peers."""
        args, timing = self.args, self.timing
        c, k, n = args.size
        dense_s, dense_call_s = self._dense(op, dtype, d_args)
        out = dict(
            dense_s=dense_s,
            dense_call_s=dense_call_s,
            dense_path_s=None,
            **roofline(op, c, k, n, layout.density, dtype, dense_s=dense_s, bandwidth=self.bandwidth),
        )
        if self.dense_impl is not None:
            sparse_dense, _ = self.dense_impl.chains[op]
            out["dense_path_s"] = time_chain(sparse_dense, args.chain, *s_args, **timing)
        if with_peers:
            out.update(self.peers(op, dtype, bs, mask, layout, d_args))
        if self.reference is not None:
            reference1, _ = self.reference.single[op]
            out["reference_s"] = time_calls(reference1, *s_args, **timing)
        return out

    def _path(self, path, op, dtype, s_args) -> dict:
        """One path's kernel on this product: target, mode and times of what was compiled
        (the single-call time only with ``--call-time``: one more program to compile)."""
        args = self.args
        sparsek, _ = self.kernels[path].chains[op]
        chain_exe, target, lowered = compile_checked(sparsek, s_args, path)
        out = dict(
            path=path_of(target, self.platform, path, lowered),
            requested_path=path,
            target=target,
            mode=arithmetic_mode(dtype, target, lowered, self.platform),
            sparse_s=time_chain(chain_exe, args.chain, *s_args, **self.timing),
            sparse_call_s=None,
        )
        if args.call_time:
            sparse1, _ = self.kernels[path].single[op]
            single_exe, single_target, _ = compile_checked(sparse1, s_args, path)
            out["sparse_call_s"] = time_calls(single_exe, *s_args, **self.timing)
            if single_target != target:
                out["call_target"] = single_target
        return out

    def _save(self, row=None) -> None:
        if row is not None:
            print(line(row), flush=True)
        if self.args.json:
            write_json(self.args.json, self.report)

    def product(
        self, op, dtype, bs, mask, layout, s_args, d_args, *, with_peers: bool = True, requested: float | None = None
    ) -> list[dict]:
        """The rows of one product, one per path, each appended (and saved) as soon as it
        is measured. Returns them; sets ``report["stopped"]`` if the CUDA context died.
        ``requested``: the density asked for (``density`` is the layout's own)."""
        base = dict(
            op=op,
            dtype=dtype,
            block_size=bs,
            density=layout.density,
            requested_density=layout.density if requested is None else requested,
            nnz=layout.nnz,
            size=list(self.args.size),
        )
        rows, shared, shared_error = [], {}, None
        try:
            shared = self._shared(op, dtype, bs, mask, layout, s_args, d_args, with_peers=with_peers)
        except Exception as err:  # noqa: BLE001 - recorded in the rows, the run goes on
            shared_error = err
        for path in self.paths:
            _, _, variant = path.partition(":")
            if variant and not paths.variant_runs(op, variant, dtype, bs):
                continue  # the variant does not run this product (it would time the baseline again)
            if (path, dtype, bs) in self.faulted:
                continue  # it faulted or hung at this block size in the run resumed: not again
            row = dict(base, path=path, target=None, mode=None, sparse_s=None, **shared)
            self.report["in_flight"] = dict(
                op=op, dtype=dtype, bs=bs, density=round(float(base["requested_density"]), 6), path=path
            )
            self._save()
            try:
                if shared_error is not None:
                    raise shared_error
                row.update(self._path(path, op, dtype, s_args))
            except Exception as err:  # noqa: BLE001
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                if err is shared_error:  # the dense timing or the peers failed: not this kernel's fault
                    row["shared_error"] = True
                if context_lost(err):
                    self.report["stopped"] = f"CUDA context lost at {op} {dtype} bs={bs} {path}: {row['error']}"
            self.report["in_flight"] = None  # measured, or an error row says why not
            if any(r["path"] == row["path"] and r.get("target") == row.get("target") for r in rows):
                continue  # the gate could not be closed (a verified sm_90 target): the same kernel twice
            add_ratios(row)
            rows.append(row)
            self.report["results"].append(row)
            self._save(row)
            if self.report["stopped"]:
                break
        return rows

    def add_peers(self, rows, op, dtype, bs, mask, layout, d_args) -> None:
        """The peers of a product whose kernel rows were measured first (``--peer-densities``
        with deferred peers): timed now, written into those rows, saved."""
        try:
            found = self.peers(op, dtype, bs, mask, layout, d_args)
        except Exception as err:  # noqa: BLE001
            found = dict(peer_error=f"{type(err).__name__}: {str(err)[:300]}")
        for row in rows:
            row.update(found)
            add_ratios(row)
            self._save(row)


def run(args) -> dict:
    t_start = _T_START
    c, k, n = args.size
    bench = Bench(args, jax.devices()[0])
    report = bench.report
    kept = resumed_rows(args, bench.device_kind)
    report["results"].extend(kept)
    report["resumed_rows"] = len(kept)
    earlier = resumed_faults(args, bench.device_kind)
    report["faults"] = [f for f in earlier if not f.get("row")]  # the error rows are in the results
    # A path that failed in the run resumed is not tried again at that dtype and block
    # size (a fault would end this run too, a hang would spend its time), so a resumed run
    # measures the other paths.
    bench.faulted = {(f["path"], f["dtype"], f["block_size"]) for f in earlier}
    done = {product_key(r["op"], r["dtype"], r["block_size"], r["requested_density"], r["size"]) for r in kept}
    deferred_peers = bench.platform == "gpu" and args.peer_densities is not None and bool(args.peers)
    print(
        f"paths: {', '.join(bench.paths)}; dense path (impl='dense'): {bench.dense_impl is not None}; "
        f"memory bandwidth {bench.bandwidth / 1e9 if bench.bandwidth else float('nan'):.0f} GB/s"
        + (f"; {len(kept)} rows kept from {args.json}" if kept else "")
    )
    print(HEADER)
    print("-" * len(HEADER), flush=True)
    key = jax.random.key(args.seed)

    def products():
        for dtype in args.dtypes:
            x, g, W = _operands(c, k, n, dtype, jax.random.fold_in(key, 1))
            for bs in args.block_sizes:
                if c % bs or k % bs:
                    print(f"skip bs={bs}: {c}x{k} not divisible")
                    continue
                for density in args.densities:
                    todo = [op for op in args.ops if product_key(op, dtype, bs, density, args.size) not in done]
                    if not todo:
                        continue
                    mask = jbs.layouts.random((c // bs, k // bs), density, seed=args.seed)
                    layout = jbs.Layout.from_mask(mask, bs)
                    w = _blocks(layout, dtype, jax.random.fold_in(key, 2))
                    for op in todo:
                        yield (op, dtype, bs, density, mask, layout, *_args(op, x, g, W, w, layout))

    def out_of_time(what: str) -> bool:
        if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            report["stopped"] = f"deadline of {args.deadline} s reached before {what}"
            return True
        return False

    later = []  # (rows, product) whose peers are timed after every kernel row
    for op, dtype, bs, density, mask, layout, s_args, d_args in products():
        if out_of_time(f"{op} {dtype} bs={bs} density={density}"):
            break
        with_peers = not deferred_peers and bench.peers_at(density)
        rows = bench.product(op, dtype, bs, mask, layout, s_args, d_args, with_peers=with_peers, requested=density)
        if report["stopped"]:
            break
        if deferred_peers and bench.peers_at(density):
            later.append((rows, (op, dtype, bs, mask, layout, d_args)))
    for rows, (op, dtype, bs, mask, layout, d_args) in later:
        if report["stopped"] or out_of_time(f"the peers of {op} {dtype} bs={bs} density={layout.density:.3f}"):
            break
        bench.add_peers(rows, op, dtype, bs, mask, layout, d_args)
    report["complete"] = report["stopped"] is None
    report["elapsed_s"] = time.perf_counter() - t_start
    if report["stopped"]:
        print(f"stopped early: {report['stopped']}", flush=True)
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default=None, help="parameter set; default 'gpu' on a GPU, else 'cpu'"
    )
    p.add_argument("--size", type=int, nargs=3, metavar=("C", "K", "N"))
    p.add_argument("--block-sizes", type=int, nargs="+")
    p.add_argument("--densities", type=float, nargs="+")
    p.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--ops", nargs="+", choices=list(OPS))
    p.add_argument("--repeats", type=int, help="samples per time (the median is kept); default 5")
    p.add_argument("--min-time", type=float, help="seconds of back-to-back calls per sample; default 0.05")
    p.add_argument("--chain", type=int, help="ops per jitted call for the device time; default 10 on a GPU, 1 on CPU")
    p.add_argument("--peers", nargs="*", choices=list(PEERS), help="peers to time beside (GPU only); default all")
    p.add_argument("--no-peers", dest="peers", action="store_const", const=[], help="no peers")
    p.add_argument(
        "--peer-densities",
        type=float,
        nargs="+",
        help="time the peers only at these densities, after every kernel row (default: beside each row, every density)",
    )
    p.add_argument(
        "--call-time",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time back-to-back single calls (one more program per product and path; default on)",
    )
    p.add_argument(
        "--dense-path",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time impl='dense' (the blocks scattered into a dense weight, then XLA's dot; default on)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows of the same problem already in --json and measure only the products missing there",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the pure-JAX reference lowering (default: on CPU only)",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="start no new row after this many seconds from the start of the process "
        "(the JSON then says complete: false)",
    )
    p.add_argument("--json", type=Path, help="write results here (rewritten after every row)")
    args = p.parse_args(argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    args.preset = args.preset or ("gpu" if on_gpu else "cpu")
    preset = PRESETS[args.preset]
    for name, value in {**DEFAULTS, **preset}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.reference is None:
        args.reference = not on_gpu
    if args.chain is None:
        args.chain = 10 if on_gpu else 1
    if args.chain < 1 or args.repeats < 1:
        p.error("--chain and --repeats must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    # A product that raised (a kernel fault among them) fails the run; a deadline does not.
    sys.exit(1 if any(r.get("error") for r in main()["results"]) else 0)
