"""Child Python processes for tests that need a fresh interpreter (or several at once).

:func:`run_together` starts scripts side by side (e.g. the processes of one
``jax.distributed`` job), each in its own session with its output in a file, and waits
for all of them under one deadline. It never hangs a test: a process that outlives the
deadline is killed, and when one process fails its peers get a short grace period
(a peer blocked in a collective would otherwise wait for the coordinator's heartbeat
timeout) before they are killed too. :func:`report` turns the results into a failure
message that names each command, its exit status and the tail of its output.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS)
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class Finished:
    """How one child ended: its command, exit status (None if killed), output, seconds."""

    command: list
    returncode: int | None
    output: str
    seconds: float
    killed: str = ""  # why it was killed: "timeout" or "peer failed"

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def environment(cpu_devices: int, **extra: str) -> dict:
    """This process's environment for a child on the CPU backend with ``cpu_devices`` host
    devices: XLA_FLAGS' device count replaced, JAX_PLATFORMS=cpu, the checkout and tests/
    first on PYTHONPATH, pytest-xdist's variables removed; ``extra`` added."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST_", "PYTEST_CURRENT_"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_FLAG)]
    env["XLA_FLAGS"] = " ".join(flags + [f"{_DEVICE_FLAG}={int(cpu_devices)}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, TESTS, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def script(name: str, *args) -> list:
    """The command that runs ``tests/<name>`` with this Python."""
    return [sys.executable, os.path.join(TESTS, name), *map(str, args)]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands, envs, *, timeout: float, grace: float = 30.0) -> list[Finished]:
    """Runs ``commands`` (lists of arguments) at once, ``envs[i]`` the environment of the
    i-th, and waits for all of them, ``timeout`` seconds at most in all.

    A child that fails (non-zero exit) leaves the others ``grace`` more seconds; any
    still running then, or at the deadline, is killed with its whole session.
    """
    procs, logs = [], []
    start = time.monotonic()
    try:
        for command, env in zip(commands, envs):
            log = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        deadline, killed, ended = start + timeout, [""] * len(procs), [None] * len(procs)
        while True:
            now = time.monotonic()
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = now
            if all(e is not None for e in ended):
                break
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, now + grace)
            if now >= deadline:
                for i, p in enumerate(procs):
                    if ended[i] is None:
                        killed[i] = "peer failed" if deadline < start + timeout else "timeout"
                        _kill(p)
                        p.wait()
                        ended[i] = time.monotonic()
                break
            time.sleep(0.2)
        results = []
        for command, p, log, why, end in zip(commands, procs, logs, killed, ended):
            log.seek(0)
            code = None if why else p.returncode
            results.append(Finished(list(command), code, log.read(), end - start, why))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
                p.wait()
        for log in logs:
            log.close()


def _kill(proc: subprocess.Popen):
    """SIGKILL to the child's session (it was started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def report(results, tail: int = 4000) -> str:
    """A failure message: per child its command, how it ended and its output's last lines."""
    parts = []
    for r in results:
        ended = f"killed ({r.killed}) after {r.seconds:.0f} s" if r.killed else f"exit {r.returncode}"
        parts.append(f"$ {' '.join(r.command)}\n[{ended}]\n{r.output[-tail:]}")
    return "\n\n".join(parts)
