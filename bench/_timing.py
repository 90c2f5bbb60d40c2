"""Timing a product on a device, and the ceilings that bound it.

Two times per product (bench/bsmm.py's rows; bench/attention.py and bench/bsconv.py use
the first): back-to-back calls of a jitted function (:func:`time_calls`, per call), and a
data-dependent chain of ``k`` calls inside one jitted function (:func:`chained`,
:func:`time_chain`, per op), which keeps a call's host work below its device work. Every
time is in seconds (float). The roofline (:func:`roofline`) bounds a product from this
run's own ceilings: the dense product's measured rate and the memory bandwidth
(:func:`measure_bandwidth`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_blocksparse.tune import median_call_time


def time_calls(fn, *args, repeats: int, min_time: float = 0.05, max_inner: int = 1000) -> float:
    """Median seconds per call of ``fn(*args)``: calls dispatched back to back, then blocked on
    (:func:`jax_blocksparse.tune.median_call_time`: ``tune``'s sampling, whose median a row
    reports; ``tune`` itself keeps the fastest sample).

    This is device time only while a call's host work is shorter than its device work;
    otherwise it is host time (see :func:`time_chain`).
    """
    return median_call_time(fn, *args, repeats=repeats, min_time=min_time, max_inner=max_inner)


def time_fn(fn, *args, repeats: int, min_time: float = 0.2) -> float:
    """Back-to-back calls, per call (kept for bench/bsconv.py)."""
    return time_calls(fn, *args, repeats=repeats, min_time=min_time, max_inner=200)


def _feed(a, out):
    """The next input of a chain: ``out`` itself where it fits, else ``a`` with one element of
    ``out`` written in (in place after the first link: one tiny kernel)."""
    if out.shape == a.shape and out.dtype == a.dtype:
        return out
    if out.size == 0:  # an empty layout: nothing to chain through
        return a
    return a.at[(0,) * a.ndim].set(out.reshape(-1)[0].astype(a.dtype))


def chained(fn, k: int):
    """``fn`` applied k times, each call's first argument computed from the previous output."""

    def run(a, *rest):
        out = fn(a, *rest)
        for _ in range(k - 1):
            a = _feed(a, out)
            out = fn(a, *rest)
        return out

    return run


def time_chain(chain_fn, k: int, *args, repeats: int, min_time: float) -> float:
    """Device seconds per op: back-to-back calls of a jitted k-op chain, divided by k."""
    return time_calls(chain_fn, *args, repeats=repeats, min_time=min_time) / k


def problem_cost(op, c, k, n, density, dtype) -> tuple[float, float]:
    """(FLOPs, bytes) of one product at ``density``: the multiply-adds of the present
    blocks, and each operand read once and the result written once (the stored blocks
    are ``density`` of the dense weight)."""
    item = np.dtype(dtype).itemsize
    weight = c * k * item * density
    acts = (n * c + n * k) * item  # fprop: x in, y out; bprop: dy in, dx out; updat: x, dy in
    return 2.0 * n * c * k * density, acts + weight


def roofline(op, c, k, n, density, dtype, *, dense_s, bandwidth) -> dict:
    """The floor of one product from this run's own ceilings: its FLOPs at the dense
    product's measured rate (``2 N C K / dense_s``) and its bytes at the measured memory
    bandwidth; the larger of the two times is the floor. Returns ``roofline_s`` (None
    where a ceiling is missing) and ``roofline_speedup_bound`` (``dense_s / roofline_s``:
    the best speedup over dense a perfect kernel could reach)."""
    if not dense_s or not bandwidth:
        return dict(roofline_s=None, roofline_speedup_bound=None)
    flops, nbytes = problem_cost(op, c, k, n, density, dtype)
    rate = 2.0 * n * c * k / dense_s
    floor = max(flops / rate, nbytes / bandwidth)
    return dict(roofline_s=floor, roofline_speedup_bound=dense_s / floor)


def measure_bandwidth(device, *, nbytes: int = 1 << 30, repeats: int = 3) -> float | None:
    """Device memory bandwidth in bytes/s (bytes read plus bytes written) of one large
    elementwise update on ``device``: the median of back-to-back single calls (one pass
    over ``nbytes`` takes far longer than a dispatch; a chain of them in one program would
    be fused into a single pass by XLA). None where it fails."""
    try:
        n = nbytes // 4
        a = jax.device_put(jnp.zeros((n,), jnp.float32), device)
        per_call = time_calls(jax.jit(lambda v: v + 1.0), a, repeats=repeats, min_time=0.02)
        return 2.0 * n * 4 / per_call
    except Exception:  # noqa: BLE001 - the roofline is optional
        return None
