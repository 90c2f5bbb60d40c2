"""Draws the attention layout pictures that jax_blocksparse/layouts.py's docstrings show.

    python bench/plot_attention_layouts.py            # writes docs/_static/layouts/*.png

Each picture is :func:`jax_blocksparse.layouts.plot` of one generator at n = 32 blocks
(T = 2048 at block 64), with the arguments named in its title.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax_blocksparse as jbs

OUT = Path(__file__).resolve().parents[1] / "docs" / "_static" / "layouts"
N = 32


def pictures(n: int = N) -> dict:
    """file stem -> (mask, title)."""
    L = jbs.layouts
    return {
        "local": (L.local(n, 3), "local(32, 3)"),
        "strided": (L.strided(n, 6), "strided(32, 6)"),
        "fixed": (L.fixed(n, 8, 2), "fixed(32, 8, 2)"),
        "bigbird": (L.bigbird(n, 2, 2, 2, seed=0), "bigbird(32, 2, 2, 2)"),
        "causal_fixed": (L.causal(L.fixed(n, 8, 2)), "causal(fixed(32, 8, 2))"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, (mask, title) in pictures().items():
        path = jbs.layouts.plot(mask, args.out / f"{stem}.png", title=title)
        print(path)


if __name__ == "__main__":
    main()
