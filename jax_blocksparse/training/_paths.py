"""Pairing layouts with the leaves they describe, by pytree path.

Layouts live beside the parameters, in a pytree whose paths mirror the parameter
paths: a :class:`~jax_blocksparse.Layout` at path ``P`` describes the per-block
leaves at path ``P``. Two spellings are understood so that the same code serves
linen variable collections, plain dicts and nnx states:

* ``P`` is the path of the parameter itself (linen: ``variables["layout"]`` mirrors
  ``variables["params"]``, both ``{"layer0": {"kernel": ...}}``);
* the last key of ``P`` is ``<name>_layout`` and describes ``<name>`` beside it
  (nnx: attribute ``kernel_layout`` next to ``kernel``).

Path keys compare by name (dict key, attribute name or sequence index, as
strings); a trailing ``.value`` attribute (an nnx ``Variable`` wrapper) is ignored.
A leaf of any other tree (an optax state) belongs to a layout when its path *ends
with* the layout's parameter path (longest match wins) and its leading dimension
is the layout's capacity: so ``mu`` and ``nu`` of Adam, inside any chain, wrapper
or nnx optimizer, are found without knowing the optimizer.
"""

from __future__ import annotations

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

from jax_blocksparse.layout import Layout

LAYOUT_SUFFIX = "_layout"


def is_layout(x) -> bool:
    return isinstance(x, Layout)


def key_name(key) -> str:
    if isinstance(key, DictKey):
        return str(key.key)
    if isinstance(key, GetAttrKey):
        return key.name
    if isinstance(key, SequenceKey):
        return str(key.idx)
    if isinstance(key, FlattenedIndexKey):
        return str(key.key)
    return str(key)


def normalize(path) -> tuple[str, ...]:
    """Key names of a pytree path, without a trailing nnx ``.value``."""
    if path and isinstance(path[-1], GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return tuple(key_name(k) for k in path)


def target_of_layout(path) -> tuple[str, ...]:
    """The (normalised) path of the leaves described by the layout at ``path``."""
    names = normalize(path)
    if names and names[-1].endswith(LAYOUT_SUFFIX) and len(names[-1]) > len(LAYOUT_SUFFIX):
        names = names[:-1] + (names[-1][: -len(LAYOUT_SUFFIX)],)
    return names


def path_string(names: tuple[str, ...]) -> str:
    return "/".join(names)


def layout_leaves(layouts) -> list[tuple[tuple[str, ...], Layout]]:
    """[(target path, layout)] for every Layout in ``layouts``, in pytree order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(layouts, is_leaf=is_layout)
    out = []
    for path, leaf in flat:
        if is_layout(leaf):
            out.append((target_of_layout(path), leaf))
    return out


def named_layouts(layouts) -> list[tuple[str, Layout]]:
    """[("layer0/kernel", layout), ...]: every Layout of ``layouts`` with the "/"-joined
    path of the leaves it describes (the names used in the layout-change log)."""
    return [(path_string(p), l) for p, l in layout_leaves(layouts)]


def map_layouts(fn, layouts, *rest):
    """Replaces every Layout leaf ``l`` of ``layouts`` by ``fn(l, *matching leaves of rest)``."""
    return jax.tree.map(fn, layouts, *rest, is_leaf=is_layout)


def match(names: tuple[str, ...], targets) -> int | None:
    """Index of the longest target path that ``names`` ends with, or None."""
    best, best_len = None, -1
    for i, target in enumerate(targets):
        n = len(target)
        if n <= len(names) and names[len(names) - n :] == target and n > best_len:
            best, best_len = i, n
    return best
