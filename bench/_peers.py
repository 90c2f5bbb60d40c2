"""Peer libraries on a bench/bsmm.py product, where importable (GPU only): torch's BSR
kernels and ``jax.experimental.sparse`` BCOO.

``torch_bsr``: Triton ``bsr_dense_mm`` for fprop and bprop, ``sampled_addmm`` for updat;
device time from a CUDA graph of chained calls (``torch_bsr_method`` says which way it was
measured). ``jax_bcoo``: element-sparse BCOO, fprop only. Each answers seconds (float) or
None where the library is missing or fails; nothing here raises.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/_timing.py, also when loaded by path
from _timing import time_calls  # noqa: E402

#: The peers a run may time (``--peers``).
PEERS = ("torch_bsr", "jax_bcoo")


def _torch_time(fn, *, repeats, min_time, chain):
    """(device s, call s, method) of a torch callable on the current CUDA device.

    Call time: back-to-back calls timed with CUDA events. Device time: a CUDA graph of
    up to ``chain`` calls, replayed (no host work between kernels); where capture fails,
    the call time ("calls").
    """
    import torch

    def timed(run, inner):
        samples = []
        for _ in range(max(1, repeats)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return float(np.median(samples))

    fn()  # compile (Triton) and warm up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-7)
    if one > 0.05:  # host overhead is noise at this length: one more call, no graph
        call_s = timed(fn, 1)
        return call_s, call_s, "calls (slow: no graph)"
    call_s = timed(fn, int(min(max(1, min_time / one), 1000)))
    k = int(min(max(1, 0.02 / max(call_s, 1e-7)), chain))  # a replay of at most ~20 ms
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's capture-unsafe calls fail (XLA's threads are left alone)
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(k):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        replay_s = timed(graph.replay, int(min(max(1, min_time / max(call_s * k, 1e-7)), 1000)))
        return replay_s / k, call_s, f"cuda_graph({k})"
    except Exception as e:  # capture is optional: fall back to the call time
        torch.cuda.synchronize()
        return call_s, call_s, f"calls (graph capture failed: {type(e).__name__})"


def torch_bsr_peer(op, c, k, n, bs, mask, dtype, *, repeats, min_time, chain):
    """torch's BSR kernels on op's problem: dict of torch_bsr_* fields, or {} where unavailable."""
    try:
        import torch
        from torch.sparse._triton_ops import bsr_dense_mm, sampled_addmm

        if not torch.cuda.is_available():
            return {}
    except Exception:
        return {}
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    try:
        block_mask = torch.from_numpy(np.kron(np.asarray(mask, bool), np.ones((bs, bs), bool))).cuda()  # [C, K]
        W = torch.randn(c, k, device="cuda", dtype=tdtype) * block_mask
        if op == "fprop":  # y.T [K, N] = W.T [K, C] @ x.T [C, N]
            bsr = W.t().contiguous().to_sparse_bsr((bs, bs))
            rhs = torch.randn(n, c, device="cuda", dtype=tdtype).t().contiguous()

            def fn():
                return bsr_dense_mm(bsr, rhs)
        elif op == "bprop":  # dx.T [C, N] = W [C, K] @ dy.T [K, N]
            bsr = W.to_sparse_bsr((bs, bs))
            rhs = torch.randn(n, k, device="cuda", dtype=tdtype).t().contiguous()

            def fn():
                return bsr_dense_mm(bsr, rhs)
        else:  # dW [C, K] at the blocks = x.T [C, N] @ dy [N, K]
            pattern = W.to_sparse_bsr((bs, bs))
            xt = torch.randn(n, c, device="cuda", dtype=tdtype).t().contiguous()
            dy = torch.randn(n, k, device="cuda", dtype=tdtype)

            def fn():
                return sampled_addmm(pattern, xt, dy, beta=0.0, alpha=1.0)

        device_s, call_s, method = _torch_time(fn, repeats=repeats, min_time=min_time, chain=chain)
        return dict(torch_bsr_s=device_s, torch_bsr_call_s=call_s, torch_bsr_method=method)
    except Exception as e:
        return dict(torch_bsr_s=None, torch_bsr_error=f"{type(e).__name__}: {str(e)[:200]}")


def jax_bcoo_peer(x, W_masked, *, repeats, min_time):
    """jax.experimental.sparse BCOO (element-sparse) x @ W: seconds per call, or None."""
    try:
        from jax.experimental import sparse as jsparse

        W_bcoo = jsparse.BCOO.fromdense(W_masked)
        fn = jax.jit(lambda x, W: x @ W)
        return time_calls(fn, x, W_bcoo, repeats=repeats, min_time=min_time)
    except Exception:
        return None


def peer_versions(peers) -> dict:
    """``{"torch": version}`` where ``"torch_bsr"`` is among ``peers`` (None where torch
    does not import), else ``{}``."""
    if "torch_bsr" not in peers:
        return {}
    try:
        import torch

        return {"torch": torch.__version__}
    except Exception:
        return {"torch": None}
