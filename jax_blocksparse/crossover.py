"""Where the native kernels pay: the crossover table that ``impl="auto"`` reads.

A block-sparse kernel is worth running only where it is faster than the dense product of
the same layer. At high density it rarely is: the dense product (the present blocks
scattered into a dense weight, then XLA's dot: ``impl="dense"``) runs at the device's
peak, the kernel at a fraction of it. So ``"auto"`` chooses, per product (fprop, bprop,
updat), when a call is lowered:

* the kernels where they are built and verified for the platform and the layout's
  *block capacity* (``capacity / (C/bs * K/bs)``, static, an upper bound on its density)
  is at most the crossover density of that kernel on that device;
* the dense product above it.

The decision reads only what is static (capacity, grid, dtype, precision, the product's
rows and the device), so a layout that changes within its capacity (dynamic sparse
training) keeps its compiled program. ``impl="kernels"`` always runs the kernels,
``impl="dense"`` always the dense product.

A crossover is measured at one batch: ``rows`` rows of activations (the leading dims of x,
or of dy in bprop; the dims updat contracts). Both sides have a cost that does not shrink
with the batch: the dense product converts the blocks to a dense weight (or the dense
weight gradient back to blocks), a kernel may transpose its weights once per call. So at
a small batch the kernel may win at a density where it lost at ``rows``, and at a large one
the reverse. An entry that also holds its kernel's and dense product's times at density 1
at two or more batches (``full_density``, which ``tune`` measures) has its crossover moved
for the batch of each product (:meth:`Crossover.at_rows`).

The table is data, one entry per (platform, device kind, FFI target, arithmetic mode,
block size), each with its ``family``: what decides the kernels' speed beside the device
itself. A kernel's speed depends on the machine, so the device kind says which machine:

* CPU: ``"cpu:<isa>:<cores>"`` (:func:`cpu_device_kind`: the instruction set the CPU
  kernels dispatch to, ``avx512``, ``avx2`` or ``baseline``, and the cores this process may
  use); its family is the instruction set;
* CUDA: JAX's ``device_kind`` ("NVIDIA H100 80GB HBM3"); its family the compute
  capability ("9.0").

Where this device has no entry (:func:`crossover_for`), the closest of its family is used:
on CPU the entry of the same instruction set whose core count is nearest, on CUDA one of
the same compute capability (an H200 uses an H100's: same chip). Where the family has none
either, :data:`UNMEASURED` decides: on CPU the kernels below density 0.5 and the dense
product above; on a verified GPU the dense product (nothing measured there, the safe
choice).

Three sources, the first found wins for each key:

1. a table put in force with :func:`use_table`;
2. this machine's own measurements: ``python -m jax_blocksparse tune`` writes them to the
   user cache (:func:`cache_path`: ``$JAX_BLOCKSPARSE_CACHE_DIR``, else the XDG cache
   folder);
3. the table shipped in this package, ``crossovers.json``, written by
   ``bench/crossover.py`` from the benchmark results committed under ``bench/results/``
   (never by hand): for each entry, the density at which the kernel's measured time meets
   the dense product's, interpolated between the measured densities of a complete sweep
   (1.0: the kernel won everywhere measured; 0.0: it lost everywhere). The mode is the
   kernel's arithmetic: the dtype's name, or ``"tf32"`` where float32 runs on TF32 tensor
   cores.

:func:`use_table`, like :func:`jax_blocksparse.config.implementation`, is part of
``jax.jit``'s cache key, so nothing is recompiled behind your back and nothing stale is
reused::

    >>> import jax_blocksparse as jbs
    >>> table = jbs.crossover.CrossoverTable.from_entries(
    ...     [dict(platform="cpu", device_kind="cpu:avx2:2", target="jbs_bsmm_fprop", mode="float32",
    ...           block_size=32, crossover=0.4, family="avx2")])
    >>> table.lookup("cpu", "cpu:avx2:2", "jbs_bsmm_fprop", "float32", 32)
    0.4
    >>> jbs.crossover.crossover_for("cpu", "cpu:avx2:8", "jbs_bsmm_fprop", "float32", 32,
    ...                             family="avx2", table=table)   # the nearest core count
    0.4
    >>> with jbs.crossover.use_table(table):
    ...     jbs.crossover.table_in_force() is table
    True
    >>> with jbs.crossover.use_table(jbs.crossover.CrossoverTable()):   # nothing measured
    ...     len(jbs.crossover.table_in_force().entries)
    0
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax

from jax_blocksparse import _native

TABLE_PATH = Path(__file__).resolve().with_name("crossovers.json")
CACHE_ENV = "JAX_BLOCKSPARSE_CACHE_DIR"
CACHE_FILE = "crossovers.json"
FORMAT = 1
MODES = ("float32", "tf32", "bfloat16", "float16")
#: The crossover where a device and its family have no entry: on CPU the kernels below
#: density 0.5 (until ``tune`` has measured this machine); on a verified GPU the dense
#: product (nothing measured: the safe choice).
UNMEASURED = {"cpu": 0.5, "cuda": 0.0}
DIGITS = 3  # a crossover's decimals
#: How much faster than the dense product a kernel must measure to count as winning, in
#: the tables (tune's and the shipped one): closer than that, timing noise decides, and
#: the dense product is what the user would otherwise run.
WIN_MARGIN = 0.03

__all__ = [
    "Crossover",
    "CrossoverTable",
    "VariantChoice",
    "TABLE_PATH",
    "UNMEASURED",
    "WIN_MARGIN",
    "cache_path",
    "cpu_device_kind",
    "crossover_density",
    "crossover_for",
    "default_table",
    "load_table",
    "merged",
    "prefers_dense",
    "reset_default_table",
    "table_in_force",
    "table_sources",
    "use_table",
    "variant_for",
]


def _check_kernel_fields(row, str_fields: tuple[str, ...]) -> None:
    """The checks a table row's kernel fields share (:class:`Crossover`,
    :class:`VariantChoice`): ``str_fields`` are strings, ``mode`` one of :data:`MODES`,
    ``block_size`` a positive int; the errors name the row's class."""
    what = type(row).__name__
    for name in str_fields:
        if not isinstance(getattr(row, name), str):
            raise TypeError(f"{what}: {name} must be a str, got {getattr(row, name)!r}")
    if row.mode not in MODES:
        raise ValueError(f"{what}: mode must be one of {MODES}, got {row.mode!r}")
    if isinstance(row.block_size, bool) or not isinstance(row.block_size, int) or row.block_size <= 0:
        raise ValueError(f"{what}: block_size must be a positive int, got {row.block_size!r}")


