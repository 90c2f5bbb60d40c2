"""The linen and NNX layers describe their attributes from one source.

``jax_blocksparse.layers.attribute_docs.ATTRIBUTES`` holds what each shared attribute
means; the docstrings of :mod:`jax_blocksparse.nn` and :mod:`jax_blocksparse.nnx` name
it by a ``{key}`` line that ``attribute_docs.fill`` replaces at import. Checked here:

* no docstring keeps an unfilled ``{key}`` line;
* a linen layer and its NNX twin that both document an attribute of the source say the
  same of it, the source's words;
* no file under ``nn/`` or ``nnx/`` repeats a description by hand.
"""

import inspect
import pathlib
import re

import pytest

import jax_blocksparse as jbs
from jax_blocksparse.layers import attribute_docs
from jax_blocksparse.layers.attribute_docs import ATTRIBUTES

PACKAGE = pathlib.Path(jbs.__file__).resolve().parent

# (linen, NNX) pairs: the same layer in both frameworks.
TWINS = [
    ("BlockSparseDense", "BlockSparseLinear"),
    ("BlockSparseConv", "BlockSparseConv"),
    ("BlockSparseConvTranspose", "BlockSparseConvTranspose"),
    ("ColumnParallelDense", "ColumnParallelLinear"),
    ("BlockSparseLSTMCell", "BlockSparseLSTMCell"),
    ("BlockSparseMLSTMCell", "BlockSparseMLSTMCell"),
    ("BlockSparseLSTM", "BlockSparseLSTM"),
    ("BlockSparseSelfAttention", "BlockSparseSelfAttention"),
    ("BlockSparseMoE", "BlockSparseMoE"),
    ("sparsify", "sparsify"),
    ("densify", "densify"),
]

# Attributes whose meaning follows the framework: where a linen layer keeps state in a
# variable collection an NNX layer keeps it in an attribute, and a linen attribute may be
# an NNX call's default.
FRAMEWORK_SPECIFIC = {"dynamic", "decode", "deterministic", "selection", "num_experts"}

_SECTION = re.compile(r"^(\s*)(?:Attributes|Args):\s*$")
_ENTRY = re.compile(r"^([\w*]+(?:, [\w*]+)*)(?: \([^)]*\))?: ?(.*)$")
_PLACEHOLDER = re.compile(r"^\s*\{[\w.]+(?:,\s*[\w.]+)*\}\s*$", re.MULTILINE)


def entries(doc: str) -> dict[str, str]:
    """name -> description (whitespace collapsed) of the Attributes: / Args: sections."""
    found, name, base = {}, None, None
    for line in (doc or "").splitlines():
        if _SECTION.match(line):
            name, base = None, len(_SECTION.match(line).group(1)) + 2
            continue
        if base is None or not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent < base:
            name, base = None, None
        elif indent == base and (match := _ENTRY.match(line.strip())):
            name = match.group(1)
            found[name] = match.group(2)
        elif name is not None:
            found[name] += " " + line.strip()
    return {k: " ".join(v.split()) for k, v in found.items()}


def shared(name: str) -> list[str]:
    """The source's descriptions of attributes called ``name``, whitespace collapsed."""
    return [" ".join(text.split()) for key, text in ATTRIBUTES.items() if key.rsplit(".", 1)[-1] == name]


def public_objects():
    for module in (jbs.nn, jbs.nnx):
        for name in module.__all__:
            yield f"{module.__name__}.{name}", getattr(module, name)


def test_the_parser_reads_a_docstring():
    doc = "Intro.\n\n    Attributes:\n      a: one\n        two.\n      b, c: three.\n\n    Example::\n      d: no\n"
    assert entries(doc) == {"a": "one two.", "b, c": "three."}


def test_every_placeholder_is_filled():
    left = [name for name, obj in public_objects() if _PLACEHOLDER.search(inspect.getdoc(obj) or "")]
    assert not left, f"docstrings with an unfilled {{key}} line (decorate them with attribute_docs.fill): {left}"


def test_one_line_names_several_keys():
    def f():
        """A function.

        Args:
          {use_bias, lstm.mask}
            More about the mask.
        """

    assert list(entries(attribute_docs.fill(f).__doc__)) == ["use_bias", "mask"]
    assert entries(f.__doc__)["mask"].endswith("More about the mask.")


def test_an_unknown_key_fails_at_import():
    def f():
        """Args:
        {no_such_attribute}
        """

    with pytest.raises(KeyError, match="no_such_attribute"):
        attribute_docs.fill(f)


def test_the_block_sizes_come_from_the_table():
    assert attribute_docs.block_sizes_text() in ATTRIBUTES["block_size"]
    assert all(str(bs) in attribute_docs.block_sizes_text() for bs in jbs.SUPPORTED_BLOCK_SIZES)


@pytest.mark.parametrize(("linen", "nnx"), TWINS, ids=lambda name: name)
def test_twins_agree_with_the_source(linen, nnx):
    a, b = entries(getattr(jbs.nn, linen).__doc__), entries(getattr(jbs.nnx, nnx).__doc__)
    for name in sorted(a.keys() & b.keys()):
        words = shared(name)
        from_source = [w for w in words if a[name].startswith(w) or b[name].startswith(w)]
        if not from_source:
            # Not in the source: the twins must still say the same, unless it is theirs.
            assert a[name] == b[name] or name in FRAMEWORK_SPECIFIC, (
                f"nn.{linen} and nnx.{nnx} describe {name!r} differently; describe it once in "
                f"jax_blocksparse/layers/attribute_docs.py:\n  nn:  {a[name]}\n  nnx: {b[name]}"
            )
            continue
        assert a[name].startswith(from_source[0]) and b[name].startswith(from_source[0]), (
            f"nn.{linen} and nnx.{nnx} describe {name!r} differently; write {{key}} for it in both:\n"
            f"  nn:  {a[name]}\n  nnx: {b[name]}"
        )


def test_no_description_is_copied_by_hand():
    sources = {
        path.relative_to(PACKAGE).as_posix(): " ".join(path.read_text(encoding="utf-8").split())
        for folder in ("nn", "nnx")
        for path in sorted((PACKAGE / folder).glob("*.py"))
    }
    copies = [
        f"{path}: {key}"
        for key, text in ATTRIBUTES.items()
        for path, source in sources.items()
        if len(text) > 40 and " ".join(text.split())[:60] in source
    ]
    assert not copies, f"descriptions written out again instead of {{key}} lines: {copies}"
