"""Type stub of the native extension built from cuda/module.cc (see CMakeLists.txt).

The module holds the XLA FFI handlers of the CPU kernels and, when built for CUDA
architectures, of the CUDA kernels; ``jax_blocksparse._native`` registers them with JAX.
"""

from typing import Literal, TypedDict

from typing_extensions import CapsuleType

class _BuildInfo(TypedDict, total=False):
    cpu_isa: Literal["baseline", "avx2", "avx512"]
    cuda: bool
    cuda_version: str
    cudart_version: int
    cudart_runtime_version: int
    archs: list[str]
    # op ("fprop", "bprop", "updat") -> block sizes where those targets run float32 on TF32
    # (cuda/sm90/bsmm_sm90_tf32.h); only when built for sm_90a
    sm90_tf32_block_sizes: dict[str, tuple[int, ...]]
    block_sizes: tuple[int, ...]

class _SddPlan(TypedDict):
    splits: int
    split_len: int
    workspace_elems: int
    items: list[tuple[int, int, int, int, int]]

def registrations() -> dict[str, dict[str, CapsuleType | dict[str, CapsuleType]]]:
    """Platform ("cpu", "CUDA") -> {FFI target name -> handler capsule, or {stage -> capsule}}.

    The names are the versioned targets of jax_blocksparse/targets.py
    (``jax_blocksparse_bsmm_fprop_v1``, ...); the Hopper ones (``*_sm90_v1``, CUDA) only
    in a build for sm_90a."""

def build_info() -> _BuildInfo:
    """Facts about this build: CPU instruction set in use, CUDA version and architectures."""

def work_plan_dsd(
    rows: int, tile_m: int, seg_ptr: list[int], order: list[int], pack: int
) -> list[tuple[int, int, int, int, list[tuple[int, list[int]]]]]:
    """DSD work items in launch order: (m_tile, group, row_begin, row_end, [(output, [entry or -1 per step])])."""

def work_plan_sdd(capacity: int, group: int, n: int, tile_n: int, num_sms: int, bs: int) -> _SddPlan:
    """SDD plan: splits, split_len, workspace_elems and items (slot_begin, slot_end, n_begin, n_end, split)."""

def persistent_grid(items: int, num_sms: int, ctas_per_sm: int) -> int:
    """CTAs of a persistent launch over ``items`` work items."""

def dsd_pack_for(bs: int) -> int:
    """Outputs packed per DSD tile at block size ``bs``."""