@dataclasses.dataclass(frozen=True)
class Crossover:
    """One kernel on one device: above ``crossover`` block density the dense product is faster.

    Attributes:
      platform: the lowering platform, "cpu" or "cuda".
      device_kind: the device it was measured on: ``"cpu:<isa>:<cores>"`` on CPU
        (:func:`cpu_device_kind`), JAX's ``device_kind`` on CUDA ("NVIDIA H100 80GB HBM3").
      target: the FFI target of the kernel ("jbs_bsmm_fprop", "jbs_bsmm_updat_sm90", ...).
      mode: the kernel's arithmetic: "float32", "tf32", "bfloat16" or "float16".
      block_size: one of :data:`~jax_blocksparse.SUPPORTED_BLOCK_SIZES`.
      crossover: a density in [0, 1]: the kernel runs for block capacities up to it.
      source: the benchmark result it was computed from (a path under bench/results/, or
        where ``tune`` measured it).
      family: what the device shares with others of its speed: the CPU's instruction set,
        the GPU's compute capability ("" where unknown).
      rows: the batch the crossover was measured at (the rows of the activations); 0
        where unknown (then the crossover holds for every batch).
      full_density: ``(rows, kernel seconds, dense seconds)`` per batch measured at
        density 1, two or more batches (``rows`` among them), or none: what
        :meth:`at_rows` moves the crossover by.
    """

    platform: str
    device_kind: str
    target: str
    mode: str
    block_size: int
    crossover: float
    source: str = ""
    family: str = ""
    rows: int = 0
    full_density: tuple[tuple[int, float, float], ...] = ()

    def __post_init__(self):
        _check_kernel_fields(self, ("platform", "device_kind", "target", "mode", "source", "family"))
        c = self.crossover
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0.0 <= c <= 1.0:
            raise ValueError(f"Crossover: crossover must be a density in [0, 1], got {c!r}")
        object.__setattr__(self, "crossover", float(c))
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 0:
            raise ValueError(f"Crossover: rows must be an int >= 0, got {self.rows!r}")
        points = []
        for point in self.full_density:
            ok = isinstance(point, (tuple, list)) and len(point) == 3
            n, kernel_s, dense_s = point if ok else (None, None, None)
            ok = ok and isinstance(n, int) and not isinstance(n, bool) and n > 0
            ok = ok and all(_positive_seconds(v) for v in (kernel_s, dense_s))
            if not ok:
                raise ValueError(
                    f"Crossover: full_density must hold (rows > 0, kernel seconds > 0, dense seconds > 0) "
                    f"points, got {point!r}"
                )
            points.append((n, float(kernel_s), float(dense_s)))
        batches = [n for n, _, _ in points]
        if points and (len(set(batches)) < 2 or self.rows not in batches):
            raise ValueError(
                f"Crossover: full_density needs two or more distinct batches, rows={self.rows} among them, "
                f"got batches {batches}"
            )
        object.__setattr__(self, "full_density", tuple(sorted(points)))

    @property
    def key(self) -> tuple:
        return (self.platform, self.device_kind, self.target, self.mode, self.block_size)

    def at_rows(self, rows: int | None) -> float:
        """The crossover for a product of ``rows`` rows of activations.

        Each side's time at density 1 is modelled as ``a * rows + b`` (a cost per row and
        one per call: the dense product's conversion, a kernel's once-per-call transpose),
        fitted by least squares to :attr:`full_density`. The measured crossover moves by
        how the dense-to-kernel ratio at density 1 moves from :attr:`rows` to ``rows``
        (a kernel's time falls about in proportion to the density, so that ratio is where
        the two meet, in units of density). Where the kernel won at every measured density
        (crossover 1), the ratio at :attr:`rows` is where it would have lost. Without
        ``full_density`` or ``rows``, or where a fit has no positive cost per row (noise),
        the measured crossover."""
        if not self.full_density or not rows or rows == self.rows:
            return self.crossover
        kernel = _line([(n, t) for n, t, _ in self.full_density])
        dense = _line([(n, t) for n, _, t in self.full_density])
        if kernel is None or dense is None:
            return self.crossover

        def ratio(n):
            return (dense[0] * n + dense[1]) / (kernel[0] * n + kernel[1])

        measured = ratio(self.rows)
        base = max(1.0, measured) if self.crossover >= 1.0 else self.crossover
        return round(min(1.0, max(0.0, base * ratio(rows) / measured)), DIGITS)


