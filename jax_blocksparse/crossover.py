"""Where the native kernels pay: the crossover table that ``impl="auto"`` reads.

A block-sparse kernel is worth running only where it is faster than the dense product of
the same layer. At high density it rarely is: the dense product (the present blocks
scattered into a dense weight, then XLA's dot: ``impl="dense"``) runs at the device's
peak, the kernel at a fraction of it. So ``"auto"`` chooses, per product (fprop, bprop,
updat), when a call is lowered:

* the kernels where they are built and verified for the platform and the layout's
  *block capacity* (``capacity / (C/bs * K/bs)``, static, an upper bound on its density)
  is at most the crossover density of that kernel on that device;
* the dense product above it;
* the kernels wherever the table has no entry (nothing measured: nothing to decide on).

The decision reads only what is static (capacity, grid, dtype, precision and the device),
so a layout that changes within its capacity (dynamic sparse training) keeps its
compiled program. ``impl="kernels"`` always runs the kernels, ``impl="dense"`` always the
dense product.

The table is data: ``crossovers.json`` in this package, one entry per (platform, device
kind, FFI target, arithmetic mode, block size). It is written by ``bench/crossover.py``
from the benchmark results committed under ``bench/results/`` (never by hand): for each
entry, the density at which the kernel's measured time meets the dense product's,
interpolated between the measured densities (1.0: the kernel won everywhere measured;
0.0: it lost everywhere). The mode is the kernel's arithmetic: the dtype's name, or
``"tf32"`` where float32 runs on TF32 tensor cores.

Another table (for example one measured on your own GPU by ``bench/bsmm.py`` and
``bench/crossover.py``) is put in force with :func:`use_table`; like
:func:`jax_blocksparse.config.implementation` its value is part of ``jax.jit``'s cache
key, so nothing is recompiled behind your back and nothing stale is reused::

    >>> import jax_blocksparse as jbs
    >>> table = jbs.crossover.CrossoverTable.from_entries(
    ...     [dict(platform="cpu", device_kind="cpu", target="jbs_bsmm_fprop", mode="float32",
    ...           block_size=32, crossover=0.4)])
    >>> table.lookup("cpu", "cpu", "jbs_bsmm_fprop", "float32", 32)
    0.4
    >>> with jbs.crossover.use_table(table):
    ...     jbs.crossover.table_in_force() is table
    True
    >>> with jbs.crossover.use_table(jbs.crossover.CrossoverTable()):   # never dense
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
from collections.abc import Iterable, Mapping
from pathlib import Path

import jax

TABLE_PATH = Path(__file__).resolve().with_name("crossovers.json")
FORMAT = 1
MODES = ("float32", "tf32", "bfloat16", "float16")

__all__ = [
    "Crossover",
    "CrossoverTable",
    "TABLE_PATH",
    "default_table",
    "load_table",
    "prefers_dense",
    "table_in_force",
    "use_table",
]


@dataclasses.dataclass(frozen=True)
class Crossover:
    """One kernel on one device: above ``crossover`` block density the dense product is faster.

    Attributes:
      platform: the lowering platform, "cpu" or "cuda".
      device_kind: ``jax.Device.device_kind`` of the device it was measured on ("cpu",
        "NVIDIA H100 80GB HBM3").
      target: the FFI target of the kernel ("jbs_bsmm_fprop", "jbs_bsmm_updat_sm90", ...).
      mode: the kernel's arithmetic: "float32", "tf32", "bfloat16" or "float16".
      block_size: 8, 16, 32, 64 or 128.
      crossover: a density in [0, 1]: the kernel runs for block capacities up to it.
      source: the benchmark result it was computed from (a path under bench/results/).
    """

    platform: str
    device_kind: str
    target: str
    mode: str
    block_size: int
    crossover: float
    source: str = ""

    def __post_init__(self):
        for name in ("platform", "device_kind", "target", "mode", "source"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Crossover: {name} must be a str, got {getattr(self, name)!r}")
        if self.mode not in MODES:
            raise ValueError(f"Crossover: mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"Crossover: block_size must be a positive int, got {self.block_size!r}")
        c = self.crossover
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or not 0.0 <= c <= 1.0:
            raise ValueError(f"Crossover: crossover must be a density in [0, 1], got {c!r}")
        object.__setattr__(self, "crossover", float(c))

    @property
    def key(self) -> tuple:
        return (self.platform, self.device_kind, self.target, self.mode, self.block_size)


@dataclasses.dataclass(frozen=True)
class CrossoverTable:
    """The crossovers of some kernels on some devices (hashable: a jit cache key).

    Attributes:
      entries: the :class:`Crossover` entries, at most one per key (platform, device
        kind, target, mode, block size). Empty: ``"auto"`` never picks the dense product.
    """

    entries: tuple[Crossover, ...] = ()

    def __post_init__(self):
        entries = tuple(self.entries)
        if not all(isinstance(e, Crossover) for e in entries):
            raise TypeError("CrossoverTable: entries must be Crossover instances (see CrossoverTable.from_entries)")
        keys = [e.key for e in entries]
        dupes = sorted({k for k in keys if keys.count(k) > 1})
        if dupes:
            raise ValueError(f"CrossoverTable: more than one entry for {dupes}")
        object.__setattr__(self, "entries", tuple(sorted(entries, key=lambda e: e.key)))

    @classmethod
    def from_entries(cls, entries: Iterable[Crossover | Mapping]) -> CrossoverTable:
        """A table from :class:`Crossover` objects or dicts of their fields."""
        return cls(tuple(e if isinstance(e, Crossover) else Crossover(**e) for e in entries))

    @classmethod
    def from_json(cls, data: Mapping) -> CrossoverTable:
        """A table from the JSON form (:meth:`to_json`): ``{"format": 1, "entries": [...]}``."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT or "entries" not in data:
            raise ValueError(f"CrossoverTable.from_json: need a mapping with format {FORMAT} and entries")
        return cls.from_entries(data["entries"])

    def to_json(self, **extra) -> dict:
        """The JSON form: ``{"format": 1, **extra, "entries": [{field: value}, ...]}``."""
        return {"format": FORMAT, **extra, "entries": [dataclasses.asdict(e) for e in self.entries]}

    def lookup(self, platform: str, device_kind: str | None, target: str, mode: str, block_size: int):
        """The crossover density of that kernel on that device, or None where unmeasured."""
        return self._index().get((platform, device_kind, target, mode, block_size))

    def for_device(self, platform: str, device_kind: str | None) -> tuple[Crossover, ...]:
        """The entries of one device."""
        return tuple(e for e in self.entries if (e.platform, e.device_kind) == (platform, device_kind))

    def _index(self) -> dict:
        return _index_of(self.entries)


@functools.lru_cache(maxsize=64)
def _index_of(entries: tuple[Crossover, ...]) -> dict:
    return {e.key: e.crossover for e in entries}


def load_table(path: str | os.PathLike) -> CrossoverTable:
    """Reads a table written by ``bench/crossover.py`` (or :meth:`CrossoverTable.to_json`)."""
    with open(path) as f:
        return CrossoverTable.from_json(json.load(f))


@functools.cache
def default_table() -> CrossoverTable:
    """The table shipped with the package (``crossovers.json``); empty if it is missing."""
    if not TABLE_PATH.exists():
        return CrossoverTable()
    return load_table(TABLE_PATH)


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
) -> bool:
    """Whether ``"auto"`` computes a product densely instead of with ``target``.

    True where the table in force (or ``table``) has an entry for the kernel on that
    device and ``block_fraction`` (the layout's capacity over its grid) exceeds it.
    """
    table = table_in_force() if table is None else table
    crossover = table.lookup(platform, device_kind, target, mode, block_size)
    return crossover is not None and block_fraction > crossover
