"""Multi-host data-parallel training, on one machine: two ``jax.distributed`` processes.

tests/multihost_train.py runs as two processes of one job (coordinator on 127.0.0.1 at a
free port, CPU collectives through gloo, 2 host CPU devices each, a 2 x 2 global mesh)
and once as a single process with 4 devices, on the same global batches. The job trains
a block-sparse MLP on the CPU kernels: a dynamic layer whose layout RigL moves, a
column-parallel layer split over the mesh's "model" axis, the batch over "data". Both
processes must end with the single process's parameters and layouts, bit for bit: the
partitioned program is the same, and a 2-way sum is the same in any order.
"""

import re
import sys

import numpy as np

import children
from helpers import require_kernels

TIMEOUT = 300  # seconds for the whole job (about 30 s on 2 idle cores)
# XLA's optimisation passes off in every child: compiles about 25% faster; the
# partitioning and the collectives are the same, and so is the setting on both sides.
FAST_COMPILES = {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
# A coordinator that could not bind its port (taken since free_port looked): try another.
PORT_TAKEN = re.compile(r"address already in use|failed to add port|bind", re.IGNORECASE)


def _distributed_run(out: str, num_processes: int = 2):
    for _attempt in range(3):
        coordinator = f"127.0.0.1:{children.free_port()}"
        commands = [
            children.script(
                "multihost_train.py",
                "--out",
                out,
                "--coordinator",
                coordinator,
                "--num-processes",
                num_processes,
                "--process-id",
                i,
            )
            for i in range(num_processes)
        ]
        envs = [children.environment(cpu_devices=2, **FAST_COMPILES)] * num_processes
        results = children.run_together(commands, envs, timeout=TIMEOUT)
        if all(r.ok for r in results) or not any(PORT_TAKEN.search(r.output) for r in results):
            return results
    return results


def test_two_processes_train_as_one(tmp_path):
    require_kernels("cpu")
    distributed = _distributed_run(str(tmp_path / "multi"))
    assert all(r.ok for r in distributed), "the 2-process job failed:\n" + children.report(distributed)
    single = children.run_together(
        [children.script("multihost_train.py", "--out", tmp_path / "single")],
        [children.environment(cpu_devices=4, **FAST_COMPILES)],
        timeout=TIMEOUT,
    )
    assert single[0].ok, "the single-process run failed:\n" + children.report(single)

    want = dict(np.load(tmp_path / "single.0.npz"))
    params = [k for k in want if k.startswith("['params']")]
    assert len(params) == 6, sorted(want)  # fc1, fc2 (column-parallel), head: kernel and bias each
    # The training step ran the CPU kernels' three products (fprop, bprop, updat).
    targets = " ".join(want["custom_call_targets"])
    assert all(re.search(rf"bsmm\w*{p}", targets) for p in ("fprop", "bprop", "updat")), targets
    # RigL moved blocks of the dynamic layer (same count, new places).
    moved, initial = want["['mask:fc1/kernel']"], want["initial_mask:fc1/kernel"]
    assert moved.sum() == initial.sum() and (moved != initial).any()

    for process in range(2):
        got = dict(np.load(tmp_path / f"multi.{process}.npz"))
        assert sorted(got) == sorted(want)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"process {process}: {key}")


def test_a_failing_process_ends_the_job_and_is_reported():
    """The launcher itself: a process that fails stops its peers after the grace period
    (a peer blocked on it must not hang the suite), and the report names both."""
    env = children.environment(cpu_devices=1)
    failing = [sys.executable, "-c", "import sys; print('lost the coordinator'); sys.exit(3)"]
    waiting = [sys.executable, "-c", "import time; time.sleep(60)"]
    results = children.run_together([failing, waiting], [env, env], timeout=60, grace=1)
    assert [r.returncode for r in results] == [3, None] and results[1].killed == "peer failed"
    assert results[1].seconds < 30
    message = children.report(results)
    assert "[exit 3]" in message and "lost the coordinator" in message and "killed (peer failed)" in message
    slow = children.run_together([waiting], [env], timeout=1)
    assert slow[0].killed == "timeout" and slow[0].returncode is None
