"""The layout-change log: blocks pruned and grown per layer at one update.

:class:`LayoutChangeLog` is a pytree of small int32 arrays (so a jitted update can
return it) whose layer names, capacities and grid sizes are static. On the host,
:meth:`LayoutChangeLog.rows` turns it into one dict per layer, :func:`log_rows`
does that for a list of logs, and :func:`format_log` prints them as a table.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import numpy as np

FIELDS = ("nnz_before", "pruned", "grown", "nnz_after")


@jax.tree_util.register_pytree_node_class
class LayoutChangeLog:
    """What one layout update did, per layer.

    Leaves (int32 arrays): ``step`` (scalar, the training step of the update) and
    ``nnz_before``, ``pruned``, ``grown``, ``nnz_after`` ([num_layers] block counts;
    ``nnz_after == nnz_before - pruned + grown``).

    Static attributes:
      names: layer names ("/"-joined parameter paths, e.g. "layer0/kernel").
      capacities: each layer's number of storage slots.
      grid_sizes: each layer's number of blocks in the grid (CB * KB).
    """

    __slots__ = ("step", "nnz_before", "pruned", "grown", "nnz_after", "names", "capacities", "grid_sizes")

    def __init__(self, step, nnz_before, pruned, grown, nnz_after, names, capacities, grid_sizes):
        self.step = step
        self.nnz_before = nnz_before
        self.pruned = pruned
        self.grown = grown
        self.nnz_after = nnz_after
        self.names = tuple(names)
        self.capacities = tuple(int(c) for c in capacities)
        self.grid_sizes = tuple(int(g) for g in grid_sizes)

    def tree_flatten(self):
        leaves = (self.step, self.nnz_before, self.pruned, self.grown, self.nnz_after)
        return leaves, (self.names, self.capacities, self.grid_sizes)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(*leaves, *aux)

    def rows(self) -> list[dict]:
        """One dict per layer: step, layer, nnz_before, pruned, grown, nnz_after,
        capacity, density_before, density_after (host values)."""
        step = int(np.asarray(self.step))
        arrays = {f: np.asarray(getattr(self, f)) for f in FIELDS}
        out = []
        for i, name in enumerate(self.names):
            row = {"step": step, "layer": name}
            row.update({f: int(arrays[f][i]) for f in FIELDS})
            row["capacity"] = self.capacities[i]
            size = max(self.grid_sizes[i], 1)
            row["density_before"] = row["nnz_before"] / size
            row["density_after"] = row["nnz_after"] / size
            out.append(row)
        return out

    def totals(self) -> dict:
        """Global counts over all layers (host values)."""
        return {f: int(np.asarray(getattr(self, f)).sum()) for f in FIELDS}

    def __repr__(self):
        try:
            return format_log([self])
        except Exception:  # traced leaves
            return f"LayoutChangeLog(names={self.names})"


def log_rows(logs: Iterable[LayoutChangeLog]) -> list[dict]:
    """All rows of several logs (e.g. the logs of every update of a run)."""
    rows = []
    for log in logs:
        rows.extend(log.rows())
    return rows


def format_log(logs, *, total: bool = True) -> str:
    """A fixed-width table of ``log_rows(logs)``; with ``total``, one total line per update."""
    if isinstance(logs, LayoutChangeLog):
        logs = [logs]
    header = (
        f"{'step':>7} {'layer':<24} {'before':>7} {'pruned':>7} {'grown':>7} {'after':>7} {'cap':>6} {'density':>8}"
    )
    lines = [header]
    for log in logs:
        for r in log.rows():
            lines.append(
                f"{r['step']:>7} {r['layer']:<24} {r['nnz_before']:>7} {r['pruned']:>7} {r['grown']:>7} "
                f"{r['nnz_after']:>7} {r['capacity']:>6} {r['density_after']:>8.4f}"
            )
        if total and len(log.names) > 1:
            t = log.totals()
            size = max(sum(log.grid_sizes), 1)
            lines.append(
                f"{int(np.asarray(log.step)):>7} {'(all layers)':<24} {t['nnz_before']:>7} {t['pruned']:>7} "
                f"{t['grown']:>7} {t['nnz_after']:>7} {sum(log.capacities):>6} {t['nnz_after'] / size:>8.4f}"
            )
    return "\n".join(lines)
