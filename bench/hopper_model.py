"""A model of the Hopper DSD kernels (fprop, bprop), written before they are timed.

For each design and block size it counts, for one product at W C x K, N rows, density d
(bfloat16, the problem of the Hopper targets: C = K = N = 8192, d = 0.1):

* FLOPs: the useful ones, F = 2 N C K d, and those the tensor cores issue (the packed
  baseline multiplies zero blocks too: P = 64 / bs times F);
* shared-memory bytes per wgmma: the operands one instruction reads (A 64 x 16, B 16 x n);
* L2 -> SM bytes: each layout entry brings a [128, bs] slice of the dense operand and a
  [bs, bs] block into the tile that uses it, F (1/bs + 1/128) bytes: a slice of the dense
  operand feeds one bs-wide output block only, which is what limits small blocks;
* HBM bytes: the stacked kernel's row-tile-major order keeps the rows a wave reads in L2,
  so a, w and out move once, 2 (N C + d C K + N K); the baseline's output-major order
  re-reads a from HBM for each output that uses it (at most F / bs bytes: an upper bound).

Each is turned into a time with a ceiling and the prediction is the largest: tensor time
F_issued / R with R the dense product's own rate, shared memory at 128 B per clock per SM,
L2 at an assumed 5.5 TB/s, HBM at the bandwidth the GPU session measured. R and the HBM
bandwidth come from the committed session results (bench/results/gpu-h100-*.json), beside
the measured efficiency of the designs that ran there. The predicted efficiency is
(F / R) / predicted time: the fraction of dense speed per stored block.

    python bench/hopper_model.py          # the table (reStructuredText, for docs/guide/performance.rst)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

SIZE = 8192  # C = K = N
DENSITY = 0.1
ELEM = 2  # bytes of a bfloat16
SMS = 132
CLOCK_HZ = 1.755e9  # the H100 SXM's clock under sustained tensor load
SMEM_BYTES_PER_CLOCK = 128  # per SM
L2_BPS = 5.5e12  # assumed L2 -> SM bandwidth (microbenchmarks of the H100 SXM); the GPU run checks it
TILE_M = 128  # rows per tile (both designs)


def session_results() -> dict:
    """The newest committed GPU session (bench/results/gpu-h100-*.json)."""
    newest = sorted(RESULTS.glob("gpu-h100-*.json"))
    if not newest:
        raise SystemExit("hopper_model.py: no bench/results/gpu-h100-*.json to take the dense rate from")
    return json.loads(newest[-1].read_text())


def ceilings(report: dict) -> dict:
    """R (the dense bf16 product's rate, FLOP/s, median over the session's 8192^3 rows) and
    the HBM bandwidth (bytes/s) the session measured."""
    rows = [
        r
        for r in report["results"]
        if r.get("dtype") == "bfloat16" and r.get("size") == [SIZE] * 3 and r.get("dense_s")
    ]
    dense_s = statistics.median(r["dense_s"] for r in rows)
    return dict(rate=2 * SIZE**3 / dense_s, hbm=report["bandwidth_Bps"])


def measured(report: dict, bs: int) -> float | None:
    """The session's fprop efficiency at block ``bs``, density 0.1, Hopper path (None where not run)."""
    found = [
        r["efficiency"]
        for r in report["results"]
        if r.get("op") == "fprop"
        and r.get("path") == "hopper"
        and r.get("dtype") == "bfloat16"
        and r.get("block_size") == bs
        and r.get("size") == [SIZE] * 3
        and r.get("efficiency")
        and abs(r["density"] - DENSITY) < 0.02
    ]
    return found[0] if found else None


def design(name: str, bs: int, ceil: dict) -> dict:
    """The model of one design at block ``bs`` (see the module docstring)."""
    n = c = k = SIZE
    flops = 2 * n * c * k * DENSITY
    if name == "packed":  # bs < 64: P outputs per 64-wide tile, block-diagonal B
        pack = 64 // bs
        issued, wgmma_n = flops * pack, 64
    else:  # "stacked" (bs < 64) and the baseline tile at 64/128: wgmma N = bs
        issued, wgmma_n = flops, bs
    wgmma_flops = 2 * 64 * wgmma_n * 16
    smem_per_wgmma = ELEM * (64 * 16 + 16 * wgmma_n)
    l2 = flops * (1 / bs + 1 / TILE_M)
    once = ELEM * (n * c + DENSITY * c * k + n * k)
    hbm = once if name == "stacked" else flops / bs + ELEM * (DENSITY * c * k + n * k)
    times = dict(
        tensor=issued / ceil["rate"],
        smem=issued / wgmma_flops * smem_per_wgmma / (SMEM_BYTES_PER_CLOCK * SMS * CLOCK_HZ),
        l2=l2 / L2_BPS,
        hbm=hbm / ceil["hbm"],
    )
    bound = max(times, key=times.get)
    return dict(
        design=name,
        bs=bs,
        flops=flops,
        issued=issued,
        smem_per_wgmma=smem_per_wgmma,
        l2_bytes=l2,
        hbm_bytes=hbm,
        times=times,
        bound=bound,
        efficiency=(flops / ceil["rate"]) / times[bound],
    )


DESIGNS = [("packed", 8), ("packed", 16), ("packed", 32), ("stacked", 8), ("stacked", 16), ("stacked", 32)]
DESIGNS += [("baseline", 64), ("stacked", 64), ("baseline", 128)]


def table() -> str:
    """The model as a reStructuredText table, with the session's measured efficiency."""
    report = session_results()
    ceil = ceilings(report)
    head = [
        "design",
        "block",
        "GFLOP useful / issued",
        "smem B / wgmma",
        "L2 GB",
        "HBM GB",
        "bound",
        "predicted",
        "measured",
    ]
    rows = []
    for name, bs in DESIGNS:
        m = design(name, bs, ceil)
        seen = measured(report, bs) if name != "stacked" else None
        rows.append(
            [
                name,
                str(bs),
                f"{m['flops'] / 1e9:.0f} / {m['issued'] / 1e9:.0f}",
                str(m["smem_per_wgmma"]),
                f"{m['l2_bytes'] / 1e9:.1f}",
                f"{m['hbm_bytes'] / 1e9:.2f}" + (" (at most)" if name != "stacked" else ""),
                m["bound"],
                f"{m['efficiency']:.2f}",
                f"{seen:.2f}" if seen is not None else "(not run)",
            ]
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    rule = "  ".join("=" * w for w in widths)
    fmt = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    lines = [rule, fmt(head), rule, *(fmt(r) for r in rows), rule]
    note = (
        f"R = {ceil['rate'] / 1e12:.0f} TFLOP/s (the dense product), HBM {ceil['hbm'] / 1e12:.2f} TB/s "
        f"(both measured in the session), L2 {L2_BPS / 1e12:.1f} TB/s (assumed), shared memory "
        f"{SMEM_BYTES_PER_CLOCK} B/clock/SM at {CLOCK_HZ / 1e9:.3f} GHz"
    )
    return "\n".join(lines) + "\n\n" + note + "\n"


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