def _positive_seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """``(a, b)`` of the least-squares line ``t = a * n + b`` through ``(n, t)`` points, with
    ``b`` clipped at 0 (a call costs nothing negative); None where ``a <= 0``."""
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    a = sum((n - mean_n) * (t - mean_t) for n, t in points) / spread
    if a <= 0:
        return None
    b = mean_t - a * mean_n
    if b < 0:  # through the origin instead
        a, b = sum(n * t for n, t in points) / sum(n * n for n, _ in points), 0.0
    return a, b


@dataclasses.dataclass(frozen=True)
class VariantChoice:
    """Which variant of a kernel ran fastest on one device over a range of block densities.

    A kernel target may hold several designs of the same product (the Hopper targets'
    variants: ``jax_blocksparse.ops._sm90.variants``). The session bench times them in one
    process; where one beat the others over ``[low, high]`` it is written here. Which
    variant runs is decided apart from whether the kernel or the dense product runs: the
    lowering first picks the variant (this choice, else the baseline), then compares that
    variant's own crossover (its :class:`Crossover` entry, whose target is
    ``"<target>:<variant>"``) with the layout's block capacity.

    Attributes:
      platform: as in :class:`Crossover`.
      device_kind: as in :class:`Crossover`.
      target: the kernel target, without a variant ("jbs_bsmm_fprop_sm90").
      mode: as in :class:`Crossover`.
      block_size: as in :class:`Crossover`.
      variant: the winner's name ("stacked").
      low: the lowest block density over which it won.
      high: the highest, ``0 <= low <= high <= 1``.
      source: as in :class:`Crossover`.
      family: as in :class:`Crossover`.
    """

    platform: str
    device_kind: str
    target: str
    mode: str
    block_size: int
    variant: str
    low: float
    high: float
    source: str = ""
    family: str = ""

    def __post_init__(self):
        _check_kernel_fields(self, ("platform", "device_kind", "target", "mode", "variant", "source", "family"))
        if ":" in self.target or not self.variant or ":" in self.variant:
            raise ValueError(
                f"VariantChoice: target {self.target!r} and variant {self.variant!r} must be plain names (no ':')"
            )
        lo, hi = self.low, self.high
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (lo, hi)):
            raise ValueError(f"VariantChoice: low and high must be densities, got {lo!r}, {hi!r}")
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"VariantChoice: need 0 <= low <= high <= 1, got low={lo!r}, high={hi!r}")
        object.__setattr__(self, "low", float(lo))
        object.__setattr__(self, "high", float(hi))

    @property
    def key(self) -> tuple:
        return (self.platform, self.device_kind, self.target, self.mode, self.block_size, self.low)


