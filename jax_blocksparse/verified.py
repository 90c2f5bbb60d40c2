"""Which native kernels ``impl="auto"`` may run: the kernels verified on the hardware.

A kernel that gives a wrong answer is worse than none, so ``"auto"`` runs a native kernel
only where it was checked against the reference on that hardware:

* **CPU**: every CPU target (:data:`CPU_TARGETS`). The whole test suite runs on the CPU
  kernels in CI, on every machine CI runs on.
* **CUDA**: the keys of the gate, ``verified_gpu.json`` in this package: per compute
  capability, the FFI targets (the portable ``jbs_bsmm_*`` and the Hopper
  ``jbs_bsmm_*_sm90``), their arithmetic mode ("bfloat16", "float16", "float32" exact,
  "tf32": float32 on TF32 tensor cores) and block sizes whose isolated GPU tests all passed
  with a clean (or unavailable) compute-sanitizer. It is data, written from a GPU check's
  results by ``bench/gpu_results.py`` (never by hand); what failed is listed with why.
  A compute capability stands for its chip: an H200 (9.0) runs what an H100 (9.0)
  passed.

``impl="kernels"`` runs the kernels whatever the gate says; ``JAX_BLOCKSPARSE_HOPPER=1``
lets the CUDA lowering pick the Hopper targets where the gate has not verified them
(ops/_sm90.py)::

    >>> from jax_blocksparse import verified
    >>> gate = verified.Gate.from_json({"format": 1, "devices": [{
    ...     "compute_capability": "9.0", "device_kinds": ["NVIDIA H100 80GB HBM3"],
    ...     "passed": {"jbs_bsmm_fprop_sm90": {"bfloat16": [64, 128]}},
    ...     "failed": [{"target": "jbs_bsmm_fprop_sm90", "mode": "tf32", "block_size": 8,
    ...                 "why": "test_tf32_rows[8-fprop-1] failed"}]}]})
    >>> gate.allows("9.0", "jbs_bsmm_fprop_sm90", "bfloat16", 128)
    True
    >>> gate.allows("8.0", "jbs_bsmm_fprop_sm90", "bfloat16", 128)
    False
    >>> gate.why_not("9.0", "jbs_bsmm_fprop_sm90", "tf32", 8)
    'test_tf32_rows[8-fprop-1] failed'
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from pathlib import Path

GATE_PATH = Path(__file__).resolve().with_name("verified_gpu.json")
FORMAT = 1
MODES = ("bfloat16", "float16", "float32", "tf32")

#: The CPU kernels' FFI targets (short names): all verified by CI's suite, on every machine.
CPU_TARGETS: frozenset[str] = frozenset(
    {"jbs_bsmm_fprop", "jbs_bsmm_bprop", "jbs_bsmm_updat", "jbs_bsconv", "jbs_bsconv_wgrad"}
)

__all__ = ["CPU_TARGETS", "GATE_PATH", "Device", "Gate", "default_gate"]


@dataclasses.dataclass(frozen=True)
class Device:
    """What one compute capability passed (and failed) in a GPU check.

    Attributes:
      compute_capability: "9.0", "8.0", ...
      device_kinds: the ``device_kind`` of the GPUs it was checked on.
      passed: target -> mode -> block sizes whose tests all passed.
      failed: ((target, mode, block size), why) for each key that did not pass.
      source, date, commit: where the results are (a file under bench/results/), when
        and at which commit they were measured.
      sanitizer: "clean" or "unavailable" (compute-sanitizer did not run on that machine).
    """

    compute_capability: str
    device_kinds: tuple[str, ...] = ()
    passed: Mapping[str, Mapping[str, tuple[int, ...]]] = dataclasses.field(default_factory=dict)
    failed: tuple[tuple[tuple[str, str, int], str], ...] = ()
    source: str = ""
    date: str = ""
    commit: str = ""
    sanitizer: str = ""

    @classmethod
    def from_json(cls, data: Mapping) -> Device:
        cc = data.get("compute_capability")
        if not isinstance(cc, str) or "." not in cc:
            raise ValueError(f"verified gate: compute_capability must be a str like '9.0', got {cc!r}")
        passed = {}
        for target, modes in (data.get("passed") or {}).items():
            for mode, sizes in modes.items():
                if mode not in MODES:
                    raise ValueError(f"verified gate: mode must be one of {MODES}, got {mode!r} ({target})")
                passed.setdefault(target, {})[mode] = tuple(sorted(int(bs) for bs in sizes))
        failed = tuple(
            ((f["target"], f["mode"], int(f["block_size"])), str(f.get("why", ""))) for f in data.get("failed") or ()
        )
        return cls(
            compute_capability=cc,
            device_kinds=tuple(data.get("device_kinds") or ()),
            passed=passed,
            failed=failed,
            source=str(data.get("source", "")),
            date=str(data.get("date", "")),
            commit=str(data.get("commit", "")),
            sanitizer=str(data.get("sanitizer", "")),
        )

    def to_json(self) -> dict:
        return dict(
            compute_capability=self.compute_capability,
            device_kinds=list(self.device_kinds),
            date=self.date,
            commit=self.commit,
            source=self.source,
            sanitizer=self.sanitizer,
            passed={t: {m: list(bs) for m, bs in sorted(modes.items())} for t, modes in sorted(self.passed.items())},
            failed=[dict(target=t, mode=m, block_size=bs, why=why) for (t, m, bs), why in self.failed],
        )


@dataclasses.dataclass(frozen=True)
class Gate:
    """The verified CUDA kernels, per compute capability (see the module docstring)."""

    devices: tuple[Device, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping) -> Gate:
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"verified gate: need a mapping with format {FORMAT}, got {str(data)[:80]!r}")
        devices = tuple(Device.from_json(d) for d in data.get("devices") or ())
        ccs = [d.compute_capability for d in devices]
        if len(set(ccs)) != len(ccs):
            raise ValueError(f"verified gate: one entry per compute capability, got {ccs}")
        return cls(devices)

    def to_json(self, **extra) -> dict:
        return {"format": FORMAT, **extra, "devices": [d.to_json() for d in self.devices]}

    def device(self, compute_capability: str | None) -> Device | None:
        return next((d for d in self.devices if d.compute_capability == compute_capability), None)

    def allows(self, compute_capability: str | None, target: str, mode: str, block_size: int) -> bool:
        """Whether ``target`` in ``mode`` at ``block_size`` passed on that compute capability."""
        device = self.device(compute_capability)
        return device is not None and block_size in device.passed.get(target, {}).get(mode, ())

    def verified_targets(self, compute_capability: str | None) -> frozenset[str]:
        """The targets with at least one verified key on that compute capability."""
        device = self.device(compute_capability)
        return frozenset(t for t, modes in (device.passed if device else {}).items() if any(modes.values()))

    def why_not(self, compute_capability: str | None, target: str, mode: str, block_size: int) -> str:
        """Why a key is off: the failure recorded for it, else that it was never verified."""
        device = self.device(compute_capability)
        if device is None:
            return f"no GPU check has verified compute capability {compute_capability}"
        for key, why in device.failed:
            if key == (target, mode, block_size):
                return why
        if self.allows(compute_capability, target, mode, block_size):
            return ""
        return f"not verified on compute capability {compute_capability} (no test exercised it)"


@functools.cache
def default_gate() -> Gate:
    """The gate shipped with the package (``verified_gpu.json``); empty where it is missing."""
    if not GATE_PATH.exists():
        return Gate()
    return Gate.from_json(json.loads(GATE_PATH.read_text()))
