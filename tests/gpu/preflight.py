"""The first step of tests/gpu/check.sh: what this GPU machine can do, within seconds.

- **The GPU**: name, driver and compute capability (nvidia-smi).
- **The CUTLASS headers** the sm_90a kernels compile against (the ``nvidia-cutlass``
  package). Where they are not importable, a wheel carried in ``.whl/`` (the device tool's
  ``carry``) is unpacked into ``.whl/site`` (pip's output goes into the log). Without
  them the check says so at once and builds the portable kernels alone, for the machine's
  own architecture (``sm_90`` on an H100/H200: ``sm_80`` machine code does not load on
  compute capability 9.0), so the call still measures and verifies something.
- **The tools**: a ten-line CUDA program, compiled here, run under
  ``compute-sanitizer --tool memcheck`` and under ``ncu``. A tool that is on the PATH but
  fails on this machine's runtime (seen on gVisor: "Device not supported",
  "LibraryNotLoaded") is ``unavailable``, not failed; one that is not installed is
  ``absent``.

Writes ``OUTDIR/preflight.json`` (everything above), ``OUTDIR/preflight.env`` (shell
assignments check.sh reads: ``PREFLIGHT_ARCH``, ``PREFLIGHT_CUTLASS``,
``PREFLIGHT_SANITIZER``, ``PREFLIGHT_NCU``) and prints one line per finding. The wheels are
looked for in ``JBS_WHEEL_DIR`` where that is set; ``JBS_CUTLASS_MODULE`` names another module
to look for instead of ``cutlass_library`` (the tests' way to play a machine without it).

Usage::

    python3 tests/gpu/preflight.py --out OUTDIR [--arch sm_90a]

Exit status 0 when the machine can build and run something (a GPU is there), else 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("JBS_WHEEL_DIR") or REPO / ".whl")  # where the device call carries wheels
SITE = WHEELS / "site"
CUTLASS_HINT = (
    "carry the wheel: here, python3 -m pip download --no-deps 'nvidia-cutlass>=4.2' -d .whl, "
    "then name '.whl' in the device call's carry"
)
PROBE_SOURCE = r"""
#include <cstdio>
__global__ void fill(float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 2.0f * i;
}
int main() {
  const int n = 1 << 12;
  float* out = nullptr;
  if (cudaMalloc(&out, n * sizeof(float)) != cudaSuccess) return 2;
  fill<<<(n + 255) / 256, 256>>>(out, n);
  cudaError_t err = cudaDeviceSynchronize();
  cudaFree(out);
  std::printf("probe: %s\n", cudaGetErrorString(err));
  return err == cudaSuccess ? 0 : 3;
}
"""


def _command(cmd, *, timeout: float, env=None) -> tuple[int | None, str]:
    """(exit status or None on timeout / not found, stdout + stderr)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        return out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as err:
        text = (err.stdout or b"") + (err.stderr or b"")
        return None, text.decode(errors="replace") if isinstance(text, bytes) else text
    except OSError as err:
        return None, str(err)


def arch_of(compute_cap: str | None, cutlass: bool) -> str | None:
    """The build's --cuda-arch for a compute capability: sm_90a on 9.0 with the CUTLASS
    headers (the Hopper kernels need both), sm_90 without them, sm_XY elsewhere."""
    if not compute_cap or "." not in compute_cap:
        return None
    major, minor = compute_cap.split(".", 1)
    if not (major.isdigit() and minor.isdigit()):
        return None
    if (major, minor) == ("9", "0"):
        return "sm_90a" if cutlass else "sm_90"
    return f"sm_{major}{minor}"


def gpu_facts() -> dict:
    if shutil.which("nvidia-smi") is None:
        return dict(present=False, why="nvidia-smi not found")
    rc, text = _command(
        ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,memory.total", "--format=csv,noheader"],
        timeout=20,
    )
    line = text.strip().splitlines()[0] if rc == 0 and text.strip() else ""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 3:
        return dict(present=False, why=f"nvidia-smi gave no GPU (exit {rc}): {text.strip()[:200]}")
    return dict(present=True, name=parts[0], driver=parts[1], compute_cap=parts[2], memory=",".join(parts[3:]))


def _cutlass_importable(env) -> tuple[bool, str]:
    module = os.environ.get("JBS_CUTLASS_MODULE", "cutlass_library")  # another name: tests/test_gpu_session.py
    rc, text = _command([sys.executable, "-c", f"import {module} as m; print(m.__file__)"], timeout=60, env=env)
    return rc == 0, text.strip().splitlines()[-1] if text.strip() else ""