@dataclasses.dataclass(frozen=True)
class CrossoverTable:
    """The crossovers of some kernels on some devices (hashable: a jit cache key).

    Attributes:
      entries: the :class:`Crossover` entries, at most one per key (platform, device
        kind, target, mode, block size). Empty: ``"auto"`` never picks the dense product.
      variants: the :class:`VariantChoice` entries: which variant of a kernel runs over
        which densities (none: every kernel runs its baseline).
    """

    entries: tuple[Crossover, ...] = ()
    variants: tuple[VariantChoice, ...] = ()

    def __post_init__(self):
        entries = tuple(self.entries)
        if not all(isinstance(e, Crossover) for e in entries):
            raise TypeError("CrossoverTable: entries must be Crossover instances (see CrossoverTable.from_entries)")
        keys = [e.key for e in entries]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"CrossoverTable: more than one entry for {dupes}")
        object.__setattr__(self, "entries", tuple(sorted(entries, key=lambda e: e.key)))
        variants = tuple(self.variants)
        if not all(isinstance(v, VariantChoice) for v in variants):
            raise TypeError(
                "CrossoverTable: variants must be VariantChoice instances (see CrossoverTable.from_entries)"
            )
        object.__setattr__(self, "variants", tuple(sorted(variants, key=lambda v: v.key)))
        by_kernel: dict[tuple, list[VariantChoice]] = {}
        for v in self.variants:
            by_kernel.setdefault(v.key[:5], []).append(v)
        for kernel, ranges in by_kernel.items():
            for a, b in zip(ranges, ranges[1:]):
                if b.low <= a.high:
                    raise ValueError(
                        f"CrossoverTable: the variant ranges of {kernel} overlap: {a.variant} over "
                        f"[{a.low}, {a.high}] and {b.variant} over [{b.low}, {b.high}]"
                    )

    @classmethod
    def from_entries(
        cls, entries: Iterable[Crossover | Mapping], variants: Iterable[VariantChoice | Mapping] = ()
    ) -> CrossoverTable:
        """A table from :class:`Crossover` objects or dicts of their fields (and the same
        for :class:`VariantChoice`)."""
        return cls(
            tuple(e if isinstance(e, Crossover) else Crossover(**e) for e in entries),
            tuple(v if isinstance(v, VariantChoice) else VariantChoice(**v) for v in variants),
        )

    @classmethod
    def from_json(cls, data: Mapping) -> CrossoverTable:
        """A table from the JSON form (:meth:`to_json`): ``{"format": 1, "entries": [...]}``
        and, where any were measured, ``"variants": [...]``."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT or "entries" not in data:
            raise ValueError(f"CrossoverTable.from_json: need a mapping with format {FORMAT} and entries")
        return cls.from_entries(data["entries"], data.get("variants", ()))

    def to_json(self, **extra) -> dict:
        """The JSON form: ``{"format": 1, **extra, "entries": [{field: value}, ...]}``, with
        ``"variants"`` where the table has any."""
        out = {"format": FORMAT, **extra, "entries": [_entry_json(e) for e in self.entries]}
        if self.variants:
            out["variants"] = [dataclasses.asdict(v) for v in self.variants]
        return out

    def lookup(self, platform: str, device_kind: str | None, target: str, mode: str, block_size: int):
        """The crossover density of that kernel on that device (at the batch it was
        measured at), or None where unmeasured."""
        entry = self.entry(platform, device_kind, target, mode, block_size)
        return None if entry is None else entry.crossover

    def entry(self, platform: str, device_kind: str | None, target: str, mode: str, block_size: int):
        """The :class:`Crossover` of that kernel on that device, or None where unmeasured."""
        return self._index().get((platform, device_kind, target, mode, block_size))

    def for_device(self, platform: str, device_kind: str | None) -> tuple[Crossover, ...]:
        """The entries of one device."""
        return tuple(e for e in self.entries if (e.platform, e.device_kind) == (platform, device_kind))

    def _index(self) -> dict:
        return _index_of(self.entries)


@functools.lru_cache(maxsize=64)
def _index_of(entries: tuple[Crossover, ...]) -> dict:
    return {e.key: e for e in entries}


def _entry_json(entry: Crossover) -> dict:
    """An entry's JSON fields; the batch fields only where measured (older tables lack them)."""
    out = dataclasses.asdict(entry)
    if not entry.rows:
        del out["rows"]
    if entry.full_density:
        out["full_density"] = [list(p) for p in entry.full_density]
    else:
        del out["full_density"]
    return out


