"""What bench/bsmm.py reports: the JSON's header, each row's ratios, the printed table,
and the rows an earlier run left (``--resume``).

A row is a dict of one (product, path): ``op``, ``dtype``, ``block_size``, ``density``,
``path``, ``target``, ``mode`` and times in seconds (``sparse_s``, ``dense_s``, ...;
None where not measured); :func:`add_ratios` derives ``efficiency`` and ``speedup`` from
them. What every benchmark shares (the commit, the atomic write) is bench/_report.py.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

import jax
import numpy as np

import jax_blocksparse as jbs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_report.py, also when loaded by path
from _peers import peer_versions  # noqa: E402
from _report import cpu_cores, git_commit  # noqa: E402


def _versions(peers) -> dict:
    out = dict(
        jax=jax.__version__, jax_blocksparse=jbs.__version__, python=sys.version.split()[0], numpy=np.__version__
    )
    out.update(peer_versions(peers))
    return out


def json_header(args, device, device_kind: str, paths: list[str], *, dense_path: bool) -> dict:
    """The report's fields before its rows: the device, versions, commit, date, the
    configuration (``args``, bench/bsmm.py's parsed command line) and how each time was
    taken; ``paths`` the kernel paths timed, ``dense_path`` whether ``impl="dense"`` is."""
    c, k, n = args.size
    now = datetime.datetime.now(datetime.UTC)
    return dict(
        device=str(device),
        device_kind=device_kind,
        platform=device.platform,
        jax_version=jax.__version__,
        jax_blocksparse_version=jbs.__version__,
        versions=_versions(args.peers),
        implementation=jbs.config.get_implementation(),
        cuda_kernels=jbs.has_cuda_kernels(),
        cpu_kernels=jbs.has_cpu_kernels(),
        extension=jbs.extension_info(),
        paths=paths,
        dense_path=dense_path,
        commit=git_commit(),
        date=now.date().isoformat(),
        datetime=now.isoformat(timespec="seconds"),
        host=platform.node(),
        cpu_cores=cpu_cores(),
        compute_capability=str(getattr(device, "compute_capability", "") or "") or None,
        python=sys.version.split()[0],
        size=dict(C=c, K=k, N=n),
        config=dict(
            block_sizes=args.block_sizes,
            densities=args.densities,
            dtypes=args.dtypes,
            ops=args.ops,
            peers=args.peers,
            peer_densities=args.peer_densities,
            call_time=args.call_time,
            dense_path=args.dense_path,
            seed=args.seed,
            preset=args.preset,
        ),
        timing=dict(
            chain=args.chain,
            repeats=args.repeats,
            min_time_s=args.min_time,
            statistic="median",
            layout="jit argument, straight from Layout.from_mask (not device_put, not closed over)",
            device_time=(
                f"sparse_s, dense_s, dense_path_s: back-to-back calls of one compiled function applying "
                f"the op {args.chain} times in a data-dependent chain, per call / {args.chain}"
            ),
            call_time="sparse_call_s, dense_call_s: back-to-back calls of the single op, per call "
            "(host time where that exceeds device time)",
            paths="each path's functions compiled ahead of time with JAX_BLOCKSPARSE_HOPPER=1 (hopper) or unset "
            "(ampere, native); target: the jbs FFI target in the compiled HLO that was timed",
            dense_path="dense_path_s: impl='dense' (blocks scattered into a dense weight, then XLA's dot)",
            torch="torch_bsr_s: CUDA graph of chained calls, replayed, per call (torch_bsr_method); "
            "torch_bsr_call_s: back-to-back calls timed with CUDA events",
            roofline="roofline_s: the larger of the product's FLOPs at the dense product's measured rate and its "
            "bytes (operands read once, result written once) at bandwidth_Bps, the bandwidth of a large "
            "elementwise update measured in the same run; roofline_speedup_bound = dense_s / roofline_s",
        ),
    )


def _ms(v):
    return f"{v * 1e3:.3f}" if v else "-"


def _num(v, spec):
    return "-" if v is None else format(v, spec)


HEADER = (
    f"{'op':6} {'dtype':9} {'bs':>4} {'density':>8} {'path':7} {'mode':9} {'dense ms':>9} {'sparse ms':>10} "
    f"{'effic.':>7} {'speedup':>8} {'bound':>6} {'dpath ms':>9} {'call ms':>8} {'call eff':>8} "
    f"{'torch ms':>9} {'vs torch':>8} {'bcoo ms':>8} {'ref ms':>8}  target"
)


def line(row) -> str:
    """One row of the printed table (:data:`HEADER`'s columns)."""
    bound = row.get("roofline_speedup_bound")
    vs = row.get("speedup_vs_torch_bsr")
    text = (
        f"{row['op']:6} {row['dtype']:9} {row['block_size']:>4} {row['density']:>8.3f} {row['path']:7} "
        f"{row.get('mode') or '-':9} {_ms(row.get('dense_s')):>9} {_ms(row.get('sparse_s')):>10} "
        f"{_num(row.get('efficiency'), '7.2f'):>7} {_num(row.get('speedup'), '8.2f'):>8} "
        f"{(f'{bound:.1f}' if bound else 'n/a'):>6} {_ms(row.get('dense_path_s')):>9} "
        f"{_ms(row.get('sparse_call_s')):>8} {_num(row.get('call_efficiency'), '8.2f'):>8} "
        f"{_ms(row.get('torch_bsr_s')):>9} {(f'{vs:.2f}x' if vs else '-'):>8} "
        f"{_ms(row.get('jax_bcoo_s')):>8} {_ms(row.get('reference_s')):>8}  {row.get('target') or '-'}"
    )
    if row.get("error"):
        text += f"  ERROR {row['error']}"
    return text


def add_ratios(row) -> None:
    """Efficiency, speedups and the torch comparison of a row, where its times exist."""
    sparse, dense, density = row.get("sparse_s"), row.get("dense_s"), row["density"]
    ok = bool(sparse and dense)
    row["efficiency"] = dense * density / sparse if ok else None
    row["speedup"] = dense / sparse if ok else None
    call, dense_call = row.get("sparse_call_s"), row.get("dense_call_s")
    row["call_efficiency"] = dense_call * density / call if call and dense_call else None
    if sparse and row.get("torch_bsr_s"):
        row["speedup_vs_torch_bsr"] = row["torch_bsr_s"] / sparse


def product_key(op, dtype, bs, density, size) -> tuple:
    return (op, dtype, int(bs), round(float(density), 6), tuple(int(v) for v in size))


def _resumed(args, device_kind: str) -> dict | None:
    """The earlier run of the same problem on the same kind of device in ``args.json``
    (``--resume``), or None where there is none or it measured something else."""
    path = args.json
    if not (args.resume and path and Path(path).exists()):
        return None
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return old if old.get("device_kind") == device_kind else None


def resumed_rows(args, device_kind: str) -> list[dict]:
    """The rows of the earlier run that ``--resume`` continues, to keep. A product with any
    row there (an error row too: it may have been a fault) is not measured again."""
    old = _resumed(args, device_kind) or {}
    return [r for r in old.get("results", []) if "requested_density" in r and "size" in r]


def resumed_faults(args, device_kind: str) -> list[dict]:
    """The faults (:func:`faults_of`) of the earlier run that ``--resume`` continues, error
    rows included (those stay in the results; the others, a path that hung or killed its
    process, the report keeps in ``faults``, or the evidence would be lost)."""
    old = _resumed(args, device_kind)
    return faults_of(old) if old else []


def _planned_paths(report: dict):
    """(op, dtype, block size, requested density, path) of every (product, path) the run of
    ``report`` measures, in bench/bsmm.py's order (dtypes, block sizes, densities, ops,
    paths; a Hopper variant only where it runs the product)."""
    from jax_blocksparse.ops import paths

    config = report.get("config") or {}
    size = report.get("size") or {}
    c, k = size.get("C", 0), size.get("K", 0)
    for dtype in config.get("dtypes", ()):
        for bs in config.get("block_sizes", ()):
            if not c or c % bs or k % bs:
                continue
            for density in config.get("densities", ()):
                for op in config.get("ops", ()):
                    for path in report.get("paths", ()):
                        _, _, variant = path.partition(":")
                        if variant and not paths.variant_runs(op, variant, dtype, bs):
                            continue
                        yield op, dtype, int(bs), round(float(density), 6), path


def _fault(op, dtype, bs, density, path, size, why, **extra) -> dict:
    return dict(
        op=op, dtype=dtype, block_size=int(bs), requested_density=density, path=path, size=size, why=why, **extra
    )


def faults_of(report: dict) -> list[dict]:
    """The (product, path)s of a bench/bsmm.py report that failed: error rows (a compile
    error, a kernel fault; not a row whose product's dense timing failed), the faults an
    earlier run of a resumed report left, and the path its process was in when it was
    killed or died (``in_flight`` left set; for a report written before that field, the
    first planned path missing from a product that has rows already, so that a kill in the
    product's shared part, the dense timing, blames no kernel). Each: op, dtype,
    block_size, requested_density, path, size, why (and row=True for an error row)."""
    size = report.get("size") or {}
    size = [size.get("C"), size.get("K"), size.get("N")]
    out = [
        _fault(
            r["op"],
            r["dtype"],
            r["block_size"],
            r.get("requested_density", r["density"]),
            r.get("requested_path", r["path"]),
            r.get("size", size),
            f"error: {r['error']}",
            row=True,
            mode=r.get("mode"),
        )
        for r in report.get("results", [])
        if r.get("error") and not r.get("shared_error")
    ]
    out += [dict(f) for f in report.get("faults", [])]
    if report.get("complete") or report.get("stopped"):
        return out
    killed = "killed or died while measuring it"
    if "in_flight" in report:
        if report["in_flight"]:
            out.append(_fault(**report["in_flight"], size=size, why=killed))
        return out
    done = {
        (
            r["op"],
            r["dtype"],
            int(r["block_size"]),
            round(float(r.get("requested_density", r["density"])), 6),
            r.get("requested_path", r["path"]),
        )
        for r in report.get("results", [])
    }
    started = {key[:4] for key in done}
    for key in _planned_paths(report):
        if key not in done:
            if key[:4] in started:
                out.append(_fault(*key, size=size, why=killed))
            break
    return out
