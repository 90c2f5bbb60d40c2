"""Type stub of the native extension built from cuda/module.cc (see CMakeLists.txt).

The module holds the XLA FFI handlers of the CPU kernels and, when built for CUDA
architectures, of the CUDA kernels; ``jax_blocksparse._native`` registers them with JAX.
"""

from typing import Literal, TypedDict

from typing_extensions import CapsuleType

class _Sm90Facts(TypedDict):
    # what the Hopper kernels of these sources do (cuda/sm90/bsmm_sm90_plan.h and
    # bsmm_sm90_tf32.h), in every build: the SM count the updat workspace is sized for,
    # op ("fprop", "bprop", "updat") -> block sizes with float32 on TF32, op -> {block
    # size -> why TF32 is off there}, the rows a TF32 updat pads n to a multiple of, the
    # kernel variants (bsmm_sm90_variants.h: op -> variant -> mode -> block sizes it runs)
    # and the capped updat variant's workspace budget in bytes
    plan_sms: int
    tf32_block_sizes: dict[str, tuple[int, ...]]
    tf32_off: dict[str, dict[int, str]]
    tf32_row_multiple: int
    variants: dict[str, dict[str, dict[str, tuple[int, ...]]]]
    updat_capped_workspace_bytes: int

class _BuildInfo(TypedDict, total=False):
    # the instruction set the CPU kernels run (JAX_BLOCKSPARSE_CPU_ISA may name a lower one
    # than detected), the widest this CPU and build support, and why the variable cannot
    # be honoured (None when it is unset or valid)
    cpu_isa: Literal["baseline", "avx2", "avx512", "avx512_bf16", "amx"]
    cpu_isa_detected: Literal["baseline", "avx2", "avx512", "avx512_bf16", "amx"]
    cpu_isa_error: str | None
    # every instruction set's name, from the lowest to the widest
    cpu_isas: tuple[str, ...]
    cuda: bool
    cuda_version: str
    cudart_version: int
    cudart_runtime_version: int
    archs: list[str]
    # the table the kernels were built from (jax_blocksparse/block_sizes.json)
    block_sizes: tuple[int, ...]
    sm90: _Sm90Facts

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

def amx_peak_probe(steps: int) -> float | None:
    """FLOPs of ``steps`` x 4 AMX TDPBF16PS on operands held in the tiles, run on the calling
    thread with the GIL released (None where the CPU or build has no AMX): timed, the
    unit's peak; one call per core at once, the machine's."""

def build_info() -> _BuildInfo:
    """Facts about this build: CPU instruction set in use, CUDA version and architectures, block sizes,
    the Hopper kernels' plan and TF32 tables."""

def work_plan_dsd(
    rows: int, tile_m: int, seg_ptr: list[int], order: list[int], pack: int
) -> list[tuple[int, int, int, int, list[tuple[int, list[int]]]]]:
    """DSD work items in launch order: (m_tile, group, row_begin, row_end, [(output, [entry or -1 per step])])."""

def work_plan_dsd_stacked(
    rows: int, tile_m: int, work_ptr: list[int], order: list[int], capacity: int, depth: int
) -> list[tuple[int, int, int, int, list[list[int]]]]:
    """Stacked DSD work items in launch order: (m_tile, output, row_begin, row_end, steps), each step a list
    of work-list entries (-1 past the output's end), one per member."""

def work_plan_sdd(capacity: int, group: int, n: int, tile_n: int, num_sms: int, bs: int) -> _SddPlan:
    """SDD plan: splits, split_len, workspace_elems and items (slot_begin, slot_end, n_begin, n_end, split)."""

def persistent_grid(items: int, num_sms: int, ctas_per_sm: int) -> int:
    """CTAs of a persistent launch over ``items`` work items."""

def dsd_pack_for(bs: int) -> int:
    """Outputs packed per DSD tile at block size ``bs``."""

def sm90_updat_workspace_bytes(
    dtype: str,
    n: int,
    cb: int,
    kb: int,
    capacity: int,
    bs: int,
    tf32: bool = False,
    num_sms: int = ...,
    variant: str = "baseline",
) -> int:
    """Bytes of the jbs_bsmm_updat_sm90 workspace (SddWorkspaceBytes) for x [n, cb * bs], dy [n, kb * bs]
    and dw [capacity, bs, bs] of ``dtype`` ("float32", "float16", "bfloat16"); 0 where the split plan
    needs none. ``num_sms`` defaults to ``build_info()["sm90"]["plan_sms"]``; ``variant`` "capped": the
    splits capped so that it fits ``updat_capped_workspace_bytes``."""