def cutlass_facts(log: Path) -> dict:
    """Whether the CUTLASS headers are importable (after unpacking a carried wheel)."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), str(SITE), os.environ.get("PYTHONPATH")]))
    )
    ok, where = _cutlass_importable(env)
    if ok:
        return dict(available=True, source=where)
    wheels = sorted(WHEELS.glob("nvidia_cutlass-*.whl"))
    if not wheels:
        return dict(available=False, why=f"nvidia-cutlass is not installed and no wheel is in {WHEELS}: {CUTLASS_HINT}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--upgrade",
        "--target",
        str(SITE),
        str(wheels[-1]),
    ]
    rc, text = _command(cmd, timeout=120)
    with log.open("a") as f:  # pip's own words, errors included
        f.write(f"$ {shlex.join(cmd)}\n{text}\n(exit {rc})\n")
    ok, where = _cutlass_importable(env)
    if ok:
        return dict(available=True, source=where, wheel=wheels[-1].name)
    return dict(
        available=False, wheel=wheels[-1].name, why=f"installing {wheels[-1].name} failed (exit {rc}; see {log.name})"
    )


def probe_tool(name: str, cmd: list[str], ok_marker: str) -> dict:
    """``available`` where ``cmd`` ran the probe and printed ``ok_marker``; ``absent`` where
    the tool is not on the PATH; else ``unavailable`` with its first error line."""
    if shutil.which(cmd[0]) is None:
        return dict(status="absent", why=f"{cmd[0]} not on the PATH")
    rc, text = _command(cmd, timeout=90)
    if rc == 0 and ok_marker in text:
        return dict(status="available")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "rror" in ln or "not supported" in ln.lower() or "failed" in ln.lower()]
    why = (errors or lines or ["no output"])[0][:300]
    return dict(status="unavailable", why=f"{name} did not run the probe (exit {rc}): {why}")


def tool_facts(out: Path, arch: str | None) -> dict:
    """The sanitizer and ncu, each probed on a small CUDA program (in parallel)."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        why = "nvcc not found: no probe program"
        return dict(sanitizer=dict(status="unprobed", why=why), ncu=dict(status="unprobed", why=why))
    src = out / "tool_probe.cu"
    exe = out / "tool_probe"
    src.write_text(PROBE_SOURCE)
    arch_flag = [f"-arch={arch.removesuffix('a')}"] if arch else []
    rc, text = _command([nvcc, *arch_flag, "-o", str(exe), str(src)], timeout=120)
    if rc != 0:
        why = f"the probe did not compile (exit {rc}): {text.strip()[:300]}"
        return dict(sanitizer=dict(status="unprobed", why=why), ncu=dict(status="unprobed", why=why))
    probes = {
        "sanitizer": (
            "compute-sanitizer",
            ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99", str(exe)],
            "ERROR SUMMARY: 0 errors",
        ),
        "ncu": (
            "ncu",
            ["ncu", "--clock-control", "none", "--metrics", "gpu__time_duration.sum", "--csv", str(exe)],
            "gpu__time_duration",
        ),
    }
    with concurrent.futures.ThreadPoolExecutor(len(probes)) as pool:
        futures = {key: pool.submit(probe_tool, *args) for key, args in probes.items()}
        return {key: future.result() for key, future in futures.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--arch", default=None, help="build for this arch instead of the one the GPU and CUTLASS give")
    args = p.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "preflight_pip.log"
    gpu = gpu_facts()
    cutlass = cutlass_facts(log)
    arch = args.arch or arch_of(gpu.get("compute_cap"), cutlass["available"])
    tools = (
        tool_facts(out, arch)
        if gpu["present"]
        else {
            "sanitizer": dict(status="unprobed", why="no GPU"),
            "ncu": dict(status="unprobed", why="no GPU"),
        }
    )
    facts = dict(gpu=gpu, cutlass=cutlass, arch=arch, tools=tools)
    (out / "preflight.json").write_text(json.dumps(facts, indent=2) + "\n")
    env_lines = {
        "PREFLIGHT_ARCH": arch or "",
        "PREFLIGHT_CUTLASS": "1" if cutlass["available"] else "0",
        "PREFLIGHT_SANITIZER": tools["sanitizer"]["status"],
        "PREFLIGHT_NCU": tools["ncu"]["status"],
    }
    (out / "preflight.env").write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in env_lines.items()))

    if gpu["present"]:
        print(f"gpu: {gpu['name']}, compute capability {gpu['compute_cap']}, driver {gpu['driver']}")
    else:
        print(f"gpu: none ({gpu['why']})")
    if cutlass["available"]:
        print(f"cutlass: available ({cutlass.get('wheel') or cutlass['source']})")
    else:
        print(f"cutlass: MISSING: {cutlass['why']}")
        if arch:
            print(
                f"cutlass: building the portable (Ampere-design) kernels alone, for {arch}: no Hopper kernels this run"
            )
    print(f"arch: {arch or 'none'}")
    for name, found in tools.items():
        print(f"{name}: {found['status']}" + (f" ({found['why']})" if found.get("why") else ""))
    return 0 if gpu["present"] else 1


if __name__ == "__main__":
    sys.exit(main())