def load_table(path: str | os.PathLike) -> CrossoverTable:
    """Reads a table written by ``bench/crossover.py`` (or :meth:`CrossoverTable.to_json`)."""
    with open(path) as f:
        return CrossoverTable.from_json(json.load(f))


def crossover_density(points: Iterable[tuple[float, float]], margin: float = 0.0) -> float:
    """The crossover of one kernel from ``(density, dense time / kernel time)`` points:
    the kernel wins where the ratio is at least ``1 + margin``. 1.0 where it wins at every
    measured density, 0.0 where it loses already at the lowest, else the density where
    the ratio crosses ``1 + margin``, interpolated linearly between the last win and the
    first loss above it (a loss below a win counts: "auto" must never be slower than
    dense where it was measured). The tables use :data:`WIN_MARGIN`.

    >>> crossover_density([(0.1, 3.0), (0.25, 1.5), (0.5, 0.5), (1.0, 0.2)])
    0.375
    """
    points = sorted(points)
    if not points:
        raise ValueError("crossover_density: no points")
    bar = 1.0 + margin
    prev = None
    for density, ratio in points:
        if ratio < bar:
            if prev is None:
                return 0.0
            d0, r0 = prev
            t = (r0 - bar) / (r0 - ratio)
            return round(d0 + t * (density - d0), DIGITS)
        prev = (density, ratio)
    return 1.0


def cache_path() -> Path:
    """Where ``python -m jax_blocksparse tune`` writes this machine's crossovers:
    ``$JAX_BLOCKSPARSE_CACHE_DIR/crossovers.json``, else ``$XDG_CACHE_HOME`` (default
    ``~/.cache``) ``/jax_blocksparse/crossovers.json``."""
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(base, "jax_blocksparse")
    return Path(folder) / CACHE_FILE


def merged(preferred: CrossoverTable, rest: CrossoverTable) -> CrossoverTable:
    """The entries of ``preferred``, and those of ``rest`` whose key it lacks; the variant
    choices of ``preferred`` for each kernel and device it chose for, those of ``rest`` for
    the others."""
    keys = {e.key for e in preferred.entries}
    chosen = {v.key[:5] for v in preferred.variants}
    return CrossoverTable(
        preferred.entries + tuple(e for e in rest.entries if e.key not in keys),
        preferred.variants + tuple(v for v in rest.variants if v.key[:5] not in chosen),
    )


@functools.cache
def _default_table(cache_file: str) -> CrossoverTable:
    shipped = load_table(TABLE_PATH) if TABLE_PATH.exists() else CrossoverTable()
    if not os.path.exists(cache_file):
        return shipped
    try:
        return merged(load_table(cache_file), shipped)
    except (OSError, ValueError, TypeError) as err:
        warnings.warn(f"jax_blocksparse: ignoring the crossover cache {cache_file}: {err}", stacklevel=3)
        return shipped


def default_table() -> CrossoverTable:
    """This machine's measurements from the user cache (:func:`cache_path`), where there
    are any, over the table shipped with the package (``crossovers.json``); empty where
    both are missing. Read once per cache path and process (``tune`` resets it)."""
    return _default_table(str(cache_path()))


def reset_default_table() -> None:
    """Forgets the tables read by :func:`default_table` (after ``tune`` wrote the cache)."""
    _default_table.cache_clear()


def table_sources() -> list[str]:
    """Where the table in force comes from, one line each (for the environment report)."""
    value = None if _context is None else _context.value
    if value is not None:
        return [f"a table put in force with use_table ({len(value.entries)} entries)"]
    lines = []
    cache = cache_path()
    if cache.exists():
        try:
            lines.append(f"this machine's measurements (tune): {cache} ({len(load_table(cache).entries)} entries)")
        except (OSError, ValueError, TypeError) as err:
            lines.append(f"the cache {cache} is unreadable and ignored: {err}")
    else:
        lines.append(f"no measurements of this machine yet ({cache}: run `python -m jax_blocksparse tune`)")
    shipped = len(load_table(TABLE_PATH).entries) if TABLE_PATH.exists() else 0
    lines.append(f"the table shipped with the package: {TABLE_PATH} ({shipped} entries)")
    return lines


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity where the OS has one, else the
    machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_device_kind(isa: str | None = None, cores: int | None = None) -> str:
    """This machine's CPU as the crossover table names it: ``"cpu:<isa>:<cores>"``, the
    instruction set the CPU kernels dispatch to (the extension's ``cpu_isa``, which
    ``JAX_BLOCKSPARSE_CPU_ISA`` may lower; "unknown" without it) and the cores this process
    may run on.

    Raises ValueError naming ``JAX_BLOCKSPARSE_CPU_ISA`` when it names an instruction set
    that is unknown or that this CPU lacks (the kernels refuse to run then)."""
    if isa is None:
        info = _native.extension_info()
        if info.get("cpu_isa_error"):
            raise ValueError(info["cpu_isa_error"])
        isa = info.get("cpu_isa") or "unknown"
    if cores is None:
        cores = usable_cores()
    return f"cpu:{isa}:{cores}"


def _cores(device_kind: str) -> int | None:
    parts = device_kind.split(":")
    return int(parts[2]) if len(parts) == 3 and parts[0] == "cpu" and parts[2].isdigit() else None


def crossover_for(
    platform: str,
    device_kind: str | None,
    target: str,
    mode: str,
    block_size: int,
    *,
    family: str | None = None,
    table: CrossoverTable | None = None,
    rows: int | None = None,
) -> float | None:
    """The crossover of a kernel on a device: its own entry, else the nearest of its family
    (CPU: same instruction set, nearest core count, the lower crossover on a tie; CUDA:
    same compute capability, the lowest crossover: the safe one); None where neither has
    one (:data:`UNMEASURED` then decides). With ``rows`` (the product's rows of
    activations), the entry's crossover for that batch (:meth:`Crossover.at_rows`)."""
    table = table_in_force() if table is None else table
    own = table.entry(platform, device_kind, target, mode, block_size)
    if own is not None or not family:
        return None if own is None else own.at_rows(rows)
    kin = [
        (_cores(e.device_kind) or 0, e.at_rows(rows))
        for e in table.entries
        if (e.platform, e.family, e.target, e.mode, e.block_size) == (platform, family, target, mode, block_size)
    ]
    if not kin:
        return None
    if platform == "cpu":
        cores = _cores(device_kind or "") or 0
        return min(kin, key=lambda k: (abs(k[0] - cores), k[1]))[1]
    return min(c for _, c in kin)


def variant_for(
    platform: str,
    device_kind: str | None,
    target: str,
    mode: str,
    block_size: int,
    block_fraction: float,
    *,
    family: str | None = None,
    table: CrossoverTable | None = None,
) -> str | None:
    """The variant of ``target`` the table chose for a layout of ``block_fraction`` (its
    capacity over its grid) on that device: the :class:`VariantChoice` whose density range
    holds it, the device's own first, else one of its family (on CUDA the same compute
    capability); None where none does (the baseline runs)."""
    table = table_in_force() if table is None else table

    def pick(choices):
        for v in choices:
            if v.low <= block_fraction <= v.high:
                return v.variant
        return None

    kernel = (platform, target, mode, block_size)
    own = [v for v in table.variants if (v.platform, v.target, v.mode, v.block_size) == kernel]
    found = pick(v for v in own if v.device_kind == device_kind)
    if found is not None or not family:
        return found
    return pick(v for v in own if v.family == family)


# The table set by use_table: a jax user context, so its value is part of jit's cache keys
# (None: the package's table). None on a jax without make_user_context.
_make = getattr(jax, "make_user_context", None)
_context = None if _make is None else _make(None)


def table_in_force() -> CrossoverTable:
    """The innermost :func:`use_table`'s table, else :func:`default_table`."""
    value = None if _context is None else _context.value
    return default_table() if value is None else value


@contextlib.contextmanager
def use_table(table: CrossoverTable):
    """Puts ``table`` in force for ops lowered inside (nests; the innermost wins).

    Part of ``jax.jit``'s cache key, as :func:`jax_blocksparse.config.implementation`
    is: a jitted function called inside is compiled for this table.
    """
    if not isinstance(table, CrossoverTable):
        raise TypeError(f"use_table: table must be a CrossoverTable (see load_table), got {type(table).__name__}")
    if _context is None:
        raise RuntimeError(f"jbs.crossover.use_table needs jax.make_user_context, which jax {jax.__version__} lacks")
    with _context(table):
        yield


def prefers_dense(
    platform: str,
    device_kind: str | None,
    target: str,
    mode: str,
    block_size: int,
    block_fraction: float,
    table: CrossoverTable | None = None,
    *,
    family: str | None = None,
    rows: int | None = None,
) -> bool:
    """Whether ``"auto"`` computes a product densely instead of with ``target``.

    True where the layout's ``block_fraction`` (its capacity over its grid) exceeds the
    kernel's crossover on that device for a product of ``rows`` rows (:func:`crossover_for`;
    :data:`UNMEASURED` where the table has none for the device or its family)."""
    crossover = crossover_for(platform, device_kind, target, mode, block_size, family=family, table=table, rows=rows)
    if crossover is None:
        crossover = UNMEASURED.get(platform, 1.0)
    return block_fraction > crossover
